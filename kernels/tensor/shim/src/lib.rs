//! Shim of `kiln-tensor`: shape and data-movement ops, following ONNX Operators.md.
//!
//! - [`layout`]: ops that only change the shape, not the bytes: Reshape (1, 5, 13, 14, 19,
//!   21, 23–25), Flatten, Squeeze, Unsqueeze (axes as attribute before opset 13, as input
//!   from 13), Identity.
//! - [`strided`]: ops that gather elements along strides: Transpose, Slice (attributes
//!   before opset 10, inputs from 10), Expand.
//! - [`join`]: Concat, Split (split as attribute before opset 13, as input from 13,
//!   `num_outputs` from 18), Gather.
//! - [`generate`]: ops that make new values: Shape (`start`/`end` from 15), Size, Constant,
//!   ConstantOfShape, Range.
//! - [`trilu`]: Trilu (a triangle of the last two dimensions).
//! - [`index`]: GatherElements, ScatterElements (and Scatter), GatherND, ScatterND.
//! - [`onehot`]: OneHot, EyeLike.
//! - [`pad`]: Pad (constant, edge, reflect and wrap).
//! - [`dropout`]: Dropout for inference (the data, and an all-true mask).
//! - [`select`]: NonZero and Compress (output shapes from the values of a value input).
//! - [`tensor_scatter`]: TensorScatter (a KV cache update).
//! - [`mel`]: MelWeightMatrix (a generator, as the windows are).
//!
//! GPU dispatches ([`gpu`], kernels in `cuda/tensor.cu`) move bytes by element size, so
//! they too serve every fixed-size dtype; Constant has none (the host folds it at load).
//!
//! Every op works on raw element bytes, so every fixed-size dtype works; string tensors
//! are unsupported. Shape-like inputs are value inputs (see `kernel.toml`): `infer` reads
//! them with [`Tensor::read_i64s`], and never reads any other input's bytes.
#![no_std]
extern crate alloc;

mod dropout;
mod generate;
mod gpu;
mod index;
mod join;
mod layout;
mod mel;
mod onehot;
mod pad;
mod reverse;
mod select;
mod strided;
mod tensor_scatter;
mod trilu;
mod window;

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{export_shim, unsupported};

struct Tensors;

