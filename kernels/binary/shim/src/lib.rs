//! Shim of `kiln-binary`: elementwise ops of two or more inputs with ONNX multidirectional
//! (numpy) broadcasting, following ONNX Operators.md: Add-14, Sub-14, Mul-14, Div-14, Pow-15,
//! Mod-13, Max-13, Min-13, Sum-13, Mean-13, Equal-19, Less-13, Greater-13, LessOrEqual-16,
//! GreaterOrEqual-16, And-7, Or-7, Xor-7, Where-16 (and their earlier broadcasting versions),
//! BitwiseAnd-18, BitwiseOr-18, BitwiseXor-18 (integers) and BitShift-11 (unsigned integers).
//!
//! The CPU reference computes floating-point ops in f64 and rounds once to the output dtype
//! (round to nearest even, also for float16/bfloat16); integer ops are done in integers,
//! wrapping as two's complement hardware does (Div truncates toward zero; Mod follows the sign
//! of the divisor unless `fmod` = 1). Integer division or modulo by zero gives 0, as numpy
//! (ONNX's reference implementation) does; ONNX leaves it undefined.
#![no_std]
extern crate alloc;

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, export_shim, unsupported};

struct Binary;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Op {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Mod {
        fmod: bool,
    },
    Max,
    Min,
    Sum,
    Mean,
    Equal,
    Less,
    Greater,
    LessOrEqual,
    GreaterOrEqual,
    And,
    Or,
    Xor,
    Where,
    BitwiseAnd,
    BitwiseOr,
    BitwiseXor,
    BitShift {
        left: bool,
    },
    /// PRelu: x < 0 ? slope·x : x, slope broadcast to X.
    PRelu,
}

impl Op {
    fn from_call(call: &Call) -> Result<Op> {
        Ok(match call.op_type() {
            "Add" => Op::Add,
            "Sub" => Op::Sub,
            "Mul" => Op::Mul,
            "Div" => Op::Div,
            "Pow" => Op::Pow,
            "Mod" => match call.attr_i("fmod", 0)? {
                0 => Op::Mod { fmod: false },
                1 => Op::Mod { fmod: true },
                other => bail!("Mod: fmod must be 0 or 1, not {other}"),
            },
            "Max" => Op::Max,
            "Min" => Op::Min,
            "Sum" => Op::Sum,
            "Mean" => Op::Mean,
            "Equal" => Op::Equal,
            "Less" => Op::Less,
            "Greater" => Op::Greater,
            "LessOrEqual" => Op::LessOrEqual,
            "GreaterOrEqual" => Op::GreaterOrEqual,
            "And" => Op::And,
            "Or" => Op::Or,
            "Xor" => Op::Xor,
            "Where" => Op::Where,
            "PRelu" => Op::PRelu,
            "BitwiseAnd" => Op::BitwiseAnd,
            "BitwiseOr" => Op::BitwiseOr,
            "BitwiseXor" => Op::BitwiseXor,
            "BitShift" => match call.attr_s("direction", "")? {
                "LEFT" => Op::BitShift { left: true },
                "RIGHT" => Op::BitShift { left: false },
                other => bail!("BitShift: direction must be \"LEFT\" or \"RIGHT\", not {other:?}"),
            },
            other => unsupported!("kiln-binary does not implement {other}"),
        })
    }

    fn is_variadic(self) -> bool {
        matches!(self, Op::Max | Op::Min | Op::Sum | Op::Mean)
    }

    fn is_comparison(self) -> bool {
        matches!(self, Op::Equal | Op::Less | Op::Greater | Op::LessOrEqual | Op::GreaterOrEqual)
    }

    fn is_logical(self) -> bool {
        matches!(self, Op::And | Op::Or | Op::Xor)
    }

    /// Integer-only ops (BitShift: unsigned only).
    fn is_bitwise(self) -> bool {
        matches!(self, Op::BitwiseAnd | Op::BitwiseOr | Op::BitwiseXor | Op::BitShift { .. })
    }
}

fn is_unsigned(dtype: DType) -> bool {
    matches!(dtype, DType::U8 | DType::U16 | DType::U32 | DType::U64)
}

