//! Shim of `kiln-quant`: block-quantized weight ops of onnxruntime's `com.microsoft` domain,
//! following onnxruntime's docs/ContribOperators.md (checked against its CPU kernels):
//!
//! - **MatMulNBits-1**: `Y = A · dequant(B)ᵀ (+ bias)`, `B` [N, k_blocks, blob_size] packed
//!   along K (low bits first), `dequant = (q − zero_point) · scale` per block of `block_size`
//!   along K; bits 2, 4, 8; zero points absent (2^(bits−1)), packed uint8, or of A's dtype;
//!   `g_idx` (deprecated) for 4 bits without packed zero points; an omitted projection (a zero
//!   dimension in `B`) gives the bias or zeros. The CPU reference is the host's `qgemm`
//!   (ABI.md §4.9, manifest schema 8: B never enters the shim, the output columns share the
//!   cores, f32 sums, rounded once to A's dtype); `accuracy_level` 4 lets the host quantize A's
//!   blocks to int8 as onnxruntime's CPU provider does (§6.6; schema 17), and the GPU computes in
//!   f32 at every level; with `g_idx` the shim
//!   dequantizes to f32 row by row of N and sums in f32 lanes per chunk of 64 and in f64 across
//!   chunks, its inner loops in wasm `simd128`.
//! - **GatherBlockQuantized-1**: `data` uint8 (bits 2, 4 packed along the last axis, low bits
//!   first, or 8), `gather_axis` 0, output = `float(q − zero_point) · scale` in scales' dtype
//!   (f32 arithmetic, rounded once, as onnxruntime); out-of-range indices give zeros.
//!   int4/uint4/float8/float4 `data` have no kiln dtype.
//!
//! And ONNX's own quantization ops: QuantizeLinear, DequantizeLinear and DynamicQuantizeLinear
//! ([`onnx_quant`]), QLinearMatMul and MatMulInteger ([`qmatmul`]).
#![no_std]
extern crate alloc;

mod onnx_quant;
mod qmatmul;

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, export_shim, unsupported};

struct Pkg;

impl Shim for Pkg {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        match call.op_type() {
            "MatMulNBits" => {
                let p = MnbPlan::new(call)?;
                Ok(vec![TensorType::new(p.dtype, p.out_shape)])
            }
            "GatherBlockQuantized" => {
                let p = GbqPlan::new(call)?;
                Ok(vec![TensorType::new(p.dtype, p.out_shape)])
            }
            "QuantizeLinear" | "DequantizeLinear" | "DynamicQuantizeLinear" => onnx_quant::infer(call),
            "QLinearMatMul" | "MatMulInteger" => qmatmul::infer(call),
            other => unsupported!("kiln-quant does not implement {other}"),
        }
    }

    fn cpu(call: &Call) -> Result<()> {
        match call.op_type() {
            "MatMulNBits" => MnbPlan::new(call)?.run(call),
            "GatherBlockQuantized" => GbqPlan::new(call)?.run(call),
            "QuantizeLinear" | "DequantizeLinear" | "DynamicQuantizeLinear" => onnx_quant::cpu(call),
            "QLinearMatMul" | "MatMulInteger" => qmatmul::cpu(call),
            other => unsupported!("kiln-quant does not implement {other}"),
        }
    }

    fn dispatch(call: &Call) -> Result<()> {
        match call.op_type() {
            "MatMulNBits" => MnbPlan::new(call)?.dispatch(call),
            "GatherBlockQuantized" => GbqPlan::new(call)?.dispatch(call),
            "QuantizeLinear" | "DequantizeLinear" | "DynamicQuantizeLinear" => onnx_quant::dispatch(call),
            "QLinearMatMul" | "MatMulInteger" => qmatmul::dispatch(call),
            other => unsupported!("kiln-quant does not implement {other}"),
        }
    }
}

export_shim!(Pkg);

/// The dtype tag of a float dtype: the kernels' template argument (`kiln_mnb_gemv<kiln_tag_f16>`,
/// ABI.md §7.3.1).
fn tag(op: &str, d: DType) -> Result<&'static str> {
    match (d, d.cuda_tag()) {
        (DType::F32 | DType::F16 | DType::BF16, Some(t)) => Ok(t),
        _ => unsupported!("{op}: no CUDA kernel for {d}"),
    }
}

fn tensor(t: &Tensor) -> KernelArg {
    KernelArg::Tensor { handle: t.handle(), offset: 0 }
}

/// A `u32` kernel argument, or unsupported when the value does not fit.
fn u32_arg(op: &str, what: &str, v: usize) -> Result<KernelArg> {
    match u32::try_from(v) {
        Ok(v) => Ok(KernelArg::U32(v)),
        Err(_) => unsupported!("{op}: {what} = {v} does not fit the CUDA kernel's 32-bit index"),
    }
}

