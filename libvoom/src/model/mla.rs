//! Multi-head latent attention (DeepSeek-V2/V3), with the compressed cache MLA
//! exists for: per position and layer, the normed latent (`kv_lora_rank` floats) and
//! the rotated shared key (`qk_rope_head_dim`), never expanded heads.
//!
//! transformers expands each cached latent into every head's key and value
//! (`kv_b_proj`) and attends over those. Here the key expansion is folded into the
//! query instead (`q_nope · W_UK` per head, a `kv_lora_rank` vector), the scores are
//! dot products with whole cache vectors, the softmax-weighted sum is taken over the
//! latents and expanded once by `W_UV`: the same products regrouped, so the bits
//! differ from transformers' only by float32 summation order, and each output element
//! is one fixed loop, so its bits do not depend on chunking or batch.

use vpaged::PageId;

use crate::backend::{Backend, LatentShape, RopeShape, RopeTable};
use crate::config::{Mla, ModelConfig};
use crate::kv::KvCache;
use crate::model::linear::Linear;
use crate::model::sweep::LayerLease;
use crate::model::weights::{Dim, Matrix, Vector, WeightFinder};
use crate::VoomError;

/// `eps` of the q and kv latent norms: transformers builds them without the
/// config's `rms_norm_eps`.
const LATENT_NORM_EPS: f32 = 1e-6;

/// How queries are projected.
enum Query {
    /// `q_proj` (`q_lora_rank` null).
    Plain(Linear),
    /// `q_b_proj(norm(q_a_proj(x)))`.
    LowRank { a: Linear, norm: Vector, b: Matrix },
}

/// One layer's MLA weights.
pub(super) struct MlaAttention {
    q: Query,
    /// `[kv_lora_rank + qk_rope_head_dim, hidden]`: the latent, then the rotary key.
    kv_a: Linear,
    kv_norm: Vector,
    /// `[heads × (qk_nope_head_dim + v_head_dim), kv_lora_rank]`: per head, the
    /// key's non-rotary rows then the value's.
    kv_b: Matrix,
    o: Linear,
}

/// The steps of an MLA layer's attention.
pub(super) const STEPS: usize = 3;
const STEP_Q: usize = 0;
const STEP_KV: usize = 1;
const STEP_O: usize = 2;

impl MlaAttention {
    /// The attention weights under `a` (`model.layers.N.self_attn`).
    pub fn load(
        f: &WeightFinder<'_>,
        cfg: &ModelConfig,
        m: &Mla,
        a: &str,
    ) -> Result<Self, VoomError> {
        let hidden = Dim::of("hidden_size", cfg.hidden_size);
        let heads = cfg.num_heads;
        let q_rows = Dim::product(
            "num_attention_heads",
            heads,
            "qk_nope_head_dim + qk_rope_head_dim",
            cfg.head_dim,
        )
        .expect("validated widths");
        let bias = cfg.qkv_bias;
        let linear = |name: &str, rows: &Dim, cols: &Dim, bias: bool| {
            Linear::load(f, &format!("{a}.{name}"), rows, cols, bias)
        };
        let q = match m.q_lora_rank {
            None => Query::Plain(linear("q_proj", &q_rows, &hidden, false)?),
            Some(r) => {
                let rank = Dim::of("q_lora_rank", r);
                Query::LowRank {
                    a: linear("q_a_proj", &rank, &hidden, bias)?,
                    norm: f.vector(&format!("{a}.q_a_layernorm.weight"), &rank)?,
                    b: f.matrix(&format!("{a}.q_b_proj.weight"), &q_rows, &rank)?,
                }
            }
        };
        let rank = Dim::of("kv_lora_rank", m.kv_lora_rank);
        let kv_a_rows = Dim {
            len: m.kv_lora_rank + m.qk_rope_head_dim,
            key: "kv_lora_rank + qk_rope_head_dim".into(),
        };
        let kv_b_rows = Dim::product(
            "num_attention_heads",
            heads,
            "qk_nope_head_dim + v_head_dim",
            m.qk_nope_head_dim + m.v_head_dim,
        )
        .expect("validated widths");
        let o_cols = Dim::product("num_attention_heads", heads, "v_head_dim", m.v_head_dim)
            .expect("validated widths");
        Ok(MlaAttention {
            q,
            kv_a: linear("kv_a_proj_with_mqa", &kv_a_rows, &hidden, bias)?,
            kv_norm: f.vector(&format!("{a}.kv_a_layernorm.weight"), &rank)?,
            kv_b: f.matrix(&format!("{a}.kv_b_proj.weight"), &kv_b_rows, &rank)?,
            o: linear("o_proj", &hidden, &o_cols, cfg.o_bias)?,
        })
    }

    /// The pages of each step, the input norm `attn_norm` with the first.
    pub fn steps(&self, attn_norm: PageId) -> Vec<Vec<PageId>> {
        let mut q = vec![attn_norm];
        match &self.q {
            Query::Plain(l) => q.extend(l.pages()),
            Query::LowRank { a, norm, b } => {
                q.extend(a.pages());
                q.push(norm.page);
                q.extend(b.pages());
            }
        }
        let mut kv: Vec<PageId> = self.kv_a.pages().collect();
        kv.push(self.kv_norm.page);
        kv.extend(self.kv_b.pages());
        vec![q, kv, self.o.pages().collect()]
    }

