"""Benchmark: an HF Llama directory (--gib of bf16 weights, a SentencePiece tokenizer) to a
GGUF file llama.cpp runs, by ``treecli convert --recipe llama.cpp`` (verified, as convert
always is, and with --no-verify) beside llama.cpp's own ``convert_hf_to_gguf.py`` (with
torch, from llama.cpp's sources: --llama-cpp DIR, e.g. the vendor/llama.cpp of the
llama-cpp-python sdist) in the same run: each a whole process, imports included,
medians of --runs, with each process's peak RSS. Then the two files are compared: the
same tensors bit for bit, and which metadata keys differ.

    python bench/hf_to_gguf.py --llama-cpp /tmp/llama.cpp [--gib 1] [--runs 3] [--dir /tmp]

Needs ``sentencepiece`` (the tokenizer is trained here) and torch (for the reference).
"""

from __future__ import annotations

import argparse
import json
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


def make_model(directory: Path, gib: float) -> None:
    """A Llama of about ``gib`` GiB of bf16 weights (hidden 2048, 16 heads, 8 KV heads, as many
    layers as fit), random values, and a SentencePiece tokenizer trained on a few sentences."""
    import ml_dtypes
    import numpy as np
    import sentencepiece
    from safetensors.numpy import save_file

    hidden, inter, vocab, heads, kv = 2048, 5632, 32000, 16, 8
    per_layer = 2 * hidden * hidden + 2 * hidden * (hidden // heads * kv) + 3 * hidden * inter
    layers = max(1, int((gib * (1 << 30) / 2 - 2 * vocab * hidden) // per_layer))
    rng = np.random.default_rng(0)
    bf16 = np.dtype(ml_dtypes.bfloat16)

    def weight(*shape):
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(bf16)

    tensors = {"model.embed_tokens.weight": weight(vocab, hidden), "lm_head.weight": weight(vocab, hidden),
               "model.norm.weight": weight(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({p + "self_attn.q_proj.weight": weight(hidden, hidden),
                        p + "self_attn.k_proj.weight": weight(hidden // heads * kv, hidden),
                        p + "self_attn.v_proj.weight": weight(hidden // heads * kv, hidden),
                        p + "self_attn.o_proj.weight": weight(hidden, hidden),
                        p + "mlp.gate_proj.weight": weight(inter, hidden), p + "mlp.up_proj.weight": weight(inter, hidden),
                        p + "mlp.down_proj.weight": weight(hidden, inter),
                        p + "input_layernorm.weight": weight(hidden), p + "post_attention_layernorm.weight": weight(hidden)})
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"))
    del tensors
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "vocab_size": vocab, "tie_word_embeddings": False, "hidden_act": "silu",
              "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    text = directory / "corpus.txt"
    text.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog {i * 7}" for i in range(2000)))
    sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(directory / "tokenizer"),
                                             vocab_size=400, model_type="bpe", byte_fallback=True,
                                             minloglevel=2)
    text.unlink()
    (directory / "tokenizer.vocab").unlink()


def compare(ours: Path, reference: Path) -> str:
    """Whether the two GGUF files hold the same tensors bit for bit, and the metadata keys that differ."""
    sys.path.insert(0, str(ROOT))
    import treecli
    from treecli._transforms import items_of

    with treecli.open(ours) as a, treecli.open(reference) as b:
        left, right = dict(items_of(a.tree)), dict(items_of(b.tree))
        same = sorted(left) == sorted(right) and all(
            left[n].shape == right[n].shape and left[n].dtype_name == right[n].dtype_name
            and left[n].read_flat(0, left[n].size).tobytes() == right[n].read_flat(0, right[n].size).tobytes()
            for n in left)
        keys = sorted(set(a.metadata) ^ set(b.metadata))
        values = sorted(k for k in set(a.metadata) & set(b.metadata) if str(a.metadata[k]) != str(b.metadata[k]))
    return (f"tensors: {'the same, bit for bit' if same else 'DIFFER'} ({len(left)}); metadata keys only one has: "
            f"{', '.join(keys) or 'none'}; values that differ: {', '.join(values) or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source directory")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--make", type=Path, help=argparse.SUPPRESS)  # (the model is made in a child process:
    args = parser.parse_args()  # a child inherits its parent's peak RSS on Linux, and the model's arrays are big)
    if args.make:
        return make_model(args.make, args.gib)
    work = Path(tempfile.mkdtemp(prefix="bench-hf-gguf-", dir=args.dir))
    try:
        model = work / "model"
        subprocess.run([sys.executable, __file__, "--llama-cpp", str(args.llama_cpp), "--gib", str(args.gib),
                        "--make", str(model)], check=True)
        size = (model / "model.safetensors").stat().st_size
        commands = {
            "convert_hf_to_gguf.py": [sys.executable, str(args.llama_cpp / "convert_hf_to_gguf.py"), str(model),
                                      "--outfile", str(work / "reference.gguf"), "--outtype", "bf16"],
            "treecli (verified)": TREECLI + ["convert", str(model), str(work / "ours.gguf"), "--recipe", "llama.cpp",
                                             "--force", "-q"],
            "treecli --no-verify": TREECLI + ["convert", str(model), str(work / "ours.gguf"), "--recipe",
                                              "llama.cpp", "--force", "-q", "--no-verify"],
        }
        results = {name: [] for name in commands}
        for _ in range(args.runs):
            for name, command in commands.items():
                (work / "reference.gguf").unlink(missing_ok=True)
                results[name].append(timed(command))
        base = statistics.median(s for s, _ in results["convert_hf_to_gguf.py"])
        print(f"HF Llama, {size / (1 << 30):.2f} GiB of bf16 -> GGUF, medians of {args.runs} runs")
        print(f"{'':28} {'seconds':>8} {'vs reference':>13} {'peak RSS':>10}")
        for name, runs in results.items():
            seconds = statistics.median(s for s, _ in runs)
            rss = max(r for _, r in runs)
            print(f"{name:28} {seconds:8.2f} {base / seconds:12.2f}x {rss / (1 << 20):8.0f} MiB")
        timed(commands["convert_hf_to_gguf.py"])
        print(compare(work / "ours.gguf", work / "reference.gguf"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
