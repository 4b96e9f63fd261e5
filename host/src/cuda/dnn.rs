//! Convolutions through cuDNN 9, loaded at run time (cudarc's `cudnn`), for the `conv` import of
//! a dispatch (ABI.md §4.8): Conv as `cudnnConvolutionForward`, ConvTranspose as
//! `cudnnConvolutionBackwardData` (the forward convolution whose input gradient it is), in NCHW
//! with every tensor packed. A descriptor's plan (cuDNN descriptors, the heuristic's algorithm
//! and its workspace size) is made once per shape when the shim's dispatch asks for it, and
//! cached on the device; a later call only enqueues. A Conv's bias and Relu are
//! `cudnnConvolutionBiasActivationForward`'s epilogue where cuDNN takes it (float32 and float16),
//! else `cudnnAddTensor` and `cudnnActivationForward` after the product. float32 computes in
//! FMA math only (no TF32, as `gemm` does); float16 and bfloat16 accumulate in f32 on tensor
//! cores.
//!
//! Channels-last (NHWC) convolutions: cuDNN's tensor-core kernels read and write NHWC, so a float16
//! or bfloat16 convolution of NCHW tensors pays a transposition of X and of Y around each call.
//! An execution plan (`ep::plan`) therefore keeps a 2-D 16-bit activation channels-last when only
//! lone cuDNN convolutions write and read it (as X or Z), and tells each convolution where its
//! operands live ([`ConvLayout`]). Such a convolution computes channels-last, with its filter
//! transposed once to `[M, kh, kw, C/groups]` ([`Dnn::filter_to_last`]); an operand kept
//! channels-first (a graph input, a pooling's output) is transformed into the workspace before
//! the product, and a channels-first Y after it (`cudnnTransformTensor`). The values only
//! convolutions touch are never seen channels-first by anything else, so no package and no
//! result sees the difference.
//!
//! cuDNN is found on the library path (`dlopen("libcudnn.so.9")`), else beside the CUDA
//! libraries this process loaded (their folder, and the `nvidia/cudnn/lib` of a pip layout), or
//! at `KILN_CUDNN_PATH` (the file or its folder).

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::cudnn::result as dnn;
use cudarc::cudnn::sys;
use cudarc::driver::sys::{CUdeviceptr, CUstream};
use kiln_kernel_abi::wire::{Conv, Epilogue};
use kiln_kernel_abi::DType;

use crate::{Error, Result};

/// Most workspace one convolution's algorithm may take, in bytes: the heuristic's fastest
/// algorithm within it is chosen.
pub const WORKSPACE_CAP: u64 = 256 << 20;

/// The cuDNN this process loaded ("cuDNN 9.10.2"), or why none: looked for once per process.
pub fn cudnn_library() -> std::result::Result<&'static str, &'static str> {
    static LIB: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    match LIB.get_or_init(load) {
        Ok(s) => Ok(s),
        Err(e) => Err(e),
    }
}

fn load() -> std::result::Result<String, String> {
    // SAFETY: dlopen of cuDNN's library names; nothing is called unless one loads.
    let mut found = unsafe { sys::is_culib_present() };
    let mut tried = Vec::new();
    if !found {
        for path in candidates() {
            if !path.is_file() {
                tried.push(path.display().to_string());
                continue;
            }
            // Loaded globally and kept, so that cudarc's dlopen by soname finds it, with the
            // sub-libraries of its folder (cuDNN 9 opens them by name at first use).
            if preload(&path).is_ok() {
                if let Some(dir) = path.parent() {
                    preload_siblings(dir);
                }
                // SAFETY: as above.
                found = unsafe { sys::is_culib_present() };
                if found {
                    break;
                }
            }
            tried.push(path.display().to_string());
        }
    }
    if !found {
        return Err(format!(
            "cuDNN 9 (libcudnn.so.9) is on neither the library path nor beside the CUDA libraries ({}); set \
             KILN_CUDNN_PATH to its file or folder",
            if tried.is_empty() { "no CUDA library folder found".to_string() } else { tried.join(", ") }
        ));
    }
    let v = dnn::get_version();
    let (major, minor, patch) = (v / 10000, v / 100 % 100, v % 100);
    if major < 9 {
        return Err(format!("cuDNN {major}.{minor}.{patch} found; kiln needs cuDNN 9"));
    }
    Ok(format!("cuDNN {major}.{minor}.{patch}"))
}

