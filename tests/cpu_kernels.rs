//! The CPU backend's host products (issue 11, item 5): float32 and float16 MatMul, Gemm, Conv and
//! ConvTranspose go through the host's `gemm` and `conv` imports (multithreaded, f32
//! accumulation), float64 through the packages' own loops (f64). Each case runs both ways on the
//! same values and must agree to f32 (resp. f16) rounding of the sums.

use kiln_host::ep::{Session, SessionOptions};
use kiln_host::{model, Tensor};
use kiln_kernel_abi::DType;
use kiln_tests::builtin_runtime;
use kiln_tests::onnx::{self, attr_float, attr_int, attr_ints, attr_string, node, value};
use kiln_tests::Rng;

const F16: i32 = 10;
const F32: i32 = 1;
const F64: i32 = 11;

/// Values on a grid of 1/16 in [-2, 2]: exact in float16, float32 and float64.
fn values(rng: &mut Rng, n: usize) -> Vec<f64> {
    (0..n).map(|_| rng.int(-32, 32) as f64 / 16.0).collect()
}

fn tensor(dtype: i32, shape: &[usize], v: &[f64]) -> Tensor {
    let (d, bytes): (DType, Vec<u8>) = match dtype {
        F64 => (DType::F64, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        F32 => (DType::F32, v.iter().flat_map(|x| (*x as f32).to_le_bytes()).collect()),
        _ => (DType::F16, v.iter().flat_map(|x| half::f16::from_f64(*x).to_le_bytes()).collect()),
    };
    Tensor::new(d, shape.to_vec(), bytes.into()).unwrap()
}

fn to_f64(t: &Tensor) -> Vec<f64> {
    match t.dtype {
        DType::F64 => t.data.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect(),
        _ => t.to_f32().unwrap().into_iter().map(f64::from).collect(),
    }
}

/// Runs `op(inputs) -> y` with `attrs` at `dtype` on the CPU; returns y's shape and values.
fn run(op: &str, attrs: &[onnx::AttributeProto], inputs: &[(&[usize], &[f64])], dtype: i32) -> (Vec<usize>, Vec<f64>) {
    let names: Vec<String> = (0..inputs.len()).map(|i| format!("in{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let decl =
        inputs.iter().zip(&names).map(|((s, _), n)| value(n, dtype, &s.iter().map(|&d| d as i64).collect::<Vec<_>>()));
    let mut m = onnx::model(
        vec![node(op, &refs, &["y"], attrs.to_vec())],
        decl.collect(),
        vec![value("y", dtype, &[])],
        vec![],
    );
    m.graph.as_mut().unwrap().output[0].type_.as_mut().unwrap().mut_tensor_type().shape.clear();
    let m = model::load_bytes(&onnx::bytes(&m), None).unwrap();
    let mut s = Session::new(builtin_runtime(), m, SessionOptions::default()).unwrap();
    let feeds = inputs.iter().zip(&names).map(|((shape, v), n)| (n.clone(), tensor(dtype, shape, v))).collect();
    let out = s.run(feeds).unwrap_or_else(|e| panic!("{op} at dtype {dtype}: {e}"));
    (out[0].1.shape.clone(), to_f64(&out[0].1))
}

/// `op` at float32 and float16 against float64: the same shape, every element within the
/// rounding of a sum of `terms` products of magnitude up to 4 (f32), or f16 output rounding.
fn agrees(what: &str, op: &str, attrs: &[onnx::AttributeProto], inputs: &[(&[usize], &[f64])], terms: usize) {
    let (shape, want) = run(op, attrs, inputs, F64);
    for (dtype, rel) in [(F32, 2f64.powi(-22)), (F16, 2f64.powi(-10))] {
        let (s, got) = run(op, attrs, inputs, dtype);
        assert_eq!(s, shape, "{what}: shape at dtype {dtype}");
        let scale = want.iter().fold(1f64, |m, v| m.max(v.abs()));
        let tol = if dtype == F32 { rel * 4.0 * terms as f64 } else { rel * scale * 2.0 };
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= tol,
                "{what} at dtype {dtype}: element {i} is {g}, float64 gives {w} (tolerance {tol})"
            );
        }
    }
}

#[test]
fn matmul_and_gemm_through_the_host_gemm_match_float64() {
    let mut rng = Rng(11);
    let mut v = |n: usize| values(&mut rng, n);
    let cases: Vec<(&str, Vec<usize>, Vec<usize>)> = vec![
        ("batched A, shared B", vec![2, 3, 5, 7], vec![7, 4]),
        ("both batched, broadcast", vec![3, 1, 5, 7], vec![1, 4, 7, 6]),
        ("vector times matrix", vec![7], vec![7, 3]),
        ("matrix times vector", vec![4, 300], vec![300]),
        ("long K", vec![6, 1000], vec![1000, 5]),
        // Past 2²¹ multiply-adds the product is cut into tiles shared over the CPU threads.
        ("tiles of a product", vec![150, 400], vec![400, 170]),
        ("tiles of a batched product", vec![2, 70, 300], vec![300, 250]),
        ("tiles of rows", vec![300, 200], vec![200, 60]),
    ];
    for (what, a, b) in cases {
        let (x, y) = (v(a.iter().product()), v(b.iter().product()));
        let k = *a.last().unwrap();
        agrees(what, "MatMul", &[], &[(&a, &x), (&b, &y)], k);
    }
    // Gemm: transposes, alpha and beta, and every form of C.
    let (m, k, n) = (5usize, 9usize, 4usize);
    let (a, b) = (v(k * m), v(n * k));
    let trans = [attr_int("transA", 1), attr_int("transB", 1), attr_float("alpha", 0.5), attr_float("beta", -2.0)];
    for (what, c_shape) in [("scalar C", vec![1]), ("column C", vec![m, 1]), ("row C", vec![n]), ("full C", vec![m, n])]
    {
        let c = v(c_shape.iter().product());
        agrees(what, "Gemm", &trans, &[(&[k, m], &a), (&[n, k], &b), (&c_shape, &c)], k);
    }
    // Transposed operands cut into tiles (120 × 90 × 300).
    let (mt, kt, nt) = (120usize, 300usize, 90usize);
    let (at, bt, ct) = (v(kt * mt), v(nt * kt), v(mt * nt));
    agrees("tiles, transposed", "Gemm", &trans, &[(&[kt, mt], &at), (&[nt, kt], &bt), (&[mt, nt], &ct)], kt);
    let c = v(n);
    agrees(
        "bias row, beta 1",
        "Gemm",
        &[attr_int("transA", 1), attr_int("transB", 1)],
        &[(&[k, m], &a), (&[n, k], &b), (&[n], &c)],
        k,
    );
}

#[test]
fn conv_and_conv_transpose_through_the_host_conv_match_float64() {
    let mut rng = Rng(12);
    let mut v = |n: usize| values(&mut rng, n);
    struct Case {
        what: &'static str,
        op: &'static str,
        x: Vec<usize>,
        w: Vec<usize>,
        bias: bool,
        attrs: Vec<onnx::AttributeProto>,
    }
    let case =
        |what, op, x: &[usize], w: &[usize], bias, attrs| Case { what, op, x: x.into(), w: w.into(), bias, attrs };
    let cases = vec![
        case(
            "2-D, groups, strides, dilations, uneven pads",
            "Conv",
            &[2, 4, 9, 8],
            &[6, 2, 3, 2],
            true,
            vec![
                attr_int("group", 2),
                attr_ints("strides", &[2, 1]),
                attr_ints("dilations", &[1, 2]),
                attr_ints("pads", &[1, 0, 2, 1]),
            ],
        ),
        case("pointwise", "Conv", &[1, 8, 5, 5], &[3, 8, 1, 1], false, vec![]),
        case(
            "1-D, same upper",
            "Conv",
            &[2, 3, 11],
            &[4, 3, 4],
            true,
            vec![attr_string("auto_pad", "SAME_UPPER"), attr_ints("strides", &[3])],
        ),
        case("3-D", "Conv", &[1, 2, 4, 5, 3], &[2, 2, 2, 3, 2], true, vec![attr_ints("pads", &[1, 0, 1, 0, 1, 0])]),
        case(
            "depthwise, stride 2, pads",
            "Conv",
            &[1, 4, 7, 7],
            &[4, 1, 3, 3],
            true,
            vec![attr_int("group", 4), attr_ints("strides", &[2, 2]), attr_ints("pads", &[1, 1, 1, 1])],
        ),
        case(
            "transposed, groups, strides, output padding",
            "ConvTranspose",
            &[2, 4, 3, 4],
            &[4, 3, 3, 2],
            true,
            vec![
                attr_int("group", 2),
                attr_ints("strides", &[2, 3]),
                attr_ints("output_padding", &[1, 0]),
                attr_ints("pads", &[1, 0, 0, 1]),
            ],
        ),
        case(
            "transposed 1-D, dilations",
            "ConvTranspose",
            &[1, 2, 5],
            &[2, 3, 3],
            false,
            vec![attr_ints("dilations", &[2])],
        ),
    ];
    for c in cases {
        let (x, w) = (v(c.x.iter().product()), v(c.w.iter().product()));
        let out_ch = if c.op == "Conv" {
            c.w[0]
        } else {
            c.w[1] * c.attrs.iter().find(|a| a.name == "group").map_or(1, |a| a.i as usize)
        };
        let b = v(out_ch);
        let mut inputs: Vec<(&[usize], &[f64])> = vec![(&c.x, &x), (&c.w, &w)];
        let b_shape = [out_ch];
        if c.bias {
            inputs.push((&b_shape, &b));
        }
        let terms = c.w[1..].iter().product::<usize>() * if c.op == "Conv" { 1 } else { c.w[0] } + 1;
        agrees(c.what, c.op, &c.attrs, &inputs, terms);
    }
}

/// Conv → Add(·, z) → Relu and Conv → Relu at `dtype`: fused into ai.kiln::ConvAddRelu and
/// ConvRelu at float32 and float16 (the fusions take those), left as they are at float64.
/// Returns both outputs and how many fusions applied.
fn residual_block(dtype: i32, bias: bool, z_shape: &[usize], v: &[Vec<f64>]) -> (Vec<Vec<f64>>, usize) {
    let (x_shape, w_shape) = ([2usize, 3, 6, 5], [4usize, 3, 3, 3]);
    let conv_in: Vec<&str> = if bias { vec!["x", "w", "b"] } else { vec!["x", "w"] };
    let pads = attr_ints("pads", &[1, 1, 1, 1]);
    let nodes = vec![
        node("Conv", &conv_in, &["c"], vec![pads.clone()]),
        node("Add", &["z", "c"], &["s"], vec![]),
        node("Relu", &["s"], &["y"], vec![]),
        node("Conv", &conv_in, &["c2"], vec![pads, attr_ints("strides", &[2, 2])]),
        node("Relu", &["c2"], &["y2"], vec![]),
    ];
    let dims = |s: &[usize]| s.iter().map(|&d| d as i64).collect::<Vec<_>>();
    let inputs = vec![value("x", dtype, &dims(&x_shape)), value("z", dtype, &dims(z_shape))];
    let mut inits = vec![onnx::TensorProto { name: "w".into(), dims: dims(&w_shape), ..Default::default() }];
    if bias {
        inits.push(onnx::TensorProto { name: "b".into(), dims: vec![4], ..Default::default() });
    }
    // The weights as initializers (a fusion needs W's dtype at load), raw little-endian bytes.
    for (t, vals) in inits.iter_mut().zip(&v[2..]) {
        let tensor = tensor(dtype, &[vals.len()], vals);
        t.data_type = dtype;
        t.raw_data = tensor.data.to_vec();
    }
    let outputs = vec![value("y", dtype, &[]), value("y2", dtype, &[])];
    let mut m = onnx::model(nodes, inputs, outputs, inits);
    for o in m.graph.as_mut().unwrap().output.iter_mut() {
        o.type_.as_mut().unwrap().mut_tensor_type().shape.clear();
    }
    let m = model::load_bytes(&onnx::bytes(&m), None).unwrap();
    let mut s = Session::new(builtin_runtime(), m, SessionOptions::default()).unwrap();
    let fused = s.report.fusions.applied.len();
    let feeds =
        vec![("x".to_string(), tensor(dtype, &x_shape, &v[0])), ("z".to_string(), tensor(dtype, z_shape, &v[1]))];
    let out = s.run(feeds).unwrap_or_else(|e| panic!("dtype {dtype}: {e}"));
    (out.iter().map(|(_, t)| to_f64(t)).collect(), fused)
}

#[test]
fn fused_conv_add_relu_matches_the_unfused_graph_in_float64() {
    let mut rng = Rng(13);
    for (bias, z_shape) in [(true, vec![2usize, 4, 6, 5]), (false, vec![1, 4, 1, 1]), (true, vec![5])] {
        let mut v = vec![
            values(&mut rng, 2 * 3 * 6 * 5),
            values(&mut rng, z_shape.iter().product()),
            values(&mut rng, 4 * 3 * 9),
        ];
        if bias {
            v.push(values(&mut rng, 4));
        }
        let (want, unfused) = residual_block(F64, bias, &z_shape, &v);
        assert_eq!(unfused, 0, "float64 is not fused");
        for (dtype, tol) in [(F32, 1e-5), (F16, 2e-2)] {
            let (got, fused) = residual_block(dtype, bias, &z_shape, &v);
            assert_eq!(fused, 2, "dtype {dtype}, z {z_shape:?}: Conv+Add+Relu and Conv+Relu fuse");
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(g.len(), w.len());
                for (i, (a, b)) in g.iter().zip(w).enumerate() {
                    assert!(
                        (a - b).abs() <= tol * b.abs().max(1.0),
                        "dtype {dtype}, z {z_shape:?}, element {i}: {a} vs {b}"
                    );
                }
            }
        }
    }
}

