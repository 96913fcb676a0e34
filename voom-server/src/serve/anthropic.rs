//! Anthropic's Messages API: `POST /v1/messages`, streaming (SSE events in
//! Anthropic's order) and not, with tools.
//!
//! Request: `model`, `max_tokens` (required), `messages` (user/assistant; content a
//! string or `text`, `tool_use` and `tool_result` blocks), `system` (string or text
//! blocks), `stop_sequences`, `temperature` (0..1), `top_p`, `top_k`, `stream`,
//! `metadata` (checked, no effect), `tools` and `tool_choice`, `output_config.format`
//! (JSON schema output), `service_tier` (one tier here: accepted), `cache_control`
//! (caching hints: accepted, no effect on output). vOOM extensions: `seed`, and a
//! Lark grammar for the output (vLLM's `structured_outputs.grammar` or
//! `guided_grammar`).
//!
//! Reasoning models (harmony: gpt-oss): `thinking` enabled (`budget_tokens` at least
//! 1024 and below `max_tokens`, as Anthropic checks it; the budget does not bound the
//! reasoning) or adaptive returns the reasoning as a `thinking` block (its
//! `signature` the thinking's blake3), streamed as `thinking_delta` and
//! `signature_delta`; disabled or absent leaves it out (the model reasons anyway).
//! `output_config.effort` (low, medium, high) goes to the template as
//! `reasoning_effort`. `thinking` blocks in the history become the assistant turn's
//! `thinking` (`redacted_thinking` is dropped: nothing here can read it). A model
//! without a reasoning format refuses `thinking` enabled and `output_config.effort`.
//! Refused with 400: images and documents (the models take text), MCP servers,
//! containers, context management, fast mode, a prefill on a harmony model, and any
//! field Anthropic's API does not define (as Anthropic does).
//!
//! A last assistant message is a prefill: the answer continues its text (Anthropic's
//! behaviour); the response holds only the continuation. Its text may not end with
//! whitespace (as Anthropic requires), and it cannot be combined with tools or an
//! output format (the tool parser and grammars see the whole answer).
//!
//! Consecutive messages of one role are rendered as separate turns, as the chat
//! template writes them. A `tool_result` becomes a `tool` message (with the tool's
//! `name` looked up from the `tool_use` it answers, and `is_error` passed to the
//! template, which may use it); `tool_use` blocks become the assistant message's
//! `tool_calls`.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use super::error::{ApiError, Dialect};
use super::ids::new_id;
use super::job::{Event, Finish, Outcome, Prepared};
use super::prepare::{self, blocking, GenerateRequest, Prompt, Sampling};
use super::request::{user_grammar, wrong, Body};
use super::stream;
use super::tools::{ResponseFormat, ToolChoice, ToolRequest, ToolSpec};
use super::App;

/// Fields this endpoint reads. Any other field is refused, as Anthropic does.
const KNOWN: &[&str] = &[
    "model",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "metadata",
    "tools",
    "tool_choice",
    "output_config",
    "service_tier",
    "cache_control",
    "thinking",
    "seed",
    "structured_outputs",
    "guided_grammar",
];

/// Fields Anthropic defines that change behaviour vOOM does not have: refused unless
/// absent or null.
const REFUSED: &[(&str, &str)] = &[
    ("container", "code execution containers are not available"),
    ("mcp_servers", "MCP servers are not available"),
    ("context_management", "context management is not available"),
    (
        "inference_geo",
        "there is one place of inference: this machine",
    ),
    ("diagnostics", "diagnostics are not available"),
    ("user_profile_id", "user profiles are not available"),
    ("workspace_id", "workspaces are not available"),
];

/// Stop sequences accepted per request.
const MAX_STOP_SEQUENCES: usize = 32;

