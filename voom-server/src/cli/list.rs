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
        // Each model's exactness: a lossy one names its scheme.
        let dir = store::models_dir()?;
        let details: Vec<_> = models
            .iter()
            .map(|m| {
                let scheme = store::lossy_scheme(&dir.join(m));
                serde_json::json!({"name": m, "exact": scheme.is_none(), "scheme": scheme})
            })
            .collect();
        vpaged::outln!(
            "{}",
            serde_json::json!({"store": dir, "models": models, "details": details,
                "pullable": known})
        )?;
        return Ok(());
    }
    vpaged::outln!("models in {}:", store::models_dir()?.display())?;
    let dir = store::models_dir()?;
    for m in &models {
        match store::lossy_scheme(&dir.join(m)) {
            Some(s) => vpaged::outln!("  {m:<40} lossy ({s})")?,
            None => vpaged::outln!("  {m:<40} exact")?,
        }
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