/// Where cuDNN may be when it is not on the library path: `KILN_CUDNN_PATH`, then beside each
/// CUDA library this process mapped (cuBLASLt, NVRTC, the runtime) and in a pip layout's
/// `nvidia/cudnn/lib` next to them.
fn candidates() -> Vec<PathBuf> {
    const FILE: &str = "libcudnn.so.9";
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os("KILN_CUDNN_PATH").map(PathBuf::from) {
        out.push(if p.is_dir() { p.join(FILE) } else { p });
    }
    // cuBLASLt is loaded for GEMMs anyway; mapping it now shows its folder.
    // SAFETY: dlopen of cuBLASLt's names only.
    if unsafe { cudarc::cublaslt::sys::is_culib_present() } {
        // SAFETY: present (above); kept loaded for the process, as cudarc does on first use.
        let _ = unsafe { cudarc::cublaslt::sys::culib() };
    }
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut dirs: Vec<&Path> = Vec::new();
    for line in maps.lines() {
        let Some(path) = line.split_whitespace().nth(5).map(Path::new) else { continue };
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let cuda =
            ["libcublasLt.so", "libcublas.so", "libnvrtc.so", "libcudart.so"].iter().any(|p| name.starts_with(p));
        if let (true, Some(dir)) = (cuda, path.parent()) {
            if !dirs.contains(&dir) {
                dirs.push(dir);
            }
        }
    }
    for dir in dirs {
        out.push(dir.join(FILE));
        if let Some(nvidia) = dir.parent().and_then(Path::parent) {
            out.push(nvidia.join("cudnn/lib").join(FILE));
        }
    }
    out
}

/// dlopen(`path`, RTLD_NOW | RTLD_GLOBAL), kept for the process.
fn preload(path: &Path) -> std::result::Result<(), String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading cuDNN runs its initializers, which only register the library.
    let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }.map_err(|e| e.to_string())?;
    std::mem::forget(lib);
    Ok(())
}

/// Preloads cuDNN 9's sub-libraries found in `dir` (graph, ops, cnn, engines, heuristic, adv).
fn preload_siblings(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut libs: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libcudnn_") && n.ends_with(".so.9"))
        })
        .collect();
    // The graph library first: the others link against it.
    libs.sort_by_key(|p| !p.to_string_lossy().contains("libcudnn_graph"));
    for l in libs {
        if let Err(e) = preload(&l) {
            tracing::debug!(lib = %l.display(), "cuDNN sub-library not preloaded: {e}");
        }
    }
}

/// Whether cuDNN's legacy convolution API takes `c` as it is, without asking cuDNN: 1 to 3
/// spatial axes, every size within `int`, padding the same on both sides of each axis (or a
/// last row or column that no output reads), and for ConvTranspose a shape that is exactly the
/// input gradient of a forward convolution. Errors: the reason, for the report.
pub fn takes(c: &Conv) -> std::result::Result<(), String> {
    let r = c.input.len();
    if !(1..=3).contains(&r) {
        return Err(format!("cuDNN convolves 1 to 3 spatial axes, this one has {r}"));
    }
    let int = |v: u64| v <= i32::MAX as u64;
    let (cin, cout) = (c.in_channels, c.out_channels);
    let elems = |ch: u64, sp: &[u64]| sp.iter().try_fold(c.batch.checked_mul(ch)?, |a, &d| a.checked_mul(d));
    let filter = if c.transposed { cin } else { cout }.checked_mul(if c.transposed { cout } else { cin } / c.groups);
    let sizes = [
        elems(cin, &c.input),
        elems(cout, &c.output),
        filter.and_then(|f| c.kernel.iter().try_fold(f, |a, &k| a.checked_mul(k))),
    ];
    if !sizes.iter().all(|s| s.is_some_and(int)) {
        return Err("a tensor of more than 2^31-1 elements (cuDNN's legacy API counts in int)".into());
    }
    if c.dtype == DType::BF16 && (c.bias.is_some() || c.z.is_some() || c.epilogue != Epilogue::None) {
        return Err(
            "a bfloat16 convolution's bias, residual or Relu (cuDNN's tensor ops here take float32 and float16)".into(),
        );
    }
    if c.pads_begin.iter().any(|&p| p < 0) {
        return Err("negative padding (a ConvTranspose output that starts inside)".into());
    }
    // cuDNN pads both sides alike: the forward output of (in, pad) must be what ONNX gives.
    let (fwd_in, fwd_out) = if c.transposed { (&c.output, &c.input) } else { (&c.input, &c.output) };
    for a in 0..r {
        let span = (c.kernel[a] - 1) * c.dilations[a] + 1;
        let padded = fwd_in[a] + 2 * c.pads_begin[a] as u64;
        if padded < span || (padded - span) / c.strides[a] + 1 != fwd_out[a] {
            return Err(format!(
                "axis {a}: the padding is not the same on both sides (cuDNN pads {} before and after)",
                c.pads_begin[a]
            ));
        }
    }
    Ok(())
}

