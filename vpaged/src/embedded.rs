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
