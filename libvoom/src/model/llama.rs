//! The Llama family: llama, mistral (sliding window), qwen2 (q/k/v bias) and qwen3
//! (per-head q/k RMSNorm), and their mixtures of experts: qwen3_moe, olmoe (q/k
//! RMSNorm over the whole projection, `clip_qkv`), mixtral, glm4_moe (partial rotary,
//! shared experts, sigmoid group-limited routing) and deepseek_v3 (multi-head latent
//! attention, [`super::mla`]). Pre-norm decoder blocks with grouped-query attention,
//! rotary embeddings and a SwiGLU MLP, or routed SwiGLU experts in its place
//! ([`super::moe`]), as in transformers.
//!
//! This file is the architecture only: its weights, its page plan (every layer's
//! pages; the embedding rows before, the final norm and LM head after) and its math
//! over the backend's ops. The sweep leases the pages.

use std::path::Path;
use std::sync::Arc;

use vpaged::{PageId, PageSource};

use crate::backend::{Activation, AttentionShape, Backend, KernelError, RopeShape, RopeTable};
use crate::config::{ModelConfig, QkNorm};
use crate::kv::KvCache;
use crate::model::deltanet::DeltaNet;
use crate::model::linear::Linear;
use crate::model::mla::{self, MlaAttention};
use crate::model::moe::{ExpertDims, Experts};
use crate::model::plan::{self, PagePlan, PerToken, Stage};
use crate::model::rope;
use crate::model::sweep::{LayerLease, Sweep};
use crate::model::values::ValueChecks;
use crate::model::weights::{Dim, Table, Vector, WeightFinder};
use crate::model::{Logits, Model, SeqPass};
use crate::VoomError;

struct Layer {
    attn_norm: Vector,
    attn: Attention,
    mlp_norm: Vector,
    mlp: Mlp,
}

/// A layer's attention.
enum Attention {
    /// Grouped-query attention.
    Gqa {
        q: Linear,
        k: Linear,
        v: Linear,
        o: Linear,
        q_norm: Option<Vector>,
        k_norm: Option<Vector>,
        /// One logit per head beside its scores (gpt-oss's `sinks`).
        sinks: Option<Vector>,
    },
    /// Multi-head latent attention (deepseek_v3).
    Mla(MlaAttention),
    /// Gated DeltaNet, a hybrid's linear attention (qwen3_next, qwen3_5).
    Delta(DeltaNet),
}

/// What follows attention in a layer.
// One per layer: the variants' sizes are left unequal rather than boxed.
#[allow(clippy::large_enum_variant)]
enum Mlp {
    Dense {
        gate: Linear,
        up: Linear,
        down: Linear,
    },
    /// Routed experts (and shared ones).
    Moe(Experts),
}

impl Layer {
    /// The pages of each step of the layer, in the order [`Llama::forward`] computes
    /// them: the attention's ([`GQA_STEPS`] or [`mla::STEPS`]), then the MLP's from
    /// [`Layer::mlp_step`] on.
    fn steps(&self) -> Vec<Vec<PageId>> {
        let with = |first: &[PageId], lin: &Linear, after: Option<&Vector>| {
            let mut v = first.to_vec();
            v.extend(lin.pages());
            v.extend(after.map(|x| x.page));
            v
        };
        let mut steps = match &self.attn {
            Attention::Gqa {
                q,
                k,
                v,
                o,
                q_norm,
                k_norm,
                sinks,
            } => vec![
                with(
                    &[self.attn_norm.page]
                        .into_iter()
                        .chain(sinks.map(|s| s.page))
                        .collect::<Vec<_>>(),
                    q,
                    q_norm.as_ref(),
                ),
                with(&[], k, k_norm.as_ref()),
                with(&[], v, None),
                with(&[], o, None),
            ],
            Attention::Mla(m) => m.steps(self.attn_norm.page),
            Attention::Delta(d) => d.steps(self.attn_norm.page),
        };
        debug_assert_eq!(steps.len(), self.mlp_step());
        match &self.mlp {
            Mlp::Dense { gate, up, down } => steps.extend([
                with(&[self.mlp_norm.page], gate, None),
                with(&[], up, None),
                with(&[], down, None),
            ]),
            Mlp::Moe(e) => {
                let mut router = vec![self.mlp_norm.page];
                router.extend(e.router_pages());
                steps.push(router);
                steps.extend(e.shared_pages());
            }
        }
        steps
    }

    /// The first step of the MLP: the dense MLP's gate (then up, down), or the
    /// experts' router (then the shared experts).
    fn mlp_step(&self) -> usize {
        match &self.attn {
            Attention::Gqa { .. } => GQA_STEPS,
            Attention::Mla(_) => mla::STEPS,
            Attention::Delta(d) => d.step_count(),
        }
    }

    /// Each routed expert's pages (none in a dense layer).
    fn expert_pages(&self) -> Vec<Vec<PageId>> {
        match &self.mlp {
            Mlp::Dense { .. } => Vec::new(),
            Mlp::Moe(e) => e.expert_pages(),
        }
    }
}

/// The steps of grouped-query attention ([`Layer::steps`]).
const STEP_Q: usize = 0;
const STEP_K: usize = 1;
const STEP_V: usize = 2;
const STEP_O: usize = 3;
const GQA_STEPS: usize = 4;

/// What the first layer of a model reads.
enum Input {
    /// The tokens' embedding rows (a decoder).
    Embed,
    /// Multi-token prediction (DeepSeek-V3, GLM-4.5: `num_nextn_predict_layers`):
    /// position `i` reads the embedding of the token after it (zeros at position 0,
    /// as vLLM computes it), normed by `enorm`, beside the hidden state of position
    /// `i` before it ([`SeqPass::hidden_in`]) normed by `hnorm`, the two joined and
    /// projected by `eh_proj` to the hidden width.
    Fuse {
        enorm: Vector,
        hnorm: Vector,
        eh_proj: Linear,
    },
}

