//! FP8 checkpoints as released (DeepSeek-V3/R1, Qwen3-FP8: e4m3 weights with a
//! scale per block, `quantization_config` fp8) run exactly: greedy ids equal
//! transformers' over the weights as stored (dequantized in f32), token for token,
//! on every backend; the bits do not depend on threads, chunks or KV pages; and bad
//! FP8 files are clear errors at open or before anything computes on them.
//! Fixtures: `tests/fixtures/tiny_fp8`, made by `tests/conformance/make_fp8_fixtures.py`.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use libvoom::backend::BackendKind;
use libvoom::engine::{Engine, EngineOptions};
use serde_json::Value;
use voom_formats::{Checkpoint, DType};

use common::{check_case, open_err, run_err};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny_fp8")
}

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
    assert_eq!(cases.len(), 4, "the FP8 fixture index lists {cases:?}");
    cases
}

#[test]
fn greedy_ids_match_transformers_on_every_fp8_case() {
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
        check_case(
            &fixtures().join(&case),
            EngineOptions {
                threads: 1,
                prefill_chunk: 5,
                ..Default::default()
            },
        );
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// A position's logits bits do not depend on the thread count, the prefill chunk,
/// the KV page size or the CPU instruction set.
#[test]
fn logits_bits_do_not_depend_on_chunking_threads_or_backend() {
    for case in cases() {
        common::check_bits_across_runs(&fixtures().join(&case), 2, &BackendKind::available());
    }
}

/// The FP8 model and its twin with every weight widened to F32 as stored (e4m3 times
/// its block's scale) give the same logits bits: the kernels dequantize in the tile
/// to exactly those values and sum in the same order.
#[test]
fn fp8_weights_give_the_bits_of_their_exact_f32_widening() {
    for case in cases() {
        let dir = fixtures().join(&case);
        let twin = tempfile::tempdir().unwrap();
        widen(&dir, twin.path());
        let prompt = common::prompt_of(&dir, 2);
        let run = |d: &Path| {
            let e = Engine::open(d, EngineOptions::default()).unwrap();
            let mut kv = e.new_kv();
            bits(&e.forward_all(&mut kv, &prompt).unwrap())
        };
        assert_eq!(run(&dir), run(twin.path()), "{case}");
    }
}

/// Block `quantization_config.weight_block_size` of `dir`'s config.
fn block_of(dir: &Path) -> (usize, usize) {
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let b = &cfg["quantization_config"]["weight_block_size"];
    (
        b[0].as_u64().unwrap() as usize,
        b[1].as_u64().unwrap() as usize,
    )
}

/// Rewrites `from` into `to` with every FP8 weight as its F32 values
/// (`e4m3 * scale`, the scales dropped) and no `quantization_config`.
fn widen(from: &Path, to: &Path) {
    let (br, bc) = block_of(from);
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(from.join("config.json")).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(to.join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(
        from.join("generation_config.json"),
        to.join("generation_config.json"),
    )
    .unwrap();
    let ckpt = Checkpoint::open(from).unwrap();
    let mut owned: Vec<(String, DType, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, loc) in ckpt.tensors() {
        if name.ends_with("_scale_inv") {
            continue;
        }
        let bytes = ckpt.tensor_bytes(name).unwrap();
        let shape = loc.info.shape.clone();
        if loc.info.dtype != DType::F8E4M3 {
            owned.push((name.to_string(), loc.info.dtype, shape, bytes.to_vec()));
            continue;
        }
        let scale_name = format!("{name}_scale_inv");
        let sl = &ckpt
            .tensors()
            .find(|(n, _)| *n == scale_name)
            .unwrap()
            .1
            .info;
        let scales =
            voom_formats::dtype::to_f32_vec(sl.dtype, ckpt.tensor_bytes(&scale_name).unwrap());
        let (rows, cols) = (shape[shape.len() - 2], shape[shape.len() - 1]);
        let (nr, nc) = (rows.div_ceil(br), cols.div_ceil(bc));
        let mut out = Vec::with_capacity(bytes.len() * 4);
        for (i, &b) in bytes.iter().enumerate() {
            let (m, r, c) = (i / (rows * cols), i / cols % rows, i % cols);
            let s = scales[m * nr * nc + (r / br) * nc + c / bc];
            let v = libvoom::backend::view::e4m3_to_f32(b) * s;
            out.extend_from_slice(&v.to_le_bytes());
        }
        owned.push((name.to_string(), DType::F32, shape, out));
    }
    let refs: Vec<(&str, DType, &[usize], &[u8])> = owned
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    voom_formats::safetensors::write(&to.join("model.safetensors"), &refs, &BTreeMap::new())
        .unwrap();
}

fn edited(
    case: &str,
    edit: impl Fn(&str, &mut DType, &mut Vec<usize>, &mut Vec<u8>) -> bool,
    cfg: impl Fn(&mut Value),
) -> tempfile::TempDir {
    common::edited_copy(&fixtures().join(case), edit, cfg)
}

const CASE: &str = "qwen3_fp8_partial_blocks";
const Q: &str = "model.layers.1.self_attn.q_proj.weight";

fn keep(_: &str, _: &mut DType, _: &mut Vec<usize>, _: &mut Vec<u8>) -> bool {
    true
}

#[test]
fn a_missing_scale_tensor_is_named_at_open() {
    let d = edited(CASE, |n, _, _, _| n != format!("{Q}_scale_inv"), |_| {});
    let e = open_err(d.path());
    assert!(
        e.contains(Q) && e.contains("block scales") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn scales_of_the_wrong_shape_are_named_at_open() {
    let d = edited(
        CASE,
        |n, _, shape, bytes| {
            if n == format!("{Q}_scale_inv") {
                // One block column too few: the block size does not tile the weight.
                let cols = shape[1];
                *bytes = bytes
                    .chunks(4 * cols)
                    .flat_map(|row| row[..4 * (cols - 1)].to_vec())
                    .collect();
                shape[1] = cols - 1;
            }
            true
        },
        |_| {},
    );
    let e = open_err(d.path());
    assert!(e.contains("_scale_inv") && e.contains("block 32"), "{e}");
}

#[test]
fn a_block_size_the_scales_disagree_with_is_an_error_at_open() {
    let d = edited(CASE, keep, |c| {
        c["quantization_config"]["weight_block_size"] = serde_json::json!([24, 64]);
    });
    let e = open_err(d.path());
    assert!(e.contains("_scale_inv") && e.contains("block 64"), "{e}");
    for bad in [
        serde_json::json!([24, 12]),
        serde_json::json!([0, 32]),
        serde_json::json!(128),
    ] {
        let d = edited(CASE, keep, |c| {
            c["quantization_config"]["weight_block_size"] = bad.clone();
        });
        let e = open_err(d.path());
        assert!(e.contains("weight_block_size"), "{bad}: {e}");
    }
}

#[test]
fn fp8_weights_without_their_quantization_config_are_an_error_at_open() {
    let d = edited(CASE, keep, |c| {
        c.as_object_mut().unwrap().remove("quantization_config");
    });
    let e = open_err(d.path());
    assert!(
        e.contains("F8_E4M3") && e.contains("quantization_config"),
        "{e}"
    );
    // A weight the config leaves unconverted but stored FP8.
    let d = edited(CASE, keep, |c| {
        c["quantization_config"]["modules_to_not_convert"] =
            serde_json::json!(["model.layers.1.self_attn"]);
    });
    let e = open_err(d.path());
    assert!(
        e.contains("modules_to_not_convert") && e.contains("self_attn"),
        "{e}"
    );
}

#[test]
fn unknown_quantization_is_named_at_open() {
    for (key, value, want) in [
        ("quant_method", serde_json::json!("awq"), "awq"),
        ("fmt", serde_json::json!("e5m2"), "e5m2"),
        ("activation_scheme", serde_json::json!("static"), "static"),
    ] {
        let d = edited(CASE, keep, |c| {
            c["quantization_config"][key] = value.clone();
        });
        let e = open_err(d.path());
        assert!(e.contains(key) && e.contains(want), "{key}: {e}");
    }
    // E5M2 weights: no release stores them.
    let d = edited(
        CASE,
        |n, dt, _, _| {
            if n == Q {
                *dt = DType::F8E5M2;
            }
            true
        },
        |_| {},
    );
    let e = open_err(d.path());
    assert!(e.contains(Q) && e.contains("F8_E5M2"), "{e}");
}

#[test]
fn a_nan_fp8_byte_or_scale_is_an_error_before_anything_computes_on_it() {
    for (tensor, at, value, want) in [
        (Q.to_string(), 100usize, vec![0x7Fu8], "0x7f"),
        (Q.to_string(), 4095, vec![0xFF], "0xff"),
        (
            format!("{Q}_scale_inv"),
            4,
            f32::NAN.to_le_bytes().to_vec(),
            "NaN",
        ),
        (
            format!("{Q}_scale_inv"),
            0,
            f32::INFINITY.to_le_bytes().to_vec(),
            "inf",
        ),
    ] {
        let d = edited(
            CASE,
            |n, _, _, bytes| {
                if n == tensor {
                    bytes[at..at + value.len()].copy_from_slice(&value);
                }
                true
            },
            |_| {},
        );
        let e = run_err(d.path());
        assert!(e.contains(&tensor) && e.contains(want), "{tensor}: {e}");
        if tensor == Q {
            // Element 100 of a [64, 64] weight: row 1, column 36.
            assert!(at != 100 || e.contains("index [1, 36]"), "{e}");
        }
    }
}

/// The manifest and vpack path: an FP8 model hashed into a manifest and packed
/// gives the mapped model's bits through the store core at a budget below one
/// layer (every page streamed).
#[test]
fn fp8_through_the_store_core_below_one_layer_gives_the_mapped_bits() {
    for case in cases() {
        common::check_store_below_one_layer(&fixtures().join(&case), 2);
    }
}
