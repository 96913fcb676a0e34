//! The page cache: pages of one or more models held in slots of the shared [`Arena`].
//!
//! One mutex guards the whole state (slot allocator, page table, eviction policy,
//! pins, counters); loads run outside it, so the lock is held only for bookkeeping.
//! A page is in one of two states:
//! - `Loading`: a slot is reserved and one thread (the loader) fills it; concurrent
//!   requests for the page wait for that load (see [`inflight`]). Nothing reads the
//!   slot, so the loader has it exclusively.
//! - `Ready`: the bytes are complete and immutable until eviction. A page is evicted
//!   only when it has no lease and no pin; its slot is then reused.
//!
//! So a leased page's bytes never change, and nothing half-loaded is ever visible: a
//! failed or panicking load frees its slot and reports the failure to every waiter.
//!
//! When everything that could be evicted is leased, pinned or loading, a demand request
//! fails at once with [`CacheError::Full`] rather than waiting: an engine holding
//! leases on part of a layer while it asks for more could otherwise wait on itself.
//! The caller decides (release and retry, or stream one page at a time).
//!
//! Eviction and admission are described in [`eviction`].

pub mod eviction;
mod inflight;
pub mod slots;

use std::collections::{HashMap, HashSet};
use std::error::Error;
use std::fmt;
use std::sync::Arc;

use crate::sync::{Mutex, MutexGuard};

use crate::arena::{Arena, SLOT_ALIGN};
use eviction::{Policy, Region};
use inflight::{Failure, InFlight, Outcome};
use slots::SlotAllocator;

/// A page in the cache: a store-assigned model index and the page's index in that
/// model's manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageKey {
    pub model: u32,
    pub page: u32,
}

impl fmt::Display for PageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "model {} page {}", self.model, self.page)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CacheError<E: Error + Send + Sync + 'static> {
    #[error("{key}: {len} bytes can never fit in the {capacity}-byte page cache")]
    TooLarge {
        key: PageKey,
        len: usize,
        capacity: usize,
    },
    #[error(
        "{key}: no room for {len} bytes in the {capacity}-byte page cache: {leased} bytes \
         leased, {pinned} pinned and unleased, {loading} loading; {free} free, longest free run {largest_free}"
    )]
    Full {
        key: PageKey,
        len: usize,
        capacity: usize,
        leased: usize,
        pinned: usize,
        loading: usize,
        free: usize,
        largest_free: usize,
    },
    #[error("{key} is cached with {resident} bytes but was requested with {requested}")]
    LengthMismatch {
        key: PageKey,
        resident: usize,
        requested: usize,
    },
    #[error("{key}: load failed: {source}")]
    Load {
        key: PageKey,
        #[source]
        source: Arc<E>,
    },
    /// A concurrent load of the page, started with another error type, failed.
    #[error("{key}: a concurrent load failed: {source}")]
    PeerLoad {
        key: PageKey,
        #[source]
        source: Arc<dyn Error + Send + Sync>,
    },
    #[error("{key}: the load panicked")]
    LoadPanicked { key: PageKey },
}

/// A snapshot of the cache's counters. Byte figures are slot bytes (rounded up to
/// 16 KiB per page) except `bytes_loaded` (page bytes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub capacity: usize,
    /// Room of the capacity withheld from pages ([`PageCache::set_limit`]).
    pub withheld: usize,
    /// Slots allocated (ready or loading).
    pub used: usize,
    /// Slots of pages with at least one lease.
    pub leased_bytes: usize,
    /// Slots of resident pinned pages.
    pub pinned_bytes: usize,
    pub resident_pages: usize,
    pub loading_pages: usize,
    /// Demand requests served from a resident page.
    pub hits: u64,
    /// Demand requests that started a load.
    pub misses: u64,
    /// Demand requests that waited for another request's load (one read, many users).
    pub inflight_dedups: u64,
    /// Demand requests refused with [`CacheError::Full`].
    pub full_refusals: u64,
    pub evictions: u64,
    /// Pages loaded by a prefetch and evicted before any request: each such read was
    /// wasted, and is read again when its request comes.
    pub unused_evictions: u64,
    /// Page bytes written by successful loads (demand and prefetch).
    pub bytes_loaded: u64,
    pub loads: u64,
    pub load_failures: u64,
    pub prefetch_loads: u64,
    /// Prefetches dropped because room would have cost more valuable pages.
    pub prefetch_skipped: u64,
    /// Loads placed in the main region (admitted) and in the window (not admitted).
    pub admitted: u64,
    pub not_admitted: u64,
}

/// What a prefetch did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prefetched {
    /// The page was already resident.
    Resident,
    /// Another request is loading it.
    InFlight,
    /// Loaded now (not leased).
    Loaded,
    /// Not loaded: making room would have evicted pages requested more often, or
    /// everything is leased.
    Skipped,
}

/// What [`PageCache::reserve`] did.
pub enum Reserve {
    /// The page is already resident.
    Resident,
    /// Another request is loading it.
    InFlight,
    /// No room without evicting pages requested more often (see
    /// [`PageCache::prefetch`]).
    Skipped,
    /// A slot is the caller's to fill.
    Reserved(Reservation),
}

/// A slot reserved for loading one page (see [`PageCache::reserve`]). Whoever holds
/// it fills [`Reservation::buf`] with the page's verified bytes and then calls
/// [`Reservation::finish`]; dropped unfinished, the load fails (its waiters are told,
/// the slot is freed). `Send`: a load may finish on another thread than it began.
pub struct Reservation {
    inner: Arc<Inner>,
    key: PageKey,
    offset: usize,
    len: usize,
    finished: bool,
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservation")
            .field("key", &self.key)
            .field("len", &self.len)
            .finish()
    }
}

impl Reservation {
    pub fn key(&self) -> PageKey {
        self.key
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The slot's bytes (a previous page's until overwritten).
    ///
    /// # Safety
    /// The slice is the only access to the slot until [`Reservation::finish`] (the
    /// page is `Loading`: no lease, reader or other loader reaches it); the caller
    /// must not keep it, or pointers derived from it, past `finish` or drop, nor
    /// create a second one while the first is in use.
    pub unsafe fn buf(&mut self) -> &mut [u8] {
        // SAFETY: the slot came from the allocator over the arena's units and its page
        // is `Loading` under this reservation, so the caller's access is exclusive
        // (this function's contract).
        match unsafe { self.inner.arena.bytes_mut(self.offset, self.len) } {
            Ok(b) => b,
            Err(_) => unreachable!("allocator slots lie inside the arena"),
        }
    }

