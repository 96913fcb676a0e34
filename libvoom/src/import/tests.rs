//! Imports of small GGUF files built here, and of the real SmolLM2 import when one is
//! provided (`VOOM_SMOLLM2_DIR`).

use std::path::{Path, PathBuf};

use voom_formats::dtype::{bf16_to_f32, f32_to_bf16};
use voom_formats::gguf::{GgmlType, GgufArray, GgufValue, GgufWriter};
use voom_formats::safetensors::SafetensorsFile;

use super::*;

const N_EMBD: usize = 32;
const N_HEAD: usize = 2;
const N_HEAD_KV: usize = 1;
const HEAD_DIM: usize = 16;
const N_FF: usize = 64;
const N_LAYER: usize = 2;

/// Deterministic values that are exact BF16 numbers, so F32 tensors import exactly.
fn values(seed: u32, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(12345);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            let x = ((s >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 0.25;
            bf16_to_f32(f32_to_bf16(x))
        })
        .collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// llama.cpp's `permute` from convert_hf_to_gguf.py:
/// `w.reshape(heads, 2, half, cols).swapaxes(1, 2).reshape(rows, cols)`.
fn llama_cpp_permute(w: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    let half = rows / heads / 2;
    let mut out = Vec::with_capacity(w.len());
    for h in 0..heads {
        for j in 0..half {
            for i in 0..2 {
                let src = h * 2 * half + i * half + j;
                out.extend_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn vocab() -> (Vec<String>, Vec<i32>, Vec<String>) {
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .map(String::from)
        .to_vec();
    let mut types = vec![3, 3, 3];
    let alphabet = super::tokenizer::byte_alphabet();
    for c in alphabet {
        tokens.push(c.to_string());
        types.push(1);
    }
    let merges: Vec<String> = ["h e", "l l", "he ll", "Ġ w"].map(String::from).to_vec();
    for m in &merges {
        tokens.push(m.replace(' ', ""));
        types.push(1);
    }
    tokens.push("<think>".into());
    types.push(4);
    (tokens, types, merges)
}

struct Tiny {
    writer: GgufWriter,
    /// HF name -> f32 values in HF layout.
    hf: Vec<(String, Vec<f32>)>,
}

fn tiny_llama(pre: &str, arch: &str) -> Tiny {
    let (tokens, types, merges) = vocab();
    let n_vocab = tokens.len();
    let mut w = GgufWriter::new();
    let s = |x: &str| GgufValue::String(x.into());
    w.add_kv("general.architecture", s(arch));
    w.add_kv("general.name", s("tiny"));
    w.add_kv("llama.block_count", GgufValue::U32(N_LAYER as u32));
    w.add_kv("llama.context_length", GgufValue::U32(128));
    w.add_kv("llama.embedding_length", GgufValue::U32(N_EMBD as u32));
    w.add_kv("llama.feed_forward_length", GgufValue::U32(N_FF as u32));
    w.add_kv("llama.attention.head_count", GgufValue::U32(N_HEAD as u32));
    w.add_kv(
        "llama.attention.head_count_kv",
        GgufValue::U32(N_HEAD_KV as u32),
    );
    w.add_kv("llama.rope.freq_base", GgufValue::F32(100000.0));
    w.add_kv(
        "llama.attention.layer_norm_rms_epsilon",
        GgufValue::F32(1e-5),
    );
    w.add_kv("llama.vocab_size", GgufValue::U32(n_vocab as u32));
    w.add_kv(
        "llama.rope.dimension_count",
        GgufValue::U32(HEAD_DIM as u32),
    );
    w.add_kv("tokenizer.ggml.model", s("gpt2"));
    w.add_kv("tokenizer.ggml.pre", s(pre));
    w.add_kv(
        "tokenizer.ggml.tokens",
        GgufValue::Array(GgufArray::String(tokens)),
    );
    w.add_kv(
        "tokenizer.ggml.token_type",
        GgufValue::Array(GgufArray::I32(types)),
    );
    w.add_kv(
        "tokenizer.ggml.merges",
        GgufValue::Array(GgufArray::String(merges)),
    );
    w.add_kv("tokenizer.ggml.bos_token_id", GgufValue::U32(1));
    w.add_kv("tokenizer.ggml.eos_token_id", GgufValue::U32(2));
    w.add_kv("tokenizer.ggml.unknown_token_id", GgufValue::U32(0));
    w.add_kv("tokenizer.ggml.padding_token_id", GgufValue::U32(2));
    w.add_kv("tokenizer.ggml.add_bos_token", GgufValue::Bool(false));
    w.add_kv("tokenizer.chat_template", s("{{ messages }}"));

    let mut hf = Vec::new();
    // Embedding as Q8_0 with scale 1/64 and q = (row + col) % 7 - 3: its dequantized
    // values are known exactly.
    let mut q8 = Vec::new();
    let mut embed = Vec::new();
    for r in 0..n_vocab {
        q8.extend(half::f16::from_f32(1.0 / 64.0).to_bits().to_le_bytes());
        for c in 0..N_EMBD {
            let q = ((r + c) % 7) as i8 - 3;
            q8.push(q as u8);
            embed.push(q as f32 / 64.0);
        }
    }
    w.add_tensor(
        "token_embd.weight",
        &[N_EMBD as u64, n_vocab as u64],
        GgmlType::Q8_0,
        &q8,
    );
    hf.push(("model.embed_tokens.weight".to_string(), embed));
    let norm = values(1, N_EMBD);
    w.add_tensor(
        "output_norm.weight",
        &[N_EMBD as u64],
        GgmlType::F32,
        &f32_bytes(&norm),
    );
    hf.push(("model.norm.weight".into(), norm));

    let q_rows = N_HEAD * HEAD_DIM;
    let kv_rows = N_HEAD_KV * HEAD_DIM;
    let mut seed = 10;
    for l in 0..N_LAYER {
        for (gguf, hf_name, rows, cols, permute_heads) in [
            ("attn_norm", "input_layernorm", 1, N_EMBD, 0),
            ("ffn_norm", "post_attention_layernorm", 1, N_EMBD, 0),
            ("attn_q", "self_attn.q_proj", q_rows, N_EMBD, N_HEAD),
            ("attn_k", "self_attn.k_proj", kv_rows, N_EMBD, N_HEAD_KV),
            ("attn_v", "self_attn.v_proj", kv_rows, N_EMBD, 0),
            ("attn_output", "self_attn.o_proj", N_EMBD, q_rows, 0),
            ("ffn_gate", "mlp.gate_proj", N_FF, N_EMBD, 0),
            ("ffn_up", "mlp.up_proj", N_FF, N_EMBD, 0),
            ("ffn_down", "mlp.down_proj", N_EMBD, N_FF, 0),
        ] {
            seed += 1;
            let v = values(seed, rows * cols);
            let stored = if permute_heads > 0 {
                llama_cpp_permute(&v, rows, cols, permute_heads)
            } else {
                v.clone()
            };
            let dims: Vec<u64> = if rows == 1 {
                vec![cols as u64]
            } else {
                vec![cols as u64, rows as u64]
            };
            w.add_tensor(
                &format!("blk.{l}.{gguf}.weight"),
                &dims,
                GgmlType::F32,
                &f32_bytes(&stored),
            );
            hf.push((format!("model.layers.{l}.{hf_name}.weight"), v));
        }
    }
    Tiny { writer: w, hf }
}

fn write_gguf(dir: &Path, name: &str, w: &GgufWriter) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, w.to_bytes()).unwrap();
    p
}

fn read_json(p: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

#[test]
fn imports_a_tiny_llama_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let tiny = tiny_llama("smollm", "llama");
    let gguf = write_gguf(tmp.path(), "tiny.gguf", &tiny.writer);
    let out = tmp.path().join("out");
    let mut calls = Vec::new();
    let report = import_gguf(&gguf, &out, &mut |d, t| calls.push((d, t))).unwrap();
    assert_eq!(report.architecture, "llama");
    assert_eq!(report.name.as_deref(), Some("tiny"));
    assert_eq!(report.tensors, 2 + 9 * N_LAYER);
    assert_eq!(report.rounded_elements, 0, "every value was BF16-exact");
    let (last_done, total) = *calls.last().unwrap();
    assert_eq!(last_done, total);
    assert!(calls.windows(2).all(|w| w[0].0 <= w[1].0));

    // Weights: HF names, HF layout (Q/K un-permuted), BF16 bits equal to the source.
    let st = SafetensorsFile::open(&out.join("model.safetensors")).unwrap();
    assert_eq!(
        st.header.tensors.len(),
        tiny.hf.len(),
        "no lm_head when tied"
    );
    assert_eq!(
        st.header.metadata.get("format").map(String::as_str),
        Some("pt")
    );
    for (name, want) in &tiny.hf {
        let t = st.tensor(name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(t.dtype, DType::BF16);
        assert_eq!(t.numel(), want.len(), "{name}");
        let got: Vec<f32> = st
            .tensor_bytes(t)
            .chunks_exact(2)
            .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect();
        assert_eq!(&got, want, "{name}");
    }
    assert_eq!(
        st.tensor("model.layers.1.self_attn.k_proj.weight")
            .unwrap()
            .shape,
        [N_HEAD_KV * HEAD_DIM, N_EMBD]
    );
    assert_eq!(
        st.tensor("model.layers.0.mlp.down_proj.weight")
            .unwrap()
            .shape,
        [N_EMBD, N_FF]
    );

    let config = read_json(&out.join("config.json"));
    assert_eq!(config["architectures"][0], "LlamaForCausalLM");
    assert_eq!(config["hidden_size"], N_EMBD);
    assert_eq!(config["num_key_value_heads"], N_HEAD_KV);
    assert_eq!(config["head_dim"], HEAD_DIM);
    assert_eq!(config["rms_norm_eps"], 1e-5);
    assert_eq!(config["rope_theta"], 100000.0);
    assert_eq!(config["tie_word_embeddings"], true);
    assert_eq!(config["eos_token_id"], 2);
    let tc = read_json(&out.join("tokenizer_config.json"));
    assert_eq!(tc["bos_token"], "<|im_start|>");
    assert_eq!(tc["unk_token"], "<|endoftext|>");
    assert_eq!(tc["add_bos_token"], false);
    assert_eq!(tc["chat_template"], "{{ messages }}");
    let gc = read_json(&out.join("generation_config.json"));
    assert_eq!(
        gc,
        serde_json::json!({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2})
    );

    // Tokenizer: merges apply, control tokens stay whole, digits split one by one.
    let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    let enc = tok.encode("hello<|im_start|> w12<think>", false).unwrap();
    let pieces: Vec<&str> = enc.get_tokens().iter().map(String::as_str).collect();
    assert_eq!(
        pieces,
        ["hell", "o", "<|im_start|>", "Ġw", "1", "2", "<think>"]
    );
    let ids = enc.get_ids();
    assert_eq!(ids[2], 1);
    assert_eq!(
        tok.decode(ids, false).unwrap(),
        "hello<|im_start|> w12<think>"
    );
    assert_eq!(tok.decode(ids, true).unwrap(), "hello w12<think>");
    assert_eq!(report.bytes_written, dir_bytes(&out));
    // Nothing left beside the output.
    let mut names: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["out", "tiny.gguf"]);
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

#[test]
fn importing_twice_gives_identical_files() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = write_gguf(
        tmp.path(),
        "tiny.gguf",
        &tiny_llama("gpt-2", "llama").writer,
    );
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    import_gguf(&gguf, &a, &mut |_, _| {}).unwrap();
    import_gguf(&gguf, &b, &mut |_, _| {}).unwrap();
    let mut files: Vec<_> = std::fs::read_dir(&a)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    files.sort();
    assert_eq!(files.len(), 5);
    for f in files {
        assert_eq!(
            std::fs::read(a.join(&f)).unwrap(),
            std::fs::read(b.join(&f)).unwrap(),
            "{f:?}"
        );
    }
}

#[test]
fn untied_model_gets_lm_head() {
    let tmp = tempfile::tempdir().unwrap();
    let mut tiny = tiny_llama("smollm", "llama");
    let n_vocab = vocab().0.len();
    let head = values(99, n_vocab * N_EMBD);
    tiny.writer.add_tensor(
        "output.weight",
        &[N_EMBD as u64, n_vocab as u64],
        GgmlType::F32,
        &f32_bytes(&head),
    );
    let gguf = write_gguf(tmp.path(), "t.gguf", &tiny.writer);
    let out = tmp.path().join("out");
    import_gguf(&gguf, &out, &mut |_, _| {}).unwrap();
    let st = SafetensorsFile::open(&out.join("model.safetensors")).unwrap();
    assert_eq!(
        st.tensor("lm_head.weight").unwrap().shape,
        [n_vocab, N_EMBD]
    );
    assert_eq!(
        read_json(&out.join("config.json"))["tie_word_embeddings"],
        false
    );
}

fn import_err(w: &GgufWriter) -> (ImportError, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = write_gguf(tmp.path(), "bad.gguf", w);
    let out = tmp.path().join("out");
    let e = import_gguf(&gguf, &out, &mut |_, _| {}).unwrap_err();
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert_eq!(left.len(), 1, "a failed import leaves nothing: {left:?}");
    (e, gguf)
}

#[test]
fn unsupported_inputs_are_clear_errors() {
    let (e, _) = import_err(&tiny_llama("smollm", "falcon").writer);
    assert!(matches!(e, ImportError::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("architecture 'falcon'"), "{e}");

    let (e, _) = import_err(&tiny_llama("deepseek-llm", "llama").writer);
    assert!(
        e.to_string().contains("pre-tokenizer 'deepseek-llm'"),
        "{e}"
    );

    let mut tiny = tiny_llama("smollm", "llama");
    tiny.writer
        .add_tensor("rope_freqs.weight", &[8], GgmlType::F32, &[0; 32]);
    let (e, _) = import_err(&tiny.writer);
    assert!(e.to_string().contains("tensor 'rope_freqs.weight'"), "{e}");

    let w = replace_kv(
        &tiny_llama("smollm", "llama").writer,
        "tokenizer.ggml.model",
        GgufValue::String("llama".into()),
    );
    let (e, _) = import_err(&w);
    assert!(e.to_string().contains("tokenizer model 'llama'"), "{e}");

    // A duplicate key: the GGUF itself is rejected.
    let mut tiny = tiny_llama("smollm", "llama");
    tiny.writer
        .add_kv("tokenizer.ggml.pre", GgufValue::String("gpt-2".into()));
    let (e, _) = import_err(&tiny.writer);
    assert!(matches!(e, ImportError::Format(_)), "{e}");
}

/// A copy of the GGUF `w` builds, with `key` set to `value` (added if absent).
fn replace_kv(w: &GgufWriter, key: &str, value: GgufValue) -> GgufWriter {
    let f = voom_formats::gguf::GgufFile::from_bytes("x", w.to_bytes()).unwrap();
    let mut out = GgufWriter::new();
    for (k, v) in f.metadata_entries() {
        out.add_kv(k, if k == key { value.clone() } else { v.clone() });
    }
    if f.metadata(key).is_none() {
        out.add_kv(key, value);
    }
    for t in f.tensors() {
        out.add_tensor(
            t.name(),
            t.dims(),
            t.ggml_type(),
            f.tensor_bytes(t).unwrap(),
        );
    }
    out
}

#[test]
fn inconsistent_models_are_clear_errors() {
    // A layer too many claimed by the metadata.
    let tiny2 = replace_kv(
        &tiny_llama("smollm", "llama").writer,
        "llama.block_count",
        GgufValue::U32(3),
    );
    let (e, _) = import_err(&tiny2);
    assert!(e.to_string().contains("block_count = 3"), "{e}");

    // A missing tensor.
    let full = tiny_llama("smollm", "llama").writer;
    let f = voom_formats::gguf::GgufFile::from_bytes("x", full.to_bytes()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in f.metadata_entries() {
        w.add_kv(k, v.clone());
    }
    for t in f
        .tensors()
        .iter()
        .filter(|t| t.name() != "blk.1.ffn_up.weight")
    {
        w.add_tensor(
            t.name(),
            t.dims(),
            t.ggml_type(),
            f.tensor_bytes(t).unwrap(),
        );
    }
    let (e, _) = import_err(&w);
    assert!(
        e.to_string().contains("'blk.1.ffn_up.weight' is missing"),
        "{e}"
    );

    // Absurd sizes are refused before anything is sized by them.
    let base = tiny_llama("smollm", "llama").writer;
    for (key, value, want) in [
        ("llama.block_count", GgufValue::U64(u64::MAX), "block_count"),
        (
            "llama.attention.head_count",
            GgufValue::U64(1 << 40),
            "heads",
        ),
        (
            "llama.attention.key_length",
            GgufValue::U64(1 << 40),
            "key_length",
        ),
        (
            "llama.feed_forward_length",
            GgufValue::U32(0),
            "feed_forward_length",
        ),
        (
            "llama.attention.layer_norm_rms_epsilon",
            GgufValue::F32(f32::NAN),
            "epsilon",
        ),
    ] {
        let (e, _) = import_err(&replace_kv(&base, key, value));
        assert!(e.to_string().contains(want), "{key}: {e}");
    }

    // A Q projection of the wrong shape.
    let full = tiny_llama("smollm", "llama");
    let f = voom_formats::gguf::GgufFile::from_bytes("x", full.writer.to_bytes()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in f.metadata_entries() {
        w.add_kv(k, v.clone());
    }
    for t in f.tensors() {
        if t.name() == "blk.0.attn_q.weight" {
            w.add_tensor(
                t.name(),
                &[N_EMBD as u64, 16],
                GgmlType::F32,
                &vec![0u8; N_EMBD * 16 * 4],
            );
        } else {
            w.add_tensor(
                t.name(),
                t.dims(),
                t.ggml_type(),
                f.tensor_bytes(t).unwrap(),
            );
        }
    }
    let (e, _) = import_err(&w);
    assert!(
        e.to_string()
            .contains("'blk.0.attn_q.weight' has shape [16, 32]"),
        "{e}"
    );
}

#[test]
fn refuses_a_non_empty_destination() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = write_gguf(tmp.path(), "t.gguf", &tiny_llama("smollm", "llama").writer);
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), b"mine").unwrap();
    let e = import_gguf(&gguf, &out, &mut |_, _| {}).unwrap_err();
    assert!(matches!(e, ImportError::OutputExists(_)), "{e}");
    assert_eq!(std::fs::read(out.join("keep.txt")).unwrap(), b"mine");
    // An empty one is fine.
    std::fs::remove_file(out.join("keep.txt")).unwrap();
    import_gguf(&gguf, &out, &mut |_, _| {}).unwrap();
}

/// The real SmolLM2-135M-Instruct import (made by `cargo run -p libvoom --example
/// import_gguf`): its tokenizer.json must give the ids transformers' own GGUF
/// tokenizer gives (`tests/fixtures/smollm2/tokenizer_cases.json`, made by
/// `tests/conformance/smollm2_tokenizer_cases.py`). Runs when `VOOM_SMOLLM2_DIR` names
/// the import; with `VOOM_REQUIRE_SMOLLM2=1` a missing import is a failure.
#[test]
fn smollm2_tokenizer_matches_transformers() {
    let dir = match std::env::var_os("VOOM_SMOLLM2_DIR") {
        Some(d) if Path::new(&d).join("tokenizer.json").is_file() => PathBuf::from(d),
        other => {
            if std::env::var("VOOM_REQUIRE_SMOLLM2").as_deref() == Ok("1") {
                panic!(
                    "VOOM_REQUIRE_SMOLLM2=1 but VOOM_SMOLLM2_DIR ({other:?}) holds no imported model"
                );
            }
            eprintln!("skipping: VOOM_SMOLLM2_DIR is not an imported SmolLM2 directory");
            return;
        }
    };
    let cases_path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/smollm2/tokenizer_cases.json");
    let cases = read_json(&cases_path);
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let list = cases["cases"].as_array().unwrap();
    assert!(list.len() >= 20);
    for case in list {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = tok.encode(text, false).unwrap();
        assert_eq!(got.get_ids(), want.as_slice(), "text {text:?}");
        let decoded = tok.decode(got.get_ids(), false).unwrap();
        assert_eq!(
            decoded,
            case["decoded"].as_str().unwrap(),
            "decode of {text:?}"
        );
    }
}
