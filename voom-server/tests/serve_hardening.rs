//! Nothing a caller or a model directory can do takes `voom serve` down or makes it
//! answer for another site (issue 8). Each test is named after the defect it guards;
//! the server stays healthy (`/health` answers, a real request completes) after each.

mod common;

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// One request written exactly as given (`head` lines, then the body).
fn raw(addr: SocketAddr, head_lines: &[&str], body: &[u8]) -> Reply {
    let mut s = connect(addr);
    let mut msg = head_lines.join("\r\n");
    msg += &format!(
        "\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let mut bytes = msg.into_bytes();
    bytes.extend_from_slice(body);
    let _ = s.write_all(&bytes);
    read_reply(&mut s)
}

fn host(addr: SocketAddr) -> String {
    format!("Host: {addr}")
}

#[test]
fn a_model_whose_config_lies_is_503_for_that_request_and_the_server_keeps_serving() {
    let mut s = Server::start(&[]);
    // A second model: the fixture with a config claiming a billion layers (it used
    // to abort the whole server allocating 368 GB).
    let bad = s.models.path().join("liar");
    copy_dir(&fixture(), &bad);
    let mut cfg: Value =
        serde_json::from_slice(&std::fs::read(bad.join("config.json")).unwrap()).unwrap();
    cfg["num_hidden_layers"] = json!(1_000_000_000u64);
    std::fs::write(bad.join("config.json"), cfg.to_string()).unwrap();
    let mut body = chat("Hello", 4);
    body["model"] = json!("liar");
    let r = s.post_json("/v1/chat/completions", &body);
    assert_eq!(r.status, 503, "{}", r.text());
    let m = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(m.contains("liar") && m.contains("num_hidden_layers"), "{m}");
    s.assert_healthy();

    // A config that reads but disagrees with the checkpoint fails when the engine
    // loads: also a 503, and the resident model keeps serving.
    let odd = s.models.path().join("odd");
    copy_dir(&fixture(), &odd);
    let mut cfg2: Value =
        serde_json::from_slice(&std::fs::read(odd.join("config.json")).unwrap()).unwrap();
    let layers = cfg2["num_hidden_layers"].as_u64().unwrap();
    cfg2["num_hidden_layers"] = json!(layers + 1);
    std::fs::write(odd.join("config.json"), cfg2.to_string()).unwrap();
    body["model"] = json!("odd");
    let r = s.post_json("/v1/chat/completions", &body);
    assert_eq!(r.status, 503, "{}", r.text());
    let m = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(m.contains("odd") && m.contains("num_hidden_layers"), "{m}");
    // The same in Anthropic's dialect.
    let r = s.post_json(
        "/v1/messages",
        &json!({"model": "odd", "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "overloaded_error");
    s.assert_healthy();
}

#[test]
fn a_prompt_far_over_the_context_is_refused_before_it_is_tokenized() {
    let mut s = Server::start(&[]);
    // 24 MB of text: tokenizing it took seconds and gigabytes before the 400.
    let big = "hello world ".repeat(2_000_000);
    let r = s.post_json("/v1/chat/completions", &chat(&big, 4));
    assert_openai_error(&r, 400, "messages", "a 24 MB message");
    let m = r.json()["error"]["message"].as_str().unwrap().to_string();
    // "at least": refused from its length, not counted by tokenizing it.
    assert!(m.contains("at least") && m.contains("context"), "{m}");
    let r = s.post_json(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": big, "max_tokens": 1}),
    );
    assert_openai_error(&r, 400, "prompt", "a 24 MB completion prompt");
    let r = s.post_json(
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 4,
                "messages": [{"role": "user", "content": big}]}),
    );
    assert_anthropic_error(&r, 400, "invalid_request_error", "messages", "24 MB");
    s.assert_healthy();
}

#[test]
fn client_schemas_the_grammar_or_validator_refuse_are_400_before_generation() {
    let mut s = Server::start(&[]);
    let cases = [
        // Refers only to itself: admits no output (it failed at the first token).
        json!({"$ref": "#"}),
        // Past the regex engine's size limit (the validator failed after generation).
        json!({"type": "string", "pattern": "^(a{1,1000}){1,1000}$"}),
        // Not a regex at all.
        json!({"type": "string", "pattern": "(unclosed"}),
    ];
    for schema in &cases {
        let mut body = chat("Hello", 8);
        body["response_format"] =
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}});
        let r = s.post_json("/v1/chat/completions", &body);
        assert_openai_error(&r, 400, "response_format", &schema.to_string());
        // Streaming too: refused before the stream starts.
        body["stream"] = json!(true);
        let r = s.post_json("/v1/chat/completions", &body);
        assert_openai_error(&r, 400, "response_format", &schema.to_string());
    }
    // As a tool's parameters: the whole schema refers to itself, or an argument's
    // pattern is refused.
    for parameters in [
        json!({"$ref": "#"}),
        json!({"type": "object", "properties": {"a": cases[1]}}),
        json!({"type": "object", "properties": {"a": cases[2]}}),
    ] {
        let mut body = chat("Hello", 8);
        body["tools"] = json!([{"type": "function", "function": {"name": "f",
            "parameters": parameters}}]);
        body["tool_choice"] = json!("required");
        let r = s.post_json("/v1/chat/completions", &body);
        assert_openai_error(&r, 400, "tools", &parameters.to_string());
    }
    // A grammar past the parser's limits once generation starts (5,000 object
    // alternatives): a 400 naming the field and the limit, not a 500.
    let alternatives: Vec<Value> = (0..5000)
        .map(|i| {
            json!({"type": "object", "properties": {format!("k{i}"): {"type": "string"}},
                        "required": [format!("k{i}")]})
        })
        .collect();
    let mut body = chat("Hello", 8);
    body["response_format"] = json!({"type": "json_schema",
        "json_schema": {"name": "x", "schema": {"anyOf": alternatives}}});
    let r = s.post_json("/v1/chat/completions", &body);
    if r.status != 200 {
        assert_openai_error(&r, 400, "response_format", "5000 alternatives");
        let m = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(m.contains("max"), "the limit is not named: {m}");
    }
    s.assert_healthy();
}

