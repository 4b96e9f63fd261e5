//! ConvInteger-10 and QLinearConv-10 (ONNX Operators.md and its reference): Conv's geometry over
//! uint8 or int8 `x` and `w` with zero points (a scalar for X; a scalar or one per output channel
//! for W), the products summed exactly as integers. ConvInteger outputs the int32 sums.
//! QLinearConv adds its int32 `B`, multiplies by `x_scale·w_scale[m] / y_scale` (float32, as
//! the reference computes the factor), adds `y_zero_point`, saturates to its type and rounds half
//! to even. Padding contributes zero (the zero point's value, after subtraction).
//!
//! Both widen `x − x_zero_point` and `w − w_zero_point` to f64 (exact) and run the float64
//! convolution (the CPU reference's loop, or `kiln_conv<kiln_tag_f64>` on the GPU between
//! `kiln_qconv_widen` and `kiln_qconv_narrow`): sums of products of 8-bit values stay exact in
//! f64.

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, unsupported};

use crate::Geom;

/// An 8-bit tensor's values as f64, less `zero` (broadcast: value i takes zero[(i / inner) %
/// zero.len()]).
fn widen(bytes: &[u8], signed: bool, zero: &[f64], inner: usize) -> Vec<f64> {
    bytes
        .iter()
        .enumerate()
        .map(|(i, &b)| (if signed { b as i8 as f64 } else { b as f64 }) - zero[(i / inner) % zero.len()])
        .collect()
}

/// The zero point at input `i` as f64 values (absent: [0]); its type must be `dtype`.
fn zeros(call: &Call, i: usize, dtype: DType, counts: &[usize]) -> Result<Vec<f64>> {
    let op = call.op_type();
    let Some(t) = call.input_opt(i) else { return Ok(alloc::vec![0.0]) };
    if t.dtype()? != dtype {
        bail!("{op}: the zero point (input {i}) is {} but its tensor is {dtype}", t.dtype()?);
    }
    let v = widen(&t.value_bytes()?, dtype == DType::I8, &[0.0], 1);
    if !counts.contains(&v.len()) {
        bail!("{op}: the zero point (input {i}) has {} values, not {counts:?}", v.len());
    }
    Ok(v)
}

/// A float32 scale at input `i`: one value or one per output channel when `per_channel`.
fn scales(call: &Call, i: usize, counts: &[usize]) -> Result<Vec<f32>> {
    let t = call.input(i)?;
    if t.dtype()? != DType::F32 {
        bail!("QLinearConv: the scale (input {i}) must be float32, not {}", t.dtype()?);
    }
    let v = element::decode::<f32>(&t.value_bytes()?);
    if !counts.contains(&v.len()) {
        bail!("QLinearConv: the scale (input {i}) has {} values, not {counts:?}", v.len());
    }
    Ok(v)
}

/// Where X, W, their zero points and (QLinearConv) the scales, the output's zero point and B are.
struct Inputs {
    w: usize,
    x_zero: usize,
    w_zero: usize,
}

fn inputs(op: &str) -> Inputs {
    if op == "QLinearConv" {
        Inputs { w: 3, x_zero: 2, w_zero: 5 }
    } else {
        Inputs { w: 1, x_zero: 2, w_zero: 3 }
    }
}

/// QLinearConv's requantisation of sum `v` of output channel `m`.
struct Requant {
    factor: Vec<f32>,
    y_zero: f64,
    lo: f64,
    hi: f64,
}

impl Requant {
    fn of(call: &Call, m_count: usize) -> Result<Requant> {
        let (xs, ws, ys) = (scales(call, 1, &[1])?, scales(call, 4, &[1, m_count])?, scales(call, 6, &[1])?);
        let y_zero = call.input(7)?;
        let signed = match y_zero.dtype()? {
            DType::I8 => true,
            DType::U8 => false,
            d => bail!("QLinearConv: y_zero_point must be uint8 or int8, not {d}"),
        };
        let z = widen(&y_zero.value_bytes()?, signed, &[0.0], 1);
        let &[y_zero] = &z[..] else { bail!("QLinearConv: y_zero_point must be one value") };
        let (lo, hi) = if signed { (-128.0, 127.0) } else { (0.0, 255.0) };
        Ok(Requant { factor: ws.iter().map(|&w| xs[0] * w / ys[0]).collect(), y_zero, lo, hi })
    }

    fn apply(&self, v: f64, m: usize) -> f64 {
        let r = (v * self.factor[m % self.factor.len()] as f64 + self.y_zero).clamp(self.lo, self.hi);
        // Half to even, as numpy's round.
        let f = libm::floor(r);
        match r - f {
            d if d > 0.5 => f + 1.0,
            d if d < 0.5 => f,
            _ if f % 2.0 == 0.0 => f,
            _ => f + 1.0,
        }
    }
}

/// QLinearConv's optional int32 `B` [M] (input 8). Errors: another dtype or shape.
fn bias_of<'c, 'a>(call: &'c Call<'a>, g: &Geom) -> Result<Option<Tensor<'c, 'a>>> {
    let Some(b) = call.input_opt(8).filter(|_| call.op_type() == "QLinearConv") else { return Ok(None) };
    if b.dtype()? != DType::I32 || b.shape()? != [g.out_ch] {
        bail!("QLinearConv: B must be int32 [{}], not {} {:?}", g.out_ch, b.dtype()?, b.shape()?);
    }
    Ok(Some(b))
}

