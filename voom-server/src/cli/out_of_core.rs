//! `voom bench out-of-core`: decode (and prefill) of a model several times larger
//! than a real memory ceiling, against the storage bound measured in the same run,
//! beside the naive baseline (plain memory mapping, the OS page cache under the same
//! ceiling) measured the same way.
//!
//! Each configuration runs as a child `voom generate` inside a memory cgroup of the
//! budget (../BENCHMARKS.md), after the page cache is dropped. Bytes read from
//! storage come from the child's `/proc/self/io` (`read_bytes`: what the kernel read
//! from the device for it, page-cache hits excluded), peak memory from the cgroup
//! (private memory and page cache together). The storage bound is the cold read
//! bandwidth of the checkpoint's files, measured here (direct and buffered, the best
//! shape, the page cache dropped; then that shape over as many bytes as a token must
//! read, again just before and just after each run), divided by the bytes per token
//! that cannot be resident under the budget. The block device's own counters over
//! each run's decode ([`crate::blockdev`], read by the child) show what the device
//! did: its mean read request, the share of decode it was busy, and what it read
//! while busy, which tells a pipeline that leaves the device idle from a device that
//! is slow; decode against the bound at that rate is the pipeline's share of what
//! the device gave in the same seconds.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use libvoom::engine::{Engine, EngineOptions};
use libvoom::model::plan;
use libvoom::placement::human;
use serde_json::{json, Value};
use voom_formats::manifest::{Manifest, PageEntry, MANIFEST_FILE};
use voom_formats::Checkpoint;
use vpaged::direct::{self, ReadMode};
use vpaged::VerifyMode;

use crate::blockdev::Device;
use crate::cgroup::{self, Ceiling};
use crate::synth;

#[derive(Args, Debug)]
pub struct OutOfCoreArgs {
    /// The memory ceiling (`1GiB`).
    #[arg(long, value_parser = crate::profile::parse_size, default_value = "1GiB")]
    pub budget: u64,
    /// Size of the synthetic random-weights Llama in GB of BF16. Default: three times
    /// the budget, at least 4 GB.
    #[arg(long)]
    pub model_gb: Option<f64>,
    /// Measure this model directory instead of a synthetic one (it needs a page
    /// manifest for the page-cache configuration: `vpagectl hash DIR`).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A mixture of experts: a synthetic Qwen3-MoE (64 experts, 8 per token) of at
    /// least four times the budget instead of a Llama. Each run records its routing
    /// trace, which is replayed through expert caches (LRU, LFU with admission, the
    /// page cache's TinyLFU, a static set, the Belady bound) of the room the plan
    /// gives experts.
    #[arg(long)]
    pub moe: bool,
    /// A synthetic Qwen3-Next (a hybrid: Gated DeltaNet and gated attention layers
    /// 3:1, 64 experts of which 8 a token, a gated shared expert) instead of a Llama.
    #[arg(long, conflicts_with = "moe")]
    pub hybrid: bool,
    /// A synthetic DeepSeek-V3 as released in FP8 (MLA, 256 experts of which 8 a
    /// token, a shared expert, dense first layers; `voom bench
    /// --synthetic-deepseek-gb`) of at least four times the budget (`--model-gb`),
    /// and at least one layer of experts (11.5 GB) with a dense layer: 12.1 GB.
    #[arg(long, conflicts_with_all = ["moe", "hybrid"])]
    pub deepseek_fp8: bool,
    /// Tokens decoded per run.
    #[arg(long, default_value_t = 8)]
    pub decode_tokens: usize,
    /// Prompt tokens prefilled per run.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Compute threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Configurations to run, comma-separated: `mmap` (the embedded memory-mapped
    /// store, the naive baseline: `--memory-mapped`), `cache` (`--memory-budget` of
    /// the ceiling: the page cache the memory planner sizes and fills) and `vpack`
    /// (the same, reading the pages' vpack
    /// bodies: a packed copy of the model beside it, its files hard links of the
    /// model's, packed once and reused).
    #[arg(long, value_delimiter = ',', default_value = "mmap,cache,vpack")]
    pub configs: Vec<String>,
    /// Rounds: every configuration runs once per round, in turn, each run after a
    /// fresh measurement of the storage's bandwidth (this benchmark's disk may change
    /// speed from one minute to the next), and the report gives medians.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// The `voom` binary the runs use (default: this one).
    #[arg(long)]
    pub voom: Option<PathBuf>,
    /// Print one JSON object with every figure.
    #[arg(long)]
    pub json: bool,
}

/// Prefill tokens per pass (the engine's default chunk).
const PREFILL_CHUNK: usize = 256;
/// Memory assumed for the child process itself (code, tokenizer, heap), for the
/// bytes per token that cannot be resident (the child plans with its own measure).
const PROCESS_BYTES: u64 = 96 << 20;

