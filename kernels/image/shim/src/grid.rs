//! GridSample (16, 20, 22) and AffineGrid (20), after ONNX Operators.md and its reference
//! implementation (which follows PyTorch's `grid_sampler` and `affine_grid`).
//!
//! # GridSample
//!
//! `X` [N, C, D1, …, Dk] (k = 2 at opset 16; 1 to 3 here), `grid` [N, O1, …, Ok, k] whose last
//! axis holds normalised coordinates in [−1, 1] in reverse axis order (x = the last axis of X
//! first); `Y` [N, C, O1, …, Ok]. A coordinate g on an axis of length d maps to
//! ((g + 1)·d − 1)/2, or (g + 1)/2·(d − 1) with `align_corners` = 1, computed in f32 as the
//! reference does. `mode`: `linear` (opset 16 `bilinear`: 2^k taps), `nearest` (round half to
//! even, as ONNX's node test data has it for 2 and 3 axes), `cubic` (opset 16 `bicubic`: 4^k taps of
//! Keys' kernel with a = −0.75). `padding_mode` for a coordinate outside [−½, d − ½] (or
//! [0, d − 1] with align_corners): `zeros` (taps outside X read 0), `border` (the coordinate and
//! the taps clamp to [0, d − 1]), `reflection` (the coordinate and the taps reflect off those
//! bounds until inside); in cubic mode only the taps, one by one, as PyTorch and onnxruntime do
//! (ONNX's reference moves the coordinate too; ONNX's node tests sample cubic with zeros only).
//! A NaN coordinate gives NaN.
//!
//! # AffineGrid
//!
//! `theta` [N, 2, 3] or [N, 3, 4], `size` (int64, a value input) [N, C, H, W] or
//! [N, C, D, H, W]; the output [N, H, W, 2] or [N, D, H, W, 3] is θ·(x, y, (z), 1) for the base
//! grid coordinates of each position: −1 + (2i + 1)/len, or −1 + 2i/(len − 1) with
//! `align_corners` (−1 for a length of 1).
use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, unsupported};

/// Most spatial axes GridSample takes (the CUDA kernel's arrays).
const MAX_SPATIAL: usize = 3;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    // The CUDA kernel's codes.
    Linear = 0,
    Nearest = 1,
    Cubic = 2,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Padding {
    Zeros = 0,
    Border = 1,
    Reflection = 2,
}

struct Plan {
    dtype: DType,
    batch: usize,
    channels: usize,
    input: Vec<usize>,
    output: Vec<usize>,
    mode: Mode,
    padding: Padding,
    align: bool,
}

fn float_dtype(op: &str, what: &str, d: DType) -> Result<()> {
    if !matches!(d, DType::F32 | DType::F16 | DType::BF16) {
        unsupported!("{op}: {what} has dtype {d}; float32, float16 and bfloat16 are supported");
    }
    Ok(())
}

fn plan(call: &Call) -> Result<Plan> {
    const OP: &str = "GridSample";
    let (x, grid) = (call.input(0)?, call.input(1)?);
    let dtype = x.dtype()?;
    float_dtype(OP, "X", dtype)?;
    float_dtype(OP, "grid", grid.dtype()?)?;
    let (xs, gs) = (x.shape()?, grid.shape()?);
    if xs.len() < 3 {
        bail!("{OP}: X must be [N, C, D1, ...], not of rank {}", xs.len());
    }
    let k = xs.len() - 2;
    if call.opset() < 20 && k != 2 {
        bail!("{OP}: opset {} takes 4-D X, not rank {}", call.opset(), xs.len());
    }
    if k > MAX_SPATIAL {
        unsupported!("{OP}: {k} spatial axes (kiln-image takes up to {MAX_SPATIAL})");
    }
    if gs.len() != k + 2 || gs[0] != xs[0] || gs[k + 1] != k {
        bail!("{OP}: grid {gs:?} must be [N = {}, output dims..., {k}] for X {xs:?}", xs[0]);
    }
    let old = call.opset() < 20;
    let mode = match (call.attr_s("mode", if old { "bilinear" } else { "linear" })?, old) {
        ("bilinear", true) | ("linear", false) => Mode::Linear,
        ("nearest", _) => Mode::Nearest,
        ("bicubic", true) | ("cubic", false) => Mode::Cubic,
        (m, _) => bail!("{OP}: mode {m:?} is not one opset {} defines", call.opset()),
    };
    let padding = match call.attr_s("padding_mode", "zeros")? {
        "zeros" => Padding::Zeros,
        "border" => Padding::Border,
        "reflection" => Padding::Reflection,
        m => bail!("{OP}: padding_mode {m:?} is not zeros, border or reflection"),
    };
    if xs[2..].contains(&0) && gs[1..=k].iter().product::<usize>() * xs[0] * xs[1] > 0 {
        bail!("{OP}: X {xs:?} has an empty spatial axis to sample from");
    }
    Ok(Plan {
        dtype,
        batch: xs[0],
        channels: xs[1],
        input: xs[2..].to_vec(),
        output: gs[1..=k].to_vec(),
        mode,
        padding,
        align: call.attr_i("align_corners", 0)? != 0,
    })
}

