//! Values of ONNX's narrow element types: the float8 forms (`float8e4m3fn`, `float8e4m3fnuz`,
//! `float8e5m2`, `float8e5m2fnuz`, `float8e8m0`), `float4e2m1`, and the packed 4-bit and 2-bit
//! integers. The host (conformance, printing) and the shims (Cast, QuantizeLinear,
//! DequantizeLinear) share these, and `kiln-cuda-std`'s `minifloat.cuh` does the same on the GPU.
//!
//! Conversions follow ONNX's Cast-25 specification (Operators.md: "Float 8 types …") and, where
//! it is silent, ml_dtypes, which ONNX's reference implementation and test data use:
//!
//! - to a float8 or float4 type: round to nearest, ties to even, on the exact value; a rounded
//!   value beyond the largest finite one (and ±inf) saturates to ±max when `saturate`, else it
//!   becomes ±inf (`float8e5m2`) or NaN (the others). `float4e2m1` has no inf or NaN, so it
//!   always saturates, and NaN becomes `0x8` (−0), −NaN `0x0`, as ml_dtypes does; a NaN keeps its
//!   sign where the target has signed NaNs (`float8e4m3fn`, `float8e5m2`);
//! - the `fnuz` forms have no −0: a negative value that rounds to zero is +0, and NaN is `0x80`;
//! - to `float8e8m0`: the float32 exponent, rounded up, down or to nearest by the fraction's
//!   bits (`round_mode`), as `onnx.numpy_helper.to_float8e8m0` does; NaN and ±inf become `0xFF`
//!   (NaN) even when saturating, as that reference and ONNX's test data have it, where Cast-25's
//!   table gives E8M0_MAX for inf.
//!
//! Packed elements (see [`DType::is_packed`]): element `i` sits in byte `i × bits / 8`, in the
//! bits above `(i × bits) mod 8`; the first element takes the lowest bits.

use crate::DType;

/// The layout of a float8 or float4 type with a sign bit, `exp` exponent bits and `man`
/// mantissa bits.
#[derive(Clone, Copy)]
struct Format {
    exp: u32,
    man: u32,
    bias: i32,
    /// The exponent of the largest finite value.
    emax: i32,
    /// The largest finite value's mantissa field.
    max_man: u32,
    kind: Kind,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// IEEE-style: an all-ones exponent is ±inf (mantissa 0) or NaN (`float8e5m2`).
    Ieee,
    /// Finite, NaN `S.1111.111` (`float8e4m3fn`).
    FiniteNan,
    /// Finite, unsigned zero: `0x80` is the only NaN (`float8e4m3fnuz`, `float8e5m2fnuz`).
    Fnuz,
    /// Finite, no NaN (`float4e2m1`).
    Finite,
}

fn format(dtype: DType) -> Option<Format> {
    let f = |exp, man, bias, emax, max_man, kind| Format { exp, man, bias, emax, max_man, kind };
    Some(match dtype {
        DType::F8E4M3FN => f(4, 3, 7, 8, 6, Kind::FiniteNan),
        DType::F8E4M3FNUZ => f(4, 3, 8, 7, 7, Kind::Fnuz),
        DType::F8E5M2 => f(5, 2, 15, 15, 3, Kind::Ieee),
        DType::F8E5M2FNUZ => f(5, 2, 16, 15, 3, Kind::Fnuz),
        DType::F4E2M1 => f(2, 1, 1, 2, 1, Kind::Finite),
        _ => return None,
    })
}

/// 2^k as f64, for k in −1022 ..= 1023.
fn pow2(k: i32) -> f64 {
    f64::from_bits(((k + 1023) as u64) << 52)
}

