//! A Hugging Face model directory's tokenizer with its special tokens, end-of-sequence
//! ids and chat templates.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use tokenizers::models::ModelWrapper;

use super::{ChatTemplate, TextError};

/// The named special tokens of `tokenizer_config.json` (transformers'
/// `special_tokens_map`); each is passed to chat templates as `<name>_token`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: Option<String>,
    pub eos: Option<String>,
    pub unk: Option<String>,
    pub sep: Option<String>,
    pub pad: Option<String>,
    pub cls: Option<String>,
    pub mask: Option<String>,
}

impl SpecialTokens {
    /// `("bos_token", "<s>")`, ... for the tokens that are set, in transformers' order.
    pub fn template_variables(&self) -> Vec<(String, String)> {
        [
            ("bos_token", &self.bos),
            ("eos_token", &self.eos),
            ("unk_token", &self.unk),
            ("sep_token", &self.sep),
            ("pad_token", &self.pad),
            ("cls_token", &self.cls),
            ("mask_token", &self.mask),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.as_ref().map(|v| (k.to_string(), v.clone())))
        .collect()
    }
}

/// A model's tokenizer: `tokenizers::Tokenizer` plus what transformers reads around it.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    dir: PathBuf,
    special: SpecialTokens,
    add_bos_token: Option<bool>,
    /// transformers' `clean_up_tokenization_spaces`, only where it applies (not BPE).
    clean_up_spaces: bool,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    vocab_size: usize,
    /// Bytes of text one token covers at most, where provable ([`Self::min_tokens`]).
    max_bytes_per_token: Option<usize>,
    default_template: Option<ChatTemplate>,
    named_templates: Vec<(String, ChatTemplate)>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("dir", &self.dir)
            .field("vocab_size", &self.vocab_size)
            .field("special", &self.special)
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

/// A side file's text: a regular file (never a blocking open) of bounded size.
fn read_text(path: &Path) -> Result<String, TextError> {
    let io = |source| TextError::Io {
        path: path.to_path_buf(),
        source,
    };
    let bytes = voom_formats::file::read_limited(path, voom_formats::file::SIDE_FILE_MAX_BYTES)
        .map_err(io)?;
    String::from_utf8(bytes).map_err(|e| {
        io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not UTF-8 text: {e}"),
        ))
    })
}

/// Parses `path` if it exists.
fn read_json_opt(path: &Path) -> Result<Option<Json>, TextError> {
    if !voom_formats::file::is_present(path).map_err(|e| TextError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    })? {
        return Ok(None);
    }
    let text = read_text(path)?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| TextError::Json {
            path: path.to_path_buf(),
            source,
        })
}

/// A special token in `tokenizer_config.json`: a string, an `AddedToken` object with
/// a `content` string, or null.
fn token_string(path: &Path, config: &Json, key: &str) -> Result<Option<String>, TextError> {
    match config.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Object(o)) => match o.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(TextError::InvalidConfig {
                path: path.to_path_buf(),
                what: format!("{key} is an object without a string \"content\""),
            }),
        },
        Some(other) => Err(TextError::InvalidConfig {
            path: path.to_path_buf(),
            what: format!("{key} must be a string or an AddedToken object, found {other}"),
        }),
    }
}

/// `eos_token_id` of `generation_config.json`/`config.json`: an int, a list of ints, or null.
fn id_list(path: &Path, value: Option<&Json>, key: &str) -> Result<Vec<u32>, TextError> {
    let bad = |v: &Json| TextError::InvalidConfig {
        path: path.to_path_buf(),
        what: format!("{key} must be a token id or a list of token ids, found {v}"),
    };
    let one = |v: &Json| -> Result<u32, TextError> {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| bad(v))
    };
    match value {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(Json::Array(items)) => items.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

fn bool_field(path: &Path, config: &Json, key: &str) -> Result<Option<bool>, TextError> {
    match config.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(TextError::InvalidConfig {
            path: path.to_path_buf(),
            what: format!("{key} must be a boolean, found {other}"),
        }),
    }
}

