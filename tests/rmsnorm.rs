//! onnxruntime's RMS normalisations in `kiln-normalization`: ai.onnx SimplifiedLayerNormalization
//! and com.microsoft SkipSimplifiedLayerNormalization, run through a session on random shapes,
//! dtypes (float32, float16, bfloat16), broadcast forms and optional inputs/outputs, against a
//! float64 reference written here.

use std::sync::Arc;

use bytes::Bytes;
use kiln_host::ep::{Runtime, Session, SessionOptions};
use kiln_host::{model, Tensor};
use kiln_kernel_abi::DType;
use kiln_tests::onnx::{self, attr_float, node, value, AttributeProto, ModelProto, OperatorSetIdProto};
use kiln_tests::Rng;

fn runtime() -> Arc<Runtime> {
    kiln_tests::builtin_runtime()
}

/// Random values of `dtype` (magnitudes about 2^-4 to 4, some negative) as tensor bytes and as
/// the exact f64 values those bytes hold.
fn random_values(rng: &mut Rng, dtype: DType, n: usize) -> (Vec<u8>, Vec<f64>) {
    let mut bytes = Vec::new();
    let mut vals = Vec::new();
    for _ in 0..n {
        let r = rng.next_u64();
        let sign = if r & 1 == 1 { -1.0 } else { 1.0 };
        let exp = ((r >> 1) % 7) as i32 - 4;
        let frac = ((r >> 8) & 0xffff_ffff) as f64 / 4_294_967_296.0;
        let v = sign * (1.0 + frac) * 2f64.powi(exp);
        match dtype {
            DType::F32 => {
                let f = v as f32;
                bytes.extend(f.to_le_bytes());
                vals.push(f as f64);
            }
            // Truncating f32 to 16 bits keeps the value exactly (bfloat16) ...
            DType::BF16 => {
                let b = ((v as f32).to_bits() >> 16) as u16;
                bytes.extend(b.to_le_bytes());
                vals.push(f32::from_bits((b as u32) << 16) as f64);
            }
            // ... and so does keeping 10 fraction bits of a normal float16.
            DType::F16 => {
                let m = (frac * 1024.0) as u16;
                let b = ((sign < 0.0) as u16) << 15 | ((exp + 15) as u16) << 10 | m;
                bytes.extend(b.to_le_bytes());
                vals.push(decode(DType::F16, &b.to_le_bytes())[0]);
            }
            other => unreachable!("{other}"),
        }
    }
    (bytes, vals)
}

fn f16_to_f64(b: u16) -> f64 {
    let sign = if b >> 15 == 1 { -1.0 } else { 1.0 };
    let exp = ((b >> 10) & 0x1f) as i32;
    let man = (b & 0x3ff) as f64;
    sign * match exp {
        0 => man * 2f64.powi(-24),
        31 if man == 0.0 => f64::INFINITY,
        31 => f64::NAN,
        e => (1.0 + man / 1024.0) * 2f64.powi(e - 15),
    }
}

fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    match dtype {
        DType::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
        DType::F64 => bytes.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect(),
        DType::F16 => bytes.chunks_exact(2).map(|c| f16_to_f64(u16::from_le_bytes([c[0], c[1]]))).collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16) as f64)
            .collect(),
        other => unreachable!("{other}"),
    }
}

/// Unit roundoff-ish spacing of `dtype` and its smallest normal.
fn precision(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F32 => (2f64.powi(-23), 2f64.powi(-126)),
        DType::F64 => (2f64.powi(-52), 2f64.powi(-1022)),
        DType::F16 => (2f64.powi(-10), 2f64.powi(-14)),
        DType::BF16 => (2f64.powi(-7), 2f64.powi(-126)),
        other => unreachable!("{other}"),
    }
}

/// Asserts that `got` holds `want` rounded once to its dtype (within one unit in the last place).
fn assert_close(what: &str, got: &Tensor, dtype: DType, shape: &[usize], want: &[f64]) {
    assert_eq!((got.dtype, got.shape.as_slice()), (dtype, shape), "{what}: dtype and shape");
    let (eps, tiny) = precision(dtype);
    for (i, (g, w)) in decode(dtype, &got.data).iter().zip(want).enumerate() {
        assert!((g - w).abs() <= eps * w.abs().max(tiny), "{what}[{i}]: got {g}, want {w}");
    }
}

