//! Model checks (loom) of the page cache's lease / in-flight / eviction protocol.
//!
//! loom runs each model closure under every interleaving of the cache's state lock and
//! in-flight cells (swapped for loom's by `vpaged::sync` under `--cfg vpaged_loom`), up
//! to a preemption bound for the three-thread models, and reports deadlocks (a waiter
//! never woken) as failures. Each model checks, in every interleaving:
//! - one load per residency (loads are counted by the load closures themselves);
//! - a lease's bytes are the page's and stay unchanged while it is held, whatever
//!   loads and evictions run meanwhile (page bytes are a per-page pattern);
//! - `CacheError::Full` only when nothing is free or evictable;
//! - afterwards nothing is leased, loading or leaked: every resident page is evictable
//!   and the cache's slots all come back.
//!
//! The arena is a real (small) memfd arena: loom does not model its bytes, but the
//! protocol decides who may write a slot, and the pattern checks catch a slot handed
//! to two pages.
//!
//! Run (not part of the normal build; the separate target dir keeps the flag from
//! invalidating the normal build). The test profile (no `--release`) keeps the cache's
//! `debug_assert!`s and overflow checks on, which catch bookkeeping slips early:
//! `RUSTFLAGS="--cfg vpaged_loom" CARGO_TARGET_DIR=target/loom cargo test -p vpaged --test loom_cache`
//! `LOOM_MAX_PREEMPTIONS=N` overrides each model's preemption bound.

// `vpaged_loom` is not a cfg rustc knows until the workspace declares it (`check-cfg`).
#![allow(unexpected_cfgs)]
#![cfg(vpaged_loom)]

use std::panic::{self, AssertUnwindSafe};

use loom::model::Builder;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

use vpaged::arena::{Arena, SLOT_ALIGN};
use vpaged::cache::{CacheError, Lease, PageCache, PageKey, Prefetched};

/// Page bytes: every page fits one 16 KiB slot; a short page keeps pattern checks cheap.
const LEN: usize = 512;

#[derive(Debug, thiserror::Error)]
#[error("disk read of page {0} failed")]
struct ReadError(u32);

#[derive(Debug, thiserror::Error)]
#[error("another loader's error type")]
struct OtherError;

/// The payload of the panics injected into loads (kept out of the test output).
const INJECTED_PANIC: &str = "loom_cache: injected load panic";

fn cache(slots: usize) -> PageCache {
    PageCache::new(Arena::new(slots * SLOT_ALIGN).expect("a small memfd arena"))
}

fn key(page: u32) -> PageKey {
    PageKey { model: 7, page }
}

fn pattern(k: PageKey, i: usize) -> u8 {
    (k.page as usize * 151 + i * 13 + 1) as u8
}

fn verify(k: PageKey, b: &[u8]) -> bool {
    b.len() == LEN && b.iter().enumerate().all(|(i, &x)| x == pattern(k, i))
}

/// A load of `k` that writes its pattern and counts itself in `runs`. It first smears
/// the slot with another value, so a reader sharing the slot by mistake sees garbage.
fn load_counted<E>(k: PageKey, runs: &Arc<AtomicUsize>) -> impl FnOnce(&mut [u8]) -> Result<(), E> {
    let runs = runs.clone();
    move |b| {
        runs.fetch_add(1, Ordering::SeqCst);
        b.fill(0xEE);
        for (i, x) in b.iter_mut().enumerate() {
            *x = pattern(k, i);
        }
        Ok(())
    }
}

