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
    /// A memory-mapped checkpoint file is now shorter than a page it holds: it was
    /// truncated after the model was opened. Nothing is read from the page.
    #[error(
        "{file}: page '{page}' is bytes {start}..{end} of the file, which is now {len} bytes: \
         it was truncated after the model was opened (reopen the model)"
    )]
    Truncated {
        file: PathBuf,
        page: String,
        start: u64,
        end: u64,
        len: u64,
    },
    /// A memory-mapped checkpoint file changed on disk after the model was opened, where
    /// its pages cannot be re-verified (no manifest, or verification off), or while
    /// pages of it were in use: what was computed from them must be discarded.
    #[error("{file}: {detail}")]
    FileChanged { file: PathBuf, detail: String },
}
