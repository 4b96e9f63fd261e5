#!/usr/bin/env python3
"""The general-ONNX issue's model benchmark (item 7): ResNet-50 (224 x 224) and a BERT-base encoder
(sequence 128) at batch 1 and 32, float32 and float16, kiln beside PyTorch eager and torch.compile
in the same run on one GPU. Random weights (torchvision's and transformers' initialisation, seeded).

    python3 bench/model_peers.py --kiln PATH/kiln --out DIR [--methods kiln,eager,compile]
                                 [--models resnet50,bert_base] [--dtypes fp32,fp16] [--batches 1,32]

- PyTorch gets its best settings: `torch.backends.cudnn.benchmark = True`; for ResNet-50 both
  memory formats are timed and the faster kept (channels_last is usually faster in float16);
  float32 computes without TF32 (`allow_tf32 = False` for matmul and cuDNN), as kiln's cuBLASLt
  and cuDNN calls do; torch.compile with mode "reduce-overhead" (Inductor kernels replayed as CUDA
  graphs), the strongest at small batches.
- Each PyTorch figure is the median of `--iters` runs, each synchronized (latency), after warm-up.
- kiln: each configuration is exported by torch.onnx (TorchScript exporter, opset 17, constant
  folding: BatchNormalization folds into the convolutions; BERT with transformers' eager attention,
  whose float16 export is a valid graph, unlike sdpa's) into DIR, then timed by `kiln bench run
  --device cuda` (random inputs held on the device, outputs written in place, CUDA graphs auto; the
  p50 of `--iters` runs, each waited for).
- Rows are printed as they finish and written to DIR/model-peers.json.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch

SEQ = 128


def resnet50():
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet50(weights=None).eval()


class Encoder(torch.nn.Module):
    """BERT-base's encoder on input_ids and attention_mask; last hidden state and pooled output.
    `attn`: transformers' attention implementation ("sdpa", PyTorch's fastest, or "eager": the
    same weights and arithmetic)."""

    def __init__(self, attn="sdpa"):
        super().__init__()
        from transformers import BertConfig, BertModel

        torch.manual_seed(1)
        self.bert = BertModel(BertConfig(attn_implementation=attn))

    def forward(self, input_ids, attention_mask):
        o = self.bert(input_ids=input_ids, attention_mask=attention_mask)
        return o.last_hidden_state, o.pooler_output


def make(model, dtype, batch, attn="sdpa"):
    """(module on the GPU, its inputs, input names, output names); `attn` as Encoder's."""
    dt = torch.float16 if dtype == "fp16" else torch.float32
    if model == "resnet50":
        m = resnet50().to("cuda", dt)
        return m, [torch.randn(batch, 3, 224, 224, device="cuda", dtype=dt)], ["images"], ["logits"]
    m = Encoder(attn).eval().to("cuda", dt)
    ids = torch.randint(0, 30522, (batch, SEQ), device="cuda")
    mask = torch.ones(batch, SEQ, dtype=torch.int64, device="cuda")
    return m, [ids, mask], ["input_ids", "attention_mask"], ["last_hidden_state", "pooler_output"]


def median_ms(fn, inputs, iters, warmup=10):
    with torch.inference_mode():
        for _ in range(warmup):
            fn(*inputs)
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn(*inputs)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return times[len(times) // 2]


def torch_rows(model, dtype, batch, methods, iters):
    m, inputs, _, _ = make(model, dtype, batch)
    layouts = ["contiguous", "channels_last"] if model == "resnet50" else ["contiguous"]
    rows = []
    for method in [x for x in methods if x in ("eager", "compile")]:
        best = None
        for layout in layouts:
            mm, xs = m, inputs
            if layout == "channels_last":
                mm = m.to(memory_format=torch.channels_last)
                xs = [x.to(memory_format=torch.channels_last) for x in inputs]
            f = torch.compile(mm, mode="reduce-overhead") if method == "compile" else mm
            t0 = time.time()
            ms = median_ms(f, xs, iters, warmup=10 if method == "eager" else 20)
            note = f"{layout}" + (f", compiled+warm-up {time.time() - t0:.0f} s" if method == "compile" else "")
            print(f"  {model} {dtype} batch {batch} PyTorch {method} {layout}: {ms:.3f} ms", file=sys.stderr)
            if best is None or ms < best[0]:
                best = (ms, note)
            if method == "compile":
                torch._dynamo.reset()
        rows.append({"model": model, "dtype": dtype, "batch": batch, "method": f"PyTorch {method}",
                     "ms": best[0], "note": best[1]})
    return rows


def kiln_row(kiln, out, model, dtype, batch, iters):
    # BERT is exported with eager attention: the TorchScript exporter's float16 sdpa adds the mask in
    # float32, so LayerNormalization gets float32 X with float16 Scale, which ONNX's type
    # constraint (one T) forbids and onnxruntime refuses at load as kiln does.
    m, inputs, in_names, out_names = make(model, dtype, batch, attn="eager")
    path = os.path.join(out, f"{model}-{dtype}-b{batch}.onnx")
    if not os.path.exists(path):
        kwargs = {"dynamo": False} if "dynamo" in torch.onnx.export.__code__.co_varnames else {}
        with torch.inference_mode():
            torch.onnx.export(m, tuple(inputs), path, input_names=in_names, output_names=out_names,
                              opset_version=17, do_constant_folding=True, **kwargs)
    del m
    torch.cuda.empty_cache()
    js = path + ".json"
    r = subprocess.run([kiln, "bench", "run", path, "--device", "cuda", "--warmup", "5", "--runs", str(iters),
                        "--json", js], capture_output=True, text=True)
    if r.returncode != 0:
        return {"model": model, "dtype": dtype, "batch": batch, "method": "kiln", "ms": None,
                "note": (r.stderr or r.stdout).strip().splitlines()[-1:]}
    s = json.load(open(js))
    return {"model": model, "dtype": dtype, "batch": batch, "method": "kiln", "ms": s["p50_ms"],
            "note": f"min {s['min_ms']:.3f}; graphs {s['graphs']}; setup {s['setup_ms']:.0f} ms"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--methods", default="kiln,eager,compile")
    ap.add_argument("--models", default="resnet50,bert_base")
    ap.add_argument("--dtypes", default="fp32,fp16")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    methods = a.methods.split(",")
    rows = []
    dump = os.path.join(a.out, "model-peers.json")
    for model in a.models.split(","):
        for dtype in a.dtypes.split(","):
            for batch in [int(b) for b in a.batches.split(",")]:
                new = []
                if "kiln" in methods:
                    new.append(kiln_row(a.kiln, a.out, model, dtype, batch, a.iters))
                new += torch_rows(model, dtype, batch, methods, a.iters)
                for r in new:
                    ms = "failed" if r["ms"] is None else f"{r['ms']:.3f} ms"
                    print(f"{model} {dtype} b{batch} {r['method']}: {ms} ({r['note']})", flush=True)
                rows += new
                json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                          open(dump, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
