//! Choosing one row's next token from its logits: the reference that kiln's host sampler and
//! the `kiln-sampling` package's `ai.kiln::Sample` op (its CPU path, and the CUDA kernel it must
//! match) all follow.
//!
//! The semantics are Hugging Face transformers' logits processors, which onnxruntime-genai
//! follows, applied in this order:
//! 1. repetition penalty (CTRL, Keskar et al. 2019): a logit `x` of a token already in the
//!    sequence becomes `x / p` when positive, `x · p` otherwise (each token once, however often
//!    it occurs);
//! 2. greedy (temperature ≤ 0): the first index of the largest penalized logit, a NaN winning
//!    over every number (numpy's `argmax`);
//! 3. otherwise temperature (`x / t`, in f32), then the candidates in descending order (IEEE
//!    total order, ties by ascending index), kept to the first `top_k` (0: all);
//! 4. softmax over the candidates in f64 (`exp((x − max) as f64)`, summed in candidate order);
//! 5. top-p (nucleus): the shortest prefix whose probability reaches `top_p`, renormalized
//!    (`top_p ≥ 1` keeps all);
//! 6. one uniform draw `r` ([`crate::philox::uniform`] of (seed, row, step)): the first candidate
//!    whose running probability exceeds `r` (the last when rounding leaves none).

use alloc::vec::Vec;

/// One row's sampling parameters, as the `sampling` input of `ai.kiln::Sample` holds them
/// (float32 `[4]` per row, in this order).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowParams {
    /// ≤ 0: greedy.
    pub temperature: f32,
    /// 0: every token is a candidate.
    pub top_k: u32,
    /// In (0, 1]; 1 disables it.
    pub top_p: f32,
    /// 1 disables it.
    pub repetition_penalty: f32,
}

/// Words of one row of `ai.kiln::Sample`'s `seeds` input (opset 2): the seed, the position whose
/// draw is step 0, and the Philox stream.
pub const SEED_WORDS: usize = 3;

/// Largest vocabulary the CUDA kernel of `ai.kiln::Sample` takes: its bitmap of the history's
/// tokens (`ceil(V / 32)` words) fits the 48 KiB of shared memory beside its own 17,824 bytes.
pub const DEVICE_MAX_VOCAB: usize = (48 * 1024 - 17_824) / 4 * 32;

/// The key the candidates are ordered by: IEEE total order of the value in the high word,
/// ascending index in the low word, so that descending keys are the candidate order of step 3
/// and no two keys are equal.
pub fn candidate_key(value: f32, index: usize) -> u64 {
    let bits = value.to_bits();
    let ordered = if bits & 0x8000_0000 != 0 { !bits } else { bits | 0x8000_0000 };
    (u64::from(ordered) << 32) | u64::from(u32::MAX - index as u32)
}

/// The value a [`candidate_key`] was made from.
pub fn key_value(key: u64) -> f32 {
    let ordered = (key >> 32) as u32;
    f32::from_bits(if ordered & 0x8000_0000 != 0 { ordered & 0x7FFF_FFFF } else { !ordered })
}

/// The index a [`candidate_key`] was made from.
pub fn key_index(key: u64) -> usize {
    (u32::MAX - key as u32) as usize
}

/// A penalized logit (step 1): `x / p` when positive, `x · p` otherwise.
pub fn penalize(x: f32, penalty: f32) -> f32 {
    if x > 0.0 {
        x / penalty
    } else {
        x * penalty
    }
}

/// Index of the largest value (the first on ties); the first NaN wins over every number.
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

