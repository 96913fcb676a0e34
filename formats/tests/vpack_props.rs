//! Property tests of vpack: every BF16/F16 page decodes back to exactly its bytes
//! (random, weight-like, all-zero, all-0xFF, NaN and infinity patterns), and no
//! truncation or mutation of a valid body makes the decoder panic: it either fails
//! with a typed error or, where the mutation left a well-formed body, fills the
//! buffer it was given and nothing else.

use proptest::prelude::*;
use voom_formats::dtype::{f32_to_bf16, DType};
use voom_formats::vpack::{self, decode, decoded_len, encode, Header, VpackError, HEADER_LEN};

fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(vec![DType::BF16, DType::F16])
}

/// Element patterns, as u16 values.
fn elements() -> impl Strategy<Value = Vec<u16>> {
    let n = 0usize..9000;
    prop_oneof![
        // Uniform random bits.
        prop::collection::vec(any::<u16>(), n.clone()),
        // Weight-like: BF16 of small normals (low entropy high bytes).
        prop::collection::vec(-0.1f32..0.1, n.clone())
            .prop_map(|v| v.into_iter().map(f32_to_bf16).collect()),
        // Constants: all zero, all 0xFFFF, one value.
        (
            n.clone(),
            prop::sample::select(vec![0u16, 0xFFFF, 0x3F80, 0x8000])
        )
            .prop_map(|(n, x)| vec![x; n]),
        // NaNs (quiet, signalling, with payloads), infinities, denormals, mixed.
        prop::collection::vec(
            prop::sample::select(vec![
                0x7FC0u16, 0xFFC0, 0x7F81, 0xFFFF, 0x7F80, 0xFF80, 0x0001, 0x8001, 0x7E00, 0xFC00,
                0x7C00, 0x0000,
            ]),
            n
        ),
    ]
}

fn le_bytes(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn encoded_page() -> impl Strategy<Value = (DType, Vec<u8>, Vec<u8>)> {
    (dtype(), elements()).prop_map(|(dt, v)| {
        let bytes = le_bytes(&v);
        let body = encode(dt, &bytes).unwrap();
        (dt, bytes, body)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn decode_reproduces_the_bytes((dt, bytes, body) in encoded_page()) {
        prop_assert_eq!(decoded_len(&body).unwrap(), bytes.len());
        let h = Header::parse(&body).unwrap();
        prop_assert_eq!(h.dtype, dt);
        prop_assert_eq!(h.count * 2, bytes.len());
        // Encoding never grows a page by more than the header.
        prop_assert!(body.len() <= bytes.len() + HEADER_LEN);
        let mut out = vec![0x5Au8; bytes.len()];
        decode(&body, &mut out).unwrap();
        prop_assert_eq!(out, bytes);
    }

    #[test]
    fn split_and_interleave_are_inverse(v in prop::collection::vec(any::<u16>(), 0..300)) {
        let bytes = le_bytes(&v);
        let (mut h, mut l) = (vec![0; v.len()], vec![0; v.len()]);
        vpack::split(&bytes, &mut h, &mut l);
        for (i, x) in v.iter().enumerate() {
            prop_assert_eq!(h[i], (x >> 8) as u8);
            prop_assert_eq!(l[i], *x as u8);
        }
        let mut out = vec![0; bytes.len()];
        vpack::interleave(&h, &l, &mut out);
        prop_assert_eq!(out, bytes);
    }

    #[test]
    fn every_truncation_is_an_error((_dt, _bytes, body) in encoded_page(), cut in any::<prop::sample::Index>()) {
        let at = cut.index(body.len());
        let short = &body[..at];
        let e = decoded_len(short).unwrap_err();
        prop_assert!(
            matches!(e, VpackError::TruncatedHeader(_) | VpackError::BodyLength { .. }),
            "{}", e
        );
        let mut out = vec![0; body.len() * 4];
        prop_assert!(decode(short, &mut out).is_err());
    }

    #[test]
    fn mutations_never_panic(
        (_dt, bytes, body) in encoded_page(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let mut bad = body.clone();
        for (at, x) in &edits {
            let i = at.index(bad.len());
            bad[i] = *x;
        }
        match decoded_len(&bad) {
            // A header still consistent with the length: decode into a buffer of the
            // size it declares (bounded here) and of the original size.
            Ok(n) => {
                for len in [n.min(1 << 20), bytes.len()] {
                    let mut out = vec![0; len];
                    let r = decode(&bad, &mut out);
                    if len != n {
                        prop_assert!(
                            matches!(r, Err(VpackError::OutputLength { .. })),
                            "{:?}", r
                        );
                    }
                }
            }
            Err(e) => {
                // The error names something; decode agrees that the body is bad.
                prop_assert!(!e.to_string().is_empty());
                prop_assert!(decode(&bad, &mut vec![0; bytes.len()]).is_err());
            }
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(data in prop::collection::vec(any::<u8>(), 0..200)) {
        if let Ok(n) = decoded_len(&data) {
            let mut out = vec![0; n.min(1 << 20)];
            let _ = decode(&data, &mut out);
        }
    }
}

#[test]
fn other_dtypes_and_odd_lengths_are_refused() {
    for dt in [DType::F32, DType::U8, DType::I16, DType::F64, DType::U16] {
        assert_eq!(encode(dt, &[0; 8]), Err(VpackError::UnsupportedDType(dt)));
    }
    assert_eq!(
        encode(DType::F16, &[1, 2, 3]),
        Err(VpackError::OddLength(3))
    );
}
