//! `voom perplexity MODEL --text FILE`: the perplexity of a text as llama.cpp's
//! `llama-perplexity` computes it, and with `--kl-base EXACT` the KL divergence of
//! the model's next-token distributions from an exact model's, as its
//! `--kl-divergence` reports it.
//!
//! The text is tokenized once, with the model's special tokens (a BOS where the
//! tokenizer adds one), and cut into `tokens / ctx` chunks of `ctx` tokens. Each
//! chunk is computed in a fresh KV cache, its first token replaced by BOS where the
//! tokenizer adds one, and only its second half is scored: the logits at position
//! `j` in `[ctx/2, ctx - 1)` predict token `j + 1`, each with
//! `nll = -log softmax(logits)[token]` (llama.cpp's own log-softmax: the maximum
//! subtracted in f32, `exp` in f32, the sum and the log in f64). PPL is
//! `exp(mean nll)` and its uncertainty llama.cpp's (the standard error of the mean
//! nll, times PPL). The positions of a chunk before the scored half are computed in
//! one pass without logits, the scored ones in a second with every position's
//! logits (the same bits as one pass on a batch-invariant backend; the chunk's last
//! token predicts nothing and is not computed).
//!
//! KL divergence is `sum_i p_base(i) (log p_base(i) - log p_model(i))` at each scored
//! position, computed in f64 from both models' f32 logits (llama.cpp rounds the
//! base's log-probabilities to 16 bits in its logits file and drops terms below
//! `exp(-16)`; here nothing is rounded or dropped, so a model against itself gives
//! exactly 0). Both engines are open at once and each chunk is computed by both.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use libvoom::engine::Engine;
use rayon::prelude::*;
use serde_json::json;

use super::common::{self, EngineArgs};

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    /// Model directory or name in the local store.
    pub model: String,
    /// The text to score (UTF-8; one trailing newline is dropped, as llama.cpp's
    /// `-f` does).
    #[arg(long, value_name = "FILE")]
    pub text: PathBuf,
    /// Tokens of each chunk (llama.cpp's `-c`): each chunk is computed in a fresh
    /// context and its second half scored.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Chunks to score at most [default: all, the text's tokens / ctx].
    #[arg(long)]
    pub chunks: Option<usize>,
    /// An exact model of the same vocabulary to compare with: the KL divergence of
    /// MODEL's next-token distributions from its, and how often their top tokens agree.
    #[arg(long, value_name = "EXACT_MODEL")]
    pub kl_base: Option<String>,
    /// Print one JSON object (ppl, ppl_stderr, tokens, chunks, ctx, kl, exact,
    /// scheme) as the last line of stdout.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// `-log softmax(logits)[tok]` as llama.cpp's `log_softmax` computes it: the maximum
/// subtracted in f32, each `exp` in f32 summed in f64 in order, then
/// `(logits[tok] - max) - ln(sum)` in f64.
pub fn token_nll(logits: &[f32], tok: usize) -> f64 {
    let max = max_logit(logits);
    let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    -(f64::from(logits[tok] - max) - sum.ln())
}

/// The largest logit, as `std::max` over them in order finds it.
fn max_logit(logits: &[f32]) -> f32 {
    logits[1..]
        .iter()
        .fold(logits[0], |m, &l| if m < l { l } else { m })
}

/// The first index of the largest logit (llama.cpp's `imax`).
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate().skip(1) {
        if l > logits[best] {
            best = i;
        }
    }
    best
}

/// The log-probabilities of `logits` in f64, with [`token_nll`]'s operations.
fn log_probs(logits: &[f32]) -> Vec<f64> {
    let max = max_logit(logits);
    let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    let ln_sum = sum.ln();
    logits
        .iter()
        .map(|&l| f64::from(l - max) - ln_sum)
        .collect()
}

/// `KL(base || model) = sum_i p_base(i) (log p_base(i) - log p_model(i))` of two
/// positions' logits, in f64 (terms where `p_base(i)` is 0 are 0).
pub fn kl_divergence(base: &[f32], model: &[f32]) -> f64 {
    let lb = log_probs(base);
    let lm = log_probs(model);
    lb.iter()
        .zip(&lm)
        .map(|(&b, &m)| {
            let p = b.exp();
            if p == 0.0 {
                0.0
            } else {
                p * (b - m)
            }
        })
        .sum()
}

