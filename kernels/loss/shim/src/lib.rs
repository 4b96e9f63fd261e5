//! Shim of `kiln-loss`: NegativeLogLikelihoodLoss (12, 13, 22) and SoftmaxCrossEntropyLoss
//! (12, 13), following ONNX Operators.md and its reference implementation.
//!
//! Inputs: scores or log-probabilities `x` `[N, C, d1, …, dk]` (float), `target`
//! `[N, d1, …, dk]` (int32 or int64), optional `weight` `[C]`. Attributes: `reduction`
//! (`mean` by default, `sum`, `none`) and `ignore_index` (optional).
//!
//! ```text
//! log_prob[n, c, d] = x[n, c, d] − log Σ_c' exp x[n, c', d]     (SoftmaxCrossEntropyLoss)
//!                   = x[n, c, d]                                  (NegativeLogLikelihoodLoss)
//! w[n, d]    = 0 where target = ignore_index, else weight[target] (1 without weight)
//! loss[n, d] = −log_prob[n, target[n, d], d] · w[n, d]
//! ```
//!
//! `none` outputs `loss` (target's shape), `sum` its sum, `mean` its sum over Σ w (a scalar).
//! SoftmaxCrossEntropyLoss's optional second output is `log_prob` (x's shape). A target outside
//! `[0, C)` that is not `ignore_index` fails the node. The CPU reference computes in f64; on the
//! GPU `kiln_loss<Tag>` runs one thread per position `(n, d)` and `kiln_loss_sum<Tag>` one
//! block that sums the positions' losses and weights for `sum` and `mean`.
#![no_std]
extern crate alloc;

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, export_shim, unsupported};

struct Loss;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Reduction {
    None = 0,
    Sum = 1,
    Mean = 2,
}

struct Plan {
    softmax: bool,
    n: usize,
    c: usize,
    /// ∏ d1..dk (1 for [N, C]).
    d: usize,
    target_shape: Vec<usize>,
    x_shape: Vec<usize>,
    reduction: Reduction,
    ignore: Option<i64>,
}

fn plan(call: &Call) -> Result<Plan> {
    let op = call.op_type();
    let softmax = match op {
        "NegativeLogLikelihoodLoss" => false,
        "SoftmaxCrossEntropyLoss" => true,
        other => unsupported!("kiln-loss does not implement {other}"),
    };
    let x = call.input(0)?;
    let x_dtype = x.dtype()?;
    if !x_dtype.is_float() {
        unsupported!("{op}: {x_dtype} scores are not supported");
    }
    let x_shape = x.shape()?;
    if x_shape.len() < 2 {
        bail!("{op}: the input must be [N, C, ...], not of rank {}", x_shape.len());
    }
    let target = call.input(1)?;
    if !matches!(target.dtype()?, DType::I32 | DType::I64) {
        bail!("{op}: target must be int32 or int64, not {}", target.dtype()?);
    }
    let target_shape = target.shape()?;
    let mut want = vec![x_shape[0]];
    want.extend(&x_shape[2..]);
    if target_shape != want {
        bail!("{op}: target has shape {target_shape:?}, the input {x_shape:?} needs {want:?}");
    }
    if let Some(w) = call.input_opt(2) {
        if w.shape()? != [x_shape[1]] || w.dtype()? != x_dtype {
            bail!("{op}: weight must be {x_dtype} [{}], not {} {:?}", x_shape[1], w.dtype()?, w.shape()?);
        }
    }
    let reduction = match call.attr_s("reduction", "mean")? {
        "none" => Reduction::None,
        "sum" => Reduction::Sum,
        "mean" => Reduction::Mean,
        other => bail!("{op}: reduction must be none, sum or mean, not {other:?}"),
    };
    if call.num_outputs() > if softmax { 2 } else { 1 } {
        bail!("{op}: the node asks for {} outputs", call.num_outputs());
    }
    Ok(Plan {
        softmax,
        n: x_shape[0],
        c: x_shape[1],
        d: x_shape[2..].iter().product(),
        target_shape,
        x_shape,
        reduction,
        ignore: call.attr("ignore_index").map(|_| call.attr_i("ignore_index", 0)).transpose()?,
    })
}

