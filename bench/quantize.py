"""Benchmark: Q4_K_M (or --mix q5_k_m) of an HF Llama (--gib of bf16 weights) by treecli beside llama.cpp's
own quantizer (``llama_model_quantize``, what ``llama-quantize`` runs, from a Python that
has llama-cpp-python: --llama-cpp-python PYTHON), both on the same bf16 GGUF and with
the same threads, each a whole process, medians of --runs, with each process's peak RSS.
Then the two files are compared tensor by tensor: each tensor's type (the mix) and its
blocks, byte for byte.

    python bench/quantize.py --llama-cpp-python /tmp/llcpp/bin/python [--mix q5_k_m] [--gib 0.25] [--runs 1]

Needs sentencepiece (the model's tokenizer is trained here, by bench/hf_to_gguf.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pytorch_gguf import timed  # noqa: E402  (one process timed, with its peak RSS)

ROOT = Path(__file__).resolve().parent.parent
TREECLI = [sys.executable, "-m", "treecli"]
QUANTIZE = r"""
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[4].upper())
params.nthread = int(sys.argv[3])
if llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params) != 0:
    raise SystemExit("llama_model_quantize failed")
"""


def compare(ours: Path, reference: Path) -> str:
    """Each tensor's type and blocks in the two files: how many are the same, which differ."""
    import gguf
    import numpy as np

    left = {t.name: t for t in gguf.GGUFReader(str(ours)).tensors}
    right = {t.name: t for t in gguf.GGUFReader(str(reference)).tensors}
    differ = [name for name in sorted(set(left) | set(right))
              if name not in left or name not in right or left[name].tensor_type != right[name].tensor_type
              or np.asarray(left[name].data).tobytes() != np.asarray(right[name].data).tobytes()]
    kinds: dict[str, int] = {}
    for tensor in right.values():
        kinds[tensor.tensor_type.name] = kinds.get(tensor.tensor_type.name, 0) + 1
    mix = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
    return (f"{len(right) - len(differ)} of {len(right)} tensors the same type and bytes ({mix})"
            + (f"; differ: {', '.join(differ[:8])}" if differ else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp-python", required=True, help="a Python with llama-cpp-python")
    parser.add_argument("--gib", type=float, default=0.25)
    parser.add_argument("--mix", default="q4_k_m", choices=["q4_k_m", "q5_k_m"])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    threads = os.cpu_count() or 1
    work = Path(tempfile.mkdtemp(prefix="bench-quantize-", dir=args.dir))
    try:
        model = work / "model"
        subprocess.run([sys.executable, str(Path(__file__).parent / "hf_to_gguf.py"), "--llama-cpp", ".", "--gib",
                        str(args.gib), "--make", str(model)], check=True)
        source = work / "bf16.gguf"
        subprocess.run(TREECLI + ["convert", str(model), str(source), "--recipe", "llama.cpp", "-q"], check=True)
        commands = {
            "llama_model_quantize": [args.llama_cpp_python, "-c", QUANTIZE, str(source), str(work / "reference.gguf"),
                                     str(threads), args.mix],
            "treecli (verified)": TREECLI + ["convert", str(source), str(work / "ours.gguf"), "--dtype", args.mix,
                                             "--force", "-q"],
            "treecli --no-verify": TREECLI + ["convert", str(source), str(work / "ours.gguf"), "--dtype", args.mix,
                                              "--force", "-q", "--no-verify"],
        }
        results = {name: [timed(command) for _ in range(args.runs)] for name, command in commands.items()}
        base = statistics.median(s for s, _ in results["llama_model_quantize"])
        size = source.stat().st_size
        print(f"{args.mix.upper()} of a {size / (1 << 30):.2f} GiB bf16 GGUF, {threads} threads, medians of "
              f"{args.runs} runs")
        print(f"{'':24} {'seconds':>8} {'x reference':>12} {'peak RSS':>10}")
        for name, runs in results.items():
            seconds = statistics.median(s for s, _ in runs)
            print(f"{name:24} {seconds:8.2f} {seconds / base:11.2f}x {max(r for _, r in runs) / (1 << 20):8.0f} MiB")
        print(compare(work / "ours.gguf", work / "reference.gguf"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
