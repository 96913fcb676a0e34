//! Multi-token prediction (`libvoom::mtp`): a checkpoint's own prediction layer
//! drafts the ids the reference computes (tests/conformance/make_mtp_fixtures.py,
//! vLLM's scheme over transformers' modules, float32 over the BF16 weights), and a
//! run drafting with it keeps plain greedy's ids and logits bits; the decoder runs
//! as before with the layer stored; a model without one, or with one that does not
//! load, says why.

mod common;

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use libvoom::engine::{Decoding, Engine, EngineOptions, GenerateParams, Generation};
use libvoom::mtp::MtpDrafter;
use libvoom::sampler::SamplingParams;
use libvoom::speculate::Drafter;
use libvoom::VoomError;
use serde_json::Value;
use voom_formats::dtype::DType;

use common::{bits, fixtures};

/// The last: the first's FP8 form (made by `tests/conformance/make_fp8_fixtures.py`),
/// its prediction layer quantized too.
const CASES: [&str; 3] = [
    "deepseek_v3_mla_yarn_mtp",
    "glm4_moe_partial_rotary_shared_mtp",
    "deepseek_v3_mla_yarn_mtp_fp8",
];

fn mtp_fixture(case: &str) -> PathBuf {
    fixtures().join("../tiny_mtp").join(case)
}

fn reference(case: &str) -> Value {
    let path = mtp_fixture(case).join("reference_mtp.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The MTP drafter, recording each proposal with the length of the context it
/// followed.
struct Recording<'e> {
    inner: MtpDrafter<'e>,
    seen: Vec<(usize, Vec<u32>)>,
}

impl Drafter for Recording<'_> {
    fn name(&self) -> String {
        self.inner.name()
    }

    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, VoomError> {
        let p = self.inner.propose(context, k)?;
        self.seen.push((context.len(), p.clone()));
        Ok(p)
    }

    fn wants_hidden(&self) -> bool {
        self.inner.wants_hidden()
    }

    fn observe_hidden(&mut self, first: usize, hidden: &[f32]) {
        self.inner.observe_hidden(first, hidden)
    }
}

fn run(
    e: &Engine,
    prompt: &[u32],
    params: &GenerateParams,
    d: Option<&mut dyn Drafter>,
) -> Generation {
    e.generate_with(
        prompt,
        params,
        Decoding {
            constraint: None,
            drafter: d,
        },
        &mut |_| ControlFlow::Continue(()),
    )
    .unwrap()
}

/// At every point a run drafts, the layer proposes the reference's ids (up to a
/// near-tie of the reference's float32 sums, where another order of the same sums
/// may pick either), and the run's ids and logits bits are plain greedy's, which are
/// transformers' (the stored layer changes nothing of the decoder).
#[test]
fn the_prediction_layer_drafts_the_reference_ids_and_decoding_stays_exact() {
    for case in CASES {
        let e = Engine::open(&mtp_fixture(case), EngineOptions::default()).unwrap();
        e.check_mtp().unwrap();
        let r = reference(case);
        let k = r["draft_len"].as_u64().unwrap() as usize;
        let min_margin = r["min_margin_threshold"].as_f64().unwrap();
        let min_gap = r["min_router_gap_threshold"].as_f64().unwrap();
        let (mut compared, mut drafted, mut accepted) = (0, 0, 0);
        for s in r["sequences"].as_array().unwrap() {
            let prompt = ids(&s["prompt_ids"]);
            let want = ids(&s["generated_ids"]);
            let params = GenerateParams {
                max_new_tokens: want.len(),
                record_logits: true,
                max_draft: k,
                adaptive_draft: false,
                ..GenerateParams::default()
            };
            let plain = run(&e, &prompt, &params, None);
            assert_eq!(plain.ids, want, "{case}: the decoder's greedy ids");
            let mut rec = Recording {
                inner: MtpDrafter::new(&e).unwrap(),
                seen: Vec::new(),
            };
            let g = run(&e, &prompt, &params, Some(&mut rec));
            assert_eq!(g.ids, plain.ids, "{case}: ids drafting with the layer");
            assert_eq!(
                bits(&g.logits),
                bits(&plain.logits),
                "{case}: logits bits drafting with the layer"
            );
            let spec = g.speculation.as_ref().unwrap();
            assert!(spec.drafter.starts_with("mtp:"), "{}", spec.drafter);
            drafted += spec.drafted;
            accepted += spec.accepted;
            assert!(!rec.seen.is_empty(), "{case}: the layer drafted");
            let drafts = s["drafts"].as_array().unwrap();
            for (n, got) in &rec.seen {
                let d = drafts
                    .iter()
                    .find(|d| d["context_len"].as_u64() == Some(*n as u64))
                    .unwrap_or_else(|| panic!("{case}: no reference draft after {n} ids"));
                let want = ids(&d["ids"]);
                // Up to the first near-tie, and as many as the run asked for.
                let sure = (0..want.len())
                    .take_while(|&i| {
                        d["margins"][i].as_f64().unwrap() >= min_margin
                            && d["router_gaps"][i].as_f64().unwrap_or(f64::INFINITY) >= min_gap
                    })
                    .count();
                let m = sure.min(got.len());
                assert!(!got.is_empty(), "{case}: nothing drafted after {n} ids");
                assert_eq!(
                    got[..m],
                    want[..m],
                    "{case}: drafts after {n} ids of {prompt:?} + {:?}",
                    plain.ids
                );
                compared += m;
            }
        }
        eprintln!("{case}: {compared} drafted ids equal the reference's; {accepted} of {drafted} proposals kept");
        assert!(
            compared >= 100,
            "{case}: only {compared} drafted ids compared"
        );
    }
}

