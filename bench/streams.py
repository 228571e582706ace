"""Benchmark: the byte-stream jobs of issue 19 on a 1 GiB fp32 safetensors file, each
beside a fair reference measured in the same interleaved run:

  diff, equal files        per leaf, 4 MiB preadv into two reused buffers, the bytes
  diff, different files    compared as 64-bit words, float64 max abs/rel only where
                           the bytes differ (every chunk, in the different pair);
  convert st -> npz        read + write + fsync, write-back started every 32 MiB (as
                           treecli's writer does); treecli verified and --no-verify;
  edit --cast bfloat16     the same stream with a NumPy cast of each chunk;
  convert Orbax -> st      the same 32 leaves saved by Orbax's StandardCheckpointer: each
                           array read whole through TensorStore, written and fsynced
                           as above; treecli verified and --no-verify. orbax-chunked:
                           the same, saved in 4 MiB chunks (chunk_byte_size).

    python bench/streams.py [--runs 5] [--gib 1] [--jobs diff-equal,diff-different,convert,cast,orbax,orbax-chunked]
                            [--before CHECKOUT]

--before CHECKOUT also runs each treecli job with another checkout of treecli (a git
worktree of the commit before a change: ``git worktree add /tmp/before HEAD~1``), in
turns with this one, and prints this one's time over that one's.

Wall time is the median of --runs, taken in turns (treecli, reference, treecli, ...), with
the largest peak RSS of each;
the load average and how full the page cache was are printed with the results.
Page cache warm for inputs; outputs are deleted and synced between runs.
Targets (issue 19): diff <= 1.2x its reference; verified convert <= 1.5x the floor;
--cast <= 1.1x the streaming cast; Orbax -> safetensors <= 1.2x TensorStore + write.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MAKE = r'''
import sys
import numpy as np
from safetensors.numpy import save_file
directory, gib = sys.argv[1], float(sys.argv[2])
rows = int(gib * 2**30) // 32 // 4 // 4096  # 32 leaves [rows, 4096] fp32
rng = np.random.default_rng(0)
a = {f"layers.{k}.w": rng.standard_normal((rows, 4096), dtype=np.float32) for k in range(32)}
save_file(a, f"{directory}/a.safetensors")
save_file(a, f"{directory}/same.safetensors")
save_file({k: v + np.float32(1e-3) for k, v in a.items()}, f"{directory}/other.safetensors")
import orbax.checkpoint as ocp
checkpointer = ocp.StandardCheckpointer()
checkpointer.save(f"{directory}/orbax", {k.replace(".", "_"): v for k, v in a.items()})
checkpointer.wait_until_finished()
checkpointer.close()
# The same arrays in chunks of 4 MiB (as a pod's shards or chunk_byte_size store them)
ocp.PyTreeCheckpointer().save(f"{directory}/orbax_chunked", {k.replace(".", "_"): v for k, v in a.items()},
                              save_args={k.replace(".", "_"): ocp.SaveArgs(chunk_byte_size=4 << 20) for k in a})
'''

CHILD = r'''
import json, os, struct, sys, time
start = time.perf_counter()
job, tool, out, *inputs = sys.argv[1:]


def written_back(f, window):
    """After each write: every 32 MiB, start write-back as treecli's writer does (``window``:
    [start of the last window hinted, its end])."""
    end = f.tell()
    if end - window[1] >= 32 << 20:
        f.flush()
        os.posix_fadvise(f.fileno(), window[0], end - window[0], os.POSIX_FADV_DONTNEED)
        window[:] = [window[1], end]


if tool == "treecli":
    from treecli.cli import main
    if job.startswith("diff"):
        code = main(["diff", *inputs])
        assert code == (0 if job == "diff-equal" else 1), code
    elif job == "convert":
        assert main(["convert", inputs[0], out, "--quiet"]) == 0
    elif job == "convert-noverify":
        assert main(["convert", inputs[0], out, "--no-verify", "--quiet"]) == 0
    elif job == "cast":
        assert main(["edit", inputs[0], "-o", out, "--cast", "**=bfloat16", "--quiet"]) == 0
    elif job == "orbax":
        assert main(["convert", inputs[0], out, "--quiet"]) == 0
    elif job == "orbax-noverify":
        assert main(["convert", inputs[0], out, "--no-verify", "--quiet"]) == 0
elif job == "orbax":  # TensorStore reads each array whole; the bytes are streamed out and fsynced
    import numpy as np
    from treecli.formats import open_checkpoint
    from treecli import _tree
    with open_checkpoint(inputs[0]) as ckpt:  # only for the arrays' TensorStore specs
        stores = [leaf._store for _, leaf in _tree.flatten(ckpt.tree)]
        with open(out, "wb") as f:
            f.write(b"\0" * 4096)
            window = [0, 0]
            for store in stores:
                data = store.read().result().reshape(-1).view(np.uint8)
                for off in range(0, data.size, 4 << 20):
                    f.write(data[off : off + (4 << 20)])
                    written_back(f, window)
            f.flush()
            os.fsync(f.fileno())
else:
    import numpy as np
    import ml_dtypes

    def header(path):
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            h = json.loads(f.read(n))
        h.pop("__metadata__", None)
        return 8 + n, h

    chunk = 4 << 20
    if job.startswith("diff"):
        (base_a, ha), (base_b, hb) = header(inputs[0]), header(inputs[1])
        fa, fb = os.open(inputs[0], os.O_RDONLY), os.open(inputs[1], os.O_RDONLY)
        ba, bb = np.empty(chunk, np.uint8), np.empty(chunk, np.uint8)
        changed = 0
        for name, info in ha.items():
            lo, hi = info["data_offsets"]
            worst_abs = worst_rel = 0.0
            for off in range(lo, hi, chunk):
                n = min(chunk, hi - off)
                os.preadv(fa, [ba[:n]], base_a + off)
                os.preadv(fb, [bb[:n]], base_b + hb[name]["data_offsets"][0] + off - lo)
                if np.array_equal(ba[:n].view(np.uint64), bb[:n].view(np.uint64)):
                    continue
                x, y = ba[:n].view(np.float32).astype(np.float64), bb[:n].view(np.float32).astype(np.float64)
                delta = np.abs(x - y)
                worst_abs = max(worst_abs, float(delta.max()))
                with np.errstate(divide="ignore", invalid="ignore"):
                    worst_rel = max(worst_rel, float(np.nanmax(np.where(delta == 0, 0.0, delta / np.abs(y)))))
            changed += worst_abs > 0
        print(changed, file=sys.stderr)
    else:  # a streamed copy (or cast), written back every 32 MiB and fsynced: the floor
        base, h = header(inputs[0])
        fd = os.open(inputs[0], os.O_RDONLY)
        buf = np.empty(chunk, np.uint8)
        cast = np.empty(chunk // 2, np.uint8)
        with open(out, "wb") as f:
            f.write(b"\0" * 4096)  # a header's worth
            window = [0, 0]
            for name, info in h.items():
                lo, hi = info["data_offsets"]
                for off in range(lo, hi, chunk):
                    n = min(chunk, hi - off)
                    os.preadv(fd, [buf[:n]], base + off)
                    if job == "cast":
                        data = cast[: n // 2].view(ml_dtypes.bfloat16)
                        np.copyto(data, buf[:n].view(np.float32), casting="unsafe")
                        f.write(data.view(np.uint8))
                    else:
                        f.write(buf[:n])
                    written_back(f, window)
            f.flush()
            os.fsync(f.fileno())
elapsed = time.perf_counter() - start
import resource
print(json.dumps({"seconds": elapsed, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
'''

JOBS = {  # job: (the treecli runs, the reference, the inputs)
    "diff-equal": (["diff-equal"], "diff-equal", ["a", "same"]),
    "diff-different": (["diff-different"], "diff-different", ["a", "other"]),
    "convert": (["convert", "convert-noverify"], "convert", ["a"]),
    "cast": (["cast"], "cast", ["a"]),
    "orbax": (["orbax", "orbax-noverify"], "orbax", ["orbax"]),
    "orbax-chunked": (["orbax", "orbax-noverify"], "orbax", ["orbax_chunked"]),
}


def run(job: str, tool: str, out: Path, inputs: list[Path], checkout: str | None = None) -> tuple[float, int]:
    """Seconds and peak RSS (MB) of one run, in a child process (importing treecli from
    ``checkout`` when given; from the output's directory, so that the working directory
    never shadows it)."""
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    os.sync()  # else the previous run's dirty pages throttle this run's writes
    env = {**os.environ, "PYTHONPATH": checkout} if checkout else None
    result = subprocess.run([sys.executable, "-c", CHILD, job, tool, str(out), *map(str, inputs)],
                            capture_output=True, text=True, env=env, cwd=out.parent)
    if result.returncode:
        sys.exit(f"{tool} {job} failed:\n{result.stderr[-3000:]}")
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    return measured["seconds"], measured["peak_mb"]


def cache_state() -> str:
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    kib = {k: int(v.split()[0]) for k, v in info.items() if v.strip().endswith("kB")}
    return (f"page cache {kib['Cached'] / 2**20:.1f} GiB of {kib['MemTotal'] / 2**20:.1f} GiB, "
            f"{kib['MemAvailable'] / 2**20:.1f} GiB available; load average {os.getloadavg()[0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--jobs", default=",".join(JOBS))
    parser.add_argument("--before", help="another checkout of treecli to run in turns with this one")
    args = parser.parse_args()
    before = str(Path(args.before).resolve()) if args.before else None
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
        tmp = Path(tmp)
        subprocess.run([sys.executable, "-c", MAKE, str(tmp), str(args.gib)], check=True)
        warm = [tmp / f"{name}.safetensors" for name in ("a", "same", "other")]
        warm += [p for name in ("orbax", "orbax_chunked") for p in (tmp / name).rglob("*") if p.is_file()]
        for path in warm:  # warm the page cache from another process
            subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
        print(f"{(tmp / 'a.safetensors').stat().st_size / 2**30:.2f} GiB fp32; before: {cache_state()}")
        print(f"{'job':<34} {'treecli':>9} {'reference':>10} {'ratio':>7}")
        for job in args.jobs.split(","):
            ours_jobs, reference_job, names = JOBS[job]
            inputs = [tmp / (n if n.startswith("orbax") else f"{n}.safetensors") for n in names]
            times: dict[str, list[float]] = {j: [] for j in [*ours_jobs, *(f"before:{o}" for o in ours_jobs),
                                                             "reference"]}
            peaks: dict[str, list[int]] = {j: [] for j in times}
            suffix = ".npz" if job == "convert" else ".safetensors"
            for _ in range(args.runs):  # interleaved: ours, (before,) the reference, ours, ...
                for ours in ours_jobs:
                    for label, checkout in [(ours, None)] + ([(f"before:{ours}", before)] if before else []):
                        seconds, peak = run(ours, "treecli", tmp / f"out{suffix}", inputs, checkout)
                        times[label].append(seconds)
                        peaks[label].append(peak)
                seconds, peak = run(reference_job, "reference", tmp / f"ref{suffix}", inputs)
                times["reference"].append(seconds)
                peaks["reference"].append(peak)
            reference = statistics.median(times["reference"])
            for ours in ours_jobs:
                median = statistics.median(times[ours])
                spread = f"{min(times[ours]):.2f}-{max(times[ours]):.2f}"
                label = f"{ours} (chunked)" if job == "orbax-chunked" else ours
                line = (f"{label:<34} {median:>8.2f}s {reference:>9.2f}s {median / reference:>6.2f}x   "
                        f"(treecli {spread} s, {max(peaks[ours])} MB; reference {min(times['reference']):.2f}-"
                        f"{max(times['reference']):.2f} s, {max(peaks['reference'])} MB)")
                if before:
                    earlier = statistics.median(times[f"before:{ours}"])
                    line += (f"   before {earlier:.2f}s ({min(times[f'before:{ours}']):.2f}-"
                             f"{max(times[f'before:{ours}']):.2f}, {max(peaks[f'before:{ours}'])} MB): "
                             f"{median / earlier:.2f}x")
                print(line)
        print(f"after: {cache_state()}")


if __name__ == "__main__":
    main()
