//! Routing traces: which routed experts each forward pass of a mixture of experts
//! read, layer by layer, as an engine records them (`voom generate --expert-trace`)
//! and the simulator replays them ([`crate::expert_plan`], `vpagectl expert-plan`).
//!
//! A trace is JSON lines: a header, then one line per forward pass.
//!
//! ```text
//! {"voom_expert_trace":1,"model":"qwen3-30b","num_experts":128,"top_k":8,"layers":[0,1,2],"expert_bytes":[9437184,9437184,9437184]}
//! {"positions":12,"experts":[[3,17,40],[1,2,9],[5,77,100]]}
//! {"positions":1,"experts":[[3,8],[2,9],[77,100]]}
//! ```
//!
//! `layers` are the decoder layers that route (in pass order) and `expert_bytes` the
//! bytes of one expert of each (all of a layer's experts are one size). A pass line
//! gives, per layer of `layers` in that order, the experts the pass read: each once,
//! ascending (a pass over several positions reads an expert any of them picked
//! once). `positions` is how many tokens the pass computed, so that a simulator
//! can count bytes per token. Errors name the line.

use std::io::{BufRead, Write};

use serde::{Deserialize, Serialize};

/// The format version this build reads and writes.
pub const TRACE_VERSION: u32 = 1;
/// The most bytes an expert may have (256 TiB: sums over a trace then fit a u64).
pub const MAX_EXPERT_BYTES: u64 = 1 << 48;

/// A trace's first line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceHeader {
    pub voom_expert_trace: u32,
    /// The model's name (informational).
    pub model: String,
    /// Routed experts per layer.
    pub num_experts: u32,
    /// Experts each position picks per layer.
    pub top_k: u32,
    /// The decoder layers that route, in pass order.
    pub layers: Vec<u32>,
    /// Bytes of one expert of each of `layers`.
    pub expert_bytes: Vec<u64>,
}

/// One forward pass: per layer of the header, the experts it read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracePass {
    pub positions: u32,
    pub experts: Vec<Vec<u32>>,
}

/// A whole trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    pub header: TraceHeader,
    pub passes: Vec<TracePass>,
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("expert trace, line {line}: {detail}")]
    Malformed { line: usize, detail: String },
    /// (The I/O error is in the message, not a source: shown once in a chain.)
    #[error("expert trace: {0}")]
    Io(std::io::Error),
}

impl From<std::io::Error> for TraceError {
    fn from(e: std::io::Error) -> Self {
        TraceError::Io(e)
    }
}

/// The largest trace file read ([`Trace::read_file`]): a pass a line, a few bytes
/// an expert; a million-token trace of a 61-layer model fits.
pub const TRACE_MAX_BYTES: u64 = 1 << 30;

impl Trace {
    /// Reads the trace file at `path`: a regular file (a FIFO or a device is
    /// refused, never read) of at most [`TRACE_MAX_BYTES`].
    pub fn read_file(path: &std::path::Path) -> Result<Trace, TraceError> {
        let bytes = voom_formats::file::read_limited(path, TRACE_MAX_BYTES)?;
        Trace::read(&mut bytes.as_slice())
    }

    /// Writes the header and every pass, a JSON line each.
    pub fn write(&self, out: &mut dyn Write) -> std::io::Result<()> {
        writeln!(out, "{}", json_line(&self.header))?;
        for p in &self.passes {
            writeln!(out, "{}", json_line(p))?;
        }
        out.flush()
    }

