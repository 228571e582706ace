"""Benchmark: `treecli average` of three ~1 GB checkpoints (fp32, then bf16),
against references measured in the same run:

  (a) tutorial: load every file (safetensors.numpy.load_file), jax.tree_util.tree_map
      a weighted sum, save;
  (b) streaming: a NumPy loop written here — per leaf, 256 KiB chunks pread into
      reused buffers, fp32 accumulator, written to the output as it goes; also
      "streaming+fsync", the same plus the fsync that treecli always does;
  (c) mergekit's linear merge (`mergekit-pytorch`, which takes plain safetensors
      files), when it is on PATH or given with --mergekit. It needs torch; a venv
      of its own keeps that out of treecli's:
        python -m venv /tmp/mk && /tmp/mk/bin/pip install torch mergekit   # measured: torch 2.13 CPU, mergekit 0.1.5
        python bench/average.py --mergekit /tmp/mk/bin/mergekit-pytorch

    python bench/average.py [--runs 3] [--gib 1] [--skip-tutorial] [--mergekit PATH]

Wall time is the median of --runs; peak RSS is the child's ru_maxrss (for mergekit,
that of the process it starts), as /usr/bin/time -v reports it. Page cache warm for all.
Beside each, the largest error of its output in units in the last place of the output's
dtype, against the weighted mean computed in float64 (the accuracy oracle: 0.5 ulp, a
correctly rounded result).
Targets (issue 5): wall <= 1.25x (b); peak RSS <= 200 MB and flat when the model doubles.
Issue 19: fp32 average <= 1.1x streaming+fsync, still within 0.5 ulp.
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
import ml_dtypes, numpy as np
from safetensors.numpy import save_file
directory, gib, dtype = sys.argv[1], float(sys.argv[2]), sys.argv[3]
np_dtype = np.float32 if dtype == "fp32" else ml_dtypes.bfloat16
itemsize = 4 if dtype == "fp32" else 2
rows = int(gib * 2**30) // 32 // itemsize // 4096  # 32 leaves [rows, 4096]
for i in range(3):
    rng = np.random.default_rng(i)
    save_file({f"layers.{k}.w": rng.standard_normal((rows, 4096), dtype=np.float32).astype(np_dtype)
               for k in range(32)}, f"{directory}/in{i}.safetensors")
'''

CHILD = r'''
import json, resource, sys, time
start = time.perf_counter()
mode, out, *inputs = sys.argv[1:]
weights = [1.0, 2.0, 3.0]
if mode == "treecli":
    from treecli.cli import main
    assert main(["average", *inputs, "--weights", "1,2,3", "-o", out, "--quiet"]) == 0
elif mode == "tutorial":
    import jax, numpy as np
    from safetensors.numpy import load_file, save_file
    trees = [load_file(p) for p in inputs]
    total = sum(weights)
    soup = jax.tree_util.tree_map(lambda *xs: sum(w / total * x.astype(np.float32) for w, x in zip(weights, xs))
                                  .astype(xs[0].dtype), *trees)
    save_file({k: np.asarray(v) for k, v in soup.items()}, out)
elif mode in ("streaming", "streaming+fsync"):
    import json as j, os, struct
    import ml_dtypes, numpy as np
    names = {"F32": np.float32, "BF16": ml_dtypes.bfloat16}
    fds = [os.open(p, os.O_RDONLY) for p in inputs]
    headers = []
    for p in inputs:
        with open(p, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            headers.append((8 + n, j.loads(f.read(n))))
    start0, header = headers[0]
    header.pop("__metadata__", None)
    blob = open(inputs[0], "rb").read(start0)  # same layout: reuse the first header
    w = [x / sum(weights) for x in weights]
    chunk = 256 * 1024
    with open(out, "wb") as f:
        f.write(blob)
        for name, info in header.items():
            dtype = np.dtype(names[info["dtype"]])
            n_el = (info["data_offsets"][1] - info["data_offsets"][0]) // dtype.itemsize
            per = chunk // dtype.itemsize
            raw, tmp, acc = np.empty(per, dtype), np.empty(per, np.float32), np.empty(per, np.float32)
            outbuf = np.empty(per, dtype)
            for s in range(0, n_el, per):
                e = min(n_el, s + per)
                m = e - s
                for i, (fd, (base, h)) in enumerate(zip(fds, headers)):
                    off = base + h[name]["data_offsets"][0] + s * dtype.itemsize
                    os.preadv(fd, [memoryview(raw[:m].view(np.uint8))], off)
                    if i == 0:
                        np.multiply(raw[:m], np.float32(w[i]), out=acc[:m], casting="unsafe") if dtype == np.float32 else np.multiply(raw[:m].astype(np.float32), np.float32(w[i]), out=acc[:m])
                    else:
                        np.copyto(tmp[:m], raw[:m], casting="unsafe")
                        tmp[:m] *= np.float32(w[i])
                        acc[:m] += tmp[:m]
                outbuf[:m] = acc[:m]
                f.write(outbuf[:m].view(np.uint8))
        if mode == "streaming+fsync":  # the durability treecli always pays
            f.flush()
            os.fsync(f.fileno())
elif mode == "mergekit":
    import os, subprocess
    config = {"merge_method": "linear", "dtype": "float32", "out_dtype": os.environ["BENCH_DTYPE"],
              "models": [{"model": p, "parameters": {"weight": w}} for p, w in zip(inputs, weights)]}
    open(out + ".yml", "w").write(json.dumps(config))  # JSON is YAML
    subprocess.run([os.environ["BENCH_MERGEKIT"], out + ".yml", out, "--quiet", "--lazy-unpickle",
                    "--no-copy-tokenizer", "--no-write-model-card"], check=True)
elapsed = time.perf_counter() - start
rss = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
print(json.dumps({"seconds": elapsed, "rss_mb": rss / 1024}))
'''


# The largest error of an output in ulps of its dtype, a leaf at a time.
ACCURACY = r'''
import contextlib, sys
import ml_dtypes  # noqa: F401  (bfloat16 outputs)
import numpy as np
from safetensors import safe_open
out, *inputs = sys.argv[1:]
weights = [1.0, 2.0, 3.0]
worst = 0.0
with contextlib.ExitStack() as stack:
    result = stack.enter_context(safe_open(out, "numpy"))
    sources = [stack.enter_context(safe_open(p, "numpy")) for p in inputs]
    for key in result.keys():
        got = result.get_tensor(key)
        mantissa_bits = {4: 23, 2: 7}[got.dtype.itemsize]  # float32, bfloat16
        reference = sum(w * s.get_tensor(key).astype(np.float64) for w, s in zip(weights, sources)) / sum(weights)
        ulp = np.ldexp(1.0, np.frexp(reference)[1] - 1 - mantissa_bits)
        worst = max(worst, float(np.max(np.abs(got.astype(np.float64) - reference) / ulp)))
print(worst)
'''


def max_ulp_error(out: Path, inputs: list[Path]) -> float:
    result = subprocess.run([sys.executable, "-c", ACCURACY, str(out), *map(str, inputs)], capture_output=True,
                            text=True)
    if result.returncode:
        sys.exit(f"measuring the error of {out.name} failed:\n{result.stderr[-3000:]}")
    return float(result.stdout)


def run(mode: str, out: Path, inputs: list[Path], env: dict[str, str]) -> dict:
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    os.sync()  # else the previous run's dirty pages throttle this run's writes
    result = subprocess.run([sys.executable, "-c", CHILD, mode, str(out), *map(str, inputs)],
                            capture_output=True, text=True, env={**os.environ, **env})
    if result.returncode:
        sys.exit(f"{mode} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--skip-tutorial", action="store_true")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--mergekit", default=shutil.which("mergekit-pytorch"), help="mergekit-pytorch to run")
    args = parser.parse_args()
    modes = ["streaming", "streaming+fsync", "treecli"] + ([] if args.skip_tutorial else ["tutorial"])
    if args.mergekit:
        modes.append("mergekit")
    for dtype in args.dtypes.split(","):
        with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
            tmp = Path(tmp)
            subprocess.run([sys.executable, "-c", MAKE, str(tmp), str(args.gib), dtype], check=True)
            inputs = [tmp / f"in{i}.safetensors" for i in range(3)]
            for p in inputs:  # warm the page cache from another process (ru_maxrss survives exec)
                subprocess.run(["cat", str(p)], stdout=subprocess.DEVNULL, check=True)
            results = {}
            env = {"BENCH_DTYPE": {"fp32": "float32", "bf16": "bfloat16"}[dtype], "BENCH_MERGEKIT": args.mergekit or ""}
            for mode in modes:
                runs = [run(mode, tmp / f"out-{mode}.safetensors", inputs, env)
                        for _ in range(1 if mode in ("tutorial", "mergekit") else args.runs)]
                results[mode] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                results[mode]["ulp"] = max_ulp_error(tmp / f"out-{mode}.safetensors", inputs)
            size = inputs[0].stat().st_size / 2**30
            print(f"\n3 x {size:.2f} GiB {dtype}")
            print(f"{'':<16} {'wall':>8} {'peak RSS':>10} {'vs streaming':>13} {'vs +fsync':>10} {'max error':>10}")
            ref, ref_sync = results["streaming"]["seconds"], results["streaming+fsync"]["seconds"]
            for mode, r in results.items():
                print(f"{mode:<16} {r['seconds']:>7.2f}s {r['rss_mb']:>8.0f}MB {r['seconds'] / ref:>12.2f}x "
                      f"{r['seconds'] / ref_sync:>9.2f}x {r['ulp']:>7.3f} ulp")
            if "mergekit" not in results:
                print("mergekit: not found; give --mergekit PATH/mergekit-pytorch to include it (see --help)")


if __name__ == "__main__":
    main()
