//! Fuzzes the request body parsers of every dialect: any byte string, as the body of
//! `/v1/chat/completions`, `/v1/completions`, `/v1/messages` and `/v1/responses`,
//! must parse to a checked request or fail with a 4xx naming the field at fault;
//! never a panic, and never a 500 (a caller's mistake is not the server's failure).
//! What parses then goes through the model-free steps of preparation: the response
//! format's grammar, its `%json` Lark body and its validator, the tools as templates
//! take them. The same functions the handlers call (`serve::openai::parse_chat`,
//! `parse_completion`, `serve::anthropic::parse`, `serve::responses::parse`).
//! Run with `cargo +nightly fuzz run request_body` in `voom-server/`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use libvoom::constrain::JsonValidator;
use voom_server::serve::error::ApiError;
use voom_server::serve::request::Body;
use voom_server::serve::tools::{ResponseFormat, ToolRequest};
use voom_server::serve::{anthropic, openai, responses};
use voom_server_fuzz::assert_client_error;

fn check<T>(r: Result<T, ApiError>) -> Option<T> {
    r.map_err(|e| assert_client_error(&e)).ok()
}

/// The model-free steps `prepare::prepare` takes with a request's tools and format.
fn prepared(tools: Option<&ToolRequest>, format: Option<&ResponseFormat>) {
    if let Some(t) = tools {
        assert!(!t.is_active() || t.template_tools().is_some_and(|v| v.len() == t.tools.len()));
        if let Some(forced) = t.forced() {
            assert!(!forced.is_empty(), "a forcing choice with nothing to force");
        }
    }
    if let Some(f) = format {
        check(f.grammar("response_format"));
        check(f.lark_json_body("response_format"));
        if let Some(s) = f.schema() {
            let _ = JsonValidator::new(&s);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some(b) = check(Body::parse(data)) else {
        return;
    };
    if let Some(r) = check(openai::parse_chat(&b)) {
        prepared(r.tools.as_ref(), r.response_format.as_ref());
    }
    if let Some(r) = check(anthropic::parse(&b)) {
        prepared(r.tools.as_ref(), r.format.as_ref());
        assert!(r.max_tokens >= 1);
    }
    if let Some(r) = check(responses::parse(&b)) {
        prepared(r.tools.as_ref(), Some(&r.format));
    }
    // Last: it takes the body.
    if let Some(r) = check(openai::parse_completion(b)) {
        prepared(None, r.response_format.as_ref());
    }
});
