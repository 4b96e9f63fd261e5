//! Fusion at load (`kiln_host::fuse`): the built-in packages' `[[fusions]]` patterns rewrite
//! the graphs they match, the result equals the unfused graph and a float64 reference, and a
//! match that a constraint turns down is left alone with its reason.

use kiln_host::ep::{Device, Session, SessionOptions};
use kiln_host::model::{self, Model};
use kiln_host::Tensor;
use kiln_tests::onnx::{self, node, value};
use kiln_tests::{f32_tensor, f32_values};

const F32: i32 = 1;

/// Deterministic values in [-2, 2).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f64 / (1u64 << 24) as f64 * 4.0 - 2.0) as f32
        })
        .collect()
}

fn silu_mul(g: f64, u: f64) -> f64 {
    g / (1.0 + (-g).exp()) * u
}

const ROWS: usize = 3;
const K: usize = 8;
const N: usize = 6;

/// x [ROWS, K] · Wg, x · Wu [K, N] → Sigmoid, Mul (inputs in the order given), Mul → y,
/// plus extra graph outputs.
fn gated_mlp(mul_order: [&str; 2], extra_outputs: &[&str]) -> Model {
    let nodes = vec![
        node("MatMul", &["x", "Wg"], &["g"], vec![]),
        node("MatMul", &["x", "Wu"], &["u"], vec![]),
        node("Sigmoid", &["g"], &["s"], vec![]),
        node("Mul", &mul_order, &["a"], vec![]),
        node("Mul", &["u", "a"], &["y"], vec![]),
    ];
    let mut outputs = vec![value("y", F32, &[ROWS as i64, N as i64])];
    outputs.extend(extra_outputs.iter().map(|o| value(o, F32, &[ROWS as i64, N as i64])));
    let inits = vec![
        onnx::init_f32("Wg", &[K as i64, N as i64], &values(K * N, 1)),
        onnx::init_f32("Wu", &[K as i64, N as i64], &values(K * N, 2)),
    ];
    let m = onnx::model(nodes, vec![value("x", F32, &[ROWS as i64, K as i64])], outputs, inits);
    model::load_bytes(&onnx::bytes(&m), None).unwrap()
}

fn session(m: Model, fuse: bool) -> Session {
    let options = SessionOptions { device: Device::Cpu, fuse, ..SessionOptions::default() };
    Session::new(kiln_tests::builtin_runtime(), m, options).unwrap()
}

fn run(s: &mut Session, feeds: Vec<(&str, Tensor)>) -> Vec<Vec<f32>> {
    let out = s.run(feeds.into_iter().map(|(n, t)| (n.to_string(), t)).collect()).unwrap();
    out.iter().map(|(_, t)| f32_values(t)).collect()
}

/// y = SiLU(x·Wg)·(x·Wu) in float64.
fn reference(x: &[f32]) -> Vec<f64> {
    let (wg, wu) = (values(K * N, 1), values(K * N, 2));
    let mut y = Vec::new();
    for r in 0..ROWS {
        for c in 0..N {
            let dot = |w: &[f32]| (0..K).map(|k| x[r * K + k] as f64 * w[k * N + c] as f64).sum::<f64>();
            y.push(silu_mul(dot(&wg), dot(&wu)));
        }
    }
    y
}

fn assert_close(got: &[f32], want: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((*g as f64 - w).abs() <= rel * scale, "element {i}: {g} vs {w} (scale {scale})");
    }
}

#[test]
fn the_gate_up_projections_and_silu_become_one_matmul_and_swiglu() {
    let x = values(ROWS * K, 3);
    // Mul's inputs in either order match (the pattern declares it commutative).
    for order in [["g", "s"], ["s", "g"]] {
        let mut fused = session(gated_mlp(order, &[]), true);
        let f = &fused.report.fusions;
        assert!(f.enabled);
        // gate-up-swiglu (5 nodes), then kiln-matmul's `linear` stores the concatenated weight
        // [N, K] for its GEMV.
        assert_eq!(f.applied.len(), 2, "{}", f.render());
        assert_eq!(f.applied[0].fusion, "gate-up-swiglu");
        assert_eq!(f.applied[0].nodes.len(), 5);
        assert_eq!(f.applied[1].fusion, "linear");
        let ops: Vec<&str> = fused.model().graph.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(ops, ["Linear", "SwiGlu"]);
        // Wg and Wu are gone; one [2N, K] weight (the [K, 2N] concatenation, transposed)
        // replaces them.
        let inits: Vec<Vec<usize>> = fused.model().graph.initializers.values().map(|t| t.shape.clone()).collect();
        assert_eq!(inits, vec![vec![2 * N, K]]);
        let mut unfused = session(gated_mlp(order, &[]), false);
        assert!(!unfused.report.fusions.enabled && unfused.report.fusions.applied.is_empty());
        assert_eq!(unfused.model().graph.nodes.len(), 5);
        let a = run(&mut fused, vec![("x", f32_tensor(&[ROWS, K], &x))]);
        let b = run(&mut unfused, vec![("x", f32_tensor(&[ROWS, K], &x))]);
        let want = reference(&x);
        assert_close(&a[0], &want, 1e-6);
        assert_close(&b[0], &want, 1e-6);
    }
}

#[test]
fn an_intermediate_read_outside_the_match_keeps_the_graph_as_it_is() {
    let x = values(ROWS * K, 4);
    let mut s = session(gated_mlp(["g", "s"], &["s"]), true);
    let f = &s.report.fusions;
    // Only the single-node `linear` applies (each MatMul by a constant); the gate-up and SiLU
    // nodes stay as they are.
    let counts = f.applied_counts();
    assert_eq!(counts.into_iter().collect::<Vec<_>>(), vec![("linear", 2)], "{}", f.render());
    let gate_up = f.rejected.iter().find(|r| r.fusion == "gate-up-swiglu").expect("the gate-up match is reported");
    assert!(gate_up.reason.contains("s is read outside the match"), "{}", gate_up.reason);
    let mut ops: Vec<&str> = s.model().graph.nodes.iter().map(|n| n.op_type.as_str()).collect();
    ops.sort_unstable();
    assert_eq!(ops, ["Linear", "Linear", "Mul", "Mul", "Sigmoid"]);
    let out = run(&mut s, vec![("x", f32_tensor(&[ROWS, K], &x))]);
    assert_close(&out[0], &reference(&x), 1e-6);
}

/// Sigmoid(g), Mul, Mul over graph inputs g and u (declared float32).
fn silu_graph(g_dtype: Option<i32>) -> Model {
    let nodes = vec![
        node("Sigmoid", &["g"], &["s"], vec![]),
        node("Mul", &["s", "g"], &["a"], vec![]),
        node("Mul", &["a", "u"], &["y"], vec![]),
    ];
    let mut g = value("g", g_dtype.unwrap_or(F32), &[2, 5]);
    if g_dtype.is_none() {
        // A value whose type the load does not know.
        g.type_ = Default::default();
    }
    let m = onnx::model(nodes, vec![g, value("u", F32, &[2, 5])], vec![value("y", F32, &[2, 5])], vec![]);
    model::load_bytes(&onnx::bytes(&m), None).unwrap()
}

#[test]
fn silu_times_up_becomes_swiglu_where_the_dtype_is_known() {
    let (g, u) = (values(10, 5), values(10, 6));
    let mut s = session(silu_graph(Some(F32)), true);
    assert_eq!(s.report.fusions.applied.len(), 1, "{}", s.report.fusions.render());
    assert_eq!(s.report.fusions.applied[0].fusion, "swiglu");
    let out = run(&mut s, vec![("g", f32_tensor(&[2, 5], &g)), ("u", f32_tensor(&[2, 5], &u))]);
    let want: Vec<f64> = g.iter().zip(&u).map(|(a, b)| silu_mul(*a as f64, *b as f64)).collect();
    assert_close(&out[0], &want, 1e-6);

    let s = session(silu_graph(None), true);
    let f = &s.report.fusions;
    assert!(f.applied.is_empty());
    assert_eq!(f.rejected.len(), 1, "{}", f.render());
    assert!(f.rejected[0].reason.contains("dtype of g (g) is not known at load"), "{}", f.rejected[0].reason);
}

