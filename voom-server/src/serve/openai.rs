//! OpenAI's API: `GET /v1/models`, `POST /v1/chat/completions`, `POST
//! /v1/completions`, streaming (SSE, `data: [DONE]` at the end) and not.
//!
//! Chat completions take `tools` (function tools), `tool_choice` (none, auto,
//! required, a named function), `parallel_tool_calls` and `response_format` (text,
//! json_object, json_schema); completions take `response_format` too. Calls come
//! back as `message.tool_calls` (arguments as a JSON string, content null when the
//! output is only calls) with finish_reason "tool_calls". Streaming with tools sends
//! the text and the calls once generation has ended (the calls are known only then).
//!
//! A reasoning model (harmony: gpt-oss) returns its reasoning as
//! `message.reasoning_content` (streamed as `delta.reasoning_content`), apart from
//! `content`; `reasoning_effort` (low, medium, high) goes to its template, and a
//! history's assistant `reasoning_content` (or `reasoning`, `thinking`) to the
//! template as the turn's thinking. Other models refuse `reasoning_effort`. vOOM
//! extension (vLLM's): a Lark grammar for the output, `structured_outputs.grammar`
//! or `guided_grammar`, on both endpoints.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::error::{ApiError, Dialect};
use super::ids::{new_id, now};
use super::job::{Event, Finish, Outcome, Prepared};
use super::prepare::{self, blocking, GenerateRequest, Prompt, Sampling};
use super::request::{kind, text_parts, user_grammar, wrong, Body};
use super::stream;
use super::tools::{
    empty_parameters, history_arguments, is_valid_tool_name, ResponseFormat, ToolCall, ToolChoice,
    ToolRequest, ToolSpec,
};
use super::App;

