//! Shim of `kiln-unary`: unary elementwise ops, following ONNX Operators.md (Relu-14,
//! LeakyRelu-16, Sigmoid-13, Tanh-13, Exp-13, Log-13, Sqrt-13, Neg-13, Abs-13, Erf-13,
//! Reciprocal-13, Cos-7, Sin-7, Floor-13, Ceil-13, Not-1, Gelu-20, Softplus-1, HardSigmoid-6,
//! Clip-6/11/13, Elu-6, Selu-6, Celu-12, HardSwish-14, Mish-18, ThresholdedRelu-10, Softsign-1,
//! Shrink-9, Tan-7, Asin-7, Acos-7, Atan-7, Sinh-9, Cosh-9, Asinh-9, Acosh-9, Atanh-9, Sign-9,
//! Round-11, BitwiseNot-18, Swish-24), IsNaN and IsInf (`classify`), and `ai.kiln::SwiGlu` (`swiglu`). The CPU reference computes
//! floating-point ops in f64 and rounds once.
#![no_std]
extern crate alloc;

mod classify;
mod swiglu;

use alloc::string::String;
use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, export_shim, unsupported, with_dtype};

struct Unary;

/// A float op and its parameters.
#[derive(Clone, Copy)]
enum Op {
    Relu,
    LeakyRelu(f64),
    Sigmoid,
    Tanh,
    Exp,
    Log,
    Sqrt,
    Neg,
    Abs,
    Erf,
    Reciprocal,
    Cos,
    Sin,
    Floor,
    Ceil,
    Gelu {
        tanh: bool,
    },
    Softplus,
    HardSigmoid(f64, f64),
    Elu(f64),
    /// alpha, gamma.
    Selu(f64, f64),
    Celu(f64),
    HardSwish,
    Mish,
    ThresholdedRelu(f64),
    Softsign,
    /// bias, lambd.
    Shrink(f64, f64),
    Tan,
    Asin,
    Acos,
    Atan,
    Sinh,
    Cosh,
    Asinh,
    Acosh,
    Atanh,
    Sign,
    Round,
    /// Integers only.
    BitwiseNot,
    /// x·sigmoid(alpha·x) (Swish-24).
    Swish(f64),
}

impl Op {
    fn from_call(call: &Call) -> Result<Op> {
        Ok(match call.op_type() {
            "Relu" => Op::Relu,
            "LeakyRelu" => Op::LeakyRelu(call.attr_f("alpha", 0.01)? as f64),
            "Sigmoid" => Op::Sigmoid,
            "Tanh" => Op::Tanh,
            "Exp" => Op::Exp,
            "Log" => Op::Log,
            "Sqrt" => Op::Sqrt,
            "Neg" => Op::Neg,
            "Abs" => Op::Abs,
            "Erf" => Op::Erf,
            "Reciprocal" => Op::Reciprocal,
            "Cos" => Op::Cos,
            "Sin" => Op::Sin,
            "Floor" => Op::Floor,
            "Ceil" => Op::Ceil,
            "Gelu" => match call.attr_s("approximate", "none")? {
                "none" => Op::Gelu { tanh: false },
                "tanh" => Op::Gelu { tanh: true },
                other => bail!("Gelu: approximate must be \"none\" or \"tanh\", not {other:?}"),
            },
            "Softplus" => Op::Softplus,
            "HardSigmoid" => Op::HardSigmoid(call.attr_f("alpha", 0.2)? as f64, call.attr_f("beta", 0.5)? as f64),
            "Elu" => Op::Elu(call.attr_f("alpha", 1.0)? as f64),
            "Selu" => Op::Selu(call.attr_f("alpha", 1.673_263_2)? as f64, call.attr_f("gamma", 1.050_701)? as f64),
            "Celu" => Op::Celu(call.attr_f("alpha", 1.0)? as f64),
            "HardSwish" => Op::HardSwish,
            "Mish" => Op::Mish,
            "ThresholdedRelu" => Op::ThresholdedRelu(call.attr_f("alpha", 1.0)? as f64),
            "Softsign" => Op::Softsign,
            "Shrink" => Op::Shrink(call.attr_f("bias", 0.0)? as f64, call.attr_f("lambd", 0.5)? as f64),
            "Tan" => Op::Tan,
            "Asin" => Op::Asin,
            "Acos" => Op::Acos,
            "Atan" => Op::Atan,
            "Sinh" => Op::Sinh,
            "Cosh" => Op::Cosh,
            "Asinh" => Op::Asinh,
            "Acosh" => Op::Acosh,
            "Atanh" => Op::Atanh,
            "Sign" => Op::Sign,
            "Round" => Op::Round,
            "BitwiseNot" => Op::BitwiseNot,
            "Swish" => Op::Swish(call.attr_f("alpha", 1.0)? as f64),
            other => unsupported!("kiln-unary does not implement {other}"),
        })
    }

