//! The llguidance implementation of [`TokenConstraint`]: grammars (JSON schemas,
//! Lark) compiled against a model's vocabulary, matched token by token.
//!
//! Costs: building a [`GrammarCompiler`] (the byte-level token table, its trie and
//! the lexer's token slices) takes a fraction of a second for a 50k vocabulary, so
//! it is built once per tokenizer and shared ([`GrammarCompiler::for_engine`] keeps
//! a small process-wide cache). Compiling a grammar takes milliseconds; a
//! [`CompiledGrammar`] can start any number of [`GrammarMatcher`]s, one per request.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory, TokenParser};
use serde_json::{json, Value};
use toktrie::{TokEnv, TokTrie, TokenId, TokenizerEnv};
use toktrie_hf_tokenizers::ByteTokenizer;

use super::validate::check_schema;
use super::{ConstrainError, TokenConstraint, TokenMask};
use crate::engine::Engine;
use crate::text::Tokenizer;

/// How JSON output may be laid out between tokens of the syntax.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum JsonWhitespace {
    /// `{"a": 1, "b": [1, 2]}`: one space after `:` and `,`, nothing else (Python's
    /// `json.dumps` layout, common in training data). The default: no token is spent
    /// on indentation and no run of whitespace can grow without bound.
    #[default]
    Spaced,
    /// `{"a":1,"b":[1,2]}`: no whitespace at all.
    Compact,
    /// Any JSON whitespace between tokens (llguidance's default).
    Flexible,
}

impl JsonWhitespace {
    /// llguidance's `x-guidance` options for this layout.
    fn options(self) -> Value {
        match self {
            JsonWhitespace::Spaced => json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            }),
            JsonWhitespace::Compact => json!({
                "whitespace_flexible": false,
                "item_separator": ",",
                "key_separator": ":",
            }),
            JsonWhitespace::Flexible => json!({ "whitespace_flexible": true }),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum GrammarKind {
    Json {
        schema: Value,
        whitespace: JsonWhitespace,
    },
    Lark(String),
}

/// What the output must match. Build with [`Grammar::json_schema`],
/// [`Grammar::json_object`] or [`Grammar::lark`]; compile with
/// [`GrammarCompiler::compile`].
#[derive(Debug, Clone, PartialEq)]
pub struct Grammar(GrammarKind);

impl Grammar {
    /// JSON matching `schema` (JSON Schema; the draft named by `$schema`, 2020-12 when
    /// absent). The schema is checked against its meta-schema here, so a malformed
    /// one fails before any model work with a [`ConstrainError::Schema`] naming the
    /// location in the schema. Keywords llguidance cannot enforce fail at
    /// [`GrammarCompiler::compile`]. Only references inside the schema resolve.
    ///
    /// Layout: [`JsonWhitespace::Spaced`] unless changed with
    /// [`Grammar::with_whitespace`] or set by the schema's own `x-guidance` object
    /// (llguidance's options), which wins.
    pub fn json_schema(schema: &Value) -> Result<Grammar, ConstrainError> {
        check_schema(schema)?;
        Ok(Grammar(GrammarKind::Json {
            schema: schema.clone(),
            whitespace: JsonWhitespace::default(),
        }))
    }

    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    pub fn json_object() -> Grammar {
        Grammar(GrammarKind::Json {
            schema: json!({"type": "object"}),
            whitespace: JsonWhitespace::default(),
        })
    }

    /// A grammar in llguidance's Lark dialect
    /// (<https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md>).
    /// Checked at [`GrammarCompiler::compile`].
    ///
    /// Besides Lark's rules, strings and regexes it has:
    /// - special tokens by name, `<tool_call>` or `<|im_end|>`: exactly that one
    ///   token of the vocabulary (an added token written `<...>` counts as special),
    ///   never the same characters spelled by ordinary tokens; `<[766]>` names a token
    ///   by id. A name that is not a token of the vocabulary is a compile error; where
    ///   a model lacks the token, write the tag as a string (`"<tool_call>"`) instead.
    /// - `%json { ...schema... }` as a rule's body: JSON matching that schema inline.
    ///
    /// A forced tool call for a Qwen/Hermes-style template:
    ///
    /// ```text
    /// start: <tool_call> "\n" call "\n" </tool_call>
    /// call: %json {"type": "object", "properties": {"name": {"const": "get_weather"},
    ///   "arguments": {...the tool's parameters schema...}},
    ///   "required": ["name", "arguments"], "additionalProperties": false}
    /// ```
    ///
    /// [`Grammar::lark_json`] renders a schema (with a layout) as such a `%json` body.
    pub fn lark(text: &str) -> Grammar {
        Grammar(GrammarKind::Lark(text.to_string()))
    }

