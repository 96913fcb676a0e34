//! Page serving by the store core, against its physical bound measured in the same
//! run (BENCHMARKS.md):
//!
//! - direct: `pread` of every page's bytes (page cache warm), GB/s;
//! - blake3: hashing the same bytes on one core, GB/s;
//! - store, first fill: every page acquired once into a fresh cache (read + verify +
//!   publish, plus the kernel zeroing the arena's fresh pages on first touch), GB/s;
//! - store, first fill, prefaulted: the same into an arena committed beforehand
//!   (`Arena::prefault`, `vpaged --prefault`), GB/s, and the time the pre-fault took;
//! - store, steady state: sweeps over the model with a cache half its size, after a
//!   sweep that touched the whole arena: GB/s of bytes loaded (misses) per second,
//!   against the serial bound of read then hash, 1 / (1/direct + 1/blake3); and the
//!   share of the swept bytes served from the cache (not re-read), beside the ideal
//!   for a cyclic sweep (plain LRU scores zero): a resident subset that hits every
//!   sweep while the other pages stream through a window of the largest of them, the
//!   largest such subset: max over window sizes w of (cache - w) / model bytes where
//!   every page longer than w fits in cache - w (slot bytes);
//! - store, warm cache: acquire + release of a resident page, µs.
//!
//! `cargo run --release -p vpaged --example store_bench -- MODEL_DIR [RUNS]`
//! (MODEL_DIR needs a manifest: `vpagectl hash MODEL_DIR`).

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Instant;

