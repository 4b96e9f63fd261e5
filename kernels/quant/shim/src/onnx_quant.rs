//! ONNX's linear quantization: QuantizeLinear and DequantizeLinear (10, 13, 19, 21, 23, 24, 25)
//! and DynamicQuantizeLinear (11), after ONNX Operators.md and its reference implementation.
//!
//! * QuantizeLinear: `y = saturate(rint(x / y_scale) + y_zero_point)` (x / y_scale in f32,
//!   rint rounding half to even), `y` of y_zero_point's type, else `output_dtype` (21+), else
//!   uint8: uint8, int8, uint16, int16, and (manifest schema 11) int4, uint4, int2, uint2. To
//!   a float8 type: `x / y_scale` rounded to nearest even, saturated when `saturate` (default 1),
//!   the zero point (which must be 0) ignored; to float4e2m1: `x / y_scale + y_zero_point`,
//!   rounded to nearest even and saturated.
//! * DequantizeLinear: `y = (x − x_zero_point) · x_scale` in f32, `y` of x_scale's dtype; x
//!   uint8, int8, uint16, int16, int32 (whose zero point must be 0), int4, uint4, int2, uint2;
//!   or a float8 type or float4e2m1, whose zero point is ignored (`y = x · x_scale`, as ONNX's
//!   reference).
//! * Scales and zero points: a scalar (per tensor), a 1-D tensor along `axis` (default 1; per
//!   axis), or from opset 21 a tensor of x's rank whose `axis` dimension is ceil(D / block_size)
//!   (`block_size` > 0; blocked).
//! * DynamicQuantizeLinear: x float32; min and max of x and 0, `y_scale = (max − min) / 255`
//!   (1 when x is all zeros), `y_zero_point = rint(clamp(−min / y_scale, 0, 255))`, `y` as
//!   QuantizeLinear to uint8.
use super::{grid_for, BLOCK};
use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, minifloat, unsupported};

/// An integer element type of the kernels (onnx_quant.cu's codes: 0 … 4, and the ONNX dtype
/// codes of the packed 4-bit and 2-bit types) and its range.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Int {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    I32 = 4,
    U4 = 21,
    I4 = 22,
    U2 = 25,
    I2 = 26,
}

impl Int {
    pub(crate) fn of(d: DType) -> Option<Int> {
        Some(match d {
            DType::U8 => Int::U8,
            DType::I8 => Int::I8,
            DType::U16 => Int::U16,
            DType::I16 => Int::I16,
            DType::I32 => Int::I32,
            DType::U4 => Int::U4,
            DType::I4 => Int::I4,
            DType::U2 => Int::U2,
            DType::I2 => Int::I2,
            _ => return None,
        })
    }
    pub(crate) fn range(self) -> (f64, f64) {
        match self {
            Int::U8 => (0.0, 255.0),
            Int::I8 => (-128.0, 127.0),
            Int::U16 => (0.0, 65535.0),
            Int::I16 => (-32768.0, 32767.0),
            Int::I32 => (i32::MIN as f64, i32::MAX as f64),
            Int::U4 => (0.0, 15.0),
            Int::I4 => (-8.0, 7.0),
            Int::U2 => (0.0, 3.0),
            Int::I2 => (-2.0, 1.0),
        }
    }
    /// `v` rounded already, saturated to the type.
    pub(crate) fn saturate(self, v: f64) -> f64 {
        let (lo, hi) = self.range();
        if v.is_nan() {
            0.0
        } else {
            v.clamp(lo, hi)
        }
    }
}

/// How scales and zero points map onto x, seen as [outer, A, inner] around `axis`.
#[derive(Clone, Copy)]
enum Layout {
    Tensor,
    Axis,
    /// Blocks of this many along the axis.
    Blocked(usize),
}

struct Plan {
    layout: Layout,
    axis_len: usize,
    inner: usize,
    /// The scale's length along the axis (blocked).
    scale_axis: usize,
}

impl Plan {
    fn param(&self, i: usize) -> usize {
        let (inn, a, o) = (i % self.inner, (i / self.inner) % self.axis_len, i / (self.inner * self.axis_len));
        match self.layout {
            Layout::Tensor => 0,
            Layout::Axis => a,
            Layout::Blocked(b) => (o * self.scale_axis + a / b) * self.inner + inn,
        }
    }

