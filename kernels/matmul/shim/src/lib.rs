//! Shim of `kiln-matmul`: MatMul-1/9/13 (numpy `matmul` semantics: a 1-D operand is promoted
//! to a matrix and the added dimension removed again, batch dimensions broadcast) and
//! Gemm-7/9/11/13 (`transA`, `transB`, `alpha`, `beta`, optional `C` broadcast
//! unidirectionally to (M, N)), following ONNX Operators.md.
//!
//! `ai.kiln::Linear`, `RmsNormLinear` and `SwiGluLinear` (weights stored `[N, K]`; the decode
//! fusions) are in [`linear`]; Einsum-12 in [`einsum`]; DFT-17/19/20 in [`dft`].
//!
//! The CPU reference computes float32, float16 and bfloat16 products through the host's `gemm`
//! (ABI.md §4.7: multithreaded, accumulating in f32 as cuBLASLt does; manifest schema 8), so a
//! weight is never copied into the shim; float64 products accumulate in f64 and integer
//! products in i64 with wrapping arithmetic (the same result, modulo 2^bits, as wrapping in the
//! element type).
#![no_std]
extern crate alloc;

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, export_shim, unsupported, with_dtype};

mod det;
mod dft;
mod einsum;
mod linear;
mod stft;

struct MatMulPkg;

/// An accumulator type: f64 for floating-point dtypes, i64 (wrapping) for integer dtypes.
trait Acc: Copy + Default {
    fn mac(self, a: Self, b: Self) -> Self;
}

impl Acc for f64 {
    fn mac(self, a: f64, b: f64) -> f64 {
        self + a * b
    }
}

impl Acc for i64 {
    fn mac(self, a: i64, b: i64) -> i64 {
        self.wrapping_add(a.wrapping_mul(b))
    }
}

/// `out[m×n] = a[m×k] · b[k×n]`, all row-major; every output element sums its products in
/// order of increasing `k`.
fn mm<A: Acc>(a: &[A], b: &[A], m: usize, k: usize, n: usize, out: &mut [A]) {
    for i in 0..m {
        let row = &mut out[i * n..(i + 1) * n];
        row.iter_mut().for_each(|o| *o = A::default());
        for p in 0..k {
            let av = a[i * k + p];
            let brow = &b[p * n..(p + 1) * n];
            for (o, &bv) in row.iter_mut().zip(brow) {
                *o = o.mac(av, bv);
            }
        }
    }
}

/// Transposes a row-major `rows × cols` matrix.
fn transpose<A: Copy>(x: &[A], rows: usize, cols: usize) -> Vec<A> {
    let mut out = Vec::with_capacity(x.len());
    for c in 0..cols {
        for r in 0..rows {
            out.push(x[r * cols + c]);
        }
    }
    out
}

/// Whether the package computes `dtype` (floats in f64, integers in i64).
fn check_dtype(op: &str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 => Ok(()),
        DType::I8 | DType::I16 | DType::I32 | DType::I64 | DType::U8 | DType::U16 | DType::U32 | DType::U64 => Ok(()),
        other => unsupported!("{op}: dtype {other} is not supported"),
    }
}

/// The operands' common dtype.
fn operand_dtype(call: &Call, inputs: &[usize]) -> Result<DType> {
    let dtype = call.input(inputs[0])?.dtype()?;
    for &i in &inputs[1..] {
        if let Some(t) = call.input_opt(i) {
            let d = t.dtype()?;
            if d != dtype {
                bail!("{}: input {i} has dtype {d}, input {} has {dtype}", call.op_type(), inputs[0]);
            }
        }
    }
    check_dtype(call.op_type(), dtype)?;
    Ok(dtype)
}

/// MatMul's geometry: operands promoted to rank >= 2.
struct MatMulPlan {
    a_batch: Vec<usize>,
    b_batch: Vec<usize>,
    batch: Vec<usize>,
    m: usize,
    k: usize,
    n: usize,
    out_shape: Vec<usize>,
}

