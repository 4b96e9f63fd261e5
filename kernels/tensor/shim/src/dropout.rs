//! Dropout-7/10/12/13/22 (ONNX Operators.md) for inference: `output` is `data`, and the optional
//! `mask` output is all true (bool from opset 10; before, of the data's dtype, all 1). From
//! opset 12, `ratio` (input 1, a float scalar, 0.5 when absent)
//! and `training_mode` (input 2, a bool scalar, false when absent) are value inputs; before, the
//! op has no training mode. Training mode with a ratio above 0 draws a random mask, which kiln
//! does not do: it is refused as unsupported; with ratio 0 it is inference.

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, unsupported};

use crate::{elem_size, gpu};

/// Checks the node: inference, or training with ratio 0.
fn check(call: &Call) -> Result<()> {
    if call.opset() < 12 {
        return Ok(());
    }
    let scalar = |i: usize, what: &str| -> Result<Option<f64>> {
        match call.input_opt(i) {
            None => Ok(None),
            // Value inputs: their bytes arrive inline with every call.
            Some(t) => match element::decode_as::<f64>(t.dtype()?, t.value().unwrap_or(&[]))?[..] {
                [v] => Ok(Some(v)),
                ref v => bail!("Dropout: {what} must be a scalar, got {} values", v.len()),
            },
        }
    };
    let training = scalar(2, "training_mode")?.is_some_and(|t| t != 0.0);
    let ratio = scalar(1, "ratio")?.unwrap_or(0.5);
    if !(0.0..1.0).contains(&ratio) {
        bail!("Dropout: ratio must be in [0, 1), not {ratio}");
    }
    if training && ratio > 0.0 {
        unsupported!("Dropout: training_mode with ratio {ratio} draws a random mask; kiln runs inference");
    }
    Ok(())
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    check(call)?;
    let x = call.input(0)?;
    let mut out = vec![TensorType::new(x.dtype()?, x.shape()?)];
    if call.num_outputs() > 1 {
        out.push(TensorType::new(mask_dtype(call)?, x.shape()?));
    }
    Ok(out)
}

/// The mask's dtype: bool from opset 10, the data's before.
fn mask_dtype(call: &Call) -> Result<DType> {
    Ok(if call.opset() >= 10 { DType::Bool } else { call.input(0)?.dtype()? })
}

/// One mask element: `true`, or 1 in the data's dtype before opset 10.
fn mask_one(call: &Call) -> Result<Vec<u8>> {
    element::encode_as::<f64>(mask_dtype(call)?, &[1.0])
}

pub fn cpu(call: &Call) -> Result<()> {
    check(call)?;
    let x = call.input(0)?;
    elem_size("Dropout", x.dtype()?)?;
    call.output(0)?.write_bytes(&x.read_bytes()?)?;
    if let Some(mask) = call.output_opt(1) {
        mask.write_bytes(&mask_one(call)?.repeat(x.numel()?))?;
    }
    Ok(())
}

pub fn dispatch(call: &Call) -> Result<()> {
    check(call)?;
    let x = call.input(0)?;
    let esize = elem_size("Dropout", x.dtype()?)?;
    let n = x.numel()? as u64;
    gpu::copy(gpu::At::of(&x), gpu::At::of(&call.output(0)?), n * esize as u64)?;
    if let Some(mask) = call.output_opt(1) {
        let one = mask_one(call)?;
        gpu::fill(gpu::At::of(&mask), n * one.len() as u64, &one)?;
    }
    Ok(())
}
