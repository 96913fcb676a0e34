//! `voom serve` over raw HTTP: a real server process on the committed chat fixture
//! (`tests/fixtures/tiny_chat`), driven through plain `TcpStream`s so that malformed
//! requests, stalled and vanishing clients can be sent exactly as written.
//!
//! Every test starts its own server (the fixture loads in milliseconds), so limits
//! (`--max-context`, `--max-body-bytes`, `--receive-timeout`) and counters
//! (`/metrics`) belong to one test.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;
use common::*;

#[test]
fn malformed_openai_requests_are_400_naming_the_field_before_any_model_work() {
    let mut s = Server::start(&[]);
    let user = json!([{"role": "user", "content": "Hi"}]);
    let chat_cases: Vec<(&str, Vec<u8>, &str)> =
        vec![
        ("empty body", b"".to_vec(), "body"),
        ("malformed JSON", b"{\"model\": \"tiny-chat\", ".to_vec(), "body"),
        ("not JSON at all", b"hello".to_vec(), "body"),
        ("body is an array", b"[1, 2]".to_vec(), "body"),
        ("body is a string", b"\"model\"".to_vec(), "body"),
        (
            "model is a number",
            json!({"model": 3, "messages": user}).to_string().into_bytes(),
            "model",
        ),
        (
            "model missing",
            json!({"messages": user}).to_string().into_bytes(),
            "model",
        ),
        (
            "messages is a string",
            json!({"model": MODEL, "messages": "Hi"})
                .to_string()
                .into_bytes(),
            "messages",
        ),
        (
            "messages missing",
            json!({"model": MODEL}).to_string().into_bytes(),
            "messages",
        ),
        (
            "messages empty",
            json!({"model": MODEL, "messages": []})
                .to_string()
                .into_bytes(),
            "messages",
        ),
        (
            "a message is a string",
            json!({"model": MODEL, "messages": ["Hi"]})
                .to_string()
                .into_bytes(),
            "messages[0]",
        ),
        (
            "unknown role",
            json!({"model": MODEL, "messages": [{"role": "wizard", "content": "Hi"}]})
                .to_string()
                .into_bytes(),
            "messages[0].role",
        ),
        (
            "content is a number",
            json!({"model": MODEL, "messages": [{"role": "user", "content": 7}]})
                .to_string()
                .into_bytes(),
            "messages[0].content",
        ),
        (
            "image content",
            json!({"model": MODEL, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
            .to_string()
            .into_bytes(),
            "messages[0].content[0].type",
        ),
        (
            "temperature is a string",
            json!({"model": MODEL, "messages": user, "temperature": "hot"})
                .to_string()
                .into_bytes(),
            "temperature",
        ),
        (
            "temperature out of range",
            json!({"model": MODEL, "messages": user, "temperature": 5})
                .to_string()
                .into_bytes(),
            "temperature",
        ),
        (
            "top_p out of range",
            json!({"model": MODEL, "messages": user, "top_p": 1.5})
                .to_string()
                .into_bytes(),
            "top_p",
        ),
        (
            "max_tokens zero",
            json!({"model": MODEL, "messages": user, "max_tokens": 0})
                .to_string()
                .into_bytes(),
            "max_tokens",
        ),
        (
            "max_tokens negative",
            json!({"model": MODEL, "messages": user, "max_tokens": -3})
                .to_string()
                .into_bytes(),
            "max_tokens",
        ),
        (
            "stream is a string",
            json!({"model": MODEL, "messages": user, "stream": "yes"})
                .to_string()
                .into_bytes(),
            "stream",
        ),
        (
            "stop holds a number",
            json!({"model": MODEL, "messages": user, "stop": ["a", 1]})
                .to_string()
                .into_bytes(),
            "stop",
        ),
        (
            "seed is a string",
            json!({"model": MODEL, "messages": user, "seed": "1"})
                .to_string()
                .into_bytes(),
            "seed",
        ),
        (
            "several choices",
            json!({"model": MODEL, "messages": user, "n": 2})
                .to_string()
                .into_bytes(),
            "n",
        ),
        (
            "logprobs",
            json!({"model": MODEL, "messages": user, "logprobs": true})
                .to_string()
                .into_bytes(),
            "logprobs",
        ),
        (
            "presence penalty",
            json!({"model": MODEL, "messages": user, "presence_penalty": 0.5})
                .to_string()
                .into_bytes(),
            "presence_penalty",
        ),
        (
            "frequency penalty",
            json!({"model": MODEL, "messages": user, "frequency_penalty": -1})
                .to_string()
                .into_bytes(),
            "frequency_penalty",
        ),
        (
            "logit bias",
            json!({"model": MODEL, "messages": user, "logit_bias": {"5": 10}})
                .to_string()
                .into_bytes(),
            "logit_bias",
        ),
        (
            "stream_options without stream",
            json!({"model": MODEL, "messages": user, "stream_options": {"include_usage": true}})
                .to_string()
                .into_bytes(),
            "stream_options",
        ),
    ];
    for (what, body, param) in &chat_cases {
        let r = s.post("/v1/chat/completions", body);
        assert_openai_error(&r, 400, param, what);
    }
    // top_p's range is open below: said in words, not as a 300-digit decimal.
    let r = s.post_json(
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": user, "top_p": 0}),
    );
    assert_openai_error(&r, 400, "top_p", "top_p zero");
    assert_eq!(
        r.json()["error"]["message"],
        "'top_p' must be above 0 and at most 1, not 0"
    );
    let completion_cases: Vec<(&str, Value, &str)> = vec![
        ("prompt missing", json!({"model": MODEL}), "prompt"),
        (
            "prompt is a number",
            json!({"model": MODEL, "prompt": 5}),
            "prompt",
        ),
        (
            "several prompts",
            json!({"model": MODEL, "prompt": ["a", "b"]}),
            "prompt",
        ),
        (
            "token id outside the vocabulary",
            json!({"model": MODEL, "prompt": [1, 99999]}),
            "prompt",
        ),
        (
            "echo",
            json!({"model": MODEL, "prompt": "a", "echo": true}),
            "echo",
        ),
        (
            "best_of",
            json!({"model": MODEL, "prompt": "a", "best_of": 3}),
            "best_of",
        ),
        (
            "temperature out of range",
            json!({"model": MODEL, "prompt": "a", "temperature": 5}),
            "temperature",
        ),
    ];
    for (what, body, param) in &completion_cases {
        let r = s.post_json("/v1/completions", body);
        assert_openai_error(&r, 400, param, what);
    }
    // All of that was refused before any model work: no engine was ever loaded.
    let h = s.get("/health").json();
    assert_eq!(h["resident_model"], Value::Null, "{h}");
    assert_eq!(s.metric("voom_model_loads_total"), 0.0);
    assert_eq!(s.metric("voom_prompt_tokens_total"), 0.0);
    s.assert_healthy();
}

#[test]
fn unknown_model_is_404_listing_the_models_present() {
    let s = Server::start(&[]);
    let r = s.post_json(
        "/v1/chat/completions",
        &json!({"model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(r.status, 404, "{}", r.text());
    let j = r.json();
    assert_eq!(j["error"]["code"], "model_not_found", "{j}");
    let m = j["error"]["message"].as_str().unwrap();
    assert!(m.contains("no-such-model") && m.contains(MODEL), "{m}");
    // Path-like ids do not reach outside the models directory.
    for id in ["../tiny-chat", "..", "/etc", "tiny-chat/../tiny-chat"] {
        let r = s.post_json("/v1/completions", &json!({"model": id, "prompt": "a"}));
        assert_eq!(r.status, 404, "{id}: {}", r.text());
    }
    let r = s.get("/v1/models/no-such-model");
    assert_eq!(r.status, 404, "{}", r.text());
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains(MODEL));
    let r = s.get("/v1/models");
    assert_eq!(r.status, 200);
    let ids: Vec<Value> = r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].clone())
        .collect();
    assert_eq!(ids, vec![json!(MODEL)]);
    let r = s.get(&format!("/v1/models/{MODEL}"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["id"], MODEL);
}

#[test]
fn prompt_longer_than_the_context_is_400_before_any_model_work() {
    let s = Server::start(&["--max-context", "16"]);
    let long = "the quick brown fox jumps over the lazy dog ".repeat(8);
    let r = s.post_json("/v1/chat/completions", &chat(&long, 4));
    assert_openai_error(&r, 400, "messages", "chat over the context");
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("context"),
        "{}",
        r.text()
    );
    let r = s.post_json(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": long, "max_tokens": 4}),
    );
    assert_openai_error(&r, 400, "prompt", "completion over the context");
    let h = s.get("/health").json();
    assert_eq!(h["resident_model"], Value::Null, "{h}");
    // A prompt that fits still runs, its output cut at the context.
    let r = s.post_json(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "a b", "max_tokens": 100, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let u = &r.json()["usage"];
    assert!(u["total_tokens"].as_u64().unwrap() <= 16, "{u}");
}

/// The Anthropic Messages endpoint answers in its own error shape.
#[test]
fn malformed_anthropic_requests_are_4xx_in_anthropic_shape() {
    let s = Server::start(&["--max-context", "16"]);
    let user = json!([{"role": "user", "content": "Hi"}]);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("malformed JSON", b"{\"model\": ".to_vec(), "JSON"),
        ("body is an array", b"[]".to_vec(), "object"),
        (
            "model is a number",
            json!({"model": 3, "max_tokens": 8, "messages": user})
                .to_string()
                .into_bytes(),
            "model",
        ),
        (
            "messages is a string",
            json!({"model": MODEL, "max_tokens": 8, "messages": "Hi"})
                .to_string()
                .into_bytes(),
            "messages",
        ),
        (
            "messages empty",
            json!({"model": MODEL, "max_tokens": 8, "messages": []})
                .to_string()
                .into_bytes(),
            "messages",
        ),
        (
            "max_tokens missing",
            json!({"model": MODEL, "messages": user})
                .to_string()
                .into_bytes(),
            "max_tokens",
        ),
        (
            "temperature is a string",
            json!({"model": MODEL, "max_tokens": 8, "messages": user, "temperature": "hot"})
                .to_string()
                .into_bytes(),
            "temperature",
        ),
        (
            "temperature out of range",
            json!({"model": MODEL, "max_tokens": 8, "messages": user, "temperature": 5})
                .to_string()
                .into_bytes(),
            "temperature",
        ),
        (
            "system is a number",
            json!({"model": MODEL, "max_tokens": 8, "messages": user, "system": 1})
                .to_string()
                .into_bytes(),
            "system",
        ),
        (
            "stop_sequences is a string",
            json!({"model": MODEL, "max_tokens": 8, "messages": user, "stop_sequences": "x"})
                .to_string()
                .into_bytes(),
            "stop_sequences",
        ),
        (
            "prompt over the context",
            json!({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user",
                "content": "the quick brown fox jumps over the lazy dog ".repeat(8)}]})
            .to_string()
            .into_bytes(),
            "context",
        ),
    ];
    for (what, body, field) in &cases {
        let r = s.post("/v1/messages", body);
        assert_anthropic_error(&r, 400, "invalid_request_error", field, what);
    }
    let r = s.post_json(
        "/v1/messages",
        &json!({"model": "no-such-model", "max_tokens": 8, "messages": user}),
    );
    assert_anthropic_error(&r, 404, "not_found_error", "no-such-model", "unknown model");
    // Unknown fields are refused, as Anthropic does.
    let r = s.post_json(
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 8, "messages": user, "n": 2}),
    );
    assert_anthropic_error(&r, 400, "invalid_request_error", "n", "unknown field");
    let h = s.get("/health").json();
    assert_eq!(h["resident_model"], Value::Null, "{h}");
}

