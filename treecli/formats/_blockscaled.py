"""Block-quantized Hugging Face checkpoints read as the weights they are, as transformers
dequantizes them:

- FP8 with block scales (DeepSeek-V3, Qwen3-FP8): ``X.weight`` in ``float8_e4m3fn`` and
  ``X.weight_scale_inv`` of one scale per block (128x128: ``config.json``'s
  ``quantization_config.weight_block_size``, else the scales' grid), read as ``X.weight``
  = weight x scale, computed in float32 and rounded to the model's dtype (its
  ``config.json`` ``dtype``, else bfloat16): transformers' ``Fp8Dequantize``.
- MXFP4 (gpt-oss): ``X_blocks`` (experts, rows, groups, 16 bytes: two FP4 E2M1 values a
  byte, the low nibble first) and ``X_scales`` (an E8M0 exponent per 32 values), read as
  ``X`` = value x 2^(scale - 127), each expert's matrix transposed (experts, inputs,
  outputs): transformers' ``convert_moe_packed_tensors``.

A copy writes such a leaf as it is stored (its parts, under their own names:
``stored_form``); a leaf computed from one (an edit of its values, an average) and
every leaf an output casts (``--dtype bfloat16``) is written as plain weights, and the
output's ``config.json`` then loses its ``quantization_config``.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

from treecli import _dtypes, _leaf

FP8_SCALES = "_scale_inv"  # X.weight + X.weight_scale_inv
MX_BLOCKS, MX_SCALES = "_blocks", "_scales"  # X_blocks + X_scales
_FP8 = ("float8_e4m3fn", "float8_e5m2")
_FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_LOGICAL = ("bfloat16", "float16", "float32")


class BlockScaledLeaf(_leaf.ComputedLeaf):
    """A weight stored as quantized blocks and their scales (``parts``: each stored tensor
    by what its name adds to the weight's: ``""`` and ``"_scale_inv"``), read as its values."""

    stored_otherwise = True

    def __init__(self, shape: tuple[int, ...], dtype: str, compute: Callable[[int, int], Any],
                 parts: dict[str, _leaf.ArrayLeaf], scheme: str):
        super().__init__(shape, dtype, compute, inputs=list(parts.values()))
        self.parts, self.scheme = parts, scheme

    @property
    def stored_dtype(self) -> str:
        return self.scheme

    @property
    def stored_nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts.values())


def wanted(names: Any) -> bool:
    """Whether a checkpoint of these tensor names may hold block-scaled weights (only then
    is its ``config.json`` read)."""
    return any(name.endswith(FP8_SCALES) or name.endswith(MX_SCALES) for name in names)


def logical_items(items: list[tuple[str, Any]], config_text: str | None) -> list[tuple[str, Any]]:
    """``items`` (tensor name, leaf) with each block-scaled weight's stored tensors replaced
    by one leaf of its values, where the weight's, or the blocks', stood; any pair that is
    not one (dtypes, shapes that do not fit) left as it is."""
    config = _config(config_text)
    dtype = config.get("dtype") or config.get("torch_dtype")
    dtype = dtype if dtype in _LOGICAL else "bfloat16"
    quantization = config.get("quantization_config")
    block = quantization.get("weight_block_size") if isinstance(quantization, dict) else None
    named = dict(items)
    made: dict[str, tuple[str, Any]] = {}  # a stored name -> the logical name and leaf it becomes (None: gone)
    for name, leaf in items:
        if name.endswith(FP8_SCALES) and name[: -len(FP8_SCALES)] in named:
            weight_name = name[: -len(FP8_SCALES)]
            logical = _fp8(named[weight_name], leaf, block, dtype)
            if logical is not None:
                made[weight_name], made[name] = (weight_name, logical), (name, None)
        elif name.endswith(MX_BLOCKS) and name[: -len(MX_BLOCKS)] + MX_SCALES in named:
            base = name[: -len(MX_BLOCKS)]
            logical = _mxfp4(leaf, named[base + MX_SCALES], dtype)
            if logical is not None:
                made[name], made[base + MX_SCALES] = (base, logical), (base + MX_SCALES, None)
    out = []
    for name, leaf in items:
        new_name, new_leaf = made.get(name, (name, leaf))
        if new_leaf is not None:
            out.append((new_name, new_leaf))
    return out


def _config(text: str | None) -> dict:
    try:
        config = json.loads(text) if text else {}
    except ValueError:
        return {}
    return config if isinstance(config, dict) else {}


