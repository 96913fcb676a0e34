//! Products over ggml block formats ([`WeightFormat::Ggml`]: GGUF's Q4_K, Q8_0, ...)
//! on every instruction set.
//!
//! A group of a few rows is dequantized into a small f32 buffer, each block as
//! ggml's reference `dequantize_row_*` computes it
//! ([`voom_formats::gguf::dequantize_into`], the format's definition, bit for bit),
//! and the group runs through the F32 kernels of `matmul.rs`. The order of the
//! arithmetic per output element is therefore the module doc's: eight lanes, one
//! fused multiply-add per lane per block of eight in increasing `k`, the fixed
//! reduction, the tail in order. Every value is the one [`WeightView::get`] defines
//! and every sum is in the one order, so the bits do not depend on the instruction
//! set, the thread count, the group or the number of tokens (batch invariant).
//!
//! On AVX-512 the rows of the common types are widened sixteen elements an
//! instruction (`ggml_widen.rs`: the same values, bit for bit).
//!
//! The buffer is never a widened copy of the matrix: at most [`GROUP_ROWS`] rows
//! and, at one token, [`DECODE_GROUP_BYTES`] (a first-level cache's worth, so the
//! widened values are read back from it), else [`GROUP_BYTES`].

use super::*;
use crate::backend::view::{ggml_block, GGML_MAX_BLOCK};
use voom_formats::gguf::{dequantize_into, GgmlType};

#[cfg(target_arch = "x86_64")]
#[path = "ggml_widen.rs"]
mod widen;

/// Rows a group holds at most (the AVX-512 packed path's panel height, so many
/// tokens run packed over whole panels).
const GROUP_ROWS: usize = 16;

/// Bytes of widened rows a group holds at one token.
const DECODE_GROUP_BYTES: usize = 32 << 10;

/// Bytes of widened rows a group holds at several tokens.
const GROUP_BYTES: usize = 256 << 10;

/// Rows a group of `cols`-column rows holds for an `n`-token call.
fn group_rows(n: usize, cols: usize) -> usize {
    let cap = if n == 1 {
        DECODE_GROUP_BYTES
    } else {
        GROUP_BYTES
    };
    (cap / (4 * cols).max(1)).clamp(1, GROUP_ROWS)
}

/// Computes rows `rows` of `out` for all `n` tokens over a ggml-block weight.
///
/// # Safety
/// As `compute_rows`: `x.len() == n*w.cols`, `w` checked and of format
/// [`WeightFormat::Ggml`], `rows ⊆ 0..w.rows`, `out` valid for `n*w.rows` writes
/// with no other thread writing these rows' elements; `isa` supported.
pub(super) unsafe fn rows(
    isa: Isa,
    x: &[f32],
    n: usize,
    w: &WeightView<'_>,
    rows: Range<usize>,
    out: *mut f32,
) {
    let WeightFormat::Ggml(ty) = w.format else {
        unreachable!("ggml::rows of a {} weight", w.format.describe());
    };
    let cols = w.cols;
    let row_bytes = w.format.bytes_for(1, cols).expect("a checked view");
    let g = group_rows(n, cols);
    let mut buf = vec![0f32; g * cols];
    let mut part = vec![0f32; n * g];
    let mut o = rows.start;
    while o < rows.end {
        let r = (rows.end - o).min(g);
        for (i, dst) in buf[..r * cols].chunks_exact_mut(cols.max(1)).enumerate() {
            let at = (o + i) * row_bytes;
            let src = &w.bytes[at..at + row_bytes];
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `isa` is supported (the caller's), and Avx512 means AVX-512 F,
            // BW and VL; `src` is the row's whole blocks, `dst` its elements.
            if isa == Isa::Avx512 && unsafe { widen::widen(ty, src, dst) } {
                continue;
            }
            dequantize_into(ty, src, dst).expect("a checked view's type dequantizes");
        }
        // SAFETY: `buf` holds r*cols initialised f32s, any bytes of which are valid
        // u8s; the slice borrows `buf` for as long as the view lives.
        let bytes = unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), 4 * r * cols) };
        let plain = WeightView::of(WeightFormat::Plain(DType::F32), r, cols, bytes)
            .expect("a group of widened rows");
        // SAFETY: `x` holds n*cols floats (the caller's), `plain` is a checked F32
        // view of `r` rows, `part` holds n*r floats and is this call's alone; `isa`
        // is supported (the caller's). The F32 kernels read the bytes as
        // little-endian f32, which on every target vOOM builds for is `buf`'s own.
        unsafe {
            compute_rows(
                isa,
                DT_F32,
                x,
                n,
                &plain,
                0..r,
                SharedOut(part.as_mut_ptr()),
            )
        };
        for t in 0..n {
            for i in 0..r {
                // SAFETY: t < n and o + i < rows.end <= w.rows: within `out`'s n*w.rows
                // elements, in rows only this call writes (the caller's contract).
                unsafe { *out.add(t * w.rows + o + i) = part[t * r + i] };
            }
        }
        o += r;
    }
}

/// Row `r`'s elements `cols` of a checked ggml-block view, widened (each block
/// dequantized whole, its part of `cols` kept).
pub(super) fn widen(
    w: &WeightView<'_>,
    ty: GgmlType,
    r: usize,
    cols: Range<usize>,
    out: &mut [f32],
) {
    let (block, bytes) = ggml_block(ty);
    let row = w.format.bytes_for(1, w.cols).expect("a checked view");
    let mut v = [0f32; GGML_MAX_BLOCK];
    let mut j = cols.start;
    while j < cols.end {
        let b = j / block;
        let at = r * row + b * bytes;
        dequantize_into(ty, &w.bytes[at..at + bytes], &mut v[..block])
            .expect("a checked view's type dequantizes");
        let end = ((b + 1) * block).min(cols.end);
        out[j - cols.start..end - cols.start].copy_from_slice(&v[j - b * block..end - b * block]);
        j = end;
    }
}

#[cfg(test)]
/// Blocks of ggml's own quantization, each type's (tests/fixtures/gguf/
/// dequant_blocks.json, whose values `voom_formats` matches bit for bit), those
/// whose values are all finite.
pub(super) fn fixture_blocks() -> Vec<(voom_formats::gguf::GgmlType, Vec<u8>)> {
    use voom_formats::gguf::GgmlType;
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/gguf/dequant_blocks.json"
    );
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let mut out = Vec::new();
    for case in doc["cases"].as_array().unwrap() {
        let name = case["type"].as_str().unwrap();
        let ty = (0..64)
            .filter_map(GgmlType::from_id)
            .find(|t| t.name() == name)
            .unwrap();
        let finite = case["f32_bits"]
            .as_array()
            .unwrap()
            .iter()
            .all(|b| f32::from_bits(b.as_u64().unwrap() as u32).is_finite());
        let hex = case["bytes_hex"].as_str().unwrap();
        let bytes = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        if finite {
            out.push((ty, bytes));
        }
    }
    out
}
