//! Causal (optionally sliding-window) grouped-query attention, and multi-head latent
//! attention, over the f32 KV layout of [`crate::kv::KvCache`], its pages read in
//! place.
//!
//! Each output row has one fixed order of arithmetic, whatever the tiling, the
//! threads, the page size and the other rows computed with it (batch invariance):
//! a score is [`super::matmul::dot_f32`] of the query and the key, times the scale;
//! a row's scores go through [`softmax::softmax`]; its output is the sum of
//! `probability × value` over the keys in increasing position from zero, one fused
//! multiply-add per term ([`super::matmul::weighted_sum`]).
//!
//! The work is tiled so that a long prompt streams its keys and values from the
//! cache once per block of queries, not once per query: a task is the heads that
//! share a KV head (one head in multi-head latent attention) and a block of
//! [`BLOCK_Q`] consecutive query positions; its keys are taken
//! [`BLOCK_K`] at a time (a block small enough to stay in the first-level cache),
//! and every row of the task computes its scores against the block (then, after the
//! softmax, adds its terms for the block) before the next block. Only the loop
//! order changes: each element's operations are the same, in the same order.

use std::cell::RefCell;

use super::grouped;
use super::matmul::Isa;
use super::softmax;
use super::threads::{SharedOut, ThreadPool};
use crate::backend::{AttentionShape, LatentShape};
use crate::kv::{KvView, PageRef};

/// Query positions per task.
pub const BLOCK_Q: usize = 16;
/// Keys a task's rows go through together.
pub const BLOCK_K: usize = 64;

thread_local! {
    /// A task's scores, reused across tasks on a thread.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Where a task's keys and values are: pages of `view` (keys and values may be the
/// same pages), each position's key `dk` floats from `k_off`, value `dv` floats from
/// `v_off`.
struct Cache<'a> {
    view: &'a KvView<'a>,
    keys: &'a [PageRef<'a>],
    values: &'a [PageRef<'a>],
    k_off: usize,
    v_off: usize,
}

/// Groups of rows (positions) from which AVX-512 transposes each block of keys once
/// for all of them (`packed_scores`) instead of scoring keys in place.
#[cfg(target_arch = "x86_64")]
const PACKED_GROUPS: usize = 4;

/// The most rows a group takes (at least [`Isa::attention_group`] of every set).
const GROUP_MAX: usize = 4;

impl Cache<'_> {
    /// `s[r][j - from] = q[r] · key_j * scale` for every row `r` and `j` in
    /// `from..from + s[r].len()` (rows of one length).
    fn scores(&self, isa: Isa, q: &[&[f32]], from: usize, scale: f32, s: &mut [&mut [f32]]) {
        let stride = self.view.width;
        let m = q.len();
        let mut at = 0;
        for (p, off, n) in self.view.segments(from, from + s[0].len()) {
            let keys = &self.keys[p][off * stride + self.k_off..];
            let mut part: [&mut [f32]; GROUP_MAX] = Default::default();
            for (d, r) in part.iter_mut().zip(s.iter_mut()) {
                *d = &mut r[at..at + n];
            }
            grouped::scores(isa, q, keys, stride, scale, &mut part[..m]);
            at += n;
        }
    }

    /// Pointers to the keys of positions `from..to` (at most [`BLOCK_K`]) in
    /// `out`: how many.
    #[cfg(target_arch = "x86_64")]
    fn key_ptrs(&self, from: usize, to: usize, out: &mut [*const f32; BLOCK_K]) -> usize {
        let stride = self.view.width;
        let mut at = 0;
        for (p, off, n) in self.view.segments(from, to) {
            let keys = &self.keys[p][off * stride + self.k_off..];
            for i in 0..n {
                out[at + i] = keys[i * stride..].as_ptr();
            }
            at += n;
        }
        at
    }

    /// `out[r] += Σ_j p[r][j - from] · value_j` for every row `r` and `j` in
    /// `from..from + p[r].len()`, in increasing `j` (rows of one length).
    fn add_values(&self, isa: Isa, p: &[&[f32]], from: usize, out: &mut [&mut [f32]]) {
        let stride = self.view.width;
        let m = p.len();
        let mut at = 0;
        for (pg, off, n) in self.view.segments(from, from + p[0].len()) {
            let values = &self.values[pg][off * stride + self.v_off..];
            let mut part: [&[f32]; GROUP_MAX] = [&[]; GROUP_MAX];
            for (d, r) in part.iter_mut().zip(p) {
                *d = &r[at..at + n];
            }
            grouped::weighted_sums(isa, &part[..m], values, stride, out);
            at += n;
        }
    }
}

