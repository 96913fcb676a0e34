//! OpenAI's Responses API: `POST /v1/responses`, streaming (typed SSE events, each
//! with a `sequence_number`) and not, with function tools and structured output.
//!
//! Request: `model`, `input` (a string, or items: messages with string or
//! `input_text`/`output_text` parts, `function_call` and `function_call_output`),
//! `instructions` (the system message), `max_output_tokens`, `temperature`, `top_p`,
//! `stream`, `text.format` (text, json_object, json_schema), `tools` (function
//! tools), `tool_choice`, `parallel_tool_calls`; accepted without effect on output:
//! `metadata` (echoed), `user`, `safety_identifier`, `prompt_cache_key`,
//! `prompt_cache_retention`, `service_tier` auto/default, `max_tool_calls` (there are
//! no built-in tools), `stream_options`. vOOM extensions: `seed`, `top_k`, and a Lark
//! grammar for the output (vLLM's `structured_outputs.grammar`, `guided_grammar`).
//!
//! A reasoning model (harmony: gpt-oss) answers with a `reasoning` item before the
//! message (its text as one `reasoning_text` part, no summary; streamed as
//! `response.reasoning_text.delta`); `reasoning.effort` (low, medium, high) goes to
//! its template (other models refuse it), and `reasoning` input items become the
//! next assistant turn's thinking.
//!
//! The server is stateless, so everything that needs stored state is refused with
//! 400: `previous_response_id`, `conversation`, `background: true`, `store: true`
//! (OpenAI's default is true, but its SDK sends `store` only when set: a request
//! that leaves it out is answered and not stored, and the response says `store:
//! false`; one that asks explicitly for storage is refused, since nothing could
//! retrieve it). Also refused: `include` with values, `reasoning.summary`,
//! `truncation: auto`, `prompt` templates, `top_logprobs`, images, files, built-in
//! tools, and any field the API does not define (as OpenAI does).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use super::error::{ApiError, Dialect};
use super::ids::{new_id, now};
use super::job::{Event, Finish, Outcome, Prepared};
use super::prepare::{self, blocking, GenerateRequest, Prompt, Sampling};
use super::request::{text_parts, user_grammar, wrong, Body};
use super::stream;
use super::tools::{
    empty_parameters, history_arguments, ResponseFormat, ToolChoice, ToolRequest, ToolSpec,
};
use super::App;

const KNOWN: &[&str] = &[
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "stream_options",
    "text",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "store",
    "metadata",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "service_tier",
    "max_tool_calls",
    "previous_response_id",
    "conversation",
    "background",
    "include",
    "reasoning",
    "truncation",
    "prompt",
    "top_logprobs",
    "seed",
    "top_k",
    "structured_outputs",
    "guided_grammar",
];

/// A Responses request, parsed and checked.
#[derive(Debug)]
pub struct ResponsesRequest {
    pub model: String,
    /// Messages as chat templates take them (instructions first, if any).
    pub messages: Vec<Value>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u64>,
    pub stream: bool,
    pub sampling: Sampling,
    pub tools: Option<ToolRequest>,
    pub format: ResponseFormat,
    /// `reasoning.effort`, for a reasoning model's template.
    pub effort: Option<String>,
    /// A Lark grammar for the output (vOOM extension: vLLM's `structured_outputs`).
    pub grammar: Option<(String, &'static str)>,
    /// Echoed in the response object.
    pub echo: Echo,
}

/// Request fields the response object repeats, in the API's form.
#[derive(Debug, Clone)]
pub struct Echo {
    pub tools: Value,
    pub tool_choice: Value,
    pub parallel_tool_calls: bool,
    pub text: Value,
    pub metadata: Value,
    pub user: Value,
}

pub fn parse(b: &Body) -> Result<ResponsesRequest, ApiError> {
    if let Some(key) = b.obj.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(ApiError::invalid(
            key,
            format!("Unknown parameter: '{key}'."),
        ));
    }
    let stateless =
        "this server keeps no state between requests: send the whole conversation in 'input'";
    b.refuse("previous_response_id", &[], stateless)?;
    b.refuse("conversation", &[], stateless)?;
    b.refuse(
        "store",
        &[false.into()],
        "responses are not stored (leave 'store' out or set it false)",
    )?;
    b.refuse(
        "background",
        &[false.into()],
        "responses run in the foreground",
    )?;
    b.refuse(
        "include",
        &[json!([])],
        "there is no extra output to include",
    )?;
    b.refuse(
        "truncation",
        &["disabled".into()],
        "inputs longer than the context are refused, never truncated",
    )?;
    b.refuse("prompt", &[], "prompt templates are not available")?;
    b.refuse(
        "top_logprobs",
        &[0.into()],
        "log probabilities are not returned",
    )?;
    // `reasoning.effort` goes to a reasoning model's template (a model without a
    // reasoning format refuses it when prepared); there are no summaries: the
    // reasoning item carries the reasoning text itself.
    let effort = match b.get("reasoning") {
        None | Some(Value::Null) => None,
        Some(Value::Object(o)) => {
            for (k, v) in o {
                match (k.as_str(), v) {
                    (_, Value::Null) | ("effort", Value::String(_)) => {}
                    ("effort", v) => return Err(wrong("reasoning.effort", "a string", v)),
                    ("summary" | "generate_summary", _) => {
                        return Err(ApiError::invalid(
                            &format!("reasoning.{k}"),
                            "reasoning summaries are not available: the reasoning item holds the reasoning text itself",
                        ))
                    }
                    (k, _) => {
                        return Err(ApiError::invalid(
                            &format!("reasoning.{k}"),
                            format!("Unknown parameter: 'reasoning.{k}'."),
                        ))
                    }
                }
            }
            o.get("effort").and_then(Value::as_str).map(str::to_string)
        }
        Some(v) => return Err(wrong("reasoning", "an object", v)),
    };
    match b.get("service_tier") {
        None => {}
        Some(Value::String(s)) if s == "auto" || s == "default" => {}
        Some(v) => {
            return Err(ApiError::invalid(
                "service_tier",
                format!("'service_tier' must be \"auto\" or \"default\", not {v}"),
            ))
        }
    }
    for key in [
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
    ] {
        b.str(key)?;
    }
    b.u64_in("max_tool_calls", 1, u32::MAX as u64)?;
    let metadata = match b.get("metadata") {
        None => json!({}),
        Some(v @ Value::Object(_)) => v.clone(),
        Some(v) => return Err(wrong("metadata", "an object", v)),
    };
    let model = b.required_str("model")?.to_string();
    let stream = b.bool("stream")?.unwrap_or(false);
    match b.get("stream_options") {
        None => {}
        Some(Value::Object(_)) if stream => {}
        Some(Value::Object(_)) => {
            return Err(ApiError::invalid(
                "stream_options",
                "'stream_options' is only allowed when 'stream' is true",
            ))
        }
        Some(v) => return Err(wrong("stream_options", "an object", v)),
    }
    let sampling = Sampling {
        temperature: b.f64_in("temperature", 0.0, 2.0)?,
        top_p: b.f64_above("top_p", 0.0, 1.0)?,
        top_k: b.u64_in("top_k", 0, u32::MAX as u64)?,
        seed: b.u64_in("seed", 0, u64::MAX)?,
    };
    let max_output_tokens = b.u64_in("max_output_tokens", 1, u32::MAX as u64)?;
    let instructions = match b.get("instructions") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => return Err(wrong("instructions", "a string", v)),
    };
    let (format, text_echo) = text_format(b)?;
    let (tools, tools_echo, choice_echo, parallel) = tool_request(b)?;
    let mut messages = Vec::new();
    if let Some(s) = &instructions {
        messages.push(json!({"role": "system", "content": s}));
    }
    input_messages(b, &mut messages)?;
    Ok(ResponsesRequest {
        model,
        messages,
        instructions,
        max_output_tokens,
        stream,
        sampling,
        tools,
        format,
        effort,
        grammar: user_grammar(b)?,
        echo: Echo {
            tools: tools_echo,
            tool_choice: choice_echo,
            parallel_tool_calls: parallel,
            text: text_echo,
            metadata,
            user: b.get("user").cloned().unwrap_or(Value::Null),
        },
    })
}

