//! A Gated DeltaNet layer (qwen3_next, qwen3_5): the linear attention of a hybrid
//! model, as transformers' `Qwen3NextGatedDeltaNet` computes it, in float32 over the
//! BF16 weights, one position after the other (the recurrent form of the delta
//! rule: its state, not a growing cache, carries the past; [`crate::kv::States`]).
//!
//! For each position, from the input normed by the layer's RMSNorm:
//!
//! 1. the projections: queries and keys (`num_key_heads × key_head_dim` each),
//!    values and output gates `z` (`num_value_heads × value_head_dim` each), and per
//!    value head `b` and `a` (`in_proj_qkvz`/`in_proj_ba` grouped by key head, or
//!    `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`);
//! 2. a causal depthwise convolution of kernel `K` over the queries, keys and values
//!    (the `K - 1` inputs before from the state, zeros before position 0), then SiLU;
//! 3. each query and key head L2-normalised (`x / sqrt(Σx² + 1e-6)`), the queries
//!    then scaled by `key_head_dim^-0.5`; `β = sigmoid(b)`, the decay
//!    `g = -exp(A_log) · softplus(a + dt_bias)`;
//! 4. per value head `h` (reading key head `h / (num_value_heads / num_key_heads)`),
//!    the state `S` (key dim × value dim): `S ← S·exp(g)`, then
//!    `S ← S + k ⊗ β(v - Sᵀk)`, and the output `Sᵀq`;
//! 5. each head's output RMS-normed, times the norm's weight and `silu(z)`, then
//!    `out_proj`, added to the residual.
//!
//! Sums run in increasing index; a position's result depends only on the positions
//! before it, so the bits do not depend on how a prompt is cut into chunks or passes.

use vpaged::PageId;

use crate::backend::Backend;
use crate::config::{LinearAttn, LinearProjections, ModelConfig};
use crate::kv::{KvCache, LayerState};
use crate::model::linear::Linear;
use crate::model::sweep::LayerLease;
use crate::model::weights::{Dim, Vector, WeightFinder};
use crate::VoomError;

/// How the input projections are stored ([`LinearProjections`]). One per layer, so
/// the variants' sizes are left unequal rather than boxed.
#[allow(clippy::large_enum_variant)]
enum Inputs {
    Grouped {
        qkvz: Linear,
        ba: Linear,
    },
    Split {
        qkv: Linear,
        z: Linear,
        b: Linear,
        a: Linear,
    },
}

pub struct DeltaNet {
    inputs: Inputs,
    /// `[conv_dim, 1, kernel]`.
    conv: Vector,
    a_log: Vector,
    dt_bias: Vector,
    /// The gated output norm's weight (`value_head_dim`; not zero-centred).
    norm: Vector,
    out: Linear,
    l: LinearAttn,
}

impl DeltaNet {
    /// The layer's weights under `p` (`model.layers.{i}.linear_attn`).
    pub fn load(
        f: &WeightFinder<'_>,
        cfg: &ModelConfig,
        l: &LinearAttn,
        p: &str,
    ) -> Result<DeltaNet, VoomError> {
        let hidden = Dim::of("hidden_size", cfg.hidden_size);
        let value = Dim::of(
            "linear_num_value_heads × linear_value_head_dim",
            l.value_dim(),
        );
        let heads = Dim::of("linear_num_value_heads", l.num_value_heads);
        let lin =
            |name: &str, rows: Dim| Linear::load(f, &format!("{p}.{name}"), &rows, &hidden, false);
        let inputs = match l.projections {
            LinearProjections::Grouped => Inputs::Grouped {
                qkvz: lin(
                    "in_proj_qkvz",
                    Dim::of(
                        "2 × (linear key dims + linear value dims)",
                        2 * (l.key_dim() + l.value_dim()),
                    ),
                )?,
                ba: lin(
                    "in_proj_ba",
                    Dim::of("2 × linear_num_value_heads", 2 * l.num_value_heads),
                )?,
            },
            LinearProjections::Split => Inputs::Split {
                qkv: lin(
                    "in_proj_qkv",
                    Dim::of("2 × linear key dims + linear value dims", l.conv_dim()),
                )?,
                z: lin("in_proj_z", value.clone())?,
                b: lin("in_proj_b", heads.clone())?,
                a: lin("in_proj_a", heads.clone())?,
            },
        };
        Ok(DeltaNet {
            inputs,
            conv: f.flat(
                &format!("{p}.conv1d.weight"),
                &[
                    Dim::of("convolution channels", l.conv_dim()),
                    Dim::of("1", 1),
                    Dim::of("linear_conv_kernel_dim", l.conv_kernel),
                ],
            )?,
            a_log: f.vector(&format!("{p}.A_log"), &heads)?,
            dt_bias: f.vector(&format!("{p}.dt_bias"), &heads)?,
            norm: f.vector(
                &format!("{p}.norm.weight"),
                &Dim::of("linear_value_head_dim", l.value_head_dim),
            )?,
            out: Linear::load(f, &format!("{p}.out_proj"), &hidden, &value, false)?,
            l: l.clone(),
        })
    }

