//! Shim of `kiln-pool`: pooling over the spatial dimensions of `[N, C, D1, …, Dk]` tensors,
//! following ONNX Operators.md: MaxPool (1, 8, 10, 11, 12; the optional int64 `Indices`
//! output), AveragePool (1, 7, 10, 11, 19), LpPool (1, 2, 11, 18), GlobalMaxPool,
//! GlobalAveragePool and GlobalLpPool (1, 2); MaxUnpool (9, 11, 22) in [`unpool`].
//!
//! Geometry, per spatial dimension `d` (onnxruntime's and ONNX's reference semantics):
//! `kernel_shape`, `strides` (1), `dilations` (1), `pads` (`[b1, …, bk, e1, …, ek]`, 0) or
//! `auto_pad` (`SAME_UPPER` and `SAME_LOWER`: output `ceil(in / s)`, the total padding split
//! with the odd one at the end, or at the beginning; `VALID`: no padding). The window of output
//! `o` covers positions `o·s − b + i·dil`, `i < kernel`. The output size is
//! `floor((in + b + e − ((kernel − 1)·dil + 1)) / s) + 1`; with `ceil_mode` it is rounded up,
//! then reduced by one when the last window would start past `in + b`.
//!
//! - Max: the largest in-bounds value; `Indices` the flat index of its first occurrence in X,
//!   `(n·C + c)·∏Di + offset`, the offset row-major (`storage_order` 0) or column-major (1).
//! - Average: the sum of in-bounds values over their count, or with `count_include_pad` over
//!   the window positions before `in + e` (padding counted, ceil's overhang not).
//! - Lp: `(Σ |v|^p)^(1/p)` over in-bounds values (`p`, default 2).
//!
//! The CPU reference computes in f64 and rounds once. On the GPU `kiln_pool<Tag>` runs one thread
//! per output element, for up to 3 spatial dimensions.
#![no_std]
extern crate alloc;

mod unpool;

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, export_shim, unsupported};

struct Pool;

/// Most spatial dimensions (the CPU reference's per-window position arrays).
const MAX_SPATIAL: usize = 8;
/// Most spatial dimensions of the CUDA kernel.
const GPU_MAX_SPATIAL: usize = 3;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    // The CUDA kernel's codes.
    Max = 0,
    Average = 1,
    Lp = 2,
}

/// One node's pooling geometry.
struct Plan {
    kind: Kind,
    /// N·C.
    planes: usize,
    input: Vec<usize>,
    output: Vec<usize>,
    kernel: Vec<usize>,
    strides: Vec<usize>,
    dilations: Vec<usize>,
    /// Padding before each spatial dimension (its end padding only bounds count_include_pad).
    begin: Vec<usize>,
    end: Vec<usize>,
    count_include_pad: bool,
    p: f64,
    column_major: bool,
    out_shape: Vec<usize>,
}

/// Largest kernel size, stride, dilation or padding taken: window positions then stay within
/// i64 (the geometry is computed in u64 and i64, since the shim's usize is 32 bits).
const MAX_ATTR: i64 = i32::MAX as i64;

/// An integer list attribute of `len` entries, each in `min..=MAX_ATTR`, or `default` repeated.
fn dims_attr(call: &Call, name: &str, len: usize, default: usize, min: i64) -> Result<Vec<usize>> {
    let op = call.op_type();
    let Some(v) = call.attr_ints(name)? else { return Ok(vec![default; len]) };
    if v.len() != len {
        bail!("{op}: {name} has {} entries, not {len}", v.len());
    }
    if let Some(x) = v.iter().find(|&&x| !(min..=MAX_ATTR).contains(&x)) {
        bail!("{op}: {name} entries must be in {min}..={MAX_ATTR}, not {x}");
    }
    Ok(v.iter().map(|&x| x as usize).collect())
}