pub fn run(a: OutOfCoreArgs) -> Result<()> {
    if a.decode_tokens < 2 || a.prompt_tokens == 0 {
        bail!("--decode-tokens must be at least 2 and --prompt-tokens positive");
    }
    let dir = match &a.model {
        Some(d) => d.clone(),
        None if a.hybrid => {
            synth::bench_hybrid_model(a.model_gb.unwrap_or((4.0 * a.budget as f64 / 1e9).max(4.0)))?
        }
        None if a.deepseek_fp8 => synth::bench_deepseek_fp8_model(
            a.model_gb.unwrap_or((4.0 * a.budget as f64 / 1e9).max(4.0)),
        )?,
        None if a.moe => {
            synth::bench_moe_model(a.model_gb.unwrap_or((4.0 * a.budget as f64 / 1e9).max(4.0)))?
        }
        None => synth::bench_model(a.model_gb.unwrap_or((3.0 * a.budget as f64 / 1e9).max(4.0)))?,
    };
    let ckpt = Checkpoint::open(&dir).with_context(|| format!("opening {}", dir.display()))?;
    let files: Vec<PathBuf> = ckpt.files.iter().map(|f| f.path.clone()).collect();
    let model_bytes = ckpt.total_bytes();
    drop(ckpt);

    // What cannot be resident: the weights a token reads less what the budget holds
    // once KV, scratch and the process are set aside.
    let engine = Engine::open(
        &dir,
        EngineOptions {
            verify: VerifyMode::Off,
            ..Default::default()
        },
    )?;
    let m = engine.model();
    let context = a.prompt_tokens + a.decode_tokens;
    let kv = m.kv_bytes_per_position() * context as u64 + m.state_bytes();
    let scratch = m.scratch_bytes(a.prompt_tokens, PREFILL_CHUNK, context);
    let weights = m.plan().weight_bytes_per_token();
    let vocab = engine.config().vocab_size as u32;
    let room = a.budget.saturating_sub(kv + scratch + PROCESS_BYTES);
    // A mixture of experts: a byte of an expert kept resident saves top_k/experts of
    // a byte per token, so what cannot be resident is what the memory planner
    // streams (it pins by bytes saved per token), with the routed experts' share of
    // it, and the bytes of experts it pins (the static cache the runs have).
    let moe = m.config().moe.is_some().then(|| {
        let needs = libvoom::placement::Needs {
            kv_bytes: kv,
            scratch_bytes: scratch,
            process_bytes: PROCESS_BYTES,
            io_bytes: 0,
        };
        let plan = m.plan().whole_pages();
        libvoom::placement::place(&plan, &needs, a.budget).map(|p| MoePlan::of(&plan, &p))
    });
    drop(engine);
    let moe = moe
        .transpose()
        .context("planning the mixture of experts under the budget")?;
    let non_resident = match &moe {
        Some(m) => m.streamed_per_token,
        None => weights.saturating_sub(room),
    };

    let dropped = cgroup::drop_page_cache();
    // The storage's best: cold reads of 1 and 8 MiB with 1 to 16 in flight, direct
    // and buffered (devices differ in what they reward; kernel readahead can beat
    // direct reads), each buffered measurement from a dropped page cache. Each reads
    // as many bytes as a token must (at least a GiB, at most the checkpoint), as a
    // pass reads them, and so do the probes around each run: the first GiB alone is
    // the part every measurement reads, and on this virtual disk it read faster than
    // the rest (1.52 against 1.38 GB/s, eight alternating reads of 1 GiB at offsets 0
    // and 2.7 GB), and buffered reads that won over one GiB read 1.0 GB/s over 2.7
    // GB where direct reads gave 2 GB/s.
    let probe_bytes = non_resident.max(1 << 30).min(model_bytes);
    let mut bw: Option<direct::Bandwidth> = None;
    for mode in [ReadMode::Direct, ReadMode::Buffered] {
        for readers in [1, 4, 8, 16] {
            for chunk in [1 << 20, 8 << 20] {
                let Ok(b) = direct::read_bandwidth(&files, probe_bytes, chunk, mode, readers)
                else {
                    continue;
                };
                if bw.is_none_or(|x| b.bytes_per_sec() > x.bytes_per_sec()) {
                    bw = Some(b);
                }
            }
        }
    }
    let bw = bw.context("measuring the checkpoint's cold read bandwidth: no read succeeded")?;
    let storage_bps = bw.bytes_per_sec();
    let bound = if non_resident == 0 {
        None
    } else {
        Some(storage_bps / non_resident as f64)
    };

    let ceiling = Ceiling::create(a.budget);
    // The device under the checkpoint, whose counters are read around each run.
    let device = files.first().and_then(|f| Device::of(f));
    let voom = match &a.voom {
        Some(v) => v.clone(),
        None => std::env::current_exe().context("finding the voom binary")?,
    };
    // A fixed prompt of ids spread over the vocabulary.
    let prompt: Vec<String> = (0..a.prompt_tokens as u32)
        .map(|i| ((i * 7919 + 13) % vocab.max(1)).to_string())
        .collect();
    let io = vpaged::store::IoConfig::default();
    // The packed copy, and the bytes per token its bodies leave on storage.
    let packed = if a.configs.iter().any(|c| c == "vpack") {
        ensure_manifest(&dir)?;
        Some(packed_copy(&dir)?)
    } else {
        None
    };
    let pack_ratio = packed.as_ref().map(Packed::ratio);
    // What the CPUs allow packed pages: every core decoding (and nothing else), the
    // bytes per token that cannot be resident.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let decode_rate = packed.as_ref().map(decode_rate).transpose()?;
    let decode_bound = decode_rate
        .filter(|_| non_resident > 0)
        .map(|r| r * cores as f64 / non_resident as f64);
    let packed_bound = pack_ratio
        .zip(bound)
        .map(|(r, b)| b / r.max(f64::MIN_POSITIVE));
    // What the CPUs allow: the same decode with the whole model in memory (no
    // ceiling), where the machine has room for it twice: every file read through the
    // OS page cache, then the decode. Reads that overlapped compute perfectly could
    // reach at most the lower of this and the storage bound. Measured around each run
    // as the storage is: this virtual machine's cores computed the same decode at 16
    // and at 29 tok/s minutes apart. (Warmed by a two-token run instead, a mixture of
    // experts still read every expert those tokens had not routed, and the figure was
    // half the rate the machine computed at.)
    let compute_now = || -> Option<f64> {
        if crate::memory::available().bytes <= 2 * model_bytes {
            return None;
        }
        cgroup::warm_page_cache(&files);
        let mut args = generate_args(&dir, &prompt, a.decode_tokens, a.threads, context);
        args.push("--memory-mapped".into());
        let o = std::process::Command::new(&voom)
            .args(&args)
            .output()
            .ok()?;
        let line = String::from_utf8_lossy(&o.stdout)
            .lines()
            .last()?
            .to_string();
        let v: Value = serde_json::from_str(&line).ok()?;
        v["timing"]["decode_tokens_per_sec"].as_f64()
    };
    let mut results = Vec::new();
    let runs: Vec<(usize, &String)> = (0..a.repeat.max(1))
        .flat_map(|round| a.configs.iter().map(move |c| (round, c)))
        .collect();
    for (round, cfg) in runs {
        // The bandwidth just before this run, in the best shape found above.
        let _ = cgroup::drop_page_cache();
        let near = direct::read_bandwidth(&files, probe_bytes, bw.chunk, bw.mode, bw.readers)
            .map(|b| b.bytes_per_sec())
            .unwrap_or(storage_bps);
        // And what the cores compute at, just before (the OS page cache is dropped
        // again below).
        let compute_before = compute_now();
        // Bytes per token a configuration must read: the packed bodies' for vpack.
        let scale = if cfg == "vpack" {
            pack_ratio.unwrap_or(1.0)
        } else {
            1.0
        };
        let near_bound = (non_resident > 0).then(|| near / (non_resident as f64 * scale));
        // The page cache runs as a user would run it: with the ceiling as its memory
        // budget, which it plans itself (cli::budget).
        let budget = vec!["--memory-budget".to_string(), a.budget.to_string()];
        let (model_dir, extra): (&Path, Vec<String>) = match cfg.as_str() {
            "mmap" => (&dir, vec!["--memory-mapped".into()]),
            "cache" => {
                ensure_manifest(&dir)?;
                (&dir, budget)
            }
            "vpack" => (&packed.as_ref().expect("packed above").dir, budget),
            other => bail!("unknown configuration '{other}' (mmap, cache, vpack)"),
        };
        let mut args = generate_args(model_dir, &prompt, a.decode_tokens, a.threads, context);
        args.extend(extra);
        // A mixture of experts' run records its routing trace.
        let trace_path = moe.as_ref().map(|_| {
            std::env::temp_dir().join(format!(
                "voom-bench-{}-{cfg}-{round}.trace",
                std::process::id()
            ))
        });
        if let Some(t) = &trace_path {
            args.push("--expert-trace".into());
            args.push(t.display().to_string());
        }
        for f in &files {
            if let Ok(d) = direct::DirectFile::open(f, ReadMode::Buffered) {
                d.drop_cached();
            }
        }
        let _ = cgroup::drop_page_cache();
        let dev_before = device.as_ref().and_then(|d| d.read());
        let t0 = Instant::now();
        let (out, peak, oom) = match &ceiling {
            Ok(c) => {
                c.reset_peak();
                let before = c.oom_kills();
                let o = c.command(&voom, &args).output()?;
                (o, c.peak(), c.oom_kills() - before)
            }
            Err(_) => (
                std::process::Command::new(&voom).args(&args).output()?,
                None,
                0,
            ),
        };
        let wall = t0.elapsed().as_secs_f64();
        let dev = device
            .as_ref()
            .and_then(|d| d.read())
            .zip(dev_before)
            .map(|(after, before)| after.since(&before));
        // And just after it: the device's bandwidth drifts over minutes on shared
        // storage (measured here: the same reads at 1.0 and 3.0 GB/s within half an hour),
        // so the run is held to the mean of the bandwidths around it.
        let _ = cgroup::drop_page_cache();
        let after = direct::read_bandwidth(&files, probe_bytes, bw.chunk, bw.mode, bw.readers)
            .map(|b| b.bytes_per_sec())
            .ok();
        let around = after.map_or(near, |after| (near + after) / 2.0);
        let compute_after = compute_now();
        let compute_around = match (compute_before, compute_after) {
            (Some(b), Some(a)) => Some((b + a) / 2.0),
            (b, a) => b.or(a),
        };
        let overlap_bound = |storage: Option<f64>| match (storage, compute_around) {
            (Some(s), Some(c)) => Some(s.min(c)),
            (s, c) => s.or(c),
        };
        let around_bound = (non_resident > 0).then(|| around / (non_resident as f64 * scale));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout.lines().last().unwrap_or("");
        let r: Value = match serde_json::from_str(line) {
            Ok(v) if out.status.success() => v,
            _ => {
                let err = String::from_utf8_lossy(&out.stderr);
                results.push(json!({
                    "config": cfg, "round": round, "ok": false, "status": out.status.to_string(),
                    "oom_kills": oom, "error": err.lines().last().unwrap_or(""),
                }));
                continue;
            }
        };
        let passes = a.prompt_tokens.div_ceil(PREFILL_CHUNK) + a.decode_tokens - 1;
        let read = r["storage_read_bytes"].as_u64();
        let decode_tps = r["timing"]["decode_tokens_per_sec"].as_f64().unwrap_or(0.0);
        let mut experts = match (&trace_path, &moe) {
            (Some(t), Some(m)) => {
                let read = vpaged::expert_trace::Trace::read_file(t);
                let _ = std::fs::remove_file(t);
                let trace = read
                    .with_context(|| format!("reading the run's routing trace {}", t.display()))?;
                trace_report(&trace, m)
            }
            _ => Value::Null,
        };
        // A mixture of experts: what a token cannot keep resident is the trunk the plan
        // streams and the routed experts the page cache's admission (frequency-aware,
        // as the LFU-admit replay) misses in the room left for them, as the run's own
        // routing trace replays them. The bound for those bytes, around the run and
        // at the device's rate, and what the device read against them.
        if let (Some(m), Some(missed)) = (
            &moe,
            experts["replay_bytes_per_token"]["lfu-admit"].as_f64(),
        ) {
            let must = m.streamed_per_token.saturating_sub(m.routed_per_token) as f64 + missed;
            experts["non_resident_bytes_per_token"] = json!(must);
            experts["ratio_to_storage_bound_around"] = json!(decode_tps * must / around.max(1.0));
            let io_bound = around / (must * scale).max(1.0);
            experts["ratio_to_overlap_bound_around"] =
                json!(overlap_bound(Some(io_bound)).map(|b| decode_tps / b));
            experts["storage_bytes_per_sec_around"] = json!(around);
        }
        let decode_device = decode_activity(
            &r,
            a.decode_tokens - 1,
            (non_resident as f64 * scale) as u64,
        );
        // What the page cache loaded over decode: the routed bytes (and any trunk the
        // plan streams) that were not resident when a pass asked for them, the bytes
        // the bound is taken on; what the device read against them (above 1:
        // read amplification; vpack reads bodies smaller than the pages they decode
        // to), and decode against the storage bound for them around the run.
        if let (true, Some(loaded)) = (
            experts.is_object(),
            r["decode_page_cache"]["bytes_loaded"].as_f64(),
        ) {
            let per_token = loaded / (a.decode_tokens - 1).max(1) as f64;
            experts["loaded_bytes_per_token"] = json!(per_token);
            experts["device_read_over_loaded"] = json!(decode_device["bytes_per_pass"]
                .as_f64()
                .map(|read| read / per_token.max(1.0)));
            experts["ratio_to_storage_bound_of_loaded_around"] =
                json!(decode_tps * per_token * scale / around.max(1.0));
        }
        // Peak memory against what the plan set aside: the process, KV, scratch and
        // read buffers, and the page cache (one batch of experts streams through it).
        let plan_needs = &r["memory_budget"]["needs"];
        let base: Option<u64> = ["kv", "scratch", "process", "read_buffers"]
            .iter()
            .map(|k| plan_needs[*k].as_u64())
            .sum();
        let memory = match (base, r["memory_budget"]["cache_bytes"].as_u64()) {
            (Some(base), Some(cache)) => json!({
                "base_bytes": base,
                "cache_bytes": cache,
                "expert_batch_bytes": moe.as_ref().map(|m| m.expert_batch_bytes),
                "planned_bytes": base + cache,
                "peak_bytes": peak,
            }),
            _ => Value::Null,
        };
        results.push(json!({
            "config": cfg,
            "round": round,
            "ok": true,
            "storage_bytes_per_sec_before": near,
            "ratio_to_storage_bound_before": near_bound.map(|b| decode_tps / b),
            "storage_bytes_per_sec_after": after,
            "ratio_to_storage_bound_around": around_bound.map(|b| decode_tps / b),
            "compute_bound_around": compute_around,
            "ratio_to_overlap_bound_around": overlap_bound(around_bound).map(|b| decode_tps / b),
            "page_source": r["page_source"],
            "memory_plan": r["memory_budget"],
            "decode_tokens_per_sec": decode_tps,
            "ids": r["ids"],
            "prefill_tokens_per_sec": r["timing"]["prefill_tokens_per_sec"],
            "decode_page_wait_share": r["timing"]["decode_page_wait_secs"].as_f64()
                .zip(r["timing"]["decode_secs"].as_f64())
                .map(|(w, t)| w / t.max(1e-9)),
            "page_cache": r["page_cache"],
            "storage_read_bytes": read,
            "read_bytes_per_pass": read.map(|b| b / passes as u64),
            "passes": passes,
            "peak_bytes": peak,
            "peak_rss_bytes": r["peak_rss_bytes"],
            "memory": memory,
            "oom_kills": oom,
            "ratio_to_storage_bound": bound.map(|b| decode_tps / (b / scale)),
            "wall_secs": wall,
            "experts": moe_against_device(experts, &decode_device, decode_tps),
            "decode_device": decode_device,
            "device": dev.map(|d| json!({
                "bytes_read": d.bytes,
                "read_requests": d.reads,
                "mean_request_bytes": d.mean_request_bytes(),
                "busy_secs": d.busy.as_secs_f64(),
                "busy_share": d.busy.as_secs_f64() / wall.max(1e-9),
                "bytes_per_sec_while_busy": d.busy_bytes_per_sec(),
            })),
        }));
    }
    // Paging never changes arithmetic: every run's ids are the first run's, whatever
    // its page source and ceiling (and the unconstrained run's, where one ran).
    let ids_check = same_ids(&results);
    // Per round, then the median over rounds.
    let rate = |name: &str, round: usize| {
        results
            .iter()
            .find(|r| r["config"] == name && r["round"] == round && r["ok"] == true)
            .and_then(|r| r["decode_tokens_per_sec"].as_f64())
    };
    let vs_mmap = |name: &str| {
        median(
            (0..a.repeat.max(1))
                .filter_map(|k| match (rate(name, k), rate("mmap", k)) {
                    (Some(c), Some(m)) if m > 0.0 => Some(c / m),
                    _ => None,
                })
                .collect(),
        )
    };
    // The same at the device's own rate: each run's decode against the bound at
    // what the device gave it (so a disk that drifts between runs moves neither),
    // as tokens/s at one common rate (vpack's bound counts its bodies' bytes).
    let at_device_rate = |name: &str, round: usize| {
        let r = results
            .iter()
            .find(|r| r["config"] == name && r["round"] == round && r["ok"] == true)?;
        let ratio = r["decode_device"]["ratio_to_device_rate_bound"].as_f64()?;
        let bytes = if name == "vpack" {
            pack_ratio.unwrap_or(1.0)
        } else {
            1.0
        };
        Some(ratio / bytes)
    };
    let vs_mmap_at_device_rate = |name: &str| {
        median(
            (0..a.repeat.max(1))
                .filter_map(
                    |k| match (at_device_rate(name, k), at_device_rate("mmap", k)) {
                        (Some(c), Some(m)) if m > 0.0 => Some(c / m),
                        _ => None,
                    },
                )
                .collect(),
        )
    };
    let medians: serde_json::Map<String, Value> = a
        .configs
        .iter()
        .map(|c| {
            let of = |key: &str| {
                median(
                    results
                        .iter()
                        .filter(|r| r["config"] == *c && r["ok"] == true)
                        .filter_map(|r| r[key].as_f64())
                        .collect(),
                )
            };
            (
                c.clone(),
                json!({
                    "decode_tokens_per_sec": of("decode_tokens_per_sec"),
                    "ratio_to_storage_bound_before": of("ratio_to_storage_bound_before"),
                    "ratio_to_storage_bound_around": of("ratio_to_storage_bound_around"),
                    "ratio_to_device_rate_bound": median(
                        results
                            .iter()
                            .filter(|r| r["config"] == *c && r["ok"] == true)
                            .filter_map(|r| r["decode_device"]["ratio_to_device_rate_bound"].as_f64())
                            .collect(),
                    ),
                }),
            )
        })
        .collect();
    let ceiling_desc = match &ceiling {
        Ok(c) => json!({"kind": format!("memory cgroup {:?}", c.version()), "limit": c.limit()}),
        Err(why) => json!({"kind": "none: the engines' own budget only", "why": why}),
    };
    let report = json!({
        "model": dir.display().to_string(),
        "model_bytes": model_bytes,
        "budget": a.budget,
        "ceiling": ceiling_desc,
        "page_cache_dropped": dropped.is_ok(),
        "weight_bytes_per_token": weights,
        "moe": moe.as_ref().map(|m| json!({
            "routed_bytes_per_token": m.routed_per_token,
            "expert_cache_bytes": m.expert_cache_bytes,
        })),
        "non_resident_bytes_per_token": non_resident,
        "needs": {"kv": kv, "scratch": scratch, "process_assumed": PROCESS_BYTES,
                  "read_buffers": io.buffer_bytes(None)},
        "storage": {"mode": bw.mode.name(), "bytes_per_sec": storage_bps, "bytes_read": bw.bytes, "readers": bw.readers, "chunk": bw.chunk},
        "storage_bound_tokens_per_sec": bound,
        // The median of the compute bounds measured around the runs.
        "compute_bound_tokens_per_sec": median(
            results
                .iter()
                .filter_map(|r| r["compute_bound_around"].as_f64())
                .collect()
        ),
        "device": device.as_ref().map(|d| d.name().to_string()),
        "vpack": packed.as_ref().map(|p| json!({
            "dir": p.dir.display().to_string(),
            "packed_over_raw": p.ratio(),
            "read_buffers": io.buffer_bytes(Some(&p.manifest)),
            "storage_bound_tokens_per_sec": packed_bound,
            "decode_bytes_per_sec_per_core": decode_rate,
            "cores": cores,
            "decode_bound_tokens_per_sec": decode_bound,
        })),
        "runs": results,
        "same_ids_in_every_run": ids_check.as_ref().ok(),
        "rounds": a.repeat.max(1),
        "medians": medians,
        "cache_vs_mmap": vs_mmap("cache"),
        "vpack_vs_mmap": vs_mmap("vpack"),
        "cache_vs_mmap_at_device_rate": vs_mmap_at_device_rate("cache"),
        "vpack_vs_mmap_at_device_rate": vs_mmap_at_device_rate("vpack"),
    });
    if a.json {
        vpaged::outln!("{report}")?;
    } else {
        print_report(&report)?;
    }
    // The figures are out; a run whose ids differ fails the bench.
    ids_check.map(|_| ())
}

