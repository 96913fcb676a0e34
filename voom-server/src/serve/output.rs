//! One request's output side: its ids become text pieces (detokenized, cut at its
//! stop sequences, held back where a tool call may be starting, or streamed as calls
//! when calls are forced) sent over its channel as they come; at the end, the tool
//! calls parsed and the JSON output validated. The worker runs one of these per
//! request in its batch ([`super::worker`]).

use std::ops::ControlFlow;
use std::time::Instant;

use libvoom::engine::{FinishReason, Generation};
use libvoom::text::{StreamDecoder, Tokenizer};
use serde_json::Value;

use super::error::ApiError;
use super::harmony::{HarmonyParser, Piece, TokenOffsets};
use super::ids::new_id;
use super::job::{Event, Finish, Job, Outcome};
use super::stop::StopScanner;
use super::tools::{
    adopt_streamed, is_number_overflow, text_after, validated_call, CallGate, CallPiece,
    CallStreamer, ToolCall,
};

/// How a request's output ended, for the worker.
pub enum Ended {
    /// It ran to its end: the outcome to send.
    Done(Box<Outcome>),
    /// Its client went away (the work is counted, nothing is sent).
    Gone,
}

/// A request's output in progress.
pub struct Output<'t> {
    pub job: Job,
    eos: Vec<u32>,
    dec: StreamDecoder<'t>,
    out: StopScanner,
    /// With tools, text streams until a call may be starting; from there on output
    /// is held back, because calls are only known at the end.
    gate: Option<CallGate>,
    /// Forced calls stream as they are written (the grammar admits only valid ones).
    calls: Option<CallStreamer>,
    call_ids: Vec<String>,
    /// A harmony model's output is read as reasoning, content and calls.
    harmony: Option<HarmonyParser>,
    /// Where each generated id's text begins (a harmony model's), to count the
    /// reasoning's tokens.
    offsets: TokenOffsets,
    reasoning: String,
    /// Harmony calls taken, and why calls were left as text.
    harmony_calls: Vec<ToolCall>,
    harmony_rejected: Vec<String>,
    text: String,
    gone: bool,
    failure: Option<ApiError>,
    pub queue_secs: f64,
    /// The request field its grammar came from, for errors of the grammar.
    pub grammar_param: Option<&'static str>,
}

impl<'t> Output<'t> {
    /// The output side of `job`, which left the queue now, on a model with tokenizer
    /// `tok` and end-of-sequence ids `eos`.
    pub fn new(
        job: Job,
        tok: &'t Tokenizer,
        eos: Vec<u32>,
        grammar_param: Option<&'static str>,
    ) -> Self {
        let queue_secs = (Instant::now() - job.enqueued).as_secs_f64();
        let tools = job.request.tools.as_ref();
        let gate = tools.map(|t| CallGate::new(t.format, t.forced));
        let calls = tools
            .filter(|t| t.forced)
            .map(|t| CallStreamer::new(t.format));
        let harmony = job.request.harmony.as_ref().map(|_| HarmonyParser::new());
        // Harmony's markers are special tokens: kept to be read.
        let keep_special = harmony.is_some() || tools.is_some_and(|t| t.format.keep_special_tokens);
        // Stop sequences cut text. A forced call is no text (its grammar ends it), so
        // they do not apply there: a `stop` of "\n" or "Observation:", as agent loops
        // pass, would otherwise cut every call.
        let forced = tools.is_some_and(|t| t.forced)
            || job.request.harmony.as_ref().is_some_and(|h| h.forced);
        let out = StopScanner::new(if forced { &[] } else { &job.request.stop });
        Output {
            eos,
            dec: StreamDecoder::new(tok, !keep_special),
            out,
            gate,
            calls,
            call_ids: Vec::new(),
            harmony,
            offsets: TokenOffsets::default(),
            reasoning: String::new(),
            harmony_calls: Vec::new(),
            harmony_rejected: Vec::new(),
            text: String::new(),
            gone: false,
            failure: None,
            queue_secs,
            grammar_param,
            job,
        }
    }

    /// Whether its client went away.
    pub fn client_gone(&self) -> bool {
        self.gone || self.job.events.is_closed()
    }