use voom_formats::Manifest;
use vpaged::store::{Store, StoreConfig};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Share of a cyclic sweep's bytes a cache of `cache` bytes can serve at best, one
/// page at a time: the pages longer than the window `w` must be resident, the rest
/// stream through it; the resident subset holds at most `cache - w`.
fn cyclic_ideal(manifest: &Manifest, cache: u64) -> f64 {
    let mut slots: Vec<u64> = manifest
        .pages
        .iter()
        .map(|p| p.len.max(1).next_multiple_of(16 << 10))
        .collect();
    slots.sort_unstable_by(|a, b| b.cmp(a));
    let total: u64 = slots.iter().sum();
    let mut longer = 0; // bytes of the pages longer than slots[i]
    let mut best = 0u64;
    for (i, &w) in slots.iter().enumerate() {
        if i > 0 && slots[i - 1] > w {
            longer = slots[..i].iter().sum();
        }
        if w <= cache && longer <= cache - w {
            best = best.max((cache - w).min(total - w));
        }
    }
    best as f64 / total as f64
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().expect("usage: store_bench MODEL_DIR [RUNS]"));
    let runs: usize = args
        .next()
        .map_or(5, |r| r.parse().expect("RUNS is a number"));
    let manifest = Manifest::load(&dir)
        .expect("readable manifest")
        .expect("a manifest: run `vpagectl hash MODEL_DIR` first");
    let total: u64 = manifest.pages.iter().map(|p| p.len).sum();
    let largest = manifest.pages.iter().map(|p| p.len).max().unwrap_or(0) as usize;
    let files: std::collections::HashMap<String, std::fs::File> = manifest
        .pages
        .iter()
        .map(|p| p.file.clone())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .map(|f| {
            let h = std::fs::File::open(dir.join(&f)).expect("model file");
            (f, h)
        })
        .collect();
    let mut buf = vec![0u8; largest];
    let (mut direct, mut hash, mut cold, mut warm_us, mut steady) =
        (vec![], vec![], vec![], vec![], vec![]);
    let (mut cold_prefaulted, mut prefault_secs) = (vec![], vec![]);
    let (mut steady_hit, mut steady_ideal) = (vec![], vec![]);
    for _ in 0..runs {
        let t = Instant::now();
        for p in &manifest.pages {
            files[&p.file]
                .read_exact_at(&mut buf[..p.len as usize], p.offset)
                .expect("read");
        }
        direct.push(total as f64 / t.elapsed().as_secs_f64() / 1e9);

        let mut hash_secs = 0.0;
        for p in &manifest.pages {
            let b = &mut buf[..p.len as usize];
            files[&p.file].read_exact_at(b, p.offset).expect("read");
            let t = Instant::now();
            std::hint::black_box(blake3::hash(b));
            hash_secs += t.elapsed().as_secs_f64();
        }
        hash.push(total as f64 / hash_secs / 1e9);

        let cache_bytes =
            (total as usize + manifest.pages.len() * (16 << 10)).next_multiple_of(16 << 10);
        let store = Store::new(StoreConfig {
            cache_bytes,
            ..Default::default()
        })
        .expect("store");
        let id = store.open_model(&dir).expect("open model");
        let t = Instant::now();
        for p in &manifest.pages {
            drop(store.acquire(id, p.id).expect("acquire"));
        }
        cold.push(total as f64 / t.elapsed().as_secs_f64() / 1e9);
        let t = Instant::now();
        let n = 20_000;
        for i in 0..n {
            let p = &manifest.pages[i % manifest.pages.len()];
            drop(store.acquire(id, p.id).expect("acquire"));
        }
        warm_us.push(t.elapsed().as_secs_f64() * 1e6 / n as f64);
        drop(store);

        // The same first fill into an arena committed at start-up (`vpaged --prefault`).
        let store = Store::new(StoreConfig {
            cache_bytes,
            ..Default::default()
        })
        .expect("store");
        let t = Instant::now();
        store.cache().arena().prefault().expect("prefault");
        prefault_secs.push(t.elapsed().as_secs_f64());
        let id = store.open_model(&dir).expect("open model");
        let t = Instant::now();
        for p in &manifest.pages {
            drop(store.acquire(id, p.id).expect("acquire"));
        }
        cold_prefaulted.push(total as f64 / t.elapsed().as_secs_f64() / 1e9);
        drop(store);

        let half = (total as usize / 2)
            .max(largest + (1 << 20))
            .next_multiple_of(16 << 10);
        let store = Store::new(StoreConfig {
            cache_bytes: half,
            ..Default::default()
        })
        .expect("store");
        let id = store.open_model(&dir).expect("open model");
        for _ in 0..2 {
            for p in &manifest.pages {
                drop(store.acquire(id, p.id).expect("acquire"));
            }
        }
        let before = store.cache_stats().bytes_loaded;
        let t = Instant::now();
        for _ in 0..3 {
            for p in &manifest.pages {
                drop(store.acquire(id, p.id).expect("acquire"));
            }
        }
        let loaded = store.cache_stats().bytes_loaded - before;
        steady.push(loaded as f64 / t.elapsed().as_secs_f64() / 1e9);
        steady_hit.push(1.0 - loaded as f64 / (3 * total) as f64);
        steady_ideal.push(cyclic_ideal(&manifest, half as u64));
    }
    let (d, h, c, w, st) = (
        median(direct),
        median(hash),
        median(cold),
        median(warm_us),
        median(steady),
    );
    let (cp, ps) = (median(cold_prefaulted), median(prefault_secs));
    let (sh, si) = (median(steady_hit), median(steady_ideal));
    let bound = 1.0 / (1.0 / d + 1.0 / h);
    println!(
        "{} pages, {:.1} MB; medians of {runs} runs\n\
         direct read (warm page cache)    {d:>7.2} GB/s\n\
         blake3, one core                 {h:>7.2} GB/s\n\
         bound: read then hash            {bound:>7.2} GB/s\n\
         store, first fill                {c:>7.2} GB/s = {:.0}% of bound\n\
         store, first fill, prefaulted    {cp:>7.2} GB/s = {:.0}% of bound (pre-fault took {:.2} s)\n\
         store, steady state loads        {st:>7.2} GB/s = {:.0}% of bound\n\
         store, steady state bytes hit    {:>7.1} %    (ideal for the sweep {:.1} %, LRU 0 %)\n\
         store, warm cache acquire        {w:>7.2} us per page",
        manifest.pages.len(),
        total as f64 / 1e6,
        100.0 * c / bound,
        100.0 * cp / bound,
        ps,
        100.0 * st / bound,
        100.0 * sh,
        100.0 * si
    );
}
