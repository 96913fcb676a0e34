//! What the voom-server fuzz targets share: a server's state over the repository's
//! fixtures, and the rule every error they get must follow.

use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use clap::Parser;
use voom_server::cli::common::EngineArgs;
use voom_server::serve::access::Access;
use voom_server::serve::catalog::Catalog;
use voom_server::serve::error::{ApiError, Kind};
use voom_server::serve::metrics::Metrics;
use voom_server::serve::worker::Worker;
use voom_server::serve::{app, App, Profile};

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    engine: EngineArgs,
}

/// A server's shared state over `tests/fixtures`, as `voom serve --models-dir
/// tests/fixtures` builds it (default profile, no API key): the model `tiny_chat` (a
/// 768-token vocabulary, a chat template with tools, `<tool_call>` tokens) is
/// servable. Its engine thread idles: nothing is ever queued.
pub fn app() -> &'static App {
    static APP: OnceLock<App> = OnceLock::new();
    APP.get_or_init(|| {
        let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
        assert!(
            models.join("tiny_chat/config.json").is_file(),
            "the tiny_chat fixture is missing from {}",
            models.display()
        );
        let mut engine = Args::parse_from(["fuzz"]).engine;
        let resolved = engine.pin_profile().expect("the default profile resolves");
        let metrics = Arc::new(Metrics::default());
        let worker = Worker::spawn(engine.clone(), Arc::clone(&metrics), 32)
            .expect("the engine thread starts");
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

/// A request's error must be the caller's (4xx) with a message: a body never gets a
/// 500 (the server failed) or a 503 (the model cannot be served: `tiny_chat` can).
pub fn assert_client_error(e: &ApiError) {
    assert!(
        !matches!(e.kind, Kind::Internal | Kind::Unavailable),
        "a request body got a server error: {e:?}"
    );
    assert!(!e.message.is_empty(), "an error without a message: {e:?}");
}
