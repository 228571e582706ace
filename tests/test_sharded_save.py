"""``save`` of JAX arrays sharded over several devices writes each shard from its device,
never gathering a whole array (a replicated shard read from one device), in every format
(issue 33, item 3). Eight CPU devices in a process of their own, as XLA reads its flags once."""

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
from treecli import _leaf

base = sys.argv[1]
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
rng = np.random.default_rng(2)
host = {"w": rng.standard_normal((64, 65536)).astype(np.float32),  # 16 MiB: four 4 MiB chunks
        "e": rng.standard_normal((12, 8)).astype(ml_dtypes.bfloat16),
        "v": np.arange(40, dtype=np.int32)}
specs = {"w": P("x", "y"), "e": P(None, "y"), "v": P("x")}  # v: each shard on two devices
tree = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
assert isinstance(_leaf.as_leaf(tree["w"]), _leaf.PiecedLeaf)
assert len(_leaf.as_leaf(tree["v"])._shards) == 4  # replicated over y: each row block read from one device

gathered = []
ArrayImpl = type(tree["w"])
asarray = ArrayImpl.__array__
def watched(self, *a, **k):
    gathered.append(self.nbytes)
    return asarray(self, *a, **k)
ArrayImpl.__array__ = watched
rows = []
rows_of = _leaf.PiecedLeaf._rows
_leaf.PiecedLeaf._rows = lambda self, first, last: (self.shape == host["w"].shape and rows.append(last - first),
                                                     rows_of(self, first, last))[1]
for target in ("m.safetensors", "m.npz", "hf", "orbax", "m.msgpack"):
    path = f"{base}/{target}"
    if target == "m.msgpack":  # msgpack holds each array as one bytes object: read whole, from its shards
        assert rows and max(rows) <= 16, max(rows)  # w's rows, a 4 MiB chunk at a time
    if target == "hf":
        treecli.save(tree, path, format="safetensors", max_shard_size=8 << 20)
    elif target == "orbax":
        treecli.save(tree, path, format="orbax")
    else:
        treecli.save(tree, path)
    ArrayImpl.__array__ = asarray
    back = treecli.load(path, lazy=False)
    for k, v in host.items():
        assert np.asarray(back[k]).tobytes() == v.tobytes() and back[k].dtype == v.dtype, (target, k)
    ArrayImpl.__array__ = watched
# no whole sharded array was ever copied to the host from one device: only shards' rows;
# streamed formats a chunk at a time (above), and Orbax writes the shards itself
assert max(gathered) <= host["w"].nbytes // 8, (max(gathered), host["w"].nbytes)
print("ok")
"""


def test_sharded_arrays_save_shard_by_shard_in_every_format(tmp_path):
    result = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
