//! `vpagectl`: control tool of the vOOM page store.
//!
//! - `vpagectl hash MODEL_DIR` hashes every page of a checkpoint and writes its page
//!   manifest (`voom-manifest.json`).
//! - `vpagectl verify MODEL_DIR` re-hashes every page against the manifest, and decodes
//!   and hashes every encoded body (vpack) the manifest lists.
//! - `vpagectl pack MODEL_DIR` writes the vpack body of every BF16/F16 page into
//!   `model.vpack` beside the raw files and lists them in the manifest.
//!
//! Exit status: 0 success (also when the reader of stdout closed it early, as `head`
//! does); 1 the store does not match its manifest (a page's bytes or a vpack body
//! differ, the manifest is stale, or a checkpoint file no longer parses; `pack` refuses
//! to pack a page whose raw bytes fail their hash); 2 the command could not run (no
//! manifest, unreadable directory, bad arguments, stdout that cannot be written).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;
use voom_formats::manifest::{Manifest, PageGroup, MANIFEST_FILE};
use voom_formats::vpack::{PACK_ALIGN, PACK_FILE};
use voom_formats::{Checkpoint, FormatError};
use vpaged::{outln, stdout};

#[derive(Parser)]
#[command(
    name = "vpagectl",
    version,
    about = "Control tool of the vOOM page store"
)]
struct Cli {
    /// The daemon's socket (for status and pages).
    #[arg(long, global = true, env = "VPAGED_SOCKET")]
    socket: Option<PathBuf>,
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
    /// Re-hash every page of MODEL_DIR (raw and vpack copies) against its manifest;
    /// exit 1 on any mismatch.
    Verify {
        /// A model directory holding voom-manifest.json.
        model_dir: PathBuf,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Write the vpack body of every BF16/F16 page of MODEL_DIR into model.vpack
    /// (manifest order, 16 KiB aligned) and list each in the manifest.
    Pack {
        /// A model directory holding voom-manifest.json (see `vpagectl hash`).
        model_dir: PathBuf,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// The daemon's cache, tiers, models and connected engines.
    Status {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Every page of MODEL_DIR: where it lives, and whether the daemon holds it resident.
    Pages {
        /// A model directory holding voom-manifest.json.
        model_dir: PathBuf,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Copy MODEL_DIR's pages the daemon read from storage most often (its hottest
    /// routed experts first, in a mixture of experts) onto its fast tier.
    Stage {
        model_dir: PathBuf,
        /// Stage at most this many bytes (e.g. 4GiB); default: as much as fits.
        #[arg(long)]
        max_bytes: Option<vpaged::config::ByteSize>,
        #[arg(long)]
        json: bool,
    },
    /// Remove MODEL_DIR's pages from the daemon's fast tier.
    Unstage {
        model_dir: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Replay a routing trace (`voom generate --expert-trace FILE`) through expert
    /// caches of several sizes under each policy (LRU, LFU with admission, the page
    /// cache's TinyLFU, a static set, the Belady bound): bytes of experts read per
    /// token for each.
    ExpertPlan {
        trace: PathBuf,
        /// The share of passes the policies are fitted (warmed) on; the rest is scored.
        #[arg(long, default_value_t = 0.5)]
        fit: f64,
        /// Cache sizes to replay (comma-separated, e.g. 1GiB,4GiB); default: 5%, 10%,
        /// 25% and 50% of the experts the trace reads.
        #[arg(long, value_delimiter = ',')]
        cache: Vec<vpaged::config::ByteSize>,
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli: Cli = match stdout::parse_args("vpagectl") {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    let result = match &cli.command {
        Command::Hash { model_dir, json } => hash(model_dir, *json),
        Command::Verify { model_dir, json } => verify(model_dir, *json),
        Command::Pack { model_dir, json } => pack(model_dir, *json),
        Command::Status { json } => status(cli.socket.as_deref(), *json),
        Command::Stage {
            model_dir,
            max_bytes,
            json,
        } => stage(
            cli.socket.as_deref(),
            model_dir,
            max_bytes.map(|b| b.0),
            *json,
        ),
        Command::Unstage { model_dir, json } => unstage(cli.socket.as_deref(), model_dir, *json),
        Command::Pages { model_dir, json } => pages(cli.socket.as_deref(), model_dir, *json),
        Command::ExpertPlan {
            trace,
            fit,
            cache,
            json,
        } => expert_plan(trace, *fit, cache, *json),
    };
    // A closed stdout (`vpagectl status | head -1`) ends quietly with 0; any other
    // failure, writing to stdout included, is an error and status 2.
    stdout::exit_code("vpagectl", result, 2)
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
    })?;
    let elapsed = start.elapsed();
    pb.finish_and_clear();
    manifest.save(dir).context("writing the manifest")?;

    let bytes = manifest.total_bytes();
    let path = dir.join(MANIFEST_FILE);
    if json {
        outln!(
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
        )?;
    } else {
        outln!(
            "hashed {} pages in {} file(s): {} bytes ({:.3} GiB) in {:.3} s, {:.2} GB/s",
            manifest.pages.len(),
            ckpt.files.len(),
            bytes,
            bytes as f64 / (1u64 << 30) as f64,
            elapsed.as_secs_f64(),
            gb_per_s(bytes, elapsed)
        )?;
        outln!("wrote {}", path.display())?;
    }
    Ok(ExitCode::SUCCESS)
}

fn load_manifest(dir: &Path) -> Result<Manifest> {
    Manifest::load(dir)
        .context("reading the manifest")?
        .with_context(|| {
            format!(
                "no {MANIFEST_FILE} in {}; run `vpagectl hash {}` first",
                dir.display(),
                dir.display()
            )
        })
}

fn verify(dir: &Path, json: bool) -> Result<ExitCode> {
    let manifest = load_manifest(dir)?;
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
    pb.finish_and_clear();
    // Encoded bodies live in their own files: they are checked even when the raw
    // checkpoint is broken.
    let pb = progress_bar(json, "verifying vpack");
    let encoded = manifest.verify_encoded(dir, &mut |done, total| {
        pb.set_length(total);
        pb.set_position(done);
    });
    let elapsed = start.elapsed();
    pb.finish_and_clear();
    let encoded_pages = manifest
        .pages
        .iter()
        .filter(|p| !p.encoded.is_empty())
        .count();

    let (store_error, mut mismatches) = match outcome {
        Ok(m) => (None, m),
        Err(e) => (Some(e), Vec::new()),
    };
    mismatches.extend(encoded?);
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
                FormatError::BadTensor { path, tensor, .. } => json!({"page": tensor, "file": path.display().to_string(), "error": e.to_string()}),
                other => json!({"error": other.to_string()}),
            })
            .collect();
        outln!(
            "{}",
            json!({
                "command": "verify",
                "model_dir": dir.display().to_string(),
                "ok": ok,
                "pages": manifest.pages.len(),
                "encoded_pages": encoded_pages,
                "bytes": bytes,
                "seconds": elapsed.as_secs_f64(),
                "gb_per_s": gb_per_s(bytes, elapsed),
                "mismatches": list,
                "error": store_error.as_ref().map(|e| e.to_string()),
            })
        )?;
    } else {
        if let Some(e) = &store_error {
            outln!("FAILED: {e}")?;
        }
        for e in &mismatches {
            match e {
                FormatError::ChecksumMismatch {
                    path,
                    page,
                    expected,
                    actual,
                } => outln!(
                    "MISMATCH page '{page}' in {}: expected blake3 {expected}, got {actual}",
                    path.display()
                )?,
                FormatError::BadTensor {
                    path,
                    tensor,
                    detail,
                } => outln!("MISMATCH page '{tensor}' in {}: {detail}", path.display())?,
                other => outln!("MISMATCH {other}")?,
            }
        }
        if store_error.is_none() {
            outln!(
                "verified {} pages ({encoded_pages} with vpack bodies): {} bytes in {:.3} s, {:.2} GB/s: {}",
                manifest.pages.len(),
                bytes,
                elapsed.as_secs_f64(),
                gb_per_s(bytes, elapsed),
                if ok {
                    "all match".to_string()
                } else {
                    format!("{} mismatch(es)", mismatches.len())
                }
            )?;
        }
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn pack(dir: &Path, json: bool) -> Result<ExitCode> {
    let mut manifest = load_manifest(dir)?;
    let pb = progress_bar(json, "packing");
    let packed = voom_formats::pack::pack_model(dir, &mut manifest, &mut |done, total| {
        pb.set_length(total);
        pb.set_position(done);
    });
    pb.finish_and_clear();
    let pack_path = dir.join(PACK_FILE);
    let r = match packed {
        Ok(r) => r,
        // A page whose raw bytes no longer match the manifest is a store mismatch
        // (exit 1); anything else means the command could not run (exit 2).
        Err(e @ FormatError::ChecksumMismatch { .. }) => {
            if json {
                outln!(
                    "{}",
                    json!({"command": "pack", "model_dir": dir.display().to_string(), "ok": false, "error": e.to_string()})
                )?;
            } else {
                outln!("FAILED: {e}; nothing was packed (run `vpagectl verify`)")?;
            }
            return Ok(ExitCode::from(1));
        }
        Err(e) => return Err(anyhow::Error::new(e).context(format!("packing {}", dir.display()))),
    };
    if json {
        outln!(
            "{}",
            json!({
                "command": "pack",
                "model_dir": dir.display().to_string(),
                "ok": true,
                "pack_file": pack_path.display().to_string(),
                "pages": r.pages,
                "raw_pages": r.raw_pages,
                "raw_bytes": r.raw_bytes,
                "packed_bytes": r.packed_bytes,
                "file_bytes": r.file_bytes,
                "ratio": r.ratio(),
                "align": PACK_ALIGN,
                "encode_gb_per_s": gb_per_s(r.raw_bytes, r.encode),
                "decode_gb_per_s": gb_per_s(r.raw_bytes, r.decode),
                "seconds": r.elapsed.as_secs_f64(),
            })
        )?;
    } else {
        outln!(
            "packed {} pages ({} of other types stay raw): {} raw bytes -> {} packed \
             bytes, ratio {:.4}; encode {:.2} GB/s, decode {:.2} GB/s (one thread)",
            r.pages,
            r.raw_pages,
            r.raw_bytes,
            r.packed_bytes,
            r.ratio(),
            gb_per_s(r.raw_bytes, r.encode),
            gb_per_s(r.raw_bytes, r.decode),
        )?;
        outln!(
            "wrote {} ({} bytes) and {}",
            pack_path.display(),
            r.file_bytes,
            dir.join(MANIFEST_FILE).display()
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

fn connect(socket: Option<&Path>) -> Result<std::sync::Arc<vpaged::client::DaemonClient>> {
    let socket = socket
        .map(Path::to_path_buf)
        .unwrap_or_else(vpaged::config::default_socket);
    Ok(vpaged::client::DaemonClient::connect(&socket, "vpagectl")?)
}

fn status(socket: Option<&Path>, json: bool) -> Result<ExitCode> {
    let c = connect(socket)?;
    let s = c.stats()?;
    if json {
        outln!("{s}")?;
        return Ok(ExitCode::SUCCESS);
    }
    let cache = &s["cache"];
    let gib = |v: &serde_json::Value| human(v.as_f64().unwrap_or(0.0));
    outln!(
        "vpaged at {} (server {})",
        c.socket().display(),
        s["server_id"]
    )?;
    outln!(
        "cache: {} of {} used, {} leased, {} pinned, {} pages resident",
        gib(&cache["used"]),
        gib(&cache["capacity"]),
        gib(&cache["leased_bytes"]),
        gib(&cache["pinned_bytes"]),
        cache["resident_pages"]
    )?;
    outln!(
        "       {} hits, {} misses (hit ratio {:.3}), {} in-flight dedups, {} evictions, {} loaded",
        cache["hits"],
        cache["misses"],
        cache["hit_ratio"].as_f64().unwrap_or(0.0),
        cache["inflight_dedups"],
        cache["evictions"],
        gib(&cache["bytes_loaded"])
    )?;
    if let Some(f) = s["fast_tier"].as_object() {
        outln!(
            "fast tier {}: {} of {}, {} reads at {:.2} GB/s",
            f["dir"].as_str().unwrap_or("?"),
            gib(&f["used"]),
            gib(&f["capacity"]),
            f["stats"]["reads"],
            f["stats"]["gb_per_sec"].as_f64().unwrap_or(0.0)
        )?;
    }
    for m in s["models"].as_array().into_iter().flatten() {
        // Tier statistics are left out of a summary (many models open).
        let tier = match m["primary"].is_object() {
            true => format!(
                "; primary {} reads at {:.2} GB/s",
                m["primary"]["reads"],
                m["primary"]["gb_per_sec"].as_f64().unwrap_or(0.0)
            ),
            false => String::new(),
        };
        outln!(
            "model {} {}{}: {} pages; served fast {} / primary {} / nas {}{tier}",
            m["id"],
            m["dir"].as_str().unwrap_or("?"),
            if m["current"] == false {
                " (superseded by a newer manifest)"
            } else {
                ""
            },
            m["pages"],
            m["served"]["fast"],
            m["served"]["primary"],
            m["served"]["nas"],
        )?;
    }
    if s["models"].is_null() {
        outln!("{} models open (too many to list)", s["open_models"])?;
    }
    let sess = &s["sessions"];
    outln!(
        "engines: {} connected ({} since start), {} leases held",
        sess["connected"],
        sess["total"],
        sess["leases"]
    )?;
    Ok(ExitCode::SUCCESS)
}

fn pages(socket: Option<&Path>, dir: &Path, json: bool) -> Result<ExitCode> {
    let manifest = load_manifest(dir)?;
    let c = connect(socket)?;
    // Opening the model through the daemon gives its id there.
    let source = vpaged::client::DaemonSource::open(std::sync::Arc::clone(&c), dir)?;
    let id = u64::from(source.model_id().0);
    let s = c.stats()?;
    let canon = dir.canonicalize()?;
    if s["detail"].as_str().is_some_and(|d| d != "full") {
        anyhow::bail!(
            "the daemon's stats leave out per-page residency ({} models open: the full \
             document would exceed the protocol's stats limit)",
            s["open_models"]
        );
    }
    let m = s["models"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["id"].as_u64() == Some(id))
        .context("the daemon does not list the model it opened")?;
    let resident: std::collections::HashSet<u64> = m["resident"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_u64())
        .collect();
    let accesses: Vec<u64> = m["accesses"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|v| v.as_u64().unwrap_or(0))
        .collect();
    let names: std::collections::HashSet<&str> =
        manifest.pages.iter().map(|p| p.name.as_str()).collect();
    let rows: Vec<serde_json::Value> = manifest
        .pages
        .iter()
        .map(|p| {
            let format = voom_formats::StoredFormat::of(&p.name, p.dtype, |n| names.contains(n));
            serde_json::json!({
                "id": p.id,
                "name": p.name,
                "dtype": p.dtype.to_string(),
                "format": format.to_string(),
                "rows": p.rows.map(|r| [r.start, r.end()]),
                "label": p.label(),
                "group": p.group,
                "bytes": p.decoded_len(),
                "file": p.file,
                "offset": p.offset,
                "vpack": p.vpack().map(|b| serde_json::json!({"file": b.file, "offset": b.offset, "len": b.len})),
                "resident": resident.contains(&(p.id as u64)),
                "requests": accesses.get(p.id as usize).copied().unwrap_or(0),
            })
        })
        .collect();
    if json {
        outln!("{}", serde_json::json!({ "model": canon, "pages": rows }))?;
    } else {
        outln!(
            "{:>6} {:>8} {:>12} {:<9} {:<6} {:<14} {:<15} name",
            "id",
            "requests",
            "bytes",
            "resident",
            "vpack",
            "group",
            "format"
        )?;
        for (r, p) in rows.iter().zip(&manifest.pages) {
            let group = match p.group {
                PageGroup::Embedding => "embedding".to_string(),
                PageGroup::Layer(l) => format!("layer {l}"),
                PageGroup::Expert { layer, expert } => format!("expert {layer}.{expert}"),
                PageGroup::Final => "final".to_string(),
                PageGroup::Other => "other".to_string(),
            };
            outln!(
                "{:>6} {:>8} {:>12} {:<9} {:<6} {:<14} {:<15} {}",
                // Numbers, not JSON values: a Value's Display ignores the width.
                r["id"].as_u64().unwrap_or(0),
                r["requests"].as_u64().unwrap_or(0),
                r["bytes"].as_u64().unwrap_or(0),
                if r["resident"].as_bool() == Some(true) {
                    "yes"
                } else {
                    "no"
                },
                if r["vpack"].is_null() { "no" } else { "yes" },
                group,
                r["format"].as_str().unwrap_or(""),
                r["label"].as_str().unwrap_or("")
            )?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn expert_plan(
    path: &Path,
    fit: f64,
    cache: &[vpaged::config::ByteSize],
    json: bool,
) -> Result<ExitCode> {
    use vpaged::expert_plan::{replay, score_layout, Layout, Policy};
    if !(0.0..1.0).contains(&fit) {
        anyhow::bail!("--fit {fit}: a share of the passes, at least 0 and below 1");
    }
    let trace = vpaged::expert_trace::Trace::read_file(path)
        .with_context(|| format!("reading {}", path.display()))?;
    let passes = trace.passes.len();
    let fitted = (passes as f64 * fit).floor() as usize;
    if fitted >= passes {
        anyhow::bail!("{}: {passes} passes leave none to score", path.display());
    }
    // The experts the trace reads, each once: what a cache of every one would hold.
    let mut distinct = std::collections::HashSet::new();
    let mut read_bytes = 0u64;
    for p in &trace.passes {
        for (l, list) in p.experts.iter().enumerate() {
            for &e in list {
                if distinct.insert((l, e)) {
                    read_bytes += trace.header.expert_bytes[l];
                }
            }
        }
    }
    let sizes: Vec<u64> = if cache.is_empty() {
        [0.05, 0.10, 0.25, 0.50]
            .iter()
            .map(|f| (read_bytes as f64 * f) as u64)
            .collect()
    } else {
        cache.iter().map(|b| b.0).collect()
    };
    let rows: Vec<_> = sizes
        .iter()
        .flat_map(|&size| Policy::ALL.map(|p| replay(&trace, p, size, fitted)))
        .collect();
    let routed = rows.first().map_or(0.0, |s| s.routed_bytes_per_token());
    // The physical order of the experts' pages, under the policy the page cache
    // uses (LFU with admission): the checkpoint's, and one fitted on the same passes.
    let layouts = [
        ("checkpoint", Layout::checkpoint(&trace)),
        ("fitted", Layout::fitted(&trace, fitted)),
    ];
    let trace_ref = &trace;
    let layout_rows: Vec<_> = sizes
        .iter()
        .flat_map(|&size| {
            layouts.iter().map(move |(name, l)| {
                (*name, score_layout(trace_ref, Policy::Lfu, size, fitted, l))
            })
        })
        .collect();
    if json {
        outln!(
            "{}",
            json!({
                "trace": path,
                "model": trace.header.model,
                "passes": passes,
                "fitted_passes": fitted,
                "distinct_experts": distinct.len(),
                "distinct_expert_bytes": read_bytes,
                "routed_bytes_per_token": routed,
                "replays": rows.iter().map(|s| json!({
                    "policy": s.policy.name(),
                    "cache_bytes": s.capacity_bytes,
                    "bytes_per_token": s.bytes_per_token(),
                    "hit_ratio": s.hit_ratio(),
                    "misses": s.misses,
                    "accesses": s.accesses,
                    "tokens": s.tokens,
                })).collect::<Vec<_>>(),
                "layouts": layout_rows.iter().map(|(name, s)| json!({
                    "layout": name,
                    "policy": s.policy.name(),
                    "cache_bytes": s.capacity_bytes,
                    "reads_per_token": s.reads_per_token(),
                    "bytes_per_token": s.bytes_per_token(),
                    "bytes_per_read": s.bytes_per_read(),
                })).collect::<Vec<_>>(),
            })
        )?;
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "{}: {passes} passes ({} fitted, {} tokens scored), {} distinct experts read ({}); \
         without a cache {} of experts per token",
        trace.header.model,
        fitted,
        rows.first().map_or(0, |s| s.tokens),
        distinct.len(),
        human(read_bytes as f64),
        human(routed)
    )?;
    outln!(
        "{:>12} {:<10} {:>14} {:>9}",
        "cache",
        "policy",
        "read/token",
        "hits"
    )?;
    for s in &rows {
        outln!(
            "{:>12} {:<10} {:>14} {:>8.1}%",
            human(s.capacity_bytes as f64),
            s.policy.name(),
            human(s.bytes_per_token()),
            100.0 * s.hit_ratio()
        )?;
    }
    outln!("the misses of lfu-admit as coalesced reads (adjacent experts of one layer in one pass read at once):")?;
    outln!(
        "{:>12} {:<10} {:>11} {:>14} {:>12}",
        "cache",
        "layout",
        "reads/token",
        "read/token",
        "per read"
    )?;
    for (name, s) in &layout_rows {
        outln!(
            "{:>12} {:<10} {:>11.2} {:>14} {:>12}",
            human(s.capacity_bytes as f64),
            name,
            s.reads_per_token(),
            human(s.bytes_per_token()),
            human(s.bytes_per_read())
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Bytes in binary units.
fn human(b: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{v:.0} B")
    } else {
        format!("{v:.2} {}", UNITS[i])
    }
}

fn stage(
    socket: Option<&Path>,
    dir: &Path,
    max_bytes: Option<u64>,
    json: bool,
) -> Result<ExitCode> {
    let c = connect(socket)?;
    // Staging copies up to the whole fast tier before it answers: from a NAS that can
    // take longer than any fixed bound, so the request waits as long as it takes.
    c.set_request_timeout(None)?;
    let src = vpaged::client::DaemonSource::open(c, dir)?;
    let (pages, bytes) = src.stage(max_bytes.unwrap_or(u64::MAX))?;
    if json {
        outln!(
            "{}",
            serde_json::json!({"staged_pages": pages, "staged_bytes": bytes})
        )?;
    } else {
        outln!("staged {pages} pages, {}", human(bytes as f64))?;
    }
    Ok(ExitCode::SUCCESS)
}

fn unstage(socket: Option<&Path>, dir: &Path, json: bool) -> Result<ExitCode> {
    let c = connect(socket)?;
    c.set_request_timeout(None)?;
    let src = vpaged::client::DaemonSource::open(c, dir)?;
    let (pages, bytes) = src.unstage()?;
    if json {
        outln!(
            "{}",
            serde_json::json!({"unstaged_pages": pages, "unstaged_bytes": bytes})
        )?;
    } else {
        outln!("unstaged {pages} pages, {}", human(bytes as f64))?;
    }
    Ok(ExitCode::SUCCESS)
}
