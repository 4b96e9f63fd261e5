//! MeanVarianceNormalization-9/13 (ONNX Operators.md, whose function body defines it):
//! `Y = (X − E[X]) / (√(E[X²] − E[X]²) + 1e−9)`, the expectations over `axes` (default
//! `[0, 2, 3]`, negative from the end in opset 13). The reference computes in f64 and rounds once;
//! the CUDA kernel (`kiln_mvn<Tag>`, one block per combination of the kept axes) sums in f64
//! too. A variance that rounds below 0 (a constant slice) counts as 0.

use alloc::vec::Vec;
use kiln_kernel_abi::bail;
use kiln_kernel_abi::guest::*;

use crate::check_float;

/// The input's dims and which of them are reduced.
struct Plan {
    dims: Vec<usize>,
    reduced: Vec<bool>,
}

impl Plan {
    /// Elements per combination of the kept axes, and combinations.
    fn counts(&self) -> (usize, usize) {
        let of =
            |keep: bool| self.dims.iter().zip(&self.reduced).filter(|(_, &r)| r != keep).map(|(&d, _)| d).product();
        (of(false), of(true))
    }

    /// The row-major offset of reduced index `r` within kept index `k`.
    fn offset(&self, mut k: usize, mut r: usize) -> usize {
        let (mut off, mut stride) = (0, 1);
        for (&d, &red) in self.dims.iter().zip(&self.reduced).rev() {
            let i = if red {
                let i = r % d;
                r /= d;
                i
            } else {
                let i = k % d;
                k /= d;
                i
            };
            off += i * stride;
            stride *= d;
        }
        off
    }
}

fn plan(call: &Call) -> Result<Plan> {
    let x = call.input(0)?;
    check_float(call, x.dtype()?)?;
    let dims = x.shape()?;
    let axes = match call.attr("axes") {
        None => alloc::vec![0, 2, 3],
        Some(AttrValue::Ints(v)) => v.clone(),
        Some(_) => bail!("MeanVarianceNormalization: axes must be a list of ints"),
    };
    let mut reduced = alloc::vec![false; dims.len()];
    for &a in &axes {
        let i = shape::normalize_axis(a, dims.len()).map_err(|_| {
            ShimError::Failed(format!("MeanVarianceNormalization: axis {a} is outside rank {}", dims.len()))
        })?;
        if reduced[i] {
            bail!("MeanVarianceNormalization: axis {a} is given twice");
        }
        reduced[i] = true;
    }
    Ok(Plan { dims, reduced })
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    plan(call)?;
    let x = call.input(0)?;
    Ok(vec![TensorType::new(x.dtype()?, x.shape()?)])
}

pub fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let x = call.input(0)?.read_vec::<f64>()?;
    let mut y = alloc::vec![0f64; x.len()];
    let (per, kept) = p.counts();
    for k in 0..kept {
        let (mut s, mut s2) = (0f64, 0f64);
        for r in 0..per {
            let v = x[p.offset(k, r)];
            s += v;
            s2 += v * v;
        }
        let mean = s / per as f64;
        // E[x²] − E[x]² can round below 0 for a constant slice: its deviation is 0.
        let std = libm::sqrt((s2 / per as f64 - mean * mean).max(0.0));
        for r in 0..per {
            let at = p.offset(k, r);
            y[at] = (x[at] - mean) / (std + 1e-9);
        }
    }
    call.output(0)?.write_vec(&y)
}

/// Threads of a `kiln_mvn` block.
const BLOCK: u32 = 256;

pub fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let (per, kept) = p.counts();
    if per * kept == 0 {
        return Ok(());
    }
    if p.dims.len() > 8 {
        kiln_kernel_abi::unsupported!(
            "MeanVarianceNormalization: rank {} (the CUDA kernel takes up to 8)",
            p.dims.len()
        );
    }
    let dtype = call.input(0)?.dtype()?;
    let tag = crate::gpu::kernel_tag(call, dtype)?;
    // Dims right-aligned in eight slots (1 before them, never reduced); bit i of the mask: slot i
    // is reduced.
    let pad = 8 - p.dims.len();
    let mask = p.reduced.iter().enumerate().filter(|(_, &r)| r).fold(0u32, |m, (i, _)| m | 1 << (pad + i));
    let mut args = alloc::vec![
        KernelArg::Tensor { handle: call.input(0)?.handle(), offset: 0 },
        KernelArg::Tensor { handle: call.output(0)?.handle(), offset: 0 },
        KernelArg::U64(kept as u64),
        KernelArg::U64(per as u64),
        KernelArg::U32(mask),
    ];
    args.extend((0..8).map(|i| KernelArg::U64(if i < pad { 1 } else { p.dims[i - pad] as u64 })));
    launch(&Launch {
        kernel: &kiln_kernel_abi::names::kernel_name("kiln_mvn", &[tag]),
        grid: [kept.min(1 << 20) as u32, 1, 1],
        block: [BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args,
    })
}
