"""``load(path, like=abstract)`` gives each leaf its template's sharding over a mesh, each
device's shard read from its own byte ranges (issue 33, first step). Eight CPU devices
stand in for accelerators: XLA reads its flags once, so the check runs in a process of
its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("jax")

CHECK = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, ml_dtypes, numpy as np, treecli
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from safetensors.numpy import save_file
from treecli._bytes import local

mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
rng = np.random.default_rng(0)
w = rng.standard_normal((64, 4096)).astype(np.float32)  # 1 MiB: each shard a quarter of the rows, half the columns
e = rng.standard_normal((32, 8)).astype(ml_dtypes.bfloat16)
path = sys.argv[1]
save_file({"w": w, "e": e, "step": np.asarray(7, np.int32)}, path)
like = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, P("x", "y"))),
        "e": jax.ShapeDtypeStruct(e.shape, e.dtype, sharding=NamedSharding(mesh, P(None, "x"))),
        "step": jax.ShapeDtypeStruct((), np.int32)}  # unsharded: read whole, as before
reads = []
read_into = local.FileReader.read_into
local.FileReader.read_into = lambda self, buffer, offset: (reads.append(buffer.nbytes), read_into(self, buffer, offset))[1]
tree = treecli.load(path, like=like)
for name, expected in (("w", w), ("e", e)):
    got = tree[name]
    assert got.sharding == like[name].sharding, (name, got.sharding)
    assert got.dtype == expected.dtype and np.asarray(got).tobytes() == expected.tobytes(), name
    assert all(s.data.shape == like[name].sharding.shard_shape(expected.shape) for s in got.addressable_shards)
assert int(tree["step"]) == 7
# each device read its own rows of w: eight shards of 1/8 of the bytes, no whole-leaf read
assert max(reads) <= w.nbytes // 4, max(reads)
print("ok")
"""


def test_a_template_sharded_over_a_mesh_loads_shard_by_shard(tmp_path):
    result = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path / "m.safetensors")], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
