//! `kiln-attention`: com.microsoft GroupQueryAttention and RotaryEmbedding against float64
//! references written here, on random shapes and configurations (prompt with right padding,
//! decode, later prompt chunks; shared and separate KV buffers; packed QKV; rotary;
//! local windows; softcap; smooth softmax; head sinks; attention bias; f32/f16/bf16).

use std::sync::Arc;

use bytes::Bytes;
use kiln_host::ep::{Runtime, Session, SessionOptions};
use kiln_host::{model, Error, Tensor};
use kiln_kernel_abi::DType;
use kiln_tests::onnx::{self, attr_float, node, value};
use kiln_tests::Rng;
use protobuf::EnumOrUnknown;

fn runtime() -> Arc<Runtime> {
    kiln_tests::builtin_runtime()
}

fn attr_int(name: &str, v: i64) -> onnx::AttributeProto {
    onnx::AttributeProto {
        name: name.into(),
        type_: EnumOrUnknown::new(onnx::attribute_proto::AttributeType::INT),
        i: v,
        ..Default::default()
    }
}

fn dtype_code(d: DType) -> i32 {
    match d {
        DType::F32 => 1,
        DType::F16 => 10,
        DType::BF16 => 16,
        DType::I32 => 6,
        DType::I64 => 7,
        other => panic!("{other:?}"),
    }
}

fn f16_bits(v: f64) -> u16 {
    // Values of the tests are multiples of 1/64 in [-4, 4]: normal and exact in float16.
    if v == 0.0 {
        return 0;
    }
    let sign = if v < 0.0 { 0x8000 } else { 0 };
    let (mut m, mut e) = (v.abs(), 0i32);
    while m >= 2.0 {
        m /= 2.0;
        e += 1;
    }
    while m < 1.0 {
        m *= 2.0;
        e -= 1;
    }
    let frac = ((m - 1.0) * 1024.0).round() as u16;
    assert!((m - 1.0) * 1024.0 == frac as f64 && (-14..=15).contains(&e), "{v} is not exact in float16");
    sign | (((e + 15) as u16) << 10) | frac
}

fn f16_value(b: u16) -> f64 {
    let sign = if b & 0x8000 != 0 { -1.0 } else { 1.0 };
    let (e, f) = (((b >> 10) & 0x1f) as i32, (b & 0x3ff) as f64);
    sign * match e {
        0 => f / 1024.0 * 2f64.powi(-14),
        31 => f64::NAN,
        _ => (1.0 + f / 1024.0) * 2f64.powi(e - 15),
    }
}

/// A float tensor of `dtype` holding `v` (exactly representable).
fn float_tensor(dtype: DType, shape: &[usize], v: &[f64]) -> Tensor {
    let data: Vec<u8> = match dtype {
        DType::F32 => v.iter().flat_map(|x| (*x as f32).to_le_bytes()).collect(),
        DType::F16 => v.iter().flat_map(|x| f16_bits(*x).to_le_bytes()).collect(),
        DType::BF16 => v
            .iter()
            .flat_map(|x| {
                let bits = (*x as f32).to_bits();
                assert_eq!(bits & 0xffff, 0, "{x} is not exact in bfloat16");
                ((bits >> 16) as u16).to_le_bytes()
            })
            .collect(),
        other => panic!("{other:?}"),
    };
    Tensor::new(dtype, shape.to_vec(), Bytes::from(data)).unwrap()
}

fn float_values(t: &Tensor) -> Vec<f64> {
    match t.dtype {
        DType::F32 => t.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64).collect(),
        DType::F16 => t.data.chunks_exact(2).map(|c| f16_value(u16::from_le_bytes([c[0], c[1]]))).collect(),
        DType::BF16 => t
            .data
            .chunks_exact(2)
            .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16) as f64)
            .collect(),
        other => panic!("{other:?}"),
    }
}

fn i32_tensor(shape: &[usize], v: &[i32]) -> Tensor {
    Tensor::new(DType::I32, shape.to_vec(), Bytes::from(v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>()))
        .unwrap()
}

fn i64_tensor(shape: &[usize], v: &[i64]) -> Tensor {
    Tensor::new(DType::I64, shape.to_vec(), Bytes::from(v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<_>>()))
        .unwrap()
}

/// Runs a one-node com.microsoft model; `inputs` are (slot name or "" for absent, tensor).
fn run_node(
    rt: &Arc<Runtime>,
    op: &str,
    inputs: Vec<(&str, Option<Tensor>)>,
    outputs: &[&str],
    attrs: Vec<onnx::AttributeProto>,
) -> Result<Vec<Tensor>, Error> {
    run_node_in(rt, ("com.microsoft", 1), op, inputs, outputs, attrs)
}

/// Runs a one-node model of `op` in (domain, opset), "" being ONNX's default domain.
fn run_node_in(
    rt: &Arc<Runtime>,
    (domain, opset): (&str, i64),
    op: &str,
    inputs: Vec<(&str, Option<Tensor>)>,
    outputs: &[&str],
    attrs: Vec<onnx::AttributeProto>,
) -> Result<Vec<Tensor>, Error> {
    let model = node_model((domain, opset), op, &inputs, outputs, attrs)?;
    let feeds = inputs.into_iter().filter_map(|(n, t)| t.map(|t| (n.to_string(), t))).collect();
    // Every run also validates the GPU launch plan (kiln_dispatch on opaque tensors).
    let mut session = Session::new(rt.clone(), model, SessionOptions { check_dispatch: true, ..Default::default() })?;
    let out = session.run(feeds)?;
    assert!(
        session.report.dispatch_unsupported.is_empty(),
        "{op}: no GPU dispatch: {:?}",
        session.report.dispatch_unsupported
    );
    assert!(session.report.dispatch_steps > 0, "{op}: an empty launch plan");
    Ok(out.into_iter().map(|(_, t)| t).collect())
}