    /// The pages of each step, one projection of any size a step (so that a step is
    /// never much more than the largest page, as the planner's least window counts):
    /// the layer's input norm and the query/key/value projection; (split: the
    /// gates' `z`;) the small projections `b`/`a` with the convolution and decay
    /// weights; the output norm and projection.
    pub fn steps(&self, attn_norm: PageId) -> Vec<Vec<PageId>> {
        let small = [self.conv.page, self.a_log.page, self.dt_bias.page];
        let last: Vec<PageId> = std::iter::once(self.norm.page)
            .chain(self.out.pages())
            .collect();
        match &self.inputs {
            Inputs::Grouped { qkvz, ba } => vec![
                std::iter::once(attn_norm).chain(qkvz.pages()).collect(),
                ba.pages().chain(small).collect(),
                last,
            ],
            Inputs::Split { qkv, z, b, a } => vec![
                std::iter::once(attn_norm).chain(qkv.pages()).collect(),
                z.pages().collect(),
                b.pages().chain(a.pages()).chain(small).collect(),
                last,
            ],
        }
    }

    /// How many steps [`DeltaNet::steps`] gives.
    pub fn step_count(&self) -> usize {
        match self.inputs {
            Inputs::Grouped { .. } => 3,
            Inputs::Split { .. } => 4,
        }
    }