impl Input {
    /// The fusion's pages (`None` for embedding rows alone).
    fn pages(&self) -> Option<Vec<PageId>> {
        match self {
            Input::Embed => None,
            Input::Fuse {
                enorm,
                hnorm,
                eh_proj,
            } => {
                let mut v = vec![enorm.page, hnorm.page];
                v.extend(eh_proj.pages());
                Some(v)
            }
        }
    }
}

/// A Llama-family model on backend `B`.
pub struct Llama<B: Backend> {
    cfg: ModelConfig,
    /// Shared with its multi-token-prediction layer's model (one thread pool).
    backend: Arc<B>,
    embed: Table,
    input: Input,
    final_norm: Vector,
    lm_head: Table,
    layers: Vec<Layer>,
    inv_freq: Vec<f32>,
    /// What rotary cos and sin are multiplied by (YaRN's attention factor).
    rope_factor: f32,
    plan: PagePlan,
    /// The pages of stored values checked when first leased (shared with its
    /// multi-token-prediction layer's model, loaded by the same finder).
    checks: Arc<ValueChecks>,
    /// Its first multi-token-prediction layer as a model, or why it has none.
    mtp: Result<Box<Llama<B>>, String>,
}

/// The tensor dimensions a config implies, each naming its config.json keys.
struct ConfigDims {
    vocab: Dim,
    hidden: Dim,
    /// Rows of q_proj: all attention heads.
    q: Dim,
    /// Rows of k_proj and v_proj: the KV heads.
    kv: Dim,
    inter: Dim,
    head: Dim,
}

impl ConfigDims {
    /// `config` names the file in errors (a product that overflows; a validated
    /// config has none).
    fn of(cfg: &ModelConfig, config: &Path) -> Result<Self, VoomError> {
        let product = |a: &str, x: usize, b: &str, y: usize| {
            Dim::product(a, x, b, y).ok_or_else(|| VoomError::Config {
                path: config.to_path_buf(),
                detail: format!("'{a}' {x} × '{b}' {y} overflows"),
            })
        };
        Ok(ConfigDims {
            vocab: Dim::of("vocab_size", cfg.vocab_size),
            hidden: Dim::of("hidden_size", cfg.hidden_size),
            q: product(
                "num_attention_heads",
                cfg.num_heads,
                "head_dim",
                cfg.head_dim,
            )?,
            kv: product(
                "num_key_value_heads",
                cfg.num_kv_heads,
                "head_dim",
                cfg.head_dim,
            )?,
            inter: Dim::of("intermediate_size", cfg.intermediate_size),
            head: Dim::of("head_dim", cfg.head_dim),
        })
    }
}

