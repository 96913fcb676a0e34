//! [`CpuBackend`]: the backend interface on this machine's cores, with one
//! instruction set's kernels. Every instruction set gives the same bits.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use super::activation;
use super::attention;
use super::matmul::{self, Isa};
use super::ops;
use super::rows::Rows;
use super::threads::{SharedOut, ThreadPool};
use crate::backend::kv::KvCache;
use crate::backend::{
    check, Activation, AttentionShape, Backend, KernelError, LatentShape, RopeShape, RopeTable,
    TableView, VecView, WeightView,
};

/// The CPU backend: a thread pool and the instruction set its kernels use.
#[derive(Debug)]
pub struct CpuBackend {
    pool: ThreadPool,
    isa: Isa,
    /// Multiply-adds of products and attention so far ([`Backend::multiply_adds`]).
    macs: AtomicU64,
}

impl CpuBackend {
    /// `threads` compute threads (0: every available core) with `isa`'s kernels.
    ///
    /// # Panics
    /// If this CPU lacks `isa` ([`Isa::detect`] tells which it has).
    pub fn new(threads: usize, isa: Isa) -> std::io::Result<Self> {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        Ok(Self::with_pool(ThreadPool::new(threads)?, isa))
    }

    /// A backend on an existing pool.
    ///
    /// # Panics
    /// If this CPU lacks `isa`.
    pub fn with_pool(pool: ThreadPool, isa: Isa) -> Self {
        assert!(
            isa.supported(),
            "{isa:?} kernels requested on a CPU without them"
        );
        CpuBackend {
            pool,
            isa,
            macs: AtomicU64::new(0),
        }
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    fn count(&self, macs: u64) {
        self.macs.fetch_add(macs, Ordering::Relaxed);
    }

    pub fn pool(&self) -> &ThreadPool {
        &self.pool
    }
}

/// Below this many floats a row-wise op runs on the caller alone.
const PARALLEL_MIN_FLOATS: usize = 1 << 15;

impl CpuBackend {
    /// Runs `f(rows, dst)` over the rows of `dst` (`cols` floats each), `dst` the
    /// floats of those rows, on the pool's threads when there is enough work: for
    /// row-wise ops, whose every element has the same bits whichever thread
    /// computes it.
    fn by_rows(&self, dst: &mut [f32], cols: usize, f: impl Fn(Range<usize>, &mut [f32]) + Sync) {
        let rows = dst.len().checked_div(cols).unwrap_or(0);
        if self.pool.threads() == 1 || dst.len() < PARALLEL_MIN_FLOATS || rows < 2 {
            f(0..rows, dst);
            return;
        }
        let ptr = SharedOut(dst.as_mut_ptr());
        let grain = rows.div_ceil(self.pool.threads() * 2);
        self.pool.for_each_chunk_grain(rows, grain, |r| {
            // SAFETY: chunks are disjoint row ranges within `rows` (rows * cols <=
            // dst.len()), and `dst` is exclusively borrowed until the pool returns.
            let part = unsafe {
                std::slice::from_raw_parts_mut(ptr.get().add(r.start * cols), r.len() * cols)
            };
            f(r, part)
        });
    }
}

/// `x` must be `rows × cols` (`what` names it in the error).
fn check_shape(what: &'static str, x: &Rows, rows: usize, cols: usize) -> Result<(), KernelError> {
    check::dims(what, (x.rows(), x.cols()), rows, cols)
}

fn dims(x: &Rows) -> (usize, usize) {
    (x.rows(), x.cols())
}

impl Backend for CpuBackend {
    type Act = Rows;

    fn name(&self) -> String {
        format!("cpu-{}", self.isa.name())
    }

    fn threads(&self) -> usize {
        self.pool.threads()
    }

    fn multiply_adds(&self) -> u64 {
        self.macs.load(Ordering::Relaxed)
    }

    fn zeros(&self, rows: usize, cols: usize) -> Rows {
        Rows::zeros(rows, cols)
    }

    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<Rows, KernelError> {
        Rows::from_vec(rows, cols, data.to_vec()).ok_or(KernelError::ActivationLen {
            what: "host data",
            n: rows,
            per_token: cols,
            expected: rows.saturating_mul(cols),
            actual: data.len(),
        })
    }

