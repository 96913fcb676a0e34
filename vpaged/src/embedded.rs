//! The embedded store: the page store core running inside the engine's process over
//! memory-mapped checkpoint files. It is the default page source: `voom run MODEL`
//! works with nothing else running.
//!
//! # What is guaranteed when the checkpoint's files change under the mapping
//!
//! The store computes in place on the files' pages as the OS maps them, so another
//! process can truncate or rewrite a file while it is served. The store never lets that
//! go unnoticed:
//!
//! - **No signal.** The files are mapped through [`voom_formats::GuardedMap`]: a read past
//!   a truncation reads zeros instead of raising `SIGBUS`, and the fault is recorded;
//!   [`PageSource::check_reads`] then fails with an error naming the file and the byte
//!   offset, and so does every later `acquire` (a faulted mapping is never trusted
//!   again: reopen the model).
//! - **A size and identity check before every lease.** Each acquire `fstat`s the page's
//!   file (its descriptor stays open beside the mapping; one system call per file per
//!   `acquire_many`). A file now shorter than its pages need is a
//!   [`StoreError::Truncated`] naming the file and the byte range of the first page
//!   past its new end. A file whose identity (device, inode,
//!   length, mtime, ctime, link count: [`voom_formats::FileIdentity`]) shows that its
//!   bytes may have changed since a page was verified has that page re-hashed against
//!   the manifest before it is served again, and a page that no longer matches is a
//!   [`StoreError::Integrity`] naming the page and the file, never served. Without a
//!   manifest (or with verification off) there is nothing to re-verify against, and a
//!   changed file is a [`StoreError::FileChanged`] saying that the file changed on disk
//!   since the model was opened.
//! - **A check after every pass.** `check_reads` re-`fstat`s the files: a change that
//!   happened while pages were leased (after their check, before the results are used)
//!   is a [`StoreError::FileChanged`], and the caller discards what it computed.
//!
//! A file replaced by rename keeps being served from the old inode the mapping holds:
//! the same verified bytes, the same results. Limits: changes are seen through the
//! file's timestamps, so a write that lands within the file system's timestamp
//! granularity of the previous observed change can go unseen where timestamps are
//! coarse (Linux 6.13 and later give ext4, xfs, btrfs and tmpfs fine-grained
//! timestamps once they have been read, which this store does); a writer that also puts
//! the mtime back *and* changes the link count between two checks is taken for a
//! rename; writes through another process's shared writable mapping update the
//! timestamps only on the first write to each page after it was written back. The
//! first-use hash is exact for the bytes it hashed. The page cache (`--cache-budget`)
//! and the daemon copy pages into memory they own and are not subject to any of this.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use voom_formats::checkpoint::TensorLocation;
use voom_formats::manifest::{Manifest, PageEntry};
use voom_formats::{Checkpoint, FileIdentity};

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

/// `verified[page]` before the page was ever verified. Files start at epoch 1.
const NEVER: u64 = 0;

/// What the store has seen of one mapped file.
struct Watch {
    /// The identity at the last observation (an acquire's or a `check_reads`').
    seen: FileIdentity,
    /// Advanced whenever an observation shows that the bytes may have changed; a page
    /// verified at an older epoch is re-verified before it is served.
    epoch: u64,
    /// The bytes may have changed at least once since the store opened.
    changed: bool,
    /// Pages of the file were leased since the last `check_reads`.
    in_use: bool,
    /// An acquire saw the bytes change while `in_use`: what changed.
    changed_in_use: Option<String>,
}

impl Watch {
    /// Records `now`; returns what changed when the bytes may differ from the previous
    /// observation.
    fn observe(&mut self, now: FileIdentity) -> Option<String> {
        if now == self.seen {
            return None;
        }
        let change = now
            .content_may_differ(&self.seen)
            .then(|| now.differences(&self.seen));
        self.seen = now;
        if change.is_some() {
            self.epoch += 1;
            self.changed = true;
        }
        change
    }
}

