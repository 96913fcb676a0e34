//! Lossy GGUF models: a quantized GGUF imported with its blocks as stored
//! (`WeightsAs::Stored`) computes, at every position, the bits of exact mode over
//! the floats its blocks stand for (`WeightsAs::F32`: ggml's dequantized values),
//! whatever the instruction set, threads, prefill chunk or page budget; its config
//! lists each tensor's ggml type; bad block shapes are named errors.
//!
//! The GGUF is built here: a small llama whose matrices are blocks of every type
//! vOOM runs (random bytes under small scales, so every bit pattern of the packed
//! values meets the kernels).

mod common;

use std::path::{Path, PathBuf};

use libvoom::backend::cpu::matmul::Isa;
use libvoom::backend::BackendKind;
use libvoom::engine::{Engine, EngineOptions};
use libvoom::import::{import_gguf_as, WeightsAs};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use voom_formats::gguf::{GgmlType, GgufArray, GgufValue, GgufWriter};

const EMBD: usize = 256;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 64;
const FF: usize = 512;
const LAYERS: usize = 2;

/// GPT-2's byte alphabet (bytes_to_unicode), as a GGUF vocabulary spells bytes.
fn byte_alphabet() -> Vec<String> {
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            let c = if matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff) {
                u32::from(b)
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(c).unwrap().to_string()
        })
        .collect()
}

/// Byte offsets of the f16 scale fields of a block of `t` (ggml's block structs).
fn f16_fields(t: GgmlType) -> &'static [usize] {
    match t {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::IQ4_XS => &[0],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        GgmlType::MXFP4 => &[],
        other => panic!("no block layout for {other}"),
    }
}

/// `rows` rows of `cols` elements of random blocks of `t`, their scales small
/// (about 2^-9) so that sums stay finite.
fn blocks(rng: &mut ChaCha8Rng, t: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let (block, bytes) = t.block();
    let n = rows * cols / block as usize;
    let mut out = Vec::with_capacity(n * bytes as usize);
    for _ in 0..n {
        let mut b: Vec<u8> = (0..bytes).map(|_| rng.gen()).collect();
        for &at in f16_fields(t) {
            let d = half::f16::from_f32(rng.gen_range(1.0f32..2.0) / 512.0);
            b[at..at + 2].copy_from_slice(&d.to_bits().to_le_bytes());
        }
        if t == GgmlType::MXFP4 {
            b[0] = rng.gen_range(118..124);
        }
        out.extend_from_slice(&b);
    }
    out
}

/// Experts of the qwen3moe GGUFs: count, used, rows of gate and up.
const EXPERTS: (usize, usize, usize) = (4, 2, 256);

/// A llama GGUF ([`lossy_gguf`]).
fn lossy_llama(dir: &Path, types: &[GgmlType], seed: u64) -> PathBuf {
    lossy_gguf(dir, "llama", types, seed)
}

