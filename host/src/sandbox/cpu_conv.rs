//! The `conv` import in `kiln_cpu` calls (ABI.md §4.8): Conv as im2col and a GEMM per batch
//! entry and group, ConvTranspose as a GEMM and col2im, on the call's host tensors, products
//! through the CPU GEMM of [`super::cpu_gemm`]. float16 and bfloat16 are widened to f32 and Y
//! rounded once. A 1×…×1 kernel with unit strides and no padding multiplies X itself.

use kiln_kernel_abi::wire::{Conv, Epilogue, TensorAt};
use rayon::prelude::*;

use super::cpu_gemm::{epilogue, f32_view, operand_bytes, sgemm, store, with_output, Finish, FinishRows};
use super::cpu_pool::on_pool;
use super::handles::Slot;

/// The im2col buffer a convolution aims for: larger products are computed in slices of output
/// rows (one row at the least).
const COL_BYTES: usize = 64 << 20;
/// Most bytes of a convolution's work buffers (im2col, or ConvTranspose's columns and targets):
/// past it the convolution is refused rather than allocated.
const MAX_WORK_BYTES: usize = 4 << 30;

/// A zeroed buffer of `n` elements, or an error naming `what` when it is past
/// [`MAX_WORK_BYTES`] or cannot be allocated.
fn work_buffer<T: Clone + Default>(n: usize, what: &str) -> Result<Vec<T>, String> {
    let bytes = n.saturating_mul(std::mem::size_of::<T>());
    let mut v = Vec::new();
    if bytes > MAX_WORK_BYTES || v.try_reserve_exact(n).is_err() {
        return Err(format!("conv: its {what} would take {bytes} bytes (at most {MAX_WORK_BYTES})"));
    }
    v.resize(n, T::default());
    Ok(v)
}

/// Computes `c` into its Y tensor. `c` was checked (`check_conv`): handles are slot indices,
/// every operand's extent lies inside its tensor, Y is writable and distinct from X, W, bias and Z.
pub(super) fn run(slots: &mut [Slot], c: &Conv) -> Result<(), String> {
    with_output(slots, c.y.handle as usize, "conv Y", |slots, y| compute(slots, c, y))
}

/// The geometry in `usize`, every value already checked to fit.
struct Geom {
    batch: usize,
    /// Input and output channels per group.
    cg: usize,
    mg: usize,
    groups: usize,
    input: Vec<usize>,
    output: Vec<usize>,
    kernel: Vec<usize>,
    strides: Vec<i64>,
    dilations: Vec<i64>,
    begin: Vec<i64>,
    in_n: usize,
    out_n: usize,
    taps: usize,
}

