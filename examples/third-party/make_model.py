"""Builds examples/third-party: model.onnx, a small block that uses the third-party op
com.example::BiasGelu of the package in bias-gelu/ (MatMul, BiasGelu, MatMul), with seeded
weights, its input x.npy, and the reference output expected.npy computed with numpy in float64
(GELU's erf form through math.erf).

    python3 examples/third-party/make_model.py   # needs onnx, numpy
"""
import math
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

here = os.path.dirname(os.path.abspath(__file__))
rng = np.random.default_rng(2027)
d_in, d_hidden, d_out, rows = 8, 16, 4, 3
w1 = rng.normal(0, 0.5, (d_in, d_hidden)).astype(np.float32)
bias = rng.normal(0, 0.5, (d_hidden,)).astype(np.float32)
w2 = rng.normal(0, 0.5, (d_hidden, d_out)).astype(np.float32)
x = rng.normal(0, 1, (rows, d_in)).astype(np.float32)

nodes = [
    helper.make_node("MatMul", ["x", "w1"], ["h"]),
    helper.make_node("BiasGelu", ["h", "bias"], ["g"], domain="com.example"),
    helper.make_node("MatMul", ["g", "w2"], ["y"]),
]
graph = helper.make_graph(
    nodes,
    "third_party_block",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", d_in])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", d_out])],
    [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(bias, "bias"), numpy_helper.from_array(w2, "w2")],
)
model = helper.make_model(
    graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.example", 1)], ir_version=10
)
onnx.save(model, os.path.join(here, "model.onnx"))
np.save(os.path.join(here, "x.npy"), x)

# The reference, in float64 from the float32 weights.
h = x.astype(np.float64) @ w1.astype(np.float64)
s = h + bias.astype(np.float64)
g = 0.5 * s * (1.0 + np.vectorize(math.erf)(s / math.sqrt(2.0)))
y = g @ w2.astype(np.float64)
np.save(os.path.join(here, "expected.npy"), y.astype(np.float32))
print("wrote model.onnx, x.npy, expected.npy; y =", y.astype(np.float32).tolist())
