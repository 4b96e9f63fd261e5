//! Device status records (ABI.md §7.5): one `kiln_status` per node, in pinned host memory
//! that the device writes through (`cuMemHostAlloc` with `CU_MEMHOSTALLOC_DEVICEMAP`). A kernel
//! that finds an input out of range writes its node's record with the prelude's `kiln_fail`;
//! the host reads the records once the stream's work is done. Nothing is copied, so a run
//! without failures pays nothing, and a captured graph keeps its records' addresses.

use std::ffi::c_void;

use cudarc::driver::sys::{self, CUdeviceptr};

use crate::{Error, Result};

/// Bytes of one record: `struct kiln_status { unsigned code, reserved; long long values[4]; }`
/// of `kiln.cuh`, padded to 64 bytes so that two nodes never share a cache line.
pub const RECORD_BYTES: usize = 64;

/// The code `kiln_fail` holds while it writes the values (never seen after a kernel ends).
const WRITING: u32 = u32::MAX;

/// What a kernel reported: the record (the node's index in its session's graph), the code and
/// the four values of `kiln_fail`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    pub record: usize,
    pub code: u32,
    pub values: [i64; 4],
}

/// The records of one session's nodes. Freed on drop (the owner synchronizes first).
pub struct StatusRecords {
    host: *mut u8,
    device: CUdeviceptr,
    len: usize,
}

// SAFETY: the memory is owned by this value and touched by the host only through `&self` /
// `&mut self` after the stream's work is done; the device writes it only during kernels.
unsafe impl Send for StatusRecords {}

impl StatusRecords {
    /// `len` zeroed records (at least one), mapped for the current context's device. Errors:
    /// the driver's, when pinned memory runs out.
    pub fn new(len: usize) -> Result<StatusRecords> {
        let len = len.max(1);
        let bytes = len * RECORD_BYTES;
        // SAFETY: a plain allocation; checked below.
        let host = unsafe { cudarc::driver::result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP) }
            .map_err(|e| Error::Device(format!("cuMemHostAlloc of {bytes} bytes of status records: {e}")))?
            as *mut u8;
        // SAFETY: `host` holds `bytes` bytes.
        unsafe { std::ptr::write_bytes(host, 0, bytes) };
        let mut device: CUdeviceptr = 0;
        // SAFETY: `host` came from cuMemHostAlloc with DEVICEMAP; `device` is written by the call.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host as *mut c_void, 0) }.result();
        if let Err(e) = mapped {
            // SAFETY: allocated above and not shared.
            let _ = unsafe { cudarc::driver::result::free_host(host as *mut c_void) };
            return Err(Error::Device(format!("cuMemHostGetDevicePointer of the status records: {e}")));
        }
        Ok(StatusRecords { host, device, len })
    }

    /// How many records there are.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none (never: `new` makes at least one).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of record `i`. Errors: `i` past the records.
    pub fn device_ptr(&self, i: usize) -> Result<CUdeviceptr> {
        if i >= self.len {
            return Err(Error::Device(format!("status record {i} of {}", self.len)));
        }
        Ok(self.device + (i * RECORD_BYTES) as u64)
    }

    /// The first record with a reported code; every reported record is cleared. Call it after a
    /// synchronization: what kernels still in flight report (a decode step enqueued ahead) may
    /// be seen now or at the next call. A record a kernel is still writing (`kiln_fail` between
    /// claiming it and publishing its code) is left alone; a reported one is cleared by its
    /// code alone, after its values are read, and a kernel can claim it again only then.
    pub fn take(&mut self) -> Option<Fault> {
        let mut first = None;
        for i in 0..self.len {
            // SAFETY: record i lies inside the allocation; volatile, because the device writes it.
            let rec = unsafe { self.host.add(i * RECORD_BYTES) };
            let code = unsafe { std::ptr::read_volatile(rec as *const u32) };
            if code == 0 || code == WRITING {
                continue;
            }
            let mut values = [0i64; 4];
            for (k, v) in values.iter_mut().enumerate() {
                // SAFETY: values start at byte 8 of the record, 8-byte aligned.
                *v = unsafe { std::ptr::read_volatile((rec.add(8) as *const i64).add(k)) };
            }
            if first.is_none() {
                first = Some(Fault { record: i, code, values });
            }
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            // SAFETY: as above; a kernel claims the record only while its code is 0.
            unsafe { std::ptr::write_volatile(rec as *mut u32, 0) };
        }
        first
    }
}

impl Drop for StatusRecords {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in `new`; the owner has synchronized.
        let _ = unsafe { cudarc::driver::result::free_host(self.host as *mut c_void) };
    }
}
