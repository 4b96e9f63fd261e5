//! onnxruntime's RMS normalisations, following its docs/ContribOperators.md and CPU kernels
//! (`core/providers/cpu/nn/layer_norm_impl.cc` with `simplified`, `contrib_ops/cpu/skip_layer_norm.cc`).
//!
//! **SimplifiedLayerNormalization** (onnxruntime registers it in the ai.onnx domain, opset 1):
//! inputs `X`, `scale`; outputs `Y`, optional `inv_std_var`; attributes `axis` (-1), `epsilon`
//! (1e-5), `stash_type` (1).
//!
//! ```text
//! inv_std_var = 1 / sqrt(mean(X², over axes axis..rank) + epsilon)
//! Y           = X · inv_std_var · scale
//! ```
//!
//! `scale` broadcasts unidirectionally to X (its rank at most X's) and may have another
//! floating-point dtype than X: Y has scale's dtype (onnxruntime's T and V). `inv_std_var` has
//! X's shape with dimensions `axis..` set to 1 and the dtype named by `stash_type` (1 float32 or
//! 11 float64, onnxruntime's U).
//!
//! **RMSNormalization** (ai.onnx, opset 23; ONNX Operators.md) is the same computation with
//! the same inputs, attributes and dtypes (ONNX's T and V), and only the output `Y`.
//!
//! **SkipSimplifiedLayerNormalization** (com.microsoft, opset 1): inputs `input`, `skip`,
//! `gamma`, optional `bias`; attribute `epsilon` (1e-12); outputs `output`, optional `mean`,
//! `inv_std_var`, `input_skip_bias_sum`.
//!
//! ```text
//! input_skip_bias_sum = input + skip (+ bias)
//! inv_std_var         = 1 / sqrt(mean(input_skip_bias_sum², over the last axis) + epsilon)
//! output              = input_skip_bias_sum · inv_std_var · gamma
//! ```
//!
//! As in onnxruntime: `input` is `[batch, sequence, hidden]` or `[sequence, hidden]`; `skip` has
//! input's shape or, for a 3-D input, `[sequence, hidden]` or `[1, sequence, hidden]` (added to
//! every batch); `gamma` and `bias` are `[hidden]`; all share one dtype. `mean` and
//! `inv_std_var` are float32 of input's shape with the last dimension 1; `mean` is all zeros,
//! which is what onnxruntime's CPU kernel writes (RMS normalisation does not centre).
//! `epsilon` must not be negative.
//!
//! **SkipLayerNormalization** (`ai.kiln`, opset 1; onnxruntime's com.microsoft op of that name
//! computes the same, with another `epsilon` default): inputs `input`, `skip`, `gamma`, optional
//! `beta` and `bias`; the same outputs; attribute `epsilon` (1e-5, LayerNormalization's); centred:
//!
//! ```text
//! input_skip_bias_sum = input + skip (+ bias)
//! mean                = mean(input_skip_bias_sum, over the last axis)
//! inv_std_var         = 1 / sqrt(mean((input_skip_bias_sum − mean)²) + epsilon)
//! output              = (input_skip_bias_sum − mean) · inv_std_var · gamma (+ beta)
//! ```
//!
//! What kiln-normalization's `skip-layernorm` fusions make of an Add and the
//! LayerNormalization over its last axis that reads it: `skip` may have any shape that
//! broadcasts to input's (ONNX's multidirectional rule, one way), and where `input` broadcasts
//! to `skip`'s shape the two swap (Add is commutative); gamma and beta may be one value; the
//! LayerNormalization's `axis` (-1, or the last) and `stash_type` (1 or 11) are accepted.
//!
//! The reference computes in f64 from the inputs' values and rounds each output once.

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, names};

use crate::{axis_error, check_float};

const SIMPLIFIED: &str = "SimplifiedLayerNormalization";
const RMS: &str = "RMSNormalization";
const SKIP: &str = "SkipSimplifiedLayerNormalization";
const SKIP_LN: &str = "SkipLayerNormalization";

/// Maps each element of a tensor of shape `out` (row-major) to the element of an input that
/// broadcasts onto it. An input whose shape, leading 1s dropped, is a suffix of `out` (the usual
/// `[hidden]` scale) is indexed modulo its size, without an index table.
struct Broadcast {
    table: Option<Vec<usize>>,
    len: usize,
}

