//! OpenAI's harmony format, the chat format of gpt-oss: detecting it, the grammars
//! that force it, and reading the model's output as reasoning, answer and tool calls.
//!
//! A harmony conversation is a sequence of messages
//! `<|start|>{header}<|message|>{text}<|end|>`; the header holds the role, the channel
//! (`<|channel|>analysis`, `commentary` or `final`), a recipient (`to=functions.NAME`)
//! and a content type (`<|constrain|>json`), the recipient before or after the
//! channel. The chat template ends the prompt with `<|start|>assistant`, so the model
//! begins inside a header; it writes its reasoning on `analysis`, its answer on
//! `final` and ends with `<|return|>`, or calls a tool on `commentary` addressed
//! `to=functions.NAME` and ends with `<|call|>` (both stop generation; `<|end|>`
//! only ends a message). Every marker is one special token, so output is decoded with
//! special tokens kept.
//!
//! [`HarmonyParser`] reads the output as it streams, in any pieces (the result does
//! not depend on where they are cut), and gives [`Piece`]s:
//! - the text of `analysis` messages: reasoning, streamed as written;
//! - the text of `final` messages, of `commentary` without a recipient (a preamble)
//!   and of messages on another or no channel: content, streamed as written;
//! - a message addressed `to=functions.NAME` (any channel): a [`Piece::Call`] when it
//!   ends, with its arguments' text and the message as written. The caller makes it
//!   a tool call if NAME is an offered tool and the arguments are valid against its
//!   schema, else the message as written is content (as other formats leave invalid
//!   calls in the text);
//! - anything else stays content as written, markers included: a message for another
//!   recipient (a built-in tool: `browser.search`, `python`) or from another role; a
//!   header that never reaches `<|message|>` (a truncated output, random tokens, text
//!   without any header; after [`MAX_HEADER`] bytes without `<|message|>` the text is
//!   taken as content at once); text between messages; markers where no marker
//!   belongs (`<|message|>` in a message's text).
//!
//! Nothing is dropped but the markers that frame well-formed messages. At the end of
//! the output ([`HarmonyParser::finish`]), an unfinished message keeps what it has:
//! unfinished reasoning is reasoning, an unfinished answer is content, and an
//! unfinished call is a call only if the generation ended by itself (a stop token, a
//! grammar's end), else (the token limit) it is content as written. Lenient where
//! the model skips a marker: `<|channel|>` after a message's end, or inside a
//! message's text, begins a new assistant message as if `<|end|><|start|>assistant`
//! had been written.
//!
//! Messages of one kind are joined as they are, without separators.
//!
//! Reasoning tokens: the parser also gives where its reasoning messages lie in the
//! text it read ([`HarmonyParser::reasoning_spans`]): each from the start of its
//! header (its `<|start|>`; the `<|channel|>` that begins it when the model wrote no
//! `<|start|>`; the start of the output for the first message, the prompt having
//! written `<|start|>assistant`) to the end of the marker that ends it (`<|end|>`, or
//! `<|return|>` / `<|call|>` where the output holds them), or to the start of the next
//! message's header when it begins without an end, or to the end of the output.
//! [`TokenOffsets`] counts the generated tokens whose text begins in those spans: the
//! usage's `reasoning_tokens`.

use std::ops::Range;

use libvoom::constrain::{Grammar, JsonWhitespace};
use libvoom::text::Tokenizer;
use serde_json::Value;

use super::error::ApiError;
use super::tools::ToolSpec;

pub const START: &str = "<|start|>";
pub const END: &str = "<|end|>";
pub const MESSAGE: &str = "<|message|>";
pub const CHANNEL: &str = "<|channel|>";
pub const CONSTRAIN: &str = "<|constrain|>";
pub const RETURN: &str = "<|return|>";
pub const CALL: &str = "<|call|>";

/// Every harmony marker.
const MARKERS: [&str; 7] = [START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL];

/// Header text longer than this without `<|message|>` is not a header: it is content.
pub const MAX_HEADER: usize = 512;