/// `text.format`: the response format, and the `text` object to echo.
fn text_format(b: &Body) -> Result<(ResponseFormat, Value), ApiError> {
    let text = match b.get("text") {
        None => return Ok((ResponseFormat::Text, json!({"format": {"type": "text"}}))),
        Some(Value::Object(o)) => o,
        Some(v) => return Err(wrong("text", "an object", v)),
    };
    for (k, v) in text {
        match k.as_str() {
            "format" => {}
            "verbosity" if v.is_null() || v == "medium" => {}
            "verbosity" => {
                return Err(ApiError::invalid(
                    "text.verbosity",
                    "'text.verbosity' is not supported: these models have no verbosity setting",
                ))
            }
            other => {
                return Err(ApiError::invalid(
                    &format!("text.{other}"),
                    format!("Unknown parameter: 'text.{other}'."),
                ))
            }
        }
    }
    let f = match text.get("format") {
        None | Some(Value::Null) => {
            return Ok((ResponseFormat::Text, json!({"format": {"type": "text"}})))
        }
        Some(Value::Object(f)) => f,
        Some(v) => return Err(wrong("text.format", "an object", v)),
    };
    let format = match f.get("type").and_then(Value::as_str) {
        Some("text") => ResponseFormat::Text,
        Some("json_object") => ResponseFormat::JsonObject,
        Some("json_schema") => {
            let name = match f.get("name") {
                Some(Value::String(s)) if !s.is_empty() => s.clone(),
                _ => {
                    return Err(ApiError::invalid(
                        "text.format.name",
                        "a json_schema format needs a 'name'",
                    ))
                }
            };
            let schema = match f.get("schema") {
                Some(s @ Value::Object(_)) => s.clone(),
                Some(v) => return Err(wrong("text.format.schema", "an object", v)),
                None => {
                    return Err(ApiError::invalid(
                        "text.format.schema",
                        "a json_schema format needs a 'schema'",
                    ))
                }
            };
            let strict = match f.get("strict") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(x)) => *x,
                Some(v) => return Err(wrong("text.format.strict", "a boolean", v)),
            };
            ResponseFormat::JsonSchema {
                name,
                schema,
                strict,
            }
        }
        _ => {
            return Err(ApiError::invalid(
                "text.format.type",
                "'text.format.type' must be one of text, json_object, json_schema",
            ))
        }
    };
    Ok((format, json!({"format": f})))
}