/// GELU as torch.onnx exports transformers' GELUActivation: x · 0.5 · (1 + erf(x / √2)), its
/// constants made by Constant nodes (√2 and 0.5 as `value` tensors, 1 as `value_float`); `half`
/// is the last factor's value.
fn exported_gelu(half: f32) -> Model {
    let scalar = |name: &str, v: f32| onnx::attr_tensor("value", onnx::init_f32(name, &[], &[v]));
    let nodes = vec![
        node("Constant", &[], &["c_sqrt2"], vec![scalar("c_sqrt2", std::f32::consts::SQRT_2)]),
        node("Constant", &[], &["c_one"], vec![onnx::attr_float("value_float", 1.0)]),
        node("Constant", &[], &["c_half"], vec![scalar("c_half", half)]),
        node("Div", &["x", "c_sqrt2"], &["d"], vec![]),
        node("Erf", &["d"], &["e"], vec![]),
        node("Add", &["e", "c_one"], &["p"], vec![]),
        node("Mul", &["x", "p"], &["m"], vec![]),
        node("Mul", &["m", "c_half"], &["y"], vec![]),
    ];
    let m = onnx::model(nodes, vec![value("x", F32, &[3, 8])], vec![value("y", F32, &[3, 8])], vec![]);
    model::load_bytes(&onnx::bytes(&m), None).unwrap()
}

#[test]
fn an_exported_gelu_becomes_one_gelu_and_a_wrong_constant_keeps_it_unfused() {
    let x = values(24, 11);
    let feeds = || vec![("x", f32_tensor(&[3, 8], &x))];
    let mut fused = session(exported_gelu(0.5), true);
    let f = &fused.report.fusions;
    assert_eq!(f.applied.len(), 1, "{}", f.render());
    assert_eq!(f.applied[0].fusion, "gelu-erf");
    let ops: Vec<(&str, &str)> =
        fused.model().graph.nodes.iter().map(|n| (n.domain.as_str(), n.op_type.as_str())).collect();
    assert_eq!(ops, [("com.microsoft", "Gelu")]);
    let want: Vec<f64> =
        x.iter().map(|&v| 0.5 * v as f64 * (1.0 + libm::erf(v as f64 / std::f64::consts::SQRT_2))).collect();
    assert_close(&run(&mut fused, feeds())[0], &want, 1e-6);

    // 0.6 where the pattern needs 0.5: the match is turned down with the value named, and the
    // unfused graph computes x · 0.6 · (1 + erf(x / √2)).
    let mut s = session(exported_gelu(0.6), true);
    let f = &s.report.fusions;
    assert!(f.applied.is_empty(), "{}", f.render());
    let r = f.rejected.iter().find(|r| r.fusion == "gelu-erf").expect("the GELU match is reported");
    assert!(r.reason.contains("half (c_half) is 0.6") && r.reason.contains("needs 0.5"), "{}", r.reason);
    let want: Vec<f64> = want.iter().map(|w| w / 0.5 * 0.6f32 as f64).collect();
    assert_close(&run(&mut s, feeds())[0], &want, 1e-6);
}

const AB: usize = 2; // batch
const AS: usize = 5; // query rows
const AT: usize = 6; // keys
const AH: usize = 3; // heads
const AD: usize = 4; // head size

/// Eager attention as torch.onnx exports transformers' BERT: q [B, S, H·D], k and v [B, T, H·D]
/// split into heads by Reshape (q's with `allowzero` = `q_allowzero`) and Transpose, scores / 2
/// (or, `mul_form`, as torch.onnx writes transformers 5's eager attention: the scores · 0.5),
/// an additive mask
/// [B, 1, 1, T], Softmax, the weighted v merged back into y [B, S, H·D]. With `projected`, q, k
/// and v are x [B, S, H·D] · W + b for each of three constant W [H·D, H·D] and b [H·D] (values
/// seeds 31–36, W scaled by 0.25), and T = S.
fn exported_attention(q_allowzero: i64, mul_form: bool, projected: bool) -> Model {
    let at = if projected { AS } else { AT };
    let (b, s, t, h, d) = (AB as i64, AS as i64, at as i64, AH as i64, AD as i64);
    let reshape_az = |x: &str, shape: &str, y: &str, az: i64| {
        node("Reshape", &[x, shape], &[y], vec![onnx::attr_int("allowzero", az)])
    };
    let reshape = |x: &str, shape: &str, y: &str| reshape_az(x, shape, y, 0);
    let transpose = |x: &str, y: &str, perm: &[i64]| node("Transpose", &[x], &[y], vec![onnx::attr_ints("perm", perm)]);
    let mut nodes = Vec::new();
    if projected {
        for x in ["q", "k", "v"] {
            nodes.push(node("MatMul", &["x", &format!("W{x}")], &[&format!("p{x}")], vec![]));
            nodes.push(node("Add", &[&format!("p{x}"), &format!("b{x}")], &[x], vec![]));
        }
    }
    nodes.extend([
        reshape_az("q", "sq", "qr", q_allowzero),
        transpose("qr", "qt", &[0, 2, 1, 3]),
        reshape("k", "sk", "kr"),
        transpose("kr", "kt", &[0, 2, 3, 1]),
        node("MatMul", &["qt", "kt"], &["sc"], vec![]),
        node(if mul_form { "Mul" } else { "Div" }, &["sc", "c"], &["sd"], vec![]),
        node("Add", &["sd", "mask"], &["sm"], vec![]),
        node("Softmax", &["sm"], &["p"], vec![onnx::attr_int("axis", -1)]),
        reshape("v", "sv", "vr"),
        transpose("vr", "vt", &[0, 2, 1, 3]),
        node("MatMul", &["p", "vt"], &["o"], vec![]),
        transpose("o", "ot", &[0, 2, 1, 3]),
        reshape("ot", "so", "y"),
    ]);
    let mut inits = vec![
        onnx::init_f32("c", &[], &[if mul_form { 0.5 } else { 2.0 }]),
        onnx::init_i64("sq", &[4], &[b, s, h, d]),
        onnx::init_i64("sk", &[4], &[b, t, h, d]),
        onnx::init_i64("sv", &[4], &[0, 0, h, d]),
        onnx::init_i64("so", &[3], &[b, s, -1]),
    ];
    let e = AH * AD;
    let mut inputs = vec![value("mask", F32, &[b, 1, 1, t])];
    if projected {
        for (i, x) in ["q", "k", "v"].into_iter().enumerate() {
            inits.push(onnx::init_f32(&format!("W{x}"), &[e as i64, e as i64], &projection(31 + i as u64)));
            inits.push(onnx::init_f32(&format!("b{x}"), &[e as i64], &values(e, 34 + i as u64)));
        }
        inputs.push(value("x", F32, &[b, s, h * d]));
    } else {
        inputs.extend([
            value("q", F32, &[b, s, h * d]),
            value("k", F32, &[b, t, h * d]),
            value("v", F32, &[b, t, h * d]),
        ]);
    }
    let m = onnx::model(nodes, inputs, vec![value("y", F32, &[b, s, h * d])], inits);
    model::load_bytes(&onnx::bytes(&m), None).unwrap()
}

/// A projection weight of `exported_attention`: values of `seed` · 0.25 (so that the scores stay
/// in a range where the float64 reference is not all one key).
fn projection(seed: u64) -> Vec<f32> {
    values(AH * AD * AH * AD, seed).iter().map(|w| w * 0.25).collect()
}

/// float64 eager attention over q [B, S, H·D], k and v [B, T, H·D]: y[b, s, h·D + e] =
/// Σ_t softmax_t(q·k · scale + mask[b, t]) v[b, t, h·D + e].
fn attention_reference(q: &[f64], k: &[f64], v: &[f64], mask: &[f32], t_n: usize, scale: f64) -> Vec<f64> {
    let e = AH * AD;
    let mut want = vec![0.0f64; AB * AS * e];
    for b in 0..AB {
        for h in 0..AH {
            for s in 0..AS {
                let row = |x: &[f64], r: usize, len: usize| x[(b * len + r) * e + h * AD..][..AD].to_vec();
                let qr = row(q, s, AS);
                let sc: Vec<f64> = (0..t_n)
                    .map(|t| {
                        qr.iter().zip(row(k, t, t_n)).map(|(a, c)| a * c).sum::<f64>() * scale
                            + mask[b * t_n + t] as f64
                    })
                    .collect();
                let max = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let den: f64 = sc.iter().map(|x| (x - max).exp()).sum();
                for (t, x) in sc.iter().enumerate() {
                    for (i, vv) in row(v, t, t_n).iter().enumerate() {
                        want[(b * AS + s) * e + h * AD + i] += (x - max).exp() / den * vv;
                    }
                }
            }
        }
    }
    want
}

