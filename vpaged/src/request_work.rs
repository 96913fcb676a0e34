//! The part of a session's requests that may wait on storage: opening a model store,
//! leasing pages that are not resident, staging and unstaging. Each is a [`Work`] that
//! owns everything it needs, so the daemon can run it on a thread of its own while
//! the session watches its client ([`crate::watch`]), and abandon it; its [`Done`] is
//! applied to the session's state (opened models, leases) only by the session, once
//! it has it. Work abandoned mid-way thus changes nothing in the session, and what it
//! leased is released when its result is dropped.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::cache::{Lease, PageKey};
use crate::protocol::ModelId;
use crate::store::{OpenModel, PlannedPins, Store};
use crate::PageId;
use crate::StoreError;

/// A request's work on the store.
#[derive(Debug)]
pub enum Work {
    Open(PathBuf),
    Acquire {
        model: ModelId,
        pages: Vec<PageId>,
    },
    Stage {
        model: ModelId,
        max_bytes: u64,
    },
    Unstage {
        model: ModelId,
    },
    Pin {
        model: ModelId,
        pages: Vec<PageId>,
    },
    KeepFast {
        model: ModelId,
        append: bool,
        pages: Vec<PageId>,
    },
}

/// What a piece of [`Work`] came to.
pub enum Done {
    Opened(Result<Arc<OpenModel>, StoreError>),
    /// The leases of every listed page in order, or the first error (then none).
    Acquired {
        model: ModelId,
        pages: Vec<PageId>,
        leases: Result<Vec<Lease>, StoreError>,
    },
    /// Pages and bytes staged or unstaged.
    Staged(Result<(usize, u64), StoreError>),
    /// The pins granted (held for as long as the session keeps them).
    Pinned(Result<PlannedPins, StoreError>),
}

impl Work {
    /// The request's name, for errors.
    pub fn name(&self) -> &'static str {
        match self {
            Work::Open(_) => "OpenModel",
            Work::Acquire { .. } => "Acquire",
            Work::Stage { .. } => "Stage",
            Work::Unstage { .. } => "Unstage",
            Work::Pin { .. } => "Pin",
            Work::KeepFast { .. } => "KeepFast",
        }
    }

    /// Whether the work may wait on storage: all of it but an `Acquire` of pages all
    /// resident already (a cache hit, served in place).
    pub fn may_wait_on_storage(&self, store: &Store) -> bool {
        match self {
            Work::Acquire { model, pages } => !pages.iter().all(|p| {
                store.cache().resident(PageKey {
                    model: model.0,
                    page: p.0,
                })
            }),
            _ => true,
        }
    }

    /// The longest the session waits for the work before answering with an error:
    /// `request_timeout`, except for `Stage`, which copies up to the whole fast tier
    /// (from a NAS that can take longer than any fixed bound) and takes as long as it
    /// takes, each of its reads bounded as every read is.
    pub fn deadline(&self, request_timeout: Duration) -> Option<Duration> {
        match self {
            Work::Stage { .. } => None,
            _ => Some(request_timeout),
        }
    }

    /// Does the work.
    pub fn run(self, store: &Arc<Store>) -> Done {
        match self {
            Work::Open(path) => {
                Done::Opened(store.open_model(&path).and_then(|id| store.model(id)))
            }
            Work::Acquire { model, pages } => {
                let leases = pages
                    .iter()
                    .map(|p| store.acquire(model.0, p.0))
                    .collect::<Result<Vec<_>, _>>();
                Done::Acquired {
                    model,
                    pages,
                    leases,
                }
            }
            Work::Stage { model, max_bytes } => Done::Staged(store.stage_hot(model.0, max_bytes)),
            Work::Unstage { model } => Done::Staged(store.unstage(model.0)),
            Work::Pin { model, pages } => {
                let pages: Vec<u32> = pages.iter().map(|p| p.0).collect();
                Done::Pinned(store.pin_planned(model.0, &pages))
            }
            Work::KeepFast {
                model,
                append,
                pages,
            } => {
                let pages: Vec<u32> = pages.iter().map(|p| p.0).collect();
                Done::Staged(store.keep_on_fast_tier(model.0, &pages, append))
            }
        }
    }
}
