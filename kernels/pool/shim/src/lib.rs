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
//! The CPU reference computes in f64 and rounds once (2-D float32 MaxPool without indices in f32:
//! a max rounds nothing), any range of the output elements from the input planes they read, so
//! the host may split a large node over its CPU threads (`cpu_tiles`, ABI.md §6.1.2). On the GPU
//! `kiln_pool<Tag>` runs one thread per output element, for up to 3 spatial dimensions.
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

/// Whether the shim runs 128-bit SIMD (Wasm `simd128`).
const SIMD: bool = cfg!(all(target_arch = "wasm32", target_feature = "simd128"));

/// `acc[i]` = `taps[i · S]` where that is greater (a NaN never is), for every `i` of `acc`; `S`
/// 0 takes the runtime `stride`. `taps` holds at least `(acc.len() − 1) · S + 1` values. Strides
/// 1 and 2 run four outputs at a time in 128-bit SIMD under Wasm (`f32x4.pmax(a, b)` is
/// `a < b ? b : a`: the same choice, NaN included): a 3 × 3 stride-2 MaxPool of 64 × 112² took
/// 8.8 ms in this shim with the scalar loop.
#[inline]
fn max_taps<const S: usize>(acc: &mut [f32], taps: &[f32], stride: usize) {
    let s = if S > 0 { S } else { stride };
    let n = acc.len();
    let mut i = 0;
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    if S == 1 || S == 2 {
        use core::arch::wasm32::*;
        // Four outputs need taps[i·S .. (i + 4)·S].
        while i + 4 <= n && (i + 4) * S <= taps.len() {
            // SAFETY: acc[i..i + 4] and taps[i·S..(i + 4)·S] are in bounds (checked above); Wasm
            // loads and stores take any alignment.
            unsafe {
                let a = v128_load(acc.as_ptr().add(i) as *const v128);
                let v = if S == 1 {
                    v128_load(taps.as_ptr().add(i) as *const v128)
                } else {
                    let lo = v128_load(taps.as_ptr().add(2 * i) as *const v128);
                    let hi = v128_load(taps.as_ptr().add(2 * i + 4) as *const v128);
                    i32x4_shuffle::<0, 2, 4, 6>(lo, hi)
                };
                v128_store(acc.as_mut_ptr().add(i) as *mut v128, f32x4_pmax(a, v));
            }
            i += 4;
        }
    }
    while i < n {
        let v = taps[i * s];
        if v > acc[i] {
            acc[i] = v;
        }
        i += 1;
    }
}

impl Plan {
    /// 2-D float32 MaxPool without indices, as [`Plan::pool`] computes it (taps in row-major
    /// order, the first inside value, then any greater one; NaN where no tap is inside), a row of
    /// outputs at a time: outputs `units` (row-major over planes and the spatial output) from `x`,
    /// the planes from `first_plane` on. That fold is NaN where its first tap is NaN
    /// and otherwise the first largest of the other values (a NaN is never greater), which is
    /// what the row pass keeps: it starts from −∞ and takes a value only when greater.
    fn max_pool_2d_f32(&self, x: &[f32], first_plane: usize, units: core::ops::Range<usize>) -> Vec<f32> {
        // Strides 1 and 2 take 128-bit SIMD (`max_taps`); the rest its indexed scalar loop.
        match self.strides[1] {
            1 => self.max_pool_rows::<1>(x, first_plane, units),
            2 => self.max_pool_rows::<2>(x, first_plane, units),
            3 => self.max_pool_rows::<3>(x, first_plane, units),
            4 => self.max_pool_rows::<4>(x, first_plane, units),
            _ => self.max_pool_rows::<0>(x, first_plane, units),
        }
    }