    /// Publishes the page (`Ok`: its bytes are complete and verified) or fails the
    /// load (`Err`: the slot is freed and every waiter gets the error). Returns the
    /// load's own result as the cache reports it.
    pub fn finish<E: Error + Send + Sync + 'static>(
        mut self,
        result: Result<(), E>,
    ) -> Result<(), CacheError<E>> {
        self.finished = true;
        match self
            .inner
            .finish(self.key, result.map_err(Failure::from_error), 0)
        {
            Outcome::Ready { .. } => Ok(()),
            Outcome::Failed(f) => Err(f.into_error(self.key)),
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.finished {
            self.inner.finish(self.key, Err(Failure::Panicked), 0);
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    unit: u32,
    units: u32,
}

impl Slot {
    fn offset(self) -> usize {
        self.unit as usize * SLOT_ALIGN
    }
    fn bytes(self) -> usize {
        self.units as usize * SLOT_ALIGN
    }
}

enum Entry {
    Loading {
        slot: Slot,
        len: usize,
        region: Region,
        demand: bool,
        /// Requests waiting for this load; each gets a reference when it completes.
        waiters: u32,
        cell: Arc<InFlight>,
    },
    Ready {
        slot: Slot,
        len: usize,
        refs: u32,
    },
}

struct State {
    slots: SlotAllocator,
    pages: HashMap<PageKey, Entry>,
    policy: Policy,
    pins: HashSet<PageKey>,
    /// Models whose unpinned pages only stream ([`PageCache::set_streaming`]).
    streaming: HashSet<u32>,
    /// Pages of streaming models still admitted to main ([`PageCache::set_admissible`]).
    admissible: HashSet<PageKey>,
    stats: CacheStats,
    /// Room taken back from pages ([`PageCache::set_limit`]): allocated runs that
    /// hold no page, their memory returned to the OS.
    withheld: Vec<Slot>,
}

impl State {
    /// Whether `key` only streams: its model is placed by a planner
    /// ([`PageCache::set_streaming`]) and it is not one that planner leaves to
    /// admission ([`PageCache::set_admissible`]).
    fn streams(&self, key: PageKey) -> bool {
        self.streaming.contains(&key.model) && !self.admissible.contains(&key)
    }
}

struct Inner {
    arena: Arena,
    state: Mutex<State>,
    /// Serialises [`PageCache::set_limit`]: withheld runs are released to the OS
    /// outside the state lock, and only `set_limit` ever frees them.
    limit: Mutex<()>,
}

/// The page cache. Cheap to clone (a shared handle); `Send + Sync`.
#[derive(Clone)]
pub struct PageCache {
    inner: Arc<Inner>,
}

impl fmt::Debug for PageCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageCache")
            .field("capacity", &self.inner.arena.capacity())
            .finish_non_exhaustive()
    }
}

/// A lease on a resident page: its bytes stay in place and unchanged until the lease is
/// dropped (which releases it).
pub struct Lease {
    key: PageKey,
    offset: usize,
    len: usize,
    inner: Arc<Inner>,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl Lease {
    pub fn key(&self) -> PageKey {
        self.key
    }
    /// Offset of the page in the arena: a multiple of [`SLOT_ALIGN`].
    pub fn offset(&self) -> usize {
        self.offset
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The page's bytes in the owner's mapping.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the slot lies inside the arena (it came from the allocator over the
        // arena's units) and is `Ready` with this lease counted, so nothing writes it
        // until the lease is dropped, which cannot happen while `&self` is borrowed.
        unsafe { std::slice::from_raw_parts(self.inner.arena.as_ptr().add(self.offset), self.len) }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.inner.release(self.key);
    }
}

/// How a load was requested.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `freq`: the page's requests before this one.
    Demand {
        freq: u32,
    },
    Prefetch {
        freq: u32,
    },
}

enum Room {
    Slot(Slot, Region),
    /// A prefetch declined to evict what it does not outrank.
    Declined,
    Full,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // No user code runs under the lock, so poisoning can only follow a bug in this
        // module's bookkeeping; the state is still the best information there is.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn release(&self, key: PageKey) {
        let mut st = self.lock();
        let pinned = st.pins.contains(&key);
        let Some(Entry::Ready { refs, slot, .. }) = st.pages.get_mut(&key) else {
            debug_assert!(false, "release of a page that is not ready");
            return;
        };
        debug_assert!(*refs > 0, "release without a lease");
        *refs = refs.saturating_sub(1);
        if *refs == 0 {
            let bytes = slot.bytes();
            st.stats.leased_bytes -= bytes;
            if !pinned {
                st.policy.set_evictable(key, true);
            }
        }
    }

    /// Finds a slot of `units`, evicting per policy. Demand loads may evict anything
    /// evictable (window first, then main's victims); prefetches only used window
    /// pages and main pages with no more requests than theirs will be once requested.
    /// Free room goes to main only for pages admitted or when it is spare (rules in
    /// [`eviction`]).
    ///
    /// A pinned page's slot is taken as high in the arena as it fits
    /// ([`SlotAllocator::alloc_high`]), other pages' by best fit from the bottom, so
    /// pins never break up the runs that streaming needs.
    fn make_room(&self, st: &mut State, key: PageKey, units: u32, mode: Mode) -> Room {
        let pinned = st.pins.contains(&key);
        let alloc = |slots: &mut SlotAllocator| {
            if pinned {
                slots.alloc_high(units)
            } else {
                slots.alloc(units)
            }
        };
        let freq = match mode {
            Mode::Demand { freq } | Mode::Prefetch { freq } => freq,
        };
        // A model placed by a planner streams what it did not pin: nothing of it is
        // admitted to main, where it would take the window's room.
        let streams = st.streams(key);
        let admitted = !streams && st.policy.admits(freq);
        let need = units as u64 * SLOT_ALIGN as u64;
        if let Some(unit) = alloc(&mut st.slots) {
            // Free room displaces nothing: it goes to main if the page passes admission
            // or the room is spare (the window keeps what streaming recently needed);
            // otherwise the page streams through the window like any other.
            let free_after = st.slots.free_units() as u64 * SLOT_ALIGN as u64;
            let region = if admitted || (!streams && st.policy.spare_room(free_after)) {
                Region::Main
            } else {
                st.policy.note_window_need(need);
                Region::Window
            };
            return Room::Slot(Slot { unit, units }, region);
        }
        let region = if admitted {
            Region::Main
        } else {
            Region::Window
        };
        let free = st.slots.free_units() as u64 * SLOT_ALIGN as u64;
        match mode {
            Mode::Demand { .. } => {
                if free + st.policy.evictable_bytes() < need {
                    return Room::Full;
                }
            }
            Mode::Prefetch { .. } => {
                if free
                    + st.policy
                        .reclaimable_for_prefetch(freq.saturating_add(1), need.saturating_sub(free))
                    < need
                {
                    return Room::Declined;
                }
            }
        }
        loop {
            let window_victim = match mode {
                Mode::Demand { .. } => st.policy.window_victim(),
                Mode::Prefetch { .. } => st.policy.window_victim_for_prefetch(),
            };
            // A demand load takes used window pages, then main's victims, and only
            // then prefetched pages still waiting for their request (see
            // `Policy::pending_victim`).
            // No used window page left and still no run long enough: the free room
            // is fragmented. Evict the cheapest contiguous span instead of more pages
            // in policy order, which would each free a scattered slot.
            if window_victim.is_none() {
                if let Some(span) = Self::cheapest_span(st, units, mode) {
                    for v in span {
                        Self::evict(st, v);
                    }
                    if let Some(unit) = alloc(&mut st.slots) {
                        if region == Region::Window {
                            st.policy.note_window_need(need);
                        }
                        return Room::Slot(Slot { unit, units }, region);
                    }
                }
            }
            let victim = match window_victim {
                Some(v) => v,
                None => match (st.policy.main_victim(), mode) {
                    (Some((v, _)), Mode::Demand { .. }) => v,
                    (Some((v, f)), Mode::Prefetch { .. }) if f <= freq.saturating_add(1) => v,
                    (_, Mode::Prefetch { .. }) => return Room::Declined,
                    (None, Mode::Demand { .. }) => match st.policy.pending_victim() {
                        Some(v) => v,
                        None => return Room::Full,
                    },
                },
            };
            Self::evict(st, victim);
            if let Some(unit) = alloc(&mut st.slots) {
                if region == Region::Window {
                    st.policy.note_window_need(need);
                }
                return Room::Slot(Slot { unit, units }, region);
            }
        }
    }

