//! The tensors of a synthetic checkpoint: planned (name, dtype, shape, how its bytes
//! are drawn), then written one after another, each drawn as it is written from one
//! generator in file order (so a seed gives the same bytes, and a checkpoint larger
//! than memory never is in memory: `safetensors::write_with`).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use anyhow::Result;
use voom_formats::dtype::f32_to_bf16;
use voom_formats::DType;

use super::Rng;

/// How a tensor's elements are drawn.
#[derive(Debug, Clone, Copy)]
pub(super) enum Kind {
    /// BF16 uniform in `offset ± scale`.
    Bf16 { scale: f32, offset: f32 },
    /// F32 uniform in `offset ± scale`.
    F32 { scale: f32, offset: f32 },
    /// Bytes, each the top eight bits of a draw (MXFP4's packed e2m1 pairs).
    Bytes,
    /// e8m0 exponents 117 to 120, one a draw (MXFP4 scales of about 2^-8).
    E8m0,
    /// e4m3 bytes of magnitude 0.25 to 3.75 (never NaN), either sign, eight a draw.
    Fp8,
    /// A `weight_scale_inv` for an FP8 weight of `cols` inputs: its values times
    /// these keep the outputs about the inputs' size.
    Fp8Scales { cols: usize },
}

/// One planned tensor.
#[derive(Debug, Clone)]
pub(super) struct Planned {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub kind: Kind,
}

impl Planned {
    /// Its bytes as stored.
    pub fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// The tensors of a checkpoint, in file order.
#[derive(Debug, Default)]
pub(super) struct Tensors {
    pub list: Vec<Planned>,
}

impl Tensors {
    pub fn add(&mut self, name: String, dtype: DType, shape: Vec<usize>, kind: Kind) {
        self.list.push(Planned {
            name,
            dtype,
            shape,
            kind,
        });
    }

    /// A BF16 tensor uniform in `offset ± scale`.
    pub fn push(&mut self, name: String, dims: Vec<usize>, scale: f32, offset: f32) {
        self.add(name, DType::BF16, dims, Kind::Bf16 { scale, offset });
    }

    /// MXFP4 `{stem}_blocks` `[count, rows, cols / 32, 16]` (random e2m1 pairs) and
    /// `{stem}_scales` `[count, rows, cols / 32]` (e8m0 exponents about 2^-7, so that
    /// a value is about `sqrt(3 / cols)` for gpt-oss's widths).
    pub fn mxfp4(&mut self, stem: &str, count: usize, rows: usize, cols: usize) {
        let groups = cols / 32;
        self.add(
            format!("{stem}_blocks"),
            DType::U8,
            vec![count, rows, groups, 16],
            Kind::Bytes,
        );
        self.add(
            format!("{stem}_scales"),
            DType::U8,
            vec![count, rows, groups],
            Kind::E8m0,
        );
    }

    /// An FP8 projection `{name}.weight` `[rows, cols]` and its `block`-square
    /// scales `{name}.weight_scale_inv`.
    pub fn fp8(&mut self, name: &str, block: usize, rows: usize, cols: usize) {
        self.add(
            format!("{name}.weight"),
            DType::F8E4M3,
            vec![rows, cols],
            Kind::Fp8,
        );
        self.add(
            format!("{name}.weight_scale_inv"),
            DType::F32,
            vec![rows.div_ceil(block), cols.div_ceil(block)],
            Kind::Fp8Scales { cols },
        );
    }

    /// An RMSNorm weight: about 1.
    pub fn norm(&mut self, name: String, n: usize) {
        self.push(name, vec![n], 0.1, 1.0);
    }

    /// A `[rows, cols]` projection, scaled so that outputs keep the inputs' size.
    pub fn linear(&mut self, name: String, rows: usize, cols: usize) {
        self.push(name, vec![rows, cols], (3.0 / cols as f32).sqrt(), 0.0);
    }

    /// A token embedding of small rows.
    pub fn embedding(&mut self, vocab: usize, hidden: usize) {
        self.push(
            "model.embed_tokens.weight".into(),
            vec![vocab, hidden],
            0.05,
            0.0,
        );
    }

    /// Layer `p`'s two norms and its q, k, v and o projections, in that order.
    pub fn attention(&mut self, p: &str, hidden: usize, q: usize, kv: usize) {
        self.norm(format!("{p}.input_layernorm.weight"), hidden);
        self.norm(format!("{p}.post_attention_layernorm.weight"), hidden);
        self.linear(format!("{p}.self_attn.q_proj.weight"), q, hidden);
        self.linear(format!("{p}.self_attn.k_proj.weight"), kv, hidden);
        self.linear(format!("{p}.self_attn.v_proj.weight"), kv, hidden);
        self.linear(format!("{p}.self_attn.o_proj.weight"), hidden, q);
    }

