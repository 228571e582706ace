"""llama.cpp's K-quants, written as its reference quantizers write them (``ggml-quants.c``'s
``quantize_row_q6_K_ref``, ``quantize_row_q5_K_ref`` and ``quantize_row_q4_K_ref``, no
importance matrix): every block byte for byte, checked against blocks the C reference
made (``tests/data/kquants/``, and the script that made them).

The reference works one group of 16 or 32 values at a time in float32; here the same
float32 operations run on every group of a part of a tensor at once, in the reference's
order (sums added term by term, never pairwise; ``nearest_int``'s own bit trick), so that
the bits agree.
"""

from __future__ import annotations

from typing import Any

QK_K = 256  # values in a K-quant super-block
Q6_K_BYTES = 210  # ql[128], qh[64], scales[16] (int8), d (float16)
Q4_K_BYTES = 144  # d, dmin (float16), scales[12] (6-bit scales and mins), qs[128]
Q5_K_BYTES = 176  # Q4_K's, with qh[32] (each level's fifth bit) before qs
_GROUP_MAX_EPS = 1e-15


def quantize_q6_k(data: Any) -> Any:
    """``data`` (float32, a multiple of 256 values, row by row) as Q6_K blocks (uint8,
    210 bytes per 256 values). Inf and NaN go through as the reference's arithmetic takes
    them, without floating-point warnings."""
    return _on_every_core(_q6_k, data)


_PART = 1024  # super-blocks quantized at once: 256K values, their temporaries a few MiB


def _on_every_core(quantize: Any, data: Any) -> Any:
    """``quantize`` of ``data``'s super-blocks, a part of 256K values at a time (the
    temporaries of a whole embedding would take gigabytes) on every core (NumPy lets go of
    the GIL), the blocks joined in order: each super-block is quantized alone."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    flat = np.ascontiguousarray(data, np.float32).reshape(-1, QK_K)
    parts = [flat[start : start + _PART] for start in range(0, flat.shape[0], _PART)]

    def run(part: Any) -> Any:
        with np.errstate(all="ignore"):
            return quantize(part)

    if len(parts) == 1:
        return run(flat)
    with ThreadPoolExecutor(min(len(parts), os.cpu_count() or 1)) as pool:
        return np.concatenate(list(pool.map(run, parts)))


def _q6_k(data: Any) -> Any:
    import numpy as np

    f32 = np.float32
    x = data.reshape(-1, QK_K // 16, 16)  # (blocks, groups, 16)
    blocks = x.shape[0]
    scales, levels = _make_qx_quants(x.reshape(-1, 16), 32)
    scales = scales.reshape(blocks, QK_K // 16)
    levels = levels.reshape(blocks, QK_K // 16, 16)
    # the block's scale: the group scale of largest magnitude (the first, as the C loop keeps it)
    max_scale = np.take_along_axis(scales, _first_largest(np.abs(scales))[:, None], axis=1)[:, 0]
    empty = np.abs(max_scale) < f32(_GROUP_MAX_EPS)
    iscale = np.where(empty, f32(0), f32(-128) / np.where(empty, f32(1), max_scale))
    d = np.where(empty, f32(0), f32(1) / np.where(empty, f32(1), iscale)).astype(np.float16)
    group_scales = np.minimum(127, _nearest_int(iscale[:, None] * scales)).astype(np.int8)
    step = d.astype(np.float32)[:, None] * group_scales.astype(np.float32)  # (blocks, groups)
    quantized = np.clip(_nearest_int(x / np.where(step == 0, f32(1), step)[:, :, None]), -32, 31) + 32
    levels = np.where((step != 0)[:, :, None], quantized, levels).reshape(blocks, QK_K).astype(np.uint8)
    out = np.zeros((blocks, Q6_K_BYTES), np.uint8)
    for half in range(2):  # each 128 values: ql 64 bytes, qh 32 bytes
        part = levels[:, 128 * half : 128 * (half + 1)].reshape(blocks, 4, 32)
        out[:, 64 * half : 64 * half + 32] = (part[:, 0] & 0xF) | ((part[:, 2] & 0xF) << 4)
        out[:, 64 * half + 32 : 64 * half + 64] = (part[:, 1] & 0xF) | ((part[:, 3] & 0xF) << 4)
        out[:, 128 + 32 * half : 128 + 32 * (half + 1)] = (part[:, 0] >> 4) | ((part[:, 1] >> 4) << 2) | \
            ((part[:, 2] >> 4) << 4) | ((part[:, 3] >> 4) << 6)
    out[:, 192:208] = np.where(empty[:, None], 0, group_scales).astype(np.int8).view(np.uint8)
    out[:, 208:210] = d.reshape(-1, 1).view(np.uint8)
    out[empty, :208] = 0
    return out.reshape(-1)


def q6_k_steps(blocks: Any) -> Any:
    """Each 16-value group's quantization step, ``d * scale``, of Q6_K blocks."""
    import numpy as np

    blocks = np.asarray(blocks, np.uint8).reshape(-1, Q6_K_BYTES)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    return np.abs(d * blocks[:, 192:208].copy().view(np.int8).astype(np.float32)).reshape(-1)


