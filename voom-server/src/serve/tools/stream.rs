//! Forced tool calls streamed as they are written.
//!
//! Under `tool_choice` required or a named tool, a grammar admits only well-formed
//! calls to the offered tools with arguments valid under their schemas, so a call
//! can be shown while it is generated: its name as soon as it is written, then its
//! arguments piece by piece, as OpenAI, Anthropic and the Responses API stream them.
//! (Calls the model writes of its own accord, under `auto`, are not streamed: a call
//! becomes a call only once its arguments have been validated, at the end.)
//!
//! [`CallStreamer`] reads the output text. A call is a JSON object at the layout's
//! call depth (the top level; inside the list for [`Layout::List`]) that begins
//! `{"name": NAME, ARGS_KEY: ` (the order and keys the grammar writes): from there
//! its name is known and the argument object's text streams, with the whitespace
//! outside strings dropped (so the pieces join to compact JSON). A call written
//! otherwise is not streamed, and neither is any call after it: the caller sends
//! those when the output is parsed at the end, so streamed calls are always the
//! first ones, in order.

use super::format::{Layout, ToolFormat};
use super::spec::ToolCall;
use crate::serve::error::ApiError;

/// A part of a call, as it is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallPiece {
    /// Call `index` (0, 1, ... in output order) calls `name`; its arguments follow.
    Start { index: usize, name: String },
    /// More of call `index`'s arguments: JSON text, whitespace outside strings
    /// dropped.
    Args { index: usize, text: String },
}

/// Where the streamer is in the output.
#[derive(Debug, Clone, PartialEq, Eq)]
enum At {
    /// Between calls.
    Outside,
    /// In a call's object, before its arguments: the text so far.
    Head(String),
    /// In call `index`'s arguments, whose value began at depth `depth`; `bracketed`
    /// when it is an object or array (it ends when the depth is back), else it ends
    /// at the next `,`, `}` or `]` at its depth.
    Args {
        index: usize,
        depth: usize,
        bracketed: bool,
    },
    /// In a call's object after its arguments, or in a call that is not streamed:
    /// until the object closes.
    Skip,
}

/// Reads output text and finds the forced calls in it as they are written.
#[derive(Debug)]
pub struct CallStreamer {
    args_key: &'static str,
    /// The depth of JSON nesting at which calls open.
    call_depth: usize,
    at: At,
    /// JSON nesting depth (`{`, `[`) outside strings, over the whole output.
    depth: usize,
    in_string: bool,
    escaped: bool,
    /// A call was written in another shape: no later call is streamed.
    stopped: bool,
    /// The names of the calls started, in order.
    names: Vec<String>,
    /// Each started call's argument text so far.
    args: Vec<String>,
}

impl CallStreamer {
    pub fn new(format: &'static ToolFormat) -> Self {
        CallStreamer {
            args_key: format.args_key,
            call_depth: usize::from(format.layout == Layout::List),
            at: At::Outside,
            depth: 0,
            in_string: false,
            escaped: false,
            stopped: false,
            names: Vec::new(),
            args: Vec::new(),
        }
    }

    /// The names of the calls started so far, in order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Call `index`'s argument text streamed so far (compact JSON once complete).
    pub fn args(&self, index: usize) -> Option<&str> {
        self.args.get(index).map(String::as_str)
    }

    /// Reads more output; returns the call pieces it completes, in order (arguments
    /// merged into one piece per call per push).
    pub fn push(&mut self, text: &str) -> Vec<CallPiece> {
        let mut out = Vec::new();
        for c in text.chars() {
            self.step(c, &mut out);
        }
        out
    }

    fn step(&mut self, c: char, out: &mut Vec<CallPiece>) {
        let before = self.depth;
        let in_string = self.in_string;
        self.lex(c);
        match std::mem::replace(&mut self.at, At::Outside) {
            At::Outside => {
                self.at = if !in_string && c == '{' && before == self.call_depth {
                    if self.stopped {
                        At::Skip
                    } else {
                        At::Head("{".into())
                    }
                } else {
                    At::Outside
                };
            }
            At::Head(mut head) => {
                if !in_string && !c.is_whitespace() {
                    if let Head::Done(name) = match_head(&head, self.args_key) {
                        let index = self.names.len();
                        self.names.push(name.clone());
                        self.args.push(String::new());
                        out.push(CallPiece::Start { index, name });
                        self.at = At::Args {
                            index,
                            depth: before,
                            bracketed: c == '{' || c == '[',
                        };
                        self.emit(index, c, out);
                        self.end_args_if_closed(before);
                        return;
                    }
                }
                head.push(c);
                self.at = if match_head(&head, self.args_key) == Head::No {
                    self.stopped = true;
                    self.after_call_char()
                } else {
                    At::Head(head)
                };
            }
            At::Args {
                index,
                depth,
                bracketed,
            } => {
                if !bracketed && !in_string && before == depth && matches!(c, ',' | '}' | ']') {
                    // A scalar's end: the character belongs to the call's object.
                    self.at = self.after_call_char();
                    return;
                }
                self.at = At::Args {
                    index,
                    depth,
                    bracketed,
                };
                self.emit(index, c, out);
                if bracketed {
                    self.end_args_if_closed(depth);
                }
            }
            At::Skip => self.at = self.after_call_char(),
        }
    }

