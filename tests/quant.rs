//! `kiln-quant`: MatMulNBits and GatherBlockQuantized (com.microsoft) against float64 (and
//! exact float32) references written independently here, on seeded random configurations.

use std::sync::Arc;

use bytes::Bytes;
use kiln_host::ep::{Runtime, Session, SessionOptions};
use kiln_host::{model, Error, Tensor};
use kiln_kernel_abi::DType;
use kiln_tests::onnx::{self, attribute_proto, node, value, AttributeProto, OperatorSetIdProto, TensorProto};
use kiln_tests::Rng;
use protobuf::EnumOrUnknown;

fn runtime() -> Arc<Runtime> {
    kiln_tests::builtin_runtime()
}

// ---------------------------------------------------------------------------------------
// Float formats, written here rather than borrowed from the SDK.

/// f32 → binary16 bits, rounding to nearest even.
fn f16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let e = ((b >> 23) & 0xff) as i32;
    let m = b & 0x7f_ffff;
    if e == 255 {
        return sign | 0x7c00 | if m != 0 { 0x200 } else { 0 };
    }
    let e16 = e - 127 + 15;
    if e16 >= 31 {
        return sign | 0x7c00;
    }
    let (r, rem, half) = if e16 <= 0 {
        if e16 < -10 {
            return sign;
        }
        let m = m | 0x80_0000;
        let shift = (14 - e16) as u32;
        (m >> shift, m & ((1 << shift) - 1), 1u32 << (shift - 1))
    } else {
        (((e16 as u32) << 10) | (m >> 13), m & 0x1fff, 0x1000)
    };
    let r = if rem > half || (rem == half && r & 1 == 1) { r + 1 } else { r };
    sign | r as u16
}

fn f16_value(h: u16) -> f64 {
    let s = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let e = ((h >> 10) & 31) as i32;
    let m = (h & 1023) as f64;
    s * match e {
        0 => m * 2f64.powi(-24),
        31 => f64::INFINITY,
        _ => (1024.0 + m) * 2f64.powi(e - 25),
    }
}

/// f32 → bfloat16 bits, rounding to nearest even (finite values).
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let (r, rem) = (b >> 16, b & 0xffff);
    (if rem > 0x8000 || (rem == 0x8000 && r & 1 == 1) { r + 1 } else { r }) as u16
}

fn bf16_value(h: u16) -> f64 {
    f32::from_bits((h as u32) << 16) as f64
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum F {
    F32,
    F16,
    BF16,
}

impl F {
    fn dtype(self) -> DType {
        match self {
            F::F32 => DType::F32,
            F::F16 => DType::F16,
            F::BF16 => DType::BF16,
        }
    }
    /// Encodes values (rounded to nearest even through f32).
    fn encode(self, v: &[f64]) -> Vec<u8> {
        match self {
            F::F32 => v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
            F::F16 => v.iter().flat_map(|&x| f16_bits(x as f32).to_le_bytes()).collect(),
            F::BF16 => v.iter().flat_map(|&x| bf16_bits(x as f32).to_le_bytes()).collect(),
        }
    }
    fn decode(self, b: &[u8]) -> Vec<f64> {
        match self {
            F::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64).collect(),
            F::F16 => b.chunks_exact(2).map(|c| f16_value(u16::from_le_bytes([c[0], c[1]]))).collect(),
            F::BF16 => b.chunks_exact(2).map(|c| bf16_value(u16::from_le_bytes([c[0], c[1]]))).collect(),
        }
    }
    /// Relative rounding error of one rounding to this format (half an ulp, doubled for slack).
    fn eps(self) -> f64 {
        match self {
            F::F32 => 2f64.powi(-23),
            F::F16 => 2f64.powi(-10),
            F::BF16 => 2f64.powi(-7),
        }
    }
}

// ---------------------------------------------------------------------------------------
// One-node models.

fn attr_int(name: &str, v: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        type_: EnumOrUnknown::new(attribute_proto::AttributeType::INT),
        i: v,
        ..Default::default()
    }
}

