//! Ops whose output is made rather than moved: Shape, Size (from the input's shape), Constant
//! (from attributes), ConstantOfShape (a value repeated), Range (an arithmetic sequence).

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, unsupported, with_dtype};

use crate::{elem_size, gpu};

/// What the node produces: the output's dtype and shape, and how to make its bytes.
struct Plan {
    dtype: DType,
    shape: Vec<usize>,
    fill: Fill,
}

enum Fill {
    /// These bytes.
    Bytes(Vec<u8>),
    /// One element's bytes, repeated over the whole output.
    Repeat(Vec<u8>),
    /// Range: `start + i·delta`, in i64 for integer dtypes, in f64 otherwise.
    IntRange(i64, i64),
    FloatRange(f64, f64),
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    Ok(vec![TensorType::new(p.dtype, p.shape)])
}

pub fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let n: usize = p.shape.iter().product();
    let bytes = match p.fill {
        Fill::Bytes(b) => b,
        Fill::Repeat(one) => one.repeat(n),
        Fill::IntRange(start, delta) => with_dtype!(p.dtype, T => Ok(element::encode::<T>(
            &(0..n as i64).map(|i| T::from_i64(start.wrapping_add(i.wrapping_mul(delta)))).collect::<Vec<T>>()
        )))?,
        Fill::FloatRange(start, delta) => with_dtype!(p.dtype, T => Ok(element::encode::<T>(
            &(0..n).map(|i| T::from_f64(start + i as f64 * delta)).collect::<Vec<T>>()
        )))?,
    };
    call.output(0)?.write_bytes(&bytes)
}

/// Shape and Size: the values, known from the shapes, as launch arguments. ConstantOfShape:
/// a fill. Range: one arithmetic-sequence launch. Constant: none (the host folds it).
pub fn dispatch(call: &Call) -> Result<()> {
    if call.op_type() == "Constant" {
        unsupported!("Constant has no GPU dispatch: the host folds it at load");
    }
    let p = plan(call)?;
    let esize = elem_size(call.op_type(), p.dtype)?;
    let n: usize = p.shape.iter().product();
    let dst = gpu::At::of(&call.output(0)?);
    match p.fill {
        Fill::Bytes(b) => {
            if p.dtype != DType::I64 {
                unsupported!("{}: only int64 values have a GPU dispatch", call.op_type());
            }
            let values: Vec<u64> =
                b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect();
            gpu::values64(dst, &values)
        }
        Fill::Repeat(one) => gpu::fill(dst, (n * esize) as u64, &one),
        Fill::IntRange(start, delta) => gpu::range_int(dst, n as u64, start, delta, esize),
        Fill::FloatRange(start, delta) => gpu::range_float(dst, n as u64, start, delta, p.dtype),
    }
}

fn plan(call: &Call) -> Result<Plan> {
    match call.op_type() {
        "Shape" => shape_of(call),
        "Size" => {
            let n = call.input(0)?.numel()? as i64;
            Ok(Plan { dtype: DType::I64, shape: Vec::new(), fill: Fill::Bytes(element::encode(&[n])) })
        }
        "Constant" => constant(call),
        "ConstantOfShape" => constant_of_shape(call),
        "Range" => range(call),
        other => unsupported!("kiln-tensor: {other} is not a generating op"),
    }
}

/// Shape: the input's dimensions `start..end` (Shape-15; whole shape before), as int64.
fn shape_of(call: &Call) -> Result<Plan> {
    let dims = call.input(0)?.shape()?;
    let r = dims.len() as i64;
    let clip = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
    let start = clip(call.attr_i("start", 0)?);
    let end = clip(call.attr_i("end", r)?);
    let out: Vec<i64> = dims.get(start..end.max(start)).unwrap_or(&[]).iter().map(|&d| d as i64).collect();
    Ok(Plan { dtype: DType::I64, shape: vec![out.len()], fill: Fill::Bytes(element::encode(&out)) })
}

/// A TENSOR value's bytes, checked against its dtype and dimensions.
fn tensor_bytes(op: &str, t: &TensorValue) -> Result<(Vec<usize>, Vec<u8>)> {
    let esize = elem_size(op, t.dtype)?;
    if let Some(d) = t.dims.iter().find(|&&d| d < 0) {
        bail!("{op}: value has negative dimension {d}");
    }
    let shape: Vec<usize> = shape::dims_from_i64(&t.dims)?;
    let n: usize = shape::numel(&shape)?;
    if t.data.len() != n * esize {
        bail!("{op}: value of shape {shape:?} and dtype {} has {} bytes, not {}", t.dtype, t.data.len(), n * esize);
    }
    Ok((shape, Vec::from(t.data)))
}

