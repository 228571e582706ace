"""The block machinery of the methods that need a statistic of the whole leaf before
any output element: one pass gathers it, on first read, then a second writes the output,
block by block (``scan``, ``output_leaf``).

- the geometric methods reduce to the Gram matrix of their vectors (their inner
  products, per leaf or per row: ``inner_products``): every mean, tangent and iteration
  of mergekit's is a linear combination of the inputs, so it is carried out on ``k``
  coefficients instead of on whole tensors, and the output is that weighted sum
  (``weighted``), streamed like ``average``;
- every pass reads a block of each input into this thread's scratch buffers and works in
  place there, on two threads.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable

from treecli import _combine, _leaf
from treecli._bytes import stream
from treecli._combine import SUB_CHUNK, AverageReport

Leaves = list  # of _leaf.ArrayLeaf, the base first where the method takes one


# --- reading and writing -------------------------------------------------------------------------


def block_length(unit: int) -> int:
    """Elements a block holds: whole ``unit``s (rows), about SUB_CHUNK of them."""
    return max(unit, SUB_CHUNK // unit * unit)


def read_block(leaves: Leaves, start: int, stop: int, buffers: list, spare: int) -> tuple[list, list]:
    """Every input's elements ``[start, stop)`` as float64 and ``spare`` more float64
    arrays of that length, all views of ``buffers`` (this thread's scratch: one for the raw
    reads, one per input, the spares), free to overwrite."""
    import numpy as np

    n = stop - start
    wide = [b.view(np.float64)[:n] for b in buffers[1:]]
    for leaf, into in zip(leaves, wide):
        if leaf.dtype == np.float64:
            leaf.read_into(start, stop, into)
        else:
            raw = buffers[0].view(leaf.dtype)[:n]
            leaf.read_into(start, stop, raw)
            np.copyto(into, raw)
    return wide[: len(leaves)], wide[len(leaves) : len(leaves) + spare]


def bool_views(spare, count: int) -> list:
    """Up to eight boolean arrays of the block's length, packed into one spare float64 array."""
    n = spare.size
    return [spare.view(bool)[j * n : (j + 1) * n] for j in range(count)]


def sum_into(arrays: list, out) -> Any:
    """``out`` := the arrays' sum, added in order."""
    import numpy as np

    np.copyto(out, arrays[0])
    for x in arrays[1:]:
        out += x
    return out


def weighted_sum(arrays: list, coefficients: list, width: int, out) -> Any:
    """``out`` := ``Σ xᵢ · cᵢ``, each ``xᵢ`` taken as rows of ``width`` (``cᵢ`` broadcast
    against them: one per row, or one per column); the arrays are overwritten."""
    import numpy as np

    total = out.reshape(-1, width)
    np.multiply(arrays[0].reshape(-1, width), coefficients[0], out=total)
    for x, c in zip(arrays[1:], coefficients[1:]):
        shaped = x.reshape(-1, width)
        shaped *= c
        total += shaped
    return out


def scan(leaves: Leaves, visit: Callable[[int, int, list, list], Any], unit: int = 1, spare: int = 0) -> list:
    """One pass over the leaf: ``visit(start, stop, arrays, spares)`` for each block (see
    ``read_block``), on two threads; what the visits returned, in block order (so that
    a sum of them is the same bytes whichever thread did which block)."""
    size, step = leaves[0].size, block_length(unit)

    def visit_block(start: int) -> Any:
        stop = min(size, start + step)
        with _combine.scratch_buffers(len(leaves) + 1 + spare, step) as buffers:
            return visit(start, stop, *read_block(leaves, start, stop, buffers, spare))

    return stream.map_on_two_threads(visit_block, range(0, size, step))