    /// `%json {...}` for a Lark rule body: JSON matching `schema` laid out as
    /// `whitespace` says (unless the schema has its own `x-guidance`). The schema is
    /// checked against its meta-schema.
    pub fn lark_json(schema: &Value, whitespace: JsonWhitespace) -> Result<String, ConstrainError> {
        check_schema(schema)?;
        let schema = with_layout(schema, whitespace);
        Ok(format!("%json {schema}"))
    }

    /// Changes the JSON layout of a JSON grammar; no effect on a Lark grammar.
    pub fn with_whitespace(mut self, layout: JsonWhitespace) -> Grammar {
        if let GrammarKind::Json { whitespace, .. } = &mut self.0 {
            *whitespace = layout;
        }
        self
    }

    fn is_json(&self) -> bool {
        matches!(self.0, GrammarKind::Json { .. })
    }

    fn to_llguidance(&self) -> TopLevelGrammar {
        match &self.0 {
            GrammarKind::Json { schema, whitespace } => {
                TopLevelGrammar::from_json_schema(with_layout(schema, *whitespace))
            }
            GrammarKind::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        }
    }
}

/// `schema` with llguidance's layout options, unless it sets its own. A boolean
/// schema is wrapped (`true` is `{}`, `false` is `{"not": {}}`).
fn with_layout(schema: &Value, whitespace: JsonWhitespace) -> Value {
    let mut s = match schema {
        Value::Bool(true) => json!({}),
        Value::Bool(false) => json!({"not": {}}),
        other => other.clone(),
    };
    if let Some(obj) = s.as_object_mut() {
        obj.entry("x-guidance")
            .or_insert_with(|| whitespace.options());
    }
    s
}

/// The vocabulary grammars are compiled against: llguidance's token table for one
/// tokenizer, padded to the model's vocabulary, with the model's end-of-sequence ids.
/// Build once per model (it is costly) and share: it is `Send + Sync`.
pub struct GrammarCompiler {
    factory: ParserFactory,
    tokenizer_path: PathBuf,
    tokenizer_vocab: usize,
    model_vocab: usize,
    eos: Vec<u32>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("tokenizer", &self.tokenizer_path)
            .field("tokenizer_vocab", &self.tokenizer_vocab)
            .field("model_vocab", &self.model_vocab)
            .field("eos", &self.eos)
            .finish()
    }
}

/// Key of the process-wide cache: the tokenizer file as it is on disk, the model's
/// vocabulary width and end-of-sequence ids.
#[derive(Debug, Clone, PartialEq, Eq)]
struct CacheKey {
    path: PathBuf,
    len: u64,
    modified: Option<SystemTime>,
    model_vocab: usize,
    eos: Vec<u32>,
}

/// Compilers for the most recently used tokenizers (a server holds one model at a
/// time; a few entries cover switching back and forth).
const CACHE_ENTRIES: usize = 4;
static CACHE: Mutex<Vec<(CacheKey, Arc<GrammarCompiler>)>> = Mutex::new(Vec::new());

/// The tokenizer environment grammars are compiled against: the Hugging Face
/// tokenizer's, except that text is never tokenized into special tokens. A Hugging
/// Face tokenizer splits its added tokens out of text (`<tool_call>` becomes one
/// token), but in the grammar's token table such tokens are special: a grammar names
/// them (`<tool_call>`, `<[766]>`), and text never matches them. So when a grammar
/// forces the characters of one (a schema's `"const": "<tool_call>"`), they are
/// spelled with ordinary tokens, as the mask allows, instead of the special token,
/// which the matcher would then refuse.
struct TextOnlyEnv {
    base: TokEnv,
}

