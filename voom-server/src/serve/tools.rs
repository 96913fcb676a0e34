//! Tool calls and structured output, shared by every dialect (OpenAI chat
//! completions, Anthropic messages, OpenAI responses).
//!
//! A request's tools arrive as a [`ToolRequest`] (tools, [`ToolChoice`], whether
//! several calls may come at once). What happens to them:
//! - they are rendered through the model's chat template
//!   ([`ToolRequest::template_tools`]), except under `tool_choice` none;
//! - the template's text says how the model writes calls: a [`ToolFormat`]
//!   ([`ToolFormat::detect`]). Each format is data: the text that opens and closes a
//!   call (or a list of calls), the key the arguments go under and how calls are
//!   separated. From it come both the grammar that forces calls
//!   ([`ToolFormat::forced_grammar`], `tool_choice` required or a named tool) and the
//!   parser that finds calls in free output ([`ToolParser::parse`], `tool_choice`
//!   auto);
//! - a parsed call becomes a [`ToolCall`] only if it names an offered tool and its
//!   arguments satisfy that tool's schema ([`libvoom::constrain::validate_json`]);
//!   anything else (malformed JSON, an unknown tool, invalid arguments, a second call
//!   when parallel calls are off) stays in the assistant text, verbatim.
//!
//! Structured output ([`ResponseFormat`]): `json_object` and `json_schema` compile to
//! llguidance grammars ([`ResponseFormat::grammar`]); the output is validated against
//! the schema before it is returned.
//!
//! Formats supported: Hermes/Qwen (`<tool_call>\n{"name": ..., "arguments": {...}}\n
//! </tool_call>`, also the default for templates that name no format), Llama 3.1
//! (bare `{"name": ..., "parameters": {...}}`, several separated by `;`, optionally
//! after `<|python_tag|>`) and Mistral (`[TOOL_CALLS] [{"name": ..., "arguments":
//! {...}}, ...]`).

use libvoom::constrain::{validate_json, Grammar, JsonWhitespace};
use libvoom::text::Tokenizer;
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::request::kind;

/// One tool offered to the model.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: Option<String>,
    /// JSON schema of the arguments.
    pub parameters: Value,
}

/// Which calls the model may or must make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// No calls: the tools are not rendered and the output is not parsed.
    None,
    /// The model decides; calls found in its output are returned as calls.
    Auto,
    /// At least one call to any offered tool, forced by a grammar.
    Required,
    /// A call to this tool, forced by a grammar.
    Named(String),
}

/// The tools of a request and how they may be used.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolRequest {
    pub tools: Vec<ToolSpec>,
    pub choice: ToolChoice,
    /// Whether more than one call may be returned (`parallel_tool_calls`; Anthropic's
    /// `disable_parallel_tool_use` negated).
    pub parallel: bool,
}

/// A call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// "call_" and 24 hex digits; dialects with another prefix may replace it.
    pub id: String,
    pub name: String,
    /// The arguments, valid against the tool's schema (always a JSON value, never a
    /// string holding JSON).
    pub arguments: Value,
    /// The arguments' JSON text as it was streamed (compact, as the model wrote it),
    /// for a call streamed while it was generated; `None` for the others.
    pub arguments_text: Option<String>,
}

impl ToolCall {
    /// The arguments as JSON text, as the APIs that take a string give them: the
    /// streamed text where the call was streamed (so streamed and whole responses
    /// agree), else `arguments` serialized.
    pub fn arguments_json(&self) -> String {
        self.arguments_text
            .clone()
            .unwrap_or_else(|| self.arguments.to_string())
    }
}

/// The APIs' rule for tool names: 1 to 64 of `a-z A-Z 0-9 _ -`. It also keeps names
/// from holding a format's markers (`<tool_call>`), which would break the call grammar.
pub fn is_valid_tool_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// The arguments schema of a tool that gives none: an object with any properties.
pub fn empty_parameters() -> Value {
    json!({"type": "object", "properties": {}})
}