/// Threads per block of the grid-stride kernels.
const BLOCK: u32 = 256;

/// Grid of a grid-stride loop over `n` elements.
fn grid_for(n: usize) -> u32 {
    (n as u64).div_ceil(BLOCK as u64).clamp(1, 65535 * 32) as u32
}

/// A required INT attribute.
fn attr_req(call: &Call, name: &str) -> Result<i64> {
    if call.attr(name).is_none() {
        bail!("{}: attribute {name} is required", call.op_type());
    }
    call.attr_i(name, 0)
}

fn is_float(d: DType) -> bool {
    matches!(d, DType::F32 | DType::F16 | DType::BF16)
}

/// Whether `shape` is `[a·b]` or `[a, b]` (1-D kept by onnxruntime for older models).
fn is_1d_or_2d(shape: &[usize], a: usize, b: usize) -> bool {
    shape == [a * b] || shape == [a, b]
}

/// Extracts element `j` of a row packed `bits` per element, low bits first.
#[inline(always)]
fn unpack(bytes: &[u8], j: usize, bits: usize) -> u8 {
    let per = 8 / bits;
    let mask = ((1u16 << bits) - 1) as u8;
    (bytes[j / per] >> ((j % per) * bits)) & mask
}

// ---------------------------------------------------------------------------------------
// MatMulNBits

#[derive(Clone, Copy, PartialEq, Eq)]
enum Zp {
    /// 2^(bits−1).
    Default,
    /// uint8, packed `bits` per element along the blocks of a row.
    Packed,
    /// A's dtype, one per block.
    Float,
}

struct MnbPlan {
    dtype: DType,
    k: usize,
    n: usize,
    bits: usize,
    block: usize,
    k_blocks: usize,
    blob: usize,
    /// Rows of A (product of its leading dimensions).
    m: usize,
    out_shape: Vec<usize>,
    zp: Zp,
    g_idx: bool,
    bias: bool,
    /// `B` has a zero dimension: the projection is omitted (Y = bias or 0).
    omitted: bool,
    /// Attribute `accuracy_level` (clamped to 0..=4 as onnxruntime does), passed to the host's `qgemm`: at 4 the host may
    /// quantize A's blocks to int8 as onnxruntime does (ABI.md §6.6).
    accuracy_level: u8,
}

