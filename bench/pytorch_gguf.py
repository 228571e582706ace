"""Benchmark: PyTorch and GGUF files (issue 34), each against the usual script in the
same run, every command a whole process (imports included), medians of --runs,
with each process's peak RSS:

  - `show` of an HF directory of two `pytorch_model-*.bin` shards, beside
    `torch.load(shard, mmap=True, weights_only=True)` of each and a line per tensor;
  - `convert` of one --gib `.bin` to safetensors (verified, as treecli always does),
    beside `torch.load(weights_only=True)` + `safetensors.torch.save_file`;
  - `convert` of a Q8_0 GGUF (its tensors --gib once dequantized) to safetensors,
    beside `gguf.GGUFReader` + `gguf.quants.dequantize` + `safetensors.numpy.save_file`.

    python bench/pytorch_gguf.py [--gib 1] [--runs 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TORCH_SHOW = r"""
import sys, torch
for path in sys.argv[1:]:
    for name, t in torch.load(path, mmap=True, weights_only=True).items():
        print(name, list(t.shape), t.dtype)
"""
TORCH_CONVERT = r"""
import sys, torch
from safetensors.torch import save_file
save_file(torch.load(sys.argv[1], weights_only=True), sys.argv[2])
"""
GGUF_CONVERT = r"""
import sys, numpy as np, gguf
from gguf import quants
from safetensors.numpy import save_file
out = {}
for t in gguf.GGUFReader(sys.argv[1]).tensors:
    out[t.name] = np.ascontiguousarray(quants.dequantize(t.data, t.tensor_type).astype(np.float32))
save_file(out, sys.argv[2])
"""


def timed(args: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one process."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stderr.read().decode()}")
    return seconds, usage.ru_maxrss * 1024


def compare(title: str, runs: int, ours: list[str], theirs: list[str], reset=lambda: None) -> None:
    times: dict[str, list[tuple[float, int]]] = {"treecli": [], "reference": []}
    for _ in range(runs):
        for name, args in (("treecli", ours), ("reference", theirs)):
            reset()
            times[name].append(timed(args))
    t_ours, t_theirs = (statistics.median(s for s, _ in times[n]) for n in ("treecli", "reference"))
    m_ours, m_theirs = (max(m for _, m in times[n]) for n in ("treecli", "reference"))
    print(f"{title}:\n  treecli   {t_ours:7.2f} s  {m_ours / 2**20:7.0f} MB\n"
          f"  reference {t_theirs:7.2f} s  {m_theirs / 2**20:7.0f} MB   treecli {t_theirs / t_ours:.2f}x faster")


def generate(work: Path, gib: float) -> None:
    """The inputs, written by a process of their own (a child forked from a big process
    would count its pages in its peak RSS)."""
    import json

    import gguf
    import numpy as np
    import torch
    from gguf import quants

    rows = max(1, int(gib * 2**30) // (2 * 4096 * 4096))  # bf16 [4096, 4096] matrices
    g = torch.Generator().manual_seed(0)
    state = {f"model.layers.{i}.weight": torch.randn(4096, 4096, generator=g).to(torch.bfloat16) for i in range(rows)}
    torch.save(state, work / "pytorch_model.bin")
    hf = work / "hf"
    hf.mkdir()
    names = list(state)
    halves = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2 or 1],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2 or 1:]}
    for shard, keys in halves.items():
        torch.save({k: state[k] for k in keys}, hf / shard)
    (hf / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {k: shard for shard, keys in halves.items() for k in keys}}))
    writer = gguf.GGUFWriter(str(work / "model.gguf"), "llama")
    rng = np.random.default_rng(0)
    for i in range(max(1, int(gib * 2**30) // (4 * 4096 * 4096))):
        q = quants.quantize(rng.standard_normal((4096, 4096), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(f"blk.{i}.attn_q.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--generate", help=argparse.SUPPRESS)  # (the child that writes the inputs)
    args = parser.parse_args()
    if args.generate:
        generate(Path(args.generate), args.gib)
        return

    work = Path(tempfile.mkdtemp(prefix="treecli-pt-", dir=args.dir))
    treecli = [sys.executable, "-m", "treecli"]
    try:
        subprocess.run([sys.executable, __file__, "--gib", str(args.gib), "--generate", str(work)], check=True)
        hf = work / "hf"
        size = (work / "pytorch_model.bin").stat().st_size
        print(f"{size / 2**30:.2f} GiB bf16 .bin; GGUF Q8_0 of {(work / 'model.gguf').stat().st_size / 2**30:.2f} GiB; "
              f"{os.cpu_count()} CPUs; medians of {args.runs}")
        shards = sorted(str(p) for p in hf.glob("*.bin"))
        compare("show of an HF directory of 2 .bin shards", args.runs, [*treecli, "show", str(hf)],
                [sys.executable, "-c", TORCH_SHOW, *shards])
        out = work / "out.safetensors"
        compare(f"convert {size / 2**30:.2f} GiB .bin -> safetensors", args.runs,
                [*treecli, "convert", str(work / "pytorch_model.bin"), str(out), "--force"],
                [sys.executable, "-c", TORCH_CONVERT, str(work / "pytorch_model.bin"), str(out)],
                reset=lambda: out.unlink(missing_ok=True))
        compare("convert GGUF Q8_0 -> safetensors (float32)", args.runs,
                [*treecli, "convert", str(work / "model.gguf"), str(out), "--force"],
                [sys.executable, "-c", GGUF_CONVERT, str(work / "model.gguf"), str(out)],
                reset=lambda: out.unlink(missing_ok=True))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
