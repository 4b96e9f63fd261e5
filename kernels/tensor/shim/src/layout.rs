//! Ops whose output holds the input's bytes unchanged, under another shape: Reshape, Flatten,
//! Squeeze, Unsqueeze, Identity.

use alloc::vec::Vec;
use kiln_kernel_abi::bail;
use kiln_kernel_abi::guest::*;

use crate::{distinct_axes, elem_size, gpu, ints_input_or_attr};

/// The output shape of the node.
pub fn out_shape(call: &Call) -> Result<Vec<usize>> {
    let x = call.input(0)?;
    let dims = x.shape()?;
    match call.op_type() {
        "Reshape" => reshape(call, &dims),
        "Flatten" => flatten(call, &dims),
        "Squeeze" => squeeze(call, &dims),
        "Unsqueeze" => unsqueeze(call, &dims),
        _ => Ok(dims),
    }
}

pub fn cpu(call: &Call) -> Result<()> {
    let x = call.input(0)?;
    let n_out: usize = out_shape(call)?.iter().product();
    if n_out != x.numel()? {
        bail!("{}: output has {n_out} elements, input {}", call.op_type(), x.numel()?);
    }
    if x.dtype()? == DType::String {
        // The same strings in the same order (manifest schema 12; no element size to copy by).
        return call.output(0)?.write_strings(&x.read_strings()?);
    }
    elem_size(call.op_type(), x.dtype()?)?;
    call.output(0)?.write_bytes(&x.read_bytes()?)
}

/// A contiguous copy of the input's bytes (the host may alias instead).
pub fn dispatch(call: &Call) -> Result<()> {
    let x = call.input(0)?;
    let esize = elem_size(call.op_type(), x.dtype()?)?;
    let n_out: usize = out_shape(call)?.iter().product();
    if n_out != x.numel()? {
        bail!("{}: output has {n_out} elements, input {}", call.op_type(), x.numel()?);
    }
    gpu::copy(gpu::At::of(&x), gpu::At::of(&call.output(0)?), (n_out * esize) as u64)
}

/// Reshape-5+ (`shape` input, `allowzero` from 14) and Reshape-1 (`shape` attribute).
fn reshape(call: &Call, dims: &[usize]) -> Result<Vec<usize>> {
    let spec = if call.opset() < 5 {
        match call.attr_ints("shape")? {
            Some(s) => s,
            None => bail!("Reshape: attribute shape is required"),
        }
    } else {
        let s = call.input(1)?;
        if s.rank()? != 1 {
            bail!("Reshape: shape must be 1-D, not of shape {:?}", s.shape()?);
        }
        s.read_i64s()?
    };
    let allowzero = call.attr_i("allowzero", 0)? != 0;
    if allowzero && spec.contains(&0) && spec.contains(&-1) {
        bail!("Reshape: shape {spec:?} has both 0 and -1 with allowzero");
    }
    let mut out = Vec::with_capacity(spec.len());
    let mut infer_at = None;
    for (i, &d) in spec.iter().enumerate() {
        out.push(match d {
            -1 => {
                if infer_at.replace(i).is_some() {
                    bail!("Reshape: shape {spec:?} has more than one -1");
                }
                1
            }
            0 if !allowzero => match dims.get(i) {
                Some(&d) => d,
                None => bail!("Reshape: shape {spec:?} copies dimension {i}, beyond input rank {}", dims.len()),
            },
            d if d < 0 => bail!("Reshape: shape {spec:?} has invalid dimension {d}"),
            d => usize::try_from(d).map_err(|_| ShimError::Failed(format!("Reshape: dimension {d} is too large")))?,
        });
    }
    let total: usize = dims.iter().product();
    let known: usize = shape::numel(&out)?;
    if let Some(i) = infer_at {
        if known == 0 || !total.is_multiple_of(known) {
            bail!("Reshape: cannot reshape {dims:?} to {spec:?}");
        }
        out[i] = total / known;
    } else if known != total {
        bail!("Reshape: cannot reshape {dims:?} ({total} elements) to {spec:?} ({known} elements)");
    }
    Ok(out)
}

/// Flatten: `(prod(dims[..axis]), prod(dims[axis..]))`, `axis` in `-rank..=rank`.
fn flatten(call: &Call, dims: &[usize]) -> Result<Vec<usize>> {
    let r = dims.len() as i64;
    let a = call.attr_i("axis", 1)?;
    let a = if a < 0 { a + r } else { a };
    if !(0..=r).contains(&a) {
        bail!("Flatten: axis {} is out of range for rank {r}", call.attr_i("axis", 1)?);
    }
    let (outer, inner) = dims.split_at(a as usize);
    Ok(vec![outer.iter().product(), inner.iter().product()])
}

/// Squeeze: removes the listed axes (which must have size 1), or every size-1 axis.
fn squeeze(call: &Call, dims: &[usize]) -> Result<Vec<usize>> {
    match ints_input_or_attr(call, 1, "axes")? {
        None => Ok(dims.iter().copied().filter(|&d| d != 1).collect()),
        Some(axes) => {
            let axes = distinct_axes("Squeeze", &axes, dims.len())?;
            if let Some(&a) = axes.iter().find(|&&a| dims[a] != 1) {
                bail!("Squeeze: axis {a} of shape {dims:?} is not 1");
            }
            Ok(dims.iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, &d)| d).collect())
        }
    }
}

/// Unsqueeze: inserts size-1 axes at the listed positions of the output.
fn unsqueeze(call: &Call, dims: &[usize]) -> Result<Vec<usize>> {
    let Some(axes) = ints_input_or_attr(call, 1, "axes")? else {
        bail!("Unsqueeze: axes are required");
    };
    let rank = dims.len() + axes.len();
    let axes = distinct_axes("Unsqueeze", &axes, rank)?;
    let mut rest = dims.iter();
    Ok((0..rank).map(|i| if axes.contains(&i) { 1 } else { *rest.next().unwrap_or(&1) }).collect())
}
