//! Stored values that are not numbers, caught before anything computes with them.
//!
//! A BF16 weight is a number whatever its bits hold; an FP8 e4m3 byte of `0x7F` or
//! `0xFF` is NaN, an e8m0 scale of 255 is NaN, a block scale may be NaN or infinite.
//! No release stores one, so one is a damaged or mis-made checkpoint, and a
//! product over it would turn a whole row of logits into NaN (a wrong answer, not
//! an error). The weight finder records which pages hold such values
//! ([`ValueChecks::add`]); each is scanned the first time a pass leases it (its
//! bytes are being read from storage then anyway; the open itself reads nothing),
//! and a bad value is a [`VoomError::Weight`] naming the tensor and the element.
//! A page checked once is not checked again: its bytes change only with the file,
//! which the manifest's hashes catch.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use voom_formats::DType;
use vpaged::{PageId, PageMeta};

use crate::VoomError;

/// What a page's values are, for what counts as a value that is not a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueKind {
    /// FP8 e4m3 weights: `0x7F` and `0xFF` are NaN (e4m3 has no infinity).
    Fp8E4M3,
    /// e8m0 exponents (MXFP4 scales): 255 is NaN.
    E8M0,
    /// FP8 block scales, F32 or BF16: NaN and infinity.
    Scales(DType),
}

/// The pages whose values are checked, each once ([module docs](self)).
#[derive(Debug, Default)]
pub struct ValueChecks {
    model: String,
    pages: HashMap<PageId, (ValueKind, AtomicBool)>,
}

impl ValueChecks {
    pub fn new(model: &str) -> Self {
        ValueChecks {
            model: model.to_string(),
            pages: HashMap::new(),
        }
    }

    /// Checks page `id` as holding values of `kind` when it is first leased.
    pub fn add(&mut self, id: PageId, kind: ValueKind) {
        self.pages
            .entry(id)
            .or_insert_with(|| (kind, AtomicBool::new(false)));
    }

    /// Pages to check.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Scans the pages of `leased` (each page with its bytes) not checked yet
    /// (`pages`: the source's page table, for names and shapes in the error).
    pub fn check<'b>(
        &self,
        pages: &[PageMeta],
        leased: impl Iterator<Item = (PageId, &'b [u8])>,
    ) -> Result<(), VoomError> {
        if self.pages.is_empty() {
            return Ok(());
        }
        for (id, bytes) in leased {
            let Some((kind, done)) = self.pages.get(&id) else {
                continue;
            };
            if done.load(Ordering::Acquire) {
                continue;
            }
            if let Some((at, what)) = first_bad(*kind, bytes) {
                let meta = pages.get(id.0 as usize);
                return Err(VoomError::Weight {
                    model: self.model.clone(),
                    tensor: meta.map_or_else(|| format!("page {}", id.0), |m| m.name.clone()),
                    detail: format!(
                        "{what} at element {} of the stored values: the checkpoint is damaged \
                         (no release stores one; re-download or re-convert it)",
                        meta.map_or_else(|| at.to_string(), |m| index_of(m, at))
                    ),
                });
            }
            done.store(true, Ordering::Release);
        }
        Ok(())
    }
}

/// Element `at` of page `m` as an index of its tensor (`[r, c]`), rows counted from
/// the tensor's first where the page is a part of it.
fn index_of(m: &PageMeta, at: usize) -> String {
    let mut rest = at;
    let mut idx = vec![0usize; m.shape.len()];
    for (i, &d) in m.shape.iter().enumerate().rev() {
        if d > 0 {
            idx[i] = rest % d;
            rest /= d;
        }
    }
    if let (Some(r), Some(first)) = (m.rows, idx.first_mut()) {
        *first += r.start as usize;
    }
    let list: Vec<String> = idx.iter().map(|i| i.to_string()).collect();
    format!("{at} (index [{}])", list.join(", "))
}

const LOW7: u64 = 0x7F7F_7F7F_7F7F_7F7F;
const ONES: u64 = 0x0101_0101_0101_0101;
const HIGH: u64 = 0x8080_8080_8080_8080;