    /// [`Plan::max_pool_2d_f32`] with column stride S (0: `self.strides[1]`, any).
    fn max_pool_rows<const S: usize>(
        &self,
        xs: &[f32],
        first_plane: usize,
        units: core::ops::Range<usize>,
    ) -> Vec<f32> {
        let (ih, iw) = (self.input[0], self.input[1]);
        let (oh, ow) = (self.output[0], self.output[1]);
        let stride = if S > 0 { S } else { self.strides[1] };
        let (dil, begin) = (self.dilations[1] as i64, self.begin[1] as i64);
        // Input rows of output row o: first, step and count (those inside the input).
        let rows: Vec<(usize, usize, usize)> = (0..oh)
            .map(|o| {
                let start = o as i64 * self.strides[0] as i64 - self.begin[0] as i64;
                let d = self.dilations[0] as i64;
                let mut taps =
                    (0..self.kernel[0] as i64).map(|t| start + t * d).filter(|&i| (0..ih as i64).contains(&i));
                match taps.next() {
                    Some(first) => (first as usize, d as usize, 1 + taps.count()),
                    None => (0, 1, 0),
                }
            })
            .collect();
        // For column tap t: the output columns lo..hi whose tap t is inside, and the input column
        // of the first of them.
        let col_of = |o: usize, t: usize| o as i64 * stride as i64 - begin + t as i64 * dil;
        let spans: Vec<(usize, usize, usize)> = (0..self.kernel[1])
            .filter_map(|t| {
                let lo = (0..ow).find(|&o| col_of(o, t) >= 0)?;
                let hi = (lo..ow).find(|&o| col_of(o, t) >= iw as i64).unwrap_or(ow);
                (lo < hi).then(|| (lo, hi, col_of(lo, t) as usize))
            })
            .collect();
        // Stride 2 under Wasm SIMD: output columns g_lo..g_hi, in groups of four whose every tap's
        // eight-value load lies inside the row, take all their taps in registers (one store per
        // group instead of a load and a store per tap); the spans cover the other columns. For a
        // 3 × 3 MaxPool of 64 × 112² this took 2.2 ms against 3.0 by spans at stride 2, but 8.0
        // against 4.7 at stride 1, which stays with the spans.
        let kw = self.kernel[1];
        let (g_lo, g_hi) = if SIMD && S == 2 && kw > 0 {
            let g_lo = (0..ow).find(|&o| col_of(o, 0) >= 0).unwrap_or(ow);
            let fits = |g: usize| g + 4 <= ow && col_of(g + 3, kw - 1) + S as i64 <= iw as i64;
            let mut g_hi = g_lo;
            while fits(g_hi) {
                g_hi += 4;
            }
            (g_lo, g_hi)
        } else {
            (0, 0)
        };
        // Tap t's column from tap 0's.
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        let tap_offsets: Vec<usize> = (0..if g_hi > g_lo { kw } else { 0 }).map(|t| t * self.dilations[1]).collect();
        let spans: Vec<(usize, usize, usize)> = spans
            .into_iter()
            .flat_map(|(lo, hi, c0)| {
                let part = move |a: usize, b: usize| (a < b).then(|| (a, b, c0 + (a - lo) * stride));
                [part(lo, hi.min(g_lo.max(lo))), part(lo.max(g_hi), hi)]
            })
            .flatten()
            .collect();
        // Each output column's first inside tap (a NaN there is the output); usize::MAX where none
        // is inside.
        let first_col: Vec<usize> = (0..ow)
            .map(|o| {
                let mut cols = (0..self.kernel[1]).map(|t| col_of(o, t));
                cols.find(|c| (0..iw as i64).contains(c)).map_or(usize::MAX, |c| c as usize)
            })
            .collect();
        let mut out = Vec::with_capacity(units.len());
        let mut acc = alloc::vec![0f32; ow];
        let (first, last) = (units.start / ow, (units.end - 1) / ow); // output rows over all planes
        for row in first..=last {
            let (plane, r) = (row / oh - first_plane, row % oh);
            let plane = &xs[plane * ih * iw..][..ih * iw];
            let (r0, rs, rn) = rows[r];
            acc.iter_mut().for_each(|a| *a = f32::NEG_INFINITY);
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            {
                use core::arch::wasm32::*;
                let mut g = g_lo;
                while g < g_hi {
                    let mut m = f32x4_splat(f32::NEG_INFINITY);
                    // The group's first tap in the first inside row (col_of(g, 0) ≥ 0 as g ≥ g_lo).
                    let first = r0 * iw + col_of(g, 0) as usize;
                    for i in 0..rn {
                        for &off in &tap_offsets {
                            // SAFETY: the row r0 + i·rs is inside the plane, and g_hi's condition
                            // (col_of(g + 3, t) + 2 ≤ iw) keeps the 8 values from the tap's column
                            // inside it; Wasm loads take any alignment.
                            let v = unsafe {
                                let p = plane.as_ptr().add(first + i * rs * iw + off);
                                let a = v128_load(p as *const v128);
                                let b = v128_load(p.add(4) as *const v128);
                                i32x4_shuffle::<0, 2, 4, 6>(a, b)
                            };
                            m = f32x4_pmax(m, v);
                        }
                    }
                    // SAFETY: g + 4 ≤ ow = acc.len() (g_hi's condition).
                    unsafe { v128_store(acc.as_mut_ptr().add(g) as *mut v128, m) };
                    g += 4;
                }
            }
            for i in 0..rn {
                let line = &plane[(r0 + i * rs) * iw..][..iw];
                for &(lo, hi, c0) in &spans {
                    // The taps of outputs lo..hi: every stride-th value from c0.
                    let taps = &line[c0..=c0 + (hi - 1 - lo) * stride];
                    max_taps::<S>(&mut acc[lo..hi], taps, stride);
                }
            }
            // No tap inside: NaN; a NaN first tap: that NaN, quieted (its sign and payload, as the
            // general path's conversions through f64 keep them).
            if rn == 0 {
                acc.iter_mut().for_each(|a| *a = f32::NAN);
            } else {
                let line0 = &plane[r0 * iw..][..iw];
                for (a, &c0) in acc.iter_mut().zip(&first_col) {
                    match line0.get(c0) {
                        None => *a = f32::NAN,
                        Some(&v) if v.is_nan() => *a = f32::from_bits(v.to_bits() | 0x0040_0000),
                        Some(_) => {}
                    }
                }
            }
            let (a, b) = (units.start.max(row * ow) - row * ow, units.end.min((row + 1) * ow) - row * ow);
            out.extend_from_slice(&acc[a..b]);
        }
        out
    }