/// The value of `bits`, an element of `dtype` (a float8 type, `float4e2m1` in the low 4 bits, or
/// `float8e8m0`), as f32 (exact). `dtype` of another kind: NaN.
pub fn to_f32(dtype: DType, bits: u8) -> f32 {
    if dtype == DType::F8E8M0 {
        return match bits {
            0xFF => f32::NAN,
            0 => f32::from_bits(0x0040_0000), // 2^-127, subnormal in f32
            e => f32::from_bits((e as u32) << 23),
        };
    }
    let Some(f) = format(dtype) else { return f32::NAN };
    let width = 1 + f.exp + f.man;
    let bits = bits as u32 & ((1 << width) - 1);
    let negative = bits >> (width - 1) != 0;
    let e = (bits >> f.man) & ((1 << f.exp) - 1);
    let m = bits & ((1 << f.man) - 1);
    let all_ones = (1 << f.exp) - 1;
    // A NaN keeps its sign (Cast-25: -NaN stays -NaN where the target has one).
    let nan = if negative { -f32::NAN } else { f32::NAN };
    match f.kind {
        Kind::Fnuz if bits == 0x80 => return f32::NAN,
        Kind::FiniteNan if e == all_ones && m == (1 << f.man) - 1 => return nan,
        Kind::Ieee if e == all_ones => {
            return match (m, negative) {
                (0, false) => f32::INFINITY,
                (0, true) => f32::NEG_INFINITY,
                _ => nan,
            }
        }
        _ => {}
    }
    let magnitude = if e == 0 {
        m as f64 * pow2(1 - f.bias - f.man as i32)
    } else {
        (((1 << f.man) | m) as f64) * pow2(e as i32 - f.bias - f.man as i32)
    };
    (if negative { -magnitude } else { magnitude }) as f32
}

/// `x` as an element of `dtype` (a float8 type other than `float8e8m0`, or `float4e2m1`, whose
/// 4 bits are returned in the low bits), rounded to nearest even; see the module's rules for
/// `saturate`. Another `dtype`: 0.
pub fn from_f64(dtype: DType, x: f64, saturate: bool) -> u8 {
    let Some(f) = format(dtype) else { return 0 };
    let sign: u32 = if x.is_sign_negative() { 1 << (f.exp + f.man) } else { 0 };
    let max = sign | (((f.emax + f.bias) as u32) << f.man) | f.max_man;
    let nan = match f.kind {
        Kind::Ieee => sign | 0x7E,
        Kind::FiniteNan => sign | 0x7F,
        Kind::Fnuz => 0x80,
        // No NaN: ml_dtypes' -0 for NaN, +0 for -NaN.
        Kind::Finite => sign ^ 0x8,
    };
    let overflow = || -> u8 {
        match f.kind {
            _ if saturate => max as u8,
            Kind::Finite => max as u8,
            Kind::Ieee => (sign | 0x7C) as u8,
            _ => nan as u8,
        }
    };
    let zero = || if f.kind == Kind::Fnuz { 0 } else { sign as u8 };
    if x.is_nan() {
        return nan as u8;
    }
    let a = x.abs();
    if a.is_infinite() {
        return overflow();
    }
    if a == 0.0 {
        return zero();
    }
    // The exponent of `a` (f64 subnormals are far below every format's smallest value).
    let e = ((a.to_bits() >> 52) as i32 & 0x7FF) - 1023;
    if e > f.emax {
        return overflow();
    }
    let emin = 1 - f.bias;
    let exp = e.max(emin);
    let q = exp - f.man as i32; // the exponent of one unit in the last place
    let scaled = a * pow2(-q); // exact, below 2^(man + 1)
    let floor = scaled as u64;
    let frac = scaled - floor as f64;
    let r = floor + u64::from(frac > 0.5 || (frac == 0.5 && floor & 1 == 1));
    if r == 0 {
        return zero();
    }
    let (mut r, mut exp) = (r as u32, exp);
    if r >= 1 << (f.man + 1) {
        r >>= 1;
        exp += 1;
    }
    if r < 1 << f.man {
        return (sign | r) as u8; // subnormal: exponent field 0
    }
    if exp > f.emax || (exp == f.emax && r - (1 << f.man) > f.max_man) {
        return overflow();
    }
    (sign | (((exp + f.bias) as u32) << f.man) | (r - (1 << f.man))) as u8
}

/// How a conversion to `float8e8m0` rounds a value between two powers of two (Cast's
/// `round_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum E8m0Rounding {
    /// To the larger power of two whenever the fraction is not zero (Cast's default, `"up"`).
    Up,
    /// To the smaller power of two (`"down"`).
    Down,
    /// To the nearer, ties to the larger exponent's even neighbour as ONNX's reference does
    /// (`"nearest"`).
    Nearest,
}

impl E8m0Rounding {
    /// Parses Cast's `round_mode` attribute (`up`, `down`, `nearest`).
    pub fn from_name(name: &str) -> Option<E8m0Rounding> {
        Some(match name {
            "up" => E8m0Rounding::Up,
            "down" => E8m0Rounding::Down,
            "nearest" => E8m0Rounding::Nearest,
            _ => return None,
        })
    }
}

