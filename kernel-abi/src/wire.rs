//! Wire encodings of ABI v1 (normative description: `ABI.md`, section "Encodings").
//!
//! Everything is little-endian and unaligned. A `str` is a `u32` byte length followed by UTF-8
//! bytes; a list is a `u32` count followed by its items. Three messages cross the boundary:
//!
//! - [`NodeCall`], host → shim: the node (op, opset, inputs, outputs, attributes) given to
//!   `kiln_infer`, `kiln_dispatch` and `kiln_cpu`.
//! - [`Launch`], shim → host: one kernel launch, argument of the `launch` import.
//! - [`Gemm`], shim → host: one (batched) matrix product, argument of the `gemm` import.
//!
//! Decoding never panics: every malformed message gives a [`WireError`].

use alloc::vec::Vec;
use core::fmt;

use crate::DType;

/// The handle value of an absent tensor (an optional input or output left empty).
pub const NO_HANDLE: u32 = u32::MAX;

/// Why a message could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireError {
    /// The message ended before a field of `what`.
    Truncated(&'static str),
    /// A field held a value outside its domain.
    Invalid(&'static str),
    /// A `str` was not UTF-8.
    Utf8,
    /// Bytes were left over after the message.
    Trailing(usize),
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Truncated(what) => write!(f, "message truncated in {what}"),
            WireError::Invalid(what) => write!(f, "invalid {what}"),
            WireError::Utf8 => f.write_str("string is not UTF-8"),
            WireError::Trailing(n) => write!(f, "{n} trailing bytes after the message"),
        }
    }
}

/// One tensor of a node call: an input or an output.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorDesc<'a> {
    /// Whether the tensor exists (an optional input or output may be absent).
    pub present: bool,
    /// Element type; `None` where not yet known (outputs during `kiln_infer`).
    pub dtype: Option<DType>,
    /// Dimensions; `None` where the rank is unknown (outputs during inference). ABI v1 hosts
    /// send only known dimensions (≥ 0) for present inputs.
    pub dims: Option<Vec<i64>>,
    /// The handle naming this tensor for the duration of the call, or [`NO_HANDLE`].
    pub handle: u32,
    /// The tensor's bytes, where the manifest declares this input a value input (shape-like
    /// inputs such as Reshape's `shape`) and the host knows them.
    pub value: Option<&'a [u8]>,
    /// Where the tensor is paged rather than row-major (flag bit 3): only for the inputs and
    /// outputs the op's manifest entry declares `paged_inputs` / `paged_outputs` (schema 5).
    pub paged: Option<Paged>,
    /// The input is constant for the session (flag bit 4, manifest schema 14): an initializer,
    /// whose bytes no kernel writes, so a kernel may read it before its grid-dependency wait
    /// (ABI.md §7.7). Sent only to packages of schema 14 or later, only in `kiln_dispatch` calls.
    pub constant: bool,
    /// An output bound in place to input `i`'s buffer (flag bit 5, manifest schema 16): its
    /// bytes start as that input's, so a CPU reference need write only what changes (a KV
    /// cache's new positions, ABI.md §7.8). Sent only to packages of schema 16 or later, only in
    /// `kiln_cpu` calls, only on outputs.
    pub in_place_of: Option<u32>,
}

impl<'a> TensorDesc<'a> {
    /// An absent tensor.
    pub fn absent() -> Self {
        TensorDesc {
            present: false,
            dtype: None,
            dims: None,
            handle: NO_HANDLE,
            value: None,
            paged: None,
            constant: false,
            in_place_of: None,
        }
    }

    /// Number of elements, when every dimension is known and non-negative.
    pub fn numel(&self) -> Option<u64> {
        let dims = self.dims.as_ref()?;
        let mut n: u64 = 1;
        for &d in dims {
            if d < 0 {
                return None;
            }
            n = n.checked_mul(d as u64)?;
        }
        Some(n)
    }
}

/// The layout of a paged tensor (ABI.md §6.1.1, tensor flag bit 3; manifest schema 5): axis
/// `axis` is split into pages of `2^shift` indices, and the pages of one index of the other
/// axes need not be adjacent. Element `(i_0, …, i_{r−1})` lies
///
/// ```text
/// Σ_{k ≠ axis} i_k · strides[k]  +  (i_axis >> shift) · page_stride  +  (i_axis mod 2^shift) · strides[axis]
/// ```
///
/// elements from the tensor's address. The host's paged KV cache is one: `[batch, kv_heads,
/// positions, head_size]` whose positions (axis 2) lie in pages that hold every layer's keys
/// and values of one row, so that memory is mapped as sequences grow (vLLM's paged attention
/// with a fixed page table: page `p` of row `b` at `b · strides[0] + p · page_stride`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Paged {
    /// The paged axis.
    pub axis: u32,
    /// log2 of the indices per page (< 32).
    pub shift: u32,
    /// Elements between consecutive pages of the paged axis.
    pub page_stride: u64,
    /// Elements between consecutive indices of each axis (within a page, for the paged axis);
    /// one per dimension.
    pub strides: Vec<u64>,
}

impl Paged {
    /// Indices per page.
    pub fn page_len(&self) -> u64 {
        1u64 << self.shift
    }

    /// The element offset of `index` (one per dimension), `None` when the rank differs or the
    /// offset overflows.
    pub fn offset(&self, index: &[u64]) -> Option<u64> {
        if index.len() != self.strides.len() {
            return None;
        }
        let mut at = 0u64;
        for (k, (&i, &s)) in index.iter().zip(&self.strides).enumerate() {
            let term = if k == self.axis as usize {
                (i >> self.shift)
                    .checked_mul(self.page_stride)?
                    .checked_add((i & (self.page_len() - 1)).checked_mul(s)?)?
            } else {
                i.checked_mul(s)?
            };
            at = at.checked_add(term)?;
        }
        Some(at)
    }

