"""JAX-native PyTrees through the Python API and the CLI (issue 16).

Every kind of pytree a JAX user holds — Equinox modules (with state, with an
``__init__`` that rewrites a field), flax structs, a linen ``TrainState``,
``nnx.State``, optax states, a user-registered node — goes through save/load,
at, average, slice_tree, edit and diff and comes back as its own type.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import treecli
from tests.conftest import assert_clean_error

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
eqx = pytest.importorskip("equinox")
optax = pytest.importorskip("optax")
flax = pytest.importorskip("flax")
from flax import nnx, struct  # noqa: E402
from flax.training import train_state  # noqa: E402

KEY = jax.random.PRNGKey(0)


class Rescaled(eqx.Module):
    """A module whose ``__init__`` rewrites its field: rebuilding must not call it."""

    weight: jax.Array
    scale: float = eqx.field(static=True)

    def __init__(self, n: int, scale: float = 2.0, *, key):
        self.scale = scale
        self.weight = jax.random.normal(key, (n,)) * scale


@struct.dataclass
class Params:
    w: jax.Array
    b: jax.Array
    name: str = struct.field(pytree_node=False, default="dense")


@jax.tree_util.register_pytree_with_keys_class
class Pair:
    """A user-registered node with named children."""

    def __init__(self, left, right):
        self.left, self.right = left, right

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("left"), self.left), (jax.tree_util.GetAttrKey("right"), self.right)), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


class NnxModel(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(2, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)


def _bf16_mlp(key):
    model = eqx.nn.MLP(2, 3, 4, 2, key=key)
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model)


def _train_state(key):
    params = {"dense": {"kernel": jax.random.normal(key, (2, 3)), "bias": jnp.zeros(3)}}
    return train_state.TrainState.create(apply_fn=lambda *a: None, params=params, tx=optax.adam(1e-3))


KINDS = {
    "eqx.nn.MLP": lambda key: eqx.nn.MLP(2, 3, 4, 2, key=key),
    "eqx.nn.MLP bf16": _bf16_mlp,
    "eqx BatchNorm with State": lambda key: eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="batch"),
    "eqx __init__ rewrites a field": lambda key: Rescaled(4, key=key),
    "flax struct.dataclass": lambda key: Params(w=jax.random.normal(key, (2, 2)), b=jnp.arange(2.0)),
    "flax TrainState": _train_state,
    "nnx.State": lambda key: nnx.state(NnxModel(nnx.Rngs(int(key[1])))),
    "optax adam state": lambda key: optax.adam(1e-3).init({"w": jax.random.normal(key, (3,))}),
    "registered node": lambda key: Pair(jax.random.normal(key, (2,)), {"x": np.arange(3, dtype=np.int64)}),
}


def _make(kind: str, seed: int = 0):
    return KINDS[kind](jax.random.PRNGKey(seed))


def assert_same_tree(got, want):
    """Same pytree type and structure; every leaf the same kind, dtype and bits."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert type(g) is type(w) or (isinstance(g, jax.Array) and isinstance(w, jax.Array)), (type(g), type(w))
        if hasattr(w, "dtype"):
            g, w = np.asarray(g), np.asarray(w)
            assert g.dtype == w.dtype and g.shape == w.shape
            assert g.tobytes() == w.tobytes()
        else:
            assert g == w


# --- 1 and 3: any pytree in, its own type out ----------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("suffix", [".safetensors", ".npz", ".msgpack", "_orbax"])
def test_save_then_load_like_the_template_is_bit_exact(kind, suffix, tmp_path):
    tree = _make(kind)
    path = treecli.save(tree, tmp_path / f"model{suffix}", format="orbax" if suffix == "_orbax" else None)
    assert_same_tree(treecli.load(path, like=tree), tree)


@pytest.mark.parametrize("kind", list(KINDS))
def test_save_as_eqx_reads_back_with_equinox(kind, tmp_path):
    tree = _make(kind)
    path = treecli.save(tree, tmp_path / "model.eqx")
    assert_same_tree(eqx.tree_deserialise_leaves(path, tree), tree)


