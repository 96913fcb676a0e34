//! Stop sequences: where streamed text ends.

/// Cuts streamed text at the first stop sequence. Text that could be the start of a
/// stop sequence is held back until it is known not to be one.
pub struct StopScanner {
    stops: Vec<String>,
    pending: String,
    pub stopped: Option<String>,
}

impl StopScanner {
    pub fn new(stops: &[String]) -> Self {
        StopScanner {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
            stopped: None,
        }
    }

    /// Adds text; returns what may be output now and whether a stop sequence ended it.
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        if self.stopped.is_some() {
            return (String::new(), true);
        }
        self.pending.push_str(piece);
        if self.stops.is_empty() {
            return (std::mem::take(&mut self.pending), false);
        }
        // The earliest match wins; among matches at one position, the longest.
        let mut best: Option<(usize, &String)> = None;
        for s in &self.stops {
            if let Some(i) = self.pending.find(s.as_str()) {
                let better = match best {
                    None => true,
                    Some((j, t)) => i < j || (i == j && s.len() > t.len()),
                };
                if better {
                    best = Some((i, s));
                }
            }
        }
        if let Some((i, s)) = best {
            let out = self.pending[..i].to_string();
            self.stopped = Some(s.clone());
            self.pending.clear();
            return (out, true);
        }
        // Hold back the longest suffix that is a proper prefix of a stop sequence.
        let mut keep = 0;
        for s in &self.stops {
            for (k, _) in s.char_indices().skip(1) {
                if k > keep && self.pending.ends_with(&s[..k]) {
                    keep = k;
                }
            }
        }
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// The held-back text, once the output has ended without a stop.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<String>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut s = StopScanner::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let (o, stop) = s.push(p);
            out += &o;
            if stop {
                return (out, s.stopped);
            }
        }
        out += &s.flush();
        (out, None)
    }

    #[test]
    fn stops_across_pieces_and_holds_back_only_possible_prefixes() {
        assert_eq!(
            run(&["END"], &["Hello E", "N", "D world"]),
            ("Hello ".into(), Some("END".into()))
        );
        assert_eq!(
            run(&["END"], &["Hello E", "nd"]),
            ("Hello End".into(), None)
        );
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), None));
        // The earliest stop wins.
        assert_eq!(run(&["b", "a"], &["xab"]), ("x".into(), Some("a".into())));
        // Multi-byte text is never split.
        assert_eq!(run(&["éé"], &["aé", "b"]), ("aéb".into(), None));
        assert_eq!(
            run(&["\n\n"], &["one\n", "\ntwo"]),
            ("one".into(), Some("\n\n".into()))
        );
    }

    #[test]
    fn held_back_text_is_released_as_soon_as_it_cannot_match() {
        let stops = vec!["STOP".to_string()];
        let mut s = StopScanner::new(&stops);
        assert_eq!(s.push("go ST"), ("go ".to_string(), false));
        assert_eq!(s.push("x"), ("STx".to_string(), false));
    }
}
