//! The memory governor under a real memory cgroup squeezed mid-run: `voom generate`
//! of a long prompt keeps going while the cgroup's limit is lowered below what its
//! KV cache takes, spills KV pages to disk instead of being killed, and gives the
//! ids of an unconstrained run; with the weights in an in-process page cache, the
//! cache's spare room is taken back, then its pins (the weights stream).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use voom_server::cgroup::{Ceiling, Version};

const START: u64 = 1 << 30;

fn ids(j: &Value) -> Vec<u64> {
    j["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect()
}

#[test]
fn a_cgroup_squeezed_mid_run_spills_kv_and_keeps_the_ids() {
    let Some(got) = squeezed(&[], 180 << 20) else {
        return;
    };
    let written = got["kv"]["written_bytes"].as_u64().unwrap();
    assert!(written > 0, "nothing spilled: {}", got["kv"]);
}

#[test]
fn a_process_squeezed_below_its_pins_unpins_weights_last() {
    // SmolLM2's 269 MB of weights in a 300 MiB in-process page cache (the planner
    // pins them: they fit), squeezed below what the pinned weights alone take
    // beside the process. The cache's spare room goes back to the OS, KV spills,
    // then the weight budget is placed again, smaller, between passes: pages it no
    // longer pins stream (read once a pass), and the run lives with the same ids.
    let Some(got) = squeezed(&["--cache-budget", "300MiB"], 230 << 20) else {
        return;
    };
    let (g, w) = (&got["governor"], &got["weight_budget"]);
    eprintln!(
        "governor: {g}; weight budget: {w}; page cache: {}; kv: {}",
        got["page_cache_room"], got["kv"]
    );
    assert_eq!(
        got["page_cache_room"]["capacity_bytes"].as_u64(),
        Some(300 << 20),
        "{}",
        got["page_cache_room"]
    );
    assert!(
        got["page_cache_room"]["withheld_bytes"].as_u64().unwrap() > 0,
        "the page cache gave nothing back: {}",
        got["page_cache_room"]
    );
    let released = g["most_pins_released_bytes"].as_u64().unwrap();
    assert!(released > 0, "no pin was given up: {g} {w}");
    assert!(
        w["taken_bytes"].as_u64().unwrap() > 0,
        "the weight budget is as configured: {w}"
    );
    // KV goes before pins.
    assert!(
        got["kv"]["written_bytes"].as_u64().unwrap() > 0,
        "{}",
        got["kv"]
    );
}

/// Runs `voom generate` of a 3000-token prompt (with `extra` arguments) unbounded,
/// then in a memory cgroup lowered from [`START`] to `squeezed` while the prompt is
/// computed; checks that the squeezed run lives and gives the same ids, and returns
/// its `--json` output (`None`: skipped, or the run ended before the squeeze did).
fn squeezed(extra: &[&str], squeezed: u64) -> Option<Value> {
    let dir = common::smollm2()?;
    let ceiling = match Ceiling::create(START) {
        Ok(c) => c,
        Err(why) => {
            eprintln!("skipping: no memory cgroup can be made here: {why}");
            return None;
        }
    };
    let home = tempfile::tempdir().unwrap();
    // 3000 positions of SmolLM2: 138 MB of KV, more than the squeezed limit leaves.
    let prompt: Vec<String> = (0..3000u64)
        .map(|i| (1000 + (i * 7919) % 40000).to_string())
        .collect();
    let args: Vec<String> = [
        "generate",
        "--model",
        &dir.display().to_string(),
        "--prompt-ids",
        &prompt.join(","),
        "--max-new-tokens",
        "8",
        "--ignore-eos",
        "--threads",
        "2",
        "--json",
        "--prefix-cache",
        "0",
        "--prefix-disk",
        "0",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect();
    let run = |mut c: std::process::Command| {
        c.env("VOOM_HOME", home.path()).env_remove("VOOM_THREADS");
        c
    };
    let free = run(std::process::Command::new(env!("CARGO_BIN_EXE_voom")))
        .args(&args)
        .output()
        .unwrap();
    assert!(
        free.status.success(),
        "{}",
        String::from_utf8_lossy(&free.stderr)
    );
    let want: Value = serde_json::from_str(
        String::from_utf8_lossy(&free.stdout)
            .lines()
            .last()
            .unwrap(),
    )
    .unwrap();

    let kills = ceiling.oom_kills();
    let mut child = run(ceiling.command(Path::new(env!("CARGO_BIN_EXE_voom")), &args))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Squeeze while the prompt is computed: 16 MiB at a time (v1 refuses a limit
    // below what it cannot reclaim yet: try again).
    let limit_file = ceiling.dir().join(match ceiling.version() {
        Version::V1 => "memory.limit_in_bytes",
        Version::V2 => "memory.max",
    });
    std::thread::sleep(Duration::from_secs(3));
    let mut limit = START;
    let t = Instant::now();
    while limit > squeezed && t.elapsed() < Duration::from_secs(240) {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        let next = (limit - (16 << 20)).max(squeezed);
        if std::fs::write(&limit_file, next.to_string()).is_ok() {
            limit = next;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{}: {err}", o.status);
    assert_eq!(ceiling.oom_kills(), kills, "killed for memory");
    let got: Value =
        serde_json::from_str(String::from_utf8_lossy(&o.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(ids(&got), ids(&want), "ids under the squeezed cgroup");
    if limit > squeezed {
        eprintln!("note: the run ended before the limit reached {squeezed} (at {limit})");
        return None;
    }
    Some(got)
}
