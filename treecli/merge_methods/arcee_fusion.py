"""Arcee Fusion: the model's value where its change from the base matters most (its
importance at least ``median + 1.5·IQR`` of the leaf's), the base's elsewhere."""

from __future__ import annotations

from treecli.merge_methods._method import LeafMerge, MergeMethod


def arcee_fusion(job: LeafMerge):
    """Arcee Fusion: an element takes the model's value where its importance
    ``|m − b| · KL(softmax(m_row) ‖ softmax(b_row))`` is at least ``median + 1.5·IQR`` of the
    leaf's importances (quantiles at ``⌊q·(n−1)⌋`` of the sorted scores, or of an even
    sample of 1M of them in a larger leaf), the base's elsewhere."""
    import numpy as np

    from treecli.merge_methods import _blocks

    leaves, keypath, report = job.leaves, job.keypath, job.report

    unit = _blocks.row_length(leaves[0].shape)
    size = leaves[0].size
    sample_size = 1_000_000

    def softmax(rows, out):
        """``softmax(rows) + 1e-8`` per row, into ``out`` (mergekit's, the 1e-8 after)."""
        np.subtract(rows, rows.max(axis=-1, keepdims=True), out=out)
        np.exp(out, out=out)
        out /= out.sum(axis=-1, keepdims=True)
        out += 1e-8
        return out

    def importances(b, m, rows, out):
        """``|m − b|`` times each row's divergence, into ``out``."""
        np.subtract(m, b, out=out)
        np.abs(out, out=out)
        shaped = out.reshape(-1, unit)
        shaped *= rows[:, None]
        return out

    def divergences(start: int, stop: int, arrays: list, spares: list):
        """Each row's ``KL(softmax(m) ‖ softmax(b))``, and the sampled importances in the block."""
        (b, m), (p, q) = arrays, spares
        p, q = softmax(m.reshape(-1, unit), p.reshape(-1, unit)), softmax(b.reshape(-1, unit), q.reshape(-1, unit))
        np.divide(p, q, out=q)
        np.log(q, out=q)
        q *= p
        rows = q.sum(axis=-1)
        if size <= sample_size:
            return rows, importances(b, m, rows, spares[0]).copy()
        # The sample: elements ⌊i·size / sample_size⌋, those of them in [start, stop).
        first, last = -(-start * sample_size // size), -(-stop * sample_size // size)
        at = np.arange(first, last) * size // sample_size - start
        return rows, np.abs(m[at] - b[at]) * rows[at // unit]

    def measure():
        found = _blocks.scan(leaves, divergences, unit, spare=2)
        rows = np.concatenate([r for r, _ in found]) if found else np.zeros(0)
        scores = np.concatenate([scores for _, scores in found]) if found else np.zeros(1)
        at = [int(q * (scores.size - 1)) for q in (0.25, 0.5, 0.75)]
        q1, median, q3 = np.partition(scores, at)[at]  # those places of the sorted scores, without a sort
        return rows, median + 1.5 * (q3 - q1)

    once = _blocks.Once(measure)

    def compute(start: int, stop: int, arrays: list, spares: list):
        (b, m), (importance,) = arrays, spares
        rows, threshold = once()
        importances(b, m, rows[start // unit : stop // unit], importance)
        np.copyto(b, m, where=importance >= threshold)
        return b

    return _blocks.output_leaf(leaves, keypath, report, compute, unit, spare=1, measure=once)


METHODS = (
    MergeMethod("arcee_fusion", "the model's value where |m − base| · KL of their rows' softmax is an outlier, the "
                "base's elsewhere", arcee_fusion, base="required", models=(1, 1)),
)
