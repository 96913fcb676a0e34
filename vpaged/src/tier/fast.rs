//! The fast tier: a bounded directory on fast storage (an internal SSD) holding staged
//! copies of hot pages, so their reads leave the slow tier's per-token path.
//!
//! Copies are content-addressed by the blake3 of the page's decoded bytes
//! (`<dir>/<first two hex digits>/<hash>.page`), so one copy serves every model store
//! holding the same page, and a copy is only ever trusted after the store re-hashes it
//! against the manifest. Staging writes a temporary file and renames it, so a crash
//! never leaves a partial copy under a page's name. The index is rebuilt from the
//! directory when the tier opens.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use super::{TierCounters, TierError, TierStats};

struct Entry {
    len: u64,
    /// Logical clock of the last stage or read (for eviction).
    last_use: u64,
}

struct Index {
    entries: HashMap<String, Entry>,
    used: u64,
    clock: u64,
}

pub struct FastTier {
    name: String,
    dir: PathBuf,
    capacity: u64,
    index: Mutex<Index>,
    counters: TierCounters,
}

fn is_hash(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl FastTier {
    /// Opens (creating) the tier at `dir`, holding at most `capacity` bytes of copies.
    /// Leftover temporary files of an interrupted stage are removed.
    pub fn open(
        name: impl Into<String>,
        dir: impl Into<PathBuf>,
        capacity: u64,
    ) -> Result<Self, TierError> {
        let name = name.into();
        let dir = dir.into();
        let io = |path: &Path, source| TierError::Io {
            tier: name.clone(),
            path: path.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
        let mut entries = HashMap::new();
        let mut used = 0;
        for sub in std::fs::read_dir(&dir).map_err(|e| io(&dir, e))? {
            let sub = sub.map_err(|e| io(&dir, e))?.path();
            if !sub.is_dir() {
                continue;
            }
            for f in std::fs::read_dir(&sub).map_err(|e| io(&sub, e))? {
                let p = f.map_err(|e| io(&sub, e))?.path();
                let fname = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                if let Some(hash) = fname.strip_suffix(".page").filter(|h| is_hash(h)) {
                    let len = p.metadata().map_err(|e| io(&p, e))?.len();
                    used += len;
                    entries.insert(hash.to_string(), Entry { len, last_use: 0 });
                } else if fname.ends_with(".tmp") {
                    let _ = std::fs::remove_file(&p);
                }
            }
        }
        Ok(FastTier {
            name,
            dir,
            capacity,
            index: Mutex::new(Index {
                entries,
                used,
                clock: 0,
            }),
            counters: TierCounters::default(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn used(&self) -> u64 {
        self.lock().used
    }

    pub fn stats(&self) -> TierStats {
        self.counters.snapshot()
    }

    pub fn counters(&self) -> &TierCounters {
        &self.counters
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn path(&self, hash: &str) -> PathBuf {
        self.dir.join(&hash[..2]).join(format!("{hash}.page"))
    }

    fn check_hash(&self, hash: &str) -> Result<(), TierError> {
        if is_hash(hash) {
            Ok(())
        } else {
            Err(TierError::Invalid {
                tier: self.name.clone(),
                detail: format!("'{hash}' is not a lowercase blake3 hex digest"),
            })
        }
    }

    /// Whether a copy of the page with this hash is staged.
    pub fn contains(&self, hash: &str) -> bool {
        self.lock().entries.contains_key(hash)
    }

    /// The staged pages' hashes and lengths.
    pub fn list(&self) -> Vec<(String, u64)> {
        let mut v: Vec<_> = self
            .lock()
            .entries
            .iter()
            .map(|(h, e)| (h.clone(), e.len))
            .collect();
        v.sort();
        v
    }

    /// Reads the staged copy of `hash` into `buf`. The caller verifies the bytes.
    pub fn read(&self, hash: &str, buf: &mut [u8]) -> Result<(), TierError> {
        self.check_hash(hash)?;
        let path = self.path(hash);
        let start = Instant::now();
        let r = (|| {
            let f = voom_formats::file::open(&path).map_err(|source| TierError::Io {
                tier: self.name.clone(),
                path: path.clone(),
                source,
            })?;
            let file_len = f.metadata().map(|m| m.len()).unwrap_or(0);
            if file_len != buf.len() as u64 {
                return Err(TierError::Truncated {
                    tier: self.name.clone(),
                    path: path.clone(),
                    end: buf.len() as u64,
                    file_len,
                });
            }
            f.read_exact_at(buf, 0).map_err(|source| TierError::Io {
                tier: self.name.clone(),
                path: path.clone(),
                source,
            })
        })();
        match &r {
            Ok(()) => {
                self.counters.record_read(buf.len() as u64, start.elapsed());
                let mut ix = self.lock();
                ix.clock += 1;
                let c = ix.clock;
                if let Some(e) = ix.entries.get_mut(hash) {
                    e.last_use = c;
                }
            }
            Err(_) => self.counters.record_error(),
        }
        r
    }

    /// Stages a copy of a page (its decoded, verified bytes), evicting the least
    /// recently used copies to stay within capacity. Returns the hashes evicted.
    pub fn stage(&self, hash: &str, bytes: &[u8]) -> Result<Vec<String>, TierError> {
        self.check_hash(hash)?;
        let len = bytes.len() as u64;
        if len > self.capacity {
            return Err(TierError::Invalid {
                tier: self.name.clone(),
                detail: format!(
                    "a page of {len} bytes exceeds the tier's capacity of {}",
                    self.capacity
                ),
            });
        }
        if self.contains(hash) {
            return Ok(vec![]);
        }
        // Make room first.
        let mut evicted = Vec::new();
        loop {
            let victim = {
                let ix = self.lock();
                if ix.used + len <= self.capacity {
                    break;
                }
                ix.entries
                    .iter()
                    .min_by_key(|(h, e)| (e.last_use, (*h).clone()))
                    .map(|(h, _)| h.clone())
            };
            match victim {
                Some(v) => {
                    self.unstage(&v)?;
                    evicted.push(v);
                }
                None => break,
            }
        }
        {
            // The room is taken now, as `keep` takes it, so that the two never
            // count one copy twice or overfill the tier between them.
            let mut ix = self.lock();
            if ix.entries.contains_key(hash) {
                return Ok(evicted);
            }
            ix.used += len;
        }
        self.write_reserved(hash, bytes, true)?;
        Ok(evicted)
    }

    /// Keeps a copy of a page (its decoded, verified bytes) if it fits in the room
    /// left, evicting nothing: a store's static set of pages fills the tier as its
    /// pages are first read. Returns whether a copy is there now. Not synced to disk:
    /// every copy is verified when it is read, so a torn one (after a crash) is
    /// caught and read again from the slow tier.
    pub fn keep(&self, hash: &str, bytes: &[u8]) -> Result<bool, TierError> {
        self.check_hash(hash)?;
        let len = bytes.len() as u64;
        {
            let mut ix = self.lock();
            if ix.entries.contains_key(hash) {
                return Ok(true);
            }
            if ix.used + len > self.capacity {
                return Ok(false);
            }
            // The room is taken now, so concurrent keeps never overfill the tier.
            ix.used += len;
        }
        self.write_reserved(hash, bytes, false)?;
        Ok(true)
    }

    /// Writes the copy of `hash` whose room the caller has taken (`used` counts it):
    /// to a temporary file, then renamed to the page's name (`sync`: synced to disk
    /// first), and indexed. Where another thread indexed the same page meanwhile, its
    /// copy stands; where the write fails, the room goes back.
    fn write_reserved(&self, hash: &str, bytes: &[u8], sync: bool) -> Result<(), TierError> {
        let len = bytes.len() as u64;
        let path = self.path(hash);
        let parent = path.parent().expect("a page path has a parent");
        let tmp = parent.join(format!(
            "{hash}.{}.{:?}.tmp",
            std::process::id(),
            std::thread::current().id()
        ));
        let write = || -> std::io::Result<()> {
            std::fs::create_dir_all(parent)?;
            let mut f = File::create(&tmp)?;
            f.write_all(bytes)?;
            if sync {
                f.sync_all()?;
            }
            std::fs::rename(&tmp, &path)
        };
        let written = write();
        let mut ix = self.lock();
        let kept = ix.entries.contains_key(hash);
        if kept || written.is_err() {
            ix.used -= len;
            drop(ix);
            let _ = std::fs::remove_file(&tmp);
            return match written {
                Err(source) if !kept => Err(TierError::Io {
                    tier: self.name.clone(),
                    path,
                    source,
                }),
                _ => Ok(()),
            };
        }
        ix.clock += 1;
        let c = ix.clock;
        ix.entries
            .insert(hash.to_string(), Entry { len, last_use: c });
        Ok(())
    }

    /// Removes the staged copy of `hash`, if any. Returns whether there was one.
    pub fn unstage(&self, hash: &str) -> Result<bool, TierError> {
        self.check_hash(hash)?;
        let Some(e) = self.lock().entries.remove(hash) else {
            return Ok(false);
        };
        self.lock().used -= e.len;
        let path = self.path(hash);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
            Err(source) => Err(TierError::Io {
                tier: self.name.clone(),
                path,
                source,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(bytes: &[u8]) -> String {
        blake3::hash(bytes).to_hex().to_string()
    }

    #[test]
    fn keeping_fills_the_room_left_and_evicts_nothing() {
        let d = tempfile::tempdir().unwrap();
        let t = FastTier::open("fast", d.path(), 100).unwrap();
        let (a, b, c) = (vec![1u8; 40], vec![2u8; 40], vec![3u8; 40]);
        assert!(t.keep(&h(&a), &a).unwrap());
        assert!(t.keep(&h(&b), &b).unwrap());
        assert!(t.keep(&h(&a), &a).unwrap(), "already there");
        assert!(!t.keep(&h(&c), &c).unwrap(), "no room: nothing evicted");
        assert_eq!(t.used(), 80);
        assert!(t.contains(&h(&a)) && t.contains(&h(&b)) && !t.contains(&h(&c)));
        let mut buf = vec![0u8; 40];
        t.read(&h(&b), &mut buf).unwrap();
        assert_eq!(buf, b);
        // What was kept is found again when the tier reopens.
        drop(t);
        let t = FastTier::open("fast", d.path(), 100).unwrap();
        assert_eq!(t.used(), 80);
        assert!(t.contains(&h(&a)));
    }

    #[test]
    fn stage_read_evict_and_reopen() {
        let d = tempfile::tempdir().unwrap();
        let t = FastTier::open("fast", d.path(), 100).unwrap();
        let a = vec![1u8; 40];
        let b = vec![2u8; 40];
        let c = vec![3u8; 40];
        t.stage(&h(&a), &a).unwrap();
        t.stage(&h(&b), &b).unwrap();
        let mut buf = vec![0u8; 40];
        t.read(&h(&a), &mut buf).unwrap(); // a is now more recent than b
        assert_eq!(buf, a);
        let evicted = t.stage(&h(&c), &c).unwrap();
        assert_eq!(evicted, vec![h(&b)]);
        assert!(t.contains(&h(&a)) && t.contains(&h(&c)) && !t.contains(&h(&b)));
        assert_eq!(t.used(), 80);

        // A leftover temporary file is cleaned; the index comes back from the directory.
        std::fs::write(d.path().join(&h(&a)[..2]).join("x.tmp"), b"partial").unwrap();
        drop(t);
        let t = FastTier::open("fast", d.path(), 100).unwrap();
        assert_eq!(t.used(), 80);
        assert_eq!(t.list().len(), 2);
        assert!(!d.path().join(&h(&a)[..2]).join("x.tmp").exists());
        assert!(t.unstage(&h(&a)).unwrap());
        assert!(!t.unstage(&h(&a)).unwrap());
    }

    #[test]
    fn bad_inputs_are_errors() {
        let d = tempfile::tempdir().unwrap();
        let t = FastTier::open("fast", d.path(), 10).unwrap();
        assert!(t.stage("../../x", b"1").is_err());
        let big = vec![0u8; 11];
        assert!(t
            .stage(&h(&big), &big)
            .unwrap_err()
            .to_string()
            .contains("capacity"));
        let a = vec![5u8; 8];
        t.stage(&h(&a), &a).unwrap();
        // A copy whose length changed on disk is reported, not half-read.
        std::fs::write(t.path(&h(&a)), b"short").unwrap();
        let mut buf = vec![0u8; 8];
        let e = t.read(&h(&a), &mut buf).unwrap_err();
        assert!(matches!(e, TierError::Truncated { .. }), "{e}");
    }
}
