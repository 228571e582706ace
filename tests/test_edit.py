import functools
import hashlib
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors import deserialize
from safetensors.numpy import load_file, save_file

from treecli._edit import Edits as _Edits
from treecli._edit import at, edit
from treecli._errors import KeyPathError, UsageError
from treecli.formats import open_array

from .conftest import BF16, assert_clean_error, bits, snapshot

# The operation is given how @file values are read, as treecli.edit and the CLI give it.
Edits = functools.partial(_Edits, open_array=open_array)


def materialize(tree):
    from treecli import _leaf, _tree

    return _tree.map_leaves(lambda kp, x: _leaf.as_leaf(x).read() if _leaf.is_array(x) else x, tree)


def sample():
    return {
        "_orig_mod": {
            "embed": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
            "head": {"kernel": np.ones((3, 2), np.float32), "bias": np.full(2, 7, np.float32)},
            "step": np.asarray(12, np.int64),
        },
        "opt_state": [{"mu": np.zeros(3, np.float32)}, None],
    }


def test_each_operation_against_hand_computed_results():
    tree = sample()
    out, _ = edit(tree, Edits(rename=["_orig_mod.**=**"], delete=["opt_state"], set=["head.bias=0"],
                              cast=["embed.**=bfloat16"], scale=["head.kernel=0.5"]))
    got = materialize(out)
    assert set(got) == {"embed", "head", "step"}
    assert got["embed"]["w"].dtype == BF16 and got["embed"]["w"].astype(np.float32).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert got["head"]["bias"].tolist() == [0, 0] and got["head"]["bias"].dtype == np.float32
    assert got["head"]["kernel"].tolist() == [[0.5, 0.5]] * 3
    assert int(got["step"]) == 12
    assert set(materialize(tree)["_orig_mod"]) == {"embed", "head", "step"}  # input not mutated


def test_untouched_leaves_are_the_same_objects_not_decoded_copies():
    tree = sample()
    out, _ = edit(tree, Edits(set=["_orig_mod.head.bias=1"]))
    assert out["_orig_mod"]["embed"]["w"] is tree["_orig_mod"]["embed"]["w"]


def test_renames_of_prefixes_and_collisions():
    tree = {"a": {"x": np.zeros(1)}, "b": {"x": np.ones(1)}, "c": np.zeros(2)}
    out, _ = edit(tree, Edits(rename=["a=z"]))
    assert set(out) == {"z", "b", "c"} and float(out["z"]["x"][0]) == 0
    with pytest.raises(KeyPathError, match="onto the existing b.x"):
        edit(tree, Edits(rename=["a=b"]))
    with pytest.raises(KeyPathError, match="sends a.x and b.x to the same key path"):
        edit(tree, Edits(rename=["*.x=y"]))
    with pytest.raises(KeyPathError, match="matches nothing; closest"):
        edit(tree, Edits(rename=["bb.x=e"]))


def test_set_and_delete_of_one_key_path_conflict():
    with pytest.raises(KeyPathError, match="both deleted"):
        edit(sample(), Edits(delete=["_orig_mod.head"], set=["_orig_mod.head.bias=0"]))


def test_errors_name_the_key_path_and_the_closest_ones():
    with pytest.raises(KeyPathError) as info:
        edit(sample(), Edits(delete=["_orig_mod.haed"]))
    assert "closest: _orig_mod.head" in str(info.value)
    with pytest.raises(UsageError, match="subtree of 2 leaves"):
        edit(sample(), Edits(set=["_orig_mod.head=0"]))
    with pytest.raises(UsageError, match="unknown dtype"):
        edit(sample(), Edits(cast=["_orig_mod.embed.w=float17"]))
    with pytest.raises(UsageError, match="floating-point"):
        edit(sample(), Edits(scale=["_orig_mod.step=2"]))
    with pytest.raises(UsageError, match="None leaf can only be set from a file"):
        edit(sample(), Edits(set=["opt_state.1=0"]))


def test_wildcard_casts_take_float_leaves_only_exact_paths_any_dtype():
    out, _ = edit(sample(), Edits(cast=["**=float16"]))
    got = materialize(out)
    assert got["_orig_mod"]["step"].dtype == np.int64 and got["_orig_mod"]["embed"]["w"].dtype == np.float16
    out, _ = edit(sample(), Edits(cast=["_orig_mod.step=int32"]))
    assert materialize(out)["_orig_mod"]["step"].dtype == np.int32


