"""``linear``: the weighted sum ``Σ wᵢmᵢ / Σ wᵢ``, what ``average`` computes. One pass."""

from __future__ import annotations

import math

from treecli.merge_methods._method import LeafMerge, MergeMethod, Param


def linear(job: LeafMerge):
    from treecli import _combine
    from treecli._errors import UsageError, option

    weights = job.weights
    if job.shared["normalize"]:
        weights = _combine.normalized(weights)
        if weights is None:
            raise UsageError("the weights sum to 0 and cannot be normalized; use "
                             f"{option('normalize', False)} for task arithmetic", keypath=job.keypath)
    convex = all(w >= 0 for w in weights) and math.isclose(sum(weights), 1.0)
    first = job.leaves[0]
    return _combine.averaged_leaf(job.leaves, weights, first.dtype_name, job.keypath, job.names, job.report, convex)


METHODS = (
    MergeMethod("linear", "Σ wᵢmᵢ / Σ wᵢ", linear, base="refused", models=(1, None),
                params=(Param("weight", 1.0, True), Param("normalize", True, kind=bool))),
)
