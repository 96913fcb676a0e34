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
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stage {
    reads: Vec<PlannedRead>,
    steps: Vec<Vec<PageId>>,
    /// The distinct pages, sorted (what a lease of the whole stage acquires).
    ids: Vec<PageId>,
    bytes: u64,
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

    /// Bytes of all its pages.
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
    /// Bytes of the largest decoder layer's pages.
    pub fn largest_layer_bytes(&self) -> u64 {
        self.layers.iter().map(Stage::bytes).max().unwrap_or(0)
    }

    /// The most bytes, as the cache holds them (slots), that one step of any stage
    /// leases: the least room streaming works in.
    pub fn largest_step_slot_bytes(&self) -> u64 {
        self.stages()
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
            .unwrap_or(0)
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
