//! Synthetic Llama-shaped checkpoints with random BF16 weights, for benchmarks of
//! models larger than the real ones this machine has. Deterministic for a seed.

mod deepseek_fp8;
mod tensors;

pub use deepseek_fp8::{
    bench_deepseek_fp8_model, write_deepseek_v3_fp8, SynthDeepseekShape, Widths,
};

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};

use tensors::Tensors;
use voom_formats::DType;

/// Shape of a synthetic model.
#[derive(Debug, Clone, Copy)]
pub struct SynthShape {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub vocab: usize,
}

impl SynthShape {
    /// A Llama shape of about `gb` GB of BF16 weights (hidden 2048, GQA 32/4, untied).
    pub fn of_size(gb: f64) -> SynthShape {
        let (hidden, intermediate, heads, kv_heads, vocab) = (2048, 5632, 32, 4, 32000);
        let head_dim = hidden / heads;
        let per_layer =
            2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate;
        let fixed = 2 * vocab * hidden;
        let params = (gb * 1e9 / 2.0) as usize;
        let layers = (params.saturating_sub(fixed) / per_layer).max(1);
        SynthShape {
            hidden,
            intermediate,
            layers,
            heads,
            kv_heads,
            vocab,
        }
    }

    pub fn params(&self) -> usize {
        let hd = self.hidden / self.heads;
        let per_layer = 2 * self.hidden * self.hidden
            + 2 * self.hidden * self.kv_heads * hd
            + 3 * self.hidden * self.intermediate
            + 2 * self.hidden;
        self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden
    }
}

/// xorshift64*: fast, deterministic, good enough for random weights.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-a, a).
    fn uniform(&mut self, a: f32) -> f32 {
        let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        (2.0 * u - 1.0) * a
    }
}

/// `n` bytes from the generator seeded with `seed`: data no file system compresses.
pub fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed | 1);
    let mut out = Vec::with_capacity(n.next_multiple_of(8));
    while out.len() < n {
        out.extend_from_slice(&rng.next().to_le_bytes());
    }
    out.truncate(n);
    out
}

/// The benchmarks' synthetic Llama of about `gb` GB of BF16 under
/// `$VOOM_HOME/bench` (named by its shape), written once and reused.
pub fn bench_model(gb: f64) -> Result<std::path::PathBuf> {
    let shape = SynthShape::of_size(gb);
    bench_dir(
        &format!("llama-synthetic-{}l-{}h", shape.layers, shape.hidden),
        &format!(
            "a synthetic Llama ({} layers, {:.2} GB BF16)",
            shape.layers,
            shape.params() as f64 * 2.0 / 1e9
        ),
        |dir| write_llama(dir, shape, 0x5eed),
    )
}

/// `$VOOM_HOME/bench/NAME`, written by `write` (announced as `what`) unless it holds
/// a checkpoint already.
fn bench_dir(
    name: &str,
    what: &str,
    write: impl FnOnce(&Path) -> Result<()>,
) -> Result<std::path::PathBuf> {
    let dir = crate::store::voom_home()?.join("bench").join(name);
    if !dir.join("config.json").exists() {
        eprintln!("voom bench: writing {what} to {}", dir.display());
        write(&dir)?;
    }
    Ok(dir)
}

/// Shape of a synthetic Qwen3-MoE: attention and a router in every layer, and
/// `experts` SwiGLU experts of which each token runs `top_k`.
#[derive(Debug, Clone, Copy)]
pub struct SynthMoeShape {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub experts: usize,
    pub top_k: usize,
    pub expert_intermediate: usize,
    pub vocab: usize,
}

impl SynthMoeShape {
    /// A Qwen3-30B-A3B-like shape (hidden 2048, 16/4 heads of 128, 64 experts of
    /// 768, 8 per token) of about `gb` GB of BF16.
    pub fn of_size(gb: f64) -> SynthMoeShape {
        let mut s = SynthMoeShape {
            hidden: 2048,
            layers: 1,
            heads: 16,
            kv_heads: 4,
            head_dim: 128,
            experts: 64,
            top_k: 8,
            expert_intermediate: 768,
            vocab: 32000,
        };
        let fixed = 2 * s.vocab * s.hidden;
        let params = (gb * 1e9 / 2.0) as usize;
        s.layers = (params.saturating_sub(fixed) / s.layer_params()).max(1);
        s
    }

