//! In-flight loads: one load per page, shared by every concurrent request for it.
//!
//! The first request for a missing page reserves a slot and becomes the loader; later
//! requests find the page `Loading`, register as waiters (under the cache's state lock,
//! so the loader counts them when it publishes) and block on the load's [`InFlight`]
//! cell. The loader publishes the page with one reference per waiter already taken, so
//! the page cannot be evicted between publication and a waiter waking up. A failure is
//! delivered to every waiter and leaves nothing resident.

use std::any::Any;
use std::error::Error;
use std::sync::Arc;

use crate::sync::{Condvar, Mutex};

use super::{CacheError, PageKey};

/// Why a load failed, shareable by every waiter.
#[derive(Clone)]
pub(crate) enum Failure {
    /// The loader's error, kept both as `Any` (a waiter whose error type matches gets it
    /// back typed) and as `dyn Error` (for waiters with another error type).
    Error {
        any: Arc<dyn Any + Send + Sync>,
        err: Arc<dyn Error + Send + Sync>,
    },
    Panicked,
}

impl Failure {
    pub(crate) fn from_error<E: Error + Send + Sync + 'static>(e: E) -> Failure {
        let e = Arc::new(e);
        Failure::Error {
            any: e.clone(),
            err: e,
        }
    }

    pub(crate) fn into_error<E: Error + Send + Sync + 'static>(
        self,
        key: PageKey,
    ) -> CacheError<E> {
        match self {
            Failure::Panicked => CacheError::LoadPanicked { key },
            Failure::Error { any, err } => match any.downcast::<E>() {
                Ok(source) => CacheError::Load { key, source },
                Err(_) => CacheError::PeerLoad { key, source: err },
            },
        }
    }
}

/// What a load ended with.
#[derive(Clone)]
pub(crate) enum Outcome {
    /// Resident at this arena offset; the waiter's reference is already counted.
    Ready {
        offset: usize,
    },
    Failed(Failure),
}

/// The rendezvous of one load and its waiters.
pub(crate) struct InFlight {
    outcome: Mutex<Option<Outcome>>,
    done: Condvar,
}

impl InFlight {
    pub(crate) fn new() -> InFlight {
        InFlight {
            outcome: Mutex::new(None),
            done: Condvar::new(),
        }
    }

    /// Publishes the outcome and wakes every waiter. Called once, by the loader, after
    /// the cache state reflects it.
    pub(crate) fn complete(&self, outcome: Outcome) {
        let mut o = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
        debug_assert!(o.is_none(), "load completed twice");
        *o = Some(outcome);
        self.done.notify_all();
    }

    /// Blocks until the load completes.
    pub(crate) fn wait(&self) -> Outcome {
        let mut o = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(outcome) = o.as_ref() {
                return outcome.clone();
            }
            o = self.done.wait(o).unwrap_or_else(|p| p.into_inner());
        }
    }
}
