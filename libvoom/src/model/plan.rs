//! A model's page plan: which pages each stage of a forward pass reads, in sweep
//! order, and how many of their bytes one decode token reads. The sweep
//! ([`super::sweep`]) leases and prefetches by it; the memory planner decides what
//! to pin from it.

use vpaged::{PageId, PageSource};

/// Alignment of every resident page's memory (the arena's slots and direct-read
/// buffers): 16 KiB.
pub const SLOT_ALIGN: u64 = 16 << 10;

/// Bytes a page of `len` bytes holds resident.
pub fn slot_bytes(len: u64) -> u64 {
    len.next_multiple_of(SLOT_ALIGN)
}

/// One page a stage reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedRead {
    pub page: PageId,
    /// Bytes of the page (as leased).
    pub bytes: u64,
    /// Bytes of it one decode token reads from the source the model was opened on:
    /// the whole page for a layer's matrices and the LM head; for an embedding table,
    /// where the source reads only what is touched, one row (spread over the table's
    /// parts), else the part holding it.
    pub per_token: u64,
    /// What `per_token` is from a source that loads pages whole (a page cache).
    pub per_token_whole: u64,
}

/// What one decode token reads of a page that it does not read whole (an embedding
/// table's part), from either kind of source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PerToken {
    /// From a source that reads only what is touched (memory-mapped files).
    pub partial: u64,
    /// From a source that loads pages whole (a page cache).
    pub whole: u64,
}

/// The pages of one stage (the embedding, a decoder layer, the head), in steps: the
/// pages each step of its computation reads, in order (a matrix and the vectors
/// beside it). A stage leased step by step holds one step's pages at a time.
///
/// A layer of routed experts also lists each expert's pages: a pass reads only those
/// its router picks, so they are in no step and in no lease of the whole stage; the
/// sweep leases them once the router has run ([`super::sweep::LayerLease::experts`]).
/// Their reads count what a token reads of them on average (`top_k` of the experts).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stage {
    reads: Vec<PlannedRead>,
    steps: Vec<Vec<PageId>>,
    /// The distinct pages of the steps, sorted (what a lease of the whole stage
    /// acquires).
    ids: Vec<PageId>,
    bytes: u64,
    /// Each routed expert's pages, by expert index.
    experts: Vec<Vec<PageId>>,
    /// Slot bytes of each routed expert's pages (computed once: the sweep asks for
    /// them every layer of every pass).
    expert_slots: Vec<u64>,
    /// Slot bytes of the `top_k` largest experts.
    expert_batch: u64,
    /// Experts a position picks.
    top_k: usize,
}

impl Stage {
    /// A stage whose steps read `steps`, in order: each page with what one decode
    /// token reads of it (`None`: the whole page), its size from `source`, its
    /// `per_token` for the kind of source `source` is. A page listed twice is one
    /// read.
    pub fn new(source: &dyn PageSource, steps: &[Vec<(PageId, Option<PerToken>)>]) -> Self {
        let pages = source.pages();
        let partial = source.partial_reads();
        let reads = steps
            .iter()
            .flatten()
            .map(|&(page, per)| {
                let bytes = pages[page.0 as usize].len;
                let (part, whole) = per.map_or((bytes, bytes), |p| (p.partial, p.whole));
                PlannedRead {
                    page,
                    bytes,
                    per_token: if partial { part } else { whole }.min(bytes),
                    per_token_whole: whole.min(bytes),
                }
            })
            .collect();
        let steps = steps
            .iter()
            .map(|s| s.iter().map(|&(p, _)| p).collect())
            .collect();
        Self::from_reads(reads, steps)
    }

    /// This stage with routed experts: expert `e`'s pages are `experts[e]`, and a
    /// token reads `top_k` of them, so each page's read per token is its bytes times
    /// `top_k` over the number of experts (rounded up). The experts' pages must be
    /// none of the steps'.
    pub fn with_experts(
        mut self,
        source: &dyn PageSource,
        experts: Vec<Vec<PageId>>,
        top_k: usize,
    ) -> Self {
        let pages = source.pages();
        let pages_of = pages;
        let n = experts.len().max(1) as u64;
        // A page several experts share (experts stored fused in one tensor) is read
        // when any of them is picked.
        let mut named: Vec<(PageId, u64)> = Vec::new();
        for &page in experts.iter().flatten() {
            match named.iter_mut().find(|(p, _)| *p == page) {
                Some((_, k)) => *k += 1,
                None => named.push((page, 1)),
            }
        }
        for (page, by) in named {
            let bytes = pages[page.0 as usize].len;
            let picked = (top_k as u64).saturating_mul(by).min(n);
            let per = (bytes as u128 * picked as u128).div_ceil(n as u128) as u64;
            self.reads.push(PlannedRead {
                page,
                bytes,
                per_token: per,
                per_token_whole: per,
            });
        }
        self.expert_slots = experts
            .iter()
            .map(|pages| {
                pages
                    .iter()
                    .map(|id| slot_bytes(pages_of[id.0 as usize].len))
                    .sum()
            })
            .collect();
        let mut sizes = self.expert_slots.clone();
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        self.expert_batch = sizes.iter().take(top_k).sum();
        self.experts = experts;
        self.top_k = top_k;
        self
    }

