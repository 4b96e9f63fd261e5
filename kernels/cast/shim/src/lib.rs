//! Shim of `kiln-cast`: Cast-6/9/13/19/21/23/24/25 and CastLike-15/19/21/23/24/25 between
//! float32, float16, bfloat16, float64, int8…int64, uint8…uint64, bool, and (manifest schema
//! 11) the float8 types, float4e2m1 and the 4-bit and 2-bit integers, following ONNX
//! Operators.md:
//!
//! - float → float rounds to nearest even, once (float64 → float16/bfloat16 included);
//!   NaN and ±inf are kept, values beyond the target's range become ±inf;
//! - float → integer truncates toward zero (out of range, which ONNX leaves undefined,
//!   saturates; NaN → 0); to a 4-bit or 2-bit integer the truncated value wraps, as ONNX's
//!   test data has it;
//! - integer → float rounds to nearest even; integer → integer wraps (two's complement);
//! - anything → bool is `x != 0` (NaN → true); bool → number is 0 or 1;
//! - to a float8 type or float4e2m1: round to nearest even, then `saturate` (default 1) as the
//!   Cast tables say; to float8e8m0: `round_mode` (`up`, `down`, `nearest`) and `saturate`
//!   (`kiln_kernel_abi::minifloat` has the rules).
//!
//! Strings are not supported.
#![no_std]
extern crate alloc;

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, export_shim, minifloat, unsupported, with_dtype};

struct Cast;

/// The input and output dtypes.
fn dtypes(call: &Call) -> Result<(DType, DType)> {
    let from = call.input(0)?.dtype()?;
    let to = match call.op_type() {
        "Cast" => {
            let code = match call.attr("to") {
                Some(_) => call.attr_i("to", 0)?,
                None => bail!("Cast: attribute to is required"),
            };
            match i32::try_from(code).ok().and_then(DType::from_code) {
                Some(d) => d,
                None => unsupported!("Cast: target dtype code {code} is not supported"),
            }
        }
        "CastLike" => call.input(1)?.dtype()?,
        other => unsupported!("kiln-cast does not implement {other}"),
    };
    if from == DType::String || to == DType::String {
        unsupported!("{}: string tensors are not supported", call.op_type());
    }
    Ok((from, to))
}

/// Integer → f32 rounding to odd (see [`element::f32_round_odd`]); `v` is within the u64/i64 range.
fn f32_round_odd_int(v: i128) -> f32 {
    let f = v as f32;
    let back = f as i128;
    if back == v {
        return f;
    }
    let mut bits = f.to_bits();
    if back.unsigned_abs() > v.unsigned_abs() {
        bits -= 1; // Truncate toward zero.
    }
    f32::from_bits(bits | 1)
}

/// The source elements: floats exactly as f64, integers and bools exactly as i128.
enum Src {
    F(Vec<f64>),
    I(Vec<i128>),
}

/// `saturate` and `round_mode`: how a cast to a float8 or float4 type treats what it cannot
/// represent.
#[derive(Clone, Copy)]
struct Narrowing {
    saturate: bool,
    round: minifloat::E8m0Rounding,
}

fn narrowing(call: &Call) -> Result<Narrowing> {
    let mode = call.attr_s("round_mode", "up")?;
    let Some(round) = minifloat::E8m0Rounding::from_name(mode) else {
        bail!("{}: round_mode {mode:?} is not up, down or nearest", call.op_type())
    };
    Ok(Narrowing { saturate: call.attr_i("saturate", 1)? != 0, round })
}

fn load(t: &Tensor, dtype: DType) -> Result<Src> {
    Ok(match dtype {
        d if d.is_float() || d.is_minifloat() => Src::F(t.read_vec::<f64>()?),
        DType::U64 => Src::I(t.read_vec::<u64>()?.into_iter().map(|v| v as i128).collect()),
        // Sign- or zero-extended exactly by the SDK's integer conversion; bool as 0/1.
        _ => Src::I(t.read_vec::<i64>()?.into_iter().map(|v| v as i128).collect()),
    })
}

/// A float (exact as f64) as a `to` code, `to` a float8 or float4 type.
fn minifloat_code(x: f64, to: DType, n: Narrowing) -> u8 {
    match to {
        DType::F8E8M0 => minifloat::e8m0_from_f32(x as f32, n.saturate, n.round),
        _ => minifloat::from_f64(to, x, n.saturate),
    }
}