impl Tokenizer {
    /// Loads a model directory: `tokenizer.json` (required); `tokenizer_config.json`
    /// (special tokens, `add_bos_token`, `clean_up_tokenization_spaces`,
    /// `chat_template` as a string or a list of named templates);
    /// `chat_template.jinja`, `chat_template.json` and `additional_chat_templates/*.jinja`
    /// (which take priority over the config's template, as in transformers); and the
    /// `eos_token_id` of `generation_config.json` and `config.json`.
    ///
    /// Encoding follows `tokenizer.json`'s post-processor for special tokens, as
    /// transformers does when `tokenizer.json` exists (it then ignores
    /// `add_bos_token`); truncation and padding stored in `tokenizer.json` are
    /// disabled, as transformers disables them for calls that do not ask for them.
    pub fn from_dir(dir: &Path) -> Result<Self, TextError> {
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(TextError::MissingFile {
                path: tok_path,
                what: "the tokenizer of the model",
            });
        }
        let bytes =
            voom_formats::file::read_limited(&tok_path, voom_formats::file::SIDE_FILE_MAX_BYTES)
                .map_err(|source| TextError::Io {
                    path: tok_path.clone(),
                    source,
                })?;
        let mut inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| TextError::TokenizerLoad {
                path: tok_path.clone(),
                message: e.to_string(),
            })?;
        inner.with_padding(None);
        inner
            .with_truncation(None)
            .map_err(|e| TextError::TokenizerLoad {
                path: tok_path.clone(),
                message: e.to_string(),
            })?;
        let vocab_size = inner.get_vocab_size(true);
        let max_bytes_per_token = serde_json::from_slice::<Json>(&bytes).ok().and_then(|j| {
            let vocab = inner.get_vocab(true);
            super::token_bound::max_bytes_per_token(&j, vocab.keys().map(String::as_str))
        });

        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = read_json_opt(&cfg_path)?.unwrap_or(Json::Object(Default::default()));
        if !cfg.is_object() {
            return Err(TextError::InvalidConfig {
                path: cfg_path,
                what: "expected a JSON object".into(),
            });
        }
        let special = SpecialTokens {
            bos: token_string(&cfg_path, &cfg, "bos_token")?,
            eos: token_string(&cfg_path, &cfg, "eos_token")?,
            unk: token_string(&cfg_path, &cfg, "unk_token")?,
            sep: token_string(&cfg_path, &cfg, "sep_token")?,
            pad: token_string(&cfg_path, &cfg, "pad_token")?,
            cls: token_string(&cfg_path, &cfg, "cls_token")?,
            mask: token_string(&cfg_path, &cfg, "mask_token")?,
        };
        let add_bos_token = bool_field(&cfg_path, &cfg, "add_bos_token")?;
        // transformers 5 skips the clean-up for BPE models (it would corrupt their
        // output) and defaults it to off.
        let clean_up_spaces = bool_field(&cfg_path, &cfg, "clean_up_tokenization_spaces")?
            .unwrap_or(false)
            && !matches!(inner.get_model(), ModelWrapper::BPE(_));

        // End-of-sequence ids: generation config first (what generate() stops on), then
        // the model config (also its text_config for multimodal models), then the eos token.
        let mut eos_ids: Vec<u32> = Vec::new();
        let gen_path = dir.join("generation_config.json");
        if let Some(gen) = read_json_opt(&gen_path)? {
            eos_ids.extend(id_list(&gen_path, gen.get("eos_token_id"), "eos_token_id")?);
        }
        let model_cfg_path = dir.join("config.json");
        if let Some(model_cfg) = read_json_opt(&model_cfg_path)? {
            eos_ids.extend(id_list(
                &model_cfg_path,
                model_cfg.get("eos_token_id"),
                "eos_token_id",
            )?);
            if let Some(text_cfg) = model_cfg.get("text_config") {
                eos_ids.extend(id_list(
                    &model_cfg_path,
                    text_cfg.get("eos_token_id"),
                    "text_config.eos_token_id",
                )?);
            }
        }
        if let Some(eos) = &special.eos {
            let id = inner
                .token_to_id(eos)
                .ok_or_else(|| TextError::InvalidConfig {
                    path: cfg_path.clone(),
                    what: format!("eos_token {eos:?} is not in the vocabulary of tokenizer.json"),
                })?;
            eos_ids.push(id);
        }
        let mut seen = std::collections::HashSet::new();
        eos_ids.retain(|id| seen.insert(*id));
        let bos_id = special.bos.as_deref().and_then(|b| inner.token_to_id(b));

        let vars = special.template_variables();
        let compile = |name: &str, source: &str| {
            ChatTemplate::with_special_tokens(name, source, vars.clone())
        };
        let mut default_template = None;
        let mut named_templates = Vec::new();
        let jinja_path = dir.join("chat_template.jinja");
        let json_path = dir.join("chat_template.json");
        if jinja_path.is_file() {
            let src = read_text(&jinja_path)?;
            default_template = Some(compile(&jinja_path.display().to_string(), &src)?);
        } else if let Some(j) = read_json_opt(&json_path)? {
            match j.get("chat_template") {
                Some(Json::String(src)) => {
                    default_template = Some(compile(&json_path.display().to_string(), src)?)
                }
                _ => {
                    return Err(TextError::InvalidConfig {
                        path: json_path,
                        what: "expected {\"chat_template\": \"...\"}".into(),
                    })
                }
            }
        }
        let extra_dir = dir.join("additional_chat_templates");
        if extra_dir.is_dir() {
            let entries = std::fs::read_dir(&extra_dir).map_err(|source| TextError::Io {
                path: extra_dir.clone(),
                source,
            })?;
            let mut paths: Vec<PathBuf> = Vec::new();
            for entry in entries {
                let entry = entry.map_err(|source| TextError::Io {
                    path: extra_dir.clone(),
                    source,
                })?;
                let p = entry.path();
                if p.extension().is_some_and(|e| e == "jinja") {
                    paths.push(p);
                }
            }
            paths.sort();
            for p in paths {
                let name = p
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let src = read_text(&p)?;
                named_templates.push((name, compile(&p.display().to_string(), &src)?));
            }
        }
        let from_files = default_template.is_some() || !named_templates.is_empty();
        if !from_files {
            let label = |suffix: &str| format!("{}:chat_template{suffix}", cfg_path.display());
            match cfg.get("chat_template") {
                None | Some(Json::Null) => {}
                Some(Json::String(src)) => default_template = Some(compile(&label(""), src)?),
                Some(Json::Array(items)) => {
                    for item in items {
                        let (Some(Json::String(name)), Some(Json::String(src))) =
                            (item.get("name"), item.get("template"))
                        else {
                            return Err(TextError::InvalidConfig {
                                path: cfg_path.clone(),
                                what: "chat_template list entries need string \"name\" and \"template\"".into(),
                            });
                        };
                        let t = compile(&label(&format!("[{name}]")), src)?;
                        if name == "default" {
                            default_template = Some(t);
                        } else {
                            named_templates.push((name.clone(), t));
                        }
                    }
                }
                Some(other) => {
                    return Err(TextError::InvalidConfig {
                        path: cfg_path.clone(),
                        what: format!("chat_template must be a string or a list, found {other}"),
                    })
                }
            }
        }

        Ok(Tokenizer {
            inner,
            dir: dir.to_path_buf(),
            special,
            add_bos_token,
            clean_up_spaces,
            bos_id,
            eos_ids,
            vocab_size,
            max_bytes_per_token,
            default_template,
            named_templates,
        })
    }

    /// Token ids of `text`. With `add_special_tokens`, the post-processor of
    /// `tokenizer.json` adds what the model expects (e.g. BOS); a rendered chat prompt
    /// already holds its special tokens and is encoded without.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| TextError::Encode {
                message: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// A lower bound on the number of ids `encode(text, _)` returns, from the text's
    /// length alone (no tokenizing): a prompt whose bound already exceeds a context
    /// can be refused at once. 0 where the tokenizer allows no such bound (its
    /// normalizer or pre-tokenizer can delete text; a model other than BPE).
    pub fn min_tokens(&self, text: &str) -> usize {
        self.max_bytes_per_token
            .map_or(0, |b| text.len().div_ceil(b.max(1)))
    }

    /// Text of `ids`, as transformers' `decode` (including its space clean-up where the
    /// model's config asks for it and the model is not BPE). Every id must be in the
    /// vocabulary.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TextError> {
        let text = self.decode_raw(ids, skip_special_tokens)?;
        Ok(if self.clean_up_spaces {
            clean_up_tokenization(&text)
        } else {
            text
        })
    }

    /// The tokenizer's decode without transformers' clean-up step.
    pub(crate) fn decode_raw(
        &self,
        ids: &[u32],
        skip_special_tokens: bool,
    ) -> Result<String, TextError> {
        if let Some(&id) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            return Err(TextError::UnknownTokenId {
                id,
                vocab_size: self.vocab_size,
            });
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TextError::Decode {
                message: e.to_string(),
            })
    }

    /// Whether `decode` applies transformers' `clean_up_tokenization` (then streaming
    /// output can differ from it around " ." and " 's"; never for BPE models).
    pub fn cleans_up_spaces(&self) -> bool {
        self.clean_up_spaces
    }

    /// Every id generation stops on: `generation_config.json` `eos_token_id` (int or
    /// list), `config.json` `eos_token_id`, and the id of `eos_token`, deduplicated.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.special.bos.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.special.eos.as_deref()
    }

    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// `add_bos_token` of `tokenizer_config.json`, for information: encoding follows
    /// `tokenizer.json`'s post-processor, as transformers does.
    pub fn add_bos_token(&self) -> Option<bool> {
        self.add_bos_token
    }

    /// The default chat template (`chat_template.jinja`, or the config's string, or
    /// the entry named "default").
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.default_template.as_ref()
    }

    /// The template transformers picks: `tool_use` when tools are given and the model
    /// has one, else the default.
    pub fn chat_template_for(&self, with_tools: bool) -> Option<&ChatTemplate> {
        if with_tools {
            if let Some(t) = self.chat_template_named("tool_use") {
                return Some(t);
            }
        }
        self.chat_template()
    }

    /// A named template (`additional_chat_templates/NAME.jinja` or a config list entry).
    pub fn chat_template_named(&self, name: &str) -> Option<&ChatTemplate> {
        if name == "default" {
            return self.chat_template();
        }
        self.named_templates
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t)
    }

    /// Number of tokens including added tokens (ids are below it for contiguous vocabularies).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The directory this tokenizer was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// transformers' `clean_up_tokenization`: removes the spaces WordPiece-style decoding
