//! Choosing the next token from logits: greedy (the default, deterministic), or
//! temperature / top-k / top-p sampling from a seeded generator.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 1.0 disables nucleus sampling.
    pub top_p: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    /// Seed of the sampling generator; the same seed gives the same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }

    /// Checks ranges; the message names the bad parameter.
    pub fn validate(&self) -> Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        Ok(())
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha20Rng,
}

/// Index of the largest logit; the first one on ties (as `torch.argmax`).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = ChaCha20Rng::seed_from_u64(params.seed);
        Sampler { params, rng }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        let dist = self.distribution(logits);
        let r: f64 = self.rng.gen();
        draw(&dist, r)
    }

    /// The distribution a sampled pick draws from: the candidates left by top-k and
    /// top-p, sorted by logit (descending; ties by id), with their probabilities
    /// (summing to one). Empty for greedy parameters.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        if self.params.is_greedy() {
            return Vec::new();
        }
        // Candidates sorted by logit, descending; ties by id for determinism.
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .map(|(i, &v)| (i as u32, v))
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.params.top_k > 0 {
            cand.truncate(self.params.top_k);
        }
        let t = self.params.temperature as f64;
        let max = cand[0].1 as f64;
        let mut probs: Vec<f64> = cand
            .iter()
            .map(|c| ((c.1 as f64 - max) / t).exp())
            .collect();
        let sum: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        if self.params.top_p < 1.0 {
            // Smallest prefix whose mass reaches top_p (at least one token).
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= self.params.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            let s: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= s);
        }
        cand.iter().map(|c| c.0).zip(probs).collect()
    }

    /// Draws from `dist` (probabilities summing to one), as [`Sampler::sample`]
    /// draws from its distribution.
    pub fn draw(&mut self, dist: &[(u32, f64)]) -> u32 {
        let r: f64 = self.rng.gen();
        draw(dist, r)
    }

    /// Speculative sampling's check of `proposed`, drawn by a drafter from
    /// distribution `q`, against the distribution `p` of `logits`: kept with
    /// probability min(1, p(d) / q(d)), else an id drawn from max(0, p - q)
    /// renormalized. The id returned is distributed as p exactly (whatever q is),
    /// though not by the draws [`Sampler::sample`] would make. Greedy parameters pick
    /// the argmax.
    pub fn verify(&mut self, logits: &[f32], proposed: u32, q: &[(u32, f64)]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        let p = self.distribution(logits);
        // q by id (a vocabulary's worth of candidates is searched once per id).
        let mut qv = vec![0.0f64; logits.len()];
        for &(id, qi) in q {
            if let Some(x) = qv.get_mut(id as usize) {
                *x = qi;
            }
        }
        let q_of = |id: u32| qv.get(id as usize).copied().unwrap_or(0.0);
        let pd = p.iter().find(|x| x.0 == proposed).map_or(0.0, |x| x.1);
        let qd = q_of(proposed);
        let r: f64 = self.rng.gen();
        if qd > 0.0 && r * qd < pd {
            return proposed;
        }
        let mut rest: Vec<(u32, f64)> = p
            .iter()
            .map(|&(id, pi)| (id, (pi - q_of(id)).max(0.0)))
            .filter(|x| x.1 > 0.0)
            .collect();
        let mass: f64 = rest.iter().map(|x| x.1).sum();
        if mass <= 0.0 {
            // p and q agree (to rounding): a draw from p itself.
            return self.draw(&p);
        }
        rest.iter_mut().for_each(|x| x.1 /= mass);
        self.draw(&rest)
    }
}

/// The id of `dist` where its cumulative mass passes `r`.
fn draw(dist: &[(u32, f64)], r: f64) -> u32 {
    let mut acc = 0.0;
    for &(id, p) in dist {
        acc += p;
        if r < acc {
            return id;
        }
    }
    dist[dist.len() - 1].0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_first_max() {
        assert_eq!(argmax(&[0.0, 2.0, 2.0, 1.0]), 1);
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.0, -1.0, 3.0]), 2);
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_restricts() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 3,
            seed: 7,
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone());
            (0..100).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p.clone());
            (0..100).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        let mut top: Vec<u32> = (0..50u32).collect();
        top.sort_by(|&x, &y| logits[y as usize].total_cmp(&logits[x as usize]));
        for t in &a {
            assert!(top[..3].contains(t));
        }
        // More than one distinct token is drawn at temperature 1.
        assert!(a.iter().any(|&t| t != a[0]));
    }

    #[test]
    fn tiny_top_p_is_greedy() {
        let logits = [0.1f32, 5.0, 4.9, -2.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.01,
            top_k: 0,
            seed: 1,
        });
        for _ in 0..20 {
            assert_eq!(s.sample(&logits), 1);
        }
    }

    /// Speculative sampling's ids follow the target's distribution whatever the
    /// drafter's: 200,000 checks of proposals drawn from a q unlike p (a flat one, a
    /// sharp one on the wrong id), each id's frequency within 0.005 of p.
    #[test]
    fn verified_proposals_come_out_with_the_targets_probabilities() {
        let logits = [0.3f32, 2.0, 1.1, -0.4, 1.9, 0.8, -3.0];
        let params = SamplingParams {
            temperature: 0.8,
            top_p: 0.97,
            top_k: 0,
            seed: 42,
        };
        let p = Sampler::new(params.clone()).distribution(&logits);
        assert!(p.len() >= 4 && p.len() < logits.len(), "{p:?}");
        let flat: Vec<(u32, f64)> = (0..7).map(|i| (i, 1.0 / 7.0)).collect();
        let sharp = vec![(3u32, 0.9), (1, 0.1)];
        for q in [flat, sharp, p.clone()] {
            let mut drafter = Sampler::new(SamplingParams {
                seed: 7,
                ..params.clone()
            });
            let mut s = Sampler::new(params.clone());
            let n = 200_000;
            let mut count = [0usize; 7];
            let mut kept = 0;
            for _ in 0..n {
                let d = drafter.draw(&q);
                let id = s.verify(&logits, d, &q);
                kept += usize::from(id == d);
                count[id as usize] += 1;
            }
            for id in 0..7u32 {
                let want = p.iter().find(|x| x.0 == id).map_or(0.0, |x| x.1);
                let got = count[id as usize] as f64 / n as f64;
                assert!(
                    (got - want).abs() < 0.005,
                    "q {q:?}: id {id} drawn {got}, p {want}"
                );
            }
            // The drafter's own distribution is always kept.
            if q == p {
                assert_eq!(kept, n);
            }
        }
        // Greedy: the argmax.
        let mut g = Sampler::new(SamplingParams::default());
        assert_eq!(g.verify(&logits, 4, &[(4, 1.0)]), 1);
    }

    #[test]
    fn validate_names_bad_parameter() {
        let p = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        };
        assert!(p.validate().unwrap_err().contains("top_p"));
    }
}
