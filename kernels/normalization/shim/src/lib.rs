//! Shim of `kiln-normalization`: Softmax and LogSoftmax (1/11/13) and LayerNormalization-17,
//! following ONNX Operators.md.
//!
//! Softmax and LogSoftmax before opset 13 coerce the input to 2-D
//! `[prod(dims[..axis]), prod(dims[axis..])]` (`axis` default 1) and normalise each row; from
//! opset 13 they normalise along the single axis `axis` (default -1).
//!
//! LayerNormalization normalises over dimensions `axis..rank` (`axis` default -1), then scales
//! by `Scale` and shifts by the optional `B` (both broadcast unidirectionally to X). The
//! optional outputs Mean and InvStdDev keep the normalised dimensions as 1 and have the dtype
//! named by `stash_type` (default 1, float32).
//!
//! The CPU reference computes in f64 and rounds once; Softmax subtracts the maximum first.
#![no_std]
extern crate alloc;

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, export_shim, unsupported};

struct Normalization;

fn check_float(call: &Call, dtype: DType) -> Result<()> {
    if !dtype.is_float() {
        unsupported!("{}: dtype {dtype} is not supported (floating-point only)", call.op_type());
    }
    Ok(())
}

fn axis_error(call: &Call, e: ShimError) -> ShimError {
    match e {
        ShimError::Failed(m) => ShimError::Failed(format!("{}: {m}", call.op_type())),
        other => other,
    }
}

/// Softmax's geometry: `outer` groups of `n` elements `inner` apart.
struct SoftmaxPlan {
    outer: usize,
    n: usize,
    inner: usize,
}

fn softmax_plan(call: &Call) -> Result<SoftmaxPlan> {
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

fn softmax_cpu(call: &Call, log: bool) -> Result<()> {
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

/// LayerNormalization's geometry.
struct LayerNormPlan {
    x_shape: Vec<usize>,
    rows: usize,
    cols: usize,
    /// Shape of Mean and InvStdDev: normalised dimensions kept as 1.
    stat_shape: Vec<usize>,
    stat_dtype: DType,
}

fn layer_norm_plan(call: &Call) -> Result<LayerNormPlan> {
    let x = call.input(0)?;
    let x_shape = x.shape()?;
    let dtype = x.dtype()?;
    check_float(call, dtype)?;
    let a = shape::normalize_axis(call.attr_i("axis", -1)?, x_shape.len()).map_err(|e| axis_error(call, e))?;
    for (i, what) in [(1, "Scale"), (2, "B")] {
        let Some(t) = call.input_opt(i) else { continue };
        if t.dtype()? != dtype {
            bail!("LayerNormalization: {what} has dtype {}, X has {dtype}", t.dtype()?);
        }
        let s = t.shape()?;
        if shape::broadcast_shapes(&[&x_shape, &s]).ok().as_deref() != Some(&x_shape[..]) {
            bail!("LayerNormalization: {what} of shape {s:?} does not broadcast to X's shape {x_shape:?}");
        }
    }
    let stash = call.attr_i("stash_type", 1)?;
    let stat_dtype = match i32::try_from(stash).ok().and_then(DType::from_code) {
        Some(d) if d.is_float() => d,
        _ => bail!("LayerNormalization: stash_type {stash} is not a floating-point type"),
    };
    let stat_shape = x_shape.iter().enumerate().map(|(i, &d)| if i < a { d } else { 1 }).collect();
    Ok(LayerNormPlan {
        rows: x_shape[..a].iter().product(),
        cols: x_shape[a..].iter().product(),
        x_shape,
        stat_shape,
        stat_dtype,
    })
}

fn layer_norm_cpu(call: &Call) -> Result<()> {
    let p = layer_norm_plan(call)?;
    let eps = call.attr_f("epsilon", 1e-5)? as f64;
    let mut x = call.input(0)?.read_vec::<f64>()?;
    // Scale and B, and for each element of X the index of the Scale/B element applied to it.
    let affine = |i: usize| -> Result<Option<(Vec<f64>, Vec<usize>)>> {
        match call.input_opt(i) {
            None => Ok(None),
            Some(t) => Ok(Some((t.read_vec::<f64>()?, shape::broadcast_index(&t.shape()?, &p.x_shape)))),
        }
    };
    let scale =
        affine(1)?.ok_or_else(|| ShimError::Failed("LayerNormalization: input 1 (Scale) is required".into()))?;
    let bias = affine(2)?;
    let mut means = Vec::with_capacity(p.rows);
    let mut inv_stds = Vec::with_capacity(p.rows);
    let cols = p.cols;
    for r in 0..p.rows {
        let row = &mut x[r * cols..(r + 1) * cols];
        let mean = row.iter().sum::<f64>() / cols as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / cols as f64;
        let inv_std = 1.0 / libm::sqrt(var + eps);
        for (c, v) in row.iter_mut().enumerate() {
            let k = r * cols + c;
            let mut y = (*v - mean) * inv_std * scale.0[scale.1[k]];
            if let Some((b, ib)) = &bias {
                y += b[ib[k]];
            }
            *v = y;
        }
        means.push(mean);
        inv_stds.push(inv_std);
    }
    call.output(0)?.write_vec(&x)?;
    if let Some(t) = call.output_opt(1) {
        t.write_vec(&means)?;
    }
    if let Some(t) = call.output_opt(2) {
        t.write_vec(&inv_stds)?;
    }
    Ok(())
}

impl Shim for Normalization {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        let x = call.input(0)?;
        let dtype = x.dtype()?;
        match call.op_type() {
            "Softmax" | "LogSoftmax" => {
                check_float(call, dtype)?;
                softmax_plan(call)?;
                Ok(vec![TensorType::new(dtype, x.shape()?)])
            }
            "LayerNormalization" => {
                let p = layer_norm_plan(call)?;
                let stat = TensorType::new(p.stat_dtype, p.stat_shape);
                Ok(vec![TensorType::new(dtype, p.x_shape), stat.clone(), stat])
            }
            other => unsupported!("kiln-normalization does not implement {other}"),
        }
    }

    fn cpu(call: &Call) -> Result<()> {
        match call.op_type() {
            "Softmax" | "LogSoftmax" => {
                check_float(call, call.input(0)?.dtype()?)?;
                softmax_cpu(call, call.op_type() == "LogSoftmax")
            }
            "LayerNormalization" => layer_norm_cpu(call),
            other => unsupported!("kiln-normalization does not implement {other}"),
        }
    }
}

export_shim!(Normalization);
