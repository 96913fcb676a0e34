//! The MLX backend's ops (builds that link MLX: feature `mlx`), each against the CPU
//! backend's (within float32 rounding: the two sum in different orders), and MLX's
//! own batch invariance: a row's bits do not depend on the rows computed with it,
//! nor a query's on the cache's length or page size. The conformance suites run
//! every architecture on MLX (`BackendKind::available()` includes it).
#![cfg(voom_mlx)]

mod common;

use libvoom::backend::cpu::matmul::Isa;
use libvoom::backend::cpu::CpuBackend;
use libvoom::backend::mlx::{MlxAct, MlxBackend};
use libvoom::backend::view::{BlockScales, WeightFormat};
use libvoom::backend::{
    Activation, AttentionShape, Backend, BackendKind, KernelError, LatentShape, RopeShape,
    RopeTable, TableView, VecView, WeightView,
};
use libvoom::kv::KvCache;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use voom_formats::DType;
use vpaged::{PageId, PageLease};

fn random(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-2.0f32..2.0)).collect()
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn cpu() -> CpuBackend {
    CpuBackend::new(2, Isa::Portable).unwrap()
}

fn mlx() -> MlxBackend {
    MlxBackend::new().unwrap()
}

/// `got` within `tol` (relative to 1 + |want|) of `want`.
fn close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: MLX {g} vs CPU {w}"
        );
    }
}

#[test]
fn mlx_is_listed_and_named() {
    assert!(BackendKind::available().contains(&BackendKind::Mlx));
    assert_eq!(BackendKind::parse("mlx").unwrap(), BackendKind::Mlx);
    let b = mlx();
    assert!(
        b.name() == "mlx-cpu" || b.name() == "mlx-gpu",
        "{}",
        b.name()
    );
    assert!(!MlxBackend::version().is_empty());
}

fn product<B: Backend>(b: &B, x: &[f32], n: usize, w: WeightView<'_>, t: bool) -> Vec<f32> {
    let k = if t { w.rows } else { w.cols };
    let xa = b.upload(n, k, x).unwrap();
    let mut out = b.zeros(n, if t { w.cols } else { w.rows });
    if t {
        b.matmul_t(&xa, w, &mut out).unwrap();
    } else {
        b.matmul(&xa, w, &mut out).unwrap();
    }
    b.download_owned(out).unwrap()
}

/// BF16, F16 and F32 weights (an F32 view at an odd address too: copied to an
/// aligned buffer, and counted), both products, against the CPU's.
#[test]
fn products_match_the_cpu_for_every_dtype_and_alignment() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let (n, rows, cols) = (5, 37, 70);
    let vals = random(&mut rng, rows * cols);
    let bf16 = bf16_bytes(&vals);
    let f16: Vec<u8> = vals
        .iter()
        .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
        .collect();
    let mut f32b = vec![0u8];
    f32b.extend(vals.iter().flat_map(|v| v.to_le_bytes()));
    let (c, m) = (cpu(), mlx());
    for (dtype, bytes) in [
        (DType::BF16, &bf16[..]),
        (DType::F16, &f16[..]),
        (DType::F32, &f32b[1..]),
    ] {
        let w = WeightView::new(dtype, rows, cols, bytes).unwrap();
        let x = random(&mut rng, n * cols);
        close(
            &format!("{dtype} matmul"),
            &product(&m, &x, n, w, false),
            &product(&c, &x, n, w, false),
            1e-5,
        );
        let xt = random(&mut rng, n * rows);
        close(
            &format!("{dtype} matmul_t"),
            &product(&m, &xt, n, w, true),
            &product(&c, &xt, n, w, true),
            1e-5,
        );
    }
    assert!(
        m.copied_bytes() >= (rows * cols * 4) as u64,
        "the misaligned F32 view was copied and counted"
    );
}

