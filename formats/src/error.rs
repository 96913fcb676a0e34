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