/// A model that speaks harmony: the ids of its markers (each one special token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Harmony {
    /// Marker text and token id, in [`MARKERS`] order.
    ids: Vec<(&'static str, u32)>,
}

impl Harmony {
    /// The harmony format of a model whose chat template renders `<|channel|>` and
    /// `<|start|>`, and whose tokenizer has every marker as a special added token;
    /// None for any other model.
    pub fn detect(template_source: &str, tok: &Tokenizer) -> Option<Harmony> {
        if !template_source.contains(CHANNEL) || !template_source.contains(START) {
            return None;
        }
        let added = tok.inner().get_added_tokens_decoder();
        let ids = MARKERS
            .iter()
            .map(|m| {
                added
                    .iter()
                    .find(|(_, t)| t.content == *m && t.special)
                    .map(|(id, _)| (*m, *id))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Harmony { ids })
    }

    /// The token id of a marker.
    pub fn id(&self, marker: &str) -> Option<u32> {
        self.ids
            .iter()
            .find(|(m, _)| *m == marker)
            .map(|(_, id)| *id)
    }

    /// A marker in a Lark grammar: its token by id.
    fn token(&self, marker: &str) -> String {
        match self.id(marker) {
            Some(id) => format!("<[{id}]>"),
            None => Value::String(marker.to_string()).to_string(),
        }
    }

    /// A Lark grammar whose every output is one call to one of `tools`, as gpt-oss
    /// writes it: `<|channel|>commentary to=functions.NAME <|constrain|>json
    /// <|message|>ARGS` (the engine then stops on an end-of-sequence id: `<|call|>`
    /// for the model); with `answer` (a `%json` body: a response format), the output
    /// may instead be that JSON as the final answer. One call: harmony ends a
    /// generation at each call's `<|call|>`.
    pub fn calls_grammar(
        &self,
        tools: &[&ToolSpec],
        answer: Option<&str>,
    ) -> Result<String, ApiError> {
        let mut g = String::new();
        let mut alts = Vec::new();
        for (i, t) in tools.iter().enumerate() {
            let mut args = t.parameters.clone();
            if let Some(o) = args.as_object_mut() {
                o.entry("type").or_insert_with(|| "object".into());
            }
            let body = Grammar::lark_json(&args, JsonWhitespace::Compact)
                .map_err(|e| ApiError::invalid("tools", format!("a tool's schema: {e}")))?;
            let head = Value::String(format!("commentary to=functions.{} ", t.name)).to_string();
            g += &format!(
                "call_{i}: {} {head} {} \"json\" {} args_{i}\nargs_{i}: {body}\n",
                self.token(CHANNEL),
                self.token(CONSTRAIN),
                self.token(MESSAGE),
            );
            alts.push(format!("call_{i}"));
        }
        if let Some(a) = answer {
            g += &self.answer_rule("answer", a);
            alts.push("answer".into());
        }
        Ok(format!("start: {}\n{g}", alts.join(" | ")))
    }

    /// A Lark grammar whose output is the final answer `json` (a `%json` body):
    /// `<|channel|>final<|message|>JSON` (then `<|return|>`).
    pub fn answer_grammar(&self, json: &str) -> String {
        format!("start: answer\n{}", self.answer_rule("answer", json))
    }

    fn answer_rule(&self, name: &str, json: &str) -> String {
        format!(
            "{name}: {} \"final\" {} {name}_json\n{name}_json: {json}\n",
            self.token(CHANNEL),
            self.token(MESSAGE)
        )
    }
}

/// How a request reads a harmony model's output.
#[derive(Debug, Clone, PartialEq)]
pub struct HarmonyOutput {
    /// The tools calls may go to (none: every call is content as written).
    pub tools: Vec<ToolSpec>,
    /// A grammar forces a call: output that ends complete must hold one.
    pub forced: bool,
}

/// What the output holds, piece by piece.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Reasoning (the analysis channel).
    Reasoning(String),
    /// Content: the answer, a preamble, or text that is not harmony.
    Content(String),
    /// A message addressed `to=functions.NAME`, ended.
    Call {
        /// NAME.
        name: String,
        /// The message's text: the arguments, JSON if the model wrote them well.
        arguments: String,
        /// The message as written, markers included: content if it is not taken as
        /// a call.
        raw: String,
    },
}

