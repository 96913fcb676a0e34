//! Issue 8, defect 1: a hostile or broken `config.json` never aborts or hangs the
//! process. Each test writes a real small random-weight checkpoint, then a config
//! that lies about one value, and `Engine::open` must return an error naming the
//! key, in-process. Before the fix, `"num_hidden_layers": 1000000000` aborted with
//! `memory allocation of 368000000000 bytes failed` in `LlamaModel::load`, and
//! `rope_theta` 0 or `rms_norm_eps` 0 ran and emitted id 0 forever.

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::Path;

use libvoom::engine::{Engine, EngineOptions, GenerateParams};
use serde_json::{json, Value};
use voom_formats::DType;

/// The shape of a tiny checkpoint, and the flags of its architecture.
#[derive(Clone, Copy)]
struct Shape {
    model_type: &'static str,
    layers: usize,
    vocab: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    inter: usize,
    qkv_bias: bool,
    qk_norm: bool,
    tied: bool,
}

const LLAMA: Shape = Shape {
    model_type: "llama",
    layers: 2,
    vocab: 128,
    hidden: 32,
    heads: 4,
    kv_heads: 2,
    head_dim: 8,
    inter: 64,
    qkv_bias: false,
    qk_norm: false,
    tied: false,
};

/// Small deterministic pseudo-random BF16 values in [-0.1, 0.1).
fn random_bf16(n: usize, seed: &mut u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * 2);
    for _ in 0..n {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let u = (*seed >> 40) as f32 / (1u64 << 24) as f32;
        out.extend_from_slice(
            &half::bf16::from_f32((u - 0.5) * 0.2)
                .to_bits()
                .to_le_bytes(),
        );
    }
    out
}

/// The checkpoint's tensors: names and shapes, as transformers names them.
fn tensors(s: &Shape) -> Vec<(String, Vec<usize>)> {
    let (q, kv) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let mut t = vec![
        (
            "model.embed_tokens.weight".to_string(),
            vec![s.vocab, s.hidden],
        ),
        ("model.norm.weight".to_string(), vec![s.hidden]),
    ];
    if !s.tied {
        t.push(("lm_head.weight".to_string(), vec![s.vocab, s.hidden]));
    }
    for i in 0..s.layers {
        let p = format!("model.layers.{i}");
        let mut add = |name: &str, shape: Vec<usize>| t.push((format!("{p}.{name}"), shape));
        add("input_layernorm.weight", vec![s.hidden]);
        add("post_attention_layernorm.weight", vec![s.hidden]);
        for (proj, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
            add(&format!("self_attn.{proj}.weight"), vec![rows, s.hidden]);
            if s.qkv_bias {
                add(&format!("self_attn.{proj}.bias"), vec![rows]);
            }
        }
        add("self_attn.o_proj.weight", vec![s.hidden, q]);
        if s.qk_norm {
            add("self_attn.q_norm.weight", vec![s.head_dim]);
            add("self_attn.k_norm.weight", vec![s.head_dim]);
        }
        add("mlp.gate_proj.weight", vec![s.inter, s.hidden]);
        add("mlp.up_proj.weight", vec![s.inter, s.hidden]);
        add("mlp.down_proj.weight", vec![s.hidden, s.inter]);
    }
    t
}

/// The honest config.json of `s`.
fn config(s: &Shape) -> Value {
    json!({
        "model_type": s.model_type,
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": s.hidden,
        "intermediate_size": s.inter,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "vocab_size": s.vocab,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": s.tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
    })
}

