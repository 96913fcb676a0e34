//! [`MlxBackend`]: the backend interface on MLX's default device (Metal on Apple
//! Silicon, the CPU build on Linux).
//!
//! Weight and KV pages are handed to MLX as external memory, which it wraps where it
//! can (Metal, pages aligned to its 16 KiB pages) and copies otherwise (its Linux
//! CPU and CUDA builds copy every page when the array is made): a copy is counted
//! ([`Backend::copied_bytes`]), and the memory planner sets one aside for the
//! largest matrix ([`Backend::weight_scratch_bytes`]).
//!
//! # One graph per layer
//! Activations are MLX arrays ([`MlxAct`]), float32, evaluated lazily: element-wise
//! ops, norms, rotary embeddings and products only add to MLX's graph. A product
//! hands MLX a clone of the page's lease ([`WeightView::kept_by`]), released when
//! MLX frees the page's buffer (at once where it copied it), so the page stays
//! leased while the graph may read it, and the product needs no evaluation of its
//! own. A layer's graph is evaluated where the engine needs values on the host:
//! the new keys and values appended to the KV cache (one evaluation of both),
//! a router's top-k, the logits. Attention reads the cache's pages, which have no
//! lease: where MLX wraps them (Metal) it is evaluated before it returns, where it
//! copies them it stays in the graph. A view with no lease that MLX wraps is
//! evaluated before the product returns. [`Backend::evaluations`] counts the
//! evaluations.
//!
//! # Arithmetic
//! Float32 activations over BF16 (F16, F32) weights widened exactly to float32, as
//! the reference computes, and FP8 weights as their e4m3 values times their block's
//! scale (exact in f32, one rounding: the CPU's specification); MXFP4 weights go to
//! MLX's own `quantized_matmul` (mode `mxfp4`), which dequantizes inside its kernel
//! (exactly) and accumulates in f32. Each op as transformers writes it (`shim.cpp`
//! says how), attention sinks and gpt-oss's clamped SwiGLU included.
//! The bits are MLX's, not the CPU backend's: the CPU and MLX backends agree on
//! token ids, and each is batch invariant where [`MlxBackend::batch_invariant`]
//! says so. Where an evaluation happens does not change a value.

use std::ffi::{c_char, c_int, c_void};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use super::ffi::{self, int, make, status, Handle};
use vpaged::PageLease;

use crate::backend::cpu::ops::top_k_rows;
use crate::backend::kv::KvCache;
use crate::backend::view::WeightFormat;
use crate::backend::{
    check, Activation, AttentionShape, Backend, KernelError, LatentShape, RopeShape, RopeTable,
    TableView, VecView, WeightView,
};
use voom_formats::DType;

/// Activations of the MLX backend: `rows × cols` float32, an MLX array (`None`:
/// zeros not yet made, so an output buffer costs nothing until written).
#[derive(Debug)]
pub struct MlxAct {
    rows: usize,
    cols: usize,
    arr: Option<Handle>,
}

/// An input array: the activation's own, or zeros made for the call.
enum Input<'a> {
    Ref(&'a Handle),
    Own(Handle),
}

impl Input<'_> {
    fn ptr(&self) -> *mut c_void {
        match self {
            Input::Ref(h) => h.ptr(),
            Input::Own(h) => h.ptr(),
        }
    }
}

/// The MLX backend.
#[derive(Debug)]
pub struct MlxBackend {
    device: String,
    /// Bytes of weights and KV pages MLX (or an alignment fix here) copied instead
    /// of reading them in place.
    copied: AtomicU64,
    /// Graph evaluations this backend asked of MLX that computed something.
    evaluations: AtomicU64,
    /// Multiply-adds of products and attention ([`Backend::multiply_adds`]).
    macs: AtomicU64,
}

