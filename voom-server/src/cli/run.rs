//! `voom run MODEL [PROMPT]`: answer one prompt, or chat interactively.

use std::io::{BufRead, Read, Write};

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
    // A harmony model (gpt-oss): its reasoning is shown apart from its answer.
    let harmony = has_template && common::is_harmony(&engine);
    if let Some(p) = &a.prompt {
        let ids = if has_template {
            messages.push(serde_json::json!({"role": "user", "content": p}));
            common::chat_ids(&engine, &messages)?
        } else {
            common::text_ids(&engine, p)?
        };
        let (g, reply) = common::generate_streaming(
            &engine,
            &ids,
            &params,
            &spec,
            !a.json,
            harmony,
            &mut || {},
        )?;
        engine.flush_prefixes();
        if a.json {
            vpaged::outln!("{}", common::result_json(&engine, &ids, &g, &reply))?;
        }
        return Ok(());
    }
    // Interactive chat.
    let exactness = match engine.lossy_scheme() {
        Some(s) => format!("LOSSY: {s} weights"),
        None => "exact".to_string(),
    };
    eprintln!(
        "voom: chatting with {} ({exactness}, {}). Ctrl-D to quit.",
        engine.name(),
        engine.source().describe()
    );
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    loop {
        eprint!(">>> ");
        std::io::stderr().flush().ok();
        let Some(line) = read_line(&mut input, MAX_LINE_BYTES)? else {
            eprintln!();
            break;
        };
        if line.trim().is_empty() {
            continue;
        }
        messages.push(serde_json::json!({"role": "user", "content": line}));
        let ids = if has_template {
            common::chat_ids(&engine, &messages)?
        } else {
            common::text_ids(&engine, &line)?
        };
        match common::generate_streaming(&engine, &ids, &params, &spec, true, harmony, &mut || {}) {
            // (A template drops earlier turns' reasoning; gpt-oss's does.)
            Ok((_, reply)) => {
                messages.push(serde_json::json!({"role": "assistant", "content": reply.text}))
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

/// The longest message line read from standard input (a whole context of text is
/// far less).
const MAX_LINE_BYTES: u64 = 16 << 20;

/// One line of `input` without its newline, of at most `limit` bytes (more is an
/// error: standard input may be `/dev/zero`); `None` at the end.
fn read_line(input: &mut impl BufRead, limit: u64) -> Result<Option<String>> {
    let mut buf = Vec::new();
    let n = input.by_ref().take(limit + 1).read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    } else if buf.len() as u64 > limit {
        anyhow::bail!("a line of standard input is longer than {limit} bytes");
    }
    Ok(Some(String::from_utf8(buf).map_err(|e| {
        anyhow::anyhow!("standard input is not UTF-8: {e}")
    })?))
}

#[cfg(test)]
mod tests {
    #[test]
    fn lines_are_bounded() {
        let mut input: &[u8] = b"hi\n\nthere";
        assert_eq!(
            super::read_line(&mut input, 8).unwrap().as_deref(),
            Some("hi")
        );
        assert_eq!(
            super::read_line(&mut input, 8).unwrap().as_deref(),
            Some("")
        );
        assert_eq!(
            super::read_line(&mut input, 8).unwrap().as_deref(),
            Some("there")
        );
        assert_eq!(super::read_line(&mut input, 8).unwrap(), None);
        let zeros = vec![0u8; 100];
        let e = super::read_line(&mut zeros.as_slice(), 8).unwrap_err();
        assert!(e.to_string().contains("longer than 8 bytes"), "{e}");
    }
}
