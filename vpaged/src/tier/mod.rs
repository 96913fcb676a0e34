//! Storage tiers: where page bytes come from before they enter the page cache.
//!
//! - [`file::FileTier`]: a directory holding model files (the **primary** store, or a
//!   model directory on a mount), read by extent (file, offset, length) with `pread`.
//! - [`nas::NasTier`]: a [`FileTier`](file::FileTier) under a mount that can
//!   disappear: reads time out instead of hanging the engine, an unhealthy mount is
//!   re-checked and can be remounted by a configured command, and open files are
//!   re-resolved after a remount.
//! - [`fast::FastTier`]: a bounded directory on fast storage holding staged copies of
//!   hot pages, content-addressed by the blake3 of their decoded bytes.
//!
//! Tiers return bytes; they do not judge them. The store verifies every page against
//! its manifest hash after decoding and before it becomes visible, and on a mismatch
//! records an integrity failure on the tier and tries the next one.

pub mod fast;
pub mod file;
pub mod nas;
pub mod stats;

use std::path::PathBuf;
use std::time::Duration;

pub use fast::FastTier;
pub use file::FileTier;
pub use nas::{NasConfig, NasTier};
pub use stats::{TierCounters, TierStats};

/// Where a page's stored bytes lie in a model directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extent {
    /// File name relative to the model directory.
    pub file: String,
    pub offset: u64,
    pub len: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error("tier '{tier}': {path}: {source}")]
    Io {
        tier: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("tier '{tier}': {path} ends before byte {end} (file length {file_len})")]
    Truncated {
        tier: String,
        path: PathBuf,
        end: u64,
        file_len: u64,
    },
    #[error("tier '{tier}': a read of {path} took longer than {timeout:?}")]
    Timeout {
        tier: String,
        path: PathBuf,
        timeout: Duration,
    },
    #[error("tier '{tier}' is unavailable: {reason}")]
    Unavailable { tier: String, reason: String },
    #[error("tier '{tier}': {detail}")]
    Invalid { tier: String, detail: String },
}

/// A tier's health, for status displays.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase", tag = "state", content = "reason")]
pub enum Health {
    Ok,
    Unavailable(String),
}
