//! Architectures, written once against the backend interface ([`crate::backend::ops`])
//! and the sweep. An architecture is one file: its weights and page plan
//! ([`plan::PagePlan`]) from the checkpoint, and its math over the ops; the engine
//! holds it as a [`Model`] and never changes for a new one.
//!
//! - [`llama`]: llama, mistral, qwen2 and qwen3, and the mixtures of experts
//!   qwen3_moe, olmoe, mixtral, glm4_moe and deepseek_v3; [`moe`] their experts,
//!   [`mla`] deepseek_v3's multi-head latent attention, [`linear`] a projection.
//! - [`sweep`]: leasing, prefetching and releasing pages along a plan.

mod deltanet;
mod linear;
pub mod llama;
mod mla;
mod moe;
pub mod plan;
pub mod rope;
pub mod sweep;
pub mod values;
pub mod weights;

use vpaged::PageSource;

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, BackendKind};
use crate::config::{Arch, ModelConfig};
use crate::kv::KvCache;
use crate::VoomError;
pub use plan::PagePlan;
pub use sweep::{Sweep, Walk};

/// Which positions' logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position's (prefill, decode).
    Last,
    /// Every position's (verification of several proposed tokens).
    All,
}

/// An architecture with its weights resolved, as the engine holds it.
pub trait Model: Send + Sync {
    /// The config it was loaded from (checked against the checkpoint).
    fn config(&self) -> &ModelConfig;

    /// The pages each stage of a forward pass reads.
    fn plan(&self) -> &PagePlan;

    /// The pages whose stored values are checked when a pass first leases them.
    fn value_checks(&self) -> &values::ValueChecks;

    /// The backend it computes on ("cpu-avx2").
    fn backend_name(&self) -> String;

    /// Compute threads of its backend.
    fn threads(&self) -> usize;

    /// Whether its backend is batch invariant ([`Backend::batch_invariant`]).
    fn batch_invariant(&self) -> bool;

    /// Bytes its backend copied instead of computing in place
    /// ([`Backend::copied_bytes`]).
    fn backend_copied_bytes(&self) -> u64;

    /// Graph evaluations of its backend ([`Backend::evaluations`]).
    fn backend_evaluations(&self) -> u64;

    /// Multiply-adds its backend computed ([`Backend::multiply_adds`]).
    fn backend_multiply_adds(&self) -> u64;

    /// Bytes of KV cache one position takes (every layer's keys and values).
    fn kv_bytes_per_position(&self) -> u64 {
        let cfg = self.config();
        (cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * std::mem::size_of::<f32>()) as u64
    }

    /// Bytes of one sequence's recurrent states, every copy its cache keeps (a
    /// hybrid's linear-attention layers: a fixed size, whatever the context; 0
    /// for others).
    fn state_bytes(&self) -> u64 {
        0
    }

    /// Bytes of activations and buffers a forward pass of `tokens` positions, computed
    /// `chunk` at a time, over a context of `context` positions allocates at most
    /// (last-position logits).
    fn scratch_bytes(&self, tokens: usize, chunk: usize, context: usize) -> u64;

    /// An empty KV cache for one sequence, holding at most `capacity` positions, in
    /// pages of `page` positions.
    fn new_kv(&self, capacity: usize, page: usize) -> KvCache {
        let cfg = self.config();
        KvCache::with_page(
            cfg.num_layers,
            cfg.num_kv_heads * cfg.head_dim,
            capacity.min(cfg.max_position_embeddings),
            page,
        )
        .with_windows(cfg.sliding_window.clone())
    }

