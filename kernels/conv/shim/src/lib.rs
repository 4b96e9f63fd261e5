//! Shim of `kiln-conv`: Conv and ConvTranspose (1, 11, 22) over `[N, C, D1, …, Dk]` tensors,
//! following ONNX Operators.md and ONNX's reference implementation. On the GPU a dispatch asks
//! the host's `conv` for cuDNN first (ABI.md §4.8, manifest schema 10); where the host declines
//! (no cuDNN, `--cudnn off`, asymmetric padding, more than 3 axes, a broadcast Z, float64) its own
//! CUDA kernels run: direct convolutions, one thread per output element.
//!
//! # Conv
//!
//! `X` [N, C, D…], `W` [M, C/group, K…], optional `B` [M]. Per spatial axis: `strides` s (1),
//! `dilations` d (1), `pads` [b…, e…] (0) or `auto_pad` (`SAME_UPPER` / `SAME_LOWER`: output
//! ceil(in / s), the total padding split with the odd one at the end / the beginning; `VALID`:
//! none). Output length floor((in + b + e − ((K − 1)·d + 1)) / s) + 1; output o reads input
//! o·s − b + t·d for tap t (zero outside). Output channel m reads the input channels of its
//! group, m / (M / group).
//!
//! # ConvTranspose
//!
//! `X` [N, C, D…], `W` [C, M/group, K…], optional `B` [M]; `output_padding` (0), `output_shape`.
//! As the reference: with `auto_pad` SAME_UPPER or SAME_LOWER (and no `pads`) the output is
//! `output_shape` (default in·s) and the total padding s·(in − 1) + output_padding +
//! (K − 1)·d + 1 − out is split as Conv splits it; otherwise the padding is `pads` and the output
//! `output_shape`, or s·(in − 1) + output_padding + (K − 1)·d + 1 − b − e. Input i at tap t adds
//! to output i·s − b + t·d.
//!
//! Col2Im-18 is in [`col2im`]; ConvInteger-10 and QLinearConv-10 in [`qconv`]; DeformConv-19/22
//! in [`deform`].
//!
//! The CPU reference of float32, float16 and bfloat16 is the host's `conv` (ABI.md §4.8: im2col
//! and multithreaded GEMMs accumulating in f32; manifest schema 8); float64 computes here in
//! f64. The CUDA kernels accumulate in f32 (f64 for float64), for up to 3 spatial axes.
#![no_std]
extern crate alloc;

mod col2im;
mod deform;
mod qconv;

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::wire::CONV_MAX_SPATIAL;
use kiln_kernel_abi::{bail, export_shim, unsupported};

struct ConvShim;

/// ConvInteger and QLinearConv ([`qconv`]).
fn is_quant(call: &Call) -> bool {
    matches!(call.op_type(), "ConvInteger" | "QLinearConv")
}

/// Most spatial axes of the CUDA kernels.
const GPU_MAX_SPATIAL: usize = 3;
/// Largest kernel size, stride, dilation or padding taken (geometry then stays within i64).
const MAX_ATTR: i64 = i32::MAX as i64;

/// One node's geometry.
struct Geom {
    transpose: bool,
    dtype: DType,
    batch: usize,
    in_ch: usize,
    out_ch: usize,
    group: usize,
    input: Vec<usize>,
    output: Vec<usize>,
    kernel: Vec<usize>,
    strides: Vec<usize>,
    dilations: Vec<usize>,
    /// Padding before each spatial axis (negative: ConvTranspose's output starts inside).
    begin: Vec<i64>,
    /// The fused ops' epilogue: max(·, 0) after the sums.
    relu: bool,
    /// ConvAddRelu's Z: its element strides over Y's axes (0 where Z broadcasts), and whether it
    /// has Y's shape.
    z: Option<(Vec<u64>, bool)>,
}

