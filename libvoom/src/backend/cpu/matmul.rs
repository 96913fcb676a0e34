//! Matrix-vector and matrix-matrix products over weights read in place.
//!
//! `y = W·x` with `W` a row-major BF16/F16/F32 matrix viewed straight from the page
//! bytes (no copy, no conversion ahead of time) and `x`, `y` in f32.
//!
//! # One accumulation order per output element (DESIGN.md invariant 6)
//!
//! Every output element `out[t][o] = Σ_k x[t][k]·W[o][k]` is computed in exactly this
//! order, whatever the number of tokens, the thread count, the tile it falls in or
//! the instruction set:
//!
//! 1. eight f32 lanes `acc[0..8]`, all `+0.0`; for each full block of eight
//!    (`k0 = 0, 8, 16, ..` while `k0 + 8 <= cols`), lane `l` does
//!    `acc[l] = fma(W[o][k0+l], x[t][k0+l], acc[l])` (fused, one rounding);
//! 2. a fixed horizontal reduction: `h[l] = acc[l] + acc[l+4]` for `l < 4`, then
//!    `(h[0] + h[2]) + (h[1] + h[3])`;
//! 3. the tail `k = cols - cols % 8 .. cols` in increasing order, `s = fma(W, x, s)`.
//!
//! Weights are converted to f32 exactly (BF16 and F16 are subsets of f32), so the
//! conversion never changes a value. Block-scaled weights enter step 1 as their
//! format defines them ([`WeightView::get`]): an FP8 element is `e4m3 × scale`
//! rounded once to f32, an MXFP4 element `e2m1 × 2^(e − 127)` (exact), computed
//! inside the tile for each block of eight (every block lies in one scale block),
//! never as a widened copy of the matrix; the order of the sums is the same. On
//! AVX-512 they run the tiles at every token count (the packed path is for plain
//! weights), FP8 and MXFP4 tiles of their own (`matmul_fp8.rs`: e4m3 bits placed in
//! an f32 and one multiply by the scale; `matmul_mxfp4.rs`: each block's weights
//! looked up in a table of its scale). The AVX2 path keeps one 8-lane register per
//! output element; instruction-level parallelism comes from computing a tile of
//! several rows and tokens at once, never from splitting one element's sum. The
//! portable path emulates the same lanes with `f32::mul_add`, so it produces the same
//! bits (it is what runs on CPUs without AVX2+FMA+F16C or NEON). It is written in a
//! form LLVM vectorises (checked on x86-64-v3; on aarch64 `fmla` is fused too, so
//! vectorising it there cannot change the bits). On aarch64 the NEON path
//! (`matmul_neon.rs`) keeps each 8-lane accumulator in two 128-bit registers.
//!
//! Decode (one token) streams `W` once, with software prefetch; prefill reuses each
//! `W` tile from L1/L2 across all tokens of the call, converting each 8-element
//! block once per group of tokens of a tile (see `tile_shape`). On AVX-512, calls
//! of [`PACKED_MIN_TOKENS`] tokens or more widen each panel of sixteen rows to f32
//! once and transpose it, then keep step 1's eight lanes of sixteen rows in eight
//! registers (`matmul_packed.rs`): the same operations in the same order, without a
//! conversion per tile or a horizontal sum per element. Threads split the rows; an
//! element's value never depends on which thread or tile computed it.

use std::ops::Range;

use voom_formats::DType;

use super::threads::{SharedOut, ThreadPool};
use crate::backend::view::{e8m0_to_f32, WeightFormat, E2M1};
pub use crate::backend::{KernelError, WeightView};

const DT_BF16: u8 = 0;
const DT_F16: u8 = 1;
const DT_F32: u8 = 2;
/// FP8 e4m3 with block scales ([`WeightFormat::Fp8`]).
const DT_FP8: u8 = 3;
/// MXFP4 with e8m0 scales ([`WeightFormat::Mxfp4`]).
const DT_MXFP4: u8 = 4;
/// A ggml block format ([`WeightFormat::Ggml`]): groups of rows widened by ggml's
/// dequantization, then the F32 kernels (`matmul_ggml.rs`).
const DT_GGML: u8 = 5;

/// Bytes per element of dtype code `DT`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const fn elem_size(dt: u8) -> usize {
    if dt == DT_F32 {
        4
    } else {
        2
    }
}

/// Bytes of eight consecutive elements of a row of dtype code `DT` (every format's
/// rows are whole such blocks, but for a plain or FP8 tail).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const fn block8_bytes(dt: u8) -> usize {
    match dt {
        DT_F32 => 32,
        DT_FP8 => 8,
        DT_MXFP4 => 4,
        _ => 16,
    }
}

/// Where element `k` of a row of dtype code `DT` starts, in bytes from the row's
/// start (`k` a multiple of 8 for MXFP4).
#[inline(always)]
const fn k_bytes(dt: u8, k: usize) -> usize {
    match dt {
        DT_F32 => 4 * k,
        DT_FP8 => k,
        DT_MXFP4 => k / 2,
        _ => 2 * k,
    }
}

fn dtype_code(f: &WeightFormat<'_>) -> Result<u8, KernelError> {
    Ok(match f {
        WeightFormat::Plain(d) => {
            crate::backend::view::check_dtype(*d)?;
            match d {
                DType::BF16 => DT_BF16,
                DType::F16 => DT_F16,
                _ => DT_F32,
            }
        }
        WeightFormat::Fp8(_) => DT_FP8,
        WeightFormat::Mxfp4 { .. } => DT_MXFP4,
        WeightFormat::Ggml(_) => DT_GGML,
    })
}

/// The e4m3 value of every byte ([`e4m3_to_f32`], computed at compile time): the
/// kernels' conversion where they look values up.
static E4M3_F32: [f32; 256] = e4m3_table();

const fn e4m3_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut b = 0;
    while b < 256 {
        let sign = ((b & 0x80) as u32) << 24;
        let e = ((b >> 3) & 0xf) as i32;
        let m = (b & 7) as u32;
        let bits = if b & 0x7f == 0x7f {
            0x7fc0_0000
        } else if e == 0 && m == 0 {
            sign
        } else if e == 0 {
            // 0.mmm x 2^-6, normalised.
            let (mut m, mut exp) = (m, -6i32);
            while m & 8 == 0 {
                m <<= 1;
                exp -= 1;
            }
            sign | (((exp + 127) as u32) << 23) | ((m & 7) << 20)
        } else {
            sign | (((e + 120) as u32) << 23) | (m << 20)
        };
        t[b] = f32::from_bits(bits);
        b += 1;
    }
    t
}

/// The high bytes of the F16 bits of the e2m1 values (`E2M1`; the low bytes are
/// all zero): the SIMD paths look MXFP4 nibbles up in it, then widen F16 to f32.
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(dead_code)
)]
const E2M1_F16_HIGH_BYTES: [u8; 16] = [
    0x00, 0x38, 0x3c, 0x3e, 0x40, 0x42, 0x44, 0x46, 0x80, 0xb8, 0xbc, 0xbe, 0xc0, 0xc2, 0xc4, 0xc6,
];

/// Where a block-scaled weight's scales are, as the tiles read them (for a plain
/// weight, nothing: never read). MXFP4 is the case of blocks of one row and 32
/// columns with e8m0 scales.
#[derive(Clone, Copy)]
struct ScaleMap {
    base: *const u8,
    block_rows: usize,
    row0: usize,
    /// Bytes of scales per block row.
    stride: usize,
    /// log2 of the columns a scale covers.
    shift: u32,
    /// FP8 scales stored as BF16 (else F32).
    bf16: bool,
}

impl ScaleMap {
    /// The map of a checked view.
    fn of(w: &WeightView<'_>) -> ScaleMap {
        match w.format {
            WeightFormat::Fp8(s) => ScaleMap {
                base: s.bytes.as_ptr(),
                block_rows: s.block_rows,
                row0: s.row0,
                stride: s.blocks_per_row(w.cols) * s.dtype.size(),
                shift: s.block_cols.trailing_zeros(),
                bf16: s.dtype == DType::BF16,
            },
            WeightFormat::Mxfp4 { scales } => ScaleMap {
                base: scales.as_ptr(),
                block_rows: 1,
                row0: 0,
                stride: w.cols / 32,
                shift: 5,
                bf16: false,
            },
            // Never read: ggml blocks carry their scales and run widened as F32.
            WeightFormat::Plain(_) | WeightFormat::Ggml(_) => ScaleMap {
                base: std::ptr::null(),
                block_rows: 1,
                row0: 0,
                stride: 0,
                shift: 0,
                bf16: false,
            },
        }
    }

    /// The scales of row `o` of the view (a null pointer for a plain weight).
    #[inline(always)]
    fn row(&self, o: usize) -> *const u8 {
        self.base
            .wrapping_add((self.row0 + o) / self.block_rows * self.stride)
    }

    /// The scale of element `k` of the row whose scales are at `s`.
    ///
    /// # Safety
    /// `s` is [`ScaleMap::row`] of a row of a checked block-scaled view (`DT_FP8`
    /// or `DT_MXFP4`), `k` within the row.
    #[inline(always)]
    unsafe fn get<const DT: u8>(&self, s: *const u8, k: usize) -> f32 {
        let i = k >> self.shift;
        // SAFETY: the checked scales hold every block of the row (the caller's).
        unsafe {
            if DT == DT_MXFP4 {
                e8m0_to_f32(*s.add(i))
            } else if self.bf16 {
                f32::from_bits(u32::from(s.add(2 * i).cast::<u16>().read_unaligned()) << 16)
            } else {
                s.add(4 * i).cast::<f32>().read_unaligned()
            }
        }
    }
}

/// Weight element `k` of a row (at `row`, its scales at `srow`) as f32: the
/// format's definition ([`WeightView::get`]), for the tails past the last block
/// of eight.
///
/// # Safety
/// `row` is a row of a checked view of code `DT`, `srow` its [`ScaleMap::row`],
/// `k` within the row.
#[inline(always)]
unsafe fn load1q<const DT: u8>(row: *const u8, k: usize, sm: &ScaleMap, srow: *const u8) -> f32 {
    // SAFETY: forwarded contract.
    unsafe {
        match DT {
            DT_FP8 => E4M3_F32[*row.add(k) as usize] * sm.get::<DT>(srow, k),
            DT_MXFP4 => {
                let b = *row.add(k / 2);
                let nib = if k.is_multiple_of(2) { b & 0xf } else { b >> 4 };
                E2M1[nib as usize] * sm.get::<DT>(srow, k)
            }
            _ => load1::<DT>(row, k),
        }
    }
}

/// Rows per chunk granule: chunks of rows handed to threads are multiples of this
/// (a multiple of both tile heights of [`tile_shape`]).
const ROW_GRANULE: usize = 12;

