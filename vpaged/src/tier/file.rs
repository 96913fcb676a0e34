//! A directory of model files, read by extent.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::{Extent, TierCounters, TierError, TierStats};

/// Model files under `root`, opened once and read with positioned reads (so
/// concurrent reads of one file need no lock).
pub struct FileTier {
    name: String,
    root: PathBuf,
    files: Mutex<HashMap<String, Arc<File>>>,
    counters: TierCounters,
}

impl FileTier {
    pub fn new(name: impl Into<String>, root: impl Into<PathBuf>) -> Self {
        FileTier {
            name: name.into(),
            root: root.into(),
            files: Mutex::new(HashMap::new()),
            counters: TierCounters::default(),
        }
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

    fn open(&self, file: &str) -> Result<Arc<File>, TierError> {
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = files.get(file) {
            return Ok(Arc::clone(f));
        }
        let path = self.path_of(file)?;
        let f = File::open(&path).map_err(|source| TierError::Io {
            tier: self.name.clone(),
            path,
            source,
        })?;
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

    fn read_inner(&self, ext: &Extent, buf: &mut [u8]) -> Result<(), TierError> {
        let f = self.open(&ext.file)?;
        let path = self.path_of(&ext.file)?;
        match f.read_exact_at(buf, ext.offset) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                let file_len = f.metadata().map(|m| m.len()).unwrap_or(0);
                Err(TierError::Truncated {
                    tier: self.name.clone(),
                    path,
                    end: ext.offset + ext.len,
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

    #[test]
    fn reads_extents_and_names_truncation() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("m.bin"), (0..100u8).collect::<Vec<_>>()).unwrap();
        let t = FileTier::new("primary", d.path());
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
}
