//! Where the memory planner put the model's weights, and a memory governor's lever
//! on it: the weight budget, which can be taken back and given back while the
//! engine runs.
//!
//! At open, the source's budget (its page cache, less its configured pins) is
//! placed ([`crate::placement::place`]): pins, and the room the rest streams
//! through. A governor then takes back bytes of that budget ([`Placements::shrink`]):
//!
//! - **The room a pass under way may lose**, at once: the streaming room beyond the
//!   least a sweep works in and beyond two whole layers (a sweep sizes its leases
//!   from the room when it starts), or, where every page is pinned, the room no
//!   page holds. The page cache's limit is lowered (`PageSource::set_cache_limit`),
//!   and each pass's room is the planned one less what was withheld since.
//! - **Pins**, between passes: the budget less what was taken is placed again, the
//!   pages it no longer pins are unpinned (they stream, read once a pass), and the
//!   limit follows. A pass holds its placement ([`Placements::begin_pass`]) until it
//!   ends, and a new placement is made only when none is held, so no pass finds
//!   fewer pages pinned than it was planned with, or less room: a request never
//!   fails for it. Never below the least budget the model streams in.
//!
//! [`Placements::restore`] gives bytes back the same way: pins (placed again between
//! passes, the limit raised first so they have room), then streaming room.
//! Placements never change arithmetic: which pages stay resident changes only what
//! is read again.

use std::sync::{Arc, Mutex, OnceLock};

use vpaged::PageSource;

use crate::model::plan::PagePlan;
use crate::model::{Model, Walk};
use crate::placement::{self, Needs};

/// One placement of the model's weights, which passes follow while they hold it.
#[derive(Debug)]
pub(crate) struct Placed {
    /// Bytes of the budget a governor had taken back when this was planned.
    taken: u64,
    /// Bytes of the cache unpinned pages stream through, when part of the model
    /// is pinned; `None` when nothing streams, or the source has no budget.
    stream_room: Option<u64>,
    /// Slot bytes pinned.
    pinned_bytes: u64,
    /// Room of the cache beyond the pins that a pass planned with this one may
    /// lose while it is under way.
    spare: u64,
    /// The plan's walk with these pins left out, which every pass's sweep follows,
    /// and the multi-token-prediction layer's, where the model has one.
    pub walk: Walk,
    pub mtp_walk: Option<Walk>,
}

impl Placed {
    /// A pass's streaming room: the planned room, less what the cache withholds
    /// beyond what had been taken when this was planned (`withheld`: now).
    pub fn room(&self, withheld: u64) -> Option<u64> {
        self.stream_room
            .map(|r| r.saturating_sub(withheld.saturating_sub(self.taken)))
    }
}

/// What the weight budget is now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WeightBudget {
    /// The budget placed at open (0 without one).
    pub configured: u64,
    /// Bytes of it a governor takes back now (placed, or withheld from the room).
    pub taken: u64,
    /// The least budget a placement is made for (what a sweep with nothing pinned
    /// works in): the most that can be taken is `configured - least`.
    pub least: u64,
    /// Slot bytes pinned at open, and by the placement passes follow now.
    pub pinned_at_open: u64,
    pub pinned: u64,
    /// Bytes of the page cache withheld from pages now.
    pub withheld: u64,
}

struct State {
    current: Arc<Placed>,
    /// The bytes a governor asks to take back.
    target: u64,
}

/// The placements of one engine's weights over its page source
/// ([`crate::engine::Engine::weights`]).
pub struct Placements {
    source: Arc<dyn PageSource>,
    plan: PagePlan,
    mtp_plan: Option<PagePlan>,
    /// The weight budget at open; `None` where the source has none (memory-mapped
    /// files) or it is below the planner's minimum (passes then stream step by
    /// step, as without a plan).
    budget: Option<u64>,
    /// The least budget a placement may be made for: what a sweep with nothing
    /// pinned works in.
    least: u64,
    /// Bytes of the page cache (its capacity), once a governor is let in and where
    /// the source lets its cache's limit be set; unset: no lever.
    capacity: OnceLock<u64>,
    pinned_at_open: u64,
    state: Mutex<State>,
}