    /// Checks the layout against the tensor's rank: one stride per dimension, an axis within
    /// the rank, a shift below 32.
    pub fn check(&self, rank: usize) -> Result<(), WireError> {
        if self.strides.len() != rank || self.axis as usize >= rank || self.shift >= 32 {
            return Err(WireError::Invalid("paged layout"));
        }
        Ok(())
    }
}

/// An ONNX attribute value (`AttributeProto`, types FLOAT … STRINGS).
#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue<'a> {
    Float(f32),
    Int(i64),
    String(&'a str),
    Tensor(TensorValue<'a>),
    Floats(Vec<f32>),
    Ints(Vec<i64>),
    Strings(Vec<&'a str>),
}

impl AttrValue<'_> {
    /// The ONNX `AttributeProto.AttributeType` code, which is the wire tag.
    pub fn code(&self) -> u32 {
        match self {
            AttrValue::Float(_) => 1,
            AttrValue::Int(_) => 2,
            AttrValue::String(_) => 3,
            AttrValue::Tensor(_) => 4,
            AttrValue::Floats(_) => 6,
            AttrValue::Ints(_) => 7,
            AttrValue::Strings(_) => 8,
        }
    }
}

/// A tensor carried by value (a TENSOR attribute): little-endian element bytes, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorValue<'a> {
    pub dtype: DType,
    pub dims: Vec<i64>,
    pub data: &'a [u8],
}

/// A named attribute.
#[derive(Clone, Debug, PartialEq)]
pub struct Attribute<'a> {
    pub name: &'a str,
    pub value: AttrValue<'a>,
}

/// One node as given to a shim export.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeCall<'a> {
    /// ABI version of the encoding (1).
    pub abi_version: u32,
    /// Operator domain: `""` for `ai.onnx`, `com.microsoft`, …
    pub domain: &'a str,
    /// Operator type, as in the ONNX graph (`MatMul`).
    pub op_type: &'a str,
    /// The model's opset version for `domain`.
    pub opset: i64,
    /// The node's name (may be empty), for messages.
    pub node_name: &'a str,
    pub inputs: Vec<TensorDesc<'a>>,
    pub outputs: Vec<TensorDesc<'a>>,
    pub attributes: Vec<Attribute<'a>>,
    /// A `kiln_cpu` call of one tile of the outputs (manifest schema 12, `cpu_tiles`; ABI.md
    /// §6.1.2), or `None` for the whole node.
    pub tile: Option<Tile>,
}

/// The part of a node's outputs one `kiln_cpu` call computes: units `start..end` of the
/// manifest's `cpu_tiles` kind (output 0's elements, or its rows: every dimension but the last),
/// and the same share of every other output's bytes. The host passes it only to an op entry
/// that declares `cpu_tiles`; the call must write nothing outside its share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tile {
    pub start: u64,
    pub end: u64,
}

/// The tag before a node call's tile (ASCII "TILE", little-endian).
const TILE_TAG: u32 = u32::from_le_bytes(*b"TILE");

impl<'a> NodeCall<'a> {
    /// The attribute named `name`, if the node has it.
    pub fn attr(&self, name: &str) -> Option<&AttrValue<'a>> {
        self.attributes.iter().find(|a| a.name == name).map(|a| &a.value)
    }

    /// Encodes the call (host side).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u32(self.abi_version);
        w.str(self.domain);
        w.str(self.op_type);
        w.i64(self.opset);
        w.str(self.node_name);
        for list in [&self.inputs, &self.outputs] {
            w.u32(list.len() as u32);
            for t in list.iter() {
                encode_tensor(&mut w, t);
            }
        }
        w.u32(self.attributes.len() as u32);
        for a in &self.attributes {
            w.str(a.name);
            w.u32(a.value.code());
            match &a.value {
                AttrValue::Float(v) => w.f32(*v),
                AttrValue::Int(v) => w.i64(*v),
                AttrValue::String(s) => w.str(s),
                AttrValue::Tensor(t) => {
                    w.i32(t.dtype.code());
                    w.dims(&t.dims);
                    w.bytes(t.data);
                }
                AttrValue::Floats(v) => {
                    w.u32(v.len() as u32);
                    v.iter().for_each(|x| w.f32(*x));
                }
                AttrValue::Ints(v) => w.dims(v),
                AttrValue::Strings(v) => {
                    w.u32(v.len() as u32);
                    v.iter().for_each(|s| w.str(s));
                }
            }
        }
        if let Some(t) = self.tile {
            w.u32(TILE_TAG);
            w.u64(t.start);
            w.u64(t.end);
        }
        w.0
    }

    /// Decodes a call (shim side).
    pub fn decode(bytes: &'a [u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(bytes);
        let abi_version = r.u32("abi_version")?;
        let domain = r.str("domain")?;
        let op_type = r.str("op_type")?;
        let opset = r.i64("opset")?;
        let node_name = r.str("node_name")?;
        let mut lists = [Vec::new(), Vec::new()];
        for list in lists.iter_mut() {
            let n = r.count("tensor count", 9)?;
            for _ in 0..n {
                list.push(decode_tensor(&mut r)?);
            }
        }
        let [inputs, outputs] = lists;
        let n = r.count("attribute count", 8)?;
        let mut attributes = Vec::with_capacity(n);
        for _ in 0..n {
            let name = r.str("attribute name")?;
            let value = match r.u32("attribute type")? {
                1 => AttrValue::Float(r.f32("FLOAT")?),
                2 => AttrValue::Int(r.i64("INT")?),
                3 => AttrValue::String(r.str("STRING")?),
                4 => AttrValue::Tensor(TensorValue {
                    dtype: r.dtype("TENSOR dtype")?,
                    dims: r.dims("TENSOR dims")?,
                    data: r.bytes("TENSOR data")?,
                }),
                6 => {
                    let n = r.count("FLOATS", 4)?;
                    (0..n).map(|_| r.f32("FLOATS")).collect::<Result<_, _>>().map(AttrValue::Floats)?
                }
                7 => AttrValue::Ints(r.dims("INTS")?),
                8 => {
                    let n = r.count("STRINGS", 4)?;
                    (0..n).map(|_| r.str("STRINGS")).collect::<Result<_, _>>().map(AttrValue::Strings)?
                }
                _ => return Err(WireError::Invalid("attribute type")),
            };
            attributes.push(Attribute { name, value });
        }
        let tile = if r.remaining() > 0 {
            if r.u32("tile tag")? != TILE_TAG {
                return Err(WireError::Invalid("tile tag"));
            }
            let (start, end) = (r.u64("tile start")?, r.u64("tile end")?);
            if start >= end {
                return Err(WireError::Invalid("tile"));
            }
            Some(Tile { start, end })
        } else {
            None
        };
        r.finish()?;
        Ok(NodeCall { abi_version, domain, op_type, opset, node_name, inputs, outputs, attributes, tile })
    }
}

