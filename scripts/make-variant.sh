#!/usr/bin/env bash
# Makes a drop-in variant of a built-in package for an A/B on the GPU machine (`gpu-check.sh ab`,
# `int4`, `attn`): .gpu/variants/NAME, a copy of the package as the last `cargo build --release`
# built it (kernel.toml with its [files] digests, cuda/, shim.wasm), with sed expressions applied
# to its CUDA sources and, when given, to its shim's sources (the shim is then rebuilt for
# wasm32 as builtin-kernels/build.rs builds it, and the sources restored). Run it after
# scripts/stage-gpu.sh, which clears .gpu/.
#   scripts/make-variant.sh NAME PKG [--cu FILE EXPR]... [--shim FILE EXPR]...
# FILE is relative to kernels/PKG/cuda/ (--cu) or kernels/PKG/shim/src/ (--shim); EXPR is a sed
# expression. Example: the 4-bit GEMV at 4 warps a block (kernel and shim change together):
#   scripts/make-variant.sh qw4 matmul --cu linear.cu 's/^#define LIN_QWARPS 8 /#define LIN_QWARPS 4 /' \
#     --shim linear.rs 's/^const Q_GEMV_WARPS: usize = 8;/const Q_GEMV_WARPS: usize = 4;/'
set -euo pipefail
usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 2 ] || usage
name=$1 pkg=$2
shift 2
case "$name" in "" | */* | .*) echo "NAME must be a plain folder name, not '$name'" >&2; exit 2 ;; esac
built=$(ls -td target/release/build/kiln-builtin-kernels-*/out/packages/"$pkg" 2>/dev/null | head -1 || true)
[ -n "$built" ] || { echo "no built package $pkg: run cargo build --release first" >&2; exit 1; }
v=.gpu/variants/$name
rm -rf "$v" && mkdir -p "$v"
cp -r "$built"/. "$v"/
shim_edits=()
while [ $# -gt 0 ]; do
  [ $# -ge 3 ] || usage
  case "$1" in
  --cu) sed -i "$3" "$v/cuda/$2"; cmp -s "$v/cuda/$2" "$built/cuda/$2" && { echo "--cu $2: '$3' changed nothing" >&2; exit 1; } ;;
  --shim) shim_edits+=("$2" "$3") ;;
  *) echo "unknown argument $1" >&2; usage ;;
  esac
  shift 3
done
if [ ${#shim_edits[@]} -gt 0 ]; then
  src=kernels/$pkg/shim/src
  backup=$(mktemp -d)
  cp -rp "$src"/. "$backup"/
  restore() { cp -rp "$backup"/. "$src"/; rm -rf "$backup"; }
  trap restore EXIT
  for ((i = 0; i < ${#shim_edits[@]}; i += 2)); do
    sed -i "${shim_edits[i + 1]}" "$src/${shim_edits[i]}"
    cmp -s "$src/${shim_edits[i]}" "$backup/${shim_edits[i]}" &&
      { echo "--shim ${shim_edits[i]}: '${shim_edits[i + 1]}' changed nothing" >&2; exit 1; }
  done
  crate=$(sed -n 's/^name = "\(.*\)"/\1/p' "kernels/$pkg/shim/Cargo.toml" | head -1)
  # As builtin-kernels/build.rs: the caller's flags and target dir removed, SIMD128 on.
  (cd kernels && env -u RUSTFLAGS -u CARGO_BUILD_RUSTFLAGS -u CARGO_TARGET_DIR -u CARGO_BUILD_TARGET \
    -u RUSTC_WORKSPACE_WRAPPER CARGO_ENCODED_RUSTFLAGS=-Ctarget-feature=+simd128 \
    cargo build -q --release --target wasm32-unknown-unknown -p "$crate" --target-dir ../target/kiln-variant)
  cp "target/kiln-variant/wasm32-unknown-unknown/release/${crate//-/_}.wasm" "$v/shim.wasm"
fi
# The [files] digests of what changed.
for f in $(cd "$v" && find cuda shim.wasm -type f); do
  h=$(sha256sum "$v/$f" | cut -d' ' -f1)
  sed -i "s|^\"$f\" = \".*\"|\"$f\" = \"$h\"|" "$v/kernel.toml"
done
listed=$(target/release/kiln kernels list --packages "$v" 2>&1 || true)
grep -E "BROKEN|\($v\)" <<<"$listed" | head -3
if grep -q BROKEN <<<"$listed"; then exit 1; fi