#[test]
fn exported_eager_attention_becomes_one_reshaped_attention() {
    let (q, k, v) = (values(AB * AS * AH * AD, 21), values(AB * AT * AH * AD, 22), values(AB * AT * AH * AD, 23));
    // The second row masks its last two keys.
    let mask: Vec<f32> = (0..AB * AT).map(|i| if i >= 2 * AT - 2 { -10000.0 } else { 0.0 }).collect();
    let feeds = || {
        vec![
            ("q", f32_tensor(&[AB, AS, AH * AD], &q)),
            ("k", f32_tensor(&[AB, AT, AH * AD], &k)),
            ("v", f32_tensor(&[AB, AT, AH * AD], &v)),
            ("mask", f32_tensor(&[AB, 1, 1, AT], &mask)),
        ]
    };
    let wide = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<_>>();
    let want = attention_reference(&wide(&q), &wide(&k), &wide(&v), &mask, AT, 0.5);
    for (mul_form, fusion) in [(false, "reshaped-attention"), (true, "reshaped-attention-mul")] {
        let mut fused = session(exported_attention(0, mul_form, false), true);
        let f = &fused.report.fusions;
        assert_eq!(f.applied_counts().into_iter().collect::<Vec<_>>(), vec![(fusion, 1)], "{}", f.render());
        let ops: Vec<&str> = fused.model().graph.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(ops, ["ReshapedAttention"]);
        assert_close(&run(&mut fused, feeds())[0], &want, 1e-6);
        let mut unfused = session(exported_attention(0, mul_form, false), false);
        assert_close(&run(&mut unfused, feeds())[0], &want, 1e-6);
    }

    // Q's Reshape with allowzero = 1 (the same here: its target has no 0): the pattern asks for
    // 0, so the match is turned down with the attribute named, and the unfused ops run.
    let mut s = session(exported_attention(1, false, false), true);
    let f = &s.report.fusions;
    assert!(f.applied.iter().all(|a| a.fusion != "reshaped-attention"), "{}", f.render());
    let r = f.rejected.iter().find(|r| r.fusion == "reshaped-attention").expect("the attention match is reported");
    assert!(r.reason.contains("attribute allowzero is 1, the pattern needs 0"), "{}", r.reason);
    assert_close(&run(&mut s, feeds())[0], &want, 1e-6);
}

/// Q, K and V projected from one x: the three MatMul + Add pairs and the attention become one
/// Linear over [Wq | Wk | Wv]ᵀ and a packed ReshapedAttention reading its rows' column blocks,
/// in both export forms, against float64 (and the unfused graph against the same).
#[test]
fn projected_attention_becomes_one_linear_and_a_packed_reshaped_attention() {
    let e = AH * AD;
    let x = values(AB * AS * e, 30);
    let mask: Vec<f32> = (0..AB * AS).map(|i| if i >= 2 * AS - 1 { -10000.0 } else { 0.0 }).collect();
    let feeds = || vec![("x", f32_tensor(&[AB, AS, e], &x)), ("mask", f32_tensor(&[AB, 1, 1, AS], &mask))];
    // q, k, v = x · W + b in float64 (the weights as the model stores them).
    let project = |i: u64| -> Vec<f64> {
        let (w, bias) = (projection(31 + i), values(e, 34 + i));
        let mut out = vec![0.0; AB * AS * e];
        for r in 0..AB * AS {
            for c in 0..e {
                out[r * e + c] =
                    bias[c] as f64 + (0..e).map(|j| x[r * e + j] as f64 * w[j * e + c] as f64).sum::<f64>();
            }
        }
        out
    };
    let want = attention_reference(&project(0), &project(1), &project(2), &mask, AS, 0.5);
    for (mul_form, fusion) in [(false, "qkv-reshaped-attention"), (true, "qkv-reshaped-attention-mul")] {
        let mut fused = session(exported_attention(0, mul_form, true), true);
        let f = &fused.report.fusions;
        assert_eq!(f.applied_counts().into_iter().collect::<Vec<_>>(), vec![(fusion, 1)], "{}", f.render());
        let g = &fused.model().graph;
        let ops: Vec<&str> = g.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(ops, ["Linear", "ReshapedAttention"]);
        let packed = g.nodes[1].attributes.iter().find(|(name, _)| name == "packed");
        assert!(
            matches!(packed, Some((_, kiln_host::model::AttrValue::Int(1)))),
            "the attention reads Q, K and V from the Linear's rows: {packed:?}"
        );
        assert_close(&run(&mut fused, feeds())[0], &want, 1e-5);
        let mut unfused = session(exported_attention(0, mul_form, true), false);
        assert_close(&run(&mut unfused, feeds())[0], &want, 1e-5);
    }
}

/// y = x [ROWS, K] · W [K, N] + b, b reaching the Add through an Identity of an initializer (as
/// torch.onnx writes equal weights), of `b_len` values (N, or 1 to broadcast).
fn biased_matmul(b_len: usize) -> Model {
    let nodes = vec![
        node("Identity", &["b0"], &["b"], vec![]),
        node("MatMul", &["x", "W"], &["p"], vec![]),
        node("Add", &["b", "p"], &["y"], vec![]),
    ];
    let inits = vec![
        onnx::init_f32("W", &[K as i64, N as i64], &values(K * N, 31)),
        onnx::init_f32("b0", &[b_len as i64], &values(b_len, 32)),
    ];
    let outputs = vec![value("y", F32, &[ROWS as i64, N as i64])];
    let m = onnx::model(nodes, vec![value("x", F32, &[ROWS as i64, K as i64])], outputs, inits);
    model::load_bytes(&onnx::bytes(&m), None).unwrap()
}

#[test]
fn a_matmul_and_its_bias_become_one_linear_and_a_bias_of_another_length_does_not() {
    let x = values(ROWS * K, 33);
    let (w, b) = (values(K * N, 31), values(N, 32));
    let want: Vec<f64> = (0..ROWS * N)
        .map(|i| (0..K).map(|k| x[i / N * K + k] as f64 * w[k * N + i % N] as f64).sum::<f64>() + b[i % N] as f64)
        .collect();
    let mut s = session(biased_matmul(N), true);
    let f = &s.report.fusions;
    assert_eq!(f.applied_counts().into_iter().collect::<Vec<_>>(), vec![("linear-bias", 1)], "{}", f.render());
    let ops: Vec<&str> = s.model().graph.nodes.iter().map(|n| n.op_type.as_str()).collect();
    assert_eq!(ops, ["Linear"]);
    assert_close(&run(&mut s, vec![("x", f32_tensor(&[ROWS, K], &x))])[0], &want, 1e-6);

    // A bias of one value broadcasts in Add; Linear's bias is [N]: not fused, the shape named.
    let b1 = values(1, 32)[0] as f64;
    let want: Vec<f64> = want.iter().enumerate().map(|(i, v)| v - b[i % N] as f64 + b1).collect();
    let mut s = session(biased_matmul(1), true);
    let f = &s.report.fusions;
    let r = f.rejected.iter().find(|r| r.fusion == "linear-bias").expect("the biased match is reported");
    assert!(r.reason.contains("b (b) has shape [1], the pattern needs [6]"), "{}", r.reason);
    assert_eq!(f.applied_counts().into_iter().collect::<Vec<_>>(), vec![("linear", 1)], "{}", f.render());
    assert_close(&run(&mut s, vec![("x", f32_tensor(&[ROWS, K], &x))])[0], &want, 1e-6);
}

/// s = a + r, y = LayerNormalization(s, gamma, beta) over the last axis (epsilon 1e-5), r [ROWS,
/// r_cols] (N, or 1 to broadcast over each row); with `sum_out`, s is a graph output too (a
/// pre-norm residual stream reads it).
fn add_layer_norm(sum_out: bool, r_cols: usize) -> Model {
    let nodes = vec![
        node("Add", &["a", "r"], &["s"], vec![]),
        node(
            "LayerNormalization",
            &["s", "gamma", "beta"],
            &["y"],
            vec![onnx::attr_int("axis", -1), onnx::attr_float("epsilon", 1e-5)],
        ),
    ];
    let inits =
        vec![onnx::init_f32("gamma", &[N as i64], &values(N, 41)), onnx::init_f32("beta", &[N as i64], &values(N, 42))];
    let shape = [ROWS as i64, N as i64];
    let mut outputs = vec![value("y", F32, &shape)];
    if sum_out {
        outputs.push(value("s", F32, &shape));
    }
    let r = value("r", F32, &[ROWS as i64, r_cols as i64]);
    let m = onnx::model(nodes, vec![value("a", F32, &shape), r], outputs, inits);
    model::load_bytes(&onnx::bytes(&m), None).unwrap()
}

#[test]
fn a_residual_add_and_its_layer_norm_become_one_skip_layer_normalization() {
    for r_cols in [N, 1] {
        skip_layer_norm_case(r_cols);
    }
}