    /// Reads a trace, checking it: a known version, one byte size per layer, each
    /// pass with one list per layer of experts below `num_experts`, ascending, and at
    /// least one position.
    pub fn read(input: &mut dyn BufRead) -> Result<Trace, TraceError> {
        let mut lines = input.lines().enumerate();
        let bad = |line: usize, detail: String| TraceError::Malformed {
            line: line + 1,
            detail,
        };
        let (n, first) = lines
            .next()
            .ok_or_else(|| bad(0, "empty: no header".into()))?;
        let header: TraceHeader =
            serde_json::from_str(&first?).map_err(|e| bad(n, format!("header: {e}")))?;
        if header.voom_expert_trace != TRACE_VERSION {
            return Err(bad(
                n,
                format!(
                    "version {} (this build reads {TRACE_VERSION})",
                    header.voom_expert_trace
                ),
            ));
        }
        if header.expert_bytes.len() != header.layers.len() {
            return Err(bad(
                n,
                format!(
                    "{} expert sizes for {} layers",
                    header.expert_bytes.len(),
                    header.layers.len()
                ),
            ));
        }
        if let Some(b) = header.expert_bytes.iter().find(|&&b| b > MAX_EXPERT_BYTES) {
            return Err(bad(
                n,
                format!("an expert of {b} bytes (at most {MAX_EXPERT_BYTES})"),
            ));
        }
        if header.top_k == 0 || header.top_k > header.num_experts {
            return Err(bad(
                n,
                format!("top_k {} of {} experts", header.top_k, header.num_experts),
            ));
        }
        let mut passes = Vec::new();
        for (n, text) in lines {
            let text = text?;
            if text.trim().is_empty() {
                continue;
            }
            let p: TracePass = serde_json::from_str(&text).map_err(|e| bad(n, e.to_string()))?;
            if p.positions == 0 {
                return Err(bad(n, "a pass of no positions".into()));
            }
            if p.experts.len() != header.layers.len() {
                return Err(bad(
                    n,
                    format!(
                        "{} lists of experts for {} layers",
                        p.experts.len(),
                        header.layers.len()
                    ),
                ));
            }
            for (l, list) in p.experts.iter().enumerate() {
                if list.windows(2).any(|w| w[0] >= w[1]) {
                    return Err(bad(
                        n,
                        format!("layer {}: experts not ascending", header.layers[l]),
                    ));
                }
                if let Some(e) = list.iter().find(|&&e| e >= header.num_experts) {
                    return Err(bad(
                        n,
                        format!(
                            "layer {}: expert {e} of {}",
                            header.layers[l], header.num_experts
                        ),
                    ));
                }
            }
            passes.push(p);
        }
        Ok(Trace { header, passes })
    }
}

/// One line of a trace (plain integers and strings: it always serializes).
fn json_line<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("a trace line serializes")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace() -> Trace {
        Trace {
            header: TraceHeader {
                voom_expert_trace: TRACE_VERSION,
                model: "m".into(),
                num_experts: 8,
                top_k: 2,
                layers: vec![0, 2],
                expert_bytes: vec![100, 100],
            },
            passes: vec![
                TracePass {
                    positions: 3,
                    experts: vec![vec![1, 2, 5], vec![0, 7]],
                },
                TracePass {
                    positions: 1,
                    experts: vec![vec![2, 5], vec![3, 4]],
                },
            ],
        }
    }

    #[test]
    fn a_trace_reads_back_as_written() {
        let t = trace();
        let mut buf = Vec::new();
        t.write(&mut buf).unwrap();
        assert_eq!(String::from_utf8_lossy(&buf).lines().count(), 3);
        assert_eq!(Trace::read(&mut buf.as_slice()).unwrap(), t);
    }

    #[test]
    fn bad_traces_are_errors_naming_the_line() {
        let write = |t: &Trace| {
            let mut buf = Vec::new();
            t.write(&mut buf).unwrap();
            String::from_utf8(buf).unwrap()
        };
        let err = |text: &str| Trace::read(&mut text.as_bytes()).unwrap_err().to_string();
        assert!(err("").contains("empty"));
        let mut t = trace();
        t.passes[1].experts[1] = vec![4, 3];
        assert!(err(&write(&t)).contains("line 3: layer 2: experts not ascending"));
        let mut t = trace();
        t.passes[0].experts[0] = vec![8];
        assert!(err(&write(&t)).contains("line 2: layer 0: expert 8 of 8"));
        let mut t = trace();
        t.passes[0].experts.pop();
        assert!(err(&write(&t)).contains("line 2: 1 lists of experts for 2 layers"));
        let mut t = trace();
        t.header.voom_expert_trace = 9;
        assert!(err(&write(&t)).contains("line 1: version 9"));
        let mut t = trace();
        t.header.expert_bytes[1] = MAX_EXPERT_BYTES + 1;
        assert!(err(&write(&t)).contains("line 1: an expert of"));
        let mut t = trace();
        t.header.expert_bytes.pop();
        assert!(err(&write(&t)).contains("1 expert sizes for 2 layers"));
        let text = write(&trace()).replace("\"positions\":1", "\"positions\":0");
        assert!(err(&text).contains("line 3: a pass of no positions"));
        assert!(err("{\"voom_expert_trace\":1}").contains("line 1: header"));
    }
}
