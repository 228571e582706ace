"""mergekit's merge methods beyond task arithmetic, one leaf at a time, streamed.

Each builder takes one leaf of every input (``base`` first where the method has one)
and that leaf's resolved parameters, and returns a computed leaf in the base's dtype.
The definitions are mergekit 0.1.5's (``mergekit/merge_methods``); the arithmetic is
float64 throughout.

Most of these methods need a statistic of the whole leaf before any output element:
norms and angles (``multislerp``, ``nuslerp``, ``karcher``, ``model_stock``), counts
(``ramplus_tl``), a selection or quantiles (``sce``, ``arcee_fusion``). One pass
gathers it, on first read, then a second writes the output, block by block:

- the geometric methods reduce to the Gram matrix of their vectors (their inner
  products, per leaf or per row): every mean, tangent and iteration of mergekit's is a
  linear combination of the inputs, so it is carried out on ``k`` coefficients instead
  of on whole tensors, and the output is that weighted sum, streamed like ``average``;
- ``sce`` with ``select_topk < 1`` counts the elements whose task vectors vary, then
  ranks their variances by TIES' streaming exact selection (``_selection.Trims``);
  ``arcee_fusion`` holds one float per row and a sample of at most 1M importance scores
  (mergekit samples 1M too, at random; here evenly).

Every pass reads a block of each input into this thread's scratch buffers and works in
place there (``_scan``, ``_output_leaf``), on two threads.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable

from treecli import _combine, _leaf
from treecli._bytes import stream
from treecli._combine import SUB_CHUNK, AverageReport
from treecli._errors import UsageError

Leaves = list  # of _leaf.ArrayLeaf, the base first where the method takes one


# --- reading and writing -------------------------------------------------------------------------


def _step(unit: int) -> int:
    """Elements a block holds: whole ``unit``s (rows), about SUB_CHUNK of them."""
    return max(unit, SUB_CHUNK // unit * unit)


def _read_block(leaves: Leaves, start: int, stop: int, buffers: list, spare: int) -> tuple[list, list]:
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


def _flags(spare, count: int) -> list:
    """Up to eight boolean arrays of the block's length, packed into one spare float64 array."""
    n = spare.size
    return [spare.view(bool)[j * n : (j + 1) * n] for j in range(count)]


def _sum_into(arrays: list, out) -> Any:
    """``out`` := the arrays' sum, added in order."""
    import numpy as np

    np.copyto(out, arrays[0])
    for x in arrays[1:]:
        out += x
    return out


def _weighted_sum(arrays: list, coefficients: list, width: int, out) -> Any:
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


def _scan(leaves: Leaves, visit: Callable[[int, int, list, list], Any], unit: int = 1, spare: int = 0) -> list:
    """One pass over the leaf: ``visit(start, stop, arrays, spares)`` for each block (see
    ``_read_block``), on two threads; what the visits returned, in block order (so that
    a sum of them is the same bytes whichever thread did which block)."""
    size, step = leaves[0].size, _step(unit)

    def visit_block(start: int) -> Any:
        stop = min(size, start + step)
        with _combine.scratch_buffers(len(leaves) + 1 + spare, step) as buffers:
            return visit(start, stop, *_read_block(leaves, start, stop, buffers, spare))

    return stream.map_on_two_threads(visit_block, range(0, size, step))


def _output_leaf(leaves: Leaves, keypath: str, report: AverageReport,
                 compute: Callable[[int, int, list, list], Any], unit: int = 1, spare: int = 0,
                 measure: Callable[[], Any] | None = None) -> _leaf.ComputedLeaf:
    """A leaf of the base's shape and dtype whose elements ``compute(start, stop, arrays,
    spares)`` gives in float64 (see ``_read_block``; it may return one of those arrays)
    from every input's elements there; ``start`` and ``stop`` fall on whole ``unit``s (a
    chunk that does not is widened to them, and cut back). ``measure()`` (a ``_Once``)
    gathers the statistics of the whole leaf that ``compute`` uses, called before a
    chunk's blocks go to two threads: called from a block, its own pass would run on one
    (the helper thread waiting for it)."""
    import numpy as np

    first = leaves[0]
    step = _step(unit)

    def fill(start: int, stop: int, out) -> None:
        lo, hi = start // unit * unit, min(first.size, -(-stop // unit) * unit)
        with _combine.scratch_buffers(len(leaves) + 1 + spare, step) as buffers:
            for block in range(lo, hi, step):
                end = min(hi, block + step)
                result = compute(block, end, *_read_block(leaves, block, end, buffers, spare))
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


