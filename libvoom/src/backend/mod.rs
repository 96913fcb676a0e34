//! Compute backends. [`ops::Backend`] is the interface architectures are written
//! against; [`cpu`] implements it (one backend per instruction set, all giving the
//! same bits). Weight views ([`WeightView`], [`VecView`]) and the error type
//! ([`KernelError`]) are the same for every backend.

pub mod cpu;
mod error;
pub mod kv;
#[cfg(feature = "mlx")]
pub mod mlx;
pub mod ops;
pub mod view;

pub use error::KernelError;
pub use ops::{Activation, AttentionShape, Backend, LatentShape, RopeShape, RopeTable};
pub use view::{TableView, VecView, WeightView};

use cpu::matmul::Isa;

/// Which backend an engine computes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// The CPU, with this instruction set's kernels.
    Cpu(Isa),
}

impl BackendKind {
    /// The fastest backend this machine has.
    pub fn best() -> Self {
        BackendKind::Cpu(Isa::detect())
    }

    /// Every backend this machine can run (tests run their checks over each).
    pub fn available() -> Vec<Self> {
        Isa::available().into_iter().map(BackendKind::Cpu).collect()
    }

    /// Its name, as `--backend` takes it: `cpu-avx512`, `cpu-avx2`, `cpu-portable`.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu(Isa::Avx512) => "cpu-avx512",
            BackendKind::Cpu(Isa::Avx2) => "cpu-avx2",
            BackendKind::Cpu(Isa::Portable) => "cpu-portable",
        }
    }

    /// The backend named `name` ([`BackendKind::name`]), if this machine has it.
    pub fn parse(name: &str) -> Result<Self, String> {
        let all = Self::available();
        all.iter()
            .copied()
            .find(|k| k.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = all.iter().map(|k| k.name()).collect();
                format!(
                    "unknown or unavailable backend '{name}' (this machine has: {})",
                    names.join(", ")
                )
            })
    }
}

impl Default for BackendKind {
    fn default() -> Self {
        Self::best()
    }
}
