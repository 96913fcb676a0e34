//! Prompt-prefix reuse in memory: the KV caches of prompts (and conversations)
//! already computed, keyed by their token ids, so that a request whose prompt
//! repeats or extends one of them computes only the positions after the longest
//! one it shares.
//!
//! Exact: a position's keys and values do not depend on the positions after it nor
//! on how the positions before it were chunked (batch invariance), so a cache cut
//! to a shared prefix holds the very bits a cold run computes there, and the
//! positions computed after it are a cold run's too.
//!
//! Entries share their closed KV pages with each other and with the sequences that
//! took them (`Arc`; a cut copies only the page it falls in), so a cache entry that
//! extends another costs its new pages. The budget counts each page once; the least
//! recently used entries go first when it is exceeded.

use std::collections::HashSet;

use crate::kv::KvCache;

/// Positions a cached prefix must have to be kept (a shorter one saves little).
pub const MIN_PREFIX: usize = 16;

/// One prefix: its ids and the cache holding exactly their positions.
struct Entry {
    ids: Vec<u32>,
    kv: KvCache,
    used: u64,
}

/// The prefixes held, under a byte budget.
pub struct PrefixCache {
    budget: usize,
    entries: Vec<Entry>,
    clock: u64,
    /// Positions served from the cache since it was made.
    reused: u64,
}

impl PrefixCache {
    /// An empty cache of at most `budget` bytes of KV (0: it keeps nothing).
    pub fn new(budget: usize) -> Self {
        PrefixCache {
            budget,
            entries: Vec::new(),
            clock: 0,
            reused: 0,
        }
    }

