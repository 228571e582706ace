"""``passthrough``: one model, bit for bit, or scaled; with a config's slices that stack
layers, a frankenmerge."""

from __future__ import annotations

from treecli.merge_methods._method import LeafMerge, MergeMethod, Param


def passthrough(job: LeafMerge):
    from treecli import _combine

    scale, first = job.per_model[0]["scale"], job.leaves[0]
    if scale is None:
        return first
    return _combine.averaged_leaf(job.leaves, [float(scale)], first.dtype_name, job.keypath, job.names, job.report,
                                  convex=False)


METHODS = (
    MergeMethod("passthrough", "the model, bit for bit, or times scale; with slices, a frankenmerge", passthrough,
                base="added", models=(1, 1), params=(Param("scale", None, True),)),
)
