//! Resize (10, 11, 13, 18, 19) and Upsample (7, 9), after ONNX Operators.md and the reference
//! implementation's `_interpolate_1d_with_x` (whose N-D form is a 1-D resampling per axis, the
//! innermost first).
//!
//! Inputs: `X`; Resize from 11 `roi` (1), `scales` (2), `sizes` (3) — one of scales and sizes,
//! the other absent or empty; Resize-10 and Upsample-9 `scales` (1); Upsample-7 the `scales`
//! attribute. From 18, `axes` names the axes that scales, sizes and roi cover (the others keep
//! their size), and `keep_aspect_ratio_policy` (`stretch`, `not_larger`, `not_smaller`) makes
//! sizes one scale for every named axis.
//!
//! Per axis of input length W, scale s (given, or out / W from sizes) and output length O
//! (floor(s·W) from scales, or sizes), output index x maps to an input coordinate c by
//! `coordinate_transformation_mode`: `half_pixel` (x + ½)/s − ½; `half_pixel_symmetric` the same
//! shifted by W/2·(1 − O/(s·W)); `pytorch_half_pixel` as half_pixel, −½ when s·W = 1;
//! `align_corners` x·(W − 1)/(s·W − 1), 0 when s·W = 1; `asymmetric` x/s;
//! `tf_crop_and_resize` roi_start·(W − 1) + x·(roi_end − roi_start)·(W − 1)/(s·W − 1), and a
//! coordinate outside [0, W − 1] gives `extrapolation_value`. Resize-10 and Upsample are
//! asymmetric.
//!
//! With c in (i0, i0 + 1] and ratio r = c − i0 (1 when c is an integer), the taps are input
//! indices i0 − n/2 + 1 + k, k < n, clamped to [0, W − 1] (edge padding):
//! * `nearest` (n = 2): tap 1 when r = 1, else by `nearest_mode`: `round_prefer_floor` tap 1
//!   when r > ½, `round_prefer_ceil` when r ≥ ½, `floor` tap 0, `ceil` tap 1. Resize-10 and
//!   Upsample round down when upsampling and up when downsampling (onnxruntime's rule there).
//! * `linear` (n = 2): 1 − r, r. `cubic` (n = 4): Keys' kernel with a = `cubic_coeff_a` at
//!   distances 1 + r, r, 1 − r, 2 − r.
//! * `antialias` = 1 (linear, cubic): the kernel stretched by 1/min(s, 1) (n grows with it),
//!   weights normalised to sum 1.
//! * `exclude_outside` = 1: taps outside [0, W) weigh 0, the rest renormalised.
use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, unsupported};

/// Interpolation (`mode`): the CUDA kernel's RS_* codes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Nearest = 0,
    Linear = 1,
    Cubic = 2,
}

/// `coordinate_transformation_mode`: the CUDA kernel's codes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Coord {
    HalfPixel = 0,
    HalfPixelSymmetric = 1,
    PytorchHalfPixel = 2,
    AlignCorners = 3,
    Asymmetric = 4,
    TfCropAndResize = 5,
}

/// `nearest_mode`, and Resize-10's and Upsample's rule (`Simple`): the CUDA kernel's codes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Nearest {
    RoundPreferFloor = 0,
    RoundPreferCeil = 1,
    Floor = 2,
    Ceil = 3,
    Simple = 4,
}

/// One resampled axis.
struct Axis {
    axis: usize,
    in_len: usize,
    out_len: usize,
    scale: f64,
    roi: (f64, f64),
}

/// A Resize or Upsample node: the axes it resamples (innermost first), and how.
struct Plan {
    dtype: DType,
    shape: Vec<usize>,
    out_shape: Vec<usize>,
    passes: Vec<Axis>,
    mode: Mode,
    coord: Coord,
    nearest: Nearest,
    antialias: bool,
    exclude: bool,
    cubic_a: f64,
    extrapolation: f64,
}

