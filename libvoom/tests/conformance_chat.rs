//! Conformance of the whole chat path with Hugging Face transformers on the tiny chat
//! model `tests/fixtures/tiny_chat` (made by `tests/conformance/make_chat_fixture.py`):
//! for each conversation our chat template renders transformers' prompt text byte for
//! byte, our tokenizer gives its ids, greedy generation gives transformers' ids (float32
//! over the same BF16 weights; stopping on `<|im_end|>` where transformers did), and the
//! decode gives its text.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use libvoom::engine::{Engine, EngineOptions, FinishReason, GenerateParams};
use libvoom::text::{StreamDecoder, Tokenizer};
use serde_json::Value;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny_chat")
}

fn reference() -> Value {
    let p = fixture().join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn cases(r: &Value) -> &[Value] {
    let cases = r["cases"].as_array().unwrap();
    assert!(
        cases.len() >= 6,
        "reference.json lists {} cases",
        cases.len()
    );
    cases
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| u32::try_from(x.as_u64().unwrap()).unwrap())
        .collect()
}

fn name(case: &Value) -> &str {
    case["name"].as_str().unwrap()
}

/// The prompt as a server builds it: the chat template (the tool-use one when tools are
/// given) rendered with a generation prompt and encoded without special tokens; a raw
/// completion prompt encoded with them.
fn prompt_of(tok: &Tokenizer, case: &Value) -> (String, Vec<u32>) {
    match case["kind"].as_str().unwrap() {
        "raw" => {
            let text = case["prompt_text"].as_str().unwrap().to_string();
            let ids = tok.encode(&text, true).unwrap();
            (text, ids)
        }
        "chat" => {
            let tools = case["tools"].as_array().map(Vec::as_slice);
            let template = tok
                .chat_template_for(tools.is_some())
                .expect("tokenizer_config.json has a chat template");
            let text = template
                .render(
                    case["messages"].as_array().unwrap(),
                    tools,
                    case["add_generation_prompt"].as_bool().unwrap(),
                    None,
                )
                .unwrap_or_else(|e| panic!("{}: {e}", name(case)));
            let ids = tok.encode(&text, false).unwrap();
            (text, ids)
        }
        k => panic!("{}: unknown kind {k}", name(case)),
    }
}

#[test]
fn tokenizer_loads_as_transformers_loads_it() {
    let r = reference();
    let tok = Tokenizer::from_dir(&fixture()).unwrap();
    assert_eq!(tok.vocab_size() as u64, r["vocab_size"].as_u64().unwrap());
    for (token, id) in r["token_ids"].as_object().unwrap() {
        let id = u32::try_from(id.as_u64().unwrap()).unwrap();
        assert_eq!(tok.token_to_id(token), Some(id), "{token}");
        // Each control token is one id, also inside text.
        assert_eq!(tok.encode(&format!("a{token}b"), false).unwrap()[1], id);
    }
    let im_end = tok.token_to_id("<|im_end|>").unwrap();
    assert_eq!(tok.eos_ids(), [im_end]);
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert_eq!(tok.bos_token(), None);
    // No BOS or anything else is added.
    assert_eq!(
        tok.encode("Hello there", true).unwrap(),
        tok.encode("Hello there", false).unwrap()
    );
    // <tool_call> tags are not special: a tool call survives skip_special_tokens.
    let call =
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call><|im_end|>";
    let call_ids = tok.encode(call, false).unwrap();
    assert_eq!(
        tok.decode(&call_ids, true).unwrap(),
        "assistant\n<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>"
    );
    assert_eq!(tok.decode(&call_ids, false).unwrap(), call);
    // Digits, accents, CJK, emoji, combining marks, whitespace runs, contractions and
    // control tokens inside text encode and decode as in transformers.
    let texts = r["tokenizer_cases"].as_array().unwrap();
    assert!(texts.len() >= 5);
    for c in texts {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["ids"]);
        assert_eq!(tok.encode(text, false).unwrap(), want, "encoding {text:?}");
        assert_eq!(
            tok.decode(&want, true).unwrap(),
            c["decode_skip_special"].as_str().unwrap(),
            "decoding {text:?} (skip special)"
        );
        assert_eq!(
            tok.decode(&want, false).unwrap(),
            c["decode_keep_special"].as_str().unwrap(),
            "decoding {text:?} (keep special)"
        );
    }
}

