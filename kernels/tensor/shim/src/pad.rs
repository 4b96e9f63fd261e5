//! Pad-2/11/13/18/19/21/23/24/25 (ONNX Operators.md): each axis grows by `pads` elements at its
//! start and end (negative pads crop). `pads` is an attribute before opset 11 and input 1 (int64,
//! a value input) from it; from opset 18 input 3 (`axes`) names the axes the pads apply to (all
//! when absent). `mode`:
//!
//! - `constant`: new elements are `value` (attribute before 11, the optional scalar input 2
//!   from it; 0 when absent);
//! - `edge`: the nearest edge element;
//! - `reflect`: mirrored about the edge element, which is not repeated (numpy's `reflect`,
//!   repeatedly when the pad is longer than the axis);
//! - `wrap` (opset 19): taken from the other end (numpy's `wrap`).
//!
//! As ONNX's reference does, an axis cropped at one end and padded at the other is cropped first:
//! edge, reflect and wrap take their values from the kept window only, and a mode other than
//! `constant` refuses to pad an axis whose window is empty.
//!
//! Works on element bytes, so every fixed-size dtype works. On the GPU `kiln_tensor_pad` runs one
//! thread per output element.

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, with_dtype};

use crate::gpu::{eight, launch_elems, At, MAX_RANK};
use crate::{distinct_axes, elem_size};

/// The kernel's mode numbers.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Constant = 0,
    Edge = 1,
    Reflect = 2,
    Wrap = 3,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Constant => "constant",
            Mode::Edge => "edge",
            Mode::Reflect => "reflect",
            Mode::Wrap => "wrap",
        }
    }
}

struct Plan {
    esize: usize,
    mode: Mode,
    input: Vec<usize>,
    out: Vec<usize>,
    begin: Vec<i64>,
    /// The constant's bytes (esize of them).
    value: Vec<u8>,
}

fn plan(call: &Call) -> Result<Plan> {
    const OP: &str = "Pad";
    let x = call.input(0)?;
    let dt = x.dtype()?;
    let esize = elem_size(OP, dt)?;
    let input = x.shape()?;
    let mode = match call.attr_s("mode", "constant")? {
        "constant" => Mode::Constant,
        "edge" => Mode::Edge,
        "reflect" => Mode::Reflect,
        "wrap" => Mode::Wrap,
        other => bail!("{OP}: mode must be constant, edge, reflect or wrap, not {other:?}"),
    };
    let old = call.opset() < 11;
    let pads = if old {
        match call.attr_ints("pads")? {
            Some(p) => p,
            None => bail!("{OP}: attribute pads is required before opset 11"),
        }
    } else {
        call.input(1)?.read_i64s()?
    };
    let axes = match call.input_opt(3) {
        Some(t) => distinct_axes(OP, &t.read_i64s()?, input.len())?,
        None => (0..input.len()).collect(),
    };
    let (begin, out) = grow(OP, &input, &axes, &pads, mode)?;
    let value = match (old, call.input_opt(2)) {
        (true, _) => with_dtype!(dt, T => Ok(element::encode(&[T::from_f64(call.attr_f("value", 0.0)? as f64)])))?,
        (false, Some(v)) => {
            if v.dtype()? != dt || v.numel()? != 1 {
                bail!("{OP}: constant_value must be one {dt} value, not {} {}", v.numel()?, v.dtype()?);
            }
            match v.value() {
                Some(b) => Vec::from(b),
                None => v.read_bytes()?,
            }
        }
        (false, None) => alloc::vec![0u8; esize],
    };
    Ok(Plan { esize, mode, input, out, begin, value })
}

/// Each axis of `axes` grown by `pads` (begins, then ends; negative crops): the pads before each
/// axis and the output shape. Errors: an axis left negative or too long, or (modes other than
/// constant) padded from an empty window.
fn grow(op: &str, input: &[usize], axes: &[usize], pads: &[i64], mode: Mode) -> Result<(Vec<i64>, Vec<usize>)> {
    if pads.len() != 2 * axes.len() {
        bail!("{op}: pads has {} values; {} axes need {}", pads.len(), axes.len(), 2 * axes.len());
    }
    let mut begin = alloc::vec![0i64; input.len()];
    let mut out = input.to_vec();
    for (i, &a) in axes.iter().enumerate() {
        let (b, e) = (pads[i], pads[i + axes.len()]);
        let Some(n) = (input[a] as i64).checked_add(b).and_then(|n| n.checked_add(e)) else {
            bail!("{op}: pads {b} and {e} overflow axis {a}");
        };
        if n < 0 {
            bail!("{op}: pads {b} and {e} leave axis {a} of {} elements with {n}", input[a]);
        }
        let Ok(n) = usize::try_from(n) else {
            bail!("{op}: pads {b} and {e} make axis {a} longer than a shim can address");
        };
        let (lo, hi) = window(input[a] as i64, b, n as i64);
        if mode != Mode::Constant && hi <= lo && n > 0 {
            bail!("{op}: mode {} cannot pad axis {a}: pads {b} and {e} leave none of it", mode.name());
        }
        begin[a] = b;
        out[a] = n;
    }
    shape::numel(&out)?;
    Ok((begin, out))
}

/// The window `[lo, hi)` of an axis of `n` input elements that an output of `out` elements,
/// padded by `begin` at its start, keeps: a negative pad at either end crops it.
fn window(n: i64, begin: i64, out: i64) -> (i64, i64) {
    let end = out - n - begin;
    (begin.min(0).abs(), n - end.min(0).abs())
}

