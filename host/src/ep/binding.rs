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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kiln_kernel_abi::DType;

use super::session::{Session, Value};
use crate::tensor::byte_size;
use crate::{Error, Result, Tensor};

/// A tensor held by one session between runs. Not `Clone`: the handle is the ownership.
/// Dropping it gives the buffer back to the session's pool (stream-ordered, so work already
/// enqueued that reads it finishes first): at the session's next run or allocation, or at once
/// with [`Session::reclaim`].
#[derive(Debug)]
pub struct DeviceTensor {
    pub(super) session: u64,
    pub(super) id: u64,
    /// The session's queue of dropped handles.
    pub(super) dropped: Dropped,
}

/// The ids of a session's dropped [`DeviceTensor`]s, not given back yet.
pub(super) type Dropped = Arc<Mutex<Vec<u64>>>;

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

/// A read of a held tensor that [`Session::read_start`] started: the copy is enqueued behind
/// the device's work so far; [`Session::read_finish`] waits for it.
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
    /// The reserved addresses of a [`Session::reserve`]d tensor, mapped for its value's rows.
    pub reserved: Option<Reserved>,
    /// A view's parent (the held tensor whose buffer it reads and writes).
    pub parent: Option<u64>,
    /// Views of this tensor not reclaimed yet: its buffer outlives its handle until they go.
    pub views: usize,
    /// Its handle was dropped while views of it remained.
    pub orphaned: bool,
}

/// A reserved tensor's addresses: room for `rows` rows, mapped for the value's first dimension.
#[derive(Debug)]
pub(super) struct Reserved {
    pub buffer: crate::cuda::VirtualBuffer,
    pub rows: usize,
}

impl Held {
    /// Whether an output of `dtype` and `nbytes` may be written into this tensor.
    pub fn fits(&self, dtype: DType, nbytes: u64) -> bool {
        self.value.dtype() == dtype && nbytes <= self.capacity
    }

    /// The device buffer (`None` on the CPU).
    pub fn device_ptr(&self) -> Option<u64> {
        match self.value {
            Value::Device { ptr, .. } => Some(ptr),
            Value::Host(_) => None,
        }
    }
}

static NEXT_SESSION: AtomicU64 = AtomicU64::new(1);

/// A process-unique session number, so handles of another session are refused.
pub(super) fn session_number() -> u64 {
    NEXT_SESSION.fetch_add(1, Ordering::Relaxed)
}

impl Session {
    fn held(&self, t: &DeviceTensor) -> Result<&Held> {
        if t.session != self.number {
            return Err(Error::Input("the device tensor belongs to another session".into()));
        }
        self.held.get(&t.id).ok_or_else(|| Error::Input("the device tensor was freed".into()))
    }

    fn hold(&mut self, mut value: Value, capacity: u64) -> DeviceTensor {
        // A held buffer may be written in place later: a host copy of its bytes would go stale.
        if let Value::Device { host, .. } = &mut value {
            *host = None;
        }
        let id = self.next_held;
        self.next_held += 1;
        self.held.insert(id, Held { value, capacity, reserved: None, parent: None, views: 0, orphaned: false });
        DeviceTensor { session: self.number, id, dropped: self.dropped.clone() }
    }

    /// A view of the first elements of held device tensor `t` as a tensor of `shape` (its
    /// dtype): the same device buffer from its start, so writes through either are seen by the
    /// other, and its address is `t`'s. A KV cache of `[rows, heads, positions, size]` viewed
    /// as `[n, heads, positions, size]` is the cache of its first `n` rows. `t`'s buffer stays
    /// until every view of it is dropped, whenever `t` is. A view of a view views its parent.
    /// Errors: a CPU session (host tensors are not shared), a shape larger than `t`, a freed or
    /// foreign handle.
    pub fn view(&mut self, t: &DeviceTensor, shape: Vec<usize>) -> Result<DeviceTensor> {
        let h = self.held(t)?;
        let Value::Device { dtype, ptr, .. } = h.value else {
            return Err(Error::Unsupported("views of held tensors need a GPU session".into()));
        };
        let root = h.parent.unwrap_or(t.id);
        let nbytes = byte_size(dtype, &shape)?;
        if nbytes > h.capacity {
            return Err(Error::Input(format!(
                "a view of shape {shape:?} ({nbytes} bytes) is larger than its tensor ({} bytes)",
                h.capacity
            )));
        }
        let value = Value::Device { dtype, shape, ptr, nbytes, owned: None, host: None };
        if let Some(r) = self.held.get_mut(&root) {
            r.views += 1;
        }
        let v = self.hold(value, nbytes);
        if let Some(h) = self.held.get_mut(&v.id) {
            h.parent = Some(root);
        }
        Ok(v)
    }

