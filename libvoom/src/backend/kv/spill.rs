//! The KV pool: the byte budget of the closed KV pages of every cache an engine
//! makes, and the file the pages beyond it spill to.
//!
//! - **Budget.** Resident closed pages plus the copies read ahead stay within
//!   [`KvPool::budget`]: resident pages within three quarters of it, copies read
//!   ahead within the rest. A page closing past it spills the oldest resident pages
//!   (in the order they closed: an idle prefix's pages before a live sequence's,
//!   a sequence's first positions before its last) until the pages fit. The budget
//!   can change while pages live ([`KvPool::set_budget`]: the memory governor).
//! - **Spill file.** One file per pool, in the pool's directory, named after the
//!   process (`kv-<pid>-<n>.spill`; a dead process's files are removed when a pool
//!   starts), removed when the pool goes. Each page takes a slot rounded up to
//!   [`DIRECT_ALIGN`], written and read with direct IO where the file system allows
//!   it (else through the OS page cache, said by [`KvPoolStats::direct`]), with the
//!   XXH3-128 of its bytes kept in memory and checked on every read (a checksum
//!   against a damaged disk or file, cheap enough to check every page read back
//!   every pass; the file is the process's own, 0600): a page that
//!   fails it is never used ([`super::page`]); the cache that held it marks its
//!   positions from that page on as lost, and the engine recomputes them from their
//!   token ids before its next pass.
//! - **Read ahead.** A cache whose layer is viewed for attention asks the pool to
//!   read the next layers' spilled pages ([`KvPool`]'s IO threads) while this one
//!   computes, within a window of a quarter of the budget; a copy read ahead is used
//!   once and dropped, or re-admitted as resident where the budget has room.
//! - **Failure.** A write that fails (a full disk) turns spilling off with a
//!   warning: pages stay in memory beyond the budget, and nothing fails.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, Weak};

use twox_hash::XxHash3_128;
use vpaged::direct::{AlignedBuf, DIRECT_ALIGN};

use super::page::{Floats, KvPage, Staged, State};

/// Threads reading spilled pages ahead of attention.
const IO_THREADS: usize = 8;

/// What a pool did and holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvPoolStats {
    /// The budget in bytes (`u64::MAX`: none).
    pub budget: u64,
    /// Bytes of resident closed pages, and of copies read ahead not yet used.
    pub resident_bytes: u64,
    pub staged_bytes: u64,
    /// Bytes of pages in the spill file now.
    pub spilled_bytes: u64,
    /// Bytes written to and read from the spill file so far.
    pub written_bytes: u64,
    pub read_bytes: u64,
    /// Pages read ahead by the IO threads, and pages a view had to read itself
    /// (not read ahead: a stall) or wait for (read ahead but not landed yet).
    pub read_ahead: u64,
    pub stalls: u64,
    pub waits: u64,
    /// Pages whose copy on disk failed its checksum, and positions recomputed
    /// because of them.
    pub corrupt: u64,
    pub recomputed_positions: u64,
    /// Whether the spill file bypasses the OS page cache.
    pub direct: bool,
    /// Why spilling is off, when it is.
    pub off: Option<String>,
    /// The spill file, once made.
    pub path: Option<PathBuf>,
}

struct SpillFile {
    file: File,
    path: PathBuf,
    direct: bool,
}

struct Inner {
    budget: usize,
    resident: usize,
    staged: usize,
    spilled: usize,
    /// Resident pages, oldest first (entries of dropped pages are skipped).
    queue: VecDeque<Weak<KvPage>>,
    /// Resident pages alive (to compact `queue`).
    live: usize,
    file: Option<Arc<SpillFile>>,
    off: Option<String>,
    /// Free slots by size, and the file's end.
    free: HashMap<usize, Vec<u64>>,
    end: u64,
}

impl Inner {
    /// Bytes resident pages may take: the budget less the read-ahead window.
    fn resident_room(&self) -> usize {
        self.budget - PoolShared::window(self.budget)
    }
}