/// Runs `f` under loom and returns how many interleavings it explored: every one when
/// `preemptions` is `None`, else those with at most that many preemptions (loom's
/// bound; `LOOM_MAX_PREEMPTIONS` overrides it). Three-thread models need the bound to
/// finish in seconds; bugs seldom need more than two or three preemptions to show.
/// Fewer than `at_least` interleavings (about half what the model has) means the cache's
/// locks are not loom's (the `vpaged::sync` swap is broken: then the models explore a
/// few dozen at most, or hang) or the model lost its concurrency: the check would prove
/// nothing, so it fails.
fn check(
    name: &str,
    preemptions: Option<usize>,
    at_least: usize,
    f: impl Fn() + Sync + Send + 'static,
) {
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = runs.clone();
    let mut builder = Builder::new();
    // A bound from the environment changes how many interleavings there are.
    let ours = builder.preemption_bound.is_none();
    if ours {
        builder.preemption_bound = preemptions;
    }
    let started = std::time::Instant::now();
    builder.check(move || {
        counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        f()
    });
    let n = runs.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!("{name}: {n} interleavings in {:.2?}", started.elapsed());
    assert!(
        n >= at_least || !ours,
        "{name}: only {n} interleavings explored"
    );
}

/// Holds `lease` across a scheduling point, checking its bytes before and after: any
/// load or eviction the other thread completes meanwhile must leave them unchanged.
fn hold(k: PageKey, lease: &Lease) {
    assert!(verify(k, lease.bytes()), "{k}: wrong bytes when leased");
    thread::yield_now();
    assert!(verify(k, lease.bytes()), "{k}: bytes changed under a lease");
}

/// A `Full` refusal is legitimate only when no slot is free and none is evictable:
/// every slot is leased, pinned (none here) or loading.
fn assert_full_is_legit<E: std::error::Error + Send + Sync + 'static>(e: &CacheError<E>) {
    match e {
        CacheError::Full {
            capacity,
            leased,
            pinned,
            loading,
            free,
            ..
        } => {
            assert_eq!(*free, 0, "Full with free slots: {e}");
            assert_eq!(
                leased + pinned + loading,
                *capacity,
                "Full with evictable slots: {e}"
            );
        }
        other => panic!("expected Ok or Full, got {other}"),
    }
}

/// After every lease is dropped: nothing leased or loading, every allocated slot holds a
/// resident page, and every resident page is evictable (`slots` fresh pages can be
/// leased at once, displacing them all).
fn assert_quiescent_and_evictable(c: &PageCache, slots: usize) {
    let s = c.stats();
    assert_eq!(s.leased_bytes, 0, "a lease leaked: {s:?}");
    assert_eq!(s.loading_pages, 0, "a load never finished: {s:?}");
    assert_eq!(
        s.used,
        s.resident_pages * SLOT_ALIGN,
        "a slot leaked: {s:?}"
    );
    let fresh: Vec<PageKey> = (0..slots as u32).map(|i| key(1000 + i)).collect();
    let runs = Arc::new(AtomicUsize::new(0));
    let leases: Vec<Lease> = fresh
        .iter()
        .map(|&k| {
            c.acquire(k, LEN, load_counted::<ReadError>(k, &runs))
                .unwrap_or_else(|e| panic!("a resident page is not evictable: {e}"))
        })
        .collect();
    for (k, l) in fresh.iter().zip(&leases) {
        assert!(verify(*k, l.bytes()));
    }
    assert_eq!(runs.load(Ordering::SeqCst), slots);
    assert_eq!(c.stats().used, slots * SLOT_ALIGN);
}

/// Check 1: three requests for one missing page share one load (one loader, two
/// waiters woken by one completion); every lease is of the same slot with the page's
/// bytes; released, the page is evictable.
#[test]
fn concurrent_requests_for_a_missing_page_share_one_load() {
    check(
        "concurrent_requests_for_a_missing_page_share_one_load",
        Some(3),
        1000,
        || {
            let c = cache(2);
            let k = key(1);
            let runs = Arc::new(AtomicUsize::new(0));
            let request = {
                let (c, runs) = (c.clone(), runs.clone());
                move || {
                    let lease = c
                        .acquire(k, LEN, load_counted::<ReadError>(k, &runs))
                        .expect("room for one page");
                    hold(k, &lease);
                    lease.offset()
                }
            };
            let others = [
                thread::spawn(request.clone()),
                thread::spawn(request.clone()),
            ];
            let here = request();
            for t in others {
                assert_eq!(t.join().unwrap(), here, "every lease is of the same slot");
            }

            assert_eq!(runs.load(Ordering::SeqCst), 1, "one load for every request");
            let s = c.stats();
            assert_eq!((s.loads, s.misses), (1, 1));
            assert_eq!(s.hits + s.inflight_dedups, 2, "{s:?}");
            assert_quiescent_and_evictable(&c, 2);
            assert!(
                !c.resident(k),
                "the released page was evicted for fresh ones"
            );
        },
    );
}

