//! The `qgemm` import in `kiln_cpu` calls (ABI.md §4.9): MatMulNBits' block-quantized product
//! on the host, the output columns shared over the CPU pool, each weight row dequantized block
//! by block once for every row of A (`Σ q·a` per block, then `scale · (Σ q·a − zero · Σ a)`), in
//! f32. The inner loops are compiled twice, for AVX2 + FMA (chosen at run time) and the baseline.

use kiln_kernel_abi::wire::{QGemm, QZeroPoints, TensorAt};
use rayon::prelude::*;

use super::cpu_gemm::{f32_view, on_pool, operand_bytes, store, with_output};
use super::handles::Slot;

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
    let b = bytes(&q.b, n * kb * blob)?;
    let scales = f32_view(bytes(&q.scales, n * kb * size)?, q.dtype)?;
    let zp_row = (kb * bits).div_ceil(8);
    let (zp_packed, zp_float) = match &q.zero_points {
        QZeroPoints::Default => (None, None),
        QZeroPoints::Packed(t) => (Some(bytes(t, n * zp_row)?), None),
        QZeroPoints::Float(t) => (None, Some(f32_view(bytes(t, n * kb * size)?, q.dtype)?)),
    };
    let bias = match &q.bias {
        Some(t) => Some(f32_view(bytes(t, n * size)?, q.dtype)?),
        None => None,
    };
    let default_zp = (1u32 << (bits - 1)) as f32;
    let mask = ((1u16 << bits) - 1) as u8;
    let zero = |r: usize, j: usize| -> f32 {
        match (&zp_packed, &zp_float) {
            (Some(p), _) => {
                let per = 8 / bits;
                ((p[r * zp_row + j / per] >> ((j % per) * bits)) & mask) as f32
            }
            (_, Some(f)) => f[r * kb + j],
            _ => default_zp,
        }
    };
    // Σ a over each block of each row of A.
    let a_sums: Vec<f32> = (0..m)
        .flat_map(|i| (0..kb).map(move |j| (i, j)))
        .map(|(i, j)| a[i * k + j * block..i * k + ((j + 1) * block).min(k)].iter().sum())
        .collect();
    // Column-major results: out[r · m + i] is Y[i, r].
    let mut out = vec![0f32; n * m];
    let avx2 = avx2();
    let col = Column { a: &a, a_sums: &a_sums, k, kb, block, blob, bits, mask };
    on_pool(|| {
        out.par_chunks_mut(m).with_min_len(32).enumerate().for_each_init(
            || (vec![0f32; block], vec![0f32; kb]),
            |(w, zeros), (r, out)| {
                zeros.iter_mut().enumerate().for_each(|(j, z)| *z = zero(r, j));
                col.compute(avx2, &b[r * kb * blob..(r + 1) * kb * blob], &scales[r * kb..(r + 1) * kb], zeros, w, out);
                if let Some(bias) = &bias {
                    out.iter_mut().for_each(|v| *v += bias[r]);
                }
            },
        )
    });
    let mut row = vec![0f32; n];
    for i in 0..m {
        for (r, v) in row.iter_mut().enumerate() {
            *v = out[r * m + i];
        }
        store(q.dtype, &row, &mut y[i * n * size..(i + 1) * n * size]);
    }
    Ok(())
}

/// What every output column shares: A, its block sums, the geometry.
struct Column<'a> {
    a: &'a [f32],
    a_sums: &'a [f32],
    k: usize,
    kb: usize,
    block: usize,
    blob: usize,
    bits: usize,
    mask: u8,
}

impl Column<'_> {
    /// Y[·, r] for weight row `row` (its blocks), `scales` and `zeros` of its blocks, into `out`
    /// (one value per row of A); `w` holds one block.
    fn compute(&self, avx2: bool, row: &[u8], scales: &[f32], zeros: &[f32], w: &mut [f32], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: the CPU has AVX2 and FMA (checked by `avx2()`).
            return unsafe { self.compute_avx2(row, scales, zeros, w, out) };
        }
        let _ = avx2;
        self.compute_body(row, scales, zeros, w, out)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn compute_avx2(&self, row: &[u8], scales: &[f32], zeros: &[f32], w: &mut [f32], out: &mut [f32]) {
        self.compute_body(row, scales, zeros, w, out)
    }

    #[inline(always)]
    fn compute_body(&self, row: &[u8], scales: &[f32], zeros: &[f32], w: &mut [f32], out: &mut [f32]) {
        for j in 0..self.kb {
            let len = self.block.min(self.k - j * self.block);
            unpack(&row[j * self.blob..(j + 1) * self.blob], self.bits, self.mask, &mut w[..len]);
            let (s, z) = (scales[j], zeros[j]);
            for (i, acc) in out.iter_mut().enumerate() {
                let x = &self.a[i * self.k + j * self.block..][..len];
                *acc += s * (dot_lanes(x, &w[..len]) - z * self.a_sums[i * self.kb + j]);
            }
        }
    }
}

/// The `bits`-bit values of a block as f32, from the low bits of each byte.
#[inline(always)]
fn unpack(blob: &[u8], bits: usize, mask: u8, w: &mut [f32]) {
    match bits {
        4 => {
            for (pair, &byte) in w.chunks_mut(2).zip(blob) {
                pair[0] = (byte & 15) as f32;
                if let Some(hi) = pair.get_mut(1) {
                    *hi = (byte >> 4) as f32;
                }
            }
        }
        8 => w.iter_mut().zip(blob).for_each(|(v, &b)| *v = b as f32),
        _ => {
            let per = 8 / bits;
            for (j, v) in w.iter_mut().enumerate() {
                *v = ((blob[j / per] >> ((j % per) * bits)) & mask) as f32;
            }
        }
    }
}

/// Whether the CPU has AVX2 and FMA (the faster `dot`).
fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `Σ x·w` in f32, eight lanes.
#[inline(always)]
fn dot_lanes(x: &[f32], w: &[f32]) -> f32 {
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
