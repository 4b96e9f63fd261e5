//! ArgMax and ArgMin (ONNX Operators.md, opsets 1–13): the int64 index of the largest
//! (smallest) element along `axis` (default 0, negative counts from the back). `keepdims`
//! (default 1) keeps the reduced axis as 1; `select_last_index` (opset 12 on, default 0) picks
//! the last of equal values instead of the first. A NaN wins over every number, as numpy's
//! `argmax`/`argmin` have it, so the host's greedy sampler and the device agree on any logits.

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, names, unsupported, with_dtype};

/// The input viewed as `[outer, n, inner]` around the reduced axis.
pub struct ArgPlan {
    pub is_min: bool,
    pub last: bool,
    pub outer: usize,
    pub n: usize,
    pub inner: usize,
    pub out_shape: Vec<usize>,
}

pub fn plan(call: &Call) -> Result<ArgPlan> {
    let is_min = match call.op_type() {
        "ArgMax" => false,
        "ArgMin" => true,
        other => unsupported!("kiln-reduce does not implement {other}"),
    };
    let x = call.input(0)?;
    let shape = x.shape()?;
    let rank = shape.len();
    if rank == 0 {
        bail!("{}: the input must have at least one dimension", call.op_type());
    }
    let axis = call.attr_i("axis", 0)?;
    let ax = shape::normalize_axis(axis, rank).map_err(|e| match e {
        ShimError::Failed(m) => ShimError::Failed(format!("{}: {m}", call.op_type())),
        other => other,
    })?;
    let n = shape[ax];
    if n == 0 {
        bail!("{}: axis {axis} has size 0 (no index to return)", call.op_type());
    }
    let keepdims = call.attr_i("keepdims", 1)? != 0;
    let last = call.opset() >= 12 && call.attr_i("select_last_index", 0)? != 0;
    let mut out_shape = shape.clone();
    if keepdims {
        out_shape[ax] = 1;
    } else {
        out_shape.remove(ax);
    }
    Ok(ArgPlan {
        is_min,
        last,
        outer: shape[..ax].iter().product(),
        n,
        inner: shape[ax + 1..].iter().product(),
        out_shape,
    })
}

/// Whether `v` at index `i` beats the best so far (`None`: nothing yet).
#[allow(clippy::eq_op)]
fn better<T: Element>(v: T, i: usize, best: Option<(T, usize)>, p: &ArgPlan) -> bool {
    let Some((b, bi)) = best else { return true };
    let (vn, bn) = (v != v, b != b);
    if vn || bn {
        return match (vn, bn) {
            (true, false) => true,
            (false, true) => false,
            _ => p.last && i > bi,
        };
    }
    if v == b {
        return p.last && i > bi;
    }
    if p.is_min {
        v < b
    } else {
        v > b
    }
}

fn indices<T: Element>(p: &ArgPlan, x: &[T]) -> Vec<i64> {
    let mut out = Vec::with_capacity(p.outer * p.inner);
    for a in 0..p.outer {
        for c in 0..p.inner {
            let mut best: Option<(T, usize)> = None;
            for j in 0..p.n {
                let v = x[(a * p.n + j) * p.inner + c];
                if better(v, j, best, p) {
                    best = Some((v, j));
                }
            }
            out.push(best.map_or(0, |b| b.1 as i64));
        }
    }
    out
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    super::kernel_tag(call, call.input(0)?.dtype()?)?;
    Ok(vec![TensorType::new(DType::I64, p.out_shape)])
}

pub fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let x = call.input(0)?;
    let dtype = x.dtype()?;
    super::kernel_tag(call, dtype)?;
    let bytes = x.read_bytes()?;
    let out = with_dtype!(dtype, T => Ok(indices::<T>(&p, &element::decode::<T>(&bytes))))?;
    call.output(0)?.write_vec(&out)
}

/// Blocks per row of `kiln_arg_rows_split` (reduce.cu's ARG_SPLIT: a thread block cluster on
/// compute capability 9.0).
const SPLIT: u64 = 8;
/// Rows at least this long, and at most [`SPLIT_MAX_ROWS`] of them, take `kiln_arg_rows_split`:
/// one block per row leaves most SMs idle, and each of a row's blocks scans 2,048 elements or more.
const SPLIT_MIN_N: usize = 16384;
const SPLIT_MAX_ROWS: u64 = 64;

pub fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let x = call.input(0)?;
    let dtype = x.dtype()?;
    let tag = super::kernel_tag(call, dtype)?;
    if dtype == DType::Bool {
        unsupported!("{}: bool input", call.op_type());
    }
    let y = call.output(0)?;
    let n_out = (p.outer * p.inner) as u64;
    if n_out == 0 {
        return Ok(());
    }
    let flags = [KernelArg::U32(p.is_min as u32), KernelArg::U32(p.last as u32)];
    let (x, y) = (super::tensor(x.handle()), super::tensor(y.handle()));
    let float = matches!(dtype, DType::F32 | DType::F16 | DType::BF16);
    if p.inner == 1 && p.n >= SPLIT_MIN_N && n_out <= SPLIT_MAX_ROWS && float {
        // Few long rows (a decode step's logits): each row over SPLIT blocks (reduce.cu).
        let mut args = vec![x, y, KernelArg::U64(n_out), KernelArg::U64(p.n as u64)];
        args.extend(flags);
        return launch(&Launch {
            kernel: &names::kernel_name("kiln_arg_rows_split", &[tag]),
            grid: [(n_out * SPLIT) as u32, 1, 1],
            block: [512, 1, 1],
            shared_mem_bytes: 0,
            args,
        });
    }
    if p.inner == 1 {
        let threads = if p.n >= 8192 {
            1024
        } else if p.n >= 1024 {
            256
        } else {
            32
        };
        let mut args = vec![x, y, KernelArg::U64(n_out), KernelArg::U64(p.n as u64)];
        args.extend(flags);
        return launch(&Launch {
            kernel: &names::kernel_name("kiln_arg_rows", &[tag]),
            grid: [n_out.min(super::MAX_GRID) as u32, 1, 1],
            block: [threads, 1, 1],
            shared_mem_bytes: 0,
            args,
        });
    }
    let mut args =
        vec![x, y, KernelArg::U64(p.outer as u64), KernelArg::U64(p.n as u64), KernelArg::U64(p.inner as u64)];
    args.extend(flags);
    launch(&Launch {
        kernel: &names::kernel_name("kiln_arg_strided", &[tag]),
        grid: [n_out.div_ceil(256).min(super::MAX_GRID) as u32, 1, 1],
        block: [256, 1, 1],
        shared_mem_bytes: 0,
        args,
    })
}
