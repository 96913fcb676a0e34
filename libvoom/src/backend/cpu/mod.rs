//! The CPU backend: f32 activations, weights read in place as BF16/F16/F32.

pub mod matmul;
pub mod membw;
pub mod ops;
pub mod threads;
