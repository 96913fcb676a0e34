//! `voom bench`: prefill and decode tokens/s, with the weight bytes streamed per
//! decode token and the ratio to the memory read bandwidth measured in the same run
//! (BENCHMARKS.md). Resident decode is bound by bandwidth / bytes touched per token.

use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use libvoom::backend::cpu::membw::{read_bandwidth, ReadProbe};
use libvoom::engine::{Engine, EngineOptions, GenerateParams};
use voom_formats::Checkpoint;

use crate::synth::{self, SynthShape};

use super::common;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Models to measure (directories or store names). Default: smollm2-135m-instruct
    /// (pulled if missing) and a synthetic Llama of --synthetic-gb.
    #[arg(long = "model")]
    pub models: Vec<String>,
    /// Size of the synthetic random-weights Llama in GB of BF16 (0: none).
    #[arg(long, default_value_t = 1.5)]
    pub synthetic_gb: f64,
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
    if a.runs == 0 || a.prompt_tokens == 0 || a.decode_tokens < 2 {
        bail!("--runs and --prompt-tokens must be positive and --decode-tokens at least 2");
    }
    let mut dirs: Vec<PathBuf> = Vec::new();
    if a.models.is_empty() {
        dirs.push(common::resolve_model("smollm2-135m-instruct", true)?);
    } else {
        for m in &a.models {
            dirs.push(common::resolve_model(m, false)?);
        }
    }
    if a.synthetic_gb > 0.0 {
        let shape = SynthShape::of_size(a.synthetic_gb);
        let dir = crate::store::voom_home()?.join("bench").join(format!(
            "llama-synthetic-{}l-{}h",
            shape.layers, shape.hidden
        ));
        if !dir.join("config.json").exists() {
            eprintln!(
                "voom bench: writing a synthetic Llama ({} layers, {:.2} GB BF16) to {}",
                shape.layers,
                shape.params() as f64 * 2.0 / 1e9,
                dir.display()
            );
            synth::write_llama(&dir, shape, 0x5eed)?;
        }
        dirs.push(dir);
    }

    let mut results = Vec::new();
    for dir in &dirs {
        let sources: Vec<Option<&PathBuf>> = std::iter::once(None)
            .chain(a.vpaged.as_ref().map(Some))
            .collect();
        for &threads in &a.threads {
            for source in &sources {
                let opts = EngineOptions {
                    threads,
                    ..Default::default()
                };
                let engine = match source {
                    None => Engine::open(dir, opts)?,
                    Some(socket) => {
                        let c = vpaged::client::DaemonClient::connect(socket, "voom-bench")?;
                        let src = vpaged::client::DaemonSource::open(c, dir)?;
                        Engine::with_source(dir, std::sync::Arc::new(src), opts)?
                    }
                };
                let vocab = engine.config().vocab_size as u32;
                let eos = engine.eos_ids().to_vec();
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
                // Warm-up: fault the mapping in and settle the page cache.
                engine.generate(&prompt, &params, &mut |_| ControlFlow::Continue(()))?;
                let bytes_per_token = engine.model().weight_bytes_per_token() as f64;
                // The same mapped files the engine reads: streaming them is the most
                // faithful bound (same memory, same bytes, same page size).
                let ckpt = Checkpoint::open(dir)?;
                let (mut prefill, mut decode, mut bw, mut wbw) =
                    (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                for _ in 0..a.runs {
                    // The bounds, measured between runs on the same threads.
                    bw.push(read_bandwidth(1 << 30, threads, 3));
                    let (mut bytes, mut secs) = (0f64, 0f64);
                    for f in &ckpt.files {
                        let gbs = ReadProbe::pass_over(f.mapping(), threads);
                        bytes += f.mapping().len() as f64;
                        secs += f.mapping().len() as f64 / (gbs * 1e9);
                    }
                    wbw.push(bytes / secs / 1e9);
                    let g =
                        engine.generate(&prompt, &params, &mut |_| ControlFlow::Continue(()))?;
                    prefill.push(g.prefill_tokens_per_sec());
                    decode.push(g.decode_tokens_per_sec());
                }
                let spread = |v: &[f64]| {
                    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
                    let hi = v.iter().copied().fold(0.0, f64::max);
                    (lo, hi)
                };
                let (dlo, dhi) = spread(&decode);
                let (plo, phi) = spread(&prefill);
                let bw_med = median(&mut bw.clone());
                let wbw_med = median(&mut wbw.clone());
                let dec_med = median(&mut decode.clone());
                let pre_med = median(&mut prefill.clone());
                let achieved = dec_med * bytes_per_token / 1e9;
                let r = serde_json::json!({
                    "model": engine.name(),
                    "page_source": engine.source().describe(),
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
                if !a.json {
                    println!(
                    "{:<28} {:<8} threads {}  prefill {:>7.1} tok/s [{:.1}..{:.1}]  decode {:>6.2} tok/s [{:.2}..{:.2}]  {:.1} MB/token  {:>5.2} GB/s = {:>3.0}% of weights read {:.2} GB/s ({:>3.0}% of probe {:.2} GB/s)",
                    engine.name(),
                    if source.is_some() { "vpaged" } else { "embedded" },
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
                );
                }
                if source.is_some() {
                    let embedded = results.last().and_then(|e: &serde_json::Value| {
                        e["decode_tokens_per_sec"]["median"].as_f64()
                    });
                    if let Some(e) = embedded {
                        let overhead = 1.0 - dec_med / e;
                        if !a.json {
                            println!(
                                "{:<28} daemon handoff overhead on decode: {:+.1}%",
                                "",
                                100.0 * overhead
                            );
                        }
                    }
                }
                results.push(r);
            }
        }
    }
    if a.json {
        println!(
            "{}",
            serde_json::json!({ "bench": "decode", "results": results })
        );
    }
    Ok(())
}