    /// The op code passed to the CUDA kernel (`enum UnaryOp` in cuda/unary.cu).
    fn code(self) -> u32 {
        match self {
            Op::Relu => 0,
            Op::LeakyRelu(_) => 1,
            Op::Sigmoid => 2,
            Op::Tanh => 3,
            Op::Exp => 4,
            Op::Log => 5,
            Op::Sqrt => 6,
            Op::Neg => 7,
            Op::Abs => 8,
            Op::Erf => 9,
            Op::Reciprocal => 10,
            Op::Cos => 11,
            Op::Sin => 12,
            Op::Floor => 13,
            Op::Ceil => 14,
            Op::Gelu { tanh: false } => 15,
            Op::Gelu { tanh: true } => 16,
            Op::Softplus => 17,
            Op::HardSigmoid(..) => 18,
            Op::Elu(_) => 19,
            Op::Selu(..) => 20,
            Op::Celu(_) => 21,
            Op::HardSwish => 22,
            Op::Mish => 23,
            Op::ThresholdedRelu(_) => 24,
            Op::Softsign => 25,
            Op::Shrink(..) => 26,
            Op::Tan => 27,
            Op::Asin => 28,
            Op::Acos => 29,
            Op::Atan => 30,
            Op::Sinh => 31,
            Op::Cosh => 32,
            Op::Asinh => 33,
            Op::Acosh => 34,
            Op::Atanh => 35,
            Op::Sign => 36,
            Op::Round => 37,
            Op::BitwiseNot => 38,
            Op::Swish(_) => 39,
        }
    }

    fn params(self) -> (f64, f64) {
        match self {
            Op::LeakyRelu(a) => (a, 0.0),
            Op::HardSigmoid(a, b) | Op::Selu(a, b) | Op::Shrink(a, b) => (a, b),
            Op::Elu(a) | Op::Celu(a) | Op::ThresholdedRelu(a) | Op::Swish(a) => (a, 0.0),
            _ => (0.0, 0.0),
        }
    }

