//! The shim SDK (feature `guest`): what a kernel package's shim crate is written with.
//!
//! A shim is a `no_std` `cdylib` for `wasm32-unknown-unknown` that implements [`Shim`] and
//! exports it with [`export_shim!`](crate::export_shim):
//!
//! ```ignore
//! #![no_std]
//! extern crate alloc;
//! use kiln_kernel_abi::guest::*;
//!
//! struct Relu;
//! impl Shim for Relu {
//!     fn infer(call: &Call) -> Result<Vec<TensorType>> {
//!         let x = call.input(0)?;
//!         Ok(vec![TensorType::new(x.dtype()?, x.shape()?)])
//!     }
//!     fn cpu(call: &Call) -> Result<()> {
//!         let x: Vec<f32> = call.input(0)?.read_vec()?;
//!         call.output(0)?.write_vec(&x.iter().map(|v| v.max(0.0)).collect::<Vec<_>>())
//!     }
//! }
//! kiln_kernel_abi::export_shim!(Relu);
//! ```
//!
//! The crate provides the global allocator (dlmalloc) and a panic handler that reports the
//! panic message through the `fail` import before trapping, so a panicking shim fails its node
//! with a readable reason.

pub mod element;
pub mod fast;
mod host;
pub mod rt;
pub mod shape;

use alloc::string::String;
use alloc::vec::Vec;

pub use alloc::{format, vec};
pub use element::{Bool, Element};
pub use half::{bf16, f16};
pub use host::{conv, device_conv, gemm, launch, log_fail, qgemm, read_handle, scratch, scratch_from, write_handle};
pub use libm;

pub use crate::wire::{
    AttrValue, Conv, Epilogue, Gemm, KernelArg, Launch, NodeCall, Operand, Paged, QGemm, QZeroPoints, TensorAt,
    TensorDesc, TensorValue,
};
pub use crate::{status, DType};

/// Threads per block of [`grid_stride`] launches.
pub const GRID_STRIDE_BLOCK: u32 = 256;

/// The grid of a grid-stride kernel (`KILN_FOR`) over `units` work items at
/// [`GRID_STRIDE_BLOCK`] threads a block: one block per 256 items, at least 1 and at most 2^20
/// (the loop covers the rest). Grid y and z are 1.
pub fn grid_stride(units: u64) -> [u32; 3] {
    [units.div_ceil(GRID_STRIDE_BLOCK as u64).clamp(1, 1 << 20) as u32, 1, 1]
}

/// Why a shim call did not succeed.
#[derive(Clone, Debug)]
pub enum ShimError {
    /// The node is invalid (shapes that do not match, a bad attribute): export returns
    /// [`status::FAILED`].
    Failed(String),
    /// The package does not implement this case: export returns [`status::UNSUPPORTED`].
    Unsupported(String),
}

/// Result of shim functions.
pub type Result<T> = core::result::Result<T, ShimError>;

/// Returns early with [`ShimError::Failed`] and a formatted message.
#[macro_export]
macro_rules! bail {
    ($($t:tt)*) => { return Err($crate::guest::ShimError::Failed($crate::guest::format!($($t)*))) };
}

/// Returns early with [`ShimError::Unsupported`] and a formatted message.
#[macro_export]
macro_rules! unsupported {
    ($($t:tt)*) => { return Err($crate::guest::ShimError::Unsupported($crate::guest::format!($($t)*))) };
}

/// The dtype and shape of one output, as inferred.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl TensorType {
    pub fn new(dtype: DType, shape: Vec<usize>) -> Self {
        TensorType { dtype, shape }
    }
}

/// What a package implements. Every function is a pure function of the call: shapes,
/// dtypes, attributes and (for value inputs) input bytes.
pub trait Shim {
    /// Output dtypes and shapes, one per output of the node (absent outputs included, in
    /// order; their entries are ignored). Inputs are fully known when this is called.
    fn infer(call: &Call) -> Result<Vec<TensorType>>;

    /// Records the GPU work for the node with [`launch`], [`gemm`] and [`scratch`].
    fn dispatch(call: &Call) -> Result<()> {
        Err(ShimError::Unsupported(format!("{} has no GPU dispatch in this package", call.op_type())))
    }

