//! gpt-oss as released (experts MXFP4, `quantization_config` mxfp4) and as its BF16
//! uploads store it run exactly: greedy ids equal transformers' over the weights as
//! stored (MXFP4 dequantized exactly), token for token, with attention sinks, the
//! sliding-window layers, YaRN, the biased router and the clamped SwiGLU; the bits do
//! not depend on threads, chunks, KV pages, instruction set or the page cache; bad
//! MXFP4 files are clear errors at open or before anything computes on them.
//! Fixtures: `tests/fixtures/tiny_gpt_oss`, made by
//! `tests/conformance/make_gpt_oss_fixtures.py`.

mod common;

use std::path::{Path, PathBuf};

use libvoom::backend::BackendKind;
use libvoom::engine::EngineOptions;
use serde_json::Value;
use voom_formats::DType;

use common::{check_case, edited_copy, open_err, run_err};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny_gpt_oss")
}

const MXFP4: &str = "gpt_oss_mxfp4";
const BF16: &str = "gpt_oss_bf16_bare_config";

fn cases() -> Vec<String> {
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("index.json")).unwrap())
            .unwrap();
    let cases: Vec<String> = index["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(cases, [MXFP4, BF16], "the gpt-oss fixture index");
    cases
}

#[test]
fn greedy_ids_match_transformers_on_every_gpt_oss_case() {
    for backend in BackendKind::available() {
        for case in cases() {
            check_case(
                &fixtures().join(&case),
                EngineOptions {
                    backend,
                    ..Default::default()
                },
            );
        }
    }
}

#[test]
fn single_threaded_and_chunked_prefill_match_transformers_too() {
    for case in cases() {
        // Chunks of 3 against a window of 8: every chunk after the first sees keys the
        // window drops and keys it keeps.
        for chunk in [3, 5] {
            check_case(
                &fixtures().join(&case),
                EngineOptions {
                    threads: 1,
                    prefill_chunk: chunk,
                    ..Default::default()
                },
            );
        }
    }
}

/// A position's logits bits do not depend on the thread count, the prefill chunk,
/// the KV page size or the CPU instruction set.
#[test]
fn logits_bits_do_not_depend_on_chunking_threads_or_backend() {
    for case in cases() {
        common::check_bits_across_runs(&fixtures().join(&case), 3, &BackendKind::available());
    }
}

/// The MXFP4 experts widened to BF16 as stored (every e2m1 times a power of two in
/// BF16's range is a BF16) in the BF16 uploads' layout, no quantization_config: the
/// same greedy ids as the MXFP4 file, and logits within float32 summation order.
#[test]
fn mxfp4_experts_and_their_bf16_widening_give_the_same_ids() {
    let dir = fixtures().join(MXFP4);
    let twin = edited_copy(
        &dir,
        |_, _, _, _| true,
        |c| {
            c.as_object_mut().unwrap().remove("quantization_config");
        },
    );
    widen_experts(&dir, twin.path());
    check_case_at(twin.path(), &dir);
}

/// Rewrites `to`'s safetensors with each `{proj}_blocks` / `{proj}_scales` pair of
/// `from` as one BF16 `{proj}` `[E, in, out]` (transformers' layout).
fn widen_experts(from: &Path, to: &Path) {
    use voom_formats::Checkpoint;
    let ckpt = Checkpoint::open(from).unwrap();
    let mut owned: Vec<(String, DType, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, loc) in ckpt.tensors() {
        let bytes = ckpt.tensor_bytes(name).unwrap();
        if name.ends_with("_scales") {
            continue;
        }
        let Some(stem) = name.strip_suffix("_blocks") else {
            owned.push((
                name.to_string(),
                loc.info.dtype,
                loc.info.shape.clone(),
                bytes.to_vec(),
            ));
            continue;
        };
        let scales = ckpt.tensor_bytes(&format!("{stem}_scales")).unwrap();
        let s = &loc.info.shape;
        let (e, rows, cols) = (s[0], s[1], s[2] * 32);
        let mut out = vec![0u8; e * rows * cols * 2];
        for x in 0..e {
            for r in 0..rows {
                for c in 0..cols {
                    let row = (x * rows + r) * cols;
                    let byte = bytes[(row + c) / 2];
                    let nib = if c % 2 == 0 { byte & 15 } else { byte >> 4 };
                    let scale = scales[(row + c) / 32];
                    let v = libvoom::backend::view::E2M1[nib as usize]
                        * libvoom::backend::view::e8m0_to_f32(scale);
                    let b = half::bf16::from_f32(v);
                    assert_eq!(b.to_f32(), v, "{stem}: not a BF16");
                    // [E, rows (out), cols (in)] -> [E, cols, rows].
                    let at = 2 * ((x * cols + c) * rows + r);
                    out[at..at + 2].copy_from_slice(&b.to_le_bytes());
                }
            }
        }
        owned.push((stem.to_string(), DType::BF16, vec![e, cols, rows], out));
    }
    let refs: Vec<(&str, DType, &[usize], &[u8])> = owned
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    voom_formats::safetensors::write(
        &to.join("model.safetensors"),
        &refs,
        &std::collections::BTreeMap::new(),
    )
    .unwrap();
}

