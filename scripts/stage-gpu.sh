#!/usr/bin/env bash
# Stages what a run on the GPU machine needs into .gpu/ (git-ignored), compressed to stay well
# under the 64 MiB that may travel:
#   .gpu/kiln.xz, .gpu/gpu-tests.xz   release kiln and the GPU test binary (tests/gpu.rs)
#   .gpu/bias-gelu.kpkg               the third-party example's package (examples/third-party)
#   .gpu/node-tests.tar.xz            the ONNX node tests (.cache/onnx-node-1.20.0)
#   .gpu/fixtures/llm/...             the small LLM fixtures the GPU tests read
#   .gpu/device-fixtures/             ../shared/fixtures/device (SmolLM2-architecture builder,
#                                     PyTorch peer benchmark) with a slimmed builder wheel
#   .gpu/python/                      the kiln wheel (release) and pytest's wheels, for the
#                                     Python package's tests there (the machine has no network)
#   .gpu/nvrtc-cache.tar.xz           with KILN_STAGE_NVRTC (below): every package's NVRTC cubins
#                                     for sm_90, unpacked into the run's KILN_CACHE_DIR there
#   .gpu/setup.sh                     run first on the GPU machine: unpacks into /tmp/kiln-gpu
#                                     (and the cubins into KILN_CACHE_DIR)
#
# KILN_STAGE_NVRTC=DIR (a folder holding the libnvrtc.so.13 of the GPU machine's NVRTC version,
# 13.0: `pip download "nvidia-cuda-nvrtc==13.0.*"` and unzip, then DIR is its nvidia/cu13/lib)
# compiles every package's sources for sm_90 here with it, the third-party example's too (kiln's
# cache key holds NVRTC's version, the architecture, the options, the prelude, the headers, the
# sources and the kernel name expressions), so that runs there load the cubins instead of
# compiling each package on first use (they still need libnvrtc, for its version). The cubins
# are kept in .cache/nvrtc-stage between stagings, so only changed sources compile again; a hit
# marks an entry used, only the entries this staging used travel, and entries unused for a week
# are dropped.
#
# On the GPU machine, from the repository root:
#   source .gpu/setup.sh            # sets KILN, GPU_TESTS, KILN_FIXTURES, KILN_CACHE_DIR
#   bash .gpu/device-fixtures/make-smollm2-arch.sh /tmp/kiln-models --results "$OUT/make"
#   "$GPU_TESTS" --include-ignored --test-threads 1
#   "$KILN" bench decode /tmp/kiln-models/smollm2-arch-fp16-cuda --batch 1 --batch 8
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
shared="${KILN_SHARED:-$root/../shared}"
rm -rf .gpu && mkdir -p .gpu/fixtures/llm/references
rustup target add wasm32-unknown-unknown >/dev/null 2>&1 || true
bash scripts/fetch-onnx-node-tests.sh
cargo build --release -p kiln-host
tests_bin=$(cargo test --release -p kiln-tests --test gpu --no-run --message-format json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu" and m.get("executable"):
        print(m["executable"])')
# With KILN_STAGE_NVRTC (above): every package's cubins for sm_90 into the staging cache.
stage=()
if [ -n "${KILN_STAGE_NVRTC:-}" ]; then
  nvrtc_dir=$(realpath "$KILN_STAGE_NVRTC")
  # cudarc opens libnvrtc.so before the versioned names: this folder, first on the library
  # path, makes it the staged version's rather than a system toolkit's.
  nvrtc_link=$(mktemp -d)
  ln -s "$nvrtc_dir/libnvrtc.so.13" "$nvrtc_link/libnvrtc.so"
  python3 - "$nvrtc_link/libnvrtc.so" <<'PYEOF'
import ctypes, sys
major, minor = ctypes.c_int(), ctypes.c_int()
ctypes.CDLL(sys.argv[1]).nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
if (major.value, minor.value) != (13, 0):
    sys.exit(f"KILN_STAGE_NVRTC: NVRTC {major.value}.{minor.value}, not the GPU machine's 13.0")
PYEOF
  stage_cache="$root/.cache/nvrtc-stage"
  mkdir -p "$stage_cache" && chmod 700 "$stage_cache"
  find "$stage_cache" -type f -mtime +7 -delete
  touch "$stage_cache/.stamp" && sleep 1
  stage=(env KILN_CACHE_DIR="$stage_cache" LD_LIBRARY_PATH="$nvrtc_link:$nvrtc_dir")
  "${stage[@]}" "$tests_bin" --ignored --exact package_sources_compile_and_define_their_kernels \
    >"$stage_cache/.test.log" 2>&1 && grep -q "1 passed" "$stage_cache/.test.log" ||
    { tail -40 "$stage_cache/.test.log"; echo "stage-gpu.sh: the packages did not compile" >&2; exit 1; }
fi
# The third-party example's package for its GPU test (the GPU machine has no cargo): built here
# in a copy whose shim depends on this checkout's kernel-abi (its cubin staged too, with
# KILN_STAGE_NVRTC).
tp=$(mktemp -d)
cp -r examples/third-party/bias-gelu "$tp/"
rm -rf "$tp/bias-gelu/shim/target" "$tp/bias-gelu/shim.wasm"
sed -i "s|path = \"../../../../kernel-abi\"|path = \"$root/kernel-abi\"|" "$tp/bias-gelu/shim/Cargo.toml"
arch=()
[ ${#stage[@]} -eq 0 ] || arch=(--arch sm_90)
"${stage[@]}" target/release/kiln -q package build "$tp/bias-gelu" "${arch[@]}" -o .gpu/bias-gelu.kpkg >/dev/null
rm -rf "$tp"
if [ ${#stage[@]} -gt 0 ]; then
  # Only the entries this staging used (a hit marks an entry used).
  (cd "$stage_cache" && find nvrtc -type f -newer .stamp) >"$stage_cache/.used"
  tar -C "$stage_cache" -cJf .gpu/nvrtc-cache.tar.xz -T "$stage_cache/.used"
  rm -rf "$nvrtc_link"
fi
venv=target/py-venv
[ -x "$venv/bin/maturin" ] || { python3 -m venv "$venv" && "$venv/bin/pip" install -q "maturin>=1.5,<2"; }
"$venv/bin/maturin" build --release -m python/Cargo.toml -o .gpu/python >/dev/null
"$venv/bin/pip" download -q --no-deps -d .gpu/python pytest pluggy iniconfig packaging
xz -T2 -6 -c target/release/kiln > .gpu/kiln.xz
xz -T2 -6 -c "$tests_bin" > .gpu/gpu-tests.xz
tar -C "$root" -cJf .gpu/node-tests.tar.xz .cache/onnx-node-1.20.0
for f in tiny-llama-v512-fp16-cuda tiny-llama-v512-fp32-cpu; do
  cp -r "$shared/fixtures/llm/$f" .gpu/fixtures/llm/
  cp -r "$shared/fixtures/llm/references/$f" .gpu/fixtures/llm/references/
done
cp -r "$shared/fixtures/device" .gpu/device-fixtures
rm -rf .gpu/device-fixtures/results
# The builder needs only the wheel's pure-Python onnxruntime_genai/models/.
wheel="onnxruntime_genai-0.18.0-cp312-cp312-manylinux_2_28_x86_64.whl"
[ -f "/tmp/whl/$wheel" ] || python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 onnxruntime-genai==0.18.0 -d /tmp/whl >/dev/null
python3 - "/tmp/whl/$wheel" ".gpu/device-fixtures/$wheel" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as src, zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_DEFLATED) as dst:
    for n in src.namelist():
        if n.startswith("onnxruntime_genai/models/") and n.endswith(".py"):
            dst.writestr(n, src.read(n))
EOF
cat > .gpu/setup.sh <<'EOF'
# Sourced on the GPU machine from the repository root.
R=$PWD
mkdir -p /tmp/kiln-gpu
for b in kiln gpu-tests; do
  python3 -c 'import lzma,sys; open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' .gpu/$b.xz /tmp/kiln-gpu/$b
  chmod +x /tmp/kiln-gpu/$b
done
tar -xJf .gpu/node-tests.tar.xz -C "$R"
# The test binary finds the repository where it was built (tests/lib.rs `root()`).
built_root=$(cat .gpu/built-root)
if [ "$built_root" != "$R" ]; then mkdir -p "$(dirname "$built_root")"; ln -sfn "$R" "$built_root"; fi
export KILN=/tmp/kiln-gpu/kiln GPU_TESTS=/tmp/kiln-gpu/gpu-tests
export KILN_FIXTURES=$R/.gpu/fixtures KILN_CACHE_DIR=/tmp/kiln-cache
# The packages' cubins compiled at staging (KILN_STAGE_NVRTC): owner-only, as kiln's cache
# requires; entries whose key differs (another NVRTC version) are simply not found.
if [ -f .gpu/nvrtc-cache.tar.xz ]; then
  mkdir -p "$KILN_CACHE_DIR" && chmod 700 "$KILN_CACHE_DIR"
  { tar --no-same-owner -xJf .gpu/nvrtc-cache.tar.xz -C "$KILN_CACHE_DIR" &&
    chmod 700 "$KILN_CACHE_DIR/nvrtc" && chmod 600 "$KILN_CACHE_DIR"/nvrtc/*; } ||
    echo "setup.sh: the staged NVRTC cubins were not unpacked; kiln compiles the packages" >&2
fi
EOF
echo "$root" > .gpu/built-root
du -sh .gpu
ls -la .gpu
