//! Tensor files: NumPy `.npy` (read and write) and ONNX `TensorProto` `.pb` (read), as the
//! CLI takes inputs and ONNX's test data stores them; and ONNX's `SequenceProto` and
//! `OptionalProto` `.pb` values (read).

use std::io::Write;
use std::path::Path;

use bytes::Bytes;
use kiln_kernel_abi::{minifloat, DType};
use onnx_protobuf::{Message, TensorProto};

use crate::model::{tensor_from_proto, ExternalData, Kind};
use crate::{Error, HostValue, Tensor};

/// Reads a `.npy` (C order) or a `.pb` (`TensorProto`) file, by extension; returns the
/// tensor and, for `.pb`, the name stored in it (may be empty).
pub fn read_tensor_file(path: &Path) -> Result<(Tensor, String), Error> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    let ctx = |e: Error| Error::Input(format!("{}: {e}", path.display()));
    match path.extension().and_then(|e| e.to_str()) {
        Some("npy") => read_npy(&bytes).map(|t| (t, String::new())).map_err(ctx),
        Some("pb") => read_pb(&bytes).map_err(ctx),
        _ => Err(Error::Input(format!("{}: tensor files must end in .npy or .pb", path.display()))),
    }
}

/// Parses a serialized `TensorProto`; external data is refused (a tensor file stands alone).
/// Errors: [`Error::Input`] for bytes that are not a `TensorProto` or a tensor whose data does
/// not match its declared shape (checked before its size is allocated);
/// [`Error::Unsupported`] for a data type kiln does not run.
pub fn read_pb(bytes: &[u8]) -> Result<(Tensor, String), Error> {
    let t = TensorProto::parse_from_bytes(bytes).map_err(|e| Error::Input(format!("not a TensorProto: {e}")))?;
    let tensor =
        tensor_from_proto(&t, &format!("tensor {:?}", t.name), &ExternalData::new(None)).map_err(|e| match e {
            Error::Model(m) => Error::Input(m),
            other => other,
        })?;
    Ok((tensor, t.name.clone()))
}

/// Reads a `.pb` file holding a value of `kind`: a `TensorProto`, or ONNX's `SequenceProto`
/// (of tensors) or `OptionalProto` (onnx-data.proto), as ONNX's test data stores them.
pub fn read_value_file(path: &Path, kind: &Kind) -> Result<HostValue, Error> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    read_value_pb(&bytes, kind).map_err(|e| e.context(&format!("{}: ", path.display())))
}

/// Parses a serialized value of `kind` (see [`read_value_file`]).
pub fn read_value_pb(bytes: &[u8], kind: &Kind) -> Result<HostValue, Error> {
    match kind {
        Kind::Tensor => Ok(HostValue::Tensor(read_pb(bytes)?.0)),
        Kind::Sequence => read_sequence(bytes).map(HostValue::Sequence),
        Kind::Optional(_) => read_optional(bytes),
    }
}

/// One field of a message: its number, and its bytes when length-delimited (`None` for other
/// wire types, whose values are skipped).
type Field = (u32, Option<Vec<u8>>);

/// The fields of a message, in order.
fn fields(bytes: &[u8], what: &str) -> Result<Vec<Field>, Error> {
    use protobuf::rt::WireType;
    let bad = |e: protobuf::Error| Error::Input(format!("not a {what}: {e}"));
    let mut is = protobuf::CodedInputStream::from_bytes(bytes);
    let mut out = Vec::new();
    while let Some(tag) = is.read_raw_tag_or_eof().map_err(bad)? {
        let (field, wire) = (tag >> 3, WireType::new(tag & 7));
        match wire {
            Some(WireType::LengthDelimited) => out.push((field, Some(is.read_bytes().map_err(bad)?))),
            Some(w) => {
                is.skip_field(w).map_err(bad)?;
                out.push((field, None));
            }
            None => return Err(Error::Input(format!("not a {what}: wire type {}", tag & 7))),
        }
    }
    Ok(out)
}

