"""The SLERP family: spherical interpolation of two models (``slerp``), of two by their
weights (``nuslerp``), and of many on the hypersphere (``multislerp``), each from the
inner products of its vectors (one pass), then their weighted sum (a second)."""

from __future__ import annotations

import math

from treecli.merge_methods._method import REQUIRED, LeafMerge, MergeMethod, Param

SLERP_PARALLEL = 0.9995  # mergekit's DOT_THRESHOLD: closer to parallel than this, interpolate linearly
SLERP_EPS = 1e-8


def slerp(job: LeafMerge):
    """The weighted sum of the two models, its weights from a first pass over both (their
    inner products)."""
    from treecli._errors import UsageError, option
    from treecli.merge_methods import _blocks

    (v0, v1), t = job.leaves, job.shared["t"]
    if t is None:
        raise UsageError(f"no {option('t', 'PATTERN=T')} rule covers this leaf; add a default {option('t', 'T')}",
                         keypath=job.keypath)

    def weights() -> tuple[float, float]:
        gram = _blocks.inner_products([v0, v1], base=False)
        return slerp_factors(t, float(gram[0, 1]), math.sqrt(gram[0, 0]), math.sqrt(gram[1, 1]))

    return _blocks.weighted([v0, v1], weights, job.keypath, job.names, job.report)


def slerp_factors(t: float, dot: float, norm0: float, norm1: float) -> tuple[float, float]:
    """The weights of ``v0`` and ``v1``: mergekit normalizes each (when its norm exceeds
    1e-8), takes the cosine, and interpolates linearly when it is nearly ±1."""
    cosine = dot / ((norm0 if norm0 > SLERP_EPS else 1.0) * (norm1 if norm1 > SLERP_EPS else 1.0))
    if abs(cosine) > SLERP_PARALLEL:
        return 1.0 - t, t
    theta = math.acos(cosine)
    return math.sin((1 - t) * theta) / math.sin(theta), math.sin(t * theta) / math.sin(theta)


def nuslerp(job: LeafMerge):
    """SLERP of two vectors (the models, or their task vectors) by ``t = w₁ / (w₀ + w₁)``,
    over the flattened leaf (default), each row, or each column (``row_wise``)."""
    import numpy as np

    from treecli.merge_methods import _blocks

    leaves, base, weights, keypath, names, report = (job.leaves, job.has_base, job.weights, job.keypath, job.names,
                                                     job.report)
    row_wise, flatten = job.shared["nuslerp_row_wise"], job.shared["nuslerp_flatten"]

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
        return _blocks.with_base(pair) if base else pair

    if flatten or len(shape) < 2:
        return _blocks.weighted(leaves, lambda: factors(_blocks.inner_products(leaves, base)), keypath, names, report)
    if not columns:
        unit = shape[-1]
        return _blocks.weighted(leaves, lambda: factors(_blocks.inner_products(leaves, base, unit)), keypath, names, report, unit)
    # Vectors along the first axis (mergekit transposes it last): one per column of the rest.
    width = leaves[0].size // shape[0]

    pairs = [(0, 0), (0, 1), (1, 1)]

    def column_products(start: int, stop: int, arrays: list, _spares: list):
        vectors = [x - arrays[0] for x in arrays[1:]] if base else arrays
        shaped = [v.reshape(-1, width) for v in vectors]
        return np.stack([np.einsum("rc,rc->c", shaped[i], shaped[j]) for i, j in pairs], axis=-1)

    def column_factors():
        sums = np.zeros((width, len(pairs)))
        for block in _blocks.scan(leaves, column_products, width):
            sums += block
        gram = np.stack([sums[:, [0, 1]], sums[:, [1, 2]]], axis=1)  # (width, 2, 2)
        return factors(gram)

    once = _blocks.Once(column_factors)

    def compute(start: int, stop: int, arrays: list, spares: list):
        c = once()  # (width, inputs)
        return _blocks.weighted_sum(arrays, [c[:, i] for i in range(len(arrays))], width, spares[0])

    return _blocks.output_leaf(leaves, keypath, report, compute, width, spare=1, measure=once)


def multislerp(job: LeafMerge):
    """Barycentric interpolation on the hypersphere: the vectors' unit directions are
    averaged in the tangent space at their weighted mean, mapped back, and scaled to the
    weighted mean of their norms."""
    import numpy as np

    from treecli._errors import UsageError
    from treecli.merge_methods import _blocks

    leaves, base, weights, keypath, names, report = (job.leaves, job.has_base, job.weights, job.keypath, job.names,
                                                     job.report)
    normalize_weights, eps = job.shared["normalize_weights"], job.shared["eps"]

    models = leaves[1:] if base else leaves
    if len(models) == 1:
        return models[0]

    def coefficients():
        gram = _blocks.inner_products(leaves, base)
        norms = _blocks.vector_norms(gram)
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
        return _blocks.with_base(on_vectors) if base else on_vectors

    return _blocks.weighted(leaves, coefficients, keypath, names, report)


METHODS = (
    MergeMethod("slerp", "spherical interpolation of two models by t (0 the base), linear when nearly parallel",
                slerp, base="first", models=(1, 1), params=(Param("t", REQUIRED),),
                inputs="two models, the base (t = 0) and one other"),
    MergeMethod("nuslerp", "SLERP of two models (or their task vectors) by t = w1 / (w0 + w1), whole or by rows",
                nuslerp, base="optional", models=(2, 2),
                params=(Param("weight", 1.0, True), Param("nuslerp_row_wise", False, kind=bool),
                        Param("nuslerp_flatten", True, kind=bool))),
    MergeMethod("multislerp", "barycentric interpolation of many models on the hypersphere", multislerp,
                base="optional", models=(1, None),
                params=(Param("weight", 1.0, True), Param("normalize_weights", True, kind=bool), Param("eps", 1e-8))),
)
