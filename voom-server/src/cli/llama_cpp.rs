//! llama.cpp as the speed reference of `voom bench` (`--llama-bench`): its
//! `llama-bench` run on the same model (a GGUF of the same weights), the same
//! prompt length, decode length and threads, in the same runs as vOOM's, so that
//! the machine's drift falls on both alike.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// `llama-bench` and the GGUF it runs.
#[derive(Debug, Clone)]
pub struct LlamaBench {
    pub binary: PathBuf,
    pub gguf: PathBuf,
}

/// One run's figures, tokens per second: prompt processing of the prompt, and
/// decode after a context of the prompt's length (as vOOM decodes after its prompt).
#[derive(Debug, Clone, Copy)]
pub struct Figures {
    pub prefill: f64,
    pub decode: f64,
}

impl LlamaBench {
    /// Checks both files exist.
    pub fn new(binary: &Path, gguf: Option<&Path>) -> Result<Self> {
        let Some(gguf) = gguf else {
            bail!("--llama-bench needs --llama-gguf: the same model as a GGUF file");
        };
        for (what, p) in [("--llama-bench", binary), ("--llama-gguf", gguf)] {
            if !p.is_file() {
                bail!("{what} {}: no such file", p.display());
            }
        }
        Ok(LlamaBench {
            binary: binary.to_path_buf(),
            gguf: gguf.to_path_buf(),
        })
    }

    /// One run of `prompt` tokens of prompt processing and `decode` tokens of
    /// generation at a depth of `prompt` tokens, on `threads` threads.
    pub fn run(&self, prompt: usize, decode: usize, threads: usize) -> Result<Figures> {
        let json = |args: &[String]| -> Result<Vec<Value>> {
            let out = Command::new(&self.binary)
                .arg("-m")
                .arg(&self.gguf)
                .args(args)
                .args(["-t", &threads.to_string(), "-r", "1", "-o", "json"])
                .output()
                .with_context(|| format!("running {}", self.binary.display()))?;
            if !out.status.success() {
                bail!(
                    "{} {args:?} failed: {}",
                    self.binary.display(),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            serde_json::from_slice(&out.stdout)
                .with_context(|| format!("{} printed no JSON list", self.binary.display()))
        };
        let rate = |rows: &[Value], what: &str| -> Result<f64> {
            rows.first()
                .and_then(|r| r["avg_ts"].as_f64())
                .with_context(|| format!("llama-bench gave no {what} rate"))
        };
        let pp = json(&["-p".into(), prompt.to_string(), "-n".into(), "0".into()])?;
        let tg = json(&[
            "-p".into(),
            "0".into(),
            "-n".into(),
            decode.to_string(),
            "-d".into(),
            prompt.to_string(),
        ])?;
        Ok(Figures {
            prefill: rate(&pp, "prompt-processing")?,
            decode: rate(&tg, "generation")?,
        })
    }
}
