//! Element types as Rust values, and conversion between tensor bytes and typed vectors.

use alloc::vec::Vec;

use half::{bf16, f16};

use super::{format, Result, ShimError};
use crate::{minifloat, DType};

/// ONNX `bool`: one byte, 0 or 1.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Bool(pub bool);

/// A fixed-size element type.
///
/// Conversions follow ONNX `Cast`: float → int truncates toward zero (saturating, NaN → 0),
/// int → float rounds to nearest, anything → bool is `!= 0`, bool → number is 0 or 1.
pub trait Element: Copy + Default + PartialOrd + 'static {
    const DTYPE: DType;
    const SIZE: usize;
    fn from_le(b: &[u8]) -> Self;
    fn write_le(self, out: &mut [u8]);
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    fn to_i64(self) -> i64;
    fn from_i64(v: i64) -> Self;
}

macro_rules! int_element {
    ($t:ty, $dt:expr) => {
        impl Element for $t {
            const DTYPE: DType = $dt;
            const SIZE: usize = core::mem::size_of::<$t>();
            #[inline]
            fn from_le(b: &[u8]) -> Self {
                let mut a = [0u8; core::mem::size_of::<$t>()];
                a.copy_from_slice(&b[..Self::SIZE]);
                <$t>::from_le_bytes(a)
            }
            #[inline]
            fn write_le(self, out: &mut [u8]) {
                out[..Self::SIZE].copy_from_slice(&self.to_le_bytes())
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline]
            fn to_i64(self) -> i64 {
                self as i64
            }
            #[inline]
            fn from_i64(v: i64) -> Self {
                v as $t
            }
        }
    };
}

int_element!(i8, DType::I8);
int_element!(i16, DType::I16);
int_element!(i32, DType::I32);
int_element!(i64, DType::I64);
int_element!(u8, DType::U8);
int_element!(u16, DType::U16);
int_element!(u32, DType::U32);
int_element!(u64, DType::U64);

macro_rules! float_element {
    ($t:ty, $dt:expr, $bits:ty, $to:expr, $from:expr) => {
        impl Element for $t {
            const DTYPE: DType = $dt;
            const SIZE: usize = core::mem::size_of::<$t>();
            #[inline]
            fn from_le(b: &[u8]) -> Self {
                let mut a = [0u8; core::mem::size_of::<$t>()];
                a.copy_from_slice(&b[..Self::SIZE]);
                <$t>::from_bits(<$bits>::from_le_bytes(a))
            }
            #[inline]
            fn write_le(self, out: &mut [u8]) {
                out[..Self::SIZE].copy_from_slice(&self.to_bits().to_le_bytes())
            }
            #[inline]
            fn to_f64(self) -> f64 {
                #[allow(clippy::redundant_closure_call)]
                ($to)(self)
            }
            #[inline]
            fn from_f64(v: f64) -> Self {
                #[allow(clippy::redundant_closure_call)]
                ($from)(v)
            }
            #[inline]
            fn to_i64(self) -> i64 {
                let v = self.to_f64();
                if v.is_nan() {
                    0
                } else {
                    v as i64
                }
            }
            #[inline]
            fn from_i64(v: i64) -> Self {
                Self::from_f64(v as f64)
            }
        }
    };
}

float_element!(f32, DType::F32, u32, |x: f32| x as f64, |v: f64| v as f32);
float_element!(f64, DType::F64, u64, |x: f64| x, |v: f64| v);
// f64 → f16/bf16 goes through f32 rounded to odd, so that the final rounding to nearest even
// is correct (`half`'s own `from_f64` rounds twice).
float_element!(f16, DType::F16, u16, |x: f16| x.to_f64(), |v: f64| f16::from_f32(f32_round_odd(v)));
float_element!(bf16, DType::BF16, u16, |x: bf16| x.to_f64(), |v: f64| bf16::from_f32(f32_round_odd(v)));

/// f64 → f32 rounded to odd (the last bit set when inexact). Rounding that f32 again to a
/// format of at most 22 significant bits (float16, bfloat16) gives the correctly rounded
/// value of `v` (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums: proved
/// algorithms using rounding to odd", 2008).
#[inline]
pub fn f32_round_odd(v: f64) -> f32 {
    let f = v as f32;
    if !f.is_finite() || f as f64 == v {
        // Exact, NaN, or beyond the f32 range (and so beyond float16's and bfloat16's).
        return f;
    }
    let mut bits = f.to_bits();
    if (f as f64).abs() > v.abs() {
        bits -= 1; // Toward zero.
    }
    f32::from_bits(bits | 1)
}

