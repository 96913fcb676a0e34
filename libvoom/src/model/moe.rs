//! Routed experts in place of a decoder layer's MLP, as transformers computes them:
//! the router scores every expert ([`Scoring`]), picks `top_k`, and each position's
//! output is its experts' gated MLP outputs ([`ExpertGate`]) times their weights,
//! added in ascending expert order (transformers' experts loop), plus the shared
//! experts' output where the family has them.
//!
//! Paging: the router (and its correction bias) is one step of the layer's plan, the
//! shared experts another; each routed expert is its own set of pages, leased only
//! when picked ([`LayerLease::experts`]).

use vpaged::PageId;

use crate::backend::{Activation, Backend};
use crate::config::{ExpertGate, ModelConfig, Moe, Scoring};
use crate::model::sweep::{LayerLease, Sweep};
use crate::model::weights::{Dim, Leased, Matrix, Vector, WeightFinder};
use crate::VoomError;

/// A projection of an expert: `x · wᵀ` of a matrix stored output-major (as
/// `nn.Linear` stores its weight), or `x · w` of one stored input-major (gpt-oss's
/// experts as transformers saves them unquantized).
#[derive(Debug, Clone, Copy)]
enum Proj {
    Out(Matrix),
    In(Matrix),
}

impl Proj {
    fn outputs(&self) -> usize {
        match self {
            Proj::Out(m) => m.rows,
            Proj::In(m) => m.cols,
        }
    }

    fn matrix(&self) -> &Matrix {
        match self {
            Proj::Out(m) | Proj::In(m) => m,
        }
    }

    fn apply<B: Backend>(
        &self,
        b: &B,
        w: &Leased,
        x: &B::Act,
        out: &mut B::Act,
    ) -> Result<(), VoomError> {
        match self {
            Proj::Out(m) => b.matmul(x, w.matrix(m), out)?,
            Proj::In(m) => b.matmul_t(x, w.matrix(m), out)?,
        }
        Ok(())
    }
}

/// An expert's gate and up projections.
enum GateUp {
    /// Two products (or two row ranges of one fused tensor).
    Apart { gate: Matrix, up: Matrix },
    /// gpt-oss: one product of `2 × intermediate` outputs, plus its bias, whose even
    /// outputs are the gate's and odd ones the up projection's.
    Interleaved { both: Proj, bias: Vector },
}

/// One gated expert (routed or shared).
pub(super) struct Expert {
    gate_up: GateUp,
    down: Proj,
    down_bias: Option<Vector>,
}

impl Expert {
    /// A SwiGLU expert of three matrices stored output-major.
    fn swiglu(gate: Matrix, up: Matrix, down: Matrix) -> Self {
        Expert {
            gate_up: GateUp::Apart { gate, up },
            down: Proj::Out(down),
            down_bias: None,
        }
    }

    /// Its pages (one each, or the fused tensors all experts share), each once.
    fn pages(&self) -> Vec<PageId> {
        let mut v: Vec<PageId> = match &self.gate_up {
            GateUp::Apart { gate, up } => gate.pages().chain(up.pages()).collect(),
            GateUp::Interleaved { both, bias } => {
                both.matrix().pages().chain([bias.page]).collect()
            }
        };
        v.extend(self.down.matrix().pages());
        v.extend(self.down_bias.map(|b| b.page));
        // Gate and up as parts of one fused tensor share their pages.
        let mut seen = std::collections::HashSet::new();
        v.retain(|p| seen.insert(*p));
        v
    }

    /// `down(act(gate(x)) * up(x))` of the `rows` rows of `input`, with the biases
    /// where the expert has them.
    fn compute<B: Backend>(
        &self,
        b: &B,
        w: &Leased,
        act: Activation,
        input: &B::Act,
        rows: usize,
    ) -> Result<Vec<f32>, VoomError> {
        let g = match &self.gate_up {
            GateUp::Apart { gate, up } => {
                let mut g = b.zeros(rows, gate.rows);
                let mut u = b.zeros(rows, up.rows);
                b.matmul(input, w.matrix(gate), &mut g)?;
                b.matmul(input, w.matrix(up), &mut u)?;
                b.gated(act, &mut g, &u)?;
                g
            }
            GateUp::Interleaved { both, bias } => {
                let n = both.outputs();
                let mut gu = b.zeros(rows, n);
                both.apply(b, w, input, &mut gu)?;
                b.add_bias(&mut gu, w.vector(bias))?;
                let gu = b.download_owned(gu)?;
                let (gate, up): (Vec<f32>, Vec<f32>) =
                    gu.chunks_exact(2).map(|pair| (pair[0], pair[1])).unzip();
                let mut g = b.upload(rows, n / 2, &gate)?;
                b.gated(act, &mut g, &b.upload(rows, n / 2, &up)?)?;
                g
            }
        };
        let mut y = b.zeros(rows, self.down.outputs());
        self.down.apply(b, w, &g, &mut y)?;
        if let Some(bias) = &self.down_bias {
            b.add_bias(&mut y, w.vector(bias))?;
        }
        Ok(b.download_owned(y)?)
    }
}