impl TokenizerEnv for TextOnlyEnv {
    fn tok_trie(&self) -> &TokTrie {
        self.base.tok_trie()
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let ids = self.base.tokenize_bytes(s);
        let trie = self.base.tok_trie();
        if ids.iter().any(|&t| trie.is_special_token(t)) {
            trie.greedy_tokenize(s)
        } else {
            ids
        }
    }

    fn tokenize_bytes_special(&self, s: &[u8]) -> Vec<TokenId> {
        self.base.tokenize_bytes_special(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        self.base.tokenize_is_canonical()
    }
}

impl GrammarCompiler {
    /// Builds the token table of `tokenizer` for a model whose logits have
    /// `model_vocab` entries (ids from the tokenizer's size up are never allowed)
    /// and which stops on `eos_ids` (what the engine stops on; ids outside the
    /// vocabulary are ignored).
    pub fn new(
        tokenizer: &Tokenizer,
        model_vocab: usize,
        eos_ids: &[u32],
    ) -> Result<GrammarCompiler, ConstrainError> {
        let path = tokenizer.dir().join("tokenizer.json");
        let err = |message: String| ConstrainError::Tokenizer {
            path: path.clone(),
            message,
        };
        let tokenizer_vocab = tokenizer.inner().get_vocab_size(true);
        let width = tokenizer_vocab.max(model_vocab);
        let eos: Vec<u32> = eos_ids
            .iter()
            .copied()
            .filter(|&id| (id as usize) < width)
            .collect();
        let hf = tokenizer.inner().clone();
        // ByteTokenizer asserts on some malformed vocabularies: a panic becomes an error.
        let env = llguidance::panic_utils::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut bt = ByteTokenizer::from_tokenizer(hf)?;
            if !eos.is_empty() {
                bt.set_eos_tokens(&eos);
            }
            bt.into_tok_env(Some(width))
        }))
        .map_err(|e| err(format!("{e:#}")))?;
        let env: TokEnv = Arc::new(TextOnlyEnv { base: env });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| err(format!("{e:#}")))?;
        factory.quiet();
        Ok(GrammarCompiler {
            factory,
            tokenizer_path: path,
            tokenizer_vocab,
            model_vocab,
            eos,
        })
    }

    /// The compiler for `engine`'s tokenizer, vocabulary width and end-of-sequence
    /// ids, shared through a process-wide cache of the last few (keyed by the
    /// tokenizer file's path, size and modification time). An engine without a
    /// tokenizer is an error.
    pub fn for_engine(engine: &Engine) -> Result<Arc<GrammarCompiler>, ConstrainError> {
        let tokenizer = engine
            .tokenizer()
            .ok_or_else(|| ConstrainError::Tokenizer {
                path: engine.dir().join("tokenizer.json"),
                message: "the model has no tokenizer.json".into(),
            })?;
        Self::shared(tokenizer, engine.config().vocab_size, engine.eos_ids())
    }

    /// As [`GrammarCompiler::new`], through the process-wide cache.
    pub fn shared(
        tokenizer: &Tokenizer,
        model_vocab: usize,
        eos_ids: &[u32],
    ) -> Result<Arc<GrammarCompiler>, ConstrainError> {
        let path = tokenizer.dir().join("tokenizer.json");
        let meta = std::fs::metadata(&path).ok();
        let key = CacheKey {
            len: meta.as_ref().map_or(0, |m| m.len()),
            modified: meta.and_then(|m| m.modified().ok()),
            path: path.canonicalize().unwrap_or(path),
            model_vocab,
            eos: eos_ids.to_vec(),
        };
        // A poisoned lock only means another thread panicked mid-build; the list
        // itself is always consistent.
        let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = cache.iter().position(|(k, _)| *k == key) {
            let entry = cache.remove(i);
            let c = entry.1.clone();
            cache.push(entry);
            return Ok(c);
        }
        let c = Arc::new(Self::new(tokenizer, model_vocab, eos_ids)?);
        if cache.len() == CACHE_ENTRIES {
            cache.remove(0);
        }
        cache.push((key, c.clone()));
        Ok(c)
    }

    /// The model's vocabulary width (the masks' width).
    pub fn model_vocab(&self) -> usize {
        self.model_vocab
    }

    /// The tokenizer's vocabulary size; no id at or past it is ever allowed.
    pub fn tokenizer_vocab(&self) -> usize {
        self.tokenizer_vocab
    }

    /// The end-of-sequence ids grammars end with.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    /// Compiles `grammar`. A JSON schema llguidance cannot enforce is a
    /// [`ConstrainError::Schema`]; a Lark grammar that does not parse or names a
    /// token the vocabulary lacks is a [`ConstrainError::Grammar`].
    pub fn compile(&self, grammar: &Grammar) -> Result<CompiledGrammar, ConstrainError> {
        let wrap = |e: String| {
            if grammar.is_json() {
                ConstrainError::Schema {
                    at: None,
                    message: e,
                }
            } else {
                ConstrainError::Grammar { message: e }
            }
        };
        let tlg = grammar.to_llguidance();
        let mut parser =
            llguidance::panic_utils::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.factory.create_parser(tlg)
            }))
            .map_err(|e| wrap(format!("{e:#}")))?;
        for w in parser.grammar_warnings() {
            tracing::warn!(target: "voom::constrain", "grammar warning: {w}");
        }
        Ok(CompiledGrammar {
            parser,
            tokenizer_vocab: self.tokenizer_vocab,
            eos: self.eos.clone(),
        })
    }

    /// Compiles `grammar` and starts one matcher on it.
    pub fn matcher(&self, grammar: &Grammar) -> Result<GrammarMatcher, ConstrainError> {
        Ok(self.compile(grammar)?.matcher())
    }
}

