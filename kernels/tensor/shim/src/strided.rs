//! Ops whose output element at a multi-index is the input element at an affine function of
//! it: Transpose (permuted strides), Slice (offset and scaled strides, possibly negative),
//! Expand (zero strides on broadcast axes).

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, unsupported};

use crate::{distinct_axes, elem_size, gpu};

/// The output shape, and for each output axis the input stride (in elements) to step by,
/// from the input element `base`.
pub struct Plan {
    pub shape: Vec<usize>,
    pub strides: Vec<isize>,
    pub base: isize,
}

pub fn plan(call: &Call) -> Result<Plan> {
    let dims = call.input(0)?.shape()?;
    match call.op_type() {
        "Transpose" => transpose(call, &dims),
        "Slice" => slice(call, &dims),
        "Expand" => expand(call, &dims),
        other => unsupported!("kiln-tensor: {other} is not a strided op"),
    }
}

pub fn cpu(call: &Call) -> Result<()> {
    let x = call.input(0)?;
    let esize = elem_size(call.op_type(), x.dtype()?)?;
    let p = plan(call)?;
    let src = if p.shape.iter().product::<usize>() == 0 { Vec::new() } else { x.read_bytes()? };
    call.output(0)?.write_bytes(&strided_copy(&src, esize, &p.shape, &p.strides, p.base))
}

/// One strided gather from the plan's first source element.
pub fn dispatch(call: &Call) -> Result<()> {
    let x = call.input(0)?;
    let esize = elem_size(call.op_type(), x.dtype()?)?;
    let p = plan(call)?;
    if p.shape.iter().product::<usize>() == 0 {
        return Ok(());
    }
    let src = gpu::At::of(&x).plus((p.base as u64) * esize as u64);
    gpu::strided(src, gpu::At::of(&call.output(0)?), esize, &p.shape, &p.strides)
}

fn in_strides(dims: &[usize]) -> Vec<isize> {
    shape::strides(dims).into_iter().map(|s| s as isize).collect()
}

/// Transpose: `perm` (default: reversed axes) must be a permutation of the input's axes.
fn transpose(call: &Call, dims: &[usize]) -> Result<Plan> {
    let rank = dims.len();
    let perm: Vec<i64> = match call.attr_ints("perm")? {
        Some(p) => p,
        None => (0..rank as i64).rev().collect(),
    };
    let mut seen = vec![false; rank];
    let valid = perm.len() == rank
        && perm.iter().all(|&p| (0..rank as i64).contains(&p) && !core::mem::replace(&mut seen[p as usize], true));
    if !valid {
        bail!("Transpose: perm {perm:?} is not a permutation of the {rank} axes");
    }
    let st = in_strides(dims);
    Ok(Plan {
        shape: perm.iter().map(|&p| dims[p as usize]).collect(),
        strides: perm.iter().map(|&p| st[p as usize]).collect(),
        base: 0,
    })
}

