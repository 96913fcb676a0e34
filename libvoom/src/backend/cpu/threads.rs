//! A persistent thread pool for the CPU kernels.
//!
//! A decode step issues a few hundred small matmuls (0.1-2 MB of weights each, tens
//! of microseconds at memory bandwidth), so dispatch must cost far less than that.
//! Workers are long-lived and poll an epoch counter after each job (the next matmul
//! usually follows within microseconds): a few microseconds of pure spinning, then
//! polling with `yield_now` in between for [`DEFAULT_SPIN`], then they park on a
//! condvar. Measured here: an empty two-chunk job costs 0.2-0.7 µs (rayon's
//! `install` + `join`: 12-24 µs).
//! The calling thread always takes part in the work, so a pool of `n` threads spawns
//! `n - 1` workers.
//!
//! Work is split into chunks of `grain` items that threads claim dynamically from an
//! atomic counter: a worker that wakes late (or a vCPU that is preempted) simply
//! claims fewer chunks. Which thread computes which chunk is therefore not fixed,
//! so callers must make each item's result independent of the chunking: every
//! kernel in this backend computes each output element in one fixed order, which is
//! what makes results independent of the thread count (DESIGN.md invariant 6).
//!
//! Job hand-off protocol (no locks on the hot path):
//! - `job` holds a pointer to the running job's body, or null when none is open.
//! - The caller publishes `job`, bumps `epoch`, wakes parked workers, runs the body
//!   itself, then clears `job` and waits until `active` is 0.
//! - A worker that sees a new epoch increments `active`, then loads `job`; only if it
//!   is non-null does it run it; then it decrements `active`.
//!
//! Both sides use sequentially consistent operations (store then load of the other
//! variable), so either the caller sees the worker's increment and waits for it, or
//! the worker sees the cleared pointer and never touches the job. A worker that
//! wakes late therefore never delays the caller and never sees a dead job.

use std::cell::Cell;
use std::ops::Range;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Busy-wait iterations (a few microseconds) before an idle worker starts yielding.
const PAUSE_SPINS: u32 = 2000;

/// How long an idle worker keeps polling (yielding in between) for the next job
/// before it parks.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(200);

/// The body of a job as the workers see it: a borrowed closure whose lifetime the
/// protocol above guarantees (the caller does not return while a worker can run it).
type JobBody<'a> = &'a (dyn Fn() + Sync + 'a);

thread_local! {
    /// True while this thread runs a pool job: a nested `for_each_chunk` then runs
    /// inline instead of dead-locking on the pool.
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

struct Shared {
    /// Bumped once per job and once at shutdown; idle workers watch it.
    epoch: AtomicU64,
    /// Points at the open job's `JobBody` (on the caller's stack), or null.
    job: AtomicPtr<JobBody<'static>>,
    /// Workers currently between their increment and decrement (see module doc).
    active: AtomicUsize,
    /// Set when a worker's part of a job panicked; the caller re-raises it.
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Workers parked on `wake` (or about to be); the caller notifies only if > 0.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    spin: Duration,
}

/// An output buffer the threads of one pool job write through, each its own
/// disjoint elements, while the caller holds the exclusive borrow of the buffer
/// until the job returns (matmul rows, attention heads, row-wise ops' rows).
#[derive(Clone, Copy)]
pub(crate) struct SharedOut(pub(crate) *mut f32);
// SAFETY: users write disjoint elements from the pool's threads, within one job,
// under the caller's exclusive borrow (see the type's doc).
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The pointer (a method, so that closures capture the whole `SharedOut`).
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// A fixed set of worker threads plus the calling thread. See the module docs.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    threads: usize,
    /// Serialises jobs: a second caller that finds the pool busy runs inline.
    busy: Mutex<()>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("threads", &self.threads)
            .field("spin", &self.shared.spin)
            .finish()
    }
}

impl ThreadPool {
    /// A pool computing on `n_threads` threads in all (the caller plus
    /// `n_threads - 1` workers). `0` is treated as `1`. Fails only if the OS refuses
    /// to spawn a thread.
    pub fn new(n_threads: usize) -> std::io::Result<ThreadPool> {
        ThreadPool::with_spin(n_threads, DEFAULT_SPIN)
    }

    /// A pool of one thread: everything runs on the caller, nothing is spawned.
    pub fn single() -> ThreadPool {
        ThreadPool {
            shared: Arc::new(Shared::new(DEFAULT_SPIN)),
            workers: Vec::new(),
            threads: 1,
            busy: Mutex::new(()),
        }
    }

    /// Like [`ThreadPool::new`], with the time an idle worker spins before parking.
    pub fn with_spin(n_threads: usize, spin: Duration) -> std::io::Result<ThreadPool> {
        let threads = n_threads.max(1);
        let shared = Arc::new(Shared::new(spin));
        let mut pool = ThreadPool {
            shared: Arc::clone(&shared),
            workers: Vec::with_capacity(threads - 1),
            threads: 1,
            busy: Mutex::new(()),
        };
        for i in 1..threads {
            let s = Arc::clone(&shared);
            let handle = std::thread::Builder::new()
                .name(format!("voom-cpu-{i}"))
                .spawn(move || worker_loop(&s))?;
            // On an error above, dropping `pool` shuts down the workers spawned so far.
            pool.workers.push(handle);
            pool.threads += 1;
        }
        Ok(pool)
    }

