use super::*;

const P: &str = "m.safetensors";

/// A file image: 8-byte length, `header` verbatim, then `data_len` data bytes.
fn image(header: &str, data_len: usize) -> Vec<u8> {
    let mut f = (header.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(header.as_bytes());
    f.extend((0..data_len).map(|i| i as u8));
    f
}

fn parse(header: &str, data_len: usize) -> Result<Header> {
    let f = image(header, data_len);
    parse_header(Path::new(P), &f, f.len() as u64)
}

fn err(header: &str, data_len: usize) -> FormatError {
    match parse(header, data_len) {
        Ok(h) => panic!("header {header:?} parsed as {h:?}"),
        Err(e) => e,
    }
}

/// Asserts a Malformed error whose detail contains `needle`.
fn assert_malformed(e: FormatError, needle: &str) {
    match &e {
        FormatError::Malformed { path, detail, .. } => {
            assert_eq!(path, Path::new(P));
            assert!(detail.contains(needle), "{e} lacks {needle:?}");
        }
        other => panic!("expected Malformed, got {other:?}"),
    }
}

/// Asserts a BadTensor error naming `tensor` whose detail contains `needle`.
fn assert_bad(e: FormatError, tensor: &str, needle: &str) {
    match &e {
        FormatError::BadTensor {
            path,
            tensor: t,
            detail,
        } => {
            assert_eq!(path, Path::new(P));
            assert_eq!(t, tensor);
            assert!(detail.contains(needle), "{e} lacks {needle:?}");
        }
        other => panic!("expected BadTensor, got {other:?}"),
    }
}

fn t(name: &str, dtype: &str, shape: &str, b: u64, e: u64) -> String {
    format!(r#""{name}":{{"dtype":"{dtype}","shape":{shape},"data_offsets":[{b},{e}]}}"#)
}

#[test]
fn parses_a_valid_header() {
    let h = format!(
        "{{{},{},\"__metadata__\":{{\"format\":\"pt\"}}}}   ",
        t("b", "BF16", "[2,3]", 8, 20),
        t("a", "F32", "[2]", 0, 8)
    );
    let hdr = parse(&h, 20).unwrap();
    let ds = 8 + h.len() as u64;
    assert_eq!(hdr.data_start, ds);
    assert_eq!(hdr.metadata.get("format").map(String::as_str), Some("pt"));
    assert_eq!(
        hdr.tensors,
        vec![
            TensorInfo {
                name: "a".into(),
                dtype: DType::F32,
                shape: vec![2],
                offset: ds,
                len: 8
            },
            TensorInfo {
                name: "b".into(),
                dtype: DType::BF16,
                shape: vec![2, 3],
                offset: ds + 8,
                len: 12
            },
        ]
    );
    assert_eq!(hdr.tensors[1].numel(), 6);
}

#[test]
fn empty_object_is_a_valid_empty_file() {
    let hdr = parse("{}", 0).unwrap();
    assert!(hdr.tensors.is_empty());
    assert!(hdr.metadata.is_empty());
}

#[test]
fn scalar_and_empty_tensors() {
    let h = format!(
        "{{{},{},{}}}",
        t("s", "F32", "[]", 0, 4),
        t("z1", "F16", "[0,7]", 4, 4),
        t("z2", "I64", "[3,0]", 4, 4)
    );
    let hdr = parse(&h, 4).unwrap();
    let names: Vec<_> = hdr.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["s", "z1", "z2"]);
    assert_eq!(hdr.tensors[0].numel(), 1);
    assert_eq!(hdr.tensors[1].numel(), 0);
}

#[test]
fn holes_in_the_data_region_are_accepted() {
    // Reference safetensors requires full coverage; vOOM only needs non-overlap.
    let h = format!("{{{}}}", t("a", "U8", "[2]", 4, 6));
    let hdr = parse(&h, 10).unwrap();
    assert_eq!(hdr.tensors[0].offset, hdr.data_start + 4);
}

#[test]
fn metadata_null_is_empty() {
    let hdr = parse(r#"{"__metadata__":null}"#, 0).unwrap();
    assert!(hdr.metadata.is_empty());
}

#[test]
fn rejects_files_shorter_than_8_bytes() {
    for len in 0..8 {
        let f = vec![0u8; len];
        assert_malformed(
            parse_header(Path::new(P), &f, len as u64).unwrap_err(),
            "shorter than the 8-byte",
        );
    }
}

#[test]
fn rejects_header_length_beyond_the_file() {
    let mut f = image("{}", 0);
    f[0] = 3; // claims 3 bytes, file has 2 after the prefix
    assert_malformed(
        parse_header(Path::new(P), &f, f.len() as u64).unwrap_err(),
        "runs past the end",
    );
    f[0..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_malformed(
        parse_header(Path::new(P), &f, f.len() as u64).unwrap_err(),
        "exceeds",
    );
}

#[test]
fn rejects_absurd_header_size() {
    let mut f = image("{}", 0);
    f[0..8].copy_from_slice(&(MAX_HEADER_LEN + 1).to_le_bytes());
    // Even when the file is (claimed to be) long enough.
    assert_malformed(
        parse_header(Path::new(P), &f, u64::MAX).unwrap_err(),
        "exceeds the 104857600-byte limit",
    );
}

#[test]
fn rejects_header_bytes_not_provided() {
    let f = image("{}    ", 0);
    assert_malformed(
        parse_header(Path::new(P), &f[..10], f.len() as u64).unwrap_err(),
        "only 10 bytes of the 14-byte header",
    );
}

#[test]
fn rejects_non_utf8_header() {
    let mut f = image(r#"{"ab":1}"#, 0);
    f[10] = 0xff;
    assert_malformed(
        parse_header(Path::new(P), &f, f.len() as u64).unwrap_err(),
        "not valid UTF-8 (at byte 10)",
    );
}

#[test]
fn rejects_non_json_and_non_object_headers() {
    assert_malformed(err("{", 0), "not a valid JSON object");
    assert_malformed(err("", 0), "not a valid JSON object");
    assert_malformed(err("[1,2]", 0), "expected a JSON object");
    assert_malformed(err("42", 0), "expected a JSON object");
    assert_malformed(err("{} x", 0), "trailing characters");
}

#[test]
fn rejects_duplicate_keys() {
    let h = format!(
        "{{{},{}}}",
        t("a", "U8", "[1]", 0, 1),
        t("a", "U8", "[1]", 1, 2)
    );
    assert_malformed(err(&h, 2), "duplicate key 'a'");
}

#[test]
fn rejects_entries_that_are_not_objects() {
    assert_bad(err(r#"{"w":[1,2]}"#, 0), "w", "an array, not an object");
}

#[test]
fn rejects_missing_and_unknown_fields() {
    assert_bad(
        err(r#"{"w":{"shape":[1],"data_offsets":[0,1]}}"#, 1),
        "w",
        "missing field 'dtype'",
    );
    assert_bad(
        err(r#"{"w":{"dtype":"U8","data_offsets":[0,1]}}"#, 1),
        "w",
        "missing field 'shape'",
    );
    assert_bad(
        err(r#"{"w":{"dtype":"U8","shape":[1]}}"#, 1),
        "w",
        "missing field 'data_offsets'",
    );
    assert_bad(
        err(
            r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":0}}"#,
            1,
        ),
        "w",
        "unknown field 'x'",
    );
}

#[test]
fn rejects_unknown_dtype() {
    let h = format!("{{{}}}", t("w", "Q4_0", "[1]", 0, 1));
    assert_bad(err(&h, 1), "w", "unknown dtype 'Q4_0'");
    let h = r#"{"w":{"dtype":7,"shape":[1],"data_offsets":[0,1]}}"#;
    assert_bad(err(h, 1), "w", "dtype is a number");
}

#[test]
fn reports_reference_dtypes_voom_lacks_as_unsupported() {
    let h = format!("{{{}}}", t("w", "F8_E8M0", "[1]", 0, 1));
    match err(&h, 1) {
        FormatError::Unsupported { what, .. } => {
            assert_eq!(what, "dtype 'F8_E8M0' of tensor 'w'")
        }
        other => panic!("{other:?}"),
    }
    // FP8 parses: the engine says whether it computes on it.
    let h = format!("{{{}}}", t("w", "F8_E4M3", "[1]", 0, 1));
    assert_eq!(parse(&h, 1).unwrap().tensors[0].dtype, DType::F8E4M3);
}

#[test]
fn rejects_bad_shapes() {
    let h = format!("{{{}}}", t("w", "U8", "[-1]", 0, 1));
    assert_bad(err(&h, 1), "w", "not a non-negative integer");
    let h = format!("{{{}}}", t("w", "U8", "[1.5]", 0, 1));
    assert_bad(err(&h, 1), "w", "not a non-negative integer");
    let h = format!("{{{}}}", t("w", "U8", "[18446744073709551616]", 0, 1));
    assert_bad(err(&h, 1), "w", "not a non-negative integer");
    let h = r#"{"w":{"dtype":"U8","shape":"3","data_offsets":[0,3]}}"#;
    assert_bad(err(h, 3), "w", "shape is a string");
}

#[test]
fn rejects_shape_product_overflow() {
    let h = format!("{{{}}}", t("w", "U8", "[4294967296,4294967296]", 0, 1));
    assert_bad(err(&h, 1), "w", "more elements than fit");
    // Element count fits, byte length does not.
    let big = usize::MAX / 2 + 1;
    let h = format!("{{{}}}", t("w", "F32", &format!("[{big}]"), 0, 1));
    assert_bad(err(&h, 1), "w", "overflows the byte length");
}

#[test]
fn rejects_malformed_data_offsets() {
    let h = format!("{{{}}}", t("w", "U8", "[0]", 5, 5)).replace("[5,5]", "[5]");
    assert_bad(err(&h, 8), "w", "has 1 elements");
    let h = format!("{{{}}}", t("w", "U8", "[0]", 5, 5)).replace("[5,5]", "[1,2,3]");
    assert_bad(err(&h, 8), "w", "has 3 elements");
    let h = format!("{{{}}}", t("w", "U8", "[0]", 5, 5)).replace("[5,5]", "[-1,2]");
    assert_bad(err(&h, 8), "w", "not non-negative integers");
    let h = format!("{{{}}}", t("w", "U8", "[0]", 5, 5)).replace("[5,5]", "{}");
    assert_bad(err(&h, 8), "w", "data_offsets is an object");
    let h = format!("{{{}}}", t("w", "U8", "[2]", 6, 4));
    assert_bad(err(&h, 8), "w", "begin > end");
}

#[test]
fn rejects_length_not_matching_shape() {
    let h = format!("{{{}}}", t("w", "BF16", "[3]", 0, 5));
    assert_bad(
        err(&h, 8),
        "w",
        "hold 5 bytes but shape [3] of BF16 needs 6",
    );
}

#[test]
fn rejects_offsets_out_of_the_data_region() {
    let h = format!("{{{}}}", t("w", "F32", "[2]", 4, 12));
    assert_bad(err(&h, 11), "w", "run past the 11-byte data region");
    let h = format!("{{{}}}", t("w", "U8", "[1]", u64::MAX - 1, u64::MAX));
    assert_bad(err(&h, 11), "w", "run past");
}

#[test]
fn rejects_overlapping_tensors() {
    let h = format!(
        "{{{},{},{}}}",
        t("a", "U8", "[4]", 0, 4),
        t("b", "U8", "[10]", 4, 14),
        t("c", "U8", "[2]", 8, 10)
    );
    assert_bad(err(&h, 14), "c", "overlap tensor 'b' at [4, 14)");
    // Identical ranges overlap too.
    let h = format!(
        "{{{},{}}}",
        t("a", "U8", "[4]", 0, 4),
        t("b", "U8", "[4]", 0, 4)
    );
    assert_bad(err(&h, 4), "b", "overlap tensor 'a'");
    // An empty tensor inside another one holds no bytes, so does not overlap.
    let h = format!(
        "{{{},{}}}",
        t("a", "U8", "[4]", 0, 4),
        t("z", "U8", "[0]", 2, 2)
    );
    parse(&h, 4).unwrap();
}

#[test]
fn rejects_bad_metadata() {
    assert_malformed(err(r#"{"__metadata__":[1]}"#, 0), "not a map of strings");
    assert_malformed(
        err(r#"{"__metadata__":{"a":"x","n":3}}"#, 0),
        "value of key 'n' is a number",
    );
}

/// A file written by Python `safetensors` 0.8.0 (`safetensors.numpy.save`) with
/// tensors {"é\"x": F64 [1.5], "a": F32 ones [2,2], "c": F16 [0,3], "b": U8 [0,1,2]}
/// and metadata {"format": "pt"}.
const REFERENCE_HEX: &str = "00010000000000007b225f5f6d657461646174615f5f223a7b22666f726d6174223a227074227d2c22c3a95c2278223a7b226474797065223a22463634222c227368617065223a5b315d2c22646174615f6f666673657473223a5b302c385d7d2c2261223a7b226474797065223a22463332222c227368617065223a5b322c325d2c22646174615f6f666673657473223a5b382c32345d7d2c2263223a7b226474797065223a22463136222c227368617065223a5b302c335d2c22646174615f6f666673657473223a5b32342c32345d7d2c2262223a7b226474797065223a225538222c227368617065223a5b335d2c22646174615f6f666673657473223a5b32342c32375d7d7d000000000000f83f0000803f0000803f0000803f0000803f000102";

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn parses_a_file_written_by_the_reference_implementation() {
    let f = unhex(REFERENCE_HEX);
    let h = parse_header(Path::new(P), &f, f.len() as u64).unwrap();
    assert_eq!(h.data_start, 8 + 256);
    let got: Vec<_> = h
        .tensors
        .iter()
        .map(|t| {
            (
                t.name.as_str(),
                t.dtype,
                t.shape.clone(),
                t.offset - h.data_start,
                t.len,
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            ("é\"x", DType::F64, vec![1], 0, 8),
            ("a", DType::F32, vec![2, 2], 8, 16),
            ("c", DType::F16, vec![0, 3], 24, 0),
            ("b", DType::U8, vec![3], 24, 3),
        ]
    );
    let b = &h.tensors[3];
    assert_eq!(&f[b.offset as usize..][..3], &[0, 1, 2]);
}

#[test]
fn writer_output_is_byte_identical_to_the_reference_implementation() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ref.safetensors");
    let one = 1.0f32.to_le_bytes().repeat(4);
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    write(
        &path,
        &[
            ("é\"x", DType::F64, &[1], &1.5f64.to_le_bytes()),
            ("a", DType::F32, &[2, 2], &one),
            ("c", DType::F16, &[0, 3], &[]),
            ("b", DType::U8, &[3], &[0, 1, 2]),
        ],
        &meta,
    )
    .unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), unhex(REFERENCE_HEX));
}

#[test]
fn writer_pads_the_header_to_8_bytes_and_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.safetensors");
    let data: Vec<u8> = (0..30u8).collect();
    write(
        &path,
        &[
            ("w", DType::BF16, &[3, 5], &data),
            ("v", DType::U8, &[], &[9]),
        ],
        &BTreeMap::new(),
    )
    .unwrap();
    let f = SafetensorsFile::open(&path).unwrap();
    assert_eq!(f.header.data_start % 8, 0);
    assert!(f.header.metadata.is_empty());
    assert_eq!(f.tensor_bytes(f.tensor("w").unwrap()), &data[..]);
    assert_eq!(f.tensor_bytes(f.tensor("v").unwrap()), &[9]);
    assert!(f.tensor("nope").is_none());
    assert_eq!(f.mapping().len() as u64, f.header.data_start + 31);
    // Only the final file is left in the directory.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("x.safetensors")]);
}

#[test]
fn writer_rejects_bad_input_and_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.safetensors");
    let e = write(&path, &[("w", DType::F32, &[2], &[0; 7])], &BTreeMap::new()).unwrap_err();
    assert!(
        matches!(e, FormatError::BadTensor { ref tensor, .. } if tensor == "w"),
        "{e}"
    );
    let e = write(
        &path,
        &[("w", DType::U8, &[1], &[0]), ("w", DType::U8, &[1], &[0])],
        &BTreeMap::new(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("given twice"), "{e}");
    let e = write(
        &path,
        &[("__metadata__", DType::U8, &[1], &[0])],
        &BTreeMap::new(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("reserved"), "{e}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn writer_replaces_an_existing_file_atomically() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.safetensors");
    write(&path, &[("a", DType::U8, &[1], &[1])], &BTreeMap::new()).unwrap();
    let old = SafetensorsFile::open(&path).unwrap();
    write(&path, &[("b", DType::U8, &[2], &[2, 3])], &BTreeMap::new()).unwrap();
    // The old mapping still sees the old file: the new one was renamed over it.
    assert_eq!(old.tensor_bytes(old.tensor("a").unwrap()), &[1]);
    let new = SafetensorsFile::open(&path).unwrap();
    assert_eq!(new.tensor_bytes(new.tensor("b").unwrap()), &[2, 3]);
}

#[test]
fn open_reports_short_and_missing_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("short.safetensors");
    std::fs::write(&path, [1, 2, 3]).unwrap();
    let e = SafetensorsFile::open(&path).unwrap_err();
    assert!(e.to_string().contains("3 bytes, shorter"), "{e}");
    std::fs::write(&path, []).unwrap();
    assert!(SafetensorsFile::open(&path).is_err());
    let e = SafetensorsFile::open(&dir.path().join("absent")).unwrap_err();
    assert!(matches!(e, FormatError::Io { .. }), "{e}");
    let e = SafetensorsFile::open(dir.path()).unwrap_err();
    assert!(
        matches!(e, FormatError::Malformed { .. } | FormatError::Io { .. }),
        "{e}"
    );
}

#[test]
fn streamed_writes_equal_whole_writes_and_wrong_lengths_are_errors() {
    use std::collections::BTreeMap;
    let d = tempfile::tempdir().unwrap();
    let a: Vec<u8> = (0..24u8).collect();
    let b: Vec<u8> = (0..6u8).map(|x| x * 3).collect();
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let whole = d.path().join("whole.safetensors");
    write(
        &whole,
        &[("a", DType::F32, &[2, 3], &a), ("b", DType::BF16, &[3], &b)],
        &meta,
    )
    .unwrap();
    let streamed = d.path().join("streamed.safetensors");
    let specs: [(&str, DType, &[usize]); 2] =
        [("a", DType::F32, &[2, 3]), ("b", DType::BF16, &[3])];
    write_with(&streamed, &specs, &meta, &mut |i, w| {
        // Written in small pieces, as a converter would.
        let bytes = if i == 0 { &a } else { &b };
        for c in bytes.chunks(5) {
            w.write_all(c)?;
        }
        Ok(())
    })
    .unwrap();
    assert_eq!(
        std::fs::read(&whole).unwrap(),
        std::fs::read(&streamed).unwrap()
    );

    // Too few bytes for a tensor: an error naming it; the existing file is untouched.
    let e = write_with(&streamed, &specs, &meta, &mut |i, w| {
        w.write_all(if i == 0 { &a[..20] } else { &b })
    })
    .unwrap_err();
    assert!(e.to_string().contains("20 bytes written"), "{e}");
    assert!(
        e.to_string().contains("'a'") || e.to_string().contains("a"),
        "{e}"
    );
    // A failing fill: its error, and nothing replaced.
    let e = write_with(&streamed, &specs, &meta, &mut |_, _| {
        Err(std::io::Error::other("conversion failed"))
    })
    .unwrap_err();
    assert!(e.to_string().contains("conversion failed"), "{e}");
    assert_eq!(
        std::fs::read(&whole).unwrap(),
        std::fs::read(&streamed).unwrap()
    );
    let leftovers = std::fs::read_dir(d.path()).unwrap().count();
    assert_eq!(leftovers, 2, "no temporary file is left behind");
}

/// Defect 4 on a safetensors file: a tensor read after the file was truncated reads
/// zeros instead of raising SIGBUS, and check_faults names the file and the offset; the
/// file's identity shows the truncation.
#[test]
fn sigbus_a_file_truncated_while_mapped_is_a_fault_naming_file_and_offset() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("model.safetensors");
    let data: Vec<u8> = (0..(64 << 10)).map(|i| (i % 241) as u8 + 1).collect();
    write(
        &p,
        &[("w", DType::U8, &[data.len()], &data)],
        &BTreeMap::new(),
    )
    .unwrap();
    let f = SafetensorsFile::open(&p).unwrap();
    let t = f.tensor("w").unwrap().clone();
    assert_eq!(f.tensor_bytes(&t), &data[..]);
    f.check_faults().unwrap();
    assert_eq!(f.current_identity().unwrap(), f.identity());
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(t.offset + 100)
        .unwrap();
    let now = f.current_identity().unwrap();
    assert_eq!(now.len, t.offset + 100);
    assert!(now.content_may_differ(&f.identity()));
    let sum: u64 = f.tensor_bytes(&t).iter().map(|&b| u64::from(b)).sum();
    assert!(sum < data.iter().map(|&b| u64::from(b)).sum::<u64>());
    let e = f.check_faults().unwrap_err();
    let FormatError::Fault { path, offset } = &e else {
        panic!("expected a fault, got {e:?}");
    };
    assert_eq!(path, &p);
    assert!(
        *offset >= t.offset + 100 && *offset < t.offset + t.len,
        "{e}"
    );
    assert!(
        e.to_string().contains(&format!("byte offset {offset}")),
        "{e}"
    );
}
