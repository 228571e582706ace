"""``average``: streaming weighted averages of N trees (model soups, checkpoint
averaging, linear merges, task arithmetic), on the combining engine (``_combine``,
whose docstring says how leaves are combined and why not ``weights @ stack(leaves)``).
"""

from __future__ import annotations

from typing import Any

from treecli._combine import AverageReport, linear


def average(
    trees: list[Any],
    weights: list[float] | None = None,
    *,
    names: list[str] | None = None,
    normalize: bool = True,
    dtype: str | None = None,
    non_float: str = "last",
) -> tuple[Any, AverageReport]:
    """The weighted average of trees with the same key paths, shapes and dtypes.

    Args:
        trees: two or more trees (lazy leaves, NumPy or JAX arrays).
        weights: one per tree (default equal); normalized to sum 1 unless ``normalize=False``.
        names: how to call each input in messages (file names).
        dtype: output dtype of float leaves (default: each leaf's own).
        non_float: what to do with integer, bool and non-array leaves that differ between
            inputs: ``"last"`` (the default) copies them from the last input, ``"first"``
            from the first; ``"error"`` refuses. The report's ``notes()`` name them.

    Returns:
        The averaged tree (computed leaves: data is produced when read) and a
        report that fills in while it is read.

    Raises:
        StructureError: the trees differ in key paths, shapes or dtypes, or
            integer/bool/non-array leaves differ (listed diff-style).
        UsageError: bad weights.

    Example:
        >>> soup, _ = treecli.average([a, b, c], [1, 2, 3])
    """
    return linear(trees, weights, names=names, normalize=normalize, dtype=dtype, non_float=non_float)