fn matmul_plan(a: &[usize], b: &[usize]) -> Result<MatMulPlan> {
    if a.is_empty() || b.is_empty() {
        bail!("MatMul: operands must have rank >= 1, got shapes {a:?} and {b:?}");
    }
    // 1-D A: [K] -> [1, K]; 1-D B: [K] -> [K, 1].
    let (a_batch, m, ka) =
        if a.len() == 1 { (&a[..0], 1, a[0]) } else { (&a[..a.len() - 2], a[a.len() - 2], a[a.len() - 1]) };
    let (b_batch, kb, n) =
        if b.len() == 1 { (&b[..0], b[0], 1) } else { (&b[..b.len() - 2], b[b.len() - 2], b[b.len() - 1]) };
    if ka != kb {
        bail!("MatMul: inner dimensions differ: shapes {a:?} and {b:?}");
    }
    let batch = shape::broadcast_shapes(&[a_batch, b_batch])
        .map_err(|_| ShimError::Failed(format!("MatMul: batch dimensions of {a:?} and {b:?} do not broadcast")))?;
    let mut out_shape = batch.clone();
    if a.len() >= 2 {
        out_shape.push(m);
    }
    if b.len() >= 2 {
        out_shape.push(n);
    }
    Ok(MatMulPlan { a_batch: a_batch.into(), b_batch: b_batch.into(), batch, m, k: ka, n, out_shape })
}

fn matmul_run<A: Acc>(p: &MatMulPlan, a: &[A], b: &[A]) -> Vec<A> {
    let (m, k, n) = (p.m, p.k, p.n);
    let ia = shape::broadcast_index(&p.a_batch, &p.batch);
    let ib = shape::broadcast_index(&p.b_batch, &p.batch);
    let mut out = vec![A::default(); ia.len() * m * n];
    for (bi, (&x, &y)) in ia.iter().zip(&ib).enumerate() {
        mm(
            &a[x * m * k..(x + 1) * m * k],
            &b[y * k * n..(y + 1) * k * n],
            m,
            k,
            n,
            &mut out[bi * m * n..(bi + 1) * m * n],
        );
    }
    out
}

/// Gemm's geometry.
struct GemmPlan {
    m: usize,
    k: usize,
    n: usize,
    trans_a: bool,
    trans_b: bool,
    alpha: f64,
    beta: f64,
    /// C's shape, when C is present.
    c_shape: Option<Vec<usize>>,
}

fn gemm_plan(call: &Call) -> Result<GemmPlan> {
    if call.opset() < 7 {
        unsupported!("Gemm-{}: opsets before 7 (the `broadcast` attribute) are not implemented", call.opset());
    }
    let a = call.input(0)?.shape()?;
    let b = call.input(1)?.shape()?;
    if a.len() != 2 || b.len() != 2 {
        bail!("Gemm: A and B must be matrices, got shapes {a:?} and {b:?}");
    }
    let trans_a = call.attr_i("transA", 0)? != 0;
    let trans_b = call.attr_i("transB", 0)? != 0;
    let (m, ka) = if trans_a { (a[1], a[0]) } else { (a[0], a[1]) };
    let (kb, n) = if trans_b { (b[1], b[0]) } else { (b[0], b[1]) };
    if ka != kb {
        bail!("Gemm: inner dimensions differ: A {a:?} (transA={trans_a}), B {b:?} (transB={trans_b})");
    }
    let c_shape = match call.input_opt(2) {
        None => None,
        Some(c) => {
            let cs = c.shape()?;
            // Unidirectional broadcast to (M, N).
            let ok = cs.len() <= 2 && cs.iter().rev().zip([n, m]).all(|(&d, want)| d == 1 || d == want);
            if !ok {
                bail!("Gemm: C of shape {cs:?} does not broadcast to ({m}, {n})");
            }
            Some(cs)
        }
    };
    Ok(GemmPlan {
        m,
        k: ka,
        n,
        trans_a,
        trans_b,
        alpha: call.attr_f("alpha", 1.0)? as f64,
        beta: call.attr_f("beta", 1.0)? as f64,
        c_shape,
    })
}

