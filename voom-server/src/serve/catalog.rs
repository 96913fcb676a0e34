//! The models the server can answer with: the directories of the models dir, each
//! with what requests need before any model work (tokenizer, chat template, context
//! limit) and the identity of its checkpoint.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use libvoom::config::ModelConfig;
use libvoom::text::Tokenizer;

use super::error::{ApiError, Kind};

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
}

/// Defaults for sampling fields a request leaves out: the model's
/// generation_config.json where it sets them (as vLLM does), else the OpenAI API's
/// (temperature 1, top_p 1, no top-k).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: usize,
}

impl SamplingDefaults {
    pub fn from_generation_config(dir: &Path) -> Self {
        let v: serde_json::Value = std::fs::read(dir.join("generation_config.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        SamplingDefaults {
            temperature: v["temperature"].as_f64().unwrap_or(1.0),
            top_p: v["top_p"].as_f64().unwrap_or(1.0),
            top_k: v["top_k"].as_u64().map_or(0, |k| k as usize),
        }
    }
}

impl ModelMeta {
    /// "name@digest": which checkpoint produced a response.
    pub fn checkpoint(&self) -> String {
        format!("{}@{}", self.id, self.checkpoint_digest)
    }
}

pub struct Catalog {
    dir: PathBuf,
    max_context: Option<usize>,
    loaded: Mutex<HashMap<String, Arc<ModelMeta>>>,
}

impl Catalog {
    pub fn new(dir: PathBuf, max_context: Option<usize>) -> Self {
        Catalog {
            dir,
            max_context,
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
        let bad = |e: &dyn std::fmt::Display| {
            ApiError::internal(format!("model '{id}' cannot be used: {e}"))
        };
        let cfg = ModelConfig::from_dir(dir).map_err(|e| bad(&e))?;
        let tokenizer = if dir.join("tokenizer.json").is_file() {
            Some(Tokenizer::from_dir(dir).map_err(|e| bad(&e))?)
        } else {
            None
        };
        let identity = std::fs::read(dir.join(voom_formats::manifest::MANIFEST_FILE))
            .or_else(|_| std::fs::read(dir.join("config.json")))
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
            max_context: self
                .max_context
                .unwrap_or(usize::MAX)
                .min(cfg.max_position_embeddings),
            checkpoint_digest: digest,
            created,
            sampling_defaults: SamplingDefaults::from_generation_config(dir),
        })
    }
}
