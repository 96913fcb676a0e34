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

use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use clap::Parser;
use libfuzzer_sys::fuzz_target;
use voom_server::cli::common::EngineArgs;
use voom_server::serve::access::Access;
use voom_server::serve::catalog::Catalog;
use voom_server::serve::error::{ApiError, Kind};
use voom_server::serve::job::Prepared;
use voom_server::serve::metrics::Metrics;
use voom_server::serve::worker::Worker;
use voom_server::serve::{anthropic, app, openai, responses, App, Profile};

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    engine: EngineArgs,
}

/// A server's shared state over `tests/fixtures`, as `voom serve` builds it; its
/// engine thread idles (nothing is ever queued).
fn app() -> &'static App {
    static APP: OnceLock<App> = OnceLock::new();
    APP.get_or_init(|| {
        let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
        assert!(
            models.join("tiny_chat/config.json").is_file(),
            "the tiny_chat fixture is missing"
        );
        let mut engine = Args::parse_from(["fuzz"]).engine;
        let resolved = engine.pin_profile().expect("the default profile resolves");
        let metrics = Arc::new(Metrics::default());
        let worker = Worker::spawn(engine.clone(), Arc::clone(&metrics), 32).unwrap();
        let max_body_bytes = 64 << 20;
        App {
            catalog: Catalog::new(models, resolved.settings.clone()),
            worker,
            metrics,
            max_body_bytes,
            receive_timeout: Duration::from_secs(30),
            profile: Profile {
                name: resolved.name.clone(),
                digest: resolved.digest.clone(),
                exact: resolved.settings.exact,
                settings: resolved.settings_json(),
            },
            started: Instant::now(),
            access: Access {
                api_key: None,
                allowed_hosts: vec![],
                cors_origins: vec![],
            },
            body_budget: Arc::new(tokio::sync::Semaphore::new(app::body_budget_kib(
                max_body_bytes,
            ))),
            prepare_slots: Arc::new(tokio::sync::Semaphore::new(1)),
        }
    })
}

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
        Err(e) => {
            assert!(
                !matches!(e.kind, Kind::Internal | Kind::Unavailable),
                "a body got a server error: {e:?}"
            );
            assert!(!e.message.is_empty(), "an error without a message");
        }
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
