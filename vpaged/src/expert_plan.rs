//! Replaying a routing trace ([`crate::expert_trace`]) through expert caches of a given
//! size, to score what each policy would read per token before choosing one
//! (`vpagectl expert-plan TRACE`).
//!
//! Every expert a pass reads is an access, in trace order (pass, then layer, then
//! expert). A cache holds whole experts up to its bytes. The policies:
//!
//! - [`Policy::Lru`]: admit every miss, evict the least recently used.
//! - [`Policy::Lfu`]: frequency-aware admission: a miss evicts the least frequently
//!   used resident expert (counted over everything seen so far; ties: the least
//!   recent) only if the newcomer has been used more often; otherwise it is read and
//!   not kept, so that one-off experts do not flush hot ones.
//! - [`Policy::Static`]: no replacement: the experts used most in the fitted part of the
//!   trace, as many as fit, and nothing else (what pinning by counted accesses does).
//! - [`Policy::TinyLfu`]: the page cache's own policy ([`crate::cache::eviction`]:
//!   TinyLFU admission with aging in front of an LFU main region, a window for the
//!   pages not admitted), replayed with every expert evictable once read and room
//!   counted in bytes (no slots, no prefetches): what the page cache would read with
//!   that much room for experts.
//! - [`Policy::Belady`]: the clairvoyant bound: a miss evicts the resident expert used
//!   again furthest in the future, or is not kept when the newcomer is used again
//!   later than all of them. With experts of one size (a model's are) no policy reads
//!   less; with mixed sizes it is the same rule, a bound no longer guaranteed tight.
//!
//! A replay is fitted on the first passes and scored on the rest: the dynamic
//! policies run over the whole trace and count only the scored passes (a warm
//! cache), the static one chooses its experts from the fitted passes' counts.
//!
//! A [`Layout`] is a physical order of each layer's experts in storage: the misses of
//! one layer in one pass that lie in adjacent places are one coalesced read.
//! [`score_layout`] counts the reads a policy's misses need per token under a layout:
//! the checkpoint's order (expert index) against one fitted on the first passes
//! ([`Layout::fitted`]: experts that are picked together placed side by side).

use std::collections::{BTreeSet, HashMap};

use crate::expert_trace::Trace;

/// A cache policy to replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Policy {
    Lru,
    Lfu,
    TinyLfu,
    Static,
    Belady,
}

impl Policy {
    pub const ALL: [Policy; 5] = [
        Policy::Lru,
        Policy::Lfu,
        Policy::TinyLfu,
        Policy::Static,
        Policy::Belady,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Lru => "lru",
            Policy::Lfu => "lfu-admit",
            Policy::TinyLfu => "tinylfu",
            Policy::Static => "static",
            Policy::Belady => "belady",
        }
    }
}

/// What one replay read.
#[derive(Debug, Clone, PartialEq)]
pub struct Score {
    pub policy: Policy,
    pub capacity_bytes: u64,
    /// Accesses and misses in the scored passes.
    pub accesses: u64,
    pub misses: u64,
    /// Bytes the misses read.
    pub bytes_read: u64,
    /// Bytes every scored access would read with no cache.
    pub bytes_routed: u64,
    /// Positions (tokens) of the scored passes.
    pub tokens: u64,
}

impl Score {
    pub fn bytes_per_token(&self) -> f64 {
        self.bytes_read as f64 / self.tokens.max(1) as f64
    }
    pub fn routed_bytes_per_token(&self) -> f64 {
        self.bytes_routed as f64 / self.tokens.max(1) as f64
    }
    pub fn hit_ratio(&self) -> f64 {
        1.0 - self.misses as f64 / self.accesses.max(1) as f64
    }
}

/// One access: the expert (layer slot × experts + expert), its bytes and its pass.
#[derive(Debug, Clone, Copy)]
struct Access {
    key: u64,
    bytes: u64,
    pass: usize,
}

