//! Every op of the backend interface on every backend this machine has (each CPU
//! instruction set): the op computes what its specification says (a reference
//! written here from the definition, in f64), and every backend gives the same bits
//! (DESIGN.md invariant 6). Shapes that do not match are errors, never reads out of
//! bounds.

use libvoom::backend::cpu::matmul::Isa;
use libvoom::backend::cpu::CpuBackend;
use libvoom::backend::{
    Activation, AttentionShape, Backend, BackendKind, KernelError, LatentShape, RopeShape,
    RopeTable, TableView, VecView, WeightView,
};
use libvoom::kv::KvCache;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use voom_formats::DType;

fn backends() -> Vec<CpuBackend> {
    BackendKind::cpus()
        .into_iter()
        .filter_map(|k| match k {
            BackendKind::Cpu(isa) => Some(CpuBackend::new(2, isa).unwrap()),
            BackendKind::Mlx => None,
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
        b.download_owned(out).unwrap()
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
        b.download_owned(out).unwrap()
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
        let half = b.download(&got).unwrap();
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
        let (got, want) = (
            b.download_owned(got).unwrap(),
            b.download_owned(want).unwrap(),
        );
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
            plus_one: false,
        };
        b.rms_norm(&xa, w, eps, &mut out).unwrap();
        b.download_owned(out).unwrap()
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
            plus_one: false,
        };
        b.rms_norm_groups(&mut xa, hd, w, eps).unwrap();
        b.download_owned(xa).unwrap()
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
        b.rope(&mut xa, &RopeShape::whole(hd), &table).unwrap();
        b.download_owned(xa).unwrap()
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
            plus_one: false,
        };
        b.add_bias(&mut xa, w).unwrap();
        b.gated(Activation::Silu, &mut xa, &ya).unwrap();
        b.download_owned(xa).unwrap()
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
            sinks: None,
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
                kv.commit(&vec![0; m]);
                out_all.extend(b.download_owned(out).unwrap());
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
            b.top_k(&a, 2).unwrap(),
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
            plus_one: false,
        };
        assert!(b.rms_norm(&x, norm, 1e-5, &mut short).is_err());
        let bad_dtype = WeightView {
            lease: None,
            format: libvoom::backend::view::WeightFormat::Plain(DType::I8),
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
            sinks: None,
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
    assert_eq!(
        BackendKind::parse("cpu").unwrap(),
        BackendKind::Cpu(Isa::detect())
    );
}

/// In a build without MLX, asking for it says what to install, from the command
/// line (`--backend mlx`) and from the library alike.
#[test]
fn mlx_in_a_build_without_it_says_what_to_install() {
    if libvoom::backend::has_mlx() {
        eprintln!("skipped: this build links MLX (tests/mlx_backend.rs runs instead)");
        return;
    }
    let e = BackendKind::parse("mlx").unwrap_err();
    assert!(
        e.contains("pip install mlx") && e.contains("--features mlx"),
        "{e}"
    );
    assert!(!BackendKind::available().contains(&BackendKind::Mlx));
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/tiny/llama_gqa_untied");
    let opts = libvoom::engine::EngineOptions {
        backend: BackendKind::Mlx,
        ..Default::default()
    };
    let e = libvoom::engine::Engine::open(&dir, opts)
        .err()
        .expect("no MLX here");
    assert!(e.to_string().contains("pip install mlx"), "{e}");
}

