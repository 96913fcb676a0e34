//! The cost of the memory-mapped (embedded) store's file checks on a decode step
//! (issue 8, defects 4 and 5): before each lease the store `fstat`s the page's file
//! (once per file per `acquire_many`, so once per decoder layer), and after each
//! forward pass the engine calls `check_reads`, which `fstat`s every file again.
//!
//! Measured in the same process, on the engine's real store:
//! - `fstat`: one `FileIdentity` of an open checkpoint file, ns;
//! - `check_reads`: the per-pass check (a fault flag, one `fstat` and a lock per file), ns;
//! - the decode step (greedy, `ignore_eos`), µs, with the number of acquire calls per
//!   step (counted by a wrapper that forwards every call to the store) and the time
//!   spent inside them (leases and checks together);
//! - the checks' share of the step: (acquire calls + 1) x (the `check_reads` cost per
//!   file) over the step time; the leases themselves existed before the checks.
//!
//! `cargo run --release -p libvoom --example mmap_check_cost -- MODEL_DIR [RUNS] [THREADS]`
//! (e.g. `~/.voom/models/smollm2-135m-instruct`).

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use libvoom::engine::{Engine, EngineOptions, GenerateParams};
use vpaged::{
    EmbeddedStore, PageId, PageLease, PageMeta, PageSource, SourceCacheStats, StoreError,
    VerifyMode,
};

/// Forwards every call to the store, counting acquire calls and the time inside them.
struct Counted {
    inner: Arc<EmbeddedStore>,
    acquires: AtomicU64,
    acquire_ns: AtomicU64,
    checks: AtomicU64,
}

impl Counted {
    fn timed<T>(&self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        self.acquires.fetch_add(1, Ordering::Relaxed);
        self.acquire_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }
}

impl PageSource for Counted {
    fn pages(&self) -> &[PageMeta] {
        self.inner.pages()
    }
    fn acquire(&self, id: PageId) -> Result<PageLease, StoreError> {
        self.timed(|| self.inner.acquire(id))
    }
    fn acquire_many(&self, ids: &[PageId]) -> Result<Vec<PageLease>, StoreError> {
        self.timed(|| self.inner.acquire_many(ids))
    }
    fn budget(&self) -> Option<u64> {
        self.inner.budget()
    }
    fn prefetch(&self, ids: &[PageId]) {
        self.inner.prefetch(ids)
    }
    fn cache_stats(&self) -> Option<SourceCacheStats> {
        self.inner.cache_stats()
    }
    fn flush(&self) {
        self.inner.flush()
    }
    fn check_reads(&self) -> Result<(), StoreError> {
        self.checks.fetch_add(1, Ordering::Relaxed);
        self.inner.check_reads()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(
        args.next()
            .expect("usage: mmap_check_cost MODEL_DIR [RUNS] [THREADS]"),
    );
    let runs: usize = args.next().map_or(7, |r| r.parse().expect("RUNS"));
    let threads: usize = args.next().map_or(0, |r| r.parse().expect("THREADS"));
    let store = Arc::new(EmbeddedStore::open(&dir, VerifyMode::FirstUse).expect("store"));
    let files = store.checkpoint().files.len();

    let n = 200_000;
    let f = &store.checkpoint().files[0];
    let t = Instant::now();
    for _ in 0..n {
        std::hint::black_box(f.current_identity().unwrap());
    }
    let fstat_ns = t.elapsed().as_nanos() as f64 / n as f64;
    let t = Instant::now();
    for _ in 0..n {
        store.check_reads().unwrap();
    }
    let check_ns = t.elapsed().as_nanos() as f64 / n as f64;

    let counted = Arc::new(Counted {
        inner: Arc::clone(&store),
        acquires: AtomicU64::new(0),
        acquire_ns: AtomicU64::new(0),
        checks: AtomicU64::new(0),
    });
    let engine = Engine::with_source(
        &dir,
        counted.clone(),
        EngineOptions {
            threads,
            ..Default::default()
        },
    )
    .expect("engine");
    let prompt = engine
        .tokenizer()
        .expect("a tokenizer")
        .encode("The capital of France is", true)
        .unwrap();
    let params = GenerateParams {
        max_new_tokens: 64,
        ignore_eos: true,
        ..Default::default()
    };
    let mut steps_us = Vec::new();
    let mut inside_us = Vec::new();
    let mut per_step_calls = 0.0;
    for run in 0..=runs {
        let a0 = counted.acquires.load(Ordering::Relaxed);
        let ns0 = counted.acquire_ns.load(Ordering::Relaxed);
        let c0 = counted.checks.load(Ordering::Relaxed);
        let g = engine
            .generate(&prompt, &params, &mut |_| ControlFlow::Continue(()))
            .unwrap();
        let passes = (counted.checks.load(Ordering::Relaxed) - c0) as f64;
        let calls = (counted.acquires.load(Ordering::Relaxed) - a0) as f64;
        let ns = (counted.acquire_ns.load(Ordering::Relaxed) - ns0) as f64;
        if run == 0 {
            continue; // warm-up: first-use verification, page faults
        }
        let decode_steps = (g.ids.len() - 1) as f64;
        steps_us.push(g.decode_secs * 1e6 / decode_steps);
        per_step_calls = calls / passes;
        inside_us.push(ns / passes / 1e3);
    }
    let step = median(steps_us);
    let inside = median(inside_us);
    let checks_us = (per_step_calls + 1.0) * check_ns / files as f64 / 1e3;
    println!(
        "model: {} ({files} file(s)), {runs} runs of 63 decode steps",
        dir.display()
    );
    println!("fstat of a checkpoint file: {fstat_ns:.0} ns");
    println!("check_reads (per pass, {files} file(s)): {check_ns:.0} ns");
    println!(
        "decode step: {step:.0} us; {per_step_calls:.1} acquire calls per pass, {inside:.1} us inside them"
    );
    println!(
        "file checks per step: ({per_step_calls:.0} + 1) x {:.0} ns = {checks_us:.1} us = {:.2}% of the step",
        check_ns / files as f64,
        100.0 * checks_us / step
    );
}
