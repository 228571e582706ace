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
- ``sce`` with ``select_topk < 1`` holds one float32 array the size of the leaf (the
  per-element variance it ranks); ``arcee_fusion`` holds one float per row and a sample
  of at most 1M importance scores (mergekit samples 1M too, at random; here evenly).
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


def _blocks(leaves: Leaves, unit: int = 1):
    """``(start, stop, arrays)`` over the leaf in element order, each input's elements as
    float64, in blocks of whole ``unit``s (rows) of about SUB_CHUNK elements."""
    import numpy as np

    size = leaves[0].size
    step = max(unit, SUB_CHUNK // unit * unit)
    raws = [np.empty(min(step, size), leaf.dtype) for leaf in leaves]
    for start in range(0, size, step):
        stop = min(size, start + step)
        arrays = []
        for leaf, raw in zip(leaves, raws):
            leaf.read_into(start, stop, raw[: stop - start])
            arrays.append(raw[: stop - start].astype(np.float64))
        yield start, stop, arrays


def _output_leaf(leaves: Leaves, keypath: str, report: AverageReport,
                 compute: Callable[[int, int, list], Any], unit: int = 1) -> _leaf.ComputedLeaf:
    """A leaf of the base's shape and dtype whose elements ``compute(start, stop, arrays)``
    gives in float64 from every input's elements there; ``start`` and ``stop`` fall on
    whole ``unit``s (a chunk that does not is widened to them, and cut back)."""
    import numpy as np

    first = leaves[0]
    step = max(unit, SUB_CHUNK // unit * unit)

    def fill(start: int, stop: int, out) -> None:
        lo, hi = start // unit * unit, min(first.size, -(-stop // unit) * unit)
        arrays = []
        for leaf in leaves:
            raw = np.empty(hi - lo, leaf.dtype)
            leaf.read_into(lo, hi, raw)
            arrays.append(raw.astype(np.float64))
        result = compute(lo, hi, arrays)[start - lo : stop - lo]
        bad = result.size - int(np.count_nonzero(np.isfinite(result)))
        if bad:
            with report._lock:
                report.nonfinite_outputs[keypath] = report.nonfinite_outputs.get(keypath, 0) + bad
        with np.errstate(over="ignore", invalid="ignore"):
            out[...] = result  # round to nearest even into the leaf's dtype

    def fill_chunk(start: int, stop: int, out) -> None:
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

    def compute(start: int, stop: int, arrays: list):
        rows = once()[start // unit : stop // unit]  # (rows, inputs)
        total = sum(x.reshape(-1, unit) * rows[:, [i]] for i, x in enumerate(arrays))
        return total.reshape(-1)

    return _output_leaf(leaves, keypath, report, compute, unit)


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

    size, k = leaves[0].size, len(leaves) - (1 if base else 0)
    step = max(unit or 1, SUB_CHUNK // (unit or 1) * (unit or 1))
    gram = np.zeros((1 if unit is None else size // unit, k, k))
    partials: dict[int, Any] = {}
    pairs = [(i, j) for i in range(k) for j in range(i, k)]

    def add(start: int) -> None:
        stop = min(size, start + step)
        n = stop - start
        with _combine.scratch_buffers(len(leaves) + 1, step) as buffers:
            wide = [b.view(np.float64)[:n] for b in buffers[1:]]
            for leaf, into in zip(leaves, wide):
                raw = buffers[0].view(leaf.dtype)[:n]
                leaf.read_into(start, stop, raw)
                np.copyto(into, raw)
            vectors = wide[1:] if base else wide
            if base:
                for v in vectors:
                    v -= wide[0]
            if unit is None:
                block = np.zeros((k, k))
                for i, j in pairs:
                    block[i, j] = block[j, i] = np.einsum("n,n->", vectors[i], vectors[j])
                partials[start] = block
            else:
                rows = gram[start // unit : stop // unit]
                shaped = [v.reshape(-1, unit) for v in vectors]
                for i, j in pairs:
                    rows[:, i, j] = rows[:, j, i] = np.einsum("rn,rn->r", shaped[i], shaped[j])

    stream.each_on_two_threads(add, range(0, size, step))
    if unit is not None:
        return gram
    for start in sorted(partials):
        gram[0] += partials[start]
    return gram[0]


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

    def column_factors():
        gram = np.zeros((width, 2, 2))
        for _, _, arrays in _blocks(leaves, width):
            vectors = [(x - arrays[0]) if base else x for x in (arrays[1:] if base else arrays)]
            stacked = np.stack([v.reshape(-1, width) for v in vectors])
            gram += np.einsum("irc,jrc->cij", stacked, stacked)
        return factors(gram)

    once = _Once(column_factors)

    def compute(start: int, stop: int, arrays: list):
        c = once()  # (width, inputs)
        return sum(x.reshape(-1, width) * c[:, i] for i, x in enumerate(arrays)).reshape(-1)

    return _output_leaf(leaves, keypath, report, compute, width)


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

    def compute(start: int, stop: int, arrays: list):
        a, b = arrays
        weight = np.clip(t / np.maximum(np.abs(a - b), 1e-6), 0.0, 1.0)
        return weight * b + (1.0 - weight) * a

    return _output_leaf(leaves, keypath, report, compute)


def ram(leaves: Leaves, epsilon: float, keypath: str, report: AverageReport, *, plus: bool = False,
        r: float = 0.1, alpha: float = 0.2) -> _leaf.ComputedLeaf:
    """Reinforced Agent Merging: each task vector's elements above ``epsilon`` in magnitude
    count; where one model alone contributes its value is kept, where several do their mean.
    ``ramplus_tl`` (``plus``) scales a model's unique elements by ``1 + r·clip(ρ, 0, alpha)``,
    ``ρ`` its shared over its unique elements in the leaf."""
    import numpy as np

    def contributions(arrays: list):
        deltas = [x - arrays[0] for x in arrays[1:]]
        present = [np.abs(d) > epsilon for d in deltas]
        return deltas, present, sum(p.astype(np.int64) for p in present)

    def measure():
        shared, unique = np.zeros(len(leaves) - 1), np.zeros(len(leaves) - 1)
        for _, _, arrays in _blocks(leaves):
            _, present, counts = contributions(arrays)
            for i, p in enumerate(present):
                shared[i] += np.count_nonzero(p & (counts > 1))
                unique[i] += np.count_nonzero(p & (counts == 1))
        return 1.0 + r * np.clip(shared / np.maximum(unique, epsilon), 0.0, alpha)

    scales = _Once(measure) if plus else None

    def compute(start: int, stop: int, arrays: list):
        deltas, present, counts = contributions(arrays)
        overlap = 1.0 / np.maximum(counts, 1)
        total = np.copy(arrays[0])
        for i, (d, p) in enumerate(zip(deltas, present)):
            share = np.where(counts == 1, scales()[i], overlap) if plus else overlap
            total += np.where(p, d * share, 0.0)
        return total

    return _output_leaf(leaves, keypath, report, compute)


def sce(leaves: Leaves, select_topk: float, keypath: str, report: AverageReport) -> _leaf.ComputedLeaf:
    """Select, Calculate, Erase: keep the ``select_topk`` fraction of elements whose task
    vectors vary most across the models (of those that vary at all), weight each model by
    its mean squared task vector over the leaf, erase the values against the elected sign."""
    import numpy as np

    size = leaves[0].size

    def select():
        """The float32 variance keys' threshold and the offset where keys equal to it stop
        being kept (the first in element order are kept), or None: keep everything."""
        if select_topk >= 1:
            return None
        keys = np.empty(size, np.float32)
        for start, stop, arrays in _blocks(leaves):
            keys[start:stop] = np.var(np.stack([x - arrays[0] for x in arrays[1:]]), axis=0)
        k = int(np.count_nonzero(keys) * select_topk)
        if k == 0:
            return (np.inf, 0)
        threshold = np.partition(keys, size - k)[size - k]
        above = int(np.count_nonzero(keys > threshold))
        ties = np.flatnonzero(keys == threshold)
        return (threshold, int(ties[k - above]) if k - above < ties.size else size)

    selection = _Once(lambda: (select(),))

    def deltas_at(start: int, stop: int, arrays: list) -> list:
        deltas = [x - arrays[0] for x in arrays[1:]]
        chosen = selection()[0]
        if chosen is not None:
            threshold, cut = chosen
            stacked = np.stack(deltas)
            variance = np.var(stacked, axis=0).astype(np.float32)
            keep = (variance > threshold) | ((variance == threshold) & (np.arange(start, stop) < cut))
            deltas = [d * keep for d in deltas]
        return deltas

    def measure_weights():
        squares = np.zeros(len(leaves) - 1)
        for start, stop, arrays in _blocks(leaves):
            for i, d in enumerate(deltas_at(start, stop, arrays)):
                squares[i] += float(np.einsum("n,n->", d, d))
        means = squares / max(size, 1)
        total = float(means.sum())
        return np.full(means.size, 1.0 / means.size) if abs(total) < 1e-6 else means / total

    weights = _Once(measure_weights)

    def compute(start: int, stop: int, arrays: list):
        deltas = deltas_at(start, stop, arrays)
        majority = np.where(sum(deltas) >= 0, 1.0, -1.0)
        erased = [w * (np.sign(d) == majority) for w, d in zip(weights(), deltas)]
        mixed = sum(d * e for d, e in zip(deltas, erased))
        return arrays[0] + mixed / np.maximum(sum(erased), 1e-6)

    return _output_leaf(leaves, keypath, report, compute)


def arcee_fusion(leaves: Leaves, keypath: str, report: AverageReport) -> _leaf.ComputedLeaf:
    """Arcee Fusion: an element takes the model's value where its importance
    ``|m − b| · KL(softmax(m_row) ‖ softmax(b_row))`` is at least ``median + 1.5·IQR`` of the
    leaf's importances (quantiles at ``⌊q·(n−1)⌋`` of the sorted scores, or of an even
    sample of 1M of them in a larger leaf), the base's elsewhere."""
    import numpy as np

    unit = _row_length(leaves[0].shape)
    size = leaves[0].size
    sample_size = 1_000_000

    def divergences(base_rows, model_rows):
        def softmax(x):
            e = np.exp(x - x.max(axis=-1, keepdims=True))
            return e / e.sum(axis=-1, keepdims=True) + 1e-8

        p, q = softmax(model_rows), softmax(base_rows)
        return np.sum(p * np.log(p / q), axis=-1)

    def measure():
        rows = np.zeros(max(1, size // unit))
        picks = None if size <= sample_size else (np.arange(sample_size) * size) // sample_size
        scores = []
        for start, stop, (b, m) in _blocks(leaves, unit):
            kl = divergences(b.reshape(-1, unit), m.reshape(-1, unit))
            rows[start // unit : stop // unit] = kl
            importance = (np.abs(m - b).reshape(-1, unit) * kl[:, None]).reshape(-1)
            if picks is None:
                scores.append(importance)
            else:
                inside = picks[(picks >= start) & (picks < stop)]
                scores.append(importance[inside - start])
        ordered = np.sort(np.concatenate(scores)) if scores else np.zeros(1)
        q1, median, q3 = (ordered[int(q * (ordered.size - 1))] for q in (0.25, 0.5, 0.75))
        return rows, median + 1.5 * (q3 - q1)

    once = _Once(measure)

    def compute(start: int, stop: int, arrays: list):
        b, m = arrays
        rows, threshold = once()
        importance = np.abs(m - b).reshape(-1, unit) * rows[start // unit : stop // unit, None]
        return np.where(importance.reshape(-1) >= threshold, m, b)

    return _output_leaf(leaves, keypath, report, compute, unit)