/// MLX's and the CPU's products of `x` (`n` rows) with `w` (`t`: transposed) agree
/// within float32 rounding of their sums: `1e-6` of the sum of the terms' sizes.
fn products_agree(
    what: &str,
    m: &MlxBackend,
    c: &CpuBackend,
    x: &[f32],
    n: usize,
    w: WeightView<'_>,
    t: bool,
) {
    let (got, want) = (product(m, x, n, w, t), product(c, x, n, w, t));
    let (k, outs) = if t {
        (w.rows, w.cols)
    } else {
        (w.cols, w.rows)
    };
    for i in 0..n {
        for o in 0..outs {
            let size: f32 = (0..k)
                .map(|j| {
                    let v = if t { w.get(j, o) } else { w.get(o, j) };
                    (x[i * k + j] * v).abs()
                })
                .sum();
            let (g, e) = (got[i * outs + o], want[i * outs + o]);
            assert!(
                (g - e).abs() <= 1e-6 * (1.0 + size),
                "{what} [{i}, {o}]: MLX {g} vs CPU {e} (terms' sizes {size})"
            );
        }
    }
}

/// FP8 e4m3 bytes (no NaN) with a scale per block, in F32 and BF16, blocks that do
/// and do not divide the columns, the last block row partial, and views of some of
/// the rows (their first row inside a block row, at an odd address): both products
/// against the CPU's.
#[test]
fn fp8_products_match_the_cpu_for_every_block_layout() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (c, m) = (cpu(), mlx());
    for (rows, cols, block_rows, block_cols, scale_dtype) in [
        (37usize, 64usize, 16usize, 16usize, DType::F32),
        (37, 70, 16, 8, DType::BF16),
        (20, 128, 128, 128, DType::F32),
    ] {
        let mut bytes = vec![0u8; 1];
        bytes.extend((0..rows * cols).map(|_| {
            let b: u8 = rng.gen();
            if b & 0x7f == 0x7f {
                0x3c
            } else {
                b
            }
        }));
        let (br, bc) = (rows.div_ceil(block_rows), cols.div_ceil(block_cols));
        let sv: Vec<f32> = (0..br * bc).map(|_| rng.gen_range(0.001f32..0.5)).collect();
        let scales: Vec<u8> = if scale_dtype == DType::F32 {
            sv.iter().flat_map(|v| v.to_le_bytes()).collect()
        } else {
            bf16_bytes(&sv)
        };
        let format = WeightFormat::Fp8(BlockScales {
            dtype: scale_dtype,
            block_rows,
            block_cols,
            row0: 0,
            bytes: &scales,
        });
        let w = WeightView::of(format, rows, cols, &bytes[1..]).unwrap();
        for view in [w, w.slice_rows(5..rows - 2)] {
            let what = format!(
                "FP8 {rows}x{cols} blocks {block_rows}x{block_cols} {scale_dtype}, rows {}",
                view.rows
            );
            let x = random(&mut rng, 3 * view.cols);
            products_agree(&format!("{what} matmul"), &m, &c, &x, 3, view, false);
            let xt = random(&mut rng, 3 * view.rows);
            products_agree(&format!("{what} matmul_t"), &m, &c, &xt, 3, view, true);
        }
    }
}

/// MXFP4 pairs with their e8m0 scales (the subnormal 2^-127 among them), at an
/// aligned and an odd address (copied to an aligned buffer, and counted), a view of
/// some rows: both products against the CPU's.
#[test]
fn mxfp4_products_match_the_cpu() {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let (c, m) = (cpu(), mlx());
    let (rows, cols) = (37, 96);
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.gen()).collect();
    let mut scales: Vec<u8> = (0..rows * cols / 32)
        .map(|_| rng.gen_range(118..134))
        .collect();
    scales[0] = 0;
    scales[4] = 1;
    let mut odd = vec![0u8];
    odd.extend(&packed);
    let copied = m.copied_bytes();
    for (at, bytes) in [("aligned", &packed[..]), ("odd", &odd[1..])] {
        let w = WeightView::of(WeightFormat::Mxfp4 { scales: &scales }, rows, cols, bytes).unwrap();
        for view in [w, w.slice_rows(3..rows - 1)] {
            let what = format!("MXFP4 {at}, rows {}", view.rows);
            let x = random(&mut rng, 4 * cols);
            products_agree(&format!("{what} matmul"), &m, &c, &x, 4, view, false);
            let xt = random(&mut rng, 4 * view.rows);
            products_agree(&format!("{what} matmul_t"), &m, &c, &xt, 4, view, true);
        }
    }
    assert!(
        m.copied_bytes() - copied >= packed.len() as u64,
        "the odd MXFP4 view was copied and counted"
    );
}

