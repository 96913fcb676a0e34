//! Dequantization of ggml tensor types to f32, exactly as ggml's reference
//! `dequantize_row_*` (ggml-quants.c) computes it, bit for bit: each f16 scale is
//! converted to f32 exactly, then per element `y = d * q`, `y = d * q + m` or (the
//! k-quants) `y = (d * sc) * q - dmin * m`, in f32 and in ggml's order. Every product
//! is exact in f32 (its factors are integers and f16 significands of at most 23 bits
//! together, well inside f32's range), so the result has at most one rounding, that
//! of the sum, and does not depend on fused multiply-add. Each type's comment gives
//! its block struct, formula and rounding. The `gguf` Python package computes the
//! same values.
//!
//! Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K,
//! Q6_K, IQ4_NL, IQ4_XS, MXFP4.

use super::GgmlType;
use crate::dtype::{bf16_to_f32, f16_to_f32};

/// Why a buffer could not be dequantized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    /// vOOM has no dequantizer for this type.
    #[error("dequantization of ggml type {0} is not supported")]
    Unsupported(GgmlType),
    /// The element count is not a whole number of blocks.
    #[error("{n_elements} elements are not a whole number of {ty} blocks of {block}")]
    PartialBlock {
        ty: GgmlType,
        n_elements: usize,
        block: usize,
    },
    /// The byte buffer does not hold exactly the given number of elements.
    #[error("{n_elements} elements of {ty} take {expected} bytes, got {actual}")]
    Length {
        ty: GgmlType,
        n_elements: usize,
        expected: usize,
        actual: usize,
    },
}

/// Dequantizes `n_elements` elements of type `ty` held in `bytes` (which must be
/// exactly their size) to f32, in ggml element order.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n_elements: usize) -> Result<Vec<f32>, DequantError> {
    check(ty, bytes, n_elements)?;
    let mut out = vec![0f32; n_elements];
    dequantize_into(ty, bytes, &mut out)?;
    Ok(out)
}