/// How many runs gave ids, all of them the same; an error naming the first run whose
/// ids differ from the first run's (a paging bug, never a tolerance).
fn same_ids(results: &[Value]) -> Result<usize> {
    let runs: Vec<&Value> = results
        .iter()
        .filter(|r| r["ok"] == true && r["ids"].is_array())
        .collect();
    if let Some(first) = runs.first() {
        for r in &runs[1..] {
            if r["ids"] != first["ids"] {
                bail!(
                    "the {} run of round {} gave other ids than the {} run of round {}: {} against {}",
                    r["config"], r["round"], first["config"], first["round"], r["ids"], first["ids"]
                );
            }
        }
    }
    Ok(runs.len())
}

/// `voom generate` of `prompt` (ids) on `model`, decoding `tokens` past any eos with
/// `threads` compute threads and a context of `context`, its report as JSON.
fn generate_args(
    model: &Path,
    prompt: &[String],
    tokens: usize,
    threads: usize,
    context: usize,
) -> Vec<String> {
    vec![
        "generate".into(),
        "--model".into(),
        model.display().to_string(),
        "--prompt-ids".into(),
        prompt.join(","),
        "--max-new-tokens".into(),
        tokens.to_string(),
        "--ignore-eos".into(),
        "--json".into(),
        "--threads".into(),
        threads.to_string(),
        "--max-context".into(),
        context.to_string(),
    ]
}