pub struct EmbeddedStore {
    dir: PathBuf,
    ckpt: Arc<Checkpoint>,
    pages: Vec<PageMeta>,
    /// Where each page's bytes are in the checkpoint.
    locs: Vec<TensorLocation>,
    /// Manifest entry of each page, when the store has a manifest and verification is on.
    entries: Option<Vec<PageEntry>>,
    /// The file epoch at which each page was last verified (`NEVER`: not yet).
    verified: Vec<AtomicU64>,
    /// One per checkpoint file (`ckpt.files` order).
    files: Vec<Mutex<Watch>>,
    /// The end of each file's last page: the length the file must keep.
    file_ends: Vec<u64>,
}

impl EmbeddedStore {
    /// Opens a model store directory. With a manifest (`voom-manifest.json`), the
    /// manifest must describe the checkpoint exactly (a stale one is an error), page ids
    /// are the manifest's, and pages are verified per `verify`.
    pub fn open(dir: &Path, verify: VerifyMode) -> Result<Self, StoreError> {
        let ckpt = Checkpoint::open(dir)?;
        let manifest = Manifest::load(dir)?;
        let mut pages = Vec::new();
        let mut locs = Vec::new();
        let mut entries = None;
        match manifest {
            Some(m) => {
                m.check_matches(&ckpt)?;
                crate::store::warn_if_experts_ungrouped(
                    &m,
                    &dir.join(voom_formats::manifest::MANIFEST_FILE),
                );
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
                    pages.push(PageMeta::from_entry(e));
                    let loc = Manifest::locate(&ckpt, e).ok_or_else(|| StoreError::Store {
                        store: dir.to_path_buf(),
                        detail: format!("page '{}' is not in the checkpoint", e.label()),
                    })?;
                    locs.push(loc);
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
                        rows: None,
                    });
                    locs.push(loc.clone());
                }
            }
        }
        let verified = (0..pages.len()).map(|_| AtomicU64::new(NEVER)).collect();
        let files = ckpt
            .files
            .iter()
            .map(|f| {
                Mutex::new(Watch {
                    seen: f.identity(),
                    epoch: 1,
                    changed: false,
                    in_use: false,
                    changed_in_use: None,
                })
            })
            .collect();
        let mut file_ends = vec![0; ckpt.files.len()];
        for l in &locs {
            file_ends[l.file] = file_ends[l.file].max(l.info.offset + l.info.len);
        }
        let store = EmbeddedStore {
            file_ends,
            dir: dir.to_path_buf(),
            ckpt: Arc::new(ckpt),
            pages,
            locs,
            entries,
            verified,
            files,
        };
        if verify == VerifyMode::Eager {
            for p in &store.pages {
                store.acquire(p.id)?;
            }
            store.check_reads()?;
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

    fn loc(&self, id: PageId) -> Result<&TensorLocation, StoreError> {
        self.locs
            .get(id.0 as usize)
            .ok_or_else(|| StoreError::NoSuchPage {
                id: id.0,
                store: self.dir.clone(),
            })
    }

    fn bytes_of(&self, loc: &TensorLocation) -> &[u8] {
        self.ckpt.files[loc.file].tensor_bytes(&loc.info)
    }

    fn watch(&self, file: usize) -> MutexGuard<'_, Watch> {
        // A panic while holding the lock leaves a consistent Watch (plain fields).
        self.files[file]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The size and identity check of `file` before pages of it are leased. Returns the
    /// file's epoch, against which the pages are verified.
    fn check_file(&self, file: usize) -> Result<u64, StoreError> {
        let f = &self.ckpt.files[file];
        f.check_faults()?;
        let now = f.current_identity()?;
        let mut w = self.watch(file);
        if let Some(what) = w.observe(now) {
            if w.in_use {
                w.changed_in_use.get_or_insert(what);
            }
        }
        // Shorter than its pages need, the file cannot serve the model: the first page
        // past the new end is named, whichever pages were asked for.
        if now.len < self.file_ends[file] {
            let loc = self
                .locs
                .iter()
                .filter(|l| l.file == file && l.info.offset + l.info.len > now.len)
                .min_by_key(|l| l.info.offset)
                .expect("a page ends past the file's length");
            return Err(StoreError::Truncated {
                file: f.path.clone(),
                page: loc.info.name.clone(),
                start: loc.info.offset,
                end: loc.info.offset + loc.info.len,
                len: now.len,
            });
        }
        if w.changed && self.entries.is_none() {
            return Err(StoreError::FileChanged {
                file: f.path.clone(),
                detail: format!(
                    "the file changed on disk since the model was opened ({}) and there is \
                     no manifest (or verification is off) to re-verify its pages against: \
                     reopen the model",
                    now.differences(&f.identity())
                ),
            });
        }
        w.in_use = true;
        Ok(w.epoch)
    }

    /// Hashes the page against the manifest unless it was verified at `epoch` already.
    fn verify(&self, id: PageId, epoch: u64) -> Result<(), StoreError> {
        let Some(entries) = &self.entries else {
            return Ok(());
        };
        let flag = &self.verified[id.0 as usize];
        if flag.load(Ordering::Acquire) >= epoch {
            return Ok(());
        }
        let loc = &self.locs[id.0 as usize];
        let file = &self.ckpt.files[loc.file];
        let actual = blake3::hash(self.bytes_of(loc)).to_hex().to_string();
        // Zeros read past a truncation are a fault, not a mismatch.
        file.check_faults()?;
        let entry = &entries[id.0 as usize];
        if actual != entry.blake3 {
            let changed = if epoch > 1 {
                ", which changed on disk after the model was opened"
            } else {
                ""
            };
            return Err(StoreError::Integrity {
                page: entry.name.clone(),
                tier: format!("primary ({}{changed})", file.path.display()),
                expected: entry.blake3.clone(),
                actual,
            });
        }
        flag.fetch_max(epoch, Ordering::AcqRel);
        Ok(())
    }

    fn lease(&self, id: PageId) -> PageLease {
        let bytes = self.bytes_of(&self.locs[id.0 as usize]);
        let holder: Arc<Checkpoint> = Arc::clone(&self.ckpt);
        // SAFETY: `bytes` lies in a read-only mapping owned by the checkpoint, which the
        // lease keeps alive through `holder`; the mapping is never unmapped while the
        // checkpoint lives. Another process changing the file under it is detected, not
        // prevented: `check_reads` reports it (module documentation).
        unsafe { PageLease::new(id, bytes.as_ptr(), bytes.len(), holder) }
    }
}