    fn layer_params(&self) -> usize {
        let (h, q, kv) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        );
        2 * h * q
            + 2 * h * kv
            + 2 * self.head_dim
            + 2 * h
            + self.experts * h
            + self.experts * 3 * h * self.expert_intermediate
    }

    pub fn params(&self) -> usize {
        self.layers * self.layer_params() + 2 * self.vocab * self.hidden + self.hidden
    }
}

/// The benchmarks' synthetic Qwen3-MoE of about `gb` GB of BF16 under
/// `$VOOM_HOME/bench` (named by its shape), written once and reused.
pub fn bench_moe_model(gb: f64) -> Result<std::path::PathBuf> {
    let shape = SynthMoeShape::of_size(gb);
    bench_dir(
        &format!("qwen3moe-synthetic-{}l-{}e", shape.layers, shape.experts),
        &format!(
            "a synthetic Qwen3-MoE ({} layers of {} experts, {:.2} GB BF16)",
            shape.layers,
            shape.experts,
            shape.params() as f64 * 2.0 / 1e9
        ),
        |dir| write_qwen3_moe(dir, shape, 0x5eed),
    )
}

/// Shape of a synthetic Qwen3-Next (a hybrid): Gated DeltaNet layers and every
/// fourth a gated full attention layer, experts with a gated shared expert in each.
#[derive(Debug, Clone, Copy)]
pub struct SynthHybridShape {
    pub hidden: usize,
    pub layers: usize,
    pub experts: usize,
    pub top_k: usize,
    pub vocab: usize,
}

impl SynthHybridShape {
    // Qwen3-Next-80B-A3B's widths: attention 16/2 heads of 256 (partial rotary a
    // quarter); DeltaNet 16 key heads and 32 value heads of 128, kernel 4; experts of
    // 512 with a shared one of 512.
    const HEADS: usize = 16;
    const KV_HEADS: usize = 2;
    const HEAD_DIM: usize = 256;
    const KEY_HEADS: usize = 16;
    const VALUE_HEADS: usize = 32;
    const LINEAR_HEAD: usize = 128;
    const CONV: usize = 4;
    const EXPERT: usize = 512;

    /// Qwen3-Next's shape with its 512 experts (10 per token) scaled to 64 (8 per
    /// token) and as many layers as make about `gb` GB of BF16 (at least 4: one full
    /// attention layer).
    pub fn of_size(gb: f64) -> SynthHybridShape {
        let mut s = SynthHybridShape {
            hidden: 2048,
            layers: 4,
            experts: 64,
            top_k: 8,
            vocab: 32000,
        };
        let fixed = 2 * s.vocab * s.hidden;
        let params = (gb * 1e9 / 2.0) as usize;
        let per = (0..4).map(|i| s.layer_params(i % 4 == 3)).sum::<usize>() / 4;
        s.layers = (params.saturating_sub(fixed) / per).max(4);
        s
    }

    fn layer_params(&self, full: bool) -> usize {
        let h = self.hidden;
        let mixer = if full {
            let (q, kv) = (
                Self::HEADS * Self::HEAD_DIM,
                Self::KV_HEADS * Self::HEAD_DIM,
            );
            2 * q * h + 2 * kv * h + q * h + 2 * Self::HEAD_DIM
        } else {
            let (k, v) = (
                Self::KEY_HEADS * Self::LINEAR_HEAD,
                Self::VALUE_HEADS * Self::LINEAR_HEAD,
            );
            (2 * k + 2 * v) * h
                + 2 * Self::VALUE_HEADS * h
                + (2 * k + v) * Self::CONV
                + 2 * Self::VALUE_HEADS
                + Self::LINEAR_HEAD
                + v * h
        };
        mixer + 2 * h + self.experts * h + (self.experts + 1) * 3 * h * Self::EXPERT + h
    }

