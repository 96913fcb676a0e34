//! Eviction and admission: TinyLFU admission in front of an LFU main region, with a
//! FIFO window for pages that were not admitted.
//!
//! The policy follows TinyLFU (Einziger, Friedman and Manes, "TinyLFU: A Highly
//! Efficient Cache Admission Policy", 2017): a page missing from the cache displaces a
//! resident page only if it has been requested more often than that page. Frequencies
//! are kept exactly (page keys are bounded by the model manifests, so an exact table
//! costs a few bytes a key and has none of a count-min sketch's collisions) and age
//! like TinyLFU's: every `10 x resident pages` recorded accesses all counts halve.
//!
//! Regions:
//! - **Main**: admitted pages. Victims are taken lowest frequency first, *most*
//!   recently used among equals (see "cyclic sweeps" below for why not least).
//! - **Window**: pages served on demand that lost the admission test (and prefetched
//!   pages that lost it). Used ones are evicted first, oldest first. Prefetched pages
//!   not yet requested, in either region, are indexed as pending window pages: no
//!   prefetch evicts them, and a demand load only after main's victims, newest first
//!   (in a sweep, the oldest is the page needed next: evicting it reads it twice; and
//!   in main's order a prefetched page is the most recent, the first victim among
//!   equals, so it went before it was used). A second demand request while still in
//!   the window proves reuse and promotes the page to main (as in S3-FIFO's small
//!   queue).
//!   The window has no fixed size: it is what streaming needs (the pages an engine
//!   holds at once, and the layer it prefetched), carved out of main by eviction when
//!   it must grow.
//!
//! Why it resists what defeats LRU:
//! - *Cyclic sweeps* (a model larger than the cache read layer 0..N, 0..N, ...): the
//!   requested page was last used a full cycle ago, exactly like every resident page not
//!   yet reused in this cycle, so its frequency ties with main's victim and it is not
//!   admitted. It streams through the window while main keeps a stable subset, which
//!   hits on every cycle: the hit ratio tends to (cache - window) / working set, where
//!   LRU scores zero. Three rules keep that subset stable when page sizes are very
//!   uneven (a released model: one embedding of a fifth of the model, layer matrices
//!   of 0.2 to 2 MB, norms of one slot), each the fix of a way it used to collapse to
//!   no hits at all:
//!   1. *Free room is not a free pass.* Evicting a large page for a smaller one leaves
//!      free room; were every load that fits in free room admitted untested, the pages
//!      after it would join main, main would outgrow its share and the window would
//!      have to be carved out of main again on every sweep. Free room goes to main
//!      only when the page passes admission or the room is *spare*: the window plus
//!      the free bytes still cover the window's recent need ([`Policy::spare_room`]),
//!      the most bytes streaming could not do without (leased and pending window
//!      pages plus the page being placed) over the last one or two aging periods. So
//!      the first fill goes to main, and main regrows into room streaming stopped
//!      using, but never into the window's working room.
//!   2. *When main must shrink, it gives up its most recently used page.* A demand load
//!      the window cannot make room for (a large page behind small ones, a leased
//!      layer) evicts main's victim. Least recently used among equal counts is, in a
//!      cycle, exactly the page needed next; it then misses, needs room in turn, and
//!      the cascade empties main within one sweep. Most recently used among equals is
//!      the page whose reuse is furthest away (Belady's choice for a loop), so a
//!      forced eviction costs one hit on the next sweep and nothing more. Frequency
//!      still ranks first: a page requested more often is never given up for a page
//!      requested less.
//!   3. *Ties are never admitted* (strictly more requests than the victim), so in a
//!      steady cycle no page displaces another and main does not churn.
//!
//!   A prefetch anticipates a request: it may evict window pages and main pages
//!   requested no more often than it will have been once that request comes (its
//!   count plus one). Pages already requested in this sweep lead the pages still to
//!   come by one request, so without the plus one the layer prefetched ahead would
//!   find no room once the resident subset had been swept, and the window could not
//!   grow to the leased layer plus the prefetched one.
//! - *Scans* (a burst of one-use pages): a page never seen before has frequency 0 and
//!   never displaces a main page that was used; scans churn only the window.
//!
//! The frequency a missing page brings to the admission test is its count *before* the
//! current request; a resident page's is its count so far. Both count the requests
//! strictly before now, so the phase of a cycle does not bias the comparison.
//!
//! Caller's obligations: the policy indexes only *evictable* pages (resident, ready,
//! unleased, unpinned); the cache calls [`Policy::set_evictable`] on every transition
//! and removes every evicted page with [`Policy::remove`].

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::PageKey;

