//! Control flow (issue 11, item 3): If, Loop, Scan and SequenceMap run by the executor with a
//! session per subgraph, and the sequence and optional values they carry. Each result is checked against the same computation written out here in f64;
//! ONNX's own If, Loop and Scan node tests run in `conformance`.

use kiln_host::ep::{Session, SessionOptions};
use kiln_host::{model, Error, HostValue, Tensor};
use kiln_kernel_abi::DType;
use kiln_tests::onnx::{self, attr_graph, attr_int, attr_ints, graph, node, value};
use kiln_tests::{builtin_runtime, f32_tensor, f32_values};

const F32: i32 = 1;
const I64: i32 = 7;
const BOOL: i32 = 9;

fn i64_scalar(v: i64) -> Tensor {
    Tensor::new(DType::I64, vec![], v.to_le_bytes().to_vec().into()).unwrap()
}

fn bool_scalar(v: bool) -> Tensor {
    Tensor::new(DType::Bool, vec![], vec![v as u8].into()).unwrap()
}

fn session(m: &onnx::ModelProto, options: SessionOptions) -> Result<Session, Error> {
    let m = model::load_bytes(&onnx::bytes(m), None)?;
    Session::new(builtin_runtime(), m, options)
}

fn run(m: &onnx::ModelProto, feeds: Vec<(&str, Tensor)>) -> Result<Vec<Tensor>, Error> {
    let mut s = session(m, SessionOptions::default())?;
    let outs = s.run(feeds.into_iter().map(|(n, t)| (n.to_string(), t)).collect())?;
    Ok(outs.into_iter().map(|(_, t)| t).collect())
}

fn assert_close(got: &Tensor, shape: &[usize], want: &[f64]) {
    assert_eq!(got.shape, shape);
    let got = f32_values(got);
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((*g as f64 - w).abs() <= 1e-6 * w.abs().max(1.0), "element {i}: {g} vs {w}");
    }
}

/// A Loop of `n` iterations carrying `acc`, whose body holds an If: iterations after the
/// second add `x`, the others subtract it. `x` is read two scopes out (the If's branches), `i`
/// and `acc_in` one scope out; the scan output is each iteration's `acc`. A second If, outside,
/// returns `x` itself (an outer value as a branch's output) or the Loop's result.
fn nested_model() -> onnx::ModelProto {
    let branch = |op: &str, name: &str| {
        graph(
            name,
            vec![node(op, &["acc_in", "x"], &[&format!("{name}_out")], vec![])],
            vec![],
            vec![value(&format!("{name}_out"), F32, &[3])],
        )
    };
    let body = graph(
        "body",
        vec![
            node("Identity", &["cond_in"], &["cond_out"], vec![]),
            node("Greater", &["i", "one"], &["late"], vec![]),
            node(
                "If",
                &["late"],
                &["acc_out"],
                vec![
                    attr_graph("then_branch", branch("Add", "then")),
                    attr_graph("else_branch", branch("Sub", "else")),
                ],
            ),
            node("Identity", &["acc_out"], &["scan_out"], vec![]),
        ],
        vec![value("i", I64, &[]), value("cond_in", BOOL, &[]), value("acc_in", F32, &[3])],
        vec![value("cond_out", BOOL, &[]), value("acc_out", F32, &[3]), value("scan_out", F32, &[3])],
    );
    let pick = |name: &str, out: &str| {
        graph(
            name,
            vec![node("Identity", &[out], &[&format!("{name}_y")], vec![])],
            vec![],
            vec![value(&format!("{name}_y"), F32, &[3])],
        )
    };
    let mut m = onnx::model(
        vec![
            node("Constant", &[], &["one"], vec![tensor_attr_i64("value", 1)]),
            node("Loop", &["n", "", "init"], &["acc", "history"], vec![attr_graph("body", body)]),
            node(
                "If",
                &["pick_x"],
                &["picked"],
                vec![attr_graph("then_branch", pick("px", "x")), attr_graph("else_branch", pick("pa", "acc"))],
            ),
        ],
        vec![value("x", F32, &[3]), value("init", F32, &[3]), value("n", I64, &[]), value("pick_x", BOOL, &[])],
        vec![value("acc", F32, &[3]), value("history", F32, &[-1, 3]), value("picked", F32, &[3])],
        vec![],
    );
    m.graph.as_mut().unwrap().name = "nested".into();
    m
}