/// A one-node model of `op` in (domain, opset) whose inputs are declared with the types of
/// `inputs` (absent ones `None`) and whose outputs are inferred.
fn node_model(
    (domain, opset): (&str, i64),
    op: &str,
    inputs: &[(&str, Option<Tensor>)],
    outputs: &[&str],
    attrs: Vec<onnx::AttributeProto>,
) -> Result<model::Model, Error> {
    let names: Vec<&str> = inputs.iter().map(|(n, t)| if t.is_some() { *n } else { "" }).collect();
    let decl: Vec<_> = inputs
        .iter()
        .filter_map(|(n, t)| {
            t.as_ref().map(|t| value(n, dtype_code(t.dtype), &t.shape.iter().map(|&d| d as i64).collect::<Vec<_>>()))
        })
        .collect();
    let out_decl: Vec<_> = outputs.iter().map(|n| value(n, 0, &[])).map(untyped).collect();
    let mut n = node(op, &names, outputs, attrs);
    n.domain = domain.into();
    let mut m = onnx::model(vec![n], decl, out_decl, vec![]);
    match m.opset_import.iter_mut().find(|o| o.domain == domain) {
        Some(o) => o.version = opset,
        None => m.opset_import.push(onnx::OperatorSetIdProto {
            domain: domain.into(),
            version: opset,
            ..Default::default()
        }),
    }
    model::load_bytes(&onnx::bytes(&m), None)
}

/// An output declaration without a type (inferred).
fn untyped(mut v: onnx::ValueInfoProto) -> onnx::ValueInfoProto {
    v.type_ = Default::default();
    v
}

fn assert_close(what: &str, got: &[f64], want: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let max = want.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= rel * max, "{what}[{i}]: got {g}, want {w} (max |ref| {max}, rel tol {rel})");
    }
}