/// A cuDNN descriptor, destroyed with its owner.
macro_rules! owned_desc {
    ($name:ident, $t:ty, $create:expr, $destroy:path) => {
        struct $name($t);
        impl $name {
            fn new() -> Result<Self> {
                $create.map($name).map_err(dnn_err(stringify!($name)))
            }
        }
        impl Drop for $name {
            fn drop(&mut self) {
                // SAFETY: created by `new`, destroyed once.
                let _ = unsafe { $destroy(self.0) };
            }
        }
    };
}

owned_desc!(TensorDesc, sys::cudnnTensorDescriptor_t, dnn::create_tensor_descriptor(), dnn::destroy_tensor_descriptor);
owned_desc!(FilterDesc, sys::cudnnFilterDescriptor_t, dnn::create_filter_descriptor(), dnn::destroy_filter_descriptor);
owned_desc!(
    ConvDesc,
    sys::cudnnConvolutionDescriptor_t,
    dnn::create_convolution_descriptor(),
    dnn::destroy_convolution_descriptor
);
owned_desc!(
    ActDesc,
    sys::cudnnActivationDescriptor_t,
    dnn::create_activation_descriptor(),
    sys::cudnnDestroyActivationDescriptor
);

fn dnn_err(what: &str) -> impl Fn(dnn::CudnnError) -> Error + '_ {
    move |e| Error::Device(format!("{what}: {e:?}"))
}

fn data_type(dtype: DType) -> Result<sys::cudnnDataType_t> {
    match dtype {
        DType::F32 => Ok(sys::cudnnDataType_t::CUDNN_DATA_FLOAT),
        DType::F16 => Ok(sys::cudnnDataType_t::CUDNN_DATA_HALF),
        DType::BF16 => Ok(sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16),
        other => Err(Error::Unsupported(format!("cuDNN convolution of {other}"))),
    }
}

/// A packed tensor descriptor of `dims` (`[N, C, spatial…]`): NCHW (or NCDHW), or with
/// `last` NHWC (channels-last: C varies fastest, then the spatial axes, then N).
fn tensor(dtype: sys::cudnnDataType_t, dims: &[c_int], last: bool) -> Result<TensorDesc> {
    let d = TensorDesc::new()?;
    // The axes from the fastest-varying out.
    let mut order: Vec<usize> = (0..dims.len()).rev().collect();
    if last {
        order.retain(|&a| a != 1);
        order.insert(0, 1);
    }
    let mut strides = vec![1 as c_int; dims.len()];
    let mut step: c_int = 1;
    for a in order {
        strides[a] = step;
        step *= dims[a];
    }
    // SAFETY: `d` is a live descriptor; `dims` and `strides` hold `dims.len()` values.
    unsafe { dnn::set_tensornd_descriptor(d.0, dtype, dims.len() as c_int, dims.as_ptr(), strides.as_ptr()) }
        .map_err(dnn_err("cudnnSetTensorNdDescriptor"))?;
    Ok(d)
}

/// The algorithm of a plan.
#[derive(Clone, Copy, Debug)]
enum Algo {
    Forward(sys::cudnnConvolutionFwdAlgo_t),
    BackwardData(sys::cudnnConvolutionBwdDataAlgo_t),
}

/// Where a convolution's activations live in device memory: channels-first (ONNX's NCHW, the
/// default) or channels-last (NHWC) for X, Z (the residual) and Y. A layout with any operand
/// channels-last computes channels-last (module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ConvLayout {
    pub x_last: bool,
    pub z_last: bool,
    pub y_last: bool,
}

impl ConvLayout {
    /// Whether the convolution computes channels-last (any operand lives so).
    pub fn computes_last(&self) -> bool {
        self.x_last || self.z_last || self.y_last
    }
}

/// Whether `c` may compute channels-last: a forward 2-D float16 or bfloat16 convolution that
/// cuDNN takes ([`takes`]). Its filter must be a constant, which the caller checks.
pub fn takes_channels_last(c: &Conv) -> bool {
    !c.transposed && c.input.len() == 2 && matches!(c.dtype, DType::F16 | DType::BF16) && takes(c).is_ok()
}

/// Descriptors and algorithm of one convolution shape.
struct Plan {
    /// X and Y (for ConvTranspose: the gradient `dy` is X, `dx` is Y).
    x: TensorDesc,
    y: TensorDesc,
    w: FilterDesc,
    conv: ConvDesc,
    /// `[1, M, 1, …]` when the node has a bias.
    bias: Option<TensorDesc>,
    /// Relu, or the identity (for the fused call without Relu).
    act: ActDesc,
    algo: Algo,
    /// The algorithm's workspace, at the start of the step's.
    algo_workspace: u64,
    /// The step's whole workspace: the algorithm's, then a channels-last plan's staging.
    workspace: u64,
    /// A channels-last plan's operands kept channels-first, staged in the workspace.
    staging: Staging,
    /// Whether the bias (and Relu, and Z) go through `cudnnConvolutionBiasActivationForward`;
    /// cleared when cuDNN refuses it, so later calls run them one by one.
    fused: bool,
    /// Y's bytes (Z is copied into Y before an unfused product).
    y_bytes: u64,
}

