//! I/O binding: tensors a caller keeps on the session's device between runs (a KV cache),
//! fed without a copy and written in place, as onnxruntime's `IOBinding` does.
//!
//! A [`DeviceTensor`] is a handle; the session owns the buffer (device memory on a GPU, host
//! bytes on the CPU) until the handle is dropped. Feeding it ([`Feed::Device`]) gives the graph its buffer as-is;
//! [`Fetch::Into`] makes the node that produces an output write straight into it (when the
//! output fits), and [`Fetch::Device`] keeps an output on the device as a new handle.
//!
//! Binding an output into the buffer of an input is the caller's promise that the producing
//! node may update that input in place (GroupQueryAttention's shared past/present buffer,
//! `past_present_share_buffer` of onnxruntime-genai); other nodes reading the input must not
//! run after the producer.
//!
//! [`HeldTensors`] is a session's table of them: handles to values, views, reserved address
//! ranges (among them paged KV caches, `super::pages`), and the queue of dropped handles. Its operations take the session's device backend
//! (`backend`); the session's public methods call them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kiln_kernel_abi::DType;

use super::backend::Backend;
use super::pages::{KvPages, PagedArena, PAGE_POSITIONS};
use super::value::Value;
use crate::cuda::Gpu;
use crate::tensor::byte_size;
use crate::{Error, Result, Tensor};

/// A tensor held by one session between runs. Not `Clone`: the handle is the ownership.
/// Dropping it gives the buffer back to the device's pool (stream-ordered, so work already
/// enqueued that reads it finishes first): at the session's next run or allocation, or at once
/// with [`super::Session::reclaim`].
#[derive(Debug)]
pub struct DeviceTensor {
    session: u64,
    id: u64,
    /// The session's queue of dropped handles.
    dropped: Dropped,
}

/// The ids of a session's dropped [`DeviceTensor`]s, not given back yet.
type Dropped = Arc<Mutex<Vec<u64>>>;

impl PartialEq for DeviceTensor {
    fn eq(&self, other: &Self) -> bool {
        (self.session, self.id) == (other.session, other.id)
    }
}

impl Eq for DeviceTensor {}

impl Drop for DeviceTensor {
    fn drop(&mut self) {
        // A poisoned queue (a panic while it was locked) only loses this buffer until the
        // session is dropped.
        if let Ok(mut q) = self.dropped.lock() {
            q.push(self.id);
        }
    }
}

/// A graph input of a run.
#[derive(Debug)]
pub enum Feed<'a> {
    /// Host bytes (uploaded on a GPU).
    Host(Tensor),
    /// A held tensor, given to the graph without a copy.
    Device(&'a DeviceTensor),
}

/// Where a graph output goes.
#[derive(Debug)]
pub enum Fetch<'a> {
    /// Back to the host (the default for outputs not named).
    Host,
    /// Kept on the device as a new held tensor.
    Device,
    /// Written into this held tensor (in place when the producing node can write there; its
    /// dtype must match and its bytes fit the tensor's buffer). The tensor takes the output's
    /// shape. An in-place write changes every input fed from the same tensor; after a failed
    /// run the tensor's bytes may be partly written.
    Into(&'a DeviceTensor),
    /// Not wanted: the output is not returned, and nodes that only it needs do not run (as
    /// onnxruntime runs only what the requested outputs need). Graph inputs that only such
    /// nodes read need not be fed.
    Skip,
}

/// A read of a held tensor that [`super::Session::read_start`] started: the copy is enqueued
/// behind the device's work so far; [`super::Session::read_finish`] waits for it.
#[derive(Debug)]
pub enum PendingRead {
    /// The tensor already had its bytes on the host.
    Host(Tensor),
    /// A copy in flight, and the tensor it makes.
    Device { download: crate::cuda::PendingDownload, dtype: DType, shape: Vec<usize> },
}

/// A graph output of a run.
#[derive(Debug)]
pub enum Fetched {
    Host(Tensor),
    Device(DeviceTensor),
    /// Written into the tensor of [`Fetch::Into`].
    Written,
}