/// Rotates one head (f64) in place at `pos` with caches of `half` columns.
fn rope_ref(x: &mut [f64], cos: &[f64], sin: &[f64], half: usize, pos: usize, interleaved: bool) {
    let (c, s) = (&cos[pos * half..(pos + 1) * half], &sin[pos * half..(pos + 1) * half]);
    let orig = x.to_vec();
    for i in 0..half {
        let (a, b) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
        x[a] = orig[a] * c[i] - orig[b] * s[i];
        x[b] = orig[a] * s[i] + orig[b] * c[i];
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// First prompt: S = total, rows right-padded through seqlens_k.
    Prompt,
    /// S = 1 with a past.
    Decode,
    /// A later prompt chunk (batch 1, S > 1, past given).
    Chunk,
}

#[derive(Clone, Debug)]
struct Case {
    dtype: DType,
    mode: Mode,
    batch: usize,
    seq: usize,
    heads: usize,
    kv_heads: usize,
    head_size: usize,
    packed: bool,
    shared: bool,
    /// Rotary: cache width (R/2), interleaved.
    rotary: Option<(usize, bool)>,
    window: i64,
    softcap: f32,
    scale: f32,
    smooth: bool,
    sink: bool,
    bias: bool,
    /// Valid length per batch row.
    lens: Vec<usize>,
    total: usize,
    past_len: usize,
}

fn random_case(r: &mut Rng, dtype: DType) -> Case {
    let mode = r.pick(&[Mode::Prompt, Mode::Decode, Mode::Decode, Mode::Chunk]);
    let batch = if mode == Mode::Chunk { 1 } else { r.range(1, 3) };
    let kv_heads = r.range(1, 2);
    let heads = kv_heads * r.pick(&[1, 2, 4]);
    let head_size = r.pick(&[8, 16, 32, 64]);
    let shared = r.coin();
    let (seq, lens, total, past_len);
    match mode {
        Mode::Prompt => {
            // From 8 rows a float32 prompt multiplies through the host's gemm.
            seq = r.range(1, 12);
            lens = (0..batch).map(|_| r.range(1, seq)).collect::<Vec<_>>();
            total = seq;
            past_len = if shared { total + r.range(0, 3) } else { 0 };
        }
        Mode::Decode => {
            seq = 1;
            let max = r.range(2, 9);
            let mut l: Vec<_> = (0..batch).map(|_| r.range(1, max)).collect();
            l[r.range(0, batch - 1)] = max;
            lens = l;
            total = max;
            past_len = if shared { total + r.range(0, 3) } else { total - 1 };
        }
        Mode::Chunk => {
            seq = r.range(2, 10);
            let past = r.range(1, 5);
            lens = vec![past + seq];
            total = past + seq;
            past_len = if shared { total + r.range(0, 3) } else { past };
        }
    }
    let rotary = if r.coin() { Some((r.pick(&[head_size / 2, head_size / 4]), r.coin())) } else { None };
    Case {
        dtype,
        mode,
        batch,
        seq,
        heads,
        kv_heads,
        head_size,
        packed: r.coin(),
        shared,
        rotary,
        window: if r.range(0, 2) == 0 { r.range(1, 5) as i64 } else { -1 },
        softcap: if r.range(0, 3) == 0 { 1.5 } else { 0.0 },
        scale: r.pick(&[0.0, 0.0, 0.3]),
        smooth: r.range(0, 4) == 0,
        sink: r.range(0, 5) == 0,
        bias: r.range(0, 5) == 0,
        lens,
        total,
        past_len,
    }
}

struct Data {
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    past_k: Vec<f64>,
    past_v: Vec<f64>,
    cos: Vec<f64>,
    sin: Vec<f64>,
    cache_rows: usize,
    sink: Vec<f64>,
    bias: Vec<f64>,
    bias_dims: [usize; 4],
}

fn random_data(r: &mut Rng, c: &Case) -> Data {
    let (b, s, h) = (c.batch, c.seq, c.head_size);
    let cache_rows = c.total.max(c.past_len) + r.range(0, 2);
    let half = c.rotary.map_or(0, |x| x.0);
    let bias_dims = [r.pick(&[1, b]), r.pick(&[1, c.heads]), s, c.total];
    Data {
        q: r.vals(b * s * c.heads * h),
        k: r.vals(b * s * c.kv_heads * h),
        v: r.vals(b * s * c.kv_heads * h),
        past_k: r.vals(b * c.kv_heads * c.past_len * h),
        past_v: r.vals(b * c.kv_heads * c.past_len * h),
        cos: r.vals(cache_rows * half),
        sin: r.vals(cache_rows * half),
        cache_rows,
        sink: r.vals(c.heads),
        bias: r.vals(bias_dims.iter().product()),
        bias_dims,
    }
}

/// float64 GroupQueryAttention: (output [B,S,N·H], present K, present V [B,Nk,PL,H]).
fn gqa_ref(c: &Case, d: &Data) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (h, nk, n, s_n) = (c.head_size, c.kv_heads, c.heads, c.seq);
    let pl = c.total.max(c.past_len);
    let mut pres_k = vec![0.0; c.batch * nk * pl * h];
    let mut pres_v = pres_k.clone();
    let mut out = vec![0.0; c.batch * s_n * n * h];
    let at = |b: usize, j: usize, t: usize| ((b * nk + j) * pl + t) * h;
    let past_at = |b: usize, j: usize, t: usize| ((b * nk + j) * c.past_len + t) * h;
    for b in 0..c.batch {
        let len = c.lens[b];
        let past = if c.mode == Mode::Prompt { 0 } else { len - s_n };
        for j in 0..nk {
            // The cache before this step: the whole shared buffer, or the valid past rows.
            let rows = if c.shared { c.past_len } else { past };
            for t in 0..rows {
                pres_k[at(b, j, t)..][..h].copy_from_slice(&d.past_k[past_at(b, j, t)..][..h]);
                pres_v[at(b, j, t)..][..h].copy_from_slice(&d.past_v[past_at(b, j, t)..][..h]);
            }
            for s in 0..s_n {
                let mut key = d.k[((b * s_n + s) * nk + j) * h..][..h].to_vec();
                if let Some((half, il)) = c.rotary {
                    rope_ref(&mut key, &d.cos, &d.sin, half, past + s, il);
                }
                pres_k[at(b, j, past + s)..][..h].copy_from_slice(&key);
                pres_v[at(b, j, past + s)..][..h].copy_from_slice(&d.v[((b * s_n + s) * nk + j) * h..][..h]);
            }
        }
        for head in 0..n {
            let j = head * nk / n;
            for s in 0..s_n {
                let pos = past + s;
                let mut q = d.q[((b * s_n + s) * n + head) * h..][..h].to_vec();
                if let Some((half, il)) = c.rotary {
                    rope_ref(&mut q, &d.cos, &d.sin, half, pos, il);
                }
                let scale = if c.scale == 0.0 { 1.0 / (h as f64).sqrt() } else { c.scale as f64 };
                let keys: Vec<usize> =
                    (0..len).filter(|&t| t <= pos && (c.window < 0 || (t as i64) > pos as i64 - c.window)).collect();
                if keys.is_empty() {
                    continue;
                }
                let logits: Vec<f64> = keys
                    .iter()
                    .map(|&t| {
                        let kr = &pres_k[at(b, j, t)..][..h];
                        let mut x = scale * q.iter().zip(kr).map(|(a, b)| a * b).sum::<f64>();
                        if c.softcap > 0.0 {
                            let cap = c.softcap as f64;
                            x = cap * (x / cap).tanh();
                        }
                        if c.bias {
                            let bd = d.bias_dims;
                            let (bb, bh) = (b.min(bd[0] - 1), head.min(bd[1] - 1));
                            x += d.bias[((bb * bd[1] + bh) * bd[2] + s) * bd[3] + t];
                        }
                        x
                    })
                    .collect();
                let sink = if c.sink {
                    Some(d.sink[head])
                } else if c.smooth {
                    Some(0.0)
                } else {
                    None
                };
                let m = logits.iter().cloned().chain(sink).fold(f64::NEG_INFINITY, f64::max);
                let den: f64 = logits.iter().map(|x| (x - m).exp()).sum::<f64>() + sink.map_or(0.0, |x| (x - m).exp());
                for (x, &t) in logits.iter().zip(&keys) {
                    let w = (x - m).exp() / den;
                    for i in 0..h {
                        out[((b * s_n + s) * n + head) * h + i] += w * pres_v[at(b, j, t) + i];
                    }
                }
            }
        }
    }
    (out, pres_k, pres_v)
}

fn run_gqa(rt: &Arc<Runtime>, c: &Case, d: &Data) -> Result<Vec<Tensor>, Error> {
    let (inputs, attrs) = gqa_node(c, d);
    run_node(rt, "GroupQueryAttention", inputs, &["output", "present_key", "present_value"], attrs)
}