/// A Messages request, parsed and checked.
#[derive(Debug)]
pub struct MessagesRequest {
    pub model: String,
    pub max_tokens: u64,
    /// Messages as chat templates take them (system first, if any), without the
    /// prefill.
    pub messages: Vec<Value>,
    /// The text of a final assistant message, which the answer continues.
    pub prefill: Option<String>,
    pub stream: bool,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    pub tools: Option<ToolRequest>,
    pub format: Option<ResponseFormat>,
    /// `thinking` enabled: the answer holds `thinking` blocks (a reasoning model's
    /// reasoning; refused for a model without a reasoning format).
    pub thinking: bool,
    /// `output_config.effort`, for a reasoning model's template.
    pub effort: Option<String>,
    /// A Lark grammar for the output (vOOM extension: vLLM's `structured_outputs`).
    pub grammar: Option<(String, &'static str)>,
}

/// Reads a Messages request body. Errors name the field at fault.
pub fn parse(b: &Body) -> Result<MessagesRequest, ApiError> {
    for (key, why) in REFUSED {
        b.refuse(key, &[], why)?;
    }
    if let Some(key) = b
        .obj
        .keys()
        .find(|k| !KNOWN.contains(&k.as_str()) && !REFUSED.iter().any(|(r, _)| r == k))
    {
        return Err(ApiError::invalid(
            key,
            format!("{key}: Extra inputs are not permitted"),
        ));
    }
    let model = b.required_str("model")?.to_string();
    let max_tokens = b
        .u64_in("max_tokens", 1, u32::MAX as u64)?
        .ok_or_else(|| ApiError::invalid("max_tokens", "'max_tokens' is required"))?;
    let stream = b.bool("stream")?.unwrap_or(false);
    let sampling = Sampling {
        temperature: b.f64_in("temperature", 0.0, 1.0)?,
        top_p: b.f64_above("top_p", 0.0, 1.0)?,
        top_k: b.u64_in("top_k", 0, u32::MAX as u64)?,
        seed: b.u64_in("seed", 0, u64::MAX)?,
    };
    let stop = b.stop_list("stop_sequences", MAX_STOP_SEQUENCES)?;
    if let Some(v) = b.get("stop_sequences") {
        if !v.is_array() {
            return Err(wrong("stop_sequences", "a list of strings", v));
        }
    }
    match b.get("metadata") {
        None | Some(Value::Object(_)) => {}
        Some(v) => return Err(wrong("metadata", "an object", v)),
    }
    match b.get("service_tier") {
        None => {}
        Some(Value::String(s)) if s == "auto" || s == "standard_only" => {}
        Some(v) => {
            return Err(ApiError::invalid(
                "service_tier",
                format!("'service_tier' must be \"auto\" or \"standard_only\", not {v}"),
            ))
        }
    }
    match b.get("cache_control") {
        None | Some(Value::Object(_)) => {}
        Some(v) => return Err(wrong("cache_control", "an object", v)),
    }
    let thinking = thinking(b, max_tokens)?;
    let (format, effort) = output_format(b)?;
    let grammar = user_grammar(b)?;
    let tools = tool_request(b)?;
    let mut messages = Vec::new();
    if let Some(s) = system(b)? {
        messages.push(json!({"role": "system", "content": s}));
    }
    let prefill = convert_messages(b, &mut messages)?;
    if prefill.is_some() && (tools.as_ref().is_some_and(ToolRequest::is_active) || format.is_some())
    {
        return Err(ApiError::invalid(
            "messages",
            "a final assistant message (prefill) cannot be combined with tools or an output format",
        ));
    }
    if format.is_some() && !stop.is_empty() {
        // As in prepare (which would name OpenAI's `stop`): a stop sequence would
        // cut the JSON where it looks complete.
        return Err(ApiError::invalid(
            "stop_sequences",
            "'stop_sequences' cannot be combined with a JSON output format: a stop \
             sequence inside the JSON would cut it short where it looks complete",
        ));
    }
    Ok(MessagesRequest {
        model,
        max_tokens,
        messages,
        prefill,
        stream,
        sampling,
        stop,
        tools,
        format,
        thinking,
        effort,
        grammar,
    })
}

/// `thinking`: enabled (with `budget_tokens` of at least 1024 and below
/// `max_tokens`, as Anthropic checks them) or adaptive: true; disabled or absent:
/// false. Whether the model can think is known when the request is prepared.
fn thinking(b: &Body, max_tokens: u64) -> Result<bool, ApiError> {
    let o = match b.get("thinking") {
        None | Some(Value::Null) => return Ok(false),
        Some(Value::Object(o)) => o,
        Some(v) => return Err(wrong("thinking", "an object", v)),
    };
    match o.get("type").and_then(Value::as_str) {
        Some("disabled") => Ok(false),
        Some("adaptive") => Ok(true),
        Some("enabled") => match o.get("budget_tokens") {
            Some(Value::Number(n)) => match n.as_u64() {
                Some(t) if t < 1024 => Err(ApiError::invalid(
                    "thinking.budget_tokens",
                    "'thinking.budget_tokens' must be at least 1024",
                )),
                Some(t) if t >= max_tokens => Err(ApiError::invalid(
                    "thinking.budget_tokens",
                    format!("'thinking.budget_tokens' must be less than max_tokens ({max_tokens})"),
                )),
                Some(_) => Ok(true),
                None => Err(wrong(
                    "thinking.budget_tokens",
                    "an integer",
                    &Value::Number(n.clone()),
                )),
            },
            Some(v) => Err(wrong("thinking.budget_tokens", "an integer", v)),
            None => Err(ApiError::invalid(
                "thinking.budget_tokens",
                "'thinking.budget_tokens' is required when thinking is enabled",
            )),
        },
        _ => Err(ApiError::invalid(
            "thinking.type",
            "'thinking.type' must be \"enabled\", \"adaptive\" or \"disabled\"",
        )),
    }
}

/// `output_config`: `format` (JSON schema output), and `effort` (a reasoning
/// model's `reasoning_effort`; refused when prepared for a model without a
/// reasoning format).
fn output_format(b: &Body) -> Result<(Option<ResponseFormat>, Option<String>), ApiError> {
    let o = match b.get("output_config") {
        None => return Ok((None, None)),
        Some(Value::Object(o)) => o,
        Some(v) => return Err(wrong("output_config", "an object", v)),
    };
    let mut effort = None;
    for key in o.keys() {
        match key.as_str() {
            "format" => {}
            "effort" => match &o[key] {
                Value::Null => {}
                Value::String(e) => effort = Some(e.clone()),
                v => return Err(wrong("output_config.effort", "a string", v)),
            },
            other => {
                return Err(ApiError::invalid(
                    &format!("output_config.{other}"),
                    format!("output_config.{other}: Extra inputs are not permitted"),
                ))
            }
        }
    }
    let f = match o.get("format") {
        None | Some(Value::Null) => return Ok((None, effort)),
        Some(Value::Object(f)) => f,
        Some(v) => return Err(wrong("output_config.format", "an object", v)),
    };
    match f.get("type").and_then(Value::as_str) {
        Some("json_schema") => {}
        _ => {
            return Err(ApiError::invalid(
                "output_config.format.type",
                "'output_config.format.type' must be \"json_schema\"",
            ))
        }
    }
    match f.get("schema") {
        Some(s @ Value::Object(_)) => Ok((
            Some(ResponseFormat::JsonSchema {
                name: "output".into(),
                schema: s.clone(),
                strict: true,
            }),
            effort,
        )),
        Some(v) => Err(wrong("output_config.format.schema", "an object", v)),
        None => Err(ApiError::invalid(
            "output_config.format.schema",
            "'output_config.format.schema' is required",
        )),
    }
}

/// `tools` and `tool_choice` as a [`ToolRequest`]; None when no tools are given.
fn tool_request(b: &Body) -> Result<Option<ToolRequest>, ApiError> {
    let list = match b.get("tools") {
        None => vec![],
        Some(Value::Array(a)) => a.clone(),
        Some(v) => return Err(wrong("tools", "an array", v)),
    };
    let mut specs = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let at = format!("tools[{i}]");
        let Value::Object(o) = t else {
            return Err(wrong(&at, "an object", t));
        };
        match o.get("type") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "custom" => {}
            Some(Value::String(s)) => {
                return Err(ApiError::invalid(
                    &format!("{at}.type"),
                    format!("server tools ('{s}') are not available: give client tools with 'name' and 'input_schema'"),
                ))
            }
            Some(v) => return Err(wrong(&format!("{at}.type"), "a string", v)),
        }
        let name = match o.get("name") {
            Some(Value::String(s)) => s.clone(),
            Some(v) => return Err(wrong(&format!("{at}.name"), "a string", v)),
            None => {
                return Err(ApiError::invalid(
                    &format!("{at}.name"),
                    "every tool needs a 'name'",
                ))
            }
        };
        let description = match o.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(v) => return Err(wrong(&format!("{at}.description"), "a string", v)),
        };
        let parameters = match o.get("input_schema") {
            Some(s @ Value::Object(_)) => s.clone(),
            Some(v) => return Err(wrong(&format!("{at}.input_schema"), "an object", v)),
            None => {
                return Err(ApiError::invalid(
                    &format!("{at}.input_schema"),
                    format!("tool '{name}' needs an 'input_schema'"),
                ))
            }
        };
        specs.push(ToolSpec {
            name,
            description,
            parameters,
        });
    }
    let (choice, parallel) = match b.get("tool_choice") {
        None => (ToolChoice::Auto, true),
        Some(Value::Object(o)) => {
            let disable = match o.get("disable_parallel_tool_use") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(x)) => *x,
                Some(v) => {
                    return Err(wrong(
                        "tool_choice.disable_parallel_tool_use",
                        "a boolean",
                        v,
                    ))
                }
            };
            let choice = match o.get("type").and_then(Value::as_str) {
                Some("auto") => ToolChoice::Auto,
                Some("any") => ToolChoice::Required,
                Some("none") => ToolChoice::None,
                Some("tool") => match o.get("name") {
                    Some(Value::String(n)) => ToolChoice::Named(n.clone()),
                    _ => {
                        return Err(ApiError::invalid(
                            "tool_choice.name",
                            "tool_choice of type 'tool' needs the tool's 'name'",
                        ))
                    }
                },
                _ => {
                    return Err(ApiError::invalid(
                        "tool_choice.type",
                        "'tool_choice.type' must be one of auto, any, tool, none",
                    ))
                }
            };
            (choice, !disable)
        }
        Some(v) => return Err(wrong("tool_choice", "an object", v)),
    };
    if specs.is_empty() && b.get("tool_choice").is_none() {
        return Ok(None);
    }
    ToolRequest::new(specs, choice, parallel, "tools").map(Some)
}

