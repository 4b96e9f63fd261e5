//! kiln's linear layers over a weight stored `[N, K]` (K contiguous, as `torch.nn.Linear` keeps
//! it; the decode fusions of `kernel.toml` transpose ONNX's `[K, N]` MatMul weights once at
//! load):
//!
//! - `ai.kiln::Linear(X [..., K], W [N, K], scales?, bias? [N])` → `Y [..., N]`, `Y = X · Wᵀ +
//!   bias` (`torch.nn.functional.linear`; the `linear-bias` fusion's MatMul and Add: the product
//!   and the bias are summed in f32 and rounded once, where the ops it replaces round the
//!   product first). On the GPU a bias is cuBLASLt's bias epilogue (prefill) or
//!   `kiln_linear_bias` after a decode GEMV; it cannot be combined with `swiglu`;
//! - `ai.kiln::RmsNormLinear(X [..., K], skip?, gamma [K], W [N, K])` → `Y [..., N]`,
//!   `sum [..., K]?`: onnxruntime's SkipSimplifiedLayerNormalization (or, without `skip`,
//!   SimplifiedLayerNormalization over the last axis) followed by the MatMul that reads its
//!   output: `s = X + skip`, `A = s / sqrt(mean(s²) + epsilon) · gamma`, `Y = A · Wᵀ`, and `sum`
//!   (SkipSimplifiedLayerNormalization's `input_skip_bias_sum`) is `s`. `skip` has X's shape or a
//!   suffix of it (added to every leading index, as onnxruntime allows `[sequence, hidden]`).
//!   Attribute `epsilon`: default 1e-12 with `skip` and 1e-5 without, the defaults of the two ops
//!   it replaces; `axis` (must be -1 or X's last axis) and `stash_type` are accepted so that a
//!   SimplifiedLayerNormalization's attributes carry over;
//! - `ai.kiln::SwiGluLinear(GU [..., 2F], W [N, F])` → `Y [..., N]`: `A = SiLU(gate) · up` of
//!   each row's gate half then up half (kiln-unary's packed SwiGlu), `Y = A · Wᵀ`, with A
//!   computed as the ops it replaces compute it: `Sigmoid(gate)`, `gate · that` and `· up`,
//!   each rounded to the dtype (the verify of `skip-rmsnorm-mlp` and `skip-rmsnorm-mlp-nbits`,
//!   whose `swiglu` epilogue below computes the same, hold the fused ops to those three
//!   roundings; rounding once differs by an ulp, which the down projection's sum magnifies where
//!   it cancels).
//!
//! Attribute `swiglu` (each op; 0 by default): 1 makes the output SwiGLU of the product,
//! `Y [..., N / 2] = SiLU(P[..., :N/2]) · P[..., N/2:]` with `P = A · Wᵀ` rounded to the dtype
//! (W's rows: the gate projection's, then the up projection's), computed as the Sigmoid, Mul and
//! Mul it replaces compute it, each rounded to the dtype (the `skip-rmsnorm-mlp` and
//! `skip-rmsnorm-mlp-nbits` fusions' `RmsNormLinear`, whose down projection is then a plain
//! `Linear`). N must be even. The GPU computes it in the decode GEMVs' epilogue for
//! `RmsNormLinear` (gate row `j` and up row `N / 2 + j` in one warp or tensor-core tile, dense or
//! quantized, so that SiLU runs once per output instead of in every block of the down
//! projection's prologue); elsewhere (prefill, `Linear`, `SwiGluLinear`) P goes to scratch and
//! `kiln_linear_swiglu` follows.
//!
//! Each op also takes its weight in onnxruntime's MatMulNBits layout (the `*-nbits` fusions of
//! `kernel.toml` replace MatMulNBits without zero points, g_idx or bias): `W` is then uint8
//! `[N, k_blocks, block_size · bits / 8]` followed by one more input, `scales` (X's dtype,
//! `N · k_blocks` values, `[N, k_blocks]` or flat), and row `n`'s value `k` dequantizes to
//! `(q − 2^(bits − 1)) · scales[n, k / block_size]`, with `q` the `bits` of its byte from the low
//! ones (MatMulNBits' default zero point). Attribute `accuracy_level` (default 0, clamped to 0..=4) is
//! MatMulNBits' (the fusions carry it over): at 4 the CPU's `qgemm` may quantize A's blocks to
//! int8 as onnxruntime's CPU provider does (ABI.md §6.6); the GPU computes in f32 at every
//! level. Attributes `bits` (2, 4 or 8) and `block_size` (a
//! power of two ≥ 16), as MatMulNBits names them (the fusions set both), must fit the shapes:
//! `k_blocks = ceil(K / block_size)`, `blob = block_size · bits / 8`; without them the shapes
//! must fit exactly one such pair. The CPU takes the product through the
//! host's `qgemm` (as kiln-quant's MatMulNBits). The GPU runs decode's rows as one kernel for 4- and
//! 8-bit weights whose block and K are multiples of a 16-byte chunk's values (32 or 16), up to
//! [`Q_MAX_ROWS`] rows whose A fits a block's 48 KiB of shared memory (at least one row of K ≤
//! 12,288): 4-bit float16 and bfloat16 from [`Q4_MMA_MIN_ROWS`] rows on tensor cores
//! (`kiln_linear_q4mma`: nibbles dequantized exactly into mma fragments, each 32-value chunk's sum
//! scaled once in f32), the rest on CUDA cores (`kiln_linear_qgemv`: a 16-byte load per chunk, f32
//! accumulation); other weights and more rows dequantize the weight into scratch
//! (`kiln_linear_dequant`) for cuBLASLt.
//!
//! All operands share one dtype: float32, float16, bfloat16 (and float64 on the CPU). `A` is
//! rounded to that dtype before the product, as the unfused graph stores it, so the fused op
//! computes what the ops it replaces compute. The CPU reference computes `A` in f64 and rounds
//! it and `sum` once each (over a MatMulNBits weight, float32's SiLU(gate)·up, of SwiGluLinear's
//! prologue or of the `swiglu` epilogue, in f32 as kiln-unary's SwiGlu computes it, within a few
//! ulp); its product goes through the host's `gemm` (f32 accumulation, as on
//! the GPU; float64 sums in f64); the CUDA kernels compute in f32 (`cuda/linear.cu`).
//!
//! On the GPU, decode's few rows run as one kernel that computes `A` in its prologue: float16 and
//! bfloat16 from 2 to [`MMA_MAX_ROWS`] rows on tensor cores (`kiln_linear_mma`, the weight as
//! the M side of the mma), one row and float32 up to [`GEMV_MAX_ROWS`] rows on CUDA cores
//! (`kiln_linear_gemv`); more rows (prefill) write `A` to scratch and call cuBLASLt with
//! `transB`.