/// A grammar compiled against one vocabulary; starts a fresh matcher per request
/// (matchers share the compiled grammar's lexer caches, so later ones start warm).
#[derive(Clone)]
pub struct CompiledGrammar {
    parser: TokenParser,
    tokenizer_vocab: usize,
    eos: Vec<u32>,
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledGrammar")
            .field("tokenizer_vocab", &self.tokenizer_vocab)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

impl CompiledGrammar {
    /// A matcher at the start of the grammar.
    pub fn matcher(&self) -> GrammarMatcher {
        GrammarMatcher {
            matcher: Matcher::new(Ok(self.parser.clone())),
            tokenizer_vocab: self.tokenizer_vocab,
            eos: self.eos.clone(),
            bytes: Vec::new(),
        }
    }

    /// A matcher at the start of the grammar, checked: the first token's mask is
    /// computed now, so a grammar that fails there (a schema that refers only to
    /// itself, a lexer past its limits) or that admits no output at all is an error
    /// before generation starts, not at its first token. A failure later, in the
    /// middle of the output, is still possible with grammars that grow past the
    /// parser's limits: it is a [`ConstrainError::Matcher`] then.
    pub fn checked_matcher(&self) -> Result<GrammarMatcher, ConstrainError> {
        // llguidance's errors carry a dump of the parser's state after the first line.
        const NOTHING: &str = "it admits no output (no token may begin it)";
        let fail = |e: &dyn std::fmt::Display| {
            let text = format!("{e:#}");
            let first = text.lines().next().unwrap_or_default();
            ConstrainError::CannotStart {
                message: match first {
                    "NoExtension" | "NoExtensionBias" => NOTHING.to_string(),
                    other => other.to_string(),
                },
            }
        };
        let mut m = self.matcher();
        let mask = m.matcher.compute_mask().map_err(|e| fail(&e))?;
        let any_text = (0..self.tokenizer_vocab as u32)
            .any(|id| !self.eos.contains(&id) && mask.is_allowed(id));
        if !any_text && !m.matcher.is_accepting().map_err(|e| fail(&e))? {
            return Err(ConstrainError::CannotStart {
                message: NOTHING.into(),
            });
        }
        Ok(m)
    }
}

/// One request's position in a grammar; implements [`TokenConstraint`].
pub struct GrammarMatcher {
    matcher: Matcher,
    tokenizer_vocab: usize,
    /// Left out of masks: the engine allows its end-of-sequence ids itself when
    /// [`TokenConstraint::may_stop`] says so.
    eos: Vec<u32>,
    /// The bytes of the accepted tokens (special tokens as their names).
    bytes: Vec<u8>,
}

impl std::fmt::Debug for GrammarMatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarMatcher")
            .field("stopped", &self.matcher.is_stopped())
            .field("error", &self.matcher.get_error())
            .field("bytes", &String::from_utf8_lossy(&self.bytes))
            .finish()
    }
}

