//! The embedded store: the page store core running inside the engine's process over
//! memory-mapped checkpoint files. It is the default page source: `voom run MODEL`
//! works with nothing else running.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use voom_formats::manifest::{Manifest, PageEntry};
use voom_formats::Checkpoint;

use crate::source::{PageId, PageLease, PageMeta, PageSource};
use crate::StoreError;

/// When pages are checked against the manifest's blake3.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VerifyMode {
    /// Never (also what happens when the store has no manifest).
    Off,
    /// Each page once, on its first acquire, before its bytes are handed out.
    #[default]
    FirstUse,
    /// Every page when the store opens.
    Eager,
}

const UNVERIFIED: u8 = 0;
const VERIFIED: u8 = 1;

pub struct EmbeddedStore {
    dir: PathBuf,
    ckpt: Arc<Checkpoint>,
    pages: Vec<PageMeta>,
    /// Manifest entry of each page, when the store has a manifest and verification is on.
    entries: Option<Vec<PageEntry>>,
    verified: Vec<AtomicU8>,
}

impl EmbeddedStore {
    /// Opens a model store directory. With a manifest (`voom-manifest.json`), the
    /// manifest must describe the checkpoint exactly (a stale one is an error), page ids
    /// are the manifest's, and pages are verified per `verify`.
    pub fn open(dir: &Path, verify: VerifyMode) -> Result<Self, StoreError> {
        let ckpt = Checkpoint::open(dir)?;
        let manifest = Manifest::load(dir)?;
        let mut pages = Vec::new();
        let mut entries = None;
        match manifest {
            Some(m) => {
                m.check_matches(&ckpt)?;
                for (i, e) in m.pages.iter().enumerate() {
                    if e.id as usize != i {
                        return Err(StoreError::Store {
                            store: dir.to_path_buf(),
                            detail: format!(
                                "manifest page '{}' has id {} at index {i}",
                                e.name, e.id
                            ),
                        });
                    }
                    pages.push(PageMeta {
                        id: PageId(e.id),
                        name: e.name.clone(),
                        dtype: e.dtype,
                        shape: e.shape.clone(),
                        len: e.len,
                    });
                }
                if verify != VerifyMode::Off {
                    entries = Some(m.pages);
                }
            }
            None => {
                for (i, (name, loc)) in ckpt.tensors().enumerate() {
                    pages.push(PageMeta {
                        id: PageId(i as u32),
                        name: name.to_string(),
                        dtype: loc.info.dtype,
                        shape: loc.info.shape.clone(),
                        len: loc.info.len,
                    });
                }
            }
        }
        let verified = (0..pages.len())
            .map(|_| AtomicU8::new(UNVERIFIED))
            .collect();
        let store = EmbeddedStore {
            dir: dir.to_path_buf(),
            ckpt: Arc::new(ckpt),
            pages,
            entries,
            verified,
        };
        if verify == VerifyMode::Eager {
            for p in &store.pages {
                store.verify_once(p.id)?;
            }
        }
        Ok(store)
    }

    /// The model store directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn checkpoint(&self) -> &Checkpoint {
        &self.ckpt
    }

    fn bytes_of(&self, id: PageId) -> Result<&[u8], StoreError> {
        let meta = self
            .pages
            .get(id.0 as usize)
            .ok_or_else(|| StoreError::NoSuchPage {
                id: id.0,
                store: self.dir.clone(),
            })?;
        self.ckpt
            .tensor_bytes(&meta.name)
            .ok_or_else(|| StoreError::Store {
                store: self.dir.clone(),
                detail: format!("page '{}' is not in the checkpoint", meta.name),
            })
    }

    fn verify_once(&self, id: PageId) -> Result<(), StoreError> {
        let Some(entries) = &self.entries else {
            return Ok(());
        };
        let flag = &self.verified[id.0 as usize];
        if flag.load(Ordering::Acquire) == VERIFIED {
            return Ok(());
        }
        let bytes = self.bytes_of(id)?;
        let entry = &entries[id.0 as usize];
        let actual = blake3::hash(bytes).to_hex().to_string();
        if actual != entry.blake3 {
            return Err(StoreError::Integrity {
                page: entry.name.clone(),
                tier: format!("primary ({})", self.dir.join(&entry.file).display()),
                expected: entry.blake3.clone(),
                actual,
            });
        }
        flag.store(VERIFIED, Ordering::Release);
        Ok(())
    }
}

