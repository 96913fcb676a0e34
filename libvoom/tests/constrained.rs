//! Constrained decoding (`libvoom::constrain`, `Engine::generate_constrained`) on real
//! tokenizers and models: the tiny chat model `tests/fixtures/tiny_chat` (always; its
//! tokenizer has `<tool_call>`/`</tool_call>` tokens) and SmolLM2-135M-Instruct from
//! `VOOM_SMOLLM2_DIR` (skipped without it unless `VOOM_REQUIRE_SMOLLM2=1`).

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use libvoom::constrain::{
    validate_json, ConstrainError, Grammar, GrammarCompiler, JsonWhitespace, TokenConstraint,
    TokenMask,
};
use libvoom::engine::{Engine, EngineOptions, FinishReason, GenerateParams, Generation};
use libvoom::sampler::SamplingParams;
use libvoom::text::Tokenizer;
use serde_json::{json, Value};

fn tiny_chat() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny_chat")
}

fn smollm2_dir() -> Option<PathBuf> {
    match std::env::var_os("VOOM_SMOLLM2_DIR") {
        Some(d) if Path::new(&d).join("config.json").exists() => Some(PathBuf::from(d)),
        _ => {
            if std::env::var("VOOM_REQUIRE_SMOLLM2").as_deref() == Ok("1") {
                panic!("VOOM_REQUIRE_SMOLLM2=1 but VOOM_SMOLLM2_DIR does not hold the model");
            }
            eprintln!("skipping: set VOOM_SMOLLM2_DIR (scripts/test does)");
            None
        }
    }
}

fn open(dir: &Path) -> Engine {
    let opts = EngineOptions {
        threads: 2,
        ..Default::default()
    };
    Engine::open(dir, opts).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

fn chat_prompt(engine: &Engine, user: &str) -> Vec<u32> {
    let tok = engine.tokenizer().unwrap();
    let text = tok
        .chat_template()
        .unwrap()
        .render(
            &[json!({"role": "user", "content": user})],
            None,
            true,
            None,
        )
        .unwrap();
    tok.encode(&text, false).unwrap()
}

fn params(max_new_tokens: usize, sampling: SamplingParams) -> GenerateParams {
    GenerateParams {
        max_new_tokens,
        sampling,
        ..Default::default()
    }
}

fn run(
    engine: &Engine,
    prompt: &[u32],
    p: &GenerateParams,
    c: &mut dyn TokenConstraint,
) -> Generation {
    let mut streamed = Vec::new();
    let g = engine
        .generate_constrained(prompt, p, c, &mut |id| {
            streamed.push(id);
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(streamed, g.ids, "on_token sees every generated id");
    g
}

/// The generated text without a final end-of-sequence token.
fn text_of(engine: &Engine, g: &Generation) -> String {
    let ids: Vec<u32> = match g.finish {
        FinishReason::Eos => g.ids[..g.ids.len() - 1].to_vec(),
        _ => g.ids.clone(),
    };
    engine.tokenizer().unwrap().decode(&ids, false).unwrap()
}

fn json_of(engine: &Engine, g: &Generation) -> Value {
    let text = text_of(engine, g);
    assert!(
        matches!(g.finish, FinishReason::Complete | FinishReason::Eos),
        "generation ended with {:?} before the JSON was complete: {text:?}",
        g.finish
    );
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?} is not JSON: {e}"))
}

fn weather_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "where": {
                "type": "object",
                "properties": {
                    "lat": {"type": "number", "minimum": -90, "maximum": 90},
                    "lon": {"type": "number", "minimum": -180, "maximum": 180}
                },
                "required": ["lat", "lon"],
                "additionalProperties": false
            },
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "minItems": 1,
                "maxItems": 3
            }
        },
        "required": ["city", "unit", "days", "where", "tags"],
        "additionalProperties": false
    })
}

/// Allows every id and may always stop: constrained generation through it must be
/// generation without a constraint, bit for bit.
struct AllowAll;

impl TokenConstraint for AllowAll {
    fn fill_mask(&mut self, _: usize, mask: &mut TokenMask) -> Result<(), ConstrainError> {
        for id in 0..mask.len() as u32 {
            mask.allow(id);
        }
        Ok(())
    }
    fn may_stop(&mut self, _: usize) -> Result<bool, ConstrainError> {
        Ok(true)
    }
    fn accept(&mut self, _: usize, _: u32) -> Result<(), ConstrainError> {
        Ok(())
    }
    fn is_complete(&self) -> bool {
        false
    }
}

