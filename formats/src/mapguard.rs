//! A fault guard for read-only file mappings: reading a mapped file that was truncated
//! (or whose storage failed) is an error naming the file and the byte offset, never a
//! `SIGBUS` that kills the process.
//!
//! When a mapped file shrinks, or the device behind it fails a read, the kernel
//! answers a read of the mapping with `SIGBUS`, whose default action ends the process
//! without a word. A [`GuardedMap`] registers its address range in a fixed-size,
//! lock-free, process-wide table ([`SLOTS`] entries of atomics), and the first
//! `GuardedMap` created installs a `SIGBUS` handler (once per process). For a fault
//! inside a registered range the handler maps a zero-filled, read-only anonymous page
//! over the faulting page (`mmap(MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS)`, a plain
//! system call, safe in a signal handler), records the first fault's offset in the
//! entry and returns: the interrupted read resumes and reads zeros. Any other `SIGBUS`
//! (an address outside every registered range, or a signal sent by a process) goes to
//! the handler that was installed before (Rust's own stack-overflow handler, say) or,
//! when there was none, gets the default action, so it still ends the process.
//!
//! # Guarantee
//!
//! A read of a [`GuardedMap`]'s bytes never raises a signal that ends the process: a
//! page the kernel cannot supply reads as zeros instead. Once any read has faulted,
//! [`GuardedMap::check`] returns [`FormatError::Fault`] naming the file and the byte
//! offset of the first faulting read, and keeps returning it for the life of the
//! mapping (the zero pages stay: a faulted mapping is never trusted again; reopen the
//! file). A reader therefore calls `check` *after* it has used the bytes, and on `Err`
//! discards everything it computed from them. Bytes read before a fault are the file's
//! bytes as they were at the moment of the read; a reader that does not call `check`
//! turns what used to be a crash into silent zeros, so every reader of a guarded
//! mapping must check. Limits: the guard covers faults the kernel reports with
//! `SIGBUS` (a truncated file, an I/O error on the backing store) in threads that do
//! not block `SIGBUS`; a handler installed later by other code replaces the guard; at
//! most [`SLOTS`] mappings are guarded at once (one more is an error, never an
//! unguarded mapping).
//!
//! The guard does not notice bytes that *change* in place (another process writing the
//! file): that is what [`FileIdentity`] and the manifest's hashes are for.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};

use memmap2::Mmap;

use crate::error::{FormatError, Result};

/// How many mappings can be guarded at once (the signal handler scans them all).
pub const SLOTS: usize = 1024;

/// One guarded range. `start == 0` means the slot is free or being set up; the handler
/// reads `start`, `len`, then `start` again, so it never matches a torn pair.
struct Slot {
    /// Taken by a mapping (set up and torn down by its owner only).
    claimed: AtomicBool,
    /// First byte of the mapping; 0 when the slot holds no range.
    start: AtomicUsize,
    len: AtomicUsize,
    /// Offset of the first faulting read plus one; 0 while no read has faulted.
    fault: AtomicUsize,
}

impl Slot {
    const fn new() -> Slot {
        Slot {
            claimed: AtomicBool::new(false),
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            fault: AtomicUsize::new(0),
        }
    }
}

static TABLE: [Slot; SLOTS] = [const { Slot::new() }; SLOTS];
/// The system page size, stored before the handler is installed.
static PAGE_SIZE: AtomicUsize = AtomicUsize::new(0);
/// The `SIGBUS` disposition in place before ours, to chain to.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();
static INSTALL: Once = Once::new();
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// A read-only memory mapping of a whole file whose read faults are caught (see the
/// [module documentation](self) for the exact guarantee).
pub struct GuardedMap {
    map: Mmap,
    /// The table slot; `None` for an empty mapping (nothing to read, nothing to guard).
    slot: Option<usize>,
    path: PathBuf,
}

impl std::fmt::Debug for GuardedMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuardedMap")
            .field("path", &self.path)
            .field("len", &self.map.len())
            .field("fault_offset", &self.fault_offset())
            .finish()
    }
}