/// `x` as a `float8e8m0` element: float32's biased exponent of `x`, rounded by `round` over its
/// fraction bits (`onnx.numpy_helper.to_float8e8m0`). NaN and ±inf give `0xFF`; the sign is
/// ignored (ONNX leaves negative values unspecified). With `saturate`, a value that would round
/// past 2^127 stays at 2^127 (`0xFE`).
pub fn e8m0_from_f32(x: f32, saturate: bool, round: E8m0Rounding) -> u8 {
    let b = x.to_bits();
    let exponent = (b >> 23) & 0xFF;
    if exponent == 0xFF {
        return 0xFF;
    }
    let up = match round {
        E8m0Rounding::Down => false,
        E8m0Rounding::Up => b & 0x7F_FFFF != 0,
        E8m0Rounding::Nearest => {
            let g = b & 0x40_0000 != 0;
            let r = b & 0x20_0000 != 0;
            let s = b & 0x1F_FFFF != 0;
            g && (r || s || exponent > 0)
        }
    };
    let up = up && !(saturate && exponent == 0xFE);
    (exponent + u32::from(up)) as u8
}

/// The bits of packed element `i` of `dtype` in `bytes`, right-aligned (see the module's layout).
/// `bytes` too short: 0.
pub fn packed_get(dtype: DType, bytes: &[u8], i: usize) -> u8 {
    let bits = dtype.bits().unwrap_or(8) as usize;
    let at = i * bits;
    let mask = ((1u16 << bits) - 1) as u8;
    bytes.get(at / 8).map_or(0, |b| (b >> (at % 8)) & mask)
}

/// Sets packed element `i` of `dtype` in `bytes` to the low bits of `field`.
pub fn packed_set(dtype: DType, bytes: &mut [u8], i: usize, field: u8) {
    let bits = dtype.bits().unwrap_or(8) as usize;
    let at = i * bits;
    let mask = ((1u16 << bits) - 1) as u8;
    if let Some(b) = bytes.get_mut(at / 8) {
        *b = (*b & !(mask << (at % 8))) | ((field & mask) << (at % 8));
    }
}

/// `codes` (one per element, right-aligned) as the bytes of a `dtype` tensor: packed for the
/// 4-bit and 2-bit types, a byte each otherwise.
pub fn pack(dtype: DType, codes: impl ExactSizeIterator<Item = u8>) -> alloc::vec::Vec<u8> {
    let mut out = alloc::vec![0u8; dtype.storage_bytes(codes.len() as u64).unwrap_or(0) as usize];
    for (i, c) in codes.enumerate() {
        packed_set(dtype, &mut out, i, c);
    }
    out
}

/// The integer a 4-bit or 2-bit field holds: sign-extended for `int4` and `int2`.
pub fn narrow_int_value(dtype: DType, field: u8) -> i64 {
    let bits = dtype.bits().unwrap_or(8);
    let field = field as i64 & ((1 << bits) - 1);
    match dtype {
        DType::I4 | DType::I2 if field >= 1 << (bits - 1) => field - (1 << bits),
        _ => field,
    }
}