/// What a message's text is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Reasoning,
    Content,
    Call {
        name: String,
        raw: String,
    },
    /// Kept as written (`raw`: its header), content when it ends.
    Verbatim {
        raw: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// In a header: its text so far, as written (after `<|start|>`, which it holds
    /// when the output wrote one).
    Header { raw: String },
    /// In a message's text.
    Body { kind: Kind, text: String },
    /// Between messages (after an end).
    Between,
}

/// Reads harmony output as it is generated; see the module's rules.
#[derive(Debug, Clone)]
pub struct HarmonyParser {
    state: State,
    /// Input not yet read: a tail that may be the start of a marker.
    pending: String,
    /// Bytes of input read (`pending` not included).
    read: usize,
    /// Where the current (or last) header began, in bytes of input.
    header_at: usize,
    /// Where the reasoning message being read began (its header's start).
    reasoning_from: Option<usize>,
    /// The reasoning messages ended so far, in bytes of input, in order.
    reasoning_spans: Vec<Range<usize>>,
}

impl Default for HarmonyParser {
    fn default() -> Self {
        Self::new()
    }
}

impl HarmonyParser {
    /// A parser at the start of an assistant turn (after the prompt's
    /// `<|start|>assistant`).
    pub fn new() -> Self {
        HarmonyParser {
            state: State::Header { raw: String::new() },
            pending: String::new(),
            read: 0,
            header_at: 0,
            reasoning_from: None,
            reasoning_spans: Vec::new(),
        }
    }

    /// Where the reasoning messages lie in the input read, in bytes, in order and
    /// apart: each from the start of its header to the end of the marker that ends
    /// it (see the module's doc). After [`Self::finish`], every one; before, those
    /// that ended.
    pub fn reasoning_spans(&self) -> &[Range<usize>] {
        &self.reasoning_spans
    }

    /// The reasoning message being read, if any, ends at `at` (bytes of input).
    fn end_reasoning(&mut self, at: usize) {
        if let Some(from) = self.reasoning_from.take() {
            self.reasoning_spans.push(from..at);
        }
    }

