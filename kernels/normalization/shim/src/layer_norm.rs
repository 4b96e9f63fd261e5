//! LayerNormalization-17.
//!
//! Normalises over dimensions `axis..rank` (`axis` default -1), then scales by `Scale` and
//! shifts by the optional `B` (both broadcast unidirectionally to X). The optional outputs Mean
//! and InvStdDev keep the normalised dimensions as 1 and have the dtype named by `stash_type`
//! (default 1, float32). The reference computes in f64 and rounds once.

use alloc::vec::Vec;
use kiln_kernel_abi::bail;
use kiln_kernel_abi::guest::*;

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
