"""Issue 42, item 1: reversible tensor operations. Each equals its NumPy twin, streams
(any chunk asked for is the same elements), and a chain of them inverted gives back the
same names and bytes; what cannot be reversed or does not fit is refused in one line."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from treecli import _tensor_ops as ops
from treecli import _transforms as T
from treecli._errors import UsageError
from treecli._leaf import InMemoryLeaf

BF16 = np.dtype(ml_dtypes.bfloat16)
RNG = np.random.default_rng(0)


def _array(shape, dtype=np.float32):
    data = RNG.standard_normal(shape) * 100
    return data.astype(dtype)


def _whole(leaf):
    return leaf.read_flat(0, leaf.size).reshape(leaf.shape)


def _chunked(leaf, step):
    """The leaf read as a writer reads it, ``step`` elements at a time."""
    return np.concatenate([leaf.read_flat(s, min(leaf.size, s + step)) for s in range(0, leaf.size, step)])


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int64])
def test_each_operation_equals_numpy_in_any_chunks(dtype):
    a, b = _array((6, 4, 5), dtype), _array((6, 3, 5), dtype)
    cases = [
        (ops.concatenated([InMemoryLeaf(a), InMemoryLeaf(b)], 1), np.concatenate([a, b], 1)),
        (ops.concatenated([InMemoryLeaf(a), InMemoryLeaf(a)], 0), np.concatenate([a, a], 0)),
        (ops.stacked([InMemoryLeaf(a), InMemoryLeaf(a[::-1].copy())], 2), np.stack([a, a[::-1]], 2)),
        (ops.transposed(InMemoryLeaf(a), (2, 0, 1)), a.transpose(2, 0, 1)),
        (ops.reshaped(InMemoryLeaf(a), (-1, 10)), a.reshape(-1, 10)),
        (ops.split(InMemoryLeaf(b), [1, -1], 1)[1], b[:, 1:]),
        (ops.unstacked(InMemoryLeaf(a), 1)[2], a[:, 2]),
    ]
    for leaf, expected in cases:
        assert leaf.shape == expected.shape and leaf.dtype == expected.dtype
        assert _whole(leaf).tobytes() == np.ascontiguousarray(expected).tobytes()
        for step in (1, 7, 33):
            assert _chunked(leaf, step).tobytes() == np.ascontiguousarray(expected).tobytes()


def test_long_rows_are_read_piece_by_piece(monkeypatch):
    """A concatenation whose rows outgrow a chunk reads each input's part of the chunk only."""
    monkeypatch.setattr(ops, "CHUNK_BYTES", 64)
    a, b = _array((3, 40)), _array((3, 24))
    leaf = ops.concatenated([InMemoryLeaf(a), InMemoryLeaf(b)], 1)
    assert _chunked(leaf, 13).tobytes() == np.concatenate([a, b], 1).tobytes()


def test_rotary_permutation_is_llama_cpps_and_undone():
    """convert_hf_to_gguf.py's permute, written out: (heads, 2, d/2, ...) with its two middle axes swapped."""
    w = _array((32, 7))
    expected = w.reshape(4, 2, 4, 7).swapaxes(1, 2).reshape(32, 7)
    permuted = ops.rotary_permuted(InMemoryLeaf(w), 4)
    assert _whole(permuted).tobytes() == expected.tobytes()
    assert _chunked(permuted, 5).tobytes() == expected.tobytes()
    assert _whole(ops.rotary_permuted(permuted, 4, inverse=True)).tobytes() == w.tobytes()
    bias = _array((32,))
    assert _whole(ops.rotary_permuted(InMemoryLeaf(bias), 4)).tobytes() == \
        bias.reshape(4, 2, 4).swapaxes(1, 2).reshape(32).tobytes()


def _model(layers=3, dtype=np.float32):
    items = []
    for i in range(layers):
        for name, shape in (("self_attn.q_proj.weight", (8, 6)), ("self_attn.k_proj.weight", (4, 6)),
                            ("self_attn.v_proj.weight", (4, 6)), ("mlp.up_proj.weight", (10, 6))):
            items.append((f"model.layers.{i}.{name}", InMemoryLeaf(_array(shape, dtype))))
    items.append(("model.embed_tokens.weight", InMemoryLeaf(_array((5, 6), dtype))))
    return items