    /// Reads more output; returns the pieces it completes, in order.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        self.run(false, &mut out);
        merge(out)
    }

    /// The end of the output; `ended`: the generation ended by itself (a stop token,
    /// a grammar's end), not at a limit. Returns the last pieces.
    pub fn finish(&mut self, ended: bool) -> Vec<Piece> {
        let mut out = Vec::new();
        self.run(true, &mut out);
        // Unfinished reasoning is reasoning to the end of the output.
        self.end_reasoning(self.read);
        match std::mem::replace(&mut self.state, State::Between) {
            State::Header { raw } => content(&mut out, raw),
            State::Body {
                kind: Kind::Call { raw, .. },
                text,
            } if !ended => content(&mut out, raw + &text),
            State::Body { kind, text } => end_message(kind, text, &mut out),
            State::Between => {}
        }
        merge(out)
    }

    fn run(&mut self, at_end: bool, out: &mut Vec<Piece>) {
        let input = std::mem::take(&mut self.pending);
        // Where `input` begins, in bytes of all input.
        let base = self.read;
        let mut rest = input.as_str();
        loop {
            let Some(i) = rest.find('<') else {
                self.text(rest, out);
                self.read = base + input.len();
                return;
            };
            self.text(&rest[..i], out);
            let tail = &rest[i..];
            let at = base + input.len() - tail.len();
            self.read = at;
            if let Some(m) = MARKERS.iter().find(|m| tail.starts_with(**m)) {
                self.marker(m, at, out);
                rest = &tail[m.len()..];
            } else if !at_end && MARKERS.iter().any(|m| m.starts_with(tail)) {
                // Maybe a marker: wait for more.
                self.pending = tail.to_string();
                return;
            } else {
                self.text("<", out);
                rest = &tail[1..];
            }
        }
    }

    /// Text (no marker) in the current state.
    fn text(&mut self, t: &str, out: &mut Vec<Piece>) {
        if t.is_empty() {
            return;
        }
        match &mut self.state {
            State::Header { raw } => {
                if raw.len() + t.len() > MAX_HEADER {
                    let raw = std::mem::take(raw);
                    content(out, raw + t);
                    self.state = State::Body {
                        kind: Kind::Content,
                        text: String::new(),
                    };
                } else {
                    raw.push_str(t);
                }
            }
            State::Body { kind, text } => match kind {
                Kind::Reasoning => out.push(Piece::Reasoning(t.to_string())),
                Kind::Content => out.push(Piece::Content(t.to_string())),
                Kind::Call { .. } | Kind::Verbatim { .. } => text.push_str(t),
            },
            State::Between => content(out, t.to_string()),
        }
    }

    /// A marker `m`, which begins at byte `at` of the input.
    fn marker(&mut self, m: &'static str, at: usize, out: &mut Vec<Piece>) {
        let state = std::mem::replace(&mut self.state, State::Between);
        self.state = match (state, m) {
            (State::Header { mut raw }, CHANNEL | CONSTRAIN) => {
                raw.push_str(m);
                State::Header { raw }
            }
            (State::Header { raw }, MESSAGE) => {
                let kind = header_kind(&raw);
                if kind == Kind::Reasoning {
                    self.reasoning_from = Some(self.header_at);
                }
                State::Body {
                    kind,
                    text: String::new(),
                }
            }
            // A header that never reached its text: content as written.
            (State::Header { raw }, START) => {
                content(out, raw);
                self.header_at = at;
                State::Header { raw: START.into() }
            }
            (State::Header { raw }, _) => {
                content(out, raw);
                State::Between
            }
            (State::Body { kind, text }, END | RETURN | CALL) => {
                self.end_reasoning(at + m.len());
                end_message(kind, text, out);
                State::Between
            }
            (State::Body { kind, text }, START | CHANNEL) => {
                self.end_reasoning(at);
                self.header_at = at;
                end_message(kind, text, out);
                State::Header {
                    raw: if m == START {
                        START.into()
                    } else {
                        CHANNEL.into()
                    },
                }
            }
            (State::Body { kind, mut text }, _) => {
                // `<|message|>` or `<|constrain|>` in a message's text: text.
                match &kind {
                    Kind::Reasoning => out.push(Piece::Reasoning(m.into())),
                    Kind::Content => out.push(Piece::Content(m.into())),
                    Kind::Call { .. } | Kind::Verbatim { .. } => text.push_str(m),
                }
                State::Body { kind, text }
            }
            (State::Between, START) => {
                self.header_at = at;
                State::Header { raw: START.into() }
            }
            (State::Between, CHANNEL) => {
                self.header_at = at;
                State::Header {
                    raw: CHANNEL.into(),
                }
            }
            (State::Between, _) => {
                content(out, m.to_string());
                State::Between
            }
        };
    }
}

/// Where each generated token's text begins in the decoded output, to count the
/// tokens of the reasoning ([`HarmonyParser::reasoning_spans`] of that output).
#[derive(Debug, Clone, Default)]
pub struct TokenOffsets {
    /// Each token's start, in bytes of the decoded output.
    starts: Vec<usize>,
    /// Bytes decoded so far.
    len: usize,
}

impl TokenOffsets {
    /// A generated token whose decoded text is `piece`. A token that completes no
    /// character (`piece` empty) begins where the next text does: in the character
    /// its bytes are part of.
    pub fn token(&mut self, piece: &str) {
        self.starts.push(self.len);
        self.len += piece.len();
    }

