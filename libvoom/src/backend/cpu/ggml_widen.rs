//! AVX-512 dequantization of whole rows of ggml blocks (`matmul_ggml.rs`'s widened
//! groups), sixteen elements an instruction where the scalar specification
//! ([`voom_formats::gguf::dequantize_into`]) takes one.
//!
//! Each type computes ggml's value with ggml's operations: the block's f16 scales
//! widened exactly (scalar, once a block), the integer levels unpacked in vector
//! registers and converted exactly, then the one product or product-and-sum the
//! specification has. Every product there is exact in f32, so a fused
//! `fma(d, q, m)` rounds once where the specification's `d * q + m` rounds once: the
//! same bits (`the_vector_rows_have_the_bits_of_the_specification` checks every type
//! on ggml's own blocks and random bytes). Types without a vector path here return
//! `false` and are widened by the specification.

use std::arch::x86_64::*;

use voom_formats::dtype::f16_to_f32;
use voom_formats::gguf::GgmlType;

/// Widens `row` (whole blocks of `ty`) into `out` (its elements) when `ty` has a
/// vector path here; `false` (and `out` untouched) otherwise.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VL; `row` is exactly `out.len()` elements of `ty`
/// (the caller's checked view).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn widen(ty: GgmlType, row: &[u8], out: &mut [f32]) -> bool {
    let (block, bytes) = ty.block();
    let (block, bytes) = (block as usize, bytes as usize);
    debug_assert_eq!(row.len() / bytes * block, out.len());
    let each: unsafe fn(&[u8], &mut [f32]) = match ty {
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q4_K => q4_k,
        GgmlType::Q5_K => q5_k,
        GgmlType::Q6_K => q6_k,
        GgmlType::IQ4_NL => iq4_nl,
        GgmlType::MXFP4 => mxfp4,
        _ => return false,
    };
    for (b, y) in row.chunks_exact(bytes).zip(out.chunks_exact_mut(block)) {
        // SAFETY: `b` is one block of `ty` and `y` its elements; AVX-512 is the
        // caller's.
        unsafe { each(b, y) };
    }
    true
}

/// The little-endian f16 at `b[at..]`, as f32 (exact).
#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Sixteen bytes at `p` as sixteen u32 lanes.
///
/// # Safety
/// `p` valid for 16 bytes; AVX-512.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn u8x16(p: *const u8) -> __m512i {
    // SAFETY: the caller's 16 readable bytes (unaligned load).
    unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast())) }
}

/// Stores sixteen f32 lanes at `y[at..at + 16]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn store(y: &mut [f32], at: usize, v: __m512) {
    let y = &mut y[at..at + 16];
    // SAFETY: `y` holds 16 floats (the slice above).
    unsafe { _mm512_storeu_ps(y.as_mut_ptr(), v) }
}

/// Q8_0 (`{f16 d; i8 qs[32]}`): `q * d`.
///
/// # Safety
/// `b` a block of 34 bytes, `y` 32 floats; AVX-512.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = _mm512_set1_ps(f16_at(b, 0));
    for h in 0..2 {
        let q = &b[2 + 16 * h..18 + 16 * h];
        // SAFETY: 16 readable bytes.
        let q = unsafe { _mm512_cvtepi8_epi32(_mm_loadu_si128(q.as_ptr().cast())) };
        store(y, 16 * h, _mm512_mul_ps(_mm512_cvtepi32_ps(q), d));
    }
}

/// The low and high nibbles of the sixteen bytes at `p`, as u32 lanes.
///
/// # Safety
/// `p` valid for 16 bytes; AVX-512.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn nibbles(p: *const u8) -> (__m512i, __m512i) {
    // SAFETY: forwarded.
    let q = unsafe { u8x16(p) };
    let f = _mm512_set1_epi32(0x0f);
    (_mm512_and_si512(q, f), _mm512_srli_epi32::<4>(q))
}

/// Q4_0 (`{f16 d; u8 qs[16]}`): `(q - 8) * d`, low nibbles first.
///
/// # Safety
/// `b` a block of 18 bytes, `y` 32 floats; AVX-512.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = _mm512_set1_ps(f16_at(b, 0));
    // SAFETY: bytes 2..18 of the block.
    let (lo, hi) = unsafe { nibbles(b[2..18].as_ptr()) };
    let eight = _mm512_set1_epi32(8);
    for (at, q) in [(0, lo), (16, hi)] {
        let q = _mm512_cvtepi32_ps(_mm512_sub_epi32(q, eight));
        store(y, at, _mm512_mul_ps(q, d));
    }
}

