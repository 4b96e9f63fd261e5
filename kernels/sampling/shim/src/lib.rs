//! Shim of `kiln-sampling`: the ops a decode step runs on the device after the model, so that
//! only token ids cross to the host (ArgMax itself is kiln-reduce's).
//!
//! `ai.kiln::Sample(logits, attention_mask, history, position, sampling, seeds) -> (token_ids,
//! history_out)`:
//! - `logits`: float32, float16 or bfloat16 `[B, S, V]` (the last position of each row is
//!   used) or `[B, V]`.
//! - `attention_mask`, `history`: int64 `[B, L]`; column `c` of `history` is the token at mask
//!   column `c`, part of the row's history when `c < position` and the mask is set there.
//! - `position`: int64 `[1]`, the column the chosen token takes.
//! - `sampling`: float32 `[B, 4]`: temperature (≤ 0: greedy), top_k (0: all), top_p,
//!   repetition_penalty.
//! - `seeds`: int64 `[B, 3]`: the row's seed, the position of its step 0 (`base`) and its
//!   stream: the draw of a row at `position` is Philox (seed, stream, position − base). A batch
//!   of prompts gives row `b` stream `b`; a continuous batch gives every request stream 0, so a
//!   request's draws do not depend on its slot.
//! - `token_ids`: int64 `[B, 1]`; `history_out`: `history` with column `position` set to the
//!   token (bound in place, the history a decode graph keeps on the device).
//! - The choice is kernel-abi's `sampling::next_token`, on the CPU and in the CUDA kernel
//!   alike, for any top-k: the CUDA kernel sorts up to 1,024 candidates on chip and selects
//!   among more by mass (radix selects of the top-p cut and of the draw), so its sums differ from
//!   the reference's only in float64 rounding.
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
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::sampling::{next_token, RowParams, DEVICE_MAX_VOCAB, SEED_WORDS};
use kiln_kernel_abi::{bail, export_shim, unsupported};

struct Sampling;

const APPEND: &str = "AppendAttentionMask";
const SAMPLE: &str = "Sample";

/// Threads of a Sample block (one block per row).
const SAMPLE_THREADS: u32 = 1024;

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

/// A Sample call's sizes: batch, positions per row, vocabulary, mask length.
struct SamplePlan {
    b: usize,
    s: usize,
    v: usize,
    l: usize,
}

fn plan_sample(call: &Call) -> Result<SamplePlan> {
    let logits = call.input(0)?;
    let ls = logits.shape()?;
    element::expect_dtype("Sample: logits", logits.dtype()?, &[DType::F32, DType::F16, DType::BF16])?;
    let (b, s, v) = match ls.as_slice() {
        [b, v] => (*b, 1, *v),
        [b, s, v] if *s > 0 => (*b, *s, *v),
        _ => bail!("{SAMPLE}: logits must be [batch, vocab] or [batch, sequence, vocab] (sequence > 0), got {ls:?}"),
    };
    let mask = call.input(1)?.shape()?;
    if mask.len() != 2 || mask[0] != b {
        bail!("{SAMPLE}: attention_mask must be [{b}, length], got {mask:?}");
    }
    let l = mask[1];
    let want = |i: usize, what: &str, dtype: DType, shape: &[usize]| -> Result<()> {
        let t = call.input(i)?;
        if t.dtype()? != dtype || t.shape()? != shape {
            bail!("{SAMPLE}: {what} must be {dtype} {shape:?}, got {} {:?}", t.dtype()?, t.shape()?);
        }
        Ok(())
    };
    if call.input(1)?.dtype()? != DType::I64 {
        bail!("{SAMPLE}: attention_mask must be int64, got {}", call.input(1)?.dtype()?);
    }
    want(2, "history", DType::I64, &[b, l])?;
    want(3, "position", DType::I64, &[1])?;
    want(4, "sampling", DType::F32, &[b, 4])?;
    want(5, "seeds", DType::I64, &[b, SEED_WORDS])?;
    Ok(SamplePlan { b, s, v, l })
}

/// Shared memory of one Sample block: the static part and the history bitmap.
fn sample_smem(v: usize) -> Result<u32> {
    let bitmap = v.div_ceil(32) * 4;
    if v > DEVICE_MAX_VOCAB {
        unsupported!("{SAMPLE}: a vocabulary of {v} tokens needs {bitmap} bytes of history bitmap beside the kernel's own shared memory; the GPU sampler fits 48 KiB");
    }
    Ok(bitmap as u32)
}

