//! Chat templates rendered as transformers renders them.
//!
//! transformers compiles a template with jinja2's `ImmutableSandboxedEnvironment(
//! trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])`, overrides `tojson`
//! (Python's `json.dumps` with `ensure_ascii=False`, no HTML escaping), and adds the
//! globals `raise_exception`, `strftime_now`, `dict` and `namespace`. Templates are
//! Python-flavoured: they call string methods (`.strip()`, `.split()`), and printing
//! a value uses Python's `str()` (`True`, `None`, `['a', 1]`). This module reproduces
//! all of that on minijinja so that a prompt renders byte for byte as in Python.
//!
//! Limits (documented, not silent): `strftime_now` formats the current time in UTC
//! (transformers uses the local time zone, which is UTC on typical servers); the
//! `{% generation %}` tag of assistant-mask templates is not supported (a syntax error
//! names it); printing a string inside a container follows Python's `repr`, with
//! non-printable characters detected for the common Unicode ranges only.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{from_args, Kwargs, Rest, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State, UndefinedBehavior};
use serde::{Deserialize, Serialize};

use super::TextError;

/// One message of a conversation, in the shape OpenAI-style clients send and chat
/// templates read. Fields that are `None` are left out of what the template sees
/// (transformers drops `None`-valued keys too).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// A string, or a list of content parts (`{"type": "text", "text": ...}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<serde_json::Value>,
    /// A list of `{"type": "function", "function": {"name", "arguments"}}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Any other keys, passed to the template unchanged.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    /// A message with a plain string content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: Some(serde_json::Value::String(content.into())),
            ..Default::default()
        }
    }

    /// The JSON object a template sees for this message.
    pub fn to_value(&self) -> serde_json::Value {
        // Serializing a struct of strings and JSON values cannot fail.
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }
}

/// A compiled chat template, with the special-token variables (`bos_token`,
/// `eos_token`, ...) transformers passes to every render.
pub struct ChatTemplate {
    env: Environment<'static>,
    name: String,
    source: String,
    special_tokens: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("name", &self.name)
            .field("source_len", &self.source.len())
            .field("special_tokens", &self.special_tokens)
            .finish()
    }
}

/// The error a template's `raise_exception(message)` produces, found again in the
/// source chain of the render error to report it as [`TextError::TemplateRaised`].
#[derive(Debug)]
struct RaisedByTemplate(String);

impl std::fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedByTemplate {}

/// Template variables a caller's `extra` may not set: transformers passes these itself
/// and Python rejects a second value for them.
const RESERVED_VARIABLES: [&str; 3] = ["messages", "tools", "add_generation_prompt"];

/// Names under which a message's reasoning may arrive; transformers copies the first
/// present one to `thinking` (first key) and `reasoning_content` (last key).
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

impl ChatTemplate {
    /// Compiles `source`, with `bos_token`/`eos_token` as template variables.
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TextError> {
        let mut special = Vec::new();
        if let Some(b) = bos_token {
            special.push(("bos_token".to_string(), b));
        }
        if let Some(e) = eos_token {
            special.push(("eos_token".to_string(), e));
        }
        Self::with_special_tokens("chat_template", source, special)
    }

