#!/usr/bin/env bash
# On the GPU machine, from the repository root, after `scripts/stage-gpu.sh` here: checks and
# times kiln in one call. Phases (any of them, in this order):
#   tests      the GPU tests (tests/gpu.rs), all of them
#   bench      kiln bench decode, graphs on and off, batch 1 and 8, prompt 128 and 3840
#   peers      PyTorch eager, CUDA graph and torch.compile on the same architecture
#   sanitize   compute-sanitizer memcheck over a graph decode
#   profile    ncu: GPU time of every kernel of one eager decode step (batch 1 and 8)
# Logs and JSON go to $OUT (or ./gpu-out); the last lines printed are a summary.
set -uo pipefail
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
phases="${*:-tests bench}"
source .gpu/setup.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.used --format=csv | tee "$out/gpu.txt"
models=/tmp/kiln-models
if [ ! -f "$models/reference/smollm2-arch-ref.json" ]; then
  t0=$(date +%s)
  bash .gpu/device-fixtures/make-smollm2-arch.sh "$models" --results "$out/make" >"$out/make.log" 2>&1 ||
    { tail -30 "$out/make.log"; exit 1; }
  echo "models built in $(($(date +%s) - t0)) s"
fi
summary=()
for phase in $phases; do
  t0=$(date +%s)
  case "$phase" in
  tests)
    "$GPU_TESTS" --include-ignored --test-threads 1 2>&1 | tee "$out/gpu-tests.log" | grep -E "^test |test result|passed|max \|" 
    summary+=("tests: $(grep -E '^test result' "$out/gpu-tests.log" | tail -1)")
    ;;
  bench)
    m=$models/smollm2-arch-fp16-cuda
    # Prompt 128 + 256 new tokens (the peers' setting), graphs on and off.
    for g in on off; do
      "$KILN" bench decode "$m" --batch 1 --batch 8 --graph $g --runs 3 --json "$out/decode-$g.json" 2>&1 |
        tee "$out/decode-$g.log"
    done
    # Context: prompt 128 and 3840 at one cache size (4096 positions).
    for p in 128 3840; do
      "$KILN" bench decode "$m" --batch 1 --batch 8 --graph on --runs 3 --prompt-len $p --max-length 4096 \
        --json "$out/decode-ctx$p.json" 2>&1 | tee "$out/decode-ctx$p.log"
    done
    summary+=("bench: $(grep -hE '^\| [0-9]' "$out"/decode-*.log | tr '\n' ' ')")
    ;;
  peers)
    py=.gpu/device-fixtures/bench_torch_decode.py
    python3 $py --json "$out/torch.json" --md "$out/torch.md" >"$out/torch.log" 2>&1
    python3 $py --methods compile --batches 1 --json "$out/torch-compile-b1.json" >>"$out/torch.log" 2>&1
    python3 $py --methods compile --batches 8 --json "$out/torch-compile-b8.json" >>"$out/torch.log" 2>&1
    python3 $py --table "$out/torch.json" "$out"/torch-compile-b*.json | tee "$out/torch-table.md"
    ;;
  profile)
    for b in 1 8; do
      ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
        --launch-skip 1300 --launch-count 460 "$KILN" bench decode "$models/smollm2-arch-fp16-cuda" --batch $b \
        --graph off --runs 1 --new-tokens 8 >"$out/ncu-b$b.csv" 2>"$out/ncu-b$b.err"
    done
    summary+=("profile: $(wc -l "$out"/ncu-b*.csv | tail -1)")
    ;;
  sanitize)
    compute-sanitizer --tool memcheck "$KILN" generate "$KILN_FIXTURES/llm/tiny-llama-v512-fp16-cuda" \
      --prompt "Once upon a time" --max-new-tokens 24 --graph on --report 2>&1 | tee "$out/sanitizer.log" | tail -25
    summary+=("sanitizer: $(grep -E 'ERROR SUMMARY' "$out/sanitizer.log")")
    ;;
  esac
  echo "phase $phase: $(($(date +%s) - t0)) s"
done
printf '%s\n' "${summary[@]}"