    fn args(&self) -> [KernelArg; 5] {
        let (code, block) = match self.layout {
            Layout::Tensor => (0, 1),
            Layout::Axis => (1, 1),
            Layout::Blocked(b) => (2, b),
        };
        [
            KernelArg::U32(code),
            KernelArg::U64(self.axis_len as u64),
            KernelArg::U64(self.inner as u64),
            KernelArg::U64(block as u64),
            KernelArg::U64(self.scale_axis as u64),
        ]
    }
}

/// The layout of `scale` (and of the zero point, which must match it) over `x`.
fn plan(call: &Call, x: &[usize]) -> Result<Plan> {
    let op = call.op_type();
    let scale = call.input(1)?;
    let ss = scale.shape()?;
    if let Some(z) = call.input_opt(2) {
        if z.shape()? != ss && !(z.numel()? == 1 && scale.numel()? == 1) {
            bail!("{op}: the zero point {:?} must have the scale's shape {ss:?}", z.shape()?);
        }
    }
    let r = x.len() as i64;
    let axis = call.attr_i("axis", 1)?;
    let block = call.attr_i("block_size", 0)?;
    let whole = Plan { layout: Layout::Tensor, axis_len: 1, inner: 1, scale_axis: 1 };
    if scale.numel()? == 1 && block == 0 {
        return Ok(Plan { inner: x.iter().product::<usize>().max(1), ..whole });
    }
    let a = if axis < 0 { axis + r } else { axis };
    if !(0..r).contains(&a) {
        bail!("{op}: axis {axis} is outside x's rank {r}");
    }
    let a = a as usize;
    let (axis_len, inner) = (x[a], x[a + 1..].iter().product::<usize>().max(1));
    if block == 0 {
        if ss != [x[a]] {
            bail!("{op}: a per-axis scale must be 1-D of x's axis-{a} length {}, not {ss:?}", x[a]);
        }
        return Ok(Plan { layout: Layout::Axis, axis_len, inner, scale_axis: 1 });
    }
    if block < 0 || call.opset() < 21 {
        bail!("{op}: block_size {block} needs opset 21 and a positive value");
    }
    let b = block as usize;
    let mut want = x.to_vec();
    want[a] = x[a].div_ceil(b);
    if ss != want {
        bail!("{op}: a blocked scale over x {x:?} with block_size {b} along axis {a} must be {want:?}, not {ss:?}");
    }
    Ok(Plan { layout: Layout::Blocked(b), axis_len, inner, scale_axis: want[a] })
}

fn float(op: &str, what: &str, d: DType) -> Result<()> {
    if !matches!(d, DType::F32 | DType::F16 | DType::BF16) {
        unsupported!("{op}: {what} has dtype {d}; float32, float16 and bfloat16 are supported");
    }
    Ok(())
}

/// What QuantizeLinear produces: integers, or codes of a float8 type or float4e2m1 (by their
/// ONNX dtype code in the kernels).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Quantized {
    Int(Int),
    Float(DType),
}

impl Quantized {
    /// The kernels' code of the output type.
    fn code(self) -> u32 {
        match self {
            Quantized::Int(i) => i as u32,
            Quantized::Float(d) => d.code() as u32,
        }
    }
}

/// QuantizeLinear's output type.
fn quantized(call: &Call) -> Result<(DType, Quantized)> {
    let op = call.op_type();
    let d = match (call.input_opt(2), call.attr_i("output_dtype", 0)?) {
        (Some(z), o) => {
            let d = z.dtype()?;
            if o != 0 && o != d as i64 {
                bail!("{op}: output_dtype {o} differs from y_zero_point's {d}");
            }
            d
        }
        (None, 0) => DType::U8,
        (None, o) => match DType::from_code(o as i32) {
            Some(d) => d,
            None => unsupported!("{op}: output_dtype {o} is not a type kiln has"),
        },
    };
    match Int::of(d) {
        Some(i) if i != Int::I32 => Ok((d, Quantized::Int(i))),
        _ if d.is_minifloat() && d != DType::F8E8M0 => Ok((d, Quantized::Float(d))),
        _ => unsupported!(
            "{op}: quantizing to {d}; uint8, int8, uint16, int16, 4-bit and 2-bit integers, float8 and float4e2m1 are supported"
        ),
    }
}