/// A checked node: its op, the inputs' dtypes and shapes, and the output type.
/// float32 Add, Sub, Mul and Div of two tensors of the output's shape, or of one and a scalar:
/// one loop over the bytes (an IEEE f32 operation rounds as the f64 reference does). `false`:
/// another case, which the reference computes.
fn fast_f32(call: &Call, op: Op, dtypes: &[DType], shapes: &[Vec<usize>], out: &TensorType) -> Result<bool> {
    let f: fn(f32, f32) -> f32 = match op {
        Op::Add => |a, b| a + b,
        Op::Sub => |a, b| a - b,
        Op::Mul => |a, b| a * b,
        Op::Div => |a, b| a / b,
        _ => return Ok(false),
    };
    if dtypes.iter().any(|d| *d != DType::F32) || shapes.len() != 2 {
        return Ok(false);
    }
    let full = |s: &Vec<usize>| *s == out.shape;
    let scalar = |s: &Vec<usize>| s.iter().product::<usize>() == 1;
    let (x, y) = (call.input(0)?, call.input(1)?);
    let mut bytes = match (full(&shapes[0]), full(&shapes[1])) {
        (true, true) => {
            let mut a = x.read_bytes()?;
            fast::zip_f32(&mut a, &y.read_bytes()?, f);
            a
        }
        (true, false) if scalar(&shapes[1]) => {
            let mut a = x.read_bytes()?;
            let s = y.read_vec::<f32>()?[0];
            fast::scalar_f32(&mut a, s, f);
            a
        }
        (false, true) if scalar(&shapes[0]) => {
            let mut b = y.read_bytes()?;
            let s = x.read_vec::<f32>()?[0];
            fast::scalar_f32(&mut b, s, |q, p| f(p, q));
            b
        }
        _ => return Ok(false),
    };
    call.output(0)?.write_bytes(&core::mem::take(&mut bytes))?;
    Ok(true)
}

struct Checked {
    op: Op,
    dtypes: Vec<DType>,
    shapes: Vec<Vec<usize>>,
    out: TensorType,
}

/// Checks the node's arity, dtypes and shapes.
fn check(call: &Call) -> Result<Checked> {
    let op = Op::from_call(call)?;
    let name = call.op_type();
    let n = call.num_inputs();
    let arity_ok = match op {
        Op::Where => n == 3,
        _ if op.is_variadic() => n >= 1,
        _ => n == 2,
    };
    if !arity_ok {
        bail!("{name}: wrong number of inputs ({n})");
    }
    let mut dtypes = Vec::with_capacity(n);
    let mut shapes = Vec::with_capacity(n);
    for i in 0..n {
        let t = call.input(i)?;
        let dtype = t.dtype()?;
        if dtype == DType::String {
            unsupported!("{name}: string tensors are not supported");
        }
        dtypes.push(dtype);
        shapes.push(t.shape()?);
    }
    let refs: Vec<&[usize]> = shapes.iter().map(|s| s.as_slice()).collect();
    let out_shape = shape::broadcast_shapes(&refs)?;
    if op == Op::PRelu && out_shape != shapes[0] {
        bail!("PRelu: slope {:?} does not broadcast to X's shape {:?}", shapes[1], shapes[0]);
    }

    // The inputs that must share one dtype, and the output dtype.
    let (same, out_dtype): (&[DType], DType) = match op {
        Op::Where => {
            if dtypes[0] != DType::Bool {
                bail!("Where: condition must be bool, not {}", dtypes[0]);
            }
            (&dtypes[1..], dtypes[1])
        }
        Op::Pow => {
            if dtypes[0] == DType::Bool || dtypes[1] == DType::Bool {
                bail!("Pow: bool inputs are not allowed");
            }
            (&dtypes[..1], dtypes[0])
        }
        _ if op.is_logical() => {
            if dtypes.iter().any(|d| *d != DType::Bool) {
                bail!("{name}: inputs must be bool, not {} and {}", dtypes[0], dtypes[1]);
            }
            (&dtypes[..], DType::Bool)
        }
        _ if op.is_comparison() => {
            if dtypes[0] == DType::Bool && op != Op::Equal {
                bail!("{name}: bool inputs are not allowed");
            }
            (&dtypes[..], DType::Bool)
        }
        _ => {
            let d = dtypes[0];
            if d == DType::Bool {
                bail!("{name}: bool inputs are not allowed");
            }
            if matches!(op, Op::Sum | Op::Mean) && !d.is_float() {
                bail!("{name}: inputs must be floating-point, not {d}");
            }
            if op == (Op::Mod { fmod: false }) && d.is_float() {
                bail!("Mod: floating-point inputs require fmod = 1");
            }
            if op.is_bitwise() && d.is_float() {
                bail!("{name}: inputs must be integers, not {d}");
            }
            if matches!(op, Op::BitShift { .. }) && !is_unsigned(d) {
                bail!("BitShift: inputs must be unsigned integers, not {d}");
            }
            (&dtypes[..], d)
        }
    };
    if let Some(d) = same.iter().find(|d| **d != same[0]) {
        bail!("{name}: inputs must have the same dtype, not {} and {d}", same[0]);
    }
    Ok(Checked { op, dtypes, shapes, out: TensorType::new(out_dtype, out_shape) })
}

