//! The KV cache: per layer, the rotated keys and the values of every position so far,
//! in f32, laid out `[position][kv_head][head_dim]`, in pages of a fixed number of
//! positions.
//!
//! A layer's keys (and values) are a list of closed pages, each exactly `page`
//! positions, immutable and shareable ([`page::KvPage`] behind an `Arc`: a sequence
//! that repeats another's prefix holds the same pages), and one open page that grows
//! as positions are appended and closes when full. Cutting positions off reopens the
//! page the cut falls in as a private copy of its first positions; the pages it
//! shared are not touched.
//!
//! Memory grows with the positions computed, never with the capacity: a capacity is a
//! bound (the context limit, at most `max_position_embeddings`), so a config's context
//! length sizes no allocation, and the open page grows as it fills. The layer count
//! and width come from a config checked against the checkpoint
//! (`model::llama::Llama::load`).
//!
//! A cache made with a [`KvPool`] has its closed pages counted in the pool's byte
//! budget and spilled to the pool's file beyond it ([`spill`]); viewing a layer for
//! attention reads its spilled pages back (read ahead while the layer before
//! computes). A page whose copy on disk fails its checksum is never used: the cache
//! marks its positions from that page on as lost ([`KvCache::lost`]) and keeps
//! their token ids ([`KvCache::ids`]) so that the engine recomputes them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::KernelError;

pub mod page;
pub mod recurrent;
pub mod spill;

pub use page::{Floats, KvPage, PageRef};
pub use recurrent::{LayerState, StateShape, States};
pub use spill::{KvPool, KvPoolStats};

/// Positions per KV page unless a cache is made with another size.
pub const DEFAULT_PAGE_POSITIONS: usize = 128;

/// One layer's keys or values: closed pages and the open one.
#[derive(Clone, Default)]
struct Half {
    closed: Vec<Arc<KvPage>>,
    open: Vec<f32>,
    /// Leading closed pages dropped behind a sliding window (stand-ins).
    dropped: usize,
}

impl Half {
    /// Floats of its positions (dropped ones included).
    fn floats(&self) -> usize {
        self.closed.iter().map(|p| p.floats()).sum::<usize>() + self.open.len()
    }

    /// Floats it holds (dropped ones not included).
    fn held_floats(&self) -> usize {
        self.closed[self.dropped.min(self.closed.len())..]
            .iter()
            .map(|p| p.floats())
            .sum::<usize>()
            + self.open.len()
    }

    /// Replaces the closed pages before page `keep` by stand-ins.
    fn drop_before(&mut self, keep: usize) {
        let keep = keep.min(self.closed.len());
        while self.dropped < keep {
            let n = self.closed[self.dropped].floats();
            self.closed[self.dropped] = KvPage::dropped(n);
            self.dropped += 1;
        }
    }

    /// Appends `x` (whole positions of `width` floats), closing pages of `per` floats
    /// as they fill; the pages closed are pushed to `closed_now`.
    fn extend(
        &mut self,
        mut x: &[f32],
        per: usize,
        pool: Option<&KvPool>,
        closed_now: &mut Vec<Arc<KvPage>>,
    ) {
        while !x.is_empty() {
            if self.open.capacity() < per {
                self.open.reserve_exact(per - self.open.len());
            }
            let take = (per - self.open.len()).min(x.len());
            self.open.extend_from_slice(&x[..take]);
            x = &x[take..];
            if self.open.len() == per {
                let page = KvPage::new(
                    std::mem::take(&mut self.open),
                    pool.map(|p| Arc::clone(&p.shared)),
                );
                self.closed.push(Arc::clone(&page));
                closed_now.push(page);
            }
        }
    }