/// An integer list attribute of `len` entries, each in `min..=MAX_ATTR`, or `default` repeated.
fn ints_attr(call: &Call, name: &str, len: usize, default: i64, min: i64) -> Result<Vec<i64>> {
    let op = call.op_type();
    let Some(v) = call.attr_ints(name)? else { return Ok(alloc::vec![default; len]) };
    if v.len() != len {
        bail!("{op}: {name} has {} entries, not {len}", v.len());
    }
    if let Some(x) = v.iter().find(|&&x| !(min..=MAX_ATTR).contains(&x)) {
        bail!("{op}: {name} entries must be in {min}..={MAX_ATTR}, not {x}");
    }
    Ok(v)
}

fn len_of(op: &str, v: i64) -> Result<usize> {
    match usize::try_from(v) {
        Ok(v) => Ok(v),
        Err(_) => bail!("{op}: an output length of {v} is not a valid size"),
    }
}

fn geom(call: &Call) -> Result<Geom> {
    let op = call.op_type();
    let transpose = op == "ConvTranspose";
    let fused = call.domain() == "ai.kiln";
    if fused && !matches!(op, "ConvRelu" | "ConvAddRelu") {
        unsupported!("kiln-conv does not implement ai.kiln::{op}");
    }
    // ConvInteger and QLinearConv: 8-bit X and W (QLinearConv's W is input 3).
    let quant = matches!(op, "ConvInteger" | "QLinearConv");
    let (x, w) = (call.input(0)?, call.input(if op == "QLinearConv" { 3 } else { 1 })?);
    let dtype = x.dtype()?;
    if quant {
        if !matches!(dtype, DType::U8 | DType::I8) || !matches!(w.dtype()?, DType::U8 | DType::I8) {
            unsupported!("{op}: X {dtype} and W {}; uint8 and int8 are supported", w.dtype()?);
        }
    } else if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::F64) {
        unsupported!("{op}: X has dtype {dtype}; float32, float16, bfloat16 and float64 are supported");
    } else if w.dtype()? != dtype {
        bail!("{op}: W is {} but X is {dtype}", w.dtype()?);
    }
    let (xs, ws) = (x.shape()?, w.shape()?);
    if xs.len() < 3 || ws.len() != xs.len() {
        bail!("{op}: X {xs:?} and W {ws:?} must be [N, C, D1, ...] and a kernel of the same rank");
    }
    let k = xs.len() - 2;
    let group = call.attr_i("group", 1)?;
    if !(1..=MAX_ATTR).contains(&group) {
        bail!("{op}: group must be positive, not {group}");
    }
    let group = group as usize;
    let (in_ch, out_ch) = if transpose {
        if ws[0] != xs[1] {
            bail!("{op}: W {ws:?} must have X's {} channels first", xs[1]);
        }
        (xs[1], ws[1] * group)
    } else {
        if ws[1] * group != xs[1] {
            bail!(
                "{op}: W {ws:?} has {} channels per group; X's {} over {group} groups is {}",
                ws[1],
                xs[1],
                xs[1] / group
            );
        }
        (xs[1], ws[0])
    };
    if in_ch % group != 0 || out_ch % group != 0 {
        bail!("{op}: {in_ch} input and {out_ch} output channels do not split into {group} groups");
    }
    if let Some(b) = call.input_opt(2).filter(|_| !quant) {
        if b.shape()? != [out_ch] || b.dtype()? != dtype {
            bail!("{op}: B must be {dtype} [{out_ch}], not {} {:?}", b.dtype()?, b.shape()?);
        }
    }
    let kernel: Vec<usize> = ws[2..].to_vec();
    if let Some(ks) = call.attr_ints("kernel_shape")? {
        if ks.iter().map(|&v| v as usize).ne(kernel.iter().copied()) {
            bail!("{op}: kernel_shape {ks:?} differs from W's spatial shape {kernel:?}");
        }
    }
    let strides = ints_attr(call, "strides", k, 1, 1)?;
    let dilations = ints_attr(call, "dilations", k, 1, 1)?;
    let auto_pad = call.attr_s("auto_pad", "NOTSET")?;
    let same = matches!(auto_pad, "SAME_UPPER" | "SAME_LOWER");
    if !same && !matches!(auto_pad, "NOTSET" | "VALID" | "") {
        bail!("{op}: auto_pad must be NOTSET, SAME_UPPER, SAME_LOWER or VALID, not {auto_pad:?}");
    }
    let input = xs[2..].to_vec();
    let extent = |d: usize| (kernel[d] as i64 - 1) * dilations[d] + 1;
    // Splits a total padding as SAME_UPPER (odd one at the end) or SAME_LOWER does.
    let split = |total: i64| {
        let small = total.div_euclid(2);
        if auto_pad == "SAME_UPPER" {
            (small, total - small)
        } else {
            (total - small, small)
        }
    };
    let mut begin = Vec::with_capacity(k);
    let mut output = Vec::with_capacity(k);
    if transpose {
        let out_pad = ints_attr(call, "output_padding", k, 0, 0)?;
        let out_shape = match call.attr_ints("output_shape")? {
            Some(v) if v.len() == k => Some(v),
            Some(v) if v.len() == k + 2 => Some(v[2..].to_vec()),
            Some(v) => bail!("{op}: output_shape {v:?} has neither {k} nor {} entries", k + 2),
            None => None,
        };
        let explicit_pads = call.attr_ints("pads")?.is_some();
        let pads = ints_attr(call, "pads", 2 * k, 0, 0)?;
        for d in 0..k {
            let natural = strides[d] * (input[d] as i64 - 1) + out_pad[d] + extent(d);
            if same && !explicit_pads {
                let o = out_shape.as_ref().map_or(input[d] as i64 * strides[d], |v| v[d]);
                begin.push(split(natural - o).0);
                output.push(len_of(op, o)?);
            } else {
                begin.push(pads[d]);
                let o = out_shape.as_ref().map_or(natural - pads[d] - pads[k + d], |v| v[d]);
                output.push(len_of(op, o)?);
            }
        }
    } else {
        let pads = ints_attr(call, "pads", 2 * k, 0, 0)?;
        for d in 0..k {
            let (i, s) = (input[d] as i64, strides[d]);
            let o = match auto_pad {
                "SAME_UPPER" | "SAME_LOWER" => {
                    let o = (i + s - 1) / s;
                    begin.push(split(((o.max(1) - 1) * s + extent(d) - i).max(0)).0);
                    o
                }
                "VALID" => {
                    begin.push(0);
                    if i < extent(d) {
                        0
                    } else {
                        (i - extent(d)) / s + 1
                    }
                }
                _ => {
                    begin.push(pads[d]);
                    let span = i + pads[d] + pads[k + d];
                    if span < extent(d) {
                        0
                    } else {
                        (span - extent(d)) / s + 1
                    }
                }
            };
            output.push(len_of(op, o)?);
        }
    }
    let mut out = alloc::vec![xs[0], out_ch];
    out.extend_from_slice(&output);
    shape::numel(&out)?;
    let z = match (op, call.input_opt(3)) {
        ("ConvAddRelu", Some(z)) => {
            let zs = z.shape()?;
            if z.dtype()? != dtype {
                bail!("{op}: Z is {} but X is {dtype}", z.dtype()?);
            }
            // Z broadcasts to Y (numpy rules, Z's axes right-aligned), as the Add it replaces
            // does when the convolution's output is the larger operand.
            let lead = out
                .len()
                .checked_sub(zs.len())
                .filter(|_| zs.iter().zip(&out[out.len().saturating_sub(zs.len())..]).all(|(&a, &b)| a == 1 || a == b));
            let Some(lead) = lead else {
                bail!("{op}: Z {zs:?} does not broadcast to the convolution's output {out:?}");
            };
            let mut strides = alloc::vec![0u64; out.len()];
            let mut step = 1u64;
            for a in (0..zs.len()).rev() {
                if zs[a] != 1 {
                    strides[lead + a] = step;
                }
                step *= zs[a] as u64;
            }
            Some((strides, zs == out))
        }
        ("ConvAddRelu", None) => bail!("{op}: Z (input 3) is required"),
        _ => None,
    };
    Ok(Geom {
        transpose,
        dtype,
        batch: xs[0],
        in_ch,
        out_ch,
        group,
        input,
        output,
        kernel,
        strides: strides.iter().map(|&v| v as usize).collect(),
        dilations: dilations.iter().map(|&v| v as usize).collect(),
        begin,
        relu: fused,
        z,
    })
}

