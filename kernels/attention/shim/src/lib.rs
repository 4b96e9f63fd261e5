//! Shim of `kiln-attention`: onnxruntime's `com.microsoft` GroupQueryAttention-1 and
//! RotaryEmbedding-1, following docs/ContribOperators.md and onnxruntime's CPU kernels
//! (`contrib_ops/cpu/bert/group_query_attention*`, `gqa_attention_base.h`,
//! `rotary_embedding*`), cross-checked against onnxruntime 1.32 on random inputs; and ONNX's
//! RotaryEmbedding-23, following ONNX Operators.md and its node tests.
//!
//! # GroupQueryAttention
//!
//! Inputs: `query` [B,S,N·H] (or packed QKV [B,S,(N+2·Nk)·H] when `key` and `value` are
//! absent), `key`/`value` [B,S,Nk·H], `past_key`/`past_value` [B,Nk,P,H], `seqlens_k` [B]
//! (int32, total valid length − 1 per batch row), `total_sequence_length` (int32 scalar, a
//! value input: the present length depends on it), `cos_cache`/`sin_cache` [M, R/2],
//! `attention_bias` (input 10) [B|1, N|1, S, total], `head_sink` (input 11) [N].
//!
//! * present length = max(total_sequence_length, P).
//! * The call is a *first prompt* when S = total_sequence_length: every row starts at
//!   position 0 and row b holds T_b = seqlens_k[b] + 1 ≤ S valid tokens (right padding).
//!   Otherwise row b had `past_b = T_b − S` cached tokens (S = 1 for batches of more than one
//!   row, as onnxruntime requires).
//! * The S new keys/values (rotated when `do_rotary`) go to present rows
//!   `past_b .. past_b + S`. Past and present share one buffer exactly when P ≥
//!   total_sequence_length (onnxruntime-genai's `past_present_share_buffer`): present is then
//!   the past buffer with those rows overwritten. Otherwise present holds past rows
//!   `0 .. past_b`, the new rows, and zeros elsewhere (onnxruntime's non-shared layout).
//! * Query row s sits at position `past_b + s` (also its rotary position) and attends to the
//!   keys `start .. min(past_b + s + 1, T_b)` with `start = max(0, past_b + s + 1 − W)` when
//!   `local_window_size` W ≥ 0; a row without keys (padding) outputs zeros.
//! * score = q·k · scale (scale 0 → 1/√H), then `softcap`·tanh(score/`softcap`) when
//!   softcap > 0, then + attention_bias. Softmax; with `smooth_softmax` = 1 or `head_sink`,
//!   the denominator gains exp(sink − max) (sink = head_sink[h], or 0).
//! * Query head h uses kv head h / (N / Nk).
//!
//! Not implemented (reported unsupported): `position_ids`, quantized caches (`k_scale`,
//! `v_scale`, `k_quant_type`/`v_quant_type` other than NONE, caches of another dtype),
//! `q_norm_weight`/`k_norm_weight`, `query_seqlens`, the `output_qk` output / `qk_output`,
//! `causal` = 0, `sliding_window_cache` = 1, and absent present outputs when a past is given.
//!
//! # RotaryEmbedding
//!
//! `input` [B,S,hidden] or [B,N,S,H], `position_ids` (int64: one element = start position p,
//! row s at p + s; or [B,S]), `cos_cache`/`sin_cache` [M, R/2]. Head size is
//! `hidden / num_heads` when `rotary_embedding_dim` is set, else 2·(cache width); the first R
//! elements of each head are rotated (interleaved pairs (2i, 2i+1), or halves (i, i + R/2)),
//! the rest copied. `scale` is accepted and, as in onnxruntime's kernels, unused.
//! `is_packed_batching` = 1 is unsupported.
//!
//! ONNX's RotaryEmbedding-23 rotates the same way with other inputs: `input` [B,N,S,H] (heads
//! and head size from its shape; `num_heads` ignored) or [B,S,hidden] with `num_heads`,
//! `cos_cache`, `sin_cache`, and optional `position_ids` [B,S]. With position_ids the caches are
//! [M, R/2]; without them [B, S, R/2], row s of batch row b at its own cache row. R is
//! `rotary_embedding_dim`, else the head size.
//!
//! The CPU reference computes in f64, except GroupQueryAttention on float32 tensors, which
//! computes in f32 as the GPU kernels do (its dot products, softmax and weighted sums are an
//! LLM decode step's CPU attention, and f64 made it several times slower); rotated Q and K are
//! rounded to the tensor dtype before the attention, as onnxruntime stores them.
//!
//! # Paged KV caches
//!
//! On the GPU `past_key`/`past_value` and `present_key`/`present_value` may come paged (ABI.md
//! §6.1.1, the manifest's `paged_inputs` and `paged_outputs`): the host's paged KV cache, whose
//! positions lie in pages shared by every layer of a row. A paged past needs present outputs of
//! the same layout and length (the buffer bound in place, which the host checks), and a paged
//! present such a past. The kernels address every K/V row through the layout (attention.cu's `gqa_layout`).
#![no_std]
extern crate alloc;

mod onnx_attention;

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::wire::MAX_COUNTERS;
use kiln_kernel_abi::{bail, export_shim, unsupported};
use onnx_attention::{ATTENTION, RESHAPED};

struct Attention;

const GQA: &str = "GroupQueryAttention";
const ROPE: &str = "RotaryEmbedding";

fn check_float(op: &str, what: &str, dtype: DType) -> Result<()> {
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        unsupported!("{op}: {what} has dtype {dtype}; float32, float16 and bfloat16 are supported");
    }
    Ok(())
}

/// A type the CPU references compute in: f64, or f32 where a reference says so.
trait Real:
    Element
    + core::ops::Add<Output = Self>
    + core::ops::Sub<Output = Self>
    + core::ops::Mul<Output = Self>
    + core::ops::Div<Output = Self>
    + core::ops::AddAssign
    + core::iter::Sum
{
    const ZERO: Self;
    const NEG_INFINITY: Self;
    fn exp(self) -> Self;
    fn tanh(self) -> Self;
    fn max(self, other: Self) -> Self;
    /// Rounds to the precision of `dtype` (f32, f16, bf16).
    fn round_to(self, dtype: DType) -> Self;
    fn to_f32(self) -> f32;
}

impl Real for f64 {
    const ZERO: f64 = 0.0;
    const NEG_INFINITY: f64 = f64::NEG_INFINITY;
    fn exp(self) -> f64 {
        libm::exp(self)
    }
    fn tanh(self) -> f64 {
        libm::tanh(self)
    }
    fn max(self, other: f64) -> f64 {
        f64::max(self, other)
    }
    fn round_to(self, dtype: DType) -> f64 {
        match dtype {
            DType::F16 => f16::from_f64(self).to_f64(),
            DType::BF16 => bf16::from_f64(self).to_f64(),
            _ => self as f32 as f64,
        }
    }
    fn to_f32(self) -> f32 {
        self as f32
    }
}

impl Real for f32 {
    const ZERO: f32 = 0.0;
    const NEG_INFINITY: f32 = f32::NEG_INFINITY;
    fn exp(self) -> f32 {
        // Branch-free, so softmax loops vectorize; within 2 ulp (the f64 reference checks it).
        kiln_kernel_abi::math::exp_f32(self)
    }
    fn tanh(self) -> f32 {
        libm::tanhf(self)
    }
    fn max(self, other: f32) -> f32 {
        // f32::max's result (the other operand where one is NaN) as a compare and a select,
        // where f32::max calls `fmaxf` for each of softmax's values.
        if other > self || self.is_nan() {
            other
        } else {
            self
        }
    }
    fn round_to(self, dtype: DType) -> f32 {
        match dtype {
            DType::F16 => f16::from_f32(self).to_f32(),
            DType::BF16 => bf16::from_f32(self).to_f32(),
            _ => self,
        }
    }
    fn to_f32(self) -> f32 {
        self
    }
}

/// Rotates `x` (one head, at least `2·half` elements) in place with the cache rows `cos`, `sin`.
fn rotate<T: Real>(x: &mut [T], cos: &[T], sin: &[T], interleaved: bool) {
    let half = cos.len();
    for i in 0..half {
        let (a_idx, b_idx) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
        let (a, b) = (x[a_idx], x[b_idx]);
        x[a_idx] = a * cos[i] - b * sin[i];
        x[b_idx] = a * sin[i] + b * cos[i];
    }
}

/// The cos/sin caches: `rows` positions of `half` values each, of which positions
/// `first..first + read` were read (the positions a call uses: a decode step at position 4,000
/// copies one row, not the 4,000 before it nor a table of 8,192).
struct Caches<T = f64> {
    cos: Vec<T>,
    sin: Vec<T>,
    rows: usize,
    first: usize,
    read: usize,
    half: usize,
}

impl<T: Real> Caches<T> {
    /// The caches' rows `positions` (as far as the caches reach; a position past them is refused
    /// by [`Caches::rotate`]).
    fn read(cos: &Tensor, sin: &Tensor, positions: core::ops::Range<usize>) -> Result<Caches<T>> {
        let [rows, half] = cache_shape(cos, sin)?;
        let first = positions.start.min(rows);
        let read = positions.end.min(rows).saturating_sub(first);
        let (at, n) = (first * half, read * half);
        Ok(Caches { cos: cos.read_vec_range(at, n)?, sin: sin.read_vec_range(at, n)?, rows, first, read, half })
    }

    /// The caches as `rows` rows of `half` values (a shape the caller checked), all read.
    fn read_as(cos: &Tensor, sin: &Tensor, rows: usize, half: usize) -> Result<Caches<T>> {
        Ok(Caches { cos: cos.read_vec()?, sin: sin.read_vec()?, rows, first: 0, read: rows, half })
    }

    fn rotate(&self, op: &str, x: &mut [T], pos: i64, interleaved: bool) -> Result<()> {
        if pos < 0 || pos as u64 >= self.rows as u64 {
            bail!("{op}: position {pos} is outside the cos/sin caches of {} rows", self.rows);
        }
        let Some(row) = (pos as usize).checked_sub(self.first).filter(|&r| r < self.read) else {
            bail!(
                "{op}: position {pos} is outside the cache rows {}..{} read for this call",
                self.first,
                self.first + self.read
            );
        };
        let r = row * self.half..(row + 1) * self.half;
        rotate(x, &self.cos[r.clone()], &self.sin[r], interleaved);
        Ok(())
    }
}

