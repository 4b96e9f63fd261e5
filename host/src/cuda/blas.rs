//! GEMMs through cuBLASLt (`cublasLtMatmul`) with descriptors, layouts and the heuristic's
//! algorithm cached per shape: the first GEMM of a shape asks `cublasLtMatmulAlgoGetHeuristic`,
//! later ones only set the bias pointer and enqueue. One handle per device (`Device::with_blas`),
//! whose workspace is one buffer of the device's pool, outside every session's
//! `--device-memory-limit`.
//!
//! Row-major `D = op(A)·op(B)` (the ABI's [`Gemm`]) is computed as column-major
//! `Dᵀ = op(B)ᵀ·op(A)ᵀ`: the operands swap and `m`/`n` exchange.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::Arc;

use cudarc::cublaslt::result as ltr;
use cudarc::cublaslt::sys as lt;
use cudarc::driver::sys::{CUdeviceptr, CUstream};
use kiln_kernel_abi::wire::{Epilogue, Gemm};
use kiln_kernel_abi::DType;

use super::{DevBuffer, Pool};
use crate::{Error, Result};

/// What a cached plan depends on: everything of a [`Gemm`] but the pointers, alpha and beta.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct PlanKey {
    dtype: DType,
    trans_a: bool,
    trans_b: bool,
    m: u64,
    n: u64,
    k: u64,
    batch: u64,
    lds: [u64; 3],
    strides: [u64; 3],
    epilogue: u8,
    bias: bool,
}

impl PlanKey {
    fn of(g: &Gemm) -> PlanKey {
        PlanKey {
            dtype: g.dtype,
            trans_a: g.trans_a,
            trans_b: g.trans_b,
            m: g.m,
            n: g.n,
            k: g.k,
            batch: g.batch,
            lds: [g.a.ld, g.b.ld, g.d.ld],
            strides: [g.a.batch_stride, g.b.batch_stride, g.d.batch_stride],
            epilogue: g.epilogue as u8,
            bias: g.bias.is_some(),
        }
    }
}

/// Descriptors and algorithm of one GEMM shape (destroyed with the plan).
struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    /// Column-major layouts of the swapped operands: B (as "A"), A (as "B"), and D (also C).
    layouts: [lt::cublasLtMatrixLayout_t; 3],
    algo: lt::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created by this plan and destroyed once.
        unsafe {
            let _ = ltr::destroy_matmul_desc(self.desc);
            for l in self.layouts {
                let _ = ltr::destroy_matrix_layout(l);
            }
        }
    }
}

fn blas_err(what: &str) -> impl Fn(ltr::CublasError) -> Error + '_ {
    move |e| Error::Device(format!("{what}: {e:?}"))
}

/// Split-K reductions the heuristic may pick: in the compute type (f32) only. The in-place and
/// output-type schemes add the partial products up in D's dtype, which at decode sizes cost
/// float16 GEMMs several ulps (5 ulps at K = 1098 on the H200: the decode-sized MatMul GPU test).
/// Unsplit algorithms (CUBLASLT_REDUCTION_SCHEME_NONE) are always allowed.
const SPLIT_K_REDUCTION: u32 = lt::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;

/// `(matrix type, compute type)` of a GEMM dtype. f32 computes in exact f32 (ONNX float32
/// MatMul/Gemm keep full precision, not TF32); f16 and bf16 accumulate in f32.
fn types(dtype: DType) -> Result<(lt::cudaDataType, lt::cublasComputeType_t)> {
    use lt::cublasComputeType_t::CUBLAS_COMPUTE_32F;
    use lt::cudaDataType_t::*;
    match dtype {
        DType::F32 => Ok((CUDA_R_32F, CUBLAS_COMPUTE_32F)),
        DType::F16 => Ok((CUDA_R_16F, CUBLAS_COMPUTE_32F)),
        DType::BF16 => Ok((CUDA_R_16BF, CUBLAS_COMPUTE_32F)),
        other => Err(Error::Unsupported(format!("gemm of {other}"))),
    }
}

/// A cuBLASLt handle, its workspace and the plan cache of one stream.
pub struct Blas {
    handle: lt::cublasLtHandle_t,
    workspace: DevBuffer,
    plans: HashMap<PlanKey, Plan>,
    /// GEMMs whose plan came from the cache, and heuristic queries.
    pub plan_hits: u64,
    pub heuristic_queries: u64,
}

