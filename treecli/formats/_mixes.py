"""llama.cpp's quantization mixes: the type its quantizer (``llama_tensor_get_type`` in
llama-quant.cpp, no importance matrix) picks for each tensor of a model, by the tensor's
llama.cpp name, its layer, the number of layers and, for a 70B model, its shape. A mix is
named as llama-quantize names it (``q4_k_m``); a plain type (``q8_0``, ``q4_0``) is that
type's mix: the output tensor (or, where the embeddings are tied, the token embeddings)
takes Q6_K unless the type is Q8_0, as llama.cpp's quantizer gives it."""

from __future__ import annotations

import re
from typing import Callable

MIXES = ("q4_k_m", "q5_k_m")
_LAYER = re.compile(r"blk\.([0-9]+)\.")


def _use_more_bits(layer: int, layers: int) -> bool:
    """The layers llama.cpp gives more bits: the first and last eighth, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def chooser(shapes: dict[str, tuple[int, ...]], kind: str) -> Callable[[str], str]:
    """For the tensors of one model (name -> shape), the function that gives each one's
    type under ``kind`` (a mix or a plain type)."""
    has_output = "output.weight" in shapes
    counts = {role: sum(1 for name in shapes if name.endswith(f".{role}.weight")) for role in ("attn_v", "ffn_down")}
    base = kind[:-2] if kind in MIXES else kind
    # llama.cpp's 70B models (80 layers; grouped KV heads, which make K's rows fewer than Q's)
    # give attn_v Q5_K where a mix gives Q4_K
    seventy = counts["attn_v"] == 80 and shapes.get("blk.0.attn_k.weight", (0,))[0] != \
        shapes.get("blk.0.attn_q.weight", (0,))[0]

    def choose(name: str) -> str:
        if name == "output.weight" or (not has_output and name == "token_embd.weight"):
            return base if base == "q8_0" else "q6_k"  # (rows short of 256 fall back to Q8_0 when written)
        found = _LAYER.match(name)
        if kind in MIXES and found:
            for role, count in counts.items():
                if name.endswith(f".{role}.weight") and _use_more_bits(int(found.group(1)), count):
                    return "q6_k"
            if seventy and name.endswith(".attn_v.weight") and base == "q4_k":
                return "q5_k"
        return base

    return choose