/// Where a channels-last plan stages the operands its layout keeps channels-first: byte offsets
/// in the workspace, each with its channels-first descriptor to transform from or to.
#[derive(Default)]
struct Staging {
    x: Option<(u64, TensorDesc)>,
    z: Option<(u64, TensorDesc)>,
    y: Option<(u64, TensorDesc)>,
}

/// The key of a plan: everything of a [`Conv`] but its tensors' handles and offsets, and the
/// layout.
fn key(c: &Conv, layout: ConvLayout) -> Vec<i64> {
    let mut k = vec![c.dtype.code() as i64, c.transposed as i64, c.input.len() as i64];
    k.extend([c.batch, c.in_channels, c.out_channels, c.groups].map(|v| v as i64));
    for axis in [&c.input, &c.output, &c.kernel, &c.strides, &c.dilations] {
        k.extend(axis.iter().map(|&v| v as i64));
    }
    k.extend(&c.pads_begin);
    k.extend([c.bias.is_some() as i64, c.z.is_some() as i64, c.epilogue as i64]);
    k.extend([layout.x_last, layout.z_last, layout.y_last].map(i64::from));
    k
}

/// A cuDNN handle and the plans of the shapes it has seen.
pub struct Dnn {
    handle: sys::cudnnHandle_t,
    plans: HashMap<Vec<i64>, Plan>,
}

// SAFETY: the handle and descriptors are host objects of cuDNN, used by one thread at a time: a
// `Dnn` lives in its `Device`'s mutex, and every call sets the stream it enqueues on.
unsafe impl Send for Dnn {}

impl Drop for Dnn {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: no plan refers to the handle any more; destroyed once.
        let _ = unsafe { dnn::destroy_handle(self.handle) };
    }
}

/// Device pointers of one convolution's operands.
#[derive(Clone, Copy)]
pub struct ConvPtrs {
    pub x: CUdeviceptr,
    pub w: CUdeviceptr,
    pub bias: Option<CUdeviceptr>,
    pub z: Option<CUdeviceptr>,
    pub y: CUdeviceptr,
}

impl Dnn {
    /// A handle on the calling thread's current context. Errors: cuDNN not loaded
    /// ([`cudnn_library`]'s reason), or `cudnnCreate` failing.
    pub fn new() -> Result<Dnn> {
        cudnn_library().map_err(|why| Error::Unsupported(why.to_string()))?;
        let handle = dnn::create_handle().map_err(dnn_err("cudnnCreate"))?;
        Ok(Dnn { handle, plans: HashMap::new() })
    }

    /// Makes `c`'s plan (descriptors, the heuristic's fastest algorithm within
    /// [`WORKSPACE_CAP`]) unless cached, and returns its workspace in bytes. Errors: a form
    /// cuDNN refuses or has no algorithm for (the reason names cuDNN's status).
    pub fn prepare(&mut self, c: &Conv, layout: ConvLayout) -> Result<u64> {
        let k = key(c, layout);
        if let Some(p) = self.plans.get(&k) {
            return Ok(p.workspace);
        }
        takes(c).map_err(Error::Unsupported)?;
        if layout.computes_last() && !takes_channels_last(c) {
            return Err(Error::Device("a channels-last layout for a convolution that cannot compute so".into()));
        }
        let plan = self.make_plan(c, layout)?;
        let ws = plan.workspace;
        self.plans.insert(k, plan);
        Ok(ws)
    }

