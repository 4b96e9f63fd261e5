//! Host↔device copies on a copy stream through two reused pinned staging buffers (small ones,
//! up to 64 KiB, inline on the compute stream).
//!
//! An upload waits (on the device) for the work already on the compute stream, since the
//! destination may be a pool block that earlier kernels still read; the compute stream then
//! waits for the copy. Between the two the host fills the next staging buffer while the
//! previous one is in flight, and the compute stream's queued kernels keep running during the
//! host-side staging. A download waits for the compute stream's work so far and copies on the
//! copy stream, so only that work, not what is enqueued later, delays it. Transfers larger
//! than a staging buffer go in chunks, alternating the two buffers. (CUDA driver API:
//! `cuMemHostAlloc`, `cuMemcpyHtoDAsync`/`cuMemcpyDtoHAsync`, `cuEventRecord`,
//! `cuStreamWaitEvent`.)

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::result::{event, free_host, malloc_host, memcpy_dtoh_async, memcpy_htod_async, stream};
use cudarc::driver::sys::{CUdeviceptr, CUevent, CUevent_flags, CUevent_wait_flags};
use cudarc::driver::CudaStream;

use crate::{Error, Result};

/// Transfers of at most this many bytes go straight on the compute stream: the driver copies
/// a small pageable source into its command stream at once (no staging, no cross-stream
/// ordering), which is cheapest for a decode step's token ids and attention mask.
const INLINE_BYTES: usize = 64 << 10;
/// Largest staging buffer, in bytes; longer transfers are chunked.
const CHUNK: usize = 8 << 20;
/// Smallest staging buffer allocated.
const MIN_STAGING: usize = 64 << 10;

fn drv(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Device(format!("{what}: {e}"))
}

/// One pinned host buffer and the event recorded after the last copy that used it.
struct Staging {
    ptr: *mut u8,
    bytes: usize,
    free: CUevent,
    /// Whether `free` has been recorded (a copy may still use the buffer).
    pending: bool,
}

impl Staging {
    /// No buffer yet (allocated by the first `ready`), its event still to be created.
    fn empty() -> Staging {
        Staging { ptr: std::ptr::null_mut(), bytes: 0, free: std::ptr::null_mut(), pending: false }
    }

    /// Waits until the buffer's last copy is done and makes it hold at least `n` bytes.
    fn ready(&mut self, n: usize) -> Result<()> {
        if self.pending {
            // SAFETY: a live event, recorded on the copy stream.
            unsafe { event::synchronize(self.free) }.map_err(drv("cuEventSynchronize"))?;
            self.pending = false;
        }
        if self.bytes < n {
            let bytes = n.next_power_of_two().clamp(MIN_STAGING, CHUNK.max(n));
            if !self.ptr.is_null() {
                // SAFETY: allocated by malloc_host; no copy uses it (waited above).
                unsafe { free_host(self.ptr as *mut c_void) }.map_err(drv("cuMemFreeHost"))?;
                self.ptr = std::ptr::null_mut();
                self.bytes = 0;
            }
            // SAFETY: a plain pinned allocation on the current context.
            self.ptr = unsafe { malloc_host(bytes, 0) }.map_err(drv("cuMemHostAlloc"))? as *mut u8;
            self.bytes = bytes;
        }
        Ok(())
    }

    /// Frees the buffer and its event, once no copy uses them.
    fn release(&mut self) {
        // SAFETY: the stream that used the buffer is idle; each pointer and event is freed once.
        unsafe {
            if !self.ptr.is_null() {
                let _ = free_host(self.ptr as *mut c_void);
                self.ptr = std::ptr::null_mut();
            }
            if !self.free.is_null() {
                let _ = event::destroy(self.free);
                self.free = std::ptr::null_mut();
            }
        }
    }

    /// The first `n` bytes (n ≤ bytes).
    fn slice(&mut self, n: usize) -> &mut [u8] {
        // SAFETY: ptr holds `bytes` ≥ n bytes of pinned memory owned by this buffer.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, n) }
    }
}

/// A download started by [`Readbacks::download_start`]: which readback buffer holds it and
/// how many bytes.
#[derive(Debug)]
pub struct PendingDownload {
    slot: usize,
    bytes: usize,
    /// Which use of the slot this is (a third outstanding download reuses the oldest slot).
    ticket: u64,
}

/// Most bytes of one [`Readbacks::download_start`] (a decode step's token ids).
pub const READBACK_BYTES: usize = 64 << 10;