impl Geom {
    /// The node as the host's `conv` (ABI.md §4.8), for a float32, float16 or bfloat16 node with
    /// no empty axis; `None`: the shim's own loop computes it.
    fn host_conv(&self, call: &Call) -> Result<Option<Conv>> {
        let sizes = [self.batch, self.in_ch, self.out_ch].into_iter().chain(self.input.iter().copied());
        if !matches!(self.dtype, DType::F32 | DType::F16 | DType::BF16)
            || self.input.len() > CONV_MAX_SPATIAL
            || sizes.chain(self.output.iter().copied()).any(|v| v == 0)
        {
            return Ok(None);
        }
        let at = |h: u32| TensorAt { handle: h, offset: 0 };
        let u = |v: &[usize]| v.iter().map(|&x| x as u64).collect::<Vec<_>>();
        Ok(Some(Conv {
            dtype: self.dtype,
            transposed: self.transpose,
            batch: self.batch as u64,
            in_channels: self.in_ch as u64,
            out_channels: self.out_ch as u64,
            groups: self.group as u64,
            input: u(&self.input),
            output: u(&self.output),
            kernel: u(&self.kernel),
            strides: u(&self.strides),
            dilations: u(&self.dilations),
            pads_begin: self.begin.clone(),
            x: at(call.input(0)?.handle()),
            w: at(call.input(1)?.handle()),
            bias: call.input_opt(2).map(|b| at(b.handle())),
            z: match &self.z {
                None => None,
                Some((_, true)) => Some(at(call.input(3)?.handle())),
                // A broadcast Z made whole, in scratch.
                Some((strides, false)) => {
                    let e = self.dtype.size().unwrap_or(4);
                    let bytes = call.input(3)?.read_bytes()?;
                    let out = self.out_shape();
                    let mut full = Vec::with_capacity(out.iter().product::<usize>() * e);
                    for i in 0..out.iter().product::<usize>() {
                        let at = Self::unflat(i, &out).iter().zip(strides).map(|(&p, &s)| p as u64 * s).sum::<u64>();
                        full.extend_from_slice(&bytes[at as usize * e..][..e]);
                    }
                    Some(at(scratch_from(&full)?))
                }
            },
            y: at(call.output(0)?.handle()),
            epilogue: if self.relu { Epilogue::Relu } else { Epilogue::None },
        }))
    }