fn skip_layer_norm_case(r_cols: usize) {
    let (a, r) = (values(ROWS * N, 43), values(ROWS * r_cols, 44));
    let (gamma, beta) = (values(N, 41), values(N, 42));
    let sum: Vec<f64> =
        a.iter().enumerate().map(|(i, x)| *x as f64 + r[i / N * r_cols + i % N % r_cols] as f64).collect();
    let mut want = Vec::new();
    for row in sum.chunks(N) {
        let mean = row.iter().sum::<f64>() / N as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / N as f64;
        let inv = 1.0 / (var + 1e-5).sqrt();
        want.extend(row.iter().enumerate().map(|(c, v)| (v - mean) * inv * gamma[c] as f64 + beta[c] as f64));
    }
    let feeds = || vec![("a", f32_tensor(&[ROWS, N], &a)), ("r", f32_tensor(&[ROWS, r_cols], &r))];
    for (sum_out, fusion) in [(false, "skip-layernorm"), (true, "skip-layernorm-sum")] {
        let mut s = session(add_layer_norm(sum_out, r_cols), true);
        let f = &s.report.fusions;
        assert_eq!(f.applied_counts().into_iter().collect::<Vec<_>>(), vec![(fusion, 1)], "{}", f.render());
        let ops: Vec<&str> = s.model().graph.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(ops, ["SkipLayerNormalization"]);
        let out = run(&mut s, feeds());
        assert_close(&out[0], &want, 1e-5);
        if sum_out {
            assert_close(&out[1], &sum, 1e-6);
        }
    }
}

/// A package manifest providing float32 Abs, with one `[[fusions]]` entry and a tail.
fn manifest(name: &str, fusion: &str, tail: &str) -> String {
    format!(
        "abi = 1\nshim = \"shim.wasm\"\n[package]\nname = \"{name}\"\nversion = \"1.0.0\"\n[[ops]]\nop_types = [\"Abs\"]\n\
         since_opset = 6\ndtypes = [\"float32\"]\nmax_rank = 8\n[[fusions]]{fusion}{tail}"
    )
}

#[test]
fn a_package_with_a_cyclic_fusion_is_refused_at_load_with_the_fusion_named() {
    let fusion = r#"
name = "loop"
match = [
  { op = "Relu", inputs = ["b"], outputs = ["a"] },
  { op = "Relu", inputs = ["a"], outputs = ["b"] },
]
replace = [{ op = "Relu", inputs = ["a"], outputs = ["b"] }]
outputs = ["b"]
"#;
    let manifest = manifest("hostile", fusion, "");
    let err = kiln_registry::Package::load_files("hostile", &[("kernel.toml", manifest.as_bytes())]).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("fusion \"loop\"") && msg.contains("cycle"), "{msg}");
}

/// A package on kiln-unary's shim (float32 Abs) declaring one fusion.
fn package_on_unary_shim(name: &str, fusion: &str) -> kiln_registry::Package {
    use sha2::Digest;
    let unary = kiln_host::packages::builtin()
        .into_iter()
        .flatten()
        .find(|p| p.name() == "kiln-unary")
        .expect("kiln-unary is built in");
    let hash: String = sha2::Sha256::digest(&unary.shim).iter().map(|b| format!("{b:02x}")).collect();
    let manifest = manifest(name, fusion, &format!("[files]\n\"shim.wasm\" = \"{hash}\"\n"));
    kiln_registry::Package::load_files(name, &[("kernel.toml", manifest.as_bytes()), ("shim.wasm", &unary.shim)])
        .expect("a valid package")
}

/// A package whose declared fusion is wrong: Relu(x) "fused" into Neg(x).
fn wrong_fusion_package() -> kiln_registry::Package {
    let fusion = r#"
name = "relu-as-neg"
match = [{ op = "Relu", inputs = ["x"], outputs = ["y"] }]
replace = [{ op = "Neg", inputs = ["x"], outputs = ["y"] }]
outputs = ["y"]
verify = { x = [4, 8] }
"#;
    package_on_unary_shim("wrong-fusion", fusion)
}

#[test]
fn verify_refuses_a_fused_op_that_disagrees_with_its_pattern() {
    let (mut reg, errors) = kiln_host::packages::registry(&[], &[]);
    assert!(errors.is_empty(), "{errors:?}");
    assert!(reg.add(wrong_fusion_package(), kiln_registry::USER));
    let rt = kiln_host::ep::Runtime::new(reg, kiln_host::sandbox::SandboxConfig::default()).unwrap();
    let pkg = rt.registry.packages().find(|p| p.name() == "wrong-fusion").unwrap().clone();
    let cases = kiln_host::cli::verify_fusion::fusion_cases(&rt, &pkg, Device::Cpu, 2);
    assert_eq!(cases.len(), 2, "one float32 case per seed");
    for c in &cases {
        assert_eq!(c.fusion, "relu-as-neg");
        match &c.outcome {
            kiln_host::conformance::Outcome::Failed(m) => {
                assert!(m.contains("max error relative to the output's largest value"), "{m}")
            }
            other => panic!("a wrong fusion must fail verification, got {other:?}"),
        }
        assert!(c.max_rel_error > 1.0, "Relu and Neg differ everywhere: {}", c.max_rel_error);
    }
    // The built-in fusions agree with the ops they replace, in every dtype they declare.
    let rt = kiln_tests::builtin_runtime();
    let unary = rt.registry.packages().find(|p| p.name() == "kiln-unary").unwrap().clone();
    let cases = kiln_host::cli::verify_fusion::fusion_cases(&rt, &unary, Device::Cpu, 1);
    let names: std::collections::BTreeSet<(&str, &str)> =
        cases.iter().map(|c| (c.fusion.as_str(), c.dtype.as_str())).collect();
    assert!(names.contains(&("gate-up-swiglu", "float16")) && names.contains(&("swiglu", "bfloat16")), "{names:?}");
    for c in &cases {
        assert!(matches!(c.outcome, kiln_host::conformance::Outcome::Passed), "{c:?}");
        if c.dtype != "float64" {
            // Fused rounds once, unfused after every op: a real difference, within tolerance.
            assert!(c.max_rel_error > 0.0 && c.max_rel_error <= c.tolerance, "{c:?}");
        }
    }
}

#[test]
fn a_pattern_input_never_binds_to_a_value_made_inside_the_match() {
    // y = g·σ(g)·σ(g): the last Mul reads s, not an outside `u`. Fusing it as SwiGlu(g, s)
    // would read s after removing its producer.
    let nodes = vec![
        node("Sigmoid", &["g"], &["s"], vec![]),
        node("Mul", &["g", "s"], &["a"], vec![]),
        node("Mul", &["a", "s"], &["y"], vec![]),
    ];
    let m = onnx::model(nodes, vec![value("g", F32, &[2, 5])], vec![value("y", F32, &[2, 5])], vec![]);
    let mut s = session(model::load_bytes(&onnx::bytes(&m), None).unwrap(), true);
    let f = &s.report.fusions;
    assert!(f.applied.is_empty(), "{}", f.render());
    assert!(f.rejected.iter().any(|r| r.reason.contains("produced inside it")), "{}", f.render());
    let g = values(10, 7);
    let out = run(&mut s, vec![("g", f32_tensor(&[2, 5], &g))]);
    let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
    let want: Vec<f64> = g.iter().map(|&x| x as f64 * sig(x as f64) * sig(x as f64)).collect();
    assert_close(&out[0], &want, 1e-6);
}

#[test]
fn a_broadcasting_mul_is_not_fused_into_swiglu() {
    let nodes = vec![
        node("Sigmoid", &["g"], &["s"], vec![]),
        node("Mul", &["g", "s"], &["a"], vec![]),
        node("Mul", &["a", "u"], &["y"], vec![]),
    ];
    let inputs = vec![value("g", F32, &[2, 5]), value("u", F32, &[5])];
    let m = onnx::model(nodes, inputs, vec![value("y", F32, &[2, 5])], vec![]);
    let mut s = session(model::load_bytes(&onnx::bytes(&m), None).unwrap(), true);
    let f = &s.report.fusions;
    assert!(f.applied.is_empty(), "{}", f.render());
    assert!(f.rejected[0].reason.contains("shapes differ"), "{}", f.render());
    let (g, u) = (values(10, 8), values(5, 9));
    let out = run(&mut s, vec![("g", f32_tensor(&[2, 5], &g)), ("u", f32_tensor(&[5], &u))]);
    let want: Vec<f64> = (0..10).map(|i| silu_mul(g[i] as f64, u[i % 5] as f64)).collect();
    assert_close(&out[0], &want, 1e-6);
}

