//! Memory read bandwidth probe: the physical bound of decode with weights resident.
//!
//! Sums a buffer of `u64` much larger than the caches, split across threads, and
//! reports bytes read per second. Benches report kernel speed as a ratio to this
//! figure measured in the same run (DESIGN.md, "Physical limits").

use std::time::Instant;

/// Read bandwidth in GB/s (10^9 bytes per second): the median over `reps` passes of
/// summing a `bytes`-byte buffer on `threads` threads (see [`ReadProbe`]). `threads`
/// and `reps` of 0 count as 1; returns 0.0 if the buffer holds fewer than one `u64`.
pub fn read_bandwidth(bytes: usize, threads: usize, reps: usize) -> f64 {
    let probe = ReadProbe::new(bytes);
    let mut rates: Vec<f64> = (0..reps.max(1)).map(|_| probe.pass(threads)).collect();
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}

/// A buffer to time read passes over, allocated and written once (so page faults
/// are not measured). Lets a bench interleave bandwidth passes with kernel passes,
/// so that both see the same machine load.
pub struct ReadProbe {
    buf: Vec<u64>,
}

impl ReadProbe {
    /// A probe over `bytes` bytes (rounded down to whole `u64`s), filled with
    /// pseudo-random bits: memory that compresses or deduplicates well (zeros,
    /// counters) can read faster on virtual machines than real weights do, which
    /// would inflate the bound.
    pub fn new(bytes: usize) -> ReadProbe {
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        ReadProbe {
            buf: (0..bytes / 8)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    s
                })
                .collect(),
        }
    }

    /// GB/s of one pass summing `bytes` (whole `u64`s; a tail is ignored) on
    /// `threads` threads: the bandwidth of reading data that is already in memory,
    /// such as a model's mapped weights.
    pub fn pass_over(bytes: &[u8], threads: usize) -> f64 {
        // SAFETY: any initialised bytes are valid u64s; `align_to` gives an aligned
        // middle part only.
        let (_, words, _) = unsafe { bytes.align_to::<u64>() };
        pass_words(words, threads)
    }

    /// One timed pass on `threads` threads (0 counts as 1), each summing an equal
    /// share of the buffer; GB/s of the bytes read. 0.0 for an empty buffer.
    pub fn pass(&self, threads: usize) -> f64 {
        pass_words(&self.buf, threads)
    }
}

fn pass_words(buf: &[u64], threads: usize) -> f64 {
    {
        let threads = threads.max(1);
        let per_thread = buf.len() / threads;
        if per_thread == 0 {
            return 0.0;
        }
        let used = &buf[..per_thread * threads];
        let start = Instant::now();
        let total = std::thread::scope(|s| {
            let handles: Vec<_> = used
                .chunks(per_thread)
                .map(|part| s.spawn(move || sum_u64(part)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(0))
                .fold(0u64, u64::wrapping_add)
        });
        let secs = start.elapsed().as_secs_f64();
        std::hint::black_box(total);
        (used.len() * 8) as f64 / secs / 1e9
    }
}

/// Wrapping sum with independent accumulators, so the loop is load bound, not bound
/// by the latency of one add chain.
fn sum_u64(v: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected just above.
        return unsafe { sum_u64_avx2(v) };
    }
    sum_u64_plain(v)
}

#[inline(always)]
fn sum_u64_plain(v: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for l in 0..8 {
            acc[l] = acc[l].wrapping_add(c[l]);
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(0u64, |a, &b| a.wrapping_add(b));
    acc.iter().fold(tail, |a, &b| a.wrapping_add(b))
}

/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_u64_avx2(v: &[u64]) -> u64 {
    // Same code; the target feature lets LLVM use 256-bit loads and adds.
    sum_u64_plain(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_match_a_plain_fold() {
        for len in [0usize, 1, 7, 8, 9, 1000, 4099] {
            let v: Vec<u64> = (0..len as u64)
                .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                .collect();
            let want = v.iter().fold(0u64, |a, &b| a.wrapping_add(b));
            assert_eq!(sum_u64(&v), want);
            assert_eq!(sum_u64_plain(&v), want);
        }
    }

    #[test]
    fn bandwidth_is_positive_and_finite() {
        for threads in [1, 2] {
            let gbs = read_bandwidth(8 << 20, threads, 3);
            assert!(gbs.is_finite() && gbs > 0.1, "{gbs} GB/s");
        }
        assert_eq!(read_bandwidth(8, 2, 1), 0.0);
        assert_eq!(ReadProbe::new(0).pass(1), 0.0);
    }
}
