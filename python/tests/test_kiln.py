"""The kiln Python package against onnxruntime (CPU) and onnxruntime-genai's references: the
README's example and a fixture decoder through `InferenceSession`, the genai-style generator on
a fixture folder, typed errors, providers, non-contiguous arrays, threads and the GIL.

Run after installing the wheel: `pytest python/tests` (fixtures through KILN_FIXTURES, default
../shared/fixtures).
"""

import json
import os
import pathlib
import threading
import time

import numpy as np
import onnxruntime as ort
import pytest

import kiln

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = pathlib.Path(os.environ.get("KILN_FIXTURES", ROOT.parent / "shared" / "fixtures"))
EXAMPLE = ROOT / "examples" / "mlp"
CPU = ["CPUExecutionProvider"]


def fixture(rel):
    p = FIXTURES / rel
    assert p.exists(), f"fixture {p} is missing: set KILN_FIXTURES (see ../shared/fixtures/README.md)"
    return p


def test_the_example_matches_onnxruntime():
    x = np.load(EXAMPLE / "x.npy")
    sess = kiln.InferenceSession(str(EXAMPLE / "model.onnx"), providers=CPU)
    ref = ort.InferenceSession(str(EXAMPLE / "model.onnx"), providers=CPU)
    (got,) = sess.run(None, {"x": x})
    (want,) = ref.run(None, {"x": x})
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, np.load(EXAMPLE / "expected.npy"), rtol=1e-5, atol=1e-6)
    assert sess.get_providers() == CPU
    for mine, theirs in [(sess.get_inputs(), ref.get_inputs()), (sess.get_outputs(), ref.get_outputs())]:
        assert [(a.name, a.shape, a.type) for a in mine] == [(a.name, a.shape, a.type) for a in theirs]
    # Output names select and order the outputs (None or [] is all of them); bytes load as a
    # path does.
    assert len(sess.run(["probs"], {"x": x})) == 1
    np.testing.assert_array_equal(sess.run([], {"x": x})[0], got)
    (again,) = kiln.InferenceSession((EXAMPLE / "model.onnx").read_bytes(), providers=CPU).run(None, {"x": x})
    np.testing.assert_array_equal(again, got)


def test_non_contiguous_inputs_give_the_contiguous_result():
    x = np.load(EXAMPLE / "x.npy")
    sess = kiln.InferenceSession(str(EXAMPLE / "model.onnx"), providers=CPU)
    (want,) = sess.run(None, {"x": x})
    wide = np.zeros((x.shape[0], 2 * x.shape[1]), dtype=x.dtype)
    wide[:, ::2] = x
    strided = wide[:, ::2]
    fortran = np.asfortranarray(x)
    assert not strided.flags.c_contiguous and not fortran.flags.c_contiguous
    for arr in (strided, fortran):
        (got,) = sess.run(None, {"x": arr})
        np.testing.assert_array_equal(got, want)


