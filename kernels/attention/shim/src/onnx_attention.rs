//! ONNX's Attention-23 and -24 (`ai.onnx`), following ONNX Operators.md and the reference and
//! node tests of ONNX 1.20 (`onnx/reference/ops/op_attention.py` at 1.20).
//!
//! Inputs: `Q`, `K`, `V` all 4-D — [B, Nq, Sq, H], [B, Nkv, Skv, H], [B, Nkv, Skv, Hv] — or all
//! 3-D — [B, Sq, Nq·H], [B, Skv, Nkv·H], [B, Skv, Nkv·Hv] with the `q_num_heads` and
//! `kv_num_heads` attributes; `attn_mask` (input 3, bool or Q's dtype, broadcastable to
//! [B, Nq, Sq, T] with a last dimension of at most T, the rest of it masked); `past_key` /
//! `past_value` (inputs 4, 5: [B, Nkv, P, H] / [B, Nkv, P, Hv]); from opset 24
//! `nonpad_kv_seqlen` (input 6, int64 [B]). T = P + Skv.
//!
//! Outputs: `Y` (Q's rank: [B, Nq, Sq, Hv] or [B, Sq, Nq·Hv]), `present_key` / `present_value`
//! (the past followed by K / V, [B, Nkv, T, H] / [B, Nkv, T, Hv]) and `qk_matmul_output`
//! [B, Nq, Sq, T].
//!
//! * qk = Q·Kᵀ · `scale` (default 1/√H); query head h uses KV head h / (Nq / Nkv).
//! * The bias: the mask (bool: true keeps a key, false gives −inf), −inf for key t > P + s
//!   when `is_causal` = 1 (query row s), and −inf for t ≥ nonpad_kv_seqlen[b].
//! * x = qk + bias, then `softcap`·tanh(x / `softcap`) when softcap > 0 — the softcap after the
//!   bias, as ONNX 1.20's reference and test data have it (later ONNX releases moved it before
//!   the bias, so that a masked key keeps weight 0 under a softcap).
//! * softmax over t (a row whose keys are all masked gives NaN, as the reference does), then
//!   the weighted sum of V (0 when there is no key at all, T = 0).
//! * `qk_matmul_output_mode`: 0 qk, 1 qk + bias, 2 after the softcap, 3 the softmax.
//! * `softmax_precision` is accepted; the CPU reference computes in f64 and the GPU in f32,
//!   never below the tensors' precision.
use super::{
    check_float, flag, grid_for, kernel_tag, prefill_mma_shared_bytes, targ, u32_arg, BLOCK, PREFILL_MMA_ROWS,
    PREFILL_MMA_THREADS,
};
use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, unsupported};

pub(crate) const ATTENTION: &str = "Attention";

/// Largest Q/K and V head size of the CUDA kernel (onnx_attention.cu's ATT_MAX_CHUNKS × 32).
const GPU_MAX_HEAD: usize = 256;
/// Warps per block of `kiln_attention` (onnx_attention.cu's ATT_WARPS).
const GPU_WARPS: u32 = 4;
/// Query rows per block, keys per tile, threads and largest head size of `kiln_attention_tiled`
/// (onnx_attention.cu's ATT_TILE_*).
const TILE_ROWS: usize = 64;
const TILE_KEYS: usize = 32;
const TILE_THREADS: u32 = 128;
const TILE_MAX_HEAD: usize = 128;
/// Fewest blocks `kiln_attention_tiled` takes a node with: about two per multiprocessor of an
/// H100 or H200. Below it a block per query row spreads the work wider: at BERT-base's batch 1
/// (48 tiles of 32 rows) the first tiled kernel took BERT fp32 from 1.95 to 2.37 ms (one H100
/// run and one H200 run, session 35), where at batch 32 (1,536 tiles) it took it from 37.0 to
/// 23.9 ms.
const TILE_MIN_BLOCKS: usize = 256;

/// `kiln_attention_tiled`'s dynamic shared memory in bytes at head sizes `h` (Q and K) and `hv`
/// (V), as float: Q and K transposed ([h][rows + 4], [h][keys + 4]), a tile of V rows (`hv`
/// rounded up to 32) and the weights transposed ([keys][rows + 4]). 43,520 bytes at 64 / 64,
/// 78,336 at 128 / 128 (past 48 KiB: the host opts the kernel in to the device's maximum).
fn attention_tiled_shared_bytes(h: usize, hv: usize) -> usize {
    4 * (h * (TILE_ROWS + 4) + h * (TILE_KEYS + 4) + TILE_KEYS * hv.div_ceil(32) * 32 + TILE_KEYS * (TILE_ROWS + 4))
}

/// `attn_mask` seen through [B, Nq, Sq, width] element strides (0 where it broadcasts; the
/// last dimension is contiguous).
struct Mask {
    is_bool: bool,
    strides: [usize; 3],
    width: usize,
}