impl Broadcast {
    /// `input` must broadcast to `out`.
    fn new(input: &[usize], out: &[usize]) -> Broadcast {
        let core = &input[input.iter().take_while(|&&d| d == 1).count()..];
        let len = core.iter().product();
        let table = if out.ends_with(core) { None } else { Some(shape::broadcast_index(input, out)) };
        Broadcast { table, len }
    }

    fn at(&self, k: usize) -> usize {
        match &self.table {
            Some(t) => t[k],
            None => k % self.len,
        }
    }
}

/// Normalises the `rows` rows of `x` (`cols` elements each) in place: `x / rms · scale(k)` with
/// `k` the element's index in `x`. Returns each row's `1 / rms` (NaN for rows of no element, as
/// onnxruntime's 0 / 0).
fn rms_rows(x: &mut [f64], rows: usize, cols: usize, eps: f64, scale: impl Fn(usize) -> f64) -> Vec<f64> {
    let mut inv_std = Vec::with_capacity(rows);
    for r in 0..rows {
        let row = &mut x[r * cols..(r + 1) * cols];
        let rms = libm::sqrt(row.iter().map(|v| v * v).sum::<f64>() / cols as f64 + eps);
        for (c, v) in row.iter_mut().enumerate() {
            *v = *v / rms * scale(r * cols + c);
        }
        inv_std.push(1.0 / rms);
    }
    inv_std
}

fn check_arity(call: &Call, op: &str, inputs: usize, outputs: usize) -> Result<()> {
    if call.num_inputs() > inputs || call.num_outputs() > outputs {
        bail!(
            "{op}: takes at most {inputs} inputs and {outputs} outputs, the node has {} and {}",
            call.num_inputs(),
            call.num_outputs()
        );
    }
    Ok(())
}

/// SimplifiedLayerNormalization's (and RMSNormalization's) geometry and types.
struct SimplifiedPlan {
    x_shape: Vec<usize>,
    scale_shape: Vec<usize>,
    rows: usize,
    cols: usize,
    y_dtype: DType,
    /// Shape of inv_std_var: normalised dimensions kept as 1.
    stat_shape: Vec<usize>,
    stat_dtype: DType,
}

fn simplified_plan(call: &Call) -> Result<SimplifiedPlan> {
    // SimplifiedLayerNormalization may also output inv_std_var; RMSNormalization only Y.
    let op = if call.op_type() == RMS { RMS } else { SIMPLIFIED };
    check_arity(call, op, 2, if op == RMS { 1 } else { 2 })?;
    let x = call.input(0)?;
    check_float(call, x.dtype()?)?;
    let scale = call.input(1)?;
    let y_dtype = scale.dtype()?;
    check_float(call, y_dtype)?;
    let x_shape = x.shape()?;
    let scale_shape = scale.shape()?;
    let a = shape::normalize_axis(call.attr_i("axis", -1)?, x_shape.len()).map_err(|e| axis_error(call, e))?;
    if shape::broadcast_shapes(&[&x_shape, &scale_shape]).ok().as_deref() != Some(&x_shape[..]) {
        bail!("{op}: scale of shape {scale_shape:?} does not broadcast to X's shape {x_shape:?}");
    }
    let stat_dtype = match call.attr_i("stash_type", 1)? {
        1 => DType::F32,
        11 => DType::F64,
        s => bail!("{op}: stash_type {s} is neither 1 (float32) nor 11 (float64)"),
    };
    Ok(SimplifiedPlan {
        rows: x_shape[..a].iter().product(),
        cols: x_shape[a..].iter().product(),
        stat_shape: x_shape.iter().enumerate().map(|(i, &d)| if i < a { d } else { 1 }).collect(),
        x_shape,
        scale_shape,
        y_dtype,
        stat_dtype,
    })
}

pub fn simplified_infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = simplified_plan(call)?;
    let y = TensorType::new(p.y_dtype, p.x_shape);
    if call.op_type() == RMS {
        return Ok(vec![y]);
    }
    Ok(vec![y, TensorType::new(p.stat_dtype, p.stat_shape)])
}

