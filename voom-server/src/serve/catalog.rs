//! The models the server can answer with: the directories of the models dir, each
//! with what requests need before any model work (tokenizer, chat template, context
//! limit) and the identity of its checkpoint.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use libvoom::config::ModelConfig;
use libvoom::text::Tokenizer;

use super::error::{ApiError, Kind};
use crate::profile::{self, Settings};

/// What a request needs to know of a model without loading its weights.
pub struct ModelMeta {
    pub id: String,
    pub dir: PathBuf,
    pub tokenizer: Option<Tokenizer>,
    /// The longest context (prompt + output) the engine will accept.
    pub max_context: usize,
    /// The checkpoint's identity: the blake3 of its page manifest (or of config.json
    /// when it has none), first 16 hex digits.
    pub checkpoint_digest: String,
    /// Seconds since the epoch of the model directory's last change.
    pub created: u64,
    /// Sampling used for fields a request leaves out.
    pub sampling_defaults: SamplingDefaults,
    /// The lossy scheme of its weights (`q4_k_m`), `None` for exact weights.
    pub scheme: Option<String>,
}

/// Defaults for sampling fields a request leaves out, field by field: the profile's
/// `sampling`, else the model's generation_config.json where it sets them (as vLLM
/// does), else the OpenAI API's (temperature 1, top_p 1, no top-k).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: usize,
}

impl SamplingDefaults {
    /// `profile`'s values over the model's generation_config.json over the API's.
    pub fn resolve(profile: &profile::Sampling, dir: &Path) -> Self {
        let v: serde_json::Value = voom_formats::file::read_limited(
            &dir.join("generation_config.json"),
            voom_formats::file::SIDE_FILE_MAX_BYTES,
        )
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
        SamplingDefaults {
            temperature: profile
                .temperature
                .or(v["temperature"].as_f64())
                .unwrap_or(1.0),
            top_p: profile.top_p.or(v["top_p"].as_f64()).unwrap_or(1.0),
            top_k: profile
                .top_k
                .or(v["top_k"].as_u64().map(|k| k as usize))
                .unwrap_or(0),
        }
    }
}

impl ModelMeta {
    /// The tokenizer, which text requests need: a model without one is a 400.
    pub fn text_tokenizer(&self) -> Result<&Tokenizer, ApiError> {
        self.tokenizer.as_ref().ok_or_else(|| {
            ApiError::invalid(
                "model",
                format!(
                    "model '{}' has no tokenizer.json, so it cannot take text",
                    self.id
                ),
            )
        })
    }

    /// "name@digest": which checkpoint produced a response.
    pub fn checkpoint(&self) -> String {
        format!("{}@{}", self.id, self.checkpoint_digest)
    }
}

pub struct Catalog {
    dir: PathBuf,
    /// The resolved profile's settings: context limits and sampling defaults.
    settings: Settings,
    loaded: Mutex<HashMap<String, Arc<ModelMeta>>>,
}

