//! `voom plan MODEL --memory-budget 4GiB`: the placement the memory planner makes of
//! a model under a budget, and the bytes read per token and tokens/s it predicts for
//! the storage and memory bandwidth measured here, before anything runs.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use libvoom::backend::cpu::membw;
use libvoom::engine::{Engine, EngineOptions};
use libvoom::model::plan::Stage;
use libvoom::placement::{self, human, Placement};
use serde_json::json;
use voom_formats::Manifest;
use vpaged::direct::{self, Bandwidth, ReadMode};
use vpaged::VerifyMode;

use crate::cli::common::resolve_model;
use crate::memory;

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// Model name in the local store, or a model directory.
    pub model: String,
    /// The memory budget for the whole process (`4GiB`, `700MiB`). Default: the
    /// memory available now (the lower of the machine's and the memory cgroup's).
    #[arg(long, value_parser = crate::profile::parse_size)]
    pub memory_budget: Option<u64>,
    /// Context to plan KV cache for (positions). Default: the model's maximum, at
    /// most 4096.
    #[arg(long)]
    pub context: Option<usize>,
    /// Positions each layer computes at a time during prefill, to plan scratch for
    /// (a prompt of the whole context is planned for).
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: usize,
    /// Compute threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Bytes of the checkpoint to read when measuring storage bandwidth.
    #[arg(long, value_parser = crate::profile::parse_size, default_value = "512MiB")]
    pub measure_bytes: u64,
    /// Memory of the process itself besides weights, KV and scratch (code, heap,
    /// tokenizer). Default: this process's resident memory once the model is open.
    /// A margin for its growth is added either way, as `voom generate` does.
    #[arg(long, value_parser = crate::profile::parse_size)]
    pub process_bytes: Option<u64>,
    /// A fast tier (a directory on faster storage than the model's): show the static
    /// set the planner gives it of the pages that stream, the bytes per token it takes
    /// off the model's storage, and (measured) the speed that predicts. Measuring
    /// writes a probe file of `--measure-bytes` there, reads it cold, and removes it.
    #[arg(long)]
    pub fast_tier: Option<PathBuf>,
    /// Bytes the fast tier may hold. Default: nine tenths of what it could hold (its
    /// file system's free space and its own copies), as `voom run` takes it.
    #[arg(long, value_parser = crate::profile::parse_size, requires = "fast_tier")]
    pub fast_tier_size: Option<u64>,
    /// Skip the bandwidth measurements (no predicted speed).
    #[arg(long)]
    pub no_measure: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: PlanArgs) -> Result<()> {
    let dir = resolve_model(&a.model, false)?;
    let engine = Engine::open(
        &dir,
        EngineOptions {
            threads: a.threads,
            verify: VerifyMode::Off,
            ..Default::default()
        },
    )
    .with_context(|| format!("opening model {}", dir.display()))?;
    let model = engine.model();
    let cfg = engine.config();
    let context = a
        .context
        .unwrap_or(crate::profile::BUDGET_CONTEXT)
        .min(cfg.max_position_embeddings)
        .max(1);
    let (process, process_from) = match a.process_bytes {
        Some(b) => (Some(b), "--process-bytes"),
        None => match memory::resident_bytes() {
            Some(b) => (Some(b), "measured"),
            None => (None, "not measured"),
        },
    };
    // What `voom generate --memory-budget` sets aside (cli::budget): the in-process
    // page cache's read buffers at its default reads in flight (and the model's
    // largest vpack bodies where it has them), and the process with its margin.
    let manifest = Manifest::load(&dir).ok().flatten();
    let needs = crate::cli::budget::needs(
        &engine,
        context,
        a.prefill_chunk,
        &vpaged::store::IoConfig::default(),
        manifest.as_ref(),
        process,
    );
    let (budget, budget_from) = match a.memory_budget {
        Some(b) => (b, "--memory-budget".to_string()),
        None => {
            let m = memory::available();
            (m.bytes, m.source)
        }
    };
    // A model that streams runs through a page cache, which loads pages whole (an
    // embedding table a part at a time): planned as that reads it.
    let whole = model.plan().whole_pages();
    let p = placement::place(&whole, &needs, budget)?;
    let plan = if p.streamed_per_token == 0 {
        model.plan().clone()
    } else {
        whole
    };

    let measured = if a.no_measure {
        None
    } else {
        Some(measure(
            &dir,
            a.measure_bytes,
            plan.weight_bytes_per_token(),
            engine.threads(),
        )?)
    };
    let stages = stage_summary(plan.stages(), &p);
    let formats = stored_formats(engine.source().pages());
    let fast = match &a.fast_tier {
        Some(d) => Some(fast_tier(
            d,
            a.fast_tier_size,
            &plan,
            &p,
            (!a.no_measure).then_some(a.measure_bytes),
            &dir,
        )?),
        None => None,
    };
    let predicted = measured.as_ref().map(|m| {
        let mut pr = predict(&p, m, plan.weight_bytes_per_token());
        if let Some(f) = &fast {
            pr["with_fast_tier_tokens_per_sec"] =
                json!(f.tokens_per_sec(&p, m, plan.weight_bytes_per_token()));
        }
        pr
    });
    if a.json {
        let m = measured.as_ref();
        let storage = m.map(|m| m.best_storage());
        vpaged::outln!(
            "{}",
            json!({
                "model": engine.name(),
                "budget": budget,
                "budget_from": budget_from,
                "context": context,
                "needs": {
                    "kv": needs.kv_bytes,
                    "scratch": needs.scratch_bytes,
                    "process": needs.process_bytes,
                    "process_from": process_from,
                    "read_buffers": needs.io_bytes,
                },
                "minimum_budget": p.minimum_budget(),
                "pinned_pages": p.pinned.len(),
                "pinned_bytes": p.pinned_bytes,
                "window_bytes": p.window_bytes,
                "expert_cache_bytes": p.expert_cache_bytes,
                "total_bytes": p.total(),
                "weight_bytes_per_token": plan.weight_bytes_per_token(),
                "streamed_bytes_per_token": p.streamed_per_token,
                "pinned_bytes_per_token": p.pinned_per_token,
                "stages": stages,
                "formats": formats.json(),
                "storage": m.map(|m| json!({
                    "direct_bytes_per_sec": m.direct.map(|b| b.bytes_per_sec()),
                    "direct_error": m.direct_error,
                    "buffered_bytes_per_sec": m.buffered.bytes_per_sec(),
                    "bytes_read": m.buffered.bytes,
                    "chosen": storage.map(|s| s.mode.name()),
                })),
                "memory_bytes_per_sec": m.map(|m| m.memory),
                "fast_tier": fast.as_ref().map(FastTier::json),
                "predicted": predicted,
            })
        )?;
        return Ok(());
    }
    vpaged::outln!(
        "{}: budget {} ({budget_from})",
        engine.name(),
        human(budget)
    )?;
    vpaged::outln!(
        "  needs: KV {} ({context} positions), scratch {}, process {}{}, read buffers {}",
        human(needs.kv_bytes),
        human(needs.scratch_bytes),
        human(needs.process_bytes),
        if process.is_some() {
            String::new()
        } else {
            format!(" ({process_from})")
        },
        human(needs.io_bytes)
    )?;
    vpaged::outln!(
        "  pinned: {} pages, {}; streaming window {}; in all {} (minimum {})",
        p.pinned.len(),
        human(p.pinned_bytes),
        human(p.window_bytes),
        human(p.total()),
        human(p.minimum_budget())
    )?;
    if p.expert_cache_bytes > 0 {
        vpaged::outln!(
            "  routed experts: none pinned; {} of the page cache left for the experts its \
             frequency-aware admission keeps (read per token below counts every routed \
             byte: what the cache keeps is seen only as tokens route)",
            human(p.expert_cache_bytes)
        )?;
    }
    vpaged::outln!("  {}", formats.line())?;
    for s in &stages {
        vpaged::outln!(
            "    {:<12} {:>10}  pinned {:>10}  read per token {:>10} from storage",
            s["name"].as_str().unwrap_or(""),
            human(s["bytes"].as_u64().unwrap_or(0)),
            human(s["pinned_bytes"].as_u64().unwrap_or(0)),
            human(s["streamed_per_token"].as_u64().unwrap_or(0)),
        )?;
    }
    vpaged::outln!(
        "  per token: {} of weights, {} from storage, {} from pinned memory",
        human(plan.weight_bytes_per_token()),
        human(p.streamed_per_token),
        human(p.pinned_per_token)
    )?;
    if let Some(m) = &measured {
        let direct = match (m.direct, &m.direct_error) {
            (Some(d), _) => format!("{:.2} GB/s direct", d.bytes_per_sec() / 1e9),
            (None, Some(e)) => format!("direct reads unavailable ({e})"),
            (None, None) => "direct not measured".into(),
        };
        vpaged::outln!(
            "  storage: {direct}, {:.2} GB/s buffered (cold, {} read); memory {:.1} GB/s",
            m.buffered.bytes_per_sec() / 1e9,
            human(m.buffered.bytes),
            m.memory / 1e9
        )?;
        let pr = predicted.clone().unwrap_or_default();
        vpaged::outln!(
            "  predicted decode: at most {:.2} tok/s (storage bound {}, memory bound {:.2})",
            pr["tokens_per_sec"].as_f64().unwrap_or(0.0),
            pr["storage_bound_tokens_per_sec"]
                .as_f64()
                .map_or("none: nothing streams".to_string(), |v| format!("{v:.2}")),
            pr["memory_bound_tokens_per_sec"].as_f64().unwrap_or(0.0),
        )?;
    }
    if let Some(f) = &fast {
        vpaged::outln!(
            "  fast tier {} ({} to hold): {} pages, {}; per token {} from it, {} from the model's storage",
            f.dir.display(),
            human(f.size),
            f.set.pages.len(),
            human(f.set.bytes),
            human(f.set.per_token),
            human(p.streamed_per_token - f.set.per_token),
        )?;
        let with = measured
            .as_ref()
            .and_then(|m| f.tokens_per_sec(&p, m, plan.weight_bytes_per_token()));
        if let (Some(bw), Some(tps)) = (&f.bandwidth, with) {
            vpaged::outln!(
                "    it reads {:.2} GB/s cold ({}); predicted decode with it: at most {:.2} tok/s",
                bw.bytes_per_sec() / 1e9,
                if f.same_device {
                    "the model's own device: the two are read one after the other"
                } else {
                    "another device than the model's: both are read at once"
                },
                tps,
            )?;
        }
    }
    Ok(())
}