/// Geometry and attributes of an Attention node, every tensor seen 4-D (see the module docs).
struct Plan {
    dtype: DType,
    batch: usize,
    q_heads: usize,
    kv_heads: usize,
    q_seq: usize,
    kv_seq: usize,
    past: usize,
    head: usize,
    v_head: usize,
    three_d: bool,
    mask: Option<Mask>,
    nonpad: bool,
    causal: bool,
    scale: f64,
    softcap: f64,
    qk_mode: u32,
    /// A `ReshapedAttention` call's output shape (its output Reshape's target): its inputs 4..
    /// are its divisor and shapes, not past or nonpad.
    reshaped: Option<Vec<usize>>,
    /// Q's, K's and V's rows when 3-D (`three_d`; unused 4-D): the element offset of their first
    /// column and the row stride. Rows of their own ([B, S, heads · head size]), or (`packed`)
    /// column blocks of input 0.
    rows: [(usize, usize); 3],
    /// K and V are columns of input 0 (ReshapedAttention with `packed` = 1), not inputs 1 and 2.
    packed: bool,
}

impl Plan {
    fn total(&self) -> usize {
        self.past + self.kv_seq
    }

    /// Element offset of (b, h, s, 0) in a tensor of `heads` × `seq` rows of `hs` elements,
    /// stored 4-D or (three_d) 3-D.
    fn at(&self, heads: usize, seq: usize, hs: usize, b: usize, h: usize, s: usize) -> usize {
        if self.three_d {
            (b * seq + s) * heads * hs + h * hs
        } else {
            ((b * heads + h) * seq + s) * hs
        }
    }
}

/// `attn_mask` (input 3) of an attention over [B, heads, Sq, T] = `dims` and `total` keys: bool
/// or `dtype`, ranks 1 to 4, broadcasting to [B, heads, Sq, width ≤ T].
fn mask_of(call: &Call, op: &str, dtype: DType, dims: [usize; 3], total: usize) -> Result<Option<Mask>> {
    let [batch, q_heads, q_seq] = dims;
    Ok(match call.input_opt(3) {
        None => None,
        Some(m) => {
            let md = m.dtype()?;
            if md != DType::Bool && md != dtype {
                bail!("{op}: attn_mask is {md}; it must be bool or Q's dtype {dtype}");
            }
            let ms = m.shape()?;
            if ms.is_empty() || ms.len() > 4 {
                bail!("{op}: attn_mask has rank {}; ranks 1 to 4 broadcast to [B, q heads, Sq, T]", ms.len());
            }
            let width = ms[ms.len() - 1];
            if width > total {
                bail!("{op}: attn_mask's last dimension {width} is longer than the {total} keys (past + K)");
            }
            // The mask's shape padded to 4-D and its row-major strides, 0 where it broadcasts.
            let mut dims = [1usize; 4];
            dims[4 - ms.len()..].copy_from_slice(&ms);
            let want = [batch, q_heads, q_seq];
            let mut strides = [0usize; 3];
            let mut stride = width;
            for i in (0..3).rev() {
                if dims[i] != 1 && dims[i] != want[i] {
                    bail!("{op}: attn_mask {ms:?} does not broadcast to [{batch}, {q_heads}, {q_seq}, {total}]");
                }
                strides[i] = if dims[i] == 1 { 0 } else { stride };
                stride *= dims[i];
            }
            Some(Mask { is_bool: md == DType::Bool, strides, width })
        }
    })
}

