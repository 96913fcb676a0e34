//! `voom bench spec`: speculative decoding measured. The same prompts decode with no
//! drafter, with prompt lookup and with a draft model, resident and out of core (a
//! memory cgroup below the model's size, the page cache dropped before each run;
//! resident runs find the model's and the draft's files in the OS page cache), in
//! one run: tokens/s, ids committed per pass of the target (one sweep of the weights
//! each), acceptance, bytes the device read per committed id, and whether the ids
//! equal the plain run's (they must: speculation is exact).
//!
//! Each run is a child `voom generate --json`, as a user would run it. The prompts:
//! an edit (rewrite a given code file with one change: the output repeats the
//! input, what prompt lookup is for) and a free-form answer (little to copy).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use libvoom::placement::human;
use serde_json::{json, Value};

use crate::cgroup::{self, Ceiling};
use crate::cli::common;
use crate::synth;

#[derive(Args, Debug)]
pub struct SpecBenchArgs {
    /// The target model (a directory or a name in the local store; pulled if it is a
    /// known one).
    #[arg(long, default_value = "smollm2-135m-instruct")]
    pub model: String,
    /// The memory ceiling of the out-of-core runs, for the whole process (the
    /// default leaves SmolLM2-135M about 80 of its 257 MiB of weights resident beside
    /// the process, KV, scratch and read buffers: a token reads most of the rest).
    #[arg(long, value_parser = crate::profile::parse_size, default_value = "240MiB")]
    pub budget: u64,
    /// Longest context of a run (KV cache sized for it). Default: the ids wanted
    /// plus 320 for the prompt.
    #[arg(long)]
    pub max_context: Option<usize>,
    /// The draft model (a directory or store name). Default: one made from the
    /// target's first `--draft-layers` layers (its own embedding, norm and head).
    #[arg(long)]
    pub draft: Option<String>,
    /// Layers of the draft made from the target when no `--draft` is given; 0: no
    /// draft-model runs.
    #[arg(long, default_value_t = 8)]
    pub draft_layers: usize,
    /// Ids generated per run at most.
    #[arg(long, default_value_t = 160)]
    pub max_new_tokens: usize,
    /// The most ids a pass verifies beyond the one it computes.
    #[arg(long, default_value_t = libvoom::engine::MAX_DRAFT)]
    pub max_draft: usize,
    /// Compute threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Placements to run, comma-separated: `resident`, `out-of-core`.
    #[arg(long, value_delimiter = ',', default_value = "resident,out-of-core")]
    pub placements: Vec<String>,
    /// Prompts to run, comma-separated: `edit`, `free`.
    #[arg(long, value_delimiter = ',', default_value = "edit,free")]
    pub prompts: Vec<String>,
    /// The `voom` binary the runs use (default: this one).
    #[arg(long)]
    pub voom: Option<PathBuf>,
    /// Print one JSON object with every figure.
    #[arg(long)]
    pub json: bool,
}

/// The edit prompt's file: the model is asked to rewrite it with one name changed.
const EDIT_FILE: &str = r#"import math


def area_of_circle(radius):
    return math.pi * radius * radius


def circumference(radius):
    return 2 * math.pi * radius


def describe(radius):
    a = area_of_circle(radius)
    c = circumference(radius)
    return f"radius={radius} area={a:.2f} circumference={c:.2f}"


if __name__ == "__main__":
    for r in [1, 2, 3]:
        print(describe(r))
"#;

fn prompt_text(name: &str) -> Result<String> {
    Ok(match name {
        "edit" => format!(
            "Here is a Python file:\n\n```python\n{EDIT_FILE}```\n\nRewrite the whole file \
             with the function `describe` renamed to `summary`. Keep everything else the same."
        ),
        "free" => "Write a short paragraph about the history of the bicycle.".to_string(),
        other => bail!("unknown prompt '{other}' (edit, free)"),
    })
}

