//! The KV cache: per layer, the rotated keys and the values of every position so far,
//! in f32, laid out `[position][kv_head][head_dim]`, in pages of a fixed number of
//! positions.
//!
//! A layer's keys (and values) are a list of closed pages, each exactly `page`
//! positions, immutable and shareable (`Arc`: a sequence that repeats another's
//! prefix can hold the same pages), and one open page that grows as positions are
//! appended and closes when full. Cutting positions off reopens the page the cut
//! falls in as a private copy of its first positions; the pages it shared are not
//! touched.
//!
//! Memory grows with the positions computed, never with the capacity: a capacity is a
//! bound (the context limit, at most `max_position_embeddings`), so a config's context
//! length sizes no allocation, and the open page grows as it fills. The layer count
//! and width come from a config checked against the checkpoint
//! (`model::llama::Llama::load`).

use std::sync::Arc;

use super::KernelError;

/// Positions per KV page unless a cache is made with another size.
pub const DEFAULT_PAGE_POSITIONS: usize = 128;

/// One layer's keys or values: closed pages and the open one.
#[derive(Clone, Default)]
struct Half {
    closed: Vec<Arc<[f32]>>,
    open: Vec<f32>,
}

impl Half {
    /// Floats held.
    fn floats(&self) -> usize {
        self.closed.iter().map(|p| p.len()).sum::<usize>() + self.open.len()
    }

    /// Appends `x` (whole positions of `width` floats), closing pages of `per` floats
    /// as they fill.
    fn extend(&mut self, mut x: &[f32], per: usize) {
        while !x.is_empty() {
            let take = (per - self.open.len()).min(x.len());
            self.open.extend_from_slice(&x[..take]);
            x = &x[take..];
            if self.open.len() == per {
                let page: Arc<[f32]> = std::mem::take(&mut self.open).into();
                self.closed.push(page);
            }
        }
    }

    /// Keeps the first `floats` floats (whole pages shared as they are; the page the
    /// cut falls in copied into the open page).
    fn truncate(&mut self, floats: usize, per: usize) {
        if floats >= self.floats() {
            return;
        }
        let pages = floats / per;
        let rest = floats % per;
        if pages < self.closed.len() {
            self.open.clear();
            self.open.extend_from_slice(&self.closed[pages][..rest]);
            self.closed.truncate(pages);
        } else {
            self.open.truncate(rest);
        }
    }

    /// Every page, closed ones first, the open one last (if it holds anything).
    fn pages(&self) -> Vec<&[f32]> {
        let mut v: Vec<&[f32]> = self.closed.iter().map(|p| &p[..]).collect();
        if !self.open.is_empty() {
            v.push(&self.open);
        }
        v
    }
}

/// One layer's keys and values as pages, for attention: position `j` is at
/// `pages[j / page]`, from float `(j % page) * width`. Every page but the last holds
/// exactly `page` positions.
pub struct KvView<'a> {
    /// Positions per page.
    pub page: usize,
    /// Floats per position.
    pub width: usize,
    /// Positions held (committed and appended).
    pub len: usize,
    pub k: Vec<&'a [f32]>,
    /// Empty where the layer keeps keys only (multi-head latent attention).
    pub v: Vec<&'a [f32]>,
}

impl KvView<'_> {
    /// The positions of `lo..hi` split by page: `(page index, first position in the
    /// page, positions)` for each page the range touches, in order.
    pub fn segments(&self, lo: usize, hi: usize) -> impl Iterator<Item = (usize, usize, usize)> {
        let page = self.page;
        let mut at = lo;
        std::iter::from_fn(move || {
            if at >= hi {
                return None;
            }
            let p = at / page;
            let off = at % page;
            let n = (page - off).min(hi - at);
            at += n;
            Some((p, off, n))
        })
    }
}

#[derive(Clone)]
pub struct KvCache {
    /// Floats per position per layer (`kv_heads * head_dim`).
    width: usize,
    capacity: usize,
    len: usize,
    /// Positions per page.
    page: usize,
    k: Vec<Half>,
    v: Vec<Half>,
}

impl KvCache {
    /// An empty cache for `layers` layers of `width` floats per position, holding at most
    /// `capacity` positions, in pages of [`DEFAULT_PAGE_POSITIONS`]. Allocates `layers`
    /// empty lists, nothing per position.
    pub fn new(layers: usize, width: usize, capacity: usize) -> Self {
        Self::with_page(layers, width, capacity, DEFAULT_PAGE_POSITIONS)
    }

    /// [`KvCache::new`] with pages of `page` positions (at least one).
    pub fn with_page(layers: usize, width: usize, capacity: usize, page: usize) -> Self {
        KvCache {
            width,
            capacity,
            len: 0,
            page: page.max(1),
            k: vec![Half::default(); layers],
            v: vec![Half::default(); layers],
        }
    }

    /// Positions stored (in every layer once a forward pass completes).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Floats per position per layer (`kv_heads * head_dim`).
    pub fn width(&self) -> usize {
        self.width
    }

    /// Positions per page.
    pub fn page_positions(&self) -> usize {
        self.page
    }

    /// Layers it holds.
    pub fn layers(&self) -> usize {
        self.k.len()
    }

