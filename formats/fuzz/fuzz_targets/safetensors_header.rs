//! Fuzzes the safetensors header parser: any byte string, read as a whole file, must
//! parse to a sound header or fail with an error; never panic, never a range outside
//! the file. Run with `cargo +nightly fuzz run safetensors_header` in `formats/`.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use voom_formats::safetensors::parse_header;

fuzz_target!(|data: &[u8]| {
    let len = data.len() as u64;
    let Ok(h) = parse_header(Path::new("fuzz.safetensors"), data, len) else {
        return;
    };
    assert!(h.data_start >= 8 && h.data_start <= len);
    let mut furthest = h.data_start;
    for t in &h.tensors {
        let end = t.offset.checked_add(t.len).expect("range overflows");
        assert!(
            t.offset >= h.data_start && end <= len,
            "tensor outside the file"
        );
        assert_eq!(t.len, (t.numel() * t.dtype.size()) as u64);
        if t.len > 0 {
            assert!(t.offset >= furthest, "overlapping tensors accepted");
            furthest = end;
        }
        // The range is readable.
        let _ = &data[t.offset as usize..end as usize];
    }
});