impl MnbPlan {
    fn new(call: &Call) -> Result<MnbPlan> {
        let op = "MatMulNBits";
        let k = attr_req(call, "K")?;
        let n = attr_req(call, "N")?;
        let block = attr_req(call, "block_size")?;
        let bits = call.attr_i("bits", 4)?;
        if k < 0 || n < 0 {
            bail!("{op}: K ({k}) and N ({n}) must be >= 0");
        }
        if !(2..=8).contains(&bits) {
            bail!("{op}: bits must be in 2..=8, got {bits}");
        }
        if !matches!(bits, 2 | 4 | 8) {
            unsupported!("{op}: bits {bits} (onnxruntime implements 2, 4 and 8)");
        }
        if block < 16 || block & (block - 1) != 0 {
            bail!("{op}: block_size must be a power of two >= 16, got {block}");
        }
        let prepacked = call.attr_i("weight_prepacked", 0)?;
        if prepacked != 0 {
            unsupported!("{op}: weight_prepacked={prepacked} (an execution-provider-specific layout)");
        }
        let (k, n, bits, block) = (k as usize, n as usize, bits as usize, block as usize);
        let k_blocks = k.div_ceil(block);
        let blob = block * bits / 8;

        let a = call.input(0)?;
        let dtype = a.dtype()?;
        if !is_float(dtype) {
            unsupported!("{op}: A of dtype {dtype} (float32, float16 and bfloat16 are)");
        }
        let a_shape = a.shape()?;
        if a_shape.last() != Some(&k) {
            bail!("{op}: the last dimension of A {a_shape:?} must be K = {k}");
        }
        let m = a_shape[..a_shape.len() - 1].iter().product();
        let mut out_shape = a_shape.clone();
        *out_shape.last_mut().unwrap() = n;

        let b = call.input(1)?;
        if b.dtype()? != DType::U8 {
            bail!("{op}: B must be uint8, got {}", b.dtype()?);
        }
        let b_shape = b.shape()?;
        let want = [n, k_blocks, blob];
        let omitted =
            b_shape.len() == 3 && b_shape.contains(&0) && (0..3).all(|i| b_shape[i] == 0 || b_shape[i] == want[i]);
        if b_shape != want && !omitted {
            bail!("{op}: B has shape {b_shape:?}, expected {want:?} (N, ceil(K / block_size), block_size·bits/8)");
        }

        let scales = call.input(2)?;
        if scales.dtype()? != dtype {
            bail!("{op}: scales must have A's dtype {dtype}, got {}", scales.dtype()?);
        }
        let s_shape = scales.shape()?;
        if !omitted && !is_1d_or_2d(&s_shape, n, k_blocks) {
            bail!("{op}: scales has shape {s_shape:?}, expected [{n}, {k_blocks}]");
        }

        let zp = match call.input_opt(3) {
            None => Zp::Default,
            Some(z) => {
                let zd = z.dtype()?;
                let zs = z.shape()?;
                if zd == DType::U8 {
                    let per_row = (k_blocks * bits).div_ceil(8);
                    if !omitted && !is_1d_or_2d(&zs, n, per_row) {
                        bail!("{op}: uint8 zero_points has shape {zs:?}, expected [{n}, {per_row}]");
                    }
                    Zp::Packed
                } else if zd == dtype {
                    if !omitted && !is_1d_or_2d(&zs, n, k_blocks) {
                        bail!("{op}: zero_points has shape {zs:?}, expected [{n}, {k_blocks}]");
                    }
                    Zp::Float
                } else {
                    bail!("{op}: zero_points must be uint8 or A's dtype {dtype}, got {zd}");
                }
            }
        };

        let g_idx = match call.input_opt(4) {
            None => false,
            Some(g) => {
                if g.dtype()? != DType::I32 {
                    bail!("{op}: g_idx must be int32, got {}", g.dtype()?);
                }
                let gs = g.shape()?;
                if !omitted && gs != [k] && gs != [k_blocks * block] {
                    bail!("{op}: g_idx has shape {gs:?}, expected [{k}] or [{}]", k_blocks * block);
                }
                if !omitted && bits != 4 {
                    unsupported!("{op}: g_idx with {bits}-bit weights (onnxruntime implements g_idx for 4 bits)");
                }
                if !omitted && zp == Zp::Packed {
                    unsupported!(
                        "{op}: g_idx with uint8 zero_points (onnxruntime's CPU kernel disagrees with its documentation)"
                    );
                }
                true
            }
        };

        let bias = match call.input_opt(5) {
            None => false,
            Some(bt) => {
                if bt.dtype()? != dtype {
                    bail!("{op}: bias must have A's dtype {dtype}, got {}", bt.dtype()?);
                }
                if bt.shape()? != [n] {
                    bail!("{op}: bias has shape {:?}, expected [{n}]", bt.shape()?);
                }
                true
            }
        };

        // Clamped to 0..=4, as onnxruntime's MatMulNBits reads it.
        let accuracy_level = call.attr_i("accuracy_level", 0)?.clamp(0, 4) as u8;
        Ok(MnbPlan { dtype, k, n, bits, block, k_blocks, blob, m, out_shape, zp, g_idx, bias, omitted, accuracy_level })
    }

