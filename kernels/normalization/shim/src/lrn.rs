//! LRN (1, 13), after ONNX Operators.md: across channels of X [N, C, D…],
//! y = x / (bias + alpha / size · Σ x²)^beta, the sum over channels c − ⌊(size − 1)/2⌋ …
//! c + ⌈(size − 1)/2⌉ that exist. `size` is required; alpha 1e-4, beta 0.75, bias 1. The CPU
//! reference computes in f64; `kiln_lrn<Tag>` runs one thread per element.
use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, names};

use crate::check_float;

struct Plan {
    shape: Vec<usize>,
    size: usize,
    alpha: f64,
    beta: f64,
    bias: f64,
}

fn plan(call: &Call) -> Result<Plan> {
    let x = call.input(0)?;
    check_float(call, x.dtype()?)?;
    let shape = x.shape()?;
    if shape.len() < 2 {
        bail!("LRN: X must be [N, C, ...], not of rank {}", shape.len());
    }
    let size = call.attr_i("size", 0)?;
    let size = match usize::try_from(size) {
        Ok(s) if s > 0 && s <= i32::MAX as usize => s,
        _ => bail!("LRN: size must be positive, not {size}"),
    };
    Ok(Plan {
        shape,
        size,
        alpha: call.attr_f("alpha", 1e-4)? as f64,
        beta: call.attr_f("beta", 0.75)? as f64,
        bias: call.attr_f("bias", 1.0)? as f64,
    })
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    Ok(vec![TensorType::new(call.input(0)?.dtype()?, p.shape)])
}

pub fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let x = call.input(0)?.read_vec::<f64>()?;
    let (c_n, inner) = (p.shape[1], p.shape[2..].iter().product::<usize>());
    let (lo, hi) = ((p.size - 1) / 2, p.size / 2); // channels before and after
    let y: Vec<f64> = (0..x.len())
        .map(|i| {
            let (k, c, n) = (i % inner, (i / inner) % c_n, i / (inner * c_n));
            let sq: f64 = (c.saturating_sub(lo)..=(c + hi).min(c_n - 1))
                .map(|cc| {
                    let v = x[(n * c_n + cc) * inner + k];
                    v * v
                })
                .sum();
            x[i] / libm::pow(p.bias + p.alpha / p.size as f64 * sq, p.beta)
        })
        .collect();
    call.output(0)?.write_vec(&y)
}

pub fn dispatch(call: &Call) -> Result<()> {
    use crate::gpu::{kernel_tag, tensor};
    let p = plan(call)?;
    let x = call.input(0)?;
    let tag = kernel_tag(call, x.dtype()?)?;
    let total = x.numel()? as u64;
    if total == 0 {
        return Ok(());
    }
    launch(&Launch {
        kernel: &names::kernel_name("kiln_lrn", &[tag]),
        grid: grid_stride(total),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args: vec![
            tensor(x.handle()),
            tensor(call.output(0)?.handle()),
            KernelArg::U64(total),
            KernelArg::U64(p.shape[1] as u64),
            KernelArg::U64(p.shape[2..].iter().product::<usize>() as u64),
            KernelArg::U32(p.size as u32),
            KernelArg::F64(p.alpha),
            KernelArg::F64(p.beta),
            KernelArg::F64(p.bias),
        ],
    })
}