/// Tokens from which AVX-512 products widen each 16-row panel once per call and
/// run over it packed (`matmul_packed.rs`) instead of tiling the weights in place.
/// Below it, widening and transposing cost more than they save (`matmul_bench
/// --tokens N`: at 16 tokens packing was the slower, from 24 to 32 about even,
/// from 64 the faster).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const PACKED_MIN_TOKENS: usize = 48;

/// Row chunks per thread: more balance load (a late or preempted thread claims
/// fewer), fewer keep each thread's weight stream long (prefetch warm-up per chunk).
const CHUNKS_PER_THREAD: usize = 4;

/// Software prefetch distance (bytes) of tiles of short rows, along the tile's
/// contiguous weight bytes; tiles longer than this prefetch per row instead. On a
/// 2 vCPU EPYC, 576-column BF16 rows (1152 bytes) read as four interleaved short
/// streams reach about half the read bandwidth without it.
#[cfg(target_arch = "x86_64")]
const PREFETCH_AHEAD: usize = 16 << 10;

/// Software prefetch distance (bytes) within each row, for tiles of long rows.
#[cfg(target_arch = "x86_64")]
const PREFETCH_ROW: usize = 2 << 10;

/// Below this many multiply-adds a call runs on the caller alone: waking workers
/// would cost more than it saves.
const PARALLEL_MIN_MACS: usize = 1 << 15;

/// The instruction set a kernel call uses. Every variant produces the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// x86_64 with AVX-512 (F, VL, BW) besides AVX2, FMA and F16C: the AVX2
    /// kernels' eight-lane arithmetic, with AVX-512's 32 vector registers holding
    /// larger tiles (more multiply-adds per weight converted and per load).
    Avx512,
    /// x86_64 with AVX2, FMA and F16C.
    Avx2,
    /// aarch64 with NEON (every aarch64 CPU): each eight-lane accumulator in two
    /// 128-bit registers (`matmul_neon.rs`).
    Neon,
    /// Lane-emulating scalar code (any CPU).
    Portable,
}

impl Isa {
    /// The best instruction set this CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::sync::OnceLock;
            static DETECTED: OnceLock<Isa> = OnceLock::new();
            return *DETECTED.get_or_init(|| {
                let avx2 = std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c");
                let avx512 = std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512bw");
                match (avx2, avx512) {
                    (true, true) => Isa::Avx512,
                    (true, false) => Isa::Avx2,
                    _ => Isa::Portable,
                }
            });
        }
        #[cfg(target_arch = "aarch64")]
        if std::arch::is_aarch64_feature_detected!("neon") {
            return Isa::Neon;
        }
        #[allow(unreachable_code)]
        Isa::Portable
    }

    /// Every instruction set this CPU can run, best first (tests compare them all).
    pub fn available() -> Vec<Isa> {
        let all: &[Isa] = if cfg!(target_arch = "aarch64") {
            &[Isa::Neon, Isa::Portable]
        } else {
            &[Isa::Avx512, Isa::Avx2, Isa::Portable]
        };
        let best = all
            .iter()
            .position(|&i| i == Isa::detect())
            .unwrap_or(all.len() - 1);
        all[best..].to_vec()
    }

    /// Whether this CPU can run `self`'s kernels.
    pub fn supported(self) -> bool {
        Isa::available().contains(&self)
    }

    /// Whether the AVX2 kernels (every kernel but the matrix product's tiles,
    /// which AVX-512 widens) may run: the CPU has AVX2, FMA and F16C.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) fn avx2(self) -> bool {
        matches!(self, Isa::Avx512 | Isa::Avx2)
    }

    /// The short name backends are called by: `avx512`, `avx2`, `portable`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Neon => "neon",
            Isa::Portable => "portable",
        }
    }
}

/// `out[t*rows + o] = Σ_k x[t*cols + k] · W[o*cols + k]` for `t < n`, `o < rows`.
///
/// Batch invariant: each output element has the bits it would have in any other
/// call, whatever `n`, the pool's thread count and the other rows (see module doc).
pub fn matmul(
    pool: &ThreadPool,
    x: &[f32],
    n: usize,
    w: WeightView<'_>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    matmul_isa(Isa::detect(), pool, x, n, w, out)
}

/// [`matmul`] with an explicit instruction set (for tests and benches).
///
/// # Panics
/// If this CPU lacks `isa` ([`Isa::available`] tells which it has).
pub fn matmul_isa(
    isa: Isa,
    pool: &ThreadPool,
    x: &[f32],
    n: usize,
    w: WeightView<'_>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    w.check()?;
    let dt = dtype_code(&w.format)?;
    check_len("x", x.len(), n, w.cols)?;
    check_len("out", out.len(), n, w.rows)?;
    assert_isa(isa);
    if n == 0 || w.rows == 0 {
        return Ok(());
    }
    let dst = SharedOut(out.as_mut_ptr());
    let job = |rows: Range<usize>| {
        // SAFETY: lengths were checked above (x: n*cols, out: n*rows, W: rows*cols of
        // `dt`), `rows` lies within 0..w.rows (pool chunks cover 0..w.rows), chunks
        // are disjoint so no two threads write the same `out` element, and `out` is
        // exclusively borrowed for the whole call. `isa` is Avx2 only if detected.
        unsafe { compute_rows(isa, dt, x, n, &w, rows, dst) }
    };
    let macs = w.rows.saturating_mul(w.cols).saturating_mul(n);
    split(pool, w.rows, macs, row_granule(isa, dt, n), job);
    Ok(())
}

/// Rows per chunk granule of an `n`-token call: whole packed panels where AVX-512
/// packs, else [`ROW_GRANULE`].
fn row_granule(isa: Isa, dt: u8, n: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && packs(dt, n) {
        return packed::PANEL;
    }
    let _ = (isa, dt, n);
    ROW_GRANULE
}

/// Whether an AVX-512 product of `n` tokens of code `dt` runs packed
/// (`matmul_packed.rs`): many tokens over a plain weight. Block-scaled weights run
/// the tiles at every `n` (their bits are the same either way).
#[cfg(target_arch = "x86_64")]
fn packs(dt: u8, n: usize) -> bool {
    n >= PACKED_MIN_TOKENS && dt <= DT_F32
}

/// Runs `job` over `0..items` on the caller when the work (`macs`) is small or the
/// pool has one thread, else in a few chunks per thread (dynamic balance on a shared
/// VM) of whole `granule`s.
fn split(
    pool: &ThreadPool,
    items: usize,
    macs: usize,
    granule: usize,
    job: impl Fn(Range<usize>) + Sync,
) {
    if pool.threads() == 1 || macs < PARALLEL_MIN_MACS {
        job(0..items);
    } else {
        let grain = items
            .div_ceil(pool.threads() * CHUNKS_PER_THREAD)
            .next_multiple_of(granule);
        pool.for_each_chunk_grain(items, grain, job);
    }
}

/// Row `r`'s elements `cols` of a checked view, as f32: each exactly
/// [`WeightView::get`]'s value (the same operands, one rounding where the format
/// has one), by table lookups rather than the definition's arithmetic.
///
/// # Panics
/// If `out.len() != cols.len()` or the row or columns lie outside the view.
pub fn widen_row(isa: Isa, w: &WeightView<'_>, r: usize, cols: Range<usize>, out: &mut [f32]) {
    assert!(r < w.rows && cols.end <= w.cols && out.len() == cols.len());
    let i0 = r * w.cols;
    match w.format {
        WeightFormat::Plain(DType::BF16) => {
            let b = &w.bytes[2 * (i0 + cols.start)..2 * (i0 + cols.end)];
            for (o, p) in out.iter_mut().zip(b.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([p[0], p[1]])) << 16);
            }
        }
        WeightFormat::Plain(d) => {
            for (o, j) in out.iter_mut().zip(cols) {
                *o = voom_formats::dtype::read_f32(d, w.bytes, i0 + j);
            }
        }
        WeightFormat::Fp8(s) => {
            // A run of columns in one scale block at a time.
            let mut j = cols.start;
            while j < cols.end {
                let end = ((j / s.block_cols + 1) * s.block_cols).min(cols.end);
                let scale = s.get(w.cols, r, j);
                let b = &w.bytes[i0 + j..i0 + end];
                let o = &mut out[j - cols.start..end - cols.start];
                #[allow(unused_mut)]
                let mut done = 0;
                #[cfg(not(target_arch = "x86_64"))]
                let _ = isa;
                #[cfg(target_arch = "x86_64")]
                if isa == Isa::Avx512 {
                    // SAFETY: `b` and `o` have one length; the AVX-512 kernels run
                    // on this CPU (the caller's `isa` is supported).
                    done = unsafe { fp8::widen_run(b, scale, o) };
                }
                for (o, &v) in o[done..].iter_mut().zip(&b[done..]) {
                    *o = E4M3_F32[usize::from(v)] * scale;
                }
                j = end;
            }
        }
        WeightFormat::Mxfp4 { scales } => {
            let per = w.cols / 32;
            for (o, j) in out.iter_mut().zip(cols) {
                let i = i0 + j;
                let byte = w.bytes[i / 2];
                let nib = if i.is_multiple_of(2) {
                    byte & 0xf
                } else {
                    byte >> 4
                };
                *o = E2M1[usize::from(nib)] * e8m0_to_f32(scales[r * per + j / 32]);
            }
        }
        WeightFormat::Ggml(ty) => ggml::widen(w, ty, r, cols, out),
    }
}

/// `out[t][c] = Σ_r x[t][r] · w[r][c]` (the weight's rows contracted: `x` is
/// `n × w.rows`, `out` `n × w.cols`): each element one fused multiply-add a term in
/// increasing `r` from 0 ([`axpy`]'s bits), whatever the number of rows or threads.
/// Blocks of columns are computed in parallel, each widening the weight a row at a
/// time.
pub fn matmul_t_isa(
    isa: Isa,
    pool: &ThreadPool,
    x: &[f32],
    n: usize,
    w: WeightView<'_>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    w.check()?;
    check_len("x", x.len(), n, w.rows)?;
    check_len("out", out.len(), n, w.cols)?;
    assert_isa(isa);
    let (k, c) = (w.rows, w.cols);
    out.fill(0.0);
    if n == 0 || c == 0 {
        return Ok(());
    }
    let dst = SharedOut(out.as_mut_ptr());
    let job = |cols: Range<usize>| {
        // One row of the weight's columns `cols` at a time, widened by the format's
        // definition ([`widen_row`]: [`WeightView::get`]'s values) and applied to
        // every token: no f32 copy of the matrix, and each element still one fused
        // multiply-add a term in increasing `r`.
        let mut row = vec![0f32; cols.len()];
        for r in 0..k {
            widen_row(isa, &w, r, cols.clone(), &mut row);
            for t in 0..n {
                // SAFETY: `out` holds n*c elements (checked above); this job writes
                // only columns `cols` (within 0..c: pool chunks cover 0..c) of row t,
                // jobs have disjoint column ranges, and `out` is exclusively borrowed
                // for the whole call; no other slice of this row is alive.
                let o = unsafe {
                    std::slice::from_raw_parts_mut(dst.get().add(t * c + cols.start), cols.len())
                };
                axpy_isa(isa, o, x[t * k + r], &row);
            }
        }
    };
    split(pool, c, k.saturating_mul(c).saturating_mul(n), 8, job);
    Ok(())
}