// SAFETY: the handle and the plans' descriptors are host objects of cuBLASLt, used by one thread
// at a time: a `Blas` lives in its `Device`'s mutex.
unsafe impl Send for Blas {}

impl Drop for Blas {
    /// Destroys the handle (the device's stream is idle: see `Device`'s drop); the workspace
    /// goes back to the pool with its buffer.
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: no plan refers to the handle any more; it is destroyed once.
        unsafe {
            let _ = ltr::destroy_handle(self.handle);
        }
    }
}

impl Blas {
    /// A handle with a workspace of 32 MiB on Hopper and later, 4 MiB before (NVIDIA's
    /// recommendation for cublasLtMatmul), taken from the device's `pool`.
    pub fn new(pool: &Arc<Pool>, compute_major: u32) -> Result<Blas> {
        let size = if compute_major >= 9 { 32 << 20 } else { 4 << 20 };
        let workspace = pool.take(size, None)?;
        let handle = ltr::create_handle().map_err(|e| Error::Device(format!("cublasLtCreate: {e:?}")))?;
        Ok(Blas { handle, workspace, plans: HashMap::new(), plan_hits: 0, heuristic_queries: 0 })
    }

    /// Makes the cached plan of `g`'s shape (descriptors and the heuristic's algorithm), so
    /// that a later [`Blas::gemm`] of that shape only enqueues.
    pub fn prepare(&mut self, g: &Gemm) -> Result<()> {
        self.plan(g).map(|_| ())
    }

    fn plan(&mut self, g: &Gemm) -> Result<&Plan> {
        let key = PlanKey::of(g);
        if self.plans.contains_key(&key) {
            self.plan_hits += 1;
        } else {
            let plan = self.make_plan(g)?;
            self.heuristic_queries += 1;
            self.plans.insert(key, plan);
        }
        self.plans.get(&key).ok_or_else(|| Error::Device("gemm plan vanished".into()))
    }

