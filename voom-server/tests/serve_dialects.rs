//! `voom serve`'s Anthropic Messages (`/v1/messages`) and OpenAI Responses
//! (`/v1/responses`) endpoints over raw HTTP, on a real server process serving the
//! committed chat fixture (`tests/fixtures/tiny_chat`): bodies, SSE event order,
//! errors in each dialect's shape, tool calls, and greedy output equal to `voom
//! generate` for the same messages.
//!
//! Every test starts its own server (the fixture loads in milliseconds).

use serde_json::{json, Value};

mod common;
use common::*;

/// The events of a server-sent-events body: (`event:` name, `data:` JSON). Every
/// event of these dialects has both.
fn sse_events(text: &str) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        let mut name = None;
        let mut data = None;
        for line in block.lines() {
            if let Some(n) = line.strip_prefix("event:") {
                name = Some(n.trim().to_string());
            } else if let Some(d) = line.strip_prefix("data:") {
                data = Some(
                    serde_json::from_str::<Value>(d.trim_start())
                        .unwrap_or_else(|e| panic!("data is not JSON ({e}): {d}")),
                );
            }
        }
        match (name, data) {
            (Some(n), Some(d)) => out.push((n, d)),
            (None, None) => {} // keep-alive comments, the end
            (n, d) => panic!("an SSE event without both a name and data: {n:?} {d:?}"),
        }
    }
    out
}

/// `voom generate --chat` on the served copy of the fixture, greedy: its JSON line.
fn generate_chat(server: &Server, system: &str, user: &str, max_new_tokens: u64) -> Value {
    let o = voom()
        .args(["generate", "--model"])
        .arg(server.model_dir())
        .args(["--chat", user, "--system", system, "--temperature", "0"])
        .args(["--max-new-tokens", &max_new_tokens.to_string(), "--json"])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "voom generate failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    serde_json::from_str(out.lines().last().unwrap()).unwrap()
}

