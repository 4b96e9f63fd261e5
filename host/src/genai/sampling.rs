//! Choosing the next token from logits: greedy, or sampling with temperature, top-k and top-p
//! (nucleus), after a repetition penalty — the semantics of Hugging Face transformers'
//! logits processors, which onnxruntime-genai follows ([`kiln_kernel_abi::sampling`], the
//! reference the device sampler shares). Each draw is Philox4x32-10 keyed by (seed, row, step),
//! so a row's tokens do not depend on the other rows of its batch, and the device sampler keyed
//! the same way draws the same numbers.

use kiln_kernel_abi::sampling::{self, RowParams};

pub use kiln_kernel_abi::sampling::argmax;

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

    /// This row's parameters as the shared reference ([`kiln_kernel_abi::sampling`]) and the
    /// device sampler take them: temperature 0 when greedy.
    pub fn row_params(&self) -> RowParams {
        let p = &self.params;
        RowParams {
            temperature: if p.is_greedy() { 0.0 } else { p.temperature },
            top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
            top_p: p.top_p,
            repetition_penalty: p.repetition_penalty,
        }
    }

    /// This row's parameters as the device Sample node reads them (float32 `[4]`): temperature
    /// (0: greedy), top_k (at most `vocab`; 0: all), top_p, repetition_penalty.
    pub fn device_row(&self, vocab: usize) -> [f32; 4] {
        let r = self.row_params();
        [r.temperature, r.top_k.min(u32::try_from(vocab).unwrap_or(u32::MAX)) as f32, r.top_p, r.repetition_penalty]
    }

    /// The next token for one sequence: `logits` over the vocabulary, `history` every token of it
    /// so far (prompt included), `row` its index in the request and `step` the number of tokens
    /// generated for it before this one (the draw's Philox counter).
    pub fn next(&self, logits: &[f32], history: &[i64], row: usize, step: usize) -> i64 {
        sampling::next_token(
            logits,
            history.iter().copied(),
            &self.row_params(),
            self.params.seed,
            row as u32,
            step as u64,
        ) as i64
    }
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
