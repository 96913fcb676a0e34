//! `voom generate`: one generation with full control over the prompt and sampling.

use anyhow::{bail, Context, Result};
use clap::Args;

use super::common::{self, EngineArgs, SamplingArgs, SpecArgs};

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Model directory or name in the local store.
    #[arg(long)]
    pub model: String,
    /// A raw text prompt (tokenized with the model's special tokens).
    #[arg(long, conflicts_with_all = ["prompt_ids", "chat"])]
    pub prompt: Option<String>,
    /// A prompt given as comma-separated token ids.
    #[arg(long, conflicts_with = "chat")]
    pub prompt_ids: Option<String>,
    /// A user message, rendered with the model's chat template.
    #[arg(long)]
    pub chat: Option<String>,
    /// A system message for --chat.
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Print one JSON object (ids, text, timing) as the last line instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Record which routed experts each forward pass reads (a mixture of experts) and
    /// write the trace to FILE (JSON lines; `vpagectl expert-plan FILE` replays it).
    #[arg(long, value_name = "FILE")]
    pub expert_trace: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>()
                .with_context(|| format!("--prompt-ids: '{t}' is not a token id"))
        })
        .collect()
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let dir = common::resolve_model(&a.model, false)?;
    let engine = common::open_engine(&dir, &a.engine)?;
    let ids = if let Some(s) = &a.prompt_ids {
        parse_ids(s)?
    } else if let Some(p) = &a.prompt {
        common::text_ids(&engine, p)?
    } else if let Some(c) = &a.chat {
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(serde_json::json!({"role": "system", "content": s}));
        }
        msgs.push(serde_json::json!({"role": "user", "content": c}));
        common::chat_ids(&engine, &msgs)?
    } else {
        bail!("give one of --prompt, --prompt-ids or --chat");
    };
    if ids.is_empty() {
        bail!("the prompt is empty");
    }
    let mut params = a.sampling.params();
    a.spec.apply(&mut params);
    let spec = a.spec.open(&engine, &a.engine)?;
    if let Some(path) = &a.expert_trace {
        if engine.config().moe.is_none() {
            bail!(
                "--expert-trace: {} has no routed experts (model_type {})",
                engine.name(),
                engine.config().arch.name()
            );
        }
        // Created before generating, so that a path that cannot be written fails first.
        std::fs::File::create(path)
            .with_context(|| format!("--expert-trace: creating {}", path.display()))?;
        engine.record_expert_trace();
    }
    // With --json, what the block device holding the model did over decode (from the
    // first id sampled to the last, as `decode_secs` counts), where it can be read:
    // bytes, requests and the time it was busy, other processes' I/O included.
    let device = a.json.then(|| crate::blockdev::Device::of(&dir)).flatten();
    let mut at_decode = None;
    let mut mark = || {
        if at_decode.is_none() {
            at_decode = device.as_ref().and_then(|d| d.read());
        }
    };
    // A chat to a harmony model (gpt-oss) is read as reasoning and answer.
    let harmony = a.chat.is_some() && common::is_harmony(&engine);
    let (g, reply) =
        common::generate_streaming(&engine, &ids, &params, &spec, !a.json, harmony, &mut mark)?;
    // A long prompt's snapshot is written before the process ends.
    engine.flush_prefixes();
    if let (Some(path), Some(trace)) = (&a.expert_trace, engine.take_expert_trace()) {
        let mut f = std::io::BufWriter::new(
            std::fs::File::create(path)
                .with_context(|| format!("--expert-trace: creating {}", path.display()))?,
        );
        trace
            .write(&mut f)
            .with_context(|| format!("--expert-trace: writing {}", path.display()))?;
    }
    if a.json {
        let mut out = common::result_json(&engine, &ids, &g, &reply);
        let decode = device
            .as_ref()
            .and_then(|d| Some((d, d.read()?.since(&at_decode?))));
        out["decode_device"] = match decode {
            Some((d, act)) => serde_json::json!({
                "name": d.name(),
                "bytes_read": act.bytes,
                "read_requests": act.reads,
                "busy_secs": act.busy.as_secs_f64(),
            }),
            None => serde_json::Value::Null,
        };
        vpaged::outln!("{out}")?;
    } else {
        let spec = g.speculation.as_ref().map_or(String::new(), |r| {
            format!(
                "; {}: {}/{} proposals kept, {} passes for {} ids",
                r.drafter,
                r.accepted,
                r.drafted,
                r.passes,
                g.ids.len().saturating_sub(1)
            )
        });
        if let Some(s) = engine.lossy_scheme() {
            eprintln!("[lossy: {s} weights, not the published ones]");
        }
        if let Some(note) = &g.exactness_note {
            eprintln!("[{note}]");
        }
        eprintln!(
            "[{}: {} prompt tokens, {:.1} tok/s prefill; {} generated, {:.1} tok/s decode; {}{spec}]",
            g.backend,
            g.prompt_tokens,
            g.prefill_tokens_per_sec(),
            g.ids.len(),
            g.decode_tokens_per_sec(),
            g.finish.as_str()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_parse_and_errors_name_the_bad_one() {
        assert_eq!(parse_ids("1, 2,3").unwrap(), vec![1, 2, 3]);
        let e = parse_ids("1,x").unwrap_err().to_string();
        assert!(e.contains("'x'"), "{e}");
    }
}