#[test]
fn a_weight_larger_than_a_shims_memory_multiplies_on_the_cpu() {
    // y = x · W with W float32 [25000, 25000], 2.5 GB of external data: past the 2 GiB a shim's
    // memory may hold, so only the host's gemm can multiply by it. The file is sparse: W is 0 but
    // for W[k][j] = 1 at three places, so y[j] = x[k] there and 0 elsewhere.
    let (k, n) = (25_000usize, 25_000usize);
    let dir = tempfile::tempdir().unwrap();
    let file = std::fs::File::create(dir.path().join("w.bin")).unwrap();
    file.set_len((k * n * 4) as u64).unwrap();
    let ones = [(7usize, 3usize), (24_999, 24_999), (12_345, 0)];
    for &(r, c) in &ones {
        std::os::unix::fs::FileExt::write_all_at(&file, &1f32.to_le_bytes(), ((r * n + c) * 4) as u64).unwrap();
    }
    drop(file);
    let mut w =
        onnx::TensorProto { name: "w".into(), data_type: F32, dims: vec![k as i64, n as i64], ..Default::default() };
    w.data_location = protobuf::EnumOrUnknown::new(onnx::tensor_proto::DataLocation::EXTERNAL);
    for (key, v) in [("location", "w.bin".to_string()), ("length", (k * n * 4).to_string())] {
        w.external_data.push(onnx::StringStringEntryProto { key: key.into(), value: v, ..Default::default() });
    }
    let m = onnx::model(
        vec![node("MatMul", &["x", "w"], &["y"], vec![])],
        vec![value("x", F32, &[1, k as i64])],
        vec![value("y", F32, &[1, n as i64])],
        vec![w],
    );
    std::fs::write(dir.path().join("model.onnx"), onnx::bytes(&m)).unwrap();
    let m = model::load(&dir.path().join("model.onnx")).unwrap();
    // Unfused: the fusion that stores W transposed would copy it.
    let options = SessionOptions { fuse: false, ..SessionOptions::default() };
    let mut s = Session::new(builtin_runtime(), m, options).unwrap();
    let x: Vec<f64> = (0..k).map(|i| (i % 13) as f64 - 6.0).collect();
    let y = to_f64(&s.run(vec![("x".into(), tensor(F32, &[1, k], &x))]).unwrap()[0].1);
    let mut want = vec![0.0; n];
    for &(r, c) in &ones {
        want[c] += x[r];
    }
    assert_eq!(y, want);
}

