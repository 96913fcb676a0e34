//! The sweep: one forward pass's walk over the weights, following the model's
//! [`PagePlan`]. It leases each stage's pages while the model computes on them,
//! hints the pages that come next to the page source meanwhile, and releases them
//! after; an architecture supplies its plan and its math and never leases by itself.
//!
//! A pass is leased a whole layer at a time when the room pages stream through holds
//! two layers, or when the pass computes its positions in several chunks (each chunk
//! runs every step of a layer, so the layer stays leased until the last chunk is
//! done: the weights are read once per pass, however many chunks there are) and the
//! room holds one layer; otherwise one step (a matrix and the small vectors beside
//! it) at a time, so that a cache smaller than a layer still streams, and a decode
//! step holds one matrix while the rest of the room reads ahead.
//!
//! Hints run ahead by bytes, not by layers: the steps after the one leased are
//! hinted in order, as far as the room allows once the lease and the pages hinted
//! and not yet leased are counted, less two of the largest page, and no further
//! than `depth` layers ahead. The page cache places each page in one run of slots;
//! the free room is what the pages before left, and a page finds no run in it when
//! that room is in pieces (with a margin of one page, a 24-layer sweep skipped a
//! few hints a pass, and the demand loads that followed evicted pages hinted and
//! not yet used, which were read twice; with two, none). Its demand loads (the
//! embedding's parts, a hint skipped) also take their room from that margin. Each
//! lease moves the window on, and the steps that now fit are hinted together.
//! Pinned pages take no room. The walk is cyclic: past the last layer and the tail
//! come the next pass's first layers ([`Walk`], built once per placement). Neither
//! the lease scope nor the hints change a result.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use vpaged::{PageId, PageSource};

use super::plan::{slot_bytes, PagePlan, Stage};
use super::values::ValueChecks;
use super::weights::Leased;
use crate::VoomError;

/// Layers past the hinted ones whose pages the sweep names to the source's read-ahead
/// ([`PageSource::read_ahead`]): the source reads as many of their bodies as its room
/// holds, so this only needs to name more than any room holds.
pub const READ_AHEAD_LAYERS: usize = 4;

/// How much of a layer is leased at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseScope {
    /// The whole layer at once.
    Layer,
    /// One step of it at a time.
    Step,
}

/// One unit of the walk that hints count by: a step of a layer, or the tail.
#[derive(Debug, Clone)]
struct Unit {
    /// Its pages that stream (not pinned), not named by an earlier unit of its stage.
    pages: Vec<PageId>,
    /// Their slot bytes.
    bytes: u64,
}

/// Where the hints stand: what is hinted and not yet leased, and how far.
#[derive(Debug, Default)]
struct Ahead {
    /// The next unit to hint (an index into the walk, see [`Sweep::unit`]).
    next: usize,
    /// Units hinted and not yet leased, in order, with their bytes.
    hinted: VecDeque<(usize, u64)>,
    /// Bytes of the lease held now.
    held: u64,
}

/// The units hints count by, in the order a pass leases them (each layer's steps,
/// then the tail), for one placement: a unit holds the pages of its step that stream
/// (not pinned) and that no earlier step of its stage names, with their slot bytes.
/// Built once when a model is placed; every pass's [`Sweep`] walks it.
#[derive(Debug, Clone, Default)]
pub struct Walk {
    units: Vec<Unit>,
    /// Index of each layer's first unit, and of the tail's (last).
    starts: Vec<usize>,
    /// Slot bytes of the largest page of any unit.
    largest_page: u64,
}

impl Walk {
    /// The least room a sweep of this walk over `plan` works in: the largest step,
    /// read ahead by two pages, beside one position's routed experts. A memory
    /// governor takes no more of the streaming room than leaves this.
    pub fn least_room(&self, plan: &PagePlan) -> u64 {
        plan.largest_step_slot_bytes()
            + 2 * self.largest_page
            + plan.largest_expert_batch_slot_bytes()
    }

