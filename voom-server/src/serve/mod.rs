//! `voom serve`: an HTTP server speaking OpenAI's and Anthropic's APIs over the
//! engine.
//!
//! Layout, data flowing one way: one module per API ([`openai`]: chat completions,
//! completions, models; [`anthropic`]: Messages; [`responses`]: OpenAI Responses)
//! reads its body ([`request`]) into the core [`prepare::GenerateRequest`];
//! [`prepare`] resolves the model ([`catalog`]), renders, tokenizes, checks the
//! context and compiles the grammar into a [`job::Prepared`]; the [`worker`] (the one
//! resident engine and its FIFO queue) runs [`job::Job`]s and answers with
//! [`job::Event`]s, which the dialects stream ([`stream`], SSE). Below them all:
//! [`tools`] (tool calls and structured output: formats, grammars, parsing,
//! streaming), [`harmony`] (gpt-oss's format: detection, grammars, reading its
//! output as reasoning, content and calls; also used by the CLI), [`stop`] (stop
//! sequences), [`error`] (errors in each dialect),
//! [`ids`], [`metrics`]; [`app`] is what handlers share.
//!
//! Connections: a request's headers and body must arrive within the receive deadline
//! and bodies are bounded; every write to a client must progress within the write
//! deadline, so a stalled client cannot hold the engine (its request is cancelled
//! when its connection is dropped).

pub mod access;
pub mod anthropic;
pub mod app;
pub mod catalog;
pub mod error;
pub mod harmony;
pub mod ids;
pub mod job;
pub mod metrics;
pub mod openai;
pub mod output;
pub mod prepare;
pub mod request;
pub mod responses;
pub mod stop;
pub mod stream;
pub mod tools;
pub mod worker;

pub use app::{App, Profile};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use clap::Args;

use crate::cli::common::EngineArgs;
use access::{dialect_of, Access};
use catalog::Catalog;
use error::{ApiError, Kind};
use metrics::Metrics;
use worker::Worker;

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "VOOM_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the chosen one is printed).
    #[arg(long, env = "VOOM_PORT", default_value_t = 8080)]
    pub port: u16,
    /// Directory of models to serve (default: the local store of `voom run`).
    #[arg(long, env = "VOOM_MODELS_DIR")]
    pub models_dir: Option<PathBuf>,
    /// Model to load before accepting requests.
    #[arg(long)]
    pub preload: Option<String>,
    /// Largest request body, in bytes.
    #[arg(long, env = "VOOM_MAX_BODY_BYTES", default_value_t = 64 << 20)]
    pub max_body_bytes: usize,
    /// Seconds a client has to send a request's headers and body.
    #[arg(long, env = "VOOM_RECEIVE_TIMEOUT", default_value_t = 30.0)]
    pub receive_timeout: f64,
    /// Seconds any one write to a client may stall before the connection is dropped.
    #[arg(long, env = "VOOM_WRITE_TIMEOUT", default_value_t = 30.0)]
    pub write_timeout: f64,
    /// Requests that may wait for the engine; beyond them, 429 with Retry-After.
    #[arg(long, env = "VOOM_MAX_QUEUE", default_value_t = 32)]
    pub max_queue: usize,
    /// Requests computed together, one sweep of the weights per step for all of
    /// them (continuous batching; each gets the ids it gets alone). 1: one at a time.
    #[arg(long, env = "VOOM_MAX_BATCH", default_value_t = 8)]
    pub max_batch: usize,
    /// Prompt positions a step computes beside the decoding requests' ids (a new
    /// request's prompt is computed over several steps, its chunks interleaved with
    /// the others' decoding).
    #[arg(long, env = "VOOM_BATCH_PREFILL_TOKENS", default_value_t = 256)]
    pub batch_prefill_tokens: usize,
    /// The API key every request must carry (`Authorization: Bearer KEY` or
    /// `x-api-key: KEY`). Required to listen beyond loopback.
    #[arg(long, env = "VOOM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Listen beyond loopback without an API key (anyone who can reach the port can
    /// use the server).
    #[arg(long)]
    pub allow_no_api_key: bool,
    /// A host name this server answers to besides IP addresses, localhost and
    /// --host (the `Host` header is checked against DNS rebinding); `*` for any.
    /// Repeatable.
    #[arg(
        long = "allowed-host",
        env = "VOOM_ALLOWED_HOSTS",
        value_delimiter = ','
    )]
    pub allowed_hosts: Vec<String>,
    /// A web origin (`http://localhost:3000`) whose pages may call the server
    /// (CORS); `*` for any. Off by default. Repeatable.
    #[arg(long = "cors-origin", env = "VOOM_CORS_ORIGINS", value_delimiter = ',')]
    pub cors_origins: Vec<String>,
    #[command(flatten)]
    pub spec: crate::cli::common::SpecArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

