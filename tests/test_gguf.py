"""GGUF read by treecli's own bounded header parser (issue 34, item 3), checked against
the gguf package: ``gguf.GGUFWriter`` writes the files, ``gguf.GGUFReader`` and its
dequantization are the oracle, bit for bit."""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest

import treecli
from safetensors.numpy import save_file
from treecli import _tree
from treecli._keypath import format_keypath

from .conftest import assert_clean_error

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q  # noqa: E402


def finished(writer) -> None:
    """A gguf.GGUFWriter's file written out and closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def random_blocks(kind, rows: int, blocks: int, rng) -> np.ndarray:
    """Raw blocks of a quantized type gguf cannot quantize (the K-quants): random bytes,
    each block's leading f16 scale kept small so that values stay finite."""
    block, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, blocks * size), dtype=np.uint8)
    raw.view(np.uint8).reshape(rows, blocks, size)[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 64)).astype(np.float32)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_string("general.name", "tiny")
    writer.add_token_list([f"tok{i}" for i in range(1000)])
    writer.add_array("llama.rope.freqs", [0.5, 1.5])
    writer.add_tensor("token_embd.weight", a)
    writer.add_tensor("blk.0.attn_q.weight", a.astype(np.float16))
    writer.add_tensor("blk.0.attn_k.weight", a.astype(ml_dtypes.bfloat16).view(np.uint16), raw_dtype=Q.BF16)
    writer.add_tensor("blk.0.norm.weight", np.arange(64, dtype=np.float64))
    writer.add_tensor("blk.0.ids", np.arange(10, dtype=np.int32))
    for kind in (Q.Q8_0, Q.Q4_0, Q.Q5_1):
        data = quants.quantize(a, kind)
        writer.add_tensor(f"blk.1.{kind.name.lower()}.weight", data, raw_shape=data.shape, raw_dtype=kind)
    for kind in (Q.Q4_K, Q.Q6_K):
        data = random_blocks(kind, 3, 2, rng)
        writer.add_tensor(f"blk.1.{kind.name.lower()}.weight", data, raw_shape=data.shape, raw_dtype=kind)
    finished(writer)
    return path


def expected_arrays(path) -> dict[str, np.ndarray]:
    out = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        data = tensor.data
        if tensor.tensor_type == Q.BF16:
            data = data.view(ml_dtypes.bfloat16)
        elif tensor.tensor_type not in (Q.F32, Q.F16, Q.F64, Q.I32):
            with np.errstate(all="ignore"):
                data = quants.dequantize(data, tensor.tensor_type).astype(np.float32)
        out[tensor.name] = np.asarray(data)
    return out


def test_every_tensor_reads_as_gguf_reads_and_dequantizes_it(model):
    got = {format_keypath(kp): leaf for kp, leaf in _tree.flatten(treecli.load(model))}
    expected = expected_arrays(model)
    assert set(got) == set(expected)
    for name, array in expected.items():
        leaf = got[name]
        assert tuple(leaf.shape) == array.shape and leaf.dtype == array.dtype, name
        assert np.asarray(leaf).tobytes() == array.tobytes(), name
        assert np.asarray(leaf[1:]).tobytes() == array[1:].tobytes(), name


def test_show_prints_the_metadata_and_the_quantized_types(cli, model):
    shown = cli("show", model)
    assert shown.code == 0, shown.stderr
    assert "quantized: 1 Q4_0, 1 Q4_K, 1 Q5_1, 1 Q6_K, 1 Q8_0" in shown.stdout
    document = cli("show", model, "--json").json
    assert document["metadata"]["general.name"] == "tiny"
    # (issue 43) metadata keeps its types: numbers as numbers, arrays as arrays, bounded
    assert document["metadata"]["llama.block_count"] == 2
    assert document["metadata"]["llama.rope.freqs"] == [0.5, 1.5]
    assert document["metadata"]["tokenizer.ggml.tokens"] == {"length": 1000,
                                                             "first": [f"tok{i}" for i in range(256)]}