    /// Decoded text of no new token (what the decoder still held at the end).
    pub fn text(&mut self, rest: &str) {
        self.len += rest.len();
    }

    /// The tokens whose text begins inside one of `spans` (in order and apart, as
    /// the parser gives them).
    pub fn count_in(&self, spans: &[Range<usize>]) -> usize {
        self.starts
            .iter()
            .filter(|&&s| {
                // The last span that begins at or before s.
                let i = spans.partition_point(|r| r.start <= s);
                i > 0 && s < spans[i - 1].end
            })
            .count()
    }
}

/// A message's end: a call is complete; a message kept as written is content.
fn end_message(kind: Kind, text: String, out: &mut Vec<Piece>) {
    match kind {
        Kind::Call { name, raw } => out.push(Piece::Call {
            name,
            raw: raw + &text,
            arguments: text,
        }),
        Kind::Verbatim { raw } => content(out, raw + &text),
        Kind::Reasoning | Kind::Content => {}
    }
}

fn content(out: &mut Vec<Piece>, t: String) {
    if !t.is_empty() {
        out.push(Piece::Content(t));
    }
}

/// Adjacent pieces of one kind joined.
fn merge(pieces: Vec<Piece>) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::with_capacity(pieces.len());
    for p in pieces {
        match (out.last_mut(), p) {
            (Some(Piece::Reasoning(a)), Piece::Reasoning(b))
            | (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
            (_, p) => out.push(p),
        }
    }
    out
}