/// Sums of a per-token value and its square, and their count.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Sums {
    pub sum: f64,
    pub sum2: f64,
    pub count: usize,
}

impl Sums {
    pub fn add(&mut self, v: f64) {
        self.sum += v;
        self.sum2 += v * v;
        self.count += 1;
    }

    pub fn mean(&self) -> f64 {
        self.sum / self.count as f64
    }

    /// The standard error of the mean as `llama-perplexity`'s final estimate computes
    /// it: `sqrt((mean(v^2) - mean(v)^2) / (count - 1))`; `None` where that variance
    /// is not positive (llama.cpp then prints an error instead of the estimate).
    pub fn stderr(&self) -> Option<f64> {
        let n = self.count as f64;
        let mean = self.sum / n;
        let var = self.sum2 / n - mean * mean;
        (var > 0.0 && self.count > 1).then(|| (var / (n - 1.0)).sqrt())
    }

    /// The mean and its uncertainty as `--kl-divergence` prints them
    /// (`mean_and_uncertainty`: 0 for fewer than 11 values or no variance).
    pub fn mean_and_uncertainty(&self) -> (f64, f64) {
        if self.count < 1 {
            return (0.0, 0.0);
        }
        let n = self.count as f64;
        let f = self.sum / n;
        let df = self.sum2 / n - f * f;
        let df = if df > 0.0 && self.count > 10 {
            (df / (n - 1.0)).sqrt()
        } else {
            0.0
        };
        (f, df)
    }

    /// `exp(mean)`: the perplexity of these negative log-likelihoods.
    pub fn ppl(&self) -> f64 {
        self.mean().exp()
    }

    /// The perplexity's uncertainty, PPL times the standard error of the mean nll.
    pub fn ppl_stderr(&self) -> Option<f64> {
        self.stderr().map(|e| e * self.ppl())
    }
}

/// The value at `fraction` of sorted `values`, interpolated between neighbours as
/// llama.cpp's `percentile` does.
pub fn percentile(sorted: &[f64], fraction: f64) -> f64 {
    if fraction <= 0.0 {
        return sorted[0];
    }
    if fraction >= 1.0 {
        return sorted[sorted.len() - 1];
    }
    let p = fraction * (sorted.len() - 1) as f64;
    let ip = p as usize;
    let p = p - ip as f64;
    (1.0 - p) * sorted[ip] + p * sorted[(ip + 1).min(sorted.len() - 1)]
}

/// What `--kl-base` measures over the scored positions.
#[derive(Debug, Default)]
pub struct KlStats {
    /// The base model's nll of each scored token.
    pub nll_base: Sums,
    /// Products of the model's and the base's nll, for their covariance.
    pub sum_nll_nll_base: f64,
    pub kld: Sums,
    /// Every position's KL divergence, in order.
    pub values: Vec<f64>,
    /// Positions whose top tokens agree.
    pub same_top: usize,
}

impl KlStats {
    /// The fraction of positions whose top tokens agree, and its uncertainty.
    pub fn same_top(&self) -> (f64, f64) {
        let n = self.kld.count as f64;
        let p = self.same_top as f64 / n;
        let unc = if self.kld.count > 1 {
            (p * (1.0 - p) / (n - 1.0)).sqrt()
        } else {
            0.0
        };
        (p, unc)
    }

    /// The KL divergences sorted.
    fn sorted(&self) -> Vec<f64> {
        let mut v = self.values.clone();
        v.sort_by(f64::total_cmp);
        v
    }
}

/// One scored position's figures.
struct Scored {
    nll: f64,
    /// With a base: its nll, the KL divergence, whether the top tokens agree.
    kl: Option<(f64, f64, bool)>,
}

/// Scores `rows` positions of logits (`vocab` wide), row `r` predicting `next[r]`,
/// with the base's logits of the same positions when given. In parallel over the
/// positions; the result is in position order (the sums do not depend on threads).
fn score(logits: &[f32], base: Option<&[f32]>, next: &[u32], vocab: usize) -> Vec<Scored> {
    (0..next.len())
        .into_par_iter()
        .map(|r| {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let tok = next[r] as usize;
            let nll = token_nll(row, tok);
            let kl = base.map(|b| {
                let brow = &b[r * vocab..(r + 1) * vocab];
                (
                    token_nll(brow, tok),
                    kl_divergence(brow, row),
                    argmax(brow) == argmax(row),
                )
            });
            Scored { nll, kl }
        })
        .collect()
}

