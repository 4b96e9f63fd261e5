//! Ops that move elements by index tensors (ONNX Operators.md):
//!
//! - GatherElements-11/13: `out[p] = data[p with its axis coordinate replaced by indices[p]]`,
//!   out and indices of one shape;
//! - ScatterElements-11/13/16/18 and Scatter-9/11 (its deprecated name): the output is `data`
//!   with `out[p with axis coordinate indices[p]] = updates[p]`, or combined with it by
//!   `reduction` (`add`, `mul` from 16, `max`, `min` from 18), updates applied in the order of
//!   their flat positions;
//! - GatherND-11/12/13 (`batch_dims` from 12): each index tuple (the last axis of `indices`, of
//!   length k) picks a slice `data[b, i_0, …, i_{k-1}, …]` after the first `batch_dims` axes;
//! - ScatterND-11/13/16/18: the output is `data` with each tuple's slice set to (or combined by
//!   `reduction` with) the matching slice of `updates`, tuples in order.
//!
//! Negative indices count from the end of their axis; an index outside `[-dim, dim)` fails the
//! node with the CPU reference's message, on the GPU through the node's status record
//! (kernel.toml's device errors 2 to 6, one per op: [`device_error`]), and the device kernel
//! writes zeros (gathers) or skips the update (scatters) instead of reading or writing outside
//! the buffers.
//!
//! On the GPU (`cuda/tensor.cu`): gathers copy element bytes, one thread per output element;
//! scatters copy `data` to the output, then run one thread per line along the axis
//! (ScatterElements) or per slice element (ScatterND), each applying its updates in order, so
//! repeated indices combine in the CPU reference's order and runs are deterministic.

use alloc::string::String;
use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, names, unsupported, with_dtype};

use crate::gpu::{eight, At};
use crate::{axis, elem_size};

/// `reduction` of the scatters (the kernels' argument).
#[derive(Clone, Copy, PartialEq, Debug)]
enum Reduction {
    None = 0,
    Add = 1,
    Mul = 2,
    Max = 3,
    Min = 4,
}

fn reduction(call: &Call, op: &str) -> Result<Reduction> {
    Ok(match call.attr_s("reduction", "none")? {
        "none" => Reduction::None,
        "add" => Reduction::Add,
        "mul" => Reduction::Mul,
        "max" => Reduction::Max,
        "min" => Reduction::Min,
        other => bail!("{op}: reduction must be none, add, mul, max or min, not {other:?}"),
    })
}

/// `old` combined with `new` as the CPU reference does: float arithmetic in f64 rounded to the
/// element type, integer arithmetic wrapping on the 64-bit pattern, max / min by the type's
/// order.
fn combine<T: Element>(old: T, new: T, r: Reduction) -> T {
    let float = T::DTYPE.is_float();
    match r {
        Reduction::None => new,
        Reduction::Add if float => T::from_f64(old.to_f64() + new.to_f64()),
        Reduction::Add => T::from_i64(old.to_i64().wrapping_add(new.to_i64())),
        Reduction::Mul if float => T::from_f64(old.to_f64() * new.to_f64()),
        Reduction::Mul => T::from_i64(old.to_i64().wrapping_mul(new.to_i64())),
        Reduction::Max => {
            if new > old {
                new
            } else {
                old
            }
        }
        Reduction::Min => {
            if new < old {
                new
            } else {
                old
            }
        }
    }
}

/// `i` wrapped into `0..dim`, or the op's out-of-range error naming `{what} {axis}` (the message
/// is only formatted on failure).
fn wrap(op: &str, i: i64, dim: usize, what: &str, axis: usize) -> Result<usize> {
    let j = if i < 0 { i + dim as i64 } else { i };
    if j < 0 || j >= dim as i64 {
        bail!("{op}: index {i} is out of range for dimension {dim} of {what} {axis}");
    }
    Ok(j as usize)
}

/// The op's code in kernel.toml's `[[device_errors]]` (its out-of-range message).
fn device_error(op: &str) -> KernelArg {
    KernelArg::U32(match op {
        "GatherElements" => 2,
        "ScatterElements" => 3,
        "Scatter" => 4,
        "GatherND" => 5,
        _ => 6, // ScatterND
    })
}