/// `tools`, `tool_choice` and `parallel_tool_calls`: the tool request (None without
/// tools and choice) and the values to echo.
fn tool_request(b: &Body) -> Result<(Option<ToolRequest>, Value, Value, bool), ApiError> {
    let parallel = b.bool("parallel_tool_calls")?.unwrap_or(true);
    let list = match b.get("tools") {
        None => vec![],
        Some(Value::Array(a)) => a.clone(),
        Some(v) => return Err(wrong("tools", "an array", v)),
    };
    let mut specs = Vec::with_capacity(list.len());
    let mut echo = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let at = format!("tools[{i}]");
        let Value::Object(o) = t else {
            return Err(wrong(&at, "an object", t));
        };
        match o.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => {
                return Err(ApiError::invalid(
                    &format!("{at}.type"),
                    format!("tools of type '{other}' are not available: only function tools"),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    &format!("{at}.type"),
                    "every tool needs a 'type' (\"function\")",
                ))
            }
        }
        let name = match o.get("name") {
            Some(Value::String(s)) => s.clone(),
            Some(v) => return Err(wrong(&format!("{at}.name"), "a string", v)),
            None => {
                return Err(ApiError::invalid(
                    &format!("{at}.name"),
                    "every function tool needs a 'name'",
                ))
            }
        };
        let description = match o.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(v) => return Err(wrong(&format!("{at}.description"), "a string", v)),
        };
        let parameters = match o.get("parameters") {
            None | Some(Value::Null) => empty_parameters(),
            Some(s @ Value::Object(_)) => s.clone(),
            Some(v) => return Err(wrong(&format!("{at}.parameters"), "an object", v)),
        };
        let strict = match o.get("strict") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(x)) => *x,
            Some(v) => return Err(wrong(&format!("{at}.strict"), "a boolean", v)),
        };
        echo.push(json!({
            "type": "function", "name": name, "description": description,
            "parameters": parameters, "strict": strict,
        }));
        specs.push(ToolSpec {
            name,
            description,
            parameters,
        });
    }
    let choice = match b.get("tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "'tool_choice' must be none, auto, required or a function, not '{other}'"
                    ),
                ))
            }
        },
        Some(Value::Object(o)) => match (o.get("type").and_then(Value::as_str), o.get("name")) {
            (Some("function"), Some(Value::String(n))) => ToolChoice::Named(n.clone()),
            (Some("function"), _) => {
                return Err(ApiError::invalid(
                    "tool_choice.name",
                    "a function tool_choice needs the function's 'name'",
                ))
            }
            (ty, _) => {
                return Err(ApiError::invalid(
                    "tool_choice.type",
                    format!(
                        "tool_choice of type {} is not available: only function tools",
                        ty.map_or("(none)".to_string(), |t| format!("'{t}'"))
                    ),
                ))
            }
        },
        Some(v) => return Err(wrong("tool_choice", "a string or an object", v)),
    };
    let choice_echo = b.get("tool_choice").cloned().unwrap_or("auto".into());
    let tools = if specs.is_empty() && b.get("tool_choice").is_none() {
        None
    } else {
        Some(ToolRequest::new(specs, choice, parallel, "tools")?)
    };
    Ok((tools, Value::Array(echo), choice_echo, parallel))
}

/// `input` as chat-template messages, appended to `out`.
fn input_messages(b: &Body, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let items = match b.get("input") {
        None => return Err(ApiError::invalid("input", "'input' is required")),
        Some(Value::String(s)) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(());
        }
        Some(Value::Array(a)) => a,
        Some(v) => return Err(wrong("input", "a string or an array of items", v)),
    };
    if items.is_empty() {
        return Err(ApiError::invalid("input", "'input' must not be empty"));
    }
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let Value::Object(o) = item else {
            return Err(wrong(&at, "an object", item));
        };
        let ty = match o.get("type") {
            None | Some(Value::Null) if o.contains_key("role") => "message",
            Some(Value::String(t)) => t.as_str(),
            Some(v) => return Err(wrong(&format!("{at}.type"), "a string", v)),
            None => {
                return Err(ApiError::invalid(
                    &format!("{at}.type"),
                    "every input item needs a 'type' (or a 'role', for a message)",
                ))
            }
        };
        let str_field = |k: &str| match o.get(k) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(v) => Err(wrong(&format!("{at}.{k}"), "a string", v)),
            None => Err(ApiError::invalid(
                &format!("{at}.{k}"),
                format!("a {ty} item needs '{k}'"),
            )),
        };
        match ty {
            "message" => {
                let role = match str_field("role")?.as_str() {
                    "system" | "developer" => "system",
                    r @ ("user" | "assistant") => r,
                    other => {
                        return Err(ApiError::invalid(
                            &format!("{at}.role"),
                            format!("unknown role '{other}' (user, assistant, system, developer)"),
                        ))
                    }
                }
                .to_string();
                let content = match o.get("content") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => text_parts(parts, &format!("{at}.content"), &["input_text", "output_text"])?,
                    Some(v) => {
                        return Err(wrong(
                            &format!("{at}.content"),
                            "a string or an array of content parts",
                            v,
                        ))
                    }
                    None => {
                        return Err(ApiError::invalid(
                            &format!("{at}.content"),
                            "a message needs 'content'",
                        ))
                    }
                };
                // An assistant message after its reasoning is the same turn.
                match out.last_mut() {
                    Some(Value::Object(m))
                        if role == "assistant"
                            && m.get("role") == Some(&json!("assistant"))
                            && m.contains_key("thinking")
                            && !m.contains_key("content")
                            && !m.contains_key("tool_calls") =>
                    {
                        m.insert("content".into(), content.into());
                    }
                    _ => out.push(json!({"role": role, "content": content})),
                }
            }
            "function_call" => {
                let call_id = str_field("call_id")?;
                let name = str_field("name")?;
                let arguments = match o.get("arguments") {
                    Some(v @ Value::String(_)) => {
                        history_arguments(v, &format!("{at}.arguments"))?
                    }
                    Some(v) => return Err(wrong(&format!("{at}.arguments"), "a string", v)),
                    None => {
                        return Err(ApiError::invalid(
                            &format!("{at}.arguments"),
                            "a function_call item needs 'arguments'",
                        ))
                    }
                };
                let call = json!({
                    "id": call_id, "type": "function",
                    "function": {"name": name, "arguments": arguments},
                });
                // Calls right after an assistant message (or other calls) belong to
                // that assistant turn.
                match out.last_mut() {
                    Some(Value::Object(m)) if m.get("role") == Some(&json!("assistant")) => {
                        match m.get_mut("tool_calls") {
                            Some(Value::Array(calls)) => calls.push(call),
                            _ => {
                                m.insert("tool_calls".into(), json!([call]));
                            }
                        }
                    }
                    _ => out.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let call_id = str_field("call_id")?;
                let output = match o.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => text_parts(parts, &format!("{at}.output"), &["input_text", "output_text"])?,
                    Some(v) => {
                        return Err(wrong(
                            &format!("{at}.output"),
                            "a string or an array of content parts",
                            v,
                        ))
                    }
                    None => {
                        return Err(ApiError::invalid(
                            &format!("{at}.output"),
                            "a function_call_output item needs 'output'",
                        ))
                    }
                };
                let name = find_call_name(out, &call_id);
                let mut msg = Map::new();
                msg.insert("role".into(), "tool".into());
                msg.insert("content".into(), output.into());
                if let Some(n) = name {
                    msg.insert("name".into(), n);
                }
                msg.insert("tool_call_id".into(), call_id.into());
                out.push(Value::Object(msg));
            }
            // Earlier reasoning: the next assistant turn's `thinking`, which a
            // reasoning model's template renders where it keeps it.
            "reasoning" => {
                let parts = match o.get("content") {
                    Some(Value::Array(p)) if !p.is_empty() => p.clone(),
                    _ => match o.get("summary") {
                        Some(Value::Array(p)) => p.clone(),
                        _ => vec![],
                    },
                };
                let thinking = text_parts(
                    &parts,
                    &format!("{at}.content"),
                    &["reasoning_text", "summary_text"],
                )?;
                out.push(json!({"role": "assistant", "thinking": thinking}));
            }
            "item_reference" => {
                return Err(ApiError::invalid(
                    &format!("{at}.type"),
                    "item references need stored state, which this server does not keep",
                ))
            }
            other => {
                return Err(ApiError::invalid(
                    &format!("{at}.type"),
                    format!("input items of type '{other}' are not supported (message, reasoning, function_call, function_call_output)"),
                ))
            }
        }
    }
    Ok(())
}

