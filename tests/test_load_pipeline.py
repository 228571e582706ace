"""Issue 45: loads onto devices read a file's byte runs in requests on several threads, onto
an accelerator through a bounded ring of reused host buffers (here forced on CPU devices),
onto CPU devices straight into the memory the device takes; through the page cache or with
direct I/O. Every shard lands in its device's array bit for bit, the ring stays bounded,
and a failure or Ctrl-C mid-load stops every read before it is raised. Eight CPU devices
stand in for accelerators: XLA reads its flags once, so each check runs in a process of
its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("jax")

SETUP = r"""
import os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, ml_dtypes, numpy as np, treecli
jax.config.update("jax_enable_x64", True)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from safetensors.numpy import save_file
from treecli import _devices, _hostbuffers
from treecli._bytes import local

mesh = Mesh(np.array(jax.devices()), ("x",))
rng = np.random.default_rng(0)
tensors = {
    "w": rng.standard_normal((320, 1000)).astype(np.float32),  # rows of 4000 bytes: many to a buffer
    "wide": rng.standard_normal((8, 40000)).astype(np.float32),  # a row of 160 KB: larger than a buffer
    "e": rng.standard_normal((32, 8)).astype(ml_dtypes.bfloat16),
    "v": rng.standard_normal(100_003).astype(np.float32),
    "step": np.asarray(7, np.int64),
}
path = sys.argv[1]
save_file(tensors, path)

def like(sharded):
    def sharding(name, value):
        if not sharded or value.ndim == 0:
            return jax.sharding.SingleDeviceSharding(jax.devices()[3])
        return NamedSharding(mesh, P("x") if value.shape[0] % 8 == 0 else P())  # (v: replicated on all 8)
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding(k, v)) for k, v in tensors.items()}

def check(tree, template):
    for name, expected in tensors.items():
        got = tree[name]
        assert got.sharding == template[name].sharding, (name, got.sharding)
        assert got.dtype == expected.dtype and np.asarray(got).tobytes() == expected.tobytes(), name
        for shard in got.addressable_shards:
            assert np.asarray(shard.data).tobytes() == expected[shard.index].tobytes(), (name, shard.index)

rings = []
class CountedRing(_hostbuffers.Ring):
    def __init__(self, *args):
        super().__init__(*args)
        rings.append(self)
_devices.Ring = CountedRing
"""

EVERY_WAY = SETUP + r"""
for through_ring in (False, True):
    _devices._host_memory_is_device = (lambda pieces: False) if through_ring else (lambda pieces: True)
    for sharded in (False, True):
        for direct in (False, True):
            rings.clear()
            template = like(sharded)
            check(treecli.load(path, like=template, threads=4, buffer_bytes=64 << 10, direct_io=direct), template)
            assert len(rings) == (1 if through_ring else 0), len(rings)
            assert all(ring.made <= 4 for ring in rings), [ring.made for ring in rings]  # (threads: the bound)
    template = like(True)
    check(treecli.load(path, like=template), template)  # (the defaults)
    check(treecli.load(path, sharding=lambda name: template[name].sharding, threads=1), template)
print("ok")
"""


def _run(script: str, path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=600)


def test_every_shard_lands_bit_exact_through_the_ring_and_straight_into_host_memory(tmp_path):
    result = _run(EVERY_WAY, tmp_path / "m.safetensors")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


STOPS = SETUP + r"""
from treecli._errors import TreecliError
calls = []
read_into = local.FileReader.read_into

def failing(at, error):
    def read(self, buffer, offset):
        calls.append(offset)
        if len(calls) == at:
            raise error
        return read_into(self, buffer, offset)
    return read

for through_ring in (False, True):
    _devices._host_memory_is_device = (lambda pieces: False) if through_ring else (lambda pieces: True)
    local.FileReader.read_into = failing(0, None)
    treecli.load(path, like=like(True), threads=4, buffer_bytes=64 << 10)
    whole = len(calls)  # (the reads of a load that does not fail)
    for error in (TreecliError("cannot read 65536 bytes at byte 0: Input/output error", file=path),
                  KeyboardInterrupt()):
        calls.clear()
        local.FileReader.read_into = failing(6, error)
        try:
            treecli.load(path, like=like(True), threads=4, buffer_bytes=64 << 10)
        except (TreecliError, KeyboardInterrupt) as e:
            assert type(e) is type(error), e
        else:
            raise AssertionError("the load did not fail")
        made = len(calls)
        time.sleep(0.3)
        assert len(calls) == made, (made, len(calls))  # no read goes on after the failure is raised
        assert made < whole / 2, (made, whole)  # (the requests not started were dropped)
        local.FileReader.read_into = read_into
        check(treecli.load(path, like=like(True), threads=4, buffer_bytes=64 << 10), like(True))  # (and the next works)
print("ok")
"""


def test_a_failure_or_ctrl_c_mid_load_stops_every_read_before_it_is_raised(tmp_path):
    result = _run(STOPS, tmp_path / "m.safetensors")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_settings_out_of_range_are_one_clear_error(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    import treecli

    save_file({"w": np.ones(4, np.float32)}, str(tmp_path / "m.safetensors"))
    for settings, fragment in (({"threads": 0}, "threads=0"), ({"buffer_bytes": 100}, "buffer_bytes=100")):
        with pytest.raises(treecli.UsageError, match=fragment):
            treecli.load(tmp_path / "m.safetensors", sharding=_one_device(), **settings)


def _one_device():
    import jax

    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
