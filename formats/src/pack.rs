//! Packing a model store: the lossless vpack body of every BF16/F16 page written to
//! `model.vpack` beside the checkpoint, and the manifest updated to name them (what
//! `vpagectl pack` does, and `voom bench out-of-core` for its packed copy).
//!
//! Every body is decoded again and checked against the manifest's blake3 before it
//! is kept, which proves the body and also that the raw bytes packed were the right
//! ones: a page whose bytes no longer match the manifest fails the whole pack with
//! [`FormatError::ChecksumMismatch`] and nothing is written. The old bodies are
//! dropped from the manifest before `model.vpack` is replaced, so a crash in between
//! never leaves a manifest pointing into a file of other bodies.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::checkpoint::Checkpoint;
use crate::error::{FormatError, Result};
use crate::manifest::{EncodedBody, Encoding, Manifest};
use crate::vpack::{self, PACK_FILE};

/// What a pack did.
#[derive(Debug, Clone, Default)]
pub struct PackReport {
    /// Pages packed, and pages of other types left raw.
    pub pages: usize,
    pub raw_pages: usize,
    /// Bytes of the packed pages, raw and as bodies.
    pub raw_bytes: u64,
    pub packed_bytes: u64,
    /// Length of `model.vpack` (bodies and their alignment padding).
    pub file_bytes: u64,
    /// Time spent encoding and decoding (one thread).
    pub encode: Duration,
    pub decode: Duration,
    pub elapsed: Duration,
}

impl PackReport {
    /// Packed bytes over raw bytes.
    pub fn ratio(&self) -> f64 {
        self.packed_bytes as f64 / self.raw_bytes.max(1) as f64
    }
}

/// Packs the model store in `dir`, whose manifest is `manifest` (updated and saved).
/// `progress` sees the raw bytes packed so far and the total.
pub fn pack_model(
    dir: &Path,
    manifest: &mut Manifest,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<PackReport> {
    let ckpt = Checkpoint::open(dir)?;
    manifest.check_matches(&ckpt)?;
    if manifest.pages.iter().any(|p| p.vpack().is_some()) {
        for p in &mut manifest.pages {
            p.encoded.retain(|e| e.encoding != Encoding::Vpack);
        }
        manifest.format_version = manifest.required_version();
        manifest.save(dir)?;
    }
    let todo: Vec<usize> = (0..manifest.pages.len())
        .filter(|&i| vpack::supports(manifest.pages[i].dtype))
        .collect();
    let total: u64 = todo.iter().map(|&i| manifest.pages[i].len).sum();
    progress(0, total);
    let pack_path = dir.join(PACK_FILE);
    let mut report = PackReport {
        raw_pages: manifest.pages.len() - todo.len(),
        ..PackReport::default()
    };
    let mut bodies: Vec<(usize, u64, u64)> = Vec::with_capacity(todo.len());
    let start = Instant::now();
    let pages = &manifest.pages;
    report.file_bytes = vpack::write_pack_file::<FormatError>(&pack_path, |w| {
        let mut decoded = Vec::new();
        for &i in &todo {
            let page = &pages[i];
            let loc = Manifest::locate(&ckpt, page).ok_or_else(|| FormatError::Missing {
                path: dir.to_path_buf(),
                what: format!("tensor '{}' of the manifest", page.name),
            })?;
            let loc = &loc;
            let raw = ckpt.files[loc.file].tensor_bytes(&loc.info);
            let t = Instant::now();
            let body = vpack::encode(page.dtype, raw)
                .map_err(|e| e.in_page(ckpt.file_path(loc), &page.label()))?;
            report.encode += t.elapsed();
            decoded.resize(raw.len(), 0);
            let t = Instant::now();
            vpack::decode(&body, &mut decoded).map_err(|e| e.in_page(&pack_path, &page.label()))?;
            report.decode += t.elapsed();
            Manifest::verify(page, &decoded, ckpt.file_path(loc))?;
            let offset = w.push(&body)?;
            bodies.push((i, offset, body.len() as u64));
            report.pages += 1;
            report.raw_bytes += raw.len() as u64;
            report.packed_bytes += body.len() as u64;
            progress(report.raw_bytes, total);
        }
        Ok(())
    })?;
    report.elapsed = start.elapsed();
    for (i, offset, len) in bodies {
        manifest.pages[i].encoded.push(EncodedBody {
            encoding: Encoding::Vpack,
            file: PACK_FILE.to_string(),
            offset,
            len,
        });
    }
    manifest.format_version = manifest.required_version();
    manifest.save(dir)?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::DType;

    #[test]
    fn packed_bodies_decode_to_the_pages_and_a_changed_page_packs_nothing() {
        let d = tempfile::tempdir().unwrap();
        let bf16: Vec<u8> = (0..4096u32)
            .flat_map(|i| ((i % 97) as u16 * 3 + 0x3f00).to_le_bytes())
            .collect();
        let f32s: Vec<u8> = (0..64u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let write = |a: &[u8]| {
            crate::safetensors::write(
                &d.path().join("model.safetensors"),
                &[
                    ("a", DType::BF16, &[4096][..], a),
                    ("b", DType::F32, &[64][..], &f32s[..]),
                ],
                &BTreeMap::new(),
            )
            .unwrap()
        };
        write(&bf16);
        let ckpt = Checkpoint::open(d.path()).unwrap();
        let mut m = Manifest::build(&ckpt, &mut |_, _| {}).unwrap();
        drop(ckpt);
        m.save(d.path()).unwrap();
        let r = pack_model(d.path(), &mut m, &mut |_, _| {}).unwrap();
        assert_eq!(
            (r.pages, r.raw_pages, r.raw_bytes),
            (1, 1, bf16.len() as u64)
        );
        assert!(r.packed_bytes < r.raw_bytes, "{r:?}");
        let saved = Manifest::load(d.path()).unwrap().unwrap();
        assert_eq!(saved, m);
        let body = saved.page("a").unwrap().vpack().unwrap().clone();
        let file = std::fs::read(d.path().join(PACK_FILE)).unwrap();
        let mut out = vec![0u8; bf16.len()];
        vpack::decode(&file[body.offset as usize..][..body.len as usize], &mut out).unwrap();
        assert_eq!(out, bf16);
        assert!(saved.page("b").unwrap().vpack().is_none());

        // Page a's bytes change under the manifest: nothing is packed.
        let before = std::fs::read(d.path().join(PACK_FILE)).unwrap();
        let mut changed = bf16.clone();
        changed[10] ^= 1;
        write(&changed);
        let e = pack_model(d.path(), &mut m, &mut |_, _| {}).unwrap_err();
        assert!(matches!(e, FormatError::ChecksumMismatch { .. }), "{e}");
        assert_eq!(std::fs::read(d.path().join(PACK_FILE)).unwrap(), before);
    }
}
