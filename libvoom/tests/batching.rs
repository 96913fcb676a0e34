//! Continuous batching (`Engine::sequence`, `Engine::step`): sequences that join at
//! different steps, prefill in chunks beside others' decode steps, sample, follow a
//! constraint, draft, or stop early, each get the ids, logits bits and stop reason
//! they get alone.

mod common;

use std::ops::ControlFlow;
use std::path::Path;

use libvoom::constrain::{ConstrainError, TokenConstraint, TokenMask};
use libvoom::engine::{Decoding, Engine, EngineOptions, FinishReason, GenerateParams, Generation};
use libvoom::sampler::SamplingParams;
use libvoom::speculate::lookup::PromptLookup;

use common::{bits, fixtures, prompt_of};

/// Only ids that are multiples of `m`, complete after `left` of them.
struct Multiples {
    m: u32,
    left: usize,
}

impl TokenConstraint for Multiples {
    fn fill_mask(&mut self, _step: usize, mask: &mut TokenMask) -> Result<(), ConstrainError> {
        for id in (0..mask.len() as u32).step_by(self.m as usize) {
            mask.allow(id);
        }
        Ok(())
    }

    fn may_stop(&mut self, _step: usize) -> Result<bool, ConstrainError> {
        Ok(false)
    }

    fn accept(&mut self, _step: usize, _id: u32) -> Result<(), ConstrainError> {
        self.left -= 1;
        Ok(())
    }

    fn is_complete(&self) -> bool {
        self.left == 0
    }
}

/// One request of the mix.
struct Req {
    prompt: Vec<u32>,
    params: GenerateParams,
    constrained: bool,
    lookup: bool,
    /// Joins the batch at this step.
    joins: usize,
    /// Its client leaves after this many ids (`on_token` breaks).
    leaves_after: Option<usize>,
}

fn requests(dir: &Path) -> Vec<Req> {
    let base = GenerateParams {
        ignore_eos: true,
        record_logits: true,
        ..Default::default()
    };
    let mut long = prompt_of(dir, 2);
    long.extend(prompt_of(dir, 1));
    vec![
        Req {
            prompt: prompt_of(dir, 0),
            params: GenerateParams {
                max_new_tokens: 9,
                ..base.clone()
            },
            constrained: false,
            lookup: false,
            joins: 0,
            leaves_after: None,
        },
        Req {
            prompt: long,
            params: GenerateParams {
                max_new_tokens: 14,
                sampling: SamplingParams {
                    temperature: 0.8,
                    top_p: 0.9,
                    top_k: 40,
                    seed: 5,
                },
                ..base.clone()
            },
            constrained: false,
            lookup: true,
            joins: 0,
            leaves_after: None,
        },
        Req {
            prompt: prompt_of(dir, 1),
            params: GenerateParams {
                max_new_tokens: 20,
                ..base.clone()
            },
            constrained: true,
            lookup: false,
            joins: 3,
            leaves_after: None,
        },
        Req {
            prompt: prompt_of(dir, 2),
            params: GenerateParams {
                max_new_tokens: 12,
                adaptive_draft: false,
                max_draft: 3,
                ..base.clone()
            },
            constrained: false,
            lookup: true,
            joins: 5,
            leaves_after: Some(4),
        },
    ]
}

