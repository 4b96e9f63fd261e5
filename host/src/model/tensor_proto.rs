//! `TensorProto` → [`Tensor`]: typed fields, raw data and external data (memory-mapped).

use std::collections::HashMap;
use std::fs::File;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

use bytes::Bytes;
use kiln_kernel_abi::DType;
use onnx_protobuf::TensorProto;

use crate::tensor::byte_size;
use crate::{Error, Tensor};

use super::MAX_TENSOR_BYTES;

/// Files of external data, memory-mapped once each, relative to the model's folder.
#[derive(Debug, Default)]
pub struct ExternalData {
    base: Option<PathBuf>,
    maps: Mutex<HashMap<PathBuf, Bytes>>,
}

impl ExternalData {
    /// External data resolved against `base` (the model's folder); `None` refuses external data.
    pub fn new(base: Option<PathBuf>) -> Self {
        ExternalData { base, maps: Mutex::default() }
    }

    /// `length` bytes at `offset` of `location`.
    fn slice(&self, tensor: &str, location: &str, offset: u64, length: Option<u64>) -> Result<Bytes, Error> {
        let bad = |m: String| Error::Model(format!("tensor {tensor:?}: external data {location:?}: {m}"));
        let base = self.base.as_ref().ok_or_else(|| bad("the model was not loaded from a file".into()))?;
        let rel = Path::new(location);
        if rel.is_absolute() || rel.components().any(|c| !matches!(c, Component::Normal(_))) {
            return Err(bad("the location must be a relative path inside the model's folder".into()));
        }
        let path = base.join(rel);
        let mut maps = self.maps.lock().unwrap_or_else(|p| p.into_inner());
        let whole = match maps.get(&path) {
            Some(b) => b.clone(),
            None => {
                let file = File::open(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
                // SAFETY: the file is mapped read-only; kiln never writes it, and a model whose
                // data file is changed while it runs is outside what kiln guarantees (as for
                // onnxruntime, which maps it the same way).
                let map =
                    unsafe { memmap2::Mmap::map(&file) }.map_err(|source| Error::Io { path: path.clone(), source })?;
                let b = Bytes::from_owner(map);
                maps.insert(path.clone(), b.clone());
                b
            }
        };
        let len = whole.len() as u64;
        let length = length.unwrap_or(len.saturating_sub(offset));
        match offset.checked_add(length) {
            Some(end) if end <= len => Ok(whole.slice(offset as usize..end as usize)),
            _ => Err(bad(format!("bytes {offset}..+{length} are past the end of the file ({len} bytes)"))),
        }
    }
}

/// Converts a `TensorProto` (ONNX IR: `raw_data`, the typed `*_data` fields, or external data).
pub fn tensor_from_proto(t: &TensorProto, ext: &ExternalData) -> Result<Tensor, Error> {
    let name = &t.name;
    let dtype = DType::from_code(t.data_type).filter(|d| *d != DType::String).ok_or_else(|| {
        Error::Unsupported(format!(
            "tensor {name:?} has data type {} (ONNX TensorProto code), which kiln does not support",
            t.data_type
        ))
    })?;
    let mut shape = Vec::with_capacity(t.dims.len());
    for &d in &t.dims {
        shape
            .push(usize::try_from(d).map_err(|_| Error::Model(format!("tensor {name:?} has negative dimension {d}")))?);
    }
    let nbytes =
        byte_size(dtype, &shape).map_err(|_| Error::Model(format!("tensor {name:?}: shape {shape:?} overflows")))?;
    if nbytes > MAX_TENSOR_BYTES {
        return Err(Error::Model(format!(
            "tensor {name:?}: shape {shape:?} needs {nbytes} bytes, over the limit of {MAX_TENSOR_BYTES}"
        )));
    }
    let numel = shape.iter().product::<usize>();
    let data: Bytes = if t.data_location.value() == 1 || !t.external_data.is_empty() {
        let get = |k: &str| t.external_data.iter().find(|e| e.key == k).map(|e| e.value.as_str());
        let location = get("location")
            .ok_or_else(|| Error::Model(format!("tensor {name:?}: external data without a location")))?;
        let num = |k: &str| -> Result<Option<u64>, Error> {
            get(k)
                .map(|v| {
                    v.parse::<u64>()
                        .map_err(|_| Error::Model(format!("tensor {name:?}: external data {k} {v:?} is not a number")))
                })
                .transpose()
        };
        ext.slice(name, location, num("offset")?.unwrap_or(0), num("length")?)?
    } else if !t.raw_data.is_empty() {
        Bytes::from(t.raw_data.clone())
    } else {
        typed_data(t, dtype, numel)?
    };
    if data.len() as u64 != nbytes {
        return Err(Error::Model(format!(
            "tensor {name:?}: {dtype} {shape:?} needs {nbytes} bytes of data, the file holds {}",
            data.len()
        )));
    }
    Ok(Tensor { dtype, shape, data })
}

/// The typed fields of `TensorProto` (onnx.proto: which field holds which dtype).
fn typed_data(t: &TensorProto, dtype: DType, numel: usize) -> Result<Bytes, Error> {
    let mut out = Vec::with_capacity(numel * dtype.size().unwrap_or(1));
    let count = match dtype {
        DType::F32 => {
            t.float_data.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
            t.float_data.len()
        }
        DType::F64 => {
            t.double_data.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
            t.double_data.len()
        }
        DType::I64 => {
            t.int64_data.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
            t.int64_data.len()
        }
        DType::U32 | DType::U64 => {
            for v in &t.uint64_data {
                match dtype {
                    DType::U32 => out.extend_from_slice(&(*v as u32).to_le_bytes()),
                    _ => out.extend_from_slice(&v.to_le_bytes()),
                }
            }
            t.uint64_data.len()
        }
        // int32_data carries every narrower type; f16/bf16 as their 16-bit patterns.
        _ => {
            let size = dtype.size().unwrap_or(4);
            for v in &t.int32_data {
                out.extend_from_slice(&v.to_le_bytes()[..size]);
            }
            t.int32_data.len()
        }
    };
    if count != numel {
        return Err(Error::Model(format!("tensor {:?}: {numel} elements expected, {count} given", t.name)));
    }
    Ok(Bytes::from(out))
}