/// The model's pages by stored format, and the bytes of its BF16 form.
struct Formats {
    /// (format, pages, bytes as stored), the most bytes first.
    each: Vec<(voom_formats::StoredFormat, usize, u64)>,
    stored: u64,
    bf16: u64,
}

/// The pages of `pages` by format ([`voom_formats::StoredFormat`]), and what they
/// would take as BF16 (FP8 weights twice their bytes, MXFP4 four times, scales none,
/// other floats at two bytes a value).
fn stored_formats(pages: &[vpaged::PageMeta]) -> Formats {
    use voom_formats::{DType, StoredFormat};
    let names: std::collections::HashSet<&str> = pages.iter().map(|p| p.name.as_str()).collect();
    let mut by: std::collections::HashMap<StoredFormat, (usize, u64)> = Default::default();
    let mut bf16 = 0u64;
    for p in pages {
        let f = StoredFormat::of(&p.name, p.dtype, |n| names.contains(n));
        let e = by.entry(f).or_default();
        e.0 += 1;
        e.1 += p.len;
        bf16 += match f {
            StoredFormat::Fp8E4M3 => 2 * p.len,
            StoredFormat::Mxfp4Blocks => 4 * p.len,
            StoredFormat::Fp8Scales(_) | StoredFormat::Mxfp4Scales => 0,
            StoredFormat::Plain(d @ (DType::F32 | DType::F16 | DType::BF16)) => {
                p.len / d.size() as u64 * 2
            }
            StoredFormat::Plain(_) => p.len,
        };
    }
    let mut each: Vec<_> = by.into_iter().map(|(f, (n, b))| (f, n, b)).collect();
    each.sort_by_key(|&(f, _, b)| (std::cmp::Reverse(b), f.to_string()));
    Formats {
        stored: each.iter().map(|e| e.2).sum(),
        each,
        bf16,
    }
}

