//! Tensor arithmetic the executor does on the host for control flow and the sequence ops:
//! slicing along an axis, stacking, concatenating and splitting, on any fixed-size element.

use crate::{Error, Result, Tensor};

/// Bytes per element. Errors: a type without a fixed size.
fn element_size(t: &Tensor) -> Result<usize> {
    t.dtype.size().ok_or_else(|| Error::Unsupported(format!("{} tensors on the host", t.dtype)))
}

/// Entry `i` of `t` along `axis`, that axis removed.
pub(super) fn slice_axis(t: &Tensor, axis: usize, i: usize) -> Result<Tensor> {
    let size = element_size(t)?;
    let len = t.shape[axis];
    let outer: usize = t.shape[..axis].iter().product();
    let inner: usize = t.shape[axis + 1..].iter().product::<usize>() * size;
    let mut data = Vec::with_capacity(outer * inner);
    for o in 0..outer {
        let start = (o * len + i) * inner;
        data.extend_from_slice(&t.data[start..start + inner]);
    }
    let mut shape = t.shape.clone();
    shape.remove(axis);
    Tensor::new(t.dtype, shape, data.into())
}

/// `parts` (one dtype and shape) stacked along a new `axis`, last first when `reverse`.
pub(super) fn stack(parts: &[Tensor], axis: usize, reverse: bool) -> Result<Tensor> {
    let Some(first) = parts.first() else { return Err(Error::Model("nothing to stack".into())) };
    if let Some(odd) = parts.iter().find(|p| p.dtype != first.dtype || p.shape != first.shape) {
        return Err(Error::Input(format!(
            "tensors to stack differ: {} {:?}, then {} {:?}",
            first.dtype, first.shape, odd.dtype, odd.shape
        )));
    }
    let expanded: Vec<Tensor> = (0..parts.len())
        .map(|j| {
            let p = &parts[if reverse { parts.len() - 1 - j } else { j }];
            let mut shape = p.shape.clone();
            shape.insert(axis, 1);
            Tensor { dtype: p.dtype, shape, data: p.data.clone() }
        })
        .collect();
    concat(&expanded, axis)
}

/// `parts` joined along `axis`: one dtype and rank, the same dimensions but on `axis`.
pub(super) fn concat(parts: &[Tensor], axis: usize) -> Result<Tensor> {
    let Some(first) = parts.first() else { return Err(Error::Input("nothing to concatenate".into())) };
    let size = element_size(first)?;
    let same = |p: &Tensor| {
        p.dtype == first.dtype
            && p.shape.len() == first.shape.len()
            && p.shape.iter().zip(&first.shape).enumerate().all(|(a, (x, y))| a == axis || x == y)
    };
    if let Some(odd) = parts.iter().find(|p| !same(p)) {
        return Err(Error::Input(format!(
            "tensors to join along axis {axis} differ: {} {:?} and {} {:?}",
            first.dtype, first.shape, odd.dtype, odd.shape
        )));
    }
    let outer: usize = first.shape[..axis].iter().product();
    let inner: usize = first.shape[axis + 1..].iter().product::<usize>() * size;
    let total: usize = parts.iter().map(|p| p.shape[axis]).sum();
    let mut data = Vec::with_capacity(outer * total * inner);
    for o in 0..outer {
        for p in parts {
            let n = p.shape[axis] * inner;
            data.extend_from_slice(&p.data[o * n..(o + 1) * n]);
        }
    }
    let mut shape = first.shape.clone();
    shape[axis] = total;
    Tensor::new(first.dtype, shape, data.into())
}

/// `t` cut along `axis` into pieces of `sizes` (summing to its length there).
pub(super) fn split(t: &Tensor, axis: usize, sizes: &[usize]) -> Result<Vec<Tensor>> {
    let size = element_size(t)?;
    let len = t.shape[axis];
    if sizes.iter().sum::<usize>() != len {
        return Err(Error::Input(format!("split sizes {sizes:?} do not sum to axis {axis}'s length {len}")));
    }
    let outer: usize = t.shape[..axis].iter().product();
    let inner: usize = t.shape[axis + 1..].iter().product::<usize>() * size;
    let mut out = Vec::with_capacity(sizes.len());
    let mut start = 0;
    for &n in sizes {
        let mut data = Vec::with_capacity(outer * n * inner);
        for o in 0..outer {
            let at = (o * len + start) * inner;
            data.extend_from_slice(&t.data[at..at + n * inner]);
        }
        let mut shape = t.shape.clone();
        shape[axis] = n;
        out.push(Tensor::new(t.dtype, shape, data.into())?);
        start += n;
    }
    Ok(out)
}

/// `axis` (negative counts from the end) as an index below `rank`. Errors name `what`.
pub(super) fn normalize_axis(axis: i64, rank: usize, what: &str) -> Result<usize> {
    let r = rank as i64;
    match axis {
        a if (0..r).contains(&a) => Ok(a as usize),
        a if (-r..0).contains(&a) => Ok((a + r) as usize),
        a => Err(Error::Model(format!("{what}: axis {a} is out of range for rank {rank}"))),
    }
}
