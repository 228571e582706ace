"""What a merge method declares: its inputs, its parameters (mergekit's names and
defaults) and its kernel, the function that merges one leaf.

Kept light (no NumPy, no engines, no dataclasses: making one took a millisecond at
every start of the CLI): ``merge --help`` and completion read the registry at start-up.
A kernel imports what it computes with when it runs.
"""

from __future__ import annotations

from typing import Any, Callable

REQUIRED = object()  # a parameter without a default

# What a method does with a base model:
BASES = {
    "required": "the task vectors are each model less the base; without one, an error",
    "optional": "used when given (the kernel is told), the models alone otherwise",
    "first": "without one, the first model is the base",
    "added": "takes none: a base given is one more model, as mergekit's methods that ignore it",
    "refused": "takes none: from flags a base is an error; a config's base is one more model, as in mergekit",
}


class Param:
    """One of a method's parameters, as mergekit names it: one value for the leaf, or one
    per model besides the base (``per_model``). ``check``, where given, is a test a value
    from the command line must pass and the line naming the requirement."""

    __slots__ = ("name", "default", "per_model", "kind", "check")

    def __init__(self, name: str, default: Any, per_model: bool = False, kind: type = float,
                 check: tuple[Callable[[float], bool], str] | None = None):
        self.name, self.default, self.per_model, self.kind, self.check = name, default, per_model, kind, check

    def __repr__(self) -> str:
        return f"Param({self.name!r}, {self.default!r}{', per model' if self.per_model else ''})"


class MergeMethod:
    """A merge method: ``kernel(job)`` merges one float leaf (see ``LeafMerge``) into a
    leaf of the first input's shape (lazy: computed as a writer reads it).

    ``base`` is one of ``BASES``; ``models`` how many models besides the base, (fewest,
    most or None); ``inputs`` how to say what it takes when the inputs do not fit (default
    from ``models``); ``rescales`` the ways its ``rescale`` parameter may be named
    (sparsifying methods only)."""

    __slots__ = ("name", "summary", "kernel", "base", "models", "params", "inputs", "rescales")

    def __init__(self, name: str, summary: str, kernel: Callable[[LeafMerge], Any], base: str,
                 models: tuple[int, int | None], params: tuple[Param, ...] = (), inputs: str | None = None,
                 rescales: tuple[str, ...] = ()):
        assert base in BASES, base
        self.name, self.summary, self.kernel, self.base, self.models = name, summary, kernel, base, models
        self.params, self.inputs, self.rescales = params, inputs, rescales

    def __repr__(self) -> str:
        return f"MergeMethod({self.name!r})"

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    @property
    def takes_no_base(self) -> bool:
        """Whether a base given is no base to it, only one more model (in a config, as mergekit)."""
        return self.base in ("added", "refused")


class LeafSettings:
    """One output leaf's parameters: the method's shared ones, and one dict per model
    besides the base (in the order of the models)."""

    __slots__ = ("shared", "models")

    def __init__(self, shared: dict[str, Any], models: list[dict[str, Any]]):
        self.shared, self.models = shared, models


class LeafMerge:
    """One float leaf to merge: ``leaves`` (the base first when ``has_base``), its
    settings, the seed of random methods, the leaf's key path (for errors and coins),
    the inputs' names and the report the merge fills in (a ``_combine.AverageReport``)."""

    __slots__ = ("leaves", "has_base", "settings", "seed", "keypath", "names", "report")

    def __init__(self, leaves: list, has_base: bool, settings: LeafSettings, seed: int, keypath: str,
                 names: list[str], report: Any):
        self.leaves, self.has_base, self.settings, self.seed = leaves, has_base, settings, seed
        self.keypath, self.names, self.report = keypath, names, report

    @property
    def shared(self) -> dict[str, Any]:
        return self.settings.shared

    @property
    def per_model(self) -> list[dict[str, Any]]:
        return self.settings.models

    @property
    def weights(self) -> list[float]:
        """Each model's weight (1 where the method takes none)."""
        return [m.get("weight", 1.0) for m in self.settings.models]