/// Q4_1 (`{f16 d; f16 m; u8 qs[16]}`): `q * d + m` (the product exact: one
/// rounding, fused or not).
///
/// # Safety
/// `b` a block of 20 bytes, `y` 32 floats; AVX-512.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn q4_1(b: &[u8], y: &mut [f32]) {
    let d = _mm512_set1_ps(f16_at(b, 0));
    let m = _mm512_set1_ps(f16_at(b, 2));
    // SAFETY: bytes 4..20 of the block.
    let (lo, hi) = unsafe { nibbles(b[4..20].as_ptr()) };
    for (at, q) in [(0, lo), (16, hi)] {
        store(y, at, _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, m));
    }
}

/// ggml's `get_scale_min_k4` (Q4_K, Q5_K): group `j`'s 6-bit scale and min.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Group `g`'s `d*sc` and `dmin*mn` (exact products), broadcast.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn k_group(d: f32, dmin: f32, scales: &[u8], g: usize) -> (__m512, __m512) {
    let (sc, mn) = scale_min_k4(g, scales);
    (
        _mm512_set1_ps(d * f32::from(sc)),
        _mm512_set1_ps(dmin * f32::from(mn)),
    )
}

/// Q4_K (`{f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}`): in each 64 elements the
/// low nibbles of 32 bytes then their high ones, `(d*sc)*q - dmin*mn` (one rounding).
///
/// # Safety
/// `b` a block of 144 bytes, `y` 256 floats; AVX-512.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    for j in 0..4 {
        let (d1, m1) = k_group(d, dmin, scales, 2 * j);
        let (d2, m2) = k_group(d, dmin, scales, 2 * j + 1);
        for h in 0..2 {
            let at = 16 + 32 * j + 16 * h;
            // SAFETY: 16 bytes of the block's qs.
            let (lo, hi) = unsafe { nibbles(b[at..at + 16].as_ptr()) };
            let o = 64 * j + 16 * h;
            store(y, o, _mm512_fmsub_ps(d1, _mm512_cvtepi32_ps(lo), m1));
            store(y, o + 32, _mm512_fmsub_ps(d2, _mm512_cvtepi32_ps(hi), m2));
        }
    }
}

/// Q5_K (`{f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}`): Q4_K with bit
/// `e/32` of `qh[e%32]` adding 16.
///
/// # Safety
/// `b` a block of 176 bytes, `y` 256 floats; AVX-512.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let one = _mm512_set1_epi32(1);
    for j in 0..4 {
        let (d1, m1) = k_group(d, dmin, scales, 2 * j);
        let (d2, m2) = k_group(d, dmin, scales, 2 * j + 1);
        let (s1, s2) = (
            _mm_cvtsi32_si128(2 * j as i32),
            _mm_cvtsi32_si128(2 * j as i32 + 1),
        );
        for h in 0..2 {
            let at = 48 + 32 * j + 16 * h;
            // SAFETY: 16 bytes of the block's qs, and of its qh.
            let ((lo, hi), qh) = unsafe {
                (
                    nibbles(b[at..at + 16].as_ptr()),
                    u8x16(b[16 + 16 * h..32 + 16 * h].as_ptr()),
                )
            };
            let h1 = _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srl_epi32(qh, s1), one));
            let h2 = _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srl_epi32(qh, s2), one));
            let lo = _mm512_cvtepi32_ps(_mm512_add_epi32(lo, h1));
            let hi = _mm512_cvtepi32_ps(_mm512_add_epi32(hi, h2));
            let o = 64 * j + 16 * h;
            store(y, o, _mm512_fmsub_ps(d1, lo, m1));
            store(y, o + 32, _mm512_fmsub_ps(d2, hi, m2));
        }
    }
}

/// Q6_K (`{u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}`): in each half of 128
/// elements, element `32k + l` has four bits from a nibble of `ql` and two from
/// `qh[l]`, less 32; `(d*sc)*q`, exact.
///
/// # Safety
/// `b` a block of 210 bytes, `y` 256 floats; AVX-512.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    let (f, three, c32) = (
        _mm512_set1_epi32(0x0f),
        _mm512_set1_epi32(3),
        _mm512_set1_epi32(32),
    );
    for n in 0..2 {
        let (ql, qh) = (64 * n, 128 + 32 * n);
        let sc = &b[192 + 8 * n..200 + 8 * n];
        for is in 0..2 {
            let l = 16 * is;
            // SAFETY: 16 bytes each of ql (at l and l + 32) and qh (at l).
            let (a, c, h) = unsafe {
                (
                    u8x16(b[ql + l..].as_ptr()),
                    u8x16(b[ql + l + 32..].as_ptr()),
                    u8x16(b[qh + l..].as_ptr()),
                )
            };
            let hb = |shift: u32| -> __m512i {
                let s = _mm_cvtsi32_si128(shift as i32);
                _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srl_epi32(h, s), three))
            };
            let levels = [
                _mm512_or_si512(_mm512_and_si512(a, f), hb(0)),
                _mm512_or_si512(_mm512_and_si512(c, f), hb(2)),
                _mm512_or_si512(_mm512_srli_epi32::<4>(a), hb(4)),
                _mm512_or_si512(_mm512_srli_epi32::<4>(c), hb(6)),
            ];
            for (k, q) in levels.into_iter().enumerate() {
                let scale = _mm512_set1_ps(d * f32::from(sc[is + 2 * k] as i8));
                let q = _mm512_cvtepi32_ps(_mm512_sub_epi32(q, c32));
                store(y, 128 * n + 32 * k + l, _mm512_mul_ps(scale, q));
            }
        }
    }
}

