//! `voom`: run released language models exactly, larger than memory.
//!
//! One-shot commands compose the engine (libvoom) with the embedded page store:
//! `voom run MODEL [PROMPT]`, `voom generate`, `voom pull`, `voom import`, `voom list`,
//! `voom profiles`, `voom plan`, `voom perplexity`, and `voom serve`, the HTTP server.

use clap::{Parser, Subcommand};
use voom_server::{cli, serve};

#[derive(Parser)]
#[command(
    name = "voom",
    version,
    about = "Run released language models exactly, larger than memory"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Answer a prompt (or chat interactively) with a model from the local store or a directory.
    Run(cli::run::RunArgs),
    /// Generate from a prompt, prompt ids or a chat message, with full control.
    Generate(cli::generate::GenerateArgs),
    /// Put a known model into the local store (no model hub needed).
    Pull(cli::pull::PullArgs),
    /// Import a GGUF file into the local store, its tensors as stored (quantized: a lossy- model).
    Import(cli::pull::ImportArgs),
    /// List the models in the local store.
    List(cli::list::ListArgs),
    /// Show how a memory budget places a model's pages, and the speed it predicts.
    Plan(cli::plan::PlanArgs),
    /// Measure prefill and decode speed against the memory-bandwidth bound.
    Bench(cli::bench::BenchArgs),
    /// The perplexity of a text as llama-perplexity computes it; KL divergence from an exact model.
    Perplexity(cli::perplexity::PerplexityArgs),
    /// Serve the models over OpenAI- and Anthropic-compatible HTTP APIs.
    Serve(serve::ServeArgs),
    /// List the runtime profiles, or show how one resolves.
    Profiles(cli::profiles::ProfilesArgs),
}

fn main() -> std::process::ExitCode {
    let cli = match vpaged::stdout::parse_args::<Cli>("voom") {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    // The server logs one line per request by default; one-shot commands only warn,
    // and say what the page store does that takes time (hashing a checkpoint that has
    // no manifest, with its progress) or changes what is served.
    let default_filter = match cli.command {
        Command::Serve(_) => "info",
        _ => "warn,vpaged::store=info",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VOOM_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        .init();
    let r = match cli.command {
        Command::Run(a) => cli::run::run(a),
        Command::Generate(a) => cli::generate::run(a),
        Command::Pull(a) => cli::pull::pull(a),
        Command::Import(a) => cli::pull::import(a),
        Command::List(a) => cli::list::run(a),
        Command::Plan(a) => cli::plan::run(a),
        Command::Bench(a) => cli::bench::run(a),
        Command::Perplexity(a) => cli::perplexity::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Profiles(a) => cli::profiles::run(a),
    };
    // A closed stdout pipe (`voom list | head -1`) ends quietly; any other failure
    // is reported with status 1.
    vpaged::stdout::exit_code("voom", r.map(|()| std::process::ExitCode::SUCCESS), 1)
}