/// A node whose package allows it (manifest `cpu_tiles`, ABI.md §6.1.2) runs as tiles on the
/// CPU pool when large enough: an elementwise op by elements, SkipSimplifiedLayerNormalization
/// and SwiGlu by rows, 37 of them over 3 tiles (uneven shares). The outputs, all four of the
/// normalization's, are bit for bit those of whole-node calls, and the report counts the tiles.
#[test]
fn tiled_cpu_calls_give_the_outputs_of_whole_ones() {
    use kiln_host::ep::CpuSplit;
    let (rows, hidden) = (37usize, 300usize);
    let mut rng = Rng(5);
    let x: Vec<f32> = values(&mut rng, rows * hidden).into_iter().map(|v| v as f32).collect();
    let skip: Vec<f32> = values(&mut rng, rows * hidden).into_iter().map(|v| v as f32 / 3.0).collect();
    let gamma: Vec<f32> = values(&mut rng, hidden).into_iter().map(|v| v as f32).collect();
    let mut m = onnx::model(
        vec![
            node("Sigmoid", &["x"], &["s"], vec![]),
            node(
                "SkipSimplifiedLayerNormalization",
                &["s", "skip", "gamma"],
                &["y", "mean", "inv_std", "sum"],
                vec![attr_float("epsilon", 1e-5)],
            ),
            node("SwiGlu", &["s", "skip"], &["w"], vec![]),
        ],
        vec![value("x", F32, &[rows as i64, hidden as i64]), value("skip", F32, &[rows as i64, hidden as i64])],
        ["y", "mean", "inv_std", "sum", "w"].iter().map(|n| value(n, F32, &[])).collect(),
        vec![onnx::init_f32("gamma", &[hidden as i64], &gamma)],
    );
    m.graph.as_mut().unwrap().node[1].domain = "com.microsoft".into();
    m.graph.as_mut().unwrap().node[2].domain = "ai.kiln".into();
    for domain in ["com.microsoft", "ai.kiln"] {
        m.opset_import.push(onnx::OperatorSetIdProto { domain: domain.into(), version: 1, ..Default::default() });
    }
    for o in &mut m.graph.as_mut().unwrap().output {
        o.type_.as_mut().unwrap().mut_tensor_type().shape.clear();
    }
    let m = model::load_bytes(&onnx::bytes(&m), None).unwrap();
    let run = |split: CpuSplit| {
        let options = SessionOptions { cpu_split: split, ..SessionOptions::default() };
        let mut s = Session::new(builtin_runtime(), m.clone(), options).unwrap();
        let feeds = vec![
            ("x".to_string(), kiln_tests::f32_tensor(&[rows, hidden], &x)),
            ("skip".to_string(), kiln_tests::f32_tensor(&[rows, hidden], &skip)),
        ];
        let out = s.run(feeds).unwrap();
        (out, s.report.wasm_calls.cpu_tiles)
    };
    let (whole, none) = run(CpuSplit { max_tiles: 1, min_tile_bytes: 1 });
    let (tiled, tiles) = run(CpuSplit { max_tiles: 3, min_tile_bytes: 1 });
    assert_eq!(none, 0);
    assert_eq!(tiles, 9, "Sigmoid, the normalization and SwiGlu, 3 tiles each");
    assert_eq!(whole.len(), 5);
    for ((name, a), (_, b)) in tiled.iter().zip(&whole) {
        assert_eq!(a, b, "output {name}");
    }
    // The normalization itself against f64 on one row: y = sum / rms(sum) · gamma.
    let r = 20;
    let sum: Vec<f64> = (0..hidden)
        .map(|c| (1.0 / (1.0 + (-(x[r * hidden + c] as f64)).exp())) + skip[r * hidden + c] as f64)
        .collect();
    let rms = (sum.iter().map(|v| v * v).sum::<f64>() / hidden as f64 + 1e-5).sqrt();
    let y = kiln_tests::f32_values(&tiled[0].1);
    for c in 0..hidden {
        let want = sum[c] / rms * gamma[c] as f64;
        assert!((y[r * hidden + c] as f64 - want).abs() <= 1e-5 * want.abs().max(1.0), "y[{r}, {c}]");
    }
}

