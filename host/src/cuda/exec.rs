//! A GPU of a session: the shared [`Device`] with the session's own account, status records,
//! readback buffers and profiling timeline; uploads, downloads, package kernels and
//! launch-plan execution.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use bytes::Bytes;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::CudaFunction;
use cudarc::nvrtc::Ptx;
use kiln_kernel_abi::plan::{LaunchPlan, PlanArg, PlanStep};
use kiln_kernel_abi::wire::{Conv, Gemm, KernelArg};
use kiln_kernel_abi::DType;
use kiln_registry::Package;

use super::{compile_cached, Allocator, ConvLayout, DevBuffer, Device, DeviceInfo};
use crate::{Error, Result, Tensor};

/// A loaded kernel (`CUfunction`), valid while its [`Device`] lives.
#[derive(Clone, Copy, Debug)]
pub struct Function {
    pub f: cudarc::driver::sys::CUfunction,
    /// Launched with programmatic dependent launch (the package declares the kernel PDL-safe
    /// and the session has PDL on).
    pub pdl: bool,
}

// SAFETY: a CUfunction is a handle of the context, usable from any thread that makes the
// context current; kiln uses it only through its session.
unsafe impl Send for Function {}
unsafe impl Sync for Function {}

/// The kernels of one package, by entry-point name.
pub type KernelCache = HashMap<String, CudaFunction>;

/// The sha256 of a package's CUDA sources and headers, by name and text, and of each source's
/// declared kernels with their signatures and PDL flags: what its loaded kernels depend on
/// beyond its id (two packages of one name and version may differ in any of them).
fn sources_digest(pkg: &Package) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    let mut part = |t: &str| {
        h.update((t.len() as u64).to_le_bytes());
        h.update(t.as_bytes());
    };
    for (name, text) in pkg.cuda_sources.iter().chain(&pkg.includes) {
        part(name);
        part(text);
    }
    // What the manifest says of each source's kernels decides what is compiled (the
    // instantiations of name expressions) and how each is checked and launched.
    for c in &pkg.manifest.cuda {
        part(&c.source);
        for k in &c.kernels {
            part(k);
            part(&format!("{:?} {}", c.params(k), c.kernel_pdl(k)));
        }
    }
    hex::encode(&h.finalize()[..8])
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // The kernels enqueued so far may still write the status records and read back into
        // the pinned buffers this value owns.
        let _ = self.synchronize();
    }
}

/// One device as a session uses it.
pub struct Gpu {
    pub info: DeviceInfo,
    /// The device's pool, with this session's account and memory limit.
    pub alloc: Allocator,
    /// NVRTC compiles and cache hits of this session's loads.
    pub compiles: u64,
    pub compile_cache_hits: u64,
    /// Per-node GPU timing, when profiling.
    pub timeline: Option<super::Timeline>,
    /// Launch the kernels that packages declare PDL-safe (`[[cuda]] pdl`) with programmatic
    /// stream serialization, so that each may start while its predecessor ends (compute
    /// capability 9.0 and later; see [`Gpu::pdl_supported`]).
    pub pdl: bool,
    /// The device's loaded kernels this session used, by package id (one registry, so one
    /// package per id).
    kernels: HashMap<String, Arc<KernelCache>>,
    /// Pinned buffers of the reads this session collects later.
    readbacks: super::Readbacks,
    /// One device status record per node of the session's graph (ABI.md §7.5).
    status: super::StatusRecords,
    /// The counters of the nodes whose launches take them (`KernelArg::Counters`, ABI.md §6.3),
    /// by node: `MAX_COUNTERS` words each, zeroed once, at one address for the session.
    counters: HashMap<usize, DevBuffer>,
    /// The workspace of this session's cuDNN convolutions, grown (outside captures) to the
    /// largest plan's, against the session's memory limit.
    conv_workspace: Option<DevBuffer>,
    /// Workspaces a larger one replaced: a graph captured before the growth still uses its
    /// address, so they live as long as the session.
    retired_workspaces: Vec<DevBuffer>,
    /// Channels-last copies of the session's resident convolution filters, by the filter's
    /// address and bytes: one per filter, whatever the execution plans that read it, kept (never
    /// replaced) while the session lives, since those plans hold their addresses.
    filters_last: HashMap<(CUdeviceptr, u64), DevBuffer>,
    /// The process's device, shared with every other session on it. Last: the fields above
    /// (events, pinned memory, pool blocks) go while its context lives.
    pub device: Arc<Device>,
}

