//! A synthetic DeepSeek-V3 as released: FP8 e4m3 linear weights with one F32 scale
//! per 128x128 block (`weight_scale_inv`, `quantization_config` fp8), MLA attention,
//! 256 routed experts of which 8 a token in groups, one shared expert, dense first
//! layers; DeepSeek-V3's widths, a smaller vocabulary, and as many layers as a size
//! gives. Written tensor by tensor (`synth::tensors`), so a checkpoint larger than
//! memory never is in memory.

use std::path::Path;

use anyhow::{Context, Result};
use voom_formats::DType;

use super::bench_dir;
use super::tensors::{Kind, Tensors};

/// Shape of a synthetic DeepSeek-V3: `dense` dense layers first, then MoE layers,
/// of DeepSeek-V3's widths ([`Widths::V3`]).
#[derive(Debug, Clone, Copy)]
pub struct SynthDeepseekShape {
    pub layers: usize,
    pub dense: usize,
    pub vocab: usize,
    pub widths: Widths,
}

/// The widths of a DeepSeek-V3 (its `config.json`'s names).
#[derive(Debug, Clone, Copy)]
pub struct Widths {
    pub hidden: usize,
    pub heads: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    pub nope: usize,
    pub rope: usize,
    pub v_head: usize,
    pub inter: usize,
    pub expert_inter: usize,
    pub experts: usize,
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub shared: usize,
    /// The FP8 scale blocks' side.
    pub block: usize,
}

impl Widths {
    /// DeepSeek-V3's (and R1's).
    pub const V3: Widths = Widths {
        hidden: 7168,
        heads: 128,
        q_lora: 1536,
        kv_lora: 512,
        nope: 128,
        rope: 64,
        v_head: 128,
        inter: 18432,
        expert_inter: 2048,
        experts: 256,
        top_k: 8,
        n_group: 8,
        topk_group: 4,
        shared: 1,
        block: 128,
    };
}

impl SynthDeepseekShape {
    /// Up to three dense layers and at least one MoE layer, as many as make about
    /// `gb` GB as stored.
    pub fn of_size(gb: f64) -> SynthDeepseekShape {
        let mut s = SynthDeepseekShape {
            layers: 2,
            dense: 1,
            vocab: 32000,
            widths: Widths::V3,
        };
        let mut room = ((gb * 1e9) as usize).saturating_sub(s.fixed_bytes());
        let moe = s.layer_bytes(false);
        let dense = s.layer_bytes(true);
        // One MoE layer always; dense layers (up to three) from what is left, then
        // more MoE layers.
        room = room.saturating_sub(moe);
        s.dense = (room / dense).clamp(1, 3);
        room = room.saturating_sub(s.dense * dense);
        s.layers = s.dense + 1 + room / moe;
        s
    }

    /// Bytes of the embedding, final norm and head as stored.
    fn fixed_bytes(&self) -> usize {
        plan(SynthDeepseekShape { layers: 0, ..*self }).bytes()
    }

    /// Bytes of one layer as stored.
    fn layer_bytes(&self, dense: bool) -> usize {
        let mut t = Tensors::default();
        plan_layer(&mut t, &self.widths, 0, dense);
        t.bytes()
    }

    /// Bytes as stored (of the tensors [`write_deepseek_v3_fp8`] writes).
    pub fn bytes(&self) -> usize {
        plan(*self).bytes()
    }
}

/// Layer `i`'s tensors: norms, MLA attention, and a dense MLP or the router, the
/// routed experts and the shared expert.
fn plan_layer(t: &mut Tensors, w: &Widths, i: usize, dense: bool) {
    let (h, b) = (w.hidden, w.block);
    let p = format!("model.layers.{i}");
    t.norm(format!("{p}.input_layernorm.weight"), h);
    t.norm(format!("{p}.post_attention_layernorm.weight"), h);
    t.norm(format!("{p}.self_attn.q_a_layernorm.weight"), w.q_lora);
    t.norm(format!("{p}.self_attn.kv_a_layernorm.weight"), w.kv_lora);
    let a = format!("{p}.self_attn");
    t.fp8(&format!("{a}.q_a_proj"), b, w.q_lora, h);
    t.fp8(
        &format!("{a}.q_b_proj"),
        b,
        w.heads * (w.nope + w.rope),
        w.q_lora,
    );
    t.fp8(&format!("{a}.kv_a_proj_with_mqa"), b, w.kv_lora + w.rope, h);
    t.fp8(
        &format!("{a}.kv_b_proj"),
        b,
        w.heads * (w.nope + w.v_head),
        w.kv_lora,
    );
    t.fp8(&format!("{a}.o_proj"), b, h, w.heads * w.v_head);
    let m = format!("{p}.mlp");
    let swiglu = |t: &mut Tensors, x: &str, inter: usize| {
        t.fp8(&format!("{x}.gate_proj"), b, inter, h);
        t.fp8(&format!("{x}.up_proj"), b, inter, h);
        t.fp8(&format!("{x}.down_proj"), b, h, inter);
    };
    if dense {
        swiglu(t, &m, w.inter);
        return;
    }
    t.push(
        format!("{m}.gate.weight"),
        vec![w.experts, h],
        (3.0 / h as f32).sqrt(),
        0.0,
    );
    t.add(
        format!("{m}.gate.e_score_correction_bias"),
        DType::F32,
        vec![w.experts],
        Kind::F32 {
            scale: 0.05,
            offset: 0.0,
        },
    );
    for e in 0..w.experts {
        swiglu(t, &format!("{m}.experts.{e}"), w.expert_inter);
    }
    swiglu(t, &format!("{m}.shared_experts"), w.shared * w.expert_inter);
}

