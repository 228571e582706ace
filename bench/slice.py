"""Benchmark: `treecli slice --index 0` on a 1 GB stacked checkpoint [8, ...],
against reading the full file with `safetensors.numpy.load_file`, indexing and
saving, in the same run.

    python bench/slice.py [--runs 3] [--gib 1]

Reports wall time (median), peak RSS (ru_maxrss of the child) and bytes read
(rchar from /proc/self/io). Page cache warm for both.
Targets (issue 4): time <= 0.25x the full read; peak RSS <= output size + 150 MB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r'''
import json, resource, sys, time
start = time.perf_counter()
mode, src, dst = sys.argv[1:4]
if mode == "treecli":
    from treecli.cli import main
    assert main(["slice", src, "--index", "0", "-o", dst, "--quiet"]) == 0
else:
    from safetensors.numpy import load_file, save_file
    import numpy as np
    tensors = load_file(src)
    save_file({k: np.ascontiguousarray(v[0]) for k, v in tensors.items()}, dst)
elapsed = time.perf_counter() - start
io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
print(json.dumps({"seconds": elapsed, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "read_mb": int(io["rchar"]) / 2**20}))
'''


MAKE_STACK = r'''
import sys
import numpy as np
from safetensors.numpy import save_file
path, gib = sys.argv[1], float(sys.argv[2])
rng = np.random.default_rng(0)
rows = int(gib * 2**30) // 16 // 4 // 8 // 1024  # 16 leaves [8, rows, 1024] float32
save_file({f"layers.{i}.w": rng.standard_normal((8, rows, 1024), dtype=np.float32) for i in range(16)}, path)
'''


def make_stack(path: Path, gib: float) -> None:
    # In a child process: this one must stay small (see the page-cache note below).
    subprocess.run([sys.executable, "-c", MAKE_STACK, str(path), str(gib)], check=True)


def run(mode: str, src: Path, dst: Path) -> dict:
    if dst.exists():
        dst.unlink()
    result = subprocess.run([sys.executable, "-c", CHILD, mode, str(src), str(dst)], capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"{mode} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--gib", type=float, default=1.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
        tmp = Path(tmp)
        src = tmp / "stack.safetensors"
        make_stack(src, args.gib)
        # Warm the page cache from another process: Linux keeps ru_maxrss across exec,
        # so reading it here would show up in every child's peak RSS.
        subprocess.run(["cat", str(src)], stdout=subprocess.DEVNULL, check=True)
        results = {}
        for mode in ("treecli", "load_file"):
            runs = [run(mode, src, tmp / f"{mode}.safetensors") for _ in range(args.runs)]
            results[mode] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        out_mb = (tmp / "treecli.safetensors").stat().st_size / 2**20
        print(f"input {src.stat().st_size / 2**30:.2f} GiB, output {out_mb:.0f} MiB, median of {args.runs}")
        print(f"{'':<10} {'wall':>8} {'peak RSS':>10} {'read':>10}")
        for mode, r in results.items():
            print(f"{mode:<10} {r['seconds']:>7.3f}s {r['rss_mb']:>8.0f}MB {r['read_mb']:>8.0f}MB")
        t, ref = results["treecli"], results["load_file"]
        print(f"time ratio {t['seconds'] / ref['seconds']:.2f} (target <= 0.25); "
              f"RSS - output = {t['rss_mb'] - out_mb:.0f} MB (target <= 150)")


if __name__ == "__main__":
    main()
