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
//!
//! Layout, one direction: [`spec`] (the tools offered and the calls made) <-
//! [`format`] (the formats and their grammars) <- [`parse`] (calls found in output),
//! [`stream`] (forced calls streamed as written), [`gate`] (how much output may
//! stream while calls may come); [`response_format`] (structured output) stands
//! alone. Nothing here imports the rest of the server but its errors, body helpers
//! and ids.

mod format;
mod gate;
mod parse;
mod response_format;
mod spec;
mod stream;

pub use format::ToolFormat;
#[cfg(test)]
use format::{HERMES, LLAMA3_JSON, MISTRAL};
pub use gate::{text_after, CallGate};
pub use parse::{is_number_overflow, validated_call, ToolParser};
pub use response_format::ResponseFormat;
pub use spec::{
    empty_parameters, history_arguments, is_valid_tool_name, ToolCall, ToolChoice, ToolRequest,
    ToolSpec,
};
pub use stream::{adopt_streamed, CallPiece, CallStreamer};

#[cfg(test)]
mod tests;
