//! A proven lower bound on how many tokens a text encodes to, from its length in
//! bytes alone: `tokens >= ceil(bytes / (longest piece * shrink))`.
//!
//! It lets a server refuse a prompt that cannot fit the context without tokenizing
//! all of it (tokenizing 30 MB takes seconds and gigabytes). The bound holds when
//! every byte of the text ends up in some token's piece and each piece stands for at
//! most its own length in bytes of the text as normalized:
//! - the model is BPE (byte-level or with byte fallback, the tokenizers of the
//!   Llama, Qwen, Mistral and SmolLM families): a piece's UTF-8 text is at least as
//!   long as the bytes it covers (byte-level maps each byte to one character of one
//!   or two bytes; SentencePiece writes a space as the three-byte `▁`; `<0xAB>` is
//!   six bytes for one), and an unknown character costs one token of its own
//!   unless unknowns are fused;
//! - the pre-tokenizer removes nothing (a `Whitespace` or `Removed` split drops
//!   text, so a text of spaces could be no tokens at all);
//! - the normalizer removes nothing and shrinks text by a bounded factor: Unicode
//!   normalization or lowercasing at most 4 bytes to 1 (`𝐀` to `A` in NFKC, `K`
//!   (Kelvin) to `k`); a literal replacement by its lengths. Stripping, accent
//!   removal, control-character cleaning, regex replacements and precompiled
//!   SentencePiece maps can delete text: no bound then.
//!
//! Anything else (WordPiece, Unigram, unknown components) gives no bound, and the
//! caller tokenizes the text as it is.

use serde_json::Value as Json;

/// Bytes of normalized text one token can cover at most, for the tokenizer whose
/// `tokenizer.json` is `json` and whose pieces (vocabulary and added tokens) are
/// `pieces`; `None` where no bound holds (module docs).
pub(crate) fn max_bytes_per_token<'a>(
    json: &Json,
    pieces: impl Iterator<Item = &'a str>,
) -> Option<usize> {
    let model = json.get("model")?;
    if model.get("type").and_then(Json::as_str) != Some("BPE") {
        return None;
    }
    let unk = model.get("unk_token").is_some_and(|u| !u.is_null());
    if unk
        && model
            .get("fuse_unk")
            .and_then(Json::as_bool)
            .unwrap_or(false)
    {
        return None;
    }
    if !pre_tokenizer_keeps_everything(json.get("pre_tokenizer").unwrap_or(&Json::Null)) {
        return None;
    }
    let shrink = normalizer_shrink(json.get("normalizer").unwrap_or(&Json::Null))?;
    // An unknown character (at most 4 bytes) is one token.
    let longest = pieces.map(str::len).max()?.max(if unk { 4 } else { 1 });
    longest.checked_mul(shrink)
}

/// How many bytes of input one byte of normalized output can come from, at most;
/// `None` when the normalizer can delete text.
fn normalizer_shrink(n: &Json) -> Option<usize> {
    if n.is_null() {
        return Some(1);
    }
    match n.get("type")?.as_str()? {
        "Sequence" => n
            .get("normalizers")?
            .as_array()?
            .iter()
            .try_fold(1usize, |acc, m| acc.checked_mul(normalizer_shrink(m)?)),
        "Prepend" | "ByteLevel" => Some(1),
        // Decomposition and composition, compatibility mappings, case mappings:
        // never empty output for a character, at most 4 bytes of input per byte.
        "NFC" | "NFD" | "NFKC" | "NFKD" | "Lowercase" => Some(4),
        "Replace" => {
            let pattern = n.get("pattern")?.get("String")?.as_str()?;
            let content = n.get("content")?.as_str()?;
            if pattern.is_empty() || content.is_empty() {
                None
            } else {
                Some(pattern.len().div_ceil(content.len()))
            }
        }
        // Strip, StripAccents, BertNormalizer, Nmt, Precompiled, and any other.
        _ => None,
    }
}

/// Whether a pre-tokenizer only splits, never drops text.
fn pre_tokenizer_keeps_everything(p: &Json) -> bool {
    if p.is_null() {
        return true;
    }
    let kept = |p: &Json| p.get("behavior").and_then(Json::as_str) != Some("Removed");
    match p.get("type").and_then(Json::as_str) {
        Some("Sequence") => p
            .get("pretokenizers")
            .and_then(Json::as_array)
            .is_some_and(|a| a.iter().all(pre_tokenizer_keeps_everything)),
        Some("ByteLevel" | "Metaspace" | "Digits" | "UnicodeScripts" | "FixedLength") => true,
        Some("Split" | "Punctuation") => kept(p),
        // Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit drop
        // what they split on.
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn bound(j: Json) -> Option<usize> {
        max_bytes_per_token(&j, ["a", "hello", "Ġworld"].into_iter())
    }

    #[test]
    fn byte_level_bpe_is_bounded_by_its_longest_piece() {
        let j = json!({"model": {"type": "BPE", "unk_token": null},
            "pre_tokenizer": {"type": "ByteLevel"}, "normalizer": null});
        assert_eq!(bound(j), Some(7));
    }

    #[test]
    fn sentencepiece_bpe_with_a_space_replacement_is_bounded() {
        let j = json!({"model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": false},
            "pre_tokenizer": null,
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}});
        assert_eq!(bound(j), Some(7));
    }

    #[test]
    fn normalizers_that_shrink_text_widen_the_bound() {
        let j = json!({"model": {"type": "BPE"}, "pre_tokenizer": null,
            "normalizer": {"type": "NFKC"}});
        assert_eq!(bound(j), Some(28));
        let j = json!({"model": {"type": "BPE"}, "pre_tokenizer": null,
            "normalizer": {"type": "Replace", "pattern": {"String": "abcd"}, "content": "x"}});
        assert_eq!(bound(j), Some(28));
    }

    #[test]
    fn anything_that_can_delete_text_gives_no_bound() {
        for (pre, norm) in [
            (json!({"type": "Whitespace"}), Json::Null),
            (
                json!({"type": "Split", "pattern": {"String": " "}, "behavior": "Removed"}),
                Json::Null,
            ),
            (
                json!({"type": "Sequence", "pretokenizers": [{"type": "ByteLevel"}, {"type": "WhitespaceSplit"}]}),
                Json::Null,
            ),
            (Json::Null, json!({"type": "Strip", "strip_left": true})),
            (Json::Null, json!({"type": "BertNormalizer"})),
            (Json::Null, json!({"type": "Precompiled"})),
            (
                Json::Null,
                json!({"type": "Replace", "pattern": {"String": " "}, "content": ""}),
            ),
            (
                Json::Null,
                json!({"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}),
            ),
        ] {
            let j = json!({"model": {"type": "BPE"}, "pre_tokenizer": pre, "normalizer": norm});
            assert_eq!(bound(j.clone()), None, "{j}");
        }
        // Other models, and fused unknowns.
        assert_eq!(bound(json!({"model": {"type": "WordPiece"}})), None);
        assert_eq!(bound(json!({"model": {"type": "Unigram"}})), None);
        assert_eq!(
            bound(json!({"model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": true}})),
            None
        );
    }
}