/// [`axpy`] with an explicit instruction set (the same bits on each). The caller
/// checked that the lengths are equal and, for AVX2, that the CPU has it.
fn axpy_isa(isa: Isa, y: &mut [f32], a: f32, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa.avx2() {
        // SAFETY: the caller checked the CPU has AVX2 (assert_isa, or Isa::detect)
        // and that the lengths are equal.
        return unsafe { avx2::axpy(y, a, x) };
    }
    #[cfg(target_arch = "aarch64")]
    if isa == Isa::Neon {
        return neon::axpy(y, a, x);
    }
    let _ = isa;
    for (o, &v) in y.iter_mut().zip(x) {
        *o = a.mul_add(v, *o);
    }
}

/// Panics unless this CPU has `isa` (a caller bug: [`Isa::detect`] tells).
fn assert_isa(isa: Isa) {
    assert!(
        isa.supported(),
        "{isa:?} kernels requested on a CPU without them"
    );
}

fn check_len(what: &'static str, actual: usize, n: usize, per: usize) -> Result<(), KernelError> {
    let expected = n.checked_mul(per);
    if expected != Some(actual) {
        return Err(KernelError::ActivationLen {
            what,
            n,
            per_token: per,
            expected: expected.unwrap_or(usize::MAX),
            actual,
        });
    }
    Ok(())
}

/// Computes rows `rows` of `out` for all `n` tokens.
///
/// # Safety
/// `x.len() == n*w.cols`, `w` checked with dtype code `dt`, `rows ⊆ 0..w.rows`,
/// `out` valid for `n*w.rows` writes and no other thread writes these rows' elements;
/// `isa` is supported by this CPU ([`Isa::supported`]).
unsafe fn compute_rows(
    isa: Isa,
    dt: u8,
    x: &[f32],
    n: usize,
    w: &WeightView<'_>,
    rows: Range<usize>,
    out: SharedOut,
) {
    if dt == DT_GGML {
        // SAFETY: forwarded contract; the view is of a ggml type (its code).
        return unsafe { ggml::rows(isa, x, n, w, rows, out.0) };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded contract; the caller checked the CPU features.
        Isa::Avx512 => unsafe {
            match dt {
                DT_BF16 => avx512::rows::<DT_BF16>(x, n, w, rows, out.0),
                DT_F16 => avx512::rows::<DT_F16>(x, n, w, rows, out.0),
                DT_FP8 => avx512::rows::<DT_FP8>(x, n, w, rows, out.0),
                DT_MXFP4 => avx512::rows::<DT_MXFP4>(x, n, w, rows, out.0),
                _ => avx512::rows::<DT_F32>(x, n, w, rows, out.0),
            }
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded contract; the caller checked the CPU features.
        Isa::Avx2 => unsafe {
            match dt {
                DT_BF16 => avx2::rows::<DT_BF16>(x, n, w, rows, out.0),
                DT_F16 => avx2::rows::<DT_F16>(x, n, w, rows, out.0),
                DT_FP8 => avx2::rows::<DT_FP8>(x, n, w, rows, out.0),
                DT_MXFP4 => mxfp4::rows_avx2(x, n, w, rows, out.0),
                _ => avx2::rows::<DT_F32>(x, n, w, rows, out.0),
            }
        },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: forwarded contract; NEON is checked by the caller (`Isa::supported`).
        Isa::Neon => unsafe {
            match dt {
                DT_BF16 => neon::rows::<DT_BF16>(x, n, w, rows, out.0),
                DT_F16 => neon::rows::<DT_F16>(x, n, w, rows, out.0),
                DT_FP8 => neon::rows::<DT_FP8>(x, n, w, rows, out.0),
                DT_MXFP4 => neon::rows::<DT_MXFP4>(x, n, w, rows, out.0),
                _ => neon::rows::<DT_F32>(x, n, w, rows, out.0),
            }
        },
        // SAFETY: forwarded contract.
        _ => unsafe {
            match dt {
                DT_BF16 => portable::rows::<DT_BF16>(x, n, w, rows, out.0),
                DT_F16 => portable::rows::<DT_F16>(x, n, w, rows, out.0),
                DT_FP8 => portable::rows::<DT_FP8>(x, n, w, rows, out.0),
                DT_MXFP4 => portable::rows::<DT_MXFP4>(x, n, w, rows, out.0),
                _ => portable::rows::<DT_F32>(x, n, w, rows, out.0),
            }
        },
    }
}

/// Dot product of two f32 slices in the kernels' fixed order (8 fused lanes, fixed
/// reduction, fused tail): `dot_f32(w, x)` has the bits of `matmul` with a one-row
/// F32 weight `w`. For attention scores.
///
/// # Panics
/// If the lengths differ (a caller bug).
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32 on slices of different lengths");
    #[cfg(target_arch = "x86_64")]
    if Isa::detect().avx2() {
        // SAFETY: features checked; equal lengths checked.
        return unsafe { avx2::dot_f32(a, b) };
    }
    #[cfg(target_arch = "aarch64")]
    if Isa::detect() == Isa::Neon {
        return neon::dot_f32(a, b);
    }
    portable::dot_f32(a, b)
}

/// Attention scores of one query against `scores.len()` keys laid out with `stride`
/// floats between consecutive keys (the key of position `j` starts at `j * stride`):
/// `scores[j] = dot_f32(q, key_j) * scale`, each with [`dot_f32`]'s bits. One dispatch
/// per call, so the per-key work is inlined.
///
/// # Panics
/// If `keys` is too short for `scores.len()` keys of `q.len()` floats.
pub fn attention_scores(q: &[f32], keys: &[f32], stride: usize, scale: f32, scores: &mut [f32]) {
    attention_scores_isa(Isa::detect(), q, keys, stride, scale, scores)
}

/// [`attention_scores`] with an explicit instruction set (the same bits on each).
///
/// # Panics
/// As [`attention_scores`]; and if this CPU lacks `isa`.
pub fn attention_scores_isa(
    isa: Isa,
    q: &[f32],
    keys: &[f32],
    stride: usize,
    scale: f32,
    scores: &mut [f32],
) {
    assert_isa(isa);
    let n = scores.len();
    if n == 0 {
        return;
    }
    assert!(
        (n - 1) * stride + q.len() <= keys.len(),
        "attention_scores: {n} keys of {} floats at stride {stride} exceed {} floats",
        q.len(),
        keys.len()
    );
    #[cfg(target_arch = "x86_64")]
    if isa.avx2() {
        // SAFETY: features checked (assert_isa); every key slice is in bounds
        // (asserted above).
        unsafe {
            return avx2::attention_scores(q, keys, stride, scale, scores);
        }
    }
    let d = q.len();
    #[cfg(target_arch = "aarch64")]
    if isa == Isa::Neon {
        for (j, s) in scores.iter_mut().enumerate() {
            *s = neon::dot_f32(q, &keys[j * stride..j * stride + d]) * scale;
        }
        return;
    }
    for (j, s) in scores.iter_mut().enumerate() {
        *s = portable::dot_f32(q, &keys[j * stride..j * stride + d]) * scale;
    }
}

/// `out = Σ_j fma(p[j], value_j, out)` from `out = 0`, in increasing `j`, with the
/// value of position `j` at `j * stride` (each element with [`axpy`]'s bits).
///
/// # Panics
/// If `values` is too short for `p.len()` values of `out.len()` floats.
pub fn weighted_sum(p: &[f32], values: &[f32], stride: usize, out: &mut [f32]) {
    weighted_sum_isa(Isa::detect(), p, values, stride, out)
}

/// [`weighted_sum`] with an explicit instruction set (the same bits on each).
///
/// # Panics
/// As [`weighted_sum`]; and if this CPU lacks `isa`.
pub fn weighted_sum_isa(isa: Isa, p: &[f32], values: &[f32], stride: usize, out: &mut [f32]) {
    out.fill(0.0);
    weighted_sum_add_isa(isa, p, values, stride, out)
}

/// [`weighted_sum_isa`] continuing from `out` as it is: `out = Σ_j fma(p[j],
/// value_j, out)` in increasing `j`. A sum over values in several pieces (the pages
/// of a KV cache), each added in turn, has the bits of one call over them all.
///
/// # Panics
/// As [`weighted_sum`]; and if this CPU lacks `isa`.
pub fn weighted_sum_add_isa(isa: Isa, p: &[f32], values: &[f32], stride: usize, out: &mut [f32]) {
    assert_isa(isa);
    let n = p.len();
    if n == 0 {
        return;
    }
    let d = out.len();
    assert!(
        (n - 1) * stride + d <= values.len(),
        "weighted_sum: {n} values of {d} floats at stride {stride} exceed {} floats",
        values.len()
    );
    #[cfg(target_arch = "x86_64")]
    if isa.avx2() {
        // SAFETY: features checked (assert_isa); every value slice is in bounds
        // (asserted above).
        unsafe { avx2::weighted_sum_add(p, values, stride, out) };
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if isa == Isa::Neon {
        for (j, &pj) in p.iter().enumerate() {
            neon::axpy(out, pj, &values[j * stride..j * stride + d]);
        }
        return;
    }
    for (j, &pj) in p.iter().enumerate() {
        for (o, &v) in out.iter_mut().zip(&values[j * stride..j * stride + d]) {
            *o = pj.mul_add(v, *o);
        }
    }
}

/// `y[i] = fma(a, x[i], y[i])` for every `i` (one fused rounding per element).
///
/// # Panics
/// If the lengths differ (a caller bug).
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    assert_eq!(y.len(), x.len(), "axpy on slices of different lengths");
    axpy_isa(Isa::detect(), y, a, x);
}

/// Reads weight element `i` (of a `DT` buffer) as f32, exactly.
///
/// # Safety
/// `p` is valid for reads of element `i`.
#[inline(always)]
unsafe fn load1<const DT: u8>(p: *const u8, i: usize) -> f32 {
    // SAFETY: the caller guarantees element `i` is in bounds; reads are unaligned.
    unsafe {
        match DT {
            DT_BF16 => f32::from_bits((p.add(2 * i).cast::<u16>().read_unaligned() as u32) << 16),
            DT_F16 => half::f16::from_bits(p.add(2 * i).cast::<u16>().read_unaligned()).to_f32(),
            _ => p.add(4 * i).cast::<f32>().read_unaligned(),
        }
    }
}