impl Shim for Tensors {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        match call.op_type() {
            "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" | "Identity" => {
                let x = call.input(0)?;
                Ok(vec![TensorType::new(x.dtype()?, layout::out_shape(call)?)])
            }
            "Transpose" | "Slice" | "Expand" | "Tile" | "DepthToSpace" | "SpaceToDepth" => {
                let x = call.input(0)?;
                Ok(vec![TensorType::new(x.dtype()?, strided::plan(call)?.out)])
            }
            "Concat" => join::concat_infer(call),
            "Split" => join::split_infer(call),
            "Gather" => join::gather_infer(call),
            "Shape" | "Size" | "Constant" | "ConstantOfShape" | "Range" => generate::infer(call),
            "Trilu" => trilu::infer(call),
            "Dropout" => dropout::infer(call),
            "GatherElements" => index::gather_elements_infer(call),
            "ScatterElements" | "Scatter" => index::scatter_elements_infer(call),
            "GatherND" => index::gather_nd_infer(call),
            "ScatterND" => index::scatter_nd_infer(call),
            "OneHot" => onehot::onehot_infer(call),
            "EyeLike" => onehot::eyelike_infer(call),
            "Pad" => pad::infer(call),
            "CenterCropPad" => pad::center_infer(call),
            "HannWindow" | "HammingWindow" | "BlackmanWindow" => window::infer(call),
            "ReverseSequence" => reverse::infer(call),
            "NonZero" => select::nonzero_infer(call),
            "Compress" => select::compress_infer(call),
            "TensorScatter" => tensor_scatter::infer(call),
            "MelWeightMatrix" => mel::infer(call),
            other => unsupported!("kiln-tensor does not implement {other}"),
        }
    }

    fn dispatch(call: &Call) -> Result<()> {
        match call.op_type() {
            "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" | "Identity" => layout::dispatch(call),
            "Transpose" | "Slice" | "Expand" | "Tile" | "DepthToSpace" | "SpaceToDepth" => strided::dispatch(call),
            "Concat" => join::concat_dispatch(call),
            "Split" => join::split_dispatch(call),
            "Gather" => join::gather_dispatch(call),
            "Shape" | "Size" | "Constant" | "ConstantOfShape" | "Range" => generate::dispatch(call),
            "Trilu" => trilu::dispatch(call),
            "Dropout" => dropout::dispatch(call),
            "GatherElements" => index::gather_elements_dispatch(call),
            "ScatterElements" | "Scatter" => index::scatter_elements_dispatch(call),
            "GatherND" => index::gather_nd_dispatch(call),
            "ScatterND" => index::scatter_nd_dispatch(call),
            "OneHot" => onehot::onehot_dispatch(call),
            "EyeLike" => onehot::eyelike_dispatch(call),
            "Pad" => pad::dispatch(call),
            "CenterCropPad" => pad::center_dispatch(call),
            "HannWindow" | "HammingWindow" | "BlackmanWindow" => window::dispatch(call),
            "ReverseSequence" => reverse::dispatch(call),
            "NonZero" => select::nonzero_dispatch(call),
            "Compress" => select::compress_dispatch(call),
            "TensorScatter" => tensor_scatter::dispatch(call),
            "MelWeightMatrix" => mel::dispatch(call),
            other => unsupported!("kiln-tensor does not implement {other}"),
        }
    }

    fn cpu(call: &Call) -> Result<()> {
        match call.op_type() {
            "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" | "Identity" => layout::cpu(call),
            "Transpose" | "Slice" | "Expand" | "Tile" | "DepthToSpace" | "SpaceToDepth" => strided::cpu(call),
            "Concat" => join::concat_cpu(call),
            "Split" => join::split_cpu(call),
            "Gather" => join::gather_cpu(call),
            "Shape" | "Size" | "Constant" | "ConstantOfShape" | "Range" => generate::cpu(call),
            "Trilu" => trilu::cpu(call),
            "Dropout" => dropout::cpu(call),
            "GatherElements" => index::gather_elements_cpu(call),
            "ScatterElements" | "Scatter" => index::scatter_elements_cpu(call),
            "GatherND" => index::gather_nd_cpu(call),
            "ScatterND" => index::scatter_nd_cpu(call),
            "OneHot" => onehot::onehot_cpu(call),
            "EyeLike" => onehot::eyelike_cpu(call),
            "Pad" => pad::cpu(call),
            "CenterCropPad" => pad::center_cpu(call),
            "HannWindow" | "HammingWindow" | "BlackmanWindow" => window::cpu(call),
            "ReverseSequence" => reverse::cpu(call),
            "NonZero" => select::nonzero_cpu(call),
            "Compress" => select::compress_cpu(call),
            "TensorScatter" => tensor_scatter::cpu(call),
            "MelWeightMatrix" => mel::cpu(call),
            other => unsupported!("kiln-tensor does not implement {other}"),
        }
    }
}

export_shim!(Tensors);

/// Size in bytes of one element of `dtype`; unsupported for strings.
pub(crate) fn elem_size(op: &str, dtype: DType) -> Result<usize> {
    match dtype.size() {
        Some(s) => Ok(s),
        None => unsupported!("{op}: {dtype} tensors are not supported"),
    }
}

/// `axis` in `-rank..rank` as `0..rank`, with the op's name in the error.
pub(crate) fn axis(op: &str, axis: i64, rank: usize) -> Result<usize> {
    shape::normalize_axis(axis, rank).map_err(|e| match e {
        ShimError::Failed(m) => ShimError::Failed(format!("{op}: {m}")),
        other => other,
    })
}

/// Normalises every axis of `axes` against `rank`; repeated axes are an error.
pub(crate) fn distinct_axes(op: &str, axes: &[i64], rank: usize) -> Result<Vec<usize>> {
    let mut out: Vec<usize> = Vec::with_capacity(axes.len());
    for &a in axes {
        let n = axis(op, a, rank)?;
        if out.contains(&n) {
            return Err(ShimError::Failed(format!("{op}: axis {a} is repeated in {axes:?}")));
        }
        out.push(n);
    }
    Ok(out)
}

/// An input's int list (a value input), or the INTS attribute `name` when the input is absent
/// (the attribute form of older opsets).
pub(crate) fn ints_input_or_attr(call: &Call, input: usize, name: &str) -> Result<Option<Vec<i64>>> {
    match call.input_opt(input) {
        Some(t) => Ok(Some(t.read_i64s()?)),
        None => call.attr_ints(name),
    }
}
