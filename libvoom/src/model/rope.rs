//! Rotary embedding frequencies, computed as transformers computes them in float32.

use crate::backend::RopeTable;
use crate::config::ModelConfig;

/// Inverse frequencies of the rotary embedding, `head_dim / 2` of them
/// ([`ModelConfig::rope_inv_freq`]).
pub fn inv_freq(cfg: &ModelConfig) -> Vec<f32> {
    cfg.rope_inv_freq()
}

/// cos/sin of `pos * inv_freq` for one position, each `inv_freq.len()` long.
pub fn cos_sin(inv_freq: &[f32], pos: usize, cos: &mut [f32], sin: &mut [f32]) {
    let p = pos as f32;
    for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(inv_freq) {
        let a = p * f;
        *c = a.cos();
        *s = a.sin();
    }
}

/// The rotary table of positions `pos0..pos0 + n` ([`cos_sin`] for each).
pub fn table(inv_freq: &[f32], pos0: usize, n: usize) -> RopeTable {
    let half = inv_freq.len();
    let mut cos = vec![0f32; n * half];
    let mut sin = vec![0f32; n * half];
    for t in 0..n {
        cos_sin(
            inv_freq,
            pos0 + t,
            &mut cos[t * half..(t + 1) * half],
            &mut sin[t * half..(t + 1) * half],
        );
    }
    RopeTable { half, cos, sin }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ModelConfig, RopeScaling};
    use std::path::Path;

    #[test]
    fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let json = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 8, "max_position_embeddings": 256,
            "rope_theta": 10000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}"#;
        let cfg = ModelConfig::from_json(json, Path::new("c")).unwrap();
        let mut plain_cfg = cfg.clone();
        plain_cfg.rope_scaling = RopeScaling::Default;
        let (s, p) = (inv_freq(&cfg), inv_freq(&plain_cfg));
        assert_eq!(s[0], p[0]);
        let last = p.len() - 1;
        assert_eq!(s[last], p[last] / 8.0);
    }
}