/// The system prompt: a string or a list of text blocks (joined by newlines).
fn system(b: &Body) -> Result<Option<String>, ApiError> {
    match b.get("system") {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(blocks)) => Ok(Some(text_blocks(blocks, "system")?)),
        Some(v) => Err(wrong("system", "a string or a list of text blocks", v)),
    }
}

/// The text of a list of blocks that may only be text blocks.
fn text_blocks(blocks: &[Value], at: &str) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(blocks.len());
    for (j, blk) in blocks.iter().enumerate() {
        let here = format!("{at}[{j}]");
        match block_type(blk, &here)? {
            "text" => texts.push(block_text(blk, &here)?),
            other => return Err(unsupported_block(other, &here)),
        }
    }
    Ok(texts.join("\n"))
}

fn block_type<'a>(blk: &'a Value, at: &str) -> Result<&'a str, ApiError> {
    match blk {
        Value::Object(o) => match o.get("type") {
            Some(Value::String(t)) => Ok(t),
            Some(v) => Err(wrong(&format!("{at}.type"), "a string", v)),
            None => Err(ApiError::invalid(
                &format!("{at}.type"),
                "every content block needs a 'type'",
            )),
        },
        v => Err(wrong(at, "an object", v)),
    }
}

fn block_text(blk: &Value, at: &str) -> Result<String, ApiError> {
    match blk.get("text") {
        Some(Value::String(t)) => Ok(t.clone()),
        Some(v) => Err(wrong(&format!("{at}.text"), "a string", v)),
        None => Err(ApiError::invalid(
            &format!("{at}.text"),
            "a text block needs 'text'",
        )),
    }
}

fn unsupported_block(ty: &str, at: &str) -> ApiError {
    let why = match ty {
        "image" | "document" | "search_result" => "these models take text only".to_string(),
        "thinking" | "redacted_thinking" => {
            "thinking blocks belong in assistant messages".to_string()
        }
        _ => format!("content blocks of type '{ty}' are not supported here"),
    };
    ApiError::invalid(
        &format!("{at}.type"),
        format!("content blocks of type '{ty}' are not supported: {why}"),
    )
}

