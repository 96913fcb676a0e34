//! The slot allocator: variable-sized runs of 16 KiB units inside the arena.
//!
//! Best fit over a free list with immediate coalescing. Free runs are indexed twice:
//! by start (to find and merge neighbours on free) and by `(length, start)` (to find
//! the smallest run that fits, lowest address first). Both operations are
//! `O(log runs)`.
//!
//! Fragmentation: best fit keeps large runs intact and, because a model's pages come
//! in a few repeated sizes (each layer has the same tensor shapes), a freed slot is
//! usually reused by a page of exactly its size, leaving no sliver. Freed neighbours
//! merge at once, so with nothing allocated the arena is one free run again. External
//! fragmentation is still possible: the free bytes can exceed a request with no run
//! long enough. The cache then evicts the cheapest contiguous span of free runs and
//! evictable slots (used streaming pages before main's, prefetched pages still to be
//! used last), one page where one suffices rather than every page in policy order
//! until a run forms, and reports [`super::CacheError::Full`] with the largest free run when
//! leased or pinned slots prevent it. Internal fragmentation is below one unit
//! (16 KiB) per page.

use std::collections::{BTreeMap, BTreeSet};

/// Free runs of units, best fit, coalescing. Units are abstract; the cache maps unit
/// `u` to arena offset `u * SLOT_ALIGN`.
#[derive(Debug, Clone)]
pub struct SlotAllocator {
    units: u32,
    free_units: u32,
    /// start -> length of each free run; runs never touch (they are merged).
    by_start: BTreeMap<u32, u32>,
    /// (length, start) of each free run.
    by_len: BTreeSet<(u32, u32)>,
}

impl SlotAllocator {
    /// All `units` free, as one run.
    pub fn new(units: u32) -> SlotAllocator {
        let mut a = SlotAllocator {
            units,
            free_units: 0,
            by_start: BTreeMap::new(),
            by_len: BTreeSet::new(),
        };
        if units > 0 {
            a.insert_run(0, units);
        }
        a
    }

    pub fn units(&self) -> u32 {
        self.units
    }

    pub fn free_units(&self) -> u32 {
        self.free_units
    }

    /// Length of the longest free run.
    pub fn largest_free(&self) -> u32 {
        self.by_len.last().map_or(0, |&(len, _)| len)
    }

    /// The free runs, (start, length), in address order.
    pub fn free_runs_by_address(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.by_start.iter().map(|(&s, &l)| (s, l))
    }

    /// Number of free runs (1 when nothing is allocated).
    pub fn free_runs(&self) -> usize {
        self.by_start.len()
    }

    /// Allocates `len` (> 0) contiguous units; returns the first unit, or `None` when no
    /// free run is long enough.
    pub fn alloc(&mut self, len: u32) -> Option<u32> {
        if len == 0 {
            return None;
        }
        let &(run_len, start) = self.by_len.range((len, 0)..).next()?;
        self.remove_run(start, run_len);
        if run_len > len {
            self.insert_run(start + len, run_len - len);
        }
        Some(start)
    }

    /// Allocates `len` (> 0) contiguous units as high in the arena as a free run
    /// allows: the top of the highest run long enough. Pinned pages are placed so,
    /// and streaming pages by [`alloc`](Self::alloc) (best fit, lowest first), so
    /// that pins gather at the top and leave the bottom's runs long for streaming.
    pub fn alloc_high(&mut self, len: u32) -> Option<u32> {
        if len == 0 {
            return None;
        }
        let (&start, &run_len) = self.by_start.iter().rev().find(|(_, &l)| l >= len)?;
        self.remove_run(start, run_len);
        if run_len > len {
            self.insert_run(start, run_len - len);
        }
        Some(start + run_len - len)
    }

    /// Returns `start..start+len` to the free list, merging it with free neighbours.
    ///
    /// The range must be one previously returned by [`alloc`](Self::alloc) and not yet
    /// freed; a violation is a bug in the caller and panics (it would corrupt the
    /// arena's accounting).
    pub fn free(&mut self, start: u32, len: u32) {
        let end = start.checked_add(len).expect("slot range overflows");
        assert!(
            len > 0 && end <= self.units,
            "freeing a range outside the arena"
        );
        let mut new_start = start;
        let mut new_len = len;
        if let Some((&p_start, &p_len)) = self.by_start.range(..start).next_back() {
            assert!(p_start + p_len <= start, "double free: overlaps a free run");
            if p_start + p_len == start {
                self.remove_run(p_start, p_len);
                new_start = p_start;
                new_len += p_len;
            }
        }
        if let Some((&n_start, &n_len)) = self.by_start.range(start..).next() {
            assert!(n_start >= end, "double free: overlaps a free run");
            if n_start == end {
                self.remove_run(n_start, n_len);
                new_len += n_len;
            }
        }
        self.insert_run(new_start, new_len);
    }

