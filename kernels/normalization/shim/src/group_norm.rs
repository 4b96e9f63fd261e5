//! InstanceNormalization (1, 6, 22) and GroupNormalization (18, 21), after ONNX Operators.md.
//!
//! X [N, C, D…] is normalised per (n, group) over the group's C / G channels and every spatial
//! position: y = (x − mean) / sqrt(var + `epsilon`) · scale + bias (population variance).
//! InstanceNormalization is G = C with `scale` and `B` [C]. GroupNormalization has
//! `num_groups` G; its `scale` and `bias` are [C] from opset 21, [G] (one per group) at opset
//! 18. The CPU reference computes in f64 and rounds once; the CUDA kernel `kiln_group_norm`
//! reduces a row (one (n, group)) per block, as LayerNormalization's does.
use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, names};

use crate::check_float;

/// One node's geometry.
struct Plan {
    shape: Vec<usize>,
    groups: usize,
    channels: usize,
    spatial: usize,
    /// Scale and bias per channel (else per group).
    per_channel: bool,
}

fn plan(call: &Call) -> Result<Plan> {
    let op = call.op_type();
    let x = call.input(0)?;
    let dtype = x.dtype()?;
    check_float(call, dtype)?;
    let shape = x.shape()?;
    if shape.len() < 2 {
        bail!("{op}: X must be [N, C, ...], not of rank {}", shape.len());
    }
    let c = shape[1];
    let (groups, per_channel) = if op == "InstanceNormalization" {
        (c, true)
    } else {
        let g = call.attr_i("num_groups", 0)?;
        match usize::try_from(g) {
            Ok(n) if n > 0 && c % n == 0 => (n, call.opset() >= 21),
            _ => bail!("{op}: num_groups {g} must be positive and divide the {c} channels"),
        }
    };
    let want = if per_channel { c } else { groups };
    for (i, what) in [(1, "scale"), (2, "bias")] {
        let t = call.input(i)?;
        if t.shape()? != [want] || t.dtype()? != dtype {
            bail!("{op}: {what} must be {dtype} [{want}], not {} {:?}", t.dtype()?, t.shape()?);
        }
    }
    Ok(Plan { spatial: shape[2..].iter().product(), shape, groups, channels: c, per_channel })
}

impl Plan {
    fn rows(&self) -> usize {
        self.shape[0] * self.groups
    }
    fn cols(&self) -> usize {
        match self.groups {
            0 => 0, // no channels
            g => self.channels / g * self.spatial,
        }
    }
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    Ok(vec![TensorType::new(call.input(0)?.dtype()?, p.shape)])
}

pub fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let eps = call.attr_f("epsilon", 1e-5)? as f64;
    let mut x = call.input(0)?.read_vec::<f64>()?;
    let (scale, bias) = (call.input(1)?.read_vec::<f64>()?, call.input(2)?.read_vec::<f64>()?);
    let (cols, cpg) = (p.cols(), p.channels / p.groups.max(1));
    for r in 0..p.rows() {
        let g = r % p.groups.max(1);
        let row = &mut x[r * cols..(r + 1) * cols];
        let mean = row.iter().sum::<f64>() / cols as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / cols as f64;
        let inv = 1.0 / libm::sqrt(var + eps);
        for (k, v) in row.iter_mut().enumerate() {
            let at = if p.per_channel { g * cpg + k / p.spatial.max(1) } else { g };
            *v = (*v - mean) * inv * scale[at] + bias[at];
        }
    }
    call.output(0)?.write_vec(&x)
}

pub fn dispatch(call: &Call) -> Result<()> {
    use crate::gpu::{kernel_tag, row_launch, tensor};
    let p = plan(call)?;
    let x = call.input(0)?;
    let tag = kernel_tag(call, x.dtype()?)?;
    let (rows, cols) = (p.rows() as u64, p.cols() as u64);
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let (grid, block) = row_launch(rows, cols);
    launch(&Launch {
        kernel: &names::kernel_name("kiln_group_norm", &[tag]),
        grid,
        block,
        shared_mem_bytes: 0,
        args: vec![
            tensor(x.handle()),
            tensor(call.input(1)?.handle()),
            tensor(call.input(2)?.handle()),
            tensor(call.output(0)?.handle()),
            KernelArg::U64(rows),
            KernelArg::U64(cols),
            KernelArg::U64(p.groups as u64),
            KernelArg::U64((p.channels / p.groups) as u64),
            KernelArg::U64(p.spatial as u64),
            KernelArg::U32(p.per_channel as u32),
            KernelArg::F32(call.attr_f("epsilon", 1e-5)?),
        ],
    })
}
