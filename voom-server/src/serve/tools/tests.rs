use std::path::PathBuf;

use libvoom::constrain::{Grammar, GrammarCompiler, TokenConstraint, TokenMask};
use libvoom::text::Tokenizer;
use serde_json::json;

use super::*;

fn weather() -> ToolSpec {
    ToolSpec {
        name: "get_weather".into(),
        description: Some("Weather of a city".into()),
        parameters: json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]}
            },
            "required": ["city"],
            "additionalProperties": false
        }),
    }
}

fn time() -> ToolSpec {
    ToolSpec {
        name: "get_time".into(),
        description: None,
        parameters: json!({"type": "object", "properties": {"zone": {"type": "string"}}}),
    }
}

fn tools() -> Vec<ToolSpec> {
    vec![weather(), time()]
}

fn tiny_chat() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny_chat")
}

#[test]
fn hermes_parses_calls_and_keeps_the_rest_as_text() {
    let out = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
    let p = HERMES.parse(out, &tools(), true);
    assert_eq!(p.content, "Let me check.");
    assert_eq!(p.calls.len(), 2);
    assert_eq!(p.calls[0].name, "get_weather");
    assert_eq!(p.calls[0].arguments, json!({"city": "Oslo"}));
    assert!(p.calls[0].id.starts_with("call_"));
    assert_ne!(p.calls[0].id, p.calls[1].id);
    assert_eq!(p.calls[1].name, "get_time");
    // Only calls: no content.
    let only =
        "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"UTC\"}}\n</tool_call>";
    let p = HERMES.parse(only, &tools(), true);
    assert_eq!(p.content, "");
    assert_eq!(p.calls[0].arguments, json!({"zone": "UTC"}));
}

#[test]
fn hermes_malformed_unknown_and_invalid_calls_stay_text() {
    for (out, why) in [
        (
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \n</tool_call>",
            "not JSON",
        ),
        (
            "<tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call>",
            "not an offered tool",
        ),
        (
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"unit\": \"kelvin\"}}\n</tool_call>",
            "do not match its schema",
        ),
        ("<tool_call>\n[1, 2]\n</tool_call>", "must be a JSON object"),
        ("<tool_call>\n{\"arguments\": {}}\n</tool_call>", "'name'"),
    ] {
        let p = HERMES.parse(out, &tools(), true);
        assert!(p.calls.is_empty(), "{out}");
        // Nothing was taken out: the text is the output unchanged.
        assert_eq!(p.content, out);
        assert!(p.rejected[0].contains(why), "{:?}", p.rejected);
    }
    // Plain text is untouched, whitespace included.
    let p = HERMES.parse("  hello \n", &tools(), true);
    assert_eq!(p.content, "  hello \n");
    assert!(p.rejected.is_empty());
}

#[test]
fn hermes_mixed_valid_and_invalid_and_unclosed() {
    let out = "<tool_call>\n{\"name\": \"nope\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}";
    let p = HERMES.parse(out, &tools(), true);
    assert_eq!(p.calls.len(), 1);
    assert_eq!(p.calls[0].name, "get_time");
    assert_eq!(
        p.content,
        "<tool_call>\n{\"name\": \"nope\", \"arguments\": {}}\n</tool_call>"
    );
    // Arguments written as a string holding JSON are accepted.
    let s = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\"}\n</tool_call>";
    let p = HERMES.parse(s, &tools(), true);
    assert_eq!(p.calls[0].arguments, json!({"city": "Rome"}));
}

#[test]
fn a_number_beyond_f64_is_marked_unrepresentable() {
    let out = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"a\", \"n\": 1e400}}\n</tool_call>";
    let p = HERMES.parse(out, &tools(), true);
    assert!(p.calls.is_empty());
    assert!(p.unrepresentable, "{:?}", p.rejected);
    let p = HERMES.parse("<tool_call>\n{oops}\n</tool_call>", &tools(), true);
    assert!(!p.unrepresentable);
    let p = LLAMA3_JSON.parse(
        "{\"name\": \"get_time\", \"parameters\": {\"n\": -2e999}}",
        &tools(),
        true,
    );
    assert!(p.unrepresentable && p.calls.is_empty());
}

