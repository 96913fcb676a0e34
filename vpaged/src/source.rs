//! The seam between engines and page stores.

use std::sync::Arc;

use voom_formats::manifest::Rows;
use voom_formats::DType;

use crate::StoreError;

/// A page's index in its model store's page table (the manifest's `id`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageId(pub u32);

/// What an engine needs to know of a page before it has its bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct PageMeta {
    pub id: PageId,
    /// Tensor name in the checkpoint.
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Decoded length in bytes.
    pub len: u64,
    /// The rows of tensor `name` the page holds when it is one part of it (`shape` is
    /// the part's); `None` for a page that is a whole tensor.
    pub rows: Option<Rows>,
}

impl PageMeta {
    /// A manifest entry's page (its decoded length: the raw bytes, whatever the
    /// stored encoding).
    pub fn from_entry(e: &voom_formats::manifest::PageEntry) -> Self {
        PageMeta {
            id: PageId(e.id),
            name: e.name.clone(),
            dtype: e.dtype,
            shape: e.shape.clone(),
            len: e.decoded_len().unwrap_or(e.len),
            rows: e.rows,
        }
    }

    /// How errors and listings name the page (the tensor, and its rows for a part).
    pub fn label(&self) -> String {
        voom_formats::manifest::page_label(&self.name, self.rows)
    }
}

/// A page cache's counters as a source reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SourceCacheStats {
    /// Demand requests served from a resident page.
    pub hits: u64,
    /// Demand requests that started a load.
    pub misses: u64,
    /// Bytes of pages loaded into the cache (demand and prefetch).
    pub bytes_loaded: u64,
    /// Demand requests that waited for a load already in flight (a prefetch that
    /// had not landed yet, or another request's load).
    pub inflight_waits: u64,
    /// Pages loaded on a hint.
    pub prefetch_loads: u64,
    /// Hints dropped because making room would have cost more valuable pages.
    pub prefetch_skipped: u64,
    /// Pages loaded on a hint and evicted before any request: reads wasted (each is
    /// read again when its request comes).
    pub unused_evictions: u64,
    /// Pages whose vpack body was read ahead of their load
    /// ([`PageSource::read_ahead`]) and decoded from there.
    pub bodies_read_ahead: u64,
    /// Bytes read from each tier so far: the fast tier (all models'), the model's
    /// own local directory, and its NAS (where it lives, or a copy of it).
    pub fast_tier_bytes: u64,
    pub primary_bytes: u64,
    pub nas_bytes: u64,
    /// Bytes of cache slots in use.
    pub used_bytes: u64,
    /// The cache's capacity in bytes.
    pub capacity_bytes: u64,
    /// Bytes of the capacity a memory governor took back from pages
    /// ([`PageSource::set_cache_limit`]).
    pub withheld_bytes: u64,
}

/// A source of pages: the embedded store or the daemon.
///
/// Callers' obligations: hold the [`PageLease`] for as long as they read its bytes
/// (the borrow checker enforces this) and drop it when done, so the store may evict the
/// page; and call [`PageSource::check_reads`] after computing on leased bytes, before
/// using the results, discarding them on `Err`. Implementations' obligations: a
/// lease's bytes are exactly the page's decoded, verified bytes and stay valid and
/// unchanged while the lease lives, or, where the source cannot prevent a change (a
/// memory-mapped file that another process truncates or rewrites), `check_reads`
/// reports it.
pub trait PageSource: Send + Sync {
    /// Every page of the model store, indexed by `PageId.0`.
    fn pages(&self) -> &[PageMeta];

    /// A page by tensor name (the first part of a tensor stored in parts).
    fn find(&self, name: &str) -> Option<&PageMeta> {
        self.pages().iter().find(|p| p.name == name)
    }

    /// Demand request: returns once the page is resident and verified.
    fn acquire(&self, id: PageId) -> Result<PageLease, StoreError>;

    /// Demand request for several pages at once (a layer's): one round trip where the
    /// source is remote. All or nothing: on error none stays leased.
    fn acquire_many(&self, ids: &[PageId]) -> Result<Vec<PageLease>, StoreError> {
        ids.iter().map(|&id| self.acquire(id)).collect()
    }