    /// The bytes of a new held tensor of `dtype` and `shape`. Errors: unsupported dtype, size
    /// overflow, over the session's limit per tensor.
    fn new_tensor_bytes(&self, dtype: DType, shape: &[usize]) -> Result<u64> {
        let nbytes = byte_size(dtype, shape)?;
        if nbytes > self.max_tensor_bytes {
            return Err(Error::Input(format!(
                "a {dtype} tensor of shape {shape:?} ({nbytes} bytes) is over the limit of {} bytes per tensor",
                self.max_tensor_bytes
            )));
        }
        Ok(nbytes)
    }

    /// A new held tensor of `dtype` whose addresses are reserved for `shape` (`[rows, ...]`)
    /// and whose first `mapped` rows are mapped, zeros: the tensor has shape `[mapped, ...]`.
    /// [`Session::map_rows`] maps more rows or fewer, at the same address; views of its first
    /// rows ([`Session::view`]) are how work reads it. A KV cache whose rows follow a batch's
    /// load lives so: its address never moves, so each row count's captured graph stays valid,
    /// and only the rows in use hold memory. Errors: a CPU session, `mapped` over the rows,
    /// size overflow, the per-tensor limit, the device-memory limit (nothing is held then).
    pub fn reserve(&mut self, dtype: DType, shape: Vec<usize>, mapped: usize) -> Result<DeviceTensor> {
        self.reclaim();
        let nbytes = self.new_tensor_bytes(dtype, &shape)?;
        let rows = shape.first().copied().unwrap_or(1);
        if mapped > rows {
            return Err(Error::Input(format!("{mapped} rows mapped of a tensor of shape {shape:?}")));
        }
        let gpu = self.gpu.as_mut().ok_or_else(|| Error::Unsupported("reserved tensors need a GPU session".into()))?;
        let buffer = gpu.reserve(nbytes)?;
        let value = Value::Device { dtype, shape, ptr: buffer.ptr(), nbytes: 0, owned: None, host: None };
        let t = self.hold(value, 0);
        if let Some(h) = self.held.get_mut(&t.id) {
            h.reserved = Some(Reserved { buffer, rows });
        }
        self.map_rows(&t, mapped)?;
        Ok(t)
    }

    /// Maps the first `rows` rows of reserved tensor `t` (growing: the new rows are zeros;
    /// shrinking: the chunks past them are unmapped behind a fence, the device's work so far
    /// finished first), which then has shape `[rows, ...]` at its same address. Growth maps
    /// whole chunks of the device's granularity, so a little more may be mapped than asked.
    /// Errors: not a reserved tensor, more rows than reserved, a view still reading rows past
    /// `rows`, the device-memory limit or the driver's (the tensor stays as it was).
    pub fn map_rows(&mut self, t: &DeviceTensor, rows: usize) -> Result<()> {
        self.reclaim();
        let h = self.held(t)?;
        let Some(r) = &h.reserved else {
            return Err(Error::Input("map_rows of a tensor that Session::reserve did not make".into()));
        };
        if rows > r.rows {
            return Err(Error::Input(format!("{rows} rows of a tensor reserved for {}", r.rows)));
        }
        let dtype = h.value.dtype();
        let mut shape = h.value.shape().to_vec();
        if let Some(first) = shape.first_mut() {
            *first = rows;
        }
        let nbytes = byte_size(dtype, &shape)?;
        if let Some(v) = self.held.values().find(|v| v.parent == Some(t.id) && v.capacity > nbytes) {
            return Err(Error::Input(format!(
                "a view of {} bytes still reads a reserved tensor being unmapped to {nbytes} bytes",
                v.capacity
            )));
        }
        let gpu = self.gpu.as_mut().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
        let Some(Held { reserved: Some(r), value, capacity, .. }) = self.held.get_mut(&t.id) else {
            return Err(Error::Device("a reserved tensor lost its addresses".into()));
        };
        let old = *capacity;
        if nbytes > old {
            // Rows newly in use are zeros, whether their chunk is new or was mapped already.
            gpu.map(&mut r.buffer, nbytes)?;
            gpu.zero(r.buffer.ptr() + old, nbytes - old)?;
        } else {
            r.buffer.unmap_past(nbytes)?;
        }
        if let Value::Device { shape: s, nbytes: n, .. } = value {
            *s = shape;
            *n = nbytes;
        }
        *capacity = nbytes;
        Ok(())
    }

