"""``merge``: task arithmetic, TIES, DARE and SLERP, streamed like ``average``.

The methods and their defaults are mergekit's (``generalized_task_arithmetic``,
``sparsify``, ``slerp``):

- task vectors ``dᵢ = mᵢ − base``; TIES keeps each one's ``density`` fraction of
  largest magnitudes (exactly ``k = int(density · n)``), DARE keeps each element
  with probability ``density`` and, by default, rescales by ``1/density``;
- TIES and DARE-TIES elect a sign per element from the weighted sum ``Σ wᵢdᵢ`` (``≥ 0``
  is positive) and keep only the weighted deltas that agree with it;
- the mixed delta is ``Σ wᵢdᵢ`` (over the agreeing ones), divided by ``Σ wᵢ`` (over
  the same) when normalizing: by default for TIES only; then scaled by ``lambda``;
- SLERP interpolates two models by the angle between their flattened leaves, and
  falls back to linear interpolation when ``|cos| > 0.9995``.

Everything is computed in float64 a block at a time and rounded to the base's
dtype at the end; mergekit computes in the models' dtype. Leaves of other dtypes
(integer, bool, non-array) follow ``average``'s rules.

Streaming needs, per leaf, what mergekit reads off a whole tensor: SLERP one
pass for the dot product and the norms; TIES the exact ``k``-th largest
magnitude of each task vector, found by a radix select over the float32 bit
patterns of ``|dᵢ|`` (mergekit ranks float32 magnitudes too): one pass histograms
the high 16 bits, a second the low 16 bits inside the bin that holds the ``k``-th
and records where that bin's values lie; when values equal to the ``k``-th straddle
the cut, the first ones in element order are kept (mergekit's ``topk`` keeps an
unspecified set), found from those records or, past 4M of them, by a third pass. DARE's coin flips come from a counter-based
generator (SplitMix64's mixer) keyed by the seed, the leaf's key path and the model,
at each element's offset: the same bytes whatever the chunk size or thread count.
"""

from __future__ import annotations

import functools
import hashlib
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable

from treecli import _average, _keypath, _leaf, _tree
from treecli._average import SUB_CHUNK, AverageReport
from treecli._bytes import stream
from treecli._errors import KeyPathError, UsageError, option
from treecli._keypath import format_keypath

SLERP_PARALLEL = 0.9995  # mergekit's DOT_THRESHOLD: closer to parallel than this, interpolate linearly
SLERP_EPS = 1e-8


@dataclass(frozen=True)
class Method:
    sparsify: str | None  # "magnitude" (TIES), "random" (DARE) or None
    consensus: bool  # elect a sign per element
    normalize: bool  # divide by the sum of the (agreeing) weights
    rescale: bool  # DARE: divide what is kept by density


TASK_METHODS = {
    "task_arithmetic": Method(None, False, False, False),
    "ties": Method("magnitude", True, True, False),
    "dare_ties": Method("random", True, False, True),
    "dare_linear": Method("random", False, False, True),
}
METHODS = ("linear", *TASK_METHODS, "slerp")


class Scoped:
    """A parameter given as rules: ``VALUE`` is the default, ``PATTERN=VALUE`` the value
    for the leaves under a pattern (``--density 0.5 --density 'model.layers.*.mlp.**=0.7'``)."""

    def __init__(self, flag: str, rules: list[str] | float | None, default: float | None,
                 check: Callable[[float], bool], requirement: str):
        self.flag = flag
        self.default = default
        self.rules: list[tuple[str, str, Any, float]] = []  # (rule, pattern, parsed pattern, value)
        texts = [] if rules is None else [str(rules)] if isinstance(rules, (int, float)) else list(rules)
        defaults = []
        for text in texts:
            try:
                pattern, value_text = _keypath.split_assignment(text)
            except KeyPathError:
                pattern, value_text = None, text
            try:
                value = float(value_text)
            except ValueError:
                raise UsageError(f"{option(flag, text)}: {value_text.strip()!r} is not a number") from None
            if not math.isfinite(value) or not check(value):
                raise UsageError(f"{option(flag, text)}: {requirement}")
            if pattern is None:
                defaults.append(text)
                self.default = value
            else:
                self.rules.append((text, pattern.strip(), _keypath.parse(pattern.strip()), value))
        if len(defaults) > 1:
            raise UsageError(f"two defaults ({option(flag, defaults[0])}, {option(flag, defaults[1])}); give one")

    def check_matches(self, tree: Any) -> None:
        for text, pattern, parsed, _ in self.rules:
            if not any(_keypath.matches(parsed, kp) for kp, _ in _tree.iter_nodes(tree)):
                raise _tree.no_match(tree, pattern, f"{option(self.flag, text)} matches nothing")

    def value(self, keypath: tuple) -> float | None:
        hits = [(text, value) for text, _, parsed, value in self.rules if _keypath.covers(parsed, keypath)]
        if len(hits) > 1:
            raise KeyPathError(f"matched by two rules: {option(self.flag, hits[0][0])} and "
                               f"{option(self.flag, hits[1][0])}", keypath=format_keypath(keypath))
        return hits[0][1] if hits else self.default