/// A `SequenceProto` of tensors (field 3, `tensor_values`).
fn read_sequence(bytes: &[u8]) -> Result<Vec<Tensor>, Error> {
    let mut seq = Vec::new();
    for (field, data) in fields(bytes, "SequenceProto")? {
        match (field, data) {
            (3, Some(t)) => seq.push(read_pb(&t)?.0),
            (4..=7, _) => {
                return Err(Error::Unsupported("a sequence of sparse tensors, sequences, maps or optionals".into()))
            }
            _ => {}
        }
    }
    Ok(seq)
}

/// An `OptionalProto`: a tensor (field 3), a sequence (field 5), or neither (empty).
fn read_optional(bytes: &[u8]) -> Result<HostValue, Error> {
    let mut value = None;
    for (field, data) in fields(bytes, "OptionalProto")? {
        match (field, data) {
            (3, Some(t)) => value = Some(HostValue::Tensor(read_pb(&t)?.0)),
            (5, Some(s)) => value = Some(HostValue::Sequence(read_sequence(&s)?)),
            (4 | 6 | 7, _) => return Err(Error::Unsupported("an optional of a sparse tensor, map or optional".into())),
            _ => {}
        }
    }
    Ok(HostValue::Optional(value.map(Box::new)))
}

/// NumPy's type codes of the dtypes `.npy` files hold as they are (little-endian; `<`, `|` or
/// `=` before them).
const NPY_CODES: [(&str, DType); 12] = [
    ("f2", DType::F16),
    ("f4", DType::F32),
    ("f8", DType::F64),
    ("i1", DType::I8),
    ("i2", DType::I16),
    ("i4", DType::I32),
    ("i8", DType::I64),
    ("u1", DType::U8),
    ("u2", DType::U16),
    ("u4", DType::U32),
    ("u8", DType::U64),
    ("b1", DType::Bool),
];

fn npy_dtype(descr: &str) -> Option<DType> {
    let (order, code) = descr.split_at_checked(1)?;
    if !matches!(order, "<" | "|" | "=") {
        return None;
    }
    NPY_CODES.iter().find(|(c, _)| *c == code).map(|(_, d)| *d)
}

/// A `.npy` array of NumPy's fixed-width unicode (`<U`width: UTF-32 code points, each element
/// padded with zeros) as a string tensor, each element's trailing zeros dropped, as NumPy does.
fn read_npy_unicode(data: &[u8], width: &str, shape: Vec<usize>) -> Result<Tensor, Error> {
    let width: usize = width.parse().map_err(|_| Error::Input(format!("not a valid .npy file: dtype <U{width}")))?;
    let numel = crate::tensor::checked_numel(&shape);
    let need = numel.and_then(|n| n.checked_mul(width)).and_then(|c| c.checked_mul(4));
    let Some(need) = need.filter(|n| *n <= data.len()) else {
        return Err(Error::Input(format!(
            "the file holds {} data bytes, too few for shape {shape:?} of <U{width}",
            data.len()
        )));
    };
    let element = |e: &[u8]| -> Result<String, Error> {
        let mut s = String::with_capacity(e.len() / 4);
        for c in e.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])) {
            s.push(char::from_u32(c).ok_or_else(|| {
                Error::Input(format!("not a valid .npy file: {c:#x} is not a code point (in a <U array)"))
            })?);
        }
        Ok(s.trim_end_matches('\0').to_string())
    };
    // Each element costs its offset (4 bytes) even when the file holds none of its text.
    let numel = numel.filter(|n| (*n as u64).saturating_mul(4) <= crate::model::MAX_TENSOR_BYTES);
    let Some(numel) = numel else {
        return Err(Error::Input(format!("a string tensor of shape {shape:?} is over the tensor size limit")));
    };
    let elements: Vec<String> = match width {
        0 => vec![String::new(); numel],
        w => data[..need].chunks_exact(4 * w).map(element).collect::<Result<_, _>>()?,
    };
    Tensor::from_strings(shape, &elements)
}

