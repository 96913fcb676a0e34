//! Per-tier statistics: reads, bytes, errors, latency.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;

/// Counters a tier updates on every read; cheap enough for the hot path.
#[derive(Debug, Default)]
pub struct TierCounters {
    reads: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
    integrity_failures: AtomicU64,
    busy_ns: AtomicU64,
    max_ns: AtomicU64,
}

/// A snapshot of a tier's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct TierStats {
    pub reads: u64,
    pub bytes: u64,
    pub errors: u64,
    pub integrity_failures: u64,
    /// Total time spent in reads.
    pub busy_secs: f64,
    /// Slowest single read.
    pub max_read_secs: f64,
    /// Mean read bandwidth while reading (bytes / busy time), GB/s.
    pub gb_per_sec: f64,
}

impl TierCounters {
    pub fn record_read(&self, bytes: u64, took: Duration) {
        let ns = took.as_nanos().min(u64::MAX as u128) as u64;
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.busy_ns.fetch_add(ns, Ordering::Relaxed);
        self.max_ns.fetch_max(ns, Ordering::Relaxed);
    }

    pub fn record_error(&self) {
        self.errors.fetch_add(1, Ordering::Relaxed);
    }

    pub fn record_integrity_failure(&self) {
        self.integrity_failures.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> TierStats {
        let bytes = self.bytes.load(Ordering::Relaxed);
        let busy = self.busy_ns.load(Ordering::Relaxed);
        TierStats {
            reads: self.reads.load(Ordering::Relaxed),
            bytes,
            errors: self.errors.load(Ordering::Relaxed),
            integrity_failures: self.integrity_failures.load(Ordering::Relaxed),
            busy_secs: busy as f64 / 1e9,
            max_read_secs: self.max_ns.load(Ordering::Relaxed) as f64 / 1e9,
            gb_per_sec: if busy == 0 {
                0.0
            } else {
                bytes as f64 / busy as f64
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_sums_reads() {
        let c = TierCounters::default();
        c.record_read(1000, Duration::from_micros(1));
        c.record_read(3000, Duration::from_micros(3));
        c.record_error();
        let s = c.snapshot();
        assert_eq!((s.reads, s.bytes, s.errors), (2, 4000, 1));
        assert!((s.gb_per_sec - 1.0).abs() < 1e-9, "{}", s.gb_per_sec);
        assert!((s.max_read_secs - 3e-6).abs() < 1e-12);
    }
}
