import json
import re
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import deserialize, safe_open
from safetensors.numpy import save_file

import treecli
from treecli import _tree
from treecli._errors import FormatError, TreecliError
from treecli._keypath import format_keypath

from .conftest import BF16, assert_clean_error, bits, raw_safetensors


def flat_leaves(tree):
    return {format_keypath(kp): leaf for kp, leaf in _tree.flatten(tree)}


def test_reads_every_dtype_bit_exactly_like_the_reference(mixed_file):
    path, tensors = mixed_file
    with treecli.open(path) as ckpt:
        leaves = flat_leaves(ckpt.tree)
        assert ckpt.metadata == {"format": "np", "note": "made by the reference library"}
        assert set(leaves) == set(tensors)
        for name, expected in tensors.items():
            got = leaves[name].read()
            assert got.dtype == expected.dtype and got.shape == expected.shape, name
            assert bits(got) == bits(expected), name


def test_reads_the_corpus_dtype_zoo_like_deserialize():
    from pathlib import Path

    path = Path(__file__).parents[1].parent / "shared/corpus/safetensors/dtype_zoo_with_metadata.safetensors"
    if not path.exists():
        pytest.skip("shared corpus not present")
    reference = {name: info for name, info in deserialize(path.read_bytes())}
    leaves = flat_leaves(treecli.load(path))
    assert set(leaves) == set(reference)
    for name, info in reference.items():
        assert list(leaves[name].shape) == info["shape"]
        assert bits(leaves[name].read()) == bytes(info["data"]), name


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_read_index_equals_numpy_indexing(tmp_path_factory, data):
    shape = tuple(data.draw(st.lists(st.integers(0, 6), min_size=0, max_size=4)))
    array = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape).astype(BF16)
    path = tmp_path_factory.mktemp("idx") / "a.safetensors"
    save_file({"a": array}, str(path))
    index = []
    for dim in shape:
        kind = data.draw(st.sampled_from(["int", "slice", "full", "none"]))
        if kind == "int" and dim:
            index.append(data.draw(st.integers(-dim, dim - 1)))
        elif kind == "slice":
            step = data.draw(st.sampled_from([None, 1, 2, 3, -1, -2]))
            index.append(slice(data.draw(st.one_of(st.none(), st.integers(-8, 8))),
                               data.draw(st.one_of(st.none(), st.integers(-8, 8))), step))
        elif kind == "none":
            index.append(None)
            index.append(slice(None))
        else:
            index.append(slice(None))
    if index and data.draw(st.booleans()):
        index = [Ellipsis] + index[len(index) // 2:]
    index = tuple(index)
    leaf = treecli.load(path)["a"]
    got = leaf.read(index)
    expected = array[index]
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert bits(got) == bits(np.ascontiguousarray(expected))


def test_read_index_touches_only_the_bytes_of_the_rows_it_needs(tmp_path):
    array = np.arange(8 * 256 * 256, dtype=np.float32).reshape(8, 256, 256)
    path = tmp_path / "stack.safetensors"
    save_file({"w": array}, str(path))
    leaf = treecli.load(path)["w"]
    assert np.array_equal(leaf.read((3,)), array[3])
    assert leaf.reader.bytes_read == 256 * 256 * 4
    assert np.array_equal(leaf.read((slice(None), 0, slice(0, 8))), array[:, 0, :8])


# --- malformed files: each gets its own clear error -----------------------------------------


def _entry(dtype="F32", shape=(1,), offsets=(0, 4)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


BAD_FILES = {
    "header_len_past_eof": (raw_safetensors({"a": _entry()}, b"\0" * 4, header_len=1000), "truncated"),
    "header_len_huge": (raw_safetensors({"a": _entry()}, b"\0" * 4, header_len=2**63), "exceeds"),
    "data_short": (raw_safetensors({"a": _entry(offsets=(0, 4))}, b"\0" * 3), "truncated"),
    "trailing_bytes": (raw_safetensors({"a": _entry()}, b"\0" * 4 + b"extra_bogus_data_for_polyglot_file"), "trailing"),
    "overlap": (raw_safetensors({"a": _entry(), "b": _entry()}, b"\0" * 4), "overlaps"),
    "gap": (raw_safetensors({"a": _entry(), "b": _entry(offsets=(8, 12))}, b"\0" * 12), "gap"),
    "end_before_begin": (raw_safetensors({"a": _entry(offsets=(4, 0))}, b"\0" * 4), "data_offsets"),
    "negative": (raw_safetensors({"a": _entry(offsets=(-4, 0))}, b""), "data_offsets"),
    "float_offset": (raw_safetensors('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0.0,4]}}', b"\0" * 4),
                     "data_offsets"),
    "size_mismatch": (raw_safetensors({"a": _entry(shape=(2,))}, b"\0" * 4), "needs 8"),
    "size_overflow": (raw_safetensors({"a": _entry(shape=(2, 18446744073709551614), offsets=(0, 16))}, b"\0" * 16),
                      "overflows 64 bits"),
    "duplicate_key": (raw_safetensors('{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
                                      '"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
                      "duplicate key 'w'"),
    "not_utf8": (raw_safetensors(b'{"\xff":1}'), "UTF-8"),
    # found by fuzz/fuzz_formats.py typed: msgspec skipped a metadata key that is not UTF-8
    "metadata_not_utf8": (raw_safetensors(b'{"__metadata__":{"\x93":"v"},"w":{"dtype":"F32","shape":[1],'
                                          b'"data_offsets":[0,4]}}', b"\0" * 4), "UTF-8"),
    "not_object": (raw_safetensors("[1, 2]"), "not an object"),
    "nan_literal": (raw_safetensors('{"a": NaN}'), "NaN"),
    "deep_nesting": (raw_safetensors("[" * 100_000 + "]" * 100_000), "nested too deeply"),
    "unknown_dtype": (raw_safetensors({"a": _entry(dtype="F128")}, b"\0" * 4), "unknown dtype"),
    # found by hypothesis (typed against exact): a dtype that is a list or an object was an internal TypeError
    "list_dtype": (raw_safetensors({"a": _entry(dtype=[1])}, b"\0" * 4), "unknown dtype"),
    "object_dtype": (raw_safetensors({"a": _entry(dtype={"k": "F32"})}, b"\0" * 4), "unknown dtype"),
    "metadata_not_str": (raw_safetensors({"__metadata__": {"a": 1}}), "__metadata__"),
    "missing_shape": (raw_safetensors({"a": {"dtype": "F32", "data_offsets": [0, 4]}}, b"\0" * 4), "'shape'"),
    "bad_shape": (raw_safetensors({"a": _entry(shape=(-1,))}, b"\0" * 4), "shape"),
    "bool_shape": (raw_safetensors('{"a":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}}', b"\0" * 4), "shape"),
    "bom": (raw_safetensors(b"\xef\xbb\xbf{}"), "not valid JSON"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_malformed_headers_are_format_errors(tmp_path, name):
    content, fragment = BAD_FILES[name]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(FormatError) as info:
        treecli.load(path)
    assert fragment in str(info.value)
    assert str(path) in str(info.value)
    # Never more permissive than the reference (which is last-wins on duplicates: we refuse).
    if name != "duplicate_key":
        with pytest.raises(Exception):
            deserialize(content)


@pytest.mark.parametrize(
    "content",
    [
        raw_safetensors("  " + json.dumps({"a": _entry()}) + "   ", b"\0" * 4),  # padded header
        raw_safetensors({"b": _entry(offsets=(4, 8)), "a": _entry()}, b"\0" * 8),  # out of order, contiguous
        raw_safetensors({}),  # no tensors
        raw_safetensors({"a": _entry(shape=(2, 0), offsets=(0, 0)), "s": _entry(shape=())}, b"\0" * 4),
        raw_safetensors({"__metadata__": None, "a": _entry()}, b"\0" * 4),  # null metadata
        raw_safetensors({"a": {"data_offsets": [0, 4], "extra": {"k": [1]}, "shape": [1], "dtype": "F32"}},
                        b"\0" * 4),  # other field order, an unknown field
    ],
)
def test_valid_edge_cases_load_like_the_reference(tmp_path, content):
    path = tmp_path / "ok.safetensors"
    path.write_bytes(content)
    leaves = flat_leaves(treecli.load(path))
    reference = dict(deserialize(content))
    assert set(leaves) == set(reference) - {""} or not reference
    for name, info in reference.items():
        assert bits(leaves[name].read()) == bytes(info["data"])


_F32 = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
# Headers that only the exact parser reads right, beside what a typed decoder would take
# the last of or read wrongly: keys twice (plain, escaped, in one entry), -0, odd metadata.
SNEAKY = {
    "field_twice_and_missing_elsewhere": ('{"a":{"dtype":"F32","dtype":"U8","shape":[4],"data_offsets":[0,4]},'
                                          '"b":{"shape":[1],"data_offsets":[4,8]}}', 8),
    "key_twice_escaped": ('{"w":' + _F32 + ',"\\u0077":' + _F32 + '}', 4),
    "field_twice_escaped": ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"data\\u005foffsets":[0,8]}}', 8),
    "field_twice_spaced": ('{"a":{"dtype": "F32","shape": [2],"data_offsets": [0,8],"data_offsets" : [0,4]}}', 8),
    "minus_zero": ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[-0,4]}}', 4),
    # found by fuzz/fuzz_formats.py typed: a field the typed decoder skips, given twice
    "unknown_field_twice": ('{"a":{"dtype":"F32","s0ape":[6],"s0ape":[6],"shape":[1],"data_offsets":[0,4]}}', 4),
    "unknown_field": ('{"a":{"dtype":"F32","extra":"x","shape":[1],"data_offsets":[0,4]}}', 4),
    "metadata_twice": ('{"__metadata__":{"a":"1"},"__metadata__":{"b":"2"},"w":' + _F32 + '}', 4),
    "metadata_key_twice": ('{"__metadata__":{"a":"1","a":"2"},"w":' + _F32 + '}', 4),
    "metadata_like_an_entry": ('{"__metadata__":{"dtype":"F32","shape":"x"},"w":' + _F32 + '}', 4),
    "metadata_null": ('{"__metadata__":null,"w":' + _F32 + '}', 4),
    "metadata_nested": ('{"__metadata__":{"a":{"b":"c"}},"w":' + _F32 + '}', 4),
    "tensor_named_dtype": ('{"dtype":' + _F32 + '}', 4),
    "huge_integer": ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,100000000000000000000000]}}', 4),
    "float_dimension": ('{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}', 4),
    "zero_dimension_overflowing": ('{"a":{"dtype":"F32","shape":[4611686018427387904,4611686018427387904,0],'
                                   '"data_offsets":[0,0]}}', 0),
    "packed_dtype": ('{"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}}', 1),
    "too_many_dimensions": ('{"a":{"dtype":"F32","shape":[' + ",".join(["1"] * 65) + '],"data_offsets":[0,4]}}', 4),
    "three_offsets": ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}}', 4),
    "dashed_name": ('{"layer-0":' + _F32 + '}', 4),
    "unicode_name": ('{"couche.é.中":' + _F32 + '}', 4),
    "indented": (json.dumps({"__metadata__": {"format": "pt"}, "b": _entry(offsets=(4, 8)), "a": _entry()},
                            indent=2), 8),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES) + sorted(SNEAKY))
