"""The means of many models: the Karcher (Riemannian) mean of their directions, and
model_stock's interpolation toward the base by the task vectors' mean cosine. Both from
the inner products of their vectors (one pass), then a weighted sum (a second)."""

from __future__ import annotations

import math

from treecli.merge_methods._method import LeafMerge, MergeMethod, Param


def karcher(job: LeafMerge):
    """The Karcher (Riemannian) mean of the inputs' directions, iterated as mergekit does
    (equal weights, ``max_iter`` steps, stopping under ``tol``), scaled by their mean norm."""
    import numpy as np

    from treecli.merge_methods import _blocks

    leaves, keypath, names, report = job.leaves, job.keypath, job.names, job.report
    max_iter, tol = int(job.shared["max_iter"]), job.shared["tol"]

    if len(leaves) == 1:
        return leaves[0]

    def coefficients():
        gram = _blocks.inner_products(leaves, base=False)
        norms = _blocks.vector_norms(gram)
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

    return _blocks.weighted(leaves, coefficients, keypath, names, report)


def model_stock(job: LeafMerge):
    """``t · mean(models) + (1 − t) · base``, ``t = N cos / (1 + (N − 1) cos)`` from the mean
    cosine between the task vectors, over the leaf or (``filter_wise``) each row."""
    import numpy as np

    from treecli.merge_methods import _blocks

    leaves, keypath, names, report = job.leaves, job.keypath, job.names, job.report
    filter_wise = job.shared["filter_wise"]

    count = len(leaves) - 1
    unit = _blocks.row_length(leaves[0].shape) if filter_wise and len(leaves[0].shape) >= 2 else None

    def coefficients():
        gram = _blocks.inner_products(leaves, base=True, unit=unit)
        norms = _blocks.vector_norms(gram)
        cosines = [np.clip(gram[..., i, j] / np.maximum(norms[..., i] * norms[..., j], 1e-6), -1.0, 1.0)
                   for i in range(count) for j in range(i + 1, count)]
        cosine = np.mean(cosines, axis=0)
        denominator = 1.0 + (count - 1) * cosine
        singular = np.abs(denominator) < 1e-6  # no finite estimate: mergekit keeps the base there
        t = np.where(singular, 0.0, count * cosine / np.where(singular, 1.0, denominator))
        return np.stack([1.0 - t] + [t / count] * count, axis=-1)

    return _blocks.weighted(leaves, coefficients, keypath, names, report, unit)


METHODS = (
    MergeMethod("karcher", "the Riemannian (Karcher) mean of the models' directions, scaled by the mean norm",
                karcher, base="added", models=(1, None), params=(Param("max_iter", 10, kind=int), Param("tol", 1e-5))),
    MergeMethod("model_stock", "t·mean(models) + (1 − t)·base, t from the task vectors' mean cosine", model_stock,
                base="required", models=(2, None), params=(Param("filter_wise", False, kind=bool),)),
)