pub fn simplified_cpu(call: &Call) -> Result<()> {
    let p = simplified_plan(call)?;
    let eps = call.attr_f("epsilon", 1e-5)? as f64;
    let mut x = call.input(0)?.read_vec::<f64>()?;
    let scale = call.input(1)?.read_vec::<f64>()?;
    let at = Broadcast::new(&p.scale_shape, &p.x_shape);
    let inv_std = rms_rows(&mut x, p.rows, p.cols, eps, |k| scale[at.at(k)]);
    call.output(0)?.write_vec(&x)?;
    if let Some(t) = call.output_opt(1) {
        t.write_vec(&inv_std)?;
    }
    Ok(())
}

/// SkipSimplifiedLayerNormalization's and SkipLayerNormalization's geometry.
struct SkipPlan {
    shape: Vec<usize>,
    dtype: DType,
    rows: usize,
    hidden: usize,
    /// Shape of mean and inv_std_var: the last dimension set to 1.
    stat_shape: Vec<usize>,
    epsilon: f64,
    /// SkipLayerNormalization: centred, with `beta`.
    center: bool,
    /// The inputs holding the full-shape operand and the one added to it (0 and 1, or swapped
    /// where `input` broadcasts to `skip`'s shape).
    input: usize,
    skip: usize,
    /// The input index of `bias` (3, or 4 after SkipLayerNormalization's `beta`).
    bias: usize,
    /// The shape of the operand added to the full-shape one (broadcast to it).
    skip_shape: Vec<usize>,
}

fn skip_plan(call: &Call) -> Result<SkipPlan> {
    let center = call.op_type() == SKIP_LN;
    let (op, bias) = if center { (SKIP_LN, 4) } else { (SKIP, 3) };
    check_arity(call, op, bias + 1, 4)?;
    let dtype = call.input(0)?.dtype()?;
    check_float(call, dtype)?;
    for (i, what) in [(1, "skip"), (2, "gamma"), (3, if center { "beta" } else { "bias" }), (4, "bias")] {
        if let Some(t) = call.input_opt(i) {
            if t.dtype()? != dtype {
                bail!("{op}: {what} has dtype {}, input has {dtype}", t.dtype()?);
            }
        }
    }
    let (a, b) = (call.input(0)?.shape()?, call.input(1)?.shape()?);
    // For SkipLayerNormalization, either operand broadcasting to the other (Add is commutative).
    let broadcasts = |full: &[usize], part: &[usize]| {
        part.len() <= full.len() && part.iter().rev().zip(full.iter().rev()).all(|(&p, &f)| p == 1 || p == f)
    };
    let (input, skip, shape) = if !center {
        let tail = &a[a.len().saturating_sub(2)..];
        let skip_ok = b == a || (a.len() == 3 && (b == tail || (b.len() == 3 && b[0] == 1 && b[1..] == *tail)));
        if !(2..=3).contains(&a.len()) {
            bail!("{op}: input must be [batch, sequence, hidden] or [sequence, hidden], not of shape {a:?}");
        }
        if !skip_ok {
            bail!(
                "{op}: skip of shape {b:?} is neither input's shape {a:?} nor, for a 3-D input, \
                 [sequence, hidden] or [1, sequence, hidden]"
            );
        }
        (0, 1, a)
    } else if broadcasts(&a, &b) {
        (0, 1, a)
    } else if broadcasts(&b, &a) {
        (1, 0, b)
    } else {
        bail!("{op}: neither of input {a:?} and skip {b:?} broadcasts to the other");
    };
    let skip_shape = call.input(skip)?.shape()?;
    let Some(&hidden) = shape.last() else { bail!("{op}: input must have rank ≥ 1") };
    call.input(2)?;
    // SkipLayerNormalization's gamma and beta may be one value (LayerNormalization broadcasts
    // them); its bias and the other op's are [hidden].
    for (i, what) in [(2, "gamma"), (3, if center { "beta" } else { "bias" }), (4, "bias")] {
        if let Some(t) = call.input_opt(i) {
            let s = t.shape()?;
            let one = center && i < 4 && s.iter().all(|&d| d == 1) && s.len() <= 1;
            if s != [hidden] && !one {
                bail!("{op}: {what} must be [hidden] = [{hidden}], not of shape {s:?}");
            }
        }
    }
    if center {
        let axis = call.attr_i("axis", -1)?;
        if axis != -1 && axis != shape.len() as i64 - 1 {
            bail!("{op}: normalises the last axis only, not axis {axis}");
        }
        // The statistics' precision (LayerNormalization's U): kiln computes them in f32, or f64
        // for float64, either way.
        let stash = call.attr_i("stash_type", 1)?;
        if stash != 1 && stash != 11 {
            bail!("{op}: stash_type must be 1 (float32) or 11 (float64), not {stash}");
        }
    }
    let epsilon = call.attr_f("epsilon", if center { 1e-5 } else { 1e-12 })?;
    if epsilon.is_nan() || epsilon < 0.0 {
        bail!("{op}: epsilon must be at least 0, not {epsilon}");
    }
    let mut stat_shape = shape.clone();
    if let Some(l) = stat_shape.last_mut() {
        *l = 1;
    }
    Ok(SkipPlan {
        rows: shape[..shape.len() - 1].iter().product(),
        hidden,
        dtype,
        stat_shape,
        shape,
        epsilon: epsilon as f64,
        center,
        input,
        skip,
        bias,
        skip_shape,
    })
}