    /// Computes each sequence's `tokens` at positions `kv.len()..` (its own KV
    /// cache) and returns the logits its `want` asks for (`vocab_size` floats per
    /// position), reading weights through `sweep` once: each layer computes every
    /// sequence's positions, `chunk` at a time at most (bounding the activations),
    /// before the next layer is leased. So a long prompt costs one sweep of the
    /// weights, not one per chunk, and several sequences cost one sweep, not one
    /// each (a mixture of experts reads each expert any position picked, once).
    /// Returns each sequence's logits, in order. A position's logits bits do not
    /// depend on the other sequences, on the chunking, nor on how many positions a
    /// pass computes (batch invariance: verifying drafted tokens and batching
    /// requests are exact because of it).
    ///
    /// The caller has checked, per sequence, that `tokens` is not empty, that each id
    /// is in the vocabulary and that the positions fit `kv`'s capacity; the caches
    /// are distinct. Each layer appends the new positions' keys and values to `kv`
    /// without committing them: the caller commits after a pass that succeeded and
    /// truncates after one that failed.
    fn forward_batch(
        &self,
        sweep: &Sweep<'_>,
        seqs: &mut [SeqPass<'_>],
        chunk: usize,
    ) -> Result<Vec<Vec<f32>>, VoomError>;

    /// Its first multi-token-prediction layer (DeepSeek-V3, GLM-4.5:
    /// `num_nextn_predict_layers`) as a model of its own, with its own plan and a KV
    /// cache of one layer ([`Model::new_kv`]): each position reads a token and the
    /// hidden state before it ([`SeqPass::hidden_in`], `hidden_size` floats a
    /// position: the decoder's [`SeqPass::hidden_out`], or its own) and gives the
    /// logits of the token two ahead. `Err`: why there is none.
    fn mtp(&self) -> Result<&dyn Model, &str> {
        Err("the architecture has no multi-token-prediction layers")
    }
}

/// One sequence's part of a forward pass ([`Model::forward_batch`]).
pub struct SeqPass<'a> {
    /// Its new tokens, at positions `kv.len()..`.
    pub tokens: &'a [u32],
    pub kv: &'a mut KvCache,
    pub want: Logits,
    /// For a multi-token-prediction model ([`Model::mtp`]), and only for one: the
    /// hidden state each position reads, `hidden_size` floats per token.
    pub hidden_in: Option<&'a [f32]>,
    /// Where to append every new position's hidden state, `hidden_size` floats
    /// each: a decoder's after its final norm (what its multi-token-prediction layer
    /// reads), a multi-token-prediction model's before its head's norm (what its next
    /// step reads).
    pub hidden_out: Option<&'a mut Vec<f32>>,
}

impl<'a> SeqPass<'a> {
    /// `tokens` after what `kv` holds, with the logits `want` asks for, and no hidden
    /// states in or out.
    pub fn new(tokens: &'a [u32], kv: &'a mut KvCache, want: Logits) -> Self {
        SeqPass {
            tokens,
            kv,
            want,
            hidden_in: None,
            hidden_out: None,
        }
    }
}

/// Loads the architecture `cfg` names from `source` on backend `kind` with
/// `threads` compute threads (0: every core). `model` names it in errors.
pub fn load(
    cfg: ModelConfig,
    source: &dyn PageSource,
    model: &str,
    kind: BackendKind,
    threads: usize,
) -> Result<Box<dyn Model>, VoomError> {
    match kind {
        BackendKind::Cpu(isa) => {
            let backend = CpuBackend::new(threads, isa).map_err(|e| {
                VoomError::Request(format!("cannot start {threads} compute threads: {e}"))
            })?;
            load_on(cfg, source, model, backend)
        }
        #[cfg(voom_mlx)]
        BackendKind::Mlx => load_on(cfg, source, model, crate::backend::mlx::MlxBackend::new()?),
        #[cfg(not(voom_mlx))]
        BackendKind::Mlx => Err(VoomError::Request(crate::backend::MLX_MISSING.to_string())),
    }
}

fn load_on<B: Backend + 'static>(
    cfg: ModelConfig,
    source: &dyn PageSource,
    model: &str,
    backend: B,
) -> Result<Box<dyn Model>, VoomError> {
    match cfg.arch {
        Arch::Llama
        | Arch::Mistral
        | Arch::Qwen2
        | Arch::Qwen3
        | Arch::Qwen3Moe
        | Arch::Olmoe
        | Arch::Mixtral
        | Arch::Glm4Moe
        | Arch::DeepseekV3
        | Arch::Qwen3Next
        | Arch::Qwen35
        | Arch::Qwen35Moe
        | Arch::GptOss => Ok(Box::new(llama::Llama::load(cfg, source, model, backend)?)),
    }
}