pub fn router(app: Arc<App>) -> Router {
    let api = Router::new()
        .route("/models", get(openai::models))
        .route("/models/{id}", get(openai::model))
        .route("/chat/completions", post(openai::chat_completions))
        .route("/completions", post(openai::completions))
        .route("/messages", post(anthropic::messages))
        .route("/responses", post(responses::responses));
    Router::new()
        .nest("/v1", api.clone())
        .merge(api)
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Access first (outermost after the log): a refused request reaches nothing.
        .layer(middleware::from_fn_with_state(
            Arc::clone(&app.access),
            access::guard,
        ))
        .layer(middleware::from_fn_with_state(
            Arc::clone(&app),
            log_request,
        ))
        .with_state(app)
}

async fn not_found(req: Request) -> ApiError {
    let dialect = dialect_of(req.uri().path());
    ApiError::new(
        Kind::NotFound,
        format!("no route for {} {}", req.method(), req.uri().path()),
    )
    .in_dialect(dialect)
}

/// A known route asked with another method: 405 in the endpoint's dialect, with the
/// method it takes in `Allow`.
async fn method_not_allowed(req: Request) -> Response {
    let path = req.uri().path();
    let dialect = dialect_of(path);
    // GET routes: /health, /metrics, /models and /models/{id}.
    let mut parts = path.trim_end_matches('/').rsplit('/');
    let (last, before) = (parts.next(), parts.next());
    let allow = if matches!(last, Some("health" | "metrics" | "models")) || before == Some("models")
    {
        "GET"
    } else {
        "POST"
    };
    let e = ApiError::new(
        Kind::MethodNotAllowed,
        format!("{path} takes {allow}, not {}", req.method()),
    )
    .in_dialect(dialect);
    let mut resp = e.into_response();
    resp.headers_mut()
        .insert(axum::http::header::ALLOW, HeaderValue::from_static(allow));
    resp
}

/// One log line per request, with its status and time; counted in the metrics.
async fn log_request(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let t = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let resp = next.run(req).await;
    let status = resp.status().as_u16();
    let endpoint = path.strip_prefix("/v1").unwrap_or(&path).to_string();
    app.metrics.record_request(&endpoint, status);
    tracing::info!(
        "{method} {path} {status} {:.1}ms (headers; streams continue)",
        t.elapsed().as_secs_f64() * 1e3
    );
    resp
}

async fn health(State(app): State<Arc<App>>) -> Response {
    axum::Json(serde_json::json!({
        "status": "ok",
        "profile": app.profile.name,
        "profile_digest": app.profile.digest,
        "profile_settings": app.profile.settings,
        "exact": app.profile.exact,
        "resident_model": app.worker.resident(),
        "queue_depth": app.worker.queue_depth(),
        "models": app.catalog.ids(),
        "uptime_secs": app.started.elapsed().as_secs_f64(),
    }))
    .into_response()
}

