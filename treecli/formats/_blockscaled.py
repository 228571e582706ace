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
``stored_form``); an FP8 weight whose values changed (an edit, an average) is quantized
to FP8 again, as transformers' FP8 quantizer quantizes; a cast asked for (``--dtype
bfloat16``), or a change of an MXFP4 weight, writes every such weight as plain values,
and the output's ``config.json`` then loses its ``quantization_config``.
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
    powers_of_two = isinstance(quantization, dict) and quantization.get("scale_fmt") == "ue8m0"
    named = dict(items)
    made: dict[str, tuple[str, Any]] = {}  # a stored name -> the logical name and leaf it becomes (None: gone)
    for name, leaf in items:
        if name.endswith(FP8_SCALES) and name[: -len(FP8_SCALES)] in named:
            weight_name = name[: -len(FP8_SCALES)]
            logical = _fp8(named[weight_name], leaf, block, dtype)
            if logical is not None:
                logical.powers_of_two = powers_of_two  # (its scales requantized as powers of two, as written)
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

    made = BlockScaledLeaf(weight.shape, dtype, compute, {"": weight, FP8_SCALES: scales}, f"FP8 {b0}x{b1}")
    made.block = (b0, b1)  # (its values, changed, are quantized in blocks of this size again)
    return made


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

    def values_of(e: int, first: int, last: int) -> Any:
        """Expert ``e``'s groups ``[first, last)`` as values, transposed: (inputs, rows). Only
        their bytes are read, so a chunk's memory is its own, whatever the expert's size."""
        import numpy as np

        raw = np.asarray(blocks.read((e, slice(None), slice(first, last)))).reshape(rows, last - first, 16)
        exponents = np.asarray(scales.read((e, slice(None), slice(first, last)))).astype(np.int32)
        table = np.asarray(_FP4_E2M1, np.float32)
        values = np.stack([table[raw & 0x0F], table[raw >> 4]], axis=-1).reshape(rows, last - first, 32)
        with np.errstate(all="ignore"):
            values = np.ldexp(values, exponents.reshape(rows, last - first, 1) - 127)  # (torch.ldexp's, bit for bit)
        return values.reshape(rows, (last - first) * 32).T.astype(_dtypes.numpy_dtype(dtype))

    def compute(start: int, stop: int) -> Any:
        import numpy as np

        pieces, at = [], start
        while at < stop:
            e, offset = divmod(at, slab)
            end = min(stop, (e + 1) * slab) - e * slab  # (this expert's part of the chunk)
            first, last = offset // rows // 32, -(-(-(-end // rows)) // 32)  # (the groups it covers)
            part = values_of(e, first, last).reshape(-1)
            pieces.append(part[offset - first * 32 * rows : end - first * 32 * rows])
            at = e * slab + end
        return np.concatenate(pieces) if len(pieces) != 1 else pieces[0].copy()

    return BlockScaledLeaf((experts, inputs, rows), dtype, compute, {MX_BLOCKS: blocks, MX_SCALES: scales}, "MXFP4")


class Written:
    """How an output writes the block-scaled weights of a tree: ``tree`` (each as its stored
    tensors, or as plain values), and how many weights of each scheme it writes plain
    (``plain``) and requantized (``requantized``: FP8 weights whose values changed)."""

    def __init__(self, tree: Any, plain: dict[str, int], requantized: dict[str, int]):
        self.tree, self.plain, self.requantized = tree, plain, requantized


def stored_form(tree: Any) -> Written:
    """``tree`` as an output writes it: each block-scaled leaf as its stored tensors (a copy
    keeps its blocks); an FP8 weight whose values a command changed (an edit, an average)
    quantized to FP8 again, in blocks of its own size, as transformers' FP8 quantizer does
    (each block's largest magnitude to 448). Anything else computed from a block-scaled
    weight (a cast a command was asked for, an MXFP4 weight changed, a shape that is no
    longer whole blocks) is written as plain values, and then so is every block-scaled
    weight (an output is either the stored scheme or plain weights, as its ``config.json``
    says)."""
    # each leaf that is, or is computed from, a block-scaled weight, with that weight
    sourced = [(leaf, leaf if isinstance(leaf, BlockScaledLeaf) else _origin(leaf)) for leaf in _array_leaves(tree)]
    sourced = [(leaf, origin) for leaf, origin in sourced if origin is not None]
    if any(leaf is not origin and _requantizable(leaf, origin) is None for leaf, origin in sourced):
        plain: dict[str, int] = {}
        for _, origin in sourced:
            plain[origin.scheme] = plain.get(origin.scheme, 0) + 1
        return Written(tree, plain, {})
    requantized: dict[str, int] = {}

    def expanded(node: Any) -> Any:
        if isinstance(node, dict):
            out: dict[Any, Any] = {}
            for key, value in node.items():
                parts = _parts(value, requantized) if isinstance(key, str) else None
                if parts is not None:
                    out.update({key + suffix: part for suffix, part in parts.items()})
                else:
                    out[key] = expanded(value)
            return out
        if isinstance(node, (list, tuple)) and type(node) in (list, tuple):
            return type(node)(expanded(value) for value in node)
        return node

    return Written(expanded(tree), {}, requantized)


