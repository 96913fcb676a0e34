//! Streaming a model through the store's page cache the way an engine's sweep does,
//! with no compute, against the cold read bandwidth of the same files measured in the
//! same run (BENCHMARKS.md):
//!
//! - bound: cold reads of the model's files around the page cache, the best of 1 to
//!   16 reads in flight of 1 and 8 MiB (`vpaged::direct::read_bandwidth`), GB/s;
//! - serial: one page read then verified at a time on the sweeping thread (no reader
//!   threads, no prefetch: the store before reads in flight), GB/s;
//! - sweep: layer by layer, the next `--depth` layers hinted ahead (loaded by the
//!   prefetch threads through the reader pool) while the current one is leased, each
//!   layer released before the next is leased, GB/s and the share of the bound;
//!
//! each after the page cache is dropped, with a cache of `--cache` bytes (default a
//! quarter of the model, so nothing stays resident from one sweep to the next beyond
//! what the cache's admission keeps).
//!
//! With `--compare CONFIGS` it interleaves configurations instead, `--rounds R` times
//! (the disk's bandwidth drifts minute to minute; only interleaved runs compare):
//! each round measures the bound (16 direct reads in flight of 8 MiB, and buffered
//! reads of 8 MiB from 2 threads) and then sweeps once per configuration, printing
//! each run's share of that round's bound and, at the end, the median share per
//! configuration. CONFIGS is a comma-separated list of `MODE:THREADS:PIECE_MIB:DEPTH`,
//! MODE `direct` or `buffered`, for example `direct:8:1:2,direct:16:4:2`.
//!
//! With `POOL_ONLY=1` it measures the reader pool alone instead (no cache): the first
//! file read whole by 1 to 8 callers of 24 or 96 MiB extents.
//!
//! `cargo run --release -p vpaged --example sweep_bench -- MODEL_DIR [--cache BYTES]
//! [--depth D] [--read-threads N] [--prefetch-threads M] [--piece BYTES] [--sweeps S]`
//! (MODEL_DIR needs a manifest: `vpagectl hash MODEL_DIR`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use voom_formats::manifest::{Manifest, PageGroup};
use vpaged::direct::{self, DirectFile, ReadMode};
use vpaged::store::{IoConfig, Store, StoreConfig, StoreSource};
use vpaged::{PageId, PageSource};

struct Args {
    dir: PathBuf,
    cache: Option<usize>,
    depth: usize,
    io: IoConfig,
    sweeps: usize,
    compare: Option<String>,
    rounds: usize,
}

fn parse() -> Args {
    let mut it = std::env::args().skip(1);
    let mut a = Args {
        dir: PathBuf::new(),
        cache: None,
        depth: 2,
        io: IoConfig::default(),
        sweeps: 2,
        compare: None,
        rounds: 3,
    };
    let mut dir = None;
    while let Some(x) = it.next() {
        let mut num = |name: &str| -> usize {
            it.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name} needs a number"))
        };
        match x.as_str() {
            "--cache" => a.cache = Some(num("--cache")),
            "--depth" => a.depth = num("--depth"),
            "--read-threads" => a.io.read_threads = num("--read-threads"),
            "--prefetch-threads" => a.io.prefetch_threads = num("--prefetch-threads"),
            "--piece" => a.io.read_piece = num("--piece"),
            "--sweeps" => a.sweeps = num("--sweeps"),
            "--rounds" => a.rounds = num("--rounds"),
            "--compare" => a.compare = it.next(),
            _ => dir = Some(PathBuf::from(x)),
        }
    }
    a.dir = dir.expect("usage: sweep_bench MODEL_DIR [options]");
    a
}

fn drop_cached(files: &[PathBuf]) {
    for f in files {
        if let Ok(d) = DirectFile::open(f, ReadMode::Buffered) {
            d.drop_cached();
        }
    }
}