def merge(
    trees: list[Any],
    method: str,
    *,
    base: Any = None,
    weights: list[float] | None = None,
    density: list[str] | float | None = None,
    lambda_: list[str] | float | None = None,
    t: list[str] | float | None = None,
    seed: int = 0,
    normalize: bool | None = None,
    names: list[str] | None = None,
    base_name: str = "base",
    non_float: str = "last",
) -> tuple[Any, AverageReport]:
    """Merge trees with mergekit's methods, streaming: see the module's docstring.

    Args:
        trees: the models (lazy leaves, NumPy or JAX arrays).
        method: ``linear``, ``task_arithmetic``, ``ties``, ``dare_linear``, ``dare_ties``
            or ``slerp``.
        base: the base model; required by the task methods. For ``slerp`` the base
            and one model, or two models without a base (the first is ``t = 0``).
        weights: one per model (default 1 each).
        density, lambda_, t: a number, or rules (``"0.5"``, ``"model.layers.*=0.7"``).
        seed: DARE's random seed.
        normalize: divide by the summed weights (default: the method's own).
        non_float: as ``average``'s.

    Returns:
        The merged tree (computed leaves) and a report that fills in while it is read.
    """
    if method not in METHODS:
        raise UsageError(f"unknown merge method {method!r}; choose one of {', '.join(METHODS)}")
    names = names or [f"model {i}" for i in range(len(trees))]
    weights = [1.0] * len(trees) if weights is None else [float(w) for w in weights]
    if len(weights) != len(trees):
        raise UsageError(f"{len(weights)} weights for {len(trees)} models")
    if method == "linear":
        if base is not None:
            raise UsageError(f"the linear method takes no base; average the models ({option('base', 'BASE')} "
                             "is for the task methods and slerp)")
        return _average.average(list(trees), weights, names=names,
                                normalize=True if normalize is None else normalize, non_float=non_float)
    if method == "slerp":
        models = ([base] if base is not None else []) + list(trees)
        if len(models) != 2:
            raise UsageError(f"slerp interpolates two models; {len(models)} were given")
        if density is not None or lambda_ is not None:
            raise UsageError(f"slerp takes {option('t', 'T')}; {option('density', 'D')} and "
                             f"{option('lambda_', 'L')} are for the task methods")
        ts = Scoped("t", t, None, lambda v: True, "a finite number")
        if ts.default is None and not ts.rules:
            raise UsageError(f"slerp needs {option('t', 'T')}: 0 gives the first model (the base), 1 the second")

        def interpolated(kp: tuple, text: str, leaves: list[_leaf.ArrayLeaf]) -> _leaf.ComputedLeaf:
            return _slerp_leaf(leaves[0], leaves[1], ts.value(kp), text)

        return _merge_leaves(models, ([base_name] if base is not None else []) + names, non_float, interpolated,
                             checked=[ts])
    if base is None:
        raise UsageError(f"{method} merges task vectors (model - base): give {option('base', 'BASE')}")
    if not trees:
        raise UsageError(f"{method} needs at least one model besides the base")
    spec = TASK_METHODS[method]
    if t is not None:
        raise UsageError(f"{option('t', 'T')} is slerp's; {method} takes {option('density', 'D')} and "
                         f"{option('lambda_', 'L')}")
    densities = Scoped("density", density, 1.0, lambda v: 0 < v <= 1, "a density must lie in (0, 1]")
    lambdas = Scoped("lambda_", lambda_, 1.0, lambda v: True, "a finite number")
    if spec.sparsify is None and density is not None:
        raise UsageError(f"{method} keeps every element; {option('density', 'D')} is for ties and dare_*")
    normalize = spec.normalize if normalize is None else normalize

    def merged(kp: tuple, text: str, leaves: list[_leaf.ArrayLeaf]) -> _leaf.ComputedLeaf:
        return _task_leaf(leaves[0], leaves[1:], weights, spec, densities.value(kp), lambdas.value(kp),
                          normalize, seed, text)

    return _merge_leaves([base, *trees], [base_name, *names], non_float, merged, checked=[densities, lambdas])