impl<B: Backend> Llama<B> {
    /// Resolves every weight the config implies, checking dtypes and shapes.
    ///
    /// The config is untrusted until it matches the checkpoint, so nothing is
    /// allocated from it first: its ranges are checked ([`ModelConfig::validate`]),
    /// then its layer count against the checkpoint's `model.layers.N.*` tensors, then
    /// every tensor's shape (each mismatch names the config.json key it contradicts:
    /// `vocab_size`, `hidden_size`, `num_attention_heads × head_dim`, ...). Only then
    /// is anything sized by the config.
    ///
    /// Multi-token-prediction layers (`num_nextn_predict_layers`) the checkpoint
    /// holds are loaded as [`Model::mtp`]; the decoder runs without them, and one
    /// that does not load leaves the model without it ([`Model::mtp_error`]).
    pub fn load(
        cfg: ModelConfig,
        source: &dyn PageSource,
        model: &str,
        backend: B,
    ) -> Result<Self, VoomError> {
        let config = Path::new(model).join("config.json");
        cfg.validate(&config)?;
        let f = WeightFinder::new(source, model).with_quant(cfg.quant.clone());
        let in_checkpoint = f.layer_count()?;
        // Multi-token-prediction layers follow the decoder's (DeepSeek-V3 stores its
        // one as layer 61 of 61).
        if in_checkpoint != cfg.num_layers && in_checkpoint != cfg.num_layers + cfg.extra_layers {
            let extra = if cfg.extra_layers > 0 {
                format!(
                    " (or {} with 'num_nextn_predict_layers')",
                    cfg.num_layers + cfg.extra_layers
                )
            } else {
                String::new()
            };
            return Err(f.err(
                "model.layers.N.*",
                format!(
                    "config.json's 'num_hidden_layers' is {}{extra}, but the checkpoint has {in_checkpoint} layers",
                    cfg.num_layers
                ),
            ));
        }
        let d = ConfigDims::of(&cfg, &config)?;
        let embed = f.table("model.embed_tokens.weight", &d.vocab, &d.hidden)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            f.table("lm_head.weight", &d.vocab, &d.hidden)?
        };
        let final_norm = f
            .vector("model.norm.weight", &d.hidden)?
            .plus_one(cfg.norm_offset);
        // As many as the checkpoint has (checked above).
        let layers = (0..cfg.num_layers)
            .map(|i| Layer::load(&f, &cfg, &d, i, i))
            .collect::<Result<Vec<_>, _>>()?;
        let backend = Arc::new(backend);
        let mut mtp = Err(format!(
            "the checkpoint has no multi-token-prediction layers ('num_nextn_predict_layers' is {}, and it holds {in_checkpoint} layers for 'num_hidden_layers' {})",
            cfg.extra_layers, cfg.num_layers
        ));
        if cfg.extra_layers > 0 && in_checkpoint > cfg.num_layers {
            let parts = MtpParts {
                f: &f,
                d: &d,
                embed: &embed,
                lm_head: &lm_head,
            };
            mtp = Self::load_mtp(&cfg, source, parts, Arc::clone(&backend))
                .map(Box::new)
                .map_err(|e| e.to_string());
        }
        let mut model = Self::assemble(
            cfg,
            source,
            backend,
            (embed, Input::Embed),
            layers,
            (final_norm, lm_head),
            mtp,
        );
        let checks = Arc::new(f.take_value_checks());
        if let Ok(m) = &mut model.mtp {
            m.checks = Arc::clone(&checks);
        }
        model.checks = checks;
        Ok(model)
    }

    /// The first extra layer (`num_layers`) as a model of its own: that decoder
    /// layer, reading the fusion of a token's embedding with the hidden state before
    /// it, and its shared head. Its embedding and head are its own copies where the
    /// checkpoint stores them, else the decoder's.
    fn load_mtp(
        cfg: &ModelConfig,
        source: &dyn PageSource,
        parts: MtpParts<'_>,
        backend: Arc<B>,
    ) -> Result<Self, VoomError> {
        let MtpParts {
            f,
            d,
            embed,
            lm_head,
        } = parts;
        let mcfg = cfg
            .extra_layer(0)
            .expect("a model with extra layers has a first");
        let at = cfg.num_layers;
        let p = format!("model.layers.{at}");
        let layer = Layer::load(f, &mcfg, d, at, 0)?;
        let own = |name: &str, theirs: &Table| -> Result<Table, VoomError> {
            let name = format!("{p}.{name}");
            if f.has(&name) {
                f.table(&name, &d.vocab, &d.hidden)
            } else {
                Ok(theirs.clone())
            }
        };
        let embed = own("embed_tokens.weight", embed)?;
        let head = own("shared_head.head.weight", lm_head)?;
        let norm = f.vector(&format!("{p}.shared_head.norm.weight"), &d.hidden)?;
        let both = Dim::product("hidden_size", cfg.hidden_size, "embedding and state", 2)
            .expect("a validated hidden size doubles");
        let fuse = Input::Fuse {
            enorm: f.vector(&format!("{p}.enorm.weight"), &d.hidden)?,
            hnorm: f.vector(&format!("{p}.hnorm.weight"), &d.hidden)?,
            eh_proj: Linear::load(f, &format!("{p}.eh_proj"), &d.hidden, &both, false)?,
        };
        Ok(Self::assemble(
            mcfg,
            source,
            backend,
            (embed, fuse),
            vec![layer],
            (norm, head),
            Err("a multi-token-prediction layer has none after it".into()),
        ))
    }

    /// The model of these weights, with its page plan.
    fn assemble(
        cfg: ModelConfig,
        source: &dyn PageSource,
        backend: Arc<B>,
        (embed, input): (Table, Input),
        layers: Vec<Layer>,
        (final_norm, lm_head): (Vector, Table),
        mtp: Result<Box<Llama<B>>, String>,
    ) -> Self {
        // A token reads one row of the embedding: where the source reads only what is
        // touched, that row; where it loads pages whole, the part holding it (all of a
        // table stored whole). Spread over the parts: each is read by a share of tokens.
        let n = embed.parts.len() as u64;
        let row = embed.row_bytes() as u64;
        let head: Vec<(PageId, Option<PerToken>)> = embed
            .parts
            .iter()
            .map(|p| {
                let bytes = (p.rows * embed.row_bytes()) as u64;
                let per = PerToken {
                    partial: row.div_ceil(n),
                    whole: bytes.div_ceil(n),
                };
                (p.page, Some(per))
            })
            .collect();
        // Steps: the table's parts are leased in batches of at least one (then the
        // fusion's weights, leased together); the final norm with the head's first
        // part.
        let mut head: Vec<Vec<_>> = head.into_iter().map(|r| vec![r]).collect();
        if let Some(fusion) = input.pages() {
            head.push(fusion.into_iter().map(|p| (p, None)).collect());
        }
        let mut tail: Vec<Vec<_>> = lm_head.parts.iter().map(|p| vec![(p.page, None)]).collect();
        tail[0].insert(0, (final_norm.page, None));
        let plan = PagePlan {
            head: Stage::new(source, &head),
            layers: layers
                .iter()
                .map(|l| {
                    let steps: Vec<Vec<_>> = l
                        .steps()
                        .into_iter()
                        .map(|s| s.into_iter().map(|p| (p, None)).collect())
                        .collect();
                    let stage = Stage::new(source, &steps);
                    match &cfg.moe {
                        Some(moe) => stage.with_experts(source, l.expert_pages(), moe.top_k),
                        None => stage,
                    }
                })
                .collect(),
            tail: Stage::new(source, &tail),
        };
        let inv_freq = cfg.rope_inv_freq();
        let rope_factor = cfg.rope_attention_factor();
        Llama {
            cfg,
            backend,
            embed,
            input,
            final_norm,
            lm_head,
            layers,
            inv_freq,
            rope_factor,
            plan,
            checks: Arc::default(),
            mtp,
        }
    }
}

/// The decoder's weights a multi-token-prediction layer may share.
struct MtpParts<'a> {
    f: &'a WeightFinder<'a>,
    d: &'a ConfigDims,
    embed: &'a Table,
    lm_head: &'a Table,
}

