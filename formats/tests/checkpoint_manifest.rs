//! A sharded checkpoint end to end through the public API: open, zero-copy access,
//! manifest build/save/load, verification that names a corrupted page and its file,
//! and a truncated shard reported with its file and tensor.

use std::collections::BTreeMap;
use std::path::Path;

use voom_formats::dtype::DType;
use voom_formats::manifest::{Manifest, PageGroup};
use voom_formats::{safetensors, Checkpoint, FormatError};

fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn write_sharded(dir: &Path) {
    let (a, b, c, d) = (bytes(4096, 1), bytes(2048, 2), bytes(64, 3), bytes(4096, 4));
    safetensors::write(
        &dir.join("model-00001-of-00002.safetensors"),
        &[
            ("model.embed_tokens.weight", DType::BF16, &[64, 32], &a),
            (
                "model.layers.0.mlp.up_proj.weight",
                DType::F32,
                &[16, 32],
                &b,
            ),
        ],
        &BTreeMap::new(),
    )
    .unwrap();
    safetensors::write(
        &dir.join("model-00002-of-00002.safetensors"),
        &[
            ("model.norm.weight", DType::BF16, &[32], &c),
            ("lm_head.weight", DType::BF16, &[64, 32], &d),
        ],
        &BTreeMap::new(),
    )
    .unwrap();
    let index = serde_json::json!({"weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "model.layers.0.mlp.up_proj.weight": "model-00001-of-00002.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors",
    }});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

#[test]
fn sharded_checkpoint_is_zero_copy_and_verified_by_its_manifest() {
    let d = tempfile::tempdir().unwrap();
    write_sharded(d.path());
    let ckpt = Checkpoint::open(d.path()).unwrap();
    assert_eq!(ckpt.files.len(), 2);
    assert_eq!(ckpt.total_bytes(), 4096 + 2048 + 64 + 4096);

    // Tensor bytes are slices of the file's mapping, not copies.
    for (name, loc) in ckpt.tensors() {
        let map = ckpt.files[loc.file].mapping().as_ptr_range();
        let t = ckpt.tensor_bytes(name).unwrap();
        assert!(map.contains(&t.as_ptr()), "{name}");
        assert_eq!(
            t.as_ptr() as usize - map.start as usize,
            loc.info.offset as usize
        );
    }

    let m = Manifest::build(&ckpt, &mut |_, _| {}).unwrap();
    m.save(d.path()).unwrap();
    let m = Manifest::load(d.path()).unwrap().unwrap();
    m.check_matches(&ckpt).unwrap();
    let groups: Vec<_> = m.pages.iter().map(|p| (p.name.as_str(), p.group)).collect();
    assert_eq!(
        groups,
        [
            ("lm_head.weight", PageGroup::Final),
            ("model.embed_tokens.weight", PageGroup::Embedding),
            ("model.layers.0.mlp.up_proj.weight", PageGroup::Layer(0)),
            ("model.norm.weight", PageGroup::Final),
        ]
    );
    assert!(m
        .verify_checkpoint(&ckpt, &mut |_, _| {})
        .unwrap()
        .is_empty());
    drop(ckpt);

    // Corrupt the last byte of lm_head (shard 2) and the first byte of the embedding (shard 1).
    for (page, at_end) in [
        ("lm_head.weight", true),
        ("model.embed_tokens.weight", false),
    ] {
        let p = m.page(page).unwrap();
        let path = d.path().join(&p.file);
        let mut f = std::fs::read(&path).unwrap();
        let i = if at_end {
            p.offset + p.len - 1
        } else {
            p.offset
        };
        f[i as usize] ^= 0x80;
        std::fs::write(&path, f).unwrap();
    }
    let ckpt = Checkpoint::open(d.path()).unwrap();
    let bad = m.verify_checkpoint(&ckpt, &mut |_, _| {}).unwrap();
    let named: Vec<_> = bad
        .iter()
        .map(|e| match e {
            FormatError::ChecksumMismatch { path, page, .. } => (
                page.as_str(),
                path.file_name().unwrap().to_str().unwrap().to_string(),
            ),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        named,
        [
            (
                "lm_head.weight",
                "model-00002-of-00002.safetensors".to_string()
            ),
            (
                "model.embed_tokens.weight",
                "model-00001-of-00002.safetensors".to_string()
            ),
        ]
    );
}

#[test]
fn truncated_shard_names_its_file_and_tensor() {
    let d = tempfile::tempdir().unwrap();
    write_sharded(d.path());
    let shard = d.path().join("model-00002-of-00002.safetensors");
    let f = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &f[..f.len() - 1]).unwrap();
    match Checkpoint::open(d.path()).unwrap_err() {
        FormatError::BadTensor {
            path,
            tensor,
            detail,
        } => {
            assert_eq!(path, shard);
            assert_eq!(tensor, "lm_head.weight");
            assert!(detail.contains("run past"), "{detail}");
        }
        other => panic!("{other:?}"),
    }
}