impl GemmPlan {
    /// A' (M×K) and B' (K×N) row-major, from the operands as stored.
    fn operands<A: Copy>(&self, a: Vec<A>, b: Vec<A>) -> (Vec<A>, Vec<A>) {
        let a = if self.trans_a { transpose(&a, self.k, self.m) } else { a };
        let b = if self.trans_b { transpose(&b, self.n, self.k) } else { b };
        (a, b)
    }

    /// For each output element, the index of the element of C added to it.
    fn c_index(&self) -> Option<Vec<usize>> {
        self.c_shape.as_ref().map(|cs| shape::broadcast_index(cs, &[self.m, self.n]))
    }
}

fn gemm_cpu(call: &Call, dtype: DType) -> Result<()> {
    let p = gemm_plan(call)?;
    if p.m * p.n > 0 && gemm_gemm(call, dtype, &p, true)? {
        return Ok(());
    }
    let y = call.output(0)?;
    // beta == 0 ignores C altogether (as the ONNX reference does).
    let c_used = p.c_shape.is_some() && p.beta != 0.0;
    let mut out = vec![0f64; p.m * p.n];
    if dtype.is_float() {
        let (a, b) = p.operands(call.input(0)?.read_vec::<f64>()?, call.input(1)?.read_vec::<f64>()?);
        mm(&a, &b, p.m, p.k, p.n, &mut out);
        for v in out.iter_mut() {
            *v *= p.alpha;
        }
    } else {
        let (a, b) = p.operands(call.input(0)?.read_vec::<i64>()?, call.input(1)?.read_vec::<i64>()?);
        let mut acc = vec![0i64; p.m * p.n];
        mm(&a, &b, p.m, p.k, p.n, &mut acc);
        if p.alpha == 1.0 && (!c_used || p.beta == 1.0) {
            // Exact integer arithmetic, wrapping.
            if c_used {
                let c = call.input(2)?.read_vec::<i64>()?;
                let ic = p.c_index().unwrap_or_default();
                for (v, &j) in acc.iter_mut().zip(&ic) {
                    *v = v.wrapping_add(c[j]);
                }
            }
            return y.write_vec(&acc);
        }
        // A scaled integer product: A·B in the element type, then scaled in floating point
        // and truncated back (numpy's `(dot(a, b) * alpha + c * beta).astype(dtype)`).
        out =
            with_dtype!(dtype, T => Ok(acc.iter().map(|&v| T::from_i64(v).to_f64() * p.alpha).collect::<Vec<f64>>()))?;
    }
    if c_used {
        let c = call.input(2)?.read_vec::<f64>()?;
        let ic = p.c_index().unwrap_or_default();
        for (v, &j) in out.iter_mut().zip(&ic) {
            *v += c[j] * p.beta;
        }
    }
    y.write_vec(&out)
}

// ---- GPU dispatch ------------------------------------------------------------------------------

fn tensor_at(handle: u32, offset: u64) -> KernelArg {
    KernelArg::Tensor { handle, offset }
}

/// Whether cuBLASLt (the host's `gemm`) computes `dtype`.
fn gemm_dtype(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

/// `kiln_matmul_tiled`'s template argument for `dtype`: the prelude's tag of a dtype kernel.toml
/// instantiates it for.
fn tiled_tag(op: &str, dtype: DType) -> Result<&'static str> {
    match (dtype, dtype.cuda_tag()) {
        (
            DType::F32 | DType::F16 | DType::BF16 | DType::F64 | DType::I32 | DType::I64 | DType::U32 | DType::U64,
            Some(tag),
        ) => Ok(tag),
        _ => unsupported!("{op}: no CUDA kernel for {dtype}"),
    }
}

