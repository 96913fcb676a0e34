//! AVX-512 products over FP8 (e4m3) weights with block scales: DeepSeek-V3's and
//! Qwen3-FP8's linear layers.
//!
//! The tiles of `matmul.rs` widen e4m3 through F16 with a dozen instructions per
//! eight weights of a row (masks, shifts, a multiply by 2^8, a NaN blend, a scalar
//! scale lookup and a broadcast). Here two blocks of eight (sixteen bytes) cost
//! six instructions of sixteen lanes besides their two multiply-adds, and a scale
//! is looked up once per scale block:
//!
//! - the sixteen bytes sign-extended to 16-bit lanes;
//! - one shift by 7 and one mask (`0xbf80`) make the F16 whose value is the e4m3
//!   value times 2^-8, exactly, normals and subnormals alike (the sign at bit 15,
//!   the exponent and mantissa at bits 7..14 under F16's wider bias);
//! - one conversion to f32 (exact; F16 subnormals become f32 normals, so no
//!   multiply sees a subnormal input: placing e4m3 straight into f32 bits, which
//!   makes its subnormals f32 subnormals, ran a third slower on this EPYC in
//!   `matmul_bench --formats`, and such inputs cost some CPUs far more);
//! - NaN bytes (`0x7f`, `0xff`) found by one compare into a mask;
//! - one multiply by the block's scale times 2^8 (exact: a power of two), merged
//!   with NaN where the mask says: `e4m3 × scale` rounded once, the value
//!   [`WeightView::get`] defines. Where `scale × 2^8` would overflow, the block
//!   multiplies by 2^8 first and by the scale then: the same single rounding.
//!
//! (A scale block of eight columns, which no release has, takes its blocks one at
//! a time, the same way in eight lanes.) Measured with `matmul_bench --formats`
//! (5760x2880, the development machine's 2-vCPU EPYC, two threads): 1.2 ms a
//! product where the tiles took 1.55 ms.
//!
//! Each row keeps one 256-bit accumulator per token, as in `matmul_mxfp4.rs`; the
//! order of arithmetic per element is the module doc's of `matmul.rs`, and the
//! tail past the last block of eight is the tiles' (scalar, in increasing `k`).

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx2::hsum;
use super::{load1q, ScaleMap, WeightView, DT_FP8, PREFETCH_ROW};

/// An e4m3 value is its F16 placement ([`tile`]) times this.
const TWO_POW_8: f32 = 256.0;