/// The logits of positions `first..chunk.len() - 1` of `chunk` computed in a fresh
/// KV cache: the positions before `first` in one pass (no logits kept), the scored
/// ones in a second with every position's logits.
fn chunk_logits(engine: &Engine, chunk: &[u32], first: usize) -> Result<Vec<f32>> {
    let mut kv = engine.new_kv();
    if first > 0 {
        engine.prefill(&mut kv, &chunk[..first])?;
    }
    Ok(engine.forward_all(&mut kv, &chunk[first..chunk.len() - 1])?)
}

/// The BOS id the tokenizer adds in front of a text with special tokens, if it adds
/// one (llama.cpp's `llama_vocab_get_add_bos`).
fn added_bos(tok: &libvoom::text::Tokenizer) -> Result<Option<u32>> {
    let Some(bos) = tok.bos_id() else {
        return Ok(None);
    };
    let with = tok.encode("a", true)?;
    let without = tok.encode("a", false)?;
    Ok((with.first() == Some(&bos) && without.first() != Some(&bos)).then_some(bos))
}

/// The text of `path` with one trailing newline dropped (llama.cpp's `-f`).
fn read_text(path: &Path) -> Result<String> {
    let mut text = std::fs::read_to_string(path)
        .with_context(|| format!("--text: reading {}", path.display()))?;
    if text.ends_with('\n') {
        text.pop();
    }
    Ok(text)
}

/// The chunks to score: `tokens / ctx`, at most `limit`; a text of fewer than
/// `2 * ctx` tokens is an error naming the file and both counts (as llama.cpp
/// refuses it).
pub fn chunk_count(tokens: usize, ctx: usize, limit: Option<usize>, text: &Path) -> Result<usize> {
    if tokens < 2 * ctx {
        bail!(
            "{} tokenizes to only {tokens} tokens: perplexity with --ctx {ctx} needs at least {} (2 x ctx)",
            text.display(),
            2 * ctx
        );
    }
    let n = tokens / ctx;
    Ok(limit.map_or(n, |l| l.min(n)))
}