/// A value input's elements as f64 (its inline bytes, or read in a CPU call); `None` when the
/// input is absent or empty.
fn values(t: Option<Tensor>) -> Result<Option<Vec<f64>>> {
    let Some(t) = t else { return Ok(None) };
    let bytes = match t.value() {
        Some(v) => Vec::from(v),
        None => t.read_bytes()?,
    };
    let v = element::decode_as::<f64>(t.dtype()?, &bytes)?;
    Ok(if v.is_empty() { None } else { Some(v) })
}

fn plan(call: &Call) -> Result<Plan> {
    let op = call.op_type();
    let x = call.input(0)?;
    let dtype = x.dtype()?;
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        unsupported!("{op}: X has dtype {dtype}; float32, float16 and bfloat16 are supported");
    }
    let shape = x.shape()?;
    let r = shape.len();
    if r == 0 {
        bail!("{op}: X must have at least one dimension");
    }
    let legacy = op == "Upsample" || call.opset() < 11;
    let mode = match call.attr_s("mode", "nearest")? {
        "nearest" => Mode::Nearest,
        "linear" => Mode::Linear,
        "bilinear" if legacy => Mode::Linear,
        "cubic" if !legacy => Mode::Cubic,
        m => bail!(
            "{op}: mode {m:?} is not one this opset defines (nearest, linear{})",
            if legacy { "" } else { ", cubic" }
        ),
    };
    let coord = if legacy {
        Coord::Asymmetric
    } else {
        match call.attr_s("coordinate_transformation_mode", "half_pixel")? {
            "half_pixel" => Coord::HalfPixel,
            "half_pixel_symmetric" if call.opset() >= 19 => Coord::HalfPixelSymmetric,
            "pytorch_half_pixel" => Coord::PytorchHalfPixel,
            "align_corners" => Coord::AlignCorners,
            "asymmetric" => Coord::Asymmetric,
            "tf_crop_and_resize" => Coord::TfCropAndResize,
            m => bail!("{op}: coordinate_transformation_mode {m:?} is not one opset {} defines", call.opset()),
        }
    };
    let nearest = if legacy {
        Nearest::Simple
    } else {
        match call.attr_s("nearest_mode", "round_prefer_floor")? {
            "round_prefer_floor" => Nearest::RoundPreferFloor,
            "round_prefer_ceil" => Nearest::RoundPreferCeil,
            "floor" => Nearest::Floor,
            "ceil" => Nearest::Ceil,
            m => bail!("{op}: nearest_mode {m:?} is not round_prefer_floor, round_prefer_ceil, floor or ceil"),
        }
    };
    let antialias = call.attr_i("antialias", 0)? != 0;
    if antialias && mode == Mode::Nearest {
        bail!("{op}: antialias applies to linear and cubic modes, not nearest");
    }

    // The axes that scales, sizes and roi cover.
    let axes: Vec<usize> = match call.attr_ints("axes")? {
        None => (0..r).collect(),
        Some(a) => {
            let mut out = Vec::with_capacity(a.len());
            for &v in &a {
                let n = if v < 0 { v + r as i64 } else { v };
                if !(0..r as i64).contains(&n) || out.contains(&(n as usize)) {
                    bail!("{op}: axes {a:?} must be distinct axes of a rank-{r} input");
                }
                out.push(n as usize);
            }
            out
        }
    };
    let k = axes.len();
    let (roi, scales, sizes) = if op == "Upsample" && call.opset() < 9 {
        let s = call.attr_floats("scales")?.map(|v| v.iter().map(|&f| f as f64).collect());
        (None, s, None)
    } else if legacy {
        (None, values(call.input_opt(1))?, None)
    } else {
        (values(call.input_opt(1))?, values(call.input_opt(2))?, values(call.input_opt(3))?)
    };
    let mut scale = alloc::vec![1.0f64; r];
    let mut out_shape = shape.clone();
    match (scales, sizes) {
        (Some(s), None) => {
            if s.len() != k {
                bail!("{op}: scales has {} values for {k} axes", s.len());
            }
            for (&a, &v) in axes.iter().zip(&s) {
                if !(v > 0.0 && v.is_finite()) {
                    bail!("{op}: scales must be positive, not {s:?}");
                }
                let o = libm::floor(v * shape[a] as f64);
                if o > u32::MAX as f64 {
                    bail!("{op}: scale {v} makes axis {a} of {} elements {o} long", shape[a]);
                }
                scale[a] = v;
                out_shape[a] = o as usize;
            }
        }
        (None, Some(z)) => {
            if z.len() != k {
                bail!("{op}: sizes has {} values for {k} axes", z.len());
            }
            if let Some(v) = z.iter().find(|&&v| !(0.0..=u32::MAX as f64).contains(&v)) {
                bail!("{op}: sizes must be non-negative 32-bit lengths, not {v}");
            }
            if let Some(&a) = axes.iter().find(|&&a| shape[a] == 0) {
                bail!("{op}: axis {a} of X is empty, so sizes gives it no scale");
            }
            let ratio = |i: usize| z[i] / shape[axes[i]] as f64;
            let policy = call.attr_s("keep_aspect_ratio_policy", "stretch")?;
            let one = match policy {
                "stretch" => None,
                "not_larger" => Some((0..k).map(ratio).fold(f64::INFINITY, f64::min)),
                "not_smaller" => Some((0..k).map(ratio).fold(f64::NEG_INFINITY, f64::max)),
                p => bail!("{op}: keep_aspect_ratio_policy {p:?} is not stretch, not_larger or not_smaller"),
            };
            for (i, &a) in axes.iter().enumerate() {
                match one {
                    None => {
                        scale[a] = ratio(i);
                        out_shape[a] = z[i] as usize;
                    }
                    Some(s) => {
                        let o = libm::floor(s * shape[a] as f64 + 0.5);
                        if !(0.0..=u32::MAX as f64).contains(&o) {
                            bail!("{op}: keep_aspect_ratio_policy makes axis {a} {o} long");
                        }
                        scale[a] = s;
                        out_shape[a] = o as usize;
                    }
                }
            }
        }
        (Some(_), Some(_)) => bail!("{op}: give scales or sizes, not both"),
        (None, None) => bail!("{op}: needs scales or sizes"),
    }
    shape::numel(&out_shape)?;
    let mut roi_of = alloc::vec![(0.0f64, 1.0f64); r];
    if coord == Coord::TfCropAndResize {
        let Some(roi) = roi else { bail!("{op}: tf_crop_and_resize needs roi") };
        if roi.len() != 2 * k {
            bail!("{op}: roi has {} values for {k} axes (starts, then ends)", roi.len());
        }
        for (i, &a) in axes.iter().enumerate() {
            roi_of[a] = (roi[i], roi[k + i]);
        }
    }
    // Innermost axis first, as the reference's recursion; an axis whose every output index
    // maps to itself is no pass.
    let passes = (0..r)
        .rev()
        .filter(|&a| out_shape[a] != shape[a] || scale[a] != 1.0 || coord == Coord::TfCropAndResize)
        .map(|a| Axis { axis: a, in_len: shape[a], out_len: out_shape[a], scale: scale[a], roi: roi_of[a] })
        .collect();
    Ok(Plan {
        dtype,
        shape,
        out_shape,
        passes,
        mode,
        coord,
        nearest,
        antialias,
        exclude: call.attr_i("exclude_outside", 0)? != 0,
        cubic_a: call.attr_f("cubic_coeff_a", -0.75)? as f64,
        extrapolation: call.attr_f("extrapolation_value", 0.0)? as f64,
    })
}