/// Converts `messages` to chat-template messages, appended to `out`. Returns the
/// text of a final assistant message (a prefill), which is not appended.
fn convert_messages(b: &Body, out: &mut Vec<Value>) -> Result<Option<String>, ApiError> {
    let msgs = match b.get("messages") {
        None => return Err(ApiError::invalid("messages", "'messages' is required")),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(wrong("messages", "an array", v)),
    };
    if msgs.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "'messages' must not be empty",
        ));
    }
    // Tool names by tool_use id, for the tool messages that answer them.
    let mut tool_names: Map<String, Value> = Map::new();
    let mut prefill = None;
    for (i, m) in msgs.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Value::Object(o) = m else {
            return Err(wrong(&at, "an object", m));
        };
        let role = match o.get("role") {
            Some(Value::String(r)) if r == "user" || r == "assistant" => r.as_str(),
            Some(Value::String(r)) => {
                return Err(ApiError::invalid(
                    &format!("{at}.role"),
                    format!(
                    "unknown role '{r}' (user or assistant; the system prompt goes in 'system')"
                ),
                ))
            }
            Some(v) => return Err(wrong(&format!("{at}.role"), "a string", v)),
            None => {
                return Err(ApiError::invalid(
                    &format!("{at}.role"),
                    "every message needs a 'role'",
                ))
            }
        };
        if let Some(k) = o.keys().find(|k| *k != "role" && *k != "content") {
            return Err(ApiError::invalid(
                &format!("{at}.{k}"),
                format!("{at}.{k}: Extra inputs are not permitted"),
            ));
        }
        let last = i + 1 == msgs.len();
        let content_at = format!("{at}.content");
        match (role, o.get("content")) {
            (_, None | Some(Value::Null)) => {
                return Err(ApiError::invalid(
                    &content_at,
                    "every message needs 'content'",
                ))
            }
            ("user", Some(Value::String(s))) => out.push(json!({"role": "user", "content": s})),
            ("assistant", Some(Value::String(s))) if last => prefill = Some(s.clone()),
            ("assistant", Some(Value::String(s))) => {
                out.push(json!({"role": "assistant", "content": s}))
            }
            ("user", Some(Value::Array(blocks))) => {
                user_blocks(blocks, &content_at, &tool_names, out)?
            }
            ("assistant", Some(Value::Array(blocks))) => {
                let (text, calls, thinking) =
                    assistant_blocks(blocks, &content_at, &mut tool_names)?;
                if last && calls.is_empty() && thinking.is_none() {
                    prefill = Some(text.unwrap_or_default());
                } else {
                    let mut msg = Map::new();
                    msg.insert("role".into(), "assistant".into());
                    msg.insert("content".into(), text.map_or(Value::Null, Value::String));
                    if let Some(t) = thinking {
                        msg.insert("thinking".into(), t.into());
                    }
                    if !calls.is_empty() {
                        msg.insert("tool_calls".into(), Value::Array(calls));
                    }
                    out.push(Value::Object(msg));
                }
            }
            (_, Some(v)) => {
                return Err(wrong(
                    &content_at,
                    "a string or a list of content blocks",
                    v,
                ))
            }
        }
    }
    if let Some(p) = &prefill {
        if p.ends_with(char::is_whitespace) {
            return Err(ApiError::invalid(
                &format!("messages[{}].content", msgs.len() - 1),
                "final assistant content cannot end with trailing whitespace",
            ));
        }
        if out.iter().all(|m| m["role"] == "system") {
            return Err(ApiError::invalid(
                "messages",
                "there must be a user message before the final assistant message",
            ));
        }
    }
    // An empty prefill continues nothing: it is an ordinary request.
    Ok(prefill.filter(|p| !p.is_empty()))
}

/// A user message's blocks: text blocks become user messages, `tool_result` blocks
/// tool messages, in their order.
fn user_blocks(
    blocks: &[Value],
    at: &str,
    tool_names: &Map<String, Value>,
    out: &mut Vec<Value>,
) -> Result<(), ApiError> {
    let mut text: Vec<String> = Vec::new();
    let flush = |text: &mut Vec<String>, out: &mut Vec<Value>| {
        if !text.is_empty() {
            out.push(json!({"role": "user", "content": text.join("\n")}));
            text.clear();
        }
    };
    if blocks.is_empty() {
        return Err(ApiError::invalid(at, format!("{at} must not be empty")));
    }
    for (j, blk) in blocks.iter().enumerate() {
        let here = format!("{at}[{j}]");
        match block_type(blk, &here)? {
            "text" => text.push(block_text(blk, &here)?),
            "tool_result" => {
                flush(&mut text, out);
                let id = match blk.get("tool_use_id") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v) => return Err(wrong(&format!("{here}.tool_use_id"), "a string", v)),
                    None => {
                        return Err(ApiError::invalid(
                            &format!("{here}.tool_use_id"),
                            "a tool_result block needs 'tool_use_id'",
                        ))
                    }
                };
                let content = match blk.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => text_blocks(parts, &format!("{here}.content"))?,
                    Some(v) => {
                        return Err(wrong(
                            &format!("{here}.content"),
                            "a string or a list of text blocks",
                            v,
                        ))
                    }
                };
                let is_error = match blk.get("is_error") {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(x)) => *x,
                    Some(v) => return Err(wrong(&format!("{here}.is_error"), "a boolean", v)),
                };
                let mut msg = Map::new();
                msg.insert("role".into(), "tool".into());
                msg.insert("content".into(), content.into());
                if let Some(name) = tool_names.get(&id) {
                    msg.insert("name".into(), name.clone());
                }
                msg.insert("tool_call_id".into(), id.into());
                if is_error {
                    msg.insert("is_error".into(), true.into());
                }
                out.push(Value::Object(msg));
            }
            other => return Err(unsupported_block(other, &here)),
        }
    }
    flush(&mut text, out);
    Ok(())
}

/// An assistant message's text, calls and thinking.
type AssistantBlocks = (Option<String>, Vec<Value>, Option<String>);

/// An assistant message's blocks: its text (None without text blocks), its
/// `tool_use` blocks as template `tool_calls`, and its thinking blocks' text.
fn assistant_blocks(
    blocks: &[Value],
    at: &str,
    tool_names: &mut Map<String, Value>,
) -> Result<AssistantBlocks, ApiError> {
    let mut texts = Vec::new();
    let mut calls = Vec::new();
    let mut thinking = Vec::new();
    for (j, blk) in blocks.iter().enumerate() {
        let here = format!("{at}[{j}]");
        match block_type(blk, &here)? {
            "text" => texts.push(block_text(blk, &here)?),
            // Earlier thinking: the assistant message's `thinking`, which a
            // reasoning model's template renders where it keeps it. The signature
            // is not checked (nothing is kept to check it against).
            "thinking" => match blk.get("thinking") {
                Some(Value::String(t)) => thinking.push(t.clone()),
                Some(v) => return Err(wrong(&format!("{here}.thinking"), "a string", v)),
                None => {
                    return Err(ApiError::invalid(
                        &format!("{here}.thinking"),
                        "a thinking block needs 'thinking'",
                    ))
                }
            },
            // Encrypted thinking of another provider: nothing here can read it.
            "redacted_thinking" => {}
            "tool_use" => {
                let field = |k: &str| match blk.get(k) {
                    Some(Value::String(s)) => Ok(s.clone()),
                    Some(v) => Err(wrong(&format!("{here}.{k}"), "a string", v)),
                    None => Err(ApiError::invalid(
                        &format!("{here}.{k}"),
                        format!("a tool_use block needs '{k}'"),
                    )),
                };
                let id = field("id")?;
                let name = field("name")?;
                let input = match blk.get("input") {
                    Some(v @ Value::Object(_)) => v.clone(),
                    Some(v) => return Err(wrong(&format!("{here}.input"), "an object", v)),
                    None => {
                        return Err(ApiError::invalid(
                            &format!("{here}.input"),
                            "a tool_use block needs 'input'",
                        ))
                    }
                };
                tool_names.insert(id.clone(), name.clone().into());
                calls.push(json!({
                    "id": id,
                    "type": "function",
                    "function": {"name": name, "arguments": input},
                }));
            }
            other => return Err(unsupported_block(other, &here)),
        }
    }
    let text = (!texts.is_empty()).then(|| texts.join("\n"));
    let thinking = (!thinking.is_empty()).then(|| thinking.join("\n"));
    Ok((text, calls, thinking))
}