def _fp8(weight: Any, scales: Any, block: Any, dtype: str) -> BlockScaledLeaf | None:
    """``weight`` (FP8, (..., rows, cols)) times its block ``scales`` (..., rows/b0, cols/b1)."""
    if weight.dtype_name not in _FP8 or scales.dtype_name not in ("float32", "bfloat16", "float16", "uint8") or \
            weight.ndim < 2 or scales.ndim != weight.ndim or weight.shape[:-2] != scales.shape[:-2]:
        return None
    (rows, cols), (scale_rows, scale_cols) = weight.shape[-2:], scales.shape[-2:]
    if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
        b0, b1 = block
    elif scale_rows and scale_cols and not rows % scale_rows and not cols % scale_cols:
        b0, b1 = rows // scale_rows, cols // scale_cols  # (the scales' grid, as transformers takes it)
    else:
        return None
    if (-(-rows // b0), -(-cols // b1)) != (scale_rows, scale_cols) or not rows or not cols:
        return None
    lead = math.prod(weight.shape[:-2])
    held: list[Any] = []

    def compute(start: int, stop: int) -> Any:
        import numpy as np

        if not held:  # (the scales: a 16,384th of the weights, read once)
            held.append(_scale_values(scales).reshape(lead * scale_rows, scale_cols))
        first, last = start // cols, -(-stop // cols)
        values = weight.read_flat(first * cols, last * cols).astype(np.float32).reshape(last - first, cols)
        row = np.arange(first, last)
        per_value = np.repeat(held[0][(row // rows) * scale_rows + (row % rows) // b0], b1, axis=1)[:, :cols]
        with np.errstate(all="ignore"):
            out = (values * per_value).astype(_dtypes.numpy_dtype(dtype))
        return out.reshape(-1)[start - first * cols : stop - first * cols]

    return BlockScaledLeaf(weight.shape, dtype, compute, {"": weight, FP8_SCALES: scales}, f"FP8 {b0}x{b1}")


def _scale_values(scales: Any) -> Any:
    """Block scales as float32: E8M0 bytes (MXFP8's) as 2^(byte - 127), as transformers reads them."""
    import numpy as np

    values = np.asarray(scales.read_flat(0, scales.size))
    if values.dtype == np.uint8:
        return np.exp2(values.astype(np.float32) - np.float32(127))
    return values.astype(np.float32)


def _mxfp4(blocks: Any, scales: Any, dtype: str) -> BlockScaledLeaf | None:
    """gpt-oss's experts: ``blocks`` (experts, rows, groups, 16) and ``scales`` (experts, rows,
    groups), read as (experts, groups x 32, rows)."""
    if blocks.dtype_name != "uint8" or scales.dtype_name != "uint8" or blocks.ndim != 4 or blocks.shape[-1] != 16 \
            or scales.shape != blocks.shape[:-1]:
        return None
    experts, rows, groups, _ = blocks.shape
    inputs = groups * 32
    slab = inputs * rows
    held: dict[int, Any] = {}  # the expert last made: a chunk reads within one or two

    def expert(e: int) -> Any:
        import numpy as np

        if e not in held:
            held.clear()
            raw = np.asarray(blocks.read((e,))).reshape(rows, groups, 16)
            exponents = np.asarray(scales.read((e,))).astype(np.int32).reshape(rows, groups, 1) - 127
            table = np.asarray(_FP4_E2M1, np.float32)
            values = np.stack([table[raw & 0x0F], table[raw >> 4]], axis=-1).reshape(rows, groups, 32)
            with np.errstate(all="ignore"):
                values = np.ldexp(values, exponents)  # (torch.ldexp's values, bit for bit)
            held[e] = np.ascontiguousarray(values.reshape(rows, inputs).T.astype(_dtypes.numpy_dtype(dtype)))
        return held[e]

    def compute(start: int, stop: int) -> Any:
        import numpy as np

        pieces, at = [], start
        while at < stop:
            e, offset = divmod(at, slab)
            end = min(stop, (e + 1) * slab)
            pieces.append(expert(e).reshape(-1)[offset : offset + end - at])
            at = end
        return np.concatenate(pieces) if len(pieces) != 1 else pieces[0].copy()

    return BlockScaledLeaf((experts, inputs, rows), dtype, compute, {MX_BLOCKS: blocks, MX_SCALES: scales}, "MXFP4")


def stored_form(tree: Any) -> tuple[Any, dict[str, int]]:
    """``tree`` as an output writes it: each block-scaled leaf as its stored tensors (a copy
    keeps its blocks), unless some leaf computed from one (an edit of its values, an
    average, a cast) is in it: then every such weight is written as plain values (an
    output is either the stored scheme or plain weights, as its ``config.json`` says).
    Also returns how many weights of each scheme are written as plain values."""
    dequantized: dict[str, int] = {}
    for leaf in _array_leaves(tree):
        if not isinstance(leaf, BlockScaledLeaf):
            origin = _scheme_of(leaf)
            if origin is not None:
                dequantized[origin] = dequantized.get(origin, 0) + 1
    plain = bool(dequantized)

    def expanded(node: Any) -> Any:
        if isinstance(node, dict):
            out: dict[Any, Any] = {}
            for key, value in node.items():
                if isinstance(value, BlockScaledLeaf) and not plain and isinstance(key, str):
                    out.update({key + suffix: part for suffix, part in value.parts.items()})
                else:
                    out[key] = expanded(value)
            return out
        if isinstance(node, (list, tuple)) and type(node) in (list, tuple):
            return type(node)(expanded(value) for value in node)
        if isinstance(node, BlockScaledLeaf):
            dequantized[node.scheme] = dequantized.get(node.scheme, 0) + 1
        return node

    if plain:
        for leaf in _array_leaves(tree):
            if isinstance(leaf, BlockScaledLeaf):
                dequantized[leaf.scheme] = dequantized.get(leaf.scheme, 0) + 1
        return tree, dequantized
    return expanded(tree), dequantized


def _array_leaves(tree: Any) -> Any:
    from treecli import _tree

    return (leaf for leaf in _tree.leaves(tree) if isinstance(leaf, _leaf.ArrayLeaf))


def _scheme_of(leaf: Any) -> str | None:
    """The scheme of the block-scaled weights a computed leaf reads, if it reads any."""
    pending = list(getattr(leaf, "inputs", ()))
    while pending:
        source = pending.pop()
        if isinstance(source, BlockScaledLeaf):
            return source.scheme
        pending.extend(getattr(source, "inputs", ()))
    return None