impl PageSource for EmbeddedStore {
    fn pages(&self) -> &[PageMeta] {
        &self.pages
    }

    fn acquire(&self, id: PageId) -> Result<PageLease, StoreError> {
        let file = self.loc(id)?.file;
        let epoch = self.check_file(file)?;
        self.verify(id, epoch)?;
        Ok(self.lease(id))
    }

    /// One size and identity check per file for all of `ids` (a layer's pages are in
    /// one file, or two).
    fn acquire_many(&self, ids: &[PageId]) -> Result<Vec<PageLease>, StoreError> {
        let mut checked: Vec<(usize, u64)> = Vec::with_capacity(2);
        for &id in ids {
            let file = self.loc(id)?.file;
            let epoch = match checked.iter().find(|c| c.0 == file) {
                Some(&(_, epoch)) => epoch,
                None => {
                    let epoch = self.check_file(file)?;
                    checked.push((file, epoch));
                    epoch
                }
            };
            self.verify(id, epoch)?;
        }
        Ok(ids.iter().map(|&id| self.lease(id)).collect())
    }

    /// Fails when a read of any file faulted (truncated under the mapping), or when a
    /// file changed on disk while its pages were leased since the previous call.
    /// A lease is the mapped file: only the bytes touched are read.
    fn partial_reads(&self) -> bool {
        true
    }

    fn check_reads(&self) -> Result<(), StoreError> {
        for (i, f) in self.ckpt.files.iter().enumerate() {
            f.check_faults()?;
            let now = f.current_identity()?;
            let mut w = self.watch(i);
            let change = w.observe(now);
            let in_use = std::mem::take(&mut w.in_use);
            let under_use = w.changed_in_use.take();
            if let Some(what) = under_use.or(change.filter(|_| in_use)) {
                return Err(StoreError::FileChanged {
                    file: f.path.clone(),
                    detail: format!(
                        "the file changed on disk while pages of it were in use ({what}): \
                         what was computed from them is discarded"
                    ),
                });
            }
        }
        Ok(())
    }