/// One row of a task: its query, the keys it attends (`lo..hi`), its output.
struct Row<'a> {
    q: &'a [f32],
    lo: usize,
    hi: usize,
    /// The head's sink logit, where the layer has sinks.
    sink: Option<f32>,
    out: &'a mut [f32],
}

/// Consecutive rows that attend the same keys with queries of one length (the
/// heads of one position), at most `g` of them: `(first row, rows)`.
fn groups(rows: &[Row<'_>], g: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < rows.len() {
        let r = &rows[i];
        let mut m = 1;
        while m < g
            && rows
                .get(i + m)
                .is_some_and(|n| (n.lo, n.hi) == (r.lo, r.hi) && n.q.len() == r.q.len())
        {
            m += 1;
        }
        out.push((i, m));
        i += m;
    }
    out
}

/// Attention of `rows` over `cache`, tiled over keys ([`BLOCK_K`]) as the module
/// says, with `scores` as scratch; the rows of one position go through each key
/// and value together ([`grouped`]).
fn attend_rows(
    isa: Isa,
    cache: &Cache<'_>,
    rows: &mut [Row<'_>],
    scale: f32,
    scores: &mut Vec<f32>,
) {
    let Some(lo) = rows.iter().map(|r| r.lo).min() else {
        return;
    };
    let hi = rows.iter().map(|r| r.hi).max().unwrap_or(lo);
    let width = rows.iter().map(|r| r.hi - r.lo).max().unwrap_or(0);
    if scores.len() < rows.len() * width {
        scores.resize(rows.len() * width, 0.0);
    }
    let groups = groups(rows, isa.attention_group().min(GROUP_MAX));
    #[cfg(target_arch = "x86_64")]
    let d = rows[0].q.len();
    // The scores of every group for keys kb..ke; with `kt`, from the block
    // transposed (`packed_scores`).
    let mut score_groups = |kb: usize, ke: usize, kt: Option<&[f32]>| {
        for &(i, m) in &groups {
            let r = &rows[i];
            let (a, b) = (kb.max(r.lo), ke.min(r.hi));
            if a >= b {
                continue;
            }
            let mut q: [&[f32]; GROUP_MAX] = [&[]; GROUP_MAX];
            for (d, row) in q.iter_mut().zip(&rows[i..i + m]) {
                *d = row.q;
            }
            let mut s: [&mut [f32]; GROUP_MAX] = Default::default();
            for (d, chunk) in s
                .iter_mut()
                .zip(scores[i * width..(i + m) * width].chunks_mut(width))
            {
                *d = &mut chunk[a - r.lo..b - r.lo];
            }
            match kt {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `kt` is only given where the CPU has AVX-512 (below), as
                // the block kb..ke of `d`-float keys transposed into `with_block`'s
                // scratch with rows of BLOCK_K; every query has `d` floats, every
                // score row b - a, and a - kb < b - kb <= ke - kb <= BLOCK_K.
                Some(kt) => unsafe {
                    super::packed_scores::scores(
                        &q[..m],
                        kt,
                        d,
                        BLOCK_K,
                        a - kb..b - kb,
                        scale,
                        &mut s[..m],
                    )
                },
                _ => cache.scores(isa, &q[..m], a, scale, &mut s[..m]),
            }
        }
    };
    // Scores, a block of keys at a time.
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut score_blocks = |mut kt: Option<&mut [f32]>| {
        let mut kb = lo;
        while kb < hi {
            let ke = (kb + BLOCK_K).min(hi);
            #[cfg(target_arch = "x86_64")]
            if let Some(kt) = kt.as_deref_mut() {
                let mut ptrs = [std::ptr::null(); BLOCK_K];
                let m = cache.key_ptrs(kb, ke, &mut ptrs);
                // SAFETY: `kt` is only given where the CPU has AVX-512 (below);
                // each key holds `d` floats (the rows' query length), m <= BLOCK_K,
                // and `kt` is `with_block`'s scratch for `d` and BLOCK_K.
                unsafe { super::packed_scores::transpose(&ptrs[..m], d, BLOCK_K, kt) };
            }
            score_groups(kb, ke, kt.as_deref());
            kb = ke;
        }
    };
    // Transposing a block pays where several positions share it.
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && groups.len() >= PACKED_GROUPS {
        super::packed_scores::with_block(d, BLOCK_K, |kt| score_blocks(Some(kt)));
    } else {
        score_blocks(None);
    }
    #[cfg(not(target_arch = "x86_64"))]
    score_blocks(None);
    for (i, r) in rows.iter_mut().enumerate() {
        softmax::softmax_sink(
            isa,
            &mut scores[i * width..i * width + (r.hi - r.lo)],
            r.sink,
        );
        r.out.fill(0.0);
    }
    // Values, a block at a time, each row's terms in increasing position.
    let mut kb = lo;
    while kb < hi {
        let ke = (kb + BLOCK_K).min(hi);
        for &(i, m) in &groups {
            let (rlo, rhi) = (rows[i].lo, rows[i].hi);
            let (a, b) = (kb.max(rlo), ke.min(rhi));
            if a >= b {
                continue;
            }
            let mut p: [&[f32]; GROUP_MAX] = [&[]; GROUP_MAX];
            for (d, chunk) in p
                .iter_mut()
                .zip(scores[i * width..(i + m) * width].chunks(width))
            {
                *d = &chunk[a - rlo..b - rlo];
            }
            let mut out: [&mut [f32]; GROUP_MAX] = Default::default();
            for (d, row) in out.iter_mut().zip(rows[i..i + m].iter_mut()) {
                *d = &mut *row.out;
            }
            cache.add_values(isa, &p[..m], a, &mut out[..m]);
        }
        kb = ke;
    }
}

/// Runs `task(head, t0..t1, scores)` for every head (or group of heads) and block
/// of [`BLOCK_Q`] query positions of `n`, on the pool, the longest blocks (the last
/// positions attend the most keys) first.
fn for_each_task(
    pool: &ThreadPool,
    heads: usize,
    n: usize,
    task: impl Fn(usize, std::ops::Range<usize>, &mut Vec<f32>) + Sync,
) {
    let blocks = n.div_ceil(BLOCK_Q);
    pool.for_each_chunk_grain(blocks * heads, 1, |range| {
        SCORES.with(|s| {
            let mut s = s.borrow_mut();
            for t in range {
                let block = blocks - 1 - t / heads;
                let t0 = block * BLOCK_Q;
                task(t % heads, t0..(t0 + BLOCK_Q).min(n), &mut s);
            }
        })
    });
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
    let sinks = shape.sinks.as_deref();
    let out_ptr = SharedOut(out.as_mut_ptr());
    // A task takes the heads that share a KV head, so that each key and value it
    // streams serves all of them.
    for_each_task(pool, shape.kv_heads, n, |kvh, ts, scores| {
        let cache = Cache {
            view: kv,
            keys: &kv.k,
            values: &kv.v,
            k_off: kvh * hd,
            v_off: kvh * hd,
        };
        let heads_of = kvh * group..(kvh + 1) * group;
        let mut rows: Vec<Row<'_>> = ts
            .flat_map(|t| heads_of.clone().map(move |head| (t, head)))
            .map(|(t, head)| {
                let pos = pos0 + t;
                // SAFETY: each task writes only the `hd`-sized slices of `out` of its
                // own heads and query positions, disjoint from every other task's,
                // and `out` outlives `for_each_chunk_grain`, which returns only
                // after every task has finished.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(out_ptr.get().add(t * qd + head * hd), hd)
                };
                Row {
                    q: &q[t * qd + head * hd..t * qd + (head + 1) * hd],
                    lo: window.map_or(0, |w| (pos + 1).saturating_sub(w)),
                    hi: pos + 1,
                    sink: sinks.map(|s| s[head]),
                    out: dst,
                }
            })
            .collect();
        attend_rows(isa, &cache, &mut rows, scale, scores);
    });
}

