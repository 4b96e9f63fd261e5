//! Shim of `kiln-reduce`: ReduceSum, ReduceMean, ReduceMax, ReduceMin, ReduceProd,
//! ReduceSumSquare, ReduceL1, ReduceL2, ReduceLogSum and ReduceLogSumExp, ArgMax / ArgMin
//! (`arg`), CumSum and Hardmax (`lines`), TopK (`topk`) and Unique (`unique`), following ONNX
//! Operators.md.
//!
//! `axes` is an attribute before ReduceSum-13 and ReduceMean-18/ReduceMax-18, the optional
//! input 1 from then on (a value input: its bytes arrive inline). `keepdims` defaults to 1;
//! `noop_with_empty_axes` (input-axes versions only) makes an empty or absent `axes` the
//! identity instead of a reduction over every axis.
//!
//! The CPU reference sums floating-point values in f64 and rounds once; integer sums wrap in
//! i64 (the same, modulo 2^bits, as wrapping in the element type); an integer mean is the sum
//! divided in f64 and truncated (numpy's `mean(dtype=...)`). An empty sum is 0, an empty mean
//! NaN (0/0), an empty max the dtype's lowest value (-inf for floats, `false` for bool), an empty
//! min its highest, an empty product 1, an empty LogSum or LogSumExp -inf. Max and Min propagate
//! NaN. Prod, SumSquare and L1 of integers wrap in i64 like the sum; L2, LogSum and LogSumExp
//! take floats only.
#![no_std]
extern crate alloc;

mod arg;
mod lines;
mod topk;
mod unique;

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, export_shim, names, unsupported, with_dtype};

struct Reduce;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    // The CUDA kernels' op codes.
    Sum = 0,
    Mean = 1,
    Max = 2,
    Min = 3,
    Prod = 4,
    SumSquare = 5,
    L1 = 6,
    L2 = 7,
    LogSum = 8,
    LogSumExp = 9,
}

impl Kind {
    /// Kinds defined for floating-point inputs only.
    fn float_only(self) -> bool {
        matches!(self, Kind::L2 | Kind::LogSum | Kind::LogSumExp)
    }
}

struct Plan {
    kind: Kind,
    in_shape: Vec<usize>,
    /// The output shape with reduced axes kept as 1 (what the data is reduced onto).
    kept_shape: Vec<usize>,
    /// The output shape as declared (reduced axes dropped unless `keepdims`).
    out_shape: Vec<usize>,
    /// No reduction at all: the output is the input (`noop_with_empty_axes` with no axes).
    noop: bool,
}

fn plan(call: &Call) -> Result<Plan> {
    let kind = match call.op_type() {
        "ReduceSum" => Kind::Sum,
        "ReduceMean" => Kind::Mean,
        "ReduceMax" => Kind::Max,
        "ReduceMin" => Kind::Min,
        "ReduceProd" => Kind::Prod,
        "ReduceSumSquare" => Kind::SumSquare,
        "ReduceL1" => Kind::L1,
        "ReduceL2" => Kind::L2,
        "ReduceLogSum" => Kind::LogSum,
        "ReduceLogSumExp" => Kind::LogSumExp,
        other => unsupported!("kiln-reduce does not implement {other}"),
    };
    let x = call.input(0)?;
    let in_shape = x.shape()?;
    let rank = in_shape.len();
    let axes_as_input = call.opset() >= if kind == Kind::Sum { 13 } else { 18 };
    let keepdims = call.attr_i("keepdims", 1)? != 0;

    let axes: Vec<i64> = if axes_as_input {
        match call.input_opt(1) {
            Some(t) => {
                if t.rank()? > 1 {
                    bail!("{}: axes must be 1-D, got shape {:?}", call.op_type(), t.shape()?);
                }
                t.read_i64s()?
            }
            None => Vec::new(),
        }
    } else {
        call.attr_ints("axes")?.unwrap_or_default()
    };
    let noop = axes.is_empty() && axes_as_input && call.attr_i("noop_with_empty_axes", 0)? != 0;

    let mut reduced = vec![axes.is_empty() && !noop; rank];
    for &a in &axes {
        let ax = shape::normalize_axis(a, rank).map_err(|e| match e {
            ShimError::Failed(m) => ShimError::Failed(format!("{}: {m}", call.op_type())),
            other => other,
        })?;
        if reduced[ax] {
            bail!("{}: axis {a} is given more than once in {axes:?}", call.op_type());
        }
        reduced[ax] = true;
    }
    let kept_shape: Vec<usize> = in_shape.iter().zip(&reduced).map(|(&d, &r)| if r { 1 } else { d }).collect();
    let out_shape: Vec<usize> = if keepdims {
        kept_shape.clone()
    } else {
        in_shape.iter().zip(&reduced).filter(|(_, &r)| !r).map(|(&d, _)| d).collect()
    };
    Ok(Plan { kind, in_shape, kept_shape, out_shape, noop })
}