impl Fetched {
    /// The host tensor of a [`Fetch::Host`] output.
    pub fn into_host(self) -> Result<Tensor> {
        match self {
            Fetched::Host(t) => Ok(t),
            _ => Err(Error::Input("the output was not fetched to the host".into())),
        }
    }
}

/// A held tensor: its value (owning its device buffer on a GPU, unless it is a view or
/// reserved) and the buffer's capacity.
#[derive(Debug)]
pub(super) struct Held {
    pub value: Value,
    pub capacity: u64,
    /// The reserved addresses of a [`super::Session::reserve`]d tensor, mapped for its value's rows.
    pub reserved: Option<Reserved>,
    /// A view's parent (the held tensor whose buffer it reads and writes).
    pub parent: Option<u64>,
    /// Views of this tensor not reclaimed yet: its buffer outlives its handle until they go.
    pub views: usize,
    /// Its handle was dropped while views of it remained.
    pub orphaned: bool,
}

/// A reserved tensor's addresses.
#[derive(Debug)]
pub(super) enum Reserved {
    /// Room for `rows` rows, mapped for the value's first dimension ([`super::Session::reserve`]).
    Rows { buffer: crate::cuda::VirtualBuffer, rows: usize },
    /// A paged KV cache ([`super::Session::reserve_pages`]), which views of its cache tensors
    /// read and write.
    Pages(PagedArena),
}

impl Held {
    /// Whether an output of `dtype` and `nbytes` may be written into this tensor.
    pub fn fits(&self, dtype: DType, nbytes: u64) -> bool {
        self.value.dtype() == dtype && nbytes <= self.capacity
    }

    /// The device buffer (`None` on the CPU).
    pub fn device_ptr(&self) -> Option<u64> {
        self.value.device_ptr()
    }
}

static NEXT_SESSION: AtomicU64 = AtomicU64::new(1);

/// One session's held tensors.
pub(super) struct HeldTensors {
    /// The session's process-unique number: handles of another session are refused.
    number: u64,
    map: HashMap<u64, Held>,
    /// Handles dropped since the last [`HeldTensors::reclaim`].
    dropped: Dropped,
    next: u64,
}

fn freed() -> Error {
    Error::Input("the device tensor was freed".into())
}

/// Checks that elements `start .. start + len` lie within `v`.
fn check_range(v: &Value, start: usize, len: usize) -> Result<()> {
    let numel = v.shape().iter().product::<usize>();
    if start.checked_add(len).is_none_or(|end| end > numel) {
        return Err(Error::Input(format!("elements {start}..{} of a tensor of {numel}", start.saturating_add(len))));
    }
    Ok(())
}

impl HeldTensors {
    pub fn new() -> HeldTensors {
        HeldTensors {
            number: NEXT_SESSION.fetch_add(1, Ordering::Relaxed),
            map: HashMap::new(),
            dropped: Dropped::default(),
            next: 1,
        }
    }

    /// The held tensor of handle `t`. Errors: a handle of another session, or a freed one.
    pub fn get(&self, t: &DeviceTensor) -> Result<&Held> {
        self.check(t)?;
        self.map.get(&t.id).ok_or_else(freed)
    }

    /// [`HeldTensors::get`], to change.
    pub fn get_mut(&mut self, t: &DeviceTensor) -> Result<&mut Held> {
        self.check(t)?;
        self.map.get_mut(&t.id).ok_or_else(freed)
    }

    fn check(&self, t: &DeviceTensor) -> Result<()> {
        if t.session != self.number {
            return Err(Error::Input("the device tensor belongs to another session".into()));
        }
        Ok(())
    }

    /// The id of handle `t`, which this session holds. Errors: as [`HeldTensors::get`].
    pub fn id(&self, t: &DeviceTensor) -> Result<u64> {
        self.get(t).map(|_| t.id)
    }

    pub fn by_id(&self, id: u64) -> Option<&Held> {
        self.map.get(&id)
    }

    /// [`HeldTensors::by_id`], to change.
    pub fn by_id_mut(&mut self, id: u64) -> Option<&mut Held> {
        self.map.get_mut(&id)
    }

