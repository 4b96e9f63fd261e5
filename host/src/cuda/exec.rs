//! A GPU of a session: uploads, downloads, package kernels and launch-plan execution.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use bytes::Bytes;
use cudarc::cublaslt::{sys as lt, Activation, CudaBlasLT, Matmul, MatmulConfig, MatmulShared, Workspace};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream};
use cudarc::nvrtc::Ptx;
use kiln_kernel_abi::wire::{Epilogue, Gemm, KernelArg};
use kiln_kernel_abi::DType;
use kiln_registry::Package;

use super::{compile_cached, open_context, Allocator, DevBuffer, DeviceInfo};
use crate::sandbox::{LaunchPlan, PlanArg, PlanStep};
use crate::{Error, Result, Tensor};

/// cuBLASLt with exact float32 compute: ONNX float32 MatMul/Gemm keep full precision
/// (cudarc's own `Matmul<f32>` computes in TF32, 10-bit mantissas).
struct ExactF32<'a>(&'a CudaBlasLT);

impl MatmulShared for ExactF32<'_> {
    fn handle(&self) -> &lt::cublasLtHandle_t {
        self.0.handle()
    }
    fn workspace(&self) -> &Workspace {
        self.0.workspace()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        MatmulShared::stream(self.0)
    }
}

impl Matmul<f32> for ExactF32<'_> {
    fn matrix_type() -> lt::cudaDataType {
        lt::cudaDataType_t::CUDA_R_32F
    }
    fn compute_type() -> lt::cublasComputeType_t {
        lt::cublasComputeType_t::CUBLAS_COMPUTE_32F
    }
}

/// The kernels of one package, by entry-point name.
pub type KernelCache = HashMap<String, CudaFunction>;

impl Drop for Gpu {
    fn drop(&mut self) {
        // Everything enqueued must finish before the pool's memory goes back to the driver.
        let _ = self.synchronize();
        self.alloc.release_cached();
    }
}

/// One device as a session uses it.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub info: DeviceInfo,
    pub alloc: Allocator,
    kernels: HashMap<String, KernelCache>,
    blas: Option<CudaBlasLT>,
    /// NVRTC compiles and cache hits.
    pub compiles: u64,
    pub compile_cache_hits: u64,
}

fn dev_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Device(format!("{what}: {e}"))
}

impl Gpu {
    /// Opens device `ordinal` with a device-memory budget of `memory_limit` bytes.
    pub fn open(ordinal: usize, memory_limit: Option<u64>) -> Result<Gpu> {
        let (ctx, stream, info) = open_context(ordinal)?;
        let limit = memory_limit.unwrap_or(info.total_memory_bytes as u64);
        Ok(Gpu {
            ctx,
            stream,
            info,
            alloc: Allocator::new(limit),
            kernels: HashMap::new(),
            blas: None,
            compiles: 0,
            compile_cache_hits: 0,
        })
    }

    /// Copies a host tensor to a new device buffer (enqueued on the stream).
    pub fn upload(&mut self, t: &Tensor) -> Result<DevBuffer> {
        let buf = self.alloc.alloc(t.data.len() as u64)?;
        if !t.data.is_empty() {
            // SAFETY: buf holds at least data.len() bytes; the host bytes live until the
            // stream is synchronized (the caller keeps `t` or synchronizes before dropping it).
            unsafe { cudarc::driver::result::memcpy_htod_async(buf.ptr, &t.data[..], self.stream.cu_stream()) }
                .map_err(dev_err("cuMemcpyHtoDAsync"))?;
        }
        Ok(buf)
    }