/// `v` as a 4-bit or 2-bit field: its low bits (integer → integer casts wrap, as ONNX says for
/// fixed-point targets).
pub fn narrow_int_field(dtype: DType, v: i64) -> u8 {
    let bits = dtype.bits().unwrap_or(8);
    (v & ((1 << bits) - 1)) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    const F8: [DType; 4] = [DType::F8E4M3FN, DType::F8E4M3FNUZ, DType::F8E5M2, DType::F8E5M2FNUZ];

    #[test]
    fn every_finite_element_converts_back_to_its_own_bits() {
        for d in F8.into_iter().chain([DType::F4E2M1]) {
            let n = if d == DType::F4E2M1 { 16 } else { 256 };
            for bits in 0..n as u16 {
                let v = to_f32(d, bits as u8);
                if v.is_nan() || v.is_infinite() {
                    continue;
                }
                let back = from_f64(d, v as f64, false);
                // -0 of the fnuz types is their NaN; +0 comes back as 0.
                assert_eq!(back, bits as u8, "{d} {bits:#x} = {v}");
            }
        }
    }

    #[test]
    fn largest_values_and_specials_match_onnx_tables() {
        assert_eq!(to_f32(DType::F8E4M3FN, 0x7E), 448.0);
        assert_eq!(to_f32(DType::F8E4M3FNUZ, 0x7F), 240.0);
        assert_eq!(to_f32(DType::F8E5M2, 0x7B), 57344.0);
        assert_eq!(to_f32(DType::F8E5M2FNUZ, 0x7F), 57344.0);
        assert_eq!(to_f32(DType::F4E2M1, 0x7), 6.0);
        assert_eq!(to_f32(DType::F4E2M1, 0xF), -6.0);
        assert!(to_f32(DType::F8E4M3FN, 0xFF).is_nan());
        assert!(to_f32(DType::F8E5M2FNUZ, 0x80).is_nan());
        assert_eq!(to_f32(DType::F8E5M2, 0xFC), f32::NEG_INFINITY);
        // Saturation and its absence (Operators.md, Cast: the two tables).
        assert_eq!(from_f64(DType::F8E4M3FN, 1e6, true), 0x7E);
        assert_eq!(from_f64(DType::F8E4M3FN, -1e6, false), 0xFF);
        assert_eq!(from_f64(DType::F8E5M2, f64::INFINITY, false), 0x7C);
        assert_eq!(from_f64(DType::F8E5M2, f64::NEG_INFINITY, true), 0xFB);
        assert_eq!(from_f64(DType::F8E4M3FNUZ, f64::INFINITY, false), 0x80);
        assert_eq!(from_f64(DType::F8E4M3FNUZ, -1e-7, true), 0x00);
        assert_eq!(from_f64(DType::F8E4M3FN, -1e-7, true), 0x80);
        assert_eq!(from_f64(DType::F4E2M1, f64::NAN, true), 0x8);
        assert_eq!(from_f64(DType::F4E2M1, -f64::NAN, true), 0x0);
        // -NaN stays -NaN from float8e5m2 to float8e4m3fn.
        let neg_nan = to_f32(DType::F8E5M2, 0xFE);
        assert!(neg_nan.is_nan() && neg_nan.is_sign_negative());
        assert_eq!(from_f64(DType::F8E4M3FN, neg_nan as f64, true), 0xFF);
        // Ties to even: 464 lies halfway between 448 (mantissa 110) and 480 (the NaN code).
        assert_eq!(from_f64(DType::F8E4M3FN, 464.0, false), 0x7E);
        assert_eq!(from_f64(DType::F4E2M1, 0.25, true), 0x0);
        assert_eq!(from_f64(DType::F4E2M1, -3.5, true), 0xE);
    }

    #[test]
    fn e8m0_follows_onnx_numpy_helper() {
        // test_cast_e8m0_FLOAT_to_FLOAT8E8M0's input and expected codes (round up, saturate).
        let x = [0.0f32, 0.124, 0.25, 0.5, 1.1, 2.0, 4.0, 8.0];
        let want = [0u8, 124, 125, 126, 128, 128, 129, 130];
        for (x, w) in x.iter().zip(want) {
            assert_eq!(e8m0_from_f32(*x, true, E8m0Rounding::Up), w, "{x}");
        }
        assert_eq!(e8m0_from_f32(f32::MAX, true, E8m0Rounding::Up), 0xFE);
        assert_eq!(e8m0_from_f32(f32::MAX, false, E8m0Rounding::Up), 0xFF);
        assert_eq!(e8m0_from_f32(1.5, true, E8m0Rounding::Down), 127);
        assert_eq!(e8m0_from_f32(1.5, true, E8m0Rounding::Nearest), 128);
        assert_eq!(to_f32(DType::F8E8M0, 127), 1.0);
        assert!(to_f32(DType::F8E8M0, 0xFF).is_nan());
    }

    #[test]
    fn packed_elements_take_the_low_bits_first() {
        let mut b = [0u8; 2];
        for (i, v) in [-8i64, 7, -1].iter().enumerate() {
            packed_set(DType::I4, &mut b, i, narrow_int_field(DType::I4, *v));
        }
        assert_eq!(b, [0x78, 0x0F]);
        assert_eq!(narrow_int_value(DType::I4, packed_get(DType::I4, &b, 2)), -1);
        let mut c = [0u8; 1];
        for (i, v) in [1i64, -2, -1, 0].iter().enumerate() {
            packed_set(DType::I2, &mut c, i, narrow_int_field(DType::I2, *v));
        }
        assert_eq!(c, [0b00_11_10_01]);
        assert_eq!(narrow_int_value(DType::U2, packed_get(DType::U2, &c, 2)), 3);
        assert_eq!(DType::I2.storage_bytes(5), Some(2));
        assert_eq!(DType::F4E2M1.storage_bytes(3), Some(2));
    }
}