/// kiln-pool's CPU pooling split over tiles (ABI.md §6.1.2) gives what whole calls give, bit for
/// bit, NaN included; its 2-D float32 MaxPool without indices (a row pass per stride: 2, 3 and a
/// runtime 5 here) gives bit for bit what the general path gives (the same MaxPool with its
/// Indices output): the first tap's NaN propagates, a later NaN is skipped, −∞ stays; and on the
/// NaN-free plane the max against float64.
#[test]
fn tiled_pooling_gives_the_outputs_of_whole_calls() {
    use kiln_host::ep::CpuSplit;
    let shape = [2usize, 5, 17, 19];
    let n: usize = shape.iter().product();
    let mut rng = Rng(11);
    let mut x: Vec<f32> = values(&mut rng, n).into_iter().map(|v| v as f32).collect();
    // Plane 0: NaN at a window's first tap (row 0, col 0), a negative NaN with a payload at the
    // first tap of a window of column 4 (row 0, col 7: shape a's output (0, 4)), NaN inside
    // other windows, and a −∞.
    let odd_nan = f32::from_bits(0xffc0_1234);
    let specials = [
        (0usize, f32::NAN),
        (7, odd_nan),
        (2 * 19 + 3, f32::NAN),
        (7 * 19 + 8, f32::NAN),
        (9 * 19 + 9, f32::NEG_INFINITY),
    ];
    for (i, v) in specials {
        x[i] = v;
    }
    let pads = |p: i64| attr_ints("pads", &[p, p, p, p]);
    let kernel = |k: i64| attr_ints("kernel_shape", &[k, k]);
    let strides = |s: i64| attr_ints("strides", &[s, s]);
    let shapes = [
        (vec![kernel(3), strides(2), pads(1)], "a", "x"),
        (vec![kernel(2), strides(3), attr_ints("dilations", &[2, 2]), attr_int("ceil_mode", 1)], "b", "x"),
        (vec![kernel(3), strides(5), pads(2)], "c", "x"),
        (vec![kernel(3), strides(4), pads(1)], "e", "x"),
        (vec![kernel(2), strides(1), pads(1)], "f", "x"),
        // On the 2 × 2 planes of `small`: taps at −1 and 2 of each axis, none inside.
        (vec![kernel(2), attr_ints("dilations", &[3, 3]), pads(1)], "d", "small"),
    ];
    let mut nodes = Vec::new();
    let mut outputs = Vec::new();
    for (attrs, tag, input) in &shapes {
        let fast = format!("fast_{tag}");
        let general = format!("general_{tag}");
        let indices = format!("indices_{tag}");
        nodes.push(node("MaxPool", &[input], &[fast.as_str()], attrs.clone()));
        nodes.push(node("MaxPool", &[input], &[general.as_str(), indices.as_str()], attrs.clone()));
        outputs.extend([fast, general, indices]);
    }
    nodes.push(node(
        "AveragePool",
        &["x"],
        &["avg"],
        vec![kernel(3), strides(2), pads(1), attr_int("count_include_pad", 1)],
    ));
    nodes.push(node("GlobalAveragePool", &["x"], &["gavg"], vec![]));
    nodes.push(node("GlobalMaxPool", &["x"], &["gmax"], vec![]));
    nodes.push(node("GlobalAveragePool", &["signs"], &["gavg_s"], vec![]));
    nodes.push(node("GlobalMaxPool", &["signs"], &["gmax_s"], vec![]));
    outputs.extend(["avg", "gavg", "gmax", "gavg_s", "gmax_s"].map(String::from));
    let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    let mut m = onnx::model(
        nodes,
        vec![value("x", F32, &dims), value("small", F32, &[1, 2, 2, 2]), value("signs", F32, &[1, 2, 2, 2])],
        outputs.iter().map(|n| value(n, F32, &[])).collect(),
        vec![],
    );
    for o in &mut m.graph.as_mut().unwrap().output {
        o.type_.as_mut().unwrap().mut_tensor_type().shape.clear();
        if o.name.starts_with("indices") {
            o.type_.as_mut().unwrap().mut_tensor_type().elem_type = 7;
        }
    }
    let m = model::load_bytes(&onnx::bytes(&m), None).unwrap();
    let run = |split: CpuSplit| {
        let options = SessionOptions { cpu_split: split, ..SessionOptions::default() };
        let mut s = Session::new(builtin_runtime(), m.clone(), options).unwrap();
        let small = kiln_tests::f32_tensor(&[1, 2, 2, 2], &[1.0, -2.0, 3.0, 0.5, f32::NAN, 2.0, -1.0, 4.0]);
        // Plane 0 all −0 (its mean is +0: sums start from +0), plane 1 with a NaN first tap.
        let signs = kiln_tests::f32_tensor(&[1, 2, 2, 2], &[-0.0, -0.0, -0.0, -0.0, f32::NAN, 2.0, -1.0, 4.0]);
        let out = s
            .run(vec![
                ("x".to_string(), kiln_tests::f32_tensor(&shape, &x)),
                ("small".to_string(), small),
                ("signs".to_string(), signs),
            ])
            .unwrap();
        (out, s.report.wasm_calls.cpu_tiles)
    };
    let (whole, none) = run(CpuSplit { max_tiles: 1, min_tile_bytes: 1 });
    let (tiled, tiles) = run(CpuSplit { max_tiles: 4, min_tile_bytes: 1 });
    assert_eq!(none, 0);
    assert!(tiles >= 12 * 3, "every pooling node of x in tiles: {tiles}");
    for ((name, a), (_, b)) in tiled.iter().zip(&whole) {
        assert_eq!(a, b, "output {name}: tiled against whole");
    }
    let bits = |t: &Tensor| kiln_tests::f32_values(t).into_iter().map(f32::to_bits).collect::<Vec<_>>();
    let get = |name: &str| &whole.iter().find(|(n, _)| n == name).unwrap().1;
    for (_, tag, _) in &shapes {
        assert_eq!(bits(get(&format!("fast_{tag}"))), bits(get(&format!("general_{tag}"))), "MaxPool {tag}");
    }
    // Shape a (3×3, stride 2, pads 1): plane 0's output (0, 0) starts at the NaN, output (1, 1)
    // covers the NaN at (2, 3) after other taps, and plane 1 has none: float64 max there.
    let a = kiln_tests::f32_values(get("fast_a"));
    let (oh, ow) = (9usize, 10usize);
    assert!(a[0].is_nan() && !a[ow + 1].is_nan(), "{:?}", &a[..ow + 2]);
    assert_eq!(a[4].to_bits(), 0xffc0_1234, "a NaN first tap comes out as it is");
    let d = kiln_tests::f32_values(get("fast_d"));
    assert!(d.len() == 2 && d.iter().all(|v| v.is_nan()), "windows with no tap inside are NaN: {d:?}");
    // Whole-plane windows against float64: the mean (a sum in input order) and the max.
    let (gavg, gmax) = (kiln_tests::f32_values(get("gavg")), kiln_tests::f32_values(get("gmax")));
    assert!(gavg[0].is_nan() && gmax[0].is_nan(), "plane 0 holds NaNs, its first tap one");
    for plane in 1..10 {
        let p = &x[plane * 17 * 19..][..17 * 19];
        let mean = p.iter().fold(0f64, |s, &v| s + v as f64) / p.len() as f64;
        let max = p.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
        assert_eq!((gavg[plane], gmax[plane] as f64), (mean as f32, max), "plane {plane}");
    }
    assert_eq!(bits(get("gavg_s"))[0], 0, "the mean of −0s is +0");
    assert_eq!(kiln_tests::f32_values(get("gavg_s"))[1].to_bits(), f32::NAN.to_bits());
    let gmax_s = kiln_tests::f32_values(get("gmax_s"));
    assert!(gmax_s[0] == 0.0 && gmax_s[1].is_nan(), "{gmax_s:?}");
    for plane in 1..10 {
        for (r, c) in (0..oh).flat_map(|r| (0..ow).map(move |c| (r, c))) {
            let mut want = f64::NEG_INFINITY;
            for (i, j) in (0..3).flat_map(|i| (0..3).map(move |j| (i, j))) {
                let (y, z) = ((2 * r + i) as i64 - 1, (2 * c + j) as i64 - 1);
                if (0..17).contains(&y) && (0..19).contains(&z) {
                    want = want.max(x[plane * 17 * 19 + y as usize * 19 + z as usize] as f64);
                }
            }
            assert_eq!(a[plane * oh * ow + r * ow + c] as f64, want, "plane {plane} ({r}, {c})");
        }
    }
}

