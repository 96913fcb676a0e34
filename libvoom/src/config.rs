//! Hugging Face `config.json` to the internal model configuration.
//!
//! The HF struct ([`HfConfig`]) is kept apart from the internal one ([`ModelConfig`]):
//! every option that changes arithmetic is either understood here or rejected with an
//! error naming it. A config vOOM half-understands would give a wrong answer.
//!
//! A config is untrusted input, too. Each key is read with its type checked (a wrong
//! type is an error naming the key), and every value is checked against [`limits`]
//! and the rules of [`ModelConfig::validate`] before anything is sized from it: a
//! hostile or broken file is an error naming the key, the value and the allowed range,
//! never an abort or a run that computes garbage. Whether the values describe the
//! checkpoint's tensors is checked when the model loads, before it allocates anything
//! (`model::llama::Llama::load`).

use std::path::Path;

use serde_json::{Map, Value};

use crate::quantization::Quantization;
use crate::VoomError;

/// Upper bounds on `config.json` values, far above any published model's. They keep a
/// hostile value from sizing an allocation or overflowing arithmetic before the
/// checkpoint is consulted; the checkpoint's tensors then decide (every dimension must
/// match them, and the layer count must be the checkpoint's).
pub mod limits {
    /// Bytes of `config.json` read (published ones are a few KiB).
    pub const CONFIG_BYTES: u64 = 16 << 20;
    /// Decoder layers (`num_hidden_layers`).
    pub const LAYERS: usize = 1 << 16;
    /// Attention heads (`num_attention_heads`; `num_key_value_heads` is at most that).
    pub const HEADS: usize = 1 << 16;
    /// `head_dim`.
    pub const HEAD_DIM: usize = 1 << 16;
    /// `hidden_size`, `intermediate_size`, and the width of all attention heads
    /// together (`num_attention_heads × head_dim`).
    pub const WIDTH: usize = 1 << 24;
    /// `vocab_size`: every token id below it fits in a u32.
    pub const VOCAB: usize = u32::MAX as usize;
    /// `max_position_embeddings` and llama3's `original_max_position_embeddings`:
    /// rotary angles are computed from positions in float32, exact integers up to 2^24.
    pub const POSITIONS: usize = 1 << 24;
    /// Routed experts of a layer (`num_experts`; published models have up to 384).
    pub const EXPERTS: usize = 1 << 16;
}

/// The architectures vOOM computes. All are Llama-family decoders that differ in
/// small, explicit ways.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    /// Bias on q, k, v projections.
    Qwen2,
    /// RMSNorm on each head's q and k before rotary embedding.
    Qwen3,
    /// Qwen3 attention; routed experts in every layer but those `mlp_only_layers` or
    /// `decoder_sparse_step` leave dense.
    Qwen3Moe,
    /// RMSNorm over the whole q and k projections, `clip_qkv`; routed experts.
    Olmoe,
    /// Mistral attention; routed experts (`block_sparse_moe`), top-k weights always
    /// renormalised.
    Mixtral,
    /// Partial rotary, q/k/v bias, optional per-head q/k norm; routed experts after
    /// `first_k_dense_replace` dense layers, chosen by sigmoid scores with a correction
    /// bias within the best groups, and shared experts.
    Glm4Moe,
    /// Multi-head latent attention ([`Mla`]) and glm4_moe's mixture of experts.
    DeepseekV3,
    /// Hybrid: Gated DeltaNet layers ([`LinearAttn`], projections grouped by key
    /// head) between full attention layers with an output gate, zero-centred
    /// RMSNorms, routed experts with a gated shared expert.
    Qwen3Next,
    /// Qwen3.5's language model (`qwen3_5_text`): qwen3_next's layers with the
    /// DeltaNet projections stored apart, dense MLPs.
    Qwen35,
    /// Qwen3.5-MoE's language model (`qwen3_5_moe_text`): [`Arch::Qwen35`] with
    /// qwen3_next's experts in every layer, always renormalised.
    Qwen35Moe,
    /// gpt-oss: attention with a learned sink logit per head, q/k/v/o biases, layers
    /// alternating sliding-window and full attention, YaRN rotary; routed experts
    /// in every layer (router with a bias, top-k of its logits then a softmax over
    /// those), each with biases, gate and up interleaved and the clamped SwiGLU
    /// ([`ExpertGate::Clamped`]).
    GptOss,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::Olmoe => "olmoe",
            Arch::Mixtral => "mixtral",
            Arch::Glm4Moe => "glm4_moe",
            Arch::DeepseekV3 => "deepseek_v3",
            Arch::Qwen3Next => "qwen3_next",
            Arch::Qwen35 => "qwen3_5_text",
            Arch::Qwen35Moe => "qwen3_5_moe_text",
            Arch::GptOss => "gpt_oss",
        }
    }

    /// Whether its layers mix linear attention and full attention ([`LinearAttn`]).
    pub fn is_hybrid(self) -> bool {
        matches!(self, Arch::Qwen3Next | Arch::Qwen35 | Arch::Qwen35Moe)
    }
}

/// How a Gated DeltaNet layer's input projections are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearProjections {
    /// `in_proj_qkvz` and `in_proj_ba`, their rows grouped by key head: per key
    /// head, its query, key, values and gates, then its betas and decays
    /// (qwen3_next).
    Grouped,
    /// `in_proj_qkv` (all queries, all keys, all values), `in_proj_z`, `in_proj_b`,
    /// `in_proj_a` (qwen3_5).
    Split,
}

/// A hybrid model's linear-attention layers (Gated DeltaNet): a causal depthwise
/// convolution over the queries, keys and values with its rolling state, then the
/// gated delta rule's recurrent state per value head, a gated RMSNorm of the output.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearAttn {
    /// The convolution's kernel (`linear_conv_kernel_dim`).
    pub conv_kernel: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    pub num_key_heads: usize,
    /// A multiple of `num_key_heads`: value head `h` reads key head `h / ratio`.
    pub num_value_heads: usize,
    /// Per layer: whether it is linear attention (else full attention).
    pub layers: Vec<bool>,
    pub projections: LinearProjections,
}

impl LinearAttn {
    /// Widths of all queries (and of all keys), and of all values.
    pub fn key_dim(&self) -> usize {
        self.num_key_heads * self.key_head_dim
    }

    pub fn value_dim(&self) -> usize {
        self.num_value_heads * self.value_head_dim
    }

    /// Channels of the convolution: queries, keys and values.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// The recurrent state of one layer, in floats: the convolution's last
    /// `conv_kernel - 1` inputs, and each value head's key-by-value matrix.
    pub fn state_shape(&self) -> crate::kv::StateShape {
        crate::kv::StateShape {
            conv: (self.conv_kernel - 1) * self.conv_dim(),
            matrix: self.num_value_heads * self.key_head_dim * self.value_head_dim,
        }
    }
}

/// How q and k are normalised before rotary embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// RMSNorm over each head's `head_dim` values (weights of `head_dim`): qwen3.
    PerHead,
    /// RMSNorm over the whole projection (weights of all heads' width): olmoe.
    Whole,
}

/// A mixture of experts in place of the MLP: a router picks `top_k` of `num_experts`
/// SwiGLU experts per position ([`Scoring`]), and the position's output is their
/// outputs weighted by their scores (renormalised to sum to one when
/// `norm_topk_prob`, then times `routed_scaling_factor`), plus the shared experts'
/// output where there are any.
#[derive(Debug, Clone, PartialEq)]
pub struct Moe {
    pub num_experts: usize,
    pub top_k: usize,
    /// Rows of each expert's gate and up projections.
    pub expert_intermediate_size: usize,
    pub norm_topk_prob: bool,
    /// Per layer, the decoder's and then the extra ones
    /// ([`ModelConfig::extra_layers`]): whether its MLP is the mixture (else a dense
    /// MLP of `intermediate_size`).
    pub sparse: Vec<bool>,
    pub scoring: Scoring,
    /// The routed experts' weights are multiplied by it (1 where a family has none).
    pub routed_scaling_factor: f32,
    /// Rows of the shared experts' gate and up projections (`moe_intermediate_size ×
    /// n_shared_experts`), 0 without shared experts.
    pub shared_intermediate_size: usize,
    /// One shared expert (`mlp.shared_expert.*`, not `shared_experts`) whose output
    /// is multiplied by the sigmoid of a per-position scalar (`shared_expert_gate`):
    /// qwen3_next, qwen3_5_moe.
    pub shared_gate: bool,
    /// The router's logits have a bias (`router.bias`: gpt-oss).
    pub router_bias: bool,
    /// How each routed expert gates its up projection.
    pub gate: ExpertGate,
}

/// A routed expert's gated MLP.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExpertGate {
    /// `down(silu(gate(x)) · up(x))`; fused, the gate's rows come first.
    Silu,
    /// gpt-oss: `gate_up_proj` interleaves gate rows (even) and up rows (odd), and
    /// every projection has a bias; `down((up + 1) · gate · sigmoid(alpha · gate))`
    /// with the gate clamped above at `limit` and up within `±limit`.
    Clamped { alpha: f32, limit: f32 },
}

/// How a router scores and picks experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoring {
    /// Softmax over every expert; the `top_k` most probable (qwen3_moe, olmoe,
    /// mixtral).
    Softmax,
    /// Sigmoid scores; experts are chosen by score plus the router's correction bias
    /// (`e_score_correction_bias`, stored in the checkpoint) among the `topk_group`
    /// groups (of `n_group` equal ones) whose two best such values sum highest, and
    /// weighted by their scores without the bias (deepseek_v3, glm4_moe:
    /// `noaux_tc`).
    SigmoidGroups { n_group: usize, topk_group: usize },
    /// The `top_k` largest logits, weighted by a softmax over those alone
    /// (gpt-oss).
    TopKSoftmax,
}

/// Multi-head latent attention (DeepSeek-V2/V3): queries through an optional
/// low-rank projection, keys and values from one compressed latent of
/// `kv_lora_rank` per position plus one shared rotary key of `qk_rope_head_dim`
/// (what the KV cache stores), each head's key its `qk_nope_head_dim` part expanded
/// from the latent and the rotary key.
#[derive(Debug, Clone, PartialEq)]
pub struct Mla {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// Rotary dimensions stored as interleaved pairs `(x0, x1), (x2, x3), ...`
    /// (`rope_interleave`, DeepSeek's layout), else rotate-half.
    pub rope_interleave: bool,
    /// The softmax scale: `(qk_nope_head_dim + qk_rope_head_dim)^-0.5`, times YaRN's
    /// `mscale_all_dim` correction squared.
    pub softmax_scale: f32,
}

/// Rotary embedding frequencies.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    Default,
    /// Llama 3.x frequency-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: usize,
    },
    /// YaRN (DeepSeek-V3): frequencies blended between interpolated and extrapolated
    /// by a linear ramp over the dimensions `beta_fast`..`beta_slow` rotations map to,
    /// and cos/sin times `attention_factor`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        /// Given, or inferred from `factor`, `mscale` and `mscale_all_dim`.
        attention_factor: f64,
        /// `mscale_all_dim`, which MLA's softmax scale is corrected by.
        mscale_all_dim: Option<f64>,
        truncate: bool,
    },
}

/// The internal configuration. [`ModelConfig::from_hf`] returns only valid ones; a
/// config built or changed by hand is checked again by [`ModelConfig::validate`] when a
/// model loads it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    /// Width of each query head (MLA: `qk_nope_head_dim + qk_rope_head_dim`).
    pub head_dim: usize,
    /// Rotary dimensions of each head (`head_dim × partial_rotary_factor`; MLA:
    /// `qk_rope_head_dim`): the first ones, or MLA's last.
    pub rotary_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v projections.
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// RMSNorm on q and k before rotary embedding.
    pub qk_norm: QkNorm,
    /// q, k and v clamped to `[-c, c]` after the norms (olmoe's `clip_qkv`).
    pub clip_qkv: Option<f32>,
    /// Routed experts in place of the MLP (in the layers `Moe::sparse` names).
    pub moe: Option<Moe>,
    /// Multi-head latent attention in place of grouped-query attention.
    pub mla: Option<Mla>,
    /// Linear-attention layers between the full attention ones (a hybrid).
    pub linear: Option<LinearAttn>,
    /// RMSNorm weights are offsets from one: `x̂ · (1 + w)` (zero-centred norms,
    /// q/k norms included; a DeltaNet layer's gated output norm is not).
    pub norm_offset: bool,
    /// `q_proj` gives each head its query and a gate of the same width, one after
    /// the other; attention's output is multiplied by the gate's sigmoid before
    /// `o_proj`.
    pub attn_output_gate: bool,
    /// Layers after the decoder's that the checkpoint may hold and the forward pass
    /// does not run (multi-token prediction: `num_nextn_predict_layers`).
    pub extra_layers: usize,
    /// Each attention head has a learned logit (`self_attn.sinks`) that joins its
    /// softmax beside the scores and attends to nothing (gpt-oss).
    pub attn_sinks: bool,
    /// Per layer: `Some(w)` when the layer attends only to the last `w` positions
    /// (the query's own included), `None` for full causal attention.
    pub sliding_window: Vec<Option<usize>>,
    /// Below `vocab_size` (see [`token_ids`]).
    pub bos_token_id: Option<u32>,
    /// Each below `vocab_size` (see [`token_ids`]).
    pub eos_token_ids: Vec<u32>,
    /// How the weights that are not BF16 are stored (`quantization_config`).
    pub quant: Quantization,
}