    /// Where a character inside a call's object (not its arguments) leaves it.
    fn after_call_char(&self) -> At {
        if self.depth <= self.call_depth {
            At::Outside
        } else {
            At::Skip
        }
    }

    /// After an argument character: a bracketed value that began at `depth` ended.
    fn end_args_if_closed(&mut self, depth: usize) {
        if let At::Args {
            bracketed: true, ..
        } = self.at
        {
            if self.depth == depth {
                self.at = At::Skip;
            }
        }
    }

    /// Adds an argument character (whitespace outside strings is dropped).
    fn emit(&mut self, index: usize, c: char, out: &mut Vec<CallPiece>) {
        let in_string_or_quote = self.in_string || c == '"';
        if c.is_whitespace() && !in_string_or_quote {
            return;
        }
        self.args[index].push(c);
        match out.last_mut() {
            Some(CallPiece::Args { index: i, text }) if *i == index => text.push(c),
            _ => out.push(CallPiece::Args {
                index,
                text: c.to_string(),
            }),
        }
    }

    /// Tracks strings and nesting.
    fn lex(&mut self, c: char) {
        if self.in_string {
            if self.escaped {
                self.escaped = false;
            } else if c == '\\' {
                self.escaped = true;
            } else if c == '"' {
                self.in_string = false;
            }
            return;
        }
        match c {
            '"' => self.in_string = true,
            '{' | '[' => self.depth += 1,
            '}' | ']' => self.depth = self.depth.saturating_sub(1),
            _ => {}
        }
    }
}

/// How far a call's text matches `{"name": NAME, ARGS_KEY:` (whitespace allowed
/// between the parts).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Head {
    /// A prefix of it.
    Prefix,
    /// All of it, with the name; nothing after but whitespace.
    Done(String),
    /// Not this shape.
    No,
}

