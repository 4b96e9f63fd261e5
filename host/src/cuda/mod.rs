//! The CUDA runtime (cudarc 0.19, CUDA 13 API, libraries loaded at run time): one [`Device`]
//! per device per process, shared by every session (the primary context, a compute stream and
//! a copy stream, the caching allocator's pool, the loaded modules, cuBLASLt), and per session a
//! [`Gpu`] (its memory account and limit, status records, readbacks), the caching allocator,
//! NVRTC compilation of package sources with an on-disk cache, transfers through pinned
//! staging buffers, and execution of launch plans (kernel launches, cuBLASLt GEMMs and cuDNN
//! convolutions (`dnn`) with cached plans), CUDA graphs (`graph`: capture, instantiate, update, replay), and the nodes'
//! device status records (`status`, ABI.md §7.5), and reserved address ranges that grow in
//! place (`vmm`: the KV caches).
//!
//! cudarc's automatic event tracking is disabled right after the context is created (it
//! breaks stream capture); kiln orders its streams with its own events. Kernels run on the
//! compute stream, so a buffer freed to the pool is only reused by work enqueued after its last
//! use; the copy stream waits for the compute stream before it writes into a buffer.

mod alloc;
mod blas;
mod device;
mod dnn;
mod exec;
mod graph;
mod nvrtc;
mod status;
mod timeline;
mod transfer;
mod vmm;

use std::sync::Arc;

use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{CudaContext, CudaStream};
use kiln_kernel_abi::plan::LaunchLimits;

pub use alloc::{Account, Allocator, AllocatorStats, DevBuffer, Pool};
pub use blas::Blas;
pub use device::{CaptureGate, Device, Enqueue};
pub use dnn::{cudnn_library, takes_channels_last, ConvLayout, ConvPtrs, Dnn};
pub use exec::{Function, Gpu, KernelCache};
pub(crate) use graph::{capture, GraphExec};
pub use nvrtc::{compile_cached, compile_package, nvrtc_archs, nvrtc_version, CompiledSource};
pub use status::{Fault, StatusRecords};
pub use timeline::Timeline;
pub use transfer::{PendingDownload, Readbacks, Transfers, READBACK_BYTES};
pub use vmm::{granularity, VirtualBuffer, VmmCounters};

use crate::{Error, Result};

/// Free and total memory of the device of the calling thread's current context, in bytes
/// (`cuMemGetInfo`): what the whole process, kiln's pool and the driver's own allocations
/// (graphs, modules) included, leaves free. Errors: no current context.
pub fn memory_info() -> Result<(u64, u64)> {
    let (free, total) =
        cudarc::driver::result::mem_get_info().map_err(|e| Error::Device(format!("cuMemGetInfo: {e}")))?;
    Ok((free as u64, total as u64))
}

/// What `kiln devices` prints.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// (major, minor).
    pub compute_capability: (u32, u32),
    pub total_memory_bytes: usize,
    pub free_memory_bytes: usize,
    /// CUDA driver API version, e.g. 13000.
    pub driver_version: i32,
    /// NVRTC (major, minor).
    pub nvrtc_version: (i32, i32),
    /// cuBLASLt version number, when the library is present.
    pub cublaslt_version: Option<usize>,
    /// `sm_XY` of this device, what NVRTC compiles for.
    pub arch: String,
    pub launch_limits: LaunchLimits,
}

impl DeviceInfo {
    /// Device features packages may require (`[device] features`): `fp16` from compute
    /// capability 5.3, `bf16` and `tf32` from 8.0.
    pub fn features(&self) -> Vec<String> {
        let cc = self.compute_capability;
        let mut f = Vec::new();
        if cc >= (5, 3) {
            f.push("fp16".to_string());
        }
        if cc >= (8, 0) {
            f.push("bf16".to_string());
            f.push("tf32".to_string());
        }
        f
    }
}

/// Whether the CUDA driver library can be loaded at all.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The number of CUDA devices (0 without a driver or a GPU).
pub fn device_count() -> usize {
    if !driver_present() {
        return 0;
    }
    cudarc::driver::result::init().ok().and(CudaContext::device_count().ok()).map_or(0, |n| n.max(0) as usize)
}

fn attr(ctx: &CudaContext, a: Attr) -> Result<u32> {
    ctx.attribute(a).map(|v| v.max(0) as u32).map_err(|e| Error::Device(format!("cuDeviceGetAttribute: {e}")))
}

/// Opens device `ordinal`: context (event tracking off), compute stream, and its facts.
pub fn open_context(ordinal: usize) -> Result<(Arc<CudaContext>, Arc<CudaStream>, DeviceInfo)> {
    if !driver_present() {
        return Err(Error::Device("no CUDA driver (libcuda) on this machine".into()));
    }
    let ctx =
        CudaContext::new(ordinal).map_err(|e| Error::Device(format!("cannot open CUDA device {ordinal}: {e}")))?;
    // SAFETY: nothing has been allocated on the context yet.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().map_err(|e| Error::Device(format!("cuStreamCreate: {e}")))?;
    let (major, minor) = ctx.compute_capability().map_err(|e| Error::Device(e.to_string()))?;
    let (free, total) = ctx.mem_get_info().map_err(|e| Error::Device(e.to_string()))?;
    let mut driver_version = 0;
    // SAFETY: writes one int.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) };
    // SAFETY: only tries to dlopen the library.
    let cublaslt_version = unsafe { cudarc::cublaslt::sys::is_culib_present() }
        .then(|| unsafe { cudarc::cublaslt::sys::cublasLtGetVersion() });
    let limits = LaunchLimits {
        max_threads_per_block: attr(&ctx, Attr::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
        max_block: [
            attr(&ctx, Attr::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X)?,
            attr(&ctx, Attr::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y)?,
            attr(&ctx, Attr::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z)?,
        ],
        max_grid: [
            attr(&ctx, Attr::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)?,
            attr(&ctx, Attr::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y)?,
            attr(&ctx, Attr::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)?,
        ],
        // The opt-in maximum (227 KiB on Hopper): every loaded kernel is opted in up to it
        // (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`, see `Gpu::kernels`).
        max_shared_mem_bytes: attr(&ctx, Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
            .max(attr(&ctx, Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK)?),
    };
    let info = DeviceInfo {
        ordinal,
        name: ctx.name().unwrap_or_default(),
        compute_capability: (major as u32, minor as u32),
        total_memory_bytes: total,
        free_memory_bytes: free,
        driver_version,
        nvrtc_version: nvrtc_version().unwrap_or((0, 0)),
        cublaslt_version,
        arch: format!("sm_{major}{minor}"),
        launch_limits: limits,
    };
    Ok((ctx, stream, info))
}

/// Facts of every device, for `kiln devices`.
pub fn probe() -> Result<Vec<DeviceInfo>> {
    (0..device_count()).map(|i| open_context(i).map(|(_, _, info)| info)).collect()
}