fn plan(call: &Call) -> Result<Plan> {
    let op = call.op_type();
    let (kind, global) = match op {
        "MaxPool" => (Kind::Max, false),
        "AveragePool" => (Kind::Average, false),
        "LpPool" => (Kind::Lp, false),
        "GlobalMaxPool" => (Kind::Max, true),
        "GlobalAveragePool" => (Kind::Average, true),
        "GlobalLpPool" => (Kind::Lp, true),
        other => unsupported!("kiln-pool does not implement {other}"),
    };
    let x = call.input(0)?;
    let shape = x.shape()?;
    if shape.len() < 3 {
        bail!("{op}: the input must be [N, C, D1, ...], not of rank {}", shape.len());
    }
    let input = shape[2..].to_vec();
    let k = input.len();
    if k > MAX_SPATIAL {
        unsupported!("{op}: {k} spatial dimensions (kiln-pool takes up to {MAX_SPATIAL})");
    }
    let p = match kind {
        Kind::Lp => {
            // LpPool-1's p is a float attribute; from opset 2 an int.
            let p = if call.opset() < 2 { call.attr_f("p", 2.0)? as f64 } else { call.attr_i("p", 2)? as f64 };
            if p <= 0.0 {
                bail!("{op}: p must be positive, not {p}");
            }
            p
        }
        _ => 1.0,
    };
    let (kernel, strides, dilations, mut begin, mut end, ceil) = if global {
        (input.clone(), vec![1; k], vec![1; k], vec![0; k], vec![0; k], false)
    } else {
        if call.attr_ints("kernel_shape")?.is_none() {
            bail!("{op}: kernel_shape is required");
        }
        let kernel = dims_attr(call, "kernel_shape", k, 1, 1)?;
        if kernel.iter().try_fold(1usize, |a, &v| a.checked_mul(v)).is_none() {
            bail!("{op}: kernel_shape {kernel:?} has more taps than the shim's 32-bit sizes hold");
        }
        let pads = dims_attr(call, "pads", 2 * k, 0, 0)?;
        // As onnxruntime: a window never lies wholly in the padding.
        if let Some(d) = (0..k).find(|&d| pads[d] >= kernel[d] || pads[k + d] >= kernel[d]) {
            bail!("{op}: pads {pads:?} must be smaller than kernel_shape {kernel:?} (axis {d})");
        }
        (
            kernel,
            dims_attr(call, "strides", k, 1, 1)?,
            dims_attr(call, "dilations", k, 1, 1)?,
            pads[..k].to_vec(),
            pads[k..].to_vec(),
            call.attr_i("ceil_mode", 0)? != 0,
        )
    };
    let auto_pad = if global { "NOTSET" } else { call.attr_s("auto_pad", "NOTSET")? };
    let mut output = Vec::with_capacity(k);
    for d in 0..k {
        // In u64: each term is at most MAX_ATTR (or a dimension), so nothing below overflows.
        let extent = (kernel[d] as u64 - 1) * dilations[d] as u64 + 1;
        let (i, s) = (input[d] as u64, strides[d] as u64);
        let (b, e) = (begin[d] as u64, end[d] as u64);
        let o: u64 = match auto_pad {
            "SAME_UPPER" | "SAME_LOWER" => {
                let o = i.div_ceil(s);
                let total = ((o.max(1) - 1) * s + extent).saturating_sub(i);
                let small = total / 2;
                let (tb, te) = if auto_pad == "SAME_UPPER" { (small, total - small) } else { (total - small, small) };
                // total < extent + s: within usize once checked.
                (begin[d], end[d]) = (usize_of(op, tb)?, usize_of(op, te)?);
                o
            }
            "VALID" => {
                (begin[d], end[d]) = (0, 0);
                if i < extent {
                    0
                } else {
                    (i - extent) / s + 1
                }
            }
            "NOTSET" | "" => {
                let span = i + b + e;
                if span < extent {
                    0
                } else if ceil {
                    let mut o = (span - extent).div_ceil(s) + 1;
                    if (o - 1) * s >= i + b {
                        o -= 1;
                    }
                    o
                } else {
                    (span - extent) / s + 1
                }
            }
            other => bail!("{op}: auto_pad must be NOTSET, SAME_UPPER, SAME_LOWER or VALID, not {other:?}"),
        };
        output.push(usize_of(op, o)?);
    }
    let mut out_shape = shape[..2].to_vec();
    out_shape.extend(&output);
    let storage_order = call.attr_i("storage_order", 0)?;
    if !(0..=1).contains(&storage_order) {
        bail!("{op}: storage_order must be 0 or 1, not {storage_order}");
    }
    Ok(Plan {
        kind,
        planes: shape[0] * shape[1],
        input,
        output,
        kernel,
        strides,
        dilations,
        begin,
        end,
        count_include_pad: call.attr_i("count_include_pad", 0)? != 0,
        p,
        column_major: storage_order == 1,
        out_shape,
    })
}

