//! Architectures, written once against the backend's ops and the page seam.
//! One file per family: [`llama`] covers llama, mistral, qwen2 and qwen3.

pub mod llama;
pub mod rope;
pub mod weights;

pub use llama::LlamaModel;