/// Reflects `x` off `lo` and `hi` until it lies between them (the reference's `_gs_reflect`).
fn reflect(x: f32, lo: f32, hi: f32) -> f32 {
    let rng = hi - lo;
    if x < lo {
        let dx = lo - x;
        let n = (dx / rng) as i64;
        let r = dx - n as f32 * rng;
        if n % 2 == 0 {
            lo + r
        } else {
            hi - r
        }
    } else if x > hi {
        let dx = x - hi;
        let n = (dx / rng) as i64;
        let r = dx - n as f32 * rng;
        if n % 2 == 0 {
            hi - r
        } else {
            lo + r
        }
    } else {
        x
    }
}

/// Keys' cubic weights (a = −0.75) of the taps x0 − 1 … x0 + 2 at fraction t = x − x0.
fn cubic_weights(t: f64) -> [f64; 4] {
    let a = -0.75;
    let near = |x: f64| ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
    let far = |x: f64| ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a;
    [far(t + 1.0), near(t), near(1.0 - t), far(2.0 - t)]
}

impl Plan {
    /// (lo, hi): where coordinates are inside the input on an axis of length `d`.
    fn bounds(&self, d: usize) -> (f32, f32) {
        if self.align {
            (0.0, d as f32 - 1.0)
        } else {
            (-0.5, d as f32 - 0.5)
        }
    }

    /// The index a tap at integer `i` reads on an axis of length `d`, or `None` (zeros).
    fn tap(&self, i: i64, d: usize) -> Option<usize> {
        match self.padding {
            _ if (0..d as i64).contains(&i) => Some(i as usize),
            Padding::Zeros => None,
            Padding::Border => Some(i.clamp(0, d as i64 - 1) as usize),
            Padding::Reflection => {
                let (lo, hi) = self.bounds(d);
                Some((reflect(i as f32, lo, hi) as i64).clamp(0, d as i64 - 1) as usize)
            }
        }
    }

