//! The `llama` architecture: hyperparameters, `config.json`, and tensors renamed to
//! Hugging Face names with llama.cpp's Q/K row permutation undone.

use std::path::PathBuf;

use serde_json::json;
use voom_formats::dtype::f32_to_bf16;
use voom_formats::gguf::{GgufFile, GgufTensorInfo};

use super::tokenizer::SpecialIds;
use super::ImportError;

/// Hyperparameters of a llama GGUF (`llama.*` keys).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Params {
    pub n_layer: u64,
    pub n_embd: u64,
    pub n_ff: u64,
    pub n_head: u64,
    pub n_head_kv: u64,
    pub head_dim: u64,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub context_length: u64,
    pub vocab_size: u64,
    /// No `output.weight`: the LM head is the embedding.
    pub tied: bool,
}

impl Params {
    pub fn from_gguf(g: &GgufFile) -> Result<Params, ImportError> {
        let path = g.path().to_path_buf();
        let req = |key: &str| -> Result<u64, ImportError> {
            Ok(g.get_u64(&format!("llama.{key}"))?
                .ok_or_else(|| g.missing_key(&format!("llama.{key}")))?)
        };
        let unsupported = |what: String| ImportError::Unsupported {
            path: path.clone(),
            what,
        };
        let n_layer = req("block_count")?;
        let n_embd = req("embedding_length")?;
        let n_ff = req("feed_forward_length")?;
        let n_head = req("attention.head_count")?;
        let n_head_kv = g
            .get_u64("llama.attention.head_count_kv")?
            .unwrap_or(n_head);
        let context_length = req("context_length")?;
        if n_head == 0 || n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(ImportError::Inconsistent {
                path,
                detail: format!("{n_head} attention heads cannot share {n_head_kv} KV heads"),
            });
        }
        let head_dim = match g.get_u64("llama.attention.key_length")? {
            Some(k) => k,
            None if n_embd % n_head == 0 => n_embd / n_head,
            None => {
                return Err(ImportError::Inconsistent {
                    path,
                    detail: format!(
                        "embedding length {n_embd} is not a multiple of {n_head} heads"
                    ),
                })
            }
        };
        let vocab_size = match g.get_u64("llama.vocab_size")? {
            Some(v) => v,
            None => g
                .get_str_array("tokenizer.ggml.tokens")?
                .ok_or_else(|| g.missing_key("tokenizer.ggml.tokens"))?
                .len() as u64,
        };
        // Sizes are bounded so that products of two of them fit u64, and the layer
        // count by the tensors present, before anything is computed or allocated from
        // them.
        for (key, x) in [
            ("embedding_length", n_embd),
            ("feed_forward_length", n_ff),
            ("attention.head_count", n_head),
            ("attention.key_length", head_dim),
            ("vocab_size", vocab_size),
        ] {
            if x == 0 || x > u64::from(u32::MAX) {
                return Err(ImportError::Inconsistent {
                    path,
                    detail: format!("llama.{key} = {x} is out of range"),
                });
            }
        }
        if let Some(v) = g.get_u64("llama.attention.value_length")? {
            if v != head_dim {
                return Err(unsupported(format!(
                    "value head size {v} different from key head size {head_dim}"
                )));
            }
        }
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(ImportError::Inconsistent {
                path,
                detail: format!("head size {head_dim} is not a positive even number"),
            });
        }
        if let Some(rot) = g.get_u64("llama.rope.dimension_count")? {
            if rot != head_dim {
                return Err(unsupported(format!(
                    "partial rotary embedding ({rot} of {head_dim} dims)"
                )));
            }
        }
        for key in ["llama.rope.scaling.type", "llama.rope.scaling.factor"] {
            match g.metadata(key) {
                None => {}
                Some(v) if v.as_str() == Some("none") => {}
                Some(v) => return Err(unsupported(format!("rope scaling ({key} = {v:?})"))),
            }
        }
        if g.get_u64("llama.expert_count")?.unwrap_or(0) > 0 {
            return Err(unsupported("mixture-of-experts llama".into()));
        }
        let rms_norm_eps = g
            .get_f32("llama.attention.layer_norm_rms_epsilon")?
            .ok_or_else(|| g.missing_key("llama.attention.layer_norm_rms_epsilon"))?;
        // llama.cpp's default when the key is absent.
        let rope_theta = g.get_f32("llama.rope.freq_base")?.unwrap_or(10000.0);
        for (key, x) in [
            ("attention.layer_norm_rms_epsilon", rms_norm_eps),
            ("rope.freq_base", rope_theta),
        ] {
            if !(x.is_finite() && x > 0.0) {
                return Err(ImportError::Inconsistent {
                    path,
                    detail: format!("llama.{key} is {x}, not a positive number"),
                });
            }
        }
        let n_tensors = g.tensors().len() as u64;
        if n_layer == 0 || n_layer > n_tensors / 9 {
            return Err(ImportError::Inconsistent {
                path,
                detail: format!(
                    "llama.block_count = {n_layer} but the file has {n_tensors} tensors (9 per layer)"
                ),
            });
        }
        Ok(Params {
            n_layer,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            rms_norm_eps,
            rope_theta,
            context_length,
            vocab_size,
            tied: g.tensor("output.weight").is_none(),
        })
    }

    /// `config.json` of `LlamaForCausalLM`.
    pub fn config_json(&self, ids: &SpecialIds) -> serde_json::Value {
        json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": false,
            "attention_dropout": 0.0,
            "bos_token_id": ids.bos,
            "eos_token_id": ids.eos,
            "pad_token_id": ids.pad,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.n_embd,
            "intermediate_size": self.n_ff,
            "max_position_embeddings": self.context_length,
            "mlp_bias": false,
            "num_attention_heads": self.n_head,
            "num_hidden_layers": self.n_layer,
            "num_key_value_heads": self.n_head_kv,
            "rms_norm_eps": shortest_f64(self.rms_norm_eps),
            "rope_scaling": null,
            "rope_theta": shortest_f64(self.rope_theta),
            "tie_word_embeddings": self.tied,
            "torch_dtype": "bfloat16",
            "dtype": "bfloat16",
            "use_cache": true,
            "vocab_size": self.vocab_size,
        })
    }
}

