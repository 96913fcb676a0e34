//! The matrix product's tiles and dot products on aarch64 with NEON (Advanced SIMD,
//! part of every aarch64 CPU): each eight-lane accumulator of the module doc is two
//! 128-bit registers (lanes 0..4, lanes 4..8), updated with fused multiply-adds
//! (`fmla`), reduced in the fixed order (`h = lanes 0..4 + lanes 4..8`, then
//! `(h0 + h2) + (h1 + h3)`), the tail fused in increasing order. So every element
//! has the portable path's bits, and the x86 paths'. Weights are widened exactly:
//! BF16 by a shift into the high half (`shll`), F16 by `fcvtl`.
//!
//! With 32 registers, the tiles are 4 rows x 2 tokens for decode (16 accumulator
//! registers, 8 of weights, 2 of activations) and 3 x 3 for prefill (18 + 6 + 2).

use super::*;
use std::arch::aarch64::*;
use std::arch::asm;

/// Rows x tokens of the tiles for an `n`-token call (the module doc).
#[inline(always)]
fn neon_tile_shape(n: usize) -> (usize, usize) {
    if n <= 2 {
        (4, 2)
    } else {
        (3, 3)
    }
}

/// Four F16 values widened exactly to f32 (`fcvtl`: NaNs quieted, as F16C and the
/// portable path do).
#[inline(always)]
fn f16x4(h: uint16x4_t) -> float32x4_t {
    let out: float32x4_t;
    // SAFETY: `fcvtl` reads one register and writes another; no memory, no flags.
    unsafe {
        asm!(
            "fcvtl {o:v}.4s, {i:v}.4h",
            o = lateout(vreg) out,
            i = in(vreg) h,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    out
}

/// Eight weights at `p` as f32, exactly: lanes 0..4 and 4..8.
///
/// # Safety
/// `p` is valid for reads of 8 elements of `DT` (no alignment needed: byte loads).
#[inline(always)]
unsafe fn load8<const DT: u8>(p: *const u8) -> (float32x4_t, float32x4_t) {
    // SAFETY: the caller guarantees 8 readable elements (16 or 32 bytes); `vld1q_u8`
    // needs no alignment.
    unsafe {
        if DT == DT_F32 {
            (
                vreinterpretq_f32_u8(vld1q_u8(p)),
                vreinterpretq_f32_u8(vld1q_u8(p.add(16))),
            )
        } else {
            let h = vreinterpretq_u16_u8(vld1q_u8(p));
            if DT == DT_BF16 {
                (
                    vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(h))),
                    vreinterpretq_f32_u32(vshll_high_n_u16::<16>(h)),
                )
            } else {
                (f16x4(vget_low_u16(h)), f16x4(vget_high_u16(h)))
            }
        }
    }
}

/// Eight weights of code `DT` from element `k` of the row at `row` (its scales at
/// `srow`), as f32: [`load8`] for a plain weight; FP8 bytes placed in F16 bit
/// positions (every e4m3 value scaled by 2^-8 exactly), widened by `fcvtl`, times
/// 2^8, `0x7f`/`0xff` set to NaN, then times the block's scale (one rounding);
/// MXFP4 nibbles looked up as F16 bits (`tbl`) and widened, times 2^(e - 127).
/// The x86 paths' values, bit for bit.
///
/// # Safety
/// `row` a row of a checked view of code `DT`, `srow` its scales, `k + 8 <= cols`.
#[inline(always)]
unsafe fn load8q<const DT: u8>(
    row: *const u8,
    k: usize,
    sm: &ScaleMap,
    srow: *const u8,
) -> (float32x4_t, float32x4_t) {
    // SAFETY: the caller guarantees the eight elements and their scale; byte loads
    // need no alignment.
    unsafe {
        match DT {
            DT_FP8 => {
                let b = vmovl_u8(vld1_u8(row.add(k)));
                let mag = vandq_u16(b, vdupq_n_u16(0x7f));
                let sign = vshlq_n_u16::<8>(vandq_u16(b, vdupq_n_u16(0x80)));
                let h = vorrq_u16(sign, vshlq_n_u16::<7>(mag));
                let nan = vceqq_u16(mag, vdupq_n_u16(0x7f));
                let two8 = vdupq_n_f32(256.0);
                let s = vdupq_n_f32(sm.get::<DT>(srow, k));
                let one = |h: uint16x4_t, nan: uint16x4_t| {
                    let v = vmulq_f32(f16x4(h), two8);
                    // Sign-extended: all ones where NaN.
                    let all = vreinterpretq_u32_s32(vmovl_s16(vreinterpret_s16_u16(nan)));
                    let v = vbslq_f32(all, vdupq_n_f32(f32::NAN), v);
                    vmulq_f32(v, s)
                };
                (
                    one(vget_low_u16(h), vget_low_u16(nan)),
                    one(vget_high_u16(h), vget_high_u16(nan)),
                )
            }
            DT_MXFP4 => {
                let x = row.add(k / 2).cast::<u32>().read_unaligned();
                let lo = vcreate_u8(u64::from(x & 0x0f0f_0f0f));
                let hi = vcreate_u8(u64::from((x >> 4) & 0x0f0f_0f0f));
                let idx = vzip1_u8(lo, hi);
                let high = vqtbl1_u8(vld1q_u8(E2M1_F16_HIGH_BYTES.as_ptr()), idx);
                let h = vshll_n_u8::<8>(high);
                let s = vdupq_n_f32(sm.get::<DT>(srow, k));
                (
                    vmulq_f32(f16x4(vget_low_u16(h)), s),
                    vmulq_f32(f16x4(vget_high_u16(h)), s),
                )
            }
            _ => load8::<DT>(row.add(k_bytes(DT, k))),
        }
    }
}

