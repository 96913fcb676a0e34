//! A directory of model files, read by extent.
//!
//! Reads are buffered (through the OS page cache) or direct (around it, into a
//! reusable aligned bounce buffer per reading thread, then copied to the caller's
//! buffer: an extent of a checkpoint starts wherever its tensor does, which a direct
//! read cannot). A filesystem that cannot read around the page cache (tmpfs, some
//! overlays) is read buffered, with a warning. A tier given a [`ReadPool`] reads each
//! extent as many pieces in flight; without one, on the caller's thread.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::{Extent, TierCounters, TierError, TierStats};
use crate::direct::{DirectFile, ReadMode};
use crate::read_pool::ReadPool;

/// Bytes of one direct read on the caller's thread: a page larger than this is read in
/// pieces of it.
const DIRECT_PIECE: usize = 8 << 20;

/// Model files under `root`, opened once and read with positioned reads (so
/// concurrent reads of one file need no lock).
pub struct FileTier {
    name: String,
    root: PathBuf,
    mode: ReadMode,
    files: Mutex<HashMap<String, Arc<DirectFile>>>,
    counters: TierCounters,
    pool: Arc<ReadPool>,
}

impl FileTier {
    /// A tier of buffered reads.
    pub fn new(name: impl Into<String>, root: impl Into<PathBuf>) -> Self {
        Self::with_mode(name, root, ReadMode::Buffered)
    }

    /// A tier that reads in `mode`.
    pub fn with_mode(name: impl Into<String>, root: impl Into<PathBuf>, mode: ReadMode) -> Self {
        FileTier {
            name: name.into(),
            root: root.into(),
            mode,
            files: Mutex::new(HashMap::new()),
            counters: TierCounters::default(),
            pool: Arc::new(ReadPool::new(0, DIRECT_PIECE).expect("a pool without threads")),
        }
    }

    /// Reads extents through `pool` (many pieces in flight).
    pub fn with_pool(mut self, pool: Arc<ReadPool>) -> Self {
        self.pool = pool;
        self
    }