/// The fixed horizontal reduction of eight lanes (step 2 of the module doc).
#[inline(always)]
fn hsum8(a: &[f32; 8]) -> f32 {
    let h = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (h[0] + h[2]) + (h[1] + h[3])
}

/// The loop over tiles of `$shape` rows x tokens shared by every instruction set:
/// `$tile::<DT, R, T>(x, w, o0, t0, out)` computes one tile. Edge tiles use the
/// smaller instantiations (at most 4 tokens where fewer rows than the shape's are
/// left); the order inside each element is the same in all of them, and so is
/// the order of the tiles (it changes no element's bits, only which cache level
/// feeds them).
macro_rules! tile_rows {
    ($tile:ident, $shape:ident, $dt:ident, $x:ident, $n:ident, $w:ident, $rows:ident, $out:ident) => {{
        let (mr, nr) = $shape($n);
        // The tile at rows `o..`, tokens `t..end`: rows and tokens it took.
        let one = |o: usize, t: usize, end: usize| -> (usize, usize) {
            let r = ($rows.end - o).min(mr);
            let nr = if r < mr { nr.min(4) } else { nr };
            let tn = (end - t).min(nr);
            // SAFETY: o + r <= rows.end <= w.rows and t + tn <= n; the rest is
            // the caller's contract.
            unsafe {
                match (r, tn) {
                    (4, 6) => $tile::<$dt, 4, 6>($x, $w, o, t, $out),
                    (4, 5) => $tile::<$dt, 4, 5>($x, $w, o, t, $out),
                    (4, 4) => $tile::<$dt, 4, 4>($x, $w, o, t, $out),
                    (4, 3) => $tile::<$dt, 4, 3>($x, $w, o, t, $out),
                    (4, 1) => $tile::<$dt, 4, 1>($x, $w, o, t, $out),
                    (4, 2) => $tile::<$dt, 4, 2>($x, $w, o, t, $out),
                    (3, 4) => $tile::<$dt, 3, 4>($x, $w, o, t, $out),
                    (3, 3) => $tile::<$dt, 3, 3>($x, $w, o, t, $out),
                    (3, 2) => $tile::<$dt, 3, 2>($x, $w, o, t, $out),
                    (3, _) => $tile::<$dt, 3, 1>($x, $w, o, t, $out),
                    (2, 4) => $tile::<$dt, 2, 4>($x, $w, o, t, $out),
                    (2, 3) => $tile::<$dt, 2, 3>($x, $w, o, t, $out),
                    (2, 2) => $tile::<$dt, 2, 2>($x, $w, o, t, $out),
                    (2, _) => $tile::<$dt, 2, 1>($x, $w, o, t, $out),
                    (_, 4) => $tile::<$dt, 1, 4>($x, $w, o, t, $out),
                    (_, 3) => $tile::<$dt, 1, 3>($x, $w, o, t, $out),
                    (_, 2) => $tile::<$dt, 1, 2>($x, $w, o, t, $out),
                    (_, _) => $tile::<$dt, 1, 1>($x, $w, o, t, $out),
                }
            }
            (r, tn)
        };
        // Tokens outer: one tile's activations stay in the first-level cache while
        // the rows of this chunk stream past them (the rows, fewer bytes per
        // multiply-add than the activations, come from the second level).
        let mut t = 0;
        while t < $n {
            let block = ($n - t).min(nr);
            let mut o = $rows.start;
            while o < $rows.end {
                // A row tile shorter than the shape takes its tokens in smaller steps.
                let mut tt = t;
                let mut r = 0;
                while tt < t + block {
                    let (rr, tn) = one(o, tt, t + block);
                    r = rr;
                    tt += tn;
                }
                o += r;
            }
            t += block;
        }
    }};
}

/// Rows x tokens of the tiles for an `n`-token call. Registers bound the tile: one
/// 8-lane accumulator per element plus one converted weight register per row and one
/// activation register, within AVX2's 16. Decode takes 4 rows (4 independent FMA
/// chains, enough to stream memory); prefill takes 3 rows x 4 tokens (12 + 3 + 1).
/// The tile shape never changes an element's bits, only speed.
#[inline(always)]
fn tile_shape(n: usize) -> (usize, usize) {
    if n <= 2 {
        (4, 2)
    } else {
        (3, 4)
    }
}

/// [`tile_shape`] with AVX-512's 32 registers: prefill takes 4 rows x 6 tokens
/// (24 accumulators + 4 weights + 1 activation), six multiply-adds per weight block
/// converted where [`tile_shape`]'s prefill tile does four.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn wide_tile_shape(n: usize) -> (usize, usize) {
    if n <= 2 {
        (4, 2)
    } else {
        (4, 6)
    }
}

/// Scalar code with the exact lane structure of the SIMD kernels: each accumulator
/// is an `[f32; 8]` updated lane by lane with `f32::mul_add` (fused, as the SIMD
/// FMA). On aarch64 LLVM vectorises the lane arrays to NEON `fmla`, which is also
/// fused, so the bits are unchanged.
mod portable {
    use super::*;

    /// # Safety
    /// As [`compute_rows`].
    pub(super) unsafe fn rows<const DT: u8>(
        x: &[f32],
        n: usize,
        w: &WeightView<'_>,
        rows: Range<usize>,
        out: *mut f32,
    ) {
        tile_rows!(tile, tile_shape, DT, x, n, w, rows, out)
    }

    // The helpers below take and return `[f32; 8]` by value with one simple loop per
    // lane operation: a form LLVM's SLP vectoriser turns into whole-register
    // operations (checked on x86-64-v3: one `vfmadd231ps ymm` per `fma8`), where a
    // tile written over nested arrays gets scattered into scalar and shuffle code.

    /// Lane-wise `a * b + c`, fused (one rounding), as the SIMD FMA.
    #[inline(always)]
    fn fma8(a: [f32; 8], b: [f32; 8], c: [f32; 8]) -> [f32; 8] {
        let mut o = [0.0f32; 8];
        for l in 0..8 {
            o[l] = a[l].mul_add(b[l], c[l]);
        }
        o
    }

    /// F16 bits to f32, exactly, in branch-free lane arithmetic (vectorisable):
    /// the exponent and mantissa moved into f32 position and scaled by 2^112 (exact
    /// for normals and subnormals alike); infinities and NaNs (quieted, as F16C
    /// does) are set apart.
    #[inline(always)]
    fn f16_to_f32(h: u16) -> f32 {
        let h = u32::from(h);
        let sign = (h & 0x8000) << 16;
        let em = h & 0x7fff;
        let finite = f32::from_bits(em << 13) * f32::from_bits(0x7780_0000); // 2^112
        let special =
            0x7f80_0000 | ((em & 0x3ff) << 13) | if em > 0x7c00 { 0x0040_0000 } else { 0 };
        let mag = if em >= 0x7c00 {
            special
        } else {
            finite.to_bits()
        };
        f32::from_bits(sign | mag)
    }

    /// Eight weights of code `DT` from the start of `b`, exactly converted; a
    /// block-scaled format's with the scale `s` of their block (one block holds all
    /// eight).
    ///
    /// # Panics
    /// If `b` is shorter than 8 elements (callers slice within the row).
    #[inline(always)]
    fn load8<const DT: u8>(b: &[u8], s: f32) -> [f32; 8] {
        let mut o = [0.0f32; 8];
        if DT == DT_FP8 {
            let b = &b[..8];
            for l in 0..8 {
                o[l] = E4M3_F32[b[l] as usize] * s;
            }
        } else if DT == DT_MXFP4 {
            let b = &b[..4];
            for l in 0..8 {
                let nib = (b[l / 2] >> (4 * (l % 2))) & 0xf;
                o[l] = E2M1[nib as usize] * s;
            }
        } else if DT == DT_F32 {
            let b = &b[..32];
            for l in 0..8 {
                o[l] = f32::from_le_bytes([b[4 * l], b[4 * l + 1], b[4 * l + 2], b[4 * l + 3]]);
            }
        } else {
            let b = &b[..16];
            let mut h = [0u16; 8];
            for l in 0..8 {
                h[l] = u16::from_le_bytes([b[2 * l], b[2 * l + 1]]);
            }
            for l in 0..8 {
                o[l] = if DT == DT_BF16 {
                    f32::from_bits(u32::from(h[l]) << 16)
                } else {
                    f16_to_f32(h[l])
                };
            }
        }
        o
    }

    /// Eight activations from the start of `x`.
    #[inline(always)]
    fn load8_f32(x: &[f32]) -> [f32; 8] {
        let mut o = [0.0f32; 8];
        o.copy_from_slice(&x[..8]);
        o
    }

    /// One tile: rows `o0..o0+R` x tokens `t0..t0+T`.
    ///
    /// # Safety
    /// As [`compute_rows`], with `o0 + R <= w.rows` and `t0 + T <= n` (the reads are
    /// bounds-checked slices; only the output write relies on the contract).
    #[inline]
    unsafe fn tile<const DT: u8, const R: usize, const T: usize>(
        x: &[f32],
        w: &WeightView<'_>,
        o0: usize,
        t0: usize,
        out: *mut f32,
    ) {
        let cols = w.cols;
        let k8 = cols - cols % 8;
        let row_bytes = k_bytes(DT, cols);
        let wr: [&[u8]; R] =
            std::array::from_fn(|r| &w.bytes[(o0 + r) * row_bytes..(o0 + r + 1) * row_bytes]);
        let sm = ScaleMap::of(w);
        let sr: [*const u8; R] = std::array::from_fn(|r| sm.row(o0 + r));
        let xr: [&[f32]; T] = std::array::from_fn(|t| &x[(t0 + t) * cols..(t0 + t + 1) * cols]);
        let mut acc = [[[0.0f32; 8]; T]; R];
        let mut k = 0;
        while k < k8 {
            // Plain loops, not `array::from_fn`, whose closure LLVM may leave
            // out of line (and the lanes then go through memory).
            let mut wv = [[0.0f32; 8]; R];
            for r in 0..R {
                let s = if DT > DT_F32 {
                    // SAFETY: `sr[r]` is row o0 + r's scales, k < cols.
                    unsafe { sm.get::<DT>(sr[r], k) }
                } else {
                    1.0
                };
                wv[r] = load8::<DT>(&wr[r][k_bytes(DT, k)..], s);
            }
            for t in 0..T {
                let xv = load8_f32(&xr[t][k..]);
                for r in 0..R {
                    acc[r][t] = fma8(wv[r], xv, acc[r][t]);
                }
            }
            k += 8;
        }
        for r in 0..R {
            for t in 0..T {
                let mut s = hsum8(&acc[r][t]);
                for (kk, &xv) in xr[t].iter().enumerate().skip(k8) {
                    // SAFETY: `kk < cols`, within the row slice; `sr[r]` its scales.
                    s = unsafe { load1q::<DT>(wr[r].as_ptr(), kk, &sm, sr[r]) }.mul_add(xv, s);
                }
                // SAFETY: (t0+t, o0+r) is within the `n*rows` output and belongs to
                // this thread's rows.
                unsafe { out.add((t0 + t) * w.rows + o0 + r).write(s) };
            }
        }
    }

