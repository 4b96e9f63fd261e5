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

/// The index of the extreme of a float32 line (`MIN`: the smallest), as [`indices`] picks it,
/// or `None` when the line holds a NaN (which [`indices`] then ranks): one pass of running
/// extremes, then the first (`last`: the last) element equal to the extreme (equality takes −0
/// and +0 alike, as [`better`] does). Cranelift compiles [`indices`]' generic loop to about 4 ns
/// an element (about 200 of the 225 µs a 49,152-value logits row took); this is its Wasm SIMD128
/// form (a one-node model over such a row: 252 → 68 µs a run, bench/RESULTS.md, session 37).
fn line_arg_f32<const MIN: bool>(line: &[f32], last: bool) -> Option<usize> {
    let step = |a: f32, v: f32| if MIN { a.min(v) } else { a.max(v) };
    let (m, nan) = simd::extreme::<MIN>(line)?;
    let m = m.into_iter().fold(line[0], step);
    if nan {
        return None;
    }
    if last {
        simd::rposition_eq(line, m)
    } else {
        simd::position_eq(line, m)
    }
}

/// The vector loops of [`line_arg_f32`]: Wasm SIMD128 where the shim is built with it (the
/// built-in packages are), else the same arithmetic element by element.
mod simd {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    use core::arch::wasm32::*;

    /// Four running extremes over `line` (each lane over every fourth element and the
    /// remainder) and whether a NaN was seen; `None` for an empty line.
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    pub fn extreme<const MIN: bool>(line: &[f32]) -> Option<([f32; 4], bool)> {
        let first = *line.first()?;
        let (mut a, mut b) = (f32x4_splat(first), f32x4_splat(first));
        let mut nan = f32x4_splat(0.0);
        // pmin / pmax keep the running value when the new one is NaN (b < a ? b : a).
        let step = |acc: v128, v: v128| if MIN { f32x4_pmin(acc, v) } else { f32x4_pmax(acc, v) };
        let chunks = line.chunks_exact(8);
        let rem = chunks.remainder();
        for c in chunks {
            // SAFETY: `c` holds 8 f32s; v128_load reads 16 bytes at any alignment.
            let (x, y) = unsafe { (v128_load(c.as_ptr().cast()), v128_load(c.as_ptr().add(4).cast())) };
            nan = v128_or(nan, v128_or(f32x4_ne(x, x), f32x4_ne(y, y)));
            a = step(a, x);
            b = step(b, y);
        }
        let a = step(a, b);
        let mut out = [
            f32x4_extract_lane::<0>(a),
            f32x4_extract_lane::<1>(a),
            f32x4_extract_lane::<2>(a),
            f32x4_extract_lane::<3>(a),
        ];
        let mut seen = v128_any_true(nan);
        for &v in rem {
            seen |= v.is_nan();
            out[0] = if MIN { out[0].min(v) } else { out[0].max(v) };
        }
        Some((out, seen))
    }

    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    pub fn extreme<const MIN: bool>(line: &[f32]) -> Option<([f32; 4], bool)> {
        let first = *line.first()?;
        let m = line.iter().fold(first, |a, &v| if MIN { a.min(v) } else { a.max(v) });
        Some(([m; 4], line.iter().any(|v| v.is_nan())))
    }

    /// The first index of an element equal to `m`.
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    pub fn position_eq(line: &[f32], m: f32) -> Option<usize> {
        let want = f32x4_splat(m);
        let chunks = line.chunks_exact(4);
        let tail = line.len() - chunks.remainder().len();
        for (i, c) in chunks.enumerate() {
            // SAFETY: `c` holds 4 f32s; v128_load reads 16 bytes at any alignment.
            let hits = i32x4_bitmask(f32x4_eq(unsafe { v128_load(c.as_ptr().cast()) }, want));
            if hits != 0 {
                return Some(4 * i + hits.trailing_zeros() as usize);
            }
        }
        line[tail..].iter().position(|&v| v == m).map(|i| tail + i)
    }

    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    pub fn position_eq(line: &[f32], m: f32) -> Option<usize> {
        line.iter().position(|&v| v == m)
    }

    /// The last index of an element equal to `m`.
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    pub fn rposition_eq(line: &[f32], m: f32) -> Option<usize> {
        let want = f32x4_splat(m);
        let chunks = line.chunks_exact(4);
        let tail = line.len() - chunks.remainder().len();
        if let Some(i) = line[tail..].iter().rposition(|&v| v == m) {
            return Some(tail + i);
        }
        for (i, c) in chunks.enumerate().rev() {
            // SAFETY: `c` holds 4 f32s; v128_load reads 16 bytes at any alignment.
            let hits = i32x4_bitmask(f32x4_eq(unsafe { v128_load(c.as_ptr().cast()) }, want));
            if hits != 0 {
                // The highest of the 4 lane bits (of 8): lane 7 − leading zeros.
                return Some(4 * i + 7 - hits.leading_zeros() as usize);
            }
        }
        None
    }

    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    pub fn rposition_eq(line: &[f32], m: f32) -> Option<usize> {
        line.iter().rposition(|&v| v == m)
    }
}

pub fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let x = call.input(0)?;
    let dtype = x.dtype()?;
    super::kernel_tag(call, dtype)?;
    if dtype == DType::F32 && p.inner == 1 {
        // Rows along the last axis (an LLM's logits: 49,152 values a decode step) in one pass
        // of running extremes each; a row with a NaN goes through `indices`.
        let x: Vec<f32> = x.read_vec()?;
        let one = ArgPlan { is_min: p.is_min, last: p.last, outer: 1, n: p.n, inner: 1, out_shape: Vec::new() };
        let mut out = Vec::with_capacity(p.outer);
        for line in x.chunks_exact(p.n) {
            let i = if p.is_min { line_arg_f32::<true>(line, p.last) } else { line_arg_f32::<false>(line, p.last) };
            out.push(match i {
                Some(i) => i as i64,
                None => indices::<f32>(&one, line)[0],
            });
        }
        return call.output(0)?.write_vec(&out);
    }
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
