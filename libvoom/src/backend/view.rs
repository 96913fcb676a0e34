//! Weights as every backend sees them: typed, shaped views of a page's bytes, read
//! in place (never copied to the heap first). A backend that computes elsewhere (a
//! GPU sharing unified memory) wraps the same bytes.

use std::ops::Range;

use voom_formats::dtype::read_f32;
use voom_formats::gguf::{dequantize_into, dequantizes, GgmlType};
use voom_formats::DType;
use vpaged::PageLease;

use super::KernelError;

/// How a weight matrix's elements are stored (and, for the block-scaled formats,
/// where their scales are). Every format reads as f32 exactly as its definition
/// says ([`WeightView::get`] is the scalar specification the kernels follow).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum WeightFormat<'a> {
    /// One BF16, F16 or F32 element each (little-endian), widened exactly.
    Plain(DType),
    /// FP8 e4m3 (one byte each, OCP "FN": no infinities, `0x7f`/`0xff` NaN), one
    /// scale per block of rows x columns: an element reads as its e4m3 value times
    /// its block's scale, rounded once to f32 (DeepSeek-V3's and Qwen3-FP8's
    /// `weight` with `weight_scale_inv`).
    Fp8(BlockScales<'a>),
    /// MXFP4: two e2m1 elements a byte, the low nibble first; each 32 elements of a
    /// row share one e8m0 scale byte (`scales`, `rows x cols/32`). An element reads
    /// as its e2m1 value times 2^(scale - 127), exactly (gpt-oss's `*_blocks` with
    /// `*_scales`).
    Mxfp4 { scales: &'a [u8] },
    /// A ggml block format (GGUF's Q4_K, Q8_0, ...), blocks as ggml stores them:
    /// each row is `cols / block` whole blocks of the type, scales inside. An
    /// element reads as ggml's reference dequantization computes it
    /// ([`voom_formats::gguf::dequantize`], bit for bit); lossy models only.
    Ggml(GgmlType),
}

impl WeightFormat<'_> {
    /// The dtype the weight's own bytes are stored as: the plain dtype, `F8E4M3`,
    /// or `U8` (MXFP4's packed pairs).
    pub fn dtype(&self) -> DType {
        match self {
            WeightFormat::Plain(d) => *d,
            WeightFormat::Fp8(_) => DType::F8E4M3,
            WeightFormat::Mxfp4 { .. } | WeightFormat::Ggml(_) => DType::U8,
        }
    }

    /// Bytes of a `rows x cols` weight's own elements (not its scales; a ggml
    /// type's rows of whole blocks, the last one counted whole), `None` on
    /// overflow.
    pub fn bytes_for(&self, rows: usize, cols: usize) -> Option<usize> {
        let n = rows.checked_mul(cols)?;
        match self {
            WeightFormat::Plain(d) => n.checked_mul(d.size()),
            WeightFormat::Fp8(_) => Some(n),
            WeightFormat::Mxfp4 { .. } => Some(n / 2),
            WeightFormat::Ggml(t) => {
                let (block, bytes) = ggml_block(*t);
                rows.checked_mul(cols.div_ceil(block).checked_mul(bytes)?)
            }
        }
    }

    /// Its name in messages and listings: `BF16`, `FP8 e4m3 128x128`, `MXFP4`.
    pub fn describe(&self) -> String {
        match self {
            WeightFormat::Plain(d) => d.to_string(),
            WeightFormat::Fp8(s) => format!("FP8 e4m3 {}x{}", s.block_rows, s.block_cols),
            WeightFormat::Mxfp4 { .. } => "MXFP4".into(),
            WeightFormat::Ggml(t) => format!("ggml {}", t.name()),
        }
    }
}

/// Elements in the largest ggml block (the k-quants' 256).
pub const GGML_MAX_BLOCK: usize = 256;

/// `(elements, bytes)` of a block of ggml type `t`, as `usize`.
pub fn ggml_block(t: GgmlType) -> (usize, usize) {
    let (n, b) = t.block();
    (n as usize, b as usize)
}

