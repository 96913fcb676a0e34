//! `voom run MODEL [PROMPT]`: answer one prompt, or chat interactively.

use std::io::{BufRead, Write};

use anyhow::Result;
use clap::Args;

use super::common::{self, EngineArgs, SamplingArgs, SpecArgs};

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Model directory or name in the local store (known models are pulled if missing).
    pub model: String,
    /// The prompt; without one, an interactive chat starts.
    pub prompt: Option<String>,
    /// A system message.
    #[arg(long)]
    pub system: Option<String>,
    /// Print one JSON object instead of streaming text (with a prompt).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

pub fn run(a: RunArgs) -> Result<()> {
    let dir = common::resolve_model(&a.model, true)?;
    let engine = common::open_engine(&dir, &a.engine)?;
    let mut params = a.sampling.params();
    a.spec.apply(&mut params);
    let spec = a.spec.open(&engine, &a.engine)?;
    let mut messages = Vec::new();
    if let Some(s) = &a.system {
        messages.push(serde_json::json!({"role": "system", "content": s}));
    }
    let has_template = engine
        .tokenizer()
        .is_some_and(|t| t.chat_template().is_some());
    if let Some(p) = &a.prompt {
        let ids = if has_template {
            messages.push(serde_json::json!({"role": "user", "content": p}));
            common::chat_ids(&engine, &messages)?
        } else {
            common::text_ids(&engine, p)?
        };
        let (g, text) =
            common::generate_streaming(&engine, &ids, &params, &spec, !a.json, &mut || {})?;
        engine.flush_prefixes();
        if a.json {
            vpaged::outln!("{}", common::result_json(&engine, &ids, &g, &text))?;
        }
        return Ok(());
    }
    // Interactive chat.
    eprintln!(
        "voom: chatting with {} (exact, {}). Ctrl-D to quit.",
        engine.name(),
        engine.source().describe()
    );
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        eprint!(">>> ");
        std::io::stderr().flush().ok();
        let Some(line) = lines.next() else {
            eprintln!();
            break;
        };
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        messages.push(serde_json::json!({"role": "user", "content": line}));
        let ids = if has_template {
            common::chat_ids(&engine, &messages)?
        } else {
            common::text_ids(&engine, &line)?
        };
        match common::generate_streaming(&engine, &ids, &params, &spec, true, &mut || {}) {
            Ok((_, text)) => {
                messages.push(serde_json::json!({"role": "assistant", "content": text}))
            }
            Err(e) => {
                eprintln!("voom: error: {e:#}");
                messages.pop();
            }
        }
    }
    engine.flush_prefixes();
    Ok(())
}