impl GuardedMap {
    /// Maps `file` (opened for reading; `path` names it in errors) read-only, in full,
    /// and guards the mapping. Errors: the mapping fails, the `SIGBUS` handler cannot
    /// be installed, or [`SLOTS`] mappings are guarded already.
    pub fn map(file: &File, path: &Path) -> Result<GuardedMap> {
        install().map_err(|e| FormatError::io(path, e))?;
        // SAFETY: the mapping is read-only and private to this value. The file may
        // still be truncated or rewritten by another process while it is mapped: a read
        // fault is caught by the guard registered below before any byte is read, and
        // in-place changes are for the readers to detect (module documentation).
        let map = unsafe { Mmap::map(file) }.map_err(|e| FormatError::io(path, e))?;
        let slot = if map.is_empty() {
            None
        } else {
            Some(register(map.as_ptr() as usize, map.len()).ok_or_else(|| {
                FormatError::Unsupported {
                    path: path.to_path_buf(),
                    what: format!("mapping more than {SLOTS} files at once"),
                }
            })?)
        };
        Ok(GuardedMap {
            map,
            slot,
            path: path.to_path_buf(),
        })
    }

    /// The mapped bytes. Reads past a truncation return zeros; call [`check`] after
    /// using them.
    ///
    /// [`check`]: GuardedMap::check
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// The mapping's length (the file's length when it was mapped).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True for the mapping of an empty file.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The mapped file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Offset in the file of the first read that faulted, if one did.
    pub fn fault_offset(&self) -> Option<u64> {
        let slot = self.slot?;
        match TABLE[slot].fault.load(Ordering::Acquire) {
            0 => None,
            n => Some((n - 1) as u64),
        }
    }

    /// `Ok` while no read of the mapping has faulted; else [`FormatError::Fault`]
    /// naming the file and the offset of the first faulting read. Once `Err`, always
    /// `Err`: everything read from the mapping since the reader's previous successful
    /// check may be zeros instead of the file's bytes and must be discarded. One atomic
    /// load.
    pub fn check(&self) -> Result<()> {
        match self.fault_offset() {
            None => Ok(()),
            Some(offset) => Err(FormatError::Fault {
                path: self.path.clone(),
                offset,
            }),
        }
    }
}

impl std::ops::Deref for GuardedMap {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map
    }
}

impl Drop for GuardedMap {
    fn drop(&mut self) {
        // The range leaves the table before `map` is unmapped (fields drop after this
        // body), so the handler never zero-fills an address that another mapping may
        // reuse. No read of `map` is possible any more: `&self` borrows have ended.
        if let Some(slot) = self.slot {
            let s = &TABLE[slot];
            s.start.store(0, Ordering::Release);
            s.len.store(0, Ordering::Release);
            s.fault.store(0, Ordering::Release);
            s.claimed.store(false, Ordering::Release);
        }
    }
}

/// Claims a free slot for `[start, start + len)`; `None` when every slot is taken.
fn register(start: usize, len: usize) -> Option<usize> {
    for (i, s) in TABLE.iter().enumerate() {
        if s.claimed
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            s.fault.store(0, Ordering::Release);
            s.len.store(len, Ordering::Release);
            // Published last: the handler considers the slot only once `start` is set.
            s.start.store(start, Ordering::Release);
            return Some(i);
        }
    }
    None
}

