//! Rotary tables of a pass's positions, from the frequencies the config computes
//! ([`crate::config::ModelConfig::rope_inv_freq`], as transformers does in float32).

use crate::backend::RopeTable;

/// cos/sin of `pos * inv_freq` for one position, each `inv_freq.len()` long.
pub fn cos_sin(inv_freq: &[f32], pos: usize, cos: &mut [f32], sin: &mut [f32]) {
    let p = pos as f32;
    for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(inv_freq) {
        let a = p * f;
        *c = a.cos();
        *s = a.sin();
    }
}

/// The rotary table of positions `pos0..pos0 + n` ([`cos_sin`] for each), cos and
/// sin multiplied by `factor` (YaRN's attention factor; 1 leaves them exact).
pub fn table(inv_freq: &[f32], factor: f32, pos0: usize, n: usize) -> RopeTable {
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
    if factor != 1.0 {
        for v in cos.iter_mut().chain(sin.iter_mut()) {
            *v *= factor;
        }
    }
    RopeTable { half, cos, sin }
}

/// Tables one after the other, as one (the positions of several sequences' rows
/// in one chunk). One table is returned as it is.
pub fn concat(mut parts: Vec<RopeTable>) -> RopeTable {
    if parts.len() == 1 {
        return parts.pop().expect("one part");
    }
    let half = parts.first().map_or(0, |p| p.half);
    let mut cos = Vec::new();
    let mut sin = Vec::new();
    for p in parts {
        debug_assert_eq!(p.half, half, "tables of one model");
        cos.extend(p.cos);
        sin.extend(p.sin);
    }
    RopeTable { half, cos, sin }
}
