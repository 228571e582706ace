"""llama.cpp runs what the llama.cpp recipe writes: the logits of a fixed prompt, computed by
llama.cpp (``llama-cpp-python``, which compiles it from source: minutes) with an F32 KV
cache, equal transformers' on the original HF model within float tolerance.

llama-cpp-python lives in a Python of its own, named by ``TREECLI_LLAMA_CPP`` (its
``python``); without it these tests are skipped::

    python3 -m venv /tmp/llcpp && /tmp/llcpp/bin/pip install llama-cpp-python==0.3.36
    TREECLI_LLAMA_CPP=/tmp/llcpp/bin/python .venv/bin/python -m pytest tests/test_llama_cpp_oracle.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from .test_model_recipes import IDS, LLAMA3, _build, _logits, _sentencepiece_model

PYTHON = os.environ.get("TREECLI_LLAMA_CPP")
pytestmark = pytest.mark.skipif(not PYTHON, reason="TREECLI_LLAMA_CPP names no Python with llama-cpp-python")

# Run in llama-cpp-python's own Python: the logits of every position of the prompt.
LOGITS = """
import json, sys, llama_cpp, llama_cpp.llama_cpp as low
defaults = low.llama_model_default_params
def without_extra_buffers():  # (ggml's AMX buffers: SIGILL where the kernel does not grant AMX, as in containers)
    params = defaults()
    params.use_extra_bufts = False
    return params
low.llama_model_default_params = without_extra_buffers
model = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, logits_all=True, verbose=False,
                        type_k=0, type_v=0, n_threads=2)  # (type 0: an F32 KV cache)
ids = json.loads(sys.argv[2])
model.eval(ids)
tokens = model.tokenize(sys.argv[3].encode(), add_bos=False) if len(sys.argv) > 3 else []
json.dump({"logits": [list(map(float, row)) for row in model.scores[: len(ids)]], "tokens": tokens}, sys.stdout)
"""


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "q8_0"])
def test_llama_cpp_runs_the_recipe_s_gguf(cli, tmp_path, kind, dtype):
    model = _build(tmp_path / kind, kind)
    args = ["--dtype", dtype] if dtype != "float32" else []
    result = cli("convert", model, tmp_path / "model.gguf", "--recipe", "llama.cpp", *args)
    assert result.code == 0, result.stderr
    got = np.array(_run(tmp_path / "model.gguf")["logits"])
    expected = _logits(model)[0][0]
    scale = np.abs(expected).max()
    if dtype == "float32":
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * scale)
    else:  # 8-bit weights: the logits move by about their rounding, the argmax stays
        assert np.abs(got - expected).max() < 0.05 * scale
        assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.75


def _run(path, text=None):
    ran = subprocess.run([PYTHON, "-c", LOGITS, str(path), json.dumps(IDS[0]), *([text] if text else [])],
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    return json.loads(ran.stdout)


def test_llama_cpp_tokenizes_as_sentencepiece_does(cli, tmp_path):
    model = _build(tmp_path / "m", "llama", tokenizer=False, vocab=320)
    processor = _sentencepiece_model(model)
    assert cli("convert", model, tmp_path / "m.gguf", "--recipe", "llama.cpp").code == 0
    text = "the quick brown fox 17 jumps over the lazy dog"
    ran = _run(tmp_path / "m.gguf", text)
    assert ran["tokens"] == processor.encode(text)
    expected = _logits(model)[0][0]
    np.testing.assert_allclose(np.array(ran["logits"]), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_llama_cpp_tokenizes_a_byte_level_bpe_as_transformers_does(cli, tmp_path):
    import transformers

    model = _build(tmp_path / "m", "qwen2")
    assert cli("convert", model, tmp_path / "m.gguf", "--recipe", "llama.cpp").code == 0
    text = "hello world, hello  wo"
    expected = transformers.AutoTokenizer.from_pretrained(model)(text, add_special_tokens=False).input_ids
    assert _run(tmp_path / "m.gguf", text)["tokens"] == expected


@pytest.mark.parametrize("scaling", [LLAMA3, {"rope_type": "linear", "factor": 4.0}], ids=["llama3", "linear"])
def test_llama_cpp_runs_a_scaled_rotary_embedding(cli, tmp_path, scaling):
    """Llama 3.1/3.2's "llama3" rope scaling, as the rope_freqs tensor llama.cpp reads; linear, as its keys."""
    model = _build(tmp_path / "m", "llama", rope_scaling=dict(scaling))
    assert cli("convert", model, tmp_path / "m.gguf", "--recipe", "llama.cpp").code == 0
    expected = _logits(model)[0][0]
    unscaled = _build(tmp_path / "plain", "llama")  # (the same weights: the scaling is what differs)
    assert not np.allclose(_logits(unscaled)[0][0], expected, rtol=1e-3)
    np.testing.assert_allclose(np.array(_run(tmp_path / "m.gguf")["logits"]), expected, rtol=1e-5,
                               atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("kind", ["q6_k", "q5_k_m", "q4_k_m"])
def test_llama_cpp_runs_k_quant_weights(cli, tmp_path, kind):
    """K-quant blocks as llama.cpp's reference quantizer writes them (rows of 256 and more: a
    hidden size of 256), the rest falling back as llama.cpp does."""
    model = _build(tmp_path / "m", "llama", hidden_size=256, intermediate_size=512)
    result = cli("convert", model, tmp_path / "m.gguf", "--recipe", "llama.cpp", "--dtype", kind)
    assert result.code == 0 and "quantized to Q6_K" in result.stderr, result.stderr
    # transformers reads the same blocks through gguf-py's dequantizer: llama.cpp must agree
    # with it within its own 8-bit activations' rounding (about 1 % on this tiny model: Q8_0's
    # weights give the same), and both stay near the original model
    expected, same_blocks = _logits(model)[0][0], _logits(tmp_path, gguf_file="m.gguf")[0][0]
    got = np.array(_run(tmp_path / "m.gguf")["logits"])
    scale = np.abs(expected).max()
    assert np.abs(got - same_blocks).max() < 0.03 * scale
    # (the weights' own rounding, on a tiny random model: 6 bits, then mostly 4)
    assert np.abs(same_blocks - expected).max() < {"q6_k": 0.06, "q5_k_m": 0.12, "q4_k_m": 0.25}[kind] * scale
    assert (got.argmax(-1) == same_blocks.argmax(-1)).mean() >= 0.75


# Run in llama-cpp-python's own Python: llama_model_quantize, what llama-quantize runs.
QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3].upper())
params.nthread = 2
if llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params) != 0:
    raise SystemExit("llama_model_quantize failed")
