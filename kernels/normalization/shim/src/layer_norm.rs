//! LayerNormalization-17.
//!
//! Normalises over dimensions `axis..rank` (`axis` default -1), then scales by `Scale` and
//! shifts by the optional `B` (both broadcast unidirectionally to X). The optional outputs Mean
//! and InvStdDev keep the normalised dimensions as 1 and have the dtype named by `stash_type`
//! (default 1, float32). The reference computes in f64 and rounds once.

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, names, unsupported};

use crate::{axis_error, check_float};

/// LayerNormalization's geometry.
pub struct LayerNormPlan {
    pub x_shape: Vec<usize>,
    rows: usize,
    cols: usize,
    /// Shape of Mean and InvStdDev: normalised dimensions kept as 1.
    pub stat_shape: Vec<usize>,
    pub stat_dtype: DType,
}

pub fn layer_norm_plan(call: &Call) -> Result<LayerNormPlan> {
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

pub fn layer_norm_cpu(call: &Call) -> Result<()> {
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

pub fn layer_norm_dispatch(call: &Call) -> Result<()> {
    use crate::gpu::{kernel_tag, row_launch, suffix_operand, tensor};
    let p = layer_norm_plan(call)?;
    let x = call.input(0)?;
    let dtype = x.dtype()?;
    let tag = kernel_tag(call, dtype)?;
    let (rows, cols) = (p.rows as u64, p.cols as u64);
    if rows == 0 {
        return Ok(());
    }
    let stat_code = match p.stat_dtype {
        DType::F32 | DType::F16 | DType::F64 | DType::BF16 => p.stat_dtype.code() as u32,
        other => unsupported!("LayerNormalization: no CUDA kernel for stash_type {other}"),
    };
    let operand = |i: usize| -> Result<Option<(u32, u64)>> {
        match call.input_opt(i) {
            None => Ok(None),
            Some(_) if cols == 0 => Ok(Some((x.handle(), 1))),
            Some(t) => suffix_operand(t.handle(), dtype, &t.shape()?, &p.x_shape).map(Some),
        }
    };
    let (scale, scale_len) =
        operand(1)?.ok_or_else(|| ShimError::Failed("LayerNormalization: input 1 (Scale) is required".into()))?;
    let bias = operand(2)?;
    let y = call.output(0)?;
    let (mean, inv) = (call.output_opt(1), call.output_opt(2));
    let (grid, block) = row_launch(rows, cols);
    launch(&Launch {
        kernel: &names::kernel_name("kiln_layer_norm", &[tag]),
        grid,
        block,
        shared_mem_bytes: 0,
        args: vec![
            tensor(x.handle()),
            tensor(scale),
            tensor(bias.map_or(x.handle(), |b| b.0)),
            tensor(y.handle()),
            tensor(mean.map_or(y.handle(), |t| t.handle())),
            tensor(inv.map_or(y.handle(), |t| t.handle())),
            KernelArg::U64(rows),
            KernelArg::U64(cols),
            KernelArg::U64(scale_len),
            KernelArg::U64(bias.map_or(1, |b| b.1)),
            KernelArg::U32(bias.is_some() as u32),
            KernelArg::F32(call.attr_f("epsilon", 1e-5)?),
            KernelArg::U32(stat_code),
            KernelArg::U32(mean.is_some() as u32),
            KernelArg::U32(inv.is_some() as u32),
        ],
    })
}