impl Plan {
    /// For each input element (row-major), the output element it reduces onto.
    fn index(&self) -> Vec<usize> {
        shape::broadcast_index(&self.kept_shape, &self.in_shape)
    }

    fn out_len(&self) -> usize {
        self.kept_shape.iter().product()
    }

    /// How many input elements reduce onto each output element.
    fn group(&self) -> usize {
        let n: usize = self.in_shape.iter().product();
        n.checked_div(self.out_len()).unwrap_or(0)
    }
}

fn check_dtype(call: &Call, dtype: DType, kind: Kind) -> Result<()> {
    match dtype {
        DType::String => unsupported!("{}: string tensors are not supported", call.op_type()),
        DType::Bool if !matches!(kind, Kind::Max | Kind::Min) => {
            unsupported!("{}: bool input is not supported", call.op_type())
        }
        d if kind.float_only() && !d.is_float() => unsupported!("{}: {d} input is not supported", call.op_type()),
        _ => Ok(()),
    }
}

/// Max (or with `min`, Min) over each group, natively in `T`, from `start`; NaN propagates.
fn reduce_extremum<T: Element>(p: &Plan, x: &[T], start: T, min: bool) -> Vec<T> {
    let mut out = vec![start; p.out_len()];
    #[allow(clippy::eq_op)]
    for (&v, &j) in x.iter().zip(&p.index()) {
        let acc = out[j];
        if acc == acc && (v != v || if min { v < acc } else { v > acc }) {
            out[j] = v;
        }
    }
    out
}

/// A floating-point reduction of each group in f64 (rounded once when written): the sum-like
/// kinds, Prod, and LogSumExp (shifted by the group's maximum).
fn reduce_float(p: &Plan, kind: Kind, xs: &[f64]) -> Vec<f64> {
    let index = p.index();
    if kind == Kind::LogSumExp {
        let mut m = vec![f64::NEG_INFINITY; p.out_len()];
        #[allow(clippy::eq_op)]
        for (&v, &j) in xs.iter().zip(&index) {
            if m[j] == m[j] && (v != v || v > m[j]) {
                m[j] = v;
            }
        }
        let mut s = vec![0f64; p.out_len()];
        for (&v, &j) in xs.iter().zip(&index) {
            s[j] += libm::exp(v - m[j]);
        }
        // An infinite or NaN maximum is the result itself (all -inf, or empty: -inf).
        return m.iter().zip(&s).map(|(&m, &s)| if m.is_finite() { m + libm::log(s) } else { m }).collect();
    }
    let mut out = vec![if kind == Kind::Prod { 1f64 } else { 0f64 }; p.out_len()];
    for (&v, &j) in xs.iter().zip(&index) {
        match kind {
            Kind::Prod => out[j] *= v,
            Kind::SumSquare | Kind::L2 => out[j] += v * v,
            Kind::L1 => out[j] += v.abs(),
            _ => out[j] += v,
        }
    }
    let n = p.group() as f64;
    for v in &mut out {
        *v = match kind {
            Kind::Mean => *v / n,
            Kind::L2 => libm::sqrt(*v),
            Kind::LogSum => libm::log(*v),
            _ => *v,
        };
    }
    out
}

