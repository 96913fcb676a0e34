//! Property tests of the safetensors writer and parser: whatever `write` writes parses
//! back exactly, and no mutation or truncation of a valid file makes the parser panic
//! or hand out a range outside the file.

use std::collections::BTreeMap;
use std::path::Path;

use proptest::prelude::*;
use voom_formats::dtype::DType;
use voom_formats::safetensors::{self, parse_header, Header, SafetensorsFile};

const DTYPES: &[DType] = &[
    DType::Bool,
    DType::U8,
    DType::I8,
    DType::U16,
    DType::I16,
    DType::U32,
    DType::I32,
    DType::U64,
    DType::I64,
    DType::F16,
    DType::BF16,
    DType::F32,
    DType::F64,
];

#[derive(Debug, Clone)]
struct Tensor {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

fn tensor(name: String) -> impl Strategy<Value = Tensor> {
    (
        prop::sample::select(DTYPES),
        prop::collection::vec(0usize..5, 0..4),
        any::<u64>(),
    )
        .prop_map(move |(dtype, shape, seed)| {
            let n = shape.iter().product::<usize>() * dtype.size();
            // Deterministic filler from the seed: cheap and varied.
            let bytes = (0..n)
                .map(|i| (seed.rotate_left(i as u32 % 64) ^ i as u64) as u8)
                .collect();
            Tensor {
                name: name.clone(),
                dtype,
                shape,
                bytes,
            }
        })
}

/// Unique tensor names (any Unicode, quotes and backslashes included), never the
/// reserved `__metadata__`.
fn tensors() -> impl Strategy<Value = Vec<Tensor>> {
    prop::collection::btree_set("[a-z0-9._\"\\\\é中 -]{0,16}|\\PC{0,6}", 0..8)
        .prop_map(|s| {
            s.into_iter()
                .filter(|n| n != "__metadata__")
                .collect::<Vec<_>>()
        })
        .prop_shuffle()
        .prop_flat_map(|names| names.into_iter().map(tensor).collect::<Vec<_>>())
}

fn metadata() -> impl Strategy<Value = BTreeMap<String, String>> {
    prop::collection::btree_map("\\PC{0,8}", "\\PC{0,12}", 0..4)
}

fn write_file(path: &Path, ts: &[Tensor], meta: &BTreeMap<String, String>) {
    let args: Vec<(&str, DType, &[usize], &[u8])> = ts
        .iter()
        .map(|t| {
            (
                t.name.as_str(),
                t.dtype,
                t.shape.as_slice(),
                t.bytes.as_slice(),
            )
        })
        .collect();
    safetensors::write(path, &args, meta).unwrap();
}

/// What every accepted header must satisfy, whatever the input was.
fn assert_sound(h: &Header, file_len: u64) {
    assert!(h.data_start >= 8 && h.data_start <= file_len);
    let mut furthest = h.data_start;
    for t in &h.tensors {
        assert!(t.offset >= h.data_start);
        assert!(t.offset.checked_add(t.len).unwrap() <= file_len);
        assert_eq!(t.len, (t.numel() * t.dtype.size()) as u64);
        if t.len > 0 {
            assert!(t.offset >= furthest, "overlap accepted: {t:?}");
            furthest = t.offset + t.len;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn write_then_parse_is_exact(ts in tensors(), meta in metadata()) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        write_file(&path, &ts, &meta);
        let f = SafetensorsFile::open(&path).unwrap();
        prop_assert_eq!(f.header.data_start % 8, 0);
        prop_assert_eq!(&f.header.metadata, &meta);
        prop_assert_eq!(f.header.tensors.len(), ts.len());
        // Data is contiguous in the given order, so the reference reader accepts it.
        let mut offset = f.header.data_start;
        for t in &ts {
            let info = f.tensor(&t.name).unwrap();
            prop_assert_eq!(info.dtype, t.dtype);
            prop_assert_eq!(&info.shape, &t.shape);
            prop_assert_eq!(info.offset, offset);
            prop_assert_eq!(f.tensor_bytes(info), &t.bytes[..]);
            offset += t.bytes.len() as u64;
        }
        prop_assert_eq!(offset, f.mapping().len() as u64);
        // Writing the same input again gives the same bytes.
        let again = dir.path().join("u.safetensors");
        write_file(&again, &ts, &meta);
        prop_assert_eq!(std::fs::read(&path).unwrap(), std::fs::read(&again).unwrap());
    }

    #[test]
    fn mutations_never_panic_and_accepted_headers_are_sound(
        ts in tensors(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in prop::option::of(any::<prop::sample::Index>()),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        write_file(&path, &ts, &BTreeMap::new());
        let mut bytes = std::fs::read(&path).unwrap();
        let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        for (at, v) in edits {
            // Most edits land in the header, where the parser's decisions are.
            let i = at.index(header_end.min(bytes.len()));
            bytes[i] = v;
        }
        if let Some(c) = cut {
            bytes.truncate(c.index(bytes.len() + 1));
        }
        if let Ok(h) = parse_header(&path, &bytes, bytes.len() as u64) {
            assert_sound(&h, bytes.len() as u64);
        }
        // The same through the mapped file.
        std::fs::write(&path, &bytes).unwrap();
        if let Ok(f) = SafetensorsFile::open(&path) {
            assert_sound(&f.header, bytes.len() as u64);
            for t in &f.header.tensors {
                prop_assert_eq!(f.tensor_bytes(t).len() as u64, t.len);
            }
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256), claimed in any::<u64>()) {
        if let Ok(h) = parse_header(Path::new("x"), &bytes, bytes.len() as u64) {
            assert_sound(&h, bytes.len() as u64);
        }
        // A caller that passes only a prefix and a (possibly larger) file length.
        let _ = parse_header(Path::new("x"), &bytes, claimed);
    }

    #[test]
    fn random_json_headers_never_panic(
        entries in prop::collection::vec(
            ("\\PC{0,4}", prop::sample::select(&["BF16", "F32", "U8", "X", "F8_E4M3"][..]),
             prop::collection::vec(any::<i64>().prop_map(|x| x % 9), 0..3),
             any::<i64>().prop_map(|x| x % 40), any::<i64>().prop_map(|x| x % 40)),
            0..5),
        data_len in 0usize..64,
    ) {
        let mut obj = serde_json::Map::new();
        for (name, dtype, shape, b, e) in entries {
            obj.insert(name, serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [b, e]}));
        }
        let header = serde_json::Value::Object(obj).to_string();
        let mut f = (header.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(header.as_bytes());
        f.resize(f.len() + data_len, 0);
        if let Ok(h) = parse_header(Path::new("x"), &f, f.len() as u64) {
            assert_sound(&h, f.len() as u64);
        }
    }
}