/// The dimensions a config gives the experts, each naming its config.json keys.
pub(super) struct ExpertDims {
    pub hidden: Dim,
    pub experts: Dim,
    pub inter: Dim,
    pub shared_inter: Dim,
}

impl ExpertDims {
    pub fn of(cfg: &ModelConfig) -> Self {
        let m = cfg.moe.as_ref();
        use crate::config::Arch;
        let inter_key = match cfg.arch {
            Arch::Olmoe | Arch::Mixtral | Arch::GptOss => "intermediate_size",
            _ => "moe_intermediate_size",
        };
        let experts_key = match cfg.arch {
            Arch::Glm4Moe | Arch::DeepseekV3 => "n_routed_experts",
            Arch::GptOss => "num_local_experts",
            _ => "num_experts",
        };
        ExpertDims {
            hidden: Dim::of("hidden_size", cfg.hidden_size),
            experts: Dim::of(experts_key, m.map_or(0, |m| m.num_experts)),
            inter: Dim::of(inter_key, m.map_or(0, |m| m.expert_intermediate_size)),
            shared_inter: Dim::of(
                "moe_intermediate_size × n_shared_experts",
                m.map_or(0, |m| m.shared_intermediate_size),
            ),
        }
    }
}

/// A layer's mixture of experts.
pub(super) struct Experts {
    /// `[experts, hidden]`.
    router: Matrix,
    /// Added to the router's logits (gpt-oss's `router.bias`).
    router_bias: Option<Vector>,
    /// The router's `e_score_correction_bias` (sigmoid scoring), any float dtype
    /// (F32 in released DeepSeek-V3 and GLM-4.5 files, beside BF16 weights).
    bias: Option<Vector>,
    routed: Vec<Expert>,
    shared: Option<Expert>,
    /// `[1, hidden]`: the shared expert's output is multiplied by the sigmoid of
    /// the normed input's product with it (qwen3_next's `shared_expert_gate`).
    shared_gate: Option<Matrix>,
    /// The routed experts' activation.
    act: Activation,
}

/// One chunk's routing in a layer of experts: its normed rows (the experts' input)
/// and, per row, the experts picked with their weights.
pub(super) struct Routed {
    xn: Vec<f32>,
    picks: Vec<Vec<(u32, f32)>>,
}