    fn make_plan(&self, c: &Conv, layout: ConvLayout) -> Result<Plan> {
        let dt = data_type(c.dtype)?;
        let last = layout.computes_last();
        // One spatial axis becomes two (a leading axis of 1): cuDNN wants 4-D at least.
        let lift = |v: &[u64], one: u64| -> Vec<c_int> {
            let mut out: Vec<c_int> = v.iter().map(|&x| x as c_int).collect();
            if out.len() == 1 {
                out.insert(0, one as c_int);
            }
            out
        };
        let with = |a: u64, b: u64, sp: &[u64]| -> Vec<c_int> {
            let mut d = vec![a as c_int, b as c_int];
            d.extend(lift(sp, 1));
            d
        };
        let (xdims, ydims) = (with(c.batch, c.in_channels, &c.input), with(c.batch, c.out_channels, &c.output));
        let (x, y) = (tensor(dt, &xdims, last)?, tensor(dt, &ydims, last)?);
        let w = FilterDesc::new()?;
        let wdims = if c.transposed {
            with(c.in_channels, c.out_channels / c.groups, &c.kernel)
        } else {
            with(c.out_channels, c.in_channels / c.groups, &c.kernel)
        };
        // SAFETY: live descriptor; `wdims` holds its length of values.
        unsafe {
            dnn::set_filternd_descriptor(
                w.0,
                dt,
                if last {
                    sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC
                } else {
                    sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW
                },
                wdims.len() as c_int,
                wdims.as_ptr(),
            )
        }
        .map_err(dnn_err("cudnnSetFilterNdDescriptor"))?;
        let conv = ConvDesc::new()?;
        let pads = lift(&c.pads_begin.iter().map(|&p| p as u64).collect::<Vec<_>>(), 0);
        let (strides, dilations) = (lift(&c.strides, 1), lift(&c.dilations, 1));
        // SAFETY: live descriptor; the three arrays hold `pads.len()` values each.
        unsafe {
            dnn::set_convolutionnd_descriptor(
                conv.0,
                pads.len() as c_int,
                pads.as_ptr(),
                strides.as_ptr(),
                dilations.as_ptr(),
                sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
            )
            .map_err(dnn_err("cudnnSetConvolutionNdDescriptor"))?;
            dnn::set_convolution_group_count(conv.0, c.groups as i32)
                .map_err(dnn_err("cudnnSetConvolutionGroupCount"))?;
        }
        use sys::cudnnMathType_t::{CUDNN_FMA_MATH, CUDNN_TENSOR_OP_MATH};
        let math = if c.dtype == DType::F32 { CUDNN_FMA_MATH } else { CUDNN_TENSOR_OP_MATH };
        // SAFETY: live descriptor.
        unsafe { dnn::set_convolution_math_type(conv.0, math) }.map_err(dnn_err("cudnnSetConvolutionMathType"))?;
        // float32 takes FMA algorithms only: no TF32.
        let math_ok = |m: sys::cudnnMathType_t| c.dtype != DType::F32 || m == CUDNN_FMA_MATH;
        let (algo, math) = self.algorithm(c, &x, &w, &conv, &y, math_ok)?;
        // SAFETY: live descriptor.
        unsafe { dnn::set_convolution_math_type(conv.0, math) }.map_err(dnn_err("cudnnSetConvolutionMathType"))?;
        // SAFETY: live handle and descriptors of one consistent shape.
        let algo_workspace = unsafe {
            match algo {
                Algo::Forward(a) => dnn::get_convolution_forward_workspace_size(self.handle, x.0, w.0, conv.0, y.0, a),
                Algo::BackwardData(a) => {
                    dnn::get_convolution_backward_data_workspace_size(self.handle, w.0, x.0, conv.0, y.0, a)
                }
            }
        }
        .map_err(dnn_err("cudnnGetConvolutionWorkspaceSize"))? as u64;
        let bias = match c.bias {
            Some(_) => {
                let mut d = vec![1 as c_int; 2 + lift(&c.output, 1).len()];
                d[1] = c.out_channels as c_int;
                Some(tensor(dt, &d, false)?)
            }
            None => None,
        };
        let act = ActDesc::new()?;
        let mode = if c.epilogue == Epilogue::Relu {
            sys::cudnnActivationMode_t::CUDNN_ACTIVATION_RELU
        } else {
            sys::cudnnActivationMode_t::CUDNN_ACTIVATION_IDENTITY
        };
        // SAFETY: live descriptor.
        unsafe { dnn::set_activation_descriptor(act.0, mode, sys::cudnnNanPropagation_t::CUDNN_PROPAGATE_NAN, 0.0) }
            .map_err(dnn_err("cudnnSetActivationDescriptor"))?;
        // cudnnConvolutionBiasActivationForward: forward, with a bias, float32 or float16; its
        // identity activation only with the implicit precomputed GEMM.
        let fused = !c.transposed
            && c.bias.is_some()
            && matches!(c.dtype, DType::F32 | DType::F16)
            && (c.epilogue == Epilogue::Relu
                || matches!(
                    algo,
                    Algo::Forward(sys::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM)
                ));
        let size = c.dtype.size().unwrap_or(4) as u64;
        let y_bytes = c.batch * c.out_channels * c.output.iter().product::<u64>() * size;
        let x_bytes = c.batch * c.in_channels * c.input.iter().product::<u64>() * size;
        // The staging buffers follow the algorithm's workspace, each at a 256-byte boundary.
        let mut workspace = if last { algo_workspace.next_multiple_of(256) } else { algo_workspace };
        let mut stage = |bytes: u64| {
            let at = workspace;
            workspace += bytes.next_multiple_of(256);
            at
        };
        let staging = if last {
            Staging {
                x: if layout.x_last { None } else { Some((stage(x_bytes), tensor(dt, &xdims, false)?)) },
                z: if c.z.is_some() && !layout.z_last {
                    Some((stage(y_bytes), tensor(dt, &ydims, false)?))
                } else {
                    None
                },
                y: if layout.y_last { None } else { Some((stage(y_bytes), tensor(dt, &ydims, false)?)) },
            }
        } else {
            Staging::default()
        };
        Ok(Plan { x, y, w, conv, bias, act, algo, algo_workspace, workspace, staging, fused, y_bytes })
    }

