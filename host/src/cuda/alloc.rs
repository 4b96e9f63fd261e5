//! The caching device allocator: freed blocks go back to a pool by size class and are handed
//! out again to later work on the same stream (stream order makes that safe without events).
//! Every byte kiln allocates on the device counts against `limit`, the bytes its
//! [`super::VirtualBuffer`]s map included.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;

use super::vmm::VmmCounters;
use crate::{Error, Result};

/// A device allocation: pointer and size in bytes (rounded up to the size class).
#[derive(Debug, PartialEq, Eq)]
pub struct DevBuffer {
    pub ptr: CUdeviceptr,
    pub bytes: u64,
}

/// Counters of the allocator, in bytes and calls.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct AllocatorStats {
    pub in_use_bytes: u64,
    pub cached_bytes: u64,
    /// The most bytes held at once: the pool's (in use and cached) and the VMM buffers' mapped.
    pub peak_bytes: u64,
    pub device_allocations: u64,
    pub pool_hits: u64,
    /// Addresses the VMM buffers reserve (no memory behind them until mapped).
    pub vmm_reserved_bytes: u64,
    /// Device memory mapped into the VMM buffers.
    pub vmm_mapped_bytes: u64,
    /// VMM chunks mapped and unmapped so far.
    pub vmm_maps: u64,
    pub vmm_unmaps: u64,
}

/// Size-class caching allocator.
#[derive(Debug)]
pub struct Allocator {
    free: HashMap<u64, Vec<CUdeviceptr>>,
    stats: AllocatorStats,
    /// Most bytes kiln may hold on the device (in use + cached + mapped).
    limit: u64,
    /// What the VMM buffers of this allocator's session reserve and map.
    vmm: Arc<VmmCounters>,
}

/// Size classes: 512-byte multiples up to 1 MiB, then powers of two up to 64 MiB, then
/// 2 MiB multiples.
fn size_class(bytes: u64) -> u64 {
    let b = bytes.max(1);
    if b <= 1 << 20 {
        b.div_ceil(512) * 512
    } else if b <= 64 << 20 {
        b.next_power_of_two()
    } else {
        b.div_ceil(2 << 20) * (2 << 20)
    }
}

impl Allocator {
    pub fn new(limit: u64) -> Allocator {
        Allocator { free: HashMap::new(), stats: AllocatorStats::default(), limit, vmm: Arc::default() }
    }

    pub fn stats(&self) -> AllocatorStats {
        AllocatorStats {
            vmm_reserved_bytes: self.vmm.reserved.load(Ordering::Relaxed),
            vmm_mapped_bytes: self.mapped(),
            vmm_maps: self.vmm.maps.load(Ordering::Relaxed),
            vmm_unmaps: self.vmm.unmaps.load(Ordering::Relaxed),
            ..self.stats
        }
    }

    /// The counters every [`super::VirtualBuffer`] of this allocator's session updates.
    pub fn vmm_counters(&self) -> &Arc<VmmCounters> {
        &self.vmm
    }

    fn mapped(&self) -> u64 {
        self.vmm.mapped.load(Ordering::Relaxed)
    }

    /// Room for `bytes` more bytes within the limit, the cached blocks freed first if need
    /// be. Errors: the limit would be passed; `what` names the request.
    fn make_room(&mut self, bytes: u64, what: &str) -> Result<()> {
        if self.stats.in_use_bytes + self.stats.cached_bytes + self.mapped() + bytes <= self.limit {
            return Ok(());
        }
        self.release_cached();
        let held = self.stats.in_use_bytes + self.mapped();
        if held + bytes > self.limit {
            return Err(Error::OutOfMemory(format!(
                "device memory limit of {} bytes reached ({} in use, {bytes} more requested {what})",
                self.limit, held
            )));
        }
        Ok(())
    }

    /// Counts `bytes` about to be mapped into a VMM buffer against the limit (the buffer's
    /// counters hold them once mapped). Errors: the limit would be passed.
    pub fn charge_mapping(&mut self, bytes: u64) -> Result<()> {
        self.make_room(bytes, "to map into the KV cache's reserved addresses")
    }

    /// Takes the peak again after a mapping.
    pub fn note_peak(&mut self) {
        let held = self.stats.in_use_bytes + self.stats.cached_bytes + self.mapped();
        self.stats.peak_bytes = self.stats.peak_bytes.max(held);
    }

    /// A buffer of at least `bytes` bytes (contents undefined).
    pub fn alloc(&mut self, bytes: u64) -> Result<DevBuffer> {
        let class = size_class(bytes);
        if let Some(ptr) = self.free.get_mut(&class).and_then(Vec::pop) {
            self.stats.cached_bytes -= class;
            self.stats.in_use_bytes += class;
            self.stats.pool_hits += 1;
            return Ok(DevBuffer { ptr, bytes: class });
        }
        self.make_room(class, "from the pool")?;
        // SAFETY: a plain allocation on the current context.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(class as usize) }.map_err(|e| {
            let why = format!("cuMemAlloc of {class} bytes: {e}");
            match e.0 {
                cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory(why),
                _ => Error::Device(why),
            }
        })?;
        self.stats.device_allocations += 1;
        self.stats.in_use_bytes += class;
        self.note_peak();
        Ok(DevBuffer { ptr, bytes: class })
    }

    /// Returns a buffer to the pool. Only work enqueued later on the same stream can get it.
    pub fn free(&mut self, b: DevBuffer) {
        self.stats.in_use_bytes -= b.bytes;
        self.stats.cached_bytes += b.bytes;
        self.free.entry(b.bytes).or_default().push(b.ptr);
    }

    /// Frees every cached block. The caller must have synchronized the stream.
    pub fn release_cached(&mut self) {
        for (class, ptrs) in self.free.drain() {
            for p in ptrs {
                // SAFETY: p came from malloc_sync and is not in use.
                let _ = unsafe { cudarc::driver::result::free_sync(p) };
                self.stats.cached_bytes -= class;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::size_class;

    #[test]
    fn size_classes_round_up() {
        assert_eq!(size_class(0), 512);
        assert_eq!(size_class(513), 1024);
        assert_eq!(size_class((1 << 20) + 1), 2 << 20);
        assert_eq!(size_class((64 << 20) + 1), 66 << 20);
    }
}