#[test]
fn a_matched_node_with_attributes_the_replacement_drops_is_not_fused() {
    // A package "fuses" LeakyRelu into Relu without taking its attributes: alpha would be lost.
    let fusion = r#"
name = "leaky-as-relu"
match = [{ op = "LeakyRelu", inputs = ["x"], outputs = ["y"] }]
replace = [{ op = "Relu", inputs = ["x"], outputs = ["y"] }]
outputs = ["y"]
"#;
    let (mut reg, _) = kiln_host::packages::registry(&[], &[]);
    assert!(reg.add(package_on_unary_shim("leaky", fusion), kiln_registry::USER));
    let rt = kiln_host::ep::Runtime::new(reg, kiln_host::sandbox::SandboxConfig::default()).unwrap();
    let nodes = vec![node("LeakyRelu", &["x"], &["y"], vec![onnx::attr_float("alpha", 0.1)])];
    let m = onnx::model(nodes, vec![value("x", F32, &[4])], vec![value("y", F32, &[4])], vec![]);
    let m = model::load_bytes(&onnx::bytes(&m), None).unwrap();
    let mut s = Session::new(rt, m, SessionOptions::default()).unwrap();
    let f = &s.report.fusions;
    assert!(f.applied.is_empty(), "{}", f.render());
    assert!(f.rejected[0].reason.contains("attributes (alpha)"), "{}", f.render());
    let out = run(&mut s, vec![("x", f32_tensor(&[4], &[-1.0, -0.5, 0.5, 2.0]))]);
    assert_close(&out[0], &[-0.1, -0.05, 0.5, 2.0], 1e-6);
}

#[test]
fn two_matches_that_would_need_each_other_are_not_both_rewritten() {
    // Each match {Relu(p) -> r, Add(r, q) -> s} is convex alone, but its replacement (one node
    // making r and s from p and q) makes r depend on q: with q1 = Neg(r2) and q2 = Neg(r1),
    // rewriting both would be a cycle. The second is refused and the graph stays orderable.
    let fusion = r#"
name = "relu-add"
match = [
  { op = "Relu", inputs = ["p"], outputs = ["r"] },
  { op = "Add", inputs = ["r", "q"], outputs = ["s"] },
]
replace = [{ domain = "ai.kiln", op = "AppendAttentionMask", inputs = ["p", "q"], outputs = ["s", "r"] }]
outputs = ["r", "s"]
"#;
    let (mut reg, _) = kiln_host::packages::registry(&[], &[]);
    assert!(reg.add(package_on_unary_shim("two-outputs", fusion), kiln_registry::USER));
    const I64: i32 = 7;
    let nodes = vec![
        node("Relu", &["p1"], &["r1"], vec![]),
        node("Relu", &["p2"], &["r2"], vec![]),
        node("Neg", &["r1"], &["q2"], vec![]),
        node("Neg", &["r2"], &["q1"], vec![]),
        node("Add", &["r1", "q1"], &["s1"], vec![]),
        node("Add", &["r2", "q2"], &["s2"], vec![]),
    ];
    let inputs = vec![value("p1", I64, &[1, 4]), value("p2", I64, &[1, 4])];
    let m = onnx::model(nodes, inputs, vec![value("s1", I64, &[1, 4]), value("s2", I64, &[1, 4])], vec![]);
    let mut m = model::load_bytes(&onnx::bytes(&m), None).unwrap();
    let f = kiln_host::fuse::fuse(&mut m, &reg, None);
    assert_eq!(f.applied.len(), 1, "{}", f.render());
    assert_eq!(f.rejected.len(), 1, "{}", f.render());
    assert!(f.rejected[0].reason.contains("cycle"), "{}", f.render());
    // Every node reads only graph inputs or values made before it.
    let g = &m.graph;
    let mut made: std::collections::HashSet<usize> = g.inputs.iter().copied().collect();
    for n in &g.nodes {
        assert!(n.inputs.iter().flatten().all(|v| made.contains(v)), "{} reads a value made later", n.name);
        made.extend(n.outputs.iter().flatten());
    }
    assert_eq!(g.nodes.len(), 5, "one Relu + Add pair became one node");
}

#[test]
fn named_dimensions_count_as_the_same_size() {
    // g and u are both [n, 5] (n symbolic): one shape, so SwiGlu(g, u) replaces the three
    // nodes; u [5] broadcasts and is not fused.
    let graph = |u_dims: &[i64]| {
        let nodes = vec![
            node("Sigmoid", &["g"], &["s"], vec![]),
            node("Mul", &["g", "s"], &["a"], vec![]),
            node("Mul", &["a", "u"], &["y"], vec![]),
        ];
        let inputs = vec![value("g", F32, &[-1, 5]), value("u", F32, u_dims)];
        let m = onnx::model(nodes, inputs, vec![value("y", F32, &[-1, 5])], vec![]);
        model::load_bytes(&onnx::bytes(&m), None).unwrap()
    };
    let mut s = session(graph(&[-1, 5]), true);
    assert_eq!(s.report.fusions.applied.len(), 1, "{}", s.report.fusions.render());
    let (g, u) = (values(15, 10), values(15, 11));
    let out = run(&mut s, vec![("g", f32_tensor(&[3, 5], &g)), ("u", f32_tensor(&[3, 5], &u))]);
    let want: Vec<f64> = g.iter().zip(&u).map(|(a, b)| silu_mul(*a as f64, *b as f64)).collect();
    assert_close(&out[0], &want, 1e-6);
    let s = session(graph(&[5]), true);
    assert!(s.report.fusions.applied.is_empty());
    assert!(
        s.report.fusions.rejected[0].reason.contains("shapes differ: g [n, 5], u [5]"),
        "{}",
        s.report.fusions.render()
    );
}

// ---- kiln-matmul's decode fusions -------------------------------------------------------------

const H: usize = 16; // hidden
const F: usize = 24; // MLP width
const V: usize = 20; // vocabulary

/// A decoder layer as onnxruntime-genai's builder writes one (float32, `rows` rows):
/// SimplifiedLayerNormalization → MatMul(Wq) → MatMul(Wo) → SkipSimplifiedLayerNormalization →
/// gate/up MatMuls, SiLU·mul, MatMul(Wd) → SkipSimplifiedLayerNormalization → MatMul(Wl). With
/// `sum_out` the last norm's sum is a graph output too.
fn decoder_layer(rows: usize, sum_out: bool) -> Model {
    let com = |mut n: onnx::NodeProto| {
        n.domain = "com.microsoft".into();
        n
    };
    let last_outputs: &[&str] = if sum_out { &["n2", "", "", "s2"] } else { &["n2"] };
    let nodes = vec![
        node("SimplifiedLayerNormalization", &["x", "g0"], &["n0"], vec![onnx::attr_float("epsilon", 1e-5)]),
        node("MatMul", &["n0", "Wq"], &["q"], vec![]),
        node("MatMul", &["q", "Wo"], &["o"], vec![]),
        com(node(
            "SkipSimplifiedLayerNormalization",
            &["x", "o", "g1"],
            &["n1", "", "", "s1"],
            vec![onnx::attr_float("epsilon", 1e-6)],
        )),
        node("MatMul", &["n1", "Wg"], &["g"], vec![]),
        node("MatMul", &["n1", "Wu"], &["u"], vec![]),
        node("Sigmoid", &["g"], &["sg"], vec![]),
        node("Mul", &["g", "sg"], &["a"], vec![]),
        node("Mul", &["a", "u"], &["h"], vec![]),
        node("MatMul", &["h", "Wd"], &["d"], vec![]),
        com(node(
            "SkipSimplifiedLayerNormalization",
            &["s1", "d", "g2"],
            last_outputs,
            vec![onnx::attr_float("epsilon", 1e-6)],
        )),
        node("MatMul", &["n2", "Wl"], &["logits"], vec![]),
    ];
    let mut outputs = vec![value("logits", F32, &[rows as i64, V as i64])];
    if sum_out {
        outputs.push(value("s2", F32, &[rows as i64, H as i64]));
    }
    let (h, f, v) = (H as i64, F as i64, V as i64);
    let inits = vec![
        onnx::init_f32("g0", &[h], &values(H, 10)),
        onnx::init_f32("g1", &[h], &values(H, 11)),
        onnx::init_f32("g2", &[h], &values(H, 12)),
        onnx::init_f32("Wq", &[h, h], &values(H * H, 13)),
        onnx::init_f32("Wo", &[h, h], &values(H * H, 14)),
        onnx::init_f32("Wg", &[h, f], &values(H * F, 15)),
        onnx::init_f32("Wu", &[h, f], &values(H * F, 16)),
        onnx::init_f32("Wd", &[f, h], &values(F * H, 17)),
        onnx::init_f32("Wl", &[h, v], &values(H * V, 18)),
    ];
    let mut m = onnx::model(nodes, vec![value("x", F32, &[rows as i64, h])], outputs, inits);
    m.opset_import.push(onnx::OperatorSetIdProto { domain: "com.microsoft".into(), version: 1, ..Default::default() });
    model::load_bytes(&onnx::bytes(&m), None).unwrap()
}

