//! The softmax of a row of attention scores, with one definition on every
//! instruction set (so its bits are the same on each, and on every machine, not
//! those of whatever `libm` the system has):
//!
//! - `m` = the row's largest value;
//! - `e[j]` = [`exp`]`(x[j] - m)`: the exponential of our own (module
//!   [`exp`](super::exp)), the same operations in scalar and vector code;
//! - `s` = the sum of the `e[j]` in f64, in eight lanes (lane `j mod 8`, each in
//!   increasing `j`), the lanes added as `((l0 + l4) + (l2 + l6)) + ((l1 + l5) +
//!   (l3 + l7))`, then rounded to f32;
//! - `x[j] = e[j] / s`.
//!
//! The vector code computes eight `j` at once with exactly these operations; the
//! lanes are independent, so the order of each sum does not depend on the row's
//! length or on which code ran.

use super::exp::exp;
use super::matmul::Isa;

/// The softmax of `x` in place, as the module defines it: [`max`], then
/// [`exp_sum`], then [`divide`] (which callers may also run a piece at a time).
pub fn softmax(isa: Isa, x: &mut [f32]) {
    if x.is_empty() {
        return;
    }
    let m = max(isa, x);
    let s = exp_sum(isa, x, m);
    divide(isa, x, s);
}

/// The softmax of `x` beside a sink logit (gpt-oss's attention sinks): `m` = the
/// larger of `x`'s largest value and `sink`; `e[j]` as [`softmax`]'s; the sum is
/// [`exp_sum`]'s plus `exp(sink - m)`, in f32; `x[j] = e[j] / s`. The sink's own
/// probability is dropped. `None`: [`softmax`].
pub fn softmax_sink(isa: Isa, x: &mut [f32], sink: Option<f32>) {
    let Some(sink) = sink else {
        return softmax(isa, x);
    };
    if x.is_empty() {
        return;
    }
    let m = max(isa, x).max(sink);
    let s = exp_sum(isa, x, m) + exp(sink - m);
    divide(isa, x, s);
}

/// The largest value of `x`, NaNs ignored (`f32::max`'s fold: the same whatever
/// the order, so a row's maximum may be taken piece by piece).
pub fn max(isa: Isa, x: &[f32]) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is AVX2 only where the CPU has it (`Isa::detect`, or a
        // caller that checked).
        Isa::Avx512 | Isa::Avx2 => unsafe { avx2::max(x) },
        _ => x.iter().copied().fold(f32::NEG_INFINITY, f32::max),
    }
}

/// `x[j] = exp(x[j] - m)` for every `j`, and the sum of them as the module
/// defines it (eight f64 lanes), rounded to f32.
pub fn exp_sum(isa: Isa, x: &mut [f32], m: f32) -> f32 {
    let mut lanes = [0f64; 8];
    let done = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `max`.
        Isa::Avx512 | Isa::Avx2 => unsafe { avx2::exp_sum(x, m, &mut lanes) },
        _ => 0,
    };
    for (j, v) in x.iter_mut().enumerate().skip(done) {
        *v = exp(*v - m);
        lanes[j % 8] += f64::from(*v);
    }
    let l = lanes;
    (((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))) as f32
}

