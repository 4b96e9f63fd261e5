#!/usr/bin/env python3
"""Node tests for the onnxruntime contrib ops kiln's packages run, in ONNX's backend test layout
(test_<name>/model.onnx, test_data_set_0/input_<i>.pb, output_<i>.pb), with onnxruntime's CPU
outputs as the expected values. ONNX ships no node tests for com.microsoft ops; these let
`kiln conformance` and `kiln verify` check them the same way.

    python3 scripts/make-contrib-node-tests.py [OUT_DIR=tests/contrib-node-tests]

Needs numpy, onnx and onnxruntime (CPU). Inputs are seeded; re-running gives the same files
for the same onnxruntime version. Shapes are small and deliberately uneven: right-padded batch
rows, K not a multiple of the block size, head ratios above 1, a local window, softcap.
"""
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper
from onnx_test_folder import write_test_folder

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "contrib-node-tests")
rng = np.random.default_rng(20261130)
ONNX_TYPE = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16, np.int32: TensorProto.INT32,
             np.int64: TensorProto.INT64, np.uint8: TensorProto.UINT8}


def vinfo(name, arr):
    return helper.make_tensor_value_info(name, ONNX_TYPE[arr.dtype.type], list(arr.shape))


def write(name, node, inputs, n_outputs, output_names=None, out=None, constants=()):
    """Builds a one-node model over `inputs` (name → array; None leaves an optional input out),
    runs it in onnxruntime and writes the test folder (under `out`, default OUT). Inputs named in
    `constants` are initializers of the model instead of graph inputs."""
    graph_inputs = [vinfo(k, v) for k, v in inputs.items() if v is not None and k not in constants]
    outs = output_names or [f"y{i}" for i in range(n_outputs)]
    node.output[:] = outs
    inits = [onnx.numpy_helper.from_array(v, k) for k, v in inputs.items() if v is not None and k in constants]
    graph = helper.make_graph([node], name, graph_inputs, [helper.make_empty_tensor_value_info(o) for o in outs],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    feeds = {k: v for k, v in inputs.items() if v is not None and k not in constants}
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    results = sess.run(outs, feeds)
    # Declare the outputs' real types in the stored model.
    del model.graph.output[:]
    model.graph.output.extend([vinfo(o, r) for o, r in zip(outs, results)])
    if node.domain == "com.microsoft":  # SimplifiedLayerNormalization is onnxruntime's, in ai.onnx
        onnx.checker.check_model(model)
    write_test_folder(os.path.join(out or OUT, f"test_{name}"), model, feeds, list(zip(outs, results)))
    print(f"test_{name}: " + ", ".join(f"{o} {r.dtype}{list(r.shape)}" for o, r in zip(outs, results)))


def rand(shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def rope_caches(rows, half, dtype):
    inv = 1.0 / (10000 ** (np.arange(half) / half))
    ang = np.arange(rows)[:, None] * inv[None, :]
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


def gqa(name, dtype, b, s, n, nk, h, past_len, seqlens, total, packed, rotary, interleaved=0, window=-1, softcap=0.0):
    q_w = (n + 2 * nk) * h if packed else n * h
    inputs = {"query": rand((b, s, q_w), dtype)}
    inputs["key"] = None if packed else rand((b, s, nk * h), dtype)
    inputs["value"] = None if packed else rand((b, s, nk * h), dtype)
    # The shared buffer as a generation leaves it: each row's past positions filled, the rest
    # zero (onnxruntime leaves present rows past a row's length unwritten; kiln keeps the
    # buffer's), and nothing for a first prompt.
    pk, pv = rand((b, nk, past_len, h), dtype), rand((b, nk, past_len, h), dtype)
    for r in range(b):
        valid = 0 if s == total else seqlens[r] + 1 - s
        pk[r, :, valid:] = 0
        pv[r, :, valid:] = 0
    inputs["past_key"], inputs["past_value"] = pk, pv
    inputs["seqlens_k"] = np.array(seqlens, dtype=np.int32)
    inputs["total_sequence_length"] = np.array(total, dtype=np.int32)
    if rotary:
        cos, sin = rope_caches(max(past_len, total) + 4, h // 2, dtype)
        inputs["cos_cache"], inputs["sin_cache"] = cos, sin
    names = [k if v is not None else "" for k, v in inputs.items()]
    node = helper.make_node("GroupQueryAttention", names, [], domain="com.microsoft", num_heads=n, kv_num_heads=nk,
                            do_rotary=int(rotary), rotary_interleaved=interleaved, local_window_size=window,
                            softcap=softcap, scale=float(1.0 / np.sqrt(h)))
    write(name, node, inputs, 3, ["output", "present_key", "present_value"])


def rotary(name, dtype, b, s, n, h, interleaved):
    cos, sin = rope_caches(32, h // 2, dtype)
    inputs = {"input": rand((b, s, n * h), dtype), "position_ids": rng.integers(0, 28, (b, s)).astype(np.int64),
              "cos_cache": cos, "sin_cache": sin}
    node = helper.make_node("RotaryEmbedding", list(inputs), [], domain="com.microsoft", interleaved=interleaved,
                            num_heads=n)
    write(name, node, inputs, 1)


def matmul_nbits(name, dtype, m, k, n, bits, block, zero_points, bias, accuracy_level=None, out=None):
    blocks = -(-k // block)
    q = rng.integers(0, 1 << bits, (n, blocks * block)).astype(np.uint8)
    per = 8 // bits
    packed = np.zeros((n, blocks, block * bits // 8), np.uint8)
    qb = q.reshape(n, blocks, block)
    for j in range(block):
        packed[:, :, j // per] |= (qb[:, :, j] << ((j % per) * bits)).astype(np.uint8)
    inputs = {"A": rand((m, k), dtype), "B": packed, "scales": (rng.random(n * blocks) * 0.1 + 0.01).astype(dtype)}
    if zero_points:
        zq = rng.integers(0, 1 << bits, (n, blocks)).astype(np.uint8)
        zrow = -(-blocks * bits // 8)
        zp = np.zeros((n, zrow), np.uint8)
        for j in range(blocks):
            zp[:, j // per] |= (zq[:, j] << ((j % per) * bits)).astype(np.uint8)
        inputs["zero_points"] = zp.reshape(-1)
    else:
        inputs["zero_points"] = None
    inputs["g_idx"] = None
    inputs["bias"] = rand((n,), dtype) if bias else None
    names = [k_ if v is not None else "" for k_, v in inputs.items()]
    while names and names[-1] == "":
        names.pop()
    attrs = {} if accuracy_level is None else {"accuracy_level": accuracy_level}
    node = helper.make_node("MatMulNBits", names, [], domain="com.microsoft", K=k, N=n, bits=bits, block_size=block,
                            **attrs)
    # At accuracy_level 4 onnxruntime quantizes A only where B is an initializer (it prepacks B
    # at load); with B a graph input it computes in f32.
    constants = ("B", "scales", "zero_points", "bias") if accuracy_level == 4 else ()
    write(name, node, inputs, 1, out=out, constants=constants)


def gather_block_quantized(name, dtype, vocab, dim, block, ids_shape):
    blocks = dim // block
    q = rng.integers(0, 16, (vocab, dim)).astype(np.uint8)
    data = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    inputs = {"data": data, "indices": rng.integers(0, vocab, ids_shape).astype(np.int64),
              "scales": (rng.random((vocab, blocks)) * 0.1 + 0.01).astype(dtype)}
    node = helper.make_node("GatherBlockQuantized", list(inputs), [], domain="com.microsoft", bits=4,
                            block_size=block, gather_axis=0, quantize_axis=1)
    write(name, node, inputs, 1)


def simplified_layer_norm(name, dtype, shape):
    inputs = {"X": rand(shape, dtype, 3.0), "scale": rand(shape[-1:], dtype)}
    node = helper.make_node("SimplifiedLayerNormalization", list(inputs), [], axis=-1, epsilon=1e-5, stash_type=1)
    write(name, node, inputs, 1)


def skip_simplified_layer_norm(name, dtype, shape, bias):
    inputs = {"input": rand(shape, dtype, 3.0), "skip": rand(shape, dtype), "gamma": rand(shape[-1:], dtype)}
    if bias:
        inputs["bias"] = rand(shape[-1:], dtype)
    names = [k if v is not None else "" for k, v in inputs.items()]
    node = helper.make_node("SkipSimplifiedLayerNormalization", names, [], domain="com.microsoft", epsilon=1e-5)
    write(name, node, inputs, 4, ["output", "mean", "inv_std_var", "input_skip_bias_sum"])


os.makedirs(OUT, exist_ok=True)
# GroupQueryAttention: a right-padded prompt into a shared buffer, a decode step, separate
# Q/K/V with a local window and softcap, f16 and f32, head ratios 2 and 3.
gqa("gqa_prompt_packed_rotary_shared_buffer", np.float32, b=2, s=5, n=4, nk=2, h=16, past_len=8, seqlens=[4, 2],
    total=5, packed=True, rotary=True)
gqa("gqa_decode_packed_rotary_shared_buffer_f16", np.float16, b=2, s=1, n=6, nk=2, h=32, past_len=12, seqlens=[7, 4],
    total=8, packed=True, rotary=True)
gqa("gqa_prompt_separate_window_softcap", np.float32, b=1, s=6, n=3, nk=1, h=8, past_len=6, seqlens=[5], total=6,
    packed=False, rotary=False, window=3, softcap=4.0)
gqa("gqa_decode_interleaved_rotary", np.float32, b=1, s=1, n=2, nk=2, h=16, past_len=9, seqlens=[6], total=7,
    packed=True, rotary=True, interleaved=1)
rotary("rotary_embedding", np.float32, b=2, s=3, n=2, h=16, interleaved=0)
rotary("rotary_embedding_interleaved_f16", np.float16, b=1, s=4, n=3, h=8, interleaved=1)
# MatMulNBits: 4 bits with zero points and K not a multiple of the block; 8 bits with a bias.
matmul_nbits("matmul_nbits_4bit_block32_zero_points", np.float32, m=3, k=80, n=24, bits=4, block=32, zero_points=True,
             bias=False)
matmul_nbits("matmul_nbits_4bit_block16_f16", np.float16, m=1, k=64, n=40, bits=4, block=16, zero_points=False,
             bias=False)
matmul_nbits("matmul_nbits_8bit_block64_bias", np.float32, m=5, k=128, n=16, bits=8, block=64, zero_points=True,
             bias=True)
gather_block_quantized("gather_block_quantized_4bit", np.float32, vocab=20, dim=64, block=32, ids_shape=(2, 3))
gather_block_quantized("gather_block_quantized_4bit_f16", np.float16, vocab=11, dim=32, block=16, ids_shape=(5,))
simplified_layer_norm("simplified_layer_normalization", np.float32, (2, 3, 40))
simplified_layer_norm("simplified_layer_normalization_f16", np.float16, (4, 600))
skip_simplified_layer_norm("skip_simplified_layer_normalization_sum", np.float32, (2, 3, 48), bias=False)
skip_simplified_layer_norm("skip_simplified_layer_normalization_bias_f16", np.float16, (1, 2, 576), bias=True)

# MatMulNBits at accuracy_level 4 over constant weights, where onnxruntime's CPU provider quantizes
# each block of A to int8 (on CPUs with its int8 kernels: AVX2, AVX-512 VNNI): a folder of its own, as kiln's GPU
# computes in f32 at every level (which the level allows) and so matches these only within f32's
# distance from int8 (about 5e-3 of the largest output). Decode-size products, fewer than 64 rows.
INT8_OUT = OUT.rstrip("/") + "-int8"
matmul_nbits("matmul_nbits_4bit_block32_accuracy4", np.float32, m=1, k=80, n=24, bits=4, block=32, zero_points=False,
             bias=False, accuracy_level=4, out=INT8_OUT)
matmul_nbits("matmul_nbits_4bit_block64_zero_points_bias_accuracy4", np.float32, m=3, k=128, n=20, bits=4, block=64,
             zero_points=True, bias=True, accuracy_level=4, out=INT8_OUT)
matmul_nbits("matmul_nbits_4bit_block32_rows5_accuracy4", np.float32, m=5, k=576, n=36, bits=4, block=32,
             zero_points=False, bias=False, accuracy_level=4, out=INT8_OUT)