/// Forces a fixed sequence of ids, then is complete.
struct Script {
    ids: Vec<u32>,
    at: usize,
}

impl TokenConstraint for Script {
    fn fill_mask(&mut self, _: usize, mask: &mut TokenMask) -> Result<(), ConstrainError> {
        mask.allow(self.ids[self.at]);
        Ok(())
    }
    fn may_stop(&mut self, _: usize) -> Result<bool, ConstrainError> {
        Ok(false)
    }
    fn accept(&mut self, step: usize, id: u32) -> Result<(), ConstrainError> {
        if id != self.ids[self.at] {
            return Err(ConstrainError::Matcher {
                step,
                message: format!("expected {}, got {id}", self.ids[self.at]),
            });
        }
        self.at += 1;
        Ok(())
    }
    fn is_complete(&self) -> bool {
        self.at == self.ids.len()
    }
}

// ---- the mask logic on a real tokenizer, no model ----

#[test]
fn json_object_mask_allows_only_tokens_that_can_start_an_object() {
    let tok = Tokenizer::from_dir(&tiny_chat()).unwrap();
    let vocab = tok.vocab_size();
    let compiler = GrammarCompiler::new(&tok, vocab, &[2]).unwrap();
    let mut m = compiler.matcher(&Grammar::json_object()).unwrap();
    let mut mask = TokenMask::new(vocab);
    m.fill_mask(0, &mut mask).unwrap();
    assert!(!m.may_stop(0).unwrap());
    let allowed: Vec<u32> = mask.allowed_ids().collect();
    assert!(!allowed.is_empty());
    let brace = tok.token_to_id("{").unwrap();
    assert!(mask.is_allowed(brace));
    for id in allowed {
        let t = tok.decode(&[id], false).unwrap();
        assert!(
            t.starts_with('{'),
            "id {id} ({t:?}) cannot start a JSON object"
        );
    }
    // Every other token that starts with '{' and is a JSON prefix is allowed, and
    // nothing else: check the complement on a few.
    for t in ["a", "\"", " {", "}", "<|im_end|>", "<tool_call>"] {
        if let Some(id) = tok.token_to_id(t) {
            assert!(
                !mask.is_allowed(id),
                "{t:?} allowed at the start of an object"
            );
        }
    }
    // The engine's end-of-sequence id is never in a grammar's mask.
    assert!(!mask.is_allowed(2));
}

#[test]
fn matcher_follows_a_valid_json_text_token_by_token() {
    let tok = Tokenizer::from_dir(&tiny_chat()).unwrap();
    let vocab = tok.vocab_size();
    let compiler = GrammarCompiler::new(&tok, vocab, &[2]).unwrap();
    let schema = weather_schema();
    let value = json!({"city": "Oslo", "unit": "celsius", "days": 3,
        "where": {"lat": 59.9, "lon": 10.75}, "tags": ["cold"]});
    validate_json(&schema, &value).unwrap();
    // Spaced layout is Python's json.dumps: keys in schema order, ", " and ": ".
    let text = r#"{"city": "Oslo", "unit": "celsius", "days": 3, "where": {"lat": 59.9, "lon": 10.75}, "tags": ["cold"]}"#;
    assert_eq!(serde_json::from_str::<Value>(text).unwrap(), value);
    let ids = tok.encode(text, false).unwrap();
    let grammar = compiler
        .compile(&Grammar::json_schema(&schema).unwrap())
        .unwrap();
    let mut m = grammar.matcher();
    let mut mask = TokenMask::new(vocab);
    for (step, &id) in ids.iter().enumerate() {
        assert!(!m.is_complete(), "complete before token {step}");
        mask.clear();
        m.fill_mask(step, &mut mask).unwrap();
        assert!(
            mask.is_allowed(id),
            "token {step} ({:?}) of a valid text is not allowed",
            tok.decode(&[id], false).unwrap()
        );
        m.accept(step, id).unwrap();
    }
    assert!(m.is_complete(), "a closed object admits nothing more");
    assert_eq!(m.text(), text);

    // The same text with a value out of range: the bad digit is masked out, and
    // forcing it is an error naming the step.
    let bad = text.replace("\"days\": 3", "\"days\": 9");
    let bad_ids = tok.encode(&bad, false).unwrap();
    let mut m = grammar.matcher();
    let mut step = 0;
    let err = loop {
        let id = bad_ids[step];
        mask.clear();
        m.fill_mask(step, &mut mask).unwrap();
        if !mask.is_allowed(id) {
            assert!(tok.decode(&[id], false).unwrap().contains('9'));
            break m.accept(step, id).unwrap_err();
        }
        m.accept(step, id).unwrap();
        step += 1;
    };
    let ConstrainError::Matcher { step: at, message } = &err else {
        panic!("{err}")
    };
    assert_eq!(*at, step);
    assert!(!message.is_empty());
}

