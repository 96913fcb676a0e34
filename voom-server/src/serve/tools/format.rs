//! The tool-call formats of chat template families, as data, and the grammars that
//! force calls in them.

use libvoom::constrain::{Grammar, JsonWhitespace};
use libvoom::text::Tokenizer;
use serde_json::{json, Map, Value};

use super::spec::ToolSpec;
use crate::serve::error::ApiError;

/// How a family of chat templates has the model write tool calls.
#[derive(Debug, PartialEq, Eq)]
pub struct ToolFormat {
    pub name: &'static str,
    /// Text before each call (`Tagged`) or before the list of calls (`List`); for
    /// `Bare`, an optional prefix.
    pub open: &'static str,
    /// Text after each call (`Tagged` only).
    pub close: &'static str,
    /// The key the arguments are written under.
    pub args_key: &'static str,
    /// Other keys accepted for the arguments when parsing.
    pub alt_args_keys: &'static [&'static str],
    pub layout: Layout,
    /// Between two forced calls (`Tagged`, `Bare`).
    pub separator: &'static str,
    /// The opening marker is a special token that a decode skipping special tokens
    /// would drop: decode output with special tokens kept.
    pub keep_special_tokens: bool,
}

/// Where the calls sit in the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Each call wrapped in `open` ... `close`, anywhere in the text.
    Tagged,
    /// `open`, then one JSON array of calls.
    List,
    /// The whole output is calls: JSON objects separated by `;` (after an optional
    /// `open`).
    Bare,
}

/// Qwen2.5, Hermes 2/3, and the tiny_chat fixture.
pub static HERMES: ToolFormat = ToolFormat {
    name: "hermes",
    open: "<tool_call>",
    close: "</tool_call>",
    args_key: "arguments",
    alt_args_keys: &["parameters"],
    layout: Layout::Tagged,
    separator: "\n",
    keep_special_tokens: false,
};

/// Llama 3.1/3.2/3.3 JSON tool calling.
pub static LLAMA3_JSON: ToolFormat = ToolFormat {
    name: "llama3_json",
    open: "<|python_tag|>",
    close: "",
    args_key: "parameters",
    alt_args_keys: &["arguments"],
    layout: Layout::Bare,
    separator: "; ",
    keep_special_tokens: true,
};

/// Mistral (v3 tokenizers and later, list form).
pub static MISTRAL: ToolFormat = ToolFormat {
    name: "mistral",
    open: "[TOOL_CALLS]",
    close: "",
    args_key: "arguments",
    alt_args_keys: &["parameters"],
    layout: Layout::List,
    separator: ", ",
    keep_special_tokens: true,
};

