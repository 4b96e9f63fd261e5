//! ONNX's integer matrix products, after Operators.md and the reference implementation:
//!
//! * MatMulInteger-10: `Y = (A − a_zero_point) · (B − b_zero_point)` in int32; A and B uint8 or
//!   int8; a_zero_point per tensor or per row of A ([M]), b_zero_point per tensor or per column
//!   of B ([N]).
//! * QLinearMatMul (10, 21): `C = (a − a_zero_point) · (b − b_zero_point)` in int32, then
//!   `y = saturate(rint(C · f) + y_zero_point)` with f = a_scale · b_scale / y_scale, each
//!   step rounded to the scales' dtype (as numpy computes it), C · f in f64. b_scale and
//!   b_zero_point per tensor or per column; y of y_zero_point's type.
//!
//! A [..., M, K] and B [..., K, N] of rank 2 or more; their batch dimensions are equal, or one
//! side's are all 1 (it broadcasts).
use super::onnx_quant::Int;
use super::{grid_for, BLOCK};
use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, unsupported};

struct Plan {
    a_int: Int,
    b_int: Int,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a_batched: bool,
    b_batched: bool,
    out_shape: Vec<usize>,
    /// Input indices of a's and b's zero points, and whether they go per row / per column.
    a_zp: Option<usize>,
    b_zp: Option<usize>,
    a_zp_rows: bool,
    b_zp_cols: bool,
    /// QLinearMatMul: b's scale per column; the output type.
    b_scale_cols: bool,
    y_int: Int,
    y_dtype: DType,
}

fn plan(call: &Call) -> Result<Plan> {
    let op = call.op_type();
    let ql = op == "QLinearMatMul";
    let (ai, bi) = if ql { (0, 3) } else { (0, 1) };
    let (a, b) = (call.input(ai)?, call.input(bi)?);
    let int = |t: &Tensor, what: &str| -> Result<Int> {
        match Int::of(t.dtype()?) {
            Some(i @ (Int::U8 | Int::I8)) => Ok(i),
            _ => unsupported!("{op}: {what} is {}; uint8 and int8 are supported", t.dtype()?),
        }
    };
    let (a_int, b_int) = (int(&a, "a")?, int(&b, "b")?);
    let (sa, sb) = (a.shape()?, b.shape()?);
    if sa.len() < 2 || sb.len() < 2 {
        unsupported!("{op}: 1-D operands ({sa:?}, {sb:?}); A and B of rank 2 or more are supported");
    }
    let (m, k, n) = (sa[sa.len() - 2], sa[sa.len() - 1], sb[sb.len() - 1]);
    if sb[sb.len() - 2] != k {
        bail!("{op}: A {sa:?} and B {sb:?} do not chain (K {k} against {})", sb[sb.len() - 2]);
    }
    let (ba, bb) = (&sa[..sa.len() - 2], &sb[..sb.len() - 2]);
    let ones = |v: &[usize]| v.iter().all(|&d| d == 1);
    let batch_dims: Vec<usize> = if ba == bb {
        ba.to_vec()
    } else if ones(ba) && bb.len() >= ba.len() {
        bb.to_vec()
    } else if ones(bb) && ba.len() >= bb.len() {
        ba.to_vec()
    } else {
        unsupported!("{op}: batch dimensions {ba:?} and {bb:?}; equal ones, or one side all 1, are supported");
    };
    let batch: usize = batch_dims.iter().product();
    let mut out_shape = batch_dims.clone();
    out_shape.extend([m, n]);
    // A zero point (input `i`): absent, one value, or `per` values (row or column).
    let zp = |i: usize, per: usize, like: Int, what: &str| -> Result<(Option<usize>, bool)> {
        let Some(z) = call.input_opt(i) else { return Ok((None, false)) };
        if Int::of(z.dtype()?) != Some(like) {
            bail!("{op}: {what} is {}, not its operand's type", z.dtype()?);
        }
        match z.numel()? {
            1 => Ok((Some(i), false)),
            c if c == per && z.rank()? == 1 && per > 1 => Ok((Some(i), true)),
            _ => unsupported!(
                "{op}: {what} {:?}; one value{} is supported",
                z.shape()?,
                if per > 1 { alloc::format!(" or a 1-D [{per}]") } else { alloc::string::String::new() }
            ),
        }
    };
    let (a_zp, a_zp_rows) = zp(2, if ql { 1 } else { m }, a_int, "a_zero_point")?;
    let (b_zp, b_zp_cols) = zp(if ql { 5 } else { 3 }, n, b_int, "b_zero_point")?;
    let (mut b_scale_cols, mut y_int, mut y_dtype) = (false, Int::I32, DType::I32);
    if ql {
        let sd = call.input(1)?.dtype()?;
        if !matches!(sd, DType::F32 | DType::F16 | DType::BF16) {
            unsupported!("{op}: scales of {sd}; float32, float16 and bfloat16 are supported");
        }
        for (i, what) in [(1, "a_scale"), (4, "b_scale"), (6, "y_scale")] {
            let s = call.input(i)?;
            if s.dtype()? != sd {
                bail!("{op}: {what} is {}, a_scale {sd}", s.dtype()?);
            }
            match s.numel()? {
                1 => {}
                c if i == 4 && c == n => b_scale_cols = true,
                _ => unsupported!(
                    "{op}: {what} {:?}; one value{} is supported",
                    s.shape()?,
                    if i == 4 { " or one per column" } else { "" }
                ),
            }
        }
        y_dtype = match call.input_opt(7) {
            Some(z) if z.numel()? == 1 => z.dtype()?,
            Some(z) => bail!("{op}: y_zero_point {:?} must be one value", z.shape()?),
            None => a.dtype()?,
        };
        y_int = Int::of(y_dtype).filter(|i| matches!(i, Int::U8 | Int::I8)).ok_or_else(|| {
            ShimError::Unsupported(alloc::format!("{op}: y of {y_dtype}; uint8 and int8 are supported"))
        })?;
    }
    Ok(Plan {
        a_int,
        b_int,
        batch,
        m,
        n,
        k,
        a_batched: !ones(ba) || ba == bb,
        b_batched: !ones(bb) || ba == bb,
        out_shape,
        a_zp,
        b_zp,
        a_zp_rows,
        b_zp_cols,
        b_scale_cols,
        y_int,
        y_dtype,
    })
}