#[test]
fn ids_past_the_tokenizer_are_never_allowed() {
    // A model whose logits are wider than its tokenizer (padded embeddings).
    let tok = Tokenizer::from_dir(&tiny_chat()).unwrap();
    let vocab = tok.vocab_size();
    let compiler = GrammarCompiler::new(&tok, vocab + 100, &[2]).unwrap();
    // `<[*]>` is any token, the padding ids included in llguidance's table.
    let mut m = compiler.matcher(&Grammar::lark("start: <[*]>")).unwrap();
    let mut mask = TokenMask::new(vocab + 100);
    m.fill_mask(0, &mut mask).unwrap();
    assert!(mask.count_allowed() > vocab / 2);
    assert!(mask.allowed_ids().all(|id| (id as usize) < vocab));
}

#[test]
fn bad_grammars_are_clear_errors() {
    let tok = Tokenizer::from_dir(&tiny_chat()).unwrap();
    let compiler = GrammarCompiler::new(&tok, tok.vocab_size(), &[2]).unwrap();

    // Not a schema per the meta-schema: the error names where.
    let e =
        Grammar::json_schema(&json!({"type": "object", "properties": {"n": {"type": "integr"}}}))
            .unwrap_err();
    assert!(
        matches!(&e, ConstrainError::Schema { at: Some(at), .. } if at == "/properties/n/type"),
        "{e}"
    );
    assert!(e.to_string().contains("/properties/n/type"), "{e}");
    eprintln!("bad type: {e}");
    let e = Grammar::json_schema(&json!({"minimum": "zero"})).unwrap_err();
    assert!(e.to_string().contains("/minimum"), "{e}");
    let e = Grammar::json_schema(&json!([1, 2])).unwrap_err();
    assert!(matches!(e, ConstrainError::Schema { .. }), "{e}");

    // A schema valid per the meta-schema that cannot be compiled: a dangling $ref.
    let e = compiler
        .compile(&Grammar::json_schema(&json!({"$ref": "#/$defs/missing"})).unwrap())
        .unwrap_err();
    assert!(matches!(e, ConstrainError::Schema { .. }), "{e}");
    assert!(e.to_string().contains("missing"), "{e}");
    eprintln!("dangling $ref: {e}");

    // Lark: a syntax error, an undefined rule, a token the vocabulary lacks.
    for (g, what) in [
        ("start: (\"a\"", "syntax"),
        ("start: foo", "foo"),
        ("start: <no_such_token>", "no_such_token"),
    ] {
        let e = compiler.compile(&Grammar::lark(g)).unwrap_err();
        assert!(matches!(e, ConstrainError::Grammar { .. }), "{g}: {e}");
        let msg = e.to_string();
        eprintln!("{g:?}: {msg}");
        assert!(msg.starts_with("invalid Lark grammar"), "{g}: {msg}");
        if what != "syntax" {
            assert!(msg.contains(what), "{g}: {msg}");
        }
    }
}

#[test]
fn the_compiler_is_shared_per_tokenizer() {
    let engine = open(&tiny_chat());
    let a = GrammarCompiler::for_engine(&engine).unwrap();
    let b = GrammarCompiler::for_engine(&engine).unwrap();
    assert!(std::sync::Arc::ptr_eq(&a, &b));
    assert_eq!(a.model_vocab(), engine.config().vocab_size);
    assert_eq!(a.eos_ids(), engine.eos_ids());
}