    fn apply(self, x: f64) -> f64 {
        use libm::{
            acos, acosh, asin, asinh, atan, atanh, ceil, cos, cosh, erf, exp, expm1, floor, log, log1p, rint, sin,
            sinh, sqrt, tan, tanh,
        };
        // log(1 + e^x), stable for large |x|.
        let softplus = |x: f64| if x > 0.0 { x + log1p(exp(-x)) } else { log1p(exp(x)) };
        match self {
            Op::Relu => {
                if x > 0.0 {
                    x
                } else {
                    0.0
                }
            }
            Op::LeakyRelu(a) => {
                if x >= 0.0 {
                    x
                } else {
                    a * x
                }
            }
            Op::Sigmoid => {
                if x >= 0.0 {
                    1.0 / (1.0 + exp(-x))
                } else {
                    let e = exp(x);
                    e / (1.0 + e)
                }
            }
            Op::Tanh => tanh(x),
            Op::Exp => exp(x),
            Op::Log => log(x),
            Op::Sqrt => sqrt(x),
            Op::Neg => -x,
            Op::Abs => x.abs(),
            Op::Erf => erf(x),
            Op::Reciprocal => 1.0 / x,
            Op::Cos => cos(x),
            Op::Sin => sin(x),
            Op::Floor => floor(x),
            Op::Ceil => ceil(x),
            Op::Gelu { tanh: false } => 0.5 * x * (1.0 + erf(x / core::f64::consts::SQRT_2)),
            Op::Gelu { tanh: true } => {
                let c = sqrt(2.0 / core::f64::consts::PI);
                0.5 * x * (1.0 + tanh(c * (x + 0.044715 * x * x * x)))
            }
            Op::Softplus => softplus(x),
            Op::HardSigmoid(a, b) => (a * x + b).clamp(0.0, 1.0),
            Op::Elu(a) => {
                if x >= 0.0 {
                    x
                } else {
                    a * expm1(x)
                }
            }
            Op::Selu(a, g) => {
                if x > 0.0 {
                    g * x
                } else {
                    g * a * expm1(x)
                }
            }
            Op::Celu(a) => x.max(0.0) + (a * expm1(x / a)).min(0.0),
            Op::HardSwish => x * (x / 6.0 + 0.5).clamp(0.0, 1.0),
            Op::Mish => x * tanh(softplus(x)),
            Op::ThresholdedRelu(a) => {
                if x > a {
                    x
                } else {
                    0.0
                }
            }
            Op::Softsign => x / (1.0 + x.abs()),
            Op::Shrink(bias, lambd) => {
                if x < -lambd {
                    x + bias
                } else if x > lambd {
                    x - bias
                } else {
                    0.0
                }
            }
            Op::Swish(a) => {
                let z = a * x;
                x * if z >= 0.0 {
                    1.0 / (1.0 + exp(-z))
                } else {
                    let e = exp(z);
                    e / (1.0 + e)
                }
            }
            Op::Tan => tan(x),
            Op::Asin => asin(x),
            Op::Acos => acos(x),
            Op::Atan => atan(x),
            Op::Sinh => sinh(x),
            Op::Cosh => cosh(x),
            Op::Asinh => asinh(x),
            Op::Acosh => acosh(x),
            Op::Atanh => atanh(x),
            // NaN and ±0 stay as they are.
            Op::Sign => {
                if x > 0.0 {
                    1.0
                } else if x < 0.0 {
                    -1.0
                } else {
                    x
                }
            }
            // Halves to even, as ONNX's Round.
            Op::Round => rint(x),
            // Refused for floats before this is reached.
            Op::BitwiseNot => f64::NAN,
        }
    }

    /// Integer inputs: Relu, Neg, Abs (wrapping, as two's complement hardware does), Sign, and
    /// BitwiseNot (of the widened value; storing keeps the element's bits).
    fn apply_int(self, x: i64) -> Result<i64> {
        Ok(match self {
            Op::Relu => x.max(0),
            Op::Neg => x.wrapping_neg(),
            Op::Abs => x.wrapping_abs(),
            Op::Sign => x.signum(),
            Op::BitwiseNot => !x,
            _ => unsupported!("integer input"),
        })
    }
}

fn map<T: Element>(bytes: &[u8], f: impl Fn(T) -> Result<T>) -> Result<Vec<u8>> {
    let xs = element::decode::<T>(bytes);
    let ys = xs.into_iter().map(f).collect::<Result<Vec<T>>>()?;
    Ok(element::encode(&ys))
}

/// float32 ops whose f32 result is the f64 reference's rounded, in one loop over `bytes` in place
/// (`false`: another op, which the reference computes).
fn fast_f32(op: Op, bytes: &mut [u8]) -> bool {
    match op {
        Op::Relu => fast::map_f32(bytes, |x| if x > 0.0 { x } else { 0.0 }),
        Op::Neg => fast::map_f32(bytes, |x| -x),
        Op::Abs => fast::map_f32(bytes, f32::abs),
        Op::LeakyRelu(a) => {
            // alpha is a float32 attribute: a·x rounds once either way.
            let a = a as f32;
            fast::map_f32(bytes, |x| if x >= 0.0 { x } else { a * x })
        }
        _ => return false,
    }
    true
}

/// Clip's bounds: inputs `min`/`max` (opset 11+) or attributes (opset 6), as f64 and i64.
fn clip_bounds(call: &Call) -> Result<(Option<f64>, Option<f64>)> {
    if call.opset() < 11 {
        let lo = call.attr("min").map(|_| call.attr_f("min", 0.0)).transpose()?;
        let hi = call.attr("max").map(|_| call.attr_f("max", 0.0)).transpose()?;
        return Ok((lo.map(f64::from), hi.map(f64::from)));
    }
    let bound = |i: usize| -> Result<Option<f64>> {
        match call.input_opt(i) {
            None => Ok(None),
            Some(t) => {
                let v: Vec<f64> = t.read_vec()?;
                match v.as_slice() {
                    [x] => Ok(Some(*x)),
                    _ => bail!("Clip: input {i} must be a scalar"),
                }
            }
        }
    };
    Ok((bound(1)?, bound(2)?))
}

