//! Fuzzes everything a generating endpoint does with a body before any model work,
//! on a real model: the repository's `tests/fixtures/tiny_chat` (a 768-token
//! vocabulary, a chat template with tools, `<tool_call>` tokens), served from
//! `tests/fixtures` as `voom serve --models-dir tests/fixtures` would. Each input is
//! the body of every generating endpoint in turn, through the function its handler
//! runs (`serve::openai::prepare_body`, `serve::anthropic::prepare_body`,
//! `serve::responses::prepare_body`): parse and check, resolve the model, render the
//! chat template, tokenize, check the context, compile the output's grammar (tool
//! calls, response format) and start it, compile the JSON validator, settle the
//! sampling. Never a panic; an error is a 4xx (or 404 for another model), never a
//! 500; what is prepared fits the context and the vocabulary.
//! Bodies name the model `tiny_chat` to get past the catalog (the seeds do).
//! Run with `cargo +nightly fuzz run request_prepare` in `voom-server/`.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use voom_server::serve::error::ApiError;
use voom_server::serve::job::Prepared;
use voom_server::serve::{anthropic, openai, responses};
use voom_server_fuzz::{app, assert_client_error};

/// `VOOM_FUZZ_SHOW=1`: print what each input came to (to see what a seed or a crash
/// input reaches).
fn show() -> bool {
    static SHOW: OnceLock<bool> = OnceLock::new();
    *SHOW.get_or_init(|| std::env::var_os("VOOM_FUZZ_SHOW").is_some())
}

fn check(endpoint: &str, r: Result<Prepared, ApiError>) {
    if show() {
        match &r {
            Ok(p) => eprintln!(
                "{endpoint}: prepared, {} prompt tokens, grammar: {}, tools: {}",
                p.prompt_ids.len(),
                p.grammar.is_some(),
                p.tools.is_some()
            ),
            Err(e) => eprintln!("{endpoint}: {:?} {:?}: {}", e.kind, e.param, e.message),
        }
    }
    match r {
        Ok(p) => {
            let vocab = p
                .meta
                .tokenizer
                .as_ref()
                .expect("tiny_chat has a tokenizer")
                .vocab_size();
            assert!(!p.prompt_ids.is_empty());
            assert!(p.prompt_ids.len() < p.meta.max_context);
            assert!(p.prompt_ids.iter().all(|&id| (id as usize) < vocab));
            assert!(p.prompt_ids.len() + p.params.max_new_tokens <= p.meta.max_context);
            assert!(p.params.sampling.validate().is_ok());
        }
        Err(e) => assert_client_error(&e),
    }
}

fuzz_target!(|data: &[u8]| {
    let app = app();
    check(
        "chat",
        openai::prepare_body(app, openai::Endpoint::Chat, data).map(|(p, _)| p),
    );
    check(
        "completion",
        openai::prepare_body(app, openai::Endpoint::Completion, data).map(|(p, _)| p),
    );
    check(
        "messages",
        anthropic::prepare_body(app, data).map(|(p, _)| p),
    );
    check(
        "responses",
        responses::prepare_body(app, data).map(|(p, _)| p),
    );
});
