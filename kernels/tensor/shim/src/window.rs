//! HannWindow, HammingWindow and BlackmanWindow (opset 17), after ONNX Operators.md and its
//! reference: a 1-D window of `size` (a scalar value input, int32 or int64) values
//! w[n] = a0 − a1·cos(2πn / N) + a2·cos(4πn / N), N = size when `periodic` (default 1), else
//! size − 1; Hann (½, ½, 0), Hamming (25/46, 21/46, 0), Blackman (0.42, 0.5, 0.08). The output
//! type is `output_datatype` (default float32): float32, float16, bfloat16 or float64 here.
//! Computed in f64 and rounded once (on the GPU float16 and bfloat16 through float32, which may
//! differ by an ulp).

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, unsupported};

use crate::gpu::launch_elems;

struct Plan {
    size: usize,
    dtype: DType,
    /// a0, a1, a2 and N.
    coeffs: [f64; 3],
    period: f64,
}

fn plan(call: &Call) -> Result<Plan> {
    let op = call.op_type();
    let size = call.input(0)?.read_i64s()?;
    let &[size] = &size[..] else { bail!("{op}: size must be one value, not {}", size.len()) };
    let Ok(size) = usize::try_from(size) else { bail!("{op}: size {size} is negative or too large") };
    let code = call.attr_i("output_datatype", 1)?;
    let dtype = match i32::try_from(code).ok().and_then(DType::from_code) {
        Some(d @ (DType::F32 | DType::F16 | DType::BF16 | DType::F64)) => d,
        _ => unsupported!("{op}: output_datatype {code}; float32, float16, bfloat16 and float64 are supported"),
    };
    let coeffs = match op {
        "HannWindow" => [0.5, 0.5, 0.0],
        "HammingWindow" => [25.0 / 46.0, 21.0 / 46.0, 0.0],
        _ => [0.42, 0.5, 0.08],
    };
    let periodic = call.attr_i("periodic", 1)? != 0;
    Ok(Plan { size, dtype, coeffs, period: if periodic { size as f64 } else { size as f64 - 1.0 } })
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    Ok(vec![TensorType::new(p.dtype, vec![p.size])])
}

pub fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let [a0, a1, a2] = p.coeffs;
    let pi = core::f64::consts::PI;
    let w: Vec<f64> = (0..p.size)
        .map(|n| {
            let n = n as f64;
            a0 - a1 * libm::cos(n * (2.0 * pi) / p.period) + a2 * libm::cos(n * (4.0 * pi) / p.period)
        })
        .collect();
    call.output(0)?.write_vec(&w)
}

pub fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let Some(tag) = p.dtype.cuda_tag() else { unsupported!("{}: no CUDA kernel for {}", call.op_type(), p.dtype) };
    let out = call.output(0)?;
    let args = vec![
        KernelArg::Tensor { handle: out.handle(), offset: 0 },
        KernelArg::U64(p.size as u64),
        KernelArg::F64(p.coeffs[0]),
        KernelArg::F64(p.coeffs[1]),
        KernelArg::F64(p.coeffs[2]),
        KernelArg::F64(p.period),
    ];
    launch_elems(&kernel_name("kiln_tensor_window", &[tag]), p.size as u64, args)
}