/// `v` as usize (32 bits in the shim), or a clear error.
fn usize_of(op: &str, v: u64) -> Result<usize> {
    match usize::try_from(v) {
        Ok(v) => Ok(v),
        Err(_) => bail!("{op}: a pooling size of {v} does not fit the shim's 32-bit sizes"),
    }
}

impl Plan {
    /// Output `o` (row-major over the spatial output) of plane `plane`: the value, and for Max
    /// the flat index of the first largest element.
    /// 2-D float32 MaxPool without indices, as [`Plan::pool`] computes it (taps in order, the
    /// first inside value, then any greater one; NaN where no tap is inside), in one pass of
    /// plain loops.
    fn max_pool_2d_f32(&self, x: &[u8]) -> Vec<u8> {
        let (ih, iw) = (self.input[0], self.input[1]);
        let (oh, ow) = (self.output[0], self.output[1]);
        let xs: Vec<f32> = x.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let mut out = Vec::with_capacity(self.planes * oh * ow * 4);
        // The taps of one axis inside the input for output position o: kernel indices lo..hi.
        let inside = |o: usize, d: usize, n: usize| {
            let start = o as i64 * self.strides[d] as i64 - self.begin[d] as i64;
            let dil = self.dilations[d] as i64;
            (0..self.kernel[d] as i64)
                .filter(move |t| (0..n as i64).contains(&(start + t * dil)))
                .map(move |t| (start + t * dil) as usize)
        };
        let rows: Vec<Vec<usize>> = (0..oh).map(|o| inside(o, 0, ih).collect()).collect();
        let cols: Vec<Vec<usize>> = (0..ow).map(|o| inside(o, 1, iw).collect()).collect();
        for plane in xs.chunks_exact(ih * iw) {
            for r in &rows {
                for c in &cols {
                    let mut best: Option<f32> = None;
                    for &i in r {
                        let line = &plane[i * iw..(i + 1) * iw];
                        for &j in c {
                            let v = line[j];
                            if best.is_none_or(|b| v > b) {
                                best = Some(v);
                            }
                        }
                    }
                    out.extend_from_slice(&best.unwrap_or(f32::NAN).to_le_bytes());
                }
            }
        }
        out
    }

    fn pool(&self, x: &[f64], plane: usize, o: usize) -> (f64, i64) {
        let k = self.input.len();
        let mut rest = o;
        let mut start = [0i64; MAX_SPATIAL];
        for d in (0..k).rev() {
            let od = rest % self.output[d];
            rest /= self.output[d];
            start[d] = od as i64 * self.strides[d] as i64 - self.begin[d] as i64;
        }
        let spatial: usize = self.input.iter().product();
        let (mut best, mut best_at, mut sum, mut values, mut counted) =
            (f64::NEG_INFINITY, -1i64, 0f64, 0usize, 0usize);
        let taps: usize = self.kernel.iter().product();
        for t in 0..taps {
            let (mut rest, mut inside, mut before_end) = (t, true, true);
            let (mut row, mut col, mut stride_c) = (0usize, 0usize, 1usize);
            let mut pos = [0i64; MAX_SPATIAL];
            for d in (0..k).rev() {
                let i = rest % self.kernel[d];
                rest /= self.kernel[d];
                pos[d] = start[d] + i as i64 * self.dilations[d] as i64;
                inside &= pos[d] >= 0 && pos[d] < self.input[d] as i64;
                before_end &= pos[d] < self.input[d] as i64 + self.end[d] as i64;
            }
            if before_end {
                counted += 1;
            }
            if !inside {
                continue;
            }
            for (&p, &n) in pos[..k].iter().zip(&self.input) {
                row = row * n + p as usize;
                col += p as usize * stride_c;
                stride_c *= n;
            }
            let v = x[plane * spatial + row];
            values += 1;
            match self.kind {
                Kind::Max => {
                    if best_at < 0 || v > best {
                        best = v;
                        best_at = (plane * spatial + if self.column_major { col } else { row }) as i64;
                    }
                }
                Kind::Average => sum += v,
                Kind::Lp => sum += libm::pow(v.abs(), self.p),
            }
        }
        match self.kind {
            Kind::Max => (if best_at < 0 { f64::NAN } else { best }, best_at.max(0)),
            Kind::Average => (sum / (if self.count_include_pad { counted } else { values }) as f64, 0),
            Kind::Lp => (libm::pow(sum, 1.0 / self.p), 0),
        }
    }
}