/// Writes a GGUF of architecture `arch` (llama, qwen2, qwen3, qwen3moe) whose
/// matrices cycle through `types` (the embedding the first, the output head the
/// second), as llama.cpp names and shapes them, and returns its path.
fn lossy_gguf(dir: &Path, arch: &str, types: &[GgmlType], seed: u64) -> PathBuf {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .map(String::from)
        .to_vec();
    tokens.extend(byte_alphabet());
    // 259 tokens: the rows of the embedding and head need not be whole blocks.
    let vocab = tokens.len();
    let mut w = GgufWriter::new();
    let s = |x: &str| GgufValue::String(x.into());
    let u = GgufValue::U32;
    let k = |key: &str| format!("{arch}.{key}");
    w.add_kv("general.architecture", s(arch));
    w.add_kv("general.name", s("lossy tiny"));
    w.add_kv("general.file_type", u(15));
    w.add_kv(&k("block_count"), u(LAYERS as u32));
    w.add_kv(&k("context_length"), u(256));
    w.add_kv(&k("embedding_length"), u(EMBD as u32));
    w.add_kv(&k("feed_forward_length"), u(FF as u32));
    w.add_kv(&k("attention.head_count"), u(HEADS as u32));
    w.add_kv(&k("attention.head_count_kv"), u(KV_HEADS as u32));
    w.add_kv(&k("rope.freq_base"), GgufValue::F32(10000.0));
    w.add_kv(&k("attention.layer_norm_rms_epsilon"), GgufValue::F32(1e-5));
    w.add_kv(&k("vocab_size"), u(vocab as u32));
    w.add_kv(&k("rope.dimension_count"), u(HEAD_DIM as u32));
    if arch == "qwen3moe" {
        let (n, used, ff) = EXPERTS;
        w.add_kv(&k("expert_count"), u(n as u32));
        w.add_kv(&k("expert_used_count"), u(used as u32));
        w.add_kv(&k("expert_feed_forward_length"), u(ff as u32));
    }
    w.add_kv("tokenizer.ggml.model", s("gpt2"));
    w.add_kv("tokenizer.ggml.pre", s("gpt-2"));
    let mut ttypes = vec![3i32; 3];
    ttypes.extend(std::iter::repeat_n(1, 256));
    w.add_kv(
        "tokenizer.ggml.tokens",
        GgufValue::Array(GgufArray::String(tokens)),
    );
    w.add_kv(
        "tokenizer.ggml.token_type",
        GgufValue::Array(GgufArray::I32(ttypes)),
    );
    w.add_kv(
        "tokenizer.ggml.merges",
        GgufValue::Array(GgufArray::String(vec![])),
    );
    w.add_kv("tokenizer.ggml.bos_token_id", u(1));
    w.add_kv("tokenizer.ggml.eos_token_id", u(2));
    let mut next = 0usize;
    // A matrix (`count` of them fused, ne = [cols, rows, count]) of the next type.
    let mut matrix = |w: &mut GgufWriter, rng: &mut ChaCha8Rng, name: &str, dims: [usize; 3]| {
        let [count, rows, cols] = dims;
        let t = types[next % types.len()];
        next += 1;
        let b = blocks(rng, t, count * rows, cols);
        let ne: Vec<u64> = match count {
            1 => vec![cols as u64, rows as u64],
            _ => vec![cols as u64, rows as u64, count as u64],
        };
        w.add_tensor(name, &ne, t, &b);
    };
    let vector = |w: &mut GgufWriter, rng: &mut ChaCha8Rng, name: &str, n: usize| {
        let v: Vec<u8> = (0..n)
            .flat_map(|_| rng.gen_range(0.5f32..1.5).to_le_bytes())
            .collect();
        w.add_tensor(name, &[n as u64], GgmlType::F32, &v);
    };
    matrix(&mut w, &mut rng, "token_embd.weight", [1, vocab, EMBD]);
    matrix(&mut w, &mut rng, "output.weight", [1, vocab, EMBD]);
    vector(&mut w, &mut rng, "output_norm.weight", EMBD);
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    for l in 0..LAYERS {
        let b = |name: &str| format!("blk.{l}.{name}");
        vector(&mut w, &mut rng, &b("attn_norm.weight"), EMBD);
        vector(&mut w, &mut rng, &b("ffn_norm.weight"), EMBD);
        for (name, rows, cols) in [
            ("attn_q", q, EMBD),
            ("attn_k", kv, EMBD),
            ("attn_v", kv, EMBD),
            ("attn_output", EMBD, q),
        ] {
            matrix(
                &mut w,
                &mut rng,
                &b(&format!("{name}.weight")),
                [1, rows, cols],
            );
        }
        if arch == "qwen3moe" {
            // The router in F32, as llama.cpp's converter keeps it.
            let (n, _, ff) = EXPERTS;
            let router: Vec<u8> = (0..n * EMBD)
                .flat_map(|_| rng.gen_range(-0.5f32..0.5).to_le_bytes())
                .collect();
            let ne = [EMBD as u64, n as u64];
            w.add_tensor(&b("ffn_gate_inp.weight"), &ne, GgmlType::F32, &router);
            for (name, rows, cols) in [
                ("ffn_gate_exps", ff, EMBD),
                ("ffn_up_exps", ff, EMBD),
                ("ffn_down_exps", EMBD, ff),
            ] {
                matrix(
                    &mut w,
                    &mut rng,
                    &b(&format!("{name}.weight")),
                    [n, rows, cols],
                );
            }
        } else {
            for (name, rows, cols) in [
                ("ffn_gate", FF, EMBD),
                ("ffn_up", FF, EMBD),
                ("ffn_down", EMBD, FF),
            ] {
                matrix(
                    &mut w,
                    &mut rng,
                    &b(&format!("{name}.weight")),
                    [1, rows, cols],
                );
            }
        }
        if arch == "qwen2" {
            for (name, n) in [("attn_q.bias", q), ("attn_k.bias", kv), ("attn_v.bias", kv)] {
                vector(&mut w, &mut rng, &b(name), n);
            }
        }
        if arch.starts_with("qwen3") {
            for name in ["attn_q_norm.weight", "attn_k_norm.weight"] {
                vector(&mut w, &mut rng, &b(name), HEAD_DIM);
            }
        }
    }
    let p = dir.join("lossy-tiny.gguf");
    std::fs::write(&p, w.to_bytes()).unwrap();
    p
}

fn import(gguf: &Path, out: &Path, how: WeightsAs) -> libvoom::import::ImportReport {
    import_gguf_as(gguf, out, how, &mut |_, _| {}).unwrap()
}

fn config(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap()
}

/// The logits bits of every position of `prompt`, and a greedy continuation.
fn bits_and_ids(e: &Engine, prompt: &[u32]) -> (Vec<u32>, Vec<u32>) {
    common::run_bits(e, prompt, 6)
}

const PROMPT: [u32; 9] = [1, 40, 75, 3, 200, 17, 250, 99, 5];

