//! Every op of the backend interface on every backend this machine has (each CPU
//! instruction set): the op computes what its specification says (a reference
//! written here from the definition, in f64), and every backend gives the same bits
//! (DESIGN.md invariant 6). Shapes that do not match are errors, never reads out of
//! bounds.

use libvoom::backend::cpu::matmul::Isa;
use libvoom::backend::cpu::CpuBackend;
use libvoom::backend::{
    Activation, AttentionShape, Backend, BackendKind, KernelError, RopeTable, TableView, VecView,
    WeightView,
};
use libvoom::kv::KvCache;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use voom_formats::DType;

fn backends() -> Vec<CpuBackend> {
    BackendKind::available()
        .into_iter()
        .map(|k| match k {
            BackendKind::Cpu(isa) => CpuBackend::new(2, isa).unwrap(),
        })
        .collect()
}

fn random(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-2.0f32..2.0)).collect()
}

/// BF16 bytes of `v` (rounded by truncation: any BF16 values will do).
fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
        .collect()
}

fn bf16_value(b: &[u8], i: usize) -> f64 {
    f32::from_bits((u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32) << 16) as f64
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Runs `op` on every backend; asserts the bits agree and returns them.
fn on_every_backend(what: &str, op: impl Fn(&CpuBackend) -> Vec<f32>) -> Vec<f32> {
    let all = backends();
    assert!(!all.is_empty());
    let first = op(&all[0]);
    for b in &all[1..] {
        assert_eq!(
            bits(&first),
            bits(&op(b)),
            "{what}: {} and {} differ",
            all[0].name(),
            b.name()
        );
    }
    first
}

fn close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

#[test]
fn matmul_is_the_product_on_every_backend() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let (n, rows, cols) = (5, 37, 70);
    let x = random(&mut rng, n * cols);
    let w = bf16_bytes(&random(&mut rng, rows * cols));
    let got = on_every_backend("matmul", |b| {
        let view = WeightView::new(DType::BF16, rows, cols, &w).unwrap();
        let xa = b.upload(n, cols, &x).unwrap();
        let mut out = b.zeros(n, rows);
        b.matmul(&xa, view, &mut out).unwrap();
        b.download_owned(out)
    });
    let want: Vec<f64> = (0..n)
        .flat_map(|t| {
            let (x, w) = (&x, &w);
            (0..rows).map(move |o| {
                (0..cols)
                    .map(|k| x[t * cols + k] as f64 * bf16_value(w, o * cols + k))
                    .sum()
            })
        })
        .collect();
    close("matmul", &got, &want, 1e-5);
}

#[test]
fn embed_gathers_rows_exactly_and_refuses_an_id_past_the_table() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let (rows, cols) = (11, 9);
    let table = bf16_bytes(&random(&mut rng, rows * cols));
    let ids = [3u32, 0, 10, 3];
    let got = on_every_backend("embed", |b| {
        let view = WeightView::new(DType::BF16, rows, cols, &table).unwrap();
        let mut out = b.zeros(ids.len(), cols);
        b.embed(&TableView::whole(view), &ids, &mut out).unwrap();
        b.download_owned(out)
    });
    for (t, &id) in ids.iter().enumerate() {
        for j in 0..cols {
            assert_eq!(
                got[t * cols + j] as f64,
                bf16_value(&table, id as usize * cols + j)
            );
        }
    }
    for b in backends() {
        let view = WeightView::new(DType::BF16, rows, cols, &table).unwrap();
        let mut out = b.zeros(1, cols);
        assert_eq!(
            b.embed(&TableView::whole(view), &[11], &mut out)
                .unwrap_err(),
            KernelError::RowOutOfRange { id: 11, rows: 11 }
        );
    }
}

/// A table in row parts, gathered part by part, gives the bits of the whole table
/// gathered at once; rows no part given holds are left as they were.
#[test]
fn embed_from_row_parts_in_several_calls_equals_the_whole_table() {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let (rows, cols) = (11, 9);
    let table = bf16_bytes(&random(&mut rng, rows * cols));
    let ids = [3u32, 0, 10, 3, 7];
    let whole = WeightView::new(DType::BF16, rows, cols, &table).unwrap();
    for b in backends() {
        let mut want = b.zeros(ids.len(), cols);
        b.embed(&TableView::whole(whole), &ids, &mut want).unwrap();
        let mut got = b
            .upload(ids.len(), cols, &vec![-1.0; ids.len() * cols])
            .unwrap();
        let part = |r: std::ops::Range<usize>| (r.start, whole.slice_rows(r));
        let first = TableView {
            rows,
            cols,
            parts: vec![part(0..4)],
        };
        b.embed(&first, &ids, &mut got).unwrap();
        let half = b.download(&got);
        for (t, &id) in ids.iter().enumerate() {
            let untouched = half[t * cols..(t + 1) * cols].iter().all(|&v| v == -1.0);
            assert_eq!(untouched, id >= 4, "{} row {t}", b.name());
        }
        let rest = TableView {
            rows,
            cols,
            parts: vec![part(4..8), part(8..11)],
        };
        b.embed(&rest, &ids, &mut got).unwrap();
        let (got, want) = (b.download_owned(got), b.download_owned(want));
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{}",
            b.name()
        );
        // Rows 4..11 placed from row 5 would run past the table.
        let shifted = TableView {
            rows,
            cols,
            parts: vec![(5, whole.slice_rows(4..11))],
        };
        let mut out = b.zeros(1, cols);
        assert!(matches!(
            b.embed(&shifted, &[5], &mut out).unwrap_err(),
            KernelError::TablePart { first: 5, .. }
        ));
    }
}