/// A tensor for a node input.
#[derive(Clone)]
struct In {
    dtype: DType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

fn input(dtype: DType, shape: &[usize], bytes: Vec<u8>) -> Option<In> {
    Some(In { dtype, shape: shape.to_vec(), bytes })
}

/// Runs `op` (com.microsoft) on `ins` (absent ones `None`): inputs listed in `inits` become
/// initializers, the others graph inputs. Returns output 0.
fn run_op(
    rt: &Arc<Runtime>,
    op: &str,
    attrs: Vec<AttributeProto>,
    ins: &[Option<In>],
    inits: &[usize],
    out: (DType, &[usize]),
) -> Result<Tensor, Error> {
    run_domain_op(rt, "com.microsoft", op, attrs, ins, inits, out)
}

/// As [`run_op`], for an op of `domain` ("" for ONNX's own, at opset 21).
fn run_domain_op(
    rt: &Arc<Runtime>,
    domain: &str,
    op: &str,
    attrs: Vec<AttributeProto>,
    ins: &[Option<In>],
    inits: &[usize],
    out: (DType, &[usize]),
) -> Result<Tensor, Error> {
    let names: Vec<String> =
        ins.iter().enumerate().map(|(i, t)| if t.is_some() { format!("x{i}") } else { String::new() }).collect();
    let used = names.iter().rposition(|n| !n.is_empty()).map_or(0, |p| p + 1);
    let node_inputs: Vec<&str> = names[..used].iter().map(String::as_str).collect();
    let mut graph_inputs = Vec::new();
    let mut initializers = Vec::new();
    let mut feeds = Vec::new();
    for (i, t) in ins.iter().enumerate() {
        let Some(t) = t else { continue };
        if inits.contains(&i) {
            initializers.push(TensorProto {
                name: names[i].clone(),
                data_type: t.dtype as i32,
                dims: t.shape.iter().map(|&d| d as i64).collect(),
                raw_data: t.bytes.clone(),
                ..Default::default()
            });
        } else {
            let dims: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
            graph_inputs.push(value(&names[i], t.dtype as i32, &dims));
            feeds.push((names[i].clone(), Tensor::new(t.dtype, t.shape.clone(), Bytes::from(t.bytes.clone()))?));
        }
    }
    let out_dims: Vec<i64> = out.1.iter().map(|&d| d as i64).collect();
    let mut n = node(op, &node_inputs, &["y"], attrs);
    n.domain = domain.into();
    let mut m = onnx::model(vec![n], graph_inputs, vec![value("y", out.0 as i32, &out_dims)], initializers);
    if !domain.is_empty() {
        m.opset_import.push(OperatorSetIdProto { domain: domain.into(), version: 1, ..Default::default() });
    }
    let loaded = model::load_bytes(&onnx::bytes(&m), None)?;
    // Every run also validates the GPU launch plan (kiln_dispatch on opaque tensors).
    let mut session = Session::new(rt.clone(), loaded, SessionOptions { check_dispatch: true, ..Default::default() })?;
    let mut outs = session.run(feeds)?;
    assert!(
        session.report.dispatch_unsupported.is_empty(),
        "{op}: no GPU dispatch: {:?}",
        session.report.dispatch_unsupported
    );
    let (_, y) = outs.remove(0);
    assert_eq!(y.dtype, out.0);
    assert_eq!(y.shape, out.1);
    // The report splits each node's host time (its op, or the fused op that replaced it): its
    // shim calls, and in them the host's products (time_us counts whole µs a node).
    for (name, st) in &session.report.ops {
        assert!(
            st.host_compute_us <= st.shim_us && st.shim_us <= (st.time_us + st.nodes) as f64,
            "{op} ({name}): host time {} µs, shim {} µs, products {} µs",
            st.time_us,
            st.shim_us,
            st.host_compute_us
        );
    }
    // A MatMulNBits that became kiln-matmul's Linear computes through the host's `qgemm`.
    if let (Some(st), false) = (session.report.ops.get("Linear"), y.data.is_empty()) {
        assert!(st.host_compute_us > 0.0, "{op}: Linear's qgemm counts as the host's product: {st:?}");
    }
    Ok(y)
}

/// Packs `values` (each < 2^bits) `8 / bits` per byte, low bits first; the unused high bits
/// of a last partial byte are filled with garbage the op must ignore.
fn pack(values: &[u32], bits: usize, rng: &mut Rng) -> Vec<u8> {
    let per = 8 / bits;
    let mut out = vec![0u8; values.len().div_ceil(per)];
    for (i, &v) in values.iter().enumerate() {
        out[i / per] |= (v << ((i % per) * bits)) as u8;
    }
    let used = values.len() % per;
    if used != 0 {
        let garbage = (rng.next_u64() as u8) & !((1u16 << (used * bits)) as u8).wrapping_sub(1);
        *out.last_mut().unwrap() |= garbage;
    }
    out
}

// ---------------------------------------------------------------------------------------
// MatMulNBits

#[derive(Clone, Copy, Debug, PartialEq)]
enum Zp {
    Absent,
    Packed,
    Float,
}

#[derive(Clone, Debug)]
struct MnbCase {
    f: F,
    bits: usize,
    block: usize,
    k: usize,
    n: usize,
    lead: Vec<usize>,
    zp: Zp,
    bias: bool,
    /// scales (and zero points) given 1-D, as older models do.
    flat: bool,
    /// `Some(len)`: a random g_idx of `len` (K or k_blocks·block_size).
    g_idx: Option<usize>,
    /// Quantization parameters as initializers rather than graph inputs.
    inits: bool,
}

/// Runs one MatMulNBits case (accuracy_level unset) and checks it against float64.
fn check_mnb(rt: &Arc<Runtime>, c: &MnbCase, rng: &mut Rng) {
    check_mnb_at(rt, c, rng, 0)
}

/// Whether the CPU quantizes A to int8 for `c` at `level` (ABI.md §6.6, the host's `qgemm`):
/// level 4, float32, 4-bit weights in blocks of a power of two ≥ 32 with whole-number zero
/// points, no g_idx, fewer than 64 rows of A.
fn int8_on_the_cpu(c: &MnbCase, level: i64) -> bool {
    let m: usize = c.lead.iter().product();
    level == 4
        && c.f == F::F32
        && c.bits == 4
        && c.block >= 32
        && c.block.is_power_of_two()
        && c.zp != Zp::Float
        && c.g_idx.is_none()
        && m < 64
}

/// `round(a · 127 / max|a|)` (ties to even) of one block of A in f32, as onnxruntime's CPU
/// provider quantizes it at accuracy_level 4, and its scale `max|a| / 127`.
fn int8_block(a: &[f64]) -> (Vec<i64>, f64) {
    let a: Vec<f32> = a.iter().map(|&v| v as f32).collect();
    let amax = a.iter().fold(0f32, |m, v| m.max(v.abs()));
    let inverse = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    (a.iter().map(|v| (v * inverse).round_ties_even() as i64).collect(), (amax / 127.0) as f64)
}

/// Runs one MatMulNBits case at `accuracy_level` = `level` and checks it against float64: of
/// the f32 product, or where the CPU quantizes A to int8 ([`int8_on_the_cpu`]) of that product,
/// its integer sums exact.
fn check_mnb_at(rt: &Arc<Runtime>, c: &MnbCase, rng: &mut Rng, level: i64) {
    let (f, bits, bs, k, n) = (c.f, c.bits, c.block, c.k, c.n);
    let kb = k.div_ceil(bs);
    let blob = bs * bits / 8;
    let levels = 1u32 << bits;
    let m: usize = c.lead.iter().product();
    // Values on grids exact in every float format: dequantization and products are exact.
    let a: Vec<f64> = (0..m * k).map(|_| rng.int(-255, 255) as f64 / 128.0).collect();
    // q[n][kb·bs], the padding of a partial last block included (garbage, ignored).
    let q: Vec<u32> = (0..n * kb * bs).map(|_| rng.below(levels as usize) as u32).collect();
    let mut b = Vec::with_capacity(n * kb * blob);
    for blk in q.chunks(bs) {
        b.extend(pack(blk, bits, rng));
    }
    let scales: Vec<f64> = (0..n * kb).map(|_| rng.int(-63, 63) as f64 / 1024.0).collect();
    let zps: Vec<f64> = match c.zp {
        Zp::Absent => vec![(levels / 2) as f64; n * kb],
        Zp::Packed => (0..n * kb).map(|_| rng.below(levels as usize) as f64).collect(),
        Zp::Float => (0..n * kb).map(|_| rng.int(0, 4 * levels as i64 - 4) as f64 / 4.0).collect(),
    };
    let g: Vec<usize> = match c.g_idx {
        Some(len) => (0..len).map(|_| rng.below(kb)).collect(),
        None => (0..k).map(|i| i / bs).collect(),
    };
    let bias: Vec<f64> = (0..n).map(|_| rng.int(-128, 128) as f64 / 64.0).collect();
    // What the float inputs hold once encoded (bfloat16 rounds some zero points).
    let zps = if c.zp == Zp::Float { f.decode(&f.encode(&zps)) } else { zps };

    let ps = |cols: usize| if c.flat { vec![n * cols] } else { vec![n, cols] };
    let mut a_shape = c.lead.clone();
    a_shape.push(k);
    let zp_in = match c.zp {
        Zp::Absent => None,
        Zp::Packed => {
            let per_row = (kb * bits).div_ceil(8);
            let bytes: Vec<u8> = zps
                .chunks(kb)
                .flat_map(|row| pack(&row.iter().map(|&z| z as u32).collect::<Vec<_>>(), bits, rng))
                .collect();
            assert_eq!(bytes.len(), n * per_row);
            input(DType::U8, &ps(per_row), bytes)
        }
        Zp::Float => input(f.dtype(), &ps(kb), f.encode(&zps)),
    };
    let g_in = c.g_idx.map(|len| In {
        dtype: DType::I32,
        shape: vec![len],
        bytes: g.iter().flat_map(|&v| (v as i32).to_le_bytes()).collect(),
    });
    let ins = [
        input(f.dtype(), &a_shape, f.encode(&a)),
        input(DType::U8, &[n, kb, blob], b),
        input(f.dtype(), &ps(kb), f.encode(&scales)),
        zp_in,
        g_in,
        if c.bias { input(f.dtype(), &[n], f.encode(&bias)) } else { None },
    ];
    let attrs = vec![
        attr_int("K", k as i64),
        attr_int("N", n as i64),
        attr_int("bits", bits as i64),
        attr_int("block_size", bs as i64),
        attr_int("accuracy_level", level),
    ];
    let mut y_shape = c.lead.clone();
    y_shape.push(n);
    let inits: &[usize] = if c.inits { &[1, 2, 3, 4, 5] } else { &[] };
    let y =
        run_op(rt, "MatMulNBits", attrs, &ins, inits, (f.dtype(), &y_shape)).unwrap_or_else(|e| panic!("{c:?}: {e}"));
    let y = f.decode(&y.data);

    let int8 = int8_on_the_cpu(c, level);
    for i in 0..m {
        for j in 0..n {
            let (mut sum, mut mag) = (0f64, 0f64);
            if int8 {
                for blk in 0..kb {
                    let (lo, hi) = (blk * bs, ((blk + 1) * bs).min(k));
                    let (qa, sa) = int8_block(&a[i * k + lo..i * k + hi]);
                    let scale = scales[j * kb + blk] * sa;
                    for (t, kk) in (lo..hi).enumerate() {
                        let term = qa[t] as f64 * (q[j * kb * bs + kk] as f64 - zps[j * kb + blk]) * scale;
                        sum += term;
                        mag += term.abs();
                    }
                }
            } else {
                for kk in 0..k {
                    let grp = g[kk];
                    let w = (q[j * kb * bs + kk] as f64 - zps[j * kb + grp]) * scales[j * kb + grp];
                    sum += a[i * k + kk] * w;
                    mag += (a[i * k + kk] * w).abs();
                }
            }
            if c.bias {
                sum += bias[j];
                mag += bias[j].abs();
            }
            let got = y[i * n + j];
            let tol = 1e-6 * mag + f.eps() * (sum.abs() + 1e-4);
            assert!((got - sum).abs() <= tol, "{c:?}: y[{i}, {j}] = {got}, want {sum} (tolerance {tol})");
        }
    }
}

fn random_mnb(rng: &mut Rng, f: F) -> MnbCase {
    let bits = rng.pick(&[2, 4, 8]);
    let block = rng.pick(&[16, 32, 64, 128, 256]);
    let k = match rng.below(3) {
        0 => block * rng.int(1, 3) as usize,
        1 => block * rng.int(0, 2) as usize + rng.int(1, block as i64 - 1) as usize,
        _ => rng.int(1, 300) as usize,
    };
    let lead: Vec<usize> = (0..rng.below(4)).map(|_| rng.int(1, 3) as usize).collect();
    let zp = rng.pick(&[Zp::Absent, Zp::Packed, Zp::Float]);
    MnbCase {
        f,
        bits,
        block,
        k,
        n: rng.int(1, 24) as usize,
        lead,
        zp,
        bias: rng.coin(),
        flat: rng.below(4) == 0,
        g_idx: None,
        inits: rng.coin(),
    }
}

#[test]
fn matmul_nbits_matches_float64_on_random_cases() {
    let rt = runtime();
    let mut rng = Rng(0x5eed_0001);
    for _ in 0..60 {
        let c = random_mnb(&mut rng, F::F32);
        check_mnb(&rt, &c, &mut rng);
    }
}

/// accuracy_level 4 on the CPU: float32 decode-size products over 4-bit weights quantize A's
/// blocks to int8 (checked against that arithmetic in float64: the integer sums exact, so an f32
/// product misses it by far more than the tolerance); float16, other bit widths, blocks of 16,
/// float zero points and 64 rows or more keep the f32 product (checked against float64 of it).
#[test]
fn matmul_nbits_at_accuracy_level_4_quantizes_a_to_int8_on_the_cpu() {
    let rt = runtime();
    let mut rng = Rng(0x5eed_0007);
    let mut int8 = 0;
    for i in 0..40 {
        let mut c = random_mnb(&mut rng, if i % 8 == 7 { F::F16 } else { F::F32 });
        if i % 2 == 0 {
            c.bits = 4;
        }
        if i % 10 == 9 {
            c.lead = vec![2, 35];
        }
        int8 += int8_on_the_cpu(&c, 4) as usize;
        check_mnb_at(&rt, &c, &mut rng, 4);
    }
    assert!(int8 >= 10, "only {int8} cases took the int8 product");
}

#[test]
fn matmul_nbits_half_precision_inputs() {
    let rt = runtime();
    let mut rng = Rng(0x5eed_0002);
    for i in 0..30 {
        let c = random_mnb(&mut rng, if i % 2 == 0 { F::F16 } else { F::BF16 });
        check_mnb(&rt, &c, &mut rng);
    }
}

#[test]
fn matmul_nbits_covers_every_bit_width_block_size_and_zero_point_kind() {
    let rt = runtime();
    let mut rng = Rng(0x5eed_0003);
    for bits in [2, 4, 8] {
        for block in [16, 32, 64, 128, 256] {
            for (z, zp) in [Zp::Absent, Zp::Packed, Zp::Float].into_iter().enumerate() {
                // A multiple of the block, and a partial last block.
                let k = if z == 1 { 2 * block } else { block + 5 + z };
                let c = MnbCase {
                    f: F::F32,
                    bits,
                    block,
                    k,
                    n: 3 + z,
                    lead: vec![2],
                    zp,
                    bias: z != 0,
                    flat: false,
                    g_idx: None,
                    inits: true,
                };
                check_mnb(&rt, &c, &mut rng);
            }
        }
    }
}

#[test]
fn matmul_nbits_llm_shapes() {
    // The shapes of the int4 LLM fixtures: bits 4, block 32, no zero points, 1 and several rows.
    let rt = runtime();
    let mut rng = Rng(0x5eed_0004);
    for (k, n, lead) in [(64, 128, vec![1, 1]), (128, 64, vec![1, 7]), (576, 40, vec![1, 3])] {
        let c = MnbCase {
            f: F::F32,
            bits: 4,
            block: 32,
            k,
            n,
            lead,
            zp: Zp::Absent,
            bias: false,
            flat: false,
            g_idx: None,
            inits: true,
        };
        check_mnb(&rt, &c, &mut rng);
    }
}

#[test]
fn matmul_nbits_long_prompts() {
    // 64 rows of A or more take the host's dequantize-then-GEMM path (63, the direct one): every
    // bit width and zero-point kind, a partial last block, N not a multiple of 4.
    let rt = runtime();
    let mut rng = Rng(0x5eed_0006);
    let cases = [(4, Zp::Absent), (4, Zp::Absent), (4, Zp::Packed), (2, Zp::Float), (8, Zp::Packed)];
    for (i, (bits, zp)) in cases.into_iter().enumerate() {
        let c = MnbCase {
            f: if i == 4 { F::F16 } else { F::F32 },
            bits,
            block: 32,
            k: 32 * 3 + 7,
            n: 21,
            lead: vec![1, 63 + i],
            zp,
            bias: i % 2 == 1,
            flat: false,
            g_idx: None,
            inits: true,
        };
        check_mnb(&rt, &c, &mut rng);
    }
}

#[test]
fn matmul_nbits_g_idx() {
    let rt = runtime();
    let mut rng = Rng(0x5eed_0005);
    for i in 0..12 {
        let block = rng.pick(&[16, 32, 64]);
        let k = rng.int(1, 3 * block as i64) as usize;
        let kb = k.div_ceil(block);
        let c = MnbCase {
            f: if i % 3 == 2 { F::F16 } else { F::F32 },
            bits: 4,
            block,
            k,
            n: rng.int(1, 9) as usize,
            lead: vec![2],
            zp: if i % 2 == 0 { Zp::Absent } else { Zp::Float },
            bias: rng.coin(),
            flat: false,
            g_idx: Some(if rng.coin() { k } else { kb * block }),
            inits: rng.coin(),
        };
        check_mnb(&rt, &c, &mut rng);
    }
}

/// A MatMulNBits node with K = 32, N = 2, block 16 and the given extra inputs / attributes.
fn mnb_node(
    rt: &Arc<Runtime>,
    bits: i64,
    b_shape: &[usize],
    extra: Vec<(usize, In)>,
    attrs: Vec<AttributeProto>,
) -> Result<Tensor, Error> {
    let mut ins = vec![
        input(DType::F32, &[1, 32], vec![0; 128]),
        input(DType::U8, b_shape, vec![0x11; b_shape.iter().product()]),
        input(DType::F32, &[2, 2], 1f32.to_le_bytes().repeat(4)),
        None,
        None,
        None,
    ];
    for (i, t) in extra {
        ins[i] = Some(t);
    }
    let mut all = vec![attr_int("K", 32), attr_int("N", 2), attr_int("bits", bits), attr_int("block_size", 16)];
    all.extend(attrs);
    run_op(rt, "MatMulNBits", all, &ins, &[1, 2], (DType::F32, &[1, 2]))
}

#[test]
fn matmul_nbits_unsupported_and_invalid_nodes() {
    let rt = runtime();
    let g_idx = In { dtype: DType::I32, shape: vec![32], bytes: vec![0; 128] };
    let zp_u8 = In { dtype: DType::U8, shape: vec![2, 1], bytes: vec![0x88; 2] };
    // Unsupported: g_idx beyond 4 bits or with uint8 zero points, prepacked weights, 3 bits.
    let e = mnb_node(&rt, 8, &[2, 2, 16], vec![(4, g_idx.clone())], vec![]).unwrap_err();
    assert!(e.is_unsupported(), "{e}");
    let e = mnb_node(&rt, 4, &[2, 2, 8], vec![(3, zp_u8), (4, g_idx.clone())], vec![]).unwrap_err();
    assert!(e.is_unsupported(), "{e}");
    let e = mnb_node(&rt, 4, &[2, 2, 8], vec![], vec![attr_int("weight_prepacked", 1)]).unwrap_err();
    assert!(e.is_unsupported(), "{e}");
    let e = mnb_node(&rt, 3, &[2, 2, 6], vec![], vec![]).unwrap_err();
    assert!(e.is_unsupported(), "{e}");
    // Invalid: B's shape, scales' shape, bias' shape, g_idx out of range, block size.
    let e = mnb_node(&rt, 4, &[2, 2, 16], vec![], vec![]).unwrap_err();
    assert!(!e.is_unsupported(), "{e}");
    let bad_scales = In { dtype: DType::F32, shape: vec![2, 3], bytes: vec![0; 24] };
    let e = mnb_node(&rt, 4, &[2, 2, 8], vec![(2, bad_scales)], vec![]).unwrap_err();
    assert!(!e.is_unsupported(), "{e}");
    let bad_bias = In { dtype: DType::F32, shape: vec![3], bytes: vec![0; 12] };
    let e = mnb_node(&rt, 4, &[2, 2, 8], vec![(5, bad_bias)], vec![]).unwrap_err();
    assert!(!e.is_unsupported(), "{e}");
    let bad_g = In { dtype: DType::I32, shape: vec![32], bytes: 2i32.to_le_bytes().repeat(32) };
    let e = mnb_node(&rt, 4, &[2, 2, 8], vec![(4, bad_g)], vec![]).unwrap_err();
    assert!(!e.is_unsupported(), "{e}");
    let all = vec![attr_int("K", 32), attr_int("N", 2), attr_int("bits", 4), attr_int("block_size", 24)];
    let ins = [
        input(DType::F32, &[1, 32], vec![0; 128]),
        input(DType::U8, &[2, 2, 12], vec![0; 48]),
        input(DType::F32, &[2, 2], vec![0; 16]),
    ];
    let e = run_op(&rt, "MatMulNBits", all, &ins, &[], (DType::F32, &[1, 2])).unwrap_err();
    assert!(!e.is_unsupported(), "{e}");
    // The documented default zero point 8 and low-nibble-first packing, by hand: B's bytes 0x11
    // hold q = 1 everywhere, so with A = 1 every weight is (1 − 8) · 1 and Y = 32 · −7.
    let ones = In { dtype: DType::F32, shape: vec![1, 32], bytes: 1f32.to_le_bytes().repeat(32) };
    let y = mnb_node(&rt, 4, &[2, 2, 8], vec![(0, ones)], vec![]).unwrap();
    assert_eq!(y.data.as_ref(), (-224f32).to_le_bytes().repeat(2));
}

#[test]
fn matmul_nbits_omitted_projection_gives_the_bias() {
    let rt = runtime();
    let bias =
        In { dtype: DType::F32, shape: vec![2], bytes: [1.5f32, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect() };
    let ins = [
        input(DType::F32, &[3, 32], 1f32.to_le_bytes().repeat(96)),
        input(DType::U8, &[2, 0, 8], vec![]),
        input(DType::F32, &[0], vec![]),
        None,
        None,
        Some(bias),
    ];
    let attrs = vec![attr_int("K", 32), attr_int("N", 2), attr_int("bits", 4), attr_int("block_size", 16)];
    let y = run_op(&rt, "MatMulNBits", attrs, &ins, &[1, 2], (DType::F32, &[3, 2])).unwrap();
    assert_eq!(y.data.as_ref(), [1.5f32, -2.0].repeat(3).iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>());
}

// ---------------------------------------------------------------------------------------
// GatherBlockQuantized

#[derive(Clone, Debug)]
struct GbqCase {
    f: F,
    bits: usize,
    block: usize,
    /// data's logical shape (last dimension unpacked).
    logical: Vec<usize>,
    quantize_axis: usize,
    /// quantize_axis given as a negative attribute.
    negative_axis: bool,
    zero_points: bool,
    indices: Vec<usize>,
    i64_indices: bool,
}

fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

fn check_gbq(rt: &Arc<Runtime>, c: &GbqCase, rng: &mut Rng) {
    let (f, bits, bs, qa) = (c.f, c.bits, c.block, c.quantize_axis);
    let comps = 8 / bits;
    let levels = 1usize << bits;
    let r = c.logical.len();
    let mut packed = c.logical.clone();
    packed[r - 1] /= comps;
    let mut s_shape = c.logical.clone();
    s_shape[qa] = c.logical[qa].div_ceil(bs);
    let mut z_shape = s_shape.clone();
    z_shape[qa] = s_shape[qa].div_ceil(comps);

    let numel: usize = c.logical.iter().product();
    let q: Vec<u32> = (0..numel).map(|_| rng.below(levels) as u32).collect();
    let data = pack(&q, bits, rng);
    let s_numel: usize = s_shape.iter().product();
    let scales: Vec<f64> = (0..s_numel).map(|_| rng.int(-2000, 2000) as f64 / 4096.0).collect();
    let scales = f.decode(&f.encode(&scales));
    let zps: Vec<u32> = (0..s_numel).map(|_| rng.below(levels) as u32).collect();
    // Zero points: packed along quantize_axis (the last axis when comps > 1), row by row.
    let zp_bytes: Vec<u8> = zps
        .chunks(s_shape[r - 1])
        .flat_map(|row| if comps > 1 { pack(row, bits, rng) } else { row.iter().map(|&z| z as u8).collect() })
        .collect();
    assert_eq!(zp_bytes.len(), z_shape.iter().product::<usize>());

    // Indices in [-rows - 2, rows + 1]: negative ones count from the end, others are out of range.
    let rows = c.logical[0] as i64;
    let idx_shape = c.indices.clone();
    let n_idx: usize = idx_shape.iter().product();
    let idx: Vec<i64> = (0..n_idx).map(|_| rng.int(-rows - 2, rows + 1)).collect();
    let idx_in = if c.i64_indices {
        In { dtype: DType::I64, shape: idx_shape.clone(), bytes: idx.iter().flat_map(|v| v.to_le_bytes()).collect() }
    } else {
        In {
            dtype: DType::I32,
            shape: idx_shape.clone(),
            bytes: idx.iter().flat_map(|&v| (v as i32).to_le_bytes()).collect(),
        }
    };
    let ins = [
        input(DType::U8, &packed, data),
        Some(idx_in),
        input(f.dtype(), &s_shape, f.encode(&scales)),
        if c.zero_points { input(DType::U8, &z_shape, zp_bytes) } else { None },
    ];
    let attrs = vec![
        attr_int("bits", bits as i64),
        attr_int("block_size", bs as i64),
        attr_int("gather_axis", if c.negative_axis { -(r as i64) } else { 0 }),
        attr_int("quantize_axis", if c.negative_axis { qa as i64 - r as i64 } else { qa as i64 }),
    ];
    let mut y_shape = idx_shape.clone();
    y_shape.extend_from_slice(&c.logical[1..]);
    let inits: &[usize] = if c.zero_points { &[0, 2, 3] } else { &[0, 2] };
    let y = run_op(rt, "GatherBlockQuantized", attrs, &ins, inits, (f.dtype(), &y_shape))
        .unwrap_or_else(|e| panic!("{c:?}: {e}"));

    // Expected: float32 (q − zp) · scale rounded once to the output format, per element,
    // through multi-indices.
    let ls = strides(&c.logical);
    let ss = strides(&s_shape);
    let row_len: usize = c.logical[1..].iter().product();
    let mut want = Vec::with_capacity(n_idx * row_len);
    for &ix in &idx {
        for e in 0..row_len {
            if ix < -rows || ix >= rows {
                want.push(0.0);
                continue;
            }
            let row = if ix < 0 { ix + rows } else { ix } as usize;
            let flat = row * ls[0] + e;
            let mi: Vec<usize> = (0..r).map(|d| flat / ls[d] % c.logical[d]).collect();
            let si: usize = (0..r).map(|d| if d == qa { mi[d] / bs } else { mi[d] } * ss[d]).sum();
            let z = if c.zero_points { zps[si] as i32 } else { 1 << (bits - 1) };
            let v = (q[flat] as i32 - z) as f32 * scales[si] as f32;
            want.push(v as f64);
        }
    }
    let want = f.decode(&f.encode(&want));
    let got = f.decode(&y.data);
    assert_eq!(got, want, "{c:?}");
}

fn random_gbq(rng: &mut Rng, f: F) -> GbqCase {
    let bits = rng.pick(&[2, 4, 8]);
    let comps = 8 / bits;
    let block = rng.pick(&[16, 32, 64]);
    let rank = if bits == 8 { rng.int(1, 3) } else { rng.int(2, 3) } as usize;
    let mut logical: Vec<usize> = (0..rank).map(|_| rng.int(1, 5) as usize).collect();
    logical[0] = rng.int(1, 12) as usize;
    let quantize_axis = if bits == 8 { rng.below(rank) } else { rank - 1 };
    // A long quantized axis: several blocks, often a partial last one.
    logical[quantize_axis] = rng.int(1, 3 * block as i64) as usize;
    logical[rank - 1] = logical[rank - 1].div_ceil(comps) * comps;
    let n_idx = rng.int(1, 3) as usize;
    let indices: Vec<usize> = match rng.below(3) {
        0 => vec![],
        1 => vec![n_idx],
        _ => vec![n_idx, rng.int(1, 2) as usize],
    };
    GbqCase {
        f,
        bits,
        block,
        logical,
        quantize_axis,
        negative_axis: rng.coin(),
        zero_points: rng.coin(),
        indices,
        i64_indices: rng.coin(),
    }
}

#[test]
fn gather_block_quantized_matches_reference_on_random_cases() {
    let rt = runtime();
    let mut rng = Rng(0x5eed_0010);
    for i in 0..60 {
        let f = [F::F32, F::F32, F::F16, F::BF16][i % 4];
        let c = random_gbq(&mut rng, f);
        check_gbq(&rt, &c, &mut rng);
    }
}

#[test]
fn gather_block_quantized_llm_embedding() {
    // The int4 fixtures' embedding: uint8 [vocab, hidden / 2], bits 4, block 32, no zero points.
    let rt = runtime();
    let mut rng = Rng(0x5eed_0011);
    let c = GbqCase {
        f: F::F32,
        bits: 4,
        block: 32,
        logical: vec![512, 64],
        quantize_axis: 1,
        negative_axis: false,
        zero_points: false,
        indices: vec![1, 7],
        i64_indices: true,
    };
    check_gbq(&rt, &c, &mut rng);
}

#[test]
fn gather_block_quantized_unsupported_and_invalid_nodes() {
    let rt = runtime();
    let gbq = |dtype: DType, shape: &[usize], attrs: Vec<(&str, i64)>| {
        let n: usize = shape.iter().product();
        let mut s = shape.to_vec();
        let qa = attrs.iter().find(|a| a.0 == "quantize_axis").map_or(1, |a| a.1) as usize;
        s[qa] = 1;
        let ins = [
            input(dtype, shape, vec![0; n]),
            input(DType::I64, &[1], 0i64.to_le_bytes().to_vec()),
            input(DType::F32, &s, 1f32.to_le_bytes().repeat(s.iter().product())),
        ];
        let attrs = attrs.into_iter().map(|(k, v)| attr_int(k, v)).collect();
        run_op(&rt, "GatherBlockQuantized", attrs, &ins, &[0, 2], (DType::F32, &[1]))
    };
    // int8 data is not a type of the op.
    let e = gbq(DType::I8, &[4, 8], vec![("bits", 8), ("block_size", 16)]).unwrap_err();
    assert!(e.is_unsupported(), "{e}");
    // 4-bit data quantized along an axis that is not the packed last one.
    let e = gbq(DType::U8, &[4, 2, 8], vec![("bits", 4), ("block_size", 16), ("quantize_axis", 1)]).unwrap_err();
    assert!(e.is_unsupported(), "{e}");
    // Invalid: gather_axis other than 0 for uint8, equal axes for packed data, bad block size.
    let e = gbq(DType::U8, &[4, 8], vec![("bits", 8), ("block_size", 16), ("gather_axis", 1)]).unwrap_err();
    assert!(!e.is_unsupported(), "{e}");
    let e = gbq(DType::U8, &[4, 8], vec![("bits", 4), ("block_size", 16), ("quantize_axis", 0)]).unwrap_err();
    assert!(!e.is_unsupported(), "{e}");
    let e = gbq(DType::U8, &[4, 8], vec![("bits", 8), ("block_size", 24)]).unwrap_err();
    assert!(!e.is_unsupported(), "{e}");
    let e = gbq(DType::U8, &[4, 8], vec![("bits", 3), ("block_size", 16)]).unwrap_err();
    assert!(!e.is_unsupported(), "{e}");
}

// ---------------------------------------------------------------------------------------
// ONNX's QLinearMatMul: out-of-range results saturate.

/// QLinearMatMul whose results leave the output type's range saturates them, as ONNX's
/// specification and onnxruntime do, against a float64 reference computed here. (ONNX 1.20's own
/// node tests `test_qlinearmatmul_*_int8_*` expect the wrapped value, onnx/onnx#7835, so the
/// conformance runner reports them with that reason instead of running them.) The int8 case is
/// that node test's data: its last element is −236 before saturation.
#[test]
fn qlinear_matmul_saturates_out_of_range_results() {
    let rt = runtime();
    let i8s = |v: &[i8]| v.iter().map(|&x| x as u8).collect::<Vec<u8>>();
    let f32s = |v: f32| v.to_le_bytes().to_vec();
    // (dtype, a [2, 4], b [4, 3], zero points a, b, y; scales a, b, y)
    let int8 = (
        DType::I8,
        i8s(&[81, 109, -127, 111, -124, 87, -128, -98]),
        i8s(&[25, -76, 117, -67, -101, -128, -127, 0, 119, 0, 127, 120]),
        [-14i64, -13, -9],
        [0.0066f32, 0.00705, 0.0107],
    );
    let uint8 = (DType::U8, vec![200u8, 250, 255, 240, 0, 3, 1, 2], vec![255u8; 12], [0i64, 0, 0], [1.0f32, 1.0, 0.2]);
    for (dtype, a, b, zp, sc) in [int8, uint8] {
        let z = |v: i64| vec![v as u8];
        let ins = [
            input(dtype, &[2, 4], a.clone()),
            input(DType::F32, &[1], f32s(sc[0])),
            input(dtype, &[1], z(zp[0])),
            input(dtype, &[4, 3], b.clone()),
            input(DType::F32, &[1], f32s(sc[1])),
            input(dtype, &[1], z(zp[1])),
            input(DType::F32, &[1], f32s(sc[2])),
            input(dtype, &[1], z(zp[2])),
        ];
        let y = run_domain_op(&rt, "", "QLinearMatMul", vec![], &ins, &[], (dtype, &[2, 3])).unwrap();
        let val = |bytes: &[u8], i: usize| if dtype == DType::I8 { bytes[i] as i8 as f64 } else { bytes[i] as f64 };
        let (lo, hi) = if dtype == DType::I8 { (-128.0, 127.0) } else { (0.0, 255.0) };
        let factor = ((sc[0] * sc[1]) / sc[2]) as f64;
        let mut saturated = 0;
        for r in 0..2 {
            for c in 0..3 {
                let acc: f64 =
                    (0..4).map(|k| (val(&a, r * 4 + k) - zp[0] as f64) * (val(&b, k * 3 + c) - zp[1] as f64)).sum();
                let exact = (acc * factor + zp[2] as f64).round_ties_even();
                saturated += (exact < lo || exact > hi) as usize;
                let got = val(&y.data, r * 3 + c);
                assert_eq!(got, exact.clamp(lo, hi), "{dtype} element ({r}, {c}): {acc} · {factor}");
            }
        }
        assert!(saturated > 0, "{dtype}: the case must leave the range");
    }
}

/// QuantizeLinear to float8 keeps the sign of −0 (ONNX's reference: `saturate_cast(x / scale)`,
/// no zero point added), and float4e2m1 adds the zero point it is given; the codes are compared
/// bit for bit, which the node tests (by value, −0 = +0) do not.
#[test]
fn quantize_to_float8_keeps_negative_zero_and_float4_adds_its_zero_point() {
    let rt = runtime();
    let x: Vec<u8> = [-0.0f32, 1.0, -3.0, 1000.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let scale = 1.0f32.to_le_bytes().to_vec();
    let y = run_domain_op(
        &rt,
        "",
        "QuantizeLinear",
        vec![attr_int("output_dtype", DType::F8E4M3FN as i64)],
        &[input(DType::F32, &[4], x.clone()), input(DType::F32, &[], scale.clone())],
        &[1],
        (DType::F8E4M3FN, &[4]),
    )
    .unwrap();
    // -0, 1.0 (0.0111.000), -3.0 (1.1000.100), 1000 saturated to 448 (0.1111.110).
    assert_eq!(&y.data[..], &[0x80, 0x38, 0xC4, 0x7E]);
    // float4e2m1 with a zero point of 1.0 (code 0x2): -0 + 1 = 1.0 (0x2), 1 + 1 = 2.0 (0x4),
    // -3 + 1 = -2.0 (0xC), 1001 saturated to 6.0 (0x7); packed low nibble first.
    let y = run_domain_op(
        &rt,
        "",
        "QuantizeLinear",
        vec![],
        &[input(DType::F32, &[4], x), input(DType::F32, &[], scale), input(DType::F4E2M1, &[], vec![0x2])],
        &[1, 2],
        (DType::F4E2M1, &[4]),
    )
    .unwrap();
    assert_eq!(&y.data[..], &[0x42, 0x7C]);
}