// ---- the engine on the tiny chat model (always) ----

#[test]
fn allow_all_is_unconstrained_generation_bit_for_bit() {
    let engine = open(&tiny_chat());
    let prompt = chat_prompt(&engine, "Tell me something.");
    for sampling in [
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            top_k: 40,
            seed: 11,
        },
        SamplingParams {
            temperature: 1.3,
            top_p: 1.0,
            top_k: 0,
            seed: 3,
        },
    ] {
        let p = GenerateParams {
            record_logits: true,
            ..params(40, sampling.clone())
        };
        let free = engine
            .generate(&prompt, &p, &mut |_| ControlFlow::Continue(()))
            .unwrap();
        let con = run(&engine, &prompt, &p, &mut AllowAll);
        assert_eq!(free.ids, con.ids, "{sampling:?}");
        assert_eq!(free.finish, con.finish);
        let bits = |g: &Generation| -> Vec<Vec<u32>> {
            g.logits
                .iter()
                .map(|l| l.iter().map(|v| v.to_bits()).collect())
                .collect()
        };
        assert_eq!(bits(&free), bits(&con), "recorded logits are the model's");
        assert_eq!(free.constraint_secs, 0.0);
    }
}

#[test]
fn a_script_forces_its_ids_and_ends_complete_without_eos() {
    let engine = open(&tiny_chat());
    let prompt = chat_prompt(&engine, "Hi");
    let forced = engine
        .tokenizer()
        .unwrap()
        .encode("OK, done.", false)
        .unwrap();
    let mut c = Script {
        ids: forced.clone(),
        at: 0,
    };
    let g = run(
        &engine,
        &prompt,
        &params(50, SamplingParams::default()),
        &mut c,
    );
    assert_eq!(g.ids, forced);
    assert_eq!(g.finish, FinishReason::Complete);
    assert_eq!(g.finish.as_str(), "stop");
    // Out of room first: Length, and the constraint saw every token.
    let mut c = Script { ids: forced, at: 0 };
    let g = run(
        &engine,
        &prompt,
        &params(2, SamplingParams::default()),
        &mut c,
    );
    assert_eq!((g.ids.len(), g.finish, c.at), (2, FinishReason::Length, 2));
    // Already complete: nothing is computed.
    let mut c = Script {
        ids: vec![5],
        at: 1,
    };
    let g = run(
        &engine,
        &prompt,
        &params(5, SamplingParams::default()),
        &mut c,
    );
    assert!(g.ids.is_empty());
    assert_eq!(g.finish, FinishReason::Complete);
}

#[test]
fn a_constraint_that_allows_nothing_is_an_error() {
    struct Nothing;
    impl TokenConstraint for Nothing {
        fn fill_mask(&mut self, _: usize, _: &mut TokenMask) -> Result<(), ConstrainError> {
            Ok(())
        }
        fn may_stop(&mut self, _: usize) -> Result<bool, ConstrainError> {
            Ok(false)
        }
        fn accept(&mut self, _: usize, _: u32) -> Result<(), ConstrainError> {
            Ok(())
        }
        fn is_complete(&self) -> bool {
            false
        }
    }
    let engine = open(&tiny_chat());
    let prompt = chat_prompt(&engine, "Hi");
    let e = engine
        .generate_constrained(
            &prompt,
            &params(5, SamplingParams::default()),
            &mut Nothing,
            &mut |_| ControlFlow::Continue(()),
        )
        .unwrap_err();
    assert!(e.to_string().contains("no token"), "{e}");
}