def test_a_fixture_decoder_matches_onnxruntime():
    folder = fixture("llm/tiny-llama-v512-fp32-cpu")
    cfg = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    model = str(folder / "model.onnx")
    ids = np.array([[1, 99, 105, 302, 391, 198, 73]], dtype=np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in range(cfg["num_hidden_layers"]):
        for kv in ("key", "value"):
            feed[f"past_key_values.{i}.{kv}"] = np.zeros(
                (1, cfg["num_key_value_heads"], 0, cfg["head_size"]), dtype=np.float32)
    got = kiln.InferenceSession(model, providers=CPU).run(["logits"], feed)[0]
    want = ort.InferenceSession(model, providers=CPU).run(["logits"], feed)[0]
    assert got.shape == want.shape == (1, 7, 512)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3 * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_errors_are_typed_and_name_what_is_wrong():
    sess = kiln.InferenceSession(str(EXAMPLE / "model.onnx"), providers=CPU)
    x = np.load(EXAMPLE / "x.npy")
    with pytest.raises(kiln.InvalidInput, match="float32") as e:
        sess.run(None, {"x": x.astype(np.int32)})
    assert isinstance(e.value, ValueError) and isinstance(e.value, kiln.KilnError)
    with pytest.raises(kiln.InvalidInput, match="nope"):
        sess.run(["nope"], {"x": x})
    with pytest.raises(kiln.InvalidInput, match="x"):
        sess.run(None, {})
    with pytest.raises(kiln.InvalidInput, match="numpy"):
        sess.run(None, {"x": x.tolist()})
    with pytest.raises(kiln.InvalidInput):
        kiln.InferenceSession(str(ROOT / "README.md"), providers=CPU)
    with pytest.raises(kiln.Unsupported, match="TensorrtExecutionProvider") as e:
        kiln.InferenceSession(str(EXAMPLE / "model.onnx"), providers=["TensorrtExecutionProvider", "CPUExecutionProvider"])
    assert isinstance(e.value, NotImplementedError)


def test_providers_follow_onnxruntime():
    avail = kiln.get_available_providers()
    assert avail[-1] == "CPUExecutionProvider"
    assert ("CUDAExecutionProvider" in avail) == (kiln.get_device() == "GPU")
    if "CUDAExecutionProvider" not in avail:
        with pytest.raises(kiln.Unsupported, match="CPUExecutionProvider"):
            kiln.InferenceSession(str(EXAMPLE / "model.onnx"), providers=["CUDAExecutionProvider"])
    sess = kiln.InferenceSession(str(EXAMPLE / "model.onnx"), providers=avail)
    assert sess.get_providers() == avail[:1]


def test_concurrent_runs_on_one_session_all_get_their_results():
    sess = kiln.InferenceSession(str(EXAMPLE / "model.onnx"), providers=CPU)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((3, 8)).astype(np.float32) for _ in range(8)]
    want = [sess.run(None, {"x": x})[0] for x in xs]
    got = [None] * len(xs)

    def work(i):
        for _ in range(10):
            got[i] = sess.run(None, {"x": xs[i]})[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def genai_reference(prompt_id):
    doc = json.loads(fixture("llm/references/tiny-llama-v512-fp32-cpu/genai_greedy.json").read_text())
    return next(r for r in doc["runs"] if r["prompt_id"] == prompt_id)


def test_the_generator_gives_onnxruntime_genais_greedy_tokens():
    run = genai_reference("plain_once_upon")
    model = kiln.Model(str(fixture("llm/tiny-llama-v512-fp32-cpu")), providers=CPU)
    tokenizer = kiln.Tokenizer(model)
    ids = tokenizer.encode(run["prompt_text"])
    assert ids.dtype == np.int32 and ids.tolist() == run["prompt_token_ids"]
    params = kiln.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + 16, do_sample=False)
    gen = kiln.Generator(model, params)
    gen.append_tokens(ids)
    stream, text, new = tokenizer.create_stream(), "", []
    while not gen.is_done():
        gen.generate_next_token()
        tok = int(gen.get_next_tokens()[0])
        new.append(tok)
        text += stream.decode(tok)
    assert new == run["generated_token_ids"][:16]
    assert gen.get_sequence(0).tolist() == run["prompt_token_ids"] + new
    whole = tokenizer.decode(new)
    assert whole.startswith(text) and len(whole) - len(text) <= 4, "the stream holds back at most a character"
    with pytest.raises(kiln.InvalidInput, match="done"):
        gen.generate_next_token()
    with pytest.raises(kiln.Unsupported, match="num_beams"):
        params.set_search_options(num_beams=4)


def test_a_next_turn_continues_the_sequence():
    """Tokens appended after generated ones continue the same sequence: the next token is the
    one a fresh generator chooses after the whole sequence."""
    model = kiln.Model(str(fixture("llm/tiny-llama-v512-fp32-cpu")), providers=CPU)
    tokenizer = kiln.Tokenizer(model)
    params = kiln.GeneratorParams(model)
    params.set_search_options(max_length=64)
    gen = kiln.Generator(model, params)
    gen.append_tokens(tokenizer.encode("Once upon a time"))
    for _ in range(5):
        gen.generate_next_token()
    gen.append_tokens(tokenizer.encode(" The end"))
    gen.generate_next_token()
    whole = gen.get_sequence(0)
    fresh = kiln.Generator(model, params)
    fresh.append_tokens(whole[:-1])
    fresh.generate_next_token()
    assert int(fresh.get_next_tokens()[0]) == int(whole[-1])