    /// Keeps the first `floats` floats (whole pages shared as they are; the page the
    /// cut falls in copied into the open page). `Err` (the page index) when that
    /// page cannot be read: the half then keeps the whole pages before it only.
    fn truncate(&mut self, floats: usize, per: usize) -> Result<(), usize> {
        if floats >= self.floats() {
            return Ok(());
        }
        let pages = floats / per;
        let rest = floats % per;
        self.dropped = self.dropped.min(pages);
        if pages < self.closed.len() {
            self.open.clear();
            let cut = if rest > 0 {
                self.closed[pages].get().map_err(|_| pages)
            } else {
                Ok(Arc::new(Floats::Heap(Box::new([]))))
            };
            self.closed.truncate(pages);
            self.open.extend_from_slice(&cut?[..rest]);
        } else {
            self.open.truncate(rest);
        }
        Ok(())
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
    pub k: Vec<PageRef<'a>>,
    /// Empty where the layer keeps keys only (multi-head latent attention).
    pub v: Vec<PageRef<'a>>,
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

/// Spilled pages read back for the layer viewed last, kept while that layer is
/// viewed again (a prompt computed in chunks views each layer once per chunk).
#[derive(Default)]
struct Held {
    layer: usize,
    pages: HashMap<usize, Arc<Floats>>,
}

/// Layers read ahead of the one viewed (as far as the pool's window allows).
const READ_AHEAD_LAYERS: usize = 2;

pub struct KvCache {
    /// Floats per position per layer (`kv_heads * head_dim`).
    width: usize,
    capacity: usize,
    len: usize,
    /// Positions per page.
    page: usize,
    k: Vec<Half>,
    v: Vec<Half>,
    /// The token id of each committed position (to recompute lost ones).
    ids: Vec<u32>,
    /// The first position whose keys or values were lost (`usize::MAX`: none).
    lost: AtomicUsize,
    pool: Option<KvPool>,
    held: Mutex<Held>,
    /// Each layer's sliding window, where it has one (empty: none has).
    windows: Vec<Option<usize>>,
    /// Linear-attention layers' recurrent states (a hybrid model's; empty: none).
    states: States,
}

impl Clone for KvCache {
    fn clone(&self) -> Self {
        KvCache {
            width: self.width,
            capacity: self.capacity,
            len: self.len,
            page: self.page,
            k: self.k.clone(),
            v: self.v.clone(),
            ids: self.ids.clone(),
            lost: AtomicUsize::new(self.lost.load(Ordering::Relaxed)),
            pool: self.pool.clone(),
            held: Mutex::default(),
            windows: self.windows.clone(),
            states: self.states.clone(),
        }
    }
}

impl Drop for KvCache {
    fn drop(&mut self) {
        // Copies read ahead for this cache are of no use to the others sharing the
        // pages (they read their own when they need them).
        if let Some(pool) = &self.pool {
            for half in self.k.iter().chain(&self.v) {
                for p in &half.closed {
                    pool.shared.unstage(p);
                }
            }
        }
    }
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
            ids: Vec::new(),
            lost: AtomicUsize::new(usize::MAX),
            pool: None,
            held: Mutex::default(),
            windows: Vec::new(),
            states: States::default(),
        }
    }

    /// This (empty) cache with a recurrent state for each layer `shapes` gives one
    /// (a hybrid model's linear-attention layers, which append no keys or values).
    pub fn with_states(mut self, shapes: &[Option<StateShape>]) -> Self {
        debug_assert!(self.len == 0 && shapes.len() == self.layers());
        self.states = States::new(shapes);
        self
    }

    /// Whether layer `layer` holds a recurrent state (no keys or values).
    pub fn is_state_layer(&self, layer: usize) -> bool {
        self.states.layer(layer).is_some()
    }

    /// Layers holding a recurrent state, and floats of one copy of all of them.
    pub fn state_layout(&self) -> (usize, usize) {
        (
            (0..self.layers())
                .filter(|&l| self.is_state_layer(l))
                .count(),
            self.states.floats(),
        )
    }

    /// Its committed recurrent state, flat, and the one where its last committed
    /// pass started with that position ([`States::export`]).
    pub fn export_states(&self) -> (Vec<f32>, Option<(usize, Vec<f32>)>) {
        self.states.export()
    }

    /// Where its last committed pass started, when it keeps a recurrent state there.
    pub fn state_before_at(&self) -> Option<usize> {
        self.states.before_at()
    }

    /// Sets its committed recurrent state ([`States::import`]): a cache rebuilt from
    /// a snapshot, after its keys and values are committed.
    pub fn import_states(
        &mut self,
        flat: &[f32],
        before: Option<(usize, &[f32])>,
    ) -> Result<(), String> {
        self.states.import(flat, before)
    }