impl Layer {
    /// Decoder layer `at` of the checkpoint (`model.layers.{at}.*`), which is layer
    /// `li` of `cfg` (its mixture flag).
    fn load(
        f: &WeightFinder<'_>,
        cfg: &ModelConfig,
        d: &ConfigDims,
        at: usize,
        li: usize,
    ) -> Result<Layer, VoomError> {
        let experts = ExpertDims::of(cfg);
        let linear = |name: &str, rows: &Dim, cols: &Dim, bias: bool| {
            Linear::load(f, name, rows, cols, bias)
        };
        let p = format!("model.layers.{at}");
        let a = format!("{p}.self_attn");
        let m = format!("{p}.mlp");
        let norm = |name: &str, dim: &Dim| {
            Ok::<_, VoomError>(f.vector(name, dim)?.plus_one(cfg.norm_offset))
        };
        // With an output gate, q_proj gives each head its query and its gate.
        let q_rows = match cfg.attn_output_gate {
            true => Dim::of(
                "2 × num_attention_heads × head_dim (queries and output gates)",
                2 * d.q.len,
            ),
            false => d.q.clone(),
        };
        let linear_layer = cfg
            .linear
            .as_ref()
            .filter(|l| l.layers.get(li) == Some(&true));
        let attn = match (&cfg.mla, linear_layer) {
            (_, Some(l)) => {
                Attention::Delta(DeltaNet::load(f, cfg, l, &format!("{p}.linear_attn"))?)
            }
            (Some(mla), None) => Attention::Mla(MlaAttention::load(f, cfg, mla, &a)?),
            (None, None) => Attention::Gqa {
                q: linear(&format!("{a}.q_proj"), &q_rows, &d.hidden, cfg.qkv_bias)?,
                k: linear(&format!("{a}.k_proj"), &d.kv, &d.hidden, cfg.qkv_bias)?,
                v: linear(&format!("{a}.v_proj"), &d.kv, &d.hidden, cfg.qkv_bias)?,
                o: linear(&format!("{a}.o_proj"), &d.hidden, &d.q, cfg.o_bias)?,
                q_norm: match cfg.qk_norm {
                    QkNorm::None => None,
                    QkNorm::PerHead => Some(norm(&format!("{a}.q_norm.weight"), &d.head)?),
                    QkNorm::Whole => Some(norm(&format!("{a}.q_norm.weight"), &d.q)?),
                },
                k_norm: match cfg.qk_norm {
                    QkNorm::None => None,
                    QkNorm::PerHead => Some(norm(&format!("{a}.k_norm.weight"), &d.head)?),
                    QkNorm::Whole => Some(norm(&format!("{a}.k_norm.weight"), &d.kv)?),
                },
                sinks: match cfg.attn_sinks {
                    true => Some(f.vector(
                        &format!("{a}.sinks"),
                        &Dim::of("num_attention_heads", cfg.num_heads),
                    )?),
                    false => None,
                },
            },
        };
        Ok(Layer {
            attn_norm: norm(&format!("{p}.input_layernorm.weight"), &d.hidden)?,
            attn,
            mlp_norm: norm(&format!("{p}.post_attention_layernorm.weight"), &d.hidden)?,
            mlp: match &cfg.moe {
                Some(moe) if moe.sparse[li] => Mlp::Moe(Experts::load(f, moe, &experts, &p)?),
                _ => Mlp::Dense {
                    gate: linear(&format!("{m}.gate_proj"), &d.inter, &d.hidden, cfg.mlp_bias)?,
                    up: linear(&format!("{m}.up_proj"), &d.inter, &d.hidden, cfg.mlp_bias)?,
                    down: linear(&format!("{m}.down_proj"), &d.hidden, &d.inter, cfg.mlp_bias)?,
                },
            },
        })
    }
}

impl<B: Backend> Model for Llama<B> {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn plan(&self) -> &PagePlan {
        &self.plan
    }

    fn value_checks(&self) -> &ValueChecks {
        &self.checks
    }

    fn backend_name(&self) -> String {
        self.backend.name()
    }

    fn batch_invariant(&self) -> bool {
        self.backend.batch_invariant()
    }

    fn backend_copied_bytes(&self) -> u64 {
        self.backend.copied_bytes()
    }

    fn backend_evaluations(&self) -> u64 {
        self.backend.evaluations()
    }

    fn backend_multiply_adds(&self) -> u64 {
        self.backend.multiply_adds()
    }

    fn threads(&self) -> usize {
        self.backend.threads()
    }

    fn mtp(&self) -> Result<&dyn Model, &str> {
        match &self.mtp {
            Ok(m) => Ok(m.as_ref()),
            Err(why) => Err(why),
        }
    }

    fn kv_bytes_per_position(&self) -> u64 {
        let cfg = &self.cfg;
        let width = match &cfg.mla {
            Some(m) => mla::cache_width(m),
            None => 2 * cfg.num_kv_heads * cfg.head_dim,
        };
        // A hybrid's linear-attention layers hold a fixed state, no keys or values.
        let layers = cfg.linear.as_ref().map_or(cfg.num_layers, |l| {
            l.layers.iter().filter(|&&linear| !linear).count()
        });
        (layers * width * std::mem::size_of::<f32>()) as u64
    }

    fn state_bytes(&self) -> u64 {
        self.cfg.linear.as_ref().map_or(0, |l| {
            let shape = l.state_shape();
            let layers = l.layers.iter().filter(|&&linear| linear).count();
            // Three copies (`kv::recurrent`), f32.
            (3 * layers * (shape.conv + shape.matrix) * std::mem::size_of::<f32>()) as u64
        })
    }

    fn new_kv(&self, capacity: usize, page: usize) -> KvCache {
        let cfg = &self.cfg;
        let width = match &cfg.mla {
            Some(m) => mla::cache_width(m),
            None => cfg.num_kv_heads * cfg.head_dim,
        };
        let kv = KvCache::with_page(
            cfg.num_layers,
            width,
            capacity.min(cfg.max_position_embeddings),
            page,
        )
        .with_windows(cfg.sliding_window.clone());
        match &cfg.linear {
            Some(l) => {
                let shape = l.state_shape();
                let shapes: Vec<_> = l
                    .layers
                    .iter()
                    .map(|&linear| linear.then_some(shape))
                    .collect();
                kv.with_states(&shapes)
            }
            None => kv,
        }
    }

