//! Resolving an architecture's weights to pages, with their expected dtype and shape
//! checked once at load time, and reading them in place at compute time.

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};

use voom_formats::gguf::GgmlType;
use voom_formats::DType;
use vpaged::{PageId, PageLease, PageSource};

use super::values::{ValueChecks, ValueKind};
use crate::backend::view::{ggml_block, BlockScales, WeightFormat};
use crate::backend::{TableView, VecView, WeightView};
use crate::quantization::Quantization;
use crate::VoomError;

/// Looks weights up by name with a path prefix, like `vb.pp("self_attn")`.
pub struct WeightFinder<'a> {
    source: &'a dyn PageSource,
    model: String,
    /// Each tensor's pages: one, or its row parts in row order.
    index: HashMap<&'a str, Vec<PageId>>,
    /// Where the language model's `model.*` tensors are: `model.`, or in a
    /// vision-language checkpoint (Qwen3.5 as released) `model.language_model.`.
    trunk: &'static str,
    /// How config.json says quantized weights are stored.
    quant: Quantization,
    /// The pages found whose stored values may be NaN (FP8 weights, their scales).
    checks: RefCell<ValueChecks>,
}

impl<'a> WeightFinder<'a> {
    pub fn new(source: &'a dyn PageSource, model: &str) -> Self {
        let mut index: HashMap<&str, Vec<PageId>> = HashMap::new();
        for p in source.pages() {
            index.entry(p.name.as_str()).or_default().push(p.id);
        }
        let pages = source.pages();
        for ids in index.values_mut() {
            ids.sort_by_key(|id| pages[id.0 as usize].rows.map(|r| r.start));
        }
        let nested = "model.language_model.";
        let trunk = if !index.contains_key("model.embed_tokens.weight")
            && index.keys().any(|k| k.starts_with(nested))
        {
            nested
        } else {
            "model."
        };
        WeightFinder {
            source,
            model: model.to_string(),
            index,
            trunk,
            quant: Quantization::None,
            checks: RefCell::new(ValueChecks::new(model)),
        }
    }

    /// The pages found so far whose values are checked when first leased
    /// ([`ValueChecks`]); the finder keeps none after.
    pub fn take_value_checks(&self) -> ValueChecks {
        let model = self.model.clone();
        self.checks.replace(ValueChecks::new(&model))
    }

    /// This finder, reading quantized weights as `quant` (config.json's) says.
    pub fn with_quant(self, quant: Quantization) -> Self {
        WeightFinder { quant, ..self }
    }