/// `x [rows, k] · w [k, n]` in float64 (w row-major as ONNX stores it).
fn matmul64(x: &[f64], w: &[f32], k: usize, n: usize) -> Vec<f64> {
    let rows = x.len() / k;
    let mut y = vec![0.0; rows * n];
    for r in 0..rows {
        for c in 0..n {
            y[r * n + c] = (0..k).map(|i| x[r * k + i] * w[i * n + c] as f64).sum();
        }
    }
    y
}

/// RMS norm of each `H`-wide row, times gamma, in float64.
fn rms64(s: &[f64], gamma: &[f32], eps: f64) -> Vec<f64> {
    s.chunks(H)
        .flat_map(|row| {
            let rms = (row.iter().map(|v| v * v).sum::<f64>() / H as f64 + eps).sqrt();
            row.iter().zip(gamma).map(move |(v, g)| v / rms * *g as f64).collect::<Vec<_>>()
        })
        .collect()
}

/// The layer's logits and last sum in float64.
fn decoder_layer_reference(x: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let x: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let q = matmul64(&rms64(&x, &values(H, 10), 1e-5), &values(H * H, 13), H, H);
    let o = matmul64(&q, &values(H * H, 14), H, H);
    let s1: Vec<f64> = x.iter().zip(&o).map(|(a, b)| a + b).collect();
    let n1 = rms64(&s1, &values(H, 11), 1e-6);
    let (g, u) = (matmul64(&n1, &values(H * F, 15), H, F), matmul64(&n1, &values(H * F, 16), H, F));
    let h: Vec<f64> = g.iter().zip(&u).map(|(&g, &u)| silu_mul(g, u)).collect();
    let d = matmul64(&h, &values(F * H, 17), F, H);
    let s2: Vec<f64> = s1.iter().zip(&d).map(|(a, b)| a + b).collect();
    let logits = matmul64(&rms64(&s2, &values(H, 12), 1e-6), &values(H * V, 18), H, V);
    (logits, s2)
}

#[test]
fn a_decoder_layer_becomes_rms_norm_linears_one_with_the_swiglu_and_linears() {
    // 3 rows take the GEMV path on a GPU, 40 the prologue + cuBLASLt path; the CPU reference
    // is the same for both.
    for (rows, sum_out) in [(3, false), (40, true)] {
        let x = values(rows * H, 20 + rows as u64);
        let mut fused = session(decoder_layer(rows, sum_out), true);
        let f = &fused.report.fusions;
        let counts = f.applied_counts();
        let last = if sum_out { "skip-rmsnorm-linear" } else { "skip-rmsnorm-linear-last" };
        let want: std::collections::BTreeMap<&str, usize> =
            [("rmsnorm-linear", 1), ("linear", 1), ("skip-rmsnorm-mlp", 1), (last, 1)].into_iter().collect();
        assert_eq!(counts, want, "{}", f.render());
        let ops: Vec<&str> = fused.model().graph.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(ops, ["RmsNormLinear", "Linear", "RmsNormLinear", "Linear", "RmsNormLinear"]);
        // Gate/up's RmsNormLinear computes the SwiGLU (its epilogue), the down projection is Linear.
        let swiglu: Vec<i64> = fused
            .model()
            .graph
            .nodes
            .iter()
            .map(|n| match n.attributes.iter().find(|(name, _)| name == "swiglu") {
                Some((_, model::AttrValue::Int(v))) => *v,
                _ => 0,
            })
            .collect();
        assert_eq!(swiglu, [0, 0, 1, 0, 0]);
        // Every weight is stored [N, K] now: Wq, Wo [H, H], [Wg | Wu]ᵀ [2F, H], Wdᵀ [H, F], Wlᵀ [V, H].
        let mut shapes: Vec<Vec<usize>> =
            fused.model().graph.initializers.values().filter(|t| t.shape.len() == 2).map(|t| t.shape.clone()).collect();
        shapes.sort();
        assert_eq!(shapes, vec![vec![H, H], vec![H, H], vec![H, F], vec![V, H], vec![2 * F, H]]);
        let mut unfused = session(decoder_layer(rows, sum_out), false);
        let a = run(&mut fused, vec![("x", f32_tensor(&[rows, H], &x))]);
        let b = run(&mut unfused, vec![("x", f32_tensor(&[rows, H], &x))]);
        let (logits, s2) = decoder_layer_reference(&x);
        assert_close(&a[0], &logits, 1e-5);
        assert_close(&b[0], &logits, 1e-5);
        if sum_out {
            assert_close(&a[1], &s2, 1e-6);
        }
    }
}

#[test]
fn verify_proves_every_fusion_of_kiln_matmul_on_the_cpu() {
    use kiln_host::cli::verify_fusion::fusion_cases;
    let rt = kiln_tests::builtin_runtime();
    let pkg = rt.registry.packages().find(|p| p.name() == "kiln-matmul").expect("kiln-matmul is built in").clone();
    let cases = fusion_cases(&rt, &pkg, Device::Cpu, 1);
    let names: std::collections::BTreeSet<&str> = cases.iter().map(|c| c.fusion.as_str()).collect();
    let dense = ["linear", "rmsnorm-linear", "skip-rmsnorm-linear", "skip-rmsnorm-linear-last", "skip-rmsnorm-mlp"];
    let mut want: std::collections::BTreeSet<String> =
        dense.iter().flat_map(|d| [d.to_string(), format!("{d}-nbits")]).collect();
    want.insert("linear-bias".into());
    assert_eq!(names, want.iter().map(String::as_str).collect());
    for c in &cases {
        assert!(
            matches!(c.outcome, kiln_host::conformance::Outcome::Passed),
            "{} {}: {:?}",
            c.fusion,
            c.dtype,
            c.outcome
        );
    }
    // float32, float16 and bfloat16 each.
    assert_eq!(cases.len(), 33);
}

/// A MatMulNBits model: X [2, 64] float32 times a 4-bit weight [N = 8, K = 64] with blocks of
/// `block` values (uint8 [8, 64 / block, block / 2], scales [8, 64 / block]), attributes as
/// given.
fn matmul_nbits(block: usize, attributes: Vec<onnx::AttributeProto>) -> Model {
    let (n, k) = (8usize, 64usize);
    let kb = k / block;
    let bytes: Vec<u8> = (0..n * kb * block / 2).map(|i| (i * 37 % 256) as u8).collect();
    let mut nb = node("MatMulNBits", &["x", "B", "scales"], &["y"], attributes);
    nb.domain = "com.microsoft".into();
    let b = onnx::TensorProto {
        name: "B".into(),
        data_type: 2,
        dims: vec![n as i64, kb as i64, (block / 2) as i64],
        raw_data: bytes,
        ..Default::default()
    };
    let scales = onnx::init_f32("scales", &[n as i64, kb as i64], &values(n * kb, 7));
    let mut m = onnx::model(
        vec![nb],
        vec![value("x", F32, &[2, k as i64])],
        vec![value("y", F32, &[2, n as i64])],
        vec![b, scales],
    );
    m.opset_import.push(onnx::OperatorSetIdProto { domain: "com.microsoft".into(), version: 1, ..Default::default() });
    model::load_bytes(&onnx::bytes(&m), None).unwrap()
}

#[test]
fn matmul_nbits_fuses_only_with_the_attributes_its_pattern_names() {
    let int = onnx::attr_int;
    let x = f32_tensor(&[2, 64], &values(128, 3));
    let attrs = |block: i64, extra: Vec<onnx::AttributeProto>| {
        let mut a = vec![int("K", 64), int("N", 8), int("bits", 4), int("block_size", block)];
        a.extend(extra);
        a
    };
    let run_model = |m: Model, fuse: bool| {
        let mut s = session(m, fuse);
        let out = run(&mut s, vec![("x", x.clone())]);
        (out, s.report.fusions.clone())
    };
    // Blocks of 32 with accuracy_level (any value, carried over as "$acc"): linear-nbits, equal to
    // the unfused op.
    let (fused, report) = run_model(matmul_nbits(32, attrs(32, vec![int("accuracy_level", 4)])), true);
    assert!(report.applied.iter().any(|a| a.fusion == "linear-nbits"), "{}", report.render());
    let (plain, _) = run_model(matmul_nbits(32, attrs(32, vec![int("accuracy_level", 4)])), false);
    assert_eq!(fused, plain);
    // Blocks of 16: the pattern needs 32, so MatMulNBits runs unfused, the reason reported.
    let (_, report) = run_model(matmul_nbits(16, attrs(16, vec![])), true);
    assert!(report.applied.is_empty(), "{}", report.render());
    let why = &report.rejected.iter().find(|r| r.fusion == "linear-nbits").expect("linear-nbits rejected").reason;
    assert!(why.contains("attribute block_size is 16, the pattern needs 32"), "{why}");
    // N contradicting B's first dimension: not fused (the unfused op then refuses it).
    let mut bad = attrs(32, vec![]);
    bad[1] = int("N", 9);
    let m = matmul_nbits(32, bad);
    let options = SessionOptions { device: Device::Cpu, ..SessionOptions::default() };
    let err = match Session::new(kiln_tests::builtin_runtime(), m, options) {
        Ok(s) => panic!("N = 9 over B [8, 2, 16] was accepted: {}", s.report.fusions.render()),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("MatMulNBits"), "{err}");
}