/// The first value of `bytes` (as `kind`) that is not a number: its element index
/// and what it is.
fn first_bad(kind: ValueKind, bytes: &[u8]) -> Option<(usize, String)> {
    match kind {
        ValueKind::Fp8E4M3 => {
            // A byte whose low seven bits are all set: (b & 0x7F) + 1 reaches 0x80
            // (without a carry into the next byte) exactly then.
            let at = first_byte(
                bytes,
                |w| ((w & LOW7) + ONES) & HIGH != 0,
                |b| b & 0x7F == 0x7F,
            )?;
            Some((at, format!("FP8 e4m3 byte {:#04x} (NaN)", bytes[at])))
        }
        ValueKind::E8M0 => {
            // 0xFF: its low seven bits all set, and its high one.
            let at = first_byte(
                bytes,
                |w| ((w & LOW7) + ONES) & w & HIGH != 0,
                |b| b == 0xFF,
            )?;
            Some((at, "e8m0 scale 255 (NaN)".to_string()))
        }
        ValueKind::Scales(DType::F32) => bytes
            .chunks_exact(4)
            .position(|c| !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite())
            .map(|i| {
                let c = &bytes[4 * i..4 * i + 4];
                let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                (i, format!("block scale {v}"))
            }),
        ValueKind::Scales(DType::BF16) => bytes
            .chunks_exact(2)
            .position(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7F80 == 0x7F80)
            .map(|i| {
                let v = half::bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]);
                (i, format!("block scale {v}"))
            }),
        ValueKind::Scales(_) => None,
    }
}

/// The first byte for which `byte` holds, testing eight at a time with `word`
/// (true where some byte of the little-endian word holds).
fn first_byte(
    bytes: &[u8],
    word: impl Fn(u64) -> bool,
    byte: impl Fn(u8) -> bool,
) -> Option<usize> {
    let mut words = bytes.chunks_exact(8);
    for (i, c) in words.by_ref().enumerate() {
        let w = u64::from_le_bytes(c.try_into().expect("eight bytes"));
        if word(w) {
            return c.iter().position(|&b| byte(b)).map(|j| 8 * i + j);
        }
    }
    let tail = bytes.len() - words.remainder().len();
    words
        .remainder()
        .iter()
        .position(|&b| byte(b))
        .map(|j| tail + j)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_nan_byte_is_found_and_no_number_is() {
        for b in 0..=255u8 {
            for at in [0usize, 5, 8, 13, 31, 37] {
                let mut bytes = vec![0x7Eu8; 40];
                bytes[at] = b;
                let fp8 = first_bad(ValueKind::Fp8E4M3, &bytes).map(|(i, _)| i);
                let e8 = first_bad(ValueKind::E8M0, &bytes).map(|(i, _)| i);
                assert_eq!(fp8, (b & 0x7F == 0x7F).then_some(at), "e4m3 {b:#x} at {at}");
                assert_eq!(e8, (b == 0xFF).then_some(at), "e8m0 {b:#x} at {at}");
            }
        }
        // The first of several, across words.
        let mut bytes = vec![0u8; 64];
        bytes[50] = 0xFF;
        bytes[20] = 0x7F;
        assert_eq!(first_bad(ValueKind::Fp8E4M3, &bytes).unwrap().0, 20);
        assert_eq!(first_bad(ValueKind::E8M0, &bytes).unwrap().0, 50);
    }

    #[test]
    fn scales_that_are_not_finite_are_found() {
        let f: Vec<u8> = [1.0f32, 0.5, f32::INFINITY, f32::NAN]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let (at, what) = first_bad(ValueKind::Scales(DType::F32), &f).unwrap();
        assert_eq!((at, what.as_str()), (2, "block scale inf"));
        let b: Vec<u8> = [1.0f32, -2.0, f32::NAN]
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        assert_eq!(first_bad(ValueKind::Scales(DType::BF16), &b).unwrap().0, 2);
        assert!(first_bad(ValueKind::Scales(DType::F32), &f[..8]).is_none());
    }

    #[test]
    fn an_element_is_named_by_its_index_in_the_tensor() {
        let m = PageMeta {
            id: PageId(0),
            name: "w".into(),
            dtype: DType::F8E4M3,
            shape: vec![2, 3, 4],
            len: 24,
            rows: Some(voom_formats::manifest::Rows { start: 6, count: 2 }),
        };
        assert_eq!(index_of(&m, 17), "17 (index [7, 1, 1])");
    }
}
