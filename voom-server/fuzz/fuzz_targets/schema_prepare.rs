//! Structured fuzzing of the JSON schemas a request may carry: `arbitrary` builds a
//! schema from the keywords JSON Schema has (types, properties, required,
//! additionalProperties, items, prefixItems, enum, const, anyOf/oneOf/allOf/not,
//! $ref and $defs, pattern, format, bounds, x-guidance), always valid JSON, so every
//! input reaches the schema checks, the grammar construction and llguidance's
//! compiler instead of stopping at the JSON parser. The schema goes into a real body
//! of one of the ways a request can ask for structured output (OpenAI's
//! `response_format`, a forced or an automatic tool's `parameters`, Anthropic's
//! `output_config.format` and `input_schema`, the Responses API's `text.format`),
//! through the handler's own step before generation (`*::prepare_body`) on the
//! `tiny_chat` fixture. Never a panic; a schema the server cannot take is a 400,
//! never a 500.
//! Run with `cargo +nightly fuzz run schema_prepare` in `voom-server/`.
#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Map, Value};
use voom_server::serve::error::ApiError;
use voom_server::serve::job::Prepared;
use voom_server::serve::{anthropic, openai, responses, App};
use voom_server_fuzz::{app, assert_client_error};

/// Property names: a few fixed ones (so `required` and `$ref`s can hit them) and
/// any string.
#[derive(Arbitrary, Debug)]
enum Name {
    A,
    B,
    C,
    Any(String),
}

impl Name {
    fn text(&self) -> String {
        match self {
            Name::A => "a".into(),
            Name::B => "b".into(),
            Name::C => "c".into(),
            Name::Any(s) => s.clone(),
        }
    }
}

/// Scalars for enum, const, bounds and defaults.
#[derive(Arbitrary, Debug)]
enum Lit {
    Null,
    Bool(bool),
    Int(i64),
    Small(u8),
    Float(f64),
    Str(String),
    Tag(Tag),
}

/// Strings that mean something to a template or a tool format.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Tag {
    ToolCall,
    ToolCallEnd,
    ImEnd,
    Quote,
    Newline,
    Empty,
}

impl Lit {
    fn value(&self) -> Value {
        match self {
            Lit::Null => Value::Null,
            Lit::Bool(b) => json!(b),
            Lit::Int(i) => json!(i),
            Lit::Small(i) => json!(i),
            // NaN and infinities are not JSON: they become null.
            Lit::Float(f) => json!(f),
            Lit::Str(s) => json!(s),
            Lit::Tag(t) => json!(match t {
                Tag::ToolCall => "<tool_call>",
                Tag::ToolCallEnd => "</tool_call>",
                Tag::ImEnd => "<|im_end|>",
                Tag::Quote => "\"",
                Tag::Newline => "\n",
                Tag::Empty => "",
            }),
        }
    }
}

/// Regexes from pieces (literals, classes, repetitions with bounds, groups,
/// alternation, anchors), so `pattern` reaches the regex compilers with more than
/// noise; or any string.
#[derive(Arbitrary, Debug)]
enum Regex {
    Lit(char),
    Class(u8),
    Dot,
    Anchors(Box<Regex>),
    Repeat(Box<Regex>, u16, Option<u16>),
    Star(Box<Regex>),
    Group(Vec<Regex>),
    Alt(Box<Regex>, Box<Regex>),
    Raw(String),
}