/// GroupQueryAttention's inputs (by name, absent ones `None`) and attributes for case `c` on
/// data `d`.
fn gqa_node(c: &Case, d: &Data) -> (Vec<(&'static str, Option<Tensor>)>, Vec<onnx::AttributeProto>) {
    let (b, s, h, dt) = (c.batch, c.seq, c.head_size, c.dtype);
    let (query, key, value_t) = if c.packed {
        // Interleave per token: [q heads | k heads | v heads].
        let (qw, kw) = (c.heads * h, c.kv_heads * h);
        let mut p = Vec::new();
        for t in 0..b * s {
            p.extend_from_slice(&d.q[t * qw..(t + 1) * qw]);
            p.extend_from_slice(&d.k[t * kw..(t + 1) * kw]);
            p.extend_from_slice(&d.v[t * kw..(t + 1) * kw]);
        }
        (float_tensor(dt, &[b, s, qw + 2 * kw], &p), None, None)
    } else {
        (
            float_tensor(dt, &[b, s, c.heads * h], &d.q),
            Some(float_tensor(dt, &[b, s, c.kv_heads * h], &d.k)),
            Some(float_tensor(dt, &[b, s, c.kv_heads * h], &d.v)),
        )
    };
    let has_past = c.past_len > 0;
    let past = |v: &[f64]| has_past.then(|| float_tensor(dt, &[b, c.kv_heads, c.past_len, h], v));
    let seqlens: Vec<i32> = c.lens.iter().map(|&l| l as i32 - 1).collect();
    let half = c.rotary.map_or(0, |x| x.0);
    let cache = |v: &[f64]| c.rotary.map(|_| float_tensor(dt, &[d.cache_rows, half], v));
    let inputs = vec![
        ("query", Some(query)),
        ("key", key),
        ("value", value_t),
        ("past_key", past(&d.past_k)),
        ("past_value", past(&d.past_v)),
        ("seqlens_k", Some(i32_tensor(&[b], &seqlens))),
        ("total_sequence_length", Some(i32_tensor(&[], &[c.total as i32]))),
        ("cos_cache", cache(&d.cos)),
        ("sin_cache", cache(&d.sin)),
        ("position_ids", None),
        ("attention_bias", c.bias.then(|| float_tensor(dt, &d.bias_dims, &d.bias))),
        ("head_sink", c.sink.then(|| float_tensor(dt, &[c.heads], &d.sink))),
    ];
    let mut attrs = vec![
        attr_int("num_heads", c.heads as i64),
        attr_int("kv_num_heads", c.kv_heads as i64),
        attr_float("scale", c.scale),
        attr_float("softcap", c.softcap),
        attr_int("local_window_size", c.window),
        attr_int("do_rotary", c.rotary.is_some() as i64),
        attr_int("rotary_interleaved", c.rotary.is_some_and(|x| x.1) as i64),
    ];
    if c.smooth {
        attrs.push(attr_int("smooth_softmax", 1));
    }
    (inputs, attrs)
}

fn check_gqa(rt: &Arc<Runtime>, c: &Case, d: &Data, rel: f64) {
    let out = run_gqa(rt, c, d).unwrap_or_else(|e| panic!("{c:?}: {e}"));
    let (o, pk, pv) = gqa_ref(c, d);
    let pl = c.total.max(c.past_len);
    assert_eq!(out[0].shape, vec![c.batch, c.seq, c.heads * c.head_size], "{c:?}");
    assert_eq!(out[1].shape, vec![c.batch, c.kv_heads, pl, c.head_size], "{c:?}");
    assert_eq!(out[2].shape, out[1].shape, "{c:?}");
    let ctx = format!("{c:?}");
    assert_close(&format!("output of {ctx}"), &float_values(&out[0]), &o, rel);
    assert_close(&format!("present_key of {ctx}"), &float_values(&out[1]), &pk, rel);
    assert_close(&format!("present_value of {ctx}"), &float_values(&out[2]), &pv, rel);
}

#[test]
fn group_query_attention_matches_float64_on_random_configurations() {
    let rt = runtime();
    let mut r = Rng(0x6a09_e667_f3bc_c908);
    let mut seen = [0usize; 3];
    let mut through_gemm = 0;
    for _ in 0..60 {
        let c = random_case(&mut r, DType::F32);
        seen[c.mode as usize] += 1;
        through_gemm += (c.seq >= 8) as usize;
        let d = random_data(&mut r, &c);
        check_gqa(&rt, &c, &d, 1e-5);
    }
    assert!(seen.iter().all(|&n| n > 5), "{seen:?}");
    assert!(through_gemm >= 4, "{through_gemm} prompts of 8 rows or more (the host-gemm path)");
}

/// Decode steps over 16 to 300 keys: from 16 a float32 step multiplies through the host's gemm
/// (the CPU reference's longer-context path), shared buffers or growing pasts, padded batch rows,
/// windows, softcaps, sinks and biases as `random_case` draws them.
#[test]
fn group_query_attention_decodes_long_contexts_through_the_host_gemm() {
    let rt = runtime();
    let mut r = Rng(0xbb67_ae85_84ca_a73b);
    let mut cases = 0;
    while cases < 12 {
        let mut c = random_case(&mut r, DType::F32);
        if c.mode != Mode::Decode {
            continue;
        }
        let max = r.range(16, 300);
        let mut lens: Vec<_> = (0..c.batch).map(|_| r.range(1, max)).collect();
        lens[r.range(0, c.batch - 1)] = max;
        c.lens = lens;
        c.total = max;
        c.past_len = if c.shared { max + r.range(0, 3) } else { max - 1 };
        let d = random_data(&mut r, &c);
        check_gqa(&rt, &c, &d, 1e-5);
        cases += 1;
    }
}

#[test]
fn group_query_attention_in_float16_and_bfloat16() {
    let rt = runtime();
    let mut r = Rng(42);
    for (dtype, rel) in [(DType::F16, 4e-3), (DType::BF16, 3e-2)] {
        for _ in 0..8 {
            let c = random_case(&mut r, dtype);
            let d = random_data(&mut r, &c);
            check_gqa(&rt, &c, &d, rel);
        }
    }
}

/// tiny-llama-v512's attention (do_rotary 1, non-interleaved, scale 0.25, 4 heads, 2 KV heads,
/// head size 16) in float32 over a shared buffer of `max_len` positions: batch rows of `lens`
/// tokens, `seq` of them new.
fn tiny_llama_case(mode: Mode, seq: usize, lens: Vec<usize>, max_len: usize) -> Case {
    Case {
        dtype: DType::F32,
        mode,
        batch: lens.len(),
        seq,
        heads: 4,
        kv_heads: 2,
        head_size: 16,
        packed: false,
        shared: true,
        rotary: Some((8, false)),
        window: -1,
        softcap: 0.0,
        scale: 0.25,
        smooth: false,
        sink: false,
        bias: false,
        total: lens.iter().copied().max().unwrap_or(0),
        lens,
        past_len: max_len,
    }
}

/// tiny-llama-v512's configuration (do_rotary 1, non-interleaved, scale 0.25, 4 heads, 2 KV
/// heads, head size 16), a padded two-row prompt, then decoding into the shared buffer fed
/// back as the next past.
#[test]
fn group_query_attention_prompt_then_decode_through_a_shared_buffer() {
    let rt = runtime();
    let mut r = Rng(7);
    let max_len = 12;
    let mut c = tiny_llama_case(Mode::Prompt, 5, vec![5, 3], max_len);
    let mut d = random_data(&mut r, &c);
    d.past_k = vec![0.0; 2 * 2 * max_len * 16];
    d.past_v = d.past_k.clone();
    for step in 0..4 {
        let out = run_gqa(&rt, &c, &d).unwrap();
        let (o, pk, pv) = gqa_ref(&c, &d);
        assert_close(&format!("step {step} output"), &float_values(&out[0]), &o, 1e-5);
        assert_close(&format!("step {step} present_key"), &float_values(&out[1]), &pk, 1e-5);
        assert_close(&format!("step {step} present_value"), &float_values(&out[2]), &pv, 1e-5);
        // The next step: one token per row, the present buffer as the past.
        d.past_k = float_values(&out[1]);
        d.past_v = float_values(&out[2]);
        c.mode = Mode::Decode;
        c.seq = 1;
        c.lens = c.lens.iter().map(|l| l + 1).collect();
        c.total = *c.lens.iter().max().unwrap();
        d.q = r.vals(2 * 4 * 16);
        d.k = r.vals(2 * 2 * 16);
        d.v = r.vals(2 * 2 * 16);
    }
}

/// The KV cache shape of the in-place decode tests: 2 rows, 2 KV heads, 24 positions, head size 16.
const IN_PLACE_SHAPE: [usize; 4] = [2, 2, 24, 16];

/// A CPU session of one GroupQueryAttention decode node (tiny-llama's heads, rows of 9 and 6
/// keys in a shared buffer of 24 positions, random data from `seed`) with its past K and V
/// written into held tensors.
fn in_place_setup(seed: u64) -> (Session, Case, Data, kiln_host::ep::DeviceTensor, kiln_host::ep::DeviceTensor) {
    let rt = runtime();
    let mut r = Rng(seed);
    let c = tiny_llama_case(Mode::Decode, 1, vec![9, 6], IN_PLACE_SHAPE[2]);
    let d = random_data(&mut r, &c);
    let (inputs, attrs) = gqa_node(&c, &d);
    let outputs = ["output", "present_key", "present_value"];
    let model = node_model(("com.microsoft", 1), "GroupQueryAttention", &inputs, &outputs, attrs).unwrap();
    let mut session = Session::new(rt, model, SessionOptions::default()).unwrap();
    let mut held = |v: &[f64]| {
        let t = session.zeros(DType::F32, IN_PLACE_SHAPE.to_vec()).unwrap();
        session.write_tensor(&t, &float_tensor(DType::F32, &IN_PLACE_SHAPE, v)).unwrap();
        t
    };
    let (pk, pv) = (held(&d.past_k), held(&d.past_v));
    (session, c, d, pk, pv)
}

/// The node's feeds for case `c` and data `d`, its pasts from held `pk` and `pv`, and `seqlens_k`
/// replaced by `seqlens` where given.
fn past_feeds<'t>(
    c: &Case,
    d: &Data,
    (pk, pv): (&'t kiln_host::ep::DeviceTensor, &'t kiln_host::ep::DeviceTensor),
    seqlens: Option<Tensor>,
) -> Vec<(String, kiln_host::ep::Feed<'t>)> {
    use kiln_host::ep::Feed;
    let (inputs, _) = gqa_node(c, d);
    let mut feeds = Vec::new();
    for (name, t) in inputs {
        let feed = match (name, t) {
            ("past_key", _) => Feed::Device(pk),
            ("past_value", _) => Feed::Device(pv),
            ("seqlens_k", Some(t)) => Feed::Host(seqlens.clone().unwrap_or(t)),
            (_, Some(t)) => Feed::Host(t),
            (_, None) => continue,
        };
        feeds.push((name.to_string(), feed));
    }
    feeds
}

