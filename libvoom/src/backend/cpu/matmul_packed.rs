//! AVX-512 products of many tokens over packed weights (prefill).
//!
//! The tiles of `matmul.rs` keep one eight-lane register per output element and sum
//! it horizontally at the end; with many tokens, converting each weight block per
//! tile and the horizontal sums cost a third of the multiply-add peak. Here the
//! weights of a panel of 16 rows are widened to f32 once per call and transposed
//! into a scratch panel `[k][16]`, so that one 512-bit register holds sixteen rows'
//! terms of one column `k`, and each token's activation `x[t][k]` is broadcast
//! against it.
//!
//! The order of arithmetic per output element is the module doc's, unchanged: the
//! eight lanes of step 1 are eight registers, `acc[l]` holding lane `l` (the
//! columns `k ≡ l mod 8`) of sixteen rows, each lane still one fused multiply-add
//! a column in increasing `k` from `+0.0`; step 2's reduction is the same additions
//! done across registers instead of within one; step 3's tail follows in
//! increasing `k`. So the bits equal every other path's.
//!
//! Blocking: a panel of [`KC`] columns (16 KiB of f32) stays in the first-level
//! cache while every token of the call passes over it, [`TOKENS`] at a time (8
//! lanes x 3 tokens = 24 accumulator registers of 32). Longer rows are taken
//! [`KC`] columns at a time, [`GROUP`] panels through each block before the next,
//! the accumulators kept in a scratch array between blocks (storing and reloading
//! an f32 changes no bit).

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::ops::Range;

use super::{elem_size, load1, WeightView, DT_BF16, DT_F16};

/// Rows of a panel: the sixteen f32 lanes of a 512-bit register.
pub(super) const PANEL: usize = 16;

/// Tokens a micro-kernel call carries: eight lanes each, 24 accumulators.
const TOKENS: usize = 3;

/// Columns of a packed block (a multiple of 8): 16 rows x 256 x 4 bytes = 16 KiB.
const KC: usize = 256;

/// Floats of one token's accumulators (eight lanes of a panel).
const ACC: usize = 8 * PANEL;

/// Panels that go through a column block together, so that the block's columns of
/// every token's activations (a quarter of a MiB for 256 tokens) are read from the
/// second-level cache by each panel after the first; their accumulators between
/// blocks take `GROUP * ACC` floats a token.
const GROUP: usize = 4;

thread_local! {
    /// The packed panel and the accumulators between column blocks, per thread.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Rows `rows` of `out` for all `n` tokens.
///
/// # Safety
/// As `compute_rows` in `matmul.rs`, and the CPU has AVX-512 F/VL/BW with AVX2,
/// FMA and F16C.
pub(super) unsafe fn rows<const DT: u8>(
    x: &[f32],
    n: usize,
    w: &WeightView<'_>,
    rows: Range<usize>,
    out: *mut f32,
) {
    let k8 = w.cols - w.cols % 8;
    // Packed columns: a block plus a tail of up to seven.
    let panel_len = PANEL * (KC + 8);
    let acc_len = if k8 > KC { GROUP * n * ACC } else { 0 };
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        // 15 floats of slack to start the panel on a 64-byte line.
        let need = panel_len + acc_len + 15;
        if s.len() < need {
            s.resize(need, 0.0);
        }
        let skip = s.as_ptr().align_offset(64);
        let (panel, acc) = s[skip..].split_at_mut(panel_len);
        // SAFETY: forwarded contract; `panel` is 64-byte aligned and holds a block,
        // `acc` n tokens' accumulators where there is more than one block.
        unsafe { drive::<DT>(x, n, w, rows, out, panel, acc) }
    })
}