    fn run(&self, call: &Call) -> Result<()> {
        let (m, n, k) = (self.m, self.n, self.k);
        let y = call.output(0)?;
        let bias: Vec<f32> = match self.bias {
            true => call.input(5)?.read_vec()?,
            false => vec![0.0; n],
        };
        if m * n == 0 {
            return Ok(());
        }
        if self.omitted || k == 0 {
            let out: Vec<f64> = (0..m).flat_map(|_| bias.iter().map(|&b| b as f64)).collect();
            return y.write_vec(&out);
        }
        if !self.g_idx && matches!(self.dtype, DType::F32 | DType::F16 | DType::BF16) && matches!(self.bits, 2 | 4 | 8)
        {
            // The host's block-quantized product (ABI.md §4.9): B never enters the shim, and
            // the output columns share the CPU's cores.
            let at = |t: &Tensor| TensorAt { handle: t.handle(), offset: 0 };
            return qgemm(&QGemm {
                dtype: self.dtype,
                m: m as u64,
                n: n as u64,
                k: k as u64,
                bits: self.bits as u32,
                block: self.block as u64,
                a: at(&call.input(0)?),
                b: at(&call.input(1)?),
                scales: at(&call.input(2)?),
                zero_points: match self.zp {
                    Zp::Default => QZeroPoints::Default,
                    Zp::Packed => QZeroPoints::Packed(at(&call.input(3)?)),
                    Zp::Float => QZeroPoints::Float(at(&call.input(3)?)),
                },
                bias: if self.bias { Some(at(&call.input(5)?)) } else { None },
                y: at(&y),
                accuracy_level: self.accuracy_level,
            });
        }
        let a: Vec<f32> = call.input(0)?.read_vec()?;
        let b = call.input(1)?.read_bytes()?;
        let scales: Vec<f32> = call.input(2)?.read_vec()?;
        let zp_u8 = match self.zp {
            Zp::Packed => call.input(3)?.read_bytes()?,
            _ => Vec::new(),
        };
        let zp_f: Vec<f32> = match self.zp {
            Zp::Float => call.input(3)?.read_vec()?,
            _ => Vec::new(),
        };
        let g_idx: Vec<i32> = match self.g_idx {
            true => call.input(4)?.read_vec()?,
            false => Vec::new(),
        };
        if let Some((i, g)) = g_idx.iter().take(k).enumerate().find(|(_, &g)| g < 0 || g as usize >= self.k_blocks) {
            bail!("MatMulNBits: g_idx[{i}] = {g} is outside [0, {})", self.k_blocks);
        }

        let (kb, bits, bs) = (self.k_blocks, self.bits, self.block);
        let zp_row = (kb * bits).div_ceil(8);
        let default_zp = (1u32 << (bits - 1)) as f32;
        // Zero point of block `j` of row `r`.
        let zero = |r: usize, j: usize| -> f32 {
            match self.zp {
                Zp::Default => default_zp,
                Zp::Packed => unpack(&zp_u8[r * zp_row..(r + 1) * zp_row], j, bits) as f32,
                Zp::Float => zp_f[r * kb + j],
            }
        };

        let mut out = vec![0f64; m * n];
        // Whole blocks (the padding of a partial last one is dequantized and never used).
        let mut w = vec![0f32; kb * bs];
        for r in 0..n {
            let row = &b[r * kb * self.blob..(r + 1) * kb * self.blob];
            if self.g_idx {
                for (i, wi) in w[..k].iter_mut().enumerate() {
                    let g = g_idx[i] as usize;
                    let q = unpack(row, i, bits) as f32;
                    *wi = (q - zero(r, g)) * scales[r * kb + g];
                }
            } else {
                for j in 0..kb {
                    let blob = &row[j * self.blob..(j + 1) * self.blob];
                    dequant_block(blob, bits, scales[r * kb + j], zero(r, j), &mut w[j * bs..(j + 1) * bs]);
                }
            }
            for i in 0..m {
                out[i * n + r] = dot(&a[i * k..(i + 1) * k], &w[..k]) + bias[r] as f64;
            }
        }
        y.write_vec(&out)
    }
}