pub struct PoolShared {
    /// This pool (for the buffers it lends to find their way back).
    me: Weak<PoolShared>,
    /// Read buffers returned by the copies that used them, by size.
    spares: Mutex<HashMap<usize, Vec<AlignedBuf>>>,
    /// The budget, readable without the pool's lock (to size the spares).
    budget_now: std::sync::atomic::AtomicUsize,
    dir: PathBuf,
    /// A file given to spill to instead of one made in `dir` (kept when the pool
    /// goes).
    given: Option<PathBuf>,
    inner: Mutex<Inner>,
    io: Mutex<Option<mpsc::Sender<Arc<KvPage>>>>,
    written: AtomicU64,
    read: AtomicU64,
    read_ahead: AtomicU64,
    stalls: AtomicU64,
    waits: AtomicU64,
    corrupt: AtomicU64,
    recomputed: AtomicU64,
}

/// Slot bytes of a page of `floats`.
fn slot_bytes(floats: usize) -> usize {
    (floats * 4).max(1).next_multiple_of(DIRECT_ALIGN)
}

impl PoolShared {
    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The read-ahead window: a quarter of the budget.
    fn window(budget: usize) -> usize {
        budget / 4
    }

    /// Whether any page of the pool is on disk now.
    pub(super) fn has_spilled(&self) -> bool {
        self.inner().spilled > 0
    }

    /// Counts a new resident page and spills what no longer fits.
    pub(super) fn admit(self: &Arc<Self>, page: &Arc<KvPage>) {
        {
            let mut inner = self.inner();
            inner.resident += page.bytes();
            inner.live += 1;
            inner.queue.push_back(Arc::downgrade(page));
            if inner.queue.len() > 2 * inner.live + 64 {
                inner.queue.retain(|w| w.strong_count() > 0);
            }
        }
        self.enforce();
    }

    /// Spills the oldest resident pages until resident pages and copies read ahead
    /// fit the budget (or spilling is off).
    pub(super) fn enforce(self: &Arc<Self>) {
        loop {
            let cand = {
                let mut inner = self.inner();
                if inner.off.is_some() || inner.resident <= inner.resident_room() {
                    return;
                }
                match inner.queue.pop_front() {
                    Some(w) => w,
                    None => return,
                }
            };
            let Some(page) = cand.upgrade() else { continue };
            let mut st = page.lock();
            let State::Resident(data) = &*st else {
                continue;
            };
            let data = Arc::clone(data);
            match self.write(&data) {
                Ok((slot, hash)) => {
                    *st = State::Spilled {
                        slot,
                        hash,
                        staged: Staged::Empty,
                    };
                    drop(st);
                    let mut inner = self.inner();
                    inner.resident -= page.bytes();
                    inner.live -= 1;
                    inner.spilled += page.bytes();
                }
                Err(why) => {
                    drop(st);
                    let mut inner = self.inner();
                    // It stays resident, first in line should spilling resume.
                    inner.queue.push_front(cand);
                    if inner.off.is_none() {
                        tracing::warn!(
                            "KV pages stay in memory beyond the budget: spilling is off: {why}"
                        );
                        inner.off = Some(why);
                    }
                    return;
                }
            }
        }
    }

    /// Writes `data` to a free slot: the slot's offset and the bytes' XXH3-128.
    fn write(&self, data: &[f32]) -> Result<(u64, u128), String> {
        let file = self.file()?;
        let size = slot_bytes(data.len());
        let slot = {
            let mut inner = self.inner();
            match inner.free.get_mut(&size).and_then(|v| v.pop()) {
                Some(s) => s,
                None => {
                    let s = inner.end;
                    inner.end += size as u64;
                    s
                }
            }
        };
        let mut buf = AlignedBuf::new(size);
        let bytes = &mut buf.as_mut_slice()[..data.len() * 4];
        for (o, x) in bytes.chunks_exact_mut(4).zip(data) {
            o.copy_from_slice(&x.to_le_bytes());
        }
        let hash = XxHash3_128::oneshot(bytes);
        match file.file.write_all_at(&buf.as_slice()[..size], slot) {
            Ok(()) => {
                self.written.fetch_add(size as u64, Ordering::Relaxed);
                Ok((slot, hash))
            }
            Err(e) => {
                self.inner().free.entry(size).or_default().push(slot);
                Err(format!(
                    "writing {size} bytes at {slot} of {}: {e}",
                    file.path.display()
                ))
            }
        }
    }

    /// The spill file, made on first use.
    fn file(&self) -> Result<Arc<SpillFile>, String> {
        let mut inner = self.inner();
        if let Some(f) = &inner.file {
            return Ok(Arc::clone(f));
        }
        if let Some(why) = &inner.off {
            return Err(why.clone());
        }
        let made = match &self.given {
            Some(path) => open_given(path),
            None => make_file(&self.dir),
        }
        .map(Arc::new);
        match made {
            Ok(f) => {
                inner.file = Some(Arc::clone(&f));
                Ok(f)
            }
            Err(e) => Err(e),
        }
    }

