"""llama.cpp's K-quants, written as its reference quantizers write them (``ggml-quants.c``'s
``quantize_row_q{6,5,4,3,2}_K_ref``, no importance matrix): every block byte for byte, checked against blocks the C reference
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
Q3_K_BYTES = 110  # hmask[32] (each level's third bit), qs[64], scales[12] (6-bit), d (float16)
Q2_K_BYTES = 84  # scales[16] (4-bit scale and min), qs[64], d, dmin (float16)
_GROUP_MAX_EPS = 1e-15


def quantize_q6_k(data: Any) -> Any:
    """``data`` (float32, a multiple of 256 values, row by row) as Q6_K blocks (uint8,
    210 bytes per 256 values). Inf and NaN go through as the reference's arithmetic takes
    them, without floating-point warnings."""
    return _on_every_core(_q6_k, data)


_PART = 1024  # super-blocks quantized at once: 256K values, their temporaries a few MiB


def _on_every_core(quantize: Any, data: Any) -> Any:
    """``quantize`` of ``data``'s super-blocks, a part of 256K values at a time (the
    temporaries of a whole embedding would take gigabytes) on every core, the blocks
    joined in order: each super-block is quantized alone."""
    import numpy as np

    flat = np.ascontiguousarray(data, np.float32).reshape(-1, QK_K)
    return np.concatenate(on_every_core(quantize, [flat[start : start + _PART]
                                                   for start in range(0, flat.shape[0], _PART)]))


def on_every_core(work: Any, parts: list) -> list:
    """``work`` of each part, in order, on every core (NumPy lets go of the GIL in each
    whole-array operation), without floating-point warnings (Inf and NaN go through as the
    reference's arithmetic takes them)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    def run(part: Any) -> Any:
        with np.errstate(all="ignore"):
            return work(part)

    if len(parts) <= 1:
        return [run(part) for part in parts]
    with ThreadPoolExecutor(min(len(parts), os.cpu_count() or 1)) as pool:
        return list(pool.map(run, parts))


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
    """Each row's sum added term by term from the first, as the reference's loops add (a
    reduction would add pairwise, rounding otherwise)."""
    import numpy as np

    return _column_sum(np.ascontiguousarray(np.asarray(terms, np.float32).T))


def _column_sum(columns: Any) -> Any:
    """Each column's sum, the rows added one at a time from the first (each group's terms
    in the reference's order). NumPy's reduction over the first axis of a C-ordered array
    of several columns adds so, a row at a time into the sums (it adds pairwise only along
    the contiguous axis: a single column's rows, summed here one at a time instead)."""
    import numpy as np

    if columns.ndim == 2 and columns.shape[1] >= 8 and columns.flags.c_contiguous:
        return np.add.reduce(columns, axis=0)
    total = columns[0].copy()
    for row in columns[1:]:
        total += row
    return total


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
    xt = np.ascontiguousarray(x.T, f32)  # (the groups side by side, as in _make_qkx2_quants)
    weights = xt * xt
    weighted_x = weights * xt  # (w * x, the first product of the reference's w*x[i]*l)
    work, as_float = np.empty_like(xt), np.empty_like(xt)

    def levels_at(iscale: Any) -> Any:
        """``MAX(-nmax, MIN(nmax - 1, nearest_int(iscale * x)))`` (int32, in ``work``'s memory)."""
        np.multiply(xt, iscale, out=work)
        np.add(work, f32(12582912.0), out=work)  # (nearest_int's bits, as _nearest_int)
        levels = work.view(np.int32)
        levels &= 0x007FFFFF
        levels -= 0x00400000
        np.clip(levels, -nmax, nmax - 1, out=levels)
        return levels

    def attempt(iscale):
        np.copyto(as_float, levels_at(iscale), casting="unsafe")
        np.multiply(weighted_x, as_float, out=work)
        sumlx = _column_sum(work)
        np.multiply(weights, as_float, out=work)
        np.multiply(work, as_float, out=work)
        return sumlx, _column_sum(work)

    # (the levels a group keeps are made again from the scale that fit best, once all are tried)
    best_iscale = f32(-nmax) / safe
    sumlx, suml2 = attempt(best_iscale)
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, f32(1)), f32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(f32(nmax) + f32(0.1) * f32(step)) / safe
        sumlx, suml2 = attempt(iscale)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        best_iscale = np.where(better, iscale, best_iscale)
        scale = np.where(better, sumlx / np.where(suml2 > 0, suml2, f32(1)), scale)
        best = np.where(better, scale * sumlx, best)
    levels = np.where(empty, 0, levels_at(best_iscale) + nmax).T
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


