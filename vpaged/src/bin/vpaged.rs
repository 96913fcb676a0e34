//! `vpaged`: the page daemon. Owns the shared page cache and the tiers, and serves
//! pages to engines over a Unix socket (docs/protocol.md).
//!
//! Every flag is also an environment variable (`VPAGED_*`) and a key of the TOML file
//! given by `--config`; flags win over the environment, which wins over the file.

use std::os::unix::fs::PermissionsExt;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use vpaged::config::{DaemonArgs, DaemonConfig};
use vpaged::daemon::{bind_private, Daemon, DaemonLimits};
use vpaged::socket_path::{check_socket_dir, clear_stale_socket};
use vpaged::stdout;
use vpaged::store::{Store, StoreConfig};

#[derive(Parser)]
#[command(
    name = "vpaged",
    version,
    about = "vOOM page daemon: one shared page cache for every engine"
)]
struct Cli {
    #[command(flatten)]
    args: DaemonArgs,
}

fn main() -> ExitCode {
    // `--help` and `--version` go to stdout: a closed pipe ends quietly, a failed write
    // is an error (never a panic); so is any error of the daemon, with status 1.
    let cli: Cli = match stdout::parse_args("vpaged") {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    stdout::exit_code("vpaged", run(cli).map(|()| ExitCode::SUCCESS), 1)
}

fn run(cli: Cli) -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VPAGED_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cfg = DaemonConfig::resolve(&cli.args).map_err(anyhow::Error::msg)?;
    let store = Store::new(StoreConfig {
        cache_bytes: cfg.cache_size as usize,
        fast_tier: cfg.fast_tier.clone().map(|d| (d, cfg.fast_tier_size)),
        nas: cfg.nas.iter().map(|n| n.nas_config()).collect(),
        pin_first_layers: cfg.pin_first_layers,
        pin_last_layers: cfg.pin_last_layers,
        read_mode: cfg.read_mode,
        io: cfg.io,
        hash_on_open: cfg.hash_on_open,
        manifest_dir: Some(cfg.state_dir.join("manifests")),
    })
    .context("creating the page store")?;
    if cfg.prefault {
        let t = std::time::Instant::now();
        store
            .cache()
            .arena()
            .prefault()
            .context("pre-faulting the page cache")?;
        tracing::info!(
            "committed the {}-byte page cache in {:.2}s",
            cfg.cache_size,
            t.elapsed().as_secs_f64()
        );
    }

    let socket = cfg.socket.clone();
    if let Some(parent) = socket.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    // A directory others can write would let them take the socket's place.
    if let Some(warning) = check_socket_dir(&socket)? {
        tracing::warn!("{warning}");
    }
    // Only a stale socket is replaced; a live one, or any other file, is refused.
    clear_stale_socket(&socket)?;
    // Bound before the runtime's threads start (the umask is process-wide), mode 0600
    // from the start.
    let listener =
        bind_private(&socket).with_context(|| format!("binding {}", socket.display()))?;
    // Only restates the mode (never looser).
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600))?;
    listener.set_nonblocking(true)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::UnixListener::from_std(listener)
            .with_context(|| format!("listening on {}", socket.display()))?;
        tracing::info!(
            "serving {} (cache {} bytes{})",
            socket.display(),
            cfg.cache_size,
            cfg.fast_tier
                .as_ref()
                .map(|f| format!(", fast tier {}", f.display()))
                .unwrap_or_default()
        );
        let daemon = Daemon::with_limits(
            store,
            DaemonLimits {
                max_sessions: cfg.max_sessions,
                ..DaemonLimits::default()
            },
        );
        let shutdown = async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("SIGTERM handler");
            tokio::select! {
                _ = term.recv() => {},
                _ = tokio::signal::ctrl_c() => {},
            }
            tracing::info!("shutting down: draining sessions");
        };
        daemon.serve(listener, socket.clone(), shutdown).await?;
        tracing::info!("stopped");
        Ok::<(), anyhow::Error>(())
    })
}
