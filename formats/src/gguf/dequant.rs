//! Dequantization of ggml tensor types to f32, exactly as ggml's reference
//! `dequantize_row_*` (ggml-quants.c) computes it: each f16 scale is converted to f32
//! exactly, then `y = d * q` (or `y = d * q + m`) in f32 per element. The products
//! are exact in f32 (at most 8 + 11 significant bits), so the result has at most one
//! rounding and does not depend on fused multiply-add. The `gguf` Python package
//! computes the same values.

use super::GgmlType;
use crate::dtype::{bf16_to_f32, f16_to_f32};

/// Why a buffer could not be dequantized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    /// vOOM has no dequantizer for this type.
    #[error("dequantization of ggml type {0} is not supported")]
    Unsupported(GgmlType),
    /// The element count is not a whole number of blocks.
    #[error("{n_elements} elements are not a whole number of {ty} blocks of {block}")]
    PartialBlock {
        ty: GgmlType,
        n_elements: usize,
        block: usize,
    },
    /// The byte buffer does not hold exactly the given number of elements.
    #[error("{n_elements} elements of {ty} take {expected} bytes, got {actual}")]
    Length {
        ty: GgmlType,
        n_elements: usize,
        expected: usize,
        actual: usize,
    },
}

/// Dequantizes `n_elements` elements of type `ty` held in `bytes` (which must be
/// exactly their size) to f32, in ggml element order.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n_elements: usize) -> Result<Vec<f32>, DequantError> {
    check(ty, bytes, n_elements)?;
    let mut out = vec![0f32; n_elements];
    dequantize_into(ty, bytes, &mut out)?;
    Ok(out)
}