def _merge_leaves(trees: list[Any], names: list[str], non_float: str,
                  merged: Callable[[tuple, str, list[_leaf.ArrayLeaf]], Any], checked: list[Scoped]
                  ) -> tuple[Any, AverageReport]:
    """Compare structures before any data is read, then merge float leaves and copy the rest."""
    return _average.combine_inputs(trees, names, non_float, lambda kp, text, leaves, _: merged(kp, text, leaves),
                                   "merged", checks=[functools.partial(s.check_matches, trees[0]) for s in checked])


# --- task vectors: task arithmetic, TIES, DARE ---------------------------------------------------


def _task_leaf(base: _leaf.ArrayLeaf, models: list[_leaf.ArrayLeaf], weights: list[float], spec: Method,
               density: float, scale: float, normalize: bool, seed: int, keypath: str) -> _leaf.ComputedLeaf:
    import numpy as np

    sparse = spec.sparsify is not None and density < 1 and base.size > 0
    if sparse and spec.sparsify == "magnitude" and int(density * base.size) == 0:  # mergekit refuses it too
        raise UsageError(f"density {density} keeps no element of a leaf of {base.size}; raise it", keypath=keypath)
    trims = _Trims(base, models, density, keypath) if sparse and spec.sparsify == "magnitude" else None
    out_dtype = base.dtype
    weight_sum = math.fsum(weights) if abs(math.fsum(weights)) >= 1e-8 else 1.0  # mergekit's guard

    def fill(start: int, stop: int, out) -> None:
        # In place wherever it can be: each full-length pass over a block costs as much as reading it.
        b = base.read_flat(start, stop).astype(np.float64)
        mixed = np.zeros(stop - start)
        total = np.zeros(stop - start) if spec.consensus else None
        weighted = []
        for i, (model, w) in enumerate(zip(models, weights)):
            delta = model.read_flat(start, stop).astype(np.float64)
            delta -= b
            if trims is not None:
                delta *= trims.keep(i, start, stop, delta)
            elif sparse:
                delta *= dare_keep(seed, keypath, i, start, stop, density)
                if spec.rescale:
                    delta /= density
            if w != 1:
                delta *= w
            if total is None:
                mixed += delta
            else:
                total += delta
                weighted.append(delta)
        if total is not None:
            # The elected sign is + where the weighted sum is >= 0. Multiplied by it, a weighted
            # delta that agrees is > 0; fmax drops the rest (zeros and NaNs agree with neither).
            sign = np.where(total >= 0, 1.0, -1.0)
            divisor = np.zeros(stop - start) if normalize else None
            for wd, w in zip(weighted, weights):
                wd *= sign
                np.fmax(wd, 0.0, out=wd)
                mixed += wd
                if divisor is not None:
                    divisor += (wd > 0) * w
            mixed *= sign
            if divisor is not None:
                divisor[divisor == 0] = 1
                mixed /= divisor
        elif normalize:
            mixed /= weight_sum
        if scale != 1:
            mixed *= scale
        mixed += b
        out[...] = mixed

    def fill_chunk(start: int, stop: int, out) -> None:
        stream.on_two_threads(fill, start, stop, out, SUB_CHUNK)

    return _leaf.ComputedLeaf(base.shape, out_dtype, fill=fill_chunk)