/// The Responses endpoint speaks OpenAI's error shape; what needs stored state is
/// refused (the server is stateless).
#[test]
fn malformed_responses_requests_are_400_naming_the_field() {
    let s = Server::start(&["--max-context", "16"]);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("malformed JSON", b"{\"input\": ".to_vec(), "body"),
        (
            "input missing",
            json!({"model": MODEL}).to_string().into_bytes(),
            "input",
        ),
        (
            "input is a number",
            json!({"model": MODEL, "input": 3}).to_string().into_bytes(),
            "input",
        ),
        (
            "input empty",
            json!({"model": MODEL, "input": []})
                .to_string()
                .into_bytes(),
            "input",
        ),
        (
            "model is a number",
            json!({"model": 1, "input": "Hi"}).to_string().into_bytes(),
            "model",
        ),
        (
            "temperature out of range",
            json!({"model": MODEL, "input": "Hi", "temperature": 5})
                .to_string()
                .into_bytes(),
            "temperature",
        ),
        (
            "previous_response_id (stateful)",
            json!({"model": MODEL, "input": "Hi", "previous_response_id": "resp_1"})
                .to_string()
                .into_bytes(),
            "previous_response_id",
        ),
    ];
    for (what, body, param) in &cases {
        let r = s.post("/v1/responses", body);
        assert_openai_error(&r, 400, param, what);
    }
    let r = s.post_json(
        "/v1/responses",
        &json!({"model": "no-such-model", "input": "Hi"}),
    );
    assert_eq!(r.status, 404, "{}", r.text());
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains(MODEL));
    let r = s.post_json(
        "/v1/responses",
        &json!({"model": MODEL, "input": "the quick brown fox jumps over the lazy dog ".repeat(8)}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("context"), "{}", r.text());
    let h = s.get("/health").json();
    assert_eq!(h["resident_model"], Value::Null, "{h}");
}