/// Writes the checkpoint of `s` (random BF16 weights; `extra` tensors besides) with
/// `cfg` as its config.json.
fn write_model(dir: &Path, s: &Shape, extra: &[(&str, Vec<usize>)], cfg: &Value) {
    let mut all = tensors(s);
    all.extend(extra.iter().map(|(n, sh)| (n.to_string(), sh.clone())));
    let mut seed = 0x5eed;
    let bytes: Vec<Vec<u8>> = all
        .iter()
        .map(|(name, shape)| {
            let n = shape.iter().product();
            if name.ends_with("norm.weight") {
                half::bf16::from_f32(1.0).to_bits().to_le_bytes().repeat(n)
            } else {
                random_bf16(n, &mut seed)
            }
        })
        .collect();
    let refs: Vec<(&str, DType, &[usize], &[u8])> = all
        .iter()
        .zip(&bytes)
        .map(|((n, sh), b)| (n.as_str(), DType::BF16, sh.as_slice(), b.as_slice()))
        .collect();
    voom_formats::safetensors::write(&dir.join("model.safetensors"), &refs, &BTreeMap::new())
        .unwrap();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
}

/// `Engine::open` on the checkpoint of `s` whose config.json has `key` set to `value`.
fn open_lying(s: &Shape, key: &str, value: Value) -> Result<Engine, String> {
    let d = tempfile::tempdir().unwrap();
    let mut cfg = config(s);
    cfg[key] = value;
    write_model(d.path(), s, &[], &cfg);
    Engine::open(d.path(), EngineOptions::default()).map_err(|e| e.to_string())
}

/// The error of opening a checkpoint whose config lies about `key`; it must name `key`
/// and contain each of `also`.
fn refused(s: &Shape, key: &str, value: Value, also: &[&str]) -> String {
    let e = match open_lying(s, key, value.clone()) {
        Ok(_) => panic!("config.json with '{key}': {value} was accepted"),
        Err(e) => e,
    };
    assert!(
        e.contains(key),
        "'{key}': {value}: the error does not name it: {e}"
    );
    for a in also {
        assert!(e.contains(a), "'{key}': {value}: expected '{a}' in: {e}");
    }
    e
}

fn generate(e: &Engine, n: usize) -> Vec<u32> {
    let params = GenerateParams {
        max_new_tokens: n,
        ignore_eos: true,
        ..Default::default()
    };
    e.generate(&[1, 5, 9], &params, &mut |_| ControlFlow::Continue(()))
        .unwrap()
        .ids
}

#[test]
fn the_honest_checkpoints_open_and_generate() {
    // The fixture is sound, so each error below is the lie's. Every family, with its
    // own tensors: q/k/v bias (qwen2), q/k norms and a head_dim apart from
    // hidden_size / heads (qwen3), tied embeddings.
    let qwen2 = Shape {
        model_type: "qwen2",
        qkv_bias: true,
        tied: true,
        ..LLAMA
    };
    let qwen3 = Shape {
        model_type: "qwen3",
        qk_norm: true,
        head_dim: 16,
        ..LLAMA
    };
    let mistral = Shape {
        model_type: "mistral",
        ..LLAMA
    };
    for s in [LLAMA, qwen2, qwen3, mistral] {
        let d = tempfile::tempdir().unwrap();
        write_model(d.path(), &s, &[], &config(&s));
        let e = Engine::open(d.path(), EngineOptions::default())
            .unwrap_or_else(|e| panic!("{}: {e}", s.model_type));
        assert_eq!(generate(&e, 4).len(), 4, "{}", s.model_type);
    }
}

#[test]
fn hostile_num_hidden_layers_is_an_error_not_an_abort() {
    // The config: 1e9 layers allocated 368 GB and aborted.
    refused(
        &LLAMA,
        "num_hidden_layers",
        json!(1_000_000_000u64),
        &["65536"],
    );
    refused(&LLAMA, "num_hidden_layers", json!(1e9), &["integer"]);
    refused(&LLAMA, "num_hidden_layers", json!(u64::MAX), &[]);
    refused(&LLAMA, "num_hidden_layers", json!(-1), &["integer"]);
    refused(&LLAMA, "num_hidden_layers", json!(0), &["positive"]);
}

#[test]
fn num_hidden_layers_must_be_the_checkpoints_layer_count() {
    // In range, but more or fewer layers than model.layers.N.* has.
    for n in [3, 1, 4096] {
        refused(
            &LLAMA,
            "num_hidden_layers",
            json!(n),
            &[&format!("is {n}, but the checkpoint has 2 layers")],
        );
    }
}

