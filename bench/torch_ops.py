"""PyTorch peers of `kiln bench ops`, measured on the same GPU in the same session:
torch.matmul TFLOP/s (f16, bf16; 4096³, 8192³), add f16 on 256 Mi elements and
device-to-device copy in GB/s, and host microseconds per eager op (torch.relu on 256 floats).

    python3 bench/torch_ops.py [--json FILE]
"""
import json
import sys
import time

import torch


def cuda_ms(fn, warmup=3, iters=20):
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def main():
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for n in (4096, 8192):
        for dt, name in ((torch.float16, "float16"), (torch.bfloat16, "bfloat16")):
            a = torch.randn(n, n, device="cuda", dtype=dt)
            b = torch.randn(n, n, device="cuda", dtype=dt)
            ms = cuda_ms(lambda: torch.matmul(a, b))
            out[f"gemm_{n}_{name}_tflops"] = 2 * n**3 / (ms * 1e-3) / 1e12
            print(f"torch.matmul {n}x{n}x{n} {name}: {out[f'gemm_{n}_{name}_tflops']:.1f} TFLOP/s")
    n = 256 << 20
    x = torch.randn(n, device="cuda", dtype=torch.float16)
    y = torch.randn(n, device="cuda", dtype=torch.float16)
    z = torch.empty_like(x)
    ms = cuda_ms(lambda: z.copy_(x))
    out["copy_gbps"] = 2 * x.numel() * 2 / (ms * 1e-3) / 1e9
    ms = cuda_ms(lambda: torch.add(x, y, out=z))
    out["add_f16_gbps"] = 3 * x.numel() * 2 / (ms * 1e-3) / 1e9
    print(f"torch copy_ (256 Mi f16): {out['copy_gbps']:.0f} GB/s; torch.add f16: {out['add_f16_gbps']:.0f} GB/s")
    s = torch.randn(256, device="cuda")
    torch.relu(s)
    torch.cuda.synchronize()
    iters = 20000
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.relu(s)
    out["eager_op_us"] = (time.perf_counter() - t0) * 1e6 / iters
    torch.cuda.synchronize()
    print(f"torch eager relu (256 floats): {out['eager_op_us']:.2f} µs host time per op")
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