/// The f64 with the shortest decimal that reads back as `x` (1e-5 rather than
/// 9.999999747378752e-06): what the checkpoint's config said before llama.cpp stored
/// it as f32. Both round to the same f32, the precision the model computes in.
fn shortest_f64(x: f32) -> f64 {
    // `Display` for f32 prints the shortest round-tripping decimal, which parses as f64.
    x.to_string().parse().unwrap_or(x as f64)
}

/// Which projection a GGUF tensor is, for the row un-permutation.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rope {
    None,
    /// Q or K rows permuted by llama.cpp for this many heads.
    Heads(u64),
}

/// The Hugging Face name and expected torch shape of a llama GGUF tensor.
fn hf_name(p: &Params, name: &str) -> Option<(String, Vec<u64>, Rope)> {
    let (e, ff, v) = (p.n_embd, p.n_ff, p.vocab_size);
    let q_rows = p.n_head * p.head_dim;
    let kv_rows = p.n_head_kv * p.head_dim;
    match name {
        "token_embd.weight" => {
            return Some(("model.embed_tokens.weight".into(), vec![v, e], Rope::None))
        }
        "output_norm.weight" => return Some(("model.norm.weight".into(), vec![e], Rope::None)),
        "output.weight" => return Some(("lm_head.weight".into(), vec![v, e], Rope::None)),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, tail) = rest.split_once('.')?;
    // Canonical decimal only ("01" would alias "1").
    let n: u64 = layer
        .parse()
        .ok()
        .filter(|n: &u64| n.to_string() == layer)?;
    if n >= p.n_layer {
        return None;
    }
    let (hf, shape, rope) = match tail {
        "attn_norm.weight" => ("input_layernorm.weight", vec![e], Rope::None),
        "ffn_norm.weight" => ("post_attention_layernorm.weight", vec![e], Rope::None),
        "attn_q.weight" => (
            "self_attn.q_proj.weight",
            vec![q_rows, e],
            Rope::Heads(p.n_head),
        ),
        "attn_k.weight" => (
            "self_attn.k_proj.weight",
            vec![kv_rows, e],
            Rope::Heads(p.n_head_kv),
        ),
        "attn_v.weight" => ("self_attn.v_proj.weight", vec![kv_rows, e], Rope::None),
        "attn_output.weight" => ("self_attn.o_proj.weight", vec![e, q_rows], Rope::None),
        "ffn_gate.weight" => ("mlp.gate_proj.weight", vec![ff, e], Rope::None),
        "ffn_up.weight" => ("mlp.up_proj.weight", vec![ff, e], Rope::None),
        "ffn_down.weight" => ("mlp.down_proj.weight", vec![e, ff], Rope::None),
        _ => return None,
    };
    Some((format!("model.layers.{n}.{hf}"), shape, rope))
}