    /// Computes the outputs on the CPU: reads inputs with [`Tensor::read_bytes`] and writes every
    /// present output with [`Tensor::write_bytes`].
    fn cpu(call: &Call) -> Result<()>;
}

/// A decoded node call with typed accessors.
pub struct Call<'a> {
    pub node: NodeCall<'a>,
}

/// One input or output of the call.
#[derive(Clone, Copy)]
pub struct Tensor<'c, 'a> {
    pub desc: &'c TensorDesc<'a>,
    /// "input 1", "output 0": for messages.
    index: usize,
    is_input: bool,
}

impl<'a> Call<'a> {
    pub fn op_type(&self) -> &'a str {
        self.node.op_type
    }
    pub fn domain(&self) -> &'a str {
        self.node.domain
    }
    pub fn opset(&self) -> i64 {
        self.node.opset
    }
    pub fn num_inputs(&self) -> usize {
        self.node.inputs.len()
    }
    pub fn num_outputs(&self) -> usize {
        self.node.outputs.len()
    }

    /// The units (elements or rows of output 0, as the op entry's `cpu_tiles` says) this CPU
    /// call computes: `0..units` for a whole-node call, else its tile's `start..end` (ABI.md
    /// §6.1.2). `units` is the node's count, which the shim knows from the shapes. Errors: a
    /// tile past `units` (a host that counts otherwise).
    pub fn tile_units(&self, units: usize) -> Result<core::ops::Range<usize>> {
        match self.node.tile {
            None => Ok(0..units),
            Some(t) if t.end <= units as u64 => Ok(t.start as usize..t.end as usize),
            Some(t) => Err(ShimError::Failed(format!(
                "{}: tile {}..{} is past the node's {units} units",
                self.op_type(),
                t.start,
                t.end
            ))),
        }
    }

    /// Input `i`, which must be present.
    pub fn input(&self, i: usize) -> Result<Tensor<'_, 'a>> {
        self.input_opt(i).ok_or_else(|| ShimError::Failed(format!("{}: input {i} is required", self.op_type())))
    }

    /// Input `i`, or `None` when absent or beyond the node's inputs.
    pub fn input_opt(&self, i: usize) -> Option<Tensor<'_, 'a>> {
        self.node.inputs.get(i).filter(|d| d.present).map(|desc| Tensor { desc, index: i, is_input: true })
    }

    /// Present inputs, in order (for variadic ops).
    pub fn inputs(&self) -> Vec<Tensor<'_, 'a>> {
        (0..self.num_inputs()).filter_map(|i| self.input_opt(i)).collect()
    }

    /// Output `i`, which must be present.
    pub fn output(&self, i: usize) -> Result<Tensor<'_, 'a>> {
        self.output_opt(i).ok_or_else(|| ShimError::Failed(format!("{}: output {i} is required", self.op_type())))
    }

    /// Output `i`, or `None` when the node leaves it out.
    pub fn output_opt(&self, i: usize) -> Option<Tensor<'_, 'a>> {
        self.node.outputs.get(i).filter(|d| d.present).map(|desc| Tensor { desc, index: i, is_input: false })
    }

    pub fn attr(&self, name: &str) -> Option<&AttrValue<'a>> {
        self.node.attr(name)
    }

    /// INT attribute `name`, or `default` when absent.
    pub fn attr_i(&self, name: &str, default: i64) -> Result<i64> {
        match self.attr(name) {
            None => Ok(default),
            Some(AttrValue::Int(v)) => Ok(*v),
            Some(_) => self.wrong_type(name, "INT"),
        }
    }

    /// FLOAT attribute `name`, or `default` when absent.
    pub fn attr_f(&self, name: &str, default: f32) -> Result<f32> {
        match self.attr(name) {
            None => Ok(default),
            Some(AttrValue::Float(v)) => Ok(*v),
            Some(_) => self.wrong_type(name, "FLOAT"),
        }
    }

    /// STRING attribute `name`, or `default` when absent.
    pub fn attr_s(&self, name: &str, default: &'a str) -> Result<&'a str> {
        match self.attr(name) {
            None => Ok(default),
            Some(AttrValue::String(v)) => Ok(v),
            Some(_) => self.wrong_type(name, "STRING"),
        }
    }

    /// INTS attribute `name`, or `None` when absent.
    pub fn attr_ints(&self, name: &str) -> Result<Option<Vec<i64>>> {
        match self.attr(name) {
            None => Ok(None),
            Some(AttrValue::Ints(v)) => Ok(Some(v.clone())),
            Some(_) => self.wrong_type(name, "INTS"),
        }
    }

    /// FLOATS attribute `name`, or `None` when absent.
    pub fn attr_floats(&self, name: &str) -> Result<Option<Vec<f32>>> {
        match self.attr(name) {
            None => Ok(None),
            Some(AttrValue::Floats(v)) => Ok(Some(v.clone())),
            Some(_) => self.wrong_type(name, "FLOATS"),
        }
    }

    /// TENSOR attribute `name`, or `None` when absent.
    pub fn attr_tensor(&self, name: &str) -> Result<Option<&TensorValue<'a>>> {
        match self.attr(name) {
            None => Ok(None),
            Some(AttrValue::Tensor(v)) => Ok(Some(v)),
            Some(_) => self.wrong_type(name, "TENSOR"),
        }
    }

    fn wrong_type<T>(&self, name: &str, want: &str) -> Result<T> {
        Err(ShimError::Failed(format!("{}: attribute {name} must be {want}", self.op_type())))
    }
}

