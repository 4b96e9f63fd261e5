#!/usr/bin/env python3
"""ONNX models that time the CPU path's convolutions where torch cannot be installed: a
torchvision-shaped ResNet-50 (v1.5: the stride on each first block's 3×3; BatchNormalization
folded into the convolutions as torch.onnx's constant folding leaves it) and single convolutions
of its shapes, built with onnx.helper.

    python3 bench/cpu_conv_models.py make DIR        # writes the models and their inputs into DIR
    python3 bench/cpu_conv_models.py ort MODEL N     # onnxruntime CPU p50 ms of MODEL, N threads

Models (input x float32, output y):
- resnet50.onnx: [1, 3, 224, 224] -> [1, 1000] (Conv + bias, Relu, Add, MaxPool,
  GlobalAveragePool, Flatten, Gemm), x_resnet50.npy;
- conv_<name>.onnx: one Conv + bias + Relu of ResNet-50's shapes (the stem's 7×7 at stride 2, the
  stride-1 3×3 of each stage and layer 2's stride-2 3×3, layer 1's and layer 4's 1×1 reduce or
  expand, layer 2's strided 1×1 downsample), x_conv_<name>.npy.

`kiln bench run MODEL --device cpu` times kiln on the same files (`KILN_CPU_THREADS=N`), and
`kiln run MODEL --input x=DIR/x_NAME.npy --runs R --report` gives each op's host time. Weights are
random and seeded, He-scaled per convolution; the residual adds still grow ResNet-50's activations
(block outputs from about 1 to 2,000 in RMS, logits up to about 10⁴), which changes no timing.
"""
import os

import numpy as np

from cpu_node_models import cli, ort_p50

# (name, in channels, out channels, kernel, stride, input side): single convolutions of ResNet-50.
CONVS = [
    ("stem7x7s2", 3, 64, 7, 2, 224),
    ("l1_3x3", 64, 64, 3, 1, 56),
    ("l1_1x1_expand", 64, 256, 1, 1, 56),
    ("l1_1x1_reduce", 256, 64, 1, 1, 56),
    ("l2_3x3s2", 128, 128, 3, 2, 56),
    ("l2_3x3", 128, 128, 3, 1, 28),
    ("l2_down1x1s2", 256, 512, 1, 2, 56),
    ("l3_3x3", 256, 256, 3, 1, 14),
    ("l4_3x3", 512, 512, 3, 1, 7),
    ("l4_1x1_expand", 512, 2048, 1, 1, 7),
]


def make(out):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    os.makedirs(out, exist_ok=True)

    class G:
        def __init__(self):
            self.nodes, self.inits, self.n = [], [], 0

        def name(self, p):
            self.n += 1
            return f"{p}{self.n}"

        def conv(self, x, cin, cout, k, stride, relu=True, residual=None):
            n = self.name("conv")
            w = rng.normal(0, np.sqrt(2.0 / (cin * k * k)), (cout, cin, k, k)).astype(np.float32)
            b = rng.normal(0, 0.05, cout).astype(np.float32)
            self.inits += [numpy_helper.from_array(w, f"{n}_W"), numpy_helper.from_array(b, f"{n}_B")]
            y = f"{n}_y"
            self.nodes.append(helper.make_node("Conv", [x, f"{n}_W", f"{n}_B"], [y], name=n, kernel_shape=[k, k],
                                               strides=[stride, stride], pads=[k // 2] * 4))
            if residual is not None:
                a = self.name("add")
                self.nodes.append(helper.make_node("Add", [y, residual], [f"{a}_y"], name=a))
                y = f"{a}_y"
            if relu:
                r = self.name("relu")
                self.nodes.append(helper.make_node("Relu", [y], [f"{r}_y"], name=r))
                y = f"{r}_y"
            return y

    def save(name, g, x_shape, y_shape):
        graph = helper.make_graph(g.nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)], g.inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        onnx.save(m, os.path.join(out, f"{name}.onnx"))
        np.save(os.path.join(out, f"x_{name}.npy"), rng.standard_normal(x_shape).astype(np.float32))

    # ResNet-50: bottleneck blocks (1×1 reduce, 3×3 with the stage's stride, 1×1 expand, + skip).
    g = G()
    x = g.conv("x", 3, 64, 7, 2)
    p = g.name("pool")
    g.nodes.append(helper.make_node("MaxPool", [x], [f"{p}_y"], name=p, kernel_shape=[3, 3], strides=[2, 2],
                                    pads=[1, 1, 1, 1]))
    x, cin = f"{p}_y", 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            s = stride if i == 0 else 1
            skip = x
            if i == 0:
                skip = g.conv(x, cin, width * 4, 1, s, relu=False)
            h = g.conv(x, cin, width, 1, 1)
            h = g.conv(h, width, width, 3, s)
            x = g.conv(h, width, width * 4, 1, 1, residual=skip)
            cin = width * 4
    gap = g.name("gap")
    g.nodes.append(helper.make_node("GlobalAveragePool", [x], [f"{gap}_y"], name=gap))
    g.nodes.append(helper.make_node("Flatten", [f"{gap}_y"], ["flat"], name="flatten", axis=1))
    fc_w = rng.normal(0, np.sqrt(1.0 / 2048), (1000, 2048)).astype(np.float32)
    g.inits += [numpy_helper.from_array(fc_w, "fc_W"), numpy_helper.from_array(np.zeros(1000, np.float32), "fc_B")]
    g.nodes.append(helper.make_node("Gemm", ["flat", "fc_W", "fc_B"], ["y"], name="fc", transB=1))
    save("resnet50", g, [1, 3, 224, 224], [1, 1000])

    for name, cin, cout, k, stride, side in CONVS:
        g = G()
        y = g.conv("x", cin, cout, k, stride)
        g.nodes[-1].output[0] = "y"
        o = (side + 2 * (k // 2) - k) // stride + 1
        save(f"conv_{name}", g, [1, cin, side, side], [1, cout, o, o])


def ort(path, threads, runs=20):
    def feeds(s):
        i = s.get_inputs()[0]
        return {i.name: np.random.default_rng(0).standard_normal(i.shape).astype(np.float32)}

    print(f"onnxruntime p50 {ort_p50(path, threads, feeds, 3, runs):.3f} ms ({threads} threads)")


if __name__ == "__main__":
    cli(__doc__, make, ort)
