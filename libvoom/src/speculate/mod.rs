//! Several tokens per sweep of the weights, exactly: speculative decoding.
//!
//! A [`Drafter`] proposes the tokens it expects to follow; the engine computes the
//! last committed token and the proposals in one forward pass (one sweep of the
//! weights), then picks each next token from that pass's logits as plain decoding
//! would (the same sampler, the same constraint, in the same order) and keeps
//! proposals as long as they equal what it picked. Batch invariance makes every
//! position's logits bits the ones a one-token pass gives, and the sampler draws one
//! random number per token it picks, so the committed ids and logits are those of
//! plain decoding, greedy or sampled. Rejected positions are cut from the KV cache.
//!
//! [`Adaptive`] chooses how many tokens to draft from what it measures: the
//! acceptance, the seconds a pass of n positions takes, and the seconds drafting
//! takes; it stops drafting for the request when no draft length beats plain
//! decoding. Drafters: [`lookup::PromptLookup`] (n-gram matches against the prompt
//! and the output so far), a smaller model ([`crate::draft::DraftModel`]) and the
//! checkpoint's own multi-token-prediction layer ([`crate::mtp::MtpDrafter`]).

pub mod adapt;
pub mod lookup;

pub use adapt::Adaptive;

use crate::sampler::{argmax, Sampler, SamplingParams};
use crate::VoomError;

/// A proposal drawn from a drafter's own distribution, with that distribution (the
/// candidates and their probabilities), for speculative sampling.
pub type SampledProposal = (u32, Vec<(u32, f64)>);

/// Proposes the tokens expected to follow a context.
pub trait Drafter: Send {
    /// What the reports call it ("prompt-lookup", "draft-model:NAME").
    fn name(&self) -> String;

    /// Up to `k` tokens expected to follow `context` (the prompt and the tokens
    /// committed so far, the last of which the target has not computed yet). Fewer,
    /// or none, where it has no good guess. Called with a context that extends the
    /// previous call's committed part: what it proposed and was not kept is not in it.
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, VoomError>;

    /// For speculative sampling (asked for by the request): up to `k` ids drawn one
    /// after another from the drafter's own distribution under `sampling`, each with
    /// the distribution it was drawn from. `None` (the default): this drafter
    /// proposes fixed ids only, which [`Drafter::propose`] gives and the engine
    /// checks the exact way (for them that keeps as many as speculative sampling
    /// would).
    fn propose_sampled(
        &mut self,
        context: &[u32],
        k: usize,
        sampling: &SamplingParams,
    ) -> Result<Option<Vec<SampledProposal>>, VoomError> {
        let _ = (context, k, sampling);
        Ok(None)
    }

    /// Whether it reads the model's hidden states (multi-token prediction): then
    /// the sequence's passes compute them ([`crate::model::SeqPass::hidden_out`])
    /// and [`Drafter::observe_hidden`] hears them.
    fn wants_hidden(&self) -> bool {
        false
    }

    /// The model's hidden states of positions `first..` (`hidden_size` floats
    /// each), committed since the last call: every computed position's once, in
    /// order, before the [`Drafter::propose`] that follows it. The default ignores
    /// them.
    fn observe_hidden(&mut self, first: usize, hidden: &[f32]) {
        let _ = (first, hidden);
    }
}

/// A drafter's own sampler for speculative sampling, made at its first sampled
/// proposal from the request's parameters with the seed mixed with `salt` (its
/// draws are not the target's).
pub struct DraftSampler {
    salt: u64,
    sampler: Option<Sampler>,
}

impl DraftSampler {
    pub fn new(salt: u64) -> Self {
        DraftSampler {
            salt,
            sampler: None,
        }
    }

    /// `draft` run with the sampler for `sampling`; `None` for greedy parameters
    /// (the drafter proposes fixed ids, checked the exact way).
    pub fn run<R>(
        &mut self,
        sampling: &SamplingParams,
        draft: impl FnOnce(&mut Sampler) -> Result<R, VoomError>,
    ) -> Result<Option<R>, VoomError> {
        if sampling.is_greedy() {
            return Ok(None);
        }
        let salt = self.salt;
        let sampler = self.sampler.get_or_insert_with(|| {
            Sampler::new(SamplingParams {
                seed: sampling.seed ^ salt,
                ..sampling.clone()
            })
        });
        draft(sampler).map(Some)
    }
}

/// A drafter's next proposal from `logits`: drawn by `sampler` with the
/// distribution it was drawn from, or the greedy pick (an empty distribution).
pub fn pick(sampler: Option<&mut Sampler>, logits: &[f32]) -> SampledProposal {
    match sampler {
        Some(s) => {
            let q = s.distribution(logits);
            (s.draw(&q), q)
        }
        None => (argmax(logits), Vec::new()),
    }
}

/// A drafter borrowed is a drafter.
impl<T: Drafter + ?Sized> Drafter for &mut T {
    fn name(&self) -> String {
        (**self).name()
    }

    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, VoomError> {
        (**self).propose(context, k)
    }

    fn propose_sampled(
        &mut self,
        context: &[u32],
        k: usize,
        sampling: &SamplingParams,
    ) -> Result<Option<Vec<SampledProposal>>, VoomError> {
        (**self).propose_sampled(context, k, sampling)
    }

    fn wants_hidden(&self) -> bool {
        (**self).wants_hidden()
    }

    fn observe_hidden(&mut self, first: usize, hidden: &[f32]) {
        (**self).observe_hidden(first, hidden)
    }
}

/// What speculation did for one generation: which drafter ran, what it proposed and
/// what was kept.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct SpecReport {
    pub drafter: String,
    /// How proposals were checked: `exact` (each id drawn as plain decoding draws
    /// it: plain decoding's ids) or `speculative-sampling` (asked for, with a
    /// drafter that samples: the target's distribution, other draws).
    pub scheme: String,
    /// Tokens proposed and verified, and of them the ones kept.
    pub drafted: usize,
    pub accepted: usize,
    /// Decode passes of the target (one sweep of the weights each), and of them the
    /// ones that verified at least one proposal.
    pub passes: usize,
    pub verify_passes: usize,
    /// Why drafting stopped before the end, if it did.
    pub stopped: Option<String>,
}

impl SpecReport {
    /// Proposals kept over proposals verified (0 with none).
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}
