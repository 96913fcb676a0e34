//! The `quantization_config` of a checkpoint's `config.json`: how its weights are
//! stored when they are not BF16 (`docs/engine.md`, "Weights in low precision").
//!
//! Exact mode computes on the weights as stored: an FP8 weight is its e4m3 value
//! times its block's scale (rounded once to f32), an MXFP4 weight its e2m1 value
//! times a power of two. Activations are never quantized. Only what a release vOOM
//! knows uses is accepted; anything else is an error naming the key and value.
//!
//! Lossy mode (`docs/lossy.md`): `quant_method: "gguf"` is a model whose weights are
//! ggml's block formats as a GGUF stored them (`voom import FILE.gguf`), each listed
//! with its type; such a model is lossy, and only a `lossy-` model id names one.

use std::collections::BTreeMap;

use serde_json::Value;
use voom_formats::gguf::{dequantizes, GgmlType};

/// How the checkpoint's quantized weights are stored.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Quantization {
    /// No `quantization_config`: every weight is BF16, F16 or F32.
    #[default]
    None,
    /// `quant_method: "fp8"`, `fmt: "e4m3"`, `weight_block_size: [rows, cols]`:
    /// FP8 weights (`*.weight`, F8_E4M3) each with `*.weight_scale_inv`, one F32 or
    /// BF16 scale per block (DeepSeek-V3/R1, Qwen3-FP8).
    Fp8 {
        block_rows: usize,
        block_cols: usize,
        not_convert: Vec<String>,
    },
    /// `quant_method: "mxfp4"`: the experts as `*_blocks` (packed e2m1 pairs) with
    /// `*_scales` (e8m0, one per 32) (gpt-oss).
    Mxfp4 { not_convert: Vec<String> },
    /// `quant_method: "gguf"` (lossy): `tensor_types` maps each quantized tensor's
    /// name to its ggml type (`"Q4_K"`), the tensor stored as U8 rows of whole
    /// blocks, `[rows, row bytes]` (`[count, rows, row bytes]` for fused experts);
    /// `scheme` names the mix (`q4_k_m`, the GGUF's file type), for labels.
    Gguf {
        scheme: String,
        types: BTreeMap<String, GgmlType>,
    },
}

