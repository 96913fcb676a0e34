//! Products over block-scaled weights (FP8 e4m3 with block scales, MXFP4, ggml's
//! block formats) on every instruction set, against the scalar specification: each
//! element `Σ_k x·w` in the module doc's order with `w` = [`WeightView::get`] (the
//! format's definition, written apart from the kernels' conversions).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::backend::view::{e4m3_to_f32, BlockScales};

/// The module doc's order over the format's own values.
fn spec_matmul(x: &[f32], n: usize, w: &WeightView<'_>) -> Vec<f32> {
    ordered(x, n, w, Order::Spec)
}

/// Orders of arithmetic: the spec's, and two others a kernel might be changed to.
#[derive(Clone, Copy, PartialEq)]
enum Order {
    /// `acc[k % 8] = fma(w(o, k), x[k], acc[k % 8])`, the fixed reduction, the tail.
    Spec,
    /// The same with the scale folded into the activation: `fma(q, s·x, acc)`.
    Folded,
    /// Unscaled values summed per 32 columns, each sum scaled, then added up (how
    /// integer-dot kernels order it).
    ScaledLast,
}

fn ordered(x: &[f32], n: usize, w: &WeightView<'_>, order: Order) -> Vec<f32> {
    let cols = w.cols;
    let k8 = cols / 8 * 8;
    let mut out = vec![0.0; n * w.rows];
    for t in 0..n {
        let xr = &x[t * cols..(t + 1) * cols];
        for o in 0..w.rows {
            let scale = |k: usize| w.get(o, k) / unscaled(w, o, k);
            let v = if order == Order::ScaledLast {
                let mut s = 0.0f32;
                for k0 in (0..cols).step_by(32) {
                    let mut b = 0.0f32;
                    for (k, &xk) in xr.iter().enumerate().take((k0 + 32).min(cols)).skip(k0) {
                        b = unscaled(w, o, k).mul_add(xk, b);
                    }
                    s = b.mul_add(scale(k0), s);
                }
                s
            } else {
                let mut acc = [0.0f32; 8];
                for k in 0..k8 {
                    acc[k % 8] = match order {
                        Order::Folded => unscaled(w, o, k).mul_add(scale(k) * xr[k], acc[k % 8]),
                        _ => w.get(o, k).mul_add(xr[k], acc[k % 8]),
                    };
                }
                let h: Vec<f32> = (0..4).map(|l| acc[l] + acc[l + 4]).collect();
                let mut s = (h[0] + h[2]) + (h[1] + h[3]);
                for (k, &xk) in xr.iter().enumerate().skip(k8) {
                    s = w.get(o, k).mul_add(xk, s);
                }
                s
            };
            out[t * w.rows + o] = v;
        }
    }
    out
}

/// Element (`o`, `k`) without its scale (1 where the value is 0, so that the
/// scale is still its quotient).
fn unscaled(w: &WeightView<'_>, o: usize, k: usize) -> f32 {
    let i = o * w.cols + k;
    let v = match w.format {
        WeightFormat::Fp8(_) => e4m3_to_f32(w.bytes[i]),
        WeightFormat::Mxfp4 { .. } => {
            let b = w.bytes[i / 2];
            E2M1[usize::from(if i.is_multiple_of(2) { b & 0xf } else { b >> 4 })]
        }
        WeightFormat::Plain(_) | WeightFormat::Ggml(_) => 1.0,
    };
    if v == 0.0 {
        1.0
    } else {
        v
    }
}

/// Random e4m3 bytes, never NaN (`0x7f`, `0xff`): zeros, subnormals, the range.
fn fp8_bytes(rng: &mut ChaCha8Rng, len: usize) -> Vec<u8> {
    (0..len)
        .map(|_| loop {
            let b: u8 = rng.gen();
            if b & 0x7f != 0x7f {
                break b;
            }
        })
        .collect()
}