const FLAG_PRESENT: u32 = 1;
const FLAG_VALUE: u32 = 2;
const FLAG_RANK: u32 = 4;
const FLAG_PAGED: u32 = 8;
const FLAG_CONSTANT: u32 = 16;
const FLAG_IN_PLACE: u32 = 32;

fn encode_tensor(w: &mut Writer, t: &TensorDesc<'_>) {
    let mut flags = 0;
    if t.present {
        flags |= FLAG_PRESENT;
    }
    if t.value.is_some() {
        flags |= FLAG_VALUE;
    }
    if t.dims.is_some() {
        flags |= FLAG_RANK;
    }
    if t.paged.is_some() {
        flags |= FLAG_PAGED;
    }
    if t.constant {
        flags |= FLAG_CONSTANT;
    }
    if t.in_place_of.is_some() {
        flags |= FLAG_IN_PLACE;
    }
    w.u32(flags);
    w.i32(t.dtype.map_or(0, DType::code));
    w.dims(t.dims.as_deref().unwrap_or(&[]));
    w.u32(t.handle);
    if let Some(v) = t.value {
        w.bytes(v);
    }
    if let Some(p) = &t.paged {
        w.u32(p.axis);
        w.u32(p.shift);
        w.u64(p.page_stride);
        w.u32(p.strides.len() as u32);
        p.strides.iter().for_each(|&s| w.u64(s));
    }
    if let Some(i) = t.in_place_of {
        w.u32(i);
    }
}

fn decode_tensor<'a>(r: &mut Reader<'a>) -> Result<TensorDesc<'a>, WireError> {
    let flags = r.u32("tensor flags")?;
    if flags & !(FLAG_PRESENT | FLAG_VALUE | FLAG_RANK | FLAG_PAGED | FLAG_CONSTANT | FLAG_IN_PLACE) != 0 {
        return Err(WireError::Invalid("tensor flags"));
    }
    let code = r.i32("tensor dtype")?;
    let dtype = if code == 0 { None } else { Some(DType::from_code(code).ok_or(WireError::Invalid("dtype"))?) };
    let dims = r.dims("tensor dims")?;
    let handle = r.u32("tensor handle")?;
    let value = if flags & FLAG_VALUE != 0 { Some(r.bytes("tensor value")?) } else { None };
    let paged = if flags & FLAG_PAGED != 0 {
        let (axis, shift, page_stride) = (r.u32("paged axis")?, r.u32("paged shift")?, r.u64("page stride")?);
        let n = r.count("paged strides", 8)?;
        let strides = (0..n).map(|_| r.u64("paged strides")).collect::<Result<Vec<_>, _>>()?;
        let p = Paged { axis, shift, page_stride, strides };
        // A paged tensor has a known rank, one stride per dimension.
        if flags & FLAG_RANK == 0 {
            return Err(WireError::Invalid("paged layout of a tensor of unknown rank"));
        }
        p.check(dims.len())?;
        Some(p)
    } else {
        None
    };
    let in_place_of = if flags & FLAG_IN_PLACE != 0 { Some(r.u32("in-place input")?) } else { None };
    Ok(TensorDesc {
        present: flags & FLAG_PRESENT != 0,
        dtype,
        dims: if flags & FLAG_RANK != 0 { Some(dims) } else { None },
        handle,
        value,
        paged,
        constant: flags & FLAG_CONSTANT != 0,
        in_place_of,
    })
}

/// One argument of a kernel launch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KernelArg {
    /// A device pointer: the tensor named by `handle`, advanced by `offset` bytes. Tag 1.
    Tensor { handle: u32, offset: u64 },
    /// Tag 2.
    I32(i32),
    /// Tag 3.
    U32(u32),
    /// Tag 4.
    I64(i64),
    /// Tag 5.
    U64(u64),
    /// Tag 6.
    F32(f32),
    /// Tag 7.
    F64(f64),
    /// A pointer to the node's device status record (`kiln_status*` of the prelude, ABI.md
    /// §7.5), through which a kernel reports an out-of-range input such as an index past its
    /// buffer; the host reads it at the step's synchronization and fails the run with the
    /// package's `[[device_errors]]` message. Tag 8, no payload (manifest schema 3).
    Status,
    /// A pointer to this many `unsigned` device words that belong to the node (ABI.md §6.3,
    /// manifest schema 5): zero when the host first gives them, at one address for the
    /// session, and left zero by every launch that uses them (the last block to finish resets
    /// what it counted), so that blocks of one launch can count themselves in, a "last block
    /// merges" reduction, without a kernel to clear them. At most [`MAX_COUNTERS`]. Tag 9,
    /// payload `u32` count.
    Counters(u32),
}

impl KernelArg {
    /// The tensor named by `handle`, from its first byte.
    pub fn tensor(handle: u32) -> KernelArg {
        KernelArg::Tensor { handle, offset: 0 }
    }
}

/// Most words of a launch's [`KernelArg::Counters`].
pub const MAX_COUNTERS: u32 = 4096;

/// Most arguments of one launch (CUDA allows 32 KiB of parameters; every argument takes at
/// least 4 bytes).
pub const MAX_KERNEL_ARGS: usize = 1024;