fn index_dtype(op: &str, t: &Tensor, allow_i32: bool) -> Result<bool> {
    match t.dtype()? {
        DType::I64 => Ok(true),
        DType::I32 if allow_i32 => Ok(false),
        dt => bail!("{op}: indices must be {}, not {dt}", if allow_i32 { "int32 or int64" } else { "int64" }),
    }
}

/// The kernel template instance for `dtype` (bool scatters as uint8: same bytes, and only
/// reduction `none` reaches it).
fn tagged(op: &str, base: &str, dtype: DType) -> Result<String> {
    let dtype = if dtype == DType::Bool { DType::U8 } else { dtype };
    match dtype.cuda_tag() {
        Some(tag) => Ok(names::kernel_name(base, &[tag])),
        None => unsupported!("{op}: {dtype} tensors are not supported"),
    }
}

// -----------------------------------------------------------------------------------------
// GatherElements and ScatterElements

/// The shared geometry of GatherElements and ScatterElements: the axis, data's dims and
/// indices' dims (updates' too for the scatters). Indices have data's rank and fit inside data
/// on every other axis.
struct Elements {
    axis: usize,
    data: Vec<usize>,
    /// Data's row-major strides.
    ds: Vec<usize>,
    idx: Vec<usize>,
}

fn elements_plan(call: &Call, op: &str) -> Result<Elements> {
    let data = call.input(0)?.shape()?;
    let indices = call.input(1)?;
    index_dtype(op, &indices, true)?;
    let idx = indices.shape()?;
    if idx.len() != data.len() || data.is_empty() {
        bail!("{op}: indices must have data's rank {} (at least 1), not {}", data.len(), idx.len());
    }
    let a = axis(op, call.attr_i("axis", 0)?, data.len())?;
    for k in 0..data.len() {
        if k != a && idx[k] > data[k] {
            bail!("{op}: indices dimension {k} is {}, larger than data's {}", idx[k], data[k]);
        }
    }
    Ok(Elements { axis: a, ds: shape::strides(&data), data, idx })
}

impl Elements {
    /// Data's offset (elements) of indices position `t` with the axis coordinate `i` (wrapped,
    /// or the op's out-of-range error).
    fn target(&self, op: &str, t: usize, i: i64) -> Result<usize> {
        let (mut rem, mut off) = (t, 0);
        for k in (0..self.idx.len()).rev() {
            let c = rem % self.idx[k];
            rem /= self.idx[k];
            if k != self.axis {
                off += c * self.ds[k];
            }
        }
        Ok(off + wrap(op, i, self.data[self.axis], "axis", self.axis)? * self.ds[self.axis])
    }
}

pub fn gather_elements_infer(call: &Call) -> Result<Vec<TensorType>> {
    let e = elements_plan(call, "GatherElements")?;
    Ok(vec![TensorType::new(call.input(0)?.dtype()?, e.idx)])
}

pub fn gather_elements_cpu(call: &Call) -> Result<()> {
    const OP: &str = "GatherElements";
    let e = elements_plan(call, OP)?;
    let x = call.input(0)?;
    let esize = elem_size(OP, x.dtype()?)?;
    let indices = call.input(1)?.read_i64s()?;
    let data = if x.numel()? == 0 { Vec::new() } else { x.read_bytes()? };
    let mut out = Vec::with_capacity(indices.len() * esize);
    for (t, &i) in indices.iter().enumerate() {
        let at = e.target(OP, t, i)?;
        out.extend_from_slice(&data[at * esize..(at + 1) * esize]);
    }
    call.output(0)?.write_bytes(&out)
}

/// `kiln_tensor_gather_elements`: one thread per output element.
pub fn gather_elements_dispatch(call: &Call) -> Result<()> {
    const OP: &str = "GatherElements";
    let e = elements_plan(call, OP)?;
    let x = call.input(0)?;
    let indices = call.input(1)?;
    let n = indices.numel()?;
    if n == 0 {
        return Ok(());
    }
    let mut args = vec![
        At::of(&x).arg(),
        At::of(&indices).arg(),
        At::of(&call.output(0)?).arg(),
        KernelArg::U64(n as u64),
        KernelArg::U32(elem_size(OP, x.dtype()?)? as u32),
        KernelArg::U32(index_dtype(OP, &indices, true)? as u32),
        KernelArg::U32(e.idx.len() as u32),
        KernelArg::U32(e.axis as u32),
        KernelArg::U64(e.data[e.axis] as u64),
    ];
    args.extend(eight(&e.idx, 1));
    args.extend(eight(&e.ds, 0));
    args.extend([device_error(OP), KernelArg::Status]);
    crate::gpu::launch_elems("kiln_tensor_gather_elements", n as u64, args)
}

