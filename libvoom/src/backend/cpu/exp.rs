//! The exponential of our own, used by softmax and SiLU: one definition, the
//! same operations in scalar and vector code, so its bits are the same on every
//! instruction set and every machine (not those of whatever `libm` the system
//! has).
//!
//! `x = n ln 2 + r`, `n` the nearest integer to `x log2(e)` (ties to even);
//! `e^r` by Cephes' `expf` polynomial; then `2^n` applied as two exact powers of
//! two, `2^a 2^b` with `a = floor(n / 2)`, so that a denormal result is rounded
//! once and an overflowing one becomes infinity. Inputs are first clamped to
//! `[LOWEST, HIGHEST]`, past which the result is already 0 (or the smallest
//! denormals) or infinity. Within 2 units in the last place of the exact value.

/// `log2(e)`, and `ln(2)` split into a part exact in few bits and the rest.
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Below this the exponential is 0 or the smallest denormals.
const LOWEST: f32 = -104.0;
/// Above `ln(f32::MAX)` (88.72) the exponential is infinite; clamping at 89 keeps
/// `n <= 128`, so each of the two powers of two stays a normal float.
const HIGHEST: f32 = 89.0;
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

/// `e^x` as the module defines it; a NaN gives NaN.
pub fn exp(x: f32) -> f32 {
    // Not `max`/`min`: a NaN stays NaN (as `_mm256_max_ps(LOWEST, x)` and
    // `_mm256_min_ps(HIGHEST, x)` keep it).
    let x = if x < LOWEST { LOWEST } else { x };
    let x = if x > HIGHEST { HIGHEST } else { x };
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

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// Eight [`exp`]s, with its operations.
    ///
    /// # Safety
    /// CPU has AVX2+FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp8(x: __m256) -> __m256 {
        // The second operand where either is NaN: a NaN stays NaN.
        let x = _mm256_max_ps(_mm256_set1_ps(LOWEST), x);
        let x = _mm256_min_ps(_mm256_set1_ps(HIGHEST), x);
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One unit in the last place of the f32 nearest `want`.
    fn ulp(want: f64) -> f64 {
        if want < f64::from(f32::MIN_POSITIVE) {
            f64::from(f32::from_bits(1))
        } else {
            let w = want as f32;
            f64::from(f32::from_bits(w.to_bits() + 1) - w)
        }
    }

    /// Within 2 units in the last place of the exact exponential over the whole
    /// finite range (every 97th float from -104 to 88.7), exact at 0, infinite past
    /// `ln(f32::MAX)`, and a NaN stays NaN.
    #[test]
    fn exp_is_within_two_ulp() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        let mut worst = 0f64;
        let mut check = |x: f32| {
            let (got, want) = (f64::from(exp(x)), f64::from(x).exp());
            worst = worst.max((got - want).abs() / ulp(want));
        };
        let mut x = -104.0f32;
        while x < 0.0 {
            check(x);
            x = f32::from_bits(x.to_bits() - 97);
        }
        let mut x = f32::from_bits(1);
        while x < 88.72 {
            check(x);
            x = f32::from_bits(x.to_bits() + 97);
        }
        assert!(worst <= 2.0, "{worst} ulp");
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(f32::NEG_INFINITY), exp(-104.0));
        for x in [88.73f32, 89.0, 1e6, f32::INFINITY] {
            assert_eq!(exp(x), f32::INFINITY, "{x}");
        }
    }

    /// The vector code gives the scalar code's bits, NaN and the ends included.
    #[test]
    fn vector_exp_has_the_scalar_bits() {
        #[cfg(target_arch = "x86_64")]
        if crate::backend::cpu::matmul::Isa::available()
            .contains(&crate::backend::cpu::matmul::Isa::Avx2)
        {
            use std::arch::x86_64::*;
            let mut x = -120.0f32;
            let mut xs = vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0];
            while x < 100.0 {
                xs.push(x);
                x += 0.0137;
            }
            for c in xs.chunks(8).filter(|c| c.len() == 8) {
                let mut out = [0f32; 8];
                // SAFETY: AVX2 is available (checked above); eight floats read from
                // and written to arrays of eight.
                unsafe {
                    _mm256_storeu_ps(out.as_mut_ptr(), avx2::exp8(_mm256_loadu_ps(c.as_ptr())))
                };
                for (&x, &o) in c.iter().zip(&out) {
                    assert_eq!(o.to_bits(), exp(x).to_bits(), "{x}");
                }
            }
        }
    }
}
