//! The `gemm` import in `kiln_cpu` calls (ABI.md §4.7, manifest schema 8): computed at once on
//! the call's host tensors with the `gemm` crate (its AVX2 / AVX-512 kernels chosen at run
//! time; a product cut into tiles shared over the CPU threads, [`sgemm`]), so that a shim's
//! matrix products never copy their operands into its memory. float16 and bfloat16 operands
//! are widened to float32 and the result rounded once: the products accumulate in f32, as
//! cuBLASLt's do on the GPU.
//!
//! Threads: the CPU pool's ([`super::cpu_pool`]).

use std::borrow::Cow;

use kiln_kernel_abi::wire::{Epilogue, Gemm, Operand};
use kiln_kernel_abi::DType;

use super::cpu_pool::{cpu_threads, on_pool, pool};
use super::handles::{readable, Access, Slot};

/// Multiply-adds a tile of a shared product aims for: a product smaller than two of them (or
/// whose longer side is under 2·[`TILE_EDGE`]) runs whole on the calling thread, about where the
/// `gemm` crate's own threading began (48·48·256).
const TILE_MACS: u64 = 1 << 18;
/// Most tiles one product is cut into.
const MAX_TILES: u64 = 64;
/// Fewest rows or columns of a cut (each but the last a multiple of 16).
const TILE_EDGE: usize = 32;

/// The tiles of an m × n × k product: (rows, columns) of each, the last one smaller. About
/// `m·n·k / TILE_MACS` tiles are wanted (at most [`MAX_TILES`]), each but the last at least
/// [`TILE_EDGE`] wide. The longer side is cut first, so that every tile packs its own part of
/// the operand along that side and the whole short-side operand: the long side's operand is
/// packed once in all, as one call packs it (cutting both sides into 64 tiles of a 1024³ product
/// took 1.75× the time of the whole one on one thread, cuts of one side 0.95–1.04×). Only when
/// the long side gives under half the wanted tiles is the short side cut too, into as many
/// parts as make up the rest (each tile then packs its part of the short-side operand):
/// ResNet-50's 256 × 196 products had 8 tiles, half of 16 threads idle. The tiles depend on the
/// shape alone, not on the thread count.
fn tiles(m: usize, n: usize, k: usize) -> (usize, usize) {
    let macs = (m as u64).saturating_mul(n as u64).saturating_mul(k as u64);
    let (long, short) = (m.max(n), m.min(n));
    let want = (macs / TILE_MACS).min(MAX_TILES) as usize;
    // `side` in about `parts` cuts: their width, a multiple of TILE_EDGE / 2.
    let cut = |side: usize, parts: usize| side.div_ceil(parts.max(1)).next_multiple_of(TILE_EDGE / 2).min(side).max(1);
    let long_edge = cut(long, want.min(long / TILE_EDGE));
    let long_parts = long.div_ceil(long_edge).max(1);
    // Under half the wanted tiles along the long side: cut the short side into the rest.
    let short_parts = if 2 * long_parts < want { (want / long_parts).min(short / TILE_EDGE) } else { 1 };
    let short_edge = cut(short, short_parts);
    if n >= m {
        (short_edge, long_edge)
    } else {
        (long_edge, short_edge)
    }
}

/// What each row of a tile of [`sgemm`] gets right after the tile's product, while it is in
/// cache (bias, residual, activation): `finish(i, j0, row)` with `row` the tile's columns
/// `j0..j0 + row.len()` of dst's row `i`.
pub(super) type Finish<'a> = Option<&'a FinishRows<'a>>;
/// The function of a [`Finish`].
pub(super) type FinishRows<'a> = dyn Fn(usize, usize, &mut [f32]) + Sync + 'a;

