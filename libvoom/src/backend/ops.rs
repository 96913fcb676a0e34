//! The interface every backend implements: the ops architectures are written against.
//!
//! An architecture (a file under `model/`) computes with these ops only, on
//! activations of the backend's own type ([`Backend::Act`]) and weights viewed in
//! place ([`WeightView`], [`VecView`]), so a new backend (MLX on Metal) is one new
//! implementation of this trait and no model file changes.
//!
//! # Exactness
//! Every backend computes each element in the order the CPU kernels document
//! (`cpu::matmul`'s module doc for products, `cpu::ops` for norms and softmax):
//! results are bit-identical across backends, instruction sets, thread counts and
//! batch sizes (DESIGN.md invariants 2 and 6). `libvoom/tests/backend_ops.rs` checks
//! each op on every backend this machine has against a reference written from the
//! specification.

use std::ops::Range;

use super::kv::KvCache;
use super::{KernelError, TableView, VecView, WeightView};

/// The activation of a gated MLP: `gate = act(gate) * up`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    /// `x * sigmoid(x)` (SwiGLU: Llama, Mistral, Qwen).
    Silu,
    /// gpt-oss's clamped SwiGLU: with `g = min(gate, limit)` and `u = clamp(up,
    /// -limit, limit)`, `(u + 1) * g * sigmoid(alpha * g)` (alpha 1.702, limit 7).
    ClampedSwiglu { alpha: f32, limit: f32 },
}

/// Rotary tables for consecutive positions: `cos[t * half + i]` and
/// `sin[t * half + i]` for position `pos0 + t` and frequency `i < half`.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTable {
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeTable {
    /// Positions the table covers.
    pub fn positions(&self) -> usize {
        self.cos.len().checked_div(self.half).unwrap_or(0)
    }
}

/// Where rotary embedding applies in each head of a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeShape {
    /// Floats per head (heads are consecutive in a row).
    pub head_dim: usize,
    /// The first rotated float of each head; `2 × table.half` floats from it rotate,
    /// the rest of the head is left as it is (partial rotary, MLA's non-rotary part).
    pub offset: usize,
    /// `false`: rotate-half pairs `(x[i], x[i + half])`. `true`: interleaved pairs
    /// `(x[2i], x[2i + 1])`, written back de-interleaved (`x[i]`, `x[half + i]`) as
    /// transformers' `apply_rotary_pos_emb_interleave` writes them.
    pub interleaved: bool,
}

impl RopeShape {
    /// Rotate-half over whole heads of `head_dim`.
    pub fn whole(head_dim: usize) -> Self {
        RopeShape {
            head_dim,
            offset: 0,
            interleaved: false,
        }
    }
}

/// The shape of multi-head latent attention over a cache of one vector per position:
/// a latent of `rank` floats then a rotary key of `rope` floats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatentShape {
    pub heads: usize,
    pub rank: usize,
    pub rope: usize,
    /// The softmax scale the scores are multiplied by.
    pub scale: f32,
}

/// The shape of grouped-query attention in one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// `Some(w)`: each query attends to the last `w` positions (its own included).
    pub window: Option<usize>,
    /// Attention sinks (gpt-oss): one learned logit per head, in each row's softmax
    /// beside the scores and dropped after it (its probability attends nothing).
    pub sinks: Option<std::sync::Arc<[f32]>>,
}

/// The ops of a compute backend. Activations are `rows` positions of `cols` f32
/// values each. Every op checks the shapes it is given and returns
/// [`KernelError`] on a mismatch, never reads out of bounds.
pub trait Backend: Send + Sync {
    /// Activations in the memory this backend computes on.
    type Act: Send + Sync;

    /// A short name for logs ("cpu-avx2").
    fn name(&self) -> String;

    /// Compute threads (or the device's equivalent for reporting).
    fn threads(&self) -> usize;

    /// Whether a position's bits are independent of the other positions and rows
    /// computed with it (the chunk, the batch, the cache length: DESIGN.md
    /// invariant 6), as shown by the conformance suites. Where not, the engine
    /// turns off what needs it to stay exact (prefix reuse, speculation, batching).
    fn batch_invariant(&self) -> bool {
        true
    }

    /// Bytes of weight and KV pages copied so far instead of computed on in place
    /// (a device that cannot wrap host memory, an address not aligned for it); 0
    /// for the CPU, which reads every page where it lies.
    fn copied_bytes(&self) -> u64 {
        0
    }

    /// Graph evaluations so far that computed something, for a backend that builds
    /// a lazy graph (MLX: one a layer, where values go to the host); 0 for one that
    /// computes each op when called (the CPU).
    fn evaluations(&self) -> u64 {
        0
    }

    /// Multiply-adds of the products and attention computed so far
    /// ([`super::check::product_terms`], [`super::check::attention_terms`]): what a
    /// prefill's rate is measured against the multiply-add peak by (other ops are
    /// not counted, so a rate from it is a lower bound).
    fn multiply_adds(&self) -> u64 {
        0
    }

    /// Bytes a product with a weight matrix of `elems` elements holds beside the
    /// page while it runs (a copy the backend makes, its f32 widening): the memory
    /// planner counts it for the largest matrix. 0 for the CPU, which reads the page
    /// in place.
    fn weight_scratch_bytes(&self, elems: u64) -> u64 {
        let _ = elems;
        0
    }

    /// `rows × cols` zeros.
    fn zeros(&self, rows: usize, cols: usize) -> Self::Act;

