//! AVX-512 products over MXFP4 weights: the decode kernel of gpt-oss's experts.
//!
//! The tiles of `matmul.rs` convert each block of eight MXFP4 elements with a
//! scalar load, a nibble split, a table shuffle, an F16 widening, a scale lookup
//! and a multiply: at one token that is about two instructions a weight, and a
//! product ran at a fifth of the read bandwidth. Here a block of eight of a row
//! costs three vector instructions besides its multiply-add:
//!
//! - the block's four bytes (eight nibbles) broadcast to the eight lanes of a
//!   256-bit register, as the load itself;
//! - one variable shift (`vpsrlvd`) leaves nibble `l` in the low bits of lane `l`;
//! - one two-table permute (`vpermi2ps`, AVX-512 VL) turns the nibbles into the
//!   weights as f32, looked up in the sixteen values of the row's scale block,
//!   `E2M1[v] × 2^(e − 127)`, taken from a table of all 256 scales ([`SCALED`]:
//!   each entry the product [`WeightView::get`] computes, so exact).
//!
//! Each row keeps one 256-bit accumulator per token, as the AVX2 tiles do (this
//! needs no pairing of rows: one block's weights are one register). The order of
//! arithmetic per output element is the module doc's of `matmul.rs`, unchanged:
//! eight lanes, one fused multiply-add per lane per block of eight in increasing
//! `k`, the same fixed reduction, every weight the f32 of [`WeightView::get`]. So
//! the bits equal every other path's (MXFP4 rows are whole blocks of 32: no tail).
//!
//! AVX2 has no two-table permute: there ([`tile_avx2`]) the nibble's low three bits
//! pick one of the row's eight magnitudes and its bit 3 sets the sign, two more
//! instructions a block.
//!
//! Measured with `matmul_bench --formats` (gpt-oss-20b's 5760x2880 gate/up on the
//! development machine's 2-vCPU EPYC, two threads): 0.45 ms a product where the
//! tiles took 1.6 ms, and BF16 of the same shape 1.4 ms; with `--avx2` 0.57 ms where
//! the AVX2 tiles took 1.43 ms.

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx2::hsum;
use super::{ScaleMap, WeightView, E2M1, PREFETCH_AHEAD, PREFETCH_ROW};

/// For every e8m0 scale byte `e`, the sixteen e2m1 values times its scale,
/// `E2M1[v] × 2^(e − 127)`, each computed as [`WeightView::get`] computes an
/// element (one f32 multiply, exact but for e 255, NaN as the format says): a row's
/// block of 32 looks its two halves up here instead of multiplying. 16 KiB, of
/// which a checkpoint's few distinct scales touch a few lines.
#[repr(C, align(64))]
struct ScaledTables([[f32; 16]; 256]);

static SCALED: ScaledTables = scaled_tables();

const fn scaled_tables() -> ScaledTables {
    let mut t = [[0.0f32; 16]; 256];
    let mut e = 0;
    while e < 256 {
        let scale = match e {
            0 => f32::from_bits(0x0040_0000),
            255 => f32::NAN,
            e => f32::from_bits((e as u32) << 23),
        };
        let mut v = 0;
        while v < 16 {
            t[e][v] = E2M1[v] * scale;
            v += 1;
        }
        e += 1;
    }
    ScaledTables(t)
}