fn attr_int(name: &str, v: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        type_: protobuf::EnumOrUnknown::new(onnx::attribute_proto::AttributeType::INT),
        i: v,
        ..Default::default()
    }
}

fn dims(shape: &[usize]) -> Vec<i64> {
    shape.iter().map(|&d| d as i64).collect()
}

/// A graph input fed at run time.
struct Feed {
    name: &'static str,
    dtype: DType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl Feed {
    fn random(rng: &mut Rng, name: &'static str, dtype: DType, shape: &[usize]) -> (Feed, Vec<f64>) {
        let (bytes, vals) = random_values(rng, dtype, shape.iter().product());
        (Feed { name, dtype, shape: shape.to_vec(), bytes }, vals)
    }
}

/// A one-node model over `feeds` with ai.onnx opset 22 and com.microsoft opset 1, as exported
/// LLMs import them; `outputs` are the graph outputs (name, dtype, shape).
fn one_node_model(n: onnx::NodeProto, feeds: &[&Feed], outputs: &[(&str, DType, Vec<usize>)]) -> ModelProto {
    let mut m = onnx::model(
        vec![n],
        feeds.iter().map(|f| value(f.name, f.dtype.code(), &dims(&f.shape))).collect(),
        outputs.iter().map(|(n, d, s)| value(n, d.code(), &dims(s))).collect(),
        vec![],
    );
    m.opset_import[0].version = 22;
    m.opset_import.push(OperatorSetIdProto { domain: "com.microsoft".into(), version: 1, ..Default::default() });
    m
}

fn run(rt: &Arc<Runtime>, m: &ModelProto, feeds: &[&Feed]) -> Result<Vec<(String, Tensor)>, kiln_host::Error> {
    let m = model::load_bytes(&onnx::bytes(m), None)?;
    let feeds = feeds
        .iter()
        .map(|f| (f.name.to_string(), Tensor::new(f.dtype, f.shape.clone(), Bytes::from(f.bytes.clone())).unwrap()))
        .collect();
    Session::new(rt.clone(), m, SessionOptions { check_dispatch: true, ..SessionOptions::default() })?.run(feeds)
}

fn output<'a>(outs: &'a [(String, Tensor)], name: &str) -> &'a Tensor {
    &outs.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("no output {name}")).1
}

/// Row-major index of each element of `out` into a tensor of shape `shape` broadcast to it.
fn broadcast_at(shape: &[usize], out: &[usize], k: usize) -> usize {
    let off = out.len() - shape.len();
    let (mut rem, mut idx, mut stride) = (k, 0, 1);
    for ax in (0..out.len()).rev() {
        let i = rem % out[ax];
        rem /= out[ax];
        if ax >= off {
            let d = shape[ax - off];
            if d != 1 {
                idx += i * stride;
            }
            stride *= d;
        }
    }
    idx
}

/// Float64 RMS normalisation of `rows` rows of `cols`: (y, 1 / rms per row).
fn rms_reference(x: &[f64], cols: usize, eps: f64, scale: impl Fn(usize) -> f64) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0; x.len()];
    let mut inv = Vec::new();
    for (r, row) in x.chunks(cols).enumerate() {
        let rms = (row.iter().map(|v| v * v).sum::<f64>() / cols as f64 + eps).sqrt();
        for (c, v) in row.iter().enumerate() {
            y[r * cols + c] = v / rms * scale(r * cols + c);
        }
        inv.push(1.0 / rms);
    }
    (y, inv)
}

const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

