//! Text in and out of the engine: tokenization, chat templates, streaming detokenization.
//!
//! - [`Tokenizer`] loads a Hugging Face model directory (`tokenizer.json`, and the
//!   special tokens, end-of-sequence ids and chat templates spread over
//!   `tokenizer_config.json`, `chat_template.jinja`/`.json`, `generation_config.json`
//!   and `config.json`), and encodes/decodes like transformers' fast tokenizers.
//! - [`ChatTemplate`] renders a chat template as transformers'
//!   `apply_chat_template(..., tokenize=False)` does (jinja2 with `trim_blocks`,
//!   `lstrip_blocks`, loop controls, `raise_exception`, HF's `tojson`, `strftime_now`,
//!   Python string methods, and Python's way of printing values). The rendered prompt
//!   is then encoded with `add_special_tokens = false`, as transformers does.
//! - [`StreamDecoder`] turns generated ids into text incrementally without ever
//!   splitting a UTF-8 character; its outputs concatenate to the full decode.

mod chat;
mod detok;
mod token_bound;
mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate};
pub use detok::StreamDecoder;
pub use tokenizer::{SpecialTokens, Tokenizer};

use std::path::PathBuf;

/// Errors of the text layer. Each names the file or template concerned.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A required file of the model directory is absent.
    #[error("{path}: file not found ({what})")]
    MissingFile { path: PathBuf, what: &'static str },
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file is not valid JSON.
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// A configuration file is valid JSON but a field has an unusable value.
    #[error("{path}: {what}")]
    InvalidConfig { path: PathBuf, what: String },
    /// The `tokenizers` library rejected `tokenizer.json`.
    #[error("{path}: cannot load tokenizer: {message}")]
    TokenizerLoad { path: PathBuf, message: String },
    /// Encoding a text failed inside the tokenizer.
    #[error("encoding failed: {message}")]
    Encode { message: String },
    /// Decoding ids failed inside the tokenizer.
    #[error("decoding failed: {message}")]
    Decode { message: String },
    /// An id names no token of the vocabulary (including added tokens).
    #[error("token id {id} is not in the vocabulary (size {vocab_size})")]
    UnknownTokenId { id: u32, vocab_size: usize },
    /// The chat template does not parse.
    #[error("chat template {template}: syntax error at line {line}: {message}")]
    TemplateSyntax {
        template: String,
        line: usize,
        message: String,
    },
    /// Rendering failed (type error, undefined attribute of an undefined value, ...).
    #[error("chat template {template}: render error{}: {message}", line.map(|l| format!(" at line {l}")).unwrap_or_default())]
    TemplateRender {
        template: String,
        line: Option<usize>,
        message: String,
    },
    /// The template called `raise_exception(message)`: the conversation is not one
    /// this model accepts (e.g. roles that do not alternate).
    #[error("chat template {template} rejected the conversation: {message}")]
    TemplateRaised { template: String, message: String },
    /// The messages or template variables given to a render are malformed.
    #[error("chat template {template}: invalid input: {what}")]
    InvalidChatInput { template: String, what: String },
    /// The model defines no chat template.
    #[error("{path}: the model defines no chat template")]
    NoChatTemplate { path: PathBuf },
}