def test_show_tells_each_tensor_s_stored_type_and_size(cli, model):
    """Issue 43, item 1: a Q4_0 tensor is float32 [4, 64] to read, 8 blocks of 18 bytes on disk."""
    document = cli("show", model, "--json").json
    leaves = {leaf["keypath"]: leaf for leaf in document["leaves"]}
    q4 = leaves["blk.1.q4_0.weight"]
    assert (q4["dtype"], q4["nbytes"], q4["stored_dtype"], q4["stored_nbytes"]) == ("float32", 1024, "Q4_0", 144)
    q6 = leaves["blk.1.q6_k.weight"]
    assert (q6["shape"], q6["stored_dtype"], q6["stored_nbytes"]) == ([3, 512], "Q6_K", 3 * 2 * 210)
    plain = leaves["blk.0.attn_k.weight"]
    assert (plain["stored_dtype"], plain["stored_nbytes"]) == ("bfloat16", plain["nbytes"])
    assert document["stored_bytes"] == sum(leaf["stored_nbytes"] for leaf in leaves.values())
    lines = cli("show", model, "--flat").stdout.splitlines()
    assert lines[0].endswith(f"{document['stored_bytes'] * 8 / document['total_params']:.2f} bits per weight")
    row = next(line.split() for line in lines if line.startswith("blk.1.q4_0.weight"))
    assert row[1:] == ["[4,", "64]", "float32", "256", "1.0", "KiB", "Q4_0", "144", "B"]
    assert any(line.split()[:2] == ["stored", "arrays"] for line in lines)  # (the totals' header)
    totals = {line.split()[0]: line.split()[1:3] for line in lines if line.startswith(("Q4_0 ", "Q6_K "))}
    assert totals == {"Q4_0": ["1", "256"], "Q6_K": ["1", "1.5"]}


def test_convert_to_safetensors_dequantizes_and_keeps_floats_bit_exact(cli, model, tmp_path):
    from safetensors.numpy import load_file

    result = cli("convert", model, tmp_path / "m.safetensors")
    assert result.code == 0, result.stderr
    written = load_file(str(tmp_path / "m.safetensors"))
    for name, array in expected_arrays(model).items():
        if array.dtype == ml_dtypes.bfloat16:
            assert written[name].view(np.uint16).tobytes() == array.view(np.uint16).tobytes(), name
        else:
            assert written[name].tobytes() == array.tobytes(), name


def header(tensors: int = 1, keys: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, keys)


def string(text: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(text) if length is None else length) + text


def tensor(name: bytes, dims: list[int], kind: int, offset: int) -> bytes:
    return string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", kind, offset)


def padded(head: bytes, data: bytes) -> bytes:
    return head + b"\0" * (-len(head) % 32) + data


@pytest.mark.parametrize("content, fragment", [
    (header(tensors=10**12), "declares 1,000,000,000,000 tensors"),
    (header(tensors=0, keys=1) + string(b"general.name") + struct.pack("<I", 8) + string(b"x", 2**40),
     "runs past the end of the file"),
    (padded(header() + tensor(b"w", [4], 0, 8), b"\0" * 32), "not aligned to 32"),
    (padded(header(2) + tensor(b"a", [8], 0, 0) + tensor(b"b", [8], 0, 0), b"\0" * 64), "overlap"),
    (padded(header() + tensor(b"w", [4], 99, 0), b"\0" * 32), "tensor type 99, which ggml does not define"),
    (padded(header() + tensor(b"w", [1000], 0, 0), b"\0" * 32), "run past the end of the file"),
    (padded(header() + tensor(b"w", [2**62, 2**62], 0, 0), b""), "elements in a file of"),
    (header(tensors=0, keys=1) + string(b"k") + struct.pack("<IIQ", 9, 8, 2**60), "runs past the end"),
    (header(tensors=0, keys=1) + string(b"k") + struct.pack("<I", 77), "value type 77"),
    (b"GGUF" + struct.pack("<I", 1) + b"\0" * 16, "GGUF version 1"),
    (padded(header(2) + tensor(b"w", [8], 0, 0) + tensor(b"w", [8], 0, 32), b"\0" * 64), "w: two tensors have this"),
    (padded(header() + tensor(b"q", [], 2, 0), b"\0" * 32), "q: a 0-d Q4_0 tensor"),
    (header(tensors=0, keys=2) + (string(b"k") + struct.pack("<I", 4) + b"\0" * 4) * 2, "key 'k' is given twice"),
    (header(tensors=0, keys=1) + string(b"k") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 40,
     "nested more than 32 deep"),
], ids=["tensor count", "string length", "misaligned", "overlapping", "unknown type", "data past the end",
        "absurd shape", "array count", "value type", "version", "a name twice", "0-d quantized", "a key twice",
        "deep arrays"])
