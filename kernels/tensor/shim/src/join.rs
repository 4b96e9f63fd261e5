//! Ops that join or cut tensors along one axis: Concat, Split, Gather.
//!
//! Along `axis`, a row-major tensor is `outer` blocks (the product of the dimensions before
//! the axis), each `dims[axis]` slabs of `inner` bytes (the dimensions after it, times the
//! element size).

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, unsupported};

use crate::{axis, elem_size, gpu, ints_input_or_attr};

/// `(outer, inner)` for `axis` of `dims`, `inner` in bytes.
fn blocks(dims: &[usize], axis: usize, esize: usize) -> (usize, usize) {
    (dims[..axis].iter().product(), dims[axis + 1..].iter().product::<usize>() * esize)
}

// ---------------------------------------------------------------------------------------
// Concat

/// The axis and the output shape of a Concat.
fn concat_plan(call: &Call) -> Result<(usize, Vec<usize>)> {
    let inputs = call.inputs();
    let Some(first) = inputs.first() else { bail!("Concat: needs at least one input") };
    let dtype = first.dtype()?;
    let mut shape = first.shape()?;
    // Concat-1 defaulted axis to 1; from Concat-4 it is required.
    let a = match call.attr("axis") {
        Some(_) => call.attr_i("axis", 0)?,
        None if call.opset() < 4 => 1,
        None => bail!("Concat: attribute axis is required"),
    };
    let a = axis("Concat", a, shape.len())?;
    for t in &inputs[1..] {
        let s = t.shape()?;
        if t.dtype()? != dtype {
            bail!("Concat: inputs mix {dtype} and {}", t.dtype()?);
        }
        if s.len() != shape.len() || s.iter().zip(&shape).enumerate().any(|(i, (x, y))| i != a && x != y) {
            bail!("Concat: input shapes {:?} and {s:?} differ outside axis {a}", first.shape()?);
        }
        shape[a] += s[a];
    }
    Ok((a, shape))
}

pub fn concat_infer(call: &Call) -> Result<Vec<TensorType>> {
    let (_, shape) = concat_plan(call)?;
    Ok(vec![TensorType::new(call.input(0)?.dtype()?, shape)])
}

pub fn concat_cpu(call: &Call) -> Result<()> {
    let (a, shape) = concat_plan(call)?;
    let inputs = call.inputs();
    let esize = elem_size("Concat", inputs[0].dtype()?)?;
    let mut parts = Vec::with_capacity(inputs.len());
    for t in &inputs {
        let dims = t.shape()?;
        let (_, inner) = blocks(&dims, a, esize);
        let bytes = if t.numel()? == 0 { Vec::new() } else { t.read_bytes()? };
        parts.push((bytes, dims[a] * inner));
    }
    let (outer, inner) = blocks(&shape, a, esize);
    let mut out = Vec::with_capacity(outer * shape[a] * inner);
    for o in 0..outer {
        for (bytes, chunk) in &parts {
            out.extend_from_slice(&bytes[o * chunk..(o + 1) * chunk]);
        }
    }
    call.output(0)?.write_bytes(&out)
}