    pub(super) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let mut out = 0.0f32;
        let w = WeightView {
            lease: None,
            format: crate::backend::view::WeightFormat::Plain(DType::F32),
            rows: 1,
            cols: a.len(),
            // SAFETY: reinterpreting initialised f32s as bytes (alignment 1, same
            // length in bytes, same lifetime).
            bytes: unsafe {
                std::slice::from_raw_parts(a.as_ptr().cast::<u8>(), std::mem::size_of_val(a))
            },
        };
        // SAFETY: one row of `a.len() == b.len()` elements, one token, one output.
        unsafe { tile::<DT_F32, 1, 1>(b, &w, 0, 0, &mut out) };
        out
    }
}

#[cfg(target_arch = "aarch64")]
#[path = "matmul_neon.rs"]
mod neon;

/// The loop over tiles of the AVX-512 block-scaled kernels (`matmul_mxfp4.rs`,
/// `matmul_fp8.rs`), whose tiles keep one 256-bit accumulator per element: six
/// rows at one or two tokens (six independent multiply-add chains while the
/// weights stream), four rows by four tokens beyond; `$tile::<R, T>(x, w, o0, t0,
/// out)` computes one. Tokens outer, as [`tile_rows!`]. The shape changes no bits.
#[cfg(target_arch = "x86_64")]
macro_rules! narrow_tiles {
    ($tile:ident, $x:ident, $n:ident, $w:ident, $rows:ident, $out:ident) => {
        narrow_tiles!($tile, (6, 2), (4, 4), $x, $n, $w, $rows, $out)
    };
    // Rows x tokens at one or two tokens, and beyond (at most 6 x 2 and 4 x 4).
    ($tile:ident, $decode:expr, $prefill:expr, $x:ident, $n:ident, $w:ident, $rows:ident, $out:ident) => {{
        let (tile_rows, tokens): (usize, usize) = if $n <= 2 { $decode } else { $prefill };
        let mut t = 0;
        while t < $n {
            let tn = ($n - t).min(tokens);
            let mut o = $rows.start;
            while o < $rows.end {
                let r = ($rows.end - o).min(tile_rows);
                // SAFETY: o + r <= rows.end and t + tn <= n; the rest is the
                // caller's contract.
                unsafe {
                    match (r, tn) {
                        (6, 1) => $tile::<6, 1>($x, $w, o, t, $out),
                        (6, 2) => $tile::<6, 2>($x, $w, o, t, $out),
                        (5, 1) => $tile::<5, 1>($x, $w, o, t, $out),
                        (5, 2) => $tile::<5, 2>($x, $w, o, t, $out),
                        (4, 1) => $tile::<4, 1>($x, $w, o, t, $out),
                        (4, 2) => $tile::<4, 2>($x, $w, o, t, $out),
                        (4, 3) => $tile::<4, 3>($x, $w, o, t, $out),
                        (4, 4) => $tile::<4, 4>($x, $w, o, t, $out),
                        (3, 1) => $tile::<3, 1>($x, $w, o, t, $out),
                        (3, 2) => $tile::<3, 2>($x, $w, o, t, $out),
                        (3, 3) => $tile::<3, 3>($x, $w, o, t, $out),
                        (3, 4) => $tile::<3, 4>($x, $w, o, t, $out),
                        (2, 1) => $tile::<2, 1>($x, $w, o, t, $out),
                        (2, 2) => $tile::<2, 2>($x, $w, o, t, $out),
                        (2, 3) => $tile::<2, 3>($x, $w, o, t, $out),
                        (2, 4) => $tile::<2, 4>($x, $w, o, t, $out),
                        (1, 1) => $tile::<1, 1>($x, $w, o, t, $out),
                        (1, 2) => $tile::<1, 2>($x, $w, o, t, $out),
                        (1, 3) => $tile::<1, 3>($x, $w, o, t, $out),
                        (1, 4) => $tile::<1, 4>($x, $w, o, t, $out),
                        _ => unreachable!("tile shapes cover 1..=6 rows x 1..=4 tokens"),
                    }
                }
                o += r;
            }
            t += tn;
        }
    }};
}

#[cfg(target_arch = "x86_64")]
#[path = "matmul_fp8.rs"]
mod fp8;
#[path = "matmul_ggml.rs"]
mod ggml;
#[cfg(target_arch = "x86_64")]
#[path = "matmul_mxfp4.rs"]
mod mxfp4;
#[cfg(target_arch = "x86_64")]
#[path = "matmul_packed.rs"]
mod packed;
#[cfg(target_arch = "x86_64")]
pub(super) use packed::transpose16;

/// Runs `$block(k)` for every eight-element block `k < $k8` of a tile's rows (`$wp`,
/// `$cols` elements, `$b8` bytes per eight), in increasing `k`, with software
/// prefetch: one cache line per row per line step. Short rows: along the tile's
/// contiguous bytes (its R rows are adjacent), PREFETCH_AHEAD beyond what the tile
/// has consumed, i.e. into the next tiles: R short interleaved streams are picked up
/// too late by the hardware prefetchers. Long rows: each row's own stream,
/// PREFETCH_ROW ahead. Prefetches never fault; addresses are only computed
/// (wrapping), never dereferenced. Shared by the AVX2 and AVX-512 tiles.
///
/// A macro, not a function taking a closure: a function without the tiles' target
/// features cannot inline a closure that has them (a callee is never inlined into a
/// caller with fewer target features), so each block became a call with the
/// accumulators in memory (a function version halved SmolLM2's prefill on
/// AVX-512).
#[cfg(target_arch = "x86_64")]
macro_rules! prefetched_blocks {
    ($wp:expr, $cols:expr, $b8:expr, $k8:expr, |$k:ident| $block:expr) => {{
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let (wp, cols, b8, k8) = ($wp, $cols, $b8, $k8);
        let blocks_per_line = 64 / b8;
        let line_k = 8 * blocks_per_line;
        let kl = k8 - k8 % line_k;
        let row_mode = R * cols * b8 / 8 > PREFETCH_AHEAD;
        let mut pf: [*const u8; R] = std::array::from_fn(|r| {
            if row_mode {
                wp[r].wrapping_add(PREFETCH_ROW)
            } else {
                wp[0].wrapping_add(PREFETCH_AHEAD + 64 * r)
            }
        });
        let pf_step = if row_mode { 64 } else { 64 * R };
        let mut base = 0;
        while base < kl {
            for p in &mut pf {
                // Expanded in the tiles' unsafe fns: SSE is part of every x86_64 CPU,
                // and a prefetch is a hint that never faults, whatever the address.
                _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>());
                *p = p.wrapping_add(pf_step);
            }
            for j in 0..blocks_per_line {
                let $k = base + 8 * j;
                $block;
            }
            base += line_k;
        }
        while base < k8 {
            let $k = base;
            $block;
            base += 8;
        }
    }};
}