def test_hostile_headers_are_one_line(cli, tmp_path, content, fragment):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    assert_clean_error(cli("show", path), fragment)


def test_gguf_to_gguf_keeps_metadata_types_and_quantized_blocks_as_they_are(cli, model, tmp_path):
    result = cli("convert", model, tmp_path / "again.gguf")
    assert result.code == 0 and "verified" in result.stderr, result.stderr
    before, after = gguf.GGUFReader(str(model)), gguf.GGUFReader(str(tmp_path / "again.gguf"))
    for name, field in before.fields.items():
        if name.startswith("GGUF."):
            continue
        copied = after.fields[name]
        assert copied.types == field.types, name
        assert [bytes(p) for p in copied.parts] == [bytes(p) for p in field.parts], name
    assert [(t.name, t.tensor_type, bytes(t.data)) for t in after.tensors] == \
        [(t.name, t.tensor_type, bytes(t.data)) for t in before.tensors]  # in the input's order
    # an edit keeps the order too: a cast leaf stays where its input was
    edited = cli("edit", model, "-o", tmp_path / "cast.gguf", "--cast", "blk.0.attn_q.weight=float32")
    assert edited.code == 0, edited.stderr
    assert [t.name for t in gguf.GGUFReader(str(tmp_path / "cast.gguf")).tensors] == [t.name for t in before.tensors]


def test_float_and_integer_leaves_write_gguf_that_gguf_reads(tmp_path):
    rng = np.random.default_rng(1)
    tree = {"model": {"embed": rng.standard_normal((8, 32)).astype(ml_dtypes.bfloat16),
                      "w": rng.standard_normal((3, 5)).astype(np.float32),
                      "h": rng.standard_normal(7).astype(np.float16), "d": rng.standard_normal(2)},
            "ids": np.arange(5, dtype=np.int64), "mask": np.arange(4, dtype=np.int8)}
    treecli.save(tree, tmp_path / "out.gguf", metadata={"general.name": "mine"})
    reader = gguf.GGUFReader(str(tmp_path / "out.gguf"))
    assert bytes(reader.fields["general.name"].parts[-1]) == b"mine"
    got = {t.name: t for t in reader.tensors}
    flat = {"model.embed": tree["model"]["embed"], "model.w": tree["model"]["w"], "model.h": tree["model"]["h"],
            "model.d": tree["model"]["d"], "ids": tree["ids"], "mask": tree["mask"]}
    for name, array in flat.items():
        assert list(reversed(got[name].shape.tolist())) == list(array.shape), name
        assert bytes(got[name].data) == array.tobytes(), name
    with pytest.raises(treecli.TreecliError, match="GGUF cannot hold 1 leaf"):
        treecli.save({"b": np.zeros(2, bool)}, tmp_path / "bool.gguf")