impl Element for Bool {
    const DTYPE: DType = DType::Bool;
    const SIZE: usize = 1;
    #[inline]
    fn from_le(b: &[u8]) -> Self {
        Bool(b[0] != 0)
    }
    #[inline]
    fn write_le(self, out: &mut [u8]) {
        out[0] = self.0 as u8
    }
    #[inline]
    fn to_f64(self) -> f64 {
        self.0 as u8 as f64
    }
    #[inline]
    fn from_f64(v: f64) -> Self {
        Bool(v != 0.0)
    }
    #[inline]
    fn to_i64(self) -> i64 {
        self.0 as i64
    }
    #[inline]
    fn from_i64(v: i64) -> Self {
        Bool(v != 0)
    }
}

/// Runs `$body` with `$T` bound to the Rust type of `$dtype` (a [`DType`] value); evaluates
/// to `$body`'s value, or to `Err(Unsupported)` for `string` and the float8, 4-bit and 2-bit
/// types, which have no Rust element type ([`decode_as`] and [`encode_as`] convert them).
#[macro_export]
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {{
        use $crate::DType as __D;
        match $dtype {
            __D::F32 => {
                type $T = f32;
                $body
            }
            __D::F64 => {
                type $T = f64;
                $body
            }
            __D::F16 => {
                type $T = $crate::guest::f16;
                $body
            }
            __D::BF16 => {
                type $T = $crate::guest::bf16;
                $body
            }
            __D::I8 => {
                type $T = i8;
                $body
            }
            __D::I16 => {
                type $T = i16;
                $body
            }
            __D::I32 => {
                type $T = i32;
                $body
            }
            __D::I64 => {
                type $T = i64;
                $body
            }
            __D::U8 => {
                type $T = u8;
                $body
            }
            __D::U16 => {
                type $T = u16;
                $body
            }
            __D::U32 => {
                type $T = u32;
                $body
            }
            __D::U64 => {
                type $T = u64;
                $body
            }
            __D::Bool => {
                type $T = $crate::guest::Bool;
                $body
            }
            __D::String => {
                Err($crate::guest::ShimError::Unsupported($crate::guest::format!("string tensors are not supported")))
            }
            other => Err($crate::guest::ShimError::Unsupported($crate::guest::format!(
                "{other} elements have no Rust element type here"
            ))),
        }
    }};
}

/// Whether `T` is one of this module's integer and float types: every `SIZE`-byte pattern is a
/// value, held in memory as its `SIZE` bytes (no padding; not [`Bool`]). Decided by type identity,
/// so no other `Element` implementation can claim it. On a little-endian target (Wasm) such
/// elements are their tensor bytes as they lie, so [`decode`], [`encode`] and the tensor reads
/// and writes copy them whole instead of element by element.
#[inline]
pub fn is_plain<T: Element>() -> bool {
    use core::any::TypeId;
    let t = TypeId::of::<T>();
    [
        TypeId::of::<i8>(),
        TypeId::of::<i16>(),
        TypeId::of::<i32>(),
        TypeId::of::<i64>(),
        TypeId::of::<u8>(),
        TypeId::of::<u16>(),
        TypeId::of::<u32>(),
        TypeId::of::<u64>(),
        TypeId::of::<f32>(),
        TypeId::of::<f64>(),
        TypeId::of::<f16>(),
        TypeId::of::<bf16>(),
    ]
    .contains(&t)
}

/// Whether `T`'s elements are their little-endian tensor bytes as they lie in memory.
#[inline]
fn as_laid<T: Element>() -> bool {
    cfg!(target_endian = "little") && is_plain::<T>()
}

/// The bytes of `values` as they lie, where those are their little-endian tensor bytes
/// ([`is_plain`] on a little-endian target); `None` otherwise.
#[inline]
pub fn laid_bytes<T: Element>(values: &[T]) -> Option<&[u8]> {
    // SAFETY: a plain T is SIZE bytes without padding, so the slice's memory is
    // `len · SIZE` initialized bytes, borrowed as long as `values`.
    as_laid::<T>()
        .then(|| unsafe { core::slice::from_raw_parts(values.as_ptr() as *const u8, core::mem::size_of_val(values)) })
}

/// The bytes of `values` as they lie, to write elements into, under [`laid_bytes`]'s condition.
#[inline]
pub fn laid_bytes_mut<T: Element>(values: &mut [T]) -> Option<&mut [u8]> {
    // SAFETY: as `laid_bytes`; any bytes written make valid plain T elements.
    as_laid::<T>().then(|| unsafe {
        core::slice::from_raw_parts_mut(values.as_mut_ptr() as *mut u8, core::mem::size_of_val(values))
    })
}