    /// The pages to evict for the cheapest run of `units` contiguous units made of
    /// free runs and evictable slots ([`Policy::eviction_cost`]); `None` if no such
    /// run exists, or if one is free already (nothing to evict).
    fn cheapest_span(st: &State, units: u32, mode: Mode) -> Option<Vec<PageKey>> {
        let prefetch_freq = match mode {
            Mode::Prefetch { freq } => Some(freq),
            Mode::Demand { .. } => None,
        };
        // The arena in address order: free runs (cost 0), slots (their eviction cost,
        // `None` for what cannot go).
        let mut blocks: Vec<(u32, u32, Option<u64>, Option<PageKey>)> = st
            .slots
            .free_runs_by_address()
            .map(|(s, l)| (s, l, Some(0), None))
            .collect();
        for (&key, e) in &st.pages {
            let slot = match e {
                Entry::Ready { slot, .. } | Entry::Loading { slot, .. } => *slot,
            };
            let cost = match e {
                Entry::Ready { refs: 0, .. } if !st.pins.contains(&key) => {
                    st.policy.eviction_cost(key, prefetch_freq)
                }
                _ => None,
            };
            blocks.push((slot.unit, slot.units, cost, Some(key)));
        }
        blocks.sort_unstable_by_key(|b| b.0);
        // Sliding window over runs of evictable blocks, adjacent in the arena.
        let mut best: Option<(u64, usize, usize)> = None;
        let (mut i, mut len, mut cost) = (0usize, 0u64, 0u64);
        for j in 0..blocks.len() {
            let (start, l, c, _) = blocks[j];
            let adjacent = j == 0 || blocks[j - 1].0 + blocks[j - 1].1 == start;
            let Some(c) = c else {
                (i, len, cost) = (j + 1, 0, 0);
                continue;
            };
            if !adjacent {
                (i, len, cost) = (j, 0, 0);
            }
            len += l as u64;
            cost += c;
            while len - blocks[i].1 as u64 >= units as u64 && i < j {
                len -= blocks[i].1 as u64;
                cost -= blocks[i].2.unwrap_or(0);
                i += 1;
            }
            if len >= units as u64 && best.is_none_or(|b| cost < b.0) {
                best = Some((cost, i, j));
            }
        }
        let (cost, i, j) = best?;
        if cost == 0 {
            return None;
        }
        Some(blocks[i..=j].iter().filter_map(|b| b.3).collect())
    }

    fn evict(st: &mut State, key: PageKey) {
        match st.pages.remove(&key) {
            Some(Entry::Ready { slot, refs: 0, .. }) => {
                if st.policy.is_awaiting(key) {
                    st.stats.unused_evictions += 1;
                }
                st.policy.remove(key);
                st.slots.free(slot.unit, slot.units);
                st.stats.evictions += 1;
            }
            other => {
                // The policy only indexes evictable pages; keep the state intact.
                debug_assert!(false, "policy offered a page that is not evictable");
                if let Some(e) = other {
                    st.pages.insert(key, e);
                }
                st.policy.set_evictable(key, false);
            }
        }
    }

    fn full_error<E: Error + Send + Sync + 'static>(
        &self,
        st: &State,
        key: PageKey,
        len: usize,
    ) -> CacheError<E> {
        let loading = st
            .pages
            .values()
            .map(|e| match e {
                Entry::Loading { slot, .. } => slot.bytes(),
                Entry::Ready { .. } => 0,
            })
            .sum();
        let pinned_unleased = st
            .pins
            .iter()
            .filter_map(|k| match st.pages.get(k) {
                Some(Entry::Ready { slot, refs: 0, .. }) => Some(slot.bytes()),
                _ => None,
            })
            .sum();
        CacheError::Full {
            key,
            len,
            capacity: self.arena.capacity(),
            leased: st.stats.leased_bytes,
            pinned: pinned_unleased,
            loading,
            free: st.slots.free_units() as usize * SLOT_ALIGN,
            largest_free: st.slots.largest_free() as usize * SLOT_ALIGN,
        }
    }

    /// Marks a finished load `Ready` with `refs` references, or removes it on failure,
    /// then wakes its waiters.
    fn finish(&self, key: PageKey, result: Result<(), Failure>, loader_refs: u32) -> Outcome {
        let mut st = self.lock();
        let Some(Entry::Loading {
            slot,
            len,
            region,
            demand,
            waiters,
            cell,
        }) = st.pages.remove(&key)
        else {
            unreachable!("a loading page is only removed by its loader");
        };
        let outcome = match result {
            Ok(()) => {
                let pinned = st.pins.contains(&key);
                let refs = loader_refs + waiters;
                let region = if pinned { Region::Main } else { region };
                st.pages.insert(key, Entry::Ready { slot, len, refs });
                // A prefetch that a demand request waited for has had its request: it
                // is a used page once released, not one still awaiting its use (which
                // no prefetch may evict: a window full of those takes no hint).
                let requested = demand || waiters > 0;
                st.policy
                    .insert(key, slot.bytes() as u64, region, requested);
                st.stats.loads += 1;
                st.stats.bytes_loaded += len as u64;
                if !demand {
                    st.stats.prefetch_loads += 1;
                }
                match region {
                    Region::Main => st.stats.admitted += 1,
                    Region::Window => st.stats.not_admitted += 1,
                }
                if pinned {
                    st.stats.pinned_bytes += slot.bytes();
                }
                if refs > 0 {
                    st.stats.leased_bytes += slot.bytes();
                } else if !pinned {
                    st.policy.set_evictable(key, true);
                }
                Outcome::Ready {
                    offset: slot.offset(),
                }
            }
            Err(f) => {
                st.slots.free(slot.unit, slot.units);
                st.stats.load_failures += 1;
                Outcome::Failed(f)
            }
        };
        drop(st);
        cell.complete(outcome.clone());
        outcome
    }
}

/// Ends a load: on unwind (the load closure panicked) it frees the slot and tells the
/// waiters, so no request waits forever and nothing half-loaded stays.
struct LoadGuard<'a> {
    inner: &'a Inner,
    key: PageKey,
    armed: bool,
}

impl Drop for LoadGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.inner.finish(self.key, Err(Failure::Panicked), 0);
        }
    }
}

fn units_for(len: usize) -> Option<u32> {
    u32::try_from(len.div_ceil(SLOT_ALIGN).max(1)).ok()
}

/// Units of room withheld from pages.
fn withheld_units(st: &State) -> u32 {
    st.withheld.iter().map(|s| s.units).sum()
}

impl PageCache {
    /// A cache over `arena`: slots are 16 KiB-aligned runs of it.
    pub fn new(arena: Arena) -> PageCache {
        let units = u32::try_from(arena.capacity() / SLOT_ALIGN).unwrap_or(u32::MAX);
        let stats = CacheStats {
            capacity: units as usize * SLOT_ALIGN,
            ..CacheStats::default()
        };
        PageCache {
            inner: Arc::new(Inner {
                arena,
                state: Mutex::new(State {
                    slots: SlotAllocator::new(units),
                    pages: HashMap::new(),
                    policy: Policy::new(),
                    pins: HashSet::new(),
                    streaming: HashSet::new(),
                    admissible: HashSet::new(),
                    stats,
                    withheld: Vec::new(),
                }),
                limit: Mutex::new(()),
            }),
        }
    }