/// Most gemm calls one MatMul issues before it takes the tiled kernel instead.
const MAX_GEMM_CALLS: u64 = 256;

/// One group of merged batch dimensions: its size and the strides (elements) of A, B and Y.
#[derive(Clone, Copy)]
struct BatchGroup {
    size: u64,
    a: u64,
    b: u64,
    y: u64,
}

/// MatMul's batch dimensions, those of size 1 in the output dropped and neighbours whose strides
/// continue each other merged, outermost first.
fn batch_groups(p: &MatMulPlan) -> Vec<BatchGroup> {
    let l = p.batch.len();
    let pad = |v: &[usize]| -> Vec<u64> {
        let mut out = vec![1u64; l - v.len()];
        out.extend(v.iter().map(|&d| d as u64));
        out
    };
    let (ab, bb) = (pad(&p.a_batch), pad(&p.b_batch));
    let (m, k, n) = (p.m as u64, p.k as u64, p.n as u64);
    // Element strides of each batch dimension in A, B and Y.
    let (mut sa, mut sb, mut sy) = (m * k, k * n, m * n);
    let mut dims = Vec::new();
    for d in (0..l).rev() {
        let size = p.batch[d] as u64;
        if size != 1 {
            dims.push((size, if ab[d] == 1 { 0 } else { sa }, if bb[d] == 1 { 0 } else { sb }, sy));
        }
        sa *= ab[d];
        sb *= bb[d];
        sy *= size;
    }
    // `dims` runs innermost first: merge each dimension into the group inside it when every
    // stride continues that group's (or A, resp. B, broadcasts both).
    let mut groups: Vec<BatchGroup> = Vec::new();
    for (size, a, b, y) in dims {
        if let Some(g) = groups.last_mut() {
            let cont = |outer: u64, inner: u64| (outer == 0 && inner == 0) || (inner != 0 && outer == inner * g.size);
            if cont(a, g.a) && cont(b, g.b) && y == g.y * g.size {
                g.size *= size;
                continue;
            }
        }
        groups.push(BatchGroup { size, a, b, y });
    }
    groups.reverse();
    groups
}

/// MatMul as host GEMMs (cuBLASLt in a dispatch, the host's CPU GEMM in a CPU call): `false`
/// when they do not compute it (a dtype they do not take, K = 0, or more than
/// [`MAX_GEMM_CALLS`] calls for the batch).
fn matmul_gemms(call: &Call, dtype: DType, p: &MatMulPlan) -> Result<bool> {
    let (a, b, y) = (call.input(0)?, call.input(1)?, call.output(0)?);
    let (m, k, n) = (p.m as u64, p.k as u64, p.n as u64);
    if !gemm_dtype(dtype) || k == 0 {
        return Ok(false);
    }
    let groups = batch_groups(p);
    let esize = dtype.size().unwrap_or(4) as u64;
    // The innermost group is the gemm's batch (or, where B is shared and A's matrices are
    // consecutive, folded into M); the outer groups are separate calls.
    let (inner, outer) = match groups.split_last() {
        Some((g, rest)) => (Some(*g), rest),
        None => (None, &groups[..]),
    };
    let calls: u64 = outer.iter().map(|g| g.size).product();
    if calls > MAX_GEMM_CALLS {
        return Ok(false);
    }
    let (gm, batch, sa, sb, sy) = match inner {
        None => (m, 1, 0, 0, 0),
        Some(g) if g.b == 0 && g.a == m * k => (m * g.size, 1, 0, 0, 0),
        Some(g) => (m, g.size, g.a, g.b, g.y),
    };
    for c in 0..calls {
        let (mut rem, mut oa, mut ob, mut oy) = (c, 0u64, 0u64, 0u64);
        for g in outer.iter().rev() {
            let i = rem % g.size;
            rem /= g.size;
            oa += i * g.a;
            ob += i * g.b;
            oy += i * g.y;
        }
        let operand = |handle: u32, off: u64, ld: u64, stride: u64| Operand {
            handle,
            offset: off * esize,
            ld,
            batch_stride: stride,
        };
        gemm(&Gemm {
            dtype,
            trans_a: false,
            trans_b: false,
            m: gm,
            n,
            k,
            batch,
            alpha: 1.0,
            beta: 0.0,
            a: operand(a.handle(), oa, k, sa),
            b: operand(b.handle(), ob, n, sb),
            c: None,
            d: operand(y.handle(), oy, n, sy),
            bias: None,
            epilogue: Epilogue::None,
        })?;
    }
    Ok(true)
}

