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


@pytest.mark.parametrize("kind", ["q6_k", "q5_k", "q4_k", "q3_k", "q2_k", "iq4_nl", "iq4_xs"])
def test_k_quant_blocks_are_the_reference_quantizer_s_byte_for_byte(kind):
    from treecli.formats import _iquants

    quantize = getattr(_kquants if kind.startswith("q") else _iquants, f"quantize_{kind}")
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


@pytest.mark.parametrize("kind, fallback", [("q6_k", "Q8_0"), ("q5_k", "Q5_1"), ("q4_k", "Q5_0"), ("q3_k", "Q4_0"),
                                            ("q2_k", "Q4_0"), ("iq4_xs", "IQ4_NL")])
def test_convert_writes_k_quants_and_falls_back_as_llama_cpp_does(cli, tmp_path, kind, fallback):
    rng = np.random.default_rng(0)
    wide, narrow = rng.standard_normal((4, 512)).astype(np.float32), rng.standard_normal((4, 64)).astype(np.float32)
    save_file({"wide": wide, "narrow": narrow, "bias": np.ones(4, np.float32)}, str(tmp_path / "m.safetensors"))
    result = cli("convert", tmp_path / "m.safetensors", tmp_path / "m.gguf", "--dtype", kind)
    assert result.code == 0, result.stderr
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    assert tensors["wide"].tensor_type == Q[kind.upper()] and tensors["narrow"].tensor_type == Q[fallback]
    assert tensors["bias"].tensor_type == Q.F32
    from treecli.formats import _iquants

    module = _kquants if kind.startswith("q") else _iquants
    assert np.asarray(tensors["wide"].data).tobytes() == getattr(module, f"quantize_{kind}")(wide).tobytes()
    assert f"1 tensor quantized to {kind.upper()} is within" in result.stderr
    assert f"1 tensor quantized to {fallback} is within" in result.stderr


def _use_more_bits(i, n):  # llama-quant.cpp's, written out
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@pytest.mark.parametrize("mix, base, fallback", [("q4_k_m", Q.Q4_K, Q.Q5_0), ("q5_k_m", Q.Q5_K, Q.Q5_1)])
def test_k_m_mixes_pick_each_tensor_s_type_as_llama_cpp_s_quantizer_does(cli, tmp_path, mix, base, fallback):
    """Q4_K_M (Q5_K_M): Q4_K (Q5_K), with Q6_K for attn_v and ffn_down in the layers llama.cpp
    gives more bits (use_more_bits) and for output.weight; 1-D tensors F32; rows short of 256
    falling back."""
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
    result = cli("convert", tmp_path / "m.safetensors", tmp_path / "m.gguf", "--dtype", mix)
    assert result.code == 0, result.stderr
    got = {t.name: t.tensor_type for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    for i in range(layers):
        more = Q.Q6_K if _use_more_bits(i, layers) else base
        assert got[f"blk.{i}.attn_v.weight"] == more and got[f"blk.{i}.ffn_down.weight"] == more, i
        assert got[f"blk.{i}.attn_q.weight"] == base and got[f"blk.{i}.attn_norm.weight"] == Q.F32
    assert got["output.weight"] == Q.Q6_K and got["token_embd.weight"] == base
    assert got["narrow.weight"] == fallback
    # tied embeddings (no output.weight): token_embd.weight takes output's Q6_K
    del tensors["output.weight"]
    save_file(tensors, str(tmp_path / "tied.safetensors"))
    assert cli("convert", tmp_path / "tied.safetensors", tmp_path / "tied.gguf", "--dtype", mix).code == 0
    got = {t.name: t.tensor_type for t in gguf.GGUFReader(str(tmp_path / "tied.gguf")).tensors}
    assert got["token_embd.weight"] == Q.Q6_K


def test_blocks_made_on_every_core_are_the_blocks_made_on_one(monkeypatch):
    import os

    values = np.random.default_rng(1).standard_normal(256 * 2048).astype(np.float32)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    parallel = _kquants.quantize_q6_k(values)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert parallel.tobytes() == _kquants.quantize_q6_k(values).tobytes()


def test_a_70b_model_s_attn_v_takes_q5_k_under_q4_k_m():
    """llama.cpp's rule for its 70B models (80 layers, grouped KV heads): attn_v Q5_K where
    Q4_K_M gives Q4_K; a model of as many layers without grouped heads (65B) keeps Q4_K."""
    from treecli.formats import _mixes

    def shapes(kv_rows):
        found = {}
        for i in range(80):
            found.update({f"blk.{i}.attn_q.weight": (8192, 8192), f"blk.{i}.attn_k.weight": (kv_rows, 8192),
                          f"blk.{i}.attn_v.weight": (kv_rows, 8192), f"blk.{i}.ffn_down.weight": (8192, 28672)})
        return found

    seventy, sixty_five = _mixes.chooser(shapes(1024), "q4_k_m"), _mixes.chooser(shapes(8192), "q4_k_m")
    plain = next(i for i in range(80) if not _use_more_bits(i, 80))
    assert seventy(f"blk.{plain}.attn_v.weight") == "q5_k" and sixty_five(f"blk.{plain}.attn_v.weight") == "q4_k"
    assert seventy("blk.0.attn_v.weight") == "q6_k" and seventy(f"blk.{plain}.ffn_down.weight") == "q4_k"


@pytest.mark.parametrize("kind, steps_of, group", [("q3_k", "q3_k_steps", 16), ("q2_k", "q2_k_steps", 16)])
def test_low_bit_k_quants_read_back_within_their_steps(kind, steps_of, group):
    values = GOLDEN["inputs"][2]
    blocks = getattr(_kquants, f"quantize_{kind}")(values)
    back = quants.dequantize(blocks.reshape(1, -1), Q[kind.upper()]).reshape(-1)
    steps = np.repeat(getattr(_kquants, steps_of)(blocks), group)
    # (levels clipped at the ends of the range: a few steps out at most, as the reference)
    assert np.all(np.abs(back - values) <= steps * 4)
    assert np.median(np.abs(back - values) / steps) < 0.5


def _model_shapes(layers=16, kv_rows=64):
    shapes = {"token_embd.weight": (100, 256), "output.weight": (100, 256)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_q.weight": (256, 256), f"blk.{i}.attn_k.weight": (kv_rows, 256),
                       f"blk.{i}.attn_v.weight": (kv_rows, 256), f"blk.{i}.attn_output.weight": (256, 256),
                       f"blk.{i}.ffn_down.weight": (256, 512), f"blk.{i}.ffn_up.weight": (512, 256),
                       f"blk.{i}.attn_norm.weight": (256,)})
    return shapes


