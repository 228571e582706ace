"""Benchmark: `treecli merge`, each method, on three ~1 GiB fp32 fine-tunes of a ~1 GiB
base, against references measured in the same run:

  (a) `treecli average`, one streaming pass, the floor: of the three fine-tunes, and of
      the method's own inputs (the base and its models: the same bytes to read), each
      taken in turns with the method;
  (b) mergekit's same config (`mergekit-pytorch`, which takes plain safetensors files),
      from a venv of its own with a CPU torch; treecli runs that config too (merge --config):
        python -m venv /tmp/mk && /tmp/mk/bin/pip install torch==2.13.0 mergekit==0.1.5
        python bench/merge.py --mergekit /tmp/mk/bin/mergekit-pytorch
      For every method but the random ones (dare_*, della*) the largest difference
      between the two outputs is reported.

    python bench/merge.py [--runs 3] [--gib 1] [--methods ties,slerp] [--mergekit PATH] [--mergekit-runs 3]
                          [--before CHECKOUT]

--before CHECKOUT also runs each method with another checkout of treecli (a git worktree
of the commit before a change: ``git worktree add /tmp/before HEAD~1``), in turns with
this one, and prints this one's time over that one's.

Wall time is the median of --runs (mergekit's of --mergekit-runs, default 1: a run of it
takes minutes for some methods, and its times vary by a third from run to run), with
the range of the method's time over the average of its own inputs turn by turn; peak
RSS is the child's ru_maxrss (for mergekit, that of the process it starts). Page cache
warm for all.
Targets (issues 18, 35): every method >= 5x faster than mergekit's; TIES <= 3x the time of
`average` on the same inputs; peak RSS <= 200 MB and flat when the model doubles (--gib 2).
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

# Made in a child: ru_maxrss survives exec, so arrays made here would count in every command.
MAKE = r'''
import sys
import numpy as np
from safetensors.numpy import save_file
directory, gib = sys.argv[1], float(sys.argv[2])
rows = int(gib * 2**30) // 32 // 4 // 4096  # 32 leaves [rows, 4096] fp32
rng = np.random.default_rng(0)
base = {f"layers.{k}.w": rng.standard_normal((rows, 4096), dtype=np.float32) for k in range(32)}
save_file(base, f"{directory}/base.safetensors")
for i in range(3):
    rng = np.random.default_rng(i + 1)
    save_file({k: v + rng.standard_normal(v.shape, dtype=np.float32) * np.float32(0.01) for k, v in base.items()},
              f"{directory}/ft{i}.safetensors")
'''

# Each method's parameters and inputs: how many fine-tunes, and whether the base is given.
SETUPS = {
    "linear": ({}, 3, False), "task_arithmetic": ({}, 3, True), "ties": ({"density": 0.5}, 3, True),
    "dare_linear": ({"density": 0.5}, 3, True), "dare_ties": ({"density": 0.5}, 3, True),
    "breadcrumbs": ({"density": 0.5}, 3, True), "breadcrumbs_ties": ({"density": 0.5}, 3, True),
    "della": ({"density": 0.5, "epsilon": 0.1}, 3, True), "della_linear": ({"density": 0.5, "epsilon": 0.1}, 3, True),
    "slerp": ({"t": 0.3}, 1, True), "nuslerp": ({}, 2, True), "multislerp": ({}, 3, True), "karcher": ({}, 3, False),
    "model_stock": ({}, 3, True), "nearswap": ({"t": 0.001}, 1, True), "ram": ({}, 3, True),
    "ramplus_tl": ({}, 3, True), "sce": ({"select_topk": 0.5}, 3, True), "arcee_fusion": ({}, 1, True),
    "passthrough": ({}, 1, False),
}

CHILD = r'''
import json, os, resource, subprocess, sys, time
start = time.perf_counter()
tool, method, out, base, *models = sys.argv[1:]
if tool == "treecli" and method.startswith("average"):
    from treecli.cli import main
    args = ["average", *models] if method == "average" else ["average", base, *models]
    assert main(args + ["-o", out, "--quiet"]) == 0
else:
    # One mergekit config for both tools (JSON is YAML); the base, when the method takes one.
    params, _, with_base = json.loads(os.environ["BENCH_SETUPS"])[method]
    config = {"merge_method": method, "dtype": "float32", "out_dtype": "float32", "parameters": params,
              "models": [{"model": m, "parameters": {"weight": 1.0}} for m in models]}
    if with_base:
        config["base_model"] = base
    open(out + ".yml", "w").write(json.dumps(config))
    if tool == "treecli":
        from treecli.cli import main
        assert main(["merge", "--config", out + ".yml", "-o", out, "--quiet"]) == 0
    else:
        subprocess.run([os.environ["BENCH_MERGEKIT"], out + ".yml", out, "--quiet", "--lazy-unpickle",
                        "--no-copy-tokenizer", "--no-write-model-card"], check=True)
elapsed = time.perf_counter() - start
rss = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
print(json.dumps({"seconds": elapsed, "rss_mb": rss / 1024}))
'''

# The largest absolute difference between two outputs, a leaf at a time.
COMPARE = r'''
import sys
from pathlib import Path
import numpy as np
from safetensors import safe_open
def tensors(path):
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), "numpy") as handle:
            for key in handle.keys():
                yield key, f, handle
a = {k: f for k, f, _ in tensors(sys.argv[1])}
b = {k: f for k, f, _ in tensors(sys.argv[2])}
assert set(a) == set(b), (sorted(set(a) ^ set(b)))[:5]
worst, differing, total = 0.0, 0, 0
for key in a:
    with safe_open(str(a[key]), "numpy") as x, safe_open(str(b[key]), "numpy") as y:
        gap = np.abs(x.get_tensor(key).astype(np.float64) - y.get_tensor(key))
        worst, differing, total = max(worst, float(gap.max())), differing + int((gap > 1e-6).sum()), total + gap.size
print(worst, differing, total)
'''

METHODS = tuple(SETUPS)
RANDOM = ("dare_linear", "dare_ties", "della", "della_linear")  # no output to compare with mergekit's


def run(tool: str, method: str, out: Path, base: Path, models: list[Path], env: dict[str, str],
        checkout: str | None = None) -> dict:
    """One run in a child process, importing treecli from ``checkout`` when given (from the
    output's directory, so that the working directory never shadows it)."""
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    os.sync()  # else the previous run's dirty pages throttle this run's writes
    result = subprocess.run([sys.executable, "-c", CHILD, tool, method, str(out), str(base), *map(str, models)],
                            capture_output=True, text=True, cwd=out.parent,
                            env={**os.environ, **env, "BENCH_SETUPS": json.dumps(SETUPS),
                                 **({"PYTHONPATH": checkout} if checkout else {})})
    if result.returncode:
        sys.exit(f"{tool} {method} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--mergekit", default=shutil.which("mergekit-pytorch"), help="mergekit-pytorch to run")
    parser.add_argument("--mergekit-runs", type=int, default=1, help="mergekit's time is the median of these")
    parser.add_argument("--before", help="another checkout of treecli to run in turns with this one")
    args = parser.parse_args()
    before = str(Path(args.before).resolve()) if args.before else None
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
        tmp = Path(tmp)
        subprocess.run([sys.executable, "-c", MAKE, str(tmp), str(args.gib)], check=True)
        base, fts = tmp / "base.safetensors", [tmp / f"ft{i}.safetensors" for i in range(3)]
        for p in (base, *fts):  # warm the page cache from another process
            subprocess.run(["cat", str(p)], stdout=subprocess.DEVNULL, check=True)
        env = {"BENCH_MERGEKIT": args.mergekit or ""}

        def interleaved(jobs: list[tuple[str, list[Path]]]) -> tuple[list[dict], list[float]]:
            """Medians of --runs of each (method, inputs[, checkout]), taken in turns: the machine's
            drift falls on all of them alike; and, turn by turn, the last job's time over the
            second's (the method's over the average of its own inputs), to show the spread."""
            results: list[list[dict]] = [[] for _ in jobs]
            for _ in range(args.runs):
                for got, (method, models, *checkout) in zip(results, jobs):
                    got.append(run("treecli", method, tmp / f"treecli-{method}.safetensors", base, models, env,
                                   *checkout))
            turns = [ours["seconds"] / own["seconds"] for own, ours in zip(results[1], results[-1])]
            return [{k: statistics.median(r[k] for r in got) for k in got[0]} for got in results], turns

        print(f"base + 3 fine-tunes, {base.stat().st_size / 2**30:.2f} GiB each, fp32")
        print("vs average: of the 3 fine-tunes / of the method's own inputs (the base and its models)")
        print(f"{'':<24} {'wall':>8} {'peak RSS':>10} {'vs average':>15}")
        for method in args.methods.split(","):
            models = fts[: SETUPS[method][1]]
            # "average" of the inputs: the base is passed to the child as the first of them
            earlier = [(method, models, before)] if before else []
            (three, own, *then, ours), turns = interleaved([("average", fts), ("average-with-base", models),
                                                           *earlier, (method, models)])
            line = (f"{'treecli ' + method:<24} {ours['seconds']:>7.2f}s {ours['rss_mb']:>8.0f}MB "
                    f"{ours['seconds'] / three['seconds']:>6.2f}x / {ours['seconds'] / own['seconds']:.2f}x"
                    f"   (average {three['seconds']:.2f}s / {own['seconds']:.2f}s; turn by turn "
                    f"{min(turns):.2f}-{max(turns):.2f}x)")
            if then:
                line += (f"   before {then[0]['seconds']:.2f}s {then[0]['rss_mb']:.0f}MB: "
                         f"{ours['seconds'] / then[0]['seconds']:.2f}x")
            if args.mergekit:
                runs = [run("mergekit", method, tmp / f"mergekit-{method}.safetensors", base, models, env)
                        for _ in range(args.mergekit_runs)]
                theirs = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                line += (f"   mergekit {theirs['seconds']:.2f}s {theirs['rss_mb']:.0f}MB: "
                         f"{theirs['seconds'] / ours['seconds']:.1f}x slower")
                if method not in RANDOM:
                    worst, differing, total = subprocess.run(
                        [sys.executable, "-c", COMPARE, str(tmp / f"treecli-{method}.safetensors"),
                         str(tmp / f"mergekit-{method}.safetensors")], capture_output=True, text=True,
                        check=True).stdout.split()
                    line += (f", largest difference {float(worst):.3g} ({int(differing)} of {int(total)} elements "
                             "differ by more than 1e-6)")
            print(line, flush=True)
        if not args.mergekit:
            print("mergekit: not found; give --mergekit PATH/mergekit-pytorch to include it (see --help)")


if __name__ == "__main__":
    main()
