//! The page cache under concurrent requests: in-flight dedup (one load for many
//! requests), failures shared by every waiter, and a stress run checking that leased
//! bytes are never overwritten and every load ran once per residency.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use vpaged::arena::{Arena, SLOT_ALIGN};
use vpaged::cache::{CacheError, PageCache, PageKey};

#[derive(Debug, thiserror::Error)]
#[error("disk read of page {0} failed")]
struct ReadError(u32);

#[derive(Debug, thiserror::Error)]
#[error("other error type")]
struct OtherError;

fn cache(slots: usize) -> PageCache {
    PageCache::new(Arena::new(slots * SLOT_ALIGN).expect("arena"))
}

fn key(page: u32) -> PageKey {
    PageKey { model: 3, page }
}

fn pattern(k: PageKey, i: usize) -> u8 {
    (k.page as usize * 151 + k.model as usize * 17 + i * 13 + 1) as u8
}

fn fill_pattern(k: PageKey, b: &mut [u8]) {
    for (i, x) in b.iter_mut().enumerate() {
        *x = pattern(k, i);
    }
}

fn verify(k: PageKey, b: &[u8]) -> bool {
    b.iter().enumerate().all(|(i, &x)| x == pattern(k, i))
}

/// Spins until `cond` holds (the test fails after 20 s rather than hanging).
fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn concurrent_requests_for_one_page_share_one_load() {
    let c = cache(8);
    let loads = Arc::new(AtomicU64::new(0));
    let n = 8;
    let barrier = Arc::new(Barrier::new(n));
    let handles: Vec<_> = (0..n)
        .map(|_| {
            let (c, loads, barrier) = (c.clone(), loads.clone(), barrier.clone());
            thread::spawn(move || {
                barrier.wait();
                let c2 = c.clone();
                let lease = c
                    .acquire(key(1), 3 * SLOT_ALIGN, |b| -> Result<(), ReadError> {
                        loads.fetch_add(1, Ordering::SeqCst);
                        // Hold the load until every other request waits on it.
                        wait_until("the waiters", || c2.stats().inflight_dedups == n as u64 - 1);
                        fill_pattern(key(1), b);
                        Ok(())
                    })
                    .expect("acquire");
                assert!(verify(key(1), lease.bytes()));
                lease.offset()
            })
        })
        .collect();
    let offsets: Vec<usize> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(offsets.iter().all(|&o| o == offsets[0]));
    assert_eq!(loads.load(Ordering::SeqCst), 1);
    let s = c.stats();
    assert_eq!((s.loads, s.misses, s.inflight_dedups), (1, 1, n as u64 - 1));
    assert_eq!(s.leased_bytes, 0, "every lease was dropped");
}

