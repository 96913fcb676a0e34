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

/// The prefix of every lossy model's id (`docs/lossy.md`): an id without it never
/// names weights that are not the published ones.
pub const LOSSY_PREFIX: &str = "lossy-";

/// The lossy scheme of the model in `dir` (`q4_k_m`: config.json's
/// `quantization_config` of gguf), `None` for exact weights or an unreadable
/// config (which opening the model reports).
pub fn lossy_scheme(dir: &Path) -> Option<String> {
    let text = voom_formats::file::read_limited(
        &dir.join("config.json"),
        voom_formats::file::SIDE_FILE_MAX_BYTES,
    )
    .ok()?;
    let v: serde_json::Value = serde_json::from_slice(&text).ok()?;
    let q = libvoom::quantization::Quantization::from_config(v.get("quantization_config")).ok()?;
    q.scheme().map(str::to_string)
}

/// Checks that the model `id` names in `dir` is labelled as what it is: a lossy
/// model's id begins with [`LOSSY_PREFIX`]. Returns its scheme (`None`: exact).
pub fn check_lossy_id(id: &str, dir: &Path) -> Result<Option<String>> {
    check_lossy_name(id, lossy_scheme(dir), dir)
}

/// [`check_lossy_id`] with the model's scheme already read (its config parsed).
pub fn check_lossy_name(id: &str, scheme: Option<String>, dir: &Path) -> Result<Option<String>> {
    if let Some(s) = &scheme {
        if !id.starts_with(LOSSY_PREFIX) {
            bail!(
                "model '{id}' holds lossy weights ({s}), but its id does not begin with \
                 '{LOSSY_PREFIX}': an exact id never names lossy weights (rename {} to \
                 {LOSSY_PREFIX}{id})",
                dir.display()
            );
        }
    }
    Ok(scheme)
}