    /// Slot bytes of the `top_k` largest of its experts: what one position's experts
    /// hold at once (0 without experts).
    pub fn expert_batch_slot_bytes(&self) -> u64 {
        self.expert_batch
    }

    /// Each routed expert's pages, by expert index (none in a dense stage).
    pub fn experts(&self) -> &[Vec<PageId>] {
        &self.experts
    }

    /// Slot bytes of routed expert `e`'s pages.
    pub fn expert_slot_bytes(&self, e: usize) -> u64 {
        self.expert_slots[e]
    }

    /// This stage as a source that loads pages whole reads it.
    pub fn whole_pages(&self) -> Stage {
        let mut s = self.clone();
        for r in &mut s.reads {
            r.per_token = r.per_token_whole;
        }
        s
    }

    /// A stage of these reads in these steps (a page read twice is one read: the
    /// first).
    pub fn from_reads(reads: Vec<PlannedRead>, steps: Vec<Vec<PageId>>) -> Self {
        let mut out: Vec<PlannedRead> = Vec::with_capacity(reads.len());
        for r in reads {
            if !out.iter().any(|o| o.page == r.page) {
                out.push(r);
            }
        }
        let mut ids: Vec<PageId> = out.iter().map(|r| r.page).collect();
        ids.sort_unstable();
        let bytes = out.iter().map(|r| r.bytes).sum();
        Stage {
            reads: out,
            steps,
            ids,
            bytes,
            experts: Vec::new(),
            expert_slots: Vec::new(),
            expert_batch: 0,
            top_k: 0,
        }
    }

    /// The pages of each step, in order.
    pub fn steps(&self) -> &[Vec<PageId>] {
        &self.steps
    }

    pub fn reads(&self) -> &[PlannedRead] {
        &self.reads
    }

    /// The stage's distinct pages, sorted.
    pub fn ids(&self) -> &[PageId] {
        &self.ids
    }

    /// Bytes of all its steps' pages (routed experts' not counted).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Bytes one decode token reads from it.
    pub fn per_token(&self) -> u64 {
        self.reads.iter().map(|r| r.per_token).sum()
    }
}

/// The stages of a forward pass, in the order a pass reads them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PagePlan {
    /// Before the first layer (the embedding rows).
    pub head: Stage,
    /// Each decoder layer's pages, which every token reads.
    pub layers: Vec<Stage>,
    /// After the last layer (the final norm, the LM head).
    pub tail: Stage,
}

impl PagePlan {
    /// Slot bytes of the largest decoder layer's pages (its steps', as the cache
    /// holds them: what a lease of a whole layer takes).
    pub fn largest_layer_slot_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|s| {
                s.ids()
                    .iter()
                    .map(|id| {
                        let r = s.reads.iter().find(|r| r.page == *id);
                        slot_bytes(r.map_or(0, |r| r.bytes))
                    })
                    .sum::<u64>()
            })
            .max()
            .unwrap_or(0)
    }

    /// Bytes of the largest decoder layer's pages.
    pub fn largest_layer_bytes(&self) -> u64 {
        self.layers.iter().map(Stage::bytes).max().unwrap_or(0)
    }

    /// Slot bytes of the largest batch of one position's routed experts (`top_k` of
    /// them) of any layer: what the sweep hints and leases beside a layer at once (0
    /// without experts).
    pub fn largest_expert_batch_slot_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(Stage::expert_batch_slot_bytes)
            .max()
            .unwrap_or(0)
    }

    /// Slot bytes of the largest routed expert of any layer (0 without experts).
    pub fn largest_expert_slot_bytes(&self) -> u64 {
        self.layers
            .iter()
            .flat_map(|s| (0..s.experts().len()).map(|e| s.expert_slot_bytes(e)))
            .max()
            .unwrap_or(0)
    }

    /// The most bytes, as the cache holds them (slots), that one step of any stage,
    /// or one routed expert, leases: the least room streaming works in.
    pub fn largest_step_slot_bytes(&self) -> u64 {
        let steps = self
            .stages()
            .flat_map(|s| {
                s.steps().iter().map(|step| {
                    let mut ids = step.clone();
                    ids.sort_unstable();
                    ids.dedup();
                    ids.iter()
                        .map(|id| {
                            let r = s.reads.iter().find(|r| r.page == *id);
                            slot_bytes(r.map_or(0, |r| r.bytes))
                        })
                        .sum::<u64>()
                })
            })
            .max()
            .unwrap_or(0);
        steps.max(self.largest_expert_slot_bytes())
    }

    /// Bytes of weights one decode token reads (a page read by two stages, such as
    /// tied embeddings, counts for each).
    pub fn weight_bytes_per_token(&self) -> u64 {
        self.stages().map(Stage::per_token).sum()
    }

    /// The plan as a source that loads pages whole (a page cache) reads it: what a
    /// memory planner sizes a cache by, whatever source the model was opened on.
    pub fn whole_pages(&self) -> PagePlan {
        PagePlan {
            head: self.head.whole_pages(),
            layers: self.layers.iter().map(Stage::whole_pages).collect(),
            tail: self.tail.whole_pages(),
        }
    }

    /// Every stage in sweep order.
    pub fn stages(&self) -> impl Iterator<Item = &Stage> {
        std::iter::once(&self.head)
            .chain(&self.layers)
            .chain(std::iter::once(&self.tail))
    }
}