def test_every_command_works_on_quantized_gguf_in_float(cli, model, tmp_path):
    from safetensors.numpy import load_file

    expected = expected_arrays(model)["blk.1.q8_0.weight"]
    got = cli("get", model, "blk.1.q8_0.weight", "-o", tmp_path / "q.npy")
    assert got.code == 0 and np.load(tmp_path / "q.npy").tobytes() == expected.tobytes(), got.stderr
    assert cli("show", model, "--stats").code == 0
    averaged = cli("average", model, model, "-o", tmp_path / "avg.safetensors")
    assert averaged.code == 0, averaged.stderr
    assert load_file(str(tmp_path / "avg.safetensors"))["blk.1.q8_0.weight"].tobytes() == expected.tobytes()
    sliced = cli("slice", model, "--index", "blk.1.q8_0.weight=:2", "-o", tmp_path / "s.safetensors")
    assert sliced.code == 0, sliced.stderr
    assert load_file(str(tmp_path / "s.safetensors"))["blk.1.q8_0.weight"].tobytes() == expected[:2].tobytes()
    assert cli("diff", model, tmp_path / "avg.safetensors").code == 0  # a model averaged with itself: itself


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_convert_quantizes_weights_into_gguf_as_gguf_quantizes_them(cli, tmp_path, kind):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(2)
    weights = {"blk.0.w": rng.standard_normal((8, 64)).astype(np.float32),
               "blk.0.norm": np.ones(64, np.float32), "blk.0.odd": rng.standard_normal((3, 40)).astype(np.float32)}
    save_file(weights, str(tmp_path / "m.safetensors"))
    result = cli("convert", tmp_path / "m.safetensors", tmp_path / "m.gguf", "--dtype", kind)
    assert result.code == 0 and "verified" in result.stderr, result.stderr
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    assert tensors["blk.0.w"].tensor_type == Q[kind.upper()]
    assert bytes(tensors["blk.0.w"].data) == quants.quantize(weights["blk.0.w"], Q[kind.upper()]).tobytes()
    assert tensors["blk.0.norm"].tensor_type == Q.F32 and tensors["blk.0.odd"].tensor_type == Q.F32  # as llama.cpp
    assert_clean_error(cli("convert", tmp_path / "m.safetensors", tmp_path / "o.npz", "--dtype", kind),
                       "quantizes into a GGUF file")


def test_metadata_arrays_nested_five_deep_read_as_gguf_py_reads_them(cli, tmp_path):
    nested = struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 4 + struct.pack("<IQ", 4, 2) + struct.pack("<II", 7, 8)
    path = tmp_path / "deep.gguf"
    path.write_bytes(header(tensors=0, keys=1) + string(b"k") + nested)
    assert gguf.GGUFReader(str(path)).fields["k"] is not None  # the reference reads it
    shown = cli("show", path, "--json")
    assert shown.code == 0, shown.stderr
    assert shown.json["metadata"]["k"] == [[[[[7, 8]]]]]


def test_a_big_endian_gguf_reads_as_gguf_py_reads_it(cli, tmp_path):
    from gguf.constants import GGUFEndian

    path = tmp_path / "be.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=GGUFEndian.BIG)
    writer.add_uint32("llama.block_count", 2)
    writer.add_array("llama.rope.freqs", [0.5, 1.5])
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    writer.add_tensor("w", w.copy())  # (gguf-py swaps the bytes as it writes)
    writer.add_tensor("ids", np.arange(5, dtype=np.int32))
    finished(writer)
    shown = cli("show", path, "--json")
    assert shown.code == 0, shown.stderr
    assert shown.json["metadata"]["llama.block_count"] == 2 and shown.json["metadata"]["llama.rope.freqs"] == \
        [0.5, 1.5]
    got = treecli.load(path)
    assert np.asarray(got["w"]).tolist() == w.tolist() and np.asarray(got["ids"]).tolist() == [0, 1, 2, 3, 4]
    assert np.asarray(got["w"][1:]).tolist() == w[1:].tolist()
    assert cli("diff", path, tmp_path / "be.gguf").code == 0
    treecli.save({"w": w, "ids": np.arange(5, dtype=np.int32)}, tmp_path / "le.safetensors")
    assert cli("diff", path, tmp_path / "le.safetensors", "--where", "w", "--where", "ids").code == 0


@pytest.mark.parametrize("kind", [Q.Q8_1, Q.Q8_K, Q.Q1_0])
def test_blocks_gguf_does_not_dequantize_are_one_line_and_copy_as_they_are(cli, tmp_path, kind):
    path = tmp_path / "q.gguf"
    block, size = GGML_QUANT_SIZES[kind]
    raw = np.zeros((2, size), np.uint8)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.w", raw, raw_shape=raw.shape, raw_dtype=kind)
    writer.add_tensor("blk.0.norm", np.ones(4, np.float32))
    finished(writer)
    shown = cli("show", path)
    assert shown.code == 0 and f"1 {kind.name}" in shown.stdout, shown.stderr
    assert_clean_error(cli("get", path, "blk.0.w"), f"blk.0.w: {kind.name} blocks, which the gguf package does not "
                                                    "dequantize")
    assert_clean_error(cli("convert", path, tmp_path / "q.safetensors"), f"{kind.name} blocks")
    copied = cli("convert", path, tmp_path / "again.gguf")
    assert copied.code == 0, copied.stderr
    again = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "again.gguf")).tensors}
    assert again["blk.0.w"].tensor_type == kind and bytes(again["blk.0.w"].data) == raw.tobytes()