    /// Number of threads that compute (workers plus the caller).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Calls `f` on disjoint ranges covering `0..n_items`, in parallel, with a chunk
    /// size chosen for load balance (about four chunks per thread). Returns when
    /// every call has returned. A panic in `f` is re-raised here.
    pub fn for_each_chunk<F>(&self, n_items: usize, f: F)
    where
        F: Fn(Range<usize>) + Sync,
    {
        let grain = n_items.div_ceil(self.threads * 4).max(1);
        self.for_each_chunk_grain(n_items, grain, f)
    }

    /// Calls `f` on the ranges `[i*grain, min((i+1)*grain, n_items))` for every `i`,
    /// each exactly once, on whichever threads claim them. Which thread runs a chunk
    /// is not deterministic; the chunk boundaries are. `grain` 0 is treated as 1.
    /// Runs inline on the caller when called from inside a job of any pool, when
    /// another thread is using this pool, or when there is a single chunk.
    pub fn for_each_chunk_grain<F>(&self, n_items: usize, grain: usize, f: F)
    where
        F: Fn(Range<usize>) + Sync,
    {
        let grain = grain.max(1);
        let n_chunks = n_items.div_ceil(grain);
        if n_chunks == 0 {
            return;
        }
        let next = AtomicUsize::new(0);
        let body = || loop {
            let c = next.fetch_add(1, Ordering::Relaxed);
            if c >= n_chunks {
                break;
            }
            let start = c * grain;
            f(start..(start + grain).min(n_items));
        };
        if n_chunks == 1 || self.workers.is_empty() || IN_JOB.with(Cell::get) {
            return body();
        }
        let _busy = match self.busy.try_lock() {
            Ok(g) => g,
            // A poisoned lock only means an earlier job panicked; the protocol state
            // is reset by every job, so the pool stays usable.
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return body(),
        };
        self.run_job(&body);
    }

