//! Storage tiers: where page bytes come from before they enter the page cache.
//!
//! - [`file::FileTier`]: a directory holding model files (the **primary** store, or a
//!   model directory on a mount), read by extent (file, offset, length) with `pread`.
//! - [`nas::NasTier`]: a [`FileTier`](file::FileTier) under a mount that can
//!   disappear: reads time out instead of hanging the engine, the mount's health is
//!   checked, a dead mount can be remounted by a configured command, and open files
//!   are re-resolved after a remount.
//! - [`ModelTier`]: where a model's files live, a local directory or a directory on a
//!   NAS mount; a model on a NAS is read only through its [`NasTier`].
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

use std::path::{Path, PathBuf};

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
    /// A NAS mount that does not answer (gone, or slower than its timeout).
    #[error("tier '{tier}': NAS mount {mount} is unavailable: {reason}")]
    MountUnavailable {
        tier: String,
        mount: PathBuf,
        reason: String,
    },
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

/// The tier holding a model's own files: a local directory, or a directory under a
/// NAS mount (then every access is bounded by the mount's timeout and health).
pub enum ModelTier {
    File(FileTier),
    Nas(NasTier),
}

impl ModelTier {
    pub fn name(&self) -> &str {
        match self {
            ModelTier::File(t) => t.name(),
            ModelTier::Nas(t) => t.name(),
        }
    }

    /// The model directory.
    pub fn root(&self) -> &Path {
        match self {
            ModelTier::File(t) => t.root(),
            ModelTier::Nas(t) => t.root(),
        }
    }

    pub fn stats(&self) -> TierStats {
        match self {
            ModelTier::File(t) => t.stats(),
            ModelTier::Nas(t) => t.stats(),
        }
    }

    pub fn counters(&self) -> &TierCounters {
        match self {
            ModelTier::File(t) => t.counters(),
            ModelTier::Nas(t) => t.counters(),
        }
    }

    /// Reads `ext` into `buf` (`buf.len() == ext.len`).
    pub fn read_extent(&self, ext: &Extent, buf: &mut [u8]) -> Result<(), TierError> {
        match self {
            ModelTier::File(t) => t.read_extent(ext, buf),
            ModelTier::Nas(t) => t.read_extent(ext, buf),
        }
    }

    /// The NAS tier, when the model lives on a NAS.
    pub fn nas(&self) -> Option<&NasTier> {
        match self {
            ModelTier::File(_) => None,
            ModelTier::Nas(t) => Some(t),
        }
    }

    /// The NAS's last known health; a local directory is always `Ok`.
    pub fn health(&self) -> Health {
        match self {
            ModelTier::File(_) => Health::Ok,
            ModelTier::Nas(t) => t.health(),
        }
    }
}
