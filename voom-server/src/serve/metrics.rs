//! Counters for `GET /metrics` (Prometheus text format, version 0.0.4).

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

#[derive(Default)]
pub struct Metrics {
    /// Requests by endpoint and status code.
    requests: Mutex<std::collections::BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    /// Microseconds spent in prefill and decode.
    prefill_us: AtomicU64,
    decode_us: AtomicU64,
    /// Of those, microseconds the passes waited for pages.
    prefill_wait_us: AtomicU64,
    decode_wait_us: AtomicU64,
    /// Requests queued for the engine, not yet started.
    pub queue_depth: AtomicUsize,
    /// Requests the engine computes now (its batch).
    pub busy: AtomicUsize,
    /// The most requests computed together so far.
    pub batch_peak: AtomicUsize,
    pub model_loads: AtomicU64,
    /// Requests whose client went away before they finished.
    pub cancelled: AtomicU64,
    /// Generations run (for the mean service time).
    generations: AtomicU64,
    /// Requests refused with 429 because the queue was full.
    pub rejected_queue_full: AtomicU64,
    /// Forward passes of decode; proposals a drafter made and of them those kept.
    decode_passes: AtomicU64,
    drafted: AtomicU64,
    draft_accepted: AtomicU64,
    /// Prompt tokens taken from prefixes computed before.
    prefix_reused: AtomicU64,
    /// The engine's KV budget as last read (after a request finished).
    kv: Mutex<Option<libvoom::kv::KvPoolStats>>,
}

impl Metrics {
    pub fn record_request(&self, endpoint: &str, status: u16) {
        *self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((endpoint.to_string(), status))
            .or_default() += 1;
    }

    /// Mean seconds one generation held the engine (prefill and decode), if any ran.
    pub fn mean_generation_secs(&self) -> Option<f64> {
        let n = self.generations.load(Ordering::Relaxed);
        let us = self.prefill_us.load(Ordering::Relaxed) + self.decode_us.load(Ordering::Relaxed);
        (n > 0).then(|| us as f64 / 1e6 / n as f64)
    }

    /// The engine's KV budget now.
    pub fn record_kv(&self, k: libvoom::kv::KvPoolStats) {
        *self.kv.lock().unwrap_or_else(|e| e.into_inner()) = Some(k);
    }