def test_a_leaf_of_more_dimensions_than_ggml_holds_is_not_written(tmp_path):
    with pytest.raises(treecli.TreecliError, match="GGUF cannot hold 1 leaf") as info:
        treecli.save({"w": np.ones((1,) * 5, np.float32), "b": np.ones(2, np.float32)}, tmp_path / "m.gguf")
    assert info.value.details == ["w (5 dimensions; GGUF holds at most 4)"]
    assert not (tmp_path / "m.gguf").exists()
    treecli.save({"w": np.ones((1, 2, 3, 4), np.float32)}, tmp_path / "four.gguf")
    assert gguf.GGUFReader(str(tmp_path / "four.gguf")).tensors[0].name == "w"


def test_show_names_the_model_a_gguf_s_metadata_describes(cli, tmp_path):
    """Issue 42, item 4: general.architecture, {arch}.block_count and the tokenizer's tokens."""
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_token_list([f"t{i}" for i in range(40)])
    writer.add_tensor("token_embd.weight", np.ones((40, 8), np.float32))
    finished(writer)
    shown = cli("show", path)
    assert shown.code == 0, shown.stderr
    assert shown.stdout.splitlines()[0].split("  ", 1)[1].startswith("gguf, llama, 2 layers, vocab 40, ")
    assert cli("show", path, "--json").json["model"] == {"architecture": "llama", "layers": 2, "vocab": 40}


def test_a_gguf_architecture_from_the_file_is_escaped_and_bounded(cli, tmp_path):
    import gguf

    path = tmp_path / "evil.gguf"
    writer = gguf.GGUFWriter(str(path), "evil\x1b[2J" + "x" * 500)
    writer.add_tensor("w", np.ones((2, 2), np.float32))
    finished(writer)
    shown = cli("show", path)
    assert shown.code == 0, shown.stderr
    head = shown.stdout.splitlines()[0]
    assert "\x1b" not in head and "evil" in head and "x" * 100 not in head