#[test]
fn parallel_off_keeps_the_first_call_and_the_rest_as_text() {
    let second = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
    let out = format!(
        "<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Oslo\"}}}}\n</tool_call>\n{second}"
    );
    let p = HERMES.parse(&out, &tools(), false);
    assert_eq!(p.calls.len(), 1);
    assert_eq!(p.calls[0].name, "get_weather");
    assert_eq!(p.content, second);
    assert!(p.rejected[0].contains("parallel"), "{:?}", p.rejected);
    let p = LLAMA3_JSON.parse(
        "{\"name\": \"get_time\", \"parameters\": {}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"X\"}}",
        &tools(),
        false,
    );
    assert_eq!(p.calls.len(), 1);
    assert_eq!(
        p.content,
        "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"X\"}}"
    );
}

#[test]
fn llama3_json_calls() {
    let p = LLAMA3_JSON.parse(
        "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\", \"unit\": \"celsius\"}}",
        &tools(),
        true,
    );
    assert_eq!(p.calls.len(), 1);
    assert_eq!(
        p.calls[0].arguments,
        json!({"city": "Oslo", "unit": "celsius"})
    );
    assert_eq!(p.content, "");
    let p = LLAMA3_JSON.parse(
        " {\"name\": \"get_time\", \"parameters\": {}}; {\"name\": \"get_weather\", \"arguments\": {\"city\": \"X\"}}\n",
        &tools(),
        true,
    );
    assert_eq!(p.calls.len(), 2);
    assert_eq!(p.calls[1].arguments, json!({"city": "X"}));
    // Text that is not a call, a call to an unknown tool, broken JSON: text.
    for out in [
        "The weather is fine.",
        "{\"name\": \"launch\", \"parameters\": {}}",
        "{\"name\": \"get_time\", \"parameters\": {",
        "{\"answer\": 42}",
    ] {
        let p = LLAMA3_JSON.parse(out, &tools(), true);
        assert!(p.calls.is_empty(), "{out}");
        assert_eq!(p.content, out);
    }
    // A valid call then garbage: the call, and the garbage as text.
    let p = LLAMA3_JSON.parse(
        "{\"name\": \"get_time\", \"parameters\": {}} and more",
        &tools(),
        true,
    );
    assert_eq!(p.calls.len(), 1);
    assert_eq!(p.content, "and more");
}

#[test]
fn mistral_list_calls() {
    let p = MISTRAL.parse(
        "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}, {\"name\": \"nope\", \"arguments\": {}}]",
        &tools(),
        true,
    );
    assert_eq!(p.calls.len(), 1);
    assert_eq!(
        p.content,
        "[TOOL_CALLS][{\"name\":\"nope\",\"arguments\":{}}]"
    );
    let p = MISTRAL.parse("[TOOL_CALLS] not json", &tools(), true);
    assert!(p.calls.is_empty());
    assert_eq!(p.content, "[TOOL_CALLS] not json");
    let p = MISTRAL.parse(
        "Sure. [TOOL_CALLS][{\"name\": \"get_time\", \"arguments\": {}}]",
        &tools(),
        true,
    );
    assert_eq!(p.calls.len(), 1);
    assert_eq!(p.content, "Sure.");
}

#[test]
fn detects_the_format_from_the_template() {
    let tok = Tokenizer::from_dir(&tiny_chat()).unwrap();
    let src = tok.chat_template_for(true).unwrap().source();
    assert_eq!(ToolFormat::detect(src).name, "hermes");
    assert_eq!(
        ToolFormat::detect("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}").name,
        "mistral"
    );
    assert_eq!(
        ToolFormat::detect(
            "Respond in the format {\"name\": function name, \"parameters\": dictionary}"
        )
        .name,
        "llama3_json"
    );
    assert_eq!(ToolFormat::detect("{{ messages }}").name, "hermes");
}

