"""Benchmark: loading a checkpoint onto JAX devices (issues 33 and 45), against the floor of
the machine measured in the same run.

One tree of float32 leaves (a few large, many medium, as a transformer's), written once as
safetensors and once as Orbax's own checkpoint, read onto the devices by, in each round:

  - treecli:            treecli.load("m.safetensors", like=abstract)
  - treecli direct_io:  the same with direct_io=True (past the page cache)
  - treecli of Orbax:   treecli.load(orbax_dir, like=abstract) (TensorStore reads the arrays)
  - orbax:              StandardCheckpointer().restore(orbax_dir, abstract)
  - safetensors.numpy:  safetensors.numpy.load_file + jax.device_put(x, sharding)

``abstract`` is the tree of ``ShapeDtypeStruct``s, unsharded (one device) and, where
there are several devices, sharded over all of them (rows split over a 1-d mesh); each
from the page cache and cold (every file dropped from the cache with
``posix_fadvise(DONTNEED)`` before each run). Every result is waited for
(``block_until_ready``) and dropped before the next. Medians of the rounds, in GiB/s, with
each one's ratio to Orbax measured in the same run, and its fraction of the floor:
min(the fastest plain reads of the same file, threads x request size swept, from the cache
or cold; the fastest copies of host buffers to the devices, kept there as a load keeps
them, threads x size swept).

    python bench/load.py [--gib 1] [--rounds 5] [--host-devices 8] [--dir /tmp]

``--host-devices N`` forces N CPU devices (XLA_FLAGS); on a GPU machine leave it out.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def tree_of(gib: float):
    """Leaves of about ``gib`` GiB: an embedding and an output head of 1/8 each, the rest
    in 32 MiB matrices and small norms; names without dots, one level for every reader."""
    import numpy as np

    total = int(gib * 2**30)
    rng = np.random.default_rng(0)
    big_rows = max(8, total // 8 // (4096 * 4) // 8 * 8)
    tree = {"embed": rng.standard_normal((big_rows, 4096), dtype=np.float32),
            "head": rng.standard_normal((big_rows, 4096), dtype=np.float32)}
    layer = 0
    remaining = total - 2 * tree["embed"].nbytes
    while remaining >= 32 << 20:
        tree[f"layer{layer}_w"] = rng.standard_normal((2048, 4096), dtype=np.float32)
        tree[f"layer{layer}_norm"] = np.ones(4096, np.float32)
        remaining -= (32 << 20) + 4096 * 4
        layer += 1
    return tree


def drop_cached(paths) -> None:
    """The files out of the page cache (a cold read comes from the disk)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_floor(path: Path, cold: bool) -> tuple[float, str]:
    """The fastest plain reads of the whole file (threads x request size), GiB/s, into reused buffers."""
    import numpy as np
    from concurrent.futures import ThreadPoolExecutor

    size = path.stat().st_size
    best = (0.0, "")
    for threads in (1, 2, 4, 8, 16):
        for request in (1 << 20, 4 << 20, 16 << 20, 64 << 20):
            if cold:
                drop_cached([path])
            fd = os.open(path, os.O_RDONLY)
            buffers = [np.empty(request, np.uint8) for _ in range(threads)]
            offsets = list(range(0, size, request))

            def work(i: int) -> None:
                for offset in offsets[i::threads]:
                    os.preadv(fd, [buffers[i][: min(request, size - offset)]], offset)

            start = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(work, range(threads)))
            seconds = time.perf_counter() - start
            os.close(fd)
            best = max(best, (size / 2**30 / seconds, f"{threads} threads x {request >> 20} MiB"))
    return best


