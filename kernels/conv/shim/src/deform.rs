//! DeformConv-19/22 (ONNX Operators.md and its reference): a 2-D convolution whose taps sample
//! X at learned offsets. `X` [N, C, H, W], `W` [M, C/group, kH, kW], `offset` [N,
//! offset_group·kH·kW·2, oH, oW] (per offset group and tap: the row, then the column offset),
//! optional `B` [M] and `mask` [N, offset_group·kH·kW, oH, oW] (default 1). Tap (i, j) of output
//! (oh, ow) samples input channel c at row oh·sH − pad_top + i·dH + Δrow and column
//! ow·sW − pad_left + j·dW + Δcol, bilinearly, zero outside the map (GridSample with
//! align_corners and zero padding, as the reference), times the mask and W[m, c, i, j]. The
//! output's spatial shape is the offset's. The CPU reference sums in f64; on the GPU
//! `kiln_deform_conv<Tag>` runs one thread per output element and sums in f32 (f64 for float64).

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, unsupported};

struct Plan {
    dtype: DType,
    /// N, C, H, W; M, C per group, kH, kW; oH, oW.
    x: [usize; 4],
    m: usize,
    cg: usize,
    k: [usize; 2],
    out: [usize; 2],
    group: usize,
    offset_group: usize,
    strides: [usize; 2],
    dilations: [usize; 2],
    pads: [i64; 2],
}

fn pair(call: &Call, name: &str, default: i64, min: i64) -> Result<[i64; 2]> {
    match call.attr_ints(name)? {
        None => Ok([default; 2]),
        Some(v) if v.len() >= 2 && v.iter().all(|&x| (min..=i32::MAX as i64).contains(&x)) => Ok([v[0], v[1]]),
        Some(v) => bail!("DeformConv: {name} {v:?} must hold 2 values (pads 4) of at least {min}"),
    }
}

fn plan(call: &Call) -> Result<Plan> {
    let (x, w, off) = (call.input(0)?, call.input(1)?, call.input(2)?);
    let dtype = x.dtype()?;
    if !dtype.is_float() {
        unsupported!("DeformConv: dtype {dtype} is not supported (floating-point only)");
    }
    let (xs, ws, os) = (x.shape()?, w.shape()?, off.shape()?);
    let (&[n, c, h, wd], &[m, cg, kh, kw], &[on, oc, oh, ow]) = (&xs[..], &ws[..], &os[..]) else {
        unsupported!("DeformConv: 2-D only: X {xs:?}, W {ws:?} and offset {os:?} must be rank 4");
    };
    let group = call.attr_i("group", 1)?;
    let offset_group = call.attr_i("offset_group", 1)?;
    let (group, offset_group) = match (usize::try_from(group), usize::try_from(offset_group)) {
        (Ok(g), Ok(o)) if g >= 1 && o >= 1 => (g, o),
        _ => bail!("DeformConv: group {group} and offset_group {offset_group} must be positive"),
    };
    if w.dtype()? != dtype || off.dtype()? != dtype {
        bail!("DeformConv: W and offset must be {dtype} as X");
    }
    if cg * group != c || m % group != 0 || c % offset_group != 0 {
        bail!("DeformConv: X's {c} channels, W {ws:?}, group {group} and offset_group {offset_group} do not fit");
    }
    if on != n || oc != offset_group * kh * kw * 2 {
        bail!("DeformConv: offset {os:?} must be [{n}, {}, oH, oW]", offset_group * kh * kw * 2);
    }
    if let Some(ks) = call.attr_ints("kernel_shape")? {
        if ks[..] != [kh as i64, kw as i64] {
            bail!("DeformConv: kernel_shape {ks:?} differs from W's {:?}", [kh, kw]);
        }
    }
    let (strides, dilations) = (pair(call, "strides", 1, 1)?, pair(call, "dilations", 1, 1)?);
    let pads = match call.attr_ints("pads")? {
        None => [0; 4],
        Some(v) if v.len() == 4 && v.iter().all(|&p| (0..=i32::MAX as i64).contains(&p)) => [v[0], v[1], v[2], v[3]],
        Some(v) => bail!("DeformConv: pads {v:?} must be 4 values of at least 0"),
    };
    for (a, (&i, &o)) in [h, wd].iter().zip(&[oh, ow]).enumerate() {
        let span = (([kh, kw][a] as i64) - 1) * dilations[a] + 1;
        let want = (i as i64 + pads[a] + pads[a + 2] - span).div_euclid(strides[a]) + 1;
        if o as i64 != want {
            bail!("DeformConv: the offset's spatial axis {a} is {o}; the geometry gives {want}");
        }
    }
    if let Some(mask) = call.input_opt(4) {
        if mask.dtype()? != dtype || mask.shape()? != [n, offset_group * kh * kw, oh, ow] {
            bail!("DeformConv: mask must be {dtype} [{n}, {}, {oh}, {ow}]", offset_group * kh * kw);
        }
    }
    if let Some(b) = call.input_opt(3) {
        if b.dtype()? != dtype || b.shape()? != [m] {
            bail!("DeformConv: B must be {dtype} [{m}]");
        }
    }
    Ok(Plan {
        dtype,
        x: [n, c, h, wd],
        m,
        cg,
        k: [kh, kw],
        out: [oh, ow],
        group,
        offset_group,
        strides: [strides[0] as usize, strides[1] as usize],
        dilations: [dilations[0] as usize, dilations[1] as usize],
        pads: [pads[0], pads[1]],
    })
}