pub fn skip_norm_infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = skip_plan(call)?;
    let stat = TensorType::new(DType::F32, p.stat_shape);
    let data = TensorType::new(p.dtype, p.shape);
    Ok(vec![data.clone(), stat.clone(), stat, data])
}

/// SkipSimplifiedLayerNormalization's rows `rows` (all of them, or a tile's: manifest
/// `cpu_tiles = "rows"`).
pub fn skip_norm_cpu(call: &Call) -> Result<()> {
    let p = skip_plan(call)?;
    let rows = call.tile_units(p.rows)?;
    let (first, n) = (rows.start * p.hidden, rows.len() * p.hidden);
    let mut sum = call.input(p.input)?.read_vec_range::<f64>(first, n)?;
    // skip is input's shape (this call's rows of it) or broadcasts to it (all of it: a suffix
    // repeated over the leading dimensions, or through an index table).
    let skip_t = call.input(p.skip)?;
    let full = skip_t.numel()? == call.input(p.input)?.numel()?;
    let skip = if full { skip_t.read_vec_range::<f64>(first, n)? } else { skip_t.read_vec::<f64>()? };
    let at = (!full).then(|| Broadcast::new(&p.skip_shape, &p.shape));
    let gamma = call.input(2)?.read_vec::<f64>()?;
    let bias = call.input_opt(p.bias).map(|t| t.read_vec::<f64>()).transpose()?;
    for (k, v) in sum.iter_mut().enumerate() {
        *v += skip[at.as_ref().map_or(k, |b| b.at(first + k))];
        if let Some(b) = &bias {
            *v += b[k % p.hidden];
        }
    }
    if p.center {
        // The sum as the Add it replaces stores it, rounded to the dtype.
        sum = element::decode_as::<f64>(p.dtype, &element::encode_as(p.dtype, &sum)?)?;
    }
    if let Some(t) = call.output_opt(3) {
        t.write_vec_at(first, &sum)?;
    }
    let mut means = vec![0f64; rows.len()];
    if p.center {
        for (r, row) in sum.chunks_mut(p.hidden.max(1)).enumerate() {
            means[r] = row.iter().sum::<f64>() / p.hidden as f64;
            row.iter_mut().for_each(|v| *v -= means[r]);
        }
    }
    // gamma and beta: [hidden], or (SkipLayerNormalization) one value.
    let inv_std = rms_rows(&mut sum, rows.len(), p.hidden, p.epsilon, |k| gamma[k % p.hidden % gamma.len()]);
    if p.center {
        if let Some(beta) = call.input_opt(3).map(|t| t.read_vec::<f64>()).transpose()? {
            sum.iter_mut().enumerate().for_each(|(k, v)| *v += beta[k % p.hidden % beta.len()]);
        }
    }
    call.output(0)?.write_vec_at(first, &sum)?;
    if let Some(t) = call.output_opt(1) {
        t.write_vec_at(rows.start, &means)?;
    }
    if let Some(t) = call.output_opt(2) {
        t.write_vec_at(rows.start, &inv_std)?;
    }
    Ok(())
}

