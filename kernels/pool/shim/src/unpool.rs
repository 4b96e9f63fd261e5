//! MaxUnpool-9/11/22 (ONNX Operators.md and its reference): `X` [N, C, D1, …, Dk] and the int64
//! `I` of the same shape (MaxPool's `Indices`: flat indices into the unpooled tensor) → `Y`, zeros
//! but for `Y.flat[I[e]] = X[e]`. The unpooled shape is `(Di − 1)·stride − b − e + kernel` per
//! spatial axis (`kernel_shape`, `strides` 1, `pads` 0); a given `output_shape` (input 2, a value
//! input, at least that large per axis) makes the output larger, the unpooled tensor in its
//! leading corner. An index outside the unpooled tensor fails the node (on the GPU through the
//! status record, device error 1). Copies element bytes, so every float dtype works.

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, unsupported};

struct Plan {
    esize: usize,
    /// The unpooled shape (from the attributes) and the output's.
    unpooled: Vec<usize>,
    out: Vec<usize>,
}

fn plan(call: &Call) -> Result<Plan> {
    let x = call.input(0)?;
    let esize = match x.dtype()? {
        d if d.is_float() => d.size().unwrap_or(4),
        d => unsupported!("MaxUnpool: {d} input is not supported"),
    };
    let shape = x.shape()?;
    if shape.len() < 3 {
        bail!("MaxUnpool: X must be [N, C, D1, ...], not {shape:?}");
    }
    let idx = call.input(1)?;
    if idx.dtype()? != DType::I64 || idx.shape()? != shape {
        bail!("MaxUnpool: I must be int64 of X's shape {shape:?}, not {} {:?}", idx.dtype()?, idx.shape()?);
    }
    let k = shape.len() - 2;
    let ints = |name: &str, len: usize, default: i64| -> Result<Vec<i64>> {
        match call.attr(name) {
            None => Ok(alloc::vec![default; len]),
            Some(AttrValue::Ints(v)) if v.len() == len => Ok(v.clone()),
            Some(_) => bail!("MaxUnpool: {name} must be {len} ints"),
        }
    };
    if call.attr("kernel_shape").is_none() {
        bail!("MaxUnpool: kernel_shape is required");
    }
    let (kernel, strides, pads) = (ints("kernel_shape", k, 1)?, ints("strides", k, 1)?, ints("pads", 2 * k, 0)?);
    let mut unpooled = shape[..2].to_vec();
    for d in 0..k {
        let v = (shape[2 + d] as i64 - 1) * strides[d] - pads[d] - pads[k + d] + kernel[d];
        if v < 1 || kernel[d] < 1 || strides[d] < 1 {
            bail!(
                "MaxUnpool: axis {d} unpools to {v} (kernel {}, stride {}, pads {} and {})",
                kernel[d],
                strides[d],
                pads[d],
                pads[k + d]
            );
        }
        unpooled.push(v as usize);
    }
    let out = match call.input_opt(2) {
        None => unpooled.clone(),
        Some(t) => {
            let s = t.read_i64s()?;
            if s.len() != shape.len() || s.iter().zip(&unpooled).any(|(&o, &u)| o < u as i64) {
                bail!("MaxUnpool: output_shape {s:?} must have X's rank and be at least {unpooled:?}");
            }
            s.iter().map(|&v| v as usize).collect()
        }
    };
    Ok(Plan { esize, unpooled, out })
}

/// The output offset of unpooled flat index `i`.
fn remap(i: usize, from: &[usize], to: &[usize]) -> usize {
    let (mut rest, mut at, mut stride) = (i, 0, 1);
    for (&f, &t) in from.iter().zip(to).rev() {
        at += (rest % f) * stride;
        rest /= f;
        stride *= t;
    }
    at
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    Ok(alloc::vec![TensorType::new(call.input(0)?.dtype()?, p.out)])
}

pub fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let x = call.input(0)?.read_bytes()?;
    let idx = call.input(1)?.read_i64s()?;
    let total: usize = p.unpooled.iter().product();
    let mut y = alloc::vec![0u8; p.out.iter().product::<usize>() * p.esize];
    for (e, &i) in idx.iter().enumerate() {
        if i < 0 || i as u64 >= total as u64 {
            bail!("MaxUnpool: I[{e}] = {i} is outside the unpooled tensor of {total} elements");
        }
        let at = remap(i as usize, &p.unpooled, &p.out) * p.esize;
        y[at..at + p.esize].copy_from_slice(&x[e * p.esize..(e + 1) * p.esize]);
    }
    call.output(0)?.write_bytes(&y)
}

pub fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let rank = p.out.len();
    if rank > 8 {
        unsupported!("MaxUnpool: rank {rank} (the CUDA kernel takes up to 8)");
    }
    let y = call.output(0)?.handle();
    let bytes = (p.out.iter().product::<usize>() * p.esize) as u64;
    if bytes == 0 {
        return Ok(());
    }
    launch(&Launch {
        kernel: "kiln_unpool_zero",
        grid: grid_stride(bytes),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args: alloc::vec![KernelArg::Tensor { handle: y, offset: 0 }, KernelArg::U64(bytes)],
    })?;
    let n = call.input(0)?.numel()? as u64;
    if n == 0 {
        return Ok(());
    }
    let t = KernelArg::tensor;
    let mut args = alloc::vec![
        t(call.input(0)?.handle()),
        t(call.input(1)?.handle()),
        t(y),
        KernelArg::U64(n),
        KernelArg::U32(p.esize as u32),
        KernelArg::U64(p.unpooled.iter().product::<usize>() as u64),
        KernelArg::U32(rank as u32),
    ];
    let dims8 = |d: &[usize]| (0..8).map(|i| KernelArg::U64(d.get(i).map_or(1, |&v| v as u64))).collect::<Vec<_>>();
    args.extend(dims8(&p.unpooled));
    args.extend(dims8(&p.out));
    args.push(KernelArg::Status);
    launch(&Launch {
        kernel: "kiln_unpool",
        grid: grid_stride(n),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args,
    })
}