pub(crate) fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    Ok(alloc::vec![TensorType::new(p.dtype, p.out_shape)])
}

/// Keys' cubic kernel with parameter `a` at distance `x`.
fn cubic(x: f64, a: f64) -> f64 {
    let x = libm::fabs(x);
    if x <= 1.0 {
        ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
    } else {
        0.0
    }
}

impl Plan {
    /// The input coordinate of output index `x` on `a`, or `None` where tf_crop_and_resize
    /// extrapolates.
    fn source(&self, a: &Axis, x: usize) -> Option<f64> {
        let (w, x) = (a.in_len as f64, x as f64);
        let ow = a.scale * w;
        Some(match self.coord {
            Coord::AlignCorners if ow == 1.0 => 0.0,
            Coord::AlignCorners => x * (w - 1.0) / (ow - 1.0),
            Coord::Asymmetric => x / a.scale,
            Coord::TfCropAndResize => {
                let (r0, r1) = a.roi;
                let c = if ow == 1.0 { (r1 - r0) * (w - 1.0) / 2.0 } else { x * (r1 - r0) * (w - 1.0) / (ow - 1.0) }
                    + r0 * (w - 1.0);
                if c < 0.0 || c > w - 1.0 {
                    return None;
                }
                c
            }
            Coord::PytorchHalfPixel if ow == 1.0 => -0.5,
            Coord::PytorchHalfPixel | Coord::HalfPixel => (x + 0.5) / a.scale - 0.5,
            Coord::HalfPixelSymmetric => w / 2.0 * (1.0 - a.out_len as f64 / ow) + (x + 0.5) / a.scale - 0.5,
        })
    }