    /// How many tensors are held (dropped ones not reclaimed yet included).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Holds `value`, whose buffer has `capacity` bytes; returns its handle.
    pub fn hold(&mut self, mut value: Value, capacity: u64) -> DeviceTensor {
        // A held buffer may be written in place later: a host copy of its bytes would go stale.
        if let Value::Device { host, .. } = &mut value {
            *host = None;
        }
        let id = self.next;
        self.next += 1;
        self.map.insert(id, Held { value, capacity, reserved: None, parent: None, views: 0, orphaned: false });
        DeviceTensor { session: self.number, id, dropped: self.dropped.clone() }
    }

    /// Sets held tensor `id`'s shape and logical size after a write of `shape` into it.
    pub fn set_shape(&mut self, id: u64, shape: Vec<usize>, nbytes: u64) {
        if let Some(Held { value: Value::Device { shape: s, nbytes: n, .. }, .. }) = self.map.get_mut(&id) {
            *s = shape;
            *n = nbytes;
        }
    }

    /// A view of the first elements of `t` as a tensor of `shape` (see [`super::Session::view`]).
    pub fn view(&mut self, t: &DeviceTensor, shape: Vec<usize>) -> Result<DeviceTensor> {
        let h = self.get(t)?;
        let Value::Device { dtype, ptr, .. } = h.value else {
            return Err(Error::Unsupported("views of held tensors need a GPU session".into()));
        };
        h.value.check_row_major("a view")?;
        let root = h.parent.unwrap_or(t.id);
        let nbytes = byte_size(dtype, &shape)?;
        if nbytes > h.capacity {
            return Err(Error::Input(format!(
                "a view of shape {shape:?} ({nbytes} bytes) is larger than its tensor ({} bytes)",
                h.capacity
            )));
        }
        let value = Value::Device { dtype, shape, ptr, nbytes, owned: None, host: None, paged: None };
        Ok(self.hold_view(root, value, nbytes))
    }

    /// Holds `value`, a view of held tensor `root`'s buffer (which then outlives its handle
    /// until the view goes).
    fn hold_view(&mut self, root: u64, value: Value, capacity: u64) -> DeviceTensor {
        if let Some(r) = self.map.get_mut(&root) {
            r.views += 1;
        }
        let v = self.hold(value, capacity);
        if let Some(h) = self.map.get_mut(&v.id) {
            h.parent = Some(root);
        }
        v
    }

    /// A new paged KV cache of `pages` of `dtype`, its addresses reserved on `gpu` and nothing
    /// mapped (see [`super::Session::reserve_pages`]).
    pub fn reserve_pages(&mut self, gpu: &mut Gpu, dtype: DType, pages: KvPages) -> Result<DeviceTensor> {
        let arena = PagedArena::reserve(gpu, dtype, pages)?;
        let ptr = arena.buffer.ptr();
        let value = Value::Device { dtype, shape: vec![0], ptr, nbytes: 0, owned: None, host: None, paged: None };
        let t = self.hold(value, 0);
        if let Some(h) = self.map.get_mut(&t.id) {
            h.reserved = Some(Reserved::Pages(arena));
        }
        Ok(t)
    }

    /// The paged KV cache `t` holds. Errors: another tensor.
    fn arena(&self, t: &DeviceTensor) -> Result<&PagedArena> {
        match &self.get(t)?.reserved {
            Some(Reserved::Pages(a)) => Ok(a),
            _ => Err(Error::Input("not a paged KV cache (Session::reserve_pages)".into())),
        }
    }

    /// A view of cache tensor `i` over the first `rows` rows of paged KV cache `t` (see
    /// [`super::Session::page_view`]).
    pub fn page_view(&mut self, t: &DeviceTensor, i: usize, rows: usize) -> Result<DeviceTensor> {
        let a = self.arena(t)?;
        let (ptr, layout) = a.view(i, rows)?;
        let p = a.geometry.pages;
        let nbytes = a.geometry.view_bytes(rows);
        let shape = vec![rows, p.kv_heads, p.positions, p.head_size];
        let value = Value::Device { dtype: a.dtype, shape, ptr, nbytes, owned: None, host: None, paged: Some(layout) };
        Ok(self.hold_view(t.id, value, nbytes))
    }