/// Installs the `SIGBUS` handler once per process.
fn install() -> std::io::Result<()> {
    INSTALL.call_once(|| {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if page <= 0 {
            return;
        }
        PAGE_SIZE.store(page as usize, Ordering::Release);
        // SAFETY: an all-zero sigaction is a valid value of the C struct (SIG_DFL, an
        // empty mask, no flags).
        let mut previous: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: a null new action only reads the current one into `previous`, a
        // valid, writable sigaction.
        if unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut previous) } != 0 {
            return;
        }
        // Stored before ours is installed, so the handler always finds it.
        let _ = PREVIOUS.set(previous);
        // SAFETY: as above, all-zero is a valid sigaction.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_sigbus as *const () as libc::sighandler_t;
        // SA_ONSTACK: run on the thread's alternate signal stack where it has one (Rust
        // gives one to its threads), so that a stack overflow reported as SIGBUS still
        // reaches Rust's overflow handler with room to run.
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        // SAFETY: `action.sa_mask` is a valid sigset_t to initialise.
        unsafe { libc::sigemptyset(&mut action.sa_mask) };
        // SAFETY: `action` is a fully initialised sigaction whose handler has the
        // SA_SIGINFO signature; the old action is not wanted (read above).
        if unsafe { libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) } == 0 {
            INSTALLED.store(true, Ordering::Release);
        }
    });
    if INSTALLED.load(Ordering::Acquire) {
        Ok(())
    } else {
        Err(std::io::Error::other(
            "cannot install the SIGBUS handler that guards memory-mapped files",
        ))
    }
}

/// The `SIGBUS` handler. Async-signal-safe: atomics, `mmap`, `sigaction` and `raise`
/// only; no allocation, no lock. `errno` is preserved.
extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let errno = errno_location();
    // SAFETY: errno_location returns this thread's errno, always valid.
    let saved = unsafe { *errno };
    // SAFETY: the kernel passes a valid siginfo_t (or null, which is checked).
    let handled = unsafe { zero_fill_fault(info) };
    // SAFETY: as above.
    unsafe { *errno = saved };
    if !handled {
        // SAFETY: `sig`, `info` and `ctx` are the kernel's, passed through unchanged.
        unsafe { chain(sig, info, ctx) };
    }
}

/// For a kernel-reported fault inside a registered range: records the fault (the first
/// one's offset is kept), maps a zero page over the faulting page, and returns true.
///
/// # Safety
/// `info` is null or points to the `siginfo_t` the kernel passed to the handler.
unsafe fn zero_fill_fault(info: *mut libc::siginfo_t) -> bool {
    if info.is_null() {
        return false;
    }
    // SAFETY: non-null, from the kernel (the caller's contract).
    let info = unsafe { &*info };
    // si_code <= 0: sent by a process (kill, raise), not a fault; si_addr is not set.
    if info.si_code <= 0 {
        return false;
    }
    // SAFETY: a kernel-generated SIGBUS carries the faulting address.
    let addr = unsafe { fault_address(info) };
    let page = PAGE_SIZE.load(Ordering::Acquire);
    if page == 0 {
        return false;
    }
    for s in &TABLE {
        let start = s.start.load(Ordering::Acquire);
        if start == 0 {
            continue;
        }
        let len = s.len.load(Ordering::Acquire);
        if s.start.load(Ordering::Acquire) != start {
            continue;
        }
        if addr < start || addr - start >= len {
            continue;
        }
        // Recorded before the zero page is mapped: whoever reads zeros from that page
        // (this thread or another) finds the fault recorded when it checks.
        let _ = s
            .fault
            .compare_exchange(0, addr - start + 1, Ordering::AcqRel, Ordering::Relaxed);
        let page_start = addr & !(page - 1);
        // SAFETY: `page_start` is page-aligned and lies in a live, registered mapping
        // (mappings start page-aligned and leave the table before they are unmapped);
        // MAP_FIXED replaces exactly that page of it with a private, zero-filled,
        // read-only page, which the owning `Mmap` unmaps with the rest on drop. No Rust
        // object other than that mapping's bytes lives there.
        let p = unsafe {
            libc::mmap(
                page_start as *mut libc::c_void,
                page,
                libc::PROT_READ,
                libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        // MAP_FAILED: the fault cannot be papered over; the default action follows.
        return p != libc::MAP_FAILED;
    }
    false
}

/// Hands a `SIGBUS` that is not a guarded fault to the previous disposition: its
/// handler, or the default action (the process ends with `SIGBUS`, as without the
/// guard).
///
/// # Safety
/// The arguments are those the kernel passed to the handler.
unsafe fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    if let Some(prev) = PREVIOUS.get() {
        let h = prev.sa_sigaction;
        // SAFETY: `info` is the kernel's (null checked).
        let from_kernel = !info.is_null() && unsafe { (*info).si_code } > 0;
        if h == libc::SIG_IGN && !from_kernel {
            return;
        }
        if h != libc::SIG_DFL && h != libc::SIG_IGN {
            if prev.sa_flags & libc::SA_SIGINFO != 0 {
                // SAFETY: with SA_SIGINFO the previous handler has this signature; it
                // was installed for SIGBUS and expects exactly these arguments.
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    unsafe { std::mem::transmute(h) };
                f(sig, info, ctx);
            } else {
                // SAFETY: without SA_SIGINFO the previous handler takes the signal only.
                let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(h) };
                f(sig);
            }
            return;
        }
    }
    // Default action: restore it and raise. SIGBUS is blocked while this handler runs,
    // so it is delivered (and ends the process) as the handler returns; a faulting
    // instruction, re-executed, would fault again under the default action anyway.
    // SAFETY: all-zero is a valid sigaction (SIG_DFL, empty mask).
    let mut dfl: libc::sigaction = unsafe { std::mem::zeroed() };
    dfl.sa_sigaction = libc::SIG_DFL;
    // SAFETY: `dfl` is initialised; sigaction and raise are async-signal-safe.
    unsafe {
        libc::sigaction(sig, &dfl, std::ptr::null_mut());
        libc::raise(sig);
    }
}