    pub fn params(&self) -> usize {
        (0..self.layers)
            .map(|i| self.layer_params((i + 1) % 4 == 0))
            .sum::<usize>()
            + 2 * self.vocab * self.hidden
            + self.hidden
    }
}

/// The benchmarks' synthetic Qwen3-Next of about `gb` GB of BF16 under
/// `$VOOM_HOME/bench` (named by its shape), written once and reused.
pub fn bench_hybrid_model(gb: f64) -> Result<std::path::PathBuf> {
    let shape = SynthHybridShape::of_size(gb);
    bench_dir(
        &format!("qwen3next-synthetic-{}l-{}e", shape.layers, shape.experts),
        &format!(
            "a synthetic Qwen3-Next ({} layers, 3 of 4 Gated DeltaNet, {} experts, {:.2} GB BF16)",
            shape.layers,
            shape.experts,
            shape.params() as f64 * 2.0 / 1e9
        ),
        |dir| write_qwen3_next(dir, shape, 0x5eed),
    )
}

/// Writes `config.json` and `model.safetensors` of a random Qwen3-MoE into `dir`,
/// one tensor per expert and projection (as transformers saves them).
pub fn write_qwen3_moe(dir: &Path, shape: SynthMoeShape, seed: u64) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let (h, hd) = (shape.hidden, shape.head_dim);
    let (qd, kvd, inter) = (
        shape.heads * hd,
        shape.kv_heads * hd,
        shape.expert_intermediate,
    );
    let mut t = Tensors::default();
    t.embedding(shape.vocab, h);
    for i in 0..shape.layers {
        let p = format!("model.layers.{i}");
        t.attention(&p, h, qd, kvd);
        t.norm(format!("{p}.self_attn.q_norm.weight"), hd);
        t.norm(format!("{p}.self_attn.k_norm.weight"), hd);
        t.linear(format!("{p}.mlp.gate.weight"), shape.experts, h);
        for e in 0..shape.experts {
            let x = format!("{p}.mlp.experts.{e}");
            t.linear(format!("{x}.gate_proj.weight"), inter, h);
            t.linear(format!("{x}.up_proj.weight"), inter, h);
            t.linear(format!("{x}.down_proj.weight"), h, inter);
        }
    }
    t.head(shape.vocab, h);
    let config = serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": h,
        "intermediate_size": 6144,
        "moe_intermediate_size": inter,
        "num_experts": shape.experts,
        "num_experts_per_tok": shape.top_k,
        "norm_topk_prob": true,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": hd,
        "vocab_size": shape.vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": false,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
        "voom_synthetic": {"seed": seed},
    });
    t.write(dir, seed, &config)
}

/// Shape of a synthetic gpt-oss: gpt-oss-20b's widths (hidden 2880, 64 query heads
/// and 8 KV heads of 64, 32 experts of 2880, 4 a token, MXFP4 experts), a smaller
/// vocabulary, and as many layers as a size gives.
#[derive(Debug, Clone, Copy)]
pub struct SynthGptOssShape {
    pub layers: usize,
    pub vocab: usize,
}

impl SynthGptOssShape {
    const HIDDEN: usize = 2880;
    const HEADS: usize = 64;
    const KV_HEADS: usize = 8;
    const HEAD_DIM: usize = 64;
    const EXPERTS: usize = 32;
    const TOP_K: usize = 4;
    const INTER: usize = 2880;

    /// As many layers (at least 2: one sliding, one full) as make about `gb` GB as
    /// stored (MXFP4 experts, the rest BF16).
    pub fn of_size(gb: f64) -> SynthGptOssShape {
        let mut s = SynthGptOssShape {
            layers: 2,
            vocab: 32000,
        };
        let fixed = 2 * 2 * s.vocab * Self::HIDDEN;
        s.layers = ((gb * 1e9) as usize).saturating_sub(fixed) / s.layer_bytes();
        s.layers = s.layers.max(2);
        s
    }

