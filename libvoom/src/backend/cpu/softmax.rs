//! The softmax of a row of attention scores, with one definition on every
//! instruction set (so its bits are the same on each, and on every machine, not
//! those of whatever `libm` the system has):
//!
//! - `m` = the row's largest value;
//! - `e[j]` = [`exp_nonpositive`]`(x[j] - m)`: an exponential of our own, the same
//!   operations in scalar and vector code;
//! - `s` = the sum of the `e[j]` in f64, in eight lanes (lane `j mod 8`, each in
//!   increasing `j`), the lanes added as `((l0 + l4) + (l2 + l6)) + ((l1 + l5) +
//!   (l3 + l7))`, then rounded to f32;
//! - `x[j] = e[j] / s`.
//!
//! The vector code computes eight `j` at once with exactly these operations; the
//! lanes are independent, so the order of each sum does not depend on the row's
//! length or on which code ran.

use super::matmul::Isa;

/// `log2(e)`, and `ln(2)` split into a part exact in few bits and the rest.
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Below this the exponential is 0 or the smallest denormals: inputs are clamped.
const LOWEST: f32 = -104.0;
/// The polynomial of `e^r` on `|r| <= ln(2)/2` (Cephes' `expf`):
/// `1 + r + r^2 (P0 r^5 + P1 r^4 + ... + P5)`.
const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x` for `x <= 0` (larger `x` are not its domain; a NaN gives NaN), within 2
/// units in the last place of the exact value. `x = n ln 2 + r`, `n` the nearest
/// integer to `x log2(e)`; `e^r` by the polynomial; then `2^n` applied as two
/// exact powers of two, `2^a 2^b` with `a = floor(n / 2)`, so that a denormal
/// result is rounded once.
pub fn exp_nonpositive(x: f32) -> f32 {
    // Not `max`: a NaN stays NaN (as `_mm256_max_ps(LOWEST, x)` keeps it).
    let x = if x < LOWEST { LOWEST } else { x };
    let n = (x * LOG2E).round_ties_even();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p = P[0];
    for c in &P[1..] {
        p = p.mul_add(r, *c);
    }
    let e = p.mul_add(r * r, r) + 1.0;
    let n = n as i32;
    let a = n >> 1;
    let b = n - a;
    (e * pow2(a)) * pow2(b)
}

/// `2^k` for `-126 <= k <= 127`.
fn pow2(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

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
        *v = exp_nonpositive(*v - m);
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
    use super::*;
    use std::arch::x86_64::*;

    /// Eight [`exp_nonpositive`]s, with its operations.
    ///
    /// # Safety
    /// CPU has AVX2+FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp8(x: __m256) -> __m256 {
        // The second operand where either is NaN: a NaN stays NaN.
        let x = _mm256_max_ps(_mm256_set1_ps(LOWEST), x);
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
        );
        let neg = _mm256_sub_ps(_mm256_setzero_ps(), n);
        let r = _mm256_fmadd_ps(neg, _mm256_set1_ps(LN2_HI), x);
        let r = _mm256_fmadd_ps(neg, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(P[0]);
        for c in &P[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        let e = _mm256_add_ps(
            _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
            _mm256_set1_ps(1.0),
        );
        let ni = _mm256_cvtps_epi32(n);
        let a = _mm256_srai_epi32::<1>(ni);
        let b = _mm256_sub_epi32(ni, a);
        let bias = _mm256_set1_epi32(127);
        let pa = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(a, bias)));
        let pb = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(b, bias)));
        _mm256_mul_ps(_mm256_mul_ps(e, pa), pb)
    }

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
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn isas() -> Vec<Isa> {
        Isa::available()
    }

    /// Within 2 units in the last place of the exact exponential over the whole
    /// domain (every 97th float from -104 to 0), and exact at 0.
    #[test]
    fn exp_is_within_two_ulp() {
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-0.0), 1.0);
        let mut x = -104.0f32;
        let mut worst = 0f64;
        while x < 0.0 {
            let got = f64::from(exp_nonpositive(x));
            let want = f64::from(x).exp();
            // One unit in the last place of the f32 nearest the exact value.
            let ulp = if want < f64::from(f32::MIN_POSITIVE) {
                f64::from(f32::from_bits(1))
            } else {
                let w = want as f32;
                f64::from(f32::from_bits(w.to_bits() + 1) - w)
            };
            worst = worst.max((got - want).abs() / ulp);
            x = f32::from_bits(x.to_bits() - 97);
        }
        assert!(worst <= 2.0, "{worst} ulp");
        assert!(exp_nonpositive(f32::NAN).is_nan());
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), exp_nonpositive(-104.0));
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