def test_big_header_decoding_reads_every_header_as_the_exact_parser_does(tmp_path, monkeypatch, name):
    """Big headers are decoded by msgspec, typed (a 200k-tensor header: 0.8 -> 0.4 s); what
    that would read differently (a dict keeps the last of a key given twice) must go the
    exact way, with the same tensors, metadata and errors."""
    from treecli.formats import _safetensors_header as safetensors

    if name in SNEAKY:
        header, data_bytes = SNEAKY[name]
        content = raw_safetensors(header, b"\0" * data_bytes)
    else:
        content = BAD_FILES[name][0]
    path = tmp_path / "m.safetensors"
    path.write_bytes(content)

    def outcome():
        try:
            return _parsed(safetensors, path)
        except FormatError as e:
            return str(e)

    exact = outcome()
    monkeypatch.setattr(safetensors, "_TYPED_FROM", 0)
    assert outcome() == exact
    assert isinstance(exact, str) != (name in ("metadata_null", "metadata_like_an_entry", "dashed_name",
                                               "unicode_name", "indented", "tensor_named_dtype", "unknown_field",
                                               "packed_dtype"))


INDEXES = [
    '{"metadata": {"total_size": 8}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "x.safetensors"}}',
    '{"weight_map": {"a": "s1", "a": "s2"}}',  # a key twice
    '{"weight_map": {"a": "s1", "\\u0061": "s2"}}',  # ... once escaped
    '{"metadata": {"n": 1, "n": 2}, "weight_map": {"a": "s1"}}',  # twice elsewhere
    '{"weight_map": {"a": "s1"}, "weight_map": {"b": "s2"}}',
    '{"metadata": {"x": [{"k": 1, "k": 2}]}, "weight_map": {"a": "s1"}}',  # deep inside
    '{"metadata": {"total_size": -0}, "weight_map": {"a": "s1"}}',
    '{"metadata": {"total_size": NaN}, "weight_map": {"a": "s1"}}',
    '{"metadata": {"total_size": 1e400}, "weight_map": {"a": "s1"}}',
    '{"metadata": {"note": "a \\"quoted\\" word"}, "weight_map": {"a": "s1"}}',
    '{"weight_map": {"a": 1}}', '{"weight_map": []}', "[]", '"text"', "-0", "null", '{"weight_map": {"a": "s1"}',
]