    /// Bytes of one layer as stored.
    fn layer_bytes(&self) -> usize {
        let h = Self::HIDDEN;
        let (q, kv) = (
            Self::HEADS * Self::HEAD_DIM,
            Self::KV_HEADS * Self::HEAD_DIM,
        );
        let attention = 2 * (2 * q * h + 2 * kv * h + q + 2 * kv + h + Self::HEADS);
        let router = 2 * (Self::EXPERTS * h + Self::EXPERTS);
        // 16 bytes and one scale byte per 32 values.
        let mxfp4 = |rows: usize, cols: usize| rows * (cols / 32) * 17;
        let experts = Self::EXPERTS
            * (mxfp4(2 * Self::INTER, h) + mxfp4(h, Self::INTER) + 2 * (2 * Self::INTER + h));
        attention + router + experts + 2 * 2 * h
    }

    /// Bytes as stored.
    pub fn bytes(&self) -> usize {
        self.layers * self.layer_bytes() + 2 * (2 * self.vocab * Self::HIDDEN + Self::HIDDEN)
    }
}

/// The benchmarks' synthetic gpt-oss of about `gb` GB as stored under
/// `$VOOM_HOME/bench` (named by its shape), written once and reused.
pub fn bench_gpt_oss_model(gb: f64) -> Result<std::path::PathBuf> {
    let shape = SynthGptOssShape::of_size(gb);
    bench_dir(
        &format!("gpt-oss-synthetic-{}l-mxfp4", shape.layers),
        &format!(
            "a synthetic gpt-oss ({} layers of 32 MXFP4 experts, {:.2} GB as stored)",
            shape.layers,
            shape.bytes() as f64 / 1e9
        ),
        |dir| write_gpt_oss(dir, shape, 0x5eed),
    )
}

/// Writes `config.json` (gpt-oss-20b's, with `quantization_config` mxfp4) and
/// `model.safetensors` of a random gpt-oss into `dir`: the experts MXFP4 as released
/// (`{proj}_blocks` / `_scales`, outputs as rows), the rest BF16.
pub fn write_gpt_oss(dir: &Path, shape: SynthGptOssShape, seed: u64) -> Result<()> {
    type S = SynthGptOssShape;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let h = S::HIDDEN;
    let (q, kv) = (S::HEADS * S::HEAD_DIM, S::KV_HEADS * S::HEAD_DIM);
    let mut t = Tensors::default();
    t.embedding(shape.vocab, h);
    for i in 0..shape.layers {
        let p = format!("model.layers.{i}");
        t.attention(&p, h, q, kv);
        for (name, n) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("o_proj", h)] {
            t.push(format!("{p}.self_attn.{name}.bias"), vec![n], 0.02, 0.0);
        }
        t.push(format!("{p}.self_attn.sinks"), vec![S::HEADS], 1.0, 0.0);
        t.linear(format!("{p}.mlp.router.weight"), S::EXPERTS, h);
        t.push(format!("{p}.mlp.router.bias"), vec![S::EXPERTS], 0.1, 0.0);
        let x = format!("{p}.mlp.experts");
        t.mxfp4(&format!("{x}.gate_up_proj"), S::EXPERTS, 2 * S::INTER, h);
        t.push(
            format!("{x}.gate_up_proj_bias"),
            vec![S::EXPERTS, 2 * S::INTER],
            0.02,
            0.0,
        );
        t.mxfp4(&format!("{x}.down_proj"), S::EXPERTS, h, S::INTER);
        t.push(
            format!("{x}.down_proj_bias"),
            vec![S::EXPERTS, h],
            0.02,
            0.0,
        );
    }
    t.head(shape.vocab, h);
    let layer_types: Vec<&str> = (0..shape.layers)
        .map(|i| match i % 2 {
            0 => "sliding_attention",
            _ => "full_attention",
        })
        .collect();
    let config = serde_json::json!({
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": true,
        "hidden_size": h,
        "intermediate_size": S::INTER,
        "num_local_experts": S::EXPERTS,
        "num_experts_per_tok": S::TOP_K,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": S::HEADS,
        "num_key_value_heads": S::KV_HEADS,
        "head_dim": S::HEAD_DIM,
        "layer_types": layer_types,
        "sliding_window": 128,
        "vocab_size": shape.vocab,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": false, "original_max_position_embeddings": 4096},
        "swiglu_limit": 7.0,
        "tie_word_embeddings": false,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router",
            "model.embed_tokens", "lm_head"]},
        "voom_synthetic": {"seed": seed},
    });
    t.write(dir, seed, &config)?;
    // A page manifest, as `voom import` writes: it pages the stacked experts one
    // expert at a time, so a token reads the experts its router picks.
    let ckpt = voom_formats::Checkpoint::open(dir)?;
    voom_formats::Manifest::build(&ckpt, &mut |_, _| {})?.save(dir)?;
    Ok(())
}

