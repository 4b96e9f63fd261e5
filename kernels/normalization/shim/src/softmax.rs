//! Softmax and LogSoftmax (opsets 1, 11, 13).
//!
//! Before opset 13 they coerce the input to 2-D `[prod(dims[..axis]), prod(dims[axis..])]`
//! (`axis` default 1) and normalise each row; from opset 13 they normalise along the single axis
//! `axis` (default -1). The reference computes in f64, subtracting the maximum first.

use kiln_kernel_abi::bail;
use kiln_kernel_abi::guest::*;

use crate::AxisPlan;

/// Softmax's geometry (from opset 13 along `axis`, default -1; before it X coerced to 2-D).
pub fn softmax_plan(call: &Call) -> Result<AxisPlan> {
    if call.opset() >= 13 {
        return AxisPlan::along(call, -1);
    }
    // Coerced to 2-D at `axis` (which may equal the rank: one column).
    let dims = call.input(0)?.shape()?;
    let rank = dims.len();
    let axis = call.attr_i("axis", 1)?;
    let a = if axis < 0 { axis + rank as i64 } else { axis };
    if a < 0 || a > rank as i64 {
        bail!("{}: axis {axis} is out of range for rank {rank}", call.op_type());
    }
    let a = a as usize;
    Ok(AxisPlan { outer: dims[..a].iter().product(), n: dims[a..].iter().product(), inner: 1 })
}

pub fn softmax_cpu(call: &Call, log: bool) -> Result<()> {
    let p = softmax_plan(call)?;
    let mut x = call.input(0)?.read_vec::<f64>()?;
    p.for_each_line(|line| {
        let max = line.iter().map(|&k| x[k]).fold(f64::NEG_INFINITY, |m, v| if v > m || v.is_nan() { v } else { m });
        let sum: f64 = line.iter().map(|&k| libm::exp(x[k] - max)).sum();
        if log {
            let lse = max + libm::log(sum);
            for &k in line {
                x[k] -= lse;
            }
        } else {
            for &k in line {
                x[k] = libm::exp(x[k] - max) / sum;
            }
        }
    });
    call.output(0)?.write_vec(&x)
}

pub fn softmax_dispatch(call: &Call, log: bool) -> Result<()> {
    crate::gpu::axis_launch(call, "kiln_softmax", &softmax_plan(call)?, log as u32)
}