impl ToolRequest {
    /// Checks the request: tool names are non-empty and distinct, each parameters
    /// schema is a valid JSON schema, a named choice names an offered tool and a
    /// forcing choice has tools to force. Errors name `param` (the request's field
    /// for the tools, in the caller's dialect) and the tool at fault.
    pub fn new(
        tools: Vec<ToolSpec>,
        choice: ToolChoice,
        parallel: bool,
        param: &str,
    ) -> Result<ToolRequest, ApiError> {
        for (i, t) in tools.iter().enumerate() {
            if t.name.is_empty() {
                return Err(ApiError::invalid(
                    param,
                    format!("tool {i} has an empty name"),
                ));
            }
            if !is_valid_tool_name(&t.name) {
                return Err(ApiError::invalid(
                    param,
                    format!(
                        "tool {i}: '{}' is not a valid tool name: 1 to 64 of a-z, A-Z, 0-9, _ and -",
                        t.name
                    ),
                ));
            }
            if tools[..i].iter().any(|u| u.name == t.name) {
                return Err(ApiError::invalid(
                    param,
                    format!("the tool name '{}' is used twice", t.name),
                ));
            }
            if !t.parameters.is_object() {
                return Err(ApiError::invalid(
                    param,
                    format!(
                        "the parameters schema of tool '{}' must be an object, not {}",
                        t.name,
                        kind(&t.parameters)
                    ),
                ));
            }
            // Arguments are a JSON object in every dialect (Anthropic's `input`
            // is one), so the schema must describe one.
            match t.parameters.get("type") {
                None => {}
                Some(Value::String(ty)) if ty == "object" => {}
                Some(ty) => {
                    return Err(ApiError::invalid(
                        param,
                        format!(
                        "the parameters schema of tool '{}' must have type \"object\", not {ty}",
                        t.name
                    ),
                    ))
                }
            }
            Grammar::json_schema(&t.parameters).map_err(|e| {
                ApiError::invalid(
                    param,
                    format!("the parameters schema of tool '{}' is invalid: {e}", t.name),
                )
            })?;
        }
        match &choice {
            ToolChoice::Required if tools.is_empty() => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "a tool call is required but no tools are offered",
                ))
            }
            ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "tool_choice names the tool '{n}', which is not among the tools offered ({})",
                        names(&tools)
                    ),
                ))
            }
            _ => {}
        }
        Ok(ToolRequest {
            tools,
            choice,
            parallel,
        })
    }

    /// Whether tools take part in this request (offered, and choice not none).
    pub fn is_active(&self) -> bool {
        self.choice != ToolChoice::None && !self.tools.is_empty()
    }

    /// The tools a grammar forces a call to: all of them (required), the named one,
    /// or none (auto, none).
    pub fn forced(&self) -> Option<Vec<&ToolSpec>> {
        match &self.choice {
            ToolChoice::Required => Some(self.tools.iter().collect()),
            ToolChoice::Named(n) => Some(self.tools.iter().filter(|t| &t.name == n).collect()),
            ToolChoice::None | ToolChoice::Auto => None,
        }
    }

    /// The tools as chat templates take them (OpenAI's `{"type": "function",
    /// "function": {name, description, parameters}}`, which transformers passes
    /// through unchanged). None when there are no tools or the choice is none: as in
    /// vLLM, a model told it may not call tools is not shown them.
    pub fn template_tools(&self) -> Option<Vec<Value>> {
        if !self.is_active() {
            return None;
        }
        Some(
            self.tools
                .iter()
                .map(|t| {
                    let mut f = Map::new();
                    f.insert("name".into(), t.name.clone().into());
                    if let Some(d) = &t.description {
                        f.insert("description".into(), d.clone().into());
                    }
                    f.insert("parameters".into(), t.parameters.clone());
                    json!({"type": "function", "function": f})
                })
                .collect(),
        )
    }
}