    /// The heuristic's first algorithm (cuDNN ranks them by expected speed) that succeeds with
    /// an allowed math type within [`WORKSPACE_CAP`].
    fn algorithm(
        &self,
        c: &Conv,
        x: &TensorDesc,
        w: &FilterDesc,
        conv: &ConvDesc,
        y: &TensorDesc,
        math_ok: impl Fn(sys::cudnnMathType_t) -> bool,
    ) -> Result<(Algo, sys::cudnnMathType_t)> {
        const N: usize = 16;
        let mut n: c_int = 0;
        let ok = sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS;
        let fits = |mem: usize| mem as u64 <= WORKSPACE_CAP;
        // One `_v7` query (its result struct, C function, operands and the Algo variant); the
        // forward and backward-data structs have the same fields.
        macro_rules! first_fitting {
            ($perf:ty, $query:path, $name:literal, [$($arg:expr),*], $variant:path) => {{
                // SAFETY: zeroed C structs are valid; cuDNN writes `n` of them.
                let mut perf: [$perf; N] = unsafe { std::mem::zeroed() };
                // SAFETY: live handle and descriptors of one shape; `perf` holds N results.
                unsafe { $query(self.handle, $($arg),*, N as c_int, &mut n, perf.as_mut_ptr()) }
                    .map_err(dnn_err($name))?;
                perf[..(n.max(0) as usize).min(N)]
                    .iter()
                    .find(|p| p.status == ok && fits(p.memory) && math_ok(p.mathType))
                    .map(|p| ($variant(p.algo), p.mathType))
            }};
        }
        let found = if c.transposed {
            first_fitting!(
                sys::cudnnConvolutionBwdDataAlgoPerf_t,
                dnn::get_convolution_backward_data_algorithm,
                "cudnnGetConvolutionBackwardDataAlgorithm_v7",
                [w.0, x.0, conv.0, y.0],
                Algo::BackwardData
            )
        } else {
            first_fitting!(
                sys::cudnnConvolutionFwdAlgoPerf_t,
                dnn::get_convolution_forward_algorithm,
                "cudnnGetConvolutionForwardAlgorithm_v7",
                [x.0, w.0, conv.0, y.0],
                Algo::Forward
            )
        };
        found.ok_or_else(|| {
            Error::Unsupported(format!(
                "cuDNN has no algorithm for this convolution ({} of {n} candidates; {} math, at most {} MiB of workspace)",
                c.dtype,
                if c.dtype == DType::F32 { "FMA" } else { "any" },
                WORKSPACE_CAP >> 20
            ))
        })
    }

    /// Enqueues `c` on `stream` with its cached plan for `layout` ([`Dnn::prepare`] first) and a
    /// workspace of at least the plan's size at `workspace`. A channels-last layout's filter
    /// `p.w` is the `[M, kh, kw, C/groups]` copy of [`Dnn::filter_to_last`]. No allocation:
    /// safe inside a capture.
    pub(super) fn conv(
        &mut self,
        c: &Conv,
        layout: ConvLayout,
        p: &ConvPtrs,
        workspace: (CUdeviceptr, u64),
        stream: CUstream,
    ) -> Result<()> {
        let handle = self.handle;
        let plan = self
            .plans
            .get_mut(&key(c, layout))
            .ok_or_else(|| Error::Device("cuDNN convolution not prepared".into()))?;
        if workspace.1 < plan.workspace {
            return Err(Error::Device(format!(
                "cuDNN convolution: workspace of {} bytes prepared, {} needed",
                workspace.1, plan.workspace
            )));
        }
        // SAFETY: the handle is live; cudnnSetStream takes the driver's stream.
        unsafe { dnn::set_stream(handle, stream as sys::cudaStream_t) }.map_err(dnn_err("cudnnSetStream"))?;
        let (one, zero) = (1f32, 0f32);
        let f = |v: &f32| v as *const f32 as *const c_void;
        let ptr = |d: CUdeviceptr| d as *const c_void;
        let ws = workspace.0 as *mut c_void;
        // Channels-first operands of a channels-last plan go through the workspace.
        let transform = |from: &TensorDesc, src: CUdeviceptr, to: &TensorDesc, dst: CUdeviceptr| {
            // SAFETY: both descriptors have the operand's dims; src and dst hold its extent (the
            // sandbox checked the tensor, the plan sized the staging).
            unsafe { sys::cudnnTransformTensor(handle, f(&one), from.0, ptr(src), f(&zero), to.0, dst as *mut c_void) }
                .result()
                .map_err(dnn_err("cudnnTransformTensor"))
        };
        let mut p = *p;
        if let Some((at, first)) = &plan.staging.x {
            transform(first, p.x, &plan.x, workspace.0 + at)?;
            p.x = workspace.0 + at;
        }
        if let (Some((at, first)), Some(z)) = (&plan.staging.z, p.z) {
            transform(first, z, &plan.y, workspace.0 + at)?;
            p.z = Some(workspace.0 + at);
        }
        let y_out = p.y;
        if let Some((at, _)) = &plan.staging.y {
            p.y = workspace.0 + at;
        }
        Self::product(handle, c, plan, &p, ws, stream)?;
        if let Some((at, first)) = &plan.staging.y {
            transform(&plan.y, workspace.0 + at, first, y_out)?;
        }
        Ok(())
    }