pub async fn models(State(app): State<Arc<App>>) -> Response {
    let data: Vec<Value> = app
        .catalog
        .ids()
        .into_iter()
        .map(|id| {
            let created = app.catalog.get(&id).map_or(0, |m| m.created);
            json!({"id": id, "object": "model", "created": created, "owned_by": "voom"})
        })
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

pub async fn model(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    match app.catalog.get(&id) {
        Ok(m) => Json(json!({
            "id": m.id, "object": "model", "created": m.created, "owned_by": "voom",
            "voom": app.provenance_json(&m),
        }))
        .into_response(),
        Err(e) => e.into_response(),
    }
}

/// Options both endpoints refuse rather than ignore.
fn refuse_unsupported(b: &Body) -> Result<(), ApiError> {
    b.refuse("n", &[1.into()], "one choice per request")?;
    b.refuse("best_of", &[1.into()], "one choice per request")?;
    b.refuse(
        "logprobs",
        &[false.into()],
        "log probabilities are not returned",
    )?;
    b.refuse(
        "top_logprobs",
        &[0.into()],
        "log probabilities are not returned",
    )?;
    b.refuse(
        "presence_penalty",
        &[0.into(), 0.0.into()],
        "penalties change the model's distribution; vOOM does not apply them",
    )?;
    b.refuse(
        "frequency_penalty",
        &[0.into(), 0.0.into()],
        "penalties change the model's distribution; vOOM does not apply them",
    )?;
    b.refuse(
        "repetition_penalty",
        &[1.into(), 1.0.into()],
        "penalties change the model's distribution; vOOM does not apply them",
    )?;
    b.refuse("logit_bias", &[json!({})], "logit bias is not supported")?;
    b.refuse("echo", &[false.into()], "the prompt is not echoed")?;
    b.refuse("suffix", &[], "insertion (suffix) is not supported")?;
    b.refuse("functions", &[json!([])], "use 'tools'")?;
    b.refuse("function_call", &[], "use 'tool_choice'")?;
    b.refuse("audio", &[], "text only")?;
    b.refuse("prediction", &[], "predicted outputs are not supported")?;
    b.refuse("modalities", &[json!(["text"])], "text only")?;
    Ok(())
}

/// `tools`, `tool_choice` and `parallel_tool_calls` of a chat request. None when no
/// tools are offered (a choice of none or auto without tools is allowed, as OpenAI
/// allows it).
fn tool_request(b: &Body) -> Result<Option<ToolRequest>, ApiError> {
    let parallel = b.bool("parallel_tool_calls")?.unwrap_or(true);
    let choice = match b.get("tool_choice") {
        None => None,
        Some(Value::String(s)) => Some(match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("unknown tool_choice '{other}' (none, auto, required, or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}})"),
                ))
            }
        }),
        Some(Value::Object(o)) => {
            match o.get("type") {
                Some(Value::String(t)) if t == "function" => {}
                _ => {
                    return Err(ApiError::invalid(
                        "tool_choice.type",
                        "a tool_choice object must have type 'function'",
                    ))
                }
            }
            match o.get("function").and_then(|f| f.get("name")) {
                Some(Value::String(n)) => Some(ToolChoice::Named(n.clone())),
                _ => {
                    return Err(ApiError::invalid(
                        "tool_choice.function.name",
                        "a tool_choice object needs function.name, a string",
                    ))
                }
            }
        }
        Some(v) => return Err(wrong("tool_choice", "a string or an object", v)),
    };
    let list = match b.get("tools") {
        None => vec![],
        Some(Value::Array(a)) => a.clone(),
        Some(v) => return Err(wrong("tools", "an array", v)),
    };
    let mut tools = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let at = |f: &str| format!("tools[{i}].{f}");
        let Value::Object(o) = t else {
            return Err(wrong(&format!("tools[{i}]"), "an object", t));
        };
        match o.get("type") {
            Some(Value::String(ty)) if ty == "function" => {}
            Some(Value::String(ty)) => {
                return Err(ApiError::invalid(
                    &at("type"),
                    format!("tools of type '{ty}' are not supported: only 'function'"),
                ))
            }
            _ => {
                return Err(ApiError::invalid(
                    &at("type"),
                    "each tool needs type 'function'",
                ))
            }
        }
        let Some(Value::Object(f)) = o.get("function") else {
            return Err(ApiError::invalid(
                &at("function"),
                "each tool needs a 'function' object",
            ));
        };
        let name = match f.get("name") {
            Some(Value::String(n)) => n.clone(),
            _ => {
                return Err(ApiError::invalid(
                    &at("function.name"),
                    "each function needs a string 'name'",
                ))
            }
        };
        if !is_valid_tool_name(&name) {
            return Err(ApiError::invalid(
                &at("function.name"),
                format!("'{name}' is not a valid function name: 1 to 64 of a-z, A-Z, 0-9, _ and -"),
            ));
        }
        let description = match f.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(d)) => Some(d.clone()),
            Some(v) => return Err(wrong(&at("function.description"), "a string", v)),
        };
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => empty_parameters(),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(v) => return Err(wrong(&at("function.parameters"), "an object", v)),
        };
        match f.get("strict") {
            None | Some(Value::Null) | Some(Value::Bool(_)) => {}
            Some(v) => return Err(wrong(&at("function.strict"), "a boolean", v)),
        }
        tools.push(ToolSpec {
            name,
            description,
            parameters,
        });
    }
    if tools.is_empty() {
        return match choice {
            Some(ToolChoice::Required | ToolChoice::Named(_)) => Err(ApiError::invalid(
                "tool_choice",
                "'tool_choice' requires 'tools'",
            )),
            _ => Ok(None),
        };
    }
    ToolRequest::new(tools, choice.unwrap_or(ToolChoice::Auto), parallel, "tools").map(Some)
}