impl Experts {
    /// The experts of the layer whose tensors start `p` (`model.layers.N`): the router
    /// (`mlp.gate`, mixtral's `block_sparse_moe.gate`), its correction bias where
    /// the scoring has one, each expert's gate, up and down projections stored one
    /// tensor per expert and projection (`mlp.experts.E.gate_proj`, mixtral's
    /// `experts.E.w1`/`w3`/`w2`) or fused (`mlp.experts.gate_up_proj` `[experts,
    /// 2 × intermediate, hidden]`, gate rows first, and `mlp.experts.down_proj`
    /// `[experts, hidden, intermediate]`, as transformers 5 can save them) or
    /// stacked apart (`mlp.experts.gate_proj`, `up_proj`, `down_proj`), and the
    /// shared experts (`mlp.shared_experts.*`). gpt-oss's are [`Experts::load_gpt_oss`].
    pub fn load(
        f: &WeightFinder<'_>,
        moe: &Moe,
        d: &ExpertDims,
        p: &str,
    ) -> Result<Self, VoomError> {
        if let ExpertGate::Clamped { alpha, limit } = moe.gate {
            return Self::load_gpt_oss(f, d, &format!("{p}.mlp"), alpha, limit);
        }
        let block = format!("{p}.block_sparse_moe");
        let m = if f.has(&format!("{block}.gate.weight")) {
            block
        } else {
            format!("{p}.mlp")
        };
        let router = f.matrix(&format!("{m}.gate.weight"), &d.experts, &d.hidden)?;
        let bias = match moe.scoring {
            Scoring::Softmax | Scoring::TopKSoftmax => None,
            Scoring::SigmoidGroups { .. } => {
                Some(f.vector(&format!("{m}.gate.e_score_correction_bias"), &d.experts)?)
            }
        };
        let fused = format!("{m}.experts.gate_up_proj");
        let inter = d.inter.len;
        let routed = if f.has(&fused) {
            let both = Dim {
                len: 2 * inter,
                key: format!("2 × {}", d.inter.key),
            };
            let gate_up = f.stacked(&fused, &d.experts, &both, &d.hidden)?;
            let down = f.stacked(
                &format!("{m}.experts.down_proj"),
                &d.experts,
                &d.hidden,
                &d.inter,
            )?;
            gate_up
                .into_iter()
                .zip(down)
                .map(|(gu, down)| {
                    Expert::swiglu(gu.sub_rows(0, inter), gu.sub_rows(inter, inter), down)
                })
                .collect()
        } else if f.has(&format!("{m}.experts.gate_proj")) {
            // Stacked apart, `[experts, rows, cols]` each (a GGUF's `ffn_*_exps`, as
            // `voom import` keeps them).
            let e = |proj: &str| format!("{m}.experts.{proj}");
            let gate = f.stacked(&e("gate_proj"), &d.experts, &d.inter, &d.hidden)?;
            let up = f.stacked(&e("up_proj"), &d.experts, &d.inter, &d.hidden)?;
            let down = f.stacked(&e("down_proj"), &d.experts, &d.hidden, &d.inter)?;
            gate.into_iter()
                .zip(up)
                .zip(down)
                .map(|((g, u), dn)| Expert::swiglu(g, u, dn))
                .collect()
        } else {
            let (g, u, dn) = if m.ends_with("block_sparse_moe") {
                ("w1", "w3", "w2")
            } else {
                ("gate_proj", "up_proj", "down_proj")
            };
            let w = |e: usize, proj: &str| format!("{m}.experts.{e}.{proj}.weight");
            (0..moe.num_experts)
                .map(|e| {
                    Ok(Expert::swiglu(
                        f.matrix(&w(e, g), &d.inter, &d.hidden)?,
                        f.matrix(&w(e, u), &d.inter, &d.hidden)?,
                        f.matrix(&w(e, dn), &d.hidden, &d.inter)?,
                    ))
                })
                .collect::<Result<Vec<_>, VoomError>>()?
        };
        // One gated shared expert (`shared_expert`), or shared experts summed as one.
        let (one, shared_gate) = match moe.shared_gate {
            true => (
                "shared_expert",
                Some(f.matrix(
                    &format!("{m}.shared_expert_gate.weight"),
                    &Dim::of("1", 1),
                    &d.hidden,
                )?),
            ),
            false => ("shared_experts", None),
        };
        let shared = if moe.shared_intermediate_size > 0 {
            let s = |proj: &str| format!("{m}.{one}.{proj}.weight");
            Some(Expert::swiglu(
                f.matrix(&s("gate_proj"), &d.shared_inter, &d.hidden)?,
                f.matrix(&s("up_proj"), &d.shared_inter, &d.hidden)?,
                f.matrix(&s("down_proj"), &d.hidden, &d.shared_inter)?,
            ))
        } else {
            None
        };
        Ok(Experts {
            router,
            router_bias: None,
            bias,
            routed,
            shared,
            shared_gate,
            act: Activation::Silu,
        })
    }

