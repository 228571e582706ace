"""Dtype names and kinds, including the ml_dtypes ones NumPy lacks (bfloat16, fp8)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from treecli._errors import UsageError

_EXTRA = {
    name: np.dtype(getattr(ml_dtypes, name))
    for name in (
        "bfloat16",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e4m3b11fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float8_e3m4",
        "float8_e4m3",
        "float4_e2m1fn",
        "float6_e2m3fn",
        "float6_e3m2fn",
        "int4",
        "uint4",
        "int2",
        "uint2",
    )
    if hasattr(ml_dtypes, name)
}
_EXTRA_FLOATS = {n for n in _EXTRA if n.startswith(("bfloat", "float"))}


def name(dtype: Any) -> str:
    """The NumPy / ml_dtypes name: ``float32``, ``bfloat16``, ``float8_e4m3fn``."""
    return np.dtype(dtype).name


def parse(text: str) -> np.dtype:
    """A dtype from its name (``bfloat16``, ``bf16``, ``float32``, ``f16``, ``int8``...).

    Raises:
        UsageError: for an unknown name.
    """
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "f16": "float16",
               "fp32": "float32", "f32": "float32", "float": "float32",
               "fp64": "float64", "f64": "float64", "double": "float64"}
    key = aliases.get(text.strip().lower(), text.strip())
    if key in _EXTRA:
        return _EXTRA[key]
    try:
        dtype = np.dtype(key)
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "biufc" or key in ("O", "object"):
        known = "float32, float16, bfloat16, float64, float8_e4m3fn, int8, int32, int64, bool, ..."
        raise UsageError(f"unknown dtype {text!r} (try one of {known})")
    return dtype


def is_float(dtype: Any) -> bool:
    """Floating point, including bfloat16 and the fp8/fp6/fp4 types (which NumPy calls kind 'V')."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype.name in _EXTRA_FLOATS


def accumulator(dtype: Any) -> np.dtype:
    """The dtype to accumulate a float dtype in: float64 for float64, else float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def finfo(dtype: Any):
    """``finfo`` that also knows the ml_dtypes floats."""
    dtype = np.dtype(dtype)
    return ml_dtypes.finfo(dtype) if dtype.name in _EXTRA_FLOATS else np.finfo(dtype)