/// `response_format`: text, json_object, or json_schema with its schema checked
/// here (a bad schema is a 400 naming the place in it).
fn response_format(b: &Body) -> Result<Option<ResponseFormat>, ApiError> {
    let Some(rf) = b.get("response_format") else {
        return Ok(None);
    };
    let Value::Object(o) = rf else {
        return Err(wrong("response_format", "an object", rf));
    };
    match o.get("type").and_then(Value::as_str) {
        Some("text") => Ok(Some(ResponseFormat::Text)),
        Some("json_object") => Ok(Some(ResponseFormat::JsonObject)),
        Some("json_schema") => {
            let Some(Value::Object(js)) = o.get("json_schema") else {
                return Err(ApiError::invalid(
                    "response_format.json_schema",
                    "a json_schema response format needs a 'json_schema' object",
                ));
            };
            let name = match js.get("name") {
                Some(Value::String(n)) => n.clone(),
                _ => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.name",
                        "'json_schema' needs a string 'name'",
                    ))
                }
            };
            let schema = match js.get("schema") {
                None | Some(Value::Null) => json!({}),
                Some(s @ (Value::Object(_) | Value::Bool(_))) => s.clone(),
                Some(v) => return Err(wrong("response_format.json_schema.schema", "an object", v)),
            };
            let strict = match js.get("strict") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(x)) => *x,
                Some(v) => return Err(wrong("response_format.json_schema.strict", "a boolean", v)),
            };
            let f = ResponseFormat::JsonSchema {
                name,
                schema,
                strict,
            };
            f.grammar("response_format.json_schema.schema")?;
            Ok(Some(f))
        }
        Some(other) => Err(ApiError::invalid(
            "response_format.type",
            format!("unknown response_format type '{other}' (text, json_object, json_schema)"),
        )),
        None => Err(ApiError::invalid(
            "response_format.type",
            "'response_format' needs a string 'type'",
        )),
    }
}

/// Fields both endpoints share.
#[derive(Debug)]
pub struct Common {
    pub model: String,
    pub stream: bool,
    pub include_usage: bool,
    pub max_tokens: Option<u64>,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    /// A Lark grammar for the output and the field it came from (vLLM's
    /// `structured_outputs.grammar` / `guided_grammar`).
    pub grammar: Option<(String, &'static str)>,
}

/// A chat completions request, parsed and checked (everything its handler reads
/// from the body before any model work).
#[derive(Debug)]
pub struct ChatRequest {
    pub common: Common,
    pub response_format: Option<ResponseFormat>,
    pub tools: Option<ToolRequest>,
    /// Messages as chat templates take them.
    pub messages: Vec<Value>,
    /// `reasoning_effort`, for a reasoning model's template.
    pub reasoning_effort: Option<String>,
}

/// Reads a chat completions body. Errors name the field at fault.
pub fn parse_chat(b: &Body) -> Result<ChatRequest, ApiError> {
    let common = common(b)?;
    let response_format = response_format(b)?;
    let tools = tool_request(b)?;
    let messages = chat_messages(b)?;
    let reasoning_effort = b.str("reasoning_effort")?.map(str::to_string);
    Ok(ChatRequest {
        common,
        response_format,
        tools,
        messages,
        reasoning_effort,
    })
}

/// The prompt of a completions request.
#[derive(Debug)]
pub enum CompletionPrompt {
    Text(String),
    Ids(Vec<u32>),
}

/// A completions request, parsed and checked.
#[derive(Debug)]
pub struct CompletionRequest {
    pub common: Common,
    pub response_format: Option<ResponseFormat>,
    pub prompt: CompletionPrompt,
}

/// Reads a completions body (taken, so the prompt's text is moved, not copied).
/// Errors name the field at fault.
pub fn parse_completion(mut b: Body) -> Result<CompletionRequest, ApiError> {
    let common = common(&b)?;
    let response_format = response_format(&b)?;
    b.refuse("tools", &[json!([])], "tools are for /v1/chat/completions")?;
    b.refuse(
        "tool_choice",
        &["none".into()],
        "tools are for /v1/chat/completions",
    )?;
    b.refuse(
        "parallel_tool_calls",
        &[],
        "tools are for /v1/chat/completions",
    )?;
    let prompt = match b.obj.remove("prompt") {
        Some(Value::String(s)) => CompletionPrompt::Text(s),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => CompletionPrompt::Text(
            a.into_iter()
                .next()
                .and_then(|v| match v {
                    Value::String(s) => Some(s),
                    _ => None,
                })
                .unwrap_or_default(),
        ),
        Some(Value::Array(a))
            if !a.is_empty()
                && a.iter()
                    .all(|x| x.as_u64().is_some_and(|v| v <= u32::MAX as u64)) =>
        {
            CompletionPrompt::Ids(a.iter().filter_map(Value::as_u64).map(|v| v as u32).collect())
        }
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                "prompt",
                "'prompt' must be a string, a list of one string, or a list of token ids (one prompt per request)",
            ))
        }
        None | Some(Value::Null) => return Err(ApiError::invalid("prompt", "'prompt' is required")),
        Some(v) => {
            return Err(ApiError::invalid(
                "prompt",
                format!("'prompt' must be a string, not {}", kind(&v)),
            ))
        }
    };
    Ok(CompletionRequest {
        common,
        response_format,
        prompt,
    })
}