/// A tile function: rows `o0..o0 + R` x tokens `t0..t0 + T`, one 256-bit
/// accumulator per element. `|table| $row_table` is what a row keeps of its scale
/// block's sixteen values (`table` points at them in [`SCALED`]); `|values, idx|
/// $weights` the eight weights of a block from it and the lanes' shifted nibbles
/// (nibble `l` in bits 0..3 of lane `l`, higher bits to ignore). The AVX-512 and AVX2
/// tiles differ only there, so everything else, the order of arithmetic included, is
/// one text (a macro, not a function taking closures: see `prefetched_blocks!`).
macro_rules! mxfp4_tile {
    (
        $(#[$doc:meta])*
        $name:ident, $features:literal,
        |$table:ident| $row_table:expr,
        |$values:ident, $idx:ident| $weights:expr
    ) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// `w` is a checked MXFP4 view; rows `o0..o0 + R` are within `w.rows`, tokens
        /// `t0..t0 + T` within `x` (`cols` each); `out` holds `n x w.rows` and this
        /// thread owns the tile's elements; the CPU has the target features.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $name<const R: usize, const T: usize>(
            x: &[f32],
            w: &WeightView<'_>,
            o0: usize,
            t0: usize,
            out: *mut f32,
        ) {
            let cols = w.cols;
            let row_bytes = cols / 2;
            let blocks = cols / 32;
            let sm = ScaleMap::of(w);
            let wp: [*const u8; R] = std::array::from_fn(|r| {
                // SAFETY: row o0 + r < w.rows starts inside the checked bytes.
                unsafe { w.bytes.as_ptr().add((o0 + r) * row_bytes) }
            });
            let sp: [*const u8; R] = std::array::from_fn(|r| sm.row(o0 + r));
            let xp: [*const f32; T] = std::array::from_fn(|t| {
                // SAFETY: token t0 + t < n starts inside `x` (n * cols elements).
                unsafe { x.as_ptr().add((t0 + t) * cols) }
            });
            // Lane l of a block of eight takes nibble l of the block's four bytes.
            let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
            // Prefetch as the tiles' `prefetched_blocks!`: short rows along the
            // tile's contiguous bytes, into the next tiles; long rows each its own
            // stream.
            let row_mode = R * row_bytes > PREFETCH_AHEAD;
            let mut acc = [[_mm256_setzero_ps(); T]; R];
            for c in 0..blocks {
                if c % 4 == 0 {
                    for (r, base) in wp.iter().enumerate() {
                        let at = if row_mode {
                            base.wrapping_add(16 * c + PREFETCH_ROW)
                        } else {
                            wp[0].wrapping_add(PREFETCH_AHEAD + 64 * r + R * 16 * c)
                        };
                        // A prefetch is a hint that never faults, whatever the address.
                        _mm_prefetch::<_MM_HINT_T0>(at.cast::<i8>());
                    }
                }
                let tables: [_; R] = std::array::from_fn(|r| {
                    // SAFETY: block c < cols / 32 has one scale byte in the row's
                    // scales; every byte has a table of sixteen f32.
                    let $table = unsafe { SCALED.0[*sp[r].add(c) as usize].as_ptr() };
                    // SAFETY: `table` points at sixteen f32.
                    unsafe { $row_table }
                });
                for j in 0..4 {
                    let k = 32 * c + 8 * j;
                    let xv: [__m256; T] = std::array::from_fn(|t| {
                        // SAFETY: k + 8 <= cols.
                        unsafe { _mm256_loadu_ps(xp[t].add(k)) }
                    });
                    for r in 0..R {
                        // SAFETY: the block's four bytes (elements k..k+8) are in the row.
                        let nibbles = unsafe {
                            _mm256_set1_epi32(
                                wp[r].add(16 * c + 4 * j).cast::<i32>().read_unaligned(),
                            )
                        };
                        let $idx = _mm256_srlv_epi32(nibbles, shifts);
                        let $values = tables[r];
                        let wv = $weights;
                        for t in 0..T {
                            acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
                        }
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                for (t, &a) in acc.iter().enumerate() {
                    // SAFETY: (t0 + t, o0 + r) is within the output and owned by this
                    // thread.
                    unsafe { out.add((t0 + t) * w.rows + o0 + r).write(hsum(a)) };
                }
            }
        }
    };
}

mxfp4_tile!(
    /// The AVX-512 tile: a row keeps its sixteen values in two halves, and one
    /// two-table permute (`vpermi2ps`: index bits 0..2 pick a lane, bit 3 the half)
    /// gives a block's weights.
    tile, "avx2,fma,f16c,avx512f,avx512vl,avx512bw",
    |table| (_mm256_loadu_ps(table), _mm256_loadu_ps(table.add(8))),
    |halves, idx| _mm256_permutex2var_ps(halves.0, idx, halves.1)
);

mxfp4_tile!(
    /// The AVX2 tile (no two-table permute): each block's eight nibbles index the
    /// row's eight magnitudes (`vpermps` reads bits 0..2 of each lane) and bit 3
    /// sets the sign (`E2M1[8 + v]` is `−E2M1[v]`, and so is every entry of a scaled
    /// table but for e 255's NaNs, which a checked page never has). The same
    /// products, so the same bits.
    tile_avx2, "avx2,fma,f16c",
    |table| _mm256_loadu_ps(table),
    |magnitudes, idx| {
        let v = _mm256_permutevar8x32_ps(magnitudes, idx);
        let sign = _mm256_and_si256(_mm256_slli_epi32::<28>(idx), _mm256_set1_epi32(i32::MIN));
        _mm256_xor_ps(v, _mm256_castsi256_ps(sign))
    }
);

/// Rows `rows` of `out = x · Wᵀ` for an MXFP4 `w`: tiles of six rows at one or two
/// tokens (six independent multiply-add chains while the weights stream), four
/// rows by four tokens beyond.
///
/// # Safety
/// As `compute_rows` in `matmul.rs`, for a checked MXFP4 view, on a CPU where the
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

/// [`rows`] for AVX2: four rows at one or two tokens, three by four beyond (the
/// sixteen registers hold the accumulators, the tables and an activation).
///
/// # Safety
/// As [`rows`], on a CPU with AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows_avx2(
    x: &[f32],
    n: usize,
    w: &WeightView<'_>,
    rows: Range<usize>,
    out: *mut f32,
) {
    narrow_tiles!(tile_avx2, (4, 2), (3, 4), x, n, w, rows, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::view::e8m0_to_f32;

    #[test]
    fn scaled_tables_are_the_formats_products() {
        for e in 0..=255u8 {
            for (v, &got) in SCALED.0[e as usize].iter().enumerate() {
                let want = E2M1[v] * e8m0_to_f32(e);
                assert_eq!(got.to_bits(), want.to_bits(), "e {e} v {v}");
            }
        }
    }
}
