"""Benchmark: `treecli hash` of a --gib safetensors file (bf16 matrices) beside `b3sum` (when
installed: `apt install b3sum`) and `sha256sum` of the same file, from the page cache (one
warm-up read first), whole processes, medians of --runs in turns, with peak RSS; then
`treecli verify` of that file against a copy of it as an HF directory of shards (another
layout of the same weights) beside `treecli diff`'s equal case of the same pair; then what
an output's record costs: `convert` of the file (its digests taken as it is written) and
`average` of the file and its shards (both inputs read again to hash them), each beside the
same command with `--no-record`.

    python bench/hash.py [--gib 2] [--runs 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pytorch_gguf import timed  # noqa: E402  (one process timed, with its peak RSS)

TREECLI = [sys.executable, "-m", "treecli"]


# The file is made in a process of its own: a forked child's peak RSS counts its parent's pages.
MAKE = r"""
import sys, ml_dtypes, numpy as np
from safetensors.numpy import save_file
rng = np.random.default_rng(0)
save_file({f"model.layers.{i}.w": rng.standard_normal((4096, 4096), dtype=np.float32).astype(ml_dtypes.bfloat16)
           for i in range(int(sys.argv[2]))}, sys.argv[1])
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-hash-", dir=args.dir))
    try:
        count = max(1, round(args.gib * (1 << 30) / (4096 * 4096 * 2)))
        source = work / "model.safetensors"
        subprocess.run([sys.executable, "-c", MAKE, str(source), str(count)], check=True)
        subprocess.run(TREECLI + ["convert", str(source), str(work / "shards"), "--max-shard-size", "300MB", "-q"],
                       check=True)
        subprocess.run(["cat", str(source)], stdout=subprocess.DEVNULL, check=True)  # (into the page cache)
        commands = {"treecli hash": TREECLI + ["hash", str(source), "-q"],
                    "sha256sum": ["sha256sum", str(source)]}
        if shutil.which("b3sum"):
            commands["b3sum"] = ["b3sum", str(source)]
        commands["treecli verify (shards)"] = TREECLI + ["verify", str(work / "shards"), str(source), "-q"]
        commands["treecli diff (equal)"] = TREECLI + ["diff", str(work / "shards"), str(source), "-q"]
        for name, command in (("convert", ["convert", str(source), str(work / "out.safetensors")]),
                              ("average", ["average", str(source), str(work / "shards"), "-o",
                                           str(work / "out.safetensors")])):
            commands[f"treecli {name}"] = TREECLI + command + ["--force", "-q"]
            commands[f"treecli {name} --no-record"] = TREECLI + command + ["--force", "-q", "--no-record"]
        results: dict[str, list] = {name: [] for name in commands}
        for _ in range(args.runs):  # (in turns: the VM's noise falls on all alike)
            for name, command in commands.items():
                results[name].append(timed(command))
        size = source.stat().st_size
        print(f"{size / (1 << 30):.2f} GiB of bf16, from the page cache, medians of {args.runs} runs in turns")
        base = statistics.median(s for s, _ in results["treecli hash"])
        print(f"{'':26} {'seconds':>8} {'GiB/s':>7} {'x treecli hash':>15} {'peak RSS':>10}")
        for name, runs in results.items():
            seconds = statistics.median(s for s, _ in runs)
            print(f"{name:26} {seconds:8.2f} {size / (1 << 30) / seconds:7.2f} {seconds / base:14.2f}x "
                  f"{max(r for _, r in runs) / (1 << 20):8.0f} MiB")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