/// X's map at (row, col), bilinearly, zero outside.
fn sample(map: &[f64], h: usize, w: usize, y: f64, x: f64) -> f64 {
    let (y0, x0) = (libm::floor(y), libm::floor(x));
    let (ly, lx) = (y - y0, x - x0);
    let at = |r: f64, c: f64| -> f64 {
        if r < 0.0 || c < 0.0 || r >= h as f64 || c >= w as f64 {
            0.0
        } else {
            map[r as usize * w + c as usize]
        }
    };
    at(y0, x0) * (1.0 - ly) * (1.0 - lx)
        + at(y0, x0 + 1.0) * (1.0 - ly) * lx
        + at(y0 + 1.0, x0) * ly * (1.0 - lx)
        + at(y0 + 1.0, x0 + 1.0) * ly * lx
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    Ok(alloc::vec![TensorType::new(p.dtype, alloc::vec![p.x[0], p.m, p.out[0], p.out[1]])])
}

pub fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let [n, c, h, w] = p.x;
    let ([kh, kw], [oh, ow]) = (p.k, p.out);
    let x = call.input(0)?.read_vec::<f64>()?;
    let wt = call.input(1)?.read_vec::<f64>()?;
    let off = call.input(2)?.read_vec::<f64>()?;
    let bias = call.input_opt(3).map(|b| b.read_vec::<f64>()).transpose()?;
    let mask = call.input_opt(4).map(|t| t.read_vec::<f64>()).transpose()?;
    let (mg, cpo) = (p.m / p.group, c / p.offset_group);
    let mut y = Vec::with_capacity(n * p.m * oh * ow);
    for b in 0..n {
        for m in 0..p.m {
            let g = m / mg;
            for r in 0..oh {
                for q in 0..ow {
                    let mut acc = bias.as_ref().map_or(0.0, |v| v[m]);
                    for ci in 0..p.cg {
                        let ch = g * p.cg + ci;
                        let og = ch / cpo;
                        let map = &x[(b * c + ch) * h * w..][..h * w];
                        for i in 0..kh {
                            for j in 0..kw {
                                let tap = (og * kh + i) * kw + j;
                                let o = |k: usize| {
                                    off[((b * p.offset_group * kh * kw * 2) + tap * 2 + k) * oh * ow + r * ow + q]
                                };
                                let sy =
                                    (r * p.strides[0]) as f64 - p.pads[0] as f64 + (i * p.dilations[0]) as f64 + o(0);
                                let sx =
                                    (q * p.strides[1]) as f64 - p.pads[1] as f64 + (j * p.dilations[1]) as f64 + o(1);
                                let mk = mask
                                    .as_ref()
                                    .map_or(1.0, |v| v[((b * p.offset_group * kh * kw) + tap) * oh * ow + r * ow + q]);
                                acc += wt[((m * p.cg + ci) * kh + i) * kw + j] * mk * sample(map, h, w, sy, sx);
                            }
                        }
                    }
                    y.push(acc);
                }
            }
        }
    }
    call.output(0)?.write_vec(&y)
}

pub fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let total = (p.x[0] * p.m * p.out[0] * p.out[1]) as u64;
    if total == 0 {
        return Ok(());
    }
    let Some(tag) = p.dtype.cuda_tag() else { unsupported!("DeformConv: no CUDA kernel for {}", p.dtype) };
    let x = call.input(0)?.handle();
    let t = KernelArg::tensor;
    let (bias, mask) = (call.input_opt(3).map(|b| b.handle()), call.input_opt(4).map(|b| b.handle()));
    let u = |v: usize| KernelArg::U64(v as u64);
    launch(&Launch {
        kernel: &kernel_name("kiln_deform_conv", &[tag]),
        grid: grid_stride(total),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args: alloc::vec![
            t(x),
            t(call.input(1)?.handle()),
            t(call.input(2)?.handle()),
            t(bias.unwrap_or(x)),
            t(mask.unwrap_or(x)),
            t(call.output(0)?.handle()),
            KernelArg::U64(total),
            KernelArg::U32(bias.is_some() as u32 | (mask.is_some() as u32) << 1),
            u(p.x[1]),
            u(p.x[2]),
            u(p.x[3]),
            u(p.m),
            u(p.group),
            u(p.offset_group),
            u(p.k[0]),
            u(p.k[1]),
            u(p.out[0]),
            u(p.out[1]),
            u(p.strides[0]),
            u(p.strides[1]),
            u(p.dilations[0]),
            u(p.dilations[1]),
            KernelArg::I64(p.pads[0]),
            KernelArg::I64(p.pads[1]),
        ],
    })
}
