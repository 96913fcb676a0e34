//! A model directory on a mount that can disappear (NAS, USB disk).
//!
//! A dead network mount can block a read or a `stat` for minutes, so every access
//! runs on a helper thread and is abandoned after `timeout`: the engine gets a clear
//! error (and the store tries another tier) instead of hanging. An unhealthy mount is
//! re-checked at most every `recheck`; before each re-check the configured remount
//! command runs, and after a successful one open files are re-resolved (the old
//! handles point at the dead mount).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Extent, FileTier, Health, TierError, TierStats};

#[derive(Debug, Clone)]
pub struct NasConfig {
    /// The mount point.
    pub mount: PathBuf,
    /// The model directory, relative to the mount point.
    pub model: PathBuf,
    /// Longest a read or health check may take.
    pub timeout: Duration,
    /// Shortest interval between health re-checks of an unhealthy mount.
    pub recheck: Duration,
    /// Run with `sh -c` before re-checking an unhealthy mount (e.g. `mount -a`).
    pub remount_command: Option<String>,
}

struct State {
    healthy: bool,
    reason: String,
    last_check: Option<Instant>,
}

pub struct NasTier {
    inner: Arc<FileTier>,
    cfg: NasConfig,
    state: Mutex<State>,
}

/// Runs `f` on a helper thread; `None` if it does not finish within `timeout`
/// (the thread is left to finish or hang on its own).
fn with_timeout<T: Send + 'static>(
    timeout: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("vpaged-nas-io".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .ok()?;
    rx.recv_timeout(timeout).ok()
}

impl NasTier {
    pub fn new(name: impl Into<String>, cfg: NasConfig) -> Self {
        let root = cfg.mount.join(&cfg.model);
        NasTier {
            inner: Arc::new(FileTier::new(name, root)),
            cfg,
            state: Mutex::new(State {
                healthy: true,
                reason: String::new(),
                last_check: None,
            }),
        }
    }

    pub fn name(&self) -> &str {
        self.inner.name()
    }

    pub fn root(&self) -> &Path {
        self.inner.root()
    }

    pub fn stats(&self) -> TierStats {
        self.inner.stats()
    }

    pub fn counters(&self) -> &super::TierCounters {
        self.inner.counters()
    }

    pub fn health(&self) -> Health {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.healthy {
            Health::Ok
        } else {
            Health::Unavailable(s.reason.clone())
        }
    }