    /// Reads the page of `floats` at `slot` and checks it against `hash`.
    pub(super) fn read(&self, slot: u64, floats: usize, hash: &u128) -> Result<Floats, String> {
        let file = self.inner().file.clone().ok_or("the spill file is gone")?;
        let size = slot_bytes(floats);
        let mut buf = self.buffer(size);
        file.file
            .read_exact_at(&mut buf.as_mut_slice()[..size], slot)
            .map_err(|e| {
                format!(
                    "reading {size} bytes at {slot} of {}: {e}",
                    file.path.display()
                )
            })?;
        self.read.fetch_add(size as u64, Ordering::Relaxed);
        let home = self.me.clone();
        if XxHash3_128::oneshot(&buf.as_slice()[..floats * 4]) != *hash {
            self.spare(buf);
            return Err(format!(
                "the KV page at {slot} of {} fails its checksum (XXH3-128)",
                file.path.display()
            ));
        }
        if cfg!(target_endian = "big") {
            return Err("spilled KV pages are little-endian".into());
        }
        Ok(Floats::Aligned {
            buf: Some(buf),
            floats,
            home,
        })
    }

    /// Drops the page's copy read ahead, if it has one (its cache is done with it).
    pub(super) fn unstage(&self, page: &KvPage) {
        let mut st = page.lock();
        if let State::Spilled { staged, .. } = &mut *st {
            if let Staged::Ready(_) = staged {
                *staged = Staged::Empty;
                self.inner().staged -= page.bytes();
            }
        }
    }

    /// Puts a read's outcome in the page (whose lock `st` is): a copy ready to use,
    /// or the page marked corrupt (its slot freed).
    pub(super) fn land(&self, page: &KvPage, st: &mut State, read: Result<Floats, String>) {
        let State::Spilled { slot, staged, .. } = st else {
            return;
        };
        let slot = *slot;
        match read {
            Ok(f) => {
                *staged = Staged::Ready(Arc::new(f));
            }
            Err(why) => {
                tracing::warn!("{why}: the positions it holds will be recomputed");
                self.corrupt.fetch_add(1, Ordering::Relaxed);
                *st = State::Corrupt(why);
                let mut inner = self.inner();
                inner.staged -= page.bytes();
                inner.spilled -= page.bytes();
                inner
                    .free
                    .entry(slot_bytes(page.floats()))
                    .or_default()
                    .push(slot);
            }
        }
        page.landed.notify_all();
    }

    /// The page's copy read ahead was taken by a view: it is used once, then kept as
    /// the resident page where the budget has room (its slot freed), else dropped.
    pub(super) fn used(&self, page: &Arc<KvPage>, st: &mut State) {
        let State::Spilled { slot, staged, .. } = st else {
            return;
        };
        let Staged::Ready(data) = std::mem::replace(staged, Staged::Empty) else {
            return;
        };
        let slot = *slot;
        let bytes = page.bytes();
        let mut inner = self.inner();
        inner.staged -= bytes;
        if inner.off.is_none() && inner.resident + bytes <= inner.resident_room() {
            *st = State::Resident(data);
            inner.resident += bytes;
            inner.live += 1;
            inner.spilled -= bytes;
            inner.queue.push_back(Arc::downgrade(page));
            inner
                .free
                .entry(slot_bytes(page.floats()))
                .or_default()
                .push(slot);
        }
    }

    /// Starts reading `page` ahead if it is spilled and the window has room; `false`
    /// when the window is full (nothing further should be asked).
    pub(super) fn prefetch(self: &Arc<Self>, page: &Arc<KvPage>) -> bool {
        let mut st = page.lock();
        let State::Spilled {
            staged: staged @ Staged::Empty,
            ..
        } = &mut *st
        else {
            return true;
        };
        {
            let mut inner = self.inner();
            if inner.staged + page.bytes() > Self::window(inner.budget) {
                return false;
            }
            inner.staged += page.bytes();
        }
        *staged = Staged::Reading;
        drop(st);
        let tx = self.io_sender();
        if tx.send(Arc::clone(page)).is_err() {
            // No reader: leave it for the view to read.
            let mut st = page.lock();
            if let State::Spilled { staged, .. } = &mut *st {
                *staged = Staged::Empty;
            }
            self.inner().staged -= page.bytes();
            page.landed.notify_all();
        }
        true
    }

