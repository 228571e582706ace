"""llama.cpp's quantization mixes: the type its quantizer (``llama_tensor_get_type`` in
llama-quant.cpp, no importance matrix) picks for each tensor of a model, by the tensor's
llama.cpp name, its layer and the number of layers. A mix is named as llama-quantize
names it (``q4_k_m``); a plain type (``q8_0``, ``q4_0``) is that type's mix: the output
tensor (or, where the embeddings are tied, the token embeddings) takes Q6_K unless the
type is Q8_0, as llama.cpp's quantizer gives it."""

from __future__ import annotations

import re
from typing import Callable

from treecli._errors import UsageError

MIXES = ("q4_k_m",)
_LAYER = re.compile(r"blk\.([0-9]+)\.")


def _use_more_bits(layer: int, layers: int) -> bool:
    """The layers llama.cpp gives more bits: the first and last eighth, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def chooser(names: list[str], kind: str) -> Callable[[str], str]:
    """For the tensors ``names`` of one model, the function that gives each one's type under
    ``kind`` (a mix or a plain type).

    Raises:
        UsageError: a mix that needs a type treecli does not write for this model.
    """
    has_output = "output.weight" in names
    counts = {role: sum(1 for name in names if name.endswith(f".{role}.weight")) for role in ("attn_v", "ffn_down")}
    base = "q4_k" if kind == "q4_k_m" else kind
    if kind == "q4_k_m" and counts["attn_v"] == 80:
        raise UsageError("Q4_K_M of an 80-layer model gives its attn_v Q5_K (llama.cpp's rule for 70B models), "
                         "which treecli does not write yet")

    def choose(name: str) -> str:
        if name == "output.weight" or (not has_output and name == "token_embd.weight"):
            return base if base == "q8_0" else "q6_k"  # (rows short of 256 fall back to Q8_0 when written)
        found = _LAYER.match(name)
        if kind == "q4_k_m" and found:
            for role, count in counts.items():
                if name.endswith(f".{role}.weight") and _use_more_bits(int(found.group(1)), count):
                    return "q6_k"
        return base

    return choose