/// A 4-bit weight `name` [n, k / 32, 16] (blocks of 32) and its scales `{name}_s` [n, k / 32].
fn nbits_weight(name: &str, n: usize, k: usize, seed: u64) -> [onnx::TensorProto; 2] {
    let kb = k / 32;
    let bytes: Vec<u8> = (0..n * kb * 16).map(|i| ((i as u64 * 37 + seed * 11) % 256) as u8).collect();
    let b = onnx::TensorProto {
        name: name.into(),
        data_type: 2,
        dims: vec![n as i64, kb as i64, 16],
        raw_data: bytes,
        ..Default::default()
    };
    [b, onnx::init_f32(&format!("{name}_s"), &[n as i64, kb as i64], &values(n * kb, seed))]
}

/// The model builder's int4 MLP: SkipSimplifiedLayerNormalization of x [2, 64] and skip, then
/// MatMulNBits gate and up (F = 32), SiLU as Sigmoid·Mul, Mul, and MatMulNBits down, the three
/// MatMulNBits at `levels` of accuracy_level (None: the attribute left out).
fn nbits_mlp(levels: [Option<i64>; 3]) -> Model {
    let int = onnx::attr_int;
    let mnb = |a: &str, b: &str, y: &str, k: i64, n: i64, level: Option<i64>| {
        let mut attrs = vec![int("K", k), int("N", n), int("bits", 4), int("block_size", 32)];
        attrs.extend(level.map(|l| int("accuracy_level", l)));
        let mut nd = node("MatMulNBits", &[a, b, &format!("{b}_s")], &[y], attrs);
        nd.domain = "com.microsoft".into();
        nd
    };
    let mut norm = node(
        "SkipSimplifiedLayerNormalization",
        &["x", "skip", "gamma"],
        &["n", "", "", "sum"],
        vec![onnx::attr_float("epsilon", 1e-6)],
    );
    norm.domain = "com.microsoft".into();
    let nodes = vec![
        norm,
        mnb("n", "Bg", "g", 64, 32, levels[0]),
        mnb("n", "Bu", "u", 64, 32, levels[1]),
        node("Sigmoid", &["g"], &["s"], vec![]),
        node("Mul", &["g", "s"], &["a"], vec![]),
        node("Mul", &["a", "u"], &["h"], vec![]),
        mnb("h", "Bd", "y", 32, 64, levels[2]),
    ];
    let mut inits = vec![onnx::init_f32("gamma", &[64], &values(64, 9))];
    inits.extend(nbits_weight("Bg", 32, 64, 1));
    inits.extend(nbits_weight("Bu", 32, 64, 2));
    inits.extend(nbits_weight("Bd", 64, 32, 3));
    let mut m = onnx::model(
        nodes,
        vec![value("x", F32, &[2, 64]), value("skip", F32, &[2, 64])],
        vec![value("y", F32, &[2, 64]), value("sum", F32, &[2, 64])],
        inits,
    );
    m.opset_import.push(onnx::OperatorSetIdProto { domain: "com.microsoft".into(), version: 1, ..Default::default() });
    model::load_bytes(&onnx::bytes(&m), None).unwrap()
}

/// MatMulNBits' accuracy_level reaches the fused ops through the attribute variable `$acc`
/// (manifest schema 17): one level across the match, carried to RmsNormLinear and Linear (at 4
/// the CPU quantizes A to int8 in both, so fused equals unfused); left out where the match has
/// none; and a match whose MatMulNBits disagree is not fused, the reason naming the variable.
#[test]
fn matmul_nbits_accuracy_level_carries_over_to_the_fused_ops() {
    let feeds = || vec![("x", f32_tensor(&[2, 64], &values(128, 4))), ("skip", f32_tensor(&[2, 64], &values(128, 5)))];
    let level_of = |s: &Session, op: &str| -> Vec<Option<i64>> {
        s.model()
            .graph
            .nodes
            .iter()
            .filter(|n| n.op_type == op)
            .map(|n| {
                n.attributes.iter().find(|(a, _)| a == "accuracy_level").map(|(_, v)| match v {
                    kiln_host::model::AttrValue::Int(i) => *i,
                    other => panic!("accuracy_level is {other:?}"),
                })
            })
            .collect()
    };
    for level in [Some(4), Some(1), None] {
        let mut fused = session(nbits_mlp([level; 3]), true);
        let applied: Vec<&str> = fused.report.fusions.applied.iter().map(|a| a.fusion.as_str()).collect();
        assert_eq!(applied, ["skip-rmsnorm-mlp-nbits"], "{}", fused.report.fusions.render());
        assert_eq!(level_of(&fused, "RmsNormLinear"), [level]);
        assert_eq!(level_of(&fused, "Linear"), [level]);
        // The fused ops round A once from f64 where the unfused graph rounds each op (a few
        // ulp); at level 4 the int8 quantization of the same A gives the same sums.
        let mut plain = session(nbits_mlp([level; 3]), false);
        let (f, p) = (run(&mut fused, feeds()), run(&mut plain, feeds()));
        for (a, b) in f.iter().flatten().zip(p.iter().flatten()) {
            let scale = p.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
            assert!((a - b).abs() <= 1e-5 * scale, "accuracy_level {level:?}: {a} vs {b}");
        }
    }
    // Level 4 computes otherwise than level 1 (int8 against f32 activations).
    let mut int8 = session(nbits_mlp([Some(4); 3]), true);
    let mut f32s = session(nbits_mlp([Some(1); 3]), true);
    assert_ne!(run(&mut int8, feeds()), run(&mut f32s, feeds()));
    // Gate at 4, up at 1: the MLP fusion is refused, naming $acc.
    let mixed = session(nbits_mlp([Some(4), Some(1), Some(4)]), true);
    let report = &mixed.report.fusions;
    assert!(!report.applied.iter().any(|a| a.fusion == "skip-rmsnorm-mlp-nbits"), "{}", report.render());
    let why = report
        .rejected
        .iter()
        .find(|r| r.fusion == "skip-rmsnorm-mlp-nbits" && r.reason.contains("$acc"))
        .unwrap_or_else(|| panic!("no rejection naming $acc: {}", report.render()));
    assert!(why.reason.contains("Int(4)") && why.reason.contains("Int(1)"), "{}", why.reason);
}

#[test]
fn matmul_nbits_with_zero_points_is_left_to_its_own_op() {
    // linear-nbits names MatMulNBits(x, B, scales): a node with zero points (a fourth input) does
    // not match, and runs as MatMulNBits.
    let int = onnx::attr_int;
    let base = matmul_nbits(32, vec![int("K", 64), int("N", 8), int("bits", 4), int("block_size", 32)]);
    let mut g = base.graph.clone();
    let zp = g.values.len();
    g.values.push(kiln_host::model::Value { name: "zp".into(), ty: None });
    g.initializers.insert(zp, Tensor::new(kiln_kernel_abi::DType::U8, vec![8, 1], vec![0x88u8; 8].into()).unwrap());
    g.nodes[0].inputs.push(Some(zp));
    let with_zp = Model { graph: g, ..base };
    let mut s = session(with_zp, true);
    assert!(s.report.fusions.applied.is_empty(), "{}", s.report.fusions.render());
    let out = run(&mut s, vec![("x", f32_tensor(&[2, 64], &values(128, 3)))]);
    // Zero point 8 in every block is MatMulNBits' default: the same as the fused model.
    let mut fused =
        session(matmul_nbits(32, vec![int("K", 64), int("N", 8), int("bits", 4), int("block_size", 32)]), true);
    assert_eq!(run(&mut fused, vec![("x", f32_tensor(&[2, 64], &values(128, 3)))]), out);
}