/// The subset of HF `config.json` keys vOOM reads, each with its JSON type checked
/// ([`HfConfig::from_value`]). Unknown keys are ignored unless they are checked
/// explicitly in [`ModelConfig::from_hf`]; `null` is the same as an absent key.
#[derive(Debug, Clone, Default)]
pub struct HfConfig {
    pub model_type: Option<String>,
    pub architectures: Option<Vec<String>>,
    pub hidden_size: Option<usize>,
    pub intermediate_size: Option<usize>,
    pub num_hidden_layers: Option<usize>,
    pub num_attention_heads: Option<usize>,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub vocab_size: Option<usize>,
    pub max_position_embeddings: Option<usize>,
    pub rms_norm_eps: Option<f64>,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<Value>,
    pub rope_parameters: Option<Value>,
    pub tie_word_embeddings: Option<bool>,
    pub attention_bias: Option<bool>,
    pub mlp_bias: Option<bool>,
    pub hidden_act: Option<String>,
    pub sliding_window: Option<Value>,
    pub use_sliding_window: Option<bool>,
    pub max_window_layers: Option<usize>,
    pub layer_types: Option<Vec<String>>,
    pub partial_rotary_factor: Option<f64>,
    pub quantization_config: Option<Value>,
    pub bos_token_id: Option<Value>,
    pub eos_token_id: Option<Value>,
    pub pretraining_tp: Option<usize>,
    pub num_experts: Option<usize>,
    pub num_local_experts: Option<usize>,
    pub num_experts_per_tok: Option<usize>,
    pub moe_intermediate_size: Option<usize>,
    pub norm_topk_prob: Option<bool>,
    pub decoder_sparse_step: Option<usize>,
    pub mlp_only_layers: Option<Vec<usize>>,
    pub clip_qkv: Option<f64>,
    pub shared_expert_intermediate_size: Option<usize>,
    pub n_routed_experts: Option<usize>,
    pub n_shared_experts: Option<usize>,
    pub routed_scaling_factor: Option<f64>,
    pub n_group: Option<usize>,
    pub topk_group: Option<usize>,
    pub first_k_dense_replace: Option<usize>,
    pub scoring_func: Option<String>,
    pub topk_method: Option<String>,
    pub moe_layer_freq: Option<usize>,
    pub q_lora_rank: Option<usize>,
    /// Whether `q_lora_rank` is in the file at all (`null` there means a plain
    /// `q_proj`; absent, transformers' default rank).
    pub q_lora_rank_given: bool,
    pub kv_lora_rank: Option<usize>,
    pub qk_nope_head_dim: Option<usize>,
    pub qk_rope_head_dim: Option<usize>,
    pub v_head_dim: Option<usize>,
    pub rope_interleave: Option<bool>,
    pub use_qk_norm: Option<bool>,
    pub num_nextn_predict_layers: Option<usize>,
    pub original_max_position_embeddings: Option<usize>,
    pub linear_conv_kernel_dim: Option<usize>,
    pub linear_key_head_dim: Option<usize>,
    pub linear_value_head_dim: Option<usize>,
    pub linear_num_key_heads: Option<usize>,
    pub linear_num_value_heads: Option<usize>,
    pub full_attention_interval: Option<usize>,
    pub swiglu_limit: Option<f64>,
}

impl HfConfig {
    /// Reads the keys vOOM knows from a parsed `config.json`. A value of the wrong
    /// type (a string for a size, a float or a negative number for a count, an integer
    /// beyond u64) is an error naming its key and quoting the value.
    pub fn from_value(v: &Value) -> Result<Self, String> {
        let obj = v
            .as_object()
            .ok_or_else(|| format!("must be a JSON object, got {}", quote(v)))?;
        let f = Keys(obj);
        Ok(HfConfig {
            model_type: f.string("model_type")?,
            architectures: f.strings("architectures")?,
            hidden_size: f.count("hidden_size")?,
            intermediate_size: f.count("intermediate_size")?,
            num_hidden_layers: f.count("num_hidden_layers")?,
            num_attention_heads: f.count("num_attention_heads")?,
            num_key_value_heads: f.count("num_key_value_heads")?,
            head_dim: f.count("head_dim")?,
            vocab_size: f.count("vocab_size")?,
            max_position_embeddings: f.count("max_position_embeddings")?,
            rms_norm_eps: f.number("rms_norm_eps")?,
            rope_theta: f.number("rope_theta")?,
            rope_scaling: f.any("rope_scaling"),
            rope_parameters: f.any("rope_parameters"),
            tie_word_embeddings: f.boolean("tie_word_embeddings")?,
            attention_bias: f.boolean("attention_bias")?,
            mlp_bias: f.boolean("mlp_bias")?,
            hidden_act: f.string("hidden_act")?,
            sliding_window: f.any("sliding_window"),
            use_sliding_window: f.boolean("use_sliding_window")?,
            max_window_layers: f.count("max_window_layers")?,
            layer_types: f.strings("layer_types")?,
            partial_rotary_factor: f.number("partial_rotary_factor")?,
            quantization_config: f.any("quantization_config"),
            bos_token_id: f.any("bos_token_id"),
            eos_token_id: f.any("eos_token_id"),
            pretraining_tp: f.count("pretraining_tp")?,
            num_experts: f.count("num_experts")?,
            num_local_experts: f.count("num_local_experts")?,
            num_experts_per_tok: f.count("num_experts_per_tok")?,
            moe_intermediate_size: f.count("moe_intermediate_size")?,
            norm_topk_prob: f.boolean("norm_topk_prob")?,
            decoder_sparse_step: f.count("decoder_sparse_step")?,
            mlp_only_layers: f.counts("mlp_only_layers")?,
            clip_qkv: f.number("clip_qkv")?,
            shared_expert_intermediate_size: f.count("shared_expert_intermediate_size")?,
            n_routed_experts: f.count("n_routed_experts")?,
            n_shared_experts: f.count("n_shared_experts")?,
            routed_scaling_factor: f.number("routed_scaling_factor")?,
            n_group: f.count("n_group")?,
            topk_group: f.count("topk_group")?,
            first_k_dense_replace: f.count("first_k_dense_replace")?,
            scoring_func: f.string("scoring_func")?,
            topk_method: f.string("topk_method")?,
            moe_layer_freq: f.count("moe_layer_freq")?,
            q_lora_rank: f.count("q_lora_rank")?,
            q_lora_rank_given: obj.contains_key("q_lora_rank"),
            kv_lora_rank: f.count("kv_lora_rank")?,
            qk_nope_head_dim: f.count("qk_nope_head_dim")?,
            qk_rope_head_dim: f.count("qk_rope_head_dim")?,
            v_head_dim: f.count("v_head_dim")?,
            rope_interleave: f.boolean("rope_interleave")?,
            use_qk_norm: f.boolean("use_qk_norm")?,
            linear_conv_kernel_dim: f.count("linear_conv_kernel_dim")?,
            linear_key_head_dim: f.count("linear_key_head_dim")?,
            linear_value_head_dim: f.count("linear_value_head_dim")?,
            linear_num_key_heads: f.count("linear_num_key_heads")?,
            linear_num_value_heads: f.count("linear_num_value_heads")?,
            full_attention_interval: f.count("full_attention_interval")?,
            swiglu_limit: f.number("swiglu_limit")?,
            num_nextn_predict_layers: match f.count("num_nextn_predict_layers")? {
                Some(n) => Some(n),
                None => f.count("num_mtp_layers")?,
            },
            original_max_position_embeddings: f.count("original_max_position_embeddings")?,
        })
    }
}

/// Typed reads of a JSON object's keys; `null` reads as absent.
struct Keys<'a>(&'a Map<String, Value>);

impl Keys<'_> {
    fn any(&self, key: &str) -> Option<Value> {
        self.0.get(key).filter(|v| !v.is_null()).cloned()
    }

    fn typed<T>(
        &self,
        key: &str,
        what: &str,
        read: impl Fn(&Value) -> Option<T>,
    ) -> Result<Option<T>, String> {
        match self.0.get(key).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => read(v)
                .map(Some)
                .ok_or_else(|| format!("'{key}' must be {what}, got {}", quote(v))),
        }
    }

    fn count(&self, key: &str) -> Result<Option<usize>, String> {
        self.typed(key, "a non-negative integer", as_count)
    }

    fn number(&self, key: &str) -> Result<Option<f64>, String> {
        self.typed(key, "a number", Value::as_f64)
    }

    fn boolean(&self, key: &str) -> Result<Option<bool>, String> {
        self.typed(key, "true or false", Value::as_bool)
    }

    fn string(&self, key: &str) -> Result<Option<String>, String> {
        self.typed(key, "a string", |v| v.as_str().map(str::to_string))
    }

    fn counts(&self, key: &str) -> Result<Option<Vec<usize>>, String> {
        self.typed(key, "a list of non-negative integers", |v| {
            v.as_array()?.iter().map(as_count).collect()
        })
    }

    fn strings(&self, key: &str) -> Result<Option<Vec<String>>, String> {
        self.typed(key, "a list of strings", |v| {
            v.as_array()?
                .iter()
                .map(|s| s.as_str().map(str::to_string))
                .collect()
        })
    }
}

/// A JSON integer that fits usize (no float, however round, and nothing that wraps).
fn as_count(v: &Value) -> Option<usize> {
    v.as_u64().and_then(|x| usize::try_from(x).ok())
}

/// A JSON value for an error message, cut short when long.
fn quote(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}

/// `config.json`'s text: a regular file (a FIFO or a device is refused without being
/// opened, so nothing blocks) of at most [`limits::CONFIG_BYTES`].
fn read_config(path: &Path) -> Result<String, String> {
    let bytes = voom_formats::file::read_limited(path, limits::CONFIG_BYTES).map_err(|e| {
        if e.kind() == std::io::ErrorKind::InvalidData {
            format!(
                "{e}: a config.json must be at most {} bytes",
                limits::CONFIG_BYTES
            )
        } else {
            format!("cannot read: {e}")
        }
    })?;
    String::from_utf8(bytes).map_err(|e| format!("not UTF-8 text: {e}"))
}

/// Token ids given by `key` of a config file (one id or a list of them), as
/// transformers reads `bos_token_id` / `eos_token_id`. An entry that is not a token
/// id of a vocabulary of `vocab_size` (negative, fractional, not a number, or not
/// below `vocab_size`) is dropped with a warning naming it: the model can never
/// produce such an id, so it could never end generation (transformers warns and
/// generates on, too). Nothing is wrapped: 2^32 is dropped, never read as 0.
pub fn token_ids(v: Option<&Value>, key: &str, vocab_size: usize, file: &Path) -> Vec<u32> {
    let entries: Vec<&Value> = match v {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(a)) => a.iter().collect(),
        Some(one) => vec![one],
    };
    let mut ids = Vec::with_capacity(entries.len());
    for e in entries {
        match e
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .filter(|&x| (x as usize) < vocab_size)
        {
            Some(id) => ids.push(id),
            None => tracing::warn!(
                "{}: '{key}' {} is not a token id of this model (0..{vocab_size}); ignored, since it can never be generated",
                file.display(),
                quote(e)
            ),
        }
    }
    ids
}

/// `Err` unless `lo <= v <= hi`, naming `key` and the range.
fn within(key: &str, v: usize, lo: usize, hi: usize) -> Result<(), String> {
    if (lo..=hi).contains(&v) {
        Ok(())
    } else {
        Err(format!("'{key}' is {v}; the allowed range is {lo}..={hi}"))
    }
}

/// `Err` unless `v` (as float32, as it is computed with) is finite and positive.
fn positive_finite(key: &str, v: f32) -> Result<(), String> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(format!(
            "'{key}' is {v} as float32; it must be a positive finite number"
        ))
    }
}

impl ModelConfig {
    /// Reads `config.json` in a model directory.
    pub fn from_dir(dir: &Path) -> Result<Self, VoomError> {
        let path = dir.join("config.json");
        let text = read_config(&path).map_err(|detail| VoomError::Config {
            path: path.clone(),
            detail,
        })?;
        Self::from_json(&text, &path)
    }