fn dev_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Device(format!("{what}: {e}"))
}

/// `cuLaunchKernelEx` with `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`: the kernel
/// may start once every block of the stream's previous kernel has triggered
/// (`griddepcontrol.launch_dependents`) or exited, and waits for that kernel's completion in
/// `kiln_griddep_wait()` (CUDA Programming Guide, "Programmatic Dependent Launch and
/// Synchronization"). Stream capture keeps the dependency as a programmatic graph edge.
fn launch_pdl(
    f: cudarc::driver::sys::CUfunction,
    kernel: &str,
    grid: [u32; 3],
    block: [u32; 3],
    shmem: u32,
    stream: cudarc::driver::sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    use cudarc::driver::sys;
    // SAFETY: a zeroed attribute is a valid C struct; the union member written is the one the
    // id names.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: grid[0],
        gridDimY: grid[1],
        gridDimZ: grid[2],
        blockDimX: block[0],
        blockDimY: block[1],
        blockDimZ: block[2],
        sharedMemBytes: shmem,
        hStream: stream,
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: as `Gpu::launch`: the plan was validated by the sandbox, `params` outlives the
    // call and `config` points at one live attribute.
    unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()) }
        .result()
        .map_err(|e| Error::Device(format!("launch of {kernel} (programmatic dependent launch): {e}")))
}

/// Lets `f` launch with up to `limit` bytes of shared memory per block, static included (the
/// device's opt-in maximum, which the sandbox checks launches against): past 48 KiB the driver
/// refuses a launch unless the function's `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`
/// allows it (CUDA Programming Guide, "Shared Memory", compute capability 7.x and later). The
/// attribute is a permission only: a launch still reserves the memory it asks for.
fn opt_in_shared_memory(f: &CudaFunction, limit: u32) -> std::result::Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys::CUfunction_attribute_enum as FuncAttr;
    let default = 48 << 10;
    if limit <= default {
        return Ok(());
    }
    let static_bytes = f.shared_size_bytes()?.max(0) as u32;
    let dynamic = limit.saturating_sub(static_bytes).min(i32::MAX as u32) as i32;
    f.set_attribute(FuncAttr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic)
}

/// Lets `f` launch as clusters of more than 8 blocks where it was compiled for one
/// (`__cluster_dims__`, read back as `CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH` × height × depth):
/// 8 is the portable maximum, and past it the driver refuses a launch unless the function's
/// `CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED` is set (CUDA Programming Guide, "Thread
/// Block Clusters": Hopper runs clusters of 16 with it, where the blocks fit a GPC). A permission
/// only, as `opt_in_shared_memory`; kernels without compiled cluster dimensions are left alone.
fn allow_wide_clusters(f: &CudaFunction) -> std::result::Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys::CUfunction_attribute_enum as FuncAttr;
    let dims = [
        FuncAttr::CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH,
        FuncAttr::CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT,
        FuncAttr::CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH,
    ];
    let mut blocks = 1i64;
    for d in dims {
        // Drivers or devices without clusters report an error or 0: no compiled cluster.
        blocks *= i64::from(f.get_attribute(d).unwrap_or(0).max(1));
    }
    if blocks <= 8 {
        return Ok(());
    }
    f.set_attribute(FuncAttr::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
}

/// The parameters of a loaded kernel as compiled (`cuFuncGetParamInfo`, CUDA 12.4: each one's
/// size, in order) against its signature in the package's manifest (ABI.md §7.3), once per
/// kernel at load: a count or a size that differs would have the driver read a parameter buffer
/// of the wrong layout at launch. Errors: invalid input naming the package, the kernel and the
/// first parameter that differs.
fn check_params(
    pkg: &str,
    kernel: &str,
    f: cudarc::driver::sys::CUfunction,
    declared: &[kiln_kernel_abi::manifest::ParamKind],
) -> Result<()> {
    let mut sizes = Vec::new();
    while sizes.len() <= kiln_kernel_abi::wire::MAX_KERNEL_ARGS {
        let (mut offset, mut size) = (0usize, 0usize);
        // SAFETY: a loaded function of the current context; the out-pointers are live locals.
        let r = unsafe { cudarc::driver::sys::cuFuncGetParamInfo(f, sizes.len(), &mut offset, &mut size) };
        match r {
            cudarc::driver::sys::CUresult::CUDA_SUCCESS => sizes.push(size),
            // Past the last parameter.
            cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_VALUE => break,
            e => return Err(Error::Device(format!("package {pkg}: kernel {kernel}: cuFuncGetParamInfo: {e:?}"))),
        }
    }
    let list = |d: &[kiln_kernel_abi::manifest::ParamKind]| d.iter().map(|p| p.name()).collect::<Vec<_>>().join(", ");
    if sizes.len() != declared.len() {
        return Err(Error::Input(format!(
            "package {pkg}: kernel {kernel} takes {} parameters as compiled, but its kernel.toml signature \
             declares {} ({}): the signature must list the kernel's C parameters in order (ABI.md §7.3)",
            sizes.len(),
            declared.len(),
            list(declared)
        )));
    }
    for (i, (size, kind)) in sizes.iter().zip(declared).enumerate() {
        if *size != kind.size() {
            return Err(Error::Input(format!(
                "package {pkg}: kernel {kernel}: parameter {i} is {size} bytes as compiled, but its kernel.toml \
                 signature declares {} ({} bytes) (ABI.md §7.3)",
                kind.name(),
                kind.size()
            )));
        }
    }
    Ok(())
}

