//! Streaming detokenization that never splits a UTF-8 character.
//!
//! Byte-level tokenizers emit tokens that hold part of a character (an emoji is often
//! two to four tokens), and decoders transform text in context (SentencePiece's
//! leading-space rule, byte fallback). Decoding each token alone is therefore wrong.
//! The decoder keeps two offsets into the ids (the method of text-generation-inference
//! and vLLM): `prefix` starts the context window, `read` ends the text already emitted.
//! On each id it decodes `ids[prefix..read]` and `ids[prefix..]`; when the latter is
//! longer and does not end in U+FFFD (an incomplete character), the difference is new
//! text, and the window slides: `prefix = read`, `read = len`.
//!
//! Invariant: `prefix` always sits on a character boundary of the full decode (it is
//! an old `read`, and text is released only when it ends on a complete character), so
//! the window decodes exactly as that stretch of the full decode, and the outputs
//! concatenated with `finish()` equal `Tokenizer::decode` of all ids (when the
//! tokenizer applies no clean-up, see [`Tokenizer::cleans_up_spaces`]).

use super::{TextError, Tokenizer};

/// Incremental decoder over one generated sequence.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    skip_special_tokens: bool,
    /// Ids from the window start on; older ids are dropped, so each step costs the
    /// window, not the whole sequence.
    ids: Vec<u32>,
    /// End of the emitted text, as an index into `ids` (the window starts at 0).
    read: usize,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tok: &'a Tokenizer, skip_special_tokens: bool) -> Self {
        StreamDecoder {
            tok,
            skip_special_tokens,
            ids: Vec::new(),
            read: 0,
        }
    }

    /// Adds one id; returns the text it completes (often empty while a character is
    /// incomplete). An id outside the vocabulary is an error and is not kept.
    pub fn push(&mut self, id: u32) -> Result<String, TextError> {
        if self.tok.id_to_token(id).is_none() {
            return Err(TextError::UnknownTokenId {
                id,
                vocab_size: self.tok.vocab_size(),
            });
        }
        self.ids.push(id);
        let prefix_text = self
            .tok
            .decode_raw(&self.ids[..self.read], self.skip_special_tokens)?;
        let new_text = self.tok.decode_raw(&self.ids, self.skip_special_tokens)?;
        if new_text.len() > prefix_text.len() && !new_text.ends_with('\u{FFFD}') {
            let out = suffix_after(&new_text, &prefix_text);
            // Slide: the emitted stretch becomes the context of the next window.
            self.ids.drain(..self.read);
            self.read = self.ids.len();
            return Ok(out);
        }
        Ok(String::new())
    }

    /// Releases what is still held (bytes of an incomplete character decode as
    /// U+FFFD, as in the full decode) and resets for a new sequence.
    pub fn finish(&mut self) -> Result<String, TextError> {
        let prefix_text = self
            .tok
            .decode_raw(&self.ids[..self.read], self.skip_special_tokens)?;
        let new_text = self.tok.decode_raw(&self.ids, self.skip_special_tokens)?;
        let out = if new_text.len() > prefix_text.len() {
            suffix_after(&new_text, &prefix_text)
        } else {
            String::new()
        };
        self.ids.clear();
        self.read = 0;
        Ok(out)
    }
}

/// The part of `text` after `prefix`. The window's text normally starts with the
/// prefix's text; if a decoder rewrote the boundary, the new text is taken from the
/// longest common prefix on, never cutting a character.
fn suffix_after(text: &str, prefix: &str) -> String {
    if let Some(rest) = text.strip_prefix(prefix) {
        return rest.to_string();
    }
    let common = text
        .char_indices()
        .zip(prefix.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i)
        .unwrap_or(prefix.len().min(text.len()));
    text[common..].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn tok() -> Tokenizer {
        Tokenizer::from_dir(Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/text/bpe_tiny"
        )))
        .unwrap()
    }

    #[test]
    fn emoji_split_over_tokens_is_held_until_complete() {
        let tok = tok();
        let text = "ok 👨‍👩‍👧‍👦🇯🇵 東京";
        let ids = tok.encode(text, false).unwrap();
        let mut dec = StreamDecoder::new(&tok, false);
        let mut pieces = Vec::new();
        let mut held = 0;
        for &id in &ids {
            let piece = dec.push(id).unwrap();
            if piece.is_empty() {
                held += 1;
            }
            assert!(!piece.contains('\u{FFFD}'), "split character in {piece:?}");
            pieces.push(piece);
        }
        pieces.push(dec.finish().unwrap());
        assert!(
            held > 0,
            "the fixture must split some character over tokens"
        );
        assert_eq!(pieces.concat(), text);
    }

    #[test]
    fn unknown_id_is_rejected_and_not_kept() {
        let tok = tok();
        let mut dec = StreamDecoder::new(&tok, false);
        let a = tok.encode("a", false).unwrap()[0];
        assert_eq!(dec.push(a).unwrap(), "a");
        let err = dec.push(u32::MAX).unwrap_err();
        assert!(matches!(
            err,
            TextError::UnknownTokenId { id: u32::MAX, .. }
        ));
        assert_eq!(dec.push(a).unwrap(), "a");
        assert_eq!(dec.finish().unwrap(), "");
    }

    #[test]
    fn suffix_after_never_cuts_a_character() {
        assert_eq!(suffix_after("héllo", "hé"), "llo");
        assert_eq!(suffix_after("h€x", "hé"), "€x");
        assert_eq!(suffix_after("ab", "abc"), "");
    }
}