impl Catalog {
    pub fn new(dir: PathBuf, settings: Settings) -> Self {
        Catalog {
            dir,
            settings,
            loaded: Mutex::new(HashMap::new()),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Model ids present now (directories holding a config.json), sorted.
    pub fn ids(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Ok(rd) = std::fs::read_dir(&self.dir) {
            for e in rd.flatten() {
                if e.path().join("config.json").is_file() {
                    if let Some(n) = e.file_name().to_str() {
                        out.push(n.to_string());
                    }
                }
            }
        }
        out.sort();
        out
    }

    /// The model `id`, read once (tokenizer, config) and kept. An unknown id is a 404
    /// that lists the models present.
    pub fn get(&self, id: &str) -> Result<Arc<ModelMeta>, ApiError> {
        if let Some(m) = self
            .loaded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
        {
            return Ok(Arc::clone(m));
        }
        let valid = !id.is_empty()
            && id.len() <= 128
            && id != "."
            && id != ".."
            && id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        let dir = self.dir.join(id);
        if !valid || !dir.join("config.json").is_file() {
            let ids = self.ids();
            return Err(ApiError::new(
                Kind::NotFound,
                format!(
                    "The model '{id}' does not exist (models here: {})",
                    if ids.is_empty() {
                        "none".to_string()
                    } else {
                        ids.join(", ")
                    }
                ),
            ));
        }
        let meta = Arc::new(self.read(id, &dir)?);
        self.loaded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_string(), Arc::clone(&meta));
        Ok(meta)
    }

    fn read(&self, id: &str, dir: &Path) -> Result<ModelMeta, ApiError> {
        let bad = |e: &dyn std::fmt::Display| ApiError::model_unavailable(id, e);
        let cfg = ModelConfig::from_dir(dir).map_err(|e| bad(&e))?;
        let scheme =
            crate::store::check_lossy_name(id, cfg.quant.scheme().map(str::to_string), dir)
                .map_err(|e| bad(&e))?;
        // The same limit the engine gets (cli::common::open_engine).
        let max_context = self.settings.max_context_for(&cfg).map_err(|e| bad(&e))?;
        let tokenizer = if dir.join("tokenizer.json").is_file() {
            Some(Tokenizer::from_dir(dir).map_err(|e| bad(&e))?)
        } else {
            None
        };
        // Files read here are regular files only (a FIFO would hold this request's
        // preparation, and the slot it takes, for good).
        let read = |name: &str, limit| voom_formats::file::read_limited(&dir.join(name), limit);
        let identity = match read(
            voom_formats::manifest::MANIFEST_FILE,
            voom_formats::manifest::MANIFEST_MAX_BYTES,
        ) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                read("config.json", voom_formats::file::SIDE_FILE_MAX_BYTES)
            }
            other => other,
        }
        .map_err(|e| bad(&e))?;
        let digest = blake3::hash(&identity).to_hex()[..16].to_string();
        let created = std::fs::metadata(dir)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs());
        Ok(ModelMeta {
            id: id.to_string(),
            dir: dir.to_path_buf(),
            tokenizer,
            max_context: max_context
                .unwrap_or(usize::MAX)
                .min(cfg.max_position_embeddings),
            checkpoint_digest: digest,
            created,
            sampling_defaults: SamplingDefaults::resolve(&self.settings.sampling, dir),
            scheme,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_defaults_take_profile_then_generation_config_then_api() {
        let d = tempfile::tempdir().unwrap();
        // No generation_config.json: the API's defaults.
        let none = profile::Sampling::default();
        assert_eq!(
            SamplingDefaults::resolve(&none, d.path()),
            SamplingDefaults {
                temperature: 1.0,
                top_p: 1.0,
                top_k: 0
            }
        );
        std::fs::write(
            d.path().join("generation_config.json"),
            r#"{"temperature": 0.6, "top_p": 0.9}"#,
        )
        .unwrap();
        assert_eq!(
            SamplingDefaults::resolve(&none, d.path()),
            SamplingDefaults {
                temperature: 0.6,
                top_p: 0.9,
                top_k: 0
            }
        );
        // The profile's values win field by field.
        let p = profile::Sampling {
            temperature: Some(0.0),
            top_p: None,
            top_k: Some(40),
        };
        assert_eq!(
            SamplingDefaults::resolve(&p, d.path()),
            SamplingDefaults {
                temperature: 0.0,
                top_p: 0.9,
                top_k: 40
            }
        );
    }

    #[test]
    fn a_kv_budget_does_not_bound_a_models_context() {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
        let models = tempfile::tempdir().unwrap();
        let src = fixture.join("tiny/llama_gqa_untied");
        let dst = models.path().join("tiny");
        std::fs::create_dir(&dst).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(src.join(f), dst.join(f)).unwrap();
        }
        let cfg = ModelConfig::from_dir(&dst).unwrap();
        // KV beyond the budget spills to disk: the model's whole context stays.
        let settings = Settings {
            kv_budget: Some(1),
            ..Settings::default()
        };
        let meta = Catalog::new(models.path().to_path_buf(), settings)
            .get("tiny")
            .unwrap();
        assert_eq!(meta.max_context, cfg.max_position_embeddings);
        let settings = Settings {
            max_context: Some(10),
            ..Settings::default()
        };
        let meta = Catalog::new(models.path().to_path_buf(), settings)
            .get("tiny")
            .unwrap();
        assert_eq!(meta.max_context, 10);
    }
}
