//! llama.cpp's decoder-only architectures vOOM imports (`llama`, `qwen2`, `qwen3`,
//! `qwen3moe`): hyperparameters (`{arch}.*` keys), `config.json`, and tensors renamed
//! to Hugging Face names, with llama.cpp's Q/K row permutation undone where its
//! converter applies one (`llama` only: the others rotate halves, as transformers
//! does).

use std::path::PathBuf;

use serde_json::json;
use voom_formats::dtype::f32_to_bf16;
use voom_formats::gguf::{GgmlType, GgufFile, GgufTensorInfo};
use voom_formats::DType;

use super::tokenizer::SpecialIds;
use super::ImportError;

/// A GGUF architecture the importer converts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Qwen3Moe,
}

impl Arch {
    /// The architecture of `general.architecture`, `None` for one not imported.
    pub fn of(name: &str) -> Option<Arch> {
        Some(match name {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "qwen3moe" => Arch::Qwen3Moe,
            _ => return None,
        })
    }

    /// The names `general.architecture` has for the importable ones.
    pub const NAMES: &'static str = "llama, qwen2, qwen3, qwen3moe";

    /// Its name in GGUF keys (`qwen3moe.block_count`).
    fn key(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
        }
    }

    /// config.json's `model_type` and `architectures`.
    fn hf(self) -> (&'static str, &'static str) {
        match self {
            Arch::Llama => ("llama", "LlamaForCausalLM"),
            Arch::Qwen2 => ("qwen2", "Qwen2ForCausalLM"),
            Arch::Qwen3 => ("qwen3", "Qwen3ForCausalLM"),
            Arch::Qwen3Moe => ("qwen3_moe", "Qwen3MoeForCausalLM"),
        }
    }

    /// Whether llama.cpp's converter permuted Q/K rows (`LlamaModel.permute`).
    fn permutes(self) -> bool {
        self == Arch::Llama
    }

    /// Per-head RMSNorm of q and k (`attn_q_norm`, `attn_k_norm`).
    fn qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Qwen3Moe)
    }

    /// Biases on q, k and v (`attn_q.bias`, ...).
    fn qkv_bias(self) -> bool {
        self == Arch::Qwen2
    }
}

/// The routed experts of a mixture-of-experts GGUF.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Experts {
    /// `{arch}.expert_count`.
    pub count: u64,
    /// `{arch}.expert_used_count`.
    pub used: u64,
    /// `{arch}.expert_feed_forward_length`.
    pub ff: u64,
}

/// Hyperparameters of a GGUF (`{arch}.*` keys).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Params {
    pub arch: Arch,
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
    /// Routed experts in every layer (qwen3moe).
    pub experts: Option<Experts>,
}