fn accesses(trace: &Trace) -> Vec<Access> {
    let e = u64::from(trace.header.num_experts);
    let mut out = Vec::new();
    for (pass, p) in trace.passes.iter().enumerate() {
        for (l, list) in p.experts.iter().enumerate() {
            for &x in list {
                out.push(Access {
                    key: l as u64 * e + u64::from(x),
                    bytes: trace.header.expert_bytes[l],
                    pass,
                });
            }
        }
    }
    out
}

/// Replays `trace` through a cache of `capacity_bytes` under `policy`, fitted on its
/// first `fit` passes and scored on the rest.
pub fn replay(trace: &Trace, policy: Policy, capacity_bytes: u64, fit: usize) -> Score {
    replay_misses(trace, policy, capacity_bytes, fit).0
}

/// [`replay`], with the scored misses: (pass, layer slot, expert), in trace order.
fn replay_misses(
    trace: &Trace,
    policy: Policy,
    capacity_bytes: u64,
    fit: usize,
) -> (Score, Vec<(usize, usize, u32)>) {
    let acc = accesses(trace);
    let e = u64::from(trace.header.num_experts).max(1);
    let mut missed = Vec::new();
    let mut score = Score {
        policy,
        capacity_bytes,
        accesses: 0,
        misses: 0,
        bytes_read: 0,
        bytes_routed: 0,
        tokens: trace
            .passes
            .iter()
            .skip(fit)
            .map(|p| u64::from(p.positions))
            .sum(),
    };
    let mut count = |a: &Access, hit: bool| {
        if a.pass >= fit {
            score.accesses += 1;
            score.bytes_routed += a.bytes;
            if !hit {
                score.misses += 1;
                score.bytes_read += a.bytes;
                missed.push((a.pass, (a.key / e) as usize, (a.key % e) as u32));
            }
        }
    };
    match policy {
        Policy::Static => {
            let mut uses: HashMap<u64, (u64, u64)> = HashMap::new();
            for a in acc.iter().filter(|a| a.pass < fit) {
                uses.entry(a.key).or_insert((0, a.bytes)).0 += 1;
            }
            let mut order: Vec<(u64, u64, u64)> =
                uses.into_iter().map(|(k, (n, b))| (k, n, b)).collect();
            order.sort_by(|x, y| y.1.cmp(&x.1).then(x.0.cmp(&y.0)));
            let mut kept = std::collections::HashSet::new();
            let mut left = capacity_bytes;
            for (k, _, b) in order {
                if b <= left {
                    left -= b;
                    kept.insert(k);
                }
            }
            for a in &acc {
                count(a, kept.contains(&a.key));
            }
        }
        Policy::TinyLfu => {
            use crate::cache::eviction::{Policy as Cache, Region};
            use crate::cache::PageKey;
            let mut p = Cache::new();
            let mut resident: HashMap<u64, u64> = HashMap::new();
            let mut used = 0u64;
            for a in &acc {
                // The simulation's keys: layer slot × experts + expert (u32 in any
                // trace a model can write: experts and layers are both below 2^16).
                let key = PageKey {
                    model: 0,
                    page: a.key as u32,
                };
                let freq = p.frequency(key);
                p.record_access(key);
                let hit = resident.contains_key(&a.key);
                count(a, hit);
                if hit {
                    p.touch(key, true);
                    continue;
                }
                if a.bytes > capacity_bytes {
                    continue;
                }
                let admitted = p.admits(freq);
                let region = if used + a.bytes <= capacity_bytes {
                    if admitted || p.spare_room(capacity_bytes - used - a.bytes) {
                        Region::Main
                    } else {
                        p.note_window_need(a.bytes);
                        Region::Window
                    }
                } else {
                    while used + a.bytes > capacity_bytes {
                        let victim = p
                            .window_victim()
                            .or_else(|| p.main_victim().map(|(k, _)| k))
                            .or_else(|| p.pending_victim())
                            .expect("a full cache holds an evictable expert");
                        p.remove(victim);
                        used -= resident
                            .remove(&u64::from(victim.page))
                            .expect("victims are resident");
                    }
                    if admitted {
                        Region::Main
                    } else {
                        p.note_window_need(a.bytes);
                        Region::Window
                    }
                };
                p.insert(key, a.bytes, region, true);
                p.set_evictable(key, true);
                resident.insert(a.key, a.bytes);
                used += a.bytes;
            }
        }
        Policy::Lru | Policy::Lfu | Policy::Belady => {
            let next = next_uses(&acc);
            let mut cache = Cache::new(capacity_bytes);
            let mut freq: HashMap<u64, u64> = HashMap::new();
            for (i, a) in acc.iter().enumerate() {
                *freq.entry(a.key).or_default() += 1;
                let hit = cache.touch(a.key, i, next[i]);
                count(a, hit);
                if hit || a.bytes > capacity_bytes {
                    continue;
                }
                // Make room, or decide not to keep it.
                loop {
                    if cache.used + a.bytes <= capacity_bytes {
                        cache.insert(a.key, a.bytes, i, next[i]);
                        break;
                    }
                    let victim = match policy {
                        Policy::Lru => cache.least_recent(),
                        Policy::Lfu => {
                            let v = cache.least_frequent(&freq);
                            (freq[&v] < freq[&a.key]).then_some(v)
                        }
                        _ => {
                            let (v, v_next) = cache.furthest();
                            (v_next > next[i]).then_some(v)
                        }
                    };
                    match victim {
                        Some(v) => cache.remove(v),
                        None => break,
                    }
                }
            }
        }
    }
    (score, missed)
}