fn matmul_dispatch(call: &Call) -> Result<()> {
    let dtype = operand_dtype(call, &[0, 1])?;
    let (a, b) = (call.input(0)?, call.input(1)?);
    let p = matmul_plan(&a.shape()?, &b.shape()?)?;
    let y = call.output(0)?;
    let (m, k, n) = (p.m as u64, p.k as u64, p.n as u64);
    if y.numel()? == 0 || matmul_gemms(call, dtype, &p)? {
        return Ok(());
    }
    let groups = batch_groups(&p);
    if groups.len() > 6 {
        unsupported!("MatMul: more than 6 batch dimensions");
    }
    let batch: u64 = groups.iter().map(|g| g.size).product();
    let mut args = vec![
        tensor_at(a.handle(), 0),
        tensor_at(b.handle(), 0),
        tensor_at(a.handle(), 0),
        tensor_at(y.handle(), 0),
        KernelArg::U64(m),
        KernelArg::U64(n),
        KernelArg::U64(k),
        KernelArg::U64(k),
        KernelArg::U64(1),
        KernelArg::U64(n),
        KernelArg::U64(1),
        KernelArg::U64(0),
        KernelArg::U64(0),
        KernelArg::U32(0),
        KernelArg::F32(1.0),
        KernelArg::F32(0.0),
        KernelArg::U32(0),
        KernelArg::U64(batch),
        KernelArg::U32(groups.len() as u32),
    ];
    args.extend((0..6).map(|i| KernelArg::U64(groups.get(i).map_or(1, |g| g.size))));
    args.extend((0..6).map(|i| KernelArg::U64(groups.get(i).map_or(0, |g| g.a))));
    args.extend((0..6).map(|i| KernelArg::U64(groups.get(i).map_or(0, |g| g.b))));
    launch_tiled(call.op_type(), dtype, m, n, batch, args)
}

fn launch_tiled(op: &str, dtype: DType, m: u64, n: u64, batch: u64, args: Vec<KernelArg>) -> Result<()> {
    launch(&Launch {
        kernel: &kernel_name("kiln_matmul_tiled", &[tiled_tag(op, dtype)?]),
        grid: [n.div_ceil(16).min(1 << 20) as u32, m.div_ceil(16).min(65535) as u32, batch.min(65535) as u32],
        block: [16, 16, 1],
        shared_mem_bytes: 0,
        args,
    })
}

/// C's shape as (rows, cols) and its element strides over (M, N), 0 where it broadcasts.
fn c_geometry(p: &GemmPlan) -> ((u64, u64), (u64, u64)) {
    let (c_rows, c_cols) = match p.c_shape.as_deref() {
        Some([r, c]) => (*r as u64, *c as u64),
        Some([c]) => (1, *c as u64),
        _ => (1, 1),
    };
    ((c_rows, c_cols), (if c_rows == 1 { 0 } else { c_cols }, if c_cols == 1 { 0 } else { 1 }))
}