impl Formats {
    fn json(&self) -> serde_json::Value {
        json!({
            "stored_bytes": self.stored,
            "bf16_bytes": self.bf16,
            "each": self.each.iter().map(|(f, n, b)| json!({
                "format": f.to_string(), "pages": n, "bytes": b,
            })).collect::<Vec<_>>(),
        })
    }

    /// `stored as: 1.1 GiB FP8 e4m3 (96 pages), ...; 2.1 GiB as BF16`.
    fn line(&self) -> String {
        let each: Vec<String> = self
            .each
            .iter()
            .map(|(f, n, b)| format!("{} {f} ({n} pages)", human(*b)))
            .collect();
        let ratio = if self.bf16 > 0 {
            format!(
                "; its BF16 form {} ({:.2}x)",
                human(self.bf16),
                self.stored as f64 / self.bf16 as f64
            )
        } else {
            String::new()
        };
        format!("stored as: {}{ratio}", each.join(", "))
    }
}

/// What a fast tier would hold and how fast it reads (`--fast-tier`).
struct FastTier {
    dir: PathBuf,
    size: u64,
    set: placement::FastTierSet,
    /// Its cold read bandwidth, when measured.
    bandwidth: Option<Bandwidth>,
    /// Whether it lies on the same device as the model (then its reads and the
    /// model's share the device, one after the other).
    same_device: bool,
}