/// Checks cos and sin caches: rank 2, same shape; returns [rows, half].
fn cache_shape(cos: &Tensor, sin: &Tensor) -> Result<[usize; 2]> {
    let (c, s) = (cos.shape()?, sin.shape()?);
    if c.len() != 2 || c != s {
        bail!("cos_cache {c:?} and sin_cache {s:?} must be 2-D of the same shape");
    }
    Ok([c[0], c[1]])
}

// ---------------------------------------------------------------------------------------------
// GroupQueryAttention
// ---------------------------------------------------------------------------------------------

/// Geometry and attributes of a GroupQueryAttention node.
struct GqaPlan {
    dtype: DType,
    batch: usize,
    seq: usize,
    heads: usize,
    kv_heads: usize,
    head_size: usize,
    packed: bool,
    /// Sequence length of past_key/past_value (0 without past).
    past_len: usize,
    total: usize,
    present_len: usize,
    first_prompt: bool,
    /// Rotary cache width (R/2) when `do_rotary`.
    rotary_half: Option<usize>,
    /// Attention bias dims (rank 4) when given.
    bias_dims: Option<[usize; 4]>,
}

fn gqa_plan(call: &Call) -> Result<GqaPlan> {
    for (i, what) in [
        (9, "position_ids"),
        (12, "k_scale"),
        (13, "v_scale"),
        (14, "q_norm_weight"),
        (15, "k_norm_weight"),
        (16, "query_seqlens"),
    ] {
        if call.input_opt(i).is_some() {
            unsupported!("{GQA}: input {i} ({what}) is not supported");
        }
    }
    if call.num_inputs() > 17 {
        unsupported!("{GQA}: {} inputs; at most 17 are known", call.num_inputs());
    }
    if call.output_opt(3).is_some() || call.attr_i("qk_output", 0)? != 0 {
        unsupported!("{GQA}: output_qk (qk_output) is not supported");
    }
    if call.attr_i("causal", 1)? != 1 {
        unsupported!("{GQA}: causal = {} is not supported (only causal attention)", call.attr_i("causal", 1)?);
    }
    if call.attr_i("sliding_window_cache", 0)? != 0 {
        unsupported!("{GQA}: sliding_window_cache = 1 (windowed KV cache) is not supported");
    }
    for name in ["k_quant_type", "v_quant_type"] {
        let q = call.attr_s(name, "NONE")?;
        if q != "NONE" {
            unsupported!("{GQA}: {name} = {q:?} (quantized KV cache) is not supported");
        }
    }

    let heads = call.attr_i("num_heads", 0)?;
    let kv_heads = call.attr_i("kv_num_heads", 0)?;
    if call.attr("num_heads").is_none() || call.attr("kv_num_heads").is_none() {
        bail!("{GQA}: attributes num_heads and kv_num_heads are required");
    }
    if heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0 {
        bail!("{GQA}: num_heads ({heads}) must be a positive multiple of kv_num_heads ({kv_heads})");
    }
    let (heads, kv_heads) = (heads as usize, kv_heads as usize);

    let query = call.input(0)?;
    let dtype = query.dtype()?;
    check_float(GQA, "query", dtype)?;
    let qs = query.shape()?;
    if qs.len() != 3 {
        bail!("{GQA}: query must be 3-D [batch, sequence, hidden], got {qs:?}");
    }
    let (batch, seq) = (qs[0], qs[1]);
    let packed = call.input_opt(1).is_none();
    let head_size;
    if packed {
        if call.input_opt(2).is_some() {
            bail!("{GQA}: key and value must both be present or both absent (packed QKV)");
        }
        let parts = heads + 2 * kv_heads;
        if qs[2] % parts != 0 || qs[2] == 0 {
            bail!(
                "{GQA}: packed QKV width {} is not a positive multiple of num_heads + 2·kv_num_heads = {parts}",
                qs[2]
            );
        }
        head_size = qs[2] / parts;
    } else {
        if qs[2] % heads != 0 || qs[2] == 0 {
            bail!("{GQA}: query width {} is not a positive multiple of num_heads {heads}", qs[2]);
        }
        head_size = qs[2] / heads;
        let want = [batch, seq, kv_heads * head_size];
        for i in [1, 2] {
            let t = call
                .input(i)
                .map_err(|_| ShimError::Failed(format!("{GQA}: key and value must both be present or both absent")))?;
            if t.dtype()? != dtype {
                bail!("{GQA}: input {i} has dtype {}, query has {dtype}", t.dtype()?);
            }
            if t.shape()? != want {
                bail!("{GQA}: input {i} (key/value) has shape {:?}, expected {want:?}", t.shape()?);
            }
        }
    }

    let past_len = match (call.input_opt(3), call.input_opt(4)) {
        (None, None) => 0,
        (Some(pk), Some(pv)) => {
            for t in [&pk, &pv] {
                if t.dtype()? != dtype {
                    unsupported!(
                        "{GQA}: past key/value of dtype {} with query of dtype {dtype} (quantized caches) is not supported",
                        t.dtype()?
                    );
                }
            }
            let (ks, vs) = (pk.shape()?, pv.shape()?);
            if ks.len() != 4 || ks != vs || ks[0] != batch || ks[1] != kv_heads || ks[3] != head_size {
                bail!(
                    "{GQA}: past_key {ks:?} and past_value {vs:?} must both be [{batch}, {kv_heads}, past, {head_size}]"
                );
            }
            ks[2]
        }
        _ => bail!("{GQA}: past_key and past_value must both be present or both absent"),
    };
    if past_len > 0 && (call.output_opt(1).is_none() || call.output_opt(2).is_none()) {
        unsupported!("{GQA}: a past key/value without the present_key and present_value outputs is not supported");
    }

    let seqlens = call.input(5)?;
    if seqlens.dtype()? != DType::I32 || seqlens.numel()? != batch || seqlens.rank()? != 1 {
        bail!("{GQA}: seqlens_k must be int32 of shape [{batch}], got {} {:?}", seqlens.dtype()?, seqlens.shape()?);
    }
    let total_t = call.input(6)?;
    if total_t.dtype()? != DType::I32 || total_t.numel()? != 1 {
        bail!("{GQA}: total_sequence_length must be one int32, got {} {:?}", total_t.dtype()?, total_t.shape()?);
    }
    let total = total_t.read_i64s()?[0];
    if total < 1 || total > i32::MAX as i64 {
        bail!("{GQA}: total_sequence_length {total} must be at least 1");
    }
    let total = total as usize;
    let first_prompt = seq == total;
    if !first_prompt {
        if seq > total {
            bail!("{GQA}: sequence length {seq} exceeds total_sequence_length {total}");
        }
        if seq > 1 && batch != 1 {
            bail!("{GQA}: batch size must be 1 when sequence length ({seq}) > 1 and a past context is given");
        }
    }
    let present_len = total.max(past_len);

    let rotary_half = match (call.input_opt(7), call.input_opt(8)) {
        (None, None) => None,
        (Some(c), Some(s)) => {
            for t in [&c, &s] {
                if t.dtype()? != dtype {
                    bail!("{GQA}: cos/sin caches have dtype {}, query has {dtype}", t.dtype()?);
                }
            }
            let [_, half] = cache_shape(&c, &s).map_err(|e| prefix(GQA, e))?;
            if half == 0 || 2 * half > head_size {
                bail!("{GQA}: cos/sin cache width {half} must be in 1..=head_size/2 ({})", head_size / 2);
            }
            Some(half)
        }
        _ => bail!("{GQA}: cos_cache and sin_cache must both be present or both absent"),
    };
    let rotary_half = if call.attr_i("do_rotary", 0)? == 1 {
        if rotary_half.is_none() {
            bail!("{GQA}: do_rotary = 1 needs cos_cache and sin_cache");
        }
        rotary_half
    } else {
        None
    };

    let bias_dims = match call.input_opt(10) {
        None => None,
        Some(b) => {
            let s = b.shape()?;
            if b.dtype()? != dtype
                || s.len() != 4
                || (s[0] != 1 && s[0] != batch)
                || (s[1] != 1 && s[1] != heads)
                || s[2] != seq
                || s[3] != total
            {
                bail!(
                    "{GQA}: attention_bias {} {s:?} must be {dtype} [{batch} or 1, {heads} or 1, {seq}, {total}]",
                    b.dtype()?
                );
            }
            Some([s[0], s[1], s[2], s[3]])
        }
    };
    if let Some(h) = call.input_opt(11) {
        if h.dtype()? != dtype || h.shape()? != [heads] {
            bail!("{GQA}: head_sink must be {dtype} [{heads}], got {} {:?}", h.dtype()?, h.shape()?);
        }
    }

    Ok(GqaPlan {
        dtype,
        batch,
        seq,
        heads,
        kv_heads,
        head_size,
        packed,
        past_len,
        total,
        present_len,
        first_prompt,
        rotary_half,
        bias_dims,
    })
}

fn prefix(op: &str, e: ShimError) -> ShimError {
    match e {
        ShimError::Failed(m) => ShimError::Failed(format!("{op}: {m}")),
        other => other,
    }
}

fn gqa_infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = gqa_plan(call)?;
    let present = TensorType::new(p.dtype, vec![p.batch, p.kv_heads, p.present_len, p.head_size]);
    Ok(vec![TensorType::new(p.dtype, vec![p.batch, p.seq, p.heads * p.head_size]), present.clone(), present])
}

fn gqa_cpu(call: &Call) -> Result<()> {
    let p = gqa_plan(call)?;
    match p.dtype {
        DType::F32 => gqa_cpu_in::<f32>(call, p),
        _ => gqa_cpu_in::<f64>(call, p),
    }
}

