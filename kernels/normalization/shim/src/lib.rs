//! Shim of `kiln-normalization`.
//!
//! - [`softmax`]: Softmax and LogSoftmax (opsets 1, 11, 13), following ONNX Operators.md.
//! - [`layer_norm`]: LayerNormalization-17, following ONNX Operators.md.
//! - [`rms_norm`]: onnxruntime's RMS normalisations, SimplifiedLayerNormalization (registered
//!   by onnxruntime in the ai.onnx domain, opset 1) and com.microsoft
//!   SkipSimplifiedLayerNormalization-1, and ONNX's RMSNormalization-23 (the same computation).
//! - [`batch_norm`]: BatchNormalization-9/14/15, inference and training mode.
//! - [`lp_norm`]: LpNormalization-1/22, following ONNX Operators.md and its reference.
//! - [`group_norm`]: InstanceNormalization-1/6/22 and GroupNormalization-18/21.
//! - [`lrn`]: LRN-1/13, after ONNX Operators.md.
//! - [`mvn`]: MeanVarianceNormalization-9/13, after its function body in ONNX Operators.md.
//!
//! The CPU references compute in f64 and round once to the output dtype.
#![no_std]
extern crate alloc;

mod batch_norm;
mod group_norm;
mod layer_norm;
mod lp_norm;
mod lrn;
mod mvn;
mod rms_norm;
mod softmax;

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{export_shim, unsupported};

struct Normalization;

fn check_float(call: &Call, dtype: DType) -> Result<()> {
    if !dtype.is_float() {
        unsupported!("{}: dtype {dtype} is not supported (floating-point only)", call.op_type());
    }
    Ok(())
}

fn axis_error(call: &Call, e: ShimError) -> ShimError {
    match e {
        ShimError::Failed(m) => ShimError::Failed(format!("{}: {m}", call.op_type())),
        other => other,
    }
}

/// A normalisation along one axis of X: `outer` groups of `n` elements `inner` apart.
pub struct AxisPlan {
    outer: usize,
    n: usize,
    inner: usize,
}

impl AxisPlan {
    /// Along attribute `axis` (default `default`, negative from the end) of input 0.
    /// Errors: an axis outside the input's rank.
    fn along(call: &Call, default: i64) -> Result<AxisPlan> {
        let dims = call.input(0)?.shape()?;
        let a = shape::normalize_axis(call.attr_i("axis", default)?, dims.len()).map_err(|e| axis_error(call, e))?;
        Ok(AxisPlan { outer: dims[..a].iter().product(), n: dims[a], inner: dims[a + 1..].iter().product() })
    }

    /// Calls `f` once per line along the axis with the row-major indices of its `n` elements.
    fn for_each_line(&self, mut f: impl FnMut(&[usize])) {
        let mut line = vec![0; self.n];
        for o in 0..self.outer {
            for i in 0..self.inner {
                for (j, at) in line.iter_mut().enumerate() {
                    *at = (o * self.n + j) * self.inner + i;
                }
                f(&line);
            }
        }
    }
}

/// Helpers of the GPU dispatches (kernels in `cuda/normalization.cu`).
mod gpu {
    use alloc::format;
    use alloc::vec::Vec;
    use kiln_kernel_abi::guest::*;
    use kiln_kernel_abi::{names, unsupported};