/// The name of the function an earlier `function_call` with `call_id` called.
fn find_call_name(messages: &[Value], call_id: &str) -> Option<Value> {
    messages.iter().rev().find_map(|m| {
        m.get("tool_calls")?
            .as_array()?
            .iter()
            .find(|c| c["id"] == call_id)
            .map(|c| c["function"]["name"].clone())
    })
}

/// What a response object is built from.
struct Shape {
    id: String,
    created_at: u64,
    model: String,
    instructions: Option<String>,
    max_output_tokens: Option<u64>,
    temperature: f64,
    top_p: f64,
    echo: Echo,
    provenance: Value,
}

impl Shape {
    /// The response object; `outcome` is None while in progress.
    fn object(&self, status: &str, output: Vec<Value>, outcome: Option<&Outcome>) -> Value {
        let incomplete = (status == "incomplete").then(|| json!({"reason": "max_output_tokens"}));
        let mut voom = self.provenance.clone();
        if let Some(o) = outcome {
            voom["timings"] = o.timings();
        }
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": (status == "completed").then(now),
            "error": null,
            "incomplete_details": incomplete,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.echo.parallel_tool_calls,
            "previous_response_id": null,
            "reasoning": {"effort": null, "summary": null},
            "store": false,
            "temperature": self.temperature,
            "text": self.echo.text,
            "tool_choice": self.echo.tool_choice,
            "tools": self.echo.tools,
            "top_p": self.top_p,
            "truncation": "disabled",
            "usage": outcome.map(usage),
            "user": self.echo.user,
            "metadata": self.echo.metadata,
            "voom": voom,
        })
    }
}

fn usage(o: &Outcome) -> Value {
    json!({
        "input_tokens": o.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": o.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": o.reasoning_tokens},
        "total_tokens": o.prompt_tokens + o.completion_tokens,
    })
}

/// "completed", or "incomplete" when the output was cut by the token limit.
fn status(o: &Outcome) -> &'static str {
    match o.finish {
        Finish::Length => "incomplete",
        Finish::Eos | Finish::StopSequence(_) | Finish::ToolCalls => "completed",
    }
}

