//! `voom bench`: prefill and decode tokens/s, with the weight bytes streamed per
//! decode token and the ratio to the memory read bandwidth measured in the same run
//! (BENCHMARKS.md). Resident decode is bound by bandwidth / bytes touched per token;
//! prefill on the CPU by its f32 multiply-adds: the prefill's multiply-adds a second
//! against the peak of the backend's instruction set, probed in the same runs.

use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use libvoom::backend::cpu::fma_peak::fma_gflops;
use libvoom::backend::cpu::matmul::Isa;
use libvoom::backend::cpu::membw::{read_bandwidth, ReadProbe};
use libvoom::backend::BackendKind;
use libvoom::engine::{Engine, EngineOptions, GenerateParams};
use voom_formats::Checkpoint;

use crate::synth;

use super::common;
use super::llama_cpp::LlamaBench;

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub sub: Option<BenchSub>,
    /// Models to measure (directories or store names). Default: smollm2-135m-instruct
    /// (pulled if missing) and a synthetic Llama of --synthetic-gb.
    #[arg(long = "model")]
    pub models: Vec<String>,
    /// Measure only the synthetic models (no default SmolLM2: a machine that cannot
    /// pull it).
    #[arg(long)]
    pub synthetic_only: bool,
    /// Size of the synthetic random-weights Llama in GB of BF16 (0: none).
    #[arg(long, default_value_t = 1.5)]
    pub synthetic_gb: f64,
    /// Size of a synthetic random-weights Qwen3-Next (a hybrid: Gated DeltaNet and
    /// gated attention layers 3:1, experts) in GB of BF16 (0: none).
    #[arg(long, default_value_t = 0.0)]
    pub synthetic_hybrid_gb: f64,
    /// Size of a synthetic random-weights gpt-oss (gpt-oss-20b's widths, experts
    /// MXFP4 as released) in GB as stored (0: none).
    #[arg(long, default_value_t = 0.0)]
    pub synthetic_gpt_oss_gb: f64,
    /// Size of a synthetic random-weights DeepSeek-V3 (its widths: MLA, 256 experts
    /// of which 8 a token, a shared expert, up to 3 dense first layers; FP8 e4m3
    /// with 128x128 block scales as released) in GB as stored (0: none). A layer of
    /// experts is 11.5 GB.
    #[arg(long, default_value_t = 0.0)]
    pub synthetic_deepseek_gb: f64,
    /// Backends to measure, comma-separated (`cpu`, `cpu-avx2`, `mlx`...): each
    /// runs the same prompts in the same runs, its ids compared with the first's.
    #[arg(long = "backend", default_value = "cpu", value_delimiter = ',', value_parser = common::parse_backend)]
    pub backends: Vec<libvoom::backend::BackendKind>,
    /// Thread counts to measure, comma-separated.
    #[arg(long, default_value = "1,2", value_delimiter = ',')]
    pub threads: Vec<usize>,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens decoded per run.
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: usize,
    /// Timed runs per configuration (medians are reported).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Print one JSON object with every figure.
    #[arg(long)]
    pub json: bool,
    /// Also run every configuration with its pages served by the vpaged daemon at
    /// this socket, and report the daemon's overhead against the embedded store.
    #[arg(long)]
    pub vpaged: Option<PathBuf>,
    /// Decoder layers hinted to the page source ahead of the one computing (0: off).
    #[arg(long, default_value_t = 1)]
    pub prefetch_depth: usize,
    /// Also run every configuration under this runtime profile (its cache budget,
    /// pins, prefetch depth...; the thread count is the bench's), in the same runs.
    #[arg(long)]
    pub profile: Option<String>,
    /// Directory of profiles (as for `voom run --profiles-dir`).
    #[arg(long)]
    pub profiles_dir: Option<PathBuf>,
    /// llama.cpp's `llama-bench`: each run also measures it on `--llama-gguf` (the
    /// same model as a GGUF) with the same prompt, decode length and threads, and
    /// the figures are reported beside vOOM's with their ratio.
    #[arg(long)]
    pub llama_bench: Option<PathBuf>,
    /// The GGUF `--llama-bench` runs.
    #[arg(long)]
    pub llama_gguf: Option<PathBuf>,
}