impl GrammarMatcher {
    /// The text matched so far (the accepted tokens' bytes, lossily decoded).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).into_owned()
    }

    /// The matcher's error, if it failed.
    pub fn error(&self) -> Option<String> {
        self.matcher.get_error()
    }

    fn fail(&self, step: usize, e: impl std::fmt::Display) -> ConstrainError {
        // llguidance appends a dump of the parser's state after the first line.
        let text = format!("{e:#}");
        ConstrainError::Matcher {
            step,
            message: text.lines().next().unwrap_or_default().to_string(),
        }
    }
}

impl TokenConstraint for GrammarMatcher {
    fn fill_mask(&mut self, step: usize, mask: &mut TokenMask) -> Result<(), ConstrainError> {
        let vob = self
            .matcher
            .compute_mask()
            .map_err(|e| self.fail(step, e))?;
        mask.set_words(vob.as_slice());
        // Padding ids (between the tokenizer's size and the model's) and the eos ids
        // are the engine's business, never the grammar's.
        mask.disallow_from(self.tokenizer_vocab);
        for &id in &self.eos {
            mask.disallow(id);
        }
        Ok(())
    }

    fn may_stop(&mut self, step: usize) -> Result<bool, ConstrainError> {
        self.matcher.is_accepting().map_err(|e| self.fail(step, e))
    }

    fn accept(&mut self, step: usize, id: u32) -> Result<(), ConstrainError> {
        self.matcher
            .consume_token(id)
            .map_err(|e| self.fail(step, format!("token id {id}: {e:#}")))?;
        if let Ok(env) = self.matcher.tok_env() {
            self.bytes.extend_from_slice(&env.tok_trie().decode(&[id]));
        }
        Ok(())
    }

    fn is_complete(&self) -> bool {
        self.matcher.is_stopped() && !self.matcher.is_error()
    }
}

#[allow(dead_code)]
fn assert_send_sync() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<GrammarCompiler>();
    send_sync::<CompiledGrammar>();
    send::<GrammarMatcher>();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_options_unless_the_schema_sets_its_own() {
        let s = with_layout(&json!({"type": "object"}), JsonWhitespace::Compact);
        assert_eq!(s["x-guidance"]["item_separator"], ",");
        assert_eq!(s["x-guidance"]["whitespace_flexible"], false);
        let own = json!({"type": "object", "x-guidance": {"whitespace_flexible": true}});
        assert_eq!(with_layout(&own, JsonWhitespace::Spaced), own);
        assert_eq!(
            with_layout(&json!(false), JsonWhitespace::Flexible)["not"],
            json!({})
        );
    }

    #[test]
    fn lark_json_renders_a_checked_schema() {
        let s = Grammar::lark_json(&json!({"type": "integer"}), JsonWhitespace::Spaced).unwrap();
        assert!(s.starts_with("%json {"), "{s}");
        let body: Value = serde_json::from_str(&s["%json ".len()..]).unwrap();
        assert_eq!(body["type"], "integer");
        assert_eq!(body["x-guidance"]["key_separator"], ": ");
        assert!(Grammar::lark_json(&json!({"type": 5}), JsonWhitespace::Spaced).is_err());
    }

    #[test]
    fn whitespace_applies_to_json_grammars_only() {
        let g = Grammar::json_object().with_whitespace(JsonWhitespace::Flexible);
        assert!(matches!(
            g.0,
            GrammarKind::Json {
                whitespace: JsonWhitespace::Flexible,
                ..
            }
        ));
        let l = Grammar::lark("start: \"a\"");
        assert_eq!(l.clone().with_whitespace(JsonWhitespace::Compact), l);
    }
}