@pytest.mark.parametrize("text", INDEXES)
def test_big_index_decoding_reads_every_index_as_the_exact_parser_does(monkeypatch, text):
    """Big shard indexes (an MoE model's: 90k tensors) are decoded by msgspec where that reads
    them as the exact parser would: keys given twice anywhere, -0 and escapes go the exact way."""
    from treecli.formats import _safetensors_header as safetensors

    def outcome():
        try:
            return safetensors._parse_json(text, "model.safetensors.index.json")
        except FormatError as e:
            return str(e)

    exact = outcome()
    monkeypatch.setattr(safetensors, "_TYPED_FROM", 0)
    assert outcome() == exact


_JSON_KEYS = st.sampled_from(['"a"', '"b"', '"\\u0061"', '"dtype"', '"shape"', '"data_offsets"', '"__metadata__"',
                              '"a-0"', '"x"'])
_JSON_VALUES = st.sampled_from(['"F32"', '"U8"', '"F4"', '[1]', '[2]', '[0]', '[-0]', '[1.0]', '[0, 4]', '[4, 8]',
                                '[0, 4, 8]', '[-4, 0]', '{}', 'null', 'true', '"text"', '18446744073709551616'])


@st.composite
def _json_objects(draw, depth=0):
    """JSON object text from a small alphabet: keys twice, escaped, fields missing or odd."""
    members = []
    for _ in range(draw(st.integers(0, 4))):
        value = draw(_json_objects(depth + 1)) if depth < 2 and draw(st.booleans()) else draw(_JSON_VALUES)
        members.append(f"{draw(_JSON_KEYS)}{draw(st.sampled_from([':', ': ', ' :']))}{value}")
    return "{" + ",".join(members) + "}"