/// Eight activations at `p`.
///
/// # Safety
/// `p` is valid for reads of 8 floats.
#[inline(always)]
unsafe fn load8_f32(p: *const f32) -> (float32x4_t, float32x4_t) {
    // SAFETY: the caller guarantees 8 readable floats.
    unsafe { (vld1q_f32(p), vld1q_f32(p.add(4))) }
}

/// The fixed reduction of an eight-lane accumulator (step 2 of the module doc).
#[inline(always)]
fn hsum(a: (float32x4_t, float32x4_t)) -> f32 {
    // SAFETY: lane arithmetic on registers only.
    unsafe {
        let h = vaddq_f32(a.0, a.1);
        (vgetq_lane_f32::<0>(h) + vgetq_lane_f32::<2>(h))
            + (vgetq_lane_f32::<1>(h) + vgetq_lane_f32::<3>(h))
    }
}

/// One tile: rows `o0..o0+R` x tokens `t0..t0+T`.
///
/// # Safety
/// As [`compute_rows`], with `o0 + R <= w.rows` and `t0 + T <= n`.
#[inline]
unsafe fn tile<const DT: u8, const R: usize, const T: usize>(
    x: &[f32],
    w: &WeightView<'_>,
    o0: usize,
    t0: usize,
    out: *mut f32,
) {
    let cols = w.cols;
    let k8 = cols - cols % 8;
    let wp: [*const u8; R] = std::array::from_fn(|r| {
        // SAFETY: row o0 + r < w.rows starts inside the checked bytes.
        unsafe { w.bytes.as_ptr().add((o0 + r) * k_bytes(DT, cols)) }
    });
    let sm = ScaleMap::of(w);
    let sr: [*const u8; R] = std::array::from_fn(|r| sm.row(o0 + r));
    let xp: [*const f32; T] = std::array::from_fn(|t| {
        // SAFETY: token t0 + t < n starts inside `x` (n * cols elements).
        unsafe { x.as_ptr().add((t0 + t) * cols) }
    });
    // SAFETY: register arithmetic; every load below is at k + 8 <= cols within a
    // row of `cols` elements.
    unsafe {
        let z = vdupq_n_f32(0.0);
        let mut acc = [[(z, z); T]; R];
        let mut k = 0;
        while k < k8 {
            let mut wv = [(z, z); R];
            for r in 0..R {
                wv[r] = load8q::<DT>(wp[r], k, &sm, sr[r]);
            }
            for t in 0..T {
                let xv = load8_f32(xp[t].add(k));
                for r in 0..R {
                    acc[r][t].0 = vfmaq_f32(acc[r][t].0, wv[r].0, xv.0);
                    acc[r][t].1 = vfmaq_f32(acc[r][t].1, wv[r].1, xv.1);
                }
            }
            k += 8;
        }
        for r in 0..R {
            for t in 0..T {
                let mut s = hsum(acc[r][t]);
                for kk in k8..cols {
                    s = load1q::<DT>(wp[r], kk, &sm, sr[r]).mul_add(*xp[t].add(kk), s);
                }
                // SAFETY: (t0+t, o0+r) is within the output and owned by this thread.
                out.add((t0 + t) * w.rows + o0 + r).write(s);
            }
        }
    }
}

/// # Safety
/// As [`compute_rows`].
pub(super) unsafe fn rows<const DT: u8>(
    x: &[f32],
    n: usize,
    w: &WeightView<'_>,
    rows: Range<usize>,
    out: *mut f32,
) {
    tile_rows!(tile, neon_tile_shape, DT, x, n, w, rows, out)
}

/// [`dot_f32`] on NEON (the same bits).
pub(super) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut out = 0.0f32;
    let w = WeightView {
        lease: None,
        format: crate::backend::view::WeightFormat::Plain(DType::F32),
        rows: 1,
        cols: a.len(),
        // SAFETY: reinterpreting initialised f32s as bytes (alignment 1, same length
        // in bytes, same lifetime).
        bytes: unsafe {
            std::slice::from_raw_parts(a.as_ptr().cast::<u8>(), std::mem::size_of_val(a))
        },
    };
    // SAFETY: one row of `a.len() == b.len()` elements, one token, one output.
    unsafe { tile::<DT_F32, 1, 1>(b, &w, 0, 0, &mut out) };
    out
}

/// `y[i] = fma(a, x[i], y[i])`, four lanes at a time (element-wise: the bits of the
/// scalar loop).
pub(super) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    let len = y.len().min(x.len());
    let k4 = len - len % 4;
    // SAFETY: every access is at k + 4 <= len of both slices.
    unsafe {
        let av = vdupq_n_f32(a);
        let mut k = 0;
        while k < k4 {
            let yp = y.as_mut_ptr().add(k);
            vst1q_f32(
                yp,
                vfmaq_f32(vld1q_f32(yp), av, vld1q_f32(x.as_ptr().add(k))),
            );
            k += 4;
        }
    }
    for kk in k4..len {
        y[kk] = a.mul_add(x[kk], y[kk]);
    }
}
