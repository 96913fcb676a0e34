//! Speculative decoding (`libvoom::speculate`, `Engine::generate_with`): whatever a
//! drafter proposes, the ids and every recorded logits bit equal plain decoding's,
//! greedy, sampled and constrained, through the paths where proposals are all kept,
//! some kept and none kept; proposals that are kept save passes; a draft model
//! with another tokenizer is an error naming both.

mod common;

use std::ops::ControlFlow;

use libvoom::constrain::{ConstrainError, TokenConstraint, TokenMask};
use libvoom::draft::DraftModel;
use libvoom::engine::{Decoding, Engine, EngineOptions, FinishReason, GenerateParams, Generation};
use libvoom::sampler::SamplingParams;
use libvoom::speculate::lookup::PromptLookup;
use libvoom::speculate::Drafter;
use libvoom::VoomError;

use common::{bits, case_dirs, fixtures, prompt_of, smollm2_dir};

/// How a scripted drafter's proposals relate to the run they are checked against.
#[derive(Clone, Copy, Debug)]
enum Script {
    /// The plain run's next ids: every proposal kept.
    All,
    /// Never the plain run's next id: none kept.
    None,
    /// The plain run's next ids for the first `context length % 3`, then wrong.
    Some,
}

/// A drafter that knows the plain run's output (`truth`: prompt and ids) and proposes
/// by its script, so that each verification path is taken on purpose.
struct Scripted {
    truth: Vec<u32>,
    script: Script,
    vocab: u32,
}

impl Drafter for Scripted {
    fn name(&self) -> String {
        format!("scripted-{:?}", self.script)
    }

    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, VoomError> {
        assert_eq!(
            context,
            &self.truth[..context.len()],
            "the drafter is given the committed ids only"
        );
        let right = match self.script {
            Script::All => k,
            Script::None => 0,
            Script::Some => context.len() % 3,
        };
        Ok((0..k)
            .map(|i| {
                let t = self
                    .truth
                    .get(context.len() + i)
                    .copied()
                    .unwrap_or(i as u32 % self.vocab);
                if i < right {
                    t
                } else {
                    (t + 1) % self.vocab
                }
            })
            .collect())
    }
}

fn generate<'a>(
    e: &Engine,
    prompt: &[u32],
    params: &GenerateParams,
    constraint: Option<&'a mut dyn TokenConstraint>,
    drafter: Option<&'a mut dyn Drafter>,
) -> Generation {
    let mut streamed = Vec::new();
    let g = e
        .generate_with(
            prompt,
            params,
            Decoding {
                constraint,
                drafter,
            },
            &mut |id| {
                streamed.push(id);
                ControlFlow::Continue(())
            },
        )
        .unwrap();
    assert_eq!(
        streamed, g.ids,
        "every committed id is streamed, once, in order"
    );
    g
}

fn check_same(case: &str, what: &str, plain: &Generation, spec: &Generation) {
    assert_eq!(
        plain.ids, spec.ids,
        "{case} {what}: ids differ from plain decoding"
    );
    assert_eq!(plain.finish, spec.finish, "{case} {what}: finish differs");
    assert_eq!(
        bits(&plain.logits),
        bits(&spec.logits),
        "{case} {what}: logits bits differ from plain decoding"
    );
}