impl Params {
    pub fn from_gguf(g: &GgufFile, arch: Arch) -> Result<Params, ImportError> {
        let path = g.path().to_path_buf();
        let a = arch.key();
        let k = |key: &str| format!("{a}.{key}");
        let req = |key: &str| -> Result<u64, ImportError> {
            Ok(g.get_u64(&k(key))?.ok_or_else(|| g.missing_key(&k(key)))?)
        };
        let unsupported = |what: String| ImportError::Unsupported {
            path: path.clone(),
            what,
        };
        let n_layer = req("block_count")?;
        let n_embd = req("embedding_length")?;
        let experts = if g.get_u64(&k("expert_count"))?.unwrap_or(0) > 0 {
            if arch != Arch::Qwen3Moe {
                return Err(unsupported(format!("mixture-of-experts {a}")));
            }
            Some(Experts {
                count: req("expert_count")?,
                used: req("expert_used_count")?,
                ff: req("expert_feed_forward_length")?,
            })
        } else if arch == Arch::Qwen3Moe {
            return Err(g.missing_key(&k("expert_count")).into());
        } else {
            None
        };
        // A mixture of experts has no dense MLP: its experts' size stands in.
        let n_ff = match (&experts, g.get_u64(&k("feed_forward_length"))?) {
            (_, Some(ff)) => ff,
            (Some(e), None) => e.ff,
            (None, None) => req("feed_forward_length")?,
        };
        let n_head = req("attention.head_count")?;
        let n_head_kv = g.get_u64(&k("attention.head_count_kv"))?.unwrap_or(n_head);
        let context_length = req("context_length")?;
        if n_head == 0 || n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(ImportError::Inconsistent {
                path,
                detail: format!("{n_head} attention heads cannot share {n_head_kv} KV heads"),
            });
        }
        let head_dim = match g.get_u64(&k("attention.key_length"))? {
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
        let vocab_size = match g.get_u64(&k("vocab_size"))? {
            Some(v) => v,
            None => g
                .get_str_array("tokenizer.ggml.tokens")?
                .ok_or_else(|| g.missing_key("tokenizer.ggml.tokens"))?
                .len() as u64,
        };
        // Sizes are bounded so that products of two of them fit u64, and the layer
        // count by the tensors present, before anything is computed or allocated from
        // them.
        let e = experts.as_ref();
        for (key, x) in [
            ("embedding_length", n_embd),
            ("feed_forward_length", n_ff),
            ("attention.head_count", n_head),
            ("attention.key_length", head_dim),
            ("vocab_size", vocab_size),
            ("expert_count", e.map_or(1, |e| e.count)),
            ("expert_used_count", e.map_or(1, |e| e.used)),
            ("expert_feed_forward_length", e.map_or(1, |e| e.ff)),
        ] {
            if x == 0 || x > u64::from(u32::MAX) {
                return Err(ImportError::Inconsistent {
                    path,
                    detail: format!("{a}.{key} = {x} is out of range"),
                });
            }
        }
        if let Some(e) = e.filter(|e| e.used > e.count) {
            return Err(ImportError::Inconsistent {
                path,
                detail: format!(
                    "{a}.expert_used_count = {} is more than {a}.expert_count = {}",
                    e.used, e.count
                ),
            });
        }
        if let Some(v) = g.get_u64(&k("attention.value_length"))? {
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
        if let Some(rot) = g.get_u64(&k("rope.dimension_count"))? {
            if rot != head_dim {
                return Err(unsupported(format!(
                    "partial rotary embedding ({rot} of {head_dim} dims)"
                )));
            }
        }
        for key in [k("rope.scaling.type"), k("rope.scaling.factor")] {
            match g.metadata(&key) {
                None => {}
                Some(v) if v.as_str() == Some("none") => {}
                Some(v) => return Err(unsupported(format!("rope scaling ({key} = {v:?})"))),
            }
        }
        let rms_norm_eps = g
            .get_f32(&k("attention.layer_norm_rms_epsilon"))?
            .ok_or_else(|| g.missing_key(&k("attention.layer_norm_rms_epsilon")))?;
        // llama.cpp's default when the key is absent.
        let rope_theta = g.get_f32(&k("rope.freq_base"))?.unwrap_or(10000.0);
        for (key, x) in [
            ("attention.layer_norm_rms_epsilon", rms_norm_eps),
            ("rope.freq_base", rope_theta),
        ] {
            if !(x.is_finite() && x > 0.0) {
                return Err(ImportError::Inconsistent {
                    path,
                    detail: format!("{a}.{key} is {x}, not a positive number"),
                });
            }
        }
        let n_tensors = g.tensors().len() as u64;
        let per_layer = layer_tensors(arch, experts.is_some()).len() as u64;
        if n_layer == 0 || n_layer > n_tensors / per_layer {
            return Err(ImportError::Inconsistent {
                path,
                detail: format!(
                    "{a}.block_count = {n_layer} but the file has {n_tensors} tensors \
                     ({per_layer} per layer)"
                ),
            });
        }
        Ok(Params {
            arch,
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
            experts,
        })
    }

    /// `config.json` of the architecture's `*ForCausalLM`.
    pub fn config_json(&self, ids: &SpecialIds) -> serde_json::Value {
        let (model_type, architecture) = self.arch.hf();
        let mut c = json!({
            "architectures": [architecture],
            "model_type": model_type,
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
        });
        if self.arch != Arch::Llama {
            c["use_sliding_window"] = false.into();
            c["sliding_window"] = serde_json::Value::Null;
        }
        if let Some(e) = &self.experts {
            // llama.cpp's qwen3moe: every layer's experts, softmax then the top
            // `expert_used_count`, their weights normalised.
            c["num_experts"] = e.count.into();
            c["num_experts_per_tok"] = e.used.into();
            c["moe_intermediate_size"] = e.ff.into();
            c["norm_topk_prob"] = true.into();
            c["decoder_sparse_step"] = 1.into();
            c["mlp_only_layers"] = json!([]);
        }
        c
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

/// The tensors of one layer of `arch` (a mixture of experts' where `moe`), by the
/// GGUF name after `blk.N.`.
fn layer_tensors(arch: Arch, moe: bool) -> Vec<&'static str> {
    let mut t = vec![
        "attn_norm.weight",
        "ffn_norm.weight",
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_output.weight",
    ];
    if moe {
        t.extend([
            "ffn_gate_inp.weight",
            "ffn_gate_exps.weight",
            "ffn_up_exps.weight",
            "ffn_down_exps.weight",
        ]);
    } else {
        t.extend(["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]);
    }
    if arch.qkv_bias() {
        t.extend(["attn_q.bias", "attn_k.bias", "attn_v.bias"]);
    }
    if arch.qk_norm() {
        t.extend(["attn_q_norm.weight", "attn_k_norm.weight"]);
    }
    t
}

/// The Hugging Face name and expected torch shape of a GGUF tensor.
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
    if n >= p.n_layer || !layer_tensors(p.arch, p.experts.is_some()).contains(&tail) {
        return None;
    }
    let heads = |h| {
        if p.arch.permutes() {
            Rope::Heads(h)
        } else {
            Rope::None
        }
    };
    let (ne, eff) = p.experts.as_ref().map_or((0, 0), |x| (x.count, x.ff));
    let (hf, shape, rope) = match tail {
        "attn_norm.weight" => ("input_layernorm.weight", vec![e], Rope::None),
        "ffn_norm.weight" => ("post_attention_layernorm.weight", vec![e], Rope::None),
        "attn_q.weight" => ("self_attn.q_proj.weight", vec![q_rows, e], heads(p.n_head)),
        "attn_k.weight" => (
            "self_attn.k_proj.weight",
            vec![kv_rows, e],
            heads(p.n_head_kv),
        ),
        "attn_v.weight" => ("self_attn.v_proj.weight", vec![kv_rows, e], Rope::None),
        "attn_output.weight" => ("self_attn.o_proj.weight", vec![e, q_rows], Rope::None),
        "attn_q.bias" => ("self_attn.q_proj.bias", vec![q_rows], Rope::None),
        "attn_k.bias" => ("self_attn.k_proj.bias", vec![kv_rows], Rope::None),
        "attn_v.bias" => ("self_attn.v_proj.bias", vec![kv_rows], Rope::None),
        "attn_q_norm.weight" => ("self_attn.q_norm.weight", vec![p.head_dim], Rope::None),
        "attn_k_norm.weight" => ("self_attn.k_norm.weight", vec![p.head_dim], Rope::None),
        "ffn_gate.weight" => ("mlp.gate_proj.weight", vec![ff, e], Rope::None),
        "ffn_up.weight" => ("mlp.up_proj.weight", vec![ff, e], Rope::None),
        "ffn_down.weight" => ("mlp.down_proj.weight", vec![e, ff], Rope::None),
        "ffn_gate_inp.weight" => ("mlp.gate.weight", vec![ne, e], Rope::None),
        "ffn_gate_exps.weight" => ("mlp.experts.gate_proj", vec![ne, eff, e], Rope::None),
        "ffn_up_exps.weight" => ("mlp.experts.up_proj", vec![ne, eff, e], Rope::None),
        "ffn_down_exps.weight" => ("mlp.experts.down_proj", vec![ne, e, eff], Rope::None),
        _ => return None,
    };
    Some((format!("model.layers.{n}.{hf}"), shape, rope))
}

/// Every tensor a model of these parameters must have, by GGUF name.
fn expected_names(p: &Params) -> Vec<String> {
    let mut names = vec![
        "token_embd.weight".to_string(),
        "output_norm.weight".to_string(),
    ];
    if !p.tied {
        names.push("output.weight".into());
    }
    for i in 0..p.n_layer {
        for t in layer_tensors(p.arch, p.experts.is_some()) {
            names.push(format!("blk.{i}.{t}"));
        }
    }
    names
}

/// Undoes llama.cpp's `permute(w, n_head, n_head_kv)` of Q/K rows.
///
/// llama.cpp stores row `h*2*half + j*2 + i` what Hugging Face has at row
/// `h*2*half + i*half + j` (`i` in 0..2, `j` in 0..half, `half = rows/heads/2`): it
/// interleaves the two rotary halves of each head. `rows` is `heads * 2 * half`;
/// a row is `cols` elements of any kind (f32 values, or a row's bytes of blocks).
fn unpermute_rows<T: Copy + Default>(w: &[T], rows: usize, cols: usize, heads: usize) -> Vec<T> {
    let half = rows / heads / 2;
    let mut out = vec![T::default(); w.len()];
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

impl Planned<'_> {
    /// How the tensor is written when kept as stored: its dtype and shape in the
    /// safetensors file, and its ggml block type when it is one (`U8` rows of whole
    /// blocks, `[rows, row bytes]`). F32, F16 and BF16 keep their dtype and shape.
    pub fn as_stored(
        &self,
        path: &std::path::Path,
    ) -> Result<(DType, Vec<usize>, Option<GgmlType>), ImportError> {
        let t = self.info.ggml_type();
        let plain = match t {
            GgmlType::F32 => Some(DType::F32),
            GgmlType::F16 => Some(DType::F16),
            GgmlType::BF16 => Some(DType::BF16),
            _ => None,
        };
        if let Some(d) = plain {
            return Ok((d, self.shape.clone(), None));
        }
        if !voom_formats::gguf::dequantizes(t) {
            return Err(ImportError::Unsupported {
                path: path.to_path_buf(),
                what: format!(
                    "tensor '{}' of ggml type {t} (vOOM runs F32, F16, BF16, Q4_0, Q4_1, \
                     Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS and MXFP4)",
                    self.info.name()
                ),
            });
        }
        let (&cols, lead) = self.shape.split_last().expect("a planned tensor has dims");
        if lead.is_empty() {
            return Err(ImportError::Unsupported {
                path: path.to_path_buf(),
                what: format!(
                    "tensor '{}': a vector of {t} blocks (vOOM keeps vectors in a float dtype)",
                    self.info.name()
                ),
            });
        }
        let (block, bytes) = t.block();
        let row = cols / block as usize * bytes as usize;
        let mut shape = lead.to_vec();
        shape.push(row);
        Ok((DType::U8, shape, Some(t)))
    }
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
                what: format!("tensor '{}' in a {} model", t.name(), p.arch.key()),
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

/// Dequantizes one planned tensor, un-permutes Q/K rows, and rounds to BF16 (or
/// keeps the f32 values, `f32`).
pub(super) fn convert_one(
    g: &GgufFile,
    t: &Planned<'_>,
    f32: bool,
) -> Result<ConvertedTensor, ImportError> {
    let mut values = g.dequantize_tensor(t.info)?;
    if let Rope::Heads(heads) = t.rope {
        let heads = usize::try_from(heads).map_err(|_| ImportError::Inconsistent {
            path: g.path().to_path_buf(),
            detail: format!("tensor '{}' has too many heads", t.info.name()),
        })?;
        // Shape checked by the plan: rows = heads * head_dim with head_dim even.
        values = unpermute_rows(&values, t.shape[0], t.shape[1], heads);
    }
    if f32 {
        return Ok(ConvertedTensor {
            data: values.iter().flat_map(|x| x.to_le_bytes()).collect(),
            parameters: values.len() as u64,
            rounded_elements: 0,
        });
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

/// One planned tensor's bytes as the GGUF stores them, Q/K rows un-permuted (whole
/// rows of blocks move; nothing is dequantized): what [`Planned::as_stored`]
/// describes.
pub(super) fn copy_one(g: &GgufFile, t: &Planned<'_>) -> Result<Vec<u8>, ImportError> {
    let bytes = g.tensor_bytes(t.info)?;
    let Rope::Heads(heads) = t.rope else {
        return Ok(bytes.to_vec());
    };
    let heads = usize::try_from(heads).map_err(|_| ImportError::Inconsistent {
        path: g.path().to_path_buf(),
        detail: format!("tensor '{}' has too many heads", t.info.name()),
    })?;
    let rows = t.shape[0];
    Ok(unpermute_rows(bytes, rows, bytes.len() / rows, heads))
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
            arch: Arch::Llama,
            experts: None,
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