/// Releases a lease a product handed MLX (`shim.cpp` calls it once, when MLX
/// frees the page's buffer).
unsafe extern "C" fn release_lease(ctx: *mut c_void) {
    // SAFETY: `ctx` came from `Box::into_raw` of a `Box<PageLease>` in
    // `MlxBackend::product`, and the shim calls this exactly once for it.
    drop(unsafe { Box::from_raw(ctx.cast::<PageLease>()) });
}

impl MlxBackend {
    /// MLX on its default device.
    pub fn new() -> Result<Self, KernelError> {
        Ok(MlxBackend {
            device: ffi::static_str(
                // SAFETY: returns a static string; no other effect.
                unsafe { ffi::voom_mlx_device() },
            ),
            copied: AtomicU64::new(0),
            evaluations: AtomicU64::new(0),
            macs: AtomicU64::new(0),
        })
    }

    fn count(&self, evaluated: c_int) {
        if evaluated != 0 {
            self.evaluations.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Evaluates `xs` together (their pending graph computed once).
    fn eval(&self, xs: &[&MlxAct]) -> Result<(), KernelError> {
        let ptrs: Vec<_> = xs
            .iter()
            .filter_map(|x| x.arr.as_ref().map(Handle::ptr))
            .collect();
        let n = int("arrays", ptrs.len())?;
        let mut evaluated = 0;
        // SAFETY: `ptrs` are live arrays.
        status(|err, len| unsafe {
            ffi::voom_mlx_eval(ptrs.as_ptr(), n, &mut evaluated, err, len)
        })?;
        self.count(evaluated);
        Ok(())
    }

    /// The version of the MLX linked ("0.32.4").
    pub fn version() -> String {
        // SAFETY: returns a static string; no other effect.
        ffi::static_str(unsafe { ffi::voom_mlx_version() })
    }

    /// "cpu" or "gpu".
    pub fn device(&self) -> &str {
        &self.device
    }

    fn input<'a>(&self, x: &'a MlxAct) -> Result<Input<'a>, KernelError> {
        match &x.arr {
            Some(h) => Ok(Input::Ref(h)),
            None => {
                let (r, c) = (int("rows", x.rows)?, int("columns", x.cols)?);
                // SAFETY: the shim writes one array pointer to `out` and at most
                // `errlen` bytes to `err`.
                make(|out, err, len| unsafe { ffi::voom_mlx_zeros(r, c, out, err, len) })
                    .map(Input::Own)
            }
        }
    }

    /// `op(x) -> y` of the same shape, in place of `x`.
    fn unary(
        &self,
        x: &mut MlxAct,
        op: impl FnOnce(*mut c_void, *mut *mut c_void, *mut c_char, c_int) -> c_int,
    ) -> Result<(), KernelError> {
        let y = {
            let a = self.input(x)?;
            make(|out, err, len| op(a.ptr(), out, err, len))?
        };
        x.arr = Some(y);
        Ok(())
    }

