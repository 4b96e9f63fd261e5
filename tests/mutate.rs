//! Seeded mutations of what kiln's loaders read, for the hostile-input tests
//! (`tests/mutation.rs`): bytes (bit flips, interesting bytes, truncation, inserted, repeated
//! and deleted runs, an overlong varint), ONNX structure (a `TensorProto`'s dims, data type,
//! data lengths, integer values and external data; attributes; declared types; opsets), `.npy`
//! headers, and the values of TOML and JSON text. Every function draws only from the [`Rng`]
//! it is given, so a mutant is reproduced by its seed.

use onnx_protobuf::{attribute_proto::AttributeType, tensor_proto::DataLocation, type_proto};
use onnx_protobuf::{ModelProto, StringStringEntryProto, TensorProto};
use protobuf::EnumOrUnknown;

use crate::Rng;

/// Dimensions and integers that probe size arithmetic: empty, negative, 2^31, 2^32, 2^40,
/// past `usize` products, the extremes.
pub const HUGE: &[i64] = &[0, 1, -1, 1 << 31, 1 << 32, 1 << 35, 1 << 40, 1 << 62, i64::MAX, i64::MIN];

/// External-data locations, relative to a folder that [`external_folder`] fills: a good file,
/// an empty name, the folder itself, escapes, a device, a directory, a link to a device, a
/// FIFO, a file that does not exist.
pub const LOCATIONS: &[&str] =
    &["w.bin", "", ".", "./", "..", "../w.bin", "/etc/passwd", "/dev/zero", "sub", "zero", "fifo", "nope.bin"];

/// Fills `dir` with what [`LOCATIONS`] name: `w.bin` (64 bytes), a directory `sub`, and where
/// the platform has them a symbolic link `zero` to `/dev/zero` and a FIFO `fifo` (made by
/// `mkfifo`; opening it would wait for a writer).
pub fn external_folder(dir: &std::path::Path) -> std::io::Result<()> {
    std::fs::write(dir.join("w.bin"), [7u8; 64])?;
    std::fs::create_dir_all(dir.join("sub"))?;
    #[cfg(unix)]
    {
        // Either may be missing on a platform: the mutants then meet a missing file instead.
        let _ = std::os::unix::fs::symlink("/dev/zero", dir.join("zero"));
        let _ = std::process::Command::new("mkfifo").arg(dir.join("fifo")).status();
    }
    Ok(())
}

/// One byte-level mutation of `b`.
pub fn bytes(rng: &mut Rng, b: &mut Vec<u8>) {
    let at = |rng: &mut Rng, len: usize| rng.below(len.max(1));
    match rng.below(8) {
        0 if !b.is_empty() => {
            let i = at(rng, b.len());
            b[i] ^= 1 << rng.below(8);
        }
        1 if !b.is_empty() => {
            let i = at(rng, b.len());
            b[i] = rng.pick(&[0, 1, 0x7f, 0x80, 0xff]);
        }
        2 => {
            let cut = at(rng, b.len());
            b.truncate(cut);
        }
        3 => {
            let i = rng.range(0, b.len());
            let run: Vec<u8> = (0..rng.range(1, 8)).map(|_| rng.next_u64() as u8).collect();
            b.splice(i..i, run);
        }
        4 if !b.is_empty() => {
            // A run repeated in place (a field twice, a length that now overshoots).
            let i = at(rng, b.len());
            let end = (i + rng.range(1, 32)).min(b.len());
            let run = b[i..end].to_vec();
            b.splice(i..i, run);
        }
        5 if !b.is_empty() => {
            let i = at(rng, b.len());
            let end = (i + rng.range(1, 16)).min(b.len());
            b.drain(i..end);
        }
        6 => {
            // An overlong varint: a length or value of 2^63 and beyond.
            let i = rng.range(0, b.len());
            b.splice(i..i, [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]);
        }
        _ => {
            let i = rng.range(0, b.len());
            b.insert(i, rng.next_u64() as u8);
        }
    }
}