def test_a_quantizing_write_says_how_far_it_is_from_its_input(cli, tmp_path):
    """Issue 43, item 5: a lossy write is not "bit-exact": it says its largest error, in
    units of the quantization step (each block's scale) and in value."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 64)).astype(np.float32)
    save_file({"w": a, "b": np.arange(4, dtype=np.float32)}, str(tmp_path / "m.safetensors"))
    result = cli("convert", tmp_path / "m.safetensors", tmp_path / "q.gguf", "--dtype", "q8_0")
    assert result.code == 0, result.stderr
    blocks = quants.quantize(a, Q.Q8_0)
    error = np.abs(quants.dequantize(blocks, Q.Q8_0) - a).reshape(-1, 32).max(axis=1)
    scales = np.abs(blocks.reshape(-1, 34)[:, :2].copy().view(np.float16).astype(np.float32)).reshape(-1)
    lines = [line for line in result.stderr.splitlines() if "verified" in line]
    assert lines == [f"treecli: verified: 1 tensor quantized to Q8_0 is within {(error / scales).max():.2f} of a "
                     f"quantization step of its input (largest error {error.max():.3g}); every other leaf is "
                     "bit-exact"], result.stderr
    plain = cli("convert", tmp_path / "m.safetensors", tmp_path / "copy.gguf")
    assert "verified: every leaf is bit-exact" in plain.stderr


def test_a_value_edit_of_a_quantized_tensor_writes_it_back_in_its_own_type(cli, model, tmp_path):
    """Issue 43, item 4: `edit --scale` of a Q8_0 tensor into a GGUF output writes Q8_0, and says
    it requantized; a type treecli cannot quantize yet (Q4_K) is written F32, and said too."""
    expected = expected_arrays(model)
    result = cli("edit", model, "-o", tmp_path / "e.gguf", "--scale", "blk.1.q8_0.weight=2")
    assert result.code == 0, result.stderr
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "e.gguf")).tensors}
    scaled = tensors["blk.1.q8_0.weight"]
    assert scaled.tensor_type == Q.Q8_0
    twice = quants.quantize(expected["blk.1.q8_0.weight"] * 2, Q.Q8_0)
    assert np.asarray(scaled.data).tobytes() == twice.tobytes()
    assert "requantized to Q8_0: 1 tensor, within" in result.stderr and "bit-exact" not in result.stderr
    assert tensors["blk.1.q4_0.weight"].tensor_type == Q.Q4_0  # (not edited: its blocks as they were)
    k_quant = cli("edit", model, "-o", tmp_path / "k.gguf", "--scale", "blk.1.q4_k.weight=2")
    assert k_quant.code == 0 and "requantized to Q4_K: 1 tensor" in k_quant.stderr, k_quant.stderr
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "k.gguf")).tensors}
    assert tensors["blk.1.q4_k.weight"].tensor_type == Q.Q4_K
    from treecli.formats import _kquants

    low_bits = tmp_path / "low.gguf"  # Q3_K and Q2_K, written since; IQ3_S, a type treecli does not write yet
    writer = gguf.GGUFWriter(str(low_bits), "llama")
    values = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    for name, kind in (("q3", Q.Q3_K), ("q2", Q.Q2_K)):
        blocks = getattr(_kquants, f"quantize_{kind.name.lower()}")(values).reshape(2, -1)
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)
    data = random_blocks(Q.IQ3_S, 2, 1, np.random.default_rng(0))
    writer.add_tensor("iq", data, raw_shape=data.shape, raw_dtype=Q.IQ3_S)
    finished(writer)
    lossy = cli("edit", low_bits, "-o", tmp_path / "f32.gguf", "--scale", "*=2")
    assert lossy.code == 0, lossy.stderr
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "f32.gguf")).tensors}
    assert tensors["iq"].tensor_type == Q.F32
    assert "1 tensor stored IQ3_S is written F32: treecli does not write IQ3_S yet" in lossy.stderr
    for name, kind in (("q3", Q.Q3_K), ("q2", Q.Q2_K)):
        before = quants.dequantize(getattr(_kquants, f"quantize_{kind.name.lower()}")(values).reshape(2, -1), kind)
        assert tensors[name].tensor_type == kind and f"requantized to {kind.name}: 1 tensor" in lossy.stderr
        again = getattr(_kquants, f"quantize_{kind.name.lower()}")(before * 2)
        assert np.asarray(tensors[name].data).tobytes() == again.tobytes()


def test_an_average_of_quantized_tensors_stays_quantized_and_a_copy_keeps_its_blocks(cli, model, tmp_path):
    result = cli("average", model, model, "-o", tmp_path / "a.gguf")
    assert result.code == 0, result.stderr
    before = {t.name: np.asarray(t.data).tobytes() for t in gguf.GGUFReader(str(model)).tensors}
    after = {t.name: (t.tensor_type, np.asarray(t.data).tobytes())
             for t in gguf.GGUFReader(str(tmp_path / "a.gguf")).tensors}
    for kind in (Q.Q8_0, Q.Q4_0):  # a model averaged with itself: its own blocks again
        name = f"blk.1.{kind.name.lower()}.weight"
        assert after[name] == (kind, before[name]), name


def test_a_slice_of_quantized_rows_keeps_its_blocks_and_one_across_them_says_why_it_is_f32(cli, model, tmp_path):
    result = cli("slice", model, "--index", "blk.1.q8_0.weight=1:3", "-o", tmp_path / "rows.gguf")
    assert result.code == 0, result.stderr
    before = next(t for t in gguf.GGUFReader(str(model)).tensors if t.name == "blk.1.q8_0.weight")
    after = next(t for t in gguf.GGUFReader(str(tmp_path / "rows.gguf")).tensors if t.name == "blk.1.q8_0.weight")
    assert after.tensor_type == Q.Q8_0 and np.asarray(after.data).tobytes() == np.asarray(before.data)[1:3].tobytes()
    result = cli("slice", model, "--index", "blk.1.q8_0.weight=:, :40", "-o", tmp_path / "cut.gguf")
    assert result.code == 0, result.stderr
    assert "1 tensor stored Q8_0 is written F32: its rows are not whole Q8_0 blocks" in result.stderr