impl MnbPlan {
    /// GPU plan. Up to [`GEMV_MAX_M`] rows of A (decode): `kiln_mnb_gemv<Tag>`, one warp per output
    /// column reading each packed weight word once, dequantizing in registers, f32 sums, bias
    /// fused. More rows (prefill): the weights dequantized once into a scratch N × K matrix of
    /// A's dtype (`kiln_mnb_dequant<Tag>`), then one GEMM `Y = A · Wᵀ + bias`; when that matrix
    /// would be over [`DEQUANT_SCRATCH_MAX`] bytes, the GEMV kernel over tiles of 8 rows.
    fn dispatch(&self, call: &Call) -> Result<()> {
        const OP: &str = "MatMulNBits";
        let tag = tag(OP, self.dtype)?;
        let (m, n, k) = (self.m, self.n, self.k);
        let y = call.output(0)?;
        if m * n == 0 {
            return Ok(());
        }
        let bias_arg = match call.input_opt(5) {
            Some(b) => tensor(&b),
            None => tensor(&y), // Not read (has_bias = 0).
        };
        if self.omitted || k == 0 {
            return launch(&Launch {
                kernel: &kernel_name("kiln_mnb_fill", &[tag]),
                grid: [grid_for(m * n), 1, 1],
                block: [BLOCK, 1, 1],
                shared_mem_bytes: 0,
                args: vec![bias_arg, tensor(&y), KernelArg::U64((m * n) as u64), u32_arg(OP, "N", n)?, flag(self.bias)],
            });
        }
        let (a, b, scales) = (call.input(0)?, call.input(1)?, call.input(2)?);
        // Absent optional tensors are passed as another tensor of the call, never read.
        let (zp_kind, zp_u8, zp_f) = match self.zp {
            Zp::Default => (0, tensor(&b), tensor(&scales)),
            Zp::Packed => (1, tensor(&call.input(3)?), tensor(&scales)),
            Zp::Float => (2, tensor(&b), tensor(&call.input(3)?)),
        };
        let g_idx = match self.g_idx {
            true => tensor(&call.input(4)?),
            false => tensor(&b),
        };
        let zp_row = (self.k_blocks * self.bits).div_ceil(8);
        let quant = [
            u32_arg(OP, "block_size", self.block)?,
            u32_arg(OP, "bits", self.bits)?,
            u32_arg(OP, "K blocks", self.k_blocks)?,
            KernelArg::U32(zp_kind),
            u32_arg(OP, "zero point row", zp_row)?,
            flag(self.g_idx),
        ];
        u32_arg(OP, "packed row bits", self.k_blocks * self.block * self.bits)?;
        let (n32, k32) = (u32_arg(OP, "N", n)?, u32_arg(OP, "K", k)?);
        let size = self.dtype.size().unwrap_or(4);
        let w_bytes = n as u64 * k as u64 * size as u64;

        if m > GEMV_MAX_M && w_bytes <= DEQUANT_SCRATCH_MAX {
            let w = scratch(w_bytes)?;
            let mut args =
                vec![tensor(&b), tensor(&scales), zp_u8, zp_f, g_idx, KernelArg::Tensor { handle: w, offset: 0 }];
            args.extend([n32, k32]);
            args.extend(quant);
            launch(&Launch {
                kernel: &kernel_name("kiln_mnb_dequant", &[tag]),
                grid: [grid_for(n * k), 1, 1],
                block: [BLOCK, 1, 1],
                shared_mem_bytes: 0,
                args,
            })?;
            let op = |handle: u32, ld: usize| Operand { handle, offset: 0, ld: ld as u64, batch_stride: 0 };
            return gemm(&Gemm {
                dtype: self.dtype,
                trans_a: false,
                trans_b: true,
                m: m as u64,
                n: n as u64,
                k: k as u64,
                batch: 1,
                alpha: 1.0,
                beta: 0.0,
                a: op(a.handle(), k),
                b: op(w, k),
                c: None,
                d: op(y.handle(), n),
                bias: call.input_opt(5).map(|t| op(t.handle(), n)),
                epilogue: Epilogue::None,
            });
        }

        let tiles = m.div_ceil(8);
        if tiles > 65535 {
            unsupported!("{OP}: {m} rows of A with a weight matrix too large to dequantize");
        }
        let warps = 8u32;
        let mut args = vec![tensor(&a), tensor(&b), tensor(&scales), zp_u8, zp_f, g_idx, bias_arg, tensor(&y)];
        args.extend([KernelArg::U64(m as u64), n32, k32]);
        args.extend(quant);
        args.push(flag(self.bias));
        launch(&Launch {
            kernel: &kernel_name("kiln_mnb_gemv", &[tag]),
            grid: [n.div_ceil(warps as usize) as u32, tiles as u32, 1],
            block: [32 * warps, 1, 1],
            shared_mem_bytes: 0,
            args,
        })
    }
}

/// Most rows of A for the GEMV plan of MatMulNBits (one tile of accumulators).
const GEMV_MAX_M: usize = 8;
/// Largest dequantized weight matrix of the GEMM plan, bytes.
const DEQUANT_SCRATCH_MAX: u64 = 512 << 20;

fn flag(b: bool) -> KernelArg {
    KernelArg::U32(b as u32)
}

/// Dequantizes one whole block: `w[j] = (q_j − z) · s`, `w.len()` = block_size.
fn dequant_block(blob: &[u8], bits: usize, s: f32, z: f32, w: &mut [f32]) {
    #[cfg(target_arch = "wasm32")]
    if bits == 4 || bits == 8 {
        return simd::dequant_block(blob, bits, s, z, w);
    }
    let lut: Vec<f32> = (0..1u32 << bits).map(|q| (q as f32 - z) * s).collect();
    for (j, wi) in w.iter_mut().enumerate() {
        *wi = lut[unpack(blob, j, bits) as usize];
    }
}

/// `Σ a[i]·w[i]`: f32 products summed in f32 lanes per chunk of 64, chunks summed in f64.
fn dot(a: &[f32], w: &[f32]) -> f64 {
    const CHUNK: usize = 64;
    let mut total = 0f64;
    let mut ac = a.chunks_exact(CHUNK);
    let mut wc = w.chunks_exact(CHUNK);
    for (x, y) in (&mut ac).zip(&mut wc) {
        total += dot64(x, y);
    }
    for (&x, &y) in ac.remainder().iter().zip(wc.remainder()) {
        total += (x * y) as f64;
    }
    total
}

#[cfg(not(target_arch = "wasm32"))]
fn dot64(x: &[f32], y: &[f32]) -> f64 {
    let mut lanes = [0f32; 16];
    for (x16, y16) in x.chunks_exact(16).zip(y.chunks_exact(16)) {
        for l in 0..16 {
            lanes[l] += x16[l] * y16[l];
        }
    }
    lanes.iter().map(|&v| v as f64).sum()
}

#[cfg(target_arch = "wasm32")]
use simd::dot64;

/// 128-bit SIMD (wasm `simd128`, on by default in wasmtime) for the two inner loops.
#[cfg(target_arch = "wasm32")]
mod simd {
    use core::arch::wasm32::*;

