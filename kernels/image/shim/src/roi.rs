//! RoiAlign-10/16/22 (ONNX Operators.md and its reference, which follows onnxruntime's kernel):
//! `X` [N, C, H, W], `rois` [R, 4] (x1, y1, x2, y2 in X's coordinates before `spatial_scale`),
//! int64 `batch_indices` [R] → `Y` [R, C, output_height, output_width]. Each output bin averages
//! (`mode` "avg") or takes the largest of (`mode` "max") bilinear samples on a grid of
//! `sampling_ratio`² points per bin (0: ⌈roi size / bins⌉ per axis). The coordinate
//! transformation is `half_pixel` (coordinates shifted by −0.5, the default from opset 16) or
//! `output_half_pixel` (no shift, and a roi at least 1 × 1: opset 10's only behaviour). A sample
//! outside [−1, size] counts as 0; one inside is clamped to the map. "max" takes, per sample, the
//! largest of its four weighted corners, as the reference does. A batch index outside [0, N)
//! fails the node (on the GPU through the status record, device error 1).

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, unsupported};

struct Plan {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    rois: usize,
    oh: usize,
    ow: usize,
    sampling: i64,
    scale: f64,
    half_pixel: bool,
    max: bool,
}

fn plan(call: &Call) -> Result<Plan> {
    let x = call.input(0)?;
    let dtype = x.dtype()?;
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::F64) {
        unsupported!("RoiAlign: dtype {dtype} is not supported (float32, float16, bfloat16, float64)");
    }
    let [n, c, h, w] = x.shape()?[..] else { bail!("RoiAlign: X must be [N, C, H, W], not {:?}", x.shape()?) };
    if h == 0 || w == 0 {
        bail!("RoiAlign: X's feature maps are empty ({h} × {w})");
    }
    let (rois, idx) = (call.input(1)?, call.input(2)?);
    let (rs, is) = (rois.shape()?, idx.shape()?);
    let r = match (&rs[..], &is[..]) {
        (&[r, 4], &[ri]) if r == ri => r,
        _ => bail!("RoiAlign: rois must be [R, 4] and batch_indices [R], not {rs:?} and {is:?}"),
    };
    if rois.dtype()? != dtype || idx.dtype()? != DType::I64 {
        bail!("RoiAlign: rois must be {dtype} (as X) and batch_indices int64");
    }
    let default_ctm = if call.opset() >= 16 { "half_pixel" } else { "output_half_pixel" };
    let half_pixel = match call.attr_s("coordinate_transformation_mode", default_ctm)? {
        "half_pixel" => true,
        "output_half_pixel" => false,
        other => bail!("RoiAlign: coordinate_transformation_mode {other:?} (half_pixel or output_half_pixel)"),
    };
    let max = match call.attr_s("mode", "avg")? {
        "avg" => false,
        "max" => true,
        other => bail!("RoiAlign: mode {other:?} (avg or max)"),
    };
    let size = |name: &str| -> Result<usize> {
        match call.attr_i(name, 1)? {
            v if v >= 1 => Ok(v as usize),
            v => bail!("RoiAlign: {name} must be at least 1, not {v}"),
        }
    };
    let sampling = call.attr_i("sampling_ratio", 0)?;
    if sampling < 0 {
        bail!("RoiAlign: sampling_ratio must not be negative, not {sampling}");
    }
    Ok(Plan {
        n,
        c,
        h,
        w,
        rois: r,
        oh: size("output_height")?,
        ow: size("output_width")?,
        sampling,
        scale: call.attr_f("spatial_scale", 1.0)? as f64,
        half_pixel,
        max,
    })
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    Ok(alloc::vec![TensorType::new(call.input(0)?.dtype()?, alloc::vec![p.rois, p.c, p.oh, p.ow])])
}

/// The four corners (row-major offsets in a map) and weights of a bilinear sample at (y, x),
/// or `None` outside [−1, size].
fn corners(y: f64, x: f64, h: usize, w: usize) -> Option<([usize; 4], [f64; 4])> {
    if y < -1.0 || y > h as f64 || x < -1.0 || x > w as f64 {
        return None;
    }
    let axis = |v: f64, len: usize| -> (usize, usize, f64) {
        let v = v.max(0.0);
        let lo = v as usize;
        if lo >= len - 1 {
            (len - 1, len - 1, 0.0)
        } else {
            (lo, lo + 1, v - lo as f64)
        }
    };
    let ((y0, y1, ly), (x0, x1, lx)) = (axis(y, h), axis(x, w));
    let (hy, hx) = (1.0 - ly, 1.0 - lx);
    Some(([y0 * w + x0, y0 * w + x1, y1 * w + x0, y1 * w + x1], [hy * hx, hy * lx, ly * hx, ly * lx]))
}

