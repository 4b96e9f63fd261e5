//! Ops whose output element at a multi-index is the input element at an affine function of
//! it: Transpose (permuted strides), Slice (offset and scaled strides, possibly negative),
//! Expand (zero strides on broadcast axes), Tile (each axis split into [repeat, element], the
//! repeat's stride 0), DepthToSpace and SpaceToDepth (a 6-D rearrangement of [N, C, H, W]).

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, unsupported};

use crate::{distinct_axes, elem_size, gpu};

/// The shape walked (row-major, as the output is written), and for each of its axes the input
/// stride (in elements) to step by, from the input element `base`; `out` is the output's shape
/// (the walked shape, or fewer axes over the same elements).
pub struct Plan {
    pub shape: Vec<usize>,
    pub strides: Vec<isize>,
    pub base: isize,
    pub out: Vec<usize>,
}

impl Plan {
    fn walk(shape: Vec<usize>, strides: Vec<isize>, base: isize) -> Plan {
        Plan { out: shape.clone(), shape, strides, base }
    }
}

pub fn plan(call: &Call) -> Result<Plan> {
    let dims = call.input(0)?.shape()?;
    match call.op_type() {
        "Transpose" => transpose(call, &dims),
        "Slice" => slice(call, &dims),
        "Expand" => expand(call, &dims),
        "Tile" => tile(call, &dims),
        "DepthToSpace" | "SpaceToDepth" => depth_space(call, &dims),
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
    Ok(Plan::walk(perm.iter().map(|&p| dims[p as usize]).collect(), perm.iter().map(|&p| st[p as usize]).collect(), 0))
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
    Ok(Plan::walk(shape, strides, base))
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
    Ok(Plan::walk(shape, strides, 0))
}

/// Tile: each axis repeated `repeats` (int64 input 1, a value input) times.
fn tile(call: &Call, dims: &[usize]) -> Result<Plan> {
    let reps = call.input(1)?.read_i64s()?;
    if reps.len() != dims.len() {
        bail!("Tile: repeats has {} values for an input of rank {}", reps.len(), dims.len());
    }
    if let Some(r) = reps.iter().find(|&&r| r < 0) {
        bail!("Tile: repeats {reps:?} has a negative count {r}");
    }
    let st = in_strides(dims);
    let (mut shape, mut strides, mut out) = (Vec::new(), Vec::new(), Vec::new());
    for (k, &d) in dims.iter().enumerate() {
        let r = usize::try_from(reps[k]).unwrap_or(usize::MAX);
        shape.extend([r, d]);
        strides.extend([0, st[k]]);
        match r.checked_mul(d) {
            Some(n) => out.push(n),
            None => bail!("Tile: axis {k} of {d} elements repeated {r} times is too long"),
        }
    }
    shape::numel(&out)?;
    Ok(Plan { shape, strides, base: 0, out })
}

/// DepthToSpace (`blocksize` b, `mode` DCR or CRD from opset 11) moves [N, C, H, W]'s channel
/// blocks into b × b spatial tiles, [N, C/b², H·b, W·b]; SpaceToDepth the reverse,
/// [N, C·b², H/b, W/b], channel (b1·b + b2)·C + c for tile position (b1, b2).
fn depth_space(call: &Call, dims: &[usize]) -> Result<Plan> {
    let op = call.op_type();
    let &[n, c, h, w] = dims else { bail!("{op}: the input must be 4-D [N, C, H, W], not {dims:?}") };
    let b = call.attr_i("blocksize", 0)?;
    if !(1..=i32::MAX as i64).contains(&b) {
        bail!("{op}: blocksize must be positive, not {b}");
    }
    let b = b as usize;
    let mul = |x: usize, y: usize| {
        x.checked_mul(y).ok_or_else(|| ShimError::Failed(format!("{op}: blocksize {b} makes {dims:?} too large")))
    };
    let bb = mul(b, b)?;
    let (hw, bi) = ((h * w) as isize, b as isize);
    if op == "DepthToSpace" {
        if c % bb != 0 {
            bail!("{op}: {c} channels are not a multiple of blocksize² = {bb}");
        }
        let cc = c / bb;
        let cci = cc as isize;
        // Walk [N, C', H, b1, W, b2]; input channel (b1·b + b2)·C' + c' (DCR) or c'·b² + b1·b + b2 (CRD).
        let (sc, sb1, sb2) = match call.attr_s("mode", "DCR")? {
            "DCR" => (hw, bi * cci * hw, cci * hw),
            "CRD" => (bi * bi * hw, bi * hw, hw),
            m => bail!("{op}: mode must be DCR or CRD, not {m:?}"),
        };
        let out = alloc::vec![n, cc, mul(h, b)?, mul(w, b)?];
        shape::numel(&out)?;
        let shape = alloc::vec![n, cc, h, b, w, b];
        let strides = alloc::vec![(c as isize) * hw, sc, w as isize, sb1, 1, sb2];
        Ok(Plan { shape, strides, base: 0, out })
    } else {
        if h % b != 0 || w % b != 0 {
            bail!("{op}: H {h} and W {w} must be multiples of blocksize {b}");
        }
        let out = alloc::vec![n, mul(c, bb)?, h / b, w / b];
        shape::numel(&out)?;
        // Walk [N, b1, b2, C, H/b, W/b]: input (c, h'·b + b1, w'·b + b2).
        let shape = alloc::vec![n, b, b, c, h / b, w / b];
        let strides = alloc::vec![(c as isize) * hw, w as isize, 1, hw, bi * w as isize, bi];
        Ok(Plan { shape, strides, base: 0, out })
    }
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
