//! Element-wise and row-wise ops of the CPU backend: norms, rotary embedding,
//! attention, activations. Each output element is computed in one fixed order whatever
//! the number of rows (batch invariance, DESIGN.md invariant 6).
//!
//! Reductions whose result feeds many elements (RMSNorm's mean square, softmax's sum)
//! accumulate in f64: the f32 result is then the correctly rounded value, which is what
//! PyTorch's float32 reductions (pairwise, very accurate) approximate best.

pub use crate::backend::VecView;

/// RMSNorm of each row of `x` ([rows, dim]) into `out`, as transformers' LlamaRMSNorm:
/// `weight * (x * rsqrt(mean(x^2) + eps))`.
pub fn rms_norm(x: &[f32], dim: usize, weight: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert_eq!(weight.len(), dim);
    debug_assert_eq!(x.len(), out.len());
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let ss: f64 = xr.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let mean = (ss / dim as f64) as f32;
        let inv = 1.0f32 / (mean + eps).sqrt();
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = w * (v * inv);
        }
    }
}

/// In-place RMSNorm of each `dim`-sized chunk of `x` (per-head q/k norm of Qwen3).
pub fn rms_norm_inplace(x: &mut [f32], dim: usize, weight: &[f32], eps: f32) {
    for r in x.chunks_exact_mut(dim) {
        let ss: f64 = r.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let mean = (ss / dim as f64) as f32;
        let inv = 1.0f32 / (mean + eps).sqrt();
        for (v, &w) in r.iter_mut().zip(weight) {
            *v = w * (*v * inv);
        }
    }
}

/// `x += y`
pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Adds `bias` to every `bias.len()`-sized row of `x`.
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    for r in x.chunks_exact_mut(bias.len()) {
        add_inplace(r, bias);
    }
}

/// Every value clamped to `[-limit, limit]` (NaN stays NaN, as `torch.clamp_`).
pub fn clamp(x: &mut [f32], limit: f32) {
    for v in x {
        if *v > limit {
            *v = limit;
        } else if *v < -limit {
            *v = -limit;
        }
    }
}

/// Softmax of `row` in place: `exp(x - max) / sum`, the sum accumulated in order.
pub fn softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in row.iter_mut() {
        *v /= sum;
    }
}

/// Rotary embedding with `rotate_half` layout (Hugging Face): for a head vector of
/// size d and i < d/2, `(x_i, x_{i+d/2})` is rotated by the angle `pos * inv_freq_i`.
/// `cos`/`sin` hold the d/2 values for this position.
pub fn rope_head(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    let (a, b) = x.split_at_mut(half);
    for i in 0..half {
        let (x1, x2) = (a[i], b[i]);
        a[i] = x1 * cos[i] - x2 * sin[i];
        b[i] = x2 * cos[i] + x1 * sin[i];
    }
}

/// Rotary embedding of interleaved pairs `(x[2i], x[2i + 1])`, written back
/// de-interleaved: `x[i] = x0·cos − x1·sin`, `x[half + i] = x1·cos + x0·sin` (each
/// product rounded, then the sum), as transformers' `apply_rotary_pos_emb_interleave`.
pub fn rope_interleaved(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    let pairs: Vec<(f32, f32)> = (0..half).map(|i| (x[2 * i], x[2 * i + 1])).collect();
    for (i, (x0, x1)) in pairs.into_iter().enumerate() {
        x[i] = x0 * cos[i] - x1 * sin[i];
        x[half + i] = x1 * cos[i] + x0 * sin[i];
    }
}

/// `1 / (1 + exp(-x))` of every value, in float32.
pub fn sigmoid(x: &mut [f32]) {
    for v in x {
        *v = 1.0 / (1.0 + (-*v).exp());
    }
}

/// [`top_k`] of each of the `rows` rows of `x` (`cols` values each).
pub fn top_k_rows(x: &[f32], cols: usize, rows: usize, k: usize) -> Vec<Vec<(u32, f32)>> {
    if cols == 0 {
        return vec![Vec::new(); rows];
    }
    x.chunks_exact(cols).map(|row| top_k(row, k)).collect()
}

/// The `k` largest values of `row` with their index, largest first; ties go to the
/// lower index and NaN ranks below every number (so it is chosen only when fewer than
/// `k` numbers exist). `k` past the row's length gives the whole row, ordered.
pub fn top_k(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    use std::cmp::Ordering;
    // Descending by value, NaN last; then ascending by index: a total order.
    let before = |a: &(u32, f32), b: &(u32, f32)| -> Ordering {
        match (a.1.is_nan(), b.1.is_nan()) {
            (false, true) => Ordering::Less,
            (true, false) => Ordering::Greater,
            (true, true) => a.0.cmp(&b.0),
            (false, false) => b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)),
        }
    };
    let mut all: Vec<(u32, f32)> = row
        .iter()
        .enumerate()
        .map(|(i, &v)| (i as u32, v))
        .collect();
    let k = k.min(all.len());
    if k == 0 {
        return Vec::new();
    }
    if k < all.len() {
        all.select_nth_unstable_by(k - 1, before);
        all.truncate(k);
    }
    all.sort_unstable_by(before);
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_orders_by_value_then_index_with_nan_last() {
        let row = [1.0f32, f32::NAN, 3.0, 3.0, -0.0, 0.0, 2.0];
        assert_eq!(top_k(&row, 3), vec![(2, 3.0), (3, 3.0), (6, 2.0)]);
        // -0.0 == 0.0: the lower index first.
        let r = top_k(&row, 6);
        assert_eq!(
            r[3..].iter().map(|p| p.0).collect::<Vec<_>>(),
            vec![0, 4, 5]
        );
        let all = top_k(&row, 99);
        assert_eq!(all.len(), 7);
        assert_eq!(all[6].0, 1);
        assert!(top_k(&row, 0).is_empty());
    }

    #[test]
    fn rms_norm_matches_definition() {
        let x = [1.0f32, -2.0, 3.0, 0.5];
        let w = [1.0f32, 0.5, 2.0, -1.0];
        let mut out = [0f32; 4];
        rms_norm(&x, 4, &w, 1e-6, &mut out);
        let ms = (1.0 + 4.0 + 9.0 + 0.25) / 4.0;
        let inv = 1.0 / ((ms as f32) + 1e-6).sqrt();
        for i in 0..4 {
            assert_eq!(out[i], w[i] * (x[i] * inv));
        }
    }

    #[test]
    fn rope_rotates_pairs() {
        let mut x = [1.0f32, 0.0, 0.0, 1.0];
        let (c, s) = (0.0f32.cos(), 1.0f32.sin());
        rope_head(&mut x, &[1.0, c], &[0.0, s]);
        // pair (x0, x2) angle 0: unchanged; pair (x1, x3) = (0, 1) rotated by 1 rad.
        assert_eq!(x[0], 1.0);
        assert_eq!(x[2], 0.0);
        assert_eq!(x[1], -s);
        assert_eq!(x[3], c);
    }
}