/// `check_case` for the model in `dir` against the reference of fixture `of`.
fn check_case_at(dir: &Path, of: &Path) {
    std::fs::copy(of.join("reference.json"), dir.join("reference.json")).unwrap();
    check_case(dir, EngineOptions::default());
}

/// Through the store core at a budget below one layer (every expert page streamed),
/// the bits of the mapped model.
#[test]
fn gpt_oss_through_the_store_core_below_one_layer_gives_the_mapped_bits() {
    for case in cases() {
        common::check_store_below_one_layer(&fixtures().join(&case), 3);
    }
}

fn edited(
    case: &str,
    edit: impl Fn(&str, &mut DType, &mut Vec<usize>, &mut Vec<u8>) -> bool,
    cfg: impl Fn(&mut Value),
) -> tempfile::TempDir {
    edited_copy(&fixtures().join(case), edit, cfg)
}

fn keep(_: &str, _: &mut DType, _: &mut Vec<usize>, _: &mut Vec<u8>) -> bool {
    true
}

const GATE_UP: &str = "model.layers.1.mlp.experts.gate_up_proj";

#[test]
fn missing_gpt_oss_tensors_are_named_at_open() {
    for (case, gone) in [
        (MXFP4, "model.layers.2.self_attn.sinks".to_string()),
        (BF16, "model.layers.0.self_attn.sinks".to_string()),
        (MXFP4, "model.layers.0.mlp.router.bias".to_string()),
        (MXFP4, format!("{GATE_UP}_scales")),
        (
            MXFP4,
            "model.layers.3.mlp.experts.down_proj_bias".to_string(),
        ),
        (
            BF16,
            "model.layers.1.mlp.experts.gate_up_proj_bias".to_string(),
        ),
    ] {
        let d = edited(case, |n, _, _, _| n != gone, |_| {});
        let e = open_err(d.path());
        assert!(e.contains(&gone) && e.contains("missing"), "{gone}: {e}");
    }
}

#[test]
fn mxfp4_shapes_that_disagree_are_named_at_open() {
    // Scales for one group too few per row.
    let d = edited(
        MXFP4,
        |n, _, shape, bytes| {
            if n == format!("{GATE_UP}_scales") {
                let g = shape[2];
                *bytes = bytes.chunks(g).flat_map(|r| r[..g - 1].to_vec()).collect();
                shape[2] = g - 1;
            }
            true
        },
        |_| {},
    );
    let e = open_err(d.path());
    assert!(
        e.contains(GATE_UP) && e.contains("'hidden_size' / 32"),
        "{e}"
    );
    // Blocks of the wrong width: 15 bytes a group.
    let d = edited(
        MXFP4,
        |n, _, shape, bytes| {
            if n == format!("{GATE_UP}_blocks") {
                *bytes = bytes.chunks(16).flat_map(|r| r[..15].to_vec()).collect();
                shape[3] = 15;
            }
            true
        },
        |_| {},
    );
    let e = open_err(d.path());
    assert!(
        e.contains(GATE_UP) && e.contains("bytes per block of 32 is 16"),
        "{e}"
    );
    // Blocks that are not U8.
    let d = edited(
        MXFP4,
        |n, dt, shape, _| {
            if n == format!("{GATE_UP}_blocks") {
                *dt = DType::I8;
                assert_eq!(shape.len(), 4);
            }
            true
        },
        |_| {},
    );
    let e = open_err(d.path());
    assert!(e.contains(GATE_UP) && e.contains("I8"), "{e}");
    // A router of the wrong width.
    let d = edited(
        MXFP4,
        |n, _, shape, bytes| {
            if n == "model.layers.0.mlp.router.bias" {
                bytes.truncate(bytes.len() - 2);
                shape[0] -= 1;
            }
            true
        },
        |_| {},
    );
    let e = open_err(d.path());
    assert!(
        e.contains("model.layers.0.mlp.router.bias") && e.contains("'num_local_experts' is 4"),
        "{e}"
    );
}

#[test]
fn mxfp4_experts_without_their_quantization_config_are_an_error_at_open() {
    let d = edited(MXFP4, keep, |c| {
        c.as_object_mut().unwrap().remove("quantization_config");
    });
    let e = open_err(d.path());
    assert!(
        e.contains("_blocks") && e.contains("quantization_config"),
        "{e}"
    );
    let d = edited(MXFP4, keep, |c| {
        c["quantization_config"]["quant_method"] = serde_json::json!("mxfp6");
    });
    let e = open_err(d.path());
    assert!(e.contains("quant_method") && e.contains("mxfp6"), "{e}");
}

#[test]
fn a_nan_scale_is_an_error_before_anything_computes_on_it() {
    let scales = format!("{GATE_UP}_scales");
    let d = edited(
        MXFP4,
        |n, _, _, bytes| {
            if n == scales {
                bytes[7] = 255;
            }
            true
        },
        |_| {},
    );
    let e = run_err(d.path());
    // Byte 7 of [4, 128, 3]: expert 0, row 2, group 1.
    assert!(
        e.contains(&scales) && e.contains("255") && e.contains("index [0, 2, 1]"),
        "{e}"
    );
}