#[test]
fn simplified_layer_norm_matches_float64_on_random_shapes() {
    let rt = runtime();
    let mut rng = Rng(0x5eed_0001);
    for trial in 0..24 {
        let rank = rng.range(1, 4);
        let x_shape: Vec<usize> =
            (0..rank).map(|i| if i + 1 == rank { rng.range(1, 40) } else { rng.range(1, 4) }).collect();
        let axis = rng.range(0, rank - 1);
        // Usually scale is X.shape[axis..]; otherwise any shape that broadcasts to X.
        let scale_shape: Vec<usize> = if trial % 3 != 2 {
            x_shape[axis..].to_vec()
        } else {
            let keep = rng.range(1, rank);
            x_shape[rank - keep..].iter().map(|&d| if rng.coin() { d } else { 1 }).collect()
        };
        let x_dtype = rng.pick(&FLOATS);
        // Y has scale's dtype, which may differ from X's.
        let y_dtype = if trial % 4 == 3 { rng.pick(&FLOATS) } else { x_dtype };
        let eps = rng.pick(&[1e-5f32, 1e-6, 0.25]);
        let with_inv_std = rng.coin();
        let stash_f64 = trial % 8 == 5;
        let negative_axis = rng.coin();

        let (x, xv) = Feed::random(&mut rng, "x", x_dtype, &x_shape);
        let (scale, sv) = Feed::random(&mut rng, "scale", y_dtype, &scale_shape);
        let mut attrs = vec![attr_float("epsilon", eps)];
        attrs.push(attr_int("axis", if negative_axis { axis as i64 - rank as i64 } else { axis as i64 }));
        if stash_f64 {
            attrs.push(attr_int("stash_type", 11));
        } else if rng.coin() {
            attrs.push(attr_int("stash_type", 1));
        }
        let outs: &[&str] = if with_inv_std { &["y", "inv_std_var"] } else { &["y"] };
        let stat_shape: Vec<usize> = x_shape.iter().enumerate().map(|(i, &d)| if i < axis { d } else { 1 }).collect();
        let stat_dtype = if stash_f64 { DType::F64 } else { DType::F32 };
        let mut graph_outs = vec![("y", y_dtype, x_shape.clone())];
        if with_inv_std {
            graph_outs.push(("inv_std_var", stat_dtype, stat_shape.clone()));
        }
        let m = one_node_model(
            node("SimplifiedLayerNormalization", &["x", "scale"], outs, attrs),
            &[&x, &scale],
            &graph_outs,
        );
        let got = run(&rt, &m, &[&x, &scale]).unwrap_or_else(|e| panic!("trial {trial}: {e}"));

        let cols: usize = x_shape[axis..].iter().product();
        let (want_y, want_inv) = rms_reference(&xv, cols, eps as f64, |k| sv[broadcast_at(&scale_shape, &x_shape, k)]);
        let what = format!("trial {trial} ({x_dtype} X {x_shape:?}, {y_dtype} scale {scale_shape:?}, axis {axis})");
        assert_close(&format!("{what}: Y"), output(&got, "y"), y_dtype, &x_shape, &want_y);
        if with_inv_std {
            assert_close(
                &format!("{what}: inv_std_var"),
                output(&got, "inv_std_var"),
                stat_dtype,
                &stat_shape,
                &want_inv,
            );
        }
    }
}