/// The GroupQueryAttention reference computing in `T`.
fn gqa_cpu_in<T: Real>(call: &Call, p: GqaPlan) -> Result<()> {
    let caches = [call.input_opt(3), call.input_opt(4), call.output_opt(1), call.output_opt(2)];
    if caches.iter().flatten().any(|t| t.paged().is_some()) {
        unsupported!("{GQA}: the CPU reference reads row-major K/V caches, not paged ones");
    }
    let (b_n, s_n, n_h, n_kv, h_sz) = (p.batch, p.seq, p.heads, p.kv_heads, p.head_size);
    let group = n_h / n_kv;
    let interleaved = call.attr_i("rotary_interleaved", 0)? == 1;
    let scale = T::from_f64(match call.attr_f("scale", 0.0)? {
        0.0 => 1.0 / libm::sqrt(h_sz as f64),
        s => s as f64,
    });
    let softcap = T::from_f64(call.attr_f("softcap", 0.0)? as f64);
    let window = call.attr_i("local_window_size", -1)?;
    let smooth = call.attr_i("smooth_softmax", 0)? == 1;

    let q_in = call.input(0)?.read_vec::<T>()?;
    // Row widths and head offsets of Q, K, V in their inputs.
    let (q_w, k_in, v_in, k_off, v_off, kv_w) = if p.packed {
        let w = (n_h + 2 * n_kv) * h_sz;
        (w, None, None, n_h * h_sz, (n_h + n_kv) * h_sz, w)
    } else {
        (n_h * h_sz, Some(call.input(1)?.read_vec::<T>()?), Some(call.input(2)?.read_vec::<T>()?), 0, 0, n_kv * h_sz)
    };
    let k_src = k_in.as_deref().unwrap_or(&q_in);
    let v_src = v_in.as_deref().unwrap_or(&q_in);
    let seqlens = call.input(5)?.read_i64s()?;
    // Positions go up to the longest row's last token (seqlens_k + 1 rows of the caches), or
    // the prompt's length (a first prompt rotates every one of its S positions); they start at
    // the shortest row's first new token (seqlens_k + 1 − S; 0 for a first prompt).
    let caches = match p.rotary_half {
        Some(_) => {
            let ends = seqlens.iter().map(|&k| (k.max(0) as u64).saturating_add(1).min(usize::MAX as u64) as usize);
            let longest = ends.clone().max().unwrap_or(0);
            let first = if p.first_prompt { 0 } else { ends.map(|t| t.saturating_sub(s_n)).min().unwrap_or(0) };
            Some(Caches::<T>::read(&call.input(7)?, &call.input(8)?, first..longest.max(s_n))?)
        }
        None => None,
    };
    let bias = match call.input_opt(10) {
        Some(t) => Some(t.read_vec::<T>()?),
        None => None,
    };
    let sink = match call.input_opt(11) {
        Some(t) => Some(t.read_vec::<T>()?),
        None => None,
    };

    // Present K/V [B, Nk, PL, H]. Only the rows a call reads or writes (each batch row's past
    // and its S new positions) decode into `pres_k` / `pres_v`, each head `pc` rows (the most
    // of any batch row); the present's other rows are the past's bytes (a shared buffer) or
    // zeros.
    let (pl, past) = (p.present_len, p.past_len);
    let shared = past >= p.total;
    let size = p.dtype.size().unwrap_or(4);

    // Per batch row: total valid length and past length.
    let mut rows = Vec::with_capacity(b_n);
    for (b, &sk) in seqlens.iter().enumerate() {
        let t = sk + 1;
        let bad = if p.first_prompt { t < 1 || t > s_n as i64 } else { t < s_n as i64 || t > p.total as i64 };
        if bad {
            bail!(
                "{GQA}: seqlens_k[{b}] = {sk} is out of range for sequence length {s_n} and total_sequence_length {}",
                p.total
            );
        }
        let t = t as usize;
        let past_b = if p.first_prompt { 0 } else { t - s_n };
        if !shared && past_b > past {
            bail!("{GQA}: seqlens_k[{b}] = {sk} needs {past_b} past tokens but past_key holds {past}");
        }
        rows.push((t, past_b));
    }

    let pc = rows.iter().map(|&(t, past_b)| t.max(past_b + s_n)).max().unwrap_or(0).min(pl);
    // A float32 prompt, or a decode step over a long context, multiplies through the host's
    // `gemm` (Q·Kᵀ and P·V over each KV head's group), reading K and V from the presents.
    let (pk, pv) = (call.output_opt(1), call.output_opt(2));
    let t_max = rows.iter().map(|r| r.0).max().unwrap_or(1).max(1);
    let through_gemm =
        p.dtype == DType::F32 && (s_n >= PROMPT_GEMM_ROWS || t_max >= DECODE_GEMM_KEYS) && pk.is_some() && pv.is_some();
    // Each head's past rows come straight from the past tensors (only the rows a batch row uses;
    // a decode step's context, not the whole buffer) where the shim's own loops read them or the
    // presents get them from `pres_*`; products over a shared buffer, whose presents start as the
    // whole past, keep only each head's S new rows.
    let (past_kt, past_vt) = if past > 0 { (Some(call.input(3)?), Some(call.input(4)?)) } else { (None, None) };
    let past_rows = !(through_gemm && shared);
    let kept = if past_rows { pc } else { s_n };
    // Position `pos` of batch row b's head j in `pres_*` (from the row's first kept position).
    let first_kept = |b: usize| if past_rows { 0 } else { rows[b].1 };
    let (mut pres_k, mut pres_v) = (vec![T::ZERO; b_n * n_kv * kept * h_sz], vec![T::ZERO; b_n * n_kv * kept * h_sz]);
    let head = |b: usize, j: usize| (b * n_kv + j) * kept * h_sz;
    let at_pos = |b: usize, j: usize, pos: usize| head(b, j) + (pos - first_kept(b)) * h_sz;
    for (b, &(_, past_b)) in rows.iter().enumerate() {
        for j in 0..n_kv {
            if let (Some(kt), Some(vt), true) = (&past_kt, &past_vt, past_b > 0 && past_rows) {
                let (dst, src, n) = (head(b, j), (b * n_kv + j) * past * h_sz, past_b * h_sz);
                pres_k[dst..dst + n].copy_from_slice(&kt.read_vec_range::<T>(src, n)?);
                pres_v[dst..dst + n].copy_from_slice(&vt.read_vec_range::<T>(src, n)?);
            }
            for s in 0..s_n {
                let src = (b * s_n + s) * kv_w;
                let dst = at_pos(b, j, past_b + s);
                let kr = &mut pres_k[dst..dst + h_sz];
                kr.copy_from_slice(&k_src[src + k_off + j * h_sz..][..h_sz]);
                if let Some(c) = &caches {
                    c.rotate(GQA, kr, (past_b + s) as i64, interleaved)?;
                    kr.iter_mut().for_each(|x| *x = x.round_to(p.dtype));
                }
                pres_v[dst..dst + h_sz].copy_from_slice(&v_src[src + v_off + j * h_sz..][..h_sz]);
            }
        }
    }
    // The presents: each batch row's past and new positions written per head; the other rows
    // are the past's bytes (a shared buffer: the present starts as the whole past, and then
    // only the new positions are written) or zeros. A present bound in place to its past's
    // buffer (ABI.md §7.8) already holds the past's bytes; another gets a copy, read before any
    // present is written (from schema 18 a present bound in place to the other past's buffer
    // is that buffer, so writing it first would change what the copy reads).
    let starts_as_past = shared && past_kt.is_some();
    let copy_of = |t: Option<&Tensor>, past_i: usize, past_t: Option<&Tensor>| -> Result<Option<Vec<u8>>> {
        match (t, past_t) {
            (Some(t), Some(pt)) if starts_as_past && t.in_place_of() != Some(past_i) => Ok(Some(pt.read_bytes()?)),
            _ => Ok(None),
        }
    };
    let starts = (copy_of(pk.as_ref(), 3, past_kt.as_ref())?, copy_of(pv.as_ref(), 4, past_vt.as_ref())?);
    let write_present = |t: &Tensor, start: Option<&[u8]>, pres: &[T]| -> Result<()> {
        if let Some(bytes) = start {
            t.write_bytes(bytes)?;
        }
        for (b, &(_, past_b)) in rows.iter().enumerate() {
            for j in 0..n_kv {
                let at = (b * n_kv + j) * pl * h_sz;
                let used = (past_b + s_n).min(pl);
                let from = if starts_as_past { past_b.min(used) } else { 0 };
                t.write_vec_at(at + from * h_sz, &pres[at_pos(b, j, from)..at_pos(b, j, used)])?;
                if !shared && used < pl {
                    t.write_bytes_at(((at + used * h_sz) * size) as u64, &alloc::vec![0u8; (pl - used) * h_sz * size])?;
                }
            }
        }
        Ok(())
    };

    // The products read K and V from the presents, which are therefore written first.
    if let Some(t) = &pk {
        write_present(t, starts.0.as_deref(), &pres_k)?;
    }
    if let Some(t) = &pv {
        write_present(t, starts.1.as_deref(), &pres_v)?;
    }
    let sink_of = |h: usize| match &sink {
        Some(sv) => Some(sv[h]),
        None if smooth => Some(T::ZERO),
        None => None,
    };
    // The logit of query row s against key t of head h in batch row b, from Q·K.
    let logit = |qk: T, b: usize, h: usize, s: usize, t: usize| {
        let mut x = qk;
        if softcap > T::ZERO {
            x = softcap * (x / softcap).tanh();
        }
        if let (Some(bias), Some(d)) = (&bias, p.bias_dims) {
            let (bb, bh) = (if d[0] == 1 { 0 } else { b }, if d[1] == 1 { 0 } else { h });
            x += bias[((bb * d[1] + bh) * d[2] + s) * d[3] + t];
        }
        x
    };
    // Query row s's keys in batch row b: [start, end).
    let keys = |t_b: usize, past_b: usize, s: usize| {
        let causal = past_b + s + 1;
        let start = if window >= 0 && causal as i64 > window { causal - window as usize } else { 0 };
        (start, causal.min(t_b))
    };
    // Query row s of head h in batch row b into `q`, rotated (and rounded to the dtype) as the
    // keys were.
    let rotated = |q: &mut [T], b: usize, h: usize, s: usize| -> Result<()> {
        q.copy_from_slice(&q_in[(b * s_n + s) * q_w + h * h_sz..][..h_sz]);
        if let Some(c) = &caches {
            c.rotate(GQA, q, (rows[b].1 + s) as i64, interleaved)?;
            q.iter_mut().for_each(|x| *x = x.round_to(p.dtype));
        }
        Ok(())
    };
    let mut q = vec![T::ZERO; h_sz];
    if let (true, Some(pk), Some(pv)) = (through_gemm, &pk, &pv) {
        let out = call.output(0)?.handle();
        // Query rows per product: the group's scores of a chunk within PROMPT_SCORES values.
        let chunk = (PROMPT_SCORES / (group * t_max)).clamp(1, s_n);
        // KV heads per product: every one at a decode step (one query row: each head's output row
        // sits h_sz after the last, so one batched product over the KV heads writes them all),
        // one for prompts. One import per product, instead of one per KV head.
        let kvp = if s_n == 1 { n_kv } else { 1 };
        let qs = scratch((kvp * group * chunk * h_sz * 4) as u64)?;
        let ss = scratch((kvp * group * chunk * t_max * 4) as u64)?;
        let f32_op = |handle, offset: usize, ld: usize, batch_stride: usize| Operand {
            handle,
            offset: offset as u64 * 4,
            ld: ld as u64,
            batch_stride: batch_stride as u64,
        };
        for (b, &(t_b, past_b)) in rows.iter().enumerate() {
            for j0 in (0..n_kv).step_by(kvp) {
                let kv = (b * n_kv + j0) * pl * h_sz;
                for s0 in (0..s_n).step_by(chunk) {
                    let n = chunk.min(s_n - s0);
                    // Q rows [kvp, group, n, H]: KV head j0 + jj, its group's heads, the chunk's rows.
                    let mut qf = Vec::with_capacity(kvp * group * n * h_sz);
                    for h in j0 * group..(j0 + kvp) * group {
                        for s in s0..s0 + n {
                            rotated(&mut q, b, h, s)?;
                            qf.extend(q.iter().map(|x| x.to_f32()));
                        }
                    }
                    write_handle(qs, 0, &element::encode_as(DType::F32, &qf)?)?;
                    // Scores [kvp, group · n, t_b] = scale · Q [kvp, group · n, H] · Kᵀ per KV head.
                    gemm(&Gemm {
                        dtype: DType::F32,
                        trans_a: false,
                        trans_b: true,
                        m: (group * n) as u64,
                        n: t_b as u64,
                        k: h_sz as u64,
                        batch: kvp as u64,
                        alpha: scale.to_f32(),
                        beta: 0.0,
                        a: f32_op(qs, 0, h_sz, group * n * h_sz),
                        b: f32_op(pk.handle(), kv, h_sz, pl * h_sz),
                        c: None,
                        d: f32_op(ss, 0, t_b, group * n * t_b),
                        bias: None,
                        epilogue: Epilogue::None,
                    })?;
                    let mut raw = alloc::vec![0u8; kvp * group * n * t_b * 4];
                    read_handle(ss, 0, &mut raw)?;
                    // Each row's logits softmaxed over its keys in place, 0 outside them.
                    let mut scores = element::decode_as::<T>(DType::F32, &raw)?;
                    for (r, row) in scores.chunks_exact_mut(t_b).enumerate() {
                        let (h, s) = (j0 * group + r / n, s0 + r % n);
                        // A padding row past the batch row's length (or a window past it) has none.
                        let (start, end) = keys(t_b, past_b, s);
                        let start = start.min(t_b);
                        let end = end.max(start);
                        if softcap > T::ZERO || bias.is_some() {
                            for (t, x) in row.iter_mut().enumerate().take(end).skip(start) {
                                *x = logit(*x, b, h, s, t);
                            }
                        }
                        softmax_in_place(&mut row[start..end], sink_of(h));
                        row[..start].fill(T::ZERO);
                        row[end..].fill(T::ZERO);
                    }
                    write_handle(ss, 0, &element::encode_as(DType::F32, &scores)?)?;
                    // Output rows s0.. of the heads = P · V [t_b, H]: at a decode step one product
                    // over the KV heads (P [kvp, group, t_b], each head's row h_sz after the last),
                    // else over the group's heads (P [group, n, t_b], rows n_h · h_sz apart).
                    let d_at = ((b * s_n + s0) * n_h + j0 * group) * h_sz;
                    // (batch, rows, P, V's batch stride, Y) of the product.
                    let (batch, m, a, v_stride, d) = if kvp > 1 {
                        (kvp, group, f32_op(ss, 0, t_b, group * t_b), pl * h_sz, f32_op(out, d_at, h_sz, group * h_sz))
                    } else {
                        (group, n, f32_op(ss, 0, t_b, n * t_b), 0, f32_op(out, d_at, n_h * h_sz, h_sz))
                    };
                    gemm(&Gemm {
                        dtype: DType::F32,
                        trans_a: false,
                        trans_b: false,
                        m: m as u64,
                        n: h_sz as u64,
                        k: t_b as u64,
                        batch: batch as u64,
                        alpha: 1.0,
                        beta: 0.0,
                        a,
                        b: f32_op(pv.handle(), kv, h_sz, v_stride),
                        c: None,
                        d,
                        bias: None,
                        epilogue: Epilogue::None,
                    })?;
                }
            }
        }
        return Ok(());
    }

    let mut out = vec![T::ZERO; b_n * s_n * n_h * h_sz];
    let mut scores = Vec::new();
    for (b, &(t_b, past_b)) in rows.iter().enumerate() {
        for h in 0..n_h {
            let j = h / group;
            // Here every head keeps its `pc` rows (`past_rows`: the products return above).
            let kh = &pres_k[head(b, j)..head(b, j) + kept * h_sz];
            let vh = &pres_v[head(b, j)..head(b, j) + kept * h_sz];
            for s in 0..s_n {
                let (start, end) = keys(t_b, past_b, s);
                if start >= end {
                    continue; // No key: the row stays zero.
                }
                rotated(&mut q, b, h, s)?;
                scores.clear();
                for t in start..end {
                    scores.push(logit(dot(&q, &kh[t * h_sz..(t + 1) * h_sz]) * scale, b, h, s, t));
                }
                softmax_in_place(&mut scores, sink_of(h));
                let o = &mut out[(b * s_n + s) * n_h * h_sz + h * h_sz..][..h_sz];
                for (w, t) in scores.iter().zip(start..end) {
                    for (od, vd) in o.iter_mut().zip(&vh[t * h_sz..(t + 1) * h_sz]) {
                        *od += *w * *vd;
                    }
                }
            }
        }
    }
    call.output(0)?.write_vec(&out)
}

