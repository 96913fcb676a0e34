//! Fuzzes `config.json` parsing: any byte string, read as a model's `config.json`,
//! must parse to a configuration that satisfies every invariant the model code sizes
//! things from, or fail with an error; never a panic, an abort or an allocation in
//! proportion to a value in the file. Run with `cargo +nightly fuzz run config_json`
//! in `libvoom/`.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use libvoom::config::{limits, token_ids, HfConfig, ModelConfig, RopeScaling};
use libvoom::model::rope;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    // `ModelConfig::from_dir` reads the file as UTF-8 text, then parses that.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("config.json");
    if let Ok(v) = serde_json::from_str::<Value>(text) {
        // The typed layer on its own, and the token-id reader on every value of the
        // file (transformers' reading of bos/eos ids: one id or a list).
        let _ = HfConfig::from_value(&v);
        if let Value::Object(o) = &v {
            for (i, x) in o.values().enumerate() {
                let vocab = [0, 1, 256, u32::MAX as usize, usize::MAX][i % 5];
                for id in token_ids(Some(x), "fuzz", vocab, path) {
                    assert!((id as usize) < vocab);
                }
            }
        }
    }
    let Ok(cfg) = ModelConfig::from_json(text, path) else {
        return;
    };
    check(&cfg);
    // Deterministic: the same text gives the same configuration.
    assert_eq!(ModelConfig::from_json(text, path).ok().as_ref(), Some(&cfg));
});

/// What `ModelConfig::from_hf` promises of every configuration it returns.
fn check(cfg: &ModelConfig) {
    let path = Path::new("config.json");
    cfg.validate(path).expect("a parsed config validates");
    assert!((1..=limits::LAYERS).contains(&cfg.num_layers));
    assert!((1..=limits::WIDTH).contains(&cfg.hidden_size));
    assert!((1..=limits::WIDTH).contains(&cfg.intermediate_size));
    assert!((1..=limits::HEADS).contains(&cfg.num_heads));
    assert!(cfg.num_kv_heads >= 1 && cfg.num_heads % cfg.num_kv_heads == 0);
    assert!((2..=limits::HEAD_DIM).contains(&cfg.head_dim) && cfg.head_dim % 2 == 0);
    assert!(cfg.num_heads * cfg.head_dim <= limits::WIDTH);
    assert!((1..=limits::VOCAB).contains(&cfg.vocab_size));
    assert!((1..=limits::POSITIONS).contains(&cfg.max_position_embeddings));
    assert!(cfg.rms_norm_eps.is_finite() && cfg.rms_norm_eps > 0.0);
    assert!(cfg.rope_theta.is_finite() && cfg.rope_theta > 0.0);
    if let RopeScaling::Llama3 {
        factor,
        low_freq_factor,
        high_freq_factor,
        original_max_position_embeddings,
    } = cfg.rope_scaling
    {
        for f in [factor, low_freq_factor, high_freq_factor] {
            assert!(f.is_finite() && f > 0.0);
        }
        assert!(high_freq_factor > low_freq_factor);
        assert!((1..=limits::POSITIONS).contains(&original_max_position_embeddings));
    }
    assert_eq!(cfg.sliding_window.len(), cfg.num_layers);
    assert!(cfg.sliding_window.iter().all(|w| *w != Some(0)));
    for id in cfg.bos_token_id.iter().chain(&cfg.eos_token_ids) {
        assert!((*id as usize) < cfg.vocab_size);
    }
    // The rotary tables the model computes: finite at the first and last positions.
    let inv_freq = cfg.rope_inv_freq();
    assert_eq!(inv_freq.len(), cfg.head_dim / 2);
    let (mut cos, mut sin) = (vec![0f32; inv_freq.len()], vec![0f32; inv_freq.len()]);
    for pos in [0, cfg.max_position_embeddings - 1] {
        rope::cos_sin(&inv_freq, pos, &mut cos, &mut sin);
        assert!(
            cos.iter().chain(&sin).all(|x| x.is_finite()),
            "rotary angle at {pos}"
        );
    }
}
