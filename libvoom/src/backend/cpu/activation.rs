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
