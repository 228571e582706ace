"""Benchmark: `average` of 3 x 1 GiB on 1, 2 and 4 processes of one run (issue 33).

Each run launches ``treecli --coordinator 127.0.0.1:PORT --num-processes N
--process-id I average ...`` N times on this machine, JAX's distributed runtime
carrying their messages, and reports the wall time of the run (launch to the last
exit) beside the single-process command, each process's bytes read from the inputs
(counted at treecli's own reader) and that the outputs are byte-identical, and the
same run's fixed cost: an ``average`` of three 4-byte files (starting Python, JAX and
the runtime, then leaving it together). Interleaved rounds, medians.

    python bench/distributed.py [--gib 1] [--rounds 3] [--processes 1,2,4] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# One process of a run: treecli's CLI, then the bytes its reader read, on stderr's last line.
CHILD = r"""
import sys
from treecli._bytes import local
read = [0]
view = local.FileReader.read_view
def counted(self, buffer, offset):
    view(self, buffer, offset)
    read[0] += len(memoryview(buffer))
local.FileReader.read_view = counted
from treecli.cli import main
code = main(sys.argv[1:])
sys.stderr.write(f"BYTES_READ {read[0]}\n")
sys.exit(code)
"""
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(count: int, args: list[str]) -> tuple[float, list[int]]:
    """Wall seconds of the run, and each process's bytes read."""
    root = str(Path(__file__).resolve().parent.parent)
    port = free_port()
    prefix = [] if count == 1 else ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(count)]
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, *prefix, *(["--process-id", str(i)] if prefix else []),
                               *args], cwd=root, env=ENV, stderr=subprocess.PIPE, text=True) for i in range(count)]
    errors = [p.communicate()[1] for p in procs]
    seconds = time.perf_counter() - start
    if any(p.returncode for p in procs):
        raise SystemExit("a run failed:\n" + "\n".join(errors))
    return seconds, [int(e.strip().splitlines()[-1].split()[1]) for e in errors]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    counts = [int(c) for c in args.processes.split(",")]

    import numpy as np
    from safetensors.numpy import save_file

    work = Path(tempfile.mkdtemp(prefix="treecli-dist-", dir=args.dir))
    try:
        rows = max(1, int(args.gib * 2**30) // (32 << 20))
        inputs = []
        for seed in range(3):
            rng = np.random.default_rng(seed)
            tree = {f"layer{i}": rng.standard_normal((2048, 4096), dtype=np.float32) for i in range(rows)}
            path = work / f"m{seed}.safetensors"
            save_file(tree, str(path))
            inputs.append(str(path))
            del tree
        tiny = []
        for seed in range(3):
            save_file({"x": np.full(1, seed, np.float32)}, str(work / f"tiny{seed}.safetensors"))
            tiny.append(str(work / f"tiny{seed}.safetensors"))
        total = sum(os.path.getsize(p) for p in inputs)
        times: dict[int, list[float]] = {c: [] for c in counts}
        fixed: dict[int, list[float]] = {c: [] for c in counts}
        reads: dict[int, list[int]] = {}
        digests: dict[int, str] = {}
        for _ in range(args.rounds):
            for count in counts:
                out = work / f"avg{count}.safetensors"
                seconds, read = run(count, ["average", *inputs, "--weights", "1,2,3", "-o", str(out), "--force"])
                times[count].append(seconds)
                reads[count] = read
                digests[count] = hashlib.sha256(out.read_bytes()).hexdigest()
                out.unlink()
                fixed[count].append(run(count, ["average", *tiny, "-o", str(out), "--force"])[0])
                out.unlink()
        print(f"average of 3 x {total / 3 / 2**30:.2f} GiB fp32; {os.cpu_count()} CPUs; medians of {args.rounds}")
        print(f"{'processes':>9} {'seconds':>8} {'vs 1':>6} {'fixed':>6}  bytes read by each process "
              f"(of {total / 2**30:.2f} GiB)")
        one = statistics.median(times[counts[0]])
        for count in counts:
            median = statistics.median(times[count])
            shares = ", ".join(f"{r / 2**30:.3f} GiB ({r / total:.0%})" for r in reads[count])
            print(f"{count:>9} {median:8.2f} {one / median:5.2f}x {statistics.median(fixed[count]):6.2f}  {shares}")
        print("outputs byte-identical:", len(set(digests.values())) == 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