/// Decode steps whose present K/V are bound in place to the held past buffer (`Feed::Device`
/// and `Fetch::Into` of one tensor, as generation over `past_present_share_buffer` runs them):
/// on the CPU the shim is told that the presents start as the past (ABI.md §7.8) and writes only
/// the new positions, into the past's own buffer (manifest schema 18: no copy of the cache).
/// Contexts of 9 to 20 keys: the shim's own loops, then the host `gemm` (from 16 keys), against
/// float64, the output and the whole buffer after every step; the last step writes its presents
/// into other buffers, which the shim is not told start as the past.
#[test]
fn group_query_attention_decodes_in_place_into_a_bound_shared_buffer() {
    use kiln_host::ep::{Fetch, Fetched};
    let (mut session, mut c, mut d, pk, pv) = in_place_setup(0x3c6e_f372_fe94_f82b);
    // The later steps' new tokens.
    let mut r = Rng(0x9b05_688c_2b3e_6c1f);
    let shape = IN_PLACE_SHAPE.to_vec();
    let (other_k, other_v) =
        (session.zeros(DType::F32, shape.clone()).unwrap(), session.zeros(DType::F32, shape.clone()).unwrap());
    for step in 0..12 {
        let (o, want_k, want_v) = gqa_ref(&c, &d);
        let feeds = past_feeds(&c, &d, (&pk, &pv), None);
        // The last step writes the presents into buffers of their own (copied from the pasts).
        let last = step == 11;
        let (to_k, to_v) = if last { (&other_k, &other_v) } else { (&pk, &pv) };
        let before = (session.report.cpu_in_place, session.report.cpu_in_place_shared);
        let fetches = [("present_key", Fetch::Into(to_k)), ("present_value", Fetch::Into(to_v))];
        let out = session.run_with(feeds, &fetches).unwrap_or_else(|e| panic!("step {step}: {e}"));
        let told = if last { 0 } else { 2 };
        assert_eq!(session.report.cpu_in_place - before.0, told, "step {step}: presents told in place");
        // kiln-attention (manifest schema 18) takes each past's buffer itself, no copy.
        assert_eq!(session.report.cpu_in_place_shared - before.1, told, "step {step}: presents in the pasts' buffers");
        let got = out.into_iter().find_map(|(n, f)| match (n.as_str(), f) {
            ("output", Fetched::Host(t)) => Some(t),
            _ => None,
        });
        let got = got.unwrap_or_else(|| panic!("step {step}: no output"));
        assert_close(&format!("step {step} (keys {:?}) output", c.lens), &float_values(&got), &o, 1e-5);
        let (k, v) = (session.read_tensor(to_k).unwrap(), session.read_tensor(to_v).unwrap());
        assert_close(&format!("step {step} present_key"), &float_values(&k), &want_k, 1e-5);
        assert_close(&format!("step {step} present_value"), &float_values(&v), &want_v, 1e-5);
        // The next token of each row, into the same buffer.
        d.past_k = want_k;
        d.past_v = want_v;
        c.lens = c.lens.iter().map(|l| l + 1).collect();
        c.total = *c.lens.iter().max().unwrap();
        d.q = r.vals(2 * 4 * 16);
        d.k = r.vals(2 * 2 * 16);
        d.v = r.vals(2 * 2 * 16);
    }
    assert!(c.total > 16, "the last steps went through the host gemm");
    let (past_k_before, past_v_before) =
        (float_values(&session.read_tensor(&pk).unwrap()), float_values(&session.read_tensor(&pv).unwrap()));
    // A step that fails (seqlens_k past total_sequence_length) after the pasts' buffers went into
    // its call: the error names the input, and the bound tensors get their pasts back unchanged
    // (a continuous batch goes on over its cache after a failed step).
    let feeds = past_feeds(&c, &d, (&pk, &pv), Some(i32_tensor(&[2], &[40, 40])));
    let fetches = [("present_key", Fetch::Into(&pk)), ("present_value", Fetch::Into(&pv))];
    let err = session.run_with(feeds, &fetches).expect_err("seqlens_k out of range").to_string();
    assert!(err.contains("seqlens_k[0] = 40 is out of range"), "{err}");
    let (kept_k, kept_v) = (session.read_tensor(&pk).unwrap(), session.read_tensor(&pv).unwrap());
    assert_eq!((kept_k.shape.clone(), kept_v.shape.clone()), (shape.clone(), shape.clone()));
    assert_eq!(float_values(&kept_k), past_k_before, "the failed step left past_key as it was");
    assert_eq!(float_values(&kept_v), past_v_before, "the failed step left past_value as it was");
}

