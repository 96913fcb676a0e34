//! The local model store: `$VOOM_HOME/models` (default `~/.voom/models`), one
//! Hugging Face checkpoint directory per model name.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// `$VOOM_HOME`, or `~/.voom`.
pub fn voom_home() -> Result<PathBuf> {
    if let Some(h) = std::env::var_os("VOOM_HOME") {
        return Ok(PathBuf::from(h));
    }
    let home = std::env::var_os("HOME").context("neither VOOM_HOME nor HOME is set")?;
    Ok(PathBuf::from(home).join(".voom"))
}

pub fn models_dir() -> Result<PathBuf> {
    Ok(voom_home()?.join("models"))
}

/// A model name must be one path component of safe characters.
pub fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name != "."
        && name != ".."
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !ok {
        bail!("invalid model name '{name}': use letters, digits, '-', '_' and '.'");
    }
    Ok(())
}

/// Where a model named `name` lives in the store.
pub fn model_path(name: &str) -> Result<PathBuf> {
    check_name(name)?;
    Ok(models_dir()?.join(name))
}

/// True when `dir` looks like a model directory.
pub fn is_model_dir(dir: &Path) -> bool {
    dir.join("config.json").is_file()
}

/// Lists model names in the store, sorted (reclaiming first what interrupted
/// imports and pulls left: [`crate::staging::reclaim`]).
pub fn list_models() -> Result<Vec<String>> {
    let dir = models_dir()?;
    crate::staging::reclaim(&dir);
    if let Ok(home) = voom_home() {
        crate::staging::reclaim(&home);
    }
    let mut out = Vec::new();
    let rd = match std::fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    };
    for e in rd {
        let e = e?;
        if is_model_dir(&e.path()) {
            out.push(e.file_name().to_string_lossy().into_owned());
        }
    }
    out.sort();
    Ok(out)
}