/// Prompts of at least this many rows multiply through the host's `gemm` (float32).
const PROMPT_GEMM_ROWS: usize = 8;
/// So do decode steps (fewer rows) over at least this many keys: the host's products read K and
/// V where they are, where the shim's own loops took about 1 µs per key and head (a 1,040-token
/// context of SmolLM2-135M's 9 heads cost 1.2 ms a layer on the CPU; at 17–48 keys the products
/// still took 12 % less, measured on a 2-core VM in session 36).
const DECODE_GEMM_KEYS: usize = 16;
/// Most scores (f32 values) one product of a prompt's attention writes at once.
const PROMPT_SCORES: usize = 4 << 20;

/// Softmax of `xs` in place, with `sink` as one more logit in the denominator (attention sinks,
/// smooth softmax); empty `xs` stays empty.
fn softmax_in_place<T: Real>(xs: &mut [T], sink: Option<T>) {
    let mut max = xs.iter().fold(T::NEG_INFINITY, |m, &x| m.max(x));
    if let Some(s) = sink {
        max = max.max(s);
    }
    // Three loops: the exponentials and the division vectorize; the sum keeps its order.
    for x in xs.iter_mut() {
        *x = (*x - max).exp();
    }
    let den = xs.iter().fold(sink.map_or(T::ZERO, |s| (s - max).exp()), |d, &x| d + x);
    for x in xs.iter_mut() {
        *x = *x / den;
    }
}

