//! numpy arrays ↔ kiln tensors. Arrays of any layout are accepted (non-contiguous ones are read
//! in logical, C order); outputs are new C-contiguous arrays.

use bytes::Bytes;
use kiln_host::Tensor;
use kiln_kernel_abi::DType;
use numpy::{
    Element, PyArray1, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use crate::errors::{raise, IntoPy, Kind};

/// Little-endian bytes of one element.
trait Le: Element + Copy {
    const DTYPE: DType;
    fn put(self, out: &mut Vec<u8>);
    fn get(b: &[u8]) -> Self;
}

macro_rules! le {
    ($t:ty, $d:expr) => {
        impl Le for $t {
            const DTYPE: DType = $d;
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn get(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().unwrap_or_default())
            }
        }
    };
}
le!(f32, DType::F32);
le!(f64, DType::F64);
le!(i8, DType::I8);
le!(i16, DType::I16);
le!(i32, DType::I32);
le!(i64, DType::I64);
le!(u8, DType::U8);
le!(u16, DType::U16);
le!(u32, DType::U32);
le!(u64, DType::U64);
le!(half::f16, DType::F16);

impl Le for bool {
    const DTYPE: DType = DType::Bool;
    fn put(self, out: &mut Vec<u8>) {
        out.push(self as u8);
    }
    fn get(b: &[u8]) -> Self {
        b.first().is_some_and(|&x| x != 0)
    }
}

fn read<T: Le>(a: &Bound<'_, PyAny>) -> Option<PyResult<Tensor>> {
    let a = a.cast::<PyArrayDyn<T>>().ok()?;
    let ro = a.readonly();
    let view = ro.as_array();
    let mut bytes = Vec::with_capacity(view.len() * std::mem::size_of::<T>());
    // ndarray's `as_slice` is the C-order slice only (a Fortran-order array iterates instead).
    match view.as_slice() {
        Some(s) => s.iter().for_each(|v| v.put(&mut bytes)),
        None => view.iter().for_each(|v| v.put(&mut bytes)),
    }
    Some(Tensor::new(T::DTYPE, view.shape().to_vec(), Bytes::from(bytes)).py_err())
}

/// A numpy array of `str` (dtype `<U`n, or `object` holding `str`, as onnxruntime takes string
/// inputs) as a string tensor; `None` for another dtype.
fn read_strings(what: &str, a: &Bound<'_, PyAny>) -> Option<PyResult<Tensor>> {
    let u = a.cast::<PyUntypedArray>().ok()?;
    let kind = u.dtype().kind();
    if kind != b'U' && kind != b'O' {
        return None;
    }
    let shape = u.shape().to_vec();
    let elements =
        a.call_method0("ravel").and_then(|r| r.call_method0("tolist")).and_then(|l| l.extract::<Vec<String>>());
    Some(match elements {
        Ok(e) => Tensor::from_strings(shape, &e).py_err(),
        Err(_) => Err(raise(Kind::InvalidInput, format!("{what}: an object array whose elements are not all str"))),
    })
}

/// `a` (a numpy array) as a tensor. `what` names it in errors. Errors: not a numpy array, or a
/// dtype kiln has no tensors of (complex, objects other than str).
pub fn to_tensor(what: &str, a: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    if a.cast::<PyUntypedArray>().is_err() {
        return Err(raise(Kind::InvalidInput, format!("{what}: a numpy.ndarray, not {}", a.get_type().name()?)));
    }
    if let Some(t) = read_strings(what, a) {
        return t;
    }
    read::<f32>(a)
        .or_else(|| read::<f64>(a))
        .or_else(|| read::<half::f16>(a))
        .or_else(|| read::<i64>(a))
        .or_else(|| read::<i32>(a))
        .or_else(|| read::<i16>(a))
        .or_else(|| read::<i8>(a))
        .or_else(|| read::<u8>(a))
        .or_else(|| read::<u16>(a))
        .or_else(|| read::<u32>(a))
        .or_else(|| read::<u64>(a))
        .or_else(|| read::<bool>(a))
        .unwrap_or_else(|| {
            let dtype = a.cast::<PyUntypedArray>().map(|u| u.dtype().to_string()).unwrap_or_default();
            Err(raise(Kind::Unsupported, format!("{what}: numpy dtype {dtype} has no kiln tensor type")))
        })
}

fn write<'py, T: Le>(py: Python<'py>, t: &Tensor) -> PyResult<Bound<'py, PyAny>> {
    let size = std::mem::size_of::<T>().max(1);
    let v: Vec<T> = t.data.chunks_exact(size).map(T::get).collect();
    Ok(PyArray1::from_vec(py, v).reshape(t.shape.clone())?.into_any())
}

/// A new numpy array with `t`'s values; strings as an `object` array of `str`, as onnxruntime
/// returns them (bytes that are not UTF-8 replaced by U+FFFD). Errors: a dtype numpy has no
/// array of (bfloat16, float8, 4-bit and 2-bit types).
pub fn to_numpy<'py>(py: Python<'py>, name: &str, t: &Tensor) -> PyResult<Bound<'py, PyAny>> {
    match t.dtype {
        DType::String => {
            let elements: Vec<String> =
                t.strings().py_err()?.iter().map(|s| String::from_utf8_lossy(s).into_owned()).collect();
            let np = py.import("numpy")?;
            let kwargs = pyo3::types::PyDict::new(py);
            kwargs.set_item("dtype", np.getattr("object_")?)?;
            let flat = np.call_method("array", (elements,), Some(&kwargs))?;
            flat.call_method1("reshape", (t.shape.clone(),))
        }
        DType::F32 => write::<f32>(py, t),
        DType::F64 => write::<f64>(py, t),
        DType::F16 => write::<half::f16>(py, t),
        DType::I64 => write::<i64>(py, t),
        DType::I32 => write::<i32>(py, t),
        DType::I16 => write::<i16>(py, t),
        DType::I8 => write::<i8>(py, t),
        DType::U8 => write::<u8>(py, t),
        DType::U16 => write::<u16>(py, t),
        DType::U32 => write::<u32>(py, t),
        DType::U64 => write::<u64>(py, t),
        DType::Bool => write::<bool>(py, t),
        other => Err(raise(Kind::Unsupported, format!("output {name:?}: {other} tensors have no numpy dtype"))),
    }
}

/// Token ids as a numpy int32 array (onnxruntime-genai returns int32 ids).
pub fn ids_array<'py>(py: Python<'py>, ids: &[i64]) -> Bound<'py, PyAny> {
    PyArray1::from_vec(py, ids.iter().map(|&i| i as i32).collect::<Vec<i32>>()).into_any()
}

/// Token ids from a numpy array or a Python sequence of ints.
pub fn ids_from(what: &str, a: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if a.cast::<PyUntypedArray>().is_ok() {
        let t = to_tensor(what, a)?;
        return match t.dtype {
            DType::I64 => t.to_i64().py_err(),
            DType::I32 => Ok(t.data.chunks_exact(4).map(|b| i32::get(b) as i64).collect()),
            d => Err(raise(Kind::InvalidInput, format!("{what}: token ids are int32 or int64, not {d}"))),
        };
    }
    a.extract::<Vec<i64>>().map_err(|_| raise(Kind::InvalidInput, format!("{what}: a sequence of token ids")))
}