    /// One output value: X's plane `plane` ([D1, …, Dk]) at normalised coordinates `g` (reverse
    /// axis order, as the grid holds them).
    fn sample(&self, plane: &[f64], g: &[f64]) -> f64 {
        let k = self.input.len();
        // Per axis: the taps' indices (None: zero) and weights.
        let mut taps: Vec<Vec<(Option<usize>, f64)>> = Vec::with_capacity(k);
        for a in 0..k {
            let d = self.input[a];
            let n = g[k - 1 - a] as f32;
            if n.is_nan() {
                return f64::NAN; // a NaN coordinate samples nothing: NaN on both devices
            }
            let mut x =
                if self.align { (n + 1.0) / 2.0 * (d as f32 - 1.0) } else { ((n + 1.0) * d as f32 - 1.0) / 2.0 };
            if self.mode == Mode::Nearest {
                x = libm::rintf(x);
            }
            let (lo, hi) = self.bounds(d);
            // Cubic taps are padded one by one (as PyTorch and onnxruntime do); the others move
            // the coordinate itself.
            if self.mode != Mode::Cubic && (x < lo || x > hi) {
                x = match self.padding {
                    Padding::Zeros => x,
                    Padding::Border => x.clamp(0.0, d as f32 - 1.0),
                    Padding::Reflection => reflect(x, lo, hi),
                };
            }
            let x = x as f64;
            let x0 = libm::floor(x);
            let t = x - x0;
            let i0 = x0 as i64;
            taps.push(match self.mode {
                Mode::Nearest => alloc::vec![(self.tap(x as i64, d), 1.0)],
                Mode::Linear => alloc::vec![(self.tap(i0, d), 1.0 - t), (self.tap(i0 + 1, d), t)],
                Mode::Cubic => {
                    let w = cubic_weights(t);
                    (0..4).map(|j| (self.tap(i0 - 1 + j as i64, d), w[j])).collect()
                }
            });
        }
        // Σ over the tensor product of the axes' taps.
        let mut sum = 0.0;
        let mut pick = alloc::vec![0usize; k];
        loop {
            let mut w = 1.0;
            let mut at = Some(0usize);
            for a in 0..k {
                let (i, wa) = taps[a][pick[a]];
                w *= wa;
                at = match (at, i) {
                    (Some(o), Some(i)) => Some(o * self.input[a] + i),
                    _ => None,
                };
            }
            if let Some(o) = at {
                sum += w * plane[o];
            }
            let mut a = k;
            loop {
                if a == 0 {
                    return sum;
                }
                a -= 1;
                pick[a] += 1;
                if pick[a] < taps[a].len() {
                    break;
                }
                pick[a] = 0;
            }
        }
    }
}

pub(crate) fn grid_sample_infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    let mut shape = alloc::vec![p.batch, p.channels];
    shape.extend_from_slice(&p.output);
    Ok(alloc::vec![TensorType::new(p.dtype, shape)])
}

pub(crate) fn grid_sample_cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let x = call.input(0)?.read_vec::<f64>()?;
    let grid = call.input(1)?.read_vec::<f64>()?;
    let (k, in_n, out_n) = (p.input.len(), p.input.iter().product::<usize>(), p.output.iter().product::<usize>());
    let mut y = Vec::with_capacity(p.batch * p.channels * out_n);
    for n in 0..p.batch {
        for c in 0..p.channels {
            let plane = &x[(n * p.channels + c) * in_n..][..in_n];
            for o in 0..out_n {
                y.push(p.sample(plane, &grid[(n * out_n + o) * k..][..k]));
            }
        }
    }
    call.output(0)?.write_vec(&y)
}

pub(crate) fn grid_sample_dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let (x, grid, y) = (call.input(0)?, call.input(1)?, call.output(0)?);
    let Some(tag) = p.dtype.cuda_tag() else { unsupported!("GridSample: no CUDA kernel for {}", p.dtype) };
    if grid.dtype()? != p.dtype {
        unsupported!("GridSample: the CUDA kernel takes a grid of X's dtype {}, not {}", p.dtype, grid.dtype()?);
    }
    let total = y.numel()? as u64;
    if total == 0 {
        return Ok(());
    }
    // Spatial dims right-aligned in three slots, 1 before them.
    let pad3 = |v: &[usize]| -> Vec<KernelArg> {
        (0..MAX_SPATIAL)
            .map(|i| KernelArg::U64(if i + v.len() < MAX_SPATIAL { 1 } else { v[i + v.len() - MAX_SPATIAL] as u64 }))
            .collect()
    };
    let mut args = alloc::vec![
        KernelArg::Tensor { handle: x.handle(), offset: 0 },
        KernelArg::Tensor { handle: grid.handle(), offset: 0 },
        KernelArg::Tensor { handle: y.handle(), offset: 0 },
        KernelArg::U64(total),
        KernelArg::U64(p.channels as u64),
        KernelArg::U32(p.input.len() as u32),
    ];
    args.extend(pad3(&p.input));
    args.extend(pad3(&p.output));
    args.extend([KernelArg::U32(p.mode as u32), KernelArg::U32(p.padding as u32), KernelArg::U32(p.align as u32)]);
    launch(&Launch {
        kernel: &kernel_name("kiln_grid_sample", &[tag]),
        grid: grid_stride(total),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args,
    })
}