pub(crate) fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    Ok(alloc::vec![TensorType::new(p.y_dtype, p.out_shape)])
}

/// Rounds `v` to the scales' dtype `d` (numpy's arithmetic on arrays of that dtype).
fn round_to(d: DType, v: f64) -> f64 {
    match d {
        DType::F16 => f16::from_f64(v).to_f64(),
        DType::BF16 => bf16::from_f64(v).to_f64(),
        _ => v as f32 as f64,
    }
}

pub(crate) fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let ql = call.op_type() == "QLinearMatMul";
    let (a, b) = (call.input(0)?.read_vec::<f64>()?, call.input(if ql { 3 } else { 1 })?.read_vec::<f64>()?);
    let read = |i: Option<usize>| -> Result<Vec<f64>> {
        match i.and_then(|i| call.input_opt(i)) {
            Some(t) => t.read_vec::<f64>(),
            None => Ok(alloc::vec![0.0]),
        }
    };
    let (za, zb) = (read(p.a_zp)?, read(p.b_zp)?);
    let (sa, sb, sy, zy) = if ql {
        (read(Some(1))?, read(Some(4))?, read(Some(6))?, read(Some(7))?)
    } else {
        (Vec::new(), Vec::new(), Vec::new(), Vec::new())
    };
    let sd = if ql { call.input(1)?.dtype()? } else { DType::F32 };
    let mut y = Vec::with_capacity(p.batch * p.m * p.n);
    for bt in 0..p.batch {
        let (ab, bb) = (if p.a_batched { bt } else { 0 }, if p.b_batched { bt } else { 0 });
        for r in 0..p.m {
            for c in 0..p.n {
                let zar = za[if p.a_zp_rows { r } else { 0 }];
                let zbc = zb[if p.b_zp_cols { c } else { 0 }];
                let acc: f64 = (0..p.k)
                    .map(|kk| (a[(ab * p.m + r) * p.k + kk] - zar) * (b[(bb * p.k + kk) * p.n + c] - zbc))
                    .sum();
                y.push(if ql {
                    let f = round_to(sd, round_to(sd, sa[0] * sb[if p.b_scale_cols { c } else { 0 }]) / sy[0]);
                    p.y_int.saturate(libm::rint(acc * f + zy[0]))
                } else {
                    acc as i64 as i32 as f64 // int32 accumulation wraps, as on the GPU
                });
            }
        }
    }
    call.output(0)?.write_vec(&y)
}

pub(crate) fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let ql = call.op_type() == "QLinearMatMul";
    let total = p.batch * p.m * p.n;
    if total == 0 {
        return Ok(());
    }
    let a = call.input(0)?;
    let h = |i: Option<usize>| -> Result<KernelArg> {
        let t = match i {
            Some(i) => call.input(i)?,
            None => a,
        };
        Ok(KernelArg::Tensor { handle: t.handle(), offset: 0 })
    };
    let tag = if ql {
        match call.input(1)?.dtype()?.cuda_tag() {
            Some(t) => t,
            None => unsupported!("QLinearMatMul: no CUDA kernel for its scales' dtype"),
        }
    } else {
        "kiln_tag_f32"
    };
    let (s, yz) = if ql { ([Some(1), Some(4), Some(6)], Some(7)) } else { ([None; 3], None) };
    let args = alloc::vec![
        h(Some(0))?,
        h(Some(if ql { 3 } else { 1 }))?,
        h(p.a_zp)?,
        h(p.b_zp)?,
        h(s[0])?,
        h(s[1])?,
        h(s[2])?,
        h(yz.filter(|&i| call.input_opt(i).is_some()))?,
        KernelArg::Tensor { handle: call.output(0)?.handle(), offset: 0 },
        KernelArg::U64(p.batch as u64),
        KernelArg::U64(p.m as u64),
        KernelArg::U64(p.n as u64),
        KernelArg::U64(p.k as u64),
        KernelArg::U32(p.a_batched as u32),
        KernelArg::U32(p.b_batched as u32),
        KernelArg::U32(p.a_int as u32),
        KernelArg::U32(p.b_int as u32),
        KernelArg::U32(p.y_int as u32),
        KernelArg::U32(p.a_zp.is_some() as u32),
        KernelArg::U32(p.b_zp.is_some() as u32),
        KernelArg::U32(p.a_zp_rows as u32),
        KernelArg::U32(p.b_zp_cols as u32),
        KernelArg::U32(ql as u32),
        KernelArg::U32(p.b_scale_cols as u32),
        KernelArg::U32(yz.is_some_and(|i| call.input_opt(i).is_some()) as u32),
    ];
    launch(&Launch {
        kernel: &kernel_name("kiln_qmatmul", &[tag]),
        grid: [grid_for(total), 1, 1],
        block: [BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args,
    })
}