/// The scales of an FP8 weight: one per block of `block_rows x block_cols`, stored
/// row-major over the blocks, edge blocks partial (DeepSeek-V3's 576-row
/// `kv_a_proj_with_mqa` has five block rows of 128).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockScales<'a> {
    /// F32 or BF16 (little-endian).
    pub dtype: DType,
    pub block_rows: usize,
    /// A power of two, at least 8 (every eight-element block of the kernels lies in
    /// one scale block).
    pub block_cols: usize,
    /// The view's row 0 is this row of the first block row of `bytes`: a view of
    /// some rows of a weight ([`WeightView::slice_rows`]) keeps its rows' scales.
    pub row0: usize,
    /// `ceil((row0 + rows) / block_rows) x ceil(cols / block_cols)` scales.
    pub bytes: &'a [u8],
}

impl BlockScales<'_> {
    /// Block columns of a weight of `cols` columns.
    pub fn blocks_per_row(&self, cols: usize) -> usize {
        cols.div_ceil(self.block_cols.max(1))
    }

    /// The scale of element (`r`, `k`) of the view, as f32 (exact: F32, or BF16
    /// widened). The caller checked the view.
    #[inline]
    pub fn get(&self, cols: usize, r: usize, k: usize) -> f32 {
        let i =
            ((self.row0 + r) / self.block_rows) * self.blocks_per_row(cols) + k / self.block_cols;
        read_f32(self.dtype, self.bytes, i)
    }
}

/// The e4m3 (FN) value of byte `b`, exactly: sign, four exponent bits biased by 7,
/// three mantissa bits; exponent 0 subnormal (`m x 2^-9`); `0x7f`/`0xff` NaN.
#[inline]
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = i32::from((b >> 3) & 0xf);
    let m = f32::from(b & 7);
    if b & 0x7f == 0x7f {
        f32::NAN
    } else if e == 0 {
        sign * m * (2.0f32).powi(-9)
    } else {
        sign * (1.0 + m / 8.0) * (2.0f32).powi(e - 7)
    }
}

/// The e2m1 values of the sixteen nibbles: sign, two exponent bits biased by 1, one
/// mantissa bit (`0b0001` the subnormal 0.5).
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// 2^(e - 127) for an e8m0 scale byte, exactly (`e` 0 is the subnormal 2^-127);
/// 255 is NaN.
#[inline]
pub fn e8m0_to_f32(e: u8) -> f32 {
    match e {
        0 => f32::from_bits(0x0040_0000),
        255 => f32::NAN,
        e => f32::from_bits(u32::from(e) << 23),
    }
}

/// A row-major weight matrix `[rows = out features, cols = in features]` viewed in
/// place. [`WeightView::new`] checks the invariants; every backend op checks them
/// again, so a view built from its public fields can never cause an out-of-bounds
/// read.
#[derive(Clone, Copy, Debug)]
pub struct WeightView<'a> {
    /// How the elements are stored: BF16, F16 or F32, or a block-scaled format.
    pub format: WeightFormat<'a>,
    pub rows: usize,
    pub cols: usize,
    /// Exactly [`WeightFormat::bytes_for`] `(rows, cols)` bytes; no alignment is
    /// required.
    pub bytes: &'a [u8],
    /// The lease `bytes` lie in, where they are a page's: a backend that reads them
    /// after the op returns (MLX's lazy graph) keeps a clone of it until it has
    /// ([`WeightView::kept_by`]). `None`: the bytes are only the call's to read.
    pub lease: Option<&'a PageLease>,
}

impl<'a> WeightView<'a> {
    /// A checked view of a plain matrix: `dtype` is BF16/F16/F32 and
    /// `bytes.len() == rows*cols*size`.
    pub fn new(
        dtype: DType,
        rows: usize,
        cols: usize,
        bytes: &'a [u8],
    ) -> Result<Self, KernelError> {
        Self::of(WeightFormat::Plain(dtype), rows, cols, bytes)
    }

    /// A checked view of a matrix stored in `format`.
    pub fn of(
        format: WeightFormat<'a>,
        rows: usize,
        cols: usize,
        bytes: &'a [u8],
    ) -> Result<Self, KernelError> {
        let w = WeightView {
            format,
            rows,
            cols,
            bytes,
            lease: None,
        };
        w.check()?;
        Ok(w)
    }

    /// The dtype of the weight's own bytes ([`WeightFormat::dtype`]).
    pub fn dtype(&self) -> DType {
        self.format.dtype()
    }