#[test]
fn a_body_that_is_not_json_is_415_and_never_reaches_the_engine() {
    let mut s = Server::start(&[]);
    let body = chat("Hello", 4).to_string();
    for ct in [
        "Content-Type: text/plain",
        "Content-Type: application/x-www-form-urlencoded",
        "Content-Type: multipart/form-data; boundary=x",
    ] {
        let r = raw(
            s.addr,
            &["POST /v1/chat/completions HTTP/1.1", &host(s.addr), ct],
            body.as_bytes(),
        );
        assert_eq!(r.status, 415, "{ct}: {}", r.text());
        assert_eq!(r.json()["error"]["code"], "unsupported_media_type");
    }
    // No content type at all; and Anthropic's dialect.
    let r = raw(
        s.addr,
        &["POST /v1/messages HTTP/1.1", &host(s.addr)],
        body.as_bytes(),
    );
    assert_eq!(r.status, 415, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    // With parameters, JSON is JSON.
    let r = raw(
        s.addr,
        &[
            "POST /v1/chat/completions HTTP/1.1",
            &host(s.addr),
            "Content-Type: application/json; charset=utf-8",
        ],
        body.as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(s.metric("voom_model_loads_total"), 1.0);
    s.assert_healthy();
}

#[test]
fn a_foreign_host_or_origin_is_403_dns_rebinding_and_cross_site_pages() {
    let mut s = Server::start(&[]);
    let body = chat("Hello", 4).to_string();
    let json_ct = "Content-Type: application/json";
    for h in [
        "Host: evil.example",
        "Host: evil.example:8080",
        "Host: localhost.evil.example",
    ] {
        let r = raw(
            s.addr,
            &["POST /v1/chat/completions HTTP/1.1", h, json_ct],
            body.as_bytes(),
        );
        assert_eq!(r.status, 403, "{h}: {}", r.text());
        assert!(r.text().contains("evil.example"), "{}", r.text());
        let r = raw(s.addr, &["GET /health HTTP/1.1", h], b"");
        assert_eq!(r.status, 403, "{h}: {}", r.text());
    }
    // Loopback names and addresses are this server.
    let port = s.addr.port();
    for h in [
        format!("Host: localhost:{port}"),
        format!("Host: 127.0.0.1:{port}"),
    ] {
        let r = raw(s.addr, &["GET /health HTTP/1.1", &h], b"");
        assert_eq!(r.status, 200, "{h}: {}", r.text());
    }
    // A web page's request (it carries its Origin) is refused while CORS is off,
    // and no CORS header invites the browser to read anything.
    let r = raw(
        s.addr,
        &[
            "POST /v1/chat/completions HTTP/1.1",
            &host(s.addr),
            json_ct,
            "Origin: https://evil.example",
        ],
        body.as_bytes(),
    );
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(r.header("access-control-allow-origin").is_none());
    let r = raw(
        s.addr,
        &[
            "OPTIONS /v1/chat/completions HTTP/1.1",
            &host(s.addr),
            "Origin: https://evil.example",
            "Access-Control-Request-Method: POST",
        ],
        b"",
    );
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(r.header("access-control-allow-origin").is_none());
    assert_eq!(s.metric("voom_model_loads_total"), 0.0);
    s.assert_healthy();
}

#[test]
fn cors_allows_exactly_the_configured_origins_and_names_with_allowed_host() {
    let mut s = Server::start(&[
        "--cors-origin",
        "http://localhost:3000",
        "--allowed-host",
        "voom.lan",
    ]);
    let r = raw(
        s.addr,
        &[
            "OPTIONS /v1/chat/completions HTTP/1.1",
            &host(s.addr),
            "Origin: http://localhost:3000",
            "Access-Control-Request-Method: POST",
            "Access-Control-Request-Headers: content-type, authorization",
        ],
        b"",
    );
    assert_eq!(r.status, 204, "{}", r.text());
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://localhost:3000")
    );
    assert!(r
        .header("access-control-allow-methods")
        .is_some_and(|m| m.contains("POST")));
    assert_eq!(
        r.header("access-control-allow-headers"),
        Some("content-type, authorization")
    );
    let body = chat("Hello", 4).to_string();
    let r = raw(
        s.addr,
        &[
            "POST /v1/chat/completions HTTP/1.1",
            "Host: voom.lan",
            "Content-Type: application/json",
            "Origin: http://localhost:3000",
        ],
        body.as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://localhost:3000")
    );
    let r = raw(
        s.addr,
        &[
            "POST /v1/chat/completions HTTP/1.1",
            &host(s.addr),
            "Content-Type: application/json",
            "Origin: http://localhost:3001",
        ],
        body.as_bytes(),
    );
    assert_eq!(r.status, 403, "{}", r.text());
    s.assert_healthy();
}

#[test]
fn with_an_api_key_every_request_needs_it_in_either_header() {
    let s = Server::start(&["--api-key", "k-123"]);
    let body = chat("Hello", 4).to_string();
    let json_ct = "Content-Type: application/json";
    for (path, auth) in [
        ("/v1/chat/completions", None),
        ("/v1/chat/completions", Some("Authorization: Bearer wrong")),
        ("/v1/chat/completions", Some("x-api-key: k-12")),
        ("/v1/messages", None),
    ] {
        let line = format!("POST {path} HTTP/1.1");
        let mut head = vec![line.as_str(), json_ct];
        let h = host(s.addr);
        head.push(&h);
        if let Some(a) = auth {
            head.push(a);
        }
        let r = raw(s.addr, &head, body.as_bytes());
        assert_eq!(r.status, 401, "{path} {auth:?}: {}", r.text());
        if path.ends_with("messages") {
            assert_eq!(r.json()["error"]["type"], "authentication_error");
        } else {
            assert_eq!(r.json()["error"]["code"], "invalid_api_key");
        }
    }
    let r = raw(s.addr, &["GET /health HTTP/1.1", &host(s.addr)], b"");
    assert_eq!(r.status, 401, "{}", r.text());
    for auth in ["Authorization: Bearer k-123", "x-api-key: k-123"] {
        let r = raw(
            s.addr,
            &[
                "POST /v1/chat/completions HTTP/1.1",
                &host(s.addr),
                json_ct,
                auth,
            ],
            body.as_bytes(),
        );
        assert_eq!(r.status, 200, "{auth}: {}", r.text());
        let r = raw(s.addr, &["GET /health HTTP/1.1", &host(s.addr), auth], b"");
        assert_eq!(r.status, 200, "{}", r.text());
    }
}

#[test]
fn listening_beyond_loopback_without_an_api_key_is_refused() {
    let models = tempfile::tempdir().unwrap();
    let out = voom()
        .args(["serve", "--host", "0.0.0.0", "--port", "0", "--models-dir"])
        .arg(models.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--api-key") && err.contains("--allow-no-api-key"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_full_queue_is_429_with_retry_after_in_the_endpoints_dialect() {
    let mut s = Server::start(&["--max-queue", "1", "--max-batch", "2"]);
    // Two long generations fill the batch (both fit in the 2048-position context);
    // one request waits; the next is refused.
    let long = json!({"model": MODEL, "prompt": [12], "max_tokens": 1000,
                      "temperature": 0, "stream": true});
    let text = long.to_string();
    let send = |s: &Server| {
        let mut c = connect(s.addr);
        c.write_all(head("POST", "/v1/completions", s.addr, Some(text.len())).as_bytes())
            .unwrap();
        c.write_all(text.as_bytes()).unwrap();
        c
    };
    let wait_for = |s: &mut Server, metric: &str, at_least: f64, what: &str| {
        let t = Instant::now();
        while s.metric(metric) < at_least {
            assert!(t.elapsed() < Duration::from_secs(30), "{what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    let running = send(&s);
    wait_for(
        &mut s,
        "voom_engine_busy",
        1.0,
        "the first request never ran",
    );
    let beside = send(&s);
    wait_for(
        &mut s,
        "voom_engine_busy",
        2.0,
        "the second never joined the batch",
    );
    let waiting = send(&s);
    wait_for(&mut s, "voom_queue_depth", 1.0, "the third never queued");
    let r = s.post_json("/v1/chat/completions", &chat("Hello", 4));
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "rate_limit_exceeded");
    let after: u64 = r
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .unwrap();
    assert!((1..=600).contains(&after), "{after}");
    let r = s.post_json(
        "/v1/messages",
        &json!({"model": MODEL, "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hi"}]}),
    );
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    assert!(r.header("retry-after").is_some());
    assert_eq!(s.metric("voom_requests_rejected_queue_full_total"), 2.0);
    // The clients leave: the engine drops each at its next token.
    drop(running);
    drop(beside);
    drop(waiting);
    let t = Instant::now();
    while s.metric("voom_queue_depth") > 0.0 || s.metric("voom_engine_busy") > 0.0 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the queue never drained"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    s.assert_healthy();
}

/// Batched requests stay within the KV cache the memory planner reserved (the
/// engine's context): requests that can each reach most of a 96-position context
/// run one at a time, and all succeed; requests that reach a fifth of it share
/// steps.
#[test]
fn a_batch_stays_within_the_context_it_was_planned_for() {
    let s = Server::start(&["--max-context", "96"]);
    let run = |max_tokens: u64| {
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    scope.spawn(|| {
                        s.post_json(
                            "/v1/completions",
                            &json!({"model": MODEL, "prompt": [12], "max_tokens": max_tokens,
                                    "temperature": 0}),
                        )
                    })
                })
                .collect();
            for h in handles {
                let r = h.join().unwrap();
                assert_eq!(r.status, 200, "{}", r.text());
                assert_eq!(r.json()["usage"]["completion_tokens"], max_tokens);
            }
        });
    };
    run(60);
    assert_eq!(
        s.metric("voom_batch_peak"),
        1.0,
        "two requests of 61 positions ran together"
    );
    run(18);
    assert!(
        s.metric("voom_batch_peak") >= 2.0,
        "requests of 19 positions did not share steps"
    );
}