#[test]
fn a_body_over_the_limit_is_413() {
    let mut s = Server::start(&["--max-body-bytes", "1024"]);
    let big = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "x".repeat(4000)}],
    })
    .to_string();
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let r = s.post(path, big.as_bytes());
        assert_eq!(r.status, 413, "{path}: {}", r.text());
        assert_eq!(
            r.json()["error"]["code"],
            "request_too_large",
            "{}",
            r.text()
        );
    }
    for path in ["/v1/messages", "/messages"] {
        let r = s.post(path, big.as_bytes());
        assert_anthropic_error(&r, 413, "request_too_large", "1024", path);
    }
    let r = s.post("/v1/responses", big.as_bytes());
    assert_eq!(r.status, 413, "responses: {}", r.text());
    // Without a Content-Length (chunked), the limit holds too.
    let mut c = connect(s.addr);
    let mut msg = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
        s.addr
    )
    .into_bytes();
    for piece in big.as_bytes().chunks(500) {
        msg.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
        msg.extend_from_slice(piece);
        msg.extend_from_slice(b"\r\n");
    }
    msg.extend_from_slice(b"0\r\n\r\n");
    let _ = c.write_all(&msg);
    let r = read_reply(&mut c);
    assert_eq!(r.status, 413, "chunked: {}", r.text());
    // A body just under the limit is read (and refused only for its content).
    let small = json!({"model": MODEL, "messages": [], "pad": "y".repeat(900)}).to_string();
    assert!(small.len() < 1024);
    let r = s.post("/v1/chat/completions", small.as_bytes());
    assert_openai_error(&r, 400, "messages", "under the limit");
    s.assert_healthy();
}

