//! `tokenizer.json`, `tokenizer_config.json` and the special token ids, from a GGUF's
//! `tokenizer.*` metadata.
//!
//! Only byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`) are converted.
//! The pre-tokenizer is chosen by `tokenizer.ggml.pre`, the name llama.cpp uses to pick
//! its own splitting regexes; a name without a known equivalent is refused rather than
//! guessed, because a wrong pre-tokenizer silently changes token ids.

use std::path::Path;

use serde_json::json;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PostProcessorWrapper, PreTokenizerWrapper, Tokenizer};
use voom_formats::gguf::GgufFile;

use super::ImportError;

/// llama.cpp's token types (`llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Special token ids from `tokenizer.ggml.*_token_id`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
}

impl SpecialIds {
    pub fn generation_config_json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for (k, v) in [
            ("bos_token_id", self.bos),
            ("eos_token_id", self.eos),
            ("pad_token_id", self.pad),
        ] {
            if let Some(v) = v {
                m.insert(k.into(), v.into());
            }
        }
        serde_json::Value::Object(m)
    }
}

pub(super) struct Built {
    pub tokenizer_json: String,
    pub tokenizer_config: serde_json::Value,
    pub special_ids: SpecialIds,
    pub vocab_len: usize,
}

/// GPT-2's byte-to-character table (`bytes_to_unicode`): printable bytes stand for
/// themselves, the others for 256 + their rank among the non-printable ones.
pub(super) fn byte_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
        let c = if printable {
            u32::from(b)
        } else {
            let c = next;
            next += 1;
            c
        };
        // All values are below 0x200, valid scalar values.
        table[b as usize] = char::from_u32(c).unwrap_or('\u{fffd}');
    }
    table
}

/// Qwen2's (and Qwen3's) pre-tokenizer regex: each digit alone.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Llama 3's pre-tokenizer regex: digits in runs of up to three.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `Split(regex, Isolated)` then `ByteLevel(use_regex = false)`.
fn split_then_bytes(regex: &str) -> Result<PreTokenizerWrapper, ImportError> {
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::SplitDelimiterBehavior;
    let split = Split::new(
        SplitPattern::Regex(regex.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .expect("the pre-tokenizer regex compiles");
    Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
        PreTokenizerWrapper::Split(split),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, false)),
    ])))
}

/// The pre-tokenizer equivalent to llama.cpp's splitting for `pre`.
fn pre_tokenizer(path: &Path, pre: &str) -> Result<PreTokenizerWrapper, ImportError> {
    // GPT-2's regex, which `ByteLevel(use_regex = true)` applies.
    let byte_level = || PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true));
    match pre {
        // llama.cpp: `\p{N}` (each digit alone), then GPT-2's regex. The published
        // SmolLM2 tokenizer.json: Digits(individual) then ByteLevel.
        "smollm" => Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            byte_level(),
        ]))),
        // llama.cpp spells GPT-2's pre-tokenizer "gpt-2".
        "gpt-2" | "gpt2" => Ok(byte_level()),
        // The published tokenizer.json files: a Split on the model's regex (isolated
        // matches), then the byte-level mapping without GPT-2's regex. The regexes
        // are tokenizer.json's, which llama.cpp's `llama-vocab.cpp` quotes (its own
        // spell the case-insensitive contractions out, the same matches).
        "qwen2" => split_then_bytes(QWEN2_REGEX),
        "llama-bpe" => split_then_bytes(LLAMA3_REGEX),
        other => Err(ImportError::Unsupported {
            path: path.to_path_buf(),
            what: format!(
                "tokenizer pre-tokenizer '{other}' (supported: smollm, gpt-2, qwen2, llama-bpe)"
            ),
        }),
    }
}