pub(crate) fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let op = call.op_type();
    let x = call.input(0)?;
    let shape = x.shape()?;
    match op {
        "QuantizeLinear" => {
            float(op, "x", x.dtype()?)?;
            float(op, "y_scale", call.input(1)?.dtype()?)?;
            plan(call, &shape)?;
            Ok(alloc::vec![TensorType::new(quantized(call)?.0, shape)])
        }
        "DequantizeLinear" => {
            let s = call.input(1)?.dtype()?;
            float(op, "x_scale", s)?;
            let xd = x.dtype()?;
            if Int::of(xd).is_none() && !(xd.is_minifloat() && xd != DType::F8E8M0) {
                unsupported!(
                    "{op}: x of {xd}; 8-, 16- and 32-bit, 4-bit and 2-bit integers, float8 and float4e2m1 are supported"
                );
            }
            if let Some(z) = call.input_opt(2) {
                if z.dtype()? != x.dtype()? {
                    bail!("{op}: x_zero_point is {} but x is {}", z.dtype()?, x.dtype()?);
                }
            }
            let o = call.attr_i("output_dtype", 0)?;
            if o != 0 && o != s as i64 {
                unsupported!("{op}: output_dtype {o} other than x_scale's {s}");
            }
            plan(call, &shape)?;
            Ok(alloc::vec![TensorType::new(s, shape)])
        }
        _ => {
            if x.dtype()? != DType::F32 {
                bail!("{op}: x must be float32, not {}", x.dtype()?);
            }
            Ok(alloc::vec![
                TensorType::new(DType::U8, shape),
                TensorType::new(DType::F32, Vec::new()),
                TensorType::new(DType::U8, Vec::new()),
            ])
        }
    }
}

pub(crate) fn cpu(call: &Call) -> Result<()> {
    let op = call.op_type();
    infer(call)?;
    let x = call.input(0)?;
    let shape = x.shape()?;
    let xv = x.read_vec::<f64>()?;
    match op {
        "QuantizeLinear" | "DequantizeLinear" => {
            let p = plan(call, &shape)?;
            let scale = call.input(1)?.read_vec::<f64>()?;
            let zp = match call.input_opt(2) {
                Some(z) => z.read_vec::<f64>()?,
                None => Vec::new(),
            };
            let z = |i: usize| zp.get(p.param(i)).copied().unwrap_or(0.0);
            let y = call.output(0)?;
            if op == "QuantizeLinear" {
                let q = |i: usize| xv[i] as f32 / scale[p.param(i)] as f32;
                return match quantized(call)?.1 {
                    Quantized::Int(t) => {
                        let v = |i| libm::rintf(q(i)) as f64;
                        let y_i = |i| t.saturate(if v(i).is_nan() { z(i) } else { v(i) + z(i) });
                        y.write_vec(&(0..xv.len()).map(y_i).collect::<Vec<f64>>())
                    }
                    Quantized::Float(d) => {
                        // float4e2m1 adds a zero point it is given; a float8 one must be 0 and is
                        // ignored (no `+ 0`, which would turn -0 into +0).
                        let add_zp = d == DType::F4E2M1 && !zp.is_empty();
                        let v = |i| if add_zp { q(i) + z(i) as f32 } else { q(i) };
                        let saturate = call.attr_i("saturate", 1)? != 0;
                        let codes = (0..xv.len()).map(|i| minifloat::from_f64(d, v(i) as f64, saturate));
                        y.write_bytes(&minifloat::pack(d, codes))
                    }
                };
            }
            // A float8 or float4 zero point is ignored (ONNX's reference).
            let ignore_zp = x.dtype()?.is_minifloat();
            let z = |i| if ignore_zp { 0.0 } else { z(i) };
            y.write_vec(
                &(0..xv.len()).map(|i| ((xv[i] - z(i)) as f32 * scale[p.param(i)] as f32) as f64).collect::<Vec<_>>(),
            )
        }
        _ => {
            let (lo, hi) = xv.iter().fold((0f32, 0f32), |(lo, hi), &v| (lo.min(v as f32), hi.max(v as f32)));
            let scale = if hi == lo { 1.0 } else { (hi - lo) / 255.0 };
            let zp = libm::rintf((0.0 - lo / scale).clamp(0.0, 255.0));
            let y: Vec<f64> =
                xv.iter().map(|&v| (libm::rintf(v as f32 / scale) + zp).clamp(0.0, 255.0) as f64).collect();
            call.output(0)?.write_vec(&y)?;
            if let Some(t) = call.output_opt(1) {
                t.write_vec(&[scale as f64])?;
            }
            if let Some(t) = call.output_opt(2) {
                t.write_vec(&[zp as f64])?;
            }
            Ok(())
        }
    }
}