    /// The kernels' template argument for a floating-point dtype (the prelude's tag of a dtype
    /// the manifest instantiates them for).
    pub fn kernel_tag(call: &Call, dtype: DType) -> Result<&'static str> {
        match (dtype, dtype.cuda_tag()) {
            (DType::F32 | DType::F16 | DType::BF16 | DType::F64, Some(tag)) => Ok(tag),
            _ => unsupported!("{}: no CUDA kernel for {dtype}", call.op_type()),
        }
    }

    pub fn tensor(handle: u32) -> KernelArg {
        KernelArg::Tensor { handle, offset: 0 }
    }

    /// Launches a normalisation along one axis of input 0 into output 0: `{name}_rows<tag>`
    /// (a row kernel, [`row_launch`]) when the axis is the last one (`inner` 1), else
    /// `{name}_cols<tag>` (a thread per (outer, inner) column); `mode` is the kernels' last
    /// argument (Softmax: log; LpNormalization: p).
    pub fn axis_launch(call: &Call, name: &str, p: &crate::AxisPlan, mode: u32) -> Result<()> {
        let x = call.input(0)?;
        let tag = kernel_tag(call, x.dtype()?)?;
        let (outer, n, inner) = (p.outer as u64, p.n as u64, p.inner as u64);
        if outer * n * inner == 0 {
            return Ok(());
        }
        let (xh, yh) = (tensor(x.handle()), tensor(call.output(0)?.handle()));
        if inner == 1 {
            let (grid, block) = row_launch(outer, n);
            launch(&Launch {
                kernel: &names::kernel_name(&format!("{name}_rows"), &[tag]),
                grid,
                block,
                shared_mem_bytes: 0,
                args: vec![xh, yh, KernelArg::U64(outer), KernelArg::U64(n), KernelArg::U32(mode)],
            })
        } else {
            launch(&Launch {
                kernel: &names::kernel_name(&format!("{name}_cols"), &[tag]),
                grid: [(outer * inner).div_ceil(256).min(1 << 20) as u32, 1, 1],
                block: [256, 1, 1],
                shared_mem_bytes: 0,
                args: vec![
                    xh,
                    yh,
                    KernelArg::U64(outer),
                    KernelArg::U64(n),
                    KernelArg::U64(inner),
                    KernelArg::U32(mode),
                ],
            })
        }
    }

    /// Rows below which a row kernel takes a block per row. At 128 rows of 768 (BERT-base,
    /// batch 1) a warp per row put the rows on 16 blocks, and SkipLayerNormalization's loop
    /// over a row's 24 values per lane took 26 µs a launch (ncu, H100, bench/RESULTS.md,
    /// 2026-12-06, session 33).
    const FEW_ROWS: u64 = 1024;

    /// Grid and block of a row kernel over `rows` rows of `cols` elements: a warp per row (8
    /// rows a block) for short rows, a block per row for long ones, and for fewer rows than
    /// [`FEW_ROWS`] (a decode step, an encoder's 128-token sequence) or rows of 257 to 1,024
    /// elements a block per row with about 4 elements a thread, so that a row's loads are spread
    /// over many threads rather than queued on one warp. (At 4,096 rows of 768, BERT-base at
    /// batch 32, a warp per row left SkipLayerNormalization's 24 values a lane past what it keeps
    /// in registers, three passes over memory: 86 µs a launch in float32, ncu on an H100,
    /// bench/RESULTS.md, session 36.)
    pub fn row_launch(rows: u64, cols: u64) -> ([u32; 3], [u32; 3]) {
        if cols > 128 && (rows < FEW_ROWS || (256 < cols && cols <= 1024)) {
            let threads = (cols.div_ceil(4).div_ceil(32) * 32).clamp(32, 1024) as u32;
            return ([rows.max(1) as u32, 1, 1], [threads, 1, 1]);
        }
        let (block, rows_per_block) = if cols <= 1024 {
            ([32, 8, 1], 8)
        } else if cols <= 8192 {
            ([256, 1, 1], 1)
        } else {
            ([1024, 1, 1], 1)
        };
        ([rows.div_ceil(rows_per_block).clamp(1, 1 << 20) as u32, 1, 1], block)
    }

    /// A tensor `t` of shape `shape` that broadcasts to `x_shape`, as the kernels index it:
    /// element k of X reads element `k % len`. When `shape`, leading 1s dropped, is a suffix of
    /// `x_shape` that is `t` itself; otherwise `t` is first expanded into scratch to the trailing
    /// `shape.len()` dimensions of X. Returns (handle, len).
    pub fn suffix_operand(t: u32, dtype: DType, shape: &[usize], x_shape: &[usize]) -> Result<(u32, u64)> {
        let core = &shape[shape.iter().take_while(|&&d| d == 1).count()..];
        if x_shape.ends_with(core) {
            return Ok((t, core.iter().product::<usize>().max(1) as u64));
        }
        let out = &x_shape[x_shape.len() - shape.len()..];
        let n: u64 = out.iter().map(|&d| d as u64).product();
        if n == 0 || out.len() > 8 {
            unsupported!("broadcast of shape {shape:?} to {x_shape:?}");
        }
        let esize = dtype.size().unwrap_or(4) as u64;
        let dst = scratch(n * esize)?;
        let mut strides = vec![0u64; shape.len()];
        let mut acc = 1u64;
        for i in (0..shape.len()).rev() {
            strides[i] = if shape[i] == 1 { 0 } else { acc };
            acc *= shape[i] as u64;
        }
        let mut args: Vec<KernelArg> = vec![
            tensor(t),
            tensor(dst),
            KernelArg::U64(n),
            KernelArg::U32(esize as u32),
            KernelArg::U32(out.len() as u32),
        ];
        args.extend((0..8).map(|i| KernelArg::U64(out.get(i).map_or(1, |&d| d as u64))));
        args.extend((0..8).map(|i| KernelArg::U64(strides.get(i).copied().unwrap_or(0))));
        launch(&Launch {
            kernel: "kiln_norm_expand",
            grid: [n.div_ceil(256).min(1 << 20) as u32, 1, 1],
            block: [256, 1, 1],
            shared_mem_bytes: 0,
            args,
        })?;
        Ok((dst, n))
    }
}

