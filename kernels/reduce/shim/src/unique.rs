//! Unique-11 (ONNX Operators.md and its reference, numpy's `unique`): without `axis` the distinct
//! elements of `X` flattened; with `axis` its distinct slices along that axis (compared
//! lexicographically, elements in row-major order); `sorted` (default 1) orders them ascending,
//! else by first occurrence. Outputs: `Y`, and optionally int64 `indices` (each one's first
//! occurrence), `inverse_indices` (each element's or slice's position in `Y`) and `counts`.
//! X is a value input: the output shape depends on its values.
//!
//! On the GPU three kernels run over the slices: `kiln_unique_first<Tag>` finds each slice's
//! first equal slice (O(n²) comparisons), `kiln_unique_place<Tag>` ranks the first occurrences
//! and writes `Y`, `indices` and `counts`, `kiln_unique_inverse` the inverse indices.

use alloc::vec::Vec;
use core::cmp::Ordering;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, unsupported};

/// The input seen as `[outer, n, inner]` slices along the axis (or `[1, len, 1]` flattened).
struct Plan {
    dtype: DType,
    esize: usize,
    outer: usize,
    n: usize,
    inner: usize,
    axis: Option<usize>,
    shape: Vec<usize>,
    sorted: bool,
}

fn plan(call: &Call) -> Result<Plan> {
    let x = call.input(0)?;
    let dtype = x.dtype()?;
    let Some(esize) = dtype.size() else { unsupported!("Unique: {dtype} tensors are not supported") };
    let shape = x.shape()?;
    let sorted = match call.attr_i("sorted", 1)? {
        0 => false,
        1 => true,
        v => bail!("Unique: sorted must be 0 or 1, not {v}"),
    };
    let (outer, n, inner, axis) = match call.attr("axis") {
        None => (1, shape.iter().product(), 1, None),
        Some(_) => {
            let a = shape::normalize_axis(call.attr_i("axis", 0)?, shape.len())
                .map_err(|_| ShimError::Failed(alloc::format!("Unique: axis is outside rank {}", shape.len())))?;
            (shape[..a].iter().product(), shape[a], shape[a + 1..].iter().product(), Some(a))
        }
    };
    Ok(Plan { dtype, esize, outer, n, inner, axis, shape, sorted })
}

/// Element bytes `a` and `b` of `dtype` compared as numbers (NaN equal to itself, after the
/// rest).
fn cmp_elem(dtype: DType, a: &[u8], b: &[u8]) -> Ordering {
    let float = |v: &[u8]| -> f64 {
        match dtype {
            DType::F32 => f32::from_le_bytes([v[0], v[1], v[2], v[3]]) as f64,
            DType::F64 => f64::from_le_bytes(v.try_into().unwrap_or_default()),
            DType::F16 => f16::from_le_bytes([v[0], v[1]]).to_f64(),
            _ => bf16::from_le_bytes([v[0], v[1]]).to_f64(),
        }
    };
    let signed = |v: &[u8]| -> i128 {
        let mut w = [if v.last().is_some_and(|&b| b & 0x80 != 0) { 0xff } else { 0 }; 16];
        w[..v.len()].copy_from_slice(v);
        i128::from_le_bytes(w)
    };
    let unsigned = |v: &[u8]| -> u128 {
        let mut w = [0u8; 16];
        w[..v.len()].copy_from_slice(v);
        u128::from_le_bytes(w)
    };
    match dtype {
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 => {
            let (x, y) = (float(a), float(b));
            x.partial_cmp(&y).unwrap_or_else(|| x.is_nan().cmp(&y.is_nan()))
        }
        DType::I8 | DType::I16 | DType::I32 | DType::I64 => signed(a).cmp(&signed(b)),
        _ => unsigned(a).cmp(&unsigned(b)),
    }
}

/// What Unique computes: the first occurrence of each distinct slice in output order, the
/// output position of every slice, and each distinct slice's count.
struct Found {
    firsts: Vec<usize>,
    inverse: Vec<usize>,
    counts: Vec<usize>,
}