use alloc::string::ToString;
use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, unsupported};

/// Most rows (product of X's leading dimensions) that take the GEMV kernel. On an H200 at 8 rows
/// (bench/RESULTS.md, 2026-12-02) the GEMV's CUDA-core arithmetic and its per-block prologue cost
/// more than a prologue kernel plus cuBLASLt; at 1 row it is well ahead.
pub const GEMV_MAX_ROWS: usize = 4;
/// Most rows of A one GEMV block holds in shared memory: its kernels come for 1, 2 and 4.
const GEMV_BLOCK_ROWS: usize = 4;
/// Warps per GEMV block (`LIN_WARPS`).
const GEMV_WARPS: usize = 8;
/// Warps per block of the 4- and 8-bit CUDA-core GEMV (`LIN_QWARPS`); each holds `LIN_COLS`
/// weight rows (one output's gate and up rows under the `swiglu` epilogue).
/// Fewer warps a block spread the small projections over more SMs, but on an H100 the int4 decode
/// step at batch 1 took 0.642 ms at 4 and 0.814 at 2 against 0.575 at 8 (bench/RESULTS.md,
/// session 42): the kernel waits on latency, and 8 warps hide more of it.
const Q_GEMV_WARPS: usize = 8;
/// Outputs (weight rows) per GEMV warp (`LIN_COLS`).
const GEMV_COLS_PER_WARP: usize = 2;
/// Most GEMV column blocks; larger N loops inside the blocks (the LM head's 49,152 outputs: in
/// SmolLM2-135M the only GEMV past the cap; a larger model's layer GEMVs past 4,224 outputs
/// loop too, not measured).
/// Two a streaming multiprocessor of a 132-SM H100 or H200: on an H100, one call, the fp16 decode
/// step at batch 1 took 0.502 ms at 264 against 0.506 at 1,024 and 0.513 at 4,096 (one block per
/// 16 outputs), the int4 step 0.569 against 0.576 and 0.581 (bench/RESULTS.md, session 37).
const GEMV_MAX_BLOCKS: usize = 264;
/// Shared memory a GEMV block may use for A (the portable per-block limit).
const GEMV_MAX_SHARED: usize = 48 * 1024;
/// Rows (float16, bfloat16) that take the tensor-core GEMV `kiln_linear_mma<tag, MODE, NT>`, NT
/// n-tiles of 8 rows each.
const MMA_MIN_ROWS: usize = 2;
pub const MMA_MAX_ROWS: usize = 16;
/// Warps per tensor-core GEMV block (linear.cu's `MMA_WARPS`); each holds a tile of 16 weight
/// rows: 16 outputs, or the gate and up rows of 8 under the `swiglu` epilogue.
const MMA_WARPS: usize = 8;
/// Blocks the tensor-core GEMV aims for (about an H200's 132 SMs): a block holds fewer tiles,
/// with its warps splitting K, until the grid has this many blocks or one tile per block.
const MMA_MIN_BLOCKS: usize = 128;

/// Most rows the 4- and 8-bit CUDA-core GEMV takes (`kiln_linear_qgemv`, up to [`Q_BLOCK_ROWS`]
/// per block); more go to the dequantized weight and cuBLASLt.
pub const Q_MAX_ROWS: usize = 16;
/// Most rows of A one quantized GEMV block holds: its kernels come for 1, 2, 4 and 8.
const Q_BLOCK_ROWS: usize = 8;
/// Fewest rows (float16, bfloat16) that take the 4-bit tensor-core GEMV
/// `kiln_linear_q4mma<tag, MODE, NT>` (up to [`MMA_MAX_ROWS`]); one row takes `kiln_linear_qgemv`.
const Q4_MMA_MIN_ROWS: usize = 2;

/// A weight in MatMulNBits' block-quantized layout (see the module docs).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Quant {
    bits: u32,
    block: usize,
    k_blocks: usize,
}

impl Quant {
    /// The layout of a MatMulNBits weight `[n, k_blocks, blob]` for K = `k`: `bits` and
    /// `block_size` as the node gives them (the `*-nbits` fusions set both), checked against the
    /// shapes (`k_blocks = ceil(k / block_size)`, `blob = block_size · bits / 8`); where the node
    /// gives neither, the one pair of a power-of-two block ≥ 16 and bits ∈ {2, 4, 8} that fits
    /// the shapes. Errors: a given pair that does not fit, or shapes that fit no pair or more than
    /// one (one block per row of at most half a block), each naming the shapes.
    fn of(op: &str, k: usize, k_blocks: usize, blob: usize, given: Option<(i64, i64)>) -> Result<Quant> {
        let fits = |bits: usize, block: usize| {
            k > 0 && k.div_ceil(block) == k_blocks && block.checked_mul(bits) == blob.checked_mul(8)
        };
        if let Some((bits, block)) = given {
            // usize::try_from: the shim's usize is 32 bits, and a block past it must not wrap to 0.
            let size = usize::try_from(block).ok().filter(|&b| b >= 16 && b.is_power_of_two());
            match size.filter(|&b| matches!(bits, 2 | 4 | 8) && fits(bits as usize, b)) {
                Some(block) => return Ok(Quant { bits: bits as u32, block, k_blocks }),
                None => bail!(
                    "{op}: bits {bits} and block_size {block} do not fit W [N, {k_blocks}, {blob}] for K = {k} (k_blocks = ceil(K / block_size), blob = block_size · bits / 8; bits 2, 4 or 8, block_size a power of two ≥ 16)"
                ),
            }
        }
        let mut found = Vec::new();
        let mut block = 16usize;
        while block <= k.saturating_mul(2).max(16) {
            for bits in [2usize, 4, 8] {
                if fits(bits, block) {
                    found.push(Quant { bits: bits as u32, block, k_blocks });
                }
            }
            block = match block.checked_mul(2) {
                Some(b) => b,
                None => break,
            };
        }
        match found.as_slice() {
            [q] => Ok(*q),
            [] => bail!(
                "{op}: W [N, {k_blocks}, {blob}] is not MatMulNBits' [N, ceil(K / block_size), block_size · bits / 8] for K = {k} (block_size a power of two ≥ 16, bits 2, 4 or 8)"
            ),
            _ => bail!(
                "{op}: W [N, {k_blocks}, {blob}] fits more than one bits / block_size pair for K = {k}: give the node `bits` and `block_size`"
            ),
        }
    }
}