/// Every tensor of the checkpoint, in file order.
fn plan(shape: SynthDeepseekShape) -> Tensors {
    let h = shape.widths.hidden;
    let mut t = Tensors::default();
    t.embedding(shape.vocab, h);
    for i in 0..shape.layers {
        plan_layer(&mut t, &shape.widths, i, i < shape.dense);
    }
    t.head(shape.vocab, h);
    t
}

/// The benchmarks' synthetic FP8 DeepSeek-V3 of about `gb` GB as stored under
/// `$VOOM_HOME/bench` (named by its shape), written once and reused.
pub fn bench_deepseek_fp8_model(gb: f64) -> Result<std::path::PathBuf> {
    let shape = SynthDeepseekShape::of_size(gb);
    bench_dir(
        &format!(
            "deepseek-v3-synthetic-{}l-{}d-fp8",
            shape.layers, shape.dense
        ),
        &format!(
            "a synthetic DeepSeek-V3 ({} layers, {} dense, 256 FP8 experts, {:.2} GB as stored)",
            shape.layers,
            shape.dense,
            shape.bytes() as f64 / 1e9
        ),
        |dir| write_deepseek_v3_fp8(dir, shape, 0x5eed),
    )
}

/// Writes `config.json` (DeepSeek-V3's as released, with fewer layers, a smaller
/// vocabulary and no MTP layer) and `model.safetensors` into `dir`, and a page
/// manifest as `voom import` writes (one page per expert and projection).
pub fn write_deepseek_v3_fp8(dir: &Path, shape: SynthDeepseekShape, seed: u64) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let w = &shape.widths;
    let mut config = serde_json::json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "attention_bias": false,
        "hidden_size": w.hidden,
        "intermediate_size": w.inter,
        "moe_intermediate_size": w.expert_inter,
        "n_routed_experts": w.experts,
        "n_shared_experts": w.shared,
        "num_experts_per_tok": w.top_k,
        "n_group": w.n_group,
        "topk_group": w.topk_group,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": true,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": shape.dense,
        "moe_layer_freq": 1,
        "num_hidden_layers": shape.layers,
        "num_nextn_predict_layers": 0,
        "num_attention_heads": w.heads,
        "num_key_value_heads": w.heads,
        "q_lora_rank": w.q_lora,
        "kv_lora_rank": w.kv_lora,
        "qk_nope_head_dim": w.nope,
        "qk_rope_head_dim": w.rope,
        "v_head_dim": w.v_head,
    });
    // (Two objects: one is past `json!`'s recursion limit.)
    let rest = serde_json::json!({
        "vocab_size": shape.vocab,
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
        "tie_word_embeddings": false,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
            "quant_method": "fp8", "weight_block_size": [w.block, w.block]},
        "voom_synthetic": {"seed": seed},
    });
    if let (Some(c), serde_json::Value::Object(r)) = (config.as_object_mut(), rest) {
        c.extend(r);
    }
    plan(shape).write(dir, seed, &config)?;
    let ckpt = voom_formats::Checkpoint::open(dir)?;
    voom_formats::Manifest::build(&ckpt, &mut |_, _| {})?.save(dir)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_count_what_is_written() {
        let s = SynthDeepseekShape::of_size(14.5);
        assert_eq!((s.dense, s.layers), (3, 4), "{s:?}");
        assert!(
            (13.5e9..14.5e9).contains(&(s.bytes() as f64)),
            "{}",
            s.bytes()
        );
        assert_eq!(
            SynthDeepseekShape::of_size(1.0).layers,
            2,
            "one dense, one MoE at least"
        );
    }

    /// DeepSeek-V3's structure at small widths: what the writer makes opens as an
    /// FP8 deepseek_v3 (MLA, grouped routing, a shared expert, a dense first layer)
    /// whose logits are finite, its experts paged one expert a page.
    #[test]
    fn a_small_one_opens_and_runs_as_fp8_deepseek_v3() {
        use libvoom::engine::{Engine, EngineOptions};
        let d = tempfile::tempdir().unwrap();
        let shape = SynthDeepseekShape {
            layers: 3,
            dense: 1,
            vocab: 300,
            widths: Widths {
                hidden: 256,
                heads: 4,
                q_lora: 96,
                kv_lora: 64,
                nope: 32,
                rope: 16,
                v_head: 32,
                inter: 384,
                expert_inter: 64,
                experts: 16,
                top_k: 4,
                n_group: 4,
                topk_group: 2,
                shared: 1,
                block: 32,
            },
        };
        write_deepseek_v3_fp8(d.path(), shape, 3).unwrap();
        let written = std::fs::metadata(d.path().join("model.safetensors"))
            .unwrap()
            .len();
        assert!(
            written as usize > shape.bytes(),
            "{written} {}",
            shape.bytes()
        );
        let e = Engine::open(d.path(), EngineOptions::default()).unwrap();
        let cfg = e.config();
        assert_eq!(cfg.arch.name(), "deepseek_v3");
        let mut kv = e.new_kv();
        let logits = e.forward_all(&mut kv, &[5, 17, 200, 3]).unwrap();
        assert_eq!(logits.len(), 4 * 300);
        assert!(logits.iter().all(|v| v.is_finite()));
        let spread = logits.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(
            spread > 0.01 && spread < 1e3,
            "logits of about unit size: {spread}"
        );
        let m = voom_formats::Manifest::load(d.path())
            .unwrap()
            .expect("a manifest");
        assert!(m.pages.len() > 3 * 16, "{} pages", m.pages.len());
    }
}