impl Plan {
    /// Slice `j`'s element `k` (row-major over outer, inner).
    fn elem<'b>(&self, x: &'b [u8], j: usize, k: usize) -> &'b [u8] {
        let (o, i) = (k / self.inner, k % self.inner);
        let at = ((o * self.n + j) * self.inner + i) * self.esize;
        &x[at..at + self.esize]
    }

    fn cmp_slices(&self, x: &[u8], a: usize, b: usize) -> Ordering {
        (0..self.outer * self.inner)
            .map(|k| cmp_elem(self.dtype, self.elem(x, a, k), self.elem(x, b, k)))
            .find(|o| o.is_ne())
            .unwrap_or(Ordering::Equal)
    }

    fn find(&self, x: &[u8]) -> Found {
        // Slices sorted by value, ties by position: each run of equal slices starts with its
        // first occurrence.
        let mut order: Vec<usize> = (0..self.n).collect();
        order.sort_by(|&a, &b| self.cmp_slices(x, a, b).then(a.cmp(&b)));
        let mut groups: Vec<(usize, usize)> = Vec::new(); // (first occurrence, count)
        let mut group_of = alloc::vec![0usize; self.n];
        for (r, &j) in order.iter().enumerate() {
            if r == 0 || self.cmp_slices(x, order[r - 1], j).is_ne() {
                groups.push((j, 0));
            }
            let g = groups.len() - 1;
            groups[g].1 += 1;
            group_of[j] = g;
        }
        // Output order: by value (as grouped), or by first occurrence.
        let mut out: Vec<usize> = (0..groups.len()).collect();
        if !self.sorted {
            out.sort_by_key(|&g| groups[g].0);
        }
        let mut pos = alloc::vec![0usize; groups.len()];
        for (p, &g) in out.iter().enumerate() {
            pos[g] = p;
        }
        Found {
            firsts: out.iter().map(|&g| groups[g].0).collect(),
            inverse: group_of.iter().map(|&g| pos[g]).collect(),
            counts: out.iter().map(|&g| groups[g].1).collect(),
        }
    }

    fn y_shape(&self, u: usize) -> Vec<usize> {
        match self.axis {
            None => alloc::vec![u],
            Some(a) => {
                let mut s = self.shape.clone();
                s[a] = u;
                s
            }
        }
    }
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    let f = p.find(&call.input(0)?.value_bytes()?);
    let u = f.firsts.len();
    Ok(alloc::vec![
        TensorType::new(p.dtype, p.y_shape(u)),
        TensorType::new(DType::I64, alloc::vec![u]),
        TensorType::new(DType::I64, alloc::vec![p.n]),
        TensorType::new(DType::I64, alloc::vec![u]),
    ])
}

pub fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let x = call.input(0)?.value_bytes()?;
    let f = p.find(&x);
    let u = f.firsts.len();
    let mut y = Vec::with_capacity(p.outer * u * p.inner * p.esize);
    for o in 0..p.outer {
        for &j in &f.firsts {
            let at = (o * p.n + j) * p.inner * p.esize;
            y.extend_from_slice(&x[at..at + p.inner * p.esize]);
        }
    }
    call.output(0)?.write_bytes(&y)?;
    let ints = |v: &[usize]| v.iter().map(|&i| i as i64).collect::<Vec<i64>>();
    for (i, v) in [(1, &f.firsts), (2, &f.inverse), (3, &f.counts)] {
        if let Some(t) = call.output_opt(i) {
            t.write_vec(&ints(v))?;
        }
    }
    Ok(())
}

pub fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let u = p.find(&call.input(0)?.value_bytes()?).firsts.len();
    if p.n == 0 {
        return Ok(());
    }
    let Some(tag) = p.dtype.cuda_tag() else { unsupported!("Unique: no CUDA kernel for {}", p.dtype) };
    let t = KernelArg::tensor;
    let (first, pos) = (scratch(p.n as u64 * 8)?, scratch(p.n as u64 * 8)?);
    let x = call.input(0)?.handle();
    let geometry = [KernelArg::U64(p.n as u64), KernelArg::U64(p.outer as u64), KernelArg::U64(p.inner as u64)];
    let per_slice = |kernel: &str, mut args: Vec<KernelArg>| {
        args.extend(geometry);
        launch(&Launch {
            kernel,
            grid: grid_stride(p.n as u64),
            block: [GRID_STRIDE_BLOCK, 1, 1],
            shared_mem_bytes: 0,
            args,
        })
    };
    per_slice(&kernel_name("kiln_unique_first", &[tag]), alloc::vec![t(x), t(first)])?;
    // Absent outputs write into `pos` instead (sized for them), and are flagged off.
    let out = |i: usize| call.output_opt(i).map(|o| o.handle());
    let flags = out(1).is_some() as u32 | (out(3).is_some() as u32) << 1;
    per_slice(
        &kernel_name("kiln_unique_place", &[tag]),
        alloc::vec![
            t(x),
            t(first),
            t(pos),
            t(call.output(0)?.handle()),
            t(out(1).unwrap_or(pos)),
            t(out(3).unwrap_or(pos)),
            KernelArg::U64(u as u64),
            KernelArg::U32(p.sorted as u32),
            KernelArg::U32(flags),
        ],
    )?;
    if let Some(inv) = out(2) {
        per_slice("kiln_unique_inverse", alloc::vec![t(first), t(pos), t(inv)])?;
    }
    Ok(())
}