/// Random block scales of `dtype` (F32 with all 24 bits of mantissa, or BF16),
/// positive as the releases' are, spanning a few binades.
fn scale_bytes(rng: &mut ChaCha8Rng, dtype: DType, len: usize) -> Vec<u8> {
    let mut b = Vec::new();
    for _ in 0..len {
        let v = (1.0 + rng.gen::<f32>()) * 2f32.powi(rng.gen_range(-12..2));
        match dtype {
            DType::BF16 => b.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes()),
            _ => b.extend_from_slice(&v.to_le_bytes()),
        }
    }
    b
}

fn random_x(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.gen_range(-2.0f32..2.0)).collect()
}

/// Every path's bits against `want` for `n` tokens of `x`, on 1 to 3 threads.
fn assert_paths(what: &str, w: WeightView<'_>, x: &[f32], n: usize, want: &[f32]) {
    for isa in Isa::available() {
        for threads in 1..=3 {
            let pool = ThreadPool::new(threads).unwrap();
            let mut out = vec![f32::NAN; n * w.rows];
            matmul_isa(isa, &pool, &x[..n * w.cols], n, w, &mut out).unwrap();
            for (i, (g, e)) in out.iter().zip(want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    e.to_bits(),
                    "{what} n={n} {isa:?} threads={threads} elem {i}: {g} vs {e}"
                );
            }
        }
    }
}

/// The transposed product (`x · w`, the weight's rows contracted) on every path and
/// thread count against its specification: each element one fused multiply-add a
/// term in increasing row over [`WeightView::get`]'s values; and [`widen_row`], by
/// which it reads the weight, gives `get`'s bits for every element.
fn assert_t_paths(what: &str, w: WeightView<'_>, x: &[f32], n: usize) {
    let (k, c) = (w.rows, w.cols);
    let mut want = vec![0f32; n * c];
    for t in 0..n {
        for j in 0..c {
            let mut acc = 0f32;
            for r in 0..k {
                acc = x[t * k + r].mul_add(w.get(r, j), acc);
            }
            want[t * c + j] = acc;
        }
    }
    for (r, isa) in (0..k).flat_map(|r| Isa::available().into_iter().map(move |i| (r, i))) {
        let a = r % c;
        let mut row = vec![0f32; c - a];
        widen_row(isa, &w, r, a..c, &mut row);
        for (j, v) in (a..c).zip(&row) {
            assert_eq!(
                v.to_bits(),
                w.get(r, j).to_bits(),
                "{what}: widened ({r}, {j}) {isa:?}"
            );
        }
    }
    for isa in Isa::available() {
        for threads in [1, 3] {
            let pool = ThreadPool::new(threads).unwrap();
            let mut out = vec![f32::NAN; n * c];
            matmul_t_isa(isa, &pool, &x[..n * k], n, w, &mut out).unwrap();
            for (i, (g, e)) in out.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    e.to_bits(),
                    "{what} transposed n={n} {isa:?} threads={threads} elem {i}: {g} vs {e}"
                );
            }
        }
    }
}

#[test]
fn the_e4m3_table_is_the_definition() {
    for b in 0..=255u8 {
        let (t, d) = (E4M3_F32[b as usize], e4m3_to_f32(b));
        if b & 0x7f == 0x7f {
            assert!(t.is_nan() && d.is_nan(), "{b:#x}");
        } else {
            assert_eq!(t.to_bits(), d.to_bits(), "{b:#x}: {t} vs {d}");
        }
    }
    // Landmarks of the format: 448 the largest, 2^-9 the least subnormal.
    assert_eq!(e4m3_to_f32(0x7e), 448.0);
    assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    assert_eq!(e4m3_to_f32(0x38), 1.0);
    assert_eq!(e4m3_to_f32(0xb8), -1.0);
}

