//! `TensorProto` → [`Tensor`]: typed fields, raw data and external data (memory-mapped).
//!
//! A tensor's declared size is checked against the bytes actually present (`raw_data`, the
//! typed field, the external file's range) before anything of that size is allocated, so a
//! small file declaring a huge shape is an error, never an allocation failure.

use bytes::Bytes;
use kiln_kernel_abi::DType;
use onnx_protobuf::TensorProto;

use crate::tensor::byte_size;
use crate::{Error, Tensor};

use super::{ExternalData, MAX_TENSOR_BYTES};

/// Converts a `TensorProto` (ONNX IR: `raw_data`, the typed `*_data` fields, or external data
/// resolved by `ext`). `what` names the tensor in errors: `initializer "W"`,
/// `node "c": attribute "value"`, `tensor "x"`.
///
/// Errors: [`Error::Unsupported`] for a data type kiln does not run (complex);
/// [`Error::Model`] for a negative dimension, a shape whose size overflows or is over
/// [`MAX_TENSOR_BYTES`], data whose size differs from the shape's, and bad external data
/// (see [`ExternalData::slice`]); [`Error::Io`] for an external file that cannot be read.
pub fn tensor_from_proto(t: &TensorProto, what: &str, ext: &ExternalData) -> Result<Tensor, Error> {
    let bad = |m: String| Error::Model(format!("{what}: {m}"));
    let dtype = DType::from_code(t.data_type).ok_or_else(|| {
        Error::Unsupported(format!(
            "{what} has data type {} (ONNX TensorProto code), which kiln does not support",
            t.data_type
        ))
    })?;
    let mut shape = Vec::with_capacity(t.dims.len());
    for &d in &t.dims {
        shape.push(usize::try_from(d).map_err(|_| bad(format!("negative dimension {d}")))?);
    }
    if dtype == DType::String {
        return string_tensor(t, what, shape);
    }
    let nbytes = byte_size(dtype, &shape).map_err(|_| bad(format!("shape {shape:?} overflows")))?;
    if nbytes > MAX_TENSOR_BYTES {
        return Err(bad(format!("shape {shape:?} needs {nbytes} bytes, over the limit of {MAX_TENSOR_BYTES}")));
    }
    let data: Bytes = if t.data_location.value() == 1 || !t.external_data.is_empty() {
        let get = |k: &str| t.external_data.iter().find(|e| e.key == k).map(|e| e.value.as_str());
        let location = get("location").ok_or_else(|| bad("external data without a location".into()))?;
        let num = |k: &str| -> Result<Option<u64>, Error> {
            get(k)
                .map(|v| v.parse::<u64>().map_err(|_| bad(format!("external data {k} {v:?} is not a number"))))
                .transpose()
        };
        ext.slice(what, location, num("offset")?.unwrap_or(0), num("length")?)?
    } else if !t.raw_data.is_empty() {
        if t.raw_data.len() as u64 != nbytes {
            return Err(size_mismatch(what, dtype, &shape, nbytes, t.raw_data.len(), "raw_data"));
        }
        Bytes::from(t.raw_data.clone())
    } else {
        typed_data(t, what, dtype, &shape)?
    };
    if data.len() as u64 != nbytes {
        return Err(size_mismatch(what, dtype, &shape, nbytes, data.len(), "the external data"));
    }
    Ok(Tensor { dtype, shape, data })
}

/// A string tensor from `string_data` (its elements as bytes; onnx.proto keeps strings nowhere
/// else), counted against the shape before anything is allocated.
fn string_tensor(t: &TensorProto, what: &str, shape: Vec<usize>) -> Result<Tensor, Error> {
    let bad = |m: String| Error::Model(format!("{what}: {m}"));
    let numel = crate::tensor::checked_numel(&shape);
    if numel != Some(t.string_data.len()) {
        return Err(bad(format!(
            "string {shape:?}: {} elements expected, string_data holds {}",
            numel.map_or("too many".to_string(), |n| n.to_string()),
            t.string_data.len()
        )));
    }
    if t.data_location.value() == 1 || !t.raw_data.is_empty() {
        return Err(bad("string tensors keep their elements in string_data, not raw or external data".into()));
    }
    let text: u64 = t.string_data.iter().map(|s| s.len() as u64).sum();
    if text + 4 * (t.string_data.len() as u64 + 1) > MAX_TENSOR_BYTES {
        return Err(bad(format!("{text} bytes of strings are over the limit of {MAX_TENSOR_BYTES}")));
    }
    Tensor::from_strings(shape, &t.string_data).map_err(|e| bad(e.to_string()))
}