/// What the product's left operand A is made of (the `MODE` of `kiln_linear_gemv<tag, MODE, R>`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Prologue {
    Linear,
    RmsNorm,
    SwiGlu,
}

impl Prologue {
    /// The kernels' MODE template argument (linear.cu's enumerators).
    fn kernel_mode(self) -> &'static str {
        match self {
            Prologue::Linear => "LIN_LINEAR",
            Prologue::RmsNorm => "LIN_RMSNORM",
            Prologue::SwiGlu => "LIN_SWIGLU",
        }
    }
}

/// One call's geometry: `rows` rows of A, each `k` wide, against W `[n, k]`.
struct Geometry {
    prologue: Prologue,
    dtype: DType,
    rows: usize,
    k: usize,
    n: usize,
    y_shape: Vec<usize>,
    x_shape: Vec<usize>,
    /// Elements of `skip` (RmsNormLinear with skip), else 0.
    skip_len: usize,
    eps: f32,
    /// A MatMulNBits weight (uint8 W, then `scales`), else `None` (W `[N, K]` of X's dtype).
    quant: Option<Quant>,
    /// The index of W among the inputs.
    w_index: usize,
    /// The output is SwiGLU of the product's halves (attribute `swiglu`), `[..., n / 2]`.
    swiglu: bool,
    /// The input index of Linear's `bias` `[N]` when given.
    bias: Option<usize>,
    /// MatMulNBits' `accuracy_level` (clamped to 0..=4; the `*-nbits` fusions carry it over), passed to the
    /// host's `qgemm`: at 4 the CPU may quantize A's blocks to int8 (ABI.md §6.6).
    accuracy_level: u8,
}

fn op_prologue(op: &str) -> Result<Prologue> {
    Ok(match op {
        "Linear" => Prologue::Linear,
        "RmsNormLinear" => Prologue::RmsNorm,
        "SwiGluLinear" => Prologue::SwiGlu,
        other => unsupported!("kiln-matmul does not implement ai.kiln::{other}"),
    })
}

fn geometry(call: &Call) -> Result<Geometry> {
    let op = call.op_type();
    let prologue = op_prologue(op)?;
    let w_index = if prologue == Prologue::RmsNorm { 3 } else { 1 };
    let dense_inputs = w_index + 1;
    // Linear's optional bias follows the scales' place (empty for a weight of X's dtype).
    let most = if prologue == Prologue::Linear { dense_inputs + 2 } else { dense_inputs + 1 };
    if call.num_inputs() < dense_inputs || call.num_inputs() > most {
        bail!(
            "{op}: takes {dense_inputs} inputs (W of X's dtype), {} (a MatMulNBits weight and its scales){}, the node has {}",
            dense_inputs + 1,
            if prologue == Prologue::Linear { ", then an optional bias" } else { "" },
            call.num_inputs()
        );
    }
    let max_outputs = if prologue == Prologue::RmsNorm { 2 } else { 1 };
    if call.num_outputs() > max_outputs {
        bail!("{op}: has at most {max_outputs} outputs, the node has {}", call.num_outputs());
    }
    let x = call.input(0)?;
    let dtype = x.dtype()?;
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::F64) {
        unsupported!("{op}: dtype {dtype} is not supported (float32, float16, bfloat16, float64)");
    }
    let same = |i: usize, what: &str| -> Result<Vec<usize>> {
        let t = call.input(i)?;
        let d = t.dtype()?;
        if d != dtype {
            bail!("{op}: {what} is {d} but X is {dtype}");
        }
        t.shape()
    };
    let x_shape = x.shape()?;
    let Some(&last) = x_shape.last() else { bail!("{op}: X must have rank ≥ 1, not a scalar") };
    let quantized = call.input_opt(w_index + 1).is_some();
    let (n, k, quant) = if quantized {
        let wt = call.input(w_index)?;
        let (wd, w) = (wt.dtype()?, wt.shape()?);
        if wd != DType::U8 || w.len() != 3 {
            bail!("{op}: with scales, W must be MatMulNBits' uint8 [N, k_blocks, blob], got {wd} {w:?}");
        }
        if dtype == DType::F64 {
            unsupported!("{op}: a MatMulNBits weight takes float32, float16 or bfloat16 X, not float64");
        }
        let k = if prologue == Prologue::SwiGlu { last / 2 } else { last };
        if prologue == Prologue::SwiGlu && last % 2 != 0 {
            bail!("{op}: X's last dimension {last} is not [gate | up] of two halves");
        }
        let given = match (call.attr_i("bits", 0)?, call.attr_i("block_size", 0)?) {
            (0, 0) => None,
            (bits, block) => Some((bits, block)),
        };
        let q = Quant::of(op, k, w[1], w[2], given)?;
        let sc = same(w_index + 1, "scales")?;
        let numel = sc.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if numel != w[0].checked_mul(q.k_blocks) {
            bail!("{op}: scales {sc:?} must hold N · k_blocks = {} · {} values", w[0], q.k_blocks);
        }
        (w[0], k, Some(q))
    } else {
        let w = same(w_index, "W")?;
        if w.len() != 2 {
            bail!("{op}: W must be a matrix [N, K], got shape {w:?}");
        }
        let want = if prologue == Prologue::SwiGlu { w[1].checked_mul(2) } else { Some(w[1]) };
        let Some(want) = want else { bail!("{op}: W {w:?} is too large") };
        if last != want {
            bail!("{op}: X's last dimension is {last}, W {w:?} needs {want}");
        }
        (w[0], w[1], None)
    };
    let swiglu = match call.attr_i("swiglu", 0)? {
        0 => false,
        1 if n % 2 == 0 => true,
        1 => bail!("{op}: swiglu = 1 needs W's N = {n} rows as [gate | up] halves, an even count"),
        v => bail!("{op}: swiglu must be 0 or 1, got {v}"),
    };
    let bias = match call.input_opt(w_index + 2) {
        None => None,
        Some(_) => {
            let b = same(w_index + 2, "bias")?;
            if b != [n] || swiglu {
                bail!("{op}: bias must be [{n}] (N) without swiglu, got {b:?}");
            }
            Some(w_index + 2)
        }
    };
    let rows = x_shape[..x_shape.len() - 1].iter().product();
    let mut y_shape = x_shape.clone();
    *y_shape.last_mut().unwrap_or(&mut 0) = if swiglu { n / 2 } else { n };
    let mut skip_len = 0;
    let mut eps = 0.0;
    if prologue == Prologue::RmsNorm {
        if let Some(skip) = call.input_opt(1) {
            // X's shape, or a suffix of it that ends in K (leading 1s allowed): each row adds
            // whole rows of skip.
            let s = same(1, "skip")?;
            let core = &s[s.iter().take_while(|&&d| d == 1).count()..];
            if core.is_empty() || s.len() > x_shape.len() || !x_shape.ends_with(core) {
                bail!("{op}: skip of shape {s:?} must have X's shape {x_shape:?} or a suffix of it that ends in K");
            }
            skip_len = skip.numel()?;
        }
        let g = same(2, "gamma")?;
        if g != [k] {
            bail!("{op}: gamma must be [{k}], got {g:?}");
        }
        let axis = call.attr_i("axis", -1)?;
        if axis != -1 && axis != x_shape.len() as i64 - 1 {
            unsupported!("{op}: normalises the last axis only, not axis {axis}");
        }
        let default = if skip_len > 0 { 1e-12 } else { 1e-5 };
        eps = call.attr_f("epsilon", default)?;
        if eps.is_nan() || eps < 0.0 {
            bail!("{op}: epsilon must not be negative, got {eps}");
        }
    }
    // Clamped to 0..=4, as onnxruntime's MatMulNBits reads it.
    let accuracy_level = call.attr_i("accuracy_level", 0)?.clamp(0, 4) as u8;
    Ok(Geometry {
        prologue,
        dtype,
        rows,
        k,
        n,
        y_shape,
        x_shape,
        skip_len,
        eps,
        quant,
        w_index,
        swiglu,
        bias,
        accuracy_level,
    })
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let g = geometry(call)?;
    let mut out = alloc::vec![TensorType::new(g.dtype, g.y_shape)];
    if g.prologue == Prologue::RmsNorm {
        out.push(TensorType::new(g.dtype, g.x_shape));
    }
    Ok(out)
}