/// `stop_reason` and `stop_sequence` of an outcome. Output cut at the context's end
/// before `max_tokens` is `model_context_window_exceeded`.
fn stop_reason(o: &Outcome, max_tokens: u64) -> (&'static str, Value) {
    match &o.finish {
        Finish::Eos => ("end_turn", Value::Null),
        Finish::StopSequence(s) => ("stop_sequence", Value::String(s.clone())),
        Finish::ToolCalls => ("tool_use", Value::Null),
        Finish::Length if (o.completion_tokens as u64) < max_tokens => {
            ("model_context_window_exceeded", Value::Null)
        }
        Finish::Length => ("max_tokens", Value::Null),
    }
}

/// Anthropic's tool_use ids start "toolu_".
fn tool_use_id(call_id: &str) -> String {
    format!("toolu_{}", call_id.strip_prefix("call_").unwrap_or(call_id))
}

/// A thinking block's `signature`, which Anthropic's clients require and send back:
/// here the thinking's blake3 digest (nothing is kept between requests, and the
/// history's thinking is rendered as it arrives).
fn signature(thinking: &str) -> String {
    blake3::hash(thinking.as_bytes()).to_hex().to_string()
}

/// The content blocks of an outcome: its reasoning as a thinking block (with
/// `thinking`: the request enabled thinking), its text (if any), then its tool calls.
fn content(o: &Outcome, thinking: bool) -> Vec<Value> {
    let mut blocks = Vec::new();
    if thinking && !o.reasoning.is_empty() {
        blocks.push(json!({
            "type": "thinking", "thinking": o.reasoning, "signature": signature(&o.reasoning),
        }));
    }
    if !o.text.is_empty() {
        blocks.push(json!({"type": "text", "text": o.text}));
    }
    for c in &o.tool_calls {
        blocks.push(json!({
            "type": "tool_use", "id": tool_use_id(&c.id), "name": c.name, "input": c.arguments,
        }));
    }
    blocks
}

/// What the handler does with a body before any model work: parse and check it,
/// then [`prepare::prepare`] it (model, template, prefill, tokens, context, grammar).
/// Blocking.
pub fn prepare_body(app: &App, bytes: &[u8]) -> Result<(Prepared, MessagesRequest), ApiError> {
    let b = Body::parse(bytes)?;
    let r = parse(&b)?;
    let p = match &r.prefill {
        None => prepare::prepare(
            app,
            GenerateRequest {
                stop: r.stop.clone(),
                response_format: r.format.as_ref(),
                reasoning_effort: r.effort.as_deref().map(|e| (e, "output_config.effort")),
                wants_reasoning: r.thinking.then_some("thinking"),
                grammar: r.grammar.as_ref().map(|(g, p)| (g.as_str(), *p)),
                ..GenerateRequest::new(
                    &r.model,
                    Prompt::Chat {
                        messages: &r.messages,
                        tools: r.tools.as_ref(),
                    },
                    Some(r.max_tokens),
                    r.sampling,
                )
            },
        )?,
        Some(prefill) => {
            let ids = prefill_ids(app, &r.model, &r.messages, prefill)?;
            prepare::prepare(
                app,
                GenerateRequest {
                    stop: r.stop.clone(),
                    grammar: r.grammar.as_ref().map(|(g, p)| (g.as_str(), *p)),
                    ..GenerateRequest::new(
                        &r.model,
                        Prompt::Ids(&ids),
                        Some(r.max_tokens),
                        r.sampling,
                    )
                },
            )?
        }
    };
    Ok((p, r))
}

pub async fn messages(State(app): State<Arc<App>>, req: Request) -> Response {
    handle(app, req)
        .await
        .unwrap_or_else(|e| e.in_dialect(Dialect::Anthropic).into_response())
}

async fn handle(app: Arc<App>, req: Request) -> Result<Response, ApiError> {
    let bytes = app.body(req, Dialect::Anthropic).await?;
    let app2 = Arc::clone(&app);
    let (prepared, r) = blocking(&app, move || prepare_body(&app2, &bytes)).await?;
    let meta = Arc::clone(&prepared.meta);
    let prompt_tokens = prepared.prompt_ids.len();
    let harmony = prepared.harmony.is_some();
    let rx = prepare::start(&app, prepared)?;
    let id = new_id("msg_");
    let provenance = app.provenance_json(&meta);
    let mut resp = if r.stream {
        // Blocks open with their first piece where the output may begin otherwise
        // than with text (calls, a reasoning model's thinking).
        let lazy = r.tools.as_ref().is_some_and(ToolRequest::is_active) || harmony;
        stream_response(
            rx,
            id,
            meta.id.clone(),
            prompt_tokens,
            r.max_tokens,
            lazy,
            r.thinking,
            provenance,
        )
    } else {
        let o = stream::collect(rx).await?;
        let (reason, seq) = stop_reason(&o, r.max_tokens);
        let mut provenance = provenance;
        provenance["timings"] = o.timings();
        Json(json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": meta.id,
            "content": content(&o, r.thinking),
            "stop_reason": reason,
            "stop_sequence": seq,
            "usage": {"input_tokens": o.prompt_tokens, "output_tokens": o.completion_tokens},
            "voom": provenance,
        }))
        .into_response()
    };
    app.provenance(&meta, &mut resp);
    Ok(resp)
}

