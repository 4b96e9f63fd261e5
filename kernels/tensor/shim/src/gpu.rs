//! Launch builders for the kernels of `cuda/tensor.cu`. Every builder launches nothing for
//! zero bytes or elements. Grids are sized from the vector width the kernel will likely pick
//! (it picks at run time from the real addresses; every kernel is a grid-stride loop, so any
//! grid is correct).

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::unsupported;

const BLOCK: u32 = 256;
/// Most blocks of one launch; grid-stride loops cover the rest.
const MAX_GRID: u64 = 1 << 20;
/// Most dimensions of [`strided`] (the kernel takes 8 dims and 8 strides as scalars).
pub const MAX_RANK: usize = 8;
/// Launches allowed per dispatch (ABI §2).
pub const MAX_LAUNCHES: usize = 4096;

/// A tensor and a byte offset into it.
#[derive(Clone, Copy)]
pub struct At {
    pub handle: u32,
    pub offset: u64,
}

impl At {
    pub fn of(t: &Tensor) -> At {
        At { handle: t.handle(), offset: 0 }
    }
    pub fn plus(self, bytes: u64) -> At {
        At { handle: self.handle, offset: self.offset + bytes }
    }
    pub fn arg(self) -> KernelArg {
        KernelArg::Tensor { handle: self.handle, offset: self.offset }
    }
}

fn grid(units: u64) -> u32 {
    units.div_ceil(BLOCK as u64).clamp(1, MAX_GRID) as u32
}

/// Largest width in {16, 8, 4, 2, 1} dividing every value (allocations are assumed aligned
/// to at least 16 bytes; the kernels check the real addresses).
fn width(values: &[u64]) -> u64 {
    let bits = values.iter().fold(0u64, |a, &v| a | v);
    [16, 8, 4, 2].into_iter().find(|w| bits % w == 0).unwrap_or(1)
}

fn run(kernel: &'static str, units: u64, args: Vec<KernelArg>) -> Result<()> {
    launch(&Launch { kernel, grid: [grid(units), 1, 1], block: [BLOCK, 1, 1], shared_mem_bytes: 0, args })
}

/// Eight u64 kernel arguments for a kernel that takes MAX_RANK dims or strides as scalars: `v`
/// padded with `pad`.
pub fn eight(v: &[usize], pad: u64) -> Vec<KernelArg> {
    (0..MAX_RANK).map(|k| KernelArg::U64(v.get(k).map_or(pad, |&x| x as u64))).collect()
}

/// One launch of `kernel` over `units` elements' worth of work (its grid-stride loop covers
/// the rest); nothing for zero units.
pub fn launch_elems(kernel: &str, units: u64, args: Vec<KernelArg>) -> Result<()> {
    if units == 0 {
        return Ok(());
    }
    launch(&Launch { kernel, grid: [grid(units), 1, 1], block: [BLOCK, 1, 1], shared_mem_bytes: 0, args })
}

/// `nbytes` contiguous bytes from `src` to `dst`.
pub fn copy(src: At, dst: At, nbytes: u64) -> Result<()> {
    if nbytes == 0 {
        return Ok(());
    }
    let w = width(&[src.offset, dst.offset]);
    run("kiln_tensor_copy", nbytes.div_ceil(w), vec![src.arg(), dst.arg(), KernelArg::U64(nbytes)])
}

/// `rows` rows of `row_bytes` bytes, row `r` at `src + r·src_pitch` and `dst + r·dst_pitch`.
pub fn copy2d(src: At, dst: At, rows: u64, row_bytes: u64, src_pitch: i64, dst_pitch: i64) -> Result<()> {
    if rows == 0 || row_bytes == 0 {
        return Ok(());
    }
    if rows == 1 || (src_pitch == row_bytes as i64 && dst_pitch == row_bytes as i64) {
        return copy(src, dst, rows * row_bytes);
    }
    let w = width(&[src.offset, dst.offset, row_bytes, src_pitch as u64, dst_pitch as u64]);
    run(
        "kiln_tensor_copy2d",
        rows * (row_bytes / w),
        vec![
            src.arg(),
            dst.arg(),
            KernelArg::U64(rows),
            KernelArg::U64(row_bytes),
            KernelArg::I64(src_pitch),
            KernelArg::I64(dst_pitch),
        ],
    )
}