    /// `Σ x[i]·y[i]` over 64 elements in 16 f32 lanes, the lanes summed in f64.
    #[target_feature(enable = "simd128")]
    pub fn dot64(x: &[f32], y: &[f32]) -> f64 {
        assert!(x.len() == 64 && y.len() == 64);
        let (xp, yp) = (x.as_ptr() as *const v128, y.as_ptr() as *const v128);
        let mut acc = [f32x4_splat(0.0); 4];
        for i in 0..4 {
            for (l, a) in acc.iter_mut().enumerate() {
                // SAFETY: 4·4 + 4 < 16 vectors of 4 lanes = 64 elements, checked above;
                // wasm loads need no alignment.
                let (xv, yv) = unsafe { (v128_load(xp.add(i * 4 + l)), v128_load(yp.add(i * 4 + l))) };
                *a = f32x4_add(*a, f32x4_mul(xv, yv));
            }
        }
        let s = f32x4_add(f32x4_add(acc[0], acc[1]), f32x4_add(acc[2], acc[3]));
        f32x4_extract_lane::<0>(s) as f64
            + f32x4_extract_lane::<1>(s) as f64
            + f32x4_extract_lane::<2>(s) as f64
            + f32x4_extract_lane::<3>(s) as f64
    }

    /// `w[j] = (q_j − z) · s` for a whole block of 4- or 8-bit values (block_size >= 16).
    #[target_feature(enable = "simd128")]
    pub fn dequant_block(blob: &[u8], bits: usize, s: f32, z: f32, w: &mut [f32]) {
        let (sv, zv) = (f32x4_splat(s), f32x4_splat(z));
        if bits == 4 {
            // 8 bytes -> 16 values, low nibble first.
            for (i, b8) in blob.chunks_exact(8).enumerate() {
                // SAFETY: `b8` holds 8 bytes; wasm loads need no alignment.
                let bytes = unsafe { v128_load64_zero(b8.as_ptr() as *const u64) };
                let lo = v128_and(bytes, u8x16_splat(15));
                let hi = u8x16_shr(bytes, 4);
                let q = u8x16_shuffle::<0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23>(lo, hi);
                put(&mut w[i * 16..i * 16 + 16], q, zv, sv);
            }
        } else {
            for (i, b16) in blob.chunks_exact(16).enumerate() {
                // SAFETY: `b16` holds 16 bytes.
                let q = unsafe { v128_load(b16.as_ptr() as *const v128) };
                put(&mut w[i * 16..i * 16 + 16], q, zv, sv);
            }
        }
    }

    /// `w[j] = (q_j − z) · s` for the 16 u8 lanes of `q`.
    #[target_feature(enable = "simd128")]
    fn put(w: &mut [f32], q: v128, zv: v128, sv: v128) {
        let (h0, h1) = (u16x8_extend_low_u8x16(q), u16x8_extend_high_u8x16(q));
        let parts = [
            u32x4_extend_low_u16x8(h0),
            u32x4_extend_high_u16x8(h0),
            u32x4_extend_low_u16x8(h1),
            u32x4_extend_high_u16x8(h1),
        ];
        for (p, chunk) in parts.iter().zip(w.chunks_exact_mut(4)) {
            let v = f32x4_mul(f32x4_sub(f32x4_convert_i32x4(*p), zv), sv);
            // SAFETY: `chunk` holds 4 f32; wasm stores need no alignment.
            unsafe { v128_store(chunk.as_mut_ptr() as *mut v128, v) };
        }
    }
}

// ---------------------------------------------------------------------------------------
// GatherBlockQuantized

/// Row `idx` of a table of `rows` (negative counting from the end); `None` out of range.
fn gathered_row(idx: i64, rows: usize) -> Option<usize> {
    let g = rows as i64;
    match idx {
        i if (0..g).contains(&i) => Some(i as usize),
        i if (-g..0).contains(&i) => Some((i + g) as usize),
        _ => None,
    }
}

struct GbqPlan {
    /// Output dtype (scales').
    dtype: DType,
    bits: usize,
    block: usize,
    quantize_axis: usize,
    /// `data`'s logical shape (the last dimension unpacked).
    logical: Vec<usize>,
    out_shape: Vec<usize>,
    zero_points: bool,
}