    /// The walk of `plan` with `pinned` (sorted) left out.
    pub fn new(plan: &PagePlan, pinned: &[PageId]) -> Walk {
        let mut walk = Walk::default();
        for layer in &plan.layers {
            walk.starts.push(walk.units.len());
            for step in layer.steps() {
                walk.push_stage_step(layer, step, pinned);
            }
        }
        walk.starts.push(walk.units.len());
        let tail: Vec<PageId> = plan.tail.steps().iter().flatten().copied().collect();
        walk.push_stage_step(&plan.tail, &tail, pinned);
        walk
    }

    /// Adds the unit of `step` of `stage`: its pages not pinned and not named by the
    /// stage's units added before (those since the stage's start).
    fn push_stage_step(&mut self, stage: &Stage, step: &[PageId], pinned: &[PageId]) {
        let stage_start = self.starts.last().copied().unwrap_or(0);
        let mut unit = Unit {
            pages: Vec::new(),
            bytes: 0,
        };
        for &id in step {
            let seen = self.units[stage_start..]
                .iter()
                .any(|u| u.pages.contains(&id));
            if seen || unit.pages.contains(&id) || pinned.binary_search(&id).is_ok() {
                continue;
            }
            let bytes = stage
                .reads()
                .iter()
                .find(|r| r.page == id)
                .map_or(0, |r| slot_bytes(r.bytes));
            unit.pages.push(id);
            unit.bytes += bytes;
            self.largest_page = self.largest_page.max(bytes);
        }
        self.units.push(unit);
    }
}

/// One forward pass's walk over the weights.
pub struct Sweep<'a> {
    source: &'a dyn PageSource,
    plan: &'a PagePlan,
    scope: LeaseScope,
    depth: usize,
    /// Bytes the lease held and the pages hinted ahead may take together.
    limit: u64,
    walk: &'a Walk,
    ahead: RefCell<Ahead>,
    /// Time spent waiting for leases (loads, or other requests' loads of the page).
    waited: Cell<Duration>,
    /// The routed experts each layer of experts leased, in pass order.
    routes: RefCell<Vec<(usize, Vec<usize>)>>,
    /// Whether the model predicts the next layer's experts and hints them
    /// ([`Sweep::predicts_experts`]).
    expert_prefetch: Cell<bool>,
    /// Bytes of a layer's expert outputs that may be held ([`Sweep::set_expert_hold`]).
    expert_hold: Cell<usize>,
    /// Slot bytes of one position's routed experts, the largest of any layer.
    expert_batch: u64,
    /// The pages whose stored values are checked when first leased.
    checks: Option<&'a ValueChecks>,
}

impl<'a> Sweep<'a> {
    /// A sweep of `plan` over `source` for a pass of `chunks` chunks of positions,
    /// hinting up to `prefetch_depth` layers ahead (0 sends no hints), as far as
    /// `room` holds. `room` is the bytes of the source's cache that unpinned pages
    /// stream through (the memory planner's window); `None`: the source's whole
    /// budget, or no bound. `walk`: the plan's [`Walk`] with the planner's pins left
    /// out (they take none of the room).
    pub fn new(
        source: &'a dyn PageSource,
        plan: &'a PagePlan,
        prefetch_depth: usize,
        room: Option<u64>,
        walk: &'a Walk,
        chunks: usize,
    ) -> Self {
        let largest = plan.largest_layer_slot_bytes();
        // Routed experts are read beside what the layer holds: room for one
        // position's (`top_k`), read at once.
        let expert = plan.largest_expert_batch_slot_bytes();
        let room = room.or(source.budget());
        let scope = match room {
            Some(b) if b >= 2 * largest + expert => LeaseScope::Layer,
            Some(b) if chunks > 1 && b >= largest + expert => LeaseScope::Layer,
            Some(_) => LeaseScope::Step,
            None => LeaseScope::Layer,
        };
        let limit = match room {
            Some(b) => b
                .saturating_sub(2 * walk.largest_page + expert)
                .max(plan.largest_step_slot_bytes()),
            None => u64::MAX,
        };
        Sweep {
            source,
            plan,
            scope,
            depth: prefetch_depth,
            limit,
            walk,
            ahead: RefCell::new(Ahead::default()),
            waited: Cell::new(Duration::ZERO),
            routes: RefCell::new(Vec::new()),
            expert_prefetch: Cell::new(false),
            expert_hold: Cell::new(EXPERT_HOLD_BYTES),
            expert_batch: expert,
            checks: None,
        }
    }