    /// Sends a piece of text (and any call events it completes); false when the
    /// client is gone.
    fn send(&mut self, piece: &str) -> bool {
        if piece.is_empty() {
            return true;
        }
        if let Some(h) = self.harmony.as_mut() {
            let pieces = h.push(piece);
            return self.send_harmony(pieces);
        }
        self.text.push_str(piece);
        for p in self
            .calls
            .as_mut()
            .map(|c| c.push(piece))
            .unwrap_or_default()
        {
            let ev = match p {
                CallPiece::Start { index, name } => {
                    let id = new_id("call_");
                    self.call_ids.push(id.clone());
                    Event::CallStart { index, id, name }
                }
                CallPiece::Args { index, text } => Event::CallArgs { index, text },
            };
            if self.job.events.send(ev).is_err() {
                return false;
            }
        }
        let emit = match self.gate.as_mut() {
            Some(g) => g.push(piece),
            None => piece.to_string(),
        };
        if emit.is_empty() {
            return !self.job.events.is_closed();
        }
        self.job.events.send(Event::Text(emit)).is_ok()
    }

    /// Sends what a harmony model's output holds: reasoning and content as they
    /// come; a call when its message ends, if it is valid (else its message as
    /// written is content). False when the client is gone.
    fn send_harmony(&mut self, pieces: Vec<Piece>) -> bool {
        for p in pieces {
            let ev = match p {
                Piece::Reasoning(t) => {
                    self.reasoning.push_str(&t);
                    Event::Reasoning(t)
                }
                Piece::Content(t) => {
                    self.text.push_str(&t);
                    Event::Text(t)
                }
                Piece::Call {
                    name,
                    arguments,
                    raw,
                } => {
                    let tools = self
                        .job
                        .request
                        .harmony
                        .as_ref()
                        .map_or(&[][..], |h| &h.tools[..]);
                    let call = serde_json::from_str::<Value>(&arguments)
                        .map_err(|e| format!("the arguments of '{name}' are not JSON ({e})"))
                        .and_then(|args| validated_call(tools, &name, args));
                    match call {
                        Ok(mut c) => {
                            c.arguments_text = Some(c.arguments.to_string());
                            self.harmony_calls.push(c);
                            continue;
                        }
                        Err(why) => {
                            self.harmony_rejected.push(why);
                            self.text.push_str(&raw);
                            Event::Text(raw)
                        }
                    }
                }
            };
            if self.job.events.send(ev).is_err() {
                return false;
            }
        }
        true
    }

