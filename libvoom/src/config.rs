//! Hugging Face `config.json` to the internal model configuration.
//!
//! The HF struct ([`HfConfig`]) is kept apart from the internal one ([`ModelConfig`]):
//! every option that changes arithmetic is either understood here or rejected with an
//! error naming it. A config vOOM half-understands would give a wrong answer.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::VoomError;

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
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }
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
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
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
    /// Per-head RMSNorm on q and k (Qwen3).
    pub qk_norm: bool,
    /// Per layer: `Some(w)` when the layer attends only to the last `w` positions
    /// (the query's own included), `None` for full causal attention.
    pub sliding_window: Vec<Option<usize>>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// The subset of HF `config.json` keys vOOM reads. Unknown keys are ignored unless
/// they are checked explicitly in [`ModelConfig::from_hf`].
#[derive(Debug, Deserialize)]
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
}

fn ids_of(v: &Option<Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect(),
        _ => vec![],
    }
}

impl ModelConfig {
    /// Reads `config.json` in a model directory.
    pub fn from_dir(dir: &Path) -> Result<Self, VoomError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| VoomError::Config {
            path: path.clone(),
            detail: format!("cannot read: {e}"),
        })?;
        Self::from_json(&text, &path)
    }

    /// Parses `config.json` text; `path` is used in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<Self, VoomError> {
        let hf: HfConfig = serde_json::from_str(text).map_err(|e| VoomError::Config {
            path: path.to_path_buf(),
            detail: format!("not a valid config.json: {e}"),
        })?;
        Self::from_hf(&hf, path)
    }

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
            other => {
                return Err(err(format!(
                    "unsupported model_type '{other}' (supported: llama, mistral, qwen2, qwen3)"
                )))
            }
        };
        if let Some(q) = &hf.quantization_config {
            if !q.is_null() {
                return Err(err(
                    "quantized checkpoints ('quantization_config') are not supported in exact mode"
                        .into(),
                ));
            }
        }
        let act = hf.hidden_act.as_deref().unwrap_or("silu");
        if act != "silu" {
            return Err(err(format!(
                "unsupported hidden_act '{act}' (supported: silu)"
            )));
        }
        if let Some(f) = hf.partial_rotary_factor {
            if f != 1.0 {
                return Err(err(format!("unsupported partial_rotary_factor {f}")));
            }
        }
        if let Some(tp) = hf.pretraining_tp {
            if tp != 1 {
                return Err(err(format!("unsupported pretraining_tp {tp}")));
            }
        }

        let hidden_size = need(hf.hidden_size, "hidden_size")?;
        let intermediate_size = need(hf.intermediate_size, "intermediate_size")?;
        let num_layers = need(hf.num_hidden_layers, "num_hidden_layers")?;
        let num_heads = need(hf.num_attention_heads, "num_attention_heads")?;
        let num_kv_heads = need(
            hf.num_key_value_heads.or(Some(num_heads)),
            "num_key_value_heads",
        )?;
        if num_heads % num_kv_heads != 0 {
            return Err(err(format!(
                "num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )));
        }
        let head_dim = match hf.head_dim {
            Some(d) => need(Some(d), "head_dim")?,
            None => {
                if hidden_size % num_heads != 0 {
                    return Err(err(format!(
                        "hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads} and no head_dim is given"
                    )));
                }
                hidden_size / num_heads
            }
        };
        if head_dim % 2 != 0 {
            return Err(err(format!(
                "head_dim {head_dim} must be even for rotary embeddings"
            )));
        }
        let vocab_size = need(hf.vocab_size, "vocab_size")?;
        let max_position_embeddings = need(hf.max_position_embeddings, "max_position_embeddings")?;
        let rms_norm_eps = hf.rms_norm_eps.unwrap_or(1e-6) as f32;

        // Rope: transformers 5 writes `rope_parameters` ({rope_type, rope_theta, ...});
        // older configs have top-level `rope_theta` and optional `rope_scaling`.
        let mut rope_theta = hf.rope_theta;
        let mut scaling: Option<&Value> = hf.rope_scaling.as_ref().filter(|v| !v.is_null());
        if let Some(p) = hf.rope_parameters.as_ref().filter(|v| !v.is_null()) {
            let obj = p
                .as_object()
                .ok_or_else(|| err("'rope_parameters' must be an object".into()))?;
            if obj.values().any(|v| v.is_object()) {
                return Err(err(
                    "per-layer-type 'rope_parameters' are not supported".into()
                ));
            }
            if let Some(t) = obj.get("rope_theta") {
                rope_theta =
                    Some(t.as_f64().ok_or_else(|| {
                        err("'rope_parameters.rope_theta' must be a number".into())
                    })?);
            }
            scaling = Some(p);
        }
        let rope_theta = rope_theta.unwrap_or(10000.0) as f32;
        let rope_scaling = match scaling {
            None => RopeScaling::Default,
            Some(s) => parse_rope_scaling(s).map_err(err)?,
        };

        let default_tie = false;
        let tie_word_embeddings = hf.tie_word_embeddings.unwrap_or(default_tie);
        let attention_bias = hf.attention_bias.unwrap_or(false);
        let (qkv_bias, o_bias) = match arch {
            // Qwen2 always has q/k/v bias and never an output bias.
            Arch::Qwen2 => (true, false),
            Arch::Mistral => (false, false),
            Arch::Llama | Arch::Qwen3 => (attention_bias, attention_bias),
        };
        let mlp_bias = match arch {
            Arch::Llama => hf.mlp_bias.unwrap_or(false),
            _ => false,
        };

        let sliding_window = sliding_windows(hf, arch, num_layers).map_err(err)?;

        Ok(ModelConfig {
            arch,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            max_position_embeddings,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            tie_word_embeddings,
            qkv_bias,
            o_bias,
            mlp_bias,
            qk_norm: arch == Arch::Qwen3,
            sliding_window,
            bos_token_id: ids_of(&hf.bos_token_id).first().copied(),
            eos_token_ids: ids_of(&hf.eos_token_id),
        })
    }
}

fn parse_rope_scaling(s: &Value) -> Result<RopeScaling, String> {
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
    match ty {
        "default" => Ok(RopeScaling::Default),
        "llama3" => {
            let factor = num("factor")?;
            let low = num("low_freq_factor")?;
            let high = num("high_freq_factor")?;
            let orig = num("original_max_position_embeddings")?;
            if factor <= 0.0 || low <= 0.0 || high <= low || orig < 1.0 {
                return Err(format!(
                    "invalid llama3 rope scaling: factor {factor}, low_freq_factor {low}, high_freq_factor {high}, original_max_position_embeddings {orig}"
                ));
            }
            Ok(RopeScaling::Llama3 {
                factor: factor as f32,
                low_freq_factor: low as f32,
                high_freq_factor: high as f32,
                original_max_position_embeddings: orig as usize,
            })
        }
        other => Err(format!(
            "unsupported rope scaling type '{other}' (supported: default, llama3)"
        )),
    }
}

fn sliding_windows(
    hf: &HfConfig,
    arch: Arch,
    num_layers: usize,
) -> Result<Vec<Option<usize>>, String> {
    let window = match &hf.sliding_window {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().filter(|&w| w > 0).ok_or_else(|| {
            format!("'sliding_window' must be a positive integer or null, got {v}")
        })? as usize),
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
                "sliding_attention" => window.map(Some).ok_or_else(|| {
                    format!("layer {i} is 'sliding_attention' but 'sliding_window' is not set")
                }),
                other => Err(format!("unsupported layer type '{other}' at layer {i}")),
            })
            .collect();
    }
    match arch {
        // Mistral applies its window on every layer.
        Arch::Mistral => Ok(vec![window; num_layers]),
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<ModelConfig, VoomError> {
        ModelConfig::from_json(json, Path::new("config.json"))
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
        assert!(!c.tie_word_embeddings && !c.qkv_bias && !c.qk_norm);
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
    fn qwen_flags() {
        let c = parse(&format!(
            r#"{{"model_type": "qwen2", {BASE}, "num_key_value_heads": 1}}"#
        ))
        .unwrap();
        assert!(c.qkv_bias && !c.o_bias && !c.qk_norm);
        assert_eq!(c.num_kv_heads, 1);
        let c = parse(&format!(
            r#"{{"model_type": "qwen3", {BASE}, "head_dim": 32}}"#
        ))
        .unwrap();
        assert!(c.qk_norm && !c.qkv_bias);
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
            r#"{{"model_type": "llama", {BASE}, "rope_scaling": {{"rope_type": "yarn", "factor": 4.0}}}}"#
        ))
        .unwrap_err();
        assert!(e.to_string().contains("yarn"), "{e}");
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
}