fn solo(e: &Engine, r: &Req) -> Generation {
    let mut c = Multiples { m: 3, left: 7 };
    let mut lookup = PromptLookup::default();
    let mut n = 0;
    e.generate_with(
        &r.prompt,
        &r.params,
        Decoding {
            constraint: r.constrained.then_some(&mut c as &mut dyn TokenConstraint),
            drafter: r
                .lookup
                .then_some(&mut lookup as &mut dyn libvoom::speculate::Drafter),
        },
        &mut |_| {
            n += 1;
            if r.leaves_after.is_some_and(|k| n >= k) {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        },
    )
    .unwrap()
}

#[test]
fn batched_requests_get_their_solo_ids_and_bits() {
    for case in [
        "llama_gqa_untied",
        "mistral_sliding_window",
        "qwen3_moe_fused_sparse_step",
        "deepseek_v3_mla_yarn",
    ] {
        let dir = fixtures().join(case);
        let e = Engine::open(
            &dir,
            EngineOptions {
                prefill_chunk: 4,
                ..Default::default()
            },
        )
        .unwrap();
        let reqs = requests(&dir);
        let alone: Vec<Generation> = reqs.iter().map(|r| solo(&e, r)).collect();

        let mut cs: Vec<Multiples> = reqs.iter().map(|_| Multiples { m: 3, left: 7 }).collect();
        let mut ls: Vec<PromptLookup> = reqs.iter().map(|_| PromptLookup::default()).collect();
        let mut seqs: Vec<Option<libvoom::engine::Sequence<'_>>> =
            reqs.iter().map(|_| None).collect();
        let mut streamed: Vec<Vec<u32>> = vec![Vec::new(); reqs.len()];
        let mut waiting: Vec<(usize, &mut Multiples, &mut PromptLookup)> = cs
            .iter_mut()
            .zip(ls.iter_mut())
            .enumerate()
            .map(|(i, (c, l))| (i, c, l))
            .collect();
        let mut step = 0;
        let mut largest_batch = 0;
        loop {
            // Requests join between steps.
            let mut still = Vec::new();
            for (i, c, l) in waiting.drain(..) {
                let r = &reqs[i];
                if r.joins <= step {
                    seqs[i] = Some(
                        e.sequence(
                            &r.prompt,
                            &r.params,
                            Decoding {
                                constraint: r.constrained.then_some(c as &mut dyn TokenConstraint),
                                drafter: r
                                    .lookup
                                    .then_some(l as &mut dyn libvoom::speculate::Drafter),
                            },
                        )
                        .unwrap(),
                    );
                } else {
                    still.push((i, c, l));
                }
            }
            waiting = still;
            let mut active: Vec<(usize, &mut libvoom::engine::Sequence<'_>)> = seqs
                .iter_mut()
                .enumerate()
                .filter_map(|(i, s)| s.as_mut().filter(|s| !s.finished()).map(|s| (i, s)))
                .collect();
            if active.is_empty() && waiting.is_empty() {
                break;
            }
            largest_batch = largest_batch.max(active.len());
            let index: Vec<usize> = active.iter().map(|(i, _)| *i).collect();
            let mut batch: Vec<&mut libvoom::engine::Sequence<'_>> =
                active.iter_mut().map(|(_, s)| &mut **s).collect();
            e.step(&mut batch, 5, &mut |j, id| {
                let i = index[j];
                streamed[i].push(id);
                if reqs[i].leaves_after.is_some_and(|k| streamed[i].len() >= k) {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })
            .unwrap();
            step += 1;
            assert!(step < 500, "{case}: the batch does not end");
        }
        assert!(
            largest_batch >= 3,
            "{case}: at most {largest_batch} ran together"
        );
        for (i, (s, a)) in seqs.into_iter().zip(&alone).enumerate() {
            let mut s = s.unwrap();
            assert!(s.take_error().is_none());
            let g = s.into_generation();
            assert_eq!(g.ids, a.ids, "{case}: request {i}'s ids differ batched");
            assert_eq!(streamed[i], g.ids, "{case}: request {i} streamed other ids");
            assert_eq!(
                g.finish, a.finish,
                "{case}: request {i} stops otherwise batched"
            );
            assert_eq!(
                bits(&g.logits),
                bits(&a.logits),
                "{case}: request {i}'s logits bits differ batched"
            );
        }
        assert_eq!(alone[3].finish, FinishReason::Stopped);
        assert_eq!(alone[2].finish, FinishReason::Complete);
    }
}