    /// Compiles `source` under `name` (used in errors, e.g. the file it came from), with
    /// `special_tokens` as template variables (`("bos_token", "<s>")`, ...).
    pub fn with_special_tokens(
        name: &str,
        source: &str,
        special_tokens: Vec<(String, String)>,
    ) -> Result<Self, TextError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_formatter(python_formatter);
        env.set_unknown_method_callback(python_methods);
        env.add_filter("tojson", tojson_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", |format: String| -> String {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs() as i64)
                .unwrap_or(0);
            strftime(&format, now)
        });
        env.add_template_owned(name.to_string(), source.to_string())
            .map_err(|e| TextError::TemplateSyntax {
                template: name.to_string(),
                line: e.line().unwrap_or(0),
                message: error_message(&e),
            })?;
        Ok(ChatTemplate {
            env,
            name: name.to_string(),
            source: source.to_string(),
            special_tokens,
        })
    }

    /// The template's name as used in errors.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The template source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders like transformers' `apply_chat_template(messages, tools=tools,
    /// add_generation_prompt=..., tokenize=False, **extra)`: messages are JSON objects
    /// (keys whose value is null are dropped), `tools` JSON schemas, `extra` further
    /// template variables (they override the special tokens; `documents` is passed as
    /// the documents variable). Encode the result with `add_special_tokens = false`.
    pub fn render(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
        extra: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<String, TextError> {
        let mut chat = Vec::with_capacity(messages.len());
        for (i, message) in messages.iter().enumerate() {
            chat.push(self.normalize_message(i, message)?);
        }
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        for (k, v) in &self.special_tokens {
            ctx.insert(k.clone(), Value::from(v.as_str()));
        }
        ctx.insert("documents".to_string(), Value::from(()));
        if let Some(extra) = extra {
            for (k, v) in extra {
                if RESERVED_VARIABLES.contains(&k.as_str()) {
                    return Err(TextError::InvalidChatInput {
                        template: self.name.clone(),
                        what: format!("extra variable {k:?} is set by the renderer itself"),
                    });
                }
                ctx.insert(k.clone(), Value::from_serialize(v));
            }
        }
        ctx.insert("messages".to_string(), Value::from(chat));
        ctx.insert(
            "tools".to_string(),
            match tools {
                Some(t) => Value::from_serialize(t),
                None => Value::from(()),
            },
        );
        ctx.insert(
            "add_generation_prompt".to_string(),
            Value::from(add_generation_prompt),
        );
        let template = self
            .env
            .get_template(&self.name)
            .map_err(|e| self.render_error(e))?;
        template.render(ctx).map_err(|e| self.render_error(e))
    }

    /// Like [`ChatTemplate::render`] with typed messages.
    pub fn render_messages(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
        extra: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<String, TextError> {
        let values: Vec<serde_json::Value> = messages.iter().map(ChatMessage::to_value).collect();
        self.render(&values, tools, add_generation_prompt, extra)
    }

    /// transformers' `_normalize_chat_messages` and `_alias_reasoning_fields`.
    fn normalize_message(
        &self,
        index: usize,
        message: &serde_json::Value,
    ) -> Result<Value, TextError> {
        let obj = message
            .as_object()
            .ok_or_else(|| TextError::InvalidChatInput {
                template: self.name.clone(),
                what: format!("message {index} is not a JSON object"),
            })?;
        let kept: Vec<(&String, &serde_json::Value)> =
            obj.iter().filter(|(_, v)| !v.is_null()).collect();
        let reasoning = REASONING_FIELDS
            .iter()
            .find_map(|f| obj.get(*f).filter(|v| !v.is_null()));
        let mut pairs: Vec<(Value, Value)> = Vec::with_capacity(kept.len() + 2);
        if let Some(r) = reasoning {
            pairs.push((Value::from("thinking"), Value::from_serialize(r)));
        }
        let mut has_reasoning_content = false;
        for (k, v) in kept {
            match (reasoning, k.as_str()) {
                // Python's `{"thinking": r, **message, "reasoning_content": r}`: an existing
                // key keeps its position and takes the later value.
                (Some(_), "thinking") => pairs[0].1 = Value::from_serialize(v),
                (Some(r), "reasoning_content") => {
                    has_reasoning_content = true;
                    pairs.push((Value::from("reasoning_content"), Value::from_serialize(r)));
                }
                _ => pairs.push((Value::from(k.as_str()), Value::from_serialize(v))),
            }
        }
        if let Some(r) = reasoning.filter(|_| !has_reasoning_content) {
            pairs.push((Value::from("reasoning_content"), Value::from_serialize(r)));
        }
        Ok(Value::from_iter(pairs))
    }

    fn render_error(&self, e: Error) -> TextError {
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
        while let Some(s) = source {
            if let Some(raised) = s.downcast_ref::<RaisedByTemplate>() {
                return TextError::TemplateRaised {
                    template: self.name.clone(),
                    message: raised.0.clone(),
                };
            }
            source = s.source();
        }
        if e.kind() == ErrorKind::SyntaxError {
            return TextError::TemplateSyntax {
                template: self.name.clone(),
                line: e.line().unwrap_or(0),
                message: error_message(&e),
            };
        }
        TextError::TemplateRender {
            template: self.name.clone(),
            line: e.line(),
            message: error_message(&e),
        }
    }
}

fn error_message(e: &Error) -> String {
    match e.detail() {
        Some(d) => format!("{}: {}", e.kind(), d),
        None => e.kind().to_string(),
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone())
        .with_source(RaisedByTemplate(message)))
}

