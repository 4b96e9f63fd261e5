//! Virtual memory management (the CUDA driver's VMM API): a [`VirtualBuffer`] reserves a range
//! of device addresses once (`cuMemAddressReserve`) and maps physical memory into it as it
//! grows (`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`), so its address never moves while it
//! grows: a captured CUDA graph that reads it stays valid. The KV caches of decode batches live
//! in them. A buffer grows from its start, or (a paged KV cache: one region per row) from the
//! start of each of several regions at granularity-aligned offsets. Mapping is in whole
//! multiples of the device's allocation granularity (2 MiB on the H200); each growth is one
//! physical allocation (a *chunk*), unmapped whole (`cuMemUnmap`, `cuMemRelease`) only behind a
//! fence: the context's work so far is finished first. Dropped, the buffer unmaps everything
//! and frees its addresses.
//!
//! Mapped bytes count against the session's device-memory limit like the pool's
//! ([`super::Allocator::charge_mapping`]); reserved addresses do not (they hold no memory).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr, CUmemGenericAllocationHandle};

use super::Device;

use crate::{Error, Result};

/// Bytes reserved and mapped by every [`VirtualBuffer`] of one allocator, and the calls that
/// changed them.
#[derive(Debug, Default)]
pub struct VmmCounters {
    pub reserved: AtomicU64,
    pub mapped: AtomicU64,
    /// Chunks mapped and unmapped so far.
    pub maps: AtomicU64,
    pub unmaps: AtomicU64,
}

/// One physical allocation mapped at `offset` bytes from the buffer's start.
#[derive(Debug)]
struct Chunk {
    handle: CUmemGenericAllocationHandle,
    offset: u64,
    bytes: u64,
}

/// A reserved range of device addresses, mapped from its start up to [`VirtualBuffer::mapped`]
/// bytes (or from the start of each region, [`VirtualBuffer::mapped_at`]). Not `Clone`: the
/// value owns the range and its chunks.
#[derive(Debug)]
pub struct VirtualBuffer {
    device: Arc<Device>,
    ptr: CUdeviceptr,
    reserved: u64,
    granularity: u64,
    chunks: Vec<Chunk>,
    counters: Arc<VmmCounters>,
}

fn check(what: &str, r: sys::CUresult) -> Result<()> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(Error::OutOfMemory(format!("{what}: out of device memory"))),
        e => Err(Error::Device(format!("{what}: {e:?}"))),
    }
}

/// Pinned device memory on device `ordinal`, no exportable handle.
fn allocation_prop(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct; all-zero is its "no flags" value.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    prop.location = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal };
    prop
}

/// The minimum VMM allocation granularity of device `ordinal` in bytes
/// (`cuMemGetAllocationGranularity`). Errors: a device without VMM support.
pub fn granularity(ordinal: i32) -> Result<u64> {
    let prop = allocation_prop(ordinal);
    let mut g = 0usize;
    // SAFETY: prop is valid, g receives one value.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    Ok((g as u64).max(1))
}

impl VirtualBuffer {
    /// Reserves `bytes` of addresses (rounded up to the granularity) on `device`, nothing
    /// mapped. Errors: the reservation's (address space, no VMM support).
    pub fn reserve(device: &Arc<Device>, bytes: u64, counters: &Arc<VmmCounters>) -> Result<Self> {
        let ctx = &device.ctx;
        ctx.bind_to_thread().map_err(|e| Error::Device(format!("cuCtxSetCurrent: {e}")))?;
        let granularity = granularity(ctx.cu_device())?;
        let reserved = bytes.max(1).div_ceil(granularity) * granularity;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: ptr receives the range's start; no fixed address is asked for.
        check(&format!("cuMemAddressReserve of {reserved} bytes"), unsafe {
            sys::cuMemAddressReserve(&mut ptr, reserved as usize, granularity as usize, 0, 0)
        })?;
        counters.reserved.fetch_add(reserved, Ordering::Relaxed);
        Ok(VirtualBuffer {
            device: device.clone(),
            ptr,
            reserved,
            granularity,
            chunks: Vec::new(),
            counters: counters.clone(),
        })
    }

    /// The range's first address (fixed for the buffer's life).
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The device's allocation granularity in bytes: mapping's unit.
    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// Bytes reserved.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Bytes mapped from the start (a multiple of the granularity).
    pub fn mapped(&self) -> u64 {
        self.mapped_at(0)
    }

    /// Bytes mapped without a gap from offset `start` (a multiple of the granularity).
    pub fn mapped_at(&self, start: u64) -> u64 {
        let mut end = start;
        while let Some(c) = self.chunks.iter().find(|c| c.offset == end) {
            end += c.bytes;
        }
        end - start
    }

    /// Bytes a growth to `bytes` would map: `bytes` rounded up to the granularity, within the
    /// reservation, less what is mapped already.
    pub fn growth(&self, bytes: u64) -> u64 {
        self.growth_at(0, bytes, self.reserved)
    }