    /// The taps of coordinate `c` on `a`: the first input index and each tap's weight (already
    /// normalised where the mode asks for it).
    fn taps(&self, a: &Axis, c: f64) -> (i64, Vec<f64>) {
        let floor = libm::floor(c);
        let r = if c == floor { 1.0 } else { c - floor };
        let i0 = (c - r) as i64;
        let s = a.scale.min(1.0);
        let n: i64 = match (self.mode, self.antialias) {
            (Mode::Nearest, _) | (Mode::Linear, false) => 2,
            (Mode::Linear, true) => 2 - 2 * (libm::floor(-1.0 / s) as i64 + 1),
            (Mode::Cubic, false) => 4,
            (Mode::Cubic, true) => 2 - 2 * (libm::floor(-2.0 / s) as i64 + 1),
        };
        let first = i0 - n / 2 + 1;
        let mut w: Vec<f64> = (0..n)
            .map(|k| {
                let d = (k - n / 2 + 1) as f64 - r; // the tap's distance from c
                match self.mode {
                    Mode::Nearest => {
                        let second = if r == 1.0 {
                            true
                        } else {
                            match self.nearest {
                                Nearest::RoundPreferFloor => r > 0.5,
                                Nearest::RoundPreferCeil => r >= 0.5,
                                Nearest::Floor => false,
                                Nearest::Ceil => true,
                                Nearest::Simple => a.scale < 1.0,
                            }
                        };
                        ((k == 1) == second) as u8 as f64
                    }
                    Mode::Linear if !self.antialias => [1.0 - r, r][k as usize],
                    Mode::Linear => (1.0 - libm::fabs(d * s)).clamp(0.0, 1.0),
                    Mode::Cubic if !self.antialias => cubic(d, self.cubic_a),
                    Mode::Cubic => cubic(d * s, self.cubic_a),
                }
            })
            .collect();
        let outside = |k: usize| {
            let i = first + k as i64;
            i < 0 || i >= a.in_len as i64
        };
        if self.exclude {
            for (k, v) in w.iter_mut().enumerate() {
                if outside(k) {
                    *v = 0.0;
                }
            }
        }
        if self.exclude || (self.antialias && self.mode != Mode::Nearest) {
            let sum: f64 = w.iter().sum();
            w.iter_mut().for_each(|v| *v /= sum);
        }
        (first, w)
    }

    /// One pass: `src` of shape `dims` resampled along `a` (dims[a.axis] = a.in_len).
    fn pass(&self, src: &[f64], dims: &[usize], a: &Axis) -> Vec<f64> {
        let outer: usize = dims[..a.axis].iter().product();
        let inner: usize = dims[a.axis + 1..].iter().product();
        let mut out = alloc::vec![0.0; outer * a.out_len * inner];
        for xo in 0..a.out_len {
            let taps = self.source(a, xo).map(|c| self.taps(a, c));
            for o in 0..outer {
                let line = &src[o * a.in_len * inner..(o + 1) * a.in_len * inner];
                for i in 0..inner {
                    out[(o * a.out_len + xo) * inner + i] = match &taps {
                        None => self.extrapolation,
                        Some((first, w)) => w
                            .iter()
                            .enumerate()
                            .map(|(k, &c)| {
                                let idx = (first + k as i64).clamp(0, a.in_len as i64 - 1) as usize;
                                c * line[idx * inner + i]
                            })
                            .sum(),
                    };
                }
            }
        }
        out
    }
}