def _parts(leaf: Any, requantized: dict[str, int]) -> dict[str, Any] | None:
    """The stored tensors a leaf is written as, by what each adds to its name; None: itself."""
    if isinstance(leaf, BlockScaledLeaf):
        return leaf.parts
    origin = _origin(leaf) if isinstance(leaf, _leaf.ArrayLeaf) else None
    block = _requantizable(leaf, origin) if origin is not None else None
    if block is None:
        return None
    requantized[origin.scheme] = requantized.get(origin.scheme, 0) + 1
    stored = origin.parts[FP8_SCALES].dtype_name  # (the scales written in the dtype they were read in)
    return _fp8_parts(leaf, block, getattr(origin, "powers_of_two", False) or stored == "uint8", stored)


def _requantizable(leaf: Any, origin: BlockScaledLeaf) -> tuple[int, int] | None:
    """The FP8 block an FP8 weight's changed values are quantized in again; None where they
    are written plain (a cast asked for, MXFP4, not whole blocks)."""
    block = getattr(origin, "block", None)
    if block is None or getattr(leaf, "asked_dtype", False) or leaf.ndim < 2 or not leaf.size or \
            leaf.shape[-2] % block[0] or leaf.shape[-1] % block[1] or not _dtypes.is_float(leaf.dtype_name):
        return None
    return block


def _fp8_parts(leaf: Any, block: tuple[int, int], powers_of_two: bool, scale_dtype: str) -> dict[str, Any]:
    """``leaf``'s values as FP8 blocks and their ``_scale_inv``, as transformers' ``Fp8Quantize``
    makes them: each block's scale 448 over its largest magnitude (1 for a block of zeros;
    ``powers_of_two``, a ``scale_fmt: ue8m0`` checkpoint's: its inverse rounded up to a power
    of two), the values times it clamped to E4M3's range and rounded; a band of
    ``block[0]`` rows at a time. The scales are of ``scale_dtype`` (``uint8``: E8M0 bytes)."""
    rows, cols = leaf.shape[-2:]
    held: dict[int, tuple[Any, Any]] = {}

    def band(index: int) -> tuple[Any, Any]:
        import ml_dtypes
        import numpy as np

        if index not in held:
            held.clear()
            values = np.asarray(leaf.read_flat(index * block[0] * cols, (index + 1) * block[0] * cols), np.float32)
            tiles = values.reshape(block[0], cols // block[1], block[1])
            largest = np.abs(tiles).max(axis=(0, 2))
            with np.errstate(all="ignore"):
                scales = np.where(largest > 0, np.float32(448.0) / np.where(largest > 0, largest, np.float32(1)),
                                  np.float32(1))
                inverse = np.float32(1) / scales
                if powers_of_two:
                    tiny = np.finfo(np.float32).tiny
                    inverse = np.exp2(np.ceil(np.log2(np.maximum(inverse, tiny)))).astype(np.float32)
                    scales = np.float32(1) / inverse
                scaled = np.clip(tiles * scales[None, :, None], np.float32(-448.0), np.float32(448.0))
            if scale_dtype == "uint8":  # (E8M0: the exponent, biased by 127)
                inverse = (np.log2(inverse) + np.float32(127)).astype(np.uint8)
            else:
                inverse = inverse.astype(_dtypes.numpy_dtype(scale_dtype))
            held[index] = (scaled.astype(ml_dtypes.float8_e4m3fn).reshape(-1), inverse)
        return held[index]

    def weight(start: int, stop: int) -> Any:
        import numpy as np

        span = block[0] * cols
        pieces = [band(i)[0][max(start - i * span, 0) : stop - i * span] for i in range(start // span, -(-stop // span))]
        return np.concatenate(pieces) if len(pieces) != 1 else pieces[0].copy()

    def scale(start: int, stop: int) -> Any:
        import numpy as np

        per_band = cols // block[1]
        return np.concatenate([band(i)[1] for i in range(start // per_band, -(-stop // per_band))])[
            start % per_band : start % per_band + stop - start]

    scale_shape = (*leaf.shape[:-2], rows // block[0], cols // block[1])
    return {"": _leaf.ComputedLeaf(leaf.shape, "float8_e4m3fn", weight, inputs=[leaf]),
            FP8_SCALES: _leaf.ComputedLeaf(scale_shape, scale_dtype, scale, inputs=[leaf])}


def _array_leaves(tree: Any) -> Any:
    from treecli import _tree

    return (leaf for leaf in _tree.leaves(tree) if isinstance(leaf, _leaf.ArrayLeaf))


def _origin(leaf: Any) -> BlockScaledLeaf | None:
    """The block-scaled weight a computed leaf reads (the first found), if it reads one."""
    pending = list(getattr(leaf, "inputs", ()))
    while pending:
        source = pending.pop()
        if isinstance(source, BlockScaledLeaf):
            return source
        pending.extend(getattr(source, "inputs", ()))
    return None