    /// Whether every window is its whole plane (GlobalAveragePool, GlobalMaxPool, or a kernel as
    /// large as the unpadded input) for Average or Max without indices: [`Plan::whole_planes`].
    fn is_whole(&self, indices: bool) -> bool {
        self.kernel == self.input
            && self.output.iter().all(|&o| o == 1)
            && self.dilations.iter().all(|&d| d == 1)
            && self.begin.iter().chain(&self.end).all(|&b| b == 0)
            && !indices
            && self.input.iter().product::<usize>() > 0
            && self.kind != Kind::Lp
    }

    /// The outputs `units` of an [`Plan::is_whole`] geometry from `x` (the planes from
    /// `first_plane` on, in the input's own type): Average and Max over each plane as one
    /// contiguous run, the values and their order as [`Plan::pool`] takes them (a sum in f64 in
    /// input order; the first tap, then each larger one).
    fn whole_planes<T: Element>(&self, x: &[T], first_plane: usize, units: core::ops::Range<usize>) -> Vec<f64> {
        let spatial: usize = self.input.iter().product();
        x.chunks_exact(spatial)
            .skip(units.start - first_plane)
            .take(units.len())
            .map(|v| match self.kind {
                Kind::Max => v[1..].iter().fold(v[0], |best, &t| if t > best { t } else { best }).to_f64(),
                // From +0 as `pool` sums (`Iterator::sum` starts from −0).
                _ => v.iter().fold(0f64, |sum, &t| sum + t.to_f64()) / spatial as f64,
            })
            .collect()
    }

    /// Output `o` (row-major over the spatial output) of plane `plane` from `x`, which holds the
    /// planes from `first_plane` on: the value, and for Max the flat index in X of the first
    /// largest element.
    fn pool(&self, x: &[f64], first_plane: usize, plane: usize, o: usize) -> (f64, i64) {
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
            let v = x[(plane - first_plane) * spatial + row];
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
        // The outputs of this call (a tile of them, §6.1.2: the host splits a large node over its
        // CPU threads) and the input planes they read.
        let per_plane: usize = p.output.iter().product();
        let spatial: usize = p.input.iter().product();
        let units = call.tile_units(p.planes * per_plane)?;
        if units.is_empty() || per_plane == 0 {
            return Ok(());
        }
        let first_plane = units.start / per_plane;
        let planes = (units.end - 1) / per_plane + 1 - first_plane;
        let x = call.input(0)?;
        if p.kind == Kind::Max && dtype == DType::F32 && p.input.len() == 2 && call.output_opt(1).is_none() {
            let xs = x.read_vec_range::<f32>(first_plane * spatial, planes * spatial)?;
            let start = units.start;
            return call.output(0)?.write_vec_at(start, &p.max_pool_2d_f32(&xs, first_plane, units));
        }
        if p.is_whole(call.output_opt(1).is_some()) {
            // float32 read as it lies (f32 → f64 is exact, so the sums are those of f64 input).
            let (at, len) = (first_plane * spatial, planes * spatial);
            let y = match dtype {
                DType::F32 => p.whole_planes(&x.read_vec_range::<f32>(at, len)?, first_plane, units.clone()),
                _ => p.whole_planes(&x.read_vec_range::<f64>(at, len)?, first_plane, units.clone()),
            };
            return call.output(0)?.write_vec_at(units.start, &y);
        }
        let x = x.read_vec_range::<f64>(first_plane * spatial, planes * spatial)?;
        let (mut y, mut idx) = (Vec::with_capacity(units.len()), Vec::new());
        for u in units.clone() {
            let (v, at) = p.pool(&x, first_plane, u / per_plane, u % per_plane);
            y.push(v);
            idx.push(at);
        }
        call.output(0)?.write_vec_at(units.start, &y)?;
        if let Some(t) = call.output_opt(1) {
            t.write_vec_at(units.start, &idx)?;
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
