//! Trilu-14 (ONNX Operators.md): the upper (`upper` = 1, the default) or lower triangle of the
//! last two dimensions `[M, N]` of a tensor of rank ≥ 2, every other element zero. Element
//! `(i, j)` of a matrix is kept when `j − i ≥ k` (upper) or `j − i ≤ k` (lower); `k` is the
//! optional int64 scalar input 1 (a value input), 0 when absent. Works on raw element bytes, so
//! every fixed-size dtype works.

use alloc::vec::Vec;
use kiln_kernel_abi::bail;
use kiln_kernel_abi::guest::*;

use crate::elem_size;

/// The node's geometry: element size, element count, matrix rows and columns, `k`, `upper`.
struct Plan {
    esize: usize,
    n: usize,
    rows: usize,
    cols: usize,
    k: i64,
    upper: bool,
}

fn plan(call: &Call) -> Result<Plan> {
    let x = call.input(0)?;
    let esize = elem_size("Trilu", x.dtype()?)?;
    let shape = x.shape()?;
    let [.., rows, cols] = shape[..] else {
        bail!("Trilu: input must have rank 2 or more, not {}", shape.len());
    };
    let k = match call.input_opt(1) {
        Some(t) => match t.read_i64s()?[..] {
            [k] => k,
            ref v => bail!("Trilu: k must be a scalar, got {} values", v.len()),
        },
        None => 0,
    };
    let upper = match call.attr_i("upper", 1)? {
        0 => false,
        1 => true,
        other => bail!("Trilu: upper must be 0 or 1, not {other}"),
    };
    Ok(Plan { esize, n: shape.iter().product(), rows, cols, k, upper })
}

impl Plan {
    /// Whether element `t` (row-major) is kept.
    fn keeps(&self, t: usize) -> bool {
        let (i, j) = ((t / self.cols) % self.rows, t % self.cols);
        let d = j as i64 - i as i64;
        if self.upper {
            d >= self.k
        } else {
            d <= self.k
        }
    }
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    plan(call)?;
    let x = call.input(0)?;
    Ok(vec![TensorType::new(x.dtype()?, x.shape()?)])
}

pub fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let mut bytes = call.input(0)?.read_bytes()?;
    for (t, e) in bytes.chunks_exact_mut(p.esize).enumerate() {
        if !p.keeps(t) {
            e.fill(0);
        }
    }
    call.output(0)?.write_bytes(&bytes)
}

/// `kiln_tensor_trilu`: one thread per element (grid-stride).
pub fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    if p.n == 0 {
        return Ok(());
    }
    launch(&Launch {
        kernel: "kiln_tensor_trilu",
        grid: [(p.n as u64).div_ceil(256).clamp(1, 1 << 20) as u32, 1, 1],
        block: [256, 1, 1],
        shared_mem_bytes: 0,
        args: vec![
            KernelArg::Tensor { handle: call.input(0)?.handle(), offset: 0 },
            KernelArg::Tensor { handle: call.output(0)?.handle(), offset: 0 },
            KernelArg::U64(p.n as u64),
            KernelArg::U32(p.esize as u32),
            KernelArg::U64(p.rows as u64),
            KernelArg::U64(p.cols as u64),
            KernelArg::I64(p.k),
            KernelArg::U32(p.upper as u32),
        ],
    })
}
