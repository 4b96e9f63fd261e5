//! Det-11/22 (ONNX Operators.md): `X` [*, M, M] → the determinants [*] of its square matrices,
//! by LU decomposition with partial pivoting (LAPACK's `getrf`, numpy's `linalg.det`), in f64.
//! On the GPU `kiln_det<Tag>` runs one thread per matrix over an f64 copy of it in scratch.

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, unsupported};

/// Matrices and their size M.
fn plan(call: &Call) -> Result<(usize, usize, Vec<usize>)> {
    let x = call.input(0)?;
    let d = x.dtype()?;
    if !d.is_float() {
        unsupported!("Det: dtype {d} is not supported (floating-point only)");
    }
    let shape = x.shape()?;
    let [ref batch @ .., r, c] = shape[..] else { bail!("Det: X must have rank 2 or more, not {shape:?}") };
    if r != c {
        bail!("Det: the last two dimensions must be equal (square matrices), not {r} and {c}");
    }
    Ok((batch.iter().product(), r, batch.to_vec()))
}

/// The determinant of the row-major m × m matrix `a` (overwritten by its LU factors).
fn det(a: &mut [f64], m: usize) -> f64 {
    let mut d = 1.0;
    for k in 0..m {
        let p = (k..m).fold(k, |p, i| if libm::fabs(a[i * m + k]) > libm::fabs(a[p * m + k]) { i } else { p });
        if a[p * m + k] == 0.0 {
            return 0.0;
        }
        if p != k {
            for j in 0..m {
                a.swap(k * m + j, p * m + j);
            }
            d = -d;
        }
        let pivot = a[k * m + k];
        d *= pivot;
        for i in k + 1..m {
            let f = a[i * m + k] / pivot;
            for j in k + 1..m {
                a[i * m + j] -= f * a[k * m + j];
            }
        }
    }
    d
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let (_, _, batch) = plan(call)?;
    Ok(alloc::vec![TensorType::new(call.input(0)?.dtype()?, batch)])
}

pub fn cpu(call: &Call) -> Result<()> {
    let (n, m, _) = plan(call)?;
    let mut x = call.input(0)?.read_vec::<f64>()?;
    let y: Vec<f64> = (0..n).map(|b| det(&mut x[b * m * m..(b + 1) * m * m], m)).collect();
    call.output(0)?.write_vec(&y)
}

pub fn dispatch(call: &Call) -> Result<()> {
    let (n, m, _) = plan(call)?;
    if n == 0 {
        return Ok(());
    }
    let dtype = call.input(0)?.dtype()?;
    let Some(tag) = dtype.cuda_tag() else { unsupported!("Det: no CUDA kernel for {dtype}") };
    let work = scratch((n * m * m).max(1) as u64 * 8)?;
    launch(&Launch {
        kernel: &kernel_name("kiln_det", &[tag]),
        grid: grid_stride(n as u64),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args: alloc::vec![
            KernelArg::Tensor { handle: call.input(0)?.handle(), offset: 0 },
            KernelArg::Tensor { handle: work, offset: 0 },
            KernelArg::Tensor { handle: call.output(0)?.handle(), offset: 0 },
            KernelArg::U64(n as u64),
            KernelArg::U64(m as u64),
        ],
    })
}