/// Sampled runs: plain sampling's draws exactly, drafting with the layer; with
/// speculative sampling asked for, the layer samples its proposals and the report
/// says so.
#[test]
fn sampled_runs_draft_with_the_layer() {
    let case = CASES[0];
    let e = Engine::open(&mtp_fixture(case), EngineOptions::default()).unwrap();
    let prompt = ids(&reference(case)["sequences"][2]["prompt_ids"]);
    let mut params = GenerateParams {
        max_new_tokens: 12,
        record_logits: true,
        max_draft: 3,
        adaptive_draft: false,
        sampling: SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            top_k: 0,
            seed: 7,
        },
        ..GenerateParams::default()
    };
    let plain = run(&e, &prompt, &params, None);
    let mut d = MtpDrafter::new(&e).unwrap();
    let g = run(&e, &prompt, &params, Some(&mut d));
    assert_eq!(g.ids, plain.ids);
    assert_eq!(bits(&g.logits), bits(&plain.logits));
    assert_eq!(g.speculation.as_ref().unwrap().scheme, "exact");
    params.speculative_sampling = true;
    let mut d = MtpDrafter::new(&e).unwrap();
    let g = run(&e, &prompt, &params, Some(&mut d));
    assert_eq!(g.ids.len(), 12);
    let spec = g.speculation.unwrap();
    assert_eq!(spec.scheme, "speculative-sampling");
    assert!(spec.drafted > 0);
}

/// A copy of `case`'s directory in a temporary one, less the tensors `drop` names.
fn without(case: &str, dropped: impl Fn(&str) -> bool) -> tempfile::TempDir {
    let src = mtp_fixture(case);
    let d = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), d.path().join(f.file_name())).unwrap();
    }
    let path = d.path().join("model.safetensors");
    let st = voom_formats::safetensors::SafetensorsFile::open(&path).unwrap();
    let kept: Vec<(String, DType, Vec<usize>, Vec<u8>)> = st
        .header
        .tensors
        .iter()
        .filter(|t| !dropped(&t.name))
        .map(|t| {
            let bytes = st.tensor_bytes(t).to_vec();
            (t.name.clone(), t.dtype, t.shape.clone(), bytes)
        })
        .collect();
    assert!(kept.len() < st.header.tensors.len(), "nothing dropped");
    drop(st);
    let specs: Vec<(&str, DType, &[usize], &[u8])> = kept
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    voom_formats::safetensors::write(&path, &specs, &BTreeMap::new()).unwrap();
    d
}

fn open(dir: &Path) -> Engine {
    Engine::open(dir, EngineOptions::default()).unwrap()
}