    /// gpt-oss's experts under `m` (`model.layers.N.mlp`): the router
    /// (`router.weight`, `router.bias`), and every expert's fused projections with
    /// their biases, `experts.gate_up_proj` (gate and up outputs interleaved) and
    /// `experts.down_proj`: MXFP4 as released (`{name}_blocks` and `_scales`,
    /// output-major: `[experts, 2 × intermediate, hidden / 32, 16]`), or unquantized
    /// as transformers saves them (input-major: `[experts, hidden, 2 ×
    /// intermediate]` and `[experts, intermediate, hidden]`).
    fn load_gpt_oss(
        f: &WeightFinder<'_>,
        d: &ExpertDims,
        m: &str,
        alpha: f32,
        limit: f32,
    ) -> Result<Self, VoomError> {
        let both = Dim {
            len: 2 * d.inter.len,
            key: format!("2 × {}", d.inter.key),
        };
        let e = |name: &str| format!("{m}.experts.{name}");
        let (gate_up, down): (Vec<Proj>, Vec<Proj>) = if f.has(&e("gate_up_proj_blocks")) {
            let gu = f.mxfp4_stacked(&e("gate_up_proj"), &d.experts, &both, &d.hidden)?;
            let dn = f.stacked_any(&e("down_proj"), &d.experts, &d.hidden, &d.inter)?;
            (
                gu.into_iter().map(Proj::Out).collect(),
                dn.into_iter().map(Proj::Out).collect(),
            )
        } else {
            let gu = f.stacked(&e("gate_up_proj"), &d.experts, &d.hidden, &both)?;
            let dn = f.stacked(&e("down_proj"), &d.experts, &d.inter, &d.hidden)?;
            (
                gu.into_iter().map(Proj::In).collect(),
                dn.into_iter().map(Proj::In).collect(),
            )
        };
        let gu_bias = f.stacked_vectors(&e("gate_up_proj_bias"), &d.experts, &both)?;
        let down_bias = f.stacked_vectors(&e("down_proj_bias"), &d.experts, &d.hidden)?;
        let routed = gate_up
            .into_iter()
            .zip(gu_bias)
            .zip(down.into_iter().zip(down_bias))
            .map(|((both, bias), (down, down_bias))| Expert {
                gate_up: GateUp::Interleaved { both, bias },
                down,
                down_bias: Some(down_bias),
            })
            .collect();
        Ok(Experts {
            router: f.matrix(&format!("{m}.router.weight"), &d.experts, &d.hidden)?,
            router_bias: Some(f.vector(&format!("{m}.router.bias"), &d.experts)?),
            bias: None,
            routed,
            shared: None,
            shared_gate: None,
            act: Activation::ClampedSwiglu { alpha, limit },
        })
    }

    /// The router step's pages after the MLP norm: the router and its bias.
    pub fn router_pages(&self) -> Vec<PageId> {
        self.router
            .pages()
            .chain(self.router_bias.map(|b| b.page))
            .chain(self.bias.map(|b| b.page))
            .collect()
    }

    /// The shared experts' pages (a step of their own), if any.
    pub fn shared_pages(&self) -> Option<Vec<PageId>> {
        self.shared.as_ref().map(|s| {
            let mut v = s.pages();
            v.extend(self.shared_gate.iter().flat_map(|g| g.pages()));
            v
        })
    }

    /// Each routed expert's pages.
    pub fn expert_pages(&self) -> Vec<Vec<PageId>> {
        self.routed.iter().map(Expert::pages).collect()
    }

    /// Routes the normed rows `xn` (`rows × hidden`) with the router and bias of the
    /// leases `w`: per row, the experts picked and their weights.
    pub fn route<B: Backend>(
        &self,
        b: &B,
        moe: &Moe,
        w: &Leased,
        xn: &B::Act,
    ) -> Result<Vec<Vec<(u32, f32)>>, VoomError> {
        let rows = b.shape(xn).0;
        let n = moe.num_experts;
        let mut logits = b.zeros(rows, n);
        b.matmul(xn, w.matrix(&self.router), &mut logits)?;
        if let Some(bias) = &self.router_bias {
            b.add_bias(&mut logits, w.vector(bias))?;
        }
        let mut picks = match moe.scoring {
            Scoring::Softmax => {
                b.softmax(&mut logits)?;
                b.top_k(&logits, moe.top_k)?
            }
            Scoring::TopKSoftmax => {
                let top = b.top_k(&logits, moe.top_k)?;
                let values: Vec<f32> = top.iter().flatten().map(|p| p.1).collect();
                let mut weights = b.upload(rows, moe.top_k, &values)?;
                b.softmax(&mut weights)?;
                let weights = b.download_owned(weights)?;
                top.into_iter()
                    .zip(weights.chunks_exact(moe.top_k))
                    .map(|(row, ws)| row.into_iter().zip(ws).map(|((e, _), &w)| (e, w)).collect())
                    .collect()
            }
            Scoring::SigmoidGroups {
                n_group,
                topk_group,
            } => {
                let bias = self
                    .bias
                    .map(|v| w.vector(&v).to_vec())
                    .expect("sigmoid scoring loads a correction bias");
                b.sigmoid(&mut logits)?;
                let scores = b.download_owned(logits)?;
                // What the choice ranks: score plus bias.
                let choice: Vec<f32> = scores
                    .chunks_exact(n)
                    .flat_map(|row| row.iter().zip(&bias).map(|(s, c)| s + c))
                    .collect();
                // Each group's two best, summed; the `topk_group` best groups.
                let size = n / n_group;
                let best_two = b.top_k(&b.upload(rows * n_group, size, &choice)?, 2)?;
                let group_scores: Vec<f32> = best_two.iter().map(|t| t[0].1 + t[1].1).collect();
                let groups = b.top_k(&b.upload(rows, n_group, &group_scores)?, topk_group)?;
                // Experts of the other groups cannot be chosen.
                let mut masked = vec![f32::NEG_INFINITY; rows * n];
                for (r, kept) in groups.iter().enumerate() {
                    for &(g, _) in kept {
                        let at = r * n + g as usize * size;
                        masked[at..at + size].copy_from_slice(&choice[at..at + size]);
                    }
                }
                let chosen = b.top_k(&b.upload(rows, n, &masked)?, moe.top_k)?;
                // Weighted by the scores without the bias.
                chosen
                    .into_iter()
                    .enumerate()
                    .map(|(r, row)| {
                        row.into_iter()
                            .map(|(e, _)| (e, scores[r * n + e as usize]))
                            .collect()
                    })
                    .collect()
            }
        };
        let eps = match moe.scoring {
            Scoring::Softmax | Scoring::TopKSoftmax => 0.0,
            Scoring::SigmoidGroups { .. } => 1e-20,
        };
        for row in &mut picks {
            if moe.norm_topk_prob {
                let sum: f32 = row.iter().map(|p| p.1).sum::<f32>() + eps;
                for p in row.iter_mut() {
                    p.1 /= sum;
                }
            }
            if moe.routed_scaling_factor != 1.0 {
                for p in row.iter_mut() {
                    p.1 *= moe.routed_scaling_factor;
                }
            }
        }
        Ok(picks)
    }