    /// Gives the buffers of dropped [`DeviceTensor`]s back to the pool now (runs and
    /// allocations do it first anyway).
    pub fn reclaim(&mut self) {
        let ids: Vec<u64> = match self.dropped.lock() {
            Ok(mut q) => std::mem::take(&mut *q),
            Err(_) => return,
        };
        for id in ids {
            let Some(mut h) = self.held.remove(&id) else { continue };
            if h.views > 0 {
                // Views still read its buffer: it goes with the last of them.
                h.orphaned = true;
                self.held.insert(id, h);
                continue;
            }
            let parent = h.parent;
            self.release(h.value);
            let Some(p) = parent else { continue };
            let last = self.held.get_mut(&p).is_some_and(|r| {
                r.views -= 1;
                r.views == 0 && r.orphaned
            });
            if let Some(r) = last.then(|| self.held.remove(&p)).flatten() {
                self.release(r.value);
            }
        }
    }

    /// How many tensors the session holds (dropped ones not reclaimed yet included).
    pub fn held_tensors(&self) -> usize {
        self.held.len()
    }

    /// A new held tensor of zeros, `dtype` and `shape`. Errors: unsupported dtype, size overflow,
    /// device memory limit.
    pub fn zeros(&mut self, dtype: DType, shape: Vec<usize>) -> Result<DeviceTensor> {
        self.reclaim();
        let nbytes = self.new_tensor_bytes(dtype, &shape)?;
        let value = match self.gpu.as_mut() {
            None => Value::Host(Tensor::new(dtype, shape, bytes::Bytes::from(vec![0u8; nbytes as usize]))?),
            Some(gpu) => {
                let b = gpu.zeroed(nbytes)?;
                Value::Device { dtype, shape, ptr: b.ptr, nbytes, owned: Some(b), host: None }
            }
        };
        Ok(self.hold(value, nbytes))
    }

    /// The device address of a held tensor (`None` on the CPU): a view's is its parent's, and a
    /// reserved tensor's never moves while it grows. Errors: a freed or foreign handle.
    pub fn device_address(&self, t: &DeviceTensor) -> Result<Option<u64>> {
        Ok(self.held(t)?.device_ptr())
    }

    /// Dtype and current shape of a held tensor.
    pub fn tensor_type(&self, t: &DeviceTensor) -> Result<(DType, Vec<usize>)> {
        let h = self.held(t)?;
        Ok((h.value.dtype(), h.value.shape().to_vec()))
    }

    /// A copy of a held tensor on the host (waits for the device).
    pub fn read_tensor(&mut self, t: &DeviceTensor) -> Result<Tensor> {
        let v = self.held(t)?.value.clone_ref();
        self.host_tensor(&v)
    }

    /// Waits for the work enqueued on the session's device so far. Errors: the device's, or an
    /// input a kernel found out of range meanwhile (as [`Session::read_tensor`]).
    pub fn synchronize(&mut self) -> Result<()> {
        if let Some(gpu) = self.gpu.as_ref() {
            gpu.synchronize()?;
        }
        self.check_device()
    }