/// FP8 with block scales: shapes with tails (cols % 8), partial edge blocks in both
/// dimensions, blocks of 8 to 128 columns and of 1 to 128 rows, F32 and BF16
/// scales, decode and prefill tile shapes, and views of some rows (`row0` inside a
/// block): every element has the spec's bits on every path and thread count.
#[test]
fn fp8_products_have_the_bits_of_the_spec() {
    let mut rng = ChaCha8Rng::seed_from_u64(36);
    let cases = [
        (1, 8, [1, 8]),
        (5, 13, [2, 8]),
        (7, 64, [128, 128]),
        (33, 300, [16, 32]),
        (130, 300, [128, 128]),
        (9, 576, [3, 64]),
        (64, 1031, [128, 128]),
        (17, 40, [5, 16]),
    ];
    for (rows, cols, [br, bc]) in cases {
        for sdt in [DType::F32, DType::BF16] {
            let wb = fp8_bytes(&mut rng, rows * cols);
            let nscales = rows.div_ceil(br) * cols.div_ceil(bc);
            let sb = scale_bytes(&mut rng, sdt, nscales);
            let scales = BlockScales {
                dtype: sdt,
                block_rows: br,
                block_cols: bc,
                row0: 0,
                bytes: &sb,
            };
            let w = WeightView::of(WeightFormat::Fp8(scales), rows, cols, &wb).unwrap();
            let x = random_x(&mut rng, 9 * cols);
            let want = spec_matmul(&x, 9, &w);
            let what = format!("fp8 {rows}x{cols} blocks {br}x{bc} scales {sdt}");
            for n in [1, 2, 3, 5, 9] {
                assert_paths(&what, w, &x, n, &want);
            }
            // Some rows of it: their scales follow them.
            let a = rng.gen_range(0..rows);
            let b = rng.gen_range(a + 1..=rows);
            let sub = w.slice_rows(a..b);
            sub.check().unwrap();
            let want_sub = spec_matmul(&x, 3, &sub);
            for t in 0..3 {
                for o in a..b {
                    assert_eq!(
                        want_sub[t * (b - a) + o - a].to_bits(),
                        want[t * rows + o].to_bits(),
                        "{what} rows {a}..{b}"
                    );
                }
            }
            assert_paths(&format!("{what} rows {a}..{b}"), sub, &x, 3, &want_sub);
            let xt = random_x(&mut rng, 3 * rows);
            assert_t_paths(&what, w, &xt, 3);
            assert_t_paths(&format!("{what} rows {a}..{b}"), sub, &xt, 2);
        }
    }
}

/// MXFP4: every nibble, every e8m0 scale but NaN (0, the subnormal 2^-127, to
/// 254), rows of 32 to 2880 columns: the spec's bits on every path.
#[test]
fn mxfp4_products_have_the_bits_of_the_spec() {
    let mut rng = ChaCha8Rng::seed_from_u64(37);
    for (rows, cols) in [(1, 32), (3, 64), (7, 96), (33, 320), (70, 2880), (16, 1024)] {
        let wb: Vec<u8> = (0..rows * cols / 2).map(|_| rng.gen()).collect();
        // Scales around 127 mostly (finite products), with the extremes mixed in.
        let sb: Vec<u8> = (0..rows * cols / 32)
            .map(|i| match i % 17 {
                0 => 0,
                1 => 1,
                2 => 250,
                _ => rng.gen_range(100..140),
            })
            .collect();
        let w = WeightView::of(WeightFormat::Mxfp4 { scales: &sb }, rows, cols, &wb).unwrap();
        let x = random_x(&mut rng, 9 * cols);
        let want = spec_matmul(&x, 9, &w);
        for n in [1, 2, 3, 4, 5, 7, 9] {
            assert_paths(&format!("mxfp4 {rows}x{cols}"), w, &x, n, &want);
        }
        let sub = w.slice_rows(rows / 3..rows);
        let want_sub = spec_matmul(&x, 2, &sub);
        assert_paths(&format!("mxfp4 {rows}x{cols} rows"), sub, &x, 2, &want_sub);
        let xt = random_x(&mut rng, 3 * rows);
        assert_t_paths(&format!("mxfp4 {rows}x{cols}"), w, &xt, 3);
        assert_t_paths(&format!("mxfp4 {rows}x{cols} rows"), sub, &xt, 1);
    }
}

