#!/usr/bin/env python3
"""Writes docs/CONFORMANCE.md: every ONNX node test kiln does not run, grouped by its reason.

    target/release/kiln conformance .cache/onnx-node-1.20.0/node --device cpu --json /tmp/conf.json
    python3 scripts/conformance-report.py /tmp/conf.json > docs/CONFORMANCE.md

The input is `kiln conformance --json` output. The reasons come from kiln itself (the op registry,
the model loader and the packages); the notes on each op say whether it stays unsupported (and
why) or is not built yet (and where it is planned).
"""
import collections
import json
import re
import sys

# ONNX TensorProto element type codes kiln does not support.
TYPES = {
    "8": "string",
    "17": "float8e4m3fn",
    "18": "float8e4m3fnuz",
    "19": "float8e5m2",
    "20": "float8e5m2fnuz",
    "21": "uint4",
    "22": "int4",
    "23": "float4e2m1",
    "24": "float8e8m0",
    "25": "uint2",
    "26": "int2",
}

# Why an op has no package, by group: (ops, note).
NOT_BUILT = "not built yet (the general-ONNX issue)"
GROUPS = [
    (["Conv", "ConvTranspose", "ConvInteger", "DeformConv", "QLinearConv"],
     "convolutions: " + NOT_BUILT + ", through a cuDNN host import with an NVRTC fallback"),
    (["Attention", "RotaryEmbedding"], "ONNX's own Attention-23/24 and RotaryEmbedding-23 (kiln runs "
     "onnxruntime's com.microsoft GroupQueryAttention and RotaryEmbedding): " + NOT_BUILT),
    (["Resize", "Upsample", "GridSample", "AffineGrid", "RoiAlign", "Col2Im", "CenterCropPad", "DepthToSpace",
      "SpaceToDepth", "MaxUnpool"], "vision ops: " + NOT_BUILT),
    (["Tile", "ReverseSequence", "Einsum", "TensorScatter", "Det"], "tensor ops: " + NOT_BUILT),
    (["Compress", "NonZero", "Unique"], "ops whose output shape depends on the input's values: " + NOT_BUILT),
    (["LpNormalization", "GroupNormalization", "InstanceNormalization", "LRN", "MeanVarianceNormalization",
      "PRelu", "Swish"], "normalizations and activations: " + NOT_BUILT),
    (["QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearMatMul", "MatMulInteger"],
     "quantization ops: " + NOT_BUILT + " (kiln runs onnxruntime's MatMulNBits and GatherBlockQuantized)"),
    (["RNN", "GRU", "LSTM"], "recurrent ops: " + NOT_BUILT),
    (["DFT", "STFT", "BlackmanWindow", "HammingWindow", "HannWindow", "MelWeightMatrix"],
     "signal processing: " + NOT_BUILT),
    (["NonMaxSuppression"], "detection post-processing (a data-dependent output shape): " + NOT_BUILT),
    (["Bernoulli", "RandomUniformLike"], "random generators: " + NOT_BUILT),
    (["ImageDecoder"], "stays unsupported: decoding image files is a host library's job, not GPU execution"),
    (["TfIdfVectorizer", "TreeEnsemble", "ArrayFeatureExtractor", "Binarizer", "LabelEncoder"],
     "stays unsupported: classical ML (ai.onnx.ml, text vectorizing) is outside what kiln runs"),
    (["Momentum", "Adagrad", "Adam"], "stays unsupported: training optimizers; kiln runs inference"),
]


def note(op):
    for ops, why in GROUPS:
        if op in ops:
            return why
    return NOT_BUILT


def main():
    d = json.load(open(sys.argv[1]))
    tests = d["tests"]
    missing = [t for t in tests if t["status"] != "passed"]
    by_op = collections.defaultdict(list)
    by_type = collections.defaultdict(list)
    other = collections.defaultdict(list)
    for t in missing:
        r = t["reason"]
        m = re.search(r"no kernel package runs (\S+) ", r)
        if m:
            by_op[m.group(1)].append(t["name"])
            continue
        m = re.search(r"has element type (\d+)", r)
        if m:
            by_type[TYPES.get(m.group(1), "code " + m.group(1))].append(t["name"])
            continue
        if "a map type" in r or "sparse tensor type" in r:
            other["Maps and sparse tensors: stay unsupported (kiln runs tensors, sequences and optionals)"].append(
                t["name"])
        else:
            other[re.sub(r'node "[^"]+"', "the node", r.split(": unsupported: ")[-1])].append(t["name"])
    out = []
    w = out.append
    w("# ONNX conformance: what kiln does not run")
    w("")
    w(f"ONNX 1.20.0's backend node tests on the CPU: **{d['passed']} passed, {d['failed']} failed, "
      f"{d['unsupported']} unsupported**. On the H200, `tests/gpu.rs` "
      "(`onnx_node_tests_that_pass_on_the_cpu_pass_on_the_gpu`) runs every test that passes on the CPU "
      "through the packages' CUDA kernels, except the string ops (StringConcat, StringSplit, "
      "StringNormalizer, RegexFullMatch, Equal of strings), whose tensors stay on the host, where "
      "their CPU references run, as onnxruntime's CPU provider takes them beside its CUDA provider; "
      "bench/RESULTS.md records its last run and what it covered.")
    w("Every test below is reported as unsupported with its reason, never as a pass. Regenerate this list")
    w("after a change:")
    w("")
    w("```sh")
    w("target/release/kiln conformance .cache/onnx-node-1.20.0/node --device cpu --json /tmp/conf.json")
    w("python3 scripts/conformance-report.py /tmp/conf.json > docs/CONFORMANCE.md")
    w("```")
    w("")
    n_ops = sum(len(v) for v in by_op.values())
    w(f"## Ops no package provides ({len(by_op)} ops, {n_ops} tests)")
    w("")
    w("| op | tests | why |")
    w("| --- | ---: | --- |")
    for op, names in sorted(by_op.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        w(f"| `{op}` | {len(names)} | {note(op.split('::')[-1])} |")
    w("")
    n_types = sum(len(v) for v in by_type.values())
    if n_types:
        w(f"## Element types kiln does not support ({n_types} tests)")
        w("")
        w("The ABI's dtype list has no such type. The first failing value of each test is counted.")
        w("")
        w("| element type | tests |")
        w("| --- | ---: |")
        for ty, names in sorted(by_type.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            w(f"| {ty} | {len(names)} |")
        w("")
    w(f"## Other reasons ({sum(len(v) for v in other.values())} tests)")
    w("")
    for why, names in sorted(other.items(), key=lambda kv: -len(kv[1])):
        w(f"- {why}: {len(names)} tests ({', '.join(f'`{n}`' for n in sorted(names))}).")
    w("")
    print("\n".join(out))


if __name__ == "__main__":
    main()