    /// Element (`r`, `k`) as f32, as its format defines it: the scalar
    /// specification every kernel computes the same value as.
    ///
    /// # Panics
    /// If the view does not pass [`WeightView::check`] or (`r`, `k`) is outside it.
    pub fn get(&self, r: usize, k: usize) -> f32 {
        assert!(r < self.rows && k < self.cols);
        let i = r * self.cols + k;
        match self.format {
            WeightFormat::Plain(d) => read_f32(d, self.bytes, i),
            WeightFormat::Fp8(s) => e4m3_to_f32(self.bytes[i]) * s.get(self.cols, r, k),
            WeightFormat::Mxfp4 { scales } => {
                let b = self.bytes[i / 2];
                let nib = if i.is_multiple_of(2) { b & 0xf } else { b >> 4 };
                E2M1[nib as usize] * e8m0_to_f32(scales[i / 32])
            }
            WeightFormat::Ggml(t) => {
                let (block, bytes) = ggml_block(t);
                let row = self.format.bytes_for(1, self.cols).expect("a checked view");
                let at = r * row + k / block * bytes;
                let mut v = [0f32; GGML_MAX_BLOCK];
                dequantize_into(t, &self.bytes[at..at + bytes], &mut v[..block])
                    .expect("a checked view's type dequantizes");
                v[k % block]
            }
        }
    }