/// Without a prediction layer, or with one that does not load, the model runs and
/// drafting with the layer is an error saying why; a layer without its own copies of
/// the embedding and head drafts with the decoder's (the same values here: the
/// same drafts).
#[test]
fn a_missing_or_broken_prediction_layer_is_a_clear_error_and_the_model_still_runs() {
    let tiny = fixtures();
    let e = open(&tiny.join("llama_gqa_untied"));
    let err = MtpDrafter::new(&e).err().unwrap().to_string();
    assert!(err.contains("no multi-token-prediction layers"), "{err}");
    let e = open(&tiny.join("deepseek_v3_mla_yarn"));
    let err = e.check_mtp().unwrap_err().to_string();
    assert!(
        err.contains("it holds 3 layers for 'num_hidden_layers' 3"),
        "{err}"
    );

    let case = CASES[1];
    let r = reference(case);
    let s = &r["sequences"][1];
    let (prompt, want) = (ids(&s["prompt_ids"]), ids(&s["generated_ids"]));
    let params = GenerateParams {
        max_new_tokens: want.len(),
        ..GenerateParams::default()
    };
    let broken = without(case, |n| n == "model.layers.3.eh_proj.weight");
    let e = open(broken.path());
    let err = e.check_mtp().unwrap_err().to_string();
    assert!(err.contains("model.layers.3.eh_proj.weight"), "{err}");
    assert_eq!(run(&e, &prompt, &params, None).ids, want);

    let shared = without(case, |n| {
        n == "model.layers.3.embed_tokens.weight" || n == "model.layers.3.shared_head.head.weight"
    });
    let full = open(&mtp_fixture(case));
    let e = open(shared.path());
    let params = GenerateParams {
        max_draft: 3,
        adaptive_draft: false,
        ..params
    };
    let mut a = Recording {
        inner: MtpDrafter::new(&full).unwrap(),
        seen: Vec::new(),
    };
    let mut b = Recording {
        inner: MtpDrafter::new(&e).unwrap(),
        seen: Vec::new(),
    };
    assert_eq!(run(&full, &prompt, &params, Some(&mut a)).ids, want);
    assert_eq!(run(&e, &prompt, &params, Some(&mut b)).ids, want);
    assert_eq!(a.seen, b.seen);
}

/// Sequences drafting with the layer in one batch (their pieces packed into shared
/// chunks where attention is grouped-query, prompts chunked): each gets its solo
/// ids, logits bits and drafts.
#[test]
fn batched_sequences_draft_as_they_do_alone() {
    for case in CASES {
        let e = Engine::open(
            &mtp_fixture(case),
            EngineOptions {
                prefill_chunk: 4,
                ..Default::default()
            },
        )
        .unwrap();
        let r = reference(case);
        let seqs: Vec<&Value> = r["sequences"].as_array().unwrap().iter().take(3).collect();
        let params = |i: usize| GenerateParams {
            max_new_tokens: 8 + 2 * i,
            record_logits: true,
            ignore_eos: true,
            max_draft: 2 + i,
            adaptive_draft: false,
            ..GenerateParams::default()
        };
        let mut alone = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            let mut d = Recording {
                inner: MtpDrafter::new(&e).unwrap(),
                seen: Vec::new(),
            };
            let g = run(&e, &ids(&s["prompt_ids"]), &params(i), Some(&mut d));
            alone.push((g, d.seen));
        }
        let mut drafters: Vec<Recording<'_>> = seqs
            .iter()
            .map(|_| Recording {
                inner: MtpDrafter::new(&e).unwrap(),
                seen: Vec::new(),
            })
            .collect();
        let mut running: Vec<libvoom::engine::Sequence<'_>> = seqs
            .iter()
            .zip(drafters.iter_mut())
            .enumerate()
            .map(|(i, (s, d))| {
                let decoding = Decoding {
                    constraint: None,
                    drafter: Some(d as &mut dyn Drafter),
                };
                e.sequence(&ids(&s["prompt_ids"]), &params(i), decoding)
                    .unwrap()
            })
            .collect();
        let mut steps = 0;
        while running.iter().any(|s| !s.finished()) {
            let mut batch: Vec<&mut libvoom::engine::Sequence<'_>> =
                running.iter_mut().filter(|s| !s.finished()).collect();
            e.step(&mut batch, 6, &mut |_, _| ControlFlow::Continue(()))
                .unwrap();
            steps += 1;
            assert!(steps < 200, "{case}: the batch does not end");
        }
        let got: Vec<Generation> = running.into_iter().map(|s| s.into_generation()).collect();
        for (i, (g, (a, seen))) in got.iter().zip(&alone).enumerate() {
            assert_eq!(g.ids, a.ids, "{case}: sequence {i}'s ids batched");
            assert_eq!(
                bits(&g.logits),
                bits(&a.logits),
                "{case}: sequence {i}'s logits batched"
            );
            assert_eq!(
                &drafters[i].seen, seen,
                "{case}: sequence {i}'s drafts batched"
            );
        }
    }
}

