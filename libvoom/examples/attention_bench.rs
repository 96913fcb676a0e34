//! Bench of the CPU attention kernel (prefill over a long prompt, and decode at the
//! end of it) against the machine's multiply-add rate measured in the same run.
//!
//! `cargo run --release -p libvoom --example attention_bench [-- --positions N]
//! [--threads T] [--heads H --kv-heads K --head-dim D]`
//!
//! Defaults are SmolLM2-135M's attention (9 heads, 3 KV heads, 64 dims) over 4096
//! positions on every core. Prefill computes every position against the ones before
//! it (`N (N + 1) / 2 × heads × head_dim` multiply-adds for the scores and as many
//! for the values); decode one more position. The bound is the matmul kernel's
//! multiply-add rate on the same threads (a 64-token product of an F32 weight),
//! measured between the timed passes. Figures are medians of 5 passes.

use std::time::Instant;

use libvoom::backend::cpu::matmul::{matmul_isa, Isa, WeightView};
use libvoom::backend::cpu::threads::ThreadPool;
use libvoom::backend::cpu::CpuBackend;
use libvoom::backend::{AttentionShape, Backend};
use libvoom::kv::KvCache;
use voom_formats::DType;

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n = arg(&args, "--positions", 4096);
    let threads = arg(
        &args,
        "--threads",
        std::thread::available_parallelism().map_or(1, |t| t.get()),
    );
    let heads = arg(&args, "--heads", 9);
    let kv_heads = arg(&args, "--kv-heads", 3);
    let hd = arg(&args, "--head-dim", 64);
    let isa = Isa::detect();
    let b = CpuBackend::new(threads, isa).expect("threads");
    let shape = AttentionShape {
        heads,
        kv_heads,
        head_dim: hd,
        window: None,
        sinks: None,
    };
    let (qd, kvd) = (heads * hd, kv_heads * hd);
    let mut seed = 1u64;
    let mut rand = |len: usize| -> Vec<f32> {
        (0..len)
            .map(|_| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    };
    let (q, k, v) = (rand(n * qd), rand(n * kvd), rand(n * kvd));
    let (q1, k1, v1) = (rand(qd), rand(kvd), rand(kvd));
    let up = |rows: usize, cols: usize, x: &[f32]| b.upload(rows, cols, x).unwrap();
    let (qa, ka, va) = (up(n, qd, &q), up(n, kvd, &k), up(n, kvd, &v));
    let (qb, kb, vb) = (up(1, qd, &q1), up(1, kvd, &k1), up(1, kvd, &v1));

    // The multiply-add rate of the matmul kernel on the same threads.
    let pool = ThreadPool::new(threads).expect("threads");
    let (rows, cols, toks) = (1024, 1024, 64);
    let w: Vec<u8> = rand(rows * cols)
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let view = WeightView {
        lease: None,
        format: libvoom::backend::view::WeightFormat::Plain(DType::F32),
        rows,
        cols,
        bytes: &w,
    };
    let x = rand(toks * cols);
    let mut out = vec![0f32; toks * rows];
    let mut bound = || {
        let t = Instant::now();
        matmul_isa(isa, &pool, &x, toks, view, &mut out).unwrap();
        (rows * cols * toks) as f64 / t.elapsed().as_secs_f64() / 1e9
    };

    let macs = (n * (n + 1) / 2 * heads * hd * 2) as f64;
    let (mut pre, mut dec, mut bounds) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..5 {
        bounds.push(bound());
        let mut kv = KvCache::new(1, kvd, n + 1);
        let mut o = b.zeros(n, qd);
        let t = Instant::now();
        b.attention(&qa, &ka, &va, &mut kv, 0, &shape, &mut o)
            .unwrap();
        pre.push(t.elapsed().as_secs_f64());
        kv.commit(&vec![0; n]);
        let mut o = b.zeros(1, qd);
        let t = Instant::now();
        b.attention(&qb, &kb, &vb, &mut kv, 0, &shape, &mut o)
            .unwrap();
        dec.push(t.elapsed().as_secs_f64());
    }
    let (pre, dec, bound) = (median(pre), median(dec), median(bounds));
    let rate = macs / pre / 1e9;
    println!(
        "{isa:?}, {threads} threads, {heads} heads / {kv_heads} KV heads x {hd}, {n} positions"
    );
    println!(
        "prefill: {:.3} s, {rate:.1} G multiply-adds/s = {:.0}% of the matmul kernel's {bound:.1}",
        pre,
        100.0 * rate / bound
    );
    println!(
        "decode at {n}: {:.3} ms, {:.2} GB/s of keys and values",
        dec * 1e3,
        (2 * n * kvd * 4) as f64 / dec / 1e9
    );
}
