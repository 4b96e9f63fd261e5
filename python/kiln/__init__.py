"""kiln: ONNX models and onnxruntime-genai LLM folders through sandboxed kernel packages.

onnxruntime's API::

    import kiln
    sess = kiln.InferenceSession("model.onnx", providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    (probs,) = sess.run(None, {"x": x})

onnxruntime-genai's API::

    model = kiln.Model("smollm2-int4-cpu")
    tokenizer = kiln.Tokenizer(model)
    params = kiln.GeneratorParams(model)
    params.set_search_options(max_length=256)
    generator = kiln.Generator(model, params)
    generator.append_tokens(tokenizer.encode("The capital of France is"))
    stream = tokenizer.create_stream()
    while not generator.is_done():
        generator.generate_next_token()
        print(stream.decode(generator.get_next_tokens()[0]), end="")

Errors are ``kiln.KilnError``: ``InvalidInput`` (also a ``ValueError``), ``Unsupported`` (also a
``NotImplementedError``) and ``DeviceError`` (also a ``RuntimeError``). A session's calls may
come from several threads; they run one at a time, with the GIL released while the model runs.
"""

from ._kiln import (  # noqa: F401
    DeviceError,
    Generator,
    GeneratorParams,
    InferenceSession,
    InvalidInput,
    KilnError,
    Model,
    NodeArg,
    Tokenizer,
    TokenizerStream,
    Unsupported,
    __version__,
    get_available_providers,
    get_device,
)
