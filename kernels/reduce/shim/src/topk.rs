//! TopK-1/10/11/24 (ONNX Operators.md): the `k` largest (`largest` = 1, the default) or smallest
//! elements of each line along `axis` (default −1) and their int64 indices, in order (best
//! first). `k` is an attribute in TopK-1 and input 1 (an int64 scalar or one-element tensor, a
//! value input) from TopK-10; `largest` and `sorted` arrive in TopK-11. Of equal elements the
//! one with the lower index comes first (the operator's rule); a NaN is larger than every number
//! (numpy's and torch's order), so it comes first among the largest and last among the
//! smallest. `sorted` = 0 allows any order: this one is the sorted order.
//!
//! Both devices keep each line's best k with the same insertion: an element enters the list
//! when it beats the last one kept (or the list is short), after every element it does not
//! beat. On the GPU, `kiln_topk<Tag>` runs one thread per line and keeps the list in the
//! outputs: `O(n·k)` per line at worst, fine for the small k of search and sampling.

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, names, unsupported, with_dtype};

use crate::lines::Lines;

struct Plan {
    lines: Lines,
    k: usize,
    largest: bool,
    out: Vec<usize>,
}

fn plan(call: &Call) -> Result<Plan> {
    const OP: &str = "TopK";
    let shape = call.input(0)?.shape()?;
    if shape.is_empty() {
        bail!("{OP}: the input must have at least one dimension");
    }
    let axis = shape::normalize_axis(call.attr_i("axis", -1)?, shape.len()).map_err(|e| match e {
        ShimError::Failed(m) => ShimError::Failed(format!("{OP}: {m}")),
        other => other,
    })?;
    let k = if call.opset() < 10 {
        call.attr_i("k", -1)?
    } else {
        match call.input(1)?.read_i64s()?[..] {
            [k] => k,
            ref v => bail!("{OP}: k must hold one value, not {}", v.len()),
        }
    };
    let n = shape[axis];
    let Some(k) = usize::try_from(k).ok().filter(|&k| k <= n) else {
        bail!("{OP}: k = {k} is out of range for axis {axis} of {n} elements");
    };
    let largest = match call.attr_i("largest", 1)? {
        0 => false,
        1 => true,
        other => bail!("{OP}: largest must be 0 or 1, not {other}"),
    };
    let mut out = shape.clone();
    out[axis] = k;
    Ok(Plan { lines: Lines::around(&shape, axis), k, largest, out })
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    let dtype = call.input(0)?.dtype()?;
    if !(dtype.is_float() || dtype.is_int()) {
        unsupported!("TopK: {dtype} tensors are not supported");
    }
    Ok(vec![TensorType::new(dtype, p.out.clone()), TensorType::new(DType::I64, p.out)])
}

/// The best k of `xs` (positions of one line, in order) as (value, index along the line).
fn best<T: Element>(xs: impl Iterator<Item = T>, k: usize, largest: bool) -> Vec<(T, usize)> {
    // A total order with NaN (unordered against itself; never an integer) above every number.
    let beats = |v: T, w: T| {
        let (nv, nw) = (v.partial_cmp(&v).is_none(), w.partial_cmp(&w).is_none());
        if largest {
            (nv && !nw) || v > w
        } else {
            (!nv && nw) || v < w
        }
    };
    let mut list: Vec<(T, usize)> = Vec::with_capacity(k + 1);
    for (i, v) in xs.enumerate() {
        if k == 0 || (list.len() == k && !beats(v, list[k - 1].0)) {
            continue;
        }
        let at = list.iter().position(|&(w, _)| beats(v, w)).unwrap_or(list.len());
        list.insert(at, (v, i));
        list.truncate(k);
    }
    list
}

pub fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let x = call.input(0)?;
    let dtype = x.dtype()?;
    let bytes = if x.numel()? == 0 { Vec::new() } else { x.read_bytes()? };
    let inner = p.lines.inner;
    let n_out: usize = p.out.iter().product();
    let (values, indices) = with_dtype!(dtype, T => {
        let xs = element::decode::<T>(&bytes);
        let mut values = alloc::vec![T::default(); n_out];
        let mut indices = alloc::vec![0i64; n_out];
        for l in 0..p.lines.count() {
            let (o, i) = (l / inner.max(1), l % inner.max(1));
            for (j, (v, at)) in best(p.lines.line(l).map(|e| xs[e]), p.k, p.largest).into_iter().enumerate() {
                let dst = (o * p.k + j) * inner + i;
                values[dst] = v;
                indices[dst] = at as i64;
            }
        }
        Ok((element::encode(&values), element::encode(&indices)))
    })?;
    call.output(0)?.write_bytes(&values)?;
    call.output(1)?.write_bytes(&indices)
}

/// `kiln_topk<Tag>`: one thread per line.
pub fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let dtype = call.input(0)?.dtype()?;
    let tag = match (dtype, dtype.cuda_tag()) {
        (DType::Bool, _) | (_, None) => unsupported!("TopK: no CUDA kernel for {dtype}"),
        (_, Some(tag)) => tag,
    };
    let lines = p.lines.count() as u64;
    if lines == 0 || p.k == 0 {
        return Ok(());
    }
    let t = KernelArg::tensor;
    launch(&Launch {
        kernel: &names::kernel_name("kiln_topk", &[tag]),
        grid: grid_stride(lines),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args: vec![
            t(call.input(0)?.handle()),
            t(call.output(0)?.handle()),
            t(call.output(1)?.handle()),
            KernelArg::U64(p.lines.outer as u64),
            KernelArg::U64(p.lines.n as u64),
            KernelArg::U64(p.lines.inner as u64),
            KernelArg::U64(p.k as u64),
            KernelArg::U32(p.largest as u32),
        ],
    })
}
