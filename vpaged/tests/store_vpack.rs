//! The store core serves pages from their vpack bodies (fewer bytes from storage),
//! verified to the manifest's hash, and falls back to the raw bytes when a body is
//! damaged.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use voom_formats::{DType, Manifest};
use vpaged::store::{Store, StoreConfig};

fn vpagectl(args: &[&str], dir: &Path) {
    let o = Command::new(env!("CARGO_BIN_EXE_vpagectl"))
        .args(args)
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "vpagectl {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn weights(n: usize, seed: u32) -> Vec<u8> {
    // Weight-like BF16: small magnitudes, so the high plane compresses.
    let mut s = seed.wrapping_mul(2654435761) | 1;
    (0..n)
        .flat_map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let v = ((s % 2001) as f32 - 1000.0) * 1e-4;
            voom_formats::dtype::f32_to_bf16(v).to_le_bytes()
        })
        .collect()
}

#[test]
fn pages_come_from_vpack_bodies_and_fall_back_to_raw() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("m");
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = (weights(64 * 1024, 1), weights(32 * 1024, 2));
    let norm: Vec<u8> = (0..256u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
    voom_formats::safetensors::write(
        &dir.join("model.safetensors"),
        &[
            ("a", DType::BF16, &[256, 256], &a),
            ("b", DType::BF16, &[128, 256], &b),
            ("n", DType::F32, &[256], &norm),
        ],
        &BTreeMap::new(),
    )
    .unwrap();
    vpagectl(&["hash"], &dir);
    vpagectl(&["pack"], &dir);
    let manifest = Manifest::load(&dir).unwrap().unwrap();
    assert!(manifest.page("a").unwrap().vpack().is_some());
    assert!(manifest.page("n").unwrap().vpack().is_none());
    let raw_total: u64 = manifest.pages.iter().map(|p| p.len).sum();

    let store = Store::new(StoreConfig {
        cache_bytes: 8 << 20,
        ..Default::default()
    })
    .unwrap();
    let id = store.open_model(&dir).unwrap();
    for (name, want) in [("a", &a), ("b", &b), ("n", &norm)] {
        let p = manifest.page(name).unwrap();
        let lease = store.acquire(id, p.id).unwrap();
        assert_eq!(lease.bytes(), want.as_slice(), "{name}");
    }
    let m = store.model(id).unwrap();
    let read = m.primary_stats().bytes;
    assert!(
        read < raw_total * 9 / 10,
        "read {read} bytes of {raw_total}: the packed bodies were not used"
    );

    // A damaged body: the raw bytes serve, and the failure is counted.
    let b_entry = manifest.page("b").unwrap();
    let body = b_entry.vpack().unwrap();
    let pack = dir.join(&body.file);
    let mut bytes = std::fs::read(&pack).unwrap();
    bytes[(body.offset + body.len / 2) as usize] ^= 0x55;
    std::fs::write(&pack, bytes).unwrap();
    let store = Store::new(StoreConfig {
        cache_bytes: 8 << 20,
        ..Default::default()
    })
    .unwrap();
    let id = store.open_model(&dir).unwrap();
    let lease = store.acquire(id, b_entry.id).unwrap();
    assert_eq!(lease.bytes(), b.as_slice());
    let s = store.model(id).unwrap().primary_stats();
    assert!(s.integrity_failures + s.errors >= 1, "{s:?}");
}
