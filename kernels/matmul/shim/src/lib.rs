//! Shim of `kiln-matmul`: MatMul-1/9/13 (numpy `matmul` semantics: a 1-D operand is promoted
//! to a matrix and the added dimension removed again, batch dimensions broadcast) and
//! Gemm-7/9/11/13 (`transA`, `transB`, `alpha`, `beta`, optional `C` broadcast
//! unidirectionally to (M, N)), following ONNX Operators.md.
//!
//! The CPU reference accumulates floating-point products in f64 and rounds once; integer
//! products accumulate in i64 with wrapping arithmetic (the same result, modulo 2^bits, as
//! wrapping in the element type).
#![no_std]
extern crate alloc;

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, export_shim, unsupported, with_dtype};

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

impl Shim for MatMulPkg {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
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
            other => unsupported!("kiln-matmul does not implement {other}"),
        }
    }

    fn cpu(call: &Call) -> Result<()> {
        match call.op_type() {
            "MatMul" => {
                let dtype = operand_dtype(call, &[0, 1])?;
                let (a, b) = (call.input(0)?, call.input(1)?);
                let p = matmul_plan(&a.shape()?, &b.shape()?)?;
                let y = call.output(0)?;
                if dtype.is_float() {
                    y.write_vec(&matmul_run(&p, &a.read_vec::<f64>()?, &b.read_vec::<f64>()?))
                } else {
                    y.write_vec(&matmul_run(&p, &a.read_vec::<i64>()?, &b.read_vec::<i64>()?))
                }
            }
            "Gemm" => gemm_cpu(call, operand_dtype(call, &[0, 1, 2])?),
            other => unsupported!("kiln-matmul does not implement {other}"),
        }
    }
}

export_shim!(MatMulPkg);