/// Removes size-1 axes and merges neighbours that are contiguous in the source: the same
/// copy over fewer axes. `shape`/`strides` outermost first, strides in elements.
pub fn collapse(shape: &[usize], strides: &[isize]) -> (Vec<u64>, Vec<i64>) {
    let mut dims: Vec<u64> = Vec::with_capacity(shape.len());
    let mut st: Vec<i64> = Vec::with_capacity(shape.len());
    for (&d, &s) in shape.iter().zip(strides) {
        if d == 1 {
            continue;
        }
        let (d, s) = (d as u64, s as i64);
        match (dims.last_mut(), st.last_mut()) {
            (Some(pd), Some(ps)) if *ps == s * d as i64 => {
                *pd *= d;
                *ps = s;
            }
            _ => {
                dims.push(d);
                st.push(s);
            }
        }
    }
    (dims, st)
}

/// The strided gather: `dst` gets the `shape` elements (row-major) of `esize` bytes whose
/// source is `src + Σ i_k·strides[k]·esize` (`src` is the first output element's source).
/// `shape`/`strides` outermost first; strides in elements, signed.
pub fn strided(src: At, dst: At, esize: usize, shape: &[usize], strides: &[isize]) -> Result<()> {
    let n: u64 = shape.iter().map(|&d| d as u64).product();
    if n == 0 {
        return Ok(());
    }
    let e = esize as u64;
    let (mut dims, mut st) = collapse(shape, strides);
    let rank = dims.len();
    // Contiguous source: one copy; contiguous rows: a 2-D copy.
    if rank == 0 || (rank == 1 && st[0] == 1) {
        return copy(src, dst, n * e);
    }
    if rank == 2 && st[1] == 1 {
        return copy2d(src, dst, dims[0], dims[1] * e, st[0] * e as i64, (dims[1] * e) as i64);
    }
    // Source contiguous along the output's second-to-last axis: a tiled transpose (coalesced
    // reads and writes) of the last two axes, batched over the others.
    if rank >= 2 && rank - 2 <= TRANSPOSE_BATCH_RANK && st[rank - 2] == 1 && dims[rank - 2] >= 8 && dims[rank - 1] >= 8
    {
        return transpose(src, dst, esize, &dims, &st);
    }
    if rank > MAX_RANK {
        unsupported!("strided copy of {rank} axes (at most {MAX_RANK} after merging)");
    }
    // Widen the element when the innermost axis is contiguous: g elements as one unit of
    // esize·g ≤ 16 bytes, when g divides that axis, every other stride and the offsets.
    let mut unit = e;
    if st[rank - 1] == 1 {
        let mut g = 16 / e;
        while g > 1 {
            let ok = dims[rank - 1] % g == 0
                && st[..rank - 1].iter().all(|&s| s % g as i64 == 0)
                && src.offset.is_multiple_of(e * g)
                && dst.offset.is_multiple_of(e * g);
            if ok {
                break;
            }
            g /= 2;
        }
        if g > 1 {
            dims[rank - 1] /= g;
            for s in &mut st[..rank - 1] {
                *s /= g as i64;
            }
            unit = e * g;
        }
    }
    let units = n * e / unit;
    let mut args =
        vec![src.arg(), dst.arg(), KernelArg::U64(units), KernelArg::U32(unit as u32), KernelArg::U32(rank as u32)];
    // Innermost first, padded to MAX_RANK.
    args.extend((0..MAX_RANK).map(|k| KernelArg::U64(if k < rank { dims[rank - 1 - k] } else { 1 })));
    args.extend((0..MAX_RANK).map(|k| KernelArg::I64(if k < rank { st[rank - 1 - k] } else { 0 })));
    run("kiln_tensor_strided", units, args)
}

/// Batch axes of [`transpose`] (scalar arguments of the kernel).
const TRANSPOSE_BATCH_RANK: usize = 6;