    /// `w`'s bytes at an address aligned for its dtype: in place, or (counted in
    /// [`MlxBackend::copied_bytes`]) a copy.
    fn aligned<'a>(&self, w: &'a [u8], size: usize, buf: &'a mut Vec<u32>) -> *const u8 {
        if (w.as_ptr() as usize).is_multiple_of(size) {
            return w.as_ptr();
        }
        buf.resize(w.len().div_ceil(4), 0);
        // SAFETY: `buf` holds at least `w.len()` bytes; the regions do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(w.as_ptr(), buf.as_mut_ptr().cast(), w.len()) };
        self.copied.fetch_add(w.len() as u64, Ordering::Relaxed);
        buf.as_ptr().cast()
    }

    fn product(
        &self,
        x: &MlxAct,
        w: WeightView<'_>,
        transposed: bool,
        out: &mut MlxAct,
    ) -> Result<(), KernelError> {
        w.check()?;
        let (format, align) = match w.format {
            WeightFormat::Plain(DType::F32) => (0, 4),
            WeightFormat::Plain(DType::BF16) => (1, 2),
            WeightFormat::Plain(DType::F16) => (2, 2),
            WeightFormat::Fp8(_) => (3, 1),
            // Read as 32-bit words of eight elements.
            WeightFormat::Mxfp4 { .. } => (4, 4),
            // ggml's block formats run on the CPU backend only.
            WeightFormat::Ggml(_) => {
                return Err(KernelError::UnsupportedFormat(format!(
                    "{} (on MLX; run it with --backend cpu)",
                    w.format.describe()
                )))
            }
            other => return Err(KernelError::UnsupportedDType(other.dtype())),
        };
        self.macs.fetch_add(
            check::product_terms(x.rows, w.rows, w.cols),
            Ordering::Relaxed,
        );
        let mut buf = Vec::new();
        let p = self.aligned(w.bytes, align, &mut buf);
        let (rows, cols) = (int("weight rows", w.rows)?, int("weight columns", w.cols)?);
        let none = (std::ptr::null(), 0, 0, 0, 0, 0, 0);
        let (scales, scale_dtype, scale_rows, scale_cols, block_rows, block_cols, row0) =
            match w.format {
                WeightFormat::Plain(_) | WeightFormat::Ggml(_) => none,
                WeightFormat::Fp8(s) => (
                    s.bytes.as_ptr(),
                    if s.dtype == DType::BF16 { 1 } else { 0 },
                    int("scale rows", (s.row0 + w.rows).div_ceil(s.block_rows))?,
                    int("scale columns", s.blocks_per_row(w.cols))?,
                    int("block rows", s.block_rows)?,
                    int("block columns", s.block_cols)?,
                    int("first row", s.row0)?,
                ),
                WeightFormat::Mxfp4 { scales } => (scales.as_ptr(), 5, rows, cols / 32, 1, 32, 0),
            };
        let q = ffi::VoomWeight {
            w: p.cast(),
            format,
            rows,
            cols,
            scales: scales.cast(),
            scale_dtype,
            scale_rows,
            scale_cols,
            block_rows,
            block_cols,
            row0,
        };
        let a = self.input(x)?;
        // The page's lease, when `p` is its bytes in place (an aligned copy here is
        // the call's own, which MLX copies or the call evaluates).
        let keep = w.kept_by().filter(|_| p == w.bytes.as_ptr());
        let (keep_ctx, keep_release) = match keep {
            Some(l) => (
                Box::into_raw(Box::new(l.clone())).cast::<c_void>(),
                Some(release_lease as unsafe extern "C" fn(*mut c_void)),
            ),
            None => (std::ptr::null_mut(), None),
        };
        let (mut copied, mut evaluated) = (0u64, 0);
        // SAFETY: `q.w` points at the `rows × cols` elements of the format coded,
        // and `q.scales` at its scales (both checked by `w.check()`; the elements
        // perhaps an aligned copy), alive until this call returns, and the
        // elements after it while the lease in `keep_ctx` lives (which the shim
        // owns from here and releases once; it copies the scales); with no lease,
        // the shim evaluates before it returns if it did not copy them.
        let y = make(|o, err, len| unsafe {
            ffi::voom_mlx_matmul(
                a.ptr(),
                &q,
                c_int::from(transposed),
                keep_ctx,
                keep_release,
                &mut copied,
                &mut evaluated,
                o,
                err,
                len,
            )
        })?;
        self.copied.fetch_add(copied, Ordering::Relaxed);
        self.count(evaluated);
        out.arr = Some(y);
        Ok(())
    }

    /// Attention of `q` over cached positions `lo..pos0 + n` of `kv`'s `layer`:
    /// keys `kv_heads·dk` floats from `k_off` of each position, values `kv_heads·dv`
    /// from `v_off` (in the value pages, or the key pages when there are none).
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        q: &MlxAct,
        kv: &KvCache,
        layer: usize,
        (heads, kv_heads, dk, dv): (usize, usize, usize, usize),
        (k_off, v_off): (usize, usize),
        (pos0, lo, window, scale): (usize, usize, usize, f32),
        sinks: Option<&[f32]>,
        out: &mut MlxAct,
    ) -> Result<(), KernelError> {
        let n = q.rows;
        if sinks.is_some_and(|s| s.len() != heads) {
            return Err(KernelError::Backend(format!(
                "{} attention sinks for {heads} heads",
                sinks.map_or(0, <[f32]>::len)
            )));
        }
        let seen = (window > 0).then_some(window);
        self.macs.fetch_add(
            check::attention_terms(n, pos0, seen, heads, dk, dv),
            Ordering::Relaxed,
        );
        let view = kv.layer(layer)?;
        let width = view.width;
        let values = if view.v.is_empty() { &view.k } else { &view.v };
        let (mut ks, mut vs, mut lens) = (Vec::new(), Vec::new(), Vec::new());
        for (p, off, m) in view.segments(lo, pos0 + n) {
            let (k, v) = (&view.k[p][..], &values[p][..]);
            let need = (off + m) * width;
            if k.len() < need || v.len() < need {
                return Err(KernelError::Backend(format!(
                    "KV page {p} of layer {layer} holds {} floats, attention needs {need}",
                    k.len().min(v.len())
                )));
            }
            ks.push(k[off * width..].as_ptr());
            vs.push(v[off * width..].as_ptr());
            lens.push(int("positions", m)?);
        }
        let args = [
            int("segments", lens.len())?,
            int("width", width)?,
            int("key offset", k_off)?,
            int("value offset", v_off)?,
            int("key size", dk)?,
            int("value size", dv)?,
            int("heads", heads)?,
            int("KV heads", kv_heads)?,
            int("position", pos0)?,
            int("first position", lo)?,
            int("window", window)?,
        ];
        let (mut copied, mut evaluated) = (0u64, 0);
        let y = {
            let a = self.input(q)?;
            // SAFETY: each segment pointer points at `lens[i] × width` floats of a
            // page `view` holds alive until this call returns (checked above); the
            // shim evaluates its result before returning unless MLX copied them all,
            // so keeps no pointer into them; `sinks`, where given, holds `heads`
            // floats (checked), which the shim copies.
            make(|o, err, len| unsafe {
                ffi::voom_mlx_attention(
                    a.ptr(),
                    ks.as_ptr(),
                    vs.as_ptr(),
                    lens.as_ptr(),
                    args[0],
                    args[1],
                    args[2],
                    args[3],
                    args[4],
                    args[5],
                    args[6],
                    args[7],
                    args[8],
                    args[9],
                    args[10],
                    scale,
                    sinks.map_or(std::ptr::null(), <[f32]>::as_ptr),
                    &mut copied,
                    &mut evaluated,
                    o,
                    err,
                    len,
                )
            })?
        };
        self.copied.fetch_add(copied, Ordering::Relaxed);
        self.count(evaluated);
        out.arr = Some(y);
        Ok(())
    }
}