/// Element values of one input, widened: floats exactly as f64, integers as i64 (sign- or
/// zero-extended; uint64 reinterpreted, see [`is_unsigned`]), bools.
enum Vals {
    F(Vec<f64>),
    I(Vec<i64>),
    B(Vec<bool>),
}

fn load(t: &Tensor) -> Result<Vals> {
    let dtype = t.dtype()?;
    Ok(if dtype.is_float() {
        Vals::F(t.read_vec::<f64>()?)
    } else if dtype.is_int() {
        Vals::I(t.read_vec::<i64>()?)
    } else if dtype == DType::Bool {
        Vals::B(t.read_vec::<Bool>()?.into_iter().map(|b| b.0).collect())
    } else {
        unsupported!("{dtype} tensors are not supported")
    })
}

/// For each input, the index of its element for each output element (`None`: the input has
/// the output's shape).
fn gather_indices(shapes: &[Vec<usize>], out_shape: &[usize]) -> Vec<Option<Vec<usize>>> {
    shapes
        .iter()
        .map(|s| if s.as_slice() == out_shape { None } else { Some(shape::broadcast_index(s, out_shape)) })
        .collect()
}

fn at(idx: &Option<Vec<usize>>, i: usize) -> usize {
    match idx {
        None => i,
        Some(v) => v[i],
    }
}

/// `f(a[i], b[j])` over the broadcast shape of two inputs.
fn map2<A: Copy, B: Copy, T>(
    a: &[A],
    a_shape: &[usize],
    b: &[B],
    b_shape: &[usize],
    f: impl Fn(A, B) -> Result<T>,
) -> Result<Vec<T>> {
    let (out, _) = shape::broadcast_map2(a, a_shape, b, b_shape, f)?;
    out.into_iter().collect()
}

fn float_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else if a > b {
        a
    } else {
        b
    }
}

fn float_min(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else if a < b {
        a
    } else {
        b
    }
}

/// A two-input float op (Mod is fmod: floats require fmod = 1).
fn float_op(op: Op, a: f64, b: f64) -> f64 {
    match op {
        Op::Add | Op::Sum | Op::Mean => a + b,
        Op::Sub => a - b,
        Op::Mul => a * b,
        Op::Div => a / b,
        Op::Pow => libm::pow(a, b),
        Op::Mod { .. } => libm::fmod(a, b),
        Op::Max => float_max(a, b),
        Op::Min => float_min(a, b),
        Op::PRelu if a < 0.0 => a * b,
        Op::PRelu => a,
        _ => f64::NAN,
    }
}

