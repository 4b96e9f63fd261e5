//! Ops that write one of two values at every position (ONNX Operators.md):
//!
//! - OneHot-9/11: indices (any numeric dtype; floats are truncated toward zero) become one-hot
//!   rows of length `depth` (input 1, a scalar value input, truncated) inserted at `axis`
//!   (default −1, in `[-r-1, r]` for indices of rank r), `values[1]` at the index and
//!   `values[0]` elsewhere (input 2, two values of the output's dtype). From OneHot-11 a negative
//!   index counts from the end (`i + depth`); an index outside `[-depth, depth)` (OneHot-9:
//!   `[0, depth)`), or a NaN, gives a row of `values[0]`, as the operator's text says
//!   (onnxruntime does the same);
//! - EyeLike-9/22: a 2-D tensor of the input's shape with ones on diagonal `k` (columns minus
//!   rows) and zeros elsewhere, of the dtype named by attribute `dtype` (the input's when absent).
//!
//! On the GPU (`cuda/tensor.cu`): one thread per output element, element bytes copied from the
//! values (OneHot; `kiln_tensor_onehot<T>` over the indices' dtype) or from a one / zero
//! pattern (`kiln_tensor_eyelike`).

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, names, unsupported, with_dtype};

use crate::elem_size;
use crate::gpu::{launch_elems, At};

/// OneHot's geometry: depth, the insertion axis, the output shape, the index count and the
/// product of the indices' dims after the axis.
struct OneHot {
    depth: usize,
    out: Vec<usize>,
    inner: usize,
    /// Negative indices count from the end (OneHot-11).
    wrap: bool,
}

fn onehot_plan(call: &Call) -> Result<OneHot> {
    const OP: &str = "OneHot";
    let idx = call.input(0)?.shape()?;
    let depth = call.input(1)?;
    let bytes = match depth.value() {
        Some(v) => Vec::from(v),
        None => depth.read_bytes()?,
    };
    let d = match element::decode_as::<f64>(depth.dtype()?, &bytes)?[..] {
        [d] => d,
        ref v => bail!("{OP}: depth must hold one value, not {}", v.len()),
    };
    if !(d >= 1.0 && d <= (1u64 << 40) as f64) {
        bail!("{OP}: depth must be a positive number, not {d}");
    }
    let values = call.input(2)?;
    if values.numel()? != 2 {
        bail!("{OP}: values must hold two values (off, on), not {}", values.numel()?);
    }
    let r = idx.len() as i64;
    let a = call.attr_i("axis", -1)?;
    if a < -r - 1 || a > r {
        bail!("{OP}: axis {a} is outside [{}, {r}] for indices of rank {r}", -r - 1);
    }
    let a = if a < 0 { (a + r + 1) as usize } else { a as usize };
    let Ok(depth) = usize::try_from(d as u64) else {
        bail!("{OP}: depth {d} is more than a shim can address");
    };
    let mut out = idx[..a].to_vec();
    out.push(depth);
    out.extend_from_slice(&idx[a..]);
    shape::numel(&out)?;
    Ok(OneHot { depth, out, inner: idx[a..].iter().product(), wrap: call.opset() >= 11 })
}

pub fn onehot_infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = onehot_plan(call)?;
    Ok(vec![TensorType::new(call.input(2)?.dtype()?, p.out)])
}

/// `i` as the index of a one-hot row of `depth`, or None outside `[-depth, depth)` (without
/// `wrap`: `[0, depth)`).
fn hot(i: i64, depth: usize, wrap: bool) -> Option<usize> {
    let j = if i < 0 && wrap { i + depth as i64 } else { i };
    (0..depth as i64).contains(&j).then_some(j as usize)
}

