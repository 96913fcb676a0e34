//! Finding tool calls in free output (`tool_choice` auto, and forced output checked
//! at the end).

use libvoom::constrain::validate_json;
use serde_json::{json, Value};

use super::format::{Layout, ToolFormat};
use super::spec::{ToolCall, ToolSpec};
use crate::serve::ids::new_id;
use crate::serve::request::kind;

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
                        p.unrepresentable |= is_number_overflow(&e);
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
                                p.unrepresentable |= is_number_overflow(e);
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
                                p.unrepresentable |= is_number_overflow(e);
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
        validated_call(tools, name, args)
    }
}

/// A call to `name` with `args`, if `name` is one of `tools` and `args` is an object
/// valid against its schema; else why not.
pub fn validated_call(tools: &[ToolSpec], name: &str, args: Value) -> Result<ToolCall, String> {
    let tool = tools
        .iter()
        .find(|t| t.name == name)
        .ok_or_else(|| format!("a call to '{name}', which is not an offered tool"))?;
    if !args.is_object() {
        return Err(format!(
            "the arguments of '{name}' must be a JSON object, not {}",
            kind(&args)
        ));
    }
    validate_json(&tool.parameters, &args)
        .map_err(|e| format!("the arguments of '{name}' do not match its schema: {e}"))?;
    Ok(ToolCall {
        id: new_id("call_"),
        name: name.to_string(),
        arguments: args,
        arguments_text: None,
    })
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

/// Whether `e` is serde_json refusing a number too large for an f64 (valid JSON that
/// it cannot represent).
pub fn is_number_overflow(e: &serde_json::Error) -> bool {
    e.to_string().starts_with("number out of range")
}