/// `voom serve --draft MODEL`: a draft that shares the model's tokenizer drafts for
/// every request (the answers are the plain server's, and say so); one that does
/// not is refused for that model with a warning naming both, and the model is
/// served plainly.
#[test]
fn a_draft_model_drafts_where_it_shares_the_tokenizer_and_is_refused_elsewhere() {
    let body = json!({"model": MODEL, "prompt": [12], "max_tokens": 24, "temperature": 0});
    let plain = Server::start(&[]).post_json("/v1/completions", &body);
    assert_eq!(plain.status, 200, "{}", plain.text());
    let same = fixture();
    let s = Server::start(&["--draft", same.to_str().unwrap(), "--fixed-draft"]);
    let r = s.post_json("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let (a, b) = (r.json(), plain.json());
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    let spec = &a["voom"]["timings"]["speculation"];
    assert_eq!(spec["drafter"], "draft-model:tiny_chat", "{spec}");
    assert_eq!(
        spec["accepted"], spec["drafted"],
        "the model drafting for itself: {spec}"
    );

    let other =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny/llama_gqa_untied");
    let s = Server::start(&["--draft", other.to_str().unwrap()]);
    let r = s.post_json("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["choices"][0]["text"], b["choices"][0]["text"]);
    assert!(r.json()["voom"]["timings"]["speculation"].is_null());
    // The warning reaches the log's reader thread in its own time.
    s.wait_for_log("no speculative decoding");
    assert!(s.log().contains("llama_gqa_untied"), "{}", s.log());
}

/// The multi-token-prediction fixture (glm4_moe with its layer) widened to the chat
/// fixture's vocabulary (each table's rows repeated), with the chat fixture's
/// tokenizer: a model the server can serve whose checkpoint holds the layer.
fn prediction_layer_model(to: &Path) {
    use voom_formats::dtype::DType;
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/tiny_mtp/glm4_moe_partial_rotary_shared_mtp");
    copy_dir(&src, to);
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture().join(f), to.join(f)).unwrap();
    }
    let vocab = 768;
    let path = to.join("config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["vocab_size"] = json!(vocab);
    std::fs::write(&path, cfg.to_string()).unwrap();
    let path = to.join("model.safetensors");
    let st = voom_formats::safetensors::SafetensorsFile::open(&path).unwrap();
    let tables = [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.3.embed_tokens.weight",
        "model.layers.3.shared_head.head.weight",
    ];
    let kept: Vec<(String, DType, Vec<usize>, Vec<u8>)> = st
        .header
        .tensors
        .iter()
        .map(|t| {
            let mut bytes = st.tensor_bytes(t).to_vec();
            let mut shape = t.shape.clone();
            if tables.contains(&t.name.as_str()) {
                let have = bytes.clone();
                while bytes.len() < have.len() * vocab / shape[0] {
                    bytes.extend_from_slice(&have);
                }
                shape[0] = vocab;
            }
            (t.name.clone(), t.dtype, shape, bytes)
        })
        .collect();
    drop(st);
    let specs: Vec<(&str, DType, &[usize], &[u8])> = kept
        .iter()
        .map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice()))
        .collect();
    voom_formats::safetensors::write(&path, &specs, &std::collections::BTreeMap::new()).unwrap();
}

