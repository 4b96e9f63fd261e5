//! ONNX 1.20.0's backend node tests on the CPU: every test of an op kiln supports passes, at
//! ONNX's tolerances; what is unsupported is reported as such, never as a pass.

use kiln_host::conformance::{run_test, summary, test_dirs, Outcome};
use kiln_host::ep::{Runtime, SessionOptions};
use kiln_host::packages;
use kiln_host::sandbox::SandboxConfig;

/// Node tests of each element type added with manifest schemas 11 and 12: the narrow types
/// through Cast, QuantizeLinear and DequantizeLinear, strings through kiln-string's ops.
const ELEMENT_TYPE_TESTS: &[&str] = &[
    "test_cast_FLOAT_to_FLOAT8E4M3FN",
    "test_cast_no_saturate_FLOAT16_to_FLOAT8E5M2FNUZ",
    "test_cast_FLOAT8E4M3FNUZ_to_FLOAT",
    "test_cast_no_saturate_FLOAT_to_FLOAT8E5M2",
    "test_cast_e8m0_FLOAT_to_FLOAT8E8M0",
    "test_cast_e8m0_FLOAT8E8M0_to_FLOAT16",
    "test_cast_FLOAT_to_FLOAT4E2M1",
    "test_cast_FLOAT_to_INT4",
    "test_cast_UINT4_to_UINT8",
    "test_cast_FLOAT16_to_INT2",
    "test_cast_UINT2_to_FLOAT16",
    "test_castlike_FLOAT_to_FLOAT8E4M3FN_expanded",
    "test_quantizelinear_int4",
    "test_quantizelinear_uint2",
    "test_quantizelinear_e4m3fn",
    "test_quantizelinear_float4e2m1",
    "test_dequantizelinear_e5m2",
    "test_dequantizelinear_float4e2m1",
    "test_dequantizelinear_int2",
    "test_dequantizelinear_uint4",
    "test_string_concat_utf8",
    "test_string_split_maxsplit",
    "test_string_split_empty_tensor",
    "test_strnormalizer_export_monday_insensintive_upper_twodim",
    "test_regex_full_match_email_domain",
    "test_equal_string_broadcast",
];

/// The ops of the foundation set; each must pass at least one node test.
const OPS: &[&str] = &[
    "Relu",
    "LeakyRelu",
    "Sigmoid",
    "Tanh",
    "Exp",
    "Log",
    "Sqrt",
    "Neg",
    "Abs",
    "Erf",
    "Reciprocal",
    "Cos",
    "Sin",
    "Floor",
    "Ceil",
    "Not",
    "Gelu",
    "Softplus",
    "HardSigmoid",
    "Clip",
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Mod",
    "Max",
    "Min",
    "Equal",
    "Less",
    "Greater",
    "And",
    "Or",
    "Where",
    "Cast",
    "CastLike",
    "MatMul",
    "Gemm",
    "Softmax",
    "LogSoftmax",
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ArgMax",
    "ArgMin",
    "Reshape",
    "Flatten",
    "Transpose",
    "Concat",
    "Split",
    "Slice",
    "Gather",
    "Unsqueeze",
    "Squeeze",
    "Expand",
    "Shape",
    "Size",
    "Constant",
    "ConstantOfShape",
    "Range",
    "Identity",
    "LayerNormalization",
    "Elu",
    "Selu",
    "Celu",
    "HardSwish",
    "Mish",
    "ThresholdedRelu",
    "Softsign",
    "Shrink",
    "Tan",
    "Asin",
    "Acos",
    "Atan",
    "Sinh",
    "Cosh",
    "Asinh",
    "Acosh",
    "Atanh",
    "Sign",
    "Round",
    "ReduceMin",
    "ReduceProd",
    "ReduceSumSquare",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "RMSNormalization",
    "BitwiseAnd",
    "BitwiseOr",
    "BitwiseXor",
    "BitwiseNot",
    "BitShift",
    "Trilu",
    "IsNaN",
    "IsInf",
    "CumSum",
    "Hardmax",
    "MaxPool",
    "AveragePool",
    "LpPool",
    "GlobalMaxPool",
    "GlobalAveragePool",
    "NegativeLogLikelihoodLoss",
    "SoftmaxCrossEntropyLoss",
    "Dropout",
    "BatchNormalization",
    "GatherElements",
    "ScatterElements",
    "Scatter",
    "GatherND",
    "ScatterND",
    "OneHot",
    "EyeLike",
    "Pad",
    "TopK",
    "LpNormalization",
    "RotaryEmbedding",
    "Attention",
    "Resize",
    "Upsample",
    "GridSample",
    "AffineGrid",
    "Conv",
    "ConvTranspose",
    "QuantizeLinear",
    "DequantizeLinear",
    "DynamicQuantizeLinear",
    "QLinearMatMul",
    "MatMulInteger",
    "CenterCropPad",
    "Tile",
    "DepthToSpace",
    "SpaceToDepth",
    "InstanceNormalization",
    "GroupNormalization",
    "HannWindow",
    "HammingWindow",
    "BlackmanWindow",
    "PRelu",
    "Swish",
    "LSTM",
    "GRU",
    "RNN",
    "Einsum",
    "DFT",
    "Col2Im",
    "LRN",
    "ReverseSequence",
    "If",
    "Loop",
    "Scan",
    "SequenceInsert",
    "SplitToSequence",
    "SequenceMap",
    "OptionalHasElement",
    "NonZero",
    "Compress",
    "Unique",
    "NonMaxSuppression",
    "RoiAlign",
    "MeanVarianceNormalization",
    "MaxUnpool",
    "Det",
    "TensorScatter",
    "STFT",
    "MelWeightMatrix",
    "ConvInteger",
    "QLinearConv",
    "DeformConv",
];