    /// The arena (its descriptor goes to engines).
    pub fn arena(&self) -> &Arena {
        &self.inner.arena
    }

    /// The arena's bytes (withheld room included: see [`PageCache::limit`]).
    pub fn capacity(&self) -> usize {
        self.inner.lock().stats.capacity
    }

    /// Bytes pages may use now: the capacity less the room withheld by
    /// [`PageCache::set_limit`].
    pub fn limit(&self) -> usize {
        let st = self.inner.lock();
        st.stats.capacity - withheld_units(&st) as usize * SLOT_ALIGN
    }

    /// Lets pages use at most `limit` bytes of the arena (rounded up to slots, at
    /// most the capacity), returning the memory of the rest to the OS: a memory
    /// governor's lever. Shrinking takes free room first, then evicts unleased,
    /// unpinned pages in eviction order; leased, pinned and loading pages are never
    /// touched, so the limit reached may stay above the one asked (it is returned).
    /// Growing hands withheld room back at once (committed again as pages load).
    pub fn set_limit(&self, limit: usize) -> usize {
        let _serial = self.inner.limit.lock().unwrap_or_else(|p| p.into_inner());
        let mut released = Vec::new();
        {
            let mut st = self.inner.lock();
            let units = st.slots.units();
            let keep = u32::try_from(limit.div_ceil(SLOT_ALIGN))
                .unwrap_or(u32::MAX)
                .min(units);
            let target = units - keep;
            let mut held = withheld_units(&st);
            while held > target {
                let Some(slot) = st.withheld.pop() else { break };
                let give = (held - target).min(slot.units);
                // The run's top `give` units go back; the rest stays withheld.
                st.slots.free(slot.unit + slot.units - give, give);
                if give < slot.units {
                    st.withheld.push(Slot {
                        unit: slot.unit,
                        units: slot.units - give,
                    });
                }
                held -= give;
            }
            while held < target {
                let want = (target - held).min(st.slots.largest_free());
                if want > 0 {
                    let Some(unit) = st.slots.alloc(want) else {
                        break;
                    };
                    let slot = Slot { unit, units: want };
                    st.withheld.push(slot);
                    released.push(slot);
                    held += want;
                    continue;
                }
                let victim = st
                    .policy
                    .window_victim()
                    .or_else(|| st.policy.main_victim().map(|(v, _)| v))
                    .or_else(|| st.policy.pending_victim());
                match victim {
                    Some(v) => Inner::evict(&mut st, v),
                    None => break,
                }
            }
            st.stats.withheld = held as usize * SLOT_ALIGN;
        }
        // Outside the state lock: these runs are withheld (no page can be placed in
        // them) and only this function, serialised, frees withheld runs.
        for slot in released {
            if let Err(e) = self.inner.arena.release(slot.offset(), slot.bytes()) {
                tracing::warn!("page cache: withheld room not returned to the OS: {e}");
                break;
            }
        }
        self.limit()
    }

    /// Leases page `key` of `len` bytes, loading it with `load` if it is not resident.
    ///
    /// - Resident: a hit; the page is leased at once.
    /// - Being loaded by another request: waits for that load and shares its result.
    /// - Missing: reserves a slot (evicting unleased, unpinned pages per policy), calls
    ///   `load` on it outside the cache lock, and only then makes the page visible.
    ///
    /// `load` must write all `len` bytes (the slot holds a previous page's bytes) and
    /// should verify them: whatever it returns `Ok` for is served. An `Err` or a panic
    /// frees the slot and fails every waiter; a later request loads afresh.
    pub fn acquire<E, F>(&self, key: PageKey, len: usize, load: F) -> Result<Lease, CacheError<E>>
    where
        E: Error + Send + Sync + 'static,
        F: FnOnce(&mut [u8]) -> Result<(), E>,
    {
        let inner = &self.inner;
        let units = self.units_checked(key, len)?;
        let mut st = inner.lock();
        let pinned = st.pins.contains(&key);
        match st.pages.get_mut(&key) {
            Some(Entry::Ready {
                slot,
                len: resident,
                refs,
            }) => {
                if *resident != len {
                    return Err(CacheError::LengthMismatch {
                        key,
                        resident: *resident,
                        requested: len,
                    });
                }
                let slot = *slot;
                *refs += 1;
                let first = *refs == 1;
                if first {
                    st.stats.leased_bytes += slot.bytes();
                    if !pinned {
                        st.policy.set_evictable(key, false);
                    }
                }
                st.stats.hits += 1;
                st.policy.record_access(key);
                let promote = !st.streams(key);
                st.policy.touch(key, promote);
                return Ok(self.lease(key, slot.offset(), len));
            }
            Some(Entry::Loading {
                len: loading,
                waiters,
                cell,
                ..
            }) => {
                if *loading != len {
                    return Err(CacheError::LengthMismatch {
                        key,
                        resident: *loading,
                        requested: len,
                    });
                }
                *waiters += 1;
                let cell = cell.clone();
                st.stats.inflight_dedups += 1;
                st.policy.record_access(key);
                drop(st);
                return match cell.wait() {
                    Outcome::Ready { offset } => Ok(self.lease(key, offset, len)),
                    Outcome::Failed(f) => Err(f.into_error(key)),
                };
            }
            None => {}
        }
        st.policy.record_access(key);
        // Requests before this one (read after recording, which may have aged counts).
        let freq = st.policy.frequency(key).saturating_sub(1);
        let (slot, region) = match inner.make_room(&mut st, key, units, Mode::Demand { freq }) {
            Room::Slot(slot, region) => (slot, region),
            Room::Full | Room::Declined => {
                st.stats.full_refusals += 1;
                return Err(inner.full_error(&st, key, len));
            }
        };
        st.stats.misses += 1;
        self.load_into(st, key, len, slot, region, true, load)
            .map(|offset| self.lease(key, offset, len))
    }

    /// Loads page `key` without leasing it, as a low-priority hint: it may evict only
    /// used window pages and main pages requested no more often than it will have been
    /// once the request it anticipates comes (its count plus one), and does not count
    /// as a request. (Ties are allowed, and pages of the sweep in progress lead the
    /// prefetched one by a request, so the window can grow to hold the layer being
    /// computed plus the one prefetched; pages with more requests are safe.)
    /// Returns at once if the page is resident or being loaded.
    pub fn prefetch<E, F>(
        &self,
        key: PageKey,
        len: usize,
        load: F,
    ) -> Result<Prefetched, CacheError<E>>
    where
        E: Error + Send + Sync + 'static,
        F: FnOnce(&mut [u8]) -> Result<(), E>,
    {
        match self.reserve(key, len)? {
            Reserve::Resident => Ok(Prefetched::Resident),
            Reserve::InFlight => Ok(Prefetched::InFlight),
            Reserve::Skipped => Ok(Prefetched::Skipped),
            Reserve::Reserved(mut r) => {
                // SAFETY: the reservation's slot is this thread's alone until
                // `finish` (see `Reservation::buf`).
                let result = load(unsafe { r.buf() });
                r.finish(result).map(|_| Prefetched::Loaded)
            }
        }
    }

