//! The Llama family: llama, mistral (sliding window), qwen2 (q/k/v bias) and qwen3
//! (per-head q/k RMSNorm), and their mixtures of experts: qwen3_moe, olmoe (q/k
//! RMSNorm over the whole projection, `clip_qkv`) and mixtral. Pre-norm decoder
//! blocks with grouped-query attention, rotary embeddings (rotate-half layout) and a
//! SwiGLU MLP, or routed SwiGLU experts in its place, as in transformers.
//!
//! This file is the architecture only: its weights, its page plan (every layer's
//! pages; the embedding rows before, the final norm and LM head after) and its math
//! over the backend's ops. The sweep leases the pages.

use std::path::Path;

use vpaged::{PageId, PageSource};

use crate::backend::{Activation, AttentionShape, Backend, KernelError, RopeTable};
use crate::config::{ModelConfig, QkNorm};
use crate::kv::KvCache;
use crate::model::plan::{self, PagePlan, PerToken, Stage};
use crate::model::rope;
use crate::model::sweep::{LayerLease, Sweep};
use crate::model::weights::{Dim, Leased, Matrix, Table, Vector, WeightFinder};
use crate::model::{Logits, Model};
use crate::VoomError;

struct Linear {
    w: Matrix,
    bias: Option<Vector>,
}

impl Linear {
    fn pages(&self) -> impl Iterator<Item = PageId> + '_ {
        std::iter::once(self.w.page).chain(self.bias.iter().map(|b| b.page))
    }
}

struct Layer {
    attn_norm: Vector,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<Vector>,
    k_norm: Option<Vector>,
    mlp_norm: Vector,
    mlp: Mlp,
}

/// What follows attention in a layer.
enum Mlp {
    Dense {
        gate: Linear,
        up: Linear,
        down: Linear,
    },
    /// Routed experts: the router (`[experts, hidden]`), and each expert's SwiGLU.
    Moe {
        router: Matrix,
        experts: Vec<Expert>,
    },
}

/// One routed expert's SwiGLU.
struct Expert {
    gate: Matrix,
    up: Matrix,
    down: Matrix,
}

impl Expert {
    /// Its pages (one each, or the fused tensors all experts share), each once.
    fn pages(&self) -> Vec<PageId> {
        let mut v = vec![self.gate.page, self.up.page, self.down.page];
        v.dedup();
        v
    }
}

impl Layer {
    /// The pages of each step of the layer, in the order [`Llama::forward`] computes
    /// them (the `STEP_*` indices).
    fn steps(&self) -> Vec<Vec<PageId>> {
        let with = |first: &[PageId], lin: &Linear, after: Option<&Vector>| {
            let mut v = first.to_vec();
            v.extend(lin.pages());
            v.extend(after.map(|x| x.page));
            v
        };
        let mut steps = vec![
            with(&[self.attn_norm.page], &self.q, self.q_norm.as_ref()),
            with(&[], &self.k, self.k_norm.as_ref()),
            with(&[], &self.v, None),
            with(&[], &self.o, None),
        ];
        match &self.mlp {
            Mlp::Dense { gate, up, down } => steps.extend([
                with(&[self.mlp_norm.page], gate, None),
                with(&[], up, None),
                with(&[], down, None),
            ]),
            Mlp::Moe { router, .. } => steps.push(vec![self.mlp_norm.page, router.page]),
        }
        steps
    }

    /// Each routed expert's pages (none in a dense layer).
    fn expert_pages(&self) -> Vec<Vec<PageId>> {
        match &self.mlp {
            Mlp::Dense { .. } => Vec::new(),
            Mlp::Moe { experts, .. } => experts.iter().map(Expert::pages).collect(),
        }
    }
}

/// The steps of a layer ([`Layer::steps`]).
const STEP_Q: usize = 0;
const STEP_K: usize = 1;
const STEP_V: usize = 2;
const STEP_O: usize = 3;
const STEP_GATE: usize = 4;
const STEP_UP: usize = 5;
const STEP_DOWN: usize = 6;
/// A layer of routed experts: the MLP norm and the router.
const STEP_ROUTER: usize = 4;