/// A two-input integer op on widened values; `u`: the dtype is unsigned.
fn int_op(op: Op, u: bool, a: i64, b: i64) -> Result<i64> {
    Ok(match op {
        Op::Add | Op::Sum => a.wrapping_add(b),
        Op::Sub => a.wrapping_sub(b),
        Op::Mul => a.wrapping_mul(b),
        Op::Div => {
            if b == 0 {
                0
            } else if u {
                ((a as u64) / (b as u64)) as i64
            } else {
                a.wrapping_div(b)
            }
        }
        Op::Mod { fmod } => {
            if b == 0 {
                0
            } else if u {
                ((a as u64) % (b as u64)) as i64
            } else {
                let r = a.wrapping_rem(b);
                if !fmod && r != 0 && ((r < 0) != (b < 0)) {
                    r + b
                } else {
                    r
                }
            }
        }
        Op::PRelu => {
            if !u && a < 0 {
                a.wrapping_mul(b)
            } else {
                a
            }
        }
        Op::Max => {
            if int_lt(u, a, b) {
                b
            } else {
                a
            }
        }
        Op::Min => {
            if int_lt(u, b, a) {
                b
            } else {
                a
            }
        }
        Op::BitwiseAnd => a & b,
        Op::BitwiseOr => a | b,
        Op::BitwiseXor => a ^ b,
        // Unsigned only: `a` is zero-extended, so a right shift brings in zeros; bits shifted
        // past the element's width are dropped when it is stored.
        Op::BitShift { left } => match u32::try_from(b as u64) {
            Ok(s) if s < 64 => {
                if left {
                    ((a as u64) << s) as i64
                } else {
                    ((a as u64) >> s) as i64
                }
            }
            _ => 0,
        },
        other => bail!("internal: {other:?} is not an integer op"),
    })
}

fn int_lt(u: bool, a: i64, b: i64) -> bool {
    if u {
        (a as u64) < (b as u64)
    } else {
        a < b
    }
}

fn compare<T: PartialOrd>(op: Op, a: T, b: T) -> bool {
    match op {
        Op::Equal => a == b,
        Op::Less => a < b,
        Op::Greater => a > b,
        Op::LessOrEqual => a <= b,
        _ => a >= b,
    }
}

/// `base ^ exp` for integers, wrapping; a negative exponent gives the truncated quotient
/// (0 unless |base| = 1).
fn int_pow(base: i64, base_unsigned: bool, exp: i64, exp_unsigned: bool) -> Result<i64> {
    if !exp_unsigned && exp < 0 {
        return Ok(match base {
            1 => 1,
            -1 if !base_unsigned => {
                if exp % 2 == 0 {
                    1
                } else {
                    -1
                }
            }
            0 => unsupported!("Pow: integer 0 to a negative power"),
            _ => 0,
        });
    }
    let mut e = exp as u64;
    let mut b = base;
    let mut r: i64 = 1;
    while e > 0 {
        if e & 1 == 1 {
            r = r.wrapping_mul(b);
        }
        b = b.wrapping_mul(b);
        e >>= 1;
    }
    Ok(r)
}

/// Widened integer (as in [`Vals::I`]) → f64.
fn int_to_f64(v: i64, unsigned: bool) -> f64 {
    if unsigned {
        v as u64 as f64
    } else {
        v as f64
    }
}

/// Float result → integer of `dtype`, truncating toward zero (NaN → 0; out of range, which
/// ONNX leaves undefined, saturates).
fn f64_to_int(v: f64, dtype: DType) -> i64 {
    if dtype == DType::U64 {
        v as u64 as i64
    } else {
        v as i64
    }
}

fn pow(call: &Call, dtypes: &[DType], shapes: &[Vec<usize>], a: Vals, b: Vals, out: &Tensor) -> Result<()> {
    let (bd, ed) = (dtypes[0], dtypes[1]);
    let (bu, eu) = (is_unsigned(bd), is_unsigned(ed));
    let (ash, bsh) = (&shapes[0][..], &shapes[1][..]);
    match (a, b) {
        (Vals::F(x), Vals::F(y)) => {
            out.write_bytes(&element::encode_as::<f64>(bd, &map2(&x, ash, &y, bsh, |p, q| Ok(libm::pow(p, q)))?)?)
        }
        (Vals::F(x), Vals::I(y)) => out.write_bytes(&element::encode_as::<f64>(
            bd,
            &map2(&x, ash, &y, bsh, |p, q| Ok(libm::pow(p, int_to_f64(q, eu))))?,
        )?),
        (Vals::I(x), Vals::F(y)) => {
            out.write_vec::<i64>(&map2(&x, ash, &y, bsh, |p, q| Ok(f64_to_int(libm::pow(int_to_f64(p, bu), q), bd)))?)
        }
        (Vals::I(x), Vals::I(y)) => out.write_vec::<i64>(&map2(&x, ash, &y, bsh, |p, q| int_pow(p, bu, q, eu))?),
        _ => bail!("{}: bool inputs are not allowed", call.op_type()),
    }
}