#[test]
fn request_checks() {
    let e =
        ToolRequest::new(vec![weather(), weather()], ToolChoice::Auto, true, "tools").unwrap_err();
    assert!(e.message.contains("twice"), "{e}");
    let e = ToolRequest::new(tools(), ToolChoice::Named("x".into()), true, "tools").unwrap_err();
    assert_eq!(e.param.as_deref(), Some("tool_choice"));
    assert!(e.message.contains("get_weather, get_time"), "{e}");
    assert!(ToolRequest::new(vec![], ToolChoice::Required, true, "tools").is_err());
    let mut bad = weather();
    bad.parameters = json!({"type": "object", "properties": {"a": {"type": "integr"}}});
    let e = ToolRequest::new(vec![bad], ToolChoice::Auto, true, "tools").unwrap_err();
    assert!(e.message.contains("get_weather"), "{e}");
    assert!(e.message.contains("/properties/a/type"), "{e}");
    let r = ToolRequest::new(tools(), ToolChoice::None, true, "tools").unwrap();
    assert!(r.template_tools().is_none());
    let r = ToolRequest::new(tools(), ToolChoice::Auto, true, "tools").unwrap();
    let t = r.template_tools().unwrap();
    assert_eq!(t[0]["type"], "function");
    assert_eq!(t[0]["function"]["name"], "get_weather");
    assert_eq!(t[1]["function"].get("description"), None);
    assert!(r.forced().is_none());
    let r = ToolRequest::new(
        tools(),
        ToolChoice::Named("get_time".into()),
        false,
        "tools",
    )
    .unwrap();
    assert_eq!(r.forced().unwrap().len(), 1);
    // Names the APIs allow, and nothing that could be a format's marker.
    for name in ["<tool_call>", "a b", &"x".repeat(65)] {
        let mut t = weather();
        t.name = name.to_string();
        let e = ToolRequest::new(vec![t], ToolChoice::Auto, true, "tools").unwrap_err();
        assert!(e.message.contains("not a valid tool name"), "{e}");
    }
    // Arguments are objects.
    for ty in [json!("string"), json!(["object", "null"])] {
        let mut t = weather();
        t.parameters = json!({"type": ty});
        let e = ToolRequest::new(vec![t], ToolChoice::Required, true, "tools").unwrap_err();
        assert!(e.message.contains("must have type \"object\""), "{e}");
    }
}

#[test]
fn history_arguments_normalize() {
    assert_eq!(
        history_arguments(&json!("{\"a\": 1}"), "x").unwrap(),
        json!({"a": 1})
    );
    assert_eq!(
        history_arguments(&json!({"a": 1}), "x").unwrap(),
        json!({"a": 1})
    );
    let e = history_arguments(&json!("{oops"), "messages[1].tool_calls[0]").unwrap_err();
    assert_eq!(e.param.as_deref(), Some("messages[1].tool_calls[0]"));
}

/// Drives a compiled grammar over `text`'s tokens; whether it accepts them all
/// and may stop there.
fn accepts(compiler: &GrammarCompiler, lark: &str, ids: &[u32]) -> bool {
    let g = compiler.compile(&Grammar::lark(lark)).unwrap();
    let mut m = g.matcher();
    let mut mask = TokenMask::new(compiler.model_vocab());
    for (step, &id) in ids.iter().enumerate() {
        if m.is_complete() {
            // The grammar admits nothing more.
            return false;
        }
        mask.clear();
        m.fill_mask(step, &mut mask).unwrap();
        if !mask.is_allowed(id) {
            return false;
        }
        m.accept(step, id).unwrap();
    }
    m.is_complete() || m.may_stop(ids.len()).unwrap()
}

/// The fixture's token ids of one Hermes call, tags included.
fn hermes_call(tok: &Tokenizer, name: &str, args: &str) -> Vec<u32> {
    let mut ids = vec![766];
    let body = format!("\n{{\"name\": \"{name}\", \"arguments\": {args}}}\n");
    ids.extend(tok.encode(&body, false).unwrap());
    ids.push(767);
    ids
}