/// The CUDA kernels' template argument for `dtype`: the prelude's tag of a dtype the manifest
/// instantiates them for (bool reduces as its bytes, with the uint8 kernels: Max is a logical
/// "any").
fn kernel_tag(call: &Call, dtype: DType) -> Result<&'static str> {
    let as_dtype = if dtype == DType::Bool { DType::U8 } else { dtype };
    match (as_dtype, as_dtype.cuda_tag()) {
        (
            DType::F32
            | DType::F16
            | DType::BF16
            | DType::F64
            | DType::I8
            | DType::I32
            | DType::I64
            | DType::U8
            | DType::U32
            | DType::U64,
            Some(tag),
        ) => Ok(tag),
        _ => unsupported!("{}: no CUDA kernel for {dtype}", call.op_type()),
    }
}

fn tensor(handle: u32) -> KernelArg {
    KernelArg::Tensor { handle, offset: 0 }
}

/// Most blocks in x of one launch (the kernels loop over the rest).
const MAX_GRID: u64 = 1 << 20;

fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let x = call.input(0)?;
    let dtype = x.dtype()?;
    check_dtype(call, dtype, p.kind)?;
    let tag = kernel_tag(call, dtype)?;
    let y = call.output(0)?;
    if p.noop {
        let nbytes = x.nbytes()? as u64;
        if nbytes == 0 {
            return Ok(());
        }
        return launch(&Launch {
            kernel: "kiln_reduce_copy",
            grid: [nbytes.div_ceil(256).min(MAX_GRID) as u32, 1, 1],
            block: [256, 1, 1],
            shared_mem_bytes: 0,
            args: vec![tensor(x.handle()), tensor(y.handle()), KernelArg::U64(nbytes)],
        });
    }
    let n_out = p.out_len() as u64;
    if n_out == 0 {
        return Ok(());
    }
    let count = p.group() as u64;
    if count == 0 && dtype == DType::Bool && p.kind == Kind::Min {
        // The kernels start a min from the byte's highest value, not `true`.
        unsupported!("{}: an empty bool reduction on the GPU", call.op_type());
    }
    // Dimensions of size 1 dropped, neighbours of the same kind (kept or reduced) merged: each
    // entry is (size, reduced); `strides` are their strides in elements.
    let mut dims: Vec<(u64, bool)> = Vec::new();
    for (&d, &k) in p.in_shape.iter().zip(&p.kept_shape) {
        if d == 1 {
            continue;
        }
        let reduced = k != d;
        match dims.last_mut() {
            Some((size, r)) if *r == reduced => *size *= d as u64,
            _ => dims.push((d as u64, reduced)),
        }
    }
    let mut strides = vec![1u64; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1].0;
    }
    let op = KernelArg::U32(p.kind as u32);
    // Contiguous rows: every reduced element is innermost ([kept], reduced), or nothing to read.
    let rows_layout = count == 0 || dims.is_empty() || (dims.len() <= 2 && matches!(dims.last(), Some((_, true))));
    if rows_layout {
        let (block, rows_per_block) = if count <= 1024 {
            ([32, 8, 1], 8)
        } else if count <= 16384 {
            ([256, 1, 1], 1)
        } else {
            ([1024, 1, 1], 1)
        };
        return launch(&Launch {
            kernel: &names::kernel_name("kiln_reduce_rows", &[tag]),
            grid: [n_out.div_ceil(rows_per_block).min(MAX_GRID) as u32, 1, 1],
            block,
            shared_mem_bytes: 0,
            args: vec![tensor(x.handle()), tensor(y.handle()), KernelArg::U64(n_out), KernelArg::U64(count), op],
        });
    }
    // Any other axis set: kept and reduced dimensions with their strides, at most 8 of each.
    let mut args = vec![tensor(x.handle()), tensor(y.handle()), KernelArg::U64(n_out), KernelArg::U64(count), op];
    for reduced in [false, true] {
        let sel: Vec<(u64, u64)> =
            dims.iter().zip(&strides).filter(|((_, r), _)| *r == reduced).map(|(&(d, _), &s)| (d, s)).collect();
        if sel.len() > 8 {
            unsupported!("{}: more than 8 separate dimension groups", call.op_type());
        }
        args.push(KernelArg::U32(sel.len() as u32));
        for i in 0..8 {
            args.push(KernelArg::U64(sel.get(i).map_or(1, |v| v.0)));
        }
        for i in 0..8 {
            args.push(KernelArg::U64(sel.get(i).map_or(0, |v| v.1)));
        }
    }
    // 32 outputs per block in x; threadIdx.y splits each output's reduced elements.
    let ys = if count >= 64 { 8 } else { 1 };
    launch(&Launch {
        kernel: &names::kernel_name("kiln_reduce_any", &[tag]),
        grid: [n_out.div_ceil(32).min(MAX_GRID) as u32, 1, 1],
        block: [32, ys, 1],
        shared_mem_bytes: 0,
        args,
    })
}

