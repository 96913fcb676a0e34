//! The argument checks every backend makes before an op (shapes of activations,
//! heads, rotary tables, the KV layer), so that each backend rejects the same bad
//! arguments with the same error and none reads out of bounds.

use std::ops::Range;

use super::kv::KvCache;
use super::{AttentionShape, KernelError, LatentShape, RopeShape, RopeTable, TableView};

/// `(rows, cols)` of an activation must be `rows × cols` (`what` names it).
pub fn dims(
    what: &'static str,
    got: (usize, usize),
    rows: usize,
    cols: usize,
) -> Result<(), KernelError> {
    if got != (rows, cols) {
        return Err(KernelError::ActivationLen {
            what,
            n: rows,
            per_token: cols,
            expected: rows * cols,
            actual: got.0 * got.1,
        });
    }
    Ok(())
}

/// `range` must be rows of an activation of `got` dims.
pub fn row_range(got: (usize, usize), range: &Range<usize>) -> Result<(), KernelError> {
    if range.start > range.end || range.end > got.0 {
        return Err(KernelError::ActivationLen {
            what: "row range",
            n: range.end,
            per_token: got.1,
            expected: range.end.saturating_mul(got.1),
            actual: got.0 * got.1,
        });
    }
    Ok(())
}

/// Parts stacked must share their columns.
pub fn stack(parts: impl Iterator<Item = (usize, usize)>) -> Result<(), KernelError> {
    let mut cols = None;
    for (r, c) in parts {
        let want = *cols.get_or_insert(c);
        if c != want {
            return Err(KernelError::ActivationLen {
                what: "stacked part",
                n: r,
                per_token: want,
                expected: r * want,
                actual: r * c,
            });
        }
    }
    Ok(())
}

/// An embedding gather: the table's parts, `out` of `ids.len() × cols`, every id
/// in the table.
pub fn embed(table: &TableView<'_>, ids: &[u32], out: (usize, usize)) -> Result<(), KernelError> {
    table.check()?;
    dims("embedding output", out, ids.len(), table.cols)?;
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= table.rows) {
        return Err(KernelError::RowOutOfRange {
            id,
            rows: table.rows,
        });
    }
    Ok(())
}

/// Each row's columns split into `group`-sized pieces.
pub fn groups(x: (usize, usize), group: usize) -> Result<(), KernelError> {
    if group == 0 || !x.1.is_multiple_of(group) {
        return Err(KernelError::ActivationLen {
            what: "grouped norm input",
            n: x.0,
            per_token: group,
            expected: x.0 * x.1.next_multiple_of(group.max(1)),
            actual: x.0 * x.1,
        });
    }
    Ok(())
}

/// A rotary embedding of an activation of `x` dims: whole heads, the rotated part
/// inside each head, one table position per row.
pub fn rope(x: (usize, usize), shape: &RopeShape, table: &RopeTable) -> Result<(), KernelError> {
    let (half, hd) = (table.half, shape.head_dim);
    if hd == 0
        || half == 0
        || shape.offset + 2 * half > hd
        || !x.1.is_multiple_of(hd)
        || table.positions() != x.0
        || table.sin.len() != table.cos.len()
    {
        return Err(KernelError::ActivationLen {
            what: "rotary input",
            n: table.positions(),
            per_token: x.1.next_multiple_of(hd.max(1)),
            expected: table.positions() * x.1,
            actual: x.0 * x.1,
        });
    }
    Ok(())
}

/// Grouped-query attention of `q`, `k`, `v` into `out` over `layer` of `kv`.
pub fn attention(
    shape: &AttentionShape,
    q: (usize, usize),
    k: (usize, usize),
    v: (usize, usize),
    out: (usize, usize),
    kv: &KvCache,
    layer: usize,
) -> Result<(), KernelError> {
    let (n, hd) = (q.0, shape.head_dim);
    if shape.kv_heads == 0 || !shape.heads.is_multiple_of(shape.kv_heads) || hd == 0 {
        return Err(KernelError::ActivationLen {
            what: "attention heads",
            n: shape.heads,
            per_token: shape.kv_heads,
            expected: shape.heads.next_multiple_of(shape.kv_heads.max(1)),
            actual: shape.heads,
        });
    }
    dims("attention queries", q, n, shape.heads * hd)?;
    dims("attention keys", k, n, shape.kv_heads * hd)?;
    dims("attention values", v, n, shape.kv_heads * hd)?;
    dims("attention output", out, n, shape.heads * hd)?;
    if let Some(s) = &shape.sinks {
        if s.len() != shape.heads {
            return Err(KernelError::ActivationLen {
                what: "attention sinks (one per head)",
                n: 1,
                per_token: shape.heads,
                expected: shape.heads,
                actual: s.len(),
            });
        }
    }
    kv_layer("KV cache layer", kv, layer, shape.kv_heads * hd)
}

/// Multi-head latent attention of `q` and the new cache vectors into `out` over
/// `layer` of `kv`.
pub fn latent(
    shape: &LatentShape,
    q: (usize, usize),
    kv_new: (usize, usize),
    out: (usize, usize),
    kv: &KvCache,
    layer: usize,
) -> Result<(), KernelError> {
    let n = q.0;
    let w = shape.rank + shape.rope;
    dims("latent attention queries", q, n, shape.heads * w)?;
    dims("latent attention cache vectors", kv_new, n, w)?;
    dims("latent attention output", out, n, shape.heads * shape.rank)?;
    kv_layer("latent KV cache layer", kv, layer, w)
}

fn kv_layer(
    what: &'static str,
    kv: &KvCache,
    layer: usize,
    width: usize,
) -> Result<(), KernelError> {
    if kv.width() != width || layer >= kv.layers() {
        return Err(KernelError::ActivationLen {
            what,
            n: kv.layers(),
            per_token: kv.width(),
            expected: width,
            actual: kv.width(),
        });
    }
    Ok(())
}

/// Multiply-adds of a product of `n` rows with a `rows × cols` weight matrix.
pub fn product_terms(n: usize, rows: usize, cols: usize) -> u64 {
    (n as u64) * (rows as u64) * (cols as u64)
}

/// Multiply-adds of attention of `n` queries at positions `pos0..pos0 + n` over
/// every position each sees (`window`: the last `w`, its own included), `heads`
/// heads of a `dk`-float score and a `dv`-float weighted sum per position seen.
pub fn attention_terms(
    n: usize,
    pos0: usize,
    window: Option<usize>,
    heads: usize,
    dk: usize,
    dv: usize,
) -> u64 {
    let seen: u64 = (0..n)
        .map(|t| {
            let all = (pos0 + t + 1) as u64;
            window.map_or(all, |w| all.min(w as u64))
        })
        .sum();
    seen * (heads as u64) * ((dk + dv) as u64)
}
