//! The tools a request offers, the choice of calls, and the calls made.

use libvoom::constrain::{Grammar, JsonValidator};
use serde_json::{json, Map, Value};

use crate::serve::error::ApiError;
use crate::serve::request::kind;

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
            // Both checkers of the arguments compile now: the grammar that forces
            // them and the validator that checks them (which refuses, say, a
            // `pattern` past the regex engine's limits).
            Grammar::json_schema(&t.parameters)
                .map(|_| ())
                .and_then(|()| JsonValidator::new(&t.parameters).map(|_| ()))
                .map_err(|e| {
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
