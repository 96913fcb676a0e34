//! `voom bench`: prefill and decode speed against the memory-bandwidth bound.

use anyhow::Result;
use clap::Args;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model directory or name in the local store.
    #[arg(long)]
    pub model: Option<String>,
}

pub fn run(_a: BenchArgs) -> Result<()> {
    anyhow::bail!("voom bench: not built yet")
}