/// Parses a `.npy` file (format versions 1–3, little-endian, C order; NumPy's
/// `numpy/lib/format.py` describes the format).
pub fn read_npy(bytes: &[u8]) -> Result<Tensor, Error> {
    let bad = |m: &str| Error::Input(format!("not a valid .npy file: {m}"));
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(bad("no \\x93NUMPY magic"));
    }
    let (len, start): (usize, usize) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        v => return Err(bad(&format!("format version {v} is not supported"))),
    };
    let header = bytes.get(start..start.saturating_add(len)).ok_or_else(|| bad("the header is truncated"))?;
    let header = std::str::from_utf8(header).map_err(|_| bad("the header is not text"))?;
    let descr = dict_value(header, "descr").ok_or_else(|| bad("no 'descr' in the header"))?;
    let descr = descr.trim_matches(|c| c == '\'' || c == '"');
    match dict_value(header, "fortran_order") {
        Some("False") => {}
        Some("True") => {
            return Err(Error::Input("Fortran-order arrays are not supported; save with np.ascontiguousarray".into()))
        }
        _ => return Err(bad("no 'fortran_order' in the header")),
    }
    let shape_text = dict_value(header, "shape").ok_or_else(|| bad("no 'shape' in the header"))?;
    let inner =
        shape_text.strip_prefix('(').and_then(|t| t.strip_suffix(')')).ok_or_else(|| bad("'shape' is not a tuple"))?;
    let shape = inner
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| d.parse::<usize>().map_err(|_| bad(&format!("dimension {d:?} is not a number"))))
        .collect::<Result<Vec<usize>, Error>>()?;
    if let Some(width) = descr.strip_prefix("<U") {
        return read_npy_unicode(&bytes[start + len..], width, shape);
    }
    let dtype = npy_dtype(descr).ok_or_else(|| {
        Error::Input(format!("dtype {descr:?} is not supported (little-endian numbers, bools and unicode strings)"))
    })?;
    let need = crate::tensor::byte_size(dtype, &shape)?;
    let data = &bytes[start + len..];
    if (data.len() as u64) < need {
        return Err(Error::Input(format!(
            "the file holds {} data bytes, shape {shape:?} of {dtype} needs {need}",
            data.len()
        )));
    }
    Tensor::new(dtype, shape, Bytes::copy_from_slice(&data[..need as usize]))
}

/// The text of `key`'s value in a `.npy` header dict: a quoted string, a word, or a tuple.
fn dict_value<'h>(header: &'h str, key: &str) -> Option<&'h str> {
    let at = header.find(&format!("'{key}'")).or_else(|| header.find(&format!("\"{key}\"")))?;
    let rest = header[at + key.len() + 2..].trim_start().strip_prefix(':')?.trim_start();
    let end = match rest.chars().next()? {
        '(' => rest.find(')')? + 1,
        q @ ('\'' | '"') => rest[1..].find(q)? + 2,
        _ => rest.find([',', '}']).unwrap_or(rest.len()),
    };
    Some(rest[..end].trim())
}