/// A row's product has the same bits whether 1, 3 or 40 rows are computed together
/// (MLX's CPU build; its GPU is not claimed batch invariant).
#[test]
fn a_products_rows_do_not_depend_on_the_rows_beside_them() {
    let m = mlx();
    if !m.batch_invariant() {
        eprintln!("skipped: {} is not claimed batch invariant", m.name());
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let (rows, cols) = (96, 576);
    let w = bf16_bytes(&random(&mut rng, rows * cols));
    let w = WeightView::new(DType::BF16, rows, cols, &w).unwrap();
    let x = random(&mut rng, 40 * cols);
    let all = product(&m, &x, 40, w, false);
    for (from, n) in [(0, 1), (7, 3), (39, 1), (0, 40)] {
        let part = product(&m, &x[from * cols..(from + n) * cols], n, w, false);
        assert_eq!(
            bits(&part),
            bits(&all[from * rows..(from + n) * rows]),
            "rows {from}..{}",
            from + n
        );
    }
}

fn elementwise<B: Backend>(b: &B, x: &[f32], y: &[f32], rows: usize, cols: usize) -> Vec<Vec<f32>> {
    let up = |v: &[f32]| b.upload(rows, cols, v).unwrap();
    let w: Vec<f32> = (0..cols).map(|i| 0.5 + i as f32 / cols as f32).collect();
    let wb = bf16_bytes(&w);
    let norm = VecView {
        dtype: DType::BF16,
        bytes: &wb,
        plus_one: false,
    };
    let mut out = Vec::new();
    let mut n = b.zeros(rows, cols);
    b.rms_norm(&up(x), norm, 1e-6, &mut n).unwrap();
    out.push(b.download_owned(n).unwrap());
    let mut g = up(x);
    b.rms_norm_groups(
        &mut g,
        8,
        // The first 8 values, zero-centred.
        VecView {
            dtype: DType::BF16,
            bytes: &wb[..16],
            plus_one: true,
        },
        1e-5,
    )
    .unwrap();
    out.push(b.download_owned(g).unwrap());
    let mut a = up(x);
    b.add(&mut a, &up(y)).unwrap();
    b.add_bias(&mut a, norm).unwrap();
    out.push(b.download_owned(a).unwrap());
    let mut s = up(x);
    b.gated(Activation::Silu, &mut s, &up(y)).unwrap();
    out.push(b.download_owned(s).unwrap());
    let mut cs = up(x);
    b.gated(
        Activation::ClampedSwiglu {
            alpha: 1.702,
            limit: 1.25,
        },
        &mut cs,
        &up(y),
    )
    .unwrap();
    out.push(b.download_owned(cs).unwrap());
    let mut c = up(x);
    b.clamp(&mut c, 1.25).unwrap();
    out.push(b.download_owned(c).unwrap());
    let mut sm = up(x);
    b.softmax(&mut sm).unwrap();
    out.push(b.download_owned(sm).unwrap());
    let mut sg = up(x);
    b.sigmoid(&mut sg).unwrap();
    out.push(b.download_owned(sg).unwrap());
    out
}

#[test]
fn norms_activations_and_softmax_match_the_cpu() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let (rows, cols) = (6, 48);
    let (x, y) = (random(&mut rng, rows * cols), random(&mut rng, rows * cols));
    let got = elementwise(&mlx(), &x, &y, rows, cols);
    let want = elementwise(&cpu(), &x, &y, rows, cols);
    let names = [
        "rms_norm",
        "rms_norm_groups (zero-centred)",
        "add + bias",
        "silu gate",
        "clamped SwiGLU gate (limit below the inputs' range)",
        "clamp",
        "softmax",
        "sigmoid",
    ];
    for ((g, w), name) in got.iter().zip(&want).zip(names) {
        close(name, g, w, 2e-6);
    }
}

