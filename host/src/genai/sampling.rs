//! Choosing the next token from logits: greedy, or sampling with temperature, top-k and top-p
//! (nucleus), after a repetition penalty — the semantics of Hugging Face transformers'
//! logits processors, which onnxruntime-genai follows. Each draw is Philox4x32-10 keyed by
//! (seed, row, step) ([`kiln_kernel_abi::philox::uniform`]), so a row's tokens do not depend on
//! the other rows of its batch, and a device sampler keyed the same way draws the same numbers.

use kiln_kernel_abi::philox;

/// How to pick tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Greedy (argmax) when false.
    pub do_sample: bool,
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    /// 1.0 disables top-p.
    pub top_p: f32,
    /// 1.0 disables it; > 1 discourages tokens already in the sequence (CTRL paper).
    pub repetition_penalty: f32,
    pub seed: u64,
}

impl SamplingParams {
    /// Whether these parameters pick the most likely token (no sampling, or temperature 0).
    pub fn is_greedy(&self) -> bool {
        !self.do_sample || self.temperature <= 0.0
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { do_sample: false, temperature: 1.0, top_k: 50, top_p: 1.0, repetition_penalty: 1.0, seed: 0 }
    }
}

/// A sampler: its parameters, and draws addressed by (seed, row, step), no state between them.
pub struct Sampler {
    pub params: SamplingParams,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        Sampler { params }
    }

    /// The next token for one sequence: `logits` over the vocabulary, `history` every token of it
    /// so far (prompt included), `row` its index in the request and `step` the number of tokens
    /// generated for it before this one (the draw's Philox counter).
    pub fn next(&self, logits: &[f32], history: &[i64], row: usize, step: usize) -> i64 {
        let mut l = logits.to_vec();
        let p = self.params.repetition_penalty;
        if p != 1.0 {
            let mut seen = history.to_vec();
            seen.sort_unstable();
            seen.dedup();
            for &t in &seen {
                if let Some(v) = usize::try_from(t).ok().and_then(|i| l.get_mut(i)) {
                    *v = if *v > 0.0 { *v / p } else { *v * p };
                }
            }
        }
        if self.params.is_greedy() {
            return argmax(&l) as i64;
        }
        let t = self.params.temperature;
        let mut cand: Vec<(usize, f32)> = l.iter().map(|v| v / t).enumerate().collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1));
        if self.params.top_k > 0 {
            cand.truncate(self.params.top_k);
        }
        let max = cand.first().map_or(0.0, |c| c.1);
        let mut probs: Vec<f64> = cand.iter().map(|c| ((c.1 - max) as f64).exp()).collect();
        let sum: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        if self.params.top_p < 1.0 {
            // Keep the smallest prefix whose mass reaches top_p (at least one token).
            let mut acc = 0.0;
            let keep = probs.iter().position(|p| {
                acc += p;
                acc >= self.params.top_p as f64
            });
            let n = keep.map_or(probs.len(), |i| i + 1);
            probs.truncate(n);
            cand.truncate(n);
            let s: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= s);
        }
        let r = philox::uniform(self.params.seed, row as u32, step as u64);
        let mut acc = 0.0;
        for (c, p) in cand.iter().zip(&probs) {
            acc += p;
            if r < acc {
                return c.0 as i64;
            }
        }
        cand.last().map_or(0, |c| c.0 as i64)
    }
}

/// Index of the largest value (the first on ties); a NaN wins over every number (the first
/// NaN), as numpy's `argmax` and kiln-reduce's ArgMax have it, so host and device greedy
/// decoding pick the same token from the same logits.
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if v[best].is_nan() {
            break;
        }
        if x.is_nan() || *x > v[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_argmax_and_the_penalty_changes_it() {
        let s = Sampler::new(SamplingParams::default());
        assert_eq!(s.next(&[0.1, 3.0, 2.9], &[], 0, 0), 1);
        let s = Sampler::new(SamplingParams { repetition_penalty: 1.1, ..SamplingParams::default() });
        assert_eq!(s.next(&[0.1, 3.0, 2.9], &[1], 0, 0), 2, "3.0 / 1.1 < 2.9");
    }

    #[test]
    fn sampling_respects_top_k_top_p_and_the_seed() {
        let logits = [1.0, 2.0, 3.0, 4.0];
        let params = SamplingParams { do_sample: true, top_k: 2, ..SamplingParams::default() };
        let s = Sampler::new(params.clone());
        let draws: Vec<i64> = (0..2000).map(|i| s.next(&logits, &[], 0, i)).collect();
        assert!(draws.iter().all(|t| *t == 2 || *t == 3));
        // top-k 2 leaves p(3) = e / (1 + e) = 0.731: 2000 draws within 4 standard errors (0.04).
        let threes = draws.iter().filter(|&&t| t == 3).count() as f64 / 2000.0;
        assert!((threes - 0.731).abs() < 0.04, "{threes}");
        let again = Sampler::new(params.clone());
        assert_eq!(
            draws,
            (0..2000).map(|i| again.next(&logits, &[], 0, i)).collect::<Vec<_>>(),
            "same seed, same tokens"
        );
        let other = Sampler::new(SamplingParams { seed: 1, ..params });
        assert_ne!(draws, (0..2000).map(|i| other.next(&logits, &[], 0, i)).collect::<Vec<_>>(), "another seed");
        // A row's draws are its own: row 1 at step i is the same whatever row 0 does.
        let row1: Vec<i64> = (0..200).map(|i| s.next(&logits, &[], 1, i)).collect();
        assert_eq!(row1, (0..200).map(|i| again.next(&logits, &[], 1, i)).collect::<Vec<_>>());
        assert_ne!(row1, draws[..200].to_vec(), "rows draw apart");
        // top_p 0.5: p(3) = 0.64 alone reaches it.
        let s = Sampler::new(SamplingParams { do_sample: true, top_k: 0, top_p: 0.5, ..SamplingParams::default() });
        assert!((0..50).all(|i| s.next(&logits, &[], 0, i) == 3));
    }
}