/// Writes `config.json` (the released form: `full_attention_interval`, top-level
/// rope) and `model.safetensors` of a random Qwen3-Next into `dir`: zero-centred
/// norms drawn about 0, decays (`A_log`, `dt_bias`) about their released ranges.
pub fn write_qwen3_next(dir: &Path, shape: SynthHybridShape, seed: u64) -> Result<()> {
    type S = SynthHybridShape;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let h = shape.hidden;
    let (k, v) = (
        S::KEY_HEADS * S::LINEAR_HEAD,
        S::VALUE_HEADS * S::LINEAR_HEAD,
    );
    let (q, kv) = (S::HEADS * S::HEAD_DIM, S::KV_HEADS * S::HEAD_DIM);
    let mut t = Tensors::default();
    t.embedding(shape.vocab, h);
    for i in 0..shape.layers {
        let p = format!("model.layers.{i}");
        t.push(format!("{p}.input_layernorm.weight"), vec![h], 0.1, 0.0);
        t.push(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            0.1,
            0.0,
        );
        if (i + 1) % 4 == 0 {
            let a = format!("{p}.self_attn");
            t.linear(format!("{a}.q_proj.weight"), 2 * q, h);
            t.linear(format!("{a}.k_proj.weight"), kv, h);
            t.linear(format!("{a}.v_proj.weight"), kv, h);
            t.linear(format!("{a}.o_proj.weight"), h, q);
            t.push(format!("{a}.q_norm.weight"), vec![S::HEAD_DIM], 0.1, 0.0);
            t.push(format!("{a}.k_norm.weight"), vec![S::HEAD_DIM], 0.1, 0.0);
        } else {
            let a = format!("{p}.linear_attn");
            t.linear(format!("{a}.in_proj_qkvz.weight"), 2 * k + 2 * v, h);
            t.linear(format!("{a}.in_proj_ba.weight"), 2 * S::VALUE_HEADS, h);
            t.push(
                format!("{a}.conv1d.weight"),
                vec![2 * k + v, 1, S::CONV],
                0.3,
                0.0,
            );
            t.push(format!("{a}.A_log"), vec![S::VALUE_HEADS], 1.0, 1.0);
            t.push(format!("{a}.dt_bias"), vec![S::VALUE_HEADS], 1.0, 0.0);
            t.norm(format!("{a}.norm.weight"), S::LINEAR_HEAD);
            t.linear(format!("{a}.out_proj.weight"), h, v);
        }
        let m = format!("{p}.mlp");
        t.linear(format!("{m}.gate.weight"), shape.experts, h);
        for e in 0..shape.experts {
            let x = format!("{m}.experts.{e}");
            t.linear(format!("{x}.gate_proj.weight"), S::EXPERT, h);
            t.linear(format!("{x}.up_proj.weight"), S::EXPERT, h);
            t.linear(format!("{x}.down_proj.weight"), h, S::EXPERT);
        }
        t.linear(format!("{m}.shared_expert.gate_proj.weight"), S::EXPERT, h);
        t.linear(format!("{m}.shared_expert.up_proj.weight"), S::EXPERT, h);
        t.linear(format!("{m}.shared_expert.down_proj.weight"), h, S::EXPERT);
        t.linear(format!("{m}.shared_expert_gate.weight"), 1, h);
    }
    t.push("model.norm.weight".into(), vec![h], 0.1, 0.0);
    t.linear("lm_head.weight".into(), shape.vocab, h);
    let config = serde_json::json!({
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": h,
        "intermediate_size": 5120,
        "num_hidden_layers": shape.layers,
        "full_attention_interval": 4,
        "num_attention_heads": S::HEADS,
        "num_key_value_heads": S::KV_HEADS,
        "head_dim": S::HEAD_DIM,
        "partial_rotary_factor": 0.25,
        "linear_conv_kernel_dim": S::CONV,
        "linear_key_head_dim": S::LINEAR_HEAD,
        "linear_value_head_dim": S::LINEAR_HEAD,
        "linear_num_key_heads": S::KEY_HEADS,
        "linear_num_value_heads": S::VALUE_HEADS,
        "num_experts": shape.experts,
        "num_experts_per_tok": shape.top_k,
        "moe_intermediate_size": S::EXPERT,
        "shared_expert_intermediate_size": S::EXPERT,
        "norm_topk_prob": true,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": shape.vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000000.0,
        "tie_word_embeddings": false,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
        "voom_synthetic": {"seed": seed},
    });
    t.write(dir, seed, &config)
}