/// Multi-head latent attention of `n` new queries `q` (`n × heads·(rank+rope)`) at
/// positions `pos0..pos0+n` over the cache vectors `cache` of positions `0..pos0+n`
/// (`rank + rope` floats each: the latent, then the rotary key), into `out`
/// (`n × heads·rank`): scores are dot products with whole cache vectors, values the
/// latents. Tiled and ordered as [`attend`]. The caller checked every length.
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
    let out_ptr = SharedOut(out.as_mut_ptr());
    for_each_task(pool, heads, n, |head, ts, scores| {
        let c = Cache {
            view: cache,
            keys: &cache.k,
            values: &cache.k,
            k_off: 0,
            v_off: 0,
        };
        let mut rows: Vec<Row<'_>> = ts
            .map(|t| {
                // SAFETY: each task writes only the `rank`-sized slices of `out` of
                // its own head and query positions, disjoint from every other task's,
                // and `out` outlives `for_each_chunk_grain`, which returns only after
                // every task has finished.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(out_ptr.get().add(t * od + head * rank), rank)
                };
                Row {
                    q: &q[t * qd + head * w..t * qd + (head + 1) * w],
                    lo: 0,
                    hi: pos0 + t + 1,
                    sink: None,
                    out: dst,
                }
            })
            .collect();
        attend_rows(isa, &c, &mut rows, shape.scale, scores);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::matmul::{attention_scores_isa, weighted_sum_isa};
    use crate::kv::KvCache;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// The untiled reference: one row at a time over one contiguous copy of the
    /// cache.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        isa: Isa,
        shape: &AttentionShape,
        q: &[f32],
        kc: &[f32],
        vc: &[f32],
        pos0: usize,
        n: usize,
    ) -> Vec<f32> {
        let hd = shape.head_dim;
        let (qd, kvd) = (shape.heads * hd, shape.kv_heads * hd);
        let group = shape.heads / shape.kv_heads;
        let scale = (hd as f32).powf(-0.5);
        let mut out = vec![0f32; n * qd];
        for t in 0..n {
            for head in 0..shape.heads {
                let pos = pos0 + t;
                let lo = shape.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                let base = lo * kvd + (head / group) * hd;
                let mut s = vec![0f32; pos + 1 - lo];
                let qv = &q[t * qd + head * hd..t * qd + (head + 1) * hd];
                attention_scores_isa(isa, qv, &kc[base..], kvd, scale, &mut s);
                softmax::softmax_sink(isa, &mut s, shape.sinks.as_ref().map(|s| s[head]));
                let dst = &mut out[t * qd + head * hd..t * qd + (head + 1) * hd];
                weighted_sum_isa(isa, &s, &vc[base..], kvd, dst);
            }
        }
        out
    }

    /// Tiles, pages, threads and windows change no bit of any row: every output
    /// equals the untiled one-row-at-a-time computation.
    #[test]
    fn tiled_paged_attention_has_the_bits_of_one_row_at_a_time() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for isa in Isa::available() {
            // Groups of 3 query heads per KV head, then 1, 4 and 5 (every group
            // size of the grouped kernels, and more).
            for (heads, threads, page, window, pos0, n) in [
                (6, 1, 128, None, 0, 1),
                (6, 2, 7, None, 0, 3 * BLOCK_Q + 5),
                (6, 2, 64, Some(20), 30, 2 * BLOCK_Q),
                (6, 3, 1, None, 100, 1),
                (6, 2, 16, Some(BLOCK_K + 3), 0, 4 * BLOCK_K + 1),
                (2, 2, 32, None, 5, 2 * BLOCK_Q + 3),
                (8, 2, 32, None, 0, 2 * BLOCK_K + 9),
                (10, 1, 128, Some(40), 3, BLOCK_K + 1),
            ] {
                // Heads of 12 (a tail of four) and 40 (AVX-512 transposes keys sixteen
                // dimensions at a time, then eight, then the tail).
                // Without sinks and with (gpt-oss).
                for (hd, with_sinks) in [(12, false), (40, false), (12, true), (40, true)] {
                    let sinks: Option<std::sync::Arc<[f32]>> =
                        with_sinks.then(|| (0..heads).map(|h| h as f32 * 0.7 - 1.5).collect());
                    let shape = AttentionShape {
                        heads,
                        kv_heads: 2,
                        head_dim: hd,
                        window,
                        sinks,
                    };
                    let (qd, kvd) = (heads * hd, 2 * hd);
                    let total = pos0 + n;
                    let mut r =
                        |len| -> Vec<f32> { (0..len).map(|_| rng.gen_range(-2.0..2.0)).collect() };
                    let (kc, vc, q) = (r(total * kvd), r(total * kvd), r(n * qd));
                    let mut kv = KvCache::with_page(1, kvd, total, page);
                    kv.append(0, &kc, &vc).unwrap();
                    kv.commit(&vec![0; total]);
                    let pool = ThreadPool::new(threads).unwrap();
                    let mut out = vec![0f32; n * qd];
                    attend(
                        isa,
                        &pool,
                        &shape,
                        &q,
                        &kv.layer(0).unwrap(),
                        pos0,
                        n,
                        &mut out,
                    );
                    let want = reference(isa, &shape, &q, &kc, &vc, pos0, n);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                    bits(&out),
                    bits(&want),
                    "{isa:?}, {heads} heads of {hd}, {threads} threads, pages of {page}, window {window:?}, {n} queries from {pos0}, sinks {with_sinks}"
                );
                }
            }
        }
    }
}