fn compute(slots: &[Slot], c: &Conv, y: &mut [u8]) -> Result<(), String> {
    let u = |v: &[u64]| v.iter().map(|&x| x as usize).collect::<Vec<_>>();
    let i = |v: &[u64]| v.iter().map(|&x| x as i64).collect::<Vec<_>>();
    let g = Geom {
        batch: c.batch as usize,
        cg: (c.in_channels / c.groups) as usize,
        mg: (c.out_channels / c.groups) as usize,
        groups: c.groups as usize,
        input: u(&c.input),
        output: u(&c.output),
        kernel: u(&c.kernel),
        strides: i(&c.strides),
        dilations: i(&c.dilations),
        begin: c.pads_begin.clone(),
        in_n: c.input.iter().product::<u64>() as usize,
        out_n: c.output.iter().product::<u64>() as usize,
        taps: c.kernel.iter().product::<u64>() as usize,
    };
    let size = c.dtype.size().unwrap_or(4);
    let bytes = |t: &TensorAt, elems: usize| operand_bytes(slots, t.handle, t.offset, elems * size, "conv");
    let (cin, mout) = (g.cg * g.groups, g.mg * g.groups);
    let x = f32_view(bytes(&c.x, g.batch * cin * g.in_n)?, c.dtype)?;
    let w_len = if c.transposed { cin * g.mg * g.taps } else { mout * g.cg * g.taps };
    let w = f32_view(bytes(&c.w, w_len)?, c.dtype)?;
    let bias = match &c.bias {
        Some(b) => Some(f32_view(bytes(b, mout)?, c.dtype)?),
        None => None,
    };
    let z = match &c.z {
        Some(t) => Some(f32_view(bytes(t, g.batch * mout * g.out_n)?, c.dtype)?),
        None => None,
    };
    let start = c.y.offset as usize;
    let total = g.batch * mout * g.out_n;
    let y = y.get_mut(start..start + total * size).ok_or("conv Y: reaches past its tensor")?;
    // float32 Y aligned for f32 is computed in place; otherwise in a buffer, then rounded into Y.
    let direct =
        c.dtype == kiln_kernel_abi::DType::F32 && matches!(unsafe { y.align_to_mut::<f32>() }, (&mut [], _, &mut []));
    let mut buffer = Vec::new();
    let out: &mut [f32] = if direct {
        // SAFETY: every bit pattern is an f32 and the slice is aligned (checked above).
        unsafe { y.align_to_mut::<f32>().1 }
    } else {
        buffer.resize(total, 0.0);
        &mut buffer
    };
    // Bias, Z and the activation on a piece of Y's output row `row` (an output channel of a
    // batch entry) from position `at`.
    let finish = |row: usize, at: usize, o: &mut [f32]| {
        if let Some(b) = &bias {
            let v = b[row % mout];
            o.iter_mut().for_each(|x| *x += v);
        }
        if let Some(z) = &z {
            o.iter_mut().zip(&z[row * g.out_n + at..]).for_each(|(x, v)| *x += v);
        }
        epilogue(c.epilogue, o);
    };
    let plain = bias.is_none() && z.is_none() && c.epilogue == Epilogue::None;
    if c.transposed {
        out.iter_mut().for_each(|v| *v = 0.0);
        transposed(&g, &x, &w, out)?;
        if !plain {
            on_pool(|| out.par_chunks_mut(g.out_n.max(1)).enumerate().for_each(|(row, o)| finish(row, 0, o)));
        }
    } else {
        // Each tile of each product finishes its rows while they are in cache.
        forward(&g, &x, &w, out, (!plain).then_some(&finish))?;
    }
    if !direct {
        store(c.dtype, &buffer, y);
    }
    Ok(())
}

/// Whether the kernel reads X as it is: every tap 1, stride 1, no padding.
fn pointwise(g: &Geom) -> bool {
    g.kernel.iter().all(|&k| k == 1)
        && g.strides.iter().all(|&s| s == 1)
        && g.begin.iter().all(|&b| b == 0)
        && g.input == g.output
}

/// Conv: per batch entry and group, Y_g [mg × out] = W_g [mg × cg·taps] · col [cg·taps × out],
/// then `finish(row, at, piece)` on each piece of Y's rows (row: batch entry · channels +
/// channel; at: its first output position) as its tile is computed.
fn forward(g: &Geom, x: &[f32], w: &[f32], y: &mut [f32], finish: Finish) -> Result<(), String> {
    let k = g.cg * g.taps;
    let last = *g.output.last().unwrap_or(&1);
    // Output rows (positions of every axis but the last) per slice.
    let rows_total = g.out_n / last.max(1);
    let rows_per_slice = (COL_BYTES / 4 / k.saturating_mul(last).max(1)).clamp(1, rows_total.max(1));
    // The buffer is taken out of the thread's cell for the product (a parallel product may run
    // another convolution on this thread while it waits) and put back after it.
    let mut col = COL.with(|c| std::mem::take(&mut *c.borrow_mut()));
    let result = (|| {
        if !pointwise(g) {
            let need = k.saturating_mul(rows_per_slice).saturating_mul(last);
            let more = need.saturating_sub(col.len());
            if need.saturating_mul(4) > MAX_WORK_BYTES || col.try_reserve(more).is_err() {
                return Err(format!(
                    "conv: its im2col buffer would take {} bytes (at most {MAX_WORK_BYTES})",
                    need.saturating_mul(4)
                ));
            }
        }
        forward_with(g, x, w, y, k, last, rows_total, rows_per_slice, &mut col, finish);
        Ok(())
    })();
    // A rare huge buffer is not kept for the thread's later convolutions.
    if col.capacity() > 2 * COL_BYTES / 4 {
        col.clear();
        col.shrink_to(COL_BYTES / 4);
    }
    COL.with(|c| *c.borrow_mut() = col);
    result
}