@settings(max_examples=300, deadline=None)
@given(header=_json_objects(), data_bytes=st.sampled_from([0, 4, 8, 12]))
def test_typed_header_decoding_never_reads_a_header_otherwise_than_the_exact_parser(tmp_path_factory, header,
                                                                                     data_bytes):
    from treecli.formats import _safetensors_header as safetensors

    content = raw_safetensors(header, b"\0" * data_bytes)
    size = len(content)

    def outcome(typed_from):
        original = safetensors._TYPED_FROM
        safetensors._TYPED_FROM = typed_from
        try:
            return safetensors.parse_header(lambda offset, count: content[offset:offset + count], size, "f")
        except FormatError as e:
            return str(e)
        finally:
            safetensors._TYPED_FROM = original

    assert outcome(0) == outcome(2**40)
    text = "{" + header[1:] if header.startswith("{") else header
    try:
        exact_index = safetensors._as_dict(safetensors._parse_pairs(text, "f"), "f")
    except FormatError:
        exact_index = None
    plain = safetensors._plain_json(text)
    assert plain is None or plain == exact_index


def test_a_big_sharded_checkpoint_opens_typed_as_it_opens_exactly(tmp_path, monkeypatch):
    from treecli.formats import _safetensors_header as safetensors

    directory = tmp_path / "moe"
    directory.mkdir()
    weight_map = {}
    for shard in range(3):
        name = f"model-{shard + 1:05d}-of-00003.safetensors"
        tensors = {f"model.layers.{shard}.mlp.experts.{e}.down_proj.weight_scale_inv": np.full(2, e, np.float32)
                   for e in range(500)}
        save_file(tensors, str(directory / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert len(json.dumps(weight_map)) >= safetensors._TYPED_FROM
    assert safetensors._plain_json((directory / "model.safetensors.index.json").read_text()) is not None

    def opened():
        with treecli.open(directory) as ckpt:
            return {name: (leaf.offset, leaf.shape, leaf.dtype_name, bits(leaf.read()))
                    for name, leaf in flat_leaves(ckpt.tree).items()}

    typed = opened()
    monkeypatch.setattr(safetensors, "_TYPED_FROM", 2**40)
    assert opened() == typed and len(typed) == 1500


def test_a_big_header_is_decoded_typed_and_reads_as_the_exact_parser_does(tmp_path, monkeypatch):
    from treecli.formats import _safetensors_header as safetensors

    tensors = {f"model.layers.{i}.w": np.full((2, 3), i, np.float16) for i in range(2_000)}
    path = tmp_path / "big.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert int.from_bytes(path.read_bytes()[:8], "little") >= safetensors._TYPED_FROM
    typed = safetensors._typed_header
    calls = []
    monkeypatch.setattr(safetensors, "_typed_header", lambda *a: calls.append(typed(*a)) or calls[-1])
    fast = _parsed(safetensors, path)
    assert calls and calls[0] is not None  # taken, not sent the exact way
    monkeypatch.setattr(safetensors, "_TYPED_FROM", 2**40)
    assert _parsed(safetensors, path) == fast
    assert fast[1] == {"format": "pt"} and len(fast[0]) == len(tensors)


# --- sharded checkpoints --------------------------------------------------------------------


def test_sharded_directory_and_index_file_open_as_one_tree(sharded_dir):
    directory, tensors = sharded_dir
    for target in (directory, directory / "model.safetensors.index.json"):
        with treecli.open(target) as ckpt:
            leaves = flat_leaves(ckpt.tree)
            assert set(leaves) == set(tensors)
            assert all(bits(leaves[k].read()) == bits(v) for k, v in tensors.items())
            assert [p.name for p in ckpt.companions] == ["config.json"]


def _rewrite_index(directory, change):
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    change(index["weight_map"])
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda wm: wm.update({"model.embed.weight": "model-00009-of-00009.safetensors"}), "missing"),
        (lambda wm: wm.update({"ghost": "model-00001-of-00002.safetensors"}), "does not hold it"),
        (lambda wm: wm.update({"model.embed.weight": "../x.safetensors"}), "leaves the checkpoint directory"),
        (lambda wm: wm.update({"model.embed.weight": "/etc/passwd"}), "leaves the checkpoint directory"),
    ],
)
def test_inconsistent_shard_indexes_are_errors(sharded_dir, change, fragment):
    directory, _ = sharded_dir
    _rewrite_index(directory, change)
    with pytest.raises(FormatError) as info:
        treecli.load(directory)
    assert fragment in str(info.value)


