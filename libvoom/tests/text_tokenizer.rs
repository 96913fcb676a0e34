//! The tokenizer against expected values computed by Python `tokenizers` and checked
//! against transformers (tests/conformance/text_reference.py).

use std::path::{Path, PathBuf};

use libvoom::text::{TextError, Tokenizer};
use serde_json::Value;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/text/bpe_tiny")
}

fn expected() -> Value {
    let text = std::fs::read_to_string(fixture_dir().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn encodes_like_python() {
    let tok = Tokenizer::from_dir(&fixture_dir()).unwrap();
    let exp = expected();
    let cases = exp["encode"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        assert_eq!(tok.encode(text, false).unwrap(), ids(&c["ids"]), "{text:?}");
        assert_eq!(
            tok.encode(text, true).unwrap(),
            ids(&c["ids_with_special"]),
            "{text:?}"
        );
    }
}

#[test]
fn decodes_like_python() {
    let tok = Tokenizer::from_dir(&fixture_dir()).unwrap();
    let exp = expected();
    let encode_cases = exp["encode"].as_array().unwrap();
    let raw_cases = exp["decode"].as_array().unwrap();
    for c in encode_cases
        .iter()
        .map(|c| (&c["ids_with_special"], c))
        .chain(raw_cases.iter().map(|c| (&c["ids"], c)))
    {
        let (seq, case) = c;
        let seq = ids(seq);
        assert_eq!(
            tok.decode(&seq, false).unwrap(),
            case["decode_keep_special"].as_str().unwrap(),
            "{seq:?}"
        );
        assert_eq!(
            tok.decode(&seq, true).unwrap(),
            case["decode_skip_special"].as_str().unwrap(),
            "{seq:?}"
        );
    }
    // The raw cases hold lone partial characters: the full decode shows U+FFFD.
    assert!(raw_cases[0]["decode_keep_special"]
        .as_str()
        .unwrap()
        .contains('\u{FFFD}'));
}

#[test]
fn special_tokens_and_eos_ids_from_all_configs() {
    let tok = Tokenizer::from_dir(&fixture_dir()).unwrap();
    let exp = expected();
    assert_eq!(
        tok.vocab_size(),
        exp["vocab_size"].as_u64().unwrap() as usize
    );
    // generation_config [im_end, endoftext], then config.json </s>, then eos_token (im_end, a duplicate).
    assert_eq!(tok.eos_ids(), ids(&exp["eos_ids"]).as_slice());
    assert_eq!(tok.bos_token(), Some("<s>")); // from the AddedToken object form
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert_eq!(tok.bos_id(), tok.token_to_id("<s>"));
    assert_eq!(
        tok.token_to_id("<s>"),
        exp["special_ids"]["<s>"].as_u64().map(|v| v as u32)
    );
    assert_eq!(tok.add_bos_token(), Some(true));
    assert!(!tok.cleans_up_spaces());
}

#[test]
fn config_chat_template_renders() {
    let tok = Tokenizer::from_dir(&fixture_dir()).unwrap();
    let t = tok
        .chat_template()
        .expect("tokenizer_config.json has a chat_template");
    let msgs = [serde_json::json!({"role": "user", "content": "héllo 😀"})];
    let out = t.render(&msgs, None, true, None).unwrap();
    assert_eq!(
        out,
        "<|im_start|>user\nhéllo 😀<|im_end|>\n<|im_start|>assistant\n"
    );
    // The rendered prompt encodes with its special tokens as single ids.
    let ids = tok.encode(&out, false).unwrap();
    assert_eq!(ids[0], tok.token_to_id("<|im_start|>").unwrap());
    assert_eq!(tok.decode(&ids, false).unwrap(), out);
}

#[test]
fn unknown_ids_are_typed_errors() {
    let tok = Tokenizer::from_dir(&fixture_dir()).unwrap();
    let n = tok.vocab_size() as u32;
    match tok.decode(&[1, n], false) {
        Err(TextError::UnknownTokenId { id, vocab_size }) => {
            assert_eq!(id, n);
            assert_eq!(vocab_size, n as usize);
        }
        other => panic!("expected UnknownTokenId, got {other:?}"),
    }
}

/// Every tokenizer a test can reach: the fixtures, and SmolLM2's when it is there.
fn every_tokenizer() -> Vec<Tokenizer> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root.join("tests/fixtures/text"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|d| d.join("tokenizer.json").is_file())
        .collect();
    dirs.push(root.join("../tests/fixtures/tiny_chat"));
    if let Some(d) = std::env::var_os("VOOM_SMOLLM2_DIR") {
        dirs.push(PathBuf::from(d));
    }
    dirs.iter()
        .map(|d| Tokenizer::from_dir(d).unwrap())
        .collect()
}

/// `min_tokens` is a lower bound on what `encode` gives, on texts made to be cheap
/// per byte (long runs, long words, special tokens' text, multi-byte characters),
/// and it is not vacuous where the tokenizer allows a bound.
#[test]
fn min_tokens_never_exceeds_the_encoded_length() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let atoms = [
        " ",
        "\n",
        "a",
        "the",
        " the",
        "Hello world",
        "<|im_start|>",
        "<|im_end|>",
        "</s>",
        "é",
        "𝐀",
        "K",
        "\u{301}",
        "日本語",
        "0123456789",
        "\t",
        "ab",
        "  ",
    ];
    for tok in every_tokenizer() {
        let mut bounded = false;
        for _ in 0..150 {
            let repeat = [1, 10, 1000][rng.gen_range(0..3)];
            let mut text = String::new();
            for _ in 0..rng.gen_range(1..20) {
                let a = atoms[rng.gen_range(0..atoms.len())];
                for _ in 0..rng.gen_range(1..=repeat) {
                    text.push_str(a);
                }
            }
            let n = tok.encode(&text, false).unwrap().len();
            let lower = tok.min_tokens(&text);
            assert!(
                lower <= n,
                "{}: bound {lower} > {n} tokens for {text:?}",
                tok.dir().display()
            );
            bounded |= lower > 0;
        }
        // Byte-level BPE tokenizers (all of these) have a bound.
        assert!(bounded, "{}: no bound", tok.dir().display());
    }
}