    /// Normalises one chunk `x` with the MLP norm of the leases `w` into `xn` and
    /// routes it ([`Experts::route`]).
    #[allow(clippy::too_many_arguments)]
    pub fn route_chunk<B: Backend>(
        &self,
        b: &B,
        moe: &Moe,
        w: &Leased,
        norm: &Vector,
        eps: f32,
        x: &B::Act,
        xn: &mut B::Act,
    ) -> Result<Routed, VoomError> {
        b.rms_norm(x, w.vector(norm), eps, xn)?;
        let picks = self.route(b, moe, w, xn)?;
        Ok(Routed {
            xn: b.download(xn)?,
            picks,
        })
    }

    /// The experts of a layer over every chunk (`routed`, one per chunk of `xs`):
    /// each routed expert picked is leased once, in ascending order, and computes the
    /// rows routed to it; each row's output is the sum of its experts' outputs times
    /// their weights, added in ascending expert order, then the shared experts'
    /// output (their step, `shared_step`, leased after the routed experts), then its
    /// residual.
    pub fn run<B: Backend>(
        &self,
        b: &B,
        lw: &LayerLease<'_>,
        shared_step: usize,
        routed: &[Routed],
        xs: &mut [B::Act],
    ) -> Result<(), VoomError> {
        let h = self.router.cols;
        // The rows each expert computes: (chunk, row, weight), in position order.
        let mut to: Vec<Vec<(usize, usize, f32)>> = vec![Vec::new(); self.routed.len()];
        for (c, r) in routed.iter().enumerate() {
            for (row, picks) in r.picks.iter().enumerate() {
                for &(e, weight) in picks {
                    to[e as usize].push((c, row, weight));
                }
            }
        }
        let chosen: Vec<usize> = (0..to.len()).filter(|&e| !to[e].is_empty()).collect();
        let mut out: Vec<Vec<f32>> = routed
            .iter()
            .map(|r| vec![0.0f32; r.picks.len() * h])
            .collect();
        // Each row adds its experts' weighted outputs in ascending expert order. Where
        // every expert's output can be held until all are computed, the experts are
        // computed in the order their pages are ready (resident ones while the others
        // load) and added in that order after; else each is added as it is computed,
        // ascending.
        let picks: usize = to.iter().map(Vec::len).sum();
        let any_order =
            lw.expert_hold() > 0 && picks * h * std::mem::size_of::<f32>() <= lw.expert_hold();
        let mut held: Vec<Option<Vec<f32>>> = vec![None; to.len()];
        let add = |out: &mut Vec<Vec<f32>>, rows: &[(usize, usize, f32)], y: &[f32]| {
            for (i, &(c, r, weight)) in rows.iter().enumerate() {
                let dst = &mut out[c][r * h..(r + 1) * h];
                for (o, &v) in dst.iter_mut().zip(&y[i * h..(i + 1) * h]) {
                    *o += v * weight;
                }
            }
        };
        lw.experts(&chosen, any_order, |e, w| {
            let rows = &to[e];
            let input = {
                let mut v = Vec::with_capacity(rows.len() * h);
                for &(c, r, _) in rows {
                    v.extend_from_slice(&routed[c].xn[r * h..(r + 1) * h]);
                }
                b.upload(rows.len(), h, &v)?
            };
            let y = self.routed[e].compute(b, w, self.act, &input, rows.len())?;
            if any_order {
                held[e] = Some(y);
            } else {
                add(&mut out, rows, &y);
            }
            Ok(())
        })?;
        if any_order {
            for &e in &chosen {
                let y = held[e].take().expect("every expert chosen was computed");
                add(&mut out, &to[e], &y);
            }
        }
        if let Some(shared) = &self.shared {
            let w = lw.step(shared_step)?;
            for (r, o) in routed.iter().zip(out.iter_mut()) {
                let rows = r.picks.len();
                let xn = b.upload(rows, h, &r.xn)?;
                let y = shared.compute(b, &w, Activation::Silu, &xn, rows)?;
                match &self.shared_gate {
                    // transformers: `sigmoid(shared_expert_gate(x)) * shared_expert(x)`.
                    Some(g) => {
                        let mut z = b.zeros(rows, 1);
                        b.matmul(&xn, w.matrix(g), &mut z)?;
                        let z = b.download_owned(z)?;
                        for ((o, v), &zr) in o.chunks_exact_mut(h).zip(y.chunks_exact(h)).zip(&z) {
                            let s = 1.0 / (1.0 + (-zr).exp());
                            for (o, &v) in o.iter_mut().zip(v) {
                                *o += s * v;
                            }
                        }
                    }
                    None => {
                        for (o, v) in o.iter_mut().zip(y) {
                            *o += v;
                        }
                    }
                }
            }
        }
        for (x, o) in xs.iter_mut().zip(out) {
            let o = b.upload(b.shape(x).0, h, &o)?;
            b.add(x, &o)?;
        }
        Ok(())
    }

