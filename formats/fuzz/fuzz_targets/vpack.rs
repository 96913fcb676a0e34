//! Fuzzes the vpack decoder: any byte string must decode or fail with an error, never
//! panic or touch memory outside the buffer it was given; and any byte string taken
//! as a BF16 or F16 page must encode and decode back to itself exactly.
//! Run with `cargo +nightly fuzz run vpack` in `formats/`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use voom_formats::dtype::DType;
use voom_formats::vpack;

fuzz_target!(|data: &[u8]| {
    // The input as a body.
    if let Ok(n) = vpack::decoded_len(data) {
        // Bounded work: a small body may declare a huge (compressed) page.
        if n <= 1 << 22 {
            let mut out = vec![0u8; n];
            let _ = vpack::decode(data, &mut out);
        }
        let _ = vpack::decode(data, &mut [0u8; 6]);
    }
    // The input as a page: the round trip is exact.
    let page = &data[..data.len() & !1];
    let dtype = if data.first().is_some_and(|b| b & 1 == 1) {
        DType::F16
    } else {
        DType::BF16
    };
    let body = vpack::encode(dtype, page).expect("every even-length page encodes");
    let mut out = vec![0u8; page.len()];
    vpack::decode(&body, &mut out).expect("an encoded page decodes");
    assert_eq!(out, page);
});