/// ArgMax and ArgMin along the last axis of float32 rows (kiln-reduce's vector scan, and the
/// generic loop for rows with a NaN) against a scalar reference with numpy's rules: the first
/// extreme, or the last with `select_last_index`; a NaN wins over every number; −0 and +0 tie.
/// Rows of 1 to 50,257 values (off and on the 4- and 8-value vectors), with the extreme planted
/// twice, rows of one repeated value, of −∞ only, with NaNs, and with −0 and +0 as the extreme.
#[test]
fn arg_max_and_min_over_float32_rows_match_a_scalar_reference() {
    fn reference(row: &[f32], min: bool, last: bool) -> i64 {
        let mut best = 0usize;
        for (i, &v) in row.iter().enumerate().skip(1) {
            let b = row[best];
            let wins = match (v.is_nan(), b.is_nan()) {
                (true, false) => true,
                (false, true) => false,
                (true, true) => last,
                _ if v == b => last,
                _ => (v < b) == min,
            };
            if wins {
                best = i;
            }
        }
        best as i64
    }
    let mut rng = Rng(0xa49);
    let mut cases = 0;
    for n in [1usize, 3, 4, 7, 8, 9, 33, 1000, 49152, 50257] {
        for kind in 0..7 {
            let rows = 3;
            let mut x: Vec<f32> = (0..rows * n).map(|_| rng.int(-1000, 1000) as f32 / 7.0).collect();
            for row in x.chunks_exact_mut(n) {
                match kind {
                    // The extreme twice (first and last differ) and a −0 / +0 pair.
                    0 | 1 => {
                        let v = if kind == 0 { 1e3 } else { -1e3 };
                        row[rng.range(0, n - 1)] = v;
                        row[rng.range(0, n - 1)] = v;
                        row[rng.range(0, n - 1)] = -0.0;
                        row[rng.range(0, n - 1)] = 0.0;
                    }
                    2 => row.fill(f32::NEG_INFINITY),
                    3 => row.fill(0.0),
                    // −0 and +0 tie at the extreme: ArgMax's over negative values, ArgMin's over
                    // positive ones.
                    5 | 6 => {
                        let sign = if kind == 5 { -1.0 } else { 1.0 };
                        row.iter_mut().for_each(|v| *v = sign * (1.0 + v.abs()));
                        row[rng.range(0, n - 1)] = -0.0;
                        row[rng.range(0, n - 1)] = 0.0;
                    }
                    _ => {
                        row[rng.range(0, n - 1)] = f32::NAN;
                        row[rng.range(0, n - 1)] = f32::NAN;
                    }
                }
            }
            for op in ["ArgMax", "ArgMin"] {
                for last in [0i64, 1] {
                    let decl = vec![value("x", F32, &[rows as i64, n as i64])];
                    let attrs = vec![attr_int("axis", -1), attr_int("select_last_index", last)];
                    let m = onnx::model(vec![node(op, &["x"], &["y"], attrs)], decl, vec![value("y", 7, &[])], vec![]);
                    let m = model::load_bytes(&onnx::bytes(&m), None).unwrap();
                    let mut s = Session::new(builtin_runtime(), m, SessionOptions::default()).unwrap();
                    let xs = x.iter().map(|&v| v as f64).collect::<Vec<_>>();
                    let out = s.run(vec![("x".into(), tensor(F32, &[rows, n], &xs))]).unwrap();
                    let got = out[0].1.to_i64().unwrap();
                    let want: Vec<i64> =
                        x.chunks_exact(n).map(|row| reference(row, op == "ArgMin", last == 1)).collect();
                    assert_eq!(got, want, "{op}, select_last_index {last}, rows of {n}, case {kind}");
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 280);
}