    /// Maps the rows of paged KV cache `t` (see [`super::Session::map_pages`]).
    pub fn map_pages(
        &mut self,
        gpu: &mut Gpu,
        t: &DeviceTensor,
        (rows, positions): (usize, usize),
        chunk: u64,
        trim: bool,
    ) -> Result<()> {
        match self.get_mut(t)?.reserved.as_mut() {
            Some(Reserved::Pages(a)) => a.map(gpu, rows, positions, chunk, trim),
            _ => Err(Error::Input("not a paged KV cache (Session::reserve_pages)".into())),
        }
    }

    /// Copies the first `positions` positions of row `src_row` of row-major cache tensor `src`
    /// (`[batch, kv_heads, length, head_size]`) into row `dst_row` of cache tensor `i` of paged
    /// KV cache `t` (see [`super::Session::copy_into_pages`]).
    #[allow(clippy::too_many_arguments)]
    pub fn copy_into_pages(
        &self,
        gpu: &mut Gpu,
        (src, src_row): (&DeviceTensor, usize),
        (t, i, dst_row): (&DeviceTensor, usize, usize),
        positions: usize,
    ) -> Result<()> {
        let a = self.arena(t)?;
        let s = &self.get(src)?.value;
        s.check_row_major("a copy")?;
        let (g, p) = (&a.geometry, a.geometry.pages);
        let shape = s.shape();
        let fits = shape.len() == 4
            && shape[1] == p.kv_heads
            && shape[3] == p.head_size
            && src_row < shape[0]
            && positions <= shape[2].min(p.positions)
            && i < p.tensors
            && dst_row < p.rows;
        if s.dtype() != a.dtype || !fits {
            return Err(Error::Input(format!(
                "{positions} positions of row {src_row} of a {} {shape:?} cache tensor into row {dst_row} of cache \
                 tensor {i} of a {} paged KV cache of {p:?}",
                s.dtype(),
                a.dtype
            )));
        }
        if a.mapped(dst_row) < g.bytes_for(positions) {
            return Err(Error::Input(format!(
                "row {dst_row} of the paged KV cache has not mapped {positions} positions"
            )));
        }
        let src_ptr = s.device_ptr().ok_or_else(|| Error::Device("a host tensor in a GPU session".into()))?;
        let (run, len) = ((PAGE_POSITIONS * p.head_size) as u64 * g.elem, shape[2]);
        let (full, rest) = ((positions / PAGE_POSITIONS) as u64, (positions % PAGE_POSITIONS) as u64);
        let page = g.page_stride * g.elem;
        for h in 0..p.kv_heads {
            let from = src_ptr + ((src_row * p.kv_heads + h) * len * p.head_size) as u64 * g.elem;
            let to = a.buffer.ptr() + g.row_offset(dst_row) + g.tensor_offset(i) + h as u64 * run;
            gpu.copy_2d(to, page, from, run, run, full)?;
            gpu.copy(to + full * page, from + full * run, rest * p.head_size as u64 * g.elem)?;
        }
        Ok(())
    }

    /// Copies the first `positions` positions of every cache tensor from row `src.1` of paged KV
    /// cache `src.0` to row `dst.1` of paged KV cache `dst.0` (the same cache, or one of the same
    /// pages) (see [`super::Session::copy_pages`]).
    pub fn copy_pages(
        &self,
        gpu: &mut Gpu,
        (src, src_row): (&DeviceTensor, usize),
        (dst, dst_row): (&DeviceTensor, usize),
        positions: usize,
    ) -> Result<()> {
        let (a, b) = (self.arena(src)?, self.arena(dst)?);
        let (ga, gb) = (&a.geometry, &b.geometry);
        let (pa, pb) = (ga.pages, gb.pages);
        if a.dtype != b.dtype
            || ga.page_stride != gb.page_stride
            || (pa.tensors, pa.kv_heads) != (pb.tensors, pb.kv_heads)
        {
            return Err(Error::Input(format!(
                "rows copy between paged KV caches of the same pages: {} {pa:?} and {} {pb:?}",
                a.dtype, b.dtype
            )));
        }
        let bytes = ga.bytes_for(positions.min(pa.positions).min(pb.positions));
        if src_row >= pa.rows || dst_row >= pb.rows || a.mapped(src_row).min(b.mapped(dst_row)) < bytes {
            return Err(Error::Input(format!(
                "{positions} positions from row {src_row} of a paged KV cache of {} rows to row {dst_row} of one of {} \
                 (both rows must have them mapped)",
                pa.rows, pb.rows
            )));
        }
        gpu.copy(b.buffer.ptr() + gb.row_offset(dst_row), a.buffer.ptr() + ga.row_offset(src_row), bytes)
    }