/// One launch of a kernel that the package's manifest declares (argument of `launch`).
#[derive(Clone, Debug, PartialEq)]
pub struct Launch<'a> {
    /// Kernel entry point, as declared in `kernel.toml` (`[[cuda]] kernels`).
    pub kernel: &'a str,
    /// Grid dimensions in blocks (x, y, z).
    pub grid: [u32; 3],
    /// Block dimensions in threads (x, y, z).
    pub block: [u32; 3],
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
    /// Kernel parameters, in order.
    pub args: Vec<KernelArg>,
}

impl<'a> Launch<'a> {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.str(self.kernel);
        self.grid.iter().chain(self.block.iter()).for_each(|v| w.u32(*v));
        w.u32(self.shared_mem_bytes);
        w.u32(self.args.len() as u32);
        for a in &self.args {
            match *a {
                KernelArg::Tensor { handle, offset } => {
                    w.u8(1);
                    w.u32(handle);
                    w.u64(offset);
                }
                KernelArg::I32(v) => {
                    w.u8(2);
                    w.i32(v)
                }
                KernelArg::U32(v) => {
                    w.u8(3);
                    w.u32(v)
                }
                KernelArg::I64(v) => {
                    w.u8(4);
                    w.i64(v)
                }
                KernelArg::U64(v) => {
                    w.u8(5);
                    w.u64(v)
                }
                KernelArg::F32(v) => {
                    w.u8(6);
                    w.f32(v)
                }
                KernelArg::F64(v) => {
                    w.u8(7);
                    w.u64(v.to_bits())
                }
                KernelArg::Status => w.u8(8),
                KernelArg::Counters(n) => {
                    w.u8(9);
                    w.u32(n)
                }
            }
        }
        w.0
    }

    pub fn decode(bytes: &'a [u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(bytes);
        let kernel = r.str("kernel name")?;
        let mut dims = [0u32; 6];
        for d in dims.iter_mut() {
            *d = r.u32("launch dimensions")?;
        }
        let shared_mem_bytes = r.u32("shared memory")?;
        let n = r.count("argument count", 5)?;
        if n > MAX_KERNEL_ARGS {
            return Err(WireError::Invalid("argument count (over MAX_KERNEL_ARGS)"));
        }
        let mut args = Vec::with_capacity(n);
        for _ in 0..n {
            args.push(match r.u8("argument tag")? {
                1 => KernelArg::Tensor { handle: r.u32("handle")?, offset: r.u64("offset")? },
                2 => KernelArg::I32(r.i32("i32")?),
                3 => KernelArg::U32(r.u32("u32")?),
                4 => KernelArg::I64(r.i64("i64")?),
                5 => KernelArg::U64(r.u64("u64")?),
                6 => KernelArg::F32(r.f32("f32")?),
                7 => KernelArg::F64(f64::from_bits(r.u64("f64")?)),
                8 => KernelArg::Status,
                9 => KernelArg::Counters(r.u32("counters")?),
                _ => return Err(WireError::Invalid("argument tag")),
            });
        }
        r.finish()?;
        Ok(Launch {
            kernel,
            grid: [dims[0], dims[1], dims[2]],
            block: [dims[3], dims[4], dims[5]],
            shared_mem_bytes,
            args,
        })
    }
}

/// A matrix operand of [`Gemm`]: row-major, `ld` elements between rows, `batch_stride`
/// elements between the matrices of a batch (0 broadcasts one matrix over the batch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Operand {
    pub handle: u32,
    /// Byte offset of the first element.
    pub offset: u64,
    pub ld: u64,
    pub batch_stride: u64,
}

/// Activation applied after the product and bias (cuBLASLt epilogues).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    None = 0,
    Relu = 1,
    /// GELU, tanh approximation (cuBLASLt `CUBLASLT_EPILOGUE_GELU`).
    Gelu = 2,
}

/// `D = epilogue(alpha · op(A) · op(B) + beta · C + bias)` for each of `batch` matrices, row-major:
/// `op(A)` is `m × k`, `op(B)` is `k × n`, `C` and `D` are `m × n`, `bias` is `n` elements
/// broadcast over rows. `op(X)` is `X` or its transpose. Argument of the `gemm` import.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemm {
    /// Element type of A, B, C, D and bias (f32 computes in f32 or TF32; f16/bf16 accumulate
    /// in f32).
    pub dtype: DType,
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub batch: u64,
    pub alpha: f32,
    pub beta: f32,
    pub a: Operand,
    pub b: Operand,
    /// Read when `beta != 0`.
    pub c: Option<Operand>,
    pub d: Operand,
    /// `n` elements; its `ld` and `batch_stride` are ignored.
    pub bias: Option<Operand>,
    pub epilogue: Epilogue,
}

impl Gemm {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.i32(self.dtype.code());
        w.u8(self.trans_a as u8);
        w.u8(self.trans_b as u8);
        for v in [self.m, self.n, self.k, self.batch] {
            w.u64(v);
        }
        w.f32(self.alpha);
        w.f32(self.beta);
        for op in [Some(self.a), Some(self.b), self.c, Some(self.d), self.bias] {
            match op {
                None => w.u8(0),
                Some(o) => {
                    w.u8(1);
                    w.u32(o.handle);
                    w.u64(o.offset);
                    w.u64(o.ld);
                    w.u64(o.batch_stride);
                }
            }
        }
        w.u32(self.epilogue as u32);
        w.0
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(bytes);
        let dtype = r.dtype("gemm dtype")?;
        let trans_a = r.bool("trans_a")?;
        let trans_b = r.bool("trans_b")?;
        let (m, n, k, batch) = (r.u64("m")?, r.u64("n")?, r.u64("k")?, r.u64("batch")?);
        let alpha = r.f32("alpha")?;
        let beta = r.f32("beta")?;
        let mut ops = [None; 5];
        for o in ops.iter_mut() {
            if r.bool("operand tag")? {
                *o = Some(Operand {
                    handle: r.u32("operand handle")?,
                    offset: r.u64("operand offset")?,
                    ld: r.u64("operand ld")?,
                    batch_stride: r.u64("operand batch stride")?,
                });
            }
        }
        let epilogue = match r.u32("epilogue")? {
            0 => Epilogue::None,
            1 => Epilogue::Relu,
            2 => Epilogue::Gelu,
            _ => return Err(WireError::Invalid("epilogue")),
        };
        r.finish()?;
        let (a, b, d) = match (ops[0], ops[1], ops[3]) {
            (Some(a), Some(b), Some(d)) => (a, b, d),
            _ => return Err(WireError::Invalid("gemm: A, B and D are required")),
        };
        Ok(Gemm { dtype, trans_a, trans_b, m, n, k, batch, alpha, beta, a, b, c: ops[2], d, bias: ops[4], epilogue })
    }
}