async fn metrics_text(State(app): State<Arc<App>>) -> Response {
    // The resident engine's page cache (the in-process store's or the daemon's: one
    // Stats round trip); the embedded mmap store has none (the OS caches its pages).
    let source = app.worker.resident_source();
    let stats = tokio::task::spawn_blocking(move || source.and_then(|s| s.cache_stats()))
        .await
        .ok()
        .flatten();
    let mut extra = Vec::new();
    if let Some(c) = stats {
        let lookups = c.hits + c.misses;
        extra = vec![
            (
                "voom_page_cache_hits".to_string(),
                c.hits as f64,
                "Page requests served from the page cache (resident engine's source).",
            ),
            (
                "voom_page_cache_misses".to_string(),
                c.misses as f64,
                "Page requests that loaded the page.",
            ),
            (
                "voom_page_cache_hit_ratio".to_string(),
                if lookups == 0 {
                    0.0
                } else {
                    c.hits as f64 / lookups as f64
                },
                "Hits over page requests.",
            ),
            (
                "voom_page_cache_bytes_loaded".to_string(),
                c.bytes_loaded as f64,
                "Bytes loaded into the page cache.",
            ),
            (
                "voom_page_cache_inflight_waits".to_string(),
                c.inflight_waits as f64,
                "Page requests that waited for a load already in flight (a prefetch not landed yet).",
            ),
            (
                "voom_page_cache_prefetch_loads".to_string(),
                c.prefetch_loads as f64,
                "Pages loaded on a prefetch hint.",
            ),
            (
                "voom_page_cache_prefetch_skipped".to_string(),
                c.prefetch_skipped as f64,
                "Prefetch hints dropped for want of room.",
            ),
            (
                "voom_page_cache_unused_evictions".to_string(),
                c.unused_evictions as f64,
                "Prefetched pages evicted before their request (each one read twice).",
            ),
            (
                "voom_page_cache_bodies_read_ahead".to_string(),
                c.bodies_read_ahead as f64,
                "Pages decoded from a vpack body read ahead of their load.",
            ),
            (
                "voom_tier_fast_read_bytes".to_string(),
                c.fast_tier_bytes as f64,
                "Bytes read from the fast tier.",
            ),
            (
                "voom_tier_primary_read_bytes".to_string(),
                c.primary_bytes as f64,
                "Bytes read from the model's local directory.",
            ),
            (
                "voom_tier_nas_read_bytes".to_string(),
                c.nas_bytes as f64,
                "Bytes read from a NAS (where the model lives, or its copy).",
            ),
            (
                "voom_page_cache_used_bytes".to_string(),
                c.used_bytes as f64,
                "Bytes of the page cache in use.",
            ),
            (
                "voom_page_cache_capacity_bytes".to_string(),
                c.capacity_bytes as f64,
                "The page cache's capacity.",
            ),
        ];
    }
    // This process's memory: what it holds now and at its peak (Linux).
    for (name, v, help) in [
        (
            "voom_resident_bytes",
            crate::memory::resident_bytes(),
            "The server process's resident memory.",
        ),
        (
            "voom_peak_resident_bytes",
            crate::memory::peak_resident_bytes(),
            "The server process's peak resident memory.",
        ),
    ] {
        if let Some(v) = v {
            extra.push((name.to_string(), v as f64, help));
        }
    }
    let body = app.metrics.render(&extra);
    (
        StatusCode::OK,
        [("content-type", "text/plain; version=0.0.4")],
        body,
    )
        .into_response()
}