    /// Predicts this layer's picks (layer `li`) from the hidden states `xs` of an
    /// earlier layer, with this layer's MLP norm and router, and hints them to the
    /// sweep. A hint only: no result depends on it.
    pub fn hint_picks<B: Backend>(
        &self,
        b: &B,
        cfg: &ModelConfig,
        sweep: &Sweep<'_>,
        li: usize,
        norm: &Vector,
        xs: &[B::Act],
    ) -> Result<(), VoomError> {
        let moe = cfg.moe.as_ref().expect("a layer of experts has a config");
        let mut pages = vec![norm.page];
        pages.extend(self.router_pages());
        let w = sweep.lease(&pages)?;
        let mut picked = vec![false; moe.num_experts];
        for x in xs {
            let mut xn = b.zeros(b.shape(x).0, cfg.hidden_size);
            b.rms_norm(x, w.vector(norm), cfg.rms_norm_eps, &mut xn)?;
            for row in self.route(b, moe, &w, &xn)? {
                for (e, _) in row {
                    picked[e as usize] = true;
                }
            }
        }
        let experts: Vec<usize> = (0..picked.len()).filter(|&e| picked[e]).collect();
        sweep.hint_experts(li, &experts);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_dims_name_each_familys_keys() {
        let json = r#"{"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128,
            "moe_intermediate_size": 32, "n_routed_experts": 8, "n_group": 2, "topk_group": 1,
            "num_experts_per_tok": 2, "n_shared_experts": 2, "num_hidden_layers": 2,
            "num_attention_heads": 2, "vocab_size": 16, "max_position_embeddings": 64,
            "kv_lora_rank": 16, "q_lora_rank": null, "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4, "v_head_dim": 8, "first_k_dense_replace": 1}"#;
        let cfg = ModelConfig::from_json(json, std::path::Path::new("c")).unwrap();
        let d = ExpertDims::of(&cfg);
        assert_eq!(
            (d.experts.key.as_str(), d.experts.len),
            ("'n_routed_experts'", 8)
        );
        assert_eq!(
            (d.inter.key.as_str(), d.inter.len),
            ("'moe_intermediate_size'", 32)
        );
        assert_eq!(d.shared_inter.len, 64);
        assert_eq!(cfg.moe.unwrap().sparse, vec![false, true]);
    }
}
