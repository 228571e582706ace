"""Benchmark: loading a checkpoint onto JAX devices (issue 33).

One tree of float32 leaves (a few large, many medium, as a transformer's), written once as
safetensors and once as Orbax's own checkpoint, read from the page cache onto the devices
by, in each round and in this order:

  - treecli:            treecli.load("m.safetensors", like=abstract)
  - orbax:              StandardCheckpointer().restore(orbax_dir, abstract)
  - safetensors.flax:   safetensors.flax.load_file + jax.device_put(x, sharding)
  - safetensors.numpy:  safetensors.numpy.load_file + jax.device_put(x, sharding)

``abstract`` is the tree of ``ShapeDtypeStruct``s, unsharded (one device) and, where
there are several devices, sharded over all of them (rows split over a 1-d mesh). Every
result is waited for (``block_until_ready``) and dropped before the next. Medians of the
rounds, in GiB/s, with each one's ratio to Orbax measured in the same run.

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--host-devices", type=int, default=0, help="force this many CPU devices")
    parser.add_argument("--dir", default=None, help="where to write the two checkpoints (default: a temp dir)")
    args = parser.parse_args()
    if args.host_devices:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.host_devices}"
        os.environ["JAX_PLATFORMS"] = "cpu"

    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    import safetensors.flax
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
        for path in [st_path, *orbax_path.rglob("*")]:  # into the page cache
            if path.is_file():
                path.read_bytes()

        devices = jax.devices()
        layouts = {"unsharded": lambda shape: jax.sharding.SingleDeviceSharding(devices[0])}
        if len(devices) > 1:
            mesh = Mesh(np.array(devices), ("x",))
            layouts[f"sharded over {len(devices)}"] = lambda shape: NamedSharding(
                mesh, P("x") if shape[0] % len(devices) == 0 else P())

        print(f"{nbytes / 2**30:.2f} GiB in {len(shapes)} float32 leaves; devices: {len(devices)} x "
              f"{devices[0].device_kind} ({devices[0].platform}); {os.cpu_count()} CPUs; medians of {args.rounds}")
        for layout, sharding_of in layouts.items():
            shardings = {k: sharding_of(shape) for k, (shape, _) in shapes.items()}
            abstract = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[k])
                        for k, (shape, dtype) in shapes.items()}

            def put(arrays):
                return {k: jax.device_put(v, shardings[k]) for k, v in arrays.items()}

            candidates = {
                "treecli.load(like=)": lambda: treecli.load(st_path, like=abstract),
                "orbax restore": lambda: ocp.StandardCheckpointer().restore(orbax_path, abstract),
                "safetensors.flax + device_put": lambda: put(safetensors.flax.load_file(str(st_path))),
                "safetensors.numpy + device_put": lambda: put(safetensors.numpy.load_file(str(st_path))),
            }
            times: dict[str, list[float]] = {name: [] for name in candidates}
            for _ in range(args.rounds):
                for name, run in candidates.items():
                    gc.collect()
                    start = time.perf_counter()
                    result = run()
                    jax.block_until_ready(result)
                    times[name].append(time.perf_counter() - start)
                    del result
            orbax = statistics.median(times["orbax restore"])
            print(f"\n{layout}:")
            print(f"  {'':34} {'seconds':>8} {'GiB/s':>7} {'vs orbax':>9}")
            for name, ts in times.items():
                median = statistics.median(ts)
                print(f"  {name:34} {median:8.3f} {nbytes / 2**30 / median:7.2f} {orbax / median:8.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
