//! Ops computed along one axis, line by line, with the input viewed as `[outer, n, inner]`
//! around it (ONNX Operators.md):
//!
//! - **CumSum-11/14**: inputs `x` and `axis` (an int32 or int64 scalar, a value input);
//!   `exclusive` (0) leaves each element out of its own sum, `reverse` (0) sums from the end.
//!   Floats accumulate in f64 on the CPU (f32, f64 for float64, on the GPU) and round each
//!   output once; integers wrap.
//! - **Hardmax-1/11/13**: 1 at the first largest element of each line, 0 elsewhere; a NaN wins
//!   over every number (numpy's `argmax`, as ArgMax here). From opset 13 the line is `axis`
//!   (default -1); before, the input is coerced to 2-D at `axis` (default 1) and each row is a
//!   line.
//!
//! On the GPU, `kiln_cumsum<Tag>` and `kiln_hardmax<Tag>` run one thread per line.

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, names, unsupported, with_dtype};

/// The input viewed as `[outer, n, inner]`.
pub(crate) struct Lines {
    pub outer: usize,
    pub n: usize,
    pub inner: usize,
}

impl Lines {
    /// Around axis `ax` of `shape`.
    pub fn around(shape: &[usize], ax: usize) -> Lines {
        Lines { outer: shape[..ax].iter().product(), n: shape[ax], inner: shape[ax + 1..].iter().product() }
    }

    /// Element indices of line `l`, in order along the axis.
    pub fn line(&self, l: usize) -> impl Iterator<Item = usize> + '_ {
        let (o, i) = (l / self.inner.max(1), l % self.inner.max(1));
        (0..self.n).map(move |j| (o * self.n + j) * self.inner + i)
    }

    pub fn count(&self) -> usize {
        self.outer * self.inner
    }
}

fn axis_of(call: &Call, axis: i64, rank: usize) -> Result<usize> {
    shape::normalize_axis(axis, rank).map_err(|e| match e {
        ShimError::Failed(m) => ShimError::Failed(format!("{}: {m}", call.op_type())),
        other => other,
    })
}

fn lines(call: &Call) -> Result<Lines> {
    let shape = call.input(0)?.shape()?;
    match call.op_type() {
        "CumSum" => {
            let axis = match call.input(1)?.read_i64s()?[..] {
                [a] => a,
                ref v => bail!("CumSum: axis must be a scalar, got {} values", v.len()),
            };
            if shape.is_empty() {
                bail!("CumSum: the input must have at least one dimension");
            }
            Ok(Lines::around(&shape, axis_of(call, axis, shape.len())?))
        }
        _ if call.opset() >= 13 => {
            if shape.is_empty() {
                bail!("Hardmax: the input must have at least one dimension");
            }
            Ok(Lines::around(&shape, axis_of(call, call.attr_i("axis", -1)?, shape.len())?))
        }
        _ => {
            // Coerced to 2-D: [prod(shape[..axis]), prod(shape[axis..])], axis in [-rank, rank].
            let (axis, rank) = (call.attr_i("axis", 1)?, shape.len() as i64);
            if !(-rank..=rank).contains(&axis) {
                bail!("Hardmax: axis {axis} is out of range for rank {rank}");
            }
            let ax = (if axis < 0 { axis + rank } else { axis }) as usize;
            Ok(Lines { outer: shape[..ax].iter().product(), n: shape[ax..].iter().product(), inner: 1 })
        }
    }
}

fn check(call: &Call) -> Result<DType> {
    let dtype = call.input(0)?.dtype()?;
    match (call.op_type(), dtype) {
        ("CumSum", d) if d.is_float() || d.is_int() => Ok(d),
        ("Hardmax", d) if d.is_float() => Ok(d),
        (op, d) => unsupported!("{op}: {d} input is not supported"),
    }
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let dtype = check(call)?;
    lines(call)?;
    Ok(vec![TensorType::new(dtype, call.input(0)?.shape()?)])
}

pub fn cpu(call: &Call) -> Result<()> {
    let dtype = check(call)?;
    let l = lines(call)?;
    let x = call.input(0)?;
    let y = call.output(0)?;
    if call.op_type() == "Hardmax" {
        let xs = x.read_vec::<f64>()?;
        let mut out = vec![0f64; xs.len()];
        for line in 0..l.count() {
            let mut best: Option<usize> = None;
            for k in l.line(line) {
                let better = match best {
                    None => true,
                    Some(b) => !xs[b].is_nan() && (xs[k].is_nan() || xs[k] > xs[b]),
                };
                if better {
                    best = Some(k);
                }
            }
            if let Some(b) = best {
                out[b] = 1.0;
            }
        }
        return y.write_vec(&out);
    }
    let exclusive = call.attr_i("exclusive", 0)? != 0;
    let reverse = call.attr_i("reverse", 0)? != 0;
    // Each line's element indices in the order they are summed.
    let order = |line: usize| -> Vec<usize> {
        let mut idx: Vec<usize> = l.line(line).collect();
        if reverse {
            idx.reverse();
        }
        idx
    };
    if dtype.is_float() {
        let xs = x.read_vec::<f64>()?;
        let mut out = vec![0f64; xs.len()];
        for line in 0..l.count() {
            let mut acc = 0f64;
            for k in order(line) {
                let before = acc;
                acc += xs[k];
                out[k] = if exclusive { before } else { acc };
            }
        }
        y.write_vec(&out)
    } else {
        let bytes = x.read_bytes()?;
        let out = with_dtype!(dtype, T => {
            let xs = element::decode::<T>(&bytes);
            let mut out = vec![T::default(); xs.len()];
            for line in 0..l.count() {
                let mut acc = 0i64;
                for k in order(line) {
                    let before = acc;
                    acc = acc.wrapping_add(xs[k].to_i64());
                    out[k] = T::from_i64(if exclusive { before } else { acc });
                }
            }
            Ok(element::encode(&out))
        })?;
        y.write_bytes(&out)
    }
}

/// The kernels' template argument for `dtype` (kernel.toml's instantiations).
fn kernel_tag(call: &Call, dtype: DType) -> Result<&'static str> {
    match (dtype, dtype.cuda_tag()) {
        (DType::F32 | DType::F16 | DType::BF16 | DType::F64, Some(tag)) => Ok(tag),
        (DType::I32 | DType::I64 | DType::U32 | DType::U64, Some(tag)) if call.op_type() == "CumSum" => Ok(tag),
        _ => unsupported!("{}: no CUDA kernel for {dtype}", call.op_type()),
    }
}

pub fn dispatch(call: &Call) -> Result<()> {
    let dtype = check(call)?;
    let l = lines(call)?;
    let tag = kernel_tag(call, dtype)?;
    let lines = l.count() as u64;
    if lines == 0 || l.n == 0 {
        return Ok(());
    }
    let t = KernelArg::tensor;
    let mut args = vec![
        t(call.input(0)?.handle()),
        t(call.output(0)?.handle()),
        KernelArg::U64(l.outer as u64),
        KernelArg::U64(l.n as u64),
        KernelArg::U64(l.inner as u64),
    ];
    let template = if call.op_type() == "CumSum" {
        args.push(KernelArg::U32((call.attr_i("exclusive", 0)? != 0) as u32));
        args.push(KernelArg::U32((call.attr_i("reverse", 0)? != 0) as u32));
        "kiln_cumsum"
    } else {
        "kiln_hardmax"
    };
    launch(&Launch {
        kernel: &names::kernel_name(template, &[tag]),
        grid: grid_stride(lines),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args,
    })
}