    /// Time this sweep has waited for its pages so far (the rest of a pass computes).
    pub fn waited(&self) -> Duration {
        self.waited.get()
    }

    /// Asks the model to predict each layer of experts' picks a layer early and hint
    /// them ([`Sweep::hint_experts`]); off by default. Never changes a result.
    /// Bytes of a layer's routed experts' outputs that may be held so that the
    /// experts compute in the order their pages are ready
    /// ([`LayerLease::experts`]' `any_order`), at most [`EXPERT_HOLD_BYTES`] (what
    /// scratch budgets count); 0: ascending order.
    pub fn set_expert_hold(&self, bytes: usize) {
        self.expert_hold.set(bytes.min(EXPERT_HOLD_BYTES));
    }

    pub fn set_expert_prefetch(&self, on: bool) {
        self.expert_prefetch.set(on);
    }

    /// Whether predicted experts are hinted (and hints are sent at all).
    pub fn predicts_experts(&self) -> bool {
        self.expert_prefetch.get() && self.depth > 0
    }

    /// Hints the pages of layer `li`'s routed experts `experts` (a prediction of its
    /// router's picks, ascending), as far as the room kept for one position's
    /// experts holds. A hint only: a wrong prediction costs reads, never a result.
    pub fn hint_experts(&self, li: usize, experts: &[usize]) {
        if !self.predicts_experts() {
            return;
        }
        self.prefetch_experts(li, experts, self.expert_batch);
    }

    /// Hints the pages of layer `li`'s routed experts `experts`, in order, in one
    /// call, as far as their slot bytes stay within `room`.
    fn prefetch_experts(&self, li: usize, experts: &[usize], room: u64) {
        let stage = &self.plan.layers[li];
        let mut used = 0;
        let mut ids = Vec::new();
        for &e in experts {
            used += stage.expert_slot_bytes(e);
            if used > room {
                break;
            }
            ids.extend_from_slice(&stage.experts()[e]);
        }
        if !ids.is_empty() {
            self.source.prefetch(&ids);
        }
    }

    /// The routed experts the pass leased so far: per layer of experts, in pass
    /// order, the layer and its experts (ascending). A routing trace's pass.
    pub fn routes(&self) -> Vec<(usize, Vec<usize>)> {
        self.routes.borrow().clone()
    }

    fn acquire(&self, ids: &[PageId]) -> Result<Leased, VoomError> {
        let leased = acquire_timed(self.source, ids, &self.waited)?;
        if let Some(c) = self.checks {
            c.check(self.source.pages(), leased.pages())?;
        }
        Ok(leased)
    }

    /// Checks the stored values of `checks`' pages as the sweep first leases them
    /// ([`ValueChecks`]).
    pub fn with_value_checks(self, checks: &'a ValueChecks) -> Self {
        Sweep {
            checks: Some(checks),
            ..self
        }
    }

    pub fn scope(&self) -> LeaseScope {
        self.scope
    }

    /// Layers hinted ahead at most (0: no hints).
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Leases pages outside a layer: of the head stage (the parts of the embedding
    /// table the pass's tokens need, which the model knows and the plan does not),
    /// or a later batch of the tail's.
    pub fn lease(&self, ids: &[PageId]) -> Result<Leased, VoomError> {
        self.acquire(ids)
    }

    /// Hints pages to the source (a pass's later head or tail parts while it
    /// computes on the first), when the sweep prefetches at all.
    pub fn hint(&self, ids: &[PageId]) {
        if self.depth > 0 && !ids.is_empty() {
            self.source.prefetch(ids);
        }
    }

    /// The most bytes of pages (as the cache holds them) to lease at once outside a
    /// layer, in batches of a table's parts: the largest layer's where the cache
    /// holds two, else the largest step's, which streaming always has room for.
    pub fn lease_bound(&self) -> u64 {
        match self.scope {
            LeaseScope::Layer => self.plan.largest_layer_slot_bytes(),
            LeaseScope::Step => self.plan.largest_step_slot_bytes(),
        }
        .max(1)
    }

    /// Starts layer `li`: leases it whole when the scope is [`LeaseScope::Layer`],
    /// first hinting what then fits ahead of it (see the module docs).
    pub fn layer(&self, li: usize) -> Result<LayerLease<'_>, VoomError> {
        self.read_ahead(li + 1);
        let whole = match self.scope {
            LeaseScope::Layer => {
                let (from, to) = (self.walk.starts[li], self.walk.starts[li + 1]);
                let held = self.walk.units[from..to].iter().map(|u| u.bytes).sum();
                self.move_on(to, held);
                self.top_up(self.stage_end(li + self.depth));
                Some(self.acquire(self.plan.layers[li].ids())?)
            }
            LeaseScope::Step => {
                self.top_up(self.stage_end(li + self.depth));
                None
            }
        };
        Ok(LayerLease {
            sweep: self,
            li,
            whole,
        })
    }