def test_a_tensor_in_two_shards_is_an_error(sharded_dir):
    directory, tensors = sharded_dir
    first = directory / "model-00001-of-00002.safetensors"
    second = directory / "model-00002-of-00002.safetensors"
    with safe_open(str(first), "np") as f:
        name = next(iter(f.keys()))
    extra = {name: np.zeros(1, np.float32)}
    with safe_open(str(second), "np") as f:
        keys = list(f.keys())
    content = {k: tensors[k] for k in keys}
    content.update(extra)
    save_file(content, str(second))
    with pytest.raises(FormatError, match="two shards|maps it to"):
        treecli.load(directory)


def test_a_stray_shard_is_ignored_with_a_warning(sharded_dir):
    directory, tensors = sharded_dir
    save_file({"x": np.zeros(1, np.float32)}, str(directory / "stray.safetensors"))
    with treecli.open(directory) as ckpt:
        assert set(flat_leaves(ckpt.tree)) == set(tensors)
        assert any("stray.safetensors" in w for w in ckpt.warnings)


@pytest.mark.parametrize("keys", [["a", "a.b"], ["a.b", "a"], ["x.a", "x.a.b.c"], ["x.a.b.c", "x.a.b"]])
def test_keys_that_cannot_nest_open_flat_with_a_warning(tmp_path, keys):
    path = tmp_path / "flat.safetensors"
    header = {key: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i, key in enumerate(keys)}
    path.write_bytes(raw_safetensors(header, b"\0" * 4 * len(keys)))  # in this order (save_file sorts)
    with treecli.open(path) as ckpt:
        assert set(ckpt.tree) == set(keys)
        assert "cannot nest" in ckpt.warnings[0]


