//! The `qgemm` import in `kiln_cpu` calls (ABI.md §4.9): MatMulNBits' block-quantized product
//! on the host, on the CPU pool. At `accuracy_level` 4 a decode-size float32 product over 4-bit
//! weights quantizes A to int8 ([`super::cpu_q4i8`], [`int8_activations`]); otherwise in f32,
//! two ways by the rows of A:
//!
//! - fewer than [`GEMM_MIN_ROWS`] (decode, short prompts): each weight block is dotted with
//!   the rows of A as `scale · Σ (q − zero)·a`; 4-bit weights go through AVX2 + FMA
//!   kernels that unpack eight values per instruction ([`super::cpu_q4`]): for one row of A,
//!   four weight rows at once; for more, each weight row unpacked once for up to eight rows
//!   of A;
//! - more (prefill): the weights are dequantized to f32 a tile of rows at a time and multiplied
//!   by the `gemm` crate.

use std::borrow::Cow;
use std::ops::Range;

use kiln_kernel_abi::wire::{QGemm, QZeroPoints, TensorAt};
use kiln_kernel_abi::DType;
use rayon::prelude::*;

use super::cpu_gemm::{f32_view, operand_bytes, sgemm, store, with_output};
use super::cpu_pool::{cpu_threads, on_pool};
use super::cpu_q4;
use super::cpu_q4i8;
use super::cpu_share;
use super::handles::Slot;

/// Rows of A from which the weights are dequantized once and multiplied as a GEMM (below, the
/// `gemm` crate's packing of each tile costs more than the product).
const GEMM_MIN_ROWS: usize = 64;

/// f32 values of dequantized weights per tile of the GEMM path (1 MiB).
const TILE_VALUES: usize = 1 << 18;

/// Computes `q` into its Y tensor. `q` was checked (`check_qgemm`): handles are slot indices,
/// every operand's extent lies inside its tensor, Y is writable and none of the operands.
pub(super) fn run(slots: &mut [Slot], q: &QGemm) -> Result<(), String> {
    with_output(slots, q.y.handle as usize, "qgemm Y", |slots, y| compute(slots, q, y))
}

fn compute(slots: &[Slot], q: &QGemm, y: &mut [u8]) -> Result<(), String> {
    let (m, n, k) = (q.m as usize, q.n as usize, q.k as usize);
    let (bits, block) = (q.bits as usize, q.block as usize);
    let kb = k.div_ceil(block);
    let blob = block * bits / 8;
    let size = q.dtype.size().unwrap_or(4);
    let bytes = |t: &TensorAt, len: usize| operand_bytes(slots, t.handle, t.offset, len, "qgemm");
    let a = f32_view(bytes(&q.a, m * k * size)?, q.dtype)?;
    let zp_row = (kb * bits).div_ceil(8);
    let zero_points = match &q.zero_points {
        QZeroPoints::Default => Zeros::Default((1u32 << (bits - 1)) as f32),
        QZeroPoints::Packed(t) => Zeros::Packed(bytes(t, n * zp_row)?, zp_row),
        QZeroPoints::Float(t) => Zeros::Float(f32_view(bytes(t, n * kb * size)?, q.dtype)?),
    };
    let w = Weights {
        b: bytes(&q.b, n * kb * blob)?,
        scales: f32_view(bytes(&q.scales, n * kb * size)?, q.dtype)?,
        zeros: zero_points,
        k,
        kb,
        block,
        blob,
        bits,
    };
    // Row-major m × n results.
    let mut out = vec![0f32; m * n];
    if m >= GEMM_MIN_ROWS {
        dequantized_product(&a, &w, m, n, &mut out);
    } else if int8_activations(q, &w) {
        int8_product(&a, &w, m, n, &mut out);
    } else {
        direct_product(&a, &w, m, n, &mut out);
    }
    if let Some(t) = &q.bias {
        let bias = f32_view(bytes(t, n * size)?, q.dtype)?;
        for row in out.chunks_exact_mut(n) {
            row.iter_mut().zip(bias.iter()).for_each(|(v, b)| *v += b);
        }
    }
    for (i, row) in out.chunks_exact(n).enumerate() {
        store(q.dtype, row, &mut y[i * n * size..(i + 1) * n * size]);
    }
    Ok(())
}