#[test]
fn skip_simplified_layer_norm_matches_float64_on_random_shapes() {
    let rt = runtime();
    let mut rng = Rng(0x5eed_0002);
    for trial in 0..24 {
        let (b, s, h) = (rng.range(1, 3), rng.range(1, 5), rng.range(1, 48));
        let three_d = trial % 4 != 0;
        let shape = if three_d { vec![b, s, h] } else { vec![s, h] };
        // skip: input's shape, or one [S, H] slice (2-D or [1, S, H]) added to every batch.
        let skip_shape = match (three_d, trial % 3) {
            (true, 1) => vec![s, h],
            (true, 2) => vec![1, s, h],
            _ => shape.clone(),
        };
        let dtype = rng.pick(&FLOATS);
        let with_bias = rng.coin();
        let eps = if rng.coin() { Some(rng.pick(&[1e-5f32, 1e-6, 0.5])) } else { None };
        let [want_mean, want_inv, want_sum] = [0, 1, 2].map(|_| rng.coin());

        let (x, xv) = Feed::random(&mut rng, "x", dtype, &shape);
        let (skip, kv) = Feed::random(&mut rng, "skip", dtype, &skip_shape);
        let (gamma, gv) = Feed::random(&mut rng, "gamma", dtype, &[h]);
        let (bias, bv) = Feed::random(&mut rng, "bias", dtype, &[h]);
        let mut feeds = vec![&x, &skip, &gamma];
        let mut inputs = vec!["x", "skip", "gamma"];
        if with_bias {
            feeds.push(&bias);
            inputs.push("bias");
        }
        let name = |on: bool, n: &'static str| if on { n } else { "" };
        let mut outs = vec!["out", name(want_mean, "mean"), name(want_inv, "inv_std_var"), name(want_sum, "sum")];
        while outs.last() == Some(&"") {
            outs.pop();
        }
        let mut stat_shape = shape.clone();
        *stat_shape.last_mut().unwrap() = 1;
        let graph_outs: Vec<(&str, DType, Vec<usize>)> = [
            ("out", dtype, shape.clone()),
            ("mean", DType::F32, stat_shape.clone()),
            ("inv_std_var", DType::F32, stat_shape.clone()),
            ("sum", dtype, shape.clone()),
        ]
        .into_iter()
        .filter(|(n, _, _)| outs.contains(n))
        .collect();
        let attrs = eps.map(|e| vec![attr_float("epsilon", e)]).unwrap_or_default();
        let mut n = node("SkipSimplifiedLayerNormalization", &inputs, &outs, attrs);
        n.domain = "com.microsoft".into();
        let m = one_node_model(n, &feeds, &graph_outs);
        let got = run(&rt, &m, &feeds).unwrap_or_else(|e| panic!("trial {trial}: {e}"));

        let sum: Vec<f64> =
            (0..xv.len()).map(|k| xv[k] + kv[k % kv.len()] + if with_bias { bv[k % h] } else { 0.0 }).collect();
        let (want_out, inv) = rms_reference(&sum, h, eps.unwrap_or(1e-12) as f64, |k| gv[k % h]);
        let what = format!("trial {trial} ({dtype} input {shape:?}, skip {skip_shape:?}, bias {with_bias})");
        assert_close(&format!("{what}: output"), output(&got, "out"), dtype, &shape, &want_out);
        if want_mean {
            // onnxruntime's CPU kernel writes zeros: RMS normalisation does not centre.
            assert_close(
                &format!("{what}: mean"),
                output(&got, "mean"),
                DType::F32,
                &stat_shape,
                &vec![0.0; inv.len()],
            );
        }
        if want_inv {
            assert_close(&format!("{what}: inv_std_var"), output(&got, "inv_std_var"), DType::F32, &stat_shape, &inv);
        }
        if want_sum {
            assert_close(&format!("{what}: input_skip_bias_sum"), output(&got, "sum"), dtype, &shape, &sum);
        }
    }
}