impl<'c, 'a> Tensor<'c, 'a> {
    fn what(&self) -> String {
        format!("{} {}", if self.is_input { "input" } else { "output" }, self.index)
    }

    /// The element type (known for every input; for outputs after inference).
    pub fn dtype(&self) -> Result<DType> {
        self.desc.dtype.ok_or_else(|| ShimError::Failed(format!("{} has no dtype", self.what())))
    }

    /// The shape, all dimensions known.
    pub fn shape(&self) -> Result<Vec<usize>> {
        let dims = self.desc.dims.as_ref().ok_or_else(|| ShimError::Failed(format!("{} has no shape", self.what())))?;
        dims.iter()
            .map(|&d| {
                usize::try_from(d).map_err(|_| ShimError::Failed(format!("{} has unknown dimension {d}", self.what())))
            })
            .collect()
    }

    pub fn rank(&self) -> Result<usize> {
        Ok(self.shape()?.len())
    }

    /// Number of elements.
    pub fn numel(&self) -> Result<usize> {
        Ok(self.shape()?.iter().product())
    }

    /// Size in bytes: `numel × size`, or for packed dtypes (int4, float4e2m1, int2, …) the
    /// bytes their packing takes ([`DType::storage_bytes`]).
    pub fn nbytes(&self) -> Result<usize> {
        let dtype = self.dtype()?;
        let n = dtype
            .storage_bytes(self.numel()? as u64)
            .ok_or_else(|| ShimError::Unsupported(format!("{}: {dtype} tensors", self.what())))?;
        usize::try_from(n)
            .map_err(|_| ShimError::Failed(format!("{} is larger than the shim can address", self.what())))
    }

    /// `bytes` of this tensor's dtype decoded as `T`, `numel` of them (a packed dtype's last
    /// byte may hold padding).
    fn decode<T: Element>(&self, bytes: &[u8]) -> Result<Vec<T>> {
        let mut v = element::decode_as::<T>(self.dtype()?, bytes)?;
        if self.dtype()?.is_packed() {
            v.truncate(self.numel()?);
        }
        Ok(v)
    }

    pub fn handle(&self) -> u32 {
        self.desc.handle
    }

    /// The tensor's paged layout (ABI.md §6.1.1), when the host pages it: only an input or output
    /// the op's manifest entry lists in `paged_inputs` / `paged_outputs`. `None`: row-major.
    pub fn paged(&self) -> Option<&crate::wire::Paged> {
        self.desc.paged.as_ref()
    }