/// Threads per block of every launch.
const BLOCK: u32 = 256;

/// Blocks for `n` elements at `per_thread` elements per thread, capped (the kernels loop).
fn grid_for(n: u64, per_thread: u64) -> u32 {
    n.div_ceil(BLOCK as u64 * per_thread.max(1)).clamp(1, 65535 * 32) as u32
}

/// The template argument of a numeric dtype: the prelude's tag (`DType::cuda_tag`) that
/// kernel.toml instantiates `kiln_binary`, `kiln_compare` and `kiln_nary` of cuda/binary.cu
/// with (`kiln_binary<kiln_tag_f16>`); `None` for bool and string, which have none.
fn numeric_tag(dtype: DType) -> Option<&'static str> {
    if dtype.is_float() || dtype.is_int() {
        dtype.cuda_tag()
    } else {
        None
    }
}

/// `enum ArithOp` of cuda/binary.cu (Sum folds with ADD).
fn arith_code(op: Op) -> Option<u32> {
    Some(match op {
        Op::Add | Op::Sum | Op::Mean => 0,
        Op::Sub => 1,
        Op::Mul => 2,
        Op::Div => 3,
        Op::Pow => 4,
        Op::Mod { fmod: true } => 5,
        Op::Mod { fmod: false } => 6,
        Op::Max => 7,
        Op::Min => 8,
        Op::BitwiseAnd => 9,
        Op::BitwiseOr => 10,
        Op::BitwiseXor => 11,
        Op::BitShift { left: true } => 12,
        Op::BitShift { left: false } => 13,
        Op::PRelu => 14,
        _ => return None,
    })
}

/// `enum CmpOp` of cuda/binary.cu.
fn cmp_code(op: Op) -> Option<u32> {
    Some(match op {
        Op::Equal => 0,
        Op::Less => 1,
        Op::Greater => 2,
        Op::LessOrEqual => 3,
        Op::GreaterOrEqual => 4,
        _ => return None,
    })
}

/// `enum LogicOp` of cuda/binary.cu (Equal of bools included).
fn logic_code(op: Op) -> Option<u32> {
    Some(match op {
        Op::And => 0,
        Op::Or => 1,
        Op::Xor => 2,
        Op::Equal => 3,
        _ => return None,
    })
}

/// Most dims a kernel takes.
const MAX_RANK: usize = 8;

/// The broadcast of some inputs to the output shape, as the kernels take it: the output's dims
/// (size-1 dims dropped, adjacent dims merged where every input allows) and each input's
/// element strides along them (0 on broadcast dims).
struct Layout {
    dims: Vec<u64>,
    strides: Vec<Vec<u64>>,
}

impl Layout {
    fn new(out: &[usize], inputs: &[&[usize]]) -> Result<Layout> {
        let r = out.len();
        let mut dims: Vec<u64> = Vec::with_capacity(r);
        let mut strides: Vec<Vec<u64>> = vec![Vec::with_capacity(r); inputs.len()];
        // Each input's strides along the output's axes.
        let full: Vec<Vec<u64>> = inputs
            .iter()
            .map(|s| {
                let lead = r - s.len();
                let mut st = vec![0u64; r];
                let mut acc = 1u64;
                for k in (0..s.len()).rev() {
                    st[lead + k] = if s[k] == 1 { 0 } else { acc };
                    acc *= s[k] as u64;
                }
                st
            })
            .collect();
        for k in 0..r {
            let d = out[k] as u64;
            if d == 1 {
                continue;
            }
            let last = dims.len();
            // Merge into the previous dim when every input steps over this one contiguously.
            if last > 0 && full.iter().zip(&strides).all(|(f, st)| st[last - 1] == f[k] * d) {
                dims[last - 1] *= d;
                for (f, st) in full.iter().zip(strides.iter_mut()) {
                    st[last - 1] = f[k];
                }
                continue;
            }
            dims.push(d);
            for (f, st) in full.iter().zip(strides.iter_mut()) {
                st.push(f[k]);
            }
        }
        if dims.is_empty() {
            // One element: every input has one too.
            dims.push(1);
            strides.iter_mut().for_each(|st| st.push(1));
        }
        if dims.len() > MAX_RANK {
            unsupported!("broadcasting over more than {MAX_RANK} dims");
        }
        Ok(Layout { dims, strides })
    }

