//! Philox4x32-10, the counter-based random number generator of Salmon, Moraes, Dror and Shaw,
//! "Parallel random numbers: as easy as 1, 2, 3" (SC 2011), as Random123 and cuRAND define it:
//! a keyed bijection of a 128-bit counter, so any draw is computed directly from its
//! coordinates with no state carried between draws. Host samplers and device sampling kernels
//! both use it, keyed the same way, so seeded draws match across devices and a row's draws do
//! not depend on the other rows of its batch.

/// Round multipliers and Weyl key increments (Random123's PHILOX_M4x32_0/1, PHILOX_W32_0/1).
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// Rounds of the standard variant.
pub const ROUNDS: usize = 10;

/// `philox4x32_10(counter, key)`: four 32-bit words, uniformly distributed over counters.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for round in 0..ROUNDS {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = u64::from(M0) * u64::from(c[0]);
        let p1 = u64::from(M1) * u64::from(c[2]);
        let (hi0, lo0, hi1, lo1) = ((p0 >> 32) as u32, p0 as u32, (p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// The uniform draw in [0, 1) of one sampling decision: the key is the request's `seed` (low
/// word first), the counter is (`step` low word, `step` high word, `row`, 0), and the value is
/// the top 53 bits of the first two output words (word 0 high) times 2^-53, exact in f64.
/// `row` is the sequence's index in its request, `step` the number of tokens generated for it
/// before this one.
pub fn uniform(seed: u64, row: u32, step: u64) -> f64 {
    let w = philox4x32_10([step as u32, (step >> 32) as u32, row, 0], [seed as u32, (seed >> 32) as u32]);
    let bits = (u64::from(w[0]) << 32 | u64::from(w[1])) >> 11;
    bits as f64 * (1.0 / (1u64 << 53) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's known-answer vectors (tests/kat_vectors, the three `philox4x32 10` lines:
    /// counter, key, result).
    #[test]
    fn matches_random123_known_answers() {
        assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]);
        assert_eq!(philox4x32_10([u32::MAX; 4], [u32::MAX; 2]), [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]);
        assert_eq!(
            philox4x32_10([0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344], [0xa409_3822, 0x299f_31d0]),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    /// 2^16 draws over steps and rows: in [0, 1), mean within 0.005 of 1/2 (6 standard errors)
    /// and every sixteenth of the interval within 10 % of its share.
    #[test]
    fn uniform_draws_fill_the_unit_interval() {
        let mut bins = [0u32; 16];
        let mut sum = 0.0;
        let n = 1 << 16;
        for i in 0..n {
            let u = uniform(42, (i % 8) as u32, (i / 8) as u64);
            assert!((0.0..1.0).contains(&u), "{u}");
            sum += u;
            bins[(u * 16.0) as usize] += 1;
        }
        assert!((sum / n as f64 - 0.5).abs() < 0.005, "mean {}", sum / n as f64);
        for (i, &b) in bins.iter().enumerate() {
            assert!((b as f64 - (n / 16) as f64).abs() < 0.1 * (n / 16) as f64, "bin {i}: {b}");
        }
        assert_ne!(uniform(42, 0, 0), uniform(42, 1, 0), "rows draw apart");
        assert_ne!(uniform(42, 0, 0), uniform(43, 0, 0), "seeds draw apart");
    }
}
