"""nearswap: the model's value where it lies within ``t`` of the base, a step of ``t``
toward it further away. Element-wise, one pass."""

from __future__ import annotations

from treecli.merge_methods._method import REQUIRED, LeafMerge, MergeMethod, Param


def nearswap(job: LeafMerge):
    """Where the base and the model are within ``t`` of each other the model's value, further
    apart a step of ``t`` toward it: ``w = clip(t / |a − b|, 0, 1)``, ``w·b + (1 − w)·a``."""
    import numpy as np

    from treecli.merge_methods import _blocks

    leaves, keypath, report, t = job.leaves, job.keypath, job.report, job.shared["t"]

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

    return _blocks.output_leaf(leaves, keypath, report, compute, spare=1)


METHODS = (
    MergeMethod("nearswap", "w·m + (1 − w)·base, w = clip(t / |m − base|, 0, 1)", nearswap, base="required",
                models=(1, 1), params=(Param("t", REQUIRED),)),
)