impl FastTier {
    /// The decode bound with the set on the fast tier (none before the tier is
    /// measured): the seconds per token of the bytes left on the model's storage and
    /// of those on the tier (added where they share a device, else the longer of the
    /// two), and the memory bound.
    fn tokens_per_sec(&self, p: &Placement, m: &Measured, weight_bytes: u64) -> Option<f64> {
        let memory_bound = m.memory / weight_bytes.max(1) as f64;
        let slow =
            (p.streamed_per_token - self.set.per_token) as f64 / m.best_storage().bytes_per_sec();
        let fast = self.set.per_token as f64 / self.bandwidth?.bytes_per_sec();
        let secs = if self.same_device {
            slow + fast
        } else {
            slow.max(fast)
        };
        Some(if secs <= 0.0 {
            memory_bound
        } else {
            (1.0 / secs).min(memory_bound)
        })
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "dir": self.dir,
            "size": self.size,
            "pages": self.set.pages.len(),
            "bytes": self.set.bytes,
            "bytes_per_token": self.set.per_token,
            "bytes_per_sec": self.bandwidth.map(|b| b.bytes_per_sec()),
            "same_device_as_model": self.same_device,
        })
    }
}

/// The static set a fast tier in `dir` gives `plan` beside `p`, and (with
/// `measure`) its cold read bandwidth: a probe file of that many bytes is written
/// there, synced, read around the page cache (buffered after dropping it where
/// direct reads are refused), and removed.
fn fast_tier(
    dir: &Path,
    size: Option<u64>,
    plan: &libvoom::model::plan::PagePlan,
    p: &Placement,
    measure: Option<u64>,
    model_dir: &Path,
) -> Result<FastTier> {
    use std::os::unix::fs::MetadataExt;
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating the fast tier {}", dir.display()))?;
    let size = crate::cli::common::fast_tier_size(dir, size)?;
    let set = placement::fast_tier_set(plan, p, size);
    let dev = |d: &Path| std::fs::metadata(d).map(|m| m.dev()).ok();
    let same_device = dev(dir).is_some() && dev(dir) == dev(model_dir);
    let bandwidth = match measure {
        Some(bytes) => Some(probe_bandwidth(dir, bytes)?),
        None => None,
    };
    Ok(FastTier {
        dir: dir.to_path_buf(),
        size,
        set,
        bandwidth,
        same_device,
    })
}

/// Cold read bandwidth of `dir`'s storage: a file of `bytes` written and synced there,
/// read as the checkpoint is measured, then removed.
fn probe_bandwidth(dir: &Path, bytes: u64) -> Result<Bandwidth> {
    use std::io::Write;
    let path = dir.join(format!(".voom-plan-probe-{}", std::process::id()));
    let result = (|| -> Result<Bandwidth> {
        let mut f = std::fs::File::create(&path)
            .with_context(|| format!("writing a probe file in {}", dir.display()))?;
        // Bytes that do not compress (a file system may).
        let block = crate::synth::random_bytes(1 << 20, 7);
        let mut left = bytes.max(1 << 20);
        while left > 0 {
            let n = left.min(block.len() as u64) as usize;
            f.write_all(&block[..n])
                .with_context(|| format!("writing {}", path.display()))?;
            left -= n as u64;
        }
        f.sync_all()
            .with_context(|| format!("syncing {}", path.display()))?;
        drop(f);
        let files = [path.clone()];
        direct::read_bandwidth(&files, bytes, PROBE_CHUNK, ReadMode::Direct, PROBE_READERS)
            .or_else(|_| {
                direct::read_bandwidth(
                    &files,
                    bytes,
                    PROBE_CHUNK,
                    ReadMode::Buffered,
                    PROBE_READERS,
                )
            })
            .with_context(|| format!("reading {}", path.display()))
    })();
    let _ = std::fs::remove_file(&path);
    result
}