fn rotary<B: Backend>(b: &B, x: &[f32], rows: usize, shape: &RopeShape, t: &RopeTable) -> Vec<f32> {
    let cols = x.len() / rows;
    let mut a = b.upload(rows, cols, x).unwrap();
    b.rope(&mut a, shape, t).unwrap();
    b.download_owned(a).unwrap()
}

#[test]
fn rotary_embedding_matches_the_cpu_in_every_layout() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let (rows, hd, heads, half) = (3, 16, 2, 6);
    let x = random(&mut rng, rows * hd * heads);
    let table = RopeTable {
        half,
        cos: (0..rows * half).map(|i| (i as f32 * 0.37).cos()).collect(),
        sin: (0..rows * half).map(|i| (i as f32 * 0.37).sin()).collect(),
    };
    for shape in [
        RopeShape {
            head_dim: hd,
            offset: 0,
            interleaved: false,
        },
        RopeShape {
            head_dim: hd,
            offset: 4,
            interleaved: false,
        },
        RopeShape {
            head_dim: hd,
            offset: 2,
            interleaved: true,
        },
    ] {
        let got = rotary(&mlx(), &x, rows, &shape, &table);
        let want = rotary(&cpu(), &x, rows, &shape, &table);
        // Element-wise products and sums, each rounded: the same bits.
        assert_eq!(bits(&got), bits(&want), "{shape:?}");
    }
}

/// Attention of `n` queries after `pos0` cached positions (pages of `page`).
#[allow(clippy::too_many_arguments)]
fn attend<B: Backend>(
    b: &B,
    shape: &AttentionShape,
    kc: &[f32],
    vc: &[f32],
    q: &[f32],
    pos0: usize,
    n: usize,
    page: usize,
) -> Vec<f32> {
    let kvd = shape.kv_heads * shape.head_dim;
    let qd = shape.heads * shape.head_dim;
    let mut kv = KvCache::with_page(1, kvd, pos0 + n, page);
    if pos0 > 0 {
        kv.append(0, &kc[..pos0 * kvd], &vc[..pos0 * kvd]).unwrap();
        kv.commit(&vec![0; pos0]);
    }
    let up = |v: &[f32], c| b.upload(n, c, v).unwrap();
    let mut out = b.zeros(n, qd);
    b.attention(
        &up(q, qd),
        &up(&kc[pos0 * kvd..(pos0 + n) * kvd], kvd),
        &up(&vc[pos0 * kvd..(pos0 + n) * kvd], kvd),
        &mut kv,
        0,
        shape,
        &mut out,
    )
    .unwrap();
    b.download_owned(out).unwrap()
}