/// The quantized weights: n rows of kb blocks of `block` values, `bits` each (packed from the
/// low bits of each byte), a scale and a zero point per block.
struct Weights<'a> {
    b: &'a [u8],
    scales: Cow<'a, [f32]>,
    zeros: Zeros<'a>,
    k: usize,
    kb: usize,
    block: usize,
    blob: usize,
    bits: usize,
}

/// Where the zero points come from.
enum Zeros<'a> {
    /// 2^(bits − 1) everywhere.
    Default(f32),
    /// `bits`-bit values packed per weight row, `.1` bytes a row.
    Packed(&'a [u8], usize),
    /// One float per block.
    Float(Cow<'a, [f32]>),
}

impl Weights<'_> {
    /// Weight row `r`'s packed blocks.
    fn row(&self, r: usize) -> &[u8] {
        &self.b[r * self.kb * self.blob..(r + 1) * self.kb * self.blob]
    }

    /// Weight row `r`'s scales.
    fn scales(&self, r: usize) -> &[f32] {
        &self.scales[r * self.kb..(r + 1) * self.kb]
    }

    /// The zero point of every block where they are all one (the default 2^(bits − 1)).
    fn default_zero(&self) -> Option<f32> {
        match self.zeros {
            Zeros::Default(d) => Some(d),
            _ => None,
        }
    }

    /// Bytes of one weight row: its packed values and its f32 scales.
    fn row_bytes(&self) -> usize {
        self.kb * (self.blob + 4)
    }

    /// Weight rows `first..first + rows`' zero points into `z` (grown to rows · kb values; the
    /// default ones are written only where `z` grows).
    fn range_zeros(&self, first: usize, rows: usize, z: &mut Vec<f32>) {
        let len = rows * self.kb;
        match self.default_zero() {
            Some(d) => z.resize(len.max(z.len()), d),
            None => {
                z.resize(len.max(z.len()), 0.0);
                for (t, zt) in z[..len].chunks_exact_mut(self.kb).enumerate() {
                    self.zeros(first + t, zt);
                }
            }
        }
    }

    /// Weight row `r`'s zero points into `z` (kb values).
    fn zeros(&self, r: usize, z: &mut [f32]) {
        match &self.zeros {
            Zeros::Default(d) => z.fill(*d),
            Zeros::Packed(p, row) => unpack(&p[r * row..(r + 1) * row], self.bits, z),
            Zeros::Float(f) => z.copy_from_slice(&f[r * self.kb..(r + 1) * self.kb]),
        }
    }

    /// Weight row `r` dequantized, `scale · (q − zero)`, into `out` (kb · block values; those
    /// past k are the padding of a partial last block). `z` is scratch for kb zero points.
    fn dequantize(&self, r: usize, z: &mut [f32], out: &mut [f32]) {
        self.zeros(r, z);
        let (row, scales) = (self.row(r), self.scales(r));
        if self.bits == 4 && cpu_q4::dequantize(row, scales, z, self.block, out) {
            return;
        }
        for (j, vals) in out.chunks_exact_mut(self.block).enumerate() {
            unpack(&row[j * self.blob..(j + 1) * self.blob], self.bits, vals);
            let (s, zj) = (scales[j], z[j]);
            vals.iter_mut().for_each(|v| *v = s * (*v - zj));
        }
    }
}

