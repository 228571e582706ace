"""Orbax checkpoints built by Orbax itself (StandardCheckpointer, PyTreeCheckpointer,
CheckpointManager), read by treecli without restoring them."""

import re
import json
import shutil
from collections import namedtuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis.extra import numpy as hnp
from safetensors.numpy import load_file

import treecli

from .conftest import BF16, assert_clean_error, bits, snapshot

ocp = pytest.importorskip("orbax.checkpoint")

AdamState = namedtuple("AdamState", ["count", "mu", "nu"])


def train_state(seed=0):
    rng = np.random.default_rng(seed)
    params = {"dense": {"kernel": rng.standard_normal((4, 3)).astype(np.float32),
                        "bias": np.zeros(3, np.float32)},
              "embed": rng.standard_normal((5, 4)).astype(BF16)}
    zeros = {"dense": {"kernel": np.zeros((4, 3), np.float32), "bias": np.zeros(3, np.float32)},
             "embed": np.zeros((5, 4), BF16)}
    return {"step": np.asarray(3, np.int32), "params": params,
            "opt_state": [AdamState(np.asarray(3, np.int32), zeros, zeros), None]}


@pytest.fixture(scope="module")
def standard(tmp_path_factory):
    path = tmp_path_factory.mktemp("orbax") / "ckpt"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(str(path), train_state())
    return path


@pytest.fixture(scope="module")
def manager_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("orbax") / "run"
    with ocp.CheckpointManager(str(root)) as manager:
        for step in (10, 20):
            manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(train_state(step)),
                                                       meta=ocp.args.JsonSave({"step": step, "tags": ["a"]})))
        manager.wait_until_finished()
    return root


def leaves_of(tree):
    from treecli import _tree
    from treecli._keypath import format_keypath

    return {format_keypath(kp): leaf for kp, leaf in _tree.flatten(tree)}


def test_standard_checkpoint_shows_shapes_dtypes_and_values(cli, standard):
    document = cli("show", standard, "--json").json
    assert document["format"] == "orbax"
    by_path = {leaf["keypath"]: leaf for leaf in document["leaves"]}
    assert by_path["params.embed"] == {"keypath": "params.embed", "shape": [5, 4], "dtype": "bfloat16", "nbytes": 40,
                                       "stored_dtype": "bfloat16", "stored_nbytes": 40}
    assert by_path["step"]["dtype"] == "int32" and by_path["step"]["shape"] == []
    assert by_path["opt_state.0.count"]["dtype"] == "int32"
    assert "opt_state.1" not in by_path  # None: an empty subtree, as in jax.tree_util
    assert document["total_params"] == 1 + 12 + 3 + 20 + 1 + 2 * 35


def test_leaves_read_lazily_and_bit_exactly(standard):
    state = train_state()
    leaves = leaves_of(treecli.load(standard))
    assert bits(leaves["params.embed"].read()) == bits(state["params"]["embed"])
    assert leaves["params.dense.kernel"].read((slice(1, 3), 0)).tolist() == state["params"]["dense"]["kernel"][1:3, 0].tolist()


def test_manager_root_lists_steps_and_items_and_takes_step(cli, manager_root):
    result = cli("show", manager_root)
    assert result.code == 0, result.stderr
    assert "steps: 10, 20" in result.stdout and "step: 20" in result.stdout and "items: meta, state" in result.stdout
    document = cli("show", manager_root, "--step", "10", "--json").json
    by_path = {leaf["keypath"]: leaf for leaf in document["leaves"]}
    assert by_path["meta.step"] == {"keypath": "meta.step", "type": "int", "value": 10}
    assert by_path["state.params.embed"]["dtype"] == "bfloat16"
    assert document["step"] == 10 and document["steps"] == [10, 20]
    assert_clean_error(cli("show", manager_root, "--step", "15"), "no committed step 15")


def test_diff_names_each_side_s_step(cli, manager_root, tmp_path):
    same = cli("diff", manager_root, manager_root, "--step-a", "10", "--step-b", "10", "--json")
    assert same.code == 0 and same.json["equal"], same.stderr
    apart = cli("diff", manager_root, manager_root, "--step-a", "10", "--step-b", "20", "--json")
    assert apart.code == 1, apart.stderr
    changed = {c["keypath"] for c in apart.json["changed"]}
    assert "meta.step" in changed and "state.params.dense.kernel" in changed  # train_state(10) vs (20)
    assert cli("diff", manager_root, manager_root, "--step", "20").code == 0  # --step: both sides
    latest = cli("diff", manager_root, manager_root, "--step-a", "20")  # B: its latest, 20
    assert latest.code == 0, latest.stderr
    assert_clean_error(cli("diff", manager_root, manager_root, "--step", "10", "--step-b", "20"), "not both")
    assert_clean_error(cli("diff", manager_root, manager_root, "--step-b", "15"), "no committed step 15")


