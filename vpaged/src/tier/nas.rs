//! A model directory on a mount that can disappear (NAS, USB disk).
//!
//! A dead network mount can block a read or a `stat` for minutes, so every access
//! runs on a helper thread and is abandoned after `timeout`: the engine gets a clear
//! error naming the mount (and the store tries another tier) instead of hanging.
//!
//! Health: the model directory is probed (a timed `stat`) before a read whenever the
//! last check is `recheck` old or more, healthy or not, so a mount that went away is
//! noticed even while open file handles still answer (a lazily unmounted share). A
//! probe that fails runs the configured remount command and probes again. While the
//! mount is known to be down and no re-check is due, reads fail at once.
//!
//! Re-resolution: open files are dropped and opened again by path after the mount
//! recovers, and whenever the model directory's identity (device, inode) changes (a
//! remount the store never saw fail), so no read goes through a handle on a dead or
//! replaced mount.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::{Extent, FileTier, Health, TierError, TierStats};

#[derive(Debug, Clone)]
pub struct NasConfig {
    /// The mount point.
    pub mount: PathBuf,
    /// The model directory, relative to the mount point.
    pub model: PathBuf,
    /// Longest a read, a health probe or a step of opening a model may take (the
    /// remount command gets four times as long, at least four seconds).
    pub timeout: Duration,
    /// Shortest interval between health checks of the mount, healthy or not (zero:
    /// before every read).
    pub recheck: Duration,
    /// Run with `sh -c` when a health probe fails, before probing again (e.g.
    /// `mount -a`). It should succeed when the mount is already there.
    pub remount_command: Option<String>,
}

struct State {
    healthy: bool,
    reason: String,
    last_check: Option<Instant>,
    /// When the probe of the last check that [`NasTier::check`] completed began: its
    /// answer is as fresh as that, not as its end (a probe that began before the
    /// mount came back, and ended after, still says it is down).
    last_probe: Option<Instant>,
    /// The model directory's (device, inode) at the last successful probe.
    identity: Option<(u64, u64)>,
}

pub struct NasTier {
    inner: Arc<FileTier>,
    cfg: NasConfig,
    state: Mutex<State>,
    /// Serialises health checks, so one remount command runs at a time.
    checking: Mutex<()>,
    /// Checks that found the mount down, and recoveries from that.
    outages: AtomicU64,
    recoveries: AtomicU64,
    /// Read buffers to reuse (at most [`SPARE_BUFFERS`], each at most
    /// [`SPARE_BUFFER_MAX`] bytes: a huge page's buffer is not kept).
    spare: Mutex<Vec<Vec<u8>>>,
}

const SPARE_BUFFERS: usize = 4;
const SPARE_BUFFER_MAX: usize = 16 << 20;

type Job = Box<dyn FnOnce() + Send>;

/// Helper threads for timed I/O, reused from call to call (starting a thread per read
/// costs about as much as reading a small page). A helper stuck on a dead mount is
/// abandoned: it takes no other job until it returns. A new helper starts whenever no
/// idle one is free; idle helpers retire after [`HELPER_IDLE`].
struct Helpers {
    queue: mpsc::Sender<Job>,
    jobs: Arc<Mutex<mpsc::Receiver<Job>>>,
    /// Helpers waiting for a job and not yet promised to one. Invariant: jobs in the
    /// queue plus `idle` never exceed the helpers waiting, so a queued job never waits
    /// behind a running (possibly hung) one.
    idle: Arc<AtomicUsize>,
}

const HELPER_IDLE: Duration = Duration::from_secs(30);

