//! The `gemm` import in `kiln_cpu` calls (ABI.md §4.7, manifest schema 8): computed at once on
//! the call's host tensors with the `gemm` crate (multithreaded, its AVX2 / AVX-512 kernels
//! chosen at run time), so that a shim's matrix products never copy their operands into its
//! memory. float16 and bfloat16 operands are widened to float32 and the result rounded once:
//! the products accumulate in f32, as cuBLASLt's do on the GPU.
//!
//! Threads: the CPU pool's ([`super::cpu_pool`]).

use std::borrow::Cow;

use kiln_kernel_abi::wire::{Epilogue, Gemm, Operand};
use kiln_kernel_abi::DType;

use super::cpu_pool::{cpu_threads, pool};
use super::handles::{Access, Slot};

/// Products smaller than this many multiply-adds run on the calling thread.
const PARALLEL_MIN_FLOPS: u64 = 1 << 18;

/// `dst = keep·dst + scale·lhs·rhs` (`dst` m × n with row stride `dst.1`, read only when
/// `dst.2`; operands as (pointer, row stride, column stride) in elements) on the CPU pool when the
/// product is large enough to share.
///
/// # Safety
/// Every element the strides reach over m × k (lhs), k × n (rhs) and m × n (dst) must be inside
/// its allocation, and dst must not overlap the operands.
pub(super) unsafe fn sgemm(
    (m, n, k): (usize, usize, usize),
    dst: (*mut f32, isize, bool),
    lhs: (*const f32, isize, isize),
    rhs: (*const f32, isize, isize),
    (keep, scale): (f32, f32),
) {
    let threads = cpu_threads();
    let parallel = (m as u64).saturating_mul(n as u64).saturating_mul(k as u64) >= PARALLEL_MIN_FLOPS && threads > 1;
    // Addresses cross to the pool's thread as integers (the caller keeps them valid).
    let (d, l, r) = (dst.0 as usize, lhs.0 as usize, rhs.0 as usize);
    let product = move || unsafe {
        gemm::gemm(
            m,
            n,
            k,
            d as *mut f32,
            1,
            dst.1,
            dst.2,
            l as *const f32,
            lhs.2,
            lhs.1,
            r as *const f32,
            rhs.2,
            rhs.1,
            keep,
            scale,
            false,
            false,
            false,
            if parallel { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None },
        )
    };
    match pool().filter(|_| parallel) {
        Some(p) => p.install(product),
        None => product(),
    }
}

/// Computes `g` into its D tensor. `g`'s handles are slot indices, its operands' extents
/// checked (`check_gemm`). Errors: an operand without host bytes, or an offset that is not a
/// whole number of elements.
pub(super) fn run(slots: &mut [Slot], g: &Gemm) -> Result<(), String> {
    let size = g.dtype.size().unwrap_or(4) as u64;
    let d_slot = g.d.handle as usize;
    // An operand that is D's own tensor reads D as it was before this product.
    let reads_d =
        [Some(&g.a), Some(&g.b), g.c.as_ref(), g.bias.as_ref()].iter().flatten().any(|o| o.handle as usize == d_slot);
    with_output(slots, d_slot, "gemm D", |slots, d| {
        let d_before = reads_d.then(|| d.clone());
        compute(slots, d_before.as_deref(), g, size, d)
    })
}

/// Runs `f` with output slot `slot`'s bytes taken out of the table (the other slots stay
/// readable) and puts them back whatever `f` returns. Errors: a slot without writable host
/// bytes, naming `what`.
pub(super) fn with_output(
    slots: &mut [Slot],
    slot: usize,
    what: &str,
    f: impl FnOnce(&[Slot], &mut Vec<u8>) -> Result<(), String>,
) -> Result<(), String> {
    let mut bytes = match slots.get_mut(slot).map(|s| &mut s.access) {
        Some(Access::Write(v)) => std::mem::take(v),
        _ => return Err(format!("{what}: the tensor has no writable host bytes")),
    };
    let result = f(slots, &mut bytes);
    if let Some(Access::Write(v)) = slots.get_mut(slot).map(|s| &mut s.access) {
        *v = bytes;
    }
    result
}