    /// All inputs have the output's shape, contiguous.
    fn contiguous(&self) -> bool {
        self.dims.len() == 1 && self.strides.iter().all(|s| s[0] == 1)
    }

    fn push_rank_dims(&self, args: &mut Vec<KernelArg>) {
        args.push(KernelArg::U32(self.dims.len() as u32));
        self.push_dims(args);
    }

    fn push_dims(&self, args: &mut Vec<KernelArg>) {
        args.extend((0..MAX_RANK).map(|k| KernelArg::U64(self.dims.get(k).copied().unwrap_or(1))));
    }

    fn push_strides(&self, args: &mut Vec<KernelArg>) {
        for st in &self.strides {
            args.extend((0..MAX_RANK).map(|k| KernelArg::U64(st.get(k).copied().unwrap_or(0))));
        }
    }
}

fn tensor(handle: u32) -> KernelArg {
    KernelArg::Tensor { handle, offset: 0 }
}

/// One launch of a two-input kernel `kernel(a, b, y, n, op, rank, dims, strides a, strides b)`;
/// `vec`: elements per thread on the contiguous fast path.
#[allow(clippy::too_many_arguments)]
fn launch2(kernel: &str, a: u32, b: u32, y: u32, n: u64, op: u32, lay: &Layout, vec: u64) -> Result<()> {
    let mut args = vec![tensor(a), tensor(b), tensor(y), KernelArg::U64(n), KernelArg::U32(op)];
    lay.push_rank_dims(&mut args);
    lay.push_strides(&mut args);
    let per_thread = if lay.contiguous() { vec } else { 1 };
    launch(&Launch { kernel, grid: [grid_for(n, per_thread), 1, 1], block: [BLOCK, 1, 1], shared_mem_bytes: 0, args })
}

/// Most inputs of one `kiln_nary<Tag>` launch.
const NARY_INPUTS: usize = 8;

/// Max, Min, Sum, Mean: launches of `kiln_nary<Tag>` folding up to eight inputs each; after the
/// first, the output so far is the first input of the next (float16/bfloat16 sums of more than
/// eight inputs round in between).
fn dispatch_nary(call: &Call, op: Op, dtype: DType, shapes: &[Vec<usize>], out: &TensorType) -> Result<()> {
    let Some(tag) = numeric_tag(dtype) else { unsupported!("{}: no CUDA kernel for {dtype}", call.op_type()) };
    let Some(code) = arith_code(op) else { bail!("internal: {op:?} is not variadic") };
    let kernel = kernel_name("kiln_nary", &[tag]);
    let y = call.output(0)?.handle();
    let n: u64 = out.shape.iter().product::<usize>() as u64;
    let count = shapes.len();
    let mut next = 0;
    while next < count {
        // (handle, shape) of this launch's inputs.
        let mut ins: Vec<(u32, &[usize])> = Vec::with_capacity(NARY_INPUTS);
        if next > 0 {
            ins.push((y, &out.shape));
        }
        while ins.len() < NARY_INPUTS && next < count {
            ins.push((call.input(next)?.handle(), &shapes[next]));
            next += 1;
        }
        let used = ins.len();
        let mean = if op == Op::Mean && next == count { count as u32 } else { 0 };
        let lay = Layout::new(&out.shape, &ins.iter().map(|(_, s)| *s).collect::<Vec<_>>())?;
        let mut args =
            vec![tensor(y), KernelArg::U64(n), KernelArg::U32(code), KernelArg::U32(used as u32), KernelArg::U32(mean)];
        lay.push_rank_dims(&mut args);
        // Unused slots repeat the first input with zero strides (never read).
        for k in 0..NARY_INPUTS {
            args.push(tensor(ins.get(k).unwrap_or(&ins[0]).0));
        }
        lay.push_strides(&mut args);
        for _ in used..NARY_INPUTS {
            args.extend((0..MAX_RANK).map(|_| KernelArg::U64(0)));
        }
        launch(&Launch {
            kernel: &kernel,
            grid: [grid_for(n, 1), 1, 1],
            block: [BLOCK, 1, 1],
            shared_mem_bytes: 0,
            args,
        })?;
    }
    Ok(())
}