#[test]
fn a_stalled_client_is_cut_off_after_the_receive_timeout() {
    let mut s = Server::start(&["--receive-timeout", "1"]);
    // Headers, then only part of the promised body.
    let t = Instant::now();
    let mut c = connect(s.addr);
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    c.write_all(head("POST", "/v1/chat/completions", s.addr, Some(200)).as_bytes())
        .unwrap();
    c.write_all(b"{\"model\": \"tiny-chat\", ").unwrap();
    let mut raw = Vec::new();
    let r = c.read_to_end(&mut raw);
    let waited = t.elapsed();
    assert!(
        r.is_ok()
            || r.as_ref()
                .is_err_and(|e| e.kind() == ErrorKind::ConnectionReset),
        "the server did not close the connection: {r:?}"
    );
    if !raw.is_empty() {
        let reply = parse_reply(&raw).expect("an HTTP reply");
        assert_eq!(reply.status, 408, "{}", reply.text());
    }
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(10),
        "cut off after {waited:?}"
    );
    // Only part of the headers.
    let t = Instant::now();
    let mut c = connect(s.addr);
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    c.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let mut raw = Vec::new();
    let r = c.read_to_end(&mut raw);
    assert!(
        r.is_ok()
            || r.as_ref()
                .is_err_and(|e| e.kind() == ErrorKind::ConnectionReset),
        "the server did not close the connection: {r:?}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "cut off after {:?}",
        t.elapsed()
    );
    s.assert_healthy();
}

/// A completion whose greedy output on the fixture runs to `max_tokens` (2000) with
/// no end-of-sequence token: the one-token prompt [12] (found by trying every
/// one-token prompt; the test checks it still holds).
fn long_completion(stream: bool) -> Value {
    json!({
        "model": MODEL,
        "prompt": [12],
        "max_tokens": 2000,
        "temperature": 0,
        "stream": stream,
    })
}