impl Regex {
    fn text(&self, depth: usize) -> String {
        if depth > 6 {
            return "x".into();
        }
        match self {
            Regex::Lit(c) => {
                if c.is_ascii_alphanumeric() {
                    c.to_string()
                } else {
                    format!("\\x{{{:x}}}", *c as u32)
                }
            }
            Regex::Class(i) => [
                "[a-z]",
                "\\d",
                "\\w",
                "[^\"]",
                "\\s",
                "[0-9a-fA-F]",
                "\\p{L}",
                "[\\x00-\\x7f]",
            ][*i as usize % 8]
                .into(),
            Regex::Dot => ".".into(),
            Regex::Anchors(r) => format!("^{}$", r.text(depth + 1)),
            Regex::Repeat(r, lo, hi) => match hi {
                Some(hi) => format!("(?:{}){{{lo},{hi}}}", r.text(depth + 1)),
                None => format!("(?:{}){{{lo},}}", r.text(depth + 1)),
            },
            Regex::Star(r) => format!("(?:{})*", r.text(depth + 1)),
            Regex::Group(rs) => rs.iter().take(8).map(|r| r.text(depth + 1)).collect(),
            Regex::Alt(a, b) => format!("(?:{}|{})", a.text(depth + 1), b.text(depth + 1)),
            Regex::Raw(s) => s.clone(),
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Ty {
    Object,
    Array,
    String,
    Integer,
    Number,
    Boolean,
    Null,
    Several(Vec<Ty>),
    Unknown(String),
}

impl Ty {
    fn value(&self) -> Value {
        let one = |t: &Ty| match t {
            Ty::Object => "object".into(),
            Ty::Array => "array".into(),
            Ty::String => "string".into(),
            Ty::Integer => "integer".into(),
            Ty::Number => "number".into(),
            Ty::Boolean => "boolean".into(),
            Ty::Null => "null".into(),
            Ty::Several(_) => "string".into(),
            Ty::Unknown(s) => s.clone(),
        };
        match self {
            Ty::Several(ts) => Value::Array(ts.iter().take(4).map(|t| one(t).into()).collect()),
            t => one(t).into(),
        }
    }
}

/// Where a `$ref` points.
#[derive(Arbitrary, Debug)]
enum Ref {
    Root,
    Def(Name),
    Property(Name),
    Remote,
    Any(String),
}

/// One keyword of a schema object.
#[derive(Arbitrary, Debug)]
enum Keyword {
    Type(Ty),
    Properties(Vec<(Name, Schema)>),
    Required(Vec<Name>),
    AdditionalProperties(Box<Schema>),
    Items(Box<Schema>),
    PrefixItems(Vec<Schema>),
    Enum(Vec<Lit>),
    Const(Lit),
    AnyOf(Vec<Schema>),
    OneOf(Vec<Schema>),
    AllOf(Vec<Schema>),
    Not(Box<Schema>),
    Ref(Ref),
    Defs(Vec<(Name, Schema)>),
    Pattern(Regex),
    Format(u8),
    Bound(u8, Lit),
    Description(String),
    Guidance(bool, Option<String>),
    Other(String, Lit),
}

/// A schema: `true`, `false` or an object of keywords.
#[derive(Arbitrary, Debug)]
enum Schema {
    True,
    False,
    Object(Vec<Keyword>),
}

const BOUNDS: [&str; 11] = [
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
];

const FORMATS: [&str; 10] = [
    "date-time",
    "date",
    "time",
    "email",
    "uuid",
    "ipv4",
    "ipv6",
    "uri",
    "hostname",
    "regex",
];

impl Schema {
    fn value(&self, depth: usize) -> Value {
        if depth > 5 {
            return json!({});
        }
        let sub = |s: &Schema| s.value(depth + 1);
        let list = |v: &[Schema]| Value::Array(v.iter().take(6).map(sub).collect());
        let map = |v: &[(Name, Schema)]| {
            Value::Object(
                v.iter()
                    .take(6)
                    .map(|(n, s)| (n.text(), sub(s)))
                    .collect::<Map<_, _>>(),
            )
        };
        match self {
            Schema::True => json!(true),
            Schema::False => json!(false),
            Schema::Object(keywords) => {
                let mut o = Map::new();
                for k in keywords.iter().take(8) {
                    let (key, v): (String, Value) = match k {
                        Keyword::Type(t) => ("type".into(), t.value()),
                        Keyword::Properties(p) => ("properties".into(), map(p)),
                        Keyword::Required(r) => (
                            "required".into(),
                            r.iter().take(6).map(|n| Value::from(n.text())).collect(),
                        ),
                        Keyword::AdditionalProperties(s) => ("additionalProperties".into(), sub(s)),
                        Keyword::Items(s) => ("items".into(), sub(s)),
                        Keyword::PrefixItems(v) => ("prefixItems".into(), list(v)),
                        Keyword::Enum(v) => {
                            ("enum".into(), v.iter().take(8).map(Lit::value).collect())
                        }
                        Keyword::Const(l) => ("const".into(), l.value()),
                        Keyword::AnyOf(v) => ("anyOf".into(), list(v)),
                        Keyword::OneOf(v) => ("oneOf".into(), list(v)),
                        Keyword::AllOf(v) => ("allOf".into(), list(v)),
                        Keyword::Not(s) => ("not".into(), sub(s)),
                        Keyword::Ref(r) => (
                            "$ref".into(),
                            match r {
                                Ref::Root => "#".into(),
                                Ref::Def(n) => format!("#/$defs/{}", n.text()),
                                Ref::Property(n) => format!("#/properties/{}", n.text()),
                                Ref::Remote => "https://example.com/schema.json".into(),
                                Ref::Any(s) => s.clone(),
                            }
                            .into(),
                        ),
                        Keyword::Defs(d) => ("$defs".into(), map(d)),
                        Keyword::Pattern(r) => ("pattern".into(), r.text(0).into()),
                        Keyword::Format(i) => {
                            ("format".into(), FORMATS[*i as usize % FORMATS.len()].into())
                        }
                        Keyword::Bound(i, l) => {
                            (BOUNDS[*i as usize % BOUNDS.len()].into(), l.value())
                        }
                        Keyword::Description(s) => ("description".into(), s.clone().into()),
                        Keyword::Guidance(flexible, sep) => {
                            let mut g = json!({"whitespace_flexible": flexible});
                            if let Some(s) = sep {
                                g["item_separator"] = s.clone().into();
                            }
                            ("x-guidance".into(), g)
                        }
                        Keyword::Other(k, l) => (k.clone(), l.value()),
                    };
                    o.insert(key, v);
                }
                Value::Object(o)
            }
        }
    }
}

/// How the request asks for structured output.
#[derive(Arbitrary, Debug)]
enum Use {
    OpenAiResponseFormat { strict: bool },
    OpenAiForcedTool,
    OpenAiAutoToolWithFormat,
    OpenAiCompletion,
    AnthropicOutputFormat,
    AnthropicToolAny,
    ResponsesTextFormat,
    ResponsesNamedTool,
}

#[derive(Arbitrary, Debug)]
struct Input {
    schema: Schema,
    how: Use,
    /// Wrapped as a tool's parameters: an object schema around it.
    as_property: bool,
}

fn check(r: Result<Prepared, ApiError>) {
    if let Err(e) = r {
        assert_client_error(&e);
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else {
        return;
    };
    let schema = input.schema.value(0);
    let params = if input.as_property {
        json!({"type": "object", "properties": {"x": schema}, "required": ["x"]})
    } else {
        schema.clone()
    };
    let user = json!([{"role": "user", "content": "Hi"}]);
    let tool = |parameters: &Value| json!([{"type": "function", "function": {"name": "f", "parameters": parameters}}]);
    let app = app();
    let (body, prepare): (Value, fn(&App, &[u8]) -> Result<Prepared, ApiError>) = match input.how {
        Use::OpenAiResponseFormat { strict } => (
            json!({"model": "tiny_chat", "messages": user, "response_format": {"type": "json_schema",
                   "json_schema": {"name": "out", "strict": strict, "schema": schema}}}),
            |a, b| openai::prepare_body(a, openai::Endpoint::Chat, b).map(|(p, _)| p),
        ),
        Use::OpenAiForcedTool => (
            json!({"model": "tiny_chat", "messages": user, "tools": tool(&params),
                   "tool_choice": "required"}),
            |a, b| openai::prepare_body(a, openai::Endpoint::Chat, b).map(|(p, _)| p),
        ),
        Use::OpenAiAutoToolWithFormat => (
            json!({"model": "tiny_chat", "messages": user, "tools": tool(&params),
                   "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}}),
            |a, b| openai::prepare_body(a, openai::Endpoint::Chat, b).map(|(p, _)| p),
        ),
        Use::OpenAiCompletion => (
            json!({"model": "tiny_chat", "prompt": "Hi", "response_format": {"type": "json_schema",
                   "json_schema": {"name": "out", "schema": schema}}}),
            |a, b| openai::prepare_body(a, openai::Endpoint::Completion, b).map(|(p, _)| p),
        ),
        Use::AnthropicOutputFormat => (
            json!({"model": "tiny_chat", "max_tokens": 16, "messages": user,
                   "output_config": {"format": {"type": "json_schema", "schema": schema}}}),
            |a, b| anthropic::prepare_body(a, b).map(|(p, _)| p),
        ),
        Use::AnthropicToolAny => (
            json!({"model": "tiny_chat", "max_tokens": 16, "messages": user,
                   "tools": [{"name": "f", "input_schema": params}], "tool_choice": {"type": "any"}}),
            |a, b| anthropic::prepare_body(a, b).map(|(p, _)| p),
        ),
        Use::ResponsesTextFormat => (
            json!({"model": "tiny_chat", "input": "Hi", "text": {"format": {"type": "json_schema",
                   "name": "out", "schema": schema}}}),
            |a, b| responses::prepare_body(a, b).map(|(p, _)| p),
        ),
        Use::ResponsesNamedTool => (
            json!({"model": "tiny_chat", "input": "Hi", "tools": [{"type": "function", "name": "f",
                   "parameters": params}], "tool_choice": {"type": "function", "name": "f"}}),
            |a, b| responses::prepare_body(a, b).map(|(p, _)| p),
        ),
    };
    let bytes = serde_json::to_vec(&body).expect("a Value serializes");
    check(prepare(app, &bytes));
});