"""


@pytest.fixture(scope="module")
def sixteen_layers(tmp_path_factory):
    """A Llama of 16 layers (use_more_bits' eighths), rows of 256 (K-quant blocks) and grouped
    KV heads (4 queries to a key: Q2_K's rule), as an F32 GGUF; the FFN's rows of 640 are
    not whole blocks (ffn_down falls back)."""
    root = tmp_path_factory.mktemp("mixes")
    model = _build(root / "hf", "llama", layers=16, hidden_size=256, intermediate_size=640,
                   num_attention_heads=8, num_key_value_heads=2)
    ran = subprocess.run([sys.executable, "-m", "treecli", "convert", str(model), str(root / "f32.gguf"), "--recipe", "llama.cpp"],
                         capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    return root / "f32.gguf"


@pytest.mark.parametrize("mix", ["q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m",
                                 "q6_k", "q8_0", "q4_0", "q5_1", "iq4_nl", "iq4_xs"])
def test_every_mix_is_llama_quantize_s_tensor_for_tensor(cli, tmp_path, sixteen_layers, mix):
    """treecli's --dtype MIX beside llama.cpp's own quantizer on the same F32 GGUF: each
    tensor's type and blocks the same, byte for byte, and general.file_type the mix."""
    import gguf

    ran = subprocess.run([PYTHON, "-c", QUANTIZE, str(sixteen_layers), str(tmp_path / "ref.gguf"), mix],
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    result = cli("convert", sixteen_layers, tmp_path / "ours.gguf", "--dtype", mix)
    assert result.code == 0, result.stderr
    ours, ref = gguf.GGUFReader(str(tmp_path / "ours.gguf")), gguf.GGUFReader(str(tmp_path / "ref.gguf"))
    theirs = {t.name: t for t in ref.tensors}
    assert sorted(t.name for t in ours.tensors) == sorted(theirs)
    for tensor in ours.tensors:
        assert tensor.tensor_type == theirs[tensor.name].tensor_type, tensor.name
        assert np.asarray(tensor.data).tobytes() == np.asarray(theirs[tensor.name].data).tobytes(), tensor.name
    file_type = [f for f in (ours.fields["general.file_type"], ref.fields["general.file_type"])]
    assert int(file_type[0].parts[-1][0]) == int(file_type[1].parts[-1][0])


def test_llama_cpp_runs_a_split_gguf_treecli_wrote(cli, tmp_path):
    """Issue 43, item 6: the shards of -o DIR --format gguf --max-shard-size are llama-gguf-split's:
    llama.cpp loads them from the first and computes what it computes from the one file."""
    model = _build(tmp_path / "m", "llama")
    assert cli("convert", model, tmp_path / "one.gguf", "--recipe", "llama.cpp").code == 0
    result = cli("convert", tmp_path / "one.gguf", tmp_path / "split", "--format", "gguf", "--max-shard-size", "40KB")
    assert result.code == 0, result.stderr
    shards = sorted((tmp_path / "split").iterdir())
    assert len(shards) > 2
    np.testing.assert_array_equal(np.array(_run(shards[0])["logits"]), np.array(_run(tmp_path / "one.gguf")["logits"]))