/// Slice-10+ (`starts`, `ends`, `axes`, `steps` inputs) and Slice-1 (attributes, step 1).
fn slice(call: &Call, dims: &[usize]) -> Result<Plan> {
    let rank = dims.len();
    let (starts, ends, axes, steps) = if call.opset() < 10 {
        let req = |name: &str| -> Result<Vec<i64>> {
            match call.attr_ints(name)? {
                Some(v) => Ok(v),
                None => bail!("Slice: attribute {name} is required"),
            }
        };
        (req("starts")?, req("ends")?, call.attr_ints("axes")?, None)
    } else {
        let read = |i: usize| call.input_opt(i).map(|t| t.read_i64s()).transpose();
        (call.input(1)?.read_i64s()?, call.input(2)?.read_i64s()?, read(3)?, read(4)?)
    };
    let n = starts.len();
    let axes = axes.unwrap_or_else(|| (0..n as i64).collect());
    let steps = steps.unwrap_or_else(|| vec![1; n]);
    if ends.len() != n || axes.len() != n || steps.len() != n {
        bail!("Slice: starts {starts:?}, ends {ends:?}, axes {axes:?} and steps {steps:?} differ in length");
    }
    let axes = distinct_axes("Slice", &axes, rank)?;
    let st = in_strides(dims);
    let mut shape = dims.to_vec();
    let mut strides = st.clone();
    let mut base = 0isize;
    for i in 0..n {
        let (a, step) = (axes[i], steps[i]);
        if step == 0 {
            bail!("Slice: step of axis {a} is 0");
        }
        let dim = dims[a] as i64;
        let norm = |v: i64| if v < 0 { v.saturating_add(dim) } else { v };
        let (start, len) = if dim == 0 {
            (0, 0)
        } else if step > 0 {
            let start = norm(starts[i]).clamp(0, dim);
            let end = norm(ends[i]).clamp(0, dim);
            (start, if end > start { (end - start - 1) / step + 1 } else { 0 })
        } else {
            let start = norm(starts[i]).clamp(0, dim - 1);
            let end = norm(ends[i]).clamp(-1, dim - 1);
            (start, if start > end { (start - end - 1) / step.saturating_neg() + 1 } else { 0 })
        };
        shape[a] = len as usize;
        if len > 0 {
            base += start as isize * st[a];
        }
        // With more than one element, |step| < dim, so the scaled stride cannot overflow.
        strides[a] = if len > 1 { st[a] * steps[i] as isize } else { 0 };
    }
    Ok(Plan { shape, strides, base })
}

/// Expand: bidirectional (numpy) broadcast of the input with the `shape` input.
fn expand(call: &Call, dims: &[usize]) -> Result<Plan> {
    let s = call.input(1)?;
    if s.rank()? != 1 {
        bail!("Expand: shape must be 1-D, not of shape {:?}", s.shape()?);
    }
    let target = s.read_i64s()?;
    if let Some(d) = target.iter().find(|&&d| d < 0) {
        bail!("Expand: shape {target:?} has negative dimension {d}");
    }
    let target: Vec<usize> = shape::dims_from_i64(&target)?;
    let shape = match shape::broadcast_shapes(&[dims, &target]) {
        Ok(s) => s,
        Err(_) => bail!("Expand: input shape {dims:?} cannot be broadcast to {target:?}"),
    };
    let off = shape.len() - dims.len();
    let st = in_strides(dims);
    let strides = (0..shape.len()).map(|i| if i < off || dims[i - off] == 1 { 0 } else { st[i - off] }).collect();
    Ok(Plan { shape, strides, base: 0 })
}

/// Copies elements of `esize` bytes from `src` into a new row-major buffer of `shape`: the
/// output element at multi-index `i` is the source element `base + Σ i[k]·strides[k]`.
pub fn strided_copy(src: &[u8], esize: usize, shape: &[usize], strides: &[isize], base: isize) -> Vec<u8> {
    let n: usize = shape.iter().product();
    let mut out = Vec::with_capacity(n * esize);
    if n == 0 {
        return out;
    }
    let rank = shape.len();
    // Copy the innermost axis as one run when it is contiguous in the source.
    let (outer, run) = if rank > 0 && strides[rank - 1] == 1 { (rank - 1, shape[rank - 1]) } else { (rank, 1) };
    let run_bytes = run * esize;
    let mut counter = vec![0usize; outer];
    let mut pos = base;
    loop {
        let at = pos as usize * esize;
        out.extend_from_slice(&src[at..at + run_bytes]);
        let mut ax = outer;
        loop {
            if ax == 0 {
                return out;
            }
            ax -= 1;
            counter[ax] += 1;
            pos += strides[ax];
            if counter[ax] < shape[ax] {
                break;
            }
            pos -= strides[ax] * shape[ax] as isize;
            counter[ax] = 0;
        }
    }
}