# --- writing ---------------------------------------------------------------------------------


def test_written_files_read_back_bit_exactly_with_the_reference(mixed_file, tmp_path):
    path, tensors = mixed_file
    out = tmp_path / "out.safetensors"
    with treecli.open(path) as ckpt:
        treecli.save(ckpt.tree, out, metadata=ckpt.metadata, record=False)
    reference = dict(deserialize(out.read_bytes()))
    assert set(reference) == set(tensors)
    for name, array in tensors.items():
        assert bytes(reference[name]["data"]) == bits(array), name
        assert reference[name]["shape"] == list(array.shape)
    with safe_open(str(out), "np") as f:
        assert f.metadata() == {"format": "np", "note": "made by the reference library"}


def test_many_small_leaves_are_written_without_rehinting_or_thread_hand_offs(tmp_path, monkeypatch):
    import os
    import threading

    from treecli._bytes import writer

    path = tmp_path / "many.safetensors"
    tensors = {f"t.{i}": np.full(64, i, np.float32) for i in range(300)}
    save_file(tensors, str(path))
    hints, reader_threads = [], set()
    monkeypatch.setattr(writer, "WRITEBACK_BYTES", 4096)
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: hints.append((offset, length)))
    (leaf_class,) = {type(leaf) for _, leaf in _tree.flatten(treecli.load(path))}
    read_flat = leaf_class.read_flat

    def recording_read_flat(self, start, stop):
        reader_threads.add(threading.current_thread())
        return read_flat(self, start, stop)

    monkeypatch.setattr(leaf_class, "read_flat", recording_read_flat)
    out = tmp_path / "out.safetensors"
    treecli.save(treecli.load(path), out)

    assert {n: bytes(t["data"]) for n, t in deserialize(out.read_bytes())} == {n: bits(a) for n, a in tensors.items()}
    assert reader_threads == {threading.main_thread()}  # small leaves: no hand-off to the prefetch thread
    # each hint covers the new window and the one before (to drop its pages, clean by then): bytes are
    # hinted twice at most, not again from byte 0 for every leaf
    ends = [offset + length for offset, length in hints]
    assert len(hints) >= 15 and hints[0][0] == 0 and ends == sorted(set(ends))
    assert all(hints[k][0] == ends[k - 2] for k in range(2, len(hints)))