/// Grouped-query attention (groups of 1 and 3, a sliding window, pages of several
/// sizes, attention sinks) matches the CPU's; and on MLX's CPU build a query's bits do not depend on
/// the queries computed with it nor on the page size.
#[test]
fn attention_matches_the_cpu_and_a_querys_bits_stand_alone() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let m = mlx();
    for (heads, window, pos0, n, page, with_sinks) in [
        (2, None, 0, 9, 4, false),
        (6, None, 5, 7, 3, false),
        (6, Some(6), 10, 8, 5, false),
        (6, Some(4), 0, 12, 128, false),
        // gpt-oss: a sink logit per head, full and sliding-window layers.
        (6, None, 5, 7, 3, true),
        (6, Some(4), 10, 8, 5, true),
    ] {
        let sinks: Option<Arc<[f32]>> =
            with_sinks.then(|| (0..heads).map(|h| h as f32 * 0.9 - 2.0).collect());
        let shape = AttentionShape {
            heads,
            kv_heads: 2,
            head_dim: 8,
            window,
            sinks,
        };
        let (qd, kvd, total) = (heads * 8, 16, pos0 + n);
        let (kc, vc, q) = (
            random(&mut rng, total * kvd),
            random(&mut rng, total * kvd),
            random(&mut rng, n * qd),
        );
        let got = attend(&m, &shape, &kc, &vc, &q, pos0, n, page);
        let want = attend(&cpu(), &shape, &kc, &vc, &q, pos0, n, page);
        close(
            &format!("attention {shape:?} from {pos0}"),
            &got,
            &want,
            1e-5,
        );
        if !m.batch_invariant() {
            continue;
        }
        // The last query alone, after every other position cached, pages of 1.
        let last = attend(&m, &shape, &kc, &vc, &q[(n - 1) * qd..], total - 1, 1, 1);
        assert_eq!(
            bits(&last),
            bits(&got[(n - 1) * qd..]),
            "the last query alone ({shape:?}, from {pos0})"
        );
    }
}

fn latent<B: Backend>(b: &B, shape: &LatentShape, c: &[f32], q: &[f32], n: usize) -> Vec<f32> {
    let w = shape.rank + shape.rope;
    let mut kv = KvCache::with_page(1, w, n, 3);
    let mut out = b.zeros(n, shape.heads * shape.rank);
    b.latent_attention(
        &b.upload(n, shape.heads * w, q).unwrap(),
        &b.upload(n, w, c).unwrap(),
        &mut kv,
        0,
        shape,
        &mut out,
    )
    .unwrap();
    b.download_owned(out).unwrap()
}

#[test]
fn latent_attention_matches_the_cpu() {
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let shape = LatentShape {
        heads: 3,
        rank: 10,
        rope: 4,
        scale: 0.3,
    };
    let n = 7;
    let c = random(&mut rng, n * 14);
    let q = random(&mut rng, n * 3 * 14);
    close(
        "latent attention",
        &latent(&mlx(), &shape, &c, &q, n),
        &latent(&cpu(), &shape, &c, &q, n),
        1e-5,
    );
}

#[test]
fn gathers_slices_stacks_and_top_k_are_exact() {
    let m = mlx();
    let table: Vec<f32> = (0..20).map(|i| i as f32 * 0.5).collect();
    let tb = bf16_bytes(&table);
    let view = WeightView::new(DType::BF16, 5, 4, &tb).unwrap();
    let mut out = m.zeros(3, 4);
    m.embed(&TableView::whole(view), &[4, 0, 2], &mut out)
        .unwrap();
    let got = m.download(&out).unwrap();
    assert_eq!(&got[..4], &table[16..20]);
    assert_eq!(&got[4..8], &table[..4]);
    assert_eq!(
        m.embed(&TableView::whole(view), &[5], &mut m.zeros(1, 4))
            .unwrap_err(),
        KernelError::RowOutOfRange { id: 5, rows: 5 }
    );
    let rows = m.rows(&out, 1..3).unwrap();
    assert_eq!(m.shape(&rows), (2, 4));
    let stacked = m.stack(&[rows, m.zeros(1, 4)]).unwrap();
    let s = m.download_owned(stacked).unwrap();
    assert_eq!(&s[..8], &got[4..12]);
    assert_eq!(&s[8..], &[0.0; 4]);
    let scores = m
        .upload(2, 4, &[0.1, 0.9, 0.9, -1.0, 3.0, 2.0, 1.0, 0.0])
        .unwrap();
    assert_eq!(
        m.top_k(&scores, 2).unwrap(),
        vec![vec![(1, 0.9), (2, 0.9)], vec![(0, 3.0), (1, 2.0)]]
    );
}

