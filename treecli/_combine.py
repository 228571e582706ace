"""The combining engine of ``average``, ``merge`` and ``edit``: same-structured trees
combined leaf by leaf, float leaves as streaming weighted sums, the rest copied.

Float leaves accumulate in float64 (see ``_dtypes.accumulator`` for why not
float32), sub-chunk by sub-chunk into reused buffers, and are cast back to
their dtype with round-to-nearest-even (bf16 stays bf16). Integer, bool and non-array leaves
must be equal across inputs and are copied bit-exactly. Nothing is read until
a writer asks for chunks, except the equality checks, which run up front so
that a mismatch is an error before anything is written.

Why not ``weights @ stack(leaves)``: it contracts the wrong axis for leaves of
two or more dimensions, and needs N copies of each leaf in memory.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from treecli import _dtypes, _leaf, _tree
from treecli._bytes import stream
from treecli._errors import StructureError, UsageError, counted, option
from treecli._keypath import format_keypath

# Elements per inner step, and per block handed to a thread, with float64 buffers.
# Measured here (3 x 0.5 GiB, two threads, noisy machine): bf16 64K 1.5-2.2 s,
# 128K 1.05-1.4 s, 256K 2.2 s; fp32 64K 0.8 s, 128K 0.58 s, 256K 1.1 s. Small
# steps lose to per-call overhead and GIL hand-offs, large ones to cache misses.
SUB_CHUNK = 128 * 1024


@dataclass
class AverageReport:
    """What averaging found, filled while the output is written."""

    nonfinite_inputs: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (keypath, input) -> [nan, inf]
    nonfinite_outputs: dict[str, int] = field(default_factory=dict)  # keypath -> count
    copied: list[str] = field(default_factory=list)  # int/bool/non-array leaves copied from one input
    differing: list[str] = field(default_factory=list)  # those of them that differ between inputs
    copied_from: str = ""  # the input they came from
    messages: list[str] = field(default_factory=list)  # other warnings (a merge config's ignored keys, ...)
    promoted: dict[str, str] = field(default_factory=dict)  # keypath -> the dtype mixed input dtypes met in
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def warnings(self) -> list[str]:
        lines = [f"{kp}: {nan} NaN and {inf} Inf values in {name}"
                 for (kp, name), (nan, inf) in self.nonfinite_inputs.items()]
        lines += [f"{kp}: non-finite values in the output: {count}" for kp, count in self.nonfinite_outputs.items()]
        return list(self.messages) + lines

    def notes(self) -> list[str]:
        lines = []
        if self.promoted:
            by_dtype: dict[str, list[str]] = {}
            for keypath, dtype in self.promoted.items():
                by_dtype.setdefault(dtype, []).append(keypath)
            for dtype, keypaths in by_dtype.items():
                lines.append(f"{counted(len(keypaths), 'leaf', 'leaves')} of mixed float dtypes computed in {dtype} "
                             f"(as mergekit promotes them): {_shown(keypaths)}")
        if self.differing:
            lines.append(f"{len(self.differing)} integer, bool or non-array leaves differ between the inputs; copied "
                         f"from {self.copied_from}: {_shown(self.differing)}")
        return lines


def _shown(keypaths: list[str]) -> str:
    """The first few of a list of key paths, for a note."""
    return ", ".join(keypaths[:8]) + (", ..." if len(keypaths) > 8 else "")


def linear(
    trees: list[Any],
    weights: list[float] | None = None,
    *,
    names: list[str] | None = None,
    normalize: bool = True,
    dtype: str | None = None,
    non_float: str = "last",
) -> tuple[Any, AverageReport]:
    """The weighted sum of trees with the same key paths, shapes and dtypes: what
    ``_average.average`` is (its docstring gives the arguments and errors), and merge's
    ``linear``."""
    if len(trees) < 1:
        raise UsageError("average needs at least one input")
    names = names or [f"input {i}" for i in range(len(trees))]
    weights = [1.0] * len(trees) if weights is None else [float(w) for w in weights]
    if len(weights) != len(trees):
        raise UsageError(f"{len(weights)} weights for {len(trees)} inputs")
    if non_float not in ("error", "first", "last"):
        raise UsageError(f"non_float must be 'last', 'first' or 'error', not {non_float!r}")
    if not all(math.isfinite(w) for w in weights):
        raise UsageError(f"weights {weights} are not all finite numbers")
    if normalize:
        normal = normalized(weights)
        if normal is None:
            raise UsageError("the weights sum to 0 and cannot be normalized; use "
                             f"{option('normalize', False)} for task arithmetic")
        weights = normal
    out_dtype = _dtypes.parse(dtype) if dtype else None
    if out_dtype and not _dtypes.is_float(out_dtype):
        raise UsageError(f"{option('dtype', dtype)}: the output of an average must be a floating-point dtype")

    convex = all(w >= 0 for w in weights) and math.isclose(sum(weights), 1.0)

    def averaged(keypath: tuple, text: str, leaves: list[_leaf.ArrayLeaf], report: AverageReport) -> Any:
        leaf = averaged_leaf(leaves, weights, out_dtype or leaves[0].dtype_name, text, names, report, convex)
        if out_dtype and isinstance(leaf, _leaf.ComputedLeaf):
            leaf.asked_dtype = True  # (written in the dtype asked for: never quantized again)
        return leaf

    return combine_inputs(trees, names, non_float, averaged, "averaged")


def normalized(weights: list[float]) -> list[float] | None:
    """``weights`` divided by their sum, or None where they sum to 0."""
    try:
        total = math.fsum(weights)
    except OverflowError:  # 1e308 + 1e308: scaled by the largest first, never inf (and zeros)
        largest = max(abs(w) for w in weights)
        weights = [w / largest for w in weights]
        total = math.fsum(weights)
    return None if total == 0 else [w / total for w in weights]


def combine_inputs(trees: list[Any], names: list[str], non_float: str,
                   float_leaf: Callable[[tuple, str, list[_leaf.ArrayLeaf], AverageReport], Any], verb: str,
                   checks: Sequence[Callable[[], None]] = ()) -> tuple[Any, AverageReport]:
    """The tree of ``float_leaf(keypath, text, leaves, report)`` for the float array leaves
    of same-structured inputs, and of their integer, bool and non-array leaves copied
    (per ``non_float``). Float leaves that differ only in dtype are computed in the one
    they promote to (``promoted_inputs``). Structures are compared first, then ``checks``
    run, before any data is read."""
    trees, promoted = promoted_inputs(trees)
    differences = _tree.structure_differences(trees, names)
    if differences:
        raise StructureError(f"the inputs differ in {counted(len(differences), 'leaf', 'leaves')}", details=differences)
    for check in checks:
        check()
    report = AverageReport(copied_from=names[0] if non_float == "first" else names[-1])
    report.promoted = promoted
    flats = [_tree.by_text(t) for t in trees]
    mismatched: list[str] = []

    def combine(keypath: tuple, first: Any) -> Any:
        text = format_keypath(keypath)
        leaves = [flat[text] for flat in flats]
        if _leaf.is_array(first) and _dtypes.is_float(_leaf.as_leaf(first).dtype_name):
            return float_leaf(keypath, text, [_leaf.as_leaf(x) for x in leaves], report)
        report.copied.append(text)
        if all(_equal(leaves[0], other) for other in leaves[1:]):
            return first
        if non_float == "error":
            mismatched.append(f"{text}: {'; '.join(_preview(x) + ' in ' + n for x, n in zip(leaves, names))}")
        report.differing.append(text)
        return first if non_float == "first" else leaves[-1]

    result = _tree.map_leaves(combine, trees[0])
    if mismatched:
        raise StructureError(
            f"{len(mismatched)} integer, bool or non-array leaves differ between inputs and cannot be {verb} "
            f"(use {option('non_float', 'last')} or 'first' to copy them from one input)",
            details=mismatched,
        )
    return result, report


def promoted_inputs(trees: list[Any]) -> tuple[list[Any], dict[str, str]]:
    """``trees`` with each float leaf whose dtype differs between them (same key path and
    shape) widened, lazily and exactly, to the dtype they promote to (``_dtypes.promoted``:
    bf16 with f32 is f32, as in mergekit); and those key paths with that dtype."""
    flats = [_tree.by_text(t) for t in trees]
    targets: dict[str, str] = {}
    for text, first in flats[0].items():
        leaves = [flat.get(text) for flat in flats]
        if not all(x is not None and _leaf.is_array(x) for x in leaves):
            continue
        arrays = [_leaf.as_leaf(x) for x in leaves]
        dtypes = {a.dtype_name for a in arrays}
        if len(dtypes) > 1 and all(_dtypes.is_float(d) for d in dtypes) \
                and len({tuple(a.shape) for a in arrays}) == 1:
            targets[text] = _dtypes.promoted(dtypes)
    if not targets:
        return trees, {}

    def widened(keypath: tuple, x: Any) -> Any:
        text = format_keypath(keypath)
        if text not in targets or _leaf.as_leaf(x).dtype_name == targets[text]:
            return x
        return cast_leaf(_leaf.as_leaf(x), targets[text], text, lambda message: None)  # widening: exact

    return [_tree.map_leaves(widened, t) for t in trees], targets


def widened_pair(x: _leaf.ArrayLeaf, y: _leaf.ArrayLeaf, text: str) -> tuple[Any, Any] | None:
    """Two leaves of one shape and different dtypes, both in the dtype that holds each
    exactly (``_dtypes.common``: a model and its bf16 cast meet in float32), read lazily;
    None where their values cannot be compared."""
    target = _dtypes.common(x.dtype_name, y.dtype_name) if tuple(x.shape) == tuple(y.shape) else None
    if target is None:
        return None

    def widened(leaf: _leaf.ArrayLeaf) -> Any:
        return leaf if leaf.dtype_name == target else cast_leaf(leaf, target, text, lambda message: None)

    return widened(x), widened(y)


def averaged_leaf(leaves: list[_leaf.ArrayLeaf], weights: list[float], out_dtype: str, keypath: str,
                   names: list[str], report: AverageReport, convex: bool) -> _leaf.ComputedLeaf:
    import numpy as np

    in_dtype = leaves[0].dtype
    acc_dtype = _dtypes.accumulator(in_dtype)
    out_np = _dtypes.numpy_dtype(_dtypes.name(out_dtype))
    acc_weights = [acc_dtype.type(w) for w in weights]
    # Finite inputs give finite outputs with convex weights into the inputs' own dtype; an
    # output dtype of their own or other weights may overflow: counted, and said once a leaf.
    may_overflow = (not convex or out_np != in_dtype) and out_np != acc_dtype

    def fill_chunk(start: int, stop: int, out) -> None:
        # Two threads take SUB_CHUNK blocks in turn (3 x 1 GiB, medians of 5: fp32 1.71 s
        # on one thread vs 1.60 s on two; bf16, whose casts cost more, gains more).
        stream.on_two_threads(fill, start, stop, out, SUB_CHUNK)

    def fill(start: int, stop: int, out) -> None:
        with scratch_buffers() as buffers:
            fill_with(start, stop, out, *_typed(buffers, acc_dtype, in_dtype))

    def fill_with(start: int, stop: int, out, acc, tmp, raw) -> None:
        n = stop - start
        for s in range(0, n, SUB_CHUNK):
            e = min(n, s + SUB_CHUNK)
            a, t, r = acc[: e - s], tmp[: e - s], raw[: e - s]
            for i, (leaf, w) in enumerate(zip(leaves, acc_weights)):
                leaf.read_into(start + s, start + e, r)
                # The ufunc widens r to float64 in its own small buffers: one pass, exact products.
                # (For bf16 that is ml_dtypes' cast: faster than widening with a shift first,
                # 2.25 s vs 2.75 s median of 5 on 3 x 1 GiB once blocks are shared out.)
                if i == 0:
                    np.multiply(r, w, out=a)
                else:
                    np.multiply(r, w, out=t)
                    a += t
            if not np.isfinite(a).all():
                _count_nonfinite_inputs(leaves, start + s, start + e, keypath, names, report)
            with np.errstate(over="ignore"):  # (counted below, never NumPy's warning)
                out[s:e] = a  # round to nearest even into the leaf's dtype
            if may_overflow:
                bad = int(np.count_nonzero(~np.isfinite(out[s:e].astype(acc_dtype))))
                if bad:
                    with report._lock:
                        report.nonfinite_outputs[keypath] = report.nonfinite_outputs.get(keypath, 0) + bad

    return _leaf.ComputedLeaf(leaves[0].shape, out_np, fill=fill_chunk, inputs=leaves)


def cast_leaf(source: _leaf.ArrayLeaf, dtype_name: str, keypath: str, warn: Callable[[str], None]
              ) -> _leaf.ComputedLeaf:
    """A computed leaf: ``source`` cast to ``dtype_name``; finite values that overflow to inf
    are counted and said through ``warn`` (one line) when the last chunk is read."""

    check = _dtypes.is_float(dtype_name) and _dtypes.is_float(source.dtype_name)
    overflowed = [0]
    lock = threading.Lock()
    # elements per scratch buffer, for the source and for the output's bits
    step = max(1, SUB_CHUNK * 8 // max(source.itemsize, _dtypes.itemsize(dtype_name)))

    def fill_part(start: int, stop: int, out) -> None:
        # The source is read a scratch buffer at a time and cast straight into the output;
        # overflow is looked for in the output (Inf or NaN) and only then counted against
        # the source (finite there): no float64 copies.
        import numpy as np  # (when data is computed: planning and --dry-run go without NumPy)

        with scratch_buffers(3) as (raw, flags, work):
            for s in range(start, stop, step):
                e = min(stop, s + step)
                chunk, cast = raw.view(source.dtype)[: e - s], out[s - start : e - start]
                source.read_into(s, e, chunk)
                with np.errstate(over="ignore", invalid="ignore"):
                    np.copyto(cast, chunk, casting="unsafe")
                if check:
                    infinite = _dtypes.nonfinite(cast, flags.view(bool)[: e - s], work)
                    if infinite.any():
                        infinite &= np.isfinite(chunk)
                        with lock:
                            overflowed[0] += int(np.count_nonzero(infinite))

    def fill(start: int, stop: int, out) -> None:
        # On two threads: the writer, on a third, mostly waits for the cast.
        stream.on_two_threads(fill_part, start, stop, out, step)
        if check and stop == source.size and overflowed[0]:  # the last chunk: one line per leaf
            n = overflowed[0]
            warn(f"{keypath}: {counted(n, 'value')} {'falls' if n == 1 else 'fall'} outside "
                                   f"{dtype_name}'s range and became inf")

    return _leaf.ComputedLeaf(source.shape, dtype_name, fill=fill, inputs=[source])


def cast_floats(tree: Any, dtype: str | None, report: AverageReport) -> Any:
    """``tree`` with its float leaves rounded to ``dtype`` (lazily: ``cast_leaf``), the rest
    as they are; overflow to inf said in ``report``'s messages."""
    if dtype is None:
        return tree

    def cast(kp: tuple, x: Any) -> Any:
        if not _leaf.is_array(x):
            return x
        leaf = _leaf.as_leaf(x)
        # (a leaf stored otherwise, quantized, is cast even to its own dtype: asking for a dtype
        # is what writes its values, dequantized, not its blocks)
        if not _dtypes.is_float(leaf.dtype_name) or (leaf.dtype_name == dtype and not leaf.stored_otherwise):
            if isinstance(leaf, _leaf.ComputedLeaf) and _dtypes.is_float(leaf.dtype_name):
                leaf.asked_dtype = True  # (a merge's leaf already of the dtype asked for: written so)
            return x
        cast = cast_leaf(leaf, dtype, format_keypath(kp), report.messages.append)
        cast.asked_dtype = True  # (a GGUF output writes it in the dtype asked for, never requantized)
        return cast

    return _tree.map_leaves(cast, tree)