/// The spec pins the order down: the kernels' results differ from a scale folded
/// into the activation (`fma(q, s·x, acc)`) and from block sums scaled afterwards
/// (how integer-dot kernels order it), on the same data. A kernel changed to either
/// fails the tests above.
#[test]
fn a_changed_order_gives_other_bits() {
    let mut rng = ChaCha8Rng::seed_from_u64(38);
    let (rows, cols) = (16, 256);
    let wb = fp8_bytes(&mut rng, rows * cols);
    let sb = scale_bytes(&mut rng, DType::F32, 2 * 8);
    let scales = BlockScales {
        dtype: DType::F32,
        block_rows: 8,
        block_cols: 32,
        row0: 0,
        bytes: &sb,
    };
    let w = WeightView::of(WeightFormat::Fp8(scales), rows, cols, &wb).unwrap();
    let x = random_x(&mut rng, 2 * cols);
    let mut out = vec![0.0; 2 * rows];
    matmul(&ThreadPool::single(), &x, 2, w, &mut out).unwrap();
    let spec = spec_matmul(&x, 2, &w);
    let folded = ordered(&x, 2, &w, Order::Folded);
    let scaled_last = ordered(&x, 2, &w, Order::ScaledLast);
    let differ = |other: &[f32]| {
        out.iter()
            .zip(other)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count()
    };
    assert_eq!(differ(&spec), 0);
    assert!(
        differ(&folded) > 0,
        "folding the scale into x changed no bit"
    );
    assert!(
        differ(&scaled_last) > 0,
        "scaling block sums changed no bit"
    );
}

/// A NaN byte (`0x7f`, `0xff`) and an e8m0 scale of 255 make their products NaN on
/// every path (the store refuses such weights at open; the kernels still never
/// turn them into numbers).
#[test]
fn nan_bytes_and_scales_give_nan() {
    let pool = ThreadPool::single();
    let one = 1f32.to_le_bytes();
    for nan in [0x7f, 0xff] {
        let mut wb = vec![0x38u8; 8 * 19];
        wb[8 * 19 - 1] = nan; // the tail of row 7
        wb[3] = nan; // a block of row 0
        let scales = BlockScales {
            dtype: DType::F32,
            block_rows: 8,
            block_cols: 32,
            row0: 0,
            bytes: &one,
        };
        let w = WeightView::of(WeightFormat::Fp8(scales), 8, 19, &wb).unwrap();
        for isa in Isa::available() {
            let mut out = vec![0.0; 8];
            matmul_isa(isa, &pool, &[1.0; 19], 1, w, &mut out).unwrap();
            for (o, v) in out.iter().enumerate() {
                assert_eq!(
                    v.is_nan(),
                    o == 0 || o == 7,
                    "{isa:?} {nan:#x} row {o}: {v}"
                );
            }
        }
    }
    let wb = vec![0x22u8; 2 * 16];
    let sb = [127u8, 255];
    let w = WeightView::of(WeightFormat::Mxfp4 { scales: &sb }, 2, 32, &wb).unwrap();
    for isa in Isa::available() {
        let mut out = vec![0.0; 2];
        matmul_isa(isa, &pool, &[1.0; 32], 1, w, &mut out).unwrap();
        assert_eq!(out[0], 32.0, "{isa:?}");
        assert!(out[1].is_nan(), "{isa:?}");
    }
}

