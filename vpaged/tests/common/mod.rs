//! Fixtures the vpaged integration tests share.

// Each test binary uses its own part.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use voom_formats::{Checkpoint, DType, Manifest};

/// A four-page model store (40 000 bytes a page) under `dir`; returns its directory
/// and each page's bytes. `seed` changes every byte (a rewritten model).
pub fn model(dir: &Path, seed: u8) -> (PathBuf, Vec<Vec<u8>>) {
    let m = dir.join("m");
    std::fs::create_dir_all(&m).unwrap();
    let pages: Vec<Vec<u8>> = (0..4u8)
        .map(|i| {
            (0..40_000u32)
                .map(|j| (j as u8).wrapping_mul(i + 3).wrapping_add(seed))
                .collect()
        })
        .collect();
    let names = ["a", "b", "c", "d"];
    let shape = [20_000usize];
    let tensors: Vec<(&str, DType, &[usize], &[u8])> = names
        .iter()
        .zip(&pages)
        .map(|(n, p)| (*n, DType::BF16, &shape[..], p.as_slice()))
        .collect();
    voom_formats::safetensors::write(&m.join("model.safetensors"), &tensors, &BTreeMap::new())
        .unwrap();
    Manifest::build(&Checkpoint::open(&m).unwrap(), &mut |_, _| {})
        .unwrap()
        .save(&m)
        .unwrap();
    (m.canonicalize().unwrap(), pages)
}

/// [`model`] with its BF16 pages packed (`vpagectl pack`): every page has a vpack body
/// in `model.vpack`. Returns the directory, each page's bytes and the manifest.
pub fn packed_model(dir: &Path) -> (PathBuf, Vec<Vec<u8>>, Manifest) {
    let (m, pages) = model(dir, 0);
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_vpagectl"))
        .arg("pack")
        .arg(&m)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let manifest = Manifest::load(&m).unwrap().unwrap();
    assert!(manifest.pages.iter().all(|p| p.vpack().is_some()));
    (m, pages, manifest)
}

/// Weight-like BF16 bytes of `n` elements (small magnitudes, so the high plane
/// compresses), a stream per `seed`.
pub fn weights(n: usize, seed: u32) -> Vec<u8> {
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

/// A packed model of `layers` decoder layers, each two BF16 matrices of
/// `rows` x 256 (named as a Llama's, so the manifest groups them by layer); returns
/// its manifest and each page's bytes by page id.
pub fn layered_packed_model(dir: &Path, layers: usize, rows: usize) -> (Manifest, Vec<Vec<u8>>) {
    std::fs::create_dir_all(dir).unwrap();
    let names: Vec<String> = (0..layers)
        .flat_map(|l| {
            [
                format!("model.layers.{l}.mlp.up_proj.weight"),
                format!("model.layers.{l}.mlp.down_proj.weight"),
            ]
        })
        .collect();
    let bytes: Vec<Vec<u8>> = (0..names.len())
        .map(|i| weights(rows * 256, 100 + i as u32))
        .collect();
    let shape = [rows, 256];
    let tensors: Vec<(&str, DType, &[usize], &[u8])> = names
        .iter()
        .zip(&bytes)
        .map(|(n, b)| (n.as_str(), DType::BF16, &shape[..], b.as_slice()))
        .collect();
    voom_formats::safetensors::write(&dir.join("model.safetensors"), &tensors, &BTreeMap::new())
        .unwrap();
    for cmd in ["hash", "pack"] {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_vpagectl"))
            .arg(cmd)
            .arg(dir)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let manifest = Manifest::load(dir).unwrap().unwrap();
    let by_id = manifest
        .pages
        .iter()
        .map(|p| bytes[names.iter().position(|n| *n == p.name).unwrap()].clone())
        .collect();
    (manifest, by_id)
}

/// Makes `path` a FIFO (replacing what is there): opening it blocks until a writer
/// comes, as I/O on a hung mount does.
pub fn mkfifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    let st = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(st.success(), "mkfifo {}", path.display());
}