/// Presents bound crosswise (present_key into past_value's buffer, present_value into
/// past_key's): from manifest schema 18 each present is the other past's own buffer, and the
/// shim still reads each past before it writes either present. One decode step against float64.
#[test]
fn group_query_attention_presents_bound_crosswise_read_each_past_first() {
    use kiln_host::ep::Fetch;
    let (mut session, c, d, pk, pv) = in_place_setup(0x51_7cc1_b727_220a);
    let (_, want_k, want_v) = gqa_ref(&c, &d);
    let feeds = past_feeds(&c, &d, (&pk, &pv), None);
    let before = session.report.cpu_in_place;
    let fetches = [("present_key", Fetch::Into(&pv)), ("present_value", Fetch::Into(&pk))];
    session.run_with(feeds, &fetches).unwrap();
    assert_eq!(session.report.cpu_in_place - before, 2, "both presents told in place");
    let read = |s: &mut Session, t| float_values(&s.read_tensor(t).unwrap());
    assert_close("present_key in past_value's buffer", &read(&mut session, &pv), &want_k, 1e-5);
    assert_close("present_value in past_key's buffer", &read(&mut session, &pk), &want_v, 1e-5);
}

#[test]
fn group_query_attention_reports_unsupported_and_invalid_nodes() {
    let rt = runtime();
    let mut r = Rng(3);
    let (q, k, v) = (r.vals(64), r.vals(32), r.vals(32));
    let base = |extra: Vec<onnx::AttributeProto>| {
        let mut inputs: Vec<(&str, Option<Tensor>)> = vec![
            ("query", Some(float_tensor(DType::F32, &[1, 2, 32], &q))),
            ("key", Some(float_tensor(DType::F32, &[1, 2, 16], &k))),
            ("value", Some(float_tensor(DType::F32, &[1, 2, 16], &v))),
            ("past_key", None),
            ("past_value", None),
            ("seqlens_k", Some(i32_tensor(&[1], &[1]))),
            ("total_sequence_length", Some(i32_tensor(&[], &[2]))),
        ];
        let mut attrs = vec![attr_int("num_heads", 2), attr_int("kv_num_heads", 1)];
        attrs.retain(|a| !extra.iter().any(|x| x.name == a.name));
        attrs.extend(extra);
        if attrs.iter().any(|a| a.name == "with_position_ids") {
            attrs.retain(|a| a.name != "with_position_ids");
            inputs.extend([("cos_cache", None), ("sin_cache", None)]);
            inputs.push(("position_ids", Some(i64_tensor(&[1, 2], &[0, 1]))));
        }
        run_node(&rt, "GroupQueryAttention", inputs, &["output", "present_key", "present_value"], attrs)
    };
    assert!(base(vec![]).is_ok());
    for (attrs, needle) in [
        (vec![attr_int("causal", 0)], "causal"),
        (vec![attr_int("sliding_window_cache", 1), attr_int("local_window_size", 2)], "sliding_window_cache"),
        (vec![attr_int("qk_output", 1)], "qk_output"),
        (vec![attr_int("with_position_ids", 1)], "position_ids"),
    ] {
        let e = base(attrs).unwrap_err();
        assert!(e.is_unsupported() && e.to_string().contains(needle), "{e}");
    }
    // num_heads not a multiple of kv_num_heads; a packed width that does not divide.
    let e = base(vec![attr_int("kv_num_heads", 3)]).unwrap_err();
    assert!(!e.is_unsupported() && e.to_string().contains("multiple"), "{e}");
}