/// # Safety
/// As [`rows`]; `panel` 64-byte aligned with `PANEL * (KC + 8)` floats, `acc`
/// `GROUP * n * ACC` floats if `w.cols` has more than `KC` columns of full blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
unsafe fn drive<const DT: u8>(
    x: &[f32],
    n: usize,
    w: &WeightView<'_>,
    rows: Range<usize>,
    out: *mut f32,
    panel: &mut [f32],
    acc: &mut [f32],
) {
    let cols = w.cols;
    let k8 = cols - cols % 8;
    let size = elem_size(DT);
    // Columns k0.. of a block: (its full blocks' end, whether it is the last, its
    // end with the tail columns, which the last block packs too).
    let block = |k0: usize| {
        let k1 = (k0 + KC).min(k8);
        (k1, k1 == k8, if k1 == k8 { cols } else { k1 })
    };
    let mut g = rows.start;
    while g < rows.end {
        let gend = (g + GROUP * PANEL).min(rows.end);
        let mut k0 = 0;
        loop {
            let (k1, last, kend) = block(k0);
            let mut o = g;
            let mut pi = 0;
            while o < gend {
                let live = (gend - o).min(PANEL);
                // SAFETY: rows o..o+live < w.rows and columns k0..kend <= cols are
                // in the checked weight bytes; the panel holds kend - k0 <= KC + 7
                // columns.
                unsafe { pack::<DT>(w, o, live, k0, kend, panel.as_mut_ptr()) };
                // The next panel's weights come from memory while this one computes:
                // the group's next panel, its first at the next block, or the next
                // group's first.
                let next = if o + live < gend {
                    Some((o + live, k0))
                } else if !last {
                    Some((g, k1))
                } else if gend < rows.end {
                    Some((gend, 0))
                } else {
                    None
                };
                if let Some((no, nk0)) = next {
                    let nlive = (rows.end - no).min(PANEL);
                    prefetch_block(w, size, no, nlive, nk0, block(nk0).2);
                }
                let step = Step {
                    panel: panel.as_ptr(),
                    blocks: (k1 - k0) / 8,
                    tail: kend - k1,
                    first: k0 == 0,
                    last,
                    // Panel pi < GROUP of the group: dereferenced only where there
                    // is more than one block, when acc holds GROUP panels.
                    acc: acc.as_mut_ptr().wrapping_add(pi * n * ACC),
                };
                let mut t = 0;
                while t < n {
                    let tn = (n - t).min(TOKENS);
                    // SAFETY: tokens t..t+tn < n; x holds n*cols floats, so the
                    // columns k0..kend of each are in bounds; acc holds this panel's
                    // n tokens' lanes when `first && last` is false; out rows
                    // o..o+live of these tokens are this call's (the caller's
                    // contract).
                    unsafe {
                        let xs = x.as_ptr().add(t * cols + k0);
                        match tn {
                            3 => micro::<3>(&step, xs, cols, t, out, w.rows, o, live),
                            2 => micro::<2>(&step, xs, cols, t, out, w.rows, o, live),
                            _ => micro::<1>(&step, xs, cols, t, out, w.rows, o, live),
                        }
                    }
                    t += tn;
                }
                o += live;
                pi += 1;
            }
            if last {
                break;
            }
            k0 = k1;
        }
        g = gend;
    }
}

/// Prefetches the weight bytes of rows `o..o+live`, columns `k0..kend`, a cache
/// line at a time (hardware prefetchers pick up sixteen interleaved short streams
/// late). A prefetch never faults; the addresses are only computed.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
fn prefetch_block(w: &WeightView<'_>, size: usize, o: usize, live: usize, k0: usize, kend: usize) {
    let base = w.bytes.as_ptr();
    for r in o..o + live {
        let from = base.wrapping_add((r * w.cols + k0) * size);
        let to = base.wrapping_add((r * w.cols + kend) * size);
        let mut p = from;
        while p < to {
            _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>());
            p = p.wrapping_add(64);
        }
    }
}

/// Widens and transposes rows `o..o+live`, columns `k0..kend` into
/// `panel[(k - k0) * 16 + r]`; lanes `live..16` are zero.
///
/// # Safety
/// The rows and columns are within `w`; `panel` valid for `(kend - k0) * 16` floats
/// and 64-byte aligned.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
unsafe fn pack<const DT: u8>(
    w: &WeightView<'_>,
    o: usize,
    live: usize,
    k0: usize,
    kend: usize,
    panel: *mut f32,
) {
    let size = elem_size(DT);
    let row = |r: usize| -> *const u8 {
        // SAFETY: row o + r < w.rows starts inside the checked bytes.
        unsafe { w.bytes.as_ptr().add((o + r) * w.cols * size) }
    };
    let mut k = k0;
    if live == PANEL {
        // Sixteen columns at a time: sixteen rows widened, transposed in registers.
        while k + 16 <= kend {
            // SAFETY: columns k..k+16 of the sixteen rows are in bounds; the panel
            // has room for sixteen columns from k - k0.
            unsafe {
                let mut v: [__m512; 16] =
                    std::array::from_fn(|r| load16::<DT>(row(r).add(k * size)));
                transpose16(&mut v);
                for (c, vc) in v.iter().enumerate() {
                    _mm512_store_ps(panel.add((k - k0 + c) * PANEL), *vc);
                }
            }
            k += 16;
        }
    }
    for kk in k..kend {
        for r in 0..PANEL {
            let v = if r < live {
                // SAFETY: column kk < cols of row o + r < w.rows.
                unsafe { load1::<DT>(row(r), kk) }
            } else {
                0.0
            };
            // SAFETY: kk - k0 < kend - k0 columns of the panel.
            unsafe { panel.add((kk - k0) * PANEL + r).write(v) };
        }
    }
}

