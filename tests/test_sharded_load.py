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


EVERY_FORMAT = r"""
import os, sys, zipfile
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, ml_dtypes, numpy as np, treecli
import orbax.checkpoint as ocp
jax.config.update("jax_enable_x64", True)  # int64 stays int64 on the devices
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding, PartitionSpec as P
from treecli.formats import npz

base = sys.argv[1]
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
rng = np.random.default_rng(1)
tree = {"w": rng.standard_normal((16, 6)).astype(np.float32),
        "e": rng.standard_normal((8, 4)).astype(ml_dtypes.bfloat16),
        "i": np.arange(8, dtype=np.int64) << 40,
        "s": np.asarray(3, np.int32)}
shardings = {"w": NamedSharding(mesh, P("x", "y")),  # 8 distinct shards
             "e": NamedSharding(mesh, P(None, "y")),  # each shard on 4 devices
             "i": NamedSharding(mesh, P()),  # replicated everywhere
             "s": SingleDeviceSharding(jax.devices()[5])}
like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in tree.items()}
paths = {"safetensors": f"{base}/m.safetensors", "npz": f"{base}/m.npz", "npz-compressed": f"{base}/c.npz",
         "msgpack": f"{base}/m.msgpack", "orbax": f"{base}/orbax", "hf": f"{base}/hf", "eqx": f"{base}/m.eqx"}
for name, path in paths.items():
    if name == "npz-compressed":  # treecli's npz (its dtype record keeps bf16), every member deflated
        treecli.save(tree, f"{base}/plain.npz")
        with zipfile.ZipFile(f"{base}/plain.npz") as plain, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            for member in plain.namelist():
                z.writestr(member, plain.read(member))
    elif name == "orbax":
        with ocp.StandardCheckpointer() as c:
            c.save(path, tree)
    elif name == "hf":
        treecli.save(tree, path, format="safetensors", max_shard_size=300)
    else:
        treecli.save(tree, path)

decompressions = []
stream = npz._member_stream
npz._member_stream = lambda *a: (decompressions.append(a[2]), stream(*a))[1]
for name, path in paths.items():
    got = treecli.load(path, like=like)
    for key, expected in tree.items():
        array = got[key]
        assert isinstance(array, jax.Array) and array.sharding == shardings[key], (name, key, array.sharding)
        assert array.dtype == expected.dtype, (name, key, array.dtype)
        assert np.asarray(array).tobytes() == expected.tobytes(), (name, key)
        for shard in array.addressable_shards:
            assert np.asarray(shard.data).tobytes() == expected[shard.index].tobytes(), (name, key, shard.index)
np.save(f"{base}/w.npy", tree["w"])  # a one-leaf file: the template is that leaf
one = treecli.load(f"{base}/w.npy", like=like["w"])
assert one.sharding == shardings["w"] and np.asarray(one).tobytes() == tree["w"].tobytes()
# a compressed member is decompressed once, then sliced, not once per shard
assert sorted(decompressions) == ["e", "i", "s", "w"], decompressions

# load(path, sharding=): one sharding for every leaf, or a function of the key path
replicated = treecli.load(paths["safetensors"], sharding=NamedSharding(mesh, P()))
assert all(replicated[k].sharding == NamedSharding(mesh, P()) for k in tree)
chosen = treecli.load(paths["orbax"], sharding=lambda keypath: shardings[keypath])
assert {k: chosen[k].sharding for k in tree} == shardings
assert all(np.asarray(chosen[k]).tobytes() == v.tobytes() for k, v in tree.items())
try:
    treecli.load(paths["safetensors"], sharding=NamedSharding(mesh, P("x", "y")))
except treecli.UsageError as e:
    assert "does not fit this leaf" in str(e) and ": e:" not in str(e), str(e)
else:
    raise AssertionError("a sharding that does not fit was accepted")
jax.config.update("jax_enable_x64", False)  # JAX would make int64 int32: refused, naming the leaf
try:
    treecli.load(paths["safetensors"], like=like)
except treecli.UsageError as e:
    assert str(e).startswith("i: an int64 leaf would become int32") and "jax_enable_x64" in str(e), str(e)
else:
    raise AssertionError("int64 became int32 silently")
print("ok")
"""


def test_every_format_loads_into_any_sharding(tmp_path):
    result = subprocess.run([sys.executable, "-c", EVERY_FORMAT, str(tmp_path)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


KEYS_AND_MISFITS = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np, treecli
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()), ("x",))
sharding = NamedSharding(mesh, P("x"))
keys = jax.device_put(jax.random.split(jax.random.key(3), 8), sharding)
w = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), sharding)
state = {"rngs": keys, "w": w}
treecli.save(state, sys.argv[1])
like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
back = treecli.load(sys.argv[1], like=like)
assert back["rngs"].sharding == sharding, back["rngs"].sharding  # every leaf its template's, key data too
assert jax.dtypes.issubdtype(back["rngs"].dtype, jax.dtypes.prng_key)
assert np.array_equal(jax.random.key_data(back["rngs"]), jax.random.key_data(keys))
assert back["w"].sharding == sharding
# an NNX state's key leaf, through its own template
model = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=jax.random.key(1)))
graphdef, nnx_state = nnx.split(model)
sharded = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), nnx_state)
treecli.save(sharded, sys.argv[2])
again = treecli.load(sys.argv[2], like=sharded)
for got, want in zip(jax.tree.leaves(again), jax.tree.leaves(sharded)):
    assert got.sharding == want.sharding, (got.sharding, want.sharding)
# a sharding that does not divide a leaf: one line naming it, as sharding= does
odd = {"rngs": like["rngs"], "w": jax.ShapeDtypeStruct((8, 4), np.float32,
                                                       sharding=NamedSharding(mesh, P(None, "x")))}
try:
    treecli.load(sys.argv[1], like=odd)
except treecli.TreecliError as e:
    assert "w: the sharding does not fit this leaf of shape [8, 4]" in str(e), str(e)
else:
    raise AssertionError("no error")
print("ok")
"""


def test_typed_key_leaves_take_their_template_s_sharding_and_misfits_name_the_leaf(tmp_path):
    pytest.importorskip("flax")
    result = subprocess.run([sys.executable, "-c", KEYS_AND_MISFITS, str(tmp_path / "k.safetensors"),
                             str(tmp_path / "nnx.safetensors")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


PEAK = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np, treecli
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()), ("x",))
like = {"w": jax.ShapeDtypeStruct((8192, 8192), np.float32, sharding=NamedSharding(mesh, P("x")))}
jax.device_put(np.zeros(1), jax.devices()[0]).block_until_ready()
start = int(open("/proc/self/statm").read().split()[1]) * 4096
tree = treecli.load(sys.argv[1], like=like)
tree["w"].block_until_ready()
# (the peak of this process's own memory: ru_maxrss would carry over a big parent's, through fork and exec)
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) * 1024
assert float(np.asarray(tree["w"][4096, 7])) == 1.0
print(f"{(peak - start) / (256 << 20):.2f}")
"""


def test_a_sharded_load_holds_its_shards_and_a_bounded_buffer(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.ones((8192, 8192), np.float32)}, str(tmp_path / "w.safetensors"))  # 256 MiB, written here:
    # the loading process's peak is its own (ru_maxrss never goes down)
    result = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / "w.safetensors")], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    # the shards (the array, on CPU devices in this process) plus at most half of it in flight
    assert float(result.stdout.strip()) <= 1.5, result.stdout