impl ToolFormat {
    /// The format a chat template's source text asks for: `<tool_call>` tags
    /// (Hermes), `[TOOL_CALLS]` (Mistral), a JSON object with "parameters" (Llama
    /// 3.1); Hermes, the most common, when the template names none.
    pub fn detect(template_source: &str) -> &'static ToolFormat {
        if template_source.contains("<tool_call>") {
            &HERMES
        } else if template_source.contains("[TOOL_CALLS]") {
            &MISTRAL
        } else if template_source.contains("\"parameters\"")
            || template_source.contains("<|python_tag|>")
        {
            &LLAMA3_JSON
        } else {
            &HERMES
        }
    }

    /// The JSON schema of one call to any of `tools`: `{"name": NAME, ARGS_KEY:
    /// ARGS}` (name first, as templates write it).
    ///
    /// Each tool's schema is written where its arguments go, so the local `$ref`s it
    /// holds (`#/$defs/...`, `#/definitions/...`, `#` for recursion), which name
    /// places in its own document, are rebased onto that place ([`rebase_refs`]):
    /// schemas generated from typed models (Pydantic, zod) use them for every
    /// nested type.
    pub fn call_schema(&self, tools: &[&ToolSpec]) -> Value {
        let one = |i: Option<usize>, t: &ToolSpec| {
            let at = match i {
                None => format!("#/properties/{}", self.args_key),
                Some(i) => format!("#/anyOf/{i}/properties/{}", self.args_key),
            };
            let mut args = rebase_refs(&t.parameters, &at);
            // Arguments are an object, also where the schema leaves the type open.
            if let Some(o) = args.as_object_mut() {
                o.entry("type").or_insert_with(|| json!("object"));
            }
            let mut props = Map::new();
            props.insert("name".into(), json!({"const": t.name}));
            props.insert(self.args_key.into(), args);
            json!({
                "type": "object",
                "properties": props,
                "required": ["name", self.args_key],
                "additionalProperties": false,
            })
        };
        match tools {
            [t] => one(None, t),
            _ => {
                json!({"anyOf": tools.iter().enumerate().map(|(i, t)| one(Some(i), t)).collect::<Vec<_>>()})
            }
        }
    }

    /// A Lark grammar whose every output is one call (or, with `parallel`, one or
    /// more) to one of `tools`, with arguments valid against its schema. With
    /// `answer` (a `%json` body: a response format), the output may instead be that
    /// JSON and no call: used under `tool_choice` auto with a response format. The
    /// markers are the tokenizer's single tokens where it has them (so a forced call
    /// looks exactly like one the model writes itself), else their text.
    pub fn grammar_text(
        &self,
        tools: &[&ToolSpec],
        parallel: bool,
        tok: &Tokenizer,
        answer: Option<&str>,
    ) -> Result<String, ApiError> {
        let call = Grammar::lark_json(&self.call_schema(tools), JsonWhitespace::Spaced)
            .map_err(|e| ApiError::invalid("tools", format!("a tool's schema: {e}")))?;
        let open = marker(tok, self.open);
        let close = marker(tok, self.close);
        let sep = lark_string(self.separator);
        let mut g = String::new();
        let calls = match self.layout {
            Layout::Tagged => {
                g += &format!("block: {open} \"\\n\" call \"\\n\" {close}\n");
                if parallel {
                    format!("block ({sep} block)*")
                } else {
                    "block".to_string()
                }
            }
            Layout::Bare => {
                if parallel {
                    format!("call ({sep} call)*")
                } else {
                    "call".to_string()
                }
            }
            Layout::List => {
                // The list's JSON is written by the grammar so the separator and the
                // count are fixed: `[CALL]` or `[CALL, CALL, ...]`.
                if parallel {
                    format!("{open} \" [\" call ({sep} call)* \"]\"")
                } else {
                    format!("{open} \" [\" call \"]\"")
                }
            }
        };
        match answer {
            Some(a) => g += &format!("start: answer | calls\ncalls: {calls}\nanswer: {a}\n"),
            None => g += &format!("start: {calls}\n"),
        }
        g += &format!("call: {call}\n");
        Ok(g)
    }
}

/// `schema`, to be moved from the root of its document to the place `at` (a URI
/// fragment holding a JSON pointer, such as `#/properties/arguments`): each local
/// `$ref` (`#` or `#/...`) is rewritten to name the same place under `at`. Values
/// that are data, not schemas (`const`, `enum`, `default`, `examples`), are left as
/// they are, as are references to other documents or to `$id`s, and everything
/// below a schema with an `$id` (a resource of its own).
fn rebase_refs(schema: &Value, at: &str) -> Value {
    match schema {
        // A schema with its own `$id` is a resource of its own: the references in
        // it resolve against it wherever it sits, so they stay as they are.
        Value::Object(m) if m.contains_key("$id") => schema.clone(),
        Value::Object(m) => Value::Object(
            m.iter()
                .map(|(k, v)| {
                    let v = match (k.as_str(), v) {
                        ("$ref", Value::String(r)) if r == "#" || r.starts_with("#/") => {
                            Value::String(format!("{at}{}", &r[1..]))
                        }
                        ("const" | "enum" | "default" | "examples", _) => v.clone(),
                        // Maps from names (which may be any word, "$ref" or
                        // "const" included) to schemas.
                        (
                            "properties" | "patternProperties" | "$defs" | "definitions"
                            | "dependentSchemas",
                            Value::Object(named),
                        ) => Value::Object(
                            named
                                .iter()
                                .map(|(n, s)| (n.clone(), rebase_refs(s, at)))
                                .collect(),
                        ),
                        _ => rebase_refs(v, at),
                    };
                    (k.clone(), v)
                })
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(|v| rebase_refs(v, at)).collect()),
        other => other.clone(),
    }
}

/// How a marker appears in a Lark grammar: the token by id when the tokenizer has
/// it as one added token, else the text.
fn marker(tok: &Tokenizer, text: &str) -> String {
    if text.is_empty() {
        return "\"\"".into();
    }
    let added = tok
        .inner()
        .get_added_tokens_decoder()
        .into_iter()
        .find(|(_, t)| t.content == text)
        .map(|(id, _)| id);
    match added {
        Some(id) => format!("<[{id}]>"),
        None => lark_string(text),
    }
}

/// A Lark string literal (JSON's escapes are Lark's).
fn lark_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}