fn dims(x: &MlxAct) -> (usize, usize) {
    (x.rows, x.cols)
}

impl Backend for MlxBackend {
    type Act = MlxAct;

    fn name(&self) -> String {
        format!("mlx-{}", self.device)
    }

    fn threads(&self) -> usize {
        1
    }

    /// Shown for MLX's CPU build (its products are the reference BLAS's, summed in
    /// order) by the conformance suites and `libvoom/tests/mlx_backend.rs`; not
    /// shown for its GPU kernels, whose products and reductions tile by shape.
    fn batch_invariant(&self) -> bool {
        self.device == "cpu"
    }

    /// Borrowed memory MLX copied instead of wrapping: on its CPU and CUDA builds
    /// every page (MLX 0.32 copies any external pointer there); on Metal, pages it
    /// cannot map as a buffer (not aligned to its 16 KiB pages).
    fn copied_bytes(&self) -> u64 {
        self.copied.load(Ordering::Relaxed)
    }

    /// The page copied (at most 4 bytes an element) and widened to f32 (4 more),
    /// both alive until the product is evaluated; an FP8 weight's e4m3 bytes (1),
    /// their f32 values (4) and the scaled values (4).
    fn weight_scratch_bytes(&self, elems: u64) -> u64 {
        elems * 9
    }