def _make_qkx2_quants(x: Any, weights: Any, nmax: int, rmin: Any, rdelta: Any, nstep: int, use_mad: bool = False
                      ) -> tuple[Any, Any, Any]:
    """``make_qkx2_quants(n, nmax, x, weights, L, &min, Laux, rmin, rdelta, nstep, use_mad)`` for
    each row of ``x``: its scale, its min (as the reference returns it: ``-min``) and levels.
    ``use_mad``: errors weighed by their magnitude, not their square.

    The groups lie side by side (each value's place a row of all groups' values at that
    place), so that a group's sums add one row at a time in the reference's order, and
    each step's arithmetic runs in buffers made once."""
    import numpy as np

    f32 = np.float32
    xt, wt = np.ascontiguousarray(x.T, f32), np.ascontiguousarray(weights.T, f32)
    low, high = xt[0].copy(), xt[0].copy()
    for row in xt[1:]:  # (as the reference compares: a NaN never becomes the min or max)
        np.copyto(low, row, where=row < low)
        np.copyto(high, row, where=row > high)
    sum_w, sum_x = _column_sum(wt), _column_sum(wt * xt)
    low = np.where(low > 0, f32(0), low)
    flat = high == low
    iscale = f32(nmax) / np.where(flat, f32(1), high - low)
    scale = f32(1) / iscale
    work, weighted, tried, levels = (np.empty_like(xt) for _ in range(4))

    def levels_at(iscale: Any, out: Any) -> None:
        """``MAX(0, MIN(nmax, nearest_int(iscale * (x - min))))``, as float32, into ``out``."""
        np.subtract(xt, low, out=work)
        np.multiply(work, iscale, out=work)
        np.add(work, f32(12582912.0), out=work)  # (nearest_int's bits, as _nearest_int)
        bits = work.view(np.int32)
        bits &= 0x007FFFFF
        bits -= 0x00400000
        np.clip(bits, 0, nmax, out=bits)
        np.copyto(out, bits, casting="unsafe")

    def error_of(scale: Any, minimum: Any, levels: Any) -> Any:
        """Each group's ``sum(w * |diff|)`` (or ``w * diff * diff``), ``diff = scale * l + min - x``."""
        np.multiply(levels, scale, out=work)
        np.add(work, minimum, out=work)
        np.subtract(work, xt, out=work)
        if use_mad:
            np.abs(work, out=work)
        else:
            np.multiply(work, work, out=work)
        np.multiply(work, wt, out=work)
        return _column_sum(work)

    levels_at(iscale, levels)
    best = error_of(scale, low, levels)
    # the levels a group keeps are those of the step that fit best: made again from that step's
    # iscale and min once all are tried (cheaper than keeping them step by step)
    best_iscale, best_low = iscale, low
    for step in range(nstep + 1):  # (``min`` moves as better fits are found: so does ``max - min``)
        iscale = (rmin + rdelta * f32(step) + f32(nmax)) / np.where(flat, f32(1), high - low)
        levels_at(iscale, tried)
        np.multiply(wt, tried, out=weighted)
        sum_l = _column_sum(weighted)
        np.multiply(weighted, tried, out=work)
        sum_l2 = _column_sum(work)
        np.multiply(weighted, xt, out=work)
        sum_xl = _column_sum(work)
        determinant = sum_w * sum_l2 - sum_l * sum_l
        solvable = determinant > 0
        safe = np.where(solvable, determinant, f32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        clamped = this_min > 0
        this_min = np.where(clamped, f32(0), this_min)
        this_scale = np.where(clamped, sum_xl / np.where(sum_l2 != 0, sum_l2, f32(1)), this_scale)
        error = error_of(this_scale, this_min, tried)
        better = solvable & (error < best)
        best_iscale, best_low = np.where(better, iscale, best_iscale), np.where(better, low, best_low)
        best = np.where(better, error, best)
        scale = np.where(better, this_scale, scale)
        low = np.where(better, this_min, low)
    low, final_min = best_low, low
    levels_at(best_iscale, levels)
    levels = np.where(flat, 0, levels.astype(np.int32)).T
    return np.where(flat, f32(0), scale), -final_min, levels


def quantize_q3_k(data: Any) -> Any:
    """``data`` (float32, a multiple of 256 values) as Q3_K blocks (uint8, 110 bytes per 256
    values): sixteen groups of 16, each a 3-bit level with a 6-bit signed scale."""
    return _on_every_core(_q3_k, data)


def quantize_q2_k(data: Any) -> Any:
    """``data`` (float32, a multiple of 256 values) as Q2_K blocks (uint8, 84 bytes per 256
    values): sixteen groups of 16, each a 2-bit level with a 4-bit scale and min."""
    return _on_every_core(_q2_k, data)


def _q3_k(data: Any) -> Any:
    import numpy as np

    f32 = np.float32
    x = data.reshape(-1, QK_K // 16, 16)
    blocks = x.shape[0]
    scales, levels = _make_q3_quants(x.reshape(-1, 16), 4)
    scales, levels = scales.reshape(blocks, 16), levels.reshape(blocks, 16, 16)
    max_scale = np.take_along_axis(scales, _first_largest(np.abs(scales))[:, None], axis=1)[:, 0]
    kept = max_scale != 0
    iscale = f32(-32) / np.where(kept, max_scale, f32(1))
    as_int8 = ((_nearest_int(iscale[:, None] * scales) + 128) & 0xFF) - 128  # (int8_t l = nearest_int(...))
    six_bit = np.where(kept[:, None], np.clip(as_int8, -32, 31) + 32, 0)
    packed = np.zeros((blocks, 12), np.int32)
    packed[:, 0:8] = (six_bit[:, 0:8] & 0xF) | ((six_bit[:, 8:16] & 0xF) << 4)
    for j in range(16):  # each scale's two high bits: four scales to a byte
        packed[:, 8 + j % 4] |= (six_bit[:, j] >> 4) << (2 * (j // 4))
    d = np.where(kept, f32(1) / iscale, f32(0)).astype(np.float16)
    # what a reader makes of the packed scales (a block of no scale reads -32 of them, times d = 0)
    step = d.astype(np.float32)[:, None] * (six_bit - 32).astype(np.float32)
    quantized = np.clip(_nearest_int(x / np.where(step == 0, f32(1), step)[:, :, None]), -4, 3) + 4
    levels = np.where((step != 0)[:, :, None], quantized, levels).reshape(blocks, QK_K)
    out = np.zeros((blocks, Q3_K_BYTES), np.uint8)
    high = (levels > 3).reshape(blocks, 8, 32)  # value j's third bit: bit j // 32 of hmask[j % 32]
    out[:, 0:32] = (high.astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    out[:, 32:96] = _two_bit(levels & 3)
    out[:, 96:108] = packed.astype(np.uint8)
    out[:, 108:110] = d.reshape(-1, 1).view(np.uint8)
    return out.reshape(-1)


def _q2_k(data: Any) -> Any:
    import numpy as np

    f32 = np.float32
    x = data.reshape(-1, QK_K // 16, 16)
    blocks = x.shape[0]
    groups = x.reshape(-1, 16)
    scales, mins, levels = _make_qkx2_quants(groups, np.abs(groups), 3, f32(-0.5), f32(0.1), 15, use_mad=True)
    scales, mins, levels = scales.reshape(blocks, 16), mins.reshape(blocks, 16), levels.reshape(blocks, 16, 16)
    max_scale = np.maximum(scales.max(axis=1), f32(0))
    max_min = np.maximum(mins.max(axis=1), f32(0))
    with_scale, with_min = max_scale > 0, max_min > 0
    ls = np.where(with_scale[:, None], _nearest_int((f32(15) / np.where(with_scale, max_scale, f32(1)))[:, None]
                                                    * scales), 0)
    lm = np.where(with_min[:, None], _nearest_int((f32(15) / np.where(with_min, max_min, f32(1)))[:, None] * mins), 0)
    packed = (ls | (lm << 4)) & 0xFF  # (uint8_t scales[j] = l, then |= l << 4)
    d = np.where(with_scale, max_scale / f32(15), f32(0)).astype(np.float16)
    dmin = np.where(with_min, max_min / f32(15), f32(0)).astype(np.float16)
    step = d.astype(np.float32)[:, None] * (packed & 0xF).astype(np.float32)
    shift = dmin.astype(np.float32)[:, None] * (packed >> 4).astype(np.float32)
    quantized = np.clip(_nearest_int((x + shift[:, :, None]) / np.where(step == 0, f32(1), step)[:, :, None]), 0, 3)
    levels = np.where((step != 0)[:, :, None], quantized, levels).reshape(blocks, QK_K)
    out = np.zeros((blocks, Q2_K_BYTES), np.uint8)
    out[:, 0:16] = packed.astype(np.uint8)
    out[:, 16:80] = _two_bit(levels)
    out[:, 80:82] = d.reshape(-1, 1).view(np.uint8)
    out[:, 82:84] = dmin.reshape(-1, 1).view(np.uint8)
    return out.reshape(-1)


def _two_bit(levels: Any) -> Any:
    """Levels of 0 to 3 packed four to a byte, as Q2_K and Q3_K pack them: of each 128
    values, byte ``l`` holds values ``l``, ``l + 32``, ``l + 64`` and ``l + 96``."""
    import numpy as np

    part = levels.reshape(levels.shape[0], 2, 4, 32).astype(np.uint8)
    packed = part[:, :, 0] | (part[:, :, 1] << 2) | (part[:, :, 2] << 4) | (part[:, :, 3] << 6)
    return packed.reshape(levels.shape[0], 64)


def _make_q3_quants(x: Any, nmax: int) -> tuple[Any, Any]:
    """``make_q3_quants(16, nmax, x, L, do_rmse=true)`` for each row of ``x``: each group's
    scale and levels (``l + nmax``; 0 for a group of zeros), the reference's five passes
    of moving one level at a time where that fits better. A pass that moves nothing
    leaves nothing for the next to move, so running every group through all five passes
    (the reference stops such a group) gives the same levels."""
    import numpy as np

    f32 = np.float32
    first = _first_largest(np.abs(x))
    biggest = x[np.arange(x.shape[0]), first]
    empty = np.abs(biggest) < f32(_GROUP_MAX_EPS)
    iscale = f32(-nmax) / np.where(empty, f32(1), biggest)
    xt = np.ascontiguousarray(x.T, f32)  # (the groups side by side: each place's values a row)
    levels = np.clip(_nearest_int(iscale * xt), -nmax, nmax - 1)
    weights = xt * xt
    weighted_x = weights * xt  # (w*x[i], the first product of the reference's w*x[i]*L[i])
    as_float = levels.astype(np.float32)
    sumlx, suml2 = _column_sum(weighted_x * as_float), _column_sum(weights * as_float * as_float)
    for _ in range(5):
        moved = False
        for i in range(xt.shape[0]):
            xi, wi, li = xt[i], weights[i], levels[i].astype(np.float32)
            slx = sumlx - weighted_x[i] * li
            movable = slx > 0
            sl2 = suml2 - wi * li * li
            new = np.clip(_nearest_int(xi * sl2 / np.where(movable, slx, f32(1))), -nmax, nmax - 1)
            as_new = new.astype(np.float32)
            new_slx, new_sl2 = slx + weighted_x[i] * as_new, sl2 + wi * as_new * as_new
            better = movable & (new != levels[i]) & (new_sl2 > 0) & \
                (new_slx * new_slx * suml2 > sumlx * sumlx * new_sl2)
            if better.any():
                moved = True
                np.copyto(levels[i], new, where=better)
                sumlx, suml2 = np.where(better, new_slx, sumlx), np.where(better, new_sl2, suml2)
        if not moved:
            break
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, f32(1)), f32(0))
    return np.where(empty, f32(0), scale), np.where(empty, 0, levels + nmax).T


def q3_k_steps(blocks: Any) -> Any:
    """Each 16-value group's quantization step, ``d * scale``, of Q3_K blocks."""
    import numpy as np

    blocks = np.asarray(blocks, np.uint8).reshape(-1, Q3_K_BYTES)
    d = blocks[:, 108:110].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 96:108].astype(np.int32)
    low = np.concatenate([packed[:, 0:8] & 0xF, packed[:, 0:8] >> 4], axis=1)
    high = np.stack([(packed[:, 8 + j % 4] >> (2 * (j // 4))) & 3 for j in range(16)], axis=1)
    return np.abs(d * ((low | (high << 4)) - 32).astype(np.float32)).reshape(-1)


def q2_k_steps(blocks: Any) -> Any:
    """Each 16-value group's quantization step, ``d * scale``, of Q2_K blocks."""
    import numpy as np

    blocks = np.asarray(blocks, np.uint8).reshape(-1, Q2_K_BYTES)
    d = blocks[:, 80:82].copy().view(np.float16).astype(np.float32)
    return np.abs(d * (blocks[:, 0:16] & 0xF).astype(np.float32)).reshape(-1)


def q5_k_steps(blocks: Any) -> Any:
    """Each 32-value group's quantization step of Q5_K blocks (laid out as Q4_K's at first)."""
    return q4_k_steps(blocks, Q5_K_BYTES)


# Each type written here, as gguf's GGMLQuantizationType names it: its quantizer of one part on
# one core (float32 rows of whole super-blocks), the function that reads each group's step from
# its blocks, and how many values share a step
QUANTIZERS = {"Q6_K": (_q6_k, q6_k_steps, 16), "Q5_K": (_q5_k, q5_k_steps, 32), "Q4_K": (_q4_k, q4_k_steps, 32),
              "Q3_K": (_q3_k, q3_k_steps, 16), "Q2_K": (_q2_k, q2_k_steps, 16)}
PART_VALUES = _PART * QK_K  # values quantized at once on one core