    /// The final norm and an untied LM head.
    pub fn head(&mut self, vocab: usize, hidden: usize) {
        self.norm("model.norm.weight".into(), hidden);
        self.linear("lm_head.weight".into(), vocab, hidden);
    }

    /// Bytes as stored.
    pub fn bytes(&self) -> usize {
        self.list.iter().map(Planned::bytes).sum()
    }

    /// Writes `model.safetensors` (the tensors drawn from `seed`'s generator as they
    /// are written) and `config.json` into `dir`.
    pub fn write(self, dir: &Path, seed: u64, config: &serde_json::Value) -> Result<()> {
        let specs: Vec<(&str, DType, &[usize])> = self
            .list
            .iter()
            .map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice()))
            .collect();
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        let mut rng = Rng(seed | 1);
        voom_formats::safetensors::write_with(
            &dir.join("model.safetensors"),
            &specs,
            &meta,
            &mut |i, w| fill(&self.list[i], &mut rng, w),
        )?;
        std::fs::write(
            dir.join("config.json"),
            serde_json::to_string_pretty(config)?,
        )?;
        Ok(())
    }
}

/// Tensor `t`'s bytes, drawn from `rng`, written to `w` a piece at a time.
pub(super) fn fill(t: &Planned, rng: &mut Rng, w: &mut dyn Write) -> std::io::Result<()> {
    let n: usize = t.shape.iter().product();
    let mut buf = Vec::with_capacity(1 << 20);
    let mut done = 0;
    while done < n {
        let k = (n - done).min(1 << 18);
        buf.clear();
        match t.kind {
            Kind::Bf16 { scale, offset } => {
                for _ in 0..k {
                    let x = offset + rng.uniform(scale);
                    buf.extend_from_slice(&f32_to_bf16(x).to_le_bytes());
                }
            }
            Kind::F32 { scale, offset } => {
                for _ in 0..k {
                    buf.extend_from_slice(&(offset + rng.uniform(scale)).to_le_bytes());
                }
            }
            Kind::Bytes => buf.extend((0..k).map(|_| (rng.next() >> 56) as u8)),
            Kind::E8m0 => buf.extend((0..k).map(|_| 117 + (rng.next() >> 62) as u8)),
            Kind::Fp8 => {
                let mut j = 0;
                while j < k {
                    let r = rng.next().to_le_bytes();
                    for &b in r.iter().take(k - j) {
                        // Sign and mantissa drawn, the exponent field 5 to 8: 2^-2
                        // to 2^1 times 1 to 1.875 (never 0x7f/0xff, NaN).
                        let e = 5 + ((b >> 3) & 3);
                        buf.push((b & 0x87) | (e << 3));
                    }
                    j += 8;
                }
            }
            Kind::Fp8Scales { cols } => {
                // Mean |e4m3| above is about 1.3; a product of `cols` terms keeps
                // its size with weights of about sqrt(3 / cols).
                let base = (3.0 / cols as f32).sqrt() / 1.3;
                for _ in 0..k {
                    let s = base * (1.0 + rng.uniform(0.25));
                    buf.extend_from_slice(&s.to_le_bytes());
                }
            }
        }
        w.write_all(&buf)?;
        done += k;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_bytes_are_never_nan_and_fill_their_length() {
        let t = Planned {
            name: "w".into(),
            dtype: DType::F8E4M3,
            shape: vec![3, 333],
            kind: Kind::Fp8,
        };
        let mut out = Vec::new();
        fill(&t, &mut Rng(7), &mut out).unwrap();
        assert_eq!(out.len(), 999);
        assert!(out.iter().all(|b| b & 0x7f != 0x7f));
        let e: std::collections::BTreeSet<u8> = out.iter().map(|b| (b >> 3) & 0xf).collect();
        assert_eq!(e.into_iter().collect::<Vec<_>>(), [5, 6, 7, 8]);
    }

    #[test]
    fn every_kind_fills_exactly_its_bytes() {
        let kinds = [
            (
                DType::BF16,
                Kind::Bf16 {
                    scale: 1.0,
                    offset: 0.0,
                },
            ),
            (
                DType::F32,
                Kind::F32 {
                    scale: 1.0,
                    offset: 0.0,
                },
            ),
            (DType::U8, Kind::Bytes),
            (DType::U8, Kind::E8m0),
            (DType::F8E4M3, Kind::Fp8),
            (DType::F32, Kind::Fp8Scales { cols: 64 }),
        ];
        for (dtype, kind) in kinds {
            // Past one piece (1 << 18 elements), and an odd count.
            for n in [7, (1 << 18) + 3] {
                let t = Planned {
                    name: "t".into(),
                    dtype,
                    shape: vec![n],
                    kind,
                };
                let mut out = Vec::new();
                fill(&t, &mut Rng(3), &mut out).unwrap();
                assert_eq!(out.len(), t.bytes(), "{kind:?} of {n}");
            }
        }
    }
}
