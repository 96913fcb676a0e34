//! The f32 multiply-add throughput probe: the physical bound of prefill, whose
//! products are compute bound (each weight read once serves every position of the
//! chunk).
//!
//! Runs independent chains of the multiply-adds an instruction set's kernels use
//! (512-bit on AVX-512, 256-bit on AVX2, 128-bit on NEON, scalar on the portable
//! path), enough of them to fill every pipeline, on `threads` threads at once, and
//! reports floating-point operations per second (a multiply-add is two). Benches
//! report prefill's multiply-adds ([`crate::backend::Backend::multiply_adds`]) as a
//! ratio to this figure measured in the same run (DESIGN.md, "Physical limits").

use std::time::{Duration, Instant};

use super::matmul::Isa;

/// Independent accumulators a probe keeps in flight: more than latency × pipes on
/// any core seen (4 cycles × 2 pipes), and within 16 registers.
const CHAINS: usize = 12;

/// GFLOP/s (10^9 floating-point operations a second, two a multiply-add) of `isa`'s
/// f32 multiply-adds on `threads` threads (0 counts as 1), each running for about
/// `run`. `isa` must be supported by this CPU.
pub fn fma_gflops(isa: Isa, threads: usize, run: Duration) -> f64 {
    let threads = threads.max(1);
    // Calibrate on one thread: iterations that take about `run`.
    let mut iters = 1u64 << 12;
    loop {
        let t = Instant::now();
        chains(isa, iters);
        let e = t.elapsed();
        if e >= run / 8 || iters >= 1 << 34 {
            let per = e.as_secs_f64() / iters as f64;
            iters = ((run.as_secs_f64() / per.max(1e-12)) as u64).max(1);
            break;
        }
        iters *= 4;
    }
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| chains(isa, iters));
        }
    });
    let secs = start.elapsed().as_secs_f64();
    let flops = 2.0 * (threads as u64 * iters * (CHAINS * lanes(isa)) as u64) as f64;
    flops / secs / 1e9
}

/// f32 lanes of one multiply-add of `isa`'s probe.
fn lanes(isa: Isa) -> usize {
    match isa {
        Isa::Avx512 => 16,
        Isa::Avx2 => 8,
        Isa::Neon => 4,
        Isa::Portable => 1,
    }
}

/// `iters` rounds of [`CHAINS`] independent multiply-adds of `isa`'s width.
fn chains(isa: Isa, iters: u64) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller passes an `isa` this CPU supports.
        Isa::Avx512 => unsafe { x86::chains512(iters) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::chains256(iters) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::chains128(iters),
        _ => scalar(iters),
    }
}

fn scalar(iters: u64) {
    let mut acc = [0f32; CHAINS];
    let (a, b) = (
        std::hint::black_box(1.000_001f32),
        std::hint::black_box(1e-7f32),
    );
    for _ in 0..iters {
        for v in &mut acc {
            *v = v.mul_add(a, b);
        }
    }
    std::hint::black_box(acc);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::CHAINS;

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn chains512(iters: u64) {
        let a = _mm512_set1_ps(std::hint::black_box(1.000_001));
        let b = _mm512_set1_ps(std::hint::black_box(1e-7));
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..iters {
            for v in &mut acc {
                *v = _mm512_fmadd_ps(*v, a, b);
            }
        }
        std::hint::black_box(acc);
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn chains256(iters: u64) {
        let a = _mm256_set1_ps(std::hint::black_box(1.000_001));
        let b = _mm256_set1_ps(std::hint::black_box(1e-7));
        let mut acc = [_mm256_setzero_ps(); CHAINS];
        for _ in 0..iters {
            for v in &mut acc {
                *v = _mm256_fmadd_ps(*v, a, b);
            }
        }
        std::hint::black_box(acc);
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    use super::CHAINS;

    pub fn chains128(iters: u64) {
        // SAFETY: NEON is part of every aarch64 CPU.
        unsafe {
            let a = vdupq_n_f32(std::hint::black_box(1.000_001));
            let b = vdupq_n_f32(std::hint::black_box(1e-7));
            let mut acc = [vdupq_n_f32(0.0); CHAINS];
            for _ in 0..iters {
                for v in &mut acc {
                    *v = vfmaq_f32(b, *v, a);
                }
            }
            std::hint::black_box(acc);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every instruction set this CPU has gives a positive, finite rate, and a wider
    /// one is not slower than the portable path's scalar multiply-adds.
    #[test]
    fn every_instruction_set_has_a_positive_peak() {
        // The best of three: a probe descheduled by other tests only reads low.
        let best = |isa| {
            (0..3)
                .map(|_| fma_gflops(isa, 1, Duration::from_millis(20)))
                .fold(0f64, f64::max)
        };
        let portable = best(Isa::Portable);
        assert!(portable.is_finite() && portable > 0.01, "{portable}");
        for isa in Isa::available() {
            let g = best(isa);
            assert!(g.is_finite() && g > 0.01, "{isa:?}: {g} GFLOP/s");
            if lanes(isa) >= 8 {
                assert!(g > portable, "{isa:?}: {g} against scalar {portable}");
            }
        }
    }
}
