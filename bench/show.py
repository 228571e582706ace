"""Benchmark: `treecli show` on a 70B-parameter bf16 checkpoint (8 sparse shards)
and on a 1 GB one, against a reference measured in the same run: a minimal Typer
app that parses the same headers with `json` and prints the rows with Rich.

    python bench/show.py [--runs 7]

Both are timed as whole processes (imports included), output to a pipe, median
of --runs runs; treecli is byte-compiled first, as an installed package is.
Targets (issue 2): show <= 1.3x the reference, <= 0.25 s, same for both sizes (+-10 %).

Then a 200k-tensor header (issue 8, case 30a: < 2 s, peak RSS < 300 MB) and a
DeepSeek-V3-shaped repository (163 shards, 93,757 tensors, an 8 MB index; issue 19:
each under 1 s), against the floor of any Python tool: `json.loads` of the headers
(and index) and one f-string print per tensor (Rich's table would take minutes on
200k rows); the 200k header also on a terminal (`script`), where identical layers fold.
With --ckptkit, `ckptkit info` of the same 200k header (issue 19: treecli must be faster),
from a venv of its own:
    python -m venv /tmp/ck && /tmp/ck/bin/pip install 'ckptkit[cli]'
    python bench/show.py --ckptkit /tmp/ck/bin/ckptkit
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _synth import llama_tensors, moe_tensors, write_sharded, write_sparse_safetensors  # noqa: E402

REFERENCE_APP = r'''
import json, struct, sys
from pathlib import Path
import typer
from rich.console import Console
from rich.table import Table

def main(path: Path):
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    table = Table()
    for c in ("name", "shape", "dtype"):
        table.add_column(c)
    for f in files:
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        for name, info in header.items():
            table.add_row(name, str(info["shape"]), info["dtype"])
    Console().print(table)

typer.run(main)
'''


FLOOR_APP = r'''
import json, struct, sys
from pathlib import Path
path = Path(sys.argv[1])
if path.is_dir():
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = [path / name for name in dict.fromkeys(index["weight_map"].values())]
else:
    files = [path]
for file in files:
    with open(file, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    header.pop("__metadata__", None)
    sys.stdout.writelines(f"{name}  {info['shape']}  {info['dtype']}\n" for name, info in header.items())
'''

PEAK_RSS = r'''
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)
'''


def peak_rss_mb(cmd: list[str]) -> int:
    return int(subprocess.run([sys.executable, "-c", PEAK_RSS, *cmd], check=True, capture_output=True,
                              text=True).stdout)


def timed(cmd: list[str], runs: int) -> float:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--ckptkit", default=shutil.which("ckptkit"), help="ckptkit to run on the 200k header")
    args = parser.parse_args()
    # As an installed package would be (and whatever PYTHONDONTWRITEBYTECODE says).
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(__file__).parents[1] / "treecli")], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        big = tmp / "llama70b"
        write_sharded(big, llama_tensors(80, 8192, 28672, 128256, 1024), shards=8)
        small = tmp / "small.safetensors"
        write_sparse_safetensors(small, llama_tensors(30, 1024, 4096, 32000, 256))
        ref = tmp / "ref.py"
        ref.write_text(REFERENCE_APP)
        treecli = [sys.executable, "-m", "treecli", "show"]
        rows = []
        for label, target in (("70B bf16, 8 shards", big), ("1 GB", small)):
            size = sum(p.stat().st_size for p in ([target] if target.is_file() else target.iterdir()))
            ours = timed(treecli + [str(target)], args.runs)
            theirs = timed([sys.executable, str(ref), str(target)], args.runs)
            rows.append((label, size, ours, theirs))
        print(f"{'checkpoint':<20} {'size':>10} {'treecli show':>13} {'reference':>10} {'ratio':>6}")
        for label, size, ours, theirs in rows:
            print(f"{label:<20} {size / 1e9:>8.1f}GB {ours:>12.3f}s {theirs:>9.3f}s {ours / theirs:>6.2f}")
        print(f"size independence: {rows[0][2] / rows[1][2]:.2f} (70B time / 1 GB time)")

        moe = tmp / "moe200k.safetensors"
        write_sparse_safetensors(moe, moe_tensors())
        deepseek = tmp / "deepseek"
        write_sharded(deepseek, moe_tensors(layers=61, experts=256), shards=163)
        floor = tmp / "floor.py"
        floor.write_text(FLOOR_APP)
        runs = max(3, args.runs // 2)
        for label, target in ((f"{len(moe_tensors())} tensors, one file", moe),
                              (f"{len(moe_tensors(61, 256))} tensors, 163 shards", deepseek)):
            ours = timed(treecli + [str(target)], runs)
            theirs = timed([sys.executable, str(floor), str(target)], runs)
            print(f"\n{label}: treecli show {ours:.2f} s, {peak_rss_mb(treecli + [str(target)])} MB peak RSS; "
                  f"floor (json + print) {theirs:.2f} s, {peak_rss_mb([sys.executable, str(floor), str(target)])} MB")
        if shutil.which("script"):  # a terminal: identical layers fold into one row each
            command = " ".join([sys.executable, "-m", "treecli", "show", str(moe)])
            on_terminal = timed(["script", "-q", "-c", command, "/dev/null"], runs)
            print(f"the one file on a terminal (script): treecli show {on_terminal:.2f} s")
        if args.ckptkit:  # in turns with treecli's, so that drift falls on both
            pairs = [(timed(treecli + [str(moe)], 1), timed([args.ckptkit, "info", str(moe)], 1)) for _ in range(runs)]
            ours, theirs = (statistics.median(p[j] for p in pairs) for j in (0, 1))
            print(f"the one file, in turns with `ckptkit info`: treecli show {ours:.2f} s, ckptkit {theirs:.2f} s "
                  f"({theirs / ours:.2f}x treecli's time)")
        else:
            print("ckptkit: not found; give --ckptkit PATH/ckptkit to include it (see --help)")


if __name__ == "__main__":
    main()
