//! The caching device allocator: freed blocks go back to a pool by size class and are handed
//! out again to later work on the same stream (stream order makes that safe without events).
//! Every byte kiln allocates on the device counts against `limit`.

use std::collections::HashMap;

use cudarc::driver::sys::CUdeviceptr;

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
    pub peak_bytes: u64,
    pub device_allocations: u64,
    pub pool_hits: u64,
}

/// Size-class caching allocator.
#[derive(Debug)]
pub struct Allocator {
    free: HashMap<u64, Vec<CUdeviceptr>>,
    stats: AllocatorStats,
    /// Most bytes kiln may hold on the device (in use + cached).
    limit: u64,
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
        Allocator { free: HashMap::new(), stats: AllocatorStats::default(), limit }
    }

    pub fn stats(&self) -> AllocatorStats {
        self.stats
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
        if self.stats.in_use_bytes + self.stats.cached_bytes + class > self.limit {
            self.release_cached();
            if self.stats.in_use_bytes + class > self.limit {
                return Err(Error::Device(format!(
                    "device memory limit of {} bytes reached ({} in use, {class} more requested)",
                    self.limit, self.stats.in_use_bytes
                )));
            }
        }
        // SAFETY: a plain allocation on the current context.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(class as usize) }
            .map_err(|e| Error::Device(format!("cuMemAlloc of {class} bytes: {e}")))?;
        self.stats.device_allocations += 1;
        self.stats.in_use_bytes += class;
        self.stats.peak_bytes = self.stats.peak_bytes.max(self.stats.in_use_bytes + self.stats.cached_bytes);
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
