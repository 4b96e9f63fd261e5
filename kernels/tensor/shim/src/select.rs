//! Ops whose output shape depends on the input's values (ONNX Operators.md), so the values that
//! decide it are value inputs (`kernel.toml`), read in `infer` and `dispatch`:
//!
//! - NonZero-9/13: `X` [D…] of any fixed-size type → int64 `[rank, nnz]`, the coordinates of
//!   the nonzero elements in row-major order, one row per axis (numpy's `nonzero`; a scalar
//!   counts as `[1]`). A float is zero when its magnitude is, so −0.0 is zero and NaN is not.
//! - Compress-9/11: `input` and a 1-D bool `condition`; with `axis`, the slices along it whose
//!   condition is true, in order (a condition shorter than the axis drops the slices past its
//!   end); without, the flattened input's elements. Output: the input's shape with that axis (or
//!   the whole, flattened) cut to the count of trues.
//!
//! On the GPU `kiln_tensor_nonzero` (one block, ordered compaction by warp ballots) writes the
//! coordinates; Compress runs it over the condition into scratch and gathers the slices with
//! `kiln_tensor_compress`.

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, unsupported};

use crate::{axis, elem_size};

/// Whether element bytes `e` of `dtype` are nonzero (floats by magnitude: −0.0 is zero).
fn nonzero(e: &[u8], float: bool) -> bool {
    let (last, rest) = e.split_last().unwrap_or((&0, &[]));
    let top = if float { last & 0x7f } else { *last };
    top != 0 || rest.iter().any(|&b| b != 0)
}

fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::F64)
}

/// NonZero's input dims (a scalar as `[1]`), element size, and the flat indices of its nonzero
/// elements.
fn nonzero_plan(call: &Call) -> Result<(Vec<usize>, usize, Vec<usize>)> {
    let x = call.input(0)?;
    let dtype = x.dtype()?;
    let esize = elem_size("NonZero", dtype)?;
    let mut dims = x.shape()?;
    if dims.is_empty() {
        dims.push(1);
    }
    let bytes = x.value_bytes()?;
    let hits = bytes.chunks_exact(esize).enumerate().filter(|(_, e)| nonzero(e, is_float(dtype))).map(|(i, _)| i);
    Ok((dims, esize, hits.collect()))
}

pub fn nonzero_infer(call: &Call) -> Result<Vec<TensorType>> {
    let (dims, _, hits) = nonzero_plan(call)?;
    Ok(alloc::vec![TensorType::new(DType::I64, alloc::vec![dims.len(), hits.len()])])
}

pub fn nonzero_cpu(call: &Call) -> Result<()> {
    let (dims, _, hits) = nonzero_plan(call)?;
    let mut out = alloc::vec![0i64; dims.len() * hits.len()];
    for (k, &flat) in hits.iter().enumerate() {
        let mut rest = flat;
        for d in (0..dims.len()).rev() {
            out[d * hits.len() + k] = (rest % dims[d]) as i64;
            rest /= dims[d];
        }
    }
    call.output(0)?.write_vec(&out)
}

/// Threads of the one block of `kiln_tensor_nonzero`.
const COMPACT_BLOCK: u32 = 1024;

