//! IsNaN-9/13/20 and IsInf-10/20 (ONNX Operators.md): bool outputs of the input's shape. IsInf's
//! `detect_positive` and `detect_negative` (both 1 by default) choose which infinities count.
//! Floating-point inputs; the kernel `kiln_classify<Tag>` takes the bits of `what` below.

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, unsupported};

/// Bits of `what`: NaN, +inf, -inf.
const NAN: u32 = 1;
const POS_INF: u32 = 2;
const NEG_INF: u32 = 4;

/// The values the node reports as true.
fn what(call: &Call) -> Result<u32> {
    let x = call.input(0)?.dtype()?;
    if !x.is_float() {
        bail!("{}: input must be floating-point, not {x}", call.op_type());
    }
    Ok(match call.op_type() {
        "IsNaN" => NAN,
        _ => {
            let flag = |name: &str| -> Result<bool> { Ok(call.attr_i(name, 1)? != 0) };
            (if flag("detect_positive")? { POS_INF } else { 0 }) | (if flag("detect_negative")? { NEG_INF } else { 0 })
        }
    })
}

fn is(what: u32, v: f64) -> bool {
    (what & NAN != 0 && v.is_nan())
        || (what & POS_INF != 0 && v == f64::INFINITY)
        || (what & NEG_INF != 0 && v == f64::NEG_INFINITY)
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    what(call)?;
    Ok(vec![TensorType::new(DType::Bool, call.input(0)?.shape()?)])
}

pub fn cpu(call: &Call) -> Result<()> {
    let what = what(call)?;
    let xs = call.input(0)?.read_vec::<f64>()?;
    call.output(0)?.write_vec(&xs.iter().map(|&v| Bool(is(what, v))).collect::<Vec<_>>())
}

pub fn dispatch(call: &Call) -> Result<()> {
    let what = what(call)?;
    let x = call.input(0)?;
    let dtype = x.dtype()?;
    let Some(tag) = dtype.cuda_tag().filter(|_| dtype.is_float()) else {
        unsupported!("{}: no CUDA kernel for {dtype}", call.op_type())
    };
    let n = x.numel()? as u64;
    if n == 0 {
        return Ok(());
    }
    launch(&Launch {
        kernel: &kernel_name("kiln_classify", &[tag]),
        grid: [n.div_ceil(256).clamp(1, 65535 * 32) as u32, 1, 1],
        block: [256, 1, 1],
        shared_mem_bytes: 0,
        args: vec![
            KernelArg::Tensor { handle: x.handle(), offset: 0 },
            KernelArg::Tensor { handle: call.output(0)?.handle(), offset: 0 },
            KernelArg::U64(n),
            KernelArg::U32(what),
        ],
    })
}