    /// Reserves a slot to load page `key` into as a prefetch (the room rules of
    /// [`PageCache::prefetch`]), for a load that completes elsewhere: on another
    /// thread, after reads in flight. The page is `Loading` (demand requests for it
    /// wait) until the [`Reservation`] is finished or dropped.
    pub fn reserve<E: Error + Send + Sync + 'static>(
        &self,
        key: PageKey,
        len: usize,
    ) -> Result<Reserve, CacheError<E>> {
        let inner = &self.inner;
        let units = self.units_checked(key, len)?;
        let mut st = inner.lock();
        if let Some(r) = Self::already_there(&st, key, len)? {
            return Ok(r);
        }
        let freq = st.policy.frequency(key);
        let (slot, region) = match inner.make_room(&mut st, key, units, Mode::Prefetch { freq }) {
            Room::Slot(slot, region) => (slot, region),
            Room::Full | Room::Declined => {
                st.stats.prefetch_skipped += 1;
                return Ok(Reserve::Skipped);
            }
        };
        st.pages.insert(
            key,
            Entry::Loading {
                slot,
                len,
                region,
                demand: false,
                waiters: 0,
                cell: Arc::new(InFlight::new()),
            },
        );
        Ok(Reserve::Reserved(Reservation {
            inner: Arc::clone(inner),
            key,
            offset: slot.offset(),
            len,
            finished: false,
        }))
    }

    /// What a reservation of `key` finds already there: `Resident`, `InFlight`, or
    /// `None` when it is neither; a length other than the one held is an error.
    fn already_there<E: Error + Send + Sync + 'static>(
        st: &State,
        key: PageKey,
        len: usize,
    ) -> Result<Option<Reserve>, CacheError<E>> {
        match st.pages.get(&key) {
            Some(Entry::Ready { len: l, .. } | Entry::Loading { len: l, .. }) if *l != len => {
                Err(CacheError::LengthMismatch {
                    key,
                    resident: *l,
                    requested: len,
                })
            }
            Some(Entry::Ready { .. }) => Ok(Some(Reserve::Resident)),
            Some(Entry::Loading { .. }) => Ok(Some(Reserve::InFlight)),
            None => Ok(None),
        }
    }

    /// [`PageCache::reserve`] for a group of pages read together (a layer hinted
    /// ahead): the pages not resident or loading get consecutive slots of one run,
    /// when one can be made, so that streaming layer after layer through a window of
    /// a few layers leaves whole runs behind: the next layer fits exactly where an
    /// evicted one was. Reserved one by one, a layer's pages land wherever each fits,
    /// the free room fragments, and a window sized for two layers soon cannot take
    /// the next one while it holds the current (measured: a sixth of the hints of a
    /// 42-layer sweep were skipped, every one a demand read later). Where no run of
    /// the group's size can be made, its pages of more than one slot get one and the
    /// others are reserved on their own, and failing that every page is. Returns one
    /// result per page, in order.
    pub fn reserve_group<E: Error + Send + Sync + 'static>(
        &self,
        pages: &[(PageKey, usize)],
    ) -> Result<Vec<Reserve>, CacheError<E>> {
        let inner = &self.inner;
        let mut units = Vec::with_capacity(pages.len());
        for &(key, len) in pages {
            units.push(self.units_checked(key, len)?);
        }
        let mut st = inner.lock();
        let mut out: Vec<Option<Reserve>> = Vec::with_capacity(pages.len());
        // The pages to place: not resident, not loading, not pinned (a pinned page
        // keeps its own slot high in the arena).
        let mut missing = Vec::new();
        for (i, &(key, len)) in pages.iter().enumerate() {
            let there = Self::already_there(&st, key, len)?;
            if there.is_none() && !st.pins.contains(&key) {
                missing.push(i);
            }
            out.push(there);
        }
        // One run for all of them; else one for those of more than one slot (a
        // layer whose small pages were pinned, or are resident, leaves a run that
        // much shorter than the next layer's group; the small ones fit anywhere).
        let big: Vec<usize> = missing.iter().copied().filter(|&i| units[i] > 1).collect();
        let mut attempts = vec![&missing];
        if big.len() < missing.len() {
            attempts.push(&big);
        }
        let mut run = None;
        for attempt in attempts {
            if attempt.len() < 2 {
                continue;
            }
            let total = attempt
                .iter()
                .fold(0u32, |t, &i| t.saturating_add(units[i]));
            let freq = attempt
                .iter()
                .map(|&i| st.policy.frequency(pages[i].0))
                .min()
                .unwrap_or(0);
            let key = pages[attempt[0]].0;
            if let Room::Slot(slot, region) =
                inner.make_room(&mut st, key, total, Mode::Prefetch { freq })
            {
                run = Some((slot.unit, region, attempt.clone()));
                break;
            }
        }
        let (mut unit, region, in_run) = run.unwrap_or((0, Region::Window, Vec::new()));
        let mut result: Vec<Reserve> = Vec::with_capacity(pages.len());
        let mut alone = Vec::new();
        for (i, (&(key, len), r)) in pages.iter().zip(out).enumerate() {
            match r {
                Some(r) => result.push(r),
                None if in_run.contains(&i) => {
                    let slot = Slot {
                        unit,
                        units: units[i],
                    };
                    unit += units[i];
                    st.pages.insert(
                        key,
                        Entry::Loading {
                            slot,
                            len,
                            region,
                            demand: false,
                            waiters: 0,
                            cell: Arc::new(InFlight::new()),
                        },
                    );
                    result.push(Reserve::Reserved(Reservation {
                        inner: Arc::clone(inner),
                        key,
                        offset: slot.offset(),
                        len,
                        finished: false,
                    }));
                }
                // Pinned, left out of the run, or no run to be had: on its own.
                None => {
                    alone.push(i);
                    result.push(Reserve::Skipped);
                }
            }
        }
        drop(st);
        for i in alone {
            let (key, len) = pages[i];
            result[i] = self.reserve(key, len)?;
        }
        Ok(result)
    }

    /// Registers `slot` as loading `key`, runs `load` outside the lock, publishes.
    #[allow(clippy::too_many_arguments)]
    fn load_into<E, F>(
        &self,
        mut st: MutexGuard<'_, State>,
        key: PageKey,
        len: usize,
        slot: Slot,
        region: Region,
        demand: bool,
        load: F,
    ) -> Result<usize, CacheError<E>>
    where
        E: Error + Send + Sync + 'static,
        F: FnOnce(&mut [u8]) -> Result<(), E>,
    {
        let inner = &*self.inner;
        st.pages.insert(
            key,
            Entry::Loading {
                slot,
                len,
                region,
                demand,
                waiters: 0,
                cell: Arc::new(InFlight::new()),
            },
        );
        drop(st);
        let mut guard = LoadGuard {
            inner,
            key,
            armed: true,
        };
        // SAFETY: the slot was just taken from the allocator and its page is `Loading`:
        // no lease, reader or other loader can reach this range until `finish`
        // publishes it, so this is the only reference to it. It lies in the arena
        // because the allocator's units cover exactly the arena's capacity.
        let result = match unsafe { inner.arena.bytes_mut(slot.offset(), len) } {
            Ok(buf) => load(buf).map_err(Failure::from_error),
            Err(_) => unreachable!("allocator slots lie inside the arena"),
        };
        guard.armed = false;
        match inner.finish(key, result, u32::from(demand)) {
            Outcome::Ready { offset } => Ok(offset),
            Outcome::Failed(f) => Err(f.into_error(key)),
        }
    }

    fn units_checked<E: Error + Send + Sync + 'static>(
        &self,
        key: PageKey,
        len: usize,
    ) -> Result<u32, CacheError<E>> {
        let total = self.inner.arena.capacity() / SLOT_ALIGN;
        match units_for(len) {
            Some(u) if (u as usize) <= total => Ok(u),
            _ => Err(CacheError::TooLarge {
                key,
                len,
                capacity: self.inner.arena.capacity(),
            }),
        }
    }

    fn lease(&self, key: PageKey, offset: usize, len: usize) -> Lease {
        Lease {
            key,
            offset,
            len,
            inner: self.inner.clone(),
        }
    }

    /// Releases a lease (the same as dropping it).
    pub fn release(&self, lease: Lease) {
        drop(lease);
    }

    /// Marks `model`'s pages as placed by a memory planner (`on`), or not: the planner
    /// pinned what saves the most reads per token and sized the rest of the budget as
    /// the window its other pages stream through, so none of them is admitted to
    /// main or promoted there (it would shrink the window below the layers streaming
    /// needs, and the hints ahead would find no room). Its pages are evicted oldest
    /// used first, which in a sweep frees whole layers.
    pub fn set_streaming(&self, model: u32, on: bool) {
        let mut st = self.inner.lock();
        if on {
            st.streaming.insert(model);
        } else {
            st.streaming.remove(&model);
        }
    }

    /// Leaves pages of a streaming model to admission all the same: routed experts,
    /// which a token reads only when its router picks them, so that the experts picked
    /// often stay in main (by TinyLFU: one-off ones do not displace them) in the room
    /// the planner left beside its pins and window, while the rest streams.
    pub fn set_admissible(&self, keys: impl IntoIterator<Item = PageKey>) {
        let mut st = self.inner.lock();
        st.admissible.extend(keys);
    }

    /// Pins pages: a pinned page is never evicted. Pins on pages not yet resident take
    /// effect when they load.
    pub fn pin(&self, keys: impl IntoIterator<Item = PageKey>) {
        let mut st = self.inner.lock();
        for key in keys {
            if !st.pins.insert(key) {
                continue;
            }
            if let Some(Entry::Ready { slot, .. }) = st.pages.get(&key) {
                let bytes = slot.bytes();
                st.stats.pinned_bytes += bytes;
                st.policy.set_evictable(key, false);
            }
        }
    }

    /// Removes pins; unleased pages become evictable again.
    pub fn unpin(&self, keys: impl IntoIterator<Item = PageKey>) {
        let mut st = self.inner.lock();
        for key in keys {
            if !st.pins.remove(&key) {
                continue;
            }
            if let Some(&Entry::Ready { slot, refs, .. }) = st.pages.get(&key) {
                st.stats.pinned_bytes -= slot.bytes();
                if refs == 0 {
                    st.policy.set_evictable(key, true);
                }
            }
        }
    }

    pub fn is_pinned(&self, key: PageKey) -> bool {
        self.inner.lock().pins.contains(&key)
    }

    /// Whether the page is resident or being loaded (a prefetch of it has nothing to do).
    pub fn present(&self, key: PageKey) -> bool {
        self.inner.lock().pages.contains_key(&key)
    }

    /// Whether the page is resident and complete.
    pub fn resident(&self, key: PageKey) -> bool {
        matches!(self.inner.lock().pages.get(&key), Some(Entry::Ready { .. }))
    }

    pub fn stats(&self) -> CacheStats {
        let st = self.inner.lock();
        let mut s = st.stats.clone();
        s.used =
            (st.slots.units() - st.slots.free_units() - withheld_units(&st)) as usize * SLOT_ALIGN;
        s.resident_pages = st.policy.resident_pages();
        s.loading_pages = st.pages.len() - st.policy.resident_pages();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("test load error {0}")]
    struct TestErr(u32);

    fn cache(slots: usize) -> PageCache {
        PageCache::new(Arena::new(slots * SLOT_ALIGN).unwrap())
    }

    fn key(page: u32) -> PageKey {
        PageKey { model: 1, page }
    }

    fn fill(v: u8) -> impl FnOnce(&mut [u8]) -> Result<(), TestErr> {
        move |b| {
            b.fill(v);
            Ok(())
        }
    }

    #[test]
    fn miss_then_hit_and_bytes_are_the_loaded_ones() {
        let c = cache(4);
        let l = c.acquire(key(1), 20_000, fill(7)).unwrap();
        assert_eq!(l.offset() % SLOT_ALIGN, 0);
        assert_eq!(l.len(), 20_000);
        assert!(l.bytes().iter().all(|&b| b == 7));
        let l2 = c
            .acquire(key(1), 20_000, |_| -> Result<(), TestErr> {
                panic!("must hit")
            })
            .unwrap();
        assert_eq!(l2.offset(), l.offset());
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.loads), (1, 1, 1));
        assert_eq!(s.used, 2 * SLOT_ALIGN);
        assert_eq!(s.leased_bytes, 2 * SLOT_ALIGN);
        drop(l);
        assert_eq!(c.stats().leased_bytes, 2 * SLOT_ALIGN, "still leased by l2");
        c.release(l2);
        assert_eq!(c.stats().leased_bytes, 0);
        assert!(c.resident(key(1)));
    }

    #[test]
    fn length_mismatch_is_an_error() {
        let c = cache(4);
        let _l = c.acquire(key(1), 100, fill(1)).unwrap();
        let e = c.acquire(key(1), 200, fill(1)).unwrap_err();
        assert!(matches!(
            e,
            CacheError::LengthMismatch {
                resident: 100,
                requested: 200,
                ..
            }
        ));
        assert!(e.to_string().contains("model 1 page 1"), "{e}");
    }

    #[test]
    fn failed_load_frees_its_slot_and_is_retried() {
        let c = cache(2);
        let e = c
            .acquire(key(3), 10, |b: &mut [u8]| {
                b[0] = 1;
                Err(TestErr(9))
            })
            .unwrap_err();
        match &e {
            CacheError::Load { key: k, source } => {
                assert_eq!(*k, key(3));
                assert_eq!(source.0, 9);
            }
            other => panic!("unexpected {other}"),
        }
        assert!(e.to_string().contains("test load error 9"));
        assert!(!c.resident(key(3)));
        let s = c.stats();
        assert_eq!((s.used, s.load_failures, s.loads), (0, 1, 0));
        let l = c.acquire(key(3), 10, fill(4)).unwrap();
        assert_eq!(l.bytes(), &[4; 10]);
    }

    #[test]
    fn panicking_load_leaves_nothing_behind() {
        let c = cache(2);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = c.acquire(key(1), 10, |_: &mut [u8]| -> Result<(), TestErr> {
                panic!("boom")
            });
        }));
        assert!(r.is_err());
        assert!(!c.resident(key(1)));
        assert_eq!(c.stats().used, 0);
        assert!(c.acquire(key(1), 10, fill(2)).is_ok());
    }

    #[test]
    fn pinned_pages_survive_pressure_and_unpin_releases_them() {
        let c = cache(3);
        c.pin([key(0)]);
        drop(c.acquire(key(0), SLOT_ALIGN, fill(0)).unwrap());
        assert_eq!(c.stats().pinned_bytes, SLOT_ALIGN);
        for p in 1..50 {
            drop(c.acquire(key(p), SLOT_ALIGN, fill(p as u8)).unwrap());
        }
        assert!(c.resident(key(0)));
        // Two pinned pages and one leased: a third page cannot be placed.
        c.pin([key(1)]);
        drop(c.acquire(key(1), SLOT_ALIGN, fill(1)).unwrap());
        let _l = c.acquire(key(2), SLOT_ALIGN, fill(2)).unwrap();
        match c.acquire(key(3), SLOT_ALIGN, fill(3)).unwrap_err() {
            CacheError::Full { leased, pinned, .. } => {
                assert_eq!((leased, pinned), (SLOT_ALIGN, 2 * SLOT_ALIGN));
            }
            e => panic!("unexpected {e}"),
        }
        c.unpin([key(0)]);
        assert!(c.acquire(key(3), SLOT_ALIGN, fill(3)).is_ok());
        assert!(!c.resident(key(0)));
    }

    #[test]
    fn a_limit_evicts_what_it_may_returns_memory_and_grows_back() {
        let c = cache(8);
        c.pin([key(0)]);
        for p in 0..6 {
            drop(c.acquire(key(p), SLOT_ALIGN, fill(p as u8)).unwrap());
        }
        let leased = c.acquire(key(6), SLOT_ALIGN, fill(6)).unwrap();
        // Free room first: one slot free, so 7 fit under a limit of 7.
        assert_eq!(c.set_limit(7 * SLOT_ALIGN), 7 * SLOT_ALIGN);
        assert_eq!(c.stats().evictions, 0);
        // Down to 3: pages evicted in policy order, never the pinned or leased one.
        assert_eq!(c.set_limit(3 * SLOT_ALIGN), 3 * SLOT_ALIGN);
        let s = c.stats();
        assert_eq!((s.withheld, s.used), (5 * SLOT_ALIGN, 3 * SLOT_ALIGN));
        assert!(c.resident(key(0)) && c.resident(key(6)));
        // Below what cannot go (one pinned, one leased): it stops there.
        assert_eq!(c.set_limit(0), 2 * SLOT_ALIGN);
        // Withheld room holds no page: a third page finds none.
        assert!(matches!(
            c.acquire(key(7), SLOT_ALIGN, fill(7)),
            Err(CacheError::Full { .. })
        ));
        drop(leased);
        assert!(c.acquire(key(7), SLOT_ALIGN, fill(7)).is_ok());
        // Growing back: pages load into the room again, with their bytes.
        assert_eq!(c.set_limit(usize::MAX), 8 * SLOT_ALIGN);
        assert_eq!(c.stats().withheld, 0);
        for p in 1..6 {
            let l = c.acquire(key(p), SLOT_ALIGN, fill(p as u8)).unwrap();
            assert!(l.bytes().iter().all(|&b| b == p as u8));
        }
        assert!(c.resident(key(0)));
    }

    #[test]
    fn prefetch_loads_without_leasing_and_yields_to_hot_pages() {
        let c = cache(2);
        assert_eq!(c.prefetch(key(1), 5, fill(1)).unwrap(), Prefetched::Loaded);
        assert_eq!(
            c.prefetch(key(1), 5, fill(1)).unwrap(),
            Prefetched::Resident
        );
        assert_eq!(c.stats().leased_bytes, 0);
        // Make pages 1 and 2 hot.
        for _ in 0..3 {
            drop(c.acquire(key(1), 5, fill(1)).unwrap());
            drop(c.acquire(key(2), 5, fill(2)).unwrap());
        }
        assert_eq!(c.prefetch(key(9), 5, fill(9)).unwrap(), Prefetched::Skipped);
        assert!(c.resident(key(1)) && c.resident(key(2)));
        let s = c.stats();
        assert_eq!((s.prefetch_loads, s.prefetch_skipped, s.hits), (1, 1, 5));
    }

    /// A reservation is filled and finished on another thread; a waiter blocked on
    /// the page meanwhile gets the bytes. Dropped unfinished, the load fails its
    /// waiters and frees the slot.
    #[test]
    fn a_reservation_finishes_elsewhere_and_an_abandoned_one_fails() {
        let c = cache(4);
        let Reserve::Reserved(mut r) = c.reserve::<TestErr>(key(1), 7).unwrap() else {
            panic!("a slot was free")
        };
        assert!(matches!(
            c.reserve::<TestErr>(key(1), 7).unwrap(),
            Reserve::InFlight
        ));
        let waiter = {
            let c = c.clone();
            std::thread::spawn(move || c.acquire(key(1), 7, fill(0)).map(|l| l.bytes().to_vec()))
        };
        std::thread::spawn(move || {
            // SAFETY: the reservation is this thread's alone until finished.
            unsafe { r.buf() }.fill(5);
            r.finish(Ok::<(), TestErr>(())).unwrap();
        })
        .join()
        .unwrap();
        assert_eq!(waiter.join().unwrap().unwrap(), vec![5u8; 7]);

        let Reserve::Reserved(r) = c.reserve::<TestErr>(key(2), 7).unwrap() else {
            panic!("a slot was free")
        };
        let waiter = {
            let c = c.clone();
            std::thread::spawn(move || c.acquire(key(2), 7, fill(0)).map(|_| ()))
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        drop(r);
        let e = waiter.join().unwrap();
        // The waiter either waited and got the failure, or came after and loaded.
        assert!(
            matches!(e, Err(CacheError::LoadPanicked { .. }) | Ok(())),
            "{e:?}"
        );
        assert_eq!(c.stats().loading_pages, 0);
    }

    /// With the free room fragmented (enough units, no run long enough), a demand load
    /// evicts the cheapest contiguous span, here the one page beside a free run,
    /// rather than every page in policy order; prefetches are spared.
    #[test]
    fn fragmented_room_evicts_one_contiguous_span() {
        let c = cache(8);
        // Pages 0..8 of one slot each fill the arena, in address order.
        for p in 0..8 {
            drop(c.acquire(key(p), SLOT_ALIGN, fill(p as u8)).unwrap());
        }
        // Free slots 1, 3 and 5 (three units free, no two adjacent); keep the rest.
        {
            let mut st = c.inner.lock();
            for p in [1, 3, 5] {
                Inner::evict(&mut st, key(p));
            }
        }
        // Lease 0 and 7. Policy order alone would evict 6 (main's most recent among
        // equals) and then 4; the spans [1, 4) and [3, 6) need one page each.
        let held: Vec<_> = [0, 7]
            .into_iter()
            .map(|p| c.acquire(key(p), SLOT_ALIGN, fill(0)).unwrap())
            .collect();
        let before = c.stats().evictions;
        let l = c.acquire(key(20), 3 * SLOT_ALIGN, fill(9)).unwrap();
        assert!(
            [SLOT_ALIGN, 3 * SLOT_ALIGN].contains(&l.offset()),
            "{}",
            l.offset()
        );
        assert_eq!(c.stats().evictions - before, 1, "one page");
        assert!(!c.resident(key(2)) || !c.resident(key(4)));
        drop(held);
    }

    /// Waits until a demand request for `k` is waiting on its load in flight.
    fn wait_for_waiter(c: &PageCache, k: PageKey) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let st = c.inner.lock();
            if matches!(st.pages.get(&k), Some(Entry::Loading { waiters, .. }) if *waiters > 0) {
                return;
            }
            drop(st);
            assert!(std::time::Instant::now() < deadline, "no waiter came");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// A prefetched page whose request waited for it in flight has been used: once
    /// released, the next hint may evict it. (It used to stay indexed as awaiting
    /// its request, which no prefetch evicts: a window full of those took no hint.)
    #[test]
    fn a_prefetch_its_request_waited_for_is_used_once_released() {
        let c = cache(2);
        c.set_streaming(1, true);
        for page in [1, 2] {
            let Reserve::Reserved(mut r) = c.reserve::<TestErr>(key(page), SLOT_ALIGN).unwrap()
            else {
                panic!("a slot was free")
            };
            let waiter = {
                let c = c.clone();
                std::thread::spawn(move || drop(c.acquire(key(page), SLOT_ALIGN, fill(0)).unwrap()))
            };
            wait_for_waiter(&c, key(page));
            // SAFETY: the reservation is this test's alone until finished.
            unsafe { r.buf() }.fill(page as u8);
            r.finish(Ok::<(), TestErr>(())).unwrap();
            waiter.join().unwrap();
        }
        // Both slots hold used pages: a hint for a third takes the older one.
        assert!(matches!(
            c.reserve::<TestErr>(key(3), SLOT_ALIGN).unwrap(),
            Reserve::Reserved(_)
        ));
        assert!(!c.resident(key(1)) && c.resident(key(2)));
        assert_eq!(c.stats().prefetch_skipped, 0);
    }

    /// A group's pages get consecutive slots of one run: the window a streaming
    /// model cycles through does not fragment. Reserved page by page in a
    /// fragmented cache, the same group would not fit.
    #[test]
    fn a_group_is_reserved_as_one_run_where_an_older_group_was() {
        let c = cache(8);
        c.set_streaming(1, true);
        let group = |first: u32| -> Vec<(PageKey, usize)> {
            vec![
                (key(first), 2 * SLOT_ALIGN),
                (key(first + 1), SLOT_ALIGN),
                (key(first + 2), SLOT_ALIGN),
            ]
        };
        let offsets = |rs: Vec<Reserve>| -> Vec<usize> {
            rs.into_iter()
                .map(|r| match r {
                    Reserve::Reserved(mut r) => {
                        // SAFETY: the reservation is this test's alone until finished.
                        unsafe { r.buf() }.fill(1);
                        let off = r.offset;
                        r.finish(Ok::<(), TestErr>(())).unwrap();
                        off
                    }
                    _ => panic!("not reserved"),
                })
                .collect()
        };
        let mut runs = Vec::new();
        for layer in 0..6u32 {
            let g = group(10 * layer);
            let o = offsets(c.reserve_group::<TestErr>(&g).unwrap());
            assert_eq!(
                o,
                vec![o[0], o[0] + 2 * SLOT_ALIGN, o[0] + 3 * SLOT_ALIGN],
                "layer {layer}: one run in order"
            );
            runs.push(o[0]);
            // Requested (a sweep computes the layer), then released.
            for (k, len) in g {
                drop(c.acquire(k, len, fill(0)).unwrap());
            }
        }
        // Two layers fit: each new layer takes the run the layer before last held.
        assert_eq!(runs[2], runs[0]);
        assert_eq!(runs[3], runs[1]);
        assert_eq!(runs[4], runs[0]);
        let s = c.stats();
        assert_eq!((s.prefetch_skipped, s.misses), (0, 0), "{s:?}");
        // Already resident pages are reported, not reserved again.
        assert!(c
            .reserve_group::<TestErr>(&group(50))
            .unwrap()
            .iter()
            .all(|r| matches!(r, Reserve::Resident)));
    }

    /// Pages of a streaming model are never admitted to main, however often they
    /// are requested: they leave in the order they were used.
    #[test]
    fn a_streaming_model_is_not_admitted() {
        let c = cache(4);
        c.set_streaming(1, true);
        for _ in 0..3 {
            for p in 0..4 {
                drop(c.acquire(key(p), SLOT_ALIGN, fill(p as u8)).unwrap());
            }
        }
        assert_eq!(c.stats().admitted, 0);
        let st = c.inner.lock();
        assert!((0..4).all(|p| st.policy.region(key(p)) != Some(Region::Main)));
        drop(st);
        // Another model's page still is promoted by its second request.
        let other = PageKey { model: 2, page: 0 };
        for _ in 0..3 {
            drop(c.acquire(other, SLOT_ALIGN, fill(9)).unwrap());
        }
        assert_eq!(c.inner.lock().policy.region(other), Some(Region::Main));
    }

    /// Pages of a streaming model left admissible (routed experts) are admitted to
    /// main by their requests, while its other pages only stream.
    #[test]
    fn admissible_pages_of_a_streaming_model_are_admitted() {
        let c = cache(4);
        c.set_streaming(1, true);
        c.set_admissible([key(0), key(1)]);
        for _ in 0..3 {
            for p in 0..4 {
                drop(c.acquire(key(p), SLOT_ALIGN, fill(p as u8)).unwrap());
            }
        }
        let st = c.inner.lock();
        assert_eq!(st.policy.region(key(0)), Some(Region::Main));
        assert_eq!(st.policy.region(key(1)), Some(Region::Main));
        assert!((2..4).all(|p| st.policy.region(key(p)) != Some(Region::Main)));
    }

    /// A group that cannot have one run (a small page of the room it needs is
    /// held) still gets one for its pages of more than one slot, where page by page
    /// the first would take a free hole elsewhere and split the layer.
    #[test]
    fn a_group_short_of_one_run_keeps_its_large_pages_together() {
        let c = cache(12);
        c.set_streaming(1, true);
        let s = SLOT_ALIGN;
        let reserve = |g: &[(PageKey, usize)]| -> Vec<Option<usize>> {
            c.reserve_group::<TestErr>(g)
                .unwrap()
                .into_iter()
                .map(|r| match r {
                    Reserve::Reserved(mut r) => {
                        // SAFETY: the reservation is this test's alone until finished.
                        unsafe { r.buf() }.fill(1);
                        let off = r.offset;
                        r.finish(Ok::<(), TestErr>(())).unwrap();
                        Some(off / s)
                    }
                    _ => None,
                })
                .collect()
        };
        let layer = |first: u32| {
            vec![
                (key(first), 2 * s),
                (key(first + 1), 2 * s),
                (key(first + 2), s),
            ]
        };
        assert_eq!(reserve(&layer(0)), vec![Some(0), Some(2), Some(4)]);
        assert_eq!(reserve(&layer(10)), vec![Some(5), Some(7), Some(9)]);
        // Layer 0 computed: its large pages released, its small one still held;
        // layer 1 computing (held). Free: units 10..12.
        drop(c.acquire(key(0), 2 * s, fill(0)).unwrap());
        drop(c.acquire(key(1), 2 * s, fill(0)).unwrap());
        let _held: Vec<Lease> = [(2, 1), (10, 2), (11, 2), (12, 1)]
            .into_iter()
            .map(|(p, n)| c.acquire(key(p), n * s, fill(0)).unwrap())
            .collect();
        // Five units in one run cannot be had (unit 4 is held); the two large pages
        // take layer 0's run together, the small one the free hole.
        assert_eq!(reserve(&layer(20)), vec![Some(0), Some(2), Some(10)]);
    }
}