@pytest.mark.parametrize("kind", list(KINDS))
def test_average_keeps_the_type_and_averages_every_float_leaf(kind):
    a, b = _make(kind, 0), _make(kind, 1)
    averaged, _ = treecli.average([a, b], non_float="first")
    assert jax.tree.structure(averaged) == jax.tree.structure(a)
    for got, x, y in zip(jax.tree.leaves(averaged), jax.tree.leaves(a), jax.tree.leaves(b)):
        if eqx.is_inexact_array(x):
            assert isinstance(got, type(x)) or isinstance(got, jax.Array)
            want = ((np.asarray(x, np.float64) + np.asarray(y, np.float64)) / 2).astype(x.dtype)
            np.testing.assert_array_equal(np.asarray(got), want)
        elif hasattr(x, "dtype"):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(x))  # non-float: first
        else:
            assert got == x


def test_average_of_two_modules_is_not_the_first_module():
    a, b = _make("eqx.nn.MLP", 0), _make("eqx.nn.MLP", 1)
    averaged, _ = treecli.average([a, b], non_float="first")
    assert isinstance(averaged, eqx.nn.MLP)
    assert not eqx.tree_equal(averaged, a)
    np.testing.assert_allclose(averaged.layers[0].weight, (a.layers[0].weight + b.layers[0].weight) / 2, rtol=1e-6)


@pytest.mark.parametrize("where", ["layers.0.bias", ".layers[0].bias", "layers[0].bias"])
def test_at_addresses_module_fields_in_treecli_and_jax_spellings(where):
    model = _make("eqx.nn.MLP")
    new = treecli.at(model, where, replace_fn=jnp.zeros_like)
    assert isinstance(new, eqx.nn.MLP)
    assert not np.asarray(new.layers[0].bias).any()
    assert new.layers[0].weight is model.layers[0].weight  # everything else passes through
    assert new.activation is model.activation


def test_at_replaces_a_whole_submodule_and_never_calls_init():
    model = Rescaled(3, key=KEY)
    new = treecli.at(model, "weight", replace=jnp.ones(3))
    assert isinstance(new, Rescaled)
    np.testing.assert_array_equal(new.weight, np.ones(3))  # __init__ would have doubled it
    mlp = _make("eqx.nn.MLP")
    other = eqx.nn.Linear(2, 4, key=jax.random.PRNGKey(5))
    swapped = treecli.at(mlp, "layers.0", replace=other)
    assert swapped.layers[0] is other


def test_at_on_a_missing_field_names_the_closest():
    with pytest.raises(treecli.KeyPathError, match="layers.0.bias"):
        treecli.at(_make("eqx.nn.MLP"), "layers.0.bais", replace=0)


@pytest.mark.parametrize("kind", ["eqx.nn.MLP", "flax TrainState", "optax adam state"])
def test_slice_tree_keeps_the_type(kind):
    tree = _make(kind)
    sliced, report = treecli.slice_tree(tree, [":1"])  # the default rule: 0-d leaves pass
    assert jax.tree.structure(sliced) == jax.tree.structure(tree)
    for got, x in zip(jax.tree.leaves(sliced), jax.tree.leaves(tree)):
        if getattr(x, "ndim", 0) >= 1:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(x)[:1])
    assert report.changed


def test_edit_scales_a_module_leaf_and_keeps_the_type():
    model = _make("eqx.nn.MLP")
    new, report = treecli.edit(model, treecli.Edits(scale=["layers.1.weight=2"]))
    assert isinstance(new, eqx.nn.MLP)
    np.testing.assert_allclose(new.layers[1].weight, model.layers[1].weight * 2)
    assert [row[0] for row in report.rows] == ["layers.1.weight"]


def test_diff_names_module_fields():
    a, b = _make("eqx.nn.MLP", 0), _make("eqx.nn.MLP", 0)
    b = eqx.tree_at(lambda m: m.layers[2].bias, b, b.layers[2].bias + 1)
    result = treecli.diff(a, b)
    assert [c.keypath for c in result.changed] == ["layers.2.bias"]
    assert treecli.diff(a, a).equal


