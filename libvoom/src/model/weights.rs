//! Resolving an architecture's weights to pages, with their expected dtype and shape
//! checked once at load time, and reading them in place at compute time.

use std::collections::{BTreeSet, HashMap};

use voom_formats::DType;
use vpaged::{PageId, PageLease, PageSource};

use crate::backend::{VecView, WeightView};
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

    pub fn err(&self, tensor: &str, detail: String) -> VoomError {
        VoomError::Weight {
            model: self.model.clone(),
            tensor: tensor.to_string(),
            detail,
        }
    }

    pub fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// The decoder layers the checkpoint holds: the `N` of its `model.layers.N.*`
    /// tensors, which must run 0, 1, ... without a gap. A name whose `N` is not a
    /// decimal number is no layer's. Nothing is allocated per layer claimed, only per
    /// tensor present.
    pub fn layer_count(&self) -> Result<usize, VoomError> {
        let mut seen = BTreeSet::new();
        for name in self.index.keys() {
            let Some(rest) = name.strip_prefix("model.layers.") else {
                continue;
            };
            let n = rest.split('.').next().unwrap_or_default();
            if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            let i: usize = n
                .parse()
                .map_err(|_| self.err(name, format!("layer index {n} is out of range")))?;
            seen.insert(i);
        }
        if let Some(gap) = (0..).zip(&seen).find(|&(i, &n)| i != n).map(|(i, _)| i) {
            let last = seen.last().copied().unwrap_or_default();
            return Err(self.err(
                &format!("model.layers.{gap}.*"),
                format!("missing, though the checkpoint has tensors of layer {last}"),
            ));
        }
        Ok(seen.len())
    }

    fn find(&self, name: &str, dims: &[Dim]) -> Result<(PageId, DType), VoomError> {
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
        let expected: Vec<usize> = dims.iter().map(|d| d.len).collect();
        if meta.shape != expected {
            let why = match dims
                .iter()
                .zip(&meta.shape)
                .enumerate()
                .find(|(_, (d, &n))| d.len != n)
            {
                Some((i, (d, n))) if meta.shape.len() == dims.len() => format!(
                    "dimension {i} is {n} in the checkpoint, but config.json's {} is {}",
                    d.key, d.len
                ),
                _ => format!(
                    "{} dimensions in the checkpoint, {} from config.json",
                    meta.shape.len(),
                    dims.len()
                ),
            };
            return Err(self.err(
                name,
                format!("shape {:?}, expected {expected:?}: {why}", meta.shape),
            ));
        }
        Ok((id, meta.dtype))
    }

    /// A `[rows, cols]` matrix.
    pub fn matrix(&self, name: &str, rows: &Dim, cols: &Dim) -> Result<Matrix, VoomError> {
        let (page, dtype) = self.find(name, &[rows.clone(), cols.clone()])?;
        Ok(Matrix {
            page,
            dtype,
            rows: rows.len,
            cols: cols.len,
        })
    }

    /// A vector of `len` elements.
    pub fn vector(&self, name: &str, len: &Dim) -> Result<Vector, VoomError> {
        let (page, dtype) = self.find(name, std::slice::from_ref(len))?;
        Ok(Vector {
            page,
            dtype,
            len: len.len,
        })
    }
}

/// A tensor dimension config.json implies, with the keys it comes from, so that a
/// checkpoint that disagrees is told apart by the key: `'vocab_size'`, or
/// `'num_attention_heads' 4 × 'head_dim' 16`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dim {
    pub len: usize,
    pub key: String,
}

impl Dim {
    /// A dimension given by one key.
    pub fn of(key: &str, len: usize) -> Self {
        Dim {
            len,
            key: format!("'{key}'"),
        }
    }

    /// A dimension that is the product of two keys' values, `None` when it overflows.
    pub fn product(a: &str, x: usize, b: &str, y: usize) -> Option<Self> {
        Some(Dim {
            len: x.checked_mul(y)?,
            key: format!("'{a}' {x} × '{b}' {y}"),
        })
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
