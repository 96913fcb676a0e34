//! What every generating endpoint does between parsing its body and streaming its
//! answer: resolve the model, render the chat through the model's template, tokenize,
//! check the context, compile the output's grammar (tool calls, response format),
//! pick sampling settings, queue the job.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use libvoom::config::ModelConfig;
use libvoom::constrain::{Grammar, GrammarCompiler, JsonValidator};
use libvoom::engine::GenerateParams;
use libvoom::sampler::SamplingParams;
use libvoom::text::Tokenizer;
use serde_json::Value;
use tokio::sync::mpsc::UnboundedReceiver;

use super::app::App;
use super::catalog::ModelMeta;
use super::error::{ApiError, Kind};
use super::harmony::{Harmony, HarmonyOutput};
use super::job::{Event, Job, OutputGrammar, Prepared};
use super::tools::{ResponseFormat, ToolFormat, ToolParser, ToolRequest};

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
    /// them) and the tools offered: rendered through the template
    /// ([`ToolRequest::template_tools`]), and, unless the choice is none, parsed from
    /// the output (auto) or forced by a grammar (required, named).
    Chat {
        messages: &'a [Value],
        tools: Option<&'a ToolRequest>,
    },
    /// Raw text, tokenized with the tokenizer's special tokens (as `voom generate
    /// --prompt` does).
    Text(&'a str),
    /// Token ids.
    Ids(&'a [u32]),
}

/// What every dialect asks of the engine, once its body is read: the core request.
pub struct GenerateRequest<'a> {
    /// The model's id in the catalog.
    pub model: &'a str,
    pub prompt: Prompt<'a>,
    /// At most this many new tokens (None: up to the context).
    pub max_tokens: Option<u64>,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    pub response_format: Option<&'a ResponseFormat>,
    /// How hard a reasoning model thinks (`low`, `medium`, `high`), passed to the
    /// chat template as `reasoning_effort`, with the request field it came from.
    /// A model without a reasoning format refuses it (400 naming the field).
    pub reasoning_effort: Option<(&'a str, &'static str)>,
    /// The request asks for reasoning (Anthropic's `thinking` enabled): the field,
    /// refused (400) for a model without a reasoning format.
    pub wants_reasoning: Option<&'static str>,
    /// A Lark grammar the output must follow (vLLM's `structured_outputs.grammar`,
    /// `guided_grammar`), with the request field it came from; not combined with a
    /// response format or forced tool calls.
    pub grammar: Option<(&'a str, &'static str)>,
}

/// The reasoning efforts of gpt-oss (harmony's `Reasoning:` line).
pub const REASONING_EFFORTS: [&str; 3] = ["low", "medium", "high"];

impl<'a> GenerateRequest<'a> {
    /// A request with nothing but its model, prompt, limit and sampling.
    pub fn new(
        model: &'a str,
        prompt: Prompt<'a>,
        max_tokens: Option<u64>,
        sampling: Sampling,
    ) -> Self {
        GenerateRequest {
            model,
            prompt,
            max_tokens,
            sampling,
            stop: Vec::new(),
            response_format: None,
            reasoning_effort: None,
            wants_reasoning: None,
            grammar: None,
        }
    }
}

/// Whether `model` writes a reasoning format (harmony): resolves the model, reads
/// its tokenizer. For dialects whose answer's shape depends on it before preparing.
pub fn harmony_of(app: &App, model: &str) -> Result<Option<Harmony>, ApiError> {
    let meta = app.catalog.get(model)?;
    let tok = meta.text_tokenizer()?;
    Ok(tok
        .chat_template()
        .and_then(|t| Harmony::detect(t.source(), tok)))
}

