//! `voom profiles list|show`: the runtime profiles and how a run resolves one.

use anyhow::Result;
use clap::{Args, Subcommand};

use super::common::EngineArgs;
use crate::profile::{self, Resolved};

#[derive(Args, Debug)]
pub struct ProfilesArgs {
    #[command(subcommand)]
    pub command: ProfilesCommand,
}

#[derive(Subcommand, Debug)]
pub enum ProfilesCommand {
    /// List the profiles: name, what it inherits, the first line of its notes.
    List(ListArgs),
    /// Show a profile's resolved settings and where each value came from
    /// (flag, environment, profile file or built-in default).
    Show(Box<ShowArgs>),
}

#[derive(Args, Debug)]
pub struct ListArgs {
    /// Print one JSON array.
    #[arg(long)]
    pub json: bool,
    /// Directory of profiles (default: $VOOM_HOME/profiles when it exists).
    #[arg(long, env = "VOOM_PROFILES_DIR")]
    pub profiles_dir: Option<std::path::PathBuf>,
}

#[derive(Args, Debug)]
pub struct ShowArgs {
    /// Profile name or YAML path (default: --profile / VOOM_PROFILE, else "default").
    pub name: Option<String>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// The engine flags to resolve against, as `voom run` takes them.
    #[command(flatten)]
    pub engine: EngineArgs,
}

pub fn run(a: ProfilesArgs) -> Result<()> {
    match a.command {
        ProfilesCommand::List(l) => list(l),
        ProfilesCommand::Show(s) => show(*s),
    }
}

fn list(a: ListArgs) -> Result<()> {
    let home = crate::store::voom_home().ok().map(|h| h.join("profiles"));
    let dirs = profile::ProfileDirs::new(a.profiles_dir, home)?;
    let all = dirs.list()?;
    if a.json {
        let v: Vec<serde_json::Value> = all
            .iter()
            .map(|l| {
                serde_json::json!({
                    "name": l.name,
                    "inherits": l.inherits,
                    "notes": l.notes,
                    "origin": l.origin.to_string(),
                })
            })
            .collect();
        vpaged::outln!("{}", serde_json::Value::Array(v))?;
        return Ok(());
    }
    let width = all.iter().map(|l| l.name.len()).max().unwrap_or(4).max(4);
    vpaged::outln!("{:width$}  {:10}  NOTES", "NAME", "INHERITS")?;
    for l in &all {
        vpaged::outln!(
            "{:width$}  {:10}  {}",
            l.name,
            l.inherits.as_deref().unwrap_or("-"),
            l.summary()
        )?;
    }
    if let Some(d) = dirs.dir() {
        vpaged::outln!("(profiles from {} and the built-in ones)", d.display())?;
    }
    Ok(())
}

fn show(mut a: ShowArgs) -> Result<()> {
    if let Some(n) = a.name.take() {
        a.engine.profile = n;
    }
    let r = a.engine.resolve()?;
    if a.json {
        vpaged::outln!("{}", r.to_json())?;
    } else {
        print_text(&r)?;
    }
    Ok(())
}

fn print_text(r: &Resolved) -> std::io::Result<()> {
    vpaged::outln!(
        "profile {} ({}), digest {}, exact",
        r.name,
        r.origin,
        r.digest
    )?;
    if r.chain.len() > 1 {
        vpaged::outln!("inherits: {}", r.chain.join(" <- "))?;
    }
    if let Some(n) = &r.notes {
        vpaged::outln!("notes: {}", n.trim())?;
    }
    let s = &r.settings;
    let size = |v: Option<u64>| v.map_or("none".to_string(), profile::format_size);
    let opt = |v: Option<String>| v.unwrap_or_else(|| "none".to_string());
    let rows: Vec<(&str, String)> = vec![
        ("memory_budget", size(s.memory_budget)),
        ("memory_mapped", s.memory_mapped.to_string()),
        ("cache_budget", size(s.cache_budget)),
        (
            "fast_tier",
            opt(s.fast_tier.as_ref().map(|p| p.display().to_string())),
        ),
        ("fast_tier_size", size(s.fast_tier_size)),
        ("pin_first_layers", s.pin_first_layers.to_string()),
        ("pin_last_layers", s.pin_last_layers.to_string()),
        ("prefetch_depth", s.prefetch_depth.to_string()),
        ("read_threads", s.read_threads.to_string()),
        ("read_piece", profile::format_size(s.read_piece)),
        ("read_ahead_layers", s.read_ahead_layers.to_string()),
        ("expert_prefetch", s.expert_prefetch.to_string()),
        ("kv_budget", size(s.kv_budget)),
        ("max_context", opt(s.max_context.map(|v| v.to_string()))),
        ("threads", s.threads.to_string()),
        ("backend", s.backend.clone()),
        ("verify", s.verify.as_str().to_string()),
        (
            "sampling.temperature",
            opt(s.sampling.temperature.map(|v| v.to_string())),
        ),
        (
            "sampling.top_p",
            opt(s.sampling.top_p.map(|v| v.to_string())),
        ),
        (
            "sampling.top_k",
            opt(s.sampling.top_k.map(|v| v.to_string())),
        ),
    ];
    for (k, v) in rows {
        let src = r.sources.get(k).map(|s| s.to_string()).unwrap_or_default();
        vpaged::outln!("  {k:22} {v:12} {src}")?;
    }
    Ok(())
}