impl Placements {
    /// Places `model`'s pages under `source`'s budget: pins them, and has its fast
    /// tier (if any) keep copies of the pages that stream and save the most.
    pub(crate) fn open(source: Arc<dyn PageSource>, model: &dyn Model) -> Placements {
        let plan = model.plan().clone();
        let mtp_plan = model.mtp().ok().map(|m| m.plan().clone());
        let least = std::iter::once(&plan)
            .chain(&mtp_plan)
            .map(|p| Walk::new(p, &[]).least_room(p))
            .max()
            .unwrap_or(0);
        let budget = source
            .budget()
            .filter(|&b| placement::place(&plan, &Needs::default(), b).is_ok());
        let mut p = Placements {
            source,
            plan,
            mtp_plan,
            budget,
            least,
            capacity: OnceLock::new(),
            pinned_at_open: 0,
            state: Mutex::new(State {
                current: Arc::new(Placed {
                    taken: 0,
                    stream_room: None,
                    pinned_bytes: 0,
                    spare: 0,
                    walk: Walk::default(),
                    mtp_walk: None,
                }),
                target: 0,
            }),
        };
        let placed = p.place(0, true);
        p.pinned_at_open = placed.pinned_bytes;
        p.state.get_mut().unwrap_or_else(|e| e.into_inner()).current = Arc::new(placed);
        p
    }