/// SiLU(g)·u as Sigmoid, Mul and Mul compute it, `round` after the first two.
fn silu_mul(g: f64, u: f64, round: impl Fn(f64) -> f64) -> f64 {
    let s = if g >= 0.0 {
        1.0 / (1.0 + libm::exp(-g))
    } else {
        let e = libm::exp(g);
        e / (1.0 + e)
    };
    round(round(g * round(s)) * u)
}

/// SiLU(g)·u in f32, g / (1 + e^−g) · u, branch-free so that its loop vectorizes: kiln-unary's
/// float32 SwiGlu, within a few ulp of the f64 [`silu_mul`] (its e^−g through
/// `kiln_kernel_abi::math::exp_f32`, within 2 ulp).
#[inline]
fn silu_mul_f32(g: f32, u: f32) -> f32 {
    g / (1.0 + kiln_kernel_abi::math::exp_f32(-g)) * u
}

/// Each row of `x` (rows of `2 · half` values: gate, then up) as SiLU(gate)·up in f32
/// ([`silu_mul_f32`]), `[rows, half]`.
fn swiglu_rows_f32(x: &[f32], half: usize) -> Vec<f32> {
    if half == 0 {
        return Vec::new();
    }
    let mut y = Vec::with_capacity(x.len() / 2);
    for row in x.chunks_exact(2 * half) {
        let (gate, up) = row.split_at(half);
        y.extend(gate.iter().zip(up).map(|(&gv, &uv)| silu_mul_f32(gv, uv)));
    }
    y
}

/// The `swiglu` output of the product `p` `[rows, n]` (values as the dtype stores them):
/// each row's `SiLU(gate) · up` of its halves, `[rows, n / 2]`.
fn swiglu_rows(p: &[f64], n: usize, round: impl Fn(f64) -> f64) -> Vec<f64> {
    if n == 0 {
        return Vec::new();
    }
    let mut y = Vec::with_capacity(p.len() / 2);
    for row in p.chunks_exact(n) {
        let (gate, up) = row.split_at(n / 2);
        y.extend(gate.iter().zip(up).map(|(&g, &u)| silu_mul(g, u, &round)));
    }
    y
}

/// `sqrt(mean(row²) + eps)` of one row of `s`, in f64.
fn rms(row: &[f64], eps: f32) -> f64 {
    libm::sqrt(row.iter().map(|v| v * v).sum::<f64>() / row.len() as f64 + eps as f64)
}

/// A `[rows, k]` in f64, not yet rounded (`round` rounds the values the unfused ops would
/// store on the way), and, for RmsNorm, `s = X + skip`.
fn operand_a(call: &Call, g: &Geometry, round: impl Fn(f64) -> f64) -> Result<(Vec<f64>, Vec<f64>)> {
    let x = call.input(0)?.read_vec::<f64>()?;
    match g.prologue {
        Prologue::Linear => Ok((x, Vec::new())),
        Prologue::SwiGlu => {
            let mut a = Vec::with_capacity(g.rows * g.k);
            for r in 0..g.rows {
                let row = &x[r * 2 * g.k..(r + 1) * 2 * g.k];
                a.extend((0..g.k).map(|c| silu_mul(row[c], row[g.k + c], &round)));
            }
            Ok((a, Vec::new()))
        }
        Prologue::RmsNorm => {
            let skip = match call.input_opt(1) {
                Some(t) => t.read_vec::<f64>()?,
                None => Vec::new(),
            };
            let gamma = call.input(2)?.read_vec::<f64>()?;
            let mut s = x;
            if !skip.is_empty() {
                for (i, v) in s.iter_mut().enumerate() {
                    *v += skip[i % skip.len()];
                }
            }
            let mut a = s.clone();
            for r in 0..g.rows {
                let row = &mut a[r * g.k..(r + 1) * g.k];
                let rms = rms(row, g.eps);
                for (c, v) in row.iter_mut().enumerate() {
                    *v = *v / rms * gamma[c];
                }
            }
            Ok((a, s))
        }
    }
}

