//! The `voom` binary end to end: real processes, real files.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;

mod common;

fn voom() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_voom"));
    c.env_remove("VOOM_THREADS").env_remove("VOOM_VERIFY");
    c
}

fn tiny(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/tiny")
        .join(case)
}

fn reference(case: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(tiny(case).join("reference.json")).unwrap())
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn last_json(o: &Output) -> Value {
    let out = stdout(o);
    let line = out
        .lines()
        .last()
        .unwrap_or_else(|| panic!("no output; stderr: {}", stderr(o)));
    serde_json::from_str(line).unwrap_or_else(|e| panic!("last line is not JSON ({e}): {line}"))
}

/// A JSON list of token ids as `--prompt-ids` takes it: `1,2,3`.
fn id_list(v: &Value) -> String {
    let ids: Vec<String> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.to_string())
        .collect();
    ids.join(",")
}

/// A copy of a tiny fixture with its page manifest (the page cache needs one).
fn hashed_copy(case: &str) -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("m");
    copy_dir(&tiny(case), &dir);
    let ckpt = voom_formats::Checkpoint::open(&dir).unwrap();
    voom_formats::Manifest::build(&ckpt, &mut |_, _| {})
        .unwrap()
        .save(&dir)
        .unwrap();
    (d, dir)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn generate_json_gives_transformers_ids() {
    let r = reference("qwen3_qk_norm_eos_list");
    let p = &r["prompts"][2];
    let ids = id_list(&p["prompt_ids"]);
    let o = voom()
        .args(["generate", "--model"])
        .arg(tiny("qwen3_qk_norm_eos_list"))
        .args(["--prompt-ids", &ids, "--max-new-tokens", "32", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let j = last_json(&o);
    assert_eq!(j["ids"], p["generated_ids"]);
    assert_eq!(
        j["finish_reason"],
        if p["stopped_on_eos"].as_bool().unwrap() {
            "stop"
        } else {
            "length"
        }
    );
    assert_eq!(j["profile"], "default");
    assert_eq!(j["exact"], true);
    assert!(j["timing"]["decode_tokens_per_sec"].as_f64().unwrap() >= 0.0);
    // The block device's counters over decode, where the model's directory has a
    // device whose counters can be read (not on overlayfs or tmpfs, not off Linux).
    let dev = &j["decode_device"];
    match voom_server::blockdev::Device::of(&tiny("qwen3_qk_norm_eos_list")) {
        Some(d) => {
            assert_eq!(dev["name"], d.name(), "{dev}");
            for k in ["bytes_read", "read_requests"] {
                assert!(dev[k].is_u64(), "{k}: {dev}");
            }
            assert!(dev["busy_secs"].as_f64().unwrap() >= 0.0, "{dev}");
        }
        None => assert!(dev.is_null(), "{dev}"),
    }
}

#[test]
fn missing_model_is_a_clear_error() {
    let home = tempfile::tempdir().unwrap();
    let o = voom()
        .env("VOOM_HOME", home.path())
        .args(["generate", "--model", "no-such-model", "--prompt-ids", "1"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("no model 'no-such-model'") && e.contains("smollm2-135m-instruct"),
        "{e}"
    );
}

#[test]
fn truncated_checkpoint_names_the_file_and_never_panics() {
    let d = tempfile::tempdir().unwrap();
    copy_dir(&tiny("llama_gqa_untied"), d.path());
    let f = d.path().join("model.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len - 1000)
        .unwrap();
    let o = voom()
        .args(["generate", "--model"])
        .arg(d.path())
        .args(["--prompt-ids", "1,2,3"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("model.safetensors") && !e.contains("panicked"),
        "{e}"
    );
}

#[test]
fn a_flipped_byte_is_detected_before_use_and_named() {
    let d = tempfile::tempdir().unwrap();
    copy_dir(&tiny("llama_gqa_untied"), d.path());
    let ckpt = voom_formats::Checkpoint::open(d.path()).unwrap();
    voom_formats::Manifest::build(&ckpt, &mut |_, _| {})
        .unwrap()
        .save(d.path())
        .unwrap();
    let loc = ckpt.get("model.layers.1.mlp.up_proj.weight").unwrap();
    let off = loc.info.offset + 10;
    drop(ckpt);
    let f = d.path().join("model.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    bytes[off as usize] ^= 0x40;
    std::fs::write(&f, &bytes).unwrap();
    let o = voom()
        .args(["generate", "--model"])
        .arg(d.path())
        .args(["--prompt-ids", "1,2,3", "--max-new-tokens", "2"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("model.layers.1.mlp.up_proj.weight") && e.contains("blake3"),
        "{e}"
    );
    // The manifest is skipped only when asked to.
    let o = voom()
        .args(["generate", "--model"])
        .arg(d.path())
        .args([
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "2",
            "--verify",
            "off",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn bad_flags_are_errors() {
    let o = voom()
        .args(["generate", "--model"])
        .arg(tiny("llama_gqa_untied"))
        .args(["--prompt-ids", "1,x"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("'x'"));
    let o = voom()
        .args(["generate", "--model"])
        .arg(tiny("llama_gqa_untied"))
        .args(["--prompt-ids", "1,999999"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("999999"), "{}", stderr(&o));
    let o = voom()
        .args(["generate", "--model"])
        .arg(tiny("llama_gqa_untied"))
        .args(["--prompt-ids", "1", "--top-p", "0"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("top_p"), "{}", stderr(&o));
}

#[test]
fn smollm2_knows_the_capital_of_france() {
    let Some(dir) = common::smollm2() else { return };
    let o = voom()
        .arg("run")
        .arg(&dir)
        .arg("What is the capital of France?")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).trim(), "The capital of France is Paris.");
}

#[test]
fn smollm2_interactive_chat_keeps_the_conversation() {
    let Some(dir) = common::smollm2() else { return };
    let mut child = voom()
        .arg("run")
        .arg(&dir)
        .args(["--max-new-tokens", "40"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(b"What is the capital of France?\nAnd of Germany?\n")
        .unwrap();
    drop(stdin);
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() >= 2, "{out}");
    assert_eq!(lines[0], "The capital of France is Paris.");
    assert!(out.contains("Berlin"), "{out}");
}

#[test]
fn a_failed_import_leaves_the_existing_model_as_it_was() {
    let home = tempfile::tempdir().unwrap();
    let model = home.path().join("models/m");
    copy_dir(&tiny("llama_gqa_untied"), &model);
    let bad = home.path().join("bad.gguf");
    std::fs::write(&bad, b"GGUF\x03\x00\x00\x00truncated").unwrap();
    let o = voom()
        .env("VOOM_HOME", home.path())
        .arg("import")
        .arg(&bad)
        .args(["m", "--force"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("bad.gguf") && !e.contains("panicked"), "{e}");
    // The old model is intact and nothing half-imported is left beside it.
    let o = voom()
        .env("VOOM_HOME", home.path())
        .args([
            "generate",
            "--model",
            "m",
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "2",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let left: Vec<_> = std::fs::read_dir(home.path().join("models"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("m")]);
}

/// The `vpaged` binary built beside `voom` (the workspace's tests build both).
fn vpaged_bin() -> PathBuf {
    let p = Path::new(env!("CARGO_BIN_EXE_voom")).with_file_name("vpaged");
    assert!(
        p.exists(),
        "{} is not built: run the workspace's tests (scripts/test)",
        p.display()
    );
    p
}

#[test]
fn generate_through_the_daemon_gives_the_same_ids_and_falls_back_when_asked() {
    let (d, model) = hashed_copy("llama_tied_legacy_rope_eos");
    let r = reference("llama_tied_legacy_rope_eos");
    let p = &r["prompts"][2];
    let ids = id_list(&p["prompt_ids"]);
    let socket = d.path().join("vpaged.sock");
    let gen = |extra: &[&str]| {
        voom()
            .args(["generate", "--model"])
            .arg(&model)
            .args(["--prompt-ids", &ids, "--max-new-tokens", "32", "--json"])
            .args(extra)
            .output()
            .unwrap()
    };
    // No daemon yet: a clear error naming the socket, or the embedded store if asked.
    let sock = socket.to_str().unwrap();
    let o = gen(&["--vpaged", sock]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("vpaged.sock"), "{}", stderr(&o));
    let o = gen(&["--vpaged", sock, "--vpaged-fallback"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(last_json(&o)["ids"], p["generated_ids"]);

    let mut daemon = Command::new(vpaged_bin())
        .arg("--socket")
        .arg(&socket)
        .args(["--cache-size", "16MiB"])
        .env("VPAGED_LOG", "warn")
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "vpaged did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let o = gen(&["--vpaged", sock]);
    let _ = daemon.kill();
    let _ = daemon.wait();
    assert!(o.status.success(), "{}", stderr(&o));
    let j = last_json(&o);
    assert_eq!(j["ids"], p["generated_ids"]);
    assert!(
        j["page_source"].as_str().unwrap().starts_with("vpaged:"),
        "{j}"
    );
}

/// Issue 3: two `voom generate` processes on one model through one daemon cost one
/// copy of the weights. Measured: the daemon's arena holds each page once (one load
/// per page), each process maps the arena (its resident bytes there cover the weights)
/// while its private memory stays far below the weights, unlike the embedded store,
/// where the weights are the process's own.
#[test]
fn two_engines_on_one_daemon_cost_one_copy_of_the_weights() {
    let Some(dir) = common::smollm2() else { return };
    let weights: u64 = voom_formats::Manifest::load(&dir)
        .unwrap()
        .expect("voom pull writes the manifest")
        .pages
        .iter()
        .map(|p| p.len)
        .sum();
    let d = tempfile::tempdir().unwrap();
    let socket = d.path().join("vpaged.sock");
    let mut daemon = Command::new(vpaged_bin())
        .arg("--socket")
        .arg(&socket)
        .args(["--cache-size", "1GiB"])
        .env("VPAGED_LOG", "warn")
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "vpaged did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let gen = |extra: &[&str]| {
        voom()
            .args(["generate", "--model"])
            .arg(&dir)
            .args([
                "--prompt",
                "Name three rivers of Europe.",
                "--max-new-tokens",
                "24",
                "--threads",
                "1",
                "--json",
            ])
            .args(extra)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let sock = socket.to_str().unwrap();
    let engines = [gen(&["--vpaged", sock]), gen(&["--vpaged", sock])];
    let outs: Vec<Output> = engines
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    let embedded = gen(&[]).wait_with_output().unwrap();
    let c = vpaged::client::DaemonClient::connect(&socket, "test").unwrap();
    let stats = c.stats().unwrap();
    drop(c);
    let _ = daemon.kill();
    let _ = daemon.wait();

    let e = last_json(&embedded);
    let em = &e["memory"];
    for o in &outs {
        assert!(o.status.success(), "{}", stderr(o));
        let j = last_json(o);
        assert_eq!(j["ids"], e["ids"], "paging never changes the output");
        let m = &j["memory"];
        let arena = m["arena_rss_bytes"].as_u64().unwrap();
        let private = m["private_bytes"].as_u64().unwrap();
        assert!(
            arena >= weights * 9 / 10,
            "the engine computed on the arena's pages: {m} (weights {weights})"
        );
        assert_eq!(m["arena_private_bytes"], 0, "arena pages are shared: {m}");
        assert!(
            private < weights / 2,
            "private memory {private} must stay well below the weights {weights}: {m}"
        );
        // The embedded engine maps the checkpoint itself: its resident set holds the
        // weights (its private figure would drop if another test mapped the same
        // files at the same moment, so compare against its resident set).
        let embedded_rss = em["rss_bytes"].as_u64().unwrap();
        assert!(
            private + weights * 8 / 10 < embedded_rss,
            "through the daemon, about one copy of the weights less than embedded: {m} vs {em}"
        );
    }
    // One copy at the daemon: every page loaded once, the arena holding about the
    // weights (16 KiB slot rounding).
    let pages = voom_formats::Manifest::load(&dir)
        .unwrap()
        .unwrap()
        .pages
        .len() as u64;
    assert_eq!(stats["cache"]["loads"].as_u64(), Some(pages), "{stats}");
    let used = stats["cache"]["used"].as_u64().unwrap();
    assert!(
        used >= weights && used < weights + pages * (16 << 10),
        "arena occupancy {used} for {weights} bytes of weights: {stats}"
    );
}

/// `voom plan`: the placement never exceeds the budget, a budget below the minimum is
/// an error naming it, and the storage measurement reports what it read.
/// `voom plan` of an FP8 checkpoint names its formats, and its bytes against its BF16
/// form: the FP8 weights half theirs, the scales none.
#[test]
fn plan_shows_the_stored_formats_and_the_bf16_form() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/tiny_fp8/qwen3_moe_fp8_bf16_scales_not_convert");
    let o = voom()
        .arg("plan")
        .arg(&dir)
        .args(["--memory-budget", "1GiB", "--context", "64", "--no-measure"])
        .args(["--process-bytes", "8MiB", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let f = last_json(&o)["formats"].clone();
    let each = f["each"].as_array().unwrap();
    let of = |name: &str| {
        each.iter()
            .find(|e| e["format"] == name)
            .map(|e| e["bytes"].as_u64().unwrap())
    };
    let (fp8, scales, bf16) = (
        of("FP8 e4m3").unwrap(),
        of("FP8 scales BF16").unwrap(),
        of("BF16").unwrap(),
    );
    assert!(fp8 > 0 && scales > 0 && bf16 > 0, "{f}");
    let others: u64 = each
        .iter()
        .map(|e| e["bytes"].as_u64().unwrap())
        .sum::<u64>()
        - fp8
        - scales
        - bf16;
    assert_eq!(
        f["stored_bytes"].as_u64().unwrap(),
        fp8 + scales + bf16 + others
    );
    // F32 tensors (none here but possible) would be half their bytes as BF16.
    assert_eq!(others, 0, "{f}");
    assert_eq!(f["bf16_bytes"].as_u64().unwrap(), 2 * fp8 + bf16, "{f}");
    let text = voom()
        .arg("plan")
        .arg(&dir)
        .args(["--memory-budget", "1GiB", "--context", "64", "--no-measure"])
        .args(["--process-bytes", "8MiB"])
        .output()
        .unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(
        text.contains("stored as:") && text.contains("FP8 e4m3") && text.contains("its BF16 form"),
        "{text}"
    );
}

#[test]
fn plan_places_within_the_budget_and_refuses_below_the_minimum() {
    let dir = tiny("llama_sharded");
    let plan = |budget: &str, extra: &[&str]| {
        voom()
            .arg("plan")
            .arg(&dir)
            .args(["--memory-budget", budget, "--context", "64", "--json"])
            .args(["--process-bytes", "8MiB"])
            .args(extra)
            .output()
            .unwrap()
    };
    let o = plan("1GiB", &["--no-measure"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let big = last_json(&o);
    // Everything fits: everything pinned, nothing read from storage per token.
    assert_eq!(big["streamed_bytes_per_token"], 0);
    assert_eq!(big["window_bytes"], 0);
    assert!(big["total_bytes"].as_u64().unwrap() <= 1 << 30);
    let minimum = big["minimum_budget"].as_u64().unwrap();
    let weights = big["weight_bytes_per_token"].as_u64().unwrap();
    assert!(minimum > 0 && weights > 0);
    // A BF16 checkpoint is its BF16 form.
    let f = &big["formats"];
    assert_eq!(f["each"][0]["format"], "BF16", "{f}");
    assert_eq!(f["stored_bytes"], f["bf16_bytes"], "{f}");

    // At the minimum it runs, streaming; below it, an error naming the minimum.
    let o = plan(&minimum.to_string(), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let at_min = last_json(&o);
    assert!(at_min["total_bytes"].as_u64().unwrap() <= minimum);
    assert!(at_min["streamed_bytes_per_token"].as_u64().unwrap() > 0);
    // Streaming runs through a page cache, which reads the (whole, one-page)
    // embedding table for a token's row: more per token than the mapping reads.
    let streamed_weights = at_min["weight_bytes_per_token"].as_u64().unwrap();
    assert_eq!(
        at_min["streamed_bytes_per_token"].as_u64().unwrap()
            + at_min["pinned_bytes_per_token"].as_u64().unwrap(),
        streamed_weights
    );
    assert!(
        streamed_weights > weights,
        "{streamed_weights} vs {weights}"
    );
    let storage = &at_min["storage"];
    assert!(storage["bytes_read"].as_u64().unwrap() > 0, "{storage}");
    assert!(storage["buffered_bytes_per_sec"].as_f64().unwrap() > 0.0);
    assert!(at_min["predicted"]["tokens_per_sec"].as_f64().unwrap() > 0.0);

    let o = plan(&(minimum - 1).to_string(), &["--no-measure"]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("cannot run this model") && e.contains("needs at least"),
        "{e}"
    );
    let o = plan("lots", &[]);
    assert!(
        !o.status.success() && stderr(&o).contains("lots"),
        "{}",
        stderr(&o)
    );
}

/// `--backend`: every backend this machine has gives transformers' ids; a name it
/// does not have is an error listing the ones it has.
#[test]
fn every_backend_gives_transformers_ids_and_an_unknown_one_is_named() {
    let r = reference("llama_gqa_untied");
    let p = &r["prompts"][0];
    let ids = id_list(&p["prompt_ids"]);
    let want: Vec<u64> = p["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    for b in libvoom::backend::BackendKind::available() {
        let o = voom()
            .args(["generate", "--model"])
            .arg(tiny("llama_gqa_untied"))
            .args(["--prompt-ids", &ids, "--json", "--backend", b.name()])
            .args(["--max-new-tokens", &want.len().to_string()])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}: {}", b.name(), stderr(&o));
        let got: Vec<u64> = last_json(&o)["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(got, want, "{}", b.name());
    }
    let o = voom()
        .args(["generate", "--model"])
        .arg(tiny("llama_gqa_untied"))
        .args(["--prompt-ids", "1,2", "--backend", "metal"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("'metal'") && stderr(&o).contains("cpu-portable"),
        "{}",
        stderr(&o)
    );
}

/// `voom generate --json` reports the page cache's traffic of the generation (and
/// nothing for the memory-mapped store, whose caching is the OS's); the ids are the
/// same on both.
#[test]
fn generate_json_reports_the_page_cache_traffic() {
    let (_d, dir) = hashed_copy("llama_gqa_untied");
    let r = reference("llama_gqa_untied");
    let p = &r["prompts"][0];
    let ids = id_list(&p["prompt_ids"]);
    let run = |extra: &[&str]| {
        let o = voom()
            .args(["generate", "--model"])
            .arg(&dir)
            .args(["--prompt-ids", &ids, "--json", "--max-new-tokens", "8"])
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        last_json(&o)
    };
    let mapped = run(&[]);
    assert!(mapped["page_cache"].is_null(), "{}", mapped["page_cache"]);
    // The whole model fits in 1 MiB: the memory planner pinned every page and the
    // engine loaded them when it opened, so the generation itself only hits.
    let cached = run(&["--cache-budget", "1MiB"]);
    let pc = &cached["page_cache"];
    assert!(pc["hits"].as_u64().unwrap() > 0, "{pc}");
    assert_eq!(pc["misses"], 0, "{pc}");
    assert_eq!(pc["bytes_loaded"], 0, "{pc}");
    assert_eq!(pc["hit_ratio"], 1.0, "{pc}");
    assert_eq!(pc["bytes_read"]["primary"], 0, "{pc}");
    assert_eq!(cached["ids"], mapped["ids"]);
    // A cache smaller than the model streams: every byte loaded was read from the
    // model's own directory (raw pages, no fast tier, no NAS).
    let streamed = run(&["--cache-budget", "160KiB"]);
    let pc = &streamed["page_cache"];
    let loaded = pc["bytes_loaded"].as_u64().unwrap();
    assert!(loaded > 0, "{pc}");
    assert_eq!(pc["bytes_read"]["primary"], loaded, "{pc}");
    assert_eq!(pc["bytes_read"]["fast_tier"], 0, "{pc}");
    assert_eq!(pc["bytes_read"]["nas"], 0, "{pc}");
    assert_eq!(streamed["ids"], mapped["ids"]);
}

/// `--memory-budget`: a budget the model fits in memory-maps it; one it does not fit
/// in streams it through a page cache of what the KV cache, scratch, read buffers and
/// the process leave, with the same ids as an unbudgeted run and a peak resident set
/// (measured) within the budget; one too small to stream is an error naming what
/// the model needs. Without a budget, the memory available is the budget, and a
/// model that fits in it is memory-mapped.
#[test]
fn a_memory_budget_smaller_than_the_model_streams_it_within_the_budget() {
    let Some(dir) = common::smollm2() else { return };
    let budget: u64 = 240 << 20;
    let run = |extra: &[&str]| {
        voom()
            .args(["generate", "--model"])
            .arg(&dir)
            .args(["--prompt", "The capital of France is", "--json"])
            .args(["--max-new-tokens", "6", "--max-context", "128"])
            .args(extra)
            .output()
            .unwrap()
    };
    let ok = |o: Output| {
        assert!(o.status.success(), "{}", stderr(&o));
        last_json(&o)
    };
    let free = ok(run(&[]));
    let plan = &free["memory_budget"];
    assert_eq!(plan["explicit"], false, "{plan}");
    assert!(
        plan["from"]
            .as_str()
            .unwrap()
            .starts_with("the memory available now"),
        "{plan}"
    );
    assert_eq!(plan["store"], "memory-mapped", "{plan}");
    assert!(free["page_cache"].is_null());

    let big = ok(run(&["--memory-budget", "8GiB"]));
    assert_eq!(big["memory_budget"]["store"], "memory-mapped");
    assert_eq!(big["memory_budget"]["explicit"], true);
    assert_eq!(big["ids"], free["ids"]);

    let o = run(&["--memory-budget", &budget.to_string()]);
    let small = ok(o);
    let plan = &small["memory_budget"];
    assert_eq!(plan["store"], "page cache", "{plan}");
    assert_eq!(plan["from"], "flag --memory-budget", "{plan}");
    let weights: u64 = std::fs::metadata(dir.join("model.safetensors"))
        .unwrap()
        .len();
    let cache = plan["cache_bytes"].as_u64().unwrap();
    let needs: u64 = ["kv", "scratch", "process", "read_buffers"]
        .iter()
        .map(|k| plan["needs"][k].as_u64().unwrap())
        .sum();
    assert_eq!(cache + needs, budget, "{plan}");
    assert!(cache < weights, "{plan}");
    assert!(
        plan["streamed_bytes_per_token"].as_u64().unwrap() > 0,
        "{plan}"
    );
    assert!(small["page_cache"]["bytes_loaded"].as_u64().unwrap() > 0);
    assert_eq!(small["ids"], free["ids"]);
    let peak = small["peak_rss_bytes"].as_u64().unwrap();
    assert!(
        peak <= budget,
        "peak resident {peak} over the budget {budget}"
    );

    // `--memory-mapped` over a budget given at a lower level: memory-mapped, with a
    // warning naming both; two at one level: an error naming both.
    let o = voom()
        .args(["generate", "--model"])
        .arg(&dir)
        .args(["--prompt", "The capital of France is", "--json"])
        .args(["--max-new-tokens", "6", "--memory-mapped"])
        .env("VOOM_MEMORY_BUDGET", budget.to_string())
        .output()
        .unwrap();
    let e = stderr(&o);
    let mapped = ok(o);
    assert!(
        e.contains("memory_mapped (flag --memory-mapped) is used and memory_budget (env VOOM_MEMORY_BUDGET) ignored"),
        "{e}"
    );
    assert!(mapped["page_source"]
        .as_str()
        .unwrap()
        .starts_with("embedded:"));
    assert!(mapped["memory_budget"].is_null());
    assert_eq!(mapped["ids"], free["ids"]);
    let o = run(&["--memory-mapped", "--memory-budget", "1GiB"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("memory_budget (flag --memory-budget) and memory_mapped (flag --memory-mapped) are set at the same level"),
        "{}",
        stderr(&o)
    );

    let o = run(&["--memory-budget", "20MiB"]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("memory_budget (flag --memory-budget)")
            && e.contains("cannot run this model: it needs at least"),
        "{e}"
    );
}

/// `--fast-tier`: the planner has the fast tier keep copies of the pages a small
/// cache streams, as they are first read; later reads of them come from it (the
/// slow tier reads less), every copy verified, the ids the same; a later run finds
/// them there.
#[test]
fn a_fast_tier_takes_the_streamed_pages_off_the_slow_tier() {
    let (d, dir) = hashed_copy("llama_gqa_untied");
    let fast = d.path().join("fast");
    let r = reference("llama_gqa_untied");
    let p = &r["prompts"][0];
    let ids = id_list(&p["prompt_ids"]);
    let run = |extra: &[&str]| {
        let o = voom()
            .args(["generate", "--model"])
            .arg(&dir)
            .args(["--prompt-ids", &ids, "--json", "--max-new-tokens", "8"])
            .args(["--cache-budget", "160KiB"])
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        last_json(&o)
    };
    let slow = run(&[]);
    let tier = [
        "--fast-tier",
        fast.to_str().unwrap(),
        "--fast-tier-size",
        "1MiB",
    ];
    let first = run(&tier);
    let second = run(&tier);
    let read = |j: &Value, k: &str| j["page_cache"]["bytes_read"][k].as_u64().unwrap();
    for j in [&first, &second] {
        assert_eq!(j["ids"], slow["ids"]);
    }
    assert_eq!(read(&slow, "fast_tier"), 0);
    // The first run reads each page from the slow tier once, then from the copies.
    assert!(read(&first, "fast_tier") > 0, "{}", first["page_cache"]);
    assert!(read(&first, "primary") < read(&slow, "primary"));
    // The second finds every copy there: nothing from the slow tier.
    assert!(read(&second, "fast_tier") > 0);
    assert_eq!(read(&second, "primary"), 0, "{}", second["page_cache"]);
    let copies = walk(&fast);
    assert!(!copies.is_empty() && copies.iter().all(|p| p.extension().unwrap() == "page"));
    let kept: u64 = copies
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    assert!(kept <= 1 << 20, "{kept}");
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// `voom plan --fast-tier`: the static set the planner gives a fast tier of the pages
/// that stream (within its size, most valuable first), the bytes per token it takes
/// off the model's storage, and, measured, the speed that predicts; the probe file it
/// reads is gone after.
#[test]
fn plan_shows_what_a_fast_tier_takes_off_the_models_storage() {
    let dir = tiny("llama_sharded");
    let tier = tempfile::tempdir().unwrap();
    let plan = |extra: &[&str]| {
        let o = voom()
            .arg("plan")
            .arg(&dir)
            .args(["--context", "64", "--json", "--process-bytes", "8MiB"])
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        last_json(&o)
    };
    let minimum = plan(&["--memory-budget", "1GiB", "--no-measure"])["minimum_budget"]
        .as_u64()
        .unwrap()
        .to_string();
    let base = ["--memory-budget", minimum.as_str()];
    let plain = plan(&[&base[..], &["--no-measure"]].concat());
    assert!(plain["fast_tier"].is_null());
    let streamed = plain["streamed_bytes_per_token"].as_u64().unwrap();
    assert!(streamed > 0);
    let t = tier.path().to_str().unwrap();
    let half = (streamed / 2).to_string();
    let some = plan(
        &[
            &base[..],
            &["--no-measure", "--fast-tier", t, "--fast-tier-size", &half],
        ]
        .concat(),
    );
    let f = &some["fast_tier"];
    assert!(f["bytes"].as_u64().unwrap() <= streamed / 2, "{f}");
    let taken = f["bytes_per_token"].as_u64().unwrap();
    assert!(taken > 0 && taken < streamed, "{f}");
    let all = plan(
        &[
            &base[..],
            &["--no-measure", "--fast-tier", t, "--fast-tier-size", "1GiB"],
        ]
        .concat(),
    );
    assert_eq!(
        all["fast_tier"]["bytes_per_token"].as_u64().unwrap(),
        streamed
    );
    let measured = plan(
        &[
            &base[..],
            &[
                "--measure-bytes",
                "4MiB",
                "--fast-tier",
                t,
                "--fast-tier-size",
                &half,
            ],
        ]
        .concat(),
    );
    assert!(measured["fast_tier"]["bytes_per_sec"].as_f64().unwrap() > 0.0);
    assert!(measured["fast_tier"]["same_device_as_model"].is_boolean());
    let with = measured["predicted"]["with_fast_tier_tokens_per_sec"]
        .as_f64()
        .unwrap();
    assert!(with > 0.0, "{}", measured["predicted"]);
    assert_eq!(
        std::fs::read_dir(tier.path()).unwrap().count(),
        0,
        "the probe file is left"
    );
}

/// Regression: a model streamed through the planner's window reads each streamed
/// page once per pass. With a window of exactly two of the largest layers, the
/// page cache's free room fragmented (pages of mixed sizes, layers made unequal by
/// the planner's pins), a layer's hint found no run for its largest page, and that
/// page's demand load evicted prefetched pages of the next layer before their
/// request: 7% more bytes read per token than the plan streams, on a 42-layer
/// sweep. The window now has room for one more of the largest page
/// (`vpaged::store::streaming_window_bytes`).
#[test]
fn a_planned_stream_reads_each_streamed_page_once_per_pass() {
    use voom_server::synth::{write_llama, SynthShape};
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("m");
    // The benchmark model's proportions, smaller: GQA 8:1, an MLP 2.75 times wide,
    // untied (the embedding in row parts), 24 layers of 5.5 MB.
    let shape = SynthShape {
        hidden: 512,
        intermediate: 1408,
        layers: 24,
        heads: 8,
        kv_heads: 1,
        vocab: 8000,
    };
    write_llama(&dir, shape, 7).unwrap();
    let gen = |tokens: usize| {
        let o = voom()
            .args(["generate", "--model"])
            .arg(&dir)
            .args(["--prompt-ids", "1,2,3,4", "--ignore-eos", "--json"])
            .args(["--max-new-tokens", &tokens.to_string()])
            .args(["--max-context", "32", "--threads", "2"])
            // About a third of the layers' bytes pinned beside the window.
            .args(["--memory-budget", "150MiB"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        last_json(&o)
    };
    let (few, many) = (gen(3), gen(9));
    let plan = &many["memory_budget"];
    assert_eq!(plan["store"], "page cache", "{plan}");
    let pinned = plan["pinned_bytes"].as_u64().unwrap();
    assert!(pinned > 20 << 20, "{plan}");
    let streamed = plan["streamed_bytes_per_token"].as_u64().unwrap();
    for r in [&few, &many] {
        assert_eq!(
            r["page_cache"]["unused_evictions"], 0,
            "{}",
            r["page_cache"]
        );
    }
    // Six more passes read six times what one pass streams at most: the layers'
    // unpinned pages and one ~1 MiB part of the embedding per token (the plan counts
    // one row); a little less where the cache's spare room kept a page. (The two
    // runs measure their process apart, so their plans differ by a few KiB.)
    let per_pass = (many["page_cache"]["bytes_loaded"].as_u64().unwrap()
        - few["page_cache"]["bytes_loaded"].as_u64().unwrap())
        / 6;
    assert!(
        per_pass >= streamed / 10 * 9 && per_pass <= streamed + (2 << 20),
        "loaded {per_pass} bytes per pass, the plan streams {streamed}: {}",
        many["page_cache"]
    );
}

/// `voom generate --expert-trace FILE` on a mixture of experts writes the routing
/// trace: one pass for the prompt and one per later token, each reading, in every
/// layer of experts, the experts its positions picked (`top_k` for one position);
/// the same ids as without it; and a dense model is refused before anything runs.
#[test]
fn generate_records_the_routing_trace_of_a_mixture_of_experts() {
    use vpaged::expert_plan::{replay, Policy};
    use vpaged::expert_trace::Trace;
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("route.trace");
    let r = reference("qwen3_moe_dense_layer");
    let p = &r["prompts"][2];
    let ids = id_list(&p["prompt_ids"]);
    let o = voom()
        .args(["generate", "--model"])
        .arg(tiny("qwen3_moe_dense_layer"))
        .args(["--prompt-ids", &ids, "--max-new-tokens", "32", "--json"])
        .arg("--expert-trace")
        .arg(&path)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(last_json(&o)["ids"], p["generated_ids"]);
    let trace = Trace::read(&mut std::io::BufReader::new(
        std::fs::File::open(&path).unwrap(),
    ))
    .unwrap();
    let h = &trace.header;
    assert_eq!((h.num_experts, h.top_k), (8, 2));
    // mlp_only_layers [1]: layers 0 and 2 route; an expert is gate, up and down.
    assert_eq!(h.layers, [0, 2]);
    assert_eq!(h.expert_bytes, [3 * 32 * 64 * 2; 2]);
    let prompt = p["prompt_ids"].as_array().unwrap().len() as u32;
    let generated = p["generated_ids"].as_array().unwrap().len();
    assert_eq!(
        trace.passes.len(),
        generated,
        "the prompt, then one per token but the last"
    );
    assert_eq!(trace.passes[0].positions, prompt);
    for (i, pass) in trace.passes.iter().enumerate() {
        for list in &pass.experts {
            let most = (pass.positions * h.top_k).min(h.num_experts) as usize;
            if i == 0 {
                assert!((2..=most).contains(&list.len()), "{list:?}");
            } else {
                assert_eq!(list.len(), 2, "one position reads top_k experts: {list:?}");
            }
        }
    }
    // The simulator replays it: no policy reads less than the Belady bound.
    let belady = replay(&trace, Policy::Belady, 4 * 12288, 8);
    for policy in Policy::ALL {
        assert!(replay(&trace, policy, 4 * 12288, 8).misses >= belady.misses);
    }

    let o = voom()
        .args(["generate", "--model"])
        .arg(tiny("llama_gqa_untied"))
        .args(["--prompt-ids", "5", "--expert-trace"])
        .arg(d.path().join("dense.trace"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("has no routed experts"),
        "{}",
        stderr(&o)
    );
    assert!(!d.path().join("dense.trace").exists());
}

/// A mixture of experts larger than its budget streams through the page cache: the
/// planner pins the trunk and no expert, the cache keeps the experts picked often
/// (hits), the ids are the memory-mapped run's, and a decode token reads less than
/// the experts it routes to plus the trunk.
#[test]
fn a_mixture_of_experts_streams_its_experts_and_keeps_the_hot_ones() {
    use voom_server::synth::{write_qwen3_moe, SynthMoeShape};
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("moe");
    // 4 layers of 16 experts of 384 KiB, 2 per token: 25 MB of experts.
    let shape = SynthMoeShape {
        hidden: 256,
        layers: 4,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        experts: 16,
        top_k: 2,
        expert_intermediate: 256,
        vocab: 2000,
    };
    write_qwen3_moe(&dir, shape, 7).unwrap();
    let gen = |extra: &[&str]| {
        let o = voom()
            .args(["generate", "--model"])
            .arg(&dir)
            .args(["--prompt-ids", "11,22,33,44", "--ignore-eos", "--json"])
            .args([
                "--max-new-tokens",
                "24",
                "--max-context",
                "32",
                "--threads",
                "2",
            ])
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        last_json(&o)
    };
    // A budget 12 MiB above the least this model runs in (the process, read buffers
    // and scratch as this machine measures them): room for the trunk and some
    // experts, not for all 25 MB of them.
    let o = voom()
        .args(["plan"])
        .arg(&dir)
        .args(["--memory-budget", "1GiB", "--context", "32", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let least = last_json(&o)["minimum_budget"].as_u64().unwrap();
    let budget = (least + (12 << 20)).to_string();
    let mapped = gen(&["--memory-mapped"]);
    let cached = gen(&["--memory-budget", &budget]);
    assert_eq!(
        cached["ids"], mapped["ids"],
        "the page cache changed the ids"
    );
    let plan = &cached["memory_budget"];
    assert_eq!(plan["store"], "page cache", "{plan}");
    let pages = &cached["page_cache"];
    assert!(pages["hits"].as_u64().unwrap() > 0, "{pages}");
    assert_eq!(pages["unused_evictions"], 0, "{pages}");
    // The plan pins the trunk and streams the experts (3 MiB of them routed per
    // token), yet 24 passes read less than the model once: the cache kept the
    // experts picked often (96% hits here; the routing is the same on every machine,
    // the ids being exact).
    assert!(plan["pinned_bytes"].as_u64().unwrap() > 0, "{plan}");
    let loaded = pages["bytes_loaded"].as_u64().unwrap();
    let everything = std::fs::metadata(dir.join("model.safetensors"))
        .unwrap()
        .len();
    assert!(
        loaded < everything,
        "loaded {loaded} bytes of {everything}: {pages}"
    );
    assert!(pages["hit_ratio"].as_f64().unwrap() > 0.5, "{pages}");
}

/// `voom generate --mtp` drafts with the checkpoint's multi-token-prediction layer:
/// transformers' ids, `--json` naming the drafter; a model without the layer is an
/// error saying why.
#[test]
fn generate_drafts_with_the_prediction_layer() {
    let case = "glm4_moe_partial_rotary_shared_mtp";
    let dir = tiny("../tiny_mtp").join(case);
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference_mtp.json")).unwrap())
            .unwrap();
    let s = &r["sequences"][2];
    let ids = id_list(&s["prompt_ids"]);
    let n = s["generated_ids"].as_array().unwrap().len().to_string();
    let o = voom()
        .args(["generate", "--model"])
        .arg(&dir)
        .args(["--prompt-ids", &ids, "--max-new-tokens", &n, "--json"])
        .args(["--mtp", "--fixed-draft", "--max-draft", "3"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let g = last_json(&o);
    assert_eq!(g["ids"], s["generated_ids"]);
    let spec = &g["speculation"];
    assert_eq!(spec["drafter"], format!("mtp:{case}"), "{spec}");
    assert!(spec["drafted"].as_u64().unwrap() > 0, "{spec}");
    let o = voom()
        .args(["generate", "--model"])
        .arg(tiny("llama_gqa_untied"))
        .args(["--prompt-ids", "5,6", "--mtp"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("--mtp") && e.contains("no multi-token-prediction layers"),
        "{e}"
    );
}

/// `voom generate` drafts when asked: `--prompt-lookup` and `--draft MODEL` give the
/// transformers reference's ids, `--json` says which drafter ran and what it kept;
/// a draft model of another vocabulary is an error naming both models.
#[test]
fn generate_drafts_and_keeps_the_reference_ids() {
    let case = "llama_tied_legacy_rope_eos";
    let r = reference(case);
    let p = &r["prompts"][1];
    let ids = id_list(&p["prompt_ids"]);
    let max_new = r["generation"]["max_new_tokens"].to_string();
    let run = |extra: &[&str]| {
        let o = voom()
            .args(["generate", "--model"])
            .arg(tiny(case))
            .args(["--prompt-ids", &ids, "--max-new-tokens", &max_new, "--json"])
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
        last_json(&o)
    };
    let plain = run(&[]);
    assert_eq!(plain["ids"], p["generated_ids"]);
    assert!(plain["speculation"].is_null());
    let lookup = run(&["--prompt-lookup", "--fixed-draft", "--max-draft", "3"]);
    assert_eq!(lookup["ids"], p["generated_ids"]);
    let s = &lookup["speculation"];
    assert_eq!(s["drafter"], "prompt-lookup", "{s}");
    assert_eq!(s["scheme"], "exact");
    assert_eq!(s["passes"], lookup["decode_passes"]);
    // The checkpoint drafting for itself: every proposal kept.
    let dir = tiny(case);
    let itself = run(&["--draft", dir.to_str().unwrap(), "--fixed-draft"]);
    assert_eq!(itself["ids"], p["generated_ids"]);
    let s = &itself["speculation"];
    assert_eq!(s["drafter"], format!("draft-model:{case}"));
    assert_eq!(s["accepted"], s["drafted"], "{s}");
    // Another vocabulary (384 ids against this model's 320).
    let o = voom()
        .args(["generate", "--model"])
        .arg(tiny(case))
        .args(["--prompt-ids", &ids, "--draft"])
        .arg(tiny("llama_gqa_untied"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("--draft") && e.contains("llama_gqa_untied") && e.contains(case),
        "{e}"
    );
}

/// A llama GGUF of F32 weights, about `layers` x 46 MB: large enough that its import
/// takes a while (an interrupt lands during it), valid so that it completes.
fn slow_gguf(path: &Path, layers: usize) {
    use voom_formats::gguf::{GgmlType, GgufArray, GgufValue, GgufWriter};
    let (embd, ff, heads) = (1024usize, 2816usize, 8usize);
    // GPT-2's byte alphabet as the vocabulary, after three special tokens.
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .map(String::from)
        .to_vec();
    let mut types = vec![3i32; 3];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let c = if matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff) {
            u32::from(b)
        } else {
            next += 1;
            next - 1
        };
        tokens.push(char::from_u32(c).unwrap().to_string());
        types.push(1);
    }
    let vocab = tokens.len();
    let mut w = GgufWriter::new();
    let s = |x: &str| GgufValue::String(x.into());
    let u = GgufValue::U32;
    w.add_kv("general.architecture", s("llama"));
    w.add_kv("llama.block_count", u(layers as u32));
    w.add_kv("llama.context_length", u(256));
    w.add_kv("llama.embedding_length", u(embd as u32));
    w.add_kv("llama.feed_forward_length", u(ff as u32));
    w.add_kv("llama.attention.head_count", u(heads as u32));
    w.add_kv("llama.attention.head_count_kv", u(heads as u32));
    w.add_kv("llama.rope.freq_base", GgufValue::F32(10000.0));
    w.add_kv(
        "llama.attention.layer_norm_rms_epsilon",
        GgufValue::F32(1e-5),
    );
    w.add_kv("llama.vocab_size", u(vocab as u32));
    w.add_kv("llama.rope.dimension_count", u((embd / heads) as u32));
    w.add_kv("tokenizer.ggml.model", s("gpt2"));
    w.add_kv("tokenizer.ggml.pre", s("gpt-2"));
    w.add_kv(
        "tokenizer.ggml.tokens",
        GgufValue::Array(GgufArray::String(tokens)),
    );
    w.add_kv(
        "tokenizer.ggml.token_type",
        GgufValue::Array(GgufArray::I32(types)),
    );
    w.add_kv(
        "tokenizer.ggml.merges",
        GgufValue::Array(GgufArray::String(vec![])),
    );
    w.add_kv("tokenizer.ggml.bos_token_id", u(1));
    w.add_kv("tokenizer.ggml.eos_token_id", u(2));
    let f32s = |n: usize, seed: usize| -> Vec<u8> {
        (0..n)
            .flat_map(|i| (((i * 7 + seed) % 13) as f32 / 64.0 - 0.1).to_le_bytes())
            .collect()
    };
    let t = |w: &mut GgufWriter, name: &str, dims: &[u64], seed: usize| {
        let n = dims.iter().product::<u64>() as usize;
        w.add_tensor(name, dims, GgmlType::F32, &f32s(n, seed));
    };
    t(&mut w, "token_embd.weight", &[embd as u64, vocab as u64], 1);
    t(&mut w, "output_norm.weight", &[embd as u64], 2);
    for l in 0..layers {
        let (e, f) = (embd as u64, ff as u64);
        for (name, dims) in [
            ("attn_norm", vec![e]),
            ("ffn_norm", vec![e]),
            ("attn_q", vec![e, e]),
            ("attn_k", vec![e, e]),
            ("attn_v", vec![e, e]),
            ("attn_output", vec![e, e]),
            ("ffn_gate", vec![e, f]),
            ("ffn_up", vec![e, f]),
            ("ffn_down", vec![f, e]),
        ] {
            t(&mut w, &format!("blk.{l}.{name}.weight"), &dims, l + 3);
        }
    }
    std::fs::write(path, w.to_bytes()).unwrap();
}

/// The entries of a directory, sorted.
fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Starts `voom import GGUF m --force` and returns it once its staging directory
/// holds the weights being written (the import is under way).
fn import_under_way(home: &Path, gguf: &Path) -> std::process::Child {
    let mut child = voom()
        .env("VOOM_HOME", home)
        .arg("import")
        .arg(gguf)
        .args(["m", "--force"])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let staged = home
        .join("models")
        .join(format!(".m.importing-{}", child.id()));
    let t = std::time::Instant::now();
    while !staged.join("model.safetensors").exists() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the import ended first"
        );
        assert!(t.elapsed().as_secs() < 60, "no staging directory");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    child
}

/// Regression (issue 41, 3): an import interrupted by SIGINT or SIGTERM removes its
/// staging directory (and leaves the model it would replace as it was); one killed
/// outright leaves it, and the next `voom list` (or import) reclaims it. Nothing
/// stays hidden beside the models.
#[test]
fn an_interrupted_import_leaves_nothing_behind() {
    let home = tempfile::tempdir().unwrap();
    let models = home.path().join("models");
    let model = models.join("m");
    copy_dir(&tiny("llama_gqa_untied"), &model);
    let gguf = home.path().join("big.gguf");
    slow_gguf(&gguf, 2);
    let config = std::fs::read(model.join("config.json")).unwrap();
    for (sig, code) in [(libc::SIGINT, 130), (libc::SIGTERM, 143)] {
        let mut child = import_under_way(home.path(), &gguf);
        // SAFETY: a signal to our own child process.
        unsafe { libc::kill(child.id() as i32, sig) };
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(code), "{status}");
        assert_eq!(entries(&models), vec!["m"], "after signal {sig}");
        assert_eq!(std::fs::read(model.join("config.json")).unwrap(), config);
    }
    let mut child = import_under_way(home.path(), &gguf);
    child.kill().unwrap();
    child.wait().unwrap();
    let left = format!(".m.importing-{}", child.id());
    assert_eq!(entries(&models), vec![left.clone(), "m".to_string()]);
    let o = voom()
        .env("VOOM_HOME", home.path())
        .arg("list")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains(&left), "{}", stderr(&o));
    assert_eq!(entries(&models), vec!["m"]);
    // The import itself, uninterrupted, replaces the model, with nothing left.
    let o = voom()
        .env("VOOM_HOME", home.path())
        .arg("import")
        .arg(&gguf)
        .args(["m", "--force"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(entries(&models), vec!["m"]);
    assert_ne!(std::fs::read(model.join("config.json")).unwrap(), config);
}

/// `voom generate --json` of a chat to a harmony model (gpt-oss) gives its reasoning
/// apart and counts its tokens in usage as the server does (the random fixture writes
/// no analysis message: none); a model without a reasoning format has null reasoning
/// and a count of 0.
#[test]
fn generate_json_counts_reasoning_tokens() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
    for (model, harmony) in [("tiny_harmony", true), ("tiny_chat", false)] {
        let o = voom()
            .args(["generate", "--model"])
            .arg(fixtures.join(model))
            .args(["--chat", "Hi there", "--max-new-tokens", "12", "--json"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{model}: {}", stderr(&o));
        let j = last_json(&o);
        let usage = &j["usage"];
        assert_eq!(usage["completion_tokens"], 12, "{model}: {usage}");
        assert_eq!(usage["reasoning_tokens"], 0, "{model}: {usage}");
        assert_eq!(
            j["reasoning"].is_string(),
            harmony,
            "{model}: {}",
            j["reasoning"]
        );
    }
}
