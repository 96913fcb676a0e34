//! `voom bench long-context`: decode at depth (8K and 32K positions by default) with
//! a KV budget of a quarter of what the context needs, against the same decode with
//! the KV resident, in one run.
//!
//! The prompt is computed once (resident); both runs decode from the same KV: the
//! resident one from it as it is, the budgeted one from a copy made in an engine
//! with the budget (pages beyond it spill to disk as they would have while the
//! prompt was computed). Their ids must be the same. The physical bound of the
//! budgeted run is the resident run's time per token or the time to read the bytes
//! it read back per token at the spill file's direct-read bandwidth (measured in
//! the same run), whichever is longer.
//!
//! A model whose `max_position_embeddings` is below a context asked for runs from a
//! copy of its directory (weights linked) with that field raised: the arithmetic is
//! the same at every position, and the output says so.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use libvoom::engine::{Engine, EngineOptions};
use libvoom::kv::KvCache;
use serde_json::json;

use super::common;

#[derive(Args, Debug)]
pub struct LongContextBenchArgs {
    /// The model (a directory or a name in the local store; pulled if it is a known
    /// one).
    #[arg(long, default_value = "smollm2-135m-instruct")]
    pub model: String,
    /// Positions of KV before decode, one run each.
    #[arg(long, value_delimiter = ',', default_value = "8192,32768")]
    pub contexts: Vec<usize>,
    /// Tokens decoded per run.
    #[arg(long, default_value_t = 16)]
    pub decode_tokens: usize,
    /// The KV budget as a share of what the context needs.
    #[arg(long, default_value_t = 0.25)]
    pub budget_share: f64,
    /// Where pages spill (default: `$VOOM_HOME/kv`).
    #[arg(long)]
    pub spill_dir: Option<PathBuf>,
    /// Positions per KV page (what spills and is read back at a time).
    #[arg(long, default_value_t = libvoom::kv::DEFAULT_PAGE_POSITIONS)]
    pub kv_page_positions: usize,
    /// Compute threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Print one JSON object with every figure.
    #[arg(long)]
    pub json: bool,
}

/// The target the KV issue sets: budgeted decode over resident decode.
const TARGET_RATIO: f64 = 0.8;

/// `dir`, or a copy of it (weights linked) whose config allows `context` positions.
fn with_context(dir: &Path, context: usize) -> Result<(Option<tempfile::TempDir>, PathBuf)> {
    let cfg = libvoom::config::ModelConfig::from_dir(dir)?;
    if cfg.max_position_embeddings >= context {
        return Ok((None, dir.to_path_buf()));
    }
    let tmp = tempfile::tempdir()?;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let to = tmp.path().join(e.file_name());
        if e.file_name() == "config.json" {
            let mut j: serde_json::Value = serde_json::from_slice(&std::fs::read(e.path())?)?;
            j["max_position_embeddings"] = json!(context);
            std::fs::write(&to, serde_json::to_vec_pretty(&j)?)?;
        } else if e.file_name() != "voom-manifest.json" {
            std::os::unix::fs::symlink(e.path(), &to)?;
        }
    }
    let path = tmp.path().to_path_buf();
    Ok((Some(tmp), path))
}

/// Greedy decode of `n` ids after `first`, one pass each: the ids and seconds.
fn decode(e: &Engine, kv: &mut KvCache, first: u32, n: usize) -> Result<(Vec<u32>, f64)> {
    let mut ids = vec![first];
    let t = Instant::now();
    for _ in 0..n {
        let logits = e.prefill(kv, &[*ids.last().expect("one")])?;
        ids.push(libvoom::sampler::argmax(&logits) as u32);
    }
    Ok((ids, t.elapsed().as_secs_f64()))
}

/// A copy of `kv`'s positions made by `e` (in its KV budget).
fn copy_into(e: &Engine, kv: &KvCache) -> Result<KvCache> {
    let mut out = e.new_kv();
    for l in 0..kv.layers() {
        let view = kv.layer(l)?;
        let mut k = Vec::with_capacity(view.len * view.width);
        let mut v = Vec::with_capacity(k.capacity());
        for (p, off, m) in view.segments(0, view.len) {
            k.extend_from_slice(&view.k[p][off * view.width..(off + m) * view.width]);
            if !view.v.is_empty() {
                v.extend_from_slice(&view.v[p][off * view.width..(off + m) * view.width]);
            }
        }
        out.append(l, &k, &v)?;
    }
    out.commit(kv.ids());
    Ok(out)
}