/// A scatter's updates (input 2: `shape` and data's dtype) and its reduction (none only for bool).
fn updates(call: &Call, op: &str, shape: &[usize]) -> Result<Reduction> {
    let updates = call.input(2)?;
    if updates.shape()? != shape {
        bail!("{op}: updates must have shape {shape:?}, not {:?}", updates.shape()?);
    }
    let dt = call.input(0)?.dtype()?;
    if updates.dtype()? != dt {
        bail!("{op}: updates must have data's dtype {dt}, not {}", updates.dtype()?);
    }
    let r = reduction(call, op)?;
    if r != Reduction::None && dt == DType::Bool {
        unsupported!("{op}: reduction {r:?} of bool tensors is not supported");
    }
    Ok(r)
}

fn scatter_elements_plan(call: &Call, op: &str) -> Result<(Elements, Reduction)> {
    let e = elements_plan(call, op)?;
    let r = updates(call, op, &e.idx)?;
    Ok((e, r))
}

pub fn scatter_elements_infer(call: &Call) -> Result<Vec<TensorType>> {
    scatter_elements_plan(call, call.op_type())?;
    let x = call.input(0)?;
    Ok(vec![TensorType::new(x.dtype()?, x.shape()?)])
}

pub fn scatter_elements_cpu(call: &Call) -> Result<()> {
    let op = call.op_type();
    let (e, r) = scatter_elements_plan(call, op)?;
    let x = call.input(0)?;
    let dt = x.dtype()?;
    let indices = call.input(1)?.read_i64s()?;
    let targets = indices.iter().enumerate().map(|(t, &i)| e.target(op, t, i)).collect::<Result<Vec<_>>>()?;
    let data = if x.numel()? == 0 { Vec::new() } else { x.read_bytes()? };
    let updates = if targets.is_empty() { Vec::new() } else { call.input(2)?.read_bytes()? };
    let out = apply(dt, data, &updates, r, |visit| {
        for (t, &at) in targets.iter().enumerate() {
            visit(at, t);
        }
    })?;
    call.output(0)?.write_bytes(&out)
}

/// `data` (bytes of `dt`) with `updates[u]` combined into element `at` for each `(at, u)` that
/// `each` visits, in its order.
fn apply(
    dt: DType,
    data: Vec<u8>,
    updates: &[u8],
    r: Reduction,
    each: impl Fn(&mut dyn FnMut(usize, usize)),
) -> Result<Vec<u8>> {
    if r == Reduction::None {
        let esize = elem_size("scatter", dt)?;
        let mut out = data;
        each(&mut |at, u| out[at * esize..(at + 1) * esize].copy_from_slice(&updates[u * esize..(u + 1) * esize]));
        return Ok(out);
    }
    with_dtype!(dt, T => {
        let mut out = element::decode::<T>(&data);
        let upd = element::decode::<T>(updates);
        each(&mut |at, u| out[at] = combine(out[at], upd[u], r));
        Ok(element::encode(&out))
    })
}

