//! OpenAI's API: `GET /v1/models`, `POST /v1/chat/completions`, `POST
//! /v1/completions`, streaming (SSE, `data: [DONE]` at the end) and not.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::error::{ApiError, Dialect};
use super::prepare::{self, blocking, new_id, now, Prompt, Sampling};
use super::request::{kind, Body};
use super::stream;
use super::worker::{Event, Finish, Outcome};
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
    b.refuse(
        "tools",
        &[json!([])],
        "tool calls are not available in this version",
    )?;
    b.refuse(
        "tool_choice",
        &["none".into(), "auto".into()],
        "tool calls are not available in this version",
    )?;
    if let Some(rf) = b.get("response_format") {
        if rf.get("type").and_then(Value::as_str) != Some("text") {
            return Err(ApiError::invalid(
                "response_format",
                "'response_format' other than text is not available in this version",
            ));
        }
    }
    Ok(())
}

/// Fields both endpoints share.
struct Common {
    model: String,
    stream: bool,
    include_usage: bool,
    max_tokens: Option<u64>,
    sampling: Sampling,
    stop: Vec<String>,
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
        top_p: b.f64_in("top_p", f64::MIN_POSITIVE, 1.0)?,
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
            Some(Value::Array(parts)) => Value::String(text_parts(parts, &at("content"))?),
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
        for key in ["name", "tool_calls", "tool_call_id"] {
            if let Some(v) = o.get(key).filter(|v| !v.is_null()) {
                msg.insert(key.into(), v.clone());
            }
        }
        out.push(Value::Object(msg));
    }
    Ok(out)
}

/// The text of content parts; other kinds of part are refused.
pub fn text_parts(parts: &[Value], at: &str) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, p) in parts.iter().enumerate() {
        let ty = p.get("type").and_then(Value::as_str).unwrap_or("");
        match (ty, p.get("text")) {
            ("text" | "input_text" | "output_text", Some(Value::String(t))) => {
                texts.push(t.as_str())
            }
            ("text" | "input_text" | "output_text", _) => {
                return Err(ApiError::invalid(
                    &format!("{at}[{j}].text"),
                    "a text part needs a string 'text'",
                ))
            }
            (other, _) => {
                return Err(ApiError::invalid(
                    &format!("{at}[{j}].type"),
                    format!("content of type '{other}' is not supported: these models take text"),
                ))
            }
        }
    }
    Ok(texts.join("\n"))
}

fn finish_reason(f: &Finish) -> &'static str {
    match f {
        Finish::Eos | Finish::StopSequence(_) => "stop",
        Finish::Length => "length",
    }
}

fn usage(o: &Outcome) -> Value {
    json!({
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "total_tokens": o.prompt_tokens + o.completion_tokens,
    })
}

fn timings(o: &Outcome) -> Value {
    json!({
        "queue_secs": o.queue_secs,
        "prefill_secs": o.prefill_secs,
        "decode_secs": o.decode_secs,
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Endpoint {
    Chat,
    Completion,
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
    let (prepared, c) = blocking(move || {
        let b = Body::parse(&bytes)?;
        let c = common(&b)?;
        let p = match ep {
            Endpoint::Chat => {
                let messages = chat_messages(&b)?;
                prepare::prepare(
                    &app2,
                    &c.model,
                    Prompt::Chat { messages: &messages, tools: None },
                    c.max_tokens,
                    c.sampling,
                    c.stop.clone(),
                )?
            }
            Endpoint::Completion => {
                let max = c.max_tokens.or(Some(16));
                match b.get("prompt") {
                    Some(Value::String(s)) => prepare::prepare(&app2, &c.model, Prompt::Text(s), max, c.sampling, c.stop.clone())?,
                    Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                        prepare::prepare(&app2, &c.model, Prompt::Text(a[0].as_str().unwrap_or_default()), max, c.sampling, c.stop.clone())?
                    }
                    Some(Value::Array(a)) if !a.is_empty() && a.iter().all(|x| x.as_u64().is_some_and(|v| v <= u32::MAX as u64)) => {
                        let ids: Vec<u32> = a.iter().filter_map(Value::as_u64).map(|v| v as u32).collect();
                        prepare::prepare(&app2, &c.model, Prompt::Ids(&ids), max, c.sampling, c.stop.clone())?
                    }
                    Some(Value::Array(_)) => {
                        return Err(ApiError::invalid("prompt", "'prompt' must be a string, a list of one string, or a list of token ids (one prompt per request)"))
                    }
                    Some(v) => return Err(ApiError::invalid("prompt", format!("'prompt' must be a string, not {}", kind(v)))),
                    None => return Err(ApiError::invalid("prompt", "'prompt' is required")),
                }
            }
        };
        Ok((p, c))
    })
    .await?;
    let rx = prepare::start(&app, &prepared)?;
    let meta = Arc::clone(&prepared.meta);
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
                "message": {"role": "assistant", "content": o.text, "refusal": null},
                "logprobs": null,
                "finish_reason": finish_reason(&o.finish),
            }),
            Endpoint::Completion => json!({
                "index": 0, "text": o.text, "logprobs": null,
                "finish_reason": finish_reason(&o.finish),
            }),
        };
        let mut provenance = provenance;
        provenance["timings"] = timings(&o);
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
    let sse = stream::sse(rx, prelude, move |ev| match ev {
        Event::Text(t) => (vec![chunk2(delta(Some(&t), None), None)], false),
        Event::Done(o) => {
            let mut out = vec![chunk2(delta(None, Some(finish_reason(&o.finish))), None)];
            if include_usage {
                let mut u = usage(&o);
                u["voom"] = json!({"timings": timings(&o), "provenance": provenance.clone()});
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
