//! Fuzzes the GGUF reader: any byte string must open as a sound file or fail with an
//! error; every tensor it accepts can be read and dequantized without panicking.
//! Run with `cargo +nightly fuzz run gguf` in `formats/`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use voom_formats::gguf::GgufFile;

fuzz_target!(|data: &[u8]| {
    let Ok(f) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else {
        return;
    };
    for t in f.tensors() {
        if let Ok(bytes) = f.tensor_bytes(t) {
            assert!(bytes.len() <= data.len());
        }
        // Bounded work: skip huge (but valid) declared tensors.
        if t.n_elements() <= 1 << 16 {
            let _ = f.dequantize_tensor(t);
        }
    }
});