/// What a request of check 2 ended with.
#[derive(Debug, PartialEq)]
enum Got {
    /// Leased, with the page's bytes throughout.
    Page,
    /// Failed with the failing load's error (typed `Load` or, across error types,
    /// `PeerLoad`).
    LoadError,
}

/// Check 2: a load fails while other requests for the page wait on it or race it: one
/// with the loader's error type, one with another. A waiter gets the loader's error
/// (typed when the types match, `PeerLoad` otherwise); a request arriving after the
/// failure loads afresh; a successful load serves everyone after it; the failure
/// leaves nothing loading or allocated.
#[test]
fn a_failed_load_fails_its_waiters_and_leaks_nothing() {
    check(
        "a_failed_load_fails_its_waiters_and_leaks_nothing",
        Some(3),
        1000,
        || {
            let c = cache(2);
            let k = key(2);
            let failing_runs = Arc::new(AtomicUsize::new(0));
            let good_runs = Arc::new(AtomicUsize::new(0));
            let other_runs = Arc::new(AtomicUsize::new(0));

            let failing = {
                let (c, runs) = (c.clone(), failing_runs.clone());
                thread::spawn(move || {
                    let load = |b: &mut [u8]| {
                        runs.fetch_add(1, Ordering::SeqCst);
                        b.fill(0xEE); // a partial write that must never be served
                        Err(ReadError(2))
                    };
                    match c.acquire(k, LEN, load) {
                        Ok(lease) => {
                            hold(k, &lease);
                            Got::Page
                        }
                        Err(CacheError::Load { key: ek, source }) => {
                            assert_eq!((ek, source.0), (k, 2));
                            Got::LoadError
                        }
                        Err(e) => panic!("unexpected {e}"),
                    }
                })
            };
            let other_type = {
                let (c, runs) = (c.clone(), other_runs.clone());
                thread::spawn(move || {
                    match c.acquire(k, LEN, load_counted::<OtherError>(k, &runs)) {
                        Ok(lease) => {
                            hold(k, &lease);
                            Got::Page
                        }
                        Err(CacheError::PeerLoad { key: ek, source }) => {
                            assert_eq!(ek, k);
                            assert_eq!(source.to_string(), ReadError(2).to_string());
                            Got::LoadError
                        }
                        Err(e) => panic!("unexpected {e}"),
                    }
                })
            };
            let good = match c.acquire(k, LEN, load_counted::<ReadError>(k, &good_runs)) {
                Ok(lease) => {
                    hold(k, &lease);
                    Got::Page
                }
                Err(CacheError::Load { key: ek, source }) => {
                    assert_eq!((ek, source.0), (k, 2), "the waiter gets the loader's error");
                    Got::LoadError
                }
                Err(e) => panic!("unexpected {e}"),
            };
            let failing = failing.join().unwrap();
            let other = other_type.join().unwrap();

            let fr = failing_runs.load(Ordering::SeqCst);
            let gr = good_runs.load(Ordering::SeqCst);
            let or = other_runs.load(Ordering::SeqCst);
            // One successful load at most: once resident, the page stays (nothing evicts).
            assert!(fr <= 1 && gr + or <= 1, "runs {fr} {gr} {or}");
            // The failing request gets a page only from another's load; the others fail
            // only by waiting on the failing load, never after running their own.
            assert_eq!(
                failing == Got::Page,
                fr == 0,
                "{failing:?} runs {fr} {gr} {or}"
            );
            if fr == 0 {
                assert_eq!(gr + or, 1, "someone loaded the page");
            }
            for (got, ran) in [(&good, gr), (&other, or)] {
                if *got == Got::LoadError {
                    assert_eq!((fr, ran), (1, 0), "{got:?} runs {fr} {gr} {or}");
                }
            }
            let s = c.stats();
            let loaded = gr + or;
            assert_eq!(
                (s.load_failures, s.loads),
                (fr as u64, loaded as u64),
                "{s:?}"
            );
            assert_eq!(c.resident(k), loaded == 1);
            assert_eq!(
                s.used,
                loaded * SLOT_ALIGN,
                "the failed load freed its slot"
            );
            assert_quiescent_and_evictable(&c, 2);
        },
    );
}