pub fn run(a: SpecBenchArgs) -> Result<()> {
    if a.max_draft == 0 || a.max_new_tokens < 2 {
        bail!("--max-draft must be positive and --max-new-tokens at least 2");
    }
    let dir = common::resolve_model(&a.model, true)?;
    let ckpt = voom_formats::Checkpoint::open(&dir)
        .with_context(|| format!("opening {}", dir.display()))?;
    let model_bytes = ckpt.total_bytes();
    // A checkpoint with a multi-token-prediction layer drafts with it too.
    let cfg = libvoom::config::ModelConfig::from_dir(&dir)
        .with_context(|| format!("opening {}", dir.display()))?;
    let has_mtp = cfg.extra_layers > 0
        && ckpt
            .get(&format!("model.layers.{}.eh_proj.weight", cfg.num_layers))
            .is_some();
    // The files a resident run reads (the draft model's added below).
    let mut files: Vec<PathBuf> = ckpt.files.iter().map(|f| f.path.clone()).collect();
    drop(ckpt);
    let draft = match (&a.draft, a.draft_layers) {
        (Some(d), _) => Some(common::resolve_model(d, false)?),
        (None, 0) => None,
        (None, n) => Some(synth::first_layers_draft(&dir, n)?),
    };
    let draft_bytes = match &draft {
        Some(d) => {
            let c = voom_formats::Checkpoint::open(d)
                .with_context(|| format!("opening {}", d.display()))?;
            files.extend(c.files.iter().map(|f| f.path.clone()));
            c.total_bytes()
        }
        None => 0,
    };
    let budget = a.budget;
    let max_context = a.max_context.unwrap_or(a.max_new_tokens + 320);
    let voom = match &a.voom {
        Some(v) => v.clone(),
        None => std::env::current_exe().context("finding the voom binary")?,
    };
    let ceiling = Ceiling::create(budget);
    let mut drafters: Vec<(&str, Vec<String>)> = vec![
        ("none", vec![]),
        ("prompt-lookup", vec!["--prompt-lookup".into()]),
    ];
    if let Some(d) = &draft {
        drafters.push((
            "draft-model",
            vec!["--draft".into(), d.display().to_string()],
        ));
    }
    if has_mtp {
        drafters.push(("mtp", vec!["--mtp".into()]));
    }
    let mut runs = Vec::new();
    for placement in &a.placements {
        let out_of_core = match placement.as_str() {
            "resident" => false,
            "out-of-core" => true,
            other => bail!("unknown placement '{other}' (resident, out-of-core)"),
        };
        if out_of_core {
            if let Err(why) = &ceiling {
                eprintln!("voom bench spec: out-of-core runs skipped: no memory cgroup ({why})");
                continue;
            }
        } else {
            // Resident: the model's and the draft's files in the OS page cache.
            cgroup::warm_page_cache(&files);
        }
        for prompt in &a.prompts {
            let text = prompt_text(prompt)?;
            let mut plain_ids: Option<Value> = None;
            for (drafter, extra) in &drafters {
                let mut args: Vec<String> = vec![
                    "generate".into(),
                    "--model".into(),
                    dir.display().to_string(),
                    "--chat".into(),
                    text.clone(),
                    "--max-new-tokens".into(),
                    a.max_new_tokens.to_string(),
                    "--threads".into(),
                    a.threads.to_string(),
                    "--max-draft".into(),
                    a.max_draft.to_string(),
                    "--max-context".into(),
                    max_context.to_string(),
                    "--json".into(),
                ];
                args.extend(extra.iter().cloned());
                let r: Result<Report> = if out_of_core {
                    // The draft model lives in the same memory: the target plans
                    // with what it leaves.
                    let target_budget = if *drafter == "draft-model" {
                        budget.saturating_sub(draft_bytes)
                    } else {
                        budget
                    };
                    args.push("--memory-budget".into());
                    args.push(target_budget.to_string());
                    let c = ceiling.as_ref().expect("checked above");
                    let _ = cgroup::drop_page_cache();
                    c.reset_peak();
                    let out = c.command(&voom, &args).output()?;
                    child_report(&out, &args).map(|r| r.with_peak(c.peak()))
                } else {
                    let out = std::process::Command::new(&voom).args(&args).output()?;
                    child_report(&out, &args)
                };
                let r = match r {
                    Ok(r) => r,
                    Err(e) => {
                        // A configuration that cannot run (a draft model that leaves
                        // the target too little memory) is reported, not fatal.
                        runs.push(json!({
                            "placement": placement, "prompt": prompt, "drafter": drafter,
                            "error": format!("{e:#}"),
                        }));
                        continue;
                    }
                };
                let v = r.0;
                let ids = v["ids"].clone();
                let same = match &plain_ids {
                    None => {
                        plain_ids = Some(ids.clone());
                        true
                    }
                    Some(p) => *p == ids,
                };
                let generated = ids.as_array().map_or(0, Vec::len);
                let passes = v["decode_passes"].as_u64().unwrap_or(0) as usize;
                let read = v["decode_device"]["bytes_read"].as_u64();
                runs.push(json!({
                    "placement": placement,
                    "prompt": prompt,
                    "drafter": drafter,
                    "decode_tokens_per_sec": v["timing"]["decode_tokens_per_sec"],
                    "generated": generated,
                    "decode_passes": passes,
                    "ids_per_pass": (generated.saturating_sub(1)) as f64 / passes.max(1) as f64,
                    "acceptance": v["speculation"]["acceptance"],
                    "drafted": v["speculation"]["drafted"],
                    "accepted": v["speculation"]["accepted"],
                    "stopped": v["speculation"]["stopped"],
                    "device_read_per_id": read.map(|b| b as f64 / generated.saturating_sub(1).max(1) as f64),
                    "same_ids_as_plain": same,
                    "peak_bytes": r.1,
                    "memory_budget": v["memory_budget"]["bytes"],
                }));
            }
        }
    }
    // Each run against the plain run of its placement and prompt.
    for i in 0..runs.len() {
        let plain = runs
            .iter()
            .find(|p| {
                p["placement"] == runs[i]["placement"]
                    && p["prompt"] == runs[i]["prompt"]
                    && p["drafter"] == "none"
            })
            .and_then(|p| p["decode_tokens_per_sec"].as_f64());
        let this = runs[i]["decode_tokens_per_sec"].as_f64();
        runs[i]["speedup"] = json!(plain.zip(this).map(|(p, t)| t / p.max(1e-9)));
    }
    let report = json!({
        "model": dir.display().to_string(),
        "model_bytes": model_bytes,
        "draft": draft.as_ref().map(|d| d.display().to_string()),
        "draft_bytes": draft_bytes,
        "budget": budget,
        "ceiling": match &ceiling {
            Ok(_) => json!({"ok": true}),
            Err(why) => json!({"ok": false, "why": why}),
        },
        "max_new_tokens": a.max_new_tokens,
        "max_draft": a.max_draft,
        "runs": runs,
    });
    if a.json {
        vpaged::outln!("{report}")?;
        return Ok(());
    }
    print_report(&report)
}

