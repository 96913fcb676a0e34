//! Structured output: what the output must be, beside tool calls.

use libvoom::constrain::{Grammar, JsonWhitespace};
use serde_json::{json, Value};

use crate::serve::error::ApiError;

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