/// Check 2b: a load panics while a request with another error type waits: the waiter
/// gets `LoadPanicked` (or loads afresh if it came after), the panicking load's slot is
/// freed and nobody waits forever.
#[test]
fn a_panicking_load_fails_its_waiters_and_leaks_nothing() {
    // Silence the injected panics; the previous hook (loom's generator filters its own
    // unwinding panics there) handles everything else and stays chained afterwards.
    let previous_hook = panic::take_hook();
    panic::set_hook(Box::new(move |info| {
        if info.payload().downcast_ref::<&str>() != Some(&INJECTED_PANIC) {
            previous_hook(info);
        }
    }));
    check(
        "a_panicking_load_fails_its_waiters_and_leaks_nothing",
        None,
        40,
        || {
            let c = cache(1);
            let k = key(3);
            let panicking_runs = Arc::new(AtomicUsize::new(0));
            let good_runs = Arc::new(AtomicUsize::new(0));

            let panicking = {
                let (c, runs) = (c.clone(), panicking_runs.clone());
                thread::spawn(move || {
                    let r = panic::catch_unwind(AssertUnwindSafe(|| {
                        c.acquire(k, LEN, |_: &mut [u8]| -> Result<(), ReadError> {
                            runs.fetch_add(1, Ordering::SeqCst);
                            panic::panic_any(INJECTED_PANIC)
                        })
                        .map(|lease| hold(k, &lease))
                    }));
                    match r {
                        Err(_) => None,
                        Ok(Ok(())) => Some(true),
                        Ok(Err(e)) => panic!("unexpected {e}"),
                    }
                })
            };
            let good_ok = match c.acquire(k, LEN, load_counted::<OtherError>(k, &good_runs)) {
                Ok(lease) => {
                    hold(k, &lease);
                    true
                }
                Err(CacheError::LoadPanicked { key: ek }) => {
                    assert_eq!(ek, k);
                    false
                }
                Err(e) => panic!("unexpected {e}"),
            };
            let panicked = panicking.join().unwrap().is_none();

            let (pr, gr) = (
                panicking_runs.load(Ordering::SeqCst),
                good_runs.load(Ordering::SeqCst),
            );
            assert_eq!(panicked, pr == 1);
            assert!(pr <= 1 && gr <= 1 && pr + gr >= 1, "runs {pr} {gr}");
            assert_eq!(good_ok, gr == 1, "the good request fails only by waiting");
            let s = c.stats();
            assert_eq!((s.load_failures, s.loads), (pr as u64, gr as u64), "{s:?}");
            assert_eq!(s.used, gr * SLOT_ALIGN, "the panicked load freed its slot");
            assert_quiescent_and_evictable(&c, 1);
        },
    );
}