/// A tensor operand of [`Conv`] and [`QGemm`]: its handle and the byte offset of its first
/// element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorAt {
    pub handle: u32,
    pub offset: u64,
}

impl TensorAt {
    /// Encodes an optional operand: u8 present, then u32 handle, u64 byte offset.
    fn write(w: &mut Writer, t: Option<TensorAt>) {
        match t {
            None => w.u8(0),
            Some(t) => {
                w.u8(1);
                w.u32(t.handle);
                w.u64(t.offset);
            }
        }
    }

    /// Decodes what [`TensorAt::write`] encodes.
    fn read(r: &mut Reader<'_>) -> Result<Option<TensorAt>, WireError> {
        Ok(match r.bool("tensor tag")? {
            true => Some(TensorAt { handle: r.u32("tensor handle")?, offset: r.u64("tensor offset")? }),
            false => None,
        })
    }
}

/// Most spatial axes a [`Conv`] may have.
pub const CONV_MAX_SPATIAL: usize = 8;

/// A convolution over `[N, C, D…]` tensors, row-major; argument of the `conv` import (ABI.md
/// §4.8, §6.5), following ONNX's Conv and ConvTranspose:
///
/// - `transposed` false (Conv): `X` [N, C, in…], `W` [M, C/groups, kernel…], `Y` [N, M, out…];
///   output position o of spatial axis a reads input `o·strides[a] − pads_begin[a] +
///   t·dilations[a]` for tap t (zero outside the input);
/// - `transposed` true (ConvTranspose): `W` [C, M/groups, kernel…]; input position i at tap t
///   adds to output `i·strides[a] − pads_begin[a] + t·dilations[a]` (dropped outside the output).
///
/// Output channel m belongs to group `m / (M / groups)` and reads its group's input channels.
/// `bias` has M elements added to every output position, `z` Y's shape, added element by element
/// (a residual: ResNet's Conv → Add → Relu); then the epilogue (none or relu).
#[derive(Clone, Debug, PartialEq)]
pub struct Conv {
    /// float32, float16 or bfloat16 (X, W, bias, Y).
    pub dtype: DType,
    pub transposed: bool,
    pub batch: u64,
    pub in_channels: u64,
    pub out_channels: u64,
    pub groups: u64,
    /// Per spatial axis (1 to [`CONV_MAX_SPATIAL`], all of one length).
    pub input: Vec<u64>,
    pub output: Vec<u64>,
    pub kernel: Vec<u64>,
    pub strides: Vec<u64>,
    pub dilations: Vec<u64>,
    /// Padding before each axis (negative: a ConvTranspose's output starts inside).
    pub pads_begin: Vec<i64>,
    pub x: TensorAt,
    pub w: TensorAt,
    pub bias: Option<TensorAt>,
    /// Y's shape, added before the epilogue.
    pub z: Option<TensorAt>,
    pub y: TensorAt,
    /// `None` or `Relu`.
    pub epilogue: Epilogue,
}

impl Conv {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.i32(self.dtype.code());
        w.u8(self.transposed as u8);
        w.u8(self.input.len() as u8);
        for v in [self.batch, self.in_channels, self.out_channels, self.groups] {
            w.u64(v);
        }
        for axis in [&self.input, &self.output, &self.kernel, &self.strides, &self.dilations] {
            axis.iter().for_each(|v| w.u64(*v));
        }
        self.pads_begin.iter().for_each(|v| w.i64(*v));
        for t in [Some(self.x), Some(self.w), self.bias, self.z, Some(self.y)] {
            TensorAt::write(&mut w, t);
        }
        w.u32(self.epilogue as u32);
        w.0
    }

    /// Decodes a descriptor. Errors: a malformed encoding, a spatial rank outside
    /// 1..=[`CONV_MAX_SPATIAL`], X, W or Y absent, an epilogue other than none or relu.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(bytes);
        let dtype = r.dtype("conv dtype")?;
        let transposed = r.bool("transposed")?;
        let rank = r.u8("spatial rank")? as usize;
        if !(1..=CONV_MAX_SPATIAL).contains(&rank) {
            return Err(WireError::Invalid("conv: spatial rank (1 to 8)"));
        }
        let (batch, in_channels, out_channels, groups) =
            (r.u64("batch")?, r.u64("in channels")?, r.u64("out channels")?, r.u64("groups")?);
        let mut axes: [Vec<u64>; 5] = Default::default();
        for a in axes.iter_mut() {
            for _ in 0..rank {
                a.push(r.u64("spatial value")?);
            }
        }
        let mut pads_begin = Vec::with_capacity(rank);
        for _ in 0..rank {
            pads_begin.push(r.i64("pads begin")?);
        }
        let mut ts = [None; 5];
        for t in ts.iter_mut() {
            *t = TensorAt::read(&mut r)?;
        }
        let epilogue = match r.u32("epilogue")? {
            0 => Epilogue::None,
            1 => Epilogue::Relu,
            _ => return Err(WireError::Invalid("conv epilogue (none or relu)")),
        };
        r.finish()?;
        let (x, w, y) = match (ts[0], ts[1], ts[4]) {
            (Some(x), Some(w), Some(y)) => (x, w, y),
            _ => return Err(WireError::Invalid("conv: X, W and Y are required")),
        };
        let [input, output, kernel, strides, dilations] = axes;
        Ok(Conv {
            dtype,
            transposed,
            batch,
            in_channels,
            out_channels,
            groups,
            input,
            output,
            kernel,
            strides,
            dilations,
            pads_begin,
            x,
            w,
            bias: ts[2],
            z: ts[3],
            y,
            epilogue,
        })
    }
}

