//! `ai.kiln::SwiGlu`: y = SiLU(gate)·up = gate·sigmoid(gate)·up (Shazeer 2020, "GLU Variants
//! Improve Transformer"), the activation of gated MLPs.
//!
//! - `SwiGlu(gate [..., N], up [..., N])` → y [..., N] (same shapes, no broadcasting);
//! - `SwiGlu(packed [..., 2N])` → y [..., N]: each row holds the gate, then the up half (the
//!   output of one GEMM over [Wg | Wu], which the `gate-up-swiglu` fusion makes).
//!
//! dtypes f32, f16, bf16, f64. The CPU reference computes in f64 and rounds once, except for
//! f32, which it computes in f32 as the CUDA kernel does (the f64 exponential made it an LLM
//! decode step's costliest elementwise op on the CPU); the CUDA kernel computes in f32 (f64 for
//! f64).

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, unsupported, with_dtype};

/// The layout of one call: output shape, row width N, and the element distance between a
/// row's first gate and first up element (`up_off`) and between rows of the inputs (`ld`).
struct Layout {
    out: Vec<usize>,
    n: usize,
    ld: usize,
    up_off: usize,
    packed: bool,
}

fn layout(call: &Call) -> Result<Layout> {
    let gate = call.input(0)?;
    let shape = gate.shape()?;
    let Some(&last) = shape.last() else { bail!("SwiGlu: input 0 must have rank ≥ 1, not a scalar") };
    match call.input_opt(1) {
        None => {
            if last % 2 != 0 {
                bail!("SwiGlu: a packed input's last dimension must be even (gate, then up), not {last}");
            }
            let mut out = shape.clone();
            let n = last / 2;
            *out.last_mut().unwrap_or(&mut 0) = n;
            Ok(Layout { out, n, ld: last, up_off: n, packed: true })
        }
        Some(up) => {
            if up.dtype()? != gate.dtype()? {
                bail!("SwiGlu: gate is {} but up is {}", gate.dtype()?, up.dtype()?);
            }
            if up.shape()? != shape {
                bail!("SwiGlu: gate {:?} and up {:?} must have the same shape", shape, up.shape()?);
            }
            Ok(Layout { out: shape, n: last, ld: last, up_off: 0, packed: false })
        }
    }
}

/// [`silu_mul`] in f32: g / (1 + e^−g) · u, branch-free so that its loop vectorizes (e^−g
/// saturates at e^88 for g below −88, where SiLU(g) is below 1e−36 either way).
#[inline]
fn silu_mul_f32(g: f32, u: f32) -> f32 {
    g / (1.0 + kiln_kernel_abi::math::exp_f32(-g)) * u
}

fn silu_mul(g: f64, u: f64) -> f64 {
    // sigmoid as Sigmoid's reference computes it (no overflow for large |g|).
    let s = if g >= 0.0 {
        1.0 / (1.0 + libm::exp(-g))
    } else {
        let e = libm::exp(g);
        e / (1.0 + e)
    };
    g * s * u
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let l = layout(call)?;
    Ok(alloc::vec![TensorType::new(call.input(0)?.dtype()?, l.out)])
}

pub fn cpu(call: &Call) -> Result<()> {
    let l = layout(call)?;
    let dtype = call.input(0)?.dtype()?;
    let size = dtype.size().unwrap_or(1);
    // This call's rows: all of them, or a tile's (manifest `cpu_tiles = "rows"`).
    let all_rows = l.out.iter().product::<usize>().checked_div(l.n).unwrap_or(0);
    let tile = call.tile_units(all_rows)?;
    let read = |t: Tensor| t.read_bytes_range(tile.start * l.ld * size, tile.len() * l.ld * size);
    let gate = read(call.input(0)?)?;
    let up = if l.packed { None } else { Some(read(call.input(1)?)?) };
    let rows = tile.len();
    let at = (tile.start * l.n * size) as u64;
    if dtype == DType::F32 {
        let g = element::decode::<f32>(&gate);
        let u = match &up {
            Some(b) => element::decode::<f32>(b),
            None => Vec::new(),
        };
        let mut y = Vec::with_capacity(rows * l.n);
        for r in 0..rows {
            let gr = &g[r * l.ld..][..l.n];
            let ur = if l.packed { &g[r * l.ld + l.up_off..][..l.n] } else { &u[r * l.ld..][..l.n] };
            y.extend(gr.iter().zip(ur).map(|(&gv, &uv)| silu_mul_f32(gv, uv)));
        }
        return call.output(0)?.write_bytes_at(at, &element::encode(&y));
    }
    let out = with_dtype!(dtype, T => {
        let g = element::decode::<T>(&gate);
        let u = match &up { Some(b) => element::decode::<T>(b), None => Vec::new() };
        let mut y = Vec::with_capacity(rows * l.n);
        for r in 0..rows {
            for c in 0..l.n {
                let gv = g[r * l.ld + c].to_f64();
                let uv = if l.packed { g[r * l.ld + l.up_off + c].to_f64() } else { u[r * l.ld + c].to_f64() };
                y.push(T::from_f64(silu_mul(gv, uv)));
            }
        }
        Ok::<Vec<u8>, ShimError>(element::encode(&y))
    })?;
    call.output(0)?.write_bytes_at(at, &out)
}

pub fn dispatch(call: &Call) -> Result<()> {
    let l = layout(call)?;
    let gate = call.input(0)?;
    let dtype = gate.dtype()?;
    let Some(kernel) = crate::instance("kiln_swiglu", dtype, DType::is_float) else {
        unsupported!("SwiGlu: no CUDA kernel for {dtype}")
    };
    let total: usize = l.out.iter().product();
    if total == 0 {
        return Ok(());
    }
    let up = if l.packed { gate.handle() } else { call.input(1)?.handle() };
    launch(&Launch {
        kernel: &kernel,
        grid: [crate::grid_for(total as u64, 1), 1, 1],
        block: [crate::BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args: alloc::vec![
            KernelArg::Tensor { handle: gate.handle(), offset: 0 },
            KernelArg::Tensor { handle: up, offset: 0 },
            KernelArg::Tensor { handle: call.output(0)?.handle(), offset: 0 },
            KernelArg::U64(total as u64),
            KernelArg::U64(l.n as u64),
            KernelArg::U64(l.ld as u64),
            KernelArg::U64(l.up_off as u64),
        ],
    })
}