/// A Llama-family model on backend `B`.
pub struct Llama<B: Backend> {
    cfg: ModelConfig,
    backend: B,
    embed: Table,
    final_norm: Vector,
    lm_head: Table,
    layers: Vec<Layer>,
    inv_freq: Vec<f32>,
    plan: PagePlan,
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
    /// Routed experts (rows of the router), and each expert's intermediate width.
    experts: Dim,
    expert_inter: Dim,
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
            experts: Dim::of("num_experts", cfg.moe.as_ref().map_or(0, |m| m.num_experts)),
            expert_inter: match (cfg.arch, &cfg.moe) {
                (crate::config::Arch::Qwen3Moe, Some(m)) => {
                    Dim::of("moe_intermediate_size", m.expert_intermediate_size)
                }
                (_, m) => Dim::of(
                    "intermediate_size",
                    m.as_ref().map_or(0, |m| m.expert_intermediate_size),
                ),
            },
        })
    }
}

/// The routed experts of the layer whose tensors start `p` (`model.layers.N`): the
/// router, and each expert's gate, up and down projections, stored one tensor per
/// expert and projection (`mlp.experts.E.gate_proj`, mixtral's
/// `block_sparse_moe.experts.E.w1`/`w3`/`w2`) or fused (`mlp.experts.gate_up_proj`
/// `[experts, 2 × intermediate, hidden]`, gate rows first, and `mlp.experts.down_proj`
/// `[experts, hidden, intermediate]`, as transformers 5 can save them).
fn load_experts(
    f: &WeightFinder<'_>,
    cfg: &ModelConfig,
    d: &ConfigDims,
    p: &str,
) -> Result<Mlp, VoomError> {
    let n = cfg.moe.as_ref().map_or(0, |m| m.num_experts);
    let block = format!("{p}.block_sparse_moe");
    let m = if f.has(&format!("{block}.gate.weight")) {
        block
    } else {
        format!("{p}.mlp")
    };
    let router = f.matrix(&format!("{m}.gate.weight"), &d.experts, &d.hidden)?;
    let fused = format!("{m}.experts.gate_up_proj");
    let inter = d.expert_inter.len;
    let experts = if f.has(&fused) {
        let both = Dim {
            len: 2 * inter,
            key: format!("2 × {}", d.expert_inter.key),
        };
        let gate_up = f.stacked(&fused, &d.experts, &both, &d.hidden)?;
        let down = f.stacked(
            &format!("{m}.experts.down_proj"),
            &d.experts,
            &d.hidden,
            &d.expert_inter,
        )?;
        gate_up
            .into_iter()
            .zip(down)
            .map(|(gu, down)| Expert {
                gate: gu.sub_rows(0, inter),
                up: gu.sub_rows(inter, inter),
                down,
            })
            .collect()
    } else {
        let (g, u, dn) = if m.ends_with("block_sparse_moe") {
            ("w1", "w3", "w2")
        } else {
            ("gate_proj", "up_proj", "down_proj")
        };
        let w = |e: usize, proj: &str| format!("{m}.experts.{e}.{proj}.weight");
        (0..n)
            .map(|e| {
                Ok(Expert {
                    gate: f.matrix(&w(e, g), &d.expert_inter, &d.hidden)?,
                    up: f.matrix(&w(e, u), &d.expert_inter, &d.hidden)?,
                    down: f.matrix(&w(e, dn), &d.hidden, &d.expert_inter)?,
                })
            })
            .collect::<Result<Vec<_>, VoomError>>()?
    };
    Ok(Mlp::Moe { router, experts })
}

