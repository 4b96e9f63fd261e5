#!/usr/bin/env bash
# On the GPU machine, from the repository root, after `scripts/stage-gpu.sh` here: checks and
# times kiln in one call. Phases (any of them, in this order):
#   tests      the GPU tests (tests/gpu.rs), all of them
#   verify     kiln verify of every built-in package with node tests on the GPU (each claimed op,
#              opset and dtype on random inputs and node tests, against the CPU reference), more
#              than 10 minutes: VERIFY_PACKAGES="kiln-quant kiln-conv" picks some; no models built
#              when it runs alone or with quick
#   int4       the SmolLM2-architecture int4 CUDA folder (MatMulNBits weights, fp16 activations; the
#              model builder's `-p int4 -e cuda`, made once per machine with its onnxruntime-CPU
#              reference of the same graph, `--ref-only`), its GPU test, the 4-bit linear-op test, and
#              kiln bench decode (graphs on, batch 1 and 8) fused, with --constant-inputs off, --no-fuse,
#              and with each package folder in .gpu/variants/* as a drop-in (its greedy text checked
#              against the built-in packages')
#   quick      the GPU tests that need no SmolLM2-architecture model (those are skipped by name),
#              without building the models when it is the only phase: kernels, node tests,
#              tiny-llama, attention, graphs and memory
#   bench      kiln bench decode: graphs on and off at prompt 128 + 256 new tokens, batch 1 and 8,
#              graphs on with a row-major KV cache (--paged-kv off), and unfused with graphs off
#              (the first eager path);
#              prompt 128 and 3840 at one cache size (4096 positions); a streamed kiln generate;
#              kiln run of the example 20 times with graphs on
#   linear     the decode linear layers: their GPU test, kiln verify kiln-matmul on the GPU, and
#              kiln bench decode (graphs on, batch 1 and 8) fused, with --pdl off, and --no-fuse
#   fusion     kiln bench decode with --no-fuse (graphs on, batch 1 and 8) and kiln verify of the
#              fusing package on the GPU (each declared fusion fused against the unfused ops)
#   serve      the load benchmark of kiln serve (bench/serve_load.py: 1, 8, 32, 64 streaming
#              clients, twice: device memory and RSS after each level, --batch 64, graphs on) beside
#              kiln bench decode --batch 64 in the same run
#   python     the Python package's tests (python/tests, the wheel staged in .gpu/python) with
#              the CUDA provider
#   sanitize   compute-sanitizer memcheck over a graph decode
#   peers      PyTorch eager, CUDA graph and torch.compile on the same architecture
#              (PEER_METHODS=graph leaves PyTorch eager out: about 45 s less)
#   profile    ncu: GPU time of every kernel of one eager decode step (batch 1 and 8, cache of 384
#              positions as in the bench rows) of the fp16 folder, or of PROFILE_MODEL (a folder path)
#   prefill    ncu: GPU time by kernel of a batch-64 prefill (128-token prompts)
#   ab         kiln bench decode (graphs on, batch 1 and 8, prompt 128 and 3840 of a 4096 cache; AB_PROMPTS
#              and AB_MAX_LENGTH change them) with
#              the built-in packages, with them and --constant-inputs off, then with each package
#              folder in .gpu/variants/* as a drop-in
#              (a drop-in outranks the built-in package of its name): an A/B of kernel changes
#   floor      bench/stage_floor.cu (nvcc): µs per dependent stage of a graph of small kernels, plain,
#              with programmatic dependent launch, and as grid barriers inside one persistent kernel
#   layer      bench/layer_probe.cu (nvcc): 30 decoder layers of the five fused decode kernels in one
#              graph, batch 1 and 8, after checking attention against float64: µs per layer, the
#              per-kernel timeline of one replay and attention's phases per block (global timer),
#              the SM clock, the step without the O projection, attention under programmatic
#              dependent launch (its wait at the start, or after the K/V loads), every layer on one
#              L2-resident K/V cache, attention with a compile-time head size and group, O +
#              residual + RMS norm + gate·up as one cluster kernel (and down + QKV too: three
#              kernels per layer), and the same with the linear.cu of each variant in
#              .gpu/variants/*; LAYER_FLAGS adds nvcc -D flags to every build;
#              LAYER_SPECS="name:flags;…" runs only those builds, LAYER_ROUNDS times over (O and
#              down with K split over a cluster, slower in session 30: "splitk-4:-DLP_SPLITK=4")
#   probe      bench/attn_probe.cu (nvcc): decode attention alone, the decode kernels (batch 1 at a
#              384 cache, the cluster rows one at 2048, kiln_gqa_decode at 4096 beside
#              kiln_gqa_decode_cluster16_rows at batch 1 and 4; the tiled one at batch 8
#              over 4096, 256 and 128 keys per block, and with its K/V left in L2), GPU time
#              and the error against float64; PROBE_OLD=path/attention.cu adds that source's tiled rows;
#              then bench/prefill_probe.cu: prompt attention on tensor cores beside kiln_gqa_prefill
#   bw         bench/bw_probe.cu (nvcc): how fast one kernel reads a batch-8 layer's 24 MiB K/V cache,
#              by access pattern, after a clean and after a dirty L2 flush
#   attn       decode attention variants (built-in, .gpu/variants/*): bench rows and ncu at context 3840
#   longctx    ncu: time, DRAM throughput, occupancy and stalls of the decode attention kernels at
#              batch 8, context 3840
#   sanitize-ops  compute-sanitizer memcheck over node tests of every op added for issue 11 (seven
#              conformance processes, --filter lists)
#   conv       convolutions through cuDNN: where cuDNN is, its GPU test (against the CPU, and the
#              fallback with --cudnn off), the node tests on CUDA, the small real models, and
#              kiln run --report of MobileNetV3 with cuDNN and without
#   models     bench/model_peers.py: ResNet-50 and BERT-base at batch 1 and 32, float32 and float16,
#              kiln bench run beside PyTorch eager and torch.compile (MODEL_PEERS="--methods
#              kiln,eager --batches 1" and the like narrow it)
#   encoder    BERT-base fp16 at batch 1 (bench/model_peers.py's export; ENCODER="fp32 32" picks
#              another dtype and batch): kiln on the GPU against kiln's CPU run of the same file, its
#              time, and ncu's table of its kernels (one eager run)
#   convnet    ResNet-50 fp16 at batch 1 (bench/model_peers.py's export): its time with
#              --channels-last off and auto (alternated), each against kiln's CPU run of the file,
#              and ncu's table of its kernels (one eager run) with each
#   big        the five full-size real models of scripts/make-big-models.py against onnxruntime
#   cpu        the fast CPU path beside onnxruntime's CPU provider at 16 threads and 1 (CPU_THREADS,
#              default "16 1", picks the thread counts)
#              (scripts/bench-cpu.py: MatMul 1024³ and resnet50, made by scripts/make-big-models.py),
#              resnet50's host time by op at 16 threads, and int4 decode (the builder's `-p int4 -e cpu`
#              SmolLM2-architecture folder, made once per machine) beside bench/ort_decode_cpu.py,
#              then int4 decode at 16 threads with KILN_CPU_HOT_SPIN_US=0 (no spinning pool threads)
#              and the default, and at 16 and 8 threads with KILN_CPU_SHARE=1 and 0, alternated (CPU_AB=0
#              leaves these two A/Bs out)
#   cpu-profile  where a CPU int4 decode step's time goes: the int4 CPU folder's host time by op at
#              1 and 16 threads (kiln bench decode --profile), and where `perf` is on the machine a
#              16-thread perf record of KILN_PROF (a kiln binary with symbols; .gpu/kiln-sym.xz
#              when staged, else $KILN): the top functions, and the graph thread's apart
#   cpu-nodes  where a node's CPU time goes at 1, 4 and 16 threads, beside onnxruntime: the chains
#              of bench/cpu_node_models.py (p50 of kiln bench run against onnxruntime's, and at 16
#              threads with KILN_CPU_TASK_KB=32 (the default), 0 (the old split) and 1024 (one task a
#              product) and KILN_CPU_SHARE=1, for KILN_AB's binary too), then the int4 CPU folder's
#              decode at 16 threads with those pool settings (alternated, twice) and its host time
#              by op at 16 and 1 threads, split into shim calls and the host's products
#              (`--profile`); KILN_AB (a second kiln binary, e.g. the last commit's) joins the
#              decode rows
# At most 8 files come back from the machine, so $OUT (or ./gpu-out) gets one log per phase
# and the JSON in tar files; the last lines printed are a summary.
set -uo pipefail
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
work=/tmp/kiln-check
rm -rf "$work" && mkdir -p "$work"
phases="${*:-tests bench}"
source .gpu/setup.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.used --format=csv | tee "$out/gpu.txt"
models=/tmp/kiln-models
m=$models/smollm2-arch-fp16-cuda
needs_models=0
for phase in $phases; do case "$phase" in quick | convnet | verify | floor | layer | probe | bw | cpu | cpu-nodes | cpu-profile | sanitize-ops | big | conv | models | encoder | int4) ;; *) needs_models=1 ;; esac; done
if [ "$needs_models" = 1 ] && [ ! -f "$models/reference/smollm2-arch-ref.json" ]; then
  t0=$(date +%s)
  bash .gpu/device-fixtures/make-smollm2-arch.sh "$models" --results "$work/make" >"$work/make.log" 2>&1 ||
    { tail -30 "$work/make.log"; exit 1; }
  echo "models built in $(($(date +%s) - t0)) s"
