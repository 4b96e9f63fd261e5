#!/usr/bin/env python3
"""Node tests of ONNX's own ops beyond what ONNX 1.20's node tests cover, in ONNX's backend test
layout (test_<name>/model.onnx, test_data_set_0/input_<i>.pb, output_<i>.pb), with onnxruntime's
CPU outputs as the expected values: bidirectional recurrent ops with sequence lengths, grouped
and dilated convolutions with bias, grouped-query Attention with a past and a causal mask,
antialiased and 3-D Resize, cubic GridSample, per-column QLinearMatMul and MatMulInteger, float16 cases. ONNX's
tests exercise these ops' defaults; these exercise the rest the way a model does.

    python3 scripts/make-onnx-node-tests.py [OUT_DIR=tests/onnx-node-tests]

Needs numpy, onnx and onnxruntime (CPU). Inputs are seeded; re-running gives the same files for
the same onnxruntime version.
"""
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper
from onnx_test_folder import write_test_folder

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "onnx-node-tests")
rng = np.random.default_rng(20261204)
ONNX_TYPE = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16, np.int32: TensorProto.INT32,
             np.int64: TensorProto.INT64, np.uint8: TensorProto.UINT8, np.int8: TensorProto.INT8,
             np.int16: TensorProto.INT16, np.bool_: TensorProto.BOOL, np.longlong: TensorProto.INT64}


def vinfo(name, arr):
    return helper.make_tensor_value_info(name, ONNX_TYPE[arr.dtype.type], list(arr.shape))


def write(name, node, inputs, outs, opset):
    """A one-node model over `inputs` (name → array; None leaves an optional input out), run in
    onnxruntime; writes the test folder with its outputs `outs` ("" leaves one out)."""
    node.input[:] = [k if v is not None else "" for k, v in inputs.items()]
    node.output[:] = outs
    wanted = [o for o in outs if o]
    graph_inputs = [vinfo(k, v) for k, v in inputs.items() if v is not None]
    graph = helper.make_graph([node], name, graph_inputs, [helper.make_empty_tensor_value_info(o) for o in wanted])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    feeds = {k: v for k, v in inputs.items() if v is not None}
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    results = sess.run(wanted, feeds)
    del model.graph.output[:]
    model.graph.output.extend([vinfo(o, r) for o, r in zip(wanted, results)])
    onnx.checker.check_model(model)
    write_test_folder(os.path.join(OUT, f"test_{name}"), model, feeds, list(zip(wanted, results)))
    print(f"test_{name}: " + ", ".join(f"{o} {r.dtype}{list(r.shape)}" for o, r in zip(wanted, results)))


