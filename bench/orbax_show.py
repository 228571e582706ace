"""Benchmark: `treecli show` on synthetic ~1 GB and ~8 GB Orbax checkpoints, against
Orbax's own cheapest metadata call and a full restore, in the same run.

    python bench/orbax_show.py [--gib 1,8] [--runs 5]

All three are timed as whole processes (imports included), median of --runs
(one run for the full restore). The checkpoints hold zeros, which Orbax
compresses to almost nothing on disk: the logical size is what matters to
metadata reads, and the restore still decompresses every byte.
Target (issue 3): show's time independent of size and <= 1.2x the metadata call.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAKE = r'''
import sys
import numpy as np
import orbax.checkpoint as ocp
path, gib = sys.argv[1], float(sys.argv[2])
n = max(1, int(gib * 16))  # 64 MiB float32 leaves
tree = {"params": {f"layer_{i}": {"kernel": np.zeros((4096, 4096), np.float32)} for i in range(n)},
        "step": np.asarray(1000, np.int64)}
with ocp.StandardCheckpointer() as c:
    c.save(path, tree)
'''
METADATA = "import sys, orbax.checkpoint as ocp; ocp.StandardCheckpointer().metadata(sys.argv[1])"
RESTORE = "import sys, orbax.checkpoint as ocp; ocp.StandardCheckpointer().restore(sys.argv[1])"


def timed(cmd: list[str], runs: int) -> float:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", default="1,8")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(__file__).parents[1] / "treecli")], check=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
        for gib in (float(g) for g in args.gib.split(",")):
            path = str(Path(tmp) / f"ckpt_{gib:g}gib")
            subprocess.run([sys.executable, "-c", MAKE, path, str(gib)], check=True)
            ours = timed([sys.executable, "-m", "treecli", "show", path], args.runs)
            metadata = timed([sys.executable, "-c", METADATA, path], args.runs)
            restore = timed([sys.executable, "-c", RESTORE, path], 1)
            rows.append((gib, ours, metadata, restore))
    print(f"{'logical size':>12} {'treecli show':>13} {'orbax metadata':>15} {'full restore':>13} {'ratio':>6}")
    for gib, ours, metadata, restore in rows:
        print(f"{gib:>10g}GiB {ours:>12.2f}s {metadata:>14.2f}s {restore:>12.2f}s {ours / metadata:>6.2f}")
    if len(rows) > 1:
        print(f"size independence: {rows[-1][1] / rows[0][1]:.2f} (largest / smallest show time)")


if __name__ == "__main__":
    main()
