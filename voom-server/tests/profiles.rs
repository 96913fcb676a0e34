//! Runtime profiles end to end through the real `voom` binary: listing, resolving
//! with sources, generating under a profile (same ids: budgets never change
//! arithmetic), and bad profile files.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// Environment that would change resolution, removed so tests see only what they set.
const ENV: &[&str] = &[
    "VOOM_PROFILE",
    "VOOM_PROFILES_DIR",
    "VOOM_THREADS",
    "VOOM_VERIFY",
    "VOOM_MAX_CONTEXT",
    "VOOM_PREFETCH_DEPTH",
    "VOOM_CACHE_BUDGET",
    "VOOM_PIN_FIRST_LAYERS",
    "VOOM_PIN_LAST_LAYERS",
    "VOOM_KV_BUDGET",
    "VOOM_VPAGED",
    "VOOM_VPAGED_FALLBACK",
];

/// `voom` with a fresh `$VOOM_HOME` (no profiles of its own) and a clean environment.
fn voom(home: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_voom"));
    for v in ENV {
        c.env_remove(v);
    }
    c.env("VOOM_HOME", home);
    c
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny/llama_gqa_untied")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn ok(o: Output) -> Output {
    assert!(
        o.status.success(),
        "voom failed: {}\n{}",
        stderr(&o),
        stdout(&o)
    );
    o
}

fn last_json(o: &Output) -> Value {
    let out = stdout(o);
    let line = out
        .lines()
        .last()
        .unwrap_or_else(|| panic!("no output: {}", stderr(o)));
    serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"))
}

/// The fixture's longest reference prompt: its ids (comma-separated) and greedy ids.
fn reference() -> (String, Value) {
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap())
            .unwrap();
    let p = r["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .max_by_key(|p| p["prompt_ids"].as_array().unwrap().len())
        .unwrap()
        .clone();
    assert!(!p["stopped_on_eos"].as_bool().unwrap());
    let ids: Vec<String> = p["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.to_string())
        .collect();
    (ids.join(","), p["generated_ids"].clone())
}

fn generate(home: &Path, model: &Path, extra: &[&str]) -> Output {
    let (ids, want) = reference();
    let n = want.as_array().unwrap().len().to_string();
    voom(home)
        .args(["generate", "--json", "--model"])
        .arg(model)
        .args(["--prompt-ids", &ids, "--max-new-tokens", &n])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn list_shows_the_shipped_profiles() {
    let home = tempfile::tempdir().unwrap();
    let o = ok(voom(home.path())
        .args(["profiles", "list"])
        .output()
        .unwrap());
    let text = stdout(&o);
    for (name, inherits) in [
        ("default", "-"),
        ("low-memory", "default"),
        ("throughput", "default"),
    ] {
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("{name} not listed:\n{text}"));
        assert_eq!(line.split_whitespace().nth(1), Some(inherits), "{line}");
        assert!(line.split_whitespace().count() > 3, "no notes: {line}");
    }
    let o = ok(voom(home.path())
        .args(["profiles", "list", "--json"])
        .output()
        .unwrap());
    let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let names: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["default", "low-memory", "throughput"]);
}

#[test]
fn show_resolves_inherited_values_with_their_sources() {
    let home = tempfile::tempdir().unwrap();
    let o = ok(voom(home.path())
        .args(["profiles", "show", "low-memory", "--json"])
        .output()
        .unwrap());
    let j = last_json(&o);
    assert_eq!(j["name"], "low-memory");
    assert_eq!(j["exact"], true);
    assert_eq!(j["chain"], serde_json::json!(["low-memory", "default"]));
    let s = &j["settings"];
    assert_eq!(s["cache_budget"], 2u64 << 30);
    assert_eq!(s["kv_budget"], 512u64 << 20);
    assert_eq!(s["pin_first_layers"], 1);
    assert_eq!(s["pin_last_layers"], 1);
    // Inherited from default.yaml.
    assert_eq!(s["verify"], "first-use");
    assert_eq!(s["threads"], 0);
    let src = &j["sources"];
    assert_eq!(
        src["cache_budget"],
        "profile built-in profiles/low-memory.yaml"
    );
    assert_eq!(src["verify"], "profile built-in profiles/default.yaml");
    assert_eq!(src["max_context"], "default");
    let digest = j["digest"].as_str().unwrap();
    assert_eq!(digest.len(), 16);
    assert!(digest.chars().all(|c| c.is_ascii_hexdigit()));

    // Flag over environment over profile; the digest follows the settings.
    let o = ok(voom(home.path())
        .env("VOOM_THREADS", "3")
        .env("VOOM_PREFETCH_DEPTH", "4")
        .args([
            "profiles",
            "show",
            "low-memory",
            "--json",
            "--prefetch-depth",
            "2",
        ])
        .output()
        .unwrap());
    let k = last_json(&o);
    assert_eq!(k["settings"]["threads"], 3);
    assert_eq!(k["sources"]["threads"], "env VOOM_THREADS");
    assert_eq!(k["settings"]["prefetch_depth"], 2);
    assert_eq!(k["sources"]["prefetch_depth"], "flag --prefetch-depth");
    assert_ne!(k["digest"], j["digest"]);

    // The text form names the same sources.
    let o = ok(voom(home.path())
        .args(["profiles", "show", "low-memory"])
        .output()
        .unwrap());
    let text = stdout(&o);
    assert!(text.contains(digest), "{text}");
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("kv_budget"))
        .unwrap();
    assert!(
        line.contains("512MiB") && line.contains("low-memory.yaml"),
        "{line}"
    );
}