fn plan(call: &Call) -> Result<Plan> {
    let (q, k, v) = (call.input(0)?, call.input(1)?, call.input(2)?);
    let dtype = q.dtype()?;
    check_float(ATTENTION, "Q", dtype)?;
    for (name, t) in [("K", &k), ("V", &v)] {
        if t.dtype()? != dtype {
            bail!("{ATTENTION}: {name} is {} but Q is {dtype}", t.dtype()?);
        }
    }
    let (qs, ks, vs) = (q.shape()?, k.shape()?, v.shape()?);
    if qs.len() != ks.len() || qs.len() != vs.len() || !(qs.len() == 3 || qs.len() == 4) {
        bail!(
            "{ATTENTION}: Q, K and V must all be 3-D or all 4-D, not of ranks {}, {}, {}",
            qs.len(),
            ks.len(),
            vs.len()
        );
    }
    let three_d = qs.len() == 3;
    let (q_heads, kv_heads, q_seq, kv_seq, head, v_head) = if three_d {
        let nq = usize::try_from(call.attr_i("q_num_heads", 0)?).unwrap_or(0);
        let nkv = usize::try_from(call.attr_i("kv_num_heads", 0)?).unwrap_or(0);
        if nq == 0 || nkv == 0 {
            bail!("{ATTENTION}: 3-D Q, K and V need positive q_num_heads and kv_num_heads attributes");
        }
        for (name, width, n) in [("Q", qs[2], nq), ("K", ks[2], nkv), ("V", vs[2], nkv)] {
            if width % n != 0 {
                bail!("{ATTENTION}: {name}'s hidden size {width} is not a multiple of its {n} heads");
            }
        }
        (nq, nkv, qs[1], ks[1], qs[2] / nq, vs[2] / nkv)
    } else {
        (qs[1], ks[1], qs[2], ks[2], qs[3], vs[3])
    };
    let kv_head = if three_d { ks[2] / kv_heads } else { ks[3] };
    let batch = qs[0];
    if ks[0] != batch || vs[0] != batch {
        bail!("{ATTENTION}: Q, K and V have batch sizes {batch}, {}, {}", ks[0], vs[0]);
    }
    if kv_head != head {
        bail!("{ATTENTION}: K's head size {kv_head} differs from Q's {head}");
    }
    let v_rows = if three_d { (vs[1], kv_heads) } else { (vs[2], vs[1]) };
    if v_rows != (kv_seq, kv_heads) {
        bail!("{ATTENTION}: V has {} heads of {} rows where K has {kv_heads} of {kv_seq}", v_rows.1, v_rows.0);
    }
    if kv_heads == 0 || q_heads % kv_heads != 0 {
        bail!("{ATTENTION}: {q_heads} query heads are not a multiple of {kv_heads} KV heads");
    }

    let past = match (call.input_opt(4), call.input_opt(5)) {
        (None, None) => 0,
        (Some(pk), Some(pv)) => {
            let (pks, pvs) = (pk.shape()?, pv.shape()?);
            if pk.dtype()? != dtype || pv.dtype()? != dtype {
                bail!("{ATTENTION}: past_key and past_value must have Q's dtype {dtype}");
            }
            if pks.len() != 4 || pvs.len() != 4 || pks[2] != pvs[2] {
                bail!(
                    "{ATTENTION}: past_key {pks:?} and past_value {pvs:?} must be [B, kv heads, P, head size] of one P"
                );
            }
            if pks != [batch, kv_heads, pks[2], head] || pvs != [batch, kv_heads, pks[2], v_head] {
                bail!(
                    "{ATTENTION}: past_key {pks:?} / past_value {pvs:?} do not match [{batch}, {kv_heads}, P, {head} / {v_head}]"
                );
            }
            pks[2]
        }
        _ => bail!("{ATTENTION}: past_key and past_value come together"),
    };
    let total = past + kv_seq;

    let mask = mask_of(call, ATTENTION, dtype, [batch, q_heads, q_seq], total)?;
    let nonpad = match call.input_opt(6) {
        None => false,
        Some(n) => {
            if n.dtype()? != DType::I64 || n.shape()? != [batch] {
                bail!("{ATTENTION}: nonpad_kv_seqlen must be int64 [{batch}], not {} {:?}", n.dtype()?, n.shape()?);
            }
            true
        }
    };
    let qk_mode = match call.attr_i("qk_matmul_output_mode", 0)? {
        m @ 0..=3 => m as u32,
        m => bail!("{ATTENTION}: qk_matmul_output_mode {m} is not 0, 1, 2 or 3"),
    };
    let scale = match call.attr("scale") {
        None => 1.0 / libm::sqrt(head as f64),
        Some(_) => call.attr_f("scale", 0.0)? as f64,
    };
    Ok(Plan {
        dtype,
        batch,
        q_heads,
        kv_heads,
        q_seq,
        kv_seq,
        past,
        head,
        v_head,
        three_d,
        mask,
        nonpad,
        causal: call.attr_i("is_causal", 0)? == 1,
        scale,
        softcap: call.attr_f("softcap", 0.0)? as f64,
        qk_mode,
        reshaped: None,
        rows: [(0, q_heads * head), (0, kv_heads * head), (0, kv_heads * v_head)],
        packed: false,
    })
}

/// kiln's `ReshapedAttention` (the `reshaped-attention` fusion's op): attention over heads that
/// Reshape and Transpose split out of 3-D rows, as exporters write eager attention (transformers'
/// BERT through torch.onnx): inputs Q [B, S, E], K [B, T, E], V [B, T, Ev], `attn_mask` (3,
/// optional, additive, Q's dtype, broadcasting to [B, H, S, T] with its last dimension T), the
/// divisor of the scores (4, one float element; with attribute `multiply` = 1 their factor, as
/// transformers' eager attention writes `· scaling`), and the four Reshape targets of Q, K, V
/// (5, 6, 7: [B, S, H, D], [B, T, H, D], [B, T, H, Dv]) and of the output (8: [B, S, H·Dv]), with
/// Reshape's `allowzero` = 0 (a 0 copies the input's dimension, one −1 is inferred).
/// Y = Reshape(Transpose(Softmax(Q'·K'ᵀ / divisor + mask) · V')), the ops it replaces. With
/// attribute `packed` = 1 (the `qkv-reshaped-attention` fusions' op), inputs 1 and 2 are empty
/// and Q, K and V are the three equal column blocks of input 0's rows ([B, S, 3E], T = S), each
/// block's targets splitting it into heads of its full width.
pub(crate) const RESHAPED: &str = "ReshapedAttention";