def test_the_chat_template_is_the_folders():
    run = genai_reference("chat_capital_france")
    model = kiln.Model(str(fixture("llm/tiny-llama-v512-fp32-cpu")), providers=CPU)
    tokenizer = kiln.Tokenizer(model)
    messages = [
        {"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    assert tokenizer.apply_chat_template(json.dumps(messages)) == run["prompt_text"]
    assert tokenizer.apply_chat_template(messages) == run["prompt_text"]


def test_generation_releases_the_gil():
    """One long call (200 tokens appended after the prompt: 200 decode steps in one call) lets
    the main thread run meanwhile: a call that held the GIL would stop it for the whole call."""
    model = kiln.Model(str(fixture("llm/tiny-llama-v512-fp32-cpu")), providers=CPU)
    tokenizer = kiln.Tokenizer(model)
    params = kiln.GeneratorParams(model)
    params.set_search_options(max_length=400)
    gen = kiln.Generator(model, params)
    prompt = tokenizer.encode("Once upon a time")
    gen.append_tokens(prompt)
    long = np.arange(200, dtype=np.int32) % 500
    started, done = threading.Event(), threading.Event()

    def work():
        started.set()
        gen.append_tokens(long)
        done.set()

    t = threading.Thread(target=work)
    t.start()
    started.wait()
    ticks, t0 = 0, time.perf_counter()
    while not done.is_set():
        ticks += 1
        time.sleep(0.0005)
    elapsed = time.perf_counter() - t0
    t.join()
    assert len(gen.get_sequence(0)) == len(prompt) + 200
    print(f"{ticks} ticks in {elapsed:.3f} s")
    assert ticks > 10, f"the main thread ran {ticks} times in {elapsed:.3f} s of one call"


HAS_GPU = "CUDAExecutionProvider" in kiln.get_available_providers()


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_the_cuda_provider_matches_onnxruntime():
    x = np.load(EXAMPLE / "x.npy")
    sess = kiln.InferenceSession(str(EXAMPLE / "model.onnx"), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert sess.get_providers() == ["CUDAExecutionProvider"]
    (got,) = sess.run(None, {"x": x})
    (want,) = ort.InferenceSession(str(EXAMPLE / "model.onnx"), providers=CPU).run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # The fp16 folder on the GPU: onnxruntime's greedy tokens (its 9th step is a tie, left out).
    doc = json.loads(fixture("llm/references/tiny-llama-v512-fp16-cuda/ort_greedy.json").read_text())
    run = next(p for p in doc["prompts"] if p["prompt_id"] == "plain_once_upon")
    model = kiln.Model(str(fixture("llm/tiny-llama-v512-fp16-cuda")), providers=["CUDAExecutionProvider"])
    assert model.device_type == "cuda"
    params = kiln.GeneratorParams(model)
    params.set_search_options(max_length=len(run["prompt_token_ids"]) + 8)
    gen = kiln.Generator(model, params)
    gen.append_tokens(np.array(run["prompt_token_ids"], dtype=np.int64))
    while not gen.is_done():
        gen.generate_next_token()
    assert gen.get_sequence(0).tolist()[len(run["prompt_token_ids"]):] == run["generated_token_ids"][:8]


def test_string_tensors_match_onnxruntime():
    """StringConcat, StringSplit, RegexFullMatch (RE2's ASCII \\w) and Equal of strings
    (python/tests/data/strings.onnx), fed a str array and an object array as onnxruntime
    takes them; string outputs come back as object arrays of str, as onnxruntime gives them."""
    model = str(ROOT / "python" / "tests" / "data" / "strings.onnx")
    sess = kiln.InferenceSession(model, providers=CPU)
    ref = ort.InferenceSession(model, providers=CPU)
    words = ["banana", "monday", "Tuesday", "a", "的a", "x y"]
    want = ref.run(None, {"x": np.array(words, dtype=object)})
    for x in (np.array(words), np.array(words, dtype=object)):
        got = sess.run(None, {"x": x})
        for out, g, w in zip(sess.get_outputs(), got, want):
            assert g.dtype == w.dtype and g.shape == w.shape, out.name
            assert (g == w).all(), f"{out.name}: {g} != {w}"
    with pytest.raises(kiln.InvalidInput):
        sess.run(None, {"x": np.array([b"bytes", 1], dtype=object)})
