"""A model's rotary-embedding scaling as llama.cpp holds it, and back.

Into GGUF, as ``convert_hf_to_gguf.py`` writes it: ``llama3`` (Llama 3.1 and 3.2) as
a ``rope_freqs.weight`` tensor of per-frequency factors, computed in float32 in the
converter's order; ``linear`` and ``yarn`` as ``rope.scaling.*`` keys. Back: the keys
become ``rope_scaling`` again; the factors of ``rope_freqs.weight`` are solved for the
llama3 parameters that give them (any triple that gives the same factors gives the same
model), checked by computing the factors again.
"""

from __future__ import annotations

import math
from typing import Any

from treecli._errors import UsageError

ROPE_FREQS = "rope_freqs.weight"
# The scalings llama.cpp reads from keys: transformers' rope_type -> gguf.RopeScalingType
_AS_KEYS = {"linear": "LINEAR", "yarn": "YARN"}
# The parameters of a scaling that are numbers (transformers' names)
_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "beta_fast",
            "beta_slow", "extrapolation_factor", "attention_factor")
_LLAMA3_DEFAULTS = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}


def scaling_of(config: dict[str, Any]) -> dict[str, Any]:
    """A config's rope scaling (``rope_parameters`` in transformers 5, ``rope_scaling`` before),
    its type under ``rope_type``; empty for none."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        return {}
    kind = rope.get("rope_type", rope.get("type"))
    return {} if kind in (None, "default") else {**rope, "rope_type": kind}


def llama3_factors(theta: float, dim: int, scaling: dict[str, Any]) -> Any:
    """The converter's rope_freqs: per frequency of a head of ``dim``, 1 (fast), the factor
    (slow) or a smooth step between, in float32 as torch computes it there."""
    import numpy as np

    one = np.float32
    freqs = one(1.0) / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / one(dim)))
    factor = scaling.get("factor", _LLAMA3_DEFAULTS["factor"])
    low = scaling.get("low_freq_factor", _LLAMA3_DEFAULTS["low_freq_factor"])
    high = scaling.get("high_freq_factor", _LLAMA3_DEFAULTS["high_freq_factor"])
    old = scaling.get("original_max_position_embeddings", _LLAMA3_DEFAULTS["original_max_position_embeddings"])
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def to_gguf(config: dict[str, Any], arch: str, theta: float, head_dim: int, writer: Any, file: str
            ) -> dict[str, Any]:
    """Write a config's rope scaling to ``writer`` (a ``gguf.GGUFWriter``) as the converter
    does; returns the tensors it adds (name -> array).

    Raises:
        UsageError: a scaling llama.cpp's converter writes otherwise, or parameters that are no numbers.
    """
    import gguf

    scaling = scaling_of(config)
    kind = scaling.get("rope_type")
    if kind is None:
        return {}
    for key in _NUMBERS:
        value = scaling.get(key)
        if value is not None and (type(value) not in (int, float) or not math.isfinite(value) or value <= 0):
            raise UsageError(f"config.json's rope scaling {key} is {str(value)[:40]!r}: a positive number is wanted",
                             file=file)
    if kind == "llama3" and arch == "llama":
        return {ROPE_FREQS: llama3_factors(theta, head_dim, scaling)}
    keyed = _AS_KEYS.get(kind)
    if keyed is not None and isinstance(scaling.get("factor"), (int, float)):
        yarn = keyed == "YARN"
        if yarn and not isinstance(scaling.get("original_max_position_embeddings"), int):
            raise UsageError("config.json's yarn rope scaling has no original_max_position_embeddings", file=file)
        writer.add_rope_scaling_type(gguf.RopeScalingType[keyed])
        writer.add_rope_scaling_factor(scaling["factor"])
        if yarn:
            writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
            for key, add in (("extrapolation_factor", writer.add_rope_scaling_yarn_ext_factor),
                             ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                             ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                             ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
                if isinstance(scaling.get(key), (int, float)):
                    add(scaling[key])
        return {}
    raise UsageError(f"the llama.cpp recipe does not write {str(kind)[:40]!r} rope scaling for a {arch} model "
                     "(it writes llama3, linear and yarn as llama.cpp's converter does)", file=file)


def to_hf(meta: dict[str, Any], arch: str, factors: Any, theta: float, head_dim: int) -> tuple[dict, list[str]]:
    """The ``rope_scaling`` of a config.json that a GGUF file's keys and ``rope_freqs``
    factors describe (empty: none), and warnings."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    if isinstance(kind, str) and kind in _AS_KEYS and isinstance(meta.get(f"{arch}.rope.scaling.factor"),
                                                                  (int, float)):
        scaling = {"rope_type": kind, "factor": meta[f"{arch}.rope.scaling.factor"]}
        if _AS_KEYS[kind] == "YARN" and isinstance(meta.get(f"{arch}.rope.scaling.original_context_length"), int):
            scaling["original_max_position_embeddings"] = meta[f"{arch}.rope.scaling.original_context_length"]
        return scaling, []
    if factors is None:
        return {}, []
    found = _llama3_parameters(factors, theta, head_dim)
    if found is None:
        return {}, [f"{ROPE_FREQS} holds rope factors no llama3 scaling gives: config.json has no rope scaling "
                    "(the model back runs without it)"]
    return {"rope_type": "llama3", **found}, []


def _llama3_parameters(factors: Any, theta: float, head_dim: int) -> dict[str, Any] | None:
    """llama3 parameters that give ``factors``: Llama 3's own where they do, else solved from
    the factors between 1 and the largest (with low_freq_factor 1), each checked."""
    import numpy as np

    factors = np.asarray(factors, np.float32)
    if factors.ndim != 1 or factors.size * 2 != head_dim or not np.all(np.isfinite(factors)) or factors.min() < 1:
        return None
    factor = float(factors.max())
    candidates = [{**_LLAMA3_DEFAULTS, "factor": factor}]
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / freqs
    between = (factors > 1) & (factors < factor)
    if factor > 1 and between.sum() >= 2:  # s = (old / wavelen - low) / (high - low), linear in 1 / wavelen
        smooth = (1 / factors[between].astype(np.float64) - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[between], smooth, 1)
        if intercept < 0 and slope > 0:
            high = 1 - 1 / intercept
            old = slope * (high - 1)
            # (rounded where that gives the same factors: a config's own numbers are round)
            candidates.append({"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": round(float(high), 4),
                               "original_max_position_embeddings": round(float(old))})
            candidates.append({"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": float(high),
                               "original_max_position_embeddings": float(old)})
    return next((candidate for candidate in candidates
                 if np.allclose(llama3_factors(theta, head_dim, candidate), factors, rtol=1e-6, atol=0)), None)