    /// A new tensor of `dtype` whose addresses on `gpu` are reserved for `shape` (`nbytes`) and
    /// whose first `mapped` rows are mapped, zeros (see [`super::Session::reserve`]).
    pub fn reserve(
        &mut self,
        gpu: &mut Gpu,
        dtype: DType,
        shape: Vec<usize>,
        nbytes: u64,
        mapped: usize,
    ) -> Result<DeviceTensor> {
        let rows = shape.first().copied().unwrap_or(1);
        if mapped > rows {
            return Err(Error::Input(format!("{mapped} rows mapped of a tensor of shape {shape:?}")));
        }
        let buffer = gpu.reserve(nbytes)?;
        let value = Value::Device { dtype, shape, ptr: buffer.ptr(), nbytes: 0, owned: None, host: None, paged: None };
        let t = self.hold(value, 0);
        if let Some(h) = self.map.get_mut(&t.id) {
            h.reserved = Some(Reserved::Rows { buffer, rows });
        }
        self.map_rows(gpu, &t, mapped)?;
        Ok(t)
    }

    /// Maps the first `rows` rows of reserved tensor `t` (see [`super::Session::map_rows`]).
    pub fn map_rows(&mut self, gpu: &mut Gpu, t: &DeviceTensor, rows: usize) -> Result<()> {
        let h = self.get(t)?;
        let Some(Reserved::Rows { rows: reserved, .. }) = &h.reserved else {
            return Err(Error::Input("map_rows of a tensor that Session::reserve did not make".into()));
        };
        if rows > *reserved {
            return Err(Error::Input(format!("{rows} rows of a tensor reserved for {reserved}")));
        }
        let dtype = h.value.dtype();
        let mut shape = h.value.shape().to_vec();
        if let Some(first) = shape.first_mut() {
            *first = rows;
        }
        let nbytes = byte_size(dtype, &shape)?;
        if let Some(v) = self.map.values().find(|v| v.parent == Some(t.id) && v.capacity > nbytes) {
            return Err(Error::Input(format!(
                "a view of {} bytes still reads a reserved tensor being unmapped to {nbytes} bytes",
                v.capacity
            )));
        }
        let Some(Held { reserved: Some(Reserved::Rows { buffer, .. }), value, capacity, .. }) = self.map.get_mut(&t.id)
        else {
            return Err(Error::Device("a reserved tensor lost its addresses".into()));
        };
        let old = *capacity;
        if nbytes > old {
            // Rows newly in use are zeros, whether their chunk is new or was mapped already.
            gpu.map(buffer, nbytes)?;
            gpu.zero(buffer.ptr() + old, nbytes - old)?;
        } else {
            buffer.unmap_past(nbytes)?;
        }
        if let Value::Device { shape: s, nbytes: n, .. } = value {
            *s = shape;
            *n = nbytes;
        }
        *capacity = nbytes;
        Ok(())
    }

    /// Gives the buffers of dropped handles back to the pool (a tensor that views still read
    /// goes with the last of them).
    pub fn reclaim(&mut self) {
        let ids: Vec<u64> = match self.dropped.lock() {
            Ok(mut q) => std::mem::take(&mut *q),
            Err(_) => return,
        };
        for id in ids {
            let Some(mut h) = self.map.remove(&id) else { continue };
            if h.views > 0 {
                // Views still read its buffer: it goes with the last of them.
                h.orphaned = true;
                self.map.insert(id, h);
                continue;
            }
            let Some(p) = h.parent else { continue };
            let last = self.map.get_mut(&p).is_some_and(|r| {
                r.views -= 1;
                r.views == 0 && r.orphaned
            });
            if last {
                self.map.remove(&p);
            }
        }
    }

