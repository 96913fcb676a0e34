//! How many tokens to draft, from what is measured: a verify pass of n positions
//! commits on average `(1 - a^(k+1)) / (1 - a)` tokens for k proposals each kept
//! with probability `a` (once one is rejected the rest are), and costs the pass's
//! seconds plus the drafting's. The draft length with the most tokens per second
//! wins; where that is none (plain decoding beats every length), drafting stops for
//! the request once enough proposals were seen to say so.
//!
//! A pass's seconds are measured per number of positions and fitted as
//! `t(n) = t(1) + (n - 1) * per_position`: out of core the sweep of the weights
//! dominates and extra positions cost little; resident, each position costs its
//! share of compute. The first pass is plain, the second drafts two ids (what an
//! extra position costs is measured on a short pass), then the fit decides.

/// The draft length that measures what an extra position costs, before any wider
/// pass was seen.
const PROBE: usize = 2;

/// The draft-length controller of one generation.
#[derive(Debug, Clone)]
pub struct Adaptive {
    /// The longest draft.
    pub max_k: usize,
    /// Proposals verified before drafting may stop for the request.
    pub min_evidence: usize,
    kept: f64,
    rejected: f64,
    drafted: usize,
    /// Mean seconds of a pass, per number of positions (index n - 1).
    pass: Vec<Mean>,
    /// Mean seconds of drafting, per proposed token.
    draft: Mean,
    stopped: Option<String>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Mean {
    sum: f64,
    n: u32,
}

impl Mean {
    fn add(&mut self, x: f64) {
        // Recent passes weigh more (the page cache warms, the machine drifts).
        if self.n >= 16 {
            self.sum *= 15.0 / 16.0;
            self.n = 15;
        }
        self.sum += x;
        self.n += 1;
    }

    fn get(&self) -> Option<f64> {
        (self.n > 0).then(|| self.sum / self.n as f64)
    }
}

impl Adaptive {
    pub fn new(max_k: usize) -> Self {
        Adaptive {
            max_k,
            min_evidence: 16,
            kept: 0.0,
            rejected: 0.0,
            drafted: 0,
            pass: vec![Mean::default(); max_k + 1],
            draft: Mean::default(),
            stopped: None,
        }
    }

    /// The probability that a proposal is kept, given the ones before it were
    /// (a prior of one kept and one rejected).
    pub fn acceptance(&self) -> f64 {
        (self.kept + 1.0) / (self.kept + self.rejected + 2.0)
    }

    /// Why drafting stopped, once it has.
    pub fn stopped(&self) -> Option<&str> {
        self.stopped.as_deref()
    }

    /// A pass of `positions` positions took `secs`.
    pub fn observe_pass(&mut self, positions: usize, secs: f64) {
        if let Some(m) = self.pass.get_mut(positions.saturating_sub(1)) {
            m.add(secs);
        }
    }

    /// Drafting `tokens` proposals took `secs`.
    pub fn observe_draft(&mut self, tokens: usize, secs: f64) {
        if tokens > 0 {
            self.draft.add(secs / tokens as f64);
        }
    }

    /// Of `drafted` proposals verified in one pass, the first `kept` were kept.
    pub fn observe_verify(&mut self, drafted: usize, kept: usize) {
        self.drafted += drafted;
        self.kept += kept as f64;
        if kept < drafted {
            self.rejected += 1.0;
        }
    }

    /// Seconds of a pass of `n` positions, as fitted (None before a one-position
    /// pass was measured).
    pub fn pass_secs(&self, n: usize) -> Option<f64> {
        let one = self.pass[0].get()?;
        if n <= 1 {
            return Some(one);
        }
        if let Some(t) = self.pass.get(n - 1).and_then(Mean::get) {
            return Some(t);
        }
        // The slope through the one-position pass and the widest pass measured.
        let slope = (1..self.pass.len())
            .rev()
            .find_map(|i| self.pass[i].get().map(|t| (t - one) / i as f64))
            .unwrap_or(0.0)
            .max(0.0);
        Some(one + slope * (n - 1) as f64)
    }

    /// Tokens a pass is expected to commit with `k` proposals.
    pub fn expected_tokens(&self, k: usize) -> f64 {
        let a = self.acceptance();
        (1.0 - a.powi(k as i32 + 1)) / (1.0 - a)
    }