/// Where a resident page sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Region {
    Window,
    Main,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IndexPos {
    /// Key into `window`: (pending, insertion tick).
    Window(bool, u64),
    /// Key into `main`: (frequency when indexed, last access tick).
    Main(u32, u64),
}

#[derive(Debug, Clone)]
struct Meta {
    region: Region,
    /// Slot bytes.
    size: u64,
    inserted: u64,
    last_access: u64,
    /// Demand requests served while in the window.
    window_demands: u32,
    /// Loaded by a prefetch and not yet requested: indexed as a pending window page
    /// whatever its region, so neither main's victim order nor another prefetch
    /// takes it before its request comes (it would be main's most recent page, the
    /// first victim among equals).
    awaiting: bool,
    indexed: Option<IndexPos>,
}

/// Smallest aging period, so a near-empty cache still accumulates history.
const MIN_AGING_PERIOD: u64 = 1024;

#[derive(Debug, Default)]
pub struct Policy {
    freq: HashMap<PageKey, u32>,
    samples: u64,
    tick: u64,
    entries: HashMap<PageKey, Meta>,
    /// Evictable window pages by (pending, insertion tick): used pages first, FIFO; then
    /// prefetched pages not yet requested ("pending"), FIFO.
    window: BTreeMap<(bool, u64), PageKey>,
    /// Evictable main pages by (frequency, most recent access first): first is the
    /// victim.
    main: BTreeSet<(u32, Reverse<u64>, PageKey)>,
    window_bytes: u64,
    pending_bytes: u64,
    main_bytes: u64,
    /// Bytes of every resident window page, evictable or not (leased, pinned).
    window_resident: u64,
    /// The most window bytes streaming could not do without (leased or pending window
    /// pages plus the page being placed), in this aging period and in the previous
    /// one: see [`Policy::note_window_need`].
    window_need: [u64; 2],
    agings: u64,
}

impl Policy {
    pub fn new() -> Policy {
        Policy::default()
    }

    /// Requests of `key` recorded so far (after aging).
    pub fn frequency(&self, key: PageKey) -> u32 {
        self.freq.get(&key).copied().unwrap_or(0)
    }

    /// Number of times the counts were halved.
    pub fn agings(&self) -> u64 {
        self.agings
    }

    /// Records one demand request of `key` (resident or not).
    pub fn record_access(&mut self, key: PageKey) {
        let f = self.freq.entry(key).or_insert(0);
        *f = f.saturating_add(1);
        self.samples += 1;
        let period = (10 * self.entries.len() as u64).max(MIN_AGING_PERIOD);
        if self.samples >= period {
            self.age();
        }
    }