    fn shape(&self, x: &Rows) -> (usize, usize) {
        (x.rows(), x.cols())
    }

    fn download(&self, x: &Rows) -> Result<Vec<f32>, KernelError> {
        Ok(x.as_slice().to_vec())
    }

    fn download_owned(&self, x: Rows) -> Result<Vec<f32>, KernelError> {
        Ok(x.into_vec())
    }

    fn rows(&self, x: &Rows, range: Range<usize>) -> Result<Rows, KernelError> {
        check::row_range(dims(x), &range)?;
        let c = x.cols();
        let data = x.as_slice()[range.start * c..range.end * c].to_vec();
        Ok(Rows::from_vec(range.len(), c, data).expect("length is rows × cols"))
    }

    fn stack(&self, parts: &[Rows]) -> Result<Rows, KernelError> {
        check::stack(parts.iter().map(dims))?;
        let c = parts.first().map_or(0, Rows::cols);
        let rows: usize = parts.iter().map(Rows::rows).sum();
        let mut data = Vec::with_capacity(rows * c);
        for p in parts {
            data.extend_from_slice(p.as_slice());
        }
        Ok(Rows::from_vec(rows, c, data).expect("length is rows × cols"))
    }

    fn embed(&self, table: &TableView<'_>, ids: &[u32], out: &mut Rows) -> Result<(), KernelError> {
        check::embed(table, ids, dims(out))?;
        table.gather(ids, out.as_mut_slice());
        Ok(())
    }

    fn matmul(&self, x: &Rows, w: WeightView<'_>, out: &mut Rows) -> Result<(), KernelError> {
        check_shape("matmul input", x, x.rows(), w.cols)?;
        check_shape("matmul output", out, x.rows(), w.rows)?;
        self.count(check::product_terms(x.rows(), w.rows, w.cols));
        matmul::matmul_isa(
            self.isa,
            &self.pool,
            x.as_slice(),
            x.rows(),
            w,
            out.as_mut_slice(),
        )
    }

    fn add_bias(&self, x: &mut Rows, bias: VecView<'_>) -> Result<(), KernelError> {
        bias.check("bias", x.cols())?;
        ops::add_bias(x.as_mut_slice(), &bias.to_vec());
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &Rows,
        weight: VecView<'_>,
        eps: f32,
        out: &mut Rows,
    ) -> Result<(), KernelError> {
        weight.check("norm weight", x.cols())?;
        check_shape("norm output", out, x.rows(), x.cols())?;
        let (cols, w) = (x.cols(), weight.to_vec());
        let src = x.as_slice();
        self.by_rows(out.as_mut_slice(), cols, |r, dst| {
            ops::rms_norm(&src[r.start * cols..r.end * cols], cols, &w, eps, dst);
        });
        Ok(())
    }

    fn rms_norm_groups(
        &self,
        x: &mut Rows,
        group: usize,
        weight: VecView<'_>,
        eps: f32,
    ) -> Result<(), KernelError> {
        weight.check("norm weight", group)?;
        check::groups(dims(x), group)?;
        let w = weight.to_vec();
        self.by_rows(x.as_mut_slice(), group, |_, dst| {
            ops::rms_norm_inplace(dst, group, &w, eps)
        });
        Ok(())
    }

    fn rope(&self, x: &mut Rows, shape: &RopeShape, table: &RopeTable) -> Result<(), KernelError> {
        check::rope(dims(x), shape, table)?;
        let (half, hd) = (table.half, shape.head_dim);
        let cols = x.cols();
        let (from, to) = (shape.offset, shape.offset + 2 * half);
        self.by_rows(x.as_mut_slice(), cols, |rows, dst| {
            for (t, row) in rows.zip(dst.chunks_exact_mut(cols)) {
                let (c, s) = (
                    &table.cos[t * half..(t + 1) * half],
                    &table.sin[t * half..(t + 1) * half],
                );
                for head in row.chunks_exact_mut(hd) {
                    let r = &mut head[from..to];
                    if shape.interleaved {
                        ops::rope_interleaved(r, c, s);
                    } else {
                        ops::rope_head(r, c, s);
                    }
                }
            }
        });
        Ok(())
    }

