"""Synthetic checkpoints for the benchmarks: real headers, sparse data (no disk cost)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path


def llama_tensors(layers: int, hidden: int, inter: int, vocab: int, kv: int) -> list[tuple[str, list[int]]]:
    """Names and shapes of a Llama-style model (70B: 80, 8192, 28672, 128256, 1024)."""
    out = [("model.embed_tokens.weight", [vocab, hidden])]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", [hidden]),
            (p + "self_attn.q_proj.weight", [hidden, hidden]),
            (p + "self_attn.k_proj.weight", [kv, hidden]),
            (p + "self_attn.v_proj.weight", [kv, hidden]),
            (p + "self_attn.o_proj.weight", [hidden, hidden]),
            (p + "post_attention_layernorm.weight", [hidden]),
            (p + "mlp.gate_proj.weight", [inter, hidden]),
            (p + "mlp.up_proj.weight", [inter, hidden]),
            (p + "mlp.down_proj.weight", [hidden, inter]),
        ]
    out += [("model.norm.weight", [hidden]), ("lm_head.weight", [vocab, hidden])]
    return out


def moe_tensors(layers: int = 130, experts: int = 256) -> list[tuple[str, list[int]]]:
    """A mixture-of-experts header with many small tensors (130 x 256: 199,810 tensors)."""
    out = []
    for i in range(layers):
        for e in range(experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                p = f"model.layers.{i}.mlp.experts.{e}.{proj}."
                out += [(p + "weight", [64, 32]), (p + "scale", [64])]
        out.append((f"model.layers.{i}.input_layernorm.weight", [4096]))
    return out


def write_sparse_safetensors(path: Path, tensors: list[tuple[str, list[int]]], dtype: str = "BF16",
                             itemsize: int = 2) -> int:
    """A safetensors file with a real header and a hole for the data. Returns its size."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        n = itemsize
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
    os.truncate(path, 8 + len(blob) + offset)
    return 8 + len(blob) + offset


def write_sharded(directory: Path, tensors: list[tuple[str, list[int]]], shards: int) -> None:
    """An HF sharded directory of sparse shards plus its index."""
    directory.mkdir(parents=True, exist_ok=True)
    per = -(-len(tensors) // shards)
    weight_map = {}
    for i in range(shards):
        part = tensors[i * per : (i + 1) * per]
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_sparse_safetensors(directory / name, part)
        weight_map.update({n: name for n, _ in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