pub fn infer(call: &Call, g: &Geom) -> Result<Vec<TensorType>> {
    let dtype = match call.op_type() {
        "QLinearConv" => call.input(7)?.dtype()?,
        _ => DType::I32,
    };
    Ok(alloc::vec![TensorType::new(dtype, g.out_shape())])
}

/// W's elements per output channel.
fn per_channel(g: &Geom) -> usize {
    g.in_ch / g.group * g.kernel.iter().product::<usize>()
}

pub fn cpu(call: &Call, g: &Geom) -> Result<()> {
    let op = call.op_type();
    let at = inputs(op);
    let (x, w) = (call.input(0)?, call.input(at.w)?);
    if op == "QLinearConv" {
        // Checked before the sums, as on the GPU.
        Requant::of(call, g.out_ch)?;
    }
    let xz = zeros(call, at.x_zero, x.dtype()?, &[1])?;
    let wz = zeros(call, at.w_zero, w.dtype()?, &[1, g.out_ch])?;
    let xv = widen(&x.read_bytes()?, x.dtype()? == DType::I8, &xz, 1);
    let wv = widen(&w.read_bytes()?, w.dtype()? == DType::I8, &wz, per_channel(g));
    let bias = match bias_of(call, g)? {
        Some(b) => Some(b.read_vec::<i32>()?.iter().map(|&v| v as f64).collect::<Vec<_>>()),
        None => None,
    };
    let y = g.run_cpu(&xv, &wv, bias.as_deref());
    if op == "ConvInteger" {
        return call.output(0)?.write_vec(&y.iter().map(|&v| v as i32).collect::<Vec<_>>());
    }
    let rq = Requant::of(call, g.out_ch)?;
    let spatial: usize = g.output.iter().product();
    let q: Vec<f64> = y.iter().enumerate().map(|(i, &v)| rq.apply(v, (i / spatial.max(1)) % g.out_ch)).collect();
    call.output(0)?.write_vec(&q)
}

pub fn dispatch(call: &Call, g: &Geom) -> Result<()> {
    let op = call.op_type();
    if g.input.len() > crate::GPU_MAX_SPATIAL {
        unsupported!("{op}: {} spatial axes (the CUDA kernels take up to {})", g.input.len(), crate::GPU_MAX_SPATIAL);
    }
    let total = g.out_shape().iter().product::<usize>() as u64;
    if total == 0 {
        return Ok(());
    }
    let at = inputs(op);
    let (x, w) = (call.input(0)?, call.input(at.w)?);
    let t = KernelArg::tensor;
    // X and W less their zero points, as f64, in scratch (an absent zero point: X's own first
    // element with the flag off).
    let widen_into = |src: &Tensor, zero: Option<Tensor>, zero_count: usize, inner: usize| -> Result<u32> {
        let n = src.numel()? as u64;
        let dst = scratch(n.max(1) * 8)?;
        if n > 0 {
            launch(&Launch {
                kernel: "kiln_qconv_widen",
                grid: grid_stride(n),
                block: [GRID_STRIDE_BLOCK, 1, 1],
                shared_mem_bytes: 0,
                args: alloc::vec![
                    t(src.handle()),
                    t(zero.as_ref().map_or(src.handle(), |z| z.handle())),
                    t(dst),
                    KernelArg::U64(n),
                    KernelArg::U32((src.dtype()? == DType::I8) as u32),
                    KernelArg::U32(zero.is_some() as u32),
                    KernelArg::U64(zero_count as u64),
                    KernelArg::U64(inner as u64),
                ],
            })?;
        }
        Ok(dst)
    };
    // The zero points' counts are checked as the CPU reference does.
    let xz = call.input_opt(at.x_zero);
    zeros(call, at.x_zero, x.dtype()?, &[1])?;
    let wz_count = zeros(call, at.w_zero, w.dtype()?, &[1, g.out_ch])?.len();
    let xs = widen_into(&x, xz, 1, 1)?;
    let ws = widen_into(&w, call.input_opt(at.w_zero), wz_count, per_channel(g))?;
    let sums = scratch(total * 8)?;
    g.launch_direct("kiln_tag_f64", xs, ws, None, None, sums)?;
    // ConvInteger: mode 0; QLinearConv: 1, or 2 with B; its scales (inputs 1, 4, 6) on the device.
    let (mode, bias, scales, y_zero, signed, factors) = match op {
        "QLinearConv" => {
            let rq = Requant::of(call, g.out_ch)?;
            let bias = bias_of(call, g)?.map(|b| b.handle());
            let s = [call.input(1)?.handle(), call.input(4)?.handle(), call.input(6)?.handle()];
            (1 + bias.is_some() as u32, bias, s, rq.y_zero, rq.lo < 0.0, rq.factor.len())
        }
        _ => (0, None, [sums; 3], 0.0, false, 1),
    };
    launch(&Launch {
        kernel: "kiln_qconv_narrow",
        grid: grid_stride(total),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args: alloc::vec![
            t(sums),
            t(bias.unwrap_or(sums)),
            t(scales[0]),
            t(scales[1]),
            t(scales[2]),
            t(call.output(0)?.handle()),
            KernelArg::U64(total),
            KernelArg::U64(g.output.iter().product::<usize>() as u64),
            KernelArg::U64(g.out_ch as u64),
            KernelArg::U64(factors as u64),
            KernelArg::F64(y_zero),
            KernelArg::U32(mode),
            KernelArg::U32(signed as u32),
        ],
    })
}