// ---------------------------------------------------------------------------------
// Python's str() and repr() of template values.

/// Prints `{{ value }}` as jinja2 does, i.e. with Python's `str()`: strings as they
/// are, `True`/`False`/`None`, containers with `repr()` of their items; undefined
/// prints nothing. No autoescaping (transformers' environment has none).
fn python_formatter(
    out: &mut minijinja::Output,
    _state: &State,
    value: &Value,
) -> Result<(), Error> {
    let mut s = String::new();
    python_str(value, &mut s);
    out.write_str(&s).map_err(Error::from)
}

fn python_str(value: &Value, out: &mut String) {
    match value.kind() {
        ValueKind::String => out.push_str(value.as_str().unwrap_or_default()),
        ValueKind::Undefined => {}
        _ => python_repr(value, out),
    }
}

fn python_repr(value: &Value, out: &mut String) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => {
            if value.is_integer() {
                let _ = write!(out, "{value}");
            } else {
                match f64::try_from(value.clone()) {
                    Ok(f) => python_float_repr(f, out),
                    Err(_) => {
                        let _ = write!(out, "{value}");
                    }
                }
            }
        }
        ValueKind::String => python_str_repr(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            if let Ok(iter) = value.try_iter() {
                for (i, item) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    python_repr(&item, out);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(iter) = value.try_iter() {
                for (i, key) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    python_repr(&key, out);
                    out.push_str(": ");
                    python_repr(&value.get_item(&key).unwrap_or_default(), out);
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `float.__repr__`: the shortest digits that round-trip (as Rust's), laid
/// out positionally for decimal exponents in [-4, 16), else as `d.ddde+XX`.
fn python_float_repr(f: f64, out: &mut String) {
    if f.is_nan() {
        out.push_str("nan");
        return;
    }
    if f.is_infinite() {
        out.push_str(if f > 0.0 { "inf" } else { "-inf" });
        return;
    }
    // `{:e}` gives the shortest round-trip digits: "-1.5e-7", "1e16", "0e0".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    out.push_str(sign);
    if (-4..16).contains(&exp) {
        if exp < 0 {
            out.push_str("0.");
            for _ in 0..(-exp - 1) {
                out.push('0');
            }
            out.push_str(&digits);
        } else {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                for _ in digits.len()..int_len {
                    out.push('0');
                }
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
}

/// Whether Python's `str.isprintable()` is false for `c` (other than ASCII controls,
/// handled by the caller): separators, format characters, C1 controls, private use.
fn python_non_printable(c: char) -> bool {
    matches!(c as u32,
        0x80..=0xA0 | 0xAD | 0x1680 | 0x2000..=0x200F | 0x2028..=0x202F | 0x205F..=0x2064
        | 0x2066..=0x206F | 0x3000 | 0xD800..=0xF8FF | 0xFEFF | 0xFFF9..=0xFFFB
        | 0xF0000..=0x10FFFF)
}

/// Python's `repr(str)`: single quotes unless the text holds `'` and no `"`.
fn python_str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7F => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if python_non_printable(c) => {
                let v = c as u32;
                let _ = if v < 0x100 {
                    write!(out, "\\x{v:02x}")
                } else if v < 0x10000 {
                    write!(out, "\\u{v:04x}")
                } else {
                    write!(out, "\\U{v:08x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

// ---------------------------------------------------------------------------------
// tojson: Python's json.dumps(x, ensure_ascii=False, indent=None, separators=None,
// sort_keys=False), the filter transformers installs.

struct JsonOptions {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// `tojson(ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, by
/// position or by keyword, as Python's signature allows.
fn tojson_filter(value: Value, args: Rest<Value>) -> Result<String, Error> {
    #[allow(clippy::type_complexity)]
    let (ensure_ascii, indent, separators, sort_keys, kwargs): (
        Option<Value>,
        Option<Value>,
        Option<Value>,
        Option<Value>,
        Kwargs,
    ) = from_args(&args)?;
    let pick = |pos: Option<Value>, name: &str| -> Result<Option<Value>, Error> {
        let kw: Option<Value> = kwargs.get(name)?;
        if pos.is_some() && kw.is_some() {
            return Err(Error::new(
                ErrorKind::TooManyArguments,
                format!("tojson got multiple values for argument '{name}'"),
            ));
        }
        Ok(pos.or(kw).filter(|v| !v.is_none() && !v.is_undefined()))
    };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = match pick(indent, "indent")? {
        None => None,
        Some(v) if v.kind() == ValueKind::String => {
            Some(v.as_str().unwrap_or_default().to_string())
        }
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.max(0) as usize)),
            None => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "tojson: indent must be an integer or a string, not {}",
                        v.kind()
                    ),
                ))
            }
        },
    };
    let (item_sep, key_sep) = match pick(separators, "separators")? {
        Some(v) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match (
                parts.first().and_then(|p| p.as_str()),
                parts.get(1).and_then(|p| p.as_str()),
            ) {
                (Some(a), Some(b)) if parts.len() == 2 => (a.to_string(), b.to_string()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
        // Python's defaults: ", " without indent, "," with it (no trailing spaces).
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let sort_keys = pick(sort_keys, "sort_keys")?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let opts = JsonOptions {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    let mut out = String::new();
    json_dump(&value, &opts, 0, &mut out)?;
    Ok(out)
}

fn json_newline(opts: &JsonOptions, level: usize, out: &mut String) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn json_dump(
    value: &Value,
    opts: &JsonOptions,
    level: usize,
    out: &mut String,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                let _ = write!(out, "{value}");
            } else {
                let f = f64::try_from(value.clone())?;
                if f.is_nan() {
                    out.push_str("NaN");
                } else if f.is_infinite() {
                    out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
                } else {
                    python_float_repr(f, out);
                }
            }
        }
        ValueKind::String => {
            json_string(value.as_str().unwrap_or_default(), opts.ensure_ascii, out)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                json_newline(opts, level + 1, out);
                json_dump(item, opts, level + 1, out)?;
            }
            json_newline(opts, level, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in value.try_iter()? {
                let v = value.get_item(&key)?;
                entries.push((json_key(&key)?, v));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (i, (k, v)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                json_newline(opts, level + 1, out);
                json_string(k, opts.ensure_ascii, out);
                out.push_str(&opts.key_sep);
                json_dump(v, opts, level + 1, out)?;
            }
            json_newline(opts, level, out);
            out.push('}');
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: object of type {kind} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

/// Python's json converts str, int, float, bool and None keys to strings.
fn json_key(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::None => "null".to_string(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_string(),
        ValueKind::Number => {
            let mut s = String::new();
            python_repr(key, &mut s);
            s
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
            ))
        }
    })
}

/// Python's JSON string escaping: `"` `\` and controls below 0x20 always; with
/// `ensure_ascii`, every non-ASCII character as `\uXXXX` (surrogate pairs above the BMP).
fn json_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7E => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

// ---------------------------------------------------------------------------------
// Python methods on values: minijinja-contrib's pycompat plus the few it lacks.

fn python_methods(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(s) = value.as_str().filter(|_| value.kind() == ValueKind::String) {
        match method {
            "isdigit" | "isdecimal" | "isnumeric" if args.is_empty() => {
                return Ok(Value::from(
                    !s.is_empty() && s.chars().all(|c| c.is_numeric()),
                ));
            }
            "removeprefix" | "removesuffix" => {
                let [affix] = args else {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        format!("{method}() takes one argument"),
                    ));
                };
                let affix = affix.as_str().unwrap_or_default();
                let out = if method == "removeprefix" {
                    s.strip_prefix(affix)
                } else {
                    s.strip_suffix(affix)
                };
                return Ok(Value::from(out.unwrap_or(s)));
            }
            "rsplit" => return python_rsplit(s, args),
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Python's `str.rsplit(sep=None, maxsplit=-1)`.
fn python_rsplit(s: &str, args: &[Value]) -> Result<Value, Error> {
    let sep = args
        .first()
        .filter(|v| !v.is_none())
        .map(|v| v.as_str().unwrap_or_default().to_string());
    let maxsplit = args.get(1).and_then(Value::as_i64).unwrap_or(-1);
    if args.len() > 2 {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "rsplit() takes at most 2 arguments",
        ));
    }
    let limit = if maxsplit < 0 {
        usize::MAX
    } else {
        maxsplit as usize
    };
    let mut parts: Vec<String> = match &sep {
        Some(sep) if sep.is_empty() => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "rsplit(): empty separator",
            ));
        }
        Some(sep) => {
            let mut v: Vec<String> = Vec::new();
            let mut rest = s;
            while v.len() < limit {
                match rest.rfind(sep.as_str()) {
                    Some(i) => {
                        v.push(rest[i + sep.len()..].to_string());
                        rest = &rest[..i];
                    }
                    None => break,
                }
            }
            v.push(rest.to_string());
            v
        }
        None => {
            let mut v: Vec<String> = Vec::new();
            let mut rest = s.trim_end();
            while !rest.is_empty() {
                if v.len() == limit {
                    v.push(rest.to_string());
                    rest = "";
                    break;
                }
                match rest.rfind(char::is_whitespace) {
                    Some(i) => {
                        let ws_len = rest[i..].chars().next().map_or(1, char::len_utf8);
                        v.push(rest[i + ws_len..].to_string());
                        rest = rest[..i].trim_end();
                    }
                    None => {
                        v.push(rest.to_string());
                        rest = "";
                    }
                }
            }
            let _ = rest;
            v
        }
    };
    parts.reverse();
    Ok(Value::from(parts))
}

// ---------------------------------------------------------------------------------
// strftime for `strftime_now`, as glibc formats a naive datetime.

const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// Civil date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

/// Formats `unix_secs` (UTC) with a C/Python `strftime` format. Supports the codes
/// chat templates use (`%d %b %Y`, `%B`, `%A`, `%H:%M:%S`, ...) and glibc's `-` flag
/// (no padding); `%Z`/`%z` print nothing, as for Python's naive `datetime.now()`.
/// Unknown codes are copied through, as glibc does.
pub(crate) fn strftime(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, (secs / 60) % 60, secs % 60);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday (Mon = 0)
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[month as usize - 1] + day as i64 + i64::from(month > 2 && is_leap(year));
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let Some(code) = chars.next() else {
            out.push('%');
            if no_pad {
                out.push('-');
            }
            break;
        };
        let num = |out: &mut String, v: i64, width: usize| {
            if no_pad {
                let _ = write!(out, "{v}");
            } else {
                let _ = write!(out, "{v:0width$}");
            }
        };
        match code {
            'Y' => {
                let _ = write!(out, "{year}");
            }
            'y' => num(&mut out, year.rem_euclid(100), 2),
            'm' => num(&mut out, i64::from(month), 2),
            'd' => num(&mut out, i64::from(day), 2),
            'e' => {
                if no_pad {
                    let _ = write!(out, "{day}");
                } else {
                    let _ = write!(out, "{day:>2}");
                }
            }
            'H' => num(&mut out, hour, 2),
            'I' => num(&mut out, hour12, 2),
            'M' => num(&mut out, minute, 2),
            'S' => num(&mut out, second, 2),
            'j' => num(&mut out, yday, 3),
            'p' => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            'a' => out.push_str(&WEEKDAYS[weekday][..3]),
            'A' => out.push_str(WEEKDAYS[weekday]),
            'b' | 'h' => out.push_str(&MONTHS[month as usize - 1][..3]),
            'B' => out.push_str(MONTHS[month as usize - 1]),
            'u' => {
                let _ = write!(out, "{}", weekday + 1);
            }
            'w' => {
                let _ = write!(out, "{}", (weekday + 1) % 7);
            }
            'F' => {
                let _ = write!(out, "{year}-{month:02}-{day:02}");
            }
            'D' | 'x' => {
                let _ = write!(out, "{month:02}/{day:02}/{:02}", year.rem_euclid(100));
            }
            'T' | 'X' => {
                let _ = write!(out, "{hour:02}:{minute:02}:{second:02}");
            }
            'R' => {
                let _ = write!(out, "{hour:02}:{minute:02}");
            }
            'c' => {
                let _ = write!(
                    out,
                    "{} {} {day:>2} {hour:02}:{minute:02}:{second:02} {year}",
                    &WEEKDAYS[weekday][..3],
                    &MONTHS[month as usize - 1][..3]
                );
            }
            'n' => out.push('\n'),
            't' => out.push('\t'),
            '%' => out.push('%'),
            'Z' | 'z' => {}
            other => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render_one(src: &str, ctx: serde_json::Value) -> Result<String, TextError> {
        let t = ChatTemplate::new(src, Some("<s>".into()), Some("</s>".into()))?;
        let extra = ctx.as_object().cloned().unwrap_or_default();
        t.render(
            &[json!({"role": "user", "content": "hi"})],
            None,
            false,
            Some(&extra),
        )
    }

    #[test]
    fn strftime_matches_python_reference() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/text/strftime.json"
        );
        let cases: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert!(cases.len() >= 30);
        for c in cases {
            let ts = c["timestamp"].as_i64().unwrap();
            let fmt = c["format"].as_str().unwrap();
            assert_eq!(
                strftime(fmt, ts),
                c["expected"].as_str().unwrap(),
                "{fmt} at {ts}"
            );
        }
    }

    #[test]
    fn strftime_now_renders_current_year() {
        let year = strftime(
            "%Y",
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_secs() as i64,
        );
        assert_eq!(
            render_one("{{ strftime_now('%Y') }}", json!({})).unwrap(),
            year
        );
        assert!(year.parse::<i32>().unwrap() >= 2025);
    }

    #[test]
    fn float_repr_is_pythons() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (1e16, "1e+16"),
            (1.5e-7, "1.5e-07"),
            (123456789.0, "123456789.0"),
            (-0.0, "-0.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1234567890123456.7, "1234567890123456.8"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (0.1 + 0.2, "0.30000000000000004"),
            (5e-324, "5e-324"),
        ];
        for (f, want) in cases {
            let mut s = String::new();
            python_float_repr(f, &mut s);
            assert_eq!(s, want, "{f:e}");
        }
    }

    #[test]
    fn str_repr_quotes_like_python() {
        let mut s = String::new();
        python_str_repr("it's", &mut s);
        assert_eq!(s, "\"it's\"");
        s.clear();
        python_str_repr("a'b\"c\\\n\u{7}\u{a0}é", &mut s);
        assert_eq!(s, "'a\\'b\"c\\\\\\n\\x07\\xa0é'");
    }

    #[test]
    fn syntax_error_names_template_and_line() {
        let err = ChatTemplate::with_special_tokens(
            "t.jinja",
            "line one\n{% if x %}\n{{ y }",
            Vec::new(),
        )
        .unwrap_err();
        match err {
            TextError::TemplateSyntax { template, line, .. } => {
                assert_eq!(template, "t.jinja");
                assert_eq!(line, 3);
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn generation_tag_is_a_syntax_error_not_a_wrong_render() {
        let err =
            ChatTemplate::new("{% generation %}x{% endgeneration %}", None, None).unwrap_err();
        assert!(
            matches!(err, TextError::TemplateSyntax { line: 1, .. }),
            "{err}"
        );
    }

    #[test]
    fn raise_exception_is_typed() {
        let err = render_one("{{ raise_exception('no system role') }}", json!({})).unwrap_err();
        match err {
            TextError::TemplateRaised { message, .. } => assert_eq!(message, "no system role"),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn render_error_has_line() {
        let err = render_one("ok\n{{ messages[0].content + 1 }}", json!({})).unwrap_err();
        assert!(
            matches!(err, TextError::TemplateRender { line: Some(2), .. }),
            "{err}"
        );
    }

    #[test]
    fn reserved_extra_is_rejected() {
        let err = render_one("x", json!({"messages": []})).unwrap_err();
        assert!(matches!(err, TextError::InvalidChatInput { .. }), "{err}");
    }

    #[test]
    fn non_object_message_is_rejected() {
        let t = ChatTemplate::new("x", None, None).unwrap();
        let err = t.render(&[json!("hello")], None, false, None).unwrap_err();
        assert!(
            err.to_string().contains("message 0 is not a JSON object"),
            "{err}"
        );
    }

    #[test]
    fn null_keys_are_dropped_and_reasoning_aliased() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m.keys() | list }}|{{ m.thinking }}|{{ 'content' in m }}\n{% endfor %}",
            None,
            None,
        )
        .unwrap();
        let out = t
            .render(
                &[
                    json!({"role": "assistant", "content": null, "reasoning": "why"}),
                    json!({"role": "user", "content": "x"}),
                ],
                None,
                false,
                None,
            )
            .unwrap();
        assert_eq!(
            out,
            "['thinking', 'role', 'reasoning', 'reasoning_content']|why|False\n['role', 'content']||True\n"
        );
    }

    #[test]
    fn rsplit_matches_python() {
        let t = ChatTemplate::new(
            "{{ 'a b  c '.rsplit() }}{{ 'a b c'.rsplit(none, 1) }}{{ 'a--b--c'.rsplit('--') }}{{ 'x'.rsplit('-', 0) }}",
            None,
            None,
        )
        .unwrap();
        let out = t.render(&[], None, false, None).unwrap();
        assert_eq!(out, "['a', 'b', 'c']['a b', 'c']['a', 'b', 'c']['x']");
    }

    #[test]
    fn tojson_takes_pythons_positional_order_and_rejects_unknown_kwargs() {
        let out = render_one("{{ {'a': 'é'} | tojson(true, 1) }}", json!({})).unwrap();
        assert_eq!(out, "{\n \"a\": \"\\u00e9\"\n}");
        let err = render_one("{{ 1 | tojson(indnt=2) }}", json!({})).unwrap_err();
        assert!(matches!(err, TextError::TemplateRender { .. }), "{err}");
        let err = render_one("{{ 1 | tojson(4, ensure_ascii=true) }}", json!({})).unwrap_err();
        assert!(err.to_string().contains("multiple values"), "{err}");
    }

    #[test]
    fn templates_and_tokenizers_are_shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
        assert_send_sync::<super::super::Tokenizer>();
    }

    #[test]
    fn chat_message_serializes_without_nones() {
        let m = ChatMessage::new("user", "hello");
        assert_eq!(m.to_value(), json!({"role": "user", "content": "hello"}));
        let parsed: ChatMessage = serde_json::from_value(
            json!({"role": "tool", "content": "r", "tool_call_id": "c1", "x": 1}),
        )
        .unwrap();
        assert_eq!(parsed.tool_call_id.as_deref(), Some("c1"));
        assert_eq!(parsed.extra["x"], json!(1));
    }
}
