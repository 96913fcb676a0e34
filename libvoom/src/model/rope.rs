//! Rotary embedding frequencies, computed as transformers computes them in float32.

use crate::config::{ModelConfig, RopeScaling};

/// Inverse frequencies of the rotary embedding, `head_dim / 2` of them.
pub fn inv_freq(cfg: &ModelConfig) -> Vec<f32> {
    let dim = cfg.head_dim;
    let base = cfg.rope_theta;
    // transformers: 1.0 / (base ** (arange(0, dim, 2).float() / dim)), in float32.
    let plain: Vec<f32> = (0..dim / 2)
        .map(|i| 1.0f32 / base.powf((2 * i) as f32 / dim as f32))
        .collect();
    match &cfg.rope_scaling {
        RopeScaling::Default => plain,
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            // transformers' _compute_llama3_parameters.
            let old_ctx = *original_max_position_embeddings as f32;
            let low_freq_wavelen = old_ctx / low_freq_factor;
            let high_freq_wavelen = old_ctx / high_freq_factor;
            plain
                .iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    let scaled = if wavelen > low_freq_wavelen {
                        f / factor
                    } else {
                        f
                    };
                    // wavelen is finite and positive, so this is transformers' `~(w < high) & ~(w > low)`.
                    let is_medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
                    if is_medium {
                        let smooth = (old_ctx / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    }
                })
                .collect()
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
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