    fn matmul_t(&self, x: &Rows, w: WeightView<'_>, out: &mut Rows) -> Result<(), KernelError> {
        check_shape("transposed matmul input", x, x.rows(), w.rows)?;
        check_shape("transposed matmul output", out, x.rows(), w.cols)?;
        self.count(check::product_terms(x.rows(), w.rows, w.cols));
        matmul::matmul_t_isa(
            self.isa,
            &self.pool,
            x.as_slice(),
            x.rows(),
            w,
            out.as_mut_slice(),
        )
    }

    fn latent_attention(
        &self,
        q: &Rows,
        kv_new: &Rows,
        kv: &mut KvCache,
        layer: usize,
        shape: &LatentShape,
        out: &mut Rows,
    ) -> Result<(), KernelError> {
        check::latent(shape, dims(q), dims(kv_new), dims(out), kv, layer)?;
        let n = q.rows();
        let pos0 = kv.layer_len(layer);
        let w = shape.rank + shape.rope;
        self.count(check::attention_terms(
            n,
            pos0,
            None,
            shape.heads,
            w,
            shape.rank,
        ));
        kv.append(layer, kv_new.as_slice(), &[])?;
        let cache = kv.layer(layer)?;
        attention::attend_latent(
            self.isa,
            &self.pool,
            shape,
            q.as_slice(),
            &cache,
            pos0,
            n,
            out.as_mut_slice(),
        );
        Ok(())
    }

    fn attention(
        &self,
        q: &Rows,
        k: &Rows,
        v: &Rows,
        kv: &mut KvCache,
        layer: usize,
        shape: &AttentionShape,
        out: &mut Rows,
    ) -> Result<(), KernelError> {
        check::attention(shape, dims(q), dims(k), dims(v), dims(out), kv, layer)?;
        let n = q.rows();
        let pos0 = kv.layer_len(layer);
        let hd = shape.head_dim;
        self.count(check::attention_terms(
            n,
            pos0,
            shape.window,
            shape.heads,
            hd,
            hd,
        ));
        kv.append(layer, k.as_slice(), v.as_slice())?;
        let view = kv.layer(layer)?;
        attention::attend(
            self.isa,
            &self.pool,
            shape,
            q.as_slice(),
            &view,
            pos0,
            n,
            out.as_mut_slice(),
        );
        Ok(())
    }

    fn add(&self, x: &mut Rows, y: &Rows) -> Result<(), KernelError> {
        check_shape("addend", y, x.rows(), x.cols())?;
        let (cols, src) = (x.cols(), y.as_slice());
        self.by_rows(x.as_mut_slice(), cols, |r, dst| {
            ops::add_inplace(dst, &src[r.start * cols..r.end * cols])
        });
        Ok(())
    }

    fn gated(&self, act: Activation, gate: &mut Rows, up: &Rows) -> Result<(), KernelError> {
        check_shape("gated MLP up", up, gate.rows(), gate.cols())?;
        let (cols, src, isa) = (gate.cols(), up.as_slice(), self.isa);
        self.by_rows(gate.as_mut_slice(), cols, |r, dst| match act {
            Activation::Silu => activation::silu_mul(isa, dst, &src[r.start * cols..r.end * cols]),
            Activation::ClampedSwiglu { alpha, limit } => {
                activation::clamped_swiglu(dst, &src[r.start * cols..r.end * cols], alpha, limit)
            }
        });
        Ok(())
    }

    fn clamp(&self, x: &mut Rows, limit: f32) -> Result<(), KernelError> {
        ops::clamp(x.as_mut_slice(), limit);
        Ok(())
    }

    fn softmax(&self, x: &mut Rows) -> Result<(), KernelError> {
        if x.cols() > 0 {
            let cols = x.cols();
            x.as_mut_slice()
                .chunks_exact_mut(cols)
                .for_each(ops::softmax);
        }
        Ok(())
    }

    fn sigmoid(&self, x: &mut Rows) -> Result<(), KernelError> {
        ops::sigmoid(x.as_mut_slice());
        Ok(())
    }

    fn top_k(&self, x: &Rows, k: usize) -> Result<Vec<Vec<(u32, f32)>>, KernelError> {
        Ok(ops::top_k_rows(x.as_slice(), x.cols(), x.rows(), k))
    }
}