/// Writes `t` as a version-1 `.npy`. bfloat16, float8 and float4 (which NumPy lacks) are written
/// as float32, int4/int2 as int8 and uint4/uint2 as uint8, their values exact; strings as NumPy's
/// fixed-width unicode (`<U`n, UTF-8 that does not decode replaced by U+FFFD).
pub fn write_npy(path: &Path, t: &Tensor) -> Result<(), Error> {
    let io = |source| Error::Io { path: path.to_path_buf(), source };
    let (descr, data): (std::borrow::Cow<str>, std::borrow::Cow<[u8]>) = match t.dtype {
        DType::BF16 => {
            let widened: Vec<u8> = t
                .data
                .chunks_exact(2)
                .flat_map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16).to_le_bytes())
                .collect();
            ("<f4".into(), widened.into())
        }
        d if NPY_CODES.iter().any(|(_, n)| *n == d) => {
            let code = NPY_CODES.iter().find(|(_, n)| *n == d).map_or("", |(c, _)| c);
            let order = if d.size() == Some(1) { "|" } else { "<" };
            (format!("{order}{code}").into(), (&t.data[..]).into())
        }
        // NumPy's fixed-width unicode: UTF-32 code points, each element padded to the longest.
        DType::String => {
            let elements: Vec<Vec<char>> =
                t.strings()?.iter().map(|s| String::from_utf8_lossy(s).chars().collect()).collect();
            let width = elements.iter().map(Vec::len).max().unwrap_or(0).max(1);
            // Every element padded to the longest: refused where that is past the tensor limit.
            let size = elements.len().checked_mul(width).and_then(|c| c.checked_mul(4));
            let Some(size) = size.filter(|s| *s as u64 <= crate::model::MAX_TENSOR_BYTES) else {
                return Err(Error::Unsupported(format!(
                    "writing {} strings padded to {width} characters as .npy: over the tensor size limit",
                    elements.len()
                )));
            };
            let mut data = Vec::with_capacity(size);
            for e in &elements {
                for i in 0..width {
                    data.extend((e.get(i).map_or(0, |c| *c as u32)).to_le_bytes());
                }
            }
            (format!("<U{width}").into(), data.into())
        }
        // NumPy has no float8, float4, 4-bit or 2-bit dtype: their values, widened exactly.
        d if d.is_minifloat() => {
            let n = t.numel();
            let values = (0..n).flat_map(|i| minifloat::to_f32(d, minifloat::packed_get(d, &t.data, i)).to_le_bytes());
            ("<f4".into(), values.collect::<Vec<u8>>().into())
        }
        d => {
            let n = t.numel();
            let values = (0..n).map(|i| minifloat::narrow_int_value(d, minifloat::packed_get(d, &t.data, i)) as u8);
            (if matches!(d, DType::I4 | DType::I2) { "|i1" } else { "|u1" }.into(), values.collect::<Vec<u8>>().into())
        }
    };
    let shape = match t.shape.len() {
        1 => format!("({},)", t.shape[0]),
        _ => format!("({})", t.shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    // Magic (6) + version (2) + length (2) + header + '\n' is a multiple of 64.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut f = std::fs::File::create(path).map_err(io)?;
    f.write_all(b"\x93NUMPY\x01\x00").map_err(io)?;
    f.write_all(&(header.len() as u16).to_le_bytes()).map_err(io)?;
    f.write_all(header.as_bytes()).map_err(io)?;
    f.write_all(&data).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_round_trips_and_bad_files_are_errors() {
        let d = tempfile::tempdir().unwrap();
        let t = Tensor::new(
            DType::I64,
            vec![2, 1],
            Bytes::from([1i64, -2].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>()),
        )
        .unwrap();
        let p = d.path().join("x.npy");
        write_npy(&p, &t).unwrap();
        assert_eq!(read_tensor_file(&p).unwrap().0, t);
        let bytes = std::fs::read(&p).unwrap();
        for cut in [0, 5, 20, bytes.len() - 1] {
            assert!(read_npy(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        assert!(read_tensor_file(&d.path().join("x.txt")).is_err());
    }

    /// Strings go to NumPy's `<U` and come back; a `<U` file NumPy wrote (`np.save` of
    /// `np.array(["ab", "的"])`: width 2) reads; a huge shape of empty strings is refused.
    #[test]
    fn string_tensors_round_trip_through_npy_unicode() {
        let d = tempfile::tempdir().unwrap();
        let t = Tensor::from_strings(vec![3], &["abc", "", "的x"]).unwrap();
        let p = d.path().join("s.npy");
        write_npy(&p, &t).unwrap();
        assert_eq!(read_tensor_file(&p).unwrap().0, t);
        let text: Vec<u8> = ['a', 'b', '的', '\0'].iter().flat_map(|c| (*c as u32).to_le_bytes()).collect();
        let numpy = npy("{'descr': '<U2', 'fortran_order': False, 'shape': (2,), }", &text);
        assert_eq!(read_npy(&numpy).unwrap().strings().unwrap(), [&b"ab"[..], "的".as_bytes()]);
        let huge = npy("{'descr': '<U0', 'fortran_order': False, 'shape': (1000000000000,), }", &[]);
        assert!(read_npy(&huge).unwrap_err().to_string().contains("over the tensor size limit"));
        let short = npy("{'descr': '<U2', 'fortran_order': False, 'shape': (3,), }", &text);
        assert!(read_npy(&short).is_err());
    }

    fn npy(header: &str, data: &[u8]) -> Vec<u8> {
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        b.extend_from_slice(&(header.len() as u16).to_le_bytes());
        b.extend_from_slice(header.as_bytes());
        b.extend_from_slice(data);
        b
    }

    #[test]
    fn hostile_npy_headers_are_errors() {
        let ok = npy("{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }", &[1, 0, 0, 0, 2, 0, 0, 0]);
        assert_eq!(read_npy(&ok).unwrap().shape, vec![2]);
        let scalar = npy("{'descr': '<f8', 'fortran_order': False, 'shape': (), }", &1.5f64.to_le_bytes());
        assert_eq!(read_npy(&scalar).unwrap().shape, Vec::<usize>::new());
        for (header, needle) in [
            ("{'descr': '<f4', 'fortran_order': False, 'shape': (100000000000, 100000000000), }", "larger than memory"),
            ("{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }", "not a number"),
            ("{'descr': '>f4', 'fortran_order': False, 'shape': (1,), }", "not supported"),
            ("{'descr': '<f4', 'fortran_order': True, 'shape': (1,), }", "Fortran"),
            ("{'descr': '<f4', 'shape': (1,), }", "fortran_order"),
            ("{'descr': '<f4', 'fortran_order': False, 'shape': (4,), }", "needs 16"),
            ("{'descr': '<f4', 'fortran_order': False, 'shape': 4, }", "not a tuple"),
        ] {
            let e = read_npy(&npy(header, &[0; 4])).unwrap_err().to_string();
            assert!(e.contains(needle), "{header}: {e}");
        }
        // An empty or non-ASCII descr (split at its first byte, this used to panic).
        for descr in ["''", "'\u{e9}4'"] {
            let header = format!("{{'descr': {descr}, 'fortran_order': False, 'shape': (1,), }}");
            let e = read_npy(&npy(&header, &[0; 4])).unwrap_err().to_string();
            assert!(
                e.starts_with("dtype ")
                    && e.ends_with(" is not supported (little-endian numbers, bools and unicode strings)"),
                "{e}"
            );
        }
        let mut long = npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", &[]);
        long[8] = 0xff;
        assert!(read_npy(&long).unwrap_err().to_string().contains("truncated"));
    }

    #[test]
    fn an_11_byte_pb_declaring_8_gib_is_an_input_error_before_allocating() {
        // name "a", float32 [2^31], no data.
        let pb = [0x08, 0x80, 0x80, 0x80, 0x80, 0x08, 0x10, 0x01, 0x42, 0x01, b'a'];
        let e = read_pb(&pb).unwrap_err();
        let Error::Input(m) = &e else { panic!("{e:?}") };
        assert_eq!(
            m,
            "tensor \"a\": float32 [2147483648]: 2147483648 elements expected, float_data holds 0 (no raw_data)"
        );
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("input_0.pb");
        std::fs::write(&p, pb).unwrap();
        let e = read_tensor_file(&p).unwrap_err().to_string();
        assert_eq!(e, format!("{}: {m}", p.display()));
    }

    #[test]
    fn a_pb_naming_external_data_is_refused() {
        let t = TensorProto {
            name: "x".into(),
            data_type: 1,
            dims: vec![1],
            external_data: vec![onnx_protobuf::StringStringEntryProto {
                key: "location".into(),
                value: "x.bin".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let e = read_pb(&t.write_to_bytes().unwrap()).unwrap_err().to_string();
        assert!(e.starts_with("tensor \"x\": external data \"x.bin\": external data is refused"), "{e}");
    }
}