def test_two_saves_give_identical_bytes(mixed_file, tmp_path):
    path, _ = mixed_file
    tree = treecli.load(path)
    treecli.save(tree, tmp_path / "a.safetensors")
    treecli.save(tree, tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_numpy_trees_save_with_keys_joined_by_dots(tmp_path):
    tree = {"params": {"dense": {"kernel": np.ones((2, 3), BF16)}}, "layers": [np.zeros(2, np.int64)]}
    out = treecli.save(tree, tmp_path / "t.safetensors")
    assert {name for name, _ in deserialize(out.read_bytes())} == {"params.dense.kernel", "layers.0"}


def test_unsupported_leaves_are_listed_not_dropped(tmp_path):
    tree = {"w": np.ones(2, np.float32), "step": 3, "none": None, "name": "x"}
    with pytest.raises(TreecliError) as info:
        treecli.save(tree, tmp_path / "t.safetensors")
    assert "cannot hold 1 leaf" in str(info.value) and ".treecli-tmp" not in str(info.value)
    assert info.value.details == ["name (str)"]  # step = 3 is stored as a 0-d int64; None holds no leaf
    assert not list(tmp_path.iterdir())


def test_a_key_holding_the_separator_cannot_be_flattened(tmp_path):
    with pytest.raises(TreecliError, match="contains '.'"):
        treecli.save({"a": {"b.c": np.ones(1, np.float32)}}, tmp_path / "t.safetensors")


def test_sharded_output_splits_by_size_and_writes_the_index_last(tmp_path):
    from treecli.formats import WriteOptions, save

    tree = {f"layer{i}": np.full(1000, i, np.float32) for i in range(5)}  # 4000 bytes each
    out = tmp_path / "out"
    save(tree, out, format="safetensors", options=WriteOptions(max_shard_size=9000))
    names = sorted(p.name for p in out.iterdir())
    assert names == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 20000
    back = flat_leaves(treecli.load(out))
    assert all(np.array_equal(back[k].read(), v) for k, v in tree.items())


def test_resaving_a_smaller_tree_leaves_no_stale_shard(tmp_path):
    from treecli.formats import WriteOptions, save

    out = tmp_path / "out"
    big = {f"l{i}": np.zeros(1000, np.float32) for i in range(4)}
    save(big, out, format="safetensors", options=WriteOptions(max_shard_size=4000))
    assert len(list(out.glob("*.safetensors"))) == 4
    small = {"l0": np.zeros(1000, np.float32)}
    save(small, out, format="safetensors", options=WriteOptions(max_shard_size=4000), force=True)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".treecli-tmp")]


def test_fp8_and_bool_survive_a_round_trip(tmp_path):
    tree = {"f8": np.array([0.5, -2, 448], ml_dtypes.float8_e4m3fn), "b": np.array([True, False])}
    out = treecli.save(tree, tmp_path / "t.safetensors")
    back = treecli.load(out)
    assert back["f8"].read().dtype == ml_dtypes.float8_e4m3fn
    assert bits(back["f8"].read()) == bits(tree["f8"])
    assert back["b"].read().tolist() == [True, False]


def test_header_is_padded_to_eight_bytes(tmp_path):
    out = treecli.save({"a": np.ones(3, np.int8)}, tmp_path / "t.safetensors")
    (n,) = struct.unpack("<Q", out.read_bytes()[:8])
    assert n % 8 == 0


def test_a_header_length_that_starts_like_a_pickle_is_still_safetensors(tmp_path):
    # Header length 0x0280 = 640: the file starts 0x80 0x02, like a protocol-2 pickle.
    header = json.dumps({"w": _entry()}).encode()
    header += b" " * (640 - len(header))
    path = tmp_path / "w.safetensors"
    path.write_bytes(struct.pack("<Q", 640) + header + b"\0" * 4)
    assert path.read_bytes()[:2] == b"\x80\x02"
    assert treecli.load(path)["w"].read().tolist() == [0.0]


@settings(max_examples=300, deadline=None)
@given(keys=st.lists(st.lists(st.sampled_from(["", "a", "b", "0"]), min_size=1, max_size=4).map(".".join),
                     unique=True, min_size=1, max_size=8))