    /// Whether it holds recurrent states (a hybrid model's cache).
    pub fn has_states(&self) -> bool {
        !self.states.is_empty()
    }

    /// Layer `layer`'s recurrent state as the positions appended so far leave it
    /// (`None`: a layer without one).
    pub fn state(&self, layer: usize) -> Option<&LayerState> {
        self.states.layer(layer)
    }

    /// [`KvCache::state`], for a pass to advance.
    pub fn state_mut(&mut self, layer: usize) -> Option<&mut LayerState> {
        self.states.layer_mut(layer)
    }

    /// This (empty) cache dropping, in each layer with a sliding window, the pages
    /// wholly behind it: what attention can no longer read, beyond a page of slack
    /// (a cut of a few positions, as speculation makes, still finds what it needs).
    /// A cut further back than that loses the positions ([`KvCache::lost`]: they
    /// are recomputed from the start).
    pub fn with_windows(mut self, windows: Vec<Option<usize>>) -> Self {
        debug_assert!(self.len == 0 && windows.len() == self.layers());
        self.windows = if windows.iter().any(Option::is_some) {
            windows
        } else {
            Vec::new()
        };
        self
    }

    /// Whether some of its positions were dropped behind a sliding window.
    pub fn has_dropped(&self) -> bool {
        self.k.iter().any(|h| h.dropped > 0)
    }

    /// This (empty) cache with its closed pages counted in `pool`'s budget and
    /// spilled beyond it.
    pub fn in_pool(mut self, pool: &KvPool) -> Self {
        debug_assert!(self.len == 0);
        self.pool = Some(pool.clone());
        self
    }

    /// The pool its pages are counted in, if any.
    pub fn pool(&self) -> Option<&KvPool> {
        self.pool.as_ref()
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

    /// The token ids of its committed positions (where its passes gave them).
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Bytes held by keys and values (in memory or spilled; not those dropped behind
    /// a sliding window).
    pub fn bytes(&self) -> usize {
        self.k
            .iter()
            .chain(&self.v)
            .map(|x| x.held_floats() * 4)
            .sum::<usize>()
            + self.state_bytes()
    }

    /// Bytes of its recurrent states: the three copies it keeps
    /// ([`recurrent`]).
    fn state_bytes(&self) -> usize {
        3 * self.states.bytes()
    }

    /// Bytes it holds that are not in pages `seen` lists (closed pages by address,
    /// added to `seen`; its open pages are its own): what it adds beside caches that
    /// share its pages.
    pub fn bytes_not_in(&self, seen: &mut std::collections::HashSet<usize>) -> usize {
        let mut bytes = 0;
        for half in self.k.iter().chain(&self.v) {
            for p in &half.closed[half.dropped.min(half.closed.len())..] {
                if seen.insert(Arc::as_ptr(p) as usize) {
                    bytes += p.bytes();
                }
            }
            bytes += half.open.len() * 4;
        }
        bytes + self.state_bytes()
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
        let mut closed = Vec::new();
        self.k[layer].extend(k, per, self.pool.as_ref(), &mut closed);
        self.v[layer].extend(v, per, self.pool.as_ref(), &mut closed);
        if let Some(pool) = &self.pool {
            for p in &closed {
                pool.shared.admit(p);
            }
        }
        Ok(())
    }

    /// Marks the positions appended for `tokens` as committed (after every layer
    /// appended them), keeping their ids.
    pub fn commit(&mut self, tokens: &[u32]) {
        self.states.commit(self.len);
        self.len += tokens.len();
        self.ids.extend_from_slice(tokens);
        for (l, w) in self.windows.iter().enumerate() {
            if let Some(w) = w {
                let keep = self.len.saturating_sub(w + self.page) / self.page;
                self.k[l].drop_before(keep);
                self.v[l].drop_before(keep);
            }
        }
    }

    /// Keys and values of `layer` by page, including positions appended but not yet
    /// committed. Spilled pages are read back (the next layers' read ahead);
    /// `Err` when one cannot be (its copy on disk is corrupt): the positions from
    /// that page on are then lost ([`KvCache::lost`]).
    pub fn layer(&self, layer: usize) -> Result<KvView<'_>, KernelError> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if held.layer != layer {
            held.layer = layer;
            held.pages.clear();
        }
        let mut views = [Vec::new(), Vec::new()];
        for (half, out) in [&self.k[layer], &self.v[layer]].into_iter().zip(&mut views) {
            out.reserve(half.closed.len() + 1);
            for _ in 0..half.dropped {
                out.push(PageRef::Dropped);
            }
            for (i, p) in half.closed.iter().enumerate().skip(half.dropped) {
                let key = Arc::as_ptr(p) as usize;
                if let Some(f) = held.pages.get(&key) {
                    out.push(PageRef::Closed(Arc::clone(f)));
                    continue;
                }
                let resident = p.is_resident();
                match p.get() {
                    Ok(f) => {
                        if !resident {
                            held.pages.insert(key, Arc::clone(&f));
                        }
                        out.push(PageRef::Closed(f));
                    }
                    Err(why) => {
                        self.lost.fetch_min(i * self.page, Ordering::Relaxed);
                        return Err(KernelError::KvPageLost {
                            layer,
                            page: i,
                            why,
                        });
                    }
                }
            }
            if !half.open.is_empty() {
                out.push(PageRef::Open(&half.open));
            }
        }
        drop(held);
        self.read_ahead(layer);
        let [k, v] = views;
        Ok(KvView {
            page: self.page,
            width: self.width,
            len: self.layer_len(layer),
            k,
            v,
        })
    }

