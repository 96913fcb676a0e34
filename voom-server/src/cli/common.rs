//! Pieces shared by the generating commands: engine options, sampling flags,
//! prompt building, streaming output.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use libvoom::engine::{Engine, EngineOptions, GenerateParams, Generation};
use libvoom::sampler::SamplingParams;
use libvoom::text::StreamDecoder;
use vpaged::VerifyMode;

use crate::store;

#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// Compute threads (default: all cores).
    #[arg(long, env = "VOOM_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// Verify pages against the manifest: off, first-use or eager.
    #[arg(long, env = "VOOM_VERIFY", default_value = "first-use")]
    pub verify: String,
    /// Longest context (prompt + generated) in tokens.
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Get pages from the vpaged daemon at this socket instead of the embedded store.
    #[arg(long, env = "VOOM_VPAGED")]
    pub vpaged: Option<PathBuf>,
    /// If the daemon cannot be reached, use the embedded store (with a warning).
    #[arg(long, env = "VOOM_VPAGED_FALLBACK")]
    pub vpaged_fallback: bool,
    /// Decoder layers hinted to the page source ahead of the one computing (0: off).
    #[arg(long, env = "VOOM_PREFETCH_DEPTH", default_value_t = 1)]
    pub prefetch_depth: usize,
}

impl EngineArgs {
    pub fn options(&self) -> Result<EngineOptions> {
        let verify = match self.verify.as_str() {
            "off" => VerifyMode::Off,
            "first-use" => VerifyMode::FirstUse,
            "eager" => VerifyMode::Eager,
            other => bail!("--verify must be off, first-use or eager, not '{other}'"),
        };
        Ok(EngineOptions {
            threads: self.threads,
            verify,
            max_context: self.max_context,
            prefetch_depth: self.prefetch_depth,
            ..EngineOptions::default()
        })
    }
}

#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy (the default, deterministic).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Sample among the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep generating after an end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
}

impl SamplingArgs {
    pub fn params(&self) -> GenerateParams {
        GenerateParams {
            max_new_tokens: self.max_new_tokens,
            sampling: SamplingParams {
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
                seed: self.seed,
            },
            ignore_eos: self.ignore_eos,
            record_logits: false,
        }
    }
}

/// Resolves MODEL: an existing directory, or a name in the local store (pulled first
/// when it is a known model that is missing and `pull_missing` is set).
pub fn resolve_model(model: &str, pull_missing: bool) -> Result<PathBuf> {
    let p = Path::new(model);
    if p.is_dir() {
        if !store::is_model_dir(p) {
            bail!("{} is a directory but has no config.json", p.display());
        }
        return Ok(p.to_path_buf());
    }
    if model.contains('/') {
        bail!("model directory {model} does not exist");
    }
    let dir = store::model_path(model)?;
    if store::is_model_dir(&dir) {
        return Ok(dir);
    }
    if pull_missing && crate::registry::find(model).is_some() {
        eprintln!("voom: {model} is not in the local store; pulling it");
        crate::cli::pull::pull_known(model, false)?;
        return Ok(dir);
    }
    let known: Vec<&str> = crate::registry::KNOWN.iter().map(|m| m.name).collect();
    bail!(
        "no model '{model}': not a directory, and not in the local store {} (models there: {}; `voom pull` knows: {})",
        store::models_dir()?.display(),
        store::list_models()?.join(", "),
        known.join(", ")
    )
}

pub fn open_engine(dir: &Path, args: &EngineArgs) -> Result<Engine> {
    let opts = args.options()?;
    if let Some(socket) = &args.vpaged {
        let source = vpaged::client::DaemonClient::connect(socket, "voom")
            .and_then(|c| vpaged::client::DaemonSource::open(c, dir));
        match source {
            Ok(src) => {
                return Engine::with_source(dir, std::sync::Arc::new(src), opts)
                    .with_context(|| format!("opening model {}", dir.display()))
            }
            Err(e) if args.vpaged_fallback => {
                eprintln!("voom: warning: {e}; using the embedded store");
            }
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("opening model {} through vpaged", dir.display()))
            }
        }
    }
    Engine::open(dir, opts).with_context(|| format!("opening model {}", dir.display()))
}

/// Token ids of a chat: the messages rendered with the model's chat template.
pub fn chat_ids(engine: &Engine, messages: &[serde_json::Value]) -> Result<Vec<u32>> {
    let tok = engine
        .tokenizer()
        .context("this model has no tokenizer.json: use --prompt-ids")?;
    let tpl = tok
        .chat_template()
        .context("this model has no chat template: use --prompt")?;
    let text = tpl.render(messages, None, true, None)?;
    Ok(tok.encode(&text, false)?)
}

/// Token ids of a raw text prompt (with the tokenizer's special tokens, as HF does).
pub fn text_ids(engine: &Engine, text: &str) -> Result<Vec<u32>> {
    let tok = engine
        .tokenizer()
        .context("this model has no tokenizer.json: use --prompt-ids")?;
    Ok(tok.encode(text, true)?)
}

/// Generates, streaming text to stdout as it completes (when `stream`), and returns
/// the generation and its full text.
pub fn generate_streaming(
    engine: &Engine,
    ids: &[u32],
    params: &GenerateParams,
    stream: bool,
) -> Result<(Generation, String)> {
    let mut text = String::new();
    let mut stdout = std::io::stdout();
    let eos = engine.eos_ids().to_vec();
    let g = match engine.tokenizer() {
        Some(tok) => {
            let mut dec = StreamDecoder::new(tok, true);
            let mut err = None;
            let g = engine.generate(ids, params, &mut |id| {
                if eos.contains(&id) && !params.ignore_eos {
                    return ControlFlow::Continue(());
                }
                match dec.push(id) {
                    Ok(piece) => {
                        if stream {
                            let _ = stdout.write_all(piece.as_bytes());
                            let _ = stdout.flush();
                        }
                        text.push_str(&piece);
                        ControlFlow::Continue(())
                    }
                    Err(e) => {
                        err = Some(e);
                        ControlFlow::Break(())
                    }
                }
            })?;
            if let Some(e) = err {
                return Err(e.into());
            }
            let rest = dec.finish()?;
            if stream {
                let _ = stdout.write_all(rest.as_bytes());
            }
            text.push_str(&rest);
            g
        }
        None => engine.generate(ids, params, &mut |_| ControlFlow::Continue(()))?,
    };
    if stream {
        let _ = stdout.write_all(b"\n");
        let _ = stdout.flush();
    }
    Ok((g, text))
}

/// The `--json` result object.
pub fn result_json(
    engine: &Engine,
    prompt_ids: &[u32],
    g: &Generation,
    text: &str,
) -> serde_json::Value {
    serde_json::json!({
        "model": engine.name(),
        "profile": "exact",
        "page_source": engine.source().describe(),
        "prompt_ids": prompt_ids,
        "ids": g.ids,
        "text": text,
        "finish_reason": g.finish.as_str(),
        "usage": {"prompt_tokens": g.prompt_tokens, "completion_tokens": g.ids.len()},
        "timing": {
            "prefill_secs": g.prefill_secs,
            "decode_secs": g.decode_secs,
            "prefill_tokens_per_sec": g.prefill_tokens_per_sec(),
            "decode_tokens_per_sec": g.decode_tokens_per_sec(),
        },
        "threads": engine.threads(),
        // This process's memory at the end (Linux): private bytes against the
        // daemon's shared arena.
        "memory": crate::memory::snapshot(),
    })
}