    /// Bytes of pages the source can hold resident at once, if it is bounded (a page
    /// cache); `None` for sources with no such limit (memory-mapped files). Engines
    /// lease less at a time when it is small.
    fn budget(&self) -> Option<u64> {
        None
    }

    /// Lets this process's page cache hold at most `limit` bytes of pages, returning
    /// the memory of the rest to the OS (a memory governor's lever; see
    /// `vpaged::cache::PageCache::set_limit`), and returns the limit reached: it
    /// stays above what leased and pinned pages hold. `None` where the source has no
    /// cache of its own to resize (memory-mapped files, which the OS reclaims; the
    /// daemon, whose cache is its own).
    fn set_cache_limit(&self, _limit: u64) -> Option<u64> {
        None
    }

    /// Bytes of the cache withheld from pages now by [`PageSource::set_cache_limit`]
    /// (0 without one): room [`PageSource::budget`] no longer counts.
    fn cache_withheld(&self) -> u64 {
        0
    }

    /// Whether reading part of a lease reads only that part from storage: true for
    /// memory-mapped files (the OS faults in the bytes touched), false for sources
    /// that load a page whole before leasing it (a page cache: one verified page is
    /// its unit). Plans count an embedding lookup as one row only where this holds.
    fn partial_reads(&self) -> bool {
        false
    }

    /// Hint that these pages will be acquired soon. Never blocks for I/O.
    fn prefetch(&self, _ids: &[PageId]) {}

    /// Whether acquiring every one of `ids` now would wait for no load: a caller free
    /// to take pages in any order takes those first, while the others load. A hint
    /// only (a page may be evicted or land a moment later); never changes a result.
    /// `true` where acquiring never waits for a read of its own (memory-mapped files:
    /// faults are taken as bytes are touched), and where the source cannot tell.
    fn ready(&self, _ids: &[PageId]) -> bool {
        true
    }

    /// [`ready`](Self::ready) of each group of pages, in one call (one round trip
    /// where the source is remote).
    fn ready_each(&self, groups: &[&[PageId]]) -> Vec<bool> {
        groups.iter().map(|g| self.ready(g)).collect()
    }

    /// Hint that these pages will be acquired after the ones hinted by
    /// [`prefetch`](Self::prefetch), in this order: a source whose pages load in two
    /// stages (a vpack body read, then decoded into a cache slot) may read their
    /// bodies now, into read buffers of its own, as far as those have room, before
    /// the pages have slots. Sent again as the engine moves on; pages already
    /// resident, hinted or read are skipped. Never blocks for I/O, never changes a
    /// result.
    fn read_ahead(&self, _ids: &[PageId]) {}

    /// Keep these pages resident once they are loaded, whatever else streams (the
    /// memory planner's choice of what saves the most reads per token). A source
    /// with a cache of its own may load them at once (engines pin when they open);
    /// sources without one (memory-mapped files) ignore it. Never changes a result.
    fn pin(&self, _ids: &[PageId]) {}

    /// Keep copies of pages on the source's fast tier (faster storage than the
    /// model's own), if it has one, once they are read, so that later reads of them
    /// leave the slow tier: the memory planner's static set. `by_value` lists the
    /// candidates, most valuable first (pages the cache cannot pin, by the bytes each
    /// saves per token); the source keeps as many as its tier has room for. Never
    /// changes a result: a copy is verified whenever it is read.
    fn keep_on_fast_tier(&self, _by_value: &[PageId]) {}

    /// The page cache's counters, for sources that have one (the store core's cache,
    /// the daemon's); `None` for memory-mapped files, whose caching is the OS's.
    fn cache_stats(&self) -> Option<SourceCacheStats> {
        None
    }

    /// Delivers anything the source deferred (a remote source batches releases and
    /// hints into its next request). Engines call it when a forward pass ends, so
    /// that released pages do not stay held while the engine is idle.
    fn flush(&self) {}

