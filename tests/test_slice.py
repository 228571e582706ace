import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

import treecli
from treecli._errors import KeyPathError, UsageError
from treecli._slice import slice_tree

from .conftest import BF16, assert_clean_error, bits, snapshot


def materialize(tree):
    from treecli import _leaf, _tree

    return _tree.map_leaves(lambda kp, x: _leaf.as_leaf(x).read() if _leaf.is_array(x) else x, tree)


@st.composite
def index_for(draw, shape):
    index = []
    for dim in shape[: draw(st.integers(0, len(shape)))]:
        kind = draw(st.sampled_from(["int", "slice", "none"]))
        if kind == "int" and dim:
            index.append(draw(st.integers(-dim, dim - 1)))
        elif kind == "none":
            index += [None, slice(None)]  # None adds an axis and consumes none: slice this one
        else:
            index.append(slice(draw(st.one_of(st.none(), st.integers(-9, 9))),
                               draw(st.one_of(st.none(), st.integers(-9, 9))),
                               draw(st.sampled_from([None, 1, 2, -1, -3]))))
    if draw(st.booleans()):
        index.append(Ellipsis)  # after the integers, so each still indexes the axis it was drawn for
    return tuple(index)


def _index_text(index):
    from treecli._index import format_index

    return format_index(index)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_every_output_leaf_equals_numpy_indexing_bit_exactly(tmp_path_factory, data):
    shapes = data.draw(st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=3), min_size=1, max_size=3))
    arrays = {f"t.{i}": np.arange(int(np.prod(s)), dtype=np.float32).reshape(s).astype(
        data.draw(st.sampled_from([np.float32, BF16, np.int64, np.float16]))) for i, s in enumerate(shapes)}
    common = data.draw(index_for(tuple(min(s[i] if i < len(s) else 0 for s in shapes)
                                       for i in range(min(len(s) for s in shapes)))))
    path = tmp_path_factory.mktemp("slice") / "in.safetensors"
    save_file(arrays, str(path))
    tree, _ = slice_tree(treecli.load(path), [_index_text(common) or "..."])
    got = materialize(tree)
    for name, array in arrays.items():
        expected = np.asarray(array[common])
        leaf = got["t"][name.split(".")[1]]
        assert leaf.shape == expected.shape and leaf.dtype == expected.dtype
        assert bits(leaf) == bits(expected)


def test_per_subtree_rules_override_the_default_and_none_passes_through():
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    tree = {"a": (a, a + 1, a + 2), "b": a * 2, "none": None, "c": (a - 1, (None,)), "step": np.int64(7)}
    out, report = slice_tree(tree, ["a=1", "c=:, :2", ":2"])
    got = materialize(out)
    assert [x.tolist() for x in got["a"]] == [a[1].tolist(), (a + 1)[1].tolist(), (a + 2)[1].tolist()]
    assert got["b"].tolist() == (a * 2)[:2].tolist()
    assert got["c"][0].tolist() == (a - 1)[:, :2].tolist() and got["c"][1] == (None,)
    assert got["none"] is None
    assert report.skipped == ["step"]  # 0-d under the default: skipped, counted
    assert isinstance(out["a"], tuple)


def test_two_pattern_rules_on_one_leaf_are_an_error_naming_both():
    tree = {"enc": {"layers": np.zeros((2, 2))}}
    with pytest.raises(KeyPathError) as info:
        slice_tree(tree, ["enc=0", "enc.layers=1"])
    assert "rules='enc=0' and rules='enc.layers=1'" in str(info.value) and info.value.keypath == "enc.layers"