/// Reshape's target `shape` (allowzero 0) resolved against the input dims `from`.
fn reshape_target(from: &[usize], shape: &[i64]) -> Result<Vec<usize>> {
    let product = |dims: &[usize]| dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let Some(total) = product(from) else { bail!("{RESHAPED}: an input of shape {from:?} is too large") };
    let mut out = Vec::with_capacity(shape.len());
    let mut infer = None;
    for (i, &d) in shape.iter().enumerate() {
        match d {
            0 => out.push(*from.get(i).ok_or_else(|| {
                ShimError::Failed(alloc::format!(
                    "{RESHAPED}: shape {shape:?} copies dimension {i} of a rank-{} input",
                    from.len()
                ))
            })?),
            -1 if infer.is_none() => {
                infer = Some(i);
                out.push(1);
            }
            d if d > 0 => match usize::try_from(d) {
                Ok(d) => out.push(d),
                Err(_) => bail!("{RESHAPED}: shape {shape:?} has a dimension too large"),
            },
            _ => bail!("{RESHAPED}: shape {shape:?} is not a Reshape target"),
        }
    }
    if let Some(i) = infer {
        let known = product(&out).unwrap_or(0);
        if known == 0 || !total.is_multiple_of(known) {
            bail!("{RESHAPED}: shape {shape:?} does not fit {total} elements");
        }
        out[i] = total / known;
    }
    if product(&out) != Some(total) {
        bail!("{RESHAPED}: shape {shape:?} does not fit an input of shape {from:?}");
    }
    Ok(out)
}

/// ReshapedAttention's Q, K, V (inputs 0–2, or with `packed` the three equal column blocks of
/// input 0's rows) seen as [B, S, H, D] through their Reshape targets (inputs 5–7; a contiguous
/// tensor's elements in any shape are its target's rows), and its output's shape: the output
/// Reshape (input 8) of [B, S, H, Dv], any rank.
fn reshaped_heads(call: &Call, packed: bool) -> Result<([[usize; 4]; 3], Vec<usize>)> {
    let part = if packed {
        let mut s = call.input(0)?.shape()?;
        match s.last_mut() {
            Some(w) if *w % 3 == 0 => *w /= 3,
            _ => bail!("{RESHAPED}: packed Q, K, V rows {s:?} do not split into three equal column blocks"),
        }
        Some(s)
    } else {
        None
    };
    let mut heads = [[0usize; 4]; 3];
    for (j, name) in ["Q", "K", "V"].into_iter().enumerate() {
        let from = match &part {
            Some(s) => s.clone(),
            None => call.input(j)?.shape()?,
        };
        match reshape_target(&from, &call.input(5 + j)?.read_i64s()?)?[..] {
            [b, s, h, d] => heads[j] = [b, s, h, d],
            ref to => bail!("{RESHAPED}: {name}'s Reshape to {to:?} does not split it into [B, S, heads, head size]"),
        }
        // Packed, the kernels read each block's rows as [heads, head size] at a stride of three
        // blocks: the target must split the block's width, not only its element count.
        let width = from.last().copied().unwrap_or(0);
        if part.is_some() && heads[j][2] * heads[j][3] != width {
            bail!(
                "{RESHAPED}: packed Q, K, V blocks of {width} columns are not split into heads: {name}'s target gives {} heads of {}",
                heads[j][2],
                heads[j][3]
            );
        }
    }
    let [b, s, h, _] = heads[0];
    let y = reshape_target(&[b, s, h, heads[2][3]], &call.input(8)?.read_i64s()?)?;
    Ok((heads, y))
}