pub fn run(a: LongContextBenchArgs) -> Result<()> {
    if a.decode_tokens == 0 || !(0.0..1.0).contains(&a.budget_share) {
        bail!("--decode-tokens must be positive and --budget-share in (0, 1)");
    }
    let model = common::resolve_model(&a.model, true)?;
    let spill = match &a.spill_dir {
        Some(d) => d.clone(),
        None => crate::store::voom_home()?.join("kv"),
    };
    let mut rows = Vec::new();
    for &n in &a.contexts {
        let (_tmp, dir) = with_context(&model, n + a.decode_tokens + 1)?;
        let raised = _tmp.is_some();
        let opts = EngineOptions {
            threads: a.threads,
            max_context: Some(n + a.decode_tokens + 1),
            kv_page_positions: a.kv_page_positions.max(1),
            ..EngineOptions::default()
        };
        let resident = Engine::open(&dir, opts.clone())
            .with_context(|| format!("opening {}", dir.display()))?;
        let vocab = resident.config().vocab_size as u64;
        // Ids spread over the vocabulary away from its ends (special tokens).
        let prompt: Vec<u32> = (0..n as u64)
            .map(|i| (vocab / 8 + (i * 7919) % (vocab / 2)) as u32)
            .collect();
        let mut kv = resident.new_kv();
        let t = Instant::now();
        let logits = resident.prefill(&mut kv, &prompt)?;
        let prefill_secs = t.elapsed().as_secs_f64();
        let first = libvoom::sampler::argmax(&logits) as u32;
        let need = kv.bytes();
        let budget = (need as f64 * a.budget_share) as usize;

        let budgeted = Engine::open(
            &dir,
            EngineOptions {
                kv_budget: Some((budget, spill.clone())),
                ..opts
            },
        )?;
        let mut kv_b = copy_into(&budgeted, &kv)?;
        let before = budgeted.kv_pool_stats().expect("a budget");
        let (ids_b, secs_b) = decode(&budgeted, &mut kv_b, first, a.decode_tokens)?;
        let after = budgeted.kv_pool_stats().expect("a budget");
        let (ids_r, secs_r) = decode(&resident, &mut kv.clone(), first, a.decode_tokens)?;
        if ids_b != ids_r {
            bail!("context {n}: the budgeted run's ids differ from the resident run's: {ids_b:?} vs {ids_r:?}");
        }
        // The spill file's direct-read bandwidth, now, in this run.
        let bw = after
            .path
            .as_ref()
            .map(|p| {
                vpaged::direct::read_bandwidth(
                    std::slice::from_ref(p),
                    1 << 30,
                    8 << 20,
                    vpaged::direct::ReadMode::Direct,
                    4,
                )
            })
            .transpose()
            .context("measuring the spill file's read bandwidth")?;
        let tok = a.decode_tokens as f64;
        let read_per_token = (after.read_bytes - before.read_bytes) as f64 / tok;
        let res_tps = tok / secs_r;
        let bud_tps = tok / secs_b;
        let bound_secs = (secs_r / tok).max(bw.map_or(0.0, |b| read_per_token / b.bytes_per_sec()));
        rows.push(json!({
            "context": n,
            "config_raised": raised,
            "kv_bytes": need,
            "kv_budget_bytes": budget,
            "prefill_secs": prefill_secs,
            "resident_tokens_per_sec": res_tps,
            "budgeted_tokens_per_sec": bud_tps,
            "ratio": bud_tps / res_tps,
            "target_ratio": TARGET_RATIO,
            "spilled_bytes": after.spilled_bytes,
            "read_back_bytes_per_token": read_per_token,
            "spill_read_bytes_per_sec": bw.map(|b| b.bytes_per_sec()),
            "bound_tokens_per_sec": 1.0 / bound_secs,
            "of_bound": bud_tps * bound_secs,
            "pages_read_ahead": after.read_ahead - before.read_ahead,
            "pages_stalled": after.stalls - before.stalls,
            "pages_waited": after.waits - before.waits,
            "direct_io": after.direct,
            "ids_equal": true,
        }));
        if !a.json {
            let r = rows.last().expect("pushed");
            println!(
                "context {n}{}: KV {:.0} MiB, budget {:.0} MiB; decode resident {res_tps:.2} tok/s, \
                 budgeted {bud_tps:.2} tok/s: {:.2}x resident (target {TARGET_RATIO}); \
                 read back {:.1} MiB/token at {} -> bound {:.2} tok/s ({:.0}% of it); \
                 pages read ahead {}, stalled {}, waited {}; ids equal",
                if raised { " (config's max_position_embeddings raised)" } else { "" },
                need as f64 / 1048576.0,
                budget as f64 / 1048576.0,
                bud_tps / res_tps,
                read_per_token / 1048576.0,
                bw.map_or("?".into(), |b| format!("{:.2} GB/s", b.bytes_per_sec() / 1e9)),
                r["bound_tokens_per_sec"].as_f64().unwrap_or(0.0),
                100.0 * r["of_bound"].as_f64().unwrap_or(0.0),
                r["pages_read_ahead"],
                r["pages_stalled"],
                r["pages_waited"],
            );
        }
    }
    if a.json {
        println!(
            "{}",
            json!({"model": a.model, "decode_tokens": a.decode_tokens, "runs": rows})
        );
    }
    Ok(())
}