/// What a header (as written, `<|start|>` included when written) makes of its
/// message's text.
fn header_kind(raw: &str) -> Kind {
    let h = raw.strip_prefix(START).unwrap_or(raw);
    // The channel: the word after `<|channel|>`.
    let mut channel = None;
    let mut rest = h.to_string();
    if let Some(i) = h.find(CHANNEL) {
        let after = &h[i + CHANNEL.len()..];
        let end = after
            .find(|c: char| c.is_whitespace() || c == '<')
            .unwrap_or(after.len());
        channel = Some(after[..end].to_string());
        rest = format!("{} {}", &h[..i], &after[end..]);
    }
    let rest = rest.replace(CONSTRAIN, " ");
    let parts: Vec<&str> = rest.split_whitespace().collect();
    let recipient = parts.iter().find_map(|p| p.strip_prefix("to="));
    let role = parts.first().filter(|p| !p.starts_with("to="));
    let from_assistant = role.is_none_or(|r| *r == "assistant");
    let raw = format!("{raw}{MESSAGE}");
    match recipient {
        Some(r) if from_assistant => match r.strip_prefix("functions.") {
            Some(name) if !name.is_empty() => Kind::Call {
                name: name.to_string(),
                raw,
            },
            // A built-in tool (browser, python) or another recipient: as written.
            _ => Kind::Verbatim { raw },
        },
        // Another role's message (a tool's answer the model made up): as written.
        _ if !from_assistant => Kind::Verbatim { raw },
        _ => match channel.as_deref() {
            Some("analysis") => Kind::Reasoning,
            _ => Kind::Content,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reasoning, content and calls of `text` read in one piece.
    fn whole(text: &str, ended: bool) -> Vec<Piece> {
        let mut p = HarmonyParser::new();
        let mut out = p.push(text);
        out.extend(p.finish(ended));
        merge(out)
    }

    /// The same, read in the pieces `cuts` makes.
    fn pieces(text: &str, cuts: &[usize], ended: bool) -> Vec<Piece> {
        cut(text, cuts, ended).0
    }

    /// The pieces and the reasoning spans of `text` read in the pieces `cuts` makes.
    fn cut(text: &str, cuts: &[usize], ended: bool) -> (Vec<Piece>, Vec<Range<usize>>) {
        let mut p = HarmonyParser::new();
        let mut out = Vec::new();
        let mut at = 0;
        for &c in cuts {
            out.extend(p.push(&text[at..c]));
            at = c;
        }
        out.extend(p.push(&text[at..]));
        out.extend(p.finish(ended));
        (merge(out), p.reasoning_spans().to_vec())
    }

    /// The spans are in order, apart and inside the text, and they hold the
    /// reasoning: each read alone is reasoning only, and together they are all of it.
    fn check_spans(text: &str, spans: &[Range<usize>], pieces: &[Piece], ended: bool) {
        let mut end = 0;
        for r in spans {
            assert!(
                end <= r.start && r.start < r.end && r.end <= text.len(),
                "{text:?} {spans:?}"
            );
            end = r.end;
        }
        let mut alone = String::new();
        for r in spans {
            for p in whole(&text[r.clone()], ended) {
                match p {
                    Piece::Reasoning(t) => alone.push_str(&t),
                    p => panic!("{text:?} {r:?}: {p:?} in a reasoning span"),
                }
            }
        }
        let all: String = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Reasoning(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(alone, all, "{text:?} {spans:?}");
    }

    /// The reasoning tokens of an output given as its tokens' texts, read a token at
    /// a time as the server reads them.
    fn reasoning_tokens(tokens: &[&str], ended: bool) -> usize {
        let mut p = HarmonyParser::new();
        let mut offsets = TokenOffsets::default();
        for t in tokens {
            offsets.token(t);
            p.push(t);
        }
        p.finish(ended);
        let n = offsets.count_in(p.reasoning_spans());
        // The same read in one piece.
        let (_, spans) = cut(&tokens.concat(), &[], ended);
        assert_eq!(offsets.count_in(&spans), n, "{tokens:?}");
        n
    }

    fn r(s: &str) -> Piece {
        Piece::Reasoning(s.into())
    }
    fn c(s: &str) -> Piece {
        Piece::Content(s.into())
    }
    fn call(name: &str, args: &str, raw: &str) -> Piece {
        Piece::Call {
            name: name.into(),
            arguments: args.into(),
            raw: raw.into(),
        }
    }

    /// Every shape, and what it reads as.
    fn cases() -> Vec<(&'static str, bool, Vec<Piece>)> {
        vec![
            // Reasoning, then the answer (`<|return|>` written: --ignore-eos, or a
            // decode that keeps stop tokens).
            (
                "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Paris.<|return|>",
                true,
                vec![r("Think."), c("Paris.")],
            ),
            // The stop token left out (as the server decodes it).
            (
                "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Paris.",
                true,
                vec![r("Think."), c("Paris.")],
            ),
            // A call, the recipient after the channel, with <|constrain|>.
            (
                "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>",
                true,
                vec![
                    r("Need weather."),
                    call(
                        "get_weather",
                        "{\"city\":\"Paris\"}",
                        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}",
                    ),
                ],
            ),
            // The recipient before the channel (as the template writes history), right
            // after the prompt's `<|start|>assistant`; no stop token.
            (
                " to=functions.get_time<|channel|>commentary json<|message|>{}",
                true,
                vec![call(
                    "get_time",
                    "{}",
                    " to=functions.get_time<|channel|>commentary json<|message|>{}",
                )],
            ),
            // `<|constrain|>` right after the recipient.
            (
                "<|channel|>commentary to=functions.f<|constrain|>json<|message|>{\"a\":1}<|call|>",
                true,
                vec![call(
                    "f",
                    "{\"a\":1}",
                    "<|channel|>commentary to=functions.f<|constrain|>json<|message|>{\"a\":1}",
                )],
            ),
            // A preamble (commentary without a recipient) is content.
            (
                "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>",
                true,
                vec![
                    c("Checking."),
                    call(
                        "f",
                        "{}",
                        "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}",
                    ),
                ],
            ),
            // A built-in tool's call is content as written.
            (
                "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>analysis to=browser.search code<|message|>{\"q\":1}<|call|>",
                true,
                vec![
                    r("x"),
                    c("<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{\"q\":1}"),
                ],
            ),
            // A message from another role (a tool's answer, made up): as written.
            (
                "<|channel|>final<|message|>a<|end|><|start|>functions.f to=assistant<|channel|>commentary<|message|>{}<|end|>",
                true,
                vec![c(
                    "a<|start|>functions.f to=assistant<|channel|>commentary<|message|>{}",
                )],
            ),
            // Unfinished reasoning at the token limit is reasoning.
            (
                "<|channel|>analysis<|message|>Let me th",
                false,
                vec![r("Let me th")],
            ),
            // An unfinished call at the token limit is content as written.
            (
                "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\":",
                false,
                vec![c("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\":")],
            ),
            // A truncated header is content as written; a dangling marker prefix is
            // text.
            ("<|channel|>analy", false, vec![c("<|channel|>analy")]),
            ("<|chan", false, vec![c("<|chan")]),
            // No harmony at all: content.
            ("Hello <| world", true, vec![c("Hello <| world")]),
            ("", true, vec![]),
            // The channel marker without `<|end|><|start|>assistant` begins a message.
            (
                "<|channel|>analysis<|message|>a<|channel|>final<|message|>b",
                true,
                vec![r("a"), c("b")],
            ),
            (
                "<|channel|>analysis<|message|>a<|end|><|channel|>final<|message|>b",
                true,
                vec![r("a"), c("b")],
            ),
            // Markers where none belongs are text; text between messages is content.
            (
                "<|channel|>final<|message|>x<|message|>y<|end|>between<|end|>",
                true,
                vec![c("x<|message|>ybetween<|end|>")],
            ),
            // A header ended by <|end|> is content as written.
            (
                "<|channel|>final<|end|><|start|>assistant<|channel|>final<|message|>ok",
                true,
                vec![c("<|channel|>finalok")],
            ),
            // Two answers: joined as they are.
            (
                "<|channel|>final<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b<|return|>",
                true,
                vec![c("ab")],
            ),
            // A message without a channel is content.
            ("<|message|>plain", true, vec![c("plain")]),
        ]
    }

    #[test]
    fn every_shape_reads_as_documented() {
        for (text, ended, want) in cases() {
            assert_eq!(whole(text, ended), want, "{text:?}");
        }
    }

    #[test]
    fn pieces_cut_anywhere_read_as_one_pass() {
        let mut texts: Vec<(String, bool)> = cases()
            .into_iter()
            .map(|(t, e, _)| (t.to_string(), e))
            .collect();
        // A header longer than MAX_HEADER becomes content at the same place however
        // it is cut.
        texts.push((
            format!("{}<|channel|>final<|message|>b", "a".repeat(MAX_HEADER + 3)),
            true,
        ));
        texts.push(("é<|channel|>analysis<|message|>ü€<|end|>".into(), true));
        for (text, ended) in &texts {
            let want = whole(text, *ended);
            let bounds: Vec<usize> = (1..text.len())
                .filter(|&i| text.is_char_boundary(i))
                .collect();
            // Every single cut, and every character its own piece.
            for &b in &bounds {
                assert_eq!(pieces(text, &[b], *ended), want, "{text:?} cut at {b}");
            }
            assert_eq!(pieces(text, &bounds, *ended), want, "{text:?} char by char");
            // The reasoning spans too.
            let (_, spans) = cut(text, &[], *ended);
            check_spans(text, &spans, &want, *ended);
            for &b in &bounds {
                assert_eq!(cut(text, &[b], *ended).1, spans, "{text:?} cut at {b}");
            }
            assert_eq!(cut(text, &bounds, *ended).1, spans, "{text:?} char by char");
        }
    }

    #[test]
    fn reasoning_tokens_are_the_analysis_messages_tokens() {
        const ANSWER: [&str; 8] = [
            START,
            "assistant",
            CHANNEL,
            "final",
            MESSAGE,
            "Par",
            "is",
            ".",
        ];
        let with_answer = |reasoning: &[&'static str]| -> Vec<&'static str> {
            reasoning.iter().chain(ANSWER.iter()).copied().collect()
        };
        // From the output's start (the prompt wrote `<|start|>assistant`) to the
        // `<|end|>`, both included; the answer's tokens are not reasoning.
        let think = [CHANNEL, "analysis", MESSAGE, "Think", ".", END];
        assert_eq!(reasoning_tokens(&with_answer(&think), true), 6);
        // The stop token, when the output holds it, is the answer's.
        let mut t = with_answer(&think);
        t.push(RETURN);
        assert_eq!(reasoning_tokens(&t, true), 6);
        // No reasoning: 0.
        assert_eq!(reasoning_tokens(&ANSWER[2..], true), 0);
        assert_eq!(reasoning_tokens(&["Hello", " <|", " world"], true), 0);
        assert_eq!(reasoning_tokens(&[], true), 0);
        // A second analysis message counts from its `<|start|>` to its `<|end|>`.
        let twice = [
            CHANNEL,
            "analysis",
            MESSAGE,
            "a",
            END,
            START,
            "assistant",
            CHANNEL,
            "analy",
            "sis",
            MESSAGE,
            "b",
            "c",
            END,
        ];
        assert_eq!(reasoning_tokens(&with_answer(&twice), true), 5 + 9);
        // Unfinished reasoning at the limit counts to the last token.
        assert_eq!(
            reasoning_tokens(&[CHANNEL, "analysis", MESSAGE, "Let", " me"], false),
            5
        );
        // A header that never reaches `<|message|>` is not reasoning.
        assert_eq!(reasoning_tokens(&[CHANNEL, "analysis"], false), 0);
        // Without `<|end|>`, the reasoning ends where the next message begins.
        assert_eq!(
            reasoning_tokens(
                &[CHANNEL, "analysis", MESSAGE, "a", CHANNEL, "final", MESSAGE, "b"],
                true
            ),
            4
        );
        // Another channel, or a built-in tool's call on the analysis channel, is not
        // reasoning; a call is not.
        assert_eq!(
            reasoning_tokens(&[CHANNEL, "commentary", MESSAGE, "Checking.", END], true),
            0
        );
        assert_eq!(
            reasoning_tokens(
                &[CHANNEL, "analysis to=browser.search", MESSAGE, "{}", CALL],
                true
            ),
            0
        );
        let call = [
            START,
            "assistant",
            CHANNEL,
            "commentary to=functions.f ",
            CONSTRAIN,
            "json",
            MESSAGE,
            "{}",
        ];
        let t: Vec<&str> = think.iter().chain(call.iter()).copied().collect();
        assert_eq!(reasoning_tokens(&t, true), 6);
        // A token that completes no character begins where its character does.
        let split = [CHANNEL, "analysis", MESSAGE, "", "é", END];
        assert_eq!(reasoning_tokens(&with_answer(&split), true), 6);
    }

    #[test]
    fn random_output_never_panics_and_keeps_its_text() {
        // Random mixtures of markers and text.
        let atoms = [
            START,
            END,
            MESSAGE,
            CHANNEL,
            CONSTRAIN,
            RETURN,
            CALL,
            "<|",
            "<",
            "|>",
            "a",
            "analysis",
            "final",
            " to=functions.f",
            " to=x",
            "{",
            "}",
            " ",
            "é",
        ];
        let mut seed = 0x9e3779b97f4a7c15u64;
        for _ in 0..400 {
            let mut text = String::new();
            for _ in 0..(seed % 24) {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                text.push_str(atoms[(seed % atoms.len() as u64) as usize]);
            }
            for ended in [true, false] {
                let want = whole(&text, ended);
                let bounds: Vec<usize> = (1..text.len())
                    .filter(|&i| text.is_char_boundary(i))
                    .collect();
                assert_eq!(pieces(&text, &bounds, ended), want, "{text:?}");
                let (_, spans) = cut(&text, &[], ended);
                check_spans(&text, &spans, &want, ended);
                assert_eq!(cut(&text, &bounds, ended).1, spans, "{text:?}");
            }
        }
    }
}
