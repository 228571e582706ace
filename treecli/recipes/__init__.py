"""Recipes: a checkpoint made into another program's model, and back.

A recipe turns an opened checkpoint into a :class:`Conversion`: the tree to write
(renamed, stacked, transposed... by the reversible operations of
``treecli._transforms``), the metadata the output carries and the companion files an
output directory gets (``config.json``, the tokenizer's). ``reverse`` makes the
recipe's output back into its input. Built-in recipes are modules of this package,
one line each in ``BUILTIN``; any other recipe is a YAML file (``_yaml``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from treecli._errors import UsageError
from treecli.recipes._recipe import Conversion, Recipe, hyper_parameters

# name -> the module that declares it as ``RECIPE``
BUILTIN = {
    "llama.cpp": "treecli.recipes.llama_cpp",
    "scanned": "treecli.recipes.scanned",
}

__all__ = ["BUILTIN", "Conversion", "Recipe", "hyper_parameters", "listed", "named"]


def named(name: str) -> Recipe:
    """A built-in recipe by name, or the recipe a YAML file holds.

    Raises:
        UsageError: neither a built-in recipe nor a readable recipe file.
    """
    if name in BUILTIN:
        return importlib.import_module(BUILTIN[name]).RECIPE
    path = Path(name)
    if path.suffix.lower() in (".yaml", ".yml") or path.exists():
        from treecli.recipes import _yaml

        return _yaml.load(path)
    raise UsageError(f"no recipe {name!r}: name one of {', '.join(BUILTIN)} (treecli convert --list-recipes) or a "
                     "YAML file")


def listed() -> list[tuple[str, str]]:
    """Each built-in recipe's name and what it does."""
    return [(name, named(name).summary) for name in BUILTIN]


def convert(checkpoint: Any, recipe: Recipe, *, reverse: bool = False) -> Conversion:
    """``checkpoint`` made by ``recipe`` (or, ``reverse``, made back)."""
    return recipe.reverse(checkpoint) if reverse else recipe.forward(checkpoint)