    /// Takes a generated id: `Break` stops its generation (a stop sequence, a
    /// client gone, an id that does not detokenize).
    pub fn on_token(&mut self, id: u32) -> ControlFlow<()> {
        if self.eos.contains(&id) && !self.job.request.params.ignore_eos {
            return ControlFlow::Continue(());
        }
        let piece = match self.dec.push(id) {
            Ok(p) => p,
            Err(e) => {
                self.failure = Some(ApiError::internal(format!("detokenizing: {e}")));
                return ControlFlow::Break(());
            }
        };
        if self.harmony.is_some() {
            self.offsets.token(&piece);
        }
        let (emit, stopped) = self.out.push(&piece);
        if !self.send(&emit) {
            self.gone = true;
            return ControlFlow::Break(());
        }
        if stopped {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    }

    /// The end of its generation `g`: the rest of the text sent, tool calls parsed,
    /// JSON output validated.
    pub fn finish(mut self, g: &Generation) -> Result<Ended, ApiError> {
        if let Some(e) = self.failure.take() {
            return Err(e);
        }
        if self.gone {
            return Ok(Ended::Gone);
        }
        let mut finish = match &self.out.stopped {
            Some(s) => Finish::StopSequence(s.clone()),
            None => {
                let rest = self
                    .dec
                    .finish()
                    .map_err(|e| ApiError::internal(format!("detokenizing: {e}")))?;
                self.offsets.text(&rest);
                let (emit, _) = self.out.push(&rest);
                let tail = if self.out.stopped.is_some() {
                    emit
                } else {
                    emit + &self.out.flush()
                };
                if !self.send(&tail) {
                    return Ok(Ended::Gone);
                }
                match (&self.out.stopped, g.finish) {
                    (Some(s), _) => Finish::StopSequence(s.clone()),
                    // A grammar's output is complete: as final as an end of sequence.
                    (None, FinishReason::Eos | FinishReason::Complete) => Finish::Eos,
                    (None, _) => Finish::Length,
                }
            }
        };
        let mut reasoning_tokens = 0;
        if let Some(mut h) = self.harmony.take() {
            let pieces = h.finish(finish == Finish::Eos);
            if !self.send_harmony(pieces) {
                return Ok(Ended::Gone);
            }
            // The ids whose text begins in a reasoning message (the end-of-sequence
            // id that stopped generation is no text: not counted).
            reasoning_tokens = self.offsets.count_in(h.reasoning_spans()).min(g.ids.len());
            let forced = self.job.request.harmony.as_ref().is_some_and(|h| h.forced);
            if forced && finish == Finish::Eos && self.harmony_calls.is_empty() {
                // The grammar admits only a well-formed call with valid arguments.
                return Err(ApiError::internal(format!(
                    "the forced tool call output did not parse ({}): {:?}",
                    self.harmony_rejected.join("; "),
                    self.text
                )));
            }
            if !self.harmony_rejected.is_empty() {
                tracing::debug!(
                    "tool calls left as text: {}",
                    self.harmony_rejected.join("; ")
                );
            }
            if !self.harmony_calls.is_empty() && finish == Finish::Eos {
                finish = Finish::ToolCalls;
            }
        }
        let mut tool_calls = std::mem::take(&mut self.harmony_calls);
        let mut streamed_calls = 0;
        let mut text = std::mem::take(&mut self.text);
        if let Some(tp) = &self.job.request.tools {
            let raw = std::mem::take(&mut text);
            let parsed = tp.parse(&raw);
            if tp.forced
                && finish == Finish::Eos
                && (parsed.calls.is_empty() || !parsed.rejected.is_empty())
                && !parsed.unrepresentable
            {
                // The grammar admits only well-formed calls with valid arguments.
                return Err(ApiError::internal(format!(
                    "the forced tool call output did not parse ({}): {raw:?}",
                    parsed.rejected.join("; ")
                )));
            }
            if !parsed.rejected.is_empty() {
                tracing::debug!("tool calls left as text: {}", parsed.rejected.join("; "));
            }
            tool_calls = parsed.calls;
            if let Some(cs) = &self.calls {
                streamed_calls =
                    adopt_streamed(cs, &self.call_ids, &mut tool_calls, finish == Finish::Eos)
                        .or_else(|e| {
                            if parsed.unrepresentable {
                                Ok(0)
                            } else {
                                Err(e)
                            }
                        })?;
            }
            // What was streamed is text before the first call; the rest of the content
            // follows it. Forced calls stream as calls: the output is only calls, and
            // what is left (a call cut by the token limit) is not text.
            let streamed = self.gate.as_ref().map_or(0, |g| g.streamed);
            let sent = raw.get(..streamed).unwrap_or(&raw);
            let rest = if streamed_calls > 0 {
                String::new()
            } else {
                text_after(sent, &parsed.content).ok_or_else(|| {
                    ApiError::internal("tool-call parsing changed text that was already streamed")
                })?
            };
            text = format!("{sent}{rest}");
            if !rest.is_empty() && self.job.events.send(Event::Text(rest)).is_err() {
                return Ok(Ended::Gone);
            }
            if !tool_calls.is_empty() && finish == Finish::Eos {
                finish = Finish::ToolCalls;
            }
        }
        if let Some(validator) = &self.job.request.json_schema {
            // Complete JSON output (not cut by a limit or a stop sequence, not calls)
            // must satisfy the schema the grammar enforced.
            if finish == Finish::Eos {
                match serde_json::from_str::<Value>(&text) {
                    Ok(v) => validator.validate(&v).map_err(|e| {
                        ApiError::internal(format!("the constrained output {e}: {text:?}"))
                    })?,
                    // Valid JSON whose number overflows an f64 (`1e400`): serde_json
                    // cannot hold it, so it cannot be checked; the grammar admitted it.
                    Err(e) if is_number_overflow(&e) => {
                        tracing::warn!("JSON output not validated: a number beyond f64 ({e})")
                    }
                    Err(e) => {
                        return Err(ApiError::internal(format!(
                            "the constrained output is not JSON ({e}): {text:?}"
                        )))
                    }
                }
            }
        }
        let meta = &self.job.request.meta;
        tracing::info!(
            "generated: model {}{} prompt {} tokens, completion {} tokens ({:?}); queue {:.3}s prefill {:.3}s decode {:.3}s ({:.1} tok/s)",
            meta.id,
            meta.scheme.as_ref().map_or(String::new(), |s| format!(" (lossy: {s})")),
            g.prompt_tokens,
            g.ids.len(),
            finish,
            self.queue_secs,
            g.prefill_secs,
            g.decode_secs,
            g.decode_tokens_per_sec()
        );
        Ok(Ended::Done(Box::new(Outcome {
            finish,
            prompt_tokens: g.prompt_tokens,
            completion_tokens: g.ids.len(),
            reasoning_tokens,
            text,
            reasoning: std::mem::take(&mut self.reasoning),
            tool_calls,
            streamed_calls,
            queue_secs: self.queue_secs,
            prefill_secs: g.prefill_secs,
            decode_secs: g.decode_secs,
            decode_passes: g.decode_passes,
            speculation: g.speculation.clone(),
            prefix_reused: g.prefix_reused,
        })))
    }
}
