"""Issue 43, item 2: K-quants written as llama.cpp's reference quantizer writes them, block
for block. The golden blocks were made by ggml-quants.c itself, compiled with
-ffp-contract=off (tests/data/kquants/make_golden.py: CI compiles nothing)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from treecli.formats import _kquants

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402
from gguf.constants import GGMLQuantizationType as Q  # noqa: E402

GOLDEN = np.load(Path(__file__).parent / "data" / "kquants" / "golden.npz")


def test_q6_k_blocks_are_the_reference_quantizer_s_byte_for_byte():
    for row, values in enumerate(GOLDEN["inputs"]):
        assert _kquants.quantize_q6_k(values).tobytes() == GOLDEN["q6_k"][row].tobytes(), row


def test_q6_k_blocks_read_back_within_half_a_step():
    values = GOLDEN["inputs"][2]
    blocks = _kquants.quantize_q6_k(values)
    back = quants.dequantize(blocks.reshape(1, -1), Q.Q6_K).reshape(-1)
    steps = np.repeat(_kquants.q6_k_steps(blocks), 16)
    assert np.all(np.abs(back - values) <= steps * 0.5 + 1e-7)


def test_convert_writes_q6_k_and_falls_back_to_q8_0_as_llama_cpp_does(cli, tmp_path):
    rng = np.random.default_rng(0)
    wide, narrow = rng.standard_normal((4, 512)).astype(np.float32), rng.standard_normal((4, 64)).astype(np.float32)
    save_file({"wide": wide, "narrow": narrow, "bias": np.ones(4, np.float32)}, str(tmp_path / "m.safetensors"))
    result = cli("convert", tmp_path / "m.safetensors", tmp_path / "m.gguf", "--dtype", "q6_k")
    assert result.code == 0, result.stderr
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    assert tensors["wide"].tensor_type == Q.Q6_K and tensors["narrow"].tensor_type == Q.Q8_0
    assert tensors["bias"].tensor_type == Q.F32
    assert np.asarray(tensors["wide"].data).tobytes() == _kquants.quantize_q6_k(wide).tobytes()
    assert "1 tensor quantized to Q6_K is within" in result.stderr and "1 tensor quantized to Q8_0" in result.stderr