/// The x86 tile kernel and its row loop, compiled for one set of target features
/// and tile shapes: `avx2` (16 registers) and `avx512` (32) share this code, so
/// they share each element's order of arithmetic.
#[cfg(target_arch = "x86_64")]
macro_rules! x86_tiles {
    ($features:literal, $shape:ident) => {
        /// One tile: rows `o0..o0+R` x tokens `t0..t0+T`.
        ///
        /// # Safety
        /// As [`compute_rows`], with `o0 + R <= w.rows` and `t0 + T <= n`.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn tile<const DT: u8, const R: usize, const T: usize>(
            x: &[f32],
            w: &WeightView<'_>,
            o0: usize,
            t0: usize,
            out: *mut f32,
        ) {
            let cols = w.cols;
            let k8 = cols - cols % 8;
            // SAFETY (pointer arithmetic below): rows o0..o0+R and tokens t0..t0+T are in
            // bounds, each has `cols` elements, and every offset used is < cols.
            let wp: [*const u8; R] = std::array::from_fn(|r| {
                // SAFETY: row o0 + r < w.rows starts inside the checked bytes.
                unsafe { w.bytes.as_ptr().add((o0 + r) * k_bytes(DT, cols)) }
            });
            let sm = ScaleMap::of(w);
            let sr: [*const u8; R] = std::array::from_fn(|r| sm.row(o0 + r));
            let xp: [*const f32; T] = std::array::from_fn(|t| {
                // SAFETY: token t0 + t < n starts inside `x` (n * cols elements).
                unsafe { x.as_ptr().add((t0 + t) * cols) }
            });
            let mut acc = [[_mm256_setzero_ps(); T]; R];
            // One 8-element block of every row and token; the same FMA sequence per
            // accumulator whether called from the line loop or the block loop.
            let block = |acc: &mut [[__m256; T]; R], k: usize| {
                // SAFETY: callers pass k + 8 <= cols, so every load is in bounds.
                unsafe {
                    let mut wv = [_mm256_setzero_ps(); R];
                    for r in 0..R {
                        wv[r] = load8q::<DT>(wp[r], k, &sm, sr[r]);
                    }
                    for t in 0..T {
                        let xv = _mm256_loadu_ps(xp[t].add(k));
                        for r in 0..R {
                            acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
                        }
                    }
                }
            };
            prefetched_blocks!(&wp, cols, block8_bytes(DT), k8, |k| block(&mut acc, k));
            for r in 0..R {
                for t in 0..T {
                    let mut s = hsum(acc[r][t]);
                    for kk in k8..cols {
                        let (wv, xv) =
                            // SAFETY: kk < cols; `sr[r]` is the row's scales.
                            unsafe { (load1q::<DT>(wp[r], kk, &sm, sr[r]), *xp[t].add(kk)) };
                        s = wv.mul_add(xv, s);
                    }
                    // SAFETY: (t0+t, o0+r) is within the output and owned by this thread.
                    unsafe { out.add((t0 + t) * w.rows + o0 + r).write(s) };
                }
            }
        }

        /// # Safety
        /// As [`compute_rows`].
        #[target_feature(enable = $features)]
        pub(super) unsafe fn rows<const DT: u8>(
            x: &[f32],
            n: usize,
            w: &WeightView<'_>,
            rows: Range<usize>,
            out: *mut f32,
        ) {
            tile_rows!(tile, $shape, DT, x, n, w, rows, out)
        }
    };
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// Eight weights at `p` as f32 (exact).
    ///
    /// # Safety
    /// `p` valid for 8 elements of `DT`; CPU has AVX2+F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn load8<const DT: u8>(p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees 8 readable elements; loads are unaligned.
        unsafe {
            match DT {
                DT_BF16 => {
                    let h = _mm_loadu_si128(p.cast::<__m128i>());
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
                }
                DT_F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>())),
                _ => _mm256_loadu_ps(p.cast::<f32>()),
            }
        }
    }

    /// Eight weights of code `DT` from element `k` of the row at `row` (its scales
    /// at `srow`), as f32: [`load8`] for a plain weight; FP8 bytes widened exactly
    /// (placed in F16 bit positions, which scales every e4m3 value by 2^-8 exactly,
    /// normals and subnormals alike, then times 2^8; `0x7f`/`0xff` set to NaN) and
    /// multiplied by the block's scale (one rounding); MXFP4 nibbles looked up as
    /// F16 bits (e2m1 values are F16 values) and multiplied by 2^(e - 127) (exact).
    ///
    /// # Safety
    /// `row` a row of a checked view of code `DT`, `srow` its scales, `k + 8 <=
    /// cols`; CPU has AVX2+FMA+F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn load8q<const DT: u8>(
        row: *const u8,
        k: usize,
        sm: &ScaleMap,
        srow: *const u8,
    ) -> __m256 {
        // SAFETY: the caller guarantees the eight elements and their scale.
        unsafe {
            match DT {
                DT_FP8 => {
                    let b = _mm_cvtepu8_epi16(_mm_loadl_epi64(row.add(k).cast::<__m128i>()));
                    let mag = _mm_and_si128(b, _mm_set1_epi16(0x7f));
                    let sign = _mm_slli_epi16::<8>(_mm_and_si128(b, _mm_set1_epi16(0x80)));
                    let h = _mm_or_si128(sign, _mm_slli_epi16::<7>(mag));
                    let v = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0));
                    let nan = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f)));
                    let v = _mm256_blendv_ps(v, _mm256_set1_ps(f32::NAN), _mm256_castsi256_ps(nan));
                    _mm256_mul_ps(v, _mm256_set1_ps(sm.get::<DT>(srow, k)))
                }
                DT_MXFP4 => {
                    let x = row.add(k / 2).cast::<u32>().read_unaligned();
                    let lo = _mm_cvtsi32_si128((x & 0x0f0f_0f0f) as i32);
                    let hi = _mm_cvtsi32_si128(((x >> 4) & 0x0f0f_0f0f) as i32);
                    let idx = _mm_unpacklo_epi8(lo, hi);
                    let table = _mm_loadu_si128(E2M1_F16_HIGH_BYTES.as_ptr().cast::<__m128i>());
                    let high = _mm_shuffle_epi8(table, idx);
                    let h = _mm_unpacklo_epi8(_mm_setzero_si128(), high);
                    _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(sm.get::<DT>(srow, k)))
                }
                _ => load8::<DT>(row.add(k_bytes(DT, k))),
            }
        }
    }

    /// The fixed reduction of the module doc, on a register.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let h = _mm_add_ps(lo, hi); // h[l] = v[l] + v[l+4]
        let q = _mm_add_ps(h, _mm_movehl_ps(h, h)); // q[0] = h0+h2, q[1] = h1+h3
        let s = _mm_add_ss(q, _mm_shuffle_ps::<0b01>(q, q)); // q0 + q1
        _mm_cvtss_f32(s)
    }

    x86_tiles!("avx2,fma,f16c", tile_shape);

    /// # Safety
    /// CPU has AVX2+FMA+F16C; `a.len() == b.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::backend::cpu) unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let cols = a.len();
        let k8 = cols - cols % 8;
        let mut acc = _mm256_setzero_ps();
        let mut k = 0;
        while k < k8 {
            // SAFETY: k + 8 <= len of both slices.
            unsafe {
                let av = _mm256_loadu_ps(a.as_ptr().add(k));
                let bv = _mm256_loadu_ps(b.as_ptr().add(k));
                acc = _mm256_fmadd_ps(av, bv, acc);
            }
            k += 8;
        }
        let mut s = hsum(acc);
        for kk in k8..cols {
            s = a[kk].mul_add(b[kk], s);
        }
        s
    }

    /// # Safety
    /// CPU has AVX2+FMA+F16C; `(scores.len() - 1) * stride + q.len() <= keys.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn attention_scores(
        q: &[f32],
        keys: &[f32],
        stride: usize,
        scale: f32,
        scores: &mut [f32],
    ) {
        let d = q.len();
        let d8 = d - d % 8;
        let n = scores.len();
        let mut j = 0;
        // Eight keys at a time: the query's chunk loaded once for the eight, and the
        // eight sums reduced together by `hsum8x` (each with `hsum`'s additions).
        while j + 8 <= n {
            let mut acc = [_mm256_setzero_ps(); 8];
            let mut k = 0;
            while k < d8 {
                // SAFETY: k + 8 <= d8 <= q.len(); key j + u's floats k..k+8 are within
                // the caller's bound ((n - 1) * stride + d <= keys.len()).
                unsafe {
                    let qv = _mm256_loadu_ps(q.as_ptr().add(k));
                    for (u, a) in acc.iter_mut().enumerate() {
                        let kp = keys.as_ptr().add((j + u) * stride + k);
                        *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp), *a);
                    }
                }
                k += 8;
            }
            // SAFETY: features as the caller's.
            let sums = unsafe { hsum8x(&acc) };
            if d8 == d {
                // SAFETY: j + 8 <= n = scores.len().
                unsafe {
                    let v = _mm256_mul_ps(sums, _mm256_set1_ps(scale));
                    _mm256_storeu_ps(scores.as_mut_ptr().add(j), v);
                }
            } else {
                let mut each = [0f32; 8];
                // SAFETY: eight floats into an array of eight.
                unsafe { _mm256_storeu_ps(each.as_mut_ptr(), sums) };
                for (u, &sum) in each.iter().enumerate() {
                    let key = &keys[(j + u) * stride..(j + u) * stride + d];
                    let mut s = sum;
                    for kk in d8..d {
                        s = q[kk].mul_add(key[kk], s);
                    }
                    scores[j + u] = s * scale;
                }
            }
            j += 8;
        }
        for (jj, s) in scores.iter_mut().enumerate().skip(j) {
            // SAFETY: the caller's bound covers key jj; features as the caller's.
            *s = unsafe { dot_f32(q, keys.get_unchecked(jj * stride..jj * stride + d)) } * scale;
        }
    }

    /// `[hsum(a[0]), ..., hsum(a[7])]`, each lane's sum with exactly `hsum`'s
    /// additions: `h[l] = v[l] + v[l+4]`, then `(h0 + h2) + (h1 + h3)`.
    ///
    /// # Safety
    /// CPU has AVX2.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::backend::cpu) unsafe fn hsum8x(a: &[__m256; 8]) -> __m256 {
        // [x.lo + x.hi | y.lo + y.hi]: the four h of x, then of y.
        let h = |x: __m256, y: __m256| {
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(x, y),
                _mm256_permute2f128_ps::<0x31>(x, y),
            )
        };
        let (h01, h23, h45, h67) = (h(a[0], a[1]), h(a[2], a[3]), h(a[4], a[5]), h(a[6], a[7]));
        // [h0 + h2, h1 + h3] of each: lanes (0, 2 | 1, 3) and (4, 6 | 5, 7).
        let q = |x: __m256, y: __m256| {
            _mm256_add_ps(
                _mm256_shuffle_ps::<0x44>(x, y),
                _mm256_shuffle_ps::<0xEE>(x, y),
            )
        };
        let (q0123, q4567) = (q(h01, h23), q(h45, h67));
        // q0 + q1 of each, lanes in the order 0, 2, 4, 6 | 1, 3, 5, 7.
        let r = _mm256_add_ps(
            _mm256_shuffle_ps::<0x88>(q0123, q4567),
            _mm256_shuffle_ps::<0xDD>(q0123, q4567),
        );
        _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }

    /// `out[i] = fma(p[j], value_j[i], out[i])` for `j` in increasing order, value `j`
    /// at `j * stride`: [`axpy`]'s bits for each term, with up to 64 floats of `out`
    /// held in registers across the values.
    ///
    /// # Safety
    /// CPU has AVX2+FMA+F16C; `(p.len() - 1) * stride + out.len() <= values.len()`
    /// when `p` is not empty.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn weighted_sum_add(
        p: &[f32],
        values: &[f32],
        stride: usize,
        out: &mut [f32],
    ) {
        let d = out.len();
        let d8 = d - d % 8;
        let mut c0 = 0;
        while c0 < d8 {
            let chunks = ((d8 - c0) / 8).min(8);
            // SAFETY: as this function's, for floats c0..c0 + 8 * chunks <= d8.
            unsafe {
                match chunks {
                    8 => wsum_block::<8>(p, values, stride, out, c0),
                    7 => wsum_block::<7>(p, values, stride, out, c0),
                    6 => wsum_block::<6>(p, values, stride, out, c0),
                    5 => wsum_block::<5>(p, values, stride, out, c0),
                    4 => wsum_block::<4>(p, values, stride, out, c0),
                    3 => wsum_block::<3>(p, values, stride, out, c0),
                    2 => wsum_block::<2>(p, values, stride, out, c0),
                    _ => wsum_block::<1>(p, values, stride, out, c0),
                }
            }
            c0 += 8 * chunks;
        }
        for (k, o) in out.iter_mut().enumerate().skip(d8) {
            let mut y = *o;
            for (j, &pj) in p.iter().enumerate() {
                y = pj.mul_add(values[j * stride + k], y);
            }
            *o = y;
        }
    }

    /// [`weighted_sum_add`] for the `C` chunks of eight floats of `out` from `c0`.
    ///
    /// # Safety
    /// As [`weighted_sum_add`], with `c0 + 8 * C <= out.len()`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn wsum_block<const C: usize>(
        p: &[f32],
        values: &[f32],
        stride: usize,
        out: &mut [f32],
        c0: usize,
    ) {
        // SAFETY: floats c0..c0 + 8 * C of `out` and of every value are in bounds
        // (the caller's bound).
        unsafe {
            let o = out.as_mut_ptr().add(c0);
            let mut acc = [_mm256_setzero_ps(); C];
            for (c, a) in acc.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(o.add(8 * c));
            }
            for (j, &pj) in p.iter().enumerate() {
                let av = _mm256_set1_ps(pj);
                let v = values.as_ptr().add(j * stride + c0);
                for (c, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(av, _mm256_loadu_ps(v.add(8 * c)), *a);
                }
            }
            for (c, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.add(8 * c), *a);
            }
        }
    }

    /// # Safety
    /// CPU has AVX2+FMA+F16C; `y.len() == x.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
        let len = y.len();
        let k8 = len - len % 8;
        let av = _mm256_set1_ps(a);
        let mut k = 0;
        while k < k8 {
            // SAFETY: k + 8 <= len of both slices.
            unsafe {
                let yp = y.as_mut_ptr().add(k);
                let xv = _mm256_loadu_ps(x.as_ptr().add(k));
                _mm256_storeu_ps(yp, _mm256_fmadd_ps(av, xv, _mm256_loadu_ps(yp)));
            }
            k += 8;
        }
        for kk in k8..len {
            y[kk] = a.mul_add(x[kk], y[kk]);
        }
    }
}