fn names(tools: &[ToolSpec]) -> String {
    if tools.is_empty() {
        return "none".into();
    }
    tools
        .iter()
        .map(|t| t.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// What the output must be, beside tool calls.
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    /// Free text (no constraint).
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid against `schema`.
    JsonSchema {
        name: String,
        schema: Value,
        strict: bool,
    },
}

impl ResponseFormat {
    /// The schema the output is validated against (None for text).
    pub fn schema(&self) -> Option<Value> {
        match self {
            ResponseFormat::Text => None,
            ResponseFormat::JsonObject => Some(json!({"type": "object"})),
            ResponseFormat::JsonSchema { schema, .. } => Some(schema.clone()),
        }
    }

    /// The grammar of the output; a malformed schema is a 400 naming `param` and the
    /// place in the schema.
    pub fn grammar(&self, param: &str) -> Result<Option<Grammar>, ApiError> {
        match self {
            ResponseFormat::Text => Ok(None),
            ResponseFormat::JsonObject => Ok(Some(Grammar::json_object())),
            ResponseFormat::JsonSchema { schema, .. } => Grammar::json_schema(schema)
                .map(Some)
                .map_err(|e| ApiError::invalid(param, e.to_string())),
        }
    }

    /// The `%json {...}` Lark body of this format (None for text).
    pub fn lark_json_body(&self, param: &str) -> Result<Option<String>, ApiError> {
        match self.schema() {
            None => Ok(None),
            Some(s) => Grammar::lark_json(&s, JsonWhitespace::Spaced)
                .map(Some)
                .map_err(|e| ApiError::invalid(param, e.to_string())),
        }
    }
}

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

/// What [`ToolParser::parse`] found.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Parsed {
    /// The output without the accepted calls (trimmed when calls were taken out;
    /// the output unchanged when none were).
    pub content: String,
    pub calls: Vec<ToolCall>,
    /// Why each call-like part that stayed text was not taken, for logs and for
    /// checking forced output.
    pub rejected: Vec<String>,
    /// A call stayed text only because it holds a number beyond an f64 (`1e400`),
    /// valid JSON that serde_json cannot represent: not a grammar failure.
    pub unrepresentable: bool,
}

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

    /// Finds the calls in `text` (see the module's rules). Calls past the first stay
    /// text unless `parallel`.
    pub fn parse(&self, text: &str, tools: &[ToolSpec], parallel: bool) -> Parsed {
        let mut p = Parsed::default();
        let mut content = String::new();
        let accept = |slice: &str, value: Result<Value, String>, p: &mut Parsed| -> bool {
            let r = value.and_then(|v| self.call_from(&v, tools));
            match r {
                Ok(c) if parallel || p.calls.is_empty() => {
                    p.calls.push(c);
                    true
                }
                Ok(c) => {
                    p.rejected.push(format!(
                        "a further call to '{}' while parallel calls are off",
                        c.name
                    ));
                    false
                }
                Err(why) => {
                    p.rejected.push(format!("{why}: {}", clip(slice)));
                    false
                }
            }
        };
        match self.layout {
            Layout::Tagged => {
                let mut rest = text;
                while let Some(i) = rest.find(self.open) {
                    content.push_str(&rest[..i]);
                    let after = &rest[i + self.open.len()..];
                    // An unclosed call at the end of the output (the model stopped
                    // right after its JSON) still counts.
                    let (body, end) = match after.find(self.close) {
                        Some(j) => (&after[..j], j + self.close.len()),
                        None => (after, after.len()),
                    };
                    let block = &rest[i..i + self.open.len() + end];
                    let v = serde_json::from_str::<Value>(body.trim()).map_err(|e| {
                        p.unrepresentable |= super::worker::is_number_overflow(&e);
                        format!("the call is not JSON ({e})")
                    });
                    if !accept(block, v, &mut p) {
                        content.push_str(block);
                    }
                    rest = &after[end..];
                }
                content.push_str(rest);
            }
            Layout::Bare => {
                let start = text.trim_start();
                let body = start.strip_prefix(self.open).unwrap_or(start);
                if !body.trim_start().starts_with('{') {
                    return Parsed {
                        content: text.to_string(),
                        ..Default::default()
                    };
                }
                let mut rest = body;
                loop {
                    let r = rest.trim_start_matches(|c: char| c.is_whitespace() || c == ';');
                    if r.is_empty() {
                        break;
                    }
                    let mut it = serde_json::Deserializer::from_str(r).into_iter::<Value>();
                    match it.next() {
                        Some(Ok(v)) => {
                            let n = it.byte_offset();
                            if !accept(&r[..n], Ok(v), &mut p) {
                                content.push_str(&r[..n]);
                                content.push('\n');
                            }
                            rest = &r[n..];
                        }
                        other => {
                            if let Some(Err(e)) = &other {
                                p.unrepresentable |= super::worker::is_number_overflow(e);
                            }
                            p.rejected
                                .push(format!("text that is not a JSON call: {}", clip(r)));
                            content.push_str(r);
                            break;
                        }
                    }
                }
                if p.calls.is_empty() {
                    content = text.to_string();
                }
            }
            Layout::List => match text.find(self.open) {
                None => content.push_str(text),
                Some(i) => {
                    content.push_str(&text[..i]);
                    let after = &text[i + self.open.len()..];
                    let r = after.trim_start();
                    let mut it = serde_json::Deserializer::from_str(r).into_iter::<Value>();
                    match it.next() {
                        Some(Ok(Value::Array(items))) => {
                            let n = it.byte_offset();
                            let mut left = Vec::new();
                            for item in items {
                                let s = item.to_string();
                                if !accept(&s, Ok(item.clone()), &mut p) {
                                    left.push(item);
                                }
                            }
                            if !left.is_empty() {
                                content.push_str(self.open);
                                content.push_str(&Value::Array(left).to_string());
                            }
                            content.push_str(&r[n..]);
                        }
                        other => {
                            if let Some(Err(e)) = &other {
                                p.unrepresentable |= super::worker::is_number_overflow(e);
                            }
                            p.rejected
                                .push(format!("no JSON list of calls after {}", self.open));
                            content.push_str(&text[i..]);
                        }
                    }
                }
            },
        }
        p.content = if p.calls.is_empty() {
            text.to_string()
        } else {
            content.trim().to_string()
        };
        p
    }

    /// A call from its JSON, if it names one of `tools` and its arguments are valid.
    fn call_from(&self, v: &Value, tools: &[ToolSpec]) -> Result<ToolCall, String> {
        let Value::Object(o) = v else {
            return Err(format!("a call must be a JSON object, not {}", kind(v)));
        };
        let name = match o.get("name") {
            Some(Value::String(n)) => n,
            _ => return Err("a call without a string 'name'".into()),
        };
        let tool = tools
            .iter()
            .find(|t| &t.name == name)
            .ok_or_else(|| format!("a call to '{name}', which is not an offered tool"))?;
        let args = std::iter::once(self.args_key)
            .chain(self.alt_args_keys.iter().copied())
            .find_map(|k| o.get(k));
        let args = match args {
            None => json!({}),
            // Some models write the arguments as a string holding JSON.
            Some(Value::String(s)) => serde_json::from_str::<Value>(s).map_err(|e| {
                format!("the arguments of '{name}' are a string that is not JSON ({e})")
            })?,
            Some(a) => a.clone(),
        };
        if !args.is_object() {
            return Err(format!(
                "the arguments of '{name}' must be a JSON object, not {}",
                kind(&args)
            ));
        }
        validate_json(&tool.parameters, &args)
            .map_err(|e| format!("the arguments of '{name}' do not match its schema: {e}"))?;
        Ok(ToolCall {
            id: super::prepare::new_id("call_"),
            name: name.clone(),
            arguments: args,
            arguments_text: None,
        })
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

/// The first 200 characters of `s`, for messages.
fn clip(s: &str) -> String {
    match s.char_indices().nth(200) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

/// Tells the worker how to treat tool calls in one request's output.
#[derive(Debug, Clone)]
pub struct ToolParser {
    pub format: &'static ToolFormat,
    pub tools: Vec<ToolSpec>,
    pub parallel: bool,
    /// A grammar forces the calls: output that ends complete must parse entirely.
    pub forced: bool,
}

impl ToolParser {
    pub fn parse(&self, text: &str) -> Parsed {
        self.format.parse(text, &self.tools, self.parallel)
    }
}

/// Arguments of a call in a request's history, as chat templates take them: an
/// object (templates write it with `tojson`), where OpenAI's API gives a string
/// holding JSON. A string that is not JSON is a 400 naming `at`.
pub fn history_arguments(v: &Value, at: &str) -> Result<Value, ApiError> {
    match v {
        Value::String(s) => serde_json::from_str::<Value>(s).map_err(|e| {
            ApiError::invalid(
                at,
                format!("the arguments must be a string holding JSON: {e}"),
            )
        }),
        other => Ok(other.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libvoom::constrain::{GrammarCompiler, TokenConstraint, TokenMask};
    use std::path::PathBuf;

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
        let only = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"UTC\"}}\n</tool_call>";
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
        let e = ToolRequest::new(vec![weather(), weather()], ToolChoice::Auto, true, "tools")
            .unwrap_err();
        assert!(e.message.contains("twice"), "{e}");
        let e =
            ToolRequest::new(tools(), ToolChoice::Named("x".into()), true, "tools").unwrap_err();
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
}