    /// Whether the input is constant for the session (ABI.md §7.7, manifest schema 14): an
    /// initializer, which no kernel writes, so a kernel may read it before its grid-dependency
    /// wait. The host says so only in `kiln_dispatch` calls; `false` elsewhere.
    pub fn is_constant(&self) -> bool {
        self.desc.constant
    }

    /// For an output bound in place to an input's buffer (ABI.md §7.8, manifest schema 16): that
    /// input's index. The output's bytes then start as the input's, so a CPU reference need write
    /// only what changes (GroupQueryAttention's present K/V over a shared past buffer: the new
    /// positions). The host says so only in `kiln_cpu` calls; `None` elsewhere, and for inputs.
    /// From manifest schema 18 the output is that input's buffer itself: reads of the input see
    /// what the shim has written to the output, so read the input's bytes before overwriting them.
    pub fn in_place_of(&self) -> Option<usize> {
        if self.is_input {
            return None;
        }
        self.desc.in_place_of.map(|i| i as usize)
    }

    /// The bytes given inline for a value input (see the manifest's `value_inputs`).
    pub fn value(&self) -> Option<&'a [u8]> {
        self.desc.value
    }

    /// The input's elements as i64 (from int32/int64/other integer types); from the inline
    /// value when given, otherwise read through the host. For shape-like inputs.
    pub fn read_i64s(&self) -> Result<Vec<i64>> {
        self.decode::<i64>(&self.value_bytes()?)
    }

    /// A floating-point value input's elements as f32 (inline, or read through the host).
    /// Errors: an integer tensor.
    pub fn value_f32s(&self) -> Result<Vec<f32>> {
        match self.dtype()? {
            d if d.is_float() => self.decode::<f32>(&self.value_bytes()?),
            d => Err(ShimError::Failed(format!("a {d} tensor where floats are expected"))),
        }
    }

    /// The bytes of a value input: inline when given (every call, dispatch included), otherwise
    /// read through the host (CPU calls).
    pub fn value_bytes(&self) -> Result<Vec<u8>> {
        match self.value() {
            Some(v) => Ok(Vec::from(v)),
            None => self.read_bytes(),
        }
    }

    /// Reads all bytes of the tensor (CPU calls only).
    pub fn read_bytes(&self) -> Result<Vec<u8>> {
        let n = self.nbytes()?;
        let mut buf = vec![0u8; n];
        host::read(self.desc.handle, 0, &mut buf)
            .map_err(|c| ShimError::Failed(format!("reading {}: host refused ({c})", self.what())))?;
        Ok(buf)
    }

    /// Reads the tensor converted to `T` (any numeric dtype; bool as 0/1).
    pub fn read_vec<T: Element>(&self) -> Result<Vec<T>> {
        if self.dtype()? == T::DTYPE && element::is_plain::<T>() {
            return self.read_vec_range(0, usize::MAX);
        }
        self.decode::<T>(&self.read_bytes()?)
    }

    /// Reads the first `count` elements converted to `T` (all of them when the tensor has
    /// fewer): a table's leading rows without copying the rest into the shim.
    pub fn read_vec_prefix<T: Element>(&self, count: usize) -> Result<Vec<T>> {
        self.read_vec_range(0, count)
    }

    /// Reads up to `count` elements from element `start`, converted to `T` (fewer where the
    /// tensor ends first): the rows a gather reads, without the rest of the table.
    pub fn read_vec_range<T: Element>(&self, start: usize, count: usize) -> Result<Vec<T>> {
        let dtype = self.dtype()?;
        let size = dtype.size().ok_or_else(|| ShimError::Unsupported(format!("reading {dtype} elements")))?;
        if dtype == T::DTYPE && element::is_plain::<T>() {
            // Straight into the elements' memory: no byte buffer, no conversion.
            let n = (self.nbytes()? / size).saturating_sub(start).min(count);
            let mut out = vec![T::default(); n];
            if let Some(bytes) = element::laid_bytes_mut(&mut out).filter(|b| !b.is_empty()) {
                host::read(self.desc.handle, (start * size) as u64, bytes)
                    .map_err(|c| ShimError::Failed(format!("reading {}: host refused ({c})", self.what())))?;
                return Ok(out);
            }
        }
        element::decode_as::<T>(dtype, &self.read_bytes_range(start.saturating_mul(size), count.saturating_mul(size))?)
    }

    /// Reads up to `len` bytes from byte `offset` (fewer where the tensor ends first).
    pub fn read_bytes_range(&self, offset: usize, len: usize) -> Result<Vec<u8>> {
        let total = self.nbytes()?;
        let n = total.saturating_sub(offset).min(len);
        let mut buf = vec![0u8; n];
        if n > 0 {
            host::read(self.desc.handle, offset as u64, &mut buf)
                .map_err(|c| ShimError::Failed(format!("reading {}: host refused ({c})", self.what())))?;
        }
        Ok(buf)
    }

    /// Writes `bytes` at `offset` (CPU calls only).
    pub fn write_bytes_at(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        host::write(self.desc.handle, offset, bytes)
            .map_err(|c| ShimError::Failed(format!("writing {}: host refused ({c})", self.what())))
    }

    /// Writes the whole tensor.
    pub fn write_bytes(&self, bytes: &[u8]) -> Result<()> {
        self.write_bytes_at(0, bytes)
    }

    /// Writes `values` converted to this tensor's dtype.
    pub fn write_vec<T: Element>(&self, values: &[T]) -> Result<()> {
        self.write_vec_at(0, values)
    }

    /// The elements of a string tensor (ABI.md §6, [`crate::strings`]): inline for a value
    /// input, else read through the host (CPU calls). Errors: another dtype, or bytes that are
    /// not a string tensor of this shape.
    pub fn read_strings(&self) -> Result<Vec<Vec<u8>>> {
        let d = self.dtype()?;
        if d != DType::String {
            return Err(ShimError::Failed(format!("{}: a {d} tensor where strings are expected", self.what())));
        }
        let n = self.numel()?;
        let bytes = match self.value() {
            Some(v) => Vec::from(v),
            None => {
                let table = crate::strings::table_bytes(n)
                    .ok_or_else(|| ShimError::Failed(format!("{}: too many strings", self.what())))?;
                let refused = |c| ShimError::Failed(format!("reading {}: host refused ({c})", self.what()));
                let mut all = vec![0u8; table];
                host::read(self.desc.handle, 0, &mut all).map_err(refused)?;
                let text = u32::from_le_bytes([all[4 * n], all[4 * n + 1], all[4 * n + 2], all[4 * n + 3]]) as usize;
                all.resize(table + text, 0);
                if text > 0 {
                    host::read(self.desc.handle, table as u64, &mut all[table..]).map_err(refused)?;
                }
                all
            }
        };
        let elements =
            crate::strings::decode(&bytes, n).map_err(|e| ShimError::Failed(format!("{}: {e}", self.what())))?;
        Ok(elements.into_iter().map(Vec::from).collect())
    }

    /// Writes a string tensor's elements (numel of them, in order; ABI.md §6).
    pub fn write_strings<S: AsRef<[u8]>>(&self, elements: &[S]) -> Result<()> {
        let bytes = crate::strings::encode(elements).map_err(|e| ShimError::Failed(format!("{}: {e}", self.what())))?;
        self.write_bytes(&bytes)
    }

    /// Writes `values` converted to this tensor's dtype from element `start` on (a tile's
    /// share, ABI.md §6.1.2). Errors: a packed dtype past element 0 (its elements share bytes).
    pub fn write_vec_at<T: Element>(&self, start: usize, values: &[T]) -> Result<()> {
        let dtype = self.dtype()?;
        if let Some(bytes) = element::laid_bytes(values).filter(|_| dtype == T::DTYPE) {
            // The elements' own memory: no byte buffer, no conversion.
            return self.write_bytes_at(start as u64 * T::SIZE as u64, bytes);
        }
        // From element 0 any dtype, packed ones included; past it a whole number of bytes each.
        let at = match start {
            0 => 0,
            _ => {
                let size = dtype
                    .size()
                    .ok_or_else(|| ShimError::Unsupported(format!("writing {dtype} elements at an offset")))?;
                start as u64 * size as u64
            }
        };
        self.write_bytes_at(at, &element::encode_as(dtype, values)?)
    }
}
