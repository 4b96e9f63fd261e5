//! Float functions for CPU references that loops vectorize (Wasm SIMD128 in the shims): no
//! branches and no calls, unlike `libm`'s.

/// 1.5 · 2^23: adding and subtracting it rounds an f32 of magnitude below 2^22 to an integer
/// (to nearest, ties to even), without a call or a branch.
const ROUND: f32 = 12_582_912.0;

/// e^x in f32, branch-free. Cephes' `expf` method: x = n·ln 2 + r with |r| ≤ ln 2 / 2 (ln 2 split
/// in two parts, Cody and Waite), e^r by its degree-7 minimax polynomial, 2^n from the exponent
/// bits. Within 2 ulp of e^x for x in [−87, 88]; below −87 it gives e^−87 (1.6·10^−38, not 0),
/// above 88 it gives e^88 (1.7·10^38, not ∞); NaN gives NaN. Softmax weights after the maximum
/// is subtracted and SiLU's sigmoid are unaffected by the saturation.
#[inline]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = core::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // `clamp` keeps NaN (min/max would turn it into a bound).
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p =
        ((((1.987_569_2e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 1.666_666_5e-1) * r + 0.5;
    let e = p * r * r + r + 1.0;
    // n is in [−126, 127]: 2^n is a normal f32. NaN casts to 0 and keeps `e` NaN.
    e * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::exp_f32;

    #[test]
    fn exp_f32_is_within_2_ulp_of_exp_and_saturates_at_the_ends() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = (x as f64).exp();
            let got = exp_f32(x) as f64;
            // One ulp of the f32 nearest to e^x.
            let ulp = f32::from_bits((want as f32).to_bits() + 1) as f64 - want as f32 as f64;
            worst = worst.max((got - want).abs() / ulp);
            x += 0.000_731;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-1000.0), exp_f32(-87.0));
        assert_eq!(exp_f32(f32::NEG_INFINITY), exp_f32(-87.0));
        assert_eq!(exp_f32(1000.0), exp_f32(88.0));
        assert!(exp_f32(88.0).is_finite() && exp_f32(-87.0) > 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
    }
}