#[test]
fn generate_under_low_memory_gives_the_same_ids_and_reports_the_profile() {
    let home = tempfile::tempdir().unwrap();
    let (_, want) = reference();

    let plain = last_json(&ok(generate(home.path(), &fixture(), &[])));
    assert_eq!(plain["ids"], want);
    assert_eq!(plain["profile"], "default");
    assert_eq!(plain["exact"], true);

    // A copy of the fixture, which has no page manifest: the page cache hashes the
    // checkpoint once and writes the manifest beside it, as `vpagectl hash` would.
    let copy = tempfile::tempdir().unwrap();
    for f in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(fixture().join(f), copy.path().join(f)).unwrap();
    }
    let o = ok(generate(
        home.path(),
        copy.path(),
        &["--profile", "low-memory"],
    ));
    let j = last_json(&o);
    assert_eq!(j["ids"], want);
    assert_eq!(j["profile"], "low-memory");
    assert!(
        j["page_source"].as_str().unwrap().starts_with("store:"),
        "{}",
        j["page_source"]
    );
    let ckpt = voom_formats::Checkpoint::open(copy.path()).unwrap();
    let expected = voom_formats::manifest::Manifest::build(&ckpt, &mut |_, _| {}).unwrap();
    let written = voom_formats::manifest::Manifest::load(copy.path())
        .unwrap()
        .expect("a manifest written beside the checkpoint");
    assert_eq!(written, expected);
    let show = last_json(&ok(voom(home.path())
        .args(["profiles", "show", "low-memory", "--json"])
        .output()
        .unwrap()));
    assert_eq!(j["profile_digest"], show["digest"]);
    assert_ne!(j["profile_digest"], plain["profile_digest"]);

    // The weights go through the in-process page cache: same ids, also with a
    // cache far smaller than the model (pages evicted and reloaded; no pins, which
    // on this 2-layer model would hold every page).
    let model_bytes = std::fs::metadata(copy.path().join("model.safetensors"))
        .unwrap()
        .len();
    let small = (model_bytes / 2).to_string();
    for extra in [
        vec!["--profile", "low-memory"],
        vec!["--profile", "throughput"],
        vec![
            "--profile",
            "low-memory",
            "--cache-budget",
            small.as_str(),
            "--pin-first-layers",
            "0",
            "--pin-last-layers",
            "0",
        ],
    ] {
        let o = ok(generate(home.path(), copy.path(), &extra));
        let j = last_json(&o);
        assert_eq!(j["ids"], want, "{extra:?}");
        assert!(
            j["page_source"].as_str().unwrap().starts_with("store:"),
            "{extra:?}: {}",
            j["page_source"]
        );
        assert_eq!(j["profile"], extra[1]);
    }
}