    /// The attention half of layer `li` on one chunk `x` (in place, its residual
    /// added), after the chunks before it: their cache vectors are in `kv`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<B: Backend>(
        &self,
        b: &B,
        cfg: &ModelConfig,
        m: &Mla,
        lw: &LayerLease<'_>,
        li: usize,
        attn_norm: &Vector,
        x: &mut B::Act,
        table: &RopeTable,
        kv: &mut KvCache,
    ) -> Result<(), VoomError> {
        let n = b.shape(x).0;
        let (heads, hd) = (cfg.num_heads, cfg.head_dim);
        let (nope, rope, rank, vd) = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.kv_lora_rank,
            m.v_head_dim,
        );
        let mut xn = b.zeros(n, cfg.hidden_size);
        let mut q = b.zeros(n, heads * hd);
        {
            let w = lw.step(STEP_Q)?;
            b.rms_norm(x, w.vector(attn_norm), cfg.rms_norm_eps, &mut xn)?;
            match &self.q {
                Query::Plain(l) => l.apply(b, &w, &xn, &mut q)?,
                Query::LowRank { a, norm, b: qb } => {
                    let mut qa = b.zeros(n, a.w.rows);
                    a.apply(b, &w, &xn, &mut qa)?;
                    let mut qn = b.zeros(n, a.w.rows);
                    b.rms_norm(&qa, w.vector(norm), LATENT_NORM_EPS, &mut qn)?;
                    b.matmul(&qn, w.matrix(qb), &mut q)?;
                }
            }
        }
        let rotary = |head_dim: usize, offset: usize| RopeShape {
            head_dim,
            offset,
            interleaved: m.rope_interleave,
        };
        b.rope(&mut q, &rotary(hd, nope), table)?;
        let q = b.download_owned(q)?;
        let mut att = vec![0f32; n * heads * vd];
        {
            let w = lw.step(STEP_KV)?;
            let mut ckv = b.zeros(n, rank + rope);
            self.kv_a.apply(b, &w, &xn, &mut ckv)?;
            let ckv = b.download_owned(ckv)?;
            let (mut latent, mut k_rot) =
                (Vec::with_capacity(n * rank), Vec::with_capacity(n * rope));
            for row in ckv.chunks_exact(rank + rope) {
                latent.extend_from_slice(&row[..rank]);
                k_rot.extend_from_slice(&row[rank..]);
            }
            let mut normed = b.zeros(n, rank);
            b.rms_norm(
                &b.upload(n, rank, &latent)?,
                w.vector(&self.kv_norm),
                LATENT_NORM_EPS,
                &mut normed,
            )?;
            let mut k_rot = b.upload(n, rope, &k_rot)?;
            b.rope(&mut k_rot, &rotary(rope, 0), table)?;
            let (normed, k_rot) = (b.download_owned(normed)?, b.download_owned(k_rot)?);
            let mut kv_new = Vec::with_capacity(n * (rank + rope));
            for t in 0..n {
                kv_new.extend_from_slice(&normed[t * rank..(t + 1) * rank]);
                kv_new.extend_from_slice(&k_rot[t * rope..(t + 1) * rope]);
            }

            // Per head: the query's non-rotary part through W_UK into the latent space,
            // beside its rotary part.
            let kv_b = w.matrix(&self.kv_b);
            let per_head = nope + vd;
            let mut q_cat = vec![0f32; n * heads * (rank + rope)];
            for h in 0..heads {
                let cat = |t: usize| t * heads * (rank + rope) + h * (rank + rope);
                let mut q_lat = b.zeros(n, rank);
                if nope > 0 {
                    let mut q_nope = Vec::with_capacity(n * nope);
                    for t in 0..n {
                        let at = t * heads * hd + h * hd;
                        q_nope.extend_from_slice(&q[at..at + nope]);
                    }
                    let w_uk = kv_b.slice_rows(h * per_head..h * per_head + nope);
                    b.matmul_t(&b.upload(n, nope, &q_nope)?, w_uk, &mut q_lat)?;
                }
                let q_lat = b.download_owned(q_lat)?;
                for t in 0..n {
                    let at = cat(t);
                    q_cat[at..at + rank].copy_from_slice(&q_lat[t * rank..(t + 1) * rank]);
                    let from = t * heads * hd + h * hd + nope;
                    q_cat[at + rank..at + rank + rope].copy_from_slice(&q[from..from + rope]);
                }
            }
            let shape = LatentShape {
                heads,
                rank,
                rope,
                scale: m.softmax_scale,
            };
            let mut out_lat = b.zeros(n, heads * rank);
            b.latent_attention(
                &b.upload(n, heads * (rank + rope), &q_cat)?,
                &b.upload(n, rank + rope, &kv_new)?,
                kv,
                li,
                &shape,
                &mut out_lat,
            )?;
            // Per head: the weighted latents through W_UV.
            let out_lat = b.download_owned(out_lat)?;
            for h in 0..heads {
                let mut lat = Vec::with_capacity(n * rank);
                for t in 0..n {
                    let at = t * heads * rank + h * rank;
                    lat.extend_from_slice(&out_lat[at..at + rank]);
                }
                let w_uv = kv_b.slice_rows(h * per_head + nope..(h + 1) * per_head);
                let mut o = b.zeros(n, vd);
                b.matmul(&b.upload(n, rank, &lat)?, w_uv, &mut o)?;
                let o = b.download_owned(o)?;
                for t in 0..n {
                    let at = t * heads * vd + h * vd;
                    att[at..at + vd].copy_from_slice(&o[t * vd..(t + 1) * vd]);
                }
            }
        }
        {
            let w = lw.step(STEP_O)?;
            let mut o = b.zeros(n, cfg.hidden_size);
            self.o
                .apply(b, &w, &b.upload(n, heads * vd, &att)?, &mut o)?;
            b.add(x, &o)?;
        }
        Ok(())
    }
}

/// Floats of KV cache per position and layer: the latent and the rotary key.
pub(super) fn cache_width(m: &Mla) -> usize {
    m.kv_lora_rank + m.qk_rope_head_dim
}