#[cfg(any(target_os = "linux", target_os = "android"))]
fn errno_location() -> *mut libc::c_int {
    // SAFETY: returns a pointer to the calling thread's errno; no preconditions.
    unsafe { libc::__errno_location() }
}

#[cfg(any(target_os = "macos", target_os = "ios", target_os = "freebsd"))]
fn errno_location() -> *mut libc::c_int {
    // SAFETY: returns a pointer to the calling thread's errno; no preconditions.
    unsafe { libc::__error() }
}

/// # Safety
/// `info` is a kernel-generated `SIGBUS`'s siginfo.
#[cfg(any(target_os = "linux", target_os = "android"))]
unsafe fn fault_address(info: &libc::siginfo_t) -> usize {
    // SAFETY: for SIGBUS raised by a fault the kernel fills si_addr.
    unsafe { info.si_addr() as usize }
}

/// # Safety
/// `info` is a kernel-generated `SIGBUS`'s siginfo.
#[cfg(any(target_os = "macos", target_os = "ios", target_os = "freebsd"))]
unsafe fn fault_address(info: &libc::siginfo_t) -> usize {
    info.si_addr as usize
}

/// What identifies a file's contents without reading them: device, inode, length and
/// the modification and status-change times, from one `fstat` of an open descriptor.
/// Two different values mean the file changed (or is another file); equal values mean
/// it did not, up to the file system's timestamp granularity (see the crate's
/// guarantee in the embedded store's documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileIdentity {
    pub dev: u64,
    pub ino: u64,
    pub len: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i128,
    /// Status-change time (changed by every write, truncation, chmod, link and unlink,
    /// and by setting the modification time back), nanoseconds since the epoch.
    pub ctime_ns: i128,
    /// Hard links to the inode (0 once it was unlinked or renamed over).
    pub nlink: u64,
}