/// Y = A · dequant(B)ᵀ for a few rows of A: each weight row read once per row of A.
fn direct_product(a: &[f32], w: &Weights, m: usize, n: usize, out: &mut [f32]) {
    let padded = w.kb * w.block;
    // A's rows padded with zeros to whole blocks.
    let mut x = vec![0f32; m * padded];
    for (i, row) in x.chunks_exact_mut(padded).enumerate() {
        row[..w.k].copy_from_slice(&a[i * w.k..(i + 1) * w.k]);
    }
    let scratch = || (Vec::new(), vec![0f32; w.block]);
    // Group g: weight rows 4g.. (fewer in the last), whose results are `chunk`.
    let group = |(z, scratch): &mut (Vec<f32>, Vec<f32>), g: usize, chunk: &mut [f32]| {
        let first = 4 * g;
        let rows = chunk.len() / m;
        w.range_zeros(first, rows, z);
        let x_row = |i: usize| &x[i * padded..(i + 1) * padded];
        // One row of A: four weight rows at once.
        let mut dots = [0f32; 4];
        if m == 1 && w.bits == 4 && rows == 4 && q4_dots(w, first, x_row(0), z, &mut dots) {
            chunk.copy_from_slice(&dots);
            return;
        }
        for i0 in (0..m).step_by(cpu_q4::MAX_ROWS) {
            let i1 = (i0 + cpu_q4::MAX_ROWS).min(m);
            let xs: Vec<&[f32]> = (i0..i1).map(x_row).collect();
            for t in 0..rows {
                let (r, zt) = (first + t, &z[t * w.kb..(t + 1) * w.kb]);
                let out = &mut chunk[t * m..(t + 1) * m];
                let a_rows = cpu_q4::Rows { xs: &xs, row: w.row(r), scales: w.scales(r), zeros: zt };
                let done = w.bits == 4 && cpu_q4::dots_rows(&a_rows, w.block, &mut out[i0..i1]);
                if !done {
                    for i in i0..i1 {
                        out[i] = row_dot(w, r, xs[i - i0], zt, scratch);
                    }
                }
            }
        }
    };
    over_groups(out, (m, n, w.row_bytes()), scratch, |s, groups, results| {
        for (g, part) in groups.zip(results.chunks_mut(4 * m)) {
            group(s, g, part);
        }
    });
}

/// Runs `run(scratch, groups, results)` over the groups of four weight rows (fewer in the
/// last) on the CPU pool, a range of groups at a time, `results` being the range's part of a
/// column-major n × m result (weight row r's m results at r · m), then writes the results
/// row-major into `out` (m × n; for one row of A the two are one layout, written in place): on
/// the kept-hot threads in chunks (about four a thread, at least two groups), else as rayon's
/// tasks of eight groups; either at least [`task_bytes`] of weights (`row_bytes` a row), so a
/// product of at most that many runs here as one task. The task size counts weight bytes only:
/// m rows of A make each task m times the work (measured for one row of A; for more, not).
/// `scratch` makes each chunk's or thread's scratch.
fn over_groups<S>(
    out: &mut [f32],
    (m, n, row_bytes): (usize, usize, usize),
    scratch: impl Fn() -> S + Sync + Send,
    run: impl Fn(&mut S, Range<usize>, &mut [f32]) + Sync + Send,
) {
    let groups = n.div_ceil(4);
    // Groups a task covers at least: `task_bytes` of weights.
    let least = task_bytes().div_ceil(4 * row_bytes.max(1)).clamp(1, groups.max(1));
    let chunk = groups.div_ceil(4 * cpu_threads()).max(2).max(least);
    let task = least.max(8);
    let mut transposed = Vec::new();
    let cols: &mut [f32] = if m == 1 {
        out
    } else {
        transposed.resize(n * m, 0f32);
        &mut transposed
    };
    if groups <= least {
        // One task's weights or fewer: here, without the pool (no parallel section opens).
        run(&mut scratch(), 0..groups, cols);
    } else {
        over_pool(cols, (m, n, groups), (chunk, task), &scratch, &run);
    }
    if m > 1 {
        for (i, row) in out.chunks_exact_mut(n).enumerate() {
            row.iter_mut().enumerate().for_each(|(r, v)| *v = transposed[r * m + i]);
        }
    }
}

/// [`over_groups`]' parallel part: `groups` groups of `cols` (column-major, n · m) in chunks of
/// `chunk` groups on the kept-hot threads (`cpu_share`), else as rayon's tasks of `task` groups.
fn over_pool<S>(
    cols: &mut [f32],
    (m, n, groups): (usize, usize, usize),
    (chunk, task): (usize, usize),
    scratch: &(impl Fn() -> S + Sync + Send),
    run: &(impl Fn(&mut S, Range<usize>, &mut [f32]) + Sync + Send),
) {
    let base = cols.as_mut_ptr() as usize;
    let shared = cpu_share::share(groups, chunk, &|g0, g1| {
        let (lo, hi) = (4 * g0 * m, (4 * g1).min(n) * m);
        // SAFETY: chunks are disjoint ranges of `cols` (n · m values), each run once, and
        // `cols` outlives the loop (`share` returns after every chunk).
        let results = unsafe { std::slice::from_raw_parts_mut((base as *mut f32).add(lo), hi - lo) };
        run(&mut scratch(), g0..g1, results);
    });
    if !shared {
        on_pool(|| {
            cols.par_chunks_mut(4 * m * task).enumerate().for_each_init(scratch, |s, (t, results)| {
                let g0 = t * task;
                run(s, g0..g0 + results.len().div_ceil(4 * m), results)
            })
        });
    }
}

