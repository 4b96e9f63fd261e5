//! ReverseSequence-10 (ONNX Operators.md): along `time_axis` (default 0), batch row b of
//! `batch_axis` (default 1; the two are 0 and 1 in some order) has its first
//! `sequence_lens[b]` (int64 [B], each in 0..=T) elements reversed; the rest stay. Works on
//! element bytes, so every fixed-size dtype works; on the GPU `kiln_tensor_reverse_sequence`
//! runs one thread per element and reports a length out of range as the CPU does.

use alloc::vec::Vec;
use kiln_kernel_abi::bail;
use kiln_kernel_abi::guest::*;

use crate::elem_size;
use crate::gpu::{launch_elems, At};

const OP: &str = "ReverseSequence";

struct Plan {
    esize: usize,
    shape: Vec<usize>,
    batch_axis: usize,
    time_axis: usize,
}

fn plan(call: &Call) -> Result<Plan> {
    let x = call.input(0)?;
    let esize = elem_size(OP, x.dtype()?)?;
    let shape = x.shape()?;
    if shape.len() < 2 {
        bail!("{OP}: the input must have rank 2 or more, not {}", shape.len());
    }
    let (b, t) = (call.attr_i("batch_axis", 1)?, call.attr_i("time_axis", 0)?);
    let (batch_axis, time_axis) = match (b, t) {
        (1, 0) => (1, 0),
        (0, 1) => (0, 1),
        _ => bail!("{OP}: batch_axis {b} and time_axis {t} must be 0 and 1 in some order"),
    };
    let lens = call.input(1)?;
    if lens.shape()? != [shape[batch_axis]] || !matches!(lens.dtype()?, DType::I64 | DType::I32) {
        bail!("{OP}: sequence_lens must be int64 [{}], not {} {:?}", shape[batch_axis], lens.dtype()?, lens.shape()?);
    }
    Ok(Plan { esize, shape, batch_axis, time_axis })
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    plan(call)?;
    let x = call.input(0)?;
    Ok(vec![TensorType::new(x.dtype()?, x.shape()?)])
}

pub fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let x = call.input(0)?;
    let data = if x.numel()? == 0 { Vec::new() } else { x.read_bytes()? };
    let lens = call.input(1)?.read_i64s()?;
    let t_len = p.shape[p.time_axis];
    if let Some((b, &l)) = lens.iter().enumerate().find(|(_, &l)| l < 0 || l > t_len as i64) {
        bail!("{OP}: sequence_lens[{b}] = {l} is out of range for {t_len} time steps");
    }
    // [axis 0, axis 1, inner]: (b, t) on axes 0 and 1 in the attributes' order.
    let inner: usize = p.shape[2..].iter().product::<usize>() * p.esize;
    let mut out = data.clone();
    for a0 in 0..p.shape[0] {
        for a1 in 0..p.shape[1] {
            let (b, t) = if p.batch_axis == 0 { (a0, a1) } else { (a1, a0) };
            let l = lens[b] as usize;
            let src_t = if t < l { l - 1 - t } else { t };
            let (s0, s1) = if p.batch_axis == 0 { (b, src_t) } else { (src_t, b) };
            let (dst, src) = ((a0 * p.shape[1] + a1) * inner, (s0 * p.shape[1] + s1) * inner);
            out[dst..dst + inner].copy_from_slice(&data[src..src + inner]);
        }
    }
    call.output(0)?.write_bytes(&out)
}

pub fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let lens = call.input(1)?;
    let n: u64 = p.shape.iter().map(|&d| d as u64).product();
    let inner: u64 = p.shape[2..].iter().map(|&d| d as u64).product();
    launch_elems(
        "kiln_tensor_reverse_sequence",
        n,
        vec![
            At::of(&call.input(0)?).arg(),
            At::of(&lens).arg(),
            At::of(&call.output(0)?).arg(),
            KernelArg::U64(n),
            KernelArg::U32(p.esize as u32),
            KernelArg::U64(p.shape[0] as u64),
            KernelArg::U64(p.shape[1] as u64),
            KernelArg::U64(inner),
            KernelArg::U32((p.batch_axis == 0) as u32),
            KernelArg::U32((lens.dtype()? == DType::I64) as u32),
            KernelArg::Status,
        ],
    )
}
