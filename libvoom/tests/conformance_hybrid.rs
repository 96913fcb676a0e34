//! Conformance of the hybrid linear-attention models (qwen3_next, qwen3_5 text) with
//! Hugging Face transformers: greedy ids token for token and first-step logits to
//! float32 noise, on the tiny checkpoints of `tests/fixtures/tiny_hybrid` (made by
//! `tests/conformance/make_hybrid_fixtures.py`). And their recurrent state's
//! invariants: the bits do not depend on how a prompt is cut into chunks or passes,
//! and a cache cut back inside its last pass (rejected drafts) gives the bits of one
//! that never went past the cut.

mod common;

use std::path::{Path, PathBuf};

use libvoom::backend::BackendKind;
use libvoom::engine::{Engine, EngineOptions};
use serde_json::Value;

use common::{check_case, json_ids as ids, SameBits};

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

fn reference(name: &str) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(fixtures().join(name).join("reference.json")).unwrap(),
    )
    .unwrap()
}

#[test]
fn greedy_ids_match_transformers_on_every_hybrid() {
    for backend in BackendKind::available() {
        for case in cases() {
            check_case(
                &fixtures().join(&case),
                EngineOptions {
                    backend,
                    ..EngineOptions::default()
                },
            );
        }
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The 200-token prompt of a case.
fn long_prompt(case: &str) -> Vec<u32> {
    let r = reference(case);
    let p = r["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["prompt_length"].as_u64() == Some(200))
        .unwrap();
    ids(&p["prompt_ids"])
}

/// A position's logits bits do not depend on the prefill chunk, the threads, the KV
/// page size, the backend, nor on the prompt being computed in one pass or two (the
/// recurrent state carried between them).
#[test]
fn logits_bits_do_not_depend_on_chunks_passes_threads_or_backend() {
    for case in cases() {
        let dir = fixtures().join(&case);
        let prompt = long_prompt(&case);
        let mut seen = SameBits::default();
        let runs = BackendKind::available().into_iter().flat_map(|backend| {
            [
                (1, 1, 1, 0),
                (2, 3, 3, 77),
                (3, 256, 128, 0),
                (1, 7, 16, 199),
            ]
            .map(|(threads, chunk, page, split)| (threads, chunk, page, split, backend))
        });
        for (threads, chunk, page, split, backend) in runs {
            let e = Engine::open(
                &dir,
                EngineOptions {
                    threads,
                    prefill_chunk: chunk,
                    backend,
                    kv_page_positions: page,
                    ..Default::default()
                },
            )
            .unwrap();
            let mut kv = e.new_kv();
            let mut all = Vec::new();
            if split > 0 {
                all = e.forward_all(&mut kv, &prompt[..split]).unwrap();
            }
            all.extend(e.forward_all(&mut kv, &prompt[split..]).unwrap());
            let what = format!(
                "{case}: threads {threads}, chunk {chunk}, KV pages of {page}, split at {split}, {}",
                backend.name()
            );
            seen.check(backend, bits(&all), &what);
        }
    }
}

/// Rejected drafted tokens: a cache whose last pass is cut back inside it (the
/// recurrent state restored to that pass's start, the kept positions computed again
/// from their ids) continues with the bits of a cache that stopped at the cut; cut
/// further back than the last pass, it computes everything again, with the same bits.
#[test]
fn a_cache_cut_inside_its_last_pass_continues_as_one_that_stopped_there() {
    for case in cases() {
        let e = Engine::open(&fixtures().join(&case), EngineOptions::default()).unwrap();
        // What the memory planner counts for the states is what a cache holds.
        assert_eq!(e.model().state_bytes(), e.new_kv().bytes() as u64, "{case}");
        assert!(e.model().state_bytes() > 0, "{case}");
        let prompt = long_prompt(&case);
        let (head, drafted, cut, end) = (100, 130, 110, 140);
        let mut straight = e.new_kv();
        e.forward_all(&mut straight, &prompt[..cut]).unwrap();
        let want = bits(&e.forward_all(&mut straight, &prompt[cut..end]).unwrap());

        let mut kv = e.new_kv();
        e.forward_all(&mut kv, &prompt[..head]).unwrap();
        e.forward_all(&mut kv, &prompt[head..drafted]).unwrap();
        kv.truncate(cut);
        assert_eq!(
            kv.lost(),
            Some(head),
            "{case}: the kept drafts are to compute again"
        );
        let got = bits(&e.forward_all(&mut kv, &prompt[cut..end]).unwrap());
        assert!(
            got == want,
            "{case}: a cut inside the last pass changed the bits"
        );
        assert_eq!(kv.len(), end);

        // Further back than the last pass: everything again.
        kv.truncate(cut - 40);
        assert_eq!(kv.lost(), Some(0), "{case}");
        let mut fresh = e.new_kv();
        e.forward_all(&mut fresh, &prompt[..cut - 40]).unwrap();
        let want = bits(&e.forward_all(&mut fresh, &prompt[cut - 40..end]).unwrap());
        let got = bits(&e.forward_all(&mut kv, &prompt[cut - 40..end]).unwrap());
        assert!(
            got == want,
            "{case}: a cut before the last pass changed the bits"
        );
    }
}

/// Qwen3.5 as released: the vision-language checkpoint (`qwen3_5`, `qwen3_5_moe`:
/// the language model's config under `text_config`, its weights under
/// `model.language_model.`, a vision tower beside them), made by
/// `tests/conformance/make_vlm_form_fixtures.py` from the text fixtures, whose
/// transformers ids (text only) it gives: the engine reads the language model out
/// of it and gives them too.
#[test]
fn released_vision_language_checkpoints_give_their_language_models_ids() {
    for case in ["qwen3_5_vlm_form", "qwen3_5_moe_vlm_form"] {
        check_case(&fixtures().join(case), EngineOptions::default());
    }
}