    /// The layer on one sequence's chunk `x` (its positions in order, after those
    /// `kv`'s state of layer `li` holds), its residual added; the state advanced.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<B: Backend>(
        &self,
        b: &B,
        cfg: &ModelConfig,
        lw: &LayerLease<'_>,
        attn_norm: &Vector,
        x: &mut B::Act,
        kv: &mut KvCache,
        li: usize,
    ) -> Result<(), VoomError> {
        let l = &self.l;
        let (n, h) = b.shape(x);
        let (kd, vd, nv) = (l.key_dim(), l.value_dim(), l.num_value_heads);
        let cd = l.conv_dim();
        // Per position: the convolution's input (queries, keys, values), then z, b, a.
        let (mut mixed, mut z, mut beta, mut a) = (
            vec![0f32; n * cd],
            vec![0f32; n * vd],
            vec![0f32; n * nv],
            vec![0f32; n * nv],
        );
        let mut xn = b.zeros(n, h);
        let project = |w: &crate::model::weights::Leased,
                       xn: &B::Act,
                       lin: &Linear,
                       rows: usize|
         -> Result<Vec<f32>, VoomError> {
            let mut out = b.zeros(n, rows);
            lin.apply(b, w, xn, &mut out)?;
            Ok(b.download_owned(out)?)
        };
        let (conv, a_log, dt_bias);
        match &self.inputs {
            Inputs::Grouped { qkvz, ba } => {
                // Per key head: its query, key, values and gates; its b's and a's.
                let (dk, dv) = (l.key_head_dim, l.value_head_dim);
                let r = nv / l.num_key_heads;
                let g = 2 * dk + 2 * r * dv;
                let all = {
                    let w = lw.step(0)?;
                    b.rms_norm(x, w.vector(attn_norm), cfg.rms_norm_eps, &mut xn)?;
                    project(&w, &xn, qkvz, l.num_key_heads * g)?
                };
                let all_ba = {
                    let w = lw.step(1)?;
                    conv = w.vector(&self.conv).to_vec();
                    a_log = w.vector(&self.a_log).to_vec();
                    dt_bias = w.vector(&self.dt_bias).to_vec();
                    project(&w, &xn, ba, 2 * nv)?
                };
                for t in 0..n {
                    let row = &all[t * l.num_key_heads * g..(t + 1) * l.num_key_heads * g];
                    let m = &mut mixed[t * cd..(t + 1) * cd];
                    for kh in 0..l.num_key_heads {
                        let blk = &row[kh * g..(kh + 1) * g];
                        m[kh * dk..(kh + 1) * dk].copy_from_slice(&blk[..dk]);
                        m[kd + kh * dk..kd + (kh + 1) * dk].copy_from_slice(&blk[dk..2 * dk]);
                        let vs = kh * r * dv..(kh + 1) * r * dv;
                        m[2 * kd + vs.start..2 * kd + vs.end]
                            .copy_from_slice(&blk[2 * dk..2 * dk + r * dv]);
                        z[t * vd + vs.start..t * vd + vs.end]
                            .copy_from_slice(&blk[2 * dk + r * dv..]);
                        let bab = &all_ba[t * 2 * nv + kh * 2 * r..t * 2 * nv + (kh + 1) * 2 * r];
                        beta[t * nv + kh * r..t * nv + (kh + 1) * r].copy_from_slice(&bab[..r]);
                        a[t * nv + kh * r..t * nv + (kh + 1) * r].copy_from_slice(&bab[r..]);
                    }
                }
            }
            Inputs::Split {
                qkv,
                z: zp,
                b: bp,
                a: ap,
            } => {
                {
                    let w = lw.step(0)?;
                    b.rms_norm(x, w.vector(attn_norm), cfg.rms_norm_eps, &mut xn)?;
                    mixed = project(&w, &xn, qkv, cd)?;
                }
                let w = lw.step(1)?;
                z = project(&w, &xn, zp, vd)?;
                drop(w);
                let w = lw.step(2)?;
                beta = project(&w, &xn, bp, nv)?;
                a = project(&w, &xn, ap, nv)?;
                conv = w.vector(&self.conv).to_vec();
                a_log = w.vector(&self.a_log).to_vec();
                dt_bias = w.vector(&self.dt_bias).to_vec();
            }
        }
        let last = lw.step(self.step_count() - 1)?;
        let norm = last.vector(&self.norm).to_vec();

        let state = kv.state_mut(li).ok_or_else(|| {
            VoomError::Request(format!(
                "layer {li} is linear attention but the KV cache holds no recurrent state for it"
            ))
        })?;
        let mut out = vec![0f32; n * vd];
        // Per-position buffers, reused: the convolution's output, the normed
        // queries and keys, one head's `Sᵀk`.
        let mut conv_out = vec![0f32; cd];
        let mut bufs = Buffers {
            qk: vec![0f32; 2 * kd],
            kvmem: vec![0f32; l.value_head_dim],
        };
        for t in 0..n {
            convolve(l, &conv, state, &mixed[t * cd..(t + 1) * cd], &mut conv_out);
            let (qk, v) = conv_out.split_at(2 * kd);
            self.recur(
                state,
                qk,
                v,
                &beta[t * nv..(t + 1) * nv],
                &a[t * nv..(t + 1) * nv],
                (&a_log, &dt_bias),
                &mut bufs,
                &mut out[t * vd..(t + 1) * vd],
            );
            gated_norm(
                &mut out[t * vd..(t + 1) * vd],
                &z[t * vd..(t + 1) * vd],
                &norm,
                cfg.rms_norm_eps,
            );
        }
        let o_in = b.upload(n, vd, &out)?;
        let mut o = b.zeros(n, h);
        self.out.apply(b, &last, &o_in, &mut o)?;
        b.add(x, &o)?;
        Ok(())
    }

    /// Step 4 of the module's list for one position (`qk`: its queries then keys
    /// as convolved): every value head's state decayed and updated, its output into
    /// `out` (`value_dim`).
    #[allow(clippy::too_many_arguments)]
    fn recur(
        &self,
        state: &mut LayerState,
        qk: &[f32],
        v: &[f32],
        b: &[f32],
        a: &[f32],
        (a_log, dt_bias): (&[f32], &[f32]),
        bufs: &mut Buffers,
        out: &mut [f32],
    ) {
        let l = &self.l;
        let (dk, dv) = (l.key_head_dim, l.value_head_dim);
        let r = l.num_value_heads / l.num_key_heads;
        let scale = (dk as f32).powf(-0.5);
        let (q, k) = qk.split_at(l.key_dim());
        let (qn, kn) = bufs.qk.split_at_mut(l.key_dim());
        let kvmem = &mut bufs.kvmem;
        for kh in 0..l.num_key_heads {
            let s = kh * dk..(kh + 1) * dk;
            l2norm(&q[s.clone()], &mut qn[s.clone()]);
            l2norm(&k[s.clone()], &mut kn[s.clone()]);
            qn[s].iter_mut().for_each(|x| *x *= scale);
        }
        for vh in 0..l.num_value_heads {
            let kh = vh / r;
            let (qh, kh) = (&qn[kh * dk..(kh + 1) * dk], &kn[kh * dk..(kh + 1) * dk]);
            let vv = &v[vh * dv..(vh + 1) * dv];
            let beta = 1.0 / (1.0 + (-b[vh]).exp());
            let g = -a_log[vh].exp() * softplus(a[vh] + dt_bias[vh]);
            let decay = g.exp();
            let s = &mut state.matrix[vh * dk * dv..(vh + 1) * dk * dv];
            s.iter_mut().for_each(|x| *x *= decay);
            // kv_mem[j] = Σ_i S[i][j] k[i]
            kvmem.fill(0.0);
            for (i, &ki) in kh.iter().enumerate() {
                for (m, &sij) in kvmem.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
                    *m += sij * ki;
                }
            }
            // delta[j] = (v[j] - kv_mem[j]) β; S[i][j] += k[i] delta[j]
            for (m, &vj) in kvmem.iter_mut().zip(vv) {
                *m = (vj - *m) * beta;
            }
            for (i, &ki) in kh.iter().enumerate() {
                for (sij, &dj) in s[i * dv..(i + 1) * dv].iter_mut().zip(kvmem.iter()) {
                    *sij += ki * dj;
                }
            }
            // out[j] = Σ_i S[i][j] q[i]
            let o = &mut out[vh * dv..(vh + 1) * dv];
            o.fill(0.0);
            for (i, &qi) in qh.iter().enumerate() {
                for (oj, &sij) in o.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
                    *oj += sij * qi;
                }
            }
        }
    }
}