/// Bad shapes are errors naming what was wrong, never reads out of bounds.
#[test]
fn shapes_that_do_not_match_are_errors() {
    let m = mlx();
    let w = vec![0u8; 4 * 3 * 2];
    let view = WeightView::new(DType::BF16, 4, 3, &w).unwrap();
    let x = m.upload(2, 5, &[0.0; 10]).unwrap();
    let e = m.matmul(&x, view, &mut m.zeros(2, 4)).unwrap_err();
    assert!(e.to_string().contains("matmul input"), "{e}");
    assert!(m.upload(2, 5, &[0.0; 9]).is_err());
    assert!(m.rows(&x, 1..3).is_err());
    let mut y = m.zeros(2, 5);
    assert!(m.add(&mut y, &m.zeros(2, 4)).is_err());
    let bad = WeightView {
        lease: None,
        format: libvoom::backend::view::WeightFormat::Plain(DType::BF16),
        rows: 4,
        cols: 3,
        bytes: &w[..20],
    };
    assert!(m.matmul(&m.zeros(1, 3), bad, &mut m.zeros(1, 4)).is_err());
}

/// MLX is driven from several threads at once (engines on a server): every call is
/// serialised, and each thread gets the bits it gets alone.
#[test]
fn several_threads_get_their_own_bits() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let (rows, cols) = (64, 128);
    let w = bf16_bytes(&random(&mut rng, rows * cols));
    let x = random(&mut rng, 8 * cols);
    let m = mlx();
    let view = WeightView::new(DType::BF16, rows, cols, &w).unwrap();
    let alone = product(&m, &x, 8, view, false);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    let view = WeightView::new(DType::BF16, rows, cols, &w).unwrap();
                    (0..10)
                        .map(|_| product(&m, &x, 8, view, false))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in hs {
            for got in h.join().unwrap() {
                assert_eq!(bits(&got), bits(&alone));
            }
        }
    });
}

/// Counts how many holders of leased test pages were dropped (pages released).
struct Page {
    bytes: Vec<u8>,
    released: Arc<AtomicUsize>,
}

impl Drop for Page {
    fn drop(&mut self) {
        self.released.fetch_add(1, Ordering::SeqCst);
    }
}

/// `bytes` as a leased page whose release is counted in `released`.
fn leased_page(id: u32, bytes: Vec<u8>, released: &Arc<AtomicUsize>) -> PageLease {
    let page = Arc::new(Page {
        bytes,
        released: released.clone(),
    });
    let (ptr, len) = (page.bytes.as_ptr(), page.bytes.len());
    // SAFETY: the bytes live in `page`, which the lease keeps alive, never written.
    unsafe { PageLease::new(PageId(id), ptr, len, page) }
}