impl Quantization {
    /// Reads `quantization_config` (`None` when absent). The error says which key
    /// holds what vOOM does not run.
    pub fn from_config(q: Option<&Value>) -> Result<Quantization, String> {
        let Some(q) = q else {
            return Ok(Quantization::None);
        };
        let Some(obj) = q.as_object() else {
            return Err("'quantization_config' is not an object".into());
        };
        let text = |key: &str| -> Result<Option<&str>, String> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s)),
                Some(other) => Err(format!(
                    "'quantization_config.{key}' is {other}, not a string"
                )),
            }
        };
        let not_convert = match obj.get("modules_to_not_convert") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_str().map(str::to_string).ok_or_else(|| {
                        format!(
                            "'quantization_config.modules_to_not_convert' holds {v}, not a name"
                        )
                    })
                })
                .collect::<Result<_, _>>()?,
            Some(other) => {
                return Err(format!(
                    "'quantization_config.modules_to_not_convert' is {other}, not a list"
                ))
            }
        };
        match text("quant_method")? {
            Some("fp8") => {
                match text("fmt")? {
                    None | Some("e4m3") => {}
                    Some(other) => {
                        return Err(format!(
                            "'quantization_config.fmt' is '{other}': FP8 weights are run in \
                             e4m3 only (no release vOOM knows stores {other})"
                        ))
                    }
                }
                match text("activation_scheme")? {
                    None | Some("dynamic") => {}
                    Some(other) => {
                        return Err(format!(
                            "'quantization_config.activation_scheme' is '{other}': only \
                             'dynamic' is run (exact mode never quantizes activations, and a \
                             static scheme's activation scales would be left out)"
                        ))
                    }
                }
                let block = match obj.get("weight_block_size") {
                    Some(Value::Array(a)) if a.len() == 2 => {
                        let dims: Vec<Option<usize>> = a
                            .iter()
                            .map(|v| v.as_u64().and_then(|n| usize::try_from(n).ok()))
                            .collect();
                        match dims[..] {
                            [Some(r), Some(c)] if r > 0 && c >= 8 && c.is_power_of_two() => (r, c),
                            _ => {
                                return Err(format!(
                                    "'quantization_config.weight_block_size' is {}: blocks of \
                                     columns are a power of two, at least 8 (releases use \
                                     [128, 128])",
                                    Value::Array(a.clone())
                                ))
                            }
                        }
                    }
                    None | Some(Value::Null) => {
                        return Err("'quantization_config' of fp8 has no 'weight_block_size': \
                                    per-tensor FP8 scales are not supported"
                            .into())
                    }
                    Some(other) => {
                        return Err(format!(
                            "'quantization_config.weight_block_size' is {other}, not [rows, cols]"
                        ))
                    }
                };
                Ok(Quantization::Fp8 {
                    block_rows: block.0,
                    block_cols: block.1,
                    not_convert,
                })
            }
            Some("mxfp4") => Ok(Quantization::Mxfp4 { not_convert }),
            Some("gguf") => {
                let scheme = text("scheme")?
                    .ok_or("'quantization_config' of gguf has no 'scheme'")?
                    .to_string();
                let Some(Value::Object(map)) = obj.get("tensor_types") else {
                    return Err("'quantization_config' of gguf has no 'tensor_types' object".into());
                };
                let mut types = BTreeMap::new();
                for (name, v) in map {
                    let t = v.as_str().and_then(ggml_type_named).ok_or_else(|| {
                        format!("'quantization_config.tensor_types.{name}' is {v}, not a ggml type")
                    })?;
                    if !dequantizes(t) {
                        return Err(format!(
                            "'quantization_config.tensor_types.{name}' is {t}, which vOOM does \
                             not run (see docs/lossy.md for the types it does)"
                        ));
                    }
                    types.insert(name.clone(), t);
                }
                Ok(Quantization::Gguf { scheme, types })
            }
            Some(other) => Err(format!(
                "'quantization_config.quant_method' is '{other}' (exact mode runs 'fp8' with \
                 block scales and 'mxfp4'; lossy formats are for lossy- models)"
            )),
            None => Err("'quantization_config' has no 'quant_method'".into()),
        }
    }

    /// Its name in messages: `FP8 e4m3 128x128`, `MXFP4`, `BF16`.
    pub fn describe(&self) -> String {
        match self {
            Quantization::None => "unquantized".into(),
            Quantization::Fp8 {
                block_rows,
                block_cols,
                ..
            } => format!("FP8 e4m3 {block_rows}x{block_cols}"),
            Quantization::Mxfp4 { .. } => "MXFP4".into(),
            Quantization::Gguf { scheme, .. } => format!("GGUF {scheme} (lossy)"),
        }
    }

    /// Whether the weights are not the published ones (lossy mode).
    pub fn is_lossy(&self) -> bool {
        matches!(self, Quantization::Gguf { .. })
    }

    /// The scheme a lossy model's labels name (`q4_k_m`), `None` for an exact one.
    pub fn scheme(&self) -> Option<&str> {
        match self {
            Quantization::Gguf { scheme, .. } => Some(scheme),
            _ => None,
        }
    }

    /// The ggml type tensor `name` (its stored name) is kept in, if it is one.
    pub fn ggml_type(&self, name: &str) -> Option<GgmlType> {
        match self {
            Quantization::Gguf { types, .. } => types.get(name).copied(),
            _ => None,
        }
    }

    /// The modules left unquantized (`modules_to_not_convert`).
    pub fn not_convert(&self) -> &[String] {
        match self {
            Quantization::None | Quantization::Gguf { .. } => &[],
            Quantization::Fp8 { not_convert, .. } | Quantization::Mxfp4 { not_convert } => {
                not_convert
            }
        }
    }

    /// Whether tensor `name` lies in a module `modules_to_not_convert` names: a
    /// pattern of dot-separated segments (`*` one segment of any name) matching a run
    /// of the name's segments (`model.layers.*.self_attn` holds
    /// `model.layers.3.self_attn.q_proj.weight`; `lm_head` holds `lm_head.weight`).
    pub fn left_unconverted(&self, name: &str) -> bool {
        let segs: Vec<&str> = name.split('.').collect();
        self.not_convert().iter().any(|p| {
            let pat: Vec<&str> = p.split('.').collect();
            !pat.is_empty()
                && segs
                    .windows(pat.len())
                    .any(|w| w.iter().zip(&pat).all(|(s, p)| *p == "*" || p == s))
        })
    }
}