fn plan_reshaped(call: &Call) -> Result<Plan> {
    if call.num_inputs() != 9 || call.num_outputs() != 1 {
        bail!(
            "{RESHAPED}: takes 9 inputs (Q, K, V, mask or \"\", divisor, 4 shapes) and 1 output, the node has {} and {}",
            call.num_inputs(),
            call.num_outputs()
        );
    }
    let dtype = call.input(0)?.dtype()?;
    check_float(RESHAPED, "Q", dtype)?;
    let packed = match call.attr_i("packed", 0)? {
        0 => false,
        1 => true,
        m => bail!("{RESHAPED}: packed must be 0 or 1, not {m}"),
    };
    for (i, name) in [(1, "K"), (2, "V")] {
        match (call.input_opt(i), packed) {
            (Some(t), false) if t.dtype()? != dtype => bail!("{RESHAPED}: {name} is {} but Q is {dtype}", t.dtype()?),
            (Some(_), false) | (None, true) => {}
            (None, false) => bail!("{RESHAPED}: {name} (input {i}) is missing"),
            (Some(_), true) => bail!("{RESHAPED}: with packed = 1, {name} is input 0's columns and input {i} is empty"),
        }
    }
    let ([[batch, q_seq, heads, head], [kb, kv_seq, k_heads, k_head], [vb, v_seq, v_heads, v_head]], y_shape) =
        reshaped_heads(call, packed)?;
    if (kb, vb, v_seq) != (batch, batch, kv_seq) {
        bail!("{RESHAPED}: Q's {batch} batch rows, K's {kb} of {kv_seq} keys and V's {vb} of {v_seq} disagree");
    }
    if (k_heads, v_heads, k_head) != (heads, heads, head) {
        bail!("{RESHAPED}: Q is split into {heads} heads of {head}, K into {k_heads} of {k_head}, V into {v_heads}");
    }
    // Input 4 divides the scores, or (attribute `multiply` = 1, the Mul form) multiplies them.
    let scale = match (&call.input(4)?.value_f32s()?[..], call.attr_i("multiply", 0)?) {
        (&[c], 1) => c as f64,
        (&[d], 0) => 1.0 / d as f64,
        (_, 0 | 1) => bail!("{RESHAPED}: the scores' divisor or factor must be one value"),
        (_, m) => bail!("{RESHAPED}: multiply must be 0 or 1, not {m}"),
    };
    let mask = mask_of(call, RESHAPED, dtype, [batch, heads, q_seq], kv_seq)?;
    if let Some(m) = &mask {
        if m.is_bool || m.width != kv_seq {
            bail!("{RESHAPED}: attn_mask must be additive ({dtype}) with a last dimension of the {kv_seq} keys");
        }
    }
    Ok(Plan {
        dtype,
        batch,
        q_heads: heads,
        kv_heads: heads,
        q_seq,
        kv_seq,
        past: 0,
        head,
        v_head,
        three_d: true,
        mask,
        nonpad: false,
        causal: false,
        scale,
        softcap: 0.0,
        qk_mode: 0,
        reshaped: Some(y_shape),
        rows: if packed {
            let w = heads * head;
            [(0, 3 * w), (w, 3 * w), (2 * w, 3 * w)]
        } else {
            [(0, heads * head), (0, heads * head), (0, heads * v_head)]
        },
        packed,
    })
}

/// The plan of an ONNX Attention or a kiln ReshapedAttention call.
fn plan_of(call: &Call) -> Result<Plan> {
    if call.op_type() == RESHAPED {
        plan_reshaped(call)
    } else {
        plan(call)
    }
}

pub(crate) fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan_of(call)?;
    if let Some(y) = p.reshaped {
        return Ok(vec![TensorType::new(p.dtype, y)]);
    }
    let y = if p.three_d {
        vec![p.batch, p.q_seq, p.q_heads * p.v_head]
    } else {
        vec![p.batch, p.q_heads, p.q_seq, p.v_head]
    };
    let t = p.total();
    Ok(vec![
        TensorType::new(p.dtype, y),
        TensorType::new(p.dtype, vec![p.batch, p.kv_heads, t, p.head]),
        TensorType::new(p.dtype, vec![p.batch, p.kv_heads, t, p.v_head]),
        TensorType::new(p.dtype, vec![p.batch, p.q_heads, p.q_seq, t]),
    ])
}

/// present [B, Nkv, T, hs] from the past [B, Nkv, P, hs] and the new rows (input `input`).
fn present(p: &Plan, past: &[f64], new: &[f64], hs: usize) -> Vec<f64> {
    let t_n = p.total();
    let mut out = vec![0.0; p.batch * p.kv_heads * t_n * hs];
    for b in 0..p.batch {
        for j in 0..p.kv_heads {
            let base = (b * p.kv_heads + j) * t_n * hs;
            let pb = (b * p.kv_heads + j) * p.past * hs;
            out[base..base + p.past * hs].copy_from_slice(&past[pb..pb + p.past * hs]);
            for s in 0..p.kv_seq {
                let src = p.at(p.kv_heads, p.kv_seq, hs, b, j, s);
                let dst = base + (p.past + s) * hs;
                out[dst..dst + hs].copy_from_slice(&new[src..src + hs]);
            }
        }
    }
    out
}

