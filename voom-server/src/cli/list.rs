//! `voom list`: models in the local store.

use anyhow::Result;
use clap::Args;

use crate::{registry, store};

#[derive(Args, Debug)]
pub struct ListArgs {
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: ListArgs) -> Result<()> {
    let models = store::list_models()?;
    if a.json {
        let known: Vec<_> = registry::KNOWN
            .iter()
            .map(|m| serde_json::json!({"name": m.name, "description": m.description}))
            .collect();
        vpaged::outln!(
            "{}",
            serde_json::json!({"store": store::models_dir()?, "models": models, "pullable": known})
        )?;
        return Ok(());
    }
    vpaged::outln!("models in {}:", store::models_dir()?.display())?;
    for m in &models {
        vpaged::outln!("  {m}")?;
    }
    if models.is_empty() {
        vpaged::outln!("  (none)")?;
    }
    vpaged::outln!("pullable with `voom pull NAME`:")?;
    for m in registry::KNOWN {
        vpaged::outln!("  {:<24} {}", m.name, m.description)?;
    }
    Ok(())
}
