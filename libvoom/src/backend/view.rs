//! Weights as every backend sees them: typed, shaped views of a page's bytes, read
//! in place (never copied to the heap first). A backend that computes elsewhere (a
//! GPU sharing unified memory) wraps the same bytes.

use std::ops::Range;

use voom_formats::dtype::read_f32;
use voom_formats::DType;
use vpaged::PageLease;

use super::KernelError;

/// A row-major weight matrix `[rows = out features, cols = in features]` viewed in
/// place. [`WeightView::new`] checks the invariants; every backend op checks them
/// again, so a view built from its public fields can never cause an out-of-bounds
/// read.
#[derive(Clone, Copy, Debug)]
pub struct WeightView<'a> {
    /// BF16, F16 or F32 (little-endian).
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    /// Exactly `rows * cols * dtype.size()` bytes; no alignment is required.
    pub bytes: &'a [u8],
    /// The lease `bytes` lie in, where they are a page's: a backend that reads them
    /// after the op returns (MLX's lazy graph) keeps a clone of it until it has
    /// ([`WeightView::kept_by`]). `None`: the bytes are only the call's to read.
    pub lease: Option<&'a PageLease>,
}

impl<'a> WeightView<'a> {
    /// A checked view: `dtype` is BF16/F16/F32 and `bytes.len() == rows*cols*size`.
    pub fn new(
        dtype: DType,
        rows: usize,
        cols: usize,
        bytes: &'a [u8],
    ) -> Result<Self, KernelError> {
        let w = WeightView {
            dtype,
            rows,
            cols,
            bytes,
            lease: None,
        };
        w.check()?;
        Ok(w)
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
        check_dtype(self.dtype)?;
        let expected = self
            .rows
            .checked_mul(self.cols)
            .and_then(|e| e.checked_mul(self.dtype.size()))
            .ok_or(KernelError::ShapeOverflow {
                rows: self.rows,
                cols: self.cols,
                dtype: self.dtype,
            })?;
        if self.bytes.len() != expected {
            return Err(KernelError::WeightLen {
                rows: self.rows,
                cols: self.cols,
                dtype: self.dtype,
                expected,
                actual: self.bytes.len(),
            });
        }
        Ok(())
    }

    /// Rows `range` of this matrix, as a view of the same bytes.
    ///
    /// # Panics
    /// If `range` is not within `0..rows` (a caller bug, not bad input).
    pub fn slice_rows(&self, range: Range<usize>) -> WeightView<'a> {
        assert!(range.start <= range.end && range.end <= self.rows);
        let row = self.cols * self.dtype.size();
        WeightView {
            dtype: self.dtype,
            rows: range.len(),
            cols: self.cols,
            bytes: &self.bytes[range.start * row..range.end * row],
            lease: self.lease,
        }
    }

    /// Row `r` as a vector view.
    ///
    /// # Panics
    /// If `r >= rows` (a caller bug).
    pub fn row(&self, r: usize) -> VecView<'a> {
        let v = self.slice_rows(r..r + 1);
        VecView {
            dtype: v.dtype,
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
            if let Some(row) = self.row(id as usize) {
                for (j, v) in dst.iter_mut().enumerate() {
                    *v = row.get(j);
                }
            }
        }
    }

    /// Row `r` from the part holding it, `None` when no part given holds it.
    pub fn row(&self, r: usize) -> Option<VecView<'a>> {
        self.parts
            .iter()
            .find(|(first, w)| (*first..first + w.rows).contains(&r))
            .map(|(first, w)| w.row(r - first))
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