impl Helpers {
    fn get() -> &'static Helpers {
        static HELPERS: OnceLock<Helpers> = OnceLock::new();
        HELPERS.get_or_init(|| {
            let (queue, jobs) = mpsc::channel();
            Helpers {
                queue,
                jobs: Arc::new(Mutex::new(jobs)),
                idle: Arc::new(AtomicUsize::new(0)),
            }
        })
    }

    fn run(&self, job: Job) -> Result<(), String> {
        let promised = self
            .idle
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        if !promised {
            let (jobs, idle) = (Arc::clone(&self.jobs), Arc::clone(&self.idle));
            std::thread::Builder::new()
                .name("vpaged-nas-io".into())
                .spawn(move || helper(&jobs, &idle))
                .map_err(|e| format!("cannot start an I/O thread: {e}"))?;
        }
        self.queue
            .send(job)
            .map_err(|_| "the I/O helpers are gone".to_string())
    }
}

fn helper(jobs: &Mutex<mpsc::Receiver<Job>>, idle: &AtomicUsize) {
    loop {
        let next = jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .recv_timeout(HELPER_IDLE);
        match next {
            Ok(job) => {
                // A panicking job reports through its dropped channel; the helper lives.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                idle.fetch_add(1, Ordering::AcqRel);
            }
            // Retire, unless every waiting helper is promised to a queued job.
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if idle
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                    .is_ok()
                {
                    return;
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// Runs `f` on a helper thread and waits at most `timeout` for it (a helper that does
/// not finish is left to finish or hang on its own; `f` owns everything it touches).
fn with_timeout<T: Send + 'static>(
    timeout: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let (tx, rx) = mpsc::channel();
    Helpers::get().run(Box::new(move || {
        let _ = tx.send(f());
    }))?;
    rx.recv_timeout(timeout).map_err(|e| match e {
        mpsc::RecvTimeoutError::Timeout => format!("did not answer within {timeout:?}"),
        mpsc::RecvTimeoutError::Disconnected => "failed (its I/O helper panicked)".into(),
    })
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
                last_probe: None,
                identity: None,
            }),
            checking: Mutex::new(()),
            outages: AtomicU64::new(0),
            recoveries: AtomicU64::new(0),
            spare: Mutex::new(Vec::new()),
        }
    }

    pub fn name(&self) -> &str {
        self.inner.name()
    }

    /// The model directory (under the mount).
    pub fn root(&self) -> &Path {
        self.inner.root()
    }

    /// The mount point.
    pub fn mount(&self) -> &Path {
        &self.cfg.mount
    }

    pub fn config(&self) -> &NasConfig {
        &self.cfg
    }

    pub fn stats(&self) -> TierStats {
        self.inner.stats()
    }

    pub fn counters(&self) -> &super::TierCounters {
        self.inner.counters()
    }

    /// Health checks that found the mount down.
    pub fn outages(&self) -> u64 {
        self.outages.load(Ordering::Relaxed)
    }

    /// Health checks that found the mount back after it was down.
    pub fn recoveries(&self) -> u64 {
        self.recoveries.load(Ordering::Relaxed)
    }

    /// The health found by the last check or read (no I/O).
    pub fn health(&self) -> Health {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.healthy {
            Health::Ok
        } else {
            Health::Unavailable(s.reason.clone())
        }
    }

    /// This tier's error for the mount being unavailable.
    fn unavailable(&self, reason: String) -> TierError {
        TierError::MountUnavailable {
            tier: self.name().to_string(),
            mount: self.cfg.mount.clone(),
            reason,
        }
    }

    fn mark_unhealthy(&self, reason: String) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.healthy {
            self.outages.fetch_add(1, Ordering::Relaxed);
        }
        s.healthy = false;
        s.reason = reason;
        s.last_check = Some(Instant::now());
    }

    /// Whether the model directory answers within the timeout; its (device, inode)
    /// if so. No remount, no change of state.
    pub fn probe(&self) -> Result<(u64, u64), String> {
        let root = self.inner.root().to_path_buf();
        let shown = self.root().display();
        match with_timeout(self.cfg.timeout, move || std::fs::metadata(&root)) {
            Err(e) => Err(format!("{shown} {e}")),
            Ok(Err(e)) => Err(format!("{shown}: {e}")),
            Ok(Ok(m)) if !m.is_dir() => Err(format!("{shown} is not a directory")),
            Ok(Ok(m)) => Ok((m.dev(), m.ino())),
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
            Err(e) => Err(format!("the remount command {e}")),
            Ok(Err(e)) => Err(format!("cannot run the remount command: {e}")),
            Ok(Ok(o)) if !o.status.success() => Err(format!(
                "the remount command failed ({}): {}",
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Ok(Ok(_)) => Ok(()),
        }
    }

    /// Checks the mount now: probes it and, if that fails, runs the remount command
    /// and probes again. Open files are re-resolved after a recovery or when the model
    /// directory was replaced. Concurrent callers share one check.
    pub fn check(&self) -> Health {
        let started = Instant::now();
        let _one = self.checking.lock().unwrap_or_else(|e| e.into_inner());
        {
            // Another caller checked while this one waited, with a probe that began
            // after this call did: its answer is fresh. (One that began before may
            // have probed before the mount came back, and would answer a request
            // made after the remount with "down".)
            let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if s.last_probe.is_some_and(|t| t >= started) {
                return if s.healthy {
                    Health::Ok
                } else {
                    Health::Unavailable(s.reason.clone())
                };
            }
        }
        let probe_started = Instant::now();
        // `down`: the first probe failed (even if the remount command then fixed it).
        let (down, result) = match self.probe() {
            Ok(id) => (false, Ok(id)),
            Err(first) if self.cfg.remount_command.is_some() => (
                true,
                self.remount()
                    .and_then(|()| self.probe())
                    .map_err(|e| format!("{first}; then {e}")),
            ),
            Err(first) => (true, Err(first)),
        };
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.last_check = Some(Instant::now());
        s.last_probe = Some(probe_started);
        if down && s.healthy {
            self.outages.fetch_add(1, Ordering::Relaxed);
        }
        match result {
            Ok(id) => {
                let recovered = down || !s.healthy;
                if recovered || s.identity.is_some_and(|old| old != id) {
                    // Handles opened before an outage or a remount may point at a
                    // dead or replaced file system.
                    self.inner.reopen();
                }
                if recovered {
                    self.recoveries.fetch_add(1, Ordering::Relaxed);
                }
                s.identity = Some(id);
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

    /// [`check`](Self::check) as a result: the mount's error if it is unavailable.
    pub fn check_now(&self) -> Result<(), TierError> {
        match self.check() {
            Health::Ok => Ok(()),
            Health::Unavailable(reason) => Err(self.unavailable(reason)),
        }
    }

    /// While the mount was last found down: checks it again if a check is due, and
    /// fails (at once when none is due) unless it is back. No I/O while it is healthy.
    /// What a load checks before it makes room for a page that only this tier holds.
    pub fn still_down(&self) -> Result<(), TierError> {
        match self.health() {
            Health::Ok => Ok(()),
            Health::Unavailable(_) => self.check_if_due(),
        }
    }

    /// Checks the mount if a check is due; fails at once while it is known to be down
    /// and no check is due.
    pub(crate) fn check_if_due(&self) -> Result<(), TierError> {
        {
            let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let due = s.last_check.is_none_or(|t| t.elapsed() >= self.cfg.recheck);
            match (due, s.healthy) {
                (false, true) => return Ok(()),
                (false, false) => return Err(self.unavailable(s.reason.clone())),
                (true, _) => {}
            }
        }
        self.check_now()
    }

    /// Runs `f` (I/O on the mount, e.g. opening a model's manifest) bounded by the
    /// timeout. A timeout marks the mount unhealthy; `f`'s own result is returned as is.
    pub fn call<T: Send + 'static>(
        &self,
        what: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, TierError> {
        with_timeout(self.cfg.timeout, f).map_err(|e| {
            let reason = format!("{what} ({}) {e}", self.root().display());
            self.mark_unhealthy(reason.clone());
            self.unavailable(reason)
        })
    }

    /// [`FileTier::check_extent`] on the mount, bounded by the timeout. While the mount
    /// is known to be down it fails at once unless a re-check is due and finds it back
    /// (a healthy mount is probed by the read that follows, not twice).
    pub fn check_extent(&self, ext: &Extent) -> Result<(), TierError> {
        self.still_down()?;
        let inner = Arc::clone(&self.inner);
        let ext = ext.clone();
        self.call("checking an extent's file length", move || {
            inner.check_extent(&ext)
        })?
    }

    fn timed_read(&self, ext: &Extent, buf: &mut [u8]) -> Result<(), Option<TierError>> {
        let inner = Arc::clone(&self.inner);
        let ext2 = ext.clone();
        let len = buf.len();
        // The helper reads into a buffer of its own: `buf` must not be written by a
        // thread that may outlive this call. Buffers are recycled, so a read does not
        // fault in fresh memory every time.
        let mut local = self
            .spare
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default();
        let r = with_timeout(self.cfg.timeout, move || {
            local.clear();
            local.resize(len, 0);
            let r = inner.read_extent(&ext2, &mut local);
            (local, r)
        });
        match r {
            Ok((local, r)) => {
                if r.is_ok() {
                    buf.copy_from_slice(&local);
                }
                if local.capacity() <= SPARE_BUFFER_MAX {
                    let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
                    if spare.len() < SPARE_BUFFERS {
                        spare.push(local);
                    }
                }
                r.map_err(Some)
            }
            Err(_) => Err(None),
        }
    }

    /// Reads an extent: checks the mount first when a check is due, fails at once
    /// while it is known to be down, and gives up after the timeout. A read that fails
    /// with an I/O error checks (and remounts) the mount at once and, if it is back,
    /// reads once more.
    pub fn read_extent(&self, ext: &Extent, buf: &mut [u8]) -> Result<(), TierError> {
        assert_eq!(
            buf.len() as u64,
            ext.len,
            "buffer length must equal the extent length"
        );
        self.check_if_due()?;
        let first = match self.timed_read(ext, buf) {
            Ok(()) => return Ok(()),
            // The file's own problem, not the mount's.
            Err(Some(e @ (TierError::Truncated { .. } | TierError::Invalid { .. }))) => {
                return Err(e)
            }
            Err(Some(e)) => e.to_string(),
            Err(None) => {
                // A hung read: the mount is dead or far too slow. Checking it now
                // would likely hang as well; the next read re-checks when due.
                self.inner.counters().record_error();
                let path = self.inner.path_of(&ext.file).unwrap_or_default();
                let reason = format!(
                    "a read of {} did not finish within {:?}",
                    path.display(),
                    self.cfg.timeout
                );
                self.mark_unhealthy(reason.clone());
                return Err(self.unavailable(reason));
            }
        };
        match self.check() {
            Health::Ok => {
                // The mount answers (again): the failed handle may be stale.
                self.inner.reopen();
                match self.timed_read(ext, buf) {
                    Ok(()) => Ok(()),
                    // The mount is fine: the error is the file's (it names its path).
                    Err(Some(e)) => Err(e),
                    Err(None) => {
                        self.inner.counters().record_error();
                        Err(self.unavailable(format!(
                            "{first}; after a re-check, a read did not finish within {:?}",
                            self.cfg.timeout
                        )))
                    }
                }
            }
            Health::Unavailable(reason) => Err(self.unavailable(format!("{first}; {reason}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Setup {
        d: tempfile::TempDir,
        mnt: PathBuf,
        gone: PathBuf,
    }

    /// A mount `mnt` holding `models/m/w.bin` (bytes 0..64), and where it goes when
    /// it disappears (`mnt.gone`).
    fn setup() -> Setup {
        let d = tempfile::tempdir().unwrap();
        let model = d.path().join("mnt/models/m");
        std::fs::create_dir_all(&model).unwrap();
        std::fs::write(model.join("w.bin"), (0..64u8).collect::<Vec<_>>()).unwrap();
        Setup {
            mnt: d.path().join("mnt"),
            gone: d.path().join("mnt.gone"),
            d,
        }
    }

    fn cfg(s: &Setup, remount: bool) -> NasConfig {
        NasConfig {
            mount: s.mnt.clone(),
            model: PathBuf::from("models/m"),
            timeout: Duration::from_secs(2),
            recheck: Duration::ZERO,
            remount_command: remount.then(|| {
                format!(
                    "if test -d '{g}'; then mv '{g}' '{m}'; fi",
                    g = s.gone.display(),
                    m = s.mnt.display()
                )
            }),
        }
    }

    fn ext() -> Extent {
        Extent {
            file: "w.bin".into(),
            offset: 8,
            len: 8,
        }
    }

    const BYTES: [u8; 8] = [8, 9, 10, 11, 12, 13, 14, 15];

    #[test]
    fn a_mount_that_disappears_fails_clearly_and_recovers_when_it_returns() {
        let s = setup();
        let nas = NasTier::new("nas", cfg(&s, false));
        let mut buf = [0u8; 8];
        nas.read_extent(&ext(), &mut buf).unwrap();
        assert_eq!(buf, BYTES);

        // The mount disappears (its directory moves away, as an unmounted mount point
        // loses its contents). The open handle still reads: the health probe is what
        // notices.
        std::fs::rename(&s.mnt, &s.gone).unwrap();
        let e = nas.read_extent(&ext(), &mut buf).unwrap_err();
        assert!(matches!(e, TierError::MountUnavailable { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("NAS mount {}", s.mnt.display())) && msg.contains("No such file"),
            "{msg}"
        );
        assert!(matches!(nas.health(), Health::Unavailable(_)));
        assert_eq!((nas.outages(), nas.recoveries()), (1, 0));

        // It comes back: the next read re-checks and reads.
        std::fs::rename(&s.gone, &s.mnt).unwrap();
        buf = [0; 8];
        nas.read_extent(&ext(), &mut buf).unwrap();
        assert_eq!(buf, BYTES);
        assert_eq!(nas.health(), Health::Ok);
        assert_eq!((nas.outages(), nas.recoveries()), (1, 1));
    }

    #[test]
    fn the_remount_command_brings_a_vanished_mount_back_within_one_read() {
        let s = setup();
        let nas = NasTier::new("nas", cfg(&s, true));
        let mut buf = [0u8; 8];
        nas.read_extent(&ext(), &mut buf).unwrap();
        std::fs::rename(&s.mnt, &s.gone).unwrap();
        buf = [0; 8];
        nas.read_extent(&ext(), &mut buf).unwrap();
        assert_eq!(buf, BYTES);
        assert!(s.mnt.is_dir() && !s.gone.exists());
        assert_eq!((nas.outages(), nas.recoveries()), (1, 1));
        assert_eq!(nas.health(), Health::Ok);
    }

    #[test]
    fn a_replaced_model_directory_is_re_resolved() {
        let s = setup();
        let nas = NasTier::new("nas", cfg(&s, false));
        let mut buf = [0u8; 8];
        nas.read_extent(&ext(), &mut buf).unwrap();
        // Another file system mounted in its place (a new directory, new inode, other
        // bytes): the old handle would still read the old file.
        let model = s.mnt.join("models/m");
        std::fs::rename(&model, s.d.path().join("old")).unwrap();
        std::fs::create_dir(&model).unwrap();
        std::fs::write(model.join("w.bin"), (100..164u8).collect::<Vec<_>>()).unwrap();
        nas.read_extent(&ext(), &mut buf).unwrap();
        assert_eq!(buf, [108, 109, 110, 111, 112, 113, 114, 115]);
    }

    #[test]
    fn while_recheck_is_not_due_reads_fail_fast() {
        let s = setup();
        let nas = NasTier::new(
            "nas",
            NasConfig {
                recheck: Duration::from_secs(3600),
                ..cfg(&s, false)
            },
        );
        std::fs::rename(&s.mnt, &s.gone).unwrap();
        let mut buf = [0u8; 8];
        assert!(nas.read_extent(&ext(), &mut buf).is_err());
        let t = Instant::now();
        let e = nas.read_extent(&ext(), &mut buf).unwrap_err();
        assert!(matches!(e, TierError::MountUnavailable { .. }), "{e}");
        assert!(t.elapsed() < Duration::from_millis(100));
    }

    #[test]
    fn a_failing_remount_command_is_reported() {
        let s = setup();
        let nas = NasTier::new(
            "nas",
            NasConfig {
                remount_command: Some("echo no such share >&2; exit 3".into()),
                ..cfg(&s, false)
            },
        );
        std::fs::rename(&s.mnt, &s.gone).unwrap();
        match nas.check() {
            Health::Unavailable(r) => {
                assert!(
                    r.contains("No such file") && r.contains("no such share"),
                    "{r}"
                )
            }
            Health::Ok => panic!("should be unavailable"),
        }
    }

    /// Regression: a check waiting behind another one takes its answer only if that
    /// one probed after the wait began. A check that probed during an outage and
    /// ended after the mount came back (its remount command slow) answered a request
    /// made after the remount with "down": the likely cause of a `nas_midrun` flake
    /// seen once (a prefetch's check, then the demand request's after the remount).
    #[test]
    fn a_check_begun_before_the_mount_came_back_does_not_answer_a_later_one() {
        let s = setup();
        let nas = Arc::new(NasTier::new(
            "nas",
            NasConfig {
                remount_command: Some("sleep 0.6; exit 1".into()),
                ..cfg(&s, false)
            },
        ));
        std::fs::rename(&s.mnt, &s.gone).unwrap();
        let early = {
            let nas = Arc::clone(&nas);
            std::thread::spawn(move || nas.check())
        };
        // The early check has probed (and found nothing) and runs its remount command.
        std::thread::sleep(Duration::from_millis(200));
        std::fs::rename(&s.gone, &s.mnt).unwrap();
        let later = nas.check();
        assert!(matches!(early.join().unwrap(), Health::Unavailable(_)));
        assert_eq!(later, Health::Ok, "a check after the mount came back");
    }

    /// A FIFO with no writer: opening it blocks, like I/O on a dead network mount.
    fn hanging_file(s: &Setup) -> PathBuf {
        let fifo = s.mnt.join("models/m/hang.bin");
        let st = Command::new("mkfifo").arg(&fifo).status().unwrap();
        assert!(st.success());
        fifo
    }

    /// Lets the abandoned helper thread blocked on `fifo` finish.
    fn release(fifo: &Path) {
        drop(std::fs::OpenOptions::new().write(true).open(fifo).unwrap());
    }

    /// Bytes of the sparse file [`slow_read`] reads: reading them all (into fresh
    /// memory) takes a hundred milliseconds or more, far beyond its timeout.
    const SLOW_LEN: u64 = 256 << 20;

    /// A read that outlasts a 20 ms timeout, like one on a mount that has become very
    /// slow: a sparse file of [`SLOW_LEN`] bytes, read whole. (A FIFO, which blocks for
    /// good, is no longer opened at all: the tier reads regular files only.)
    fn slow_read(s: &Setup) -> (NasTier, Extent) {
        let f = std::fs::File::create(s.mnt.join("models/m/slow.bin")).unwrap();
        f.set_len(SLOW_LEN).unwrap();
        let nas = NasTier::new(
            "nas",
            NasConfig {
                timeout: Duration::from_millis(20),
                ..cfg(s, false)
            },
        );
        let ext = Extent {
            file: "slow.bin".into(),
            offset: 0,
            len: SLOW_LEN,
        };
        (nas, ext)
    }

    #[test]
    fn a_read_that_outlasts_the_timeout_times_out() {
        let s = setup();
        let (nas, ext) = slow_read(&s);
        let mut buf = vec![0u8; SLOW_LEN as usize];
        let t = Instant::now();
        let e = nas.read_extent(&ext, &mut buf).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(2));
        // The read times out; on a loaded machine the mount's own check before it
        // (same 20 ms budget) may be the one that runs out: a timeout either way.
        let m = e.to_string();
        assert!(
            m.contains("did not finish within 20ms") || m.contains("did not answer within 20ms"),
            "{e}"
        );
        assert!(matches!(nas.health(), Health::Unavailable(_)));
    }

    /// The regression of a session stuck for good: a FIFO in place of a model file
    /// blocked the tier's open until a writer came (here: until the timeout, and its
    /// helper thread for ever). It is refused at once, naming what it is, and the
    /// mount stays healthy.
    #[test]
    fn a_fifo_on_the_mount_is_refused_at_once_not_waited_on() {
        let s = setup();
        let nas = NasTier::new("nas", cfg(&s, false));
        let _fifo = hanging_file(&s);
        let t = Instant::now();
        let e = nas
            .read_extent(
                &Extent {
                    file: "hang.bin".into(),
                    offset: 0,
                    len: 4,
                },
                &mut [0u8; 4],
            )
            .unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        assert!(
            e.to_string().contains("hang.bin") && e.to_string().contains("is a FIFO"),
            "{e}"
        );
        assert_eq!(nas.health(), Health::Ok);
    }

    #[test]
    fn work_on_the_mount_that_hangs_times_out() {
        let s = setup();
        let nas = NasTier::new(
            "nas",
            NasConfig {
                timeout: Duration::from_millis(200),
                ..cfg(&s, false)
            },
        );
        let fifo = hanging_file(&s);
        let f = fifo.clone();
        let t = Instant::now();
        let e = nas
            .call("reading the manifest", move || std::fs::read(f))
            .unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(2));
        let msg = e.to_string();
        assert!(
            msg.contains("reading the manifest") && msg.contains("within"),
            "{msg}"
        );
        assert!(matches!(nas.health(), Health::Unavailable(_)));
        release(&fifo);
        // A call that finishes returns its own result.
        assert_eq!(nas.call("adding", || 1 + 1).unwrap(), 2);
    }

    #[test]
    fn a_missing_file_on_a_healthy_mount_is_the_file_s_error() {
        let s = setup();
        let nas = NasTier::new("nas", cfg(&s, false));
        let mut buf = [0u8; 1];
        let e = nas
            .read_extent(
                &Extent {
                    file: "absent.bin".into(),
                    offset: 0,
                    len: 1,
                },
                &mut buf,
            )
            .unwrap_err();
        assert!(matches!(e, TierError::Io { .. }), "{e}");
        assert!(e.to_string().contains("absent.bin"), "{e}");
        assert_eq!(nas.health(), Health::Ok);
        assert_eq!(nas.outages(), 0);
    }

    #[test]
    fn helpers_are_reused_and_a_hung_or_panicking_one_blocks_nothing() {
        let ids: std::collections::HashSet<_> = (0..50)
            .map(|_| with_timeout(Duration::from_secs(2), || std::thread::current().id()).unwrap())
            .collect();
        assert!(
            ids.len() < 25,
            "{} helpers for 50 sequential calls",
            ids.len()
        );

        let s = setup();
        let fifo = hanging_file(&s);
        let f = fifo.clone();
        assert!(with_timeout(Duration::from_millis(100), move || std::fs::read(f)).is_err());
        let t = Instant::now();
        assert_eq!(with_timeout(Duration::from_secs(2), || 7).unwrap(), 7);
        assert!(t.elapsed() < Duration::from_secs(1));
        let e = with_timeout(Duration::from_secs(2), || -> u8 { panic!("a bug") }).unwrap_err();
        assert!(e.contains("panicked"), "{e}");
        assert_eq!(with_timeout(Duration::from_secs(2), || 8).unwrap(), 8);
        release(&fifo);
    }
}