    fn make_plan(&self, g: &Gemm) -> Result<Plan> {
        let (mt, ct) = types(g.dtype)?;
        // Column-major view: "A" is B (n × k after op), "B" is A (k × m after op), D is n × m.
        let (a_rows, a_cols) = if g.trans_b { (g.k, g.n) } else { (g.n, g.k) };
        let (b_rows, b_cols) = if g.trans_a { (g.m, g.k) } else { (g.k, g.m) };
        let dims = [
            (a_rows, a_cols, g.b.ld, g.b.batch_stride),
            (b_rows, b_cols, g.a.ld, g.a.batch_stride),
            (g.n, g.m, g.d.ld, g.d.batch_stride),
        ];
        let desc = ltr::create_matmul_desc(ct, lt::cudaDataType_t::CUDA_R_32F)
            .map_err(blas_err("cublasLtMatmulDescCreate"))?;
        let mut plan =
            Plan { desc, layouts: [std::ptr::null_mut(); 3], algo: lt::cublasLtMatmulAlgo_t { data: [0; 8] } };
        for (i, (rows, cols, ld, stride)) in dims.into_iter().enumerate() {
            let l =
                ltr::create_matrix_layout(mt, rows, cols, ld as i64).map_err(blas_err("cublasLtMatrixLayoutCreate"))?;
            plan.layouts[i] = l;
            if g.batch > 1 {
                let count = g.batch as i32;
                let stride = stride as i64;
                // SAFETY: attributes of a live layout, values of the documented types.
                unsafe {
                    ltr::set_matrix_layout_attribute(
                        l,
                        lt::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                        &count as *const i32 as *const c_void,
                        size_of::<i32>(),
                    )
                    .map_err(blas_err("batch count"))?;
                    ltr::set_matrix_layout_attribute(
                        l,
                        lt::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                        &stride as *const i64 as *const c_void,
                        size_of::<i64>(),
                    )
                    .map_err(blas_err("batch stride"))?;
                }
            }
        }
        use lt::cublasLtEpilogue_t::*;
        let epilogue = match (g.epilogue, g.bias.is_some()) {
            (Epilogue::None, false) => CUBLASLT_EPILOGUE_DEFAULT,
            (Epilogue::None, true) => CUBLASLT_EPILOGUE_BIAS,
            (Epilogue::Relu, false) => CUBLASLT_EPILOGUE_RELU,
            (Epilogue::Relu, true) => CUBLASLT_EPILOGUE_RELU_BIAS,
            (Epilogue::Gelu, false) => CUBLASLT_EPILOGUE_GELU,
            (Epilogue::Gelu, true) => CUBLASLT_EPILOGUE_GELU_BIAS,
        };
        let (ta, tb) = (g.trans_b as i32, g.trans_a as i32);
        use lt::cublasLtMatmulDescAttributes_t::*;
        // SAFETY: attributes of a live descriptor, values of the documented types.
        unsafe {
            let set = |attr, p: *const c_void, n| {
                ltr::set_matmul_desc_attribute(desc, attr, p, n).map_err(blas_err("cublasLtMatmulDescSetAttribute"))
            };
            set(CUBLASLT_MATMUL_DESC_TRANSA, &ta as *const i32 as *const c_void, size_of::<i32>())?;
            set(CUBLASLT_MATMUL_DESC_TRANSB, &tb as *const i32 as *const c_void, size_of::<i32>())?;
            set(
                CUBLASLT_MATMUL_DESC_EPILOGUE,
                &epilogue as *const _ as *const c_void,
                size_of::<lt::cublasLtEpilogue_t>(),
            )?;
            if g.bias.is_some() && g.batch > 1 {
                let zero = 0i64;
                set(CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &zero as *const i64 as *const c_void, size_of::<i64>())?;
            }
        }
        let pref = ltr::create_matmul_pref().map_err(blas_err("cublasLtMatmulPreferenceCreate"))?;
        let ws = self.workspace.bytes as usize;
        // SAFETY: all descriptors are live; the preference is destroyed right after.
        let heuristic = unsafe {
            let r = ltr::set_matmul_pref_attribute(
                pref,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const usize as *const c_void,
                size_of::<usize>(),
            )
            .and_then(|_| {
                ltr::set_matmul_pref_attribute(
                    pref,
                    lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                    &SPLIT_K_REDUCTION as *const u32 as *const c_void,
                    size_of::<u32>(),
                )
            })
            .and_then(|_| {
                ltr::get_matmul_algo_heuristic(
                    self.handle,
                    desc,
                    plan.layouts[0],
                    plan.layouts[1],
                    plan.layouts[2],
                    plan.layouts[2],
                    pref,
                )
            });
            let _ = ltr::destroy_matmul_pref(pref);
            r
        }
        .map_err(|e| {
            Error::Device(format!(
                "cublasLtMatmulAlgoGetHeuristic (m {} n {} k {} batch {} {}): {e:?}",
                g.m, g.n, g.k, g.batch, g.dtype
            ))
        })?;
        plan.algo = heuristic.algo;
        Ok(plan)
    }

    /// Enqueues `g` on `stream`; `ptr(operand)` gives each operand's device address (the
    /// sandbox has checked the extents). `C` must already be in `D` when `beta != 0`.
    pub fn gemm(
        &mut self,
        g: &Gemm,
        a: CUdeviceptr,
        b: CUdeviceptr,
        d: CUdeviceptr,
        bias: Option<CUdeviceptr>,
        stream: CUstream,
    ) -> Result<()> {
        let handle = self.handle;
        let (ws, ws_bytes) = (self.workspace.ptr, self.workspace.bytes as usize);
        let plan = self.plan(g)?;
        let beta = if g.c.is_some() { g.beta } else { 0.0 };
        // SAFETY: descriptors are live; pointers address checked extents on this context;
        // alpha/beta are f32 (scale type CUDA_R_32F) and read during the call.
        unsafe {
            if let Some(bias) = bias {
                ltr::set_matmul_desc_attribute(
                    plan.desc,
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &bias as *const CUdeviceptr as *const c_void,
                    size_of::<CUdeviceptr>(),
                )
                .map_err(blas_err("bias pointer"))?;
            }
            ltr::matmul(
                handle,
                plan.desc,
                &g.alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                b as *const c_void,
                plan.layouts[0],
                a as *const c_void,
                plan.layouts[1],
                d as *const c_void,
                plan.layouts[2],
                d as *mut c_void,
                plan.layouts[2],
                &plan.algo,
                ws as *mut c_void,
                ws_bytes,
                stream as lt::cudaStream_t,
            )
        }
        .map_err(|e| {
            Error::Device(format!(
                "cublasLtMatmul (m {} n {} k {} batch {} {}): {e:?}",
                g.m, g.n, g.k, g.batch, g.dtype
            ))
        })
    }
}