    /// Parses `config.json` text; `path` is used in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<Self, VoomError> {
        let err = |detail: String| VoomError::Config {
            path: path.to_path_buf(),
            detail,
        };
        let v: Value =
            serde_json::from_str(text).map_err(|e| err(format!("not a valid config.json: {e}")))?;
        let v = language_model(v).map_err(err)?;
        let hf = HfConfig::from_value(&v).map_err(err)?;
        Self::from_hf(&hf, path)
    }

    /// The internal configuration of `hf`, checked by [`ModelConfig::validate`].
    pub fn from_hf(hf: &HfConfig, path: &Path) -> Result<Self, VoomError> {
        let err = |detail: String| VoomError::Config {
            path: path.to_path_buf(),
            detail,
        };
        let need = |v: Option<usize>, key: &str| -> Result<usize, VoomError> {
            match v {
                Some(0) => Err(err(format!("'{key}' must be positive"))),
                Some(x) => Ok(x),
                None => Err(err(format!("missing '{key}'"))),
            }
        };
        let model_type = hf
            .model_type
            .as_deref()
            .ok_or_else(|| err("missing 'model_type'".into()))?;
        let arch = match model_type {
            "llama" => Arch::Llama,
            "mistral" => Arch::Mistral,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "qwen3_moe" => Arch::Qwen3Moe,
            "olmoe" => Arch::Olmoe,
            "mixtral" => Arch::Mixtral,
            "glm4_moe" => Arch::Glm4Moe,
            "deepseek_v3" => Arch::DeepseekV3,
            "qwen3_next" => Arch::Qwen3Next,
            "qwen3_5_text" => Arch::Qwen35,
            "qwen3_5_moe_text" => Arch::Qwen35Moe,
            "gpt_oss" => Arch::GptOss,
            other => {
                return Err(err(format!(
                    "unsupported model_type '{other}' (supported: llama, mistral, qwen2, \
                     qwen3, qwen3_moe, olmoe, mixtral, glm4_moe, deepseek_v3, qwen3_next, \
                     qwen3_5_text, qwen3_5_moe_text, gpt_oss, and qwen3_5 and qwen3_5_moe's \
                     language models)"
                )))
            }
        };
        let quant = Quantization::from_config(hf.quantization_config.as_ref()).map_err(err)?;
        let act = hf.hidden_act.as_deref().unwrap_or("silu");
        if act != "silu" {
            return Err(err(format!(
                "unsupported hidden_act '{act}' (supported: silu)"
            )));
        }
        if let Some(tp) = hf.pretraining_tp {
            if tp != 1 {
                return Err(err(format!("unsupported pretraining_tp {tp}")));
            }
        }

        let hidden_size = need(hf.hidden_size, "hidden_size")?;
        // qwen3_5_moe has no dense MLP: its experts' size stands in (never used).
        let intermediate_size = match (arch, hf.intermediate_size) {
            (Arch::Qwen35Moe, None) => need(hf.moe_intermediate_size, "moe_intermediate_size")?,
            (_, i) => need(i, "intermediate_size")?,
        };
        let num_layers = need(hf.num_hidden_layers, "num_hidden_layers")?;
        let num_heads = need(hf.num_attention_heads, "num_attention_heads")?;
        let num_kv_heads = need(
            hf.num_key_value_heads.or(Some(num_heads)),
            "num_key_value_heads",
        )?;
        let mla = match arch {
            Arch::DeepseekV3 => Some(mla(hf).map_err(err)?),
            _ => None,
        };
        let head_dim = match (&mla, hf.head_dim) {
            (Some(m), _) => m.qk_nope_head_dim + m.qk_rope_head_dim,
            (None, Some(d)) => need(Some(d), "head_dim")?,
            // transformers' default for gpt-oss (its hidden size is not heads × 64).
            (None, None) if arch == Arch::GptOss => 64,
            (None, None) => {
                if hidden_size % num_heads != 0 {
                    return Err(err(format!(
                        "hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads} and no head_dim is given"
                    )));
                }
                hidden_size / num_heads
            }
        };
        let vocab_size = need(hf.vocab_size, "vocab_size")?;
        let max_position_embeddings = match (arch, hf.max_position_embeddings) {
            // transformers' default for gpt-oss.
            (Arch::GptOss, None) => 131072,
            (_, given) => need(given, "max_position_embeddings")?,
        };
        // Both are used in float32, as transformers does (validate checks what they
        // become there: 1e-50 is 0, 1e39 is infinite).
        let rms_norm_eps = hf.rms_norm_eps.unwrap_or(1e-6) as f32;

        // Rope: transformers 5 writes `rope_parameters` ({rope_type, rope_theta, ...});
        // older configs have top-level `rope_theta` and optional `rope_scaling`.
        let mut rope_theta = hf.rope_theta;
        let mut partial = hf.partial_rotary_factor;
        let mut scaling: Option<&Value> = hf.rope_scaling.as_ref();
        if let Some(p) = hf.rope_parameters.as_ref() {
            let obj = p
                .as_object()
                .ok_or_else(|| err("'rope_parameters' must be an object".into()))?;
            if obj.values().any(|v| v.is_object()) {
                return Err(err(
                    "per-layer-type 'rope_parameters' are not supported".into()
                ));
            }
            let number = |key: &str| -> Result<Option<f64>, VoomError> {
                obj.get(key)
                    .filter(|v| !v.is_null())
                    .map(|t| {
                        t.as_f64().ok_or_else(|| {
                            err(format!(
                                "'rope_parameters.{key}' must be a number, got {}",
                                quote(t)
                            ))
                        })
                    })
                    .transpose()
            };
            if let Some(t) = number("rope_theta")? {
                rope_theta = Some(t);
            }
            if let Some(f) = number("partial_rotary_factor")? {
                partial = Some(f);
            }
            scaling = Some(p);
        }
        // gpt-oss: transformers' defaults where the config gives none.
        let gpt_oss_yarn;
        if arch == Arch::GptOss && scaling.is_none() {
            gpt_oss_yarn = serde_json::json!({
                "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": false, "original_max_position_embeddings": 4096
            });
            scaling = Some(&gpt_oss_yarn);
        }
        let default_theta = match arch {
            Arch::GptOss => 150000.0,
            _ => 10000.0,
        };
        let rope_theta = rope_theta.unwrap_or(default_theta) as f32;
        let rope_scaling = match scaling {
            None => RopeScaling::Default,
            Some(s) => parse_rope_scaling(
                s,
                max_position_embeddings,
                hf.original_max_position_embeddings,
            )
            .map_err(err)?,
        };
        // glm4_moe rotates half of each head unless the config says otherwise.
        // qwen3_next and qwen3_5 a quarter (transformers' default for these).
        let partial = match (arch, partial) {
            (Arch::Glm4Moe, None) => Some(0.5),
            (a, None) if a.is_hybrid() => Some(0.25),
            (_, p) => p,
        };
        let rotary_dim = match partial {
            Some(f) if arch == Arch::Glm4Moe || arch.is_hybrid() => {
                if !(f > 0.0 && f <= 1.0) {
                    return Err(err(format!(
                        "'partial_rotary_factor' {f} must be in (0, 1]"
                    )));
                }
                // transformers: int(head_dim * partial_rotary_factor).
                (head_dim as f64 * f) as usize
            }
            Some(f) if f != 1.0 => {
                return Err(err(format!(
                    "unsupported partial_rotary_factor {f} for {}",
                    arch.name()
                )));
            }
            // MLA rotates its qk_rope_head_dim part; the others the whole head.
            _ => mla.as_ref().map_or(head_dim, |m| m.qk_rope_head_dim),
        };
        let mla = mla.map(|mut m| {
            // transformers: yarn_apply_mscale(rope_parameters, qk_head_dim ** -0.5), in
            // float64, used as a float32 factor.
            let mut scale = (head_dim as f64).powf(-0.5);
            if let RopeScaling::Yarn {
                factor,
                mscale_all_dim: Some(all),
                ..
            } = rope_scaling
            {
                if all != 0.0 {
                    let m = yarn_mscale(factor, all);
                    scale = scale * m * m;
                }
            }
            m.softmax_scale = scale as f32;
            m
        });

        let default_tie = false;
        let tie_word_embeddings = hf.tie_word_embeddings.unwrap_or(default_tie);
        let attention_bias = hf.attention_bias.unwrap_or(arch == Arch::GptOss);
        let (qkv_bias, o_bias) = match arch {
            // Qwen2 always has q/k/v bias and never an output bias.
            Arch::Qwen2 => (true, false),
            Arch::Mistral | Arch::Mixtral => (false, false),
            // glm4_moe: `attention_bias` on q, k and v only.
            Arch::Glm4Moe => (attention_bias, false),
            // deepseek_v3: on q_a, kv_a and o (q_b, kv_b never have one).
            Arch::Llama
            | Arch::Qwen3
            | Arch::Qwen3Moe
            | Arch::Olmoe
            | Arch::DeepseekV3
            | Arch::Qwen3Next
            | Arch::Qwen35
            | Arch::Qwen35Moe
            | Arch::GptOss => (attention_bias, attention_bias),
        };
        let mlp_bias = match arch {
            Arch::Llama => hf.mlp_bias.unwrap_or(false),
            _ => false,
        };
        let extra_layers = match arch {
            Arch::Glm4Moe | Arch::DeepseekV3 => hf.num_nextn_predict_layers.unwrap_or(0),
            _ => 0,
        };

        let mut cfg = ModelConfig {
            arch,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rotary_dim,
            vocab_size,
            max_position_embeddings,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            tie_word_embeddings,
            qkv_bias,
            o_bias,
            mlp_bias,
            qk_norm: match arch {
                Arch::Qwen3 | Arch::Qwen3Moe => QkNorm::PerHead,
                a if a.is_hybrid() => QkNorm::PerHead,
                Arch::Glm4Moe if hf.use_qk_norm.unwrap_or(false) => QkNorm::PerHead,
                Arch::Olmoe => QkNorm::Whole,
                _ => QkNorm::None,
            },
            clip_qkv: match (arch, hf.clip_qkv) {
                (Arch::Olmoe, Some(c)) => Some(c as f32),
                _ => None,
            },
            moe: None,
            mla,
            linear: None,
            norm_offset: arch.is_hybrid(),
            attn_output_gate: arch.is_hybrid(),
            extra_layers,
            attn_sinks: arch == Arch::GptOss,
            sliding_window: Vec::new(),
            bos_token_id: None,
            eos_token_ids: Vec::new(),
            quant,
        };
        // The per-layer lists are sized by num_layers: only once it is in range.
        cfg.check_scalars().map_err(err)?;
        cfg.sliding_window = sliding_windows(hf, arch, num_layers).map_err(err)?;
        cfg.moe = moe(hf, arch, num_layers, intermediate_size).map_err(err)?;
        cfg.linear = linear_attn(hf, arch, num_layers).map_err(err)?;
        cfg.bos_token_id = token_ids(hf.bos_token_id.as_ref(), "bos_token_id", vocab_size, path)
            .first()
            .copied();
        cfg.eos_token_ids = token_ids(hf.eos_token_id.as_ref(), "eos_token_id", vocab_size, path);
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Checks every value against [`limits`] and the rules the arithmetic needs:
    /// sizes and counts in range, `num_attention_heads` a multiple of
    /// `num_key_value_heads`, an even `head_dim`, `rms_norm_eps` and `rope_theta`
    /// positive and finite in float32, rope scaling parameters in range, finite rotary
    /// angles at every position below `max_position_embeddings`, one attention window
    /// per layer, special token ids inside the vocabulary. `path` names the config in
    /// the error. Nothing is allocated in proportion to any value checked.
    pub fn validate(&self, path: &Path) -> Result<(), VoomError> {
        self.check_scalars()
            .and_then(|()| self.check_lists())
            .map_err(|detail| VoomError::Config {
                path: path.to_path_buf(),
                detail,
            })
    }

    /// Everything but the per-layer and token lists.
    fn check_scalars(&self) -> Result<(), String> {
        within("num_hidden_layers", self.num_layers, 1, limits::LAYERS)?;
        within("hidden_size", self.hidden_size, 1, limits::WIDTH)?;
        within(
            "intermediate_size",
            self.intermediate_size,
            1,
            limits::WIDTH,
        )?;
        within("num_attention_heads", self.num_heads, 1, limits::HEADS)?;
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(format!(
                "'num_attention_heads' {} is not a multiple of 'num_key_value_heads' {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        within("head_dim", self.head_dim, 2, limits::HEAD_DIM)?;
        if self.mla.is_none() && !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "'head_dim' {} must be even for rotary embeddings",
                self.head_dim
            ));
        }
        within("rotary dimensions", self.rotary_dim, 2, self.head_dim)?;
        if !self.rotary_dim.is_multiple_of(2) {
            return Err(format!(
                "{} rotary dimensions (of 'head_dim' {}): they must be even",
                self.rotary_dim, self.head_dim
            ));
        }
        within(
            "num_nextn_predict_layers",
            self.extra_layers,
            0,
            limits::LAYERS,
        )?;
        if let Some(m) = &self.mla {
            if let Some(q) = m.q_lora_rank {
                within("q_lora_rank", q, 1, limits::WIDTH)?;
            }
            within("kv_lora_rank", m.kv_lora_rank, 1, limits::WIDTH)?;
            within("qk_rope_head_dim", m.qk_rope_head_dim, 2, limits::HEAD_DIM)?;
            within("qk_nope_head_dim", m.qk_nope_head_dim, 0, limits::HEAD_DIM)?;
            within("v_head_dim", m.v_head_dim, 1, limits::HEAD_DIM)?;
            if m.qk_nope_head_dim + m.qk_rope_head_dim != self.head_dim
                || m.qk_rope_head_dim != self.rotary_dim
            {
                return Err(format!(
                    "MLA head widths (nope {} + rope {}) disagree with head_dim {} and rotary dimensions {}",
                    m.qk_nope_head_dim, m.qk_rope_head_dim, self.head_dim, self.rotary_dim
                ));
            }
            for (key, x) in [
                (
                    "num_attention_heads × (kv_lora_rank + qk_rope_head_dim)",
                    m.kv_lora_rank + m.qk_rope_head_dim,
                ),
                ("num_attention_heads × v_head_dim", m.v_head_dim),
                (
                    "num_attention_heads × (qk_nope_head_dim + v_head_dim)",
                    m.qk_nope_head_dim + m.v_head_dim,
                ),
            ] {
                if !matches!(self.num_heads.checked_mul(x), Some(w) if w <= limits::WIDTH) {
                    return Err(format!(
                        "'{key}' exceeds the largest width, {}",
                        limits::WIDTH
                    ));
                }
            }
            positive_finite("MLA softmax scale", m.softmax_scale)?;
        }
        if !matches!(self.num_heads.checked_mul(self.head_dim), Some(w) if w <= limits::WIDTH) {
            return Err(format!(
                "'num_attention_heads' {} × 'head_dim' {} exceeds the largest attention width, {}",
                self.num_heads,
                self.head_dim,
                limits::WIDTH
            ));
        }
        within("vocab_size", self.vocab_size, 1, limits::VOCAB)?;
        within(
            "max_position_embeddings",
            self.max_position_embeddings,
            1,
            limits::POSITIONS,
        )?;
        positive_finite("rms_norm_eps", self.rms_norm_eps)?;
        positive_finite("rope_theta", self.rope_theta)?;
        if let RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } = self.rope_scaling
        {
            positive_finite("rope_scaling.factor", factor)?;
            positive_finite("rope_scaling.low_freq_factor", low_freq_factor)?;
            positive_finite("rope_scaling.high_freq_factor", high_freq_factor)?;
            if high_freq_factor <= low_freq_factor {
                return Err(format!(
                    "'rope_scaling.high_freq_factor' {high_freq_factor} must be greater than 'rope_scaling.low_freq_factor' {low_freq_factor}"
                ));
            }
            within(
                "rope_scaling.original_max_position_embeddings",
                original_max_position_embeddings,
                1,
                limits::POSITIONS,
            )?;
        }
        if let RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            ..
        } = self.rope_scaling
        {
            positive_finite("rope_scaling.factor", factor as f32)?;
            positive_finite("rope_scaling.attention_factor", attention_factor as f32)?;
            for (key, b) in [("beta_fast", beta_fast), ("beta_slow", beta_slow)] {
                if !b.is_finite() {
                    return Err(format!("'rope_scaling.{key}' {b} must be finite"));
                }
            }
            within(
                "rope_scaling.original_max_position_embeddings",
                original_max_position_embeddings,
                1,
                limits::POSITIONS,
            )?;
        }
        self.check_rotary_angles()
    }

    /// The factor transformers multiplies rotary cos and sin by (YaRN's
    /// `attention_factor`; 1 otherwise), as float32.
    pub fn rope_attention_factor(&self) -> f32 {
        match self.rope_scaling {
            RopeScaling::Yarn {
                attention_factor, ..
            } => attention_factor as f32,
            _ => 1.0,
        }
    }

    /// The config of extra layer `j` (multi-token prediction, stored as decoder layer
    /// `num_layers + j`) computed on its own: one layer, with that layer's mixture
    /// flag and attention window, and none extra. `None` past the extra layers.
    pub fn extra_layer(&self, j: usize) -> Option<ModelConfig> {
        if j >= self.extra_layers {
            return None;
        }
        let at = self.num_layers + j;
        let mut cfg = self.clone();
        cfg.num_layers = 1;
        cfg.extra_layers = 0;
        if let Some(m) = cfg.moe.as_mut() {
            m.sparse = vec![m.sparse[at]];
        }
        cfg.sliding_window = vec![self.sliding_window.get(at).copied().flatten()];
        Some(cfg)
    }

    /// Inverse frequencies of the rotary embedding, `rotary_dim / 2` of them,
    /// computed as transformers computes them in float32 (with the `llama3` or `yarn`
    /// scaling).
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let cfg = self;
        let dim = cfg.rotary_dim;
        let base = cfg.rope_theta;
        // transformers: 1.0 / (base ** (arange(0, dim, 2).float() / dim)), in float32.
        let plain: Vec<f32> = (0..dim / 2)
            .map(|i| 1.0f32 / base.powf((2 * i) as f32 / dim as f32))
            .collect();
        match &cfg.rope_scaling {
            RopeScaling::Default => plain,
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => yarn_inv_freq(
                dim,
                base,
                *factor,
                *original_max_position_embeddings,
                *beta_fast,
                *beta_slow,
                *truncate,
            ),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                // transformers' _compute_llama3_parameters.
                let old_ctx = *original_max_position_embeddings as f32;
                let low_freq_wavelen = old_ctx / low_freq_factor;
                let high_freq_wavelen = old_ctx / high_freq_factor;
                plain
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        let scaled = if wavelen > low_freq_wavelen {
                            f / factor
                        } else {
                            f
                        };
                        // wavelen is finite and positive, so this is transformers' `~(w < high) & ~(w > low)`.
                        let is_medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
                        if is_medium {
                            let smooth = (old_ctx / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        } else {
                            scaled
                        }
                    })
                    .collect()
            }
        }
    }

    /// Every rotary frequency finite and non-negative, and so is its angle at the last
    /// position (a tiny `rope_theta` or scaling factor can overflow float32 there).
    fn check_rotary_angles(&self) -> Result<(), String> {
        let last = (self.max_position_embeddings - 1) as f32;
        let inv_freq = self.rope_inv_freq();
        match inv_freq
            .iter()
            .enumerate()
            .find(|(_, &f)| !(f >= 0.0 && f.is_finite() && (f * last).is_finite()))
        {
            None => Ok(()),
            Some((i, f)) => Err(format!(
                "'rope_theta' {} with rope scaling {:?} gives rotary frequency {i} of {f}: its angle is not finite at every position below 'max_position_embeddings' {}",
                self.rope_theta, self.rope_scaling, self.max_position_embeddings
            )),
        }
    }

    /// The attention windows (one per layer) and the special token ids.
    fn check_lists(&self) -> Result<(), String> {
        if self.sliding_window.len() != self.num_layers {
            return Err(format!(
                "{} attention windows for {} layers ('num_hidden_layers')",
                self.sliding_window.len(),
                self.num_layers
            ));
        }
        if let Some(i) = self.sliding_window.iter().position(|w| *w == Some(0)) {
            return Err(format!("the sliding window of layer {i} is 0"));
        }
        if let Some(m) = &self.moe {
            within("num_experts", m.num_experts, 1, limits::EXPERTS)?;
            within("num_experts_per_tok", m.top_k, 1, m.num_experts)?;
            within(
                "moe_intermediate_size",
                m.expert_intermediate_size,
                1,
                limits::WIDTH,
            )?;
            if m.sparse.len() != self.num_layers + self.extra_layers {
                return Err(format!(
                    "{} expert-layer flags for {} layers ('num_hidden_layers') and {} extra",
                    m.sparse.len(),
                    self.num_layers,
                    self.extra_layers
                ));
            }
        }
        if let Some(c) = self.clip_qkv {
            positive_finite("clip_qkv", c)?;
        }
        for (key, id) in self
            .bos_token_id
            .iter()
            .map(|id| ("bos_token_id", id))
            .chain(self.eos_token_ids.iter().map(|id| ("eos_token_id", id)))
        {
            if *id as usize >= self.vocab_size {
                return Err(format!(
                    "'{key}' {id} is outside the vocabulary (0..{})",
                    self.vocab_size
                ));
            }
        }
        Ok(())
    }
}