#[test]
fn tiny_chat_json_object_and_schema_outputs_parse_and_validate() {
    let engine = open(&tiny_chat());
    let compiler = GrammarCompiler::for_engine(&engine).unwrap();
    let prompt = chat_prompt(&engine, "Give me the weather as JSON.");
    let p = params(300, SamplingParams::default());
    let g = run(
        &engine,
        &prompt,
        &p,
        &mut compiler.matcher(&Grammar::json_object()).unwrap(),
    );
    // Random weights write keys of noise and numbers too large for f64 (valid JSON,
    // which serde_json refuses to parse): check the shape only; SmolLM2 parses it.
    let text = text_of(&engine, &g);
    assert_eq!(g.finish, FinishReason::Complete, "{text:?}");
    assert!(text.starts_with('{') && text.ends_with('}'), "{text:?}");

    let schema = weather_schema();
    let grammar = compiler
        .compile(&Grammar::json_schema(&schema).unwrap())
        .unwrap();
    let g1 = run(&engine, &prompt, &p, &mut grammar.matcher());
    let v = json_of(&engine, &g1);
    validate_json(&schema, &v).unwrap_or_else(|e| panic!("{v}: {e}"));
    // Greedy is deterministic; sampled runs obey the schema too.
    let g2 = run(&engine, &prompt, &p, &mut grammar.matcher());
    assert_eq!(g1.ids, g2.ids);
    for seed in 0..3 {
        let s = SamplingParams {
            temperature: 1.0,
            top_p: 0.95,
            top_k: 0,
            seed,
        };
        let g = run(&engine, &prompt, &params(300, s), &mut grammar.matcher());
        let v = json_of(&engine, &g);
        validate_json(&schema, &v).unwrap_or_else(|e| panic!("seed {seed}: {v}: {e}"));
    }
}

#[test]
fn tiny_chat_forced_tool_call_with_special_tokens() {
    let engine = open(&tiny_chat());
    let tok = engine.tokenizer().unwrap();
    let open_id = tok.token_to_id("<tool_call>").expect("<tool_call> token");
    let close_id = tok.token_to_id("</tool_call>").expect("</tool_call> token");
    let call_schema = json!({
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": weather_schema()
        },
        "required": ["name", "arguments"],
        "additionalProperties": false
    });
    let lark = format!(
        "start: <tool_call> \"\\n\" call \"\\n\" </tool_call>\ncall: {}\n",
        Grammar::lark_json(&call_schema, JsonWhitespace::Spaced).unwrap()
    );
    let compiler = GrammarCompiler::for_engine(&engine).unwrap();
    let grammar = compiler.compile(&Grammar::lark(&lark)).unwrap();
    let prompt = chat_prompt(&engine, "What is the weather in Oslo?");
    for seed in 0..3 {
        let s = SamplingParams {
            temperature: if seed == 0 { 0.0 } else { 1.0 },
            seed,
            ..Default::default()
        };
        let mut m = grammar.matcher();
        let g = run(&engine, &prompt, &params(400, s), &mut m);
        assert_eq!(g.finish, FinishReason::Complete, "{:?}", m.text());
        // The tags are the special tokens, not their characters spelled out.
        assert_eq!(g.ids[0], open_id);
        assert_eq!(*g.ids.last().unwrap(), close_id);
        let text = tok.decode(&g.ids, false).unwrap();
        assert_eq!(text, m.text());
        let body = text
            .strip_prefix("<tool_call>\n")
            .and_then(|t| t.strip_suffix("\n</tool_call>"))
            .unwrap_or_else(|| panic!("{text:?}"));
        let call: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{body:?}: {e}"));
        validate_json(&call_schema, &call).unwrap_or_else(|e| panic!("{call}: {e}"));
        assert_eq!(call["name"], "get_weather");
    }
}

// ---- SmolLM2-135M-Instruct (VOOM_SMOLLM2_DIR) ----