class _Once:
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
    once = _Once(coefficients)
    if unit is None:
        whole = _Once(lambda: _combine.averaged_leaf(leaves, [float(c) for c in once()], leaves[0].dtype_name,
                                                      keypath, names, report, convex=False))
        return _leaf.ComputedLeaf(leaves[0].shape, leaves[0].dtype,
                                  fill=lambda start, stop, out: whole().read_into(start, stop, out), inputs=leaves)

    def compute(start: int, stop: int, arrays: list, spares: list):
        rows = once()[start // unit : stop // unit]  # (rows, inputs)
        return _weighted_sum(arrays, [rows[:, [i]] for i in range(len(arrays))], unit, spares[0])

    return _output_leaf(leaves, keypath, report, compute, unit, spare=1, measure=once)


def _row_length(shape: tuple) -> int:
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

    blocks = _scan(leaves, products, unit or 1)
    if unit is not None:
        return np.concatenate(blocks) if blocks else np.zeros((0, k, k))
    gram = np.zeros((k, k))
    for block in blocks:
        gram += block[0]
    return gram


def _norms(gram):
    import numpy as np

    return np.sqrt(np.maximum(np.diagonal(gram, axis1=-2, axis2=-1), 0.0))


def _with_base(coefficients):
    """Coefficients of the vectors ``mᵢ − base`` as coefficients of ``base`` and each ``mᵢ``."""
    import numpy as np

    c = np.asarray(coefficients, np.float64)
    return np.concatenate([1.0 - c.sum(axis=-1, keepdims=True), c], axis=-1)


# --- geometric methods ---------------------------------------------------------------------------


def multislerp(leaves: Leaves, base: bool, weights: list[float], normalize_weights: bool, eps: float,
               keypath: str, names: list[str], report: AverageReport) -> _leaf.ComputedLeaf:
    """Barycentric interpolation on the hypersphere: the vectors' unit directions are
    averaged in the tangent space at their weighted mean, mapped back, and scaled to the
    weighted mean of their norms."""
    import numpy as np

    models = leaves[1:] if base else leaves
    if len(models) == 1:
        return models[0]

    def coefficients():
        gram = inner_products(leaves, base)
        norms = _norms(gram)
        w = np.asarray(weights, np.float64)
        if normalize_weights:
            w = w / w.sum()
        unit_gram = gram / np.outer(norms + eps, norms + eps)
        mean_norm = math.sqrt(max(0.0, float(w @ unit_gram @ w)))
        if mean_norm < eps:
            if len(models) != 2:
                raise UsageError("multislerp: the weighted sum of the models' directions is zero (antipodal "
                                 "models with balancing weights); choose other weights", keypath=keypath)
            on_vectors = w  # mergekit's fallback for two: the weighted sum
        else:
            dots = unit_gram @ w / mean_norm
            tangent = w - float(w @ dots) * w / mean_norm
            tangent_norm = math.sqrt(max(0.0, float(tangent @ unit_gram @ tangent))) + eps
            on_units = w / mean_norm * math.cos(tangent_norm) + tangent * (math.sin(tangent_norm) / tangent_norm)
            on_vectors = on_units * float(norms @ w) / (norms + eps)
        return _with_base(on_vectors) if base else on_vectors

    return weighted(leaves, coefficients, keypath, names, report)


def nuslerp(leaves: Leaves, base: bool, weights: list[float], row_wise: bool, flatten: bool,
            keypath: str, names: list[str], report: AverageReport) -> _leaf.ComputedLeaf:
    """SLERP of two vectors (the models, or their task vectors) by ``t = w₁ / (w₀ + w₁)``,
    over the flattened leaf (default), each row, or each column (``row_wise``)."""
    import numpy as np

    total = sum(weights)
    t = 0.5 if abs(total) < 1e-6 else weights[1] / total
    shape = leaves[0].shape
    columns = row_wise and not flatten and len(shape) >= 2

    def factors(gram):
        n0, n1 = (np.maximum(np.sqrt(np.maximum(gram[..., i, i], 0.0)), 1e-7) for i in (0, 1))
        cosine = np.clip(gram[..., 0, 1] / (n0 * n1), -1.0, 1.0)
        colinear = 1.0 - cosine**2 <= 1e-16
        theta = np.arccos(np.where(colinear, 0.0, cosine))
        sin = np.where(colinear, 1.0, np.sin(theta))
        a = np.where(colinear, 1.0 - t, np.sin((1.0 - t) * theta) / sin)
        b = np.where(colinear, t, np.sin(t * theta) / sin)
        pair = np.stack([a, b], axis=-1)
        return _with_base(pair) if base else pair

    if flatten or len(shape) < 2:
        return weighted(leaves, lambda: factors(inner_products(leaves, base)), keypath, names, report)
    if not columns:
        unit = shape[-1]
        return weighted(leaves, lambda: factors(inner_products(leaves, base, unit)), keypath, names, report, unit)
    # Vectors along the first axis (mergekit transposes it last): one per column of the rest.
    width = leaves[0].size // shape[0]

    pairs = [(0, 0), (0, 1), (1, 1)]

    def column_products(start: int, stop: int, arrays: list, _spares: list):
        vectors = [x - arrays[0] for x in arrays[1:]] if base else arrays
        shaped = [v.reshape(-1, width) for v in vectors]
        return np.stack([np.einsum("rc,rc->c", shaped[i], shaped[j]) for i, j in pairs], axis=-1)

    def column_factors():
        sums = np.zeros((width, len(pairs)))
        for block in _scan(leaves, column_products, width):
            sums += block
        gram = np.stack([sums[:, [0, 1]], sums[:, [1, 2]]], axis=1)  # (width, 2, 2)
        return factors(gram)

    once = _Once(column_factors)

    def compute(start: int, stop: int, arrays: list, spares: list):
        c = once()  # (width, inputs)
        return _weighted_sum(arrays, [c[:, i] for i in range(len(arrays))], width, spares[0])

    return _output_leaf(leaves, keypath, report, compute, width, spare=1, measure=once)


def karcher(leaves: Leaves, max_iter: int, tol: float, keypath: str, names: list[str],
            report: AverageReport) -> _leaf.ComputedLeaf:
    """The Karcher (Riemannian) mean of the inputs' directions, iterated as mergekit does
    (equal weights, ``max_iter`` steps, stopping under ``tol``), scaled by their mean norm."""
    import numpy as np

    if len(leaves) == 1:
        return leaves[0]

    def coefficients():
        gram = inner_products(leaves, base=False)
        norms = _norms(gram)
        alphas = np.full(len(leaves), 1.0 / len(leaves))
        valid = np.flatnonzero(norms > tol)
        result = np.zeros(len(leaves))
        if valid.size == 0:
            return result
        g = gram[np.ix_(valid, valid)] / np.outer(norms[valid], norms[valid])  # the units' inner products
        a = alphas[valid] / alphas[valid].sum()

        def norm(c):
            return math.sqrt(max(0.0, float(c @ g @ c)))

        mean = a.copy()
        mean_norm = norm(mean)
        mean = np.eye(valid.size)[0] if mean_norm < tol else mean / mean_norm
        for _ in range(max_iter):
            tangent = np.zeros(valid.size)
            dots = np.clip(g @ mean, -1.0, 1.0)
            for j in range(valid.size):
                theta = math.acos(float(dots[j]))
                if theta < tol:
                    continue
                tangent += a[j] * (theta / math.sin(theta)) * (np.eye(valid.size)[j] - dots[j] * mean)
            tangent_norm = norm(tangent)
            if tangent_norm < tol:
                break
            mean = math.cos(tangent_norm) * mean + math.sin(tangent_norm) * tangent / tangent_norm
            unit_norm = norm(mean)
            if unit_norm > tol:
                mean = mean / unit_norm
        result[valid] = float(alphas @ norms) * mean / norms[valid]
        return result

    return weighted(leaves, coefficients, keypath, names, report)


def model_stock(leaves: Leaves, filter_wise: bool, keypath: str, names: list[str],
                report: AverageReport) -> _leaf.ComputedLeaf:
    """``t · mean(models) + (1 − t) · base``, ``t = N cos / (1 + (N − 1) cos)`` from the mean
    cosine between the task vectors, over the leaf or (``filter_wise``) each row."""
    import numpy as np

    count = len(leaves) - 1
    unit = _row_length(leaves[0].shape) if filter_wise and len(leaves[0].shape) >= 2 else None

    def coefficients():
        gram = inner_products(leaves, base=True, unit=unit)
        norms = _norms(gram)
        cosines = [np.clip(gram[..., i, j] / np.maximum(norms[..., i] * norms[..., j], 1e-6), -1.0, 1.0)
                   for i in range(count) for j in range(i + 1, count)]
        cosine = np.mean(cosines, axis=0)
        denominator = 1.0 + (count - 1) * cosine
        singular = np.abs(denominator) < 1e-6  # no finite estimate: mergekit keeps the base there
        t = np.where(singular, 0.0, count * cosine / np.where(singular, 1.0, denominator))
        return np.stack([1.0 - t] + [t / count] * count, axis=-1)

    return weighted(leaves, coefficients, keypath, names, report, unit)


# --- element-wise methods ------------------------------------------------------------------------


def nearswap(leaves: Leaves, t: float, keypath: str, report: AverageReport) -> _leaf.ComputedLeaf:
    """Where the base and the model are within ``t`` of each other the model's value, further
    apart a step of ``t`` toward it: ``w = clip(t / |a − b|, 0, 1)``, ``w·b + (1 − w)·a``."""
    import numpy as np

    def compute(start: int, stop: int, arrays: list, spares: list):
        (a, b), (weight,) = arrays, spares
        np.subtract(a, b, out=weight)
        np.abs(weight, out=weight)
        np.maximum(weight, 1e-6, out=weight)
        np.divide(t, weight, out=weight)
        np.clip(weight, 0.0, 1.0, out=weight)
        b *= weight
        np.subtract(1.0, weight, out=weight)
        a *= weight
        a += b
        return a

    return _output_leaf(leaves, keypath, report, compute, spare=1)


def ram(leaves: Leaves, epsilon: float, keypath: str, report: AverageReport, *, plus: bool = False,
        r: float = 0.1, alpha: float = 0.2) -> _leaf.ComputedLeaf:
    """Reinforced Agent Merging: each task vector's elements above ``epsilon`` in magnitude
    count; where one model alone contributes its value is kept, where several do their mean.
    ``ramplus_tl`` (``plus``) scales a model's unique elements by ``1 + r·clip(ρ, 0, alpha)``,
    ``ρ`` its shared over its unique elements in the leaf."""
    import numpy as np

    k = len(leaves) - 1
    flag_spares = -(-(k + 1) // 8)  # each model's mask, and where one model alone contributes

    def contributions(arrays: list, spares: list) -> tuple[list, Any, Any]:
        """The models' task vectors in place of the models, zero where not above epsilon (as
        mergekit, a NaN stays); their masks; how many models contribute to each element."""
        base, deltas = arrays[0], arrays[1:]
        magnitude, count = spares[:2]
        flags = [f for spare in spares[2:] for f in _flags(spare, 8)]
        count[...] = 0.0
        for d, mask in zip(deltas, flags):
            d -= base
            np.abs(d, out=magnitude)
            np.greater(magnitude, epsilon, out=mask)
            d *= mask
            count += mask
        np.equal(count, 1.0, out=flags[k])
        return flags[:k], flags[k], count

    def measure():
        def counts(start: int, stop: int, arrays: list, spares: list):
            masks, alone, _ = contributions(arrays, spares)
            present = [np.count_nonzero(mask) for mask in masks]
            unique = [np.count_nonzero(np.logical_and(mask, alone, out=mask)) for mask in masks]
            return np.array([present, unique], np.float64)

        present, unique = sum(_scan(leaves, counts, spare=2 + flag_spares), np.zeros((2, k)))
        shared = present - unique
        return 1.0 + r * np.clip(shared / np.maximum(unique, epsilon), 0.0, alpha)

    scales = _Once(measure) if plus else None

    def compute(start: int, stop: int, arrays: list, spares: list):
        _, alone, count = contributions(arrays, spares)
        deltas, total = arrays[1:], spares[0]
        _sum_into(deltas, total)
        np.maximum(count, 1.0, out=count)
        total /= count  # the mean where several contribute, the value where one does
        if plus:  # where one contributes: its value scaled by its model's factor
            for d, scale in zip(deltas, scales()):
                d *= scale
            _sum_into(deltas, count)
            np.copyto(total, count, where=alone)
        total += arrays[0]
        return total

    return _output_leaf(leaves, keypath, report, compute, spare=2 + flag_spares, measure=scales)


def sce(leaves: Leaves, select_topk: float, keypath: str, report: AverageReport) -> _leaf.ComputedLeaf:
    """Select, Calculate, Erase: keep the ``select_topk`` fraction of elements whose task
    vectors vary most across the models (of those that vary at all), weight each model by
    its mean squared task vector over the leaf, erase the values against the elected sign.
    The selection is TIES' streaming exact one (``_selection.Trims``) ranking the float32
    variances; a pass before it counts those that are not zero."""
    import numpy as np

    from treecli._selection import Trims

    k, size = len(leaves) - 1, leaves[0].size

    def deltas_and_keys(arrays: list, spares: list):
        """The task vectors in place of the models, and their variances as float32 bit
        patterns (sign cleared: NaN ranks above inf) in ``spares[0]``, as NumPy's ``var``
        computes them (the mean first, then the mean square from it); three spares used."""
        mean, square, variance = spares[:3]
        deltas = arrays[1:]
        for d in deltas:
            d -= arrays[0]
        _sum_into(deltas, mean)
        mean /= k
        for i, d in enumerate(deltas):
            np.subtract(d, mean, out=square if i else variance)
            if i:
                square *= square
                variance += square
            else:
                variance *= variance
        variance /= k
        keys = mean.view(np.float32)[: mean.size]
        np.copyto(keys, variance, casting="unsafe")
        bits = keys.view(np.uint32)
        np.bitwise_and(bits, 0x7FFFFFFF, out=bits)
        return deltas, bits

    def count_varying() -> int:
        return sum(_scan(leaves, lambda start, stop, arrays, spares: int(np.count_nonzero(
            deltas_and_keys(arrays, spares)[1])), spare=3))

    def select():
        """The selection among the varying elements, or None: keep everything."""
        if select_topk >= 1:
            return None
        kept = int(count_varying() * select_topk)

        def variance_keys(start: int, stop: int, space, which):
            keys = space.key.view(np.uint32)[: stop - start]
            with _combine.scratch_buffers(len(leaves) + 4, SUB_CHUNK) as buffers:
                for lo in range(start, stop, SUB_CHUNK):
                    hi = min(stop, lo + SUB_CHUNK)
                    keys[lo - start : hi - start] = deltas_and_keys(*_read_block(leaves, lo, hi, buffers, 3))[1]
            yield 0, keys

        return Trims(leaves[0], [leaves[0]], [kept], keys=variance_keys)

    selection = _Once(lambda: (select(),))

    def selected(start: int, stop: int, arrays: list, spares: list) -> list:
        """The task vectors, zero where the selection drops them; three spares used."""
        deltas, keys = deltas_and_keys(arrays, spares)
        trims = selection()[0]
        if trims is not None:
            keep = _flags(spares[1], 1)[0]
            trims.keep(0, start, stop, keys, keep)
            for d in deltas:
                d *= keep
        return deltas

    def measure_weights():
        selection()  # before this pass: measured from one of its blocks, its passes would run on one thread
        squares = sum(_scan(leaves, lambda start, stop, arrays, spares: np.array(
            [np.einsum("n,n->", d, d) for d in selected(start, stop, arrays, spares)]), spare=3), np.zeros(k))
        means = squares / max(size, 1)
        total = float(means.sum())
        return np.full(k, 1.0 / k) if abs(total) < 1e-6 else means / total

    weights = _Once(measure_weights)

    def compute(start: int, stop: int, arrays: list, spares: list):
        deltas = selected(start, stop, arrays, spares)
        majority, agree, numerator, denominator = spares
        _sum_into(deltas, majority)
        elected = _flags(agree, 1)[0]
        np.greater_equal(majority, 0.0, out=elected)
        np.multiply(elected, 2.0, out=majority)
        majority -= 1.0  # the elected sign: +1 where the task vectors' sum is >= 0, else -1
        for i, (d, weight) in enumerate(zip(deltas, weights())):
            np.sign(d, out=agree)
            np.equal(agree, majority, out=agree)
            agree *= weight  # the model's weight where its sign is the elected one, else 0
            if i:
                denominator += agree
            else:
                np.copyto(denominator, agree)
            d *= agree
        _sum_into(deltas, numerator)
        np.maximum(denominator, 1e-6, out=denominator)
        numerator /= denominator
        numerator += arrays[0]
        return numerator

    return _output_leaf(leaves, keypath, report, compute, spare=4, measure=weights)


def arcee_fusion(leaves: Leaves, keypath: str, report: AverageReport) -> _leaf.ComputedLeaf:
    """Arcee Fusion: an element takes the model's value where its importance
    ``|m − b| · KL(softmax(m_row) ‖ softmax(b_row))`` is at least ``median + 1.5·IQR`` of the
    leaf's importances (quantiles at ``⌊q·(n−1)⌋`` of the sorted scores, or of an even
    sample of 1M of them in a larger leaf), the base's elsewhere."""
    import numpy as np

    unit = _row_length(leaves[0].shape)
    size = leaves[0].size
    sample_size = 1_000_000

    def softmax(rows, out):
        """``softmax(rows) + 1e-8`` per row, into ``out`` (mergekit's, the 1e-8 after)."""
        np.subtract(rows, rows.max(axis=-1, keepdims=True), out=out)
        np.exp(out, out=out)
        out /= out.sum(axis=-1, keepdims=True)
        out += 1e-8
        return out

    def importances(b, m, rows, out):
        """``|m − b|`` times each row's divergence, into ``out``."""
        np.subtract(m, b, out=out)
        np.abs(out, out=out)
        shaped = out.reshape(-1, unit)
        shaped *= rows[:, None]
        return out

    def divergences(start: int, stop: int, arrays: list, spares: list):
        """Each row's ``KL(softmax(m) ‖ softmax(b))``, and the sampled importances in the block."""
        (b, m), (p, q) = arrays, spares
        p, q = softmax(m.reshape(-1, unit), p.reshape(-1, unit)), softmax(b.reshape(-1, unit), q.reshape(-1, unit))
        np.divide(p, q, out=q)
        np.log(q, out=q)
        q *= p
        rows = q.sum(axis=-1)
        if size <= sample_size:
            return rows, importances(b, m, rows, spares[0]).copy()
        # The sample: elements ⌊i·size / sample_size⌋, those of them in [start, stop).
        first, last = -(-start * sample_size // size), -(-stop * sample_size // size)
        at = np.arange(first, last) * size // sample_size - start
        return rows, np.abs(m[at] - b[at]) * rows[at // unit]

    def measure():
        found = _scan(leaves, divergences, unit, spare=2)
        rows = np.concatenate([r for r, _ in found]) if found else np.zeros(0)
        scores = np.concatenate([scores for _, scores in found]) if found else np.zeros(1)
        at = [int(q * (scores.size - 1)) for q in (0.25, 0.5, 0.75)]
        q1, median, q3 = np.partition(scores, at)[at]  # those places of the sorted scores, without a sort
        return rows, median + 1.5 * (q3 - q1)

    once = _Once(measure)

    def compute(start: int, stop: int, arrays: list, spares: list):
        (b, m), (importance,) = arrays, spares
        rows, threshold = once()
        importances(b, m, rows[start // unit : stop // unit], importance)
        np.copyto(b, m, where=importance >= threshold)
        return b

    return _output_leaf(leaves, keypath, report, compute, unit, spare=1, measure=once)