/// The matrix product's tiles with AVX-512: rows in pairs, one 512-bit register
/// holding two elements' eight-lane accumulators (row `r`'s lanes in its low half,
/// row `r + 1`'s in its high half, one token), the token's eight activations
/// broadcast to both halves. Each half is the AVX2 kernel's accumulator, lane for
/// lane, so every element keeps the module doc's order (and the other paths' bits),
/// with half the multiply-add instructions; an odd last row takes a 256-bit
/// accumulator as in AVX2. Tiles of [`wide_tile_shape`]: 4 rows x 6 tokens take 12
/// accumulators, 2 weight and 2 activation registers of the 32.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::avx2::{hsum, load8q};
    use super::*;
    use std::arch::x86_64::*;

    /// `lo` in the low half, `hi` in the high half.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
    fn pair(lo: __m256, hi: __m256) -> __m512 {
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castpd256_pd512(_mm256_castps_pd(lo)),
            _mm256_castps_pd(hi),
        ))
    }

    /// The high half.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
    fn high(v: __m512) -> __m256 {
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
    }

    /// One tile: rows `o0..o0+R` x tokens `t0..t0+T`.
    ///
    /// # Safety
    /// As [`compute_rows`], with `o0 + R <= w.rows` and `t0 + T <= n`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
    unsafe fn tile<const DT: u8, const R: usize, const T: usize>(
        x: &[f32],
        w: &WeightView<'_>,
        o0: usize,
        t0: usize,
        out: *mut f32,
    ) {
        let cols = w.cols;
        let k8 = cols - cols % 8;
        let (pairs, odd) = (R / 2, R % 2 == 1);
        // SAFETY (pointer arithmetic below): rows o0..o0+R and tokens t0..t0+T are in
        // bounds, each has `cols` elements, and every offset used is < cols.
        let wp: [*const u8; R] = std::array::from_fn(|r| {
            // SAFETY: row o0 + r < w.rows starts inside the checked bytes.
            unsafe { w.bytes.as_ptr().add((o0 + r) * k_bytes(DT, cols)) }
        });
        let sm = ScaleMap::of(w);
        let sr: [*const u8; R] = std::array::from_fn(|r| sm.row(o0 + r));
        let xp: [*const f32; T] = std::array::from_fn(|t| {
            // SAFETY: token t0 + t < n starts inside `x` (n * cols elements).
            unsafe { x.as_ptr().add((t0 + t) * cols) }
        });
        // Rows 2p and 2p+1 in acc2[p] (only `pairs` of the R used); the odd row in
        // acc1.
        let mut acc2 = [[_mm512_setzero_ps(); T]; R];
        let mut acc1 = [_mm256_setzero_ps(); T];
        let block = |acc2: &mut [[__m512; T]; R], acc1: &mut [__m256; T], k: usize| {
            // SAFETY: callers pass k + 8 <= cols, so every load is in bounds.
            unsafe {
                let mut wv = [_mm512_setzero_ps(); R];
                for p in 0..pairs {
                    wv[p] = pair(
                        load8q::<DT>(wp[2 * p], k, &sm, sr[2 * p]),
                        load8q::<DT>(wp[2 * p + 1], k, &sm, sr[2 * p + 1]),
                    );
                }
                let w1 = if odd {
                    load8q::<DT>(wp[R - 1], k, &sm, sr[R - 1])
                } else {
                    _mm256_setzero_ps()
                };
                for t in 0..T {
                    let xv = _mm256_loadu_ps(xp[t].add(k));
                    let xx = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(xv)));
                    for p in 0..pairs {
                        acc2[p][t] = _mm512_fmadd_ps(wv[p], xx, acc2[p][t]);
                    }
                    if odd {
                        acc1[t] = _mm256_fmadd_ps(w1, xv, acc1[t]);
                    }
                }
            }
        };
        prefetched_blocks!(&wp, cols, block8_bytes(DT), k8, |k| block(
            &mut acc2, &mut acc1, k
        ));
        for r in 0..R {
            for t in 0..T {
                let lanes = if r / 2 < pairs {
                    let a = acc2[r / 2][t];
                    if r % 2 == 0 {
                        _mm512_castps512_ps256(a)
                    } else {
                        high(a)
                    }
                } else {
                    acc1[t]
                };
                let mut s = hsum(lanes);
                for kk in k8..cols {
                    // SAFETY: kk < cols; `sr[r]` is the row's scales.
                    let (wv, xv) = unsafe { (load1q::<DT>(wp[r], kk, &sm, sr[r]), *xp[t].add(kk)) };
                    s = wv.mul_add(xv, s);
                }
                // SAFETY: (t0+t, o0+r) is within the output and owned by this thread.
                unsafe { out.add((t0 + t) * w.rows + o0 + r).write(s) };
            }
        }
    }

    /// # Safety
    /// As [`compute_rows`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
    pub(super) unsafe fn rows<const DT: u8>(
        x: &[f32],
        n: usize,
        w: &WeightView<'_>,
        rows: Range<usize>,
        out: *mut f32,
    ) {
        if packs(DT, n) {
            // SAFETY: forwarded contract; this CPU has AVX-512 (the caller's).
            return unsafe { super::packed::rows::<DT>(x, n, w, rows, out) };
        }
        if DT == DT_MXFP4 {
            // SAFETY: forwarded contract; the view is MXFP4 (DT).
            return unsafe { super::mxfp4::rows(x, n, w, rows, out) };
        }
        if DT == DT_FP8 {
            // SAFETY: forwarded contract; the view is FP8 (DT).
            return unsafe { super::fp8::rows(x, n, w, rows, out) };
        }
        tile_rows!(tile, wide_tile_shape, DT, x, n, w, rows, out)
    }
}