    /// Asks the pool to read the spilled pages of the layers after `layer` (the
    /// first ones after the last: the next pass's).
    fn read_ahead(&self, layer: usize) {
        let Some(pool) = &self.pool else { return };
        if !pool.shared.has_spilled() {
            // Nothing on disk (the usual case without pressure): nothing to read.
            return;
        }
        let layers = self.layers();
        for d in 1..=READ_AHEAD_LAYERS.min(layers.saturating_sub(1)) {
            let l = (layer + d) % layers;
            for half in [&self.k[l], &self.v[l]] {
                for p in &half.closed[half.dropped..] {
                    if !pool.shared.prefetch(p) {
                        return;
                    }
                }
            }
        }
    }

    /// The first position lost (its page's copy on disk was corrupt), when one
    /// before [`KvCache::len`] was.
    pub fn lost(&self) -> Option<usize> {
        let at = self.lost.load(Ordering::Relaxed);
        (at < self.len).then_some(at)
    }

    /// Cuts the lost positions off ([`KvCache::lost`]) and returns their token ids,
    /// for the caller to compute again; `None` when nothing is lost, or when the
    /// ids are not known (a cache whose passes did not give them).
    pub fn take_lost(&mut self) -> Option<Vec<u32>> {
        let at = self.lost()?;
        if self.ids.len() != self.len {
            return None;
        }
        // Positions from `at` on read the window before them: where a layer
        // dropped those, everything is computed again. A recurrent state resumes
        // only where one was kept.
        let at = if self.behind_windows(at) { 0 } else { at };
        let at = self.states.resumable(at, self.len);
        let ids = self.ids[at..].to_vec();
        // `at` is a page boundary: nothing is read to cut there, and nothing
        // before it is lost.
        self.truncate(at);
        debug_assert!(self.lost().is_none());
        Some(ids)
    }

    /// Drops positions from `len` on (rejected proposals, a failed pass's appended
    /// positions, a prompt prefix reused): every layer keeps at most `len` of its
    /// committed positions. Where the page a cut falls in cannot be read back, the
    /// positions from that page on are lost ([`KvCache::lost`]).
    pub fn truncate(&mut self, len: usize) {
        let len = len.min(self.len);
        let per = self.page * self.width;
        for x in self.k.iter_mut().chain(self.v.iter_mut()) {
            // A layer of keys only holds no values: nothing to cut there.
            if x.floats() > 0 {
                if let Err(page) = x.truncate(len * self.width, per) {
                    self.lost.fetch_min(page * self.page, Ordering::Relaxed);
                }
            }
        }
        // A window whose positions before the cut were dropped cannot attend from
        // it: everything is recomputed (each position needs the window before it).
        if self.behind_windows(len) {
            self.lost.store(0, Ordering::Relaxed);
        }
        // A recurrent state is cut back to where one was kept: the positions from
        // there to `len` are computed again.
        if let Some(at) = self.states.cut(len, self.len) {
            self.lost.fetch_min(at, Ordering::Relaxed);
        }
        self.len = len;
        self.ids.truncate(len);
        if self.lost.load(Ordering::Relaxed) >= len {
            self.lost.store(usize::MAX, Ordering::Relaxed);
        }
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pages
            .clear();
    }