fn sample_cpu(call: &Call) -> Result<()> {
    let SamplePlan { b, s, v, l } = plan_sample(call)?;
    let logits = call.input(0)?.read_vec::<f32>()?;
    let mask = call.input(1)?.read_vec::<i64>()?;
    let mut history = call.input(2)?.read_vec::<i64>()?;
    let position = call.input(3)?.read_vec::<i64>()?[0];
    let params = call.input(4)?.read_vec::<f32>()?;
    let seeds = call.input(5)?.read_vec::<i64>()?;
    let cols = usize::try_from(position.max(0)).unwrap_or(usize::MAX).min(l);
    let mut ids = Vec::with_capacity(b);
    for r in 0..b {
        let row = &logits[(r * s + s - 1) * v..(r * s + s) * v];
        let p = &params[r * 4..r * 4 + 4];
        let rp = RowParams {
            temperature: p[0],
            top_k: if p[1] >= 1.0 { p[1] as u32 } else { 0 },
            top_p: p[2],
            repetition_penalty: p[3],
        };
        let seen = (0..cols).filter(|&c| mask[r * l + c] != 0).map(|c| history[r * l + c]);
        let seed = &seeds[r * SEED_WORDS..(r + 1) * SEED_WORDS];
        let step = position.wrapping_sub(seed[1]) as u64;
        let token = next_token(row, seen, &rp, seed[0] as u64, seed[2] as u32, step) as i64;
        ids.push(token);
    }
    if let Ok(c) = usize::try_from(position) {
        if c < l {
            (0..b).for_each(|r| history[r * l + c] = ids[r]);
        }
    }
    call.output(0)?.write_vec(&ids)?;
    call.output(1)?.write_vec(&history)
}

/// The kernels' template argument for `dtype`: the prelude's tag of a dtype kernel.toml
/// instantiates them for (Sample: float32, float16, bfloat16; AppendAttentionMask: int64, int32).
fn kernel_tag(dtype: DType) -> Result<&'static str> {
    match (dtype, dtype.cuda_tag()) {
        (DType::F32 | DType::F16 | DType::BF16 | DType::I64 | DType::I32, Some(tag)) => Ok(tag),
        _ => unsupported!("kiln-sampling: no CUDA kernel for {dtype}"),
    }
}

fn sample_dispatch(call: &Call) -> Result<()> {
    let SamplePlan { b, s, v, l } = plan_sample(call)?;
    let kernel = kernel_name("kiln_sample", &[kernel_tag(call.input(0)?.dtype()?)?]);
    let t = KernelArg::tensor;
    let mut args: Vec<KernelArg> = (0..6).map(|i| Ok(t(call.input(i)?.handle()))).collect::<Result<_>>()?;
    args.extend([t(call.output(0)?.handle()), t(call.output(1)?.handle())]);
    args.extend([KernelArg::U64(s as u64), KernelArg::U64(v as u64), KernelArg::U64(l as u64), KernelArg::Status]);
    launch(&Launch {
        kernel: &kernel,
        grid: [b as u32, 1, 1],
        block: [SAMPLE_THREADS, 1, 1],
        shared_mem_bytes: sample_smem(v)?,
        args,
    })
}

impl Shim for Sampling {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        match call.op_type() {
            APPEND => {}
            SAMPLE => {
                let SamplePlan { b, l, .. } = plan_sample(call)?;
                return Ok(vec![TensorType::new(DType::I64, vec![b, 1]), TensorType::new(DType::I64, vec![b, l])]);
            }
            other => unsupported!("kiln-sampling does not implement {other}"),
        }
        plan(call)?;
        let (mask, pos) = (call.input(0)?, call.input(1)?);
        Ok(vec![TensorType::new(mask.dtype()?, mask.shape()?), TensorType::new(DType::I64, pos.shape()?)])
    }

    fn cpu(call: &Call) -> Result<()> {
        if call.op_type() == SAMPLE {
            return sample_cpu(call);
        }
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
        if call.op_type() == SAMPLE {
            return sample_dispatch(call);
        }
        let (b_n, l) = plan(call)?;
        let mask = call.input(0)?;
        let kernel = kernel_name("kiln_append_mask", &[kernel_tag(mask.dtype()?)?]);
        let t = KernelArg::tensor;
        launch(&Launch {
            kernel: &kernel,
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