/// A child's `--json` report (its last stdout line), and the cgroup's peak.
struct Report(Value, Option<u64>);

impl Report {
    fn with_peak(self, peak: Option<u64>) -> Report {
        Report(self.0, peak)
    }
}

fn child_report(out: &std::process::Output, args: &[String]) -> Result<Report> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or("");
    match serde_json::from_str::<Value>(line) {
        Ok(v) if out.status.success() => Ok(Report(v, None)),
        _ => bail!(
            "voom {} failed ({}): {}",
            args.iter()
                .filter(|a| !a.contains('\n'))
                .cloned()
                .collect::<Vec<_>>()
                .join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        ),
    }
}

fn print_report(r: &Value) -> Result<()> {
    let b = |k: &Value| human(k.as_u64().unwrap_or(0));
    vpaged::outln!(
        "model {} ({}); draft {} ({}); out-of-core ceiling {}; up to {} ids, drafts of up to {}",
        Path::new(r["model"].as_str().unwrap_or("")).display(),
        b(&r["model_bytes"]),
        r["draft"].as_str().unwrap_or("none"),
        b(&r["draft_bytes"]),
        b(&r["budget"]),
        r["max_new_tokens"],
        r["max_draft"]
    )?;
    vpaged::outln!(
        "  {:<12} {:<6} {:<14} {:>8} {:>8} {:>6} {:>8} {:>9} {:>12} {:>10} {:>9}",
        "placement",
        "prompt",
        "drafter",
        "tok/s",
        "speedup",
        "ids",
        "passes",
        "ids/pass",
        "acceptance",
        "read/id",
        "same ids"
    )?;
    for run in r["runs"].as_array().into_iter().flatten() {
        if let Some(e) = run["error"].as_str() {
            vpaged::outln!(
                "  {:<12} {:<6} {:<14} did not run: {e}",
                run["placement"].as_str().unwrap_or(""),
                run["prompt"].as_str().unwrap_or(""),
                run["drafter"].as_str().unwrap_or("")
            )?;
            continue;
        }
        let f = |k: &str, p: usize| {
            run[k]
                .as_f64()
                .map_or("-".to_string(), |x| format!("{x:.p$}"))
        };
        vpaged::outln!(
            "  {:<12} {:<6} {:<14} {:>8} {:>8} {:>6} {:>8} {:>9} {:>12} {:>10} {:>9}",
            run["placement"].as_str().unwrap_or(""),
            run["prompt"].as_str().unwrap_or(""),
            run["drafter"].as_str().unwrap_or(""),
            f("decode_tokens_per_sec", 2),
            f("speedup", 2),
            run["generated"].as_u64().unwrap_or(0),
            run["decode_passes"].as_u64().unwrap_or(0),
            f("ids_per_pass", 2),
            f("acceptance", 2),
            run["device_read_per_id"]
                .as_f64()
                .map_or("-".into(), |x| human(x as u64)),
            if run["same_ids_as_plain"] == true {
                "yes"
            } else {
                "NO"
            }
        )?;
        if let Some(why) = run["stopped"].as_str() {
            vpaged::outln!("      drafting stopped: {why}")?;
        }
    }
    // The issue's targets, against this run's figures.
    let find = |placement: &str, prompt: &str, drafter: &str| {
        r["runs"].as_array().into_iter().flatten().find(|x| {
            x["placement"] == placement && x["prompt"] == prompt && x["drafter"] == drafter
        })
    };
    if let Some(x) = find("out-of-core", "edit", "prompt-lookup") {
        if let Some(v) = x["ids_per_pass"].as_f64() {
            vpaged::outln!(
                "  target: out of core, prompt lookup on the edit commits at least 3 ids a sweep: {v:.2} ({})",
                if v >= 3.0 { "met" } else { "not met" }
            )?;
        }
    }
    for placement in ["out-of-core", "resident"] {
        for prompt in ["edit", "free"] {
            if let Some(v) =
                find(placement, prompt, "draft-model").and_then(|x| x["speedup"].as_f64())
            {
                vpaged::outln!(
                    "  target: a draft model of the same family at least doubles tokens/s ({placement}, {prompt}): {v:.2}x ({})",
                    if v >= 2.0 { "met" } else { "not met" }
                )?;
            }
        }
    }
    Ok(())
}