def _nearest_int(values: Any) -> Any:
    """ggml's ``nearest_int``, its very bits: 1.5 * 2^23 added in float32 (rounding half to
    even) and the low mantissa bits read as the integer; so that Inf and NaN give what the
    reference gives too."""
    import numpy as np

    shifted = (np.asarray(values, np.float32) + np.float32(12582912.0)).view(np.int32)
    return (shifted & 0x007FFFFF) - 0x00400000


def _sequential_sum(terms: Any) -> Any:
    """Each row's sum added term by term from the first, as the reference's loops add
    (``np.add.accumulate`` adds in order; a reduction would add pairwise, rounding otherwise)."""
    import numpy as np

    return np.add.accumulate(terms, axis=1, dtype=np.float32)[:, -1]


def _first_largest(magnitudes: Any) -> Any:
    """The index of each row's largest value, the first of equals, NaN never (the reference's
    ``if (ax > amax)`` is false for NaN)."""
    import numpy as np

    return np.where(np.isnan(magnitudes), -1, magnitudes).argmax(axis=1)


def _make_qx_quants(x: Any, nmax: int) -> tuple[Any, Any]:
    """``make_qx_quants(16, nmax, x, L, rmse_type=1, NULL)`` for each row of ``x`` (groups of
    16): each group's scale (float32) and levels (``l + nmax``), the search over 19
    candidate scales run as the reference runs it."""
    import numpy as np

    f32 = np.float32
    groups, n = x.shape
    first = _first_largest(np.abs(x))
    biggest = x[np.arange(groups), first]
    empty = np.abs(biggest) < f32(_GROUP_MAX_EPS)
    safe = np.where(empty, f32(1), biggest)
    weights = x * x

    def attempt(iscale):
        levels = np.clip(_nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
        as_float = levels.astype(np.float32)
        return levels, _sequential_sum(weights * x * as_float), _sequential_sum(weights * as_float * as_float)

    levels, sumlx, suml2 = attempt(f32(-nmax) / safe)
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, f32(1)), f32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        tried, sumlx, suml2 = attempt(-(f32(nmax) + f32(0.1) * f32(step)) / safe)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        levels = np.where(better[:, None], tried, levels)
        scale = np.where(better, sumlx / np.where(suml2 > 0, suml2, f32(1)), scale)
        best = np.where(better, scale * sumlx, best)
    levels = np.where(empty[:, None], 0, levels + nmax)
    return np.where(empty, f32(0), scale), levels


def quantize_q4_k(data: Any) -> Any:
    """``data`` (float32, a multiple of 256 values) as Q4_K blocks (uint8, 144 bytes per 256
    values): eight groups of 32, each a 4-bit level with a 6-bit scale and min."""
    return _on_every_core(_q4_k, data)