/// Resolves the model, renders and tokenizes the prompt, checks it against the
/// context and compiles the output's grammar, before any model work (a bad schema
/// is a 400 here). Blocking (reads tokenizer files the first time, builds the
/// model's grammar compiler the first time a grammar is needed).
///
/// Grammars: `tool_choice` required or named forces calls in the template's
/// [`ToolFormat`] (the response format then has nothing to apply to: the output is
/// calls only); auto with a JSON response format allows either that JSON or calls;
/// otherwise a JSON response format constrains the whole output.
pub fn prepare(app: &App, req: GenerateRequest<'_>) -> Result<Prepared, ApiError> {
    let GenerateRequest {
        model,
        prompt,
        max_tokens,
        sampling,
        stop,
        response_format,
        reasoning_effort,
        wants_reasoning,
        grammar: user_grammar,
    } = req;
    let meta = app.catalog.get(model)?;
    let tok = meta.text_tokenizer()?;
    let response_format = response_format.filter(|f| **f != ResponseFormat::Text);
    let mut tool_parser = None;
    let mut harmony_out = None;
    let mut lark = None;
    let prompt_param = match prompt {
        Prompt::Chat { .. } => "messages",
        Prompt::Text(_) | Prompt::Ids(_) => "prompt",
    };
    let prompt_ids = match prompt {
        Prompt::Chat { messages, tools } => {
            let template_tools = tools.and_then(ToolRequest::template_tools);
            let tpl = tok
                .chat_template_for(template_tools.is_some())
                .ok_or_else(|| {
                    ApiError::invalid(
                        "messages",
                        format!("model '{model}' has no chat template: use /v1/completions"),
                    )
                })?;
            let harmony = Harmony::detect(tpl.source(), tok);
            let mut template_tools = template_tools;
            if let Some(h) = &harmony {
                // gpt-oss's template writes every tool's description (`"// " +
                // tool.description`), which fails on a tool without one.
                for t in template_tools.iter_mut().flatten() {
                    if let Some(f) = t["function"].as_object_mut() {
                        f.entry("description").or_insert_with(|| "".into());
                    }
                }
                let active = tools.filter(|t| t.is_active());
                let answer = match response_format {
                    Some(f) => f.lark_json_body("response_format")?,
                    None => None,
                };
                match (active.and_then(ToolRequest::forced), active) {
                    (Some(forced), _) => lark = Some(h.calls_grammar(&forced, None)?),
                    (None, Some(req)) if answer.is_some() => {
                        let all: Vec<_> = req.tools.iter().collect();
                        lark = Some(h.calls_grammar(&all, answer.as_deref())?);
                    }
                    (None, _) => lark = answer.map(|a| h.answer_grammar(&a)),
                }
                harmony_out = Some(HarmonyOutput {
                    tools: active.map(|t| t.tools.clone()).unwrap_or_default(),
                    forced: active.is_some_and(|t| t.forced().is_some()),
                });
            } else if let Some(req) = tools.filter(|t| t.is_active()) {
                let format = ToolFormat::detect(tpl.source());
                let answer = match response_format {
                    Some(f) => f.lark_json_body("response_format")?,
                    None => None,
                };
                if let Some(forced) = req.forced() {
                    lark = Some(format.grammar_text(&forced, req.parallel, tok, None)?);
                } else if let Some(a) = answer {
                    let all: Vec<_> = req.tools.iter().collect();
                    lark = Some(format.grammar_text(&all, req.parallel, tok, Some(&a))?);
                }
                tool_parser = Some(ToolParser {
                    format,
                    tools: req.tools.clone(),
                    parallel: req.parallel,
                    forced: req.forced().is_some(),
                });
            }
            if let Some(param) = wants_reasoning.filter(|_| harmony.is_none()) {
                return Err(no_reasoning(model, param));
            }
            let mut extra = serde_json::Map::new();
            if let Some((effort, param)) = reasoning_effort {
                if harmony.is_none() {
                    return Err(no_reasoning(model, param));
                }
                if !REASONING_EFFORTS.contains(&effort) {
                    return Err(ApiError::invalid(
                        param,
                        format!(
                            "'{effort}' is not a reasoning effort of '{model}': low, medium or high"
                        ),
                    ));
                }
                extra.insert("reasoning_effort".into(), effort.into());
            }
            let text = tpl
                .render(
                    messages,
                    template_tools.as_deref(),
                    true,
                    (!extra.is_empty()).then_some(&extra),
                )
                .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
            encode_within(tok, &text, false, &meta, prompt_param)?
        }
        Prompt::Text(_) | Prompt::Ids(_)
            if reasoning_effort.is_some() || wants_reasoning.is_some() =>
        {
            let param = reasoning_effort
                .map(|(_, p)| p)
                .or(wants_reasoning)
                .unwrap_or("reasoning");
            return Err(ApiError::invalid(
                param,
                "reasoning settings apply to chat messages, rendered through the model's template",
            ));
        }
        Prompt::Text(t) => encode_within(tok, t, true, &meta, prompt_param)?,
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
        return Err(too_long(&meta, prompt_param, prompt_ids.len(), ""));
    }
    // The grammar: forced calls, calls or the answer, or the answer alone.
    let forced_tools = tool_parser.as_ref().is_some_and(|t| t.forced)
        || harmony_out.as_ref().is_some_and(|h| h.forced);
    // A stop sequence matching inside a JSON answer would cut it (`{"`) and end it
    // as `stop`, which a client cannot tell from a complete answer: the two are not
    // combined (docs/server.md). Forced tool calls ignore stop sequences (they cut
    // text only), so an agent loop's stops stay allowed with tools.
    if !stop.is_empty() && response_format.is_some() {
        return Err(ApiError::invalid(
            "stop",
            "stop sequences cannot be combined with a JSON response format: a stop \
             sequence inside the JSON would cut it short where it looks complete",
        ));
    }
    let mut user_param = None;
    if let Some((g, param)) = user_grammar {
        if forced_tools || response_format.is_some() {
            return Err(ApiError::invalid(
                param,
                "a grammar cannot be combined with a JSON response format or a forced tool call (tool_choice required or named)",
            ));
        }
        lark = Some(g.to_string());
        user_param = Some(param);
    }
    let grammar = match (lark, response_format) {
        (Some(l), _) => Some(Grammar::lark(&l)),
        // (With tools active, `lark` is set whenever a response format is.)
        (None, Some(f)) => f.grammar("response_format")?,
        (None, None) => None,
    };
    let json_schema = if forced_tools {
        None
    } else {
        response_format.and_then(ResponseFormat::schema)
    };
    // Everything the output is checked with is compiled now, so what the grammar
    // library or the validator refuses is a 400 before any model work.
    let json_schema = json_schema
        .map(|s| {
            JsonValidator::new(&s).map_err(|e| ApiError::invalid("response_format", e.to_string()))
        })
        .transpose()?;
    let tools_active =
        tool_parser.is_some() || harmony_out.as_ref().is_some_and(|h| !h.tools.is_empty());
    let param = if let Some(p) = user_param {
        p
    } else if tools_active && response_format.is_none() {
        "tools"
    } else {
        "response_format"
    };
    let grammar = match grammar {
        None => None,
        Some(g) => {
            let compiler = compiler_for(&meta, tok)?;
            let matcher = compiler
                .compile(&g)
                .and_then(|c| c.checked_matcher())
                .map_err(|e| ApiError::invalid(param, e.to_string()))?;
            Some(OutputGrammar {
                matcher,
                eos: compiler.eos_ids().to_vec(),
                param,
            })
        }
    };
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
        grammar,
        tools: tool_parser,
        json_schema,
        harmony: harmony_out,
    })
}