fn tensor_attr_i64(name: &str, v: i64) -> onnx::AttributeProto {
    onnx::AttributeProto {
        name: name.into(),
        type_: protobuf::EnumOrUnknown::new(onnx::attribute_proto::AttributeType::TENSOR),
        t: protobuf::MessageField::some(onnx::TensorProto {
            data_type: I64,
            int64_data: vec![v],
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[test]
fn loop_and_if_read_values_from_every_enclosing_scope() {
    let x = [0.5f64, -1.25, 2.0];
    let init = [1.0f64, 2.0, 3.0];
    for (n, pick_x) in [(4i64, false), (1, true), (0, false)] {
        let outs = run(
            &nested_model(),
            vec![
                ("x", f32_tensor(&[3], &x.map(|v| v as f32))),
                ("init", f32_tensor(&[3], &init.map(|v| v as f32))),
                ("n", i64_scalar(n)),
                ("pick_x", bool_scalar(pick_x)),
            ],
        )
        .unwrap_or_else(|e| panic!("n = {n}: {e}"));
        let mut acc = init;
        let mut history = Vec::new();
        for i in 0..n {
            for (a, xv) in acc.iter_mut().zip(x) {
                *a = if i > 1 { *a + xv } else { *a - xv };
            }
            history.extend(acc);
        }
        assert_close(&outs[0], &[3], &acc);
        // Zero iterations: the body's declared [3] with a 0 before it.
        assert_close(&outs[1], &[n as usize, 3], &history);
        assert_close(&outs[2], &[3], if pick_x { &x } else { &acc });
    }
}

/// Scan-16 over axis 1 of `xs` [2, len], in reverse, carrying a running sum [2]; its scan
/// output (the sum after each step) stacked along the last axis, reversed again.
fn scan_model() -> onnx::ModelProto {
    let body = graph(
        "body",
        vec![node("Add", &["sum_in", "x_t"], &["sum_out"], vec![]), node("Identity", &["sum_out"], &["seen"], vec![])],
        vec![value("sum_in", F32, &[2]), value("x_t", F32, &[2])],
        vec![value("sum_out", F32, &[2]), value("seen", F32, &[2])],
    );
    onnx::model(
        vec![node(
            "Scan",
            &["s0", "xs"],
            &["sum", "steps"],
            vec![
                attr_graph("body", body),
                attr_int("num_scan_inputs", 1),
                attr_ints("scan_input_axes", &[-1]),
                attr_ints("scan_input_directions", &[1]),
                attr_ints("scan_output_axes", &[-1]),
                attr_ints("scan_output_directions", &[1]),
            ],
        )],
        vec![value("s0", F32, &[2]), value("xs", F32, &[2, -1])],
        vec![value("sum", F32, &[2]), value("steps", F32, &[2, -1])],
        vec![],
    )
}

#[test]
fn scan_slices_and_stacks_along_the_axes_and_directions_it_is_given() {
    let len = 4;
    let xs: Vec<f64> = (0..2 * len).map(|i| (i as f64) * 0.75 - 2.0).collect();
    let s0 = [10.0f64, -3.0];
    let outs = run(
        &scan_model(),
        vec![
            ("s0", f32_tensor(&[2], &s0.map(|v| v as f32))),
            ("xs", f32_tensor(&[2, len], &xs.iter().map(|v| *v as f32).collect::<Vec<_>>())),
        ],
    )
    .unwrap();
    // Step t reads column len-1-t; its output goes to column len-1-t (reversed twice).
    let mut sum = s0;
    let mut steps = vec![0.0; 2 * len];
    for t in 0..len {
        let col = len - 1 - t;
        for r in 0..2 {
            sum[r] += xs[r * len + col];
            steps[r * len + col] = sum[r];
        }
    }
    assert_close(&outs[0], &[2], &sum);
    assert_close(&outs[1], &[2, len], &steps);
}

/// A while loop: no trip count; the body's condition is `i < stop`, so it runs `stop + 1`
/// times, counting them in `count`.
fn while_model() -> onnx::ModelProto {
    let body = graph(
        "body",
        vec![
            node("Less", &["i", "stop"], &["cond_out"], vec![]),
            node("Constant", &[], &["one"], vec![tensor_attr_i64("value", 1)]),
            node("Add", &["count_in", "one"], &["count_out"], vec![]),
        ],
        vec![value("i", I64, &[]), value("cond_in", BOOL, &[]), value("count_in", I64, &[])],
        vec![value("cond_out", BOOL, &[]), value("count_out", I64, &[])],
    );
    onnx::model(
        vec![node("Loop", &["", "go", "zero"], &["count"], vec![attr_graph("body", body)])],
        vec![value("go", BOOL, &[]), value("zero", I64, &[]), value("stop", I64, &[])],
        vec![value("count", I64, &[])],
        vec![],
    )
}

#[test]
fn a_while_loop_stops_on_its_condition_and_one_past_the_iteration_limit_is_an_error() {
    let feeds = |stop: i64, go: bool| {
        vec![
            ("go".to_string(), bool_scalar(go)),
            ("zero".to_string(), i64_scalar(0)),
            ("stop".to_string(), i64_scalar(stop)),
        ]
    };
    let options = SessionOptions { max_loop_iterations: 50, ..SessionOptions::default() };
    let mut s = session(&while_model(), options).unwrap();
    for (stop, go, want) in [(5, true, 6), (0, true, 1), (5, false, 0), (49, true, 50)] {
        let out = s.run(feeds(stop, go)).unwrap();
        assert_eq!(out[0].1.to_i64().unwrap(), vec![want], "stop {stop}, go {go}");
    }
    assert_eq!(s.report.control_flow.iterations, 6 + 1 + 50);
    let err = s.run(feeds(50, true)).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("node \"Loop#0\"")
            && msg.contains("needs more than 50 iterations")
            && msg.contains("--max-loop-iterations"),
        "{msg}"
    );
}

/// `depth` Ifs, each in the then-branch of the one before; the innermost returns `x`.
fn nested_ifs(depth: usize) -> onnx::ModelProto {
    let mut inner =
        graph("leaf", vec![node("Identity", &["x"], &["leaf_y"], vec![])], vec![], vec![value("leaf_y", F32, &[1])]);
    for d in (0..depth).rev() {
        let y = format!("y{d}");
        let n =
            node("If", &["c"], &[&y], vec![attr_graph("then_branch", inner.clone()), attr_graph("else_branch", inner)]);
        if d == 0 {
            return onnx::model(
                vec![n],
                vec![value("c", BOOL, &[]), value("x", F32, &[1])],
                vec![value(&y, F32, &[1])],
                vec![],
            );
        }
        inner = graph(&format!("level{d}"), vec![n], vec![], vec![value(&y, F32, &[1])]);
    }
    unreachable!("depth 0")
}

#[test]
fn nesting_past_the_limit_and_unknown_outer_names_are_load_errors() {
    let limit = kiln_host::model::MAX_SUBGRAPH_DEPTH;
    // At the limit it loads and runs.
    let outs = run(&nested_ifs(limit), vec![("c", bool_scalar(true)), ("x", f32_tensor(&[1], &[4.5]))]).unwrap();
    assert_eq!(f32_values(&outs[0]), vec![4.5]);
    let err = session(&nested_ifs(limit + 1), SessionOptions::default()).err().expect("too deep");
    assert!(matches!(err, Error::Unsupported(_)), "{err}");
    assert!(err.to_string().contains(&format!("more than {limit} deep")), "{err}");

    let mut m = nested_ifs(1);
    let ifn = &mut m.graph.as_mut().unwrap().node[0];
    ifn.attribute[0].g.as_mut().unwrap().node[0].input[0] = "nowhere".into();
    let err = session(&m, SessionOptions::default()).err().expect("unknown name");
    let msg = err.to_string();
    assert!(msg.contains("then_branch") && msg.contains("\"nowhere\""), "{msg}");
}

#[test]
fn an_op_no_package_runs_inside_a_body_fails_the_model_at_load() {
    let mut m = nested_ifs(1);
    let ifn = &mut m.graph.as_mut().unwrap().node[0];
    ifn.attribute[1].g.as_mut().unwrap().node[0].op_type = "NoSuchOp".into();
    let err = session(&m, SessionOptions::default()).err().expect("unresolved");
    let msg = err.to_string();
    assert!(err.is_unsupported() && msg.contains("NoSuchOp") && msg.contains("else_branch"), "{msg}");
}

/// A Loop of `n` iterations carrying a sequence: each appends `x · i` (SequenceInsert at the
/// end); then the sequence, its length, its element at `at`, and all of it concatenated.
fn sequence_loop_model() -> onnx::ModelProto {
    let body = graph(
        "body",
        vec![
            node("Identity", &["cond_in"], &["cond_out"], vec![]),
            node("Cast", &["i"], &["fi"], vec![attr_int("to", F32 as i64)]),
            node("Mul", &["x", "fi"], &["xi"], vec![]),
            node("SequenceInsert", &["seq_in", "xi"], &["seq_out"], vec![]),
        ],
        vec![value("i", I64, &[]), value("cond_in", BOOL, &[]), sequence_value("seq_in")],
        vec![value("cond_out", BOOL, &[]), sequence_value("seq_out")],
    );
    onnx::model(
        vec![
            node("SequenceEmpty", &[], &["empty"], vec![attr_int("dtype", F32 as i64)]),
            node("Loop", &["n", "", "empty"], &["seq"], vec![attr_graph("body", body)]),
            node("SequenceLength", &["seq"], &["len"], vec![]),
            node("SequenceAt", &["seq", "at"], &["one"], vec![]),
            node("ConcatFromSequence", &["seq"], &["all"], vec![attr_int("axis", 0)]),
        ],
        vec![value("x", F32, &[2]), value("n", I64, &[]), value("at", I64, &[])],
        vec![sequence_value("seq"), value("len", I64, &[]), value("one", F32, &[2]), value("all", F32, &[-1])],
        vec![],
    )
}

/// A graph value declared as a sequence of float32 tensors.
fn sequence_value(name: &str) -> onnx::ValueInfoProto {
    let elem = value("e", F32, &[2]).type_.unwrap();
    onnx::ValueInfoProto {
        name: name.into(),
        type_: protobuf::MessageField::some(onnx::TypeProto {
            value: Some(onnx::type_proto::Value::SequenceType(onnx::type_proto::Sequence {
                elem_type: protobuf::MessageField::some(elem),
                ..Default::default()
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[test]
fn a_loop_carries_a_sequence_and_the_sequence_ops_read_it() {
    let x = [1.5f32, -2.0];
    let mut s = session(&sequence_loop_model(), SessionOptions::default()).unwrap();
    for (n, at) in [(4i64, -1i64), (3, 0)] {
        let feeds = vec![
            ("x".to_string(), HostValue::Tensor(f32_tensor(&[2], &x))),
            ("n".to_string(), HostValue::Tensor(i64_scalar(n))),
            ("at".to_string(), HostValue::Tensor(i64_scalar(at))),
        ];
        let outs: Vec<HostValue> = s.run_values(feeds).unwrap().into_iter().map(|(_, v)| v).collect();
        let step = |i: i64| x.map(|v| v * i as f32);
        let HostValue::Sequence(seq) = &outs[0] else { panic!("{:?}", outs[0]) };
        assert_eq!(seq.len(), n as usize);
        for (i, t) in seq.iter().enumerate() {
            assert_eq!(f32_values(t), step(i as i64).to_vec(), "element {i}");
        }
        let tensor = |v: &HostValue| match v {
            HostValue::Tensor(t) => t.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(tensor(&outs[1]).to_i64().unwrap(), vec![n]);
        let at = if at < 0 { n + at } else { at };
        assert_eq!(f32_values(&tensor(&outs[2])), step(at).to_vec());
        let all: Vec<f32> = (0..n).flat_map(step).collect();
        assert_eq!(f32_values(&tensor(&outs[3])), all);
    }
    // Session::run returns tensors only: the sequence output is refused, naming run_values.
    let err =
        s.run(vec![("x".into(), f32_tensor(&[2], &x)), ("n".into(), i64_scalar(2)), ("at".into(), i64_scalar(0))]);
    let msg = err.unwrap_err().to_string();
    assert!(msg.contains("\"seq\"") && msg.contains("run_values"), "{msg}");
    // A position past the end names the node.
    let feeds = vec![
        ("x".to_string(), HostValue::Tensor(f32_tensor(&[2], &x))),
        ("n".to_string(), HostValue::Tensor(i64_scalar(2))),
        ("at".to_string(), HostValue::Tensor(i64_scalar(2))),
    ];
    let msg = s.run_values(feeds).unwrap_err().to_string();
    assert!(msg.contains("SequenceAt") && msg.contains("position 2 is out of range"), "{msg}");
}

#[test]
fn a_package_node_given_a_sequence_is_an_error_naming_it() {
    let m = onnx::model(
        vec![node("SplitToSequence", &["x"], &["seq"], vec![]), node("Relu", &["seq"], &["y"], vec![])],
        vec![value("x", F32, &[3, 2])],
        vec![value("y", F32, &[])],
        vec![],
    );
    let mut s = session(&m, SessionOptions::default()).unwrap();
    let msg = s.run(vec![("x".into(), f32_tensor(&[3, 2], &[1.0; 6]))]).unwrap_err().to_string();
    assert!(msg.contains("Relu") && msg.contains("is a sequence") && msg.contains("packages take tensors"), "{msg}");
}