fn is_arg(call: &Call) -> bool {
    matches!(call.op_type(), "ArgMax" | "ArgMin")
}

fn is_line_op(call: &Call) -> bool {
    matches!(call.op_type(), "CumSum" | "Hardmax")
}

impl Shim for Reduce {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        if is_arg(call) {
            return arg::infer(call);
        }
        if is_line_op(call) {
            return lines::infer(call);
        }
        if call.op_type() == "TopK" {
            return topk::infer(call);
        }
        if call.op_type() == "Unique" {
            return unique::infer(call);
        }
        let p = plan(call)?;
        let dtype = call.input(0)?.dtype()?;
        check_dtype(call, dtype, p.kind)?;
        Ok(vec![TensorType::new(dtype, if p.noop { p.in_shape } else { p.out_shape })])
    }

    fn cpu(call: &Call) -> Result<()> {
        if is_arg(call) {
            return arg::cpu(call);
        }
        if is_line_op(call) {
            return lines::cpu(call);
        }
        if call.op_type() == "TopK" {
            return topk::cpu(call);
        }
        if call.op_type() == "Unique" {
            return unique::cpu(call);
        }
        let p = plan(call)?;
        let x = call.input(0)?;
        let dtype = x.dtype()?;
        check_dtype(call, dtype, p.kind)?;
        let y = call.output(0)?;
        if p.noop {
            return y.write_bytes(&x.read_bytes()?);
        }
        match p.kind {
            Kind::Max | Kind::Min => {
                let min = p.kind == Kind::Min;
                let bytes = x.read_bytes()?;
                let out = with_dtype!(dtype, T => {
                    let start = match (dtype == DType::Bool, min) {
                        (true, false) => T::default(),
                        (true, true) => T::from_f64(1.0),
                        (false, false) => T::from_f64(f64::NEG_INFINITY),
                        (false, true) => T::from_f64(f64::INFINITY),
                    };
                    Ok(element::encode(&reduce_extremum::<T>(&p, &element::decode::<T>(&bytes), start, min)))
                })?;
                y.write_bytes(&out)
            }
            _ if dtype.is_float() => y.write_vec(&reduce_float(&p, p.kind, &x.read_vec::<f64>()?)),
            kind => {
                let xs = x.read_vec::<i64>()?;
                let mut out = vec![if kind == Kind::Prod { 1i64 } else { 0i64 }; p.out_len()];
                for (&v, &j) in xs.iter().zip(&p.index()) {
                    out[j] = match kind {
                        Kind::Prod => out[j].wrapping_mul(v),
                        Kind::SumSquare => out[j].wrapping_add(v.wrapping_mul(v)),
                        Kind::L1 => out[j].wrapping_add(v.wrapping_abs()),
                        _ => out[j].wrapping_add(v),
                    };
                }
                if kind != Kind::Mean {
                    return y.write_vec(&out);
                }
                // The sum in the element type, divided in f64, truncated back.
                let n = p.group() as f64;
                let mean = with_dtype!(dtype, T => Ok(out.iter().map(|&v| T::from_i64(v).to_f64() / n).collect::<Vec<f64>>()))?;
                y.write_vec(&mean)
            }
        }
    }

    fn dispatch(call: &Call) -> Result<()> {
        if is_arg(call) {
            return arg::dispatch(call);
        }
        if is_line_op(call) {
            return lines::dispatch(call);
        }
        if call.op_type() == "TopK" {
            return topk::dispatch(call);
        }
        if call.op_type() == "Unique" {
            return unique::dispatch(call);
        }
        dispatch(call)
    }
}

export_shim!(Reduce);