#[test]
fn forced_grammars_accept_exactly_well_formed_calls() {
    let tok = Tokenizer::from_dir(&tiny_chat()).unwrap();
    let compiler = GrammarCompiler::new(&tok, tok.vocab_size(), &[2]).unwrap();
    let ts = tools();
    let all: Vec<&ToolSpec> = ts.iter().collect();
    let one = HERMES.grammar_text(&all, false, &tok, None).unwrap();
    // The tags are the fixture's tokens.
    assert!(one.contains("<[766]>") && one.contains("<[767]>"), "{one}");
    let call = |name: &str, args: &str| hermes_call(&tok, name, args);
    let good = call("get_weather", "{\"city\": \"Oslo\"}");
    assert!(accepts(&compiler, &one, &good));
    assert!(!accepts(&compiler, &one, &call("launch", "{}")));
    assert!(!accepts(
        &compiler,
        &one,
        &call("get_weather", "{\"unit\": \"celsius\"}")
    ));
    let mut two = good.clone();
    two.extend(tok.encode("\n", false).unwrap());
    two.extend(call("get_time", "{}"));
    assert!(!accepts(&compiler, &one, &two), "parallel off: one call");
    let many = HERMES.grammar_text(&all, true, &tok, None).unwrap();
    assert!(accepts(&compiler, &many, &two));
    // Named: only that tool.
    let named = HERMES.grammar_text(&[&ts[1]], true, &tok, None).unwrap();
    assert!(!accepts(&compiler, &named, &good));
    // Llama 3.1 bare JSON, with the "parameters" key.
    let l = LLAMA3_JSON.grammar_text(&all, true, &tok, None).unwrap();
    let ids = tok
        .encode(
            "{\"name\": \"get_time\", \"parameters\": {}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"A\"}}",
            false,
        )
        .unwrap();
    assert!(accepts(&compiler, &l, &ids));
    let ids = tok
        .encode("{\"name\": \"get_time\", \"arguments\": {}}", false)
        .unwrap();
    assert!(!accepts(&compiler, &l, &ids));
    // The marker is text where the vocabulary lacks the token.
    let m = MISTRAL.grammar_text(&all, false, &tok, None).unwrap();
    assert!(m.contains("\"[TOOL_CALLS]\""), "{m}");
    let ids = tok
        .encode(
            "[TOOL_CALLS] [{\"name\": \"get_time\", \"arguments\": {}}]",
            false,
        )
        .unwrap();
    assert!(accepts(&compiler, &m, &ids));
    // Auto with a response format: either the JSON answer or calls.
    let rf = ResponseFormat::JsonSchema {
        name: "a".into(),
        schema: json!({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}),
        strict: true,
    };
    let answer = rf.lark_json_body("response_format").unwrap().unwrap();
    let either = HERMES
        .grammar_text(&all, true, &tok, Some(&answer))
        .unwrap();
    assert!(accepts(&compiler, &either, &good));
    let ids = tok.encode("{\"x\": 3}", false).unwrap();
    assert!(accepts(&compiler, &either, &ids));
    let ids = tok.encode("{\"y\": 3}", false).unwrap();
    assert!(!accepts(&compiler, &either, &ids));
}

