//! DFT (17, 19, 20), after ONNX Operators.md: the discrete Fourier transform of `input`
//! [..., n, ..., 1 | 2] (the last axis holds a real value, or a complex one as (re, im)) along
//! `axis` (an attribute up to opset 19, default 1; from 20 the optional scalar input 2, default
//! −2; never the last axis), over `dft_length` (optional scalar input 1; the signal zero-padded
//! or cut to it, default its length n): X[k] = Σₘ x[m]·e^(∓2πi·k·m / n), with + and a factor
//! 1/n when `inverse`; `onesided` keeps the first n/2 + 1 frequencies of a real signal. The
//! output has the input's shape with that axis the output length and a last axis of 2.
//!
//! The CPU reference sums in f64; the CUDA kernel `kiln_dft<Tag>` runs one thread per output
//! value (re or im) and sums in f64 too, each twiddle from (k·m mod n) so that long signals keep
//! their precision.
use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, unsupported};

const OP: &str = "DFT";

struct Plan {
    dtype: DType,
    /// The input seen as [outer, n_in, inner, complex (1 or 2)].
    outer: usize,
    n_in: usize,
    inner: usize,
    complex: bool,
    /// The transform length and the output's length along the axis.
    n: usize,
    n_out: usize,
    inverse: bool,
    out_shape: Vec<usize>,
}

fn scalar(t: Option<Tensor>) -> Result<Option<i64>> {
    let Some(t) = t else { return Ok(None) };
    match t.read_i64s()?[..] {
        [v] => Ok(Some(v)),
        _ => bail!("{OP}: dft_length and axis are scalars, not {:?}", t.shape()?),
    }
}

fn plan(call: &Call) -> Result<Plan> {
    let x = call.input(0)?;
    let dtype = x.dtype()?;
    if !dtype.is_float() {
        unsupported!("{OP}: {dtype} input; float types are supported");
    }
    let s = x.shape()?;
    let r = s.len() as i64;
    if r < 2 || !matches!(s[s.len() - 1], 1 | 2) {
        bail!("{OP}: the input {s:?} needs a last axis of 1 (real) or 2 (complex)");
    }
    let axis = if call.opset() >= 20 { scalar(call.input_opt(2))?.unwrap_or(-2) } else { call.attr_i("axis", 1)? };
    let a = if axis < 0 { axis + r } else { axis };
    if !(0..r - 1).contains(&a) {
        bail!("{OP}: axis {axis} is not a signal axis of an input of rank {r}");
    }
    let a = a as usize;
    let n_in = s[a];
    let n = match scalar(call.input_opt(1))? {
        None => n_in,
        Some(l) if l > 0 && l <= u32::MAX as i64 => l as usize,
        Some(l) => bail!("{OP}: dft_length {l} must be positive and fit 32 bits"),
    };
    if n == 0 {
        bail!("{OP}: the signal axis of {s:?} is empty and no dft_length is given");
    }
    let complex = s[s.len() - 1] == 2;
    let onesided = call.attr_i("onesided", 0)? != 0;
    if onesided && complex {
        bail!("{OP}: onesided takes a real signal (a last axis of 1)");
    }
    let inverse = call.attr_i("inverse", 0)? != 0;
    if onesided && inverse {
        unsupported!("{OP}: an inverse onesided transform");
    }
    let n_out = if onesided { n / 2 + 1 } else { n };
    let mut out_shape = s.clone();
    out_shape[a] = n_out;
    let last = out_shape.len() - 1; // rank ≥ 2, checked above
    out_shape[last] = 2;
    shape::numel(&out_shape)?;
    Ok(Plan {
        dtype,
        outer: s[..a].iter().product(),
        n_in,
        inner: s[a + 1..s.len() - 1].iter().product(),
        complex,
        n,
        n_out,
        inverse,
        out_shape,
    })
}

pub(crate) fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    Ok(alloc::vec![TensorType::new(p.dtype, p.out_shape)])
}

pub(crate) fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let x = call.input(0)?.read_vec::<f64>()?;
    let c = if p.complex { 2 } else { 1 };
    let sign = if p.inverse { 1.0 } else { -1.0 };
    let scale = if p.inverse { 1.0 / p.n as f64 } else { 1.0 };
    let mut y = alloc::vec![0.0; p.outer * p.n_out * p.inner * 2];
    for o in 0..p.outer {
        for k in 0..p.n_out {
            for i in 0..p.inner {
                let (mut re, mut im) = (0.0, 0.0);
                for m in 0..p.n.min(p.n_in) {
                    let at = ((o * p.n_in + m) * p.inner + i) * c;
                    let (xr, xi) = (x[at], if p.complex { x[at + 1] } else { 0.0 });
                    let ang =
                        sign * 2.0 * core::f64::consts::PI * ((k as u64 * m as u64) % p.n as u64) as f64 / p.n as f64;
                    let (sn, cs) = (libm::sin(ang), libm::cos(ang));
                    re += xr * cs - xi * sn;
                    im += xr * sn + xi * cs;
                }
                let at = ((o * p.n_out + k) * p.inner + i) * 2;
                y[at] = re * scale;
                y[at + 1] = im * scale;
            }
        }
    }
    call.output(0)?.write_vec(&y)
}

pub(crate) fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let Some(tag) = p.dtype.cuda_tag() else { unsupported!("{OP}: no CUDA kernel for {}", p.dtype) };
    let y = call.output(0)?;
    let total = y.numel()? as u64;
    if total == 0 {
        return Ok(());
    }
    let u = |v: usize| KernelArg::U64(v as u64);
    launch(&Launch {
        kernel: &kernel_name("kiln_dft", &[tag]),
        grid: grid_stride(total),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args: alloc::vec![
            KernelArg::Tensor { handle: call.input(0)?.handle(), offset: 0 },
            KernelArg::Tensor { handle: y.handle(), offset: 0 },
            KernelArg::U64(total),
            u(p.n_in),
            u(p.inner),
            u(p.n),
            u(p.n_out),
            KernelArg::U32(p.complex as u32),
            KernelArg::U32(p.inverse as u32),
        ],
    })
}