impl GbqPlan {
    fn new(call: &Call) -> Result<GbqPlan> {
        let op = "GatherBlockQuantized";
        let data = call.input(0)?;
        let dd = data.dtype()?;
        if dd != DType::U8 {
            unsupported!(
                "{op}: data of dtype {dd} (uint8 is implemented; int4/uint4/float8/float4 have no kiln dtype)"
            );
        }
        let indices = call.input(1)?;
        if !matches!(indices.dtype()?, DType::I32 | DType::I64) {
            bail!("{op}: indices must be int32 or int64, got {}", indices.dtype()?);
        }
        let scales = call.input(2)?;
        let dtype = scales.dtype()?;
        if !is_float(dtype) {
            bail!("{op}: scales must be float32, float16 or bfloat16, got {dtype}");
        }
        let bits = call.attr_i("bits", 4)?;
        if !matches!(bits, 2 | 4 | 8) {
            bail!("{op}: bits must be 2, 4 or 8 for uint8 data, got {bits}");
        }
        let block = call.attr_i("block_size", 128)?;
        if block < 16 || block & (block - 1) != 0 {
            bail!("{op}: block_size must be a power of two >= 16 for uint8 data, got {block}");
        }
        let (bits, block) = (bits as usize, block as usize);
        let shape = data.shape()?;
        let r = shape.len();
        if r == 0 {
            bail!("{op}: data must have rank >= 1");
        }
        let gather_axis = shape::normalize_axis(call.attr_i("gather_axis", 0)?, r)?;
        let quantize_axis = shape::normalize_axis(call.attr_i("quantize_axis", 1)?, r)?;
        if gather_axis != 0 {
            bail!("{op}: gather_axis must be 0 for uint8 data, got {gather_axis}");
        }
        let comps = 8 / bits;
        if comps > 1 {
            if quantize_axis == gather_axis {
                bail!("{op}: gather_axis and quantize_axis must differ for {bits}-bit data");
            }
            if quantize_axis != r - 1 {
                unsupported!("{op}: {bits}-bit data packed along the last axis, quantized along axis {quantize_axis}");
            }
        }
        let mut logical = shape.clone();
        logical[r - 1] *= comps;

        let s_shape = scales.shape()?;
        let mut want = logical.clone();
        want[quantize_axis] = logical[quantize_axis].div_ceil(block);
        if s_shape != want {
            bail!("{op}: scales has shape {s_shape:?}, expected {want:?}");
        }
        let zero_points = match call.input_opt(3) {
            None => false,
            Some(z) => {
                if z.dtype()? != DType::U8 {
                    bail!("{op}: zero_points must have data's dtype uint8, got {}", z.dtype()?);
                }
                let mut zwant = want.clone();
                zwant[quantize_axis] = want[quantize_axis].div_ceil(comps);
                if z.shape()? != zwant {
                    bail!("{op}: zero_points has shape {:?}, expected {zwant:?}", z.shape()?);
                }
                true
            }
        };

        let mut out_shape = indices.shape()?;
        out_shape.extend_from_slice(&logical[1..]);
        Ok(GbqPlan { dtype, bits, block, quantize_axis, logical, out_shape, zero_points })
    }

    /// GPU plan: `kiln_gbq<Tag>`, one thread per output element (grid-stride).
    fn dispatch(&self, call: &Call) -> Result<()> {
        const OP: &str = "GatherBlockQuantized";
        let tag = tag(OP, self.dtype)?;
        let y = call.output(0)?;
        let total = y.numel()?;
        let row_len: usize = self.logical[1..].iter().product();
        if total == 0 || row_len == 0 {
            return Ok(());
        }
        let (data, indices, scales) = (call.input(0)?, call.input(1)?, call.input(2)?);
        let qa = self.quantize_axis;
        let q_dim = self.logical[qa];
        let q_inner: usize = self.logical[qa + 1..].iter().product();
        let zp = match call.input_opt(3) {
            Some(z) => tensor(&z),
            None => tensor(&data), // Not read (has_zp = 0).
        };
        launch(&Launch {
            kernel: &kernel_name("kiln_gbq", &[tag]),
            grid: [grid_for(total), 1, 1],
            block: [BLOCK, 1, 1],
            shared_mem_bytes: 0,
            args: vec![
                tensor(&data),
                tensor(&indices),
                tensor(&scales),
                zp,
                tensor(&y),
                KernelArg::U64(total as u64),
                KernelArg::U64(self.logical[0] as u64),
                KernelArg::U64(row_len as u64),
                KernelArg::U64(q_dim as u64),
                KernelArg::U64(q_inner as u64),
                KernelArg::U64(q_dim.div_ceil(self.block) as u64),
                u32_arg(OP, "block_size", self.block)?,
                u32_arg(OP, "bits", self.bits)?,
                flag(self.zero_points),
                flag(indices.dtype()? == DType::I64),
            ],
        })
    }

    /// Writes the f32 results as the output's dtype (scales', rounded once).
    fn write(&self, call: &Call, out: &[f32]) -> Result<()> {
        let y = call.output(0)?;
        match self.dtype {
            DType::F16 => y.write_vec(&out.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>()),
            DType::BF16 => y.write_vec(&out.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>()),
            _ => y.write_vec(out),
        }
    }

