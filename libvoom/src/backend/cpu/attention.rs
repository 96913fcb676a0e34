//! Causal (optionally sliding-window) grouped-query attention over the f32 KV
//! layout of [`crate::kv::KvCache`] (its pages read in place), one fixed loop per
//! output row: a key's score and a value's term are the same whatever page holds
//! them, and values are summed in position order across pages.

use super::matmul::{attention_scores_isa, weighted_sum_add_isa, Isa};
use super::ops;
use super::threads::ThreadPool;
use crate::backend::{AttentionShape, LatentShape};
use crate::kv::KvView;

/// `s[j - lo] = q · key_j * scale` for `j` in `lo..lo + s.len()`, the keys at
/// `offset` floats into each position of `pages`.
#[allow(clippy::too_many_arguments)]
fn scores_paged(
    isa: Isa,
    q: &[f32],
    pages: &[&[f32]],
    view: &KvView<'_>,
    offset: usize,
    lo: usize,
    scale: f32,
    s: &mut [f32],
) {
    let stride = view.width;
    let mut at = 0;
    for (p, from, n) in view.segments(lo, lo + s.len()) {
        let keys = &pages[p][from * stride + offset..];
        attention_scores_isa(isa, q, keys, stride, scale, &mut s[at..at + n]);
        at += n;
    }
}

/// `out = Σ_j p[j - lo] · value_j` in increasing `j` from zero, the values at
/// `offset` floats into each position of `pages`.
fn weighted_sum_paged(
    isa: Isa,
    p: &[f32],
    pages: &[&[f32]],
    view: &KvView<'_>,
    offset: usize,
    lo: usize,
    out: &mut [f32],
) {
    let stride = view.width;
    out.fill(0.0);
    let mut at = 0;
    for (pg, from, n) in view.segments(lo, lo + p.len()) {
        let values = &pages[pg][from * stride + offset..];
        weighted_sum_add_isa(isa, &p[at..at + n], values, stride, out);
        at += n;
    }
}

/// Attention of `n` new queries `q` (`n × heads·head_dim`) at positions
/// `pos0..pos0+n` over the cached keys and values `kv` of positions `0..pos0+n`
/// (`kv_heads·head_dim` floats each), into `out` (`n × heads·head_dim`).
/// The caller checked every length.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend(
    isa: Isa,
    pool: &ThreadPool,
    shape: &AttentionShape,
    q: &[f32],
    kv: &KvView<'_>,
    pos0: usize,
    n: usize,
    out: &mut [f32],
) {
    let hd = shape.head_dim;
    let heads = shape.heads;
    let group = heads / shape.kv_heads;
    let qd = heads * hd;
    let scale = (hd as f32).powf(-0.5);
    let window = shape.window;
    // One task per (token, head): each output row is computed by one fixed loop.
    let tasks = n * heads;
    let out_ptr = SendPtr(out.as_mut_ptr());
    let max_keys = window.map_or(pos0 + n, |w| w.min(pos0 + n));
    pool.for_each_chunk(tasks, |range| {
        let mut scores = vec![0f32; max_keys];
        for task in range {
            let (t, head) = (task / heads, task % heads);
            let pos = pos0 + t;
            let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let kvh = head / group;
            let qv = &q[t * qd + head * hd..t * qd + (head + 1) * hd];
            let s = &mut scores[..pos + 1 - lo];
            scores_paged(isa, qv, &kv.k, kv, kvh * hd, lo, scale, s);
            ops::softmax_inplace(s);
            // SAFETY: each task writes only its own disjoint `hd`-sized slice of `out`
            // (row t, head `head`), and `out` outlives `for_each_chunk`, which returns
            // only after every task has finished.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(out_ptr.get().add(t * qd + head * hd), hd)
            };
            weighted_sum_paged(isa, s, &kv.v, kv, kvh * hd, lo, dst);
        }
    });
}

/// Multi-head latent attention of `n` new queries `q` (`n × heads·(rank+rope)`) at
/// positions `pos0..pos0+n` over the cache vectors `cache` of positions `0..pos0+n`
/// (`rank + rope` floats each: the latent, then the rotary key), into `out`
/// (`n × heads·rank`): scores are dot products with whole cache vectors, values the
/// latents. One fixed loop per output row, as [`attend`]. The caller checked every
/// length.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend_latent(
    isa: Isa,
    pool: &ThreadPool,
    shape: &LatentShape,
    q: &[f32],
    cache: &KvView<'_>,
    pos0: usize,
    n: usize,
    out: &mut [f32],
) {
    let (heads, rank) = (shape.heads, shape.rank);
    let w = rank + shape.rope;
    let (qd, od) = (heads * w, heads * rank);
    let tasks = n * heads;
    let out_ptr = SendPtr(out.as_mut_ptr());
    pool.for_each_chunk(tasks, |range| {
        let mut scores = vec![0f32; pos0 + n];
        for task in range {
            let (t, head) = (task / heads, task % heads);
            let pos = pos0 + t;
            let qv = &q[t * qd + head * w..t * qd + (head + 1) * w];
            let s = &mut scores[..pos + 1];
            scores_paged(isa, qv, &cache.k, cache, 0, 0, shape.scale, s);
            ops::softmax_inplace(s);
            // SAFETY: each task writes only its own disjoint `rank`-sized slice of
            // `out` (row t, head `head`), and `out` outlives `for_each_chunk`, which
            // returns only after every task has finished.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(out_ptr.get().add(t * od + head * rank), rank)
            };
            weighted_sum_paged(isa, s, &cache.k, cache, 0, 0, dst);
        }
    });
}

/// A raw pointer that may cross threads; users guarantee disjoint writes.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: only used to hand disjoint output slices to pool tasks (see `attend`).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}
