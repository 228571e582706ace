"""llama.cpp's non-linear 4-bit types, written as its quantizer writes them without an
importance matrix (``quantize_iq4_nl`` and ``quantize_iq4_xs`` of ``ggml-quants.c``, what
llama-quantize runs; ``quantize_row_iq4_nl_ref`` tries one scale where ``quantize_iq4_nl``
tries 15, and writes other blocks): every block byte for byte, checked against blocks the C
code made (``tests/data/kquants/``). Each value is one of 16 levels (``kvalues_iq4nl``,
spaced unevenly) times its block's scale; the float32 operations run in the C code's
order on every block of a part at once, as ``_kquants`` runs the K-quants.
"""

from __future__ import annotations

from typing import Any

from treecli.formats._kquants import QK_K, _column_sum, _first_largest, _nearest_int

IQ4_NL_BYTES = 18  # d (float16), qs[16]: 32 values
IQ4_XS_BYTES = 136  # d (float16), scales_h (uint16), scales_l[4], qs[128]: 256 values
LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_WIDEST_GAP = 24  # between neighbouring levels (89 to 113): a scale's step, at most
_GROUP_MAX_EPS = 1e-15


def _best_index(values: Any) -> Any:
    """``best_index_int8(16, kvalues_iq4nl, x)`` for each value: the nearest level's index,
    a tie to the upper one; beyond the ends, the end."""
    import numpy as np

    levels = np.asarray(LEVELS, np.float32)
    upper = np.clip(np.searchsorted(levels, values, side="right"), 1, 15)  # (the first level above x)
    below, above = levels[upper - 1], levels[upper]
    index = np.where(values - below < above - values, upper - 1, upper)
    index = np.where(values <= levels[0], 0, np.where(values >= levels[15], 15, index))
    return np.where(np.isnan(values), 15, index)  # (NaN compares false everywhere: the search ends at 15)


def _fit(xt: Any, weights: Any, inverse: Any) -> tuple[Any, Any]:
    """For each group (a column), with levels picked at ``inverse`` * x: the sums
    ``sum(w*q*x)`` and ``sum(w*q*q)``, in the reference's order."""
    import numpy as np

    q = np.asarray(LEVELS, np.float32)[_best_index(xt * inverse)]
    wq = weights * q
    return _column_sum(wq * xt), _column_sum(wq * q)


def _block_scales(xt: Any, ntry: int) -> tuple[Any, Any]:
    """``quantize_row_iq4_nl_impl``'s first part for groups of 32 (columns of ``xt``): each
    group's scale, and which are empty (all below GROUP_MAX_EPS)."""
    import numpy as np

    f32 = np.float32
    weights = xt * xt
    biggest = xt.T[np.arange(xt.shape[1]), _first_largest(np.abs(xt.T))]
    empty = np.abs(biggest) < f32(_GROUP_MAX_EPS)
    safe = np.where(empty, f32(1), biggest)
    d = (-safe if ntry > 0 else safe) / f32(LEVELS[0])
    sumqx, sumq2 = _fit(xt, weights, f32(1) / d)
    d = np.where(sumq2 > 0, sumqx / np.where(sumq2 > 0, sumq2, f32(1)), f32(0))
    best = d * sumqx
    for step in range(-ntry, ntry + 1):
        sumqx, sumq2 = _fit(xt, weights, f32(step + LEVELS[0]) / safe)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = np.where(better, sumqx / np.where(sumq2 > 0, sumq2, f32(1)), d)
        best = np.where(better, d * sumqx, best)
    return np.where(empty, f32(0), d), empty


def _packed(levels: Any) -> Any:
    """Levels (0 to 15) of 32-value groups, two a byte: value j and j + 16 of each group."""
    import numpy as np

    groups = levels.reshape(-1, 2, 16).astype(np.uint8)
    return (groups[:, 0] | (groups[:, 1] << 4)).reshape(levels.shape[0], -1)


def quantize_iq4_nl(data: Any) -> Any:
    """``data`` (float32, a multiple of 32 values) as IQ4_NL blocks (18 bytes per 32 values):
    each block's scale the best of 15 tried, its levels those that scale picks."""
    import numpy as np

    f32 = np.float32
    with np.errstate(all="ignore"):
        xt = np.ascontiguousarray(np.asarray(data, f32).reshape(-1, 32).T)
        d, _ = _block_scales(xt, 7)
        levels = _best_index(xt * np.where(d != 0, f32(1) / np.where(d != 0, d, f32(1)), f32(0))).T
    out = np.zeros((xt.shape[1], IQ4_NL_BYTES), np.uint8)
    out[:, 0:2] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
    out[:, 2:] = _packed(levels)
    return out.reshape(-1)


def quantize_iq4_xs(data: Any) -> Any:
    """``data`` (float32, a multiple of 256 values) as IQ4_XS blocks (136 bytes per 256
    values): eight groups of 32, each with a 6-bit scale under the block's."""
    import numpy as np

    f32 = np.float32
    with np.errstate(all="ignore"):
        x = np.asarray(data, f32).reshape(-1, QK_K)
        blocks = x.shape[0]
        xt = np.ascontiguousarray(x.reshape(-1, 32).T)
        scales, _ = _block_scales(xt, 7)
        scales = scales.reshape(blocks, 8)
        max_scale = np.take_along_axis(scales, _first_largest(np.abs(scales))[:, None], axis=1)[:, 0]
        d = -max_scale / f32(32)
        inverse = np.where(d != 0, f32(1) / np.where(d != 0, d, f32(1)), f32(0))
        six = np.clip(_nearest_int(inverse[:, None] * scales), -32, 31)
        dl = d[:, None] * six.astype(np.float32)
        idl = np.where(dl != 0, f32(1) / np.where(dl != 0, dl, f32(1)), f32(0))
        levels = _best_index(x.reshape(blocks, 8, 32) * idl[:, :, None]).reshape(blocks, QK_K)
    six = (six + 32).astype(np.int64)
    out = np.zeros((blocks, IQ4_XS_BYTES), np.uint8)
    out[:, 0:2] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
    high = np.zeros(blocks, np.int64)
    for group in range(8):
        high |= (six[:, group] >> 4) << (2 * group)
    out[:, 2:4] = high.astype(np.uint16).reshape(-1, 1).view(np.uint8)
    out[:, 4:8] = ((six[:, 0::2] & 0xF) | ((six[:, 1::2] & 0xF) << 4)).astype(np.uint8)
    out[:, 8:] = _packed(levels)
    return out.reshape(-1)


def iq4_nl_steps(blocks: Any) -> Any:
    """Each 32-value block's widest step between neighbouring levels, of IQ4_NL blocks."""
    import numpy as np

    d = np.asarray(blocks, np.uint8).reshape(-1, IQ4_NL_BYTES)[:, 0:2].copy().view(np.float16).astype(np.float32)
    return np.abs(d[:, 0]) * np.float32(_WIDEST_GAP)


def iq4_xs_steps(blocks: Any) -> Any:
    """Each 32-value group's widest step between neighbouring levels, of IQ4_XS blocks."""
    import numpy as np

    blocks = np.asarray(blocks, np.uint8).reshape(-1, IQ4_XS_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    high = blocks[:, 2:4].copy().view(np.uint16).astype(np.int64)
    low = np.stack([blocks[:, 4 + g // 2] >> (4 * (g % 2)) & 0xF for g in range(8)], axis=1).astype(np.int64)
    six = low | (((high >> (2 * np.arange(8))) & 3) << 4)
    return (np.abs(d * (six - 32).astype(np.float32)) * np.float32(_WIDEST_GAP)).reshape(-1)