/// The zero points of a [`QGemm`]'s blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QZeroPoints {
    /// 2^(bits − 1) for every block.
    Default,
    /// uint8 `[n, ceil(k_blocks · bits / 8)]`: `bits` per block, packed from the low bits.
    Packed(TensorAt),
    /// The dtype's values `[n, k_blocks]`.
    Float(TensorAt),
}

/// `Y [m, n] = A [m, k] · dequant(B)ᵀ + bias`, the product of onnxruntime's MatMulNBits; argument
/// of the `qgemm` import (ABI.md §4.9, §6.6). B is uint8 `[n, k_blocks, block · bits / 8]`: row
/// r's value j is the `j % block`-th of block `j / block`, `bits` of a byte from the low ones, and
/// dequantizes to `(q − zero[r, b]) · scales[r, b]`; `k_blocks = ceil(k / block)`.
#[derive(Clone, Debug, PartialEq)]
pub struct QGemm {
    /// float32, float16 or bfloat16: A, scales, float zero points, bias, Y.
    pub dtype: DType,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    /// 2, 4 or 8.
    pub bits: u32,
    /// Values per block, a multiple of 8 / bits.
    pub block: u64,
    pub a: TensorAt,
    pub b: TensorAt,
    pub scales: TensorAt,
    pub zero_points: QZeroPoints,
    pub bias: Option<TensorAt>,
    pub y: TensorAt,
    /// MatMulNBits' `accuracy_level` (manifest schema 17): 0 unset, 1 float32, 2 float16, 3
    /// bfloat16, 4 int8, the least precise computation of A the op allows. At 4 the CPU host
    /// may quantize each block of A's rows (`block` values) to int8, `round(a · 127 / max|a|)`
    /// with scale `max|a| / 127`, and sum integer products, as onnxruntime's CPU provider does
    /// (ABI.md §6.6). Encoded as a trailing byte when not 0, so a descriptor without it reads
    /// as 0.
    pub accuracy_level: u8,
}

impl QGemm {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.i32(self.dtype.code());
        for v in [self.m, self.n, self.k] {
            w.u64(v);
        }
        w.u32(self.bits);
        w.u64(self.block);
        let (zp_tag, zp) = match self.zero_points {
            QZeroPoints::Default => (0, None),
            QZeroPoints::Packed(t) => (1, Some(t)),
            QZeroPoints::Float(t) => (2, Some(t)),
        };
        w.u8(zp_tag);
        for t in [Some(self.a), Some(self.b), Some(self.scales), zp, self.bias, Some(self.y)] {
            TensorAt::write(&mut w, t);
        }
        if self.accuracy_level != 0 {
            w.u8(self.accuracy_level);
        }
        w.0
    }

    /// Decodes a descriptor. Errors: a malformed encoding, A, B, scales or Y absent, a zero-point
    /// kind without its tensor.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(bytes);
        let dtype = r.dtype("qgemm dtype")?;
        let (m, n, k) = (r.u64("m")?, r.u64("n")?, r.u64("k")?);
        let bits = r.u32("bits")?;
        let block = r.u64("block")?;
        let zp_tag = r.u8("zero point kind")?;
        let mut ts = [None; 6];
        for t in ts.iter_mut() {
            *t = TensorAt::read(&mut r)?;
        }
        let accuracy_level = if r.remaining() > 0 { r.u8("accuracy level")? } else { 0 };
        r.finish()?;
        let zero_points = match (zp_tag, ts[3]) {
            (0, None) => QZeroPoints::Default,
            (1, Some(t)) => QZeroPoints::Packed(t),
            (2, Some(t)) => QZeroPoints::Float(t),
            _ => return Err(WireError::Invalid("qgemm zero points")),
        };
        let (a, b, scales, y) = match (ts[0], ts[1], ts[2], ts[5]) {
            (Some(a), Some(b), Some(s), Some(y)) => (a, b, s, y),
            _ => return Err(WireError::Invalid("qgemm: A, B, scales and Y are required")),
        };
        Ok(QGemm { dtype, m, n, k, bits, block, a, b, scales, zero_points, bias: ts[4], y, accuracy_level })
    }
}

/// Little-endian writer.
#[derive(Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    pub fn u8(&mut self, v: u8) {
        self.0.push(v)
    }
    pub fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    pub fn i32(&mut self, v: i32) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    pub fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    pub fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    pub fn f32(&mut self, v: f32) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    pub fn bytes(&mut self, v: &[u8]) {
        self.u32(v.len() as u32);
        self.0.extend_from_slice(v)
    }
    pub fn str(&mut self, v: &str) {
        self.bytes(v.as_bytes())
    }
    pub fn dims(&mut self, v: &[i64]) {
        self.u32(v.len() as u32);
        v.iter().for_each(|d| self.i64(*d));
    }
}