    fn out_shape(&self) -> Vec<usize> {
        let mut s = alloc::vec![self.batch, self.out_ch];
        s.extend_from_slice(&self.output);
        s
    }

    /// Row-major index of `pos` in `dims`.
    fn flat(pos: &[usize], dims: &[usize]) -> usize {
        pos.iter().zip(dims).fold(0, |a, (&p, &d)| a * d + p)
    }

    /// The positions of a row-major index `i` over `dims`.
    fn unflat(mut i: usize, dims: &[usize]) -> Vec<usize> {
        let mut pos = alloc::vec![0; dims.len()];
        for a in (0..dims.len()).rev() {
            pos[a] = i % dims[a];
            i /= dims[a];
        }
        pos
    }

    fn run_cpu(&self, x: &[f64], w: &[f64], b: Option<&[f64]>) -> Vec<f64> {
        let (in_n, out_n) = (self.input.iter().product::<usize>(), self.output.iter().product::<usize>());
        let taps: usize = self.kernel.iter().product();
        let (cg, mg) = (self.in_ch / self.group, self.out_ch / self.group);
        let mut y = alloc::vec![0.0; self.batch * self.out_ch * out_n];
        for n in 0..self.batch {
            for m in 0..self.out_ch {
                let base = b.map_or(0.0, |b| b[m]);
                y[(n * self.out_ch + m) * out_n..][..out_n].iter_mut().for_each(|v| *v = base);
            }
        }
        // Every (input position, tap) pair that meets an output position, in input order.
        let k = self.input.len();
        for t in 0..taps {
            let tp = Self::unflat(t, &self.kernel);
            let (lo, hi) = (0usize, if self.transpose { in_n } else { out_n });
            for p in lo..hi {
                let pos = Self::unflat(p, if self.transpose { &self.input } else { &self.output });
                // The other side's position: Conv reads input o·s − b + t·d; ConvTranspose writes
                // output i·s − b + t·d.
                let mut other = alloc::vec![0usize; k];
                let mut inside = true;
                for a in 0..k {
                    let q = (pos[a] * self.strides[a]) as i64 - self.begin[a] + (tp[a] * self.dilations[a]) as i64;
                    let lim = if self.transpose { self.output[a] } else { self.input[a] };
                    inside &= q >= 0 && q < lim as i64;
                    other[a] = q.max(0) as usize;
                }
                if !inside {
                    continue;
                }
                let (xi, yi) = if self.transpose {
                    (p, Self::flat(&other, &self.output))
                } else {
                    (Self::flat(&other, &self.input), p)
                };
                for n in 0..self.batch {
                    for m in 0..self.out_ch {
                        let (grp, mm) = (m / mg, m % mg);
                        let mut acc = 0.0;
                        for c in 0..cg {
                            let ci = grp * cg + c;
                            let wv =
                                if self.transpose { w[(ci * mg + mm) * taps + t] } else { w[(m * cg + c) * taps + t] };
                            acc += x[(n * self.in_ch + ci) * in_n + xi] * wv;
                        }
                        y[(n * self.out_ch + m) * out_n + yi] += acc;
                    }
                }
            }
        }
        y
    }
}

