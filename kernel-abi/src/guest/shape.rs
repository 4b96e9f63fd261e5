//! Shape helpers shared by ops: axis normalisation, strides, numpy-style broadcasting
//! (ONNX "Broadcasting in ONNX", multidirectional).

use alloc::vec::Vec;

use super::{format, Result, ShimError};

/// Normalises `axis` in `-rank..rank` to `0..rank`.
pub fn normalize_axis(axis: i64, rank: usize) -> Result<usize> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    if a < 0 || a >= r {
        return Err(ShimError::Failed(format!("axis {axis} is out of range for rank {rank}")));
    }
    Ok(a as usize)
}

/// Number of elements of `shape`, refusing products that overflow `usize` (32 bits in a
/// wasm32 shim).
pub fn numel(shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| ShimError::Failed(format!("shape {shape:?} has more elements than a shim can address")))
}

/// ONNX dims (`i64`, e.g. from a shape input) as `usize`, refusing negative values and values
/// over the shim's address space.
pub fn dims_from_i64(dims: &[i64]) -> Result<Vec<usize>> {
    let mut out = Vec::with_capacity(dims.len());
    for &d in dims {
        out.push(usize::try_from(d).map_err(|_| ShimError::Failed(format!("dimension {d} is negative or too large")))?);
    }
    numel(&out)?;
    Ok(out)
}

/// Row-major strides in elements.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = alloc::vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// The multidirectional broadcast of `shapes` (numpy rules), or an error naming the clash.
pub fn broadcast_shapes(shapes: &[&[usize]]) -> Result<Vec<usize>> {
    let rank = shapes.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut out = alloc::vec![1usize; rank];
    for s in shapes {
        let off = rank - s.len();
        for (i, &d) in s.iter().enumerate() {
            let o = &mut out[off + i];
            if *o == 1 {
                *o = d;
            } else if d != 1 && d != *o {
                return Err(ShimError::Failed(format!("shapes {shapes:?} cannot be broadcast together")));
            }
        }
    }
    Ok(out)
}

/// For each element of `out_shape` (row-major), the index of the element of an input of
/// `in_shape` that broadcasts onto it. `in_shape` must broadcast to `out_shape`.
pub fn broadcast_index(in_shape: &[usize], out_shape: &[usize]) -> Vec<usize> {
    let n: usize = out_shape.iter().product();
    let rank = out_shape.len();
    let off = rank - in_shape.len();
    let in_strides = strides(in_shape);
    // Stride of each output axis in the input (0 where broadcast).
    let st: Vec<usize> =
        (0..rank).map(|i| if i < off || in_shape[i - off] == 1 { 0 } else { in_strides[i - off] }).collect();
    let mut idx = alloc::vec![0usize; n];
    let mut counter = alloc::vec![0usize; rank];
    let mut cur = 0usize;
    for slot in idx.iter_mut() {
        *slot = cur;
        // Odometer increment.
        for ax in (0..rank).rev() {
            counter[ax] += 1;
            cur += st[ax];
            if counter[ax] < out_shape[ax] {
                break;
            }
            cur -= st[ax] * counter[ax];
            counter[ax] = 0;
        }
    }
    idx
}

/// Multidirectional broadcast of a binary function: `f(a[i], b[j])` over the broadcast shape.
pub fn broadcast_map2<A: Copy, B: Copy, T>(
    a: &[A],
    a_shape: &[usize],
    b: &[B],
    b_shape: &[usize],
    f: impl Fn(A, B) -> T,
) -> Result<(Vec<T>, Vec<usize>)> {
    let out_shape = broadcast_shapes(&[a_shape, b_shape])?;
    let out = if a_shape == b_shape {
        a.iter().zip(b).map(|(x, y)| f(*x, *y)).collect()
    } else {
        let ia = broadcast_index(a_shape, &out_shape);
        let ib = broadcast_index(b_shape, &out_shape);
        ia.iter().zip(&ib).map(|(&i, &j)| f(a[i], b[j])).collect()
    };
    Ok((out, out_shape))
}