/// Benchmarks beside the resident one.
#[derive(clap::Subcommand, Debug)]
pub enum BenchSub {
    /// Decode a model several times larger than a memory ceiling (a memory cgroup),
    /// against the storage bound and plain memory mapping, measured in the same run.
    OutOfCore(super::out_of_core::OutOfCoreArgs),
    /// Speculative decoding: the same prompts with no drafter, prompt lookup and a
    /// draft model, resident and out of core (a memory cgroup), in one run.
    Spec(super::spec_bench::SpecBenchArgs),
    /// Prompt-prefix reuse: time to first token of a long agent prompt cold,
    /// repeated, extended by a turn and after a restart, ids compared.
    Prefix(super::prefix_bench::PrefixBenchArgs),
    /// Decode at depth (8K, 32K positions) with a KV budget of a quarter of the
    /// context's KV, pages spilled to disk, against the KV resident.
    LongContext(super::long_context_bench::LongContextBenchArgs),
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

pub fn run(a: BenchArgs) -> Result<()> {
    match a.sub {
        Some(BenchSub::OutOfCore(o)) => return super::out_of_core::run(o),
        Some(BenchSub::Spec(s)) => return super::spec_bench::run(s),
        Some(BenchSub::Prefix(p)) => return super::prefix_bench::run_bench(p),
        Some(BenchSub::LongContext(l)) => return super::long_context_bench::run(l),
        None => {}
    }
    if a.runs == 0 || a.prompt_tokens == 0 || a.decode_tokens < 2 {
        bail!("--runs and --prompt-tokens must be positive and --decode-tokens at least 2");
    }
    let mut dirs: Vec<PathBuf> = Vec::new();
    if a.models.is_empty() && !a.synthetic_only {
        dirs.push(common::resolve_model("smollm2-135m-instruct", true)?);
    } else {
        for m in &a.models {
            dirs.push(common::resolve_model(m, false)?);
        }
    }
    if a.synthetic_gb > 0.0 {
        dirs.push(synth::bench_model(a.synthetic_gb)?);
    }
    if a.synthetic_hybrid_gb > 0.0 {
        dirs.push(synth::bench_hybrid_model(a.synthetic_hybrid_gb)?);
    }
    if a.synthetic_gpt_oss_gb > 0.0 {
        dirs.push(synth::bench_gpt_oss_model(a.synthetic_gpt_oss_gb)?);
    }
    if a.synthetic_deepseek_gb > 0.0 {
        dirs.push(synth::bench_deepseek_fp8_model(a.synthetic_deepseek_gb)?);
    }
    let llama = match &a.llama_bench {
        Some(b) => {
            if dirs.len() != 1 {
                bail!("--llama-bench compares one model: give one --model and --synthetic-gb 0");
            }
            Some(LlamaBench::new(b, a.llama_gguf.as_deref())?)
        }
        None => None,
    };

    let mut results = Vec::new();
    for dir in &dirs {
        for &threads in &a.threads {
            // Every page source of this configuration is measured in the same runs,
            // interleaved (run r of each source back to back), so that the machine's
            // drift falls on all of them alike.
            let opts = EngineOptions {
                threads,
                prefetch_depth: a.prefetch_depth,
                backend: a.backends.first().copied().unwrap_or_default(),
                ..Default::default()
            };
            let mut engines: Vec<(&str, Engine)> =
                vec![("embedded", Engine::open(dir, opts.clone())?)];
            // Other backends, over the embedded store too.
            for &backend in a.backends.iter().skip(1) {
                let e = Engine::open(
                    dir,
                    EngineOptions {
                        backend,
                        ..opts.clone()
                    },
                )?;
                engines.push((backend.name(), e));
            }
            if let Some(name) = &a.profile {
                let args = common::EngineArgs {
                    profile: name.clone(),
                    profiles_dir: a.profiles_dir.clone(),
                    threads: Some(threads),
                    verify: None,
                    max_context: None,
                    backend: None,
                    kv_page_positions: None,
                    vpaged: None,
                    vpaged_fallback: false,
                    prefetch_depth: None,
                    read_threads: None,
                    read_piece: None,
                    read_ahead_layers: None,
                    expert_prefetch: false,
                    memory_budget: None,
                    memory_mapped: false,
                    cache_budget: None,
                    fast_tier: None,
                    fast_tier_size: None,
                    pin_first_layers: None,
                    pin_last_layers: None,
                    kv_budget: None,
                    // Every run repeats one prompt: reusing it would measure nothing.
                    prefix_cache: Some(0),
                    prefix_disk: Some(0),
                    prefix_disk_min: None,
                    resolved: None,
                };
                let engine = common::open_engine(dir, &args)?;
                engines.push(("profile", engine));
            }
            if let Some(socket) = &a.vpaged {
                // The store core in this process, over an arena like the daemon's: the
                // same memory and cache, without the socket. Against it, the daemon's
                // figure is the handoff alone.
                let weights: u64 = Checkpoint::open(dir)?
                    .files
                    .iter()
                    .map(|f| f.mapping().len() as u64)
                    .sum();
                let store = vpaged::store::Store::new(vpaged::store::StoreConfig {
                    cache_bytes: (weights * 3 / 2) as usize + (64 << 20),
                    ..Default::default()
                })?;
                let src = vpaged::store::StoreSource::open(store, dir)?;
                engines.push((
                    "store",
                    Engine::with_source(dir, std::sync::Arc::new(src), opts.clone())?,
                ));
                let c = vpaged::client::DaemonClient::connect(socket, "voom-bench")?;
                let src = vpaged::client::DaemonSource::open(c, dir)?;
                engines.push((
                    "vpaged",
                    Engine::with_source(dir, std::sync::Arc::new(src), opts.clone())?,
                ));
            }
            let engine0 = &engines[0].1;
            let vocab = engine0.config().vocab_size as u32;
            let eos = engine0.eos_ids().to_vec();
            // A fixed pseudo-random prompt of ids that are not end-of-sequence tokens.
            let prompt: Vec<u32> = (0..a.prompt_tokens as u32)
                .map(|i| (i.wrapping_mul(2654435761) >> 7) % vocab)
                .map(|t| if eos.contains(&t) { (t + 1) % vocab } else { t })
                .collect();
            let params = GenerateParams {
                max_new_tokens: a.decode_tokens,
                ignore_eos: true,
                ..Default::default()
            };
            let bytes_per_token = engine0.model().plan().weight_bytes_per_token() as f64;
            // Warm-up: fault the mappings in, fill the caches, settle the page cache.
            let mut first_ids = None;
            let engine0_backend = engines[0].1.backend_name();
            for (label, engine) in &engines {
                let g = engine.generate(&prompt, &params, &mut |_| ControlFlow::Continue(()))?;
                // Paging never changes arithmetic: every source gives the same ids.
                // Backends agree on ids where the logits have no near-tie (random
                // weights can have one): a difference is reported, not fatal.
                match &first_ids {
                    None => first_ids = Some(g.ids),
                    Some(ids) if *ids != g.ids => {
                        if engine.backend_name() == engine0_backend {
                            bail!("the {label} page source generated different ids");
                        }
                        let same = ids.iter().zip(&g.ids).take_while(|(a, b)| a == b).count();
                        eprintln!(
                            "voom bench: {} and {engine0_backend} agree on the first {same} of {} ids",
                            engine.backend_name(),
                            ids.len()
                        );
                    }
                    _ => {}
                }
            }
            // The same mapped files the engine reads: streaming them is the most
            // faithful bound (same memory, same bytes, same page size).
            let ckpt = Checkpoint::open(dir)?;
            let (mut bw, mut wbw) = (Vec::new(), Vec::new());
            let mut prefill = vec![Vec::new(); engines.len()];
            let mut decode = vec![Vec::new(); engines.len()];
            let mut prefill_macs = vec![0u64; engines.len()];
            // The CPU instruction set each engine computes with (none: not the CPU),
            // and the multiply-add peak of each, probed between runs.
            let isas: Vec<Option<Isa>> = engines
                .iter()
                .map(|(_, e)| match BackendKind::parse(&e.backend_name()) {
                    Ok(BackendKind::Cpu(isa)) => Some(isa),
                    _ => None,
                })
                .collect();
            let mut peaks: Vec<(Isa, Vec<f64>)> = Vec::new();
            for isa in isas.iter().flatten() {
                if !peaks.iter().any(|(i, _)| i == isa) {
                    peaks.push((*isa, Vec::new()));
                }
            }
            let (mut llama_prefill, mut llama_decode) = (Vec::new(), Vec::new());
            for _ in 0..a.runs {
                if let Some(l) = &llama {
                    let f = l.run(a.prompt_tokens, a.decode_tokens, threads)?;
                    llama_prefill.push(f.prefill);
                    llama_decode.push(f.decode);
                }
                // The bounds, measured between runs on the same threads.
                bw.push(read_bandwidth(1 << 30, threads, 3));
                let (mut bytes, mut secs) = (0f64, 0f64);
                for f in &ckpt.files {
                    let gbs = ReadProbe::pass_over(f.mapping(), threads);
                    bytes += f.mapping().len() as f64;
                    secs += f.mapping().len() as f64 / (gbs * 1e9);
                }
                wbw.push(bytes / secs / 1e9);
                for (isa, v) in &mut peaks {
                    v.push(fma_gflops(
                        *isa,
                        threads,
                        std::time::Duration::from_millis(300),
                    ));
                }
                for (i, (_, engine)) in engines.iter().enumerate() {
                    let g =
                        engine.generate(&prompt, &params, &mut |_| ControlFlow::Continue(()))?;
                    prefill[i].push(g.prefill_tokens_per_sec());
                    decode[i].push(g.decode_tokens_per_sec());
                    prefill_macs[i] = g.prefill_multiply_adds;
                }
            }
            let spread = |v: &[f64]| {
                let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = v.iter().copied().fold(0.0, f64::max);
                (lo, hi)
            };
            let bw_med = median(&mut bw.clone());
            let wbw_med = median(&mut wbw.clone());
            let mut medians = Vec::new();
            for (i, (label, engine)) in engines.iter().enumerate() {
                let (dlo, dhi) = spread(&decode[i]);
                let (plo, phi) = spread(&prefill[i]);
                let dec_med = median(&mut decode[i].clone());
                let pre_med = median(&mut prefill[i].clone());
                medians.push(dec_med);
                let achieved = dec_med * bytes_per_token / 1e9;
                let mut r = serde_json::json!({
                    "model": engine.name(),
                    "backend": engine.backend_name(),
                    "page_source": engine.source().describe(),
                    "source_kind": label,
                    "threads": threads,
                    "weight_bytes_per_token": bytes_per_token,
                    "prompt_tokens": a.prompt_tokens,
                    "decode_tokens": a.decode_tokens,
                    "runs": a.runs,
                    "prefill_tokens_per_sec": {"median": pre_med, "min": plo, "max": phi},
                    "decode_tokens_per_sec": {"median": dec_med, "min": dlo, "max": dhi},
                    "decode_weight_gb_per_sec": achieved,
                    "memory_read_gb_per_sec": bw_med,
                    "weights_read_gb_per_sec": wbw_med,
                    "decode_bound_tokens_per_sec": wbw_med * 1e9 / bytes_per_token,
                    "ratio_to_bound": achieved / wbw_med,
                    "ratio_to_memory_probe": achieved / bw_med,
                });
                // Prefill against the multiply-add peak (CPU backends): its products'
                // and attention's multiply-adds (two operations each) a second.
                let pre_gflops =
                    2.0 * prefill_macs[i] as f64 / a.prompt_tokens.max(1) as f64 * pre_med / 1e9;
                let peak = isas[i].and_then(|isa| {
                    let v = &peaks.iter().find(|(p, _)| *p == isa)?.1;
                    Some(median(&mut v.clone()))
                });
                r["prefill_multiply_adds"] = prefill_macs[i].into();
                r["prefill_gflops"] = pre_gflops.into();
                if let Some(p) = peak {
                    r["fma_peak_gflops"] = p.into();
                    r["prefill_ratio_to_fma_peak"] = (pre_gflops / p).into();
                }
                if !a.json {
                    vpaged::outln!(
                        "{:<28} {:<8} threads {}  prefill {:>7.1} tok/s [{:.1}..{:.1}]  decode {:>6.2} tok/s [{:.2}..{:.2}]  {:.1} MB/token  {:>5.2} GB/s = {:>3.0}% of weights read {:.2} GB/s ({:>3.0}% of probe {:.2} GB/s)",
                        engine.name(),
                        format!("{label}/{}", engine.backend_name()),
                        threads,
                        pre_med,
                        plo,
                        phi,
                        dec_med,
                        dlo,
                        dhi,
                        bytes_per_token / 1e6,
                        achieved,
                        100.0 * achieved / wbw_med,
                        wbw_med,
                        100.0 * achieved / bw_med,
                        bw_med
                    )?;
                    if let Some(p) = peak {
                        vpaged::outln!(
                            "{:<28} prefill {:.1} GFLOP/s (its products' and attention's multiply-adds) = {:>3.0}% of the f32 multiply-add peak {:.1} GFLOP/s ({} threads)",
                            "",
                            pre_gflops,
                            100.0 * pre_gflops / p,
                            p,
                            threads,
                        )?;
                    }
                }
                if let (Some(l), true) = (&llama, i == 0) {
                    let (lp, ld) = (
                        median(&mut llama_prefill.clone()),
                        median(&mut llama_decode.clone()),
                    );
                    r["llama_cpp"] = serde_json::json!({
                        "llama_bench": l.binary.display().to_string(),
                        "gguf": l.gguf.display().to_string(),
                        "prefill_tokens_per_sec": lp,
                        "decode_tokens_per_sec": ld,
                        "prefill_ratio": pre_med / lp,
                        "decode_ratio": dec_med / ld,
                        // vOOM's multiply-adds at llama.cpp's rate: the same work.
                        "prefill_gflops_same_work": pre_gflops * lp / pre_med,
                    });
                    if !a.json {
                        vpaged::outln!(
                            "{:<28} llama.cpp (llama-bench, same runs): prefill {:>7.1} tok/s, decode {:>6.2} tok/s at depth {}: vOOM {:.2}x prefill, {:.2}x decode",
                            "",
                            lp,
                            ld,
                            a.prompt_tokens,
                            pre_med / lp,
                            dec_med / ld,
                        )?;
                    }
                }
                if *label == "vpaged" {
                    // Overhead = 1 - daemon/other, on decode medians; per-run pairs
                    // (same run, back to back) give a second, drift-free estimate.
                    let pairs = |j: usize| {
                        let mut v: Vec<f64> = decode[i]
                            .iter()
                            .zip(&decode[j])
                            .map(|(d, o)| 1.0 - d / o)
                            .collect();
                        median(&mut v)
                    };
                    // The in-process store is pushed with the daemon, just before it.
                    let store_i = i - 1;
                    let vs_embedded = 1.0 - dec_med / medians[0];
                    let vs_store = 1.0 - dec_med / medians[store_i];
                    r["handoff_overhead_vs_embedded"] = vs_embedded.into();
                    r["handoff_overhead_vs_store"] = vs_store.into();
                    r["handoff_overhead_vs_embedded_paired"] = pairs(0).into();
                    r["handoff_overhead_vs_store_paired"] = pairs(store_i).into();
                    if !a.json {
                        vpaged::outln!(
                            "{:<28} daemon overhead on decode: {:+.1}% vs embedded (paired runs {:+.1}%), {:+.1}% vs the in-process store (paired {:+.1}%)",
                            "",
                            100.0 * vs_embedded,
                            100.0 * pairs(0),
                            100.0 * vs_store,
                            100.0 * pairs(store_i),
                        )?;
                    }
                }
                results.push(r);
            }
        }
    }
    if a.json {
        vpaged::outln!(
            "{}",
            serde_json::json!({ "bench": "decode", "results": results })
        )?;
    }
    Ok(())
}