def test_unfinished_steps_are_ignored_with_a_note(cli, manager_root, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(manager_root, root)
    (root / "30.orbax-checkpoint-tmp-123").mkdir()
    result = cli("show", root, "--json")
    assert result.json["step"] == 20
    assert "unfinished step directories: 30.orbax-checkpoint-tmp-123" in result.stderr


def test_pytree_checkpointer_mixed_leaves(tmp_path):
    path = tmp_path / "mixed"
    tree = {"bf16": np.ones((2, 3), BF16), "ints": np.arange(4, dtype=np.int32), "mask": np.array([True, False]),
            "py_int": 42, "py_float": 0.5, "name": "demo", "nothing": None, "empty": {}}
    ocp.PyTreeCheckpointer().save(str(path), tree)
    leaves = leaves_of(treecli.load(path))
    assert leaves["py_int"] == 42 and leaves["py_float"] == 0.5 and leaves["name"] == "demo"
    assert "nothing" not in leaves and leaves["empty"] == {}
    assert leaves["bf16"].dtype_name == "bfloat16" and leaves["mask"].read().tolist() == [True, False]


def test_orbax_to_safetensors_and_back_is_bit_exact(cli, standard, tmp_path):
    st = tmp_path / "out.safetensors"
    result = cli("edit", standard, "--drop-unsupported", "--scale", "params.dense.bias=1", "-o", st)
    assert result.code == 0, result.stderr
    assert "opt_state.1" not in result.stderr  # None is no leaf: nothing to drop
    tensors = load_file(str(st))
    assert bits(tensors["params.embed"]) == bits(train_state()["params"]["embed"])
    back = tmp_path / "back"
    result = cli("slice", st, "--index", "params.embed=:", "-o", back, "--format", "orbax")
    assert result.code == 0, result.stderr
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(str(back))
    assert restored["params"]["embed"].dtype == BF16
    assert bits(np.asarray(restored["params"]["embed"])) == bits(tensors["params.embed"])
    assert np.asarray(restored["step"]).dtype == np.int32


def test_bad_orbax_directories_get_one_clear_line(cli, standard, tmp_path):
    def copy(name):
        target = tmp_path / name
        shutil.copytree(standard, target)
        return target

    no_meta = copy("no_meta")
    (no_meta / "_METADATA").unlink()
    assert_clean_error(cli("show", no_meta), str(no_meta))
    corrupt = copy("corrupt")
    (corrupt / "_METADATA").write_text("{not json")
    assert_clean_error(cli("show", corrupt), "JSON")
    no_data = copy("no_data")
    shutil.rmtree(no_data / "ocdbt.process_0")
    shutil.rmtree(no_data / "d")
    result = cli("show", no_data)
    assert_clean_error(result, str(no_data))
    escaping = copy("escaping")
    secret = tmp_path / "secret.txt"
    secret.write_text("host file")
    (escaping / "link").symlink_to(secret)
    assert_clean_error(cli("show", escaping), "leaves the checkpoint directory")
    unfinished = tmp_path / "ckpt.orbax-checkpoint-tmp-99"
    shutil.copytree(standard, unfinished)
    assert_clean_error(cli("show", unfinished), "incomplete checkpoint")
    assert_clean_error(cli("show", standard, "--step", "3"), "CheckpointManager root")


def test_metadata_that_disagrees_with_the_data_is_an_error(cli, tmp_path):
    import jax.numpy as jnp

    target = tmp_path / "lying"
    with ocp.StandardCheckpointer() as checkpointer:  # jax.Array leaves: Orbax records their write_shape
        checkpointer.save(str(target), {"params": {"embed": jnp.ones((5, 4), jnp.bfloat16)}})
    meta = json.loads((target / "_METADATA").read_text())
    for entry in meta["tree_metadata"].values():
        if entry["value_metadata"].get("write_shape") == [5, 4]:
            entry["value_metadata"]["write_shape"] = [2**40]
    (target / "_METADATA").write_text(json.dumps(meta))
    assert_clean_error(cli("show", target), "params.embed", "_METADATA says [1099511627776]")


def test_show_of_orbax_never_imports_jax(standard):
    import subprocess
    import sys

    code = (f"from treecli.cli import main; main(['show', {str(standard)!r}]); import sys; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'orbax')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_orbax_output_that_would_not_fit_in_memory_is_refused(cli, tmp_path, monkeypatch):
    from treecli import _memory

    monkeypatch.setattr(_memory, "available", lambda: 1000)
    path = tmp_path / "in.safetensors"
    from safetensors.numpy import save_file

    save_file({"w": np.zeros(1000, np.float32)}, str(path))
    before = snapshot(tmp_path)
    assert_clean_error(cli("edit", path, "--scale", "w=2", "-o", tmp_path / "out", "--format", "orbax"),
                       "needs the whole output in memory")
    assert snapshot(tmp_path) == before


def test_a_local_checkpoint_is_finished_as_orbax_decides_by_its_name_not_its_markers(cli, standard, tmp_path):
    """Orbax renames a local save into place once complete; an older Orbax wrote neither
    commit_success.txt nor a commit time, and its checkpoints restore: they read."""
    for name, drop in (("no_marker", ["commit_success.txt"]),
                       ("no_checkpoint_metadata", ["commit_success.txt", "_CHECKPOINT_METADATA"])):
        target = tmp_path / name
        shutil.copytree(standard, target)
        for file in drop:
            (target / file).unlink()
        if (target / "_CHECKPOINT_METADATA").exists():
            meta = json.loads((target / "_CHECKPOINT_METADATA").read_text())
            meta.pop("commit_timestamp_nsecs", None)
            (target / "_CHECKPOINT_METADATA").write_text(json.dumps(meta))
        restored = ocp.StandardCheckpointer().restore(str(target))  # the reference restores it
        shown = cli("show", target, "--json")
        assert shown.code == 0, shown.stderr
        got = leaves_of(treecli.load(target))
        assert np.asarray(got["params.dense.kernel"]).tobytes() == \
            np.asarray(restored["params"]["dense"]["kernel"]).tobytes()
    unfinished = tmp_path / "run" / "100.orbax-checkpoint-tmp-1234"
    shutil.copytree(standard, unfinished)
    assert_clean_error(cli("show", unfinished), "incomplete checkpoint")


def test_composite_items_json_of_v0_and_v1_and_an_item_without_metadata(cli, tmp_path):
    from orbax.checkpoint.experimental import v1 as ocp1
    from orbax.checkpoint.experimental.v1._src.handlers import registration
    from orbax.checkpoint.experimental.v1._src.handlers.json_handler import JsonHandler

    registry = registration.local_registry()
    registry.add(JsonHandler, checkpointable_name="meta")
    path = tmp_path / "v1"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ocp1.Context(checkpointables_options=ocp1.options.CheckpointablesOptions(registry=registry)):
            ocp1.save_checkpointables(str(path), {"state": {"w": np.ones(3, np.float32)},
                                                  "meta": {"step": 3, "tags": ["a"]}})
    assert (path / "meta" / "data.json").is_file()
    shown = cli("show", path, "--json")
    assert shown.code == 0, shown.stderr
    assert {leaf["keypath"] for leaf in shown.json["leaves"]} == {"state.w", "meta.step", "meta.tags.0"}
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (broken / "state" / "_METADATA").unlink()
    assert_clean_error(cli("show", broken), "item 'state' has no _METADATA")


def test_item_restricts_show_to_one_item_of_a_step(cli, manager_root):
    document = cli("show", manager_root, "--item", "meta", "--json").json
    assert {leaf["keypath"] for leaf in document["leaves"]} == {"meta.step", "meta.tags.0"}
    assert_clean_error(cli("show", manager_root, "--item", "nope"), "no item 'nope'; items: meta, state")
    text = cli("show", manager_root, "--item", "meta").stdout  # values only: no empty dtype table
    assert "tags" in text and not re.search(r"^dtype +arrays", text, re.M)
    assert re.search(r"^dtype +arrays", cli("show", manager_root, "--item", "state").stdout, re.M)


def test_non_ocdbt_checkpoints_read_too(tmp_path):
    path = tmp_path / "plain"
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False))
    checkpointer.save(str(path), args=ocp.args.PyTreeSave({"w": np.arange(6, dtype=np.float32).reshape(2, 3),
                                                           "b": np.ones(2, BF16), "n": 3}))
    leaves = leaves_of(treecli.load(path))
    assert leaves["w"].read().tolist() == [[0, 1, 2], [3, 4, 5]]
    assert leaves["b"].dtype_name == "bfloat16" and leaves["n"] == 3