    /// Evaluations that computed something (a download of values already computed
    /// is not one).
    fn evaluations(&self) -> u64 {
        self.evaluations.load(Ordering::Relaxed)
    }

    fn multiply_adds(&self) -> u64 {
        self.macs.load(Ordering::Relaxed)
    }

    fn zeros(&self, rows: usize, cols: usize) -> MlxAct {
        MlxAct {
            rows,
            cols,
            arr: None,
        }
    }

    fn upload(&self, rows: usize, cols: usize, data: &[f32]) -> Result<MlxAct, KernelError> {
        if rows.checked_mul(cols) != Some(data.len()) {
            return Err(KernelError::ActivationLen {
                what: "host data",
                n: rows,
                per_token: cols,
                expected: rows.saturating_mul(cols),
                actual: data.len(),
            });
        }
        let (r, c) = (int("rows", rows)?, int("columns", cols)?);
        // SAFETY: `data` holds `rows × cols` floats (checked); the shim copies them.
        let h =
            make(|o, err, len| unsafe { ffi::voom_mlx_upload(data.as_ptr(), r, c, o, err, len) })?;
        Ok(MlxAct {
            rows,
            cols,
            arr: Some(h),
        })
    }

    fn shape(&self, x: &MlxAct) -> (usize, usize) {
        dims(x)
    }

    fn download(&self, x: &MlxAct) -> Result<Vec<f32>, KernelError> {
        let mut v = vec![0f32; x.rows * x.cols];
        if let Some(h) = &x.arr {
            let mut evaluated = 0;
            // SAFETY: `v` holds exactly the array's `rows × cols` floats (the shim
            // checks the size before copying).
            status(|err, len| unsafe {
                ffi::voom_mlx_download(h.ptr(), v.as_mut_ptr(), v.len(), &mut evaluated, err, len)
            })?;
            self.count(evaluated);
        }
        Ok(v)
    }

    fn download_owned(&self, x: MlxAct) -> Result<Vec<f32>, KernelError> {
        self.download(&x)
    }

    fn rows(&self, x: &MlxAct, range: Range<usize>) -> Result<MlxAct, KernelError> {
        check::row_range(dims(x), &range)?;
        let (s, e) = (int("row", range.start)?, int("row", range.end)?);
        let arr = match &x.arr {
            None => None,
            // SAFETY: a live array; the range is within its rows (checked).
            Some(h) => Some(make(|o, err, len| unsafe {
                ffi::voom_mlx_rows(h.ptr(), s, e, o, err, len)
            })?),
        };
        Ok(MlxAct {
            rows: range.len(),
            cols: x.cols,
            arr,
        })
    }

    fn stack(&self, parts: &[MlxAct]) -> Result<MlxAct, KernelError> {
        check::stack(parts.iter().map(dims))?;
        let cols = parts.first().map_or(0, |p| p.cols);
        let rows = parts.iter().map(|p| p.rows).sum();
        let inputs = parts
            .iter()
            .map(|p| self.input(p))
            .collect::<Result<Vec<_>, _>>()?;
        let ptrs: Vec<_> = inputs.iter().map(Input::ptr).collect();
        let n = int("parts", ptrs.len())?;
        let arr = if ptrs.is_empty() {
            None
        } else {
            // SAFETY: `ptrs` are live arrays of one column count (checked).
            Some(make(|o, err, len| unsafe {
                ffi::voom_mlx_stack(ptrs.as_ptr(), n, o, err, len)
            })?)
        };
        Ok(MlxAct { rows, cols, arr })
    }