/// Like [`dequantize`], writing into `out` (whose length is the element count).
pub fn dequantize_into(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    check(ty, bytes, out.len())?;
    match ty {
        GgmlType::F32 => {
            for (y, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *y = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (y, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *y = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        GgmlType::BF16 => {
            for (y, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *y = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        // block_q8_0 { f16 d; i8 qs[32]; }: y = q*d. Exact (8 + 11 bits): no rounding.
        GgmlType::Q8_0 => {
            for (y, b) in blocks(ty, out, bytes) {
                let d = f16_at(b, 0);
                for (yj, &q) in y.iter_mut().zip(&b[2..34]) {
                    *yj = (q as i8) as f32 * d;
                }
            }
        }
        // block_q4_0 { f16 d; u8 qs[16]; }: low nibbles are elements 0..16, high
        // nibbles 16..32, both offset by 8; y = (q - 8)*d. Exact: no rounding.
        GgmlType::Q4_0 => {
            for (y, b) in blocks(ty, out, bytes) {
                let d = f16_at(b, 0);
                let (lo, hi) = y.split_at_mut(16);
                for j in 0..16 {
                    let q = b[2 + j];
                    lo[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
                    hi[j] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        // block_q4_1 { f16 d; f16 m; u8 qs[16]; }: y = q*d + m, q unsigned.
        GgmlType::Q4_1 => {
            for (y, b) in blocks(ty, out, bytes) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                let (lo, hi) = y.split_at_mut(16);
                for j in 0..16 {
                    let q = b[4 + j];
                    // q*d is exact (4-bit q times an 11-bit f16 significand), so the only
                    // rounding is that of the sum, fused or not.
                    lo[j] = (q & 0x0f) as f32 * d + m;
                    hi[j] = (q >> 4) as f32 * d + m;
                }
            }
        }
        // block_q5_0 { f16 d; u8 qh[4]; u8 qs[16]; }: element j (< 16) is the low nibble
        // of qs[j] with bit j of the little-endian u32 qh as its fifth bit, element
        // 16 + j the high nibble with bit 16 + j; y = (q - 16)*d. Exact (5 + 11 bits):
        // no rounding.
        GgmlType::Q5_0 => {
            for (y, b) in blocks(ty, out, bytes) {
                let d = f16_at(b, 0);
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                let (lo, hi) = y.split_at_mut(16);
                for j in 0..16 {
                    let (q0, q1) = q5_pair(qh, b[6 + j], j);
                    lo[j] = (q0 as i32 - 16) as f32 * d;
                    hi[j] = (q1 as i32 - 16) as f32 * d;
                }
            }
        }
        // block_q5_1 { f16 d; f16 m; u8 qh[4]; u8 qs[16]; }: q as in Q5_0 but unsigned;
        // y = q*d + m. q*d is exact (5 + 11 bits); the sum is the one rounding.
        GgmlType::Q5_1 => {
            for (y, b) in blocks(ty, out, bytes) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
                let (lo, hi) = y.split_at_mut(16);
                for j in 0..16 {
                    let (q0, q1) = q5_pair(qh, b[8 + j], j);
                    lo[j] = q0 as f32 * d + m;
                    hi[j] = q1 as f32 * d + m;
                }
            }
        }
        // block_q2_K { u8 scales[16]; u8 qs[64]; f16 d; f16 dmin; }: 16 groups of 16;
        // group g has scale sc = scales[g] & 15 and min mn = scales[g] >> 4. Element e
        // (n = e/128, s = (e%128)/32, l = e%32) is q = (qs[32n + l] >> 2s) & 3 and
        // y = (d*sc)*q - dmin*mn. d*sc (15 bits), (d*sc)*q (17 bits) and dmin*mn are
        // exact; the subtraction is the one rounding.
        GgmlType::Q2_K => {
            for (y, b) in blocks(ty, out, bytes) {
                let (scales, qs) = (&b[0..16], &b[16..80]);
                let d = f16_at(b, 80);
                let min = f16_at(b, 82);
                let mut y = y.iter_mut();
                let mut is = 0;
                for q in qs.chunks_exact(32) {
                    for shift in [0, 2, 4, 6] {
                        for half in [&q[..16], &q[16..]] {
                            let sc = scales[is];
                            is += 1;
                            let dl = d * (sc & 0x0f) as f32;
                            let ml = min * (sc >> 4) as f32;
                            for &ql in half {
                                *y.next().unwrap() = dl * ((ql >> shift) & 3) as f32 - ml;
                            }
                        }
                    }
                }
            }
        }
        // block_q3_K { u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d; }: 16 groups of
        // 16 with 6-bit scales (see `q3_k_scale`), offset by 32. Element e (n = e/128,
        // s = (e%128)/32, l = e%32) has low bits (qs[32n + l] >> 2s) & 3, less 4 when
        // bit 4n + s of hmask[l] is clear; y = (d*(sc - 32))*q. Exact (11 + 5 + 2 bits):
        // no rounding.
        GgmlType::Q3_K => {
            for (y, b) in blocks(ty, out, bytes) {
                let (hmask, qs) = (&b[0..32], &b[32..96]);
                let scales: &[u8; 12] = b[96..108].try_into().unwrap();
                let d_all = f16_at(b, 108);
                let mut y = y.iter_mut();
                let mut is = 0;
                let mut m = 1u8;
                for q in qs.chunks_exact(32) {
                    for shift in [0, 2, 4, 6] {
                        for (half, hm) in [(&q[..16], &hmask[..16]), (&q[16..], &hmask[16..])] {
                            let dl = d_all * (q3_k_scale(scales, is) as i32 - 32) as f32;
                            is += 1;
                            for (&ql, &h) in half.iter().zip(hm) {
                                let q = ((ql >> shift) & 3) as i32 - if h & m != 0 { 0 } else { 4 };
                                *y.next().unwrap() = dl * q as f32;
                            }
                        }
                        m <<= 1;
                    }
                }
            }
        }
        // block_q4_K { f16 d; f16 dmin; u8 scales[12]; u8 qs[128]; }: 8 groups of 32
        // with 6-bit scale and min (`scale_min_k4`). Element e is the low nibble of
        // qs[32*(e/64) + e%32] for even e/32, the high one for odd; with sc, mn those of
        // group e/32, y = (d*sc)*q - dmin*mn. d*sc (17 bits), (d*sc)*q (21 bits) and
        // dmin*mn are exact; the subtraction is the one rounding.
        GgmlType::Q4_K => {
            for (y, b) in blocks(ty, out, bytes) {
                let d = f16_at(b, 0);
                let min = f16_at(b, 2);
                let scales: &[u8; 12] = b[4..16].try_into().unwrap();
                for (j, (y, q)) in y
                    .chunks_exact_mut(64)
                    .zip(b[16..144].chunks_exact(32))
                    .enumerate()
                {
                    let (d1, m1) = k_group(d, min, scales, 2 * j);
                    let (d2, m2) = k_group(d, min, scales, 2 * j + 1);
                    let (lo, hi) = y.split_at_mut(32);
                    for l in 0..32 {
                        lo[l] = d1 * (q[l] & 0x0f) as f32 - m1;
                        hi[l] = d2 * (q[l] >> 4) as f32 - m2;
                    }
                }
            }
        }
        // block_q5_K { f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]; }: as
        // Q4_K, with bit e/32 of qh[e%32] adding 16 to q; y = (d*sc)*q - dmin*mn.
        // d*sc (17 bits), (d*sc)*q (22 bits) and dmin*mn are exact; the subtraction is
        // the one rounding.
        GgmlType::Q5_K => {
            for (y, b) in blocks(ty, out, bytes) {
                let d = f16_at(b, 0);
                let min = f16_at(b, 2);
                let scales: &[u8; 12] = b[4..16].try_into().unwrap();
                let qh = &b[16..48];
                for (j, (y, ql)) in y
                    .chunks_exact_mut(64)
                    .zip(b[48..176].chunks_exact(32))
                    .enumerate()
                {
                    let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
                    let (d1, m1) = k_group(d, min, scales, 2 * j);
                    let (d2, m2) = k_group(d, min, scales, 2 * j + 1);
                    let (lo, hi) = y.split_at_mut(32);
                    for l in 0..32 {
                        let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                        let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                        lo[l] = d1 * ((ql[l] & 0x0f) + h1) as f32 - m1;
                        hi[l] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
                    }
                }
            }
        }
        // block_q6_K { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d; }: in half n of
        // 128 elements (ql + 64n, qh + 32n), element 32k + l (k < 4, l < 32) takes the
        // low (k < 2) or high (k >= 2) nibble of ql[l + 32*(k%2)] as bits 0..4 and bits
        // 2k..2k+2 of qh[l] as bits 4..6; q = that - 32 and y = (d*scales[e/16])*q, left
        // to right as ggml. d*sc (11 + 7 bits) and (d*sc)*q (+ 5 bits) are exact: no
        // rounding.
        GgmlType::Q6_K => {
            for (y, b) in blocks(ty, out, bytes) {
                let d = f16_at(b, 208);
                for n in 0..2 {
                    let ql = &b[64 * n..64 * n + 64];
                    let qh = &b[128 + 32 * n..128 + 32 * n + 32];
                    let sc = &b[192 + 8 * n..192 + 8 * n + 8];
                    let y = &mut y[128 * n..128 * n + 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                }
            }
        }
        // block_iq4_nl { f16 d; u8 qs[16]; }: nibbles as in Q4_0, each an index into
        // `KVALUES_IQ4NL`; y = d*kvalues[q]. Exact (11 + 7 bits): no rounding.
        GgmlType::IQ4_NL => {
            for (y, b) in blocks(ty, out, bytes) {
                let d = f16_at(b, 0);
                let (lo, hi) = y.split_at_mut(16);
                for j in 0..16 {
                    let q = b[2 + j];
                    lo[j] = d * KVALUES_IQ4NL[(q & 0x0f) as usize] as f32;
                    hi[j] = d * KVALUES_IQ4NL[(q >> 4) as usize] as f32;
                }
            }
        }
        // block_iq4_xs { f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]; }: 8 groups
        // of 32, group g has the 6-bit scale ls = nibble g%2 of scales_l[g/2] | bits
        // 2g..2g+2 of scales_h << 4, and its 16 bytes of nibbles as in IQ4_NL;
        // y = (d*(ls - 32))*kvalues[q]. Exact (11 + 5 + 7 bits): no rounding.
        GgmlType::IQ4_XS => {
            for (y, b) in blocks(ty, out, bytes) {
                let d = f16_at(b, 0);
                let scales_h = u16::from_le_bytes([b[2], b[3]]);
                for (ib, (y, qs)) in y
                    .chunks_exact_mut(32)
                    .zip(b[8..136].chunks_exact(16))
                    .enumerate()
                {
                    let ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0f) as i32
                        | (((scales_h >> (2 * ib)) & 3) << 4) as i32;
                    let dl = d * (ls - 32) as f32;
                    let (lo, hi) = y.split_at_mut(16);
                    for j in 0..16 {
                        lo[j] = dl * KVALUES_IQ4NL[(qs[j] & 0x0f) as usize] as f32;
                        hi[j] = dl * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
                    }
                }
            }
        }
        // block_mxfp4 { u8 e; u8 qs[16]; }: nibbles as in Q4_0, each an e2m1 value
        // doubled (`KVALUES_MXFP4`); y = kvalues[q] * 2^(e - 128) (`e8m0_to_f32_half`).
        // Exact (an integer of at most 4 bits times a power of two no smaller than
        // 2^-128), so no rounding, except overflow to ±infinity where
        // |kvalues[q]| * 2^(e - 128) >= 2^128 (e >= 253): ggml does not treat e = 255
        // as NaN here, nor does this.
        GgmlType::MXFP4 => {
            for (y, b) in blocks(ty, out, bytes) {
                let d = e8m0_to_f32_half(b[0]);
                let (lo, hi) = y.split_at_mut(16);
                for j in 0..16 {
                    let q = b[1 + j];
                    lo[j] = KVALUES_MXFP4[(q & 0x0f) as usize] as f32 * d;
                    hi[j] = KVALUES_MXFP4[(q >> 4) as usize] as f32 * d;
                }
            }
        }
        other => return Err(DequantError::Unsupported(other)),
    }
    Ok(())
}

/// The pairs (block of `out`, its bytes) of a checked buffer of `ty`.
fn blocks<'a>(
    ty: GgmlType,
    out: &'a mut [f32],
    bytes: &'a [u8],
) -> impl Iterator<Item = (&'a mut [f32], &'a [u8])> {
    let (block, block_bytes) = ty.block();
    out.chunks_exact_mut(block as usize)
        .zip(bytes.chunks_exact(block_bytes as usize))
}

/// ggml's `kvalues_iq4nl` (ggml-common.h).
const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// ggml's `kvalues_mxfp4`: the e2m1 values, doubled (ggml-common.h).
const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// The little-endian f16 at `b[at..at + 2]`, as f32 (exact).
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// ggml's `GGML_E8M0_TO_FP32_HALF` (ggml-impl.h): 2^(x - 128), built from its bits;
/// 0 and 1 are the subnormals 2^-128 and 2^-127, 255 is 2^127 (not NaN).
fn e8m0_to_f32_half(x: u8) -> f32 {
    let bits = if x < 2 {
        0x0020_0000u32 << x
    } else {
        ((x - 1) as u32) << 23
    };
    f32::from_bits(bits)
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of group `j` (< 8) of Q4_K and
/// Q5_K. Groups 0..4 are the low 6 bits of `q[j]` and `q[j + 4]`; groups 4..8 take
/// their low 4 bits from the nibbles of `q[j + 4]` and their top 2 from the top bits of
/// `q[j - 4]` (scale) and `q[j]` (min).
fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The 6-bit scale of group `is` (< 16) of Q3_K, as ggml's `dequantize_row_q3_K`
/// unpacks them with `kmask1`/`kmask2` into `aux`: the low 4 bits are the low nibble
/// of `scales[is]` (is < 8) or the high nibble of `scales[is - 8]`, the high 2 bits are
/// bits `2*(is/4)..` of `scales[8 + is%4]`.
fn q3_k_scale(scales: &[u8; 12], is: usize) -> u8 {
    let low = if is < 8 {
        scales[is] & 0x0f
    } else {
        scales[is - 8] >> 4
    };
    let high = (scales[8 + is % 4] >> (2 * (is / 4))) & 3;
    low | (high << 4)
}

/// Q5_0's and Q5_1's five-bit values of elements `j` and `16 + j` (`j < 16`): the
/// low and high nibbles of `q` (`qs[j]`) with bits `j` and `16 + j` of `qh` as their
/// fifth bits.
fn q5_pair(qh: u32, q: u8, j: usize) -> (u32, u32) {
    let h0 = ((qh >> j) << 4) & 0x10;
    let h1 = (qh >> (j + 12)) & 0x10;
    ((q & 0x0f) as u32 | h0, (q >> 4) as u32 | h1)
}

/// Q4_K's and Q5_K's group `g`: its scale `d*sc` and its min `dmin*mn`, each an
/// exact f32 product, as ggml computes them before the group's elements.
fn k_group(d: f32, dmin: f32, scales: &[u8; 12], g: usize) -> (f32, f32) {
    let (sc, mn) = scale_min_k4(g, scales);
    (d * sc as f32, dmin * mn as f32)
}

/// Whether [`dequantize`] handles `ty` (the types of the module doc).
pub fn dequantizes(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::F32
            | GgmlType::F16
            | GgmlType::BF16
            | GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::IQ4_NL
            | GgmlType::IQ4_XS
            | GgmlType::MXFP4
    )
}

fn check(ty: GgmlType, bytes: &[u8], n_elements: usize) -> Result<(), DequantError> {
    if !dequantizes(ty) {
        return Err(DequantError::Unsupported(ty));
    }
    let (block, block_bytes) = ty.block();
    let (block, block_bytes) = (block as usize, block_bytes as usize);
    if !n_elements.is_multiple_of(block) {
        return Err(DequantError::PartialBlock {
            ty,
            n_elements,
            block,
        });
    }
    let expected = (n_elements / block).checked_mul(block_bytes);
    if expected != Some(bytes.len()) {
        return Err(DequantError::Length {
            ty,
            n_elements,
            expected: expected.unwrap_or(usize::MAX),
            actual: bytes.len(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const F16_ONE: [u8; 2] = [0x00, 0x3c];
    const F16_HALF: [u8; 2] = [0x00, 0x38];
    const F16_MINUS_TWO: [u8; 2] = [0x00, 0xc0];

    /// The types added with the k-quants, each with an id.
    const NEW_TYPES: [GgmlType; 10] = [
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_NL,
        GgmlType::IQ4_XS,
        GgmlType::MXFP4,
    ];

    fn f16(x: f32) -> [u8; 2] {
        let h = half::f16::from_f32(x);
        assert_eq!(h.to_f32(), x, "{x} is not an f16");
        h.to_bits().to_le_bytes()
    }

    /// `n` bytes that are not all alike (a fixed LCG), for the bytes a test leaves free.
    fn noise(n: usize, seed: u32) -> Vec<u8> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(12345);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                (s >> 24) as u8
            })
            .collect()
    }

    /// Element `e` of one block of `ty`, straight from the per-element formula of the
    /// type's comment (indices computed from `e`, not by walking the block as ggml
    /// does), with ggml's order of operations. The Q3_K scales are unpacked as ggml's
    /// code does, with `kmask1`/`kmask2` on u32 words.
    fn reference(ty: GgmlType, b: &[u8], e: usize) -> f32 {
        let h = |at: usize| f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]));
        let nib = |byte: u8, high: bool| if high { byte >> 4 } else { byte & 0x0f };
        let k4 = |j: usize| scale_min_k4(j, b[4..16].try_into().unwrap());
        let (n, s, l) = (e / 128, (e % 128) / 32, e % 32);
        match ty {
            GgmlType::Q5_0 | GgmlType::Q5_1 => {
                let o = if ty == GgmlType::Q5_0 { 2 } else { 4 };
                let qh = u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
                let q = nib(b[o + 4 + e % 16], e >= 16) as u32 | (((qh >> e) & 1) << 4);
                if ty == GgmlType::Q5_0 {
                    (q as i32 - 16) as f32 * h(0)
                } else {
                    q as f32 * h(0) + h(2)
                }
            }
            GgmlType::Q2_K => {
                let q = (b[16 + 32 * n + l] >> (2 * s)) & 3;
                let sc = b[e / 16];
                h(80) * (sc & 15) as f32 * q as f32 - h(82) * (sc >> 4) as f32
            }
            GgmlType::Q3_K => {
                let w =
                    |i: usize| u32::from_le_bytes(b[96 + 4 * i..100 + 4 * i].try_into().unwrap());
                let (k1, k2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
                let (a0, a1, tmp) = (w(0), w(1), w(2));
                let aux = [
                    (a0 & k2) | ((tmp & k1) << 4),
                    (a1 & k2) | (((tmp >> 2) & k1) << 4),
                    ((a0 >> 4) & k2) | (((tmp >> 4) & k1) << 4),
                    ((a1 >> 4) & k2) | (((tmp >> 6) & k1) << 4),
                ];
                let sc = aux[e / 64].to_le_bytes()[(e / 16) % 4] as i8;
                let low = ((b[32 + 32 * n + l] >> (2 * s)) & 3) as i32;
                let q = low - if b[l] & (1 << (4 * n + s)) != 0 { 0 } else { 4 };
                h(108) * (sc as i32 - 32) as f32 * q as f32
            }
            GgmlType::Q4_K | GgmlType::Q5_K => {
                let g = e / 32;
                let (sc, m) = k4(g);
                let o = if ty == GgmlType::Q4_K { 16 } else { 48 };
                let mut q = nib(b[o + 32 * (e / 64) + l], g % 2 == 1);
                if ty == GgmlType::Q5_K {
                    q += ((b[16 + l] >> g) & 1) * 16;
                }
                h(0) * sc as f32 * q as f32 - h(2) * m as f32
            }
            GgmlType::Q6_K => {
                let (k, r) = ((e % 128) / 32, e % 32);
                let low = nib(b[64 * n + r + 32 * (k % 2)], k >= 2);
                let high = (b[128 + 32 * n + r] >> (2 * k)) & 3;
                let q = (low | (high << 4)) as i32 - 32;
                h(208) * (b[192 + e / 16] as i8) as f32 * q as f32
            }
            GgmlType::IQ4_NL => h(0) * KVALUES_IQ4NL[nib(b[2 + e % 16], e >= 16) as usize] as f32,
            GgmlType::IQ4_XS => {
                let g = e / 32;
                let sh = u16::from_le_bytes([b[2], b[3]]);
                let ls = nib(b[4 + g / 2], g % 2 == 1) as i32 | (((sh >> (2 * g)) & 3) << 4) as i32;
                let q = nib(b[8 + 16 * g + l % 16], l >= 16);
                h(0) * (ls - 32) as f32 * KVALUES_IQ4NL[q as usize] as f32
            }
            GgmlType::MXFP4 => {
                let d = 2f64.powi(b[0] as i32 - 128) as f32;
                KVALUES_MXFP4[nib(b[1 + e % 16], e >= 16) as usize] as f32 * d
            }
            other => panic!("no reference for {other}"),
        }
    }

    fn bits(y: &[f32]) -> Vec<u32> {
        y.iter().map(|x| x.to_bits()).collect()
    }

    /// Dequantizes one block and checks every element against [`reference`].
    fn block_checked(ty: GgmlType, b: &[u8]) -> Vec<f32> {
        let n = ty.block_size() as usize;
        let y = dequantize(ty, b, n).unwrap();
        let want: Vec<f32> = (0..n).map(|e| reference(ty, b, e)).collect();
        assert_eq!(bits(&y), bits(&want), "{ty}");
        y
    }

    #[test]
    fn q8_0_block() {
        let mut b = F16_HALF.to_vec();
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let y = dequantize(GgmlType::Q8_0, &b, 32).unwrap();
        let want: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.5).collect();
        assert_eq!(y, want);
        // Extremes of i8.
        let mut b = F16_MINUS_TWO.to_vec();
        b.extend([0x80u8, 0x7f]);
        b.extend([0u8; 30]);
        let y = dequantize(GgmlType::Q8_0, &b, 32).unwrap();
        assert_eq!(&y[..3], &[256.0, -254.0, -0.0]);
    }

    #[test]
    fn q4_0_block_nibble_order() {
        let mut b = F16_ONE.to_vec();
        // byte j: low nibble j (element j), high nibble 15 - j (element 16 + j)
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = dequantize(GgmlType::Q4_0, &b, 32).unwrap();
        for j in 0..16 {
            assert_eq!(y[j], j as f32 - 8.0);
            assert_eq!(y[16 + j], (15 - j) as f32 - 8.0);
        }
    }

    #[test]
    fn q4_1_block_scale_and_min() {
        let mut b = F16_HALF.to_vec();
        b.extend(F16_MINUS_TWO);
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = dequantize(GgmlType::Q4_1, &b, 32).unwrap();
        for j in 0..16 {
            assert_eq!(y[j], j as f32 * 0.5 - 2.0);
            assert_eq!(y[16 + j], (15 - j) as f32 * 0.5 - 2.0);
        }
    }

    /// qh with the fifth bit of elements 3, 21 and 31 set, little-endian.
    const Q5_QH: [u8; 4] = (1u32 << 3 | 1 << 21 | 1 << 31).to_le_bytes();

    #[test]
    fn q5_0_block_high_bits() {
        let mut b = f16(0.5).to_vec();
        b.extend(Q5_QH);
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = block_checked(GgmlType::Q5_0, &b);
        assert_eq!(y[0], -8.0); // (0 - 16) * 0.5
        assert_eq!(y[3], 1.5); // (3 + 16 - 16) * 0.5: bit 3 of qh
        assert_eq!(y[17], -1.0); // high nibble 14, no fifth bit
        assert_eq!(y[21], 5.0); // high nibble 10, bit 21 of qh
        assert_eq!(y[31], 0.0); // high nibble 0, bit 31 of qh
    }

    #[test]
    fn q5_1_block_high_bits_and_min() {
        let mut b = f16(0.5).to_vec();
        b.extend(f16(-2.0));
        b.extend(Q5_QH);
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = block_checked(GgmlType::Q5_1, &b);
        assert_eq!(y[0], -2.0);
        assert_eq!(y[3], 7.5); // 19 * 0.5 - 2
        assert_eq!(y[17], 5.0); // 14 * 0.5 - 2
        assert_eq!(y[21], 11.0); // 26 * 0.5 - 2
        assert_eq!(y[31], 6.0); // 16 * 0.5 - 2
    }

    #[test]
    fn q2_k_block() {
        let mut b = noise(84, 2);
        b[80..82].copy_from_slice(&f16(1.0));
        b[82..84].copy_from_slice(&f16(0.5));
        b[0] = 0x21; // group 0: scale 1, min 2
        b[2] = 0x12; // group 2: scale 2, min 1
        b[15] = 0x3f; // group 15: scale 15, min 3
        b[16] = (b[16] & 0xf0) | 0b01_11; // qs[0]: element 0 is 3, element 32 is 1
        b[16 + 63] = (b[16 + 63] & 0x3f) | 0xc0; // qs[63] >> 6: element 255 is 3
        let y = block_checked(GgmlType::Q2_K, &b);
        assert_eq!(y[0], 2.0); // 1*3 - 0.5*2
        assert_eq!(y[32], 1.5); // 2*1 - 0.5*1
        assert_eq!(y[255], 43.5); // 15*3 - 0.5*3
    }

    #[test]
    fn q3_k_block() {
        let mut b = noise(110, 3);
        b[108..110].copy_from_slice(&f16(0.25));
        // Scales (at 96): group 0 = 33 (low 1 in scales[0], high 2 in scales[8] bits
        // 0..2), group 8 = 63 (low 15 in scales[0] >> 4, high 3 in scales[8] bits
        // 4..6), group 15 = 0 (scales[7] >> 4, scales[11] >> 6).
        b[96] = 0xf1;
        b[104] = (b[104] & 0b1100_1100) | 0b0011_0010;
        b[103] &= 0x0f;
        b[107] &= 0x3f;
        // hmask[0]: bit 0 clear (element 0 less 4), bit 4 set (element 128 not).
        b[0] = (b[0] & !0x11) | 0x10;
        b[31] &= 0x7f; // hmask[31] bit 7 clear: element 255 less 4
        b[32] = (b[32] & 0xf0) | 0b11; // element 0: low bits 3
        b[64] = (b[64] & 0xfc) | 0b10; // qs[32]: element 128 low bits 2
        b[95] &= 0x3f; // qs[63] >> 6: element 255 low bits 0
        let y = block_checked(GgmlType::Q3_K, &b);
        assert_eq!(y[0], -0.25); // 0.25 * (33 - 32) * (3 - 4)
        assert_eq!(y[128], 15.5); // 0.25 * 31 * 2: its high bit set
        assert_eq!(y[255], 32.0); // 0.25 * -32 * -4
    }

    /// The 12 scale bytes of Q4_K/Q5_K in `s`: group 0 scale 3 min 5, group 1 scale
    /// 10 min 1, group 7 scale 47 min 50 (top bits from s[3] and s[7]).
    fn k4_scales(s: &mut [u8]) {
        s[0] = 0x03;
        s[4] = 0x05;
        s[1] = 0x0a;
        s[5] = 0x01;
        s[11] = 0x2f;
        s[3] = 0x80;
        s[7] = 0xc1;
    }

    #[test]
    fn q4_k_block() {
        let mut b = noise(144, 4);
        b[0..2].copy_from_slice(&f16(0.5));
        b[2..4].copy_from_slice(&f16(0.25));
        k4_scales(&mut b[4..16]);
        assert_eq!(scale_min_k4(7, b[4..16].try_into().unwrap()), (47, 50));
        b[16] = 0x9c; // element 0: 12, element 32: 9
        b[143] = 0xf0; // element 255: 15
        let y = block_checked(GgmlType::Q4_K, &b);
        assert_eq!(y[0], 16.75); // 0.5*3*12 - 0.25*5
        assert_eq!(y[32], 44.75); // 0.5*10*9 - 0.25*1
        assert_eq!(y[255], 340.0); // 0.5*47*15 - 0.25*50
    }

    #[test]
    fn q5_k_block() {
        let mut b = noise(176, 5);
        b[0..2].copy_from_slice(&f16(0.5));
        b[2..4].copy_from_slice(&f16(0.25));
        k4_scales(&mut b[4..16]);
        b[16] = (b[16] & !3) | 1; // qh[0]: element 0 + 16, element 32 not
        b[47] |= 0x80; // qh[31] bit 7: element 255 + 16
        b[48] = 0x9c;
        b[175] = 0xf0;
        let y = block_checked(GgmlType::Q5_K, &b);
        assert_eq!(y[0], 40.75); // 0.5*3*28 - 1.25
        assert_eq!(y[32], 44.75); // 0.5*10*9 - 0.25
        assert_eq!(y[255], 716.0); // 0.5*47*31 - 12.5
    }

    #[test]
    fn q6_k_block() {
        let mut b = noise(210, 6);
        b[208..210].copy_from_slice(&f16(0.5));
        b[0] = 0xa5; // element 0 low 5, element 64 low 10
                     // qh[0]: element 0 high 1 (bits 0..2), element 32 high 2, element 64 high 0,
                     // element 96 high 3 (bits 6..8).
        b[128] = 0b11_00_10_01;
        b[32] = 0xf0 | (b[32] & 0x0f); // element 96 low 15
        b[127] &= 0x0f; // element 255 low 0
        b[191] &= 0x3f; // element 255 high 0
        b[192] = (-3i8) as u8;
        b[196] = 7;
        b[198] = (-128i8) as u8;
        b[207] = 127;
        let y = block_checked(GgmlType::Q6_K, &b);
        assert_eq!(y[0], 16.5); // 0.5 * -3 * (21 - 32)
        assert_eq!(y[64], -77.0); // 0.5 * 7 * (10 - 32)
        assert_eq!(y[96], -1984.0); // 0.5 * -128 * (63 - 32)
        assert_eq!(y[255], -2032.0); // 0.5 * 127 * -32
    }

    #[test]
    fn iq4_nl_block() {
        let mut b = f16(0.5).to_vec();
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = block_checked(GgmlType::IQ4_NL, &b);
        for j in 0..16 {
            assert_eq!(y[j], KVALUES_IQ4NL[j] as f32 * 0.5);
            assert_eq!(y[16 + j], KVALUES_IQ4NL[15 - j] as f32 * 0.5);
        }
        assert_eq!((y[0], y[15], y[16], y[31]), (-63.5, 56.5, 56.5, -63.5));
    }

    #[test]
    fn iq4_xs_block() {
        let mut b = noise(136, 7);
        b[0..2].copy_from_slice(&f16(0.5));
        // scales_h bits 0..2 = 2 (group 0), 2..4 = 3 (group 1), 14..16 = 0 (group 7).
        let sh = (u16::from_le_bytes([b[2], b[3]]) & 0x3ff0) | 0b11_10;
        b[2..4].copy_from_slice(&sh.to_le_bytes());
        b[4] = 0xf1; // group 0 low 1 (ls 33), group 1 low 15 (ls 63)
        b[7] &= 0x0f; // group 7 low 0 (ls 0)
        b[8] = 0xf0; // element 0: kvalues[0], element 16: kvalues[15]
        b[24] = (b[24] & 0xf0) | 8; // element 32: kvalues[8] = 1
        b[135] = (b[135] & 0x0f) | 0x70; // element 255: kvalues[7] = -10
        let y = block_checked(GgmlType::IQ4_XS, &b);
        assert_eq!(y[0], -63.5); // 0.5 * 1 * -127
        assert_eq!(y[16], 56.5); // 0.5 * 1 * 113
        assert_eq!(y[32], 15.5); // 0.5 * 31 * 1
        assert_eq!(y[255], 160.0); // 0.5 * -32 * -10
    }

    #[test]
    fn mxfp4_block_and_exponent_extremes() {
        let qs: Vec<u8> = (0..16u8).map(|j| j | ((15 - j) << 4)).collect();
        let block = |e: u8| [&[e][..], &qs].concat();
        let y = block_checked(GgmlType::MXFP4, &block(128)); // scale 2^0
        for j in 0..16 {
            assert_eq!(y[j], KVALUES_MXFP4[j] as f32);
            assert_eq!(y[16 + j], KVALUES_MXFP4[15 - j] as f32);
        }
        assert_eq!((y[7], y[16], y[31]), (12.0, -12.0, 0.0));
        assert!(
            y[8] == 0.0 && y[8].is_sign_positive(),
            "-0 of e2m1 is +0 in ggml's table"
        );
        // e = 0, 1: subnormal scales 2^-128, 2^-127, still exact.
        assert_eq!(
            block_checked(GgmlType::MXFP4, &block(0))[3],
            3.0 * 2f32.powi(-128)
        );
        assert_eq!(
            block_checked(GgmlType::MXFP4, &block(1))[1],
            2f32.powi(-127)
        );
        // e = 255 is 2^127, not NaN: 1 * 2^127 is finite, 2 * 2^127 overflows.
        let y = block_checked(GgmlType::MXFP4, &block(255));
        assert_eq!(y[1], 2f32.powi(127));
        assert_eq!(y[2], f32::INFINITY);
        assert_eq!(y[16], f32::NEG_INFINITY);
        // e = 254: 3 * 2^126 finite, 4 * 2^126 infinite; e = 253: 6 finite, 8 not.
        let y = block_checked(GgmlType::MXFP4, &block(254));
        assert_eq!((y[3], y[4]), (3.0 * 2f32.powi(126), f32::INFINITY));
        let y = block_checked(GgmlType::MXFP4, &block(253));
        assert_eq!((y[5], y[6]), (6.0 * 2f32.powi(125), f32::INFINITY));
        assert_eq!(e8m0_to_f32_half(2), 2f32.powi(-126));
    }

    #[test]
    fn q3_k_scales_match_ggml_kmask_unpacking() {
        for seed in 0..64 {
            let mut b = noise(110, 100 + seed);
            b[108..110].copy_from_slice(&f16(1.0));
            // Every q 1 (low bits 1, high bit set), so element 16g is group g's scale.
            b[0..32].fill(0xff);
            b[32..96].fill(0b0101_0101);
            let y = block_checked(GgmlType::Q3_K, &b);
            for g in 0..16 {
                let sc = q3_k_scale(b[96..108].try_into().unwrap(), g) as f32 - 32.0;
                assert_eq!(y[16 * g], sc);
            }
        }
    }

    #[test]
    fn float_types() {
        let b: Vec<u8> = [1.5f32, -0.0, f32::INFINITY]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let y = dequantize(GgmlType::F32, &b, 3).unwrap();
        assert_eq!(y[0], 1.5);
        assert!(y[1] == 0.0 && y[1].is_sign_negative());
        assert_eq!(y[2], f32::INFINITY);
        // F16 subnormal 2^-24 and BF16 1.0.
        assert_eq!(
            dequantize(GgmlType::F16, &[1, 0], 1).unwrap(),
            [2f32.powi(-24)]
        );
        assert_eq!(dequantize(GgmlType::BF16, &[0x80, 0x3f], 1).unwrap(), [1.0]);
    }

    #[test]
    fn bad_lengths_and_types() {
        assert!(matches!(
            dequantize(GgmlType::Q4_1, &[0; 20], 16),
            Err(DequantError::PartialBlock { .. })
        ));
        assert!(matches!(
            dequantize(GgmlType::Q4_1, &[0; 19], 32),
            Err(DequantError::Length { .. })
        ));
        assert_eq!(
            dequantize(GgmlType::IQ2_XXS, &[0; 66], 256),
            Err(DequantError::Unsupported(GgmlType::IQ2_XXS))
        );
        let mut out = [0f32; 2];
        assert!(dequantize_into(GgmlType::F32, &[0; 4], &mut out).is_err());
    }

    #[test]
    fn new_types_bad_lengths() {
        for ty in NEW_TYPES {
            let (n, nb) = (ty.block_size() as usize, ty.block_bytes() as usize);
            assert_eq!(
                dequantize(ty, &vec![0; nb], n / 2),
                Err(DequantError::PartialBlock {
                    ty,
                    n_elements: n / 2,
                    block: n
                }),
                "{ty}"
            );
            assert!(
                matches!(
                    dequantize(ty, &[0; 7], n + 1),
                    Err(DequantError::PartialBlock { .. })
                ),
                "{ty}"
            );
            for bytes in [nb - 1, nb + 1, 2 * nb] {
                assert_eq!(
                    dequantize(ty, &vec![0; bytes], n),
                    Err(DequantError::Length {
                        ty,
                        n_elements: n,
                        expected: nb,
                        actual: bytes
                    }),
                    "{ty}"
                );
            }
            let mut out = vec![0f32; 2 * n];
            assert!(dequantize_into(ty, &vec![0; nb], &mut out).is_err(), "{ty}");
            assert_eq!(dequantize(ty, &[], 0), Ok(vec![]), "{ty}");
            assert_eq!(
                dequantize(ty, &vec![0; 3 * nb], 3 * n).unwrap().len(),
                3 * n
            );
        }
    }

    /// Real blocks of SmolLM2-135M-Instruct.Q4_1.gguf with the values the `gguf` Python
    /// package dequantizes them to (tests/conformance/smollm2_dequant_blocks.py).
    #[test]
    fn matches_gguf_python_on_real_blocks() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/smollm2/dequant_blocks.json"
        );
        let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let cases = doc["cases"].as_array().unwrap();
        assert!(cases.len() >= 12);
        let mut seen = std::collections::HashSet::new();
        for case in cases {
            let ty = match case["type"].as_str().unwrap() {
                "Q4_1" => GgmlType::Q4_1,
                "Q8_0" => GgmlType::Q8_0,
                other => panic!("fixture type {other}"),
            };
            seen.insert(ty);
            let bytes = from_hex(case["bytes_hex"].as_str().unwrap());
            let want = u32s(&case["f32_bits"]);
            let got = bits(&dequantize(ty, &bytes, want.len()).unwrap());
            assert_eq!(got, want, "{} block {}", case["tensor"], case["block"]);
        }
        assert_eq!(seen.len(), 2);
    }

    fn from_hex(hex: &str) -> Vec<u8> {
        assert!(hex.len().is_multiple_of(2), "odd hex length");
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect()
    }

    fn u32s(v: &serde_json::Value) -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| u32::try_from(x.as_u64().unwrap()).unwrap())
            .collect()
    }

    /// Blocks quantized and dequantized by ggml's own C code
    /// (tests/conformance/ggml_dequant_blocks.c): every value, bit for bit.
    #[test]
    fn matches_ggml_reference_blocks() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/gguf/dequant_blocks.json"
        );
        let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let mut seen = std::collections::HashSet::new();
        for case in doc["cases"].as_array().unwrap() {
            let name = case["type"].as_str().unwrap();
            let ty = (0..64)
                .filter_map(GgmlType::from_id)
                .find(|t| t.name() == name)
                .unwrap_or_else(|| panic!("fixture type {name}"));
            seen.insert(ty);
            let bytes = from_hex(case["bytes_hex"].as_str().unwrap());
            let want = u32s(&case["f32_bits"]);
            let got = bits(&dequantize(ty, &bytes, want.len()).unwrap());
            for (e, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g,
                    w,
                    "{name} case {}: element {e} is {} ({g:#010x}), ggml's {} ({w:#010x})",
                    case["case"],
                    f32::from_bits(*g),
                    f32::from_bits(*w)
                );
            }
        }
        use GgmlType::*;
        for ty in [
            Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4,
        ] {
            assert!(seen.contains(&ty), "the fixture has no {ty} block");
        }
    }

    proptest! {
        #[test]
        fn any_bytes_any_length_never_panics(
            ty in 0u32..40,
            bytes in proptest::collection::vec(any::<u8>(), 0..200),
            n in 0usize..200,
        ) {
            if let Some(ty) = GgmlType::from_id(ty) {
                let _ = dequantize(ty, &bytes, n);
            }
        }

        /// Whole blocks of any bytes (so the 256-element types, which the test above
        /// reaches only with zero elements, are decoded too): no panic, and every
        /// element as the per-element formula gives it.
        #[test]
        fn any_whole_blocks_match_the_formula(
            which in 0usize..NEW_TYPES.len(),
            seed in any::<u32>(),
            n_blocks in 0usize..3,
        ) {
            let ty = NEW_TYPES[which];
            let (n, nb) = (ty.block_size() as usize, ty.block_bytes() as usize);
            let bytes = noise(n_blocks * nb, seed);
            let y = dequantize(ty, &bytes, n_blocks * n).unwrap();
            for (yb, b) in y.chunks_exact(n).zip(bytes.chunks_exact(nb)) {
                let want: Vec<f32> = (0..n).map(|e| reference(ty, b, e)).collect();
                prop_assert_eq!(bits(yb), bits(&want));
            }
        }
    }
}
