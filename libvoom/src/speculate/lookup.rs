//! Prompt lookup: drafts without a second model, by finding the context's last few
//! tokens earlier in the context and proposing what followed them there. Strong
//! where the output repeats its input: code edits, summaries, tool outputs.

use super::Drafter;
use crate::VoomError;

/// An n-gram drafter over the prompt and the output so far.
#[derive(Debug, Clone)]
pub struct PromptLookup {
    /// The longest and shortest suffix matched (the longest that matches wins).
    pub max_ngram: usize,
    pub min_ngram: usize,
}

impl Default for PromptLookup {
    fn default() -> Self {
        PromptLookup {
            max_ngram: 3,
            min_ngram: 1,
        }
    }
}

impl PromptLookup {
    /// The proposal for `context`: for the longest suffix of `max_ngram` down to
    /// `min_ngram` tokens that occurs earlier, the up to `k` tokens after its most
    /// recent earlier occurrence.
    pub fn lookup(&self, context: &[u32], k: usize) -> Vec<u32> {
        let len = context.len();
        if k == 0 {
            return Vec::new();
        }
        for n in (self.min_ngram.max(1)..=self.max_ngram).rev() {
            if n >= len {
                continue;
            }
            let suffix = &context[len - n..];
            // The most recent occurrence that ends before the suffix does.
            if let Some(start) = (0..len - n).rev().find(|&s| &context[s..s + n] == suffix) {
                let from = start + n;
                let to = (from + k).min(len);
                return context[from..to].to_vec();
            }
        }
        Vec::new()
    }
}

impl Drafter for PromptLookup {
    fn name(&self) -> String {
        "prompt-lookup".into()
    }

    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, VoomError> {
        Ok(self.lookup(context, k))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_suffix_that_occurred_before_proposes_what_followed_it() {
        let p = PromptLookup::default();
        // "5 6 7" occurred at 1..4, followed by 8 9 10.
        let ctx = [4, 5, 6, 7, 8, 9, 10, 1, 5, 6, 7];
        assert_eq!(p.lookup(&ctx, 2), vec![8, 9]);
        assert_eq!(p.lookup(&ctx, 10), vec![8, 9, 10, 1, 5, 6, 7]);
        // The most recent occurrence wins: "1 2" is followed by 3, then by 9.
        let ctx = [1, 2, 3, 1, 2, 9, 0, 1, 2];
        assert_eq!(p.lookup(&ctx, 1), vec![9]);
        // A longer match beats a more recent shorter one.
        let ctx = [7, 8, 1, 2, 8, 5, 9, 8, 7, 8];
        assert_eq!(p.lookup(&ctx, 1), vec![1]);
    }

    #[test]
    fn nothing_to_propose_without_a_match_or_room() {
        let p = PromptLookup::default();
        assert!(p.lookup(&[1, 2, 3, 4], 4).is_empty());
        assert!(p.lookup(&[], 4).is_empty());
        assert!(p.lookup(&[3, 3], 0).is_empty());
        // A single token that repeats: the shortest n-gram.
        assert_eq!(p.lookup(&[3, 4, 3], 4), vec![4, 3]);
        let q = PromptLookup {
            max_ngram: 3,
            min_ngram: 2,
        };
        assert!(q.lookup(&[3, 4, 3], 4).is_empty());
    }
}