    fn mark_unhealthy(&self, reason: String) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.healthy = false;
        s.reason = reason;
        s.last_check = Some(Instant::now());
    }

    /// Whether the model directory answers within the timeout.
    fn probe(&self) -> Result<(), String> {
        let root = self.inner.root().to_path_buf();
        match with_timeout(self.cfg.timeout, move || std::fs::metadata(&root)) {
            None => Err(format!(
                "{} did not answer within {:?}",
                self.root().display(),
                self.cfg.timeout
            )),
            Some(Err(e)) => Err(format!("{}: {e}", self.root().display())),
            Some(Ok(m)) if !m.is_dir() => {
                Err(format!("{} is not a directory", self.root().display()))
            }
            Some(Ok(_)) => Ok(()),
        }
    }

    fn remount(&self) -> Result<(), String> {
        let Some(cmd) = self.cfg.remount_command.clone() else {
            return Ok(());
        };
        let out = with_timeout(
            self.cfg.timeout.max(Duration::from_secs(1)) * 4,
            move || Command::new("sh").arg("-c").arg(&cmd).output(),
        );
        match out {
            None => Err("the remount command timed out".into()),
            Some(Err(e)) => Err(format!("cannot run the remount command: {e}")),
            Some(Ok(o)) if !o.status.success() => Err(format!(
                "the remount command failed ({}): {}",
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Some(Ok(_)) => Ok(()),
        }
    }

    /// Checks the mount now (remounting first if it was unhealthy) and returns its
    /// health. After a recovery, open files are re-resolved.
    pub fn check(&self) -> Health {
        let was_healthy = self.state.lock().unwrap_or_else(|e| e.into_inner()).healthy;
        let result = if was_healthy {
            self.probe()
        } else {
            self.remount().and_then(|()| self.probe())
        };
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.last_check = Some(Instant::now());
        match result {
            Ok(()) => {
                if !s.healthy {
                    self.inner.reopen();
                }
                s.healthy = true;
                s.reason.clear();
                Health::Ok
            }
            Err(reason) => {
                s.healthy = false;
                s.reason = reason.clone();
                Health::Unavailable(reason)
            }
        }
    }

    /// Reads an extent, failing fast while the mount is known to be down, and with
    /// a timeout otherwise.
    pub fn read_extent(&self, ext: &Extent, buf: &mut [u8]) -> Result<(), TierError> {
        let recheck_due = {
            let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if s.healthy {
                false
            } else if s.last_check.is_some_and(|t| t.elapsed() < self.cfg.recheck) {
                return Err(TierError::Unavailable {
                    tier: self.name().to_string(),
                    reason: s.reason.clone(),
                });
            } else {
                true
            }
        };
        if recheck_due {
            if let Health::Unavailable(reason) = self.check() {
                return Err(TierError::Unavailable {
                    tier: self.name().to_string(),
                    reason,
                });
            }
        }
        let inner = Arc::clone(&self.inner);
        let ext2 = ext.clone();
        let len = buf.len();
        let r = with_timeout(self.cfg.timeout, move || {
            let mut local = vec![0u8; len];
            inner.read_extent(&ext2, &mut local).map(|()| local)
        });
        match r {
            Some(Ok(bytes)) => {
                buf.copy_from_slice(&bytes);
                Ok(())
            }
            Some(Err(e)) => {
                // A missing file or a vanished directory means the mount is gone;
                // a truncated file is the file's own problem.
                if !matches!(e, TierError::Truncated { .. }) {
                    self.mark_unhealthy(e.to_string());
                }
                Err(e)
            }
            None => {
                self.inner.counters().record_error();
                let path = self.inner.path_of(&ext.file).unwrap_or_default();
                self.mark_unhealthy(format!("a read of {} timed out", path.display()));
                Err(TierError::Timeout {
                    tier: self.name().to_string(),
                    path,
                    timeout: self.cfg.timeout,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (tempfile::TempDir, NasTier) {
        let d = tempfile::tempdir().unwrap();
        let model = d.path().join("mnt/models/m");
        std::fs::create_dir_all(&model).unwrap();
        std::fs::write(model.join("w.bin"), (0..64u8).collect::<Vec<_>>()).unwrap();
        let mnt = d.path().join("mnt");
        let gone = d.path().join("mnt.gone");
        let cfg = NasConfig {
            mount: mnt.clone(),
            model: PathBuf::from("models/m"),
            timeout: Duration::from_secs(2),
            recheck: Duration::from_millis(0),
            remount_command: Some(format!(
                "test -d '{g}' && mv '{g}' '{m}' || true",
                g = gone.display(),
                m = mnt.display()
            )),
        };
        (d, NasTier::new("nas", cfg))
    }

    fn ext() -> Extent {
        Extent {
            file: "w.bin".into(),
            offset: 8,
            len: 8,
        }
    }

    #[test]
    fn a_mount_that_disappears_fails_clearly_then_recovers_by_remount() {
        let (d, nas) = setup();
        let mut buf = [0u8; 8];
        nas.read_extent(&ext(), &mut buf).unwrap();
        assert_eq!(buf, [8, 9, 10, 11, 12, 13, 14, 15]);

        // The mount disappears (its directory moves away, as an unmounted mount point
        // would lose its contents).
        std::fs::rename(d.path().join("mnt"), d.path().join("mnt.gone")).unwrap();
        nas.inner.reopen();
        let e = nas.read_extent(&ext(), &mut buf).unwrap_err();
        assert!(e.to_string().contains("nas"), "{e}");
        assert!(matches!(nas.health(), Health::Unavailable(_)));

        // The next read re-checks: the remount command brings it back.
        buf = [0; 8];
        nas.read_extent(&ext(), &mut buf).unwrap();
        assert_eq!(buf, [8, 9, 10, 11, 12, 13, 14, 15]);
        assert_eq!(nas.health(), Health::Ok);
    }

    #[test]
    fn while_recheck_is_not_due_reads_fail_fast() {
        let (d, mut nas) = setup();
        nas.cfg.recheck = Duration::from_secs(3600);
        nas.cfg.remount_command = None;
        std::fs::rename(d.path().join("mnt"), d.path().join("mnt.gone")).unwrap();
        let mut buf = [0u8; 8];
        assert!(nas.read_extent(&ext(), &mut buf).is_err());
        let t = Instant::now();
        let e = nas.read_extent(&ext(), &mut buf).unwrap_err();
        assert!(matches!(e, TierError::Unavailable { .. }), "{e}");
        assert!(t.elapsed() < Duration::from_millis(100));
    }

    #[test]
    fn a_failing_remount_command_is_reported() {
        let (d, mut nas) = setup();
        nas.cfg.remount_command = Some("echo no such share >&2; exit 3".into());
        std::fs::rename(d.path().join("mnt"), d.path().join("mnt.gone")).unwrap();
        nas.mark_unhealthy("test".into());
        match nas.check() {
            Health::Unavailable(r) => assert!(r.contains("no such share"), "{r}"),
            Health::Ok => panic!("should be unavailable"),
        }
    }

    #[test]
    fn a_read_that_hangs_times_out() {
        let (d, mut nas) = setup();
        nas.cfg.timeout = Duration::from_millis(200);
        // Opening a FIFO with no writer blocks, like a read on a dead network mount.
        let fifo = d.path().join("mnt/models/m/hang.bin");
        let st = Command::new("mkfifo").arg(&fifo).status().unwrap();
        assert!(st.success());
        let mut buf = [0u8; 4];
        let t = Instant::now();
        let e = nas
            .read_extent(
                &Extent {
                    file: "hang.bin".into(),
                    offset: 0,
                    len: 4,
                },
                &mut buf,
            )
            .unwrap_err();
        assert!(matches!(e, TierError::Timeout { .. }), "{e}");
        assert!(t.elapsed() < Duration::from_secs(2));
        assert!(matches!(nas.health(), Health::Unavailable(_)));
    }
}