impl Shim for ConvShim {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        if call.op_type() == "Col2Im" {
            return col2im::infer(call);
        }
        if call.op_type() == "DeformConv" {
            return deform::infer(call);
        }
        if is_quant(call) {
            return qconv::infer(call, &geom(call)?);
        }
        let g = geom(call)?;
        Ok(alloc::vec![TensorType::new(g.dtype, g.out_shape())])
    }

    fn cpu(call: &Call) -> Result<()> {
        if call.op_type() == "Col2Im" {
            return col2im::cpu(call);
        }
        if call.op_type() == "DeformConv" {
            return deform::cpu(call);
        }
        if is_quant(call) {
            return qconv::cpu(call, &geom(call)?);
        }
        let g = geom(call)?;
        if let Some(c) = g.host_conv(call)? {
            return conv(&c);
        }
        let x = call.input(0)?.read_vec::<f64>()?;
        let w = call.input(1)?.read_vec::<f64>()?;
        let b = match call.input_opt(2) {
            Some(t) => Some(t.read_vec::<f64>()?),
            None => None,
        };
        let mut y = g.run_cpu(&x, &w, b.as_deref());
        if let Some((strides, _)) = &g.z {
            let z = call.input(3)?.read_vec::<f64>()?;
            let out = g.out_shape();
            for (i, v) in y.iter_mut().enumerate() {
                *v += z[Geom::unflat(i, &out).iter().zip(strides).map(|(&p, &s)| p as u64 * s).sum::<u64>() as usize];
            }
        }
        if g.relu {
            y.iter_mut().for_each(|v| *v = v.max(0.0));
        }
        call.output(0)?.write_vec(&y)
    }

    fn dispatch(call: &Call) -> Result<()> {
        if call.op_type() == "Col2Im" {
            return col2im::dispatch(call);
        }
        if call.op_type() == "DeformConv" {
            return deform::dispatch(call);
        }
        if is_quant(call) {
            return qconv::dispatch(call, &geom(call)?);
        }
        let g = geom(call)?;
        // cuDNN through the host, unless Z needs broadcasting (that reads its bytes, which a
        // dispatch cannot) or the host declines the descriptor.
        if !matches!(g.z, Some((_, false))) {
            if let Some(c) = g.host_conv(call)? {
                if device_conv(&c)? {
                    return Ok(());
                }
            }
        }
        let op = call.op_type();
        let k = g.input.len();
        if k > GPU_MAX_SPATIAL {
            unsupported!("{op}: {k} spatial axes (the CUDA kernels take up to {GPU_MAX_SPATIAL})");
        }
        let Some(tag) = g.dtype.cuda_tag() else { unsupported!("{op}: no CUDA kernel for {}", g.dtype) };
        let y = call.output(0)?;
        if y.numel()? == 0 {
            return Ok(());
        }
        let z = match &g.z {
            Some((strides, _)) => Some((call.input(3)?.handle(), strides.as_slice())),
            None => None,
        };
        let bias = call.input_opt(2).map(|b| b.handle());
        g.launch_direct(tag, call.input(0)?.handle(), call.input(1)?.handle(), bias, z, y.handle())
    }
}