fn no_reasoning(model: &str, param: &str) -> ApiError {
    ApiError::invalid(
        param,
        format!(
            "'{param}' is not supported: model '{model}' has no reasoning format (reasoning is read from harmony models, gpt-oss)"
        ),
    )
}

/// `text`'s token ids, if they fit the context of `meta`: a text whose length alone
/// shows that it cannot ([`Tokenizer::min_tokens`]) is refused before it is
/// tokenized, which would cost seconds and gigabytes for a text of megabytes.
pub fn encode_within(
    tok: &Tokenizer,
    text: &str,
    add_special_tokens: bool,
    meta: &ModelMeta,
    param: &str,
) -> Result<Vec<u32>, ApiError> {
    let lower = tok.min_tokens(text);
    if lower >= meta.max_context {
        return Err(too_long(meta, param, lower, "at least "));
    }
    tok.encode(text, add_special_tokens)
        .map_err(|e| ApiError::internal(format!("tokenizing the prompt: {e}")))
}

fn too_long(meta: &ModelMeta, param: &str, tokens: usize, at_least: &str) -> ApiError {
    ApiError::invalid(
        param,
        format!(
            "the prompt is {at_least}{tokens} tokens; the context limit of '{}' is {} (prompt and output together)",
            meta.id, meta.max_context
        ),
    )
}

/// The grammar compiler of a model (its tokenizer, vocabulary width and
/// end-of-sequence ids), built once per checkpoint and kept.
fn compiler_for(meta: &ModelMeta, tok: &Tokenizer) -> Result<Arc<GrammarCompiler>, ApiError> {
    static COMPILERS: Mutex<Option<HashMap<String, Arc<GrammarCompiler>>>> = Mutex::new(None);
    let key = format!("{}#{}", meta.dir.display(), meta.checkpoint_digest);
    if let Some(c) = COMPILERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .get(&key)
    {
        return Ok(Arc::clone(c));
    }
    let bad = |e: &dyn std::fmt::Display| {
        ApiError::internal(format!("model '{}' cannot take grammars: {e}", meta.id))
    };
    let cfg = ModelConfig::from_dir(&meta.dir).map_err(|e| bad(&e))?;
    let eos = libvoom::engine::eos_ids(&meta.dir, &cfg, Some(tok));
    let c = GrammarCompiler::shared(tok, cfg.vocab_size, &eos).map_err(|e| bad(&e))?;
    COMPILERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(key, Arc::clone(&c));
    Ok(c)
}

/// Queues a prepared request; its events arrive on the returned receiver. Dropping
/// the receiver cancels it.
pub fn start(app: &App, p: Prepared) -> Result<UnboundedReceiver<Event>, ApiError> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    app.worker.submit(Job {
        request: p,
        events: tx,
        enqueued: Instant::now(),
    })?;
    Ok(rx)
}

/// Runs blocking preparation off the async threads, at most
/// [`App::prepare_slots`] at once.
pub async fn blocking<T: Send + 'static>(
    app: &App,
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let slot = Arc::clone(&app.prepare_slots)
        .acquire_owned()
        .await
        .map_err(|_| ApiError::internal("the server is shutting down"))?;
    tokio::task::spawn_blocking(move || {
        let _slot = slot;
        f()
    })
    .await
    .unwrap_or_else(|e| {
        Err(ApiError::new(
            Kind::Internal,
            format!("request failed: {e}"),
        ))
    })
}