def test_misfits_name_the_key_path_shape_and_index():
    tree = {"w": np.zeros((3, 4)), "b": np.zeros(4)}
    with pytest.raises(UsageError) as info:
        slice_tree(tree, ["5"])
    assert info.value.keypath == "b" and "[4]" in str(info.value) and "index [5]" in str(info.value)
    with pytest.raises(UsageError, match="does not fit shape"):
        slice_tree(tree, ["b=0, 0"])  # a pattern rule with more indices than dimensions
    with pytest.raises(KeyPathError, match="matches nothing; closest: w"):
        slice_tree(tree, ["ww=0"])
    with pytest.raises(UsageError, match="step cannot be zero"):
        slice_tree(tree, ["::0"])
    with pytest.raises(UsageError, match="two default"):
        slice_tree(tree, ["0", "1"])


def test_slicing_a_file_leaf_reads_only_the_selected_member(tmp_path):
    stack = np.random.default_rng(0).standard_normal((8, 64, 128)).astype(np.float32)
    path = tmp_path / "stack.safetensors"
    save_file({"w": stack}, str(path))
    ckpt = treecli.open(path)
    tree, _ = slice_tree(ckpt.tree, ["0"])
    out = treecli.save(tree, tmp_path / "out.safetensors")
    assert ckpt.tree["w"].reader.bytes_read == stack[0].nbytes
    assert bits(load_file(str(out))["w"]) == bits(stack[0])