/// [`operand_a`]'s RmsNorm for float32 X, rounded as `cpu` rounds it: `A` and (with `sum`) `s`
/// as float32, from the same f64 arithmetic (`s = X + skip` unrounded in f64 within a row, its
/// mean square and each `s / rms · gamma` in f64, each result rounded once to f32).
fn rmsnorm_f32(call: &Call, g: &Geometry, sum: bool) -> Result<(Vec<f32>, Vec<f32>)> {
    let x: Vec<f32> = call.input(0)?.read_vec()?;
    let skip: Option<Vec<f32>> = call.input_opt(1).map(|t| t.read_vec()).transpose()?.filter(|v| !v.is_empty());
    let gamma: Vec<f32> = call.input(2)?.read_vec()?;
    let k = g.k;
    let (mut a, mut s) = (Vec::with_capacity(g.rows * k), Vec::with_capacity(if sum { g.rows * k } else { 0 }));
    let mut row = vec![0f64; k];
    for r in 0..g.rows {
        for (c, v) in row.iter_mut().enumerate() {
            let i = r * k + c;
            *v = x[i] as f64 + skip.as_ref().map_or(0.0, |sk| sk[i % sk.len()] as f64);
        }
        if sum {
            s.extend(row.iter().map(|&v| v as f32));
        }
        let rms = rms(&row, g.eps);
        a.extend(row.iter().zip(&gamma).map(|(&v, &gm)| (v / rms * gm as f64) as f32));
    }
    Ok((a, s))
}

pub fn cpu(call: &Call) -> Result<()> {
    let g = geometry(call)?;
    // A as the unfused graph stores it: rounded to the dtype.
    let round = |v: f64| -> f64 {
        match g.dtype {
            DType::F32 => <f32 as Element>::from_f64(v) as f64,
            DType::F16 => <f16 as Element>::from_f64(v).to_f64(),
            DType::BF16 => <bf16 as Element>::from_f64(v).to_f64(),
            _ => v,
        }
    };
    let w_input = call.input(g.w_index)?;
    let bias = bias_handle(call, &g)?;
    if g.dtype != DType::F64 && g.rows > 0 && g.n > 0 && g.k > 0 {
        // The product's destination: Y, or (swiglu) P in scratch, read back for the SwiGLU.
        let p_bytes = g.rows as u64 * g.n as u64 * g.dtype.size().unwrap_or(4) as u64;
        let p = if g.swiglu { scratch(p_bytes)? } else { call.output(0)?.handle() };
        // The product through the host's gemm or qgemm (W stays out of the shim): A is X
        // itself, or the prologue's result in scratch.
        let a = match g.prologue {
            Prologue::Linear => call.input(0)?.handle(),
            Prologue::SwiGlu if g.dtype == DType::F32 && g.quant.is_some() => {
                // Over a MatMulNBits weight, float32 in f32 as kiln-unary's SwiGlu computes it (a
                // loop that vectorizes; its gate-up-swiglu fusion took these graphs before): each
                // row's SiLU(gate)·up.
                let x: Vec<f32> = call.input(0)?.read_vec()?;
                scratch_from(&element::encode_as(DType::F32, &swiglu_rows_f32(&x, g.k))?)?
            }
            Prologue::RmsNorm if g.dtype == DType::F32 => {
                // float32: the same values as `operand_a` and its rounding, without f64 copies
                // of X, skip, gamma and the sum (a decode step's serial work on the CPU).
                let (a, s) = rmsnorm_f32(call, &g, call.output_opt(1).is_some())?;
                if let Some(sum) = call.output_opt(1) {
                    sum.write_vec(&s)?;
                }
                scratch_from(&element::encode_as(DType::F32, &a)?)?
            }
            _ => {
                let (a, s) = operand_a(call, &g, round)?;
                if let Some(sum) = call.output_opt(1) {
                    sum.write_vec(&s)?;
                }
                scratch_from(&element::encode_as(g.dtype, &a)?)?
            }
        };
        let (rows, n, k) = (g.rows as u64, g.n as u64, g.k as u64);
        if let Some(q) = g.quant {
            let at = |handle: u32| TensorAt { handle, offset: 0 };
            qgemm(&QGemm {
                dtype: g.dtype,
                m: rows,
                n,
                k,
                bits: q.bits,
                block: q.block as u64,
                a: at(a),
                b: at(w_input.handle()),
                scales: at(call.input(g.w_index + 1)?.handle()),
                zero_points: QZeroPoints::Default,
                bias: bias.map(at),
                y: at(p),
                accuracy_level: g.accuracy_level,
            })?;
        } else {
            gemm_transposed(g.dtype, (rows, n, k), a, w_input.handle(), bias, p)?;
        }
        if g.swiglu {
            let Ok(len) = usize::try_from(p_bytes) else {
                bail!("{}: the product's {p_bytes} bytes do not fit the shim's memory", call.op_type())
            };
            let mut bytes = alloc::vec![0u8; len];
            read_handle(p, 0, &mut bytes)?;
            if g.dtype == DType::F32 && g.quant.is_some() {
                // Over a MatMulNBits weight, float32 in f32 as SwiGluLinear's prologue above (the
                // `skip-rmsnorm-mlp-nbits` fusion's int4 CPU prefill: millions of values).
                let product = element::decode_as::<f32>(DType::F32, &bytes)?;
                call.output(0)?.write_vec(&swiglu_rows_f32(&product, g.n / 2))?;
            } else {
                let product = element::decode_as::<f64>(g.dtype, &bytes)?;
                call.output(0)?.write_vec(&swiglu_rows(&product, g.n, round))?;
            }
        }
        return Ok(());
    }
    let (a, s) = operand_a(call, &g, round)?;
    if g.quant.is_some() {
        // An empty product (no rows, no outputs or K = 0): zeros (their SwiGLU too), and the sum.
        call.output(0)?.write_vec(&alloc::vec![0f64; g.rows * g.y_shape.last().copied().unwrap_or(0)])?;
        if let Some(sum) = call.output_opt(1) {
            sum.write_vec(&s)?;
        }
        return Ok(());
    }
    let w = w_input.read_vec::<f64>()?;
    let b = match g.bias {
        Some(i) => call.input(i)?.read_vec::<f64>()?,
        None => alloc::vec![0f64; g.n],
    };
    let a: Vec<f64> = a.into_iter().map(round).collect();
    let mut y = alloc::vec![0f64; g.rows * g.n];
    for r in 0..g.rows {
        let ar = &a[r * g.k..(r + 1) * g.k];
        for (c, out) in y[r * g.n..(r + 1) * g.n].iter_mut().enumerate() {
            let wr = &w[c * g.k..(c + 1) * g.k];
            *out = ar.iter().zip(wr).map(|(x, w)| x * w).sum::<f64>() + b[c];
        }
    }
    if g.swiglu {
        let stored: Vec<f64> = y.into_iter().map(round).collect();
        y = swiglu_rows(&stored, g.n, round);
    }
    call.output(0)?.write_vec(&y)?;
    if let Some(sum) = call.output_opt(1) {
        sum.write_vec(&s)?;
    }
    Ok(())
}

