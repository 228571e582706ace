"""PyTorch Distributed Checkpoint directories read without torch (issue 34, item 2):
written by ``torch.distributed.checkpoint.save`` in one process and in two (a DTensor
sharded over two gloo ranks, each writing its own chunks), compared bit for bit with
``dcp.load``."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import treecli
from treecli import _tree
from treecli._keypath import format_keypath

from .conftest import assert_clean_error

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
# dcp.save / dcp.load in one process say so
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def tensor_bytes(t) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def leaves(tree) -> dict:
    return {format_keypath(kp): leaf for kp, leaf in _tree.flatten(tree)}


RANK = r"""
import os, sys, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

rank, path, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
dist.init_process_group("gloo", rank=rank, world_size=2)
mesh = init_device_mesh("cpu", (2,))
g = torch.Generator().manual_seed(0)
full = {"w": torch.randn(6, 5, generator=g), "e": torch.randn(4, 8, generator=g).to(torch.bfloat16)}
state = {"model": {"w": distribute_tensor(full["w"], mesh, [Shard(0)]),
                   "e": distribute_tensor(full["e"], mesh, [Shard(1)])}, "step": 12}
dcp.save(state, checkpoint_id=path)
dist.barrier()
os._exit(0)  # gloo's teardown at exit sometimes aborts ("terminate called without an active exception")
"""


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    from .test_distributed import free_port

    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(path), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    errors = [rank.communicate(timeout=300)[1] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], [e[-2000:] for e in errors]
    return path


def test_a_checkpoint_of_two_ranks_reads_as_dcp_loads_it(sharded):
    assert len(list(sharded.glob("*.distcp"))) == 2
    g = torch.Generator().manual_seed(0)
    full = {"model.w": torch.randn(6, 5, generator=g), "model.e": torch.randn(4, 8, generator=g).to(torch.bfloat16)}
    target = {"model": {"w": torch.empty(6, 5), "e": torch.empty(4, 8, dtype=torch.bfloat16)}, "step": 0}
    dcp.load(target, checkpoint_id=sharded)
    assert tensor_bytes(target["model"]["w"]) == tensor_bytes(full["model.w"])
    got = leaves(treecli.load(sharded))
    assert got["step"] == 12
    for name, tensor in full.items():
        assert np.asarray(got[name]).tobytes() == tensor_bytes(tensor), name
        assert np.asarray(got[name][1:3]).tobytes() == tensor_bytes(tensor[1:3]), name  # rows across the chunks


def test_convert_a_dcp_checkpoint_to_safetensors(cli, sharded, tmp_path):
    from safetensors.numpy import load_file

    result = cli("convert", sharded, tmp_path / "model.safetensors", "--drop-unsupported")
    assert result.code == 0, result.stderr
    written = load_file(str(tmp_path / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    assert written["model.w"].tobytes() == tensor_bytes(torch.randn(6, 5, generator=g))


def test_one_process_checkpoint_and_its_values(cli, tmp_path):
    state = {"model": {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}, "step": 5, "name": "x"}
    dcp.save(state, checkpoint_id=tmp_path / "one")
    shown = cli("show", tmp_path / "one", "--json")
    assert shown.code == 0 and shown.json["format"] == "dcp", shown.stderr
    rows = {row["keypath"]: row for row in shown.json["leaves"]}
    assert rows["model.w"]["shape"] == [4, 3] and rows["step"]["value"] == 5 and rows["name"]["value"] == "x"
    assert np.asarray(leaves(treecli.load(tmp_path / "one"))["model.w"]).tobytes() == tensor_bytes(state["model"]["w"])


def test_damaged_checkpoints_are_one_line(cli, tmp_path):
    state = {"w": torch.randn(4, 3)}
    dcp.save(state, checkpoint_id=tmp_path / "c")
    (tmp_path / "c" / "__0_0.distcp").write_bytes(b"")  # the chunks' file emptied
    assert_clean_error(cli("show", tmp_path / "c"), "w: a chunk at", "past its end")
    (tmp_path / "c" / ".metadata").write_bytes(b"\x80\x04cos\nsystem\n.")  # a metadata pickle naming os.system
    assert_clean_error(cli("show", tmp_path / "c"), "names os.system")


def test_chunks_that_overlap_are_refused_though_their_volumes_add_up(cli, sharded, tmp_path):
    import pickle
    import shutil

    target = tmp_path / "overlapping"
    shutil.copytree(sharded, target)
    with open(target / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # (the test's own file: trusted)
    chunks = metadata.state_dict_metadata["model.w"].chunks
    assert [list(c.offsets) for c in chunks] == [[0, 0], [3, 0]]
    chunks[1].offsets = torch.Size([0, 0])  # both at row 0: 30 elements "held", rows 3-5 held by none
    with open(target / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    assert_clean_error(cli("show", target), "model.w: the chunks at [0, 0] and [0, 0] overlap")
    assert_clean_error(cli("convert", target, tmp_path / "o.safetensors"), "overlap")
    assert not (tmp_path / "o.safetensors").exists()


def test_a_value_holding_tensors_reads_as_a_subtree_never_a_private_object(cli, tmp_path):
    state = {"w": torch.ones(2), "pair": (torch.arange(2), "x"), "tags": frozenset(["a"])}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=tmp_path / "c")
    shown = cli("show", tmp_path / "c", "--json")
    assert shown.code == 0, shown.stderr  # (a frozenset pickled as __builtin__.frozenset, as protocol 2 names it)
    rows = {row["keypath"]: row for row in shown.json["leaves"]}
    assert rows["pair.0"]["shape"] == [2] and rows["pair.1"]["value"] == "x"
    assert "_Tensor" not in shown.stdout
    assert np.asarray(leaves(treecli.load(tmp_path / "c"))["pair.0"]).tolist() == [0, 1]