/// Check 3: eviction against a lease. A cache of 2 slots holds X and Y (unleased).
/// Thread A leases X (a hit, or a reload if B evicted it first), leases it again, drops
/// the first lease and holds the second; thread B
/// leases Z, then W while still holding Z, forcing evictions. A leased page is never
/// evicted or overwritten, B gets its pages or a legitimate `Full`, and loads are
/// exactly the misses.
#[test]
fn a_leased_page_survives_eviction_pressure() {
    check(
        "a_leased_page_survives_eviction_pressure",
        None,
        1000,
        || {
            let c = cache(2);
            let (x, y, z, w) = (key(10), key(11), key(12), key(13));
            let runs = Arc::new(AtomicUsize::new(0));
            for k in [x, y] {
                drop(
                    c.acquire(k, LEN, load_counted::<ReadError>(k, &runs))
                        .unwrap(),
                );
            }

            let a = {
                let (c, runs) = (c.clone(), runs.clone());
                thread::spawn(move || match c.acquire(x, LEN, load_counted(x, &runs)) {
                    Ok(first) => {
                        // A second lease (two references); dropping the first must leave X
                        // unevictable under the second.
                        let second = c
                            .acquire(x, LEN, |_: &mut [u8]| -> Result<(), ReadError> {
                                panic!("X is leased: a second request must hit")
                            })
                            .expect("a hit");
                        assert_eq!(second.offset(), first.offset());
                        drop(first);
                        hold(x, &second);
                    }
                    Err(e) => assert_full_is_legit::<ReadError>(&e),
                })
            };
            match c.acquire(z, LEN, load_counted(z, &runs)) {
                Ok(lz) => {
                    assert!(verify(z, lz.bytes()));
                    match c.acquire(w, LEN, load_counted(w, &runs)) {
                        Ok(lw) => {
                            hold(w, &lw);
                            assert_ne!(lz.offset(), lw.offset());
                        }
                        Err(e) => assert_full_is_legit::<ReadError>(&e),
                    }
                    assert!(verify(z, lz.bytes()), "Z changed under its lease");
                }
                Err(e) => assert_full_is_legit::<ReadError>(&e),
            }
            a.join().unwrap();

            let s = c.stats();
            assert_eq!(s.loads as usize, runs.load(Ordering::SeqCst), "{s:?}");
            assert_eq!(s.misses, s.loads, "every load was a demand miss: {s:?}");
            assert_eq!(s.load_failures, 0);
            assert_quiescent_and_evictable(&c, 2);
        },
    );
}

/// Check 4: a prefetch races a demand request for the same page: one load; the demand
/// request gets the page's bytes whoever loaded it; released, the page is evictable.
#[test]
fn prefetch_and_demand_of_one_page_share_one_load() {
    check(
        "prefetch_and_demand_of_one_page_share_one_load",
        None,
        40,
        || {
            let c = cache(2);
            let p = key(20);
            let runs = Arc::new(AtomicUsize::new(0));

            let prefetcher = {
                let (c, runs) = (c.clone(), runs.clone());
                thread::spawn(move || c.prefetch(p, LEN, load_counted::<ReadError>(p, &runs)))
            };
            let offset = {
                let lease = c
                    .acquire(p, LEN, load_counted::<ReadError>(p, &runs))
                    .expect("room for one page");
                hold(p, &lease);
                lease.offset()
            };
            let prefetched = prefetcher.join().unwrap().expect("prefetch");

            assert_eq!(runs.load(Ordering::SeqCst), 1, "one load: {prefetched:?}");
            assert_ne!(prefetched, Prefetched::Skipped, "there was room");
            let s = c.stats();
            assert_eq!(s.loads, 1);
            let by_prefetch = prefetched == Prefetched::Loaded;
            assert_eq!(s.prefetch_loads, u64::from(by_prefetch), "{s:?}");
            assert_eq!(s.misses, u64::from(!by_prefetch), "{s:?}");
            // Had the demand request hit or waited, it would see the same slot.
            let again = c
                .acquire(p, LEN, load_counted::<ReadError>(p, &runs))
                .unwrap();
            assert_eq!(again.offset(), offset);
            drop(again);
            assert_quiescent_and_evictable(&c, 2);
        },
    );
}