/// Views whose scales or blocks do not fit their shape are typed errors, never a
/// read out of bounds.
#[test]
fn bad_scales_are_typed_errors() {
    let wb = vec![0u8; 4 * 64];
    let fp8 = |br, bc, row0, bytes: &'static [u8]| {
        WeightView::of(
            WeightFormat::Fp8(BlockScales {
                dtype: DType::F32,
                block_rows: br,
                block_cols: bc,
                row0,
                bytes,
            }),
            4,
            64,
            &[0u8; 256],
        )
        .map(|_| ())
    };
    static FOUR: [u8; 16] = [0; 16];
    assert!(fp8(2, 32, 0, &FOUR).is_ok());
    assert!(matches!(
        fp8(2, 32, 0, &FOUR[..12]),
        Err(KernelError::ScalesLen { .. })
    ));
    assert!(matches!(
        fp8(2, 24, 0, &FOUR),
        Err(KernelError::BlockShape { .. })
    ));
    assert!(matches!(
        fp8(2, 4, 0, &FOUR),
        Err(KernelError::BlockShape { .. })
    ));
    assert!(matches!(
        fp8(0, 32, 0, &FOUR),
        Err(KernelError::BlockShape { .. })
    ));
    assert!(matches!(
        fp8(2, 32, 2, &FOUR),
        Err(KernelError::BlockShape { .. })
    ));
    let mx = |cols, bytes: &[u8], scales: &[u8]| {
        WeightView::of(WeightFormat::Mxfp4 { scales }, 4, cols, bytes).map(|_| ())
    };
    assert!(matches!(
        mx(64, &wb[..128], &[0; 4]),
        Err(KernelError::ScalesLen { .. })
    ));
    assert!(mx(64, &wb[..128], &[0; 8]).is_ok());
    assert!(matches!(
        mx(48, &wb[..96], &[0; 6]),
        Err(KernelError::BlockShape { .. })
    ));
    assert!(matches!(
        mx(64, &wb[..100], &[0; 8]),
        Err(KernelError::WeightLen { .. })
    ));
    let pool = ThreadPool::single();
    let bad = WeightView {
        format: WeightFormat::Mxfp4 { scales: &[0; 7] },
        rows: 4,
        cols: 64,
        bytes: &wb[..128],
        lease: None,
    };
    assert!(matches!(
        matmul(&pool, &[0.0; 64], 1, bad, &mut [0.0; 4]),
        Err(KernelError::ScalesLen { .. })
    ));
}

/// The module doc's order over a matrix's values given dense (`dense[o*cols + k]`).
fn spec_dense(x: &[f32], n: usize, dense: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let k8 = cols / 8 * 8;
    let mut out = vec![0.0; n * rows];
    for t in 0..n {
        let xr = &x[t * cols..(t + 1) * cols];
        for o in 0..rows {
            let wr = &dense[o * cols..(o + 1) * cols];
            let mut acc = [0.0f32; 8];
            for k in 0..k8 {
                acc[k % 8] = wr[k].mul_add(xr[k], acc[k % 8]);
            }
            let h: Vec<f32> = (0..4).map(|l| acc[l] + acc[l + 4]).collect();
            let mut s = (h[0] + h[2]) + (h[1] + h[3]);
            for k in k8..cols {
                s = wr[k].mul_add(xr[k], s);
            }
            out[t * rows + o] = s;
        }
    }
    out
}