impl Shim for Binary {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        Ok(vec![check(call)?.out])
    }

    fn cpu(call: &Call) -> Result<()> {
        let Checked { op, dtypes, shapes, out: out_type } = check(call)?;
        let out = call.output(0)?;
        let dtype = dtypes[0];
        let u = is_unsigned(dtype);

        if op == Op::Where {
            let cond: Vec<bool> = call.input(0)?.read_vec::<Bool>()?.into_iter().map(|b| b.0).collect();
            let size = out_type.dtype.size().ok_or_else(|| ShimError::Unsupported("string tensors".into()))?;
            let x = call.input(1)?.read_bytes()?;
            let y = call.input(2)?.read_bytes()?;
            let idx = gather_indices(&shapes, &out_type.shape);
            let n: usize = out_type.shape.iter().product();
            let mut bytes = vec![0u8; n * size];
            for (i, o) in bytes.chunks_exact_mut(size).enumerate() {
                let src = if cond[at(&idx[0], i)] { (&x, at(&idx[1], i)) } else { (&y, at(&idx[2], i)) };
                o.copy_from_slice(&src.0[src.1 * size..(src.1 + 1) * size]);
            }
            return out.write_bytes(&bytes);
        }

        if op.is_variadic() {
            let idx = gather_indices(&shapes, &out_type.shape);
            let n: usize = out_type.shape.iter().product();
            let inputs = call.inputs().iter().map(load).collect::<Result<Vec<Vals>>>()?;
            return match &inputs[0] {
                Vals::F(first) => {
                    let mut acc: Vec<f64> = (0..n).map(|i| first[at(&idx[0], i)]).collect();
                    for (k, v) in inputs.iter().enumerate().skip(1) {
                        let Vals::F(v) = v else { bail!("internal: mixed dtypes") };
                        for (i, a) in acc.iter_mut().enumerate() {
                            *a = float_op(op, *a, v[at(&idx[k], i)]);
                        }
                    }
                    if op == Op::Mean {
                        let count = inputs.len() as f64;
                        acc.iter_mut().for_each(|a| *a /= count);
                    }
                    out.write_bytes(&element::encode_as::<f64>(dtype, &acc)?)
                }
                Vals::I(first) => {
                    let mut acc: Vec<i64> = (0..n).map(|i| first[at(&idx[0], i)]).collect();
                    for (k, v) in inputs.iter().enumerate().skip(1) {
                        let Vals::I(v) = v else { bail!("internal: mixed dtypes") };
                        for (i, a) in acc.iter_mut().enumerate() {
                            *a = int_op(op, u, *a, v[at(&idx[k], i)])?;
                        }
                    }
                    out.write_vec::<i64>(&acc)
                }
                Vals::B(_) => bail!("{}: bool inputs are not allowed", call.op_type()),
            };
        }

        if fast_f32(call, op, &dtypes, &shapes, &out_type)? {
            return Ok(());
        }
        let a = load(&call.input(0)?)?;
        let b = load(&call.input(1)?)?;
        if op == Op::Pow {
            return pow(call, &dtypes, &shapes, a, b, &out);
        }
        let (ash, bsh) = (&shapes[0][..], &shapes[1][..]);
        if op.is_comparison() || op.is_logical() {
            let r: Vec<Bool> = match (a, b) {
                (Vals::F(x), Vals::F(y)) => map2(&x, ash, &y, bsh, |p, q| Ok(Bool(compare(op, p, q))))?,
                (Vals::I(x), Vals::I(y)) if u => {
                    map2(&x, ash, &y, bsh, |p, q| Ok(Bool(compare(op, p as u64, q as u64))))?
                }
                (Vals::I(x), Vals::I(y)) => map2(&x, ash, &y, bsh, |p, q| Ok(Bool(compare(op, p, q))))?,
                (Vals::B(x), Vals::B(y)) => map2(&x, ash, &y, bsh, |p, q| {
                    Ok(Bool(match op {
                        Op::And => p && q,
                        Op::Or => p || q,
                        Op::Xor => p != q,
                        _ => compare(op, p, q),
                    }))
                })?,
                _ => bail!("internal: mixed dtypes"),
            };
            return out.write_vec::<Bool>(&r);
        }
        match (a, b) {
            (Vals::F(x), Vals::F(y)) => out.write_bytes(&element::encode_as::<f64>(
                dtype,
                &map2(&x, ash, &y, bsh, |p, q| Ok(float_op(op, p, q)))?,
            )?),
            (Vals::I(x), Vals::I(y)) => out.write_vec::<i64>(&map2(&x, ash, &y, bsh, |p, q| int_op(op, u, p, q))?),
            _ => bail!("{}: bool inputs are not allowed", call.op_type()),
        }
    }

    fn dispatch(call: &Call) -> Result<()> {
        let Checked { op, dtypes, shapes, out } = check(call)?;
        let name = call.op_type();
        let n: u64 = out.shape.iter().product::<usize>() as u64;
        if n == 0 {
            return Ok(());
        }
        if op.is_variadic() {
            return dispatch_nary(call, op, dtypes[0], &shapes, &out);
        }
        let y = call.output(0)?.handle();
        let h = |i: usize| -> Result<u32> { Ok(call.input(i)?.handle()) };
        if op == Op::Where {
            let size = match out.dtype.size() {
                Some(s @ (1 | 2 | 4 | 8)) => s,
                _ => unsupported!("Where: no CUDA kernel for {}", out.dtype),
            };
            let lay = Layout::new(&out.shape, &[&shapes[0], &shapes[1], &shapes[2]])?;
            let mut args = vec![tensor(h(0)?), tensor(h(1)?), tensor(h(2)?), tensor(y), KernelArg::U64(n)];
            lay.push_rank_dims(&mut args);
            lay.push_strides(&mut args);
            let kernel = kernel_name("kiln_where", &[&format!("{size}")]);
            return launch(&Launch {
                kernel: &kernel,
                grid: [grid_for(n, 1), 1, 1],
                block: [BLOCK, 1, 1],
                shared_mem_bytes: 0,
                args,
            });
        }
        let (a, b) = (h(0)?, h(1)?);
        let lay = Layout::new(&out.shape, &[&shapes[0], &shapes[1]])?;
        let dtype = dtypes[0];
        let vec = 16 / dtype.size().unwrap_or(16) as u64;
        if op == Op::Pow && dtypes[1] != dtype {
            let (Some(_), Some(_)) = (numeric_tag(dtype), numeric_tag(dtypes[1])) else {
                unsupported!("Pow: no CUDA kernel for {dtype} and {}", dtypes[1]);
            };
            let mut args = vec![
                tensor(a),
                tensor(b),
                tensor(y),
                KernelArg::U64(n),
                KernelArg::U32(dtype.code() as u32),
                KernelArg::U32(dtypes[1].code() as u32),
            ];
            lay.push_rank_dims(&mut args);
            lay.push_strides(&mut args);
            return launch(&Launch {
                kernel: "kiln_pow",
                grid: [grid_for(n, 1), 1, 1],
                block: [BLOCK, 1, 1],
                shared_mem_bytes: 0,
                args,
            });
        }
        if op.is_logical() || (op == Op::Equal && dtype == DType::Bool) {
            let Some(code) = logic_code(op) else { bail!("internal: {op:?} is not logical") };
            return launch2("kiln_logic", a, b, y, n, code, &lay, vec);
        }
        let Some(tag) = numeric_tag(dtype) else { unsupported!("{name}: no CUDA kernel for {dtype}") };
        if op.is_comparison() {
            let Some(code) = cmp_code(op) else { bail!("internal: {op:?} is not a comparison") };
            return launch2(&kernel_name("kiln_compare", &[tag]), a, b, y, n, code, &lay, vec);
        }
        let Some(code) = arith_code(op) else { bail!("internal: {op:?} is not arithmetic") };
        launch2(&kernel_name("kiln_binary", &[tag]), a, b, y, n, code, &lay, vec)
    }
}

export_shim!(Binary);