    /// The IO threads' queue, started on first use.
    fn io_sender(self: &Arc<Self>) -> mpsc::Sender<Arc<KvPage>> {
        let mut io = self.io.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = &*io {
            return tx.clone();
        }
        let (tx, rx) = mpsc::channel::<Arc<KvPage>>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..IO_THREADS {
            let rx = Arc::clone(&rx);
            let spawned = std::thread::Builder::new()
                .name(format!("voom-kv-io-{i}"))
                .spawn(move || loop {
                    let job = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                    let Ok(page) = job else { return };
                    read_ahead(&page);
                });
            if let Err(e) = spawned {
                tracing::warn!("KV read-ahead thread: {e}: spilled pages are read on demand");
            }
        }
        *io = Some(tx.clone());
        tx
    }

    /// A buffer of `size` bytes to read a page into: a spare one, or a new one.
    fn buffer(&self, size: usize) -> AlignedBuf {
        let spare = self
            .spares
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(&size)
            .and_then(Vec::pop);
        spare.unwrap_or_else(|| AlignedBuf::new(size))
    }

    /// Keeps `buf` for a later read, up to the read-ahead window's worth (and a
    /// layer's held pages) of spares.
    pub(super) fn spare(&self, buf: AlignedBuf) {
        let keep = Self::window(self.budget_now.load(Ordering::Relaxed)).max(64 << 20);
        let mut spares = self.spares.lock().unwrap_or_else(|e| e.into_inner());
        let held: usize = spares.values().flatten().map(|b| b.capacity()).sum();
        if held + buf.capacity() <= keep {
            spares.entry(buf.capacity()).or_default().push(buf);
        }
    }

    /// A view reads a page of `bytes` itself (not read ahead): counted as a copy
    /// staged until it is used.
    pub(super) fn note_stall(&self, bytes: usize) {
        self.stalls.fetch_add(1, Ordering::Relaxed);
        self.inner().staged += bytes;
    }

    pub(super) fn note_wait(&self) {
        self.waits.fetch_add(1, Ordering::Relaxed);
    }

    /// A page of `floats` in state `st` is gone: its bytes and slot are freed.
    pub(super) fn forget(&self, floats: usize, st: State) {
        let bytes = floats * 4;
        let mut inner = self.inner();
        match &st {
            State::Resident(_) => {
                inner.resident -= bytes;
                inner.live -= 1;
            }
            State::Spilled { slot, staged, .. } => {
                if !matches!(staged, Staged::Empty) {
                    inner.staged -= bytes;
                }
                inner.spilled -= bytes;
                inner
                    .free
                    .entry(slot_bytes(floats))
                    .or_default()
                    .push(*slot);
            }
            State::Corrupt(_) | State::Dropped => {}
        }
        // Its floats go after the lock: a copy read back returns its buffer to
        // the spares.
        drop(inner);
        drop(st);
    }
}

/// An IO thread's job: reads the page (if it still waits for it) and lands it.
fn read_ahead(page: &Arc<KvPage>) {
    let Some(pool) = page.pool.clone() else {
        return;
    };
    let (slot, hash) = match &*page.lock() {
        State::Spilled {
            slot,
            hash,
            staged: Staged::Reading,
        } => (*slot, *hash),
        _ => return,
    };
    let read = pool.read(slot, page.floats(), &hash);
    pool.read_ahead.fetch_add(1, Ordering::Relaxed);
    let mut st = page.lock();
    pool.land(page, &mut st, read);
}

impl Drop for PoolShared {
    fn drop(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(|e| e.into_inner());
        if let (Some(f), None) = (&inner.file, &self.given) {
            let _ = std::fs::remove_file(&f.path);
        }
    }
}

/// Makes a spill file in `dir`, direct where the file system allows it, after
/// removing the files of processes that are gone.
fn make_file(dir: &Path) -> Result<SpillFile, String> {
    use std::sync::atomic::AtomicUsize;
    static N: AtomicUsize = AtomicUsize::new(0);
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    remove_orphans(dir);
    let pid = std::process::id();
    let path = dir.join(format!(
        "kv-{pid}-{}.spill",
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let file = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?
    };
    let direct = vpaged::direct::set_direct(&file).is_ok();
    if !direct {
        tracing::debug!(
            "{}: direct IO is not available here; spilled KV pages go through the OS page cache",
            path.display()
        );
    }
    Ok(SpillFile { file, path, direct })
}

/// Opens a file given to spill to (kept as it is when the pool goes).
fn open_given(path: &Path) -> Result<SpillFile, String> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let direct = vpaged::direct::set_direct(&file).is_ok();
    Ok(SpillFile {
        file,
        path: path.to_path_buf(),
        direct,
    })
}