/// `voom serve --mtp`: a model whose checkpoint holds a multi-token-prediction layer
/// drafts with it for every request (the plain server's answers, and they say so);
/// a model without one is served plainly, with a warning saying why.
#[test]
fn the_prediction_layer_drafts_where_the_checkpoint_has_one() {
    let body =
        json!({"model": "glm-mtp", "prompt": [12, 40, 7], "max_tokens": 16, "temperature": 0});
    let start = |extra: &[&str]| {
        let models = tempfile::tempdir().unwrap();
        prediction_layer_model(&models.path().join("glm-mtp"));
        copy_dir(&fixture(), &models.path().join(MODEL));
        Server::start_over(models, extra)
    };
    let plain = start(&[]).post_json("/v1/completions", &body);
    assert_eq!(plain.status, 200, "{}", plain.text());
    let s = start(&["--mtp", "--fixed-draft", "--max-draft", "3"]);
    let r = s.post_json("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let (a, b) = (r.json(), plain.json());
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    let spec = &a["voom"]["timings"]["speculation"];
    assert_eq!(spec["drafter"], "mtp:glm-mtp", "{spec}");
    assert!(spec["drafted"].as_u64().unwrap() > 0, "{spec}");
    // The chat fixture (llama) has no such layer.
    let r = s.post_json(
        "/v1/completions",
        &json!({"model": MODEL, "prompt": [12], "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.json()["voom"]["timings"]["speculation"].is_null());
    s.wait_for_log("no speculative decoding");
    assert!(
        s.log().contains("no multi-token-prediction layers"),
        "{}",
        s.log()
    );
}

/// Prompt-prefix reuse in `voom serve`: a request that repeats or extends one
/// computed before takes those positions from memory, says how many in
/// `voom.timings.prefix_tokens_reused` and `/metrics`, and answers exactly as
/// without reuse (`--prefix-cache 0`).
#[test]
fn repeated_and_extended_prompts_reuse_their_prefix_exactly() {
    let prompt: Vec<u32> = (0..40).map(|i| 20 + (i * 7) % 300).collect();
    let mut longer = prompt.clone();
    longer.extend([5, 6, 7]);
    let body = |p: &[u32]| json!({"model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 0});
    let plain = Server::start(&["--prefix-cache", "0"]);
    let reused = Server::start(&[]);
    let mut answers = Vec::new();
    for (i, p) in [&prompt, &prompt, &longer].iter().enumerate() {
        let a = plain.post_json("/v1/completions", &body(p));
        let b = reused.post_json("/v1/completions", &body(p));
        assert_eq!(
            (a.status, b.status),
            (200, 200),
            "{} {}",
            a.text(),
            b.text()
        );
        let (a, b) = (a.json(), b.json());
        assert_eq!(
            a["choices"][0]["text"], b["choices"][0]["text"],
            "request {i}"
        );
        assert_eq!(a["voom"]["timings"]["prefix_tokens_reused"], 0);
        answers.push(
            b["voom"]["timings"]["prefix_tokens_reused"]
                .as_u64()
                .unwrap(),
        );
    }
    // The first computes everything; the repeat all but its last token; the
    // extension at least the first prompt.
    assert_eq!(answers[0], 0);
    assert_eq!(answers[1], prompt.len() as u64 - 1);
    assert!(answers[2] >= prompt.len() as u64, "{answers:?}");
    assert_eq!(
        reused.metric("voom_prefix_tokens_reused_total"),
        (answers[1] + answers[2]) as f64
    );
    assert_eq!(plain.metric("voom_prefix_tokens_reused_total"), 0.0);
}