    /// Leases the pages read after the last layer, first hinting what fits of the
    /// layers the next pass starts with (decode sweeps again at once; without these
    /// hints a pass's first layer was read on demand, with nothing computing
    /// meanwhile). After the last pass of a generation that is one layer read for
    /// nothing. `ids` are the tail's pages to lease first (all of them, or the first
    /// batch of a head stored in parts).
    pub fn tail(&self, ids: &[PageId]) -> Result<Leased, VoomError> {
        let n = self.plan.layers.len();
        self.read_ahead(n + 1);
        let held = self.walk.units[self.walk.starts[n]]
            .bytes
            .min(self.lease_bound());
        self.move_on(self.walk.units.len(), held);
        self.top_up(self.stage_end(n + self.depth));
        self.acquire(ids)
    }

    /// Ends the pass (every lease dropped): a remote source delivers the releases it
    /// batched.
    pub fn finish(self) {
        self.source.flush();
    }

    /// The walk's unit `i`: the layers' steps, the tail, then the next pass's layers'
    /// steps; `None` past those.
    fn unit(&self, i: usize) -> Option<&Unit> {
        let n = self.plan.layers.len();
        match i.checked_sub(self.walk.units.len()) {
            None => self.walk.units.get(i),
            Some(j) if j < self.walk.starts[n] => self.walk.units.get(j),
            Some(_) => None,
        }
    }

    /// The index in the walk just past stage `t` (see [`Sweep::stage`]).
    fn stage_end(&self, t: usize) -> usize {
        let n = self.plan.layers.len();
        match t.cmp(&n) {
            std::cmp::Ordering::Less => self.walk.starts[t + 1],
            std::cmp::Ordering::Equal => self.walk.units.len(),
            std::cmp::Ordering::Greater => self.walk.units.len() + self.walk.starts[(t - n).min(n)],
        }
    }

    /// The walk has reached unit `to` (exclusive): what it leased is no longer ahead,
    /// and the lease held now is `held` bytes.
    fn move_on(&self, to: usize, held: u64) {
        let mut a = self.ahead.borrow_mut();
        while a.hinted.front().is_some_and(|&(i, _)| i < to) {
            a.hinted.pop_front();
        }
        a.next = a.next.max(to);
        a.held = held;
    }

    /// Hints the units from the next one not hinted, up to `reach` (exclusive), as
    /// far as they fit the limit beside the lease held and the units hinted and not
    /// yet leased, in one call (so that the source can read them as runs).
    fn top_up(&self, reach: usize) {
        if self.depth == 0 {
            return;
        }
        let mut pages = Vec::new();
        {
            let mut a = self.ahead.borrow_mut();
            let mut used = a.held + a.hinted.iter().map(|&(_, b)| b).sum::<u64>();
            while a.next < reach {
                let Some(u) = self.unit(a.next) else { break };
                if used + u.bytes > self.limit {
                    break;
                }
                used += u.bytes;
                pages.extend_from_slice(&u.pages);
                let next = a.next;
                a.hinted.push_back((next, u.bytes));
                a.next += 1;
            }
        }
        if !pages.is_empty() {
            self.source.prefetch(&pages);
        }
    }