pub fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let x = call.input(0)?.read_vec::<f64>()?;
    let rois = call.input(1)?.read_vec::<f64>()?;
    let idx = call.input(2)?.read_i64s()?;
    let mut y = Vec::with_capacity(p.rois * p.c * p.oh * p.ow);
    let shift = if p.half_pixel { 0.5 } else { 0.0 };
    for (r, &b) in idx.iter().enumerate() {
        if b < 0 || b as u64 >= p.n as u64 {
            bail!("RoiAlign: batch_indices[{r}] = {b} is out of range for a batch of {}", p.n);
        }
        let roi = &rois[r * 4..r * 4 + 4];
        let (x1, y1) = (roi[0] * p.scale - shift, roi[1] * p.scale - shift);
        let (mut rw, mut rh) = (roi[2] * p.scale - shift - x1, roi[3] * p.scale - shift - y1);
        if !p.half_pixel {
            rw = rw.max(1.0);
            rh = rh.max(1.0);
        }
        let (bh, bw) = (rh / p.oh as f64, rw / p.ow as f64);
        let grid =
            |size: f64, bins: usize| if p.sampling > 0 { p.sampling } else { libm::ceil(size / bins as f64) as i64 };
        let (gh, gw) = (grid(rh, p.oh), grid(rw, p.ow));
        let count = (gh * gw).max(1) as f64;
        for c in 0..p.c {
            let map = &x[(b as usize * p.c + c) * p.h * p.w..][..p.h * p.w];
            for ph in 0..p.oh {
                for pw in 0..p.ow {
                    let mut acc: Option<f64> = None;
                    for iy in 0..gh.max(0) {
                        let sy = y1 + ph as f64 * bh + (iy as f64 + 0.5) * bh / gh as f64;
                        for ix in 0..gw.max(0) {
                            let sx = x1 + pw as f64 * bw + (ix as f64 + 0.5) * bw / gw as f64;
                            let (at, wt) = corners(sy, sx, p.h, p.w).unwrap_or(([0; 4], [0.0; 4]));
                            let v = if p.max {
                                (0..4).map(|k| wt[k] * map[at[k]]).fold(f64::NEG_INFINITY, f64::max)
                            } else {
                                (0..4).map(|k| wt[k] * map[at[k]]).sum()
                            };
                            acc = Some(match acc {
                                None => v,
                                Some(a) if p.max => a.max(v),
                                Some(a) => a + v,
                            });
                        }
                    }
                    let v = acc.unwrap_or(0.0);
                    y.push(if p.max { v } else { v / count });
                }
            }
        }
    }
    call.output(0)?.write_vec(&y)
}

pub fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let total = p.rois * p.c * p.oh * p.ow;
    if total == 0 {
        return Ok(());
    }
    let Some(tag) = call.input(0)?.dtype()?.cuda_tag() else { unsupported!("RoiAlign: no CUDA kernel") };
    let t = KernelArg::tensor;
    launch(&Launch {
        kernel: &kiln_kernel_abi::names::kernel_name("kiln_roi_align", &[tag]),
        grid: grid_stride(total as u64),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args: alloc::vec![
            t(call.input(0)?.handle()),
            t(call.input(1)?.handle()),
            t(call.input(2)?.handle()),
            t(call.output(0)?.handle()),
            KernelArg::U64(total as u64),
            KernelArg::U64(p.n as u64),
            KernelArg::U64(p.c as u64),
            KernelArg::U64(p.h as u64),
            KernelArg::U64(p.w as u64),
            KernelArg::U64(p.oh as u64),
            KernelArg::U64(p.ow as u64),
            KernelArg::I64(p.sampling),
            KernelArg::F64(p.scale),
            KernelArg::U32(p.half_pixel as u32),
            KernelArg::U32(p.max as u32),
            KernelArg::Status,
        ],
    })
}