/// A physical order of each routing layer's experts: `order[l][i]` is the expert in
/// place `i` of layer slot `l`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub order: Vec<Vec<u32>>,
}

impl Layout {
    /// The checkpoint's order: expert `i` in place `i`.
    pub fn checkpoint(trace: &Trace) -> Layout {
        let n = trace.header.num_experts;
        Layout {
            order: vec![(0..n).collect(); trace.header.layers.len()],
        }
    }

    /// An order fitted on the first `fit` passes: per layer, a chain that starts at
    /// the expert picked most and goes on to the unplaced expert picked together
    /// with the last placed most often (ties: picked more, then the lower index);
    /// experts never picked follow in index order.
    pub fn fitted(trace: &Trace, fit: usize) -> Layout {
        let n = trace.header.num_experts as usize;
        let order = (0..trace.header.layers.len())
            .map(|l| {
                let mut uses = vec![0u64; n];
                let mut together: HashMap<(u32, u32), u64> = HashMap::new();
                for p in trace.passes.iter().take(fit) {
                    let list = &p.experts[l];
                    for (i, &a) in list.iter().enumerate() {
                        uses[a as usize] += 1;
                        for &b in &list[i + 1..] {
                            *together.entry((a, b)).or_default() += 1;
                            *together.entry((b, a)).or_default() += 1;
                        }
                    }
                }
                let mut placed = vec![false; n];
                let mut chain: Vec<u32> = Vec::with_capacity(n);
                let best = |placed: &[bool], key: &dyn Fn(u32) -> (u64, u64)| {
                    (0..n as u32)
                        .filter(|&x| !placed[x as usize])
                        .max_by(|&x, &y| key(x).cmp(&key(y)).then(y.cmp(&x)))
                };
                while let Some(next) = match chain.last() {
                    None => best(&placed, &|x| (uses[x as usize], 0)),
                    Some(&last) => best(&placed, &|x| {
                        (
                            together.get(&(last, x)).copied().unwrap_or(0),
                            uses[x as usize],
                        )
                    }),
                }
                .filter(|&x| uses[x as usize] > 0)
                {
                    placed[next as usize] = true;
                    chain.push(next);
                }
                chain.extend((0..n as u32).filter(|&x| !placed[x as usize]));
                chain
            })
            .collect();
        Layout { order }
    }
}