pub fn run(a: PerplexityArgs) -> Result<()> {
    if a.ctx < 4 {
        bail!(
            "--ctx {} is too small: a chunk scores positions ctx/2..ctx-1 (at least 4)",
            a.ctx
        );
    }
    if a.chunks == Some(0) {
        bail!("--chunks 0 scores nothing");
    }
    let text = read_text(&a.text)?;
    let dir = common::resolve_model(&a.model, false)?;
    let engine = common::open_engine(&dir, &a.engine)?;
    let tok = engine.tokenizer().with_context(|| {
        format!(
            "{} has no tokenizer (tokenizer.json): perplexity needs one to tokenize the text",
            engine.name()
        )
    })?;
    let t0 = Instant::now();
    let ids = tok.encode(&text, true)?;
    let tokenize_secs = t0.elapsed().as_secs_f64();
    let n_chunk = chunk_count(ids.len(), a.ctx, a.chunks, &a.text)?;
    if a.ctx > engine.max_context() {
        bail!(
            "--ctx {} is longer than {}'s context ({})",
            a.ctx,
            engine.name(),
            engine.max_context()
        );
    }
    let vocab = engine.config().vocab_size;
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
        bail!(
            "the tokenizer gave id {bad}, outside {}'s vocabulary of {vocab}",
            engine.name()
        );
    }
    let bos = added_bos(tok)?;
    let base = match &a.kl_base {
        Some(b) => {
            let bdir = common::resolve_model(b, false)?;
            let be = common::open_engine(&bdir, &a.engine)?;
            let bv = be.config().vocab_size;
            if bv != vocab {
                bail!(
                    "--kl-base {} has a vocabulary of {bv} tokens and {} one of {vocab}: KL divergence needs the same vocabulary",
                    be.name(),
                    engine.name()
                );
            }
            if a.ctx > be.max_context() {
                bail!(
                    "--ctx {} is longer than --kl-base {}'s context ({})",
                    a.ctx,
                    be.name(),
                    be.max_context()
                );
            }
            if let Some(bt) = be.tokenizer() {
                if bt.encode(&text, true)? != ids {
                    eprintln!(
                        "voom: warning: --kl-base {} tokenizes the text differently from {}; both are given {}'s ids",
                        be.name(),
                        engine.name(),
                        engine.name()
                    );
                }
            }
            Some(be)
        }
        None => None,
    };
    if let Some(s) = engine.lossy_scheme() {
        eprintln!("[lossy: {s} weights, not the published ones]");
    }
    eprintln!(
        "perplexity: {} tokens ({tokenize_secs:.2} s to tokenize{}); {n_chunk} chunks of {}, scoring positions {}..{} of each",
        ids.len(),
        if bos.is_some() { "; each chunk begins with BOS" } else { "" },
        a.ctx,
        a.ctx / 2,
        a.ctx - 1,
    );

    let first = a.ctx / 2;
    let mut nll = Sums::default();
    let mut kl = base.as_ref().map(|_| KlStats::default());
    let start = Instant::now();
    let mut eval_secs = 0.0;
    let mut base_secs = 0.0;
    let mut running = false;
    for c in 0..n_chunk {
        let mut chunk = ids[c * a.ctx..(c + 1) * a.ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        // The tokens predicted: the originals (never the BOS put in front).
        let next = &ids[c * a.ctx + first + 1..(c + 1) * a.ctx];
        let t = Instant::now();
        let logits = chunk_logits(&engine, &chunk, first)?;
        eval_secs += t.elapsed().as_secs_f64();
        let base_logits = match &base {
            Some(be) => {
                let t = Instant::now();
                let l = chunk_logits(be, &chunk, first)?;
                base_secs += t.elapsed().as_secs_f64();
                Some(l)
            }
            None => None,
        };
        if logits.len() != next.len() * vocab {
            bail!(
                "{} gave {} logits for {} positions of a vocabulary of {vocab}",
                engine.name(),
                logits.len(),
                next.len()
            );
        }
        for s in score(&logits, base_logits.as_deref(), next, vocab) {
            nll.add(s.nll);
            if let (Some(k), Some((nb, kld, same))) = (kl.as_mut(), s.kl) {
                k.nll_base.add(nb);
                k.sum_nll_nll_base += s.nll * nb;
                k.kld.add(kld);
                k.values.push(kld);
                k.same_top += usize::from(same);
            }
        }
        if c == 0 {
            let secs = start.elapsed().as_secs_f64();
            eprintln!(
                "perplexity: {secs:.2} seconds per pass - ETA {:.2} minutes",
                secs * n_chunk as f64 / 60.0
            );
            if kl.is_some() {
                eprintln!("chunk        PPL   ln(PPL/PPL(base))   mean KLD   same top");
            }
        }
        match &kl {
            Some(k) => {
                let (top, _) = k.same_top();
                eprintln!(
                    "{:5}  {:9.4}   {:17.5}   {:8.5}   {:7.3}%",
                    c + 1,
                    nll.ppl(),
                    nll.mean() - k.nll_base.mean(),
                    k.kld.mean(),
                    100.0 * top
                );
            }
            None => {
                // llama.cpp's running values, on one line as it prints them.
                eprint!("[{}]{:.4},", c + 1, nll.ppl());
                running = true;
            }
        }
    }
    if running {
        eprintln!();
    }
    let secs = start.elapsed().as_secs_f64();
    let evaluated = n_chunk * (a.ctx - 1);
    let ppl = nll.ppl();
    let ppl_stderr = nll.ppl_stderr();

    let kl_json = match (&kl, &base) {
        (Some(k), Some(be)) => {
            let sorted = k.sorted();
            let (mean, mean_unc) = k.kld.mean_and_uncertainty();
            let (top, top_unc) = k.same_top();
            let (ln_q, ln_q_unc) = nll.mean_and_uncertainty();
            let (ln_b, ln_b_unc) = k.nll_base.mean_and_uncertainty();
            // llama.cpp's covariance of the two mean nlls (0 for fewer than 10).
            let n = k.kld.count as f64;
            let cov = if k.kld.count < 10 {
                0.0
            } else {
                (k.sum_nll_nll_base / n - (nll.sum / n) * (k.nll_base.sum / n)) / (n - 1.0)
            };
            let ratio_unc = (ln_q_unc * ln_q_unc + ln_b_unc * ln_b_unc - 2.0 * cov)
                .max(0.0)
                .sqrt();
            let median = percentile(&sorted, 0.5);
            Some(json!({
                "base": be.name(),
                "base_exact": be.lossy_scheme().is_none(),
                "base_ppl": ln_b.exp(),
                "base_ppl_stderr": ln_b.exp() * ln_b_unc,
                "ln_ppl_ratio": ln_q - ln_b,
                "ln_ppl_ratio_stderr": ratio_unc,
                "mean": mean,
                "mean_stderr": mean_unc,
                "median": median,
                "p99": percentile(&sorted, 0.99),
                "p99_9": percentile(&sorted, 0.999),
                "max": sorted[sorted.len() - 1],
                "min": sorted[0],
                "same_top": top,
                "same_top_stderr": top_unc,
                "base_secs": base_secs,
            }))
        }
        _ => None,
    };

    let mut report = String::new();
    match ppl_stderr {
        Some(e) => report.push_str(&format!("Final estimate: PPL = {ppl:.4} +/- {e:.5}\n")),
        None => report.push_str(&format!(
            "Final estimate: PPL = {ppl:.4} (no positive variance of the nll: no uncertainty)\n"
        )),
    }
    if let Some(k) = &kl_json {
        let f = |key: &str| k[key].as_f64().unwrap_or(f64::NAN);
        report.push_str(&format!(
            "Mean PPL(base)                : {:10.6} ± {:10.6}\n",
            f("base_ppl"),
            f("base_ppl_stderr")
        ));
        report.push_str(&format!(
            "Mean ln(PPL(Q)/PPL(base))     : {:10.6} ± {:10.6}\n",
            f("ln_ppl_ratio"),
            f("ln_ppl_ratio_stderr")
        ));
        report.push_str(&format!(
            "Mean    KLD: {:10.6} ± {:10.6}\n",
            f("mean"),
            f("mean_stderr")
        ));
        report.push_str(&format!("Maximum KLD: {:10.6}\n", f("max")));
        report.push_str(&format!("99.9%   KLD: {:10.6}\n", f("p99_9")));
        report.push_str(&format!("99.0%   KLD: {:10.6}\n", f("p99")));
        report.push_str(&format!("Median  KLD: {:10.6}\n", f("median")));
        report.push_str(&format!("Minimum KLD: {:10.6}\n", f("min")));
        report.push_str(&format!(
            "Same top p: {:6.3} ± {:5.3} %\n",
            100.0 * f("same_top"),
            100.0 * f("same_top_stderr")
        ));
    }
    report.push_str(&format!(
        "[{}: {} chunks of {}, {} tokens scored; {evaluated} positions in {secs:.1} s, {:.1} tok/s{}]",
        engine.backend_name(),
        n_chunk,
        a.ctx,
        nll.count,
        evaluated as f64 / eval_secs.max(1e-9),
        match engine.lossy_scheme() {
            Some(s) => format!("; lossy: {s}"),
            None => String::new(),
        }
    ));
    if a.json {
        eprintln!("{report}");
        let out = json!({
            "model": engine.name(),
            "text": a.text.display().to_string(),
            "ppl": ppl,
            "ppl_stderr": ppl_stderr,
            "tokens": ids.len(),
            "chunks": n_chunk,
            "ctx": a.ctx,
            "scored": nll.count,
            "bos": bos.is_some(),
            "exact": engine.lossy_scheme().is_none(),
            "scheme": engine.lossy_scheme(),
            "backend": engine.backend_name(),
            "kl": kl_json,
            "timing": {
                "tokenize_secs": tokenize_secs,
                "eval_secs": eval_secs,
                "total_secs": secs,
                "tokens_per_sec": evaluated as f64 / eval_secs.max(1e-9),
            },
        });
        vpaged::outln!("{out}")?;
    } else {
        for line in report.lines() {
            vpaged::outln!("{line}")?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1.0)
    }

    #[test]
    fn nll_of_known_softmaxes() {
        // Equal logits: each token has probability 1/4.
        let l = [0.5f32; 4];
        assert!(close(token_nll(&l, 2), 4f64.ln()));
        // ln 1, ln 2, ln 3, ln 4 as logits: probabilities 1/10, 2/10, 3/10, 4/10 (up
        // to the f32 rounding of the logits and the exponentials).
        let l = [0f32, 2f32.ln(), 3f32.ln(), 4f32.ln()];
        for (t, p) in [0.1f64, 0.2, 0.3, 0.4].into_iter().enumerate() {
            let got = token_nll(&l, t);
            assert!(
                (got - -p.ln()).abs() < 1e-6,
                "token {t}: {got} vs {}",
                -p.ln()
            );
        }
        // A shift of every logit changes nothing; large logits do not overflow.
        let shifted = l.map(|x| x + 1000.0);
        for t in 0..4 {
            assert!((token_nll(&shifted, t) - token_nll(&l, t)).abs() < 1e-3);
        }
        // One dominant logit: nll ~ 0 for it, ~ the gap for the others.
        let l = [30f32, 0.0, 0.0];
        assert!(token_nll(&l, 0) < 1e-12);
        assert!((token_nll(&l, 1) - 30.0).abs() < 1e-9);
    }

    #[test]
    fn nll_is_llama_cpp_s_arithmetic() {
        // The same operations as llama.cpp's log_softmax, written out.
        let l = [1.25f32, -3.5, 0.125, 7.0, 2.0];
        let max = 7.0f32;
        let mut sum = 0f64;
        for &x in &l {
            sum += f64::from((x - max).exp());
        }
        let want = -(f64::from(l[2] - max) - sum.ln());
        assert_eq!(token_nll(&l, 2).to_bits(), want.to_bits());
    }

    #[test]
    fn ppl_and_its_error_as_llama_perplexity_prints_them() {
        let mut s = Sums::default();
        let v = [0.5f64, 1.0, 2.0, 1.5];
        for x in v {
            s.add(x);
        }
        let mean = 1.25f64;
        assert!(close(s.ppl(), mean.exp()));
        let var: f64 = v.iter().map(|x| x * x).sum::<f64>() / 4.0 - mean * mean;
        let err = (var / 3.0).sqrt() * mean.exp();
        assert!(close(s.ppl_stderr().unwrap(), err));
        // No variance: no estimate of the error.
        let mut s = Sums::default();
        s.add(1.0);
        s.add(1.0);
        assert_eq!(s.ppl_stderr(), None);
    }

    #[test]
    fn kl_of_known_distributions() {
        // Identical logits: exactly 0, whatever they are.
        let a = [0.3f32, -1.0, 2.5, 0.0];
        assert_eq!(kl_divergence(&a, &a), 0.0);
        // base (1/2, 1/2) against model (1/4, 3/4): 1/2 ln 2 + 1/2 ln(2/3).
        let base = [0f32, 0.0];
        let model = [0f32, 3f32.ln()];
        let want = 0.5 * 2f64.ln() + 0.5 * (2.0f64 / 3.0).ln();
        assert!((kl_divergence(&base, &model) - want).abs() < 1e-7);
        // Not symmetric, never negative.
        assert!(kl_divergence(&model, &base) > 0.0);
        assert!((kl_divergence(&model, &base) - want).abs() > 1e-3);
    }

    #[test]
    fn argmax_takes_the_first_largest() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[5.0]), 0);
    }

    #[test]
    fn percentiles_interpolate_as_llama_cpp() {
        let v = [0.0, 1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 0.5), 2.0);
        assert_eq!(percentile(&v, 0.99), 0.04 * 3.0 + 0.96 * 4.0);
        assert_eq!(percentile(&v, 1.0), 4.0);
        assert_eq!(percentile(&v, 0.0), 0.0);
    }

    #[test]
    fn scoring_predicts_the_next_token_with_each_row() {
        // Two rows of a vocabulary of 3: row 0 predicts token 2, row 1 token 0.
        let logits = [0f32, 0.0, 3f32.ln(), 2f32.ln(), 0.0, 0.0];
        let s = score(&logits, Some(&logits), &[2, 0], 3);
        assert!((s[0].nll - -(0.6f64).ln()).abs() < 1e-6);
        assert!((s[1].nll - -(0.5f64).ln()).abs() < 1e-6);
        for r in &s {
            let (nb, kld, same) = r.kl.unwrap();
            assert_eq!(nb, r.nll);
            assert_eq!(kld, 0.0);
            assert!(same);
        }
    }

    #[test]
    fn too_short_a_text_names_the_file_and_the_counts() {
        let e = chunk_count(100, 64, None, Path::new("t.txt"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("t.txt") && e.contains("100") && e.contains("128"),
            "{e}"
        );
        assert_eq!(chunk_count(1000, 64, None, Path::new("t")).unwrap(), 15);
        assert_eq!(chunk_count(1000, 64, Some(2), Path::new("t")).unwrap(), 2);
    }
}
