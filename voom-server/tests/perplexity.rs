//! `voom perplexity` end to end: the built binary on a committed model with a
//! tokenizer (tests/fixtures/tiny_chat, random weights) and the committed
//! public-domain text (tests/fixtures/text/alice.txt), with a small context.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn voom() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_voom"));
    c.env_remove("VOOM_THREADS")
        .env_remove("VOOM_VERIFY")
        .env_remove("VOOM_PROFILE");
    c
}

fn repo(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(p)
}

fn model() -> PathBuf {
    repo("tests/fixtures/tiny_chat")
}

fn text() -> PathBuf {
    repo("tests/fixtures/text/alice.txt")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn last_json(o: &Output) -> Value {
    assert!(o.status.success(), "voom failed: {}", stderr(o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let line = out
        .lines()
        .last()
        .unwrap_or_else(|| panic!("no output; stderr: {}", stderr(o)));
    serde_json::from_str(line).unwrap_or_else(|e| panic!("last line is not JSON ({e}): {line}"))
}

/// `voom perplexity` of the fixture text with `--ctx 32 --chunks CHUNKS --json`.
fn perplexity(chunks: &str, extra: &[&str]) -> Output {
    voom()
        .arg("perplexity")
        .arg(model())
        .arg("--text")
        .arg(text())
        .args(["--ctx", "32", "--chunks", chunks, "--json"])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn json_reports_the_perplexity_of_the_scored_half_of_each_chunk() {
    let o = perplexity("2", &[]);
    let j = last_json(&o);
    assert_eq!(j["ctx"], 32);
    assert_eq!(j["chunks"], 2);
    // Positions 16..31 of each chunk predict tokens 17..32: 15 a chunk.
    assert_eq!(j["scored"], 30);
    assert!(j["tokens"].as_u64().unwrap() >= 64, "{j}");
    assert_eq!(j["exact"], true);
    assert_eq!(j["scheme"], Value::Null);
    assert_eq!(j["kl"], Value::Null);
    assert_eq!(j["bos"], false, "tiny_chat's tokenizer adds no BOS");
    let ppl = j["ppl"].as_f64().unwrap();
    assert!(ppl.is_finite() && ppl > 1.0, "{j}");
    assert!(j["ppl_stderr"].as_f64().unwrap() > 0.0, "{j}");
    // The running values and llama-perplexity's final line, on stderr.
    let e = stderr(&o);
    assert!(e.contains("[1]") && e.contains("[2]"), "{e}");
    assert!(e.contains("Final estimate: PPL = "), "{e}");
    // Deterministic: the same figure again, and the first chunk alone is a prefix
    // of the running values.
    let again = last_json(&perplexity("2", &[]));
    assert_eq!(again["ppl"], j["ppl"]);
    let one = last_json(&perplexity("1", &[]));
    assert_eq!(one["scored"], 15);
    let first = format!("[1]{:.4},", one["ppl"].as_f64().unwrap());
    assert!(e.contains(&first), "{first} in {e}");
}

#[test]
fn kl_of_a_model_against_itself_is_zero_with_full_agreement() {
    let m = model();
    let j = last_json(&perplexity("2", &["--kl-base", m.to_str().unwrap()]));
    let kl = &j["kl"];
    assert_eq!(kl["mean"].as_f64(), Some(0.0), "{j}");
    assert_eq!(kl["p99"].as_f64(), Some(0.0), "{j}");
    assert_eq!(kl["max"].as_f64(), Some(0.0), "{j}");
    assert_eq!(kl["same_top"].as_f64(), Some(1.0), "{j}");
    assert_eq!(kl["base_ppl"], j["ppl"]);
    assert_eq!(kl["ln_ppl_ratio"].as_f64(), Some(0.0));
}

#[test]
fn a_text_shorter_than_two_chunks_is_an_error_naming_it() {
    let d = tempfile::tempdir().unwrap();
    let short = d.path().join("short.txt");
    std::fs::write(&short, "Alice was beginning to get very tired.\n").unwrap();
    let o = voom()
        .arg("perplexity")
        .arg(model())
        .arg("--text")
        .arg(&short)
        .args(["--ctx", "32"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("short.txt"), "{e}");
    assert!(e.contains("needs at least 64"), "{e}");
    assert!(e.contains("tokenizes to only"), "{e}");
}

#[test]
fn a_model_without_a_tokenizer_is_an_error() {
    let o = voom()
        .arg("perplexity")
        .arg(repo("tests/fixtures/tiny/llama_gqa_untied"))
        .arg("--text")
        .arg(text())
        .args(["--ctx", "32"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("no tokenizer"), "{e}");
}

#[test]
fn a_base_of_another_vocabulary_is_an_error_naming_both() {
    // tiny_chat's vocabulary is 768; llama_gqa_untied's 384.
    let o = perplexity(
        "2",
        &[
            "--kl-base",
            repo("tests/fixtures/tiny/llama_gqa_untied")
                .to_str()
                .unwrap(),
        ],
    );
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("vocabulary"), "{e}");
    assert!(
        e.contains("tiny_chat") && e.contains("llama_gqa_untied"),
        "{e}"
    );
}