/// `rope_scaling` (or `rope_parameters`): `max_position_embeddings` and a top-level
/// `original_max_position_embeddings` are the defaults transformers fills in.
fn parse_rope_scaling(
    s: &Value,
    max_position_embeddings: usize,
    top_level_original: Option<usize>,
) -> Result<RopeScaling, String> {
    let obj = s
        .as_object()
        .ok_or_else(|| "'rope_scaling' must be an object".to_string())?;
    let ty = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |k: &str| -> Result<f64, String> {
        obj.get(k)
            .and_then(Value::as_f64)
            .ok_or_else(|| format!("rope scaling '{ty}' needs a numeric '{k}'"))
    };
    let optional = |k: &str| -> Result<Option<f64>, String> {
        match obj.get(k).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                format!(
                    "rope scaling '{ty}': '{k}' must be a number, got {}",
                    quote(v)
                )
            }),
        }
    };
    // An integer; an integral float such as 8192.0 is read as before.
    let integral = |v: &Value| {
        as_count(v).or_else(|| {
            v.as_f64()
                .filter(|x| x.fract() == 0.0 && (0.0..=(1u64 << 53) as f64).contains(x))
                .map(|x| x as usize)
        })
    };
    match ty {
        "default" => Ok(RopeScaling::Default),
        "yarn" => {
            let key = "original_max_position_embeddings";
            // transformers: a top-level value wins, else the one given here, else
            // max_position_embeddings.
            let original = match (top_level_original, obj.get(key).filter(|v| !v.is_null())) {
                (Some(o), _) => o,
                (None, Some(v)) => integral(v).ok_or_else(|| {
                    format!(
                        "rope scaling 'yarn' needs a non-negative integer '{key}', got {}",
                        quote(v)
                    )
                })?,
                (None, None) => max_position_embeddings,
            };
            if original == 0 {
                return Err(format!("rope scaling 'yarn': '{key}' must be positive"));
            }
            let factor =
                optional("factor")?.unwrap_or(max_position_embeddings as f64 / original as f64);
            let mscale = optional("mscale")?;
            let mscale_all_dim = optional("mscale_all_dim")?;
            let attention_factor = match optional("attention_factor")? {
                Some(a) => a,
                None => match (mscale, mscale_all_dim) {
                    (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                        yarn_mscale(factor, m) / yarn_mscale(factor, a)
                    }
                    _ => yarn_mscale(factor, 1.0),
                },
            };
            // `or` as transformers: a 0 takes the default too.
            let beta_fast = optional("beta_fast")?.filter(|&b| b != 0.0).unwrap_or(32.0);
            let beta_slow = optional("beta_slow")?.filter(|&b| b != 0.0).unwrap_or(1.0);
            let truncate = match obj.get("truncate").filter(|v| !v.is_null()) {
                None => true,
                Some(v) => v.as_bool().ok_or_else(|| {
                    format!(
                        "rope scaling 'yarn': 'truncate' must be true or false, got {}",
                        quote(v)
                    )
                })?,
            };
            Ok(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast,
                beta_slow,
                attention_factor,
                mscale_all_dim,
                truncate,
            })
        }
        "llama3" => {
            let factor = num("factor")?;
            let low = num("low_freq_factor")?;
            let high = num("high_freq_factor")?;
            let key = "original_max_position_embeddings";
            let orig = obj.get(key).and_then(integral).ok_or_else(|| {
                format!(
                    "rope scaling 'llama3' needs a non-negative integer '{key}', got {}",
                    obj.get(key).map_or("nothing".into(), quote)
                )
            })?;
            // Ranges are checked by ModelConfig::validate, on the float32 values.
            Ok(RopeScaling::Llama3 {
                factor: factor as f32,
                low_freq_factor: low as f32,
                high_freq_factor: high as f32,
                original_max_position_embeddings: orig,
            })
        }
        other => Err(format!(
            "unsupported rope scaling type '{other}' (supported: default, llama3, yarn)"
        )),
    }
}

/// YaRN's magnitude correction for a context `factor` (transformers' `get_mscale`,
/// in float64).
fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * mscale * factor.ln() + 1.0
    }
}