/// One chunk's routing in a layer of experts: its normed rows (the experts' input)
/// and, per row, the experts picked with their weights, in the router's order.
struct Routed {
    xn: Vec<f32>,
    picks: Vec<Vec<(u32, f32)>>,
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
    pub fn load(
        cfg: ModelConfig,
        source: &dyn PageSource,
        model: &str,
        backend: B,
    ) -> Result<Self, VoomError> {
        let config = Path::new(model).join("config.json");
        cfg.validate(&config)?;
        let f = WeightFinder::new(source, model);
        let in_checkpoint = f.layer_count()?;
        if in_checkpoint != cfg.num_layers {
            return Err(f.err(
                "model.layers.N.*",
                format!(
                    "config.json's 'num_hidden_layers' is {}, but the checkpoint has {in_checkpoint} layers",
                    cfg.num_layers
                ),
            ));
        }
        let d = ConfigDims::of(&cfg, &config)?;
        let linear =
            |name: &str, rows: &Dim, cols: &Dim, bias: bool| -> Result<Linear, VoomError> {
                Ok(Linear {
                    w: f.matrix(&format!("{name}.weight"), rows, cols)?,
                    bias: if bias {
                        Some(f.vector(&format!("{name}.bias"), rows)?)
                    } else {
                        None
                    },
                })
            };
        let embed = f.table("model.embed_tokens.weight", &d.vocab, &d.hidden)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            f.table("lm_head.weight", &d.vocab, &d.hidden)?
        };
        let final_norm = f.vector("model.norm.weight", &d.hidden)?;
        // As many as the checkpoint has (checked above).
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            let a = format!("{p}.self_attn");
            let m = format!("{p}.mlp");
            layers.push(Layer {
                attn_norm: f.vector(&format!("{p}.input_layernorm.weight"), &d.hidden)?,
                q: linear(&format!("{a}.q_proj"), &d.q, &d.hidden, cfg.qkv_bias)?,
                k: linear(&format!("{a}.k_proj"), &d.kv, &d.hidden, cfg.qkv_bias)?,
                v: linear(&format!("{a}.v_proj"), &d.kv, &d.hidden, cfg.qkv_bias)?,
                o: linear(&format!("{a}.o_proj"), &d.hidden, &d.q, cfg.o_bias)?,
                q_norm: match cfg.qk_norm {
                    QkNorm::None => None,
                    QkNorm::PerHead => Some(f.vector(&format!("{a}.q_norm.weight"), &d.head)?),
                    QkNorm::Whole => Some(f.vector(&format!("{a}.q_norm.weight"), &d.q)?),
                },
                k_norm: match cfg.qk_norm {
                    QkNorm::None => None,
                    QkNorm::PerHead => Some(f.vector(&format!("{a}.k_norm.weight"), &d.head)?),
                    QkNorm::Whole => Some(f.vector(&format!("{a}.k_norm.weight"), &d.kv)?),
                },
                mlp_norm: f.vector(&format!("{p}.post_attention_layernorm.weight"), &d.hidden)?,
                mlp: match &cfg.moe {
                    Some(moe) if moe.sparse[i] => load_experts(&f, &cfg, &d, &p)?,
                    _ => Mlp::Dense {
                        gate: linear(&format!("{m}.gate_proj"), &d.inter, &d.hidden, cfg.mlp_bias)?,
                        up: linear(&format!("{m}.up_proj"), &d.inter, &d.hidden, cfg.mlp_bias)?,
                        down: linear(&format!("{m}.down_proj"), &d.hidden, &d.inter, cfg.mlp_bias)?,
                    },
                },
            });
        }
        // A token reads one row of the embedding: where the source reads only what is
        // touched, that row; where it loads pages whole, the part holding it (all of a
        // table stored whole). Spread over the parts: each is read by a share of tokens.
        let n = embed.parts.len() as u64;
        let row = (embed.cols * embed.dtype.size()) as u64;
        let head: Vec<(PageId, Option<PerToken>)> = embed
            .parts
            .iter()
            .map(|p| {
                let bytes = (p.rows * embed.cols * embed.dtype.size()) as u64;
                let per = PerToken {
                    partial: row.div_ceil(n),
                    whole: bytes.div_ceil(n),
                };
                (p.page, Some(per))
            })
            .collect();
        // Steps: the table's parts are leased in batches of at least one; the final
        // norm with the head's first part.
        let head: Vec<Vec<_>> = head.into_iter().map(|r| vec![r]).collect();
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
        Ok(Llama {
            cfg,
            backend,
            embed,
            final_norm,
            lm_head,
            layers,
            inv_freq,
            plan,
        })
    }

    /// `out = x · lin.wᵀ (+ bias)`, on the step's leases.
    fn linear(
        &self,
        w: &Leased,
        lin: &Linear,
        x: &B::Act,
        out: &mut B::Act,
    ) -> Result<(), VoomError> {
        self.backend.matmul(x, w.matrix(&lin.w), out)?;
        if let Some(b) = &lin.bias {
            self.backend.add_bias(out, w.vector(b))?;
        }
        Ok(())
    }
}