/// Every tensor a llama model of these parameters must have, by GGUF name.
fn expected_names(p: &Params) -> Vec<String> {
    let mut names = vec![
        "token_embd.weight".to_string(),
        "output_norm.weight".to_string(),
    ];
    if !p.tied {
        names.push("output.weight".into());
    }
    for i in 0..p.n_layer {
        for t in [
            "attn_norm",
            "ffn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ] {
            names.push(format!("blk.{i}.{t}.weight"));
        }
    }
    names
}

/// Undoes llama.cpp's `permute(w, n_head, n_head_kv)` of Q/K rows.
///
/// llama.cpp stores row `h*2*half + j*2 + i` what Hugging Face has at row
/// `h*2*half + i*half + j` (`i` in 0..2, `j` in 0..half, `half = rows/heads/2`): it
/// interleaves the two rotary halves of each head. `rows` is `heads * 2 * half`.
fn unpermute_rows(w: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    let half = rows / heads / 2;
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for i in 0..2 {
            for j in 0..half {
                let hf_row = h * 2 * half + i * half + j;
                let gguf_row = h * 2 * half + j * 2 + i;
                out[hf_row * cols..(hf_row + 1) * cols]
                    .copy_from_slice(&w[gguf_row * cols..(gguf_row + 1) * cols]);
            }
        }
    }
    out
}

/// One tensor to convert: its GGUF entry, Hugging Face name and shape, and whether
/// its rows are un-permuted.
pub(super) struct Planned<'a> {
    pub info: &'a GgufTensorInfo,
    pub name: String,
    pub shape: Vec<usize>,
    rope: Rope,
}

/// Checks every tensor against the parameters and lists them in output order (sorted
/// by Hugging Face name). Nothing is dequantized yet.
pub(super) fn plan_tensors<'a>(
    g: &'a GgufFile,
    p: &Params,
) -> Result<Vec<Planned<'a>>, ImportError> {
    let path: PathBuf = g.path().to_path_buf();
    let inconsistent = |detail: String| ImportError::Inconsistent {
        path: path.clone(),
        detail,
    };
    for name in expected_names(p) {
        if g.tensor(&name).is_none() {
            return Err(inconsistent(format!("tensor '{name}' is missing")));
        }
    }
    let mut plan = Vec::new();
    for t in g.tensors() {
        let Some((hf, shape, rope)) = hf_name(p, t.name()) else {
            return Err(ImportError::Unsupported {
                path,
                what: format!("tensor '{}' in a llama model", t.name()),
            });
        };
        if t.torch_shape() != shape {
            return Err(inconsistent(format!(
                "tensor '{}' has shape {:?} (torch order), expected {shape:?}",
                t.name(),
                t.torch_shape()
            )));
        }
        let shape: Vec<usize> = shape
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<Result<_, _>>()
            .map_err(|_| {
                inconsistent(format!(
                    "tensor '{}' is too large for this platform",
                    t.name()
                ))
            })?;
        plan.push(Planned {
            info: t,
            name: hf,
            shape,
            rope,
        });
    }
    plan.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(plan)
}

/// One tensor converted: its BF16 bytes, elements, and how many of them rounding to
/// BF16 changed.
pub(super) struct ConvertedTensor {
    pub data: Vec<u8>,
    pub parameters: u64,
    pub rounded_elements: u64,
}