fi
# build_folder PRECISION EP: the model builder's `-p PRECISION -e EP` folder of the SmolLM2-135M
# architecture (random weights, the HF model made first where missing) in $models/smollm2-arch-PRECISION-EP.
build_folder() {
  (cd .gpu/device-fixtures && PYTHONPATH=. python3 - "$models" "$1" "$2" <<'PYEOF'
import os, sys
import make_smollm2_arch as m
out, precision, ep = sys.argv[1:4]
hf = os.path.join(out, "hf", f"{m.NAME}-random")
if not os.path.isfile(os.path.join(hf, "config.json")):
    m.make_hf(hf, m.INIT_RANGE)
m.build(hf, os.path.join(out, f"{m.NAME}-{precision}-{ep}"), precision, ep, os.path.join(out, f".cache-{precision}-{ep}"))
PYEOF
  )
}
# kiln_export MODEL DIR LOG [DTYPE BATCH]: bench/model_peers.py's export of MODEL (resnet50,
# bert_base) at DTYPE (fp16) and BATCH (1) into DIR as DIR/MODEL-DTYPE-bBATCH.onnx, and kiln's time
# of it, written to LOG.
kiln_export() {
  python3 bench/model_peers.py --kiln "$KILN" --out "$2" --methods kiln --models "$1" --dtypes "${4:-fp16}" \
    --batches "${5:-1}" 2>&1 | grep -E ' ms ' | tee "$3"
}
# ncu_table LABEL PREFIX CMD...: ncu's GPU time of every kernel of CMD (a kiln run of --runs 2), the
# second run's kernels summed by name, the 12 largest printed; the CSV is kept at PREFIX.csv.
ncu_table() {
  local label=$1 prefix=$2
  shift 2
  ncu --cache-control none --clock-control none --print-units base --metrics gpu__time_duration.sum --csv \
    "$@" >"$prefix.csv" 2>/dev/null
  python3 - "$prefix.csv" "$label" <<'PYEOF'
import collections, csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
h = rows[0]
ki, vi = h.index("Kernel Name"), h.index("Metric Value")
data = [(r[ki], float(r[vi].replace(",", ""))) for r in rows[1:] if r[vi].replace(",", "").replace(".", "").isdigit()]
second = data[len(data) // 2:]  # the second of the two runs
t = collections.defaultdict(lambda: [0, 0.0])
for k, v in second:
    t[k.split("(")[0][:70]][0] += 1
    t[k.split("(")[0][:70]][1] += v / 1000
print(f"{sys.argv[2]}: {len(second)} kernels, {sum(v for _, v in second) / 1000:.1f} us summed")
for k, (c, us) in sorted(t.items(), key=lambda x: -x[1][1])[:12]:
    print(f"{us:9.1f} us {c:4d}  {k}")
PYEOF
}
summary=()
for phase in $phases; do
  t0=$(date +%s)
  case "$phase" in
  tests)
    # The int4 folder's test runs where `int4` made its folder (earlier in this call or on this
    # warm machine); it is skipped by name otherwise, and says so.
    skips=()
    if [ ! -f "$models/reference/smollm2-arch-int4-cuda-ref.json" ]; then
      skips=(--skip smollm2_arch_int4)
      echo "tests: smollm2_arch_int4_on_the_gpu_matches_onnxruntime_on_its_graph skipped (run the int4 phase first)"
    fi
    # The big real models' test runs where KILN_BIG_MODELS names them (set, or the big phase earlier
    # in this call); skipped by name otherwise.
    if [ -z "${KILN_BIG_MODELS:-}" ]; then
      skips+=(--skip big_real_models)
      echo "tests: big_real_models_match_onnxruntime_on_the_gpu skipped (set KILN_BIG_MODELS, or run the big phase before it)"
    fi
    "$GPU_TESTS" --include-ignored --test-threads 1 --nocapture "${skips[@]}" 2>&1 | tee "$out/gpu-tests.log" | grep -E "^test .*(ok|FAILED)$|test result"
    summary+=("tests: $(grep -E '^test result' "$out/gpu-tests.log" | tail -1)")
    ;;
  bench)
    for g in on off; do
      "$KILN" bench decode "$m" --batch 1 --batch 8 --graph $g --runs 3 --json "$work/decode-$g.json" 2>&1
    done | tee "$out/bench.log"
    # The KV cache in the pool's row-major buffers instead of pages (graphs on), to compare.
    "$KILN" bench decode "$m" --batch 1 --batch 8 --graph on --paged-kv off --runs 3 \
      --json "$work/decode-rowmajor.json" 2>&1 | tee -a "$out/bench.log"
    # The eager path the decode-graph issue measured first (no fusion, no graphs: 363 launches
    # per step), beside the rows above in the same run.
    "$KILN" bench decode "$m" --batch 1 --batch 8 --graph off --no-fuse --runs 3 \
      --json "$work/decode-off-nofuse.json" 2>&1 | tee -a "$out/bench.log"
    for p in 128 3840; do
      "$KILN" bench decode "$m" --batch 1 --batch 8 --graph on --runs 3 --prompt-len $p --max-length 4096 \
        --json "$work/decode-ctx$p.json" 2>&1
    done | tee -a "$out/bench.log"
    # The device sampler in the captured step (temperature, top-k 50, top-p 0.9, penalty 1.1).
    "$KILN" bench decode "$m" --batch 1 --batch 8 --graph on --runs 3 --temperature 0.8 --top-p 0.9 \
      --repetition-penalty 1.1 --json "$work/decode-sampled.json" 2>&1 | tee -a "$out/bench.log"
    tar -C "$work" -cf "$out/bench-json.tar" $(cd "$work" && ls decode-*.json)
    # kiln generate streams its tokens through the same Generator path.
    "$KILN" generate "$m" --prompt "Once upon a time" --max-new-tokens 256 --graph on --report 2>&1 |
      tail -40 >"$out/generate.log"
    # A plain model run many times on the device: one graph replay per run from the third.
    "$KILN" run examples/mlp/model.onnx --input x=examples/mlp/x.npy --expect probs=examples/mlp/expected.npy \
      --output-dir "$work/run-out" --runs 20 --graph on 2>&1 | tail -3 >"$out/run.log"
    summary+=("run: $(tr '\n' ' ' <"$out/run.log")")
    summary+=("bench: $(grep -hE '^\| [0-9]' "$out/bench.log" | tr '\n' ' ')")
    summary+=("generate: $(grep -E 'decode .* tokens/s' "$out/generate.log")")
    ;;
  linear)
    "$GPU_TESTS" --include-ignored --test-threads 1 linear_ops 2>&1 | tee "$out/linear.log" | grep -E "^test |test result|panicked"
    "$KILN" verify kiln-matmul --device cuda --seeds 2 2>&1 | tail -18 | tee -a "$out/linear.log"
    for args in "" "--pdl off" "--no-fuse"; do
      echo "== bench decode $args"
      "$KILN" bench decode "$m" --batch 1 --batch 8 --graph on --runs 3 $args --report 2>&1
    done | tee -a "$out/linear.log" | grep -E "^==|^\| [0-9]|graphs:|fusions:"
    summary+=("linear: $(grep -E 'test result' "$out/linear.log" | tail -1); $(grep -E '^verify kiln-matmul' "$out/linear.log")")
    summary+=("linear bench: $(grep -hE '^==|^\| [0-9]' "$out/linear.log" | tr '\n' ' ')")
    ;;
  fusion)
    "$KILN" bench decode "$m" --batch 1 --batch 8 --graph on --no-fuse --runs 3 --json "$work/decode-nofuse.json" 2>&1 |
      tee "$out/fusion.log"
    "$KILN" verify kiln-unary --device cuda --seeds 1 2>&1 | tail -12 | tee -a "$out/fusion.log"
    summary+=("unfused: $(grep -hE '^\| [0-9]' "$out/fusion.log" | tr '\n' ' ')")
    summary+=("$(grep -E '^verify kiln-unary' "$out/fusion.log")")
    ;;
  serve)
    "$KILN" bench decode "$m" --batch 64 --graph on --runs 3 --prompt-len 128 --new-tokens 256 --max-length 512 \
      --json "$work/decode-b64.json" 2>&1 | tee "$out/serve.log"
    python3 bench/serve_load.py --kiln "$KILN" --model "$m" --batch 64 --max-length 512 --max-tokens 256 \
      --repeat 2 --extra "--graph on" --json "$work/serve-load.json" 2>&1 | tail -16 | tee -a "$out/serve.log"
    # What --batch-invariant costs (each request prefilled alone).
    echo "== --batch-invariant" | tee -a "$out/serve.log"
    python3 bench/serve_load.py --kiln "$KILN" --model "$m" --batch 64 --max-length 512 --max-tokens 256 \
      --clients 1 64 --extra "--graph on --batch-invariant" --json "$work/serve-load-invariant.json" 2>&1 |
      tail -4 | tee -a "$out/serve.log"
    tar -C "$work" -cf "$out/serve-json.tar" decode-b64.json serve-load.json serve-load-invariant.json
    summary+=("serve: $(grep -hE '^==|^\| [0-9]' "$out/serve.log" | tr '\n' ' ')")
    ;;
  python)
    rm -rf /tmp/kiln-py && mkdir -p /tmp/kiln-py
    python3 -c 'import glob, zipfile
