"""SCE: Select, Calculate, Erase. The elements whose task vectors vary most across the
models, each model weighted by its mean squared task vector, minority signs erased."""

from __future__ import annotations

from treecli.merge_methods._method import LeafMerge, MergeMethod, Param


def sce(job: LeafMerge):
    """Select, Calculate, Erase: keep the ``select_topk`` fraction of elements whose task
    vectors vary most across the models (of those that vary at all), weight each model by
    its mean squared task vector over the leaf, erase the values against the elected sign.
    The selection is TIES' streaming exact one (``_selection.Trims``) ranking the float32
    variances; a pass before it counts those that are not zero."""
    import numpy as np

    from treecli import _combine
    from treecli._combine import SUB_CHUNK
    from treecli._selection import Trims
    from treecli.merge_methods import _blocks

    leaves, keypath, report, select_topk = job.leaves, job.keypath, job.report, job.shared["select_topk"]

    k, size = len(leaves) - 1, leaves[0].size

    def deltas_and_keys(arrays: list, spares: list):
        """The task vectors in place of the models, and their variances as float32 bit
        patterns (sign cleared: NaN ranks above inf) in ``spares[0]``, as NumPy's ``var``
        computes them (the mean first, then the mean square from it); three spares used."""
        mean, square, variance = spares[:3]
        deltas = arrays[1:]
        for d in deltas:
            d -= arrays[0]
        _blocks.sum_into(deltas, mean)
        mean /= k
        for i, d in enumerate(deltas):
            np.subtract(d, mean, out=square if i else variance)
            if i:
                square *= square
                variance += square
            else:
                variance *= variance
        variance /= k
        keys = mean.view(np.float32)[: mean.size]
        np.copyto(keys, variance, casting="unsafe")
        bits = keys.view(np.uint32)
        np.bitwise_and(bits, 0x7FFFFFFF, out=bits)
        return deltas, bits

    def count_varying() -> int:
        return sum(_blocks.scan(leaves, lambda start, stop, arrays, spares: int(np.count_nonzero(
            deltas_and_keys(arrays, spares)[1])), spare=3))

    def select():
        """The selection among the varying elements, or None: keep everything."""
        if select_topk >= 1:
            return None
        kept = int(count_varying() * select_topk)

        def variance_keys(start: int, stop: int, space, which):
            keys = space.key.view(np.uint32)[: stop - start]
            with _combine.scratch_buffers(len(leaves) + 4, SUB_CHUNK) as buffers:
                for lo in range(start, stop, SUB_CHUNK):
                    hi = min(stop, lo + SUB_CHUNK)
                    keys[lo - start : hi - start] = deltas_and_keys(*_blocks.read_block(leaves, lo, hi, buffers, 3))[1]
            yield 0, keys

        return Trims(leaves[0], [leaves[0]], [kept], keys=variance_keys)

    selection = _blocks.Once(lambda: (select(),))

    def selected(start: int, stop: int, arrays: list, spares: list) -> list:
        """The task vectors, zero where the selection drops them; three spares used."""
        deltas, keys = deltas_and_keys(arrays, spares)
        trims = selection()[0]
        if trims is not None:
            keep = _blocks.bool_views(spares[1], 1)[0]
            trims.keep(0, start, stop, keys, keep)
            for d in deltas:
                d *= keep
        return deltas

    def measure_weights():
        selection()  # before this pass: measured from one of its blocks, its passes would run on one thread
        squares = sum(_blocks.scan(leaves, lambda start, stop, arrays, spares: np.array(
            [np.einsum("n,n->", d, d) for d in selected(start, stop, arrays, spares)]), spare=3), np.zeros(k))
        means = squares / max(size, 1)
        total = float(means.sum())
        return np.full(k, 1.0 / k) if abs(total) < 1e-6 else means / total

    weights = _blocks.Once(measure_weights)

    def compute(start: int, stop: int, arrays: list, spares: list):
        deltas = selected(start, stop, arrays, spares)
        majority, agree, numerator, denominator = spares
        _blocks.sum_into(deltas, majority)
        elected = _blocks.bool_views(agree, 1)[0]
        np.greater_equal(majority, 0.0, out=elected)
        np.multiply(elected, 2.0, out=majority)
        majority -= 1.0  # the elected sign: +1 where the task vectors' sum is >= 0, else -1
        for i, (d, weight) in enumerate(zip(deltas, weights())):
            np.sign(d, out=agree)
            np.equal(agree, majority, out=agree)
            agree *= weight  # the model's weight where its sign is the elected one, else 0
            if i:
                denominator += agree
            else:
                np.copyto(denominator, agree)
            d *= agree
        _blocks.sum_into(deltas, numerator)
        np.maximum(denominator, 1e-6, out=denominator)
        numerator /= denominator
        numerator += arrays[0]
        return numerator

    return _blocks.output_leaf(leaves, keypath, report, compute, spare=4, measure=weights)


METHODS = (
    MergeMethod("sce", "the select_topk most varying elements, models weighted by their mean square, minority signs "
                "erased", sce, base="required", models=(1, None),
                params=(Param("select_topk", 1.0), Param("int8_mask", False, kind=bool))),
)
