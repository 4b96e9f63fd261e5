//! The caching device allocator, in two parts:
//!
//! - [`Pool`]: one per device per process ([`super::Device`]), shared by every session. Freed
//!   blocks go back to it by size class and are handed out again to later work on the device's
//!   one compute stream (stream order makes that safe without events).
//! - [`Allocator`]: a session's view of the pool, with that session's account: the bytes it
//!   holds in use and the bytes its [`super::VirtualBuffer`]s map, which together count against
//!   its device-memory limit (`--device-memory-limit`).
//!
//! A [`DevBuffer`] owns its block: dropped, it goes back to the pool and off its session's
//! account. Nothing calls a free by hand.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::sys::CUdeviceptr;

use super::vmm::VmmCounters;
use crate::{Error, Result};

/// A device allocation from a [`Pool`]: pointer and size in bytes (rounded up to the size
/// class). Dropped, the block goes back to its pool, where only work enqueued later on the
/// device's compute stream can get it.
#[derive(Debug)]
pub struct DevBuffer {
    pub ptr: CUdeviceptr,
    pub bytes: u64,
    pool: Arc<Pool>,
    /// The session account the block counts against (`None`: the device's own, such as the
    /// cuBLASLt workspace).
    account: Option<Arc<Account>>,
}

impl Drop for DevBuffer {
    fn drop(&mut self) {
        if let Some(a) = &self.account {
            a.in_use.fetch_sub(self.bytes, Ordering::Relaxed);
        }
        self.pool.give_back(self.ptr, self.bytes);
    }
}

/// Counters of a session's allocator, in bytes and calls.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct AllocatorStats {
    /// Bytes of pool blocks this session holds.
    pub in_use_bytes: u64,
    /// Bytes of free blocks the device's pool keeps for reuse (every session's).
    pub cached_bytes: u64,
    /// The most bytes this session held at once: its pool blocks and its VMM buffers' mapped
    /// bytes.
    pub peak_bytes: u64,
    /// `cuMemAlloc` calls and requests served from the cache, the device's pool's.
    pub device_allocations: u64,
    pub pool_hits: u64,
    /// Addresses this session's VMM buffers reserve (no memory behind them until mapped).
    pub vmm_reserved_bytes: u64,
    /// Device memory mapped into this session's VMM buffers.
    pub vmm_mapped_bytes: u64,
    /// VMM chunks mapped and unmapped so far.
    pub vmm_maps: u64,
    pub vmm_unmaps: u64,
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

#[derive(Debug, Default)]
struct PoolState {
    free: HashMap<u64, Vec<CUdeviceptr>>,
    cached_bytes: u64,
    device_allocations: u64,
    pool_hits: u64,
}

/// The free blocks of one device, by size class.
#[derive(Debug, Default)]
pub struct Pool {
    state: Mutex<PoolState>,
}

impl Pool {
    fn state(&self) -> MutexGuard<'_, PoolState> {
        // The state is counters and lists, valid after any panic between two statements.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A block of at least `bytes` bytes (contents undefined), counted against `account`.
    /// When the device has no room, the cached blocks are freed and the allocation tried once
    /// more. Errors: [`Error::OutOfMemory`] when it still has none.
    pub fn take(self: &Arc<Self>, bytes: u64, account: Option<Arc<Account>>) -> Result<DevBuffer> {
        let class = size_class(bytes);
        let cached = {
            let mut s = self.state();
            let hit = s.free.get_mut(&class).and_then(Vec::pop);
            if hit.is_some() {
                s.cached_bytes -= class;
                s.pool_hits += 1;
            }
            hit
        };
        let ptr = match cached {
            Some(p) => p,
            None => match cu_alloc(class) {
                Err(Error::OutOfMemory(_)) => {
                    self.release_cached();
                    cu_alloc(class)?
                }
                other => other?,
            },
        };
        if cached.is_none() {
            self.state().device_allocations += 1;
        }
        if let Some(a) = &account {
            a.in_use.fetch_add(class, Ordering::Relaxed);
            a.note_peak();
        }
        Ok(DevBuffer { ptr, bytes: class, pool: self.clone(), account })
    }

    fn give_back(&self, ptr: CUdeviceptr, class: u64) {
        let mut s = self.state();
        s.cached_bytes += class;
        s.free.entry(class).or_default().push(ptr);
    }

    /// Frees every cached block. `cuMemFree` does not return before the device's work that
    /// may still use a block is done (CUDA Programming Guide, "Implicit Synchronization"); from
    /// another thread than a capturing one it is allowed during a thread-local capture
    /// (`cuThreadExchangeStreamCaptureMode`: such captures ignore other threads). A block whose
    /// free fails stays cached.
    pub fn release_cached(&self) {
        let blocks: Vec<(u64, Vec<CUdeviceptr>)> = self.state().free.drain().collect();
        for (class, ptrs) in blocks {
            for p in ptrs {
                // SAFETY: p came from cuMemAlloc and no live DevBuffer holds it.
                match unsafe { cudarc::driver::result::free_sync(p) } {
                    Ok(()) => self.state().cached_bytes -= class,
                    Err(_) => self.state().free.entry(class).or_default().push(p),
                }
            }
        }
    }