#[test]
fn a_checkpoint_with_a_gap_in_its_layers_is_an_error_naming_the_missing_layer() {
    let d = tempfile::tempdir().unwrap();
    let cfg = config(&LLAMA);
    write_model(
        d.path(),
        &LLAMA,
        &[("model.layers.1000000.input_layernorm.weight", vec![32])],
        &cfg,
    );
    let e = Engine::open(d.path(), EngineOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("model.layers.2.*") && e.contains("layer 1000000"),
        "{e}"
    );
    // A layer index beyond usize is an error too, not a wrapped number.
    let d = tempfile::tempdir().unwrap();
    write_model(
        d.path(),
        &LLAMA,
        &[("model.layers.99999999999999999999999.x.weight", vec![32])],
        &cfg,
    );
    let e = Engine::open(d.path(), EngineOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("out of range"), "{e}");
}

#[test]
fn vocab_size_must_match_the_embedding_and_fit_u32() {
    refused(
        &LLAMA,
        "vocab_size",
        json!(1000),
        &["model.embed_tokens.weight", "dimension 0 is 128"],
    );
    refused(
        &LLAMA,
        "vocab_size",
        json!(64),
        &["model.embed_tokens.weight"],
    );
    refused(&LLAMA, "vocab_size", json!(1u64 << 32), &["4294967295"]);
    // Tied: only the embedding decides; untied: lm_head must agree as well.
    let d = tempfile::tempdir().unwrap();
    let mut cfg = config(&LLAMA);
    write_model(d.path(), &LLAMA, &[], &cfg);
    let st = voom_formats::Checkpoint::open(d.path()).unwrap();
    assert!(st.tensors().any(|(n, _)| n == "lm_head.weight"));
    cfg["tie_word_embeddings"] = json!(true);
    std::fs::write(d.path().join("config.json"), cfg.to_string()).unwrap();
    Engine::open(d.path(), EngineOptions::default()).unwrap();
}

#[test]
fn hidden_size_must_match_the_embedding_and_norms() {
    refused(
        &LLAMA,
        "hidden_size",
        json!(48),
        &["dimension 1 is 32 in the checkpoint", "'hidden_size' is 48"],
    );
    refused(&LLAMA, "hidden_size", json!(1u64 << 40), &["16777216"]);
}

#[test]
fn heads_and_head_dim_must_match_the_attention_projections() {
    refused(
        &LLAMA,
        "num_attention_heads",
        json!(8),
        &["q_proj", "'num_attention_heads' 8 × 'head_dim' 8 is 64"],
    );
    refused(
        &LLAMA,
        "num_key_value_heads",
        json!(1),
        &["k_proj", "'num_key_value_heads' 1 × 'head_dim' 8 is 8"],
    );
    refused(&LLAMA, "num_key_value_heads", json!(3), &["multiple"]);
    refused(&LLAMA, "head_dim", json!(16), &["q_proj"]);
    refused(&LLAMA, "head_dim", json!(7), &["even"]);
    refused(&LLAMA, "num_attention_heads", json!(1u64 << 40), &["65536"]);
    // qwen3 checks head_dim against its per-head norms too.
    let qwen3 = Shape {
        model_type: "qwen3",
        qk_norm: true,
        ..LLAMA
    };
    let d = tempfile::tempdir().unwrap();
    let mut cfg = config(&qwen3);
    cfg["head_dim"] = json!(4);
    cfg["num_attention_heads"] = json!(8);
    cfg["num_key_value_heads"] = json!(4);
    write_model(d.path(), &qwen3, &[], &cfg);
    let e = Engine::open(d.path(), EngineOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("q_norm") && e.contains("'head_dim' is 4"), "{e}");
}

#[test]
fn intermediate_size_must_match_the_mlp() {
    refused(
        &LLAMA,
        "intermediate_size",
        json!(96),
        &["gate_proj", "'intermediate_size' is 96"],
    );
    refused(
        &LLAMA,
        "intermediate_size",
        json!(1_000_000_000u64),
        &["16777216"],
    );
}

