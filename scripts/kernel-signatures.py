"""Prints the parameter signatures of a package's CUDA kernels, read from its sources, as the
`signatures` tables of kernel.toml (ABI.md §7.3), or checks a package's manifest against them.

    python3 scripts/kernel-signatures.py kernels/matmul            # print, per [[cuda]] source
    python3 scripts/kernel-signatures.py --check kernels/*/        # exit 1 on any mismatch

Each source is run through the C preprocessor (`cpp`, with the host prelude's folder
host/cuda on the include path, and every header package's `include/` — of kernels/ and of the
packages given — as `<package>/`, ABI.md §7.6), so kernels that macros define are seen as the
compiler sees them; a kernel declared by a name expression (`kiln_cast<kiln_tag_f16>`, schema 6)
has its function template's parameters. A parameter is `tensor` when it is a pointer, else its scalar type: `i32` (int), `u32`
(unsigned), `i64` (long long, kiln_i64), `u64` (unsigned long long, kiln_u64), `f32` (float),
`f64` (double); a `kiln_status*` is `status` (ABI.md §7.5), a `kiln_counter*` is `counters` (§6.3). Kernels with the same parameters are grouped under a `*` pattern when one
covers exactly them, else listed.
"""
import os
import re
import glob
import subprocess
import sys
import tempfile
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCALARS = {
    "int": "i32", "signed": "i32", "signed int": "i32", "int32_t": "i32",
    "unsigned": "u32", "unsigned int": "u32", "uint32_t": "u32",
    "long long": "i64", "long long int": "i64", "kiln_i64": "i64", "int64_t": "i64",
    "unsigned long long": "u64", "unsigned long long int": "u64", "kiln_u64": "u64", "uint64_t": "u64",
    "float": "f32", "double": "f64",
}


def header_tree(pkgs, tree):
    """Fills folder `tree` so that `<package>/` is each header package's `include/` (the
    packages of kernels/ and `pkgs`), as NVRTC sees their headers; returns it."""
    for pkg in sorted(set(glob.glob(os.path.join(ROOT, "kernels", "*"))) | set(pkgs)):
        path = os.path.join(pkg, "kernel.toml")
        if not os.path.isfile(path):
            continue
        manifest = tomllib.load(open(path, "rb"))
        name = manifest["package"]["name"]
        if manifest.get("headers") and not os.path.exists(os.path.join(tree, name)):
            os.symlink(os.path.abspath(os.path.join(pkg, "include")), os.path.join(tree, name))
    return tree


def kernels_of(source, tree):
    """{kernel name: [param kind, ...]} of every extern "C" __global__ function in `source`, and
    of every __global__ function template by its name (a manifest's name expression
    `NAME<args>`, schema 6, takes the template NAME's parameters)."""
    out = subprocess.run(["cpp", "-P", "-x", "c++", "-I", os.path.join(ROOT, "host", "cuda"), "-I", tree, source],
                         check=True, capture_output=True, text=True).stdout
    found = {}
    entry = r'(?:extern\s+"C"|template\s*<[^>]*>)\s*__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)'
    for m in re.finditer(entry, out):
        name, params = m.group(1), m.group(2).strip()
        kinds = []
        for p in [p.strip() for p in params.split(",")] if params and params != "void" else []:
            if re.match(r"(const\s+)?kiln_status\s*\*", p):
                kinds.append("status")
                continue
            if re.match(r"kiln_counter\s*\*", p):
                kinds.append("counters")
                continue
            if "*" in p:
                kinds.append("tensor")
                continue
            words = [w for w in re.sub(r"\b(const|volatile|__restrict__)\b", " ", p).split()]
            ty = " ".join(words[:-1])
            if ty not in SCALARS:
                raise SystemExit(f"{source}: kernel {name}: parameter {p!r} has a type this script does not map")
            kinds.append(SCALARS[ty])
        found[name] = kinds
    return found


def glob_match(pattern, name):
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), name) is not None


def groups(declared, sigs):
    """[(patterns, params)] covering `declared`, one entry per distinct parameter list."""
    by_params = {}
    for k in declared:
        by_params.setdefault(tuple(sigs[k]), []).append(k)
    result = []
    for params, names in by_params.items():
        prefix = os.path.commonprefix(names)
        others = [k for k in declared if k not in names]
        pattern = prefix + "*"
        if len(names) > 1 and prefix and not any(glob_match(pattern, k) for k in others):
            result.append(([pattern], list(params)))
        else:
            result.append((names, list(params)))
    return result


def toml_list(items, indent="    "):
    line = ", ".join(f'"{i}"' for i in items)
    return f"[{line}]"


def main(argv):
    check = argv[:1] == ["--check"]
    pkgs = argv[1:] if check else argv
    with tempfile.TemporaryDirectory(prefix="kiln-headers-") as tree:
        return check_or_print(pkgs, check, header_tree(pkgs, tree))


def check_or_print(pkgs, check, tree):
    failed = 0
    for pkg in pkgs:
        manifest = tomllib.load(open(os.path.join(pkg, "kernel.toml"), "rb"))
        for c in manifest.get("cuda", []):
            found = kernels_of(os.path.join(pkg, c["source"]), tree)
            sigs = {k: found[k.split("<")[0]] for k in c["kernels"] if k.split("<")[0] in found}
            missing = [k for k in c["kernels"] if k not in sigs]
            if missing:
                print(f"{pkg}: {c['source']}: declared kernels not in the source: {missing}")
                failed += 1
                continue
            if check:
                for k in c["kernels"]:
                    hits = [s for s in c.get("signatures", []) if any(glob_match(p, k) for p in s["kernels"])]
                    if len(hits) != 1 or hits[0]["params"] != sigs[k]:
                        print(f"{pkg}: {c['source']}: kernel {k}: manifest {[h['params'] for h in hits]}, source {sigs[k]}")
                        failed += 1
                continue
            print(f"# {pkg}: {c['source']}")
            print("signatures = [")
            for patterns, params in groups(c["kernels"], sigs):
                print(f"    {{ kernels = {toml_list(patterns)}, params = {toml_list(params)} }},")
            print("]")
    if check:
        print("ok" if failed == 0 else f"{failed} mismatches")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