    fn scratch_bytes(&self, tokens: usize, chunk: usize, context: usize) -> u64 {
        let cfg = &self.cfg;
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (qd, kvd) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let chunk = chunk.clamp(1, tokens.max(1));
        // Every position: x and its rotary table. One chunk (two sizes at most, the
        // full one and the remainder: counted as two full ones): xn, o; q, att; k, v;
        // gate, up. Then the last row, its norm and the logits; and one row of
        // attention scores per thread.
        let per_chunk = 2 * h + 2 * qd + 2 * kvd + 2 * cfg.intermediate_size;
        // A layer of experts keeps every position's normed rows and output, and
        // computes an expert on the rows routed to it (at most every position): its
        // input (gathered, then uploaded), gate, up and output; its picks and the
        // rows each expert computes (32 bytes a pick); beside one chunk's router
        // probabilities (five copies of them for sigmoid group routing).
        // (gpt-oss's interleaved experts: their joint product, downloaded, and the
        // gate and up split from it: 2 more.)
        let experts = cfg.moe.as_ref().map_or(0, |m| {
            let widths = match m.gate {
                crate::config::ExpertGate::Silu => 2,
                crate::config::ExpertGate::Clamped { .. } => 4,
            };
            tokens * 2 * h
                + tokens * (3 * h + widths * m.expert_intermediate_size)
                + tokens * 8 * m.top_k
                + 5 * chunk * m.num_experts
        });
        // MLA's chunk: the normed input, the query twice (projected and downloaded),
        // its low-rank projection and norm, the cache vectors (projected, split,
        // normed, joined and uploaded), the queries in the latent space (and one head's
        // absorbed part), the attention output in the latent space and expanded; and
        // one head's W_UK widened to f32 (`matmul_t`).
        let mla = cfg.mla.as_ref().map_or(0, |m| {
            let w = mla::cache_width(m);
            let heads = cfg.num_heads;
            chunk
                * (h + 2 * qd
                    + 2 * m.q_lora_rank.unwrap_or(0)
                    + 5 * w
                    + 2 * heads * w
                    + 2 * m.kv_lora_rank
                    + 2 * heads * m.kv_lora_rank
                    + 3 * heads * m.v_head_dim)
                + m.qk_nope_head_dim * m.kv_lora_rank
        });
        // The shared experts' input, gate, up and output; the routed experts' outputs
        // held to be added in order (at most `EXPERT_HOLD_BYTES`).
        let shared = cfg.moe.as_ref().map_or(0, |m| {
            tokens * (h + m.shared_intermediate_size * 2 + h)
                + (tokens * m.top_k * h).min(crate::model::sweep::EXPERT_HOLD_BYTES / 4)
        });
        // A thread's attention scores: the rows of one task (the query heads of a
        // KV head, or one latent head, times a block of positions) over the
        // context.
        let attention_rows = crate::backend::cpu::ATTENTION_BLOCK_Q
            * match &cfg.mla {
                Some(_) => 1,
                None => cfg.num_heads / cfg.num_kv_heads.max(1),
            };
        // A backend that copies a weight page for its product (MLX where it cannot
        // wrap it) holds the copy beside the page: counted for the largest matrix
        // (the embedding or head, else an MLP or attention projection).
        let largest = [
            cfg.vocab_size,
            cfg.intermediate_size,
            qd,
            cfg.moe.as_ref().map_or(0, |m| {
                m.expert_intermediate_size.max(m.shared_intermediate_size)
            }),
        ]
        .into_iter()
        .max()
        .unwrap_or(0)
            * h;
        let copies = self.backend.weight_scratch_bytes(largest as u64);
        let floats = tokens * (h + cfg.rotary_dim)
            + 2 * chunk * per_chunk
            + mla
            + shared
            + 2 * h
            + cfg.vocab_size
            + self.threads() * context * attention_rows
            + experts;
        (floats * std::mem::size_of::<f32>()) as u64 + copies
    }