fn common(b: &Body) -> Result<Common, ApiError> {
    refuse_unsupported(b)?;
    let model = b.required_str("model")?.to_string();
    let stream = b.bool("stream")?.unwrap_or(false);
    let include_usage = match b.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(x)) => *x,
            Some(v) => {
                return Err(ApiError::invalid(
                    "stream_options.include_usage",
                    format!("must be a boolean, not {}", kind(v)),
                ))
            }
        },
        Some(v) => {
            return Err(ApiError::invalid(
                "stream_options",
                format!("'stream_options' must be an object, not {}", kind(v)),
            ))
        }
    };
    if b.get("stream_options").is_some() && !stream {
        return Err(ApiError::invalid(
            "stream_options",
            "'stream_options' is only allowed when 'stream' is true",
        ));
    }
    let max_completion = b.u64_in("max_completion_tokens", 1, u32::MAX as u64)?;
    let max_tokens = b.u64_in("max_tokens", 1, u32::MAX as u64)?;
    let sampling = Sampling {
        temperature: b.f64_in("temperature", 0.0, 2.0)?,
        top_p: b.f64_above("top_p", 0.0, 1.0)?,
        top_k: b.u64_in("top_k", 0, u32::MAX as u64)?,
        seed: match b.get("seed") {
            None => None,
            Some(Value::Number(n)) => Some(
                n.as_u64()
                    .or_else(|| n.as_i64().map(|x| x as u64))
                    .ok_or_else(|| {
                        ApiError::invalid("seed", format!("'seed' must be an integer, not {n}"))
                    })?,
            ),
            Some(v) => {
                return Err(ApiError::invalid(
                    "seed",
                    format!("'seed' must be an integer, not {}", kind(v)),
                ))
            }
        },
    };
    Ok(Common {
        model,
        stream,
        include_usage,
        max_tokens: max_completion.or(max_tokens),
        sampling,
        stop: b.stop_list("stop", 4)?,
        grammar: user_grammar(b)?,
    })
}

/// Chat messages as chat templates take them.
fn chat_messages(b: &Body) -> Result<Vec<Value>, ApiError> {
    let msgs = match b.get("messages") {
        None => return Err(ApiError::invalid("messages", "'messages' is required")),
        Some(Value::Array(a)) => a,
        Some(v) => {
            return Err(ApiError::invalid(
                "messages",
                format!("'messages' must be an array, not {}", kind(v)),
            ))
        }
    };
    if msgs.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "'messages' must not be empty",
        ));
    }
    let mut out = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let at = |f: &str| format!("messages[{i}].{f}");
        let Value::Object(o) = m else {
            return Err(ApiError::invalid(
                &format!("messages[{i}]"),
                format!("each message must be an object, not {}", kind(m)),
            ));
        };
        let role = match o.get("role") {
            Some(Value::String(r)) => r.as_str(),
            Some(v) => {
                return Err(ApiError::invalid(
                    &at("role"),
                    format!("must be a string, not {}", kind(v)),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    &at("role"),
                    "every message needs a 'role'",
                ))
            }
        };
        let role = match role {
            "developer" | "system" => "system",
            "user" | "assistant" | "tool" => role,
            other => {
                return Err(ApiError::invalid(
                    &at("role"),
                    format!("unknown role '{other}' (system, developer, user, assistant, tool)"),
                ))
            }
        };
        let content = match o.get("content") {
            None | Some(Value::Null) if role == "assistant" => Value::Null,
            None | Some(Value::Null) => {
                return Err(ApiError::invalid(
                    &at("content"),
                    format!("a {role} message needs 'content'"),
                ))
            }
            Some(Value::String(s)) => Value::String(s.clone()),
            Some(Value::Array(parts)) => Value::String(text_parts(
                parts,
                &at("content"),
                &["text", "input_text", "output_text"],
            )?),
            Some(v) => {
                return Err(ApiError::invalid(
                    &at("content"),
                    format!(
                        "must be a string or an array of content parts, not {}",
                        kind(v)
                    ),
                ))
            }
        };
        let mut msg = serde_json::Map::new();
        msg.insert("role".into(), role.into());
        msg.insert("content".into(), content);
        for key in ["name", "tool_call_id"] {
            if let Some(v) = o.get(key).filter(|v| !v.is_null()) {
                msg.insert(key.into(), v.clone());
            }
        }
        // An assistant turn's reasoning, as reasoning models' templates read it
        // (`thinking`; the renderer aliases the three names).
        for key in ["reasoning_content", "reasoning", "thinking"] {
            match o.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::String(r)) if role == "assistant" => {
                    msg.insert(key.into(), r.clone().into());
                }
                Some(Value::String(_)) => {
                    return Err(ApiError::invalid(
                        &at(key),
                        format!("only assistant messages carry reasoning ('{key}')"),
                    ))
                }
                Some(v) => return Err(wrong(&at(key), "a string", v)),
            }
        }
        if let Some(calls) = o.get("tool_calls").filter(|v| !v.is_null()) {
            msg.insert(
                "tool_calls".into(),
                history_calls(calls, &at("tool_calls"))?,
            );
        }
        out.push(Value::Object(msg));
    }
    Ok(out)
}

