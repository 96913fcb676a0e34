//! `vpagectl`: control tool of the vOOM page store.
//!
//! - `vpagectl hash MODEL_DIR` hashes every page of a checkpoint and writes its page
//!   manifest (`voom-manifest.json`).
//! - `vpagectl verify MODEL_DIR` re-hashes every page against the manifest.
//!
//! Exit status: 0 success; 1 the store does not match its manifest (a page's bytes
//! differ, the manifest is stale, or a checkpoint file no longer parses); 2 the command
//! could not run (no manifest, unreadable directory, bad arguments).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;
use voom_formats::manifest::{Manifest, MANIFEST_FILE};
use voom_formats::{Checkpoint, FormatError};

#[derive(Parser)]
#[command(
    name = "vpagectl",
    version,
    about = "Control tool of the vOOM page store"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Hash every page of MODEL_DIR and write its manifest (voom-manifest.json).
    Hash {
        /// A Hugging Face model directory (model.safetensors or sharded).
        model_dir: PathBuf,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Re-hash every page of MODEL_DIR against its manifest; exit 1 on any mismatch.
    Verify {
        /// A model directory holding voom-manifest.json.
        model_dir: PathBuf,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Hash { model_dir, json } => hash(model_dir, *json),
        Command::Verify { model_dir, json } => verify(model_dir, *json),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("vpagectl: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// A byte progress bar on stderr, drawn only when stderr is a terminal and the output
/// is not JSON.
fn progress_bar(json: bool, verb: &str) -> ProgressBar {
    let target = if !json && std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let pb = ProgressBar::with_draw_target(Some(0), target);
    pb.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    pb.set_message(verb.to_string());
    pb
}

fn gb_per_s(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / 1e9 / elapsed.as_secs_f64().max(1e-9)
}

fn hash(dir: &Path, json: bool) -> Result<ExitCode> {
    let ckpt = Checkpoint::open(dir).context("opening the checkpoint")?;
    let pb = progress_bar(json, "hashing");
    let start = Instant::now();
    let manifest = Manifest::build(&ckpt, &mut |done, total| {
        pb.set_length(total);
        pb.set_position(done);
    });
    let elapsed = start.elapsed();
    pb.finish_and_clear();
    manifest.save(dir).context("writing the manifest")?;

    let bytes = manifest.total_bytes();
    let path = dir.join(MANIFEST_FILE);
    if json {
        println!(
            "{}",
            json!({
                "command": "hash",
                "model_dir": dir.display().to_string(),
                "manifest": path.display().to_string(),
                "files": ckpt.files.len(),
                "pages": manifest.pages.len(),
                "bytes": bytes,
                "seconds": elapsed.as_secs_f64(),
                "gb_per_s": gb_per_s(bytes, elapsed),
            })
        );
    } else {
        println!(
            "hashed {} pages in {} file(s): {} bytes ({:.3} GiB) in {:.3} s, {:.2} GB/s",
            manifest.pages.len(),
            ckpt.files.len(),
            bytes,
            bytes as f64 / (1u64 << 30) as f64,
            elapsed.as_secs_f64(),
            gb_per_s(bytes, elapsed)
        );
        println!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

fn verify(dir: &Path, json: bool) -> Result<ExitCode> {
    let manifest = Manifest::load(dir)
        .context("reading the manifest")?
        .with_context(|| {
            format!(
                "no {MANIFEST_FILE} in {}; run `vpagectl hash {}` first",
                dir.display(),
                dir.display()
            )
        })?;
    let bytes = manifest.total_bytes();
    let pb = progress_bar(json, "verifying");
    let start = Instant::now();
    // A checkpoint that no longer parses, or no longer matches the manifest's layout,
    // fails verification as a whole: its pages cannot be located.
    let outcome = Checkpoint::open(dir).and_then(|ckpt| {
        manifest.verify_checkpoint(&ckpt, &mut |done, total| {
            pb.set_length(total);
            pb.set_position(done);
        })
    });
    let elapsed = start.elapsed();
    pb.finish_and_clear();

    let (store_error, mismatches) = match outcome {
        Ok(m) => (None, m),
        Err(e) => (Some(e), Vec::new()),
    };
    let ok = store_error.is_none() && mismatches.is_empty();
    if json {
        let list: Vec<_> = mismatches
            .iter()
            .map(|e| match e {
                FormatError::ChecksumMismatch {
                    path,
                    page,
                    expected,
                    actual,
                } => json!({"page": page, "file": path.display().to_string(), "expected": expected, "actual": actual}),
                other => json!({"error": other.to_string()}),
            })
            .collect();
        println!(
            "{}",
            json!({
                "command": "verify",
                "model_dir": dir.display().to_string(),
                "ok": ok,
                "pages": manifest.pages.len(),
                "bytes": bytes,
                "seconds": elapsed.as_secs_f64(),
                "gb_per_s": gb_per_s(bytes, elapsed),
                "mismatches": list,
                "error": store_error.as_ref().map(|e| e.to_string()),
            })
        );
    } else {
        if let Some(e) = &store_error {
            println!("FAILED: {e}");
        }
        for e in &mismatches {
            match e {
                FormatError::ChecksumMismatch {
                    path,
                    page,
                    expected,
                    actual,
                } => println!(
                    "MISMATCH page '{page}' in {}: expected blake3 {expected}, got {actual}",
                    path.display()
                ),
                other => println!("MISMATCH {other}"),
            }
        }
        if store_error.is_none() {
            println!(
                "verified {} pages: {} bytes in {:.3} s, {:.2} GB/s: {}",
                manifest.pages.len(),
                bytes,
                elapsed.as_secs_f64(),
                gb_per_s(bytes, elapsed),
                if ok {
                    "all match".to_string()
                } else {
                    format!("{} mismatch(es)", mismatches.len())
                }
            );
        }
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