impl PageSource for EmbeddedStore {
    fn pages(&self) -> &[PageMeta] {
        &self.pages
    }

    fn acquire(&self, id: PageId) -> Result<PageLease, StoreError> {
        self.verify_once(id)?;
        let bytes = self.bytes_of(id)?;
        let holder: Arc<Checkpoint> = Arc::clone(&self.ckpt);
        // SAFETY: `bytes` lies in a read-only mapping owned by the checkpoint, which the
        // lease keeps alive through `holder`; the mapping is never written or unmapped
        // while the checkpoint lives.
        Ok(unsafe { PageLease::new(id, bytes.as_ptr(), bytes.len(), holder) })
    }

    fn describe(&self) -> String {
        format!("embedded:{}", self.dir.display())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use voom_formats::DType;

    use super::*;

    fn write_store(dir: &Path) {
        let a: Vec<u8> = (0..64u8).collect();
        let b: Vec<u8> = (0..32u8).map(|x| x.wrapping_mul(7)).collect();
        voom_formats::safetensors::write(
            &dir.join("model.safetensors"),
            &[("a", DType::BF16, &[4, 8], &a), ("b", DType::F32, &[8], &b)],
            &BTreeMap::new(),
        )
        .unwrap();
    }

    #[test]
    fn serves_pages_in_place_without_a_manifest() {
        let d = tempfile::tempdir().unwrap();
        write_store(d.path());
        let s = EmbeddedStore::open(d.path(), VerifyMode::FirstUse).unwrap();
        let a = s.find("a").unwrap().clone();
        assert_eq!(
            (a.dtype, a.shape.clone(), a.len),
            (DType::BF16, vec![4, 8], 64)
        );
        let lease = s.acquire(a.id).unwrap();
        assert_eq!(lease.bytes(), (0..64u8).collect::<Vec<_>>().as_slice());
        // In place: the lease points into the checkpoint's mapping.
        let mapped = s.checkpoint().tensor_bytes("a").unwrap();
        assert_eq!(lease.bytes().as_ptr(), mapped.as_ptr());
        assert!(matches!(
            s.acquire(PageId(99)),
            Err(StoreError::NoSuchPage { id: 99, .. })
        ));
    }

    #[test]
    fn a_flipped_byte_is_never_served_and_names_page_and_tier() {
        let d = tempfile::tempdir().unwrap();
        write_store(d.path());
        let ckpt = Checkpoint::open(d.path()).unwrap();
        Manifest::build(&ckpt, &mut |_, _| {})
            .save(d.path())
            .unwrap();
        let off = ckpt.get("b").unwrap().info.offset as usize;
        drop(ckpt);
        let f = d.path().join("model.safetensors");
        let mut bytes = std::fs::read(&f).unwrap();
        bytes[off + 3] ^= 1;
        std::fs::write(&f, bytes).unwrap();

        let s = EmbeddedStore::open(d.path(), VerifyMode::FirstUse).unwrap();
        assert!(s.acquire(s.find("a").unwrap().id).is_ok());
        let err = s.acquire(s.find("b").unwrap().id).unwrap_err();
        match &err {
            StoreError::Integrity {
                page,
                tier,
                expected,
                actual,
            } => {
                assert_eq!(page, "b");
                assert!(tier.contains("model.safetensors"), "{tier}");
                assert_ne!(expected, actual);
            }
            other => panic!("expected an integrity error, got {other}"),
        }
        // Eager verification refuses to open the store at all.
        assert!(EmbeddedStore::open(d.path(), VerifyMode::Eager).is_err());
        // Verification off serves the bytes as they are.
        let s = EmbeddedStore::open(d.path(), VerifyMode::Off).unwrap();
        assert!(s.acquire(s.find("b").unwrap().id).is_ok());
    }

    #[test]
    fn a_stale_manifest_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        write_store(d.path());
        let ckpt = Checkpoint::open(d.path()).unwrap();
        let mut m = Manifest::build(&ckpt, &mut |_, _| {});
        drop(ckpt);
        m.pages[0].shape = vec![8, 4];
        m.save(d.path()).unwrap();
        assert!(EmbeddedStore::open(d.path(), VerifyMode::FirstUse).is_err());
    }
}