pub fn onehot_cpu(call: &Call) -> Result<()> {
    let p = onehot_plan(call)?;
    let x = call.input(0)?;
    let dt = x.dtype()?;
    let bytes = if x.numel()? == 0 { Vec::new() } else { x.read_bytes()? };
    // Integers exactly, floats truncated toward zero.
    let indices: Vec<i64> = if dt.is_float() {
        // A NaN (or a value past i64) matches no position, as on the GPU.
        let out_of_range = |v: f64| v.is_nan() || v.abs() >= 9.2e18;
        element::decode_as::<f64>(dt, &bytes)?
            .into_iter()
            .map(|v| if out_of_range(v) { i64::MIN } else { v as i64 })
            .collect()
    } else {
        element::decode_as::<i64>(dt, &bytes)?
    };
    let values = call.input(2)?;
    let esize = elem_size("OneHot", values.dtype()?)?;
    let vb = values.read_bytes()?;
    let (off, on) = vb.split_at(esize);
    let n: usize = p.out.iter().product();
    let mut out = Vec::with_capacity(n * esize);
    for t in 0..n {
        let (o, rest) = (t / (p.depth * p.inner), t % (p.depth * p.inner));
        let (d, i) = (rest / p.inner, rest % p.inner);
        out.extend_from_slice(if hot(indices[o * p.inner + i], p.depth, p.wrap) == Some(d) { on } else { off });
    }
    call.output(0)?.write_bytes(&out)
}

/// `kiln_tensor_onehot<T>` over the indices' dtype.
pub fn onehot_dispatch(call: &Call) -> Result<()> {
    let p = onehot_plan(call)?;
    let n: usize = p.out.iter().product();
    let x = call.input(0)?;
    let dt = x.dtype()?;
    let tag = match (dt, dt.cuda_tag()) {
        (DType::F32 | DType::F64 | DType::I32 | DType::I64, Some(tag)) => tag,
        _ => unsupported!("OneHot: {dt} indices are not supported on the GPU"),
    };
    let values = call.input(2)?;
    launch_elems(
        &names::kernel_name("kiln_tensor_onehot", &[tag]),
        n as u64,
        vec![
            At::of(&x).arg(),
            At::of(&values).arg(),
            At::of(&call.output(0)?).arg(),
            KernelArg::U64(n as u64),
            KernelArg::U32(elem_size("OneHot", values.dtype()?)? as u32),
            KernelArg::U64(p.depth as u64),
            KernelArg::U64(p.inner as u64),
            KernelArg::U32(p.wrap as u32),
        ],
    )
}

/// EyeLike's output dtype, rows, columns and k.
fn eyelike_plan(call: &Call) -> Result<(DType, usize, usize, i64)> {
    const OP: &str = "EyeLike";
    let x = call.input(0)?;
    let [rows, cols] = x.shape()?[..] else {
        bail!("{OP}: input must have rank 2, not {}", x.rank()?);
    };
    let dt = match call.attr("dtype") {
        Some(_) => {
            let code = call.attr_i("dtype", 0)?;
            match i32::try_from(code).ok().and_then(DType::from_code) {
                Some(dt) if dt != DType::String => dt,
                _ => bail!("{OP}: dtype {code} is not a supported tensor type"),
            }
        }
        None => x.dtype()?,
    };
    Ok((dt, rows, cols, call.attr_i("k", 0)?))
}

pub fn eyelike_infer(call: &Call) -> Result<Vec<TensorType>> {
    let (dt, rows, cols, _) = eyelike_plan(call)?;
    Ok(vec![TensorType::new(dt, vec![rows, cols])])
}

/// The little-endian bytes of 1 in `dt`.
fn one(dt: DType) -> Result<Vec<u8>> {
    with_dtype!(dt, T => Ok(element::encode(&[T::from_f64(1.0)])))
}

pub fn eyelike_cpu(call: &Call) -> Result<()> {
    let (dt, rows, cols, k) = eyelike_plan(call)?;
    let one = one(dt)?;
    let mut out = vec![0u8; rows * cols * one.len()];
    for (t, e) in out.chunks_exact_mut(one.len()).enumerate() {
        if (t % cols) as i64 - (t / cols) as i64 == k {
            e.copy_from_slice(&one);
        }
    }
    call.output(0)?.write_bytes(&out)
}

/// `kiln_tensor_eyelike`: one thread per element.
pub fn eyelike_dispatch(call: &Call) -> Result<()> {
    let (dt, rows, cols, k) = eyelike_plan(call)?;
    let one = one(dt)?;
    let pattern = one.iter().rev().fold(0u64, |a, &b| (a << 8) | b as u64);
    launch_elems(
        "kiln_tensor_eyelike",
        (rows * cols) as u64,
        vec![
            At::of(&call.output(0)?).arg(),
            KernelArg::U64(rows as u64),
            KernelArg::U64(cols as u64),
            KernelArg::I64(k),
            KernelArg::U32(one.len() as u32),
            KernelArg::U64(pattern),
        ],
    )
}
