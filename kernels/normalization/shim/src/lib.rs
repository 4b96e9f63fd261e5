//! Shim of `kiln-normalization`.
//!
//! - [`softmax`]: Softmax and LogSoftmax (opsets 1, 11, 13), following ONNX Operators.md.
//! - [`layer_norm`]: LayerNormalization-17, following ONNX Operators.md.
//! - [`rms_norm`]: onnxruntime's RMS normalisations, SimplifiedLayerNormalization (registered
//!   by onnxruntime in the ai.onnx domain, opset 1) and com.microsoft
//!   SkipSimplifiedLayerNormalization-1.
//!
//! The CPU references compute in f64 and round once to the output dtype.
#![no_std]
extern crate alloc;

mod layer_norm;
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

impl Shim for Normalization {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        match call.op_type() {
            "Softmax" | "LogSoftmax" => {
                let x = call.input(0)?;
                check_float(call, x.dtype()?)?;
                softmax::softmax_plan(call)?;
                Ok(vec![TensorType::new(x.dtype()?, x.shape()?)])
            }
            "LayerNormalization" => {
                let p = layer_norm::layer_norm_plan(call)?;
                let stat = TensorType::new(p.stat_dtype, p.stat_shape);
                Ok(vec![TensorType::new(call.input(0)?.dtype()?, p.x_shape), stat.clone(), stat])
            }
            "SimplifiedLayerNormalization" => rms_norm::simplified_infer(call),
            "SkipSimplifiedLayerNormalization" => rms_norm::skip_simplified_infer(call),
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
            "SimplifiedLayerNormalization" => rms_norm::simplified_cpu(call),
            "SkipSimplifiedLayerNormalization" => rms_norm::skip_simplified_cpu(call),
            other => unsupported!("kiln-normalization does not implement {other}"),
        }
    }
}

export_shim!(Normalization);