/// An assistant message's `tool_calls` as templates take them: each call's
/// `function.arguments` an object (OpenAI sends a string holding JSON; templates
/// write arguments with `tojson`).
fn history_calls(calls: &Value, at: &str) -> Result<Value, ApiError> {
    let Value::Array(list) = calls else {
        return Err(wrong(at, "an array", calls));
    };
    let mut out = Vec::with_capacity(list.len());
    for (j, c) in list.iter().enumerate() {
        let at = format!("{at}[{j}]");
        let Value::Object(o) = c else {
            return Err(wrong(&at, "an object", c));
        };
        let mut o = o.clone();
        let Some(Value::Object(f)) = o.get_mut("function") else {
            return Err(ApiError::invalid(
                &format!("{at}.function"),
                "each tool call needs a 'function' object",
            ));
        };
        if !f.get("name").is_some_and(Value::is_string) {
            return Err(ApiError::invalid(
                &format!("{at}.function.name"),
                "each tool call needs a string function.name",
            ));
        }
        let args = match f.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(a) => history_arguments(a, &format!("{at}.function.arguments"))?,
        };
        f.insert("arguments".into(), args);
        out.push(Value::Object(o));
    }
    Ok(Value::Array(out))
}

fn finish_reason(f: &Finish) -> &'static str {
    match f {
        Finish::Eos | Finish::StopSequence(_) => "stop",
        Finish::Length => "length",
        Finish::ToolCalls => "tool_calls",
    }
}

/// Calls as OpenAI writes them: arguments as a JSON string.
fn tool_calls_json(calls: &[ToolCall]) -> Value {
    calls
        .iter()
        .map(|c| {
            json!({
                "id": c.id, "type": "function",
                "function": {"name": c.name, "arguments": c.arguments_json()},
            })
        })
        .collect()
}

/// The assistant message of a chat completion.
fn message(o: &Outcome) -> Value {
    let mut m = json!({"role": "assistant", "content": o.text, "refusal": null});
    if !o.reasoning.is_empty() {
        // As vLLM and DeepSeek's API give a reasoning model's thinking.
        m["reasoning_content"] = o.reasoning.clone().into();
    }
    if !o.tool_calls.is_empty() {
        if o.text.is_empty() {
            m["content"] = Value::Null;
        }
        m["tool_calls"] = tool_calls_json(&o.tool_calls);
    }
    m
}

fn usage(o: &Outcome) -> Value {
    json!({
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "total_tokens": o.prompt_tokens + o.completion_tokens,
        "completion_tokens_details": {"reasoning_tokens": o.reasoning_tokens},
    })
}