/// One Llama decoder layer over `n` new positions: every product with a leased BF16
/// page; `settle` runs after each op (a download, to force an evaluation, or
/// nothing).
fn llama_layer(
    b: &MlxBackend,
    pages: &[PageLease],
    x: &[f32],
    n: usize,
    settle: &dyn Fn(&MlxAct),
) -> Vec<f32> {
    let (d, hd, heads, kv_heads, ff) = (16, 4, 4, 2, 24);
    let view = |i: usize, rows, cols| {
        WeightView::new(DType::BF16, rows, cols, pages[i].bytes())
            .unwrap()
            .leased(&pages[i])
    };
    let ones = vec![1.0f32; d];
    let norm = VecView {
        dtype: DType::F32,
        bytes: bytemuck_f32(&ones),
        plus_one: false,
    };
    let shape = AttentionShape {
        heads,
        kv_heads,
        head_dim: hd,
        window: None,
        sinks: None,
    };
    let mut kv = KvCache::with_page(1, kv_heads * hd, n, 8);
    let mut h = b.upload(n, d, x).unwrap();
    let mut normed = b.zeros(n, d);
    b.rms_norm(&h, norm, 1e-5, &mut normed).unwrap();
    settle(&normed);
    let mut q = b.zeros(n, heads * hd);
    let mut k = b.zeros(n, kv_heads * hd);
    let mut v = b.zeros(n, kv_heads * hd);
    b.matmul(&normed, view(0, heads * hd, d), &mut q).unwrap();
    settle(&q);
    b.matmul(&normed, view(1, kv_heads * hd, d), &mut k)
        .unwrap();
    settle(&k);
    b.matmul(&normed, view(2, kv_heads * hd, d), &mut v)
        .unwrap();
    settle(&v);
    let mut att = b.zeros(n, heads * hd);
    b.attention(&q, &k, &v, &mut kv, 0, &shape, &mut att)
        .unwrap();
    settle(&att);
    let mut o = b.zeros(n, d);
    b.matmul(&att, view(3, d, heads * hd), &mut o).unwrap();
    settle(&o);
    b.add(&mut h, &o).unwrap();
    settle(&h);
    b.rms_norm(&h, norm, 1e-5, &mut normed).unwrap();
    settle(&normed);
    let (mut gate, mut up) = (b.zeros(n, ff), b.zeros(n, ff));
    b.matmul(&normed, view(4, ff, d), &mut gate).unwrap();
    settle(&gate);
    b.matmul(&normed, view(5, ff, d), &mut up).unwrap();
    settle(&up);
    b.gated(Activation::Silu, &mut gate, &up).unwrap();
    settle(&gate);
    let mut down = b.zeros(n, d);
    b.matmul(&gate, view(6, d, ff), &mut down).unwrap();
    settle(&down);
    b.add(&mut h, &down).unwrap();
    b.download_owned(h).unwrap()
}

fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: reinterpreting initialised f32s as bytes (alignment 1, same length in
    // bytes, same lifetime).
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

/// A layer's products stay in MLX's lazy graph, each holding its page's lease until
/// MLX is done with it: the layer is evaluated once for its keys and values and once
/// for its output (attention once more where MLX wraps the cache's pages: Metal),
/// not once per product; its bits equal those of the same layer evaluated op by op;
/// and every page is released once nothing holds it.
#[test]
fn a_layer_is_one_graph_whose_pages_stay_leased_until_it_is_evaluated() {
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let shapes = [
        (16, 16),
        (8, 16),
        (8, 16),
        (16, 16),
        (24, 16),
        (24, 16),
        (16, 24),
    ];
    let released = Arc::new(AtomicUsize::new(0));
    let pages: Vec<PageLease> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(r, c))| leased_page(i as u32, bf16_bytes(&random(&mut rng, r * c)), &released))
        .collect();
    let n = 5;
    let x = random(&mut rng, n * 16);
    let b = mlx();

    let eager_b = mlx();
    let eager = llama_layer(&eager_b, &pages, &x, n, &|a| {
        eager_b.download(a).unwrap();
    });
    let eager_evals = eager_b.evaluations();

    let before = b.evaluations();
    let lazy = llama_layer(&b, &pages, &x, n, &|_| {});
    let evals = b.evaluations() - before;
    assert_eq!(
        bits(&lazy),
        bits(&eager),
        "where MLX evaluates changes no bit"
    );
    let wraps_pages = b.copied_bytes() == 0;
    let most = if wraps_pages { 3 } else { 2 };
    assert!(
        (1..=most).contains(&evals),
        "{evals} evaluations for one layer (at most {most}); op by op took {eager_evals}"
    );
    assert!(eager_evals >= 12, "{eager_evals} evaluations op by op");

    assert_eq!(
        released.load(Ordering::SeqCst),
        0,
        "the test still holds every page"
    );
    drop(pages);
    assert_eq!(
        released.load(Ordering::SeqCst),
        shapes.len(),
        "every page released once MLX and the caller are done with it"
    );
}