impl Shim for Unary {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        match call.op_type() {
            "SwiGlu" => return swiglu::infer(call),
            "IsNaN" | "IsInf" => return classify::infer(call),
            _ => {}
        }
        let x = call.input(0)?;
        let dtype = x.dtype()?;
        if call.op_type() == "Not" && dtype != DType::Bool {
            bail!("Not: input must be bool, not {dtype}");
        }
        Ok(vec![TensorType::new(dtype, x.shape()?)])
    }

    fn cpu(call: &Call) -> Result<()> {
        match call.op_type() {
            "SwiGlu" => return swiglu::cpu(call),
            "IsNaN" | "IsInf" => return classify::cpu(call),
            _ => {}
        }
        let x = call.input(0)?;
        let dtype = x.dtype()?;
        // This call's elements: all of them, or a tile's (manifest `cpu_tiles = "elements"`).
        let size = dtype.size().ok_or_else(|| ShimError::Unsupported(format!("{dtype} elements")))?;
        let tile = call.tile_units(x.numel()?)?;
        let at = (tile.start * size) as u64;
        let mut bytes = x.read_bytes_range(tile.start * size, tile.len() * size)?;
        if dtype == DType::F32
            && !matches!(call.op_type(), "Not" | "Clip")
            && fast_f32(Op::from_call(call)?, &mut bytes)
        {
            return call.output(0)?.write_bytes_at(at, &bytes);
        }
        let out = match call.op_type() {
            "Not" => map::<Bool>(&bytes, |b| Ok(Bool(!b.0)))?,
            "Clip" => {
                let (lo, hi) = clip_bounds(call)?;
                with_dtype!(dtype, T => map::<T>(&bytes, |v| {
                    let mut r = v;
                    if let Some(l) = lo { let l = T::from_f64(l); if r < l { r = l } }
                    if let Some(h) = hi { let h = T::from_f64(h); if r > h { r = h } }
                    Ok(r)
                }))?
            }
            _ => {
                let op = Op::from_call(call)?;
                if matches!(op, Op::BitwiseNot) && !dtype.is_int() {
                    bail!("BitwiseNot: input must be an integer, not {dtype}");
                }
                if dtype.is_float() {
                    with_dtype!(dtype, T => map::<T>(&bytes, |v| Ok(T::from_f64(op.apply(v.to_f64())))))?
                } else {
                    with_dtype!(dtype, T => map::<T>(&bytes, |v| Ok(T::from_i64(op.apply_int(v.to_i64())?))))?
                }
            }
        };
        call.output(0)?.write_bytes_at(at, &out)
    }

    fn dispatch(call: &Call) -> Result<()> {
        match call.op_type() {
            "SwiGlu" => return swiglu::dispatch(call),
            "IsNaN" | "IsInf" => return classify::dispatch(call),
            _ => {}
        }
        let x = call.input(0)?;
        let y = call.output(0)?;
        let dtype = x.dtype()?;
        let n = x.numel()? as u64;
        let (kernel, extra): (String, Vec<KernelArg>) = match call.op_type() {
            "Not" => {
                if dtype != DType::Bool {
                    bail!("Not: input must be bool, not {dtype}");
                }
                ("kiln_not".into(), vec![])
            }
            "Clip" => clip_dispatch(call, dtype)?,
            _ => {
                let op = Op::from_call(call)?;
                if matches!(op, Op::BitwiseNot) && !dtype.is_int() {
                    bail!("BitwiseNot: input must be an integer, not {dtype}");
                }
                if dtype.is_float() {
                    let Some(kernel) = instance("kiln_unary", dtype, DType::is_float) else {
                        unsupported!("{}: no CUDA kernel for {dtype}", call.op_type())
                    };
                    let (alpha, beta) = op.params();
                    (kernel, vec![KernelArg::U32(op.code()), KernelArg::F32(alpha as f32), KernelArg::F32(beta as f32)])
                } else {
                    let ints: fn(DType) -> bool = match op {
                        Op::BitwiseNot => DType::is_int,
                        Op::Relu | Op::Neg | Op::Abs | Op::Sign => is_signed_int,
                        _ => unsupported!("{}: integer input", call.op_type()),
                    };
                    let Some(kernel) = instance("kiln_unary_int", dtype, ints) else {
                        unsupported!("{}: no CUDA kernel for {dtype}", call.op_type())
                    };
                    (kernel, vec![KernelArg::U32(op.code())])
                }
            }
        };
        if n == 0 {
            return Ok(());
        }
        let size = dtype.size().unwrap_or(1) as u64;
        let mut args = vec![
            KernelArg::Tensor { handle: x.handle(), offset: 0 },
            KernelArg::Tensor { handle: y.handle(), offset: 0 },
            KernelArg::U64(n),
        ];
        args.extend(extra);
        launch(&Launch {
            kernel: &kernel,
            grid: [grid_for(n, 16 / size), 1, 1],
            block: [BLOCK, 1, 1],
            shared_mem_bytes: 0,
            args,
        })
    }
}

