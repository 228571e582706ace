"""treecli: look inside ML checkpoints and operate on them as PyTrees.

The public API, imported lazily so that ``import treecli`` costs nothing::

    import treecli
    tree = treecli.load("model.safetensors")      # lazy leaves: shape/dtype now, data on demand
    treecli.save(tree, "copy.safetensors")        # atomic, streaming
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

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
    "Checkpoint": "treecli.formats._base",
    "slice_tree": "treecli._api",
    "average": "treecli._api",
    "merge": "treecli._api",
    "edit": "treecli._api",
    "Edits": "treecli._edit",
    "at": "treecli._api",
    "diff": "treecli._api",
    "cast": "treecli._api",
    "quantize": "treecli._api",
    "transform": "treecli._api",
    "recipe": "treecli._api",
    "Rename": "treecli._transforms",
    "Stack": "treecli._transforms",
    "Unstack": "treecli._transforms",
    "Concat": "treecli._transforms",
    "Split": "treecli._transforms",
    "Transpose": "treecli._transforms",
    "Rotary": "treecli._transforms",
    "Unflatten": "treecli._transforms",
    "Flatten": "treecli._transforms",
    "jax_keypath": "treecli._api",
    "hash": "treecli._api",
    "verify": "treecli._api",
    "format_keypath": "treecli._keypath",
    "parse_keypath": "treecli._keypath",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time each name is imported on first use
    from treecli._api import at as at, average as average, diff as diff, edit as edit, jax_keypath as jax_keypath
    from treecli._api import load as load, merge as merge, open as open, save as save, slice_tree as slice_tree
    from treecli._api import cast as cast, quantize as quantize, recipe as recipe, transform as transform
    from treecli._api import hash as hash, verify as verify
    from treecli._transforms import Concat as Concat, Flatten as Flatten, Rename as Rename, Rotary as Rotary
    from treecli._transforms import Split as Split, Stack as Stack, Transpose as Transpose
    from treecli._transforms import Unflatten as Unflatten, Unstack as Unstack
    from treecli._edit import Edits as Edits
    from treecli._errors import FormatError as FormatError, KeyPathError as KeyPathError
    from treecli._errors import StructureError as StructureError, TreecliError as TreecliError
    from treecli._errors import UsageError as UsageError
    from treecli._keypath import format_keypath as format_keypath, parse as parse_keypath
    from treecli._leaf import ArrayLeaf as ArrayLeaf
    from treecli.formats._base import Checkpoint as Checkpoint

    __version__: str


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import version

        return version("treecli")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'treecli' has no attribute {name!r}")
    module = import_module(_EXPORTS[name])
    return getattr(module, "parse" if name == "parse_keypath" else name)