/// Dequantizes one planned tensor, un-permutes Q/K rows, and rounds to BF16.
pub(super) fn convert_one(g: &GgufFile, t: &Planned<'_>) -> Result<ConvertedTensor, ImportError> {
    let mut values = g.dequantize_tensor(t.info)?;
    if let Rope::Heads(heads) = t.rope {
        let heads = usize::try_from(heads).map_err(|_| ImportError::Inconsistent {
            path: g.path().to_path_buf(),
            detail: format!("tensor '{}' has too many heads", t.info.name()),
        })?;
        // Shape checked by the plan: rows = heads * head_dim with head_dim even.
        values = unpermute_rows(&values, t.shape[0], t.shape[1], heads);
    }
    let mut data = Vec::with_capacity(values.len() * 2);
    let mut rounded = 0u64;
    for &x in &values {
        let b = f32_to_bf16(x);
        if voom_formats::dtype::bf16_to_f32(b).to_bits() != x.to_bits() {
            rounded += 1;
        }
        data.extend_from_slice(&b.to_le_bytes());
    }
    Ok(ConvertedTensor {
        data,
        parameters: values.len() as u64,
        rounded_elements: rounded,
    })
}

/// Hugging Face names of the tensors a GGUF with these parameters converts to, for
/// tests and docs.
#[cfg(test)]
pub(super) fn hf_names(p: &Params) -> std::collections::BTreeMap<String, String> {
    expected_names(p)
        .into_iter()
        .filter_map(|g| hf_name(p, &g).map(|(hf, ..)| (g, hf)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's `permute` (convert_hf_to_gguf.py), written the numpy way.
    pub(crate) fn permute_rows(w: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
        // w.reshape(heads, 2, half, cols).swapaxes(1, 2).reshape(rows, cols)
        let half = rows / heads / 2;
        let mut out = Vec::with_capacity(w.len());
        for h in 0..heads {
            for j in 0..half {
                for i in 0..2 {
                    let src = h * 2 * half + i * half + j;
                    out.extend_from_slice(&w[src * cols..(src + 1) * cols]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        let (rows, cols) = (3 * 8, 5);
        let w: Vec<f32> = (0..rows * cols).map(|x| x as f32).collect();
        let p = permute_rows(&w, rows, cols, 3);
        assert_ne!(p, w);
        assert_eq!(unpermute_rows(&p, rows, cols, 3), w);
        // Row 1 of head 0 in llama.cpp's order is HF row `half` (second rotary half).
        assert_eq!(p[cols], w[4 * cols]);
    }

    #[test]
    fn shortest_decimal_of_f32_hyperparameters() {
        assert_eq!(shortest_f64(1e-5), 1e-5);
        assert_eq!(shortest_f64(100000.0), 100000.0);
        assert_eq!(shortest_f64(1e-6), 1e-6);
        assert_eq!(shortest_f64(1e-5) as f32, 1e-5f32);
    }

    #[test]
    fn layer_numbers_are_canonical_and_in_range() {
        let p = Params {
            n_layer: 2,
            n_embd: 8,
            n_ff: 16,
            n_head: 2,
            n_head_kv: 1,
            head_dim: 4,
            rms_norm_eps: 1e-5,
            rope_theta: 1e4,
            context_length: 64,
            vocab_size: 10,
            tied: true,
        };
        assert!(hf_name(&p, "blk.1.attn_q.weight").is_some());
        assert!(hf_name(&p, "blk.01.attn_q.weight").is_none());
        assert!(hf_name(&p, "blk.2.attn_q.weight").is_none());
        assert!(hf_name(&p, "blk.x.attn_q.weight").is_none());
        assert!(hf_name(&p, "rope_freqs.weight").is_none());
        let names = hf_names(&p);
        assert_eq!(names.len(), 2 + 2 * 9);
        assert_eq!(
            names["blk.0.ffn_norm.weight"],
            "model.layers.0.post_attention_layernorm.weight"
        );
        assert_eq!(
            names["blk.1.attn_output.weight"],
            "model.layers.1.self_attn.o_proj.weight"
        );
    }
}