/// Launches `kiln_tensor_nonzero` over `n` elements of `esize` bytes at `x` with dims `dims`
/// (at most 8), writing `nnz` coordinates per axis to `out`.
fn launch_nonzero(x: u32, out: u32, n: usize, esize: usize, float: bool, nnz: usize, dims: &[usize]) -> Result<()> {
    if dims.len() > 8 {
        unsupported!("NonZero: rank {} (the CUDA kernel takes up to 8)", dims.len());
    }
    let mut args = alloc::vec![
        KernelArg::Tensor { handle: x, offset: 0 },
        KernelArg::Tensor { handle: out, offset: 0 },
        KernelArg::U64(n as u64),
        KernelArg::U32(esize as u32),
        KernelArg::U32(float as u32),
        KernelArg::U64(nnz as u64),
        KernelArg::U32(dims.len() as u32),
    ];
    args.extend((0..8).map(|i| KernelArg::U64(dims.get(i).map_or(1, |&d| d as u64))));
    launch(&Launch {
        kernel: "kiln_tensor_nonzero",
        grid: [1, 1, 1],
        block: [COMPACT_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args,
    })
}

pub fn nonzero_dispatch(call: &Call) -> Result<()> {
    let (dims, esize, hits) = nonzero_plan(call)?;
    if hits.is_empty() {
        return Ok(());
    }
    let x = call.input(0)?;
    let n = dims.iter().product();
    launch_nonzero(x.handle(), call.output(0)?.handle(), n, esize, is_float(x.dtype()?), hits.len(), &dims)
}

/// Compress's geometry: element size, elements per slice (`inner`), slices before the axis
/// (`outer`), the axis length, the selected slice indices, and the output shape.
struct CompressPlan {
    esize: usize,
    outer: usize,
    axis_len: usize,
    inner: usize,
    /// How many condition values are used (at most the axis length).
    used: usize,
    selected: Vec<usize>,
    out: Vec<usize>,
}

fn compress_plan(call: &Call) -> Result<CompressPlan> {
    let x = call.input(0)?;
    let esize = elem_size("Compress", x.dtype()?)?;
    let shape = x.shape()?;
    let cond = call.input(1)?;
    if cond.dtype()? != DType::Bool || cond.shape()?.len() != 1 {
        bail!("Compress: condition must be a 1-D bool tensor, not {} {:?}", cond.dtype()?, cond.shape()?);
    }
    let flags = cond.value_bytes()?;
    let (outer, axis_len, inner, a) = match call.attr("axis") {
        None => (1, shape.iter().product(), 1, None),
        Some(_) => {
            let a = axis("Compress", call.attr_i("axis", 0)?, shape.len())?;
            (shape[..a].iter().product(), shape[a], shape[a + 1..].iter().product(), Some(a))
        }
    };
    if flags.len() > axis_len {
        bail!("Compress: condition has {} values, more than the {axis_len} slices it selects from", flags.len());
    }
    let selected: Vec<usize> = flags.iter().enumerate().filter(|(_, &f)| f != 0).map(|(i, _)| i).collect();
    let out = match a {
        None => alloc::vec![selected.len()],
        Some(a) => {
            let mut s = shape.clone();
            s[a] = selected.len();
            s
        }
    };
    Ok(CompressPlan { esize, outer, axis_len, inner, used: flags.len(), selected, out })
}

pub fn compress_infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = compress_plan(call)?;
    Ok(alloc::vec![TensorType::new(call.input(0)?.dtype()?, p.out)])
}

pub fn compress_cpu(call: &Call) -> Result<()> {
    let p = compress_plan(call)?;
    let src = call.input(0)?.read_bytes()?;
    let slice = p.inner * p.esize;
    let mut out = Vec::with_capacity(p.outer * p.selected.len() * slice);
    for o in 0..p.outer {
        for &j in &p.selected {
            let at = (o * p.axis_len + j) * slice;
            out.extend_from_slice(&src[at..at + slice]);
        }
    }
    call.output(0)?.write_bytes(&out)
}

pub fn compress_dispatch(call: &Call) -> Result<()> {
    let p = compress_plan(call)?;
    let total = p.outer * p.selected.len() * p.inner;
    if total == 0 {
        return Ok(());
    }
    // The selected slice indices, in order, into scratch; then every output element's copy.
    let sel = scratch(p.selected.len() as u64 * 8)?;
    launch_nonzero(call.input(1)?.handle(), sel, p.used, 1, false, p.selected.len(), &[p.used])?;
    launch(&Launch {
        kernel: "kiln_tensor_compress",
        grid: grid_stride(total as u64),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args: alloc::vec![
            KernelArg::Tensor { handle: call.input(0)?.handle(), offset: 0 },
            KernelArg::Tensor { handle: sel, offset: 0 },
            KernelArg::Tensor { handle: call.output(0)?.handle(), offset: 0 },
            KernelArg::U64(total as u64),
            KernelArg::U32(p.esize as u32),
            KernelArg::U64(p.inner as u64),
            KernelArg::U64(p.selected.len() as u64),
            KernelArg::U64(p.axis_len as u64),
        ],
    })
}