/// The copy stream, its staging buffers and the events that order it against the compute stream.
pub struct Transfers {
    copy: Arc<CudaStream>,
    staging: [Staging; 2],
    next: usize,
    /// Recorded on the compute stream, waited for by the copy stream.
    compute_mark: CUevent,
    /// Recorded on the copy stream, waited for by the compute stream.
    copy_mark: CUevent,
    /// Bytes moved each way.
    pub uploaded_bytes: u64,
    pub downloaded_bytes: u64,
}

// SAFETY: the raw pointers are pinned buffers and events owned by this value, used only through
// `&mut self` with the context current.
unsafe impl Send for Transfers {}

fn new_event() -> Result<CUevent> {
    event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(drv("cuEventCreate"))
}

impl Transfers {
    /// A copy stream on `copy`'s context (staging buffers are allocated on first use).
    pub fn new(copy: Arc<CudaStream>) -> Result<Transfers> {
        let mut t = Transfers {
            copy,
            staging: [(); 2].map(|_| Staging::empty()),
            next: 0,
            compute_mark: new_event()?,
            copy_mark: new_event()?,
            uploaded_bytes: 0,
            downloaded_bytes: 0,
        };
        for s in t.staging.iter_mut() {
            s.free = new_event()?;
        }
        Ok(t)
    }

