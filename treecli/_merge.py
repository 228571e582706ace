"""``merge``: task arithmetic, TIES, DARE and SLERP, streamed like ``average``.

The methods and their defaults are mergekit's (``generalized_task_arithmetic``,
``sparsify``, ``slerp``):

- task vectors ``dᵢ = mᵢ − base``; TIES keeps each one's ``density`` fraction of
  largest magnitudes (exactly ``k = int(density · n)``), DARE keeps each element
  with probability ``density`` and rescales what it keeps (``rescale``): by default as
  mergekit does, to each task vector's L1 norm over the leaf (``‖d‖₁ / ‖d ⊙ keep‖₁``,
  found by a first pass), or by ``1/density`` (the DARE paper's), or not at all;
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
pass for the dot product and the norms; TIES the exact ``k``-th largest magnitude of
each task vector, found by the streaming exact selection of ``_selection``.
DARE's coin flips come from a counter-based generator (SplitMix64's mixer) keyed by
the seed, the leaf's key path and the model, at each element's offset: the same
bytes whatever the chunk size or thread count.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable

from treecli import _combine, _keypath, _leaf, _tree
from treecli._bytes import stream
from treecli._combine import SUB_CHUNK, AverageReport
from treecli._errors import KeyPathError, UsageError, option
from treecli._keypath import format_keypath
from treecli._selection import Space, Trims, key_base, magnitude_keys

SLERP_PARALLEL = 0.9995  # mergekit's DOT_THRESHOLD: closer to parallel than this, interpolate linearly
SLERP_EPS = 1e-8


@dataclass(frozen=True)
class Method:
    sparsify: str | None  # "magnitude" (TIES), "random" (DARE) or None
    consensus: bool  # elect a sign per element
    normalize: bool  # divide by the sum of the (agreeing) weights
    rescale: bool  # DARE: rescale what is kept (``merge``'s ``rescale`` says how)


TASK_METHODS = {
    "task_arithmetic": Method(None, False, False, False),
    "ties": Method("magnitude", True, True, False),
    "dare_ties": Method("random", True, False, True),
    "dare_linear": Method("random", False, False, True),
}
METHODS = ("linear", *TASK_METHODS, "slerp")
RESCALES = ("l1", "density", "none")  # DARE's rescale of what it keeps: mergekit's L1 norm, 1/density, none


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
    rescale: str = "l1",
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
        rescale: how DARE rescales what it keeps of a task vector: ``"l1"`` (mergekit's:
            to the vector's L1 norm over the leaf), ``"density"`` (by ``1/density``) or ``"none"``.
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
        return _combine.linear(list(trees), weights, names=names,
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

        models_names = ([base_name] if base is not None else []) + names

        def interpolated(kp: tuple, text: str, leaves: list[_leaf.ArrayLeaf], report: AverageReport
                         ) -> _leaf.ComputedLeaf:
            return _slerp_leaf(leaves[0], leaves[1], ts.value(kp), text, models_names, report)

        return _merge_leaves(models, models_names, non_float, interpolated, checked=[ts])
    if base is None:
        raise UsageError(f"{method} merges task vectors (model - base): give {option('base', 'BASE')}")
    if not trees:
        raise UsageError(f"{method} needs at least one model besides the base")
    spec = TASK_METHODS[method]
    if t is not None:
        raise UsageError(f"{option('t', 'T')} is slerp's; {method} takes {option('density', 'D')} and "
                         f"{option('lambda_', 'L')}")
    if rescale not in RESCALES:
        raise UsageError(f"{option('rescale', rescale)}: choose one of {', '.join(RESCALES)}")
    if rescale != "l1" and not spec.rescale:
        raise UsageError(f"{option('rescale', rescale)} is DARE's; {method} keeps what it keeps as it is")
    spec = dataclasses.replace(spec, rescale=spec.rescale and rescale != "none")
    rescale_to_l1 = rescale == "l1"
    densities = Scoped("density", density, 1.0, lambda v: 0 < v <= 1, "a density must lie in (0, 1]")
    lambdas = Scoped("lambda_", lambda_, 1.0, lambda v: True, "a finite number")
    if spec.sparsify is None and density is not None:
        raise UsageError(f"{method} keeps every element; {option('density', 'D')} is for ties and dare_*")
    normalize = spec.normalize if normalize is None else normalize

    def merged(kp: tuple, text: str, leaves: list[_leaf.ArrayLeaf], report: AverageReport) -> _leaf.ComputedLeaf:
        return _task_leaf(leaves[0], leaves[1:], weights, spec, densities.value(kp), lambdas.value(kp),
                          normalize, seed, text, report, rescale_to_l1)

    return _merge_leaves([base, *trees], [base_name, *names], non_float, merged, checked=[densities, lambdas])


def _merge_leaves(trees: list[Any], names: list[str], non_float: str,
                  merged: Callable[[tuple, str, list[_leaf.ArrayLeaf], AverageReport], Any], checked: list[Scoped]
                  ) -> tuple[Any, AverageReport]:
    """Compare structures before any data is read, then merge float leaves and copy the rest."""
    return _combine.combine_inputs(trees, names, non_float, merged, "merged", checks=[functools.partial(s.check_matches, trees[0]) for s in checked])


# --- task vectors: task arithmetic, TIES, DARE ---------------------------------------------------


def _task_leaf(base: _leaf.ArrayLeaf, models: list[_leaf.ArrayLeaf], weights: list[float], spec: Method,
               density: float, scale: float, normalize: bool, seed: int, keypath: str,
               report: AverageReport, rescale_to_l1: bool = True) -> _leaf.ComputedLeaf:
    import numpy as np

    sparse = spec.sparsify is not None and density < 1 and base.size > 0
    if sparse and spec.sparsify == "magnitude" and int(density * base.size) == 0:  # mergekit refuses it too
        raise UsageError(f"density {density} keeps no element of a leaf of {base.size}; raise it", keypath=keypath)
    trims = Trims(base, models, density) if sparse and spec.sparsify == "magnitude" else None
    l1 = _L1Rescale(base, models, density, seed, keypath) if sparse and spec.sparsify == "random" and \
        spec.rescale and rescale_to_l1 else None
    in_dtype = base.dtype
    weight_sum = math.fsum(weights) if abs(math.fsum(weights)) >= 1e-8 else 1.0  # mergekit's guard
    # With equal weights the divisor is the weight times a count of agreeing models, kept in bytes.
    counted = len(set(weights)) == 1 and len(weights) < 256
    divisor = None if not (spec.consensus and normalize) else "counts" if counted else "weights"

    def block(start: int, stop: int, out, space: Space) -> None:
        # Every full-length step costs about as much as reading the block: the fewest steps,
        # all into this thread's buffers (fresh memory per step cost more than all the arithmetic).
        # Memory bandwidth, not arithmetic, is the limit here: simple steps ran no faster on two
        # threads or two processes than on one, and the kernel gained 1.4x from its second thread.
        b, b64, d, total = space.base, space.base64, space.delta, space.total
        # Where every kept delta is nonzero (a TIES threshold above 0, and a weight that cannot
        # round one to 0), the negative ones are counted as the kept less the positive ones.
        negatives_from_kept = (divisor == "counts" and trims is not None and trims.keeps_only_nonzero()
                               and abs(weights[0]) >= 2.0**-900)
        base.read_into(start, stop, b)
        np.copyto(b64, b)
        base_key = key_base(b, space) if trims is not None else None
        for i, (model, w) in enumerate(zip(models, weights)):
            m = space.model
            model.read_into(start, stop, m)
            np.copyto(d, m)  # (widening first, then subtracting, beat one mixed-type subtract: 61 vs 76 µs)
            d -= b64  # exact: the difference of two floats of up to 32 bits
            if trims is not None:
                d *= trims.keep(i, start, stop, magnitude_keys(m, base_key, space), space.keep)
            elif sparse:
                d *= dare_keep(seed, keypath, i, start, stop, density, out=space.keep, work=space.coins)
                if l1 is not None:
                    d *= l1.factors()[i]
                elif spec.rescale:
                    d /= density
            if w != 1:
                d *= w
            if i == 0:
                np.copyto(total, d)
            else:
                total += d
            if spec.consensus:
                _tally(d, w, i == 0, divisor, space, kept=space.keep if negatives_from_kept else None)
        if spec.consensus:
            mixed = _elected(space, weights[0] if counted else None, normalize, negatives_from_kept)
        else:
            mixed = total
            if normalize:
                mixed /= weight_sum
        if scale != 1:
            mixed *= scale
        mixed += b64
        finite = np.isfinite(mixed, out=space.flag)
        if not finite.all():
            with report._lock:
                report.nonfinite_outputs[keypath] = (report.nonfinite_outputs.get(keypath, 0)
                                                     + finite.size - int(np.count_nonzero(finite)))
        out[...] = mixed  # round to nearest even into the leaf's dtype

    def fill(start: int, stop: int, out) -> None:
        with _combine.scratch_buffers(Space.BUFFERS) as buffers:
            for s in range(start, stop, SUB_CHUNK):
                e = min(stop, s + SUB_CHUNK)
                block(s, e, out[s - start : e - start], Space(buffers, e - s, in_dtype))

    def fill_chunk(start: int, stop: int, out) -> None:
        if trims is not None:
            trims.select()  # here, on two threads, before any block waits for it
        stream.on_two_threads(fill, start, stop, out, SUB_CHUNK)

    return _leaf.ComputedLeaf(base.shape, in_dtype, fill=fill_chunk, inputs=[base, *models])


def _tally(d, w: float, first: bool, divisor: str | None, space: Space, kept=None) -> None:
    """Adds one weighted delta to the consensus sums: ``Σ|wᵢdᵢ|`` and, for the ``divisor``
    (``None`` when not normalizing), which models are positive and which negative: "counts",
    or "weights" (summed, when they differ). With ``kept`` (the model's keep mask, when every
    kept delta is nonzero), the kept are counted in place of the negative ones."""
    import numpy as np

    if first:
        np.abs(d, out=space.magnitude)
    else:
        np.abs(d, out=space.work)
        space.magnitude += space.work
    if divisor is None:
        return
    for sign, counts, weight_sums in ((np.greater, space.positive, space.positive_weight),
                                      (np.less, space.negative, space.negative_weight)):
        flag = kept if sign is np.less and kept is not None else sign(d, 0, out=space.flag)
        if divisor == "counts":
            if first:
                np.copyto(counts, flag.view(np.uint8))
            else:
                counts += flag.view(np.uint8)
        else:
            np.multiply(flag, w, out=space.work)
            if first:
                np.copyto(weight_sums, space.work)
            else:
                weight_sums += space.work


def _elected(space: Space, weight: float | None, normalize: bool, negatives_from_kept: bool = False):
    """The sum of the weighted deltas that agree with the elected sign (``+`` where
    ``Σ wᵢdᵢ ≥ 0``), divided by their weights when normalizing: in ``space.total``.

    With ``P`` the sum of the positive deltas and ``N`` of the negative ones, the total is
    ``P + N`` and ``Σ|wᵢdᵢ| = P − N``, so the elected side is ``(total ± Σ|wᵢdᵢ|) / 2``:
    two steps instead of a pass per model, and without cancellation (the two terms share a sign).
    """
    import numpy as np

    total, magnitude, negative = space.total, space.magnitude, space.flag
    np.less(total, 0, out=negative)
    total += 0.0  # -0.0 elects + (``>= 0``), so the sign bit taken next must be +0.0's
    # ``copysign(magnitude, total)`` as bits (the magnitude's sign bit is clear): 55 µs a block against 73
    sign = np.bitwise_and(total.view(np.uint64), np.uint64(1 << 63), out=space.work.view(np.uint64))
    magnitude.view(np.uint64)[...] |= sign
    total += magnitude
    total *= 0.5
    if not normalize:
        return total
    if weight is not None:
        if negatives_from_kept:  # (``_tally`` counted the kept ones)
            space.negative -= space.positive
        # counts: the negative ones where the elected sign is -, else the positive ones (byte masks)
        np.negative(negative.view(np.uint8), out=space.mask)
        np.bitwise_xor(space.negative, space.positive, out=space.negative)
        space.negative &= space.mask
        space.positive ^= space.negative
        # no agreeing model: divide by 1, as mergekit (``maximum(counts, 1)`` takes 55 µs a block, these 7)
        space.positive |= np.equal(space.positive, 0, out=space.flag).view(np.uint8)
        total /= space.positive
        if weight != 1:
            total /= weight
        return total
    divisor, other = space.positive_weight, space.negative_weight
    other -= divisor
    other *= negative
    divisor += other
    np.equal(divisor, 0, out=negative)
    if negative.any():
        divisor[negative] = 1
    total /= divisor
    return total


class _L1Rescale:
    """DARE's rescale as mergekit's (``RescaleNorm.l1``): each task vector's kept elements
    scaled by ``‖d‖₁ / ‖d ⊙ keep‖₁`` over the whole leaf (1 where ``‖d‖₁`` is below 1e-7 or
    nothing is kept), found on first use by one pass over the inputs, in float64."""

    def __init__(self, base: _leaf.ArrayLeaf, models: list[_leaf.ArrayLeaf], density: float, seed: int,
                 keypath: str):
        self._base, self._models, self._density, self._seed, self._keypath = base, models, density, seed, keypath
        self._lock = threading.Lock()
        self._factors: list[float] | None = None

    def factors(self) -> list[float]:
        with self._lock:  # (blocks run on two threads; the first to ask makes the pass)
            if self._factors is None:
                self._factors = self._measure()
            return self._factors

    def _measure(self) -> list[float]:
        """Per model, ``‖d‖₁ / ‖d ⊙ keep‖₁``, in one pass. (On two threads it ran slower here.)"""
        import numpy as np

        sums = [[0.0, 0.0] for _ in self._models]  # per model: ‖d‖₁, ‖d ⊙ keep‖₁
        # One set of buffers for the pass (fresh memory per block cost more than the arithmetic)
        raw, b, d = np.empty(SUB_CHUNK, self._base.dtype), np.empty(SUB_CHUNK), np.empty(SUB_CHUNK)
        keep, coins = np.empty(SUB_CHUNK, bool), [np.empty(SUB_CHUNK // 2 + 2, np.uint64) for _ in range(2)]
        for start in range(0, self._base.size, SUB_CHUNK):
            stop = min(self._base.size, start + SUB_CHUNK)
            n = stop - start
            self._base.read_into(start, stop, raw[:n])
            np.copyto(b[:n], raw[:n])
            for i, model in enumerate(self._models):
                model.read_into(start, stop, raw[:n])
                np.copyto(d[:n], raw[:n])
                d[:n] -= b[:n]
                np.abs(d[:n], out=d[:n])
                dare_keep(self._seed, self._keypath, i, start, stop, self._density, out=keep[:n], work=coins)
                sums[i][0] += float(d[:n].sum())
                d[:n] *= keep[:n]  # (in place: a dot with the bool mask would cast it to a new array)
                sums[i][1] += float(d[:n].sum())
        return [before / after if before >= 1e-7 and after > 0 else 1.0 for before, after in sums]


def dare_keep(seed: int, keypath: str, model: int, start: int, stop: int, density: float, *, out=None,
              work=None):
    """DARE's keep mask for elements ``[start, stop)`` of one model's task vector (into
    ``out`` if given, working in ``work``: two uint64 arrays of ``(stop - start) / 2 + 1``
    words or more).

    Counter-based: elements ``2j`` and ``2j + 1`` take the low and high 32 bits of
    SplitMix64's output for the state ``key + (j + 1) * golden``, the key hashed from
    (seed, key path, model), so no chunking or thread count changes a coin. An element
    is kept where its 32 bits are below ``density * 2**32``."""
    import numpy as np

    key = int.from_bytes(hashlib.blake2b(f"{seed}\0{keypath}\0{model}".encode(), digest_size=8).digest(), "little")
    first, last = start // 2 + 1, (stop + 1) // 2 + 1
    z, shifted = (np.empty(last - first, np.uint64) for _ in range(2)) if work is None else (
        w[: last - first] for w in work)
    np.add(_counters(last - first), np.uint64(first), out=z)
    with np.errstate(over="ignore"):
        z *= np.uint64(0x9E3779B97F4A7C15)
        z += np.uint64(key)
        for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None)):
            np.right_shift(z, np.uint64(shift), out=shifted)
            z ^= shifted
            if factor:
                z *= np.uint64(factor)
    coins = z.view("<u4")[start % 2 : start % 2 + stop - start]
    return np.less(coins, np.uint32(min(2**32 - 1, int(density * 2**32))), out=out)


@functools.lru_cache(maxsize=1)
def _iota(count: int):
    import numpy as np

    return np.arange(count, dtype=np.uint64)


def _counters(count: int):
    """``0, 1, ..., count - 1`` as uint64, from one array made once per size class."""
    return _iota(max(count, SUB_CHUNK // 2 + 1))[:count]


# --- SLERP ---------------------------------------------------------------------------------------


def _slerp_leaf(v0: _leaf.ArrayLeaf, v1: _leaf.ArrayLeaf, t: float | None, keypath: str, names: list[str],
                report: AverageReport) -> _leaf.ComputedLeaf:
    import numpy as np

    if t is None:
        raise UsageError(f"no {option('t', 'PATTERN=T')} rule covers this leaf; add a default {option('t', 'T')}",
                         keypath=keypath)

    lock = threading.Lock()
    interpolated: list[_leaf.ComputedLeaf] = []
    partials: dict[int, tuple[float, float, float]] = {}

    def add_block(start: int) -> None:
        """The dot product and squared norms of one block, in float64. With einsum, not BLAS:
        OpenBLAS runs a dot on threads of its own, and under treecli's two the 1 GiB slerp
        took 2.5-3.7 s instead of 1.5-1.8 s."""
        stop = min(v0.size, start + SUB_CHUNK)
        with _combine.scratch_buffers() as buffers:
            raw = buffers[0].view(v0.dtype)[: stop - start]
            a, b = (buffer.view(np.float64)[: stop - start] for buffer in buffers[1:])
            v0.read_into(start, stop, raw)
            np.copyto(a, raw)
            v1.read_into(start, stop, raw)
            np.copyto(b, raw)
            partials[start] = tuple(float(np.einsum("i,i->", x, y)) for x, y in ((a, b), (a, a), (b, b)))

    def leaf() -> _leaf.ComputedLeaf:
        """The weighted sum of the two models, its weights from a first pass over both."""
        with lock:
            if not interpolated:
                stream.each_on_two_threads(add_block, range(0, v0.size, SUB_CHUNK))
                # summed in block order: the same bytes whatever thread did which block
                dot, norm0, norm1 = (math.fsum(partials[s][j] for s in sorted(partials)) for j in range(3))
                s0, s1 = _slerp_factors(t, dot, math.sqrt(norm0), math.sqrt(norm1))
                interpolated.append(_combine.averaged_leaf([v0, v1], [s0, s1], v0.dtype_name, keypath, names,
                                                            report, convex=False))
        return interpolated[0]

    return _leaf.ComputedLeaf(v0.shape, v0.dtype, fill=lambda start, stop, out: leaf().read_into(start, stop, out),
                              inputs=[v0, v1])


def _slerp_factors(t: float, dot: float, norm0: float, norm1: float) -> tuple[float, float]:
    """The weights of ``v0`` and ``v1``: mergekit normalizes each (when its norm exceeds
    1e-8), takes the cosine, and interpolates linearly when it is nearly ±1."""
    cosine = dot / ((norm0 if norm0 > SLERP_EPS else 1.0) * (norm1 if norm1 > SLERP_EPS else 1.0))
    if abs(cosine) > SLERP_PARALLEL:
        return 1.0 - t, t
    theta = math.acos(cosine)
    return math.sin((1 - t) * theta) / math.sin(theta), math.sin(t * theta) / math.sin(theta)