pub fn run(mut a: ServeArgs) -> Result<()> {
    let models_dir = match &a.models_dir {
        Some(d) => d.clone(),
        None => crate::store::models_dir()?,
    };
    let addr = resolve(&a.host, a.port)?;
    if !addr.ip().is_loopback() && a.api_key.is_none() && !a.allow_no_api_key {
        anyhow::bail!(
            "--host {} listens beyond loopback: set an API key (--api-key KEY or VOOM_API_KEY), \
             or pass --allow-no-api-key to let anyone who reaches port {} use it",
            a.host,
            a.port
        );
    }
    if a.api_key.as_deref().is_some_and(str::is_empty) {
        anyhow::bail!("--api-key is empty");
    }
    let mut allowed_hosts: Vec<String> = a
        .allowed_hosts
        .iter()
        .map(|h| h.trim().to_ascii_lowercase())
        .collect();
    allowed_hosts.push(a.host.to_ascii_lowercase());
    let access = Access {
        api_key: a.api_key.clone(),
        allowed_hosts,
        cors_origins: a
            .cors_origins
            .iter()
            .map(|o| o.trim().trim_end_matches('/').to_string())
            .collect(),
    };
    let metrics = Arc::new(Metrics::default());
    // Resolved once (flag > env > profile > default): every engine the worker opens
    // uses, and every response reports, these settings.
    let resolved = a.engine.pin_profile()?;
    if a.max_batch == 0 {
        bail!("--max-batch must be at least 1");
    }
    let worker = Worker::spawn(
        a.engine.clone(),
        a.spec.clone(),
        worker::Batching {
            max_batch: a.max_batch,
            prefill_room: a.batch_prefill_tokens,
        },
        Arc::clone(&metrics),
        a.max_queue,
    )
    .context("starting the engine thread")?;
    let profile = Profile {
        name: resolved.name.clone(),
        digest: resolved.digest.clone(),
        exact: resolved.settings.exact,
        settings: resolved.settings_json(),
    };
    tracing::info!(
        "profile {} (digest {}): {}",
        profile.name,
        profile.digest,
        profile.settings
    );
    let backend = EngineArgs::options(&resolved.settings, None).backend;
    let app = Arc::new(App {
        catalog: Catalog::new(models_dir, resolved.settings.clone()),
        worker,
        metrics,
        max_body_bytes: a.max_body_bytes,
        receive_timeout: Duration::from_secs_f64(a.receive_timeout.max(0.001)),
        profile,
        backend: backend.describe(),
        exactness_note: (!backend.batch_invariant()).then(|| {
            format!(
                "{}: prefix reuse, speculation and batching are off (not shown batch invariant)",
                backend.describe()
            )
        }),
        started: Instant::now(),
        access: Arc::new(access),
        body_budget: Arc::new(tokio::sync::Semaphore::new(app::body_budget_kib(
            a.max_body_bytes,
        ))),
        prepare_slots: Arc::new(tokio::sync::Semaphore::new(
            std::thread::available_parallelism().map_or(2, |n| n.get()),
        )),
    });
    if let Some(m) = &a.preload {
        app.catalog.get(m).map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(serve(app, a, addr))
}

/// The address `--host`/`--port` name.
fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    format!("{host}:{port}")
        .parse()
        .or_else(|_| {
            std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
                .ok()
                .and_then(|mut it| it.next())
                .ok_or(())
        })
        .map_err(|_| anyhow::anyhow!("cannot resolve --host {host}"))
}

async fn serve(app: Arc<App>, a: ServeArgs, addr: SocketAddr) -> Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let local = listener.local_addr()?;
    eprintln!(
        "voom serve: listening on http://{local} (models from {}, profile {})",
        app.catalog.dir().display(),
        app.profile.name
    );
    let router = router(Arc::clone(&app));
    let receive = app.receive_timeout;
    let write = Duration::from_secs_f64(a.write_timeout.max(0.001));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown_signal());
    loop {
        let (tcp, _peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = tcp.set_nodelay(true);
        // A write that makes no progress for `write` fails, dropping the connection
        // (and with it the request's stream: the engine stops at the next token).
        let mut io = tokio_io_timeout::TimeoutStream::new(tcp);
        io.set_write_timeout(Some(write));
        let io = TokioIo::new(Box::pin(io));
        let svc = hyper_util::service::TowerToHyperService::new(router.clone());
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(receive)
            .keep_alive(true)
            .serve_connection(io, svc);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection ended: {e}");
            }
        });
    }
    eprintln!("voom serve: shutting down");
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(Duration::from_secs(10)) => {
            eprintln!("voom serve: connections still open after 10 s; exiting");
        }
    }
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = ctrl_c => {}
            _ = async {
                match term.as_mut() {
                    Some(t) => { t.recv().await; }
                    None => std::future::pending::<()>().await,
                }
            } => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
