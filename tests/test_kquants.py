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


@pytest.mark.parametrize("kind", ["q6_k", "q4_k"])
def test_k_quant_blocks_are_the_reference_quantizer_s_byte_for_byte(kind):
    quantize = getattr(_kquants, f"quantize_{kind}")
    for row, values in enumerate(GOLDEN["inputs"]):
        assert quantize(values).tobytes() == GOLDEN[kind][row].tobytes(), row


def test_q6_k_blocks_read_back_within_half_a_step():
    values = GOLDEN["inputs"][2]
    blocks = _kquants.quantize_q6_k(values)
    back = quants.dequantize(blocks.reshape(1, -1), Q.Q6_K).reshape(-1)
    steps = np.repeat(_kquants.q6_k_steps(blocks), 16)
    assert np.all(np.abs(back - values) <= steps * 0.5 + 1e-7)
    blocks = _kquants.quantize_q4_k(values)  # (with a min: within a step, the min's own rounding aside)
    back = quants.dequantize(blocks.reshape(1, -1), Q.Q4_K).reshape(-1)
    assert np.all(np.abs(back - values) <= np.repeat(_kquants.q4_k_steps(blocks), 32) * 1.5)


@pytest.mark.parametrize("kind, fallback", [("q6_k", "Q8_0"), ("q4_k", "Q5_0")])
def test_convert_writes_k_quants_and_falls_back_as_llama_cpp_does(cli, tmp_path, kind, fallback):
    rng = np.random.default_rng(0)
    wide, narrow = rng.standard_normal((4, 512)).astype(np.float32), rng.standard_normal((4, 64)).astype(np.float32)
    save_file({"wide": wide, "narrow": narrow, "bias": np.ones(4, np.float32)}, str(tmp_path / "m.safetensors"))
    result = cli("convert", tmp_path / "m.safetensors", tmp_path / "m.gguf", "--dtype", kind)
    assert result.code == 0, result.stderr
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    assert tensors["wide"].tensor_type == Q[kind.upper()] and tensors["narrow"].tensor_type == Q[fallback]
    assert tensors["bias"].tensor_type == Q.F32
    assert np.asarray(tensors["wide"].data).tobytes() == getattr(_kquants, f"quantize_{kind}")(wide).tobytes()
    assert f"1 tensor quantized to {kind.upper()} is within" in result.stderr
    assert f"1 tensor quantized to {fallback} is within" in result.stderr


def _use_more_bits(i, n):  # llama-quant.cpp's, written out
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def test_q4_k_m_picks_each_tensor_s_type_as_llama_cpp_s_quantizer_does(cli, tmp_path):
    """Q4_K_M: Q4_K, with Q6_K for attn_v and ffn_down in the layers llama.cpp gives more
    bits (use_more_bits) and for output.weight; 1-D tensors F32; rows short of 256 falling back."""
    rng = np.random.default_rng(0)
    layers, tensors = 16, {}
    for i in range(layers):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            tensors[f"blk.{i}.{name}.weight"] = rng.standard_normal((2, 256)).astype(np.float32)
        tensors[f"blk.{i}.attn_norm.weight"] = np.ones(256, np.float32)
    tensors["token_embd.weight"] = rng.standard_normal((4, 256)).astype(np.float32)
    tensors["output.weight"] = rng.standard_normal((4, 256)).astype(np.float32)
    tensors["narrow.weight"] = rng.standard_normal((4, 64)).astype(np.float32)
    save_file(tensors, str(tmp_path / "m.safetensors"))
    result = cli("convert", tmp_path / "m.safetensors", tmp_path / "m.gguf", "--dtype", "q4_k_m")
    assert result.code == 0, result.stderr
    got = {t.name: t.tensor_type for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    for i in range(layers):
        more = Q.Q6_K if _use_more_bits(i, layers) else Q.Q4_K
        assert got[f"blk.{i}.attn_v.weight"] == more and got[f"blk.{i}.ffn_down.weight"] == more, i
        assert got[f"blk.{i}.attn_q.weight"] == Q.Q4_K and got[f"blk.{i}.attn_norm.weight"] == Q.F32
    assert got["output.weight"] == Q.Q6_K and got["token_embd.weight"] == Q.Q4_K
    assert got["narrow.weight"] == Q.Q5_0  # (Q4_K's fallback)
    # tied embeddings (no output.weight): token_embd.weight takes output's Q6_K
    del tensors["output.weight"]
    save_file(tensors, str(tmp_path / "tied.safetensors"))
    assert cli("convert", tmp_path / "tied.safetensors", tmp_path / "tied.gguf", "--dtype", "q4_k_m").code == 0
    got = {t.name: t.tensor_type for t in gguf.GGUFReader(str(tmp_path / "tied.gguf")).tensors}
    assert got["token_embd.weight"] == Q.Q6_K


def test_blocks_made_on_every_core_are_the_blocks_made_on_one(monkeypatch):
    import os

    values = np.random.default_rng(1).standard_normal(256 * 2048).astype(np.float32)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    parallel = _kquants.quantize_q6_k(values)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert parallel.tobytes() == _kquants.quantize_q6_k(values).tobytes()
