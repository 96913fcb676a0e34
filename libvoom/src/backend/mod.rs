//! Compute backends. The CPU backend comes first; architectures call the ops of
//! [`cpu`] through the model's forward pass.

pub mod cpu;