    /// Bytes held by keys and values.
    pub fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|x| x.floats() * 4).sum()
    }

    /// Bytes it holds that are not in pages `seen` lists (closed pages by address,
    /// added to `seen`; its open pages are its own): what it adds beside caches that
    /// share its pages.
    pub fn bytes_not_in(&self, seen: &mut std::collections::HashSet<usize>) -> usize {
        let mut bytes = 0;
        for half in self.k.iter().chain(&self.v) {
            for p in &half.closed {
                if seen.insert(p.as_ptr() as usize) {
                    bytes += p.len() * 4;
                }
            }
            bytes += half.open.len() * 4;
        }
        bytes
    }

    /// Positions `layer` holds: the committed ones and those appended since.
    pub fn layer_len(&self, layer: usize) -> usize {
        self.k[layer].floats() / self.width.max(1)
    }

    /// Appends `n` positions of keys and values to `layer`, after those it holds
    /// ([`KvCache::layer_len`]): a pass computing its positions in chunks appends
    /// each chunk in turn. `v` is empty for a layer of keys only.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<(), KernelError> {
        let n = k.len() / self.width.max(1);
        let held = self.layer_len(layer);
        if held + n > self.capacity {
            return Err(KernelError::ContextFull {
                cached: held,
                new: n,
                limit: self.capacity,
            });
        }
        debug_assert!(held >= self.len);
        let per = self.page * self.width;
        self.k[layer].extend(k, per);
        self.v[layer].extend(v, per);
        Ok(())
    }

    /// Marks `n` appended positions as committed (after every layer appended them).
    pub fn commit(&mut self, n: usize) {
        self.len += n;
    }

    /// Keys and values of `layer` by page, including positions appended but not yet
    /// committed.
    pub fn layer(&self, layer: usize) -> KvView<'_> {
        KvView {
            page: self.page,
            width: self.width,
            len: self.layer_len(layer),
            k: self.k[layer].pages(),
            v: self.v[layer].pages(),
        }
    }

    /// Drops positions from `len` on (rejected proposals, a failed pass's appended
    /// positions, a prompt prefix reused): every layer keeps at most `len` of its
    /// committed positions.
    pub fn truncate(&mut self, len: usize) {
        let len = len.min(self.len);
        let per = self.page * self.width;
        for x in self.k.iter_mut().chain(self.v.iter_mut()) {
            // A layer of keys only holds no values: nothing to cut there.
            if x.floats() > 0 {
                x.truncate(len * self.width, per);
            }
        }
        self.len = len;
    }

    pub fn clear(&mut self) {
        self.truncate(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_reserves_nothing_for_its_capacity() {
        // Issue 8: a context of 2^24 positions must cost nothing until it is used.
        let mut kv = KvCache::new(2, 4, 1 << 24);
        assert_eq!((kv.capacity(), kv.bytes()), (1 << 24, 0));
        kv.append(0, &[1.0; 8], &[2.0; 8]).unwrap();
        kv.append(1, &[1.0; 8], &[2.0; 8]).unwrap();
        kv.commit(2);
        assert_eq!((kv.len(), kv.bytes()), (2, 2 * 2 * 8 * 4));
    }

    #[test]
    fn appending_past_the_capacity_is_an_error() {
        let mut kv = KvCache::new(1, 2, 2);
        let e = kv.append(0, &[0.0; 6], &[0.0; 6]).unwrap_err();
        assert!(e.to_string().contains("limit of 2"), "{e}");
        assert_eq!(kv.bytes(), 0);
    }

    /// Positions land in pages of the page size, in order, across appends of any
    /// length; a cut reopens the page it falls in as a copy, leaving a clone that
    /// shares the pages untouched.
    #[test]
    fn pages_hold_the_positions_in_order_and_cuts_copy_on_write() {
        let (w, page) = (3, 4);
        let mut kv = KvCache::with_page(1, w, 100, page);
        let pos = |j: usize| -> Vec<f32> { (0..w).map(|c| (j * 10 + c) as f32).collect() };
        let mut j = 0;
        for n in [1, 5, 2, 3] {
            let k: Vec<f32> = (j..j + n).flat_map(pos).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            kv.append(0, &k, &v).unwrap();
            kv.commit(n);
            j += n;
        }
        let check = |kv: &KvCache, len: usize| {
            let view = kv.layer(0);
            assert_eq!(view.len, len);
            assert_eq!(view.k.len(), len.div_ceil(page));
            for i in 0..len {
                let p = view.k[i / page];
                let at = (i % page) * w;
                assert_eq!(&p[at..at + w], &pos(i)[..], "position {i}");
                assert_eq!(view.v[i / page][at], -(i as f32 * 10.0));
            }
            for p in &view.k[..view.k.len().saturating_sub(1)] {
                assert_eq!(p.len(), page * w);
            }
        };
        check(&kv, 11);
        let shared = kv.clone();
        kv.truncate(6);
        check(&kv, 6);
        check(&shared, 11);
        kv.append(0, &pos(6), &pos(6).iter().map(|x| -x).collect::<Vec<_>>())
            .unwrap();
        kv.commit(1);
        check(&kv, 7);
        kv.truncate(4);
        check(&kv, 4);
        assert_eq!(kv.bytes(), 2 * 4 * w * 4);
        let view = kv.layer(0);
        let segs: Vec<_> = view.segments(1, 4).collect();
        assert_eq!(segs, vec![(0, 1, 3)]);
        let view = shared.layer(0);
        let segs: Vec<_> = view.segments(2, 11).collect();
        assert_eq!(segs, vec![(0, 2, 2), (1, 0, 4), (2, 0, 3)]);
    }
}