    /// The convolution of a plan with its epilogue (bias, Z, Relu) on `stream` (`handle`'s),
    /// every operand in the plan's layout.
    fn product(
        handle: sys::cudnnHandle_t,
        c: &Conv,
        plan: &mut Plan,
        p: &ConvPtrs,
        ws: *mut c_void,
        stream: CUstream,
    ) -> Result<()> {
        let (one, zero) = (1f32, 0f32);
        let f = |v: &f32| v as *const f32 as *const c_void;
        let ptr = |d: CUdeviceptr| d as *const c_void;
        if plan.fused {
            let (Algo::Forward(algo), Some(bias), Some(bias_desc)) = (plan.algo, p.bias, plan.bias.as_ref()) else {
                return Err(Error::Device("cuDNN fused convolution without a bias".into()));
            };
            let (alpha2, z) = match p.z {
                Some(z) => (one, z),
                None => (zero, p.y),
            };
            // SAFETY: the sandbox checked every operand's extent against its tensor; the
            // descriptors describe those extents; the workspace holds `plan.workspace` bytes.
            let r = unsafe {
                dnn::convolution_bias_activation_forward(
                    handle,
                    f(&one),
                    plan.x.0,
                    ptr(p.x),
                    plan.w.0,
                    ptr(p.w),
                    plan.conv.0,
                    algo,
                    ws,
                    plan.algo_workspace as usize,
                    f(&alpha2),
                    plan.y.0,
                    ptr(z),
                    bias_desc.0,
                    ptr(bias),
                    plan.act.0,
                    plan.y.0,
                    p.y as *mut c_void,
                )
            };
            match r {
                Ok(()) => return Ok(()),
                Err(e) => {
                    tracing::debug!(
                        "cudnnConvolutionBiasActivationForward refused ({e:?}): bias and activation one by one"
                    );
                    plan.fused = false;
                }
            }
        }
        let beta = match p.z {
            Some(z) => {
                // SAFETY: Z and Y hold `y_bytes` each (checked by the sandbox) and differ.
                unsafe { cudarc::driver::result::memcpy_dtod_async(p.y, z, plan.y_bytes as usize, stream) }
                    .map_err(|e| Error::Device(format!("cuMemcpyDtoDAsync: {e}")))?;
                one
            }
            None => zero,
        };
        // SAFETY: as for the fused call.
        unsafe {
            match plan.algo {
                Algo::Forward(a) => dnn::convolution_forward(
                    handle,
                    f(&one),
                    plan.x.0,
                    ptr(p.x),
                    plan.w.0,
                    ptr(p.w),
                    plan.conv.0,
                    a,
                    ws,
                    plan.algo_workspace as usize,
                    f(&beta),
                    plan.y.0,
                    p.y as *mut c_void,
                ),
                Algo::BackwardData(a) => dnn::convolution_backward_data(
                    handle,
                    f(&one),
                    plan.w.0,
                    ptr(p.w),
                    plan.x.0,
                    ptr(p.x),
                    plan.conv.0,
                    a,
                    ws,
                    plan.algo_workspace as usize,
                    f(&beta),
                    plan.y.0,
                    p.y as *mut c_void,
                ),
            }
        }
        .map_err(dnn_err("cuDNN convolution"))?;
        if let (Some(bias), Some(desc)) = (p.bias, plan.bias.as_ref()) {
            // SAFETY: bias holds M values, Y its extent.
            unsafe { sys::cudnnAddTensor(handle, f(&one), desc.0, ptr(bias), f(&one), plan.y.0, p.y as *mut c_void) }
                .result()
                .map_err(dnn_err("cudnnAddTensor"))?;
        }
        if c.epilogue == Epilogue::Relu {
            // SAFETY: in place over Y, which cuDNN allows.
            unsafe {
                dnn::activation_forward(
                    handle,
                    plan.act.0,
                    f(&one),
                    plan.y.0,
                    ptr(p.y),
                    f(&zero),
                    plan.y.0,
                    p.y as *mut c_void,
                )
            }
            .map_err(dnn_err("cudnnActivationForward"))?;
        }
        Ok(())
    }

