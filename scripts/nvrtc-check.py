"""Compiles CUDA sources with NVRTC (no GPU needed) to check they build, as kiln will at run
time, with the host's prelude header kiln.cuh. Usage: python3 scripts/nvrtc-check.py [--arch sm_90] FILE.cu ...

Needs libnvrtc: `pip install nvidia-cuda-nvrtc` (CUDA 13) or a CUDA toolkit; set
KILN_NVRTC=/path/to/libnvrtc.so.13 to choose one.
"""
import ctypes
import glob
import os
import sys
import sysconfig


def find_nvrtc():
    if os.environ.get("KILN_NVRTC"):
        return os.environ["KILN_NVRTC"]
    roots = [sysconfig.get_paths()["purelib"], "/tmp/nvrtc"]
    for root in roots:
        hits = glob.glob(os.path.join(root, "nvidia", "cu13", "lib", "libnvrtc.so.13"))
        if hits:
            return hits[0]
    return "libnvrtc.so.13"


def main(argv):
    arch = "sm_90"
    if argv[:1] == ["--arch"]:
        arch, argv = argv[1], argv[2:]
    lib = ctypes.CDLL(find_nvrtc())
    failed = 0
    for path in argv:
        src = open(path, "rb").read()
        prog = ctypes.c_void_p()
        prelude = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "host", "cuda", "kiln.cuh"), "rb").read()
        headers = (ctypes.c_char_p * 1)(prelude)
        names = (ctypes.c_char_p * 1)(b"kiln.cuh")
        rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src, os.path.basename(path).encode(), 1, headers, names)
        assert rc == 0, rc
        opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"-default-device"] + [o.encode() for o in os.environ.get("KILN_NVRTC_OPTS", "").split()]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace").strip()
        if rc != 0:
            failed += 1
            print(f"FAILED {path}:\n{text}")
        else:
            print(f"ok     {path}" + (f"\n{text}" if text else ""))
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