#[test]
fn smollm2_json_object_schema_and_lark() {
    let Some(dir) = smollm2_dir() else { return };
    let engine = open(&dir);
    let compiler = GrammarCompiler::for_engine(&engine).unwrap();
    let greedy = params(200, SamplingParams::default());

    // json_object.
    let prompt = chat_prompt(
        &engine,
        "Describe a cat as a JSON object with its name and age.",
    );
    let g = run(
        &engine,
        &prompt,
        &greedy,
        &mut compiler.matcher(&Grammar::json_object()).unwrap(),
    );
    let v = json_of(&engine, &g);
    assert!(v.is_object(), "{v}");
    eprintln!("json_object: {}", text_of(&engine, &g));

    // A schema with required properties, an enum, integer bounds, nested object and array.
    let schema = weather_schema();
    let prompt = chat_prompt(
        &engine,
        "Give the weather forecast request for Paris for 3 days in celsius as JSON.",
    );
    let grammar = compiler
        .compile(&Grammar::json_schema(&schema).unwrap())
        .unwrap();
    let g1 = run(&engine, &prompt, &greedy, &mut grammar.matcher());
    let v = json_of(&engine, &g1);
    validate_json(&schema, &v).unwrap_or_else(|e| panic!("{v}: {e}"));
    eprintln!("json_schema: {}", text_of(&engine, &g1));
    let g2 = run(&engine, &prompt, &greedy, &mut grammar.matcher());
    assert_eq!(g1.ids, g2.ids, "greedy constrained output is deterministic");

    // A Lark grammar with a fixed literal prefix.
    let prompt = chat_prompt(&engine, "What is the capital of France?");
    let lark = r#"start: "The answer is: " ANSWER "."
ANSWER: /[A-Z][a-z]+( [A-Z][a-z]+)?/
"#;
    let mut m = compiler.matcher(&Grammar::lark(lark)).unwrap();
    let g = run(&engine, &prompt, &greedy, &mut m);
    let text = text_of(&engine, &g);
    eprintln!("lark: {text:?} ({:?})", g.finish);
    assert!(matches!(
        g.finish,
        FinishReason::Complete | FinishReason::Eos
    ));
    let answer = text
        .strip_prefix("The answer is: ")
        .and_then(|t| t.strip_suffix('.'))
        .unwrap_or_else(|| panic!("{text:?}"));
    assert!(
        answer.chars().next().unwrap().is_ascii_uppercase(),
        "{text:?}"
    );
}

#[test]
fn smollm2_unconstrained_generation_is_unaffected() {
    let Some(dir) = smollm2_dir() else { return };
    let engine = open(&dir);
    let prompt = chat_prompt(&engine, "Write a JSON object describing a dog.");
    let p = GenerateParams {
        record_logits: true,
        ..params(48, SamplingParams::default())
    };
    let free = engine
        .generate(&prompt, &p, &mut |_| ControlFlow::Continue(()))
        .unwrap();
    let con = run(&engine, &prompt, &p, &mut AllowAll);
    assert_eq!(free.ids, con.ids);
    let bits =
        |g: &Generation| -> Vec<u32> { g.logits.iter().flatten().map(|v| v.to_bits()).collect() };
    assert!(bits(&free) == bits(&con));

    // Its cost: `cargo run --release -p libvoom --example constrain_bench -- MODEL_DIR`.
}

/// A schema whose strings are the text of added tokens (`<tool_call>`, the chat's
/// `<|im_end|>`): the grammar spells them with ordinary tokens (a special token is
/// never text), and the output decodes to the JSON the schema asks for.
#[test]
fn strings_spelling_special_tokens_are_written_with_ordinary_tokens() {
    let engine = open(&tiny_chat());
    let compiler = GrammarCompiler::for_engine(&engine).unwrap();
    let tok = engine.tokenizer().unwrap();
    let specials: Vec<u32> = ["<tool_call>", "</tool_call>", "<|im_end|>"]
        .iter()
        .map(|t| tok.token_to_id(t).unwrap())
        .collect();
    let schema = json!({
        "type": "object",
        "properties": {
            "open": {"const": "<tool_call>"},
            "end": {"enum": ["<|im_end|>"]},
            "close": {"type": "string", "pattern": "^</tool_call>$"}
        },
        "required": ["open", "end", "close"],
        "additionalProperties": false
    });
    let grammar = compiler
        .compile(&Grammar::json_schema(&schema).unwrap())
        .unwrap();
    let prompt = chat_prompt(&engine, "JSON please.");
    for seed in 0..3 {
        let s = SamplingParams {
            temperature: if seed == 0 { 0.0 } else { 1.0 },
            seed,
            ..SamplingParams::default()
        };
        let g = run(&engine, &prompt, &params(100, s), &mut grammar.matcher());
        let v = json_of(&engine, &g);
        assert_eq!(
            v,
            json!({"open": "<tool_call>", "end": "<|im_end|>", "close": "</tool_call>"})
        );
        let body = match g.finish {
            FinishReason::Eos => &g.ids[..g.ids.len() - 1],
            _ => &g.ids[..],
        };
        assert!(
            body.iter().all(|id| !specials.contains(id)),
            "special tokens in {body:?}"
        );
    }
}
