//! The Llama family: llama, mistral (sliding window), qwen2 (q/k/v bias) and qwen3
//! (per-head q/k RMSNorm). Pre-norm decoder blocks with grouped-query attention,
//! rotary embeddings (rotate-half layout) and a SwiGLU MLP, as in transformers.
//!
//! Each layer's pages are leased for the time that layer is computed, and the next
//! layer's pages are hinted to the page source meanwhile.

use std::path::Path;

use vpaged::{PageId, PageSource};

use crate::backend::cpu::matmul::{self, matmul};
use crate::backend::cpu::ops::{self, VecView};
use crate::backend::cpu::threads::ThreadPool;
use crate::config::ModelConfig;
use crate::kv::KvCache;
use crate::model::rope;
use crate::model::weights::{Dim, Leased, Matrix, Vector, WeightFinder};
use crate::VoomError;

struct Linear {
    w: Matrix,
    bias: Option<Vector>,
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
    gate: Linear,
    up: Linear,
    down: Linear,
    pages: Vec<PageId>,
}

pub struct LlamaModel {
    pub cfg: ModelConfig,
    embed: Matrix,
    final_norm: Vector,
    lm_head: Matrix,
    layers: Vec<Layer>,
    inv_freq: Vec<f32>,
    /// Bytes of the largest decoder layer's pages (decides how much to lease at once).
    largest_layer_bytes: u64,
    /// Layers hinted ahead of the one computing (0: no prefetch hints).
    prefetch_depth: usize,
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

/// Which positions' logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position's (prefill, decode).
    Last,
    /// Every position's (verification of several proposed tokens).
    All,
}

