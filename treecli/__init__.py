"""treecli: look inside ML checkpoints and operate on them as PyTrees.

The public API, imported lazily so that ``import treecli`` costs nothing::

    import treecli
    tree = treecli.load("model.safetensors")      # lazy leaves: shape/dtype now, data on demand
    treecli.save(tree, "copy.safetensors")        # atomic, streaming
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "load": "treecli._api",
    "open": "treecli._api",
    "save": "treecli._api",
    "TreecliError": "treecli._errors",
    "FormatError": "treecli._errors",
    "KeyPathError": "treecli._errors",
    "StructureError": "treecli._errors",
    "UsageError": "treecli._errors",
    "ArrayLeaf": "treecli._leaf",
    "slice_tree": "treecli._api",
    "average": "treecli._api",
    "merge": "treecli._api",
    "edit": "treecli._api",
    "Edits": "treecli._edit",
    "at": "treecli._api",
    "diff": "treecli._api",
    "jax_keypath": "treecli._api",
    "format_keypath": "treecli._keypath",
    "parse_keypath": "treecli._keypath",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import version

        return version("treecli")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'treecli' has no attribute {name!r}")
    module = import_module(_EXPORTS[name])
    return getattr(module, "parse" if name == "parse_keypath" else name)
