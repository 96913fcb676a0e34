//! Streaming detokenization against the full decode, property-tested with a real
//! byte-level BPE tokenizer whose single tokens are often partial UTF-8 characters.

use std::path::Path;
use std::sync::OnceLock;

use libvoom::text::{StreamDecoder, Tokenizer};
use proptest::prelude::*;

fn tok() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        Tokenizer::from_dir(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/text/bpe_tiny"),
        )
        .unwrap()
    })
}

/// Ids of tokens that decode alone to an incomplete character.
fn partial_ids() -> &'static Vec<u32> {
    static IDS: OnceLock<Vec<u32>> = OnceLock::new();
    IDS.get_or_init(|| {
        let t = tok();
        (0..t.vocab_size() as u32)
            .filter(|&i| t.decode(&[i], false).unwrap().contains('\u{FFFD}'))
            .collect()
    })
}

/// Streams `ids`; checks no piece splits a character that the full decode has whole,
/// and returns the concatenation.
fn stream(ids: &[u32], skip: bool) -> String {
    let mut dec = StreamDecoder::new(tok(), skip);
    let mut out = String::new();
    for &id in ids {
        out.push_str(&dec.push(id).unwrap());
    }
    out.push_str(&dec.finish().unwrap());
    out
}

const ALPHABET: &[&str] = &[
    "a",
    "b",
    " ",
    "the",
    "\n",
    "é",
    "ß",
    "ж",
    "中",
    "文",
    "東京",
    "の",
    "한",
    "😀",
    "🦊",
    "👍🏽",
    "🇯🇵",
    "👨‍👩‍👧‍👦",
    "❤️",
    "∑",
    "𝔘",
    "ไ",
    "ع",
    "<|im_start|>",
    "<|im_end|>",
    "<s>",
    "?",
    "1",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Real text: pieces never hold U+FFFD and concatenate to the text.
    #[test]
    fn text_roundtrips_through_stream(parts in prop::collection::vec(prop::sample::select(ALPHABET), 0..40)) {
        let text: String = parts.concat();
        let ids = tok().encode(&text, false).unwrap();
        let mut dec = StreamDecoder::new(tok(), false);
        let mut out = String::new();
        for &id in &ids {
            let piece = dec.push(id).unwrap();
            prop_assert!(!piece.contains('\u{FFFD}'), "split character: {:?}", piece);
            out.push_str(&piece);
        }
        out.push_str(&dec.finish().unwrap());
        prop_assert_eq!(&out, &text);
        prop_assert_eq!(stream(&ids, true), tok().decode(&ids, true).unwrap());
    }

    /// Arbitrary id sequences, mostly partial-character tokens (so invalid UTF-8 is
    /// common): the stream equals the full decode, U+FFFD included, both skip modes.
    #[test]
    fn arbitrary_ids_match_full_decode(
        picks in prop::collection::vec((any::<bool>(), any::<prop::sample::Index>()), 0..60),
        skip in any::<bool>(),
    ) {
        let vocab = tok().vocab_size();
        let partial = partial_ids();
        let ids: Vec<u32> = picks.iter().map(|(from_partial, ix)| {
            if *from_partial { partial[ix.index(partial.len())] } else { ix.index(vocab) as u32 }
        }).collect();
        prop_assert_eq!(stream(&ids, skip), tok().decode(&ids, skip).unwrap());
    }
}

#[test]
fn fixture_has_many_partial_tokens() {
    assert!(partial_ids().len() > 100, "{}", partial_ids().len());
}

#[test]
fn decoder_is_reusable_after_finish() {
    let ids = tok().encode("東京 😀", false).unwrap();
    let mut dec = StreamDecoder::new(tok(), false);
    for round in 0..2 {
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&dec.push(id).unwrap());
        }
        out.push_str(&dec.finish().unwrap());
        assert_eq!(out, "東京 😀", "round {round}");
    }
}