def test_diff_of_a_module_and_its_saved_file(tmp_path):
    model = _make("flax TrainState")
    path = treecli.save(model, tmp_path / "state.safetensors")
    assert treecli.diff(model, treecli.load(path)).equal


# --- 2: one key-path text for memory and disk -------------------------------------------------------


def test_optax_fields_keep_their_names_in_memory_and_on_disk(tmp_path):
    state = _train_state(KEY)
    path = treecli.save(state, tmp_path / "state_orbax", format="orbax")
    on_disk = {treecli.format_keypath(kp) for kp, _ in _flat(treecli.load(path))}
    assert "opt_state.0.mu.dense.kernel" in on_disk
    in_memory = {treecli.format_keypath(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]}
    assert "opt_state.0.mu.dense.kernel" in in_memory
    assert {c for c in in_memory if "mu" in c} <= on_disk


def _flat(tree):
    from treecli import _tree

    return _tree.flatten(tree)


def test_format_keypath_takes_jax_key_paths_and_jax_keypath_goes_back():
    model = _make("eqx.nn.MLP")
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(model)[0]]
    assert treecli.format_keypath(paths[1]) == "layers.0.bias"
    assert treecli.jax_keypath(model, "layers.0.bias") == paths[1]
    assert treecli.jax_keypath(model, ".layers[0].bias") == paths[1]
    opt = optax.adam(1e-3).init({"w": jnp.ones(2)})
    mu = [p for p, _ in jax.tree_util.tree_flatten_with_path(opt)[0]][1]
    assert treecli.format_keypath(mu) == "0.mu.w"
    assert treecli.jax_keypath(opt, "0.mu.w") == mu


def test_keystr_forms_parse():
    from treecli._keypath import parse

    assert parse(".layers[0].bias") == parse("layers[0].bias")
    assert parse("['a']['b'][0]") == parse('a.b[0]')


# --- 5: lazy leaves JAX can use, and no leaked descriptors -------------------------------------------


def test_lazy_leaves_index_and_convert(tmp_path):
    data = np.arange(24, dtype=np.float32).reshape(4, 6)
    path = treecli.save({"w": data, "h": data.astype(ml_dtypes.bfloat16)}, tmp_path / "m.safetensors")
    tree = treecli.load(path)
    np.testing.assert_array_equal(tree["w"][1], data[1])
    np.testing.assert_array_equal(tree["w"][1:3, ::2], data[1:3, ::2])
    assert len(tree["w"]) == 4 and [row.tolist() for row in tree["w"]] == data.tolist()
    assert jnp.asarray(tree["h"]).dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(jnp.asarray(tree["w"])), data)
    eager = treecli.load(path, lazy=False)
    assert type(eager["w"]) is np.ndarray and eager["h"].dtype == ml_dtypes.bfloat16
    doubled = jax.jit(lambda t: jax.tree.map(lambda x: x * 2, t))(eager)
    np.testing.assert_array_equal(np.asarray(doubled["w"]), data * 2)
    np.testing.assert_array_equal(np.asarray(jax.device_put(eager)["w"]), data)


def test_in_memory_inputs_give_arrays_lazy_inputs_stay_lazy(tmp_path):
    a = {"w": np.ones(3, np.float32)}
    b = {"w": np.zeros(3, np.float32)}
    averaged, _ = treecli.average([a, b])
    assert type(averaged["w"]) is np.ndarray
    pa, pb = treecli.save(a, tmp_path / "a.safetensors"), treecli.save(b, tmp_path / "b.safetensors")
    lazy, _ = treecli.average([treecli.load(pa), treecli.load(pb)])
    assert isinstance(lazy["w"], treecli.ArrayLeaf)
    np.testing.assert_array_equal(np.asarray(lazy["w"]), np.full(3, 0.5, np.float32))


