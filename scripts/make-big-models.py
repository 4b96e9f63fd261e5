#!/usr/bin/env python3
"""The general-ONNX issue's real models, full size: torchvision's resnet50, mobilenet_v3_large,
efficientnet_b0 and vit_b_16 (224 × 224) and a transformers BERT-base encoder (sequence 128),
random weights, exported by torch.onnx at opset 17, with onnxruntime's CPU outputs on fixed
inputs. Too large for the repository (about 100 MB each): run it where the models are tested,
the GPU machine included (it has torch, transformers, onnx and onnxruntime), then

    python3 scripts/make-big-models.py OUT_DIR [NAME ...]
    kiln conformance OUT_DIR                       # per element, ONNX's tolerances
    KILN_BIG_MODELS=OUT_DIR $GPU_TESTS --ignored big_real_models   # 1e-3·max|ref|, top-5

Each model folder is in ONNX's backend test layout (model.onnx, test_data_set_0). BatchNormalization
statistics are made realistic by training-mode passes over random images first. Seeded.
"""
import os
import sys

import torch
import torchvision
from onnx_test_folder import export_torch_test


def save(out, name, model, inputs, input_names, output_names):
    size, outputs = export_torch_test(os.path.join(out, name), model, inputs, input_names,
                                      output_names)
    print(f"{name}: {size / 1e6:.2f} MB, outputs " + ", ".join(f"{n}{list(r.shape)}" for n, r in outputs), flush=True)


def vision(out, name):
    torch.manual_seed(0)
    m = getattr(torchvision.models, name)(weights=None)
    # Weights torchvision initialises to zero (vit_b_16's head) would make every logit 0.
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0.0, 0.02)
    m.train()
    with torch.no_grad():
        for _ in range(4):
            m(torch.randn(4, 3, 224, 224))
    m.eval()
    save(out, name, m, [torch.randn(1, 3, 224, 224)], ["images"], ["logits"])


def bert_base(out):
    from transformers import BertConfig, BertModel

    torch.manual_seed(1)
    m = BertModel(BertConfig(attn_implementation="eager")).eval()
    ids = torch.randint(0, 30522, (1, 128))
    mask = torch.ones(1, 128, dtype=torch.int64)
    types = torch.zeros(1, 128, dtype=torch.int64)

    class Encoder(torch.nn.Module):
        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            o = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return o.last_hidden_state, o.pooler_output

    save(out, "bert_base", Encoder(m), [ids, mask, types], ["input_ids", "attention_mask", "token_type_ids"],
         ["last_hidden_state", "pooler_output"])


if __name__ == "__main__":
    out = sys.argv[1]
    names = sys.argv[2:] or ["resnet50", "mobilenet_v3_large", "efficientnet_b0", "vit_b_16", "bert_base"]
    for n in names:
        bert_base(out) if n == "bert_base" else vision(out, n)