/// Partial and interleaved rotary: only `2 × half` floats from the offset of each head
/// rotate; interleaved pairs `(x[2i], x[2i+1])` are written back de-interleaved.
#[test]
fn rope_rotates_the_part_of_each_head_its_shape_names() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (n, hd, heads, half, offset) = (3, 10, 2, 3, 4);
    let x = random(&mut rng, n * heads * hd);
    let angles: Vec<f32> = (0..n * half).map(|i| i as f32 * 0.61 + 0.1).collect();
    let table = RopeTable {
        half,
        cos: angles.iter().map(|a| a.cos()).collect(),
        sin: angles.iter().map(|a| a.sin()).collect(),
    };
    for interleaved in [false, true] {
        let shape = RopeShape {
            head_dim: hd,
            offset,
            interleaved,
        };
        let got = on_every_backend("rope (part)", |b| {
            let mut xa = b.upload(n, heads * hd, &x).unwrap();
            b.rope(&mut xa, &shape, &table).unwrap();
            b.download_owned(xa).unwrap()
        });
        for t in 0..n {
            for h in 0..heads {
                let base = t * heads * hd + h * hd;
                for d in (0..offset).chain(offset + 2 * half..hd) {
                    assert_eq!(got[base + d], x[base + d], "outside the rotary part");
                }
                for i in 0..half {
                    let (c, s) = (table.cos[t * half + i], table.sin[t * half + i]);
                    let (x1, x2) = if interleaved {
                        (x[base + offset + 2 * i], x[base + offset + 2 * i + 1])
                    } else {
                        (x[base + offset + i], x[base + offset + half + i])
                    };
                    let r = base + offset;
                    assert_eq!(got[r + i], x1 * c - x2 * s);
                    assert_eq!(got[r + half + i], x2 * c + x1 * s);
                }
            }
        }
    }
    let b = &backends()[0];
    let mut xa = b.upload(n, heads * hd, &x).unwrap();
    let past_the_head = RopeShape {
        head_dim: hd,
        offset: 5,
        interleaved: false,
    };
    assert!(b.rope(&mut xa, &past_the_head, &table).is_err());
}

/// `matmul_t` contracts the weight's rows: each element one fused multiply-add a
/// term in increasing row order, whatever the number of input rows.
#[test]
fn matmul_t_contracts_the_weights_rows_in_order() {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let (n, k, c) = (3, 7, 5);
    let x = random(&mut rng, n * k);
    let wv = random(&mut rng, k * c);
    let wb = bf16_bytes(&wv);
    let w = WeightView::new(DType::BF16, k, c, &wb).unwrap();
    let got = on_every_backend("matmul_t", |b| {
        let mut out = b.zeros(n, c);
        b.matmul_t(&b.upload(n, k, &x).unwrap(), w, &mut out)
            .unwrap();
        b.download_owned(out).unwrap()
    });
    for t in 0..n {
        for j in 0..c {
            let mut acc = 0f32;
            for r in 0..k {
                acc = x[t * k + r].mul_add(bf16_value(&wb, r * c + j) as f32, acc);
            }
            assert_eq!(got[t * c + j].to_bits(), acc.to_bits(), "({t}, {j})");
        }
    }
    // One row at a time gives the same bits.
    for t in 0..n {
        let b = &backends()[0];
        let mut out = b.zeros(1, c);
        b.matmul_t(
            &b.upload(1, k, &x[t * k..(t + 1) * k]).unwrap(),
            w,
            &mut out,
        )
        .unwrap();
        assert_eq!(
            bits(&b.download_owned(out).unwrap()),
            bits(&got[t * c..(t + 1) * c])
        );
    }
    let b = &backends()[0];
    let mut out = b.zeros(n, c);
    assert!(b
        .matmul_t(&b.upload(n, c, &x[..n * c]).unwrap(), w, &mut out)
        .is_err());
}