/// How the memory planner places a mixture of experts under the budget: what it
/// streams per token (every routed expert counted: it pins none), the routed experts'
/// share of a token's reads, and the room it leaves the page cache to keep the
/// experts its admission picks.
struct MoePlan {
    streamed_per_token: u64,
    routed_per_token: u64,
    expert_cache_bytes: u64,
    /// Slot bytes of one position's experts in the layer where they are largest:
    /// what the page cache streams through at once beside the layer.
    expert_batch_bytes: u64,
}

impl MoePlan {
    fn of(plan: &plan::PagePlan, p: &libvoom::placement::Placement) -> MoePlan {
        let routed_per_token = plan
            .layers
            .iter()
            .flat_map(|l| {
                l.reads()
                    .iter()
                    .filter(|r| l.experts().iter().flatten().any(|x| *x == r.page))
            })
            .map(|r| r.per_token)
            .sum();
        MoePlan {
            streamed_per_token: p.streamed_per_token,
            routed_per_token,
            expert_cache_bytes: p.expert_cache_bytes,
            expert_batch_bytes: plan
                .layers
                .iter()
                .map(|l| l.expert_batch_slot_bytes())
                .max()
                .unwrap_or(0),
        }
    }
}

/// A mixture of experts' run against the bytes its tokens could not keep resident
/// (`experts["non_resident_bytes_per_token"]`), with the device's counters over
/// decode: the bound at the device's rate, and the device's bytes per token over them.
fn moe_against_device(mut experts: Value, device: &Value, decode_tps: f64) -> Value {
    let must = experts["non_resident_bytes_per_token"].as_f64();
    if let (Some(must), Some(rate), Some(read)) = (
        must,
        device["bytes_per_sec_while_busy"].as_f64(),
        device["bytes_per_pass"].as_f64(),
    ) {
        experts["ratio_to_device_rate_bound"] = json!(decode_tps * must / rate.max(1.0));
        experts["device_read_over_non_resident"] = json!(read / must.max(1.0));
    }
    experts
}