fn size_mismatch(what: &str, dtype: DType, shape: &[usize], nbytes: u64, held: usize, source: &str) -> Error {
    Error::Model(format!("{what}: {dtype} {shape:?} needs {nbytes} bytes of data, {source} holds {held}"))
}

/// The typed field of `TensorProto` that holds `dtype`'s values (onnx.proto), and how many it
/// holds.
fn typed_field(t: &TensorProto, dtype: DType) -> (&'static str, usize) {
    match dtype {
        DType::F32 => ("float_data", t.float_data.len()),
        DType::F64 => ("double_data", t.double_data.len()),
        DType::I64 => ("int64_data", t.int64_data.len()),
        DType::U32 | DType::U64 => ("uint64_data", t.uint64_data.len()),
        // int32_data carries every narrower type; f16/bf16 as their 16-bit patterns, the float8
        // types as their 8-bit codes, the packed types a byte per entry.
        _ => ("int32_data", t.int32_data.len()),
    }
}

/// The typed field's values as little-endian bytes. The element count is checked against the
/// shape's before the bytes are allocated, so they are never more than the field holds.
fn typed_data(t: &TensorProto, what: &str, dtype: DType, shape: &[usize]) -> Result<Bytes, Error> {
    let numel: usize = shape.iter().product();
    let (field, count) = typed_field(t, dtype);
    if dtype.is_packed() {
        // onnx.proto: 4-bit and 2-bit elements come packed, one byte of them per int32_data entry.
        let bytes = dtype.storage_bytes(numel as u64).unwrap_or(0) as usize;
        if count != bytes {
            return Err(Error::Model(format!(
                "{what}: {dtype} {shape:?}: {bytes} packed bytes expected, {field} holds {count} (no raw_data)"
            )));
        }
        return Ok(Bytes::from(t.int32_data.iter().map(|v| *v as u8).collect::<Vec<u8>>()));
    }
    if count != numel {
        return Err(Error::Model(format!(
            "{what}: {dtype} {shape:?}: {numel} elements expected, {field} holds {count} (no raw_data)"
        )));
    }
    let size = dtype.size().unwrap_or(1);
    let mut out = Vec::with_capacity(numel * size);
    match dtype {
        DType::F32 => t.float_data.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::F64 => t.double_data.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::I64 => t.int64_data.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DType::U32 => t.uint64_data.iter().for_each(|v| out.extend_from_slice(&(*v as u32).to_le_bytes())),
        DType::U64 => t.uint64_data.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        _ => t.int32_data.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()[..size])),
    }
    Ok(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use onnx_protobuf::{GraphProto, Message, ModelProto, NodeProto, OperatorSetIdProto, ValueInfoProto};
    use protobuf::MessageField;

    use super::*;

    fn model_err(initializer: TensorProto) -> (usize, Error) {
        let m = ModelProto {
            ir_version: 10,
            opset_import: vec![OperatorSetIdProto { version: 21, ..Default::default() }],
            graph: MessageField::some(GraphProto {
                node: vec![NodeProto {
                    op_type: "Relu".into(),
                    input: vec!["x".into()],
                    output: vec!["y".into()],
                    ..Default::default()
                }],
                initializer: vec![initializer],
                output: vec![ValueInfoProto { name: "y".into(), ..Default::default() }],
                ..Default::default()
            }),
            ..Default::default()
        };
        let bytes = m.write_to_bytes().unwrap();
        (bytes.len(), crate::model::load_bytes(&bytes, None).unwrap_err())
    }

    /// Without raw_data, float8 elements come one per int32_data entry and 4-bit ones packed, a
    /// byte of them per entry (onnx.proto); a count that does not match is an error.
    #[test]
    fn float8_and_packed_int4_read_from_int32_data() {
        let ext = ExternalData::default();
        let t = |data_type, dims: Vec<i64>, vals: Vec<i32>| TensorProto {
            name: "x".into(),
            data_type,
            dims,
            int32_data: vals,
            ..Default::default()
        };
        let f8 = tensor_from_proto(&t(17, vec![3], vec![0x38, 0x7E, 0xFF]), "x", &ext).unwrap();
        assert_eq!((f8.dtype, f8.data.to_vec()), (DType::F8E4M3FN, vec![0x38, 0x7E, 0xFF]));
        let i4 = tensor_from_proto(&t(22, vec![3], vec![0x78, 0x0F]), "x", &ext).unwrap();
        assert_eq!((i4.dtype, i4.data.to_vec()), (DType::I4, vec![0x78, 0x0F]));
        let err = tensor_from_proto(&t(22, vec![5], vec![0x78, 0x0F]), "x", &ext).unwrap_err().to_string();
        assert!(err.contains("int4 [5]: 3 packed bytes expected, int32_data holds 2"), "{err}");
    }

    /// String tensors come from string_data, counted against the shape; raw data is refused.
    #[test]
    fn strings_read_from_string_data() {
        let ext = ExternalData::default();
        let t = |dims: Vec<i64>, vals: &[&str]| TensorProto {
            name: "s".into(),
            data_type: 8,
            dims,
            string_data: vals.iter().map(|v| v.as_bytes().to_vec()).collect(),
            ..Default::default()
        };
        let s = tensor_from_proto(&t(vec![2], &["abc", "的"]), "s", &ext).unwrap();
        assert_eq!(s.strings().unwrap(), [&b"abc"[..], "的".as_bytes()]);
        let err = tensor_from_proto(&t(vec![3], &["abc", ""]), "s", &ext).unwrap_err().to_string();
        assert!(err.contains("string [3]: 3 elements expected, string_data holds 2"), "{err}");
        let raw = TensorProto { raw_data: vec![1, 2], ..t(vec![2], &["a", "b"]) };
        assert!(tensor_from_proto(&raw, "s", &ext).unwrap_err().to_string().contains("not raw or external data"));
    }

    #[test]
    fn a_70_byte_model_declaring_2_to_the_40_elements_is_refused_before_allocating() {
        // Bool [2^40] with no data: a terabyte declared by 70 bytes.
        let t = TensorProto {
            name: "x".into(),
            data_type: 9,
            dims: vec![1 << 40],
            doc_string: "2^40 bools and no data here".into(),
            ..Default::default()
        };
        let (len, e) = model_err(t);
        assert_eq!(len, 70);
        let Error::Model(m) = e else { panic!("{e:?}") };
        assert_eq!(
            m,
            "initializer \"x\": shape [1099511627776] needs 1099511627776 bytes, over the limit of 68719476736"
        );
    }

    #[test]
    fn a_shape_under_the_limit_with_no_data_is_refused_before_allocating() {
        // 32 GiB of uint8 declared, none present: this used to abort ("memory allocation of
        // 34359738368 bytes failed") on a machine with less memory.
        let t = TensorProto { name: "x".into(), data_type: 2, dims: vec![1 << 35], ..Default::default() };
        let Error::Model(m) = model_err(t).1 else { panic!() };
        assert_eq!(
            m,
            "initializer \"x\": uint8 [34359738368]: 34359738368 elements expected, int32_data holds 0 (no raw_data)"
        );
        let t = TensorProto {
            name: "x".into(),
            data_type: 1,
            dims: vec![1 << 30],
            raw_data: vec![0; 12],
            ..Default::default()
        };
        let Error::Model(m) = model_err(t).1 else { panic!() };
        assert_eq!(m, "initializer \"x\": float32 [1073741824] needs 4294967296 bytes of data, raw_data holds 12");
    }

    #[test]
    fn typed_fields_become_little_endian_bytes() {
        let t = TensorProto { data_type: 10, dims: vec![2], int32_data: vec![0x3c00, 0xc000], ..Default::default() };
        let got = tensor_from_proto(&t, "tensor \"h\"", &ExternalData::new(None)).unwrap();
        assert_eq!((got.dtype, &got.shape[..], &got.data[..]), (DType::F16, &[2][..], &[0x00, 0x3c, 0x00, 0xc0][..]));
        let t = TensorProto { data_type: 12, dims: vec![1], uint64_data: vec![7], ..Default::default() };
        assert_eq!(&tensor_from_proto(&t, "u", &ExternalData::new(None)).unwrap().data[..], &[7, 0, 0, 0]);
    }
}