/// The two generating endpoints.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
}

/// What the handler of `ep` does with a body before any model work: parse and check
/// it, then [`prepare::prepare`] it (model, template, tokens, context, grammar).
/// Blocking.
pub fn prepare_body(app: &App, ep: Endpoint, bytes: &[u8]) -> Result<(Prepared, Common), ApiError> {
    let b = Body::parse(bytes)?;
    match ep {
        Endpoint::Chat => {
            let r = parse_chat(&b)?;
            let p = prepare::prepare(
                app,
                GenerateRequest {
                    stop: r.common.stop.clone(),
                    response_format: r.response_format.as_ref(),
                    reasoning_effort: r
                        .reasoning_effort
                        .as_deref()
                        .map(|e| (e, "reasoning_effort")),
                    grammar: r.common.grammar.as_ref().map(|(g, p)| (g.as_str(), *p)),
                    ..GenerateRequest::new(
                        &r.common.model,
                        Prompt::Chat {
                            messages: &r.messages,
                            tools: r.tools.as_ref(),
                        },
                        r.common.max_tokens,
                        r.common.sampling,
                    )
                },
            )?;
            Ok((p, r.common))
        }
        Endpoint::Completion => {
            let r = parse_completion(b)?;
            let prompt = match &r.prompt {
                CompletionPrompt::Text(s) => Prompt::Text(s),
                CompletionPrompt::Ids(ids) => Prompt::Ids(ids),
            };
            let p = prepare::prepare(
                app,
                GenerateRequest {
                    stop: r.common.stop.clone(),
                    response_format: r.response_format.as_ref(),
                    grammar: r.common.grammar.as_ref().map(|(g, p)| (g.as_str(), *p)),
                    ..GenerateRequest::new(
                        &r.common.model,
                        prompt,
                        r.common.max_tokens.or(Some(16)),
                        r.common.sampling,
                    )
                },
            )?;
            Ok((p, r.common))
        }
    }
}

pub async fn chat_completions(State(app): State<Arc<App>>, req: Request) -> Response {
    handle(app, req, Endpoint::Chat)
        .await
        .unwrap_or_else(|e| e.into_response())
}

pub async fn completions(State(app): State<Arc<App>>, req: Request) -> Response {
    handle(app, req, Endpoint::Completion)
        .await
        .unwrap_or_else(|e| e.into_response())
}

async fn handle(app: Arc<App>, req: Request, ep: Endpoint) -> Result<Response, ApiError> {
    let bytes = app.body(req, Dialect::OpenAi).await?;
    let app2 = Arc::clone(&app);
    let (prepared, c) = blocking(&app, move || prepare_body(&app2, ep, &bytes)).await?;
    let meta = Arc::clone(&prepared.meta);
    let rx = prepare::start(&app, prepared)?;
    let id = new_id(if ep == Endpoint::Chat {
        "chatcmpl-"
    } else {
        "cmpl-"
    });
    let created = now();
    let fingerprint = format!("voom-{}-{}", app.profile.name, &meta.checkpoint_digest[..8]);
    let provenance = app.provenance_json(&meta);
    let mut resp = if c.stream {
        stream_response(
            ep,
            rx,
            id,
            created,
            meta.id.clone(),
            fingerprint,
            provenance,
            c.include_usage,
        )
    } else {
        let o = stream::collect(rx).await?;
        let choice = match ep {
            Endpoint::Chat => json!({
                "index": 0,
                "message": message(&o),
                "logprobs": null,
                "finish_reason": finish_reason(&o.finish),
            }),
            Endpoint::Completion => json!({
                "index": 0, "text": o.text, "logprobs": null,
                "finish_reason": finish_reason(&o.finish),
            }),
        };
        let mut provenance = provenance;
        provenance["timings"] = o.timings();
        Json(json!({
            "id": id,
            "object": if ep == Endpoint::Chat { "chat.completion" } else { "text_completion" },
            "created": created,
            "model": meta.id,
            "system_fingerprint": fingerprint,
            "choices": [choice],
            "usage": usage(&o),
            "voom": provenance,
        }))
        .into_response()
    };
    app.provenance(&meta, &mut resp);
    Ok(resp)
}