pub(crate) fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let mut v = call.input(0)?.read_vec::<f64>()?;
    if p.out_shape.contains(&0) {
        return call.output(0)?.write_vec::<f64>(&[]);
    }
    if v.is_empty() {
        bail!("{}: X is empty, so it has nothing to resample into {:?}", call.op_type(), p.out_shape);
    }
    let mut dims = p.shape.clone();
    for a in &p.passes {
        v = p.pass(&v, &dims, a);
        dims[a.axis] = a.out_len;
    }
    call.output(0)?.write_vec(&v)
}

pub(crate) fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let op = call.op_type();
    let Some(tag) = p.dtype.cuda_tag() else { unsupported!("{op}: no CUDA kernel for {}", p.dtype) };
    let y = call.output(0)?;
    let x = call.input(0)?;
    if y.numel()? == 0 {
        return Ok(());
    }
    if x.numel()? == 0 {
        bail!("{op}: X is empty, so it has nothing to resample into {:?}", p.out_shape);
    }
    if p.passes.is_empty() {
        // Every axis maps to itself: a copy through one pass of the innermost axis.
        let r = p.shape.len() - 1;
        let a = Axis { axis: r, in_len: p.shape[r], out_len: p.shape[r], scale: 1.0, roi: (0.0, 1.0) };
        return launch_pass(&p, &p.shape, &a, (tag, x.handle()), (tag, y.handle()));
    }
    // Passes between the first and the last go through f32 scratch.
    let f32_tag = "kiln_tag_f32";
    let mut dims = p.shape.clone();
    let mut src = (tag, x.handle());
    for (i, a) in p.passes.iter().enumerate() {
        let last = i + 1 == p.passes.len();
        let mut next = dims.clone();
        next[a.axis] = a.out_len;
        let dst = if last {
            (tag, y.handle())
        } else {
            let n: u64 = next.iter().map(|&d| d as u64).product();
            (f32_tag, scratch(n * 4)?)
        };
        launch_pass(&p, &dims, a, src, dst)?;
        src = dst;
        dims = next;
    }
    Ok(())
}

/// One `kiln_resize_axis<In, Out>` launch over `dims` along `a`.
fn launch_pass(p: &Plan, dims: &[usize], a: &Axis, src: (&str, u32), dst: (&str, u32)) -> Result<()> {
    let outer: u64 = dims[..a.axis].iter().map(|&d| d as u64).product();
    let inner: u64 = dims[a.axis + 1..].iter().map(|&d| d as u64).product();
    let total = outer * a.out_len as u64 * inner;
    let arg = KernelArg::tensor;
    launch(&Launch {
        kernel: &kernel_name("kiln_resize_axis", &[src.0, dst.0]),
        grid: grid_stride(total),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args: alloc::vec![
            arg(src.1),
            arg(dst.1),
            KernelArg::U64(outer),
            KernelArg::U64(a.in_len as u64),
            KernelArg::U64(a.out_len as u64),
            KernelArg::U64(inner),
            KernelArg::U32(p.mode as u32),
            KernelArg::U32(p.coord as u32),
            KernelArg::U32(p.nearest as u32),
            KernelArg::U32(p.antialias as u32),
            KernelArg::U32(p.exclude as u32),
            KernelArg::F64(p.cubic_a),
            KernelArg::F64(p.extrapolation),
            KernelArg::F64(a.scale),
            KernelArg::F64(a.roi.0),
            KernelArg::F64(a.roi.1),
        ],
    })
}