/// Like [`dequantize`], writing into `out` (whose length is the element count).
pub fn dequantize_into(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    check(ty, bytes, out.len())?;
    match ty {
        GgmlType::F32 => {
            for (y, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *y = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (y, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *y = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        GgmlType::BF16 => {
            for (y, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *y = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        // block_q8_0 { f16 d; i8 qs[32]; }
        GgmlType::Q8_0 => {
            for (y, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(34)) {
                let d = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                for (yj, &q) in y.iter_mut().zip(&b[2..34]) {
                    *yj = (q as i8) as f32 * d;
                }
            }
        }
        // block_q4_0 { f16 d; u8 qs[16]; }: low nibbles are elements 0..16, high
        // nibbles 16..32, both offset by 8.
        GgmlType::Q4_0 => {
            for (y, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(18)) {
                let d = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                let (lo, hi) = y.split_at_mut(16);
                for j in 0..16 {
                    let q = b[2 + j];
                    lo[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
                    hi[j] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        // block_q4_1 { f16 d; f16 m; u8 qs[16]; }: y = q*d + m, q unsigned.
        GgmlType::Q4_1 => {
            for (y, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(20)) {
                let d = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                let m = f16_to_f32(u16::from_le_bytes([b[2], b[3]]));
                let (lo, hi) = y.split_at_mut(16);
                for j in 0..16 {
                    let q = b[4 + j];
                    // q*d is exact (4-bit q times an 11-bit f16 significand), so the only
                    // rounding is that of the sum, fused or not.
                    lo[j] = (q & 0x0f) as f32 * d + m;
                    hi[j] = (q >> 4) as f32 * d + m;
                }
            }
        }
        other => return Err(DequantError::Unsupported(other)),
    }
    Ok(())
}

fn check(ty: GgmlType, bytes: &[u8], n_elements: usize) -> Result<(), DequantError> {
    if !matches!(
        ty,
        GgmlType::F32
            | GgmlType::F16
            | GgmlType::BF16
            | GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q4_1
    ) {
        return Err(DequantError::Unsupported(ty));
    }
    let (block, block_bytes) = ty.block();
    let (block, block_bytes) = (block as usize, block_bytes as usize);
    if !n_elements.is_multiple_of(block) {
        return Err(DequantError::PartialBlock {
            ty,
            n_elements,
            block,
        });
    }
    let expected = (n_elements / block).checked_mul(block_bytes);
    if expected != Some(bytes.len()) {
        return Err(DequantError::Length {
            ty,
            n_elements,
            expected: expected.unwrap_or(usize::MAX),
            actual: bytes.len(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const F16_ONE: [u8; 2] = [0x00, 0x3c];
    const F16_HALF: [u8; 2] = [0x00, 0x38];
    const F16_MINUS_TWO: [u8; 2] = [0x00, 0xc0];

    #[test]
    fn q8_0_block() {
        let mut b = F16_HALF.to_vec();
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let y = dequantize(GgmlType::Q8_0, &b, 32).unwrap();
        let want: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.5).collect();
        assert_eq!(y, want);
        // Extremes of i8.
        let mut b = F16_MINUS_TWO.to_vec();
        b.extend([0x80u8, 0x7f]);
        b.extend([0u8; 30]);
        let y = dequantize(GgmlType::Q8_0, &b, 32).unwrap();
        assert_eq!(&y[..3], &[256.0, -254.0, -0.0]);
    }

    #[test]
    fn q4_0_block_nibble_order() {
        let mut b = F16_ONE.to_vec();
        // byte j: low nibble j (element j), high nibble 15 - j (element 16 + j)
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = dequantize(GgmlType::Q4_0, &b, 32).unwrap();
        for j in 0..16 {
            assert_eq!(y[j], j as f32 - 8.0);
            assert_eq!(y[16 + j], (15 - j) as f32 - 8.0);
        }
    }

    #[test]
    fn q4_1_block_scale_and_min() {
        let mut b = F16_HALF.to_vec();
        b.extend(F16_MINUS_TWO);
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = dequantize(GgmlType::Q4_1, &b, 32).unwrap();
        for j in 0..16 {
            assert_eq!(y[j], j as f32 * 0.5 - 2.0);
            assert_eq!(y[16 + j], (15 - j) as f32 * 0.5 - 2.0);
        }
    }

    #[test]
    fn float_types() {
        let b: Vec<u8> = [1.5f32, -0.0, f32::INFINITY]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let y = dequantize(GgmlType::F32, &b, 3).unwrap();
        assert_eq!(y[0], 1.5);
        assert!(y[1] == 0.0 && y[1].is_sign_negative());
        assert_eq!(y[2], f32::INFINITY);
        // F16 subnormal 2^-24 and BF16 1.0.
        assert_eq!(
            dequantize(GgmlType::F16, &[1, 0], 1).unwrap(),
            [2f32.powi(-24)]
        );
        assert_eq!(dequantize(GgmlType::BF16, &[0x80, 0x3f], 1).unwrap(), [1.0]);
    }

    #[test]
    fn bad_lengths_and_types() {
        assert!(matches!(
            dequantize(GgmlType::Q4_1, &[0; 20], 16),
            Err(DequantError::PartialBlock { .. })
        ));
        assert!(matches!(
            dequantize(GgmlType::Q4_1, &[0; 19], 32),
            Err(DequantError::Length { .. })
        ));
        assert_eq!(
            dequantize(GgmlType::Q4_K, &[0; 144], 256),
            Err(DequantError::Unsupported(GgmlType::Q4_K))
        );
        let mut out = [0f32; 2];
        assert!(dequantize_into(GgmlType::F32, &[0; 4], &mut out).is_err());
    }

    /// Real blocks of SmolLM2-135M-Instruct.Q4_1.gguf with the values the `gguf` Python
    /// package dequantizes them to (tests/conformance/smollm2_dequant_blocks.py).
    #[test]
    fn matches_gguf_python_on_real_blocks() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/smollm2/dequant_blocks.json"
        );
        let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let cases = doc["cases"].as_array().unwrap();
        assert!(cases.len() >= 12);
        let mut seen = std::collections::HashSet::new();
        for case in cases {
            let ty = match case["type"].as_str().unwrap() {
                "Q4_1" => GgmlType::Q4_1,
                "Q8_0" => GgmlType::Q8_0,
                other => panic!("fixture type {other}"),
            };
            seen.insert(ty);
            let hex = case["bytes_hex"].as_str().unwrap();
            let bytes: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            let want: Vec<u32> = case["f32_bits"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let got: Vec<u32> = dequantize(ty, &bytes, want.len())
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect();
            assert_eq!(got, want, "{} block {}", case["tensor"], case["block"]);
        }
        assert_eq!(seen.len(), 2);
    }

    proptest! {
        #[test]
        fn any_bytes_any_length_never_panics(
            ty in 0u32..40,
            bytes in proptest::collection::vec(any::<u8>(), 0..200),
            n in 0usize..200,
        ) {
            if let Some(ty) = GgmlType::from_id(ty) {
                let _ = dequantize(ty, &bytes, n);
            }
        }
    }
}