CHAIN = [
    T.Rotary(r"model\.layers\.\d+\.self_attn\.q_proj\.weight", "num_attention_heads"),
    T.Concat(("model.layers.(\\d+).self_attn.q_proj.weight", "model.layers.(\\d+).self_attn.k_proj.weight",
              "model.layers.(\\d+).self_attn.v_proj.weight"), "model.layers.\\1.self_attn.qkv.weight", 0,
             ("num_attention_heads*head_dim", "num_key_value_heads*head_dim", -1)),
    T.Rename("model.layers.(\\d+).mlp.up_proj.weight", "blk.\\1.ffn_up.weight"),
    T.Transpose(r".*qkv.*", (1, 0)),
    T.Stack("model.layers.{i}.(.+)", "layers.\\1"),
    T.Unflatten("layers.self_attn.qkv.weight", 2, (4, -1)),
    T.Split("layers.self_attn.qkv.weight", ("layers.qkv_a", "layers.qkv_b"), 2),
]
PARAMS = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4}


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int64])
def test_a_chain_round_trips_bit_identical(dtype):
    items = _model(dtype=dtype)
    done = T.applied(CHAIN, items, PARAMS)
    assert {name: leaf.shape for name, leaf in done} == {
        "layers.qkv_a": (3, 6, 2, 4), "layers.qkv_b": (3, 6, 2, 4), "blk.0.ffn_up.weight": (10, 6),
        "blk.1.ffn_up.weight": (10, 6), "blk.2.ffn_up.weight": (10, 6), "model.embed_tokens.weight": (5, 6)}
    back = dict(T.applied(T.inverted(CHAIN), done, PARAMS))
    assert sorted(back) == sorted(name for name, _ in items)
    for name, leaf in items:
        assert back[name].shape == leaf.shape and back[name].dtype == leaf.dtype
        assert _whole(back[name]).tobytes() == _whole(leaf).tobytes(), name


def test_an_inverted_rename_swaps_pattern_and_template():
    rename = T.Rename("model.layers.(\\d+).mlp.up_proj.weight", "blk.\\1.ffn_up.weight")
    assert rename.inverse() == T.Rename("blk.(\\d+).ffn_up.weight", "model.layers.\\1.mlp.up_proj.weight")
    swapped = T.Rename("a.(\\d+).b.(\\w+)", "x.\\2.\\1")
    assert [n for n, _ in swapped.apply([("a.3.b.w", 1)], {})] == ["x.w.3"]
    assert [n for n, _ in swapped.inverse().apply([("x.w.3", 1)], {})] == ["a.3.b.w"]


@pytest.mark.parametrize("operation, items, message", [
    (T.Rename("a.(.+)", "b.\\1.\\1"), [("a.x", 1)], "use each group once"),
    (T.Rename("a.(.+)", "b"), [("a.x", 1)], "use each group once"),
    (T.Rename("a+(.+)", "b.\\1"), [("a.x", 1)], "literal text"),
    (T.Rename("(.+)", "x"), [("a", 1)], "use each group once"),
    (T.Rename("a.(\\d+)", "b"), [("a.1", 1)], "use each group once"),
    (T.Rename("(a|b)", "c.\\1"), [("a", 1), ("c.a", 2)], "the same name"),
    (T.Rename("(.+)\\.(.+)", "\\1_\\2"), [("a.b_c", 1)], "does not rename back"),
    (T.Stack("l.{i}.w", "w"), [("l.0.w", InMemoryLeaf(np.zeros(2))), ("l.2.w", InMemoryLeaf(np.zeros(2)))],
     "not numbered 0 to 1 (no 1)"),
    (T.Stack("l.{i}.w", "w"), [("l.0.w", InMemoryLeaf(np.zeros(2))), ("l.1.w", InMemoryLeaf(np.zeros(3)))],
     "different shapes"),
    (T.Stack("l.(\\d+).w", "w"), [("l.0.w", 1)], "with {i}"),
    (T.Rotary("q", 3), [("q", InMemoryLeaf(np.zeros((8, 2))))], "3 heads"),
    (T.Rotary("q", "num_attention_heads"), [("q", InMemoryLeaf(np.zeros((8, 2))))], "needs num_attention_heads"),
    (T.Transpose("q", (0, 0)), [("q", InMemoryLeaf(np.zeros((8, 2))))], "no order of the 2 axes"),
    (T.Flatten("q", 0, (4, 2)), [("q", InMemoryLeaf(np.zeros((8, 2))))], "are not [4, 2]"),
    (T.Split("q", ("a", "b"), 0, (3, 3)), [("q", InMemoryLeaf(np.zeros((8, 2))))], "do not add up"),
    (T.Concat(("(.+).q", "(.+).k"), "\\1.qk"), [("x.q", InMemoryLeaf(np.zeros(2)))], "has no x.k to join"),
    (T.Concat(("(.+).q", "(.+).k"), "\\1.qk"), [("x.q", InMemoryLeaf(np.zeros(2))),
                                                ("x.k", InMemoryLeaf(np.zeros(3)))], "give their sizes"),
    (T.Transpose("q", (1, 0)), [("q", "text")], "not an array"),
])
def test_what_cannot_be_reversed_or_does_not_fit_is_refused(operation, items, message):
    with pytest.raises(UsageError) as raised:
        operation.apply(items, {})
    assert message in raised.value.message, raised.value.message


