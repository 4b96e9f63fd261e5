#!/usr/bin/env python3
"""kiln's CPU path beside onnxruntime's CPU provider, in one run, at one thread count (issue 11,
item 5): MatMul 1024³ and every model folder given (ONNX backend-test layout, such as
scripts/make-big-models.py writes: resnet50 ...). Each model runs on its test_data_set_0 input
shapes with random values; latency is the median of --runs timed runs after warm-up.

    python3 scripts/bench-cpu.py --kiln target/release/kiln --threads 2 /tmp/big/resnet50

kiln's threads are KILN_CPU_THREADS; onnxruntime's intra_op_num_threads (inter-op 1).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def matmul_model(folder):
    w = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "mm1024",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1024, 1024])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1024, 1024])],
        [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    path = os.path.join(folder, "matmul1024.onnx")
    onnx.save(m, path)
    return path


def ort_ms(path, threads, warmup, runs):
    o = ort.SessionOptions()
    o.intra_op_num_threads = threads
    o.inter_op_num_threads = 1
    s = ort.InferenceSession(path, o, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {}
    for i in s.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        if "int64" in i.type:
            feeds[i.name] = rng.integers(0, 100, shape).astype(np.int64)
        else:
            feeds[i.name] = rng.uniform(-2, 2, shape).astype(np.float32)
    for _ in range(warmup):
        s.run(None, feeds)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        s.run(None, feeds)
        times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times))


def kiln_ms(kiln, path, threads, warmup, runs):
    env = dict(os.environ, KILN_CPU_THREADS=str(threads))
    out = subprocess.run([kiln, "bench", "run", path, "--device", "cpu", "--warmup", str(warmup), "--runs", str(runs),
                          "--json", "-", "-q"], env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out)["p50_ms"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kiln", default="target/release/kiln")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("models", nargs="*", help="model folders (model.onnx inside)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cases = [("MatMul 1024³", matmul_model(tmp))]
        cases += [(os.path.basename(os.path.normpath(m)), os.path.join(m, "model.onnx")) for m in a.models]
        print(f"| case | threads | kiln p50 ms | onnxruntime p50 ms | kiln / onnxruntime |")
        print(f"|---|---:|---:|---:|---:|")
        for name, path in cases:
            # The 1024³ product takes milliseconds a run: its warm-up counts in tens, so that
            # both sides start timing on warm threads and caches (three runs were about 10 ms at
            # 16 threads, and kiln's first 16-thread figure of a call read 2-3x its later ones).
            warmup = max(a.warmup, 30) if name.startswith("MatMul") else a.warmup
            k = kiln_ms(a.kiln, path, a.threads, warmup, a.runs)
            o = ort_ms(path, a.threads, warmup, a.runs)
            print(f"| {name} | {a.threads} | {k:.2f} | {o:.2f} | {k / o:.2f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
