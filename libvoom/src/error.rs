//! The typed error of libvoom.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum VoomError {
    #[error(transparent)]
    Store(#[from] vpaged::StoreError),
    #[error(transparent)]
    Format(#[from] voom_formats::FormatError),
    #[error(transparent)]
    Kernel(#[from] crate::backend::KernelError),
    #[error(transparent)]
    Text(#[from] crate::text::TextError),
    /// `config.json` is missing, malformed, or asks for something vOOM does not do.
    #[error("{path}: {detail}")]
    Config { path: PathBuf, detail: String },
    /// A weight the architecture needs is missing or has the wrong dtype/shape.
    #[error("model {model}: tensor '{tensor}': {detail}")]
    Weight {
        model: String,
        tensor: String,
        detail: String,
    },
    /// Constrained decoding failed (a grammar that allows nothing, a matcher error).
    #[error(transparent)]
    Constrain(#[from] crate::constrain::ConstrainError),
    /// A request the engine cannot serve (prompt too long, empty prompt, bad ids...).
    #[error("{0}")]
    Request(String),
}