    /// Lets a governor take back bytes of the budget from now on: the page cache's
    /// limit is set to its capacity (which a source without a cache of its own, or
    /// whose cache is a daemon's, refuses: then there is no lever). Returns whether
    /// there is one.
    pub fn govern(&self) -> bool {
        if self.capacity.get().is_some() {
            return true;
        }
        if self.budget.is_none() {
            return false;
        }
        let Some(capacity) = self.source.cache_stats().map(|s| s.capacity_bytes) else {
            return false;
        };
        if self.source.set_cache_limit(capacity).is_none() {
            return false;
        }
        self.capacity.get_or_init(|| capacity);
        true
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The placement for the budget less `taken`, its pins pinned (replacing the
    /// previous placement's). `first`: at open, when the fast tier is told what to
    /// keep too.
    fn place(&self, taken: u64, first: bool) -> Placed {
        let (mut pinned, mut pinned_bytes, mut stream_room) = (Vec::new(), 0, None);
        let mut budget = 0;
        if let Some(b) = self.budget {
            budget = b - taken;
            if let Ok(p) = placement::place(&self.plan, &Needs::default(), budget) {
                self.source.pin(&p.pinned);
                if first {
                    self.source
                        .keep_on_fast_tier(&placement::fast_tier_order(&self.plan, &p));
                }
                stream_room = (p.streamed_per_token > 0).then(|| budget - p.pinned_bytes);
                (pinned, pinned_bytes) = (p.pinned, p.pinned_bytes);
            }
        }
        let walk = Walk::new(&self.plan, &pinned);
        let mtp_walk = self.mtp_plan.as_ref().map(|p| Walk::new(p, &pinned));
        let spare = match stream_room {
            // What a pass already under way may lease: a sweep sizes its leases
            // from the room when it starts, and whole layers (two, beside one
            // position's experts) where the room held them.
            Some(room) => {
                let layers = 2 * self.plan.largest_layer_slot_bytes()
                    + self.plan.largest_expert_batch_slot_bytes();
                room - walk.least_room(&self.plan).max(layers).min(room)
            }
            // Every page pinned: a pass leases none but those.
            None => budget.saturating_sub(pinned_bytes),
        };
        Placed {
            taken,
            stream_room,
            pinned_bytes,
            spare,
            walk,
            mtp_walk,
        }
    }

    /// The placement a pass follows, held until the pass ends (dropped). A new
    /// placement a governor asked for is made first, when no pass holds the
    /// current one.
    pub(crate) fn begin_pass(&self) -> Arc<Placed> {
        let mut st = self.lock();
        self.apply(&mut st);
        Arc::clone(&st.current)
    }

    /// Takes back up to `need` more bytes of the budget, from the room a pass under
    /// way may lose or, with `unpin`, from pins too (those between passes: at once
    /// where none is under way). Returns the bytes of the page cache withheld by
    /// this call now.
    pub fn shrink(&self, need: u64, unpin: bool) -> u64 {
        let Some(budget) = self.budget.filter(|_| self.capacity.get().is_some()) else {
            return 0;
        };
        let before = self.source.cache_withheld();
        let mut st = self.lock();
        let most = if unpin {
            budget.saturating_sub(self.least)
        } else {
            st.current.taken + st.current.spare
        };
        st.target = st.target.max(st.target.saturating_add(need).min(most));
        self.apply(&mut st);
        self.source.cache_withheld().saturating_sub(before)
    }

    /// Gives back up to `bytes` of what was taken: pins first (placed again between
    /// passes), then streaming room. Returns whether anything was to give back.
    pub fn restore(&self, bytes: u64) -> bool {
        if self.capacity.get().is_none() {
            return false;
        }
        let mut st = self.lock();
        if st.target == 0 && st.current.taken == 0 {
            return false;
        }
        st.target = st.target.saturating_sub(bytes);
        self.apply(&mut st);
        true
    }

    /// Makes what the governor asked for now, as far as passes under way allow.
    fn apply(&self, st: &mut State) {
        let Some(&capacity) = self.capacity.get() else {
            return;
        };
        let idle = Arc::strong_count(&st.current) == 1;
        if st.target != st.current.taken && idle {
            // Growing: the room first, for the pins about to load; shrinking: the
            // pins first, so that the pages they leave can be evicted.
            let growing = st.target < st.current.taken;
            if growing {
                self.source.set_cache_limit(capacity - st.target);
            }
            st.current = Arc::new(self.place(st.target, false));
            if !growing {
                self.source.set_cache_limit(capacity - st.target);
            }
        } else {
            // Within the placement passes hold: no more than its spare room.
            let withheld = st.target.min(st.current.taken + st.current.spare);
            self.source.set_cache_limit(capacity - withheld);
        }
    }

    /// Applies a new placement asked for while passes held the last one, if none
    /// holds it now (a governor's tick: an idle engine gives its pins back too).
    pub fn settle(&self) {
        let mut st = self.lock();
        if st.target != st.current.taken {
            self.apply(&mut st);
        }
    }

    /// The budget now.
    pub fn budget(&self) -> WeightBudget {
        let st = self.lock();
        WeightBudget {
            configured: self.budget.unwrap_or(0),
            least: self.least,
            taken: st
                .current
                .taken
                .max(st.target.min(st.current.taken + st.current.spare)),
            pinned_at_open: self.pinned_at_open,
            pinned: st.current.pinned_bytes,
            withheld: self.source.cache_withheld(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use vpaged::store::{Store, StoreConfig, StoreSource};

    use crate::engine::{Engine, EngineOptions};

    /// An engine over an ample in-process cache of a copy of a committed fixture
    /// (with its page manifest), and the copy's directory.
    fn engine(case: &str) -> (tempfile::TempDir, Engine) {
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/tiny")
            .join(case);
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join(case);
        std::fs::create_dir_all(&dir).unwrap();
        for e in std::fs::read_dir(&src).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
        }
        let ckpt = voom_formats::Checkpoint::open(&dir).unwrap();
        voom_formats::Manifest::build(&ckpt, &mut |_, _| {})
            .unwrap()
            .save(&dir)
            .unwrap();
        let store = Store::new(StoreConfig {
            cache_bytes: 64 << 20,
            ..Default::default()
        })
        .unwrap();
        let source = StoreSource::open(store, &dir).unwrap();
        let e = Engine::with_source(&dir, std::sync::Arc::new(source), EngineOptions::default())
            .unwrap();
        (d, e)
    }

    /// A pass holding its placement keeps its pins and the room it may lease: the
    /// pins go when it ends (at the next pass, or a governor's `settle`), and
    /// given back, they come back only when no pass holds the smaller placement.
    #[test]
    fn a_placement_changes_only_between_passes() {
        let (_d, e) = engine("llama_gqa_untied");
        let w = &e.placements;
        assert!(w.govern());
        let open = w.budget();
        let held = w.begin_pass();
        w.shrink(u64::MAX, true);
        let b = w.budget();
        assert_eq!(b.pinned, open.pinned, "unpinned under a pass: {b:?}");
        assert_eq!(b.withheld, held.spare, "more than its spare room: {b:?}");
        assert_eq!(held.room(b.withheld), held.stream_room);
        w.settle();
        assert_eq!(w.budget().pinned, open.pinned, "settled under a pass");
        drop(held);
        w.settle();
        let small = w.budget();
        assert!(small.pinned < open.pinned, "{small:?}");
        assert_eq!(small.taken, small.configured - small.least);

        let held = w.begin_pass();
        assert!(held.stream_room.is_some(), "the smaller placement streams");
        assert!(w.restore(u64::MAX));
        let b = w.budget();
        assert_eq!(b.pinned, small.pinned, "pinned under a pass: {b:?}");
        assert_eq!(b.withheld, 0, "the room comes back at once: {b:?}");
        drop(held);
        let again = w.begin_pass();
        assert_eq!(w.budget().pinned, open.pinned);
        assert_eq!(again.taken, 0);
    }
}