/// A run's routing trace: the experts its decode passes read (every pass after the
/// prompt's) per token, and the same passes replayed through expert caches of the
/// room the plan leaves experts under each policy (fitted on the prompt's pass).
fn trace_report(trace: &vpaged::expert_trace::Trace, moe: &MoePlan) -> Value {
    use vpaged::expert_plan::{replay, Policy};
    let (mut tokens, mut routed) = (0u64, 0u64);
    for p in trace.passes.iter().skip(1) {
        tokens += u64::from(p.positions);
        for (slot, list) in p.experts.iter().enumerate() {
            routed += list.len() as u64 * trace.header.expert_bytes[slot];
        }
    }
    json!({
        "decode_tokens": tokens,
        "routed_bytes_per_token": routed as f64 / tokens.max(1) as f64,
        "replay_cache_bytes": moe.expert_cache_bytes,
        "replay_bytes_per_token": Policy::ALL
            .iter()
            .map(|&p| {
                let s = replay(trace, p, moe.expert_cache_bytes, 1);
                (p.name().to_string(), json!(s.bytes_per_token()))
            })
            .collect::<serde_json::Map<_, _>>(),
    })
}

/// What the block device did over a child's decode (its `decode_device`: from the
/// first id sampled to the last, over `passes` forward passes), held to the bytes a
/// pass must read (`must_read`): bytes per pass, mean request, the share of decode it
/// was busy, what it read while busy, and decode's ratio to the bound at that rate
/// (the device's own bandwidth in the same seconds, so the disk drifting between the
/// probes and the run moves neither side). `Null` where the child could not read it.
fn decode_activity(r: &Value, passes: usize, must_read: u64) -> Value {
    let d = &r["decode_device"];
    let (Some(bytes), Some(reads), Some(busy), Some(secs)) = (
        d["bytes_read"].as_u64(),
        d["read_requests"].as_u64(),
        d["busy_secs"].as_f64(),
        r["timing"]["decode_secs"].as_f64(),
    ) else {
        return Value::Null;
    };
    let rate = (busy > 0.0).then(|| bytes as f64 / busy);
    let tps = passes as f64 / secs.max(1e-9);
    json!({
        "bytes_read": bytes,
        "bytes_per_pass": bytes / passes.max(1) as u64,
        "read_requests": reads,
        "mean_request_bytes": bytes.checked_div(reads).unwrap_or(0),
        "busy_share": busy / secs.max(1e-9),
        "bytes_per_sec_while_busy": rate,
        "ratio_to_device_rate_bound": rate
            .filter(|_| must_read > 0)
            .map(|rate| tps * must_read as f64 / rate),
    })
}

