//! The MLX backend (feature `mlx`): MLX linked from its official Python wheels
//! (`build.rs`: `mlx` with `mlx-metal` on macOS, `mlx-cpu` on Linux), called
//! through a small C++ shim (`shim.cpp`: C ABI, exceptions caught, every call
//! serialised by [`ffi`]'s lock). [`MlxBackend`] implements the backend interface,
//! so every architecture runs on it unchanged.

mod backend;
mod ffi;

pub use backend::{MlxAct, MlxBackend};
