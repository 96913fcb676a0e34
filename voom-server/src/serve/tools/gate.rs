//! How much output may stream while tools are offered.

use super::format::{Layout, ToolFormat};

/// Decides how much of the output may stream while tools are offered: text before
/// the first place a call could begin (the format's opening marker; for formats whose
/// calls are the whole output, its start), holding back a tail that could be the
/// start of that marker. From there on everything is held until the calls are parsed
/// at the end.
pub struct CallGate {
    format: &'static ToolFormat,
    /// Output seen, not yet streamed.
    pending: String,
    /// A call may have begun: nothing more streams.
    closed: bool,
    /// The output is plain text for good (a whole-output format that began otherwise).
    plain: bool,
    /// Bytes of output streamed so far.
    pub streamed: usize,
}

impl CallGate {
    /// `forced`: the output is only calls; nothing streams.
    pub fn new(format: &'static ToolFormat, forced: bool) -> Self {
        CallGate {
            format,
            pending: String::new(),
            closed: forced,
            plain: false,
            streamed: 0,
        }
    }

    /// Adds output; returns what may be streamed now.
    pub fn push(&mut self, piece: &str) -> String {
        if self.closed {
            return String::new();
        }
        self.pending.push_str(piece);
        let marker = self.format.open;
        let keep = if self.plain {
            0
        } else if self.format.layout == Layout::Bare {
            // Calls are the whole output: decide on its first visible characters.
            let start = self.pending.trim_start();
            let body = match start.strip_prefix(marker) {
                Some(b) if !marker.is_empty() => b.trim_start(),
                _ => start,
            };
            if start.is_empty() || (!marker.is_empty() && marker.starts_with(start)) {
                return String::new(); // nothing visible yet, or maybe the marker
            }
            if body.is_empty() || body.starts_with('{') {
                self.closed = true;
                return String::new();
            }
            self.plain = true;
            0
        } else if let Some(i) = self.pending.find(marker).filter(|_| !marker.is_empty()) {
            let out = self.pending[..i].to_string();
            self.closed = true;
            self.streamed += out.len();
            return out;
        } else {
            // The longest tail that could begin the marker.
            marker
                .char_indices()
                .skip(1)
                .map(|(k, _)| k)
                .filter(|&k| self.pending.ends_with(&marker[..k]))
                .max()
                .unwrap_or(0)
        };
        let cut = self.pending.len() - keep;
        let out: String = self.pending.drain(..cut).collect();
        self.streamed += out.len();
        out
    }
}

/// What of `content` (the output with its calls taken out, and trimmed when there
/// were calls) follows `sent` (the text streamed before the first call, as it was
/// written). `None` if `content` does not continue `sent`.
pub fn text_after(sent: &str, content: &str) -> Option<String> {
    for s in [sent, sent.trim_start()] {
        if let Some(rest) = content.strip_prefix(s) {
            return Some(rest.to_string());
        }
    }
    // The trim took whitespace that was streamed (before a call that ends the
    // output): nothing follows.
    match sent.trim_start().strip_prefix(content) {
        Some(extra) if extra.trim().is_empty() => Some(String::new()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_after_continues_what_was_streamed() {
        // Calls in the middle: the content is the text before and after them.
        assert_eq!(
            text_after("I'll check. ", "I'll check. \nDone").as_deref(),
            Some("\nDone")
        );
        // A call ending the output: the content was trimmed of the streamed newline.
        assert_eq!(
            text_after("I'll check.\n", "I'll check.").as_deref(),
            Some("")
        );
        // Leading whitespace streamed, then trimmed away.
        assert_eq!(text_after("\n\nHi ", "Hi \nx").as_deref(), Some("\nx"));
        // No calls: the content is the output itself.
        assert_eq!(text_after("  a", "  a b").as_deref(), Some(" b"));
        assert_eq!(text_after("", "abc").as_deref(), Some("abc"));
        assert_eq!(text_after("abc", "xyz"), None);
        assert_eq!(text_after("abc d", "abc"), None);
    }

    fn gate(format: &'static ToolFormat, forced: bool, pieces: &[&str]) -> Vec<String> {
        let mut g = CallGate::new(format, forced);
        pieces.iter().map(|p| g.push(p)).collect()
    }

    #[test]
    fn text_streams_until_a_call_may_begin() {
        use super::super::{HERMES, LLAMA3_JSON};
        // Tagged: text before the marker streams; a partial marker is held; after
        // the marker nothing streams.
        assert_eq!(
            gate(
                &HERMES,
                false,
                &["Let me check. <tool", "_call>\n{", "\"name\""]
            ),
            ["Let me check. ", "", ""]
        );
        // A tail that turns out not to be the marker is released.
        assert_eq!(gate(&HERMES, false, &["a <to", "p>"]), ["a ", "<top>"]);
        // Forced calls: nothing streams.
        assert_eq!(gate(&HERMES, true, &["<tool_call>", "x"]), ["", ""]);
        // Whole-output JSON calls: an output starting with '{' is held; plain text
        // streams from its first visible character.
        assert_eq!(
            gate(&LLAMA3_JSON, false, &["  ", "{\"name\"", "x"]),
            ["", "", ""]
        );
        assert_eq!(
            gate(&LLAMA3_JSON, false, &[" ", "Hello", " there"]),
            ["", " Hello", " there"]
        );
    }
}
