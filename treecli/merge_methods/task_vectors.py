"""The task-vector methods: task arithmetic, TIES, DARE, breadcrumbs and DELLA (each
with and without TIES' sign election), one kernel for all eight.

- task vectors ``dᵢ = mᵢ − base``; TIES keeps each one's ``density`` fraction of
  largest magnitudes (``k = max(1, int(density · n))``), breadcrumbs those less the
  largest ``gamma`` fraction, DARE each element with probability ``density``, DELLA
  with a probability rising with its magnitude's rank in its row (``_sparsify``); what
  is kept is rescaled (``rescale``) to each task vector's L1 norm over the leaf
  (``‖d‖₁ / ‖d ⊙ keep‖₁``, found by a first pass; DARE and DELLA by default), or by
  ``1/density`` (DARE only), or not at all;
- the ``_ties`` methods and DELLA elect a sign per element from the weighted sum
  ``Σ wᵢdᵢ`` (``≥ 0`` is positive) and keep only the weighted deltas that agree with it;
- the mixed delta is ``Σ wᵢdᵢ`` (over the agreeing ones), divided by ``Σ wᵢ`` (over
  the same) when normalizing (by default for TIES and DELLA); then scaled by ``lambda``.

Everything is computed in float64 a block at a time and rounded to the base's dtype at
the end; mergekit computes in the models' dtype.
"""

from __future__ import annotations

import functools
import math

from treecli.merge_methods._method import LeafMerge, MergeMethod, Param


class Variant:
    """A task-vector method: how it sparsifies each task vector, and its defaults (a plain
    class, as ``_method``'s: the registry is read at the CLI's start)."""

    __slots__ = ("sparsify", "consensus", "normalize", "rescale")

    def __init__(self, sparsify: str | None, consensus: bool, normalize: bool, rescale: bool):
        self.sparsify = sparsify  # "magnitude" (TIES), "random" (DARE), "outliers" (breadcrumbs), "della" or None
        self.consensus = consensus  # elect a sign per element
        self.normalize = normalize  # divide by the sum of the (agreeing) weights
        self.rescale = rescale  # rescale what is kept to the task vector's L1 norm (``rescale`` says how)


def _task_leaf(job: LeafMerge, spec: Variant):
    import numpy as np

    from treecli import _combine, _leaf
    from treecli._bytes import stream
    from treecli._combine import SUB_CHUNK
    from treecli._errors import UsageError
    from treecli._selection import Space, key_base
    from treecli.merge_methods._sparsify import L1Rescale, TopKeeps, keeps_of

    base, models, weights = job.leaves[0], job.leaves[1:], job.weights
    per_model, shared, seed, keypath, report = job.per_model, job.shared, job.seed, job.keypath, job.report

    densities = [float(m.get("density", 1.0)) for m in per_model]
    for density in densities:
        if not 0 <= density <= 1:
            raise UsageError(f"density {density:g}: a density must lie in [0, 1]", keypath=keypath)
    scale, normalize = shared["lambda"], shared["normalize"]
    rescale = shared.get("rescale", False)
    rescale = {True: "l1", False: "none"}.get(rescale, rescale)  # (a config's booleans, or a named choice)
    # mergekit leaves a task vector whole at a density of 1 (no rescale either)
    sparse = [spec.sparsify is not None and d < 1 for d in densities]
    keeps = keeps_of(spec.sparsify, base, models, per_model, densities, seed, keypath) if any(sparse) else None
    l1 = L1Rescale(base, models, keeps, sparse) if keeps is not None and rescale == "l1" else None
    by_density = rescale == "density"
    trims = keeps.trims if isinstance(keeps, TopKeeps) and keeps.outliers is None else None
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
        # Where every kept delta is nonzero (a TIES threshold above 0 in every model, and a weight
        # that cannot round one to 0), the negative ones are counted as the kept less the positive ones.
        negatives_from_kept = (divisor == "counts" and trims is not None and all(sparse)
                               and trims.keeps_only_nonzero() and abs(weights[0]) >= 2.0**-900)
        base.read_into(start, stop, b)
        np.copyto(b64, b)
        base_key = key_base(b, space) if keeps is not None and keeps.needs_keys else None
        for i, (model, w) in enumerate(zip(models, weights)):
            m = space.model
            model.read_into(start, stop, m)
            np.copyto(d, m)  # (widening first, then subtracting, beat one mixed-type subtract: 61 vs 76 µs)
            d -= b64  # exact: the difference of two floats of up to 32 bits
            if sparse[i]:
                d *= keeps.mask(i, start, stop, space, base_key)
                if l1 is not None:
                    d *= l1.factors()[i]
                elif by_density:
                    d /= densities[i]
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
        # The statistics of the whole leaf, here: from a block, their passes would run on one
        # thread (the other waiting for them).
        if isinstance(keeps, TopKeeps):
            keeps.select()
        if l1 is not None:
            l1.factors()
        stream.on_two_threads(fill, start, stop, out, SUB_CHUNK)

    return _leaf.ComputedLeaf(base.shape, in_dtype, fill=fill_chunk, inputs=[base, *models])


def _tally(d, w: float, first: bool, divisor: str | None, space, kept=None) -> None:
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


def _elected(space, weight: float | None, normalize: bool, negatives_from_kept: bool = False):
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


def _params(spec: Variant) -> tuple[Param, ...]:
    params = [Param("weight", 1.0, True), Param("lambda", 1.0), Param("normalize", spec.normalize, kind=bool),
              Param("int8_mask", False, kind=bool)]
    if spec.sparsify:
        params += [Param("density", 1.0, True, check=(lambda v: 0 < v <= 1, "a density must lie in (0, 1]")),
                   Param("rescale", spec.rescale, kind=bool)]
    if spec.sparsify == "outliers":
        params.append(Param("gamma", 0.01, True, check=(lambda v: 0 <= v <= 1, "gamma must lie in [0, 1]")))
    if spec.sparsify == "della":
        params.append(Param("epsilon", 0.15, True))
    return tuple(params)


def _method(name: str, summary: str, spec: Variant) -> MergeMethod:
    # The rescale of what is kept: mergekit's L1 norm, 1/density (DARE's), or none.
    rescales = {None: (), "random": ("l1", "density", "none")}.get(spec.sparsify, ("l1", "none"))
    return MergeMethod(name, summary, functools.partial(_task_leaf, spec=spec), base="required", models=(1, None),
                       params=_params(spec), rescales=rescales)


METHODS = (
    _method("task_arithmetic", "base + λ Σ wᵢdᵢ, dᵢ = mᵢ − base", Variant(None, False, False, False)),
    _method("ties", "each task vector trimmed to its largest magnitudes, a sign elected, the agreeing summed",
            Variant("magnitude", True, True, False)),
    _method("dare_linear", "each task vector's elements kept at random, rescaled, summed",
            Variant("random", False, False, True)),
    _method("dare_ties", "DARE's random drop, then TIES' sign election", Variant("random", True, False, True)),
    _method("breadcrumbs", "each task vector less its largest and smallest magnitudes, summed",
            Variant("outliers", False, False, False)),
    _method("breadcrumbs_ties", "breadcrumbs' drop, then TIES' sign election", Variant("outliers", True, False, False)),
    _method("della", "elements kept with a probability rising with their magnitude's rank, TIES' election",
            Variant("della", True, True, True)),
    _method("della_linear", "DELLA's drop, summed", Variant("della", False, False, True)),
)