#[test]
fn onnx_node_tests_pass_on_the_cpu() {
    let dir = kiln_tests::onnx_node_tests();
    let (reg, errors) = packages::registry(&[], &[]);
    assert!(errors.is_empty(), "{errors:?}");
    let rt = Runtime::new(reg, SandboxConfig::default()).unwrap();
    let results: Vec<_> =
        test_dirs(&dir, None).unwrap().iter().map(|d| run_test(&rt, d, &SessionOptions::default())).collect();
    let text = summary(&results);
    println!("{text}");
    let passed = results.iter().filter(|r| r.outcome == Outcome::Passed).count();
    let failed: Vec<_> = results.iter().filter(|r| matches!(r.outcome, Outcome::Failed(_))).collect();
    assert!(failed.is_empty(), "{} node tests failed:\n{failed:#?}", failed.len());
    assert!(passed >= 1606, "only {passed} node tests passed (1606 did when this test was last raised)");
    for op in OPS {
        assert!(results.iter().any(|r| r.op == *op && r.outcome == Outcome::Passed), "no node test of {op} passed");
    }
    // The float8, float4e2m1, float8e8m0, 4-bit and 2-bit element types (manifest schema 11), and
    // strings (schema 12).
    for test in ELEMENT_TYPE_TESTS {
        let r = results.iter().find(|r| r.name == *test).unwrap_or_else(|| panic!("no node test {test}"));
        assert_eq!(r.outcome, Outcome::Passed, "{test}");
    }
    // docs/CONFORMANCE.md lists every test kiln does not run, with its reason: it must describe
    // this run.
    let doc = std::fs::read_to_string(kiln_tests::root().join("docs/CONFORMANCE.md")).expect("docs/CONFORMANCE.md");
    let line = format!("**{passed} passed, 0 failed, {} unsupported**", results.len() - passed);
    assert!(
        doc.contains(&line),
        "docs/CONFORMANCE.md does not say {line}; regenerate it as its first lines say (scripts/conformance-report.py)"
    );
}

/// Runs kiln's own node tests in tests/`folder` (expected outputs from onnxruntime's CPU
/// provider), each launch plan checked too: every one must pass, and `ops` each have one.
fn own_node_tests_pass(folder: &str, ops: &[&str]) {
    let dir = kiln_tests::root().join("tests").join(folder);
    let rt = kiln_tests::builtin_runtime();
    let options = SessionOptions { check_dispatch: true, ..SessionOptions::default() };
    let results: Vec<_> = test_dirs(&dir, None).unwrap().iter().map(|d| run_test(&rt, d, &options)).collect();
    println!("{}", summary(&results));
    let not_passed: Vec<_> = results.iter().filter(|r| r.outcome != Outcome::Passed).collect();
    assert!(not_passed.is_empty(), "{not_passed:#?}");
    for op in ops {
        assert!(results.iter().any(|r| r.op == *op), "no node test of {op} in {folder}");
    }
}

/// kiln's node tests of onnxruntime's contrib ops (tests/contrib-node-tests).
#[test]
fn contrib_op_node_tests_match_onnxruntime_on_the_cpu() {
    own_node_tests_pass(
        "contrib-node-tests",
        &[
            "GroupQueryAttention",
            "RotaryEmbedding",
            "MatMulNBits",
            "GatherBlockQuantized",
            "SimplifiedLayerNormalization",
            "SkipSimplifiedLayerNormalization",
        ],
    );
}

/// MatMulNBits at accuracy_level 4 over constant weights (tests/contrib-node-tests-int8, from
/// scripts/make-contrib-node-tests.py): the CPU quantizes each block of A to int8 as onnxruntime's
/// CPU provider does and matches its outputs within the runner's tolerance, which an f32 product
/// misses (by about 1e-2 of the largest output). Decode-size products: 1, 3 and 5 rows of A.
#[test]
fn matmul_nbits_at_accuracy_level_4_matches_onnxruntimes_int8_on_the_cpu() {
    own_node_tests_pass("contrib-node-tests-int8", &["MatMulNBits"]);
}

/// kiln's node tests of ONNX's own ops beyond what ONNX 1.20's tests cover (tests/onnx-node-tests,
/// written by scripts/make-onnx-node-tests.py): bidirectional recurrent ops with sequence
/// lengths, grouped and dilated convolutions with bias, grouped-query Attention with a past and
/// masks, antialiased and 3-D Resize, GridSample, per-column integer matrix products.
#[test]
fn onnx_op_node_tests_match_onnxruntime_on_the_cpu() {
    own_node_tests_pass(
        "onnx-node-tests",
        &[
            "LSTM",
            "GRU",
            "RNN",
            "Conv",
            "ConvTranspose",
            "Attention",
            "Resize",
            "GridSample",
            "QLinearMatMul",
            "Einsum",
        ],
    );
}
