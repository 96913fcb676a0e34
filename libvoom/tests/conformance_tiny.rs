//! Conformance with Hugging Face transformers (DESIGN.md invariant 2): on tiny random
//! BF16 checkpoints of every supported architecture, greedy ids equal transformers'
//! (float32 arithmetic, eager attention) token for token, and the first step's logits
//! agree to float32 noise. References: `tests/fixtures/tiny`, made by
//! `tests/conformance/make_fixtures.py`.

mod common;

use std::path::{Path, PathBuf};

use libvoom::backend::BackendKind;
use libvoom::engine::{Engine, EngineOptions};
use serde_json::Value;

use common::{check_case, json_ids as ids, SameBits};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny")
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
    assert!(
        cases.len() >= 7,
        "the fixture index lists {} cases",
        cases.len()
    );
    cases
}

/// On every backend this machine has (each CPU instruction set).
#[test]
fn greedy_ids_match_transformers_on_every_architecture() {
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
    for backend in BackendKind::available() {
        for case in cases() {
            check_case(
                &fixtures().join(&case),
                EngineOptions {
                    threads: 1,
                    prefill_chunk: 7,
                    backend,
                    ..Default::default()
                },
            );
        }
    }
}

/// Batch invariance (DESIGN.md invariant 6): a position's logits are bit-identical
/// whatever the prefill chunk size, the thread count, the KV cache's page size and
/// the CPU instruction set; on MLX (where built), whatever the chunk and page size.
#[test]
fn logits_bits_do_not_depend_on_chunking_threads_or_backend() {
    for case in cases() {
        let dir = fixtures().join(&case);
        let reference: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
                .unwrap();
        let prompt = ids(&reference["prompts"][2]["prompt_ids"]);
        let mut seen = SameBits::default();
        let runs = BackendKind::available().into_iter().flat_map(|backend| {
            // (threads, prefill chunk, KV page positions)
            [
                (1, 1, 1),
                (2, 3, 3),
                (3, 256, 128),
                (2, 5, 1 << 20),
                (1, 7, 16),
            ]
            .map(|(threads, chunk, page)| (threads, chunk, page, backend))
        });
        for (threads, chunk, page, backend) in runs {
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
            let name = backend.name();
            let mut kv = e.new_kv();
            let all = e.forward_all(&mut kv, &prompt).unwrap();
            let mut kv2 = e.new_kv();
            let last = e.prefill(&mut kv2, &prompt).unwrap();
            let v = e.config().vocab_size;
            // (Where the backend is batch invariant: MLX's GPU kernels are not claimed
            // to be, and `SameBits` says so.)
            assert!(
                !backend.batch_invariant() || bits(&all[all.len() - v..]) == bits(&last),
                "{case}: all-positions and last-position logits differ (threads {threads}, chunk {chunk}, KV pages of {page}, {name})"
            );
            seen.check(
                backend,
                bits(&all),
                &format!("{case}: threads {threads}, chunk {chunk}, KV pages of {page}, {name}"),
            );
        }
    }
}

/// Batch invariance across sequences: several sequences of different lengths and
/// histories, computed in one pass (`Engine::forward_batch`), each get the logits
/// bits they get alone, and each KV cache then continues as a solo one does.
#[test]
fn a_batch_of_sequences_gives_each_its_solo_bits() {
    use libvoom::model::{Logits, SeqPass};
    // The hybrids too (tests/fixtures/tiny_hybrid): each sequence's recurrent state
    // is its own.
    let hybrids = fixtures().join("../tiny_hybrid");
    let hybrid_index: Value =
        serde_json::from_str(&std::fs::read_to_string(hybrids.join("index.json")).unwrap())
            .unwrap();
    let dirs = cases().into_iter().map(|c| fixtures().join(c)).chain(
        hybrid_index["cases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| hybrids.join(c["name"].as_str().unwrap())),
    );
    for dir in dirs {
        let case = dir.file_name().unwrap().to_string_lossy().into_owned();
        let reference: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
                .unwrap();
        let prompts: Vec<Vec<u32>> = reference["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| ids(&p["prompt_ids"]))
            .collect();
        for chunk in [3, 256] {
            let e = Engine::open(
                &dir,
                EngineOptions {
                    prefill_chunk: chunk,
                    ..Default::default()
                },
            )
            .unwrap();
            // Sequence i has its prompt's first half in its cache already (the first
            // none), and computes the rest; then one more token each, batched again.
            let (mut solo, mut batched): (Vec<_>, Vec<_>) =
                prompts.iter().map(|_| (e.new_kv(), e.new_kv())).unzip();
            let split: Vec<usize> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| if i == 0 { 0 } else { p.len() / 2 })
                .collect();
            for ((p, &at), (s, b)) in prompts
                .iter()
                .zip(&split)
                .zip(solo.iter_mut().zip(batched.iter_mut()))
            {
                if at > 0 {
                    e.prefill(s, &p[..at]).unwrap();
                    e.prefill(b, &p[..at]).unwrap();
                }
            }
            let wants: Vec<Logits> = (0..prompts.len())
                .map(|i| {
                    if i % 2 == 0 {
                        Logits::All
                    } else {
                        Logits::Last
                    }
                })
                .collect();
            let alone: Vec<Vec<f32>> = prompts
                .iter()
                .zip(&split)
                .zip(solo.iter_mut())
                .zip(&wants)
                .map(|(((p, &at), kv), want)| match want {
                    Logits::All => e.forward_all(kv, &p[at..]).unwrap(),
                    Logits::Last => e.prefill(kv, &p[at..]).unwrap(),
                })
                .collect();
            let mut seqs: Vec<SeqPass<'_>> = prompts
                .iter()
                .zip(&split)
                .zip(batched.iter_mut())
                .zip(&wants)
                .map(|(((p, &at), kv), &want)| SeqPass::new(&p[at..], kv, want))
                .collect();
            let together = e.forward_batch(&mut seqs).unwrap();
            drop(seqs);
            for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
                assert_eq!(
                    bits(a),
                    bits(t),
                    "{case}: sequence {i} (chunk {chunk}) differs batched"
                );
            }
            // The caches hold the same: one more token each, batched and alone.
            let next: Vec<[u32; 1]> = (0..prompts.len())
                .map(|i| [(i as u32 * 31 + 7) % 200])
                .collect();
            let alone: Vec<Vec<f32>> = solo
                .iter_mut()
                .zip(&next)
                .map(|(kv, t)| e.prefill(kv, t).unwrap())
                .collect();
            let mut seqs: Vec<SeqPass<'_>> = batched
                .iter_mut()
                .zip(&next)
                .map(|(kv, t)| SeqPass::new(t, kv, Logits::Last))
                .collect();
            let together = e.forward_batch(&mut seqs).unwrap();
            for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
                assert_eq!(
                    bits(a),
                    bits(t),
                    "{case}: sequence {i}'s next token differs batched"
                );
            }
        }
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}
