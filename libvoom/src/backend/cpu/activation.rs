//! Gated activations, with the exponential of [`exp`](super::exp) so their bits
//! are the same on every instruction set.

use super::exp::exp;
use super::matmul::Isa;

/// `gate = silu(gate) * up`, with `silu(x) = x / (1 + e^-x)`: for each element,
/// `-x` (a sign flip), [`exp`], `1 + e`, the division, then the product, in f32.
pub fn silu_mul(isa: Isa, gate: &mut [f32], up: &[f32]) {
    assert_eq!(
        gate.len(),
        up.len(),
        "silu_mul: gate and up differ in length"
    );
    let done = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is AVX2 or AVX-512 only where the CPU has AVX2 and FMA
        // (`Isa::detect`, or a caller that checked).
        Isa::Avx512 | Isa::Avx2 => unsafe { avx2::silu_mul(gate, up) },
        _ => 0,
    };
    for (g, &u) in gate[done..].iter_mut().zip(&up[done..]) {
        let s = *g / (1.0 + exp(-*g));
        *g = s * u;
    }
}

/// gpt-oss's clamped SwiGLU ([`crate::backend::Activation::ClampedSwiglu`]), for
/// each element in f32 as transformers computes it: `g = min(gate, limit)`, `u =
/// clamp(up, -limit, limit)` (NaN kept), `y = g * alpha`, `s = 1 / (1 + exp(-y))`
/// ([`exp`]), then `gate = (u + 1) * (g * s)`.
pub fn clamped_swiglu(gate: &mut [f32], up: &[f32], alpha: f32, limit: f32) {
    assert_eq!(
        gate.len(),
        up.len(),
        "clamped_swiglu: gate and up differ in length"
    );
    for (x, &u) in gate.iter_mut().zip(up) {
        let g = if *x > limit { limit } else { *x };
        let u = if u > limit {
            limit
        } else if u < -limit {
            -limit
        } else {
            u
        };
        let s = 1.0 / (1.0 + exp(-(g * alpha)));
        *x = (u + 1.0) * (g * s);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::exp::avx2::exp8;
    use std::arch::x86_64::*;

    /// [`super::silu_mul`] over the whole chunks of eight; returns how many it did.
    ///
    /// # Safety
    /// CPU has AVX2+FMA; `gate.len() == up.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) -> usize {
        let n8 = gate.len() - gate.len() % 8;
        let (sign, one) = (_mm256_set1_ps(-0.0), _mm256_set1_ps(1.0));
        let mut j = 0;
        while j < n8 {
            // SAFETY: j + 8 <= n8 <= gate.len() == up.len().
            unsafe {
                let p = gate.as_mut_ptr().add(j);
                let g = _mm256_loadu_ps(p);
                let e = exp8(_mm256_xor_ps(g, sign));
                let s = _mm256_div_ps(g, _mm256_add_ps(one, e));
                _mm256_storeu_ps(p, _mm256_mul_ps(s, _mm256_loadu_ps(up.as_ptr().add(j))));
            }
            j += 8;
        }
        n8
    }
}

#[cfg(test)]
mod tests {

    /// The clamped SwiGLU: transformers' formula in f64 to f32 rounding, the clamps
    /// where they bite (gate above the limit, up beyond it either way), NaN kept.
    #[test]
    fn clamped_swiglu_is_gpt_oss_gate() {
        let (alpha, limit) = (1.702f32, 7.0f32);
        let gates = [-9.0f32, -3.0, -0.5, 0.0, 0.25, 2.0, 6.9, 7.5, 20.0];
        let ups = [-12.0f32, -7.5, -1.0, 0.0, 0.5, 3.0, 7.0, 9.0, 100.0];
        let mut g = gates.to_vec();
        super::clamped_swiglu(&mut g, &ups, alpha, limit);
        for ((&got, &x), &u) in g.iter().zip(&gates).zip(&ups) {
            let x = f64::from(x.min(limit));
            let u = f64::from(u.clamp(-limit, limit));
            let want = (u + 1.0) * x / (1.0 + (-x * f64::from(alpha)).exp());
            assert!(
                (f64::from(got) - want).abs() <= 1e-6 * want.abs().max(1e-6),
                "{x}, {u}: {got} vs {want}"
            );
        }
        let mut n = vec![f32::NAN, 1.0];
        super::clamped_swiglu(&mut n, &[1.0, f32::NAN], alpha, limit);
        assert!(n[0].is_nan() && n[1].is_nan());
    }
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Near the exact SiLU product, the same bits on every instruction set for
    /// every length, and the ends: 0 at 0, `x * up` far right, -0 far left.
    #[test]
    fn silu_mul_has_one_definition() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for n in [1usize, 7, 8, 9, 31, 1536] {
            let g: Vec<f32> = (0..n).map(|_| rng.gen_range(-120.0..120.0)).collect();
            let u: Vec<f32> = (0..n).map(|_| rng.gen_range(-3.0..3.0)).collect();
            let mut outs = Vec::new();
            for isa in Isa::available() {
                let mut x = g.clone();
                silu_mul(isa, &mut x, &u);
                for ((&x, &g), &u) in x.iter().zip(&g).zip(&u) {
                    let (g, u) = (f64::from(g), f64::from(u));
                    let want = g / (1.0 + (-g).exp()) * u;
                    assert!(
                        (f64::from(x) - want).abs() <= 1e-6 * want.abs() + 1e-30,
                        "{g} {u}"
                    );
                }
                outs.push(x.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            }
            assert!(outs.windows(2).all(|w| w[0] == w[1]), "{n}: differs by ISA");
        }
        for isa in Isa::available() {
            let mut x = vec![0.0f32, 200.0, -200.0, f32::NAN, 1.0, 0.0, 0.0, 0.0, 0.0];
            silu_mul(isa, &mut x, &[2.0; 9]);
            assert_eq!(x[0], 0.0);
            assert_eq!(x[1], 400.0);
            assert_eq!(x[2].to_bits(), (-0.0f32).to_bits());
            assert!(x[3].is_nan());
        }
    }
}