/// Sixteen elements of `DT` at `p` widened to f32 (exact).
///
/// # Safety
/// `p` valid for sixteen elements.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
unsafe fn load16<const DT: u8>(p: *const u8) -> __m512 {
    // SAFETY: the caller guarantees sixteen readable elements; loads are unaligned.
    unsafe {
        match DT {
            DT_BF16 => {
                let h = _mm256_loadu_si256(p.cast::<__m256i>());
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
            DT_F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast::<__m256i>())),
            _ => _mm512_loadu_ps(p.cast::<f32>()),
        }
    }
}

/// Transposes a 16 x 16 block of f32 held as sixteen rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
pub(in crate::backend::cpu) fn transpose16(v: &mut [__m512; 16]) {
    // Pairs of rows interleaved by 32, then 64 bits, then 128-bit quarters.
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
    }
    for i in 0..4 {
        for j in 0..2 {
            let (a, b) = (t[4 * i + j], t[4 * i + j + 2]);
            let (a, b) = (_mm512_castps_pd(a), _mm512_castps_pd(b));
            v[4 * i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            v[4 * i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
    }
    // v[4i + c] holds rows 4i..4i+4 of column 4q + c in its quarter q.
    for i in 0..2 {
        for c in 0..4 {
            let (a, b) = (v[8 * i + c], v[8 * i + 4 + c]);
            t[8 * i + c] = _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b);
            t[8 * i + 4 + c] = _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b);
        }
    }
    // t[8i + c] holds rows 8i..8i+8 of columns c and 8 + c, t[8i + 4 + c] of 4 + c
    // and 12 + c.
    for c in 0..4 {
        for h in 0..2 {
            let (a, b) = (t[4 * h + c], t[8 + 4 * h + c]);
            v[c + 4 * h] = _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b);
            v[c + 4 * h + 8] = _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b);
        }
    }
}

/// One column block of a panel: what every micro-kernel call over it shares.
struct Step {
    panel: *const f32,
    blocks: usize,
    tail: usize,
    first: bool,
    last: bool,
    acc: *mut f32,
}

/// Tokens `t0..t0+T` (activations from `xs`, `cols` floats apart, at the block's
/// first column) over the block: lanes from zero or from the accumulators, and to
/// the accumulators, or reduced with the tail into `out` rows `o..o+live`.
///
/// # Safety
/// As in [`drive`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
// Indexed loops: constant indices once unrolled keep the accumulators in registers.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
unsafe fn micro<const T: usize>(
    s: &Step,
    xs: *const f32,
    cols: usize,
    t0: usize,
    out: *mut f32,
    out_rows: usize,
    o: usize,
    live: usize,
) {
    // SAFETY: the caller's contract covers every pointer below.
    unsafe {
        let xp: [*const f32; T] = std::array::from_fn(|t| xs.add(t * cols));
        let saved = |t: usize, l: usize| s.acc.add(((t0 + t) * 8 + l) * PANEL);
        let mut acc = [[_mm512_setzero_ps(); 8]; T];
        if !s.first {
            for (t, a) in acc.iter_mut().enumerate() {
                for (l, lane) in a.iter_mut().enumerate() {
                    *lane = _mm512_loadu_ps(saved(t, l));
                }
            }
        }
        let mut wp = s.panel;
        let mut xo = 0;
        for _ in 0..s.blocks {
            for l in 0..8 {
                let wv = _mm512_load_ps(wp.add(l * PANEL));
                for t in 0..T {
                    let xv = _mm512_set1_ps(*xp[t].add(xo + l));
                    acc[t][l] = _mm512_fmadd_ps(wv, xv, acc[t][l]);
                }
            }
            wp = wp.add(8 * PANEL);
            xo += 8;
        }
        if !s.last {
            for (t, a) in acc.iter().enumerate() {
                for (l, lane) in a.iter().enumerate() {
                    _mm512_storeu_ps(saved(t, l), *lane);
                }
            }
            return;
        }
        let mask: __mmask16 = if live == PANEL {
            !0
        } else {
            (1u16 << live) - 1
        };
        for (t, a) in acc.iter().enumerate() {
            let h0 = _mm512_add_ps(a[0], a[4]);
            let h1 = _mm512_add_ps(a[1], a[5]);
            let h2 = _mm512_add_ps(a[2], a[6]);
            let h3 = _mm512_add_ps(a[3], a[7]);
            let mut sum = _mm512_add_ps(_mm512_add_ps(h0, h2), _mm512_add_ps(h1, h3));
            for kk in 0..s.tail {
                let wv = _mm512_load_ps(wp.add(kk * PANEL));
                let xv = _mm512_set1_ps(*xp[t].add(xo + kk));
                sum = _mm512_fmadd_ps(wv, xv, sum);
            }
            _mm512_mask_storeu_ps(out.add((t0 + t) * out_rows + o), mask, sum);
        }
    }
}