/// A KV budget below what the prompt needs spills pages to `$VOOM_HOME/kv` and
/// reads them back: the reference's ids, and `--json` says what spilled.
#[test]
fn a_kv_budget_spills_and_keeps_the_ids() {
    let home = tempfile::tempdir().unwrap();
    let (_ids, want) = reference();
    let o = ok(generate(
        home.path(),
        &fixture(),
        &["--kv-budget", "4KiB", "--kv-page-positions", "4"],
    ));
    let j = last_json(&o);
    assert_eq!(j["ids"], want, "{j}");
    let kv = &j["kv"];
    assert_eq!(kv["budget_bytes"], 4096, "{j}");
    assert!(kv["written_bytes"].as_u64().unwrap() > 0, "{j}");
    assert!(kv["read_bytes"].as_u64().unwrap() > 0, "{j}");
    assert_eq!(kv["corrupt_pages"], 0, "{j}");
    // The spill file goes with the process.
    let left: Vec<_> = std::fs::read_dir(home.path().join("kv")).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn bad_profiles_are_clear_errors() {
    let home = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
    write("typo.yaml", "inherits: default\ncache_budgte: 1GiB\n");
    write("lossy.yaml", "lossy: true\n");
    write("orphan.yaml", "inherits: missing\n");
    write("loop.yaml", "inherits: loop2\n");
    write("loop2.yaml", "inherits: loop\n");
    write("size.yaml", "kv_budget: 12 parsecs\n");
    let cases = [
        ("typo", vec!["typo.yaml", "unknown key 'cache_budgte'"]),
        (
            "lossy",
            vec!["lossy.yaml", "no lossy encodings are implemented"],
        ),
        ("orphan", vec!["orphan.yaml", "'missing'"]),
        ("loop", vec!["loop -> loop2 -> loop"]),
        ("size", vec!["size.yaml", "kv_budget", "parsecs"]),
        ("absent", vec!["no profile 'absent'", "low-memory"]),
    ];
    for (name, wants) in cases {
        // Both where profiles are read: `profiles show` and an engine command.
        let show = voom(home.path())
            .args(["profiles", "show", name, "--profiles-dir"])
            .arg(dir.path())
            .output()
            .unwrap();
        let gen = voom(home.path())
            .env("VOOM_PROFILES_DIR", dir.path())
            .args([
                "generate",
                "--prompt-ids",
                "1",
                "--profile",
                name,
                "--model",
            ])
            .arg(fixture())
            .output()
            .unwrap();
        for o in [show, gen] {
            assert_eq!(o.status.code(), Some(1), "{name}: {}", stderr(&o));
            let e = stderr(&o);
            assert!(!e.contains("panicked"), "{e}");
            for w in &wants {
                assert!(e.contains(w), "{name}: '{w}' not in: {e}");
            }
        }
    }
    // `profiles list` reads every file, so it reports the first bad one.
    let o = voom(home.path())
        .args(["profiles", "list", "--profiles-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    // A bad environment value names the variable.
    let o = voom(home.path())
        .env("VOOM_CACHE_BUDGET", "huge")
        .args(["profiles", "show"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("VOOM_CACHE_BUDGET"), "{}", stderr(&o));
}

#[test]
fn home_profiles_shadow_the_shipped_ones() {
    let home = tempfile::tempdir().unwrap();
    std::fs::create_dir(home.path().join("profiles")).unwrap();
    std::fs::write(
        home.path().join("profiles/default.yaml"),
        "notes: site defaults\nthreads: 1\n",
    )
    .unwrap();
    std::fs::write(
        home.path().join("profiles/mine.yaml"),
        "inherits: low-memory\nnotes: my profile\nsampling: {temperature: 0.2}\n",
    )
    .unwrap();
    let j = last_json(&ok(voom(home.path())
        .args(["profiles", "show", "mine", "--json"])
        .output()
        .unwrap()));
    assert_eq!(
        j["chain"],
        serde_json::json!(["mine", "low-memory", "default"])
    );
    assert_eq!(j["settings"]["threads"], 1);
    assert_eq!(j["settings"]["sampling"]["temperature"], 0.2);
    assert_eq!(j["settings"]["cache_budget"], 2u64 << 30);
    let src = j["sources"]["threads"].as_str().unwrap();
    assert!(
        src.ends_with("profiles/default.yaml") && !src.contains("built-in"),
        "{src}"
    );
    let o = ok(voom(home.path())
        .args(["profiles", "list"])
        .output()
        .unwrap());
    assert!(stdout(&o).contains("my profile"), "{}", stdout(&o));
}

/// Regression (issue 41, 5 and 6): a profile that is a device, a FIFO or too large
/// is refused without being read, and one nested past the limit is refused before
/// the YAML parser sees it (100,000 levels of `[` took the parser 28 s of CPU).
#[test]
fn hostile_profile_files_are_refused_at_once() {
    let home = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.yaml");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let big = dir.path().join("big.yaml");
    std::fs::write(&big, format!("notes: \"{}\"\n", "x".repeat(2 << 20))).unwrap();
    let deep_flow = dir.path().join("flow.yaml");
    std::fs::write(&deep_flow, "[".repeat(100_000)).unwrap();
    let deep_map = dir.path().join("map.yaml");
    std::fs::write(&deep_map, format!("notes: {}", "{a: ".repeat(100_000))).unwrap();
    let deep_block = dir.path().join("block.yaml");
    std::fs::write(&deep_block, "- ".repeat(100_000) + "x\n").unwrap();
    let dev = PathBuf::from("/dev/zero");
    let cases: [(&Path, &str); 6] = [
        (&dev, "not a regular file"),
        (&fifo, "not a regular file"),
        (&big, "more than 1048576 bytes"),
        (&deep_flow, "nested more than 32 deep"),
        (&deep_map, "nested more than 32 deep"),
        (&deep_block, "nested more than 32 deep"),
    ];
    for (path, want) in cases {
        let o = voom(home.path())
            .args(["profiles", "show"])
            .arg(path)
            .output()
            .unwrap();
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{}: {e}", path.display());
        assert!(
            e.contains(want) && e.contains(&*path.to_string_lossy()),
            "{}: '{want}' not in: {e}",
            path.display()
        );
    }
    // Brackets and dashes inside quoted scalars and comments are not nesting.
    let fine = dir.path().join("fine.yaml");
    let quoted = "[".repeat(100);
    std::fs::write(
        &fine,
        format!("inherits: default\nnotes: \"{quoted} - - - it's\" # {quoted}\n"),
    )
    .unwrap();
    ok(voom(home.path())
        .args(["profiles", "show"])
        .arg(&fine)
        .output()
        .unwrap());
}
