//! Bench of the CPU matmul kernels against the machine's measured read bandwidth.
//!
//! `cargo run --release -p libvoom --example matmul_bench [-- --quick] [--shape RxC]
//! [--no-prefill] [--tokens N] [--portable | --avx2] [--formats]`
//!
//! `--formats` measures the block-scaled formats as released (FP8 e4m3 with 128x128
//! F32 scales, MXFP4 with e8m0 scales per 32) at gpt-oss-20b's expert shapes and
//! DeepSeek-V3's, beside BF16 of the same shapes; GB/s count the bytes as stored
//! (elements and scales).
//!
//! Decode (one token) is memory bound: it reports GB/s of weights streamed and the
//! ratio to `read_bandwidth` measured in the same run on the same thread count.
//! Weights are cycled over a set of copies much larger than the last-level cache, so
//! every call reads DRAM. Prefill (64 tokens, or `--tokens N`) is compute bound: it reports GFLOP/s.
//! Every figure is the median of several timed passes.

use std::time::{Duration, Instant};

use libvoom::backend::cpu::matmul::{matmul_isa, Isa, WeightView};
use libvoom::backend::cpu::membw::ReadProbe;
use libvoom::backend::cpu::threads::ThreadPool;
use libvoom::backend::view::{BlockScales, WeightFormat};
use voom_formats::DType;

/// Total bytes of weight copies cycled through: 16x a 32 MiB L3.
const WORKING_SET: usize = 512 << 20;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    // `--shape RxC` restricts the table to one shape; `--no-prefill` skips prefill.
    let only: Option<(usize, usize)> = args
        .iter()
        .position(|a| a == "--shape")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.split_once('x'))
        .and_then(|(r, c)| Some((r.parse().ok()?, c.parse().ok()?)));
    let no_prefill = args.iter().any(|a| a == "--no-prefill");
    // `--tokens N`: tokens of a prefill call (the engine's prefill chunk is 256).
    let tokens: usize = args
        .iter()
        .position(|a| a == "--tokens")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(64);
    let reps = if quick { 3 } else { 7 };
    // `--portable` measures the lane-emulating fallback instead of the best kernels,
    // `--avx2` the AVX2 tiles on a CPU that also has AVX-512.
    let isa = if args.iter().any(|a| a == "--portable") {
        Isa::Portable
    } else if args.iter().any(|a| a == "--avx2") && Isa::Avx2.supported() {
        Isa::Avx2
    } else {
        Isa::detect()
    };
    println!("instruction set: {isa:?}");

    let pools: Vec<ThreadPool> = [1, 2]
        .iter()
        .map(|&t| ThreadPool::new(t).expect("spawn pool threads"))
        .collect();

    // Bandwidth passes are interleaved with the kernel passes below so that both
    // see the same load on a shared machine; this first figure is for reference.
    let probe = ReadProbe::new(WORKING_SET);
    for pool in &pools {
        let gbs = median((0..reps).map(|_| probe.pass(pool.threads())).collect());
        println!(
            "read bandwidth, {} thread(s): {gbs:.1} GB/s",
            pool.threads()
        );
    }
    dispatch_overhead(&pools);

    let small = [
        (576, 576),
        (192, 576),
        (1536, 576),
        (576, 1536),
        (49152, 576),
    ];
    let large = [(2048, 2048), (8192, 2048), (2048, 8192)];
    println!(
        "\n{:>12} {:>5} {:>3} | {:>9} {:>7} {:>7} {:>6} | {:>13}",
        "shape", "dtype", "thr", "decode us", "GB/s", "bw GB/s", "of bw", "prefill GF/s"
    );
    let formats = args.iter().any(|a| a == "--formats");
    // gpt-oss-20b's expert gate_up and down; DeepSeek-V3's expert gate and down.
    let quant = [(5760, 2880), (2880, 2880), (2048, 7168), (7168, 2048)];
    let shapes: Vec<(usize, usize)> = if formats {
        quant.to_vec()
    } else {
        small.iter().chain(&large).copied().collect()
    };
    for (rows, cols) in shapes {
        if only.is_some_and(|s| s != (rows, cols)) {
            continue;
        }
        let kinds: &[Kind] = if formats {
            &[Kind::Plain(DType::BF16), Kind::Fp8, Kind::Mxfp4]
        } else if (rows, cols) == (2048, 8192) {
            &[
                Kind::Plain(DType::BF16),
                Kind::Plain(DType::F16),
                Kind::Plain(DType::F32),
            ]
        } else {
            &[Kind::Plain(DType::BF16)]
        };
        for &dtype in kinds {
            let set = WeightSet::new(dtype, rows, cols);
            for pool in &pools {
                let (us, gbs, bound) = decode(&set, pool, isa, &probe, reps);
                let gflops = if no_prefill {
                    f64::NAN
                } else {
                    prefill(&set, pool, isa, tokens, reps)
                };
                println!(
                    "{:>12} {:>5} {:>3} | {:>9.1} {:>7.2} {:>7.2} {:>5.0}% | {:>13.1}",
                    format!("{rows}x{cols}"),
                    dtype.name(),
                    pool.threads(),
                    us,
                    gbs,
                    bound,
                    100.0 * gbs / bound,
                    gflops
                );
            }
        }
    }
}