/// DESIGN.md invariant 1 with the layer drafting: its drafts, and the run's ids and
/// bits, are the embedded store's whatever the page source and its budget (the
/// store core's cache, ample or smaller than the model, prefetching or not).
#[test]
fn drafts_are_the_same_from_any_page_source() {
    use vpaged::store::{Store, StoreConfig, StoreSource};
    for case in CASES {
        let (_tmp, dir) = common::copy_with_manifest(&mtp_fixture(case));
        let manifest = voom_formats::Manifest::load(&dir).unwrap().unwrap();
        let model_bytes: u64 = manifest.pages.iter().map(|p| p.len).sum();
        let r = reference(case);
        let prompt = ids(&r["sequences"][2]["prompt_ids"]);
        let params = GenerateParams {
            max_new_tokens: 10,
            record_logits: true,
            max_draft: 3,
            adaptive_draft: false,
            ..GenerateParams::default()
        };
        let drafted = |e: &Engine| {
            let mut d = Recording {
                inner: MtpDrafter::new(e).unwrap(),
                seen: Vec::new(),
            };
            let g = run(e, &prompt, &params, Some(&mut d));
            (g.ids, bits(&g.logits), d.seen)
        };
        let embedded = drafted(&open(&dir));
        for (budget, prefetch_depth) in [(64 << 20, 1), (192 << 10, 0), (192 << 10, 2)] {
            let store = Store::new(StoreConfig {
                cache_bytes: budget,
                ..Default::default()
            })
            .unwrap();
            let src = StoreSource::open(Arc::clone(&store), &dir).unwrap();
            let opts = EngineOptions {
                prefetch_depth,
                ..EngineOptions::default()
            };
            let e = Engine::with_source(&dir, Arc::new(src), opts).unwrap();
            assert_eq!(
                drafted(&e),
                embedded,
                "{case}: a cache of {budget} bytes (the model: {model_bytes}), prefetch depth {prefetch_depth}"
            );
            let loaded = store.cache_stats().bytes_loaded;
            if (budget as u64) < model_bytes {
                // The pages streamed: read again and again.
                assert!(loaded > 2 * model_bytes, "{case}: {loaded} bytes loaded");
            }
        }
    }
}

/// A cache of the prediction layer handed to the decoder (or the decoder's to the
/// layer) is a clear error, not a panic.
#[test]
fn a_cache_of_the_wrong_layout_is_an_error() {
    use libvoom::model::{Logits, SeqPass};
    let e = Engine::open(&mtp_fixture(CASES[0]), EngineOptions::default()).unwrap();
    let mut kv = e.new_mtp_kv().unwrap();
    let err = e
        .forward_batch(&mut [SeqPass::new(&[5, 6], &mut kv, Logits::Last)])
        .unwrap_err()
        .to_string();
    assert!(err.contains("KV cache of 1 layers"), "{err}");
    let mut kv = e.new_kv();
    let h = vec![0f32; 2 * e.config().hidden_size];
    let err = e
        .mtp_forward(&mut [SeqPass {
            hidden_in: Some(&h),
            ..SeqPass::new(&[5, 6], &mut kv, Logits::Last)
        }])
        .unwrap_err()
        .to_string();
    assert!(err.contains("KV cache of"), "{err}");
}