/// The kernels' template argument for `dtype`: the prelude's tag of a dtype kernel.toml
/// instantiates them for (float32, float16, bfloat16).
fn kernel_tag(op: &str, dtype: DType) -> Result<&'static str> {
    match (dtype, dtype.cuda_tag()) {
        (DType::F32 | DType::F16 | DType::BF16, Some(tag)) => Ok(tag),
        _ => unsupported!("{op}: no CUDA kernel for {dtype}"),
    }
}

fn at(handle: u32) -> KernelArg {
    KernelArg::Tensor { handle, offset: 0 }
}

pub fn dispatch(call: &Call) -> Result<()> {
    let g = geometry(call)?;
    let tag = kernel_tag(call.op_type(), g.dtype)?;
    let y = call.output(0)?.handle();
    // The SwiGLU epilogue inside the decode GEMV kernels (RmsNormLinear), else the product into
    // scratch and kiln_linear_swiglu after it. Without rows or outputs there is no product (a
    // sum output is still written).
    if !g.swiglu || g.rows == 0 || g.n == 0 {
        return product(call, &g, tag, y, false);
    }
    if g.prologue == Prologue::RmsNorm && decode_kernel(&g).is_some() {
        return product(call, &g, tag, y, true);
    }
    let p = scratch(g.rows as u64 * g.n as u64 * g.dtype.size().unwrap_or(4) as u64)?;
    product(call, &g, tag, p, false)?;
    launch_swiglu(tag, p, y, g.rows as u64, (g.n / 2) as u64)
}

/// Launches `kiln_linear_swiglu`: `a [rows, half]` = SiLU(gate) · up of `gu [rows, 2·half]`'s
/// halves, rounded as Sigmoid, Mul and Mul round.
fn launch_swiglu(tag: &str, gu: u32, a: u32, rows: u64, half: u64) -> Result<()> {
    launch(&Launch {
        kernel: &kernel_name("kiln_linear_swiglu", &[tag]),
        grid: grid_stride(rows * half),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args: alloc::vec![at(gu), at(a), KernelArg::U64(rows), KernelArg::U64(half)],
    })
}

/// The decode kernel a call takes, `None` for the prefill path:
/// - a weight of X's dtype: the tensor-core GEMV `kiln_linear_mma` (float16 and bfloat16,
///   [`MMA_MIN_ROWS`] to [`MMA_MAX_ROWS`] rows, A within a block's shared memory) or the CUDA-core
///   `kiln_linear_gemv` (up to [`GEMV_MAX_ROWS`] rows, or any at K = 0: it writes an empty
///   product's zeros);
/// - a 4- or 8-bit weight (whole 16-byte chunks of 128 / bits values in every block and row): the
///   4-bit tensor-core `kiln_linear_q4mma` ([`Q4_MMA_MIN_ROWS`] to [`MMA_MAX_ROWS`] rows of float16
///   or bfloat16) or the CUDA-core `kiln_linear_qgemv` (up to [`Q_MAX_ROWS`] rows, the most per
///   block of 8, 4, 2, 1 whose A fits the shared memory).
enum DecodeKernel {
    Mma { n_tiles: u64, shared: u64 },
    Gemv { block_rows: usize, shared: u64 },
}

fn decode_kernel(g: &Geometry) -> Option<DecodeKernel> {
    let vec = 16 / g.dtype.size().unwrap_or(4);
    if !g.k.is_multiple_of(vec) || g.n == 0 {
        return None;
    }
    let (shared, n_tiles) = mma_shared(g);
    if let Some(q) = g.quant {
        let chunk = 128 / q.bits as usize;
        if !matches!(q.bits, 4 | 8) || !q.block.is_multiple_of(chunk) || !g.k.is_multiple_of(chunk) {
            return None;
        }
        if q.bits == 4 && tensor_cores(g, Q4_MMA_MIN_ROWS) && shared <= GEMV_MAX_SHARED as u64 {
            return Some(DecodeKernel::Mma { n_tiles, shared });
        }
        let mut block_rows = g.rows.next_power_of_two().min(Q_BLOCK_ROWS);
        while block_rows > 1 && g.rows.min(block_rows) as u64 * g.k as u64 * 4 > GEMV_MAX_SHARED as u64 {
            block_rows /= 2;
        }
        let shared = g.rows.min(block_rows) as u64 * g.k as u64 * 4;
        return (g.rows <= Q_MAX_ROWS && shared <= GEMV_MAX_SHARED as u64)
            .then_some(DecodeKernel::Gemv { block_rows, shared });
    }
    if tensor_cores(g, MMA_MIN_ROWS) && g.k > 0 && shared <= GEMV_MAX_SHARED as u64 {
        return Some(DecodeKernel::Mma { n_tiles, shared });
    }
    // Rows per block: the smallest kernel that holds them all, else GEMV_BLOCK_ROWS per block; A
    // in f32 in shared memory (u64: the shim's usize is 32 bits).
    let block_rows = g.rows.next_power_of_two().min(GEMV_BLOCK_ROWS);
    let shared = g.rows.min(block_rows) as u64 * g.k as u64 * 4;
    ((g.rows <= GEMV_MAX_ROWS || g.k == 0) && shared <= GEMV_MAX_SHARED as u64)
        .then_some(DecodeKernel::Gemv { block_rows, shared })
}