/// The pages of each stage in sweep order: embedding, layers, final, other.
fn stages(m: &Manifest) -> Vec<Vec<PageId>> {
    let mut by: BTreeMap<(u8, u32), Vec<PageId>> = BTreeMap::new();
    for p in &m.pages {
        let k = match p.group {
            PageGroup::Embedding => (0, 0),
            // A dense sweep: a layer's experts with it, all of them.
            PageGroup::Layer(n) | PageGroup::Expert { layer: n, .. } => (1, n),
            PageGroup::Final => (2, 0),
            PageGroup::Other => (3, 0),
        };
        by.entry(k).or_default().push(PageId(p.id));
    }
    by.into_values().collect()
}

/// Sweeps `stages` `sweeps` times through a fresh store; GB/s of bytes loaded and
/// seconds waited per sweep.
fn run(
    a: &Args,
    mode: ReadMode,
    io: IoConfig,
    depth: usize,
    cache: usize,
    files: &[PathBuf],
) -> (f64, f64) {
    let store = Store::new(StoreConfig {
        cache_bytes: cache,
        read_mode: Some(mode),
        io,
        ..StoreConfig::default()
    })
    .expect("store");
    // Committed beforehand, so the sweep does not also time the kernel zeroing fresh
    // arena pages (`vpaged --prefault`).
    store.cache().arena().prefault().expect("prefault");
    let src = Arc::new(StoreSource::open(store.clone(), &a.dir).expect("open"));
    let stages = stages(
        &Manifest::load(&a.dir)
            .expect("manifest")
            .expect("a manifest"),
    );
    drop_cached(files);
    let before = store.cache_stats().bytes_loaded;
    let t = Instant::now();
    for _ in 0..a.sweeps {
        for (i, ids) in stages.iter().enumerate() {
            for ahead in stages.iter().skip(i + 1).take(depth) {
                src.prefetch(ahead);
            }
            let leases = src.acquire_many(ids).expect("acquire");
            std::hint::black_box(leases.iter().map(|l| l.bytes()[0]).sum::<u8>());
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let st = store.cache_stats();
    let bytes = st.bytes_loaded - before;
    println!(
        "  hits {} misses {} in-flight waits {} prefetch loads {} skipped {} full {}",
        st.hits,
        st.misses,
        st.inflight_dedups,
        st.prefetch_loads,
        st.prefetch_skipped,
        st.full_refusals
    );
    (bytes as f64 / secs / 1e9, secs / a.sweeps as f64)
}

fn main() {
    let a = parse();
    let manifest = Manifest::load(&a.dir)
        .expect("manifest")
        .expect("a manifest (vpagectl hash MODEL_DIR)");
    let mut files: Vec<PathBuf> = manifest.pages.iter().map(|p| a.dir.join(&p.file)).collect();
    files.sort();
    files.dedup();
    let model: u64 = manifest.pages.iter().map(|p| p.len).sum();
    let cache = a.cache.unwrap_or((model / 4) as usize);
    println!(
        "model {:.2} GB, cache {:.2} GB, depth {}, {} reader threads of {} MiB pieces, {} prefetch threads",
        model as f64 / 1e9,
        cache as f64 / 1e9,
        a.depth,
        a.io.read_threads,
        a.io.read_piece >> 20,
        a.io.prefetch_threads
    );
    if let Some(list) = &a.compare {
        compare(&a, list, cache, &files);
        return;
    }
    let mut best = 0f64;
    let mut shape = (0, 0);
    for readers in [1, 4, 16] {
        for chunk in [1 << 20, 8 << 20] {
            drop_cached(&files);
            let b = direct::read_bandwidth(&files, 2 << 30, chunk, ReadMode::Direct, readers)
                .expect("bandwidth");
            println!(
                "  cold direct reads, {readers} in flight of {} MiB: {:.2} GB/s",
                chunk >> 20,
                b.bytes_per_sec() / 1e9
            );
            if b.bytes_per_sec() / 1e9 > best {
                best = b.bytes_per_sec() / 1e9;
                shape = (readers, chunk >> 20);
            }
        }
    }
    println!(
        "bound (cold direct reads, best shape: {} in flight of {} MiB): {best:.2} GB/s",
        shape.0, shape.1
    );
    if std::env::var_os("POOL_ONLY").is_some() {
        for (callers, extent) in [(1, 96 << 20), (1, 24 << 20), (4, 24 << 20), (8, 24 << 20)] {
            let g = pool_only(&files, callers, extent, a.io);
            println!(
                "pool: {callers} callers of {} MiB: {g:.2} GB/s",
                extent >> 20
            );
        }
        return;
    }
    let serial = IoConfig {
        read_threads: 0,
        ..a.io
    };
    let (gbs, secs) = run(&a, ReadMode::Direct, serial, 0, cache, &files);
    println!(
        "serial (one read at a time, no prefetch): {gbs:.2} GB/s, {secs:.2} s/sweep, {:.2} of bound",
        gbs / best
    );
    let (gbs, secs) = run(&a, ReadMode::Direct, a.io, a.depth, cache, &files);
    println!(
        "sweep (reads in flight, prefetch depth {}): {gbs:.2} GB/s, {secs:.2} s/sweep, {:.2} of bound",
        a.depth,
        gbs / best
    );
}

/// `--compare`: configurations interleaved over rounds, each against its round's bound.
fn compare(a: &Args, list: &str, cache: usize, files: &[PathBuf]) {
    let configs: Vec<(String, ReadMode, IoConfig, usize)> = list
        .split(',')
        .map(|c| {
            let f: Vec<&str> = c.split(':').collect();
            let bad = || -> ! { panic!("bad config {c:?}: MODE:THREADS:PIECE_MIB:DEPTH") };
            if f.len() != 4 {
                bad();
            }
            let mode = ReadMode::from_name(f[0]).unwrap_or_else(|| bad());
            let n = |s: &str| s.parse::<usize>().unwrap_or_else(|_| bad());
            let io = IoConfig {
                read_threads: n(f[1]),
                read_piece: n(f[2]) << 20,
                ..a.io
            };
            (c.to_string(), mode, io, n(f[3]))
        })
        .collect();
    let mut shares: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    for round in 0..a.rounds {
        drop_cached(files);
        let d = direct::read_bandwidth(files, 2 << 30, 8 << 20, ReadMode::Direct, 16)
            .expect("bandwidth")
            .bytes_per_sec();
        let b = direct::read_bandwidth(files, 2 << 30, 8 << 20, ReadMode::Buffered, 2)
            .expect("bandwidth")
            .bytes_per_sec();
        let bound = d.max(b) / 1e9;
        println!(
            "round {round}: bound {bound:.2} GB/s (direct 16x8 MiB {:.2}, buffered 2x8 MiB {:.2})",
            d / 1e9,
            b / 1e9
        );
        for (k, (name, mode, io, depth)) in configs.iter().enumerate() {
            let (gbs, secs) = run(a, *mode, *io, *depth, cache, files);
            println!(
                "  {name}: {gbs:.2} GB/s, {secs:.2} s/sweep, {:.2} of bound",
                gbs / bound
            );
            shares[k].push(gbs / bound);
        }
    }
    for ((name, ..), mut s) in configs.iter().zip(shares) {
        s.sort_by(f64::total_cmp);
        println!("median {name}: {:.2} of bound", s[s.len() / 2]);
    }
}

/// GB/s of the reader pool reading the first file whole, `callers` threads each
/// reading the next `extent` bytes.
fn pool_only(files: &[PathBuf], callers: usize, extent: usize, io: IoConfig) -> f64 {
    let pool = Arc::new(vpaged::read_pool::ReadPool::new(io.read_threads, io.read_piece).unwrap());
    let f = Arc::new(DirectFile::open(&files[0], ReadMode::Direct).unwrap());
    drop_cached(files);
    let len = f.len() as usize;
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..callers {
            let (pool, f, next) = (pool.clone(), f.clone(), next.clone());
            s.spawn(move || {
                let mut buf = vec![0u8; extent];
                loop {
                    let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let at = k * extent;
                    if at >= len {
                        break;
                    }
                    let n = extent.min(len - at);
                    pool.read(&f, at as u64, &mut buf[..n]).unwrap();
                }
            });
        }
    });
    len as f64 / t.elapsed().as_secs_f64() / 1e9
}