impl Shim for Normalization {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        match call.op_type() {
            "Softmax" | "LogSoftmax" => {
                let x = call.input(0)?;
                check_float(call, x.dtype()?)?;
                softmax::softmax_plan(call)?;
                Ok(vec![TensorType::new(x.dtype()?, x.shape()?)])
            }
            "InstanceNormalization" | "GroupNormalization" => group_norm::infer(call),
            "LRN" => lrn::infer(call),
            "LayerNormalization" => {
                let p = layer_norm::layer_norm_plan(call)?;
                let stat = TensorType::new(p.stat_dtype, p.stat_shape);
                Ok(vec![TensorType::new(call.input(0)?.dtype()?, p.x_shape), stat.clone(), stat])
            }
            "SimplifiedLayerNormalization" | "RMSNormalization" => rms_norm::simplified_infer(call),
            "SkipSimplifiedLayerNormalization" | "SkipLayerNormalization" => rms_norm::skip_norm_infer(call),
            "BatchNormalization" => batch_norm::infer(call),
            "LpNormalization" => lp_norm::infer(call),
            "MeanVarianceNormalization" => mvn::infer(call),
            other => unsupported!("kiln-normalization does not implement {other}"),
        }
    }

    fn cpu(call: &Call) -> Result<()> {
        match call.op_type() {
            "Softmax" | "LogSoftmax" => {
                check_float(call, call.input(0)?.dtype()?)?;
                softmax::softmax_cpu(call, call.op_type() == "LogSoftmax")
            }
            "LayerNormalization" => layer_norm::layer_norm_cpu(call),
            "InstanceNormalization" | "GroupNormalization" => group_norm::cpu(call),
            "LRN" => lrn::cpu(call),
            "SimplifiedLayerNormalization" | "RMSNormalization" => rms_norm::simplified_cpu(call),
            "SkipSimplifiedLayerNormalization" | "SkipLayerNormalization" => rms_norm::skip_norm_cpu(call),
            "BatchNormalization" => batch_norm::cpu(call),
            "LpNormalization" => lp_norm::cpu(call),
            "MeanVarianceNormalization" => mvn::cpu(call),
            other => unsupported!("kiln-normalization does not implement {other}"),
        }
    }

    fn dispatch(call: &Call) -> Result<()> {
        match call.op_type() {
            "Softmax" | "LogSoftmax" => {
                check_float(call, call.input(0)?.dtype()?)?;
                softmax::softmax_dispatch(call, call.op_type() == "LogSoftmax")
            }
            "LayerNormalization" => layer_norm::layer_norm_dispatch(call),
            "InstanceNormalization" | "GroupNormalization" => group_norm::dispatch(call),
            "LRN" => lrn::dispatch(call),
            "SimplifiedLayerNormalization" | "RMSNormalization" => rms_norm::simplified_dispatch(call),
            "SkipSimplifiedLayerNormalization" | "SkipLayerNormalization" => rms_norm::skip_norm_dispatch(call),
            "BatchNormalization" => batch_norm::dispatch(call),
            "LpNormalization" => lp_norm::dispatch(call),
            "MeanVarianceNormalization" => mvn::dispatch(call),
            other => unsupported!("kiln-normalization does not implement {other}"),
        }
    }
}

export_shim!(Normalization);