/// Whether the rows take a tensor-core GEMV from `min_rows` rows (float16, bfloat16).
fn tensor_cores(g: &Geometry, min_rows: usize) -> bool {
    matches!(g.dtype, DType::F16 | DType::BF16) && (min_rows..=MMA_MAX_ROWS).contains(&g.rows) && g.n > 0
}

/// The tensor-core GEMVs' shared memory and n-tiles of 8 rows: A in the storage type, 8·NT rows
/// of K rounded up to 64; the split-K partial sums reuse it.
fn mma_shared(g: &Geometry) -> (u64, u64) {
    let vec = 16 / g.dtype.size().unwrap_or(4);
    let n_tiles = g.rows.div_ceil(8) as u64;
    ((8 * n_tiles * ((g.k / vec).div_ceil(8) as u64 * 8) * 16).max(MMA_WARPS as u64 * n_tiles * 512), n_tiles)
}

/// The GEMV kernels' MODE: the prologue's, or `LIN_RMSNORM_SWIGLU` with the epilogue (only
/// RmsNormLinear takes it: [`dispatch`]).
fn kernel_mode(g: &Geometry, epilogue: bool) -> &'static str {
    if epilogue {
        "LIN_RMSNORM_SWIGLU"
    } else {
        g.prologue.kernel_mode()
    }
}

/// The product (and the sum output) into `y`: Y, or scratch for the SwiGLU after it. With
/// `epilogue`, Y through the GEMV kernels' SwiGLU epilogue (`LIN_RMSNORM_SWIGLU`: the caller
/// checked that [`decode_kernel`] takes the call).
fn product(call: &Call, g: &Geometry, tag: &str, y: u32, epilogue: bool) -> Result<()> {
    debug_assert!(!epilogue || decode_kernel(g).is_some());
    let x = call.input(0)?.handle();
    let sum = call.output_opt(1).map(|t| t.handle());
    let (skip, gamma) = match g.prologue {
        Prologue::RmsNorm => (call.input_opt(1).map(|t| t.handle()), Some(call.input(2)?.handle())),
        _ => (None, None),
    };
    let w_input = call.input(g.w_index)?;
    let w = w_input.handle();
    // W_CONST: W (and a quantized W's scales) constant for the session (ABI.md §7.7), so the
    // kernels load their first weights before the grid-dependency wait.
    let w_const = w_input.is_constant() && (g.quant.is_none() || call.input(g.w_index + 1)?.is_constant());
    let flags = skip.is_some() as u32 | (sum.is_some() as u32) << 1 | (w_const as u32) << 2;
    if g.rows == 0 || g.n == 0 && sum.is_none() {
        return Ok(());
    }
    let tail = [
        at(y),
        at(sum.unwrap_or(y)),
        KernelArg::U64(g.rows as u64),
        KernelArg::U64(g.n as u64),
        KernelArg::U64(g.k as u64),
        KernelArg::U64(g.skip_len.max(1) as u64),
        KernelArg::U32(flags),
        KernelArg::F32(g.eps),
    ];
    let mut operands = alloc::vec![at(x), at(skip.unwrap_or(x)), at(gamma.unwrap_or(x)), at(w)];
    // A quantized W's scales follow it; its layout's k_blocks and block close the arguments.
    let (mma, gemv, bits) = match g.quant {
        Some(q) => {
            operands.push(at(call.input(g.w_index + 1)?.handle()));
            ("kiln_linear_q4mma", "kiln_linear_qgemv", Some(q.bits.to_string()))
        }
        None => ("kiln_linear_mma", "kiln_linear_gemv", None),
    };
    operands.extend(tail);
    if let Some(q) = g.quant {
        operands.extend([KernelArg::U32(q.k_blocks as u32), KernelArg::U32(q.block as u32)]);
    }
    let Some(decode) = decode_kernel(g) else { return prefill(call, g, tag, y, skip, gamma, flags) };
    launch_decode(g, tag, epilogue, decode, bits.as_deref(), (mma, gemv), operands)?;
    match bias_handle(call, g)? {
        // The bias in place after the decode GEMV (prefill adds it in cuBLASLt's epilogue).
        Some(b) => launch(&Launch {
            kernel: &kernel_name("kiln_linear_bias", &[tag]),
            grid: grid_stride(g.rows as u64 * g.n as u64),
            block: [GRID_STRIDE_BLOCK, 1, 1],
            shared_mem_bytes: 0,
            args: alloc::vec![at(y), at(b), KernelArg::U64(g.rows as u64), KernelArg::U64(g.n as u64)],
        }),
        None => Ok(()),
    }
}

/// Linear's bias tensor, when the node has one.
fn bias_handle(call: &Call, g: &Geometry) -> Result<Option<u32>> {
    g.bias.map(|i| call.input(i).map(|t| t.handle())).transpose()
}

/// Launches the decode kernel `decode` (`mma` / `gemv`: the tensor-core and CUDA-core kernel
/// names) with `operands`.
fn launch_decode(
    g: &Geometry,
    tag: &str,
    epilogue: bool,
    decode: DecodeKernel,
    bits: Option<&str>,
    (mma, gemv): (&str, &str),
    operands: Vec<KernelArg>,
) -> Result<()> {
    match decode {
        DecodeKernel::Mma { n_tiles, shared } => launch_mma(mma, tag, g, epilogue, n_tiles, shared, operands),
        DecodeKernel::Gemv { block_rows, shared } => {
            // GEMV_COLS_PER_WARP outputs per warp; under the epilogue a warp's two weight rows
            // are one output's gate and up.
            let warps = if bits.is_some() { Q_GEMV_WARPS } else { GEMV_WARPS };
            let per_block = if epilogue { warps } else { warps * GEMV_COLS_PER_WARP };
            let outputs = if epilogue { g.n / 2 } else { g.n };
            let rows = block_rows.to_string();
            let mut params = alloc::vec![tag, kernel_mode(g, epilogue), rows.as_str()];
            params.extend(bits);
            launch_gemv(
                gemv,
                &params,
                [outputs.div_ceil(per_block), g.rows.div_ceil(block_rows), warps],
                shared,
                operands,
            )
        }
    }
}