pub fn simplified_dispatch(call: &Call) -> Result<()> {
    use crate::gpu::{kernel_tag, row_launch, suffix_operand, tensor};
    let p = simplified_plan(call)?;
    let x = call.input(0)?;
    let (xt, yt) = (kernel_tag(call, x.dtype()?)?, kernel_tag(call, p.y_dtype)?);
    let (rows, cols) = (p.rows as u64, p.cols as u64);
    if rows == 0 {
        return Ok(());
    }
    let scale = call.input(1)?;
    let (scale, scale_len) = if cols == 0 {
        (scale.handle(), 1)
    } else {
        suffix_operand(scale.handle(), p.y_dtype, &p.scale_shape, &p.x_shape)?
    };
    let y = call.output(0)?;
    let inv = call.output_opt(1);
    let (grid, block) = row_launch(rows, cols);
    launch(&Launch {
        kernel: &names::kernel_name("kiln_rms_norm", &[xt, yt]),
        grid,
        block,
        shared_mem_bytes: 0,
        args: vec![
            tensor(x.handle()),
            tensor(scale),
            tensor(y.handle()),
            tensor(inv.map_or(y.handle(), |t| t.handle())),
            KernelArg::U64(rows),
            KernelArg::U64(cols),
            KernelArg::U64(scale_len),
            KernelArg::F32(call.attr_f("epsilon", 1e-5)?),
            KernelArg::U32(p.stat_dtype.code() as u32),
            KernelArg::U32(inv.is_some() as u32),
        ],
    })
}

pub fn skip_norm_dispatch(call: &Call) -> Result<()> {
    use crate::gpu::{kernel_tag, row_launch, tensor};
    let p = skip_plan(call)?;
    let tag = kernel_tag(call, p.dtype)?;
    let (rows, hidden) = (p.rows as u64, p.hidden as u64);
    if rows == 0 {
        return Ok(());
    }
    let x = call.input(p.input)?;
    // A skip that is not input's shape or a suffix of it is expanded to input's shape first.
    let (skip, skip_len) = crate::gpu::suffix_operand(call.input(p.skip)?.handle(), p.dtype, &p.skip_shape, &p.shape)?;
    let skip_len = skip_len.max(1);
    let bias = call.input_opt(p.bias);
    let out = call.output(0)?;
    let (mean, inv, sum) = (call.output_opt(1), call.output_opt(2), call.output_opt(3));
    let (grid, block) = row_launch(rows, hidden);
    let mut args = vec![tensor(x.handle()), tensor(skip), tensor(call.input(2)?.handle())];
    let beta = call.input_opt(3).filter(|_| p.center);
    if p.center {
        args.push(tensor(beta.as_ref().map_or(x.handle(), |t| t.handle())));
    }
    args.extend([
        tensor(bias.as_ref().map_or(x.handle(), |t| t.handle())),
        tensor(out.handle()),
        tensor(mean.map_or(out.handle(), |t| t.handle())),
        tensor(inv.map_or(out.handle(), |t| t.handle())),
        tensor(sum.map_or(out.handle(), |t| t.handle())),
        KernelArg::U64(rows),
        KernelArg::U64(hidden),
        KernelArg::U64(skip_len),
    ]);
    if p.center {
        args.push(KernelArg::U32(beta.is_some() as u32));
    }
    args.extend([
        KernelArg::U32(bias.is_some() as u32),
        KernelArg::U32(mean.is_some() as u32),
        KernelArg::U32(inv.is_some() as u32),
        KernelArg::U32(sum.is_some() as u32),
        KernelArg::F32(p.epsilon as f32),
    ]);
    if p.center {
        let one = |i: usize| -> Result<u32> {
            Ok((call.input_opt(i).map(|t| t.numel()).transpose()? == Some(1) && hidden != 1) as u32)
        };
        args.push(KernelArg::U32(one(2)? | one(3)? << 1));
    }
    let kernel = if p.center { "kiln_skip_layer_norm" } else { "kiln_skip_rms_norm" };
    launch(&Launch { kernel: &names::kernel_name(kernel, &[tag]), grid, block, shared_mem_bytes: 0, args })
}