    /// A new held tensor of zeros (`nbytes` bytes of `dtype` and `shape`) on `backend`'s device.
    pub fn zeros(
        &mut self,
        backend: &mut dyn Backend,
        dtype: DType,
        shape: Vec<usize>,
        nbytes: u64,
    ) -> Result<DeviceTensor> {
        let value = backend.zeros(dtype, shape, nbytes)?;
        Ok(self.hold(value, nbytes))
    }

    /// Copies host tensor `t` into held tensor `dst` (see [`super::Session::write_tensor`]).
    pub fn write_tensor(&mut self, backend: &mut dyn Backend, dst: &DeviceTensor, t: &Tensor) -> Result<()> {
        let h = self.get(dst)?;
        let nbytes = t.data.len() as u64;
        if !h.fits(t.dtype, nbytes) {
            return Err(Error::Input(format!(
                "a {} tensor of {nbytes} bytes does not fit a held {} tensor of {} bytes",
                t.dtype,
                h.value.dtype(),
                h.capacity
            )));
        }
        let h = self.get_mut(dst)?;
        if h.value.is_device() {
            backend.write(&mut h.value, 0, &t.data)?;
            self.set_shape(dst.id, t.shape.clone(), nbytes);
        } else {
            h.value = Value::Host(t.clone());
        }
        Ok(())
    }

    /// Copies elements between held tensors (see [`super::Session::copy_elements`]).
    pub fn copy_elements(
        &mut self,
        backend: &mut dyn Backend,
        src: &DeviceTensor,
        src_start: usize,
        dst: &DeviceTensor,
        dst_start: usize,
        len: usize,
    ) -> Result<()> {
        if src == dst {
            return Err(Error::Input("copy_elements within one tensor".into()));
        }
        let s = self.get(src)?.value.clone_ref();
        let d = &self.get(dst)?.value;
        let dtype = s.dtype();
        if d.dtype() != dtype {
            return Err(Error::Input(format!("copy_elements from a {dtype} tensor into a {} tensor", d.dtype())));
        }
        let size = dtype.size().ok_or_else(|| Error::Unsupported(format!("{dtype} tensors")))?;
        check_range(&s, src_start, len)?;
        check_range(d, dst_start, len)?;
        let d = &mut self.get_mut(dst)?.value;
        backend.copy(&s, src_start * size, d, dst_start * size, len * size)
    }

    /// Writes `values` into elements of held tensor `dst` (see
    /// [`super::Session::write_elements`]).
    pub fn write_elements(
        &mut self,
        backend: &mut dyn Backend,
        dst: &DeviceTensor,
        start: usize,
        values: &Tensor,
    ) -> Result<()> {
        let d = &self.get(dst)?.value;
        if d.dtype() != values.dtype {
            return Err(Error::Input(format!("write_elements of {} values into a {} tensor", values.dtype, d.dtype())));
        }
        let size = values.dtype.size().ok_or_else(|| Error::Unsupported(format!("{} tensors", values.dtype)))?;
        check_range(d, start, values.data.len() / size)?;
        let d = &mut self.get_mut(dst)?.value;
        backend.write(d, start * size, &values.data)
    }

    /// Elements `start .. start + len` of held tensor `t` as a 1-D host tensor (see
    /// [`super::Session::read_slice`]).
    pub fn read_slice(&self, backend: &mut dyn Backend, t: &DeviceTensor, start: usize, len: usize) -> Result<Tensor> {
        let v = &self.get(t)?.value;
        let dtype = v.dtype();
        let size = dtype.size().ok_or_else(|| Error::Unsupported(format!("{dtype} tensors")))?;
        check_range(v, start, len)?;
        backend.read(v, start * size, dtype, vec![len])
    }
}