/// Launches tensor-core GEMV `kernel` (`kiln_linear_mma`, `kiln_linear_q4mma`) over `n_tiles`
/// n-tiles of 8 rows with `shared` bytes: blocks of [`MMA_WARPS`] warps hold fewer tiles of 16
/// weight rows (16 outputs, or with `epilogue` 8 outputs' gate and up rows), their warps splitting
/// K (the `ksplit` argument appended to `args`), until the grid has [`MMA_MIN_BLOCKS`] blocks or
/// one tile per block.
fn launch_mma(
    kernel: &str,
    tag: &str,
    g: &Geometry,
    epilogue: bool,
    n_tiles: u64,
    shared: u64,
    mut args: Vec<KernelArg>,
) -> Result<()> {
    // 16 weight rows per tile: 16 outputs, or (the SwiGLU epilogue) the gate and up rows of 8.
    let tiles = if epilogue { (g.n / 2).div_ceil(8) } else { g.n.div_ceil(16) };
    let mut per_block = MMA_WARPS;
    while per_block > 1 && tiles.div_ceil(per_block) < MMA_MIN_BLOCKS {
        per_block /= 2;
    }
    args.push(KernelArg::U32((MMA_WARPS / per_block) as u32));
    launch(&Launch {
        kernel: &kernel_name(kernel, &[tag, kernel_mode(g, epilogue), &n_tiles.to_string()]),
        grid: [tiles.div_ceil(per_block) as u32, 1, 1],
        block: [(MMA_WARPS * 32) as u32, 1, 1],
        shared_mem_bytes: shared as u32,
        args,
    })
}

/// Launches CUDA-core GEMV `kernel` (`kiln_linear_gemv`, `kiln_linear_qgemv`) with template
/// arguments `params` over `column_blocks` blocks of outputs (at most `GEMV_MAX_BLOCKS`, which then
/// loop) and `row_blocks` blocks of rows, `warps` warps a block (the kernel's `LIN_WARPS` or
/// `LIN_QWARPS`), `shared` bytes of A.
fn launch_gemv(
    kernel: &str,
    params: &[&str],
    [column_blocks, row_blocks, warps]: [usize; 3],
    shared: u64,
    args: Vec<KernelArg>,
) -> Result<()> {
    launch(&Launch {
        kernel: &kernel_name(kernel, params),
        grid: [column_blocks.min(GEMV_MAX_BLOCKS) as u32, row_blocks as u32, 1],
        block: [(warps * 32) as u32, 1, 1],
        shared_mem_bytes: shared as u32,
        args,
    })
}

/// Many rows (or a weight the GEMVs do not take): A into scratch (or X itself), a quantized W
/// dequantized into scratch, then cuBLASLt.
fn prefill(
    call: &Call,
    g: &Geometry,
    tag: &str,
    y: u32,
    skip: Option<u32>,
    gamma: Option<u32>,
    flags: u32,
) -> Result<()> {
    let esize = g.dtype.size().unwrap_or(4);
    let x = call.input(0)?.handle();
    let sum = call.output_opt(1).map(|t| t.handle());
    let mut w = call.input(g.w_index)?.handle();
    let (rows, k) = (g.rows as u64, g.k as u64);
    let a = match g.prologue {
        Prologue::Linear => x,
        Prologue::RmsNorm => {
            let a = scratch(rows * k * esize as u64)?;
            launch(&Launch {
                kernel: &kernel_name("kiln_linear_rmsnorm", &[tag]),
                grid: [rows.min(65535) as u32, 1, 1],
                block: [256, 1, 1],
                shared_mem_bytes: 0,
                args: alloc::vec![
                    at(x),
                    at(skip.unwrap_or(x)),
                    at(gamma.unwrap_or(x)),
                    at(a),
                    at(sum.unwrap_or(a)),
                    KernelArg::U64(rows),
                    KernelArg::U64(k),
                    KernelArg::U64(g.skip_len.max(1) as u64),
                    KernelArg::U32(flags),
                    KernelArg::F32(g.eps),
                ],
            })?;
            a
        }
        Prologue::SwiGlu => {
            let a = scratch(rows * k * esize as u64)?;
            launch_swiglu(tag, x, a, rows, k)?;
            a
        }
    };
    if g.n == 0 || k == 0 {
        // No output, or (with a norm's sum written above) nothing left: K = 0 with outputs took
        // the GEMV (a quantized weight has K > 0).
        return Ok(());
    }
    if let Some(q) = g.quant {
        let n = g.n as u64;
        let dense = scratch(n * k * esize as u64)?;
        launch(&Launch {
            kernel: &kernel_name("kiln_linear_dequant", &[tag]),
            grid: grid_stride(n * k),
            block: [GRID_STRIDE_BLOCK, 1, 1],
            shared_mem_bytes: 0,
            args: alloc::vec![
                at(w),
                at(call.input(g.w_index + 1)?.handle()),
                at(dense),
                KernelArg::U64(n),
                KernelArg::U64(k),
                KernelArg::U32(q.k_blocks as u32),
                KernelArg::U32(q.block as u32),
                KernelArg::U32(q.bits),
            ],
        })?;
        w = dense;
    }
    gemm_transposed(g.dtype, (rows, g.n as u64, k), a, w, bias_handle(call, g)?, y)
}

/// `Y [m, n] = A [m, k] · Wᵀ (+ bias [n])` with W stored `[n, k]`, through the host's `gemm`
/// (ABI.md §4.7: cuBLASLt with `transB` and its bias epilogue on the GPU, the host's
/// f32-accumulating gemm on the CPU).
fn gemm_transposed(dtype: DType, (m, n, k): (u64, u64, u64), a: u32, w: u32, bias: Option<u32>, y: u32) -> Result<()> {
    let operand = |handle: u32, ld: u64| Operand { handle, offset: 0, ld, batch_stride: 0 };
    gemm(&Gemm {
        dtype,
        trans_a: false,
        trans_b: true,
        m,
        n,
        k,
        batch: 1,
        alpha: 1.0,
        beta: 0.0,
        a: operand(a, k),
        b: operand(w, k),
        c: None,
        d: operand(y, n),
        bias: bias.map(|b| operand(b, n)),
        epilogue: Epilogue::None,
    })
}
