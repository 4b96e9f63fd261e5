#!/usr/bin/env python3
"""Small ONNX models that time the CPU path one node at a time: chains of MatMulNBits (4-bit,
block 32, accuracy_level 4, as the model builder's int4 CPU folders have them) at SmolLM2-135M's
decode shapes, one row of A.

    python3 bench/cpu_node_models.py make DIR        # writes the models and x.npy into DIR
    python3 bench/cpu_node_models.py ort MODEL N     # onnxruntime CPU p50 ms of MODEL, N threads

Models (input x [1, 576] float32, output y):
- one_576x3072.onnx, one_576x49152.onnx: one product (the MLP's gate·up and the LM head);
- chain60_576x576.onnx: 60 products 576 -> 576 in a row (12 MB of weights);
- mlp30.onnx: 30 pairs 576 -> 1536 -> 576 (33 MB);
- normlin30.onnx: 30 SkipSimplifiedLayerNormalization + MatMulNBits pairs (kiln fuses each into
  RmsNormLinear);
- swiglu30.onnx: 30 MLP blocks as the model builder writes them (SkipSimplifiedLayerNormalization,
  gate and up MatMulNBits 576 -> 1536, Sigmoid, Mul, Mul, down 1536 -> 576: kiln's RmsNormLinear
  with the SwiGLU epilogue, then Linear);
- add60.onnx: 60 Adds of 576 values (a node's fixed cost).

`kiln bench run MODEL --device cpu` times kiln on the same models (`KILN_CPU_THREADS=N`), and
`kiln run MODEL --input x=DIR/x.npy --runs R --report` splits each op's host time into its shim
calls and the host's products. Weights are random with scales that keep activations near 1.
"""
import os
import statistics
import sys
import time

import numpy as np


def make(out):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def mnb(name, x, y, k, n, inits):
        kb = k // 32
        b = rng.integers(0, 256, size=(n, kb, 16), dtype=np.uint8)
        # (q − 8) has a standard deviation near 4.6: outputs stay near the input's scale.
        s = np.full(n * kb, 1.0 / (4.6 * np.sqrt(k)), dtype=np.float32)
        inits += [numpy_helper.from_array(b, f"{name}_B"), numpy_helper.from_array(s, f"{name}_S")]
        return helper.make_node("MatMulNBits", [x, f"{name}_B", f"{name}_S"], [y], name=name,
                                domain="com.microsoft", K=k, N=n, bits=4, block_size=32, accuracy_level=4)

    def save(name, nodes, inits, k, n_out):
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n_out])], inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
        m.ir_version = 8
        onnx.save(m, os.path.join(out, name))

    def chain(prefix, shapes, layers):
        inits, nodes, cur = [], [], "x"
        for i in range(layers):
            for j, (k, n) in enumerate(shapes):
                last = i == layers - 1 and j == len(shapes) - 1
                y = "y" if last else f"{prefix}{i}_{j}"
                nodes.append(mnb(f"{prefix}{i}_{j}", cur, y, k, n, inits))
                cur = y
        return nodes, inits

    os.makedirs(out, exist_ok=True)
    for n in (3072, 49152):
        inits = []
        save(f"one_576x{n}.onnx", [mnb("m", "x", "y", 576, n, inits)], inits, 576, n)
    save("chain60_576x576.onnx", *chain("c", [(576, 576)], 60), 576, 576)
    save("mlp30.onnx", *chain("m", [(576, 1536), (1536, 576)], 30), 576, 576)
    inits = [numpy_helper.from_array(np.ones(576, dtype=np.float32), "gamma")]
    nodes, cur, skip = [], "x", "x"
    for i in range(30):
        nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [cur, skip, "gamma"],
                                      [f"n{i}", "", "", f"s{i}"], name=f"ln{i}", domain="com.microsoft", epsilon=1e-5))
        y = "y" if i == 29 else f"q{i}"
        nodes.append(mnb(f"p{i}", f"n{i}", y, 576, 576, inits))
        cur, skip = y, f"s{i}"
    save("normlin30.onnx", nodes, inits, 576, 576)
    # 30 MLP blocks as the model builder writes them (kiln fuses each into RmsNormLinear with the
    # SwiGLU epilogue, then Linear).
    inits = [numpy_helper.from_array(np.ones(576, dtype=np.float32), "gamma")]
    nodes, cur, skip = [], "x", "x"
    for i in range(30):
        nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [cur, skip, "gamma"],
                                      [f"n{i}", "", "", f"s{i}"], name=f"ln{i}", domain="com.microsoft", epsilon=1e-5))
        nodes.append(mnb(f"g{i}", f"n{i}", f"g{i}", 576, 1536, inits))
        nodes.append(mnb(f"u{i}", f"n{i}", f"u{i}", 576, 1536, inits))
        nodes.append(helper.make_node("Sigmoid", [f"g{i}"], [f"sg{i}"], name=f"sig{i}"))
        nodes.append(helper.make_node("Mul", [f"g{i}", f"sg{i}"], [f"a{i}"], name=f"mul{i}"))
        nodes.append(helper.make_node("Mul", [f"a{i}", f"u{i}"], [f"h{i}"], name=f"mulu{i}"))
        y = "y" if i == 29 else f"d{i}"
        nodes.append(mnb(f"d{i}", f"h{i}", y, 1536, 576, inits))
        cur, skip = y, f"s{i}"
    save("swiglu30.onnx", nodes, inits, 576, 576)
    nodes, cur = [], "x"
    for i in range(60):
        y = "y" if i == 59 else f"a{i}"
        nodes.append(helper.make_node("Add", [cur, cur], [y], name=f"a{i}"))
        cur = y
    save("add60.onnx", nodes, [], 576, 576)
    np.save(os.path.join(out, "x.npy"), rng.uniform(-2, 2, (1, 576)).astype(np.float32))


def ort_p50(path, threads, feeds, warmup, runs):
    """onnxruntime CPU's p50 ms over `runs` runs of the model at `path` (`threads` intra-op threads,
    after `warmup` runs), on the inputs `feeds(session)` returns (a dict by input name)."""
    import onnxruntime as rt

    o = rt.SessionOptions()
    o.intra_op_num_threads, o.inter_op_num_threads = threads, 1
    s = rt.InferenceSession(path, o, providers=["CPUExecutionProvider"])
    inputs = feeds(s)
    for _ in range(warmup):
        s.run(None, inputs)
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        s.run(None, inputs)
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def ort(path, threads, runs=200):
    x = np.random.default_rng(0).uniform(-2, 2, (1, 576)).astype(np.float32)
    ms = ort_p50(path, threads, lambda s: {"x": x}, 20, runs)
    print(f"onnxruntime p50 {ms:.3f} ms ({threads} threads)")


def cli(doc, make, ort):
    """`make DIR` and `ort MODEL N` as the module docstrings give them."""
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "ort":
        ort(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(doc)


if __name__ == "__main__":
    cli(__doc__, make, ort)