    fn run_job(&self, body: &(dyn Fn() + Sync)) {
        let s = &*self.shared;
        let body_ref: JobBody<'_> = body;
        // SAFETY: only the lifetime is erased. Workers dereference this pointer only
        // while it is published in `s.job` and they are counted in `s.active`; this
        // function clears `s.job` and waits for `s.active == 0` before returning, so
        // no worker touches `body` (or `body_ref`) after this frame ends.
        let erased: JobBody<'static> =
            unsafe { std::mem::transmute::<JobBody<'_>, JobBody<'static>>(body_ref) };
        let slot: *const JobBody<'static> = &erased;
        s.panicked.store(false, Ordering::Relaxed);
        s.job.store(slot.cast_mut(), Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }
        let mine = run_marked(body);
        s.job.store(std::ptr::null_mut(), Ordering::SeqCst);
        let mut spins = 0u32;
        while s.active.load(Ordering::SeqCst) != 0 {
            spins = spins.saturating_add(1);
            if spins < PAUSE_SPINS {
                std::hint::spin_loop();
            } else {
                // A worker preempted mid-chunk may need this CPU to finish.
                std::thread::yield_now();
            }
        }
        if let Err(payload) = mine {
            panic::resume_unwind(payload);
        }
        if s.panicked.load(Ordering::Acquire) {
            panic!("a voom-cpu worker thread panicked while running a pool job");
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.shutdown.store(true, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        {
            let _g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            // A worker never panics outside a job (jobs are caught), so join errors
            // cannot carry anything worth re-raising from a destructor.
            let _ = w.join();
        }
    }
}

impl Shared {
    fn new(spin: Duration) -> Shared {
        Shared {
            epoch: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            active: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            spin,
        }
    }

    /// Waits until `epoch != seen`: spins briefly, then yields the CPU between checks
    /// until `self.spin` has passed, then parks.
    ///
    /// Yielding matters on a loaded machine: when the calling thread shares this
    /// worker's CPU, pure spinning takes its time slices from the caller, which then
    /// runs at half speed while the worker spins on an epoch that cannot change.
    fn wait_epoch(&self, seen: u64) -> u64 {
        for _ in 0..PAUSE_SPINS {
            let e = self.epoch.load(Ordering::Acquire);
            if e != seen {
                return e;
            }
            std::hint::spin_loop();
        }
        let start = Instant::now();
        while start.elapsed() < self.spin {
            let e = self.epoch.load(Ordering::Acquire);
            if e != seen {
                return e;
            }
            std::thread::yield_now();
        }
        let mut g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let e = loop {
            let e = self.epoch.load(Ordering::SeqCst);
            if e != seen {
                break e;
            }
            g = self.wake.wait(g).unwrap_or_else(|p| p.into_inner());
        };
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        e
    }
}

/// Runs `body` with the nested-call marker set, catching a panic.
fn run_marked(body: &(dyn Fn() + Sync)) -> std::thread::Result<()> {
    IN_JOB.with(|m| m.set(true));
    let r = panic::catch_unwind(AssertUnwindSafe(body));
    IN_JOB.with(|m| m.set(false));
    r
}

fn worker_loop(s: &Shared) {
    let mut seen = 0u64;
    loop {
        seen = s.wait_epoch(seen);
        if s.shutdown.load(Ordering::SeqCst) {
            return;
        }
        s.active.fetch_add(1, Ordering::SeqCst);
        let p = s.job.load(Ordering::SeqCst);
        if !p.is_null() {
            // SAFETY: `p` was published by `run_job`, which keeps the pointee (and the
            // closure it refers to) alive until it has cleared `job` and seen
            // `active == 0`; our increment above happened before our load of `job`,
            // so `run_job` waits for the decrement below.
            let body: JobBody<'static> = unsafe { *p };
            if run_marked(body).is_err() {
                s.panicked.store(true, Ordering::Release);
            }
        }
        s.active.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    /// Every item is visited exactly once, for many sizes, grains and pool sizes.
    #[test]
    fn chunks_cover_every_item_once() {
        for threads in [1, 2, 3, 5] {
            let pool = ThreadPool::new(threads).unwrap();
            assert_eq!(pool.threads(), threads);
            for n in [0usize, 1, 2, 7, 64, 1000, 4097] {
                for grain in [0usize, 1, 3, 64, 5000] {
                    let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                    pool.for_each_chunk_grain(n, grain, |r| {
                        let g = grain.max(1);
                        assert_eq!(r.start % g, 0, "chunk start on a grain boundary");
                        assert!(r.end <= n && r.end - r.start <= g && r.start < r.end);
                        for i in r {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        }
                    });
                    assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                }
            }
        }
    }

    /// Many back-to-back jobs (the decode pattern) with the workers both spinning
    /// and parked (zero spin) complete and run on more than one thread.
    #[test]
    fn many_jobs_spinning_and_parked() {
        for spin in [Duration::ZERO, DEFAULT_SPIN] {
            let pool = ThreadPool::with_spin(3, spin).unwrap();
            let total = AtomicUsize::new(0);
            for round in 0..2000 {
                pool.for_each_chunk_grain(64, 1, |r| {
                    total.fetch_add(r.len(), Ordering::Relaxed);
                });
                if round % 500 == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            assert_eq!(total.load(Ordering::Relaxed), 2000 * 64);
            // The workers really do take part: with chunks that take a while, more
            // than one thread id shows up.
            let ids = Mutex::new(std::collections::HashSet::new());
            pool.for_each_chunk_grain(12, 1, |_| {
                ids.lock().unwrap().insert(std::thread::current().id());
                std::thread::sleep(Duration::from_millis(5));
            });
            assert!(ids.lock().unwrap().len() > 1);
        }
    }

    /// A nested call runs inline instead of dead-locking.
    #[test]
    fn nested_calls_run_inline() {
        let pool = ThreadPool::new(2).unwrap();
        let total = AtomicUsize::new(0);
        pool.for_each_chunk_grain(8, 1, |_| {
            pool.for_each_chunk_grain(10, 3, |r| {
                total.fetch_add(r.len(), Ordering::Relaxed);
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 80);
    }

    /// Two external threads sharing one pool both get complete results.
    #[test]
    fn concurrent_callers() {
        let pool = ThreadPool::new(2).unwrap();
        std::thread::scope(|sc| {
            for _ in 0..2 {
                sc.spawn(|| {
                    for _ in 0..300 {
                        let total = AtomicUsize::new(0);
                        pool.for_each_chunk(1000, |r| {
                            total.fetch_add(r.len(), Ordering::Relaxed);
                        });
                        assert_eq!(total.load(Ordering::Relaxed), 1000);
                    }
                });
            }
        });
    }

    /// A panic in a chunk reaches the caller, and the pool still works afterwards.
    #[test]
    fn panics_propagate_and_pool_survives() {
        let pool = ThreadPool::new(3).unwrap();
        for bad in [0usize, 5, 11] {
            let r = panic::catch_unwind(AssertUnwindSafe(|| {
                pool.for_each_chunk_grain(12, 1, |r| {
                    std::thread::sleep(Duration::from_micros(200));
                    if r.start == bad {
                        panic!("chunk {bad} failed");
                    }
                });
            }));
            assert!(r.is_err());
        }
        let total = AtomicUsize::new(0);
        pool.for_each_chunk(100, |r| {
            total.fetch_add(r.len(), Ordering::Relaxed);
        });
        assert_eq!(total.load(Ordering::Relaxed), 100);
    }

    #[test]
    fn single_and_zero_thread_pools_run_inline() {
        for pool in [ThreadPool::single(), ThreadPool::new(0).unwrap()] {
            assert_eq!(pool.threads(), 1);
            let me = std::thread::current().id();
            let total = AtomicUsize::new(0);
            pool.for_each_chunk(50, |r| {
                assert_eq!(std::thread::current().id(), me);
                total.fetch_add(r.len(), Ordering::Relaxed);
            });
            assert_eq!(total.load(Ordering::Relaxed), 50);
        }
    }
}