/// ReshapedAttention on the CPU: per batch entry, the heads' scores Q·Kᵀ / divisor through the
/// host's `gemm` (a batch of H products over the heads' column slices, no copy), the mask and
/// the softmax of each row in f64, the weights rounded to the dtype (as Softmax stores them),
/// then Σ weight·V through `gemm` again, straight into Y's columns of each head.
fn cpu_reshaped(call: &Call, p: &Plan) -> Result<()> {
    let (h_n, s_n, t_n, d, dv) = (p.q_heads, p.q_seq, p.kv_seq, p.head, p.v_head);
    let ev = (h_n * dv) as u64;
    let size = p.dtype.size().unwrap_or(4) as u64;
    let [(q_off, q_rs), (k_off, k_rs), (v_off, v_rs)] = p.rows.map(|(o, r)| (o as u64, r as u64));
    let (q, y) = (call.input(0)?.handle(), call.output(0)?.handle());
    let (k, v) = if p.packed { (q, q) } else { (call.input(1)?.handle(), call.input(2)?.handle()) };
    if p.batch == 0 || s_n == 0 || h_n == 0 || dv == 0 {
        return Ok(());
    }
    if t_n == 0 {
        // No key: Σ weight·V over none is 0 (the host's gemm takes no empty sum).
        return call.output(0)?.write_vec(&alloc::vec![0f64; p.batch * s_n * h_n * dv]);
    }
    let mask = match call.input_opt(3) {
        Some(t) => t.read_vec::<f64>()?,
        None => Vec::new(),
    };
    let scores_len = (h_n * s_n * t_n) as u64;
    let scores = scratch(scores_len * size)?;
    let op = |handle: u32, offset: u64, ld: u64, batch_stride: u64| Operand {
        handle,
        offset: offset * size,
        ld,
        batch_stride,
    };
    for b in 0..p.batch {
        let (qb, kb) = ((b * s_n) as u64 * q_rs + q_off, (b * t_n) as u64 * k_rs + k_off);
        if d == 0 {
            // Empty products: every score is 0.
            write_handle(scores, 0, &alloc::vec![0u8; (scores_len * size) as usize])?;
        } else {
            gemm(&Gemm {
                dtype: p.dtype,
                trans_a: false,
                trans_b: true,
                m: s_n as u64,
                n: t_n as u64,
                k: d as u64,
                batch: h_n as u64,
                alpha: p.scale as f32,
                beta: 0.0,
                a: op(q, qb, q_rs, d as u64),
                b: op(k, kb, k_rs, d as u64),
                c: None,
                d: op(scores, 0, t_n as u64, (s_n * t_n) as u64),
                bias: None,
                epilogue: Epilogue::None,
            })?;
        }
        let mut raw = alloc::vec![0u8; (scores_len * size) as usize];
        read_handle(scores, 0, &mut raw)?;
        let mut x = element::decode_as::<f64>(p.dtype, &raw)?;
        for h in 0..h_n {
            for s in 0..s_n {
                let row = &mut x[(h * s_n + s) * t_n..][..t_n];
                if let Some(m) = &p.mask {
                    for (t, xt) in row.iter_mut().enumerate() {
                        *xt += mask[b * m.strides[0] + h * m.strides[1] + s * m.strides[2] + t];
                    }
                }
                let max = row.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v));
                let mut den = 0.0;
                for xt in row.iter_mut() {
                    *xt = libm::exp(*xt - max);
                    den += *xt;
                }
                row.iter_mut().for_each(|xt| *xt /= den);
            }
        }
        write_handle(scores, 0, &element::encode_as(p.dtype, &x)?)?;
        gemm(&Gemm {
            dtype: p.dtype,
            trans_a: false,
            trans_b: false,
            m: s_n as u64,
            n: dv as u64,
            k: t_n as u64,
            batch: h_n as u64,
            alpha: 1.0,
            beta: 0.0,
            a: op(scores, 0, t_n as u64, (s_n * t_n) as u64),
            b: op(v, (b * t_n) as u64 * v_rs + v_off, v_rs, dv as u64),
            c: None,
            d: op(y, (b * s_n) as u64 * ev, ev, dv as u64),
            bias: None,
            epilogue: Epilogue::None,
        })?;
    }
    Ok(())
}