/// Gemm as one host GEMM (cuBLASLt in a dispatch, the host's CPU GEMM in a CPU call): `false`
/// when it does not compute it (a dtype it does not take, or K = 0). A C that broadcasts other
/// than as a bias row is made whole first: by a kernel in a dispatch, by the shim in a CPU call.
fn gemm_gemm(call: &Call, dtype: DType, p: &GemmPlan, cpu: bool) -> Result<bool> {
    let (m, k, n) = (p.m as u64, p.k as u64, p.n as u64);
    if !gemm_dtype(dtype) || k == 0 {
        return Ok(false);
    }
    let (a, b, y) = (call.input(0)?, call.input(1)?, call.output(0)?);
    let c = call.input_opt(2).filter(|_| p.beta != 0.0);
    let ((c_rows, c_cols), (c_rs, c_cs)) = c_geometry(p);
    let esize = dtype.size().unwrap_or(4) as u64;
    let beta = p.beta as f32;
    let operand = |handle: u32, ld: u64| Operand { handle, offset: 0, ld, batch_stride: 0 };
    let (mut c_op, mut bias, mut g_beta) = (None, None, 0.0);
    if let Some(c) = c {
        if (c_rows == m || m == 1) && (c_cols == n || n == 1) && c_rows * c_cols == m * n {
            c_op = Some(operand(c.handle(), n));
            g_beta = beta;
        } else if c_rows == 1 && c_cols == n && beta == 1.0 {
            bias = Some(operand(c.handle(), n));
        } else {
            // Materialise the broadcast C, then use it with beta.
            let full = if cpu {
                let bytes = c.read_bytes()?;
                let e = esize as usize;
                let mut out = Vec::with_capacity((m * n) as usize * e);
                for i in 0..m {
                    for j in 0..n {
                        let at = ((i * c_rs + j * c_cs) as usize) * e;
                        out.extend_from_slice(&bytes[at..at + e]);
                    }
                }
                scratch_from(&out)?
            } else {
                let full = scratch(m * n * esize)?;
                launch(&Launch {
                    kernel: "kiln_matmul_bcast",
                    grid: [(m * n).div_ceil(256).min(1 << 20) as u32, 1, 1],
                    block: [256, 1, 1],
                    shared_mem_bytes: 0,
                    args: vec![
                        tensor_at(c.handle(), 0),
                        tensor_at(full, 0),
                        KernelArg::U64(m),
                        KernelArg::U64(n),
                        KernelArg::U64(c_rs),
                        KernelArg::U64(c_cs),
                        KernelArg::U32(esize as u32),
                    ],
                })?;
                full
            };
            c_op = Some(operand(full, n));
            g_beta = beta;
        }
    }
    let (a_shape, b_shape) = (a.shape()?, b.shape()?);
    gemm(&Gemm {
        dtype,
        trans_a: p.trans_a,
        trans_b: p.trans_b,
        m,
        n,
        k,
        batch: 1,
        alpha: p.alpha as f32,
        beta: g_beta,
        a: operand(a.handle(), a_shape[1] as u64),
        b: operand(b.handle(), b_shape[1] as u64),
        c: c_op,
        d: operand(y.handle(), n),
        bias,
        epilogue: Epilogue::None,
    })?;
    Ok(true)
}