impl LlamaModel {
    /// Resolves every weight the config implies, checking dtypes and shapes.
    ///
    /// The config is untrusted until it matches the checkpoint, so nothing is
    /// allocated from it first: its ranges are checked ([`ModelConfig::validate`]),
    /// then its layer count against the checkpoint's `model.layers.N.*` tensors, then
    /// every tensor's shape (each mismatch names the config.json key it contradicts:
    /// `vocab_size`, `hidden_size`, `num_attention_heads × head_dim`, ...). Only then
    /// is anything sized by the config.
    pub fn load(cfg: ModelConfig, source: &dyn PageSource, model: &str) -> Result<Self, VoomError> {
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
        let embed = f.matrix("model.embed_tokens.weight", &d.vocab, &d.hidden)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed
        } else {
            f.matrix("lm_head.weight", &d.vocab, &d.hidden)?
        };
        let final_norm = f.vector("model.norm.weight", &d.hidden)?;
        // As many as the checkpoint has (checked above).
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            let a = format!("{p}.self_attn");
            let m = format!("{p}.mlp");
            let mut layer = Layer {
                attn_norm: f.vector(&format!("{p}.input_layernorm.weight"), &d.hidden)?,
                q: linear(&format!("{a}.q_proj"), &d.q, &d.hidden, cfg.qkv_bias)?,
                k: linear(&format!("{a}.k_proj"), &d.kv, &d.hidden, cfg.qkv_bias)?,
                v: linear(&format!("{a}.v_proj"), &d.kv, &d.hidden, cfg.qkv_bias)?,
                o: linear(&format!("{a}.o_proj"), &d.hidden, &d.q, cfg.o_bias)?,
                q_norm: if cfg.qk_norm {
                    Some(f.vector(&format!("{a}.q_norm.weight"), &d.head)?)
                } else {
                    None
                },
                k_norm: if cfg.qk_norm {
                    Some(f.vector(&format!("{a}.k_norm.weight"), &d.head)?)
                } else {
                    None
                },
                mlp_norm: f.vector(&format!("{p}.post_attention_layernorm.weight"), &d.hidden)?,
                gate: linear(&format!("{m}.gate_proj"), &d.inter, &d.hidden, cfg.mlp_bias)?,
                up: linear(&format!("{m}.up_proj"), &d.inter, &d.hidden, cfg.mlp_bias)?,
                down: linear(&format!("{m}.down_proj"), &d.hidden, &d.inter, cfg.mlp_bias)?,
                pages: Vec::new(),
            };
            layer.pages = layer_pages(&layer);
            layers.push(layer);
        }
        let inv_freq = rope::inv_freq(&cfg);
        let largest_layer_bytes = layers
            .iter()
            .map(|l| {
                l.pages
                    .iter()
                    .map(|p| source.pages()[p.0 as usize].len)
                    .sum::<u64>()
            })
            .max()
            .unwrap_or(0);
        Ok(LlamaModel {
            cfg,
            embed,
            final_norm,
            lm_head,
            layers,
            inv_freq,
            largest_layer_bytes,
            prefetch_depth: 1,
        })
    }

    /// Layers to hint ahead of the one computing; 0 sends no prefetch hints. Hints never
    /// change results, only when pages arrive.
    pub fn set_prefetch_depth(&mut self, depth: usize) {
        self.prefetch_depth = depth;
    }

    pub fn prefetch_depth(&self) -> usize {
        self.prefetch_depth
    }

    /// Layers actually hinted ahead: the configured depth, bounded so that the layer
    /// computing and those hinted fit the source's budget (at least one ahead, which a
    /// small cache streams).
    fn effective_prefetch_depth(&self, source: &dyn PageSource) -> usize {
        match (self.prefetch_depth, source.budget()) {
            (0, _) => 0,
            (d, Some(b)) if self.largest_layer_bytes > 0 => {
                let fit = (b / self.largest_layer_bytes).saturating_sub(1) as usize;
                d.min(fit.max(1))
            }
            (d, _) => d,
        }
    }

    /// Sends the hints due when layer `li` starts: layers `li+1..=li+depth` at the
    /// first layer, then the one newly inside the window; past the last layer, the
    /// final norm and LM head.
    fn hint_ahead(&self, source: &dyn PageSource, li: usize, depth: usize) {
        if depth == 0 {
            return;
        }
        let first = if li == 0 { 1 } else { li + depth };
        for t in first..=li + depth {
            match t.cmp(&self.layers.len()) {
                std::cmp::Ordering::Less => source.prefetch(&self.layers[t].pages),
                std::cmp::Ordering::Equal => {
                    source.prefetch(&[self.final_norm.page, self.lm_head.page])
                }
                std::cmp::Ordering::Greater => break,
            }
        }
    }

    /// Bytes of weights read for one decode token (every layer, the embedding row,
    /// the final norm and the LM head).
    pub fn weight_bytes_per_token(&self) -> u64 {
        let mat = |m: &Matrix| (m.rows * m.cols * m.dtype.size()) as u64;
        let vec = |v: &Vector| (v.len * v.dtype.size()) as u64;
        let lin = |l: &Linear| mat(&l.w) + l.bias.as_ref().map_or(0, vec);
        let mut total = (self.embed.cols * self.embed.dtype.size()) as u64
            + vec(&self.final_norm)
            + mat(&self.lm_head);
        for l in &self.layers {
            total += vec(&l.attn_norm) + vec(&l.mlp_norm);
            total += lin(&l.q) + lin(&l.k) + lin(&l.v) + lin(&l.o);
            total += lin(&l.gate) + lin(&l.up) + lin(&l.down);
            total += l.q_norm.as_ref().map_or(0, vec) + l.k_norm.as_ref().map_or(0, vec);
        }
        total
    }

    /// A KV cache sized for this model, holding at most `capacity` positions.
    pub fn new_kv(&self, capacity: usize) -> KvCache {
        KvCache::new(
            self.cfg.num_layers,
            self.cfg.num_kv_heads * self.cfg.head_dim,
            capacity.min(self.cfg.max_position_embeddings),
        )
    }

    /// Runs `tokens` at positions `kv.len()..` and returns logits (`vocab` floats per
    /// returned position). On error the cache is left as it was.
    pub fn forward(
        &self,
        source: &dyn PageSource,
        pool: &ThreadPool,
        tokens: &[u32],
        kv: &mut KvCache,
        want: Logits,
    ) -> Result<Vec<f32>, VoomError> {
        let start = kv.len();
        let lease = self.lease_scope(source);
        let r = self.forward_inner(source, pool, tokens, kv, want, lease);
        // Every lease of the pass is dropped by now: let a remote source deliver the
        // releases it batched.
        source.flush();
        match r {
            Ok(l) => {
                kv.commit(tokens.len());
                Ok(l)
            }
            Err(e) => {
                kv.truncate(start);
                Err(e)
            }
        }
    }

    /// Leases a whole layer at once when the source's cache holds two layers (this
    /// one and the one prefetched), else one step (one matrix) at a time, so that a
    /// cache smaller than a layer still works by streaming.
    fn lease_scope(&self, source: &dyn PageSource) -> LeaseScope {
        match source.budget() {
            Some(b) if b < 2 * self.largest_layer_bytes => LeaseScope::Tensor,
            _ => LeaseScope::Layer,
        }
    }

    fn forward_inner(
        &self,
        source: &dyn PageSource,
        pool: &ThreadPool,
        tokens: &[u32],
        kv: &mut KvCache,
        want: Logits,
        lease: LeaseScope,
    ) -> Result<Vec<f32>, VoomError> {
        let cfg = &self.cfg;
        let n = tokens.len();
        if n == 0 {
            return Err(VoomError::Request("no tokens to compute".into()));
        }
        let pos0 = kv.len();
        if pos0 + n > kv.capacity() {
            return Err(VoomError::Request(format!(
                "context full: {pos0} positions cached + {n} new exceed the limit of {}",
                kv.capacity()
            )));
        }
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let (qd, kvd) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);

        // Embedding rows.
        let mut x = vec![0f32; n * h];
        {
            let leased = Leased::acquire(source, &[self.embed.page])?;
            let e = leased.matrix(&self.embed);
            for (t, &tok) in tokens.iter().enumerate() {
                if tok as usize >= cfg.vocab_size {
                    return Err(VoomError::Request(format!(
                        "token id {tok} is out of range for a vocabulary of {}",
                        cfg.vocab_size
                    )));
                }
                let row = VecView {
                    dtype: e.dtype,
                    bytes: &e.bytes[tok as usize * h * e.dtype.size()
                        ..(tok as usize + 1) * h * e.dtype.size()],
                };
                for (j, v) in x[t * h..(t + 1) * h].iter_mut().enumerate() {
                    *v = row.get(j);
                }
            }
        }

        // Rotary tables for these positions.
        let half = hd / 2;
        let mut cos = vec![0f32; n * half];
        let mut sin = vec![0f32; n * half];
        for t in 0..n {
            rope::cos_sin(
                &self.inv_freq,
                pos0 + t,
                &mut cos[t * half..(t + 1) * half],
                &mut sin[t * half..(t + 1) * half],
            );
        }

        let mut xn = vec![0f32; n * h];
        let mut q = vec![0f32; n * qd];
        let mut k = vec![0f32; n * kvd];
        let mut v = vec![0f32; n * kvd];
        let mut att = vec![0f32; n * qd];
        let mut o = vec![0f32; n * h];
        let mut g = vec![0f32; n * cfg.intermediate_size];
        let mut u = vec![0f32; n * cfg.intermediate_size];

        let depth = self.effective_prefetch_depth(source);
        for (li, layer) in self.layers.iter().enumerate() {
            self.hint_ahead(source, li, depth);
            // The whole layer leased at once, or (small caches) one step at a time.
            let whole = match lease {
                LeaseScope::Layer => Some(Leased::acquire(source, &layer.pages)?),
                LeaseScope::Tensor => None,
            };
            let step = |ids: &[PageId]| -> Result<StepLease<'_>, VoomError> {
                match &whole {
                    Some(l) => Ok(StepLease::Shared(l)),
                    None => Ok(StepLease::Own(Leased::acquire(source, ids)?)),
                }
            };

            {
                let mut ids = vec![layer.attn_norm.page];
                ids.extend(linear_pages(&layer.q));
                ids.extend(layer.q_norm.iter().map(|v| v.page));
                let w = step(&ids)?;
                ops::rms_norm(
                    &x,
                    h,
                    &w.vector(&layer.attn_norm).to_vec(),
                    cfg.rms_norm_eps,
                    &mut xn,
                );
                apply_linear(pool, &w, &layer.q, &xn, n, &mut q)?;
                if let Some(qn) = &layer.q_norm {
                    ops::rms_norm_inplace(&mut q, hd, &w.vector(qn).to_vec(), cfg.rms_norm_eps);
                }
            }
            {
                let mut ids = linear_pages(&layer.k);
                ids.extend(layer.k_norm.iter().map(|v| v.page));
                let w = step(&ids)?;
                apply_linear(pool, &w, &layer.k, &xn, n, &mut k)?;
                if let Some(kn) = &layer.k_norm {
                    ops::rms_norm_inplace(&mut k, hd, &w.vector(kn).to_vec(), cfg.rms_norm_eps);
                }
            }
            {
                let w = step(&linear_pages(&layer.v))?;
                apply_linear(pool, &w, &layer.v, &xn, n, &mut v)?;
            }
            for t in 0..n {
                let (c, s) = (
                    &cos[t * half..(t + 1) * half],
                    &sin[t * half..(t + 1) * half],
                );
                for head in q[t * qd..(t + 1) * qd].chunks_exact_mut(hd) {
                    ops::rope_head(head, c, s);
                }
                for head in k[t * kvd..(t + 1) * kvd].chunks_exact_mut(hd) {
                    ops::rope_head(head, c, s);
                }
            }
            kv.append(li, &k, &v)?;
            let (kc, vc) = kv.layer(li);
            attention(
                pool,
                cfg,
                &q,
                kc,
                vc,
                pos0,
                n,
                cfg.sliding_window[li],
                &mut att,
            );
            {
                let w = step(&linear_pages(&layer.o))?;
                apply_linear(pool, &w, &layer.o, &att, n, &mut o)?;
            }
            ops::add_inplace(&mut x, &o);

            let mut ids = vec![layer.mlp_norm.page];
            ids.extend(linear_pages(&layer.gate));
            let w = step(&ids)?;
            ops::rms_norm(
                &x,
                h,
                &w.vector(&layer.mlp_norm).to_vec(),
                cfg.rms_norm_eps,
                &mut xn,
            );
            apply_linear(pool, &w, &layer.gate, &xn, n, &mut g)?;
            drop(w);
            {
                let w = step(&linear_pages(&layer.up))?;
                apply_linear(pool, &w, &layer.up, &xn, n, &mut u)?;
            }
            ops::silu_mul(&mut g, &u);
            {
                let w = step(&linear_pages(&layer.down))?;
                apply_linear(pool, &w, &layer.down, &g, n, &mut o)?;
            }
            ops::add_inplace(&mut x, &o);
        }

        // Final norm and LM head on the rows whose logits are wanted.
        let rows = match want {
            Logits::Last => &x[(n - 1) * h..],
            Logits::All => &x[..],
        };
        let m = rows.len() / h;
        let w = Leased::acquire(source, &[self.final_norm.page, self.lm_head.page])?;
        let mut hn = vec![0f32; m * h];
        ops::rms_norm(
            rows,
            h,
            &w.vector(&self.final_norm).to_vec(),
            cfg.rms_norm_eps,
            &mut hn,
        );
        let mut logits = vec![0f32; m * cfg.vocab_size];
        matmul(pool, &hn, m, w.matrix(&self.lm_head), &mut logits)?;
        Ok(logits)
    }
}