/// `Σ a·b` in eight partial sums (which the compiler keeps in SIMD lanes), then their sum.
fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    let mut lanes = [T::ZERO; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: T = ac.remainder().iter().zip(bc.remainder()).map(|(&x, &y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().copied().sum::<T>() + tail
}

// ---------------------------------------------------------------------------------------------
// RotaryEmbedding
// ---------------------------------------------------------------------------------------------

/// Geometry of a RotaryEmbedding node: the input seen as [B, S, N, H] through strides.
struct RopePlan {
    batch: usize,
    seq: usize,
    heads: usize,
    head_size: usize,
    rotary_dim: usize,
    /// Element strides of batch, sequence and head.
    strides: [usize; 3],
    /// Where each (batch row, position)'s cache row comes from.
    positions: Positions,
    /// Input indices of cos_cache and sin_cache.
    caches: [usize; 2],
    /// Rows of the caches (a [B, S, half] cache without position_ids counts B·S rows).
    cache_rows: usize,
}

/// How a RotaryEmbedding node finds the cache row of batch row b, sequence index s.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Positions {
    /// position_ids [B, S] (input i): row position_ids[b, s].
    Ids(usize),
    /// One start position (com.microsoft's scalar position_ids, input i): row position_ids[0] + s.
    Start(usize),
    /// No position_ids (ONNX's RotaryEmbedding-23): caches [B, S, half], row b·S + s.
    Rows,
}

impl Positions {
    /// The position_ids input, when the node has one.
    fn input(self) -> Option<usize> {
        match self {
            Positions::Ids(i) | Positions::Start(i) => Some(i),
            Positions::Rows => None,
        }
    }

    /// The kiln_rope kernel's pos_mode.
    fn mode(self) -> u32 {
        match self {
            Positions::Ids(_) => 0,
            Positions::Start(_) => 1,
            Positions::Rows => 2,
        }
    }
}

/// com.microsoft RotaryEmbedding (input, position_ids, cos_cache, sin_cache; `num_heads` with
/// `rotary_embedding_dim`) or ONNX's RotaryEmbedding-23 (input, cos_cache, sin_cache, optional
/// position_ids; a 4-D input is [B, num_heads, S, head_size], a 3-D one needs `num_heads`; without
/// position_ids the caches are [B, S, rotary_dim / 2]). Errors: shapes, dtypes or attributes
/// that disagree, named.
fn rope_plan(call: &Call) -> Result<RopePlan> {
    let onnx = call.domain() != "com.microsoft";
    if !onnx && call.attr_i("is_packed_batching", 0)? != 0 {
        unsupported!("{ROPE}: is_packed_batching = 1 is not supported");
    }
    let x = call.input(0)?;
    check_float(ROPE, "input", x.dtype()?)?;
    let xs = x.shape()?;
    let pos_input = if onnx { call.input_opt(3).map(|_| 3) } else { Some(1) };
    let [cos_i, sin_i] = if onnx { [1, 2] } else { [2, 3] };
    if let Some(i) = pos_input {
        if call.input(i)?.dtype()? != DType::I64 {
            bail!("{ROPE}: position_ids must be int64, got {}", call.input(i)?.dtype()?);
        }
    }
    let (cos, sin) = (call.input(cos_i)?, call.input(sin_i)?);
    for t in [&cos, &sin] {
        if t.dtype()? != x.dtype()? {
            bail!("{ROPE}: cos/sin caches have dtype {}, input has {}", t.dtype()?, x.dtype()?);
        }
    }
    let num_heads = call.attr_i("num_heads", 0)?;
    let rot_attr = call.attr_i("rotary_embedding_dim", 0)?;
    if num_heads < 0 || rot_attr < 0 {
        bail!("{ROPE}: num_heads ({num_heads}) and rotary_embedding_dim ({rot_attr}) must not be negative");
    }
    if !onnx && rot_attr > 0 && num_heads == 0 {
        bail!("{ROPE}: num_heads must be given with rotary_embedding_dim");
    }
    let (batch, seq, hidden, transposed) = match xs[..] {
        [b, s, d] => (b, s, d, false),
        [b, n, s, h] => (b, s, n * h, true),
        _ => bail!("{ROPE}: input must be 3-D or 4-D, got {xs:?}"),
    };
    let (cache_rows, half) = match pos_input {
        Some(_) => {
            let [rows, half] = cache_shape(&cos, &sin).map_err(|e| prefix(ROPE, e))?;
            (rows, half)
        }
        None => {
            let (c, sn) = (cos.shape()?, sin.shape()?);
            if c != sn || c.len() != 3 || c[0] != batch || c[1] != seq {
                bail!("{ROPE}: without position_ids cos_cache {c:?} and sin_cache {sn:?} must both be [{batch}, {seq}, _]");
            }
            (batch * seq, c[2])
        }
    };
    // The head size, and the heads: ONNX's from a 4-D input's shape (num_heads is for 3-D input).
    let (head_size, onnx_heads) = if onnx {
        match (transposed, num_heads) {
            (true, _) => (xs[3], Some(xs[1])),
            (false, 0) => bail!("{ROPE}: a 3-D input needs num_heads"),
            (false, n) if hidden % n as usize == 0 => (hidden / n as usize, Some(n as usize)),
            (false, n) => bail!("{ROPE}: hidden size {hidden} is not a multiple of num_heads {n}"),
        }
    } else if rot_attr == 0 {
        (2 * half, None)
    } else {
        if hidden % num_heads as usize != 0 {
            bail!("{ROPE}: hidden size {hidden} is not a multiple of num_heads {num_heads}");
        }
        (hidden / num_heads as usize, None)
    };
    if head_size == 0 || hidden % head_size != 0 {
        bail!("{ROPE}: hidden size {hidden} is not a positive multiple of the head size {head_size}");
    }
    let heads = match onnx_heads {
        Some(n) => n,
        None if num_heads > 0 => num_heads as usize,
        None => hidden / head_size,
    };
    if heads * head_size != hidden {
        bail!("{ROPE}: num_heads {heads} × head size {head_size} ≠ hidden size {hidden}");
    }
    if transposed && (xs[1] != heads || xs[3] != head_size) {
        unsupported!("{ROPE}: 4-D input {xs:?} whose head layout differs from [_, {heads}, _, {head_size}]");
    }
    let rotary_dim = if rot_attr > 0 { rot_attr as usize } else { head_size };
    if rotary_dim > head_size || rotary_dim % 2 != 0 || rotary_dim / 2 != half {
        bail!(
            "{ROPE}: rotary dimension {rotary_dim} must be even, at most the head size {head_size}, \
             and twice the cache width {half}"
        );
    }
    let positions = match pos_input {
        None => Positions::Rows,
        Some(i) => {
            let pos = call.input(i)?;
            if !onnx && pos.numel()? == 1 && pos.rank()? <= 1 {
                Positions::Start(i)
            } else if pos.shape()? == [batch, seq] {
                Positions::Ids(i)
            } else if onnx {
                bail!("{ROPE}: position_ids must have shape [{batch}, {seq}], got {:?}", pos.shape()?);
            } else {
                bail!("{ROPE}: position_ids must have one element or shape [{batch}, {seq}], got {:?}", pos.shape()?);
            }
        }
    };
    let strides = if transposed {
        [heads * seq * head_size, head_size, seq * head_size]
    } else {
        [seq * hidden, hidden, head_size]
    };
    Ok(RopePlan { batch, seq, heads, head_size, rotary_dim, strides, positions, caches: [cos_i, sin_i], cache_rows })
}

fn rope_cpu(call: &Call) -> Result<()> {
    let p = rope_plan(call)?;
    let interleaved = call.attr_i("interleaved", 0)? == 1;
    let mut x = call.input(0)?.read_vec::<f64>()?;
    let pos = match p.positions.input() {
        Some(i) => call.input(i)?.read_i64s()?,
        None => Vec::new(),
    };
    let caches = Caches::read_as(&call.input(p.caches[0])?, &call.input(p.caches[1])?, p.cache_rows, p.rotary_dim / 2)?;
    for b in 0..p.batch {
        for s in 0..p.seq {
            let position = match p.positions {
                Positions::Ids(_) => pos[b * p.seq + s],
                Positions::Start(_) => pos[0].saturating_add(s as i64),
                Positions::Rows => (b * p.seq + s) as i64,
            };
            for n in 0..p.heads {
                let at = b * p.strides[0] + s * p.strides[1] + n * p.strides[2];
                let head = &mut x[at..at + p.head_size];
                caches.rotate(ROPE, &mut head[..p.rotary_dim], position, interleaved)?;
            }
        }
    }
    call.output(0)?.write_vec(&x)
}

// ---------------------------------------------------------------------------------------------
// GPU plans
// ---------------------------------------------------------------------------------------------

/// The CUDA kernels' template argument for `d`: the prelude's tag of a dtype kernel.toml
/// instantiates them for (f32, f16 or bf16), spelled into a name expression by `kernel_name`.
fn kernel_tag(op: &str, d: DType) -> Result<&'static str> {
    match (d, d.cuda_tag()) {
        (DType::F32 | DType::F16 | DType::BF16, Some(tag)) => Ok(tag),
        _ => unsupported!("{op}: no CUDA kernel for {d}"),
    }
}

fn targ(t: &Tensor) -> KernelArg {
    KernelArg::Tensor { handle: t.handle(), offset: 0 }
}

fn harg(handle: u32) -> KernelArg {
    KernelArg::Tensor { handle, offset: 0 }
}

/// A `u32` kernel argument, or unsupported when the value does not fit.
fn u32_arg(op: &str, what: &str, v: usize) -> Result<KernelArg> {
    match u32::try_from(v) {
        Ok(v) => Ok(KernelArg::U32(v)),
        Err(_) => unsupported!("{op}: {what} = {v} does not fit the CUDA kernel's 32-bit index"),
    }
}

fn flag(b: bool) -> KernelArg {
    KernelArg::U32(b as u32)
}

/// Threads per block of the grid-stride kernels.
const BLOCK: u32 = 256;

fn grid_for(n: usize) -> u32 {
    (n as u64).div_ceil(BLOCK as u64).clamp(1, 65535 * 32) as u32
}

/// Decode attention by KV head (`kiln_gqa_decode`): the most keys per block, and the largest
/// query group and group × head size it handles (attention.cu's GQA_DEC_* limits).
const DEC_KEYS: usize = 256;
const DEC_MAX_GROUP: usize = 8;
const DEC_MAX_QH: usize = 1024;
/// Cross-warp reduction rows of `kiln_gqa_decode_tiled` (attention.cu's GQA_DEC_WARPS).
const DEC_WARPS: usize = 8;
/// Bytes of K and V rows one `kiln_gqa_decode_tiled` block holds in shared memory.
const DEC_TILE_BYTES: usize = 64 << 10;
/// From this many cache positions in all (present buffer length × batch rows × KV heads: shapes
/// only, so the choice is a plan constant, whatever the rows' lengths), decode attention runs
/// `kiln_gqa_decode_tiled` (K/V tiles copied into shared memory, 3 blocks per SM for groups of
/// up to 4 query heads: the bandwidth-bound case), below it `kiln_gqa_decode` (rows loaded into registers up front, 2
/// blocks per SM: the latency-bound case). On the H200 (bench/RESULTS.md, 2026-12-03 session 9)
/// the tiled kernel took batch 8 at context 3840 of a 4096 cache from 1.423 to 1.275 ms/step
/// and the register kernel was 3–4 % faster at batch 1 and at caches of a few hundred keys.
const DEC_TILED_MIN_KEYS: usize = 64 << 10;