/// Latent attention: every head attends over one cache vector per position (the
/// latent then the rotary key), values the latents; positions arriving in one call
/// or several give the same bits.
#[test]
fn latent_attention_attends_over_whole_cache_vectors_with_latent_values() {
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    let shape = LatentShape {
        heads: 3,
        rank: 6,
        rope: 2,
        scale: 0.3,
    };
    let w = shape.rank + shape.rope;
    let n = 5;
    let q = random(&mut rng, n * shape.heads * w);
    let c = random(&mut rng, n * w);
    let od = shape.heads * shape.rank;
    let run = |b: &CpuBackend, split: usize| -> Vec<f32> {
        let mut kv = KvCache::new(1, w, 64);
        let mut all = Vec::new();
        for (lo, hi) in [(0, split), (split, n)] {
            if lo == hi {
                continue;
            }
            let m = hi - lo;
            let qa = b
                .upload(
                    m,
                    shape.heads * w,
                    &q[lo * shape.heads * w..hi * shape.heads * w],
                )
                .unwrap();
            let ca = b.upload(m, w, &c[lo * w..hi * w]).unwrap();
            let mut out = b.zeros(m, od);
            b.latent_attention(&qa, &ca, &mut kv, 0, &shape, &mut out)
                .unwrap();
            kv.commit(&vec![0; m]);
            all.extend(b.download_owned(out).unwrap());
        }
        assert_eq!(kv.bytes(), n * w * 4, "one vector per position, no values");
        all
    };
    let got = on_every_backend("latent attention", |b| run(b, n));
    for split in [1, 3] {
        on_every_backend("latent attention", |b| {
            let r = run(b, split);
            assert_eq!(bits(&r), bits(&got), "split at {split}");
            r
        });
    }
    for t in 0..n {
        for h in 0..shape.heads {
            let qv = &q[t * shape.heads * w + h * w..][..w];
            let scores: Vec<f64> = (0..=t)
                .map(|j| {
                    (0..w)
                        .map(|d| qv[d] as f64 * c[j * w + d] as f64)
                        .sum::<f64>()
                        * shape.scale as f64
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let z: f64 = e.iter().sum();
            let want: Vec<f64> = (0..shape.rank)
                .map(|d| {
                    (0..=t)
                        .zip(&e)
                        .map(|(j, p)| p / z * c[j * w + d] as f64)
                        .sum()
                })
                .collect();
            close(
                "latent attention",
                &got[t * od + h * shape.rank..][..shape.rank],
                &want,
                1e-5,
            );
        }
    }
    let b = &backends()[0];
    let mut kv = KvCache::new(1, w + 1, 64);
    let mut out = b.zeros(1, od);
    let e = b
        .latent_attention(
            &b.upload(1, shape.heads * w, &q[..shape.heads * w]).unwrap(),
            &b.upload(1, w, &c[..w]).unwrap(),
            &mut kv,
            0,
            &shape,
            &mut out,
        )
        .unwrap_err();
    assert!(e.to_string().contains("latent KV cache"), "{e}");
}

#[test]
fn sigmoid_is_the_logistic_function_on_every_backend() {
    let x = [-30.0f32, -1.0, 0.0, 0.5, 2.0, 40.0];
    let got = on_every_backend("sigmoid", |b| {
        let mut a = b.upload(2, 3, &x).unwrap();
        b.sigmoid(&mut a).unwrap();
        b.download_owned(a).unwrap()
    });
    for (g, &v) in got.iter().zip(&x) {
        assert_eq!(g.to_bits(), (1.0f32 / (1.0 + (-v).exp())).to_bits());
    }
}

/// The multiply-adds a backend reports are those of the products and attention it
/// computed: rows × weight elements a product, and per query and head the positions
/// it sees times the key and value sizes (causal, or the window's).
#[test]
fn multiply_adds_count_products_and_attention() {
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    for b in backends() {
        let w = bf16_bytes(&random(&mut rng, 6 * 8));
        let view = WeightView::new(DType::BF16, 6, 8, &w).unwrap();
        let x = b.upload(3, 8, &random(&mut rng, 24)).unwrap();
        let mut out = b.zeros(3, 6);
        let before = b.multiply_adds();
        b.matmul(&x, view, &mut out).unwrap();
        assert_eq!(b.multiply_adds() - before, 3 * 6 * 8, "{}", b.name());
        let mut back = b.zeros(3, 8);
        b.matmul_t(&out, view, &mut back).unwrap();
        assert_eq!(b.multiply_adds() - before, 2 * 3 * 6 * 8, "{}", b.name());

        // Two KV heads of 4, four query heads; 2 positions cached, then 3 new: the new
        // ones see 3, 4 and 5 positions, or at most 4 with a window of 4.
        for (window, seen) in [(None, 3 + 4 + 5), (Some(4), 3 + 4 + 4)] {
            let shape = AttentionShape {
                heads: 4,
                kv_heads: 2,
                head_dim: 4,
                window,
                sinks: None,
            };
            let mut kv = KvCache::with_page(1, 8, 5, 4);
            kv.append(0, &random(&mut rng, 16), &random(&mut rng, 16))
                .unwrap();
            kv.commit(&[0, 0]);
            let up = |n, c, rng: &mut ChaCha8Rng| b.upload(n, c, &random(rng, n * c)).unwrap();
            let (q, k, v) = (up(3, 16, &mut rng), up(3, 8, &mut rng), up(3, 8, &mut rng));
            let mut att = b.zeros(3, 16);
            let before = b.multiply_adds();
            b.attention(&q, &k, &v, &mut kv, 0, &shape, &mut att)
                .unwrap();
            assert_eq!(
                b.multiply_adds() - before,
                seen * 4 * (4 + 4),
                "{} window {window:?}",
                b.name()
            );
        }
    }
}