impl FileIdentity {
    /// The identity in `meta` (the metadata of an open file).
    pub fn of_metadata(meta: &std::fs::Metadata) -> FileIdentity {
        use std::os::unix::fs::MetadataExt;
        FileIdentity {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.size(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            ctime_ns: i128::from(meta.ctime()) * 1_000_000_000 + i128::from(meta.ctime_nsec()),
            nlink: meta.nlink(),
        }
    }

    /// Whether the file's bytes may differ from what they were at `earlier`: another
    /// inode, length or modification time, or a status change that is not explained by
    /// a change of the link count alone. A rename over the file, or a hard link to it,
    /// changes `ctime` and `nlink` but not the bytes, so it does not count; a write
    /// changes `mtime` (and `ctime`), and putting `mtime` back changes `ctime` with the
    /// link count unchanged, so both count.
    pub fn content_may_differ(&self, earlier: &FileIdentity) -> bool {
        (self.dev, self.ino, self.len, self.mtime_ns)
            != (earlier.dev, earlier.ino, earlier.len, earlier.mtime_ns)
            || (self.ctime_ns != earlier.ctime_ns && self.nlink == earlier.nlink)
    }

    /// The current identity of the open `file` (one `fstat`; `path` names it in errors).
    pub fn of_file(file: &File, path: &Path) -> Result<FileIdentity> {
        file.metadata()
            .map(|m| FileIdentity::of_metadata(&m))
            .map_err(|e| FormatError::io(path, e))
    }

    /// What differs from `earlier`, in words ("length 100 -> 50, ctime").
    pub fn differences(&self, earlier: &FileIdentity) -> String {
        let mut d = Vec::new();
        if (self.dev, self.ino) != (earlier.dev, earlier.ino) {
            d.push("inode".to_string());
        }
        if self.len != earlier.len {
            d.push(format!("length {} -> {} bytes", earlier.len, self.len));
        }
        if self.mtime_ns != earlier.mtime_ns {
            d.push("mtime".to_string());
        }
        if self.ctime_ns != earlier.ctime_ns {
            d.push("ctime".to_string());
        }
        if self.nlink != earlier.nlink {
            d.push(format!("links {} -> {}", earlier.nlink, self.nlink));
        }
        d.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file_of(len: usize) -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("weights.bin");
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8 + 1).collect();
        std::fs::File::create(&p)
            .unwrap()
            .write_all(&bytes)
            .unwrap();
        (d, p)
    }

    fn page() -> usize {
        // SAFETY: sysconf has no preconditions.
        unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
    }

    /// The defect-4 mechanism on a real file and a real signal: a read past a
    /// truncation reads zeros instead of killing the process, and check() names the
    /// file and the offset of the read.
    #[test]
    fn sigbus_reading_past_a_truncation_is_an_error_naming_file_and_offset() {
        let pg = page();
        let (_d, p) = file_of(8 * pg);
        let f = File::open(&p).unwrap();
        let m = GuardedMap::map(&f, &p).unwrap();
        assert_eq!(m.len(), 8 * pg);
        assert_eq!(m[5 * pg + 3], ((5 * pg + 3) % 251) as u8 + 1);
        assert!(m.check().is_ok());

        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(2 * pg as u64)
            .unwrap();
        // Still the file's bytes below the new end.
        assert_eq!(m[pg + 1], ((pg + 1) % 251) as u8 + 1);
        assert!(m.check().is_ok());
        // Past it: a SIGBUS, caught; the read sees zeros.
        let off = 6 * pg + 17;
        // SAFETY: `off` is inside the mapping; a volatile read so the access happens.
        let v = unsafe { std::ptr::read_volatile(m.as_ptr().add(off)) };
        assert_eq!(v, 0);
        let e = m.check().unwrap_err();
        match &e {
            FormatError::Fault { path, offset } => {
                assert_eq!(path, &p);
                assert_eq!(*offset, off as u64);
            }
            other => panic!("expected a fault, got {other:?}"),
        }
        assert!(e.to_string().contains("weights.bin"), "{e}");
        assert!(e.to_string().contains(&off.to_string()), "{e}");
        // The first fault is the one reported; the whole tail reads as zeros now.
        assert!(m[3 * pg..].iter().all(|&b| b == 0));
        assert_eq!(m.fault_offset(), Some(off as u64));
    }