/// `dst = keep·dst + scale·lhs·rhs` (`dst` m × n with row stride `dst.1`, read only when
/// `dst.2`; operands as (pointer, row stride, column stride) in elements), in the tiles of
/// [`tiles`], shared out over the CPU pool; each tile is one single-threaded `gemm` call, then
/// `finish` over its rows.
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
    finish: Finish,
) {
    if m == 0 || n == 0 {
        return;
    }
    let (tm, tn) = tiles(m, n, k);
    let (rows, cols) = (m.div_ceil(tm), n.div_ceil(tn));
    // Addresses cross to the pool's threads as integers (the caller keeps them valid).
    let (d, l, r) = (dst.0 as usize, lhs.0 as usize, rhs.0 as usize);
    let tile = move |t: usize| {
        let (i0, j0) = ((t / cols) * tm, (t % cols) * tn);
        let (mh, nh) = (tm.min(m - i0), tn.min(n - j0));
        // SAFETY: tile t covers rows i0.. and columns j0.. of dst inside m × n, disjoint from
        // every other tile's; the operands' rows i0.. (lhs) and columns j0.. (rhs) lie inside
        // what the caller vouched for.
        unsafe {
            gemm::gemm(
                mh,
                nh,
                k,
                (d as *mut f32).offset(i0 as isize * dst.1 + j0 as isize),
                1,
                dst.1,
                dst.2,
                (l as *const f32).offset(i0 as isize * lhs.1),
                lhs.2,
                lhs.1,
                (r as *const f32).offset(j0 as isize * rhs.2),
                rhs.2,
                rhs.1,
                keep,
                scale,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
            if let Some(f) = finish {
                for i in i0..i0 + mh {
                    f(
                        i,
                        j0,
                        std::slice::from_raw_parts_mut((d as *mut f32).offset(i as isize * dst.1 + j0 as isize), nh),
                    );
                }
            }
        }
    };
    let count = rows * cols;
    // On the kept-hot threads of a running session where loops are shared (`cpu_share`), else
    // as rayon's tasks.
    if count > 1 && super::cpu_share::share(count, 1, &|t0, t1| (t0..t1).for_each(tile)) {
        return;
    }
    if count > 1 && cpu_threads() > 1 && pool().is_some() {
        on_pool(|| {
            use rayon::prelude::*;
            (0..count).into_par_iter().for_each(tile)
        })
    } else {
        (0..count).for_each(tile)
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
    let no_bytes = || format!("{what}: the tensor has no writable host bytes");
    let s = slots.get_mut(slot).filter(|s| matches!(s.access, Access::Write(_))).ok_or_else(no_bytes)?;
    // Opaque while taken: an input bound in place to it (`Access::Alias`) has no bytes meanwhile.
    let Access::Write(mut bytes) = std::mem::replace(&mut s.access, Access::Opaque) else { return Err(no_bytes()) };
    let result = f(slots, &mut bytes);
    if let Some(s) = slots.get_mut(slot) {
        s.access = Access::Write(bytes);
    }
    result
}

/// `len` bytes of operand slot `handle` from byte `offset` (an input's, or an output's or
/// scratch's written so far; an input bound in place reads its output's, [`readable`]). Errors
/// name `what`.
pub(super) fn operand_bytes<'s>(
    slots: &'s [Slot],
    handle: u32,
    offset: u64,
    len: usize,
    what: &str,
) -> Result<&'s [u8], String> {
    let Some(raw) = readable(slots, handle as usize) else {
        return Err(format!("{what}: an operand has no host bytes"));
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
        readable(slots, o.handle as usize).ok_or_else(|| "gemm: an operand has no host bytes".to_string())
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
        let finish = |_: usize, j0: usize, row: &mut [f32]| {
            if let Some(bias) = &bias {
                for (j, t) in row.iter_mut().enumerate() {
                    *t += bias.at(0, 0, j0 + j);
                }
            }
            epilogue(g.epilogue, row);
        };
        let finish: Finish = (bias.is_some() || g.epilogue != Epilogue::None).then_some(&finish);
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
                finish,
            )
        };
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_cut_the_long_side_into_about_the_wanted_number() {
        // ResNet-50's convolution products at batch 1, a square MatMul, a decode-sized product.
        for (m, n, k) in [
            (64, 3136, 576),
            (128, 784, 1152),
            (256, 196, 2304),
            (512, 49, 4608),
            (2048, 49, 512),
            (1024, 1024, 1024),
            (16, 3072, 576),
        ] {
            let (tm, tn) = tiles(m, n, k);
            let count = m.div_ceil(tm) * n.div_ceil(tn);
            let want = ((m * n * k) as u64 / TILE_MACS).min(MAX_TILES) as usize;
            assert!(tm.min(tn) >= TILE_EDGE.min(m.min(n)), "{m}×{n}×{k}: tile {tm}×{tn}");
            assert!(
                count <= want && 8 * count >= 5 * want.min(m.max(n) / TILE_EDGE),
                "{m}×{n}×{k}: {count} tiles, {want} wanted"
            );
        }
        // The short side is cut only where the long one gives fewer tiles than wanted.
        assert_eq!(tiles(64, 3136, 576), (64, 64));
        assert_eq!(tiles(256, 196, 2304), (32, 48), "8 cuts of the rows, 5 of the columns: 40 tiles");
        assert_eq!(tiles(128, 784, 1152), (48, 48));
        assert_eq!(tiles(1024, 1024, 1024), (1024, 32), "32 cuts of the long side: half the 64 wanted, enough");
        assert_eq!(tiles(0, 0, 7), (1, 1));
        assert_eq!(tiles(512, 49, 4608), (32, 49));
        assert_eq!(tiles(100, 100, 40), (100, 100), "a product of under 2¹⁹ multiply-adds stays whole");
        assert_eq!(tiles(60, 60, 4096), (60, 60), "so does one whose sides are both under 64");
        assert_eq!(tiles(128, 128, 64), (128, 32));
        assert_eq!(tiles(0, 5, 7), (1, 5));
    }
}