    /// Names to the source the pages of the stages from `from` on, through
    /// [`READ_AHEAD_LAYERS`] past the hinted ones, in the order they will be leased
    /// (stage `n` is the tail, past it the next pass's layers): a source that reads
    /// encoded bodies ahead of their slots reads what its room allows
    /// ([`PageSource::read_ahead`]). Those the hints name are included, first, so that
    /// their bodies are read before later ones.
    fn read_ahead(&self, from: usize) {
        if self.depth == 0 {
            return;
        }
        let last = from + self.depth + READ_AHEAD_LAYERS;
        let mut ids = Vec::new();
        for t in from..last {
            match self.stage(t) {
                Some(stage) => ids.extend_from_slice(stage),
                None => break,
            }
        }
        if !ids.is_empty() {
            self.source.read_ahead(&ids);
        }
    }

    /// The pages of stage `t` in the order a sweep leases them: the layers, then
    /// (at `t` = the number of layers) the tail, then the next pass's layers; `None`
    /// past those.
    fn stage(&self, t: usize) -> Option<&[PageId]> {
        let layers = &self.plan.layers;
        let n = layers.len();
        match t.cmp(&n) {
            std::cmp::Ordering::Less => Some(layers[t].ids()),
            std::cmp::Ordering::Equal => Some(self.plan.tail.ids()),
            std::cmp::Ordering::Greater => layers.get(t - n - 1).map(|l| l.ids()),
        }
    }
}

/// Leases `ids`, adding the time it took to `waited`.
fn acquire_timed(
    source: &dyn PageSource,
    ids: &[PageId],
    waited: &Cell<Duration>,
) -> Result<Leased, VoomError> {
    let t = Instant::now();
    let r = Leased::acquire(source, ids);
    waited.set(waited.get() + t.elapsed());
    r
}

/// The most bytes of a layer's routed experts' outputs held to compute them in the
/// order their pages are ready: a decode step's always fit, a long prompt's may not.
pub const EXPERT_HOLD_BYTES: usize = 32 << 20;

/// A layer being computed: its pages, leased whole or step by step.
pub struct LayerLease<'a> {
    sweep: &'a Sweep<'a>,
    li: usize,
    whole: Option<Leased>,
}

impl LayerLease<'_> {
    /// The leases of step `i` of the layer's plan ([`super::plan::Stage::steps`]);
    /// leased step by step, the hints first move on past it.
    ///
    /// # Panics
    /// If the plan has no step `i` (an architecture bug).
    pub fn step(&self, i: usize) -> Result<StepLease<'_>, VoomError> {
        match &self.whole {
            Some(l) => Ok(StepLease::Shared(l)),
            None => {
                let s = self.sweep;
                let unit = s.walk.starts[self.li] + i;
                s.move_on(unit + 1, s.walk.units[unit].bytes);
                s.top_up(s.stage_end(self.li + s.depth));
                Ok(StepLease::Own(
                    s.acquire(&s.plan.layers[self.li].steps()[i])?,
                ))
            }
        }
    }
}