def test_flat_keys_nest_as_their_segments_say(keys):
    """Keys nest into the tree their dot-separated segments spell (empty segments too:
    ``.a`` is ``a`` under the key ``""``), whatever their order; keys where one is a leaf and
    a prefix of another open flat."""
    from treecli.formats import _flatkeys

    expected: dict | None = {}
    for key in keys:
        *parents, last = key.split(".")
        node = expected
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                expected = None
                break
        if expected is None or last in node:
            expected = None
            break
        node[last] = key
    tree, warning = _flatkeys.nest([(key, key) for key in keys], ".")
    if expected is None:
        assert tree == {key: key for key in keys} and "cannot nest" in warning
    else:
        assert (tree, warning) == (expected, None)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="-0a,:[ \n\"", max_size=400), as_bytes=st.booleans(),
       dashes_for_regex=st.sampled_from([0, 3, 256]))
def test_a_minus_starting_a_number_is_found_however_many_dashes_there_are(text, as_bytes, dashes_for_regex):
    """A ``-`` first or after ``[``, ``,``, ``:`` or white space sends a big header the exact
    way; dashes elsewhere (an index's ``model-00001-of-00163`` names, 280k of them) do not.
    Few dashes are looked at one by one, many in one regex pass: both ways alike."""
    from treecli.formats import _safetensors_header as safetensors

    expected = re.search(r"(?:^|[\[,: \t\r\n])-", text) is not None
    saved, safetensors.DASHES_FOR_REGEX = safetensors.DASHES_FOR_REGEX, dashes_for_regex
    try:
        assert safetensors._has_negative_number(text.encode() if as_bytes else text) == expected
    finally:
        safetensors.DASHES_FOR_REGEX = saved


def test_safetensors_0_6_dtypes_show_every_leaf_and_read_what_ml_dtypes_names(cli, tmp_path):
    import ml_dtypes

    entries, data = {}, b""
    for name, code, shape, raw in [("a", "F4", [4], b"\x12\x34"), ("b", "F8_E4M3FNUZ", [2], b"\x12\x34"),
                                   ("c", "F6_E2M3", [4], b"\x12\x34\x56"), ("d", "F8_E5M2FNUZ", [1], b"\x01"),
                                   ("e", "F6_E3M2", [4], b"\x12\x34\x56"), ("w", "F32", [1], b"\x00\x00\x80\x3f")]:
        entries[name] = {"dtype": code, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = json.dumps(entries).encode()
    path = tmp_path / "new.safetensors"
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)
    reference = dict(deserialize(path.read_bytes()))  # safetensors itself reads every entry
    assert reference["a"]["dtype"] == "F4"
    shown = cli("show", path, "--json")
    assert shown.code == 0, shown.stderr
    rows = {row["keypath"]: row for row in shown.json["leaves"]}
    assert rows["b"]["dtype"] == "float8_e4m3fnuz" and rows["d"]["dtype"] == "float8_e5m2fnuz"
    for name, code in (("a", "F4"), ("c", "F6_E2M3"), ("e", "F6_E3M2")):
        assert rows[name]["type"] == "unread" and code in rows[name]["value"]
    got = treecli.load(path)
    assert np.asarray(got["b"]).tobytes() == b"\x12\x34" and np.asarray(got["b"]).dtype == ml_dtypes.float8_e4m3fnuz
    out = tmp_path / "out.safetensors"
    refused = cli("convert", path, out)
    assert_clean_error(refused, "cannot hold 3 leaves")
    assert cli("convert", path, out, "--drop-unsupported").code == 0
    written = dict(deserialize(out.read_bytes()))
    assert sorted(written) == ["b", "d", "w"] and written["b"]["dtype"] == "F8_E4M3FNUZ"
    assert bytes(written["d"]["data"]) == b"\x01"
    # a packed tensor that does not fill whole bytes, or its bytes miscounted, is still one line
    entries["a"]["shape"] = [3]
    head = json.dumps(entries).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)
    assert_clean_error(cli("show", path), "a: 3 elements of F4 do not fill whole bytes")


def _parsed(header_module, path):
    """A file's header as every reader parses it (through a byte source's ``read``)."""
    data = path.read_bytes()
    return header_module.parse_header(lambda offset, size: data[offset:offset + size], len(data), str(path))