/// Threads per block of every launch.
const BLOCK: u32 = 256;

/// Blocks for `n` elements at `per_thread` elements per thread, capped (the kernels loop).
fn grid_for(n: u64, per_thread: u64) -> u32 {
    n.div_ceil(BLOCK as u64 * per_thread.max(1)).clamp(1, 65535 * 32) as u32
}

/// The instantiation of kernel template `template` (cuda/unary.cu) for `dtype`: its name
/// expression with the dtype's tag (`kiln_clip<kiln_tag_f16>`), or `None` when `instantiated`
/// (the dtypes kernel.toml instantiates the template for) does not hold `dtype`.
fn instance(template: &str, dtype: DType, instantiated: fn(DType) -> bool) -> Option<String> {
    if !instantiated(dtype) {
        return None;
    }
    Some(kernel_name(template, &[dtype.cuda_tag()?]))
}

/// The integer dtypes of Relu, Neg, Abs and Sign: signed (`kiln_unary_int` is instantiated for
/// every integer dtype, which BitwiseNot takes).
fn is_signed_int(dtype: DType) -> bool {
    matches!(dtype, DType::I8 | DType::I16 | DType::I32 | DType::I64)
}

/// The dtypes of `kiln_clip`: floating-point and integer types (not bool).
fn is_numeric(dtype: DType) -> bool {
    dtype.is_float() || dtype.is_int()
}

/// Clip's kernel and its arguments after `x, y, n`: `lo, hi, flags, lo_attr, hi_attr` (see
/// cuda/unary.cu).
fn clip_dispatch(call: &Call, dtype: DType) -> Result<(String, Vec<KernelArg>)> {
    let Some(kernel) = instance("kiln_clip", dtype, is_numeric) else {
        unsupported!("Clip: no CUDA kernel for {dtype}")
    };
    let x = call.input(0)?.handle();
    let mut flags = 0u32;
    let (mut lo, mut hi) = (x, x);
    let (mut lo_attr, mut hi_attr) = (0.0f64, 0.0f64);
    if call.opset() < 11 {
        if call.attr("min").is_some() {
            lo_attr = call.attr_f("min", 0.0)? as f64;
            flags |= 4;
        }
        if call.attr("max").is_some() {
            hi_attr = call.attr_f("max", 0.0)? as f64;
            flags |= 8;
        }
    } else {
        for (i, bit) in [(1usize, 1u32), (2, 2)] {
            if let Some(t) = call.input_opt(i) {
                if t.numel()? != 1 {
                    bail!("Clip: input {i} must be a scalar");
                }
                if t.dtype()? != dtype {
                    unsupported!("Clip: bound {i} of dtype {} for input of {dtype}", t.dtype()?);
                }
                if i == 1 {
                    lo = t.handle();
                } else {
                    hi = t.handle();
                }
                flags |= bit;
            }
        }
    }
    Ok((
        kernel,
        vec![
            KernelArg::Tensor { handle: lo, offset: 0 },
            KernelArg::Tensor { handle: hi, offset: 0 },
            KernelArg::U32(flags),
            KernelArg::F64(lo_attr),
            KernelArg::F64(hi_attr),
        ],
    ))
}

export_shim!(Unary);
