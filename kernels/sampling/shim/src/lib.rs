//! Shim of `kiln-sampling`: the ops a decode step runs on the device after the model, so that
//! only token ids cross to the host (ArgMax itself is kiln-reduce's).
//!
//! `ai.kiln::AppendAttentionMask(attention_mask, position) -> (attention_mask_out,
//! position_out)`:
//! - `attention_mask`: int64 or int32 `[B, L]`; `position`: int64 `[1]`.
//! - `attention_mask_out` is the mask with column `position` of every row set to 1 (unchanged
//!   when `position` is outside `[0, L)`); `position_out` is `position + 1`.
//! - Bound in place (outputs written into the inputs' buffers) it is onnxruntime-genai's
//!   device-side mask update under CUDA graphs: a decode step appends its token's 1 to every
//!   row without the host, so the next step's `seqlens_k` (`ReduceSum(mask) − 1`) is ready on
//!   the device.
#![no_std]
extern crate alloc;

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, export_shim, unsupported};

struct Sampling;

const APPEND: &str = "AppendAttentionMask";

/// `(B, L)` of the mask, after checking both inputs.
fn plan(call: &Call) -> Result<(usize, usize)> {
    if call.op_type() != APPEND {
        unsupported!("kiln-sampling does not implement {}", call.op_type());
    }
    let mask = call.input(0)?;
    let shape = mask.shape()?;
    if shape.len() != 2 || !matches!(mask.dtype()?, DType::I64 | DType::I32) {
        bail!("{APPEND}: attention_mask must be int64 or int32 [batch, length], got {} {:?}", mask.dtype()?, shape);
    }
    let pos = call.input(1)?;
    if pos.dtype()? != DType::I64 || pos.numel()? != 1 {
        bail!("{APPEND}: position must be one int64, got {} {:?}", pos.dtype()?, pos.shape()?);
    }
    Ok((shape[0], shape[1]))
}

impl Shim for Sampling {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        plan(call)?;
        let (mask, pos) = (call.input(0)?, call.input(1)?);
        Ok(vec![TensorType::new(mask.dtype()?, mask.shape()?), TensorType::new(DType::I64, pos.shape()?)])
    }

    fn cpu(call: &Call) -> Result<()> {
        let (b_n, l) = plan(call)?;
        let mask = call.input(0)?;
        let p = call.input(1)?.read_vec::<i64>()?[0];
        let mut m = mask.read_vec::<i64>()?;
        if let Ok(col) = usize::try_from(p) {
            if col < l {
                (0..b_n).for_each(|b| m[b * l + col] = 1);
            }
        }
        let out = element::encode_as(mask.dtype()?, &m)?;
        call.output(0)?.write_bytes(&out)?;
        call.output(1)?.write_vec(&[p.wrapping_add(1)])
    }

    fn dispatch(call: &Call) -> Result<()> {
        let (b_n, l) = plan(call)?;
        let mask = call.input(0)?;
        let kernel = if mask.dtype()? == DType::I64 { "kiln_append_mask_i64" } else { "kiln_append_mask_i32" };
        let t = |h: u32| KernelArg::Tensor { handle: h, offset: 0 };
        launch(&Launch {
            kernel,
            grid: [1, 1, 1],
            block: [256, 1, 1],
            shared_mem_bytes: 0,
            args: vec![
                t(mask.handle()),
                t(call.input(1)?.handle()),
                t(call.output(0)?.handle()),
                t(call.output(1)?.handle()),
                KernelArg::U64(b_n as u64),
                KernelArg::U64(l as u64),
            ],
        })
    }
}

export_shim!(Sampling);