/// Copies data to the output, then `kiln_tensor_scatter_elements<T>`: one thread per line along
/// the axis.
pub fn scatter_elements_dispatch(call: &Call) -> Result<()> {
    let op = call.op_type();
    let (e, r) = scatter_elements_plan(call, op)?;
    let x = call.input(0)?;
    let out = call.output(0)?;
    let dt = x.dtype()?;
    crate::gpu::copy(At::of(&x), At::of(&out), x.nbytes()? as u64)?;
    let n: usize = e.idx.iter().product();
    if n == 0 {
        return Ok(());
    }
    let indices = call.input(1)?;
    let lines = n / e.idx[e.axis];
    let mut args = vec![
        At::of(&out).arg(),
        At::of(&indices).arg(),
        At::of(&call.input(2)?).arg(),
        KernelArg::U64(lines as u64),
        KernelArg::U32(index_dtype(op, &indices, true)? as u32),
        KernelArg::U32(e.idx.len() as u32),
        KernelArg::U32(e.axis as u32),
        KernelArg::U64(e.data[e.axis] as u64),
        KernelArg::U32(r as u32),
    ];
    args.extend(eight(&e.idx, 1));
    args.extend(eight(&e.ds, 0));
    args.extend([device_error(op), KernelArg::Status]);
    crate::gpu::launch_elems(&tagged(op, "kiln_tensor_scatter_elements", dt)?, lines as u64, args)
}

// -----------------------------------------------------------------------------------------
// GatherND and ScatterND

/// GatherND / ScatterND geometry: `batch_dims` b, tuple length k, data's dims, the tuples'
/// count (indices' positions but the last axis), the slice length (data's dims after b + k),
/// and the output shape (GatherND).
struct Nd {
    b: usize,
    k: usize,
    data: Vec<usize>,
    /// Data's row-major strides.
    ds: Vec<usize>,
    tuples: usize,
    /// Tuples per batch (all of them without batch dims).
    per_batch: usize,
    slice: usize,
    out: Vec<usize>,
}

fn nd_plan(call: &Call, op: &str, batch_dims: i64) -> Result<Nd> {
    let data = call.input(0)?.shape()?;
    let indices = call.input(1)?;
    index_dtype(op, &indices, false)?;
    let idx = indices.shape()?;
    let Some((&k, lead)) = idx.split_last() else {
        bail!("{op}: indices must have rank 1 or more");
    };
    if batch_dims < 0 || batch_dims as usize >= data.len().min(idx.len()) {
        bail!("{op}: batch_dims {batch_dims} must be in [0, {})", data.len().min(idx.len()));
    }
    let b = batch_dims as usize;
    if k < 1 || b + k > data.len() {
        bail!("{op}: index tuples of length {k} do not fit data of rank {} after {b} batch dims", data.len());
    }
    if idx[..b] != data[..b] {
        bail!("{op}: indices' batch dims {:?} differ from data's {:?}", &idx[..b], &data[..b]);
    }
    let mut out = lead.to_vec();
    out.extend_from_slice(&data[b + k..]);
    shape::numel(&out)?;
    let tuples: usize = lead.iter().product();
    let batches: usize = data[..b].iter().product();
    Ok(Nd {
        b,
        k,
        ds: shape::strides(&data),
        tuples,
        per_batch: tuples / batches.max(1),
        slice: data[b + k..].iter().product(),
        data,
        out,
    })
}

impl Nd {
    /// Data's element offset of the slice that tuple `q` (`tuple`, its k indices) picks.
    fn slice_at(&self, op: &str, q: usize, tuple: &[i64]) -> Result<usize> {
        let mut at = self.batch_stride() * (q / self.per_batch);
        for (j, &i) in tuple.iter().enumerate() {
            let d = self.b + j;
            at += wrap(op, i, self.data[d], "data axis", d)? * self.ds[d];
        }
        Ok(at)
    }

    /// Data's stride of the last batch dim (0 without batch dims).
    fn batch_stride(&self) -> usize {
        if self.b > 0 {
            self.ds[self.b - 1]
        } else {
            0
        }
    }

    /// The kernels' geometry arguments: k, the batch dims, slice, tuples per batch, the batch
    /// stride, data's dims and strides from axis b.
    fn args(&self) -> Vec<KernelArg> {
        let mut a = vec![
            KernelArg::U32(self.k as u32),
            KernelArg::U32(self.b as u32),
            KernelArg::U64(self.slice as u64),
            KernelArg::U64(self.per_batch as u64),
            KernelArg::U64(self.batch_stride() as u64),
        ];
        a.extend(eight(&self.data[self.b..], 1));
        a.extend(eight(&self.ds[self.b..], 0));
        a
    }
}

pub fn gather_nd_infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = nd_plan(call, "GatherND", call.attr_i("batch_dims", 0)?)?;
    Ok(vec![TensorType::new(call.input(0)?.dtype()?, p.out)])
}

