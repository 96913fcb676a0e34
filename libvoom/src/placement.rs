//! The memory planner: one byte budget becomes a placement of a model's pages.
//!
//! A budget is a ceiling for the whole process: pinned pages, the streaming window
//! that unpinned pages pass through, the KV cache, compute scratch and the process
//! itself. The planner first sets aside what the run needs besides weights
//! ([`Needs`]), then:
//!
//! 1. If every page fits, every page is pinned: nothing streams.
//! 2. Otherwise the window gets room for the largest layer and three more of the
//!    largest page a layer has, and for one position's routed experts (`top_k` of the
//!    largest), read beside them once a router picks them
//!    (`vpaged::store::streaming_window_bytes`, which the
//!    store keeps out of planner pins): a decode step leases one matrix at a time and
//!    reads a layer's worth ahead of it; a pass of several chunks leases a layer
//!    whole (it is read once per pass) and reads a page ahead; and two pages of
//!    margin keep the page cache's placement of each page in one run of slots from
//!    finding no run (see `libvoom::model::sweep`), or all there is when that is less,
//!    but never less than the largest step a pass leases at once (one matrix and
//!    the vectors beside it, or a head stage): below that the model cannot run, and
//!    the budget is refused with [`PlacementError::BelowMinimum`] saying how much it
//!    needs.
//! 3. What is left pins pages (routed experts excepted: the page cache keeps those
//!    its frequency-aware admission picks, in the room pins leave, so no page that
//!    saves less per byte than an expert would is pinned either), in order of the
//!    bytes each saves per token for each
//!    byte it holds: a layer's matrices and the LM head are read whole every token
//!    (a ratio of 1), an embedding table one row per token (it is nearly free to
//!    leave on disk). A page that does not fit is skipped for smaller ones after it.
//!
//! Every page is counted at its slot size (a multiple of [`SLOT_ALIGN`]), as the
//! page cache and the direct-read buffers hold it.

use std::collections::BTreeMap;

use vpaged::PageId;

use crate::model::plan::PagePlan;
pub use crate::model::plan::{slot_bytes, SLOT_ALIGN};

/// What a run needs besides weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Needs {
    /// The KV cache at the planned context.
    pub kv_bytes: u64,
    /// Activations and buffers of the largest forward pass.
    pub scratch_bytes: u64,
    /// The process itself: code, tokenizer, heap before weights.
    pub process_bytes: u64,
    /// The page store's read buffers: readers' bounce buffers and vpack bodies being
    /// decoded ([`vpaged::store::IoConfig::buffer_bytes`]).
    pub io_bytes: u64,
}

impl Needs {
    pub fn total(&self) -> u64 {
        self.kv_bytes + self.scratch_bytes + self.process_bytes + self.io_bytes
    }
}

/// Where a model's pages live under a budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub budget: u64,
    pub needs: Needs,
    /// Pages kept resident once read, sorted.
    pub pinned: Vec<PageId>,
    /// Their slot bytes.
    pub pinned_bytes: u64,
    /// Bytes of the window unpinned pages stream through (0 when all are pinned).
    pub window_bytes: u64,
    /// The least window the model runs with (its largest step).
    pub min_window_bytes: u64,
    /// Bytes one decode token reads from storage (unpinned pages).
    pub streamed_per_token: u64,
    /// Bytes one decode token reads from pinned memory.
    pub pinned_per_token: u64,
    /// Room left beside the pins and the window, where a page cache keeps the routed
    /// experts its frequency-aware admission picks (a mixture of experts' experts are
    /// never pinned: which are hot is seen only as tokens route); 0 without experts.
    pub expert_cache_bytes: u64,
}

impl Placement {
    /// Everything the placement holds at once: never more than the budget.
    pub fn total(&self) -> u64 {
        self.pinned_bytes + self.window_bytes + self.needs.total()
    }

    pub fn is_pinned(&self, id: PageId) -> bool {
        self.pinned.binary_search(&id).is_ok()
    }