@pytest.mark.parametrize("strings", ["[1, 2]", '{"name": [1]}', '{"name": {"k": "v"}}', '"tiny"'])
def test_a_strings_file_of_other_json_is_one_clear_line(cli, tmp_path, strings):
    """_strings.json holds the tree's string leaves by name: anything but an object of
    strings is refused, naming the file, never an internal error or a string turned list."""
    import orbax.checkpoint as ocp

    path = tmp_path / "ckpt"
    ocp.PyTreeCheckpointer().save(str(path), {"w": np.ones(2, np.float32), "name": "tiny"})
    (path / "_strings.json").write_text(strings)
    result = cli("show", path)
    assert_clean_error(result, "_strings.json", "object of strings")
    assert "Error:" not in result.stderr  # no internal exception's name


class _ReadRecorder:
    """A TensorStore array standing in for an Orbax leaf's, recording how many elements each
    read takes (the memory a read needs)."""

    def __init__(self, store, reads):
        self._store, self._reads = store, reads

    def __getattr__(self, name):
        return getattr(self._store, name)

    def __getitem__(self, index):
        return _ReadRecorder(self._store[index], self._reads)

    def read(self):
        self._reads.append(int(np.prod(self._store.shape)))
        return self._store.read()


@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    """An array of 8 MiB saved in chunks of 64 KiB ((128, 128) float32), as a pod's shards or
    ``chunk_byte_size`` store it, beside one that is not chunked."""
    path = tmp_path_factory.mktemp("orbax") / "chunked"
    rng = np.random.default_rng(3)
    tree = {"big": rng.standard_normal((4096, 512)).astype(np.float32), "small": np.arange(10, dtype=np.int64)}
    ocp.PyTreeCheckpointer().save(str(path), tree, save_args={"big": ocp.SaveArgs(chunk_byte_size=64 << 10),
                                                             "small": ocp.SaveArgs()})
    return path, tree