/// leaves before punctuation and English contractions, in the same order.
fn clean_up_tokenization(text: &str) -> String {
    text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> PathBuf {
        PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/text/bpe_tiny"
        ))
    }

    #[test]
    fn clean_up_matches_transformers_order() {
        assert_eq!(
            clean_up_tokenization("Hello , world ! I 'm fine . Do n't ' x ' they 're"),
            "Hello, world! I'm fine. Don't'x'they're"
        );
    }

    #[test]
    fn missing_tokenizer_json_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TextError::MissingFile { .. }));
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
    }

    fn copy_fixture() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for f in [
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "config.json",
        ] {
            std::fs::copy(fixture().join(f), dir.path().join(f)).unwrap();
        }
        dir
    }

    #[test]
    fn corrupt_files_are_typed_errors_naming_them() {
        let dir = copy_fixture();
        std::fs::write(
            dir.path().join("generation_config.json"),
            "{\"eos_token_id\": \"x\"}",
        )
        .unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TextError::InvalidConfig { .. }), "{err}");
        assert!(err.to_string().contains("generation_config.json"), "{err}");

        std::fs::write(dir.path().join("generation_config.json"), "{}").unwrap();
        std::fs::write(dir.path().join("tokenizer_config.json"), "{\"bos_token\": ").unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TextError::Json { .. }), "{err}");
        assert!(err.to_string().contains("tokenizer_config.json"), "{err}");

        std::fs::write(dir.path().join("tokenizer_config.json"), "{}").unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": 3}").unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TextError::TokenizerLoad { .. }), "{err}");

        let dir = copy_fixture();
        std::fs::write(dir.path().join("chat_template.jinja"), "{% for %}").unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(
            matches!(err, TextError::TemplateSyntax { line: 1, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("chat_template.jinja"), "{err}");
    }

    #[test]
    fn template_files_take_priority_and_named_templates_load() {
        let dir = copy_fixture();
        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "J{{ bos_token }}{{ pad_token }}",
        )
        .unwrap();
        std::fs::create_dir(dir.path().join("additional_chat_templates")).unwrap();
        std::fs::write(
            dir.path().join("additional_chat_templates/tool_use.jinja"),
            "T{{ tools | length }}",
        )
        .unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let plain = tok.chat_template_for(false).unwrap();
        assert_eq!(plain.render(&[], None, false, None).unwrap(), "J<s><pad>");
        let tools = [serde_json::json!({"type": "function"})];
        let t = tok.chat_template_for(true).unwrap();
        assert_eq!(t.render(&[], Some(&tools), false, None).unwrap(), "T1");
    }

    #[test]
    fn config_template_list_selects_default() {
        let dir = copy_fixture();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"eos_token": "</s>", "chat_template": [{"name": "default", "template": "D"}, {"name": "rag", "template": "R{{ eos_token }}"}]}"#,
        )
        .unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(
            tok.chat_template()
                .unwrap()
                .render(&[], None, false, None)
                .unwrap(),
            "D"
        );
        let rag = tok.chat_template_named("rag").unwrap();
        assert_eq!(rag.render(&[], None, false, None).unwrap(), "R</s>");
        assert!(rag
            .name()
            .ends_with("tokenizer_config.json:chat_template[rag]"));
    }
}