    /// The least budget that runs the model with these needs.
    pub fn minimum_budget(&self) -> u64 {
        self.min_window_bytes + self.needs.total()
    }
}

/// A budget the planner cannot use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error(
        "a memory budget of {} cannot run this model: it needs at least {} ({} of \
         streaming window for its largest step, {} of KV cache, {} of compute scratch, \
         {} for the process, {} of read buffers)",
        human(*budget), human(*minimum), human(*window), human(*kv), human(*scratch),
        human(*process), human(*io)
    )]
    BelowMinimum {
        budget: u64,
        minimum: u64,
        window: u64,
        kv: u64,
        scratch: u64,
        process: u64,
        io: u64,
    },
}

/// `n` bytes for people: `1.50 GiB`, `12.0 MiB`, `512 B`.
pub fn human(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    match u {
        0 => format!("{n} B"),
        _ if v < 10.0 => format!("{v:.2} {}", UNITS[u]),
        _ => format!("{v:.1} {}", UNITS[u]),
    }
}

/// One page as the planner weighs it.
#[derive(Debug, Clone, Copy)]
struct Weighed {
    page: PageId,
    /// Its bytes, and what it holds resident.
    bytes: u64,
    slot: u64,
    per_token: u64,
}

/// Each distinct page of `plan` once: its bytes, its slot and the bytes every stage
/// reading it reads per token.
fn weigh(plan: &PagePlan) -> BTreeMap<PageId, Weighed> {
    let mut pages: BTreeMap<PageId, Weighed> = BTreeMap::new();
    for stage in plan.stages() {
        for r in stage.reads() {
            let w = pages.entry(r.page).or_insert(Weighed {
                page: r.page,
                bytes: r.bytes,
                slot: slot_bytes(r.bytes),
                per_token: 0,
            });
            w.per_token += r.per_token;
        }
    }
    pages
}

/// Sorts pages by the bytes each saves per token for each byte `held` says it holds,
/// highest first (compared exactly, as `per_token_a * held_b` against
/// `per_token_b * held_a`); then by the most saved; then by page, so equal plans
/// give equal placements.
fn by_value(order: &mut [Weighed], held: impl Fn(&Weighed) -> u64) {
    order.sort_by(|a, b| {
        let (x, y) = (
            a.per_token as u128 * held(b) as u128,
            b.per_token as u128 * held(a) as u128,
        );
        y.cmp(&x)
            .then(b.per_token.cmp(&a.per_token))
            .then(a.page.cmp(&b.page))
    });
}

/// The candidates for a fast tier's static set beside `placement`: the pages that
/// stream (not pinned, read every token), most valuable first, by the bytes each
/// saves per token for each byte of copy. A tier keeps them in this order as far
/// as its room goes, skipping one that does not fit for smaller ones after it
/// ([`PageSource::keep_on_fast_tier`](vpaged::PageSource::keep_on_fast_tier)).
pub fn fast_tier_order(plan: &PagePlan, placement: &Placement) -> Vec<PageId> {
    let mut order: Vec<Weighed> = weigh(plan)
        .into_values()
        .filter(|w| w.per_token > 0 && !placement.is_pinned(w.page))
        .collect();
    by_value(&mut order, |w| w.bytes);
    order.into_iter().map(|w| w.page).collect()
}

/// The static set a fast tier of `room` bytes keeps beside `placement`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FastTierSet {
    /// Its pages, most valuable first.
    pub pages: Vec<PageId>,
    /// Bytes of their copies.
    pub bytes: u64,
    /// Bytes per token read from the fast tier instead of the slow one.
    pub per_token: u64,
}

/// The pages a fast tier of `room` bytes keeps of `plan` beside `placement`, as the
/// store chooses them (`vpaged::store::Store::keep_on_fast_tier`): the candidates of
/// [`fast_tier_order`] in order, each whose bytes fit what is left, skipping one that
/// does not for smaller ones after it.
pub fn fast_tier_set(plan: &PagePlan, placement: &Placement, room: u64) -> FastTierSet {
    let pages = weigh(plan);
    let mut set = FastTierSet::default();
    let mut left = room;
    for id in fast_tier_order(plan, placement) {
        let w = &pages[&id];
        if w.bytes > left {
            continue;
        }
        left -= w.bytes;
        set.pages.push(id);
        set.bytes += w.bytes;
        set.per_token += w.per_token;
    }
    set
}