impl<B: Backend> Model for Llama<B> {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn plan(&self) -> &PagePlan {
        &self.plan
    }

    fn backend_name(&self) -> String {
        self.backend.name()
    }

    fn threads(&self) -> usize {
        self.backend.threads()
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
        // probabilities.
        let experts = cfg.moe.as_ref().map_or(0, |m| {
            tokens * 2 * h
                + tokens * (3 * h + 2 * m.expert_intermediate_size)
                + tokens * 8 * m.top_k
                + chunk * m.num_experts
        });
        let floats = tokens * (h + hd)
            + 2 * chunk * per_chunk
            + 2 * h
            + cfg.vocab_size
            + self.threads() * context
            + experts;
        (floats * std::mem::size_of::<f32>()) as u64
    }

    fn forward(
        &self,
        sweep: &Sweep<'_>,
        tokens: &[u32],
        chunk: usize,
        kv: &mut KvCache,
        want: Logits,
    ) -> Result<Vec<f32>, VoomError> {
        let (b, cfg) = (&self.backend, &self.cfg);
        let n = tokens.len();
        let pos0 = kv.len();
        let h = cfg.hidden_size;
        // The positions in chunks: each layer computes every chunk in turn, so the
        // pass reads the weights once however many chunks there are.
        let chunk = chunk.clamp(1, n);
        let ranges: Vec<std::ops::Range<usize>> = (0..n)
            .step_by(chunk)
            .map(|s| s..(s + chunk).min(n))
            .collect();

        let mut xs: Vec<B::Act> = ranges.iter().map(|r| b.zeros(r.len(), h)).collect();
        self.embed_rows(sweep, tokens, &ranges, &mut xs)?;
        let tables: Vec<_> = ranges
            .iter()
            .map(|r| rope::table(&self.inv_freq, pos0 + r.start, r.len()))
            .collect();

        let mut full = Scratch::new(b, cfg, chunk);
        let mut rest: Option<Scratch<B>> = None;
        for (li, layer) in self.layers.iter().enumerate() {
            let lw = sweep.layer(li)?;
            // A layer of experts routes every chunk before any expert is leased, so
            // that each expert picked is read once per pass, however many chunks.
            let mut routed = Vec::new();
            for (x, table) in xs.iter_mut().zip(&tables) {
                let rows = b.shape(x).0;
                let s = if rows == chunk {
                    &mut full
                } else {
                    rest.get_or_insert_with(|| Scratch::new(b, cfg, rows))
                };
                self.attention(&lw, li, layer, x, table, kv, s)?;
                match &layer.mlp {
                    Mlp::Dense { gate, up, down } => {
                        self.dense_mlp(&lw, layer, [gate, up, down], x, s)?
                    }
                    Mlp::Moe { router, .. } => routed.push(self.route(&lw, layer, router, x, s)?),
                }
            }
            if let Mlp::Moe { experts, .. } = &layer.mlp {
                if sweep.predicts_experts() {
                    self.predict_next_experts(sweep, li, &xs)?;
                }
                self.experts(&lw, experts, &routed, &mut xs)?;
            }
        }

        // Final norm and LM head on the rows whose logits are wanted. A head stored in
        // row parts is leased a bounded batch of parts at a time, the final norm with
        // the first.
        let head = &self.lm_head;
        let norm =
            plan::slot_bytes(self.final_norm.len as u64 * self.final_norm.dtype.size() as u64);
        let batches = head.batches(&head.pages(), sweep.lease_bound().saturating_sub(norm));
        let mut first = vec![self.final_norm.page];
        first.extend(&batches[0]);
        let w = sweep.tail(&first)?;
        let last = xs.len() - 1;
        let mut normed = Vec::new();
        for (i, x) in xs.into_iter().enumerate() {
            let rows = match want {
                Logits::Last if i < last => continue,
                Logits::Last => {
                    let r = b.shape(&x).0;
                    b.rows(&x, r - 1..r)?
                }
                Logits::All => x,
            };
            let mut hn = b.zeros(b.shape(&rows).0, h);
            b.rms_norm(&rows, w.vector(&self.final_norm), cfg.rms_norm_eps, &mut hn)?;
            normed.push(hn);
        }
        if let [(_, whole)] = w.table(head).parts[..] {
            let mut out = Vec::new();
            for hn in &normed {
                let mut logits = b.zeros(b.shape(hn).0, cfg.vocab_size);
                b.matmul(hn, whole, &mut logits)?;
                out.extend(b.download_owned(logits));
            }
            return Ok(out);
        }
        // Each part's logits are the same elements computed the same way (one
        // accumulation order per output element, whatever rows a call has), put in
        // place.
        let v = cfg.vocab_size;
        let total: usize = normed.iter().map(|hn| b.shape(hn).0).sum();
        let mut out = vec![0.0f32; total * v];
        sweep.hint(&head.pages()[batches[0].len()..]);
        let mut w = Some(w);
        for batch in &batches {
            let lease = match w.take() {
                Some(w) => w,
                None => sweep.lease(batch)?,
            };
            let view = lease.table(head);
            let mut at = 0;
            for hn in &normed {
                let m = b.shape(hn).0;
                for (first, part) in &view.parts {
                    let mut logits = b.zeros(m, part.rows);
                    b.matmul(hn, *part, &mut logits)?;
                    let got = b.download_owned(logits);
                    for t in 0..m {
                        let dst = (at + t) * v + first;
                        out[dst..dst + part.rows]
                            .copy_from_slice(&got[t * part.rows..(t + 1) * part.rows]);
                    }
                }
                at += m;
            }
        }
        Ok(out)
    }
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
        tokens: &[u32],
        ranges: &[std::ops::Range<usize>],
        xs: &mut [B::Act],
    ) -> Result<(), VoomError> {
        let b = &self.backend;
        let t = &self.embed;
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= t.rows) {
            return Err(KernelError::RowOutOfRange { id, rows: t.rows }.into());
        }
        let needed = t.pages_for(tokens);
        // Each part as the cache holds it (a slot), so that many small parts
        // cannot add up to more room than the bound.
        let batches = t.batches(&needed, sweep.lease_bound());
        if batches.len() > 1 {
            sweep.hint(&needed[batches[0].len()..]);
        }
        for batch in &batches {
            let w = sweep.lease(batch)?;
            let view = w.table(t);
            for (x, r) in xs.iter_mut().zip(ranges) {
                b.embed(&view, &tokens[r.clone()], x)?;
            }
        }
        Ok(())
    }

    /// The attention half of decoder layer `li` on one chunk of positions `x` (in
    /// place, its residual added), after the chunks before it: their keys and values
    /// are in `kv` already.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        lw: &LayerLease<'_>,
        li: usize,
        layer: &Layer,
        x: &mut B::Act,
        table: &RopeTable,
        kv: &mut KvCache,
        s: &mut Scratch<B>,
    ) -> Result<(), VoomError> {
        let (b, cfg) = (&self.backend, &self.cfg);
        let (hd, eps) = (cfg.head_dim, cfg.rms_norm_eps);
        // Per head (qwen3), or over the whole projection (olmoe).
        let (qg, kg) = match cfg.qk_norm {
            QkNorm::Whole => (cfg.num_heads * hd, cfg.num_kv_heads * hd),
            _ => (hd, hd),
        };
        {
            let w = lw.step(STEP_Q)?;
            b.rms_norm(x, w.vector(&layer.attn_norm), eps, &mut s.xn)?;
            self.linear(&w, &layer.q, &s.xn, &mut s.q)?;
            if let Some(qn) = &layer.q_norm {
                b.rms_norm_groups(&mut s.q, qg, w.vector(qn), eps)?;
            }
        }
        {
            let w = lw.step(STEP_K)?;
            self.linear(&w, &layer.k, &s.xn, &mut s.k)?;
            if let Some(kn) = &layer.k_norm {
                b.rms_norm_groups(&mut s.k, kg, w.vector(kn), eps)?;
            }
        }
        {
            let w = lw.step(STEP_V)?;
            self.linear(&w, &layer.v, &s.xn, &mut s.v)?;
        }
        if let Some(c) = cfg.clip_qkv {
            b.clamp(&mut s.q, c)?;
            b.clamp(&mut s.k, c)?;
            b.clamp(&mut s.v, c)?;
        }
        b.rope(&mut s.q, hd, table)?;
        b.rope(&mut s.k, hd, table)?;
        let shape = AttentionShape {
            heads: cfg.num_heads,
            kv_heads: cfg.num_kv_heads,
            head_dim: hd,
            window: cfg.sliding_window[li],
        };
        b.attention(&s.q, &s.k, &s.v, kv, li, &shape, &mut s.att)?;
        {
            let w = lw.step(STEP_O)?;
            self.linear(&w, &layer.o, &s.att, &mut s.o)?;
        }
        b.add(x, &s.o)?;
        Ok(())
    }

    /// The dense MLP half of a layer (`[gate, up, down]`) on one chunk `x`, its
    /// residual added.
    fn dense_mlp(
        &self,
        lw: &LayerLease<'_>,
        layer: &Layer,
        [gate, up, down]: [&Linear; 3],
        x: &mut B::Act,
        s: &mut Scratch<B>,
    ) -> Result<(), VoomError> {
        let (b, eps) = (&self.backend, self.cfg.rms_norm_eps);
        {
            let w = lw.step(STEP_GATE)?;
            b.rms_norm(x, w.vector(&layer.mlp_norm), eps, &mut s.xn)?;
            self.linear(&w, gate, &s.xn, &mut s.g)?;
        }
        {
            let w = lw.step(STEP_UP)?;
            self.linear(&w, up, &s.xn, &mut s.u)?;
        }
        b.gated(Activation::Silu, &mut s.g, &s.u)?;
        {
            let w = lw.step(STEP_DOWN)?;
            self.linear(&w, down, &s.g, &mut s.o)?;
        }
        b.add(x, &s.o)?;
        Ok(())
    }

    /// Routes one chunk `x` in a layer of experts: the MLP norm, the router's
    /// softmax over every expert, the `top_k` most probable (renormalised to sum to
    /// one where the config says so), as transformers routes.
    fn route(
        &self,
        lw: &LayerLease<'_>,
        layer: &Layer,
        router: &Matrix,
        x: &B::Act,
        s: &mut Scratch<B>,
    ) -> Result<Routed, VoomError> {
        let (b, cfg) = (&self.backend, &self.cfg);
        let moe = cfg
            .moe
            .as_ref()
            .expect("a layer of experts has a config of them");
        let w = lw.step(STEP_ROUTER)?;
        b.rms_norm(x, w.vector(&layer.mlp_norm), cfg.rms_norm_eps, &mut s.xn)?;
        let mut probs = b.zeros(b.shape(x).0, moe.num_experts);
        b.matmul(&s.xn, w.matrix(router), &mut probs)?;
        b.softmax(&mut probs)?;
        let mut picks = b.top_k(&probs, moe.top_k);
        if moe.norm_topk_prob {
            for row in &mut picks {
                let sum: f32 = row.iter().map(|p| p.1).sum();
                for p in row.iter_mut() {
                    p.1 /= sum;
                }
            }
        }
        Ok(Routed {
            xn: b.download(&s.xn),
            picks,
        })
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
        let b = &self.backend;
        let Some((n, next, router)) =
            self.layers
                .iter()
                .enumerate()
                .skip(li + 1)
                .find_map(|(n, l)| match &l.mlp {
                    Mlp::Moe { router, .. } => Some((n, l, router)),
                    Mlp::Dense { .. } => None,
                })
        else {
            return Ok(());
        };
        let moe = self
            .cfg
            .moe
            .as_ref()
            .expect("a layer of experts has a config of them");
        let w = sweep.lease(&[next.mlp_norm.page, router.page])?;
        let mut picked = vec![false; moe.num_experts];
        for x in xs {
            let rows = b.shape(x).0;
            let mut xn = b.zeros(rows, self.cfg.hidden_size);
            b.rms_norm(x, w.vector(&next.mlp_norm), self.cfg.rms_norm_eps, &mut xn)?;
            let mut probs = b.zeros(rows, moe.num_experts);
            b.matmul(&xn, w.matrix(router), &mut probs)?;
            for row in b.top_k(&probs, moe.top_k) {
                for (e, _) in row {
                    picked[e as usize] = true;
                }
            }
        }
        let experts: Vec<usize> = (0..picked.len()).filter(|&e| picked[e]).collect();
        sweep.hint_experts(n, &experts);
        Ok(())
    }

    /// The routed experts of a layer over every chunk (`routed`, one per chunk of
    /// `xs`): each expert picked is leased once, in ascending order, and computes the
    /// rows routed to it; each row's output is the sum of its experts' outputs times
    /// their weights, added in ascending expert order (as transformers' experts loop
    /// adds them), then its residual.
    fn experts(
        &self,
        lw: &LayerLease<'_>,
        experts: &[Expert],
        routed: &[Routed],
        xs: &mut [B::Act],
    ) -> Result<(), VoomError> {
        let b = &self.backend;
        let h = self.cfg.hidden_size;
        let inter = self
            .cfg
            .moe
            .as_ref()
            .map_or(0, |m| m.expert_intermediate_size);
        // The rows each expert computes: (chunk, row, weight), in position order.
        let mut to: Vec<Vec<(usize, usize, f32)>> = vec![Vec::new(); experts.len()];
        for (c, r) in routed.iter().enumerate() {
            for (row, picks) in r.picks.iter().enumerate() {
                for &(e, weight) in picks {
                    to[e as usize].push((c, row, weight));
                }
            }
        }
        let chosen: Vec<usize> = (0..experts.len()).filter(|&e| !to[e].is_empty()).collect();
        let mut out: Vec<Vec<f32>> = routed
            .iter()
            .map(|r| vec![0.0f32; r.picks.len() * h])
            .collect();
        lw.experts(&chosen, |e, w| {
            let rows = &to[e];
            let input = {
                let mut v = Vec::with_capacity(rows.len() * h);
                for &(c, r, _) in rows {
                    v.extend_from_slice(&routed[c].xn[r * h..(r + 1) * h]);
                }
                b.upload(rows.len(), h, &v)?
            };
            let ex = &experts[e];
            let mut g = b.zeros(rows.len(), inter);
            let mut u = b.zeros(rows.len(), inter);
            b.matmul(&input, w.matrix(&ex.gate), &mut g)?;
            b.matmul(&input, w.matrix(&ex.up), &mut u)?;
            b.gated(Activation::Silu, &mut g, &u)?;
            let mut y = b.zeros(rows.len(), h);
            b.matmul(&g, w.matrix(&ex.down), &mut y)?;
            let y = b.download_owned(y);
            for (i, &(c, r, weight)) in rows.iter().enumerate() {
                let dst = &mut out[c][r * h..(r + 1) * h];
                for (o, &v) in dst.iter_mut().zip(&y[i * h..(i + 1) * h]) {
                    *o += v * weight;
                }
            }
            Ok(())
        })?;
        for (x, o) in xs.iter_mut().zip(out) {
            let o = b.upload(b.shape(x).0, h, &o)?;
            b.add(x, &o)?;
        }
        Ok(())
    }
}