#[test]
fn a_client_that_disconnects_mid_stream_frees_the_engine() {
    let s = Server::start(&[]);
    // How long the whole generation takes when nobody leaves.
    let full = s.post_json("/v1/completions", &long_completion(false));
    assert_eq!(full.status, 200, "{}", full.text());
    let fj = full.json();
    assert_eq!(
        fj["choices"][0]["finish_reason"], "length",
        "the prompt must not stop early: {}",
        fj["usage"]
    );
    let full_secs = fj["voom"]["timings"]["decode_secs"].as_f64().unwrap();
    assert_eq!(s.metric("voom_requests_cancelled_total"), 0.0);

    // Stream it, read a few events, vanish.
    let text = long_completion(true).to_string();
    let mut c = connect(s.addr);
    c.write_all(head("POST", "/v1/completions", s.addr, Some(text.len())).as_bytes())
        .unwrap();
    c.write_all(text.as_bytes()).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while sse_data(&String::from_utf8_lossy(&seen)).len() < 3 {
        let n = c.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(String::from_utf8_lossy(&seen).starts_with("HTTP/1.1 200"));
    drop(c);

    // The next request runs as soon as the engine notices, not after the abandoned
    // generation's remaining ~2000 tokens.
    let r = s.post_json("/v1/chat/completions", &chat("Hello", 8));
    assert_eq!(r.status, 200, "{}", r.text());
    let queue = r.json()["voom"]["timings"]["queue_secs"].as_f64().unwrap();
    eprintln!("queued {queue:.4}s after the disconnect; the whole generation: {full_secs:.4}s");
    assert!(
        queue < 0.75 * full_secs,
        "the next request queued {queue:.3}s; the whole abandoned generation takes {full_secs:.3}s"
    );
    // The worker stopped the abandoned request (rather than finishing it).
    assert_eq!(s.metric("voom_requests_cancelled_total"), 1.0);
    // Idle again (the gauge drops just after the reply is sent: poll).
    let t = Instant::now();
    while s.metric("voom_engine_busy") != 0.0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the engine stays busy"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Sends a request on a fresh connection and returns the connection unread.
fn send_only(addr: SocketAddr, path: &str, body: &Value) -> TcpStream {
    let text = body.to_string();
    let mut c = connect(addr);
    c.write_all(head("POST", path, addr, Some(text.len())).as_bytes())
        .unwrap();
    c.write_all(text.as_bytes()).unwrap();
    c
}

#[test]
fn a_client_that_leaves_before_its_answer_frees_the_engine() {
    // One request at a time, so that B waits in the queue while A runs (batched,
    // it would join A's steps).
    let s = Server::start(&["--max-batch", "1"]);
    // Non-streaming, gone while its request runs.
    let c = send_only(s.addr, "/v1/completions", &long_completion(false));
    let t = Instant::now();
    while s.get("/health").json()["resident_model"] != MODEL {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the request never ran"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    drop(c);
    let t = Instant::now();
    while s.metric("voom_requests_cancelled_total") < 1.0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "a non-streaming request whose client left was not cancelled"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // The tokens the cancelled request did generate are counted (recorded before the
    // cancellation is).
    let before = s.metric("voom_completion_tokens_total");
    // Gone while queued: it never runs. A streams (read to its end later); B queues
    // behind it and leaves; then C runs.
    let mut a = send_only(s.addr, "/v1/completions", &long_completion(true));
    let mut buf = [0u8; 256];
    let n = a.read(&mut buf).unwrap();
    assert!(n > 0);
    let b = send_only(s.addr, "/v1/completions", &long_completion(false));
    let t = Instant::now();
    while s.metric("voom_queue_depth") < 1.0 {
        assert!(t.elapsed() < Duration::from_secs(10), "B never queued");
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(b);
    let a = read_reply_after(&mut a, buf[..n].to_vec());
    assert_eq!(a.status, 200);
    let data = a.sse_data();
    assert_eq!(
        data.last().map(String::as_str),
        Some("[DONE]"),
        "A was cut short"
    );
    let r = s.post_json(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "Hi",
        "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(s.metric("voom_requests_cancelled_total"), 2.0);
    // Since then only A (2000 tokens) and the last request (3) ran; B never did.
    assert_eq!(s.metric("voom_completion_tokens_total") - before, 2003.0);
}

#[test]
fn queued_requests_wait_and_all_succeed() {
    let s = Server::start(&[]);
    let addr = s.addr;
    let body = chat("Tell me a story about a cat", 48).to_string();
    let handles: Vec<_> = (0..3)
        .map(|_| {
            let body = body.clone();
            std::thread::spawn(move || {
                request(addr, "POST", "/v1/chat/completions", Some(body.as_bytes()))
            })
        })
        .collect();
    let replies: Vec<Reply> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let mut texts = Vec::new();
    for r in &replies {
        assert_eq!(r.status, 200, "{}\nlog:\n{}", r.text(), s.log());
        texts.push(r.json()["choices"][0]["message"]["content"].clone());
    }
    // Greedy: whatever order they ran in, each got the same answer.
    assert!(texts.iter().all(|t| *t == texts[0]), "{texts:?}");
    assert_eq!(s.metric("voom_queue_depth"), 0.0);
    assert_eq!(s.metric("voom_model_loads_total"), 1.0);
}

#[test]
fn health_and_metrics_formats() {
    let s = Server::start(&[]);
    let h = s.get("/health");
    assert_eq!(h.status, 200);
    assert!(h
        .header("content-type")
        .unwrap()
        .starts_with("application/json"));
    let j = h.json();
    assert_eq!(j["status"], "ok");
    assert_eq!(j["models"], json!([MODEL]), "{j}");
    assert!(
        j["profile"].is_string() && j["profile_digest"].is_string(),
        "{j}"
    );
    assert!(
        j["queue_depth"].is_u64() && j["uptime_secs"].is_f64(),
        "{j}"
    );

    let r = s.post_json("/v1/chat/completions", &chat("Hello there", 12));
    assert_eq!(r.status, 200, "{}", r.text());
    let usage = r.json()["usage"].clone();
    assert_eq!(s.get("/health").json()["resident_model"], MODEL);

    let m = s.get("/metrics");
    assert_eq!(m.status, 200);
    assert!(
        m.header("content-type").unwrap().starts_with("text/plain"),
        "{:?}",
        m.header("content-type")
    );
    let text = m.text();
    // Prometheus text format: every sample is `name{labels} value`, and every metric
    // name has its HELP and TYPE lines.
    let mut typed = std::collections::HashSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split(' ');
            let name = it.next().unwrap();
            let ty = it.next().unwrap();
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&ty),
                "{line}"
            );
            typed.insert(name.to_string());
        } else if line.starts_with("# HELP ") || line.is_empty() {
        } else {
            let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line}"));
            value
                .parse::<f64>()
                .unwrap_or_else(|e| panic!("value of '{line}': {e}"));
            let name = series.split('{').next().unwrap();
            assert!(
                name.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
                "{line}"
            );
            assert!(typed.contains(name), "no TYPE before {line}");
            if let Some(labels) = series.strip_prefix(name) {
                if !labels.is_empty() {
                    assert!(labels.starts_with('{') && labels.ends_with('}'), "{line}");
                }
            }
        }
    }
    for name in [
        "voom_requests_total",
        "voom_prompt_tokens_total",
        "voom_completion_tokens_total",
        "voom_decode_tokens_per_second",
        "voom_queue_depth",
        "voom_requests_cancelled_total",
        "voom_prefill_page_wait_seconds_total",
        "voom_decode_page_wait_seconds_total",
    ] {
        assert!(typed.contains(name), "{name} missing:\n{text}");
    }
    // The process's memory, where the OS reports it: the peak at least what it
    // holds now, and more than nothing.
    let sample = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .map(|v| v.parse::<f64>().unwrap())
    };
    if let (Some(now), Some(peak)) = (
        sample("voom_resident_bytes"),
        sample("voom_peak_resident_bytes"),
    ) {
        assert!(now > 0.0 && peak >= now, "{now} {peak}");
    } else {
        assert!(!Path::new("/proc/self/status").exists(), "{text}");
    }
    assert!(
        text.contains("voom_requests_total{endpoint=\"/chat/completions\",status=\"200\"} 1"),
        "{text}"
    );
    assert_eq!(
        s.metric("voom_completion_tokens_total"),
        usage["completion_tokens"].as_f64().unwrap()
    );
    assert_eq!(
        s.metric("voom_prompt_tokens_total"),
        usage["prompt_tokens"].as_f64().unwrap()
    );
    assert!(s.metric("voom_decode_tokens_per_second") > 0.0);
}

