"""llama.cpp's quantization mixes: the type its quantizer (``llama_tensor_get_type`` in
llama-quant.cpp, no importance matrix) picks for each tensor of a model, by the tensor's
llama.cpp name, its layer, the number of layers, grouped KV heads and experts. A mix is
named as llama-quantize names it (``q4_k_m``; ``q4_k`` is its alias of ``q4_k_m``, as
there); a plain type (``q8_0``, ``q4_0``) is that type's mix: the output tensor (or, where
the embeddings are tied, the token embeddings) takes Q6_K unless the type is Q8_0.
Overrides (``--tensor-type REGEX=TYPE``, llama-quantize's own option) come first: the
first pattern found in a tensor's name gives its type.

Rules llama.cpp keeps for architectures treecli does not convert (Falcon's, GLM's) and
for the mixes that need an importance matrix (IQ1-IQ3, Q2_K_S) are not here.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

from treecli._errors import UsageError
from treecli.formats._gguf_layout import WRITTEN_QUANTIZATIONS

# llama-quantize's mixes, each with the type most of its tensors take
MIXES = {"q2_k": "q2_k", "q3_k_s": "q3_k", "q3_k_m": "q3_k", "q3_k_l": "q3_k", "q4_k_s": "q4_k", "q4_k_m": "q4_k",
         "q5_k_s": "q5_k", "q5_k_m": "q5_k", "q6_k": "q6_k", "q8_0": "q8_0", "q5_1": "q5_1", "q5_0": "q5_0",
         "q4_1": "q4_1", "q4_0": "q4_0", "iq4_nl": "iq4_nl", "iq4_xs": "iq4_xs"}
ALIASES = {"q3_k": "q3_k_m", "q4_k": "q4_k_m", "q5_k": "q5_k_m"}  # (as llama-quantize takes them)
_LAYER = re.compile(r"blk\.([0-9]+)\.")
_BLOCKS_OF_256 = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")
# tensors llama.cpp never quantizes, whatever their shape (``tensor_allows_quantization``)
_KEPT = re.compile(r"_norm\.weight|ffn_gate_inp\.weight|ffn_gate_tid2eid\.weight|altup|laurel|per_layer_model_proj|"
                   r"ssm_conv1d|shortconv\.conv\.weight|^position_embd\.weight$|^token_types\.weight$")


def _use_more_bits(layer: int, layers: int) -> bool:
    """The layers llama.cpp gives more bits: the first and last eighth, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _category(name: str) -> str:
    """llama.cpp's ``tensor_get_category``: by a part of the name, in its order."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, category in (("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"), ("attn_v.weight", "attn_v"),
                           ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                           ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                           ("ffn_down", "ffn_down")):
        if part in name:  # (QKV and KV_B are attn_v to the rules: more sensitive to quantization)
            return category
    return "other"


def chooser(shapes: dict[str, tuple[int, ...]], kind: str, overrides: Sequence[tuple[str, str]] = ()
            ) -> Callable[[str], str | None]:
    """For the tensors of one model (name -> shape, in the order they are written), the
    function that gives each one's type under ``kind`` (a mix, an alias or a plain type),
    ``overrides`` ((regex, type) pairs) first; None where llama.cpp leaves a tensor as it is."""
    mix = ALIASES.get(kind, kind)
    base = MIXES[mix]
    has_output = "output.weight" in shapes
    attn_v = sum(1 for name in shapes if _category(name) == "attn_v")
    layers = 1 + max((int(found.group(1)) for found in map(_LAYER.match, shapes) if found), default=-1)
    q_rows, k_rows = shapes.get("blk.0.attn_q.weight", (0,))[0], shapes.get("blk.0.attn_k.weight", (0,))[0]
    gqa = q_rows // k_rows if k_rows else 1  # (n_head / n_head_kv)
    experts = next((shape[0] for name, shape in shapes.items() if "_exps." in name and len(shape) == 3), 1)
    seventy = layers == 80 and gqa > 1  # llama.cpp's 70B type: 80 layers, grouped KV heads
    compiled = _compiled(overrides)

    def choose(name: str) -> str | None:
        if len(shapes[name]) < 2 or _KEPT.search(name):
            return None
        for pattern, chosen in compiled:
            if pattern.search(name):
                return chosen
        category, found = _category(name), _LAYER.match(name)
        layer = int(found.group(1)) if found else 0
        if category == "output" or (not has_output and category == "token_embd"):
            if shapes[name][-1] % (256 if base in _BLOCKS_OF_256 else 32):
                return "q8_0"
            return base if base == "q8_0" else "q6_k"
        if category == "attn_v":
            return _attn_v(mix, base, layer, attn_v, gqa, seventy, experts)
        if category == "attn_k" and experts == 8:
            return "q8_0"
        if category == "ffn_down":
            return _ffn_down(mix, base, layer, layers)
        if category == "attn_output":
            if experts == 8:
                return "q5_k" if mix in ("q2_k", "q3_k_s", "q3_k_m", "q4_k_s", "q4_k_m", "iq4_nl", "iq4_xs") else base
            return {"q2_k": "q3_k", "q3_k_m": "q4_k", "q3_k_l": "q5_k"}.get(mix, base)
        return base

    return choose


def _compiled(overrides: Sequence[tuple[str, str]]) -> list[tuple[re.Pattern, str]]:
    """The overrides' regexes compiled, each with its type: one treecli writes (as
    ``--tensor-type`` may give one tensor).

    Raises:
        UsageError: a type treecli does not write, or a regex that is not one.
    """
    compiled = []
    for pattern, chosen in overrides:
        if chosen.lower() not in WRITTEN_QUANTIZATIONS:
            raise UsageError(f"cannot quantize {pattern!r} to {chosen!r}; choose one of "
                             f"{', '.join(WRITTEN_QUANTIZATIONS)}")
        try:
            compiled.append((re.compile(pattern), chosen.lower()))
        except re.error as e:
            raise UsageError(f"{pattern!r} is not a regular expression: {e}") from None
    return compiled


def _attn_v(mix: str, base: str, index: int, count: int, gqa: int, seventy: bool, experts: int) -> str:
    """An attn_v-like tensor's type: the ``index``-th of ``count`` (llama.cpp counts them in the
    order it meets them: in a model's file, one to a layer, the layer's number)."""
    chosen = base
    if mix == "q2_k":
        chosen = "q4_k" if gqa >= 4 else "q3_k"
    elif mix == "q3_k_m":
        chosen = "q5_k" if index < 2 else "q4_k"
    elif mix == "q3_k_l":
        chosen = "q5_k"
    elif mix in ("iq4_nl", "iq4_xs") and gqa >= 4:
        chosen = "q5_k"
    elif mix in ("q4_k_m", "q5_k_m") and _use_more_bits(index, count):
        chosen = "q6_k"
    elif mix == "q4_k_s" and index < 4:
        chosen = "q5_k"
    if seventy and chosen in ("q3_k", "q4_k"):
        # 8 heads share attn_v: more bits here cost little and buy much
        chosen = "q5_k"
    return "q8_0" if experts == 8 else chosen


def _ffn_down(mix: str, base: str, layer: int, layers: int) -> str:
    if mix == "q2_k":
        return "q3_k"
    if mix == "q3_k_m":
        return "q5_k" if layer < layers // 16 else "q4_k"
    if mix == "q3_k_l":
        return "q5_k"
    if mix in ("q4_k_m", "q5_k_m") and _use_more_bits(layer, layers):
        return "q6_k"
    if mix in ("iq4_nl", "iq4_xs") and layer < layers // 8:
        return "q5_k"
    if mix == "q4_k_s" and layer < layers // 8:
        return "q5_k"
    return base