    /// Starts reading a small held tensor (at most [`crate::cuda::READBACK_BYTES`]) back to the
    /// host behind the device's work so far, and returns at once: runs enqueued afterwards may
    /// overwrite the tensor (the copy reads it first), so a decode loop can enqueue its next
    /// step before it waits for this one's tokens. At most two reads may be outstanding.
    /// Errors: a tensor over the limit.
    pub fn read_start(&mut self, t: &DeviceTensor) -> Result<PendingRead> {
        let v = self.held(t)?.value.clone_ref();
        if let Some(host) = v.host_bytes() {
            return Ok(PendingRead::Host(host.clone()));
        }
        let Value::Device { ptr, nbytes, dtype, shape, .. } = v else {
            return Err(Error::Device("a host value without bytes".into()));
        };
        let gpu = self.gpu.as_mut().ok_or_else(|| Error::Device("device value without a GPU".into()))?;
        Ok(PendingRead::Device { download: gpu.download_start(ptr, nbytes as usize)?, dtype, shape })
    }

    /// Waits for a read of [`Session::read_start`] and returns the tensor; fails, as
    /// [`Session::read_tensor`] does, when a kernel reported an input out of range meanwhile.
    pub fn read_finish(&mut self, p: PendingRead) -> Result<Tensor> {
        match p {
            PendingRead::Host(t) => Ok(t),
            PendingRead::Device { download, dtype, shape } => {
                let gpu = self.gpu.as_mut().ok_or_else(|| Error::Device("device value without a GPU".into()))?;
                let bytes = gpu.download_finish(download)?;
                self.check_device()?;
                Tensor::new(dtype, shape, bytes.into())
            }
        }
    }

    /// Elements `start .. start + len` of a held tensor, flattened row-major, as a 1-D host
    /// tensor (waits for the device). Errors: a range outside the tensor.
    pub fn read_slice(&mut self, t: &DeviceTensor, start: usize, len: usize) -> Result<Tensor> {
        let v = self.held(t)?.value.clone_ref();
        let dtype = v.dtype();
        let size = dtype.size().ok_or_else(|| Error::Unsupported(format!("{dtype} tensors")))?;
        let numel = v.shape().iter().product::<usize>();
        if start.checked_add(len).is_none_or(|end| end > numel) {
            return Err(Error::Input(format!(
                "elements {start}..{} of a tensor of {numel}",
                start.saturating_add(len)
            )));
        }
        let (off, n) = (start * size, len * size);
        match &v {
            Value::Device { ptr, host: None, .. } => {
                let gpu = self.gpu.as_mut().ok_or_else(|| Error::Device("device value without a GPU".into()))?;
                let t = gpu.download(ptr + off as u64, dtype, vec![len], n)?;
                self.check_device()?;
                Ok(t)
            }
            _ => {
                let t = self.host_tensor(&v)?;
                Tensor::new(dtype, vec![len], t.data.slice(off..off + n))
            }
        }
    }

    /// Copies host tensor `t` into held tensor `dst`, which takes `t`'s shape (enqueued on the
    /// GPU's stream: later runs see it). Errors: another dtype, or more bytes than `dst` holds.
    pub fn write_tensor(&mut self, dst: &DeviceTensor, t: &Tensor) -> Result<()> {
        let h = self.held(dst)?;
        let nbytes = t.data.len() as u64;
        if !h.fits(t.dtype, nbytes) {
            return Err(Error::Input(format!(
                "a {} tensor of {nbytes} bytes does not fit a held {} tensor of {} bytes",
                t.dtype,
                h.value.dtype(),
                h.capacity
            )));
        }
        match h.device_ptr() {
            Some(ptr) => {
                let gpu = self.gpu.as_mut().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
                gpu.upload_into(ptr, &t.data)?;
                if let Some(Held { value: Value::Device { shape, nbytes: n, .. }, .. }) = self.held.get_mut(&dst.id) {
                    *shape = t.shape.clone();
                    *n = nbytes;
                }
            }
            None => {
                if let Some(h) = self.held.get_mut(&dst.id) {
                    h.value = Value::Host(t.clone());
                }
            }
        }
        Ok(())
    }

