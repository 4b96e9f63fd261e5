"""Start-up time of `kiln run` on the CPU with a cold and a warm shim cache.

Runs the README's example (`kiln run examples/mlp/model.onnx … --device cpu -q`) as a whole
process, timed from here with subprocess: each round makes an empty KILN_CACHE_DIR (mode 0700),
runs once cold (every shim compiled by Cranelift) and then WARM times warm (the sealed cache
entries deserialized). Prints the medians and their ratio, which the package-format issue bounds
(warm ≤ 60 ms, warm / cold ≤ 0.25). Wall times on a shared machine are only comparable within
one run.

    python3 bench/start_time.py [--kiln target/release/kiln] [--rounds 5] [--warm 3]
"""

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kiln", default="target/release/kiln")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warm", type=int, default=3)
    args = ap.parse_args()
    cmd = [args.kiln, "run", "examples/mlp/model.onnx", "--input", "x=examples/mlp/x.npy",
           "--expect", "probs=examples/mlp/expected.npy", "--device", "cpu", "-q"]

    def once(env):
        t = time.perf_counter()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        ms = (time.perf_counter() - t) * 1000
        if r.returncode != 0:
            raise SystemExit(f"kiln run failed ({r.returncode}): {r.stderr}")
        return ms

    cold, warm = [], []
    for _ in range(args.rounds):
        cache = tempfile.mkdtemp(prefix="kiln-cache-")
        os.chmod(cache, 0o700)
        try:
            env = dict(os.environ, KILN_CACHE_DIR=cache)
            cold.append(once(env))
            warm.extend(once(env) for _ in range(args.warm))
        finally:
            shutil.rmtree(cache)
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"cold cache: median {c:.1f} ms over {len(cold)} runs")
    print(f"warm cache: median {w:.1f} ms over {len(warm)} runs (min {min(warm):.1f}, max {max(warm):.1f})")
    print(f"warm / cold: {w / c:.3f}")


if __name__ == "__main__":
    main()
