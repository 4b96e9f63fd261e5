//! Shim of `kiln-cast`: Cast-6/9/13/19/21/23/24/25 and CastLike-15/19/21/23/24/25 between
//! float32, float16, bfloat16, float64, int8…int64, uint8…uint64 and bool, following ONNX
//! Operators.md:
//!
//! - float → float rounds to nearest even, once (float64 → float16/bfloat16 included);
//!   NaN and ±inf are kept, values beyond the target's range become ±inf;
//! - float → integer truncates toward zero (out of range, which ONNX leaves undefined,
//!   saturates; NaN → 0);
//! - integer → float rounds to nearest even; integer → integer wraps (two's complement);
//! - anything → bool is `x != 0` (NaN → true); bool → number is 0 or 1.
//!
//! Strings, float8, float4, int4/uint4, int2/uint2 and float8e8m0 are not supported (their
//! dtype codes are not representable in kiln). `saturate` and `round_mode` only concern float8
//! targets and are ignored.
#![no_std]
extern crate alloc;

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, export_shim, unsupported, with_dtype};

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

fn load(t: &Tensor, dtype: DType) -> Result<Src> {
    Ok(match dtype {
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 => Src::F(t.read_vec::<f64>()?),
        DType::U64 => Src::I(t.read_vec::<u64>()?.into_iter().map(|v| v as i128).collect()),
        // Sign- or zero-extended exactly by the SDK's integer conversion; bool as 0/1.
        _ => Src::I(t.read_vec::<i64>()?.into_iter().map(|v| v as i128).collect()),
    })
}

fn convert(src: &Src, to: DType) -> Result<Vec<u8>> {
    Ok(match (src, to) {
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
        out.write_bytes(&convert(&load(&x, from)?, to)?)
    }

    fn dispatch(call: &Call) -> Result<()> {
        let (from, to) = dtypes(call)?;
        let Some(tag) = from.cuda_tag() else { unsupported!("{}: no CUDA kernel from {from}", call.op_type()) };
        let kernel = kiln_kernel_abi::names::kernel_name("kiln_cast", &[tag]);
        if to == DType::String {
            unsupported!("{}: no CUDA kernel to {to}", call.op_type());
        }
        let x = call.input(0)?;
        let n = x.numel()? as u64;
        if n == 0 {
            return Ok(());
        }
        const BLOCK: u32 = 256;
        let grid = n.div_ceil(BLOCK as u64).clamp(1, 65535 * 32) as u32;
        launch(&Launch {
            kernel: &kernel,
            grid: [grid, 1, 1],
            block: [BLOCK, 1, 1],
            shared_mem_bytes: 0,
            args: vec![
                KernelArg::Tensor { handle: x.handle(), offset: 0 },
                KernelArg::Tensor { handle: call.output(0)?.handle(), offset: 0 },
                KernelArg::U64(n),
                KernelArg::U32(to.code() as u32),
            ],
        })
    }
}

export_shim!(Cast);
