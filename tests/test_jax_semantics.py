"""JAX's own semantics (issue 33, item 5): ``None`` is an empty subtree, as in
``jax.tree_util``, in every command and in the API; a CheckpointManager step whose only
item is ``default`` (``StandardSave`` without ``Composite``) reads as Orbax's own restore
returns it, while ``--item`` / ``item=`` still name it."""

from __future__ import annotations

import numpy as np
import pytest

import treecli

from .conftest import BF16, bits

ocp = pytest.importorskip("orbax.checkpoint")
eqx = pytest.importorskip("equinox")
jax = pytest.importorskip("jax")


def filtered_model():
    """``eqx.filter(model, eqx.is_array)``: the activation and the dropout rate become ``None``."""
    model = eqx.nn.MLP(3, 2, 4, depth=2, key=jax.random.PRNGKey(0))
    return eqx.filter(model, eqx.is_array)


def named_leaves(tree):
    return {jax.tree_util.keystr(path, simple=True, separator="."): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def filtered(tmp_path_factory):
    """The same filtered model as an Orbax checkpoint (Orbax writes its ``None``\\ s) and as safetensors."""
    base = tmp_path_factory.mktemp("filtered")
    model = filtered_model()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(str(base / "orbax"), model)
    treecli.save(model, base / "model.safetensors")
    return base, model


def test_show_lists_no_none_rows(cli, filtered):
    base, _ = filtered
    shown = cli("show", base / "orbax", "--flat")
    assert shown.code == 0, shown.stderr
    assert "None" not in shown.stdout
    document = cli("show", base / "orbax", "--json").json
    assert sorted(row["keypath"] for row in document["leaves"]) == sorted(named_leaves(filtered_model()))


def test_diff_of_the_same_tree_across_formats_reports_no_none(cli, filtered):
    base, _ = filtered
    result = cli("diff", base / "orbax", base / "model.safetensors", "--json")
    assert result.code == 0, result.stderr
    document = result.json
    assert document["only_in_a"] == document["only_in_b"] == [] and document["equal"], document


def test_convert_of_an_orbax_filtered_model_needs_no_drop_unsupported(cli, filtered, tmp_path):
    base, model = filtered
    for target in ("m.safetensors", "m.npz", "m.msgpack", "m.eqx"):
        result = cli("convert", base / "orbax", tmp_path / target)
        assert result.code == 0, (target, result.stderr)
        assert "None" not in result.stderr
    back = treecli.load(tmp_path / "m.safetensors", like=model)
    assert back.layers[0].bias is not None and back.activation is model.activation
    for name, expected in named_leaves(model).items():
        assert bits(named_leaves(back)[name]) == bits(expected), name


def test_average_and_the_api_treat_none_as_empty(cli, filtered, tmp_path):
    base, model = filtered
    result = cli("average", base / "orbax", base / "model.safetensors", "-o", tmp_path / "avg.safetensors")
    assert result.code == 0, result.stderr
    averaged = treecli.load(tmp_path / "avg.safetensors", like=model)
    for name, expected in named_leaves(model).items():
        assert bits(named_leaves(averaged)[name]) == bits(expected), name
    # a tree in memory with None: saved without drop_unsupported, its None an empty subtree
    tree = {"w": np.arange(3, dtype=np.float32), "frozen": None, "nested": {"x": None}}
    for target in ("t.safetensors", "t.npz", "t.msgpack"):
        treecli.save(tree, tmp_path / target)
        loaded = treecli.load(tmp_path / target, lazy=False)
        assert list(named_leaves(loaded)) == ["w"], (target, loaded)
    back = treecli.load(tmp_path / "t.safetensors", like=tree)
    assert back["frozen"] is None and back["nested"] == {"x": None}
    assert bits(back["w"]) == bits(tree["w"])


@pytest.fixture(scope="module")
def default_step(tmp_path_factory):
    """A CheckpointManager root whose steps were saved with StandardSave alone: item ``default``."""
    base = tmp_path_factory.mktemp("default")
    rng = np.random.default_rng(0)
    tree = {"params": {"w": rng.standard_normal((4, 3)).astype(np.float32),
                       "e": rng.standard_normal((2, 5)).astype(BF16)},
            "step": np.asarray(3, np.int32)}
    with ocp.CheckpointManager(str(base / "run")) as manager:
        manager.save(1, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()
    treecli.save(tree, base / "same.safetensors")
    with ocp.CheckpointManager(str(base / "run")) as manager:
        restored = manager.restore(1)
    assert set(restored) == {"params", "step"}  # Orbax's own restore: no `default` level
    return base, tree


def test_a_default_only_step_reads_as_orbax_restores_it(cli, default_step, tmp_path):
    base, tree = default_step
    shown = cli("show", base / "run", "--json").json
    assert shown["items"] == ["default"]
    assert [row["keypath"] for row in shown["leaves"]] == ["params.e", "params.w", "step"], shown["leaves"]
    diff = cli("diff", base / "run", base / "same.safetensors", "--json")
    assert diff.code == 0 and diff.json["equal"], diff.stdout + diff.stderr
    result = cli("average", base / "run/1", base / "same.safetensors", "-o", tmp_path / "avg.safetensors")
    assert result.code == 0, result.stderr
    loaded = treecli.load(base / "run")
    assert set(loaded) == {"params", "step"}
    assert bits(np.asarray(loaded["params"]["e"])) == bits(tree["params"]["e"])
    # the item still has its name
    assert set(treecli.load(base / "run", item="default")) == {"params", "step"}
    item = cli("show", base / "run", "--item", "default", "--json").json
    assert [row["keypath"] for row in item["leaves"]] == ["default.params.e", "default.params.w", "default.step"]
    with pytest.raises(treecli.UsageError, match="no item 'state'; items: default"):
        treecli.load(base / "run", item="state")