/// The reads a replay's misses need under a layout.
#[derive(Debug, Clone, PartialEq)]
pub struct LayoutScore {
    pub policy: Policy,
    pub capacity_bytes: u64,
    /// Coalesced reads: runs of adjacent places missed in one layer of one pass.
    pub reads: u64,
    pub bytes_read: u64,
    pub tokens: u64,
}

impl LayoutScore {
    pub fn reads_per_token(&self) -> f64 {
        self.reads as f64 / self.tokens.max(1) as f64
    }
    pub fn bytes_per_token(&self) -> f64 {
        self.bytes_read as f64 / self.tokens.max(1) as f64
    }
    /// Mean bytes of one coalesced read.
    pub fn bytes_per_read(&self) -> f64 {
        self.bytes_read as f64 / self.reads.max(1) as f64
    }
}

/// Replays `trace` as [`replay`] does and counts the reads its misses need when each
/// run of adjacent places of `layout` missed in one layer of one pass is read at once.
pub fn score_layout(
    trace: &Trace,
    policy: Policy,
    capacity_bytes: u64,
    fit: usize,
    layout: &Layout,
) -> LayoutScore {
    let (score, missed) = replay_misses(trace, policy, capacity_bytes, fit);
    let place: Vec<Vec<usize>> = layout
        .order
        .iter()
        .map(|o| {
            let mut at = vec![0usize; o.len()];
            for (i, &x) in o.iter().enumerate() {
                at[x as usize] = i;
            }
            at
        })
        .collect();
    let mut groups: HashMap<(usize, usize), Vec<usize>> = HashMap::new();
    for (pass, l, x) in missed {
        groups
            .entry((pass, l))
            .or_default()
            .push(place[l][x as usize]);
    }
    let mut reads = 0u64;
    for places in groups.values_mut() {
        places.sort_unstable();
        reads += 1 + places.windows(2).filter(|w| w[1] != w[0] + 1).count() as u64;
    }
    LayoutScore {
        policy,
        capacity_bytes,
        reads,
        bytes_read: score.bytes_read,
        tokens: score.tokens,
    }
}

/// For each access, the index of the same expert's next access (`usize::MAX`: none).
fn next_uses(acc: &[Access]) -> Vec<usize> {
    let mut next = vec![usize::MAX; acc.len()];
    let mut seen: HashMap<u64, usize> = HashMap::new();
    for i in (0..acc.len()).rev() {
        if let Some(&j) = seen.get(&acc[i].key) {
            next[i] = j;
        }
        seen.insert(acc[i].key, i);
    }
    next
}

/// The resident experts: bytes, last use and next use of each.
struct Cache {
    capacity: u64,
    used: u64,
    /// key -> (bytes, last use, next use)
    entries: HashMap<u64, (u64, usize, usize)>,
    /// (last use, key), for the least recent.
    by_last: BTreeSet<(usize, u64)>,
    /// (next use, key), for the furthest.
    by_next: BTreeSet<(usize, u64)>,
}

impl Cache {
    fn new(capacity: u64) -> Self {
        Cache {
            capacity,
            used: 0,
            entries: HashMap::new(),
            by_last: BTreeSet::new(),
            by_next: BTreeSet::new(),
        }
    }

    /// A use of `key` at `now`, next used at `next`: whether it was resident.
    fn touch(&mut self, key: u64, now: usize, next: usize) -> bool {
        let Some(e) = self.entries.get_mut(&key) else {
            return false;
        };
        self.by_last.remove(&(e.1, key));
        self.by_next.remove(&(e.2, key));
        e.1 = now;
        e.2 = next;
        self.by_last.insert((now, key));
        self.by_next.insert((next, key));
        true
    }