/// `voom generate --prompt` (raw text with special tokens), greedy: its JSON line.
fn generate_text(server: &Server, prompt: &str, max_new_tokens: u64) -> Value {
    let o = voom()
        .args(["generate", "--model"])
        .arg(server.model_dir())
        .args(["--prompt", prompt, "--temperature", "0"])
        .args(["--max-new-tokens", &max_new_tokens.to_string(), "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    serde_json::from_str(out.lines().last().unwrap()).unwrap()
}

fn message(system: &str, user: &str, max_tokens: u64) -> Value {
    json!({
        "model": MODEL,
        "max_tokens": max_tokens,
        "system": system,
        "messages": [{"role": "user", "content": user}],
        "temperature": 0,
    })
}

/// The text blocks of a Messages response, concatenated.
fn message_text(j: &Value) -> String {
    j["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "text")
        .map(|b| b["text"].as_str().unwrap())
        .collect()
}

#[test]
fn messages_greedy_text_equals_voom_generate_streamed_or_not() {
    let server = Server::start(&[]);
    let (system, user) = ("You are terse.", "Tell me about the sea.");
    let g = generate_chat(&server, system, user, 24);
    let want = g["text"].as_str().unwrap();
    assert!(!want.is_empty());
    let stop_reason = if g["finish_reason"] == "stop" {
        "end_turn"
    } else {
        "max_tokens"
    };
    for path in ["/v1/messages", "/messages"] {
        let r = server.post_json(path, &message(system, user, 24));
        assert_eq!(r.status, 200, "{}\n{}", r.text(), server.log());
        assert!(r
            .header("x-voom-checkpoint")
            .unwrap()
            .starts_with("tiny-chat@"));
        assert!(r.header("x-voom-profile").is_some());
        // Every response names its backend (a CPU one here: batch invariant, so
        // nothing was turned off).
        let backend = r.header("x-voom-backend").unwrap().to_string();
        assert!(backend.starts_with("cpu-"), "{backend}");
        let j = r.json();
        assert_eq!(j["voom"]["backend"], backend.as_str(), "{j}");
        assert_eq!(j["voom"]["exactness_note"], Value::Null, "{j}");
        assert!(j["id"].as_str().unwrap().starts_with("msg_"), "{j}");
        assert_eq!(j["type"], "message");
        assert_eq!(j["role"], "assistant");
        assert_eq!(j["model"], MODEL);
        assert_eq!(message_text(&j), want, "{j}");
        assert_eq!(j["stop_reason"], stop_reason);
        assert_eq!(j["stop_sequence"], Value::Null);
        assert_eq!(
            j["usage"]["input_tokens"],
            g["prompt_ids"].as_array().unwrap().len()
        );
        assert_eq!(j["usage"]["output_tokens"], g["usage"]["completion_tokens"]);
        assert_eq!(j["voom"]["exact"], true);
        assert!(j["voom"]["checkpoint"]
            .as_str()
            .unwrap()
            .starts_with("tiny-chat@"));
    }
    // Streamed: Anthropic's event order, the same text.
    let mut body = message(system, user, 24);
    body["stream"] = true.into();
    let r = server.post_json("/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    assert!(r.header("x-voom-checkpoint").is_some());
    let events = sse_events(&r.text());
    for (name, data) in &events {
        assert_eq!(data["type"], name.as_str(), "event name and type differ");
    }
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let deltas = names
        .iter()
        .filter(|n| **n == "content_block_delta")
        .count();
    assert!(deltas >= 1);
    let mut expected = vec!["message_start", "content_block_start", "ping"];
    expected.extend(std::iter::repeat_n("content_block_delta", deltas));
    expected.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(names, expected);
    let start = &events[0].1["message"];
    assert!(start["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["stop_reason"], Value::Null);
    assert_eq!(
        start["usage"]["input_tokens"],
        g["prompt_ids"].as_array().unwrap().len()
    );
    assert_eq!(
        events[1].1["content_block"],
        json!({"type": "text", "text": ""})
    );
    let text: String = events
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| {
            assert_eq!(d["index"], 0);
            assert_eq!(d["delta"]["type"], "text_delta");
            d["delta"]["text"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(text, want);
    let delta = &events[events.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], stop_reason);
    assert_eq!(
        delta["usage"]["output_tokens"],
        g["usage"]["completion_tokens"]
    );
}

#[test]
fn messages_stop_sequences_and_prefill() {
    let server = Server::start(&[]);
    let plain = server.post_json("/v1/messages", &message("Be kind.", "Hello", 20));
    assert_eq!(plain.status, 200, "{}", plain.text());
    let p = plain.json();
    let text = message_text(&p);
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 4, "{text}");
    let stop: String = chars[2..4].iter().collect();
    let mut body = message("Be kind.", "Hello", 20);
    body["stop_sequences"] = json!([stop]);
    let cut = server.post_json("/v1/messages", &body).json();
    assert_eq!(cut["stop_reason"], "stop_sequence", "{cut}");
    assert_eq!(cut["stop_sequence"], stop.as_str());
    assert_eq!(message_text(&cut), text[..text.find(&stop).unwrap()]);
    // A final assistant message is continued: the prompt is the template's
    // generation prompt followed by its text (the fixture's ChatML), so the answer
    // equals `voom generate --prompt` on that text.
    let prefill = "Well,";
    let body = json!({
        "model": MODEL, "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": prefill}],
    });
    let r = server.post_json("/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let j = r.json();
    let g = generate_text(
        &server,
        &format!("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n{prefill}"),
        12,
    );
    assert_eq!(message_text(&j), g["text"].as_str().unwrap(), "{j}");
    assert_eq!(
        j["usage"]["input_tokens"],
        g["prompt_ids"].as_array().unwrap().len()
    );
}

#[test]
fn messages_errors_have_anthropics_shape_before_any_model_work() {
    let server = Server::start(&[]);
    let user = json!([{"role": "user", "content": "Hi"}]);
    let bad = "invalid_request_error";
    let r = server.post("/v1/messages", b"{\"model\": ");
    assert_anthropic_error(&r, 400, bad, "JSON", "malformed JSON");
    let r = server.post("/v1/messages", b"[1, 2]");
    assert_anthropic_error(&r, 400, bad, "object", "not an object");
    for (what, body, field) in [
        (
            "missing max_tokens",
            json!({"model": MODEL, "messages": user}),
            "max_tokens",
        ),
        (
            "max_tokens a string",
            json!({"model": MODEL, "max_tokens": "5", "messages": user}),
            "max_tokens",
        ),
        (
            "empty messages",
            json!({"model": MODEL, "max_tokens": 5, "messages": []}),
            "messages",
        ),
        (
            "messages not a list",
            json!({"model": MODEL, "max_tokens": 5, "messages": "Hi"}),
            "messages",
        ),
        (
            "content a number",
            json!({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": 7}]}),
            "messages[0].content",
        ),
        (
            "a system role in messages",
            json!({"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}),
            "messages[0].role",
        ),
        (
            "temperature above 1",
            json!({"model": MODEL, "max_tokens": 5, "messages": user, "temperature": 1.5}),
            "temperature",
        ),
        (
            "an image",
            json!({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}),
            "messages[0].content[0].type",
        ),
        (
            "thinking on a model without a reasoning format",
            json!({"model": MODEL, "max_tokens": 5000, "messages": user, "thinking": {"type": "enabled", "budget_tokens": 2000}}),
            "thinking",
        ),
        (
            "an unknown field",
            json!({"model": MODEL, "max_tokens": 5, "messages": user, "frequency_penalty": 1}),
            "frequency_penalty",
        ),
        (
            "stop_sequences with a number",
            json!({"model": MODEL, "max_tokens": 5, "messages": user, "stop_sequences": ["a", 1]}),
            "stop_sequences",
        ),
        (
            "tool_choice naming a tool not offered",
            json!({"model": MODEL, "max_tokens": 5, "messages": user,
                   "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                   "tool_choice": {"type": "tool", "name": "g"}}),
            "tool_choice",
        ),
    ] {
        let r = server.post_json("/v1/messages", &body);
        assert_anthropic_error(&r, 400, bad, field, what);
    }
    let r = server.post_json(
        "/v1/messages",
        &json!({"model": "no-such-model", "max_tokens": 5, "messages": user}),
    );
    assert_anthropic_error(&r, 404, "not_found_error", "no-such-model", "unknown model");
    // A prompt longer than the context.
    let long = "word ".repeat(3000);
    let r = server.post_json(
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": long}]}),
    );
    assert_anthropic_error(&r, 400, bad, "context", "prompt too long");
    // Nothing above reached the engine: no model was loaded (a valid request does
    // load it, so the log would say).
    assert!(!server.log().contains("loaded model"), "{}", server.log());
    let r = server.post_json("/v1/messages", &message("x", "Hi", 2));
    assert_eq!(r.status, 200, "{}", r.text());
    server.wait_for_log("loaded model");
}

fn weather_tool() -> Value {
    json!({
        "name": "get_weather",
        "description": "The weather of a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": false,
        },
    })
}

#[test]
fn messages_tool_use_round_trip_streamed_and_not() {
    let server = Server::start(&[]);
    let ask = json!({"role": "user", "content": "Weather in Oslo?"});
    let body = json!({
        "model": MODEL, "max_tokens": 200, "temperature": 0,
        "tools": [weather_tool()], "tool_choice": {"type": "any"},
        "messages": [ask],
    });
    let r = server.post_json("/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let j = r.json();
    assert_eq!(j["stop_reason"], "tool_use", "{j}");
    let uses: Vec<&Value> = j["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .collect();
    assert!(!uses.is_empty(), "{j}");
    let first = uses[0];
    assert!(first["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(first["name"], "get_weather");
    assert!(first["input"]["city"].is_string(), "{j}");
    // Streamed: each call is a tool_use block whose input arrives as JSON deltas.
    let mut sbody = body.clone();
    sbody["stream"] = true.into();
    let events = sse_events(&server.post_json("/v1/messages", &sbody).text());
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[..2], ["message_start", "ping"]);
    assert_eq!(names[names.len() - 2..], ["message_delta", "message_stop"]);
    assert_eq!(
        events[events.len() - 2].1["delta"]["stop_reason"],
        "tool_use"
    );
    let mut streamed = Vec::new();
    let mut i = 2;
    while i < events.len() - 2 {
        let (n, d) = &events[i];
        assert_eq!(n, "content_block_start");
        let index = d["index"].clone();
        let block = d["content_block"].clone();
        let mut partial = String::new();
        let mut text = String::new();
        i += 1;
        while events[i].0 == "content_block_delta" {
            assert_eq!(events[i].1["index"], index);
            let delta = &events[i].1["delta"];
            match delta["type"].as_str().unwrap() {
                "input_json_delta" => partial += delta["partial_json"].as_str().unwrap(),
                "text_delta" => text += delta["text"].as_str().unwrap(),
                other => panic!("delta type {other}"),
            }
            i += 1;
        }
        assert_eq!(events[i].0, "content_block_stop");
        assert_eq!(events[i].1["index"], index);
        i += 1;
        if block["type"] == "tool_use" {
            assert_eq!(block["input"], json!({}));
            let mut b = block.clone();
            b["input"] = serde_json::from_str(&partial).unwrap();
            streamed.push(b);
        } else {
            assert_eq!(block["type"], "text");
            streamed.push(json!({"type": "text", "text": text}));
        }
    }
    let strip = |b: &Value| {
        let mut b = b.clone();
        b.as_object_mut().unwrap().remove("id");
        b
    };
    assert_eq!(
        streamed.iter().map(strip).collect::<Vec<_>>(),
        j["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(strip)
            .collect::<Vec<_>>()
    );
    // The result goes back as a tool_result; the answer is text.
    let result = json!({
        "model": MODEL, "max_tokens": 8, "temperature": 0,
        "tools": [weather_tool()],
        "messages": [
            ask,
            {"role": "assistant", "content": j["content"]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first["id"],
                                          "content": [{"type": "text", "text": "12 C"}]}]},
        ],
    });
    let r = server.post_json("/v1/messages", &result);
    assert_eq!(r.status, 200, "{}", r.text());
    let k = r.json();
    assert!(
        k["usage"]["input_tokens"].as_u64() > j["usage"]["input_tokens"].as_u64(),
        "{k}"
    );
    assert!(["end_turn", "max_tokens", "tool_use"].contains(&k["stop_reason"].as_str().unwrap()));
}

#[test]
fn responses_text_stream_and_greedy_equal_voom_generate() {
    let server = Server::start(&[]);
    let (system, user) = ("You are terse.", "Tell me about the sea.");
    let g = generate_chat(&server, system, user, 16);
    let want = g["text"].as_str().unwrap();
    let body = json!({
        "model": MODEL, "instructions": system, "input": user,
        "max_output_tokens": 16, "temperature": 0,
    });
    let complete = g["finish_reason"] == "stop";
    for path in ["/v1/responses", "/responses"] {
        let r = server.post_json(path, &body);
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(r.header("x-voom-checkpoint").is_some());
        let j = r.json();
        assert!(j["id"].as_str().unwrap().starts_with("resp_"));
        assert_eq!(j["object"], "response");
        assert_eq!(
            j["status"],
            if complete { "completed" } else { "incomplete" }
        );
        if !complete {
            assert_eq!(j["incomplete_details"]["reason"], "max_output_tokens");
        }
        assert_eq!(j["output"][0]["type"], "message");
        assert_eq!(j["output"][0]["role"], "assistant");
        assert_eq!(j["output"][0]["content"][0]["type"], "output_text");
        assert_eq!(j["output"][0]["content"][0]["text"], want);
        assert_eq!(j["output"][0]["content"][0]["annotations"], json!([]));
        let u = &j["usage"];
        assert_eq!(u["input_tokens"], g["prompt_ids"].as_array().unwrap().len());
        assert_eq!(u["output_tokens"], g["usage"]["completion_tokens"]);
        assert_eq!(u["input_tokens_details"]["cached_tokens"], 0);
        assert_eq!(u["output_tokens_details"]["reasoning_tokens"], 0);
        for key in [
            "parallel_tool_calls",
            "tool_choice",
            "tools",
            "created_at",
            "voom",
        ] {
            assert!(!j[key].is_null(), "{key}: {j}");
        }
    }
    let mut sbody = body.clone();
    sbody["stream"] = true.into();
    let r = server.post_json("/v1/responses", &sbody);
    assert_eq!(r.status, 200);
    let events = sse_events(&r.text());
    for (k, (name, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], name.as_str());
        assert_eq!(data["sequence_number"], k, "{name}");
    }
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let deltas = names
        .iter()
        .filter(|n| **n == "response.output_text.delta")
        .count();
    let mut expected = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    expected.extend(std::iter::repeat_n("response.output_text.delta", deltas));
    expected.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        if complete {
            "response.completed"
        } else {
            "response.incomplete"
        },
    ]);
    assert_eq!(names, expected);
    let text: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, want);
    let item_id = &events[2].1["item"]["id"];
    assert!(events[4..events.len() - 1]
        .iter()
        .filter(|(n, _)| n.contains("text") || n.contains("part"))
        .all(|(_, d)| d["item_id"] == *item_id));
    let last = &events.last().unwrap().1["response"];
    assert_eq!(last["output"][0]["content"][0]["text"], want);
    assert_eq!(last["output"][0]["id"], *item_id);
    assert_eq!(events[0].1["response"]["status"], "in_progress");
}

#[test]
fn responses_errors_are_openai_shaped_and_state_is_refused() {
    let server = Server::start(&[]);
    let r = server.post("/v1/responses", b"{\"model\": ");
    assert_openai_error(&r, 400, "body", "malformed JSON");
    for (what, body, param) in [
        ("no input", json!({"model": MODEL}), "input"),
        ("no model", json!({"input": "x"}), "model"),
        (
            "input a number",
            json!({"model": MODEL, "input": 3}),
            "input",
        ),
        (
            "previous_response_id",
            json!({"model": MODEL, "input": "x", "previous_response_id": "resp_1"}),
            "previous_response_id",
        ),
        (
            "store true",
            json!({"model": MODEL, "input": "x", "store": true}),
            "store",
        ),
        (
            "background",
            json!({"model": MODEL, "input": "x", "background": true}),
            "background",
        ),
        (
            "a reasoning effort on a model without a reasoning format",
            json!({"model": MODEL, "input": "x", "reasoning": {"effort": "high"}}),
            "reasoning.effort",
        ),
        (
            "unknown parameter",
            json!({"model": MODEL, "input": "x", "n": 2}),
            "n",
        ),
        (
            "an image",
            json!({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}),
            "input[0].content[0].type",
        ),
        (
            "a bad schema",
            json!({"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integr"}}}}}}),
            "response_format",
        ),
    ] {
        let r = server.post_json("/v1/responses", &body);
        assert_openai_error(&r, 400, param, what);
    }
    let r = server.post_json(
        "/v1/responses",
        &json!({"model": "no-such-model", "input": "x"}),
    );
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    assert!(!server.log().contains("loaded model"), "{}", server.log());
    let r = server.post_json(
        "/v1/responses",
        &json!({"model": MODEL, "input": "x", "max_output_tokens": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    server.wait_for_log("loaded model");
}

#[test]
fn responses_function_call_round_trip_and_json_output() {
    let server = Server::start(&[]);
    let tool = json!({
        "type": "function", "name": "get_weather", "description": "The weather of a city",
        "parameters": weather_tool()["input_schema"].clone(),
    });
    let body = json!({
        "model": MODEL, "input": "Weather in Oslo?", "max_output_tokens": 200,
        "temperature": 0, "tools": [tool], "tool_choice": "required",
        "parallel_tool_calls": false,
    });
    let j = server.post_json("/v1/responses", &body).json();
    assert_eq!(j["status"], "completed", "{j}");
    let calls: Vec<&Value> = j["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["type"] == "function_call")
        .collect();
    assert_eq!(calls.len(), 1, "parallel calls are off: {j}");
    let call = calls[0];
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["status"], "completed");
    assert!(call["call_id"].as_str().unwrap().starts_with("call_"));
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"].is_string());
    assert_eq!(j["parallel_tool_calls"], false);
    assert_eq!(j["tools"][0]["name"], "get_weather");
    // Streamed: the call is an output item with its arguments.
    let mut sbody = body.clone();
    sbody["stream"] = true.into();
    let events = sse_events(&server.post_json("/v1/responses", &sbody).text());
    let done: Vec<&Value> = events
        .iter()
        .filter(|(n, _)| n == "response.function_call_arguments.done")
        .map(|(_, d)| d)
        .collect();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0]["arguments"], call["arguments"]);
    assert_eq!(events.last().unwrap().0, "response.completed");
    // The output goes back; the next answer is a message.
    let back = json!({
        "model": MODEL, "max_output_tokens": 8, "temperature": 0, "tools": [tool],
        "input": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": call["call_id"], "name": "get_weather", "arguments": call["arguments"]},
            {"type": "function_call_output", "call_id": call["call_id"], "output": "12 C"},
        ],
    });
    let k = server.post_json("/v1/responses", &back).json();
    assert!(
        k["usage"]["input_tokens"].as_u64() > j["usage"]["input_tokens"].as_u64(),
        "{k}"
    );
    // JSON-schema output parses and satisfies the schema.
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": false});
    let j = server
        .post_json(
            "/v1/responses",
            &json!({"model": MODEL, "input": "A number as JSON", "max_output_tokens": 40, "temperature": 0,
                    "text": {"format": {"type": "json_schema", "name": "num", "schema": schema, "strict": true}}}),
        )
        .json();
    assert_eq!(j["status"], "completed", "{j}");
    let v: Value =
        serde_json::from_str(j["output"][0]["content"][0]["text"].as_str().unwrap()).unwrap();
    assert!(v["n"].is_i64(), "{v}");
    assert_eq!(v.as_object().unwrap().len(), 1);
}