def quantize_q5_k(data: Any) -> Any:
    """``data`` (float32, a multiple of 256 values) as Q5_K blocks (uint8, 176 bytes per 256
    values): Q4_K's layout with a fifth bit of each level in ``qh``."""
    return _on_every_core(_q5_k, data)


def _q4_k(data: Any) -> Any:
    import numpy as np

    d, dmin, packed, levels = _with_mins(data, 15, -1.0, 20)
    out = np.zeros((levels.shape[0], Q4_K_BYTES), np.uint8)
    out[:, 0:2], out[:, 2:4], out[:, 4:16] = d, dmin, packed
    for chunk in range(4):  # each 64 values: 32 bytes, the first 32 in the low nibbles
        part = levels[:, 64 * chunk : 64 * (chunk + 1)]
        out[:, 16 + 32 * chunk : 16 + 32 * (chunk + 1)] = part[:, :32] | (part[:, 32:] << 4)
    return out.reshape(-1)


def _q5_k(data: Any) -> Any:
    import numpy as np

    d, dmin, packed, levels = _with_mins(data, 31, -0.5, 15)
    out = np.zeros((levels.shape[0], Q5_K_BYTES), np.uint8)
    out[:, 0:2], out[:, 2:4], out[:, 4:16] = d, dmin, packed
    high = np.zeros((levels.shape[0], 32), np.uint8)
    for chunk in range(4):  # each 64 values: their low nibbles in 32 bytes, their fifth bits in qh
        part = levels[:, 64 * chunk : 64 * (chunk + 1)]
        high |= ((part[:, :32] >> 4) << (2 * chunk)).astype(np.uint8)
        high |= ((part[:, 32:] >> 4) << (2 * chunk + 1)).astype(np.uint8)
        out[:, 48 + 32 * chunk : 48 + 32 * (chunk + 1)] = (part[:, :32] & 0xF) | ((part[:, 32:] & 0xF) << 4)
    out[:, 16:48] = high
    return out.reshape(-1)


def _with_mins(data: Any, nmax: int, rmin: float, nstep: int) -> tuple[Any, Any, Any, Any]:
    """What Q4_K and Q5_K share (``quantize_row_q{4,5}_K_ref``): per super-block its scale
    and min as float16 bytes, the 6-bit scales and mins of its eight groups of 32 packed in
    12 bytes, and each value's level (0 to ``nmax``)."""
    import numpy as np

    f32 = np.float32
    x = data.reshape(-1, 8, 32)
    blocks = x.shape[0]
    groups = x.reshape(-1, 32)
    weights = np.sqrt(_sequential_sum(groups * groups) / f32(32))[:, None] + np.abs(groups)
    scales, mins, levels = _make_qkx2_quants(groups, weights, nmax, f32(rmin), f32(0.1), nstep)
    scales, mins = scales.reshape(blocks, 8), mins.reshape(blocks, 8)
    levels = levels.reshape(blocks, 8, 32)
    max_scale = np.maximum(scales.max(axis=1), f32(0))  # (the C loop keeps the largest above 0)
    max_min = np.maximum(mins.max(axis=1), f32(0))
    inv_scale = np.where(max_scale > 0, f32(63) / np.where(max_scale > 0, max_scale, f32(1)), f32(0))
    inv_min = np.where(max_min > 0, f32(63) / np.where(max_min > 0, max_min, f32(1)), f32(0))
    # (uint8_t ls = nearest_int(...): the int's low byte, then at most 63)
    ls = np.minimum(63, _nearest_int(inv_scale[:, None] * scales) & 0xFF)
    lm = np.minimum(63, _nearest_int(inv_min[:, None] * mins) & 0xFF)
    packed = np.zeros((blocks, 12), np.int32)
    packed[:, 0:4] = ls[:, 0:4]
    packed[:, 4:8] = lm[:, 0:4]
    packed[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    packed[:, 0:4] |= (ls[:, 4:8] >> 4) << 6
    packed[:, 4:8] |= (lm[:, 4:8] >> 4) << 6
    d = (max_scale / f32(63)).astype(np.float16)
    dmin = (max_min / f32(63)).astype(np.float16)
    step = d.astype(np.float32)[:, None] * ls.astype(np.float32)
    shift = dmin.astype(np.float32)[:, None] * lm.astype(np.float32)
    quantized = np.clip(_nearest_int((x + shift[:, :, None]) / np.where(step == 0, f32(1), step)[:, :, None]),
                        0, nmax)
    levels = np.where((step != 0)[:, :, None], quantized, levels).reshape(blocks, 256)
    return (d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), packed.astype(np.uint8),
            levels.astype(np.uint8))