    /// Copies `bytes` bytes of a device buffer back (synchronizes the stream).
    pub fn download(&mut self, ptr: CUdeviceptr, dtype: DType, shape: Vec<usize>, bytes: usize) -> Result<Tensor> {
        let mut host = vec![0u8; bytes];
        if bytes > 0 {
            // SAFETY: ptr holds `bytes` bytes; host is written before synchronize returns.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut host[..], ptr, self.stream.cu_stream()) }
                .map_err(dev_err("cuMemcpyDtoHAsync"))?;
        }
        self.synchronize()?;
        Tensor::new(dtype, shape, Bytes::from(host))
    }

    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(dev_err("cuStreamSynchronize"))
    }

    /// Compiles (or takes from the cache) and loads the CUDA sources of `pkg`.
    fn kernels(&mut self, pkg: &Package) -> Result<&KernelCache> {
        let id = pkg.id();
        if !self.kernels.contains_key(&id) {
            let mut fns = HashMap::new();
            for src in &pkg.manifest.cuda {
                let text = pkg
                    .cuda_sources
                    .get(&src.source)
                    .ok_or_else(|| Error::Device(format!("{id}: source {} missing", src.source)))?;
                let compiled = compile_cached(&id, &src.source, text, &self.info.arch)?;
                if compiled.cache_hit {
                    self.compile_cache_hits += 1;
                } else {
                    self.compiles += 1;
                }
                let module =
                    self.ctx.load_module(Ptx::from_binary(compiled.cubin)).map_err(dev_err("cuModuleLoadData"))?;
                for k in &src.kernels {
                    let f = module
                        .load_function(k)
                        .map_err(|e| Error::Device(format!("{id}: kernel {k} of {}: {e}", src.source)))?;
                    fns.insert(k.clone(), f);
                }
            }
            self.kernels.insert(id.clone(), fns);
        }
        Ok(&self.kernels[&id])
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
    /// returned to the pool after the plan.
    pub fn execute(&mut self, pkg: &Package, plan: &LaunchPlan, slots: &[(CUdeviceptr, u64)]) -> Result<()> {
        let mut all: Vec<(CUdeviceptr, u64)> = slots.to_vec();
        let mut scratch = Vec::with_capacity(plan.scratch_bytes.len());
        for &n in &plan.scratch_bytes {
            let b = self.alloc.alloc(n)?;
            all.push((b.ptr, n));
            scratch.push(b);
        }
        let result = plan.steps.iter().try_for_each(|step| match step {
            PlanStep::Launch { kernel, grid, block, shared_mem_bytes, args } => {
                self.launch(pkg, kernel, *grid, *block, *shared_mem_bytes, args, &all)
            }
            PlanStep::Gemm(g) => self.gemm(g, &all),
        });
        for b in scratch {
            self.alloc.free(b);
        }
        result
    }

    #[allow(clippy::too_many_arguments)]
    fn launch(
        &mut self,
        pkg: &Package,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        shmem: u32,
        args: &[PlanArg],
        slots: &[(CUdeviceptr, u64)],
    ) -> Result<()> {
        let stream = self.stream.cu_stream();
        let f = self
            .kernels(pkg)?
            .get(kernel)
            .ok_or_else(|| Error::Device(format!("{}: kernel {kernel} was not loaded", pkg.id())))?
            .cu_function();
        // One 8-byte cell per argument; the kernel reads its parameter's size from the cell.
        let mut cells: Vec<u64> = Vec::with_capacity(args.len());
        for a in args {
            cells.push(match *a {
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
                PlanArg::Scalar(KernelArg::Tensor { .. }) => {
                    return Err(Error::Device("tensor argument left in a plan".into()))
                }
            });
        }
        let mut params: Vec<*mut c_void> = cells.iter_mut().map(|c| c as *mut u64 as *mut c_void).collect();
        // SAFETY: the sandbox checked the kernel name, dimensions and tensor offsets against
        // the device limits and the tensors' sizes; `cells` outlives the call (the driver
        // copies parameters at launch).
        unsafe {
            cudarc::driver::result::launch_kernel(
                f,
                (grid[0], grid[1], grid[2]),
                (block[0], block[1], block[2]),
                shmem,
                stream,
                &mut params,
            )
        }
        .map_err(|e| Error::Device(format!("{}: launch of {kernel}: {e}", pkg.id())))
    }

    fn gemm(&mut self, g: &Gemm, slots: &[(CUdeviceptr, u64)]) -> Result<()> {
        if self.blas.is_none() {
            self.blas =
                Some(CudaBlasLT::new(self.stream.clone()).map_err(|e| Error::Device(format!("cuBLASLt: {e:?}")))?);
        }
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
                    if c.ld != g.d.ld || c.batch_stride != g.d.batch_stride {
                        return Err(Error::Unsupported("gemm: C with another layout than D".into()));
                    }
                    let extent = ((g.batch - 1) * g.d.batch_stride + (g.m - 1) * g.d.ld + g.n) * size;
                    // SAFETY: both extents were checked by the sandbox.
                    unsafe {
                        cudarc::driver::result::memcpy_dtod_async(d, cp, extent as usize, self.stream.cu_stream())
                    }
                    .map_err(dev_err("cuMemcpyDtoDAsync"))?;
                }
            }
        }
        // Row-major D = op(A)·op(B) is column-major Dᵀ = op(B)ᵀ·op(A)ᵀ: swap the operands.
        let batched = g.batch > 1;
        let cfg = MatmulConfig {
            transa: g.trans_b,
            transb: g.trans_a,
            transc: false,
            m: g.n,
            n: g.m,
            k: g.k,
            alpha: g.alpha,
            lda: g.b.ld as i64,
            ldb: g.a.ld as i64,
            beta: if g.c.is_some() { g.beta } else { 0.0 },
            ldc: g.d.ld as i64,
            stride_a: batched.then_some(g.b.batch_stride as i64),
            stride_b: batched.then_some(g.a.batch_stride as i64),
            stride_c: batched.then_some(g.d.batch_stride as i64),
            stride_bias: batched.then_some(0),
            batch_size: batched.then_some(g.batch as i32),
        };
        let act = match g.epilogue {
            Epilogue::None => None,
            Epilogue::Relu => Some(Activation::Relu),
            Epilogue::Gelu => Some(Activation::Gelu),
        };
        let bias = g.bias.as_ref().and_then(ptr);
        let blas = self.blas.as_ref().ok_or_else(|| Error::Device("cuBLASLt missing".into()))?;
        let len = |p: CUdeviceptr| {
            slots.iter().find(|s| s.0 <= p && p < s.0 + s.1.max(1)).map_or(0, |s| ((s.0 + s.1 - p) / size) as usize)
        };
        macro_rules! run {
            ($t:ty, $engine:expr) => {{
                let stream = &self.stream;
                // SAFETY: views over checked extents, leaked after the call (the slots own them).
                unsafe {
                    let av = stream.upgrade_device_ptr::<$t>(b, len(b));
                    let bv = stream.upgrade_device_ptr::<$t>(a, len(a));
                    let mut dv = stream.upgrade_device_ptr::<$t>(d, len(d));
                    let biasv = bias.map(|p| stream.upgrade_device_ptr::<$t>(p, len(p)));
                    let r = $engine.matmul(cfg, &av, &bv, &mut dv, biasv.as_ref(), act.as_ref());
                    av.leak();
                    bv.leak();
                    dv.leak();
                    if let Some(v) = biasv {
                        v.leak();
                    }
                    r
                }
            }};
        }
        let r = match g.dtype {
            DType::F32 => run!(f32, ExactF32(blas)),
            DType::F16 => run!(half::f16, blas),
            DType::BF16 => run!(half::bf16, blas),
            other => return Err(Error::Unsupported(format!("gemm of {other}"))),
        };
        r.map_err(|e| Error::Device(format!("cublasLtMatmul (m {} n {} k {} batch {}): {e:?}", g.m, g.n, g.k, g.batch)))
    }
}