#[cfg(test)]
#[path = "matmul_quant_tests.rs"]
mod quant_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Independent exact decoding of one weight element (not the kernels' code).
    fn decode(dtype: DType, b: &[u8], i: usize) -> f32 {
        match dtype {
            DType::BF16 => {
                f32::from_bits(u32::from(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])) << 16)
            }
            DType::F16 => {
                let h = u16::from_le_bytes([b[2 * i], b[2 * i + 1]]);
                let sign = if h & 0x8000 != 0 { -1.0f64 } else { 1.0 };
                let e = i32::from((h >> 10) & 0x1f);
                let m = f64::from(h & 0x3ff);
                let v = match e {
                    0 => m * 2f64.powi(-24),
                    31 if m == 0.0 => f64::INFINITY,
                    31 => f64::NAN,
                    _ => (1.0 + m / 1024.0) * 2f64.powi(e - 15),
                };
                (sign * v) as f32
            }
            DType::F32 => f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap()),
            _ => unreachable!(),
        }
    }

    /// The specified order, written directly from the module doc.
    fn spec_dot(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
        let cols = x.len();
        let k8 = cols / 8 * 8;
        let mut acc = [0.0f32; 8];
        for k in 0..k8 {
            acc[k % 8] = decode(dtype, row, k).mul_add(x[k], acc[k % 8]);
        }
        let h: Vec<f32> = (0..4).map(|l| acc[l] + acc[l + 4]).collect();
        let mut s = (h[0] + h[2]) + (h[1] + h[3]);
        for (k, &xk) in x.iter().enumerate().skip(k8) {
            s = decode(dtype, row, k).mul_add(xk, s);
        }
        s
    }

    fn spec_matmul(x: &[f32], n: usize, w: &WeightView<'_>) -> Vec<f32> {
        let row = w.cols * w.dtype().size();
        let mut out = vec![0.0; n * w.rows];
        for t in 0..n {
            for o in 0..w.rows {
                out[t * w.rows + o] = spec_dot(
                    w.dtype(),
                    &w.bytes[o * row..(o + 1) * row],
                    &x[t * w.cols..(t + 1) * w.cols],
                );
            }
        }
        out
    }

    /// Random finite weights spanning many exponents, with zeros and subnormals.
    fn random_weights(rng: &mut ChaCha8Rng, dtype: DType, len: usize) -> Vec<u8> {
        let mut b = Vec::with_capacity(len * dtype.size());
        for _ in 0..len {
            let sign = if rng.gen::<bool>() { -1.0f32 } else { 1.0 };
            let v = match rng.gen_range(0..20) {
                0 => 0.0,
                1 => f32::MIN_POSITIVE * rng.gen::<f32>(),
                _ => rng.gen::<f32>() * 2f32.powi(rng.gen_range(-20..4)),
            } * sign;
            match dtype {
                DType::BF16 => {
                    b.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes())
                }
                DType::F16 => {
                    // Random bits cover F16 subnormals and the whole finite range.
                    let mut h: u16 = rng.gen();
                    if (h >> 10) & 0x1f == 0x1f {
                        h &= !0x4000;
                    }
                    b.extend_from_slice(&h.to_le_bytes());
                }
                _ => b.extend_from_slice(&v.to_le_bytes()),
            }
        }
        b
    }

    fn random_x(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.gen_range(-2.0f32..2.0)).collect()
    }

    fn isas() -> Vec<Isa> {
        Isa::available()
    }

    const DTYPES: [DType; 3] = [DType::BF16, DType::F16, DType::F32];

    /// NEON is every aarch64 CPU's, and it is what runs there (the tests under
    /// `qemu-aarch64` compare it with the portable path).
    #[test]
    #[cfg(target_arch = "aarch64")]
    fn neon_is_detected_on_aarch64() {
        assert_eq!(Isa::detect(), Isa::Neon);
        assert_eq!(Isa::available(), vec![Isa::Neon, Isa::Portable]);
    }

    /// Close to an f64 reference: the error bound of a chain of `cols/8 + 11`
    /// roundings relative to Σ|w·x|, plus subnormal slack.
    #[test]
    fn matches_f64_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let pool = ThreadPool::new(2).unwrap();
        for dtype in DTYPES {
            for &(rows, cols) in &[(5, 1), (7, 8), (9, 37), (33, 300), (16, 576), (3, 2051)] {
                let wb = random_weights(&mut rng, dtype, rows * cols);
                let w = WeightView::new(dtype, rows, cols, &wb).unwrap();
                let n = 3;
                let x = random_x(&mut rng, n * cols);
                for isa in isas() {
                    let mut out = vec![f32::NAN; n * rows];
                    matmul_isa(isa, &pool, &x, n, w, &mut out).unwrap();
                    for t in 0..n {
                        for o in 0..rows {
                            let (mut exact, mut mag) = (0.0f64, 0.0f64);
                            for k in 0..cols {
                                let p = f64::from(decode(dtype, &wb[o * cols * dtype.size()..], k))
                                    * f64::from(x[t * cols + k]);
                                exact += p;
                                mag += p.abs();
                            }
                            let bound = (cols / 8 + 11) as f64 * f64::from(f32::EPSILON) * mag
                                + cols as f64 * f64::from(f32::MIN_POSITIVE);
                            let got = f64::from(out[t * rows + o]);
                            assert!(
                                (got - exact).abs() <= bound,
                                "{dtype} {rows}x{cols} {isa:?} t{t} o{o}: {got} vs {exact} (bound {bound})"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Batch invariance: every element has the spec's bits whatever n (1..=17), the
    /// thread count (1, 2, 3), the instruction set, and the rows computed with it.
    /// Shapes cover tails (cols % 8 != 0), partial cache-line steps, edge tiles,
    /// both prefetch modes (short and long rows) and the parallel path.
    #[test]
    fn bits_independent_of_batch_threads_isa_and_rows() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let pools: Vec<ThreadPool> = (1..=3).map(|t| ThreadPool::new(t).unwrap()).collect();
        let mut shapes = vec![
            (1, 0),
            (1, 1),
            (4, 8),
            (3, 7),
            (5, 9),
            (67, 517),
            (130, 300),
            (8, 1031),
            (6, 2500),
            (13, 64),
        ];
        for _ in 0..14 {
            shapes.push((rng.gen_range(1..40), rng.gen_range(1..200)));
        }
        for dtype in DTYPES {
            for &(rows, cols) in &shapes {
                let wb = random_weights(&mut rng, dtype, rows * cols);
                let w = WeightView::new(dtype, rows, cols, &wb).unwrap();
                let x = random_x(&mut rng, 17 * cols);
                let want = spec_matmul(&x, 17, &w);
                for n in 1..=17 {
                    // Tokens are taken from different offsets so each n sees new rows.
                    let t0 = (n * 5) % (18 - n);
                    let xs = &x[t0 * cols..(t0 + n) * cols];
                    let want_n = &want[t0 * rows..(t0 + n) * rows];
                    for isa in isas() {
                        for pool in &pools {
                            let mut out = vec![f32::NAN; n * rows];
                            matmul_isa(isa, pool, xs, n, w, &mut out).unwrap();
                            for (i, (g, e)) in out.iter().zip(want_n).enumerate() {
                                assert_eq!(
                                    g.to_bits(),
                                    e.to_bits(),
                                    "{dtype} {rows}x{cols} n={n} {isa:?} threads={} elem {i}",
                                    pool.threads()
                                );
                            }
                        }
                    }
                }
                // A sub-range of rows computes the same bits as inside the full matrix.
                let a = rng.gen_range(0..rows);
                let b = rng.gen_range(a + 1..=rows);
                let sub = w.slice_rows(a..b);
                let n = 5;
                let mut out = vec![0.0; n * (b - a)];
                matmul(&pools[1], &x[..n * cols], n, sub, &mut out).unwrap();
                for t in 0..n {
                    for o in a..b {
                        assert_eq!(
                            out[t * (b - a) + o - a].to_bits(),
                            want[t * rows + o].to_bits()
                        );
                    }
                }
            }
        }
    }

    /// Many tokens (AVX-512 packs the weights from `PACKED_MIN_TOKENS`): panels of
    /// sixteen rows cut short, column blocks with carried accumulators, tails, token
    /// groups cut short, and thread chunks, all with the bits of the order.
    #[test]
    fn many_tokens_have_the_bits_of_the_order() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let pools: Vec<ThreadPool> = (1..=3).map(|t| ThreadPool::new(t).unwrap()).collect();
        let shapes = [
            (1, 9),
            (16, 16),
            (17, 263),
            (40, 520),
            (33, 1031),
            (70, 96),
            (83, 300),
        ];
        let ns = [
            PACKED_MIN_TOKENS - 1,
            PACKED_MIN_TOKENS,
            PACKED_MIN_TOKENS + 1,
            PACKED_MIN_TOKENS + 2,
            100,
        ];
        let most = ns.iter().copied().max().unwrap();
        for dtype in DTYPES {
            for &(rows, cols) in &shapes {
                let wb = random_weights(&mut rng, dtype, rows * cols);
                let w = WeightView::new(dtype, rows, cols, &wb).unwrap();
                let x = random_x(&mut rng, most * cols);
                let want = spec_matmul(&x, most, &w);
                for &n in &ns {
                    for isa in isas() {
                        for pool in &pools {
                            let mut out = vec![f32::NAN; n * rows];
                            matmul_isa(isa, pool, &x[..n * cols], n, w, &mut out).unwrap();
                            for (i, (g, e)) in out.iter().zip(&want).enumerate() {
                                assert_eq!(
                                    g.to_bits(),
                                    e.to_bits(),
                                    "{dtype} {rows}x{cols} n={n} {isa:?} threads={} elem {i}",
                                    pool.threads()
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// Infinite and NaN weights propagate as IEEE arithmetic says, on every path.
    #[test]
    fn non_finite_weights_propagate() {
        let pool = ThreadPool::single();
        for dtype in DTYPES {
            let (inf, nan): (Vec<u8>, Vec<u8>) = match dtype {
                DType::BF16 => (
                    0x7f80u16.to_le_bytes().into(),
                    0x7fc0u16.to_le_bytes().into(),
                ),
                DType::F16 => (
                    0x7c00u16.to_le_bytes().into(),
                    0x7e00u16.to_le_bytes().into(),
                ),
                _ => (
                    f32::INFINITY.to_le_bytes().into(),
                    f32::NAN.to_le_bytes().into(),
                ),
            };
            let cols = 19;
            let one = random_weights(&mut ChaCha8Rng::seed_from_u64(3), dtype, 1);
            for pos in [0, 5, 17] {
                let mut wb = Vec::new();
                for row in 0..2 {
                    for k in 0..cols {
                        wb.extend_from_slice(match (row, k == pos) {
                            (0, true) => &inf,
                            (1, true) => &nan,
                            _ => &one,
                        });
                    }
                }
                let w = WeightView::new(dtype, 2, cols, &wb).unwrap();
                let x = vec![1.0f32; cols];
                for isa in isas() {
                    let mut out = vec![0.0; 2];
                    matmul_isa(isa, &pool, &x, 1, w, &mut out).unwrap();
                    assert_eq!(out[0], f32::INFINITY, "{dtype} {isa:?} pos {pos}");
                    assert!(out[1].is_nan(), "{dtype} {isa:?} pos {pos}");
                }
            }
        }
    }

    #[test]
    fn bad_shapes_are_typed_errors() {
        let pool = ThreadPool::single();
        let b = vec![0u8; 24];
        assert_eq!(
            WeightView::new(DType::I32, 2, 3, &b).unwrap_err(),
            KernelError::UnsupportedDType(DType::I32)
        );
        assert!(matches!(
            WeightView::new(DType::BF16, 2, 3, &b),
            Err(KernelError::WeightLen {
                expected: 12,
                actual: 24,
                ..
            })
        ));
        assert!(matches!(
            WeightView::new(DType::F32, usize::MAX / 2, 3, &b),
            Err(KernelError::ShapeOverflow { .. })
        ));
        let w = WeightView::new(DType::F32, 2, 3, &b).unwrap();
        let mut out = vec![0.0; 4];
        assert!(matches!(
            matmul(&pool, &[0.0; 5], 2, w, &mut out),
            Err(KernelError::ActivationLen {
                what: "x",
                expected: 6,
                actual: 5,
                ..
            })
        ));
        assert!(matches!(
            matmul(&pool, &[0.0; 6], 2, w, &mut out[..3]),
            Err(KernelError::ActivationLen {
                what: "out",
                expected: 4,
                actual: 3,
                ..
            })
        ));
        // A view built from its public fields with a wrong length is caught too.
        let bad = WeightView {
            lease: None,
            format: crate::backend::view::WeightFormat::Plain(DType::F32),
            rows: 3,
            cols: 3,
            bytes: &b,
        };
        assert!(matches!(
            matmul(&pool, &[0.0; 6], 2, bad, &mut [0.0; 6]),
            Err(KernelError::WeightLen {
                expected: 36,
                actual: 24,
                ..
            })
        ));
        assert!(matches!(
            matmul(&pool, &[0.0; 6], usize::MAX / 2, w, &mut out),
            Err(KernelError::ActivationLen { what: "x", .. })
        ));
        // Empty calls are fine.
        matmul(&pool, &[], 0, w, &mut []).unwrap();
    }

    #[test]
    fn attention_kernels_have_dot_and_axpy_bits() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for d in [8usize, 13, 64, 72, 130, 576] {
            let stride = d + 5;
            let n = 19;
            let q: Vec<f32> = (0..d).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let kv: Vec<f32> = (0..n * stride).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let mut s = vec![0f32; n];
            attention_scores(&q, &kv, stride, 0.125, &mut s);
            for j in 0..n {
                assert_eq!(
                    s[j].to_bits(),
                    (dot_f32(&q, &kv[j * stride..j * stride + d]) * 0.125).to_bits()
                );
            }
            let mut out = vec![1f32; d];
            weighted_sum(&s, &kv, stride, &mut out);

            let mut want = vec![0f32; d];
            for j in 0..n {
                axpy(&mut want, s[j], &kv[j * stride..j * stride + d]);
            }
            assert_eq!(
                out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn dot_f32_is_the_kernel_order_and_axpy_is_fused() {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        for len in [0usize, 1, 7, 8, 9, 64, 100, 128, 1001] {
            let a = random_x(&mut rng, len);
            let b = random_x(&mut rng, len);
            let bytes: Vec<u8> = a.iter().flat_map(|v| v.to_le_bytes()).collect();
            let want = spec_dot(DType::F32, &bytes, &b);
            assert_eq!(dot_f32(&a, &b).to_bits(), want.to_bits(), "len {len}");
            assert_eq!(
                portable::dot_f32(&a, &b).to_bits(),
                want.to_bits(),
                "len {len}"
            );

            let alpha = rng.gen_range(-3.0f32..3.0);
            let mut y = b.clone();
            axpy(&mut y, alpha, &a);
            for i in 0..len {
                assert_eq!(y[i].to_bits(), alpha.mul_add(a[i], b[i]).to_bits());
            }
        }
    }
}
