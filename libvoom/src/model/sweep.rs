//! The sweep: one forward pass's walk over the weights, following the model's
//! [`PagePlan`]. It leases each stage's pages while the model computes on them,
//! hints the next layers to the page source meanwhile, and releases them after; an
//! architecture supplies its plan and its math and never leases by itself.
//!
//! When the source's cache holds two layers (the one computing and the one
//! prefetched), a layer is leased whole; otherwise one step (a matrix and the small
//! vectors beside it) at a time, so that a cache smaller than a layer still streams.
//! The walk is cyclic: past the last layer, the next pass's first layers are hinted.
//! Neither the lease scope nor the prefetch depth changes a result.

use std::cell::Cell;
use std::time::{Duration, Instant};

use vpaged::{PageId, PageSource};

use super::plan::PagePlan;
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

/// One forward pass's walk over the weights.
pub struct Sweep<'a> {
    source: &'a dyn PageSource,
    plan: &'a PagePlan,
    scope: LeaseScope,
    depth: usize,
    /// Time spent waiting for leases (loads, or other requests' loads of the page).
    waited: Cell<Duration>,
}

impl<'a> Sweep<'a> {
    /// A sweep of `plan` over `source`, hinting up to `prefetch_depth` layers ahead
    /// (bounded so that the layer computing and those hinted fit the room streaming
    /// has, at least one ahead; 0 sends no hints). `room` is the bytes of the
    /// source's cache that unpinned pages stream through (the memory planner's
    /// window); `None`: the source's whole budget, or no bound.
    pub fn new(
        source: &'a dyn PageSource,
        plan: &'a PagePlan,
        prefetch_depth: usize,
        room: Option<u64>,
    ) -> Self {
        let largest = plan.largest_layer_bytes();
        let room = room.or(source.budget());
        let scope = match room {
            Some(b) if b < 2 * largest => LeaseScope::Step,
            _ => LeaseScope::Layer,
        };
        let depth = match (prefetch_depth, room) {
            (0, _) => 0,
            (d, Some(b)) if largest > 0 => {
                let fit = (b / largest).saturating_sub(1) as usize;
                d.min(fit.max(1))
            }
            (d, _) => d,
        };
        Sweep {
            source,
            plan,
            scope,
            depth,
            waited: Cell::new(Duration::ZERO),
        }
    }

    /// Time this sweep has waited for its pages so far (the rest of a pass computes).
    pub fn waited(&self) -> Duration {
        self.waited.get()
    }

    fn acquire(&self, ids: &[PageId]) -> Result<Leased, VoomError> {
        acquire_timed(self.source, ids, &self.waited)
    }

    pub fn scope(&self) -> LeaseScope {
        self.scope
    }

    /// Layers actually hinted ahead.
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
            LeaseScope::Layer => self.plan.largest_layer_bytes(),
            LeaseScope::Step => self.plan.largest_step_slot_bytes(),
        }
        .max(1)
    }

    /// Starts layer `li`: sends the hints due (layers `li+1..=li+depth` at the first
    /// layer, then the one newly inside the window; past the last layer, the tail's
    /// pages) and leases the layer whole when the scope is [`LeaseScope::Layer`].
    pub fn layer(&self, li: usize) -> Result<LayerLease<'_>, VoomError> {
        self.read_ahead(li + 1);
        self.hint_ahead(li);
        let whole = match self.scope {
            LeaseScope::Layer => Some(self.acquire(self.plan.layers[li].ids())?),
            LeaseScope::Step => None,
        };
        Ok(LayerLease {
            source: self.source,
            steps: self.plan.layers[li].steps(),
            whole,
            waited: &self.waited,
        })
    }

    /// Leases the pages read after the last layer, first hinting the layers the next
    /// pass starts with (decode sweeps again at once; without this hint a pass's
    /// first layer was read on demand, with nothing computing meanwhile). After the
    /// last pass of a generation that is one layer read for nothing. `ids` are the
    /// tail's pages to lease first (all of them, or the first batch of a head stored
    /// in parts).
    pub fn tail(&self, ids: &[PageId]) -> Result<Leased, VoomError> {
        self.read_ahead(self.plan.layers.len() + 1);
        for layer in self.plan.layers.iter().take(self.depth) {
            self.source.prefetch(layer.ids());
        }
        self.acquire(ids)
    }

    /// Ends the pass (every lease dropped): a remote source delivers the releases it
    /// batched.
    pub fn finish(self) {
        self.source.flush();
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

    fn hint_ahead(&self, li: usize) {
        if self.depth == 0 {
            return;
        }
        let first = if li == 0 { 1 } else { li + self.depth };
        // This pass's stages only: the next pass's first layers are hinted at the tail.
        for t in first..=(li + self.depth).min(self.plan.layers.len()) {
            if let Some(stage) = self.stage(t) {
                self.source.prefetch(stage);
            }
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

/// A layer being computed: its pages, leased whole or step by step.
pub struct LayerLease<'a> {
    source: &'a dyn PageSource,
    steps: &'a [Vec<PageId>],
    whole: Option<Leased>,
    waited: &'a Cell<Duration>,
}

impl LayerLease<'_> {
    /// The leases of step `i` of the layer's plan ([`super::plan::Stage::steps`]).
    ///
    /// # Panics
    /// If the plan has no step `i` (an architecture bug).
    pub fn step(&self, i: usize) -> Result<StepLease<'_>, VoomError> {
        match &self.whole {
            Some(l) => Ok(StepLease::Shared(l)),
            None => Ok(StepLease::Own(acquire_timed(
                self.source,
                &self.steps[i],
                self.waited,
            )?)),
        }
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
        let sweep = Sweep::new(&src, &plan, 1, None);
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