/// YaRN's inverse frequencies over `dim` rotary dimensions, in float32 as
/// transformers' `_compute_yarn_parameters` computes them (its correction range in
/// float64).
fn yarn_inv_freq(
    dim: usize,
    base: f32,
    factor: f64,
    original: usize,
    beta_fast: f64,
    beta_slow: f64,
    truncate: bool,
) -> Vec<f32> {
    let half = dim / 2;
    let b = base as f64;
    let correction_dim = |rotations: f64| {
        (dim as f64 * (original as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln())
            / (2.0 * b.ln())
    };
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if truncate {
        low = low.floor();
        high = high.ceil();
    }
    let low = low.max(0.0);
    let mut high = high.min((dim - 1) as f64);
    if low == high {
        high += 0.001;
    }
    let (low32, span) = (low as f32, (high - low) as f32);
    let factor = factor as f32;
    (0..half)
        .map(|i| {
            let pos_freq = base.powf((2 * i) as f32 / dim as f32);
            let extrapolation = 1.0f32 / pos_freq;
            let interpolation = 1.0f32 / (factor * pos_freq);
            let ramp = ((i as f32 - low32) / span).clamp(0.0, 1.0);
            let extrapolation_factor = 1.0f32 - ramp;
            interpolation * (1.0f32 - extrapolation_factor) + extrapolation * extrapolation_factor
        })
        .collect()
}

/// Multi-head latent attention's widths (transformers' DeepseekV3Config defaults
/// where a key is absent; `q_lora_rank` null means a plain `q_proj`), each in range
/// before anything adds them. (A `partial_rotary_factor` is refused with the other
/// families', where the rotary dimensions are chosen.)
fn mla(hf: &HfConfig) -> Result<Mla, String> {
    let m = mla_widths(hf)?;
    within("kv_lora_rank", m.kv_lora_rank, 1, limits::WIDTH)?;
    within("qk_nope_head_dim", m.qk_nope_head_dim, 0, limits::HEAD_DIM)?;
    within("qk_rope_head_dim", m.qk_rope_head_dim, 2, limits::HEAD_DIM)?;
    within("v_head_dim", m.v_head_dim, 1, limits::HEAD_DIM)?;
    Ok(m)
}

fn mla_widths(hf: &HfConfig) -> Result<Mla, String> {
    let positive = |v: Option<usize>, key: &str, default: usize| match v {
        Some(0) => Err(format!("'{key}' must be positive")),
        Some(x) => Ok(x),
        None => Ok(default),
    };
    Ok(Mla {
        q_lora_rank: match (hf.q_lora_rank, hf.q_lora_rank_given) {
            (Some(0), _) => return Err("'q_lora_rank' must be positive or null".into()),
            (Some(r), _) => {
                within("q_lora_rank", r, 1, limits::WIDTH)?;
                Some(r)
            }
            (None, true) => None,
            (None, false) => Some(1536),
        },
        kv_lora_rank: positive(hf.kv_lora_rank, "kv_lora_rank", 512)?,
        qk_nope_head_dim: hf.qk_nope_head_dim.unwrap_or(128),
        qk_rope_head_dim: positive(hf.qk_rope_head_dim, "qk_rope_head_dim", 64)?,
        v_head_dim: positive(hf.v_head_dim, "v_head_dim", 128)?,
        rope_interleave: hf.rope_interleave.unwrap_or(true),
        // Set once the rope scaling is known.
        softmax_scale: 1.0,
    })
}

/// The mixture of experts of an `arch` config, checked: `None` for a dense one.
fn moe(
    hf: &HfConfig,
    arch: Arch,
    num_layers: usize,
    intermediate_size: usize,
) -> Result<Option<Moe>, String> {
    match arch {
        Arch::Qwen3Moe | Arch::Olmoe | Arch::Mixtral | Arch::GptOss => {}
        Arch::Glm4Moe | Arch::DeepseekV3 => return grouped_moe(hf, arch, num_layers).map(Some),
        Arch::Qwen3Next | Arch::Qwen35Moe => return gated_shared_moe(hf, arch, num_layers),
        Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen35 => return Ok(None),
    }
    if hf.shared_expert_intermediate_size.is_some_and(|n| n > 0) {
        return Err("shared experts ('shared_expert_intermediate_size') are not supported".into());
    }
    // transformers maps `num_local_experts` and `num_experts` to one attribute.
    let num_experts = match (hf.num_experts, hf.num_local_experts) {
        (Some(a), Some(b)) if a != b => {
            return Err(format!(
                "'num_experts' {a} and 'num_local_experts' {b} disagree"
            ))
        }
        (Some(n), _) | (None, Some(n)) => n,
        (None, None) => match arch {
            Arch::Qwen3Moe | Arch::GptOss => 128,
            Arch::Olmoe => 64,
            _ => 8,
        },
    };
    within("num_experts", num_experts, 1, limits::EXPERTS)?;
    let top_k = hf.num_experts_per_tok.unwrap_or(match arch {
        Arch::Mixtral => 2,
        Arch::GptOss => 4,
        _ => 8,
    });
    within("num_experts_per_tok", top_k, 1, num_experts)?;
    let expert_intermediate_size = match arch {
        Arch::Qwen3Moe => hf.moe_intermediate_size.unwrap_or(768),
        _ => intermediate_size,
    };
    within(
        "moe_intermediate_size",
        expert_intermediate_size,
        1,
        limits::WIDTH,
    )?;
    let norm_topk_prob = match arch {
        Arch::Mixtral => true,
        _ => hf.norm_topk_prob.unwrap_or(false),
    };
    let sparse = match arch {
        Arch::Qwen3Moe => sparse_layers(hf, num_layers)?,
        _ => vec![true; num_layers],
    };
    let gpt_oss = arch == Arch::GptOss;
    let gate = match gpt_oss {
        // transformers: alpha 1.702 always; the limit is the released config's
        // `swiglu_limit` (7.0, transformers' own constant).
        true => {
            let limit = hf.swiglu_limit.unwrap_or(7.0);
            let l = limit as f32;
            if !(l.is_finite() && l > 0.0) {
                return Err(format!(
                    "'swiglu_limit' {limit} must be positive and finite in float32"
                ));
            }
            ExpertGate::Clamped {
                alpha: 1.702,
                limit: l,
            }
        }
        false => ExpertGate::Silu,
    };
    Ok(Some(Moe {
        num_experts,
        top_k,
        expert_intermediate_size,
        norm_topk_prob: norm_topk_prob && !gpt_oss,
        sparse,
        scoring: match gpt_oss {
            true => Scoring::TopKSoftmax,
            false => Scoring::Softmax,
        },
        routed_scaling_factor: 1.0,
        shared_intermediate_size: 0,
        shared_gate: false,
        router_bias: gpt_oss,
        gate,
    }))
}

/// The language model's config of a vision-language checkpoint as Qwen3.5 is
/// released (`model_type` `qwen3_5` or `qwen3_5_moe`: the text model's keys under
/// `text_config`, its weights under `model.language_model.`): `text_config`, with
/// the top level's `tie_word_embeddings` (the head's, which the outer model owns)
/// and token ids where the text config lacks them. Any other config as it is.
fn language_model(v: Value) -> Result<Value, String> {
    let outer = match v.get("model_type").and_then(Value::as_str) {
        Some("qwen3_5") => "qwen3_5_text",
        Some("qwen3_5_moe") => "qwen3_5_moe_text",
        _ => return Ok(v),
    };
    let mut text = match v.get("text_config") {
        Some(Value::Object(t)) => t.clone(),
        Some(other) => {
            return Err(format!(
                "'text_config' must be an object, got {}",
                quote(other)
            ))
        }
        None => {
            return Err(format!(
                "a '{}' config needs 'text_config'",
                v["model_type"].as_str().unwrap_or_default()
            ))
        }
    };
    match text.get("model_type").and_then(Value::as_str) {
        None => {
            text.insert("model_type".into(), Value::from(outer));
        }
        Some(t) if t == outer => {}
        Some(t) => return Err(format!("'text_config.model_type' is '{t}', not '{outer}'")),
    }
    for key in ["tie_word_embeddings", "bos_token_id", "eos_token_id"] {
        if let Some(x) = v.get(key).filter(|x| !x.is_null()) {
            if key == "tie_word_embeddings" || !text.contains_key(key) {
                text.insert(key.into(), x.clone());
            }
        }
    }
    Ok(Value::Object(text))
}

/// The sparse layers of `num_layers` by `decoder_sparse_step` and `mlp_only_layers`
/// (qwen3_moe's and qwen3_next's rule: layer `i` routes unless listed, when `i + 1`
/// is a multiple of the step).
fn sparse_layers(hf: &HfConfig, num_layers: usize) -> Result<Vec<bool>, String> {
    let step = hf.decoder_sparse_step.unwrap_or(1);
    within("decoder_sparse_step", step, 1, limits::LAYERS)?;
    let mut dense = vec![false; num_layers];
    for &l in hf.mlp_only_layers.as_deref().unwrap_or_default() {
        if l >= num_layers {
            return Err(format!("'mlp_only_layers' names layer {l} of {num_layers}"));
        }
        dense[l] = true;
    }
    Ok((0..num_layers)
        .map(|i| !dense[i] && (i + 1) % step == 0)
        .collect())
}

/// qwen3_next's and qwen3_5_moe's experts (transformers' defaults for absent keys):
/// softmax routing, one shared expert gated by a sigmoid. qwen3_5_moe routes in
/// every layer and always renormalises.
fn gated_shared_moe(hf: &HfConfig, arch: Arch, num_layers: usize) -> Result<Option<Moe>, String> {
    let num_experts = hf.num_experts.unwrap_or(512);
    if num_experts == 0 {
        return Ok(None);
    }
    within("num_experts", num_experts, 1, limits::EXPERTS)?;
    let top_k = hf.num_experts_per_tok.unwrap_or(10);
    within("num_experts_per_tok", top_k, 1, num_experts)?;
    let inter = hf.moe_intermediate_size.unwrap_or(512);
    within("moe_intermediate_size", inter, 1, limits::WIDTH)?;
    let shared = hf.shared_expert_intermediate_size.unwrap_or(512);
    within("shared_expert_intermediate_size", shared, 1, limits::WIDTH)?;
    let (norm_topk_prob, sparse) = match arch {
        Arch::Qwen35Moe => (true, vec![true; num_layers]),
        _ => (
            hf.norm_topk_prob.unwrap_or(true),
            sparse_layers(hf, num_layers)?,
        ),
    };
    Ok(Some(Moe {
        num_experts,
        top_k,
        expert_intermediate_size: inter,
        norm_topk_prob,
        sparse,
        scoring: Scoring::Softmax,
        routed_scaling_factor: 1.0,
        shared_intermediate_size: shared,
        shared_gate: true,
        router_bias: false,
        gate: ExpertGate::Silu,
    }))
}

/// A hybrid's linear-attention layers (transformers' defaults for absent keys): the
/// layer pattern from `layer_types`, or every `full_attention_interval`-th layer
/// full attention (4 by default).
fn linear_attn(hf: &HfConfig, arch: Arch, num_layers: usize) -> Result<Option<LinearAttn>, String> {
    if !arch.is_hybrid() {
        return Ok(None);
    }
    let conv_kernel = hf.linear_conv_kernel_dim.unwrap_or(4);
    within("linear_conv_kernel_dim", conv_kernel, 1, 64)?;
    let key_head_dim = hf.linear_key_head_dim.unwrap_or(128);
    within("linear_key_head_dim", key_head_dim, 1, limits::HEAD_DIM)?;
    let value_head_dim = hf.linear_value_head_dim.unwrap_or(128);
    within("linear_value_head_dim", value_head_dim, 1, limits::HEAD_DIM)?;
    let num_key_heads = hf.linear_num_key_heads.unwrap_or(16);
    within("linear_num_key_heads", num_key_heads, 1, limits::HEADS)?;
    let num_value_heads = hf.linear_num_value_heads.unwrap_or(32);
    within("linear_num_value_heads", num_value_heads, 1, limits::HEADS)?;
    if !num_value_heads.is_multiple_of(num_key_heads) {
        return Err(format!(
            "'linear_num_value_heads' {num_value_heads} is not a multiple of \
             'linear_num_key_heads' {num_key_heads}"
        ));
    }
    let layers = match &hf.layer_types {
        Some(types) => types.iter().map(|t| t == "linear_attention").collect(),
        None => {
            let every = hf.full_attention_interval.unwrap_or(4);
            within("full_attention_interval", every, 1, limits::LAYERS)?;
            (0..num_layers).map(|i| (i + 1) % every != 0).collect()
        }
    };
    let projections = match arch {
        Arch::Qwen3Next => LinearProjections::Grouped,
        _ => LinearProjections::Split,
    };
    let l = LinearAttn {
        conv_kernel,
        key_head_dim,
        value_head_dim,
        num_key_heads,
        num_value_heads,
        layers,
        projections,
    };
    for (what, w) in [
        ("convolution channels", l.conv_dim()),
        (
            "'linear_num_value_heads' × 'linear_value_head_dim'",
            l.value_dim(),
        ),
    ] {
        within(what, w, 1, limits::WIDTH)?;
    }
    Ok(Some(l))
}

/// deepseek_v3's and glm4_moe's experts (transformers' defaults for absent keys):
/// sigmoid scores with the correction bias, group-limited choice, shared experts,
/// dense first layers. A routing option these do not compute is an error naming it.
fn grouped_moe(hf: &HfConfig, arch: Arch, num_layers: usize) -> Result<Moe, String> {
    let ds = arch == Arch::DeepseekV3;
    // The multi-token-prediction layers after the decoder's follow the same rule.
    let extra = hf.num_nextn_predict_layers.unwrap_or(0);
    within("num_nextn_predict_layers", extra, 0, limits::LAYERS)?;
    if let Some(f) = hf.scoring_func.as_deref().filter(|&f| f != "sigmoid") {
        return Err(format!(
            "unsupported 'scoring_func' '{f}' for {} (supported: sigmoid)",
            arch.name()
        ));
    }
    if let Some(m) = hf.topk_method.as_deref().filter(|&m| m != "noaux_tc") {
        return Err(format!(
            "unsupported 'topk_method' '{m}' for {} (supported: noaux_tc)",
            arch.name()
        ));
    }
    if let Some(f) = hf.moe_layer_freq.filter(|&f| f != 1) {
        return Err(format!("unsupported 'moe_layer_freq' {f} (supported: 1)"));
    }
    let num_experts = match (hf.n_routed_experts, hf.num_local_experts) {
        (Some(a), Some(b)) if a != b => {
            return Err(format!(
                "'n_routed_experts' {a} and 'num_local_experts' {b} disagree"
            ))
        }
        (Some(n), _) | (None, Some(n)) => n,
        (None, None) => {
            if ds {
                256
            } else {
                128
            }
        }
    };
    within("n_routed_experts", num_experts, 1, limits::EXPERTS)?;
    let top_k = hf.num_experts_per_tok.unwrap_or(8);
    within("num_experts_per_tok", top_k, 1, num_experts)?;
    let inter = hf
        .moe_intermediate_size
        .unwrap_or(if ds { 2048 } else { 1408 });
    within("moe_intermediate_size", inter, 1, limits::WIDTH)?;
    let shared = hf.n_shared_experts.unwrap_or(1);
    let shared_intermediate_size = inter
        .checked_mul(shared)
        .filter(|&w| w <= limits::WIDTH)
        .ok_or_else(|| {
            format!("'moe_intermediate_size' {inter} × 'n_shared_experts' {shared} is too wide")
        })?;
    let n_group = hf.n_group.unwrap_or(if ds { 8 } else { 1 });
    let topk_group = hf.topk_group.unwrap_or(if ds { 4 } else { 1 });
    within("n_group", n_group, 1, num_experts)?;
    if !num_experts.is_multiple_of(n_group) || num_experts / n_group < 2 {
        return Err(format!(
            "'n_routed_experts' {num_experts} must be 'n_group' {n_group} groups of at least two experts"
        ));
    }
    within("topk_group", topk_group, 1, n_group)?;
    if top_k > topk_group * (num_experts / n_group) {
        return Err(format!(
            "'num_experts_per_tok' {top_k} is more than the {} experts of 'topk_group' {topk_group} groups",
            topk_group * (num_experts / n_group)
        ));
    }
    let scale = hf
        .routed_scaling_factor
        .unwrap_or(if ds { 2.5 } else { 1.0 }) as f32;
    positive_finite("routed_scaling_factor", scale)?;
    let first_dense = hf.first_k_dense_replace.unwrap_or(if ds { 3 } else { 1 });
    Ok(Moe {
        num_experts,
        top_k,
        expert_intermediate_size: inter,
        norm_topk_prob: hf.norm_topk_prob.unwrap_or(true),
        sparse: (0..num_layers + extra).map(|i| i >= first_dense).collect(),
        scoring: Scoring::SigmoidGroups {
            n_group,
            topk_group,
        },
        routed_scaling_factor: scale,
        shared_intermediate_size,
        shared_gate: false,
        router_bias: false,
        gate: ExpertGate::Silu,
    })
}

fn sliding_windows(
    hf: &HfConfig,
    arch: Arch,
    num_layers: usize,
) -> Result<Vec<Option<usize>>, String> {
    let window = match &hf.sliding_window {
        // transformers' default for gpt-oss (null there is no window).
        None if arch == Arch::GptOss => Some(128),
        None | Some(Value::Null) => None,
        Some(v) => Some(as_count(v).filter(|&w| w > 0).ok_or_else(|| {
            format!(
                "'sliding_window' must be a positive integer or null, got {}",
                quote(v)
            )
        })?),
    };
    if let Some(types) = &hf.layer_types {
        if types.len() != num_layers {
            return Err(format!(
                "'layer_types' has {} entries for {num_layers} layers",
                types.len()
            ));
        }
        return types
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                "full_attention" => Ok(None),
                // A hybrid's recurrent layers ([`LinearAttn`]) hold no keys to window.
                "linear_attention" if arch.is_hybrid() => Ok(None),
                "sliding_attention" => window.map(Some).ok_or_else(|| {
                    format!("layer {i} is 'sliding_attention' but 'sliding_window' is not set")
                }),
                other => Err(format!("unsupported layer type '{other}' at layer {i}")),
            })
            .collect();
    }
    match arch {
        // Mistral and Mixtral apply their window on every layer.
        Arch::Mistral | Arch::Mixtral => Ok(vec![window; num_layers]),
        // Qwen3-MoE keeps the window only with use_sliding_window, on every layer; no
        // released checkpoint sets it, and transformers' own handling of it is not one
        // vOOM has reference outputs for.
        Arch::Qwen3Moe => match (hf.use_sliding_window.unwrap_or(false), window) {
            (true, Some(_)) => {
                Err("'use_sliding_window' true is not supported for qwen3_moe".into())
            }
            _ => Ok(vec![None; num_layers]),
        },
        Arch::Olmoe | Arch::Glm4Moe | Arch::DeepseekV3 => Ok(vec![None; num_layers]),
        // transformers' hybrids have no sliding window.
        Arch::Qwen3Next | Arch::Qwen35 | Arch::Qwen35Moe => Ok(vec![None; num_layers]),
        // Qwen2/3 apply a window only with use_sliding_window, from max_window_layers on.
        Arch::Qwen2 | Arch::Qwen3 => {
            if hf.use_sliding_window.unwrap_or(false) {
                let w =
                    window.ok_or("'use_sliding_window' is true but 'sliding_window' is not set")?;
                let from = hf.max_window_layers.unwrap_or(num_layers);
                Ok((0..num_layers).map(|i| (i >= from).then_some(w)).collect())
            } else {
                Ok(vec![None; num_layers])
            }
        }
        Arch::Llama => Ok(vec![None; num_layers]),
        // transformers: layers 0, 2, 4, ... slide, the others attend to everything.
        Arch::GptOss => Ok((0..num_layers)
            .map(|i| if i % 2 == 0 { window } else { None })
            .collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let json = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 8, "max_position_embeddings": 256,
            "rope_theta": 10000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}"#;
        let cfg = ModelConfig::from_json(json, Path::new("c")).unwrap();
        let mut plain_cfg = cfg.clone();
        plain_cfg.rope_scaling = RopeScaling::Default;
        let (s, p) = (cfg.rope_inv_freq(), plain_cfg.rope_inv_freq());
        assert_eq!(s[0], p[0]);
        let last = p.len() - 1;
        assert_eq!(s[last], p[last] / 8.0);
    }

    fn parse(json: &str) -> Result<ModelConfig, VoomError> {
        ModelConfig::from_json(json, Path::new("config.json"))
    }

    fn hybrid_fixture(case: &str) -> ModelConfig {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny_hybrid");
        ModelConfig::from_dir(&dir.join(case)).unwrap()
    }

    /// The hybrid fixtures' configs: the released qwen3_next form (top-level rope,
    /// `full_attention_interval`), explicit `layer_types`, and qwen3_5's text models
    /// (M-RoPE sections, projections apart, experts in every layer).
    #[test]
    fn hybrid_configs_give_their_layers_heads_and_experts() {
        let c = hybrid_fixture("qwen3_next_moe_legacy_config");
        assert_eq!(c.arch, Arch::Qwen3Next);
        assert!(c.norm_offset && c.attn_output_gate && c.qk_norm == QkNorm::PerHead);
        assert_eq!((c.head_dim, c.rotary_dim, c.rope_theta), (32, 8, 10000.0));
        let l = c.linear.as_ref().unwrap();
        assert_eq!(l.layers, vec![true, true, true, false]);
        assert_eq!(l.projections, LinearProjections::Grouped);
        assert_eq!(
            (
                l.num_key_heads,
                l.num_value_heads,
                l.key_head_dim,
                l.value_head_dim
            ),
            (2, 4, 16, 16)
        );
        assert_eq!(
            (l.conv_dim(), l.state_shape().conv, l.state_shape().matrix),
            (128, 3 * 128, 4 * 16 * 16)
        );
        let m = c.moe.as_ref().unwrap();
        assert_eq!(
            (m.num_experts, m.top_k, m.norm_topk_prob, m.shared_gate),
            (8, 2, true, true)
        );
        assert_eq!(
            (m.expert_intermediate_size, m.shared_intermediate_size),
            (32, 48)
        );
        assert_eq!(m.sparse, vec![true; 4]);
        assert_eq!(c.sliding_window, vec![None; 4]);

        let c = hybrid_fixture("qwen3_next_ratio1_dense_layer_tied");
        let l = c.linear.as_ref().unwrap();
        assert_eq!(l.layers, vec![true, false, true]);
        assert_eq!(
            (l.conv_kernel, l.value_head_dim, l.num_value_heads),
            (3, 24, 2)
        );
        assert_eq!((c.head_dim, c.rotary_dim, c.num_kv_heads), (16, 8, 1));
        let m = c.moe.as_ref().unwrap();
        assert_eq!(
            (m.sparse.clone(), m.norm_topk_prob, m.top_k),
            (vec![true, false, true], false, 3)
        );
        assert!(c.tie_word_embeddings);

        let c = hybrid_fixture("qwen3_5_text_dense");
        assert_eq!(c.arch, Arch::Qwen35);
        assert!(c.moe.is_none() && c.norm_offset && c.attn_output_gate);
        let l = c.linear.as_ref().unwrap();
        assert_eq!(l.projections, LinearProjections::Split);
        assert_eq!(l.layers, vec![true, true, false, true, false]);
        assert_eq!(c.rotary_dim, 8);

        let c = hybrid_fixture("qwen3_5_moe_text");
        assert_eq!(c.arch, Arch::Qwen35Moe);
        assert_eq!(
            c.linear.as_ref().unwrap().layers,
            vec![true, false, true, false]
        );
        let m = c.moe.as_ref().unwrap();
        assert_eq!(
            (m.sparse.clone(), m.norm_topk_prob, m.shared_gate),
            (vec![true; 4], true, true)
        );
        assert_eq!(c.intermediate_size, 32);
    }

    /// The released Qwen3.5 form: the language model's config under `text_config`,
    /// the head's tie from the top level; what is refused.
    #[test]
    fn a_vision_language_config_gives_its_language_model() {
        let c = hybrid_fixture("qwen3_5_moe_vlm_form");
        assert_eq!(c, hybrid_fixture("qwen3_5_moe_text"));
        let c = hybrid_fixture("qwen3_5_vlm_form");
        assert_eq!(c, hybrid_fixture("qwen3_5_text_dense"));
        let tied = parse(&format!(
            r#"{{"model_type": "qwen3_5", "tie_word_embeddings": true,
                "text_config": {{"tie_word_embeddings": false, {BASE}}}}}"#
        ))
        .unwrap();
        assert!(tied.tie_word_embeddings && tied.arch == Arch::Qwen35);
        for (json, want) in [
            (
                r#"{"model_type": "qwen3_5"}"#.to_string(),
                "needs 'text_config'",
            ),
            (
                r#"{"model_type": "qwen3_5_moe", "text_config": 3}"#.into(),
                "must be an object",
            ),
            (
                format!(
                    r#"{{"model_type": "qwen3_5", "text_config": {{"model_type": "llama", {BASE}}}}}"#
                ),
                "not 'qwen3_5_text'",
            ),
        ] {
            let e = parse(&json).unwrap_err().to_string();
            assert!(e.contains(want), "{json}: {e}");
        }
    }

    /// transformers' defaults for a qwen3_next config that gives none of the hybrid
    /// keys (the 80B release's shapes), and what is refused.
    #[test]
    fn hybrid_defaults_and_bad_hybrid_keys() {
        let c = parse(&format!(
            r#"{{"model_type": "qwen3_next", {BASE}, "num_hidden_layers": 8, "head_dim": 64}}"#
        ))
        .unwrap();
        let l = c.linear.as_ref().unwrap();
        assert_eq!(
            l.layers,
            vec![true, true, true, false, true, true, true, false]
        );
        assert_eq!(
            (
                l.conv_kernel,
                l.num_key_heads,
                l.num_value_heads,
                l.key_head_dim
            ),
            (4, 16, 32, 128)
        );
        assert_eq!(c.rotary_dim, 16);
        let m = c.moe.as_ref().unwrap();
        assert_eq!(
            (m.num_experts, m.top_k, m.shared_intermediate_size),
            (512, 10, 512)
        );
        for (extra, want) in [
            (
                r#""linear_num_key_heads": 3, "linear_num_value_heads": 4"#,
                "not a multiple",
            ),
            (r#""linear_conv_kernel_dim": 0"#, "linear_conv_kernel_dim"),
            (
                r#""layer_types": ["linear_attention", "mamba"]"#,
                "unsupported layer type 'mamba'",
            ),
            (r#""full_attention_interval": 0"#, "full_attention_interval"),
        ] {
            let e = parse(&format!(
                r#"{{"model_type": "qwen3_next", {BASE}, {extra}}}"#
            ))
            .unwrap_err()
            .to_string();
            assert!(e.contains(want), "{extra}: {e}");
        }
        // A linear layer in a model that has none.
        let e = parse(&format!(
            r#"{{"model_type": "qwen3", {BASE}, "layer_types": ["linear_attention", "full_attention"]}}"#
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("unsupported layer type 'linear_attention'"),
            "{e}"
        );
    }

    const BASE: &str = r#""hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 512"#;

    #[test]
    fn llama_defaults() {
        let c = parse(&format!(r#"{{"model_type": "llama", {BASE}}}"#)).unwrap();
        assert_eq!(c.arch, Arch::Llama);
        assert_eq!(c.num_kv_heads, 4);
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.rope_theta, 10000.0);
        assert_eq!(c.rope_scaling, RopeScaling::Default);
        assert!(!c.tie_word_embeddings && !c.qkv_bias && c.qk_norm == QkNorm::None);
    }

    #[test]
    fn rope_theta_inside_rope_parameters() {
        let c = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_parameters": {{"rope_type": "llama3", "rope_theta": 500000.0,
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}}}"#
        ))
        .unwrap();
        assert_eq!(c.rope_theta, 500000.0);
        assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
    }

    #[test]
    fn legacy_rope_scaling_key() {
        let c = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_theta": 1000.0, "rope_scaling": {{"rope_type": "llama3",
            "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}}}"#
        ))
        .unwrap();
        assert_eq!(c.rope_theta, 1000.0);
        assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { .. }));
    }

    #[test]
    fn experts_from_each_family_and_their_defaults() {
        let q = parse(&format!(
            r#"{{"model_type": "qwen3_moe", {BASE}, "num_experts": 8, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32, "norm_topk_prob": true, "mlp_only_layers": [0]}}"#
        ))
        .unwrap();
        let m = q.moe.as_ref().unwrap();
        assert_eq!(
            (m.num_experts, m.top_k, m.expert_intermediate_size),
            (8, 2, 32)
        );
        assert!(m.norm_topk_prob);
        assert_eq!(m.sparse, vec![false, true]);
        assert_eq!(q.qk_norm, QkNorm::PerHead);
        // decoder_sparse_step 2: only every second layer is sparse.
        let q = parse(&format!(
            r#"{{"model_type": "qwen3_moe", {BASE}, "decoder_sparse_step": 2}}"#
        ))
        .unwrap();
        let m = q.moe.unwrap();
        assert_eq!(
            (m.num_experts, m.top_k, m.expert_intermediate_size),
            (128, 8, 768)
        );
        assert!(!m.norm_topk_prob);
        assert_eq!(m.sparse, vec![false, true]);
        // olmoe: experts as wide as intermediate_size, norms over the whole projection,
        // clip_qkv kept.
        let o = parse(&format!(
            r#"{{"model_type": "olmoe", {BASE}, "num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 8.0}}"#
        ))
        .unwrap();
        assert_eq!(o.qk_norm, QkNorm::Whole);
        assert_eq!(o.clip_qkv, Some(8.0));
        assert_eq!(o.moe.unwrap().expert_intermediate_size, 128);
        // mixtral: num_local_experts, always renormalised, a window on every layer.
        let x = parse(&format!(
            r#"{{"model_type": "mixtral", {BASE}, "num_local_experts": 4, "sliding_window": 8}}"#
        ))
        .unwrap();
        let m = x.moe.unwrap();
        assert_eq!((m.num_experts, m.top_k), (4, 2));
        assert!(m.norm_topk_prob);
        assert_eq!(x.sliding_window, vec![Some(8); 2]);
        assert_eq!(x.qk_norm, QkNorm::None);
        // A dense model has none.
        assert!(parse(&format!(r#"{{"model_type": "qwen3", {BASE}}}"#))
            .unwrap()
            .moe
            .is_none());
    }

    #[test]
    fn expert_options_not_understood_are_errors_naming_them() {
        for (arch, fields, says) in [
            (
                "qwen3_moe",
                r#""num_experts": 8, "num_local_experts": 4"#,
                "disagree",
            ),
            (
                "qwen3_moe",
                r#""num_experts": 4, "num_experts_per_tok": 5"#,
                "'num_experts_per_tok' is 5",
            ),
            (
                "qwen3_moe",
                r#""mlp_only_layers": [2]"#,
                "'mlp_only_layers' names layer 2 of 2",
            ),
            (
                "qwen3_moe",
                r#""decoder_sparse_step": 0"#,
                "'decoder_sparse_step' is 0",
            ),
            (
                "qwen3_moe",
                r#""shared_expert_intermediate_size": 64"#,
                "shared experts",
            ),
            (
                "qwen3_moe",
                r#""use_sliding_window": true, "sliding_window": 8"#,
                "use_sliding_window",
            ),
            ("olmoe", r#""clip_qkv": -1.0"#, "'clip_qkv'"),
            ("mixtral", r#""num_experts": 0"#, "'num_experts' is 0"),
            (
                "olmoe",
                r#""mlp_only_layers": [0, "x"]"#,
                "'mlp_only_layers' must be a list",
            ),
        ] {
            let e = problem(arch, &format!("{BASE}, {fields}"));
            assert!(e.contains(says), "{arch} {fields}: {e}");
        }
    }

    #[test]
    fn qwen_flags() {
        let c = parse(&format!(
            r#"{{"model_type": "qwen2", {BASE}, "num_key_value_heads": 1}}"#
        ))
        .unwrap();
        assert!(c.qkv_bias && !c.o_bias && c.qk_norm == QkNorm::None);
        assert_eq!(c.num_kv_heads, 1);
        let c = parse(&format!(
            r#"{{"model_type": "qwen3", {BASE}, "head_dim": 32}}"#
        ))
        .unwrap();
        assert!(c.qk_norm == QkNorm::PerHead && !c.qkv_bias);
        assert_eq!(c.head_dim, 32);
    }

    #[test]
    fn mistral_window_on_every_layer() {
        let c = parse(&format!(
            r#"{{"model_type": "mistral", {BASE}, "sliding_window": 16}}"#
        ))
        .unwrap();
        assert_eq!(c.sliding_window, vec![Some(16), Some(16)]);
    }

    const DEEPSEEK: &str = r#""model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "n_routed_experts": 16, "num_experts_per_tok": 2,
        "num_hidden_layers": 3, "num_attention_heads": 4, "vocab_size": 256,
        "max_position_embeddings": 256, "kv_lora_rank": 16, "q_lora_rank": 24,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12"#;

    #[test]
    fn deepseek_v3_reads_mla_widths_and_its_familys_defaults() {
        let c = parse(&format!("{{{DEEPSEEK}, \"head_dim\": 8}}")).unwrap();
        assert_eq!(c.arch, Arch::DeepseekV3);
        // head_dim (transformers writes qk_rope_head_dim there) is the query head's
        // width; the rotary part is qk_rope_head_dim.
        assert_eq!((c.head_dim, c.rotary_dim), (16, 8));
        let m = c.mla.clone().unwrap();
        assert_eq!(
            (m.q_lora_rank, m.kv_lora_rank, m.v_head_dim),
            (Some(24), 16, 12)
        );
        assert!(m.rope_interleave);
        assert_eq!(m.softmax_scale, 0.25);
        let moe = c.moe.unwrap();
        // first_k_dense_replace 3 by default: all three layers dense.
        assert_eq!(moe.sparse, vec![false; 3]);
        assert_eq!(moe.routed_scaling_factor, 2.5);
        assert_eq!(moe.shared_intermediate_size, 32);
        assert_eq!(
            moe.scoring,
            Scoring::SigmoidGroups {
                n_group: 8,
                topk_group: 4
            }
        );
    }

    #[test]
    fn yarn_corrects_mla_softmax_scale_and_takes_its_factor_from_the_context_ratio() {
        // The released DeepSeek-V3 form: top-level rope_scaling with "type".
        let c = parse(&format!(
            r#"{{{DEEPSEEK}, "rope_scaling": {{"type": "yarn", "factor": 40, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1}}, "max_position_embeddings": 163840}}"#
        ))
        .unwrap();
        let mscale = 0.1 * 40f64.ln() + 1.0;
        assert_eq!(
            c.mla.as_ref().unwrap().softmax_scale,
            (0.25 * mscale * mscale) as f32
        );
        // mscale == mscale_all_dim: cos and sin are left as they are.
        assert_eq!(c.rope_attention_factor(), 1.0);
        // No factor: max_position_embeddings over the original, as transformers infers.
        let c = parse(&format!(
            r#"{{{DEEPSEEK}, "rope_parameters": {{"rope_type": "yarn", "rope_theta": 10000.0,
            "original_max_position_embeddings": 64}}}}"#
        ))
        .unwrap();
        assert!(matches!(c.rope_scaling, RopeScaling::Yarn { factor, .. } if factor == 4.0));
        assert_eq!(c.rope_attention_factor(), (0.1 * 4f64.ln() + 1.0) as f32);
        // The high frequencies extrapolate (unchanged), the low ones interpolate.
        let mut plain = c.clone();
        plain.rope_scaling = RopeScaling::Default;
        let (y, p) = (c.rope_inv_freq(), plain.rope_inv_freq());
        assert_eq!(y[0], p[0]);
        assert_eq!(y[3], 1.0 / (4.0f32 * (1.0 / p[3])));
    }

    /// The config.json files DeepSeek-V3 and GLM-4.5 were released with (the
    /// DeepSeek one as its BF16 conversions ship it: the release itself is FP8, a
    /// quantized checkpoint exact mode refuses by name).
    #[test]
    fn released_deepseek_v3_and_glm_4_5_configs_read_as_published() {
        let ds = r#"{"architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false,
            "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1,
            "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
            "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
            "max_position_embeddings": 163840, "model_type": "deepseek_v3",
            "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
            "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true,
            "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
            "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1,
            "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40,
            "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
            "type": "yarn"}, "rope_theta": 10000, "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid", "seq_aux": true, "tie_word_embeddings": false,
            "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
            "use_cache": true, "v_head_dim": 128, "vocab_size": 129280}"#;
        let c = parse(ds).unwrap();
        assert_eq!((c.head_dim, c.rotary_dim, c.extra_layers), (192, 64, 1));
        // Layer 61, the prediction layer, has experts as the decoder's last does.
        let moe = c.moe.as_ref().unwrap();
        assert_eq!(moe.sparse.len(), 62);
        assert!(moe.sparse[61] && !moe.sparse[2] && moe.sparse[3]);
        let mtp = c.extra_layer(0).unwrap();
        assert_eq!((mtp.num_layers, mtp.extra_layers), (1, 0));
        assert_eq!(mtp.moe.as_ref().unwrap().sparse, vec![true]);
        assert_eq!(mtp.sliding_window, vec![None]);
        assert!(c.extra_layer(1).is_none());
        let m = c.mla.as_ref().unwrap();
        assert_eq!(
            (m.q_lora_rank, m.kv_lora_rank, m.v_head_dim),
            (Some(1536), 512, 128)
        );
        assert!(m.rope_interleave);
        let mscale = 0.1 * 40f64.ln() + 1.0;
        assert_eq!(
            m.softmax_scale,
            (192f64.powf(-0.5) * mscale * mscale) as f32
        );
        let moe = c.moe.as_ref().unwrap();
        assert_eq!(
            (moe.num_experts, moe.top_k, moe.shared_intermediate_size),
            (256, 8, 2048)
        );
        assert_eq!(
            moe.scoring,
            Scoring::SigmoidGroups {
                n_group: 8,
                topk_group: 4
            }
        );
        assert_eq!(moe.sparse.iter().filter(|s| !**s).count(), 3);
        assert_eq!(c.rope_inv_freq().len(), 32);
        let fp8 = ds.replacen(
            r#""pretraining_tp": 1,"#,
            r#""pretraining_tp": 1, "quantization_config": {"activation_scheme": "dynamic",
            "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},"#,
            1,
        );
        assert_eq!(
            parse(&fp8).unwrap().quant,
            Quantization::Fp8 {
                block_rows: 128,
                block_cols: 128,
                not_convert: vec![]
            }
        );
        let gptq = ds.replacen(
            r#""pretraining_tp": 1,"#,
            r#""pretraining_tp": 1, "quantization_config": {"quant_method": "gptq"},"#,
            1,
        );
        let e = parse(&gptq).unwrap_err();
        assert!(e.to_string().contains("quant_method' is 'gptq'"), "{e}");

        let glm = r#"{"architectures": ["Glm4MoeForCausalLM"], "attention_bias": true,
            "attention_dropout": 0.0, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338],
            "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "partial_rotary_factor": 0.5,
            "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 131072,
            "model_type": "glm4_moe", "moe_intermediate_size": 1536, "norm_topk_prob": true,
            "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160,
            "n_shared_experts": 1, "routed_scaling_factor": 2.5, "num_experts_per_tok": 8,
            "first_k_dense_replace": 3, "num_hidden_layers": 92, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
            "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true,
            "use_qk_norm": true, "vocab_size": 151552}"#;
        let c = parse(glm).unwrap();
        assert_eq!((c.head_dim, c.rotary_dim, c.extra_layers), (128, 64, 1));
        assert!(c.qkv_bias && !c.o_bias && c.qk_norm == QkNorm::PerHead);
        assert_eq!(c.eos_token_ids, vec![151329, 151336, 151338]);
        let moe = c.moe.as_ref().unwrap();
        assert_eq!((moe.num_experts, moe.routed_scaling_factor), (160, 2.5));
        assert_eq!(
            moe.scoring,
            Scoring::SigmoidGroups {
                n_group: 1,
                topk_group: 1
            }
        );
    }

    /// MLA widths are bounded before anything adds them; an absent q_lora_rank is
    /// transformers' default rank, a null one a plain q_proj; a partial rotary
    /// factor is refused, not ignored.
    #[test]
    fn mla_widths_are_checked_before_use() {
        let huge = format!("{{{DEEPSEEK}, \"qk_nope_head_dim\": 18446744073709551615}}");
        let e = parse(&huge).unwrap_err();
        assert!(e.to_string().contains("qk_nope_head_dim"), "{e}");
        let wide =
            format!("{{{DEEPSEEK}, \"num_attention_heads\": 65536, \"kv_lora_rank\": 16777216}}");
        let e = parse(&wide).unwrap_err();
        assert!(e.to_string().contains("kv_lora_rank"), "{e}");
        let absent = DEEPSEEK.replace(r#""q_lora_rank": 24,"#, "");
        let c = parse(&format!("{{{absent}}}")).unwrap();
        assert_eq!(c.mla.unwrap().q_lora_rank, Some(1536));
        let null = DEEPSEEK.replace(r#""q_lora_rank": 24"#, r#""q_lora_rank": null"#);
        let c = parse(&format!("{{{null}}}")).unwrap();
        assert_eq!(c.mla.unwrap().q_lora_rank, None);
        for extra in [
            r#""partial_rotary_factor": 0.5"#,
            r#""rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}"#,
        ] {
            let e = parse(&format!("{{{DEEPSEEK}, {extra}}}")).unwrap_err();
            assert!(
                e.to_string().contains("partial_rotary_factor"),
                "{extra}: {e}"
            );
        }
    }

    #[test]
    fn routing_options_not_computed_are_errors_naming_them() {
        for (extra, needle) in [
            (r#""scoring_func": "softmax""#, "scoring_func"),
            (r#""topk_method": "group_limited_greedy""#, "topk_method"),
            (r#""moe_layer_freq": 2"#, "moe_layer_freq"),
            (r#""n_group": 3"#, "n_group"),
            (r#""n_group": 4, "topk_group": 5"#, "topk_group"),
            (
                r#""n_group": 4, "topk_group": 1, "num_experts_per_tok": 5"#,
                "num_experts_per_tok",
            ),
            (r#""kv_lora_rank": 0"#, "kv_lora_rank"),
            (r#""routed_scaling_factor": -1.0"#, "routed_scaling_factor"),
        ] {
            let e = parse(&format!("{{{DEEPSEEK}, {extra}}}")).unwrap_err();
            assert!(e.to_string().contains(needle), "{extra}: {e}");
        }
        let ok = parse(&format!(
            r#"{{{DEEPSEEK}, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
            "n_group": 4, "topk_group": 2}}"#
        ));
        assert!(ok.is_ok(), "{ok:?}");
    }

    #[test]
    fn glm4_moe_rotates_half_of_each_head_unless_told_otherwise() {
        let glm = r#""model_type": "glm4_moe", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 24, "vocab_size": 256, "max_position_embeddings": 512,
            "attention_bias": true, "use_qk_norm": true"#;
        let c = parse(&format!("{{{glm}}}")).unwrap();
        assert_eq!((c.head_dim, c.rotary_dim), (24, 12));
        assert_eq!(c.rope_inv_freq().len(), 6);
        assert!(c.qkv_bias && !c.o_bias && c.qk_norm == QkNorm::PerHead);
        let moe = c.moe.unwrap();
        assert_eq!(moe.sparse, vec![false, true]);
        assert_eq!(
            moe.scoring,
            Scoring::SigmoidGroups {
                n_group: 1,
                topk_group: 1
            }
        );
        let c = parse(&format!(
            r#"{{{glm}, "rope_parameters": {{"rope_type": "default", "rope_theta": 10000.0,
            "partial_rotary_factor": 1.0}}}}"#
        ))
        .unwrap();
        assert_eq!(c.rotary_dim, 24);
        // Elsewhere a partial rotary factor is not computed.
        let e = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "partial_rotary_factor": 0.5}}"#
        ))
        .unwrap_err();
        assert!(e.to_string().contains("partial_rotary_factor"), "{e}");
    }

    #[test]
    fn unsupported_things_are_errors_naming_them() {
        let e = parse(&format!(r#"{{"model_type": "gpt2", {BASE}}}"#)).unwrap_err();
        assert!(e.to_string().contains("gpt2"), "{e}");
        let e = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "hidden_act": "gelu"}}"#
        ))
        .unwrap_err();
        assert!(e.to_string().contains("gelu"), "{e}");
        let e = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "rope_scaling": {{"rope_type": "longrope", "factor": 4.0}}}}"#
        ))
        .unwrap_err();
        assert!(e.to_string().contains("longrope"), "{e}");
        let e = parse(r#"{"model_type": "llama", "hidden_size": 64}"#).unwrap_err();
        assert!(e.to_string().contains("intermediate_size"), "{e}");
        let e = parse(&format!(
            r#"{{"model_type": "llama", {BASE}, "num_key_value_heads": 3}}"#
        ))
        .unwrap_err();
        assert!(e.to_string().contains("multiple"), "{e}");
        let e = parse("{not json").unwrap_err();
        assert!(e.to_string().contains("config.json"), "{e}");
    }

    /// The error text of `BASE` with `extra` keys replacing or adding to it.
    fn problem(arch: &str, fields: &str) -> String {
        let e = parse(&format!(r#"{{"model_type": "{arch}", {fields}}}"#)).unwrap_err();
        assert!(matches!(e, VoomError::Config { .. }), "{e:?}");
        e.to_string()
    }

    /// BASE with `key` set to `value` (JSON text); later keys win in serde_json.
    fn with(key: &str, value: &str) -> String {
        format!("{BASE}, \"{key}\": {value}")
    }

    #[test]
    fn hostile_num_hidden_layers_is_an_error_before_anything_is_sized_from_it() {
        // Issue 8: 1e9 layers aborted in sliding_windows (and in LlamaModel::load).
        for arch in ["llama", "mistral", "qwen2", "qwen3"] {
            let e = problem(arch, &with("num_hidden_layers", "1000000000"));
            assert!(
                e.contains("'num_hidden_layers' is 1000000000") && e.contains("1..=65536"),
                "{e}"
            );
        }
        let e = problem(
            "qwen2",
            &format!(
                "{}, \"use_sliding_window\": true, \"sliding_window\": 4",
                with("num_hidden_layers", "18446744073709551615")
            ),
        );
        assert!(e.contains("num_hidden_layers"), "{e}");
    }

    #[test]
    fn values_of_the_wrong_type_are_errors_naming_the_key() {
        for (key, value) in [
            ("num_hidden_layers", "1e9"),
            ("num_hidden_layers", "-1"),
            ("hidden_size", "\"64\""),
            ("vocab_size", "18446744073709551616"),
            ("intermediate_size", "12.5"),
            ("rms_norm_eps", "\"small\""),
            ("tie_word_embeddings", "1"),
            ("layer_types", "[1, 2]"),
        ] {
            let e = problem("llama", &with(key, value));
            assert!(e.contains(&format!("'{key}' must be")), "{key}: {e}");
            assert!(e.contains("config.json"), "{e}");
        }
        let e = parse("[1, 2]").unwrap_err().to_string();
        assert!(e.contains("must be a JSON object"), "{e}");
    }

    #[test]
    fn sizes_beyond_the_limits_are_errors_naming_key_value_and_range() {
        for (key, value, range) in [
            ("hidden_size", "16777217", "1..=16777216"),
            ("intermediate_size", "1000000000000", "1..=16777216"),
            ("num_attention_heads", "65540", "1..=65536"),
            ("head_dim", "131072", "2..=65536"),
            ("vocab_size", "4294967296", "1..=4294967295"),
            ("max_position_embeddings", "1000000000000", "1..=16777216"),
        ] {
            // head_dim given, so that hidden_size need not divide by the heads.
            let extra = if key == "head_dim" {
                ""
            } else {
                r#", "head_dim": 16"#
            };
            let e = problem("llama", &format!("{}{extra}", with(key, value)));
            assert!(
                e.contains(&format!("'{key}' is {value}")) && e.contains(range),
                "{key}: {e}"
            );
        }
        // Each in range, their product (the width of q) not.
        let e = problem(
            "qwen3",
            &format!(
                "{}, \"num_key_value_heads\": 1, \"head_dim\": 65536",
                with("num_attention_heads", "65536")
            ),
        );
        assert!(e.contains("attention width"), "{e}");
        let e = problem("llama", &with("num_key_value_heads", "8"));
        assert!(e.contains("num_key_value_heads"), "{e}");
        let e = problem("llama", &with("head_dim", "15"));
        assert!(e.contains("'head_dim' 15 must be even"), "{e}");
    }

    #[test]
    fn rope_theta_zero_negative_or_infinite_is_an_error() {
        // Issue 8: rope_theta 0 ran and emitted id 0 forever (NaN logits).
        for v in ["0", "-1", "0.0", "1e39"] {
            let e = problem("llama", &with("rope_theta", v));
            assert!(e.contains("'rope_theta'"), "{v}: {e}");
        }
        let e = problem(
            "llama",
            &with(
                "rope_parameters",
                r#"{"rope_type": "default", "rope_theta": -5}"#,
            ),
        );
        assert!(e.contains("'rope_theta' is -5"), "{e}");
        // Positive but so small that the frequencies overflow float32.
        let e = problem("llama", &with("rope_theta", "1e-44"));
        assert!(
            e.contains("rotary frequency") && e.contains("max_position_embeddings"),
            "{e}"
        );
    }

    #[test]
    fn rms_norm_eps_zero_negative_or_zero_in_float32_is_an_error() {
        // Issue 8: rms_norm_eps 0 ran and emitted id 0 forever.
        for v in ["0", "-1e-6", "1e-50", "1e39"] {
            let e = problem("llama", &with("rms_norm_eps", v));
            assert!(e.contains("'rms_norm_eps'"), "{v}: {e}");
        }
    }

    #[test]
    fn llama3_rope_scaling_out_of_range_is_an_error_naming_the_parameter() {
        let scaling = |factor: &str, low: &str, high: &str, orig: &str| {
            with(
                "rope_scaling",
                &format!(
                    r#"{{"rope_type": "llama3", "factor": {factor}, "low_freq_factor": {low},
                    "high_freq_factor": {high}, "original_max_position_embeddings": {orig}}}"#
                ),
            )
        };
        for (cfg, key) in [
            (scaling("0", "1", "4", "32"), "rope_scaling.factor"),
            (scaling("1e39", "1", "4", "32"), "rope_scaling.factor"),
            (
                scaling("8", "-1", "4", "32"),
                "rope_scaling.low_freq_factor",
            ),
            (
                scaling("8", "4", "1", "32"),
                "rope_scaling.high_freq_factor",
            ),
            (
                scaling("8", "1", "4", "0"),
                "rope_scaling.original_max_position_embeddings",
            ),
            (
                scaling("8", "1", "4", "100000000"),
                "rope_scaling.original_max_position_embeddings",
            ),
            (
                scaling("8", "1", "4", "8192.5"),
                "original_max_position_embeddings",
            ),
            (
                scaling("8", "1", "4", "-1"),
                "original_max_position_embeddings",
            ),
            (scaling("1e-38", "1", "4", "32"), "rotary frequency"),
        ] {
            let e = problem("llama", &cfg);
            assert!(e.contains(key), "{key}: {e}");
        }
    }

    #[test]
    fn per_layer_lists_must_match_the_layer_count() {
        let e = problem(
            "llama",
            &with(
                "layer_types",
                r#"["full_attention", "full_attention", "full_attention"]"#,
            ),
        );
        assert!(
            e.contains("'layer_types' has 3 entries for 2 layers"),
            "{e}"
        );
        let e = problem("mistral", &with("sliding_window", "-4"));
        assert!(
            e.contains("'sliding_window' must be a positive integer"),
            "{e}"
        );
        let e = problem("mistral", &with("sliding_window", "18446744073709551616"));
        assert!(e.contains("'sliding_window'"), "{e}");
        // A hand-made config is checked again.
        let mut c = parse(&format!(r#"{{"model_type": "llama", {BASE}}}"#)).unwrap();
        c.sliding_window.pop();
        let e = c
            .validate(Path::new("x/config.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("1 attention windows for 2 layers"), "{e}");
    }

    #[test]
    fn special_token_ids_outside_the_vocabulary_are_ignored_never_wrapped() {
        // 2^32 must not become 0 (the first id) by an `as u32` cast.
        let c = parse(&format!(
            r#"{{"model_type": "llama", {}, "bos_token_id": -1}}"#,
            with("eos_token_id", r#"[2, -1, 4294967296, 256, 1e3, "3", 255]"#)
        ))
        .unwrap();
        assert_eq!(c.eos_token_ids, vec![2, 255]);
        assert_eq!(c.bos_token_id, None);
        let c = parse(&format!(
            r#"{{"model_type": "llama", {}}}"#,
            with("eos_token_id", "4294967296")
        ))
        .unwrap();
        assert!(c.eos_token_ids.is_empty());
        let mut c = parse(&format!(r#"{{"model_type": "llama", {BASE}}}"#)).unwrap();
        c.eos_token_ids.push(256);
        let e = c
            .validate(Path::new("config.json"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("'eos_token_id' 256 is outside the vocabulary (0..256)"),
            "{e}"
        );
    }

    #[test]
    fn config_json_that_is_not_a_regular_file_is_refused_without_blocking() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("config.json");
        let made = std::process::Command::new("mkfifo").arg(&path).status();
        if !made.is_ok_and(|s| s.success()) {
            eprintln!("skipped: mkfifo unavailable");
            return;
        }
        // Opening a FIFO for reading would block until a writer comes.
        let e = ModelConfig::from_dir(d.path()).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        let e = ModelConfig::from_dir(d.path()).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }

    #[test]
    fn config_json_larger_than_the_limit_is_refused_unread() {
        let d = tempfile::tempdir().unwrap();
        let f = std::fs::File::create(d.path().join("config.json")).unwrap();
        f.set_len(limits::CONFIG_BYTES + 1).unwrap(); // sparse: nothing written
        let e = ModelConfig::from_dir(d.path()).unwrap_err().to_string();
        assert!(e.contains("16777217 bytes") && e.contains("refused"), "{e}");
    }

    #[test]
    fn published_shapes_are_inside_the_limits() {
        // Llama 3.1 405B's, with the llama3 scaling and its 128K context; Llama 4's 10M.
        let c = parse(
            r#"{"model_type": "llama", "hidden_size": 16384, "intermediate_size": 53248,
            "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "eos_token_id": [128001, 128008, 128009], "bos_token_id": 128000}"#,
        )
        .unwrap();
        assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
        parse(&format!(
            r#"{{"model_type": "llama", {}, "rope_theta": 500000.0}}"#,
            with("max_position_embeddings", "10485760")
        ))
        .unwrap();
        // Qwen2.5's window may exceed its context (use_sliding_window is false).
        parse(&format!(
            r#"{{"model_type": "qwen2", {}, "use_sliding_window": false, "max_window_layers": 70}}"#,
            with("sliding_window", "131072")
        ))
        .unwrap();
    }

    /// gpt-oss-20b's released config, then the same without what transformers
    /// fills in (head_dim, rope, window, layer types, biases, experts, limit).
    #[test]
    fn gpt_oss_config_gives_sinks_windows_yarn_and_clamped_experts() {
        let types: Vec<&str> = (0..24)
            .map(|i| match i % 2 {
                0 => "\"sliding_attention\"",
                _ => "\"full_attention\"",
            })
            .collect();
        let released = format!(
            r#"{{"architectures": ["GptOssForCausalLM"], "attention_bias": true,
            "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4,
            "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
            "initial_context_length": 4096, "initializer_range": 0.02,
            "intermediate_size": 2880, "layer_types": [{}],
            "max_position_embeddings": 131072, "model_type": "gpt_oss",
            "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
            "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": false,
            "pad_token_id": 199999, "quantization_config": {{"modules_to_not_convert":
            ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"], "quant_method": "mxfp4"}}, "rms_norm_eps": 1e-05,
            "rope_scaling": {{"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false}},
            "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
            "swiglu_limit": 7.0, "tie_word_embeddings": false, "use_cache": true,
            "vocab_size": 201088}}"#,
            types.join(", ")
        );
        let c = parse(&released).unwrap();
        assert_eq!(c.arch, Arch::GptOss);
        assert!(c.attn_sinks && c.qkv_bias && c.o_bias);
        assert_eq!((c.head_dim, c.num_heads, c.num_kv_heads), (64, 64, 8));
        assert_eq!(c.rope_theta, 150000.0);
        let yarn = RopeScaling::Yarn {
            factor: 32.0,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 0.1 * 32f64.ln() + 1.0,
            mscale_all_dim: None,
            truncate: false,
        };
        assert_eq!(c.rope_scaling, yarn);
        let windows: Vec<Option<usize>> = (0..24).map(|i| (i % 2 == 0).then_some(128)).collect();
        assert_eq!(c.sliding_window, windows);
        let moe = c.moe.as_ref().unwrap();
        assert_eq!(
            (moe.num_experts, moe.top_k, moe.expert_intermediate_size),
            (32, 4, 2880)
        );
        assert!(moe.router_bias && !moe.norm_topk_prob && moe.sparse.iter().all(|s| *s));
        assert_eq!(moe.scoring, Scoring::TopKSoftmax);
        assert_eq!(
            moe.gate,
            ExpertGate::Clamped {
                alpha: 1.702,
                limit: 7.0
            }
        );
        assert!(
            matches!(c.quant, Quantization::Mxfp4 { ref not_convert } if not_convert.len() == 4)
        );

        // transformers' defaults fill in what a bare config leaves out.
        let bare = r#"{"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
            "num_hidden_layers": 4, "num_attention_heads": 64, "num_key_value_heads": 8,
            "vocab_size": 201088}"#;
        let d = parse(bare).unwrap();
        assert_eq!((d.head_dim, d.rope_theta), (64, 150000.0));
        assert_eq!(d.rope_scaling, yarn);
        assert_eq!(d.sliding_window, vec![Some(128), None, Some(128), None]);
        assert!(d.attn_sinks && d.qkv_bias && d.o_bias);
        let moe = d.moe.as_ref().unwrap();
        assert_eq!((moe.num_experts, moe.top_k), (128, 4));
        assert_eq!(
            moe.gate,
            ExpertGate::Clamped {
                alpha: 1.702,
                limit: 7.0
            }
        );
        let limit = bare.replacen("\"vocab_size\"", "\"swiglu_limit\": 0, \"vocab_size\"", 1);
        let e = parse(&limit).unwrap_err();
        assert!(e.to_string().contains("'swiglu_limit' 0"), "{e}");
        let no_bias = bare.replacen(
            "\"vocab_size\"",
            "\"attention_bias\": false, \"vocab_size\"",
            1,
        );
        let n = parse(&no_bias).unwrap();
        assert!(!n.qkv_bias && !n.o_bias);
    }
}
