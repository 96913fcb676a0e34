//! Compute backends. [`ops::Backend`] is the interface architectures are written
//! against; [`cpu`] implements it (one backend per instruction set, all giving the
//! same bits). Weight views ([`WeightView`], [`VecView`]) and the error type
//! ([`KernelError`]) are the same for every backend.

pub mod check;
pub mod cpu;
mod error;
pub mod kv;
#[cfg(voom_mlx)]
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
    /// MLX on its default device (Metal on Apple Silicon, the CPU build on Linux),
    /// in builds that link it (feature `mlx`; on macOS whenever MLX is found).
    Mlx,
}

/// What `--backend mlx` says in a build without MLX.
pub const MLX_MISSING: &str = "this build of vOOM has no MLX backend: install MLX's \
    wheels (`python3 -m pip install mlx mlx-cpu` on Linux, `python3 -m pip install mlx` \
    on macOS) and build with `--features mlx`";

/// Whether this build links MLX.
pub const fn has_mlx() -> bool {
    cfg!(voom_mlx)
}

impl BackendKind {
    /// The fastest backend this machine has.
    pub fn best() -> Self {
        BackendKind::Cpu(Isa::detect())
    }

    /// Every backend this machine can run (tests run their checks over each): its
    /// CPU instruction sets, then MLX where the build links it.
    pub fn available() -> Vec<Self> {
        let mut all: Vec<Self> = Isa::available().into_iter().map(BackendKind::Cpu).collect();
        if has_mlx() {
            all.push(BackendKind::Mlx);
        }
        all
    }

    /// The CPU backends this machine can run.
    pub fn cpus() -> Vec<Self> {
        Isa::available().into_iter().map(BackendKind::Cpu).collect()
    }

    /// Its name, as `--backend` takes it: `cpu-avx512`, `cpu-avx2`, `cpu-portable`,
    /// `mlx`.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu(Isa::Avx512) => "cpu-avx512",
            BackendKind::Cpu(Isa::Avx2) => "cpu-avx2",
            BackendKind::Cpu(Isa::Neon) => "cpu-neon",
            BackendKind::Cpu(Isa::Portable) => "cpu-portable",
            BackendKind::Mlx => "mlx",
        }
    }

    /// The backend's own name, as its engine reports it: the CPU backends' names,
    /// `mlx-cpu` or `mlx-gpu` (MLX's default device).
    pub fn describe(self) -> String {
        match self {
            BackendKind::Cpu(_) => self.name().to_string(),
            #[cfg(voom_mlx)]
            BackendKind::Mlx => {
                mlx::MlxBackend::new().map_or_else(|_| "mlx".into(), |b| ops::Backend::name(&b))
            }
            #[cfg(not(voom_mlx))]
            BackendKind::Mlx => "mlx".into(),
        }
    }

    /// Whether the backend is batch invariant ([`Backend::batch_invariant`]).
    pub fn batch_invariant(self) -> bool {
        match self {
            BackendKind::Cpu(_) => true,
            #[cfg(voom_mlx)]
            BackendKind::Mlx => {
                mlx::MlxBackend::new().is_ok_and(|b| ops::Backend::batch_invariant(&b))
            }
            #[cfg(not(voom_mlx))]
            BackendKind::Mlx => false,
        }
    }

    /// The backend named `name` ([`BackendKind::name`]; `cpu` is the best CPU one),
    /// if this machine and build have it.
    pub fn parse(name: &str) -> Result<Self, String> {
        if name == "cpu" {
            return Ok(BackendKind::Cpu(Isa::detect()));
        }
        if name == "mlx" && !has_mlx() {
            return Err(MLX_MISSING.to_string());
        }
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