pub fn gather_nd_cpu(call: &Call) -> Result<()> {
    const OP: &str = "GatherND";
    let p = nd_plan(call, OP, call.attr_i("batch_dims", 0)?)?;
    let x = call.input(0)?;
    let esize = elem_size(OP, x.dtype()?)?;
    let indices = call.input(1)?.read_i64s()?;
    let data = if x.numel()? == 0 { Vec::new() } else { x.read_bytes()? };
    let mut out = Vec::with_capacity(p.tuples * p.slice * esize);
    for q in 0..p.tuples {
        let at = p.slice_at(OP, q, &indices[q * p.k..(q + 1) * p.k])?;
        out.extend_from_slice(&data[at * esize..(at + p.slice) * esize]);
    }
    call.output(0)?.write_bytes(&out)
}

/// `kiln_tensor_gather_nd`: one thread per output element.
pub fn gather_nd_dispatch(call: &Call) -> Result<()> {
    const OP: &str = "GatherND";
    let p = nd_plan(call, OP, call.attr_i("batch_dims", 0)?)?;
    let n = p.tuples * p.slice;
    if n == 0 {
        return Ok(());
    }
    let x = call.input(0)?;
    let mut args = vec![
        At::of(&x).arg(),
        At::of(&call.input(1)?).arg(),
        At::of(&call.output(0)?).arg(),
        KernelArg::U64(n as u64),
        KernelArg::U32(elem_size(OP, x.dtype()?)? as u32),
    ];
    args.extend(p.args());
    args.extend([device_error(OP), KernelArg::Status]);
    crate::gpu::launch_elems("kiln_tensor_gather_nd", n as u64, args)
}

fn scatter_nd_plan(call: &Call) -> Result<(Nd, Reduction)> {
    const OP: &str = "ScatterND";
    let p = nd_plan(call, OP, 0)?;
    let r = updates(call, OP, &p.out)?;
    Ok((p, r))
}

pub fn scatter_nd_infer(call: &Call) -> Result<Vec<TensorType>> {
    scatter_nd_plan(call)?;
    let x = call.input(0)?;
    Ok(vec![TensorType::new(x.dtype()?, x.shape()?)])
}

pub fn scatter_nd_cpu(call: &Call) -> Result<()> {
    let (p, r) = scatter_nd_plan(call)?;
    let x = call.input(0)?;
    let indices = call.input(1)?.read_i64s()?;
    let mut slices = Vec::with_capacity(p.tuples);
    for q in 0..p.tuples {
        slices.push(p.slice_at("ScatterND", q, &indices[q * p.k..(q + 1) * p.k])?);
    }
    let data = if x.numel()? == 0 { Vec::new() } else { x.read_bytes()? };
    let n = p.tuples * p.slice;
    let updates = if n == 0 { Vec::new() } else { call.input(2)?.read_bytes()? };
    let out = apply(x.dtype()?, data, &updates, r, |visit| {
        for (q, &at) in slices.iter().enumerate() {
            for e in 0..p.slice {
                visit(at + e, q * p.slice + e);
            }
        }
    })?;
    call.output(0)?.write_bytes(&out)
}

/// Copies data to the output, then `kiln_tensor_scatter_nd<T>`: one thread per slice element,
/// over every tuple in order.
pub fn scatter_nd_dispatch(call: &Call) -> Result<()> {
    let (p, r) = scatter_nd_plan(call)?;
    let x = call.input(0)?;
    let out = call.output(0)?;
    crate::gpu::copy(At::of(&x), At::of(&out), x.nbytes()? as u64)?;
    if p.tuples * p.slice == 0 {
        return Ok(());
    }
    let mut args = vec![
        At::of(&out).arg(),
        At::of(&call.input(1)?).arg(),
        At::of(&call.input(2)?).arg(),
        KernelArg::U64(p.tuples as u64),
        KernelArg::U32(r as u32),
    ];
    args.extend(p.args());
    args.extend([device_error("ScatterND"), KernelArg::Status]);
    crate::gpu::launch_elems(&tagged("ScatterND", "kiln_tensor_scatter_nd", x.dtype()?)?, p.slice as u64, args)
}