    /// Copies elements `src_start .. src_start + len` of held tensor `src` to elements
    /// `dst_start ..` of held tensor `dst` (both flattened row-major; stream-ordered on a GPU,
    /// like a run). A continuous batch copies a prefilled sequence's KV row into its slot this
    /// way. Errors: different dtypes, the same tensor, or a range outside either tensor.
    pub fn copy_elements(
        &mut self,
        src: &DeviceTensor,
        src_start: usize,
        dst: &DeviceTensor,
        dst_start: usize,
        len: usize,
    ) -> Result<()> {
        if src == dst {
            return Err(Error::Input("copy_elements within one tensor".into()));
        }
        let (s, d) = (self.held(src)?.value.clone_ref(), self.held(dst)?.value.clone_ref());
        let dtype = s.dtype();
        if d.dtype() != dtype {
            return Err(Error::Input(format!("copy_elements from a {dtype} tensor into a {} tensor", d.dtype())));
        }
        let size = dtype.size().ok_or_else(|| Error::Unsupported(format!("{dtype} tensors")))?;
        check_range(&s, src_start, len)?;
        check_range(&d, dst_start, len)?;
        let (from, to, n) = (src_start * size, dst_start * size, len * size);
        match (&s, &d) {
            (Value::Device { ptr: sp, .. }, Value::Device { ptr: dp, .. }) => {
                let gpu = self.gpu.as_mut().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
                gpu.copy(dp + to as u64, sp + from as u64, n as u64)
            }
            _ => {
                let from_bytes = self.host_tensor(&s)?.data.slice(from..from + n);
                drop(s);
                let Some(Held { value: Value::Host(t), .. }) = self.held.get_mut(&dst.id) else {
                    return Err(Error::Device("copy_elements between a host and a device tensor".into()));
                };
                drop(d);
                write_bytes(t, to, &from_bytes);
                Ok(())
            }
        }
    }

    /// Writes `values` (a tensor of `dst`'s dtype, any shape) into elements `start ..
    /// start + values.numel()` of held tensor `dst` (flattened row-major). On a GPU the copy
    /// is stream-ordered like a run: work enqueued before it (a decode step in flight) reads
    /// the old elements, work enqueued after it the new ones. A continuous batch sets a joining
    /// sequence's rows of the step buffers this way. Errors: another dtype, or a range outside
    /// `dst`.
    pub fn write_elements(&mut self, dst: &DeviceTensor, start: usize, values: &Tensor) -> Result<()> {
        let d = self.held(dst)?.value.clone_ref();
        if d.dtype() != values.dtype {
            return Err(Error::Input(format!("write_elements of {} values into a {} tensor", values.dtype, d.dtype())));
        }
        let size = values.dtype.size().ok_or_else(|| Error::Unsupported(format!("{} tensors", values.dtype)))?;
        check_range(&d, start, values.data.len() / size)?;
        match &d {
            &Value::Device { ptr, .. } => {
                let gpu = self.gpu.as_mut().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
                gpu.upload_into(ptr + (start * size) as u64, &values.data)
            }
            Value::Host(_) => {
                drop(d);
                let Some(Held { value: Value::Host(t), .. }) = self.held.get_mut(&dst.id) else {
                    return Err(Error::Device("a held tensor changed place".into()));
                };
                write_bytes(t, start * size, &values.data);
                Ok(())
            }
        }
    }

    /// The value a fed held tensor gives the graph.
    pub(super) fn fed_value(&self, t: &DeviceTensor) -> Result<Value> {
        Ok(self.held(t)?.value.clone_ref())
    }

