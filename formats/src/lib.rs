//! # voom-formats
//!
//! The on-disk formats vOOM reads and writes, as pure data: no caching, tiering or
//! I/O policy lives here (that is `vpaged`'s job).
//!
//! - [`safetensors`]: single-file safetensors checkpoints, parsed and validated so a
//!   malformed file is a clear [`FormatError`] naming the file and tensor, never a
//!   panic or an out-of-bounds read; and a writer.
//! - [`checkpoint`]: a Hugging Face model directory: one `model.safetensors` or shards
//!   listed in `model.safetensors.index.json`, memory mapped.
//! - [`manifest`]: the page manifest of a model store: every page (tensor) with dtype,
//!   shape, location and the blake3 of its bytes. The manifest is the authority on
//!   what a page's bytes must be.
//! - [`gguf`]: the GGUF container (llama.cpp), its metadata and the dequantization of
//!   the tensor types vOOM imports.
//! - [`dtype`]: element types and exact conversions.
//! - [`stored_format`]: what a tensor's bytes are in a listing (plain, or a part of
//!   an FP8 or MXFP4 weight).
//! - [`vpack`]: the lossless byte-plane encoding of BF16/F16 pages (high plane zstd).
//! - [`pack`]: packing a model store: every BF16/F16 page's vpack body written beside
//!   the checkpoint, verified, and named in the manifest.
//! - [`mapguard`]: read-only file mappings whose read faults (a file truncated while
//!   mapped) are errors naming the file and offset instead of a fatal `SIGBUS`, and
//!   [`FileIdentity`], which tells whether a file changed since it was opened.

pub mod checkpoint;
pub mod dtype;
pub mod error;
pub mod file;
pub mod gguf;
pub mod manifest;
pub mod mapguard;
pub mod pack;
pub mod safetensors;
pub mod stored_format;
pub mod vpack;

pub use checkpoint::Checkpoint;
pub use dtype::DType;
pub use error::FormatError;
pub use manifest::Manifest;
pub use mapguard::{FileIdentity, GuardedMap};
pub use stored_format::StoredFormat;
