//! LpNormalization (opsets 1 and 22): `Y = X / ‖X‖_p` along `axis` (default -1), with
//! `‖x‖_p = (Σ |x|^p)^(1/p)` and `p` 1 or 2 (default 2), following ONNX Operators.md. A zero norm
//! divides as IEEE 754 does (0/0 is NaN), as ONNX 1.20's node test data expects
//! (test_l2normalization_axis_0); later reference code returns 0 there. The reference computes
//! in f64 and rounds once to X's dtype; the CUDA kernels sum in f32 (f64 for float64), so a
//! float32 or bfloat16 row whose squares overflow or underflow f32 differs from it (as NumPy's
//! and onnxruntime's float32 sums do).

use alloc::vec::Vec;
use kiln_kernel_abi::bail;
use kiln_kernel_abi::guest::*;

use crate::{check_float, AxisPlan};

/// `p` of the node: 1 or 2. Errors: any other value.
fn order(call: &Call) -> Result<u32> {
    match call.attr_i("p", 2)? {
        1 => Ok(1),
        2 => Ok(2),
        p => bail!("LpNormalization: p must be 1 or 2, got {p}"),
    }
}

/// The plan and `p`, after the dtype check.
fn plan(call: &Call) -> Result<(AxisPlan, u32)> {
    check_float(call, call.input(0)?.dtype()?)?;
    Ok((AxisPlan::along(call, -1)?, order(call)?))
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    plan(call)?;
    let x = call.input(0)?;
    Ok(vec![TensorType::new(x.dtype()?, x.shape()?)])
}

pub fn cpu(call: &Call) -> Result<()> {
    let (p, order) = plan(call)?;
    let mut x = call.input(0)?.read_vec::<f64>()?;
    p.for_each_line(|line| {
        let norm = if order == 1 {
            line.iter().map(|&k| libm::fabs(x[k])).sum::<f64>()
        } else {
            libm::sqrt(line.iter().map(|&k| x[k] * x[k]).sum::<f64>())
        };
        for &k in line {
            x[k] /= norm;
        }
    });
    call.output(0)?.write_vec(&x)
}

pub fn dispatch(call: &Call) -> Result<()> {
    let (p, order) = plan(call)?;
    crate::gpu::axis_launch(call, "kiln_lp_norm", &p, order)
}