    /// Finishes one graph output `v` of a run as `fetch` asks.
    pub(super) fn fetch_output(&mut self, name: &str, v: Value, fetch: &Fetch<'_>) -> Result<Fetched> {
        match fetch {
            Fetch::Host => {
                let t = self.host_tensor(&v);
                self.release(v);
                Ok(Fetched::Host(t?))
            }
            Fetch::Device => {
                let v = match v {
                    v @ (Value::Device { owned: Some(_), .. } | Value::Host(_))
                        if self.gpu.is_some() == v.is_device() =>
                    {
                        v
                    }
                    other => {
                        // An alias (an input or an initializer): the held tensor gets its own copy.
                        let copy = self.copied(&other)?;
                        self.release(other);
                        copy
                    }
                };
                let capacity = v.nbytes();
                Ok(Fetched::Device(self.hold(v, capacity)))
            }
            Fetch::Skip => {
                self.release(v);
                Ok(Fetched::Written)
            }
            Fetch::Into(t) => {
                let (dtype, shape, nbytes) = (v.dtype(), v.shape().to_vec(), v.nbytes());
                let h = self.held(t)?;
                if !h.fits(dtype, nbytes) {
                    let e = Error::Input(format!(
                        "output {name:?} ({dtype} {shape:?}, {nbytes} bytes) does not fit its bound tensor ({}, {} bytes)",
                        h.value.dtype(),
                        h.capacity
                    ));
                    self.release(v);
                    return Err(e);
                }
                let (dst, id) = (h.device_ptr(), t.id);
                // On a GPU the bytes go into the held buffer (nothing to do when the producing
                // node wrote there); on the CPU the held value is replaced.
                let written = match dst {
                    Some(dst) => self.copy_into(dst, &v),
                    None => self.host_tensor(&v).map(|host| {
                        if let Some(h) = self.held.get_mut(&id) {
                            h.value = Value::Host(host);
                        }
                    }),
                };
                self.release(v);
                written?;
                if let Some(Held { value: Value::Device { shape: s, nbytes: n, .. }, .. }) = self.held.get_mut(&id) {
                    *s = shape;
                    *n = nbytes;
                }
                Ok(Fetched::Written)
            }
        }
    }

    /// `v` in a new buffer of the session's device.
    fn copied(&mut self, v: &Value) -> Result<Value> {
        match (v, self.gpu.as_mut()) {
            (Value::Host(t), None) => Ok(Value::Host(t.clone())),
            (_, None) => self.host_tensor(v).map(Value::Host),
            (v, Some(gpu)) => {
                let b = gpu.alloc.alloc(v.nbytes())?;
                let ptr = b.ptr;
                let out = Value::Device {
                    dtype: v.dtype(),
                    shape: v.shape().to_vec(),
                    ptr,
                    nbytes: v.nbytes(),
                    owned: Some(b),
                    host: None,
                };
                if let Err(e) = self.copy_into(ptr, v) {
                    self.release(out);
                    return Err(e);
                }
                Ok(out)
            }
        }
    }

    /// Copies the bytes of `v` to device address `dst` (nothing when `v` is already there).
    fn copy_into(&mut self, dst: u64, v: &Value) -> Result<()> {
        let gpu = self.gpu.as_mut().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
        match v {
            Value::Device { ptr, nbytes, .. } => gpu.copy(dst, *ptr, *nbytes),
            Value::Host(t) => gpu.upload_into(dst, &t.data),
        }
    }
}

/// Checks that elements `start .. start + len` lie within `v`.
fn check_range(v: &Value, start: usize, len: usize) -> Result<()> {
    let numel = v.shape().iter().product::<usize>();
    if start.checked_add(len).is_none_or(|end| end > numel) {
        return Err(Error::Input(format!("elements {start}..{} of a tensor of {numel}", start.saturating_add(len))));
    }
    Ok(())
}

/// Overwrites `t`'s bytes from byte `at` with `bytes` (the caller checked the extent); in place
/// when the bytes are not shared with another value (a KV cache's are not).
fn write_bytes(t: &mut Tensor, at: usize, bytes: &[u8]) {
    let data = std::mem::take(&mut t.data);
    let mut b = data.try_into_mut().unwrap_or_else(|shared| bytes::BytesMut::from(&shared[..]));
    b[at..at + bytes.len()].copy_from_slice(bytes);
    t.data = b.freeze();
}