    pub fn clear(&mut self) {
        self.truncate(0);
    }

    /// Whether attending from position `at` needs positions some sliding window
    /// dropped.
    fn behind_windows(&self, at: usize) -> bool {
        self.windows
            .iter()
            .enumerate()
            .any(|(l, w)| w.is_some_and(|w| self.k[l].dropped * self.page > at.saturating_sub(w)))
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
        kv.commit(&[0, 0]);
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
            kv.commit(&vec![0; n]);
            j += n;
        }
        let check = |kv: &KvCache, len: usize| {
            let view = kv.layer(0).unwrap();
            assert_eq!(view.len, len);
            assert_eq!(view.k.len(), len.div_ceil(page));
            for i in 0..len {
                let p = &view.k[i / page];
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
        kv.commit(&[0]);
        check(&kv, 7);
        kv.truncate(4);
        check(&kv, 4);
        assert_eq!(kv.bytes(), 2 * 4 * w * 4);
        let view = kv.layer(0).unwrap();
        let segs: Vec<_> = view.segments(1, 4).collect();
        assert_eq!(segs, vec![(0, 1, 3)]);
        let view = shared.layer(0).unwrap();
        let segs: Vec<_> = view.segments(2, 11).collect();
        assert_eq!(segs, vec![(0, 2, 2), (1, 0, 4), (2, 0, 3)]);
    }

    /// A cache of `layers` layers of `w` floats, in pages of `page`, holding `n`
    /// positions whose floats say where they are.
    fn filled(pool: Option<&KvPool>, layers: usize, w: usize, page: usize, n: usize) -> KvCache {
        let mut kv = KvCache::with_page(layers, w, 1 << 20, page);
        if let Some(p) = pool {
            kv = kv.in_pool(p);
        }
        for l in 0..layers {
            let k: Vec<f32> = (0..n * w).map(|i| (l * 1_000_000 + i) as f32).collect();
            let v: Vec<f32> = k.iter().map(|x| -x - 0.5).collect();
            kv.append(l, &k, &v).unwrap();
        }
        kv.commit(&(0..n as u32).collect::<Vec<_>>());
        kv
    }

    fn bits(kv: &KvCache) -> Result<Vec<u32>, KernelError> {
        let mut out = Vec::new();
        for l in 0..kv.layers() {
            let v = kv.layer(l)?;
            for pages in [&v.k, &v.v] {
                for (p, off, m) in v.segments(0, v.len) {
                    out.extend(
                        pages[p][off * v.width..(off + m) * v.width]
                            .iter()
                            .map(|x| x.to_bits()),
                    );
                }
            }
        }
        Ok(out)
    }

    /// Beyond its budget a pool spills the oldest pages to its file and reads them
    /// back (ahead of the layer viewed) with the same bits; a budget raised lets
    /// pages read back stay; the file goes with the pool.
    #[test]
    fn pages_beyond_the_budget_spill_and_read_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let (layers, w, page, n) = (6, 1024, 8, 100);
        let want = bits(&filled(None, layers, w, page, n)).unwrap();
        let page_bytes = page * w * 4;
        let pool = KvPool::new(8 * page_bytes, dir.path());
        let mut kv = filled(Some(&pool), layers, w, page, n);
        let s = pool.stats();
        assert!(
            s.resident_bytes + s.staged_bytes <= 8 * page_bytes as u64,
            "{s:?}"
        );
        let closed = layers * 2 * (n / page);
        // Resident pages take three quarters of the budget, copies read ahead the rest.
        assert_eq!(s.spilled_bytes, ((closed - 6) * page_bytes) as u64, "{s:?}");
        assert!(s.path.as_ref().unwrap().exists());
        for _ in 0..3 {
            assert_eq!(bits(&kv).unwrap(), want);
        }
        let s = pool.stats();
        assert!(s.read_ahead > 0 && s.read_bytes > 0, "{s:?}");
        assert!(
            s.resident_bytes + s.staged_bytes <= 8 * page_bytes as u64,
            "{s:?}"
        );
        // Cuts falling in spilled pages copy them back.
        kv.truncate(37);
        let mut cut = filled(None, layers, w, page, n);
        cut.truncate(37);
        assert_eq!(bits(&kv).unwrap(), bits(&cut).unwrap());
        pool.set_budget(usize::MAX / 2);
        assert_eq!(bits(&kv).unwrap(), bits(&cut).unwrap());
        assert_eq!(bits(&kv).unwrap(), bits(&cut).unwrap());
        let s = pool.stats();
        assert_eq!(s.spilled_bytes, 0, "every page read back stays: {s:?}");
        let path = s.path.unwrap();
        drop(kv);
        // Reads in flight hold their pages until they land.
        let settled = |f: &dyn Fn() -> bool| {
            let t = std::time::Instant::now();
            while !f() && t.elapsed().as_secs() < 10 {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            f()
        };
        let freed = || {
            let s = pool.stats();
            (s.resident_bytes, s.staged_bytes, s.spilled_bytes) == (0, 0, 0)
        };
        assert!(settled(&freed), "{:?}", pool.stats());
        drop(pool);
        assert!(settled(&|| !path.exists()));
    }

    /// A spilled page whose bytes on disk changed is never used: the view is an
    /// error naming it, and the cache's positions from that page on are lost, with
    /// their ids to recompute them.
    #[test]
    fn a_corrupt_spilled_page_is_lost_not_used() {
        let dir = tempfile::tempdir().unwrap();
        let (layers, w, page, n) = (2, 1024, 4, 40);
        let pool = KvPool::new(2 * page * w * 4, dir.path());
        let mut kv = filled(Some(&pool), layers, w, page, n);
        let path = pool.stats().path.unwrap();
        // Flip one byte of every slot written.
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        use std::os::unix::fs::FileExt;
        let len = f.metadata().unwrap().len();
        let slot = vpaged::direct::DIRECT_ALIGN as u64;
        let mut at = 0;
        while at < len {
            let mut b = [0u8; 1];
            f.read_exact_at(&mut b, at + 5).unwrap();
            f.write_all_at(&[b[0] ^ 0x40], at + 5).unwrap();
            f.sync_all().unwrap();
            at += slot;
        }
        let Err(e) = kv.layer(0) else {
            panic!("a corrupt page was used")
        };
        assert!(
            matches!(
                e,
                KernelError::KvPageLost {
                    layer: 0,
                    page: 0,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("checksum"), "{e}");
        assert_eq!(kv.lost(), Some(0));
        assert!(pool.stats().corrupt > 0);
        let ids = kv.take_lost().unwrap();
        assert_eq!(ids, (0..n as u32).collect::<Vec<_>>());
        assert_eq!((kv.len(), kv.lost(), kv.bytes()), (0, None, 0));
    }

    /// A spill file that cannot be written (a full device) turns spilling off:
    /// pages stay in memory beyond the budget, with the same bits.
    #[test]
    fn a_full_disk_keeps_pages_in_memory() {
        let full = std::path::Path::new("/dev/full");
        if !full.exists() {
            eprintln!("skipped: no /dev/full here");
            return;
        }
        let (layers, w, page, n) = (2, 64, 4, 40);
        let pool = KvPool::with_file(page * w * 4, full);
        let kv = filled(Some(&pool), layers, w, page, n);
        let s = pool.stats();
        assert!(
            s.off.as_deref().unwrap_or("").contains("No space left"),
            "{s:?}"
        );
        assert_eq!(s.spilled_bytes, 0);
        assert_eq!(
            bits(&kv).unwrap(),
            bits(&filled(None, layers, w, page, n)).unwrap()
        );
    }

    /// A layer with a sliding window keeps only the pages attention can still read
    /// (and one of slack); views show the others as dropped; a cut within the slack
    /// keeps everything needed, one further back loses every position.
    #[test]
    fn sliding_windows_drop_the_pages_behind_them() {
        let (w, page) = (2, 4);
        let mut kv = KvCache::with_page(2, w, 1000, page).with_windows(vec![Some(6), None]);
        let x: Vec<f32> = (0..40 * w).map(|i| i as f32).collect();
        kv.append(0, &x, &x).unwrap();
        kv.append(1, &x, &x).unwrap();
        kv.commit(&(0..40).collect::<Vec<_>>());
        // Positions 40 - 6 - 4 = 30 on are needed: pages 0..7 (0..28) dropped.
        let view = kv.layer(0).unwrap();
        assert_eq!(view.k.len(), 10);
        assert!(view.k[..7].iter().all(|p| matches!(p, PageRef::Dropped)));
        assert_eq!(view.k[7][0], 28.0 * w as f32);
        assert!(kv
            .layer(1)
            .unwrap()
            .k
            .iter()
            .all(|p| !matches!(p, PageRef::Dropped)));
        assert!(kv.has_dropped());
        assert_eq!(kv.bytes(), (3 * page * w * 2 + 40 * w * 2) * 4);
        // Speculation's cut: a few positions back, nothing lost.
        kv.truncate(37);
        assert_eq!((kv.len(), kv.lost()), (37, None));
        // A cut behind the window: every position is lost, with its ids.
        kv.truncate(20);
        assert_eq!(kv.lost(), Some(0));
        assert_eq!(kv.take_lost().unwrap(), (0..20).collect::<Vec<_>>());
        assert_eq!((kv.len(), kv.bytes(), kv.has_dropped()), (0, 0, false));
    }

    /// A hybrid's cache: layer 1 has a recurrent state, layer 0 keys and values. A
    /// cut inside the last pass restores the state at its start and marks the
    /// positions from there lost (their ids kept), which the engine computes again;
    /// a failed pass's cut leaves the committed state.
    #[test]
    fn a_recurrent_state_is_cut_back_where_one_was_kept() {
        let shape = StateShape { conv: 2, matrix: 3 };
        let mut kv = KvCache::with_page(2, 1, 64, 4).with_states(&[None, Some(shape)]);
        assert!(kv.state(0).is_none());
        assert_eq!(kv.bytes(), 3 * 5 * 4);
        let pass = |kv: &mut KvCache, ids: &[u32]| {
            let x: Vec<f32> = ids.iter().map(|&i| i as f32).collect();
            kv.append(0, &x, &x).unwrap();
            let s = kv.state_mut(1).unwrap();
            for &i in ids {
                s.matrix.iter_mut().for_each(|m| *m = *m * 0.5 + i as f32);
            }
            kv.commit(ids);
        };
        pass(&mut kv, &[1, 2, 3]);
        let at3 = kv.state(1).unwrap().clone();
        pass(&mut kv, &[4, 5, 6, 7]);
        let at7 = kv.state(1).unwrap().clone();

        // A failed pass: appended, then cut back to the committed length.
        kv.append(0, &[9.0], &[9.0]).unwrap();
        kv.state_mut(1).unwrap().matrix.fill(42.0);
        kv.truncate(7);
        assert_eq!((kv.len(), kv.lost()), (7, None));
        assert_eq!(kv.state(1).unwrap(), &at7);

        // Two drafted tokens of the last pass rejected: back to its start, and
        // positions 3..5 to compute again.
        kv.truncate(5);
        assert_eq!(kv.state(1).unwrap(), &at3);
        assert_eq!(kv.lost(), Some(3));
        assert_eq!(kv.take_lost().unwrap(), vec![4, 5]);
        assert_eq!((kv.len(), kv.layer_len(0), kv.lost()), (3, 3, None));
        pass(&mut kv, &[4, 5]);
        let mut again = KvCache::with_page(2, 1, 64, 4).with_states(&[None, Some(shape)]);
        pass(&mut again, &[1, 2, 3]);
        pass(&mut again, &[4, 5]);
        assert_eq!(kv.state(1), again.state(1));

        // Further back than the last pass: everything again.
        kv.truncate(1);
        assert_eq!(kv.lost(), Some(0));
        assert_eq!(kv.take_lost().unwrap(), vec![1]);
        assert_eq!(kv.len(), 0);
        assert_eq!(kv.state(1).unwrap().matrix, vec![0.0; 3]);
    }
}
