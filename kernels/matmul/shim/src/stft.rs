//! STFT-17 (ONNX Operators.md and its reference): `signal` [B, L, 1 | 2] (real, or complex as
//! (re, im)), scalar `frame_step`, optional `window` [W] and scalar `frame_length` (default W,
//! else L) → [B, frames, bins, 2], frames = 1 + ⌊(L − frame_length) / frame_step⌋, bins =
//! frame_length / 2 + 1 when `onesided` (default 1), else frame_length. Frame f is the signal
//! from f·frame_step, multiplied by the window (1s without one), and transformed:
//! X[k] = Σₘ x[m]·w[m]·e^(−2πi·k·m / frame_length). frame_step and frame_length are value
//! inputs. The CPU reference and the CUDA kernel `kiln_stft<Tag>` (one thread per output value,
//! re or im) sum in f64, each twiddle from (k·m mod n).

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, unsupported};

struct Plan {
    dtype: DType,
    batch: usize,
    len: usize,
    complex: bool,
    step: usize,
    n: usize,
    frames: usize,
    bins: usize,
}

fn scalar(call: &Call, i: usize, what: &str) -> Result<Option<i64>> {
    match call.input_opt(i) {
        None => Ok(None),
        Some(t) => match t.read_i64s()?[..] {
            [v] => Ok(Some(v)),
            ref v => bail!("STFT: {what} must be one value, not {}", v.len()),
        },
    }
}

fn plan(call: &Call) -> Result<Plan> {
    let x = call.input(0)?;
    let dtype = x.dtype()?;
    if !dtype.is_float() {
        unsupported!("STFT: dtype {dtype} is not supported (floating-point only)");
    }
    let shape = x.shape()?;
    let (batch, len, complex) = match shape[..] {
        [b, l, 1] => (b, l, false),
        [b, l, 2] => (b, l, true),
        _ => bail!("STFT: signal must be [batch, length, 1 or 2], not {shape:?}"),
    };
    if let Some(w) = call.input_opt(2) {
        if w.dtype()? != dtype {
            bail!("STFT: window is {} but signal is {dtype}", w.dtype()?);
        }
    }
    let window = call.input_opt(2).map(|w| w.shape()).transpose()?;
    let n = match (scalar(call, 3, "frame_length")?, &window) {
        (Some(n), _) => n,
        (None, Some(w)) if w.len() == 1 => w[0] as i64,
        (None, Some(w)) => bail!("STFT: window must be 1-D, not {w:?}"),
        (None, None) => len as i64,
    };
    if let Some(w) = &window {
        if w[..] != [n as usize] {
            bail!("STFT: window {w:?} must have frame_length {n} values");
        }
    }
    let step = scalar(call, 1, "frame_step")?.unwrap_or(0);
    let (Ok(step), Ok(n)) = (usize::try_from(step), usize::try_from(n)) else {
        bail!("STFT: frame_step {step} must be positive and frame_length {n} within 1..={len}");
    };
    if step < 1 || n < 1 || n > len {
        bail!("STFT: frame_step {step} must be positive and frame_length {n} within 1..={len}");
    }
    let onesided = call.attr_i("onesided", 1)? != 0;
    Ok(Plan {
        dtype,
        batch,
        len,
        complex,
        step,
        n,
        frames: 1 + (len - n) / step,
        bins: if onesided { n / 2 + 1 } else { n },
    })
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    Ok(alloc::vec![TensorType::new(p.dtype, alloc::vec![p.batch, p.frames, p.bins, 2])])
}

pub fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let x = call.input(0)?.read_vec::<f64>()?;
    let w = match call.input_opt(2) {
        Some(t) => t.read_vec::<f64>()?,
        None => alloc::vec![1.0; p.n],
    };
    let c = if p.complex { 2 } else { 1 };
    let pi2 = 2.0 * core::f64::consts::PI;
    let mut y = Vec::with_capacity(p.batch * p.frames * p.bins * 2);
    for b in 0..p.batch {
        for f in 0..p.frames {
            for k in 0..p.bins {
                let (mut re, mut im) = (0.0, 0.0);
                for (m, &wm) in w.iter().enumerate() {
                    let at = (b * p.len + f * p.step + m) * c;
                    let (xr, xi) = (x[at] * wm, if p.complex { x[at + 1] * wm } else { 0.0 });
                    let a = -pi2 * ((k * m) % p.n) as f64 / p.n as f64;
                    let (s, co) = (libm::sin(a), libm::cos(a));
                    re += xr * co - xi * s;
                    im += xr * s + xi * co;
                }
                y.extend([re, im]);
            }
        }
    }
    call.output(0)?.write_vec(&y)
}

pub fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let total = (p.batch * p.frames * p.bins * 2) as u64;
    if total == 0 {
        return Ok(());
    }
    let Some(tag) = p.dtype.cuda_tag() else { unsupported!("STFT: no CUDA kernel for {}", p.dtype) };
    let x = call.input(0)?.handle();
    let w = call.input_opt(2).map(|t| t.handle());
    launch(&Launch {
        kernel: &kernel_name("kiln_stft", &[tag]),
        grid: grid_stride(total),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args: alloc::vec![
            KernelArg::Tensor { handle: x, offset: 0 },
            KernelArg::Tensor { handle: w.unwrap_or(x), offset: 0 },
            KernelArg::Tensor { handle: call.output(0)?.handle(), offset: 0 },
            KernelArg::U64(total),
            KernelArg::U64(p.len as u64),
            KernelArg::U64(p.step as u64),
            KernelArg::U64(p.n as u64),
            KernelArg::U64(p.frames as u64),
            KernelArg::U64(p.bins as u64),
            KernelArg::U32(p.complex as u32),
            KernelArg::U32(w.is_some() as u32),
        ],
    })
}