impl Shim for Loss {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        let p = plan(call)?;
        let dtype = call.input(0)?.dtype()?;
        let loss_shape = if p.reduction == Reduction::None { p.target_shape } else { Vec::new() };
        let mut out = vec![TensorType::new(dtype, loss_shape)];
        if call.num_outputs() > 1 {
            out.push(TensorType::new(dtype, p.x_shape));
        }
        Ok(out)
    }

    fn cpu(call: &Call) -> Result<()> {
        let p = plan(call)?;
        let op = call.op_type();
        let mut x = call.input(0)?.read_vec::<f64>()?;
        let target = call.input(1)?.read_i64s()?;
        let weight = call.input_opt(2).map(|w| w.read_vec::<f64>()).transpose()?;
        let (c, d) = (p.c, p.d);
        if p.softmax {
            for n in 0..p.n {
                for j in 0..d {
                    let at = |k: usize| (n * c + k) * d + j;
                    let m = (0..c).map(|k| x[at(k)]).fold(f64::NEG_INFINITY, f64::max);
                    let lse = m + libm::log((0..c).map(|k| libm::exp(x[at(k)] - m)).sum::<f64>());
                    (0..c).for_each(|k| x[at(k)] -= lse);
                }
            }
        }
        let (mut loss, mut total, mut weights) = (Vec::with_capacity(p.n * d), 0f64, 0f64);
        for n in 0..p.n {
            for j in 0..d {
                let t = target[n * d + j];
                if Some(t) == p.ignore {
                    loss.push(0.0);
                    continue;
                }
                // usize is 32 bits in the shim: convert before comparing.
                let Some(t) = usize::try_from(t).ok().filter(|&t| t < c) else {
                    bail!("{op}: target {t} is out of range for {c} classes");
                };
                let w = weight.as_ref().map_or(1.0, |w| w[t]);
                let l = -x[(n * c + t) * d + j] * w;
                loss.push(l);
                total += l;
                weights += w;
            }
        }
        match p.reduction {
            Reduction::None => call.output(0)?.write_vec(&loss)?,
            Reduction::Sum => call.output(0)?.write_vec(&[total])?,
            Reduction::Mean => call.output(0)?.write_vec(&[total / weights])?,
        }
        if let Some(t) = call.output_opt(1) {
            t.write_vec(&x)?;
        }
        Ok(())
    }

    fn dispatch(call: &Call) -> Result<()> {
        let p = plan(call)?;
        let x = call.input(0)?;
        let dtype = x.dtype()?;
        let Some(tag) = dtype.cuda_tag() else { unsupported!("{}: no CUDA kernel for {dtype}", call.op_type()) };
        let positions = (p.n * p.d) as u64;
        let loss = call.output(0)?;
        let log_prob = call.output_opt(1);
        let target = call.input(1)?;
        let weight = call.input_opt(2);
        // Per position its loss and weight for `sum` and `mean` (the compute type: f64 for
        // float64, else f32), summed by kiln_loss_sum.
        let esize = if dtype == DType::F64 { 8 } else { 4 };
        let partial = match p.reduction {
            Reduction::None => loss.handle(),
            _ => scratch((2 * positions).max(1) * esize)?,
        };
        let t = KernelArg::tensor;
        if positions > 0 {
            launch(&Launch {
                kernel: &kernel_name("kiln_loss", &[tag]),
                grid: grid_stride(positions),
                block: [GRID_STRIDE_BLOCK, 1, 1],
                shared_mem_bytes: 0,
                args: vec![
                    t(x.handle()),
                    t(target.handle()),
                    t(weight.as_ref().map_or(x.handle(), |w| w.handle())),
                    t(log_prob.as_ref().map_or(x.handle(), |l| l.handle())),
                    t(loss.handle()),
                    t(partial),
                    KernelArg::U64(p.n as u64),
                    KernelArg::U64(p.c as u64),
                    KernelArg::U64(p.d as u64),
                    KernelArg::U32(p.softmax as u32),
                    KernelArg::U32(weight.is_some() as u32),
                    KernelArg::U32(p.ignore.is_some() as u32),
                    KernelArg::I64(p.ignore.unwrap_or(0)),
                    KernelArg::U32(log_prob.is_some() as u32),
                    KernelArg::U32((target.dtype()? == DType::I64) as u32),
                    KernelArg::U32(p.reduction as u32),
                    KernelArg::Status,
                ],
            })?;
        }
        if p.reduction == Reduction::None {
            return Ok(());
        }
        launch(&Launch {
            kernel: &kernel_name("kiln_loss_sum", &[tag]),
            grid: [1, 1, 1],
            block: [1024, 1, 1],
            shared_mem_bytes: 0,
            args: vec![
                t(partial),
                t(loss.handle()),
                KernelArg::U64(positions),
                KernelArg::U32((p.reduction == Reduction::Mean) as u32),
            ],
        })
    }
}

export_shim!(Loss);