thread_local! {
    /// The im2col buffer, kept between convolutions of a thread (a fresh one faults its pages in
    /// every time).
    static COL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[allow(clippy::too_many_arguments)]
fn forward_with(
    g: &Geom,
    x: &[f32],
    w: &[f32],
    y: &mut [f32],
    k: usize,
    last: usize,
    rows_total: usize,
    rows_per_slice: usize,
    col: &mut Vec<f32>,
    finish: Finish,
) {
    for n in 0..g.batch {
        for grp in 0..g.groups {
            let xg = &x[(n * g.groups + grp) * g.cg * g.in_n..][..g.cg * g.in_n];
            let wg = &w[grp * g.mg * k..][..g.mg * k];
            let yg = &mut y[(n * g.groups + grp) * g.mg * g.out_n..][..g.mg * g.out_n];
            // `finish` of a product whose rows are Y's from this batch entry and group's first and
            // whose columns are Y's from `first`.
            let row0 = (n * g.groups + grp) * g.mg;
            let piece =
                |first: usize| finish.map(|f| move |i: usize, j0: usize, o: &mut [f32]| f(row0 + i, first + j0, o));
            if pointwise(g) {
                let finish_tile = piece(0);
                // SAFETY: W_g is mg × cg, X_g cg × out, Y_g mg × out, all row-major and disjoint.
                unsafe {
                    sgemm(
                        (g.mg, g.out_n, g.cg),
                        (yg.as_mut_ptr(), g.out_n as isize, false),
                        (wg.as_ptr(), g.cg as isize, 1),
                        (xg.as_ptr(), g.out_n as isize, 1),
                        (0.0, 1.0),
                        finish_tile.as_ref().map(|f| f as &FinishRows<'_>),
                    )
                };
                continue;
            }
            let mut r0 = 0;
            while r0 < rows_total {
                let r1 = (r0 + rows_per_slice).min(rows_total);
                let cols = (r1 - r0) * last;
                col.resize(k * cols, 0.0);
                let col = &mut col[..k * cols];
                on_pool(|| {
                    col.par_chunks_mut(cols).enumerate().for_each(|(row, dst)| {
                        let (ch, tap) = (row / g.taps, row % g.taps);
                        im2col_row(g, &xg[ch * g.in_n..][..g.in_n], tap, r0..r1, dst);
                    })
                });
                let finish_tile = piece(r0 * last);
                // SAFETY: W_g is mg × k, col k × cols, and Y_g's columns r0·last.. with row stride
                // out_n hold mg × cols; col and Y_g are distinct buffers.
                unsafe {
                    sgemm(
                        (g.mg, cols, k),
                        (yg.as_mut_ptr().add(r0 * last), g.out_n as isize, false),
                        (wg.as_ptr(), k as isize, 1),
                        (col.as_ptr(), cols as isize, 1),
                        (0.0, 1.0),
                        finish_tile.as_ref().map(|f| f as &FinishRows<'_>),
                    )
                };
                r0 = r1;
            }
        }
    }
}

/// One im2col row: input channel `xc` at tap `tap`, for output rows `rows` (positions of every
/// axis but the last, row-major) × the last axis; zero where the tap falls outside the input.
fn im2col_row(g: &Geom, xc: &[f32], tap: usize, rows: std::ops::Range<usize>, dst: &mut [f32]) {
    let rank = g.output.len();
    let last = g.output[rank - 1];
    let mut tp = [0usize; kiln_kernel_abi::wire::CONV_MAX_SPATIAL];
    unflat_into(tap, &g.kernel, &mut tp);
    let (s, in_last) = (g.strides[rank - 1], g.input[rank - 1] as i64);
    let shift = tp[rank - 1] as i64 * g.dilations[rank - 1] - g.begin[rank - 1];
    // The outputs o of the last axis whose input o·s + shift is inside: lo..hi.
    let lo = if shift >= 0 { 0 } else { ((-shift + s - 1) / s) as usize }.min(last);
    let hi = if in_last - shift <= 0 { 0 } else { ((in_last - shift + s - 1) / s) as usize }.clamp(lo, last);
    let mut pos = [0usize; kiln_kernel_abi::wire::CONV_MAX_SPATIAL];
    for (r, out_row) in rows.zip(dst.chunks_mut(last)) {
        // The input row this output row reads at this tap, if inside.
        unflat_into(r, &g.output[..rank - 1], &mut pos);
        let mut base = 0usize;
        let mut inside = true;
        for a in 0..rank - 1 {
            let q = pos[a] as i64 * g.strides[a] - g.begin[a] + tp[a] as i64 * g.dilations[a];
            inside &= q >= 0 && q < g.input[a] as i64;
            base = base * g.input[a] + q.max(0) as usize;
        }
        if !inside || lo == hi {
            out_row.fill(0.0);
            continue;
        }
        let src = &xc[base * g.input[rank - 1]..][..g.input[rank - 1]];
        out_row[..lo].fill(0.0);
        out_row[hi..].fill(0.0);
        let first = (lo as i64 * s + shift) as usize;
        if s == 1 {
            out_row[lo..hi].copy_from_slice(&src[first..first + (hi - lo)]);
        } else {
            for (o, v) in out_row[lo..hi].iter_mut().enumerate() {
                *v = src[first + o * s as usize];
            }
        }
    }
}

/// ConvTranspose: per batch entry and group, col [mg·taps × in] = W_gᵀ · X_g (W_g stored
/// [cg × mg·taps]), then each column adds to the output position its tap reaches.
fn transposed(g: &Geom, x: &[f32], w: &[f32], y: &mut [f32]) -> Result<(), String> {
    let rows = g.mg * g.taps;
    if g.taps.saturating_mul(g.in_n).saturating_mul(std::mem::size_of::<usize>()) > MAX_WORK_BYTES {
        return Err(format!("conv: ConvTranspose's {} taps × {} inputs are too many to map", g.taps, g.in_n));
    }
    // Per tap, the output position each input position adds to (`usize::MAX`: outside).
    let targets: Vec<Vec<usize>> = (0..g.taps)
        .map(|tap| {
            let tp = unflat(tap, &g.kernel);
            (0..g.in_n)
                .map(|i| {
                    let pos = unflat(i, &g.input);
                    let mut at = 0usize;
                    for a in 0..pos.len() {
                        let q = pos[a] as i64 * g.strides[a] - g.begin[a] + tp[a] as i64 * g.dilations[a];
                        if q < 0 || q >= g.output[a] as i64 {
                            return usize::MAX;
                        }
                        at = at * g.output[a] + q as usize;
                    }
                    at
                })
                .collect()
        })
        .collect();
    let mut col: Vec<f32> = work_buffer(rows.saturating_mul(g.in_n), "ConvTranspose columns")?;
    for n in 0..g.batch {
        for grp in 0..g.groups {
            let xg = &x[(n * g.groups + grp) * g.cg * g.in_n..][..g.cg * g.in_n];
            let wg = &w[grp * g.cg * rows..][..g.cg * rows];
            // SAFETY: op(W_g) is rows × cg (W_g stored cg × rows, read transposed), X_g cg × in,
            // col rows × in; col is its own buffer.
            unsafe {
                sgemm(
                    (rows, g.in_n, g.cg),
                    (col.as_mut_ptr(), g.in_n as isize, false),
                    (wg.as_ptr(), 1, rows as isize),
                    (xg.as_ptr(), g.in_n as isize, 1),
                    (0.0, 1.0),
                    None,
                )
            };
            let yg = &mut y[(n * g.groups + grp) * g.mg * g.out_n..][..g.mg * g.out_n];
            on_pool(|| {
                yg.par_chunks_mut(g.out_n.max(1)).enumerate().for_each(|(m, ym)| {
                    for (tap, to) in targets.iter().enumerate() {
                        let src = &col[(m * g.taps + tap) * g.in_n..][..g.in_n];
                        for (v, &at) in src.iter().zip(to) {
                            if at != usize::MAX {
                                ym[at] += v;
                            }
                        }
                    }
                })
            });
        }
    }
    Ok(())
}

/// The positions of a row-major index `i` over `dims`, into `pos`.
fn unflat_into(mut i: usize, dims: &[usize], pos: &mut [usize]) {
    for a in (0..dims.len()).rev() {
        pos[a] = i % dims[a].max(1);
        i /= dims[a].max(1);
    }
}

/// The positions of a row-major index `i` over `dims`.
fn unflat(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut pos = vec![0; dims.len()];
    for a in (0..dims.len()).rev() {
        pos[a] = i % dims[a].max(1);
        i /= dims[a].max(1);
    }
    pos
}