/// Removes `kv-<pid>-<n>.spill` files of processes that no longer run.
fn remove_orphans(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(pid) = name
            .strip_prefix("kv-")
            .and_then(|r| r.strip_suffix(".spill"))
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        // SAFETY: kill with signal 0 only checks whether the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The byte budget of the closed KV pages of the caches made with it, and their
/// spill file (see the module). Cheap to clone (one shared pool).
#[derive(Clone)]
pub struct KvPool {
    pub(super) shared: Arc<PoolShared>,
}

/// A handle on a pool that does not keep it alive (the memory governor's).
#[derive(Clone)]
pub struct WeakKvPool(Weak<PoolShared>);

impl WeakKvPool {
    pub fn upgrade(&self) -> Option<KvPool> {
        self.0.upgrade().map(|shared| KvPool { shared })
    }
}

impl KvPool {
    /// A pool of `budget` bytes spilling to a file in `dir` (made when first
    /// needed).
    pub fn new(budget: usize, dir: &Path) -> Self {
        Self::make(budget, dir.to_path_buf(), None)
    }

    /// A pool of `budget` bytes spilling to the existing file `path`, from its
    /// start (kept when the pool goes): a device or a file prepared elsewhere.
    pub fn with_file(budget: usize, path: &Path) -> Self {
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        Self::make(budget, dir, Some(path.to_path_buf()))
    }

    fn make(budget: usize, dir: PathBuf, given: Option<PathBuf>) -> Self {
        KvPool {
            shared: Arc::new_cyclic(|me| PoolShared {
                me: me.clone(),
                spares: Mutex::new(HashMap::new()),
                budget_now: std::sync::atomic::AtomicUsize::new(budget),
                dir,
                given,
                inner: Mutex::new(Inner {
                    budget,
                    resident: 0,
                    staged: 0,
                    spilled: 0,
                    queue: VecDeque::new(),
                    live: 0,
                    file: None,
                    off: None,
                    free: HashMap::new(),
                    end: 0,
                }),
                io: Mutex::new(None),
                written: AtomicU64::new(0),
                read: AtomicU64::new(0),
                read_ahead: AtomicU64::new(0),
                stalls: AtomicU64::new(0),
                waits: AtomicU64::new(0),
                corrupt: AtomicU64::new(0),
                recomputed: AtomicU64::new(0),
            }),
        }
    }

    pub fn budget(&self) -> usize {
        self.shared.inner().budget
    }

    pub fn downgrade(&self) -> WeakKvPool {
        WeakKvPool(Arc::downgrade(&self.shared))
    }

    /// Changes the budget: a smaller one spills pages now; a larger one lets pages
    /// read back stay.
    pub fn set_budget(&self, budget: usize) {
        self.shared.inner().budget = budget;
        self.shared.budget_now.store(budget, Ordering::Relaxed);
        self.shared.enforce();
    }

    /// Counts positions recomputed because their pages were lost.
    pub fn note_recomputed(&self, positions: usize) {
        self.shared
            .recomputed
            .fetch_add(positions as u64, Ordering::Relaxed);
    }

    pub fn stats(&self) -> KvPoolStats {
        let s = &self.shared;
        let inner = s.inner();
        KvPoolStats {
            budget: inner.budget as u64,
            resident_bytes: inner.resident as u64,
            staged_bytes: inner.staged as u64,
            spilled_bytes: inner.spilled as u64,
            written_bytes: s.written.load(Ordering::Relaxed),
            read_bytes: s.read.load(Ordering::Relaxed),
            read_ahead: s.read_ahead.load(Ordering::Relaxed),
            stalls: s.stalls.load(Ordering::Relaxed),
            waits: s.waits.load(Ordering::Relaxed),
            corrupt: s.corrupt.load(Ordering::Relaxed),
            recomputed_positions: s.recomputed.load(Ordering::Relaxed),
            direct: inner.file.as_ref().is_some_and(|f| f.direct),
            off: inner.off.clone(),
            path: inner.file.as_ref().map(|f| f.path.clone()),
        }
    }
}