    /// Row `r` widened to f32 in `out` (`cols` floats), each element exactly
    /// [`WeightView::get`]'s value.
    ///
    /// # Panics
    /// If `r >= rows`, `out` is not `cols` long, or the view does not pass
    /// [`WeightView::check`].
    pub fn read_row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows && out.len() == self.cols);
        match self.format {
            WeightFormat::Ggml(t) => {
                let row = self.format.bytes_for(1, self.cols).expect("a checked view");
                dequantize_into(t, &self.bytes[r * row..(r + 1) * row], out)
                    .expect("a checked view's type dequantizes");
            }
            WeightFormat::Plain(d) => {
                for (k, o) in out.iter_mut().enumerate() {
                    *o = read_f32(d, self.bytes, r * self.cols + k);
                }
            }
            _ => {
                for (k, o) in out.iter_mut().enumerate() {
                    *o = self.get(r, k);
                }
            }
        }
    }

    /// This view with `lease` named as the one keeping its bytes alive.
    pub fn leased(self, lease: &'a PageLease) -> Self {
        WeightView {
            lease: Some(lease),
            ..self
        }
    }

    /// The lease keeping the bytes alive, when one is named and its bytes hold the
    /// view's (a lease named for other bytes is ignored: keeping it would not keep
    /// these).
    pub fn kept_by(&self) -> Option<&'a PageLease> {
        let lease = self.lease?;
        let page = lease.bytes().as_ptr_range();
        let own = self.bytes.as_ptr_range();
        (page.start <= own.start && own.end <= page.end).then_some(lease)
    }

    /// Re-checks the invariants of a view (its fields are public).
    pub fn check(&self) -> Result<(), KernelError> {
        let dtype = self.dtype();
        let overflow = || KernelError::ShapeOverflow {
            rows: self.rows,
            cols: self.cols,
            dtype,
        };
        let expected = self
            .format
            .bytes_for(self.rows, self.cols)
            .ok_or_else(overflow)?;
        let scales = |expected: usize, actual: usize| KernelError::ScalesLen {
            rows: self.rows,
            cols: self.cols,
            format: self.format.describe(),
            expected,
            actual,
        };
        match self.format {
            WeightFormat::Plain(d) => check_dtype(d)?,
            WeightFormat::Fp8(s) => {
                if !matches!(s.dtype, DType::F32 | DType::BF16) {
                    return Err(KernelError::UnsupportedDType(s.dtype));
                }
                if s.block_rows == 0
                    || s.block_cols < 8
                    || !s.block_cols.is_power_of_two()
                    || s.row0 >= s.block_rows
                {
                    return Err(KernelError::BlockShape {
                        block_rows: s.block_rows,
                        block_cols: s.block_cols,
                        row0: s.row0,
                    });
                }
                let n = (s.row0 + self.rows)
                    .div_ceil(s.block_rows)
                    .checked_mul(s.blocks_per_row(self.cols))
                    .and_then(|n| n.checked_mul(s.dtype.size()))
                    .ok_or_else(overflow)?;
                if s.bytes.len() != n {
                    return Err(scales(n, s.bytes.len()));
                }
            }
            WeightFormat::Ggml(t) => {
                if !dequantizes(t) {
                    return Err(KernelError::UnsupportedFormat(self.format.describe()));
                }
                let (block, _) = ggml_block(t);
                if !self.cols.is_multiple_of(block) {
                    return Err(KernelError::PartialBlock {
                        cols: self.cols,
                        format: self.format.describe(),
                        block,
                    });
                }
            }
            WeightFormat::Mxfp4 { scales: sc } => {
                if !self.cols.is_multiple_of(32) {
                    return Err(KernelError::BlockShape {
                        block_rows: 1,
                        block_cols: 32,
                        row0: 0,
                    });
                }
                let n = self.rows * (self.cols / 32);
                if sc.len() != n {
                    return Err(scales(n, sc.len()));
                }
            }
        }
        if self.bytes.len() != expected {
            return Err(KernelError::WeightLen {
                rows: self.rows,
                cols: self.cols,
                dtype,
                expected,
                actual: self.bytes.len(),
            });
        }
        Ok(())
    }

    /// Rows `range` of this matrix, as a view of the same bytes (and of the scales
    /// of those rows).
    ///
    /// # Panics
    /// If `range` is not within `0..rows` (a caller bug, not bad input), or the view
    /// does not pass [`WeightView::check`].
    pub fn slice_rows(&self, range: Range<usize>) -> WeightView<'a> {
        assert!(range.start <= range.end && range.end <= self.rows);
        let row = self.format.bytes_for(1, self.cols).expect("a checked view");
        let format = match self.format {
            WeightFormat::Plain(d) => WeightFormat::Plain(d),
            WeightFormat::Fp8(s) => {
                let first = s.row0 + range.start;
                let last = (s.row0 + range.end).div_ceil(s.block_rows);
                let per = s.blocks_per_row(self.cols) * s.dtype.size();
                let from = (first / s.block_rows).min(last);
                WeightFormat::Fp8(BlockScales {
                    row0: first % s.block_rows,
                    bytes: &s.bytes[from * per..last * per],
                    ..s
                })
            }
            WeightFormat::Mxfp4 { scales } => {
                let per = self.cols / 32;
                WeightFormat::Mxfp4 {
                    scales: &scales[range.start * per..range.end * per],
                }
            }
            WeightFormat::Ggml(t) => WeightFormat::Ggml(t),
        };
        WeightView {
            format,
            rows: range.len(),
            cols: self.cols,
            bytes: &self.bytes[range.start * row..range.end * row],
            lease: self.lease,
        }
    }

    /// Row `r` as a vector view.
    ///
    /// # Panics
    /// If `r >= rows` (a caller bug), or the weight is not plain (its rows are not
    /// vectors of a dtype: read them with [`WeightView::get`]).
    pub fn row(&self, r: usize) -> VecView<'a> {
        let WeightFormat::Plain(dtype) = self.format else {
            panic!("row of a {} weight", self.format.describe());
        };
        let v = self.slice_rows(r..r + 1);
        VecView {
            dtype,
            bytes: v.bytes,
            plus_one: false,
        }
    }
}

/// A table of `rows` rows (an embedding) as some of the parts it is stored in:
/// `parts[i] = (first, view)` holds rows `first..first + view.rows`. A table stored
/// whole is one part from row 0; a table leased part by part passes the parts it
/// holds. Parts do not overlap; every part has the table's columns.
#[derive(Clone, Debug)]
pub struct TableView<'a> {
    pub rows: usize,
    pub cols: usize,
    pub parts: Vec<(usize, WeightView<'a>)>,
}

impl<'a> TableView<'a> {
    /// A table stored whole.
    pub fn whole(w: WeightView<'a>) -> Self {
        TableView {
            rows: w.rows,
            cols: w.cols,
            parts: vec![(0, w)],
        }
    }

