//! The CPU backend: f32 activations ([`Rows`]), weights read in place as
//! BF16/F16/F32, one [`CpuBackend`] per instruction set.

pub mod activation;
mod attention;
mod backend;
pub mod exp;
pub mod fma_peak;
pub mod grouped;
pub mod matmul;
pub mod membw;
pub mod ops;
#[cfg(target_arch = "x86_64")]
mod packed_scores;
mod rows;
pub mod softmax;
pub mod threads;

pub use attention::BLOCK_Q as ATTENTION_BLOCK_Q;
pub use backend::CpuBackend;
pub use rows::Rows;
