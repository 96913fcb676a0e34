//! GGUF files written by llama.cpp's own converter (tests/fixtures/gguf/converted:
//! `convert_hf_to_gguf.py` of tiny llama, qwen2, qwen3 and qwen3_moe checkpoints,
//! to BF16 and Q8_0; tests/conformance/gguf_fixtures.py) import into the models
//! they came from:
//! - the BF16 file, kept as stored, computes the bits of the Hugging Face checkpoint
//!   it was converted from at every position (llama.cpp's names, hyperparameter
//!   keys, Q/K row permutation, stacked experts and F32 norms all undone exactly);
//! - its tokenizer, built from the GGUF's metadata, gives the checkpoint's
//!   tokenizer.json ids;
//! - the Q8_0 file (gguf-py's reference quantization) is a lossy model that
//!   computes the bits of the F32 checkpoint of its dequantized values.

mod common;

use std::path::{Path, PathBuf};

use libvoom::engine::{Engine, EngineOptions};
use libvoom::import::{import_gguf_as, WeightsAs};

const CASES: [&str; 4] = ["llama", "qwen2", "qwen3", "qwen3_moe"];

fn case_dir(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/gguf/converted")
        .join(case)
}

fn import(gguf: &Path, out: &Path, how: WeightsAs) -> libvoom::import::ImportReport {
    import_gguf_as(gguf, out, how, &mut |_, _| {})
        .unwrap_or_else(|e| panic!("importing {}: {e}", gguf.display()))
}

fn open(dir: &Path) -> Engine {
    Engine::open(dir, EngineOptions::default())
        .unwrap_or_else(|e| panic!("opening {}: {e}", dir.display()))
}

/// Ids of a text with tokenizer.json's special tokens and several pre-tokenizer
/// cases (digits, contractions, newlines, non-ASCII).
const TEXT: &str = "Hello world! It's 2024,\n\n  the quick brown fox — naïve café 12345.";

#[test]
fn a_converted_bf16_gguf_computes_its_checkpoints_bits() {
    for case in CASES {
        let dir = case_dir(case);
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join(case);
        let r = import(&dir.join("model.bf16.gguf"), &out, WeightsAs::Stored);
        assert_eq!(r.scheme, None, "{case}: a BF16 file is not lossy");
        let (hf, gguf) = (open(&dir.join("hf")), open(&out));
        let ids = hf.tokenizer().unwrap().encode(TEXT, true).unwrap();
        assert_eq!(
            gguf.tokenizer().unwrap().encode(TEXT, true).unwrap(),
            ids,
            "{case}: tokenizer from the GGUF's metadata"
        );
        assert!(ids.len() > 10, "{case}: {ids:?}");
        assert_eq!(
            common::run_bits(&gguf, &ids, 6),
            common::run_bits(&hf, &ids, 6),
            "{case}: logits bits and greedy ids"
        );
    }
}

#[test]
fn a_converted_q8_0_gguf_is_a_lossy_model_of_its_dequantized_values() {
    for case in CASES {
        let dir = case_dir(case);
        let tmp = tempfile::tempdir().unwrap();
        let (lossy, floats) = (tmp.path().join("lossy"), tmp.path().join("f32"));
        let gguf = dir.join("model.q8_0.gguf");
        let r = import(&gguf, &lossy, WeightsAs::Stored);
        assert_eq!(r.scheme.as_deref(), Some("q8_0"), "{case}");
        import(&gguf, &floats, WeightsAs::F32);
        let e = open(&lossy);
        assert_eq!(e.lossy_scheme(), Some("q8_0"));
        let ids = e.tokenizer().unwrap().encode(TEXT, true).unwrap();
        assert_eq!(
            common::run_bits(&e, &ids, 6),
            common::run_bits(&open(&floats), &ids, 6),
            "{case}"
        );
    }
}
