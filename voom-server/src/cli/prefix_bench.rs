//! `voom bench prefix`: time to first token of a long agent-style prompt (a tool
//! catalog, then a conversation) sent cold, repeated, extended by one turn, and
//! repeated on a fresh engine over the snapshots the first wrote (what a restarted
//! server has), with the ids of each
//! compared to a cold run of the same prompt. The baseline is that cold run,
//! measured the same way in the same sitting.

use std::ops::ControlFlow;

use anyhow::{bail, Context, Result};
use clap::Args;
use libvoom::engine::{Decoding, Engine, EngineOptions, GenerateParams, Generation};
use serde_json::json;

use super::common;

#[derive(Args, Debug)]
pub struct PrefixBenchArgs {
    /// The model (a directory or a name in the local store; pulled if it is a known
    /// one). It needs a tokenizer.
    #[arg(long, default_value = "smollm2-135m-instruct")]
    pub model: String,
    /// Tokens of the prompt.
    #[arg(long, default_value_t = 4000)]
    pub prompt_tokens: usize,
    /// Compute threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Bytes of the prefix cache.
    #[arg(long, value_parser = crate::profile::parse_size, default_value = "1GiB")]
    pub prefix_cache: u64,
    /// Print one JSON object with every figure.
    #[arg(long)]
    pub json: bool,
}

/// Targets the KV issue sets, as multiples of the cold time to first token.
const TARGET_WARM: f64 = 20.0;
const TARGET_RESTART: f64 = 10.0;

/// A tool catalog and a conversation, as an agent sends them, of at least `tokens`
/// tokens once encoded.
fn agent_prompt(e: &Engine, tokens: usize) -> Result<Vec<u32>> {
    let tok = e
        .tokenizer()
        .context("the model has no tokenizer.json: voom bench prefix needs one")?;
    let mut text =
        String::from("System: You are an assistant that can call tools. The tools are:\n");
    let mut i = 0;
    loop {
        let tool = json!({
            "name": format!("tool_{i}"),
            "description": format!(
                "Looks up record {i} of the inventory and returns its fields: the \
                 name, the quantity on hand, the warehouse, and the date of the last \
                 count."
            ),
            "parameters": {"type": "object", "properties": {
                "id": {"type": "integer"}, "fields": {"type": "array", "items": {"type": "string"}}
            }, "required": ["id"]},
        });
        text.push_str(&tool.to_string());
        text.push('\n');
        if i % 3 == 2 {
            text.push_str(&format!(
                "User: What is the quantity of item {i} in the north warehouse?\n\
                 Assistant: I will call tool_{i} with id {i}. The count is {}.\n",
                i * 7
            ));
        }
        let ids = tok.encode(&text, true)?;
        if ids.len() >= tokens {
            return Ok(ids[..tokens].to_vec());
        }
        i += 1;
    }
}

fn run(e: &Engine, prompt: &[u32]) -> Result<Generation> {
    let params = GenerateParams {
        max_new_tokens: 8,
        ignore_eos: true,
        ..GenerateParams::default()
    };
    Ok(
        e.generate_with(prompt, &params, Decoding::default(), &mut |_| {
            ControlFlow::Continue(())
        })?,
    )
}