impl Geom {
    /// Launches `kiln_conv<tag>` (or the transposed one) over X, W, an optional bias and Z
    /// (with its strides over Y's axes) into Y: one thread per output element.
    fn launch_direct(
        &self,
        tag: &str,
        x: u32,
        w: u32,
        bias: Option<u32>,
        z: Option<(u32, &[u64])>,
        y: u32,
    ) -> Result<()> {
        let g = self;
        let k = g.input.len();
        let total = g.out_shape().iter().product::<usize>() as u64;
        if total == 0 {
            return Ok(());
        }
        let t = KernelArg::tensor;
        // conv.cu's CV_BIAS, CV_Z, CV_RELU.
        let flags = bias.is_some() as u32 | (z.is_some() as u32) << 1 | (g.relu as u32) << 2;
        let mut args = alloc::vec![
            t(x),
            t(w),
            t(bias.unwrap_or(x)),
            t(z.map_or(x, |z| z.0)),
            t(y),
            KernelArg::U64(total),
            KernelArg::U64(g.in_ch as u64),
            KernelArg::U64(g.out_ch as u64),
            KernelArg::U64(g.group as u64),
            KernelArg::U32(flags),
        ];
        // Z's strides over n, m and the three output slots (0 for the slots before the axes).
        let zs = |i: usize| z.map_or(0, |(_, s)| s[i]);
        args.extend([KernelArg::U64(zs(0)), KernelArg::U64(zs(1))]);
        args.extend(
            (0..GPU_MAX_SPATIAL)
                .map(|i| KernelArg::U64(if i + k < GPU_MAX_SPATIAL { 0 } else { zs(2 + i + k - GPU_MAX_SPATIAL) })),
        );
        // Spatial values right-aligned in three slots; `pad` before them. The padding before
        // goes as its two's complement (a ConvTranspose may start inside its output).
        let slots = |v: &[u64], pad: u64| -> Vec<KernelArg> {
            (0..GPU_MAX_SPATIAL)
                .map(|i| KernelArg::U64(if i + k < GPU_MAX_SPATIAL { pad } else { v[i + k - GPU_MAX_SPATIAL] }))
                .collect()
        };
        let u = |v: &[usize]| v.iter().map(|&x| x as u64).collect::<Vec<_>>();
        args.extend(slots(&u(&g.input), 1));
        args.extend(slots(&u(&g.output), 1));
        args.extend(slots(&u(&g.kernel), 1));
        args.extend(slots(&u(&g.strides), 1));
        args.extend(slots(&u(&g.dilations), 1));
        args.extend(slots(&g.begin.iter().map(|&b| b as u64).collect::<Vec<_>>(), 0));
        let name = if g.transpose { "kiln_conv_transpose" } else { "kiln_conv" };
        launch(&Launch {
            kernel: &kernel_name(name, &[tag]),
            grid: grid_stride(total),
            block: [GRID_STRIDE_BLOCK, 1, 1],
            shared_mem_bytes: 0,
            args,
        })
    }
}

export_shim!(ConvShim);