/// How much of a layer is leased at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LeaseScope {
    Layer,
    Tensor,
}

/// The leases of one step: the layer's (shared) or the step's own.
enum StepLease<'a> {
    Shared(&'a Leased),
    Own(Leased),
}

impl std::ops::Deref for StepLease<'_> {
    type Target = Leased;
    fn deref(&self) -> &Leased {
        match self {
            StepLease::Shared(l) => l,
            StepLease::Own(l) => l,
        }
    }
}

fn linear_pages(l: &Linear) -> Vec<PageId> {
    let mut p = vec![l.w.page];
    p.extend(l.bias.iter().map(|b| b.page));
    p
}

fn layer_pages(l: &Layer) -> Vec<PageId> {
    let mut p = vec![l.attn_norm.page, l.mlp_norm.page];
    for lin in [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down] {
        p.push(lin.w.page);
        if let Some(b) = &lin.bias {
            p.push(b.page);
        }
    }
    p.extend(l.q_norm.iter().chain(l.k_norm.iter()).map(|v| v.page));
    p
}

fn apply_linear(
    pool: &ThreadPool,
    w: &Leased,
    lin: &Linear,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) -> Result<(), VoomError> {
    matmul(pool, x, n, w.matrix(&lin.w), out)?;
    if let Some(b) = &lin.bias {
        ops::add_bias(out, &w.vector(b).to_vec());
    }
    Ok(())
}

