//! What every generating endpoint does between parsing its body and streaming its
//! answer: resolve the model, render the chat through the model's template, tokenize,
//! check the context, pick sampling settings, queue the job.

use std::sync::Arc;
use std::time::Instant;

use libvoom::engine::GenerateParams;
use libvoom::sampler::SamplingParams;
use serde_json::Value;
use tokio::sync::mpsc::UnboundedReceiver;

use super::catalog::ModelMeta;
use super::error::{ApiError, Kind};
use super::worker::{Event, Job};
use super::App;

/// Sampling fields as a request gave them (None: not given).
#[derive(Debug, Clone, Copy, Default)]
pub struct Sampling {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<u64>,
    pub seed: Option<u64>,
}

/// The prompt of a request.
pub enum Prompt<'a> {
    /// Chat messages (JSON objects with `role` and `content`, as chat templates take
    /// them) and the tools offered.
    Chat {
        messages: &'a [Value],
        tools: Option<&'a [Value]>,
    },
    /// Raw text, tokenized with the tokenizer's special tokens (as `voom generate
    /// --prompt` does).
    Text(&'a str),
    /// Token ids.
    Ids(&'a [u32]),
}

/// A request ready to queue.
pub struct Prepared {
    pub meta: Arc<ModelMeta>,
    pub prompt_ids: Vec<u32>,
    pub params: GenerateParams,
    pub stop: Vec<String>,
}

/// Resolves the model, renders and tokenizes the prompt and checks it against the
/// context, before any model work. Blocking (reads tokenizer files the first time).
pub fn prepare(
    app: &App,
    model: &str,
    prompt: Prompt<'_>,
    max_tokens: Option<u64>,
    sampling: Sampling,
    stop: Vec<String>,
) -> Result<Prepared, ApiError> {
    let meta = app.catalog.get(model)?;
    let tok = meta.tokenizer.as_ref().ok_or_else(|| {
        ApiError::invalid(
            "model",
            format!("model '{model}' has no tokenizer.json, so it cannot take text"),
        )
    })?;
    let prompt_ids = match prompt {
        Prompt::Chat { messages, tools } => {
            let tpl = tok.chat_template_for(tools.is_some()).ok_or_else(|| {
                ApiError::invalid(
                    "messages",
                    format!("model '{model}' has no chat template: use /v1/completions"),
                )
            })?;
            let text = tpl
                .render(messages, tools, true, None)
                .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
            tok.encode(&text, false)
                .map_err(|e| ApiError::internal(format!("tokenizing the prompt: {e}")))?
        }
        Prompt::Text(t) => tok
            .encode(t, true)
            .map_err(|e| ApiError::internal(format!("tokenizing the prompt: {e}")))?,
        Prompt::Ids(ids) => {
            let vocab = tok.vocab_size() as u32;
            if let Some(bad) = ids.iter().find(|&&i| i >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("token id {bad} is outside the vocabulary of {vocab}"),
                ));
            }
            ids.to_vec()
        }
    };
    if prompt_ids.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    if prompt_ids.len() >= meta.max_context {
        return Err(ApiError::invalid(
            "messages",
            format!(
                "the prompt is {} tokens; the context limit of '{model}' is {} (prompt and output together)",
                prompt_ids.len(),
                meta.max_context
            ),
        ));
    }
    let room = (meta.max_context - prompt_ids.len()) as u64;
    let max_new_tokens = max_tokens.unwrap_or(room).min(room) as usize;
    let d = &meta.sampling_defaults;
    let temperature = sampling.temperature.unwrap_or(d.temperature) as f32;
    let params = GenerateParams {
        max_new_tokens,
        sampling: SamplingParams {
            temperature,
            top_p: sampling.top_p.unwrap_or(d.top_p) as f32,
            top_k: sampling.top_k.map_or(d.top_k, |k| k as usize),
            seed: sampling.seed.unwrap_or_else(rand::random),
        },
        ..Default::default()
    };
    params
        .sampling
        .validate()
        .map_err(|e| ApiError::invalid("temperature", e))?;
    Ok(Prepared {
        meta,
        prompt_ids,
        params,
        stop,
    })
}

/// Queues a prepared request; its events arrive on the returned receiver. Dropping
/// the receiver cancels it.
pub fn start(app: &App, p: &Prepared) -> Result<UnboundedReceiver<Event>, ApiError> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    app.worker.submit(Job {
        meta: Arc::clone(&p.meta),
        prompt: p.prompt_ids.clone(),
        params: p.params.clone(),
        stop: p.stop.clone(),
        events: tx,
        enqueued: Instant::now(),
    })?;
    Ok(rx)
}

/// Runs blocking preparation off the async threads.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(ApiError::new(
            Kind::Internal,
            format!("request failed: {e}"),
        ))
    })
}

/// Seconds since the epoch.
pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A random id with a prefix ("chatcmpl-", "msg_", ...).
pub fn new_id(prefix: &str) -> String {
    format!("{prefix}{:024x}", rand::random::<u128>() >> 32)
}
