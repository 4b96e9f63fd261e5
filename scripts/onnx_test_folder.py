"""Writes one test folder in ONNX's backend test layout, shared by the scripts that make kiln's
own node tests and real-model tests (make-contrib-node-tests.py, make-onnx-node-tests.py,
make-real-models.py, make-big-models.py)."""
import os
import shutil

import onnx
from onnx import numpy_helper


def write_test_folder(d, model, feeds, outputs):
    """Makes folder `d` afresh: `model` (a ModelProto) as model.onnx, test_data_set_0/input_<i>.pb
    from `feeds` (name → array) and output_<i>.pb from `outputs` ((name, array) pairs). Returns
    the folder's size in bytes."""
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(os.path.join(d, "test_data_set_0"))
    onnx.save(model, os.path.join(d, "model.onnx"))
    for i, (k, v) in enumerate(feeds.items()):
        with open(os.path.join(d, "test_data_set_0", f"input_{i}.pb"), "wb") as f:
            f.write(numpy_helper.from_array(v, k).SerializeToString())
    for i, (o, r) in enumerate(outputs):
        with open(os.path.join(d, "test_data_set_0", f"output_{i}.pb"), "wb") as f:
            f.write(numpy_helper.from_array(r, o).SerializeToString())
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


def export_torch_test(d, model, inputs, input_names, output_names):
    """Exports the torch module `model` at opset 17 (TorchScript exporter), runs onnxruntime's
    CPU provider on `inputs` (tensors) and writes test folder `d` with its outputs as the
    expected ones (make-real-models.py, make-big-models.py). Returns (size in bytes, outputs)."""
    import onnxruntime as ort
    import torch

    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "model.onnx")
    kwargs = {"dynamo": False} if "dynamo" in torch.onnx.export.__code__.co_varnames else {}
    torch.onnx.export(model, tuple(inputs), path, input_names=input_names, output_names=output_names,
                      opset_version=17, do_constant_folding=True, **kwargs)
    onnx.checker.check_model(path)
    feeds = {n: t.numpy() for n, t in zip(input_names, inputs)}
    results = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(output_names, feeds)
    outputs = list(zip(output_names, results))
    return write_test_folder(d, onnx.load(path), feeds, outputs), outputs