def test_cast_over_many_chunks_counts_only_finite_values_that_overflow_and_rounds_as_numpy():
    """Overflow is found in the output and checked against the source: an inf or NaN
    already there is not counted; every chunk is cast as NumPy casts."""
    from treecli._combine import SUB_CHUNK

    rng = np.random.default_rng(0)
    w = rng.standard_normal(3 * SUB_CHUNK + 5) * 1e3
    w[[7, SUB_CHUNK + 1, 3 * SUB_CHUNK + 4]] = 1e39  # past bfloat16's range, in three places
    w[[8, 2 * SUB_CHUNK]] = [np.inf, np.nan]
    out, report = edit({"w": w}, Edits(cast=["w=bfloat16"]))
    got = materialize(out)["w"]
    with np.errstate(over="ignore"):
        assert got.tobytes() == w.astype(BF16).tobytes()
    assert report.warnings == ["w: 3 values fall outside bfloat16's range and became inf"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "float8_e4m3fn"])
def test_nonfinite_reads_the_exponent_bits_as_numpy_would_judge(dtype):
    from treecli import _dtypes

    values = np.array([0.0, -0.0, 1.5, -2.0, np.inf, -np.inf, np.nan, 1e-40, 448.0]).astype(_dtypes.numpy_dtype(dtype))
    got = _dtypes.nonfinite(values, np.empty(values.size, bool), np.empty(values.size * 8, np.uint8))
    assert got.tolist() == (~np.isfinite(values)).tolist()


def test_lossy_cast_warns_when_written():
    out, report = edit({"w": np.array([1.0, 1e6], np.float32)}, Edits(cast=["w=float16"]))
    assert materialize(out)["w"][1] == np.inf
    assert report.warnings == ["w: 1 value falls outside float16's range and became inf"]


def test_none_leaves_can_be_addressed_and_replaced_from_a_file(tmp_path):
    np.save(tmp_path / "v.npy", np.arange(4, dtype=np.float32))
    out, _ = edit(sample(), Edits(set=[f"opt_state.1=@{tmp_path / 'v.npy'}"]))
    assert materialize(out)["opt_state"][1].tolist() == [0, 1, 2, 3]
    assert isinstance(out["opt_state"], list)


def test_set_from_npy_checks_shape_and_casts_to_the_leaf_dtype(tmp_path):
    np.save(tmp_path / "k.npy", np.full((3, 2), 2.5, np.float64))
    np.save(tmp_path / "bad.npy", np.zeros((4, 4), np.float32))
    out, _ = edit(sample(), Edits(set=[f"_orig_mod.head.kernel=@{tmp_path / 'k.npy'}"]))
    kernel = materialize(out)["_orig_mod"]["head"]["kernel"]
    assert kernel.dtype == np.float32 and kernel.tolist() == [[2.5, 2.5]] * 3
    with pytest.raises(UsageError, match=r"shape \[4, 4\] does not match the leaf's \[3, 2\]"):
        edit(sample(), Edits(set=[f"_orig_mod.head.kernel=@{tmp_path / 'bad.npy'}"]))
    out, _ = edit(sample(), Edits(set=[f"_orig_mod.head.kernel=@{tmp_path / 'bad.npy'}"], allow_reshape=True))
    assert materialize(out)["_orig_mod"]["head"]["kernel"].shape == (4, 4)


def test_npy_object_arrays_are_never_unpickled(tmp_path):
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(UsageError, match="cannot read it"):
        edit(sample(), Edits(set=[f"_orig_mod.head.bias=@{tmp_path / 'obj.npy'}"]))


def test_at_is_tree_at_with_key_paths():
    tree = sample()
    out = at(tree, "_orig_mod.head.bias", replace_fn=lambda b: b * 0)
    assert out["_orig_mod"]["head"]["bias"].tolist() == [0, 0]
    out = at(tree, ["opt_state.1", "_orig_mod.step"], replace=["x", 3])
    assert out["opt_state"][1] == "x" and out["_orig_mod"]["step"] == 3
    assert tree["opt_state"][1] is None
    with pytest.raises(KeyPathError, match="closest"):
        at(tree, "_orig_mod.haed", replace=1)


# --- CLI ------------------------------------------------------------------------------------