#[test]
fn a_quantized_linear_takes_bits_and_block_size_or_refuses_ambiguous_shapes() {
    // W [8, 1, 16] for K = 16 fits 4 bits in blocks of 32 and 8 bits in blocks of 16: without
    // the attributes the op refuses it; with them it computes MatMulNBits' product.
    let int = onnx::attr_int;
    let model_with = |attrs: Vec<onnx::AttributeProto>, op: &str, domain: &str| {
        let mut n = node(op, &["x", "B", "scales"], &["y"], attrs);
        n.domain = domain.into();
        let b = onnx::TensorProto {
            name: "B".into(),
            data_type: 2,
            dims: vec![8, 1, 16],
            raw_data: (0..128u32).map(|i| (i * 29 % 256) as u8).collect(),
            ..Default::default()
        };
        let scales = onnx::init_f32("scales", &[8], &values(8, 5));
        let mut m =
            onnx::model(vec![n], vec![value("x", F32, &[3, 16])], vec![value("y", F32, &[3, 8])], vec![b, scales]);
        m.opset_import.push(onnx::OperatorSetIdProto { domain: domain.into(), version: 1, ..Default::default() });
        model::load_bytes(&onnx::bytes(&m), None).unwrap()
    };
    let options = SessionOptions { device: Device::Cpu, fuse: false, ..SessionOptions::default() };
    let err =
        match Session::new(kiln_tests::builtin_runtime(), model_with(vec![], "Linear", "ai.kiln"), options.clone()) {
            Ok(_) => panic!("an ambiguous quantized weight must be refused"),
            Err(e) => e.to_string(),
        };
    assert!(err.contains("fits more than one bits / block_size pair for K = 16"), "{err}");
    let attrs = || vec![int("bits", 4), int("block_size", 32)];
    let x = f32_tensor(&[3, 16], &values(48, 9));
    let mut linear =
        Session::new(kiln_tests::builtin_runtime(), model_with(attrs(), "Linear", "ai.kiln"), options.clone()).unwrap();
    let mut nbits_attrs = attrs();
    nbits_attrs.extend([int("K", 16), int("N", 8)]);
    let mut reference = Session::new(
        kiln_tests::builtin_runtime(),
        model_with(nbits_attrs, "MatMulNBits", "com.microsoft"),
        options.clone(),
    )
    .unwrap();
    assert_eq!(run(&mut linear, vec![("x", x.clone())]), run(&mut reference, vec![("x", x.clone())]));
    let bad = vec![int("bits", 8), int("block_size", 32)];
    let err = match Session::new(kiln_tests::builtin_runtime(), model_with(bad, "Linear", "ai.kiln"), options.clone()) {
        Ok(_) => panic!("bits 8 over blobs of 16 bytes for blocks of 32 must be refused"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("bits 8 and block_size 32 do not fit W [N, 1, 16] for K = 16"), "{err}");
    // A block size past the shim's 32-bit usize is refused, not wrapped to 0.
    let huge = vec![int("bits", 4), int("block_size", 1 << 32)];
    let err = match Session::new(kiln_tests::builtin_runtime(), model_with(huge, "Linear", "ai.kiln"), options) {
        Ok(_) => panic!("block_size 2^32 must be refused"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("bits 4 and block_size 4294967296 do not fit"), "{err}");
}

#[test]
fn an_int4_decoder_fused_gives_the_unfused_logits() {
    // tiny-llama's int4 folder (MatMulNBits, float32 activations): every projection becomes a
    // kiln-matmul op over the 4-bit weights (the host's qgemm on the CPU) with the same logits.
    use kiln_host::genai::{Generator, ModelFolder};
    let folder = kiln_tests::fixture("llm/tiny-llama-v512-int4-acc1-cpu");
    let logits = |fuse: bool| {
        let options = SessionOptions { device: Device::Cpu, fuse, ..SessionOptions::default() };
        let mut g =
            Generator::new(kiln_tests::builtin_runtime(), ModelFolder::open(&folder).unwrap(), options).unwrap();
        let applied: Vec<String> = g.session.report.fusions.applied.iter().map(|a| a.fusion.clone()).collect();
        let (mut kv, first) = g.prefill(&[vec![1, 15, 27, 300, 4]], 16).unwrap();
        let next = g.decode(&mut kv, &[42]).unwrap();
        g.free(kv);
        (applied, first, next)
    };
    let (applied, f1, n1) = logits(true);
    let (none, f0, n0) = logits(false);
    assert!(none.is_empty());
    for name in ["skip-rmsnorm-mlp-nbits", "skip-rmsnorm-linear-nbits", "rmsnorm-linear-nbits", "linear-nbits"] {
        assert!(applied.iter().any(|a| a == name), "{name} not applied: {applied:?}");
    }
    for (a, b) in [(&f1, &f0), (&n1, &n0)] {
        let (a, b) = (&a[0], &b[0]);
        let worst = a.iter().zip(b.iter()).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(worst <= 1e-4 * scale.max(1.0), "fused vs unfused logits differ by {worst} (max |logit| {scale})");
    }
}

#[test]
fn rms_norm_linear_refuses_a_skip_that_is_not_whole_rows() {
    // skip [1] would broadcast one value (the unfused SkipSimplifiedLayerNormalization refuses
    // it, and the GEMV reads skip in whole rows): a clear error, not a read past the tensor.
    let mut n = node("RmsNormLinear", &["x", "skip", "gamma", "W"], &["y"], vec![]);
    n.domain = "ai.kiln".into();
    let inits = vec![
        onnx::init_f32("gamma", &[H as i64], &values(H, 1)),
        onnx::init_f32("W", &[4, H as i64], &values(4 * H, 2)),
    ];
    let mut m = onnx::model(
        vec![n],
        vec![value("x", F32, &[2, H as i64]), value("skip", F32, &[1])],
        vec![value("y", F32, &[2, 4])],
        inits,
    );
    m.opset_import.push(onnx::OperatorSetIdProto { domain: "ai.kiln".into(), version: 1, ..Default::default() });
    let m = model::load_bytes(&onnx::bytes(&m), None).unwrap();
    // Refused when the session infers the node's shapes, before any run.
    let options = SessionOptions { device: Device::Cpu, fuse: false, ..SessionOptions::default() };
    let err = match Session::new(kiln_tests::builtin_runtime(), m, options) {
        Ok(_) => panic!("a skip of shape [1] must be refused"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("skip of shape [1] must have X's shape [2, 16] or a suffix of it that ends in K"), "{err}");
}

/// `RmsNormLinear(x, skip, gamma, W [2F, H])` with `swiglu = 1` as one node on the CPU: Y
/// `[rows, F]` is SiLU of the product's first half times its second, against float64; an odd N
/// and a value other than 0 or 1 are refused with the node's reason.
#[test]
fn rms_norm_linear_with_swiglu_gives_silu_of_gate_times_up_and_refuses_odd_n() {
    const F: usize = 12;
    let build = |n_rows: usize, swiglu: i64| {
        let mut n = node("RmsNormLinear", &["x", "skip", "gamma", "W"], &["y"], vec![onnx::attr_int("swiglu", swiglu)]);
        n.domain = "ai.kiln".into();
        let inits = vec![
            onnx::init_f32("gamma", &[H as i64], &values(H, 3)),
            onnx::init_f32("W", &[n_rows as i64, H as i64], &values(n_rows * H, 4)),
        ];
        let mut m = onnx::model(
            vec![n],
            vec![value("x", F32, &[2, H as i64]), value("skip", F32, &[2, H as i64])],
            vec![value("y", F32, &[2, (n_rows / 2) as i64])],
            inits,
        );
        m.opset_import.push(onnx::OperatorSetIdProto { domain: "ai.kiln".into(), version: 1, ..Default::default() });
        model::load_bytes(&onnx::bytes(&m), None).unwrap()
    };
    let (x, skip) = (values(2 * H, 5), values(2 * H, 6));
    let mut s = session(build(2 * F, 1), false);
    let y = run(&mut s, vec![("x", f32_tensor(&[2, H], &x)), ("skip", f32_tensor(&[2, H], &skip))]);
    let sum: Vec<f64> = x.iter().zip(&skip).map(|(a, b)| *a as f64 + *b as f64).collect();
    let a = rms64(&sum, &values(H, 3), 1e-12);
    let w = values(2 * F * H, 4);
    let dot = |r: usize, c: usize| (0..H).map(|i| a[r * H + i] * w[c * H + i] as f64).sum::<f64>();
    let want: Vec<f64> =
        (0..2).flat_map(|r| (0..F).map(move |j| (r, j))).map(|(r, j)| silu_mul(dot(r, j), dot(r, F + j))).collect();
    assert_close(&y[0], &want, 1e-5);
    let refused = |n_rows: usize, swiglu: i64| {
        let options = SessionOptions { device: Device::Cpu, fuse: false, ..SessionOptions::default() };
        match Session::new(kiln_tests::builtin_runtime(), build(n_rows, swiglu), options) {
            Ok(_) => panic!("RmsNormLinear with {n_rows} weight rows and swiglu = {swiglu} must be refused"),
            Err(e) => e.to_string(),
        }
    };
    let err = refused(2 * F + 1, 1);
    assert!(err.contains("swiglu = 1 needs W's N = 25 rows as [gate | up] halves, an even count"), "{err}");
    let err = refused(2 * F, 2);
    assert!(err.contains("swiglu must be 0 or 1, got 2"), "{err}");
}