/// `len` bytes of operand slot `handle` from byte `offset` (an input's, or an output's or
/// scratch's written so far). Errors name `what`.
pub(super) fn operand_bytes<'s>(
    slots: &'s [Slot],
    handle: u32,
    offset: u64,
    len: usize,
    what: &str,
) -> Result<&'s [u8], String> {
    let raw = match slots.get(handle as usize).map(|s| &s.access) {
        Some(Access::Read(b)) => &b[..],
        Some(Access::Write(v)) => &v[..],
        _ => return Err(format!("{what}: an operand has no host bytes")),
    };
    let start = offset as usize;
    raw.get(start..start.saturating_add(len)).ok_or_else(|| format!("{what}: an operand reaches past its tensor"))
}

fn compute(slots: &[Slot], d_before: Option<&[u8]>, g: &Gemm, size: u64, d: &mut [u8]) -> Result<(), String> {
    let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
    let (ar, ac) = if g.trans_a { (g.k, g.m) } else { (g.m, g.k) };
    let (br, bc) = if g.trans_b { (g.n, g.k) } else { (g.k, g.n) };
    let bytes_of = |o: &Operand| -> Result<&[u8], String> {
        if o.handle as usize == g.d.handle as usize {
            return d_before.ok_or_else(|| "gemm: D's earlier bytes are missing".to_string());
        }
        match slots.get(o.handle as usize).map(|s| &s.access) {
            Some(Access::Read(b)) => Ok(&b[..]),
            Some(Access::Write(v)) => Ok(&v[..]),
            _ => Err("gemm: an operand has no host bytes".into()),
        }
    };
    let view = |name: &str, o: &Operand, rows: u64, cols: u64| -> Result<Matrix<'_>, String> {
        Matrix::new(name, bytes_of(o)?, o, g.dtype, size, g.batch, rows, cols)
    };
    let a = view("A", &g.a, ar, ac)?;
    let b = view("B", &g.b, br, bc)?;
    let c = match (&g.c, g.beta != 0.0) {
        (Some(o), true) => Some(view("C", o, g.m, g.n)?),
        _ => None,
    };
    let bias = match &g.bias {
        Some(o) => Some(view("bias", &Operand { ld: g.n, batch_stride: 0, ..*o }, 1, g.n)?),
        None => None,
    };
    let d_first = element_offset("D", &g.d, size)? as usize;
    let ld = g.d.ld as usize;
    // Matrix `batch` into `dst` (m rows of n at row stride `rs`): C, the product, bias, epilogue.
    let one = |dst: &mut [f32], rs: usize, batch: usize| {
        if let Some(c) = &c {
            for i in 0..m {
                for (j, t) in dst[i * rs..i * rs + n].iter_mut().enumerate() {
                    *t = c.at(batch, i, j);
                }
            }
        }
        let (lhs, lhs_rs, lhs_cs) = a.operand(batch, g.trans_a);
        let (rhs, rhs_rs, rhs_cs) = b.operand(batch, g.trans_b);
        // SAFETY: `Matrix::new` checked that every element these strides reach, over m × k and
        // k × n, lies in the operand's data; the caller gives `dst` m rows of n at stride rs; D
        // is no operand (one that shares its tensor reads the copy made before).
        unsafe {
            sgemm(
                (m, n, k),
                (dst.as_mut_ptr(), rs as isize, c.is_some()),
                (lhs.as_ptr(), lhs_rs, lhs_cs),
                (rhs.as_ptr(), rhs_rs, rhs_cs),
                (g.beta, g.alpha),
            )
        };
        for i in 0..m {
            let row = &mut dst[i * rs..i * rs + n];
            if let Some(bias) = &bias {
                for (j, t) in row.iter_mut().enumerate() {
                    *t += bias.at(0, 0, j);
                }
            }
            epilogue(g.epilogue, row);
        }
    };
    // SAFETY: every bit pattern is an f32; only an aligned middle part is used.
    match unsafe { d.align_to_mut::<f32>() } {
        // float32 D aligned for f32: computed in place (`check_gemm` bounded its rows in D).
        (&mut [], mid, &mut []) if g.dtype == DType::F32 => {
            for batch in 0..g.batch as usize {
                one(&mut mid[d_first + batch * g.d.batch_stride as usize..], ld, batch);
            }
        }
        // Otherwise each matrix through `tmp`, rounded into D.
        _ => {
            let mut tmp = vec![0f32; m * n];
            for batch in 0..g.batch as usize {
                one(&mut tmp, n, batch);
                let base = d_first + batch * g.d.batch_stride as usize;
                for (i, row) in tmp.chunks_exact(n).enumerate() {
                    let start = (base + i * ld) * size as usize;
                    store(g.dtype, row, &mut d[start..start + n * size as usize]);
                }
            }
        }
    }
    Ok(())
}

