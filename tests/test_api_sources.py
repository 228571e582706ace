"""No writer replaces a file a tree it writes is still read from: the Python API learns
an output's sources from the lazy leaves themselves, and in-place edits hold the input
for their whole read-modify-write (issue 31)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import treecli

from .conftest import file_sha256


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "a.safetensors"
    save_file({"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, np.float32)}, str(path))
    return path


def test_saving_a_lazy_tree_over_its_own_file_is_refused_whatever_force_says(model):
    digest = file_sha256(model)
    tree = treecli.load(model)
    with pytest.raises(treecli.UsageError, match="output is the input"):
        treecli.save(tree, model, force=True)
    with pytest.raises(treecli.UsageError, match="output is the input"):
        treecli.save({"only": tree["w"]}, model, force=True)  # one leaf is enough
    assert file_sha256(model) == digest
    assert sorted(p.name for p in model.parent.iterdir()) == ["a.safetensors"]


@pytest.mark.parametrize("operation", ["average", "merge", "slice", "edit", "cast"])
def test_saving_a_result_computed_from_a_file_over_that_file_is_refused(model, tmp_path, operation):
    other = tmp_path / "other.safetensors"
    save_file({"w": np.zeros((3, 4), np.float32), "b": np.zeros(4, np.float32)}, str(other))
    a, b = treecli.load(model), treecli.load(other)
    result = {
        "average": lambda: treecli.average([b, a])[0],
        "merge": lambda: treecli.merge([b, a], "linear")[0],
        "slice": lambda: treecli.slice_tree(a, [":1"])[0],
        "edit": lambda: treecli.edit(a, treecli.Edits(scale=["**=2"]))[0],
        "cast": lambda: treecli.edit(a, treecli.Edits(cast=["**=bfloat16"]))[0],
    }[operation]()
    digest = file_sha256(model)
    with pytest.raises(treecli.UsageError, match="output is the input"):
        treecli.save(result, model, force=True)
    assert file_sha256(model) == digest


@pytest.mark.parametrize("name", ["a.npz", "dir"])
def test_other_formats_are_protected_alike(tmp_path, name):
    source = tmp_path / name
    treecli.save({"w": np.arange(6, dtype=np.float32)}, source, format=None if name.endswith(".npz") else "safetensors")
    tree = treecli.load(source)
    with pytest.raises(treecli.UsageError, match="input"):
        treecli.save(tree, source, force=True, format=None if name.endswith(".npz") else "safetensors")
    assert np.asarray(treecli.load(source)["w"]).tolist() == list(range(6))


def test_an_orbax_checkpoint_is_not_replaced_by_a_tree_read_from_it(tmp_path):
    source = tmp_path / "ckpt"
    treecli.save({"w": np.arange(6, dtype=np.float32)}, source, format="orbax")
    tree = treecli.load(source)
    with pytest.raises(treecli.UsageError, match="input"):
        treecli.save(tree, source, format="orbax", force=True)
    assert np.asarray(treecli.load(source)["w"]).tolist() == list(range(6))


def test_saving_a_tree_read_into_memory_over_its_file_is_allowed(model):
    tree = treecli.load(model, lazy=False)
    treecli.save({**tree, "w": tree["w"] * 2}, model, force=True)
    assert load_file(str(model))["w"].tolist() == (np.arange(12, dtype=np.float32).reshape(3, 4) * 2).tolist()


EDIT = """
import sys
from treecli.cli import main
sys.exit(main(["edit", sys.argv[1], "--in-place", "--scale", "w=2", "--quiet"]))
"""


def test_concurrent_in_place_edits_of_one_file_both_land(tmp_path):
    path = tmp_path / "big.safetensors"
    w = np.ones(8 << 20, np.float32)  # 32 MiB: long enough for the two to overlap
    for trial in range(3):
        save_file({"w": w}, str(path))
        runs = [subprocess.Popen([sys.executable, "-c", EDIT, str(path)], stderr=subprocess.PIPE, text=True)
                for _ in range(2)]
        errors = [run.communicate()[1] for run in runs]
        assert [run.returncode for run in runs] == [0, 0], errors
        result = load_file(str(path))["w"]
        assert np.all(result == 4), (trial, np.unique(result))  # both scalings, none lost
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors"]
