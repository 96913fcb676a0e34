//! The typed error of this crate.

use std::path::PathBuf;

/// Everything that can be wrong with a file vOOM reads. Each variant names the file
/// and, where there is one, the tensor.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file's structure is wrong (header, offsets, lengths, JSON).
    #[error("{path}: malformed {what}: {detail}")]
    Malformed {
        path: PathBuf,
        /// What kind of file or part: "safetensors header", "GGUF metadata", ...
        what: &'static str,
        detail: String,
    },
    /// One tensor's entry is wrong.
    #[error("{path}: tensor '{tensor}': {detail}")]
    BadTensor {
        path: PathBuf,
        tensor: String,
        detail: String,
    },
    /// A tensor, shard or key that should exist does not.
    #[error("{path}: missing {what}")]
    Missing { path: PathBuf, what: String },
    /// The bytes of a page do not hash to what the manifest says.
    #[error("{path}: page '{page}' fails its blake3 check: expected {expected}, got {actual}")]
    ChecksumMismatch {
        path: PathBuf,
        page: String,
        expected: String,
        actual: String,
    },
    /// A read through the file's memory mapping faulted at `offset` (the file was
    /// truncated, or its storage failed, while it was mapped): the bytes read from the
    /// mapping may be zeros instead of the file's, and what was computed from them must
    /// be discarded. See [`crate::mapguard`].
    #[error(
        "{path}: reading byte offset {offset} through the memory mapping failed (the file \
         was truncated or its storage failed while it was open); what was read from it is \
         discarded: reopen the file"
    )]
    Fault { path: PathBuf, offset: u64 },
    /// Valid file, but a feature vOOM does not support (yet).
    #[error("{path}: unsupported {what}")]
    Unsupported { path: PathBuf, what: String },
}

impl FormatError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        FormatError::Io {
            path: path.into(),
            source,
        }
    }
}

pub type Result<T, E = FormatError> = std::result::Result<T, E>;