#[test]
fn routes_without_v1_work_unknown_routes_are_404_and_wrong_methods_405() {
    let s = Server::start(&[]);
    let r = s.get("/models");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["data"][0]["id"], MODEL);
    let a = s.post_json("/chat/completions", &chat("Hi", 6));
    let b = s.post_json("/v1/chat/completions", &chat("Hi", 6));
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(b.status, 200, "{}", b.text());
    assert_eq!(
        a.json()["choices"][0]["message"]["content"],
        b.json()["choices"][0]["message"]["content"]
    );
    let r = s.post_json(
        "/completions",
        &json!({"model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    for (method, path) in [
        ("GET", "/v1/nope"),
        ("POST", "/v2/chat/completions"),
        ("GET", "/"),
        ("DELETE", "/v1/models/x/y"),
    ] {
        let r = request(s.addr, method, path, None);
        assert_eq!(r.status, 404, "{method} {path}: {}", r.text());
        let j = r.json();
        assert!(
            j["error"]["message"].as_str().unwrap().contains(path),
            "{j}"
        );
    }
    // An unknown route ending in /messages answers in Anthropic's shape.
    let r = request(s.addr, "POST", "/v2/messages", Some(b"{}"));
    assert_anthropic_error(&r, 404, "not_found_error", "/v2/messages", "/v2/messages");
    // A route that exists with the wrong method is refused, not run: 405 in the
    // endpoint's dialect, with the method it takes in Allow.
    for (method, path, allow) in [
        ("GET", "/v1/chat/completions", "POST"),
        ("GET", "/responses", "POST"),
        ("POST", "/v1/models", "GET"),
        ("DELETE", "/v1/models/x", "GET"),
        ("POST", "/health", "GET"),
    ] {
        let r = request(s.addr, method, path, None);
        assert_eq!(r.status, 405, "{method} {path}: {}", r.text());
        assert_eq!(r.header("allow"), Some(allow), "{method} {path}");
        let j = r.json();
        assert_eq!(j["error"]["code"], "method_not_allowed", "{j}");
        assert!(
            j["error"]["message"].as_str().unwrap().contains(path),
            "{j}"
        );
    }
    let r = request(s.addr, "GET", "/v1/messages", None);
    assert_anthropic_error(
        &r,
        405,
        "invalid_request_error",
        "/v1/messages",
        "GET messages",
    );
    assert_eq!(r.header("allow"), Some("POST"));
}

/// `voom generate --json` on the same model directory.
fn generate(dir: &Path, prompt_flag: &str, prompt: &str, n: u64) -> Value {
    let o = voom()
        .args(["generate", "--model"])
        .arg(dir)
        .args([
            prompt_flag,
            prompt,
            "--temperature",
            "0",
            "--max-new-tokens",
            &n.to_string(),
            "--json",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    serde_json::from_str(out.lines().last().unwrap()).unwrap()
}

#[test]
fn greedy_output_through_the_server_equals_voom_generate() {
    let s = Server::start(&[]);
    let dir = s.model_dir();
    for (prompt, n) in [
        ("Hello, how are you?", 40),
        ("Write a haiku about the sea", 64),
    ] {
        let g = generate(&dir, "--chat", prompt, n);
        let r = s.post_json("/v1/chat/completions", &chat(prompt, n));
        assert_eq!(r.status, 200, "{}", r.text());
        assert!(r
            .header("x-voom-checkpoint")
            .is_some_and(|c| c.starts_with(MODEL)));
        let j = r.json();
        assert_eq!(
            j["choices"][0]["message"]["content"], g["text"],
            "chat {prompt:?}"
        );
        assert_eq!(j["choices"][0]["finish_reason"], g["finish_reason"]);
        assert_eq!(j["usage"]["prompt_tokens"], g["usage"]["prompt_tokens"]);
        assert_eq!(
            j["usage"]["completion_tokens"],
            g["usage"]["completion_tokens"]
        );
        assert_eq!(j["voom"]["exact"], true);

        // Streaming gives the same text, piece by piece.
        let mut body = chat(prompt, n);
        body["stream"] = json!(true);
        let r = s.post_json("/v1/chat/completions", &body);
        assert_eq!(r.status, 200);
        assert!(r
            .header("content-type")
            .unwrap()
            .starts_with("text/event-stream"));
        let data = r.sse_data();
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
        let mut text = String::new();
        for d in &data[..data.len() - 1] {
            let c: Value = serde_json::from_str(d).unwrap();
            if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
                text += t;
            }
        }
        assert_eq!(Value::String(text), g["text"], "streamed chat {prompt:?}");

        // The other dialects render the same chat and generate the same tokens.
        let r = s.post_json(
            "/v1/messages",
            &json!({"model": MODEL, "max_tokens": n, "temperature": 0,
                    "messages": [{"role": "user", "content": prompt}]}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let j = r.json();
        assert_eq!(j["content"][0]["text"], g["text"], "messages {prompt:?}");
        assert_eq!(j["usage"]["input_tokens"], g["usage"]["prompt_tokens"]);
        assert_eq!(j["usage"]["output_tokens"], g["usage"]["completion_tokens"]);
        let r = s.post_json(
            "/v1/responses",
            &json!({"model": MODEL, "max_output_tokens": n, "temperature": 0, "input": prompt}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let j = r.json();
        assert_eq!(
            j["output"][0]["content"][0]["text"], g["text"],
            "responses {prompt:?}"
        );
        assert_eq!(j["usage"]["input_tokens"], g["usage"]["prompt_tokens"]);
    }
    for (prompt, n) in [("Once upon a time", 30), ("def main():", 50)] {
        let g = generate(&dir, "--prompt", prompt, n);
        let r = s.post_json(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let j = r.json();
        assert_eq!(j["choices"][0]["text"], g["text"], "completion {prompt:?}");
        assert_eq!(j["usage"]["prompt_tokens"], g["usage"]["prompt_tokens"]);
        assert_eq!(
            j["usage"]["completion_tokens"],
            g["usage"]["completion_tokens"]
        );
        // The same prompt as token ids.
        let r = s.post_json(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": g["prompt_ids"], "max_tokens": n, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["choices"][0]["text"], g["text"], "ids {prompt:?}");
    }
}

/// A small deterministic generator (xorshift64*) for the garbage bodies.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn no_input_crashes_the_server() {
    let mut s = Server::start(&["--max-context", "64", "--max-body-bytes", "65536"]);
    let valid = [
        chat("Hello", 2),
        json!({"model": MODEL, "prompt": "Hello", "max_tokens": 2}),
        json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hello"}]}),
        json!({"model": MODEL, "input": "Hello", "max_output_tokens": 2}),
    ];
    let posts = [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/responses",
        "/chat/completions",
        "/v1/models",
    ];
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut statuses = std::collections::BTreeMap::new();
    for i in 0..240 {
        let path = posts[i % posts.len()];
        let body: Vec<u8> = match i % 4 {
            // Random bytes.
            0 => (0..rng.below(300)).map(|_| rng.next() as u8).collect(),
            // A valid body cut short.
            1 => {
                let v = valid[rng.below(valid.len())].to_string().into_bytes();
                v[..rng.below(v.len())].to_vec()
            }
            // A valid body with one byte changed.
            2 => {
                let mut v = valid[rng.below(valid.len())].to_string().into_bytes();
                let at = rng.below(v.len());
                v[at] = rng.next() as u8;
                v
            }
            // Valid JSON of surprising shapes and values.
            _ => {
                let odd = [
                    json!(null),
                    json!(1e308),
                    json!(-1),
                    json!(u64::MAX),
                    json!([]),
                    json!({}),
                    json!(""),
                    json!("\u{0}\u{ffff}"),
                    json!([[[[[]]]]]),
                    json!({"role": "user"}),
                ];
                let mut v = valid[rng.below(valid.len())].clone();
                let keys: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
                let key = &keys[rng.below(keys.len())];
                v[key.as_str()] = odd[rng.below(odd.len())].clone();
                v.to_string().into_bytes()
            }
        };
        let r = s.post(path, &body);
        *statuses.entry(r.status).or_insert(0) += 1;
        assert!(
            r.status < 500,
            "POST {path} with {:?} gave {}: {}",
            String::from_utf8_lossy(&body),
            r.status,
            r.text()
        );
        if i % 40 == 0 {
            s.assert_alive();
        }
    }
    eprintln!("statuses: {statuses:?}");
    // Deep nesting, not HTTP at all, and a huge header.
    let deep = "[".repeat(100_000);
    let r = s.post("/v1/chat/completions", deep.as_bytes());
    assert!(r.status == 400 || r.status == 413, "{}", r.status);
    for raw in [
        &b"\x00\x01\x02GARBAGE\r\n\r\n"[..],
        b"GET / HTTP/9.9\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ] {
        let mut c = connect(s.addr);
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = c.write_all(raw);
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out);
        if let Some(r) = parse_reply(&out) {
            assert!((400..500).contains(&r.status), "{:?}: {}", raw, r.status);
        }
    }
    let mut c = connect(s.addr);
    let _ = c.write_all(
        format!(
            "GET /health HTTP/1.1\r\nX-Big: {}\r\n\r\n",
            "a".repeat(1 << 20)
        )
        .as_bytes(),
    );
    drop(c);
    s.assert_healthy();
}

/// With a page cache (`--cache-budget`), /metrics reports its hits and misses.
#[test]
fn metrics_report_the_page_cache_of_the_resident_engine() {
    let s = Server::start_with(&["--cache-budget", "64MiB"], true);
    let body = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 4, "temperature": 0});
    assert_eq!(s.post_json("/v1/completions", &body).status, 200);
    let misses = s.metric("voom_page_cache_misses");
    let hits = s.metric("voom_page_cache_hits");
    assert!(misses > 0.0, "the first request loaded pages");
    // Read from the model's own directory, as many bytes as were loaded.
    assert_eq!(
        s.metric("voom_tier_primary_read_bytes"),
        s.metric("voom_page_cache_bytes_loaded")
    );
    assert_eq!(s.metric("voom_tier_fast_read_bytes"), 0.0);
    assert_eq!(
        s.metric("voom_page_cache_capacity_bytes"),
        (64u64 << 20) as f64
    );
    assert!(s.metric("voom_page_cache_used_bytes") > 0.0);
    // The model fits: a second request is served from the cache.
    assert_eq!(s.post_json("/v1/completions", &body).status, 200);
    assert_eq!(s.metric("voom_page_cache_misses"), misses);
    assert!(s.metric("voom_page_cache_hits") > hits);
    let r = s.metric("voom_page_cache_hit_ratio");
    assert!(r > 0.0 && r < 1.0, "{r}");
}

/// A client that stops reading is cut off after `--write-timeout`: 40 pipelined
/// 2000-token streams (about 240 KB each) on one connection that is never read fill
/// the socket buffers; the server's next write stalls, the connection is dropped, and
/// the requests behind it never run. The server keeps serving others.
#[test]
fn a_client_that_stops_reading_is_cut_off_after_the_write_deadline() {
    let s = Server::start(&["--write-timeout", "1"]);
    let body = json!({"model": MODEL, "prompt": [12], "max_tokens": 2000,
        "temperature": 0, "stream": true})
    .to_string();
    let one = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        s.addr,
        body.len()
    );
    let mut c = TcpStream::connect(s.addr).unwrap();
    c.write_all(one.repeat(40).as_bytes()).unwrap();
    // Not reading: wait until generation has stopped for good.
    let t = Instant::now();
    let mut last = -1.0;
    loop {
        std::thread::sleep(Duration::from_millis(1500));
        let now = s.metric("voom_completion_tokens_total");
        if now == last && s.metric("voom_engine_busy") == 0.0 {
            break;
        }
        last = now;
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "generation never stopped"
        );
    }
    assert!(
        last < 40.0 * 2000.0,
        "every pipelined request ran: the stalled writes were never cut off"
    );
    // The connection was closed by the server: reading drains what was buffered, then
    // ends (EOF or reset), without all 40 answers.
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut data = Vec::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match c.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => data.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => break,
            Err(e) => panic!("the connection was not closed: {e}"),
        }
    }
    let done = String::from_utf8_lossy(&data).matches("[DONE]").count();
    assert!(done < 40, "{done} answers arrived");
    // Others are still served.
    let r = s.post_json(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(r.status, 200);
}

/// One engine resident at a time: a request for another model swaps it, and each
/// model answers as it does alone.
#[test]
fn requesting_another_model_swaps_the_engine() {
    let s = Server::start(&[]);
    // A second model in the same store: the fixture under another name.
    copy_dir(&fixture(), &s.models.path().join("tiny-chat-b"));
    let ask = |model: &str| {
        let r = s.post_json(
            "/v1/completions",
            &json!({"model": model, "prompt": "Hello", "max_tokens": 5, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        (
            r.json()["choices"][0]["text"].as_str().unwrap().to_string(),
            s.get("/health").json()["resident_model"].clone(),
        )
    };
    let (a1, res) = ask(MODEL);
    assert_eq!(res, MODEL);
    let (b1, res) = ask("tiny-chat-b");
    assert_eq!(res, "tiny-chat-b");
    assert_eq!(s.metric("voom_model_loads_total"), 2.0);
    let (a2, res) = ask(MODEL);
    assert_eq!(res, MODEL);
    assert_eq!(s.metric("voom_model_loads_total"), 3.0);
    // Same weights, same greedy text, whichever engine was resident before.
    assert_eq!(a1, b1);
    assert_eq!(a1, a2);
    let models = s.get("/v1/models").json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [MODEL, "tiny-chat-b"]);
}
