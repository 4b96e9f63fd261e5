#!/usr/bin/env bash
# Fetches ONNX 1.20.0's backend node tests (onnx/backend/test/data/node, 1653 tests) into
# .cache/onnx-node-1.20.0/node. Idempotent; needs python3 with pip and access to PyPI.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.cache/onnx-node-1.20.0"
[ -f "$dest/node/test_relu/model.onnx" ] && exit 0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: onnx==1.20.0 -d "$tmp"
wheel=$(ls "$tmp"/onnx-1.20.0-*.whl | head -n 1)
python3 - "$wheel" "$tmp/x" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("onnx/backend/test/data/node/")])
PY
mkdir -p "$dest"
rm -rf "$dest/node"
mv "$tmp/x/onnx/backend/test/data/node" "$dest/node"
echo "fetched $(ls "$dest/node" | wc -l) ONNX node tests into $dest/node"
