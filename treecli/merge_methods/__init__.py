"""mergekit's merge methods, one family per module, each method declared once (its
inputs, parameters, defaults and kernel: ``_method.MergeMethod``) and registered here.
``merge``, a mergekit config, ``merge --help``, completion and the docs all read
``REGISTRY``; ``run`` runs a method over trees.

Adding a method: a module with its kernel and a ``METHODS`` tuple, and one line in
``FAMILIES`` (CONTRIBUTING.md; a test follows that recipe with a toy method).
"""

from __future__ import annotations

import importlib

from treecli.merge_methods._method import REQUIRED, LeafMerge, LeafSettings, MergeMethod, Param

# The families, in the order their methods are listed: one line each.
FAMILIES = tuple(importlib.import_module(f"{__name__}.{family}") for family in (
    "linear",
    "task_vectors",
    "slerp",
    "means",
    "nearswap",
    "ram",
    "sce",
    "arcee_fusion",
    "passthrough",
))

REGISTRY: dict[str, MergeMethod] = {}
for _family in FAMILIES:
    for _method in _family.METHODS:
        assert _method.name not in REGISTRY, f"{_family.__name__}: a second method named {_method.name}"
        REGISTRY[_method.name] = _method
METHODS = tuple(REGISTRY)
# Every parameter name some method takes (a config naming another is a typo).
PARAMETERS = sorted({p.name for method in REGISTRY.values() for p in method.params})

__all__ = ["FAMILIES", "METHODS", "PARAMETERS", "REGISTRY", "REQUIRED", "LeafMerge", "LeafSettings", "MergeMethod",
           "Param", "method_named"]


def method_named(name: str) -> MergeMethod:
    """The registered method ``name``, or a line naming those there are."""
    from treecli._errors import UsageError

    if name not in REGISTRY:
        raise UsageError(f"unknown merge method {name!r}; choose one of {', '.join(METHODS)}")
    return REGISTRY[name]