def output_leaf(leaves: Leaves, keypath: str, report: AverageReport,
                 compute: Callable[[int, int, list, list], Any], unit: int = 1, spare: int = 0,
                 measure: Callable[[], Any] | None = None) -> _leaf.ComputedLeaf:
    """A leaf of the base's shape and dtype whose elements ``compute(start, stop, arrays,
    spares)`` gives in float64 (see ``read_block``; it may return one of those arrays)
    from every input's elements there; ``start`` and ``stop`` fall on whole ``unit``s (a
    chunk that does not is widened to them, and cut back). ``measure()`` (a ``Once``)
    gathers the statistics of the whole leaf that ``compute`` uses, called before a
    chunk's blocks go to two threads: called from a block, its own pass would run on one
    (the helper thread waiting for it)."""
    import numpy as np

    first = leaves[0]
    step = block_length(unit)

    def fill(start: int, stop: int, out) -> None:
        lo, hi = start // unit * unit, min(first.size, -(-stop // unit) * unit)
        with _combine.scratch_buffers(len(leaves) + 1 + spare, step) as buffers:
            for block in range(lo, hi, step):
                end = min(hi, block + step)
                result = compute(block, end, *read_block(leaves, block, end, buffers, spare))
                a, b = max(block, start), min(end, stop)
                part = result[a - block : b - block]
                with np.errstate(over="ignore", invalid="ignore"):
                    if not np.isfinite(np.add.reduce(part)):  # one sum; a count only where it is not finite
                        bad = part.size - int(np.count_nonzero(np.isfinite(part)))
                        if bad:
                            with report._lock:
                                report.nonfinite_outputs[keypath] = report.nonfinite_outputs.get(keypath, 0) + bad
                    out[a - start : b - start] = part  # round to nearest even into the leaf's dtype

    def fill_chunk(start: int, stop: int, out) -> None:
        if measure is not None:
            measure()
        stream.on_two_threads(fill, start, stop, out, step)

    return _leaf.ComputedLeaf(first.shape, first.dtype, fill=fill_chunk, inputs=leaves)


class Once:
    """A statistic of the whole leaf, measured by the first reader that needs it."""

    def __init__(self, measure: Callable[[], Any]):
        self._measure, self._lock, self._value = measure, threading.Lock(), None

    def __call__(self) -> Any:
        with self._lock:
            if self._value is None:
                self._value = (self._measure(),)
            return self._value[0]


def weighted(leaves: Leaves, coefficients: Callable[[], Any], keypath: str, names: list[str],
              report: AverageReport, unit: int | None = None) -> _leaf.ComputedLeaf:
    """``Σ cᵢ · inputᵢ`` with the coefficients measured on first read: one set for the leaf
    (``unit`` None), or one row of them per ``unit`` elements."""
    once = Once(coefficients)
    if unit is None:
        whole = Once(lambda: _combine.averaged_leaf(leaves, [float(c) for c in once()], leaves[0].dtype_name,
                                                      keypath, names, report, convex=False))
        return _leaf.ComputedLeaf(leaves[0].shape, leaves[0].dtype,
                                  fill=lambda start, stop, out: whole().read_into(start, stop, out), inputs=leaves)

    def compute(start: int, stop: int, arrays: list, spares: list):
        rows = once()[start // unit : stop // unit]  # (rows, inputs)
        return weighted_sum(arrays, [rows[:, [i]] for i in range(len(arrays))], unit, spares[0])

    return output_leaf(leaves, keypath, report, compute, unit, spare=1, measure=once)


def row_length(shape: tuple) -> int:
    """The length of a row (the last axis) of a leaf of ``shape``; a 1-D or 0-d leaf is one row."""
    return max(1, shape[-1]) if len(shape) >= 2 else max(1, math.prod(shape))


def inner_products(leaves: Leaves, base: bool, unit: int | None = None):
    """The inner products of the vectors (each input less the base, when ``base``; the
    inputs themselves otherwise), in float64: ``(k, k)`` over the leaf, or
    ``(rows, k, k)`` per ``unit`` elements. Blocks on two threads, each in its own
    scratch buffers; the leaf's sums are added in block order (the same bytes whatever
    thread did which block), a row's lie in one block. With einsum, not BLAS: OpenBLAS
    runs a dot on threads of its own, and under treecli's two a 1 GiB slerp took
    2.5-3.7 s instead of 1.5-1.8 s."""
    import numpy as np

    k = len(leaves) - (1 if base else 0)
    pairs = [(i, j) for i in range(k) for j in range(i, k)]

    def products(start: int, stop: int, arrays: list, _spares: list):
        vectors = arrays[1:] if base else arrays
        if base:
            for v in vectors:
                v -= arrays[0]
        shaped = [v.reshape(-1, unit or v.size) for v in vectors]
        block = np.zeros((shaped[0].shape[0], k, k))
        for i, j in pairs:
            block[:, i, j] = block[:, j, i] = np.einsum("rn,rn->r", shaped[i], shaped[j])
        return block

    blocks = scan(leaves, products, unit or 1)
    if unit is not None:
        return np.concatenate(blocks) if blocks else np.zeros((0, k, k))
    gram = np.zeros((k, k))
    for block in blocks:
        gram += block[0]
    return gram


def vector_norms(gram):
    import numpy as np

    return np.sqrt(np.maximum(np.diagonal(gram, axis1=-2, axis2=-1), 0.0))


def with_base(coefficients):
    """Coefficients of the vectors ``mᵢ − base`` as coefficients of ``base`` and each ``mᵢ``."""
    import numpy as np

    c = np.asarray(coefficients, np.float64)
    return np.concatenate([1.0 - c.sum(axis=-1, keepdims=True), c], axis=-1)
