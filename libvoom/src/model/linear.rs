//! A projection with an optional bias, and its product over a step's leases.

use vpaged::PageId;

use crate::backend::Backend;
use crate::model::weights::{Dim, Leased, Matrix, Vector, WeightFinder};
use crate::VoomError;

pub(super) struct Linear {
    pub w: Matrix,
    pub bias: Option<Vector>,
}

impl Linear {
    /// The projection `name` (`name.weight` of `rows × cols`, and `name.bias` of
    /// `rows` when `bias`).
    pub fn load(
        f: &WeightFinder<'_>,
        name: &str,
        rows: &Dim,
        cols: &Dim,
        bias: bool,
    ) -> Result<Linear, VoomError> {
        Ok(Linear {
            w: f.matrix(&format!("{name}.weight"), rows, cols)?,
            bias: if bias {
                Some(f.vector(&format!("{name}.bias"), rows)?)
            } else {
                None
            },
        })
    }

    pub fn pages(&self) -> impl Iterator<Item = PageId> + '_ {
        self.w.pages().chain(self.bias.iter().map(|b| b.page))
    }

    /// `out = x · wᵀ (+ bias)`, on the leases `w` of its step.
    pub fn apply<B: Backend>(
        &self,
        b: &B,
        w: &Leased,
        x: &B::Act,
        out: &mut B::Act,
    ) -> Result<(), VoomError> {
        b.matmul(x, w.matrix(&self.w), out)?;
        if let Some(bias) = &self.bias {
            b.add_bias(out, w.vector(bias))?;
        }
        Ok(())
    }
}