    /// Positions served from reused prefixes so far (from this cache or from disk),
    /// as the engine counted them.
    pub fn reused_positions(&self) -> u64 {
        self.reused
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of KV the entries hold, each page counted once.
    pub fn bytes(&self) -> usize {
        let mut seen = HashSet::new();
        self.entries
            .iter()
            .map(|e| e.kv.bytes_not_in(&mut seen))
            .sum()
    }

    /// A cache holding the longest prefix of `prompt` held here, cut to at most
    /// `prompt.len() - 1` positions (the last prompt position is computed, for its
    /// logits), sharing the entry's pages; `None` when none shares
    /// [`MIN_PREFIX`] positions with it.
    pub fn take(&mut self, prompt: &[u32]) -> Option<KvCache> {
        let limit = prompt.len().saturating_sub(1);
        let (best, len) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let n = e.ids.iter().zip(prompt).take_while(|(a, b)| a == b).count();
                (i, n.min(limit))
            })
            .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)))?;
        if len < MIN_PREFIX {
            return None;
        }
        self.clock += 1;
        let e = &mut self.entries[best];
        e.used = self.clock;
        let mut kv = e.kv.clone();
        kv.truncate(len);
        if kv.lost().is_some() {
            // Cut behind a sliding window's dropped pages: nothing to reuse.
            return None;
        }
        Some(kv)
    }

    /// Counts `n` prompt positions served from a reused prefix (the caller's
    /// choice among this cache and the snapshots on disk).
    pub fn count_reused(&mut self, n: usize) {
        self.reused += n as u64;
    }

    /// Keeps the first `ids.len()` positions of `kv` as the KV of `ids` (at least
    /// [`MIN_PREFIX`] of them; `kv` holds at least that many), replacing any
    /// entry it extends or repeats, then evicts the least recently used entries
    /// past the budget (this one last).
    pub fn insert(&mut self, ids: &[u32], kv: &KvCache) {
        let n = ids.len().min(kv.len());
        if n < MIN_PREFIX || self.budget == 0 {
            return;
        }
        let ids = &ids[..n];
        // An entry this one extends (or repeats) is no longer needed, and one that
        // extends this one holds it already: unless the caches carry recurrent
        // states (a hybrid's), which are cut back only to where a pass started, so
        // that the longer entry cannot stand for the shorter.
        let cuts = !kv.has_states();
        self.entries.retain(|e| {
            !(e.ids.len() <= n && ids.starts_with(&e.ids) && (cuts || e.ids.len() == n))
        });
        if self
            .entries
            .iter()
            .any(|e| e.ids.starts_with(ids) && (cuts || e.ids.len() == n))
        {
            return;
        }
        let mut kv = kv.clone();
        kv.truncate(n);
        if kv.lost().is_some() {
            return;
        }
        self.clock += 1;
        self.entries.push(Entry {
            ids: ids.to_vec(),
            kv,
            used: self.clock,
        });
        self.evict();
    }

    /// The byte budget.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Changes the budget, evicting the least recently used entries past it (the
    /// memory governor).
    pub fn set_budget(&mut self, budget: usize) {
        self.budget = budget;
        self.evict();
    }

    /// Evicts the least recently used entries until the entries fit the budget.
    fn evict(&mut self) {
        while self.bytes() > self.budget && !self.entries.is_empty() {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i)
                .expect("not empty");
            self.entries.remove(oldest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache of `ids` whose position `j` holds the value `ids[j]` in every float.
    fn kv_of(ids: &[u32], page: usize) -> KvCache {
        let mut kv = KvCache::with_page(2, 2, 1000, page);
        let x: Vec<f32> = ids.iter().flat_map(|&i| [i as f32; 2]).collect();
        for l in 0..2 {
            kv.append(l, &x, &x).unwrap();
        }
        kv.commit(ids);
        kv
    }

    fn values(kv: &KvCache) -> Vec<u32> {
        let v = kv.layer(1).unwrap();
        (0..v.len)
            .map(|j| v.v[j / v.page][(j % v.page) * v.width] as u32)
            .collect()
    }

    #[test]
    fn the_longest_shared_prefix_comes_back_and_keeps_one_position_to_compute() {
        let mut c = PrefixCache::new(1 << 20);
        let a: Vec<u32> = (0..40).collect();
        c.insert(&a, &kv_of(&a, 8));
        // A repeat: all but the last position.
        let kv = c.take(&a).unwrap();
        assert_eq!(values(&kv), (0..39).collect::<Vec<_>>());
        // An extension: all of `a`.
        let mut b = a.clone();
        b.extend([100, 101]);
        assert_eq!(c.take(&b).unwrap().len(), 40);
        // A divergence after 20: those 20.
        let mut d: Vec<u32> = (0..20).collect();
        d.extend([7; 10]);
        assert_eq!(values(&c.take(&d).unwrap()), (0..20).collect::<Vec<_>>());
        // Too short a match.
        assert!(c.take(&[0, 1, 2, 9, 9]).is_none());
        // The engine counts what it used.
        assert_eq!(c.reused_positions(), 0);
        c.count_reused(39);
        assert_eq!(c.reused_positions(), 39);
    }

    #[test]
    fn an_extension_replaces_its_prefix_and_shares_its_pages() {
        let mut c = PrefixCache::new(1 << 20);
        let a: Vec<u32> = (0..40).collect();
        let kva = kv_of(&a, 8);
        c.insert(&a, &kva);
        let one = c.bytes();
        let mut b = a.clone();
        b.extend(40..48);
        // The extension computed on a cache taken from the first.
        let mut kvb = c.take(&b).unwrap();
        assert_eq!(kvb.len(), 40);
        let x: Vec<f32> = (40..48).flat_map(|i| [i as f32; 2]).collect();
        for l in 0..2 {
            kvb.append(l, &x, &x).unwrap();
        }
        kvb.commit(&[0; 8]);
        c.insert(&b, &kvb);
        assert_eq!(c.len(), 1);
        // Only the new positions' bytes were added (the 40 shared).
        assert_eq!(c.bytes(), one + 8 * 2 * 2 * 2 * 4);
        // A prefix of a held entry adds nothing.
        c.insert(&a[..30], &kva);
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn past_the_budget_the_least_recently_used_go_first() {
        let one = kv_of(&(0..32).collect::<Vec<_>>(), 8).bytes();
        let mut c = PrefixCache::new(2 * one);
        let p = |k: u32| -> Vec<u32> { (0..32).map(|i| i + 1000 * k).collect() };
        for k in 0..2 {
            c.insert(&p(k), &kv_of(&p(k), 8));
        }
        assert!(c.take(&p(0)).is_some());
        c.insert(&p(2), &kv_of(&p(2), 8));
        assert_eq!(c.len(), 2);
        assert!(c.take(&p(1)).is_none(), "the least recently used went");
        assert!(c.take(&p(0)).is_some() && c.take(&p(2)).is_some());
        assert!(c.bytes() <= 2 * one);
        let mut none = PrefixCache::new(0);
        none.insert(&p(0), &kv_of(&p(0), 8));
        assert!(none.is_empty());
    }
}
