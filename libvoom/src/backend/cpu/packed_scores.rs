//! AVX-512 attention scores over a transposed block of keys.
//!
//! A task's rows go through its keys a block at a time (`attention.rs`). Where
//! many rows share a block, its keys are transposed once into `kt[d][block]`
//! (`block` the most keys of a block), so
//! that one 512-bit register holds one dimension of sixteen keys, and each row's
//! query element is broadcast against it. A score keeps the order of
//! [`super::matmul::dot_f32`]: its eight lanes (the dimensions `≡ l mod 8`) are
//! eight registers, each one fused multiply-add a dimension in increasing order
//! from `+0.0`; the fixed reduction adds the same lanes in the same order across
//! registers instead of within one; the tail follows, then the scale. So the bits
//! are those of the one-row kernels, without a horizontal sum per score.

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::ops::Range;

use super::matmul::transpose16;

/// Lanes of a register: keys scored together.
const LANES: usize = 16;

/// Rows a micro-kernel call carries: eight lanes each, 24 accumulators.
const ROWS: usize = 3;

thread_local! {
    /// The transposed block, per thread.
    static KT: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's scratch for a transposed block of at most `block`
/// keys of `d` floats: `d * block` floats and a register's slack (loads past the
/// last key of a row).
pub(super) fn with_block<R>(d: usize, block: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    KT.with(|kt| {
        let mut kt = kt.borrow_mut();
        let need = d * block + LANES;
        if kt.len() < need {
            kt.resize(need, 0.0);
        }
        f(&mut kt[..need])
    })
}

/// `kt[e * block + j] = keys[j][e]` for `j < keys.len()` and `e < d`.
///
/// # Safety
/// The CPU has AVX-512 F/VL/BW with AVX2 and FMA; `keys.len() <= block`, each
/// pointer valid for `d` floats; `kt` holds `d * block` floats.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
pub(super) unsafe fn transpose(keys: &[*const f32], d: usize, block: usize, kt: &mut [f32]) {
    debug_assert!(keys.len() <= block && kt.len() >= d * block);
    let m = keys.len();
    let out = kt.as_mut_ptr();
    let mut j0 = 0;
    while j0 < m {
        let jn = (m - j0).min(LANES);
        let mut e = 0;
        if jn == LANES {
            while e + LANES <= d {
                // SAFETY: keys j0..j0+16 hold d floats each, e + 16 <= d; the
                // stores are rows e..e+16 of kt, columns j0..j0+16 <= block.
                unsafe {
                    let mut v: [__m512; LANES] =
                        std::array::from_fn(|c| _mm512_loadu_ps(keys[j0 + c].add(e)));
                    transpose16(&mut v);
                    for (c, vc) in v.iter().enumerate() {
                        _mm512_storeu_ps(out.add((e + c) * block + j0), *vc);
                    }
                }
                e += LANES;
            }
        }
        for ee in e..d {
            for (j, key) in keys.iter().enumerate().skip(j0).take(jn) {
                // SAFETY: key j holds d floats; (ee, j) is within kt.
                unsafe { out.add(ee * block + j).write(*key.add(ee)) };
            }
        }
        j0 += jn;
    }
}

/// `s[r][j - keys.start] = dot_f32(q[r], key_j) * scale` for the block's keys
/// `keys`, transposed in `kt` with rows of `block` ([`transpose`]).
///
/// # Safety
/// The CPU has AVX-512 F/VL/BW with AVX2 and FMA; every `q[r]` has `d` floats and
/// every `s[r]` `keys.len()`; `keys.end <= block`; `kt` is a transposed block of
/// `d`-float keys covering `keys.end` keys, with [`with_block`]'s slack.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
pub(super) unsafe fn scores(
    q: &[&[f32]],
    kt: &[f32],
    d: usize,
    block: usize,
    keys: Range<usize>,
    scale: f32,
    s: &mut [&mut [f32]],
) {
    debug_assert!(keys.end <= block && kt.len() >= d * block + LANES);
    let vscale = _mm512_set1_ps(scale);
    let mut r = 0;
    while r < q.len() {
        let rn = (q.len() - r).min(ROWS);
        let mut j = keys.start;
        while j < keys.end {
            let lanes = (keys.end - j).min(LANES);
            let mask: __mmask16 = if lanes == LANES {
                !0
            } else {
                (1u16 << lanes) - 1
            };
            let out = Out {
                at: j - keys.start,
                mask,
            };
            // SAFETY: rows r..r+rn exist; lanes j..j+16 of every kt row are within
            // kt (its slack covers the last row), and only `lanes` scores, within
            // each s row, are stored.
            unsafe {
                let kp = kt.as_ptr().add(j);
                match rn {
                    3 => micro::<3>(kp, d, block, &q[r..r + 3], vscale, &mut s[r..r + 3], out),
                    2 => micro::<2>(kp, d, block, &q[r..r + 2], vscale, &mut s[r..r + 2], out),
                    _ => micro::<1>(kp, d, block, &q[r..r + 1], vscale, &mut s[r..r + 1], out),
                }
            }
            j += lanes;
        }
        r += rn;
    }
}

/// Where a micro-kernel's sixteen scores go in each row: from `at`, the lanes of
/// `mask`.
#[derive(Clone, Copy)]
struct Out {
    at: usize,
    mask: __mmask16,
}

/// `Q` rows' scores of the sixteen keys at `kp` (a column of the transposed
/// block, rows `block` apart), stored where `out` says.
///
/// # Safety
/// As [`scores`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
// Indexed loops: constant indices once unrolled keep the accumulators in registers.
#[allow(clippy::needless_range_loop)]
unsafe fn micro<const Q: usize>(
    kp: *const f32,
    d: usize,
    block: usize,
    q: &[&[f32]],
    vscale: __m512,
    s: &mut [&mut [f32]],
    out: Out,
) {
    let d8 = d - d % 8;
    let qp: [*const f32; Q] = std::array::from_fn(|r| q[r].as_ptr());
    let mut acc = [[_mm512_setzero_ps(); 8]; Q];
    // SAFETY: the caller's contract covers kt rows 0..d at these lanes and q's d
    // floats.
    unsafe {
        let mut e = 0;
        while e < d8 {
            for l in 0..8 {
                let kv = _mm512_loadu_ps(kp.add((e + l) * block));
                for r in 0..Q {
                    let qv = _mm512_set1_ps(*qp[r].add(e + l));
                    acc[r][l] = _mm512_fmadd_ps(kv, qv, acc[r][l]);
                }
            }
            e += 8;
        }
        for r in 0..Q {
            let a = &acc[r];
            let h0 = _mm512_add_ps(a[0], a[4]);
            let h1 = _mm512_add_ps(a[1], a[5]);
            let h2 = _mm512_add_ps(a[2], a[6]);
            let h3 = _mm512_add_ps(a[3], a[7]);
            let mut sum = _mm512_add_ps(_mm512_add_ps(h0, h2), _mm512_add_ps(h1, h3));
            for ee in d8..d {
                let kv = _mm512_loadu_ps(kp.add(ee * block));
                sum = _mm512_fmadd_ps(kv, _mm512_set1_ps(*qp[r].add(ee)), sum);
            }
            let v = _mm512_mul_ps(sum, vscale);
            _mm512_mask_storeu_ps(s[r].as_mut_ptr().add(out.at), out.mask, v);
        }
    }
}