pub(crate) fn cpu(call: &Call) -> Result<()> {
    let p = plan_of(call)?;
    if p.reshaped.is_some() {
        return cpu_reshaped(call, &p);
    }
    let read = |i: usize| -> Result<Vec<f64>> {
        match call.input_opt(i).filter(|_| p.reshaped.is_none() || i < 4) {
            Some(t) => t.read_vec::<f64>(),
            None => Ok(Vec::new()),
        }
    };
    let (q, k, v) = (read(0)?, read(1)?, read(2)?);
    let (past_k, past_v) = (read(4)?, read(5)?);
    let mask = read(3)?;
    let nonpad = match call.input_opt(6).filter(|_| p.nonpad) {
        Some(t) => t.read_i64s()?,
        None => Vec::new(),
    };
    let pres_k = present(&p, &past_k, &k, p.head);
    let pres_v = present(&p, &past_v, &v, p.v_head);
    let t_n = p.total();
    let group = p.q_heads / p.kv_heads;
    let mut y = vec![0.0; p.batch * p.q_heads * p.q_seq * p.v_head];
    let mut qk_out = vec![0.0; p.batch * p.q_heads * p.q_seq * t_n];
    let mut x = vec![0.0; t_n];
    for b in 0..p.batch {
        for h in 0..p.q_heads {
            let j = h / group;
            let kh = &pres_k[(b * p.kv_heads + j) * t_n * p.head..][..t_n * p.head];
            let vh = &pres_v[(b * p.kv_heads + j) * t_n * p.v_head..][..t_n * p.v_head];
            for s in 0..p.q_seq {
                let qr = &q[p.at(p.q_heads, p.q_seq, p.head, b, h, s)..][..p.head];
                let stage = &mut qk_out[((b * p.q_heads + h) * p.q_seq + s) * t_n..][..t_n];
                for t in 0..t_n {
                    let qk =
                        qr.iter().zip(&kh[t * p.head..(t + 1) * p.head]).map(|(a, c)| a * c).sum::<f64>() * p.scale;
                    let mut bias = 0.0;
                    if let Some(m) = &p.mask {
                        bias = if t >= m.width {
                            f64::NEG_INFINITY
                        } else {
                            let at = b * m.strides[0] + h * m.strides[1] + s * m.strides[2] + t;
                            match (m.is_bool, mask[at]) {
                                (true, keep) if keep != 0.0 => 0.0,
                                (true, _) => f64::NEG_INFINITY,
                                (false, value) => value,
                            }
                        };
                    }
                    if p.causal && t > p.past + s {
                        bias += f64::NEG_INFINITY;
                    }
                    if !nonpad.is_empty() && t as i64 >= nonpad[b] {
                        bias += f64::NEG_INFINITY;
                    }
                    let mut xt = qk + bias;
                    stage[t] = if p.qk_mode == 0 { qk } else { xt };
                    if p.softcap > 0.0 {
                        xt = p.softcap * libm::tanh(xt / p.softcap);
                        if p.qk_mode == 2 {
                            stage[t] = xt;
                        }
                    }
                    x[t] = xt;
                }
                let max = x.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v));
                let mut den = 0.0;
                for xt in x.iter_mut() {
                    *xt = libm::exp(*xt - max);
                    den += *xt;
                }
                let yr = p.at(p.q_heads, p.q_seq, p.v_head, b, h, s);
                for (t, &w) in x.iter().enumerate() {
                    let w = w / den;
                    if p.qk_mode == 3 {
                        stage[t] = w;
                    }
                    for (o, vd) in y[yr..yr + p.v_head].iter_mut().zip(&vh[t * p.v_head..(t + 1) * p.v_head]) {
                        *o += w * vd;
                    }
                }
            }
        }
    }
    call.output(0)?.write_vec(&y)?;
    for (i, values) in [(1, &pres_k), (2, &pres_v), (3, &qk_out)] {
        if let Some(t) = call.output_opt(i) {
            t.write_vec(values)?;
        }
    }
    Ok(())
}

/// A grid dimension of `kiln_attention` for `op`, or unsupported over CUDA's limit for it.
fn grid_dim(op: &str, what: &str, v: usize, max: u32) -> Result<u32> {
    match u32::try_from(v) {
        Ok(d) if d <= max => Ok(d),
        _ => unsupported!("{op}: {what} = {v} is over the CUDA grid's {max} blocks"),
    }
}

/// The head size (its template argument) of `kiln_attention_mma` when it computes `p`: float16 or
/// bfloat16, Q and V head sizes both 64 or both 128, no past, no softcap, and no
/// qk_matmul_output (`has_qk`); otherwise `kiln_attention` does.
fn mma_head(p: &Plan, has_qk: bool) -> Option<&'static str> {
    let plain = matches!(p.dtype, DType::F16 | DType::BF16) && p.past == 0 && p.softcap == 0.0 && !has_qk;
    match (p.head, p.v_head) {
        (64, 64) if plain => Some("64"),
        (128, 128) if plain => Some("128"),
        _ => None,
    }
}