#[test]
fn norms_rope_add_bias_and_activation_follow_their_definitions() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let (n, heads, hd) = (3, 4, 8);
    let cols = heads * hd;
    let x = random(&mut rng, n * cols);
    let wv: Vec<f32> = random(&mut rng, cols);
    let wb = bf16_bytes(&wv);
    let hb = bf16_bytes(&wv[..hd]);
    let eps = 1e-5f32;

    let got = on_every_backend("rms_norm", |b| {
        let xa = b.upload(n, cols, &x).unwrap();
        let mut out = b.zeros(n, cols);
        let w = VecView {
            dtype: DType::BF16,
            bytes: &wb,
        };
        b.rms_norm(&xa, w, eps, &mut out).unwrap();
        b.download_owned(out)
    });
    let want: Vec<f64> = x
        .chunks(cols)
        .flat_map(|r| {
            let ms = r.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / cols as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            let wb = &wb;
            r.iter()
                .enumerate()
                .map(move |(j, &v)| bf16_value(wb, j) * v as f64 * inv)
                .collect::<Vec<_>>()
        })
        .collect();
    close("rms_norm", &got, &want, 1e-5);

    let got = on_every_backend("rms_norm_groups", |b| {
        let mut xa = b.upload(n, cols, &x).unwrap();
        let w = VecView {
            dtype: DType::BF16,
            bytes: &hb,
        };
        b.rms_norm_groups(&mut xa, hd, w, eps).unwrap();
        b.download_owned(xa)
    });
    let want: Vec<f64> = x
        .chunks(hd)
        .flat_map(|r| {
            let ms = r.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / hd as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            let hb = &hb;
            r.iter()
                .enumerate()
                .map(move |(j, &v)| bf16_value(hb, j) * v as f64 * inv)
                .collect::<Vec<_>>()
        })
        .collect();
    close("rms_norm_groups", &got, &want, 1e-5);

    let half = hd / 2;
    let angles: Vec<f32> = (0..n * half).map(|i| i as f32 * 0.37).collect();
    let table = RopeTable {
        half,
        cos: angles.iter().map(|a| a.cos()).collect(),
        sin: angles.iter().map(|a| a.sin()).collect(),
    };
    let got = on_every_backend("rope", |b| {
        let mut xa = b.upload(n, cols, &x).unwrap();
        b.rope(&mut xa, hd, &table).unwrap();
        b.download_owned(xa)
    });
    for t in 0..n {
        for h in 0..heads {
            let base = t * cols + h * hd;
            for i in 0..half {
                let (c, s) = (
                    table.cos[t * half + i] as f64,
                    table.sin[t * half + i] as f64,
                );
                let (x1, x2) = (x[base + i] as f64, x[base + half + i] as f64);
                close(
                    "rope",
                    &[got[base + i], got[base + half + i]],
                    &[x1 * c - x2 * s, x2 * c + x1 * s],
                    1e-6,
                );
            }
        }
    }

    let y = random(&mut rng, n * cols);
    let got = on_every_backend("add, add_bias, gated", |b| {
        let mut xa = b.upload(n, cols, &x).unwrap();
        let ya = b.upload(n, cols, &y).unwrap();
        b.add(&mut xa, &ya).unwrap();
        let w = VecView {
            dtype: DType::BF16,
            bytes: &wb,
        };
        b.add_bias(&mut xa, w).unwrap();
        b.gated(Activation::Silu, &mut xa, &ya).unwrap();
        b.download_owned(xa)
    });
    let want: Vec<f64> = (0..n * cols)
        .map(|i| {
            let a = (x[i] + y[i]) as f64 + bf16_value(&wb, i % cols);
            a / (1.0 + (-a).exp()) * y[i] as f64
        })
        .collect();
    close("add, add_bias, gated", &got, &want, 1e-5);
}

