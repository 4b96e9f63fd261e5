//! Choosing the next token from logits: greedy, or sampling with temperature, top-k and top-p
//! (nucleus), after a repetition penalty — the semantics of Hugging Face transformers'
//! logits processors, which onnxruntime-genai follows.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

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

/// A sampler with its own seeded random stream.
pub struct Sampler {
    pub params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        let rng = StdRng::seed_from_u64(params.seed);
        Sampler { params, rng }
    }

    /// The next token for one sequence; `history` is every token of it so far (prompt included).
    pub fn next(&mut self, logits: &[f32], history: &[i64]) -> i64 {
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
        let r: f64 = self.rng.random();
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
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.next(&[0.1, 3.0, 2.9], &[]), 1);
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 1.1, ..SamplingParams::default() });
        assert_eq!(s.next(&[0.1, 3.0, 2.9], &[1]), 2, "3.0 / 1.1 < 2.9");
    }

    #[test]
    fn sampling_respects_top_k_top_p_and_the_seed() {
        let logits = [1.0, 2.0, 3.0, 4.0];
        let params = SamplingParams { do_sample: true, top_k: 2, ..SamplingParams::default() };
        let mut s = Sampler::new(params.clone());
        let draws: Vec<i64> = (0..200).map(|_| s.next(&logits, &[])).collect();
        assert!(draws.iter().all(|t| *t == 2 || *t == 3));
        assert!(draws.contains(&2) && draws.contains(&3));
        let mut again = Sampler::new(params);
        assert_eq!(draws, (0..200).map(|_| again.next(&logits, &[])).collect::<Vec<_>>(), "same seed, same tokens");
        // top_p 0.5: p(3) = 0.64 alone reaches it.
        let mut s = Sampler::new(SamplingParams { do_sample: true, top_k: 0, top_p: 0.5, ..SamplingParams::default() });
        assert!((0..50).all(|_| s.next(&logits, &[]) == 3));
    }
}