/// The next token of one row: `logits` over the vocabulary, `history` the row's tokens so far
/// (ids outside the vocabulary are ignored), `seed`/`row`/`step` the draw's Philox
/// coordinates (`step`: tokens generated for the row before this one). Returns an index into
/// `logits` (0 for an empty vocabulary).
pub fn next_token(
    logits: &[f32],
    history: impl IntoIterator<Item = i64>,
    p: &RowParams,
    seed: u64,
    row: u32,
    step: u64,
) -> usize {
    let mut l = logits.to_vec();
    if p.repetition_penalty != 1.0 {
        let mut seen = alloc::vec![false; l.len()];
        for t in history {
            if let Some(s) = usize::try_from(t).ok().and_then(|i| seen.get_mut(i)) {
                *s = true;
            }
        }
        for (x, _) in l.iter_mut().zip(&seen).filter(|(_, s)| **s) {
            *x = penalize(*x, p.repetition_penalty);
        }
    }
    if p.temperature <= 0.0 || l.is_empty() {
        return argmax(&l);
    }
    let mut keys: Vec<u64> = l.iter().enumerate().map(|(i, x)| candidate_key(x / p.temperature, i)).collect();
    let k = if p.top_k == 0 { keys.len() } else { (p.top_k as usize).min(keys.len()) };
    if k < keys.len() {
        keys.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
        keys.truncate(k);
    }
    keys.sort_unstable_by(|a, b| b.cmp(a));
    let max = key_value(keys[0]);
    let mut probs: Vec<f64> = keys.iter().map(|&c| libm::exp((key_value(c) - max) as f64)).collect();
    let sum: f64 = probs.iter().fold(0.0, |a, b| a + b);
    probs.iter_mut().for_each(|q| *q /= sum);
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let n = probs
            .iter()
            .position(|q| {
                acc += q;
                acc >= p.top_p as f64
            })
            .map_or(probs.len(), |i| i + 1);
        probs.truncate(n);
        let s: f64 = probs.iter().fold(0.0, |a, b| a + b);
        probs.iter_mut().for_each(|q| *q /= s);
    }
    let r = crate::philox::uniform(seed, row, step);
    let mut acc = 0.0;
    for (i, q) in probs.iter().enumerate() {
        acc += q;
        if r < acc {
            return key_index(keys[i]);
        }
    }
    key_index(keys[probs.len() - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_order_values_by_ieee_total_order_then_index() {
        let vals = [-f32::INFINITY, -2.5, -0.0, 0.0, 1e-30, 3.0, f32::INFINITY];
        for w in vals.windows(2) {
            assert!(candidate_key(w[0], 0) < candidate_key(w[1], 0), "{} < {}", w[0], w[1]);
        }
        assert!(candidate_key(1.0, 3) > candidate_key(1.0, 4), "ties: the lower index first");
        for (i, v) in vals.iter().enumerate() {
            let k = candidate_key(*v, i * 1000);
            assert_eq!(key_value(k).to_bits(), v.to_bits());
            assert_eq!(key_index(k), i * 1000);
        }
    }

    #[test]
    fn greedy_takes_the_penalized_argmax() {
        let greedy = RowParams { temperature: 0.0, top_k: 0, top_p: 1.0, repetition_penalty: 1.0 };
        assert_eq!(next_token(&[0.1, 3.0, 2.9], [], &greedy, 0, 0, 0), 1);
        let pen = RowParams { repetition_penalty: 1.1, ..greedy };
        assert_eq!(next_token(&[0.1, 3.0, 2.9], [1, 1, 7, -1], &pen, 0, 0, 0), 2, "3.0 / 1.1 < 2.9");
        assert_eq!(next_token(&[-1.0, -1.05, -5.0], [0], &pen, 0, 0, 0), 1, "-1.0 · 1.1 < -1.05");
        assert_eq!(next_token(&[1.0, f32::NAN, 5.0, f32::NAN], [], &greedy, 0, 0, 0), 1, "the first NaN");
    }

    /// The draw follows the softmax of the candidates: with top-k 2 of [1, 2, 3, 4] at
    /// temperature 1, p(3) = e / (1 + e); with top-p the nucleus alone.
    #[test]
    fn draws_follow_the_candidates_softmax() {
        let p = RowParams { temperature: 1.0, top_k: 2, top_p: 1.0, repetition_penalty: 1.0 };
        let draws: Vec<usize> = (0..4000).map(|s| next_token(&[1.0, 2.0, 3.0, 4.0], [], &p, 7, 0, s)).collect();
        assert!(draws.iter().all(|t| *t == 2 || *t == 3));
        let threes = draws.iter().filter(|&&t| t == 3).count() as f64 / 4000.0;
        // 4000 draws: standard error 0.007; within 4 of them.
        let e = core::f64::consts::E;
        assert!((threes - e / (1.0 + e)).abs() < 0.028, "{threes}");
        let nucleus = RowParams { top_k: 0, top_p: 0.5, ..p };
        assert!((0..50).all(|s| next_token(&[1.0, 2.0, 3.0, 4.0], [], &nucleus, 7, 0, s) == 3));
        // Equal logits: the lower index is the better candidate, so top-k 1 keeps index 1.
        let one = RowParams { top_k: 1, ..p };
        assert!((0..20).all(|s| next_token(&[0.0, 2.0, 2.0], [], &one, 7, 0, s) == 1));
    }
}