/// Every type vOOM runs, in two mixes: blocks of 32 and the k-quants/IQ4_XS.
#[test]
fn a_lossy_import_computes_the_bits_of_its_dequantized_floats() {
    use GgmlType::*;
    let mixes: [&[GgmlType]; 2] = [
        &[Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4],
        &[Q6_K, Q4_K, Q2_K, Q3_K, Q5_K, IQ4_XS, Q8_0],
    ];
    let cases = mixes.into_iter().map(|t| ("llama", t)).chain([
        ("qwen2", mixes[0]),
        ("qwen3", mixes[1]),
        ("qwen3moe", mixes[1]),
    ]);
    for (i, (arch, types)) in cases.enumerate() {
        let tmp = tempfile::tempdir().unwrap();
        let gguf = lossy_gguf(tmp.path(), arch, types, 40 + i as u64);
        let (lossy, floats) = (tmp.path().join("lossy"), tmp.path().join("f32"));
        let report = import(&gguf, &lossy, WeightsAs::Stored);
        assert_eq!(
            report.scheme.as_deref(),
            Some("q4_k_m"),
            "general.file_type 15"
        );
        import(&gguf, &floats, WeightsAs::F32);

        // The blocks are kept: config.json names every matrix's type, the weights
        // file is the size of the GGUF's tensors, not of their floats.
        let q = &config(&lossy)["quantization_config"];
        assert_eq!(q["quant_method"], "gguf");
        let listed = q["tensor_types"].as_object().unwrap();
        assert_eq!(listed.len(), 2 + 7 * LAYERS, "{arch}: {listed:?}");
        for t in types {
            assert!(listed.values().any(|v| v == t.name()), "{t} listed");
        }
        let size = |d: &Path| {
            std::fs::metadata(d.join("model.safetensors"))
                .unwrap()
                .len()
        };
        assert!(
            size(&lossy) * 3 < size(&floats),
            "{} vs {}",
            size(&lossy),
            size(&floats)
        );

        let want = bits_and_ids(
            &Engine::open(&floats, EngineOptions::default()).unwrap(),
            &PROMPT,
        );
        assert!(
            want.0.iter().all(|b| f32::from_bits(*b).is_finite()),
            "{arch} {types:?}: finite logits"
        );
        for isa in Isa::available() {
            for (threads, chunk) in [(1, 256), (2, 1), (3, 4)] {
                let opts = EngineOptions {
                    threads,
                    prefill_chunk: chunk,
                    backend: BackendKind::Cpu(isa),
                    ..Default::default()
                };
                let e = Engine::open(&lossy, opts).unwrap();
                assert_eq!(
                    bits_and_ids(&e, &PROMPT),
                    want,
                    "{arch} {types:?} {isa:?} threads {threads} chunk {chunk}"
                );
            }
        }
        // Out of core: the store's page cache at a budget below one layer.
        let (_d, dir) = common::copy_with_manifest(&lossy);
        let m = voom_formats::Manifest::load(&dir).unwrap().unwrap();
        let largest = m.pages.iter().map(|p| p.len as usize).max().unwrap();
        let budget = (largest * 2).next_multiple_of(16 << 10) + (256 << 10);
        let (_store, e) = common::over_store_with(&dir, budget, None, EngineOptions::default());
        assert_eq!(
            bits_and_ids(&e, &PROMPT),
            want,
            "{arch} {types:?}: budget {budget}"
        );
    }
}

/// A config.json whose `tensor_types` disagrees with the stored rows, or names a
/// type vOOM does not run, is an error naming the tensor, at open.
#[test]
fn bad_block_metadata_is_a_named_error() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = lossy_llama(tmp.path(), &[GgmlType::Q8_0, GgmlType::Q4_K], 7);
    let lossy = tmp.path().join("lossy");
    import(&gguf, &lossy, WeightsAs::Stored);
    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let d = tempfile::tempdir().unwrap();
        for e in std::fs::read_dir(&lossy).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), d.path().join(e.file_name())).unwrap();
        }
        let mut c = config(&lossy);
        f(&mut c);
        std::fs::write(d.path().join("config.json"), c.to_string()).unwrap();
        d
    };
    let q = "model.layers.0.self_attn.q_proj.weight";
    let err = |d: &tempfile::TempDir| match Engine::open(d.path(), EngineOptions::default()) {
        Ok(_) => panic!("opened"),
        Err(e) => e.to_string(),
    };
    // The k-quant's rows read as Q8_0 rows: 256 columns are 8 Q8_0 blocks of 34
    // bytes, not the 144 stored.
    let was = config(&lossy)["quantization_config"]["tensor_types"][q].clone();
    let other = if was == "Q8_0" { "Q4_K" } else { "Q8_0" };
    let d = edit(&|c| c["quantization_config"]["tensor_types"][q] = other.into());
    let e = err(&d);
    assert!(e.contains(q) && e.contains(other), "{e}");
    let d = edit(&|c| c["quantization_config"]["tensor_types"][q] = "IQ2_XXS".into());
    let e = err(&d);
    assert!(e.contains("IQ2_XXS"), "{e}");
    // A quantized tensor left out of the list is a U8 tensor the kernels refuse.
    let d = edit(&|c| {
        c["quantization_config"]["tensor_types"]
            .as_object_mut()
            .unwrap()
            .remove(q);
    });
    let e = err(&d);
    assert!(e.contains(q) && e.contains("U8"), "{e}");
}