    /// Bytes a growth of the region of `limit` bytes at `start` to its first `bytes` bytes would
    /// map: `bytes` rounded up to the granularity, within the region and the reservation, less
    /// what the region has mapped already.
    pub fn growth_at(&self, start: u64, bytes: u64, limit: u64) -> u64 {
        let room = limit.min(self.reserved.saturating_sub(start));
        let target = bytes.div_ceil(self.granularity).saturating_mul(self.granularity).min(room);
        target.saturating_sub(self.mapped_at(start))
    }

    /// Maps one chunk so that at least the first `bytes` bytes (within the reservation) are
    /// mapped; the caller charged [`VirtualBuffer::growth`] against its limit. The new bytes'
    /// contents are undefined. Errors: the driver's (out of memory); nothing is mapped then.
    pub fn map_to(&mut self, bytes: u64) -> Result<()> {
        self.map_at(0, bytes, self.reserved)
    }

    /// [`VirtualBuffer::map_to`] for the region of `limit` bytes at `start` (a multiple of the
    /// granularity): one chunk after what the region has mapped, so that its first `bytes`
    /// bytes are mapped; the caller charged [`VirtualBuffer::growth_at`].
    pub fn map_at(&mut self, start: u64, bytes: u64, limit: u64) -> Result<()> {
        let add = self.growth_at(start, bytes, limit);
        let offset = start + self.mapped_at(start);
        if add == 0 {
            return Ok(());
        }
        self.device.ctx.bind_to_thread().map_err(|e| Error::Device(format!("cuCtxSetCurrent: {e}")))?;
        let prop = allocation_prop(self.device.ctx.cu_device());
        let mut handle: CUmemGenericAllocationHandle = 0;
        // SAFETY: prop is valid; add is a multiple of the granularity.
        check(&format!("cuMemCreate of {add} bytes"), unsafe {
            sys::cuMemCreate(&mut handle, add as usize, &prop, 0)
        })?;
        let at = self.ptr + offset;
        // SAFETY: [at, at + add) lies in the reservation and is not mapped; the handle is `add` bytes.
        let mapped = check("cuMemMap", unsafe { sys::cuMemMap(at, add as usize, 0, handle, 0) });
        let access = sys::CUmemAccessDesc {
            location: prop.location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range was just mapped; one access descriptor.
        let usable =
            mapped.and_then(|_| check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(at, add as usize, &access, 1) }));
        if let Err(e) = usable {
            // SAFETY: undoes what succeeded above; nothing has used the range.
            unsafe {
                sys::cuMemUnmap(at, add as usize);
                sys::cuMemRelease(handle);
            }
            return Err(e);
        }
        self.chunks.push(Chunk { handle, offset, bytes: add });
        self.counters.mapped.fetch_add(add, Ordering::Relaxed);
        self.counters.maps.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Unmaps the chunks that lie wholly past the first `bytes` bytes, behind a fence: the
    /// device's work so far (which may read them) finishes first ([`Device::synchronize`]).
    /// Errors: the synchronization's (a device fault); nothing is unmapped then.
    pub fn unmap_past(&mut self, bytes: u64) -> Result<()> {
        self.unmap_at(0, bytes, self.reserved)
    }

    /// [`VirtualBuffer::unmap_past`] for the region of `limit` bytes at `start`: its chunks that
    /// start at or past `start + keep`.
    pub fn unmap_at(&mut self, start: u64, keep: u64, limit: u64) -> Result<()> {
        let gone = |c: &Chunk| c.offset >= start + keep && c.offset < start.saturating_add(limit);
        if !self.chunks.iter().any(gone) {
            return Ok(());
        }
        self.device.synchronize()?;
        let (out, kept): (Vec<Chunk>, Vec<Chunk>) = std::mem::take(&mut self.chunks).into_iter().partition(gone);
        self.chunks = kept;
        for c in out {
            self.release(c);
        }
        Ok(())
    }

    fn release(&self, c: Chunk) {
        // SAFETY: the chunk is mapped at this offset and the device no longer uses it (fenced
        // by the caller).
        unsafe {
            sys::cuMemUnmap(self.ptr + c.offset, c.bytes as usize);
            sys::cuMemRelease(c.handle);
        }
        self.counters.mapped.fetch_sub(c.bytes, Ordering::Relaxed);
        self.counters.unmaps.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for VirtualBuffer {
    fn drop(&mut self) {
        // The fence: work that reads the buffer finishes before it is unmapped. A failed
        // synchronization (a device fault) leaves the context unusable anyway.
        let _ = self.device.ctx.bind_to_thread();
        let _ = self.device.synchronize();
        while let Some(c) = self.chunks.pop() {
            self.release(c);
        }
        // SAFETY: the range was reserved by this buffer and nothing is mapped in it now.
        unsafe { sys::cuMemAddressFree(self.ptr, self.reserved as usize) };
        self.counters.reserved.fetch_sub(self.reserved, Ordering::Relaxed);
    }
}