#[allow(clippy::too_many_arguments)]
fn stream_response(
    ep: Endpoint,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    id: String,
    created: u64,
    model: String,
    fingerprint: String,
    provenance: Value,
    include_usage: bool,
) -> Response {
    let object = if ep == Endpoint::Chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let chunk = move |choices: Value, usage: Option<Value>| {
        let mut c = json!({
            "id": id, "object": object, "created": created, "model": model,
            "system_fingerprint": fingerprint, "choices": choices,
        });
        if include_usage {
            c["usage"] = usage.unwrap_or(Value::Null);
        }
        SseEvent::default().data(c.to_string())
    };
    let delta = move |text: Option<&str>, finish: Option<&str>| -> Value {
        match ep {
            Endpoint::Chat => {
                let d = match text {
                    Some(t) => json!({"content": t}),
                    None => json!({}),
                };
                json!([{"index": 0, "delta": d, "logprobs": null, "finish_reason": finish}])
            }
            Endpoint::Completion => {
                json!([{"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish}])
            }
        }
    };
    let prelude = match ep {
        Endpoint::Chat => vec![chunk(
            json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
            None,
        )],
        Endpoint::Completion => vec![],
    };
    let chunk2 = chunk.clone();
    let call_delta = |call: Value| json!([{"index": 0, "delta": {"tool_calls": [call]}, "logprobs": null, "finish_reason": null}]);
    let sse = stream::sse(rx, prelude, move |ev| match ev {
        Event::Text(t) => (vec![chunk2(delta(Some(&t), None), None)], false),
        // Reasoning streams beside the content, as vLLM streams it.
        Event::Reasoning(t) => {
            let choices = match ep {
                Endpoint::Chat => json!([{"index": 0, "delta": {"reasoning_content": t},
                                          "logprobs": null, "finish_reason": null}]),
                // (Completions render no template, so no reasoning is read.)
                Endpoint::Completion => return (vec![], false),
            };
            (vec![chunk2(choices, None)], false)
        }
        // A forced call as it is written: its id, type and name first, then argument
        // fragments by index (OpenAI's clients concatenate them).
        Event::CallStart { index, id, name } => {
            let call = json!({
                "index": index, "id": id, "type": "function",
                "function": {"name": name, "arguments": ""},
            });
            (vec![chunk2(call_delta(call), None)], false)
        }
        Event::CallArgs { index, text } => {
            let call = json!({"index": index, "function": {"arguments": text}});
            (vec![chunk2(call_delta(call), None)], false)
        }
        Event::Done(o) => {
            let mut out = Vec::new();
            // Calls not streamed are known at the end: one chunk per call with its
            // whole arguments.
            for (i, c) in o.tool_calls.iter().enumerate().skip(o.streamed_calls) {
                let call = json!({
                    "index": i, "id": c.id, "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments_json()},
                });
                out.push(chunk2(call_delta(call), None));
            }
            out.push(chunk2(delta(None, Some(finish_reason(&o.finish))), None));
            if include_usage {
                let mut u = usage(&o);
                u["voom"] = json!({"timings": o.timings(), "provenance": provenance.clone()});
                out.push(chunk2(json!([]), Some(u)));
            }
            out.push(SseEvent::default().data("[DONE]"));
            (out, true)
        }
        Event::Failed(e) => (
            vec![
                SseEvent::default().data(e.in_dialect(Dialect::OpenAi).body().to_string()),
                SseEvent::default().data("[DONE]"),
            ],
            true,
        ),
    });
    sse.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_reports_reasoning_tokens_within_completion_tokens() {
        let mut o = Outcome::for_test(Finish::Eos, 10, "hi");
        // Present, 0, without reasoning.
        assert_eq!(
            usage(&o)["completion_tokens_details"]["reasoning_tokens"],
            0
        );
        o.reasoning_tokens = 6;
        let u = usage(&o);
        assert_eq!(u["completion_tokens"], 10);
        assert_eq!(u["total_tokens"], 13);
        assert_eq!(u["completion_tokens_details"]["reasoning_tokens"], 6);
    }
}