    /// Checks every part's view, that each has the table's columns and lies inside
    /// the table.
    pub fn check(&self) -> Result<(), KernelError> {
        for (first, w) in &self.parts {
            w.check()?;
            if w.cols != self.cols || first.checked_add(w.rows).is_none_or(|e| e > self.rows) {
                return Err(KernelError::TablePart {
                    first: *first,
                    rows: w.rows,
                    cols: w.cols,
                    table_rows: self.rows,
                    table_cols: self.cols,
                });
            }
        }
        Ok(())
    }

    /// Writes row `ids[t]`, widened exactly to f32, to `out[t * cols..]` for every
    /// `t` whose row a part given holds; leaves the others. The caller checked the
    /// ids and that `out` holds `ids.len() × cols` floats.
    pub fn gather(&self, ids: &[u32], out: &mut [f32]) {
        let c = self.cols;
        for (&id, dst) in ids.iter().zip(out.chunks_exact_mut(c.max(1))) {
            if let Some((first, w)) = self.part(id as usize) {
                w.read_row(id as usize - first, dst);
            }
        }
    }

    /// The part holding row `r`, `None` when no part given holds it.
    fn part(&self, r: usize) -> Option<(usize, &WeightView<'a>)> {
        self.parts
            .iter()
            .find(|(first, w)| (*first..first + w.rows).contains(&r))
            .map(|(first, w)| (*first, w))
    }

    /// Row `r` from the part holding it, `None` when no part given holds it.
    pub fn row(&self, r: usize) -> Option<VecView<'a>> {
        self.part(r).map(|(first, w)| w.row(r - first))
    }
}

/// The dtypes every backend computes on.
pub fn check_dtype(d: DType) -> Result<(), KernelError> {
    match d {
        DType::BF16 | DType::F16 | DType::F32 => Ok(()),
        other => Err(KernelError::UnsupportedDType(other)),
    }
}

/// A 1-D weight vector (norm scale, bias) viewed in place.
#[derive(Clone, Copy, Debug)]
pub struct VecView<'a> {
    pub dtype: DType,
    pub bytes: &'a [u8],
    /// Its values are offsets from one: each reads as `1 + w` in f32 (a zero-centred
    /// RMSNorm's weight, as transformers computes `1.0 + weight.float()`).
    pub plus_one: bool,
}

impl VecView<'_> {
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        let w = read_f32(self.dtype, self.bytes, i);
        if self.plus_one {
            1.0 + w
        } else {
            w
        }
    }

    /// The values widened to f32 (exactly: BF16 and F16 are subsets of f32).
    pub fn to_vec(&self) -> Vec<f32> {
        (0..self.len()).map(|i| self.get(i)).collect()
    }

    /// Checks the dtype and that the vector has `len` elements (`what` names it).
    pub fn check(&self, what: &'static str, len: usize) -> Result<(), KernelError> {
        check_dtype(self.dtype)?;
        if self.bytes.len() != len * self.dtype.size() {
            return Err(KernelError::ActivationLen {
                what,
                n: 1,
                per_token: len,
                expected: len,
                actual: self.len(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use vpaged::PageId;

    use super::*;

    fn lease(bytes: Arc<Vec<u8>>) -> PageLease {
        let (ptr, len) = (bytes.as_ptr(), bytes.len());
        // SAFETY: the bytes live in the Arc the lease holds, never written.
        unsafe { PageLease::new(PageId(0), ptr, len, bytes) }
    }

    #[test]
    fn a_lease_keeps_a_view_only_when_it_holds_the_views_bytes() {
        let page = lease(Arc::new(vec![1u8; 32]));
        let other = lease(Arc::new(vec![2u8; 32]));
        let whole = WeightView::new(DType::BF16, 4, 4, page.bytes()).unwrap();
        assert!(whole.kept_by().is_none(), "no lease named");
        let kept = whole.leased(&page);
        assert!(std::ptr::eq(kept.kept_by().unwrap(), &page));
        let rows = kept.slice_rows(1..3);
        assert!(
            std::ptr::eq(rows.kept_by().unwrap(), &page),
            "a slice keeps it"
        );
        assert!(
            whole.leased(&other).kept_by().is_none(),
            "another page's lease"
        );
        let outside = [0u8; 8];
        let stray = WeightView::new(DType::BF16, 1, 4, &outside).unwrap();
        assert!(stray.leased(&page).kept_by().is_none());
    }
}