/// One 2-D copy per non-empty input, into the output at the input's offset along the axis.
pub fn concat_dispatch(call: &Call) -> Result<()> {
    let (a, shape) = concat_plan(call)?;
    let inputs = call.inputs();
    if inputs.len() > gpu::MAX_LAUNCHES {
        unsupported!("Concat of {} inputs (at most {} launches)", inputs.len(), gpu::MAX_LAUNCHES);
    }
    let esize = elem_size("Concat", inputs[0].dtype()?)?;
    let (outer, inner) = blocks(&shape, a, esize);
    let out = gpu::At::of(&call.output(0)?);
    let out_row = (shape[a] * inner) as i64;
    let mut offset = 0u64;
    for t in &inputs {
        let dims = t.shape()?;
        let row = (dims[a] * inner) as u64;
        if t.numel()? > 0 {
            gpu::copy2d(gpu::At::of(t), out.plus(offset), outer as u64, row, row as i64, out_row)?;
        }
        offset += row;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Split

/// The axis and the size of each output along it.
fn split_plan(call: &Call) -> Result<(usize, Vec<usize>)> {
    let dims = call.input(0)?.shape()?;
    let a = axis("Split", call.attr_i("axis", 0)?, dims.len())?;
    let dim = dims[a];
    let n = call.num_outputs();
    let sizes: Vec<usize> = match ints_input_or_attr(call, 1, "split")? {
        Some(split) => {
            if split.len() != n {
                bail!("Split: split {split:?} has {} entries for {n} outputs", split.len());
            }
            if split.iter().any(|&s| s < 0) || split.iter().sum::<i64>() != dim as i64 {
                bail!("Split: split {split:?} does not add up to dimension {dim} of axis {a}");
            }
            shape::dims_from_i64(&split)?
        }
        None => {
            // Split-18: `num_outputs` parts of ceil(dim / num_outputs), the last one smaller.
            // Earlier opsets: as many equal parts as the node has outputs.
            let parts = match call.attr("num_outputs") {
                Some(_) => {
                    let k = call.attr_i("num_outputs", 0)?;
                    if k < 1 || k as usize != n {
                        bail!("Split: num_outputs {k} does not match the node's {n} outputs");
                    }
                    n
                }
                None => n,
            };
            if parts == 0 {
                bail!("Split: the node has no outputs");
            }
            if dim % parts == 0 {
                vec![dim / parts; parts]
            } else if call.opset() >= 18 {
                let chunk = dim.div_ceil(parts);
                let Some(last) = dim.checked_sub(chunk * (parts - 1)) else {
                    bail!("Split: dimension {dim} of axis {a} cannot be split into {parts} chunks of {chunk}");
                };
                let mut sizes = vec![chunk; parts];
                sizes[parts - 1] = last;
                sizes
            } else {
                bail!("Split: dimension {dim} of axis {a} does not split into {parts} equal parts");
            }
        }
    };
    Ok((a, sizes))
}

pub fn split_infer(call: &Call) -> Result<Vec<TensorType>> {
    let x = call.input(0)?;
    let (dtype, dims) = (x.dtype()?, x.shape()?);
    let (a, sizes) = split_plan(call)?;
    Ok(sizes
        .iter()
        .map(|&s| {
            let mut d = dims.clone();
            d[a] = s;
            TensorType::new(dtype, d)
        })
        .collect())
}

pub fn split_cpu(call: &Call) -> Result<()> {
    let x = call.input(0)?;
    let esize = elem_size("Split", x.dtype()?)?;
    let dims = x.shape()?;
    let (a, sizes) = split_plan(call)?;
    let (outer, inner) = blocks(&dims, a, esize);
    let bytes = if x.numel()? == 0 { Vec::new() } else { x.read_bytes()? };
    let row = dims[a] * inner;
    let mut offset = 0;
    for (i, &s) in sizes.iter().enumerate() {
        if let Some(out) = call.output_opt(i) {
            let chunk = s * inner;
            let mut buf = Vec::with_capacity(outer * chunk);
            for o in 0..outer {
                let at = o * row + offset;
                buf.extend_from_slice(&bytes[at..at + chunk]);
            }
            out.write_bytes(&buf)?;
        }
        offset += s * inner;
    }
    Ok(())
}

/// One 2-D copy per present, non-empty output, from the input at its offset along the axis.
pub fn split_dispatch(call: &Call) -> Result<()> {
    let x = call.input(0)?;
    let esize = elem_size("Split", x.dtype()?)?;
    let dims = x.shape()?;
    let (a, sizes) = split_plan(call)?;
    if sizes.len() > gpu::MAX_LAUNCHES {
        unsupported!("Split into {} outputs (at most {} launches)", sizes.len(), gpu::MAX_LAUNCHES);
    }
    let (outer, inner) = blocks(&dims, a, esize);
    let src = gpu::At::of(&x);
    let in_row = (dims[a] * inner) as i64;
    let mut offset = 0u64;
    for (i, &s) in sizes.iter().enumerate() {
        let row = (s * inner) as u64;
        if let Some(out) = call.output_opt(i) {
            if outer > 0 && row > 0 {
                gpu::copy2d(src.plus(offset), gpu::At::of(&out), outer as u64, row, in_row, row as i64)?;
            }
        }
        offset += row;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Gather

/// The axis and the output shape of a Gather: `data[..axis] ++ indices ++ data[axis + 1..]`.
fn gather_plan(call: &Call) -> Result<(usize, Vec<usize>)> {
    let data = call.input(0)?.shape()?;
    let indices = call.input(1)?;
    let dt = indices.dtype()?;
    if !matches!(dt, DType::I32 | DType::I64) {
        bail!("Gather: indices must be int32 or int64, not {dt}");
    }
    let a = axis("Gather", call.attr_i("axis", 0)?, data.len())?;
    let mut shape = data[..a].to_vec();
    shape.extend(indices.shape()?);
    shape.extend_from_slice(&data[a + 1..]);
    Ok((a, shape))
}

pub fn gather_infer(call: &Call) -> Result<Vec<TensorType>> {
    let (_, shape) = gather_plan(call)?;
    Ok(vec![TensorType::new(call.input(0)?.dtype()?, shape)])
}

pub fn gather_cpu(call: &Call) -> Result<()> {
    let x = call.input(0)?;
    let esize = elem_size("Gather", x.dtype()?)?;
    let dims = x.shape()?;
    let (a, _) = gather_plan(call)?;
    let dim = dims[a];
    let indices = call.input(1)?.read_i64s()?;
    let indices = indices
        .iter()
        .map(|&i| {
            let j = if i < 0 { i + dim as i64 } else { i };
            if j < 0 || j >= dim as i64 {
                bail!("Gather: index {i} is out of range for dimension {dim} of axis {a}");
            }
            Ok(j as usize)
        })
        .collect::<Result<Vec<usize>>>()?;
    let (outer, inner) = blocks(&dims, a, esize);
    let bytes = if indices.is_empty() || x.numel()? == 0 { Vec::new() } else { x.read_bytes()? };
    let mut out = Vec::with_capacity(outer * indices.len() * inner);
    for o in 0..outer {
        for &j in &indices {
            let at = (o * dim + j) * inner;
            out.extend_from_slice(&bytes[at..at + inner]);
        }
    }
    call.output(0)?.write_bytes(&out)
}

/// One gather launch; indices are read on the device (negative ones wrap; an out-of-range one
/// gives zeros and fails the run through the node's status record with the CPU reference's
/// message, kernel.toml's device error 1).
pub fn gather_dispatch(call: &Call) -> Result<()> {
    let x = call.input(0)?;
    let esize = elem_size("Gather", x.dtype()?)?;
    let dims = x.shape()?;
    let (a, shape) = gather_plan(call)?;
    if shape.iter().product::<usize>() == 0 {
        return Ok(());
    }
    let indices = call.input(1)?;
    let idx64 = indices.dtype()? == DType::I64;
    let (outer, inner) = blocks(&dims, a, esize);
    gpu::gather(
        gpu::At::of(&x),
        gpu::At::of(&indices),
        idx64,
        gpu::At::of(&call.output(0)?),
        outer as u64,
        dims[a] as u64,
        indices.numel()? as u64,
        inner as u64,
        a as u32,
    )
}
