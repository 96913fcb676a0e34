//! Resolving an architecture's weights to pages, with their expected dtype and shape
//! checked once at load time, and reading them in place at compute time.

use std::collections::HashMap;

use voom_formats::DType;
use vpaged::{PageId, PageLease, PageSource};

use crate::backend::cpu::matmul::WeightView;
use crate::backend::cpu::ops::VecView;
use crate::VoomError;

/// Looks weights up by name with a path prefix, like `vb.pp("self_attn")`.
pub struct WeightFinder<'a> {
    source: &'a dyn PageSource,
    model: String,
    index: HashMap<&'a str, PageId>,
}

impl<'a> WeightFinder<'a> {
    pub fn new(source: &'a dyn PageSource, model: &str) -> Self {
        let index = source
            .pages()
            .iter()
            .map(|p| (p.name.as_str(), p.id))
            .collect();
        WeightFinder {
            source,
            model: model.to_string(),
            index,
        }
    }

    fn err(&self, tensor: &str, detail: String) -> VoomError {
        VoomError::Weight {
            model: self.model.clone(),
            tensor: tensor.to_string(),
            detail,
        }
    }

    pub fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn find(&self, name: &str, shape: &[usize]) -> Result<(PageId, DType), VoomError> {
        let id = *self
            .index
            .get(name)
            .ok_or_else(|| self.err(name, "missing from the checkpoint".into()))?;
        let meta = &self.source.pages()[id.0 as usize];
        if !meta.dtype.is_compute_float() {
            return Err(self.err(
                name,
                format!("dtype {} is not supported (BF16, F16, F32)", meta.dtype),
            ));
        }
        if meta.shape != shape {
            return Err(self.err(
                name,
                format!(
                    "shape {:?}, expected {:?} from config.json",
                    meta.shape, shape
                ),
            ));
        }
        Ok((id, meta.dtype))
    }

    /// A `[rows, cols]` matrix.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, VoomError> {
        let (page, dtype) = self.find(name, &[rows, cols])?;
        Ok(Matrix {
            page,
            dtype,
            rows,
            cols,
        })
    }

    /// A vector of `len` elements.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vector, VoomError> {
        let (page, dtype) = self.find(name, &[len])?;
        Ok(Vector { page, dtype, len })
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Matrix {
    pub page: PageId,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
}

#[derive(Debug, Clone, Copy)]
pub struct Vector {
    pub page: PageId,
    pub dtype: DType,
    pub len: usize,
}

/// The leases held while computing one step (a layer, the head): weights are read
/// in place from them.
pub struct Leased {
    leases: HashMap<PageId, PageLease>,
}

impl Leased {
    /// Acquires every page in `ids` (duplicates once).
    pub fn acquire(source: &dyn PageSource, ids: &[PageId]) -> Result<Self, VoomError> {
        let mut unique = ids.to_vec();
        unique.sort_unstable();
        unique.dedup();
        let leases = source.acquire_many(&unique)?;
        Ok(Leased {
            leases: unique.into_iter().zip(leases).collect(),
        })
    }

    fn bytes(&self, id: PageId) -> &[u8] {
        self.leases
            .get(&id)
            .expect("page acquired for this step")
            .bytes()
    }

    pub fn matrix(&self, m: &Matrix) -> WeightView<'_> {
        WeightView {
            dtype: m.dtype,
            rows: m.rows,
            cols: m.cols,
            bytes: self.bytes(m.page),
        }
    }

    pub fn vector(&self, v: &Vector) -> VecView<'_> {
        VecView {
            dtype: v.dtype,
            bytes: self.bytes(v.page),
        }
    }
}
