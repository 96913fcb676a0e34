//! # libvoom
//!
//! The client inference library of vOOM. An [`engine::Engine`] computes a model whose
//! weights it reaches through one seam, a [`vpaged::PageSource`]: the embedded store
//! (memory-mapped checkpoint files in this process) or, later, the `vpaged` daemon's
//! shared page cache. The engine leases each layer's pages while it computes on them
//! and computes in place on their bytes: weights are never copied to the heap.
//!
//! - [`config`]: Hugging Face `config.json` to the internal [`config::ModelConfig`].
//! - [`text`]: tokenizer, chat templates, streaming detokenization.
//! - [`backend`]: the op-level compute interface ([`backend::Backend`]) and its CPU
//!   implementation.
//! - [`model`]: the [`model::Model`] trait, the sweep over a page plan, and the
//!   architectures written against the backend (Llama family: llama,
//!   mistral, qwen2, qwen3).
//! - [`placement`]: the memory planner (one budget to pinned pages, a streaming
//!   window, KV and scratch).
//! - [`kv`]: the KV cache (the layout backends attend over; [`backend::kv`]).
//! - [`sampler`]: greedy, temperature, top-k, top-p, seeded.
//! - [`draft`]: a smaller model as a drafter.
//! - [`mtp`]: the checkpoint's multi-token-prediction layer as a drafter.
//! - [`speculate`]: drafters and the draft-length controller of speculative decoding.
//! - [`engine`]: prefill + decode loop with stop conditions, batched passes,
//!   speculative decoding.
//! - [`import`]: GGUF to Hugging Face layout.

pub mod backend;
pub mod config;
pub mod constrain;
pub mod draft;
pub mod engine;
pub mod error;
pub mod import;
pub mod model;
pub mod mtp;
pub mod placement;
pub mod quantization;
pub mod sampler;
pub mod speculate;
pub mod text;

pub use backend::kv;
pub use error::VoomError;