    /// Activations holding `data` (`rows × cols`, row-major).
    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<Self::Act, KernelError>;

    /// `(rows, cols)`.
    fn shape(&self, x: &Self::Act) -> (usize, usize);

    /// The values, row-major, in host memory (`Err` when a backend that evaluates
    /// lazily fails computing them).
    fn download(&self, x: &Self::Act) -> Result<Vec<f32>, KernelError>;

    /// [`Backend::download`], consuming `x` (no copy where it is host memory already).
    fn download_owned(&self, x: Self::Act) -> Result<Vec<f32>, KernelError>;

    /// A copy of rows `range` of `x`.
    fn rows(&self, x: &Self::Act, range: Range<usize>) -> Result<Self::Act, KernelError>;

    /// `parts` one after the other, as one activation (every part with the same
    /// columns).
    fn stack(&self, parts: &[Self::Act]) -> Result<Self::Act, KernelError>;

    /// Gathers rows `ids` of `table` (an embedding) into `out` (`ids.len() × cols`),
    /// widened exactly to f32: row `t` of `out` from the part holding row `ids[t]`.
    /// Rows of `out` whose id no part given holds are left as they are, so a table
    /// leased part by part is gathered in several calls. An id past the table is an
    /// error.
    fn embed(
        &self,
        table: &TableView<'_>,
        ids: &[u32],
        out: &mut Self::Act,
    ) -> Result<(), KernelError>;

    /// `out[t][o] = Σ_k x[t][k] · w[o][k]`: `x` is `n × w.cols`, `out` `n × w.rows`.
    fn matmul(
        &self,
        x: &Self::Act,
        w: WeightView<'_>,
        out: &mut Self::Act,
    ) -> Result<(), KernelError>;

    /// Adds `bias` to every row of `x`.
    fn add_bias(&self, x: &mut Self::Act, bias: VecView<'_>) -> Result<(), KernelError>;

    /// RMSNorm of each row into `out`: `w * (x * rsqrt(mean(x²) + eps))`.
    fn rms_norm(
        &self,
        x: &Self::Act,
        weight: VecView<'_>,
        eps: f32,
        out: &mut Self::Act,
    ) -> Result<(), KernelError>;

    /// RMSNorm in place of each `group`-sized piece of every row (per-head norms).
    fn rms_norm_groups(
        &self,
        x: &mut Self::Act,
        group: usize,
        weight: VecView<'_>,
        eps: f32,
    ) -> Result<(), KernelError>;

    /// Rotary embedding of each head of row `t` ([`RopeShape`]), by the angles of the
    /// table's position `t`.
    fn rope(
        &self,
        x: &mut Self::Act,
        shape: &RopeShape,
        table: &RopeTable,
    ) -> Result<(), KernelError>;

    /// `out[t][c] = Σ_r x[t][r] · w[r][c]` (the weight's rows contracted: `x` is
    /// `n × w.rows`, `out` `n × w.cols`), each element summed in increasing `r` with
    /// one fused multiply-add a term, from 0.
    fn matmul_t(
        &self,
        x: &Self::Act,
        w: WeightView<'_>,
        out: &mut Self::Act,
    ) -> Result<(), KernelError>;

    /// Appends the new positions' cache vectors `kv_new` (`n × (rank + rope)`: the
    /// latent, then the rotary key) to `layer` of `kv`, then computes each head's
    /// causal attention of the queries `q` (`n × heads·(rank + rope)`) over every
    /// cached position into `out` (`n × heads·rank`): scores are the dot products
    /// with whole cache vectors times the scale, values the latents.
    #[allow(clippy::too_many_arguments)]
    fn latent_attention(
        &self,
        q: &Self::Act,
        kv_new: &Self::Act,
        kv: &mut KvCache,
        layer: usize,
        shape: &LatentShape,
        out: &mut Self::Act,
    ) -> Result<(), KernelError>;

    /// Appends the keys `k` and values `v` of positions `kv.len()..` to `layer` of
    /// `kv`, then computes causal attention of the queries `q` (one row per new
    /// position) over every cached position of the layer into `out`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        kv: &mut KvCache,
        layer: usize,
        shape: &AttentionShape,
        out: &mut Self::Act,
    ) -> Result<(), KernelError>;

    /// `x += y`.
    fn add(&self, x: &mut Self::Act, y: &Self::Act) -> Result<(), KernelError>;

    /// `gate = act(gate) * up`.
    fn gated(
        &self,
        act: Activation,
        gate: &mut Self::Act,
        up: &Self::Act,
    ) -> Result<(), KernelError>;

    /// Every value clamped to `[-limit, limit]` (olmoe's `clip_qkv`).
    fn clamp(&self, x: &mut Self::Act, limit: f32) -> Result<(), KernelError>;

    /// Softmax of each row in place, in float32 as torch computes it: the row's
    /// maximum subtracted, exponentials, each divided by their sum (a mixture of
    /// experts' router).
    fn softmax(&self, x: &mut Self::Act) -> Result<(), KernelError>;

    /// The logistic sigmoid of every value in place, `1 / (1 + exp(-x))` in float32
    /// (a router's scores).
    fn sigmoid(&self, x: &mut Self::Act) -> Result<(), KernelError>;

    /// Per row, the `k` largest values with their column, largest first (ties: the
    /// lower column first; NaN is never chosen over a number).
    fn top_k(&self, x: &Self::Act, k: usize) -> Result<Vec<Vec<(u32, f32)>>, KernelError>;
}