/// One structural mutation of a tensor: its dims, data type, data (lengths, its bytes moved
/// into its type's typed field with a wrong length, and for integers values that a shape input
/// turns into sizes), or its data moved to a [`LOCATIONS`] file.
pub fn tensor(rng: &mut Rng, t: &mut TensorProto) {
    match rng.below(10) {
        0 if !t.dims.is_empty() => {
            let i = rng.below(t.dims.len());
            t.dims[i] = rng.pick(HUGE);
        }
        1 => t.dims.push(rng.pick(HUGE)),
        2 => {
            t.dims.pop();
        }
        3 => t.data_type = rng.int(-1, 30) as i32,
        4 => {
            let keep = rng.range(0, t.raw_data.len());
            t.raw_data.truncate(keep);
            t.float_data.truncate(rng.range(0, t.float_data.len()));
            t.int64_data.truncate(rng.range(0, t.int64_data.len()));
            t.int32_data.truncate(rng.range(0, t.int32_data.len()));
        }
        5 => {
            let extra = rng.range(1, 16);
            t.raw_data.extend((0..extra).map(|_| rng.next_u64() as u8));
        }
        6 => integer_value(rng, t),
        8 => typed(rng, t),
        7 => {
            t.raw_data.clear();
            t.float_data.clear();
            t.int64_data.clear();
            t.int32_data.clear();
            t.double_data.clear();
            t.uint64_data.clear();
        }
        _ => external(rng, t),
    }
}

/// Moves `raw_data` into the typed field of the tensor's data type (ONNX's `TensorProto`:
/// `float_data` for float, `double_data` for double, `int64_data` for int64, `uint64_data` for
/// uint32 and uint64, `int32_data` one element per value for the rest), with elements dropped
/// or zeros added, so that every typed field's size check meets short and long data.
fn typed(rng: &mut Rng, t: &mut TensorProto) {
    fn words<const N: usize>(raw: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
        raw.chunks_exact(N).map(|c| c.try_into().unwrap_or([0; N]))
    }
    fn resize<T: Default + Clone>(rng: &mut Rng, v: &mut Vec<T>) {
        let n = if rng.coin() { rng.range(0, v.len()) } else { v.len() + rng.range(1, 3) };
        v.resize(n, T::default());
    }
    let raw = std::mem::take(&mut t.raw_data);
    match t.data_type {
        1 => {
            t.float_data = words::<4>(&raw).map(f32::from_le_bytes).collect();
            resize(rng, &mut t.float_data);
        }
        11 => {
            t.double_data = words::<8>(&raw).map(f64::from_le_bytes).collect();
            resize(rng, &mut t.double_data);
        }
        7 => {
            t.int64_data = words::<8>(&raw).map(i64::from_le_bytes).collect();
            resize(rng, &mut t.int64_data);
        }
        12 => {
            t.uint64_data = words::<4>(&raw).map(|w| u32::from_le_bytes(w) as u64).collect();
            resize(rng, &mut t.uint64_data);
        }
        13 => {
            t.uint64_data = words::<8>(&raw).map(u64::from_le_bytes).collect();
            resize(rng, &mut t.uint64_data);
        }
        2 | 3 | 9 => {
            t.int32_data = raw.iter().map(|&b| b as i32).collect();
            resize(rng, &mut t.int32_data);
        }
        4 | 5 | 10 | 16 => {
            t.int32_data = words::<2>(&raw).map(|w| u16::from_le_bytes(w) as i32).collect();
            resize(rng, &mut t.int32_data);
        }
        6 => {
            t.int32_data = words::<4>(&raw).map(i32::from_le_bytes).collect();
            resize(rng, &mut t.int32_data);
        }
        _ => t.raw_data = raw,
    }
}

/// Sets one int64 element (in `raw_data` or `int64_data`) to a [`HUGE`] value: the shape input
/// of Reshape, Expand or ConstantOfShape, Tile's repeats, Range's limits.
fn integer_value(rng: &mut Rng, t: &mut TensorProto) {
    let v = rng.pick(HUGE);
    if !t.int64_data.is_empty() {
        let i = rng.below(t.int64_data.len());
        t.int64_data[i] = v;
    } else if t.raw_data.len() >= 8 {
        let i = rng.below(t.raw_data.len() / 8) * 8;
        t.raw_data[i..i + 8].copy_from_slice(&v.to_le_bytes());
    } else {
        t.int64_data.push(v);
    }
}