#[test]
fn hostile_context_length_is_an_error_and_the_limit_reserves_nothing() {
    refused(
        &LLAMA,
        "max_position_embeddings",
        json!(1_000_000_000_000u64),
        &["1..=16777216"],
    );
    refused(&LLAMA, "max_position_embeddings", json!(1e12), &["integer"]);
    // At the limit itself the model opens, and a cache of that capacity holds
    // nothing until positions are computed.
    let e = open_lying(&LLAMA, "max_position_embeddings", json!(1 << 24)).unwrap();
    assert_eq!(e.max_context(), 1 << 24);
    let kv = e.new_kv();
    assert_eq!((kv.capacity(), kv.bytes()), (1 << 24, 0));
    assert_eq!(generate(&e, 3).len(), 3);
}

#[test]
fn rope_theta_zero_or_negative_is_an_error() {
    // Issue 8: these ran and emitted id 0 forever.
    for v in [json!(0), json!(-1), json!(0.0), json!(1e39)] {
        refused(&LLAMA, "rope_theta", v, &["positive finite"]);
    }
    refused(&LLAMA, "rope_theta", json!("10000"), &["number"]);
    // A theta so small that its rotary angles overflow float32 within the context.
    let d = tempfile::tempdir().unwrap();
    let mut cfg = config(&LLAMA);
    cfg["rope_theta"] = json!(1e-44);
    cfg["max_position_embeddings"] = json!(1 << 24);
    write_model(d.path(), &LLAMA, &[], &cfg);
    let e = Engine::open(d.path(), EngineOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("'rope_theta'") && e.contains("rotary frequency"),
        "{e}"
    );
}

#[test]
fn rms_norm_eps_zero_or_negative_is_an_error() {
    for v in [json!(0), json!(-1e-6), json!(1e-50)] {
        refused(&LLAMA, "rms_norm_eps", v, &["positive finite"]);
    }
}

#[test]
fn broken_rope_scaling_and_layer_lists_are_errors_naming_the_key() {
    refused(
        &LLAMA,
        "rope_scaling",
        json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1e12}),
        &["original_max_position_embeddings"],
    );
    refused(
        &LLAMA,
        "rope_scaling",
        json!({"rope_type": "llama3", "factor": 0.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        &["rope_scaling.factor"],
    );
    refused(
        &LLAMA,
        "layer_types",
        json!(["full_attention", "full_attention", "full_attention"]),
        &["3 entries for 2 layers"],
    );
    let mistral = Shape {
        model_type: "mistral",
        ..LLAMA
    };
    refused(&mistral, "sliding_window", json!(-1), &["positive integer"]);
    refused(
        &mistral,
        "sliding_window",
        json!(1e30),
        &["positive integer"],
    );
}

#[test]
fn eos_ids_outside_the_vocabulary_never_stop_generation_and_never_wrap_to_0() {
    // 2^32 once became eos id 0 by an `as u32` cast; -1 and 10^6 can never be
    // generated (transformers warns and generates on).
    let e = open_lying(
        &LLAMA,
        "eos_token_id",
        json!([4294967296u64, -1, 1_000_000, 7]),
    )
    .unwrap();
    assert_eq!(e.eos_ids(), &[7]);
    let e = open_lying(&LLAMA, "eos_token_id", json!(4294967296u64)).unwrap();
    assert!(e.eos_ids().is_empty(), "{:?}", e.eos_ids());
    let e = open_lying(&LLAMA, "bos_token_id", json!(-5)).unwrap();
    assert_eq!(e.config().bos_token_id, None);
}

#[test]
fn a_config_json_that_is_not_json_or_not_an_object_is_an_error() {
    let d = tempfile::tempdir().unwrap();
    write_model(d.path(), &LLAMA, &[], &config(&LLAMA));
    for text in ["", "[]", "{\"model_type\": ", "null", "\"llama\""] {
        std::fs::write(d.path().join("config.json"), text).unwrap();
        let e = Engine::open(d.path(), EngineOptions::default())
            .err()
            .unwrap_or_else(|| panic!("{text:?} accepted"))
            .to_string();
        assert!(e.contains("config.json"), "{text:?}: {e}");
    }
}

/// A copy of a committed conformance fixture whose config.json is `edit`ed.
fn fixture_with(case: &str, edit: impl FnOnce(&mut Value)) -> tempfile::TempDir {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/tiny")
        .join(case);
    let d = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), d.path().join(f.file_name())).unwrap();
    }
    let path = d.path().join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    d
}