for w in glob.glob(".gpu/python/*.whl"):
    zipfile.ZipFile(w).extractall("/tmp/kiln-py")'
    PYTHONPATH=/tmp/kiln-py python3 -m pytest -q -rs -p no:cacheprovider python/tests 2>&1 | tee "$out/python.log" | tail -15
    summary+=("python: $(tail -1 "$out/python.log")")
    ;;
  sanitize)
    # Memory errors, with API errors left out: loading a kernel probes cuFuncGetParamInfo one
    # parameter past its signature, which the driver answers CUDA_ERROR_INVALID_VALUE (the end of
    # the list); the second run counts the API errors by call, so that any other one shows.
    gen=("$KILN" generate "$KILN_FIXTURES/llm/tiny-llama-v512-fp16-cuda" --prompt "Once upon a time" \
      --max-new-tokens 40 --graph on --report)
    compute-sanitizer --tool memcheck --report-api-errors no "${gen[@]}" 2>&1 | tail -40 >"$out/sanitizer.log"
    compute-sanitizer --tool memcheck --print-limit 10000 "${gen[@]}" 2>&1 |
      grep -oE "Program hit [A-Z_]+ .* on CUDA API call to [A-Za-z_0-9]+" | sort | uniq -c >"$out/sanitizer-api.log"
    # The device sampler (Sample node in the captured step) under memcheck too.
    compute-sanitizer --tool memcheck --report-api-errors no "${gen[@]}" --temperature 0.8 --top-k 40 \
      --top-p 0.9 --repetition-penalty 1.2 --seed 1 2>&1 | tail -40 >"$out/sanitizer-sampled.log"
    # Every token a candidate (more than the kernel sorts on chip: it selects by mass).
    compute-sanitizer --tool memcheck --report-api-errors no "${gen[@]}" --temperature 1.2 --top-k 0 \
      --top-p 0.95 --seed 3 2>&1 | tail -40 >"$out/sanitizer-all-tokens.log"
    summary+=("sanitizer (memory): $(grep -E 'ERROR SUMMARY' "$out/sanitizer.log")")
    summary+=("sanitizer (memory, top-k 0): $(grep -E 'ERROR SUMMARY' "$out/sanitizer-all-tokens.log")")
    summary+=("sanitizer (memory, sampled): $(grep -E 'ERROR SUMMARY' "$out/sanitizer-sampled.log")")
    summary+=("sanitizer (API errors by call): $(tr -s ' \n' ' ' <"$out/sanitizer-api.log")")
    ;;
  peers)
    py=.gpu/device-fixtures/bench_torch_decode.py
    {
      python3 $py --methods "${PEER_METHODS:-eager,graph}" --json "$work/torch.json" --md "$work/torch.md"
      python3 $py --methods compile --batches 1 --json "$work/torch-compile-b1.json"
      python3 $py --methods compile --batches 8 --json "$work/torch-compile-b8.json"
      python3 $py --table "$work/torch.json" "$work"/torch-compile-b*.json
    } >"$out/torch.log" 2>&1
    tar -C "$work" -cf "$out/torch-json.tar" $(cd "$work" && ls torch*.json torch.md 2>/dev/null)
    tail -20 "$out/torch.log"
    ;;
  profile)
    for b in 1 8; do
      ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
        --launch-skip 1300 --launch-count 460 "$KILN" bench decode "${PROFILE_MODEL:-$m}" --batch $b \
        --graph off --runs 1 --new-tokens 8 --max-length 384 >"$work/ncu-b$b.csv" 2>"$work/ncu-b$b.err"
    done
    tar -C "$work" -cf "$out/ncu.tar" ncu-b1.csv ncu-b8.csv
    ;;
  sanitize-ops)
    # compute-sanitizer memcheck over node tests of the ops added since the decode work (issue 11:
    # at least one per new op), in a few conformance processes rather than one per op.
    groups=(
      "test_conv,test_convtranspose,test_col2im,test_maxpool,test_averagepool,test_lppool,test_globalaveragepool,test_globalmaxpool,test_maxunpool"
      "test_lstm,test_gru,test_rnn,test_einsum,test_dft,test_lrn,test_reversesequence,window,test_prelu,test_swish"
      "test_resize,test_upsample,test_gridsample,test_affine_grid,test_batchnorm,test_instancenorm,test_group_normalization,test_depthtospace,test_spacetodepth,test_tile,test_center_crop_pad"
      "test_if,test_loop,test_scan,test_sequence,test_optional,test_split_to_sequence,test_concat_from_sequence"
      "test_quantizelinear,test_dequantizelinear,test_dynamicquantizelinear,test_qlinearmatmul,test_matmulinteger,test_nllloss,test_sce,test_attention,test_rotary_embedding,test_rms_normalization"
      "test_nonzero,test_compress,test_unique,test_nonmaxsuppression,test_roialign,test_mvn,test_maxunpool,test_det,test_tensorscatter,test_stft,test_melweightmatrix,test_convinteger,test_qlinearconv,test_deform_conv,test_basic_deform_conv"
      "test_cast_FLOAT_to_FLOAT8,test_cast_FLOAT16_to_INT4,test_cast_UINT2,test_cast_FLOAT_to_FLOAT4E2M1,test_cast_e8m0,test_cast_no_saturate,test_castlike_FLOAT_to_FLOAT8E4M3FN"
    )
    for g in "${groups[@]}"; do
      compute-sanitizer --tool memcheck --report-api-errors no "$KILN" conformance .cache/onnx-node-1.20.0/node --device cuda \
        --filter "$g" 2>&1 | grep -E "^conformance:|ERROR SUMMARY|Invalid|out of bounds" | head -12
    done | tee "$out/sanitize-ops.log"
    summary+=("sanitize-ops: $(grep -E 'ERROR SUMMARY|^conformance:' "$out/sanitize-ops.log" | tr '\n' ' ')")
    ;;
  big)
    # The five full-size real models (scripts/make-big-models.py) against onnxruntime on the GPU.
    (cd scripts && python3 make-big-models.py "$work/big") 2>&1 | tail -3
    export KILN_BIG_MODELS="$work/big" # for a tests or quick phase after this one
    "$GPU_TESTS" --include-ignored --test-threads 1 --nocapture big_real_models 2>&1 |
      tee "$out/big.log" | tail -15
    summary+=("big: $(grep -E '^test result' "$out/big.log" | tail -1)")
    ;;
  cpu)
    (cd scripts && python3 make-big-models.py "$work/big" resnet50) 2>&1 | tail -2
    for t in ${CPU_THREADS:-16 1}; do
      python3 scripts/bench-cpu.py --kiln "$KILN" --threads "$t" "$work/big/resnet50" 2>&1
    done | tee "$out/cpu.log"
    # Where ResNet-50's time goes at 16 threads: host time by op.
    KILN_CPU_THREADS=16 "$KILN" run "$work/big/resnet50/model.onnx" --device cpu --runs 20 --report \
      --input images="$work/big/resnet50/test_data_set_0/input_0.pb" --output-dir "$work/cpu-out" 2>&1 |
      sed -n '/^ops/,$p' | head -14 | tee -a "$out/cpu.log"
    # int4 decode beside onnxruntime's CPU provider on the same folder (the builder's `-p int4 -e
    # cpu` of the SmolLM2-135M architecture, random weights): prompt 16, 32 new tokens.
    i4c=$models/smollm2-arch-int4-cpu
    if [ ! -f "$i4c/model.onnx" ]; then
      build_folder int4 cpu >"$work/int4-cpu-make.log" 2>&1 || tail -20 "$work/int4-cpu-make.log"
    fi
    [ -f "$i4c/model.onnx" ] && for t in ${CPU_THREADS:-16 1}; do
      echo "== int4 CPU decode, $t threads"
      KILN_CPU_THREADS=$t "$KILN" bench decode "$i4c" --device cpu --prompt-len 16 --new-tokens 32 --runs 3 2>&1 |
        grep -E "^\| [0-9]|[Ee]rror"
      python3 bench/ort_decode_cpu.py "$i4c" --threads $t --prompt-len 16 --new-tokens 32 --runs 3 2>&1 | tail -1
    done | tee -a "$out/cpu.log"
    # The kept-hot pool's A/B at 16 threads: no spinning threads (KILN_CPU_HOT_SPIN_US=0), then
    # the default again (CPU_AB=0 leaves this and the next A/B out).
    [ -f "$i4c/model.onnx" ] && [ "${CPU_AB:-1}" != 0 ] && for v in 0 2000; do
      echo "== int4 CPU decode, 16 threads, KILN_CPU_HOT_SPIN_US=$v"
      KILN_CPU_HOT_SPIN_US=$v KILN_CPU_THREADS=16 "$KILN" bench decode "$i4c" --device cpu --prompt-len 16 \
        --new-tokens 32 --runs 3 2>&1 | grep -E "^\| [0-9]|[Ee]rror"
    done | tee -a "$out/cpu.log"
    # The decode products shared out to the kept-hot threads by one counter (cpu_share) against
    # rayon's tasks, at 16 and 8 threads, alternated.
    [ -f "$i4c/model.onnx" ] && [ "${CPU_AB:-1}" != 0 ] && for t in 16 8; do for v in 1 0 1 0; do
      echo "== int4 CPU decode, $t threads, KILN_CPU_SHARE=$v"
      KILN_CPU_SHARE=$v KILN_CPU_THREADS=$t "$KILN" bench decode "$i4c" --device cpu --prompt-len 16 \
        --new-tokens 32 --runs 3 2>&1 | grep -E "^\| [0-9]|[Ee]rror"
    done; done | tee -a "$out/cpu.log"
    summary+=("cpu: $(grep -E '^\| (MatMul|resnet50)|^==|^\| 1 \(1\)|^onnxruntime' "$out/cpu.log" | tr '\n' ' ')")
    ;;
  cpu-nodes)
    python3 bench/cpu_node_models.py make "$work/nodes" >"$work/nodes.log" 2>&1 ||
      { echo "cpu-nodes: bench/cpu_node_models.py make failed"; tail -5 "$work/nodes.log"; }
    for m in chain60_576x576 mlp30 swiglu30 normlin30 one_576x49152; do
      for t in 1 4 16; do
        echo "== $m, $t threads: kiln $(KILN_CPU_THREADS=$t "$KILN" bench run "$work/nodes/$m.onnx" --device cpu --runs 200 \
          --warmup 20 2>&1 | grep -oE 'p50 [0-9.]+') ms; $(python3 bench/cpu_node_models.py ort "$work/nodes/$m.onnx" $t)"
      done
      # At 16 threads: the default (tasks of at least 32 KiB), the old split (0), one task a
      # product (1024: no parallel section), the shared counter; KILN_AB's binary beside this one.
      for b in "$KILN" ${KILN_AB:-}; do
        for v in KILN_CPU_TASK_KB=32 KILN_CPU_TASK_KB=0 KILN_CPU_TASK_KB=1024 KILN_CPU_SHARE=1; do
          # shellcheck disable=SC2086
          echo "== $m, 16 threads, $v, $b: kiln $(env $v KILN_CPU_THREADS=16 "$b" bench run "$work/nodes/$m.onnx" \
            --device cpu --runs 200 --warmup 20 2>&1 | grep -oE 'p50 [0-9.]+') ms"
        done
      done
    done 2>&1 | tee "$out/cpu-nodes.log"
    i4c=$models/smollm2-arch-int4-cpu
    if [ ! -f "$i4c/model.onnx" ]; then
      build_folder int4 cpu >"$work/int4-cpu-make.log" 2>&1 || tail -20 "$work/int4-cpu-make.log"
    fi
    # decode BINARY ENV...: ms/step of the int4 CPU folder, prompt 16 + 64 new tokens, medians of 3.
    decode() {
      local b=$1
      shift
      env "$@" "$b" bench decode "$i4c" --device cpu --prompt-len 16 --new-tokens 64 --runs 3 2>&1 |
        grep -E "^\| [0-9]" | cut -d'|' -f4
    }
    [ -f "$i4c/model.onnx" ] && {
      python3 bench/ort_decode_cpu.py "$i4c" --threads 16 --prompt-len 16 --new-tokens 64 --runs 3 2>&1 | tail -1
      for round in 1 2; do
        [ -n "${KILN_AB:-}" ] && echo "== decode, 16 threads, $KILN_AB: $(decode "$KILN_AB" KILN_CPU_THREADS=16)"
        for v in KILN_CPU_SHARE=0 KILN_CPU_SHARE=1 KILN_CPU_TASK_KB=0 "KILN_CPU_SHARE=1 KILN_CPU_TASK_KB=0" \
          KILN_CPU_HOT_SPIN_US=0; do
          # shellcheck disable=SC2086
          echo "== decode, 16 threads, $v (round $round): $(decode "$KILN" KILN_CPU_THREADS=16 $v)"
        done
      done
      for t in 16 1; do
        echo "== int4 CPU decode, $t threads, host time by op"
        KILN_CPU_THREADS=$t "$KILN" bench decode "$i4c" --device cpu --prompt-len 16 --new-tokens 64 --runs 3 --profile 2>&1 |
          grep -E "^\| [0-9]|^  [A-Z][A-Za-z]+ +[0-9]+ +[0-9.]+ ms" | head -9
      done
      python3 bench/ort_decode_cpu.py "$i4c" --threads 1 --prompt-len 16 --new-tokens 64 --runs 3 2>&1 | tail -1
    } 2>&1 | tee -a "$out/cpu-nodes.log"
    summary+=("cpu-nodes: $(grep -E '^== decode' "$out/cpu-nodes.log" | tr '\n' ' ')")
    ;;
  cpu-profile)
    i4c=$models/smollm2-arch-int4-cpu
    if [ ! -f "$i4c/model.onnx" ]; then
      build_folder int4 cpu >"$work/int4-cpu-make.log" 2>&1 || tail -20 "$work/int4-cpu-make.log"
    fi
    prof=$KILN
    if [ -f .gpu/kiln-sym.xz ]; then
      python3 -c 'import lzma,sys; open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' .gpu/kiln-sym.xz "$work/kiln-sym" &&
        chmod +x "$work/kiln-sym" && prof=$work/kiln-sym
    fi
    prof=${KILN_PROF:-$prof}
    for t in 1 16; do
      echo "== int4 CPU decode, $t threads, host time by op"
      KILN_CPU_THREADS=$t "$KILN" bench decode "$i4c" --device cpu --prompt-len 16 --new-tokens 32 --runs 2 --profile 2>&1 |
        grep -E "^\| [0-9]|^  [A-Z][A-Za-z]+ +[0-9]+ +[0-9.]+ ms" | head -9
    done | tee "$out/cpu-profile.log"
    if command -v perf >/dev/null; then
      KILN_CPU_THREADS=16 perf record -F 999 -g -o "$work/perf.data" "$prof" bench decode "$i4c" --device cpu \
        --prompt-len 16 --new-tokens 64 --runs 2 2>&1 | grep -E "^\| [0-9]"
      { echo "== perf, 16 threads: all threads"
        perf report -i "$work/perf.data" --no-children --sort sym --stdio -g none 2>/dev/null | grep -E "^ +[0-9]" | head -30
        echo "== perf, 16 threads: by thread"
        perf report -i "$work/perf.data" --no-children --sort comm --stdio -g none 2>/dev/null | grep -E "^ +[0-9]" | head -6
        graph=$(perf report -i "$work/perf.data" --no-children --sort comm,sym --stdio -g none 2>/dev/null |
          grep -E "run_nodes_here" | awk '{print $2}' | head -1)
        echo "== perf, 16 threads: the graph thread ($graph)"
        [ -n "$graph" ] && perf report -i "$work/perf.data" --no-children --comms "$graph" --sort sym --stdio -g none 2>/dev/null |
          grep -E "^ +[0-9]" | head -30
      } | tee -a "$out/cpu-profile.log"
    else
      echo "no perf on this machine" | tee -a "$out/cpu-profile.log"
    fi
    summary+=("cpu-profile: $(grep -cE '^ +[0-9]' "$out/cpu-profile.log") profile rows")
    ;;
  verify)
    # kiln-sampling's ops (ai.kiln) have no node tests: the device-sampling GPU test covers them.
    # VERIFY_PACKAGES picks some of them (all take more than one call's 10 minutes together).
    for p in ${VERIFY_PACKAGES:-kiln-unary kiln-binary kiln-cast kiln-matmul kiln-reduce kiln-normalization kiln-tensor \
      kiln-quant kiln-attention kiln-conv kiln-pool kiln-image kiln-rnn kiln-loss}; do
      "$KILN" verify "$p" --device cuda --seeds 1 2>&1 | grep -v '  ok$' | tail -12
    done | tee "$out/verify.log"
    summary+=("$(grep -E '^verify kiln-' "$out/verify.log" | tr '\n' ' ')")
    ;;
  conv)
    { find / -name 'libcudnn.so.9*' -not -path '*/proc/*' 2>/dev/null | head -3
      find / -name 'libcublasLt.so*' -not -path '*/proc/*' 2>/dev/null | head -3; } | tee "$out/conv.log"
    "$GPU_TESTS" --include-ignored --test-threads 1 --nocapture convolutions_run onnx_node_tests_that small_real_models 2>&1 |
      tee -a "$out/conv.log" | grep -E "^cuDNN|^conformance:|^test .*(ok|FAILED)$|test result|panicked|assert"
    mn=tests/real-models/mobilenet_v3_small_64
    in=$(python3 -c "import onnx; print(onnx.load('$mn/model.onnx').graph.input[0].name)")
    for c in auto off; do
      "$KILN" run "$mn/model.onnx" --input "$in=$mn/test_data_set_0/input_0.pb" --output-dir "$work/mn-$c" \
        --device cuda --cudnn $c --runs 20 --report 2>&1 | grep -E "runs in|convolutions|on the package|rror" | head -6
    done | tee -a "$out/conv.log"
    summary+=("conv: $(grep -E '^test result' "$out/conv.log" | tail -1)")
    ;;
  encoder)
    ew=$work/encoder && mkdir -p "$ew"
    read -r edt eb <<<"${ENCODER:-fp16 1}"
    kiln_export bert_base "$ew" "$out/encoder.log" "$edt" "$eb"
    python3 -c "