/// Check 4b: the same race under eviction pressure. Thread A prefetches P, then leases
/// Q and R at once in a cache of 2 slots (so R must evict P unless P is leased); thread
/// B leases P. A demand request that waited on the prefetch is counted in P's
/// references when P is published, so P cannot be evicted between publication and the
/// waiter waking: B's bytes never change under its lease.
#[test]
fn prefetched_page_is_not_evicted_under_a_waiting_demand() {
    check(
        "prefetched_page_is_not_evicted_under_a_waiting_demand",
        None,
        1000,
        || {
            let c = cache(2);
            let (p, q, r) = (key(30), key(31), key(32));
            let runs = Arc::new(AtomicUsize::new(0));

            let a = {
                let (c, runs) = (c.clone(), runs.clone());
                thread::spawn(move || {
                    let pf = c
                        .prefetch(p, LEN, load_counted::<ReadError>(p, &runs))
                        .expect("prefetch");
                    match c.acquire(q, LEN, load_counted(q, &runs)) {
                        Ok(lq) => {
                            match c.acquire(r, LEN, load_counted(r, &runs)) {
                                Ok(lr) => hold(r, &lr),
                                Err(e) => assert_full_is_legit::<ReadError>(&e),
                            }
                            assert!(verify(q, lq.bytes()), "Q changed under its lease");
                        }
                        Err(e) => assert_full_is_legit::<ReadError>(&e),
                    }
                    pf
                })
            };
            match c.acquire(p, LEN, load_counted(p, &runs)) {
                Ok(lease) => hold(p, &lease),
                Err(e) => assert_full_is_legit::<ReadError>(&e),
            }
            let pf = a.join().unwrap();

            let s = c.stats();
            assert_eq!(s.loads as usize, runs.load(Ordering::SeqCst), "{s:?}");
            assert_eq!(
                s.prefetch_loads,
                u64::from(pf == Prefetched::Loaded),
                "{pf:?} {s:?}"
            );
            assert_quiescent_and_evictable(&c, 2);
        },
    );
}

/// Check 5: pins against leases and eviction. A cache of 2 slots holds X (pinned) and
/// Y. Thread A leases X and holds it (or reloads it, or is refused); thread B unpins X
/// and pins P; the main thread leases P (a miss, pinned before, during or after its
/// load) and then W while holding P. A pinned or leased page is never evicted; W gets a
/// slot only once X is neither; afterwards P is resident and pinned, and the pin
/// counters match.
#[test]
fn pins_and_unpins_race_leases_and_eviction() {
    check(
        "pins_and_unpins_race_leases_and_eviction",
        Some(3),
        1000,
        || {
            let c = cache(2);
            let (x, y, p, w) = (key(40), key(41), key(42), key(43));
            let runs = Arc::new(AtomicUsize::new(0));
            c.pin([x]);
            for k in [x, y] {
                drop(
                    c.acquire(k, LEN, load_counted::<ReadError>(k, &runs))
                        .unwrap(),
                );
            }
            assert_eq!(c.stats().pinned_bytes, SLOT_ALIGN);

            // A hit, or (once B unpinned X and the main thread evicted it for W) a
            // reload or a legitimate `Full`.
            let a = {
                let (c, runs) = (c.clone(), runs.clone());
                thread::spawn(move || match c.acquire(x, LEN, load_counted(x, &runs)) {
                    Ok(lease) => hold(x, &lease),
                    Err(e) => assert_full_is_legit::<ReadError>(&e),
                })
            };
            let b = {
                let c = c.clone();
                thread::spawn(move || {
                    c.unpin([x]);
                    c.pin([p]);
                })
            };
            {
                // Y is neither pinned nor leased: P always finds room.
                let lp = c
                    .acquire(p, LEN, load_counted::<ReadError>(p, &runs))
                    .expect("room for P");
                match c.acquire(w, LEN, load_counted(w, &runs)) {
                    Ok(lw) => hold(w, &lw),
                    Err(e) => assert_full_is_legit::<ReadError>(&e),
                }
                hold(p, &lp);
            }
            a.join().unwrap();
            b.join().unwrap();

            assert!(c.resident(p) && c.is_pinned(p) && !c.is_pinned(x));
            let s = c.stats();
            assert_eq!(s.pinned_bytes, SLOT_ALIGN, "only P is pinned: {s:?}");
            assert_eq!(s.loads as usize, runs.load(Ordering::SeqCst), "{s:?}");
            // Unpinned, P is as evictable as the rest.
            c.unpin([p]);
            assert_eq!(c.stats().pinned_bytes, 0);
            assert_quiescent_and_evictable(&c, 2);
        },
    );
}