/// The least bytes of weights (packed values and scales) one task of a decode product covers by
/// default: a 576 × 576 4-bit product (about 200 KiB with its scales) then takes at most 7 tasks.
/// With tasks of eight groups (18 for that product) a 16-core H100 host ran 60 such products in
/// 1.89–2.04 ms at 16 threads and 1.85–1.98 at 4, against 1.38–1.48 on one thread (two machines
/// of the kind); at 32 KiB 1.80–1.87 and 1.51, and the SmolLM2-135M int4 decode step at 16
/// threads took 6.67–6.93 ms against 7.00–8.80 (bench/RESULTS.md, session 42). Larger tasks
/// (128 KiB, 1 MiB) were slower again.
const TASK_BYTES: usize = 32 << 10;

/// The least bytes of weights one task of a decode product covers: `KILN_CPU_TASK_KB` KiB when
/// set (0: tasks of at least eight groups of four rows, the split before [`TASK_BYTES`]; an A/B
/// of how many threads a small product is worth), else [`TASK_BYTES`] (another value is
/// reported once, as a warning, and ignored).
fn task_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| match std::env::var("KILN_CPU_TASK_KB") {
        Err(_) => TASK_BYTES,
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(kib) => kib.saturating_mul(1024),
            Err(_) => {
                tracing::warn!("KILN_CPU_TASK_KB={v:?} is not a number of KiB; using {}", TASK_BYTES >> 10);
                TASK_BYTES
            }
        },
    })
}

/// Whether `q` takes the int8-activation product ([`cpu_q4i8`]): MatMulNBits' accuracy_level
/// 4 with float32 A over 4-bit weights in blocks of a power of two ≥ 32 values with whole-number
/// zero points (the default or packed ones; float zero points keep f32), for fewer than
/// [`GEMM_MIN_ROWS`] rows of A. Level 4 allows int8 (ABI.md §6.6) and onnxruntime's CPU provider
/// takes it there (over constant weights: tests/contrib-node-tests-int8); the many rows of a
/// prefill keep the f32 GEMM, which the level allows as well.
fn int8_activations(q: &QGemm, w: &Weights) -> bool {
    q.accuracy_level == 4
        && q.dtype == DType::F32
        && w.bits == 4
        && w.block.is_multiple_of(cpu_q4i8::CHUNK)
        && w.block.is_power_of_two()
        && !matches!(w.zeros, Zeros::Float(_))
}

/// Y = A · dequant(B)ᵀ for a few rows of A quantized to int8 per block ([`cpu_q4i8`]): each
/// task's weight rows 16 at a time, against up to four rows of A at once.
fn int8_product(a: &[f32], w: &Weights, m: usize, n: usize, out: &mut [f32]) {
    let qa = cpu_q4i8::QuantizedA::new(a, m, w.k, w.block);
    // Each call of the kernel covers at most this many weight rows, which it reads once per row
    // of A: they stay in cache between the rows of A.
    const CALL_ROWS: usize = 16;
    let run = |(z, part): &mut (Vec<f32>, Vec<f32>), groups: Range<usize>, results: &mut [f32]| {
        for (c, results) in results.chunks_mut(CALL_ROWS * m).enumerate() {
            let (first, rows) = (4 * groups.start + c * CALL_ROWS, results.len() / m);
            w.range_zeros(first, rows, z);
            let weights = cpu_q4i8::WeightRows {
                bytes: &w.b[first * w.kb * w.blob..(first + rows) * w.kb * w.blob],
                scales: &w.scales[first * w.kb..(first + rows) * w.kb],
                zeros: &z[..rows * w.kb],
                rows,
                zero: w.default_zero(),
            };
            if m <= 4 {
                // Every row of A at once: the kernel writes results r · m + i itself.
                cpu_q4i8::dots(&qa, 0..m, &weights, results);
                continue;
            }
            // Rows of A four at a time: results r · m + i of the rows.
            part.resize(rows * 4, 0.0);
            for i0 in (0..m).step_by(4) {
                let i1 = (i0 + 4).min(m);
                let take = i1 - i0;
                cpu_q4i8::dots(&qa, i0..i1, &weights, &mut part[..rows * take]);
                for t in 0..rows {
                    results[t * m + i0..t * m + i1].copy_from_slice(&part[t * take..(t + 1) * take]);
                }
            }
        }
    };
    over_groups(out, (m, n, w.row_bytes()), || (Vec::new(), Vec::new()), run);
}