def copy_floor(total: int) -> tuple[float, str]:
    """The fastest copies of host buffers onto the devices (threads x size), GiB/s: up to
    ``total`` bytes a setting, every copy kept on its device to the end of the sweep, as a
    load keeps what it copies (device memory never used before, as a load's: on CPU
    devices, memory freed by one setting and taken again by the next is twice as fast)."""
    import jax
    import numpy as np
    from concurrent.futures import ThreadPoolExecutor

    devices = jax.devices()
    best = (0.0, "")
    every: list = []
    for threads in (1, 2, 4, 8):
        for size in (4 << 20, 16 << 20, 64 << 20):
            buffers = [np.ones(size // 4, np.float32) for _ in range(threads)]
            count = max(1, min(total, 256 << 20) // size)
            kept: list = [None] * count

            def work(i: int) -> None:
                for k in range(i, count, threads):
                    kept[k] = jax.device_put(buffers[i], devices[k % len(devices)], may_alias=False)
                    kept[k].block_until_ready()

            start = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(work, range(threads)))
            seconds = time.perf_counter() - start
            every += kept
            best = max(best, (count * size / 2**30 / seconds, f"{threads} threads x {size >> 20} MiB"))
    del every
    return best


def copy_floor_measured_apart(total: int, host_devices: int) -> tuple[float, str]:
    """:func:`copy_floor` in a process of its own, whose device memory is all new (in this
    one, what the benchmark freed would be taken again)."""
    import json
    import subprocess

    command = [sys.executable, __file__, "--copy-floor", str(total), "--host-devices", str(host_devices)]
    speed, how = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    return speed, how


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--host-devices", type=int, default=0, help="force this many CPU devices")
    parser.add_argument("--dir", default=None, help="where to write the two checkpoints (default: a temp dir)")
    parser.add_argument("--copy-floor", type=int, default=0, help=argparse.SUPPRESS)  # (copy_floor_measured_apart)
    args = parser.parse_args()
    if args.host_devices:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.host_devices}"
        os.environ["JAX_PLATFORMS"] = "cpu"
    if args.copy_floor:
        import json

        print(json.dumps(copy_floor(args.copy_floor)))
        return

    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    import safetensors.numpy
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import treecli

    work = Path(tempfile.mkdtemp(prefix="treecli-load-", dir=args.dir))
    try:
        tree = tree_of(args.gib)
        nbytes = sum(v.nbytes for v in tree.values())
        st_path, orbax_path = work / "m.safetensors", work / "orbax"
        safetensors.numpy.save_file(tree, str(st_path))
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(str(orbax_path), tree)
        shapes = {k: (v.shape, v.dtype) for k, v in tree.items()}
        del tree
        gc.collect()
        files = [st_path, *(p for p in orbax_path.rglob("*") if p.is_file())]

        def warm() -> None:
            """Every file into the page cache, through one small buffer (not a GiB of bytes
            made and freed before each run: the run's own memory would pay for it)."""
            buffer = bytearray(16 << 20)
            for path in files:
                with open(path, "rb", buffering=0) as f:
                    while f.readinto(buffer):
                        pass

        devices = jax.devices()
        print(f"{nbytes / 2**30:.2f} GiB in {len(shapes)} float32 leaves; devices: {len(devices)} x "
              f"{devices[0].device_kind} ({devices[0].platform}); {os.cpu_count()} CPUs; medians of {args.rounds}")
        warm()
        floors = {"cache": read_floor(st_path, cold=False), "cold": read_floor(st_path, cold=True)}
        copy = copy_floor_measured_apart(nbytes, args.host_devices)
        for state, (speed, how) in floors.items():
            print(f"read floor ({state}): {speed:.2f} GiB/s ({how})")
        print(f"copy floor: {copy[0]:.2f} GiB/s ({copy[1]})")

        layouts = {"unsharded": lambda shape: jax.sharding.SingleDeviceSharding(devices[0])}
        if len(devices) > 1:
            mesh = Mesh(np.array(devices), ("x",))
            layouts[f"sharded over {len(devices)}"] = lambda shape: NamedSharding(
                mesh, P("x") if shape[0] % len(devices) == 0 else P())
        for layout, sharding_of in layouts.items():
            shardings = {k: sharding_of(shape) for k, (shape, _) in shapes.items()}
            abstract = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[k])
                        for k, (shape, dtype) in shapes.items()}

            def put(arrays):
                return {k: jax.device_put(v, shardings[k]) for k, v in arrays.items()}

            candidates = {
                "treecli.load(like=)": lambda: treecli.load(st_path, like=abstract),
                "treecli.load(like=, direct_io=True)": lambda: treecli.load(st_path, like=abstract, direct_io=True),
                "treecli.load(orbax_dir, like=)": lambda: treecli.load(orbax_path, like=abstract),
                "orbax restore": lambda: ocp.StandardCheckpointer().restore(orbax_path, abstract),
                "safetensors.numpy + device_put": lambda: put(safetensors.numpy.load_file(str(st_path))),
            }
            for state in ("cache", "cold"):
                times: dict[str, list[float]] = {name: [] for name in candidates}
                for _ in range(args.rounds):
                    for name, run in candidates.items():
                        gc.collect()
                        drop_cached(files) if state == "cold" else warm()
                        start = time.perf_counter()
                        result = run()
                        jax.block_until_ready(result)
                        times[name].append(time.perf_counter() - start)
                        del result
                floor = min(floors[state][0], copy[0])
                orbax = statistics.median(times["orbax restore"])
                print(f"\n{layout}, {'from the page cache' if state == 'cache' else 'cold'} (floor {floor:.2f} GiB/s):")
                print(f"  {'':38} {'seconds':>8} {'GiB/s':>7} {'vs orbax':>9} {'of floor':>9}")
                for name, ts in times.items():
                    median = statistics.median(ts)
                    speed = nbytes / 2**30 / median
                    print(f"  {name:38} {median:8.3f} {speed:7.2f} {orbax / median:8.2f}x {speed / floor:9.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