/// Constant: exactly one of `value`, `value_float(s)`, `value_int(s)`; strings and sparse
/// tensors are unsupported.
fn constant(call: &Call) -> Result<Plan> {
    for name in ["sparse_value", "value_string", "value_strings"] {
        if call.attr(name).is_some() {
            unsupported!("Constant: attribute {name} is not supported");
        }
    }
    let given = ["value", "value_float", "value_floats", "value_int", "value_ints"]
        .into_iter()
        .filter(|n| call.attr(n).is_some())
        .collect::<Vec<_>>();
    let [name] = given.as_slice() else {
        bail!("Constant: needs exactly one value attribute, has {given:?}");
    };
    let bytes = |dtype, shape, fill| Ok(Plan { dtype, shape, fill: Fill::Bytes(fill) });
    match *name {
        "value" => {
            let Some(t) = call.attr_tensor("value")? else { bail!("Constant: attribute value is missing") };
            let (shape, data) = tensor_bytes("Constant", t)?;
            bytes(t.dtype, shape, data)
        }
        "value_float" => bytes(DType::F32, Vec::new(), element::encode(&[call.attr_f("value_float", 0.0)?])),
        "value_int" => bytes(DType::I64, Vec::new(), element::encode(&[call.attr_i("value_int", 0)?])),
        "value_floats" => {
            let v = call.attr_floats("value_floats")?.unwrap_or_default();
            bytes(DType::F32, vec![v.len()], element::encode(&v))
        }
        _ => {
            let v = call.attr_ints("value_ints")?.unwrap_or_default();
            bytes(DType::I64, vec![v.len()], element::encode(&v))
        }
    }
}

/// ConstantOfShape: the int64 shape input, filled with the one-element `value` (default
/// float32 0).
fn constant_of_shape(call: &Call) -> Result<Plan> {
    let s = call.input(0)?;
    if s.dtype()? != DType::I64 || s.rank()? != 1 {
        bail!("ConstantOfShape: input must be a 1-D int64 tensor, not {} of shape {:?}", s.dtype()?, s.shape()?);
    }
    let dims = s.read_i64s()?;
    if let Some(d) = dims.iter().find(|&&d| d < 0) {
        bail!("ConstantOfShape: shape {dims:?} has negative dimension {d}");
    }
    let shape = shape::dims_from_i64(&dims)?;
    let (dtype, one) = match call.attr_tensor("value")? {
        None => (DType::F32, element::encode(&[0f32])),
        Some(t) => {
            let (vshape, data) = tensor_bytes("ConstantOfShape", t)?;
            if vshape.iter().product::<usize>() != 1 {
                bail!("ConstantOfShape: value must hold one element, has shape {vshape:?}");
            }
            (t.dtype, data)
        }
    };
    Ok(Plan { dtype, shape, fill: Fill::Repeat(one) })
}

/// Range: `max(ceil((limit - start) / delta), 0)` elements `start + i·delta`, of the inputs'
/// dtype.
fn range(call: &Call) -> Result<Plan> {
    let dtype = call.input(0)?.dtype()?;
    let mut vals = [0f64; 3];
    let mut ints = [0i64; 3];
    for i in 0..3 {
        let t = call.input(i)?;
        if t.dtype()? != dtype {
            bail!("Range: inputs mix {dtype} and {}", t.dtype()?);
        }
        if t.numel()? != 1 {
            bail!("Range: input {i} must be a scalar, has shape {:?}", t.shape()?);
        }
        let bytes = match t.value() {
            Some(v) => Vec::from(v),
            None => t.read_bytes()?,
        };
        vals[i] = element::decode_as::<f64>(dtype, &bytes)?[0];
        ints[i] = element::decode_as::<i64>(dtype, &bytes)?[0];
    }
    if dtype.is_float() {
        let [start, limit, delta] = vals;
        if delta == 0.0 {
            bail!("Range: delta is 0");
        }
        let n = libm::ceil((limit - start) / delta);
        if !n.is_finite() {
            bail!("Range: start {start}, limit {limit} and delta {delta} give no finite length");
        }
        if n > u32::MAX as f64 {
            bail!("Range: {n} elements are more than a shim can address");
        }
        let n = if n > 0.0 { n as usize } else { 0 };
        Ok(Plan { dtype, shape: vec![n], fill: Fill::FloatRange(start, delta) })
    } else {
        let [start, limit, delta] = ints.map(i128::from);
        if delta == 0 {
            bail!("Range: delta is 0");
        }
        let diff = limit - start;
        let n = if delta > 0 && diff > 0 {
            (diff - 1) / delta + 1
        } else if delta < 0 && diff < 0 {
            (-diff - 1) / -delta + 1
        } else {
            0
        };
        let Ok(n) = usize::try_from(n) else { bail!("Range: {n} elements are too many") };
        Ok(Plan { dtype, shape: vec![n], fill: Fill::IntRange(ints[0], ints[2]) })
    }
}