def test_a_leaf_and_a_node_of_one_name_are_refused():
    with pytest.raises(UsageError, match="both a leaf and the node"):
        T.tree_of([("a", 1), ("a.b", 2)])


def test_sizes_name_hyper_parameters():
    params = {"num_attention_heads": 32, "head_dim": 128, "hidden_size": 4096}
    assert T.size_of("num_attention_heads*head_dim", params, "x") == 4096
    assert T.size_of("hidden_size/num_attention_heads", params, "x") == 128
    assert T.size_of(-1, params, "x") == -1
    for bad, message in (("hidden_size/7", "no whole number"), ("__import__('os')", "is no size"),
                         ("missing*2", "needs missing")):
        with pytest.raises(UsageError) as raised:
            T.size_of(bad, params, "x")
        assert message in raised.value.message


# --- from the shell: edit's layout options and recipe files -----------------------------------

ROOT = __import__("pathlib").Path(__file__).parent.parent


def test_edit_stacks_and_transposes_and_undoes_it(cli, tmp_path):
    from .tiny_llama import write_model

    model = write_model(tmp_path / "m", "llama")
    result = cli("edit", model, "-o", tmp_path / "scanned.safetensors", "--transpose", r"model.*_proj\.weight=1,0",
                 "--stack", r"model.layers.{i}.(.+) -> layers.\1", "--regex-rename",
                 r"model.(embed_tokens|norm).weight -> \1")
    assert result.code == 0, result.stderr
    shown = {leaf["keypath"]: leaf["shape"] for leaf in cli("show", tmp_path / "scanned.safetensors",
                                                             "--json").json["leaves"]}
    assert shown["layers.self_attn.q_proj.weight"] == [2, 64, 64]
    assert shown["layers.mlp.down_proj.weight"] == [2, 128, 64] and shown["embed_tokens"] == [263, 64]
    result = cli("edit", tmp_path / "scanned.safetensors", "-o", tmp_path / "back", "--format", "safetensors",
                 "--unstack", r"layers.(.+) -> model.layers.{i}.\1", "--transpose", r"model.*_proj\.weight=1,0",
                 "--regex-rename", r"(embed_tokens|norm) -> model.\1.weight")
    assert result.code == 0, result.stderr
    assert cli("diff", model, tmp_path / "back").code == 0


def test_a_recipe_file_runs_both_ways_and_writes_its_metadata(cli, tmp_path):
    from .tiny_llama import write_model

    model = write_model(tmp_path / "m", "llama")
    recipe = ROOT / "examples" / "scan_layers.yaml"
    assert cli("convert", model, tmp_path / "s.safetensors", "--recipe", recipe).code == 0
    shown = cli("show", tmp_path / "s.safetensors", "--json").json
    assert shown["metadata"]["layout"] == "scanned"
    assert {leaf["keypath"]: leaf["shape"] for leaf in shown["leaves"]}[
        "decoder.layers.self_attn.q_proj.weight"] == [2, 64, 4, 16]
    assert cli("convert", tmp_path / "s.safetensors", tmp_path / "back", "--recipe", recipe, "--reverse").code == 0
    assert cli("diff", model, tmp_path / "back").code == 0
    assert "layout" not in cli("show", tmp_path / "back", "--json").json.get("metadata", {})
    assert cli("edit", model, "-o", tmp_path / "e.safetensors", "--recipe", recipe).code == 0
    assert (tmp_path / "e.safetensors").read_bytes() != b""


