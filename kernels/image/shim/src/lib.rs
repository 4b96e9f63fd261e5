//! Shim of `kiln-image`: image and spatial-resampling ops over `[N, C, D1, …]`-style tensors,
//! following ONNX Operators.md and ONNX's reference implementation: Resize (10, 11, 13, 18, 19)
//! and Upsample (7, 9) in [`resize`], GridSample (16, 20, 22) and AffineGrid (20) in [`grid`],
//! RoiAlign (10, 16, 22) in [`roi`], NonMaxSuppression (10, 11) in [`nms`].
//!
//! The CPU reference computes in f64 and rounds once; the CUDA kernels compute coordinates and
//! weights in f64 and the values in f32.
#![no_std]
extern crate alloc;

mod grid;
mod nms;
mod resize;
mod roi;

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{export_shim, unsupported};

struct Image;

impl Shim for Image {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        match call.op_type() {
            "Resize" | "Upsample" => resize::infer(call),
            "GridSample" => grid::grid_sample_infer(call),
            "AffineGrid" => grid::affine_infer(call),
            "RoiAlign" => roi::infer(call),
            "NonMaxSuppression" => nms::infer(call),
            other => unsupported!("kiln-image does not implement {other}"),
        }
    }

    fn cpu(call: &Call) -> Result<()> {
        match call.op_type() {
            "Resize" | "Upsample" => resize::cpu(call),
            "GridSample" => grid::grid_sample_cpu(call),
            "AffineGrid" => grid::affine_cpu(call),
            "RoiAlign" => roi::cpu(call),
            "NonMaxSuppression" => nms::cpu(call),
            other => unsupported!("kiln-image does not implement {other}"),
        }
    }

    fn dispatch(call: &Call) -> Result<()> {
        match call.op_type() {
            "Resize" | "Upsample" => resize::dispatch(call),
            "GridSample" => grid::grid_sample_dispatch(call),
            "AffineGrid" => grid::affine_dispatch(call),
            "RoiAlign" => roi::dispatch(call),
            "NonMaxSuppression" => nms::dispatch(call),
            other => unsupported!("kiln-image does not implement {other}"),
        }
    }
}

export_shim!(Image);
