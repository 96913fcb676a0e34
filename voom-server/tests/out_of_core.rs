//! A model larger than a real memory ceiling (a memory cgroup, where this machine
//! lets the test make one) completes with transformers' ids and is not killed, by
//! default, on the memory-mapped store, on a page cache of a given size and on the
//! one the memory planner sizes for the ceiling; the cgroup's peak (private memory
//! and page cache) stays within the ceiling.

use std::path::Path;

use serde_json::Value;
use voom_server::cgroup::Ceiling;

mod common;

fn reference() -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/smollm2/reference.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

#[test]
fn a_model_larger_than_its_memory_cgroup_gives_transformers_ids_and_is_not_killed() {
    let Some(dir) = common::smollm2() else { return };
    let model_bytes = std::fs::metadata(dir.join("model.safetensors"))
        .unwrap()
        .len();
    const LIMIT: u64 = 200 << 20;
    assert!(
        model_bytes > LIMIT,
        "the model must be larger than the ceiling"
    );
    let ceiling = match Ceiling::create(LIMIT) {
        Ok(c) => c,
        Err(why) => {
            eprintln!("skipping: no memory cgroup can be made here: {why}");
            return;
        }
    };
    let r = reference();
    let case = &r["results"][1];
    let prompt: Vec<String> = ids(&case["prompt_ids"])
        .iter()
        .map(|i| i.to_string())
        .collect();
    let want: Vec<u64> = ids(&case["output_ids"])[..12].to_vec();
    let budget = LIMIT.to_string();
    for extra in [
        // The default: the memory the cgroup leaves is the budget.
        vec![],
        vec!["--memory-mapped"],
        vec!["--cache-budget", "96MiB"],
        // The memory planner at the ceiling (fewer readers: smaller read buffers).
        vec![
            "--memory-budget",
            budget.as_str(),
            "--max-context",
            "128",
            "--read-threads",
            "4",
        ],
    ] {
        let mut args: Vec<String> = vec![
            "generate".into(),
            "--model".into(),
            dir.display().to_string(),
            "--prompt-ids".into(),
            prompt.join(","),
            "--max-new-tokens".into(),
            want.len().to_string(),
            "--threads".into(),
            "2".into(),
            "--json".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        ceiling.reset_peak();
        let kills = ceiling.oom_kills();
        let o = ceiling
            .command(Path::new(env!("CARGO_BIN_EXE_voom")), &args)
            .env_remove("VOOM_THREADS")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{extra:?}: {} {err}", o.status);
        assert_eq!(ceiling.oom_kills(), kills, "{extra:?}: killed for memory");
        let out = String::from_utf8_lossy(&o.stdout);
        let j: Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
        assert_eq!(
            ids(&j["ids"]),
            want,
            "{extra:?}: greedy ids under the ceiling"
        );
        if extra.first() == Some(&"--memory-budget") {
            let plan = &j["memory_budget"];
            assert_eq!(plan["store"], "page cache", "{plan}");
            assert!(
                plan["streamed_bytes_per_token"].as_u64().unwrap() > 0,
                "{plan}"
            );
        }
        if let Some(peak) = ceiling.peak() {
            assert!(
                peak <= LIMIT,
                "{extra:?}: peak {peak} over the ceiling {LIMIT}"
            );
        }
    }
}