    #[test]
    fn a_fresh_mapping_of_the_same_file_is_not_faulted_and_slots_are_reused() {
        let pg = page();
        let (_d, p) = file_of(4 * pg);
        for _ in 0..(SLOTS + 10) {
            let f = File::open(&p).unwrap();
            let m = GuardedMap::map(&f, &p).unwrap();
            assert_eq!(m[3 * pg], ((3 * pg) % 251) as u8 + 1);
            assert!(m.check().is_ok());
        }
    }

    #[test]
    fn identity_sees_writes_truncation_and_replacement() {
        let (d, p) = file_of(4096);
        let f = File::open(&p).unwrap();
        let a = FileIdentity::of_file(&f, &p).unwrap();
        assert_eq!(a, FileIdentity::of_file(&f, &p).unwrap());
        assert_eq!(a.len, 4096);
        use std::os::unix::fs::FileExt;
        let w = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        w.write_all_at(&[9, 9], 100).unwrap();
        let b = FileIdentity::of_file(&f, &p).unwrap();
        assert!(
            b.content_may_differ(&a),
            "an in-place write changes the identity"
        );
        assert!(b.differences(&a).contains("ctime"), "{}", b.differences(&a));
        // Setting the modification time back is still a change (ctime moves).
        let times = [libc::timespec {
            tv_sec: (a.mtime_ns / 1_000_000_000) as libc::time_t,
            tv_nsec: (a.mtime_ns % 1_000_000_000) as libc::c_long,
        }; 2];
        use std::os::fd::AsRawFd;
        // SAFETY: a valid descriptor and two valid timespecs.
        assert_eq!(unsafe { libc::futimens(w.as_raw_fd(), times.as_ptr()) }, 0);
        let b2 = FileIdentity::of_file(&f, &p).unwrap();
        assert_eq!(b2.mtime_ns, a.mtime_ns);
        assert!(b2.content_may_differ(&a), "{}", b2.differences(&a));
        w.set_len(10).unwrap();
        let c = FileIdentity::of_file(&f, &p).unwrap();
        assert!(c.content_may_differ(&b2));
        assert!(c.differences(&b2).contains("length 4096 -> 10"));
        // A replacement by rename leaves the open descriptor on the old inode: its link
        // count and ctime change, its bytes do not.
        let q = d.path().join("new.bin");
        std::fs::write(&q, [1u8; 10]).unwrap();
        std::fs::rename(&q, &p).unwrap();
        let c2 = FileIdentity::of_file(&f, &p).unwrap();
        assert_eq!((c2.nlink, c.nlink), (0, 1));
        assert!(!c2.content_may_differ(&c), "{}", c2.differences(&c));
        let reopened = File::open(&p).unwrap();
        let other = FileIdentity::of_file(&reopened, &p).unwrap();
        assert!(other.content_may_differ(&c2));
        assert!(other.differences(&c2).contains("inode"));
    }