/// Bandwidths measured for a prediction.
struct Measured {
    direct: Option<Bandwidth>,
    direct_error: Option<String>,
    buffered: Bandwidth,
    /// Memory read bandwidth, bytes/s.
    memory: f64,
}

impl Measured {
    /// The faster of the two ways to read.
    fn best_storage(&self) -> Bandwidth {
        match self.direct {
            Some(d) if d.bytes_per_sec() >= self.buffered.bytes_per_sec() => d,
            _ => self.buffered,
        }
    }
}

/// Bytes of one read when measuring storage (the checkpoint's, a fast tier's).
const PROBE_CHUNK: usize = 8 << 20;
/// Reads in flight when measuring: devices reward it, and the engine's readers do it.
const PROBE_READERS: usize = 4;

fn measure(dir: &Path, bytes: u64, weight_bytes: u64, threads: usize) -> Result<Measured> {
    let files = checkpoint_files(dir)?;
    let (direct, direct_error) =
        match direct::read_bandwidth(&files, bytes, PROBE_CHUNK, ReadMode::Direct, PROBE_READERS) {
            Ok(b) => (Some(b), None),
            Err(e) => (None, Some(e.to_string())),
        };
    let buffered = direct::read_bandwidth(
        &files,
        bytes,
        PROBE_CHUNK,
        ReadMode::Buffered,
        PROBE_READERS,
    )
    .with_context(|| format!("reading the checkpoint in {}", dir.display()))?;
    let probe = (weight_bytes as usize).clamp(64 << 20, 1 << 30);
    let memory = membw::read_bandwidth(probe, threads.max(1), 2) * 1e9;
    Ok(Measured {
        direct,
        direct_error,
        buffered,
        memory,
    })
}

/// The bounds on decode speed: storage (bytes read per token from storage at the
/// faster way to read) and memory (every weight byte read once from memory).
fn predict(p: &Placement, m: &Measured, weight_bytes: u64) -> serde_json::Value {
    let storage = m.best_storage().bytes_per_sec();
    let storage_bound = (p.streamed_per_token > 0).then(|| storage / p.streamed_per_token as f64);
    let memory_bound = m.memory / weight_bytes.max(1) as f64;
    let tps = storage_bound.map_or(memory_bound, |s| s.min(memory_bound));
    json!({
        "tokens_per_sec": tps,
        "storage_bound_tokens_per_sec": storage_bound,
        "memory_bound_tokens_per_sec": memory_bound,
        "read_mode": m.best_storage().mode.name(),
    })
}

fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let ckpt = voom_formats::Checkpoint::open(dir)
        .with_context(|| format!("reading the checkpoint in {}", dir.display()))?;
    Ok(ckpt.files.iter().map(|f| f.path.clone()).collect())
}

/// One row per stage kind: the embedding, the decoder layers (together), the head.
fn stage_summary<'a>(
    stages: impl Iterator<Item = &'a Stage>,
    p: &Placement,
) -> Vec<serde_json::Value> {
    let all: Vec<&Stage> = stages.collect();
    let n = all.len();
    let groups: [(&str, &[&Stage]); 3] = [
        ("embedding", &all[..1]),
        ("layers", &all[1..n - 1]),
        ("head", &all[n - 1..]),
    ];
    groups
        .iter()
        .map(|(name, stages)| {
            let (mut bytes, mut pinned, mut streamed) = (0u64, 0u64, 0u64);
            for s in stages.iter() {
                for r in s.reads() {
                    bytes += r.bytes;
                    if p.is_pinned(r.page) {
                        pinned += r.bytes;
                    } else {
                        streamed += r.per_token;
                    }
                }
            }
            json!({
                "name": name,
                "stages": stages.len(),
                "bytes": bytes,
                "pinned_bytes": pinned,
                "streamed_per_token": streamed,
            })
        })
        .collect()
}