fn message_item(id: &str, status: &str, text: Option<&str>) -> Value {
    let content = match text {
        Some(t) => json!([output_text(t)]),
        None => json!([]),
    };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn output_text(t: &str) -> Value {
    json!({"type": "output_text", "text": t, "annotations": [], "logprobs": []})
}

/// A function call's item while its arguments stream: its output index, call id,
/// name and arguments so far.
struct OpenCall {
    index: usize,
    id: String,
    name: String,
    args: String,
}

impl OpenCall {
    /// Adds the call's item (in progress) to `items`: `output_item.added`.
    fn added(seq: &mut Seq, items: &mut Vec<Value>, id: String, name: String) -> (Self, SseEvent) {
        let index = items.len();
        let item = function_call_item(&id, &name, "in_progress", "");
        items.push(item.clone());
        let ev = seq.event(
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        );
        let c = OpenCall {
            index,
            id,
            name,
            args: String::new(),
        };
        (c, ev)
    }

    /// More arguments: `function_call_arguments.delta`.
    fn delta(&mut self, seq: &mut Seq, delta: &str) -> SseEvent {
        self.args.push_str(delta);
        seq.event(
            "response.function_call_arguments.delta",
            json!({"item_id": item_id(&self.id), "output_index": self.index, "delta": delta}),
        )
    }

    /// The arguments are complete: `function_call_arguments.done`, then
    /// `output_item.done` with the item, which replaces it in `items`.
    fn done(self, seq: &mut Seq, items: &mut [Value], status: &str) -> Vec<SseEvent> {
        let item = function_call_item(&self.id, &self.name, status, &self.args);
        items[self.index] = item.clone();
        vec![
            seq.event(
                "response.function_call_arguments.done",
                json!({"item_id": item_id(&self.id), "output_index": self.index,
                       "name": self.name, "arguments": self.args}),
            ),
            seq.event(
                "response.output_item.done",
                json!({"output_index": self.index, "item": item}),
            ),
        ]
    }
}

/// The reasoning item's id: `rs_` and the message id's digits.
fn reasoning_id(msg_id: &str) -> String {
    format!("rs_{}", msg_id.strip_prefix("msg_").unwrap_or(msg_id))
}

/// A function call's item id: `fc_` and the call id's digits.
fn item_id(call_id: &str) -> String {
    format!("fc_{}", call_id.strip_prefix("call_").unwrap_or(call_id))
}

fn function_call_item(call_id: &str, name: &str, status: &str, arguments: &str) -> Value {
    json!({
        "type": "function_call",
        "id": item_id(call_id),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    })
}

/// A reasoning model's reasoning as an output item: its text as one
/// `reasoning_text` part (no summary).
fn reasoning_item(id: &str, status: &str, text: Option<&str>) -> Value {
    let content = match text {
        Some(t) => json!([{"type": "reasoning_text", "text": t}]),
        None => json!([]),
    };
    json!({"type": "reasoning", "id": id, "status": status, "summary": [],
           "content": content, "encrypted_content": null})
}

/// The output items of a finished request: the reasoning (a reasoning model's, when
/// it wrote some), the message (left out when the output is only calls), then one
/// `function_call` per call.
fn output_items(o: &Outcome, msg_id: &str) -> Vec<Value> {
    let mut items = Vec::new();
    if !o.reasoning.is_empty() {
        items.push(reasoning_item(
            &reasoning_id(msg_id),
            "completed",
            Some(&o.reasoning),
        ));
    }
    if !o.text.is_empty() || o.tool_calls.is_empty() {
        items.push(message_item(msg_id, status(o), Some(&o.text)));
    }
    for c in &o.tool_calls {
        items.push(function_call_item(
            &c.id,
            &c.name,
            "completed",
            &c.arguments_json(),
        ));
    }
    items
}

/// What the handler does with a body before any model work: parse and check it,
/// then [`prepare::prepare`] it (model, template, tokens, context, grammar).
/// Blocking.
pub fn prepare_body(app: &App, bytes: &[u8]) -> Result<(Prepared, ResponsesRequest), ApiError> {
    let b = Body::parse(bytes)?;
    let r = parse(&b)?;
    let p = prepare::prepare(
        app,
        GenerateRequest {
            response_format: Some(&r.format),
            reasoning_effort: r.effort.as_deref().map(|e| (e, "reasoning.effort")),
            grammar: r.grammar.as_ref().map(|(g, p)| (g.as_str(), *p)),
            ..GenerateRequest::new(
                &r.model,
                Prompt::Chat {
                    messages: &r.messages,
                    tools: r.tools.as_ref(),
                },
                r.max_output_tokens,
                r.sampling,
            )
        },
    )?;
    Ok((p, r))
}

pub async fn responses(State(app): State<Arc<App>>, req: Request) -> Response {
    handle(app, req)
        .await
        .unwrap_or_else(|e| e.in_dialect(Dialect::OpenAi).into_response())
}

async fn handle(app: Arc<App>, req: Request) -> Result<Response, ApiError> {
    let bytes = app.body(req, Dialect::OpenAi).await?;
    let app2 = Arc::clone(&app);
    let (prepared, r) = blocking(&app, move || prepare_body(&app2, &bytes)).await?;
    let meta = Arc::clone(&prepared.meta);
    let harmony = prepared.harmony.is_some();
    let rx = prepare::start(&app, prepared)?;
    let d = meta.sampling_defaults;
    let shape = Shape {
        id: new_id("resp_"),
        created_at: now(),
        model: meta.id.clone(),
        instructions: r.instructions.clone(),
        max_output_tokens: r.max_output_tokens,
        temperature: r.sampling.temperature.unwrap_or(d.temperature),
        top_p: r.sampling.top_p.unwrap_or(d.top_p),
        echo: r.echo.clone(),
        provenance: app.provenance_json(&meta),
    };
    let msg_id = new_id("msg_");
    let mut resp = if r.stream {
        // The message opens with its first text where the output may begin with
        // calls or reasoning.
        let lazy = r.tools.as_ref().is_some_and(ToolRequest::is_active) || harmony;
        stream_response(rx, shape, msg_id, lazy)
    } else {
        let o = stream::collect(rx).await?;
        Json(shape.object(status(&o), output_items(&o, &msg_id), Some(&o))).into_response()
    };
    app.provenance(&meta, &mut resp);
    Ok(resp)
}

/// Numbers events in order, as the API does.
struct Seq(u64);

impl Seq {
    fn event(&mut self, ty: &str, mut data: Value) -> SseEvent {
        data["type"] = ty.into();
        data["sequence_number"] = self.0.into();
        self.0 += 1;
        SseEvent::default().event(ty).data(data.to_string())
    }
}

/// The event stream: `response.created`, `response.in_progress`; the message item
/// (`output_item.added`, `content_part.added`, `output_text.delta`...,
/// `output_text.done`, `content_part.done`, `output_item.done`); each function call
/// as an item with one `function_call_arguments.delta` and `.done`; then
/// `response.completed` (or `response.incomplete` at the token limit). Without
/// tools the message opens at once; with tools the message opens with the first
/// text (and is left out when the output is only calls). A forced call streams as
/// it is written: its item, then `function_call_arguments.delta` fragments; calls
/// the model makes under `auto` are known at the end, each with one delta. A
/// failure is an `error` event then `response.failed`.
fn stream_response(
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    shape: Shape,
    msg_id: String,
    tools_active: bool,
) -> Response {
    let mut seq = Seq(0);
    let created = shape.object("in_progress", vec![], None);
    let mut prelude = vec![
        seq.event("response.created", json!({"response": created})),
        seq.event("response.in_progress", json!({"response": created})),
    ];
    // Output items so far; whether the message item is open, and its text.
    let mut items: Vec<Value> = Vec::new();
    let mut msg_open = false;
    let mut text = String::new();
    let msg_id1 = msg_id.clone();
    let open_message = move |seq: &mut Seq, items: &mut Vec<Value>| -> Vec<SseEvent> {
        let msg_id = &msg_id1;
        let index = items.len();
        items.push(Value::Null);
        vec![
            seq.event(
                "response.output_item.added",
                json!({"output_index": index, "item": message_item(msg_id, "in_progress", None)}),
            ),
            seq.event(
                "response.content_part.added",
                json!({"item_id": msg_id, "output_index": index, "content_index": 0,
                       "part": output_text("")}),
            ),
        ]
    };
    let msg_id2 = msg_id.clone();
    let close_message =
        move |seq: &mut Seq, items: &mut [Value], text: &str, status: &str| -> Vec<SseEvent> {
            let index = items.len() - 1;
            let item = message_item(&msg_id2, status, Some(text));
            items[index] = item.clone();
            vec![
                seq.event(
                    "response.output_text.done",
                    json!({"item_id": msg_id2, "output_index": index, "content_index": 0,
                       "text": text, "logprobs": []}),
                ),
                seq.event(
                    "response.content_part.done",
                    json!({"item_id": msg_id2, "output_index": index, "content_index": 0,
                       "part": output_text(text)}),
                ),
                seq.event(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                ),
            ]
        };
    if !tools_active {
        prelude.extend(open_message(&mut seq, &mut items));
        msg_open = true;
    }
    // The streamed call whose item is open.
    let mut open_call: Option<OpenCall> = None;
    // The reasoning item while it is open: its output index and text.
    let mut reasoning: Option<(usize, String)> = None;
    let rs_id = reasoning_id(&msg_id);
    let close_reasoning = move |r: &mut Option<(usize, String)>,
                                seq: &mut Seq,
                                items: &mut [Value],
                                id: &str|
          -> Vec<SseEvent> {
        let Some((index, text)) = r.take() else {
            return vec![];
        };
        let item = reasoning_item(id, "completed", Some(&text));
        items[index] = item.clone();
        vec![
            seq.event(
                "response.reasoning_text.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
            ),
            seq.event(
                "response.content_part.done",
                json!({"item_id": id, "output_index": index, "content_index": 0,
                       "part": {"type": "reasoning_text", "text": text}}),
            ),
            seq.event(
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
            ),
        ]
    };
    let msg_id3 = msg_id.clone();
    let sse = stream::sse(rx, prelude, move |ev| match ev {
        // A reasoning model's reasoning: a reasoning item (before the message),
        // its text in `reasoning_text.delta` pieces.
        Event::Reasoning(t) => {
            let mut out = Vec::new();
            if reasoning.is_none() {
                if msg_open {
                    out.extend(close_message(&mut seq, &mut items, &text, "completed"));
                    msg_open = false;
                }
                let index = items.len();
                let item = reasoning_item(&rs_id, "in_progress", None);
                items.push(item.clone());
                out.push(seq.event(
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                ));
                out.push(seq.event(
                    "response.content_part.added",
                    json!({"item_id": rs_id, "output_index": index, "content_index": 0,
                           "part": {"type": "reasoning_text", "text": ""}}),
                ));
                reasoning = Some((index, String::new()));
            }
            if let Some((index, so_far)) = reasoning.as_mut() {
                so_far.push_str(&t);
                out.push(seq.event(
                    "response.reasoning_text.delta",
                    json!({"item_id": rs_id, "output_index": *index, "content_index": 0, "delta": t}),
                ));
            }
            (out, false)
        }
        Event::CallStart { id, name, .. } => {
            let mut out = close_reasoning(&mut reasoning, &mut seq, &mut items, &rs_id);
            if msg_open {
                out.extend(close_message(&mut seq, &mut items, &text, "completed"));
                msg_open = false;
            }
            if let Some(c) = open_call.take() {
                out.extend(c.done(&mut seq, &mut items, "completed"));
            }
            let (c, added) = OpenCall::added(&mut seq, &mut items, id, name);
            out.push(added);
            open_call = Some(c);
            (out, false)
        }
        Event::CallArgs { text: delta, .. } => match open_call.as_mut() {
            Some(c) => (vec![c.delta(&mut seq, &delta)], false),
            None => (vec![], false),
        },
        Event::Text(t) => {
            let mut out = close_reasoning(&mut reasoning, &mut seq, &mut items, &rs_id);
            if let Some(c) = open_call.take() {
                out.extend(c.done(&mut seq, &mut items, "completed"));
            }
            if !msg_open {
                out.extend(open_message(&mut seq, &mut items));
                msg_open = true;
            }
            text.push_str(&t);
            out.push(seq.event(
                "response.output_text.delta",
                json!({"item_id": msg_id3, "output_index": items.len() - 1,
                       "content_index": 0, "delta": t, "logprobs": []}),
            ));
            (out, false)
        }
        Event::Done(o) => {
            let mut out = close_reasoning(&mut reasoning, &mut seq, &mut items, &rs_id);
            let st = status(&o);
            if !msg_open && o.tool_calls.is_empty() && o.streamed_calls == 0 {
                // No text and no calls: the answer is an empty message.
                out.extend(open_message(&mut seq, &mut items));
                msg_open = true;
            }
            if msg_open {
                out.extend(close_message(&mut seq, &mut items, &text, st));
                msg_open = false;
            }
            if let Some(c) = open_call.take() {
                // The last streamed call: cut by the token limit if the parse lacks it.
                let cut = o.tool_calls.len() < o.streamed_calls;
                let status = if cut { "incomplete" } else { "completed" };
                out.extend(c.done(&mut seq, &mut items, status));
            }
            // Calls not streamed are known at the end: each with one delta.
            for call in o.tool_calls.iter().skip(o.streamed_calls) {
                let (mut c, added) =
                    OpenCall::added(&mut seq, &mut items, call.id.clone(), call.name.clone());
                out.push(added);
                out.push(c.delta(&mut seq, &call.arguments_json()));
                out.extend(c.done(&mut seq, &mut items, "completed"));
            }
            let name = if st == "completed" {
                "response.completed"
            } else {
                "response.incomplete"
            };
            let response = shape.object(st, items.clone(), Some(&o));
            out.push(seq.event(name, json!({"response": response})));
            (out, true)
        }
        Event::Failed(e) => {
            let mut failed = shape.object("failed", items.clone(), None);
            failed["error"] = json!({"code": "server_error", "message": e.message});
            (
                vec![
                    seq.event(
                        "error",
                        json!({"code": "server_error", "message": e.message, "param": e.param}),
                    ),
                    seq.event("response.failed", json!({"response": failed})),
                ],
                true,
            )
        }
    });
    sse.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::tools::ToolCall;

    fn parse_str(s: &str) -> Result<ResponsesRequest, ApiError> {
        parse(&Body::parse(s.as_bytes())?)
    }

    fn err(s: &str) -> ApiError {
        parse_str(s).expect_err(s)
    }

    #[test]
    fn input_string_and_items_become_template_messages() {
        let r = parse_str(r#"{"model": "m", "input": "Hi", "instructions": "Be brief."}"#).unwrap();
        assert_eq!(
            r.messages,
            vec![
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "user", "content": "Hi"}),
            ]
        );
        assert_eq!(r.format, ResponseFormat::Text);
        assert!(r.tools.is_none() && !r.stream);
        let r = parse_str(
            r#"{"model": "m", "max_output_tokens": 7, "temperature": 0, "stream": true, "input": [
                {"role": "developer", "content": "Rules."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
                {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
                {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "12 C"}]}"#,
        )
        .unwrap();
        assert_eq!(r.max_output_tokens, Some(7));
        assert_eq!(r.sampling.temperature, Some(0.0));
        assert!(r.stream);
        assert_eq!(
            r.messages,
            vec![
                json!({"role": "system", "content": "Rules."}),
                json!({"role": "user", "content": "a\nb"}),
                json!({"role": "assistant", "content": "Let me look.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}),
                json!({"role": "tool", "content": "12 C", "name": "get_weather", "tool_call_id": "call_1"}),
            ]
        );
    }

    #[test]
    fn stateful_and_unsupported_options_are_refused() {
        for (extra, param) in [
            (
                r#""previous_response_id": "resp_1""#,
                "previous_response_id",
            ),
            (r#""conversation": "conv_1""#, "conversation"),
            (r#""store": true"#, "store"),
            (r#""background": true"#, "background"),
            (r#""include": ["reasoning.encrypted_content"]"#, "include"),
            (r#""reasoning": {"summary": "auto"}"#, "reasoning.summary"),
            (r#""reasoning": {"effort": 3}"#, "reasoning.effort"),
            (r#""truncation": "auto""#, "truncation"),
            (r#""prompt": {"id": "pmpt_1"}"#, "prompt"),
            (r#""top_logprobs": 3"#, "top_logprobs"),
            (r#""frequency_penalty": 1"#, "frequency_penalty"),
            (r#""tools": [{"type": "web_search"}]"#, "tools[0].type"),
            (r#""text": {"verbosity": "high"}"#, "text.verbosity"),
            (
                r#""tool_choice": {"type": "file_search"}"#,
                "tool_choice.type",
            ),
        ] {
            let body = format!(r#"{{"model": "m", "input": "x", {extra}}}"#);
            let e = err(&body);
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e}");
        }
        // Neutral values pass.
        assert!(parse_str(
            r#"{"model": "m", "input": "x", "store": false, "background": false, "include": [], "truncation": "disabled", "reasoning": {"effort": null}, "metadata": {"k": "v"}, "user": "u"}"#
        )
        .is_ok());
        // A reasoning effort is for the template (a model without a reasoning format
        // refuses it when prepared); earlier reasoning is the next turn's thinking.
        let r = parse_str(
            r#"{"model": "m", "reasoning": {"effort": "high"}, "input": [{"role": "user", "content": "q"}, {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]}, {"role": "assistant", "content": "a"}]}"#,
        )
        .unwrap();
        assert_eq!(r.effort.as_deref(), Some("high"));
        assert_eq!(
            r.messages[1],
            json!({"role": "assistant", "thinking": "hm", "content": "a"})
        );
        let e = err(
            r#"{"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}"#,
        );
        assert_eq!(e.param.as_deref(), Some("input[0].content[0].type"));
        assert!(e.message.contains("take text"), "{e}");
        for (body, param) in [
            (r#"{"input": "x"}"#, "model"),
            (r#"{"model": "m"}"#, "input"),
            (r#"{"model": "m", "input": []}"#, "input"),
            (r#"{"model": "m", "input": 5}"#, "input"),
            (
                r#"{"model": "m", "input": "x", "max_output_tokens": 0}"#,
                "max_output_tokens",
            ),
            (
                r#"{"model": "m", "input": "x", "temperature": "hot"}"#,
                "temperature",
            ),
            (
                r#"{"model": "m", "input": [{"type": "reasoning", "content": [{"type": "x", "text": "t"}]}]}"#,
                "input[0].content[0].type",
            ),
            (
                r#"{"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}"#,
                "input[0].arguments",
            ),
            (
                r#"{"model": "m", "input": [{"type": "function_call_output", "call_id": "c"}]}"#,
                "input[0].output",
            ),
        ] {
            assert_eq!(err(body).param.as_deref(), Some(param), "{body}");
        }
    }

    #[test]
    fn tools_choice_and_text_format() {
        let r = parse_str(
            r#"{"model": "m", "input": "x", "parallel_tool_calls": false, "tool_choice": {"type": "function", "name": "f"},
                "tools": [{"type": "function", "name": "f", "description": "F", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
                          {"type": "function", "name": "g", "parameters": null, "strict": false}],
                "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": true}}}"#,
        )
        .unwrap();
        let t = r.tools.unwrap();
        assert_eq!(t.choice, ToolChoice::Named("f".into()));
        assert!(!t.parallel);
        assert_eq!(t.tools[1].parameters, empty_parameters());
        assert_eq!(r.echo.tools[1]["strict"], false);
        assert_eq!(r.echo.tools[0]["strict"], true);
        assert_eq!(r.echo.tool_choice, json!({"type": "function", "name": "f"}));
        assert!(!r.echo.parallel_tool_calls);
        assert!(
            matches!(r.format, ResponseFormat::JsonSchema { ref name, strict: true, .. } if name == "out")
        );
        let r = parse_str(
            r#"{"model": "m", "input": "x", "text": {"format": {"type": "json_object"}}}"#,
        )
        .unwrap();
        assert_eq!(r.format, ResponseFormat::JsonObject);
        assert_eq!(
            err(r#"{"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}"#)
                .param
                .as_deref(),
            Some("text.format.name")
        );
        assert_eq!(
            err(r#"{"model": "m", "input": "x", "tool_choice": "required"}"#)
                .param
                .as_deref(),
            Some("tool_choice")
        );
    }

    #[test]
    fn response_objects_have_what_the_sdk_requires() {
        let shape = Shape {
            id: "resp_1".into(),
            created_at: 5,
            model: "m".into(),
            instructions: None,
            max_output_tokens: Some(4),
            temperature: 1.0,
            top_p: 1.0,
            echo: Echo {
                tools: json!([]),
                tool_choice: json!("auto"),
                parallel_tool_calls: true,
                text: json!({"format": {"type": "text"}}),
                metadata: json!({}),
                user: Value::Null,
            },
            provenance: json!({"profile": "exact"}),
        };
        let mut o = Outcome::for_test(Finish::Length, 4, "abcd");
        let v = shape.object(status(&o), output_items(&o, "msg_1"), Some(&o));
        for key in [
            "id",
            "created_at",
            "model",
            "object",
            "output",
            "parallel_tool_calls",
            "tool_choice",
            "tools",
        ] {
            assert!(!v[key].is_null(), "{key}");
        }
        assert_eq!(v["status"], "incomplete");
        assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(v["output"][0]["content"][0]["text"], "abcd");
        assert_eq!(v["output"][0]["status"], "incomplete");
        assert_eq!(v["usage"]["total_tokens"], 7);
        assert_eq!(v["usage"]["output_tokens_details"]["reasoning_tokens"], 0);
        o.reasoning_tokens = 3;
        let v = shape.object(status(&o), output_items(&o, "msg_1"), Some(&o));
        assert_eq!(v["usage"]["output_tokens"], 4);
        assert_eq!(v["usage"]["output_tokens_details"]["reasoning_tokens"], 3);
        o.finish = Finish::ToolCalls;
        o.text.clear();
        o.tool_calls.push(ToolCall {
            id: "call_9".into(),
            name: "f".into(),
            arguments: json!({"a": 1}),
            arguments_text: None,
        });
        let v = shape.object(status(&o), output_items(&o, "msg_1"), Some(&o));
        assert_eq!(v["status"], "completed");
        assert_eq!(v["output"].as_array().unwrap().len(), 1);
        assert_eq!(
            v["output"][0],
            json!({"type": "function_call", "id": "fc_9", "call_id": "call_9", "name": "f", "arguments": "{\"a\":1}", "status": "completed"})
        );
    }
}