    fn insert(&mut self, key: u64, bytes: u64, now: usize, next: usize) {
        debug_assert!(self.used + bytes <= self.capacity);
        self.entries.insert(key, (bytes, now, next));
        self.by_last.insert((now, key));
        self.by_next.insert((next, key));
        self.used += bytes;
    }

    fn remove(&mut self, key: u64) {
        if let Some((bytes, last, next)) = self.entries.remove(&key) {
            self.by_last.remove(&(last, key));
            self.by_next.remove(&(next, key));
            self.used -= bytes;
        }
    }

    fn least_recent(&self) -> Option<u64> {
        self.by_last.first().map(|&(_, k)| k)
    }

    /// The least frequently used resident (ties: the least recent); the cache is not
    /// empty when asked.
    fn least_frequent(&self, freq: &HashMap<u64, u64>) -> u64 {
        self.by_last
            .iter()
            .min_by_key(|&&(last, k)| (freq.get(&k).copied().unwrap_or(0), last))
            .map(|&(_, k)| k)
            .expect("a full cache holds something")
    }

    /// The resident used again furthest ahead, and when; the cache is not empty.
    fn furthest(&self) -> (u64, usize) {
        self.by_next
            .last()
            .map(|&(n, k)| (k, n))
            .expect("a full cache holds something")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::expert_trace::{TraceHeader, TracePass, TRACE_VERSION};

    /// A one-layer trace of passes of one position, each reading one expert.
    fn trace_of(keys: &[u32], experts: u32) -> Trace {
        Trace {
            header: TraceHeader {
                voom_expert_trace: TRACE_VERSION,
                model: "t".into(),
                num_experts: experts,
                top_k: 1,
                layers: vec![0],
                expert_bytes: vec![10],
            },
            passes: keys
                .iter()
                .map(|&k| TracePass {
                    positions: 1,
                    experts: vec![vec![k]],
                })
                .collect(),
        }
    }

    /// The fewest misses any policy can have on `keys` with room for `c` experts
    /// (each miss may keep the expert, replacing any, or not): exhaustive search.
    fn optimum(keys: &[u32], c: usize) -> u64 {
        let mut states: HashMap<Vec<u32>, u64> = HashMap::from([(Vec::new(), 0)]);
        for &k in keys {
            let mut next: HashMap<Vec<u32>, u64> = HashMap::new();
            let mut put = |s: Vec<u32>, m: u64| {
                let e = next.entry(s).or_insert(u64::MAX);
                *e = (*e).min(m);
            };
            for (s, m) in states {
                if s.contains(&k) {
                    put(s, m);
                    continue;
                }
                put(s.clone(), m + 1);
                if s.len() < c {
                    let mut t = s.clone();
                    t.push(k);
                    t.sort_unstable();
                    put(t, m + 1);
                } else {
                    for i in 0..s.len() {
                        let mut t = s.clone();
                        t[i] = k;
                        t.sort_unstable();
                        put(t, m + 1);
                    }
                }
            }
            states = next;
        }
        states.into_values().min().unwrap()
    }

    #[test]
    fn belady_reaches_the_optimum_and_no_policy_beats_it() {
        // A cyclic trace over four experts with room for two: LRU misses every time.
        let cyclic: Vec<u32> = (0..24).map(|i| i % 4).collect();
        let t = trace_of(&cyclic, 4);
        let best = optimum(&cyclic, 2);
        assert_eq!(replay(&t, Policy::Belady, 20, 0).misses, best);
        assert_eq!(replay(&t, Policy::Lru, 20, 0).misses, 24);
        // Pseudo-random traces of six experts, room for 1 to 3.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for round in 0..40 {
            let keys: Vec<u32> = (0..14)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // Skewed: low experts more often.
                    ((x % 36) as f64).sqrt() as u32
                })
                .collect();
            let t = trace_of(&keys, 6);
            for c in 1..=3u64 {
                let best = optimum(&keys, c as usize);
                let belady = replay(&t, Policy::Belady, 10 * c, 0);
                assert_eq!(belady.misses, best, "round {round}, room {c}: {keys:?}");
                for p in Policy::ALL {
                    let s = replay(&t, p, 10 * c, 0);
                    assert!(
                        s.misses >= best,
                        "{} beat the optimum on {keys:?}",
                        p.name()
                    );
                    assert_eq!(s.accesses, keys.len() as u64);
                    assert_eq!(s.bytes_read, 10 * s.misses);
                }
            }
        }
    }

    #[test]
    fn lfu_admission_keeps_hot_experts_through_one_off_ones() {
        // Experts 0 and 1 are hot; a scan of one-off experts passes between uses.
        let mut keys = Vec::new();
        for i in 0..10u32 {
            keys.extend([0, 1, 2 + i]);
        }
        let t = trace_of(&keys, 12);
        let lru = replay(&t, Policy::Lru, 20, 0);
        let lfu = replay(&t, Policy::Lfu, 20, 0);
        // LRU with room for two: the one-off evicts a hot one each round.
        assert!(lru.misses > 20, "{lru:?}");
        // LFU keeps both hot experts after their first reads: only the scan misses.
        assert_eq!(lfu.misses, 2 + 10, "{lfu:?}");
        // So does the page cache's own policy, with room for three (the one-offs
        // stream through its window).
        let tiny = replay(&t, Policy::TinyLfu, 30, 0);
        assert_eq!(tiny.misses, 2 + 10, "{tiny:?}");
    }

    #[test]
    fn a_replay_is_fitted_on_the_first_passes_and_scored_on_the_rest() {
        let keys = [0u32, 0, 1, 0, 2, 0, 1];
        let t = trace_of(&keys, 3);
        // Static with room for one: the fitted part (first 4) used 0 most.
        let s = replay(&t, Policy::Static, 10, 4);
        assert_eq!((s.accesses, s.misses, s.tokens), (3, 2, 3));
        assert_eq!(s.bytes_per_token(), 20.0 / 3.0);
        assert_eq!(s.routed_bytes_per_token(), 10.0);
        // LRU warmed on the first four: 0 is resident at pass 5 (room for one: no).
        let s = replay(&t, Policy::Lru, 10, 4);
        assert_eq!(s.misses, 3);
        let s = replay(&t, Policy::Lru, 20, 4);
        assert_eq!(s.misses, 2, "0 stays with room for two");
        // No room: every scored access misses.
        assert_eq!(replay(&t, Policy::Belady, 0, 4).misses, 3);
    }

    /// Experts always picked in pairs that the checkpoint keeps apart (0 with 4, 1
    /// with 5, ...): in its order each pair is two reads, in the fitted order one, and
    /// the bytes are the same.
    #[test]
    fn a_fitted_layout_puts_experts_picked_together_side_by_side() {
        let pairs = [[0u32, 4], [1, 5], [2, 6], [3, 7]];
        let keys: Vec<u32> = (0..40).flat_map(|i| pairs[i % 4]).collect();
        let mut t = trace_of(&[], 8);
        t.header.top_k = 2;
        t.passes = keys
            .chunks(2)
            .map(|c| TracePass {
                positions: 1,
                experts: vec![c.to_vec()],
            })
            .collect();
        let fitted = Layout::fitted(&t, 20);
        let order = &fitted.order[0];
        for p in pairs {
            let (a, b) = (
                order.iter().position(|&x| x == p[0]).unwrap(),
                order.iter().position(|&x| x == p[1]).unwrap(),
            );
            assert_eq!(a.abs_diff(b), 1, "{p:?} in {order:?}");
        }
        let plain = score_layout(&t, Policy::Lru, 0, 20, &Layout::checkpoint(&t));
        let better = score_layout(&t, Policy::Lru, 0, 20, &fitted);
        assert_eq!((plain.reads, better.reads), (40, 20));
        assert_eq!(plain.bytes_read, better.bytes_read);
        assert_eq!(better.reads_per_token(), 1.0);
    }
}