    /// Whether the bytes of pages leased since the previous call may have been other
    /// than the verified pages: `Err` when the source saw that they could have been (for
    /// memory-mapped files: a read fault, the file having been truncated under the
    /// mapping, or the file changing on disk while pages of it were leased), naming the
    /// file and the offset or page.
    ///
    /// Callers' obligation: call it after each computation on leased bytes (an engine:
    /// after every forward pass) and before using, returning or emitting anything
    /// computed, and on `Err` discard all of it and return the error. Sources whose
    /// leases are the only copy of verified bytes in memory they own (a page cache, the
    /// daemon's arena) cannot see their bytes change and return `Ok` (the default).
    /// With one caller at a time the report is exact for that caller's reads; callers
    /// that share one source concurrently each see a given change reported at most
    /// once, by whichever checks first, so they must not share a source whose reads can
    /// fail (give each its own).
    fn check_reads(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Whether every page it serves was checked against the store's page manifest
    /// (the blake3 of its bytes) before it was served, so that what is computed on
    /// its pages is what the manifest names. False (the default) for sources that
    /// serve bytes unchecked (an embedded store opened with verification off, or
    /// without a manifest). Things kept beyond one run and keyed by the manifest
    /// (prompt-prefix snapshots) are written and read only where this holds.
    fn verifies(&self) -> bool {
        false
    }

    /// A short description for logs and responses ("embedded", "vpaged:/run/...").
    fn describe(&self) -> String;
}

/// Keeps a page's bytes alive (an mmap, a cache slot with a refcount...).
pub trait LeaseHolder: Send + Sync {}
impl<T: Send + Sync> LeaseHolder for T {}

/// A lease on one page's bytes. The bytes are valid while the lease lives.
///
/// A clone shares the lease: the page is released when the last clone is dropped
/// (a backend that reads the bytes after the call that was given them, such as a
/// lazily evaluated graph, keeps a clone until it is done).
#[derive(Clone)]
pub struct PageLease {
    ptr: *const u8,
    len: usize,
    id: PageId,
    // Dropped last: releases the page.
    _holder: Arc<dyn LeaseHolder>,
}

// SAFETY: a lease only exposes shared, immutable access to bytes kept alive by
// `_holder` (which is Send + Sync); the pointer is never written through.
unsafe impl Send for PageLease {}
// SAFETY: as above: `&PageLease` only yields `&[u8]`.
unsafe impl Sync for PageLease {}

impl PageLease {
    /// # Safety
    /// `ptr..ptr+len` must be readable, initialised and unchanged for as long as
    /// `holder` lives.
    pub unsafe fn new(
        id: PageId,
        ptr: *const u8,
        len: usize,
        holder: Arc<dyn LeaseHolder>,
    ) -> Self {
        PageLease {
            ptr,
            len,
            id,
            _holder: holder,
        }
    }

    pub fn id(&self) -> PageId {
        self.id
    }

    /// The page's bytes, in place.
    pub fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `new`'s contract: the range is valid while `_holder` lives, and
        // `_holder` lives at least as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::fmt::Debug for PageLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageLease")
            .field("id", &self.id)
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Holder {
        bytes: Vec<u8>,
        released: Arc<AtomicUsize>,
    }

    impl Drop for Holder {
        fn drop(&mut self) {
            self.released.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_page_is_released_once_when_its_last_clone_goes() {
        let released = Arc::new(AtomicUsize::new(0));
        let holder = Arc::new(Holder {
            bytes: vec![7, 8, 9],
            released: released.clone(),
        });
        let (ptr, len) = (holder.bytes.as_ptr(), holder.bytes.len());
        // SAFETY: the bytes live in `holder`, which the lease keeps alive, and are
        // never written.
        let lease = unsafe { PageLease::new(PageId(3), ptr, len, holder) };
        let clone = lease.clone();
        drop(lease);
        assert_eq!(released.load(Ordering::SeqCst), 0, "a clone still holds it");
        assert_eq!(clone.bytes(), &[7, 8, 9]);
        assert_eq!(clone.id(), PageId(3));
        drop(clone);
        assert_eq!(released.load(Ordering::SeqCst), 1);
    }
}