/// Every ggml block format vOOM runs: rows assembled from ggml's own blocks of the
/// type (and, so that every bit pattern meets the kernels, random bytes under a
/// finite scale), one to several blocks a row, decode and prefill token counts (the
/// packed path's too): every element has the spec's bits ([`WeightView::get`]'s
/// values, the module doc's order) on every path and thread count; views of some
/// rows, the transposed product and [`widen_row`] likewise; and `read_row` gives
/// `get`'s bits.
#[test]
fn ggml_products_have_the_bits_of_the_spec() {
    use crate::backend::view::ggml_block;
    let mut rng = ChaCha8Rng::seed_from_u64(39);
    let blocks = super::ggml::fixture_blocks();
    let mut types: Vec<_> = blocks.iter().map(|(t, _)| *t).collect();
    types.dedup();
    assert!(types.len() >= 13, "fixture types: {types:?}");
    let (mut compared, mut cases) = (0, 0);
    for ty in types {
        let (block, bytes) = ggml_block(ty);
        let own: Vec<&Vec<u8>> = blocks
            .iter()
            .filter(|(t, _)| *t == ty)
            .map(|(_, b)| b)
            .collect();
        let shapes: &[(usize, usize)] = if block == 32 {
            &[(1, 32), (5, 64), (13, 96), (33, 320)]
        } else {
            &[(1, 256), (7, 512), (19, 768)]
        };
        for &(rows, cols) in shapes {
            let mut wb = Vec::new();
            for _ in 0..rows * cols / block {
                if rng.gen_range(0..4) == 0 {
                    // Random bytes with every f16 field of the header made finite: the
                    // first two bytes (d) of the 32-element types, the last four (d,
                    // dmin) of the k-quants but Q6_K/Q3_K (d last) and IQ4_XS (d first).
                    let mut b: Vec<u8> = (0..bytes).map(|_| rng.gen()).collect();
                    for i in 0..bytes / 2 {
                        let h = half::f16::from_bits(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]));
                        if !h.is_finite() {
                            b[2 * i + 1] &= 0x3f;
                        }
                    }
                    wb.extend_from_slice(&b);
                } else {
                    wb.extend_from_slice(own[rng.gen_range(0..own.len())]);
                }
            }
            let w = WeightView::of(WeightFormat::Ggml(ty), rows, cols, &wb).unwrap();
            let mut dense = vec![0f32; rows * cols];
            for (o, row) in dense.chunks_exact_mut(cols).enumerate() {
                w.read_row(o, row);
                for (k, v) in row.iter().enumerate().step_by(7) {
                    assert_eq!(
                        v.to_bits(),
                        w.get(o, k).to_bits(),
                        "{ty} read_row ({o}, {k})"
                    );
                }
            }
            cases += 1;
            if dense.iter().any(|v| !v.is_finite()) {
                // A random block's nibbles can still overflow a product; keep the
                // comparison to finite sums.
                continue;
            }
            let x = random_x(&mut rng, 50 * cols);
            let want = spec_dense(&x, 50, &dense, rows, cols);
            let what = format!("{ty} {rows}x{cols}");
            for n in [1, 2, 3, 5, 9, 50] {
                assert_paths(&what, w, &x, n, &want);
            }
            let (a, b) = (rows / 3, rows);
            let sub = w.slice_rows(a..b);
            sub.check().unwrap();
            let want_sub = spec_dense(&x, 3, &dense[a * cols..], b - a, cols);
            assert_paths(&format!("{what} rows {a}..{b}"), sub, &x, 3, &want_sub);
            let xt = random_x(&mut rng, 2 * rows);
            assert_t_paths(&what, w, &xt, 2);
            compared += 1;
        }
    }
    assert!(
        compared * 4 >= cases * 3,
        "only {compared} of {cases} shapes finite"
    );
}

/// ggml-block views that do not fit their shape, or of a type with no
/// dequantization, are typed errors.
#[test]
fn bad_ggml_views_are_typed_errors() {
    use voom_formats::gguf::GgmlType;
    let ok = WeightView::of(WeightFormat::Ggml(GgmlType::Q4_K), 2, 512, &[0u8; 4 * 144]);
    assert!(ok.is_ok());
    assert!(matches!(
        WeightView::of(
            WeightFormat::Ggml(GgmlType::Q4_K),
            2,
            512,
            &[0u8; 4 * 144 - 1]
        ),
        Err(KernelError::WeightLen { .. })
    ));
    assert!(matches!(
        WeightView::of(WeightFormat::Ggml(GgmlType::Q8_0), 1, 48, &[0u8; 68]),
        Err(KernelError::PartialBlock { .. })
    ));
    assert!(matches!(
        WeightView::of(WeightFormat::Ggml(GgmlType::IQ2_XXS), 1, 256, &[0u8; 66]),
        Err(KernelError::UnsupportedFormat(_))
    ));
    let pool = ThreadPool::single();
    let bad = WeightView {
        format: WeightFormat::Ggml(GgmlType::Q8_0),
        rows: 2,
        cols: 32,
        bytes: &[0u8; 34],
        lease: None,
    };
    assert!(matches!(
        matmul(&pool, &[0.0; 32], 1, bad, &mut [0.0; 2]),
        Err(KernelError::WeightLen { .. })
    ));
}