/// Below the tiled kernel's threshold, a present buffer of at most `DEC_CLUSTER × DEC_KEYS`
/// positions runs a cluster kernel: DEC_CLUSTER blocks (attention.cu's GQA_DEC_CLUSTER) per (KV
/// head, batch row), each over ceil(present / DEC_CLUSTER) keys, whose partial states merge
/// through a thread block cluster on compute capability 9.0 (folded on the node's counters before
/// it). Spreading a short cache over 8 multiprocessors instead of 1 or 2 cuts the latency-bound
/// step: on the H200, decode attention at batch 1 over a 384-position cache spent most of its
/// 7–10 µs loading 64 KiB per block into one multiprocessor and in the fold's counter and L2
/// round trips (bench/RESULTS.md, 2026-12-04, session 14). Up to `DEC_CLUSTER_MAX_PRESENT`
/// positions (shares of up to 64 keys) it is `kiln_gqa_decode_cluster`, whose blocks hold their
/// keys in registers in chunks of 2 per key lane (64 keys of 64-wide 16-bit rows), one chunk
/// after another; past it `kiln_gqa_decode_cluster_rows`, whose blocks copy every row of their
/// share into shared memory at once, where that fits `DEC_ROWS_SMEM` bytes
/// ([`tiled_shared_bytes`] at the cluster merge's fixed reduction stride, `DEC_MAX_QH`: 2,048
/// positions of 64-wide 16-bit rows). On an H100
/// (bench/RESULTS.md, 2026-12-06, session 27), batch 1 at prompt 1,792 of a 2,048 cache ran
/// 0.811 ms/step with `kiln_gqa_decode_cluster` and 0.681 with `kiln_gqa_decode_cluster_rows` in
/// the same run (0.711 with `kiln_gqa_decode`'s folded splits in another); shares of two passes
/// of rows per block at prompt 3,840 of 4,096 lost to `kiln_gqa_decode` (0.938 against 0.752), so
/// longer presents take 16 blocks of one pass (below) or keep `kiln_gqa_decode`.
const DEC_CLUSTER: usize = 8;
const DEC_CLUSTER_MAX_PRESENT: usize = 512;
/// Past `DEC_CLUSTER × DEC_KEYS` positions and up to `DEC_CLUSTER_WIDE × DEC_KEYS`, below the tiled
/// kernel's threshold and for at most `DEC_CLUSTER_WIDE_MAX_PAIRS` (KV head, batch row) pairs,
/// `kiln_gqa_decode_cluster16_rows`: the cluster rows kernel over 16 blocks per pair, a
/// non-portable cluster size that the host allows at load (attention.cu's GQA_DEC_CLUSTER_WIDE),
/// where its shares' rows fit `DEC_ROWS_SMEM`. On an H100 (bench/attn_probe.cu, a 4,096 cache;
/// bench/RESULTS.md, 2026-12-06, session 28) it took 12.70 µs per launch at batch 1 and position
/// 4,094 where `kiln_gqa_decode`'s 16 folded splits took 13.92, and 9.67 against 10.01 at position
/// 100; at batch 4 (12 pairs) 12.77 against 15.27 at position 2,048 and level near the end (16.24
/// against 15.99), and the decode step at batch 4 and prompt 3,840 went from 1.095 to 1.042 ms. At
/// batch 8 (24 pairs) it took 27.3 µs where the tiled kernel takes 20.1, so more pairs keep the
/// other kernels. Like the tiled kernel's, its 64 KiB of dynamic shared memory at a 4,096 present
/// do not fit a compute capability 7.5 device (64 KiB in all per block; ABI 1 gives a shim no
/// device limits).
const DEC_CLUSTER_WIDE: usize = 16;
const DEC_CLUSTER_WIDE_MAX_PAIRS: usize = 12;
/// Head sizes and query groups (num_heads / kv_num_heads) that the float16 cluster kernels
/// `kiln_gqa_decode_cluster_plain`, `kiln_gqa_decode_cluster_rows` and
/// `kiln_gqa_decode_cluster16_rows` are also compiled for, as `*_hg<tag, head size, group>`
/// (attention.cu): the divisions by them become shifts and multiplications by constants, and their
/// loops unroll. On an H100 a 30-layer batch-1 decode layer took 15.02 µs with head size 64 and
/// group 3 compiled in, against 16.26 (bench/layer_probe.cu; bench/RESULTS.md, 2026-12-06, session
/// 30). `kiln_gqa_decode_cluster_plain_hg` leaves out groups 4, 6 and 7, where NVRTC (sm_90) gives
/// its compiled form spilled registers that the runtime form does not have (8–68 bytes). The
/// 16-block kernel's rows fit `DEC_ROWS_SMEM` only at head size 64 (`HG_WIDE_HEAD`), so it is
/// compiled for that one. bfloat16 keeps the runtime forms: each compiled form costs about a
/// second of a cold NVRTC compile, and the GPU tests have no bfloat16 attention case.
const HG_HEADS: [usize; 2] = [64, 128];
const HG_GROUPS: [usize; 8] = [1, 2, 3, 4, 5, 6, 7, 8];
const HG_PLAIN_GROUPS: [usize; 5] = [1, 2, 3, 5, 8];
const HG_WIDE_HEAD: usize = 64;

/// The most dynamic shared memory `kiln_gqa_decode_cluster_rows` and
/// `kiln_gqa_decode_cluster16_rows` take (DEC_TILE_BYTES, the tiled kernel's: ABI 1 gives a shim
/// no device limits).
const DEC_ROWS_SMEM: usize = DEC_TILE_BYTES;

/// Keys per block of `kiln_gqa_decode_tiled` for K/V rows of `row_bytes` bytes: the most
/// (at most DEC_KEYS) whose K and V tiles fit DEC_TILE_BYTES.
fn tiled_keys_per_block(row_bytes: usize) -> usize {
    let mut kpb = DEC_KEYS;
    while kpb > 1 && 2 * kpb * row_bytes > DEC_TILE_BYTES {
        kpb /= 2;
    }
    kpb
}

/// Dynamic shared memory of `kiln_gqa_decode_tiled` and `kiln_gqa_decode_cluster_rows` (attention.cu's
/// gqa_decode_k_bytes, then the V rows) for `kpb` keys of `row_bytes`-byte rows: the K rows, or the
/// cross-warp reduction of `group_head` values per warp that reuses them when larger, and the V
/// rows. The cluster rows kernel's reduction has the cluster merge's fixed stride, `DEC_MAX_QH`.
fn tiled_shared_bytes(kpb: usize, row_bytes: usize, group_head: usize) -> usize {
    (kpb * row_bytes).max(DEC_WARPS * group_head * 4) + kpb * row_bytes
}

/// Most splits whose merge the decode kernels fold into their last block (attention.cu's
/// `GQA_FOLD_MAX_SPLITS`: each thread of that block merges one output over the splits, 16 splits'
/// loads in flight at a time, so the merge's latency grows by an L2 round trip per 16 splits);
/// more go to `kiln_gqa_merge` after the decode kernel, which spreads them over a block per
/// head. A cache of up to 32,768 positions (256 keys per split) folds. Session 11's fold walked
/// the splits one L2 round trip after another and was limited to 4 (bench/RESULTS.md,
/// 2026-12-04).
const FOLD_MAX_SPLITS: usize = 128;

/// Other decode attention over a present buffer longer than this many positions is split over the
/// keys (`kiln_gqa_split` then `kiln_gqa_merge`), `SPLIT_KEYS` keys per block of
/// `SPLIT_WARPS` warps.
const SPLIT_MIN_PRESENT: usize = 512;
const SPLIT_KEYS: usize = 256;
const SPLIT_WARPS: u32 = 8;

/// Prompt attention by tiles (`kiln_gqa_prefill`, attention.cu's GQA_PF_* values): query
/// rows per block, threads per block, and the largest head size.
const PREFILL_ROWS: usize = 16;
const PREFILL_THREADS: u32 = 128;
const PREFILL_MAX_HEAD: usize = 128;

/// Prompt attention on tensor cores (`kiln_gqa_prefill_mma`, attention.cu's GQA_PFM_* values and
/// `gqa_pfm_keys`, `gqa_pfm_smem`) for 16-bit floats at head sizes 64 and 128: query rows per
/// block (16 per warp), threads per block, and keys per tile at a head size, whose K and V tiles,
/// two of each, share the block's dynamic shared memory with its query rows (40 KiB at 64, 48 KiB
/// at 128).
const PREFILL_MMA_ROWS: usize = 64;
const PREFILL_MMA_THREADS: u32 = 128;
fn prefill_mma_keys(head: usize) -> usize {
    if head > 64 {
        32
    } else {
        64
    }
}
fn prefill_mma_shared_bytes(head: usize) -> usize {
    (PREFILL_MMA_ROWS + 4 * prefill_mma_keys(head)) * head * 2
}

/// The present K/V layout the kernels address (attention.cu's `gqa_layout`, in elements): batch
/// row stride, KV head stride, page stride and log2 of the positions per page. Paged: the present
/// outputs' layout, which a paged past must share (same layout and length: one buffer bound in
/// place, as the host checks); row-major `[B, Nk, PL, H]` otherwise: `Nk·PL·H`, `PL·H`, 0, 31.
/// Errors: a paged past beside a present of another layout or length, a paged present without a
/// paged past of its layout, or a layout whose positions within a page are not `H` apart and its
/// elements 1 apart.
fn kv_layout(call: &Call, p: &GqaPlan) -> Result<[KernelArg; 4]> {
    let paged = |t: Option<Tensor>| t.and_then(|t| t.paged().cloned());
    let (past, pres) =
        ([paged(call.input_opt(3)), paged(call.input_opt(4))], [paged(call.output_opt(1)), paged(call.output_opt(2))]);
    let has_past = p.past_len > 0;
    let layout = match (&past, &pres) {
        ([None, None], [None, None]) => {
            let pl = (p.present_len * p.head_size) as u64;
            return Ok([
                KernelArg::U64(p.kv_heads as u64 * pl),
                KernelArg::U64(pl),
                KernelArg::U64(0),
                KernelArg::U32(31),
            ]);
        }
        ([a, b], [Some(c), Some(d)]) if c == d && has_past && a.as_ref() == Some(c) && b.as_ref() == Some(c) => {
            if has_past && p.present_len != p.past_len {
                bail!(
                    "{GQA}: a paged past_key of {} positions needs present outputs of its length (the buffer bound in \
                     place), not {}",
                    p.past_len,
                    p.present_len
                );
            }
            c.clone()
        }
        _ => bail!(
            "{GQA}: paged K/V caches need past_key, past_value, present_key and present_value in one paged layout \
             (a paged past bound in place as the present)"
        ),
    };
    if layout.axis != 2 || layout.strides[2] != p.head_size as u64 || layout.strides[3] != 1 {
        unsupported!(
            "{GQA}: a paged K/V layout must page axis 2 (positions) with positions {} elements apart within a page \
             and head elements adjacent, got axis {} and strides {:?}",
            p.head_size,
            layout.axis,
            layout.strides
        );
    }
    Ok([
        KernelArg::U64(layout.strides[0]),
        KernelArg::U64(layout.strides[1]),
        KernelArg::U64(layout.page_stride),
        KernelArg::U32(layout.shift),
    ])
}