/// A product whose graph is never evaluated releases its page when the graph goes;
/// a view naming a lease that does not hold its bytes is computed (and evaluated
/// before the product returns wherever MLX would wrap it) without keeping it.
#[test]
fn a_pending_product_keeps_its_page_until_the_graph_is_dropped() {
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    let released = Arc::new(AtomicUsize::new(0));
    let w = bf16_bytes(&random(&mut rng, 8 * 16));
    let page = leased_page(0, w.clone(), &released);
    let other = leased_page(1, vec![0; 4], &released);
    let b = mlx();
    let x = b.upload(3, 16, &random(&mut rng, 48)).unwrap();
    let mut out = b.zeros(3, 8);
    let view = WeightView::new(DType::BF16, 8, 16, page.bytes()).unwrap();
    b.matmul(&x, view.leased(&page), &mut out).unwrap();
    drop(page);
    drop(out);
    assert_eq!(
        released.load(Ordering::SeqCst),
        1,
        "released once the unevaluated product is dropped"
    );

    let stray = WeightView::new(DType::BF16, 8, 16, &w)
        .unwrap()
        .leased(&other);
    assert!(stray.kept_by().is_none());
    let mut y = b.zeros(3, 8);
    b.matmul(&x, stray, &mut y).unwrap();
    let want = product(
        &cpu(),
        &b.download(&x).unwrap(),
        3,
        WeightView::new(DType::BF16, 8, 16, &w).unwrap(),
        false,
    );
    close(
        "product with a stray lease",
        &b.download_owned(y).unwrap(),
        &want,
        1e-5,
    );
    drop(other);
    assert_eq!(released.load(Ordering::SeqCst), 2);
}

/// Through the engine: each forward pass of a dense model is one evaluation per
/// layer (its keys and values) and one for the logits (one more per layer, for
/// attention, where MLX wraps the cache's pages).
#[test]
fn an_engine_pass_evaluates_once_per_layer() {
    use libvoom::engine::{Engine, EngineOptions};
    let dir = common::fixtures().join("llama_sharded");
    let layers = 3;
    let engine = Engine::open(
        &dir,
        EngineOptions {
            backend: BackendKind::Mlx,
            ..EngineOptions::default()
        },
    )
    .unwrap();
    let prompt = common::prompt_of(&dir, 2);
    let before = engine.backend_evaluations();
    let g = common::greedy(&engine, &prompt, 6);
    let evals = engine.backend_evaluations() - before;
    let passes = 1 + g.decode_passes as u64;
    let per_pass = [layers + 1, 2 * layers + 1];
    let wraps = engine.backend_copied_bytes() == 0;
    assert!(
        evals == passes * per_pass[0] || (wraps && evals == passes * per_pass[1]),
        "{evals} evaluations over {passes} passes of {layers} layers"
    );
}

/// ggml's block formats (lossy GGUF weights) run on the CPU backend only: MLX
/// refuses them with an error that names the format, for both products.
#[test]
fn ggml_blocks_are_refused_by_name() {
    let m = mlx();
    let bytes = vec![0u8; 2 * 34];
    let w = WeightView::of(
        WeightFormat::Ggml(voom_formats::gguf::GgmlType::Q8_0),
        2,
        32,
        &bytes,
    )
    .unwrap();
    for t in [false, true] {
        let k = if t { 2 } else { 32 };
        let x = m.upload(1, k, &vec![1.0; k]).unwrap();
        let mut out = m.zeros(1, if t { 32 } else { 2 });
        let r = if t {
            m.matmul_t(&x, w, &mut out)
        } else {
            m.matmul(&x, w, &mut out)
        };
        match r {
            Err(KernelError::UnsupportedFormat(f)) => assert!(f.contains("Q8_0"), "{f}"),
            other => panic!("transposed={t}: {other:?}"),
        }
    }
}