@pytest.mark.parametrize("text, message", [
    ("steps: [{explode: {}}]", "no operation 'explode'"),
    ("steps: [{rename: {from: a, to: b, axis: 1}}]", "unknown field 'axis'"),
    ("steps: [{rename: {from: 'a.(.+)'}}]", "give to"),
    ("steps: [{rename: {from: 'a+b', to: c}}]", "literal text"),
    ("steps: [{stack: {from: 'l.{i}.(.+)', to: 'x', axis: one}}]", "axis is a whole number"),
    ("steps: [{transpose: {keys: w, axes: 1}}]", "axes is a list"),
    ("steps: [!!python/object/apply:os.system ['touch pwned']]", "not a YAML config"),
    ("just text", "a YAML mapping with a list of steps"),
    ("steps: []\nextra: 1", "unknown key 'extra'"),
])
def test_a_bad_recipe_file_is_one_line_and_nothing_runs(cli, tmp_path, text, message):
    from .conftest import assert_clean_error
    from .tiny_llama import write_model

    model = write_model(tmp_path / "m", "llama")
    (tmp_path / "r.yaml").write_text(text)
    assert_clean_error(cli("convert", model, tmp_path / "out.safetensors", "--recipe", tmp_path / "r.yaml"),
                       "r.yaml", message)
    assert not (tmp_path / "out.safetensors").exists() and not (tmp_path / "pwned").exists()


def test_edit_s_layout_options_say_what_they_want(cli, tmp_path):
    from .conftest import assert_clean_error
    from .tiny_llama import write_model

    model = write_model(tmp_path / "m", "llama")
    assert_clean_error(cli("edit", model, "-o", tmp_path / "o", "--stack", "model.layers.{i}.(.+)"),
                       "--stack", "PATTERN -> TEMPLATE")
    assert_clean_error(cli("edit", model, "-o", tmp_path / "o", "--transpose", "w=a,b"), "REGEX=AXES")
    assert_clean_error(cli("edit", model, "-o", tmp_path / "o", "--recipe", "llama.cpp"),
                       "treecli convert --recipe")
    assert_clean_error(cli("edit", model, "-o", tmp_path / "o", "--reverse", "--set", "x=1"), "give --recipe")
    assert not (tmp_path / "o").exists()


def test_a_transpose_that_cannot_fit_in_memory_is_refused_before_it_starts(monkeypatch):
    from treecli import _memory

    monkeypatch.setattr(_memory, "available", lambda: 1000)
    with pytest.raises(UsageError) as raised:
        T.Transpose("w", (1, 0)).apply([("w", InMemoryLeaf(np.zeros((20, 20), np.float32)))], {})
    assert "holds the leaf twice in memory" in raised.value.message and "w" in raised.value.message


@pytest.mark.parametrize("text, message", [
    ("steps: [{rename: {from: 'a.(.+)', to: 'b.\\\\1', to: 'c.\\\\1'}}]", "'to' twice"),
    ("steps: [{rename: {from: a, to: b}}]\nsteps: []", "'steps' twice"),
    ("params: {b: &b [1, 1, 1, 1, 1, 1, 1, 1], c: &c [*b, *b, *b, *b, *b, *b, *b, *b],\n"
     "  d: &d [*c, *c, *c, *c, *c, *c, *c, *c], e: &e [*d, *d, *d, *d, *d, *d, *d, *d],\n"
     "  f: &f [*e, *e, *e, *e, *e, *e, *e, *e]}\n"
     "steps: [{unflatten: {keys: w, axis: 0, sizes: [*f]}}]", "sizes holds a list"),
    ("params: {b: &b [1, 1, 1, 1, 1, 1, 1, 1], c: &c [*b, *b, *b, *b, *b, *b, *b, *b],\n"
     "  d: &d [*c, *c, *c, *c, *c, *c, *c, *c], e: &e [*d, *d, *d, *d, *d, *d, *d, *d]}\n"
     "steps: []\nmetadata: {k: *e}", "metadata values are text or numbers"),
    ("steps: [{unflatten: {keys: w, axis: 0, sizes: [[1, 2]]}}]", "sizes holds a list"),
    ("steps: []\nmetadata: {k: [1, 2]}", "metadata values are text or numbers"),
])
def test_a_recipe_file_s_ambiguity_and_alias_bombs_are_one_line(cli, tmp_path, text, message):
    from .conftest import assert_clean_error
    from .tiny_llama import write_model

    model = write_model(tmp_path / "m", "llama")
    (tmp_path / "r.yaml").write_text(text)
    assert_clean_error(cli("convert", model, tmp_path / "out.safetensors", "--recipe", tmp_path / "r.yaml"), message)
    assert not (tmp_path / "out.safetensors").exists()


def test_a_recipe_that_is_a_fifo_or_a_device_is_refused_without_reading(cli, tmp_path):
    import os

    from .conftest import assert_clean_error
    from .tiny_llama import write_model

    model = write_model(tmp_path / "m", "llama")
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    for name in ("fifo.yaml", "zero.yaml"):
        assert_clean_error(cli("convert", model, tmp_path / "out.safetensors", "--recipe", tmp_path / name), name)
    assert not (tmp_path / "out.safetensors").exists()