/// Moves the tensor's data to a [`LOCATIONS`] file, with an offset and length that may be
/// absent, past the end or not numbers.
fn external(rng: &mut Rng, t: &mut TensorProto) {
    let entry = |k: &str, v: String| StringStringEntryProto { key: k.into(), value: v, ..Default::default() };
    t.data_location = EnumOrUnknown::new(DataLocation::EXTERNAL);
    t.external_data = vec![entry("location", rng.pick(LOCATIONS).to_string())];
    for key in ["offset", "length"] {
        match rng.below(4) {
            0 => {}
            1 => t.external_data.push(entry(key, rng.range(0, 80).to_string())),
            2 => t.external_data.push(entry(key, rng.pick(HUGE).to_string())),
            _ => t.external_data.push(entry(key, "x".into())),
        }
    }
}

/// One structural mutation of a model: a tensor of it (initializer or attribute), an
/// attribute's value or type, a node's wiring, a declared type, or an opset.
pub fn model(rng: &mut Rng, m: &mut ModelProto) {
    let Some(g) = m.graph.as_mut() else {
        m.ir_version = rng.pick(HUGE);
        return;
    };
    match rng.below(6) {
        0 | 1 => {
            let mut tensors: Vec<&mut TensorProto> = g.initializer.iter_mut().collect();
            for n in g.node.iter_mut() {
                tensors.extend(n.attribute.iter_mut().filter_map(|a| a.t.as_mut()));
            }
            if tensors.is_empty() {
                return;
            }
            let i = rng.below(tensors.len());
            tensor(rng, tensors[i]);
        }
        2 => {
            let mut attrs: Vec<_> = g.node.iter_mut().flat_map(|n| n.attribute.iter_mut()).collect();
            if attrs.is_empty() {
                return;
            }
            let i = rng.below(attrs.len());
            let a = &mut attrs[i];
            match rng.below(4) {
                0 => a.i = rng.pick(HUGE),
                1 if !a.ints.is_empty() => {
                    let j = rng.below(a.ints.len());
                    a.ints[j] = rng.pick(HUGE);
                }
                2 => a.f = rng.pick(&[f32::NAN, f32::INFINITY, -0.0, 1e38]),
                _ => {
                    let types = [AttributeType::INT, AttributeType::INTS, AttributeType::TENSOR, AttributeType::GRAPH];
                    a.type_ = EnumOrUnknown::new(rng.pick(&types));
                }
            }
        }
        3 => {
            if g.node.is_empty() {
                return;
            }
            let i = rng.below(g.node.len());
            let n = &mut g.node[i];
            match rng.below(3) {
                0 if !n.input.is_empty() => {
                    let j = rng.below(n.input.len());
                    n.input[j] = rng.pick(&["", "missing"]).to_string();
                }
                1 if !n.input.is_empty() => {
                    n.input.pop();
                }
                _ => n.input.push(n.output.first().cloned().unwrap_or_default()),
            }
        }
        4 => {
            let mut decls: Vec<_> = g.input.iter_mut().chain(g.output.iter_mut()).collect();
            if decls.is_empty() {
                return;
            }
            let i = rng.below(decls.len());
            if let Some(type_proto::Value::TensorType(t)) = decls[i].type_.as_mut().and_then(|t| t.value.as_mut()) {
                match t.shape.as_mut() {
                    Some(s) if !s.dim.is_empty() && rng.coin() => {
                        let j = rng.below(s.dim.len());
                        s.dim[j].set_dim_value(rng.pick(HUGE));
                    }
                    _ => t.elem_type = rng.int(-1, 30) as i32,
                }
            }
        }
        _ => {
            if let Some(o) = m.opset_import.first_mut() {
                o.version = rng.pick(&[0, 1, 7, 13, 99, i64::MAX]);
            }
        }
    }
}