import numpy as np
np.save('$ew/ids.npy', np.random.default_rng(0).integers(0, 30522, ($eb, 128)).astype(np.int64))
np.save('$ew/mask.npy', np.ones(($eb, 128), np.int64))"
    em=$ew/bert_base-$edt-b$eb.onnx
    ein=(--input input_ids="$ew/ids.npy" --input attention_mask="$ew/mask.npy")
    for d in cpu cuda; do "$KILN" run "$em" --device $d "${ein[@]}" --output-dir "$ew/out-$d" -q 2>&1 | tail -2; done
    python3 -c "
import numpy as np
a = np.load('$ew/out-cpu/last_hidden_state.npy').astype(np.float64)
b = np.load('$ew/out-cuda/last_hidden_state.npy').astype(np.float64)
print('encoder: cuda vs cpu max|d| / max|ref| = %.3e' % (np.abs(a - b).max() / np.abs(a).max()))" | tee -a "$out/encoder.log"
    ncu_table encoder "$ew/ncu" "$KILN" run "$em" --device cuda --graph off --runs 2 "${ein[@]}" --output-dir "$ew/out-ncu" |
      tee -a "$out/encoder.log"
    summary+=("$(grep -E '^bert|^encoder' "$out/encoder.log" | head -3 | tr '\n' ' ')")
    ;;
  convnet)
    cw=$work/convnet && mkdir -p "$cw"
    kiln_export resnet50 "$cw" "$out/convnet.log"
    python3 -c "