    fn embed(
        &self,
        table: &TableView<'_>,
        ids: &[u32],
        out: &mut MlxAct,
    ) -> Result<(), KernelError> {
        check::embed(table, ids, dims(out))?;
        let mut host = self.download(out)?;
        table.gather(ids, &mut host);
        *out = self.upload(out.rows, out.cols, &host)?;
        Ok(())
    }

    fn matmul(&self, x: &MlxAct, w: WeightView<'_>, out: &mut MlxAct) -> Result<(), KernelError> {
        check::dims("matmul input", dims(x), x.rows, w.cols)?;
        check::dims("matmul output", dims(out), x.rows, w.rows)?;
        self.product(x, w, false, out)
    }

    fn add_bias(&self, x: &mut MlxAct, bias: VecView<'_>) -> Result<(), KernelError> {
        bias.check("bias", x.cols)?;
        let b = bias.to_vec();
        let n = int("columns", b.len())?;
        // SAFETY: `b` holds the row's `n` floats; the shim copies them.
        self.unary(x, |a, o, err, len| unsafe {
            ffi::voom_mlx_add_row(a, b.as_ptr(), n, o, err, len)
        })
    }

    fn rms_norm(
        &self,
        x: &MlxAct,
        weight: VecView<'_>,
        eps: f32,
        out: &mut MlxAct,
    ) -> Result<(), KernelError> {
        weight.check("norm weight", x.cols)?;
        check::dims("norm output", dims(out), x.rows, x.cols)?;
        let w = weight.to_vec();
        let g = int("columns", x.cols)?;
        let y = {
            let a = self.input(x)?;
            // SAFETY: `w` holds `g` floats; the shim copies them.
            make(|o, err, len| unsafe {
                ffi::voom_mlx_rms_norm(a.ptr(), w.as_ptr(), g, eps, o, err, len)
            })?
        };
        out.arr = Some(y);
        Ok(())
    }

    fn rms_norm_groups(
        &self,
        x: &mut MlxAct,
        group: usize,
        weight: VecView<'_>,
        eps: f32,
    ) -> Result<(), KernelError> {
        weight.check("norm weight", group)?;
        check::groups(dims(x), group)?;
        let w = weight.to_vec();
        let g = int("group", group)?;
        // SAFETY: `w` holds `g` floats; the shim copies them.
        self.unary(x, |a, o, err, len| unsafe {
            ffi::voom_mlx_rms_norm(a, w.as_ptr(), g, eps, o, err, len)
        })
    }

    fn rope(
        &self,
        x: &mut MlxAct,
        shape: &RopeShape,
        table: &RopeTable,
    ) -> Result<(), KernelError> {
        check::rope(dims(x), shape, table)?;
        let (half, hd, off) = (
            int("rotary half", table.half)?,
            int("head size", shape.head_dim)?,
            int("rotary offset", shape.offset)?,
        );
        let il = c_int::from(shape.interleaved);
        // SAFETY: the tables hold `rows × half` floats each (checked); the shim
        // copies them.
        self.unary(x, |a, o, err, len| unsafe {
            ffi::voom_mlx_rope(
                a,
                table.cos.as_ptr(),
                table.sin.as_ptr(),
                half,
                hd,
                off,
                il,
                o,
                err,
                len,
            )
        })
    }

    fn matmul_t(&self, x: &MlxAct, w: WeightView<'_>, out: &mut MlxAct) -> Result<(), KernelError> {
        check::dims("transposed matmul input", dims(x), x.rows, w.rows)?;
        check::dims("transposed matmul output", dims(out), x.rows, w.cols)?;
        self.product(x, w, true, out)
    }