    /// How it reads.
    pub fn mode(&self) -> ReadMode {
        self.mode
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn counters(&self) -> &TierCounters {
        &self.counters
    }

    pub fn stats(&self) -> TierStats {
        self.counters.snapshot()
    }

    /// Forgets open files, so the next read opens them again (after a remount, or
    /// when a file was replaced).
    pub fn reopen(&self) {
        self.files.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// The path of `file`, which must be a plain relative name inside the root.
    pub fn path_of(&self, file: &str) -> Result<PathBuf, TierError> {
        let rel = Path::new(file);
        if rel.as_os_str().is_empty()
            || !rel.components().all(|c| matches!(c, Component::Normal(_)))
        {
            return Err(TierError::Invalid {
                tier: self.name.clone(),
                detail: format!("file name '{file}' leaves the tier's directory"),
            });
        }
        Ok(self.root.join(rel))
    }

    /// The open file `file` of the tier (opened once, then shared).
    pub fn open(&self, file: &str) -> Result<Arc<DirectFile>, TierError> {
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = files.get(file) {
            return Ok(Arc::clone(f));
        }
        let path = self.path_of(file)?;
        let io = |source| TierError::Io {
            tier: self.name.clone(),
            path: path.clone(),
            source,
        };
        // A regular file, opened without blocking (a FIFO in its place is refused).
        let f = match DirectFile::open(&path, self.mode) {
            Ok(f) => f,
            // Direct reads refused: buffered ones, if the file opens at all (else
            // that error, which names what is wrong with the file).
            Err(e) if self.mode == ReadMode::Direct => {
                let f = DirectFile::open(&path, ReadMode::Buffered).map_err(io)?;
                tracing::warn!(
                    tier = %self.name,
                    "{e}; reading {} through the page cache",
                    path.display()
                );
                f
            }
            Err(e) => return Err(io(e)),
        };
        let f = Arc::new(f);
        files.insert(file.to_string(), Arc::clone(&f));
        Ok(f)
    }

    /// Reads `ext` into `buf` (`buf.len() == ext.len`).
    pub fn read_extent(&self, ext: &Extent, buf: &mut [u8]) -> Result<(), TierError> {
        assert_eq!(
            buf.len() as u64,
            ext.len,
            "buffer length must equal the extent length"
        );
        let start = Instant::now();
        let r = self.read_inner(ext, buf);
        match &r {
            Ok(()) => self.counters.record_read(ext.len, start.elapsed()),
            Err(_) => self.counters.record_error(),
        }
        r
    }

    /// The end of `ext` (offset + length), or an error naming the extent if it
    /// overflows (a hostile or corrupt manifest).
    fn extent_end(&self, ext: &Extent) -> Result<u64, TierError> {
        ext.offset
            .checked_add(ext.len)
            .ok_or_else(|| TierError::Invalid {
                tier: self.name.clone(),
                detail: format!(
                    "extent of '{}' at offset {} with length {} ends past 2^64",
                    ext.file, ext.offset, ext.len
                ),
            })
    }

    /// Checks that `ext` lies inside its file (one `fstat` of the open file), so a
    /// caller may size a buffer by it: a manifest's length must not make the reader
    /// allocate more than the file holds.
    pub fn check_extent(&self, ext: &Extent) -> Result<(), TierError> {
        let end = self.extent_end(ext)?;
        let f = self.open(&ext.file)?;
        let path = self.path_of(&ext.file)?;
        let file_len = f
            .file()
            .metadata()
            .map_err(|source| TierError::Io {
                tier: self.name.clone(),
                path: path.clone(),
                source,
            })?
            .len();
        if end > file_len {
            return Err(TierError::Truncated {
                tier: self.name.clone(),
                path,
                end,
                file_len,
            });
        }
        Ok(())
    }

    fn read_inner(&self, ext: &Extent, buf: &mut [u8]) -> Result<(), TierError> {
        let end = self.extent_end(ext)?;
        let f = self.open(&ext.file)?;
        let path = self.path_of(&ext.file)?;
        let r = self.pool.read(&f, ext.offset, buf);
        match r {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                let file_len = f.file().metadata().map(|m| m.len()).unwrap_or(0);
                Err(TierError::Truncated {
                    tier: self.name.clone(),
                    path,
                    end,
                    file_len,
                })
            }
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
    use crate::direct::DIRECT_ALIGN;

    #[test]
    fn reads_extents_and_names_truncation() {
        for mode in [ReadMode::Buffered, ReadMode::Direct] {
            reads_extents_and_names_truncation_in(mode);
        }
    }

    fn reads_extents_and_names_truncation_in(mode: ReadMode) {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("m.bin"), (0..100u8).collect::<Vec<_>>()).unwrap();
        let t = FileTier::with_mode("primary", d.path(), mode);
        let mut buf = vec![0u8; 10];
        let ext = Extent {
            file: "m.bin".into(),
            offset: 20,
            len: 10,
        };
        t.read_extent(&ext, &mut buf).unwrap();
        assert_eq!(buf, (20..30u8).collect::<Vec<_>>());
        let mut big = vec![0u8; 20];
        let e = t
            .read_extent(
                &Extent {
                    file: "m.bin".into(),
                    offset: 90,
                    len: 20,
                },
                &mut big,
            )
            .unwrap_err();
        assert!(
            matches!(
                e,
                TierError::Truncated {
                    end: 110,
                    file_len: 100,
                    ..
                }
            ),
            "{e}"
        );
        let e = t
            .read_extent(
                &Extent {
                    file: "../etc/passwd".into(),
                    offset: 0,
                    len: 1,
                },
                &mut [0u8; 1],
            )
            .unwrap_err();
        assert!(e.to_string().contains("leaves"), "{e}");
        let s = t.stats();
        assert_eq!((s.reads, s.bytes, s.errors), (1, 10, 2));
    }

    /// Direct reads of extents at any offset and of any length, larger than one
    /// piece, give the file's bytes; a file truncated after it was opened is a
    /// truncation error, never stale bytes.
    #[test]
    fn direct_reads_give_the_bytes_of_any_extent() {
        let d = tempfile::tempdir().unwrap();
        let len = DIRECT_PIECE * 2 + 3 * DIRECT_ALIGN + 77;
        let data: Vec<u8> = (0..len)
            .map(|i| (i % 251) as u8 ^ (i >> 12) as u8)
            .collect();
        std::fs::write(d.path().join("m.bin"), &data).unwrap();
        let t = FileTier::with_mode("primary", d.path(), ReadMode::Direct);
        for (offset, n) in [
            (0usize, 1usize),
            (3, DIRECT_ALIGN),
            (DIRECT_ALIGN, DIRECT_PIECE),
            (12345, DIRECT_PIECE * 2 + 5),
            (len - 9, 9),
        ] {
            let mut buf = vec![0u8; n];
            let ext = Extent {
                file: "m.bin".into(),
                offset: offset as u64,
                len: n as u64,
            };
            t.read_extent(&ext, &mut buf).unwrap();
            assert!(buf == data[offset..offset + n], "{offset}+{n}");
        }
        std::fs::OpenOptions::new()
            .write(true)
            .open(d.path().join("m.bin"))
            .unwrap()
            .set_len(1000)
            .unwrap();
        let mut buf = vec![0u8; 2000];
        let e = t
            .read_extent(
                &Extent {
                    file: "m.bin".into(),
                    offset: 500,
                    len: 2000,
                },
                &mut buf,
            )
            .unwrap_err();
        assert!(
            matches!(e, TierError::Truncated { file_len: 1000, .. }),
            "{e}"
        );
    }

    /// A hostile extent whose end overflows a u64 is an error naming it, not an
    /// arithmetic overflow; `check_extent` bounds an extent by the file's length.
    #[test]
    fn overflowing_and_oversized_extents_are_errors() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("m.bin"), [7u8; 100]).unwrap();
        let t = FileTier::new("primary", d.path());
        let hostile = Extent {
            file: "m.bin".into(),
            offset: u64::MAX - 1,
            len: 4,
        };
        let e = t.read_extent(&hostile, &mut [0u8; 4]).unwrap_err();
        assert!(
            matches!(e, TierError::Invalid { .. }) && e.to_string().contains("2^64"),
            "{e}"
        );
        let e = t.check_extent(&hostile).unwrap_err();
        assert!(matches!(e, TierError::Invalid { .. }), "{e}");
        let huge = Extent {
            file: "m.bin".into(),
            offset: 10,
            len: 1 << 40,
        };
        let e = t.check_extent(&huge).unwrap_err();
        assert!(
            matches!(e, TierError::Truncated { file_len: 100, .. }),
            "{e}"
        );
        t.check_extent(&Extent {
            file: "m.bin".into(),
            offset: 90,
            len: 10,
        })
        .unwrap();
    }
}