/// float64 RotaryEmbedding on x viewed as [B, S, N, H] with the given element strides.
#[allow(clippy::too_many_arguments)]
fn rope_embedding_ref(
    x: &[f64],
    dims: [usize; 4],
    strides: [usize; 3],
    pos: &dyn Fn(usize, usize) -> usize,
    cos: &[f64],
    sin: &[f64],
    rdim: usize,
    il: bool,
) -> Vec<f64> {
    let mut y = x.to_vec();
    let [b_n, s_n, n_n, h] = dims;
    for b in 0..b_n {
        for s in 0..s_n {
            for n in 0..n_n {
                let at = b * strides[0] + s * strides[1] + n * strides[2];
                rope_ref(&mut y[at..at + h][..rdim], cos, sin, rdim / 2, pos(b, s), il);
            }
        }
    }
    y
}

/// A random RotaryEmbedding case: dtype, batch b, sequence s, heads n, head size h, rotary
/// dimension (the whole head or half), a 4-D [B, N, S, H] or 3-D [B, S, N·H] input x with its
/// element strides of (batch, sequence, head), and interleaving.
struct RopeCase {
    dtype: DType,
    b: usize,
    s: usize,
    n: usize,
    h: usize,
    rdim: usize,
    partial: bool,
    four_d: bool,
    il: bool,
    x: Vec<f64>,
    shape: Vec<usize>,
    strides: [usize; 3],
}

impl RopeCase {
    fn random(r: &mut Rng, i: usize) -> RopeCase {
        let dtype = [DType::F32, DType::F32, DType::F16, DType::BF16][i % 4];
        let (b, s, n) = (r.range(1, 3), r.range(1, 5), r.range(1, 3));
        let h = r.pick(&[8, 16, 32]);
        let partial = r.coin();
        let rdim = if partial { h / 2 } else { h };
        let (four_d, il) = (r.coin(), r.coin());
        let x = r.vals(b * s * n * h);
        let (shape, strides) =
            if four_d { (vec![b, n, s, h], [n * s * h, h, s * h]) } else { (vec![b, s, n * h], [s * n * h, n * h, h]) };
        RopeCase { dtype, b, s, n, h, rdim, partial, four_d, il, x, shape, strides }
    }

    /// float64 output for cache row `pos(b, s)` of each row.
    fn want(&self, pos: &dyn Fn(usize, usize) -> usize, cos: &[f64], sin: &[f64]) -> Vec<f64> {
        let dims = [self.b, self.s, self.n, self.h];
        rope_embedding_ref(&self.x, dims, self.strides, pos, cos, sin, self.rdim, self.il)
    }

    /// The output against `want` at the dtype's tolerance.
    fn check(&self, what: &str, out: &Tensor, want: &[f64]) {
        assert_eq!(out.shape, self.shape);
        let rel = match self.dtype {
            DType::F32 => 1e-6,
            DType::F16 => 2e-3,
            _ => 1e-2,
        };
        assert_close(what, &float_values(out), want, rel);
    }
}