/// Tool schemas with `$defs`, `definitions` and recursion, as typed-model
/// generators write them: their references still resolve once the schema sits
/// inside a call, alone or among several tools.
#[test]
fn forced_calls_resolve_the_tools_own_references() {
    let tok = Tokenizer::from_dir(&tiny_chat()).unwrap();
    let compiler = GrammarCompiler::new(&tok, tok.vocab_size(), &[2]).unwrap();
    let route = ToolSpec {
        name: "route".into(),
        description: None,
        parameters: json!({
            "type": "object",
            "properties": {
                "from": {"$ref": "#/$defs/Place"},
                "via": {"type": "array", "items": {"$ref": "#/definitions/Stop"}},
                // A property named like a keyword is still a schema.
                "const": {"$ref": "#/$defs/Place"},
                "note": {"const": {"$ref": "#/not/a/schema"}}
            },
            "required": ["from"],
            "additionalProperties": false,
            "$defs": {"Place": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": false
            }},
            "definitions": {"Stop": {"$ref": "#/$defs/Place"}}
        }),
    };
    let tree = ToolSpec {
        name: "tree".into(),
        description: None,
        parameters: json!({
            "type": "object",
            "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
            "additionalProperties": false
        }),
    };
    let ids = |name: &str, args: &str| hermes_call(&tok, name, args);
    let good_route = ids(
        "route",
        r#"{"from": {"city": "Oslo"}, "via": [{"city": "Bergen"}]}"#,
    );
    let bad_route = ids("route", r#"{"from": {"town": "Oslo"}}"#);
    let bad_stop = ids("route", r#"{"from": {"city": "A"}, "via": [{"c": 1}]}"#);
    let good_tree = ids("tree", r#"{"kids": [{"kids": []}, {}]}"#);
    let bad_tree = ids("tree", r#"{"kids": [{"leaf": 1}]}"#);
    let literal = ids(
        "route",
        r##"{"from": {"city": "A"}, "note": {"$ref": "#/not/a/schema"}}"##,
    );
    // A schema with its own `$id` is a resource: its references resolve against
    // it wherever it sits (absolute or relative `$id`).
    let with_id = |id: &str| {
        let mut t = route.clone();
        t.parameters["$id"] = json!(id);
        t
    };
    for t in [
        with_id("https://example.com/route.json"),
        with_id("route.json"),
    ] {
        let g = HERMES.grammar_text(&[&t], false, &tok, None).unwrap();
        assert!(accepts(&compiler, &g, &good_route), "{g}");
        assert!(!accepts(&compiler, &g, &bad_route), "{g}");
    }
    // A schema without a type still forces an object.
    let open = ToolSpec {
        name: "open".into(),
        description: None,
        parameters: json!({"properties": {"a": {"type": "integer"}}}),
    };
    let g = HERMES.grammar_text(&[&open], false, &tok, None).unwrap();
    assert!(accepts(&compiler, &g, &ids("open", r#"{"a": 1}"#)), "{g}");
    assert!(!accepts(&compiler, &g, &ids("open", "3")), "{g}");
    for tools in [vec![&route], vec![&tree], vec![&tree, &route]] {
        let g = HERMES.grammar_text(&tools, false, &tok, None).unwrap();
        let has = |t: &ToolSpec| tools.iter().any(|u| u.name == t.name);
        assert_eq!(accepts(&compiler, &g, &good_route), has(&route), "{g}");
        assert_eq!(accepts(&compiler, &g, &literal), has(&route), "{g}");
        assert_eq!(accepts(&compiler, &g, &good_tree), has(&tree), "{g}");
        assert!(!accepts(&compiler, &g, &bad_route), "{g}");
        assert!(!accepts(&compiler, &g, &bad_stop), "{g}");
        assert!(!accepts(&compiler, &g, &bad_tree), "{g}");
    }
    // What the grammar forces, validation accepts.
    let p = HERMES.parse(
        &tok.decode(&good_route, false).unwrap(),
        &[route.clone(), tree.clone()],
        false,
    );
    assert_eq!(p.calls.len(), 1, "{p:?}");
}

#[test]
fn response_format_grammars_and_schema_errors() {
    assert!(ResponseFormat::Text.grammar("rf").unwrap().is_none());
    assert!(ResponseFormat::JsonObject.grammar("rf").unwrap().is_some());
    let bad = ResponseFormat::JsonSchema {
        name: "x".into(),
        schema: json!({"type": "object", "properties": {"n": {"minimum": "zero"}}}),
        strict: false,
    };
    let e = bad
        .grammar("response_format.json_schema.schema")
        .unwrap_err();
    assert_eq!(
        e.param.as_deref(),
        Some("response_format.json_schema.schema")
    );
    assert!(e.message.contains("/properties/n/minimum"), "{e}");
}
