//! The engine computes on BF16, F16 and F32 weights in place. A BF16 checkpoint
//! widened to F32 holds the same values, so it must give the same logits bits: the
//! kernels' arithmetic does not depend on the storage type.

use std::collections::BTreeMap;
use std::path::Path;

use libvoom::engine::{Engine, EngineOptions};
use voom_formats::dtype::to_f32_vec;
use voom_formats::{Checkpoint, DType};

fn fixture(case: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/tiny")
        .join(case)
}

/// Rewrites every tensor of `from` as `to_dtype` in a new directory (rounding to
/// nearest when narrowing).
fn convert(from: &Path, to: &Path, to_dtype: DType) {
    std::fs::create_dir_all(to).unwrap();
    for f in ["config.json", "generation_config.json"] {
        if from.join(f).exists() {
            std::fs::copy(from.join(f), to.join(f)).unwrap();
        }
    }
    let ckpt = Checkpoint::open(from).unwrap();
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, loc) in ckpt.tensors() {
        let vals = to_f32_vec(loc.info.dtype, ckpt.tensor_bytes(name).unwrap()).into_iter();
        let out: Vec<u8> = match to_dtype {
            DType::F32 => vals.flat_map(|v| v.to_le_bytes()).collect(),
            DType::F16 => vals
                .flat_map(|v| half::f16::from_f32(v).to_bits().to_le_bytes())
                .collect(),
            _ => unreachable!(),
        };
        owned.push((name.to_string(), loc.info.shape.clone(), out));
    }
    let refs: Vec<(&str, DType, &[usize], &[u8])> = owned
        .iter()
        .map(|(n, s, b)| (n.as_str(), to_dtype, s.as_slice(), b.as_slice()))
        .collect();
    voom_formats::safetensors::write(&to.join("model.safetensors"), &refs, &BTreeMap::new())
        .unwrap();
}

fn logits_bits(dir: &Path, prompt: &[u32]) -> Vec<u32> {
    let e = Engine::open(dir, EngineOptions::default()).unwrap();
    let mut kv = e.new_kv();
    e.forward_all(&mut kv, prompt)
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn f32_weights_give_the_same_bits_as_bf16() {
    let src = fixture("llama_gqa_untied");
    let d = tempfile::tempdir().unwrap();
    convert(&src, d.path(), DType::F32);
    let prompt: Vec<u32> = (0..37).map(|i| (i * 7 + 3) % 200).collect();
    assert_eq!(logits_bits(&src, &prompt), logits_bits(d.path(), &prompt));
}

#[test]
fn f16_weights_give_the_same_bits_as_their_f32_widening() {
    let src = fixture("qwen2_bias_tied");
    let f16 = tempfile::tempdir().unwrap();
    convert(&src, f16.path(), DType::F16);
    let f32 = tempfile::tempdir().unwrap();
    convert(f16.path(), f32.path(), DType::F32);
    let prompt: Vec<u32> = (0..23).map(|i| (i * 11 + 5) % 250).collect();
    assert_eq!(
        logits_bits(f16.path(), &prompt),
        logits_bits(f32.path(), &prompt)
    );
}