@pytest.mark.parametrize("keep", [False, True], ids=["dropped", "kept"])
def test_a_thousand_loads_under_ulimit_256(keep, tmp_path):
    path = treecli.save({"w": np.arange(4, dtype=np.float32)}, tmp_path / "m.safetensors")
    eqx_path = tmp_path / "m.eqx"
    eqx.tree_serialise_leaves(eqx_path, [jnp.ones(2), jnp.zeros(3)])
    script = textwrap.dedent(f"""
        import resource, numpy as np, treecli
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        kept = []
        for i in range(1000):
            for p in ({str(path)!r}, {str(eqx_path)!r}):
                tree = treecli.load(p)
                first = tree["w"] if isinstance(tree, dict) else tree[0]
                assert np.asarray(first).size > 0
                if {keep}:
                    kept.append(tree)
        for tree in kept[::97]:
            np.asarray(tree["w"] if isinstance(tree, dict) else tree[1])
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]


def test_a_dropped_tree_closes_its_file(tmp_path):
    import gc

    path = treecli.save({"w": np.arange(4, dtype=np.float32)}, tmp_path / "m.safetensors")
    gc.collect()  # earlier tests' trees
    before = len(os.listdir("/proc/self/fd"))
    tree = treecli.load(path)
    np.asarray(tree["w"])
    assert len(os.listdir("/proc/self/fd")) == before + 1
    del tree
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_reader_collected_while_the_pool_is_busy_never_deadlocks(tmp_path):
    """The collector runs finalizers wherever it likes: inside the pool's own locked section too."""
    import threading

    from treecli._bytes import local

    path = treecli.save({"w": np.arange(4, dtype=np.float32)}, tmp_path / "m.safetensors")
    reader = local.FileReader(str(path))
    with local._POOL.descriptor(reader) as fd:
        pass

    def collected_inside_the_lock():
        with local._POOL._lock:
            local._POOL.collected(reader.token)

    worker = threading.Thread(target=collected_inside_the_lock, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive()
    with local._POOL.descriptor(local.FileReader(str(path))):  # the next user closes it
        pass
    with pytest.raises(OSError):
        os.fstat(fd)


# --- 6: errors in the caller's language ---------------------------------------------------------------


def test_library_errors_name_parameters_and_the_cli_names_flags(tmp_path, cli):
    tree = {"w": np.ones(2, np.float32), "note": "text"}
    with pytest.raises(treecli.TreecliError) as caught:
        treecli.save(tree, tmp_path / "m.safetensors")
    assert "drop_unsupported=True" in str(caught.value) and "--" not in str(caught.value)
    path = treecli.save(tree, tmp_path / "m.safetensors", drop_unsupported=True)
    assert list(treecli.load(path)) == ["w"]
    with pytest.raises(treecli.UsageError) as caught:
        treecli.save(tree, path, drop_unsupported=True)
    assert "force=True" in str(caught.value) and "--force" not in str(caught.value)
    with pytest.raises(treecli.UsageError) as caught:
        treecli.average([tree, tree], weights=[1, -1])
    assert "normalize=False" in str(caught.value) and "--" not in str(caught.value)
    result = cli("average", path, path, "--weights", "1,-1", "-o", tmp_path / "x.safetensors")
    assert_clean_error(result, "--no-normalize")


# --- 4: .eqx files named by the model's code ------------------------------------------------------------

MODELS = '''
import jax, jax.numpy as jnp, equinox as eqx

class Rescaled(eqx.Module):
    weight: jax.Array
    scale: float = eqx.field(static=True)

    def __init__(self, n, scale=2.0, *, key):
        self.scale = scale
        self.weight = jax.random.normal(key, (n,)) * scale

def make_mlp():
    return eqx.nn.MLP(2, 3, 4, 2, key=jax.random.PRNGKey(0))

def make_with_state():
    return eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="batch")

def make_rescaled():
    return Rescaled(4, key=jax.random.PRNGKey(0))

def make_huge():
    return eqx.nn.Linear(100_000, 100_000, key=jax.random.PRNGKey(0))

INSTANCE = eqx.nn.MLP(2, 3, 4, 2, key=jax.random.PRNGKey(0))
'''

FACTORIES = {
    "mlp": ("make_mlp", lambda: eqx.nn.MLP(2, 3, 4, 2, key=jax.random.PRNGKey(0))),
    "state": ("make_with_state", lambda: eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="batch")),
    "rescaled": ("make_rescaled", lambda: Rescaled(4, key=jax.random.PRNGKey(0))),
}


@pytest.fixture
def models(tmp_path, monkeypatch):
    """A user's package of models on the import path, and a trained-looking .eqx of each."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "mymodels.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(package))
    monkeypatch.chdir(tmp_path)
    files = {}
    for name, (_, factory) in FACTORIES.items():
        tree = jax.tree.map(lambda x: x + 1 if eqx.is_inexact_array(x) else x, factory())
        files[name] = tmp_path / f"{name}.eqx"
        eqx.tree_serialise_leaves(files[name], tree)
    yield files
    sys.modules.pop("mymodels", None)


def test_show_names_eqx_leaves_with_like(models, cli):
    plain = cli("show", models["mlp"], "--flat")
    assert plain.code == 0 and "layers.0.weight" not in plain.stdout
    named = cli("show", models["mlp"], "--flat", "--like", "mymodels:make_mlp")
    assert named.code == 0, named.stderr
    for name in ("layers.0.weight", "layers.0.bias", "layers.2.weight"):
        assert name in named.stdout
    assert "warning" not in named.stderr


@pytest.mark.parametrize("kind", list(FACTORIES))
def test_edit_in_place_round_trips_through_equinox(kind, models, cli):
    attr, factory = FACTORIES[kind]
    template = factory()
    before = eqx.tree_deserialise_leaves(models[kind], template)
    paths = [treecli.format_keypath(p) for p, x in jax.tree_util.tree_flatten_with_path(template)[0]
             if eqx.is_inexact_array(x) and x.ndim > 0]
    result = cli("edit", models[kind], "--like", f"mymodels:{attr}", "--in-place", "--scale", f"{paths[0]}=3")
    assert result.code == 0, result.stderr
    after = eqx.tree_deserialise_leaves(models[kind], template)
    for (p, x), y in zip(jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(after)):
        if treecli.format_keypath(p) == paths[0]:
            np.testing.assert_allclose(np.asarray(y), np.asarray(x) * 3, rtol=1e-6)
        elif hasattr(x, "dtype"):
            assert np.asarray(y).tobytes() == np.asarray(x).tobytes()


def test_eqx_commands_work_by_name(models, cli, tmp_path):
    like = ("--like", "mymodels:make_mlp")
    got = cli("get", models["mlp"], "layers.2.bias", "--json", *like)
    assert got.code == 0, got.stderr
    model = eqx.tree_deserialise_leaves(models["mlp"], FACTORIES["mlp"][1]())
    np.testing.assert_allclose(got.json["value"], np.asarray(model.layers[2].bias), rtol=1e-6)
    converted = cli("convert", models["mlp"], tmp_path / "m.safetensors", *like)
    assert converted.code == 0, converted.stderr
    assert set(treecli.load(tmp_path / "m.safetensors")["layers"]["1"]) == {"weight", "bias"}
    back = cli("convert", tmp_path / "m.safetensors", tmp_path / "back.eqx", *like)
    assert back.code == 0, back.stderr
    assert (tmp_path / "back.eqx").read_bytes() == models["mlp"].read_bytes()
    sliced = cli("slice", models["mlp"], "--index", "layers.0.weight=:1", "-o", tmp_path / "s.safetensors", *like)
    assert sliced.code == 0, sliced.stderr
    diffed = cli("diff", models["mlp"], tmp_path / "m.safetensors", "--like", "mymodels:make_mlp")
    assert diffed.code == 0, diffed.stdout + diffed.stderr


def test_average_of_eqx_files_writes_an_eqx_equinox_reads(models, cli, tmp_path):
    other = tmp_path / "other.eqx"
    eqx.tree_serialise_leaves(other, jax.tree.map(lambda x: x * 3 if eqx.is_inexact_array(x) else x,
                                                  eqx.tree_deserialise_leaves(models["mlp"], FACTORIES["mlp"][1]())))
    result = cli("average", models["mlp"], other, "--like", "mymodels:make_mlp", "-o", tmp_path / "avg.eqx")
    assert result.code == 0, result.stderr
    template = FACTORIES["mlp"][1]()
    a, b = (eqx.tree_deserialise_leaves(p, template) for p in (models["mlp"], other))
    averaged = eqx.tree_deserialise_leaves(tmp_path / "avg.eqx", template)
    np.testing.assert_allclose(averaged.layers[1].weight, (a.layers[1].weight + b.layers[1].weight) / 2, rtol=1e-6)


def test_like_builds_the_template_without_allocating(models, cli, tmp_path):
    """A 40 GB model's template costs nothing: the file does not fit it, and that is all we hear."""
    result = cli("show", models["mlp"], "--like", "mymodels:make_huge")
    assert_clean_error(result, "mlp.eqx")
    assert "[100000, 100000] float32" in result.stderr


def test_like_accepts_an_object(models, cli):
    result = cli("show", models["mlp"], "--flat", "--like", "mymodels:INSTANCE")
    assert result.code == 0 and "layers.1.bias" in result.stdout


def test_like_that_does_not_fit_lists_the_differences(models, cli):
    result = cli("show", models["mlp"], "--like", "mymodels:make_rescaled")
    assert_clean_error(result, "mlp.eqx")
    assert "weight" in result.stderr


@pytest.mark.parametrize("spec, fragment", [
    ("mymodels", "MODULE:ATTR"),
    ("nosuchmodule:make", "nosuchmodule"),
    ("mymodels:nothing", "nothing"),
])
def test_bad_like_is_one_clear_line(spec, fragment, models, cli):
    assert_clean_error(cli("show", models["mlp"], "--like", spec), fragment)


def test_load_like_checks_shapes_and_dtypes_diff_style(tmp_path):
    model = _make("eqx.nn.MLP")
    other = eqx.nn.MLP(2, 3, 5, 2, key=KEY)
    path = treecli.save(model, tmp_path / "m.safetensors")
    with pytest.raises(treecli.StructureError) as caught:
        treecli.load(path, like=other)
    text = "\n".join([str(caught.value)] + caught.value.details)
    assert "layers.0.weight" in text and "[5, 2]" in text and "[4, 2]" in text


def test_lazy_like_keeps_lazy_leaves(tmp_path):
    model = _make("eqx.nn.MLP")
    path = treecli.save(model, tmp_path / "m.safetensors")
    lazy = treecli.load(path, like=model, lazy=True)
    assert isinstance(lazy, eqx.nn.MLP) and isinstance(lazy.layers[0].weight, treecli.ArrayLeaf)


# --- 7: start-up --------------------------------------------------------------------------------------


@pytest.mark.parametrize("example", ["tiny.npz", "tiny.safetensors"])
def test_show_of_flat_formats_does_not_import_jax(example, tmp_path):
    root = Path(__file__).parents[1]
    script = (f"from treecli.cli import main\nmain(['show', {str(root / 'examples' / example)!r}])\n"
              "import sys; print('jax' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root)
    assert result.stdout.strip().splitlines()[-1] == "False"


def test_show_of_msgpack_does_not_import_jax(tmp_path):
    path = treecli.save({"a": {"b": np.ones(2, np.float32)}}, tmp_path / "m.msgpack")
    script = f"from treecli.cli import main\nmain(['show', {str(path)!r}])\nimport sys; print('jax' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("how", ["convert-shapes", "convert-dtype", "edit-cast", "edit-cast-in-place"])
def test_an_eqx_the_model_could_not_load_is_refused_before_writing(models, cli, tmp_path, how):
    """Record i of an .eqx file is the model's i-th leaf: a leaf of another shape or dtype
    would make the file unloadable into that model, so it is never written."""
    like = ("--like", "mymodels:make_mlp")
    before = models["mlp"].read_bytes()
    if how.startswith("convert"):
        tree = treecli.load(models["mlp"], like=FACTORIES["mlp"][1]())
        leaves = {treecli.format_keypath(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
                  if eqx.is_array(x)}
        leaves["layers.0.weight"] = (np.zeros((5, 2), np.float32) if how == "convert-shapes"  # the model's: [3, 2]
                                     else leaves["layers.0.weight"].astype(np.float16))
        save_file(leaves, str(tmp_path / "wrong.safetensors"))
        result = cli("convert", tmp_path / "wrong.safetensors", tmp_path / "out.eqx", *like)
    elif how == "edit-cast":
        result = cli("edit", models["mlp"], "-o", tmp_path / "out.eqx", "--cast", "layers.0.weight=bfloat16", *like)
    else:
        result = cli("edit", models["mlp"], "--in-place", "--cast", "layers.0.weight=bfloat16", *like)
    assert_clean_error(result, "could not load", "layers.0.weight")
    assert not (tmp_path / "out.eqx").exists()
    assert models["mlp"].read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".treecli")] == []


class _Noisy(nnx.Module):
    def __init__(self, seed: int):
        rngs = nnx.Rngs(seed, dropout=seed + 1)
        self.lin = nnx.Linear(2, 3, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)


def _key_leaf(state):
    return state["drop"]["rngs"]["key"].get_value()


@pytest.mark.parametrize("name", ["s.safetensors", "s.npz", "s.msgpack", "orbax_dir"])
def test_typed_prng_keys_round_trip_as_key_data(tmp_path, name):
    state = nnx.state(_Noisy(0))
    path = tmp_path / name
    treecli.save(state, path, format="orbax" if name == "orbax_dir" else None, drop_unsupported=True)
    stored = treecli.load(path)["drop"]["rngs"]["key"]["value"]
    assert stored.dtype_name == "uint32" and tuple(stored.shape) == (2,)
    back = treecli.load(path, like=state)
    assert _key_leaf(back).dtype == _key_leaf(state).dtype  # key<fry> again
    assert np.array_equal(jax.random.key_data(_key_leaf(back)), jax.random.key_data(_key_leaf(state)))
    abstract = jax.eval_shape(lambda: nnx.state(_Noisy(0)))
    assert _key_leaf(treecli.load(path, like=abstract)).dtype == _key_leaf(state).dtype
    model = _Noisy(5)
    nnx.update(model, back)
    assert np.array_equal(model.lin.kernel.get_value(), state["lin"]["kernel"].get_value())
    if name.endswith(".safetensors"):
        assert json.loads(treecli.open(path).metadata["treecli.prng_keys"]) == {"drop.rngs.key.value": "threefry2x32"}


def test_typed_prng_keys_are_copied_by_average_and_merge_and_compared_by_diff():
    a, b = nnx.state(_Noisy(0)), nnx.state(_Noisy(0))
    b["lin"]["kernel"].set_value(b["lin"]["kernel"].get_value() + 1)
    soup, _ = treecli.average([a, b])
    assert _key_leaf(soup).dtype == _key_leaf(a).dtype
    assert np.array_equal(jax.random.key_data(_key_leaf(soup)), jax.random.key_data(_key_leaf(a)))
    merged, _ = treecli.merge([a, b], "linear")
    assert np.array_equal(jax.random.key_data(_key_leaf(merged)), jax.random.key_data(_key_leaf(a)))
    assert treecli.diff(a, a).equal
    other = nnx.state(_Noisy(1))
    changed = {c.keypath for c in treecli.diff(a, other).changed}
    assert "drop.rngs.key.value" in changed
    with pytest.raises(treecli.TreecliError, match="cannot be averaged") as caught:
        treecli.average([a, other], non_float="error")
    assert any("drop.rngs.key.value" in line for line in caught.value.details)
