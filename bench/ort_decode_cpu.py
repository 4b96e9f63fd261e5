#!/usr/bin/env python3
"""Greedy decode of an onnxruntime-genai model folder on onnxruntime's CPU provider: the peer of
`kiln bench decode FOLDER --device cpu` where onnxruntime-genai itself is not installed (the GPU
machine has onnxruntime, not its generate() API).

    python3 bench/ort_decode_cpu.py FOLDER [--threads N] [--prompt-len 16] [--new-tokens 32] [--runs 3]

- The folder's genai_config.json names the decoder file and its inputs and outputs (input_ids,
  attention_mask, past_key_values.%d.key / .value, logits, present.%d.key / .value).
- One batch row. The prompt is random token ids (seeded); each step feeds the argmax of the last
  logits and the whole attention mask of ones. The KV cache is what the folder's
  `past_present_share_buffer` asks for, as onnxruntime-genai keeps it: with it, one buffer per
  past of `prompt + new tokens` positions, bound as both the past input and the present output
  (GroupQueryAttention writes the new rows in place); without it, the presents go back as the next
  pasts (onnxruntime values through I/O binding, no copy through numpy).
- Timed: each decode step after the prompt's, `--new-tokens` − 1 of them, as `kiln bench decode`
  times them (the prompt's step makes the first new token).
- MatMulNBits computes as the folder says (the model builder's CPU int4 folders ask for
  `accuracy_level` 4: activations quantized to int8 where onnxruntime has the kernel).
- onnxruntime: `intra_op_num_threads` N, `inter_op_num_threads` 1, graph optimizations all.
- Prints ms per decode step (the steps after the prompt's), median over --runs generations;
  with ORT_DECODE_TOKENS set, each generation's greedy tokens too.
"""
import argparse
import json
import os
import statistics
import time

import numpy as np
import onnxruntime as ort


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    if a.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (the first comes from the prompt's step)")
    genai = json.load(open(os.path.join(a.folder, "genai_config.json")))
    cfg = genai["model"]
    dec = cfg["decoder"]
    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(os.path.join(a.folder, dec["filename"]), so, providers=["CPUExecutionProvider"])
    ins, outs = dec["inputs"], dec["outputs"]
    layers, kv, hd = dec["num_hidden_layers"], dec["num_key_value_heads"], dec["head_size"]
    kv_dtype = next(i for i in sess.get_inputs() if i.name == ins["past_key_names"] % 0).type
    np_dtype = np.float16 if "float16" in kv_dtype else np.float32
    names = [(ins[p] % i, outs[o] % i) for i in range(layers) for p, o in
             (("past_key_names", "present_key_names"), ("past_value_names", "present_value_names"))]
    share = genai["search"].get("past_present_share_buffer", False)
    max_len = a.prompt_len + a.new_tokens
    rng = np.random.default_rng(0)

    def generate():
        ids = rng.integers(3, cfg["vocab_size"], size=(1, a.prompt_len), dtype=np.int64)
        shape = (1, kv, max_len if share else 0, hd)
        pasts = {p: ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np_dtype)) for p, _ in names}
        io = sess.io_binding()
        io.bind_output(outs["logits"])  # first, so that get_outputs()[0] stays the logits
        for p, o in names:
            io.bind_ortvalue_input(p, pasts[p])
            if share:
                io.bind_ortvalue_output(o, pasts[p])
        total, steps, tokens = 0, [], []
        for step in range(a.new_tokens):
            t0 = time.perf_counter()
            total += ids.shape[1]
            mask = np.ones((1, total), np.int64)
            io.bind_cpu_input(ins["input_ids"], ids)
            io.bind_cpu_input(ins["attention_mask"], mask)
            # Outputs whose shape changes each step are bound afresh (onnxruntime allocates them;
            # a name bound again keeps its place in get_outputs()).
            io.bind_output(outs["logits"])
            if not share:
                for _, o in names:
                    io.bind_output(o)
            sess.run_with_iobinding(io)
            got = io.get_outputs()
            if not share:
                for i, (p, _) in enumerate(names):
                    io.bind_ortvalue_input(p, got[1 + i])
            logits = got[0].numpy()
            assert logits.shape[-1] == cfg["vocab_size"], f"output 0 is not the logits: {logits.shape}"
            ids = np.array([[int(np.argmax(logits[0, -1]))]], np.int64)
            tokens.append(int(ids[0, 0]))
            if step > 0:
                steps.append(time.perf_counter() - t0)
        if os.environ.get("ORT_DECODE_TOKENS"):
            print(tokens)
        return 1e3 * sum(steps) / len(steps)

    generate()  # warm-up
    ms = [generate() for _ in range(a.runs)]
    print(f"onnxruntime {ort.__version__} CPU, {a.threads} threads, prompt {a.prompt_len}, {a.new_tokens} new tokens, "
          f"{'shared' if share else 'concatenated'} KV: "
          f"{statistics.median(ms):.2f} ms/step (runs: {', '.join(f'{m:.2f}' for m in ms)})")


if __name__ == "__main__":
    main()