/// AffineGrid's spatial output dims from `size` (a value input), and whether it is 2-D.
fn affine_plan(call: &Call) -> Result<(DType, usize, Vec<usize>)> {
    const OP: &str = "AffineGrid";
    let theta = call.input(0)?;
    let dtype = theta.dtype()?;
    float_dtype(OP, "theta", dtype)?;
    let size = call.input(1)?.read_i64s()?;
    let ts = theta.shape()?;
    let k = match size.len() {
        4 => 2,
        5 => 3,
        n => bail!("{OP}: size must be [N, C, H, W] or [N, C, D, H, W], not {n} values"),
    };
    if ts != [size[0].max(0) as usize, k, k + 1] {
        bail!("{OP}: theta {ts:?} must be [N, {k}, {}] for size {size:?}", k + 1);
    }
    if let Some(d) = size[2..].iter().find(|&&d| !(1..=u32::MAX as i64).contains(&d)) {
        bail!("{OP}: size {size:?} has a spatial length {d}; lengths are positive");
    }
    let dims: Vec<usize> = size[2..].iter().map(|&d| d as usize).collect();
    let mut out = alloc::vec![ts[0], k];
    out.extend_from_slice(&dims);
    shape::numel(&out)?;
    Ok((dtype, ts[0], dims))
}

pub(crate) fn affine_infer(call: &Call) -> Result<Vec<TensorType>> {
    let (dtype, n, dims) = affine_plan(call)?;
    let mut shape = alloc::vec![n];
    shape.extend_from_slice(&dims);
    shape.push(dims.len());
    Ok(alloc::vec![TensorType::new(dtype, shape)])
}

/// The base grid coordinate of index `i` on an axis of `len` positions.
fn base(i: usize, len: usize, align: bool) -> f64 {
    if align {
        if len == 1 {
            -1.0
        } else {
            -1.0 + i as f64 * (2.0 / (len - 1) as f64)
        }
    } else {
        let step = 2.0 / len as f64;
        -1.0 + step / 2.0 + i as f64 * step
    }
}

pub(crate) fn affine_cpu(call: &Call) -> Result<()> {
    let (_, n, dims) = affine_plan(call)?;
    let align = call.attr_i("align_corners", 0)? != 0;
    let theta = call.input(0)?.read_vec::<f64>()?;
    let k = dims.len();
    let per: usize = dims.iter().product();
    let mut out = Vec::with_capacity(n * per * k);
    for b in 0..n {
        let th = &theta[b * k * (k + 1)..][..k * (k + 1)];
        for p in 0..per {
            // (x, y, (z)): the last axis first.
            let mut rest = p;
            let mut h = alloc::vec![0.0; k + 1];
            for a in (0..k).rev() {
                h[k - 1 - a] = base(rest % dims[a], dims[a], align);
                rest /= dims[a];
            }
            h[k] = 1.0;
            for r in 0..k {
                out.push((0..=k).map(|c| th[r * (k + 1) + c] * h[c]).sum::<f64>());
            }
        }
    }
    call.output(0)?.write_vec(&out)
}

pub(crate) fn affine_dispatch(call: &Call) -> Result<()> {
    let (dtype, n, dims) = affine_plan(call)?;
    let Some(tag) = dtype.cuda_tag() else { unsupported!("AffineGrid: no CUDA kernel for {dtype}") };
    let out = call.output(0)?;
    let total = (n * dims.iter().product::<usize>()) as u64;
    if total == 0 {
        return Ok(());
    }
    let d3 = |i: usize| {
        KernelArg::U64(if dims.len() == 3 {
            dims[i] as u64
        } else if i == 0 {
            1
        } else {
            dims[i - 1] as u64
        })
    };
    launch(&Launch {
        kernel: &kernel_name("kiln_affine_grid", &[tag]),
        grid: grid_stride(total),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args: alloc::vec![
            KernelArg::Tensor { handle: call.input(0)?.handle(), offset: 0 },
            KernelArg::Tensor { handle: out.handle(), offset: 0 },
            KernelArg::U64(total),
            KernelArg::U32(dims.len() as u32),
            d3(0),
            d3(1),
            d3(2),
            KernelArg::U32(call.attr_i("align_corners", 0)? as u32),
        ],
    })
}