/// `x[j] /= s` for every `j` (each element alone: a row may be divided piece by
/// piece).
pub fn divide(isa: Isa, x: &mut [f32], s: f32) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `max`.
        Isa::Avx512 | Isa::Avx2 => unsafe { avx2::divide(x, s) },
        _ => x.iter_mut().for_each(|v| *v /= s),
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::exp::avx2::exp8;
    use std::arch::x86_64::*;

    /// The largest value of `x`, NaNs ignored (`f32::max`'s fold: the largest of
    /// the numbers, whatever their order, or -inf).
    ///
    /// # Safety
    /// CPU has AVX2.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn max(x: &[f32]) -> f32 {
        let n8 = x.len() - x.len() % 8;
        let mut acc = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut j = 0;
        while j < n8 {
            // SAFETY: j + 8 <= n8 <= x.len(). `max_ps(v, acc)` gives `acc` where `v`
            // is NaN, so NaNs are skipped as `f32::max` skips them.
            acc = unsafe { _mm256_max_ps(_mm256_loadu_ps(x.as_ptr().add(j)), acc) };
            j += 8;
        }
        let mut lanes = [0f32; 8];
        // SAFETY: eight floats into an array of eight.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        lanes
            .iter()
            .chain(&x[n8..])
            .copied()
            .fold(f32::NEG_INFINITY, f32::max)
    }

    /// `x[j] /= s` for every `j`.
    ///
    /// # Safety
    /// CPU has AVX2.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn divide(x: &mut [f32], s: f32) {
        let n8 = x.len() - x.len() % 8;
        let sv = _mm256_set1_ps(s);
        let mut j = 0;
        while j < n8 {
            // SAFETY: j + 8 <= n8 <= x.len().
            unsafe {
                let p = x.as_mut_ptr().add(j);
                _mm256_storeu_ps(p, _mm256_div_ps(_mm256_loadu_ps(p), sv));
            }
            j += 8;
        }
        for v in &mut x[n8..] {
            *v /= s;
        }
    }

    /// `x[j] = exp(x[j] - m)` for the whole chunks of eight, each added to
    /// `lanes[j % 8]`; returns how many it did.
    ///
    /// # Safety
    /// CPU has AVX2+FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_sum(x: &mut [f32], m: f32, lanes: &mut [f64; 8]) -> usize {
        let n8 = x.len() - x.len() % 8;
        let mv = _mm256_set1_ps(m);
        // SAFETY: eight f64 lanes read from and written to an array of eight.
        let (mut lo, mut hi) = unsafe {
            (
                _mm256_loadu_pd(lanes.as_ptr()),
                _mm256_loadu_pd(lanes.as_ptr().add(4)),
            )
        };
        let mut j = 0;
        while j < n8 {
            // SAFETY: j + 8 <= n8 <= x.len().
            unsafe {
                let p = x.as_mut_ptr().add(j);
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p), mv));
                _mm256_storeu_ps(p, e);
                lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
                hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(e)));
            }
            j += 8;
        }
        // SAFETY: as above.
        unsafe {
            _mm256_storeu_pd(lanes.as_mut_ptr(), lo);
            _mm256_storeu_pd(lanes.as_mut_ptr().add(4), hi);
        }
        n8
    }
}

#[cfg(test)]
mod tests {

    /// A sink takes its share of each row's probability and no more: the f64
    /// definition, to the exponential's rounding (its argument's error grows with
    /// its size: some ulps at -40), on every instruction set.
    #[test]
    fn a_sink_is_one_more_logit_in_the_denominator() {
        for isa in Isa::available() {
            for sink in [-30.0f32, -1.0, 0.5, 3.0, 40.0] {
                let x0: Vec<f32> = (0..37).map(|i| ((i * 7) % 11) as f32 * 0.3 - 1.0).collect();
                let mut x = x0.clone();
                softmax_sink(isa, &mut x, Some(sink));
                let m = x0.iter().fold(f64::from(sink), |a, &b| a.max(f64::from(b)));
                let denom: f64 = x0.iter().map(|&v| (f64::from(v) - m).exp()).sum::<f64>()
                    + (f64::from(sink) - m).exp();
                for (got, &v) in x.iter().zip(&x0) {
                    let want = (f64::from(v) - m).exp() / denom;
                    assert!(
                        (f64::from(*got) - want).abs() <= 4e-6 * want.max(1e-30) + 1e-38,
                        "{isa:?} sink {sink}: {got} vs {want}"
                    );
                }
                let total: f32 = x.iter().sum();
                if sink == 40.0 {
                    // A dominant sink leaves the keys almost nothing.
                    assert!(total < 1e-15, "{isa:?} sink {sink}: {total}");
                }
            }
            // No sink: the plain softmax's bits.
            let mut a: Vec<f32> = (0..19).map(|i| i as f32 * 0.1).collect();
            let mut b = a.clone();
            softmax(isa, &mut a);
            softmax_sink(isa, &mut b, None);
            assert_eq!(a, b);
        }
    }

    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn isas() -> Vec<Isa> {
        Isa::available()
    }

    /// The same bits on every instruction set, for every row length; rows sum to
    /// one and keep the order of their scores; a NaN makes the row NaN.
    #[test]
    fn softmax_has_one_definition() {
        let mut x = [1.0f32, 3.0, 2.0, -1.0];
        softmax(Isa::Portable, &mut x);
        assert!(x[1] > x[2] && x[2] > x[0] && x[0] > x[3]);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for n in [1usize, 2, 7, 8, 9, 16, 63, 200, 1031] {
            let row: Vec<f32> = (0..n).map(|_| rng.gen_range(-30.0..30.0)).collect();
            let mut outs = Vec::new();
            for isa in isas() {
                let mut x = row.clone();
                softmax(isa, &mut x);
                let total: f64 = x.iter().map(|&v| f64::from(v)).sum();
                assert!((total - 1.0).abs() < 1e-5, "{n}: sums to {total}");
                outs.push(x.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            }
            assert!(outs.windows(2).all(|w| w[0] == w[1]), "{n}: differs by ISA");
        }
        for isa in isas() {
            let mut x = vec![0.5f32; 19];
            x[11] = f32::NAN;
            softmax(isa, &mut x);
            assert!(x.iter().all(|v| v.is_nan()), "{isa:?}: {x:?}");
        }
    }
}
