"""Running a registered method: the inputs checked against what it takes, then each
float leaf merged by its kernel with that leaf's settings (the rest of the tree as
``average`` treats it)."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from treecli import _combine, _leaf
from treecli._combine import AverageReport
from treecli._errors import UsageError, option
from treecli.merge_methods import REQUIRED, LeafMerge, LeafSettings, MergeMethod

# The flags of ``merge`` that take rules, by the parameter they set (``lambda_``: a Python keyword).
RULE_FLAGS = {"density": "density", "lambda": "lambda_", "t": "t", "gamma": "gamma", "epsilon": "epsilon"}


def check_inputs(method: MergeMethod, has_base: bool, models: int, where: str = "") -> None:
    """A line naming what ``method`` needs when the inputs do not fit it."""
    if method.base == "required" and not has_base:
        raise UsageError(f"{method.name} needs a base model{where} (the task vectors are each model less the base): "
                         f"give {option('base', 'BASE')}")
    low, high = method.models
    given = models + has_base if method.base == "first" else models
    if method.base == "first":
        low, high = low + 1, None if high is None else high + 1
    if given < low or (high is not None and given > high):
        if method.inputs:
            wanted = method.inputs
        else:
            wanted = (f"exactly {low}" if low == high else f"at least {low}" if high is None else f"{low} to {high}")
            wanted += f" model{'s' if (high or low) != 1 else ''}"
            wanted += " besides the base" if not (method.takes_no_base or method.base == "first") else ""
        raise UsageError(f"{method.name} merges {wanted}{where}; {given} were given")


def merge_with(method: MergeMethod, base: Any, trees: list[Any], settings: Callable[[tuple], LeafSettings], *,
               names: list[str], base_name: str = "base", seed: int = 0, non_float: str = "last",
               checks: Sequence[Callable[[], None]] = ()) -> tuple[Any, AverageReport]:
    """Merge ``trees`` (and ``base``) leaf by leaf with each leaf's ``settings``: structures
    compared and ``checks`` run before any data is read."""
    inputs, input_names = ([base] if base is not None else []) + trees, ([base_name] if base is not None else []) + names

    def merged(kp: tuple, text: str, leaves: list[_leaf.ArrayLeaf], report: AverageReport) -> Any:
        return leaf_merge(method, LeafMerge(leaves, base is not None, settings(kp), seed, text, input_names, report))

    return _combine.combine_inputs(inputs, input_names, non_float, merged, "merged", checks=checks)


def leaf_merge(method: MergeMethod, job: LeafMerge) -> _leaf.ArrayLeaf:
    """One float leaf merged by ``method``, its settings checked first."""
    for p in method.params:
        values = [m[p.name] for m in job.per_model] if p.per_model else [job.shared[p.name]]
        if any(v is REQUIRED for v in values):
            raise UsageError(f"{method.name} needs {option(RULE_FLAGS.get(p.name, p.name), p.name.upper())} for "
                             "this leaf", keypath=job.keypath)
        if p.kind is float and any(v is not None and not (isinstance(v, (int, float)) and math.isfinite(v))
                                   for v in values):
            raise UsageError(f"{p.name} must be a finite number, not {values}", keypath=job.keypath)
    if job.leaves[0].size == 0:
        return job.leaves[0]
    return method.kernel(job)