    /// Bytes cached, `cuMemAlloc` calls, cache hits.
    fn counters(&self) -> (u64, u64, u64) {
        let s = self.state();
        (s.cached_bytes, s.device_allocations, s.pool_hits)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.release_cached();
    }
}

fn cu_alloc(class: u64) -> Result<CUdeviceptr> {
    // SAFETY: a plain allocation on the current context.
    unsafe { cudarc::driver::result::malloc_sync(class as usize) }.map_err(|e| {
        let why = format!("cuMemAlloc of {class} bytes: {e}");
        match e.0 {
            cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory(why),
            _ => Error::Device(why),
        }
    })
}

/// What one session holds on the device, against its limit.
#[derive(Debug)]
pub struct Account {
    /// Most bytes the session may hold (pool blocks in use + VMM mapped).
    limit: u64,
    in_use: AtomicU64,
    peak: AtomicU64,
    /// What the session's VMM buffers reserve and map.
    vmm: Arc<VmmCounters>,
}

impl Account {
    fn held(&self) -> u64 {
        self.in_use.load(Ordering::Relaxed) + self.vmm.mapped.load(Ordering::Relaxed)
    }

    fn note_peak(&self) {
        self.peak.fetch_max(self.held(), Ordering::Relaxed);
    }
}

/// A session's allocator: the device's pool, with the session's account and limit.
#[derive(Debug)]
pub struct Allocator {
    pool: Arc<Pool>,
    account: Arc<Account>,
}

impl Allocator {
    /// A view of `pool` whose session may hold at most `limit` bytes.
    pub fn new(pool: Arc<Pool>, limit: u64) -> Allocator {
        let account = Account { limit, in_use: AtomicU64::new(0), peak: AtomicU64::new(0), vmm: Arc::default() };
        Allocator { pool, account: Arc::new(account) }
    }

    pub fn stats(&self) -> AllocatorStats {
        let (cached_bytes, device_allocations, pool_hits) = self.pool.counters();
        let (a, v) = (&self.account, &self.account.vmm);
        AllocatorStats {
            in_use_bytes: a.in_use.load(Ordering::Relaxed),
            cached_bytes,
            peak_bytes: a.peak.load(Ordering::Relaxed),
            device_allocations,
            pool_hits,
            vmm_reserved_bytes: v.reserved.load(Ordering::Relaxed),
            vmm_mapped_bytes: v.mapped.load(Ordering::Relaxed),
            vmm_maps: v.maps.load(Ordering::Relaxed),
            vmm_unmaps: v.unmaps.load(Ordering::Relaxed),
        }
    }

    /// The counters every [`super::VirtualBuffer`] of this session updates.
    pub fn vmm_counters(&self) -> &Arc<VmmCounters> {
        &self.account.vmm
    }

    /// Room for `bytes` more bytes within the session's limit: what the session holds and
    /// what it asks for must fit, and when the pool's cached blocks would take them past the
    /// limit, the cached blocks are freed first (a session alone on the device then keeps
    /// kiln's whole footprint within its limit, as before the pool was shared). Errors: the
    /// limit would be passed ([`Error::OutOfMemory`]); `what` names the request.
    fn make_room(&self, bytes: u64, what: &str) -> Result<()> {
        let (held, limit) = (self.account.held(), self.account.limit);
        if held + bytes > limit {
            return Err(Error::OutOfMemory(format!(
                "device memory limit of {limit} bytes reached ({held} in use, {bytes} more requested {what})"
            )));
        }
        if held + self.pool.counters().0 + bytes > limit {
            self.pool.release_cached();
        }
        Ok(())
    }

    /// Frees the device pool's cached blocks (after a driver allocation outside the pool found
    /// no room).
    pub fn release_cached(&self) {
        self.pool.release_cached();
    }

    /// Counts `bytes` about to be mapped into a VMM buffer against the limit (the buffer's
    /// counters hold them once mapped). Errors: the limit would be passed.
    pub fn charge_mapping(&mut self, bytes: u64) -> Result<()> {
        self.make_room(bytes, "to map into the KV cache's reserved addresses")
    }

    /// Takes the peak again after a mapping.
    pub fn note_peak(&mut self) {
        self.account.note_peak();
    }

    /// A buffer of at least `bytes` bytes (contents undefined), returned to the pool when
    /// dropped. Errors: the session's limit or the device's memory ([`Error::OutOfMemory`]).
    pub fn alloc(&mut self, bytes: u64) -> Result<DevBuffer> {
        self.make_room(size_class(bytes), "from the pool")?;
        self.pool.take(bytes, Some(self.account.clone()))
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