import numpy as np
np.save('$cw/x.npy', np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float16))"
    cm=$cw/resnet50-fp16-b1.onnx
    cin=$(python3 -c "import onnx; print(onnx.load('$cm').graph.input[0].name)")
    # Channels-last convolutions against every value NCHW, alternated, then each against the CPU
    # (kiln run --runs 3: the last run a graph replay of the plan).
    for cl in off auto off auto; do
      "$KILN" bench run "$cm" --device cuda --channels-last $cl --warmup 5 --runs 50 2>&1 | grep -E "p50" |
        sed "s/^/convnet channels-last $cl: /" | tee -a "$out/convnet.log"
    done
    "$KILN" run "$cm" --device cpu --input "$cin=$cw/x.npy" --output-dir "$cw/out-cpu" -q
    for cl in auto off; do
      "$KILN" run "$cm" --device cuda --runs 3 --channels-last $cl --report --input "$cin=$cw/x.npy" \
        --output-dir "$cw/out-$cl" 2>&1 | grep -E "^convolutions|channels-last|captured" | sed "s/^/convnet $cl: /" |
        tee -a "$out/convnet.log"
      python3 -c "
import numpy as np
a = np.load('$cw/out-cpu/logits.npy').astype(np.float64).ravel()
b = np.load('$cw/out-$cl/logits.npy').astype(np.float64).ravel()
t5 = lambda v: list(np.argsort(-v)[:5])
print('convnet $cl: cuda vs cpu max|d| / max|ref| = %.3e, top-5 %s' % (np.abs(a - b).max() / np.abs(a).max(), 'same' if t5(a) == t5(b) else 'DIFFERENT'))" |
        tee -a "$out/convnet.log"
    done
    for cl in auto off; do
      ncu_table "convnet $cl" "$cw/ncu-$cl" "$KILN" run "$cm" --device cuda --graph off --runs 2 --channels-last $cl \
        --input "$cin=$cw/x.npy" --output-dir "$cw/out-ncu" | tee -a "$out/convnet.log"
    done
    summary+=("$(grep -E '^resnet|^convnet (auto|off):' "$out/convnet.log" | tr '\n' ' ')")
    ;;
  models)
    # shellcheck disable=SC2086
    python3 bench/model_peers.py --kiln "$KILN" --out "$work/peers" ${MODEL_PEERS:-} 2>&1 |
      grep -vE "Warning|warn\(|^\s*$" | tee "$out/models.log" | tail -40
    cp "$work/peers/model-peers.json" "$out/" 2>/dev/null
    summary+=("models: $(grep -c ' ms (' "$out/models.log") rows")
    ;;
  int4)
    i4=$models/smollm2-arch-int4-cuda
    if [ ! -f "$models/reference/smollm2-arch-int4-cuda-ref.json" ]; then
      t1=$(date +%s)
      build_folder int4 cuda >"$work/int4-make.log" 2>&1 &&
        bash .gpu/device-fixtures/make-smollm2-arch.sh "$models" --ref-only "$i4" >>"$work/int4-make.log" 2>&1 ||
        { tail -30 "$work/int4-make.log"; exit 1; }
      echo "int4 folder and reference made in $(($(date +%s) - t1)) s"
      du -sh "$i4"
    fi
    "$GPU_TESTS" --include-ignored --test-threads 1 --nocapture smollm2_arch_int4 quantized_linear constant_inputs 2>&1 |
      tee "$out/int4.log" | grep -E "^smollm2|^test .*(ok|FAILED)$|test result|panicked"
    for f in "" "--constant-inputs off" --no-fuse; do
      echo "== int4 bench decode --graph on $f"
      # shellcheck disable=SC2086
      "$KILN" bench decode "$i4" --batch 1 --batch 8 --graph on $f --runs 3 2>&1
    done | tee -a "$out/int4.log" | grep -E "^==|^\||floor" | head -40
    # Each package folder in .gpu/variants as a drop-in, graphs on (an A/B of kernel changes), and
    # its greedy text against the built-in packages' (the same tokens where the variant keeps the
    # arithmetic).
    gen() {
      "$KILN" generate "$i4" --prompt "Once upon a time" --max-new-tokens 64 --greedy --graph on "$@" \
        2>>"$work/int4-generate.log"
    }
    # The built-in packages' text, once, where there are variants.
    base_ok=0
    compgen -G ".gpu/variants/*/" >/dev/null && base=$(gen) && base_ok=1
    for v in .gpu/variants/*; do
      [ -d "$v" ] || continue # no variants: the glob stays unexpanded
      echo "== int4 bench decode --graph on --packages $v"
      "$KILN" bench decode "$i4" --batch 1 --batch 8 --graph on --runs 3 --packages "$v" 2>&1
      if [ "$base_ok" = 0 ] || ! b=$(gen --packages "$v"); then
        echo "$v: greedy text: a generation failed ($(tail -1 "$work/int4-generate.log"))"
      elif [ "$base" = "$b" ]; then echo "$v: the built-in packages' greedy tokens"
      else echo "$v: greedy text differs from the built-in packages'"; fi
    done | tee -a "$out/int4.log" | grep -E "^==|^\||[Ee]rror|greedy"
    summary+=("int4: $(grep -E '^test result' "$out/int4.log" | tail -1)")
    ;;
  quick)
    skip=()
    for t in smollm2 device_sampling soak continuous_batch batch_invariant kv_cache_grow; do skip+=(--skip "$t"); done
    [ -n "${KILN_BIG_MODELS:-}" ] || skip+=(--skip big_real_models) # KILN_BIG_MODELS: set, or the big phase before it
    "$GPU_TESTS" --include-ignored --test-threads 1 --nocapture "${skip[@]}" 2>&1 | tee "$out/gpu-tests.log" |
      grep -E "^test .*(ok|FAILED)$|test result"
    summary+=("quick: $(grep -E '^test result' "$out/gpu-tests.log" | tail -1)")
    ;;
  floor)
    # The cost of one dependent stage of a CUDA graph without kiln (bench/stage_floor.cu).
    nvcc -O3 -arch=sm_90 -o "$work/stage_floor" bench/stage_floor.cu && "$work/stage_floor" | tee "$out/floor.log"
    summary+=("floor: $(grep -E '^\| [0-9]' "$out/floor.log" | tr '\n' ' ')")
    ;;
  layer)
    # Where a decode layer's time goes (bench/layer_probe.cu): each build of `specs`, then run.
    inc="$work/inc" && mkdir -p "$inc/kiln-cuda-std" && cp kernels/cuda-std/include/* "$inc/kiln-cuda-std/" &&
      cp host/cuda/kiln.cuh "$inc/"
    specs=("plain:" "marks:-DLP_MARKS" "no-O:-DLP_NO_O" "attn-pdl:-DLP_ATTN_PDL"
      "attn-pdl-early:-DLP_ATTN_PDL -DLP_ATTN_EARLY" "kv-shared:-DLP_KV_SHARED" "fused-ogu:-DLP_FUSED_OGU"
      "fused-all:-DLP_FUSED_ALL" "b8:-DLP_BATCH=8" "b8-marks:-DLP_BATCH=8 -DLP_MARKS"
      "fixed-h:-DGQA_FIXED_H=64 -DGQA_FIXED_GROUP=3" "fixed-h-marks:-DGQA_FIXED_H=64 -DGQA_FIXED_GROUP=3 -DLP_MARKS"
      "epi:-DLP_EPI" "b8-epi:-DLP_BATCH=8 -DLP_EPI" "b8-epi-pro8:-DLP_BATCH=8 -DLP_EPI -DLIN_PRO_COPY=8")
    for v in .gpu/variants/*/cuda/linear.cu; do # drop-in GEMV variants, plain and with marks
      [ -f "$v" ] && ! cmp -s "$v" kernels/matmul/cuda/linear.cu || continue
      n=$(basename "$(dirname "$(dirname "$v")")")
      specs+=("$n:-DLIN_SRC=\"$v\"" "$n-marks:-DLIN_SRC=\"$v\" -DLP_MARKS")
    done
    # LAYER_SPECS="name:flags;name:flags" runs those builds instead (each once per LAYER_ROUNDS).
    [ -n "${LAYER_SPECS:-}" ] && IFS=';' read -ra specs <<<"$LAYER_SPECS"
    for spec in "${specs[@]}"; do # the builds side by side
      IFS=: read -r v flags <<<"$spec"
      # shellcheck disable=SC2086 # flags are words
      nvcc -O3 -arch=sm_90 -std=c++17 -I"$inc" -I. $flags ${LAYER_FLAGS:-} -o "$work/layer-$v" bench/layer_probe.cu \
        >"$work/layer-$v.log" 2>&1 &
    done
    wait
    for ((round = 0; round < ${LAYER_ROUNDS:-1}; ++round)); do
      for spec in "${specs[@]}"; do
        v=${spec%%:*}
        echo "== $v" && cat "$work/layer-$v.log" && "$work/layer-$v"
      done
    done 2>&1 | tee "$out/layer.log"
    summary+=("layer: $(grep -E '^==|^graph|^\| [a-zQgOd]|^sum|split over|FAILED' "$out/layer.log" | tr '\n' ' ')")
    ;;
  bw)
    # Read bandwidth of a layer's batch-8 K/V cache by access pattern (bench/bw_probe.cu).
    nvcc -O3 -arch=sm_90 -o "$work/bw_probe" bench/bw_probe.cu && "$work/bw_probe" | tee "$out/bw.log"
    summary+=("bw: $(grep -E '^\| [a-z]' "$out/bw.log" | tr '\n' ' ')")
    ;;
  probe)
    # Decode attention alone (bench/attn_probe.cu): kiln_gqa_decode, kiln_gqa_decode_cluster(_rows) and
    # kiln_gqa_decode_tiled of this tree, L2 flushed before each launch.
    inc="$work/inc" && mkdir -p "$inc/kiln-cuda-std" && cp kernels/cuda-std/include/* "$inc/kiln-cuda-std/" &&
      cp host/cuda/kiln.cuh "$inc/"
    # PROBE_OLD: another attention.cu (a path in the tree) whose tiled kernel runs beside this one.
    variants=("decode::kernels/attention/cuda/attention.cu" "cluster:-DCLUSTER:kernels/attention/cuda/attention.cu"
      "cluster-rows-2048:-DCLUSTER_ROWS -DPB=1 -DPPL=2048:kernels/attention/cuda/attention.cu"
      "decode-4096:-DPB=1 -DPPL=4096:kernels/attention/cuda/attention.cu"
      "cluster16-rows-4096:-DCLUSTER16_ROWS -DPB=1 -DPPL=4096:kernels/attention/cuda/attention.cu"
      "cluster16-rows-b4-4096:-DCLUSTER16_ROWS -DPB=4 -DPPL=4096:kernels/attention/cuda/attention.cu"
      "decode-b4-4096:-DPB=4 -DPPL=4096:kernels/attention/cuda/attention.cu"
      "tiled-b8-4096-warm:-DTILED -DNO_FLUSH:kernels/attention/cuda/attention.cu"
      "tiled:-DTILED:kernels/attention/cuda/attention.cu" "tiled-kpb128:-DTILED -DKPB=128:kernels/attention/cuda/attention.cu")
    [ -n "${PROBE_OLD:-}" ] && variants+=("tiled-old:-DTILED:$PROBE_OLD" "tiled-old-kpb128:-DTILED -DKPB=128:$PROBE_OLD")
    for spec in "${variants[@]}"; do
      IFS=: read -r v flags src <<<"$spec"
      # shellcheck disable=SC2086 # flags are words
      nvcc -O3 -arch=sm_90 -I"$inc" -I. $flags -DATTN_SRC="\"$src\"" -o "$work/probe-$v" bench/attn_probe.cu &&
        echo "== $v ($src)" && "$work/probe-$v"
    done 2>&1 | tee "$out/probe.log"
    # Prompt attention on tensor cores (bench/prefill_probe.cu) beside kiln_gqa_prefill.
    nvcc -O3 -arch=sm_90 -std=c++17 -I"$inc" -I. -Ibench -DATTN_SRC='"kernels/attention/cuda/attention.cu"' \
      -o "$work/prefill-probe" bench/prefill_probe.cu && "$work/prefill-probe" 2>&1 | tee -a "$out/probe.log"
    summary+=("probe: $(grep -E '^==|^\| [0-9]|^position|float64|FAILED' "$out/probe.log" | tr '\n' ' ')")
    ;;
  ab)
    for v in builtin constant-inputs-off .gpu/variants/*; do
      case "$v" in
      builtin) pk=() ;;
      constant-inputs-off) pk=(--constant-inputs off) ;; # the built-in packages, told nothing is constant
      *) [ -d "$v" ] || continue; pk=(--packages "$v") ;; # no variants: the glob stays unexpanded
      esac
      echo "== packages: $v"
      for p in ${AB_PROMPTS:-128 3840}; do
        "$KILN" bench decode "$m" --batch 1 --batch 8 --graph on --runs 3 --prompt-len $p --max-length ${AB_MAX_LENGTH:-4096} \
          "${pk[@]}" 2>&1 | grep -E "^\| [0-9]|[Ee]rror|failed|graph nodes"
      done
    done 2>&1 | tee "$out/ab.log"
    summary+=("ab: $(grep -hE '^==|^\| [0-9]' "$out/ab.log" | tr '\n' ' ')")
    ;;
  attn)
    # Decode attention variants side by side: the built-in package, then each package folder in
    # .gpu/variants (a drop-in outranks the built-in one): batch 8 (and 1, 64) at context 128
    # and 3840 of a 4096 cache, graphs on, and ncu of the attention kernels at context 3840.
    for v in builtin .gpu/variants/*; do
      [ "$v" = builtin ] || [ -d "$v" ] || continue # no variants: the glob stays unexpanded
      [ "$v" = builtin ] && pk=() || pk=(--packages "$v")
      echo "== attention: $v"
      for p in 128 3840; do
        "$KILN" bench decode "$m" --batch 1 --batch 8 --graph on --runs 3 --prompt-len $p --max-length 4096 "${pk[@]}" 2>&1 |
          grep -E "^\| [0-9]|[Ee]rror|failed"
      done
      "$KILN" bench decode "$m" --batch 64 --graph on --runs 2 --prompt-len 128 --new-tokens 128 --max-length 512 \
        "${pk[@]}" 2>&1 | grep -E "^\| [0-9]|[Ee]rror|failed"
      ncu --cache-control none --clock-control none --kernel-name regex:'kiln_gqa_(decode|merge)' --launch-skip 60 \
        --launch-count 4 --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct \
        --csv --print-units base "$KILN" bench decode "$m" --batch 8 --graph off --runs 1 --new-tokens 4 \
        --prompt-len 3840 --max-length 4096 "${pk[@]}" 2>/dev/null | grep -E "gqa_" | tail -10
    done 2>&1 | tee "$out/attn.log"
    summary+=("attn: $(grep -hE '^==|^\| [0-9]' "$out/attn.log" | tr '\n' ' ')")
    ;;
  prefill)
    # ncu: GPU time by kernel of a batch-64 prefill of 128-token prompts (a serve join wave).
    ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
      --launch-count 900 "$KILN" bench decode "$m" --batch 64 --graph off --runs 1 --new-tokens 2 --prompt-len 128 \
      --max-length 512 >"$work/ncu-prefill.csv" 2>"$work/ncu-prefill.err"
    tail -3 "$work/ncu-prefill.err"
    python3 - "$work/ncu-prefill.csv" <<'PY' | tee "$out/prefill.log"
import csv, collections, sys
lines = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 3]
head = next((r for r in lines if "Metric Name" in r), None)
if head is None:
    sys.exit("no ncu table: see ncu-prefill.err")
name, metric, value = (head.index(c) for c in ("Kernel Name", "Metric Name", "Metric Value"))
rows = [r for r in lines if len(r) == len(head) and r[metric] == "gpu__time_duration.sum"]
by = collections.defaultdict(lambda: [0, 0.0])
for r in rows:
    by[r[name]][0] += 1
    by[r[name]][1] += float(r[value].replace(",", "")) / 1e3
total = sum(v[1] for v in by.values())
print(f"{len(rows)} kernels, {total:.1f} us in all")
for k, (n, us) in sorted(by.items(), key=lambda kv: -kv[1][1])[:25]:
    print(f"{us:10.1f} us {n:5d}x  {k[:110]}")
PY
    ;;
  longctx)
    # ncu: the decode attention kernels of a batch-8 step at context 3840 (cache of 4096): the
    # metrics of every layer's launch, then the full sections of one launch (where its time goes).
    ncu --cache-control none --clock-control none --kernel-name regex:'kiln_gqa_(decode|merge)' --launch-count 60 \
      --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__occupancy_limit_registers,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_barrier_per_warp_active.pct \
      --csv --print-units base "$KILN" bench decode "$m" --batch 8 --graph off --runs 1 --new-tokens 4 --prompt-len 3840 \
      --max-length 4096 >"$work/ncu-longctx.csv" 2>"$work/ncu-longctx.err"
    ncu --cache-control none --clock-control none --kernel-name regex:'kiln_gqa_decode' --launch-skip 30 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
      --section LaunchStats --section SchedulerStats --section SourceCounters "$KILN" bench decode "$m" --batch 8 \
      --graph off --runs 1 --new-tokens 4 --prompt-len 3840 --max-length 4096 >"$work/ncu-longctx-sections.txt" 2>&1
    grep -vE "^==PROF==|^\| " "$work/ncu-longctx-sections.txt" | tail -150 >"$out/ncu-longctx-sections.txt"
    tar -C "$work" -cf "$out/ncu-longctx.tar" ncu-longctx.csv ncu-longctx.err
    ;;
  esac
  echo "phase $phase: $(($(date +%s) - t0)) s"
done
printf '%s\n' "${summary[@]}"