def _make(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    save_file({"_orig_mod.embed.w": np.arange(6, dtype=np.float32).reshape(2, 3).astype(BF16),
               "_orig_mod.head.bias": np.full(2, 7, np.float32), "opt.mu": np.zeros(2, np.float32)},
              str(path), metadata={"format": "pt"})
    return path


def test_cli_edit_writes_only_what_was_named_and_keeps_other_bytes(cli, tmp_path):
    path = _make(tmp_path)
    out = tmp_path / "out.safetensors"
    result = cli("edit", path, "-o", out, "--rename", "_orig_mod.**=**", "--delete", "opt", "--set", "head.bias=0")
    assert result.code == 0, result.stderr
    got = load_file(str(out))
    src = load_file(str(path))
    assert set(got) == {"embed.w", "head.bias"}
    assert bits(got["embed.w"]) == bits(src["_orig_mod.embed.w"]) and got["embed.w"].dtype == BF16
    assert got["head.bias"].tolist() == [0, 0]


def test_cli_dry_run_reads_no_data_and_writes_nothing(cli, tmp_path, monkeypatch):
    from treecli._bytes import local

    path = _make(tmp_path)
    before = snapshot(tmp_path)
    monkeypatch.setattr(local.FileReader, "read_into", lambda *a: pytest.fail("dry run read data"))
    result = cli("edit", path, "--dry-run", "--cast", "**=float16", "--delete", "opt")
    assert result.code == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    assert rows == [["_orig_mod.embed.w", "[2,", "3]", "bfloat16", "[2,", "3]", "float16", "cast", "to", "float16"],
                    ["_orig_mod.head.bias", "[2]", "float32", "[2]", "float16", "cast", "to", "float16"],
                    ["opt.mu", "[2]", "float32", "-", "deleted"]]
    assert snapshot(tmp_path) == before


def test_cli_output_safety(cli, tmp_path):
    path = _make(tmp_path)
    link = tmp_path / "link.safetensors"
    link.symlink_to(path)
    hard = tmp_path / "hard.safetensors"
    os.link(path, hard)
    before = snapshot(tmp_path)
    for target in (path, tmp_path / "." / "ckpt.safetensors", link, hard):
        assert_clean_error(cli("edit", path, "-o", target, "--set", "opt.mu=1"), "output is the input")
    (tmp_path / "exists.safetensors").write_bytes(b"old")
    assert_clean_error(cli("edit", path, "-o", tmp_path / "exists.safetensors", "--set", "opt.mu=1"), "--force")
    assert (tmp_path / "exists.safetensors").read_bytes() == b"old"
    (tmp_path / "exists.safetensors").unlink()
    assert snapshot(tmp_path) == before


def test_cli_in_place_replaces_the_input_atomically_and_keeps_its_mode(cli, tmp_path):
    path = _make(tmp_path)
    os.chmod(path, 0o640)
    inode = os.stat(path).st_ino
    result = cli("edit", path, "--in-place", "--scale", "_orig_mod.head.bias=2")
    assert result.code == 0, result.stderr
    assert load_file(str(path))["_orig_mod.head.bias"].tolist() == [14, 14]  # not zeros (safetensors #762)
    assert os.stat(path).st_ino != inode and os.stat(path).st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]


KILL_SCRIPT = r"""
import sys
from treecli.cli import main
sys.exit(main(["edit", sys.argv[1], "--in-place", "--scale", "**=0.5", "--quiet"]))
"""


def test_in_place_survives_kill_9_at_any_moment(tmp_path):
    """Old or new file, never a mix: SIGKILL at random moments during --in-place."""
    path = tmp_path / "big.safetensors"
    rng = np.random.default_rng(0)
    save_file({f"l{i}": rng.standard_normal(1 << 20).astype(np.float32) for i in range(24)}, str(path))  # 96 MiB
    versions = {hashlib.sha256(path.read_bytes()).hexdigest()}
    random.seed(0)
    for trial in range(6):
        proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(path)])
        time.sleep(random.uniform(0.2, 1.2))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest not in versions:  # the run finished before the kill: a complete new version
            deserialize(path.read_bytes())
            versions.add(digest)
        assert len(deserialize(path.read_bytes())) == 24
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "big.safetensors"]
    assert all(name.startswith(".treecli-tmp-") for name in leftovers)
    # the next run removes the dead runs' temporaries
    subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(path)], check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors"]


@pytest.mark.parametrize("layout", ["c", "fortran", "big-endian"])
def test_set_from_npy_reads_every_layout_numpy_writes(tmp_path, layout):
    value = np.arange(6, dtype=np.float32).reshape(3, 2)
    stored = {"c": value, "fortran": np.asfortranarray(value), "big-endian": value.astype(">f4")}[layout]
    np.save(tmp_path / "k.npy", stored)
    out, _ = edit(sample(), Edits(set=[f"_orig_mod.head.kernel=@{tmp_path / 'k.npy'}"]))
    assert np.asarray(out["_orig_mod"]["head"]["kernel"]).tolist() == value.tolist()


def test_a_set_npy_truncated_while_the_edit_runs_is_one_line_not_sigbus(tmp_path):
    """The value file is read by positional reads, never mapped: a file that shrinks under
    treecli is an error naming it (a memory map would die of SIGBUS)."""
    import treecli
    from treecli._errors import TreecliError

    big = np.ones((1 << 22,), np.float32)  # 16 MiB
    save_file({"w": big}, str(tmp_path / "m.safetensors"))
    np.save(tmp_path / "v.npy", big * 2)
    tree, _ = edit(treecli.load(tmp_path / "m.safetensors"), Edits(set=[f"w=@{tmp_path / 'v.npy'}"]))
    os.truncate(tmp_path / "v.npy", 4096)  # after the header was read, before the data
    with pytest.raises(TreecliError, match="v.npy"):
        treecli.save(tree, tmp_path / "out.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "v.npy"]