/// One mutation of a `.npy` file: its header's shape, dtype or length field, or its bytes.
pub fn npy(rng: &mut Rng, b: &mut Vec<u8>) {
    let header_end = b.iter().position(|&c| c == b'\n').unwrap_or(b.len());
    let Some(header) = b.get(10..header_end).and_then(|h| std::str::from_utf8(h).ok()) else {
        return bytes(rng, b);
    };
    let new = match rng.below(4) {
        0 => header.find("'shape': (").map(|at| {
            let dims: Vec<String> = (0..rng.range(1, 3)).map(|_| rng.pick(HUGE).to_string()).collect();
            let close = header[at..].find(')').map_or(header.len(), |c| at + c);
            format!("{}'shape': ({},{}", &header[..at], dims.join(", "), &header[close..])
        }),
        1 => header.find("'descr': '").map(|at| {
            let descr = rng.pick(&["", "<", "é4", ">f4", "<U8", "|O", "<f4"]);
            let close = header[at + 10..].find('\'').map_or(header.len(), |c| at + 10 + c);
            format!("{}'descr': '{descr}{}", &header[..at], &header[close..])
        }),
        2 => {
            // The header length field (bytes 8 and 9) past the file, or zero.
            let v = rng.pick(&[0u16, 1, 0x7fff, 0xffff]);
            b[8..10].copy_from_slice(&v.to_le_bytes());
            None
        }
        _ => {
            bytes(rng, b);
            None
        }
    };
    if let Some(h) = new {
        // The length field counts the header and its newline (format version 1).
        let len = u16::try_from(h.len() + 1).unwrap_or(u16::MAX);
        b.splice(10..header_end, h.into_bytes());
        b[8..10].copy_from_slice(&len.to_le_bytes());
    }
}

/// One mutation of TOML or JSON text: a number made huge, negative or fractional, a string
/// made empty, escaping or long, a line deleted, repeated or moved; or a byte-level mutation.
pub fn text(rng: &mut Rng, t: &mut Vec<u8>) {
    let Ok(s) = std::str::from_utf8(t) else { return bytes(rng, t) };
    let spans = |pred: fn(&u8) -> bool| -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut i = 0;
        let b = s.as_bytes();
        while i < b.len() {
            if pred(&b[i]) {
                let start = i;
                while i < b.len() && pred(&b[i]) {
                    i += 1;
                }
                out.push((start, i));
            }
            i += 1;
        }
        out
    };
    let replaced = |(a, z): (usize, usize), with: &str| format!("{}{with}{}", &s[..a], &s[z..]);
    let lines: Vec<&str> = s.split_inclusive('\n').collect();
    let new = match rng.below(5) {
        0 => {
            let numbers = spans(u8::is_ascii_digit);
            (!numbers.is_empty()).then(|| {
                let with = rng.pick(&["0", "-1", "4294967296", "18446744073709551616", "1e309", "0.5", "999999999"]);
                replaced(numbers[rng.below(numbers.len())], with)
            })
        }
        1 => {
            let quoted: Vec<(usize, usize)> = s
                .match_indices('"')
                .map(|(i, _)| i)
                .collect::<Vec<_>>()
                .chunks_exact(2)
                .map(|p| (p[0] + 1, p[1]))
                .collect();
            (!quoted.is_empty()).then(|| {
                let long = "x".repeat(rng.range(65, 5000));
                let with = rng.pick(&["", "../x", "/etc/passwd", "\\u0000", "1.0.0-", "é", long.as_str()]).to_string();
                replaced(quoted[rng.below(quoted.len())], &with)
            })
        }
        2 if lines.len() > 1 => {
            let i = rng.below(lines.len());
            Some(lines.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, l)| *l).collect())
        }
        3 if !lines.is_empty() => {
            let (i, j) = (rng.below(lines.len()), rng.below(lines.len()));
            let mut l = lines.clone();
            l.insert(j, lines[i]);
            Some(l.concat())
        }
        _ => None,
    };
    match new {
        Some(n) => *t = n.into_bytes(),
        None => bytes(rng, t),
    }
}