/// An operand's elements as f32: the range its batch of matrices reaches, borrowed when it is
/// float32 and aligned, widened otherwise; offsets are relative to that range.
struct Matrix<'a> {
    data: Cow<'a, [f32]>,
    ld: usize,
    batch_stride: usize,
}

impl<'a> Matrix<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        name: &str,
        bytes: &'a [u8],
        o: &Operand,
        dtype: DType,
        size: u64,
        batch: u64,
        rows: u64,
        cols: u64,
    ) -> Result<Matrix<'a>, String> {
        let first = element_offset(name, o, size)?;
        // `check_gemm` bounded this extent inside the tensor.
        let len = (batch - 1) * o.batch_stride + (rows - 1) * o.ld + cols;
        let range = (first * size) as usize..((first + len) * size) as usize;
        let raw = bytes.get(range).ok_or_else(|| format!("gemm {name}: the operand reaches past its tensor"))?;
        let data = f32_view(raw, dtype).map_err(|e| format!("gemm: {e}"))?;
        Ok(Matrix { data, ld: o.ld as usize, batch_stride: o.batch_stride as usize })
    }

    /// The element at row `i`, column `j` of matrix `batch`, as stored.
    fn at(&self, batch: usize, i: usize, j: usize) -> f32 {
        self.data[batch * self.batch_stride + i * self.ld + j]
    }

    /// Matrix `batch` for the `gemm` crate: its first element, and op(X)'s row and column
    /// strides (transposed: the stored columns are op(X)'s rows).
    fn operand(&self, batch: usize, transposed: bool) -> (&[f32], isize, isize) {
        let m = &self.data[batch * self.batch_stride..];
        if transposed {
            (m, 1, self.ld as isize)
        } else {
            (m, self.ld as isize, 1)
        }
    }
}

/// `raw` (float32, float16 or bfloat16 elements) as f32: borrowed when float32 and aligned,
/// widened otherwise.
pub(super) fn f32_view(raw: &[u8], dtype: DType) -> Result<Cow<'_, [f32]>, String> {
    Ok(match dtype {
        // SAFETY: every bit pattern is an f32; only an aligned middle part is borrowed.
        DType::F32 => match unsafe { raw.align_to::<f32>() } {
            (&[], mid, &[]) => Cow::Borrowed(mid),
            _ => Cow::Owned(raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
        },
        DType::F16 => {
            Cow::Owned(raw.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect())
        }
        DType::BF16 => {
            Cow::Owned(raw.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect())
        }
        other => return Err(format!("dtype {other} is not supported (float32, float16, bfloat16)")),
    })
}

/// An operand's byte offset in elements. Errors: an offset inside an element.
fn element_offset(name: &str, o: &Operand, size: u64) -> Result<u64, String> {
    if !o.offset.is_multiple_of(size) {
        return Err(format!("gemm {name}: byte offset {} is not a multiple of the element size {size}", o.offset));
    }
    Ok(o.offset / size)
}

/// Applies the epilogue to a row of results.
pub(super) fn epilogue(e: Epilogue, row: &mut [f32]) {
    match e {
        Epilogue::None => {}
        Epilogue::Relu => row.iter_mut().for_each(|v| *v = v.max(0.0)),
        Epilogue::Gelu => {
            // The tanh approximation, as cuBLASLt's GELU epilogue computes it.
            const C: f32 = 0.797_884_6; // sqrt(2 / pi)
            row.iter_mut().for_each(|v| *v = 0.5 * *v * (1.0 + (C * (*v + 0.044_715 * *v * *v * *v)).tanh()));
        }
    }
}

/// Writes f32 results as `dtype` (rounded to nearest even for the half types).
pub(super) fn store(dtype: DType, row: &[f32], out: &mut [u8]) {
    match dtype {
        DType::F16 => row
            .iter()
            .zip(out.chunks_exact_mut(2))
            .for_each(|(v, o)| o.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes())),
        DType::BF16 => row
            .iter()
            .zip(out.chunks_exact_mut(2))
            .for_each(|(v, o)| o.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes())),
        _ => row.iter().zip(out.chunks_exact_mut(4)).for_each(|(v, o)| o.copy_from_slice(&v.to_le_bytes())),
    }
}
