//! # vpaged
//!
//! The page store core of vOOM. A *page* is the unit of placement, caching and
//! integrity (here: one tensor of a checkpoint). Engines reach pages through one seam,
//! [`PageSource`]: they look up a tensor's [`PageId`] once, then [`PageSource::acquire`]
//! a [`PageLease`] on it around each use and compute on the lease's bytes in place.
//! A lease keeps its bytes valid and resident until dropped.
//!
//! This crate holds the [`embedded::EmbeddedStore`] (the default: memory-mapped
//! checkpoint files in the engine's own process, verified against the page manifest
//! when there is one). The daemon and its shared page cache plug into the same seam.

pub mod ahead;
pub mod arena;
pub mod cache;
pub mod client;
pub mod config;
pub mod daemon;
pub mod direct;
pub mod embedded;
pub mod error;
pub mod expert_plan;
pub mod expert_trace;
pub mod loader;
pub mod protocol;
pub mod read_pool;
pub mod request_work;
pub mod seal;
pub mod socket_path;
pub mod source;
pub mod stdout;
pub mod store;
pub(crate) mod sync;
pub mod tier;
pub mod watch;

pub use embedded::{EmbeddedStore, VerifyMode};
pub use error::StoreError;
pub use source::{PageId, PageLease, PageMeta, PageSource, SourceCacheStats};