/// A position's working buffers in [`DeltaNet::recur`]: the normed queries then
/// keys, and one head's `Sᵀk`.
struct Buffers {
    qk: Vec<f32>,
    kvmem: Vec<f32>,
}

/// The causal convolution of one position's input `x` (`conv_dim` channels) with
/// the `K - 1` inputs before it in `state` (oldest first), then SiLU, into `out`;
/// `state` moves on by one.
fn convolve(l: &LinearAttn, w: &[f32], state: &mut LayerState, x: &[f32], out: &mut [f32]) {
    let (c, k) = (l.conv_dim(), l.conv_kernel);
    for (ch, o) in out.iter_mut().enumerate() {
        let wc = &w[ch * k..(ch + 1) * k];
        let mut acc = 0f32;
        for (j, &wj) in wc[..k - 1].iter().enumerate() {
            acc += wj * state.conv[j * c + ch];
        }
        acc += wc[k - 1] * x[ch];
        *o = acc / (1.0 + (-acc).exp());
    }
    if k > 1 {
        state.conv.copy_within(c.., 0);
        let last = (k - 2) * c;
        state.conv[last..last + c].copy_from_slice(x);
    }
}

/// `x / sqrt(Σx² + 1e-6)` (transformers' `l2norm`, FLA's epsilon).
fn l2norm(x: &[f32], out: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss + 1e-6).sqrt();
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v * inv;
    }
}

/// torch's `softplus` (beta 1, threshold 20): `x` above 20, else `log(1 + e^x)`.
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// One position's output heads RMS-normed (`value_head_dim` each), times the
/// norm's weight, times `silu(z)` (transformers' `Qwen3NextRMSNormGated`).
fn gated_norm(out: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let dv = w.len();
    for (o, zh) in out.chunks_exact_mut(dv).zip(z.chunks_exact(dv)) {
        let ss: f32 = o.iter().map(|v| v * v).sum();
        let inv = 1.0 / (ss / dv as f32 + eps).sqrt();
        for ((v, &wj), &zj) in o.iter_mut().zip(w).zip(zh) {
            let silu = zj / (1.0 + (-zj).exp());
            *v = (wj * (*v * inv)) * silu;
        }
    }
}