    /// Runs `case` of [`child_entry`] in a fresh process (this test binary, re-run on
    /// that one test) and returns its exit status and output.
    fn run_child(case: &str) -> (std::process::ExitStatus, String) {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "mapguard::tests::child_entry",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, case)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status, text)
    }

    const CHILD_ENV: &str = "VOOM_MAPGUARD_CHILD";

    /// The child processes' side: does nothing unless [`CHILD_ENV`] names a case.
    #[test]
    fn child_entry() {
        let Ok(case) = std::env::var(CHILD_ENV) else {
            return;
        };
        // No core files from the cases that are meant to die.
        let no_core = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `no_core` is a valid rlimit.
        unsafe { libc::setrlimit(libc::RLIMIT_CORE, &no_core) };
        let pg = page();
        let (_d, p) = file_of(4 * pg);
        let truncate = |p: &Path| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .unwrap()
                .set_len(pg as u64)
                .unwrap()
        };
        let case = match case.strip_prefix("dfl-") {
            Some(rest) => {
                // Before the guard is installed: no previous handler to chain to (Rust's
                // own is replaced by the default action), so the guard's default path runs.
                // SAFETY: all-zero is a valid sigaction (SIG_DFL, empty mask).
                let dfl: libc::sigaction = unsafe { std::mem::zeroed() };
                // SAFETY: `dfl` is initialised.
                unsafe { libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut()) };
                rest.to_string()
            }
            None => case,
        };
        match case.as_str() {
            "guarded" => {
                let f = File::open(&p).unwrap();
                let m = GuardedMap::map(&f, &p).unwrap();
                truncate(&p);
                let sum: u64 = m.iter().map(|&b| u64::from(b)).sum();
                println!("sum {sum}; {}", m.check().unwrap_err());
            }
            "unguarded" => {
                // The guard is installed, but this mapping is not registered.
                let f = File::open(&p).unwrap();
                let _guarded = GuardedMap::map(&f, &p).unwrap();
                // SAFETY: deliberately unguarded and truncated below: the case checks
                // that such a fault still ends the process.
                let raw = unsafe { Mmap::map(&f) }.unwrap();
                truncate(&p);
                // SAFETY: in bounds of the mapping; volatile so the read happens.
                let v = unsafe { std::ptr::read_volatile(raw.as_ptr().add(3 * pg)) };
                println!("survived an unguarded fault, read {v}");
            }
            "sent" | "sent-without-guard" => {
                let f = File::open(&p).unwrap();
                let _guarded = (case == "sent").then(|| GuardedMap::map(&f, &p).unwrap());
                // SAFETY: raise has no preconditions.
                unsafe { libc::raise(libc::SIGBUS) };
                println!("survived a SIGBUS sent by a process");
            }
            "slots" => {
                let f = File::open(&p).unwrap();
                let mut maps = Vec::new();
                let err = loop {
                    match GuardedMap::map(&f, &p) {
                        Ok(m) => maps.push(m),
                        Err(e) => break e,
                    }
                    assert!(maps.len() <= SLOTS, "more mappings than slots");
                };
                println!("{} guarded; then: {err}", maps.len());
                drop(maps);
                assert!(GuardedMap::map(&f, &p).is_ok());
                println!("a slot is free again");
            }
            other => panic!("unknown case {other}"),
        }
    }

    #[test]
    fn sigbus_a_guarded_process_survives_reading_a_truncated_file() {
        let (status, out) = run_child("guarded");
        assert!(status.success(), "{status:?}: {out}");
        assert!(out.contains("sum ") && out.contains("weights.bin"), "{out}");
        assert!(out.contains("reading byte offset"), "{out}");
    }

    #[test]
    fn sigbus_outside_guarded_ranges_still_ends_the_process() {
        use std::os::unix::process::ExitStatusExt;
        // Chained to Rust's handler (a fault), and to the default action (a fault, and a
        // signal sent by a process).
        for case in ["unguarded", "dfl-unguarded", "dfl-sent"] {
            let (status, out) = run_child(case);
            assert_eq!(
                status.signal(),
                Some(libc::SIGBUS),
                "{case}: {status:?}: {out}"
            );
            assert!(!out.contains("survived"), "{case}: {out}");
        }
        // A sent SIGBUS fares as it does without the guard (Rust's handler, which only
        // acts on faults, lets the process go on).
        let (with, out_with) = run_child("sent");
        let (without, out_without) = run_child("sent-without-guard");
        assert_eq!(
            with.signal(),
            without.signal(),
            "{out_with} / {out_without}"
        );
        assert_eq!(with.code(), without.code(), "{out_with} / {out_without}");
    }

    #[test]
    fn every_slot_taken_is_an_error_not_an_unguarded_mapping() {
        // In a child: taking every slot would fail other tests' mappings meanwhile.
        let (status, out) = run_child("slots");
        assert!(status.success(), "{status:?}: {out}");
        assert!(out.contains(&format!("{SLOTS} guarded")), "{out}");
        assert!(out.contains("more than 1024 files"), "{out}");
        assert!(out.contains("a slot is free again"), "{out}");
    }
}