impl LayerLease<'_> {
    /// Bytes of the layer's routed experts' outputs that may be held
    /// ([`Sweep::set_expert_hold`]).
    pub fn expert_hold(&self) -> usize {
        self.sweep.expert_hold.get()
    }

    /// Leases the routed experts `chosen` (indices into the layer's
    /// [`Stage::experts`](super::plan::Stage::experts), ascending, each once) and runs
    /// `f` on each with the leases holding it. Experts are leased one at a time; when
    /// the sweep prefetches, they are hinted together first, as far as the room
    /// streaming keeps beside the layer for one position's experts holds (see
    /// [`Sweep::new`]: all of a decode step's), so that their reads are in flight at
    /// once. With `any_order`, each next expert is the first in `chosen` whose pages
    /// the source holds ready ([`PageSource::ready`]), else the first left (waiting
    /// for it): experts already resident compute while the others load. Without it,
    /// ascending. What `f` computes must not depend on the order.
    pub fn experts(
        &self,
        chosen: &[usize],
        any_order: bool,
        mut f: impl FnMut(usize, &Leased) -> Result<(), VoomError>,
    ) -> Result<(), VoomError> {
        let s = self.sweep;
        let stage = &s.plan.layers[self.li];
        s.routes.borrow_mut().push((self.li, chosen.to_vec()));
        if s.depth > 0 {
            s.prefetch_experts(self.li, chosen, 2 * s.walk.largest_page + s.expert_batch);
        }
        let mut left = chosen.to_vec();
        // Which of `left` were ready when last asked (in one call): asked again only
        // after a wait, so a layer asks the source a few times, not once per pick.
        let ask = |left: &[usize]| -> Vec<bool> {
            if !any_order {
                return vec![false; left.len()];
            }
            let groups: Vec<&[PageId]> = left.iter().map(|&e| &stage.experts()[e][..]).collect();
            s.source.ready_each(&groups)
        };
        let mut ready = ask(&left);
        while !left.is_empty() {
            // The first ready one, else the first left (waiting for it).
            let (i, waits) = match ready.iter().position(|&r| r) {
                Some(i) => (i, false),
                None => (0, true),
            };
            ready.remove(i);
            let e = left.remove(i);
            let lease = s.acquire(&stage.experts()[e])?;
            f(e, &lease)?;
            drop(lease);
            if waits {
                // See what landed meanwhile.
                ready = ask(&left);
            }
        }
        Ok(())
    }
}

/// The leases of one step: the layer's (shared) or the step's own.
pub enum StepLease<'a> {
    Shared(&'a Leased),
    Own(Leased),
}

