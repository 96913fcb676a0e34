//! The MLX backend (feature `mlx`): MLX linked from its official Python wheels
//! (`build.rs`), called through a small C++ shim (`shim.cpp`: C ABI, exceptions
//! caught). This is its first piece: the link and one product, checked against
//! the CPU backend's; the backend interface ([`crate::backend::Backend`]) follows.

use std::ffi::{c_char, c_int, CStr};

use crate::backend::KernelError;

extern "C" {
    fn voom_mlx_version() -> *const c_char;
    fn voom_mlx_matmul_bf16(
        x: *const f32,
        n: c_int,
        k: c_int,
        w: *const u16,
        m: c_int,
        out: *mut f32,
        err: *mut c_char,
        errlen: c_int,
    ) -> c_int;
}

/// The version of the MLX linked ("0.32.4").
pub fn version() -> String {
    // SAFETY: the shim returns a pointer to a static NUL-terminated string.
    unsafe { CStr::from_ptr(voom_mlx_version()) }
        .to_string_lossy()
        .into_owned()
}

/// `x · wᵀ`: `x` is `n × k` f32, `w` is `m × k` BF16 bits (row-major, as stored);
/// the result `n × m` f32, computed by MLX on its default device.
pub fn matmul_bf16(x: &[f32], n: usize, w: &[u16], m: usize) -> Result<Vec<f32>, KernelError> {
    let k = x.len().checked_div(n).unwrap_or(0);
    let too_big = |v: usize| c_int::try_from(v).is_err();
    if n == 0 || x.len() != n * k || w.len() != m * k || too_big(n) || too_big(k) || too_big(m) {
        return Err(KernelError::ActivationLen {
            what: "MLX product input",
            actual: x.len(),
            n,
            per_token: k,
            expected: n * (w.len() / m.max(1)),
        });
    }
    let mut out = vec![0f32; n * m];
    let mut err = [0 as c_char; 512];
    // SAFETY: every pointer is to a live buffer of the length passed (checked
    // above); the shim writes `n * m` floats to `out` and at most `err.len()` bytes
    // (NUL-terminated) to `err`, and keeps no pointer after it returns.
    let rc = unsafe {
        voom_mlx_matmul_bf16(
            x.as_ptr(),
            n as c_int,
            k as c_int,
            w.as_ptr(),
            m as c_int,
            out.as_mut_ptr(),
            err.as_mut_ptr(),
            err.len() as c_int,
        )
    };
    if rc != 0 {
        // SAFETY: the shim NUL-terminated the message within the buffer.
        let why = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy();
        return Err(KernelError::Backend(format!("MLX: {why}")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// MLX's product of BF16 weights and f32 activations is within f32 rounding of
    /// the exact one (computed in f64): the link works and the layouts agree.
    #[test]
    fn mlx_multiplies_bf16_weights_as_stored() {
        assert!(!version().is_empty());
        let (n, k, m) = (3, 70, 5);
        let x: Vec<f32> = (0..n * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let w: Vec<u16> = (0..m * k)
            .map(|i| half::bf16::from_f32(((i * 53 % 89) as f32 - 44.0) / 30.0).to_bits())
            .collect();
        let got = matmul_bf16(&x, n, &w, m).unwrap();
        for r in 0..n {
            for c in 0..m {
                let want: f64 = (0..k)
                    .map(|i| {
                        f64::from(x[r * k + i])
                            * f64::from(half::bf16::from_bits(w[c * k + i]).to_f32())
                    })
                    .sum();
                let g = f64::from(got[r * m + c]);
                assert!(
                    (g - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "{r},{c}: {g} vs {want}"
                );
            }
        }
        assert!(matmul_bf16(&x, n, &w[1..], m).is_err());
    }
}
