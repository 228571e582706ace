"""Reinforced Agent Merging (``ram``) and its variant that rewards the elements a model
shares (``ramplus_tl``). Element-wise; ``ramplus_tl`` counts over the leaf first."""

from __future__ import annotations

from typing import Any

from treecli.merge_methods._method import LeafMerge, MergeMethod, Param


def ram(job: LeafMerge):
    return _ram(job, plus=False)


def ramplus_tl(job: LeafMerge):
    return _ram(job, plus=True)


def _ram(job: LeafMerge, plus: bool):
    """Reinforced Agent Merging: each task vector's elements above ``epsilon`` in magnitude
    count; where one model alone contributes its value is kept, where several do their mean.
    ``ramplus_tl`` (``plus``) scales a model's unique elements by ``1 + r·clip(ρ, 0, alpha)``,
    ``ρ`` its shared over its unique elements in the leaf."""
    import numpy as np

    from treecli.merge_methods import _blocks

    leaves, keypath, report, epsilon = job.leaves, job.keypath, job.report, job.shared["epsilon"]
    r, alpha = job.shared.get("r", 0.1), job.shared.get("alpha", 0.2)

    k = len(leaves) - 1
    flag_spares = -(-(k + 1) // 8)  # each model's mask, and where one model alone contributes

    def contributions(arrays: list, spares: list) -> tuple[list, Any, Any]:
        """The models' task vectors in place of the models, zero where not above epsilon (as
        mergekit, a NaN stays); their masks; how many models contribute to each element."""
        base, deltas = arrays[0], arrays[1:]
        magnitude, count = spares[:2]
        flags = [f for spare in spares[2:] for f in _blocks.bool_views(spare, 8)]
        count[...] = 0.0
        for d, mask in zip(deltas, flags):
            d -= base
            np.abs(d, out=magnitude)
            np.greater(magnitude, epsilon, out=mask)
            d *= mask
            count += mask
        np.equal(count, 1.0, out=flags[k])
        return flags[:k], flags[k], count

    def measure():
        def counts(start: int, stop: int, arrays: list, spares: list):
            masks, alone, _ = contributions(arrays, spares)
            present = [np.count_nonzero(mask) for mask in masks]
            unique = [np.count_nonzero(np.logical_and(mask, alone, out=mask)) for mask in masks]
            return np.array([present, unique], np.float64)

        present, unique = sum(_blocks.scan(leaves, counts, spare=2 + flag_spares), np.zeros((2, k)))
        shared = present - unique
        return 1.0 + r * np.clip(shared / np.maximum(unique, epsilon), 0.0, alpha)

    scales = _blocks.Once(measure) if plus else None

    def compute(start: int, stop: int, arrays: list, spares: list):
        _, alone, count = contributions(arrays, spares)
        deltas, total = arrays[1:], spares[0]
        _blocks.sum_into(deltas, total)
        np.maximum(count, 1.0, out=count)
        total /= count  # the mean where several contribute, the value where one does
        if plus:  # where one contributes: its value scaled by its model's factor
            for d, scale in zip(deltas, scales()):
                d *= scale
            _blocks.sum_into(deltas, count)
            np.copyto(total, count, where=alone)
        total += arrays[0]
        return total

    return _blocks.output_leaf(leaves, keypath, report, compute, spare=2 + flag_spares, measure=scales)


METHODS = (
    MergeMethod("ram", "the task vectors' elements above epsilon: one model's alone kept, several averaged", ram,
                base="required", models=(1, None), params=(Param("epsilon", 1e-5),)),
    MergeMethod("ramplus_tl", "RAM, each model's unique elements scaled up by how much it shares", ramplus_tl,
                base="required", models=(1, None), params=(Param("r", 0.1), Param("alpha", 0.2), Param("epsilon", 1e-5))),
)