pub fn run_bench(a: PrefixBenchArgs) -> Result<()> {
    if a.prompt_tokens < 32 {
        bail!("--prompt-tokens must be at least 32");
    }
    let dir = common::resolve_model(&a.model, true)?;
    // Snapshots go to a directory of this run's own, so the run starts with none.
    let snaps = tempfile::tempdir().context("a temporary directory for snapshots")?;
    let disk = libvoom::engine::snapshot::DiskPrefixes {
        dir: snaps.path().to_path_buf(),
        budget: u64::MAX,
        min_tokens: libvoom::engine::prefix::MIN_PREFIX,
    };
    let opts = |prefix_cache_bytes: usize| EngineOptions {
        threads: a.threads,
        max_context: Some(a.prompt_tokens + 256),
        prefix_cache_bytes,
        prefix_disk: (prefix_cache_bytes > 0).then(|| disk.clone()),
        ..EngineOptions::default()
    };
    let open = |bytes: usize| {
        Engine::open(&dir, opts(bytes)).with_context(|| format!("opening {}", dir.display()))
    };
    let cold = open(0)?;
    let warm = open(a.prefix_cache as usize)?;
    if warm.snapshot_status().is_none() {
        bail!(
            "{} has no page manifest, so its prefixes cannot be persisted: `vpagectl hash` writes one",
            dir.display()
        );
    }
    let prompt = agent_prompt(&cold, a.prompt_tokens)?;
    // Warm the OS page cache and the kernels on a short prompt first (on the
    // engine without a prefix cache: the other starts empty).
    run(&cold, &prompt[..32])?;

    let base = run(&cold, &prompt)?;
    let first = run(&warm, &prompt)?;
    let repeated = run(&warm, &prompt)?;
    let tok = cold.tokenizer().context("checked above")?;
    let mut extended = prompt.clone();
    extended.extend(&first.ids);
    extended.extend(tok.encode("\nUser: And in the south warehouse?\nAssistant:", false)?);
    let extended_cold = run(&cold, &extended)?;
    let extended_warm = run(&warm, &extended)?;
    warm.flush_prefixes();
    drop(warm);
    // A fresh engine: what a restarted server starts with (the snapshots on disk).
    let restarted = run(&open(a.prefix_cache as usize)?, &prompt)?;

    let ttft = |g: &Generation| g.prefill_secs;
    let rows = [
        ("cold", &base, &base, ttft(&base)),
        ("first (filling the cache)", &first, &base, ttft(&base)),
        ("repeated", &repeated, &base, ttft(&base)),
        (
            "extended by a turn",
            &extended_warm,
            &extended_cold,
            ttft(&extended_cold),
        ),
        ("repeated after a restart", &restarted, &base, ttft(&base)),
    ];
    let mut out = Vec::new();
    for (name, g, reference, cold_ttft) in rows {
        out.push(json!({
            "run": name,
            "prompt_tokens": g.prompt_tokens,
            "prefix_tokens_reused": g.prefix_reused,
            "time_to_first_token_secs": ttft(g),
            "cold_secs": cold_ttft,
            "speedup": cold_ttft / ttft(g).max(1e-9),
            "same_ids_as_cold": g.ids == reference.ids,
        }));
    }
    let speedup = |i: usize| out[i]["speedup"].as_f64().unwrap_or(0.0);
    let report = json!({
        "model": dir.display().to_string(),
        "threads": cold.threads(),
        "runs": out,
        "targets": {
            "repeated_and_extended_speedup": TARGET_WARM,
            "after_restart_speedup": TARGET_RESTART,
            "repeated_met": speedup(2) >= TARGET_WARM,
            "extended_met": speedup(3) >= TARGET_WARM,
            "after_restart_met": speedup(4) >= TARGET_RESTART,
        },
    });
    if a.json {
        vpaged::outln!("{report}")?;
        return Ok(());
    }
    vpaged::outln!(
        "{} on {} threads, a {}-token agent prompt (tool catalog and conversation):",
        cold.name(),
        cold.threads(),
        prompt.len()
    )?;
    vpaged::outln!(
        "  {:<28} {:>7} {:>7} {:>10} {:>9} {:>8}",
        "run",
        "tokens",
        "reused",
        "TTFT s",
        "x cold",
        "same ids"
    )?;
    for r in &out {
        vpaged::outln!(
            "  {:<28} {:>7} {:>7} {:>10.3} {:>9.1} {:>8}",
            r["run"].as_str().unwrap_or(""),
            r["prompt_tokens"].as_u64().unwrap_or(0),
            r["prefix_tokens_reused"].as_u64().unwrap_or(0),
            r["time_to_first_token_secs"].as_f64().unwrap_or(0.0),
            r["speedup"].as_f64().unwrap_or(0.0),
            r["same_ids_as_cold"].as_bool().unwrap_or(false)
        )?;
    }
    let met = |b: bool| if b { "met" } else { "NOT met" };
    vpaged::outln!(
        "targets: repeated and extended at least {TARGET_WARM}x faster to the first token: {} ({:.1}x), {} ({:.1}x); after a restart at least {TARGET_RESTART}x: {} ({:.1}x)",
        met(speedup(2) >= TARGET_WARM),
        speedup(2),
        met(speedup(3) >= TARGET_WARM),
        speedup(3),
        met(speedup(4) >= TARGET_RESTART),
        speedup(4),
    )?;
    Ok(())
}
