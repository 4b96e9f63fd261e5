#!/usr/bin/env bash
# A/B of the CPU products' tile shapes (host/src/sandbox/cpu_gemm.rs: MAX_TILES, TILE_EDGE) at the
# GPU machine's 16 threads: ResNet-50 and MatMul 1024³ beside onnxruntime, each binary in turn,
# rounds alternated.
#   here, after scripts/stage-gpu.sh:   bash scripts/cpu-tile-ab.sh stage [TILES:EDGE ...]
#     builds one kiln per TILES:EDGE (default 32:64 16:128) into .gpu/kiln-tiles-TILES-EDGE.xz,
#     restoring cpu_gemm.rs and the release binary after;
#   there:                              bash scripts/cpu-tile-ab.sh run [ROUNDS]
#     runs the staged kiln (the built-in tiles) and every .gpu/kiln-tiles-*.xz, ROUNDS times (2),
#     then the staged kiln at 1, 2, 4, 8 and 16 threads (its scaling beside onnxruntime's); the
#     tables go to $OUT/cpu-tile-ab.log.
set -euo pipefail
mode=${1:-}
shift || true
case "$mode" in
stage)
  src=host/src/sandbox/cpu_gemm.rs
  cp "$src" /tmp/cpu_gemm.rs.ab
  trap 'cp /tmp/cpu_gemm.rs.ab "$src"' EXIT
  for v in "${@:-32:64 16:128}"; do
    for pair in $v; do
      t=${pair%%:*} e=${pair##*:}
      cp /tmp/cpu_gemm.rs.ab "$src"
      sed -i "s/^const MAX_TILES: u64 = [0-9]*;/const MAX_TILES: u64 = $t;/; s/^const TILE_EDGE: usize = [0-9]*;/const TILE_EDGE: usize = $e;/" "$src"
      grep -q "^const MAX_TILES: u64 = $t;" "$src" && grep -q "^const TILE_EDGE: usize = $e;" "$src" ||
        { echo "cpu_gemm.rs: MAX_TILES / TILE_EDGE not found" >&2; exit 1; }
      cargo build --release --bin kiln 2>&1 | grep -E "^error" && exit 1
      xz -T2 -c target/release/kiln >".gpu/kiln-tiles-$t-$e.xz"
      echo "staged .gpu/kiln-tiles-$t-$e.xz"
    done
  done
  cp /tmp/cpu_gemm.rs.ab "$src"
  cargo build --release --bin kiln 2>&1 | grep -E "^error" && exit 1
  du -sh .gpu
  ;;
run)
  rounds=${1:-2}
  source .gpu/setup.sh
  bins=("builtin:$KILN")
  for x in .gpu/kiln-tiles-*.xz; do
    [ -f "$x" ] || continue
    b=/tmp/kiln-gpu/$(basename "$x" .xz)
    python3 -c 'import lzma,sys; open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' "$x" "$b"
    chmod +x "$b"
    bins+=("$(basename "$b"):$b")
  done
  work=/tmp/kiln-check
  mkdir -p "$work"
  (cd scripts && python3 make-big-models.py "$work/big" resnet50) 2>&1 | tail -1
  for r in $(seq "$rounds"); do
    for nb in "${bins[@]}"; do
      python3 scripts/bench-cpu.py --kiln "${nb#*:}" --threads 16 "$work/big/resnet50" 2>&1 |
        grep -E "^\| (MatMul|resnet)" | sed "s/^/${nb%%:*} round $r /"
    done
  done | tee "${OUT:-.}/cpu-tile-ab.log"
  # How the built-in tiles scale: ResNet-50 and MatMul at 1 to 16 threads, kiln beside onnxruntime.
  for t in 1 2 4 8 16; do
    python3 scripts/bench-cpu.py --kiln "${bins[0]#*:}" --threads "$t" --runs 10 "$work/big/resnet50" 2>&1 |
      grep -E "^\| (MatMul|resnet)"
  done | tee -a "${OUT:-.}/cpu-tile-ab.log"
  ;;
*) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
