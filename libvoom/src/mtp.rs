//! The checkpoint's own multi-token-prediction layer as the drafter of speculative
//! decoding ([`crate::speculate`]): DeepSeek-V3 and GLM-4.5 ship one
//! (`num_nextn_predict_layers`), trained to predict the token two ahead from a
//! position's hidden state and the token after it.
//!
//! The layer ([`crate::model::Model::mtp`]) keeps a KV cache of its own. Position
//! `i` of it reads the model's hidden state at `i` (after the final norm) and the
//! token at `i + 1`, and gives the logits of the token at `i + 2`. Before each
//! proposal it computes the positions the model has committed since the last one
//! (their hidden states come with the model's passes: [`Drafter::observe_hidden`]);
//! the last of them proposes the first token. Each further token comes from the
//! layer applied again to the token it just proposed and its own output state
//! there, as vLLM chains it; those positions are recomputed from the model's hidden
//! states once the model has computed them. Like any drafter, it changes how many
//! passes the model takes, never what it generates.

use crate::engine::Engine;
use crate::kv::KvCache;
use crate::model::{Logits, SeqPass};
use crate::sampler::{Sampler, SamplingParams};
use crate::speculate::{pick, DraftSampler, Drafter, SampledProposal};
use crate::VoomError;

/// Drafts with the multi-token-prediction layer of `engine`'s model, for one
/// sequence of that engine.
pub struct MtpDrafter<'e> {
    engine: &'e Engine,
    kv: KvCache,
    /// Positions of `kv` computed from the model's hidden states; those after were
    /// computed from proposals.
    computed: usize,
    /// The model's hidden states of positions `computed..`, not yet computed here.
    pending: Vec<f32>,
    /// A position's hidden state never arrived: it proposes nothing more.
    lost: bool,
    /// Its own sampler for speculative sampling (seeded from the request's seed),
    /// made at the first sampled proposal.
    sampler: DraftSampler,
}

impl<'e> MtpDrafter<'e> {
    /// A drafter for a sequence of `engine`: an error naming the model unless its
    /// checkpoint holds a multi-token-prediction layer that loaded.
    pub fn new(engine: &'e Engine) -> Result<Self, VoomError> {
        Ok(MtpDrafter {
            kv: engine.new_mtp_kv()?,
            engine,
            computed: 0,
            pending: Vec::new(),
            lost: false,
            sampler: DraftSampler::new(0x5eed_d4af_7000_0002),
        })
    }

    /// Up to `k` ids after `context`: greedy, or drawn by `sampler` (each with its
    /// distribution; empty for greedy picks).
    fn decode(
        &mut self,
        context: &[u32],
        k: usize,
        mut sampler: Option<&mut Sampler>,
    ) -> Result<Vec<SampledProposal>, VoomError> {
        let h = self.engine.config().hidden_size;
        let n = context.len();
        // The model has computed every position but the last id's, and this layer
        // has their hidden states (or computed them already).
        let known = self.computed + self.pending.len() / h;
        if self.lost || k == 0 || n < 2 || known != n - 1 || self.pending.is_empty() {
            return Ok(Vec::new());
        }
        // Position i + 1 for each proposal after the first.
        let k = k.min((self.kv.capacity() + 2).saturating_sub(n));
        if k == 0 {
            return Ok(Vec::new());
        }
        // Positions computed from proposals last time are recomputed from the
        // model's states.
        self.kv.truncate(self.computed);
        let mut state = Vec::new();
        let mut logits = {
            let pass = SeqPass {
                hidden_in: Some(&self.pending),
                hidden_out: Some(&mut state),
                ..SeqPass::new(&context[self.computed + 1..], &mut self.kv, Logits::Last)
            };
            self.engine.mtp_forward(&mut [pass])?.remove(0)
        };
        self.computed = n - 1;
        self.pending.clear();
        let vocab = self.engine.config().vocab_size;
        let mut out = Vec::with_capacity(k);
        loop {
            let (t, q) = pick(sampler.as_deref_mut(), &logits);
            if t as usize >= vocab {
                break;
            }
            out.push((t, q));
            if out.len() == k {
                break;
            }
            // The layer again, on the proposal and its own state at the position
            // before.
            let last = state[state.len() - h..].to_vec();
            state.clear();
            let tokens = [t];
            let pass = SeqPass {
                hidden_in: Some(&last),
                hidden_out: Some(&mut state),
                ..SeqPass::new(&tokens, &mut self.kv, Logits::Last)
            };
            logits = self.engine.mtp_forward(&mut [pass])?.remove(0);
        }
        Ok(out)
    }
}

impl Drafter for MtpDrafter<'_> {
    fn name(&self) -> String {
        format!("mtp:{}", self.engine.name())
    }

    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, VoomError> {
        Ok(self
            .decode(context, k, None)?
            .into_iter()
            .map(|(t, _)| t)
            .collect())
    }

    /// As `propose`, each id drawn from the layer's distribution under `sampling`
    /// (the model's parameters; its own generator, seeded from the request's seed).
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

    fn wants_hidden(&self) -> bool {
        true
    }

    fn observe_hidden(&mut self, first: usize, hidden: &[f32]) {
        let h = self.engine.config().hidden_size;
        let next = self.computed + self.pending.len() / h;
        if first > next {
            // A gap: the positions between have no state here.
            self.lost = true;
        } else if first < self.computed {
            // Positions computed here again (not how a sequence calls it): from
            // `first` on, the new states.
            self.kv.truncate(first);
            self.computed = first;
            self.pending.clear();
        } else {
            self.pending.truncate((first - self.computed) * h);
        }
        self.pending.extend_from_slice(hidden);
    }
}