/// [`row_dot`] for four 4-bit weight rows from `first`, whose zero points are `z`'s four runs
/// of kb (false: no AVX2 here).
fn q4_dots(w: &Weights, first: usize, x: &[f32], z: &[f32], dots: &mut [f32; 4]) -> bool {
    // Literal arrays, not array maps: those stayed calls in this per-four-rows path.
    let zr = |t: usize| &z[t * w.kb..(t + 1) * w.kb];
    let f = cpu_q4::Four {
        x,
        rows: [w.row(first), w.row(first + 1), w.row(first + 2), w.row(first + 3)],
        scales: [w.scales(first), w.scales(first + 1), w.scales(first + 2), w.scales(first + 3)],
        zeros: [zr(0), zr(1), zr(2), zr(3)],
    };
    cpu_q4::dots4(&f, w.block, dots)
}

/// `Σ_j scale_j · Σ (q − zero_j)·x` for weight row `r` (`x` padded to whole blocks, `z` the
/// row's zero points), one block at a time through `scratch`.
fn row_dot(w: &Weights, r: usize, x: &[f32], z: &[f32], scratch: &mut [f32]) -> f32 {
    let (row, scales) = (w.row(r), w.scales(r));
    let mut acc = 0f32;
    for (j, xb) in x.chunks_exact(w.block).enumerate() {
        unpack(&row[j * w.blob..(j + 1) * w.blob], w.bits, scratch);
        scratch.iter_mut().for_each(|v| *v -= z[j]);
        acc += scales[j] * dot(xb, scratch);
    }
    acc
}

/// Y = A · dequant(B)ᵀ for many rows of A: a tile of weight rows dequantized at a time (on the
/// pool), then multiplied by the `gemm` crate into Y's columns.
fn dequantized_product(a: &[f32], w: &Weights, m: usize, n: usize, out: &mut [f32]) {
    let padded = w.kb * w.block;
    let tile_rows = (TILE_VALUES / padded).max(16).min(n);
    let mut tile = vec![0f32; tile_rows * padded];
    for first in (0..n).step_by(tile_rows) {
        let rows = tile_rows.min(n - first);
        on_pool(|| {
            tile[..rows * padded]
                .par_chunks_mut(padded)
                .with_min_len(4)
                .enumerate()
                .for_each_init(|| vec![0f32; w.kb], |z, (t, vals)| w.dequantize(first + t, z, vals))
        });
        // SAFETY: lhs is A (m × k, row stride k); rhs is the tile transposed (k × rows: element
        // (kk, c) at c · padded + kk, kk < k ≤ padded); dst is Y's columns first..first + rows of
        // m rows at stride n, inside `out` (m · n) and apart from both operands.
        unsafe {
            sgemm(
                (m, rows, w.k),
                (out.as_mut_ptr().add(first), n as isize, false),
                (a.as_ptr(), w.k as isize, 1),
                (tile.as_ptr(), 1, padded as isize),
                (0.0, 1.0),
                None,
            )
        };
    }
}

/// The `bits`-bit values of a block as f32, from the low bits of each byte.
fn unpack(blob: &[u8], bits: usize, w: &mut [f32]) {
    let mask = ((1u16 << bits) - 1) as u8;
    let per = 8 / bits;
    for (j, v) in w.iter_mut().enumerate() {
        *v = ((blob[j / per] >> ((j % per) * bits)) & mask) as f32;
    }
}

