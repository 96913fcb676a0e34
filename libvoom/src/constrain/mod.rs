//! Token-level constrained decoding: before each token is chosen, a
//! [`TokenConstraint`] says which token ids may come next; the engine
//! ([`crate::engine::Engine::generate_constrained`]) chooses only among them, then
//! tells the constraint which token it chose.
//!
//! - [`TokenConstraint`] and [`TokenMask`] are the engine-level seam; they know
//!   nothing of grammars.
//! - [`GrammarCompiler`], [`Grammar`] and [`GrammarMatcher`] implement it with
//!   llguidance: JSON schemas (`response_format` json_schema), any JSON object
//!   (json_object) and Lark grammars (forced tool calls: a tag, JSON with the tool's
//!   schema, a closing tag).
//! - [`validate_json`] checks a value against a JSON schema (the `jsonschema` crate),
//!   so a server can check generated arguments before returning them.

mod llg;
mod validate;

pub use llg::{CompiledGrammar, Grammar, GrammarCompiler, GrammarMatcher, JsonWhitespace};
pub use validate::{validate_json, JsonValidator};

/// Errors of constrained decoding. Each says which input was wrong and how.
#[derive(Debug, thiserror::Error)]
pub enum ConstrainError {
    /// The tokenizer cannot be turned into the byte-level token table grammars
    /// are matched against.
    #[error("{path}: cannot build the token table for constrained decoding: {message}")]
    Tokenizer {
        path: std::path::PathBuf,
        message: String,
    },
    /// A JSON schema is malformed or uses something the grammar compiler rejects.
    /// `at` is the JSON pointer of the offending part of the schema when known.
    #[error("invalid JSON schema{}: {message}", at_suffix(.at))]
    Schema { at: Option<String>, message: String },
    /// A Lark grammar does not parse or does not compile against the vocabulary.
    #[error("invalid Lark grammar: {message}")]
    Grammar { message: String },
    /// The grammar fails before its first token: it admits no output at all (a
    /// schema that only refers to itself), or its start already exceeds the
    /// parser's limits.
    #[error("the grammar cannot start: {message}")]
    CannotStart { message: String },
    /// The constraint failed while generating (its internal state, a token it
    /// cannot consume). `step` counts generated tokens from 0.
    #[error("constrained decoding failed at generated token {step}: {message}")]
    Matcher { step: usize, message: String },
    /// The constraint allows no token of the model's vocabulary.
    #[error(
        "constrained decoding: no token of the vocabulary (size {vocab}) is allowed at generated token {step}"
    )]
    NothingAllowed { step: usize, vocab: usize },
    /// A JSON value does not satisfy a schema ([`validate_json`]); one message per
    /// violation, each naming the location in the value.
    #[error("the value does not match the JSON schema: {}", .errors.join("; "))]
    Invalid { errors: Vec<String> },
}

fn at_suffix(at: &Option<String>) -> String {
    match at {
        Some(p) if !p.is_empty() => format!(" at {p}"),
        Some(_) => " at the root".to_string(),
        None => String::new(),
    }
}

/// The set of token ids allowed next, a bitmask over the model's vocabulary (the
/// width of its logits, which can exceed the tokenizer's size). Bit `i` is bit
/// `i % 32` of word `i / 32`, the layout of llguidance's `SimpleVob`. Ids at or past
/// [`TokenMask::len`] are never allowed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
    len: usize,
}

impl TokenMask {
    /// A mask over `len` ids with none allowed.
    pub fn new(len: usize) -> Self {
        TokenMask {
            words: vec![0; len.div_ceil(32)],
            len,
        }
    }

    /// The number of ids the mask covers (the model's vocabulary size).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Disallows every id.
    pub fn clear(&mut self) {
        self.words.iter_mut().for_each(|w| *w = 0);
    }

    /// Allows `id`; an id at or past `len` is ignored (it can never be generated).
    pub fn allow(&mut self, id: u32) {
        if (id as usize) < self.len {
            self.words[id as usize / 32] |= 1 << (id % 32);
        }
    }

