"""Benchmark: `convert x.safetensors y.gguf --dtype q8_0` (or --type q4_0) of --gib of float32
matrices, verified and not, beside the gguf package's own Python quantizer (what
convert_hf_to_gguf.py runs: `gguf.quants.quantize` of each tensor, `GGUFWriter`), not
verified; each a whole process, medians of --runs, with each process's peak RSS. The
two files' blocks are compared tensor by tensor.

    python bench/quantize_gguf_py.py [--gib 0.5] [--type q4_0] [--runs 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pytorch_gguf import timed  # noqa: E402  (one process timed, with its peak RSS)

TREECLI = [sys.executable, "-m", "treecli"]
GGUF_PY = r"""
import sys, gguf, numpy as np
from gguf import quants
from safetensors import safe_open
kind = gguf.GGMLQuantizationType[sys.argv[3].upper()]
writer = gguf.GGUFWriter(sys.argv[2], "llama")
with safe_open(sys.argv[1], "np") as f:
    for name in f.keys():
        q = quants.quantize(f.get_tensor(name), kind)
        writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=kind)
    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file()
writer.close()
"""


def main() -> None:
    import numpy as np
    from safetensors.numpy import save_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=0.5)
    parser.add_argument("--type", default="q8_0", choices=["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-gguf-py-", dir=args.dir))
    try:
        rng = np.random.default_rng(0)
        count = max(1, round(args.gib * (1 << 30) / (4096 * 4096 * 4)))
        save_file({f"blk.{i}.ffn_up.weight": rng.standard_normal((4096, 4096), dtype=np.float32) * 0.02
                   for i in range(count)}, str(work / "model.safetensors"))
        source = str(work / "model.safetensors")
        commands = {
            "gguf-py (not verified)": [sys.executable, "-c", GGUF_PY, source, str(work / "theirs.gguf"), args.type],
            "treecli (verified)": TREECLI + ["convert", source, str(work / "ours.gguf"), "--dtype", args.type,
                                             "--force", "-q"],
            "treecli --no-verify": TREECLI + ["convert", source, str(work / "ours.gguf"), "--dtype", args.type,
                                              "--force", "-q", "--no-verify"],
        }
        results = {name: [timed(command) for _ in range(args.runs)] for name, command in commands.items()}
        base = statistics.median(s for s, _ in results["gguf-py (not verified)"])
        print(f"{args.type.upper()} of {count} float32 matrices of 4096x4096 ({count * 64} MiB), medians of "
              f"{args.runs} runs")
        print(f"{'':24} {'seconds':>8} {'x gguf-py':>10} {'peak RSS':>10}")
        for name, runs in results.items():
            seconds = statistics.median(s for s, _ in runs)
            print(f"{name:24} {seconds:8.2f} {seconds / base:9.2f}x {max(r for _, r in runs) / (1 << 20):8.0f} MiB")
        import gguf

        ours = {t.name: bytes(t.data) for t in gguf.GGUFReader(str(work / "ours.gguf")).tensors}
        theirs = {t.name: bytes(t.data) for t in gguf.GGUFReader(str(work / "theirs.gguf")).tensors}
        print(f"{sum(ours[k] == theirs.get(k) for k in ours)} of {len(theirs)} tensors the same blocks")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
