//! TensorScatter-24 (ONNX Operators.md and its reference): a KV cache update. `past_cache`
//! [B, …, max_sequence_length, …] and `update` of the same shape but `sequence_length` along
//! `axis` (default −2, never the batch axis 0), optional int64 `write_indices` [B] (default 0)
//! → `present_cache`, the past with row `write_indices[b] + s` of batch row b replaced by the
//! update's row s (`mode` "linear"; "circular": modulo max_sequence_length). A linear write past
//! the cache's end, or a negative index, fails the node (on the GPU through the status record,
//! device error 8).

use alloc::vec::Vec;
use kiln_kernel_abi::bail;
use kiln_kernel_abi::guest::*;

use crate::{axis, elem_size};

struct Plan {
    esize: usize,
    batch: usize,
    /// Prefix rows per batch row (the axes between 0 and `axis`).
    rows: usize,
    max_seq: usize,
    seq: usize,
    inner: usize,
    circular: bool,
}

fn plan(call: &Call) -> Result<Plan> {
    let (past, update) = (call.input(0)?, call.input(1)?);
    let esize = elem_size("TensorScatter", past.dtype()?)?;
    let (ps, us) = (past.shape()?, update.shape()?);
    if past.dtype()? != update.dtype()? || ps.len() != us.len() || ps.len() < 2 {
        bail!("TensorScatter: past_cache {ps:?} and update {us:?} must have one dtype and one rank of 2 or more");
    }
    let a = axis("TensorScatter", call.attr_i("axis", -2)?, ps.len())?;
    if a == 0 {
        bail!("TensorScatter: axis may not be the batch axis 0");
    }
    if (0..ps.len()).any(|i| if i == a { us[i] > ps[i] } else { us[i] != ps[i] }) {
        bail!("TensorScatter: update {us:?} does not fit past_cache {ps:?} along axis {a}");
    }
    if let Some(w) = call.input_opt(2) {
        if w.dtype()? != DType::I64 || w.shape()? != [ps[0]] {
            bail!("TensorScatter: write_indices must be int64 [{}], not {} {:?}", ps[0], w.dtype()?, w.shape()?);
        }
    }
    let circular = match call.attr_s("mode", "linear")? {
        "linear" => false,
        "circular" => true,
        other => bail!("TensorScatter: mode {other:?} (linear or circular)"),
    };
    Ok(Plan {
        esize,
        batch: ps[0],
        rows: ps[1..a].iter().product(),
        max_seq: ps[a],
        seq: us[a],
        inner: ps[a + 1..].iter().product(),
        circular,
    })
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    plan(call)?;
    let p = call.input(0)?;
    Ok(alloc::vec![TensorType::new(p.dtype()?, p.shape()?)])
}

pub fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let mut out = call.input(0)?.read_bytes()?;
    let update = call.input(1)?.read_bytes()?;
    let w = match call.input_opt(2) {
        Some(t) => t.read_i64s()?,
        None => alloc::vec![0; p.batch],
    };
    let row = p.inner * p.esize;
    for (b, &start) in w.iter().enumerate() {
        // In u64: the shim's usize is 32 bits, an index may not fit it.
        if start < 0 || (!p.circular && start as u64 + p.seq as u64 > p.max_seq as u64) {
            bail!("TensorScatter: write_indices[{b}] = {start} writes past the cache's {} positions", p.max_seq);
        }
        for r in 0..p.rows {
            for s in 0..p.seq {
                let j = ((start as u64 + s as u64) % p.max_seq as u64) as usize;
                let (dst, src) = (((b * p.rows + r) * p.max_seq + j) * row, ((b * p.rows + r) * p.seq + s) * row);
                out[dst..dst + row].copy_from_slice(&update[src..src + row]);
            }
        }
    }
    call.output(0)?.write_bytes(&out)
}

pub fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let n = p.batch * p.rows * p.max_seq * p.inner;
    if n == 0 {
        return Ok(());
    }
    let t = KernelArg::tensor;
    let past = call.input(0)?.handle();
    let w = call.input_opt(2);
    launch(&Launch {
        kernel: "kiln_tensor_scatter_seq",
        grid: grid_stride(n as u64),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args: alloc::vec![
            t(past),
            t(call.input(1)?.handle()),
            t(w.as_ref().map_or(past, |w| w.handle())),
            t(call.output(0)?.handle()),
            KernelArg::U64(n as u64),
            KernelArg::U32(p.esize as u32),
            KernelArg::U64(p.rows as u64),
            KernelArg::U64(p.max_seq as u64),
            KernelArg::U64(p.seq as u64),
            KernelArg::U64(p.inner as u64),
            KernelArg::U32(p.circular as u32),
            KernelArg::U32(w.is_some() as u32),
            KernelArg::Status,
        ],
    })
}