pub(super) fn build(g: &GgufFile, context_length: u64) -> Result<Built, ImportError> {
    let path = g.path().to_path_buf();
    let tok_err = |detail: String| ImportError::Tokenizer {
        path: path.clone(),
        detail,
    };
    let model = g
        .get_str("tokenizer.ggml.model")?
        .ok_or_else(|| g.missing_key("tokenizer.ggml.model"))?;
    if model != "gpt2" {
        return Err(ImportError::Unsupported {
            path,
            what: format!("tokenizer model '{model}' (supported: gpt2, byte-level BPE)"),
        });
    }
    let pre_name = g.get_str("tokenizer.ggml.pre")?.unwrap_or("default");
    let pre = pre_tokenizer(&path, pre_name)?;

    let tokens = g
        .get_str_array("tokenizer.ggml.tokens")?
        .ok_or_else(|| g.missing_key("tokenizer.ggml.tokens"))?;
    let types = g
        .get_int_array("tokenizer.ggml.token_type")?
        .unwrap_or_default();
    if !types.is_empty() && types.len() != tokens.len() {
        return Err(tok_err(format!(
            "{} token types for {} tokens",
            types.len(),
            tokens.len()
        )));
    }
    let merges = g
        .get_str_array("tokenizer.ggml.merges")?
        .ok_or_else(|| g.missing_key("tokenizer.ggml.merges"))?;
    let n_tokens = u32::try_from(tokens.len())
        .map_err(|_| tok_err(format!("{} tokens do not fit u32 ids", tokens.len())))?;

    // A token not written in the byte alphabet is spelled in it from its UTF-8 bytes,
    // as transformers' GGUF conversion does (the BPE model only sees byte characters).
    let alphabet = byte_alphabet();
    let in_alphabet = |s: &str| s.chars().all(|c| alphabet.contains(&c));
    let mut vocab = tokenizers::models::bpe::Vocab::with_capacity(tokens.len());
    for (id, t) in (0..n_tokens).zip(tokens) {
        let spelled = if in_alphabet(t) {
            t.clone()
        } else {
            t.bytes().map(|b| alphabet[b as usize]).collect()
        };
        if let Some(prev) = vocab.insert(spelled.clone(), id) {
            return Err(tok_err(format!(
                "tokens {prev} and {id} are both '{spelled}'"
            )));
        }
    }
    let mut pairs = Vec::with_capacity(merges.len());
    for (i, m) in merges.iter().enumerate() {
        match m.split(' ').collect::<Vec<_>>()[..] {
            [a, b] if !a.is_empty() && !b.is_empty() => pairs.push((a.to_string(), b.to_string())),
            _ => return Err(tok_err(format!("merge #{i} '{m}' is not two tokens"))),
        }
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab.clone(), pairs)
        .build()
        .map_err(|e| tok_err(format!("BPE model: {e}")))?;

    let ids = SpecialIds {
        bos: g.get_u32("tokenizer.ggml.bos_token_id")?,
        eos: g.get_u32("tokenizer.ggml.eos_token_id")?,
        unk: g.get_u32("tokenizer.ggml.unknown_token_id")?,
        pad: g.get_u32("tokenizer.ggml.padding_token_id")?,
    };
    let token_of = |key: &str, id: Option<u32>| -> Result<Option<String>, ImportError> {
        match id {
            None => Ok(None),
            Some(i) if i < n_tokens => Ok(Some(tokens[i as usize].clone())),
            Some(i) => Err(tok_err(format!(
                "{key} {i} is not below the {n_tokens} tokens"
            ))),
        }
    };
    let bos = token_of("bos_token_id", ids.bos)?;
    let eos = token_of("eos_token_id", ids.eos)?;
    let unk = token_of("unknown_token_id", ids.unk)?;
    let pad = token_of("padding_token_id", ids.pad)?;
    // gpt2 vocabularies add no BOS unless the file says so (llama.cpp's default).
    let add_bos = g.get_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(false);
    let add_eos = g.get_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);

    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(pre));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    let post: PostProcessorWrapper = if add_bos || add_eos {
        let mut single = Vec::new();
        let mut specials = Vec::new();
        for (on, tok, id, key) in [
            (add_bos, &bos, ids.bos, "bos"),
            (add_eos, &eos, ids.eos, "eos"),
        ] {
            if !on {
                continue;
            }
            let (Some(tok), Some(id)) = (tok, id) else {
                return Err(tok_err(format!(
                    "add_{key}_token is set but there is no {key} token"
                )));
            };
            specials.push((tok.clone(), id));
            single.push(format!("{tok}:0"));
            if key == "bos" {
                single.push("$A:0".into());
            }
        }
        if !add_bos {
            single.insert(0, "$A:0".into());
        }
        TemplateProcessing::builder()
            .try_single(single.join(" "))
            .map_err(|e| tok_err(format!("template: {e}")))?
            .special_tokens(specials)
            .build()
            .map_err(|e| tok_err(format!("template: {e}")))?
            .into()
    } else {
        ByteLevel::new(false, false, true).into()
    };
    tokenizer.with_post_processor(Some(post));

    // Control tokens (like `<|im_start|>`) are matched whole and are special; user
    // defined ones are matched whole and are not. As in transformers' conversion, a
    // control token outside the byte alphabet is a llama.cpp mislabel and is skipped,
    // and a user-defined token is added only under its own spelling.
    let mut control = Vec::new();
    let mut user = Vec::new();
    for (t, &ty) in tokens.iter().zip(&types) {
        if ty == TOKEN_TYPE_CONTROL && in_alphabet(t) {
            control.push(AddedToken::from(t.clone(), true).normalized(false));
        } else if ty == TOKEN_TYPE_USER_DEFINED && vocab.contains_key(t) {
            user.push(AddedToken::from(t.clone(), false).normalized(false));
        }
    }
    tokenizer.add_special_tokens(&control);
    tokenizer.add_tokens(&user);
    let tokenizer_json = tokenizer
        .to_string(true)
        .map_err(|e| tok_err(format!("serializing tokenizer.json: {e}")))?;

    let mut config = serde_json::Map::new();
    config.insert("add_bos_token".into(), add_bos.into());
    config.insert("add_eos_token".into(), add_eos.into());
    config.insert("add_prefix_space".into(), false.into());
    config.insert("clean_up_tokenization_spaces".into(), false.into());
    config.insert("model_max_length".into(), context_length.into());
    // Not "GPT2Tokenizer": transformers 5 rebuilds that class's pre-tokenizer (dropping
    // SmolLM2's digit split) instead of loading tokenizer.json as written.
    config.insert("tokenizer_class".into(), "PreTrainedTokenizerFast".into());
    for (k, v) in [
        ("bos_token", bos),
        ("eos_token", eos),
        ("unk_token", unk),
        ("pad_token", pad),
    ] {
        if let Some(v) = v {
            config.insert(k.into(), v.into());
        }
    }
    if let Some(t) = g.get_str("tokenizer.chat_template")? {
        config.insert("chat_template".into(), json!(t));
    }

    Ok(Built {
        tokenizer_json,
        tokenizer_config: serde_json::Value::Object(config),
        special_ids: ids,
        vocab_len: tokens.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pieces `pre` splits `text` into, in the byte alphabet.
    fn pieces(pre: &str, text: &str) -> Vec<String> {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let p = pre_tokenizer(Path::new("x.gguf"), pre).unwrap();
        let mut s = PreTokenizedString::from(text);
        p.pre_tokenize(&mut s).unwrap();
        s.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(t, _, _)| t.to_string())
            .collect()
    }

    /// Qwen2's and Llama 3's regexes as their tokenizer.json files split: digits
    /// alone or in threes, contractions in any case, a space before a word kept
    /// with it, runs of newlines apart, trailing spaces before a word left alone.
    #[test]
    fn qwen2_and_llama3_split_as_their_tokenizers() {
        let text = "Hello WORLD'S 12345\n\n  x!";
        assert_eq!(
            pieces("qwen2", text),
            ["Hello", "ĠWORLD", "'S", "Ġ", "1", "2", "3", "4", "5", "ĊĊ", "Ġ", "Ġx", "!"]
        );
        assert_eq!(
            pieces("llama-bpe", text),
            ["Hello", "ĠWORLD", "'S", "Ġ", "123", "45", "ĊĊ", "Ġ", "Ġx", "!"]
        );
        assert!(pre_tokenizer(Path::new("x.gguf"), "deepseek-llm").is_err());
    }

    #[test]
    fn byte_alphabet_is_gpt2s() {
        let a = byte_alphabet();
        assert_eq!(a[b'A' as usize], 'A');
        assert_eq!(a[b' ' as usize], 'Ġ'); // U+0120
        assert_eq!(a[b'\n' as usize], 'Ċ'); // U+010A
        assert_eq!(a[0xad], '\u{0143}');
        assert_eq!(a[0], '\u{0100}');
        let distinct: std::collections::HashSet<char> = a.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }
}