/// The prompt of a prefilled answer: the conversation before the final assistant
/// message, with the generation prompt, then the prefill's text.
fn prefill_ids(
    app: &App,
    model: &str,
    messages: &[Value],
    prefill: &str,
) -> Result<Vec<u32>, ApiError> {
    let meta = app.catalog.get(model)?;
    let tok = meta.text_tokenizer()?;
    let tpl = tok.chat_template_for(false).ok_or_else(|| {
        ApiError::invalid("messages", format!("model '{model}' has no chat template"))
    })?;
    if super::harmony::Harmony::detect(tpl.source(), tok).is_some() {
        return Err(ApiError::invalid(
            "messages",
            format!(
                "model '{model}' writes harmony (gpt-oss): a final assistant message (prefill) is not continued; end the conversation with a user or tool turn"
            ),
        ));
    }
    let mut text = tpl
        .render(messages, None, true, None)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    text.push_str(prefill);
    prepare::encode_within(tok, &text, false, &meta, "messages")
}

fn event(name: &str, data: Value) -> SseEvent {
    SseEvent::default().event(name).data(data.to_string())
}

/// The event stream: `message_start`, then content blocks (`content_block_start`,
/// `content_block_delta`..., `content_block_stop`), `message_delta` with the stop
/// reason and usage, `message_stop`; a `ping` after the first block's start, as
/// Anthropic sends it. Without tools the text block opens at once; with tools the
/// text block opens with the first text (none for a bare call). A forced call
/// streams as it is written: a `tool_use` block whose input arrives in
/// `input_json_delta` fragments. Calls the model makes under `auto` are known at the
/// end: each follows as a `tool_use` block with its input as one `input_json_delta`.
/// A failure mid-stream is an `error` event.
#[allow(clippy::too_many_arguments)]
fn stream_response(
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    id: String,
    model: String,
    input_tokens: usize,
    max_tokens: u64,
    lazy: bool,
    thinking: bool,
    provenance: Value,
) -> Response {
    let start = event(
        "message_start",
        json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }}),
    );
    let ping = event("ping", json!({"type": "ping"}));
    let text_start = |index: usize| {
        event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index,
                   "content_block": {"type": "text", "text": ""}}),
        )
    };
    let block_stop = |index: usize| {
        event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        )
    };
    let tool_start = |index: usize, call_id: &str, name: &str| {
        event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": {
                "type": "tool_use", "id": tool_use_id(call_id), "name": name, "input": {},
            }}),
        )
    };
    let input_delta = |index: usize, json: &str| {
        event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index, "delta": {
                "type": "input_json_delta", "partial_json": json,
            }}),
        )
    };
    let mut prelude = vec![start];
    // Blocks opened so far, and whether the last one is still open (text, or a
    // streamed tool_use).
    let mut blocks = 0usize;
    let mut text_open = false;
    let mut tool_open = false;
    // The open thinking block's text (its signature is sent when it closes).
    let mut thinking_open: Option<String> = None;
    let thinking_start = |index: usize| {
        event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index,
                   "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        )
    };
    // Closes the open thinking block: its signature, then its stop.
    let close_thinking = move |open: &mut Option<String>, index: usize, out: &mut Vec<SseEvent>| {
        if let Some(t) = open.take() {
            out.push(event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index,
                       "delta": {"type": "signature_delta", "signature": signature(&t)}}),
            ));
            out.push(block_stop(index));
        }
    };
    if !lazy {
        prelude.push(text_start(0));
        blocks = 1;
        text_open = true;
    }
    prelude.push(ping);
    let sse = stream::sse(rx, prelude, move |ev| match ev {
        // A reasoning model's thinking: a thinking block of thinking_delta pieces
        // (left out unless the request enabled thinking).
        Event::Reasoning(t) => {
            let mut out = Vec::new();
            if !thinking {
                return (out, false);
            }
            if text_open || tool_open {
                out.push(block_stop(blocks - 1));
                text_open = false;
                tool_open = false;
            }
            let open = thinking_open.get_or_insert_with(|| {
                out.push(thinking_start(blocks));
                blocks += 1;
                String::new()
            });
            open.push_str(&t);
            out.push(event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": blocks - 1,
                       "delta": {"type": "thinking_delta", "thinking": t}}),
            ));
            (out, false)
        }
        Event::Text(t) => {
            let mut out = Vec::new();
            close_thinking(&mut thinking_open, blocks.wrapping_sub(1), &mut out);
            if tool_open {
                out.push(block_stop(blocks - 1));
                tool_open = false;
            }
            if !text_open {
                out.push(text_start(blocks));
                blocks += 1;
                text_open = true;
            }
            out.push(event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": blocks - 1,
                       "delta": {"type": "text_delta", "text": t}}),
            ));
            (out, false)
        }
        // A forced call as it is written: a tool_use block, then its input in
        // input_json_delta fragments.
        Event::CallStart { id, name, .. } => {
            let mut out = Vec::new();
            close_thinking(&mut thinking_open, blocks.wrapping_sub(1), &mut out);
            if text_open || tool_open {
                out.push(block_stop(blocks - 1));
                text_open = false;
            }
            out.push(tool_start(blocks, &id, &name));
            blocks += 1;
            tool_open = true;
            (out, false)
        }
        Event::CallArgs { text, .. } => (vec![input_delta(blocks - 1, &text)], false),
        Event::Done(o) => {
            let mut out = Vec::new();
            close_thinking(&mut thinking_open, blocks.wrapping_sub(1), &mut out);
            if text_open || tool_open {
                out.push(block_stop(blocks - 1));
                text_open = false;
                tool_open = false;
            }
            // Calls not streamed are known at the end: each is one block with its
            // whole input.
            for c in o.tool_calls.iter().skip(o.streamed_calls) {
                let index = blocks;
                blocks += 1;
                out.push(tool_start(index, &c.id, &c.name));
                out.push(input_delta(index, &c.arguments_json()));
                out.push(block_stop(index));
            }
            let (reason, seq) = stop_reason(&o, max_tokens);
            let mut voom = provenance.clone();
            voom["timings"] = o.timings();
            out.push(event(
                "message_delta",
                json!({"type": "message_delta",
                       "delta": {"stop_reason": reason, "stop_sequence": seq},
                       "usage": {"output_tokens": o.completion_tokens},
                       "voom": voom}),
            ));
            out.push(event("message_stop", json!({"type": "message_stop"})));
            (out, true)
        }
        Event::Failed(e) => (
            vec![event("error", e.in_dialect(Dialect::Anthropic).body())],
            true,
        ),
    });
    sse.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::tools::ToolCall;

    fn parse_str(s: &str) -> Result<MessagesRequest, ApiError> {
        parse(&Body::parse(s.as_bytes())?)
    }

    fn err(s: &str) -> ApiError {
        parse_str(s).expect_err(s)
    }

    #[test]
    fn a_plain_request_becomes_template_messages() {
        let r = parse_str(
            r#"{"model": "m", "max_tokens": 10, "system": [{"type": "text", "text": "Be brief."}],
                "messages": [{"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
                             {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}}]}],
                "stop_sequences": ["\n\n"], "temperature": 0, "top_k": 5, "stream": true,
                "metadata": {"user_id": "u"}}"#,
        )
        .unwrap();
        assert_eq!(r.model, "m");
        assert_eq!(r.max_tokens, 10);
        assert!(r.stream);
        assert_eq!(r.stop, vec!["\n\n".to_string()]);
        assert_eq!(r.sampling.temperature, Some(0.0));
        assert_eq!(r.sampling.top_k, Some(5));
        assert!(r.prefill.is_none() && r.tools.is_none() && r.format.is_none());
        assert_eq!(
            r.messages,
            vec![
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "user", "content": "Hi"}),
                json!({"role": "assistant", "content": "Hello"}),
                json!({"role": "user", "content": "a\nb"}),
            ]
        );
    }

    #[test]
    fn required_fields_and_wrong_types_name_the_field() {
        for (body, param, what) in [
            (
                r#"{"model": "m", "messages": [{"role": "user", "content": "x"}]}"#,
                "max_tokens",
                "required",
            ),
            (
                r#"{"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}"#,
                "max_tokens",
                "from 1",
            ),
            (
                r#"{"model": "m", "max_tokens": "5", "messages": [{"role": "user", "content": "x"}]}"#,
                "max_tokens",
                "an integer",
            ),
            (
                r#"{"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}"#,
                "model",
                "required",
            ),
            (
                r#"{"model": "m", "max_tokens": 5, "messages": []}"#,
                "messages",
                "empty",
            ),
            (r#"{"model": "m", "max_tokens": 5}"#, "messages", "required"),
            (
                r#"{"model": "m", "max_tokens": 5, "messages": {}}"#,
                "messages",
                "an array",
            ),
            (
                r#"{"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}"#,
                "messages[0].role",
                "unknown role",
            ),
            (
                r#"{"model": "m", "max_tokens": 5, "messages": [{"content": "x"}]}"#,
                "messages[0].role",
                "needs",
            ),
            (
                r#"{"model": "m", "max_tokens": 5, "messages": [{"role": "user"}]}"#,
                "messages[0].content",
                "needs",
            ),
            (
                r#"{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": 3}]}"#,
                "messages[0].content",
                "a number",
            ),
            (
                r#"{"model": "m", "max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]}"#,
                "temperature",
                "between 0 and 1",
            ),
            (
                r#"{"model": "m", "max_tokens": 5, "stop_sequences": "x", "messages": [{"role": "user", "content": "x"}]}"#,
                "stop_sequences",
                "list",
            ),
            (
                r#"{"model": "m", "max_tokens": 5, "system": 1, "messages": [{"role": "user", "content": "x"}]}"#,
                "system",
                "a number",
            ),
            (
                r#"{"model": "m", "max_tokens": 5, "metadata": "x", "messages": [{"role": "user", "content": "x"}]}"#,
                "metadata",
                "an object",
            ),
            (
                r#"{"model": "m", "max_tokens": 5, "n": 2, "messages": [{"role": "user", "content": "x"}]}"#,
                "n",
                "not permitted",
            ),
            (
                r#"{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x", "name": "bob"}]}"#,
                "messages[0].name",
                "not permitted",
            ),
        ] {
            let e = err(body);
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e}");
            assert!(e.message.contains(what), "{body}: {e}");
            // In Anthropic's shape, the message names the field.
            let a = e.in_dialect(Dialect::Anthropic).body();
            assert_eq!(a["type"], "error");
            assert_eq!(a["error"]["type"], "invalid_request_error");
            assert!(
                a["error"]["message"].as_str().unwrap().contains(param),
                "{a}"
            );
        }
    }

    #[test]
    fn images_thinking_and_server_features_are_refused() {
        let e = err(
            r#"{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is this"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}"#,
        );
        assert_eq!(e.param.as_deref(), Some("messages[0].content[1].type"));
        assert!(e.message.contains("text only"), "{e}");
        // Thinking is checked as Anthropic checks it here; whether the model can
        // think is known when the request is prepared.
        let e = err(
            r#"{"model": "m", "max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 1024}, "messages": [{"role": "user", "content": "x"}]}"#,
        );
        assert_eq!(e.param.as_deref(), Some("thinking.budget_tokens"));
        let e = err(
            r#"{"model": "m", "max_tokens": 5000, "thinking": {"type": "enabled", "budget_tokens": 100}, "messages": [{"role": "user", "content": "x"}]}"#,
        );
        assert_eq!(e.param.as_deref(), Some("thinking.budget_tokens"));
        let e = err(
            r#"{"model": "m", "max_tokens": 5000, "thinking": {"type": "sometimes"}, "messages": [{"role": "user", "content": "x"}]}"#,
        );
        assert_eq!(e.param.as_deref(), Some("thinking.type"));
        let r = parse_str(
            r#"{"model": "m", "max_tokens": 5000, "thinking": {"type": "enabled", "budget_tokens": 1024}, "output_config": {"effort": "low"}, "messages": [{"role": "user", "content": "x"}]}"#,
        )
        .unwrap();
        assert!(r.thinking);
        assert_eq!(r.effort.as_deref(), Some("low"));
        assert!(parse_str(
            r#"{"model": "m", "max_tokens": 5, "thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "x"}]}"#
        )
        .is_ok());
        for (field, value) in [
            (
                "mcp_servers",
                r#"[{"type": "url", "url": "http://x", "name": "x"}]"#,
            ),
            ("container", r#""c""#),
            ("output_config", r#"{"effort": 3}"#),
            ("service_tier", r#""priority""#),
        ] {
            let body = format!(
                r#"{{"model": "m", "max_tokens": 5, "{field}": {value}, "messages": [{{"role": "user", "content": "x"}}]}}"#
            );
            let e = err(&body);
            assert!(
                e.param.as_deref().unwrap().starts_with(field),
                "{body}: {e}"
            );
        }
        let e = err(
            r#"{"model": "m", "max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "web_search"}], "messages": [{"role": "user", "content": "x"}]}"#,
        );
        assert_eq!(e.param.as_deref(), Some("tools[0].type"));
    }

    #[test]
    fn tools_history_and_choices_map_to_the_shared_types() {
        let r = parse_str(
            r#"{"model": "m", "max_tokens": 50,
                "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}],
                "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
                "messages": [
                  {"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "12 C"}], "is_error": false},
                      {"type": "text", "text": "And tomorrow?"}]}]}"#,
        )
        .unwrap();
        let t = r.tools.unwrap();
        assert_eq!(t.choice, ToolChoice::Required);
        assert!(!t.parallel);
        assert_eq!(t.tools[0].name, "get_weather");
        assert_eq!(t.tools[0].description.as_deref(), Some("Weather"));
        assert_eq!(
            r.messages,
            vec![
                json!({"role": "user", "content": "Weather in Oslo?"}),
                json!({"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}),
                json!({"role": "tool", "content": "12 C", "name": "get_weather", "tool_call_id": "toolu_1"}),
                json!({"role": "user", "content": "And tomorrow?"}),
            ]
        );
        let base = |choice: &str| {
            format!(
                r#"{{"model": "m", "max_tokens": 5, "tools": [{{"name": "f", "input_schema": {{"type": "object"}}}}], "tool_choice": {choice}, "messages": [{{"role": "user", "content": "x"}}]}}"#
            )
        };
        let t = parse_str(&base(r#"{"type": "tool", "name": "f"}"#))
            .unwrap()
            .tools
            .unwrap();
        assert_eq!(t.choice, ToolChoice::Named("f".into()));
        assert!(t.parallel);
        let t = parse_str(&base(r#"{"type": "none"}"#))
            .unwrap()
            .tools
            .unwrap();
        assert!(!t.is_active());
        assert_eq!(
            err(&base(r#"{"type": "tool", "name": "g"}"#))
                .param
                .as_deref(),
            Some("tool_choice")
        );
        assert_eq!(
            err(&base(r#"{"type": "sometimes"}"#)).param.as_deref(),
            Some("tool_choice.type")
        );
        assert_eq!(
            err(&base(r#""auto""#)).param.as_deref(),
            Some("tool_choice")
        );
        let e = err(
            r#"{"model": "m", "max_tokens": 5, "tools": [{"name": "f"}], "messages": [{"role": "user", "content": "x"}]}"#,
        );
        assert_eq!(e.param.as_deref(), Some("tools[0].input_schema"));
        let e = err(
            r#"{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": "{}"}]}]}"#,
        );
        assert_eq!(e.param.as_deref(), Some("messages[1].content[0].input"));
        let e = err(
            r#"{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]}"#,
        );
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].content[0].tool_use_id")
        );
    }

    #[test]
    fn a_final_assistant_message_is_a_prefill() {
        let r = parse_str(
            r#"{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]}"#,
        )
        .unwrap();
        assert_eq!(r.prefill.as_deref(), Some("1, 2,"));
        assert_eq!(
            r.messages,
            vec![json!({"role": "user", "content": "Count"})]
        );
        let e = err(
            r#"{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2, "}]}"#,
        );
        assert!(e.message.contains("trailing whitespace"), "{e}");
        let e = err(
            r#"{"model": "m", "max_tokens": 5, "tools": [{"name": "f", "input_schema": {"type": "object"}}], "messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1"}]}"#,
        );
        assert!(e.message.contains("prefill"), "{e}");
    }

    #[test]
    fn output_format_is_a_json_schema() {
        let r = parse_str(
            r#"{"model": "m", "max_tokens": 5, "output_config": {"format": {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}, "messages": [{"role": "user", "content": "x"}]}"#,
        )
        .unwrap();
        match r.format {
            Some(ResponseFormat::JsonSchema { schema, .. }) => {
                assert_eq!(schema["properties"]["a"]["type"], "integer")
            }
            other => panic!("{other:?}"),
        }
        let e = err(
            r#"{"model": "m", "max_tokens": 5, "output_config": {"format": {"type": "json_object"}}, "messages": [{"role": "user", "content": "x"}]}"#,
        );
        assert_eq!(e.param.as_deref(), Some("output_config.format.type"));
    }

    fn outcome(finish: Finish, completion_tokens: usize) -> Outcome {
        Outcome::for_test(finish, completion_tokens, "hi")
    }

    #[test]
    fn stop_reasons() {
        assert_eq!(stop_reason(&outcome(Finish::Eos, 2), 9).0, "end_turn");
        assert_eq!(stop_reason(&outcome(Finish::Length, 9), 9).0, "max_tokens");
        assert_eq!(
            stop_reason(&outcome(Finish::Length, 4), 9).0,
            "model_context_window_exceeded"
        );
        assert_eq!(
            stop_reason(&outcome(Finish::StopSequence("X".into()), 2), 9),
            ("stop_sequence", json!("X"))
        );
        let mut o = outcome(Finish::ToolCalls, 2);
        o.text.clear();
        o.tool_calls.push(ToolCall {
            id: "call_abc".into(),
            name: "f".into(),
            arguments: json!({"a": 1}),
            arguments_text: None,
        });
        assert_eq!(stop_reason(&o, 9).0, "tool_use");
        assert_eq!(
            content(&o, false),
            vec![json!({"type": "tool_use", "id": "toolu_abc", "name": "f", "input": {"a": 1}})]
        );
    }
}