/// Causal (optionally sliding-window) grouped-query attention of `n` new queries at
/// positions `pos0..pos0+n` over the cached keys/values `0..pos0+n`.
#[allow(clippy::too_many_arguments)]
fn attention(
    pool: &ThreadPool,
    cfg: &ModelConfig,
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    pos0: usize,
    n: usize,
    window: Option<usize>,
    out: &mut [f32],
) {
    let hd = cfg.head_dim;
    let heads = cfg.num_heads;
    let group = heads / cfg.num_kv_heads;
    let (qd, kvd) = (heads * hd, cfg.num_kv_heads * hd);
    let scale = (hd as f32).powf(-0.5);
    // One task per (token, head): each output row is computed by one fixed loop.
    let tasks = n * heads;
    let out_ptr = SendPtr(out.as_mut_ptr());
    let max_keys = window.map_or(pos0 + n, |w| w.min(pos0 + n));
    pool.for_each_chunk(tasks, |range| {
        let mut scores = vec![0f32; max_keys];
        for task in range {
            let (t, head) = (task / heads, task % heads);
            let pos = pos0 + t;
            let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let kvh = head / group;
            let qv = &q[t * qd + head * hd..t * qd + (head + 1) * hd];
            let s = &mut scores[..pos + 1 - lo];
            let base = lo * kvd + kvh * hd;
            matmul::attention_scores(qv, &kc[base..], kvd, scale, s);
            ops::softmax_inplace(s);
            // SAFETY: each task writes only its own disjoint `hd`-sized slice of `out`
            // (row t, head `head`), and `out` outlives `for_each_chunk`, which returns
            // only after every task has finished.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(out_ptr.get().add(t * qd + head * hd), hd)
            };
            matmul::weighted_sum(s, &vc[base..], kvd, dst);
        }
    });
}

/// A raw pointer that may cross threads; users guarantee disjoint writes.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: only used to hand disjoint output slices to pool tasks (see `attention`).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}
