//! `vpagectl expert-plan TRACE`: a routing trace replayed through expert caches of
//! several sizes under each policy.

use std::process::Command;

use vpaged::expert_trace::{Trace, TraceHeader, TracePass, TRACE_VERSION};

fn ctl(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_vpagectl"))
        .args(args)
        .output()
        .unwrap()
}

/// Two layers of 16 experts, 2 per token: a prompt pass, then decode passes whose
/// picks favour a few experts (as trained routers do).
fn trace() -> Trace {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut pick = |n: usize| -> Vec<u32> {
        let mut v = Vec::new();
        while v.len() < n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let e = ((x % 256) as f64).sqrt() as u32; // 0..16, skewed to the top
            if !v.contains(&e) {
                v.push(e);
            }
        }
        v.sort_unstable();
        v
    };
    let mut passes = vec![TracePass {
        positions: 6,
        experts: vec![pick(9), pick(7)],
    }];
    for _ in 0..60 {
        passes.push(TracePass {
            positions: 1,
            experts: vec![pick(2), pick(2)],
        });
    }
    Trace {
        header: TraceHeader {
            voom_expert_trace: TRACE_VERSION,
            model: "synthetic".into(),
            num_experts: 16,
            top_k: 2,
            layers: vec![0, 1],
            expert_bytes: vec![1 << 20, 1 << 20],
        },
        passes,
    }
}

#[test]
fn expert_plan_scores_every_policy_and_size_against_the_bound() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("t.trace");
    let mut f = std::fs::File::create(&path).unwrap();
    trace().write(&mut f).unwrap();
    let o = ctl(&[
        "expert-plan",
        path.to_str().unwrap(),
        "--cache",
        "4MiB,8MiB",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["passes"], 61);
    assert_eq!(r["fitted_passes"], 30);
    // Two experts of 1 MiB in each of two layers per token, without a cache.
    assert_eq!(
        r["routed_bytes_per_token"].as_f64().unwrap(),
        4.0 * (1 << 20) as f64
    );
    let replays = r["replays"].as_array().unwrap();
    assert_eq!(replays.len(), 10);
    for size in [4u64 << 20, 8 << 20] {
        let of = |p: &str| {
            replays
                .iter()
                .find(|x| x["policy"] == p && x["cache_bytes"] == size)
                .unwrap()["bytes_per_token"]
                .as_f64()
                .unwrap()
        };
        for p in ["lru", "lfu-admit", "tinylfu", "static"] {
            assert!(of("belady") <= of(p), "{p} below the bound at {size}");
        }
        assert!(of("belady") < 4.0 * (1 << 20) as f64);
    }
    // The misses of lfu-admit as coalesced reads, in the checkpoint's order and a
    // fitted one: the same bytes; at least one read per two experts missed together.
    let layouts = r["layouts"].as_array().unwrap();
    assert_eq!(layouts.len(), 4);
    for size in [4u64 << 20, 8 << 20] {
        let of = |l: &str| {
            layouts
                .iter()
                .find(|x| x["layout"] == l && x["cache_bytes"] == size)
                .unwrap()
        };
        let (c, f) = (of("checkpoint"), of("fitted"));
        assert_eq!(c["bytes_per_token"], f["bytes_per_token"]);
        let lfu = replays
            .iter()
            .find(|x| x["policy"] == "lfu-admit" && x["cache_bytes"] == size)
            .unwrap();
        assert_eq!(c["bytes_per_token"], lfu["bytes_per_token"]);
        for x in [c, f] {
            let reads = x["reads_per_token"].as_f64().unwrap();
            assert!(reads > 0.0 && reads <= 4.0, "{x}");
        }
    }
    // Text too.
    let o = ctl(&["expert-plan", path.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && text.contains("belady") && text.contains("fitted"),
        "{text}"
    );

    // Errors name what is wrong.
    let o = ctl(&["expert-plan", path.to_str().unwrap(), "--fit", "1"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--fit 1"));
    std::fs::write(&path, "{\"voom_expert_trace\":1}\n").unwrap();
    let o = ctl(&["expert-plan", path.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("line 1") && e.contains("t.trace"), "{e}");
}