    /// How many tokens to draft now, at most `room` (the tokens still wanted less
    /// one, and the context's room). 0: a plain pass. Before `min_evidence`
    /// proposals were verified it drafts the best length even where the estimate
    /// says plain decoding is faster (the estimate rests on a prior until then).
    pub fn next_k(&mut self, room: usize) -> usize {
        let room = room.min(self.max_k);
        if self.stopped.is_some() || room == 0 {
            return 0;
        }
        // A plain pass first, to measure what drafting must beat; then a short draft,
        // to measure what a position costs before drafting long.
        let Some(plain) = self.pass_secs(1) else {
            return 0;
        };
        if self.pass[1..].iter().all(|m| m.get().is_none()) {
            return room.min(PROBE);
        }
        let per_draft = self.draft.get().unwrap_or(0.0);
        let rate = |k: usize| {
            let secs = self.pass_secs(k + 1).unwrap_or(plain) + per_draft * k as f64;
            self.expected_tokens(k) / secs.max(f64::MIN_POSITIVE)
        };
        let best = (1..=room)
            .max_by(|&x, &y| rate(x).total_cmp(&rate(y)))
            .unwrap_or(0);
        if rate(best) > rate(0) {
            return best;
        }
        // Too few proposals seen to judge: drafting is how they are seen.
        if self.drafted < self.min_evidence {
            return best;
        }
        self.stopped = Some(format!(
            "acceptance {:.2} over {} proposals: drafting {} would commit {:.2} tokens a \
             pass where plain decoding is faster",
            self.acceptance(),
            self.drafted,
            best,
            self.expected_tokens(best)
        ));
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_pass_then_a_short_draft_then_the_fit() {
        let mut a = Adaptive::new(6);
        assert_eq!(a.next_k(10), 0, "nothing measured yet");
        a.observe_pass(1, 1.0);
        // What an extra position costs is measured on a short draft first.
        assert_eq!(a.next_k(10), PROBE);
        assert_eq!(a.next_k(1), 1, "no more than the room");
        // Positions nearly free (out of core): the longest draft.
        a.observe_pass(PROBE + 1, 1.01);
        a.observe_verify(PROBE, PROBE);
        assert_eq!(a.next_k(10), 6);
        assert_eq!(a.next_k(3), 3, "no more than the room");
    }

    #[test]
    fn out_of_core_passes_draft_long_resident_ones_stop_when_acceptance_is_low() {
        // Out of core: a pass costs the sweep, positions little.
        let mut a = Adaptive::new(8);
        a.observe_pass(1, 1.0);
        a.observe_pass(9, 1.08);
        for _ in 0..10 {
            a.observe_verify(8, 4);
        }
        let k = a.next_k(100);
        assert!(k >= 4, "{k}");

        // Resident: each position costs as much as the pass; a low acceptance
        // cannot pay for it, and after enough proposals drafting stops.
        let mut r = Adaptive::new(8);
        r.observe_pass(1, 1.0);
        r.observe_pass(3, 3.0);
        for _ in 0..10 {
            r.observe_verify(2, 0);
        }
        assert_eq!(r.next_k(100), 0);
        assert!(r.stopped().is_some());
        assert_eq!(r.next_k(100), 0, "stays stopped");
    }

    #[test]
    fn drafting_costs_count() {
        let mut a = Adaptive::new(4);
        a.observe_pass(1, 1.0);
        a.observe_pass(5, 1.0);
        for _ in 0..4 {
            a.observe_verify(4, 4);
        }
        assert_eq!(a.next_k(10), 4);
        // A drafter five times slower per token than a pass of the target: even
        // proposals nearly always kept do not pay for it.
        a.observe_draft(1, 5.0);
        assert_eq!(a.next_k(10), 0);
        assert!(a.stopped().is_some());
    }

    #[test]
    fn the_fit_interpolates_widths_not_measured() {
        let mut a = Adaptive::new(8);
        a.observe_pass(1, 1.0);
        a.observe_pass(5, 2.0);
        assert_eq!(a.pass_secs(5), Some(2.0));
        assert_eq!(a.pass_secs(3), Some(1.5));
        assert_eq!(a.pass_secs(9), Some(3.0));
    }
}