/// Little-endian reader over a message; every read is bounds-checked.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        let end = self.pos.checked_add(n).ok_or(WireError::Truncated(what))?;
        let s = self.buf.get(self.pos..end).ok_or(WireError::Truncated(what))?;
        self.pos = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }
    pub fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        Ok(self.take(1, what)?[0])
    }
    pub fn bool(&mut self, what: &'static str) -> Result<bool, WireError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(WireError::Invalid(what)),
        }
    }
    pub fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        self.array(what).map(u32::from_le_bytes)
    }
    pub fn i32(&mut self, what: &'static str) -> Result<i32, WireError> {
        self.array(what).map(i32::from_le_bytes)
    }
    pub fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        self.array(what).map(u64::from_le_bytes)
    }
    pub fn i64(&mut self, what: &'static str) -> Result<i64, WireError> {
        self.array(what).map(i64::from_le_bytes)
    }
    pub fn f32(&mut self, what: &'static str) -> Result<f32, WireError> {
        self.array(what).map(f32::from_le_bytes)
    }
    pub fn dtype(&mut self, what: &'static str) -> Result<DType, WireError> {
        DType::from_code(self.i32(what)?).ok_or(WireError::Invalid(what))
    }
    /// A count of items that each take at least `min_item` bytes: refused when the rest of the
    /// message could not hold them (so a forged count cannot make the reader allocate).
    pub fn count(&mut self, what: &'static str, min_item: usize) -> Result<usize, WireError> {
        let n = self.u32(what)? as usize;
        if n.saturating_mul(min_item) > self.buf.len() - self.pos {
            return Err(WireError::Truncated(what));
        }
        Ok(n)
    }
    pub fn bytes(&mut self, what: &'static str) -> Result<&'a [u8], WireError> {
        let n = self.u32(what)? as usize;
        self.take(n, what)
    }
    pub fn str(&mut self, what: &'static str) -> Result<&'a str, WireError> {
        core::str::from_utf8(self.bytes(what)?).map_err(|_| WireError::Utf8)
    }
    pub fn dims(&mut self, what: &'static str) -> Result<Vec<i64>, WireError> {
        let n = self.count(what, 8)?;
        (0..n).map(|_| self.i64(what)).collect()
    }
    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub fn finish(&self) -> Result<(), WireError> {
        match self.buf.len() - self.pos {
            0 => Ok(()),
            n => Err(WireError::Trailing(n)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    fn sample<'a>(value: &'a [u8]) -> NodeCall<'a> {
        NodeCall {
            abi_version: 1,
            domain: "",
            op_type: "Reshape",
            opset: 21,
            node_name: "r0",
            inputs: vec![
                TensorDesc {
                    present: true,
                    dtype: Some(DType::F32),
                    dims: Some(vec![2, 3, 8, 4]),
                    handle: 7,
                    value: None,
                    paged: Some(Paged { axis: 2, shift: 2, page_stride: 96, strides: [400, 16, 4, 1].to_vec() }),
                    constant: true,
                    in_place_of: None,
                },
                TensorDesc {
                    present: true,
                    dtype: Some(DType::I64),
                    dims: Some(vec![1]),
                    handle: 8,
                    value: Some(value),
                    paged: None,
                    constant: false,
                    in_place_of: None,
                },
                TensorDesc::absent(),
            ],
            outputs: vec![TensorDesc {
                present: true,
                dtype: None,
                dims: None,
                handle: 9,
                value: None,
                paged: None,
                constant: false,
                in_place_of: Some(0),
            }],
            attributes: vec![
                Attribute { name: "allowzero", value: AttrValue::Int(0) },
                Attribute { name: "f", value: AttrValue::Floats(vec![1.5, -2.0]) },
                Attribute { name: "s", value: AttrValue::Strings(vec!["a", "bc"]) },
                Attribute {
                    name: "t",
                    value: AttrValue::Tensor(TensorValue { dtype: DType::F16, dims: vec![1], data: &[0, 60] }),
                },
            ],
            tile: None,
        }
    }

    #[test]
    fn node_call_round_trips() {
        let v = 6i64.to_le_bytes();
        let call = sample(&v);
        let bytes = call.encode();
        assert_eq!(NodeCall::decode(&bytes).unwrap(), call);
    }

    /// A tile rides after the attributes; a call cut inside it, or one with an empty or
    /// mistagged tile, is refused.
    #[test]
    fn a_tile_round_trips_and_a_broken_one_is_refused() {
        let v = 6i64.to_le_bytes();
        let call = NodeCall { tile: Some(Tile { start: 3, end: 9 }), ..sample(&v) };
        let bytes = call.encode();
        assert_eq!(NodeCall::decode(&bytes).unwrap(), call);
        let untiled = sample(&v).encode().len();
        assert_eq!(bytes.len(), untiled + 20);
        for cut in untiled + 1..bytes.len() {
            assert!(NodeCall::decode(&bytes[..cut]).is_err(), "a tile cut at {cut} decoded");
        }
        let empty = NodeCall { tile: Some(Tile { start: 4, end: 4 }), ..sample(&v) }.encode();
        assert_eq!(NodeCall::decode(&empty), Err(WireError::Invalid("tile")));
        let mut mistagged = bytes.clone();
        mistagged[untiled] ^= 1;
        assert_eq!(NodeCall::decode(&mistagged), Err(WireError::Invalid("tile tag")));
    }

    #[test]
    fn every_truncation_of_a_node_call_is_an_error() {
        let v = 6i64.to_le_bytes();
        let bytes = sample(&v).encode();
        for cut in 0..bytes.len() {
            assert!(NodeCall::decode(&bytes[..cut]).is_err(), "prefix of {cut} bytes decoded");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert_eq!(NodeCall::decode(&long), Err(WireError::Truncated("tile tag")), "a byte that starts no tile");
        let tiled = NodeCall { tile: Some(Tile { start: 0, end: 1 }), ..sample(&v) }.encode();
        let mut long = tiled.clone();
        long.push(0);
        assert_eq!(NodeCall::decode(&long), Err(WireError::Trailing(1)));
    }

    #[test]
    fn a_paged_offset_splits_its_axis_into_pages() {
        // [2 rows, 3 heads, 8 positions, 4] in pages of 4 positions: a page holds 3 heads × 4
        // positions × 4 = 48 elements, then another tensor's 48; a row holds 2 pages.
        let p = Paged { axis: 2, shift: 2, page_stride: 96, strides: vec![192, 16, 4, 1] };
        let at = |b: u64, h: u64, t: u64, d: u64| p.offset(&[b, h, t, d]).unwrap();
        assert_eq!(at(0, 0, 0, 0), 0);
        assert_eq!(at(0, 0, 3, 1), 13, "within the first page");
        assert_eq!(at(0, 0, 4, 0), 96, "position 4 starts the second page");
        assert_eq!(at(0, 2, 6, 3), 96 + 32 + 8 + 3);
        assert_eq!(at(1, 1, 5, 2), 192 + 96 + 16 + 4 + 2);
        // Every element of the tensor has its own offset.
        let mut seen = alloc::collections::BTreeSet::new();
        for i in 0..2 * 3 * 8 * 4u64 {
            assert!(seen.insert(at(i / 96, i / 32 % 3, i / 4 % 8, i % 4)));
        }
        assert_eq!(p.offset(&[0, 0, 0]), None, "another rank");
        assert_eq!(Paged { strides: vec![u64::MAX, 1, 1, 1], ..p.clone() }.offset(&[2, 0, 0, 0]), None, "overflow");
    }

    #[test]
    fn a_paged_layout_that_does_not_fit_its_tensor_is_refused() {
        let good = Paged { axis: 2, shift: 2, page_stride: 96, strides: vec![192, 16, 4, 1] };
        let call = |paged: Paged, dims: Option<Vec<i64>>| {
            let t = TensorDesc {
                present: true,
                dtype: Some(DType::F16),
                dims,
                handle: 1,
                value: None,
                paged: Some(paged),
                constant: false,
                in_place_of: None,
            };
            NodeCall {
                abi_version: 1,
                domain: "",
                op_type: "X",
                opset: 1,
                node_name: "",
                inputs: vec![t],
                outputs: vec![],
                attributes: vec![],
                tile: None,
            }
            .encode()
        };
        let dims = Some(vec![2, 3, 8, 4]);
        assert!(NodeCall::decode(&call(good.clone(), dims.clone())).is_ok());
        for (bad, what) in [
            (Paged { strides: vec![16, 4, 1], ..good.clone() }, "3 strides for 4 dimensions"),
            (Paged { axis: 4, ..good.clone() }, "axis past the rank"),
            (Paged { shift: 32, ..good.clone() }, "shift of 32"),
        ] {
            let err = NodeCall::decode(&call(bad, dims.clone())).unwrap_err();
            assert_eq!(err, WireError::Invalid("paged layout"), "{what}");
        }
        let err = NodeCall::decode(&call(good, None)).unwrap_err();
        assert_eq!(err, WireError::Invalid("paged layout of a tensor of unknown rank"));
    }

    #[test]
    fn a_forged_count_is_refused_without_allocating() {
        let mut w = Writer::default();
        w.u32(u32::MAX);
        assert!(Reader::new(&w.0).dims("dims").is_err());
    }

    #[test]
    fn launch_and_gemm_round_trip() {
        let l = Launch {
            kernel: "relu_f32",
            grid: [4, 1, 1],
            block: [256, 1, 1],
            shared_mem_bytes: 0,
            args: vec![
                KernelArg::Tensor { handle: 3, offset: 16 },
                KernelArg::U64(10),
                KernelArg::F64(0.5),
                KernelArg::Status,
                KernelArg::Counters(24),
            ],
        };
        assert_eq!(Launch::decode(&l.encode()).unwrap(), l);
        let op = Operand { handle: 1, offset: 0, ld: 8, batch_stride: 64 };
        let g = Gemm {
            dtype: DType::F16,
            trans_a: false,
            trans_b: true,
            m: 8,
            n: 8,
            k: 8,
            batch: 2,
            alpha: 1.0,
            beta: 0.0,
            a: op,
            b: op,
            c: None,
            d: op,
            bias: Some(op),
            epilogue: Epilogue::Gelu,
        };
        assert_eq!(Gemm::decode(&g.encode()).unwrap(), g);
    }

    #[test]
    fn qgemm_round_trips() {
        let at = |handle| TensorAt { handle, offset: 4 };
        let q = QGemm {
            dtype: DType::F16,
            m: 3,
            n: 5,
            k: 70,
            bits: 4,
            block: 32,
            a: at(1),
            b: at(2),
            scales: at(3),
            zero_points: QZeroPoints::Packed(at(4)),
            bias: Some(at(5)),
            y: at(6),
            accuracy_level: 0,
        };
        let bytes = q.encode();
        assert_eq!(QGemm::decode(&bytes).unwrap(), q);
        for cut in 0..bytes.len() {
            assert!(QGemm::decode(&bytes[..cut]).is_err(), "a descriptor cut at {cut} decoded");
        }
        let no_zp = QGemm { zero_points: QZeroPoints::Default, ..q.clone() };
        assert_eq!(QGemm::decode(&no_zp.encode()).unwrap(), no_zp);
        // accuracy_level is one trailing byte, absent at 0 (a schema-16 shim's descriptor).
        let int8 = QGemm { accuracy_level: 4, ..q.clone() };
        let int8_bytes = int8.encode();
        assert_eq!(int8_bytes.len(), bytes.len() + 1);
        assert_eq!(QGemm::decode(&int8_bytes).unwrap(), int8);
        let mut long = int8_bytes.clone();
        long.push(0);
        assert!(QGemm::decode(&long).is_err(), "a second trailing byte decoded");
    }

    #[test]
    fn conv_round_trips_and_refuses_what_it_cannot_describe() {
        let at = |handle| TensorAt { handle, offset: 8 };
        let c = Conv {
            dtype: DType::BF16,
            transposed: true,
            batch: 2,
            in_channels: 4,
            out_channels: 6,
            groups: 2,
            input: vec![5, 7],
            output: vec![9, 13],
            kernel: vec![3, 2],
            strides: vec![2, 2],
            dilations: vec![1, 1],
            pads_begin: vec![-1, 0],
            x: at(1),
            w: at(2),
            bias: None,
            z: Some(at(3)),
            y: at(4),
            epilogue: Epilogue::Relu,
        };
        let bytes = c.encode();
        assert_eq!(Conv::decode(&bytes).unwrap(), c);
        for cut in 0..bytes.len() {
            assert!(Conv::decode(&bytes[..cut]).is_err(), "a descriptor cut at {cut} decoded");
        }
        let mut no_rank = bytes.clone();
        no_rank[5] = 0;
        assert!(Conv::decode(&no_rank).is_err());
        let gelu = Conv { epilogue: Epilogue::Gelu, ..c };
        assert!(Conv::decode(&gelu.encode()).is_err(), "conv has no GELU epilogue");
    }
}
