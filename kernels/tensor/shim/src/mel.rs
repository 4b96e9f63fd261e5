//! MelWeightMatrix-17 (ONNX Operators.md and its reference): the [dft_length / 2 + 1,
//! num_mel_bins] matrix that maps a onesided spectrum to mel bins. The mel scale
//! m(f) = 2595·log10(1 + f/700) is split between `lower_edge_hertz` and `upper_edge_hertz` into
//! num_mel_bins + 2 equal steps (the reference divides by the count of points, not the gaps);
//! each point back in hertz is the spectrum bin ⌊(dft_length + 1)·f / sample_rate⌋. Mel bin i is
//! a triangle over spectrum bins b(i) ..= b(i + 2): rising (j − b(i)) / (b(i+1) − b(i)), falling
//! (b(i+2) − j) / (b(i+2) − b(i+1)), 1 at b(i+1). The integer inputs (int32 or int64) and the edge
//! frequencies (float32) are value inputs; the mel edges in f32 as the reference computes them,
//! the points in f64. Output type `output_datatype` (default float32): float types here.

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, unsupported};

use crate::gpu::launch_elems;

struct Plan {
    mel_bins: usize,
    spec_bins: usize,
    dft_length: f64,
    sample_rate: f64,
    low_mel: f64,
    step: f64,
    dtype: DType,
}

fn scalar_f32(call: &Call, i: usize) -> Result<f32> {
    let t = call.input(i)?;
    match (t.dtype()?, &t.value_f32s()?[..]) {
        (DType::F32, &[v]) => Ok(v),
        (d, v) => bail!("MelWeightMatrix: input {i} must be one float32 value, not {d} of {} values", v.len()),
    }
}

fn plan(call: &Call) -> Result<Plan> {
    let int = |i: usize| -> Result<i64> {
        match call.input(i)?.read_i64s()?[..] {
            [v] => Ok(v),
            ref v => bail!("MelWeightMatrix: input {i} must be one value, not {}", v.len()),
        }
    };
    let (mel_bins, dft_length, sample_rate) = (int(0)?, int(1)?, int(2)?);
    if mel_bins < 1 || dft_length < 1 || sample_rate < 1 {
        bail!("MelWeightMatrix: num_mel_bins {mel_bins}, dft_length {dft_length} and sample_rate {sample_rate} must be positive");
    }
    // Sizes the shim's 32-bit usize holds, the output's element count included.
    let (mel_bins, spec_bins) = match (usize::try_from(mel_bins), usize::try_from(dft_length / 2 + 1)) {
        (Ok(m), Ok(s)) if m.checked_mul(s).is_some() => (m, s),
        _ => bail!("MelWeightMatrix: a [{}, {mel_bins}] output is too large", dft_length / 2 + 1),
    };
    let (lo, hi) = (scalar_f32(call, 3)?, scalar_f32(call, 4)?);
    let code = call.attr_i("output_datatype", 1)?;
    let dtype = match i32::try_from(code).ok().and_then(DType::from_code) {
        Some(d @ (DType::F32 | DType::F16 | DType::BF16 | DType::F64)) => d,
        _ => unsupported!(
            "MelWeightMatrix: output_datatype {code}; float32, float16, bfloat16 and float64 are supported"
        ),
    };
    let mel = |f: f32| 2595.0f32 * libm::log10f(1.0 + f / 700.0);
    let (low, high) = (mel(lo), mel(hi));
    let step = (high - low) / (mel_bins + 2) as f32;
    Ok(Plan {
        mel_bins,
        spec_bins,
        dft_length: dft_length as f64,
        sample_rate: sample_rate as f64,
        low_mel: low as f64,
        step: step as f64,
        dtype,
    })
}

impl Plan {
    /// The spectrum bin of mel point `i`.
    fn point(&self, i: usize) -> i64 {
        let hz = 700.0 * (libm::pow(10.0, (i as f64 * self.step + self.low_mel) / 2595.0) - 1.0);
        libm::floor((self.dft_length + 1.0) * hz / self.sample_rate) as i64
    }
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    Ok(vec![TensorType::new(p.dtype, vec![p.spec_bins, p.mel_bins])])
}

pub fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let mut y = vec![0f64; p.spec_bins * p.mel_bins];
    for i in 0..p.mel_bins {
        let (lo, c, hi) = (p.point(i), p.point(i + 1), p.point(i + 2));
        for j in 0..p.spec_bins as i64 {
            let mut v = 0.0;
            if lo == c {
                if j == c {
                    v = 1.0;
                }
            } else if lo <= j && j <= c {
                v = (j - lo) as f64 / (c - lo) as f64;
            }
            if hi > c && c <= j && j < hi {
                v = (hi - j) as f64 / (hi - c) as f64;
            }
            y[j as usize * p.mel_bins + i] = v;
        }
    }
    call.output(0)?.write_vec(&y)
}

pub fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let Some(tag) = p.dtype.cuda_tag() else { unsupported!("MelWeightMatrix: no CUDA kernel for {}", p.dtype) };
    let args = vec![
        KernelArg::Tensor { handle: call.output(0)?.handle(), offset: 0 },
        KernelArg::U64(p.spec_bins as u64),
        KernelArg::U64(p.mel_bins as u64),
        KernelArg::F64(p.low_mel),
        KernelArg::F64(p.step),
        KernelArg::F64(p.dft_length),
        KernelArg::F64(p.sample_rate),
    ];
    launch_elems(&kernel_name("kiln_tensor_mel", &[tag]), (p.spec_bins * p.mel_bins) as u64, args)
}