/// Largest head size of `kiln_gqa_attn` (8 elements per lane).
const GQA_MAX_HEAD: usize = 256;

/// GroupQueryAttention on the GPU: `kiln_gqa_kv` writes the whole present K/V (past rows
/// copied, the new rows rotated and appended at each batch row's past length, which the kernels
/// read from `seqlens_k`), then `kiln_gqa_attn` runs one block per (query row, head, batch
/// row) with an online softmax in f32 (16 warps splitting the keys for decode, 4 for prompts).
/// Prompts without bias, softcap or sink and heads of at most PREFILL_MAX_HEAD run
/// `kiln_gqa_prefill` instead: a block per PREFILL_ROWS query rows, K/V tiles shared by them; of
/// float16 or bfloat16 at head sizes 64 and 128, `kiln_gqa_prefill_mma`: a block per
/// PREFILL_MMA_ROWS query rows, the scores and Σ weight·V on tensor cores.
/// Decode by KV head over a shared past and present (the decode graphs' case) runs without
/// `kiln_gqa_kv`: each `kiln_gqa_decode` block writes the present rows it reads.
/// Without a past, absent present outputs become scratch buffers.
fn gqa_dispatch(call: &Call) -> Result<()> {
    let p = gqa_plan(call)?;
    let tag = kernel_tag(GQA, p.dtype)?;
    let layout = kv_layout(call, &p)?;
    if p.head_size > GQA_MAX_HEAD {
        unsupported!("{GQA}: head size {} (the CUDA kernel handles up to {GQA_MAX_HEAD})", p.head_size);
    }
    if p.seq > 65535 * 32 || p.heads > 65535 || p.batch > 65535 {
        unsupported!("{GQA}: batch {}, sequence {}, heads {} exceed the launch grid", p.batch, p.seq, p.heads);
    }
    let out = call.output(0)?;
    let interleaved = call.attr_i("rotary_interleaved", 0)? == 1;
    let scale = match call.attr_f("scale", 0.0)? {
        0.0 => 1.0 / libm::sqrt(p.head_size as f64),
        s => s as f64,
    } as f32;
    let softcap = call.attr_f("softcap", 0.0)?;
    let window = call.attr_i("local_window_size", -1)?;
    let window = i32::try_from(window.max(-1)).unwrap_or(i32::MAX);
    let smooth = call.attr_i("smooth_softmax", 0)? == 1;
    let (n_h, n_kv, h_sz) = (p.heads, p.kv_heads, p.head_size);

    let query = call.input(0)?;
    let (k_src, v_src, kv_w, k_off, v_off) = if p.packed {
        let w = (n_h + 2 * n_kv) * h_sz;
        (targ(&query), targ(&query), w, n_h * h_sz, (n_h + n_kv) * h_sz)
    } else {
        (targ(&call.input(1)?), targ(&call.input(2)?), n_kv * h_sz, 0, 0)
    };
    let q_w = if p.packed { (n_h + 2 * n_kv) * h_sz } else { n_h * h_sz };
    let present_elems = p.batch * n_kv * p.present_len * h_sz;
    let present_bytes = (present_elems * p.dtype.size().unwrap_or(4)) as u64;
    let buffer = |i: usize| -> Result<u32> {
        match call.output_opt(i) {
            Some(t) => Ok(t.handle()),
            None => scratch(present_bytes),
        }
    };
    let (pres_k, pres_v) = (buffer(1)?, buffer(2)?);
    // Absent optional tensors are passed as the query, never read.
    let (past_k, past_v) = match p.past_len {
        0 => (targ(&query), targ(&query)),
        _ => (targ(&call.input(3)?), targ(&call.input(4)?)),
    };
    let seqlens = targ(&call.input(5)?);
    let (cos, sin, cache_rows, rot_half) = match p.rotary_half {
        Some(half) => {
            let c = call.input(7)?;
            (targ(&c), targ(&call.input(8)?), c.shape()?[0], half)
        }
        None => (targ(&query), targ(&query), 0, 0),
    };
    let shared = p.past_len > 0 && p.past_len >= p.total;
    let u = |what: &str, v: usize| u32_arg(GQA, what, v);
    let esize = p.dtype.size().unwrap_or(4);
    let group = n_h / n_kv.max(1);
    let vectors = (h_sz * esize) / 16;
    let decode = p.seq == 1 && !p.first_prompt;
    let by_kv_head = decode
        && group <= DEC_MAX_GROUP
        && group * h_sz <= DEC_MAX_QH
        && (h_sz * esize) % 16 == 0
        && vectors.is_power_of_two()
        && vectors <= 32;
    // A shared past and present at decode: `kiln_gqa_decode` appends the new rows itself.
    let append = by_kv_head && shared && out.numel()? > 0;

    if present_elems > 0 && !append {
        // A shared buffer bound in place only needs the new rows written (the kernel checks);
        // otherwise the grid-stride loop copies the past with the same threads.
        let new_elems = p.batch * n_kv * p.seq * h_sz;
        let kv_threads = if shared { (present_elems / 64).max(new_elems) } else { present_elems };
        launch(&Launch {
            kernel: &kernel_name("kiln_gqa_kv", &[tag]),
            grid: [grid_for(kv_threads), 1, 1],
            block: [BLOCK, 1, 1],
            shared_mem_bytes: 0,
            args: vec![
                k_src,
                v_src,
                past_k,
                past_v,
                seqlens,
                cos,
                sin,
                harg(pres_k),
                harg(pres_v),
                u("batch", p.batch)?,
                u("sequence", p.seq)?,
                u("kv_num_heads", n_kv)?,
                u("head size", h_sz)?,
                u("present length", p.present_len)?,
                u("past length", p.past_len)?,
                KernelArg::U64(kv_w as u64),
                KernelArg::U64(k_off as u64),
                KernelArg::U64(v_off as u64),
                flag(p.first_prompt),
                flag(shared),
                KernelArg::U64(cache_rows as u64),
                u("rotary width", rot_half)?,
                flag(interleaved),
                u("total_sequence_length", p.total)?,
                layout[0],
                layout[1],
                layout[2],
                layout[3],
                KernelArg::Status,
            ],
        })?;
    }

    let (bias, bias_b, bias_h) = match (call.input_opt(10), p.bias_dims) {
        (Some(t), Some(d)) => (targ(&t), d[0], d[1]),
        _ => (targ(&query), 1, 1),
    };
    let (sink, sink_mode) = match call.input_opt(11) {
        Some(t) => (targ(&t), 2u32),
        None => (targ(&query), smooth as u32),
    };
    if out.numel()? == 0 {
        return Ok(());
    }
    if by_kv_head || (decode && p.present_len > SPLIT_MIN_PRESENT) {
        // Split over the keys (flash-decoding): the split count depends on the present length
        // only (a plan constant under graph capture); splits past a row's length return at once.
        // By KV head, one block per (key chunk, KV head, batch row) serves all the query heads of
        // the KV head; otherwise one per (key chunk, query head, batch row). Several chunks are
        // merged by `kiln_gqa_merge`.
        let row_bytes = h_sz * esize;
        let pairs = p.batch * n_kv;
        let tiled = by_kv_head && p.present_len.saturating_mul(pairs) >= DEC_TILED_MIN_KEYS;
        let few_pairs = by_kv_head && !tiled && pairs <= MAX_COUNTERS as usize;
        let cluster = few_pairs && p.present_len <= DEC_CLUSTER * DEC_KEYS;
        // Past the 8-block cluster, one of 16 for the pairs measured, whose shares' rows fit
        // shared memory (16-bit rows: the kernel has no float32 instantiation).
        let wide_keys = p.present_len.div_ceil(DEC_CLUSTER_WIDE).max(1);
        let wide = few_pairs
            && !cluster
            && pairs <= DEC_CLUSTER_WIDE_MAX_PAIRS
            && esize < 4
            && wide_keys <= DEC_KEYS
            && tiled_shared_bytes(wide_keys, row_bytes, DEC_MAX_QH) <= DEC_ROWS_SMEM;
        let keys = match (by_kv_head, tiled, cluster, wide) {
            (true, _, true, _) => p.present_len.div_ceil(DEC_CLUSTER).max(1),
            (true, _, _, true) => wide_keys,
            (true, true, _, _) => tiled_keys_per_block(row_bytes),
            (true, false, false, false) => DEC_KEYS,
            (false, ..) => SPLIT_KEYS,
        };
        let splits = match (cluster, wide) {
            (true, _) => DEC_CLUSTER,
            (_, true) => DEC_CLUSTER_WIDE,
            _ => p.present_len.div_ceil(keys).max(1),
        };
        if splits > 65535 {
            unsupported!("{GQA}: present length {} needs {splits} splits (at most 65535)", p.present_len);
        }
        // By KV head the last block of each (KV head, batch row) merges the splits itself, on
        // the node's counters (one per pair), up to FOLD_MAX_SPLITS splits; past them (or past
        // MAX_COUNTERS pairs) `kiln_gqa_merge` runs after it. The cluster kernel merges through
        // its cluster where it can and folds otherwise.
        let fold = by_kv_head && splits > 1 && splits <= FOLD_MAX_SPLITS && pairs <= MAX_COUNTERS as usize;
        let merged = splits > 1 || !by_kv_head;
        let partial = if merged { scratch((p.batch * n_h * splits * (h_sz + 2) * 4) as u64)? } else { out.handle() };
        let geometry = vec![
            u("num_heads", n_h)?,
            u("kv_num_heads", n_kv)?,
            u("head size", h_sz)?,
            u("present length", p.present_len)?,
            KernelArg::U64(q_w as u64),
            KernelArg::U64(cache_rows as u64),
            u("rotary width", rot_half)?,
            flag(interleaved),
            KernelArg::F32(scale),
            KernelArg::F32(softcap),
            KernelArg::I32(window),
            flag(p.bias_dims.is_some()),
            u("attention_bias batch", bias_b)?,
            u("attention_bias heads", bias_h)?,
            u("total_sequence_length", p.total)?,
        ];
        let (kernel, grid, block, smem, mut args, last) = if by_kv_head {
            let t = vec![
                targ(&query),
                harg(pres_k),
                harg(pres_v),
                seqlens,
                cos,
                sin,
                bias,
                sink,
                harg(partial),
                targ(&out),
            ];
            // The kernel for the group rounded up to a power of two (its per-thread arrays).
            let g = match group {
                0..=1 => "1",
                2 => "2",
                3..=4 => "4",
                _ => "8",
            };
            // Without bias, softcap, sink or window the cluster kernel's plain instantiation, compiled
            // without them (0.5 µs of a layer's 6 on an H100: bench/RESULTS.md, 2026-12-06).
            let plain = sink_mode == 0 && softcap <= 0.0 && p.bias_dims.is_none() && window < 0;
            let rows_smem = tiled_shared_bytes(keys, row_bytes, DEC_MAX_QH);
            let rows = p.present_len > DEC_CLUSTER_MAX_PRESENT && rows_smem <= DEC_ROWS_SMEM;
            let (kernel, smem) = match (tiled, cluster) {
                (true, _) => ("kiln_gqa_decode_tiled", tiled_shared_bytes(keys, row_bytes, group * h_sz)),
                (false, true) if rows => ("kiln_gqa_decode_cluster_rows", rows_smem),
                (false, true) if plain => ("kiln_gqa_decode_cluster_plain", 0),
                (false, true) => ("kiln_gqa_decode_cluster", 0),
                (false, false) if wide => ("kiln_gqa_decode_cluster16_rows", rows_smem),
                (false, false) => ("kiln_gqa_decode", 0),
            };
            // A cluster kernel compiled for the node's head size and group where there is one.
            let compiled_groups: &[usize] = match kernel {
                "kiln_gqa_decode_cluster_plain" => &HG_PLAIN_GROUPS,
                "kiln_gqa_decode_cluster_rows" => &HG_GROUPS,
                "kiln_gqa_decode_cluster16_rows" if h_sz == HG_WIDE_HEAD => &HG_GROUPS,
                _ => &[],
            };
            let kernel = if p.dtype == DType::F16 && HG_HEADS.contains(&h_sz) && compiled_groups.contains(&group) {
                let (h_s, g_s) = (alloc::format!("{h_sz}"), alloc::format!("{group}"));
                kernel_name(&alloc::format!("{kernel}_hg"), &[tag, &h_s, &g_s])
            } else {
                kernel_name(kernel, &[tag, g])
            };
            (kernel, [splits as u32, n_kv as u32, p.batch as u32], 256, smem, t, KernelArg::U32(sink_mode))
        } else {
            let t = vec![targ(&query), harg(pres_k), harg(pres_v), seqlens, cos, sin, bias, harg(partial)];
            let grid = [splits as u32, p.heads as u32, p.batch as u32];
            (kernel_name("kiln_gqa_split", &[tag]), grid, 32 * SPLIT_WARPS, 0, t, KernelArg::U32(keys as u32))
        };
        args.extend(geometry);
        args.push(last);
        if by_kv_head {
            args.extend([
                k_src,
                v_src,
                past_k,
                past_v,
                u("past length", p.past_len)?,
                KernelArg::U64(kv_w as u64),
                KernelArg::U64(k_off as u64),
                KernelArg::U64(v_off as u64),
                flag(append),
                u("keys per block", keys)?,
            ]);
        }
        args.extend(layout);
        if by_kv_head {
            args.extend([flag(fold), KernelArg::Counters(pairs.clamp(1, MAX_COUNTERS as usize) as u32)]);
        }
        args.push(KernelArg::Status);
        launch(&Launch {
            kernel: &kernel,
            grid,
            block: [block, 1, 1],
            shared_mem_bytes: smem as u32, // at most DEC_TILE_BYTES (tiled: K and V tiles, the reduction ≤ 32 KiB) or DEC_ROWS_SMEM (cluster rows)
            args,
        })?;
        if !merged || fold {
            return Ok(());
        }
        return launch(&Launch {
            kernel: &kernel_name("kiln_gqa_merge", &[tag]),
            grid: [p.heads as u32, p.batch as u32, 1],
            block: [64, 1, 1],
            shared_mem_bytes: 0,
            args: vec![
                harg(partial),
                seqlens,
                sink,
                targ(&out),
                u("num_heads", n_h)?,
                u("head size", h_sz)?,
                u("present length", p.present_len)?,
                KernelArg::I32(window),
                u("splits", splits)?,
                KernelArg::U32(sink_mode),
            ],
        });
    }
    // The arguments `kiln_gqa_attn` and `kiln_gqa_prefill` share after their tensors.
    let geometry = vec![
        u("sequence", p.seq)?,
        u("num_heads", n_h)?,
        u("kv_num_heads", n_kv)?,
        u("head size", h_sz)?,
        u("present length", p.present_len)?,
        KernelArg::U64(q_w as u64),
        flag(p.first_prompt),
        KernelArg::U64(cache_rows as u64),
        u("rotary width", rot_half)?,
        flag(interleaved),
        KernelArg::F32(scale),
    ];
    if p.seq > 1 && sink_mode == 0 && softcap <= 0.0 && p.bias_dims.is_none() && h_sz <= PREFILL_MAX_HEAD {
        // A prompt: `kiln_gqa_prefill(_mma)` tiles the query rows and keys (K/V loaded once per
        // tile of query rows, not once per row).
        let mma = esize == 2 && (h_sz == 64 || h_sz == 128);
        let (kernel, rows, threads, smem) = if mma {
            let hd = if h_sz == 64 { "64" } else { "128" };
            let smem = prefill_mma_shared_bytes(h_sz);
            (kernel_name("kiln_gqa_prefill_mma", &[tag, hd]), PREFILL_MMA_ROWS, PREFILL_MMA_THREADS, smem)
        } else {
            (kernel_name("kiln_gqa_prefill", &[tag]), PREFILL_ROWS, PREFILL_THREADS, 0)
        };
        return launch(&Launch {
            kernel: &kernel,
            grid: [p.seq.div_ceil(rows) as u32, p.heads as u32, p.batch as u32],
            block: [threads, 1, 1],
            shared_mem_bytes: smem as u32, // at most 48 KiB (head size 128)
            args: [
                vec![targ(&query), harg(pres_k), harg(pres_v), seqlens, cos, sin, targ(&out)],
                geometry,
                vec![KernelArg::I32(window), u("total_sequence_length", p.total)?],
                layout.to_vec(),
                vec![KernelArg::Status],
            ]
            .concat(),
        });
    }
    let warps: u32 = if p.seq == 1 { 16 } else { 4 };
    launch(&Launch {
        kernel: &kernel_name("kiln_gqa_attn", &[tag]),
        grid: [p.seq as u32, p.heads as u32, p.batch as u32],
        block: [32 * warps, 1, 1],
        shared_mem_bytes: 0,
        args: [
            vec![targ(&query), harg(pres_k), harg(pres_v), seqlens, cos, sin, bias, sink, targ(&out)],
            geometry,
            vec![
                KernelArg::F32(softcap),
                KernelArg::I32(window),
                flag(p.bias_dims.is_some()),
                u("attention_bias batch", bias_b)?,
                u("attention_bias heads", bias_h)?,
                u("total_sequence_length", p.total)?,
                KernelArg::U32(sink_mode),
            ],
            layout.to_vec(),
            vec![KernelArg::Status],
        ]
        .concat(),
    })
}