impl std::ops::Deref for StepLease<'_> {
    type Target = Leased;
    fn deref(&self) -> &Leased {
        match self {
            StepLease::Shared(l) => l,
            StepLease::Own(l) => l,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use voom_formats::DType;
    use vpaged::{PageLease, PageMeta, StoreError};

    use super::*;
    use crate::model::plan::{PlannedRead, Stage};

    /// A source that records what it is asked: `Lease(id)` and `Hint(ids)`.
    #[derive(Default)]
    struct Recorder {
        pages: Vec<PageMeta>,
        log: Mutex<Vec<String>>,
        bytes: Arc<Vec<u8>>,
        /// Pages it reports ready (all, where empty).
        ready: Vec<u32>,
    }

    impl PageSource for Recorder {
        fn pages(&self) -> &[PageMeta] {
            &self.pages
        }
        fn acquire(&self, id: PageId) -> Result<PageLease, StoreError> {
            self.log.lock().unwrap().push(format!("lease {}", id.0));
            // SAFETY: `bytes` is kept alive by the lease's holder and never written.
            Ok(unsafe { PageLease::new(id, self.bytes.as_ptr(), 0, self.bytes.clone()) })
        }
        fn prefetch(&self, ids: &[PageId]) {
            let ids: Vec<String> = ids.iter().map(|i| i.0.to_string()).collect();
            self.log
                .lock()
                .unwrap()
                .push(format!("hint {}", ids.join(",")));
        }
        fn ready(&self, ids: &[PageId]) -> bool {
            self.ready.is_empty() || ids.iter().all(|id| self.ready.contains(&id.0))
        }
        fn describe(&self) -> String {
            "recorder".into()
        }
    }

    fn stage(id: u32) -> Stage {
        Stage::from_reads(
            vec![PlannedRead {
                page: PageId(id),
                bytes: 100,
                per_token: 100,
                per_token_whole: 100,
            }],
            vec![vec![PageId(id)]],
        )
    }

    const K: u64 = 16 << 10;

    /// A recorder of pages `0..n` of `len` bytes each.
    fn recorder(lens: &[u64]) -> Recorder {
        Recorder {
            pages: lens
                .iter()
                .enumerate()
                .map(|(i, &len)| PageMeta {
                    id: PageId(i as u32),
                    name: format!("p{i}"),
                    dtype: DType::BF16,
                    shape: vec![len as usize / 2],
                    len,
                    rows: None,
                })
                .collect(),
            ..Recorder::default()
        }
    }

    /// A stage of one page per step, the pages `ids` of the sizes in `lens`.
    fn steps(ids: &[u32], lens: &[u64]) -> Stage {
        Stage::from_reads(
            ids.iter()
                .map(|&i| PlannedRead {
                    page: PageId(i),
                    bytes: lens[i as usize],
                    per_token: lens[i as usize],
                    per_token_whole: lens[i as usize],
                })
                .collect(),
            ids.iter().map(|&i| vec![PageId(i)]).collect(),
        )
    }

    /// Three layers of four pages (16, 32, 32 and 32 KiB), a tail of one 16 KiB page
    /// (page 13); page 0 is the head.
    fn three_layers() -> (Recorder, PagePlan) {
        let mut lens = vec![K];
        for _ in 0..3 {
            lens.extend([K, 2 * K, 2 * K, 2 * K]);
        }
        lens.push(K);
        let src = recorder(&lens);
        let plan = PagePlan {
            head: steps(&[0], &lens),
            layers: (0..3)
                .map(|l| steps(&[1 + 4 * l, 2 + 4 * l, 3 + 4 * l, 4 + 4 * l], &lens))
                .collect(),
            tail: steps(&[13], &lens),
        };
        (src, plan)
    }

    fn log(src: &Recorder) -> Vec<String> {
        src.log.lock().unwrap().clone()
    }

    /// The planner's window for [`three_layers`], in units of 16 KiB: a layer (7)
    /// and three of its largest page (2).
    const ROOM: u64 = 13 * K;

    /// Leased a step at a time (the room holds less than two layers), hints go as
    /// far ahead as the room less two pages holds beside the step leased (9 units),
    /// and each step leased hints what then fits, never past the next layer with
    /// depth 1; at the tail, the next pass's first layer.
    #[test]
    fn step_leases_hint_ahead_by_bytes() {
        let (src, plan) = three_layers();
        let walk = Walk::new(&plan, &[]);
        let sweep = Sweep::new(&src, &plan, 1, Some(ROOM), &walk, 1);
        assert_eq!(sweep.scope(), LeaseScope::Step);
        for li in 0..3 {
            let lw = sweep.layer(li).unwrap();
            for i in 0..4 {
                drop(lw.step(i).unwrap());
            }
        }
        drop(sweep.tail(&[PageId(13)]).unwrap());
        sweep.finish();
        assert_eq!(
            log(&src),
            [
                // Layer 0: its pages and the next layer's first (8 units; the next
                // page would make 10).
                "hint 1,2,3,4,5",
                "lease 1",
                "hint 6",
                "lease 2",
                "hint 7",
                "lease 3",
                "hint 8",
                "lease 4",
                // Layer 1: layer 2 comes into reach.
                "hint 9",
                "lease 5",
                "hint 10",
                "lease 6",
                "hint 11",
                "lease 7",
                "hint 12",
                "lease 8",
                "hint 13",
                "lease 9",
                "lease 10",
                "lease 11",
                "lease 12",
                // The tail: the next pass's first layer.
                "hint 1,2,3,4",
                "lease 13",
            ]
        );
    }

    /// Routed experts free to come in any order are leased ready ones first (those
    /// resident while the others load), then in the order chosen; otherwise
    /// ascending.
    #[test]
    fn experts_in_any_order_take_the_ready_ones_first() {
        let lens = [K, K, K, K, K, K, K];
        for (any_order, want) in [(true, [4, 2, 3, 5]), (false, [2, 3, 4, 5])] {
            let mut src = recorder(&lens);
            src.ready = vec![4];
            let layer =
                steps(&[1], &lens).with_experts(&src, (2..6).map(|p| vec![PageId(p)]).collect(), 2);
            let plan = PagePlan {
                head: steps(&[0], &lens),
                layers: vec![layer],
                tail: steps(&[6], &lens),
            };
            let walk = Walk::new(&plan, &[]);
            let sweep = Sweep::new(&src, &plan, 0, None, &walk, 1);
            let lw = sweep.layer(0).unwrap();
            let mut order = Vec::new();
            lw.experts(&[0, 1, 2, 3], any_order, |e, _| {
                order.push(e as u32 + 2);
                Ok(())
            })
            .unwrap();
            assert_eq!(order, want, "any order: {any_order}");
            let leased: Vec<String> = log(&src)
                .into_iter()
                .filter(|l| l.starts_with("lease") && l != "lease 1")
                .collect();
            assert_eq!(leased, want.map(|p| format!("lease {p}")));
            // The route is recorded as chosen, whatever the order computed.
            assert_eq!(sweep.routes(), vec![(0, vec![0, 1, 2, 3])]);
        }
    }

    /// A pass of several chunks leases a layer whole when the room holds one (so the
    /// layer is read once), and hints what fits beside it; pinned pages take no
    /// room and are not hinted.
    #[test]
    fn chunked_passes_lease_layers_whole_and_pins_take_no_room() {
        let (src, plan) = three_layers();
        let walk = Walk::new(&plan, &[]);
        let sweep = Sweep::new(&src, &plan, 1, Some(ROOM), &walk, 2);
        assert_eq!(sweep.scope(), LeaseScope::Layer);
        for li in 0..3 {
            drop(sweep.layer(li).unwrap());
        }
        sweep.finish();
        // Each layer (7 units) leaves 2 of the 9: the next layer's first page. A
        // layer's pages are leased the largest first (page 1 of 4 is the smallest).
        assert_eq!(
            log(&src),
            [
                "hint 5", "lease 2", "lease 3", "lease 4", "lease 1", "hint 9", "lease 6",
                "lease 7", "lease 8", "lease 5", "hint 13", "lease 10", "lease 11", "lease 12",
                "lease 9"
            ]
        );

        // Pages 2 and 6 pinned: layer 0 leased whole holds 5 units, and the hints
        // take 3 more of layer 1 (its pinned page is not hinted); layer 1 leaves room
        // for 3 of layer 2.
        let (src, plan) = three_layers();
        let walk = Walk::new(&plan, &[PageId(2), PageId(6)]);
        let sweep = Sweep::new(&src, &plan, 1, Some(ROOM), &walk, 2);
        drop(sweep.layer(0).unwrap());
        drop(sweep.layer(1).unwrap());
        sweep.finish();
        assert_eq!(
            log(&src),
            [
                "hint 5,7",
                "lease 2",
                "lease 3",
                "lease 4",
                "lease 1",
                "hint 9,10",
                "lease 6",
                "lease 7",
                "lease 8",
                "lease 5"
            ]
        );
    }

    /// Without hints (depth 0) nothing is hinted, whatever the room.
    #[test]
    fn depth_zero_hints_nothing() {
        let (src, plan) = three_layers();
        let walk = Walk::new(&plan, &[]);
        let sweep = Sweep::new(&src, &plan, 0, Some(ROOM), &walk, 1);
        for li in 0..3 {
            let lw = sweep.layer(li).unwrap();
            for i in 0..4 {
                drop(lw.step(i).unwrap());
            }
        }
        sweep.finish();
        assert!(log(&src).iter().all(|l| l.starts_with("lease")));
    }

    /// Each layer hints the one after it, the last one the tail, and the tail the
    /// next pass's first layer (decode sweeps again at once).
    #[test]
    fn hints_run_one_layer_ahead_and_wrap_to_the_next_pass() {
        let src = Recorder {
            pages: (0..5)
                .map(|i| PageMeta {
                    id: PageId(i),
                    name: format!("p{i}"),
                    dtype: DType::BF16,
                    shape: vec![50],
                    len: 100,
                    rows: None,
                })
                .collect(),
            ..Recorder::default()
        };
        let plan = PagePlan {
            head: stage(0),
            layers: vec![stage(1), stage(2), stage(3)],
            tail: stage(4),
        };
        let walk = Walk::new(&plan, &[]);
        let sweep = Sweep::new(&src, &plan, 1, None, &walk, 1);
        assert_eq!(sweep.depth(), 1);
        drop(sweep.lease(plan.head.ids()).unwrap());
        for li in 0..3 {
            drop(sweep.layer(li).unwrap());
        }
        drop(sweep.tail(plan.tail.ids()).unwrap());
        sweep.finish();
        let log = src.log.lock().unwrap().clone();
        assert_eq!(
            log,
            [
                "lease 0", "hint 2", "lease 1", "hint 3", "lease 2", "hint 4", "lease 3", "hint 1",
                "lease 4"
            ]
        );
    }
}