# llama-quant.cpp's rules for 16 layers, written out: (attn_v of layers 0-15, ffn_down, attn_output)
_EXPECTED = {
    "q2_k": (["q4_k"] * 16, ["q3_k"] * 16, "q3_k"),  # (4 query heads to a KV head: attn_v Q4_K)
    "q3_k_s": (["q3_k"] * 16, ["q3_k"] * 16, "q3_k"),
    "q3_k_m": (["q5_k"] * 2 + ["q4_k"] * 14, ["q5_k"] + ["q4_k"] * 15, "q4_k"),
    "q3_k_l": (["q5_k"] * 16, ["q5_k"] * 16, "q5_k"),
    "q4_k_s": (["q5_k"] * 4 + ["q4_k"] * 12, ["q5_k"] * 2 + ["q4_k"] * 14, "q4_k"),
    "q4_k": ([("q6_k" if _use_more_bits(i, 16) else "q4_k") for i in range(16)],
             [("q6_k" if _use_more_bits(i, 16) else "q4_k") for i in range(16)], "q4_k"),
    "q5_k_s": (["q5_k"] * 16, ["q5_k"] * 16, "q5_k"),
    "q6_k": (["q6_k"] * 16, ["q6_k"] * 16, "q6_k"),
}


@pytest.mark.parametrize("mix", sorted(_EXPECTED))
def test_each_mix_picks_llama_cpp_s_types_by_layer(mix):
    from treecli.formats import _mixes

    choose = _mixes.chooser(_model_shapes(kv_rows=64), mix)
    attn_v, ffn_down, attn_output = _EXPECTED[mix]
    assert [choose(f"blk.{i}.attn_v.weight") for i in range(16)] == attn_v
    assert [choose(f"blk.{i}.ffn_down.weight") for i in range(16)] == ffn_down
    assert choose("blk.3.attn_output.weight") == attn_output
    assert choose("output.weight") == "q6_k" and choose("blk.0.attn_norm.weight") is None
    assert choose("blk.5.attn_q.weight") == _mixes.MIXES[_mixes.ALIASES.get(mix, mix)]


def test_q2_k_s_attn_v_without_grouped_heads_is_q3_k():
    from treecli.formats import _mixes

    assert _mixes.chooser(_model_shapes(kv_rows=256), "q2_k")("blk.7.attn_v.weight") == "q3_k"


def _layered(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {f"blk.{i}.{name}.weight": rng.standard_normal((2, 256)).astype(np.float32)
               for i in range(4) for name in ("attn_q", "attn_v", "ffn_down")}
    tensors["output.weight"] = rng.standard_normal((4, 256)).astype(np.float32)
    save_file(tensors, str(tmp_path / "m.safetensors"))
    return tmp_path / "m.safetensors"


def test_tensor_type_overrides_the_mix_first_match_first(cli, tmp_path):
    source = _layered(tmp_path)
    result = cli("convert", source, tmp_path / "m.gguf", "--dtype", "q4_k_m", "--tensor-type", r"attn_v=q8_0",
                 "--tensor-type", r"blk\.[23]\..*=q2_k", "--tensor-type", "output=q5_0")
    assert result.code == 0, result.stderr
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    got = {t.name: t.tensor_type for t in reader.tensors}
    assert [got[f"blk.{i}.attn_v.weight"] for i in range(4)] == [Q.Q8_0] * 4
    assert got["blk.2.ffn_down.weight"] == got["blk.3.attn_q.weight"] == Q.Q2_K
    assert got["blk.0.ffn_down.weight"] == got["blk.1.attn_q.weight"] == Q.Q4_K  # (the mix, where nothing matched)
    assert got["output.weight"] == Q.Q5_0
    assert int(reader.fields["general.file_type"].parts[-1][0]) == 15  # (LLAMA_FTYPE_MOSTLY_Q4_K_M)


@pytest.mark.parametrize("args, message", [
    (["--dtype", "q4_k_m", "--tensor-type", "attn_v=q9_9"], "cannot quantize 'attn_v' to 'q9_9'"),
    (["--dtype", "q4_k_m", "--tensor-type", "attn_v(=q8_0"], "'attn_v(' is not a regular expression"),
    (["--dtype", "q4_k_m", "--tensor-type", "attn_v"], "is not REGEX=TYPE"),
    (["--tensor-type", "attn_v=q8_0"], "give a quantizing --dtype"),
])
def test_a_bad_tensor_type_is_refused_in_one_line_before_anything_is_written(cli, tmp_path, args, message):
    source = _layered(tmp_path)
    result = cli("convert", source, tmp_path / "m.gguf", *args)
    assert result.code == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "m.gguf").exists()