pub(crate) fn dispatch(call: &Call) -> Result<()> {
    let op = call.op_type();
    infer(call)?;
    let x = call.input(0)?;
    let n = x.numel()?;
    match op {
        "QuantizeLinear" | "DequantizeLinear" => {
            let p = plan(call, &x.shape()?)?;
            let scale = call.input(1)?;
            let zp = call.input_opt(2);
            let y = call.output(0)?;
            let quant = op == "QuantizeLinear";
            // The integer or float8/float4 side's kernel code (onnx_quant.cu).
            let (float_dtype, code) = if quant {
                (x.dtype()?, quantized(call)?.1.code())
            } else {
                let xd = x.dtype()?;
                (scale.dtype()?, Int::of(xd).map_or(xd.code() as u32, |i| i as u32))
            };
            let saturate = quant && call.attr_i("saturate", 1)? != 0;
            if scale.dtype()? != float_dtype {
                unsupported!("{op}: the CUDA kernel takes a scale of {float_dtype}, not {}", scale.dtype()?);
            }
            let Some(tag) = float_dtype.cuda_tag() else { unsupported!("{op}: no CUDA kernel for {float_dtype}") };
            if n == 0 {
                return Ok(());
            }
            let name = if quant { "kiln_quantize_linear" } else { "kiln_dequantize_linear" };
            let mut args = alloc::vec![
                KernelArg::tensor(x.handle()),
                KernelArg::tensor(scale.handle()),
                KernelArg::tensor(zp.as_ref().map_or(x.handle(), |z| z.handle())),
                KernelArg::tensor(y.handle()),
                KernelArg::U64(n as u64),
                // Flags: bit 0 a zero point is given, bit 1 `saturate` (to float8).
                KernelArg::U32(u32::from(zp.is_some()) | u32::from(saturate) << 1),
                KernelArg::U32(code),
            ];
            args.extend(p.args());
            launch(&Launch {
                kernel: &kernel_name(name, &[tag]),
                grid: [grid_for(n), 1, 1],
                block: [BLOCK, 1, 1],
                shared_mem_bytes: 0,
                args,
            })
        }
        _ => {
            let (y, scale, zp) = (call.output(0)?, call.output_opt(1), call.output_opt(2));
            // The scale and zero point go to scratch when the node leaves them out.
            let s = match &scale {
                Some(t) => t.handle(),
                None => scratch(4)?,
            };
            let z = match &zp {
                Some(t) => t.handle(),
                None => scratch(1)?,
            };
            let n64 = KernelArg::U64(n as u64);
            launch(&Launch {
                kernel: "kiln_dql_params",
                grid: [1, 1, 1],
                block: [1024, 1, 1],
                shared_mem_bytes: 0,
                args: alloc::vec![KernelArg::tensor(x.handle()), KernelArg::tensor(s), KernelArg::tensor(z), n64],
            })?;
            if n == 0 {
                return Ok(());
            }
            launch(&Launch {
                kernel: "kiln_dql_apply",
                grid: [grid_for(n), 1, 1],
                block: [BLOCK, 1, 1],
                shared_mem_bytes: 0,
                args: alloc::vec![
                    KernelArg::tensor(x.handle()),
                    KernelArg::tensor(s),
                    KernelArg::tensor(z),
                    KernelArg::tensor(y.handle()),
                    n64
                ],
            })
        }
    }
}