fn print_report(r: &Value) -> Result<()> {
    let b = |k: &Value| human(k.as_u64().unwrap_or(0));
    vpaged::outln!(
        "model {} ({}), budget {} under {}",
        r["model"].as_str().unwrap_or(""),
        b(&r["model_bytes"]),
        b(&r["budget"]),
        r["ceiling"]["kind"].as_str().unwrap_or("")
    )?;
    if let Some(why) = r["ceiling"]["why"].as_str() {
        vpaged::outln!("  (no memory cgroup: {why})")?;
    }
    vpaged::outln!(
        "  weights per token {}, of which cannot be resident {}; storage {:.2} GB/s cold ({}, {} reads of {} in flight)",
        b(&r["weight_bytes_per_token"]),
        b(&r["non_resident_bytes_per_token"]),
        r["storage"]["bytes_per_sec"].as_f64().unwrap_or(0.0) / 1e9,
        r["storage"]["mode"].as_str().unwrap_or(""),
        r["storage"]["readers"],
        b(&r["storage"]["chunk"])
    )?;
    vpaged::outln!(
        "  storage bound: {} tok/s",
        r["storage_bound_tokens_per_sec"]
            .as_f64()
            .map_or("none (fits)".into(), |v| format!("{v:.3}"))
    )?;
    if let Some(c) = r["compute_bound_tokens_per_sec"].as_f64() {
        vpaged::outln!(
            "  compute bound: {c:.3} tok/s (the same decode from memory, no ceiling; the median of \
             its measures just before and just after each run): reads that overlapped compute \
             perfectly reach at most the lower of the two"
        )?;
    }
    if let Some(v) = r["vpack"].as_object() {
        vpaged::outln!(
            "  vpack bodies {:.4} of the raw bytes; their storage bound: {} tok/s",
            v["packed_over_raw"].as_f64().unwrap_or(0.0),
            v["storage_bound_tokens_per_sec"]
                .as_f64()
                .map_or("none (fits)".into(), |v| format!("{v:.3}"))
        )?;
        vpaged::outln!(
            "  decoding them: {:.2} GB/s of pages per core, so {} cores bound it at {} tok/s",
            v["decode_bytes_per_sec_per_core"].as_f64().unwrap_or(0.0) / 1e9,
            v["cores"],
            v["decode_bound_tokens_per_sec"]
                .as_f64()
                .map_or("none (fits)".into(), |v| format!("{v:.3}"))
        )?;
    }
    vpaged::outln!(
        "  {:<6} {:>5} {:>10} {:>10} {:>12} {:>12} {:>8} {:>10} {:>6} {:>10} {:>9}",
        "config",
        "round",
        "decode t/s",
        "of bound*",
        "read/pass",
        "peak mem",
        "oom",
        "dev req**",
        "busy",
        "GB/s busy",
        "of dev***"
    )?;
    for run in r["runs"].as_array().into_iter().flatten() {
        if run["ok"] != true {
            vpaged::outln!(
                "  {:<6} failed ({}; {} killed for memory): {}",
                run["config"].as_str().unwrap_or(""),
                run["status"].as_str().unwrap_or(""),
                run["oom_kills"].as_u64().unwrap_or(0),
                run["error"].as_str().unwrap_or("")
            )?;
            continue;
        }
        // The device over decode where the child read it, else over the whole run.
        let dev = if run["decode_device"].is_object() {
            &run["decode_device"]
        } else {
            &run["device"]
        };
        vpaged::outln!(
            "  {:<6} {:>5} {:>10.3} {:>10} {:>12} {:>12} {:>8} {:>10} {:>6} {:>10} {:>9}",
            run["config"].as_str().unwrap_or(""),
            run["round"],
            run["decode_tokens_per_sec"].as_f64().unwrap_or(0.0),
            run["ratio_to_storage_bound_around"]
                .as_f64()
                .map_or("-".into(), |v| format!("{v:.2}")),
            b(&run["read_bytes_per_pass"]),
            run["peak_bytes"].as_u64().map_or("-".into(), human),
            run["oom_kills"].as_u64().unwrap_or(0),
            dev["mean_request_bytes"].as_u64().map_or("-".into(), human),
            dev["busy_share"]
                .as_f64()
                .map_or("-".into(), |v| format!("{:.0}%", 100.0 * v)),
            dev["bytes_per_sec_while_busy"]
                .as_f64()
                .map_or("-".into(), |v| format!("{:.2}", v / 1e9)),
            dev["ratio_to_device_rate_bound"]
                .as_f64()
                .map_or("-".into(), |v| format!("{v:.2}"))
        )?;
    }
    vpaged::outln!(
        "  * of the bound from the mean of the bandwidths measured just before and just \
         after the run (vpack: of its bodies' bytes)"
    )?;
    vpaged::outln!(
        "  ** the device's counters ({}) over decode (from the first id sampled to the \
         last; over the whole run where the child could not read them): mean read \
         request, share of the time it had a request in flight, and what it read while \
         it did (other processes' I/O on it included)",
        r["device"].as_str().unwrap_or("none found")
    )?;
    vpaged::outln!(
        "  *** of the bound at the device's own rate while busy in decode: the bytes a \
         token cannot keep resident over what it read while busy, against decode's \
         time per token (busy share times bytes needed over bytes read)"
    )?;
    if let Some(m) = r["moe"].as_object() {
        vpaged::outln!(
            "  mixture of experts: {} of routed experts per token; the plan leaves {} to the \
             page cache for the experts its admission keeps, and streams at most {} per token",
            b(&m["routed_bytes_per_token"]),
            b(&m["expert_cache_bytes"]),
            b(&r["non_resident_bytes_per_token"])
        )?;
        for run in r["runs"].as_array().into_iter().flatten() {
            let x = &run["experts"];
            if !x.is_object() {
                continue;
            }
            let f = |v: &Value| human(v.as_f64().unwrap_or(0.0) as u64);
            let replays = x["replay_bytes_per_token"]
                .as_object()
                .map(|o| {
                    o.iter()
                        .map(|(k, v)| format!("{k} {}", f(v)))
                        .collect::<Vec<_>>()
                        .join(", ")
                })
                .unwrap_or_default();
            let ratio = |k: &str| x[k].as_f64().map_or("-".into(), |v| format!("{v:.2}"));
            vpaged::outln!(
                "  {:<6} {:>5}: device read {} per decode token, {} of what it could not keep \
                 resident ({}: the trunk streamed and the experts the LFU-admit replay \
                 misses); {} of that bound around the run ({} of the lower of it and the \
                 compute bound, {} tok/s around the run), {} at the device's rate; experts routed {} per token; the page cache's hit ratio {:.1}%; the trace replayed \
                 through {} of experts: {}",
                run["config"].as_str().unwrap_or(""),
                run["round"],
                b(&run["decode_device"]["bytes_per_pass"]),
                ratio("device_read_over_non_resident"),
                f(&x["non_resident_bytes_per_token"]),
                ratio("ratio_to_storage_bound_around"),
                ratio("ratio_to_overlap_bound_around"),
                run["compute_bound_around"]
                    .as_f64()
                    .map_or("-".into(), |c| format!("{c:.1}")),
                ratio("ratio_to_device_rate_bound"),
                f(&x["routed_bytes_per_token"]),
                100.0 * run["page_cache"]["hit_ratio"].as_f64().unwrap_or(0.0),
                b(&x["replay_cache_bytes"]),
                replays
            )?;
            if x["loaded_bytes_per_token"].is_number() {
                vpaged::outln!(
                    "  {:<6} {:>5}: the page cache loaded {} per decode token (the routed experts \
                     it did not hold when asked, and the trunk streamed): the device read {} of \
                     that; decode at {} of the storage bound for it around the run",
                    run["config"].as_str().unwrap_or(""),
                    run["round"],
                    f(&x["loaded_bytes_per_token"]),
                    ratio("device_read_over_loaded"),
                    ratio("ratio_to_storage_bound_of_loaded_around"),
                )?;
            }
            let mem = &run["memory"];
            if mem.is_object() {
                vpaged::outln!(
                    "  {:<6} {:>5}: peak memory {} against the plan's {}: base {} (process, KV, \
                     scratch, read buffers) + page cache {} (one batch of experts, {}, streams \
                     through it)",
                    run["config"].as_str().unwrap_or(""),
                    run["round"],
                    b(&mem["peak_bytes"]),
                    b(&mem["planned_bytes"]),
                    b(&mem["base_bytes"]),
                    b(&mem["cache_bytes"]),
                    b(&mem["expert_batch_bytes"])
                )?;
            }
        }
    }
    if let Some(m) = r["medians"].as_object() {
        for (c, v) in m {
            let x = |k: &str, p: usize| v[k].as_f64().map_or("-".into(), |x| format!("{x:.p$}"));
            vpaged::outln!(
                "  median over {} rounds, {c}: {} tok/s, {} of the bound, {} of the bound at the device's rate",
                r["rounds"],
                x("decode_tokens_per_sec", 3),
                x("ratio_to_storage_bound_around", 2),
                x("ratio_to_device_rate_bound", 2)
            )?;
        }
    }
    if let Some(n) = r["same_ids_in_every_run"].as_u64() {
        vpaged::outln!("  ids: the same in all {n} runs")?;
    }
    for c in ["cache", "vpack"] {
        if let Some(v) = r[format!("{c}_vs_mmap")].as_f64() {
            vpaged::outln!("  {c} / mmap decode (median of each round's ratio): {v:.2}x")?;
        }
        if let Some(v) = r[format!("{c}_vs_mmap_at_device_rate")].as_f64() {
            vpaged::outln!("  {c} / mmap at the device's rate (the same, each held to what the device gave it): {v:.2}x")?;
        }
    }
    Ok(())
}