#[test]
fn rotary_embedding_matches_float64() {
    let rt = runtime();
    let mut r = Rng(11);
    for i in 0..24 {
        let c = RopeCase::random(&mut r, i);
        let scalar = r.coin();
        let rows = 12;
        let cos = r.vals(rows * c.rdim / 2);
        let sin = r.vals(rows * c.rdim / 2);
        let start = r.range(0, rows - c.s);
        let pos: Vec<i64> = (0..c.b * c.s).map(|_| r.range(0, rows - 1) as i64).collect();
        let want = c.want(&|bi, si| if scalar { start + si } else { pos[bi * c.s + si] as usize }, &cos, &sin);
        let mut attrs = vec![attr_int("interleaved", c.il as i64), attr_float("scale", 2.0)];
        if c.partial {
            attrs.extend([attr_int("num_heads", c.n as i64), attr_int("rotary_embedding_dim", c.rdim as i64)]);
        }
        let pos_t = if scalar { i64_tensor(&[1], &[start as i64]) } else { i64_tensor(&[c.b, c.s], &pos) };
        let out = run_node(
            &rt,
            "RotaryEmbedding",
            vec![
                ("input", Some(float_tensor(c.dtype, &c.shape, &c.x))),
                ("position_ids", Some(pos_t)),
                ("cos_cache", Some(float_tensor(c.dtype, &[rows, c.rdim / 2], &cos))),
                ("sin_cache", Some(float_tensor(c.dtype, &[rows, c.rdim / 2], &sin))),
            ],
            &["output"],
            attrs,
        )
        .unwrap_or_else(|e| panic!("case {i}: {e}"));
        let what = format!("case {i} ({:?}, {:?}, partial {}, il {})", c.dtype, c.shape, c.partial, c.il);
        c.check(&what, &out[0], &want);
    }
}

/// ONNX's RotaryEmbedding-23 (input, cos_cache, sin_cache, optional position_ids; 4-D input
/// [B, N, S, H] or 3-D with num_heads; without position_ids caches of [B, S, R/2]) against float64,
/// and its malformed nodes refused with the reason.
#[test]
fn onnx_rotary_embedding_23_matches_float64_and_refuses_malformed_nodes() {
    let rt = runtime();
    let mut r = Rng(23);
    for i in 0..24 {
        let c = RopeCase::random(&mut r, i);
        let with_ids = r.coin();
        let rows = 12;
        let cache_rows = if with_ids { rows } else { c.b * c.s };
        let cos = r.vals(cache_rows * c.rdim / 2);
        let sin = r.vals(cache_rows * c.rdim / 2);
        let pos: Vec<i64> = (0..c.b * c.s).map(|_| r.range(0, rows - 1) as i64).collect();
        let want = c.want(&|bi, si| if with_ids { pos[bi * c.s + si] as usize } else { bi * c.s + si }, &cos, &sin);
        let mut attrs = vec![attr_int("interleaved", c.il as i64)];
        if c.partial {
            attrs.push(attr_int("rotary_embedding_dim", c.rdim as i64));
        }
        if !c.four_d {
            attrs.push(attr_int("num_heads", c.n as i64));
        }
        let cache_shape = if with_ids { vec![rows, c.rdim / 2] } else { vec![c.b, c.s, c.rdim / 2] };
        let out = run_node_in(
            &rt,
            ("", 23),
            "RotaryEmbedding",
            vec![
                ("input", Some(float_tensor(c.dtype, &c.shape, &c.x))),
                ("cos_cache", Some(float_tensor(c.dtype, &cache_shape, &cos))),
                ("sin_cache", Some(float_tensor(c.dtype, &cache_shape, &sin))),
                ("position_ids", with_ids.then(|| i64_tensor(&[c.b, c.s], &pos))),
            ],
            &["output"],
            attrs,
        )
        .unwrap_or_else(|e| panic!("case {i}: {e}"));
        let what =
            format!("case {i} ({:?}, {:?}, partial {}, ids {with_ids}, il {})", c.dtype, c.shape, c.partial, c.il);
        c.check(&what, &out[0], &want);
    }
    // Malformed nodes: each refused, naming what is wrong.
    let x3 = float_tensor(DType::F32, &[1, 2, 16], &r.vals(32));
    let run = |x: &Tensor, cache: &[usize], ids: Option<Tensor>, attrs: Vec<onnx::AttributeProto>| {
        let n: usize = cache.iter().product();
        let c = float_tensor(DType::F32, cache, &vec![0.5; n]);
        run_node_in(
            &rt,
            ("", 23),
            "RotaryEmbedding",
            vec![
                ("input", Some(x.clone())),
                ("cos_cache", Some(c.clone())),
                ("sin_cache", Some(c)),
                ("position_ids", ids),
            ],
            &["output"],
            attrs,
        )
    };
    let ids = || Some(i64_tensor(&[1, 2], &[0, 1]));
    for (e, needle) in [
        (run(&x3, &[4, 4], ids(), vec![]).unwrap_err(), "needs num_heads"),
        (run(&x3, &[1, 3, 4], None, vec![attr_int("num_heads", 2)]).unwrap_err(), "without position_ids"),
        (run(&x3, &[4, 3], ids(), vec![attr_int("num_heads", 2)]).unwrap_err(), "twice the cache width"),
        (
            run(&x3, &[4, 4], Some(i64_tensor(&[2], &[0, 1])), vec![attr_int("num_heads", 2)]).unwrap_err(),
            "shape [1, 2]",
        ),
        (run(&x3, &[4, 4], Some(i64_tensor(&[1, 2], &[0, 4])), vec![attr_int("num_heads", 2)]).unwrap_err(), "outside"),
    ] {
        assert!(!e.is_unsupported() && e.to_string().contains(needle), "{needle}: {e}");
    }
}

/// Test values for attention inputs.
trait Values {
    fn val(&mut self) -> f64;
    fn vals(&mut self, n: usize) -> Vec<f64>;
}

impl Values for Rng {
    /// Uniform in [-1, 1), a multiple of 1/64 so that float16 and bfloat16 hold it exactly.
    fn val(&mut self) -> f64 {
        (self.range(0, 127) as f64 - 64.0) / 64.0
    }
    fn vals(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.val()).collect()
    }
}