/// The input index of output index `o` on an axis of `n` input elements padded by `begin` at its
/// start into `out` elements, or None for the constant. Edge, reflect and wrap read the kept
/// window only (cuda/tensor.cu's kiln_tensor_pad does the same).
fn source(mode: Mode, o: i64, begin: i64, n: i64, out: i64) -> Option<i64> {
    let i = o - begin;
    let (lo, hi) = window(n, begin, out);
    if (lo..hi).contains(&i) {
        return Some(i);
    }
    let len = hi - lo;
    match mode {
        Mode::Constant => None,
        Mode::Edge => Some(i.clamp(lo, hi - 1)),
        Mode::Wrap => Some(lo + (i - lo).rem_euclid(len)),
        Mode::Reflect if len == 1 => Some(lo),
        Mode::Reflect => {
            let period = 2 * (len - 1);
            let r = (i - lo).rem_euclid(period);
            Some(lo + if r >= len { period - r } else { r })
        }
    }
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    Ok(vec![TensorType::new(call.input(0)?.dtype()?, p.out)])
}

pub fn cpu(call: &Call) -> Result<()> {
    cpu_with(call, &plan(call)?)
}

/// Output 0 = input 0 padded as `p` says.
fn cpu_with(call: &Call, p: &Plan) -> Result<()> {
    let x = call.input(0)?;
    let data = if x.numel()? == 0 { Vec::new() } else { x.read_bytes()? };
    let n: usize = p.out.iter().product();
    let mut out = Vec::with_capacity(n * p.esize);
    for t in 0..n {
        let (mut rem, mut at, mut stride, mut inside) = (t, 0usize, 1usize, true);
        for k in (0..p.out.len()).rev() {
            let o = (rem % p.out[k]) as i64;
            rem /= p.out[k];
            match source(p.mode, o, p.begin[k], p.input[k] as i64, p.out[k] as i64) {
                Some(i) => at += i as usize * stride,
                None => inside = false,
            }
            stride *= p.input[k];
        }
        out.extend_from_slice(if inside { &data[at * p.esize..(at + 1) * p.esize] } else { &p.value });
    }
    call.output(0)?.write_bytes(&out)
}

/// `kiln_tensor_pad`: one thread per output element.
pub fn dispatch(call: &Call) -> Result<()> {
    dispatch_with(call, &plan(call)?)
}

fn dispatch_with(call: &Call, p: &Plan) -> Result<()> {
    if p.out.len() > MAX_RANK {
        bail!("{}: rank {} is more than {MAX_RANK}", call.op_type(), p.out.len());
    }
    let n: usize = p.out.iter().product();
    let value = p.value.iter().rev().fold(0u64, |a, &b| (a << 8) | b as u64);
    let mut args = vec![
        At::of(&call.input(0)?).arg(),
        At::of(&call.output(0)?).arg(),
        KernelArg::U64(n as u64),
        KernelArg::U32(p.esize as u32),
        KernelArg::U32(p.out.len() as u32),
        KernelArg::U32(p.mode as u32),
    ];
    args.extend(eight(&p.input, 1));
    args.extend(eight(&p.out, 1));
    args.extend((0..MAX_RANK).map(|k| KernelArg::I64(p.begin.get(k).copied().unwrap_or(0))));
    args.push(KernelArg::U64(value));
    launch_elems("kiln_tensor_pad", n as u64, args)
}

/// CenterCropPad-18 (ONNX Operators.md): each axis of `axes` (all when absent) cropped or padded
/// with zeros, centred, to its length in `shape` (int64, a value input): a crop starts at
/// floor((in − len) / 2), a pad puts floor((len − in) / 2) zeros before.
fn center_plan(call: &Call) -> Result<Plan> {
    const OP: &str = "CenterCropPad";
    let x = call.input(0)?;
    let esize = elem_size(OP, x.dtype()?)?;
    let input = x.shape()?;
    let axes = match call.attr_ints("axes")? {
        Some(a) => distinct_axes(OP, &a, input.len())?,
        None => (0..input.len()).collect(),
    };
    let want = call.input(1)?.read_i64s()?;
    if want.len() != axes.len() {
        bail!("{OP}: shape has {} values for {} axes", want.len(), axes.len());
    }
    let mut pads = alloc::vec![0i64; 2 * axes.len()];
    for (i, (&a, &len)) in axes.iter().zip(&want).enumerate() {
        if len < 0 {
            bail!("{OP}: shape {want:?} has a negative length");
        }
        let diff = len - input[a] as i64;
        let before = diff / 2; // toward zero: an odd crop or pad puts its extra element at the end
        pads[i] = before;
        pads[i + axes.len()] = diff - before;
    }
    let (begin, out) = grow(OP, &input, &axes, &pads, Mode::Constant)?;
    Ok(Plan { esize, mode: Mode::Constant, input, out, begin, value: alloc::vec![0u8; esize] })
}

pub fn center_infer(call: &Call) -> Result<Vec<TensorType>> {
    Ok(vec![TensorType::new(call.input(0)?.dtype()?, center_plan(call)?.out)])
}

pub fn center_cpu(call: &Call) -> Result<()> {
    cpu_with(call, &center_plan(call)?)
}

pub fn center_dispatch(call: &Call) -> Result<()> {
    dispatch_with(call, &center_plan(call)?)
}