fn match_head(text: &str, args_key: &str) -> Head {
    let mut s = text;
    let key = format!("\"{args_key}\"");
    macro_rules! lit {
        ($l:expr) => {{
            let l: &str = $l;
            if s.len() < l.len() {
                return if l.starts_with(s) {
                    Head::Prefix
                } else {
                    Head::No
                };
            }
            match s.strip_prefix(l) {
                Some(rest) => s = rest,
                None => return Head::No,
            }
        }};
    }
    macro_rules! ws {
        () => {{
            s = s.trim_start();
            if s.is_empty() {
                return Head::Prefix;
            }
        }};
    }
    lit!("{");
    ws!();
    lit!("\"name\"");
    ws!();
    lit!(":");
    ws!();
    if !s.starts_with('"') {
        return Head::No;
    }
    // The name's string: up to the first unescaped quote.
    let mut escaped = false;
    let mut end = None;
    for (i, c) in s.char_indices().skip(1) {
        if escaped {
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if c == '"' {
            end = Some(i);
            break;
        }
    }
    let Some(end) = end else {
        return Head::Prefix;
    };
    let Ok(name) = serde_json::from_str::<String>(&s[..=end]) else {
        return Head::No;
    };
    s = &s[end + 1..];
    ws!();
    lit!(",");
    ws!();
    lit!(&key);
    ws!();
    lit!(":");
    if s.trim_start().is_empty() {
        Head::Done(name)
    } else {
        Head::No
    }
}

/// Gives the first parsed calls the ids and argument text of the calls streamed
/// while they were written (`ids`, in order); returns how many were streamed. The
/// streamed calls must be the first parsed ones, by name and count (a streamed call
/// missing at the end is allowed only when the output was cut: not `complete`).
pub fn adopt_streamed(
    cs: &CallStreamer,
    ids: &[String],
    calls: &mut [ToolCall],
    complete: bool,
) -> Result<usize, ApiError> {
    let names = cs.names();
    if (complete && calls.len() < names.len()) || calls.iter().zip(names).any(|(c, n)| &c.name != n)
    {
        return Err(ApiError::internal(format!(
            "the streamed tool calls ({names:?}) are not the parsed ones ({:?})",
            calls.iter().map(|c| &c.name).collect::<Vec<_>>()
        )));
    }
    for (i, c) in calls.iter_mut().enumerate().take(names.len()) {
        c.id = ids[i].clone();
        c.arguments_text = cs.args(i).map(str::to_string);
    }
    Ok(names.len())
}

#[cfg(test)]
mod tests {
    use super::super::{HERMES, LLAMA3_JSON, MISTRAL};
    use super::*;

    /// Feeds `text` in pieces of `n` characters; returns the pieces joined per call:
    /// (name, arguments text).
    fn run(format: &'static ToolFormat, text: &str, n: usize) -> Vec<(String, String)> {
        let mut s = CallStreamer::new(format);
        let chars: Vec<char> = text.chars().collect();
        let mut calls: Vec<(String, String)> = Vec::new();
        for chunk in chars.chunks(n) {
            let piece: String = chunk.iter().collect();
            for p in s.push(&piece) {
                match p {
                    CallPiece::Start { index, name } => {
                        assert_eq!(index, calls.len());
                        calls.push((name, String::new()));
                    }
                    CallPiece::Args { index, text } => {
                        assert!(!text.is_empty());
                        calls[index].1 += &text;
                    }
                }
            }
        }
        assert_eq!(
            s.names(),
            calls.iter().map(|c| c.0.clone()).collect::<Vec<_>>()
        );
        for (i, c) in calls.iter().enumerate() {
            assert_eq!(s.args(i), Some(c.1.as_str()));
        }
        calls
    }

    fn each_split(
        format: &'static ToolFormat,
        text: &str,
        want: &[(&str, &str)],
    ) -> Vec<(String, String)> {
        let want: Vec<(String, String)> = want
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        for n in [1, 2, 3, 7, 1000] {
            assert_eq!(run(format, text, n), want, "pieces of {n}: {text:?}");
        }
        want
    }

    #[test]
    fn hermes_calls_stream_name_then_compact_arguments() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo \\\"N\\\" {x}\", \"days\": [1, 2]}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        each_split(
            &HERMES,
            text,
            &[
                ("get_weather", r#"{"city":"Oslo \"N\" {x}","days":[1,2]}"#),
                ("get_time", "{}"),
            ],
        );
        // Each argument text is the compact form of the arguments.
        let v: serde_json::Value =
            serde_json::from_str(r#"{"city":"Oslo \"N\" {x}","days":[1,2]}"#).unwrap();
        assert_eq!(v.to_string(), r#"{"city":"Oslo \"N\" {x}","days":[1,2]}"#);
    }

    #[test]
    fn llama3_bare_and_mistral_list_calls() {
        each_split(
            &LLAMA3_JSON,
            "{\"name\": \"a\", \"parameters\": {\"x\": 1}}; {\"name\": \"b\", \"parameters\": {\"y\": [{}]}}",
            &[("a", r#"{"x":1}"#), ("b", r#"{"y":[{}]}"#)],
        );
        each_split(
            &MISTRAL,
            "[TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {\"k\": \"[v]\"}}, {\"name\": \"b\", \"arguments\": {}}]",
            &[("a", r#"{"k":"[v]"}"#), ("b", "{}")],
        );
    }

    #[test]
    fn a_call_in_another_shape_stops_streaming_from_there() {
        // The second call has its arguments first: neither it nor the third streams.
        each_split(
            &HERMES,
            "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"arguments\": {}, \"name\": \"b\"}\n</tool_call>\n<tool_call>\n{\"name\": \"c\", \"arguments\": {}}\n</tool_call>",
            &[("a", "{}")],
        );
        // Under another key: not a call of this format.
        each_split(&HERMES, "{\"name\": \"a\", \"parameters\": {}}", &[]);
        // Text that is no call at all.
        each_split(&HERMES, "plain words, {braces} and \"quotes", &[]);
    }

    #[test]
    fn a_cut_call_streams_what_was_written() {
        each_split(
            &HERMES,
            "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"city\": \"Os",
            &[("a", r#"{"city":"Os"#)],
        );
        // Cut before the arguments: nothing started.
        each_split(&HERMES, "<tool_call>\n{\"name\": \"a\", \"argu", &[]);
    }

    #[test]
    fn scalar_arguments_end_at_their_delimiter() {
        each_split(
            &HERMES,
            "{\"name\": \"a\", \"arguments\": 12}{\"name\": \"b\", \"arguments\": \"s,}\"}",
            &[("a", "12"), ("b", "\"s,}\"")],
        );
    }

    #[test]
    fn head_matching() {
        assert_eq!(match_head("{", "arguments"), Head::Prefix);
        assert_eq!(match_head("{ \"na", "arguments"), Head::Prefix);
        assert_eq!(match_head("{\"name\": \"x\\\"y", "arguments"), Head::Prefix);
        assert_eq!(
            match_head("{\"name\": \"x\\\"y\", \"arguments\": ", "arguments"),
            Head::Done("x\"y".into())
        );
        assert_eq!(match_head("{\"nom\"", "arguments"), Head::No);
        assert_eq!(match_head("{\"name\": 3", "arguments"), Head::No);
        assert_eq!(
            match_head("{\"name\": \"x\", \"parameters\"", "arguments"),
            Head::No
        );
    }
}
