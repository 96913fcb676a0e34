//! What a tensor's stored bytes are, for listings (`vpagectl pages`, `voom plan`):
//! a plain float, or a part of a quantized weight as released checkpoints store them
//! (FP8 e4m3 weights with `*_scale_inv` block scales; MXFP4 `*_blocks` of packed
//! e2m1 pairs with `*_scales` of e8m0 exponents). Read from the tensors' names and
//! dtypes alone; the engine checks the pairing and shapes when it loads them.

use crate::DType;

/// The stored format of one tensor (one page, or the parts of one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoredFormat {
    /// Values of a float (or other) dtype, as they are.
    Plain(DType),
    /// FP8 e4m3 weights, each block of them scaled by its `_scale_inv`.
    Fp8E4M3,
    /// The block scales of an FP8 weight (F32 or BF16).
    Fp8Scales(DType),
    /// MXFP4 weights: two e2m1 values a byte, low nibble first.
    Mxfp4Blocks,
    /// The e8m0 exponents of MXFP4 weights, one per 32 values.
    Mxfp4Scales,
}

impl StoredFormat {
    /// The format of tensor `name` of `dtype`, where `has(other)` tells whether the
    /// checkpoint holds a tensor named `other` (the weight a scale belongs to).
    pub fn of(name: &str, dtype: DType, has: impl Fn(&str) -> bool) -> StoredFormat {
        if dtype == DType::F8E4M3 {
            return StoredFormat::Fp8E4M3;
        }
        if let Some(weight) = name.strip_suffix("_scale_inv") {
            if matches!(dtype, DType::F32 | DType::BF16) && has(weight) {
                return StoredFormat::Fp8Scales(dtype);
            }
        }
        if dtype == DType::U8 {
            if name.ends_with("_blocks") {
                return StoredFormat::Mxfp4Blocks;
            }
            if let Some(stem) = name.strip_suffix("_scales") {
                if has(&format!("{stem}_blocks")) {
                    return StoredFormat::Mxfp4Scales;
                }
            }
        }
        StoredFormat::Plain(dtype)
    }

    /// Whether it is part of a quantized weight.
    pub fn is_quantized(self) -> bool {
        !matches!(self, StoredFormat::Plain(_))
    }
}

impl std::fmt::Display for StoredFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoredFormat::Plain(d) => write!(f, "{d}"),
            StoredFormat::Fp8E4M3 => write!(f, "FP8 e4m3"),
            StoredFormat::Fp8Scales(d) => write!(f, "FP8 scales {d}"),
            StoredFormat::Mxfp4Blocks => write!(f, "MXFP4 e2m1"),
            StoredFormat::Mxfp4Scales => write!(f, "MXFP4 e8m0"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_follow_the_releases_names() {
        let names = [
            "a.q_proj.weight",
            "m.experts.gate_up_proj_blocks",
            "m.experts.gate_up_proj_scales",
        ];
        let has = |n: &str| names.contains(&n);
        let of = |n: &str, d| StoredFormat::of(n, d, has).to_string();
        assert_eq!(of("a.q_proj.weight", DType::F8E4M3), "FP8 e4m3");
        assert_eq!(
            of("a.q_proj.weight_scale_inv", DType::F32),
            "FP8 scales F32"
        );
        assert_eq!(of("a.k_proj.weight_scale_inv", DType::F32), "F32");
        assert_eq!(of("m.experts.gate_up_proj_blocks", DType::U8), "MXFP4 e2m1");
        assert_eq!(of("m.experts.gate_up_proj_scales", DType::U8), "MXFP4 e8m0");
        assert_eq!(of("m.experts.down_proj_scales", DType::U8), "U8");
        assert_eq!(of("a.norm.weight", DType::BF16), "BF16");
        assert!(!StoredFormat::of("x", DType::BF16, has).is_quantized());
    }
}