    /// Quantized along the last axis (an embedding table): reads only the gathered rows of data,
    /// scales and zero points, the same values as [`GbqPlan::run`] computes.
    fn run_rows(&self, call: &Call) -> Result<()> {
        let (data, scales_t) = (call.input(0)?, call.input(2)?);
        let indices = call.input(1)?.read_i64s()?;
        let zp_t = if self.zero_points { Some(call.input(3)?) } else { None };
        let bits = self.bits;
        let comps = 8 / bits;
        let mask = ((1u16 << bits) - 1) as u8;
        let rows = self.logical[0];
        let last = self.logical.len() - 1;
        let q_dim = self.logical[last];
        let sub_rows: usize = self.logical[1..last].iter().product();
        let row_len = sub_rows * q_dim;
        let q_blocks = q_dim.div_ceil(self.block);
        let zp_row = if comps > 1 { q_blocks.div_ceil(comps) } else { q_blocks };
        let default_zp = 1i32 << (bits - 1);
        let mut out = vec![0f32; indices.len() * row_len];
        for (o, &idx) in out.chunks_exact_mut(row_len.max(1)).zip(&indices) {
            // Out of range: zeros (onnxruntime's documented behaviour).
            let Some(row) = gathered_row(idx, rows) else { continue };
            let d = data.read_bytes_range(row * row_len / comps, row_len / comps)?;
            let sc: Vec<f32> = scales_t.read_vec_range(row * sub_rows * q_blocks, sub_rows * q_blocks)?;
            let zp = match &zp_t {
                Some(t) => t.read_bytes_range(row * sub_rows * zp_row, sub_rows * zp_row)?,
                None => Vec::new(),
            };
            for (i, v) in o.iter_mut().enumerate() {
                let q = ((d[i / comps] >> ((i % comps) * bits)) & mask) as i32;
                let (sr, blk) = (i / q_dim, (i % q_dim) / self.block);
                let zp_val = match (&zp_t, comps > 1) {
                    (None, _) => default_zp,
                    (Some(_), true) => ((zp[sr * zp_row + blk / comps] >> ((blk % comps) * bits)) & mask) as i32,
                    (Some(_), false) => zp[sr * zp_row + blk] as i32,
                };
                *v = (q - zp_val) as f32 * sc[sr * q_blocks + blk];
            }
        }
        self.write(call, &out)
    }

    fn run(&self, call: &Call) -> Result<()> {
        if self.logical.len() >= 2 && self.quantize_axis + 1 == self.logical.len() {
            return self.run_rows(call);
        }
        let data = call.input(0)?.read_bytes()?;
        let indices = call.input(1)?.read_i64s()?;
        let scales: Vec<f32> = call.input(2)?.read_vec()?;
        let zp = match self.zero_points {
            true => call.input(3)?.read_bytes()?,
            false => Vec::new(),
        };
        let bits = self.bits;
        let comps = 8 / bits;
        let mask = ((1u16 << bits) - 1) as u8;
        let rows = self.logical[0];
        let row_len: usize = self.logical[1..].iter().product();
        let qa = self.quantize_axis;
        let q_dim = self.logical[qa];
        let q_inner: usize = self.logical[qa + 1..].iter().product();
        let q_blocks = q_dim.div_ceil(self.block);
        let zp_row = q_blocks.div_ceil(comps);
        let default_zp = 1i32 << (bits - 1);

        let mut out = vec![0f32; indices.len() * row_len];
        for (o, &idx) in out.chunks_exact_mut(row_len.max(1)).zip(&indices) {
            // Out of range: zeros (onnxruntime's documented behaviour).
            let Some(row) = gathered_row(idx, rows) else { continue };
            for (e, v) in o.iter_mut().enumerate() {
                let i = row * row_len + e;
                let q = ((data[i / comps] >> ((i % comps) * bits)) & mask) as i32;
                let x = i / (q_dim * q_inner);
                let y = (i / q_inner) % q_dim;
                let z = i % q_inner;
                let s = (x * q_blocks + y / self.block) * q_inner + z;
                let zp_val = if !self.zero_points {
                    default_zp
                } else if comps > 1 {
                    // quantize_axis is the last: `s` = row · q_blocks + block.
                    let (zr, zb) = (s / q_blocks, s % q_blocks);
                    ((zp[zr * zp_row + zb / comps] >> ((zb % comps) * bits)) & mask) as i32
                } else {
                    zp[s] as i32
                };
                *v = (q - zp_val) as f32 * scales[s];
            }
        }
        self.write(call, &out)
    }
}