impl Gpu {
    /// Whether the device can launch kernels with programmatic dependent launch and capture
    /// such launches into graphs: compute capability 9.0 and later, and a driver of CUDA 12.3 or
    /// later (programmatic edges in stream capture).
    pub fn pdl_supported(&self) -> bool {
        self.info.compute_capability.0 >= 9 && self.info.driver_version >= 12030
    }

    /// Device `ordinal` (the process's shared [`Device`]) for a session that may hold at most
    /// `memory_limit` bytes on it (default: the device's memory).
    pub fn open(ordinal: usize, memory_limit: Option<u64>) -> Result<Gpu> {
        let device = Device::open(ordinal)?;
        let info = device.info.clone();
        let limit = memory_limit.unwrap_or(info.total_memory_bytes as u64);
        Ok(Gpu {
            alloc: Allocator::new(device.pool.clone(), limit),
            device,
            info,
            kernels: HashMap::new(),
            compiles: 0,
            compile_cache_hits: 0,
            timeline: None,
            pdl: false,
            readbacks: super::Readbacks::new()?,
            status: super::StatusRecords::new(1)?,
            counters: HashMap::new(),
            conv_workspace: None,
            retired_workspaces: Vec::new(),
            filters_last: HashMap::new(),
        })
    }

    /// Gives the session `records` device status records, one per node (ABI.md §7.5), before
    /// anything is launched: a captured graph holds their addresses, so they are never moved
    /// once a plan has run.
    pub fn status_records(&mut self, records: usize) -> Result<()> {
        if records > self.status.len() {
            self.synchronize()?;
            self.device.ctx.bind_to_thread().map_err(dev_err("cuCtxSetCurrent"))?;
            self.status = super::StatusRecords::new(records)?;
        }
        Ok(())
    }

    /// The first failure a kernel reported through a status record since the last call, with
    /// every record cleared (ABI.md §7.5). Meaningful once the stream's work is done.
    pub fn take_fault(&mut self) -> Option<super::Fault> {
        self.status.take()
    }

    /// Copies a host tensor to a new device buffer (through the copy stream; later work on the
    /// compute stream sees it).
    pub fn upload(&mut self, t: &Tensor) -> Result<DevBuffer> {
        let buf = self.alloc.alloc(t.data.len() as u64)?;
        let stream = self.device.enqueue();
        let mut transfers = self.device.transfers();
        if let Err(e) = transfers.upload(&stream, buf.ptr, &t.data) {
            // Chunks already queued may still write into the buffer: wait before it goes back.
            let _ = transfers.synchronize();
            return Err(e);
        }
        Ok(buf)
    }

    /// A new device buffer of `bytes` zero bytes (the memset is enqueued on the stream).
    pub fn zeroed(&mut self, bytes: u64) -> Result<DevBuffer> {
        let buf = self.alloc.alloc(bytes)?;
        self.zero(buf.ptr, bytes)?;
        Ok(buf)
    }

    /// The device's VMM allocation granularity in bytes ([`super::granularity`]).
    pub fn granularity(&self) -> Result<u64> {
        super::granularity(self.device.ctx.cu_device())
    }

    /// Reserves `bytes` of device addresses, nothing mapped ([`super::VirtualBuffer`]).
    pub fn reserve(&mut self, bytes: u64) -> Result<super::VirtualBuffer> {
        super::VirtualBuffer::reserve(&self.device, bytes, self.alloc.vmm_counters())
    }