/// Attention over the KV layout: appends, then attends causally (with a window),
/// in one call and in several, to the same bits.
#[test]
fn attention_is_causal_softmax_attention_and_independent_of_how_positions_arrive() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    for window in [None, Some(3)] {
        let shape = AttentionShape {
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            window,
        };
        let (qd, kvd, n) = (32, 16, 6);
        let q = random(&mut rng, n * qd);
        let k = random(&mut rng, n * kvd);
        let v = random(&mut rng, n * kvd);
        let run = |b: &CpuBackend, split: usize| -> Vec<f32> {
            let mut kv = KvCache::new(1, kvd, 64);
            let mut out_all = Vec::new();
            for (lo, hi) in [(0, split), (split, n)] {
                if lo == hi {
                    continue;
                }
                let m = hi - lo;
                let qa = b.upload(m, qd, &q[lo * qd..hi * qd]).unwrap();
                let ka = b.upload(m, kvd, &k[lo * kvd..hi * kvd]).unwrap();
                let va = b.upload(m, kvd, &v[lo * kvd..hi * kvd]).unwrap();
                let mut out = b.zeros(m, qd);
                b.attention(&qa, &ka, &va, &mut kv, 0, &shape, &mut out)
                    .unwrap();
                kv.commit(m);
                out_all.extend(b.download_owned(out));
            }
            out_all
        };
        let got = on_every_backend("attention", |b| run(b, n));
        for split in [1, 4] {
            on_every_backend("attention", |b| {
                let r = run(b, split);
                assert_eq!(bits(&r), bits(&got), "split at {split}");
                r
            });
        }
        // The definition, in f64.
        for t in 0..n {
            for h in 0..4 {
                let kvh = h / 2;
                let lo = window.map_or(0, |w| (t + 1).saturating_sub(w));
                let qv = &q[t * qd + h * 8..t * qd + h * 8 + 8];
                let scores: Vec<f64> = (lo..=t)
                    .map(|j| {
                        (0..8)
                            .map(|d| qv[d] as f64 * k[j * kvd + kvh * 8 + d] as f64)
                            .sum::<f64>()
                            / 8f64.sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f64 = e.iter().sum();
                let want: Vec<f64> = (0..8)
                    .map(|d| {
                        (lo..=t)
                            .zip(&e)
                            .map(|(j, p)| p / z * v[j * kvd + kvh * 8 + d] as f64)
                            .sum()
                    })
                    .collect();
                close(
                    "attention",
                    &got[t * qd + h * 8..t * qd + h * 8 + 8],
                    &want,
                    1e-5,
                );
            }
        }
    }
}

#[test]
fn top_k_is_the_largest_first_on_every_backend() {
    let x = [0.5f32, 2.0, -1.0, 2.0, f32::NAN, 1.5, 0.0, 3.0];
    for b in backends() {
        let a = b.upload(2, 4, &x).unwrap();
        assert_eq!(
            b.top_k(&a, 2),
            vec![vec![(1, 2.0), (3, 2.0)], vec![(3, 3.0), (1, 1.5)]],
            "{}",
            b.name()
        );
    }
}

#[test]
fn mismatched_shapes_are_errors_on_every_backend() {
    let w = vec![0u8; 2 * 4 * 3];
    for b in backends() {
        let view = WeightView::new(DType::BF16, 4, 3, &w).unwrap();
        let x = b.zeros(2, 5);
        let mut out = b.zeros(2, 4);
        assert!(matches!(
            b.matmul(&x, view, &mut out),
            Err(KernelError::ActivationLen { .. })
        ));
        let mut short = b.zeros(2, 3);
        let x = b.zeros(2, 3);
        assert!(b.matmul(&x, view, &mut short).is_err());
        let norm = VecView {
            dtype: DType::BF16,
            bytes: &w[..4],
        };
        assert!(b.rms_norm(&x, norm, 1e-5, &mut short).is_err());
        let bad_dtype = WeightView {
            dtype: DType::I8,
            rows: 4,
            cols: 3,
            bytes: &w[..12],
        };
        assert!(matches!(
            b.matmul(&x, bad_dtype, &mut out),
            Err(KernelError::UnsupportedDType(DType::I8))
        ));
        let shape = AttentionShape {
            heads: 3,
            kv_heads: 2,
            head_dim: 1,
            window: None,
        };
        let mut kv = KvCache::new(1, 2, 4);
        let (q, k) = (b.zeros(1, 3), b.zeros(1, 2));
        let mut o = b.zeros(1, 3);
        assert!(b.attention(&q, &k, &k, &mut kv, 0, &shape, &mut o).is_err());
        assert!(b.upload(2, 2, &[0.0; 3]).is_err());
    }
    // A backend that is not on this CPU cannot be asked for.
    if Isa::detect() == Isa::Portable {
        assert!(BackendKind::parse("cpu-avx2").is_err());
    }
    assert!(BackendKind::parse("metal")
        .unwrap_err()
        .contains("cpu-portable"));
}