    /// The checkpoint's name of tensor `name` (`model.*` under the trunk).
    fn stored<'n>(&self, name: &'n str) -> std::borrow::Cow<'n, str> {
        match name.strip_prefix("model.") {
            Some(rest) if self.trunk != "model." && !name.starts_with(self.trunk) => {
                format!("{}{rest}", self.trunk).into()
            }
            _ => name.into(),
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
        self.index.contains_key(self.stored(name).as_ref())
    }

    /// The decoder layers the checkpoint holds: the `N` of its `model.layers.N.*`
    /// tensors, which must run 0, 1, ... without a gap. A name whose `N` is not a
    /// decimal number is no layer's. Nothing is allocated per layer claimed, only per
    /// tensor present.
    pub fn layer_count(&self) -> Result<usize, VoomError> {
        let mut seen = BTreeSet::new();
        let layers = format!("{}layers.", self.trunk);
        for name in self.index.keys() {
            let Some(rest) = name.strip_prefix(layers.as_str()) else {
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
                &format!("{layers}{gap}.*"),
                format!("missing, though the checkpoint has tensors of layer {last}"),
            ));
        }
        Ok(seen.len())
    }

    /// The one page of tensor `name`, checked against `dims`; a tensor stored in row
    /// parts is an error here (only tables are read part by part).
    fn find(&self, name: &str, dims: &[Dim]) -> Result<(PageId, DType), VoomError> {
        let (meta, _) = self.find_meta(name, dims)?;
        self.check_dtype(name, meta.dtype)?;
        Ok((meta.id, meta.dtype))
    }

    /// [`WeightFinder::find`] of a page of any dtype, with its stored name.
    fn find_meta<'n>(
        &self,
        name: &'n str,
        dims: &[Dim],
    ) -> Result<(&'a vpaged::PageMeta, std::borrow::Cow<'n, str>), VoomError> {
        let stored = self.stored(name);
        let name = stored.as_ref();
        let ids = self
            .index
            .get(name)
            .ok_or_else(|| self.err(name, "missing from the checkpoint".into()))?;
        let meta = &self.source.pages()[ids[0].0 as usize];
        if ids.len() > 1 || meta.rows.is_some() {
            return Err(self.err(
                name,
                format!(
                    "stored in {} row parts, but this architecture reads it whole \
                     (rebuild the manifest: vpagectl hash)",
                    ids.len()
                ),
            ));
        }
        self.check_shape(name, meta, dims)?;
        Ok((meta, stored.into_owned().into()))
    }

    /// Checks that a weight's dtype is one the kernels compute on as it is.
    fn check_dtype(&self, name: &str, dtype: DType) -> Result<(), VoomError> {
        if dtype.is_compute_float() {
            return Ok(());
        }
        Err(self.err(
            name,
            match dtype {
                DType::F8E5M2 => "dtype F8_E5M2 is not supported: no release vOOM knows stores \
                                  its weights in it (FP8 runs as e4m3 with block scales)"
                    .into(),
                DType::F8E4M3 => "dtype F8_E4M3 is not supported for this tensor (FP8 runs for \
                                  the linear layers' weights, with their block scales)"
                    .into(),
                d => format!("dtype {d} is not supported (BF16, F16, F32)"),
            },
        ))
    }

    /// Checks a page's shape against `dims` (config.json's).
    fn check_shape(
        &self,
        name: &str,
        meta: &vpaged::PageMeta,
        dims: &[Dim],
    ) -> Result<(), VoomError> {
        let expected: Vec<usize> = dims.iter().map(|d| d.len).collect();
        if meta.shape != expected {
            let why = match dims
                .iter()
                .zip(&meta.shape)
                .enumerate()
                .find(|(_, (d, &n))| d.len != n)
            {
                Some((i, (d, n))) if meta.shape.len() == dims.len() => {
                    // Config keys are quoted; other sizes are the format's own.
                    let from = match d.key.starts_with('\'') {
                        true => "config.json's ",
                        false => "",
                    };
                    format!(
                        "dimension {i} is {n} in the checkpoint, but {from}{} is {}",
                        d.key, d.len
                    )
                }
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
        Ok(())
    }

    /// Where config.json's `quantization_config` (of gguf) keeps tensor `stored` in
    /// a ggml block type: the type and the dimension that stands for `cols` in the
    /// stored shape, the bytes of a row of whole blocks. `None` for any other tensor.
    fn ggml_cols(&self, stored: &str, cols: &Dim) -> Result<Option<(GgmlType, Dim)>, VoomError> {
        let Some(t) = self.quant.ggml_type(stored) else {
            let page = self.index.get(stored).and_then(|ids| ids.first());
            let u8_page =
                page.is_some_and(|id| self.source.pages()[id.0 as usize].dtype == DType::U8);
            if u8_page && self.quant.is_lossy() {
                return Err(self.err(
                    stored,
                    "stored as U8 (ggml blocks?), but config.json's \
                     'quantization_config.tensor_types' does not list its type"
                        .into(),
                ));
            }
            return Ok(None);
        };
        let (block, bytes) = ggml_block(t);
        if !cols.len.is_multiple_of(block) {
            return Err(self.err(
                stored,
                format!(
                    "{} is {}, which {t} blocks of {block} do not divide",
                    cols.key, cols.len
                ),
            ));
        }
        let n = cols.len / block;
        let dim = Dim::format(
            &format!(
                "{n} {t} blocks of {bytes} bytes for {} {}",
                cols.key, cols.len
            ),
            n * bytes,
        );
        Ok(Some((t, dim)))
    }

    /// Checks a stored dtype: U8 for a ggml-block tensor, else one the kernels
    /// compute on.
    fn check_stored(
        &self,
        name: &str,
        dtype: DType,
        ggml: Option<GgmlType>,
    ) -> Result<(), VoomError> {
        match ggml {
            Some(t) if dtype != DType::U8 => Err(self.err(
                name,
                format!("dtype {dtype}, but config.json says {t} blocks, stored as U8"),
            )),
            Some(_) => Ok(()),
            None => self.check_dtype(name, dtype),
        }
    }

    /// A `[rows, cols]` matrix: BF16, F16 or F32, or FP8 with its block scales
    /// (`{name}_scale_inv`) where config.json's `quantization_config` says so, or
    /// (lossy) ggml blocks where its gguf `tensor_types` names the tensor.
    pub fn matrix(&self, name: &str, rows: &Dim, cols: &Dim) -> Result<Matrix, VoomError> {
        if let Some((t, bytes)) = self.ggml_cols(&self.stored(name), cols)? {
            let (meta, stored) = self.find_meta(name, &[rows.clone(), bytes])?;
            self.check_stored(&stored, meta.dtype, Some(t))?;
            return Ok(Matrix {
                page: meta.id,
                dtype: meta.dtype,
                scales: None,
                ggml: Some(t),
                first: 0,
                rows: rows.len,
                cols: cols.len,
            });
        }
        let (meta, stored) = self.find_meta(name, &[rows.clone(), cols.clone()])?;
        let (page, dtype) = (meta.id, meta.dtype);
        let scales = if dtype == DType::F8E4M3 {
            let s = self.fp8_scales(&stored, rows, cols)?;
            self.record(page, &s);
            Some(s)
        } else {
            self.check_dtype(&stored, dtype)?;
            None
        };
        Ok(Matrix {
            page,
            dtype,
            scales,
            ggml: None,
            first: 0,
            rows: rows.len,
            cols: cols.len,
        })
    }

    /// A `[count, rows, cols]` tensor as `count` matrices of `[rows, cols]` (experts
    /// stored fused in one tensor), each a view of the page holding it; FP8 with its
    /// `[count, ceil(rows / block), ceil(cols / block)]` block scales, stored (and
    /// paged) the same way.
    pub fn stacked(
        &self,
        name: &str,
        count: &Dim,
        rows: &Dim,
        cols: &Dim,
    ) -> Result<Vec<Matrix>, VoomError> {
        let stored = self.stored(name).into_owned();
        if let Some((t, bytes)) = self.ggml_cols(&stored, cols)? {
            let (at, dtype) = self.stacked_pages(&stored, count, &[rows.clone(), bytes])?;
            self.check_stored(&stored, dtype, Some(t))?;
            return Ok(at
                .into_iter()
                .map(|(page, i)| Matrix {
                    page,
                    dtype,
                    scales: None,
                    ggml: Some(t),
                    first: i * rows.len,
                    rows: rows.len,
                    cols: cols.len,
                })
                .collect());
        }
        let (at, dtype) = self.stacked_pages(&stored, count, &[rows.clone(), cols.clone()])?;
        let scales: Vec<Option<Scales>> = if dtype == DType::F8E4M3 {
            let (block_rows, block_cols) = self.fp8_block(&stored)?;
            let scale_name = self.fp8_scale_name(&stored)?;
            let (br, bc) = fp8_scale_dims(rows, cols, block_rows, block_cols);
            let nbr = br.len;
            let (sat, sdtype) = self.stacked_pages(&scale_name, count, &[br, bc])?;
            self.check_scale_dtype(&scale_name, sdtype)?;
            let scales: Vec<Option<Scales>> = sat
                .into_iter()
                .map(|(page, i)| {
                    Some(Scales {
                        page,
                        kind: ScaleKind::Fp8 {
                            dtype: sdtype,
                            block_rows,
                            block_cols,
                        },
                        first: i * nbr,
                        row0: 0,
                    })
                })
                .collect();
            for ((page, _), s) in at.iter().zip(&scales) {
                self.record(*page, s.as_ref().expect("FP8 scales"));
            }
            scales
        } else {
            self.check_dtype(&stored, dtype)?;
            vec![None; at.len()]
        };
        Ok(at
            .into_iter()
            .zip(scales)
            .map(|((page, i), scales)| Matrix {
                page,
                dtype,
                scales,
                ggml: None,
                first: i * rows.len,
                rows: rows.len,
                cols: cols.len,
            })
            .collect())
    }

    /// `count` matrices of `[rows, cols]` stored under `stem`: MXFP4 where the
    /// checkpoint holds `{stem}_blocks` ([`WeightFinder::mxfp4_stacked`]), else the
    /// tensor `stem` itself ([`WeightFinder::stacked`]).
    pub fn stacked_any(
        &self,
        stem: &str,
        count: &Dim,
        rows: &Dim,
        cols: &Dim,
    ) -> Result<Vec<Matrix>, VoomError> {
        if self.has(&format!("{stem}_blocks")) {
            self.mxfp4_stacked(stem, count, rows, cols)
        } else {
            self.stacked(stem, count, rows, cols)
        }
    }

    /// `count` MXFP4 matrices of `[rows, cols]` (gpt-oss's experts): `{stem}_blocks`
    /// `[count, rows, cols / 32, 16]` of packed e2m1 pairs (low nibble first) and
    /// `{stem}_scales` `[count, rows, cols / 32]` of e8m0 exponents, U8 both, each
    /// one page or paged per matrix alike.
    pub fn mxfp4_stacked(
        &self,
        stem: &str,
        count: &Dim,
        rows: &Dim,
        cols: &Dim,
    ) -> Result<Vec<Matrix>, VoomError> {
        let stem = self.stored(stem).into_owned();
        let blocks = format!("{stem}_blocks");
        let scales = format!("{stem}_scales");
        if !matches!(self.quant, Quantization::Mxfp4 { .. }) {
            return Err(self.err(
                &blocks,
                "MXFP4 blocks, but config.json has no 'quantization_config' of mxfp4".into(),
            ));
        }
        if self.quant.left_unconverted(&blocks) {
            return Err(self.err(
                &blocks,
                "MXFP4 blocks, but config.json's 'modules_to_not_convert' leaves it \
                 unquantized"
                    .into(),
            ));
        }
        if !cols.len.is_multiple_of(32) {
            return Err(self.err(
                &blocks,
                format!(
                    "{} is {}, which blocks of 32 do not divide (MXFP4 scales one exponent \
                     per 32 values of a row)",
                    cols.key, cols.len
                ),
            ));
        }
        if !self.index.contains_key(scales.as_str()) {
            return Err(self.err(
                &blocks,
                format!("MXFP4 blocks, but their scales '{scales}' are missing"),
            ));
        }
        let groups = Dim {
            len: cols.len / 32,
            key: format!("{} / 32", cols.key),
        };
        let (at, dtype) = self.stacked_pages(
            &blocks,
            count,
            &[
                rows.clone(),
                groups.clone(),
                Dim::format("MXFP4's bytes per block of 32", 16),
            ],
        )?;
        let (sat, sdtype) = self.stacked_pages(&scales, count, &[rows.clone(), groups])?;
        for (name, d) in [(&blocks, dtype), (&scales, sdtype)] {
            if d != DType::U8 {
                return Err(self.err(name, format!("dtype {d}, but MXFP4 is stored as U8")));
            }
        }
        let mut c = self.checks.borrow_mut();
        Ok(at
            .into_iter()
            .zip(sat)
            .map(|((page, i), (spage, si))| {
                c.add(spage, ValueKind::E8M0);
                Matrix {
                    page,
                    dtype,
                    ggml: None,
                    scales: Some(Scales {
                        page: spage,
                        kind: ScaleKind::Mxfp4,
                        first: si * rows.len,
                        row0: 0,
                    }),
                    first: i * rows.len,
                    rows: rows.len,
                    cols: cols.len,
                }
            })
            .collect())
    }

    /// `count` vectors of `[len]` stored as one `[count, len]` tensor (fused experts'
    /// biases, `experts.gate_up_proj_bias`), each a view of the page holding it: a
    /// float dtype.
    pub fn stacked_vectors(
        &self,
        name: &str,
        count: &Dim,
        len: &Dim,
    ) -> Result<Vec<Vector>, VoomError> {
        let stored = self.stored(name).into_owned();
        let (at, dtype) = self.stacked_pages(&stored, count, std::slice::from_ref(len))?;
        self.check_dtype(&stored, dtype)?;
        Ok(at
            .into_iter()
            .map(|(page, i)| Vector {
                page,
                dtype,
                first: i * len.len,
                len: len.len,
                plus_one: false,
            })
            .collect())
    }

    /// Where each of the `count` slices of tensor `name` (`[count, tail..]`, its
    /// stored name) lies: its page and its index in that page, with the tensor's dtype.
    /// One whole page, or parts along the first dimension (a manifest pages each
    /// expert on its own), each holding whole slices from 0 in order, of one dtype.
    fn stacked_pages(
        &self,
        name: &str,
        count: &Dim,
        tail: &[Dim],
    ) -> Result<(Vec<(PageId, usize)>, DType), VoomError> {
        let ids = self
            .index
            .get(name)
            .ok_or_else(|| self.err(name, "missing from the checkpoint".into()))?;
        let pages = self.source.pages();
        let first = &pages[ids[0].0 as usize];
        let dims = |lead: Dim| {
            std::iter::once(lead)
                .chain(tail.iter().cloned())
                .collect::<Vec<_>>()
        };
        if ids.len() == 1 && first.rows.is_none() {
            let (meta, _) = self.find_meta(name, &dims(count.clone()))?;
            return Ok(((0..count.len).map(|i| (meta.id, i)).collect(), meta.dtype));
        }
        let mut out = Vec::with_capacity(count.len);
        for &id in ids {
            let meta = &pages[id.0 as usize];
            let label = meta.label();
            let Some(r) = meta.rows else {
                return Err(self.err(name, format!("page '{label}' is whole beside parts")));
            };
            if r.start != out.len() as u64 || meta.dtype != first.dtype {
                return Err(self.err(
                    name,
                    format!("page '{label}' does not follow the part before it"),
                ));
            }
            let held = Dim {
                len: r.count as usize,
                key: format!("{}..{} of {}", r.start, r.end(), count.key),
            };
            self.check_shape(name, meta, &dims(held))?;
            out.extend((0..r.count as usize).map(|i| (id, i)));
        }
        if out.len() != count.len {
            return Err(self.err(
                name,
                format!(
                    "its parts hold {} of config.json's {} {}",
                    out.len(),
                    count.key,
                    count.len
                ),
            ));
        }
        Ok((out, first.dtype))
    }

    /// Records quantized weight page `page` and its scales' for their values' check.
    fn record(&self, page: PageId, s: &Scales) {
        let mut c = self.checks.borrow_mut();
        match s.kind {
            ScaleKind::Fp8 { dtype, .. } => {
                c.add(page, ValueKind::Fp8E4M3);
                c.add(s.page, ValueKind::Scales(dtype));
            }
            ScaleKind::Mxfp4 => c.add(s.page, ValueKind::E8M0),
        }
    }

    /// The FP8 block size config.json gives for weight `name` (stored as F8_E4M3).
    fn fp8_block(&self, name: &str) -> Result<(usize, usize), VoomError> {
        let Quantization::Fp8 {
            block_rows,
            block_cols,
            ..
        } = self.quant
        else {
            return Err(self.err(
                name,
                "stored as F8_E4M3, but config.json has no 'quantization_config' of fp8 \
                 with its block size"
                    .into(),
            ));
        };
        if self.quant.left_unconverted(name) {
            return Err(self.err(
                name,
                "stored as F8_E4M3, but config.json's 'modules_to_not_convert' leaves it \
                 unquantized"
                    .into(),
            ));
        }
        Ok((block_rows, block_cols))
    }

    /// The name of FP8 weight `name`'s block scales (`{name}_scale_inv`), present.
    fn fp8_scale_name(&self, name: &str) -> Result<String, VoomError> {
        let scale_name = format!("{name}_scale_inv");
        if !self.index.contains_key(scale_name.as_str()) {
            return Err(self.err(
                name,
                format!("stored as F8_E4M3, but its block scales '{scale_name}' are missing"),
            ));
        }
        Ok(scale_name)
    }

    fn check_scale_dtype(&self, scale_name: &str, dtype: DType) -> Result<(), VoomError> {
        if matches!(dtype, DType::F32 | DType::BF16) {
            return Ok(());
        }
        Err(self.err(
            scale_name,
            format!("block scales of dtype {dtype} (F32 or BF16 expected)"),
        ))
    }

    /// The block scales of FP8 weight `name` (its stored name): the page
    /// `{name}_scale_inv`, F32 or BF16, of `ceil(rows / block) x ceil(cols / block)`.
    fn fp8_scales(&self, name: &str, rows: &Dim, cols: &Dim) -> Result<Scales, VoomError> {
        let (block_rows, block_cols) = self.fp8_block(name)?;
        let scale_name = self.fp8_scale_name(name)?;
        let (br, bc) = fp8_scale_dims(rows, cols, block_rows, block_cols);
        let (meta, _) = self.find_meta(&scale_name, &[br, bc])?;
        self.check_scale_dtype(&scale_name, meta.dtype)?;
        Ok(Scales {
            page: meta.id,
            kind: ScaleKind::Fp8 {
                dtype: meta.dtype,
                block_rows,
                block_cols,
            },
            first: 0,
            row0: 0,
        })
    }

    /// A `[rows, cols]` table read by rows (an embedding, an output head): its one
    /// page, or the row parts it is stored in, which must tile it.
    pub fn table(&self, name: &str, rows: &Dim, cols: &Dim) -> Result<Table, VoomError> {
        let stored = self.stored(name);
        let name = stored.as_ref();
        let ids = self
            .index
            .get(name)
            .ok_or_else(|| self.err(name, "missing from the checkpoint".into()))?;
        let pages = self.source.pages();
        // Read by rows: a plain dtype, or (lossy) ggml blocks.
        let (ggml, stored_cols) = match self.ggml_cols(name, cols)? {
            Some((t, bytes)) => (Some(t), bytes),
            None => (None, cols.clone()),
        };
        if ids.len() == 1 && pages[ids[0].0 as usize].rows.is_none() {
            let (meta, _) = self.find_meta(name, &[rows.clone(), stored_cols])?;
            self.check_stored(name, meta.dtype, ggml)?;
            return Ok(Table {
                parts: vec![TablePart {
                    page: meta.id,
                    first: 0,
                    rows: rows.len,
                }],
                dtype: meta.dtype,
                ggml,
                rows: rows.len,
                cols: cols.len,
            });
        }
        let mut parts = Vec::with_capacity(ids.len());
        let mut next = 0usize;
        let dtype = pages[ids[0].0 as usize].dtype;
        for &id in ids {
            let meta = &pages[id.0 as usize];
            let label = meta.label();
            let Some(r) = meta.rows else {
                return Err(self.err(name, format!("page '{label}' is whole beside row parts")));
            };
            if r.start != next as u64 || meta.dtype != dtype {
                return Err(self.err(
                    name,
                    format!("page '{label}' does not follow the part before it"),
                ));
            }
            let count = Dim {
                len: r.count as usize,
                key: format!("rows {}..{} of {}", r.start, r.end(), rows.key),
            };
            self.check_stored(name, meta.dtype, ggml)?;
            self.check_shape(name, meta, &[count, stored_cols.clone()])?;
            parts.push(TablePart {
                page: id,
                first: next,
                rows: r.count as usize,
            });
            next += r.count as usize;
        }
        if next != rows.len {
            return Err(self.err(
                name,
                format!(
                    "its row parts hold {next} rows, but config.json's {} is {}",
                    rows.key, rows.len
                ),
            ));
        }
        Ok(Table {
            parts,
            dtype,
            ggml,
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
            first: 0,
            len: len.len,
            plus_one: false,
        })
    }

    /// A tensor of any shape `dims` (checked as [`WeightFinder::matrix`] checks
    /// two), read as one flat vector in its stored order.
    pub fn flat(&self, name: &str, dims: &[Dim]) -> Result<Vector, VoomError> {
        let (page, dtype) = self.find(name, dims)?;
        Ok(Vector {
            page,
            dtype,
            first: 0,
            len: dims.iter().map(|d| d.len).product(),
            plus_one: false,
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

    /// A dimension the storage format fixes (not config.json's).
    pub fn format(what: &str, len: usize) -> Self {
        Dim {
            len,
            key: what.to_string(),
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

/// A `[rows, cols]` matrix: rows `first..first + rows` of its page's (a tensor of
/// its own has `first` 0; a fused tensor's part, another), and, for a block-scaled
/// format, where its scales are.
#[derive(Debug, Clone, Copy)]
pub struct Matrix {
    pub page: PageId,
    /// The dtype of the weight's own bytes (`F8E4M3`, `U8` for MXFP4's pairs and
    /// ggml's blocks).
    pub dtype: DType,
    pub scales: Option<Scales>,
    /// Lossy: the ggml block type the rows are stored in (no scales of their own).
    pub ggml: Option<GgmlType>,
    pub first: usize,
    pub rows: usize,
    pub cols: usize,
}

/// The scales of a block-scaled [`Matrix`], in a page of their own that is leased
/// with the weight's ([`Matrix::pages`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scales {
    pub page: PageId,
    pub kind: ScaleKind,
    /// FP8: the block row of the page the matrix's row 0 lies in; MXFP4: the row of
    /// the page's scales that is the matrix's row 0.
    pub first: usize,
    /// FP8: the matrix's row 0 is this row of block row `first`; MXFP4: 0.
    pub row0: usize,
}

/// What a [`Scales`] page holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleKind {
    /// One F32 or BF16 scale per block of `block_rows x block_cols` FP8 elements.
    Fp8 {
        dtype: DType,
        block_rows: usize,
        block_cols: usize,
    },
    /// One e8m0 byte per 32 MXFP4 elements of a row.
    Mxfp4,
}

impl Matrix {
    /// Rows `start..start + rows` of this matrix (`rows` within it).
    pub fn sub_rows(&self, start: usize, rows: usize) -> Matrix {
        assert!(start + rows <= self.rows, "rows within the matrix");
        let scales = self.scales.map(|s| match s.kind {
            ScaleKind::Fp8 { block_rows, .. } => {
                let r = s.row0 + start;
                Scales {
                    first: s.first + r / block_rows,
                    row0: r % block_rows,
                    ..s
                }
            }
            ScaleKind::Mxfp4 => Scales {
                first: s.first + start,
                ..s
            },
        });
        Matrix {
            first: self.first + start,
            rows,
            scales,
            ..*self
        }
    }

    /// The pages computing with the matrix leases: its own, and its scales'.
    pub fn pages(&self) -> impl Iterator<Item = PageId> {
        std::iter::once(self.page).chain(self.scales.map(|s| s.page))
    }
}

/// The shape of an FP8 weight's block scales: `ceil(rows / block_rows) x
/// ceil(cols / block_cols)` (edge blocks partial).
fn fp8_scale_dims(rows: &Dim, cols: &Dim, block_rows: usize, block_cols: usize) -> (Dim, Dim) {
    (
        Dim {
            len: rows.len.div_ceil(block_rows),
            key: format!("{} / block {block_rows}, rounded up", rows.key),
        },
        Dim {
            len: cols.len.div_ceil(block_cols),
            key: format!("{} / block {block_cols}, rounded up", cols.key),
        },
    )
}

/// A table read by rows, as the pages it is stored in (one, or its row parts).
#[derive(Debug, Clone)]
pub struct Table {
    pub parts: Vec<TablePart>,
    pub dtype: DType,
    /// Lossy: the ggml block type the rows are stored in (`dtype` is then U8).
    pub ggml: Option<GgmlType>,
    pub rows: usize,
    pub cols: usize,
}

/// One page of a [`Table`]: rows `first..first + rows`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TablePart {
    pub page: PageId,
    pub first: usize,
    pub rows: usize,
}

impl Table {
    /// The weight format of its rows.
    pub fn format(&self) -> WeightFormat<'static> {
        match self.ggml {
            Some(t) => WeightFormat::Ggml(t),
            None => WeightFormat::Plain(self.dtype),
        }
    }

    /// Bytes of one row as stored.
    pub fn row_bytes(&self) -> usize {
        self.format().bytes_for(1, self.cols).unwrap_or(usize::MAX)
    }

    /// The part holding row `r`, if any.
    pub fn part_of(&self, r: usize) -> Option<&TablePart> {
        let i = self.parts.partition_point(|p| p.first + p.rows <= r);
        self.parts.get(i).filter(|p| p.first <= r)
    }

    /// The pages holding rows `ids` (each once, in row order); ids past the table
    /// hold none (the gather reports them).
    pub fn pages_for(&self, ids: &[u32]) -> Vec<PageId> {
        let mut out: Vec<PageId> = ids
            .iter()
            .filter_map(|&id| self.part_of(id as usize))
            .map(|p| p.page)
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// `ids` (pages of the table, in order) in consecutive batches of at most
    /// `bound` bytes as the cache holds them (slots), at least one page each; one
    /// batch at least.
    pub fn batches(&self, ids: &[PageId], bound: u64) -> Vec<Vec<PageId>> {
        let mut out: Vec<Vec<PageId>> = Vec::new();
        let mut held = 0;
        for &id in ids {
            let p = self
                .parts
                .iter()
                .find(|p| p.page == id)
                .expect("a page of the table");
            let n = super::plan::slot_bytes((p.rows * self.row_bytes()) as u64);
            match out.last_mut() {
                Some(last) if held + n <= bound => last.push(id),
                _ => {
                    out.push(vec![id]);
                    held = 0;
                }
            }
            held += n;
        }
        if out.is_empty() {
            out.push(Vec::new());
        }
        out
    }

    /// Every page of the table, in row order.
    pub fn pages(&self) -> Vec<PageId> {
        self.parts.iter().map(|p| p.page).collect()
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Vector {
    pub page: PageId,
    pub dtype: DType,
    /// Its first element in the page (0 but for a slice of a stacked tensor).
    pub first: usize,
    pub len: usize,
    /// Its values read as `1 + w` ([`VecView::plus_one`]: a zero-centred norm's).
    pub plus_one: bool,
}

/// Elements `first * per..(first + n) * per` of a page's bytes, or all of them
/// where the page is shorter than that (for the kernels' length checks to report).
fn part(bytes: &[u8], per: usize, first: usize, n: usize) -> &[u8] {
    bytes.get(first * per..(first + n) * per).unwrap_or(bytes)
}

impl Vector {
    /// This vector read as offsets from one where `yes` (a zero-centred RMSNorm).
    pub fn plus_one(self, yes: bool) -> Vector {
        Vector {
            plus_one: yes,
            ..self
        }
    }
}

/// The leases held while computing one step (a layer, the head): weights are read
/// in place from them.
pub struct Leased {
    leases: HashMap<PageId, PageLease>,
}

impl Leased {
    /// Acquires every page in `ids` (duplicates once), the largest first: a cache
    /// that places each page in one run of slots finds a run for the largest while
    /// nothing of this lease splits its free room (a small page leased first could
    /// sit between the only runs a large one would fit).
    pub fn acquire(source: &dyn PageSource, ids: &[PageId]) -> Result<Self, VoomError> {
        let mut unique = ids.to_vec();
        unique.sort_unstable();
        unique.dedup();
        let pages = source.pages();
        unique.sort_by_key(|id| std::cmp::Reverse(pages.get(id.0 as usize).map_or(0, |p| p.len)));
        let leases = source.acquire_many(&unique)?;
        Ok(Leased {
            leases: unique.into_iter().zip(leases).collect(),
        })
    }

    fn lease(&self, id: PageId) -> &PageLease {
        self.leases.get(&id).expect("page acquired for this step")
    }

    fn bytes(&self, id: PageId) -> &[u8] {
        self.lease(id).bytes()
    }

    /// Every page leased, with its bytes.
    pub fn pages(&self) -> impl Iterator<Item = (PageId, &[u8])> {
        self.leases.iter().map(|(&id, l)| (id, l.bytes()))
    }

    /// The parts of `t` this lease holds (a table leased part by part holds some).
    pub fn table(&self, t: &Table) -> TableView<'_> {
        TableView {
            rows: t.rows,
            cols: t.cols,
            parts: t
                .parts
                .iter()
                .filter_map(|p| {
                    let lease = self.leases.get(&p.page)?;
                    Some((
                        p.first,
                        WeightView {
                            format: t.format(),
                            rows: p.rows,
                            cols: t.cols,
                            bytes: lease.bytes(),
                            lease: Some(lease),
                        },
                    ))
                })
                .collect(),
        }
    }

    pub fn matrix(&self, m: &Matrix) -> WeightView<'_> {
        let lease = self.lease(m.page);
        let page = lease.bytes();
        // A page shorter than its shape (a source's fault) keeps its bytes whole, for
        // the kernels' length check to report rather than a panic here; so do scales.
        let format = match (m.ggml, m.scales) {
            (Some(t), _) => WeightFormat::Ggml(t),
            (None, None) => WeightFormat::Plain(m.dtype),
            (None, Some(s)) => {
                let held = self.bytes(s.page);
                match s.kind {
                    ScaleKind::Fp8 {
                        dtype,
                        block_rows,
                        block_cols,
                    } => {
                        let per = m.cols.div_ceil(block_cols) * dtype.size();
                        let n = (s.row0 + m.rows).div_ceil(block_rows);
                        WeightFormat::Fp8(BlockScales {
                            dtype,
                            block_rows,
                            block_cols,
                            row0: s.row0,
                            bytes: part(held, per, s.first, n),
                        })
                    }
                    ScaleKind::Mxfp4 => WeightFormat::Mxfp4 {
                        scales: part(held, m.cols / 32, s.first, m.rows),
                    },
                }
            }
        };
        let row = format.bytes_for(1, m.cols).unwrap_or(0);
        WeightView {
            lease: Some(lease),
            format,
            rows: m.rows,
            cols: m.cols,
            bytes: part(page, row, m.first, m.rows),
        }
    }

    pub fn vector(&self, v: &Vector) -> VecView<'_> {
        VecView {
            dtype: v.dtype,
            bytes: part(self.bytes(v.page), v.dtype.size(), v.first, v.len),
            plus_one: v.plus_one,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::view::{e8m0_to_f32, E2M1};
    use std::collections::BTreeMap;
    use vpaged::embedded::{EmbeddedStore, VerifyMode};

    /// A store over one safetensors file of `tensors`.
    fn store(tensors: &[(&str, DType, Vec<usize>, Vec<u8>)]) -> (tempfile::TempDir, EmbeddedStore) {
        let d = tempfile::tempdir().unwrap();
        let refs: Vec<(&str, DType, &[usize], &[u8])> = tensors
            .iter()
            .map(|(n, t, s, b)| (*n, *t, s.as_slice(), b.as_slice()))
            .collect();
        voom_formats::safetensors::write(
            &d.path().join("model.safetensors"),
            &refs,
            &BTreeMap::new(),
        )
        .unwrap();
        let s = EmbeddedStore::open(d.path(), VerifyMode::Off).unwrap();
        (d, s)
    }

    const STEM: &str = "model.layers.0.mlp.experts.gate_up_proj";

    fn mxfp4_tensors(
        cols: usize,
        scale: impl Fn(usize) -> u8,
    ) -> Vec<(&'static str, DType, Vec<usize>, Vec<u8>)> {
        let (e, r) = (2, 3);
        let n = e * r * cols / 2;
        let blocks: Vec<u8> = (0..n).map(|i| (i * 37 + 11) as u8).collect();
        let scales: Vec<u8> = (0..e * r * cols / 32).map(scale).collect();
        vec![
            (
                "model.layers.0.mlp.experts.gate_up_proj_blocks",
                DType::U8,
                vec![e, r, cols / 32, 16],
                blocks,
            ),
            (
                "model.layers.0.mlp.experts.gate_up_proj_scales",
                DType::U8,
                vec![e, r, cols / 32],
                scales,
            ),
        ]
    }

    fn mxfp4() -> Quantization {
        Quantization::Mxfp4 {
            not_convert: Vec::new(),
        }
    }

    #[test]
    fn mxfp4_experts_read_as_their_definition() {
        let t = mxfp4_tensors(64, |i| 120 + (i % 9) as u8);
        let (_d, s) = store(&t);
        let f = WeightFinder::new(&s, "m").with_quant(mxfp4());
        let (count, rows, cols) = (
            Dim::of("experts", 2),
            Dim::of("rows", 3),
            Dim::of("cols", 64),
        );
        let ms = f.stacked_any(STEM, &count, &rows, &cols).unwrap();
        assert_eq!(ms.len(), 2);
        let pages: Vec<PageId> = ms.iter().flat_map(|m| m.pages()).collect();
        let leased = Leased::acquire(&s, &pages).unwrap();
        let (blocks, scales) = (&t[0].3, &t[1].3);
        for (e, m) in ms.iter().enumerate() {
            let v = leased.matrix(m);
            v.check().unwrap();
            for r in 0..3 {
                for k in 0..64 {
                    let i = (e * 3 + r) * 64 + k;
                    let b = blocks[i / 2];
                    let nib = if i % 2 == 0 { b & 0xf } else { b >> 4 };
                    let want = E2M1[nib as usize] * e8m0_to_f32(scales[i / 32]);
                    assert_eq!(
                        v.get(r, k).to_bits(),
                        want.to_bits(),
                        "expert {e} [{r}, {k}]"
                    );
                }
            }
        }
        // Its scales' values are checked when leased.
        assert_eq!(f.take_value_checks().len(), 1);
    }

    #[test]
    fn bad_mxfp4_tensors_are_named() {
        let (count, rows) = (Dim::of("experts", 2), Dim::of("rows", 3));
        let t = mxfp4_tensors(64, |_| 127);
        let (_d, s) = store(&t);
        let err = |f: &WeightFinder, cols: usize| {
            f.stacked_any(STEM, &count, &rows, &Dim::of("cols", cols))
                .err()
                .unwrap()
                .to_string()
        };
        let plain = WeightFinder::new(&s, "m");
        assert!(err(&plain, 64).contains("quantization_config"));
        let f = WeightFinder::new(&s, "m").with_quant(mxfp4());
        // Blocks whose shape disagrees with config.json's.
        let e = err(&f, 96);
        assert!(e.contains("_blocks") && e.contains("cols"), "{e}");
        let e = err(&f, 48);
        assert!(e.contains("blocks of 32"), "{e}");
        // Scales of the wrong shape; scales missing.
        let mut t2 = mxfp4_tensors(64, |_| 127);
        t2[1].2 = vec![2, 3, 1];
        t2[1].3.truncate(6);
        let (_d2, s2) = store(&t2);
        let f2 = WeightFinder::new(&s2, "m").with_quant(mxfp4());
        let e = err(&f2, 64);
        assert!(e.contains("_scales") && e.contains("shape"), "{e}");
        let (_d3, s3) = store(&t[..1]);
        let f3 = WeightFinder::new(&s3, "m").with_quant(mxfp4());
        let e = err(&f3, 64);
        assert!(e.contains("_scales") && e.contains("missing"), "{e}");
    }
}