/// The median of `v` (the mean of the middle two for an even count); `None` if empty.
fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// Writes the page manifest the page cache needs, if missing.
fn ensure_manifest(dir: &Path) -> Result<()> {
    if dir.join(MANIFEST_FILE).is_file() {
        return Ok(());
    }
    eprintln!(
        "voom bench: hashing {} for its page manifest",
        dir.display()
    );
    let ckpt = Checkpoint::open(dir)?;
    let manifest = Manifest::build(&ckpt, &mut |_, _| {})?;
    manifest.save(dir)?;
    Ok(())
}

/// Raw bytes per second one thread decodes from the packed copy's bodies (zstd and
/// the byte interleave, as a page load does), over up to 512 MiB of its pages, read
/// into memory first.
fn decode_rate(p: &Packed) -> Result<f64> {
    use std::os::unix::fs::FileExt;
    let mut files: std::collections::HashMap<String, std::fs::File> = Default::default();
    let (mut raw, mut secs) = (0u64, 0f64);
    let mut out = Vec::new();
    for page in &p.manifest.pages {
        let Some(b) = page.vpack() else { continue };
        if raw >= 512 << 20 {
            break;
        }
        if !files.contains_key(&b.file) {
            let path = p.dir.join(&b.file);
            let f = std::fs::File::open(&path)
                .with_context(|| format!("opening {}", path.display()))?;
            files.insert(b.file.clone(), f);
        }
        let mut body = vec![0u8; b.len as usize];
        files[&b.file]
            .read_exact_at(&mut body, b.offset)
            .with_context(|| format!("reading the vpack body of page '{}'", page.name))?;
        out.resize(page.len as usize, 0);
        let t = Instant::now();
        voom_formats::vpack::decode(&body, &mut out)
            .with_context(|| format!("decoding the vpack body of page '{}'", page.name))?;
        secs += t.elapsed().as_secs_f64();
        raw += page.len;
    }
    if raw == 0 {
        bail!("the packed copy {} has no vpack bodies", p.dir.display());
    }
    Ok(raw as f64 / secs.max(1e-9))
}