def test_a_requantized_gguf_says_its_new_file_type(cli, tmp_path):
    """An F16 GGUF's general.file_type (1) no longer holds once it is written Q8_0 (7)."""
    writer = gguf.GGUFWriter(str(tmp_path / "f16.gguf"), "llama")
    writer.add_file_type(1)
    writer.add_tensor("blk.0.attn_q.weight", np.random.default_rng(0).standard_normal((4, 256)).astype(np.float16))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    assert cli("convert", tmp_path / "f16.gguf", tmp_path / "q8.gguf", "--dtype", "q8_0").code == 0
    reader = gguf.GGUFReader(str(tmp_path / "q8.gguf"))
    assert int(reader.fields["general.file_type"].parts[-1][0]) == 7
    assert reader.tensors[0].tensor_type == Q.Q8_0


def test_a_verified_quantized_write_quantizes_each_tensor_once_and_still_checks_its_bytes(cli, tmp_path, monkeypatch):
    """The verification checks the blocks written against the digest of the blocks made (not
    by making them again: that doubled a quantized write's time), and still catches a
    block that differs on disk."""
    from treecli.formats import _gguf_write
    from treecli.formats import gguf as module

    rng = np.random.default_rng(0)
    save_file({f"blk.{i}.ffn_up.weight": rng.standard_normal((8, 512)).astype(np.float32) for i in range(3)},
              str(tmp_path / "m.safetensors"))
    made = []
    quantize, steps, group = module._REFERENCE["Q4_K"]
    monkeypatch.setitem(module._REFERENCE, "Q4_K", (lambda data: made.append(1) or quantize(data), steps, group))
    result = cli("convert", tmp_path / "m.safetensors", tmp_path / "m.gguf", "--dtype", "q4_k")
    assert result.code == 0 and "3 tensors quantized to Q4_K are within" in result.stderr, result.stderr
    assert len(made) == 3
    real_write = _gguf_write._write_blocks
    flipped = []

    def one_bit_flipped(f, leaf, options):  # the first tensor's byte 20 on disk differs from the block made
        at = f.tell()
        real_write(f, leaf, options)
        if not flipped:
            end = f.tell()
            flipped.append(int(leaf.read_raw(20, 21)[0]) ^ 1)
            f.seek(at + 20)
            f.write(bytes(flipped))
            f.seek(end)

    monkeypatch.setattr(_gguf_write, "_write_blocks", one_bit_flipped)
    broken = cli("convert", tmp_path / "m.safetensors", tmp_path / "b.gguf", "--dtype", "q4_k")
    assert broken.code != 0 and "verification failed" in broken.stderr, broken.stderr
    assert not (tmp_path / "b.gguf").exists()


def test_dtype_float32_is_what_dequantizes_a_gguf_s_quantized_tensors(cli, tmp_path):
    """Issue 43, item 4: a copy keeps a quantized tensor's blocks; --dtype float32 (any float)
    is what writes its values, dequantized, and they are not quantized again."""
    rng = np.random.default_rng(0)
    save_file({"blk.0.ffn_up.weight": rng.standard_normal((4, 256)).astype(np.float32)}, str(tmp_path / "m.safetensors"))
    assert cli("convert", tmp_path / "m.safetensors", tmp_path / "q.gguf", "--dtype", "q4_k").code == 0
    assert cli("convert", tmp_path / "q.gguf", tmp_path / "copy.gguf").code == 0
    result = cli("convert", tmp_path / "q.gguf", tmp_path / "f32.gguf", "--dtype", "float32")
    assert result.code == 0 and "requantized" not in result.stderr, result.stderr
    quantized = gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors[0]
    assert gguf.GGUFReader(str(tmp_path / "copy.gguf")).tensors[0].tensor_type == Q.Q4_K
    plain = gguf.GGUFReader(str(tmp_path / "f32.gguf")).tensors[0]
    assert plain.tensor_type == Q.F32
    assert np.array_equal(np.asarray(plain.data).reshape(4, 256),
                          quants.dequantize(np.asarray(quantized.data), Q.Q4_K).reshape(4, 256))