_scratch = threading.local()


@contextlib.contextmanager
def scratch_buffers(count: int = 3, elements: int = SUB_CHUNK) -> Iterator[list]:
    """``count`` work buffers of ``elements`` float64s (as bytes), reused by this thread from
    chunk to chunk: fresh memory per step costs more than the arithmetic. (An average of
    averages nests: each level takes its own set.) Pages a caller never touches are never
    resident."""
    import numpy as np

    free = _scratch.__dict__.setdefault((count, elements), [])
    buffers = free.pop() if free else [np.empty(elements * 8, np.uint8) for _ in range(count)]
    try:
        yield buffers
    finally:
        free.append(buffers)


def _typed(buffers: list, acc_dtype, in_dtype) -> tuple:
    """The scratch buffers as accumulator, product and raw input arrays."""
    acc, tmp, raw = buffers
    return acc.view(acc_dtype), tmp.view(acc_dtype), raw.view(in_dtype)[:SUB_CHUNK]


def _count_nonfinite_inputs(leaves, start, stop, keypath, names, report) -> None:
    import numpy as np

    for leaf, name in zip(leaves, names):
        values = leaf.read_flat(start, stop).astype(np.float64)
        nan, inf = int(np.isnan(values).sum()), int(np.isinf(values).sum())
        if nan or inf:
            with report._lock:
                counts = report.nonfinite_inputs.setdefault((keypath, name), [0, 0])
                counts[0] += nan
                counts[1] += inf


def _equal(a: Any, b: Any) -> bool:
    """Bit-exact equality of two leaves (arrays chunk by chunk; NaN equals NaN for scalars)."""
    if _leaf.is_array(a):
        a, b = _leaf.as_leaf(a), _leaf.as_leaf(b)
        return all(_tree.same_bytes(x, y) for x, y in stream.paired_chunks(a, b))
    return _tree.values_equal(a, b)


def _preview(value: Any) -> str:
    if _leaf.is_array(value):
        leaf = _leaf.as_leaf(value)
        if leaf.size <= 4:
            return str(leaf.read().tolist())
        return _tree.describe_leaf(leaf) + " (values differ)"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
