//! Host tensors: a dtype, a shape and little-endian row-major bytes.

use bytes::Bytes;
use kiln_kernel_abi::{strings, DType};

use crate::Error;

/// A dense tensor in host memory. `data` holds `numel × dtype.size()` bytes, little-endian,
/// row-major (packed dtypes: [`DType::storage_bytes`], ONNX's packing; strings: ABI.md §6's
/// offsets and text); cloning shares the bytes (initializers may be memory-mapped external data).
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Bytes,
}

impl Tensor {
    /// Checks that `data` has the size the dtype and shape require (a string tensor: that it is
    /// one of `shape`'s elements, ABI.md §6, `kiln_kernel_abi::strings`).
    pub fn new(dtype: DType, shape: Vec<usize>, data: Bytes) -> Result<Tensor, Error> {
        if dtype == DType::String {
            let ok = checked_numel(&shape)
                .ok_or(strings::StringsError::TooLarge)
                .and_then(|n| strings::decode(&data, n).map(|_| ()));
            return match ok {
                Ok(()) => Ok(Tensor { dtype, shape, data }),
                Err(e) => Err(Error::Input(format!("a string tensor of shape {shape:?}: {e}"))),
            };
        }
        let expected = byte_size(dtype, &shape)?;
        if data.len() as u64 != expected {
            return Err(Error::Input(format!(
                "a {dtype} tensor of shape {shape:?} needs {expected} bytes, {} were given",
                data.len()
            )));
        }
        Ok(Tensor { dtype, shape, data })
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The elements of a float tensor (f32, f16, bf16, f64) as f32. Errors: another dtype.
    pub fn to_f32(&self) -> Result<Vec<f32>, Error> {
        let d = &self.data;
        Ok(match self.dtype {
            DType::F32 => d.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            DType::F16 => d.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            DType::BF16 => d.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            DType::F64 => {
                d.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap_or_default()) as f32).collect()
            }
            other => return Err(Error::Input(format!("{other} values are not floats"))),
        })
    }

    /// The value of a one-element float tensor (f32, f16, bf16, f64) as f64, or `None` for
    /// another dtype or element count.
    pub fn scalar_f64(&self) -> Option<f64> {
        if self.numel() != 1 {
            return None;
        }
        let d = &self.data;
        match self.dtype {
            DType::F64 => Some(f64::from_le_bytes(d.get(..8)?.try_into().ok()?)),
            DType::F32 | DType::F16 | DType::BF16 => self.to_f32().ok()?.first().map(|&x| f64::from(x)),
            _ => None,
        }
    }

    /// A tensor of `shape` holding `xs` converted to `dtype` (floats rounded, integers
    /// truncated toward zero). Errors: a dtype that is neither float nor a plain integer, or a
    /// count that does not fit the shape.
    pub fn from_f64s(dtype: DType, shape: Vec<usize>, xs: &[f64]) -> Result<Tensor, Error> {
        let mut data = Vec::new();
        for &x in xs {
            match dtype {
                DType::F64 => data.extend(x.to_le_bytes()),
                DType::F32 => data.extend((x as f32).to_le_bytes()),
                DType::F16 => data.extend(half::f16::from_f64(x).to_le_bytes()),
                DType::BF16 => data.extend(half::bf16::from_f64(x).to_le_bytes()),
                DType::I64 => data.extend((x as i64).to_le_bytes()),
                DType::I32 => data.extend((x as i32).to_le_bytes()),
                other => return Err(Error::Input(format!("cannot make a {other} tensor of numbers"))),
            }
        }
        Tensor::new(dtype, shape, data.into())
    }

    /// The elements of a string tensor, as bytes. Errors: another dtype (a string tensor's
    /// bytes were checked when it was made).
    pub fn strings(&self) -> Result<Vec<&[u8]>, Error> {
        match self.dtype {
            DType::String => strings::decode(&self.data, self.numel()).map_err(|e| Error::Input(e.to_string())),
            other => Err(Error::Input(format!("{other} values are not strings"))),
        }
    }

    /// A string tensor of `shape` holding `elements` in row-major order. Errors: a count other
    /// than the shape's, or more than 4 GiB of text.
    pub fn from_strings<S: AsRef<[u8]>>(shape: Vec<usize>, elements: &[S]) -> Result<Tensor, Error> {
        let data = strings::encode(elements).map_err(|e| Error::Input(format!("strings: {e}")))?;
        Tensor::new(DType::String, shape, data.into())
    }

    /// The elements of an int64 tensor. Errors: another dtype.
    pub fn to_i64(&self) -> Result<Vec<i64>, Error> {
        match self.dtype {
            DType::I64 => {
                Ok(self.data.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap_or_default())).collect())
            }
            other => Err(Error::Input(format!("{other} values are not int64"))),
        }
    }

    /// Shape as the ABI's `i64` dims.
    pub fn dims_i64(&self) -> Vec<i64> {
        self.shape.iter().map(|&d| d as i64).collect()
    }
}

/// Bytes of a `dtype` tensor of `shape` (packed dtypes: [`DType::storage_bytes`]), refusing
/// string tensors and sizes that overflow.
pub fn byte_size(dtype: DType, shape: &[usize]) -> Result<u64, Error> {
    if dtype.bits().is_none() {
        return Err(Error::Unsupported(format!("{dtype} tensors are not supported")));
    }
    shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
        .and_then(|numel| dtype.storage_bytes(numel))
        .ok_or_else(|| Error::Input(format!("a {dtype} tensor of shape {shape:?} is larger than memory can address")))
}

/// The fewest bytes a `dtype` tensor of `shape` takes: [`byte_size`], or for strings their offset
/// table (ABI.md §6; the text's length is known only once the tensor is made).
pub fn least_byte_size(dtype: DType, shape: &[usize]) -> Result<u64, Error> {
    if dtype != DType::String {
        return byte_size(dtype, shape);
    }
    checked_numel(shape)
        .and_then(strings::table_bytes)
        .map(|b| b as u64)
        .ok_or_else(|| Error::Input(format!("a string tensor of shape {shape:?} has too many elements")))
}

/// The number of elements of `shape`, or `None` when it overflows `usize`.
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}