/// Places `plan`'s pages under `budget` bytes, with `needs` set aside first.
pub fn place(plan: &PagePlan, needs: &Needs, budget: u64) -> Result<Placement, PlacementError> {
    let pages = weigh(plan);
    let min_window = plan.largest_step_slot_bytes();
    let refuse = || PlacementError::BelowMinimum {
        budget,
        minimum: min_window + needs.total(),
        window: min_window,
        kv: needs.kv_bytes,
        scratch: needs.scratch_bytes,
        process: needs.process_bytes,
        io: needs.io_bytes,
    };
    let avail = budget.checked_sub(needs.total()).ok_or_else(refuse)?;
    if avail < min_window {
        return Err(refuse());
    }
    let all: u64 = pages.values().map(|w| w.slot).sum();
    let total_per_token: u64 = pages.values().map(|w| w.per_token).sum();
    if all <= avail {
        return Ok(Placement {
            budget,
            needs: *needs,
            pinned: pages.keys().copied().collect(),
            pinned_bytes: all,
            window_bytes: 0,
            min_window_bytes: min_window,
            streamed_per_token: 0,
            pinned_per_token: total_per_token,
            expert_cache_bytes: 0,
        });
    }
    let largest_layer = plan
        .layers
        .iter()
        .map(|s| s.ids().iter().map(|id| pages[id].slot).sum::<u64>())
        .max()
        .unwrap_or(0);
    let largest_page = plan
        .layers
        .iter()
        .flat_map(|s| s.ids().iter().map(|id| pages[id].slot))
        .max()
        .unwrap_or(0);
    // And one position's routed experts beside them (vpaged's window counts the
    // same).
    let window = (largest_layer + 3 * largest_page + plan.largest_expert_batch_slot_bytes())
        .max(min_window)
        .min(avail);
    let mut room = avail - window;
    // Routed experts are left to the cache's admission, in the room pins leave.
    let experts: std::collections::BTreeSet<PageId> = plan
        .layers
        .iter()
        .flat_map(|l| l.experts().iter().flatten().copied())
        .collect();
    let mut order: Vec<Weighed> = pages
        .values()
        .filter(|w| !experts.contains(&w.page))
        .copied()
        .collect();
    by_value(&mut order, |w| w.slot);
    // Nor is a page pinned that saves fewer bytes per token for each byte it holds
    // than a routed expert kept in that room would (an embedding table's part, read
    // by a share of the tokens, against top_k of the experts): the room goes to the
    // experts instead.
    let expert_value = experts.iter().map(|id| pages[id]).max_by(|a, b| {
        (a.per_token as u128 * b.slot as u128).cmp(&(b.per_token as u128 * a.slot as u128))
    });
    let mut pinned = Vec::new();
    let (mut pinned_bytes, mut pinned_per_token) = (0u64, 0u64);
    for w in order {
        if w.per_token == 0 || w.slot > room {
            continue;
        }
        if expert_value.is_some_and(|x| {
            (w.per_token as u128 * x.slot as u128) < (x.per_token as u128 * w.slot as u128)
        }) {
            continue;
        }
        room -= w.slot;
        pinned_bytes += w.slot;
        pinned_per_token += w.per_token;
        pinned.push(w.page);
    }
    pinned.sort_unstable();
    Ok(Placement {
        budget,
        needs: *needs,
        pinned,
        pinned_bytes,
        window_bytes: window,
        min_window_bytes: min_window,
        streamed_per_token: total_per_token - pinned_per_token,
        pinned_per_token,
        expert_cache_bytes: if experts.is_empty() { 0 } else { room },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::plan::{PlannedRead, Stage};
    use proptest::prelude::*;

    /// A plan of `layers` layers of `steps` pages each, an embedding read a row per
    /// token, and a head, with the sizes given.
    fn plan_of(embed: u64, row: u64, layer_pages: &[Vec<u64>], head: u64) -> PagePlan {
        let mut next = 0u32;
        let mut page = |bytes: u64, per_token: u64| {
            next += 1;
            PlannedRead {
                page: PageId(next),
                bytes,
                per_token,
                per_token_whole: bytes,
            }
        };
        let e = page(embed, row.min(embed));
        let layers = layer_pages
            .iter()
            .map(|l| {
                let reads: Vec<PlannedRead> = l.iter().map(|&b| page(b, b)).collect();
                let steps = reads.iter().map(|r| vec![r.page]).collect();
                Stage::from_reads(reads, steps)
            })
            .collect();
        let h = page(head, head);
        PagePlan {
            head: Stage::from_reads(vec![e], vec![vec![e.page]]),
            layers,
            tail: Stage::from_reads(vec![h], vec![vec![h.page]]),
        }
    }

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_budget_below_the_largest_step_is_refused_naming_the_minimum() {
        let plan = plan_of(8 * MIB, 1024, &vec![vec![3 * MIB, 5 * MIB]; 4], 2 * MIB);
        let needs = Needs {
            kv_bytes: MIB,
            scratch_bytes: MIB,
            process_bytes: 8 * MIB,
            io_bytes: 2 * MIB,
        };
        // The largest step is the embedding (8 MiB): 8 + 12 needed.
        let e = place(&plan, &needs, 20 * MIB - 1).unwrap_err();
        let PlacementError::BelowMinimum {
            minimum, window, ..
        } = e.clone();
        assert_eq!((minimum, window), (20 * MIB, 8 * MIB));
        assert!(e.to_string().contains("at least 20.0 MiB"), "{e}");
        assert!(e.to_string().contains("2.00 MiB of read buffers"), "{e}");
        let p = place(&plan, &needs, 20 * MIB).unwrap();
        assert_eq!(p.window_bytes, 8 * MIB);
        assert!(p.pinned.is_empty());
        assert_eq!(p.streamed_per_token, plan.weight_bytes_per_token());
        assert!(place(&plan, &needs, 5 * MIB).is_err());
    }

    /// The window holds the largest layer and three more of the largest page a
    /// layer has (`vpaged::store::streaming_window_bytes`); the rest pins.
    #[test]
    fn the_window_is_a_layer_and_three_of_the_largest_page() {
        let plan = plan_of(MIB, 4096, &vec![vec![2 * MIB, 6 * MIB, MIB]; 10], 4 * MIB);
        let p = place(&plan, &Needs::default(), 60 * MIB).unwrap();
        assert_eq!(p.window_bytes, 9 * MIB + 3 * 6 * MIB);
        assert!(p.pinned_bytes <= 60 * MIB - p.window_bytes);
        assert!(p.pinned_bytes > 60 * MIB - p.window_bytes - 6 * MIB);
    }

    /// A fast tier keeps the most valuable streamed pages that fit its room, as the
    /// store does, and what it keeps comes off the slow tier's bytes per token.
    #[test]
    fn a_fast_tier_keeps_what_fits_of_the_streamed_pages_most_valuable_first() {
        let plan = plan_of(64 * MIB, 4096, &vec![vec![4 * MIB, 2 * MIB]; 8], 16 * MIB);
        let p = place(&plan, &Needs::default(), 64 * MIB + 40 * MIB).unwrap();
        assert!(p.streamed_per_token > 0);
        let order = fast_tier_order(&plan, &p);
        let none = fast_tier_set(&plan, &p, MIB);
        assert_eq!(none, FastTierSet::default());
        // 7 MiB: a 4 MiB page, then a 2 MiB one (the next 4 MiB pages do not fit).
        let set = fast_tier_set(&plan, &p, 7 * MIB);
        assert_eq!(set.bytes, 6 * MIB);
        assert_eq!(set.per_token, 6 * MIB);
        assert_eq!(set.pages[0], order[0]);
        assert!(set.pages.iter().all(|id| !p.is_pinned(*id)));
        let all = fast_tier_set(&plan, &p, u64::MAX);
        assert_eq!(all.pages, order);
        assert_eq!(all.per_token, p.streamed_per_token);
    }

    #[test]
    fn pins_go_to_what_every_token_reads_and_the_embedding_stays_on_disk() {
        let plan = plan_of(64 * MIB, 4096, &vec![vec![4 * MIB, 4 * MIB]; 8], 16 * MIB);
        let needs = Needs::default();
        // Window: a layer and three pages (20 MiB) but at least the embedding (64 MiB).
        let p = place(&plan, &needs, 64 * MIB + 40 * MIB).unwrap();
        assert_eq!(p.window_bytes, 64 * MIB);
        // 40 MiB of pins: the head (16) and six 4 MiB matrices; never the embedding.
        assert!(!p.is_pinned(PageId(1)));
        assert!(p.is_pinned(plan.tail.ids()[0]));
        assert_eq!(p.pinned_bytes, 40 * MIB);
        assert_eq!(
            p.streamed_per_token,
            plan.weight_bytes_per_token() - 40 * MIB
        );
        // Everything fits: everything pinned, nothing streams.
        let p = place(&plan, &needs, 200 * MIB).unwrap();
        assert_eq!((p.window_bytes, p.streamed_per_token), (0, 0));
        assert_eq!(p.pinned.len(), 1 + 16 + 1);
    }

    #[test]
    fn the_fast_tier_candidates_are_what_streams_most_valuable_first() {
        let plan = plan_of(64 * MIB, 4096, &vec![vec![4 * MIB, 4 * MIB]; 8], 16 * MIB);
        let p = place(&plan, &Needs::default(), 64 * MIB + 40 * MIB).unwrap();
        // Every streamed page, never a pinned one; the matrices (read whole every
        // token: a ratio of one) lowest page first, the embedding (one row a token)
        // last.
        let order = fast_tier_order(&plan, &p);
        let mut streamed: Vec<PageId> = (2..=17)
            .map(PageId)
            .filter(|id| !p.is_pinned(*id))
            .collect();
        streamed.push(PageId(1));
        assert_eq!(order, streamed);
        // Everything pinned: nothing to keep.
        let all = place(&plan, &Needs::default(), 1 << 30).unwrap();
        assert!(fast_tier_order(&plan, &all).is_empty());
    }

    fn arb_plan() -> impl Strategy<Value = PagePlan> {
        (
            1u64..(64 << 20),
            1u64..(1 << 16),
            prop::collection::vec(prop::collection::vec(1u64..(32 << 20), 1..8), 1..12),
            1u64..(64 << 20),
        )
            .prop_map(|(e, row, layers, head)| plan_of(e, row, &layers, head))
    }

    proptest! {
        #[test]
        fn a_placement_never_exceeds_its_budget(
            plan in arb_plan(),
            kv in 0u64..(256 << 20),
            scratch in 0u64..(64 << 20),
            process in 0u64..(64 << 20),
            io in 0u64..(64 << 20),
            budget in 0u64..(2u64 << 30),
        ) {
            let needs = Needs { kv_bytes: kv, scratch_bytes: scratch, process_bytes: process, io_bytes: io };
            match place(&plan, &needs, budget) {
                Ok(p) => {
                    prop_assert!(p.total() <= budget);
                    prop_assert_eq!(
                        p.streamed_per_token + p.pinned_per_token,
                        plan.weight_bytes_per_token()
                    );
                    if p.streamed_per_token > 0 {
                        prop_assert!(p.window_bytes >= p.min_window_bytes);
                    }
                    prop_assert!(p.pinned.windows(2).all(|w| w[0] < w[1]));
                    prop_assert!(p.minimum_budget() <= budget);
                }
                Err(PlacementError::BelowMinimum { minimum, budget: b, .. }) => {
                    prop_assert!(b < minimum);
                    // The minimum it names is enough.
                    prop_assert!(place(&plan, &needs, minimum).is_ok());
                }
            }
        }
    }
}