    /// Halves every count, forgets zeros, and re-sorts main by the new counts.
    fn age(&mut self) {
        self.samples = 0;
        self.agings += 1;
        self.window_need = [0, self.window_need[0]];
        self.freq.retain(|_, f| {
            *f /= 2;
            *f > 0
        });
        let indexed: Vec<PageKey> = self.main.iter().map(|&(_, _, k)| k).collect();
        for key in indexed {
            self.unindex(key);
            self.index(key);
        }
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// A page became resident (its load finished). `demand`: it was loaded for a demand
    /// request (not a prefetch).
    pub fn insert(&mut self, key: PageKey, size: u64, region: Region, demand: bool) {
        let t = self.next_tick();
        let old = self.entries.insert(
            key,
            Meta {
                region,
                size,
                inserted: t,
                last_access: t,
                window_demands: u32::from(demand),
                awaiting: !demand,
                indexed: None,
            },
        );
        debug_assert!(old.is_none(), "page inserted twice");
        if region == Region::Window {
            self.window_resident += size;
        }
    }

    /// A page left the cache (evicted, or its residency ended).
    pub fn remove(&mut self, key: PageKey) {
        self.unindex(key);
        if let Some(m) = self.entries.remove(&key) {
            if m.region == Region::Window {
                self.window_resident -= m.size;
            }
        }
    }

    /// What evicting an evictable page costs, for choosing which pages to evict
    /// together when room must be contiguous: `None` if it is not evictable (leased,
    /// pinned, loading) or may not be evicted for a load of this kind (a prefetch
    /// spares pending prefetches and main pages requested more often than
    /// `prefetch_freq + 1`, as [`Policy::reclaimable_for_prefetch`] counts).
    /// Used window pages cost least, main pages more (more with more requests),
    /// pending prefetches most (each was read for a request still to come).
    pub fn eviction_cost(&self, key: PageKey, prefetch_freq: Option<u32>) -> Option<u64> {
        let m = self.entries.get(&key)?;
        let units = m.size.div_ceil(crate::arena::SLOT_ALIGN as u64).max(1);
        match m.indexed? {
            IndexPos::Window(false, _) => Some(units),
            IndexPos::Window(true, _) => match prefetch_freq {
                Some(_) => None,
                None => Some(units.saturating_mul(1 << 20)),
            },
            IndexPos::Main(..) => {
                let f = self.frequency(key);
                match prefetch_freq {
                    Some(pf) if f > pf.saturating_add(1) => None,
                    _ => Some(units.saturating_mul(2 + f.min(1 << 10) as u64)),
                }
            }
        }
    }

    /// Whether `key` was loaded by a prefetch and not requested since.
    pub fn is_awaiting(&self, key: PageKey) -> bool {
        self.entries.get(&key).is_some_and(|m| m.awaiting)
    }

    pub fn region(&self, key: PageKey) -> Option<Region> {
        self.entries.get(&key).map(|m| m.region)
    }

    /// A demand hit on a resident page: refreshes its recency; a second demand hit in
    /// the window promotes it to main (when `promote`; pages that only stream stay).
    pub fn touch(&mut self, key: PageKey, promote: bool) {
        let t = self.next_tick();
        let was_indexed = self.unindex(key);
        if let Some(m) = self.entries.get_mut(&key) {
            m.last_access = t;
            m.awaiting = false;
            if m.region == Region::Window {
                m.window_demands += 1;
                if promote && m.window_demands >= 2 {
                    m.region = Region::Main;
                    self.window_resident -= m.size;
                }
            }
        }
        if was_indexed {
            self.index(key);
        }
    }

    /// Adds or removes `key` from the victim indexes.
    pub fn set_evictable(&mut self, key: PageKey, evictable: bool) {
        let indexed = self.entries.get(&key).is_some_and(|m| m.indexed.is_some());
        if evictable && !indexed {
            self.index(key);
        } else if !evictable && indexed {
            self.unindex(key);
        }
    }

    fn index(&mut self, key: PageKey) {
        let f = self.frequency(key);
        let Some(m) = self.entries.get_mut(&key) else {
            return;
        };
        let region = if m.awaiting { Region::Window } else { m.region };
        let pos = match region {
            Region::Window => {
                let pending = m.awaiting || m.window_demands == 0;
                self.window.insert((pending, m.inserted), key);
                self.window_bytes += m.size;
                if pending {
                    self.pending_bytes += m.size;
                }
                IndexPos::Window(pending, m.inserted)
            }
            Region::Main => {
                self.main.insert((f, Reverse(m.last_access), key));
                self.main_bytes += m.size;
                IndexPos::Main(f, m.last_access)
            }
        };
        m.indexed = Some(pos);
    }

    /// Returns whether the key was indexed.
    fn unindex(&mut self, key: PageKey) -> bool {
        let Some(m) = self.entries.get_mut(&key) else {
            return false;
        };
        match m.indexed.take() {
            Some(IndexPos::Window(pending, t)) => {
                self.window.remove(&(pending, t));
                self.window_bytes -= m.size;
                if pending {
                    self.pending_bytes -= m.size;
                }
                true
            }
            Some(IndexPos::Main(f, t)) => {
                self.main.remove(&(f, Reverse(t), key));
                self.main_bytes -= m.size;
                true
            }
            None => false,
        }
    }

    /// The window page to evict for a demand load: the oldest used one.
    pub fn window_victim(&self) -> Option<PageKey> {
        self.window_victim_for_prefetch()
    }

    /// The prefetched page still waiting for its request that a demand load evicts
    /// when nothing else can go: the newest (in a sweep, the one needed furthest
    /// ahead; the oldest is the one needed next, and evicting it would read it twice).
    pub fn pending_victim(&self) -> Option<PageKey> {
        self.window
            .last_key_value()
            .filter(|((pending, _), _)| *pending)
            .map(|(_, &k)| k)
    }

    /// The window page a prefetch may evict: the oldest used one. A prefetch never
    /// evicts another prefetch still waiting for its request (that would waste the
    /// read and, with read-ahead, evict the next page to be used).
    pub fn window_victim_for_prefetch(&self) -> Option<PageKey> {
        self.window
            .first_key_value()
            .filter(|((pending, _), _)| !pending)
            .map(|(_, &k)| k)
    }

    /// Evictable main page with the lowest frequency (most recently used among
    /// equals: in a cycle, the one needed last), and that frequency.
    pub fn main_victim(&self) -> Option<(PageKey, u32)> {
        self.main.first().map(|&(_, _, k)| (k, self.frequency(k)))
    }

    /// TinyLFU's test: is a missing page requested `candidate_freq` times before now
    /// worth more than main's current victim? With no evictable main page there is
    /// nothing to displace, and the page is not admitted.
    pub fn admits(&self, candidate_freq: u32) -> bool {
        self.main_victim()
            .is_some_and(|(_, victim_freq)| candidate_freq > victim_freq)
    }

    /// Bytes a prefetch of a page with `candidate_freq` may free: all evictable window
    /// pages plus main pages requested no more often, counted until `need` is reached.
    pub fn reclaimable_for_prefetch(&self, candidate_freq: u32, need: u64) -> u64 {
        let mut total = self.window_bytes - self.pending_bytes;
        for &(_, _, k) in &self.main {
            if total >= need || self.frequency(k) > candidate_freq {
                break;
            }
            total += self.entries[&k].size;
        }
        total
    }

    /// Records that a page of `incoming` bytes is being placed in the window: streaming
    /// then holds the window pages it cannot give up (leased, or prefetched and not yet
    /// requested) plus this one. The largest such figure over the last one to two aging
    /// periods is the window's need.
    pub fn note_window_need(&mut self, incoming: u64) {
        let held = self.window_resident - (self.window_bytes - self.pending_bytes);
        self.window_need[0] = self.window_need[0].max(held + incoming);
    }

    /// The window bytes streaming has needed recently (see [`Self::note_window_need`]).
    pub fn window_need(&self) -> u64 {
        self.window_need[0].max(self.window_need[1])
    }

    /// Whether the window, with `free` unallocated bytes beside it, still covers its
    /// recent need: then free space is spare and may go to main without displacing
    /// anything.
    pub fn spare_room(&self, free: u64) -> bool {
        self.window_resident + free >= self.window_need()
    }

    /// Bytes of all evictable pages.
    pub fn evictable_bytes(&self) -> u64 {
        self.window_bytes + self.main_bytes
    }

    /// Number of resident pages known to the policy.
    pub fn resident_pages(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(page: u32) -> PageKey {
        PageKey { model: 0, page }
    }

    #[test]
    fn window_is_fifo_and_main_is_lfu_then_mru() {
        let mut p = Policy::new();
        for i in 0..3 {
            p.record_access(k(i));
            p.insert(k(i), 1, Region::Main, true);
            p.set_evictable(k(i), true);
        }
        p.record_access(k(0));
        p.touch(k(0), true);
        // k(1) and k(2) have 1 request; k(2) is the more recent, so (in a cycle) the
        // one needed last.
        assert_eq!(p.main_victim(), Some((k(2), 1)));
        p.insert(k(10), 1, Region::Window, true);
        p.insert(k(11), 1, Region::Window, false);
        p.set_evictable(k(11), true);
        p.set_evictable(k(10), true);
        assert_eq!(
            p.window_victim(),
            Some(k(10)),
            "insertion order, not index order"
        );
        assert_eq!(p.window_victim_for_prefetch(), Some(k(10)));
        assert_eq!(p.pending_victim(), Some(k(11)));
        p.set_evictable(k(10), false);
        assert_eq!(p.window_victim(), None, "a pending prefetch goes last");
        assert_eq!(
            p.window_victim_for_prefetch(),
            None,
            "pending prefetch is spared"
        );
        assert_eq!(p.pending_victim(), Some(k(11)));
        p.insert(k(12), 1, Region::Window, false);
        p.set_evictable(k(12), true);
        assert_eq!(p.pending_victim(), Some(k(12)), "the newest pending first");
        p.remove(k(12));
        assert_eq!(p.evictable_bytes(), 4);
        p.remove(k(11));
        p.remove(k(2));
        assert_eq!(p.evictable_bytes(), 2);
        assert_eq!(p.main_victim(), Some((k(1), 1)));
    }

    #[test]
    fn admission_needs_strictly_more_requests_than_the_victim() {
        let mut p = Policy::new();
        p.record_access(k(0));
        p.insert(k(0), 1, Region::Main, true);
        p.set_evictable(k(0), true);
        assert!(!p.admits(0));
        assert!(!p.admits(1));
        assert!(p.admits(2));
    }

    #[test]
    fn second_demand_in_the_window_promotes() {
        let mut p = Policy::new();
        p.insert(k(5), 1, Region::Window, false); // prefetched
        p.set_evictable(k(5), true);
        p.touch(k(5), true); // the demand the prefetch anticipated
        assert_eq!(p.region(k(5)), Some(Region::Window));
        p.touch(k(5), true);
        assert_eq!(p.region(k(5)), Some(Region::Main));
        assert_eq!(p.window_victim(), None);
        assert_eq!(p.main_victim().map(|v| v.0), Some(k(5)));
    }

    #[test]
    fn aging_halves_counts_and_keeps_the_index_consistent() {
        let mut p = Policy::new();
        for _ in 0..7 {
            p.record_access(k(1));
        }
        p.insert(k(1), 1, Region::Main, true);
        p.set_evictable(k(1), true);
        for i in 0..(MIN_AGING_PERIOD as u32 - 7) {
            p.record_access(k(100 + i));
        }
        assert_eq!(p.agings(), 1);
        assert_eq!(p.frequency(k(1)), 3);
        assert_eq!(p.frequency(k(100)), 0, "one-use keys are forgotten");
        assert_eq!(p.main_victim(), Some((k(1), 3)));
        p.remove(k(1));
        assert_eq!(p.evictable_bytes(), 0);
    }

    #[test]
    fn a_more_requested_page_outranks_recency() {
        let mut p = Policy::new();
        for _ in 0..2 {
            p.record_access(k(0));
        }
        p.insert(k(0), 1, Region::Main, true);
        p.set_evictable(k(0), true);
        p.record_access(k(1));
        p.insert(k(1), 1, Region::Main, true);
        p.set_evictable(k(1), true);
        p.touch(k(0), true);
        assert_eq!(p.main_victim(), Some((k(1), 1)), "fewer requests go first");
    }

    #[test]
    fn free_room_is_spare_only_beyond_the_windows_recent_need() {
        let mut p = Policy::new();
        assert!(p.spare_room(0), "no streaming yet: all free room is spare");
        // A leased window page of 4 and an incoming one of 3: streaming needs 7.
        p.insert(k(1), 4, Region::Window, true);
        p.note_window_need(3);
        assert_eq!(p.window_need(), 7);
        p.insert(k(2), 3, Region::Window, true);
        assert!(p.spare_room(0));
        // Released, the pages stay in the window (evictable): still its room.
        p.set_evictable(k(1), true);
        p.set_evictable(k(2), true);
        assert!(p.spare_room(0));
        p.remove(k(1));
        assert!(!p.spare_room(3), "3 + 3 < 7");
        assert!(p.spare_room(4));
        // Evictable used window pages do not count in the need; pending ones do.
        p.insert(k(3), 5, Region::Window, false);
        p.set_evictable(k(3), true);
        p.note_window_need(1);
        assert_eq!(p.window_need(), 7, "pending 5 + incoming 1 < 7");
        p.note_window_need(4);
        assert_eq!(p.window_need(), 9);
        // A promoted page leaves the window's bytes.
        p.touch(k(2), true);
        p.touch(k(2), true);
        assert_eq!(p.region(k(2)), Some(Region::Main));
        assert!(!p.spare_room(3), "window 5 + free 3 < 9");
        // The need is forgotten after two aging periods without it.
        for round in 0..2 {
            for i in 0..MIN_AGING_PERIOD as u32 {
                p.record_access(k(1000 + i));
            }
            assert_eq!(p.window_need(), if round == 0 { 9 } else { 0 });
        }
    }
}