def dare_keep(seed: int, keypath: str, model: int, start: int, stop: int, density: float):
    """DARE's keep mask for elements ``[start, stop)`` of one model's task vector.

    Counter-based: elements ``2j`` and ``2j + 1`` take the low and high 32 bits of
    SplitMix64's output for the state ``key + (j + 1) * golden``, the key hashed from
    (seed, key path, model), so no chunking or thread count changes a coin. An element
    is kept where its 32 bits are below ``density * 2**32``."""
    import numpy as np

    key = int.from_bytes(hashlib.blake2b(f"{seed}\0{keypath}\0{model}".encode(), digest_size=8).digest(), "little")
    with np.errstate(over="ignore"):
        z = np.arange(start // 2 + 1, (stop + 1) // 2 + 1, dtype=np.uint64)
        z *= np.uint64(0x9E3779B97F4A7C15)
        z += np.uint64(key)
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    coins = z.view("<u4")[start % 2 : start % 2 + stop - start]
    return coins < np.uint32(min(2**32 - 1, int(density * 2**32)))


class _Trims:
    """TIES' trim of each task vector of one leaf: which elements are among the ``k``
    largest magnitudes, found on first use by streaming passes (module docstring)."""

    # Pass B keeps the (offset, low bits) of the elements in the bin that holds the cut,
    # up to this many per leaf, so that ties at the cut need no third pass.
    MAX_RECORDED = 1 << 22

    def __init__(self, base: _leaf.ArrayLeaf, models: list[_leaf.ArrayLeaf], density: float, keypath: str):
        self._base, self._models, self._keypath = base, models, keypath
        self._k = int(density * base.size)
        self._lock = threading.Lock()
        self._cuts: list[tuple[int, int | None]] | None = None  # per model: (threshold bits, cut offset)

    def keep(self, model: int, start: int, stop: int, delta) -> Any:
        with self._lock:
            if self._cuts is None:
                self._cuts = self._select()
        threshold, cut = self._cuts[model]
        keys = _magnitude_bits(delta)
        keep = keys >= threshold
        if cut is not None and cut < stop:  # of the values equal to the threshold, those from cut on go
            tail = keep[max(0, cut - start):]
            tail &= keys[max(0, cut - start):] > threshold
        return keep

    def _select(self) -> list[tuple[int, int | None]]:
        import numpy as np

        n = len(self._models)
        high = [np.zeros(1 << 16, np.int64) for _ in range(n)]

        def high_pass(i: int, keys, start: int) -> None:
            # The high halves as uint16: bincount of uint32 values ran 4x slower here.
            high[i] += np.bincount((keys >> 16).astype(np.uint16), minlength=1 << 16)

        self._scan(high_pass)
        bins = [_kth_bin(h, self._k) for h in high]  # (bin, count above it)
        low = [np.zeros(1 << 16, np.int64) for _ in range(n)]
        recorded: list[list | None] = [[] for _ in range(n)]  # (offsets, low bits) inside the bin
        room = [self.MAX_RECORDED // n] * n

        def low_pass(i: int, keys, start: int) -> None:
            inside = np.flatnonzero((keys >> 16) == bins[i][0])
            bits = (keys[inside] & 0xFFFF).astype(np.uint16)
            low[i] += np.bincount(bits, minlength=1 << 16)
            room[i] -= len(inside)
            if room[i] < 0:
                recorded[i] = None
            elif recorded[i] is not None:
                recorded[i].append((inside + start, bits))

        self._scan(low_pass)
        cuts, needed = [], []
        for i in range(n):
            lo, above_lo = _kth_bin(low[i], self._k - bins[i][1])
            threshold = (bins[i][0] << 16) | lo
            take = self._k - bins[i][1] - above_lo  # how many values equal to the threshold are kept
            cut = None
            if take < low[i][lo] and recorded[i] is not None:
                offsets = np.concatenate([o for o, _ in recorded[i]])
                bits = np.concatenate([b for _, b in recorded[i]])
                cut = int(offsets[bits == lo][take])  # the first value equal to the threshold not kept
            cuts.append([threshold, cut])
            needed.append(take if take < low[i][lo] and recorded[i] is None else 0)
        if any(needed):
            self._find_cuts(cuts, needed)
        return [(int(threshold), cut) for threshold, cut in cuts]

    def _find_cuts(self, cuts: list, needed: list[int]) -> None:
        """A third pass, when the bin at the cut held too many values to record: where, in
        element order, the first value equal to the threshold that is not kept lies."""
        import numpy as np

        seen = [0] * len(needed)

        def tie_pass(i: int, keys, start: int) -> None:
            if not needed[i] or cuts[i][1] is not None:
                return
            ties = np.flatnonzero(keys == cuts[i][0])
            if seen[i] + len(ties) > needed[i]:
                cuts[i][1] = start + int(ties[needed[i] - seen[i]])
            seen[i] += len(ties)

        self._scan(tie_pass)

    def _scan(self, visit: Callable[[int, Any, int], None]) -> None:
        """One pass over the leaf in order: ``visit(model, magnitude bits, start)`` per block.
        (Two threads taking blocks in turn were no faster: bincount holds the GIL.)"""
        import numpy as np

        wide = self._base.dtype.itemsize > 4
        for start in range(0, self._base.size, SUB_CHUNK):
            stop = min(self._base.size, start + SUB_CHUNK)
            b = self._base.read_flat(start, stop).astype(np.float64 if wide else np.float32)
            for i, model in enumerate(self._models):
                # Up to float32 inputs the float32 difference is float32(|exact difference|): the same keys.
                visit(i, _magnitude_bits(np.subtract(model.read_flat(start, stop), b, dtype=b.dtype)), start)


def _magnitude_bits(delta):
    """``|delta|`` as float32 bit patterns: for non-negative floats, ordered as the values."""
    import numpy as np

    return np.abs(delta).astype(np.float32, copy=False).view(np.uint32)


def _kth_bin(histogram, k: int) -> tuple[int, int]:
    """The bin holding the ``k``-th largest value, and how many values lie above it."""
    import numpy as np

    from_top = np.cumsum(histogram[::-1])
    position = int(np.searchsorted(from_top, k))  # first index where the running count reaches k
    bin_index = len(histogram) - 1 - position
    above = int(from_top[position - 1]) if position else 0
    return bin_index, above


# --- SLERP ---------------------------------------------------------------------------------------


def _slerp_leaf(v0: _leaf.ArrayLeaf, v1: _leaf.ArrayLeaf, t: float | None, keypath: str) -> _leaf.ComputedLeaf:
    import numpy as np

    if t is None:
        raise UsageError(f"no {option('t', 'PATTERN=T')} rule covers this leaf; add a default {option('t', 'T')}",
                         keypath=keypath)

    lock = threading.Lock()
    factors: list[tuple[float, float]] = []

    def sums(thread: int, totals: list[float]) -> None:
        """Dot product and squared norms over every other block (two threads: the BLAS
        calls let go of the GIL)."""
        for start in range(thread * SUB_CHUNK, v0.size, 2 * SUB_CHUNK):
            stop = min(v0.size, start + SUB_CHUNK)
            a = v0.read_flat(start, stop).astype(np.float64)
            b = v1.read_flat(start, stop).astype(np.float64)
            totals[0] += float(a @ b)
            totals[1] += float(a @ a)
            totals[2] += float(b @ b)

    def coefficients() -> tuple[float, float]:
        with lock:
            if not factors:
                halves = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
                stream.in_flight([lambda: sums(0, halves[0]), lambda: sums(1, halves[1])])
                dot, norm0, norm1 = (x + y for x, y in zip(*halves))
                factors.append(_slerp_factors(t, dot, math.sqrt(norm0), math.sqrt(norm1)))
        return factors[0]

    def fill(start: int, stop: int, out) -> None:
        s0, s1 = coefficients()
        out[...] = s0 * v0.read_flat(start, stop).astype(np.float64) + s1 * v1.read_flat(start, stop)

    return _leaf.ComputedLeaf(v0.shape, v0.dtype, fill=fill)


def _slerp_factors(t: float, dot: float, norm0: float, norm1: float) -> tuple[float, float]:
    """The weights of ``v0`` and ``v1``: mergekit normalizes each (when its norm exceeds
    1e-8), takes the cosine, and interpolates linearly when it is nearly ±1."""
    cosine = dot / ((norm0 if norm0 > SLERP_EPS else 1.0) * (norm1 if norm1 > SLERP_EPS else 1.0))
    if abs(cosine) > SLERP_PARALLEL:
        return 1.0 - t, t
    theta = math.acos(cosine)
    return math.sin((1 - t) * theta) / math.sin(theta), math.sin(t * theta) / math.sin(theta)