/// One tile: rows `o0..o0 + R` x tokens `t0..t0 + T`.
///
/// # Safety
/// `w` is a checked FP8 view; rows `o0..o0 + R` are within `w.rows`, tokens
/// `t0..t0 + T` within `x` (`cols` each); `out` holds `n x w.rows` and this thread
/// owns the tile's elements; the CPU has what the AVX-512 tiles need.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
unsafe fn tile<const R: usize, const T: usize>(
    x: &[f32],
    w: &WeightView<'_>,
    o0: usize,
    t0: usize,
    out: *mut f32,
) {
    let cols = w.cols;
    let k8 = cols - cols % 8;
    let sm = ScaleMap::of(w);
    let wp: [*const u8; R] = std::array::from_fn(|r| {
        // SAFETY: row o0 + r < w.rows starts inside the checked bytes.
        unsafe { w.bytes.as_ptr().add((o0 + r) * cols) }
    });
    let sr: [*const u8; R] = std::array::from_fn(|r| sm.row(o0 + r));
    // SAFETY: token t0 + t < n starts inside `x` (n * cols elements).
    let xp: [*const f32; T] = std::array::from_fn(|t| unsafe { x.as_ptr().add((t0 + t) * cols) });
    let place = _mm_set1_epi16(0xbf80u16 as i16);
    let nan_bytes = _mm_set1_epi8(0x7f);
    let nan = _mm256_set1_ps(f32::NAN);
    let two_pow_8 = _mm256_set1_ps(TWO_POW_8);
    let block_cols = 1usize << sm.shift;
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut k = 0;
    while k < k8 {
        // One scale block's columns (at least eight: its blocks of eight share it).
        let end = ((k / block_cols + 1) * block_cols).min(k8);
        let mut scale = [_mm256_setzero_ps(); R];
        let mut fused = [true; R];
        for r in 0..R {
            // SAFETY: `sr[r]` is the row's scales, k < cols.
            let s = unsafe { sm.get::<DT_FP8>(sr[r], k) };
            let s8 = s * TWO_POW_8;
            fused[r] = s8.is_finite() || !s.is_finite();
            scale[r] = _mm256_set1_ps(if fused[r] { s8 } else { s });
        }
        let scale16: [__m512; R] = std::array::from_fn(|r| {
            _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(scale[r])))
        });
        // Two blocks of eight at a time (one 16-byte load, one conversion of
        // sixteen lanes), then the scale block's last eight if it has eight left.
        while k + 16 <= end {
            if k % 64 == 0 {
                for p in &wp {
                    // A prefetch is a hint that never faults, whatever the address.
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(k + PREFETCH_ROW).cast::<i8>());
                }
            }
            let xv: [[__m256; T]; 2] = std::array::from_fn(|h| {
                std::array::from_fn(|t| {
                    // SAFETY: k + 16 <= cols.
                    unsafe { _mm256_loadu_ps(xp[t].add(k + 8 * h)) }
                })
            });
            for r in 0..R {
                // SAFETY: the row's elements k..k+16 are in the checked bytes.
                let b = unsafe { _mm_loadu_si128(wp[r].add(k).cast()) };
                let h = _mm256_and_si256(
                    _mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(b)),
                    _mm256_set1_epi16(0xbf80u16 as i16),
                );
                let is_nan = _mm_cmpeq_epi8_mask(_mm_and_si128(b, nan_bytes), nan_bytes);
                let mut v = _mm512_cvtph_ps(h);
                if !fused[r] {
                    v = _mm512_mul_ps(v, _mm512_set1_ps(TWO_POW_8));
                }
                let wv = _mm512_mask_mul_ps(_mm512_set1_ps(f32::NAN), !is_nan, v, scale16[r]);
                let halves = [
                    _mm512_castps512_ps256(wv),
                    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(wv))),
                ];
                for (hv, xv) in halves.iter().zip(&xv) {
                    for t in 0..T {
                        acc[r][t] = _mm256_fmadd_ps(*hv, xv[t], acc[r][t]);
                    }
                }
            }
            k += 16;
        }
        while k < end {
            let xv: [__m256; T] = std::array::from_fn(|t| {
                // SAFETY: k + 8 <= cols.
                unsafe { _mm256_loadu_ps(xp[t].add(k)) }
            });
            for r in 0..R {
                // SAFETY: the row's elements k..k+8 are in the checked bytes.
                let b = unsafe { _mm_loadl_epi64(wp[r].add(k).cast()) };
                let h = _mm_and_si128(_mm_slli_epi16::<7>(_mm_cvtepi8_epi16(b)), place);
                let is_nan = _mm_cmpeq_epi8_mask(_mm_and_si128(b, nan_bytes), nan_bytes) as u8;
                let mut v = _mm256_cvtph_ps(h);
                if !fused[r] {
                    v = _mm256_mul_ps(v, two_pow_8);
                }
                let wv = _mm256_mask_mul_ps(nan, !is_nan, v, scale[r]);
                for t in 0..T {
                    acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
                }
            }
            k += 8;
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (t, &a) in acc.iter().enumerate() {
            let mut s = hsum(a);
            for kk in k8..cols {
                // SAFETY: kk < cols; `sr[r]` is the row's scales.
                let (wv, xv) = unsafe { (load1q::<DT_FP8>(wp[r], kk, &sm, sr[r]), *xp[t].add(kk)) };
                s = wv.mul_add(xv, s);
            }
            // SAFETY: (t0 + t, o0 + r) is within the output and owned by this thread.
            unsafe { out.add((t0 + t) * w.rows + o0 + r).write(s) };
        }
    }
}

/// Rows `rows` of `out = x · Wᵀ` for an FP8 `w`, in the tiles of `narrow_tiles!`.
///
/// # Safety
/// As `compute_rows` in `matmul.rs`, for a checked FP8 view, on a CPU where the
/// AVX-512 tiles run.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
pub(super) unsafe fn rows(
    x: &[f32],
    n: usize,
    w: &WeightView<'_>,
    rows: Range<usize>,
    out: *mut f32,
) {
    narrow_tiles!(tile, x, n, w, rows, out)
}

/// `out[i] = e4m3(b[i]) × scale` for a run of elements sharing one scale, sixteen
/// at a time as [`tile`] computes them (the F16 placement, one multiply by the
/// scale times 2^8, NaN merged by mask: [`WeightView::get`]'s values); returns how
/// many it did (a multiple of sixteen; the caller does the rest).
///
/// # Safety
/// `out.len() == b.len()`; the CPU has what the AVX-512 tiles need.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
pub(super) unsafe fn widen_run(b: &[u8], scale: f32, out: &mut [f32]) -> usize {
    let s8 = scale * TWO_POW_8;
    let fused = s8.is_finite() || !scale.is_finite();
    let sv = _mm512_set1_ps(if fused { s8 } else { scale });
    let nan_bytes = _mm_set1_epi8(0x7f);
    let n16 = b.len() - b.len() % 16;
    let mut i = 0;
    while i < n16 {
        // SAFETY: i + 16 <= b.len() == out.len().
        unsafe {
            let v8 = _mm_loadu_si128(b.as_ptr().add(i).cast());
            let h = _mm256_and_si256(
                _mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(v8)),
                _mm256_set1_epi16(0xbf80u16 as i16),
            );
            let is_nan = _mm_cmpeq_epi8_mask(_mm_and_si128(v8, nan_bytes), nan_bytes);
            let mut v = _mm512_cvtph_ps(h);
            if !fused {
                v = _mm512_mul_ps(v, _mm512_set1_ps(TWO_POW_8));
            }
            let wv = _mm512_mask_mul_ps(_mm512_set1_ps(f32::NAN), !is_nan, v, sv);
            _mm512_storeu_ps(out.as_mut_ptr().add(i), wv);
        }
        i += 16;
    }
    n16
}
