#!/usr/bin/env bash
# The Python package's tests: builds the wheel (maturin, dev profile, so that it reuses what
# `cargo test --workspace` compiled), installs it into a virtual environment under target/ with
# numpy, onnxruntime (CPU) and pytest from PyPI, and runs python/tests against onnxruntime.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/py-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --disable-pip-version-check "maturin>=1.5,<2" numpy onnxruntime pytest
rm -rf target/wheels
"$venv/bin/maturin" build --profile dev -m python/Cargo.toml -o target/wheels
"$venv/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps target/wheels/kiln-*.whl
"$venv/bin/python" -m pytest -q python/tests
