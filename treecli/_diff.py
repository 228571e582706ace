"""``diff``: compare two trees leaf by leaf, streaming one pair of leaves at a time.

Exact by default (the bytes, so NaN payloads and -0.0 count); with ``rtol`` /
``atol``, numerically as ``np.isclose`` does, NaN equal to NaN.

The statistics of a changed leaf are over its finite pairs: equal infinities, and NaN
with NaN, are equal; a pair where a non-finite value meets anything else is counted
(``nonfinite``), never folded into the maximum differences as inf or NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from treecli import _combine, _dtypes, _keypath, _leaf, _tree
from treecli._keypath import format_keypath


@dataclass
class Change:
    keypath: str
    a: str  # description in a: "[2, 3] float32", or a value
    b: str
    max_abs_diff: float | None = None  # over the pairs where both are finite
    max_rel_diff: float | None = None
    nonfinite: int = 0  # pairs where Inf or NaN meets a different value
    compared_in: str | None = None  # the dtype two leaves of different dtypes were compared in


@dataclass
class DiffResult:
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    changed: list[Change] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.changed)


    def as_json(self) -> dict[str, Any]:
        def number(x: float | None) -> Any:
            if x is None or math.isfinite(x):
                return x
            return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")

        def change(c: Change) -> dict[str, Any]:
            entry = {"keypath": c.keypath, "a": c.a, "b": c.b, "max_abs_diff": number(c.max_abs_diff),
                     "max_rel_diff": number(c.max_rel_diff)}
            if c.compared_in:
                entry["compared_in"] = c.compared_in
            return {**entry, "nonfinite_mismatches": c.nonfinite} if c.nonfinite else entry

        return {"equal": self.equal, "only_in_a": self.only_in_a, "only_in_b": self.only_in_b,
                "changed": [change(c) for c in self.changed]}


def diff(a: Any, b: Any, *, rtol: float | None = None, atol: float | None = None, where: list[str] = (),
         progress=None, part: tuple[int, int] = (0, 1),
         gather: Callable[[list[Change]], list[list[Change]]] | None = None) -> DiffResult:
    """Compare two trees: key paths only in one, shape/dtype changes, value differences.

    Args:
        rtol, atol: compare numerically (``|a - b| <= atol + rtol * |b|``, NaN equal
            to NaN); default exact, byte for byte.
        where: only key paths covered by these patterns.
        part: ``(i, n)``: compare only the i-th of n shares of the leaves (by bytes, the
            same shares in every process of a run).
        gather: with ``part``, gives every part's changes for this part's (the processes
            of a run exchange them): the result is the whole diff's.
    """
    patterns = [_keypath.parse(w) for w in where]
    # Keyed by the text form, so that list index 0 (Orbax) and string key "0"
    # (safetensors) are the same key path: `opt_state.0.mu` either way.
    flat_a = {format_keypath(kp): (kp, leaf) for kp, leaf in _tree.flatten(a)}
    flat_b = {format_keypath(kp): (kp, leaf) for kp, leaf in _tree.flatten(b)}

    def wanted(kp: tuple) -> bool:
        return not patterns or any(_keypath.covers(p, kp) for p in patterns)

    result = DiffResult()
    keypaths = {text: kp for text, (kp, _) in {**flat_b, **flat_a}.items()}
    for text, pattern in zip(where, patterns):  # a pattern that matches nothing is no "no differences"
        if not any(_keypath.covers(pattern, kp) for kp in keypaths.values()):
            raise _tree.no_match(a if flat_a else b, text)
    order = sorted(keypaths, key=lambda t: tuple(_keypath.natural_sort_key(k) for k in keypaths[t]))
    owner = _tree.shares([(t, flat_a[t][1]) for t in order if t in flat_a and t in flat_b], part[1])
    for text in order:
        if not wanted(keypaths[text]):
            continue
        if text not in flat_b:
            result.only_in_a.append(text or "<root>")
        elif text not in flat_a:
            result.only_in_b.append(text or "<root>")
        elif owner[text] == part[0]:
            change = _compare(flat_a[text][1], flat_b[text][1], text or "<root>", rtol, atol, progress)
            if change is not None:
                result.changed.append(change)
    if gather is not None:
        rank = {text or "<root>": i for i, text in enumerate(order)}
        result.changed = sorted((c for changes in gather(result.changed) for c in changes),
                                key=lambda c: rank[c.keypath])
    return result


def _compare(x: Any, y: Any, text: str, rtol, atol, progress) -> Change | None:
    if not (_leaf.is_array(x) and _leaf.is_array(y)):
        if _leaf.is_array(x) or _leaf.is_array(y) or not _tree.values_equal(x, y):
            return Change(text, _describe_value(x), _describe_value(y))
        return None
    if not _tree.same_layout(x, y):
        pair = _combine.widened_pair(_leaf.as_leaf(x), _leaf.as_leaf(y), text)
        if pair is None:
            return Change(text, _tree.describe_leaf(x), _tree.describe_leaf(y))
        # Dtypes differ: never "equal", whatever the tolerances; the values are compared, to
        # the last bit, in the dtype holding both, so the numbers are there for every pair.
        found = _compare_arrays(*pair, text, None, None, progress)
        return Change(text, _tree.describe_leaf(x), _tree.describe_leaf(y),
                      found.max_abs_diff if found else 0.0, found.max_rel_diff if found else 0.0,
                      found.nonfinite if found else 0, compared_in=pair[0].dtype_name)
    return _compare_arrays(_leaf.as_leaf(x), _leaf.as_leaf(y), text, rtol, atol, progress)


def _compare_arrays(x, y, text, rtol, atol, progress) -> Change | None:
    from treecli._bytes import stream

    exact = rtol is None and atol is None
    start = 0
    if exact and x.in_local_file and y.in_local_file:
        start = stream.first_difference(x, y, progress)  # (NumPy is only needed from there on)
        if start is None:
            return None

    import numpy as np

    kind = _dtypes.kind(x.dtype_name)
    numeric = kind in "biufc"
    wide = np.complex128 if kind == "c" else np.float64  # x and y share a dtype here
    differs = False
    max_abs = max_rel = 0.0
    nonfinite = 0
    # Chunks come in reused buffers, read ahead on another thread; equal bytes are found
    # at memory speed, and only chunks whose bytes differ are widened to float64.
    for cx, cy in stream.paired_chunks(x, y, start):
        if progress:
            progress(cx.nbytes + cy.nbytes)
        if exact:
            if _tree.same_bytes(cx, cy):
                continue
            if numeric:
                fx, fy = cx.astype(wide), cy.astype(wide)
        else:
            fx, fy = cx.astype(wide), cy.astype(wide)
            if np.all(np.isclose(fx, fy, rtol=rtol or 0.0, atol=atol or 0.0, equal_nan=True)):
                continue
        differs = True
        if numeric:
            with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
                finite = np.isfinite(fx) & np.isfinite(fy)
                same = (fx == fy) | (np.isnan(fx) & np.isnan(fy))  # equal infinities; NaN with NaN
                nonfinite += int(np.count_nonzero(~finite & ~same))
                delta = np.where(finite, np.abs(fx - fy), 0.0)
                rel = np.where(delta == 0, 0.0, delta / np.abs(fy))
            max_abs = max(max_abs, float(delta.max()) if delta.size else 0.0)
            max_rel = max(max_rel, float(rel.max()) if rel.size else 0.0)
    if not differs:
        return None
    description = _tree.describe_leaf(x)
    return Change(text, description, description, max_abs if numeric else None, max_rel if numeric else None,
                  nonfinite)


def _describe_value(value: Any) -> str:
    if _leaf.is_array(value):
        return _tree.describe_leaf(value)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