/// Writes `config.json` and `model.safetensors` of a random Llama into `dir`.
pub fn write_llama(dir: &Path, shape: SynthShape, seed: u64) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let (h, inter) = (shape.hidden, shape.intermediate);
    let kvd = shape.kv_heads * (h / shape.heads);
    let mut t = Tensors::default();
    t.embedding(shape.vocab, h);
    for i in 0..shape.layers {
        let p = format!("model.layers.{i}");
        t.attention(&p, h, h, kvd);
        t.linear(format!("{p}.mlp.gate_proj.weight"), inter, h);
        t.linear(format!("{p}.mlp.up_proj.weight"), inter, h);
        t.linear(format!("{p}.mlp.down_proj.weight"), h, inter);
    }
    t.head(shape.vocab, h);
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "vocab_size": shape.vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": false,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
        "voom_synthetic": {"seed": seed},
    });
    t.write(dir, seed, &config)
}

/// A draft model for speculative decoding made from `src` itself: its first `layers`
/// decoder layers, its embedding, final norm and head (the checkpoint's own tensors,
/// copied), and its tokenizer: the target's vocabulary by construction, a third or a
/// quarter of its bytes per token. Written under `$VOOM_HOME/bench` once and reused.
/// (No smaller model of the same family is on this machine; this is the drafter the
/// layer-skipping self-speculative methods start from, untrained to exit early, so
/// its proposals are kept less often than a trained draft model's.)
pub fn first_layers_draft(src: &Path, layers: usize) -> Result<std::path::PathBuf> {
    let name = src
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let dir = crate::store::voom_home()?
        .join("bench")
        .join(format!("{name}-first-{layers}-layers"));
    if dir.join("model.safetensors").exists() && dir.join("config.json").exists() {
        return Ok(dir);
    }
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(src.join("config.json"))
            .with_context(|| format!("reading {}/config.json", src.display()))?,
    )?;
    let total = config["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
    if layers == 0 || layers >= total {
        anyhow::bail!(
            "a draft of {layers} layers from {} ({total} layers): give fewer layers than it has, at least one",
            src.display()
        );
    }
    config["num_hidden_layers"] = serde_json::json!(layers);
    let ckpt = voom_formats::Checkpoint::open(src)
        .with_context(|| format!("opening {}", src.display()))?;
    let keep = |n: &str| match n.strip_prefix("model.layers.") {
        Some(rest) => rest
            .split('.')
            .next()
            .and_then(|i| i.parse::<usize>().ok())
            .is_some_and(|i| i < layers),
        None => true,
    };
    let tensors: Vec<(&str, DType, &[usize], &[u8])> = ckpt
        .tensors()
        .filter(|(n, _)| keep(n))
        .map(|(n, loc)| {
            let bytes = ckpt.tensor_bytes(n).expect("listed tensors have bytes");
            (n, loc.info.dtype, loc.info.shape.as_slice(), bytes)
        })
        .collect();
    let tmp = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    voom_formats::safetensors::write(&tmp.join("model.safetensors"), &tensors, &meta)?;
    std::fs::write(
        tmp.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "special_tokens_map.json",
    ] {
        if src.join(f).exists() {
            std::fs::copy(src.join(f), tmp.join(f))?;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&tmp, &dir)?;
    Ok(dir)
}