    /// Disallows `id`; an id at or past `len` is ignored.
    pub fn disallow(&mut self, id: u32) {
        if (id as usize) < self.len {
            self.words[id as usize / 32] &= !(1 << (id % 32));
        }
    }

    /// Disallows every id from `first` on (ids past a tokenizer's vocabulary).
    pub fn disallow_from(&mut self, first: usize) {
        if first >= self.len {
            return;
        }
        let w = first / 32;
        self.words[w] &= (1u32 << (first % 32)) - 1;
        self.words[w + 1..].iter_mut().for_each(|x| *x = 0);
    }

    pub fn is_allowed(&self, id: u32) -> bool {
        (id as usize) < self.len && self.words[id as usize / 32] & (1 << (id % 32)) != 0
    }

    /// How many ids are allowed.
    pub fn count_allowed(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Whether no id is allowed.
    pub fn none_allowed(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// The allowed ids in increasing order.
    pub fn allowed_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.words.iter().enumerate().flat_map(|(wi, &w)| {
            let mut w = w;
            std::iter::from_fn(move || {
                if w == 0 {
                    return None;
                }
                let b = w.trailing_zeros();
                w &= w - 1;
                Some(wi as u32 * 32 + b)
            })
        })
    }

    /// Replaces the mask by `words` (same bit layout). Words past the mask's width
    /// are ignored, missing words are zero, and bits at or past `len` are cleared,
    /// so a wider source (a tokenizer larger than the model) never allows an id the
    /// model cannot produce.
    pub fn set_words(&mut self, words: &[u32]) {
        let n = self.words.len().min(words.len());
        self.words[..n].copy_from_slice(&words[..n]);
        self.words[n..].iter_mut().for_each(|w| *w = 0);
        let tail = self.len % 32;
        if tail != 0 {
            if let Some(last) = self.words.last_mut() {
                *last &= (1u32 << tail) - 1;
            }
        }
    }

    /// The raw words (bit `i % 32` of word `i / 32` is id `i`).
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// Sets the logit of every disallowed id to negative infinity.
    pub fn apply(&self, logits: &mut [f32]) {
        for (i, l) in logits.iter_mut().enumerate() {
            if !self.is_allowed(i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    /// The allowed ids among `logits` and their logits, in increasing id order.
    /// Sampling over this list is sampling over the logits with every disallowed
    /// logit at negative infinity (equal logits still resolve to the lowest id, as
    /// relative order is kept), except that no rounding residue can ever pick a
    /// disallowed id.
    pub fn gather(&self, logits: &[f32], ids: &mut Vec<u32>, values: &mut Vec<f32>) {
        ids.clear();
        values.clear();
        for id in self.allowed_ids() {
            match logits.get(id as usize) {
                Some(&v) => {
                    ids.push(id);
                    values.push(v);
                }
                None => break,
            }
        }
    }
}

/// A constraint on generated tokens, driven by the engine one token at a time.
///
/// The caller's protocol, for each generated token:
/// 1. [`fill_mask`](Self::fill_mask) with a cleared mask as wide as the model's
///    vocabulary; the constraint allows the ids that may come next.
/// 2. [`may_stop`](Self::may_stop): whether the output would be complete if
///    generation ended here (the engine then also allows its end-of-sequence ids,
///    and disallows them otherwise).
/// 3. The engine chooses an allowed id. An end-of-sequence id ends generation and
///    is not passed on; any other id goes to [`accept`](Self::accept).
/// 4. After `accept`, [`is_complete`](Self::is_complete) says the constraint admits
///    no further token: generation must end there.
pub trait TokenConstraint {
    /// Allows in `mask` (given cleared) every id that may be generated next.
    /// `step` counts generated tokens from 0 (for error messages).
    fn fill_mask(&mut self, step: usize, mask: &mut TokenMask) -> Result<(), ConstrainError>;

    /// Whether generation may end before the next token (the output so far is
    /// complete, though it could go on).
    fn may_stop(&mut self, step: usize) -> Result<bool, ConstrainError>;

    /// Advances past `id`, which the last mask allowed.
    fn accept(&mut self, step: usize, id: u32) -> Result<(), ConstrainError>;

    /// The output is complete and admits no further token.
    fn is_complete(&self) -> bool;
}

/// A constraint borrowed is a constraint.
impl<T: TokenConstraint + ?Sized> TokenConstraint for &mut T {
    fn fill_mask(&mut self, step: usize, mask: &mut TokenMask) -> Result<(), ConstrainError> {
        (**self).fill_mask(step, mask)
    }

    fn may_stop(&mut self, step: usize) -> Result<bool, ConstrainError> {
        (**self).may_stop(step)
    }

    fn accept(&mut self, step: usize, id: u32) -> Result<(), ConstrainError> {
        (**self).accept(step, id)
    }

    fn is_complete(&self) -> bool {
        (**self).is_complete()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_bits_and_bounds() {
        let mut m = TokenMask::new(70);
        assert_eq!(m.words().len(), 3);
        assert!(m.none_allowed());
        m.allow(0);
        m.allow(31);
        m.allow(32);
        m.allow(69);
        m.allow(70); // past the vocabulary: ignored
        m.allow(u32::MAX);
        assert_eq!(m.allowed_ids().collect::<Vec<_>>(), vec![0, 31, 32, 69]);
        assert_eq!(m.count_allowed(), 4);
        assert!(!m.is_allowed(70));
        m.disallow(31);
        assert!(!m.is_allowed(31));
        m.disallow_from(33);
        assert_eq!(m.allowed_ids().collect::<Vec<_>>(), vec![0, 32]);
        m.disallow_from(32);
        assert_eq!(m.allowed_ids().collect::<Vec<_>>(), vec![0]);
        m.disallow_from(70);
        m.disallow_from(1000);
        assert_eq!(m.count_allowed(), 1);
        m.clear();
        assert!(m.none_allowed());
    }

    #[test]
    fn set_words_truncates_to_the_model_vocabulary() {
        // A tokenizer wider than the model: ids 40.. of the source must not survive.
        let mut m = TokenMask::new(40);
        m.set_words(&[u32::MAX, u32::MAX, u32::MAX]);
        assert_eq!(m.count_allowed(), 40);
        assert!(m.is_allowed(39));
        assert!(!m.is_allowed(40));
        // A narrower source leaves the rest disallowed.
        m.set_words(&[0b1010]);
        assert_eq!(m.allowed_ids().collect::<Vec<_>>(), vec![1, 3]);
    }

    #[test]
    fn gather_equals_masking_for_argmax() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 17) as f32 * 0.5).collect();
        let mut m = TokenMask::new(100);
        for id in [3u32, 5, 50, 51, 99] {
            m.allow(id);
        }
        let mut masked = logits.clone();
        m.apply(&mut masked);
        let (mut ids, mut vals) = (Vec::new(), Vec::new());
        m.gather(&logits, &mut ids, &mut vals);
        assert_eq!(ids, vec![3, 5, 50, 51, 99]);
        let full = crate::sampler::argmax(&masked);
        let compact = ids[crate::sampler::argmax(&vals) as usize];
        assert_eq!(full, compact);
        assert!(m.is_allowed(full));
        for (i, v) in masked.iter().enumerate() {
            assert_eq!(v.is_finite(), m.is_allowed(i as u32), "id {i}");
        }
    }

    #[test]
    fn gather_stops_at_the_logits_width() {
        let mut m = TokenMask::new(64);
        m.allow(2);
        m.allow(60);
        let (mut ids, mut vals) = (Vec::new(), Vec::new());
        m.gather(&[0.0; 10], &mut ids, &mut vals);
        assert_eq!(ids, vec![2]);
    }
}