    /// Makes the copy stream wait for the work enqueued on `compute` so far.
    fn after(&self, compute: &CudaStream) -> Result<()> {
        // SAFETY: live events and streams of the current context.
        unsafe {
            event::record(self.compute_mark, compute.cu_stream()).map_err(drv("cuEventRecord"))?;
            stream::wait_event(self.copy.cu_stream(), self.compute_mark, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
                .map_err(drv("cuStreamWaitEvent"))
        }
    }

    /// Waits for every copy enqueued so far.
    pub fn synchronize(&self) -> Result<()> {
        self.copy.synchronize().map_err(drv("cuStreamSynchronize"))
    }

    /// Copies `data` to device address `dst` (which holds at least `data.len()` bytes); work
    /// enqueued on `compute` afterwards sees the bytes.
    pub fn upload(&mut self, compute: &CudaStream, dst: CUdeviceptr, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        if data.len() <= INLINE_BYTES {
            // SAFETY: the destination extent is the caller's guarantee; a pageable source of
            // this size is copied out before the call returns.
            unsafe { memcpy_htod_async(dst, data, compute.cu_stream()) }.map_err(drv("cuMemcpyHtoDAsync"))?;
            self.uploaded_bytes += data.len() as u64;
            return Ok(());
        }
        self.after(compute)?;
        let copy = self.copy.cu_stream();
        for (i, chunk) in data.chunks(CHUNK).enumerate() {
            let s = &mut self.staging[self.next];
            self.next ^= 1;
            s.ready(chunk.len())?;
            s.slice(chunk.len()).copy_from_slice(chunk);
            // SAFETY: the staging buffer stays untouched until `free` completes (`ready` waits
            // for it); the destination extent is the caller's guarantee.
            unsafe {
                memcpy_htod_async(dst + (i * CHUNK) as u64, &*s.slice(chunk.len()), copy)
                    .map_err(drv("cuMemcpyHtoDAsync"))?;
                event::record(s.free, copy).map_err(drv("cuEventRecord"))?;
            }
            s.pending = true;
        }
        self.uploaded_bytes += data.len() as u64;
        // SAFETY: live events and streams of the current context.
        unsafe {
            event::record(self.copy_mark, copy).map_err(drv("cuEventRecord"))?;
            stream::wait_event(compute.cu_stream(), self.copy_mark, CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
                .map_err(drv("cuStreamWaitEvent"))
        }
    }

    /// Copies `out.len()` bytes from device address `src` once the work enqueued on `compute`
    /// so far is done; returns when the bytes are in `out`.
    pub fn download(&mut self, compute: &CudaStream, src: CUdeviceptr, out: &mut [u8]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        if out.len() <= INLINE_BYTES {
            // SAFETY: the source extent is the caller's guarantee; `out` is written before the
            // stream synchronizes.
            unsafe { memcpy_dtoh_async(out, src, compute.cu_stream()) }.map_err(drv("cuMemcpyDtoHAsync"))?;
            self.downloaded_bytes += out.len() as u64;
            return compute.synchronize().map_err(drv("cuStreamSynchronize"));
        }
        self.after(compute)?;
        let copy = self.copy.cu_stream();
        for (i, chunk) in out.chunks_mut(CHUNK).enumerate() {
            let s = &mut self.staging[self.next];
            self.next ^= 1;
            s.ready(chunk.len())?;
            // SAFETY: the staging buffer is only read after the copy's event completes; the
            // source extent is the caller's guarantee.
            unsafe {
                memcpy_dtoh_async(s.slice(chunk.len()), src + (i * CHUNK) as u64, copy)
                    .map_err(drv("cuMemcpyDtoHAsync"))?;
                event::record(s.free, copy).map_err(drv("cuEventRecord"))?;
            }
            s.pending = true;
            s.ready(0)?;
            chunk.copy_from_slice(s.slice(chunk.len()));
        }
        self.downloaded_bytes += out.len() as u64;
        Ok(())
    }
}

/// A session's pinned buffers for downloads the host collects later (two, so that a step's
/// readback can be in flight while the one before it is read). Copies run on the compute
/// stream, behind the work enqueued there before them.
pub struct Readbacks {
    readback: [Staging; 2],
    next_readback: usize,
    /// The ticket of each readback slot's latest download, and the next ticket.
    readback_ticket: [u64; 2],
    tickets: u64,
    /// Bytes read back.
    pub downloaded_bytes: u64,
}

// SAFETY: the raw pointers are pinned buffers and events owned by this value, used only through
// `&mut self` with the context current.
unsafe impl Send for Readbacks {}

impl Readbacks {
    pub fn new() -> Result<Readbacks> {
        let mut r = Readbacks {
            readback: [(); 2].map(|_| Staging::empty()),
            next_readback: 0,
            readback_ticket: [0; 2],
            tickets: 0,
            downloaded_bytes: 0,
        };
        for s in r.readback.iter_mut() {
            s.free = new_event()?;
        }
        Ok(r)
    }

    /// Enqueues a copy of `bytes` bytes (at most [`READBACK_BYTES`]) from device address `src`
    /// into a pinned readback buffer on `compute`, after the work enqueued there so far, and
    /// returns at once; [`Readbacks::download_finish`] waits for it and hands the bytes over.
    /// Work enqueued on `compute` later may overwrite `src`: the copy reads it first. At most
    /// two downloads may be outstanding: a third reuses the oldest one's buffer (after waiting
    /// for its copy), and finishing that oldest one is then an error.
    pub fn download_start(&mut self, compute: &CudaStream, src: CUdeviceptr, bytes: usize) -> Result<PendingDownload> {
        if bytes > READBACK_BYTES {
            return Err(Error::Device(format!("a readback of {bytes} bytes (at most {READBACK_BYTES})")));
        }
        let slot = self.next_readback;
        self.next_readback ^= 1;
        let s = &mut self.readback[slot];
        s.ready(bytes.max(1))?;
        if bytes > 0 {
            // SAFETY: the buffer is pinned and holds `bytes`; it is read only after `free`
            // completes; the source extent is the caller's guarantee.
            unsafe {
                memcpy_dtoh_async(s.slice(bytes), src, compute.cu_stream()).map_err(drv("cuMemcpyDtoHAsync"))?;
            }
        }
        // SAFETY: a live event of the current context, recorded on the compute stream.
        unsafe { event::record(s.free, compute.cu_stream()) }.map_err(drv("cuEventRecord"))?;
        s.pending = true;
        self.downloaded_bytes += bytes as u64;
        self.tickets += 1;
        self.readback_ticket[slot] = self.tickets;
        Ok(PendingDownload { slot, bytes, ticket: self.tickets })
    }

    /// Waits for a download of [`Readbacks::download_start`] (and the compute stream's work
    /// before it) and returns its bytes.
    pub fn download_finish(&mut self, p: PendingDownload) -> Result<Vec<u8>> {
        if self.readback_ticket[p.slot] != p.ticket {
            return Err(Error::Device(
                "a readback's buffer was reused by a later one: at most two reads may be outstanding".into(),
            ));
        }
        let s = &mut self.readback[p.slot];
        s.ready(0)?;
        Ok(if p.bytes == 0 { Vec::new() } else { s.slice(p.bytes).to_vec() })
    }
}

impl Drop for Readbacks {
    fn drop(&mut self) {
        // Readbacks run on the compute stream, which the owning `Gpu` synchronizes before its
        // fields drop.
        for s in self.readback.iter_mut() {
            s.release();
        }
    }
}

impl Drop for Transfers {
    fn drop(&mut self) {
        // The copy stream is this value's own.
        let _ = self.copy.synchronize();
        for s in self.staging.iter_mut() {
            s.release();
        }
        // SAFETY: as above.
        unsafe {
            let _ = event::destroy(self.compute_mark);
            let _ = event::destroy(self.copy_mark);
        }
    }
}