#[test]
fn a_failed_load_is_reported_to_every_waiter_and_nothing_stays() {
    let c = cache(4);
    let waiting = 3;
    let loader = {
        let c = c.clone();
        thread::spawn(move || {
            let c2 = c.clone();
            c.acquire(key(5), 100, |_| {
                wait_until("the waiters", || c2.stats().inflight_dedups == waiting + 1);
                Err(ReadError(5))
            })
        })
    };
    wait_until("the load to start", || c.stats().loading_pages == 1);
    let same_type: Vec<_> = (0..waiting)
        .map(|_| {
            let c = c.clone();
            thread::spawn(move || {
                c.acquire(key(5), 100, |_| -> Result<(), ReadError> {
                    panic!("a waiter never loads")
                })
            })
        })
        .collect();
    let other_type = {
        let c = c.clone();
        thread::spawn(move || {
            c.acquire(key(5), 100, |_| -> Result<(), OtherError> {
                panic!("a waiter never loads")
            })
        })
    };
    match loader.join().unwrap() {
        Err(CacheError::Load { key: k, source }) => assert_eq!((k, source.0), (key(5), 5)),
        other => panic!("unexpected {other:?}"),
    }
    for h in same_type {
        match h.join().unwrap() {
            Err(CacheError::Load { key: k, source }) => assert_eq!((k, source.0), (key(5), 5)),
            other => panic!("unexpected {other:?}"),
        }
    }
    match other_type.join().unwrap() {
        Err(e @ CacheError::PeerLoad { .. }) => {
            assert!(e.to_string().contains("disk read of page 5 failed"), "{e}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(!c.resident(key(5)));
    let s = c.stats();
    assert_eq!((s.used, s.load_failures, s.loading_pages), (0, 1, 0));
}

/// xorshift64*: a deterministic per-thread stream without extra dependencies.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn stress_leased_bytes_are_never_overwritten_and_each_residency_loads_once() {
    const THREADS: usize = 8;
    const KEYS: u32 = 48;
    const OPS: usize = 3000;
    let c = cache(40);
    let len_of = |p: u32| (p as usize % 4 + 1) * SLOT_ALIGN - (p as usize * 97) % 1000;
    // A load of a key while another load of it runs would break in-flight dedup.
    let loading: Arc<Vec<AtomicBool>> =
        Arc::new((0..KEYS).map(|_| AtomicBool::new(false)).collect());
    let loads = Arc::new(AtomicU64::new(0));
    let full = Arc::new(AtomicU64::new(0));
    let corrupt = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (c, loading, loads, full, corrupt) = (
                c.clone(),
                loading.clone(),
                loads.clone(),
                full.clone(),
                corrupt.clone(),
            );
            thread::spawn(move || {
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((t as u64 + 1) * 0x1234_5678));
                let mut held = Vec::new();
                for _ in 0..OPS {
                    // Skewed keys: half the requests go to an eighth of them.
                    let p = if rng.below(2) == 0 {
                        rng.below(KEYS as u64 / 8) as u32
                    } else {
                        rng.below(KEYS as u64) as u32
                    };
                    let k = key(p);
                    let load = |b: &mut [u8]| -> Result<(), ReadError> {
                        assert!(
                            !loading[p as usize].swap(true, Ordering::SeqCst),
                            "two concurrent loads of {k}"
                        );
                        loads.fetch_add(1, Ordering::SeqCst);
                        fill_pattern(k, b);
                        // Some loads yield mid-way, widening the race window.
                        if p.is_multiple_of(3) {
                            thread::yield_now();
                        }
                        loading[p as usize].store(false, Ordering::SeqCst);
                        Ok(())
                    };
                    if rng.below(8) == 0 {
                        c.prefetch(k, len_of(p), load).expect("prefetch");
                        continue;
                    }
                    match c.acquire(k, len_of(p), load) {
                        Ok(lease) => {
                            if !verify(k, lease.bytes()) {
                                corrupt.fetch_add(1, Ordering::SeqCst);
                            }
                            held.push(lease);
                        }
                        Err(CacheError::Full { .. }) => {
                            full.fetch_add(1, Ordering::SeqCst);
                            held.clear();
                        }
                        Err(e) => panic!("{e}"),
                    }
                    // Hold up to 3 leases; re-verify each before release.
                    if held.len() > rng.below(3) as usize {
                        let lease = held.remove(0);
                        thread::yield_now();
                        if !verify(lease.key(), lease.bytes()) {
                            corrupt.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
                for lease in held {
                    if !verify(lease.key(), lease.bytes()) {
                        corrupt.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let s = c.stats();
    println!(
        "stress: {} loads, {} hits, {} misses, {} dedups, {} evictions, {} prefetch loads, {} full",
        loads.load(Ordering::SeqCst),
        s.hits,
        s.misses,
        s.inflight_dedups,
        s.evictions,
        s.prefetch_loads,
        full.load(Ordering::SeqCst)
    );
    assert_eq!(corrupt.load(Ordering::SeqCst), 0, "leased bytes changed");
    assert_eq!(s.loads, loads.load(Ordering::SeqCst));
    // Every load began a residency that either ended in one eviction or lasts.
    assert_eq!(s.loads, s.evictions + s.resident_pages as u64);
    assert_eq!(s.misses + s.prefetch_loads, s.loads);
    assert_eq!(s.full_refusals, full.load(Ordering::SeqCst));
    assert_eq!(s.leased_bytes, 0);
    assert_eq!(s.loading_pages, 0);
    assert!(s.hits > 0 && s.evictions > 0);
}
