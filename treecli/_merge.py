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
magnitude of each task vector, ranked as float32 bit patterns of ``|dᵢ|`` (mergekit
ranks float32 magnitudes too). A leaf of up to 64K elements is read whole. A
larger one is sampled (runs spread over the leaf, 1/128 of it, 64K to 1M), the
sample's estimate of the ``k``-th largest widened to a range that holds it with
near certainty, and one pass (on two threads) counts the keys above that range and
records those inside it, among which the ``k``-th is found exactly. Where the sample
misled (or too many keys fell inside, past 4M recorded per leaf), a radix select runs
instead: one pass histograms the high 16 bits, a second the low 16 bits inside the
bin that holds the ``k``-th. When values equal to the ``k``-th straddle the cut, the
first ones in element order are kept (mergekit's ``topk`` keeps an unspecified set):
the counting pass finds where the cut lies by reading again the one block that holds
it, the radix passes from what they recorded or, failing that, by a third pass.
DARE's coin flips come from a counter-based generator (SplitMix64's mixer) keyed by
the seed, the leaf's key path and the model, at each element's offset: the same
bytes whatever the chunk size or thread count.
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
    densities = Scoped("density", density, 1.0, lambda v: 0 < v <= 1, "a density must lie in (0, 1]")
    lambdas = Scoped("lambda_", lambda_, 1.0, lambda v: True, "a finite number")
    if spec.sparsify is None and density is not None:
        raise UsageError(f"{method} keeps every element; {option('density', 'D')} is for ties and dare_*")
    normalize = spec.normalize if normalize is None else normalize

    def merged(kp: tuple, text: str, leaves: list[_leaf.ArrayLeaf], report: AverageReport) -> _leaf.ComputedLeaf:
        return _task_leaf(leaves[0], leaves[1:], weights, spec, densities.value(kp), lambdas.value(kp),
                          normalize, seed, text, report)

    return _merge_leaves([base, *trees], [base_name, *names], non_float, merged, checked=[densities, lambdas])


def _merge_leaves(trees: list[Any], names: list[str], non_float: str,
                  merged: Callable[[tuple, str, list[_leaf.ArrayLeaf], AverageReport], Any], checked: list[Scoped]
                  ) -> tuple[Any, AverageReport]:
    """Compare structures before any data is read, then merge float leaves and copy the rest."""
    return _average.combine_inputs(trees, names, non_float, merged, "merged", checks=[functools.partial(s.check_matches, trees[0]) for s in checked])


# --- task vectors: task arithmetic, TIES, DARE ---------------------------------------------------


class _Space:
    """One thread's scratch memory for the task kernel, as typed views for a block of
    ``n`` elements (12 buffers of SUB_CHUNK float64s: 12 MiB a thread; the selection
    passes' larger blocks touch five of them)."""

    BUFFERS = 12

    def __init__(self, buffers: list, n: int, in_dtype: Any):
        import numpy as np

        f64 = [b.view(np.float64)[:n] for b in buffers]
        self.base, self.model = buffers[0].view(in_dtype)[:n], buffers[1].view(in_dtype)[:n]
        self.base64, self.delta, self.total, self.magnitude, self.work = f64[2:7]
        self.positive_weight, self.negative_weight = f64[7:9]  # the agreeing weights' sums, unequal weights
        self.base_key = buffers[9].view(np.float32)[:n]  # the base in float32, for the keys of bf16/fp16 leaves
        self.key = buffers[10].view(np.float32)[:n]
        self.coins = (buffers[9].view(np.uint64), buffers[10].view(np.uint64))  # DARE's, which needs no keys
        slot = buffers[11].size // 8  # eight slots of a byte per element
        flags = buffers[11]
        self.keep, self.flag = flags[:n].view(bool), flags[slot : slot + n].view(bool)
        self.positive, self.negative, self.mask = (flags[j * slot : j * slot + n] for j in (2, 3, 4))