/// A 4-bit index looked up in sixteen f32 values (`table`) times `d`: IQ4_NL's
/// non-linear levels and MXFP4's doubled e2m1 values.
///
/// # Safety
/// `qs` valid for 16 bytes, `y` 32 floats; AVX-512.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn lookup4(qs: *const u8, table: __m512, d: __m512, y: &mut [f32]) {
    // SAFETY: forwarded.
    let (lo, hi) = unsafe { nibbles(qs) };
    for (at, q) in [(0, lo), (16, hi)] {
        store(y, at, _mm512_mul_ps(_mm512_permutexvar_ps(q, table), d));
    }
}

/// `values` as sixteen f32 lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn table(values: [i8; 16]) -> __m512 {
    let v = values.map(f32::from);
    // SAFETY: 16 floats.
    unsafe { _mm512_loadu_ps(v.as_ptr()) }
}

/// IQ4_NL (`{f16 d; u8 qs[16]}`): `d * kvalues[q]`, exact.
///
/// # Safety
/// `b` a block of 18 bytes, `y` 32 floats; AVX-512.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn iq4_nl(b: &[u8], y: &mut [f32]) {
    const KVALUES: [i8; 16] = [
        -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
    ];
    let d = _mm512_set1_ps(f16_at(b, 0));
    // SAFETY: bytes 2..18 of the block.
    unsafe { lookup4(b[2..18].as_ptr(), table(KVALUES), d, y) }
}

/// MXFP4 (`{u8 e; u8 qs[16]}`): `kvalues[q] * 2^(e - 128)` (ggml's doubled e2m1
/// values and `GGML_E8M0_TO_FP32_HALF`), exact but for overflow.
///
/// # Safety
/// `b` a block of 17 bytes, `y` 32 floats; AVX-512.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn mxfp4(b: &[u8], y: &mut [f32]) {
    const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
    let e = b[0];
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        u32::from(e - 1) << 23
    };
    let d = _mm512_set1_ps(f32::from_bits(bits));
    // SAFETY: bytes 1..17 of the block.
    unsafe { lookup4(b[1..17].as_ptr(), table(KVALUES), d, y) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use voom_formats::gguf::dequantize_into;

    /// Every vector path against the specification, bit for bit (NaN as NaN): rows
    /// of random bytes (every bit pattern of levels, scales of every f16 and e8m0,
    /// NaN and infinity among them) and of ggml's own blocks.
    #[test]
    fn the_vector_rows_have_the_bits_of_the_specification() {
        if !(is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl"))
        {
            eprintln!("skipped: this CPU has no AVX-512");
            return;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(41);
        let types = [
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
            GgmlType::IQ4_NL,
            GgmlType::MXFP4,
        ];
        let fixture = super::super::fixture_blocks();
        for ty in types {
            let (block, bytes) = ty.block();
            let (block, bytes) = (block as usize, bytes as usize);
            let mut rows: Vec<Vec<u8>> = (0..200)
                .map(|_| (0..bytes * 3).map(|_| rng.gen()).collect())
                .collect();
            rows.extend(
                fixture
                    .iter()
                    .filter(|(t, _)| *t == ty)
                    .map(|(_, b)| b.clone()),
            );
            assert!(rows.len() > 200, "{ty}: ggml's blocks in the fixture");
            for row in rows {
                let n = row.len() / bytes * block;
                let mut want = vec![0f32; n];
                dequantize_into(ty, &row, &mut want).unwrap();
                let mut got = vec![0f32; n];
                // SAFETY: AVX-512 checked above; `row` is whole blocks of `n` elements.
                assert!(unsafe { widen(ty, &row, &mut got) }, "{ty}");
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                        "{ty} element {i}: {g} vs {w}"
                    );
                }
            }
        }
    }
}
