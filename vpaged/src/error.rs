//! The typed error of the page store.

use std::path::PathBuf;

use voom_formats::FormatError;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error("no page {id} in model store {store}")]
    NoSuchPage { id: u32, store: PathBuf },
    /// The page's bytes failed verification on a tier; it is never served.
    #[error("page '{page}' on tier '{tier}' fails verification: expected blake3 {expected}, got {actual}")]
    Integrity {
        page: String,
        tier: String,
        expected: String,
        actual: String,
    },
    /// Every copy of the page (on every tier holding it, raw and encoded) failed
    /// verification; it is never served. `copies` names each copy's tier and what it
    /// held instead (its blake3, or why its body does not decode).
    #[error("page '{page}' fails verification on every copy (expected blake3 {expected}): {}", copies.join("; "))]
    Corrupt {
        page: String,
        expected: String,
        copies: Vec<String>,
    },
    #[error(transparent)]
    Tier(crate::tier::TierError),
    /// No tier could serve the page's bytes.
    #[error("page '{page}' is unavailable on every tier: {}", reasons.join("; "))]
    Unavailable { page: String, reasons: Vec<String> },
    /// The daemon could not be reached or answered with an error.
    #[error("vpaged at {socket}: {detail}")]
    Daemon { socket: PathBuf, detail: String },
    #[error("model store {store}: {detail}")]
    Store { store: PathBuf, detail: String },
    /// No model store at the path (no such directory, or no page manifest in it), or no
    /// open model of that id.
    #[error("model store {store}: {detail}")]
    NotFound { store: PathBuf, detail: String },
}
