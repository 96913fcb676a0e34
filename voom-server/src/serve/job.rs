//! The job types that prepare hands to the worker, and what the worker sends back.

use std::sync::Arc;
use std::time::Instant;

use libvoom::constrain::{GrammarMatcher, JsonValidator};
use libvoom::engine::GenerateParams;
use serde_json::Value;
use tokio::sync::mpsc::UnboundedSender;

use super::catalog::ModelMeta;
use super::error::ApiError;
use super::harmony::HarmonyOutput;
use super::tools::{ToolCall, ToolParser};

/// The grammar of one request's output.
pub struct OutputGrammar {
    /// A matcher at the grammar's start.
    pub matcher: GrammarMatcher,
    /// The end-of-sequence ids it was compiled with (the engine must stop on
    /// exactly these).
    pub eos: Vec<u32>,
    /// The request field the grammar comes from (`response_format`, `tools`): the
    /// one an error of the grammar names.
    pub param: &'static str,
}

/// A request ready to queue.
pub struct Prepared {
    pub meta: Arc<ModelMeta>,
    pub prompt_ids: Vec<u32>,
    pub params: GenerateParams,
    pub stop: Vec<String>,
    /// The grammar the output must follow (forced tool calls, a response format),
    /// checked at its start before the request was queued.
    pub grammar: Option<OutputGrammar>,
    /// How to find tool calls in the output (tools offered, choice not none).
    pub tools: Option<ToolParser>,
    /// What the text output is validated against (a JSON response format's schema,
    /// compiled).
    pub json_schema: Option<JsonValidator>,
    /// The model writes harmony (gpt-oss): its output is read as reasoning, content
    /// and calls ([`super::harmony`]); `tools` is None then.
    pub harmony: Option<HarmonyOutput>,
}

/// One generation request, ready for the engine: the prompt is already tokens.
pub struct Job {
    pub request: Prepared,
    pub events: UnboundedSender<Event>,
    pub enqueued: Instant,
}

/// Why generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// The model produced an end-of-sequence token.
    Eos,
    /// One of the request's stop sequences appeared (it is not in the text).
    StopSequence(String),
    /// The token limit (or the context) was reached.
    Length,
    /// The output ended with tool calls (see [`Outcome::tool_calls`]).
    ToolCalls,
}

/// The end of a request that ran.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub finish: Finish,
    pub prompt_tokens: usize,
    /// Total generated tokens, `reasoning_tokens` included.
    pub completion_tokens: usize,
    /// Of `completion_tokens`, those of a harmony model's reasoning (analysis)
    /// messages, their framing markers included ([`super::harmony`]: from a
    /// message's start to its `<|end|>`); 0 for a model without a reasoning format.
    pub reasoning_tokens: usize,
    /// Every piece sent, concatenated (the assistant text without tool calls).
    pub text: String,
    /// The reasoning sent ([`Event::Reasoning`]), concatenated; empty for a model
    /// without a reasoning format.
    pub reasoning: String,
    /// The tool calls found in the output, in order.
    pub tool_calls: Vec<ToolCall>,
    /// How many calls were streamed as they were written ([`Event::CallStart`]);
    /// they are the first of `tool_calls` (a streamed call cut by the token limit
    /// is not among them).
    pub streamed_calls: usize,
    pub queue_secs: f64,
    pub prefill_secs: f64,
    pub decode_secs: f64,
    /// Forward passes of decode, and what a drafter did (speculative decoding).
    pub decode_passes: usize,
    pub speculation: Option<libvoom::speculate::SpecReport>,
    /// Prompt tokens taken from a prefix computed before (prompt-prefix reuse).
    pub prefix_reused: usize,
}

impl Outcome {
    /// A request that ran with `finish` after `completion_tokens` of text `text`,
    /// from a prompt of 3 tokens, nothing else (for the dialects' tests).
    #[cfg(test)]
    pub fn for_test(finish: Finish, completion_tokens: usize, text: &str) -> Outcome {
        Outcome {
            finish,
            prompt_tokens: 3,
            completion_tokens,
            reasoning_tokens: 0,
            text: text.into(),
            reasoning: String::new(),
            tool_calls: vec![],
            streamed_calls: 0,
            queue_secs: 0.0,
            prefill_secs: 0.0,
            decode_secs: 0.0,
            decode_passes: 0,
            prefix_reused: 0,
            speculation: None,
        }
    }

    /// Where the request's time went, as every dialect reports it in its `voom` object.
    pub fn timings(&self) -> Value {
        serde_json::json!({
            "queue_secs": self.queue_secs,
            "prefill_secs": self.prefill_secs,
            "decode_secs": self.decode_secs,
            "decode_passes": self.decode_passes,
            "prefix_tokens_reused": self.prefix_reused,
            "speculation": self.speculation.as_ref().map(crate::cli::common::speculation_json),
        })
    }
}

pub enum Event {
    /// More output text.
    Text(String),
    /// More reasoning (a harmony model's analysis channel), apart from the text.
    Reasoning(String),
    /// A forced tool call begins ([`super::tools::CallStreamer`]): calls are numbered from 0
    /// in output order; its id is the one the finished call keeps.
    CallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// More of call `index`'s arguments: JSON text, joining to the call's
    /// [`ToolCall::arguments_json`].
    CallArgs { index: usize, text: String },
    /// The request finished; no events follow.
    Done(Outcome),
    /// The request failed; no events follow.
    Failed(ApiError),
}