def q4_k_steps(blocks: Any, size: int = 0) -> Any:
    """Each 32-value group's quantization step, ``d * scale``, of Q4_K blocks (or of Q5_K
    blocks, of ``size`` 176: their first 16 bytes are laid out alike)."""
    import numpy as np

    blocks = np.asarray(blocks, np.uint8).reshape(-1, size or Q4_K_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 4:16].astype(np.int32)
    scales = np.concatenate([q[:, 0:4] & 63, (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)], axis=1)
    return np.abs(d * scales.astype(np.float32)).reshape(-1)


def _make_qkx2_quants(x: Any, weights: Any, nmax: int, rmin: Any, rdelta: Any, nstep: int
                      ) -> tuple[Any, Any, Any]:
    """``make_qkx2_quants(32, nmax, x, weights, L, &min, Laux, rmin, rdelta, nstep, false)`` for
    each row of ``x``: its scale, its min (as the reference returns it: ``-min``) and levels."""
    import numpy as np

    f32 = np.float32
    groups, n = x.shape
    low, high = x[:, 0].copy(), x[:, 0].copy()
    for i in range(1, n):  # (as the reference compares: a NaN never becomes the min or max)
        low = np.where(x[:, i] < low, x[:, i], low)
        high = np.where(x[:, i] > high, x[:, i], high)
    sum_w = _sequential_sum(weights)
    sum_x = _sequential_sum(weights * x)
    low = np.where(low > 0, f32(0), low)
    flat = high == low
    span = np.where(flat, f32(1), high - low)
    iscale = f32(nmax) / span
    scale = f32(1) / iscale
    levels = np.clip(_nearest_int(iscale[:, None] * (x - low[:, None])), 0, nmax)
    diff = scale[:, None] * levels.astype(np.float32) + low[:, None] - x
    best = _sequential_sum(weights * (diff * diff))
    for step in range(nstep + 1):  # (``min`` moves as better fits are found: so does ``max - min``)
        iscale = (rmin + rdelta * f32(step) + f32(nmax)) / np.where(flat, f32(1), high - low)
        tried = np.clip(_nearest_int(iscale[:, None] * (x - low[:, None])), 0, nmax)
        as_float = tried.astype(np.float32)
        weighted = weights * as_float
        sum_l, sum_l2, sum_xl = (_sequential_sum(weighted), _sequential_sum(weighted * as_float),
                                 _sequential_sum(weighted * x))
        determinant = sum_w * sum_l2 - sum_l * sum_l
        solvable = determinant > 0
        safe = np.where(solvable, determinant, f32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        clamped = this_min > 0
        this_min = np.where(clamped, f32(0), this_min)
        this_scale = np.where(clamped, sum_xl / np.where(sum_l2 != 0, sum_l2, f32(1)), this_scale)
        diff = this_scale[:, None] * as_float + this_min[:, None] - x
        error = _sequential_sum(weights * (diff * diff))
        better = solvable & (error < best)
        levels = np.where(better[:, None], tried, levels)
        best = np.where(better, error, best)
        scale = np.where(better, this_scale, scale)
        low = np.where(better, this_min, low)
    levels = np.where(flat[:, None], 0, levels)
    return np.where(flat, f32(0), scale), -low, levels
