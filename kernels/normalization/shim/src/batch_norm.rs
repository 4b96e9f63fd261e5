//! BatchNormalization-9/14/15 (ONNX Operators.md): inputs `X` `[N, C, D1, …]`, `scale`, `B`,
//! `input_mean`, `input_var` (each `[C]`, X's dtype here); attributes `epsilon` (1e-5),
//! `momentum` (0.9), `training_mode` (0).
//!
//! ```text
//! inference: Y = (X − input_mean) / sqrt(input_var + epsilon) · scale + B
//! training:  Y = (X − mean) / sqrt(var + epsilon) · scale + B, with mean and var (population)
//!            of each channel over N and the spatial dimensions; the optional outputs
//!            running_mean = input_mean · momentum + mean · (1 − momentum), running_var likewise
//! ```
//!
//! The CPU reference computes in f64. On the GPU, training first runs `kiln_batch_stats<Tag>`
//! (a block per channel: mean, then the variance about it, and the running statistics), then
//! `kiln_batch_norm<Tag>` (a thread per element) with those statistics.

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, unsupported};

use crate::check_float;

const OP: &str = "BatchNormalization";

struct Plan {
    n: usize,
    c: usize,
    /// Elements per (n, c): the product of the spatial dimensions.
    s: usize,
    eps: f64,
    momentum: f64,
    training: bool,
}

fn plan(call: &Call) -> Result<Plan> {
    let x = call.input(0)?;
    let dtype = x.dtype()?;
    check_float(call, dtype)?;
    let shape = x.shape()?;
    if shape.len() < 2 {
        bail!("{OP}: X must be [N, C, ...], not of rank {}", shape.len());
    }
    for i in 1..5 {
        let t = call.input(i)?;
        if t.shape()? != [shape[1]] || t.dtype()? != dtype {
            unsupported!("{OP}: input {i} must be {dtype} [{}], not {} {:?}", shape[1], t.dtype()?, t.shape()?);
        }
    }
    // From opset 14 the `training_mode` attribute; BatchNormalization-9 trains when a node asks
    // for its 5 outputs (running and saved statistics), which kiln does not build.
    let training = if call.opset() >= 14 {
        call.attr_i("training_mode", 0)? != 0
    } else if call.num_outputs() > 1 {
        unsupported!("{OP}: training mode of BatchNormalization-{} (its 5 outputs)", call.opset());
    } else {
        false
    };
    if call.num_outputs() > 3 || (!training && call.num_outputs() > 1) {
        bail!(
            "{OP}: the node asks for {} outputs; running_mean and running_var come with training_mode = 1",
            call.num_outputs()
        );
    }
    Ok(Plan {
        n: shape[0],
        c: shape[1],
        s: shape[2..].iter().product(),
        eps: call.attr_f("epsilon", 1e-5)? as f64,
        momentum: call.attr_f("momentum", 0.9)? as f64,
        training,
    })
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    let x = call.input(0)?;
    let mut out = vec![TensorType::new(x.dtype()?, x.shape()?)];
    for _ in 1..call.num_outputs() {
        out.push(TensorType::new(x.dtype()?, vec![p.c]));
    }
    Ok(out)
}

pub fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let x = call.input(0)?.read_vec::<f64>()?;
    let read = |i: usize| -> Result<Vec<f64>> { call.input(i)?.read_vec::<f64>() };
    let (scale, bias, mut mean, mut var) = (read(1)?, read(2)?, read(3)?, read(4)?);
    let at = |n: usize, c: usize, j: usize| (n * p.c + c) * p.s + j;
    if p.training {
        let count = (p.n * p.s) as f64;
        let (mut running_mean, mut running_var) = (Vec::with_capacity(p.c), Vec::with_capacity(p.c));
        for c in 0..p.c {
            let values = || (0..p.n).flat_map(move |n| (0..p.s).map(move |j| at(n, c, j)));
            let m = values().map(|k| x[k]).sum::<f64>() / count;
            let v = values().map(|k| (x[k] - m) * (x[k] - m)).sum::<f64>() / count;
            running_mean.push(mean[c] * p.momentum + m * (1.0 - p.momentum));
            running_var.push(var[c] * p.momentum + v * (1.0 - p.momentum));
            (mean[c], var[c]) = (m, v);
        }
        if let Some(t) = call.output_opt(1) {
            t.write_vec(&running_mean)?;
        }
        if let Some(t) = call.output_opt(2) {
            t.write_vec(&running_var)?;
        }
    }
    let mut y = vec![0f64; x.len()];
    for n in 0..p.n {
        for c in 0..p.c {
            let inv = 1.0 / libm::sqrt(var[c] + p.eps);
            for j in 0..p.s {
                let k = at(n, c, j);
                y[k] = (x[k] - mean[c]) * inv * scale[c] + bias[c];
            }
        }
    }
    call.output(0)?.write_vec(&y)
}

pub fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let x = call.input(0)?;
    let dtype = x.dtype()?;
    let Some(tag) = dtype.cuda_tag() else { unsupported!("{OP}: no CUDA kernel for {dtype}") };
    let t = KernelArg::tensor;
    let total = (p.n * p.c * p.s) as u64;
    if p.c == 0 {
        return Ok(());
    }
    // The statistics kiln_batch_norm reads: input_mean and input_var, or in training mode the
    // batch's, in the compute type (f64 for float64, else f32): [C] means, then [C] variances.
    let (mean, var) = if p.training {
        let esize: u64 = if dtype == DType::F64 { 8 } else { 4 };
        let stats = scratch(2 * p.c as u64 * esize)?;
        let (batch_mean, batch_var) = (
            KernelArg::Tensor { handle: stats, offset: 0 },
            KernelArg::Tensor { handle: stats, offset: p.c as u64 * esize },
        );
        let running = |i: usize| call.output_opt(i).map(|o| o.handle());
        launch(&Launch {
            kernel: &kernel_name("kiln_batch_stats", &[tag]),
            grid: [p.c as u32, 1, 1],
            block: [256, 1, 1],
            shared_mem_bytes: 0,
            args: vec![
                t(x.handle()),
                t(call.input(3)?.handle()),
                t(call.input(4)?.handle()),
                batch_mean,
                batch_var,
                t(running(1).unwrap_or(stats)),
                t(running(2).unwrap_or(stats)),
                KernelArg::U64(p.n as u64),
                KernelArg::U64(p.c as u64),
                KernelArg::U64(p.s as u64),
                KernelArg::F32(p.momentum as f32),
                KernelArg::U32(running(1).is_some() as u32),
                KernelArg::U32(running(2).is_some() as u32),
            ],
        })?;
        (batch_mean, batch_var)
    } else {
        (t(call.input(3)?.handle()), t(call.input(4)?.handle()))
    };
    if total == 0 {
        return Ok(());
    }
    launch(&Launch {
        kernel: &kernel_name("kiln_batch_norm", &[tag]),
        grid: grid_stride(total),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args: vec![
            t(x.handle()),
            t(call.input(1)?.handle()),
            t(call.input(2)?.handle()),
            mean,
            var,
            t(call.output(0)?.handle()),
            KernelArg::U64(total),
            KernelArg::U64(p.c as u64),
            KernelArg::U64(p.s as u64),
            KernelArg::F32(p.eps as f32),
            KernelArg::U32(p.training as u32),
        ],
    })
}