    /// With a manifest and verification on (first use or eager); a page whose file
    /// changed since it was verified is verified again before it is served.
    fn verifies(&self) -> bool {
        self.entries.is_some()
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
            .unwrap()
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

    /// A store of two tensors: "small" (64 bytes) and "big" (64 KiB, many pages, after
    /// it), with a manifest if `manifest`. Returns the file and big's byte range.
    fn write_big_store(dir: &Path, manifest: bool) -> (PathBuf, std::ops::Range<u64>) {
        let small: Vec<u8> = (0..64u8).collect();
        let big: Vec<u8> = (0..(64u32 << 10)).map(|i| (i % 251) as u8 + 1).collect();
        let f = dir.join("model.safetensors");
        voom_formats::safetensors::write(
            &f,
            &[
                ("small", DType::U8, &[64], &small),
                ("big", DType::U8, &[big.len()], &big),
            ],
            &BTreeMap::new(),
        )
        .unwrap();
        let ckpt = Checkpoint::open(dir).unwrap();
        if manifest {
            Manifest::build(&ckpt, &mut |_, _| {})
                .unwrap()
                .save(dir)
                .unwrap();
        }
        let range = ckpt.get("big").unwrap().info.range();
        (f, range)
    }

    fn writable(f: &Path) -> std::fs::File {
        std::fs::OpenOptions::new().write(true).open(f).unwrap()
    }

    fn sum(lease: &PageLease) -> u64 {
        lease.bytes().iter().map(|&b| u64::from(b)).sum()
    }

    /// Defect 4 at the store: a leased page read after its file was truncated reads
    /// zeros instead of killing the process with SIGBUS, and check_reads names the file
    /// and the offset; the store never serves from that mapping again.
    #[test]
    fn sigbus_a_lease_read_after_truncation_is_reported_by_check_reads() {
        for manifest in [true, false] {
            let d = tempfile::tempdir().unwrap();
            let (f, big) = write_big_store(d.path(), manifest);
            let s = EmbeddedStore::open(d.path(), VerifyMode::FirstUse).unwrap();
            let id = s.find("big").unwrap().id;
            let full = sum(&s.acquire(id).unwrap());
            s.check_reads().unwrap();

            let lease = s.acquire(id).unwrap();
            let cut = big.start + 5000;
            writable(&f).set_len(cut).unwrap();
            assert!(sum(&lease) < full, "the bytes past the cut read as zeros");
            drop(lease);
            let e = s.check_reads().unwrap_err();
            let msg = e.to_string();
            match &e {
                StoreError::Format(voom_formats::FormatError::Fault { path, offset }) => {
                    assert_eq!(path, &f);
                    assert!((cut..big.end).contains(offset), "{msg}");
                    assert!(msg.contains(&format!("byte offset {offset}")), "{msg}");
                }
                other => panic!("expected a fault, got {other}"),
            }
            assert!(msg.contains("model.safetensors"), "{msg}");
            // Sticky: every later acquire and check fails too, even of the page still
            // inside the file.
            assert!(s.acquire(s.find("small").unwrap().id).is_err());
            assert!(s.check_reads().is_err());
        }
    }

    /// Defect 4 before a read: a page past the file's new end is an error naming the
    /// file and the page's byte range, and nothing is read.
    #[test]
    fn sigbus_a_page_past_a_truncation_is_an_error_naming_file_and_range() {
        for manifest in [true, false] {
            let d = tempfile::tempdir().unwrap();
            let (f, big) = write_big_store(d.path(), manifest);
            let s = EmbeddedStore::open(d.path(), VerifyMode::FirstUse).unwrap();
            writable(&f).set_len(big.start + 10).unwrap();
            let e = s.acquire(s.find("big").unwrap().id).unwrap_err();
            match &e {
                StoreError::Truncated {
                    file,
                    page,
                    start,
                    end,
                    len,
                } => {
                    assert_eq!(file, &f);
                    assert_eq!((page.as_str(), *start, *end), ("big", big.start, big.end));
                    assert_eq!(*len, big.start + 10);
                }
                other => panic!("expected Truncated, got {other}"),
            }
            let msg = e.to_string();
            assert!(
                msg.contains(&format!("bytes {}..{}", big.start, big.end)),
                "{msg}"
            );
            // No read happened: the mapping is not faulted.
            s.checkpoint().files[0].check_faults().unwrap();
        }
    }

    /// Defect 5 at the store: a page overwritten in place after its first-use
    /// verification is re-hashed before it is served again, and fails, naming the
    /// page and the file; pages of the file that did not change are re-hashed and
    /// served.
    #[test]
    fn changed_bytes_after_verification_are_reverified_and_never_served() {
        use std::os::unix::fs::FileExt;
        let d = tempfile::tempdir().unwrap();
        let (f, big) = write_big_store(d.path(), true);
        let s = EmbeddedStore::open(d.path(), VerifyMode::FirstUse).unwrap();
        let (small, bigid) = (s.find("small").unwrap().id, s.find("big").unwrap().id);
        let before = sum(&s.acquire(bigid).unwrap());
        s.acquire(small).unwrap();
        s.check_reads().unwrap();

        writable(&f)
            .write_all_at(&[0xAA; 16], big.start + 40000)
            .unwrap();
        let e = s.acquire(bigid).unwrap_err();
        match &e {
            StoreError::Integrity { page, tier, .. } => {
                assert_eq!(page, "big");
                assert!(tier.contains("model.safetensors"), "{tier}");
                assert!(tier.contains("changed on disk"), "{tier}");
            }
            other => panic!("expected Integrity, got {other}"),
        }
        // Still never served, however often it is asked for.
        assert!(matches!(
            s.acquire(bigid),
            Err(StoreError::Integrity { .. })
        ));
        assert!(matches!(
            s.acquire_many(&[small, bigid]),
            Err(StoreError::Integrity { .. })
        ));
        // The unchanged page is re-verified and served.
        assert_eq!(
            s.acquire(small).unwrap().bytes(),
            (0..64u8).collect::<Vec<_>>()
        );
        // Put back, the page verifies again.
        let orig: Vec<u8> = (40000..40016u64).map(|i| (i % 251) as u8 + 1).collect();
        writable(&f).write_all_at(&orig, big.start + 40000).unwrap();
        assert_eq!(sum(&s.acquire(bigid).unwrap()), before);
    }

    /// Defect 5 without a manifest: nothing to re-verify against, so a changed file is an
    /// error saying so, for every page of it.
    #[test]
    fn without_a_manifest_a_changed_file_is_an_error() {
        use std::os::unix::fs::FileExt;
        for (manifest, verify) in [(false, VerifyMode::FirstUse), (true, VerifyMode::Off)] {
            let d = tempfile::tempdir().unwrap();
            let (f, big) = write_big_store(d.path(), manifest);
            let s = EmbeddedStore::open(d.path(), verify).unwrap();
            let small = s.find("small").unwrap().id;
            s.acquire(small).unwrap();
            s.check_reads().unwrap();
            writable(&f).write_all_at(&[7; 4], big.start + 3).unwrap();
            for _ in 0..2 {
                let e = s.acquire(small).unwrap_err();
                assert!(
                    matches!(&e, StoreError::FileChanged { file, .. } if file == &f),
                    "{e}"
                );
                assert!(
                    e.to_string()
                        .contains("changed on disk since the model was opened"),
                    "{e}"
                );
            }
        }
    }

    /// A file that changes while its pages are leased (after their checks, before the
    /// results are used) is reported by check_reads, once; the next acquire re-verifies.
    #[test]
    fn a_change_while_pages_are_leased_is_reported_by_check_reads() {
        use std::os::unix::fs::FileExt;
        let d = tempfile::tempdir().unwrap();
        let (f, big) = write_big_store(d.path(), true);
        let s = EmbeddedStore::open(d.path(), VerifyMode::FirstUse).unwrap();
        let small = s.find("small").unwrap().id;
        let bigid = s.find("big").unwrap().id;
        let leases = s.acquire_many(&[small, bigid]).unwrap();
        let w = writable(&f);
        w.write_all_at(&[1; 8], big.start + 100).unwrap();
        drop(leases);
        let e = s.check_reads().unwrap_err();
        assert!(
            matches!(&e, StoreError::FileChanged { file, .. } if file == &f),
            "{e}"
        );
        assert!(
            e.to_string().contains("while pages of it were in use"),
            "{e}"
        );
        // Also when the change is seen by a later acquire of the same pass.
        let l = s.acquire(small).unwrap();
        s.check_reads().unwrap();
        drop(l);
        let l = s.acquire(small).unwrap();
        w.write_all_at(&[2; 8], big.start + 100).unwrap();
        assert!(matches!(
            s.acquire(bigid),
            Err(StoreError::Integrity { .. })
        ));
        drop(l);
        assert!(matches!(
            s.check_reads(),
            Err(StoreError::FileChanged { .. })
        ));
        // With nothing leased, a change is no error of check_reads (acquires re-verify).
        s.check_reads().unwrap();
        w.write_all_at(&[3; 8], big.start + 100).unwrap();
        s.check_reads().unwrap();
    }

    /// A file touched (its times changed, its bytes not) has its pages re-hashed, and
    /// they are served as before.
    #[test]
    fn a_touched_file_is_reverified_and_served() {
        let d = tempfile::tempdir().unwrap();
        let (f, _) = write_big_store(d.path(), true);
        let s = EmbeddedStore::open(d.path(), VerifyMode::Eager).unwrap();
        let bigid = s.find("big").unwrap().id;
        let before = sum(&s.acquire(bigid).unwrap());
        s.check_reads().unwrap();
        writable(&f)
            .set_modified(std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(7))
            .unwrap();
        assert_eq!(sum(&s.acquire(bigid).unwrap()), before);
        s.check_reads().unwrap();
    }

    /// A file replaced by rename keeps being served from the old inode: the same
    /// verified bytes, with or without a manifest; a new store sees the new file.
    #[test]
    fn a_file_replaced_by_rename_keeps_serving_the_verified_old_bytes() {
        for manifest in [true, false] {
            let d = tempfile::tempdir().unwrap();
            let (f, _) = write_big_store(d.path(), manifest);
            let s = EmbeddedStore::open(d.path(), VerifyMode::FirstUse).unwrap();
            let bigid = s.find("big").unwrap().id;
            let old = s.acquire(bigid).unwrap().bytes().to_vec();
            s.check_reads().unwrap();
            let other = tempfile::tempdir().unwrap();
            let new_big = vec![9u8; old.len()];
            voom_formats::safetensors::write(
                &other.path().join("model.safetensors"),
                &[
                    ("small", DType::U8, &[64], &[5u8; 64]),
                    ("big", DType::U8, &[new_big.len()], &new_big),
                ],
                &BTreeMap::new(),
            )
            .unwrap();
            std::fs::copy(
                other.path().join("model.safetensors"),
                d.path().join("new.tmp"),
            )
            .unwrap();
            std::fs::rename(d.path().join("new.tmp"), &f).unwrap();
            for _ in 0..2 {
                let l = s.acquire(bigid).unwrap();
                assert_eq!(l.bytes(), &old[..]);
                drop(l);
                s.check_reads().unwrap();
            }
            assert_eq!(
                s.acquire(s.find("small").unwrap().id).unwrap().bytes(),
                (0..64u8).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn a_stale_manifest_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        write_store(d.path());
        let ckpt = Checkpoint::open(d.path()).unwrap();
        let mut m = Manifest::build(&ckpt, &mut |_, _| {}).unwrap();
        drop(ckpt);
        m.pages[0].shape = vec![8, 4];
        m.save(d.path()).unwrap();
        assert!(EmbeddedStore::open(d.path(), VerifyMode::FirstUse).is_err());
    }
}