/// The packed copy of a model that the `vpack` configuration reads.
struct Packed {
    dir: PathBuf,
    /// Its manifest.
    manifest: Manifest,
}

impl Packed {
    /// Bytes of the bodies over the raw bytes of the pages they encode.
    fn ratio(&self) -> f64 {
        let (raw, body) = self
            .manifest
            .pages
            .iter()
            .filter_map(|p| p.vpack().map(|b| (p.len, b.len)))
            .fold((0u64, 0u64), |(r, b), (x, y)| (r + x, b + y));
        body as f64 / raw.max(1) as f64
    }
}

/// The packed copy of `dir` (`DIR-vpack` beside it): its checkpoint files hard links
/// of `dir`'s (the same blocks on storage; copies where links cannot be made), the
/// other files copied, its manifest naming the vpack bodies in its own `model.vpack`.
/// Made once; a copy whose pages are no longer the model's (its manifest's pages,
/// blake3s included, differ from the model's manifest) is made again. The model must
/// have its manifest ([`ensure_manifest`]).
fn packed_copy(dir: &Path) -> Result<Packed> {
    use voom_formats::vpack::PACK_FILE;
    let name = dir.file_name().context("the model directory has no name")?;
    let packed = dir.with_file_name(format!("{}-vpack", name.to_string_lossy()));
    let ckpt = Checkpoint::open(dir)?;
    let model =
        Manifest::load(dir)?.with_context(|| format!("{} has no page manifest", dir.display()))?;
    let same_page = |a: &PageEntry, b: &PageEntry| {
        (&a.name, &a.blake3, &a.file, a.offset, a.len)
            == (&b.name, &b.blake3, &b.file, b.offset, b.len)
    };
    if let Ok(Some(m)) = Manifest::load(&packed) {
        if packed.join(PACK_FILE).is_file()
            && m.pages.iter().any(|p| p.vpack().is_some())
            && m.pages.len() == model.pages.len()
            && m.pages
                .iter()
                .zip(&model.pages)
                .all(|(a, b)| same_page(a, b))
        {
            return Ok(Packed {
                manifest: m,
                dir: packed,
            });
        }
    }
    eprintln!(
        "voom bench: packing a copy of {} into {} for the vpack configuration",
        dir.display(),
        packed.display()
    );
    std::fs::create_dir_all(&packed).with_context(|| format!("creating {}", packed.display()))?;
    let links: Vec<PathBuf> = ckpt.files.iter().map(|f| f.path.clone()).collect();
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let from = entry?.path();
        if !from.is_file() || from.file_name().is_some_and(|n| n == PACK_FILE) {
            continue;
        }
        let to = packed.join(from.file_name().expect("a file has a name"));
        let _ = std::fs::remove_file(&to);
        let linked = links.contains(&from) && std::fs::hard_link(&from, &to).is_ok();
        if !linked {
            std::fs::copy(&from, &to)
                .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
        }
    }
    let mut manifest = Manifest::load(&packed)?
        .with_context(|| format!("{} has no page manifest", packed.display()))?;
    let report = voom_formats::pack::pack_model(&packed, &mut manifest, &mut |_, _| {})
        .with_context(|| format!("packing {}", packed.display()))?;
    eprintln!(
        "voom bench: packed {} pages, bodies {:.4} of the raw bytes",
        report.pages,
        report.ratio()
    );
    Ok(Packed {
        manifest,
        dir: packed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_against_the_devices_rate_is_busy_share_times_bytes_needed_over_read() {
        // 4 passes in 8 s reading 4 GB, the device busy 6 s of them: it gave 4/6
        // GB/s, at which a token needing 0.5 GB would take 0.75 s; decode took 2 s.
        let r = json!({
            "timing": {"decode_secs": 8.0},
            "decode_device": {"bytes_read": 4_000_000_000u64, "read_requests": 2000, "busy_secs": 6.0},
        });
        let d = decode_activity(&r, 4, 500_000_000);
        assert_eq!(d["bytes_per_pass"], 1_000_000_000u64);
        assert_eq!(d["mean_request_bytes"], 2_000_000u64);
        let near = |k: &str, want: f64| {
            let got = d[k].as_f64().unwrap();
            assert!((got - want).abs() < 1e-9, "{k}: {got} against {want}");
        };
        near("busy_share", 0.75);
        near("bytes_per_sec_while_busy", 4e9 / 6.0);
        near("ratio_to_device_rate_bound", 0.75 * 0.5);
        // No counters from the child (not Linux, no device): nothing to report.
        let none = json!({"timing": {"decode_secs": 8.0}, "decode_device": null});
        assert!(decode_activity(&none, 4, 1).is_null());
        // A device never busy gives no rate, and no ratio.
        let idle = json!({
            "timing": {"decode_secs": 1.0},
            "decode_device": {"bytes_read": 0, "read_requests": 0, "busy_secs": 0.0},
        });
        assert!(decode_activity(&idle, 1, 1)["ratio_to_device_rate_bound"].is_null());
    }
}