    fn forward_batch(
        &self,
        sweep: &Sweep<'_>,
        seqs: &mut [SeqPass<'_>],
        chunk: usize,
    ) -> Result<Vec<Vec<f32>>, VoomError> {
        let (b, cfg) = (&*self.backend, &self.cfg);
        let h = cfg.hidden_size;
        // Every sequence's positions in chunks of at most `chunk` rows: each layer
        // computes every chunk in turn, so the pass reads the weights once however
        // many chunks and sequences there are. Where every layer's attention is
        // grouped-query, the pieces of several sequences share a chunk (decode steps
        // of a batch: one product per weight for all of them), each piece attending
        // against its own sequence's cache; a sequence's pieces stay in order.
        let chunk = chunk.max(1);
        let pack = self
            .layers
            .iter()
            .all(|l| matches!(l.attn, Attention::Gqa { .. }));
        let mut chunks: Vec<Vec<Piece>> = Vec::new();
        let mut rows_in_last = 0;
        for (si, seq) in seqs.iter().enumerate() {
            let n = seq.tokens.len();
            for start in (0..n).step_by(chunk) {
                let len = (start + chunk).min(n) - start;
                if !pack || chunks.is_empty() || rows_in_last + len > chunk {
                    chunks.push(Vec::new());
                    rows_in_last = 0;
                }
                chunks.last_mut().expect("pushed above").push(Piece {
                    seq: si,
                    positions: start..start + len,
                    rows: rows_in_last..rows_in_last + len,
                });
                rows_in_last += len;
            }
        }
        let chunk_tokens: Vec<Vec<u32>> = chunks
            .iter()
            .map(|c| {
                c.iter()
                    .flat_map(|p| seqs[p.seq].tokens[p.positions.clone()].iter().copied())
                    .collect()
            })
            .collect();
        let token_refs: Vec<&[u32]> = chunk_tokens.iter().map(Vec::as_slice).collect();
        let mut xs: Vec<B::Act> = chunk_tokens.iter().map(|t| b.zeros(t.len(), h)).collect();
        self.embed_rows(sweep, &token_refs, &mut xs)?;
        if let Input::Fuse { .. } = self.input {
            self.fuse(sweep, seqs, &chunks, &mut xs)?;
        }
        // Each chunk's rotary table: its pieces' positions, one after the other.
        let tables: Vec<RopeTable> = chunks
            .iter()
            .map(|c| {
                let parts: Vec<RopeTable> = c
                    .iter()
                    .map(|p| {
                        let pos0 = seqs[p.seq].kv.len() + p.positions.start;
                        rope::table(&self.inv_freq, self.rope_factor, pos0, p.positions.len())
                    })
                    .collect();
                rope::concat(parts)
            })
            .collect();

        let mut scratch: Vec<(usize, Scratch<B>)> = Vec::new();
        for (li, layer) in self.layers.iter().enumerate() {
            let lw = sweep.layer(li)?;
            // A layer of experts routes every chunk before any expert is leased, so
            // that each expert picked is read once per pass, however many chunks.
            let mut routed = Vec::new();
            for ((x, table), pieces) in xs.iter_mut().zip(&tables).zip(&chunks) {
                let rows = b.shape(x).0;
                let s = match scratch.iter().position(|(r, _)| *r == rows) {
                    Some(i) => &mut scratch[i].1,
                    None => {
                        scratch.push((rows, Scratch::new(b, cfg, rows)));
                        &mut scratch.last_mut().expect("just pushed").1
                    }
                };
                match &layer.attn {
                    Attention::Gqa { .. } => {
                        let mut kvs: Vec<(std::ops::Range<usize>, &mut KvCache)> = Vec::new();
                        let mut taken: Vec<Option<&mut KvCache>> =
                            seqs.iter_mut().map(|s| Some(&mut *s.kv)).collect();
                        for p in pieces {
                            let kv = taken[p.seq].take().expect("a sequence once a chunk");
                            kvs.push((p.rows.clone(), kv));
                        }
                        self.attention(&lw, li, layer, x, table, &mut kvs, s)?
                    }
                    Attention::Delta(d) => {
                        // Not packed: the chunk is one sequence's, its positions in
                        // order.
                        let kv = &mut *seqs[pieces[0].seq].kv;
                        d.forward(b, cfg, &lw, &layer.attn_norm, x, kv, li)?
                    }
                    Attention::Mla(m) => {
                        // Not packed: the chunk is one sequence's.
                        let kv = &mut *seqs[pieces[0].seq].kv;
                        m.forward(
                            b,
                            cfg,
                            cfg.mla.as_ref().expect("an MLA layer has an MLA config"),
                            &lw,
                            li,
                            &layer.attn_norm,
                            x,
                            table,
                            kv,
                        )?
                    }
                }
                let step = layer.mlp_step();
                match &layer.mlp {
                    Mlp::Dense { gate, up, down } => {
                        self.dense_mlp(&lw, step, layer, [gate, up, down], x, s)?
                    }
                    Mlp::Moe(e) => {
                        let moe = cfg.moe.as_ref().expect("a layer of experts has a config");
                        let w = lw.step(step)?;
                        routed.push(e.route_chunk(
                            b,
                            moe,
                            &w,
                            &layer.mlp_norm,
                            cfg.rms_norm_eps,
                            x,
                            &mut s.xn,
                        )?);
                    }
                }
            }
            if let Mlp::Moe(e) = &layer.mlp {
                if sweep.predicts_experts() {
                    self.predict_next_experts(sweep, li, &xs)?;
                }
                e.run(b, &lw, layer.mlp_step() + 1, &routed, &mut xs)?;
            }
        }

        // Final norm and LM head on the rows whose logits are wanted: per sequence,
        // its last position's or all of them. A head stored in row parts is leased a
        // bounded batch of parts at a time, the final norm with the first.
        let head = &self.lm_head;
        let norm =
            plan::slot_bytes(self.final_norm.len as u64 * self.final_norm.dtype.size() as u64);
        let batches = head.batches(&head.pages(), sweep.lease_bound().saturating_sub(norm));
        let mut first = vec![self.final_norm.page];
        first.extend(&batches[0]);
        let w = sweep.tail(&first)?;
        // The wanted rows of each piece, normed, with the sequence they belong to:
        // every position's, or a sequence's last (in its last piece).
        let mut normed: Vec<(usize, B::Act)> = Vec::new();
        for (x, pieces) in xs.iter().zip(&chunks) {
            for p in pieces {
                // Every position's hidden state, where it is asked for: a decoder's
                // normed, a multi-token-prediction layer's as it leaves the layer.
                if let Some(out) = seqs[p.seq].hidden_out.as_deref_mut() {
                    let rows = b.rows(x, p.rows.clone())?;
                    let rows = match self.input {
                        Input::Fuse { .. } => rows,
                        Input::Embed => {
                            let mut hn = b.zeros(p.rows.len(), h);
                            b.rms_norm(
                                &rows,
                                w.vector(&self.final_norm),
                                cfg.rms_norm_eps,
                                &mut hn,
                            )?;
                            hn
                        }
                    };
                    out.extend_from_slice(&b.download_owned(rows)?);
                }
                let n = seqs[p.seq].tokens.len();
                let rows = match seqs[p.seq].want {
                    Logits::Last if p.positions.end < n => continue,
                    Logits::Last => p.rows.end - 1..p.rows.end,
                    Logits::All => p.rows.clone(),
                };
                let picked = b.rows(x, rows)?;
                let mut hn = b.zeros(b.shape(&picked).0, h);
                b.rms_norm(
                    &picked,
                    w.vector(&self.final_norm),
                    cfg.rms_norm_eps,
                    &mut hn,
                )?;
                normed.push((p.seq, hn));
            }
        }
        let v = cfg.vocab_size;
        let mut out: Vec<Vec<f32>> = seqs
            .iter()
            .map(|s| {
                let rows = match s.want {
                    Logits::Last => 1,
                    Logits::All => s.tokens.len(),
                };
                vec![0.0f32; rows * v]
            })
            .collect();
        if let [(_, whole)] = w.table(head).parts[..] {
            let mut at = vec![0usize; seqs.len()];
            for (si, hn) in &normed {
                let mut logits = b.zeros(b.shape(hn).0, v);
                b.matmul(hn, whole, &mut logits)?;
                let got = b.download_owned(logits)?;
                out[*si][at[*si]..at[*si] + got.len()].copy_from_slice(&got);
                at[*si] += got.len();
            }
            return Ok(out);
        }
        // Each part's logits are the same elements computed the same way (one
        // accumulation order per output element, whatever rows a call has), put in
        // place.
        sweep.hint(&head.pages()[batches[0].len()..]);
        let mut w = Some(w);
        for batch in &batches {
            let lease = match w.take() {
                Some(w) => w,
                None => sweep.lease(batch)?,
            };
            let view = lease.table(head);
            let mut at = vec![0usize; seqs.len()];
            for (si, hn) in &normed {
                let m = b.shape(hn).0;
                for (first, part) in &view.parts {
                    let mut logits = b.zeros(m, part.rows);
                    b.matmul(hn, *part, &mut logits)?;
                    let got = b.download_owned(logits)?;
                    for t in 0..m {
                        let dst = (at[*si] + t) * v + first;
                        out[*si][dst..dst + part.rows]
                            .copy_from_slice(&got[t * part.rows..(t + 1) * part.rows]);
                    }
                }
                at[*si] += m;
            }
        }
        Ok(out)
    }
}

/// A sequence's positions in a chunk: `positions` of its new tokens, at `rows` of
/// the chunk.
struct Piece {
    seq: usize,
    positions: std::ops::Range<usize>,
    rows: std::ops::Range<usize>,
}

/// One chunk's activations inside a layer.
struct Scratch<B: Backend> {
    xn: B::Act,
    q: B::Act,
    k: B::Act,
    v: B::Act,
    att: B::Act,
    o: B::Act,
    g: B::Act,
    u: B::Act,
}

impl<B: Backend> Scratch<B> {
    fn new(b: &B, cfg: &ModelConfig, rows: usize) -> Self {
        let (qd, kvd) = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        );
        Scratch {
            xn: b.zeros(rows, cfg.hidden_size),
            q: b.zeros(rows, qd),
            k: b.zeros(rows, kvd),
            v: b.zeros(rows, kvd),
            att: b.zeros(rows, qd),
            o: b.zeros(rows, cfg.hidden_size),
            g: b.zeros(rows, cfg.intermediate_size),
            u: b.zeros(rows, cfg.intermediate_size),
        }
    }
}