pub(crate) fn dispatch(call: &Call) -> Result<()> {
    let p = plan_of(call)?;
    let op = call.op_type();
    let tag = kernel_tag(op, p.dtype)?;
    if p.head > GPU_MAX_HEAD || p.v_head > GPU_MAX_HEAD {
        unsupported!("{op}: head sizes {} / {} over the CUDA kernel's {GPU_MAX_HEAD}", p.head, p.v_head);
    }
    let u = |what: &str, v: usize| u32_arg(op, what, v);
    let q = call.input(0)?;
    // K and V: their inputs, or (packed) input 0 from their first column.
    let esize = p.dtype.size().unwrap_or(4) as u64;
    let (k, v) = if p.packed {
        let at = |col: usize| KernelArg::Tensor { handle: q.handle(), offset: col as u64 * esize };
        (at(p.rows[1].0), at(p.rows[2].0))
    } else {
        (targ(&call.input(1)?), targ(&call.input(2)?))
    };
    let row_strides = p.rows.map(|(_, rs)| KernelArg::U64(rs as u64));
    // Absent optional inputs and outputs: any tensor stands in (the kernels do not touch them).
    // (A ReshapedAttention's inputs 4.. are no past or nonpad.)
    let or_q = |t: Option<Tensor>| t.filter(|_| p.reshaped.is_none()).as_ref().map_or(targ(&q), targ);
    for (out, new, hs, past) in [(1, &k, p.head, 4), (2, &v, p.v_head, 5)] {
        let Some(pres) = call.output_opt(out) else { continue };
        let n = pres.numel()?;
        if n == 0 {
            continue;
        }
        launch(&Launch {
            kernel: &kernel_name("kiln_attention_present", &[tag]),
            grid: [grid_for(n), 1, 1],
            block: [BLOCK, 1, 1],
            shared_mem_bytes: 0,
            args: vec![
                or_q(call.input_opt(past)),
                *new,
                targ(&pres),
                KernelArg::U64(n as u64),
                u("kv heads", p.kv_heads)?,
                u("past length", p.past)?,
                u("kv sequence", p.kv_seq)?,
                u("head size", hs)?,
                flag(p.three_d),
            ],
        })?;
    }
    if p.batch == 0 || p.q_seq == 0 || p.q_heads == 0 {
        return Ok(());
    }
    let (mask_mode, strides, width) = match &p.mask {
        None => (0, [0; 3], 0),
        Some(m) => (if m.is_bool { 2 } else { 1 }, m.strides, m.width),
    };
    let qk = call.output_opt(3);
    let mask = call.input_opt(3).as_ref().map_or(targ(&q), targ);
    // Both kernels' arguments from `three_d` to `scale`: the layout, the mask and the scale.
    let layout_args = [
        flag(p.three_d),
        row_strides[0],
        row_strides[1],
        row_strides[2],
        KernelArg::U64(strides[0] as u64),
        KernelArg::U64(strides[1] as u64),
        KernelArg::U64(strides[2] as u64),
        KernelArg::U32(mask_mode),
        u("mask width", width)?,
        flag(p.causal),
        flag(p.nonpad),
        KernelArg::F32(p.scale as f32),
    ];
    if let Some(hd) = mma_head(&p, qk.is_some()) {
        // Tensor cores: a block per 64 query rows of a head (onnx_attention.cu's ATT_MMA_* and
        // att_mma_keys, the same geometry as GroupQueryAttention's prompt kernel).
        return launch(&Launch {
            kernel: &kernel_name("kiln_attention_mma", &[tag, hd]),
            grid: [
                grid_dim(op, "query tiles", p.q_seq.div_ceil(PREFILL_MMA_ROWS), u32::MAX >> 1)?,
                grid_dim(op, "query heads", p.q_heads, 65535)?,
                grid_dim(op, "batch", p.batch, 65535)?,
            ],
            block: [PREFILL_MMA_THREADS, 1, 1],
            shared_mem_bytes: prefill_mma_shared_bytes(p.head) as u32, // at most 48 KiB (head size 128)
            args: [
                vec![
                    targ(&q),
                    k,
                    v,
                    mask,
                    or_q(call.input_opt(6)),
                    targ(&call.output(0)?),
                    u("query heads", p.q_heads)?,
                    u("kv heads", p.kv_heads)?,
                    u("query sequence", p.q_seq)?,
                    u("kv sequence", p.kv_seq)?,
                ],
                layout_args.to_vec(),
            ]
            .concat(),
        });
    }
    // Without qk_matmul_output, at head sizes up to 128 (float32 above all) and with enough tiles to
    // fill the GPU, tiles of query rows that share their K and V reads; otherwise a block per
    // query row.
    let tiles = p.q_seq.div_ceil(TILE_ROWS).saturating_mul(p.q_heads).saturating_mul(p.batch);
    let tiled = qk.is_none() && p.head <= TILE_MAX_HEAD && p.v_head <= TILE_MAX_HEAD && tiles >= TILE_MIN_BLOCKS;
    let (kernel, rows, block, shared) = if tiled {
        let bytes = attention_tiled_shared_bytes(p.head, p.v_head) as u32;
        ("kiln_attention_tiled", p.q_seq.div_ceil(TILE_ROWS), TILE_THREADS, bytes)
    } else {
        ("kiln_attention", p.q_seq, GPU_WARPS * 32, 0)
    };
    launch(&Launch {
        kernel: &kernel_name(kernel, &[tag]),
        grid: [
            grid_dim(op, "query blocks", rows, u32::MAX >> 1)?,
            grid_dim(op, "query heads", p.q_heads, 65535)?,
            grid_dim(op, "batch", p.batch, 65535)?,
        ],
        block: [block, 1, 1],
        shared_mem_bytes: shared,
        args: [
            vec![
                targ(&q),
                k,
                v,
                or_q(call.input_opt(4)),
                or_q(call.input_opt(5)),
                mask,
                or_q(call.input_opt(6)),
                targ(&call.output(0)?),
                qk.as_ref().map_or(targ(&q), targ),
                u("query heads", p.q_heads)?,
                u("kv heads", p.kv_heads)?,
                u("query sequence", p.q_seq)?,
                u("kv sequence", p.kv_seq)?,
                u("past length", p.past)?,
                u("head size", p.head)?,
                u("value head size", p.v_head)?,
            ],
            layout_args.to_vec(),
            vec![KernelArg::F32(p.softcap as f32), flag(qk.is_some()), KernelArg::U32(p.qk_mode)],
        ]
        .concat(),
    })
}