#[test]
fn shapes_and_attributes_onnxruntime_rejects_fail_the_node() {
    let rt = runtime();
    let mut rng = Rng(0x5eed_0003);
    let skip_case = |rng: &mut Rng, x: &[usize], skip: &[usize], gamma: &[usize], eps: f32| {
        let (a, _) = Feed::random(rng, "x", DType::F32, x);
        let (b, _) = Feed::random(rng, "skip", DType::F32, skip);
        let (g, _) = Feed::random(rng, "gamma", DType::F32, gamma);
        let mut n = node(
            "SkipSimplifiedLayerNormalization",
            &["x", "skip", "gamma"],
            &["out"],
            vec![attr_float("epsilon", eps)],
        );
        n.domain = "com.microsoft".into();
        let m = one_node_model(n, &[&a, &b, &g], &[("out", DType::F32, x.to_vec())]);
        run(&rt, &m, &[&a, &b, &g]).map(|_| ()).map_err(|e| e.to_string())
    };
    assert!(skip_case(&mut rng, &[2, 3, 8], &[2, 3, 8], &[8], 1e-6).is_ok());
    for (x, skip, gamma, eps) in [
        (&[2, 3, 8][..], &[2, 1, 8][..], &[8][..], 1e-6), // skip broadcast over the sequence
        (&[2, 3, 8], &[8], &[8], 1e-6),                   // 1-D skip
        (&[3, 8], &[1, 8], &[8], 1e-6),                   // 2-D input takes only its own shape
        (&[2, 2, 3, 8], &[2, 2, 3, 8], &[8], 1e-6),       // rank 4
        (&[2, 3, 8], &[2, 3, 8], &[1, 8], 1e-6),          // gamma not 1-D
        (&[2, 3, 8], &[2, 3, 8], &[4], 1e-6),             // gamma not [hidden]
        (&[2, 3, 8], &[2, 3, 8], &[8], -1.0),             // negative epsilon
    ] {
        let err =
            skip_case(&mut rng, x, skip, gamma, eps).expect_err(&format!("x {x:?} skip {skip:?} gamma {gamma:?}"));
        assert!(err.contains("SkipSimplifiedLayerNormalization"), "{err}");
    }

    let simplified_case = |rng: &mut Rng, x: &[usize], scale: &[usize], attrs: Vec<AttributeProto>| {
        let (a, _) = Feed::random(rng, "x", DType::F32, x);
        let (s, _) = Feed::random(rng, "scale", DType::F32, scale);
        let n = node("SimplifiedLayerNormalization", &["x", "scale"], &["y"], attrs);
        let m = one_node_model(n, &[&a, &s], &[("y", DType::F32, x.to_vec())]);
        run(&rt, &m, &[&a, &s]).map(|_| ()).map_err(|e| e.to_string())
    };
    assert!(simplified_case(&mut rng, &[2, 3, 4], &[2, 1, 4], vec![]).is_ok());
    for (scale, attrs) in [
        (&[12][..], vec![attr_int("axis", 1)]), // scale's size matches but not its shape
        (&[1, 2, 3, 4], vec![]),                // scale of a higher rank
        (&[4], vec![attr_int("axis", 3)]),
        (&[4], vec![attr_int("stash_type", 10)]), // inv_std_var is float32 or float64
    ] {
        let err = simplified_case(&mut rng, &[2, 3, 4], scale, attrs).expect_err(&format!("scale {scale:?}"));
        assert!(err.contains("SimplifiedLayerNormalization"), "{err}");
    }
}

/// LpNormalization-22 (kiln-normalization) against float64 on random shapes, axes, p and dtypes,
/// the last axis and an inner one (the row and column kernels' launch plans checked too); any
/// p but 1 and 2 is refused with the reason.
#[test]
fn lp_normalization_matches_float64_and_refuses_other_orders() {
    let rt = runtime();
    let mut rng = Rng(0x5eed_00f1);
    for trial in 0..24 {
        let dtype = [DType::F32, DType::F16, DType::BF16][trial % 3];
        let rank = rng.range(1, 4);
        let shape: Vec<usize> = (0..rank).map(|_| rng.range(1, 9)).collect();
        let axis = rng.range(0, rank - 1);
        let p = rng.pick(&[1i64, 2]);
        let (x, vals) = Feed::random(&mut rng, "x", dtype, &shape);
        let (n, inner) = (shape[axis], shape[axis + 1..].iter().product::<usize>());
        let mut want = vals.clone();
        for o in 0..vals.len() / (n * inner) {
            for i in 0..inner {
                let at = |j: usize| (o * n + j) * inner + i;
                let sum: f64 = (0..n).map(|j| if p == 1 { vals[at(j)].abs() } else { vals[at(j)] * vals[at(j)] }).sum();
                let norm = if p == 1 { sum } else { sum.sqrt() };
                for j in 0..n {
                    want[at(j)] = vals[at(j)] / norm;
                }
            }
        }
        let n = node("LpNormalization", &["x"], &["y"], vec![attr_int("axis", axis as i64), attr_int("p", p)]);
        let outs = run(&rt, &one_node_model(n, &[&x], &[("y", dtype, shape.clone())]), &[&x])
            .unwrap_or_else(|e| panic!("trial {trial}: {e}"));
        assert_close(
            &format!("trial {trial} ({dtype}, {shape:?}, axis {axis}, p {p})"),
            output(&outs, "y"),
            dtype,
            &shape,
            &want,
        );
    }
    let (x, _) = Feed::random(&mut rng, "x", DType::F32, &[2, 3]);
    let n = node("LpNormalization", &["x"], &["y"], vec![attr_int("p", 3)]);
    let e = run(&rt, &one_node_model(n, &[&x], &[("y", DType::F32, vec![2, 3])]), &[&x]).unwrap_err();
    assert!(!e.is_unsupported() && e.to_string().contains("p must be 1 or 2, got 3"), "{e}");
}