impl<B: Backend> Llama<B> {
    /// Gathers the tokens' embedding rows into `xs` (one activation per chunk of
    /// `ranges`), leasing the table's parts that hold them a bounded batch at a time
    /// (a long prompt can touch every part of a table larger than the cache) and
    /// hinting the later batches meanwhile.
    fn embed_rows(
        &self,
        sweep: &Sweep<'_>,
        chunks: &[&[u32]],
        xs: &mut [B::Act],
    ) -> Result<(), VoomError> {
        let b = &*self.backend;
        let t = &self.embed;
        let tokens: Vec<u32> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= t.rows) {
            return Err(KernelError::RowOutOfRange { id, rows: t.rows }.into());
        }
        let needed = t.pages_for(&tokens);
        // Each part as the cache holds it (a slot), so that many small parts
        // cannot add up to more room than the bound.
        let batches = t.batches(&needed, sweep.lease_bound());
        if batches.len() > 1 {
            sweep.hint(&needed[batches[0].len()..]);
        }
        for batch in &batches {
            let w = sweep.lease(batch)?;
            let view = w.table(t);
            for (x, c) in xs.iter_mut().zip(chunks) {
                b.embed(&view, c, x)?;
            }
        }
        Ok(())
    }

    /// A multi-token-prediction layer's input ([`Input::Fuse`]): each chunk's
    /// embedding rows `xs` (zeros at position 0), normed, joined with the hidden
    /// states its sequences' [`SeqPass::hidden_in`] give for the same positions,
    /// normed, and projected to the hidden width, in place.
    fn fuse(
        &self,
        sweep: &Sweep<'_>,
        seqs: &[SeqPass<'_>],
        chunks: &[Vec<Piece>],
        xs: &mut [B::Act],
    ) -> Result<(), VoomError> {
        let (b, cfg) = (&*self.backend, &self.cfg);
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let Input::Fuse {
            enorm,
            hnorm,
            eh_proj,
        } = &self.input
        else {
            unreachable!("a fusion on a model of one")
        };
        let pages = self.input.pages().expect("a fusion has pages");
        let w = sweep.lease(&pages)?;
        for (x, pieces) in xs.iter_mut().zip(chunks) {
            let rows = b.shape(x).0;
            let mut emb = b.download(x)?;
            let mut before = Vec::with_capacity(rows * h);
            for p in pieces {
                let seq = &seqs[p.seq];
                let n = seq.tokens.len();
                let hidden = seq.hidden_in.filter(|s| s.len() == n * h).ok_or_else(|| {
                    VoomError::Request(format!(
                        "a multi-token-prediction pass of {n} positions needs {} floats of hidden states, got {}",
                        n * h,
                        seq.hidden_in.map_or(0, <[f32]>::len)
                    ))
                })?;
                before.extend_from_slice(&hidden[p.positions.start * h..p.positions.end * h]);
                if seq.kv.len() + p.positions.start == 0 {
                    emb[p.rows.start * h..(p.rows.start + 1) * h].fill(0.0);
                }
            }
            let (e, hs) = (b.upload(rows, h, &emb)?, b.upload(rows, h, &before)?);
            let (mut en, mut hn) = (b.zeros(rows, h), b.zeros(rows, h));
            b.rms_norm(&e, w.vector(enorm), eps, &mut en)?;
            b.rms_norm(&hs, w.vector(hnorm), eps, &mut hn)?;
            let (en, hn) = (b.download_owned(en)?, b.download_owned(hn)?);
            let mut both = Vec::with_capacity(rows * 2 * h);
            for r in 0..rows {
                both.extend_from_slice(&en[r * h..(r + 1) * h]);
                both.extend_from_slice(&hn[r * h..(r + 1) * h]);
            }
            let both = b.upload(rows, 2 * h, &both)?;
            eh_proj.apply(b, &w, &both, x)?;
        }
        Ok(())
    }

    /// The attention half of decoder layer `li` on one chunk of positions `x` (in
    /// place, its residual added), after the chunks before it: their keys and values
    /// are in the caches already. `pieces`: the chunk's rows of each sequence in it,
    /// with that sequence's cache; the projections compute every row at once, each
    /// piece attends against its own cache.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        lw: &LayerLease<'_>,
        li: usize,
        layer: &Layer,
        x: &mut B::Act,
        table: &RopeTable,
        pieces: &mut [(std::ops::Range<usize>, &mut KvCache)],
        s: &mut Scratch<B>,
    ) -> Result<(), VoomError> {
        let (b, cfg) = (&*self.backend, &self.cfg);
        let (hd, eps) = (cfg.head_dim, cfg.rms_norm_eps);
        let Attention::Gqa {
            q,
            k,
            v,
            o,
            q_norm,
            k_norm,
            sinks,
        } = &layer.attn
        else {
            unreachable!("grouped-query attention on a layer of it")
        };
        // Per head (qwen3), or over the whole projection (olmoe).
        let (qg, kg) = match cfg.qk_norm {
            QkNorm::Whole => (cfg.num_heads * hd, cfg.num_kv_heads * hd),
            _ => (hd, hd),
        };
        // With an output gate: each head's gate, beside its query in q_proj's rows.
        let mut gate = None;
        let sink_logits: Option<Arc<[f32]>>;
        {
            let w = lw.step(STEP_Q)?;
            sink_logits = sinks.map(|s| w.vector(&s).to_vec().into());
            b.rms_norm(x, w.vector(&layer.attn_norm), eps, &mut s.xn)?;
            if cfg.attn_output_gate {
                let (rows, qd) = b.shape(&s.q);
                let mut both = b.zeros(rows, 2 * qd);
                q.apply(b, &w, &s.xn, &mut both)?;
                let both = b.download_owned(both)?;
                let (mut qs, mut gs) = (vec![0f32; rows * qd], vec![0f32; rows * qd]);
                for (r, row) in both.chunks_exact(2 * qd).enumerate() {
                    for (hh, head) in row.chunks_exact(2 * hd).enumerate() {
                        let at = r * qd + hh * hd;
                        qs[at..at + hd].copy_from_slice(&head[..hd]);
                        gs[at..at + hd].copy_from_slice(&head[hd..]);
                    }
                }
                s.q = b.upload(rows, qd, &qs)?;
                gate = Some(gs);
            } else {
                q.apply(b, &w, &s.xn, &mut s.q)?;
            }
            if let Some(qn) = q_norm {
                b.rms_norm_groups(&mut s.q, qg, w.vector(qn), eps)?;
            }
        }
        {
            let w = lw.step(STEP_K)?;
            k.apply(b, &w, &s.xn, &mut s.k)?;
            if let Some(kn) = k_norm {
                b.rms_norm_groups(&mut s.k, kg, w.vector(kn), eps)?;
            }
        }
        {
            let w = lw.step(STEP_V)?;
            v.apply(b, &w, &s.xn, &mut s.v)?;
        }
        if let Some(c) = cfg.clip_qkv {
            b.clamp(&mut s.q, c)?;
            b.clamp(&mut s.k, c)?;
            b.clamp(&mut s.v, c)?;
        }
        // The table's `rotary_dim` first floats of each head (all of it but in
        // glm4_moe).
        let rotary = RopeShape::whole(hd);
        b.rope(&mut s.q, &rotary, table)?;
        b.rope(&mut s.k, &rotary, table)?;
        let shape = AttentionShape {
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            head_dim: hd,
            window: cfg.sliding_window[li],
            sinks: sink_logits,
        };
        match pieces {
            [(_, kv)] => b.attention(&s.q, &s.k, &s.v, kv, li, &shape, &mut s.att)?,
            _ => {
                let mut outs = Vec::with_capacity(pieces.len());
                for (rows, kv) in pieces.iter_mut() {
                    let q = b.rows(&s.q, rows.clone())?;
                    let k = b.rows(&s.k, rows.clone())?;
                    let v = b.rows(&s.v, rows.clone())?;
                    let mut att = b.zeros(rows.len(), b.shape(&s.att).1);
                    b.attention(&q, &k, &v, kv, li, &shape, &mut att)?;
                    outs.push(att);
                }
                s.att = b.stack(&outs)?;
            }
        }
        if let Some(g) = gate {
            // transformers: `attn_output * torch.sigmoid(gate)`, in float32.
            let (rows, cols) = b.shape(&s.att);
            let mut att = b.download(&s.att)?;
            for (a, &g) in att.iter_mut().zip(&g) {
                *a *= 1.0 / (1.0 + (-g).exp());
            }
            s.att = b.upload(rows, cols, &att)?;
        }
        {
            let w = lw.step(STEP_O)?;
            o.apply(b, &w, &s.att, &mut s.o)?;
        }
        b.add(x, &s.o)?;
        Ok(())
    }

    /// The dense MLP half of a layer (`[gate, up, down]`) on one chunk `x`, its
    /// residual added.
    /// `step` is the gate's ([`Layer::mlp_step`]).
    fn dense_mlp(
        &self,
        lw: &LayerLease<'_>,
        step: usize,
        layer: &Layer,
        [gate, up, down]: [&Linear; 3],
        x: &mut B::Act,
        s: &mut Scratch<B>,
    ) -> Result<(), VoomError> {
        let (b, eps) = (&*self.backend, self.cfg.rms_norm_eps);
        {
            let w = lw.step(step)?;
            b.rms_norm(x, w.vector(&layer.mlp_norm), eps, &mut s.xn)?;
            gate.apply(b, &w, &s.xn, &mut s.g)?;
        }
        {
            let w = lw.step(step + 1)?;
            up.apply(b, &w, &s.xn, &mut s.u)?;
        }
        b.gated(Activation::Silu, &mut s.g, &s.u)?;
        {
            let w = lw.step(step + 2)?;
            down.apply(b, &w, &s.g, &mut s.o)?;
        }
        b.add(x, &s.o)?;
        Ok(())
    }

    /// Predicts the picks of the next layer of experts after `li` from the hidden
    /// state now (before `li`'s experts are added), with that layer's MLP norm and
    /// router, and hints them, so that they load while this layer's experts and the
    /// next layer's attention compute. A hint only: the pass's results never depend
    /// on it.
    fn predict_next_experts(
        &self,
        sweep: &Sweep<'_>,
        li: usize,
        xs: &[B::Act],
    ) -> Result<(), VoomError> {
        let next = self
            .layers
            .iter()
            .enumerate()
            .skip(li + 1)
            .find_map(|(n, l)| match &l.mlp {
                Mlp::Moe(e) => Some((n, l, e)),
                Mlp::Dense { .. } => None,
            });
        match next {
            Some((n, l, e)) => e.hint_picks(&*self.backend, &self.cfg, sweep, n, &l.mlp_norm, xs),
            None => Ok(()),
        }
    }
}