#[test]
fn templates_render_and_encode_like_transformers() {
    let r = reference();
    let tok = Tokenizer::from_dir(&fixture()).unwrap();
    let mut with_tools = 0;
    for case in cases(&r) {
        let (text, got) = prompt_of(&tok, case);
        assert_eq!(
            text,
            case["prompt_text"].as_str().unwrap(),
            "{}: rendered prompt differs from transformers'",
            name(case)
        );
        assert_eq!(
            got,
            ids(&case["prompt_ids"]),
            "{}: prompt ids differ from transformers'",
            name(case)
        );
        with_tools += usize::from(case["tools"].is_array());
    }
    assert!(with_tools >= 2, "{with_tools} cases offer tools");
}

fn check_generation(opts: EngineOptions) {
    let r = reference();
    let engine = Engine::open(&fixture(), opts).unwrap();
    let tok = engine.tokenizer().expect("tokenizer.json");
    let max_new = r["generation"]["max_new_tokens"].as_u64().unwrap() as usize;
    assert_eq!(engine.eos_ids(), ids(&r["generation"]["eos_token_ids"]));
    let (mut eos_stops, mut length_stops) = (0, 0);
    for case in cases(&r) {
        let n = name(case);
        let (_, prompt) = prompt_of(tok, case);
        assert_eq!(prompt, ids(&case["prompt_ids"]), "{n}: prompt ids");
        let params = GenerateParams {
            max_new_tokens: max_new,
            ..Default::default()
        };
        let mut stream = StreamDecoder::new(tok, true);
        let mut streamed = String::new();
        let g = engine
            .generate(&prompt, &params, &mut |id| {
                streamed.push_str(&stream.push(id).unwrap());
                ControlFlow::Continue(())
            })
            .unwrap();
        streamed.push_str(&stream.finish().unwrap());
        assert_eq!(
            g.ids,
            ids(&case["generated_ids"]),
            "{n}: generated ids differ from transformers'"
        );
        let stopped = case["stopped_on_eos"].as_bool().unwrap();
        let want_finish = if stopped {
            eos_stops += 1;
            FinishReason::Eos
        } else {
            length_stops += 1;
            FinishReason::Length
        };
        assert_eq!(g.finish, want_finish, "{n}: finish reason");
        let text = tok.decode(&g.ids, true).unwrap();
        assert_eq!(
            text,
            case["generated_text"].as_str().unwrap(),
            "{n}: decoded text differs from transformers'"
        );
        assert_eq!(
            tok.decode(&g.ids, false).unwrap(),
            case["generated_text_with_special"].as_str().unwrap(),
            "{n}: decoded text (special tokens kept) differs from transformers'"
        );
        assert_eq!(streamed, text, "{n}: streamed text differs from the decode");
    }
    // The fixture covers both ways a generation ends.
    assert!(
        eos_stops >= 1 && length_stops >= 1,
        "{eos_stops} eos stops, {length_stops} length stops"
    );
}

#[test]
fn greedy_generation_matches_transformers() {
    check_generation(EngineOptions::default());
}

#[test]
fn greedy_generation_matches_single_threaded_and_chunked() {
    check_generation(EngineOptions {
        threads: 1,
        prefill_chunk: 7,
        ..Default::default()
    });
}

/// The fixture is committed: keep it small.
#[test]
fn fixture_stays_small() {
    let mut total = 0;
    for entry in std::fs::read_dir(fixture()).unwrap() {
        total += entry.unwrap().metadata().unwrap().len();
    }
    assert!(
        total < 300_000,
        "tests/fixtures/tiny_chat holds {total} bytes"
    );
}