    /// Enqueues on `stream` the copy of `c`'s filter at `src` (`[M, C/groups, kh, kw]`) into
    /// `dst` as `[M, kh, kw, C/groups]`, the filter of its channels-last plan; `dst` holds as
    /// many bytes. Errors: a convolution that cannot compute channels-last, cuDNN's.
    pub(super) fn filter_to_last(
        &mut self,
        c: &Conv,
        src: CUdeviceptr,
        dst: CUdeviceptr,
        stream: CUstream,
    ) -> Result<()> {
        if !takes_channels_last(c) {
            return Err(Error::Device("a channels-last filter for a convolution that cannot compute so".into()));
        }
        let dt = data_type(c.dtype)?;
        let mut dims = vec![c.out_channels as c_int, (c.in_channels / c.groups) as c_int];
        dims.extend(c.kernel.iter().map(|&k| k as c_int));
        let (first, last) = (tensor(dt, &dims, false)?, tensor(dt, &dims, true)?);
        let (one, zero) = (1f32, 0f32);
        // SAFETY: the handle is live; cudnnSetStream takes the driver's stream; src and dst
        // hold the filter's elements (the caller's buffers), both descriptors have its dims.
        unsafe {
            dnn::set_stream(self.handle, stream as sys::cudaStream_t).map_err(dnn_err("cudnnSetStream"))?;
            sys::cudnnTransformTensor(
                self.handle,
                &one as *const f32 as *const c_void,
                first.0,
                src as *const c_void,
                &zero as *const f32 as *const c_void,
                last.0,
                dst as *mut c_void,
            )
        }
        .result()
        .map_err(dnn_err("cudnnTransformTensor"))
    }

    /// Plans cached.
    pub fn plans(&self) -> usize {
        self.plans.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_kernel_abi::wire::TensorAt;

    fn conv(input: u64, kernel: u64, stride: u64, pad: i64, output: u64, transposed: bool) -> Conv {
        let at = TensorAt { handle: 0, offset: 0 };
        Conv {
            dtype: DType::F32,
            transposed,
            batch: 1,
            in_channels: 4,
            out_channels: 8,
            groups: 2,
            input: vec![input, input],
            output: vec![output, output],
            kernel: vec![kernel, kernel],
            strides: vec![stride, stride],
            dilations: vec![1, 1],
            pads_begin: vec![pad, pad],
            x: at,
            w: at,
            bias: None,
            z: None,
            y: at,
            epilogue: Epilogue::None,
        }
    }

    #[test]
    fn takes_symmetric_padding_and_refuses_the_rest_with_its_reason() {
        // 224 → 112 at stride 2, 3×3, pads 1 and 1 (or 1 and 0: the last column is never read).
        assert_eq!(takes(&conv(224, 3, 2, 1, 112, false)), Ok(()));
        // SAME_UPPER of a 4×4 kernel at stride 1: pads 1 before, 2 after → 8 outputs; cuDNN's
        // symmetric 1 gives 7.
        let err = takes(&conv(8, 4, 1, 1, 8, false)).unwrap_err();
        assert!(err.contains("axis 0") && err.contains("same on both sides"), "{err}");
        // ConvTranspose 3 → 5 (stride 2, 3×3, no pads) is the gradient of 5 → 3.
        assert_eq!(takes(&conv(3, 3, 2, 0, 7, true)), Ok(()));
        // output_padding 1 of a stride-2 ConvTranspose: 8, still floor((8 - 3) / 2) + 1 = 3.
        assert_eq!(takes(&conv(3, 3, 2, 0, 8, true)), Ok(()));
        let err = takes(&conv(3, 3, 2, -1, 9, true)).unwrap_err();
        assert!(err.contains("negative padding"), "{err}");
        let mut c = conv(8, 3, 1, 1, 8, false);
        c.input = vec![8; 4];
        c.output = vec![8; 4];
        c.kernel = vec![3; 4];
        c.strides = vec![1; 4];
        c.dilations = vec![1; 4];
        c.pads_begin = vec![1; 4];
        assert!(takes(&c).unwrap_err().contains("1 to 3 spatial axes"));
        let mut c = conv(1 << 16, 1, 1, 0, 1 << 16, false);
        c.batch = 1 << 10;
        assert!(takes(&c).unwrap_err().contains("2^31-1"));
        let mut c = conv(8, 3, 1, 1, 8, false);
        c.dtype = DType::BF16;
        assert_eq!(takes(&c), Ok(()));
        c.epilogue = Epilogue::Relu;
        assert!(takes(&c).unwrap_err().contains("bfloat16"));
    }
}
