"""Builds examples/mlp: a small classifier (MatMul, Add, LayerNormalization, Gelu, MatMul,
Add, Softmax) with seeded weights, its input x.npy, and the reference output computed by
onnxruntime (CPU) as expected.npy.

    python3 examples/mlp/make_mlp.py   # needs onnx, numpy, onnxruntime
"""
import os

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

here = os.path.dirname(os.path.abspath(__file__))
rng = np.random.default_rng(2026)
d_in, d_hidden, d_out = 8, 16, 4
w1 = rng.normal(0, 0.5, (d_in, d_hidden)).astype(np.float32)
b1 = rng.normal(0, 0.1, (d_hidden,)).astype(np.float32)
gamma = (1 + rng.normal(0, 0.1, (d_hidden,))).astype(np.float32)
beta = rng.normal(0, 0.1, (d_hidden,)).astype(np.float32)
w2 = rng.normal(0, 0.5, (d_hidden, d_out)).astype(np.float32)
b2 = rng.normal(0, 0.1, (d_out,)).astype(np.float32)

nodes = [
    helper.make_node("MatMul", ["x", "w1"], ["h"]),
    helper.make_node("Add", ["h", "b1"], ["hb"]),
    helper.make_node("LayerNormalization", ["hb", "gamma", "beta"], ["n"], axis=-1, epsilon=1e-5),
    helper.make_node("Gelu", ["n"], ["g"]),
    helper.make_node("MatMul", ["g", "w2"], ["o"]),
    helper.make_node("Add", ["o", "b2"], ["logits"]),
    helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
]
graph = helper.make_graph(
    nodes,
    "mlp",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", d_in])],
    [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", d_out])],
    [numpy_helper.from_array(a, n) for a, n in [(w1, "w1"), (b1, "b1"), (gamma, "gamma"), (beta, "beta"), (w2, "w2"), (b2, "b2")]],
)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10, producer_name="kiln examples")
onnx.checker.check_model(model)
onnx.save(model, os.path.join(here, "model.onnx"))

x = rng.normal(0, 1, (3, d_in)).astype(np.float32)
np.save(os.path.join(here, "x.npy"), x)
expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
np.save(os.path.join(here, "expected.npy"), expected)
print("probs =", expected)
