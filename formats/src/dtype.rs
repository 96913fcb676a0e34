//! Element types of checkpoint tensors and their exact conversions to f32.

use serde::{Deserialize, Serialize};

/// An element type as named by safetensors (`"BF16"`, `"F32"`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum DType {
    Bool,
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    U64,
    I64,
    F16,
    BF16,
    F32,
    F64,
    /// FP8 e4m3 (OCP "FN": no infinities; `0x7f`/`0xff` are NaN), safetensors `F8_E4M3`.
    #[serde(rename = "F8_E4M3")]
    F8E4M3,
    /// FP8 e5m2, safetensors `F8_E5M2`: known, so that a checkpoint of it is refused
    /// by name (no release vOOM knows stores weights in it).
    #[serde(rename = "F8_E5M2")]
    F8E5M2,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
        }
    }

    /// The safetensors spelling of this type.
    pub fn as_str(self) -> &'static str {
        match self {
            DType::Bool => "BOOL",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::U16 => "U16",
            DType::I16 => "I16",
            DType::U32 => "U32",
            DType::I32 => "I32",
            DType::U64 => "U64",
            DType::I64 => "I64",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::F8E4M3 => "F8_E4M3",
            DType::F8E5M2 => "F8_E5M2",
        }
    }

    /// Parses the safetensors spelling; `None` for a type vOOM does not know.
    pub fn from_safetensors(s: &str) -> Option<DType> {
        Some(match s {
            "BOOL" => DType::Bool,
            "U8" => DType::U8,
            "I8" => DType::I8,
            "U16" => DType::U16,
            "I16" => DType::I16,
            "U32" => DType::U32,
            "I32" => DType::I32,
            "U64" => DType::U64,
            "I64" => DType::I64,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            "F32" => DType::F32,
            "F64" => DType::F64,
            "F8_E4M3" => DType::F8E4M3,
            "F8_E5M2" => DType::F8E5M2,
            _ => return None,
        })
    }

    /// True for the floating-point types the engine computes on (BF16, F16, F32).
    pub fn is_compute_float(self) -> bool {
        matches!(self, DType::BF16 | DType::F16 | DType::F32)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// BF16 bits to f32: exact (BF16 is the top half of an f32).
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 to BF16 bits with round-to-nearest-even, as PyTorch's `tensor.to(torch.bfloat16)` does.
/// NaN stays NaN (quiet).
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// F16 bits to f32: exact.
#[inline(always)]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// Reads element `i` of a little-endian BF16/F16/F32 buffer as f32.
///
/// # Panics
/// If `dtype` is not a compute float type or `i` is out of range.
#[inline]
pub fn read_f32(dtype: DType, bytes: &[u8], i: usize) -> f32 {
    match dtype {
        DType::BF16 => bf16_to_f32(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])),
        DType::F16 => f16_to_f32(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])),
        DType::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()),
        other => panic!("read_f32 on non-float dtype {other}"),
    }
}

/// Converts a whole little-endian BF16/F16/F32 buffer to f32.
pub fn to_f32_vec(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    let n = bytes.len() / dtype.size();
    (0..n).map(|i| read_f32(dtype, bytes, i)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_is_exact_for_bf16_values() {
        for bits in (0u16..=u16::MAX).step_by(7) {
            let x = bf16_to_f32(bits);
            if x.is_nan() {
                continue;
            }
            assert_eq!(f32_to_bf16(x), bits);
        }
    }

    #[test]
    fn f32_to_bf16_rounds_to_nearest_even() {
        // 1.0 + 2^-8 is exactly halfway between two BF16 values: ties to even (1.0).
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        // 1.0 + 3 * 2^-8 is halfway; the even neighbour is 1.0 + 2^-6.
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
    }

    #[test]
    fn names_round_trip() {
        for d in [
            DType::BF16,
            DType::F16,
            DType::F32,
            DType::I64,
            DType::Bool,
            DType::F8E4M3,
            DType::F8E5M2,
        ] {
            assert_eq!(DType::from_safetensors(d.as_str()), Some(d));
            // The manifest's JSON spells it as safetensors does.
            let json = serde_json::to_string(&d).unwrap();
            assert_eq!(json, format!("\"{}\"", d.as_str()));
            assert_eq!(serde_json::from_str::<DType>(&json).unwrap(), d);
        }
        assert_eq!(DType::from_safetensors("F8_E8M0"), None);
    }
}