/// Decodes little-endian bytes of `T` elements (a trailing part of an element is ignored).
#[inline]
pub fn decode<T: Element>(bytes: &[u8]) -> Vec<T> {
    let n = bytes.len() / T::SIZE;
    let mut out = alloc::vec![T::default(); n];
    match laid_bytes_mut(&mut out) {
        Some(dst) => dst.copy_from_slice(&bytes[..n * T::SIZE]),
        None => out.iter_mut().zip(bytes.chunks_exact(T::SIZE)).for_each(|(o, b)| *o = T::from_le(b)),
    }
    out
}

/// Encodes `T` elements as little-endian bytes.
#[inline]
pub fn encode<T: Element>(values: &[T]) -> Vec<u8> {
    if let Some(bytes) = laid_bytes(values) {
        return bytes.to_vec();
    }
    let mut out = alloc::vec![0u8; values.len() * T::SIZE];
    for (v, o) in values.iter().zip(out.chunks_exact_mut(T::SIZE)) {
        v.write_le(o);
    }
    out
}

/// Converts one element type to another with [`Element`]'s rules (through i64 between
/// integer types, through f64 otherwise).
#[inline]
pub fn convert<S: Element, T: Element>(v: S) -> T {
    if S::DTYPE.is_float() || T::DTYPE.is_float() {
        T::from_f64(v.to_f64())
    } else {
        T::from_i64(v.to_i64())
    }
}

/// Decodes bytes of `dtype` elements into `T` values. A packed dtype gives every element the
/// bytes hold, the last byte's padding included: [`super::Tensor::read_vec`] keeps `numel`.
/// float8 and float4 values convert through their exact f32 value, 4-bit and 2-bit integers
/// through i64 (see [`crate::minifloat`]).
#[inline]
pub fn decode_as<T: Element>(dtype: DType, bytes: &[u8]) -> Result<Vec<T>> {
    if dtype == T::DTYPE {
        return Ok(decode::<T>(bytes));
    }
    if dtype.is_minifloat() || dtype.is_narrow_int() {
        let n = bytes.len() * 8 / dtype.bits().unwrap_or(8) as usize;
        return Ok((0..n).map(|i| narrow_value(dtype, minifloat::packed_get(dtype, bytes, i))).collect());
    }
    with_dtype!(dtype, S => Ok(decode::<S>(bytes).into_iter().map(convert::<S, T>).collect()))
}

/// One float8, float4, 4-bit or 2-bit element (its bits right-aligned) as `T`.
#[inline]
fn narrow_value<T: Element>(dtype: DType, field: u8) -> T {
    if dtype.is_minifloat() {
        T::from_f64(minifloat::to_f32(dtype, field) as f64)
    } else {
        let v = minifloat::narrow_int_value(dtype, field);
        if T::DTYPE.is_float() {
            T::from_f64(v as f64)
        } else {
            T::from_i64(v)
        }
    }
}

/// Encodes `T` values as bytes of `dtype` elements. To a float8 or float4 type: rounded to
/// nearest even and saturated (Cast's default; `float8e8m0` rounds up); to a 4-bit or 2-bit
/// integer: the low bits of the value converted to i64 (a float truncated toward zero).
#[inline]
pub fn encode_as<T: Element>(dtype: DType, values: &[T]) -> Result<Vec<u8>> {
    if dtype == T::DTYPE {
        return Ok(encode(values));
    }
    if dtype.is_minifloat() || dtype.is_narrow_int() {
        let code = |v: &T| match dtype {
            DType::F8E8M0 => minifloat::e8m0_from_f32(v.to_f64() as f32, true, minifloat::E8m0Rounding::Up),
            d if d.is_minifloat() => minifloat::from_f64(d, v.to_f64(), true),
            d => minifloat::narrow_int_field(d, v.to_i64()),
        };
        return Ok(minifloat::pack(dtype, values.iter().map(code)));
    }
    with_dtype!(dtype, D => Ok(encode::<D>(&values.iter().map(|v| convert::<T, D>(*v)).collect::<Vec<D>>())))
}

/// Checks a value against a dtype for messages.
pub fn expect_dtype(what: &str, got: DType, allowed: &[DType]) -> Result<()> {
    if allowed.contains(&got) {
        Ok(())
    } else {
        Err(ShimError::Unsupported(format!("{what}: dtype {got} is not supported")))
    }
}