def rand(shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def recurrent(name, op, gates, seq, batch, inp, hidden, direction, lens, **attrs):
    dirs = 2 if direction == "bidirectional" else 1
    inputs = {"X": rand((seq, batch, inp)), "W": rand((dirs, gates * hidden, inp), scale=0.5),
              "R": rand((dirs, gates * hidden, hidden), scale=0.5), "B": rand((dirs, 2 * gates * hidden), scale=0.3),
              "sequence_lens": None if lens is None else np.array(lens, dtype=np.int32),
              "initial_h": rand((dirs, batch, hidden))}
    outs = ["Y", "Y_h"]
    if op == "LSTM":
        inputs["initial_c"] = rand((dirs, batch, hidden))
        inputs["P"] = rand((dirs, 3 * hidden), scale=0.5)
        outs.append("Y_c")
    write(name, helper.make_node(op, [], [], hidden_size=hidden, direction=direction, **attrs), inputs, outs, 22)


def main():
    # Recurrent ops: both directions, uneven sequence lengths, every optional input.
    recurrent("lstm_bidirectional_seq_lens", "LSTM", 4, 5, 3, 4, 6, "bidirectional", [5, 2, 4])
    recurrent("lstm_reverse_clip", "LSTM", 4, 4, 2, 3, 5, "reverse", None, clip=1.5)
    recurrent("gru_bidirectional_linear_before_reset", "GRU", 3, 5, 3, 4, 6, "bidirectional", [3, 5, 1],
              linear_before_reset=1)
    recurrent("gru_reverse_seq_lens", "GRU", 3, 4, 2, 3, 5, "reverse", [2, 4])
    recurrent("rnn_bidirectional_relu", "RNN", 1, 4, 2, 3, 5, "bidirectional", [4, 3],
              activations=["Relu", "Tanh"])
    recurrent("lstm_zero_length_row", "LSTM", 4, 3, 2, 3, 4, "forward", [0, 3])

    # Convolutions: groups, dilations, strides, SAME padding, bias; 1-D and 3-D.
    write("conv_groups_dilations_bias", helper.make_node("Conv", [], [], group=2, dilations=[2, 1], strides=[2, 2],
                                                         pads=[2, 1, 1, 0]),
          {"x": rand((2, 4, 9, 8)), "w": rand((6, 2, 3, 3)), "b": rand((6,))}, ["y"], 22)
    write("conv_same_lower_strides", helper.make_node("Conv", [], [], strides=[2, 3], auto_pad="SAME_LOWER"),
          {"x": rand((1, 2, 7, 8)), "w": rand((3, 2, 4, 3)), "b": None}, ["y"], 22)
    write("conv_1d_pads", helper.make_node("Conv", [], [], pads=[2, 1], strides=[3]),
          {"x": rand((1, 3, 11)), "w": rand((2, 3, 4)), "b": None}, ["y"], 22)
    write("conv_3d_groups", helper.make_node("Conv", [], [], group=3, pads=[1, 0, 1, 1, 0, 1]),
          {"x": rand((1, 3, 4, 5, 4)), "w": rand((3, 1, 3, 2, 3)), "b": rand((3,))}, ["y"], 22)
    write("conv_transpose_groups_bias_output_padding",
          helper.make_node("ConvTranspose", [], [], group=2, strides=[2, 3], output_padding=[1, 2], dilations=[1, 2],
                           pads=[1, 0, 0, 1]),
          {"x": rand((2, 4, 3, 4)), "w": rand((4, 3, 3, 2)), "b": rand((6,))}, ["y"], 22)
    write("conv_f16", helper.make_node("Conv", [], [], pads=[1, 1, 1, 1]),
          {"x": rand((1, 3, 6, 6), np.float16), "w": rand((4, 3, 3, 3), np.float16, 0.3), "b": None}, ["y"], 22)

    # Attention-23: grouped query heads, a past, a causal mask and a bool mask; 3-D inputs.
    b, nq, nkv, s, p, h = 2, 6, 2, 3, 4, 8
    write("attention_gqa_past_causal_bool_mask", helper.make_node("Attention", [], [], is_causal=1),
          {"Q": rand((b, nq, s, h)), "K": rand((b, nkv, s, h)), "V": rand((b, nkv, s, h)),
           "attn_mask": rng.random((b, 1, s, p + s)) > 0.2, "past_key": rand((b, nkv, p, h)),
           "past_value": rand((b, nkv, p, h))}, ["Y", "present_key", "present_value"], 23)
    write("attention_3d_float_mask_scale", helper.make_node("Attention", [], [], q_num_heads=4, kv_num_heads=2,
                                                           scale=0.2),
          {"Q": rand((2, 5, 4 * 6)), "K": rand((2, 7, 2 * 6)), "V": rand((2, 7, 2 * 10)),
           "attn_mask": rand((5, 7))}, ["Y"], 23)

    # Resize: cubic antialias with axes in reverse, 3-D trilinear align_corners, nearest ceil.
    write("resize_cubic_antialias_axes_3_2",
          helper.make_node("Resize", [], [], mode="cubic", antialias=1, axes=[3, 2], exclude_outside=1),
          {"X": rand((1, 2, 9, 7)), "roi": None, "scales": np.array([0.45, 0.6], dtype=np.float32)}, ["Y"], 19)
    write("resize_trilinear_align_corners",
          helper.make_node("Resize", [], [], mode="linear", coordinate_transformation_mode="align_corners"),
          {"X": rand((1, 2, 3, 4, 5)), "roi": None, "scales": None,
           "sizes": np.array([1, 2, 5, 7, 4], dtype=np.int64)}, ["Y"], 19)
    write("resize_nearest_ceil_asymmetric_f16",
          helper.make_node("Resize", [], [], mode="nearest", coordinate_transformation_mode="asymmetric",
                           nearest_mode="ceil"),
          {"X": rand((1, 1, 4, 5), np.float16), "roi": None,
           "scales": np.array([1, 1, 1.7, 0.6], dtype=np.float32)}, ["Y"], 19)

    # GridSample: cubic with border padding, linear with reflection and align_corners.
    write("gridsample_cubic_border", helper.make_node("GridSample", [], [], mode="cubic", padding_mode="border"),
          {"X": rand((2, 3, 5, 6)), "grid": rand((2, 4, 7, 2), scale=0.8)}, ["Y"], 22)
    write("gridsample_linear_reflection_align",
          helper.make_node("GridSample", [], [], mode="linear", padding_mode="reflection", align_corners=1),
          {"X": rand((1, 2, 4, 5)), "grid": rand((1, 3, 6, 2), scale=1.5)}, ["Y"], 22)

    # Quantization: per-column QLinearMatMul and MatMulInteger, blocked int16, axis int8.
    write("qlinearmatmul_per_column_uint8", helper.make_node("QLinearMatMul", [], []),
          {"a": rng.integers(0, 256, (3, 5)).astype(np.uint8), "a_scale": np.array(0.02, np.float32),
           "a_zero_point": np.array(120, np.uint8), "b": rng.integers(0, 256, (5, 4)).astype(np.uint8),
           "b_scale": (rng.random(4) * 0.02 + 0.01).astype(np.float32),
           "b_zero_point": rng.integers(100, 150, 4).astype(np.uint8), "y_scale": np.array(0.05, np.float32),
           "y_zero_point": np.array(128, np.uint8)}, ["y"], 21)
    write("matmulinteger_per_column_uint8", helper.make_node("MatMulInteger", [], []),
          {"A": rng.integers(0, 256, (2, 3, 6)).astype(np.uint8), "B": rng.integers(0, 256, (6, 5)).astype(np.uint8),
           "a_zero_point": np.array(7, np.uint8), "b_zero_point": rng.integers(100, 150, 5).astype(np.uint8)}, ["Y"], 21)
    write("dequantizelinear_blocked_int16", helper.make_node("DequantizeLinear", [], [], axis=1, block_size=3),
          {"x": rng.integers(-30000, 30000, (2, 7, 3)).astype(np.int16), "x_scale": rand((2, 3, 3), scale=0.01),
           "x_zero_point": rng.integers(-100, 100, (2, 3, 3)).astype(np.int16)}, ["y"], 21)
    write("quantizelinear_axis_int8", helper.make_node("QuantizeLinear", [], [], axis=0),
          {"x": rand((3, 8), scale=4.0), "y_scale": np.array([0.05, 0.02, 0.1], np.float32),
           "y_zero_point": np.array([-3, 0, 7], np.int8)}, ["y"], 21)
    write("dynamicquantizelinear_random", helper.make_node("DynamicQuantizeLinear", [], []),
          {"x": rand((4, 9), scale=3.0)}, ["y", "y_scale", "y_zero_point"], 21)

    # Normalizations and rearrangements.
    write("instance_normalization_f16", helper.make_node("InstanceNormalization", [], [], epsilon=1e-3),
          {"x": rand((2, 3, 5, 4), np.float16), "scale": rand((3,), np.float16), "B": rand((3,), np.float16)},
          ["y"], 22)
    write("group_normalization_4_groups", helper.make_node("GroupNormalization", [], [], num_groups=4),
          {"x": rand((2, 8, 3, 3)), "scale": rand((8,)), "bias": rand((8,))}, ["y"], 21)
    write("depth_to_space_crd_f16", helper.make_node("DepthToSpace", [], [], blocksize=2, mode="CRD"),
          {"x": rand((2, 8, 3, 2), np.float16)}, ["y"], 13)
    # Einsum: attention-style contraction, broadcast ... axes, a trace, an implicit output, float16.
    write("einsum_attention_scores", helper.make_node("Einsum", [], [], equation="bhqd,bhkd->bhqk"),
          {"q": rand((2, 3, 4, 5)), "k": rand((2, 3, 6, 5))}, ["y"], 13)
    write("einsum_broadcast_ellipsis", helper.make_node("Einsum", [], [], equation="...ij,...jk->...ik"),
          {"a": rand((2, 1, 3, 4)), "b": rand((2, 5, 4, 2))}, ["y"], 13)
    write("einsum_trace", helper.make_node("Einsum", [], [], equation="ii->"), {"x": rand((4, 4))}, ["y"], 13)
    write("einsum_broadcast_letter", helper.make_node("Einsum", [], [], equation="bij,bjk->bik"),
          {"a": rand((1, 2, 3)), "b": rand((4, 3, 5))}, ["y"], 13)
    write("einsum_implicit_f16", helper.make_node("Einsum", [], [], equation="kj,ji"),
          {"a": rand((3, 4), np.float16), "b": rand((4, 2), np.float16)}, ["y"], 13)
    write("tile_int64", helper.make_node("Tile", [], []),
          {"x": rng.integers(-9, 9, (2, 3, 1)).astype(np.int64), "repeats": np.array([2, 1, 3], np.int64)}, ["y"], 13)


if __name__ == "__main__":
    main()