def _task_leaf(base: _leaf.ArrayLeaf, models: list[_leaf.ArrayLeaf], weights: list[float], spec: Method,
               density: float, scale: float, normalize: bool, seed: int, keypath: str,
               report: AverageReport) -> _leaf.ComputedLeaf:
    import numpy as np

    sparse = spec.sparsify is not None and density < 1 and base.size > 0
    if sparse and spec.sparsify == "magnitude" and int(density * base.size) == 0:  # mergekit refuses it too
        raise UsageError(f"density {density} keeps no element of a leaf of {base.size}; raise it", keypath=keypath)
    trims = _Trims(base, models, density) if sparse and spec.sparsify == "magnitude" else None
    in_dtype = base.dtype
    weight_sum = math.fsum(weights) if abs(math.fsum(weights)) >= 1e-8 else 1.0  # mergekit's guard
    # With equal weights the divisor is the weight times a count of agreeing models, kept in bytes.
    counted = len(set(weights)) == 1 and len(weights) < 256
    divisor = None if not (spec.consensus and normalize) else "counts" if counted else "weights"

    def block(start: int, stop: int, out, space: _Space) -> None:
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
        base_key = _key_base(b, space) if trims is not None else None
        for i, (model, w) in enumerate(zip(models, weights)):
            m = space.model
            model.read_into(start, stop, m)
            np.copyto(d, m)  # (widening first, then subtracting, beat one mixed-type subtract: 61 vs 76 µs)
            d -= b64  # exact: the difference of two floats of up to 32 bits
            if trims is not None:
                d *= trims.keep(i, start, stop, _magnitude_keys(m, base_key, space), space.keep)
            elif sparse:
                d *= dare_keep(seed, keypath, i, start, stop, density, out=space.keep, work=space.coins)
                if spec.rescale:
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
        with _average.scratch_buffers(_Space.BUFFERS) as buffers:
            for s in range(start, stop, SUB_CHUNK):
                e = min(stop, s + SUB_CHUNK)
                block(s, e, out[s - start : e - start], _Space(buffers, e - s, in_dtype))

    def fill_chunk(start: int, stop: int, out) -> None:
        if trims is not None:
            trims.select()  # here, on two threads, before any block waits for it
        stream.on_two_threads(fill, start, stop, out, SUB_CHUNK)

    return _leaf.ComputedLeaf(base.shape, in_dtype, fill=fill_chunk, inputs=[base, *models])


def _tally(d, w: float, first: bool, divisor: str | None, space: _Space, kept=None) -> None:
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


def _elected(space: _Space, weight: float | None, normalize: bool, negatives_from_kept: bool = False):
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


def _magnitude_keys(model, base, space: _Space):
    """``|model − base|`` rounded once to float32, as bit patterns with the sign cleared:
    ordered as the magnitudes (NaN above Inf), mergekit's ranking in float32. Inputs of up
    to 32 bits are subtracted in float32, which rounds the exact difference once; float64
    ones in float64 first. The selection passes and the output pass share this function,
    so they rank alike. ``base`` is ``_key_base``'s."""
    import numpy as np

    key = space.key
    if base.dtype.itemsize > 4:
        np.subtract(model, base, out=space.work)
        with np.errstate(over="ignore"):
            np.copyto(key, space.work, casting="unsafe")
    else:
        np.subtract(model, base, out=key, dtype=np.float32)
    keys = key.view(np.uint32)
    np.bitwise_and(keys, 0x7FFFFFFF, out=keys)
    return keys


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


