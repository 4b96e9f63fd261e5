//! Shim of bias-gelu: com.example::BiasGelu(X [..., C], bias [C]) -> Y [..., C] = Gelu(X + bias)
//! (erf form), float32. `infer` checks the shapes, `cpu` computes in f64 and rounds once,
//! `dispatch` launches cuda/bias_gelu.cu.
#![no_std]
extern crate alloc;

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, export_shim, unsupported};

struct BiasGelu;

/// X's shape and C, after checking the inputs.
fn shapes(call: &Call) -> Result<(Vec<usize>, usize)> {
    if call.num_inputs() != 2 || call.num_outputs() != 1 {
        bail!("BiasGelu: takes X and bias and gives Y");
    }
    let (x, bias) = (call.input(0)?, call.input(1)?);
    for (what, t) in [("X", &x), ("bias", &bias)] {
        let d = t.dtype()?;
        if d != DType::F32 {
            unsupported!("BiasGelu: {what} is {d} (this package handles float32)");
        }
    }
    let shape = x.shape()?;
    let c = *shape.last().unwrap_or(&0);
    if shape.is_empty() || bias.shape()? != [c] {
        bail!("BiasGelu: bias must be [C] for X [..., C]; X is {:?}, bias {:?}", shape, bias.shape()?);
    }
    Ok((shape, c))
}

impl Shim for BiasGelu {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        let (shape, _) = shapes(call)?;
        Ok(vec![TensorType::new(DType::F32, shape)])
    }

    fn cpu(call: &Call) -> Result<()> {
        let (_, c) = shapes(call)?;
        let x: Vec<f32> = call.input(0)?.read_vec()?;
        let bias: Vec<f32> = call.input(1)?.read_vec()?;
        let y: Vec<f32> = x
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let s = v as f64 + bias[i % c] as f64;
                (0.5 * s * (1.0 + libm::erf(s / core::f64::consts::SQRT_2))) as f32
            })
            .collect();
        call.output(0)?.write_vec(&y)
    }

    fn dispatch(call: &Call) -> Result<()> {
        let (shape, c) = shapes(call)?;
        let n: usize = shape.iter().product();
        if n == 0 {
            return Ok(());
        }
        let at = |t: Tensor| KernelArg::Tensor { handle: t.handle(), offset: 0 };
        launch(&Launch {
            kernel: "bias_gelu_f32",
            grid: [(n as u64).div_ceil(256).min(65535) as u32, 1, 1],
            block: [256, 1, 1],
            shared_mem_bytes: 0,
            args: vec![
                at(call.input(0)?),
                at(call.input(1)?),
                at(call.output(0)?),
                KernelArg::U64(n as u64),
                KernelArg::U64(c as u64),
            ],
        })
    }
}

export_shim!(BiasGelu);
