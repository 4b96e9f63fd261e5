#!/usr/bin/env python3
"""Compiles a kernel package's CUDA source with NVRTC as kiln does (the prelude kiln.cuh as an
in-memory header, --std=c++17, -default-device, sm_90 unless --arch), without a GPU, and prints
ptxas's report: registers, spills and shared memory per kernel, or the compiler's errors.

NVRTC comes from PyPI on a machine without the CUDA toolkit:
    python3 -m venv /tmp/nvrtc && /tmp/nvrtc/bin/pip install nvidia-cuda-nvrtc
    python3 scripts/nvrtc-check.py kernels/attention/cuda/attention.cu [--arch sm_90] [--lib PATH]
        [--kernel REGEX]
Exit status: 0 when it compiles, 1 when it does not.
"""
import argparse
import ctypes
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_lib():
    pats = ["/tmp/nvrtc/lib/python3*/site-packages/nvidia/cu*/lib/libnvrtc.so*",
            os.path.expanduser("~/.local/lib/python3*/site-packages/nvidia/cu*/lib/libnvrtc.so*"),
            "/usr/local/cuda/lib64/libnvrtc.so*"]
    for p in pats:
        hits = sorted(h for h in glob.glob(p) if "builtins" not in h)
        if hits:
            return hits[-1]
    sys.exit("no libnvrtc found: pip install nvidia-cuda-nvrtc into /tmp/nvrtc, or pass --lib")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--lib")
    ap.add_argument("--kernel", default=".", help="report only kernels whose name matches")
    a = ap.parse_args()
    lib = ctypes.CDLL(a.lib or find_lib())
    src = open(a.source, "rb").read()
    prelude = open(os.path.join(ROOT, "host/cuda/kiln.cuh"), "rb").read()
    prog = ctypes.c_void_p()
    lib.nvrtcCreateProgram(ctypes.byref(prog), src, os.path.basename(a.source).encode(), 1,
                           (ctypes.c_char_p * 1)(prelude), (ctypes.c_char_p * 1)(b"kiln.cuh"))
    opts = [f"--gpu-architecture={a.arch}".encode(), b"--std=c++17", b"-default-device", b"--ptxas-options=-v"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace")
    if rc != 0:
        print(text)
        return 1
    # ptxas: "Compiling entry function 'NAME'", then its spills and registers.
    name, spills = None, 0
    for line in text.splitlines():
        m = re.search(r"entry function '([^']+)'", line)
        if m:
            name = m.group(1)
            continue
        if name and re.search(a.kernel, name):
            m = re.search(r"(\d+) bytes spill stores", line)
            if m:
                spills = int(m.group(1))
            m = re.search(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", line)
            if m:
                smem = m.group(2) or "0"
                print(f"{name:40s} {m.group(1):>4s} registers  {spills:5d} B spilled  {smem:>6s} B shared")
                name = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