/// How a bench matrix is stored.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Plain(DType),
    /// FP8 e4m3, one F32 scale per 128x128 block (DeepSeek-V3, Qwen3-FP8).
    Fp8,
    /// MXFP4, one e8m0 scale per 32 elements of a row (gpt-oss).
    Mxfp4,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Plain(d) => d.as_str(),
            Kind::Fp8 => "FP8",
            Kind::Mxfp4 => "MXFP4",
        }
    }

    /// Bytes of a matrix's elements and of its scales.
    fn bytes(self, rows: usize, cols: usize) -> (usize, usize) {
        match self {
            Kind::Plain(d) => (rows * cols * d.size(), 0),
            Kind::Fp8 => (rows * cols, rows.div_ceil(128) * cols.div_ceil(128) * 4),
            Kind::Mxfp4 => (rows * cols / 2, rows * cols / 32),
        }
    }
}

/// Copies of one matrix, adjacent in one buffer (their scales in another),
/// totalling at least `WORKING_SET`.
struct WeightSet {
    kind: Kind,
    rows: usize,
    cols: usize,
    copies: usize,
    bytes: Vec<u8>,
    scales: Vec<u8>,
}

impl WeightSet {
    fn new(kind: Kind, rows: usize, cols: usize) -> WeightSet {
        let (one, one_scales) = kind.bytes(rows, cols);
        let copies = WORKING_SET.div_ceil(one + one_scales).max(2);
        let mut bytes = vec![0u8; one * copies];
        let mut scales = vec![0u8; one_scales * copies];
        // Finite values in [-1, 1): xorshift mantissa under a fixed exponent.
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let v = f32::from_bits(0x3f80_0000 | (s as u32 >> 9)) - 1.5;
            v * 2.0
        };
        match kind {
            Kind::Plain(DType::BF16) => {
                for c in bytes.chunks_exact_mut(2) {
                    c.copy_from_slice(&((next().to_bits() >> 16) as u16).to_le_bytes());
                }
            }
            Kind::Plain(DType::F16) => {
                for c in bytes.chunks_exact_mut(2) {
                    c.copy_from_slice(&half::f16::from_f32(next()).to_bits().to_le_bytes());
                }
            }
            Kind::Plain(_) => {
                for c in bytes.chunks_exact_mut(4) {
                    c.copy_from_slice(&next().to_le_bytes());
                }
            }
            Kind::Fp8 => {
                // Bytes as a release's weights are (normals: the block's largest
                // magnitudes near 448, the rest spread below; no subnormal, which
                // a release's weights almost never are), no NaN; scales near
                // 2^-8.
                for b in bytes.iter_mut() {
                    let v = (next().to_bits() >> 8) as u8;
                    let exponent = 1 + (v >> 3) % 15;
                    *b = (v & 0x87) | (exponent << 3);
                    if *b & 0x7f == 0x7f {
                        *b = 0x7e;
                    }
                }
                for c in scales.chunks_exact_mut(4) {
                    c.copy_from_slice(&(next().abs() * 2e-3 + 1e-4).to_le_bytes());
                }
            }
            Kind::Mxfp4 => {
                for b in bytes.iter_mut() {
                    *b = (next().to_bits() >> 8) as u8;
                }
                for b in scales.iter_mut() {
                    *b = 118 + (next().to_bits() >> 8) as u8 % 8;
                }
            }
        }
        WeightSet {
            kind,
            rows,
            cols,
            copies,
            bytes,
            scales,
        }
    }

    /// Bytes a product reads: elements and scales.
    fn stored_bytes(&self) -> usize {
        (self.bytes.len() + self.scales.len()) / self.copies
    }

    fn view(&self, i: usize) -> WeightView<'_> {
        let one = self.bytes.len() / self.copies;
        let one_s = self.scales.len() / self.copies;
        let scales = &self.scales[i * one_s..(i + 1) * one_s];
        let format = match self.kind {
            Kind::Plain(d) => WeightFormat::Plain(d),
            Kind::Fp8 => WeightFormat::Fp8(BlockScales {
                dtype: DType::F32,
                block_rows: 128,
                block_cols: 128,
                row0: 0,
                bytes: scales,
            }),
            Kind::Mxfp4 => WeightFormat::Mxfp4 { scales },
        };
        WeightView::of(
            format,
            self.rows,
            self.cols,
            &self.bytes[i * one..(i + 1) * one],
        )
        .expect("bench weights have the right length")
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Medians over passes of (µs per call, GB/s of weights, GB/s of the bandwidth
/// probe); each decode pass (one call per copy) follows a probe pass.
fn decode(
    set: &WeightSet,
    pool: &ThreadPool,
    isa: Isa,
    probe: &ReadProbe,
    reps: usize,
) -> (f64, f64, f64) {
    let x: Vec<f32> = (0..set.cols)
        .map(|i| (i % 7) as f32 * 0.25 - 0.75)
        .collect();
    let mut out = vec![0.0f32; set.rows];
    let per_call_bytes = set.stored_bytes() as f64;
    let (mut secs, mut bw) = (Vec::new(), Vec::new());
    for rep in 0..=reps {
        let b = probe.pass(pool.threads());
        let start = Instant::now();
        for i in 0..set.copies {
            matmul_isa(isa, pool, &x, 1, set.view(i), &mut out).expect("valid shapes");
        }
        let t = start.elapsed().as_secs_f64() / set.copies as f64;
        if rep > 0 {
            // The first pass warms pages and threads.
            secs.push(t);
            bw.push(b);
        }
    }
    std::hint::black_box(&out);
    let t = median(secs);
    (t * 1e6, per_call_bytes / t / 1e9, median(bw))
}

/// Median GFLOP/s of `n`-token calls, cycling over the copies.
fn prefill(set: &WeightSet, pool: &ThreadPool, isa: Isa, n: usize, reps: usize) -> f64 {
    let x: Vec<f32> = (0..n * set.cols)
        .map(|i| (i % 11) as f32 * 0.1 - 0.5)
        .collect();
    let mut out = vec![0.0f32; n * set.rows];
    let flops = 2.0 * (set.rows * set.cols * n) as f64;
    // Enough calls per pass for ~50 ms, at least one.
    let calls = {
        let start = Instant::now();
        matmul_isa(isa, pool, &x, n, set.view(0), &mut out).expect("valid shapes");
        let one = start.elapsed().max(Duration::from_micros(1));
        ((0.05 / one.as_secs_f64()) as usize).clamp(1, set.copies * 4)
    };
    let mut rates = Vec::new();
    for _ in 0..reps {
        let start = Instant::now();
        for i in 0..calls {
            matmul_isa(isa, pool, &x, n, set.view(i % set.copies), &mut out).expect("valid shapes");
        }
        rates.push(flops * calls as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    std::hint::black_box(&out);
    median(rates)
}

/// Cost of dispatching an empty two-chunk job, this pool vs rayon's.
fn dispatch_overhead(pools: &[ThreadPool]) {
    const CALLS: u32 = 20_000;
    for pool in pools.iter().filter(|p| p.threads() > 1) {
        let start = Instant::now();
        for _ in 0..CALLS {
            pool.for_each_chunk_grain(pool.threads(), 1, |r| {
                std::hint::black_box(r);
            });
        }
        let ours = start.elapsed() / CALLS;
        let rp = rayon::ThreadPoolBuilder::new()
            .num_threads(pool.threads())
            .build()
            .expect("rayon pool");
        let start = Instant::now();
        for _ in 0..CALLS {
            rp.install(|| {
                rayon::join(|| std::hint::black_box(1), || std::hint::black_box(2));
            });
        }
        let rayon = start.elapsed() / CALLS;
        println!(
            "dispatch of an empty job on {} threads: voom pool {:.2} us, rayon install+join {:.2} us",
            pool.threads(),
            ours.as_secs_f64() * 1e6,
            rayon.as_secs_f64() * 1e6
        );
    }
}
