"""Dtype names and kinds, including the ml_dtypes ones NumPy lacks (bfloat16, fp8).

Leaves carry their dtype by *name* (``float32``, ``bfloat16``) with its item
size from the table below, so that ``show`` never imports NumPy (0.1 s of a
0.25 s budget). ``numpy_dtype`` turns a name into a real dtype when data is
actually read.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from treecli._errors import UsageError

_ITEMSIZE = {
    "bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e4m3b11fnuz": 1, "float8_e5m2": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float8_e3m4": 1, "float8_e4m3": 1,
    "float4_e2m1fn": 1, "float6_e2m3fn": 1, "float6_e3m2fn": 1, "int4": 1, "uint4": 1, "int2": 1, "uint2": 1,
}
_ML_DTYPES = {
    "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e4m3b11fnuz", "float8_e5m2", "float8_e5m2fnuz",
    "float8_e8m0fnu", "float8_e3m4", "float8_e4m3", "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn",
    "int4", "uint4", "int2", "uint2",
}
_FLOATS = {n for n in _ITEMSIZE if n.startswith(("float", "bfloat"))}
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "f16": "float16",
            "fp32": "float32", "f32": "float32", "float": "float32",
            "fp64": "float64", "f64": "float64", "double": "float64"}


def name(dtype: Any) -> str:
    """The NumPy / ml_dtypes name of a dtype or dtype name: ``float32``, ``bfloat16``."""
    if isinstance(dtype, str):
        return dtype
    return getattr(dtype, "name", None) or str(dtype)


def names() -> list[str]:
    """Every dtype name treecli knows, for completion and messages."""
    return list(_ITEMSIZE)


def is_known(dtype_name: str) -> bool:
    """A numeric dtype treecli handles (bool, ints, floats incl. bf16/fp8, complex); never objects or voids."""
    return dtype_name in _ITEMSIZE


def needs_ml_dtypes(dtype_name: str) -> bool:
    """bfloat16, fp8, fp6, fp4, int4...: dtypes NumPy has no name for."""
    return dtype_name in _ML_DTYPES


def itemsize(dtype_name: str) -> int:
    size = _ITEMSIZE.get(dtype_name)
    return size if size is not None else numpy_dtype(dtype_name).itemsize


@lru_cache(maxsize=None)
def numpy_dtype(dtype_name: str):
    """The NumPy dtype of a name (imports NumPy, and ml_dtypes where needed)."""
    import numpy as np

    if dtype_name in _ML_DTYPES:
        import ml_dtypes

        if not hasattr(ml_dtypes, dtype_name):
            raise UsageError(f"dtype {dtype_name} needs a newer ml_dtypes")
        return np.dtype(getattr(ml_dtypes, dtype_name))
    return np.dtype(dtype_name)


def parse(text: str) -> str:
    """A dtype name from what a user typed (``bfloat16``, ``bf16``, ``float32``, ``f16``, ``int8``...).

    Raises:
        UsageError: for an unknown name.
    """
    key = _ALIASES.get(text.strip().lower(), text.strip())
    if key in _ITEMSIZE:
        return key
    known = "float32, float16, bfloat16, float64, float8_e4m3fn, int8, int32, int64, bool, ..."
    raise UsageError(f"unknown dtype {text!r} (try one of {known})")


def promoted(dtype_names: Any) -> str:
    """The dtype mixed floats are computed in, as mergekit 0.1.5 (torch) promotes them:
    the widest; two of one width that differ (bfloat16 with float16, fp8 kinds) meet in
    float32, which holds every value of either exactly."""
    distinct = sorted(set(dtype_names), key=itemsize)
    if len(distinct) == 1:
        return distinct[0]
    widest = distinct[-1]
    if itemsize(widest) >= 4 and sum(itemsize(d) == itemsize(widest) for d in distinct) == 1:
        return widest
    return "float32" if itemsize(widest) <= 4 else "float64"


def common(a: str, b: str) -> str | None:
    """The dtype two leaves of different dtypes are compared in: the one that holds both
    exactly where there is one (``promoted`` for floats, NumPy's promotion for integers and
    their mixes with floats, float64 at most); None where no comparison of values makes
    sense (bool, int4 and the like, complex with real)."""
    kinds = {kind(a), kind(b)}
    if a == b or not kinds <= set("iuf") or needs_ml_dtypes(a) and not is_float(a) \
            or needs_ml_dtypes(b) and not is_float(b):
        return None
    if kinds == {"f"}:
        return promoted([a, b])
    import numpy as np

    return name(np.result_type(*(numpy_dtype(d if not is_float(d) else "float64" if itemsize(d) == 8 else "float32")
                                 for d in (a, b))))


def kind(dtype: Any) -> str:
    """NumPy's one-letter kind (``b i u f c``, else ``V``, ``U``, ...), decided by the dtype's name
    for every dtype treecli knows: ml_dtypes reports its types (bf16, fp8, int4) as kind ``V``
    in some releases and not in others, and a raw void (an npz's ``V2``) is ``V`` in all."""
    dtype_name = name(dtype)
    if dtype_name == "bool":
        return "b"
    if dtype_name in _ITEMSIZE:
        return "f" if is_float(dtype_name) else "c" if dtype_name.startswith("complex") else \
            "u" if dtype_name.startswith("uint") else "i"
    return numpy_dtype(dtype_name).kind if isinstance(dtype, str) else dtype.kind


def is_float(dtype: Any) -> bool:
    """Floating point, including bfloat16 and the fp8/fp6/fp4 types (which NumPy calls kind 'V')."""
    return name(dtype) in _FLOATS or name(dtype).startswith("float")  # float128 too


# IEEE formats: a value is Inf or NaN exactly when its exponent bits are all ones.
_EXPONENT_BITS = {"float16": ("<u2", 0x7C00), "bfloat16": ("<u2", 0x7F80), "float32": ("<u4", 0x7F800000),
                  "float64": ("<u8", 0x7FF0000000000000)}


def nonfinite(values, out, work):
    """Into ``out`` (bools): which ``values`` are Inf or NaN. IEEE types are read as bits
    (``work``: room for as many unsigned integers of their width), 7x faster than
    ml_dtypes' ``isinf`` on bf16; fp8 and the like through ``np.isfinite``."""
    import numpy as np

    spec = _EXPONENT_BITS.get(name(values.dtype))
    if spec is None:
        return np.logical_not(np.isfinite(values), out=out)
    unsigned, exponent = np.dtype(spec[0]), spec[1]
    bits = work.view(unsigned)[: values.size]
    np.bitwise_and(values.view(unsigned), unsigned.type(exponent), out=bits)
    return np.equal(bits, unsigned.type(exponent), out=out)


def accumulator(dtype: Any):
    """The NumPy dtype to accumulate floats in: float64, whatever the leaf's dtype.

    A float32 accumulator misses DESIGN.md's accuracy oracle wherever terms
    cancel: its absolute error (~1e-7 of the terms' magnitude) is many ulps of
    a small result, for fp32 (rtol 1e-6 / atol 1e-7) and for bf16/fp16 (one
    ulp) alike. With independent random inputs that is a few elements per
    million. float64 holds every product of a <=32-bit float and a weight
    nearly exactly, so the cast back is the only rounding that matters.
    """
    import numpy as np

    return np.dtype(np.float64)