fn check_dtype(call: &Call, kind: Kind) -> Result<DType> {
    let d = call.input(0)?.dtype()?;
    match d {
        d if d.is_float() => Ok(d),
        DType::I8 | DType::U8 if kind == Kind::Max => Ok(d),
        d => unsupported!("{}: {d} input is not supported", call.op_type()),
    }
}

impl Shim for Pool {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        if call.op_type() == "MaxUnpool" {
            return unpool::infer(call);
        }
        let p = plan(call)?;
        let dtype = check_dtype(call, p.kind)?;
        let mut out = vec![TensorType::new(dtype, p.out_shape.clone())];
        if call.num_outputs() > 1 {
            if p.kind != Kind::Max || call.op_type() != "MaxPool" {
                bail!("{}: has one output, the node asks for {}", call.op_type(), call.num_outputs());
            }
            out.push(TensorType::new(DType::I64, p.out_shape));
        }
        Ok(out)
    }

    fn cpu(call: &Call) -> Result<()> {
        if call.op_type() == "MaxUnpool" {
            return unpool::cpu(call);
        }
        let p = plan(call)?;
        let dtype = check_dtype(call, p.kind)?;
        if p.kind == Kind::Max && dtype == DType::F32 && p.input.len() == 2 && call.output_opt(1).is_none() {
            let x = call.input(0)?.read_bytes()?;
            return call.output(0)?.write_bytes(&p.max_pool_2d_f32(&x));
        }
        let x = call.input(0)?.read_vec::<f64>()?;
        let per_plane: usize = p.output.iter().product();
        let (mut y, mut idx) = (Vec::with_capacity(p.planes * per_plane), Vec::new());
        for plane in 0..p.planes {
            for o in 0..per_plane {
                let (v, at) = p.pool(&x, plane, o);
                y.push(v);
                idx.push(at);
            }
        }
        call.output(0)?.write_vec(&y)?;
        if let Some(t) = call.output_opt(1) {
            t.write_vec(&idx)?;
        }
        Ok(())
    }

    fn dispatch(call: &Call) -> Result<()> {
        if call.op_type() == "MaxUnpool" {
            return unpool::dispatch(call);
        }
        let p = plan(call)?;
        let dtype = check_dtype(call, p.kind)?;
        let k = p.input.len();
        if k > GPU_MAX_SPATIAL {
            unsupported!("{}: {k} spatial dimensions (the CUDA kernel takes up to {GPU_MAX_SPATIAL})", call.op_type());
        }
        let Some(tag) = dtype.cuda_tag() else { unsupported!("{}: no CUDA kernel for {dtype}", call.op_type()) };
        let total = (p.planes * p.output.iter().product::<usize>()) as u64;
        if total == 0 {
            return Ok(());
        }
        let y = call.output(0)?;
        let idx = call.output_opt(1);
        let t = KernelArg::tensor;
        let mut args = vec![
            t(call.input(0)?.handle()),
            t(y.handle()),
            t(idx.as_ref().map_or(y.handle(), |i| i.handle())),
            KernelArg::U64(total),
            KernelArg::U32(p.kind as u32),
            KernelArg::U32(p.count_include_pad as u32),
            KernelArg::U32(idx.is_some() as u32),
            KernelArg::U32(p.column_major as u32),
            KernelArg::F32(p.p as f32),
        ];
        // Three spatial dimensions, leading ones of size 1 for fewer.
        let pad = GPU_MAX_SPATIAL - k;
        let at = |v: &[usize], d: usize, one: usize| if d < pad { one } else { v[d - pad] };
        for d in 0..GPU_MAX_SPATIAL {
            for (v, one) in [
                (&p.input, 1),
                (&p.output, 1),
                (&p.kernel, 1),
                (&p.strides, 1),
                (&p.dilations, 1),
                (&p.begin, 0),
                (&p.end, 0),
            ] {
                args.push(KernelArg::I64(at(v, d, one) as i64));
            }
        }
        launch(&Launch {
            kernel: &kernel_name("kiln_pool", &[tag]),
            grid: grid_stride(total),
            block: [GRID_STRIDE_BLOCK, 1, 1],
            shared_mem_bytes: 0,
            args,
        })
    }
}

export_shim!(Pool);