def test_slicing_large_rows_in_chunks_reads_each_row_once(tmp_path, monkeypatch):
    from treecli import _leaf, _tensor_ops

    monkeypatch.setattr(_tensor_ops, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(_leaf, "CHUNK_BYTES", 1024)
    array = np.arange(6 * 1000, dtype=np.float32).reshape(6, 1000)
    path = tmp_path / "a.safetensors"
    save_file({"w": array}, str(path))
    ckpt = treecli.open(path)
    tree, _ = slice_tree(ckpt.tree, ["::2, 10:990"])
    leaf = tree["w"]
    chunks = [leaf.read_flat(s, e) for s, e in leaf.chunk_ranges(1024)]
    assert bits(np.concatenate(chunks)) == bits(np.ascontiguousarray(array[::2, 10:990]))
    assert ckpt.tree["w"].reader.bytes_read <= 3 * 1000 * 4  # rows 0, 2, 4, each once


def test_cli_slice_writes_the_result_and_dry_run_writes_nothing(cli, tmp_path):
    stack = np.arange(4 * 3 * 2, dtype=np.float32).reshape(4, 3, 2).astype(BF16)
    path = tmp_path / "in.safetensors"
    # ascontiguousarray: safetensors.numpy.save_file writes a strided bf16 view in memory order, not C order.
    save_file({"ens.w": stack, "ens.b": np.ascontiguousarray(stack[:, 0]), "step": np.asarray(5, np.int64)},
              str(path))
    before = snapshot(tmp_path)
    dry = cli("slice", path, "--index", "ens.w=-1", "--index", ":2", "--dry-run")
    assert dry.code == 0, dry.stderr
    assert snapshot(tmp_path) == before
    rows = [line.split() for line in dry.stdout.splitlines()[1:]]
    assert rows == [["ens.b", "[4,", "2]", "->", "[2,", "2]", "bfloat16", ":2"],
                    ["ens.w", "[4,", "3,", "2]", "->", "[3,", "2]", "bfloat16", "ens.w=-1"]]
    assert "skipped 1 leaf" in dry.stderr
    result = cli("slice", path, "--index", "ens.w=-1", "--index", ":2", "-o", tmp_path / "out.safetensors")
    assert result.code == 0, result.stderr
    out = load_file(str(tmp_path / "out.safetensors"))
    assert bits(out["ens.w"]) == bits(stack[-1]) and bits(out["ens.b"]) == bits(stack[:2, 0])
    assert out["step"] == 5


def test_cli_slice_errors_write_nothing(cli, tmp_path):
    path = tmp_path / "in.safetensors"
    save_file({"w": np.zeros((2, 2), np.float32)}, str(path))
    before = snapshot(tmp_path)
    assert_clean_error(cli("slice", path, "--index", "7", "-o", tmp_path / "o.safetensors"), "w", "[2, 2]")
    assert_clean_error(cli("slice", path, "--index", "x=0", "-o", tmp_path / "o.safetensors"), "matches nothing")
    assert_clean_error(cli("slice", path, "--index", "0"), "-o")
    assert snapshot(tmp_path) == before


def test_result_shape_is_numpys_without_numpy():
    """The planning of a slice (``--dry-run``, the shapes of the output) agrees with NumPy's
    indexing on every combination of these items, errors included, and imports no NumPy."""
    import itertools

    from treecli._index import result_shape

    items = [0, 1, -1, 2, -3, 5, -6, None, Ellipsis, slice(None), slice(1, None), slice(None, 2),
             slice(None, None, -1), slice(1, 5, 2), slice(-2, None), slice(None, None, 3)]
    for shape in [(), (3,), (4, 5), (2, 3, 4), (0, 3), (5, 0, 2)]:
        for n in range(4):
            for index in itertools.product(items, repeat=n):
                try:
                    expected = np.zeros(shape)[index].shape
                except IndexError:
                    with pytest.raises(IndexError):
                        result_shape(shape, index)
                    continue
                assert result_shape(shape, index) == expected, (shape, index)


def test_an_index_of_many_nones_is_refused_never_written_unreadable(cli, tmp_path):
    save_file({"w": np.ones((2, 3), np.float32)}, str(tmp_path / "a.safetensors"))
    many = ",".join(["None"] * 20_000)
    result = cli("slice", tmp_path / "a.safetensors", "--index", many, "-o", tmp_path / "s.safetensors")
    assert_clean_error(result, "w: index [None, None", "more characters)] does not fit shape [2, 3]",
                       "the result would have 20002 dimensions", "at most 64")
    assert len(result.stderr) - len(str(tmp_path)) < 300  # (the file is named in full: the rest is bounded)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]
    with pytest.raises(UsageError, match="at most 64"):  # the Python API, on any tree
        treecli.slice_tree({"w": np.ones(3, np.float32)}, [",".join(["None"] * 64)])
    # and whatever leaf a tree holds, no format writes what NumPy could not read back
    from treecli._leaf import ComputedLeaf

    deep = {"w": ComputedLeaf((1,) * 65, "float32", fill=lambda start, stop, out: None)}
    for name in ("s.npz", "s.msgpack", "s.safetensors"):
        with pytest.raises(treecli.TreecliError, match="w: a leaf of 65 dimensions"):
            treecli.save(deep, tmp_path / name)
    edge = cli("slice", tmp_path / "a.safetensors", "--index", ",".join(["None"] * 62), "-o", tmp_path / "e.npz")
    assert edge.code == 0, edge.stderr
    assert treecli.load(tmp_path / "e.npz")["w"].shape == (1,) * 62 + (2, 3)


def test_an_index_that_takes_norms_apart_warns_and_names_the_way_to_a_layer(cli, tmp_path):
    src = tmp_path / "m.safetensors"
    save_file({f"model.layers.{i}.{name}": np.ones(shape, np.float32) for i in range(2)
               for name, shape in (("mlp.weight", (4, 3)), ("input_layernorm.weight", (3,)))}, str(src))
    result = cli("slice", src, "--index", "model.layers.*=0", "-o", tmp_path / "s.safetensors")
    assert result.code == 0, result.stderr
    warning = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and "one element of 2 vectors" in warning[0]
    assert "model.layers.0.input_layernorm.weight" in warning[0] and f"treecli get {src} KEYPATH" in warning[0]
    rows = cli("slice", src, "--index", "model.layers.*=:2", "-o", tmp_path / "t.safetensors")
    assert rows.code == 0 and "warning" not in rows.stderr  # a range keeps every axis
    layer = cli("get", src, "model.layers.0", "-o", tmp_path / "layer0.safetensors")  # docs/remote.md's way
    assert layer.code == 0 and sorted(load_file(str(tmp_path / "layer0.safetensors"))) == [
        "model.layers.0.input_layernorm.weight", "model.layers.0.mlp.weight"]