    pub fn record_generation(&self, g: &libvoom::engine::Generation) {
        let us = |secs: f64| (secs * 1e6) as u64;
        self.generations.fetch_add(1, Ordering::Relaxed);
        self.prompt_tokens
            .fetch_add(g.prompt_tokens as u64, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(g.ids.len() as u64, Ordering::Relaxed);
        self.prefill_us
            .fetch_add(us(g.prefill_secs), Ordering::Relaxed);
        self.decode_us
            .fetch_add(us(g.decode_secs), Ordering::Relaxed);
        self.prefill_wait_us
            .fetch_add(us(g.prefill_page_wait_secs), Ordering::Relaxed);
        self.decode_wait_us
            .fetch_add(us(g.decode_page_wait_secs), Ordering::Relaxed);
        self.decode_passes
            .fetch_add(g.decode_passes as u64, Ordering::Relaxed);
        self.prefix_reused
            .fetch_add(g.prefix_reused as u64, Ordering::Relaxed);
        if let Some(r) = &g.speculation {
            self.drafted.fetch_add(r.drafted as u64, Ordering::Relaxed);
            self.draft_accepted
                .fetch_add(r.accepted as u64, Ordering::Relaxed);
        }
    }

    /// The Prometheus exposition; `extra` lines (already formatted) are appended.
    pub fn render(&self, extra: &[(String, f64, &str)]) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# HELP voom_requests_total HTTP requests by endpoint and status.\n# TYPE voom_requests_total counter"
        );
        for ((endpoint, status), n) in self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let _ = writeln!(
                s,
                "voom_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}"
            );
        }
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let completion = load(&self.completion_tokens);
        let decode_s = load(&self.decode_us) as f64 / 1e6;
        let prompt = load(&self.prompt_tokens);
        let prefill_s = load(&self.prefill_us) as f64 / 1e6;
        let secs = |a: &AtomicU64| load(a) as f64 / 1e6;
        let rows: [(&str, &str, &str, f64); 17] = [
            (
                "voom_prompt_tokens_total",
                "counter",
                "Prompt tokens processed.",
                prompt as f64,
            ),
            (
                "voom_completion_tokens_total",
                "counter",
                "Tokens generated.",
                completion as f64,
            ),
            (
                "voom_prefill_seconds_total",
                "counter",
                "Seconds spent in prefill.",
                prefill_s,
            ),
            (
                "voom_decode_seconds_total",
                "counter",
                "Seconds spent decoding.",
                decode_s,
            ),
            (
                "voom_prefill_page_wait_seconds_total",
                "counter",
                "Of the prefill seconds, those the passes waited for pages.",
                secs(&self.prefill_wait_us),
            ),
            (
                "voom_decode_page_wait_seconds_total",
                "counter",
                "Of the decode seconds, those the passes waited for pages.",
                secs(&self.decode_wait_us),
            ),
            (
                "voom_decode_tokens_per_second",
                "gauge",
                "Generated tokens per decode second, over the server's life.",
                if decode_s > 0.0 {
                    completion as f64 / decode_s
                } else {
                    0.0
                },
            ),
            (
                "voom_queue_depth",
                "gauge",
                "Requests waiting for the engine.",
                self.queue_depth.load(Ordering::Relaxed) as f64,
            ),
            (
                "voom_engine_busy",
                "gauge",
                "Requests the engine computes now (its batch; 0 when idle).",
                self.busy.load(Ordering::Relaxed) as f64,
            ),
            (
                "voom_batch_peak",
                "gauge",
                "The most requests computed together (in one sweep of the weights per step) so far.",
                self.batch_peak.load(Ordering::Relaxed) as f64,
            ),
            (
                "voom_model_loads_total",
                "counter",
                "Engines loaded (model swaps).",
                load(&self.model_loads) as f64,
            ),
            (
                "voom_requests_cancelled_total",
                "counter",
                "Requests whose client went away before the end.",
                load(&self.cancelled) as f64,
            ),
            (
                "voom_requests_rejected_queue_full_total",
                "counter",
                "Requests refused with 429 because the engine's queue was full.",
                load(&self.rejected_queue_full) as f64,
            ),
            (
                "voom_prefix_tokens_reused_total",
                "counter",
                "Prompt tokens taken from a prefix computed before instead of computed.",
                load(&self.prefix_reused) as f64,
            ),
            (
                "voom_decode_passes_total",
                "counter",
                "Forward passes of decode (one sweep of the weights each).",
                load(&self.decode_passes) as f64,
            ),
            (
                "voom_draft_tokens_total",
                "counter",
                "Tokens a drafter proposed and a pass verified (speculative decoding).",
                load(&self.drafted) as f64,
            ),
            (
                "voom_draft_tokens_accepted_total",
                "counter",
                "Of the proposed tokens, those kept.",
                load(&self.draft_accepted) as f64,
            ),
        ];
        let kv = self
            .kv
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_default();
        let kv_rows: [(&str, &str, &str, f64); 6] = [
            (
                "voom_kv_resident_bytes",
                "gauge",
                "Bytes of closed KV pages in memory.",
                kv.resident_bytes as f64,
            ),
            (
                "voom_kv_spilled_bytes",
                "gauge",
                "Bytes of KV pages spilled to disk beyond the KV budget.",
                kv.spilled_bytes as f64,
            ),
            (
                "voom_kv_spill_written_bytes_total",
                "counter",
                "Bytes of KV pages written to the spill file.",
                kv.written_bytes as f64,
            ),
            (
                "voom_kv_spill_read_bytes_total",
                "counter",
                "Bytes of KV pages read back from the spill file.",
                kv.read_bytes as f64,
            ),
            (
                "voom_kv_pages_corrupt_total",
                "counter",
                "Spilled KV pages that failed their checksum (never used).",
                kv.corrupt as f64,
            ),
            (
                "voom_kv_positions_recomputed_total",
                "counter",
                "KV positions computed again because their spilled page was lost.",
                kv.recomputed_positions as f64,
            ),
        ];
        for (name, ty, help, v) in rows.into_iter().chain(kv_rows) {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {ty}\n{name} {v}");
        }
        for (name, v, help) in extra {
            let base = name.split('{').next().unwrap_or(name);
            let _ = writeln!(s, "# HELP {base} {help}\n# TYPE {base} gauge\n{name} {v}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_lists_counters_with_help_and_type() {
        let m = Metrics::default();
        m.record_request("/v1/chat/completions", 200);
        m.record_request("/v1/chat/completions", 200);
        m.record_request("/v1/messages", 400);
        m.record_generation(&libvoom::engine::Generation {
            prompt_tokens: 10,
            ids: vec![1; 20],
            prefill_secs: 0.5,
            decode_secs: 2.0,
            decode_page_wait_secs: 0.25,
            prefill_page_wait_secs: 0.0,
            finish: libvoom::engine::FinishReason::Length,
            logits: Vec::new(),
            constraint_secs: 0.0,
            pages: None,
            decode_pages: None,
            decode_passes: 7,
            prefix_reused: 40,
            prefill_multiply_adds: 0,
            backend: "cpu-portable".into(),
            exactness_note: None,
            speculation: Some(libvoom::speculate::SpecReport {
                drafter: "prompt-lookup".into(),
                scheme: "exact".into(),
                drafted: 15,
                accepted: 12,
                passes: 7,
                verify_passes: 5,
                stopped: None,
            }),
        });
        let s = m.render(&[]);
        assert!(
            s.contains("voom_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 2")
        );
        assert!(s.contains("voom_requests_total{endpoint=\"/v1/messages\",status=\"400\"} 1"));
        assert!(s.contains("voom_completion_tokens_total 20"));
        assert!(s.contains("voom_decode_tokens_per_second 10"));
        assert!(s.contains("voom_decode_page_wait_seconds_total 0.25"));
        assert!(s.contains("voom_decode_passes_total 7\n"));
        assert!(s.contains("voom_prefix_tokens_reused_total 40\n"));
        assert!(s.contains("voom_draft_tokens_total 15\n"));
        assert!(s.contains("voom_draft_tokens_accepted_total 12\n"));
        assert!(s.contains("voom_prefill_page_wait_seconds_total 0\n"));
        assert!(s.contains("# TYPE voom_queue_depth gauge"));
        m.record_kv(libvoom::kv::KvPoolStats {
            spilled_bytes: 4096,
            read_bytes: 8192,
            ..Default::default()
        });
        let s = m.render(&[]);
        assert!(s.contains("voom_kv_spilled_bytes 4096\n"), "{s}");
        assert!(s.contains("voom_kv_spill_read_bytes_total 8192\n"), "{s}");
    }
}