class _Trims:
    """TIES' trim of each task vector of one leaf: which elements are among the ``k``
    largest magnitudes. Found on first use (see the module's docstring): an estimate from
    a sample, one pass that counts what lies above it and records what lies near it, and
    the radix passes for a model whose sample misled it."""

    # Elements per model the estimate is drawn from: a leaf this small is read whole, a larger
    # one sampled at 1/128 of its size, within [SAMPLE, 16 * SAMPLE]. (A sample's cost is in its
    # partition, 0.7 ms for 64K keys; the range it gives holds about 6 / sqrt(sample) + 0.1 % of
    # the keys at density 0.5: see _bounds.)
    SAMPLE = 1 << 16
    SAMPLE_RUN = 4096  # contiguous elements per sampled piece
    # Recorded per leaf: the keys near the estimate, or the (offset, key) pairs in the radix cut's bin.
    MAX_RECORDED = 1 << 22
    # Elements a pass takes at a time. The counting pass ran no faster on two threads than on
    # one in SUB_CHUNK blocks (its steps are short, and finding the near keys holds the GIL);
    # in blocks four times larger it ran 1.5-2x faster (0.72-0.87 s against 1.26-1.7 s over 4 GiB).
    BLOCK = 4 * SUB_CHUNK

    def __init__(self, base: _leaf.ArrayLeaf, models: list[_leaf.ArrayLeaf], density: float):
        self._base, self._models = base, models
        self._k = int(density * base.size)
        self._lock = threading.Lock()
        self._cuts: list[tuple[int, int | None]] | None = None  # per model: (threshold key, cut offset)

    def keep(self, model: int, start: int, stop: int, keys, out):
        """Into ``out``: which of elements ``[start, stop)`` (their ``keys``) survive the trim."""
        import numpy as np

        threshold, cut = self.select()[model]
        if cut is None or cut >= stop:
            return np.greater_equal(keys, threshold, out=out)
        split = max(0, cut - start)  # of the keys equal to the threshold, those from the cut on go
        np.greater_equal(keys[:split], threshold, out=out[:split])
        np.greater(keys[split:], threshold, out=out[split:])
        return out

    def keeps_only_nonzero(self) -> bool:
        """Whether every model's threshold key is above 0, so that no kept delta is 0."""
        return all(threshold > 0 for threshold, _ in self.select())

    def select(self) -> list[tuple[int, int | None]]:
        """Each model's (threshold key, cut offset), found on the first call."""
        with self._lock:
            if self._cuts is None:
                self._cuts = self._select()
            return self._cuts

    def _select(self) -> list[tuple[int, int | None]]:
        size, models = self._base.size, range(len(self._models))
        if size <= self.SAMPLE:
            cuts = []
            for keys in self._sample(whole=True):
                threshold, take = _kth_largest(keys, self._k)
                cuts.append((threshold, _first_not_kept(keys, threshold, take)))
            return cuts
        bounds = [_bounds(sample, self._k, size) for sample in self._sample(whole=False)]
        found = self._count_near(bounds)
        missed = [i for i in models if found[i] is None]
        if missed:
            for i, cut in zip(missed, self._radix(missed)):
                found[i] = cut
        return found

    def _sample(self, whole: bool) -> list:
        """Each model's keys, in element order: all of them, or runs of SAMPLE_RUN spread
        evenly over the leaf (see SAMPLE)."""
        import numpy as np

        size = self._base.size
        if whole:
            ranges = self._blocks()
        else:
            wanted = min(16 * self.SAMPLE, max(self.SAMPLE, size // 128))
            step = self.SAMPLE_RUN * -(-size // wanted)
            ranges = [(s, min(size, s + self.SAMPLE_RUN)) for s in range(0, size, step)]
        pieces: list[list] = [[] for _ in self._models]
        self._scan(ranges, range(len(self._models)), lambda i, keys, start, _: pieces[i].append(keys.copy()))
        return [np.concatenate(p) for p in pieces]

    def _count_near(self, bounds: list[tuple[int, int]]) -> list[tuple[int, int | None] | None]:
        """One pass, on two threads: per model, how many keys lie at or above its bounds'
        ``high`` and which keys lie in ``[low, high)``; the threshold and cut when the
        ``k``-th largest is among those, else ``None``."""
        import numpy as np

        count = len(self._models)
        above = [0] * count
        near: list[list | None] = [[] for _ in range(count)]  # (block start, keys - low) per block
        room = [self.MAX_RECORDED // count] * count
        lock = threading.Lock()

        def visit(i: int, keys, start: int, space: _Space) -> None:
            low, high = bounds[i]
            flag = space.flag
            more = int(np.count_nonzero(np.greater_equal(keys, high, out=flag)))
            keys -= np.uint32(low)  # wraps below low: one comparison finds [low, high)
            # Only the keys, in element order: compress lets the other thread run (flatnonzero
            # held the GIL for a fifth of the pass); where ties sit is found later, if needed.
            inside = np.compress(np.less(keys, np.uint32(high - low), out=flag), keys)
            with lock:
                above[i] += more
                room[i] -= inside.size
                if room[i] < 0:
                    near[i] = None
                elif near[i] is not None:
                    near[i].append((start, inside))

        self._scan(self._blocks(), range(count), visit, parallel=True)
        pieces = [sorted(near[i] or [], key=lambda piece: piece[0]) for i in range(count)]  # in element order
        wanted = [self._k - above[i] for i in range(count)]  # how many of each model's near keys are kept
        kths: list[tuple[int, int] | None] = [None] * count

        def kth(i: int) -> None:
            if pieces[i] and 0 < wanted[i] <= sum(k.size for _, k in pieces[i]):
                kths[i] = _kth_largest(np.concatenate([k for _, k in pieces[i]]), wanted[i])

        # On two threads (the partition lets go of the GIL): a sixth of the selection on one.
        stream.each_on_two_threads(kth, range(count))
        return [None if kths[i] is None else
                (kths[i][0] + bounds[i][0], self._tie_cut(i, pieces[i], kths[i][0], bounds[i][0], kths[i][1]))
                for i in range(count)]

    def _tie_cut(self, model: int, pieces: list, threshold: int, low: int, take: int) -> int | None:
        """The offset of the first key equal to the threshold that is not kept (``None``
        when none is cut), ``take`` keys equal to it coming before: found in the one block
        that holds it, read again. ``pieces`` are each block's near keys less ``low``, as
        ``_count_near`` records them; ``threshold`` is less ``low`` too."""
        import numpy as np

        for start, keys in pieces:
            equal = int(np.count_nonzero(keys == threshold))
            if take < equal:
                stop = min(self._base.size, start + self.BLOCK)
                key = threshold + low
                found: list[int] = []
                self._scan([(start, stop)], [model], lambda _, block_keys, s, __: found.append(
                    s + _first_not_kept(block_keys, key, take)))
                return found[0]
            take -= equal
        return None

    def _radix(self, which: list[int]) -> list[tuple[int, int | None]]:
        """The exact threshold and cut of the given models, whatever their keys: one pass
        histograms the keys' high 16 bits, a second the low 16 bits inside the bin that
        holds the ``k``-th largest, recording where that bin's keys lie; a third finds the
        cut when too many were in it to record."""
        import numpy as np

        count = len(self._models)
        blocks = self._blocks()
        high = {i: np.zeros(1 << 16, np.int64) for i in which}

        def high_pass(i: int, keys, start: int, _: _Space) -> None:
            # The high halves as uint16: bincount of uint32 values ran 4x slower here.
            high[i] += np.bincount((keys >> 16).astype(np.uint16), minlength=1 << 16)

        self._scan(blocks, which, high_pass)
        bins = {i: _kth_bin(high[i], self._k) for i in which}  # (bin, count above it)
        low = {i: np.zeros(1 << 16, np.int64) for i in which}
        recorded: dict[int, list | None] = {i: [] for i in which}  # (offsets, low bits) inside the bin
        room = {i: self.MAX_RECORDED // count for i in which}

        def low_pass(i: int, keys, start: int, _: _Space) -> None:
            inside = np.flatnonzero((keys >> 16) == bins[i][0])
            bits = (keys[inside] & 0xFFFF).astype(np.uint16)
            low[i] += np.bincount(bits, minlength=1 << 16)
            room[i] -= len(inside)
            if room[i] < 0:
                recorded[i] = None
            elif recorded[i] is not None:
                recorded[i].append((inside + start, bits))

        self._scan(blocks, which, low_pass)
        cuts, needed = {}, {}
        for i in which:
            lo, above_lo = _kth_bin(low[i], self._k - bins[i][1])
            threshold = (bins[i][0] << 16) | lo
            take = self._k - bins[i][1] - above_lo  # how many keys equal to the threshold are kept
            cut = None
            if take < low[i][lo] and recorded[i] is not None:
                offsets = np.concatenate([o for o, _ in recorded[i]])
                bits = np.concatenate([b for _, b in recorded[i]])
                cut = int(offsets[bits == lo][take])  # the first key equal to the threshold not kept
            cuts[i] = [threshold, cut]
            needed[i] = take if take < low[i][lo] and recorded[i] is None else 0
        if any(needed.values()):
            self._find_cuts(blocks, cuts, needed)
        return [(int(cuts[i][0]), cuts[i][1]) for i in which]

    def _find_cuts(self, blocks: list, cuts: dict, needed: dict) -> None:
        """A third pass, when the bin at the cut held too many keys to record: where, in
        element order, the first key equal to the threshold that is not kept lies."""
        import numpy as np

        seen = dict.fromkeys(needed, 0)

        def tie_pass(i: int, keys, start: int, _: _Space) -> None:
            if not needed[i] or cuts[i][1] is not None:
                return
            ties = np.flatnonzero(keys == cuts[i][0])
            if seen[i] + len(ties) > needed[i]:
                cuts[i][1] = start + int(ties[needed[i] - seen[i]])
            seen[i] += len(ties)

        self._scan(blocks, [i for i in needed if needed[i]], tie_pass)

    def _blocks(self) -> list[tuple[int, int]]:
        size = self._base.size
        return [(s, min(size, s + self.BLOCK)) for s in range(0, size, self.BLOCK)]

    def _scan(self, ranges: list[tuple[int, int]], which, visit: Callable[[int, Any, int, _Space], None],
              parallel: bool = False) -> None:
        """A pass over ``ranges`` of the leaf: ``visit(model, keys, start, space)`` for each of
        the models ``which``, their keys in a buffer reused for the next. In element order
        unless ``parallel``, when two threads take ranges in turn (the radix passes run on
        one: bincount holds the GIL)."""

        def scan(bounds: tuple[int, int]) -> None:
            start, stop = bounds
            with _average.scratch_buffers(_Space.BUFFERS, self.BLOCK) as buffers:
                space = _Space(buffers, stop - start, self._base.dtype)
                self._base.read_into(start, stop, space.base)
                base_key = _key_base(space.base, space)
                for i in which:
                    self._models[i].read_into(start, stop, space.model)
                    visit(i, _magnitude_keys(space.model, base_key, space), start, space)

        if parallel:
            stream.each_on_two_threads(scan, ranges)
        else:
            for bounds in ranges:
                scan(bounds)


def _bounds(sample, k: int, size: int) -> tuple[int, int]:
    """Keys ``[low, high)`` that hold the ``k``-th largest of ``size`` with near certainty,
    from a sample of them: its rank in the sample, give or take six binomial standard
    deviations and a little more, so that a sample drawn from rows that differ still holds
    it nearly always (the radix passes catch the rest)."""
    import numpy as np

    n = sample.size
    share = k / size
    rank = share * n  # the k-th largest's expected rank from the top, in the sample
    margin = 6 * math.sqrt(n * share * (1 - share)) + n / 2000 + 16
    top, bottom = math.floor(rank - margin), math.ceil(rank + margin)
    wanted = sorted({n - rank for rank, inside in ((top, top >= 1), (bottom, bottom <= n)) if inside})
    ordered = np.partition(sample, wanted) if wanted else sample
    high = int(ordered[n - top]) + 1 if top >= 1 else 1 << 31  # keys never reach 2**31: the sign is cleared
    low = int(ordered[n - bottom]) if bottom <= n else 0
    return low, high


def _kth_largest(keys, k: int) -> tuple[int, int]:
    """The ``k``-th largest of ``keys``, and how many keys equal to it are kept (``k`` less
    those above it)."""
    import numpy as np

    threshold = int(np.partition(keys, keys.size - k)[keys.size - k])
    return threshold, k - int(np.count_nonzero(keys > threshold))


def _first_not_kept(keys, threshold: int, take: int) -> int | None:
    """Where in ``keys`` (in element order) the first key equal to the threshold that is not
    kept lies, the first ``take`` being kept (mergekit's ``topk`` keeps an unspecified set);
    ``None`` when every one is."""
    import numpy as np

    equal = np.flatnonzero(keys == threshold)
    return int(equal[take]) if take < equal.size else None


def _key_base(base, space: _Space):
    """The base as the keys subtract it: itself, or in float32 for bf16/fp16."""
    import numpy as np

    if base.dtype.itemsize >= 4:
        return base
    np.copyto(space.base_key, base)
    return space.base_key


def _kth_bin(histogram, k: int) -> tuple[int, int]:
    """The bin holding the ``k``-th largest value, and how many values lie above it."""
    import numpy as np

    from_top = np.cumsum(histogram[::-1])
    position = int(np.searchsorted(from_top, k))  # first index where the running count reaches k
    bin_index = len(histogram) - 1 - position
    above = int(from_top[position - 1]) if position else 0
    return bin_index, above


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
        with _average.scratch_buffers() as buffers:
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
                interpolated.append(_average.averaged_leaf([v0, v1], [s0, s1], v0.dtype_name, keypath, names,
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