/// `Σ x·w` in f32, eight lanes.
fn dot(x: &[f32], w: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (xc, wc) = (x.chunks_exact(8), w.chunks_exact(8));
    let tail: f32 = xc.remainder().iter().zip(wc.remainder()).map(|(a, b)| a * b).sum();
    for (a, b) in xc.zip(wc) {
        for l in 0..8 {
            lanes[l] = a[l].mul_add(b[l], lanes[l]);
        }
    }
    lanes.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;

    /// Random 4-bit weights of 1,203 rows (not a multiple of four) over K = 96 in blocks of 32, and
    /// the generator that made them.
    struct Case {
        n: usize,
        k: usize,
        block: usize,
        kb: usize,
        blob: usize,
        b: Vec<u8>,
        scales: Vec<f32>,
        next: Box<dyn FnMut() -> u32>,
    }

    impl Case {
        fn new(mut seed: u64) -> Case {
            // 1,203 weight rows of 60 bytes: 301 groups, three tasks at TASK_BYTES (137, 137, 27).
            let (n, k, block) = (4 * 300 + 3, 96, 32);
            let (kb, blob) = (k / block, block / 2);
            let mut next: Box<dyn FnMut() -> u32> = Box::new(move || {
                seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                (seed >> 33) as u32
            });
            let b: Vec<u8> = (0..n * kb * blob).map(|_| next() as u8).collect();
            let scales: Vec<f32> = (0..n * kb).map(|_| (next() % 1000) as f32 / 1000.0 + 0.01).collect();
            Case { n, k, block, kb, blob, b, scales, next }
        }
    }

    /// The int8 decode product over ranges of weight rows (rayon's tasks, several kernel calls
    /// each) gives exactly each weight row's product computed alone, for 1, 3 and 6 rows of A
    /// (the last through four and two), default and packed zero points, and a weight row count
    /// that is not a multiple of four.
    #[test]
    fn int8_ranges_match_each_weight_row_alone() {
        let Case { n, k, block, kb, blob, b, scales, mut next } = Case::new(0x2545_f491_4f6c_dd1d);
        let zp_row = (kb * 4usize).div_ceil(8);
        let packed: Vec<u8> = (0..n * zp_row).map(|_| next() as u8).collect();
        for zeros in [Zeros::Default(8.0), Zeros::Packed(&packed, zp_row)] {
            let w = Weights { b: &b, scales: Cow::Borrowed(&scales), zeros, k, kb, block, blob, bits: 4 };
            for m in [1, 3, 6] {
                let a: Vec<f32> = (0..m * k).map(|_| (next() % 2000) as f32 / 1000.0 - 1.0).collect();
                let mut got = vec![0f32; m * n];
                int8_product(&a, &w, m, n, &mut got);
                let qa = cpu_q4i8::QuantizedA::new(&a, m, k, block);
                let mut z = vec![0f32; kb];
                for r in 0..n {
                    w.zeros(r, &mut z);
                    let row = cpu_q4i8::WeightRows {
                        bytes: w.row(r),
                        scales: w.scales(r),
                        zeros: &z,
                        rows: 1,
                        zero: w.default_zero(),
                    };
                    for i in 0..m {
                        let mut one = [0f32];
                        cpu_q4i8::dots(&qa, i..i + 1, &row, &mut one);
                        assert_eq!(got[i * n + r], one[0], "{m} rows of A, weight row {r}, A row {i}");
                    }
                }
            }
        }
    }

    /// A decode product whose groups of weight rows go to the kept-hot threads (`cpu_share`)
    /// gives exactly rayon's results, for one and three rows of A and a weight row count that is
    /// not a multiple of four.
    #[test]
    fn shared_and_rayon_decode_products_agree() {
        let Case { n, k, block, kb, blob, b, scales, mut next } = Case::new(0x9e37_79b9_7f4a_7c15);
        let w =
            Weights { b: &b, scales: Cow::Borrowed(&scales), zeros: Zeros::Default(8.0), k, kb, block, blob, bits: 4 };
        for m in [1, 3] {
            let a: Vec<f32> = (0..m * k).map(|_| (next() % 2000) as f32 / 1000.0 - 1.0).collect();
            let mut want = vec![0f32; m * n];
            direct_product(&a, &w, m, n, &mut want);
            assert!(want.iter().any(|v| *v != 0.0));
            cpu_share::FORCE.store(true, Ordering::Relaxed);
            let got = cpu_share::tests::hot(|| {
                let mut got = vec![0f32; m * n];
                direct_product(&a, &w, m, n, &mut got);
                got
            });
            cpu_share::FORCE.store(false, Ordering::Relaxed);
            if let Some(got) = got {
                assert_eq!(got, want, "{m} rows of A");
            }
        }
    }
}