fn gemm_dispatch(call: &Call) -> Result<()> {
    let dtype = operand_dtype(call, &[0, 1, 2])?;
    let p = gemm_plan(call)?;
    let (m, k, n) = (p.m as u64, p.k as u64, p.n as u64);
    if m * n == 0 || gemm_gemm(call, dtype, &p, false)? {
        return Ok(());
    }
    let (a, b, y) = (call.input(0)?, call.input(1)?, call.output(0)?);
    let c = call.input_opt(2).filter(|_| p.beta != 0.0);
    let (_, (c_rs, c_cs)) = c_geometry(&p);
    let (alpha, beta) = (p.alpha as f32, p.beta as f32);
    // The tiled kernel: transposes as strides; integers exact unless scaled.
    let (a_rs, a_cs) = if p.trans_a { (1, m) } else { (k, 1) };
    let (b_rs, b_cs) = if p.trans_b { (1, k) } else { (n, 1) };
    let exact = alpha == 1.0 && (c.is_none() || beta == 1.0);
    let mut args = vec![
        tensor_at(a.handle(), 0),
        tensor_at(b.handle(), 0),
        tensor_at(c.map_or(a.handle(), |c| c.handle()), 0),
        tensor_at(y.handle(), 0),
        KernelArg::U64(m),
        KernelArg::U64(n),
        KernelArg::U64(k),
        KernelArg::U64(a_rs),
        KernelArg::U64(a_cs),
        KernelArg::U64(b_rs),
        KernelArg::U64(b_cs),
        KernelArg::U64(c_rs),
        KernelArg::U64(c_cs),
        KernelArg::U32(c.is_some() as u32),
        KernelArg::F32(alpha),
        KernelArg::F32(beta),
        KernelArg::U32(!exact as u32),
        KernelArg::U64(1),
        KernelArg::U32(0),
    ];
    args.extend((0..6).map(|_| KernelArg::U64(1)));
    args.extend((0..12).map(|_| KernelArg::U64(0)));
    launch_tiled("Gemm", dtype, m, n, 1, args)
}

impl Shim for MatMulPkg {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        if call.domain() == "ai.kiln" {
            return linear::infer(call);
        }
        match call.op_type() {
            "MatMul" => {
                let dtype = operand_dtype(call, &[0, 1])?;
                let p = matmul_plan(&call.input(0)?.shape()?, &call.input(1)?.shape()?)?;
                Ok(vec![TensorType::new(dtype, p.out_shape)])
            }
            "Gemm" => {
                let dtype = operand_dtype(call, &[0, 1, 2])?;
                let p = gemm_plan(call)?;
                Ok(vec![TensorType::new(dtype, vec![p.m, p.n])])
            }
            "Einsum" => einsum::infer(call),
            "DFT" => dft::infer(call),
            "Det" => det::infer(call),
            "STFT" => stft::infer(call),
            other => unsupported!("kiln-matmul does not implement {other}"),
        }
    }

    fn cpu(call: &Call) -> Result<()> {
        if call.domain() == "ai.kiln" {
            return linear::cpu(call);
        }
        match call.op_type() {
            "MatMul" => {
                let dtype = operand_dtype(call, &[0, 1])?;
                let (a, b) = (call.input(0)?, call.input(1)?);
                let p = matmul_plan(&a.shape()?, &b.shape()?)?;
                let y = call.output(0)?;
                if y.numel()? > 0 && matmul_gemms(call, dtype, &p)? {
                    return Ok(());
                }
                if dtype.is_float() {
                    y.write_vec(&matmul_run(&p, &a.read_vec::<f64>()?, &b.read_vec::<f64>()?))
                } else {
                    y.write_vec(&matmul_run(&p, &a.read_vec::<i64>()?, &b.read_vec::<i64>()?))
                }
            }
            "Gemm" => gemm_cpu(call, operand_dtype(call, &[0, 1, 2])?),
            "Einsum" => einsum::cpu(call),
            "DFT" => dft::cpu(call),
            "Det" => det::cpu(call),
            "STFT" => stft::cpu(call),
            other => unsupported!("kiln-matmul does not implement {other}"),
        }
    }

    fn dispatch(call: &Call) -> Result<()> {
        if call.domain() == "ai.kiln" {
            return linear::dispatch(call);
        }
        match call.op_type() {
            "MatMul" => matmul_dispatch(call),
            "Gemm" => gemm_dispatch(call),
            "Einsum" => einsum::dispatch(call),
            "DFT" => dft::dispatch(call),
            "Det" => det::dispatch(call),
            "STFT" => stft::dispatch(call),
            other => unsupported!("kiln-matmul does not implement {other}"),
        }
    }
}

export_shim!(MatMulPkg);
