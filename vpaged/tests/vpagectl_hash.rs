//! `vpagectl hash` and `vpagectl verify` on a real (small, sharded) checkpoint written
//! with the safetensors writer: the manifest describes every tensor with its blake3,
//! and one flipped byte makes verify fail naming exactly that tensor and file.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

use voom_formats::dtype::{f32_to_bf16, DType};
use voom_formats::manifest::{Manifest, PageGroup, MANIFEST_FILE};
use voom_formats::{safetensors, Checkpoint};

fn vpagectl(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vpagectl"))
        .args(args)
        .arg(dir)
        .output()
        .expect("runs vpagectl")
}

fn bf16_bytes(n: usize, seed: f32) -> Vec<u8> {
    (0..n)
        .flat_map(|i| f32_to_bf16((i as f32 * 0.37 + seed).sin()).to_le_bytes())
        .collect()
}

/// Two shards and an index, like a Hugging Face sharded checkpoint.
fn write_model(dir: &Path) {
    let emb = bf16_bytes(32 * 16, 0.1);
    let q0 = bf16_bytes(16 * 16, 0.2);
    let n0 = bf16_bytes(16, 0.3);
    let q1 = bf16_bytes(16 * 16, 0.4);
    let norm = bf16_bytes(16, 0.5);
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::write(
        &dir.join("model-00001-of-00002.safetensors"),
        &[
            ("model.embed_tokens.weight", DType::BF16, &[32, 16], &emb),
            (
                "model.layers.0.self_attn.q_proj.weight",
                DType::BF16,
                &[16, 16],
                &q0,
            ),
            (
                "model.layers.0.input_layernorm.weight",
                DType::BF16,
                &[16],
                &n0,
            ),
        ],
        &meta,
    )
    .unwrap();
    safetensors::write(
        &dir.join("model-00002-of-00002.safetensors"),
        &[
            (
                "model.layers.1.self_attn.q_proj.weight",
                DType::BF16,
                &[16, 16],
                &q1,
            ),
            ("model.norm.weight", DType::BF16, &[16], &norm),
        ],
        &meta,
    )
    .unwrap();
    let index = serde_json::json!({
        "metadata": {"total_size": emb.len() + q0.len() + n0.len() + q1.len() + norm.len()},
        "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "model.layers.0.self_attn.q_proj.weight": "model-00001-of-00002.safetensors",
            "model.layers.0.input_layernorm.weight": "model-00001-of-00002.safetensors",
            "model.layers.1.self_attn.q_proj.weight": "model-00002-of-00002.safetensors",
            "model.norm.weight": "model-00002-of-00002.safetensors",
        }
    });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

fn stdout_json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

#[test]
fn hash_writes_a_manifest_and_verify_names_a_flipped_byte() {
    let d = tempfile::tempdir().unwrap();
    write_model(d.path());

    let out = vpagectl(&["hash", "--json"], d.path());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = stdout_json(&out);
    assert_eq!(report["pages"], 5);
    assert_eq!(report["files"], 2);

    // The manifest on disk describes the checkpoint, hashes included.
    let m = Manifest::load(d.path()).unwrap().expect("manifest written");
    let ckpt = Checkpoint::open(d.path()).unwrap();
    m.check_matches(&ckpt).unwrap();
    assert_eq!(report["bytes"], ckpt.total_bytes());
    assert_eq!(m.pages.len(), 5);
    for p in &m.pages {
        let bytes = ckpt.tensor_bytes(&p.name).unwrap();
        assert_eq!(
            p.blake3,
            blake3::hash(bytes).to_hex().as_str(),
            "{}",
            p.name
        );
    }
    let q1 = m.page("model.layers.1.self_attn.q_proj.weight").unwrap();
    assert_eq!(q1.file, "model-00002-of-00002.safetensors");
    assert_eq!(q1.group, PageGroup::Layer(1));
    assert_eq!(
        m.page("model.embed_tokens.weight").unwrap().group,
        PageGroup::Embedding
    );
    assert_eq!(m.page("model.norm.weight").unwrap().group, PageGroup::Final);

    let out = vpagectl(&["verify"], d.path());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("verified 5 pages"));

    // Flip one byte inside layer 1's q_proj, in place (same length, same header).
    let shard = d.path().join(&q1.file);
    let mut bytes = std::fs::read(&shard).unwrap();
    let at = (q1.offset + q1.len / 2) as usize;
    bytes[at] ^= 0x01;
    std::fs::write(&shard, &bytes).unwrap();

    let out = vpagectl(&["verify"], d.path());
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("MISMATCH page 'model.layers.1.self_attn.q_proj.weight'")
            && text.contains("model-00002-of-00002.safetensors"),
        "{text}"
    );
    assert_eq!(text.matches("MISMATCH").count(), 1, "{text}");

    let out = vpagectl(&["verify", "--json"], d.path());
    assert_eq!(out.status.code(), Some(1));
    let report = stdout_json(&out);
    assert_eq!(report["ok"], false);
    let list = report["mismatches"].as_array().unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0]["page"], "model.layers.1.self_attn.q_proj.weight");
    assert!(list[0]["file"]
        .as_str()
        .unwrap()
        .ends_with("model-00002-of-00002.safetensors"));
    assert_eq!(list[0]["expected"], q1.blake3.as_str());
}

#[test]
fn verify_fails_on_a_stale_manifest_and_errors_without_one() {
    let d = tempfile::tempdir().unwrap();
    write_model(d.path());

    let out = vpagectl(&["verify"], d.path());
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains(MANIFEST_FILE));

    assert!(vpagectl(&["hash"], d.path()).status.success());
    // Replace a shard with one whose layout differs: the manifest is now stale.
    safetensors::write(
        &d.path().join("model-00002-of-00002.safetensors"),
        &[
            (
                "model.layers.1.self_attn.q_proj.weight",
                DType::BF16,
                &[16, 16],
                &bf16_bytes(256, 0.4),
            ),
            (
                "model.norm.weight",
                DType::BF16,
                &[16],
                &bf16_bytes(16, 0.5),
            ),
        ],
        &BTreeMap::new(),
    )
    .unwrap();
    let out = vpagectl(&["verify", "--json"], d.path());
    assert_eq!(out.status.code(), Some(1));
    let report = stdout_json(&out);
    assert_eq!(report["ok"], false);
    assert!(
        report["error"].as_str().unwrap().contains("stale"),
        "{report}"
    );
}

#[test]
fn hash_on_a_directory_without_a_checkpoint_is_an_error() {
    let d = tempfile::tempdir().unwrap();
    let out = vpagectl(&["hash"], d.path());
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing safetensors checkpoint"));
    assert!(!d.path().join(MANIFEST_FILE).exists());
}