/// The ggml type named `name` as ggml names it (`"Q4_K"`).
pub fn ggml_type_named(name: &str) -> Option<GgmlType> {
    (0..64)
        .filter_map(GgmlType::from_id)
        .find(|t| t.name() == name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn q(v: Value) -> Result<Quantization, String> {
        Quantization::from_config(Some(&v))
    }

    #[test]
    fn the_releases_configs_read() {
        // DeepSeek-V3 / R1.
        let ds = q(json!({"activation_scheme": "dynamic", "fmt": "e4m3",
            "quant_method": "fp8", "weight_block_size": [128, 128]}))
        .unwrap();
        assert_eq!(
            ds,
            Quantization::Fp8 {
                block_rows: 128,
                block_cols: 128,
                not_convert: vec![]
            }
        );
        // gpt-oss.
        let oss = q(
            json!({"modules_to_not_convert": ["model.layers.*.self_attn",
            "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
            "quant_method": "mxfp4"}),
        )
        .unwrap();
        assert!(oss.left_unconverted("model.layers.12.self_attn.q_proj.weight"));
        assert!(oss.left_unconverted("model.layers.0.mlp.router.bias"));
        assert!(oss.left_unconverted("lm_head.weight"));
        assert!(!oss.left_unconverted("model.layers.0.mlp.experts.down_proj_blocks"));
        assert!(!oss.left_unconverted("model.layers.0.self_attention.x"));
        assert_eq!(Quantization::from_config(None).unwrap(), Quantization::None);
    }

    #[test]
    fn gguf_tensor_types_read_and_bad_ones_are_named() {
        let g = q(json!({"quant_method": "gguf", "scheme": "q4_k_m",
            "tensor_types": {"model.layers.0.mlp.down_proj.weight": "Q6_K",
                             "model.layers.0.mlp.up_proj.weight": "Q4_K"}}))
        .unwrap();
        assert!(g.is_lossy());
        assert_eq!(g.scheme(), Some("q4_k_m"));
        assert_eq!(
            g.ggml_type("model.layers.0.mlp.down_proj.weight"),
            Some(GgmlType::Q6_K)
        );
        assert_eq!(g.ggml_type("model.norm.weight"), None);
        assert_eq!(g.describe(), "GGUF q4_k_m (lossy)");
        assert!(!Quantization::None.is_lossy());
        for (v, needle) in [
            (
                json!({"quant_method": "gguf", "tensor_types": {}}),
                "no 'scheme'",
            ),
            (
                json!({"quant_method": "gguf", "scheme": "x"}),
                "'tensor_types'",
            ),
            (
                json!({"quant_method": "gguf", "scheme": "x", "tensor_types": {"a": "Q9_K"}}),
                "tensor_types.a' is \"Q9_K\"",
            ),
            (
                json!({"quant_method": "gguf", "scheme": "x", "tensor_types": {"a": "IQ2_XXS"}}),
                "IQ2_XXS, which vOOM does not run",
            ),
        ] {
            let e = q(v).unwrap_err();
            assert!(e.contains(needle), "{e}");
        }
    }

    #[test]
    fn what_is_not_run_is_named() {
        for (v, needle) in [
            (json!({"quant_method": "gptq", "bits": 4}), "'gptq'"),
            (
                json!({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}),
                "'e5m2'",
            ),
            (
                json!({"quant_method": "fp8", "weight_block_size": [128, 100]}),
                "[128,100]",
            ),
            (
                json!({"quant_method": "fp8", "weight_block_size": [0, 128]}),
                "weight_block_size",
            ),
            (json!({"quant_method": "fp8"}), "per-tensor"),
            (
                json!({"quant_method": "fp8", "activation_scheme": "static",
                "weight_block_size": [128, 128]}),
                "'static'",
            ),
            (json!({"bits": 4}), "no 'quant_method'"),
            (json!([1]), "not an object"),
            (
                json!({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}),
                "not a list",
            ),
        ] {
            let e = q(v.clone()).unwrap_err();
            assert!(e.contains(needle), "{v}: {e}");
        }
    }
}