/// `dst[b][k][l] = src[off(b) + k + l·s_l]` for collapsed `dims` (`[batch.., nk, nl]`) and
/// element strides `st` whose second-to-last is 1.
fn transpose(src: At, dst: At, esize: usize, dims: &[u64], st: &[i64]) -> Result<()> {
    let rank = dims.len();
    let (nk, nl) = (dims[rank - 2], dims[rank - 1]);
    let batch = &dims[..rank - 2];
    let nb: u64 = batch.iter().product();
    let tiles = nb * nk.div_ceil(32) * nl.div_ceil(32);
    let mut args = vec![
        src.arg(),
        dst.arg(),
        KernelArg::U32(esize as u32),
        KernelArg::U64(nb),
        KernelArg::U64(nk),
        KernelArg::U64(nl),
        KernelArg::I64(st[rank - 1]),
        KernelArg::U32(batch.len() as u32),
    ];
    // Batch axes innermost first, padded.
    let b = batch.len();
    args.extend((0..TRANSPOSE_BATCH_RANK).map(|i| KernelArg::U64(if i < b { batch[b - 1 - i] } else { 1 })));
    args.extend((0..TRANSPOSE_BATCH_RANK).map(|i| KernelArg::I64(if i < b { st[b - 1 - i] } else { 0 })));
    launch(&Launch {
        kernel: "kiln_tensor_transpose",
        grid: [tiles.clamp(1, MAX_GRID) as u32, 1, 1],
        block: [32, 8, 1],
        shared_mem_bytes: 0,
        args,
    })
}

/// Gather along axis `axis` (for the device error's message): `data` is
/// `outer × dim × inner_bytes`, `indices` int32 or int64.
#[allow(clippy::too_many_arguments)]
pub fn gather(
    data: At,
    indices: At,
    idx64: bool,
    dst: At,
    outer: u64,
    dim: u64,
    n_idx: u64,
    inner_bytes: u64,
    axis: u32,
) -> Result<()> {
    let units = outer * n_idx * inner_bytes;
    if units == 0 {
        return Ok(());
    }
    let w = width(&[data.offset, dst.offset, inner_bytes]);
    run(
        "kiln_tensor_gather",
        units / w,
        vec![
            data.arg(),
            indices.arg(),
            dst.arg(),
            KernelArg::U64(outer),
            KernelArg::U64(dim),
            KernelArg::U64(n_idx),
            KernelArg::U64(inner_bytes),
            KernelArg::U32(idx64 as u32),
            KernelArg::U32(axis),
            KernelArg::Status,
        ],
    )
}

/// `nbytes` bytes of `one` (an element of 1, 2, 4 or 8 bytes) repeated.
pub fn fill(dst: At, nbytes: u64, one: &[u8]) -> Result<()> {
    if nbytes == 0 {
        return Ok(());
    }
    if one.is_empty() || 16 % one.len() != 0 {
        unsupported!("fill with an element of {} bytes", one.len());
    }
    let pattern: Vec<u8> = one.repeat(16 / one.len());
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
    run(
        "kiln_tensor_fill",
        nbytes.div_ceil(16),
        vec![
            dst.arg(),
            KernelArg::U64(nbytes),
            KernelArg::U64(word(&pattern[..8])),
            KernelArg::U64(word(&pattern[8..])),
        ],
    )
}

/// The 64-bit `values`, in order, from `dst` (8 per launch).
pub fn values64(dst: At, values: &[u64]) -> Result<()> {
    for (c, chunk) in values.chunks(8).enumerate() {
        let mut args = vec![dst.plus(64 * c as u64).arg(), KernelArg::U32(chunk.len() as u32)];
        args.extend((0..8).map(|k| KernelArg::U64(chunk.get(k).copied().unwrap_or(0))));
        launch(&Launch {
            kernel: "kiln_tensor_values64",
            grid: [1, 1, 1],
            block: [8, 1, 1],
            shared_mem_bytes: 0,
            args,
        })?;
    }
    Ok(())
}

/// `n` integers `start + i·delta` (wrapping in 64 bits) of `esize` bytes.
pub fn range_int(dst: At, n: u64, start: i64, delta: i64, esize: usize) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    if !matches!(esize, 1 | 2 | 4 | 8) {
        unsupported!("integer Range of {esize}-byte elements");
    }
    run(
        "kiln_tensor_range_int",
        n,
        vec![dst.arg(), KernelArg::U64(n), KernelArg::I64(start), KernelArg::I64(delta), KernelArg::U32(esize as u32)],
    )
}

/// `n` floats `start + i·delta` computed in f64, stored as float32 or float64.
pub fn range_float(dst: At, n: u64, start: f64, delta: f64, dtype: DType) -> Result<()> {
    let esize = match dtype {
        DType::F32 => 4u32,
        DType::F64 => 8,
        other => unsupported!("Range of {other} has no CUDA kernel"),
    };
    if n == 0 {
        return Ok(());
    }
    run(
        "kiln_tensor_range_float",
        n,
        vec![dst.arg(), KernelArg::U64(n), KernelArg::F64(start), KernelArg::F64(delta), KernelArg::U32(esize)],
    )
}
