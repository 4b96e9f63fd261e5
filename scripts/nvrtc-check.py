#!/usr/bin/env python3
"""Compiles CUDA sources with NVRTC (no GPU needed) to check they build, as kiln will at run
time, with the host's prelude header kiln.cuh and the header packages, and prints ptxas's report of each kernel:
registers, bytes spilled and static shared memory. Usage:
    python3 scripts/nvrtc-check.py [--arch sm_90] [--kernel REGEX] FILE.cu ...

Kernels the package's kernel.toml names by C++ name expressions (manifest schema 6,
`kiln_cast<kiln_tag_f16>`) are instantiated with nvrtcAddNameExpression, as kiln does, and
reported by those names.

Needs libnvrtc: `pip install nvidia-cuda-nvrtc` (CUDA 13) or a CUDA toolkit; set
KILN_NVRTC=/path/to/libnvrtc.so.13 to choose one, KILN_NVRTC_OPTS for more options.
Exit status: 1 when a file does not compile.
"""
import argparse
import ctypes
import glob
import os
import re
import sys
import sysconfig
import tomllib


def find_nvrtc():
    if os.environ.get("KILN_NVRTC"):
        return os.environ["KILN_NVRTC"]
    # This Python's packages, a venv at /tmp/nvrtc (the README's), and the venv that
    # scripts/make-model-folder.sh makes (its onnxruntime-genai builder pulls NVRTC in).
    roots = [sysconfig.get_paths()["purelib"], "/tmp/nvrtc",
             os.path.expanduser("~/.cache/kiln/model-build/venv")]
    for root in roots:
        hits = glob.glob(os.path.join(root, "nvidia", "cu13", "lib", "libnvrtc.so.13"))
        hits += glob.glob(os.path.join(root, "lib", "python3*", "site-packages", "nvidia", "cu13", "lib", "libnvrtc.so.13"))
        if hits:
            return hits[0]
    return "libnvrtc.so.13"


def header_packages(root):
    """The prelude and every package's manifest `headers` under `root`/kernels as (name, bytes), named
    `<package>/<file>` as the host gives them to NVRTC (ABI.md §7.6)."""
    out = [(b"kiln.cuh", open(os.path.join(root, "host", "cuda", "kiln.cuh"), "rb").read())]
    for toml in sorted(glob.glob(os.path.join(root, "kernels", "*", "kernel.toml"))):
        with open(toml, "rb") as f:
            manifest = tomllib.load(f)
        for header in manifest.get("headers", []):  # "include/<path>", as the manifest lists them
            rel = header.removeprefix("include/")
            path = os.path.join(os.path.dirname(toml), header)
            out.append((f"{manifest['package']['name']}/{rel}".encode(), open(path, "rb").read()))
    return out


def name_expressions(path):
    """The kernels that the kernel.toml of the package holding `path` declares for that source by
    name expressions: the nearest kernel.toml above the file whose [[cuda]] names it."""
    pkg = os.path.dirname(os.path.abspath(path))
    while pkg != os.path.dirname(pkg):
        toml = os.path.join(pkg, "kernel.toml")
        if os.path.isfile(toml):
            rel = os.path.relpath(os.path.abspath(path), pkg)
            cuda = [c for c in tomllib.load(open(toml, "rb")).get("cuda", []) if c["source"] == rel]
            if cuda:
                return [k for c in cuda for k in c.get("kernels", []) if "<" in k]
        pkg = os.path.dirname(pkg)
    return []


def kernel_report(log, pattern, names=None):
    """ptxas -v lines → one line per kernel whose name (a name expression's own for a lowered
    symbol in `names`) matches `pattern`."""
    out, name, spills = [], None, 0
    for line in log.splitlines():
        m = re.search(r"entry function '([^']+)'", line)
        if m:
            name, spills = (names or {}).get(m.group(1), m.group(1)), 0
            continue
        if not name or not re.search(pattern, name):
            continue
        m = re.search(r"(\d+) bytes spill stores", line)
        if m:
            spills = int(m.group(1))
        m = re.search(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", line)
        if m:
            out.append(f"  {name:40s} {m.group(1):>4s} registers  {spills:5d} B spilled  {m.group(2) or '0':>6s} B shared")
            name = None
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", metavar="FILE.cu")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--kernel", default=".", help="report only kernels whose name matches")
    a = ap.parse_args()
    lib = ctypes.CDLL(find_nvrtc())
    headers = header_packages(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    failed = 0
    for path in a.files:
        src = open(path, "rb").read()
        prog = ctypes.c_void_p()
        sources = (ctypes.c_char_p * len(headers))(*(h for _, h in headers))
        names = (ctypes.c_char_p * len(headers))(*(n for n, _ in headers))
        rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src, os.path.basename(path).encode(), len(headers), sources, names)
        assert rc == 0, rc
        exprs = name_expressions(path)
        for e in exprs:
            assert lib.nvrtcAddNameExpression(prog, e.encode()) == 0, e
        opts = [f"--gpu-architecture={a.arch}".encode(), b"--std=c++17", b"-default-device", b"--ptxas-options=-v"]
        opts += [o.encode() for o in os.environ.get("KILN_NVRTC_OPTS", "").split()]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace").strip()
        if rc != 0:
            failed += 1
            print(f"FAILED {path}:\n{text}")
        else:
            lowered, missing = {}, []
            for e in exprs:
                sym = ctypes.c_char_p()
                if lib.nvrtcGetLoweredName(prog, e.encode(), ctypes.byref(sym)) != 0:
                    missing.append(e)
                    continue
                lowered[sym.value.decode()] = e
            if missing:
                failed += 1
                print(f"FAILED {path}: kernel.toml names {missing}, which the source does not instantiate")
                lib.nvrtcDestroyProgram(ctypes.byref(prog))
                continue
            print(f"ok     {path}")
            for line in kernel_report(text, a.kernel, lowered):
                print(line)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