    fn insert_run(&mut self, start: u32, len: u32) {
        self.by_start.insert(start, len);
        self.by_len.insert((len, start));
        self.free_units += len;
    }

    fn remove_run(&mut self, start: u32, len: u32) {
        self.by_start.remove(&start);
        self.by_len.remove(&(len, start));
        self.free_units -= len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn high_allocations_gather_at_the_top_and_keep_the_bottom_run_long() {
        let mut a = SlotAllocator::new(100);
        let low = a.alloc(10).unwrap();
        assert_eq!(low, 0);
        assert_eq!(a.alloc_high(20), Some(80));
        assert_eq!(a.alloc_high(30), Some(50));
        // The bottom run (10..50) stays whole for streaming.
        assert_eq!(a.largest_free(), 40);
        a.free(low, 10);
        assert_eq!(a.largest_free(), 50);
        assert_eq!(a.alloc_high(60), None);
        a.free(80, 20);
        a.free(50, 30);
        assert_eq!((a.free_runs(), a.largest_free()), (1, 100));
    }
    use proptest::prelude::*;

    #[test]
    fn best_fit_picks_the_smallest_run_that_fits() {
        let mut a = SlotAllocator::new(100);
        let x = a.alloc(10).unwrap();
        let y = a.alloc(5).unwrap();
        let z = a.alloc(30).unwrap();
        let _w = a.alloc(1).unwrap();
        a.free(x, 10); // run of 10 at 0
        a.free(z, 30); // run of 30 at 15
        assert_eq!(a.alloc(8), Some(0), "the 10-run fits 8 best");
        assert_eq!(a.alloc(12), Some(15), "then the 30-run");
        a.free(y, 5);
        assert_eq!(a.alloc(0), None);
        assert_eq!(a.alloc(1000), None);
    }

    #[test]
    fn neighbours_merge_on_free() {
        let mut a = SlotAllocator::new(9);
        let r: Vec<u32> = (0..3).map(|_| a.alloc(3).unwrap()).collect();
        assert_eq!(a.free_units(), 0);
        a.free(r[0], 3);
        a.free(r[2], 3);
        assert_eq!(a.free_runs(), 2);
        assert_eq!(a.largest_free(), 3);
        a.free(r[1], 3);
        assert_eq!(a.free_runs(), 1);
        assert_eq!(a.largest_free(), 9);
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_is_caught() {
        let mut a = SlotAllocator::new(8);
        let x = a.alloc(2).unwrap();
        let _y = a.alloc(2).unwrap();
        a.free(x, 2);
        a.free(x, 2);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u32),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1u32..40).prop_map(Op::Alloc),
            (0usize..64).prop_map(Op::Free),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// No two live allocations overlap, every allocation lies inside the arena, the
        /// free count is exact, an allocation fails only when no run is long enough, and
        /// freeing everything coalesces back to a single run.
        #[test]
        fn allocations_never_overlap_and_coalesce(units in 1u32..300, ops in proptest::collection::vec(op(), 1..200)) {
            let mut a = SlotAllocator::new(units);
            let mut live: Vec<(u32, u32)> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(len) => {
                        let largest = a.largest_free();
                        match a.alloc(len) {
                            Some(start) => {
                                prop_assert!(start + len <= units);
                                for &(s, l) in &live {
                                    prop_assert!(start + len <= s || s + l <= start, "overlap");
                                }
                                live.push((start, len));
                            }
                            None => prop_assert!(largest < len),
                        }
                    }
                    Op::Free(i) => {
                        if !live.is_empty() {
                            let (s, l) = live.swap_remove(i % live.len());
                            a.free(s, l);
                        }
                    }
                }
                let used: u32 = live.iter().map(|&(_, l)| l).sum();
                prop_assert_eq!(a.free_units() + used, units);
                // Runs never touch: merging is immediate.
                let runs: Vec<(u32, u32)> = a.by_start.iter().map(|(&s, &l)| (s, l)).collect();
                for w in runs.windows(2) {
                    prop_assert!(w[0].0 + w[0].1 < w[1].0);
                }
            }
            for (s, l) in live.drain(..) {
                a.free(s, l);
            }
            prop_assert_eq!(a.free_runs(), 1);
            prop_assert_eq!(a.largest_free(), units);
        }
    }
}