/// An MLA config that lies about a latent width is an error naming the key, before
/// anything is allocated from it.
#[test]
fn mla_widths_that_contradict_the_checkpoint_name_their_key() {
    for (key, value, needle) in [
        ("kv_lora_rank", 20, "kv_lora_rank"),
        ("q_lora_rank", 30, "q_lora_rank"),
        ("v_head_dim", 16, "v_head_dim"),
        ("qk_nope_head_dim", 4, "qk_nope_head_dim"),
        ("n_shared_experts", 3, "n_shared_experts"),
        ("moe_intermediate_size", 8, "moe_intermediate_size"),
    ] {
        let d = fixture_with("deepseek_v3_mla_yarn", |v| v[key] = json!(value));
        let e = Engine::open(d.path(), EngineOptions::default())
            .err()
            .unwrap_or_else(|| panic!("{key} {value} opened"));
        assert!(e.to_string().contains(needle), "{key}: {e}");
    }
}

/// Multi-token-prediction layers after the decoder's (DeepSeek-V3 stores one as layer
/// 61 of 61) are allowed in the checkpoint and not run: the fixture's last layer read
/// as one, the model is the first two layers. Without `num_nextn_predict_layers` the
/// layer count must match.
#[test]
fn layers_past_the_decoders_are_allowed_only_as_prediction_layers() {
    let d = fixture_with("deepseek_v3_mla_yarn", |v| {
        v["num_hidden_layers"] = json!(2);
        v["num_nextn_predict_layers"] = json!(1);
    });
    let e = Engine::open(d.path(), EngineOptions::default()).unwrap();
    assert_eq!(e.config().num_layers, 2);
    let g = e
        .generate(
            &[5, 9, 13],
            &GenerateParams {
                max_new_tokens: 4,
                ..Default::default()
            },
            &mut |_| ControlFlow::Continue(()),
        )
        .unwrap();
    assert_eq!(g.ids.len(), 4);
    let d = fixture_with("deepseek_v3_mla_yarn", |v| {
        v["num_hidden_layers"] = json!(2);
        v["num_nextn_predict_layers"] = json!(0);
    });
    let e = Engine::open(d.path(), EngineOptions::default())
        .err()
        .expect("a layer too many opened");
    assert!(e.to_string().contains("num_hidden_layers"), "{e}");
}

/// The sigmoid router's correction bias is part of the checkpoint: without it the
/// model does not open, and the error names the tensor.
#[test]
fn a_missing_correction_bias_names_the_tensor() {
    let d = fixture_with("glm4_moe_partial_rotary_shared", |_| {});
    let path = d.path().join("model.safetensors");
    let st = voom_formats::safetensors::SafetensorsFile::open(&path).unwrap();
    let kept: Vec<(String, DType, Vec<usize>, Vec<u8>)> = st
        .header
        .tensors
        .iter()
        .filter(|t| !t.name.ends_with("e_score_correction_bias"))
        .map(|t| {
            (
                t.name.clone(),
                t.dtype,
                t.shape.clone(),
                st.tensor_bytes(t).to_vec(),
            )
        })
        .collect();
    assert!(kept.len() < st.header.tensors.len());
    drop(st);
    let specs: Vec<(&str, DType, &[usize], &[u8])> = kept
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    voom_formats::safetensors::write(&path, &specs, &BTreeMap::new()).unwrap();
    let e = Engine::open(d.path(), EngineOptions::default())
        .err()
        .expect("opened without a correction bias");
    assert!(e.to_string().contains("e_score_correction_bias"), "{e}");
}
