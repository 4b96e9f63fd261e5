#!/usr/bin/env python3
"""Small real-model tests for CI: torchvision's MobileNetV3-Small (10 classes, 64 × 64 images)
and a 2-layer BERT encoder from transformers, random weights, exported by torch.onnx (opset 17)
with onnxruntime's CPU outputs on fixed inputs as the references. tests/real_models.rs runs
them: max|Δ| ≤ 1e-3·max|ref| per output, and the classifier's top-5 classes identical.

    python3 scripts/make-real-models.py [OUT_DIR=tests/real-models]

Each model folder holds model.onnx and test_data_set_0/{input_*.pb, output_*.pb} (ONNX's
backend test layout, so `kiln conformance tests/real-models` runs them too, at its stricter
per-element tolerance). Needs torch and torchvision (2.5), transformers (4.46), onnx and
onnxruntime. BatchNormalization statistics are made realistic by a few training-mode passes
over random images before export. Seeded: re-running gives the same files for the same
library versions. The folders stay under 8 MB in all.
"""
import os
import sys

import torch
import torchvision
from onnx_test_folder import export_torch_test

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "real-models")


def save(name, model, inputs, input_names, output_names):
    size, outputs = export_torch_test(os.path.join(OUT, name), model, inputs, input_names,
                                      output_names)
    print(f"{name}: {size / 1e6:.2f} MB, outputs " + ", ".join(f"{n}{list(r.shape)}" for n, r in outputs), flush=True)


def mobilenet():
    torch.manual_seed(0)
    m = torchvision.models.mobilenet_v3_small(weights=None, num_classes=10)
    # Realistic BatchNormalization statistics: a few training-mode passes over random images.
    m.train()
    with torch.no_grad():
        for _ in range(8):
            m(torch.randn(8, 3, 64, 64))
    m.eval()
    x = torch.randn(2, 3, 64, 64)
    save("mobilenet_v3_small_64", m, [x], ["images"], ["logits"])


def bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(1)
    cfg = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=256, max_position_embeddings=64, attn_implementation="eager")
    m = BertModel(cfg).eval()
    ids = torch.randint(0, 512, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    mask[1, 11:] = 0  # a right-padded row
    types = torch.zeros(2, 16, dtype=torch.int64)
    types[:, 8:] = 1

    class Encoder(torch.nn.Module):
        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            out = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return out.last_hidden_state, out.pooler_output

    save("bert_2_layers", Encoder(m), [ids, mask, types], ["input_ids", "attention_mask", "token_type_ids"],
         ["last_hidden_state", "pooler_output"])


if __name__ == "__main__":
    mobilenet()
    bert()
