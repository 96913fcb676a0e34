//! A smaller model as the drafter of speculative decoding ([`crate::speculate`]): it
//! decodes greedily ahead of the target, on its own engine and KV cache, and the
//! target keeps what agrees with its own picks. Its proposals change how many passes
//! the target takes, never what it generates.

use std::sync::Arc;

use crate::engine::Engine;
use crate::kv::KvCache;
use crate::sampler::{Sampler, SamplingParams};
use crate::speculate::{pick, DraftSampler, Drafter, SampledProposal};
use crate::VoomError;

/// A draft model: an engine over a smaller checkpoint with the target's tokenizer.
pub struct DraftModel {
    engine: Arc<Engine>,
    kv: KvCache,
    /// The ids whose positions `kv` holds.
    seen: Vec<u32>,
    /// The target's vocabulary: proposals stop before an id past it.
    target_vocab: usize,
    /// Its own sampler for speculative sampling (seeded from the request's seed),
    /// made at the first sampled proposal.
    sampler: DraftSampler,
}

impl DraftModel {
    /// `draft` as the drafter of `target`: an error naming both unless they share
    /// a tokenizer (the same vocabulary, added tokens included), or, for checkpoints
    /// without one, the same vocabulary size.
    pub fn new(draft: Arc<Engine>, target: &Engine) -> Result<Self, VoomError> {
        let same = match (draft.tokenizer(), target.tokenizer()) {
            (Some(d), Some(t)) => d.inner().get_vocab(true) == t.inner().get_vocab(true),
            (None, None) => draft.config().vocab_size == target.config().vocab_size,
            _ => false,
        };
        if !same {
            let describe = |e: &Engine| match e.tokenizer() {
                Some(t) => format!("a tokenizer of {} tokens", t.vocab_size()),
                None => format!("no tokenizer, {} ids", e.config().vocab_size),
            };
            return Err(VoomError::Request(format!(
                "the draft model {} ({}) does not share the tokenizer of {} ({}): its \
                 proposals would be other tokens",
                draft.name(),
                describe(draft.as_ref()),
                target.name(),
                describe(target)
            )));
        }
        let kv = draft.new_kv();
        Ok(DraftModel {
            engine: draft,
            kv,
            seen: Vec::new(),
            target_vocab: target.config().vocab_size,
            sampler: DraftSampler::new(0x5eed_d4af_7000_0001),
        })
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Another drafter over the same draft engine with a cache of its own (one per
    /// request; the tokenizers were checked once).
    pub fn fresh(&self) -> DraftModel {
        DraftModel {
            engine: Arc::clone(&self.engine),
            kv: self.engine.new_kv(),
            seen: Vec::new(),
            target_vocab: self.target_vocab,
            sampler: DraftSampler::new(0x5eed_d4af_7000_0001),
        }
    }
}

impl Drafter for DraftModel {
    fn name(&self) -> String {
        format!("draft-model:{}", self.engine.name())
    }

    /// Computes what of `context` its cache lacks (keeping the longest prefix it
    /// shares with the last call's: the ids the target kept), then decodes `k`
    /// tokens greedily. Fewer where its context is full.
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, VoomError> {
        Ok(self
            .decode(context, k, None)?
            .into_iter()
            .map(|(t, _)| t)
            .collect())
    }

    /// As `propose`, each id drawn from its distribution under `sampling` (the
    /// target's parameters; its own generator, seeded from the request's seed).
    fn propose_sampled(
        &mut self,
        context: &[u32],
        k: usize,
        sampling: &SamplingParams,
    ) -> Result<Option<Vec<SampledProposal>>, VoomError> {
        let mut sampler = std::mem::replace(&mut self.sampler, DraftSampler::new(0));
        let out = sampler.run(sampling, |s| self.decode(context, k, Some(s)));
        self.sampler = sampler;
        out
    }
}

impl DraftModel {
    /// Up to `k` ids after `context`: greedy, or drawn by `sampler` (each with its
    /// distribution; empty for greedy picks).
    fn decode(
        &mut self,
        context: &[u32],
        k: usize,
        mut sampler: Option<&mut Sampler>,
    ) -> Result<Vec<SampledProposal>, VoomError> {
        if context.is_empty() || k == 0 {
            return Ok(Vec::new());
        }
        let room = self.kv.capacity().saturating_sub(context.len());
        let k = k.min(room);
        if k == 0 {
            return Ok(Vec::new());
        }
        // The last context id is computed now, so that its logits are at hand.
        let common = self
            .seen
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count()
            .min(context.len() - 1);
        self.kv.truncate(common);
        self.seen.truncate(common);
        let mut logits = self.engine.prefill(&mut self.kv, &context[common..])?;
        self.seen.extend_from_slice(&context[common..]);
        let mut out = Vec::with_capacity(k);
        loop {
            let (t, q) = pick(sampler.as_deref_mut(), &logits);
            if t as usize >= self.target_vocab {
                break;
            }
            out.push((t, q));
            if out.len() == k {
                break;
            }
            logits = self.engine.prefill(&mut self.kv, &[t])?;
            self.seen.push(t);
        }
        Ok(out)
    }
}