/// RotaryEmbedding on the GPU: `kiln_rope`, one thread per element.
fn rope_dispatch(call: &Call) -> Result<()> {
    let p = rope_plan(call)?;
    let x = call.input(0)?;
    let tag = kernel_tag(ROPE, x.dtype()?)?;
    let y = call.output(0)?;
    let total = x.numel()?;
    if total == 0 {
        return Ok(());
    }
    let transposed = x.rank()? == 4;
    let u = |what: &str, v: usize| u32_arg(ROPE, what, v);
    // Without position_ids the kernel reads no ids (any tensor stands in for them).
    let ids = match p.positions.input() {
        Some(i) => targ(&call.input(i)?),
        None => targ(&x),
    };
    launch(&Launch {
        kernel: &kernel_name("kiln_rope", &[tag]),
        grid: [grid_for(total), 1, 1],
        block: [BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args: vec![
            targ(&x),
            ids,
            targ(&call.input(p.caches[0])?),
            targ(&call.input(p.caches[1])?),
            targ(&y),
            KernelArg::U64(total as u64),
            u("sequence", p.seq)?,
            u("heads", p.heads)?,
            u("head size", p.head_size)?,
            u("rotary width", p.rotary_dim / 2)?,
            KernelArg::U64(p.cache_rows as u64),
            flag(transposed),
            KernelArg::U32(p.positions.mode()),
            flag(call.attr_i("interleaved", 0)? == 1),
            KernelArg::Status,
        ],
    })
}

/// Whether the call is of ONNX's own domain (com.microsoft has an Attention op of its own).
fn is_onnx(call: &Call) -> bool {
    matches!(call.domain(), "" | "ai.onnx")
}

impl Shim for Attention {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        match call.op_type() {
            GQA => gqa_infer(call),
            ATTENTION if is_onnx(call) => onnx_attention::infer(call),
            RESHAPED if call.domain() == "ai.kiln" => onnx_attention::infer(call),
            ROPE => {
                rope_plan(call)?;
                let x = call.input(0)?;
                Ok(vec![TensorType::new(x.dtype()?, x.shape()?)])
            }
            other => unsupported!("kiln-attention does not implement {other}"),
        }
    }

    fn cpu(call: &Call) -> Result<()> {
        match call.op_type() {
            GQA => gqa_cpu(call),
            ATTENTION if is_onnx(call) => onnx_attention::cpu(call),
            RESHAPED if call.domain() == "ai.kiln" => onnx_attention::cpu(call),
            ROPE => rope_cpu(call),
            other => unsupported!("kiln-attention does not implement {other}"),
        }
    }

    fn dispatch(call: &Call) -> Result<()> {
        match call.op_type() {
            GQA => gqa_dispatch(call),
            ATTENTION if is_onnx(call) => onnx_attention::dispatch(call),
            RESHAPED if call.domain() == "ai.kiln" => onnx_attention::dispatch(call),
            ROPE => rope_dispatch(call),
            other => unsupported!("kiln-attention does not implement {other}"),
        }
    }
}

export_shim!(Attention);