/// Every architecture, every path, a fixed draft length and the adaptive one:
/// plain greedy's ids and logits bits. Kept proposals save passes; none kept costs
/// none.
#[test]
fn every_verification_path_gives_plain_greedy_ids_and_bits() {
    for (case, dir) in case_dirs() {
        let e = Engine::open(&dir, EngineOptions::default()).unwrap();
        let prompt = prompt_of(&dir, 1);
        let vocab = e.config().vocab_size as u32;
        for adaptive_draft in [false, true] {
            let params = GenerateParams {
                max_new_tokens: 14,
                ignore_eos: true,
                record_logits: true,
                max_draft: 4,
                adaptive_draft,
                ..Default::default()
            };
            let plain = generate(&e, &prompt, &params, None, None);
            assert_eq!(plain.decode_passes, plain.ids.len() - 1);
            let mut truth = prompt.clone();
            truth.extend(&plain.ids);
            for script in [Script::All, Script::None, Script::Some] {
                let mut d = Scripted {
                    truth: truth.clone(),
                    script,
                    vocab,
                };
                let spec = generate(&e, &prompt, &params, None, Some(&mut d));
                let what = format!("{script:?} (adaptive {adaptive_draft})");
                check_same(&case, &what, &plain, &spec);
                let r = spec.speculation.clone().expect("a report");
                assert_eq!(r.drafter, d.name());
                assert_eq!(r.passes, spec.decode_passes);
                match script {
                    Script::All => {
                        assert_eq!(r.accepted, r.drafted, "{case} {what}: {r:?}");
                        if !adaptive_draft {
                            // 13 ids after the first, 5 a pass: 3 passes.
                            assert_eq!(spec.decode_passes, 3, "{case} {what}: {r:?}");
                        }
                        assert!(spec.decode_passes < plain.decode_passes, "{case} {what}");
                    }
                    Script::None => {
                        assert_eq!(r.accepted, 0, "{case} {what}: {r:?}");
                        assert_eq!(spec.decode_passes, plain.decode_passes, "{case} {what}");
                    }
                    Script::Some => {
                        if !adaptive_draft {
                            assert!(
                                r.accepted > 0 && r.accepted < r.drafted,
                                "{case} {what}: {r:?}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Sampled decoding: the sampler draws one number per token it picks, and picks
/// from the same logits bits, so a drafted run samples plain decoding's ids.
#[test]
fn sampled_runs_are_plain_sampled_runs() {
    for case in [
        "llama_gqa_untied",
        "qwen3_moe_fused_sparse_step",
        "deepseek_v3_mla_yarn",
    ] {
        let dir = fixtures().join(case);
        let e = Engine::open(&dir, EngineOptions::default()).unwrap();
        let prompt = prompt_of(&dir, 0);
        let vocab = e.config().vocab_size as u32;
        for seed in [1, 7] {
            let params = GenerateParams {
                max_new_tokens: 16,
                ignore_eos: true,
                record_logits: true,
                adaptive_draft: false,
                max_draft: 3,
                sampling: SamplingParams {
                    temperature: 0.9,
                    top_p: 0.95,
                    top_k: 50,
                    seed,
                },
                speculative_sampling: false,
            };
            let plain = generate(&e, &prompt, &params, None, None);
            let mut truth = prompt.clone();
            truth.extend(&plain.ids);
            for script in [Script::All, Script::Some] {
                let mut d = Scripted {
                    truth: truth.clone(),
                    script,
                    vocab,
                };
                let spec = generate(&e, &prompt, &params, None, Some(&mut d));
                check_same(
                    case,
                    &format!("sampled, seed {seed}, {script:?}"),
                    &plain,
                    &spec,
                );
            }
            let mut lookup = PromptLookup::default();
            let spec = generate(&e, &prompt, &params, None, Some(&mut lookup));
            check_same(
                case,
                &format!("sampled, seed {seed}, prompt lookup"),
                &plain,
                &spec,
            );
        }
    }
}

/// A constraint (here: even ids only, complete after `left` of them) sees the ids
/// plain decoding commits, in order, and proposals it would not allow are simply
/// not kept.
struct EvenIds {
    left: usize,
    accepted: Vec<u32>,
}

impl TokenConstraint for EvenIds {
    fn fill_mask(&mut self, _step: usize, mask: &mut TokenMask) -> Result<(), ConstrainError> {
        for id in (0..mask.len() as u32).step_by(2) {
            mask.allow(id);
        }
        Ok(())
    }

    fn may_stop(&mut self, _step: usize) -> Result<bool, ConstrainError> {
        Ok(false)
    }

    fn accept(&mut self, _step: usize, id: u32) -> Result<(), ConstrainError> {
        assert_eq!(id % 2, 0, "only allowed ids are accepted");
        self.accepted.push(id);
        self.left -= 1;
        Ok(())
    }

    fn is_complete(&self) -> bool {
        self.left == 0
    }
}

#[test]
fn constrained_runs_are_plain_constrained_runs() {
    for case in [
        "llama_gqa_untied",
        "mixtral_block_sparse",
        "glm4_moe_partial_rotary_shared",
    ] {
        let dir = fixtures().join(case);
        let e = Engine::open(&dir, EngineOptions::default()).unwrap();
        let prompt = prompt_of(&dir, 2);
        let vocab = e.config().vocab_size as u32;
        let params = GenerateParams {
            max_new_tokens: 30,
            record_logits: true,
            adaptive_draft: false,
            max_draft: 5,
            ..Default::default()
        };
        let mut c = EvenIds {
            left: 11,
            accepted: Vec::new(),
        };
        let plain = generate(&e, &prompt, &params, Some(&mut c), None);
        assert_eq!(plain.finish, FinishReason::Complete);
        let mut truth = prompt.clone();
        truth.extend(&plain.ids);
        for script in [Script::All, Script::Some, Script::None] {
            let mut d = Scripted {
                truth: truth.clone(),
                script,
                vocab,
            };
            let mut c2 = EvenIds {
                left: 11,
                accepted: Vec::new(),
            };
            let spec = generate(&e, &prompt, &params, Some(&mut c2), Some(&mut d));
            check_same(case, &format!("constrained, {script:?}"), &plain, &spec);
            assert_eq!(
                c.accepted, c2.accepted,
                "{case}: the constraint saw other ids"
            );
        }
    }
}

/// At the ends: the tokens wanted and the context's room bound the proposals, and
/// the run stops where plain decoding does, for the same reason.
#[test]
fn runs_stop_where_plain_runs_do() {
    let dir = fixtures().join("qwen2_bias_tied");
    let prompt = prompt_of(&dir, 0);
    for (max_context, max_new) in [
        (prompt.len() + 6, 40),
        (prompt.len() + 40, 7),
        (prompt.len() + 2, 9),
    ] {
        let e = Engine::open(
            &dir,
            EngineOptions {
                max_context: Some(max_context),
                ..Default::default()
            },
        )
        .unwrap();
        let params = GenerateParams {
            max_new_tokens: max_new,
            ignore_eos: true,
            record_logits: true,
            adaptive_draft: false,
            max_draft: 8,
            ..Default::default()
        };
        let plain = generate(&e, &prompt, &params, None, None);
        let mut truth = prompt.clone();
        truth.extend(&plain.ids);
        truth.extend(std::iter::repeat_n(3, 20));
        let mut d = Scripted {
            truth,
            script: Script::All,
            vocab: e.config().vocab_size as u32,
        };
        let spec = generate(&e, &prompt, &params, None, Some(&mut d));
        check_same(
            "qwen2_bias_tied",
            &format!("context {max_context}, {max_new} wanted"),
            &plain,
            &spec,
        );
    }
}

/// A model drafting for itself proposes what the target picks: every proposal kept.
/// Another checkpoint with the same vocabulary proposes other tokens: the target's
/// ids all the same. Another tokenizer is an error naming both models.
#[test]
fn draft_models_keep_the_target_exact() {
    let target_dir = fixtures().join("llama_gqa_untied");
    let target = Engine::open(&target_dir, EngineOptions::default()).unwrap();
    let prompt = prompt_of(&target_dir, 2);
    let params = GenerateParams {
        max_new_tokens: 12,
        ignore_eos: true,
        record_logits: true,
        adaptive_draft: false,
        max_draft: 4,
        ..Default::default()
    };
    let plain = generate(&target, &prompt, &params, None, None);
    let itself = std::sync::Arc::new(Engine::open(&target_dir, EngineOptions::default()).unwrap());
    let mut d = DraftModel::new(itself, &target).unwrap();
    assert_eq!(d.name(), "draft-model:llama_gqa_untied");
    let spec = generate(&target, &prompt, &params, None, Some(&mut d));
    check_same("llama_gqa_untied", "drafting for itself", &plain, &spec);
    let r = spec.speculation.unwrap();
    assert_eq!(r.accepted, r.drafted, "{r:?}");
    assert_eq!(spec.decode_passes, 3);

    let other = Engine::open(
        &fixtures().join("qwen2_bias_tied"),
        EngineOptions::default(),
    )
    .unwrap();
    let mut d = DraftModel::new(std::sync::Arc::new(other), &target).unwrap();
    let spec = generate(&target, &prompt, &params, None, Some(&mut d));
    check_same(
        "llama_gqa_untied",
        "drafted by qwen2_bias_tied",
        &plain,
        &spec,
    );
    // A fresh drafter over the same engine (a server's next request) likewise.
    let mut again = d.fresh();
    let spec = generate(&target, &prompt, &params, None, Some(&mut again));
    check_same("llama_gqa_untied", "a fresh drafter", &plain, &spec);

    let small_vocab =
        Engine::open(&fixtures().join("llama_sharded"), EngineOptions::default()).unwrap();
    let e = DraftModel::new(std::sync::Arc::new(small_vocab), &target)
        .err()
        .expect("another vocabulary");
    let msg = e.to_string();
    assert!(
        msg.contains("llama_sharded")
            && msg.contains("llama_gqa_untied")
            && msg.contains("tokenizer"),
        "{msg}"
    );
}

/// A real model asked to repeat a passage: prompt lookup proposes the passage, the
/// model's own picks keep most of it, and the output is plain decoding's. A
/// tokenizer-less checkpoint cannot draft for it.
#[test]
fn prompt_lookup_on_a_real_model_saves_passes_exactly() {
    let Some(dir) = smollm2_dir() else { return };
    let e = Engine::open(
        &dir,
        EngineOptions {
            threads: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let tok = e.tokenizer().unwrap();
    let passage = "fn area(w: u32, h: u32) -> u32 {\n    let a = w * h;\n    a\n}\n";
    let text = tok
        .chat_template()
        .unwrap()
        .render(
            &[serde_json::json!({"role": "user", "content":
                format!("Copy this code exactly, nothing else:\n{passage}")})],
            None,
            true,
            None,
        )
        .unwrap();
    let prompt = tok.encode(&text, false).unwrap();
    let params = GenerateParams {
        max_new_tokens: 40,
        record_logits: true,
        ..Default::default()
    };
    let plain = generate(&e, &prompt, &params, None, None);
    let mut lookup = PromptLookup::default();
    let spec = generate(&e, &prompt, &params, None, Some(&mut lookup));
    check_same("smollm2", "prompt lookup", &plain, &spec);
    let r = spec.speculation.unwrap();
    eprintln!(
        "prompt lookup: {} ids in {} passes (plain {}): {r:?}",
        spec.ids.len(),
        spec.decode_passes,
        plain.decode_passes
    );
    assert!(r.accepted > 0, "{r:?}: {:?}", tok.decode(&plain.ids, false));
    assert!(spec.decode_passes < plain.decode_passes, "{r:?}");

    let tiny = Engine::open(
        &fixtures().join("llama_gqa_untied"),
        EngineOptions::default(),
    )
    .unwrap();
    let err = DraftModel::new(std::sync::Arc::new(tiny), &e)
        .err()
        .expect("no tokenizer")
        .to_string();
    assert!(err.contains("tokenizer"), "{err}");
}

/// Speculative sampling, asked for, with a draft model that samples: a model
/// drafting for itself draws from the target's own distribution, so every proposal
/// is kept (min(1, p/q) = 1), where the exact scheme keeps a greedy proposal only
/// when the plain draw is it. Greedy runs stay plain greedy; fixed-id drafters
/// (prompt lookup) stay exact. (That its ids follow the target's distribution for
/// any draft is the sampler's test,
/// `verified_proposals_come_out_with_the_targets_probabilities`.)
#[test]
fn speculative_sampling_keeps_a_sampling_drafts_proposals() {
    let dir = fixtures().join("qwen3_qk_norm_eos_list");
    let e = Engine::open(&dir, EngineOptions::default()).unwrap();
    let draft = std::sync::Arc::new(Engine::open(&dir, EngineOptions::default()).unwrap());
    let prompt = prompt_of(&dir, 1);
    let vocab = e.config().vocab_size as u32;
    let sampled = GenerateParams {
        max_new_tokens: 30,
        ignore_eos: true,
        adaptive_draft: false,
        max_draft: 4,
        sampling: SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 20,
            seed: 9,
        },
        ..Default::default()
    };
    let run = |speculative_sampling: bool, drafter: &mut dyn Drafter| {
        let params = GenerateParams {
            speculative_sampling,
            ..sampled.clone()
        };
        let g = generate(&e, &prompt, &params, None, Some(drafter));
        assert_eq!(g.ids.len(), 30);
        assert!(g.ids.iter().all(|&t| t < vocab));
        g
    };
    let plain = generate(&e, &prompt, &sampled, None, None);
    let mut d = DraftModel::new(std::sync::Arc::clone(&draft), &e).unwrap();
    let exact = run(false, &mut d.fresh());
    assert_eq!(
        exact.ids, plain.ids,
        "without speculative sampling: plain draws"
    );
    let exact = exact.speculation.unwrap();
    assert_eq!(exact.scheme, "exact");
    assert!(exact.accepted < exact.drafted, "{exact:?}");
    let ss = run(true, &mut d).speculation.unwrap();
    assert_eq!(ss.scheme, "speculative-sampling");
    assert_eq!(ss.accepted, ss.drafted, "{ss:?}");
    assert!(ss.passes < exact.passes, "{ss:?} against {exact:?}");
    // Prompt lookup proposes fixed ids: checked the exact way.
    let mut lookup = PromptLookup::default();
    let r = run(true, &mut lookup);
    assert_eq!(r.ids, plain.ids);
    assert_eq!(r.speculation.unwrap().scheme, "exact");
    // Greedy: plain greedy, whatever is asked.
    let greedy = GenerateParams {
        sampling: SamplingParams::default(),
        speculative_sampling: true,
        record_logits: true,
        ..sampled.clone()
    };
    let plain = generate(&e, &prompt, &greedy, None, None);
    let mut d2 = d.fresh();
    let g = generate(&e, &prompt, &greedy, None, Some(&mut d2));
    check_same(
        "qwen3_qk_norm_eos_list",
        "greedy, speculative sampling",
        &plain,
        &g,
    );
}