    fn latent_attention(
        &self,
        q: &MlxAct,
        kv_new: &MlxAct,
        kv: &mut KvCache,
        layer: usize,
        shape: &LatentShape,
        out: &mut MlxAct,
    ) -> Result<(), KernelError> {
        check::latent(shape, dims(q), dims(kv_new), dims(out), kv, layer)?;
        let pos0 = kv.layer_len(layer);
        kv.append(layer, &self.download(kv_new)?, &[])?;
        let w = shape.rank + shape.rope;
        self.attend(
            q,
            kv,
            layer,
            (shape.heads, 1, w, shape.rank),
            (0, 0),
            (pos0, 0, 0, shape.scale),
            None,
            out,
        )
    }

    fn attention(
        &self,
        q: &MlxAct,
        k: &MlxAct,
        v: &MlxAct,
        kv: &mut KvCache,
        layer: usize,
        shape: &AttentionShape,
        out: &mut MlxAct,
    ) -> Result<(), KernelError> {
        check::attention(shape, dims(q), dims(k), dims(v), dims(out), kv, layer)?;
        let pos0 = kv.layer_len(layer);
        // The layer's graph so far, evaluated once for both.
        self.eval(&[k, v])?;
        kv.append(layer, &self.download(k)?, &self.download(v)?)?;
        let hd = shape.head_dim;
        let lo = shape.window.map_or(0, |w| (pos0 + 1).saturating_sub(w));
        let scale = (hd as f32).powf(-0.5);
        self.attend(
            q,
            kv,
            layer,
            (shape.heads, shape.kv_heads, hd, hd),
            (0, 0),
            (pos0, lo, shape.window.unwrap_or(0), scale),
            shape.sinks.as_deref(),
            out,
        )
    }

    fn add(&self, x: &mut MlxAct, y: &MlxAct) -> Result<(), KernelError> {
        check::dims("addend", dims(y), x.rows, x.cols)?;
        let b = self.input(y)?;
        // SAFETY: two live arrays of one shape (checked).
        self.unary(x, |a, o, err, len| unsafe {
            ffi::voom_mlx_add(a, b.ptr(), o, err, len)
        })
    }

    fn gated(&self, act: Activation, gate: &mut MlxAct, up: &MlxAct) -> Result<(), KernelError> {
        check::dims("gated MLP up", dims(up), gate.rows, gate.cols)?;
        let u = self.input(up)?;
        match act {
            // SAFETY: two live arrays of one shape (checked).
            Activation::Silu => self.unary(gate, |a, o, err, len| unsafe {
                ffi::voom_mlx_silu_mul(a, u.ptr(), o, err, len)
            }),
            Activation::ClampedSwiglu { alpha, limit } => {
                // SAFETY: two live arrays of one shape (checked).
                self.unary(gate, |a, o, err, len| unsafe {
                    ffi::voom_mlx_clamped_swiglu(a, u.ptr(), alpha, limit, o, err, len)
                })
            }
        }
    }

    fn clamp(&self, x: &mut MlxAct, limit: f32) -> Result<(), KernelError> {
        // SAFETY: a live array.
        self.unary(x, |a, o, err, len| unsafe {
            ffi::voom_mlx_clamp(a, limit, o, err, len)
        })
    }

    fn softmax(&self, x: &mut MlxAct) -> Result<(), KernelError> {
        if x.cols == 0 {
            return Ok(());
        }
        // SAFETY: a live array.
        self.unary(x, |a, o, err, len| unsafe {
            ffi::voom_mlx_softmax(a, o, err, len)
        })
    }

    fn sigmoid(&self, x: &mut MlxAct) -> Result<(), KernelError> {
        // SAFETY: a live array.
        self.unary(x, |a, o, err, len| unsafe {
            ffi::voom_mlx_sigmoid(a, o, err, len)
        })
    }

    fn top_k(&self, x: &MlxAct, k: usize) -> Result<Vec<Vec<(u32, f32)>>, KernelError> {
        Ok(top_k_rows(&self.download(x)?, x.cols, x.rows, k))
    }
}