    /// Maps `vb` so that its first `bytes` bytes are usable, within the device-memory limit
    /// (their contents undefined). Errors: the limit ([`Error::OutOfMemory`], nothing mapped),
    /// the driver's.
    pub fn map(&mut self, vb: &mut super::VirtualBuffer, bytes: u64) -> Result<()> {
        let all = vb.reserved();
        self.map_at(vb, 0, bytes, all)
    }

    /// [`Gpu::map`] for the region of `limit` bytes at offset `start` of `vb` (a multiple of
    /// its granularity): its first `bytes` bytes usable.
    pub fn map_at(&mut self, vb: &mut super::VirtualBuffer, start: u64, bytes: u64, limit: u64) -> Result<()> {
        let add = vb.growth_at(start, bytes, limit);
        if add == 0 {
            return Ok(());
        }
        self.alloc.charge_mapping(add)?;
        match vb.map_at(start, bytes, limit) {
            // The device's free memory may sit in the pool's cached blocks.
            Err(Error::OutOfMemory(_)) => {
                self.alloc.release_cached();
                vb.map_at(start, bytes, limit)?;
            }
            other => other?,
        }
        self.alloc.note_peak();
        Ok(())
    }

    /// Sets `bytes` bytes at `ptr` to zero (enqueued on the stream; the caller guarantees the
    /// extent).
    pub fn zero(&mut self, ptr: CUdeviceptr, bytes: u64) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let stream = self.device.enqueue();
        // SAFETY: the caller guarantees [ptr, ptr + bytes) is device memory it owns.
        unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, bytes as usize, stream.cu_stream()) }
            .map_err(dev_err("cuMemsetD8Async"))
    }

    /// Copies host bytes into `dst`, which holds at least `data.len()` bytes (through the copy
    /// stream; `data` may go away on return).
    pub fn upload_into(&mut self, dst: CUdeviceptr, data: &[u8]) -> Result<()> {
        let stream = self.device.enqueue();
        self.device.transfers().upload(&stream, dst, data)
    }

    /// Copies `bytes` bytes from `src` to `dst` on the stream (both extents checked by the caller).
    pub fn copy(&mut self, dst: CUdeviceptr, src: CUdeviceptr, bytes: u64) -> Result<()> {
        if bytes == 0 || dst == src {
            return Ok(());
        }
        let stream = self.device.enqueue();
        // SAFETY: the caller guarantees both extents.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes as usize, stream.cu_stream()) }
            .map_err(dev_err("cuMemcpyDtoDAsync"))
    }

    /// Copies `height` rows of `width` bytes from `src` (rows `src_pitch` bytes apart) to `dst`
    /// (rows `dst_pitch` bytes apart) on the stream (`cuMemcpy2DAsync`; both extents checked by
    /// the caller, pitches at least `width`).
    pub fn copy_2d(
        &mut self,
        dst: CUdeviceptr,
        dst_pitch: u64,
        src: CUdeviceptr,
        src_pitch: u64,
        width: u64,
        height: u64,
    ) -> Result<()> {
        use cudarc::driver::sys;
        if width == 0 || height == 0 {
            return Ok(());
        }
        let stream = self.device.enqueue();
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch as usize,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch as usize,
            WidthInBytes: width as usize,
            Height: height as usize,
        };
        // SAFETY: the caller guarantees both extents; the descriptor is read during the call.
        let r = unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream.cu_stream()) };
        match r {
            sys::CUresult::CUDA_SUCCESS => Ok(()),
            e => Err(Error::Device(format!("cuMemcpy2DAsync: {e:?}"))),
        }
    }

    /// Copies `bytes` bytes of a device buffer back once the compute stream's work so far is
    /// done (through the copy stream).
    pub fn download(&mut self, ptr: CUdeviceptr, dtype: DType, shape: Vec<usize>, bytes: usize) -> Result<Tensor> {
        let mut host = vec![0u8; bytes];
        let stream = self.device.enqueue();
        let download = self.device.transfers().download(&stream, ptr, &mut host);
        drop(stream);
        download?;
        Tensor::new(dtype, shape, Bytes::from(host))
    }

    /// Starts a download of `bytes` bytes (at most [`super::READBACK_BYTES`]) of a device
    /// buffer after the stream's work so far, without waiting ([`super::Readbacks::download_start`]).
    pub fn download_start(&mut self, ptr: CUdeviceptr, bytes: usize) -> Result<super::PendingDownload> {
        let stream = self.device.enqueue();
        self.readbacks.download_start(&stream, ptr, bytes)
    }

    /// Waits for a download of [`Gpu::download_start`] and returns its bytes.
    pub fn download_finish(&mut self, p: super::PendingDownload) -> Result<Vec<u8>> {
        self.readbacks.download_finish(p)
    }

    /// Records a timeline mark on the stream when profiling.
    pub fn mark(&mut self) -> Result<()> {
        match self.timeline.as_mut() {
            Some(t) => t.mark(&self.device.enqueue()),
            None => Ok(()),
        }
    }

    /// Waits for the device's compute stream (every session's work on it so far).
    pub fn synchronize(&self) -> Result<()> {
        self.device.synchronize()
    }

    /// The loaded kernels of `pkg`, from the device's module cache or compiled (or taken from
    /// the NVRTC cache) and loaded now, with the headers of [`Package::includes`] (its
    /// dependencies' once the registry is linked). A package is known by its id and the digest
    /// of its sources, so two packages that share a name and version never share kernels.
    fn kernels(&mut self, pkg: &Package) -> Result<Arc<KernelCache>> {
        let id = pkg.id();
        if let Some(k) = self.kernels.get(&id) {
            return Ok(k.clone());
        }
        let key = format!("{id}#{}", sources_digest(pkg));
        let (device, info) = (self.device.clone(), &self.info);
        let (mut compiles, mut hits) = (0, 0);
        let kernels = device.module(&key, || {
            let id = pkg.id();
            let mut fns = HashMap::new();
            for src in &pkg.manifest.cuda {
                let text = pkg
                    .cuda_sources
                    .get(&src.source)
                    .ok_or_else(|| Error::Device(format!("{id}: source {} missing", src.source)))?;
                let mut compiled =
                    compile_cached(&id, &src.source, text, &pkg.includes, &info.arch, &src.name_expressions())?;
                if compiled.cache_hit {
                    hits += 1;
                } else {
                    compiles += 1;
                }
                let cubin = std::mem::take(&mut compiled.cubin);
                let module = device.ctx.load_module(Ptx::from_binary(cubin)).map_err(dev_err("cuModuleLoadData"))?;
                for k in &src.kernels {
                    let f = module
                        .load_function(compiled.symbol(k))
                        .map_err(|e| Error::Device(format!("{id}: kernel {k} of {}: {e}", src.source)))?;
                    if info.driver_version >= 12040 {
                        check_params(&id, k, f.cu_function(), src.params(k).unwrap_or_default())?;
                    }
                    if let Err(e) = opt_in_shared_memory(&f, info.launch_limits.max_shared_mem_bytes) {
                        // A permission only: the kernel still runs within 48 KiB.
                        tracing::warn!("{id}: kernel {k} of {}: no shared memory past 48 KiB: {e}", src.source);
                    }
                    if let Err(e) = allow_wide_clusters(&f) {
                        // Its launches then fail with the driver's error, naming the kernel.
                        tracing::warn!("{id}: kernel {k} of {}: no cluster past 8 blocks: {e}", src.source);
                    }
                    fns.insert(k.clone(), f);
                }
            }
            Ok(fns)
        });
        self.compiles += compiles;
        self.compile_cache_hits += hits;
        let kernels = kernels?;
        self.kernels.insert(id, kernels.clone());
        Ok(kernels)
    }

    /// The loaded function `kernel` of `pkg` (compiling the package's sources if needed).
    pub fn function(&mut self, pkg: &Package, kernel: &str) -> Result<cudarc::driver::sys::CUfunction> {
        self.kernels(pkg)?
            .get(kernel)
            .map(|f| f.cu_function())
            .ok_or_else(|| Error::Device(format!("{}: no kernel {kernel}", pkg.id())))
    }

    /// Compiles every package's sources ahead of use (`kiln kernels warm`).
    pub fn warm(&mut self, pkg: &Package) -> Result<usize> {
        self.kernels(pkg).map(|k| k.len())
    }

    /// Runs a launch plan. `slots` are the device pointers of the call's inputs then outputs
    /// (present ones, in order), each with its size in bytes; scratch is allocated here and
    /// returned to the pool after the plan. `record`: the node's status record (its index in
    /// the session's graph; 0 outside a session).
    pub fn execute(
        &mut self,
        pkg: &Package,
        plan: &LaunchPlan,
        slots: &[(CUdeviceptr, u64)],
        record: usize,
    ) -> Result<()> {
        let functions = self.plan_functions(pkg, plan)?;
        self.execute_resolved(plan, &functions, slots, record)
    }

    /// The loaded function of every launch step of `plan` (compiling the package's sources on
    /// first use); `None` for GEMM steps. Kept with a memoized plan, it spares later runs the
    /// lookups.
    pub fn plan_functions(&mut self, pkg: &Package, plan: &LaunchPlan) -> Result<Vec<Option<Function>>> {
        plan.steps
            .iter()
            .map(|step| match step {
                PlanStep::Launch { kernel, .. } => {
                    let pdl = self.pdl && pkg.manifest.kernel_pdl(kernel);
                    self.function(pkg, kernel).map(|f| Some(Function { f, pdl }))
                }
                PlanStep::Gemm(_) | PlanStep::Conv(_) => Ok(None),
            })
            .collect()
    }

    /// Readies node `record`'s counters when a launch of `plan` takes them (`KernelArg::Counters`):
    /// `MAX_COUNTERS` words, zeroed on the stream, kept for the session. Allocates, so it runs
    /// before a plan is recorded or captured, never inside a capture. Errors: device memory.
    pub fn prepare_counters(&mut self, record: usize, plan: &LaunchPlan) -> Result<()> {
        let takes = plan.steps.iter().any(|s| match s {
            PlanStep::Launch { args, .. } => args.iter().any(|a| matches!(a, PlanArg::Scalar(KernelArg::Counters(_)))),
            PlanStep::Gemm(_) | PlanStep::Conv(_) => false,
        });
        if !takes || self.counters.contains_key(&record) {
            return Ok(());
        }
        let b = self.zeroed(kiln_kernel_abi::wire::MAX_COUNTERS as u64 * 4)?;
        self.counters.insert(record, b);
        Ok(())
    }

    /// Runs `plan` with the functions of [`Gpu::plan_functions`].
    pub fn execute_resolved(
        &mut self,
        plan: &LaunchPlan,
        functions: &[Option<Function>],
        slots: &[(CUdeviceptr, u64)],
        record: usize,
    ) -> Result<()> {
        let mut scratch = Vec::new();
        let mut with_scratch;
        let all: &[(CUdeviceptr, u64)] = if plan.scratch_bytes.is_empty() {
            slots
        } else {
            with_scratch = slots.to_vec();
            for &n in &plan.scratch_bytes {
                let b = self.alloc.alloc(n)?;
                with_scratch.push((b.ptr, n));
                scratch.push(b);
            }
            &with_scratch
        };
        // GEMMs make their plan on first use; a convolution's workspace must exist first.
        self.prepare_convs(plan)?;
        // The scratch goes back to the pool after the launches are enqueued: only later work
        // can reuse it.
        self.run_steps(plan, functions, all, record, ConvLayout::default())
    }

    /// Enqueues `plan`'s launches and GEMMs with every slot given (inputs, outputs, then
    /// scratch) and status record `record`: no allocation, no synchronization, so an execution
    /// plan can run it inside a capture. Its convolutions run in `layout` (an execution plan's
    /// channels-last convolution; [`Gpu::prepare_conv`] made that plan).
    pub fn run_steps(
        &mut self,
        plan: &LaunchPlan,
        functions: &[Option<Function>],
        slots: &[(CUdeviceptr, u64)],
        record: usize,
        layout: ConvLayout,
    ) -> Result<()> {
        let status = self.status.device_ptr(record)?;
        // 0 when the node has none: a launch that takes them then fails (never prepared).
        let counters = self.counters.get(&record).map_or(0, |b| b.ptr);
        plan.steps.iter().zip(functions).try_for_each(|(step, f)| match (step, f) {
            (PlanStep::Launch { kernel, grid, block, shared_mem_bytes, args }, Some(f)) => {
                self.launch(f, kernel, *grid, *block, *shared_mem_bytes, args, slots, (status, counters))
            }
            (PlanStep::Gemm(g), _) => self.gemm(g, slots),
            (PlanStep::Conv(c), _) => self.conv(c, layout, slots),
            (PlanStep::Launch { kernel, .. }, None) => Err(Error::Device(format!("kernel {kernel} was not loaded"))),
        })
    }

    /// Readies everything `plan`'s GEMMs and convolutions need before a capture (the cuBLASLt
    /// and cuDNN handles, each shape's algorithm, the workspaces), without enqueueing anything.
    /// Errors: a library's, or the session's memory limit for the convolution workspace.
    pub fn prepare_library_steps(&mut self, plan: &LaunchPlan) -> Result<()> {
        for step in &plan.steps {
            if let PlanStep::Gemm(g) = step {
                self.device.with_blas(|b| b.prepare(g))?;
            }
        }
        self.prepare_convs(plan)
    }

    /// Each convolution's cuDNN plan, and a workspace as large as the largest needs (never
    /// inside a capture: it may allocate). Errors: cuDNN's, or the session's memory limit.
    fn prepare_convs(&mut self, plan: &LaunchPlan) -> Result<()> {
        for step in &plan.steps {
            if let PlanStep::Conv(c) = step {
                self.prepare_conv(c, ConvLayout::default())?;
            }
        }
        Ok(())
    }

    /// `c`'s cuDNN plan in `layout`, and a workspace as large as it needs (never inside a
    /// capture: it may allocate). Errors: cuDNN's, or the session's memory limit.
    pub fn prepare_conv(&mut self, c: &Conv, layout: ConvLayout) -> Result<()> {
        let bytes = self.device.with_dnn(|d| d.prepare(c, layout))?;
        let held = self.conv_workspace.as_ref().map_or(0, |b| b.bytes);
        if bytes > held {
            // At least twice the old size, so that few are retired.
            let grown = self.alloc.alloc(bytes.max(2 * held))?;
            self.retired_workspaces.extend(self.conv_workspace.replace(grown));
        }
        Ok(())
    }

    /// The address of a copy of `c`'s resident filter (at `src`, `bytes` long) as its
    /// channels-last plan reads it (`[M, kh, kw, C/groups]`): made on the stream on first use,
    /// then kept for the session (its filters stay where they are). Never inside a capture: it
    /// may allocate. Errors: device memory, cuDNN's.
    pub fn filter_to_last(&mut self, c: &Conv, src: CUdeviceptr, bytes: u64) -> Result<CUdeviceptr> {
        if let Some(b) = self.filters_last.get(&(src, bytes)) {
            return Ok(b.ptr);
        }
        let dst = self.alloc.alloc(bytes)?;
        let stream = self.device.enqueue();
        self.device.with_dnn(|d| d.filter_to_last(c, src, dst.ptr, stream.cu_stream()))?;
        let ptr = dst.ptr;
        self.filters_last.insert((src, bytes), dst);
        Ok(ptr)
    }

    #[allow(clippy::too_many_arguments)]
    fn launch(
        &mut self,
        f: &Function,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        shmem: u32,
        args: &[PlanArg],
        slots: &[(CUdeviceptr, u64)],
        (status, counters): (CUdeviceptr, CUdeviceptr),
    ) -> Result<()> {
        // One 8-byte cell per argument; the kernel reads its parameter's size from the cell.
        // Up to 64 arguments live on the stack.
        let mut stack_cells = [0u64; 64];
        let mut heap_cells = Vec::new();
        let cells: &mut [u64] = if args.len() <= stack_cells.len() {
            &mut stack_cells[..args.len()]
        } else {
            heap_cells.resize(args.len(), 0);
            &mut heap_cells
        };
        for (cell, a) in cells.iter_mut().zip(args) {
            *cell = match *a {
                PlanArg::Tensor { slot, offset } => slots
                    .get(slot)
                    .map(|s| s.0 + offset)
                    .ok_or_else(|| Error::Device(format!("launch {kernel}: slot {slot} missing")))?,
                PlanArg::Scalar(KernelArg::I32(v)) => v as u32 as u64,
                PlanArg::Scalar(KernelArg::U32(v)) => v as u64,
                PlanArg::Scalar(KernelArg::I64(v)) => v as u64,
                PlanArg::Scalar(KernelArg::U64(v)) => v,
                PlanArg::Scalar(KernelArg::F32(v)) => v.to_bits() as u64,
                PlanArg::Scalar(KernelArg::F64(v)) => v.to_bits(),
                PlanArg::Scalar(KernelArg::Status) => status,
                PlanArg::Scalar(KernelArg::Counters(_)) if counters != 0 => counters,
                PlanArg::Scalar(KernelArg::Counters(_)) => {
                    return Err(Error::Device(format!("launch {kernel}: the node's counters were not prepared")))
                }
                PlanArg::Scalar(KernelArg::Tensor { .. }) => {
                    return Err(Error::Device("tensor argument left in a plan".into()))
                }
            };
        }
        let mut stack_params = [std::ptr::null_mut::<c_void>(); 64];
        let mut heap_params = Vec::new();
        let params: &mut [*mut c_void] = if cells.len() <= stack_params.len() {
            &mut stack_params[..cells.len()]
        } else {
            heap_params.resize(cells.len(), std::ptr::null_mut());
            &mut heap_params
        };
        for (p, c) in params.iter_mut().zip(cells.iter_mut()) {
            *p = c as *mut u64 as *mut c_void;
        }
        let stream = self.device.enqueue();
        if f.pdl {
            return launch_pdl(f.f, kernel, grid, block, shmem, stream.cu_stream(), params);
        }
        // SAFETY: the sandbox checked the kernel name, dimensions and tensor offsets against
        // the device limits and the tensors' sizes; `cells` outlives the call (the driver
        // copies parameters at launch).
        unsafe {
            cudarc::driver::result::launch_kernel(
                f.f,
                (grid[0], grid[1], grid[2]),
                (block[0], block[1], block[2]),
                shmem,
                stream.cu_stream(),
                params,
            )
        }
        .map_err(|e| Error::Device(format!("launch of {kernel}: {e}")))
    }

    fn gemm(&mut self, g: &Gemm, slots: &[(CUdeviceptr, u64)]) -> Result<()> {
        let ptr = |o: &kiln_kernel_abi::wire::Operand| slots.get(o.handle as usize).map(|s| s.0 + o.offset);
        let (a, b, d) = match (ptr(&g.a), ptr(&g.b), ptr(&g.d)) {
            (Some(a), Some(b), Some(d)) => (a, b, d),
            _ => return Err(Error::Device("gemm: operand slot missing".into())),
        };
        let size = g.dtype.size().unwrap_or(4) as u64;
        if let (Some(c), beta) = (g.c.as_ref(), g.beta) {
            if beta != 0.0 {
                let cp = ptr(c).ok_or_else(|| Error::Device("gemm: C slot missing".into()))?;
                if cp != d {
                    let stream = self.device.enqueue();
                    if c.ld != g.d.ld || c.batch_stride != g.d.batch_stride {
                        return Err(Error::Unsupported("gemm: C with another layout than D".into()));
                    }
                    let extent = ((g.batch - 1) * g.d.batch_stride + (g.m - 1) * g.d.ld + g.n) * size;
                    // SAFETY: both extents were checked by the sandbox.
                    unsafe { cudarc::driver::result::memcpy_dtod_async(d, cp, extent as usize, stream.cu_stream()) }
                        .map_err(dev_err("cuMemcpyDtoDAsync"))?;
                }
            }
        }
        let bias = match g.bias.as_ref() {
            Some(o) => Some(ptr(o).ok_or_else(|| Error::Device("gemm: bias slot missing".into()))?),
            None => None,
        };
        let stream = self.device.enqueue();
        self.device.with_blas(|blas| blas.gemm(g, a, b, d, bias, stream.cu_stream()))
    }

    /// Enqueues one cuDNN convolution ([`Gpu::prepare_library_steps`] made its plan and
    /// workspace): no allocation, so it may run inside a capture.
    fn conv(&mut self, c: &Conv, layout: ConvLayout, slots: &[(CUdeviceptr, u64)]) -> Result<()> {
        let ptr = |t: &kiln_kernel_abi::wire::TensorAt| {
            slots
                .get(t.handle as usize)
                .map(|s| s.0 + t.offset)
                .ok_or_else(|| Error::Device("conv: operand slot missing".into()))
        };
        let p = super::ConvPtrs {
            x: ptr(&c.x)?,
            w: ptr(&c.w)?,
            bias: c.bias.as_ref().map(ptr).transpose()?,
            z: c.z.as_ref().map(ptr).transpose()?,
            y: ptr(&c.y)?,
        };
        let ws = self.conv_workspace.as_ref().map_or((0, 0), |b| (b.ptr, b.bytes));
        let stream = self.device.enqueue();
        self.device.with_dnn(|d| d.conv(c, layout, &p, ws, stream.cu_stream()))
    }

    /// GEMM plan-cache counters of the device: (hits, heuristic queries).
    pub fn gemm_plan_stats(&self) -> (u64, u64) {
        self.device.gemm_plan_stats()
    }
}
