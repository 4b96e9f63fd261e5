//! Softmax and LogSoftmax (opsets 1, 11, 13).
//!
//! Before opset 13 they coerce the input to 2-D `[prod(dims[..axis]), prod(dims[axis..])]`
//! (`axis` default 1) and normalise each row; from opset 13 they normalise along the single axis
//! `axis` (default -1). The reference computes in f64, subtracting the maximum first.

use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, names};

use crate::axis_error;

/// Softmax's geometry: `outer` groups of `n` elements `inner` apart.
pub struct SoftmaxPlan {
    outer: usize,
    n: usize,
    inner: usize,
}

pub fn softmax_plan(call: &Call) -> Result<SoftmaxPlan> {
    let dims = call.input(0)?.shape()?;
    let rank = dims.len();
    if call.opset() < 13 {
        // Coerced to 2-D at `axis` (which may equal the rank: one column).
        let axis = call.attr_i("axis", 1)?;
        let a = if axis < 0 { axis + rank as i64 } else { axis };
        if a < 0 || a > rank as i64 {
            bail!("{}: axis {axis} is out of range for rank {rank}", call.op_type());
        }
        let a = a as usize;
        Ok(SoftmaxPlan { outer: dims[..a].iter().product(), n: dims[a..].iter().product(), inner: 1 })
    } else {
        let a = shape::normalize_axis(call.attr_i("axis", -1)?, rank).map_err(|e| axis_error(call, e))?;
        Ok(SoftmaxPlan { outer: dims[..a].iter().product(), n: dims[a], inner: dims[a + 1..].iter().product() })
    }
}

pub fn softmax_cpu(call: &Call, log: bool) -> Result<()> {
    let p = softmax_plan(call)?;
    let mut x = call.input(0)?.read_vec::<f64>()?;
    let (n, inner) = (p.n, p.inner);
    for o in 0..p.outer {
        let base = o * n * inner;
        for i in 0..inner {
            let at = |j: usize| base + j * inner + i;
            let max = (0..n).map(|j| x[at(j)]).fold(f64::NEG_INFINITY, |m, v| if v > m || v.is_nan() { v } else { m });
            let sum: f64 = (0..n).map(|j| libm::exp(x[at(j)] - max)).sum();
            if log {
                let lse = max + libm::log(sum);
                for j in 0..n {
                    x[at(j)] -= lse;
                }
            } else {
                for j in 0..n {
                    x[at(j)] = libm::exp(x[at(j)] - max) / sum;
                }
            }
        }
    }
    call.output(0)?.write_vec(&x)
}

pub fn softmax_dispatch(call: &Call, log: bool) -> Result<()> {
    let p = softmax_plan(call)?;
    let x = call.input(0)?;
    let tag = crate::gpu::kernel_tag(call, x.dtype()?)?;
    let (outer, n, inner) = (p.outer as u64, p.n as u64, p.inner as u64);
    if outer * n * inner == 0 {
        return Ok(());
    }
    let (xh, yh) = (crate::gpu::tensor(x.handle()), crate::gpu::tensor(call.output(0)?.handle()));
    if inner == 1 {
        let (grid, block) = crate::gpu::row_launch(outer, n);
        launch(&Launch {
            kernel: &names::kernel_name("kiln_softmax_rows", &[tag]),
            grid,
            block,
            shared_mem_bytes: 0,
            args: vec![xh, yh, KernelArg::U64(outer), KernelArg::U64(n), KernelArg::U32(log as u32)],
        })
    } else {
        launch(&Launch {
            kernel: &names::kernel_name("kiln_softmax_cols", &[tag]),
            grid: [(outer * inner).div_ceil(256).min(1 << 20) as u32, 1, 1],
            block: [256, 1, 1],
            shared_mem_bytes: 0,
            args: vec![
                xh,
                yh,
                KernelArg::U64(outer),
                KernelArg::U64(n),
                KernelArg::U64(inner),
                KernelArg::U32(log as u32),
            ],
        })
    }
}