def test_a_chunked_array_streams_a_band_of_chunks_at_a_time(chunked, tmp_path):
    """Converting reads a chunked array a band of chunk rows at a time, each a chunk of the
    stream's (4 MiB) rounded out to whole chunks: memory that does not grow with the array."""
    from treecli._leaf import CHUNK_BYTES

    path, tree = chunked
    reads: list[int] = []
    with treecli.open(path) as ckpt:
        leaf = ckpt.tree["big"]
        band = leaf._store.chunk_layout.read_chunk.shape[0] * leaf.shape[1]
        assert band < leaf.size  # (the fixture is chunked along its rows)
        leaf._store = _ReadRecorder(leaf._store, reads)
        treecli.save(ckpt.tree, tmp_path / "out.safetensors")
    assert len(reads) > 1 and max(reads) <= CHUNK_BYTES // 4 + 2 * band < leaf.size
    out = load_file(str(tmp_path / "out.safetensors"))
    assert bits(out["big"]) == bits(tree["big"]) and bits(out["small"]) == bits(tree["small"])


def test_an_index_into_a_chunked_array_reads_only_the_chunks_it_touches(chunked):
    path, tree = chunked
    reads: list[int] = []
    with treecli.open(path) as ckpt:
        leaf = ckpt.tree["big"]
        chunk = int(np.prod(leaf._store.chunk_layout.read_chunk.shape))
        leaf._store = _ReadRecorder(leaf._store, reads)
        for index in [(5,), (slice(700, 650, -3), slice(3, 300, 7)), (Ellipsis, 511), (-1, -1), ()]:
            reads.clear()
            assert bits(leaf.read(index)) == bits(tree["big"][index])
            if index != ():
                assert max(reads) <= 4 * chunk  # never the whole array


@settings(max_examples=60, deadline=None)
@given(index=hnp.basic_indices(shape=(4096, 512), allow_newaxis=True, allow_ellipsis=True))
def test_any_basic_index_into_a_chunked_array_reads_as_numpy_does(chunked, index):
    path, tree = chunked
    with treecli.open(path) as ckpt:
        got = ckpt.tree["big"].read(index)
    want = tree["big"][index]
    assert got.shape == want.shape and bits(got) == bits(want)