fn convert(src: &Src, to: DType, n: Narrowing) -> Result<Vec<u8>> {
    Ok(match (src, to) {
        (Src::F(v), to) if to.is_minifloat() => minifloat::pack(to, v.iter().map(|&x| minifloat_code(x, to, n))),
        (Src::I(v), to) if to.is_minifloat() => minifloat::pack(to, v.iter().map(|&x| minifloat_code(x as f64, to, n))),
        // Truncated toward zero (NaN → 0), then the low bits.
        (Src::F(v), to) if to.is_narrow_int() => {
            minifloat::pack(to, v.iter().map(|&x| minifloat::narrow_int_field(to, x as i64)))
        }
        (Src::I(v), to) if to.is_narrow_int() => {
            minifloat::pack(to, v.iter().map(|&x| minifloat::narrow_int_field(to, x as i64)))
        }
        (Src::F(v), DType::F64) => element::encode(v),
        (Src::F(v), DType::F32) => element::encode(&v.iter().map(|&x| x as f32).collect::<Vec<_>>()),
        (Src::F(v), DType::F16) => {
            element::encode(&v.iter().map(|&x| f16::from_f32(element::f32_round_odd(x))).collect::<Vec<_>>())
        }
        (Src::F(v), DType::BF16) => {
            element::encode(&v.iter().map(|&x| bf16::from_f32(element::f32_round_odd(x))).collect::<Vec<_>>())
        }
        // To integers and bool: `from_f64` truncates toward zero, saturating, NaN → 0;
        // bool is `x != 0`.
        (Src::F(v), to) => {
            with_dtype!(to, T => Ok(element::encode(&v.iter().map(|&x| T::from_f64(x)).collect::<Vec<T>>())))?
        }
        (Src::I(v), DType::F64) => element::encode(&v.iter().map(|&x| x as f64).collect::<Vec<_>>()),
        (Src::I(v), DType::F32) => element::encode(&v.iter().map(|&x| x as f32).collect::<Vec<_>>()),
        (Src::I(v), DType::F16) => {
            element::encode(&v.iter().map(|&x| f16::from_f32(f32_round_odd_int(x))).collect::<Vec<_>>())
        }
        (Src::I(v), DType::BF16) => {
            element::encode(&v.iter().map(|&x| bf16::from_f32(f32_round_odd_int(x))).collect::<Vec<_>>())
        }
        (Src::I(v), DType::Bool) => element::encode(&v.iter().map(|&x| Bool(x != 0)).collect::<Vec<_>>()),
        // Integer → integer: keep the low bits (`as` wraps).
        (Src::I(v), to) => {
            with_dtype!(to, T => Ok(element::encode(&v.iter().map(|&x| T::from_i64(x as i64)).collect::<Vec<T>>())))?
        }
    })
}

impl Shim for Cast {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        let (_, to) = dtypes(call)?;
        Ok(vec![TensorType::new(to, call.input(0)?.shape()?)])
    }

    fn cpu(call: &Call) -> Result<()> {
        let (from, to) = dtypes(call)?;
        let x = call.input(0)?;
        let out = call.output(0)?;
        if from == to {
            return out.write_bytes(&x.read_bytes()?);
        }
        out.write_bytes(&convert(&load(&x, from)?, to, narrowing(call)?)?)
    }

    fn dispatch(call: &Call) -> Result<()> {
        let (from, to) = dtypes(call)?;
        let x = call.input(0)?;
        let n = x.numel()? as u64;
        if n == 0 {
            return Ok(());
        }
        const BLOCK: u32 = 256;
        let grid = n.div_ceil(BLOCK as u64).clamp(1, 65535 * 32) as u32;
        let mut args = vec![
            KernelArg::Tensor { handle: x.handle(), offset: 0 },
            KernelArg::Tensor { handle: call.output(0)?.handle(), offset: 0 },
            KernelArg::U64(n),
        ];
        let kernel = if from.since_schema_11() || to.since_schema_11() {
            // Both dtypes by code, with saturate and round_mode.
            let n = narrowing(call)?;
            let round = match n.round {
                minifloat::E8m0Rounding::Up => 0,
                minifloat::E8m0Rounding::Down => 1,
                minifloat::E8m0Rounding::Nearest => 2,
            };
            args.extend([
                KernelArg::U32(from.code() as u32),
                KernelArg::U32(to.code() as u32),
                KernelArg::U32(u32::from(n.saturate) | round << 1),
            ]);
            "kiln_cast_narrow".into()
        } else {
            let Some(tag) = from.cuda_tag() else { unsupported!("{}: no CUDA kernel from {from}", call.op_type()) };
            args.push(KernelArg::U32(to.code() as u32));
            kiln_kernel_abi::names::kernel_name("kiln_cast", &[tag])
        };
        launch(&Launch { kernel: &kernel, grid: [grid, 1, 1], block: [BLOCK, 1, 1], shared_mem_bytes: 0, args })
    }
}

export_shim!(Cast);
