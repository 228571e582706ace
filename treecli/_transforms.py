"""Reversible operations on a tree's leaves by name: rename by regex, stack and
unstack, concatenate and split, transpose, rotary permutation, unflatten and
flatten of an axis. Each is a small frozen object with ``apply`` and ``inverse``;
a chain of them, applied and then inverted in reverse order, gives back the same
names and the same bytes (``tests/test_transforms.py``).

Names are key paths as text, segments joined by ``.`` (``model.layers.0.mlp.up_proj.weight``);
the patterns that pick leaves and the templates that name the results are ``_names``'
(reversible: literal text, ``(groups)``, ``{i}`` for a layer's number).

Sizes and head counts may name a model's hyper-parameters (``num_key_value_heads``,
``num_attention_heads*head_dim``), looked up in ``params`` (an HF ``config.json``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from treecli import _tensor_ops
from treecli._errors import UsageError
from treecli._names import Mapping, pattern

Items = list[tuple[str, Any]]  # (name, leaf), in the tree's order


# --- hyper-parameters in sizes -------------------------------------------------------------------


def size_of(expression: Any, params: dict[str, Any], what: str) -> int:
    """A size: an int, or hyper-parameters and ints multiplied or divided
    (``num_attention_heads*head_dim``, ``hidden_size/num_attention_heads``), left to right.

    Raises:
        UsageError: a name ``params`` lacks, or a result that is no whole number.
    """
    if isinstance(expression, int) and not isinstance(expression, bool):
        return expression
    text = str(expression).replace(" ", "")
    if not re.fullmatch(r"-?[A-Za-z0-9_.]+([*/][A-Za-z0-9_.]+)*", text):
        raise UsageError(f"{what}: {expression!r} is no size (an int, or hyper-parameters joined by * or /)")
    terms = re.split(r"([*/])", text)
    value = _term(terms[0], params, what)
    for operator, term in zip(terms[1::2], terms[2::2]):
        right = _term(term, params, what)
        if operator == "*":
            value *= right
        elif right == 0 or value % right:
            raise UsageError(f"{what}: {expression!r} is no whole number ({value} / {right})")
        else:
            value //= right
    return value


def _term(term: str, params: dict[str, Any], what: str) -> int:
    if re.fullmatch(r"-?[0-9]+", term):
        return int(term)
    value = params.get(term)
    if type(value) is not int:
        raise UsageError(f"{what}: needs {term}, which the model's config does not give as a whole number"
                         if value is not None else f"{what}: needs {term}, which the model's config does not give")
    return value


# --- the operations ----------------------------------------------------------------------------


def _leaf_of(name: str, leaf: Any, what: str) -> Any:
    from treecli import _leaf

    if not _leaf.is_array(leaf):
        raise UsageError(f"{what}: {name} is not an array")
    return _leaf.as_leaf(leaf)


@dataclass(frozen=True)
class Rename:
    """Rename leaves whose names match ``pattern`` to ``template``."""

    pattern: str
    template: str

    def apply(self, items: Items, params: dict[str, Any]) -> Items:
        mapping = Mapping(self.pattern, self.template, "rename")
        if ("{i}" in self.pattern) != ("{i}" in self.template):
            raise UsageError(f"rename {self.pattern!r} -> {self.template!r}: {{i}} on one side only (stack or unstack "
                             "moves a number between a name and an axis)")
        renamed = []
        for name, leaf in items:
            found = mapping.match(name)
            renamed.append((mapping.rendered(found) if found else name, leaf))
        return _checked(items, renamed, mapping, "rename")

    def inverse(self) -> "Rename":
        back = Mapping(self.pattern, self.template, "rename").inverse()
        return Rename(back.pattern, back.template)


def _checked(before: Items, after: Items, mapping: Mapping, what: str) -> Items:
    """``after``, refused where two leaves would share a name or a renamed name would not
    rename back (a pattern whose groups can split a name in two ways)."""
    seen: dict[str, str] = {}
    back = mapping.inverse()
    for (old, _), (new, _) in zip(before, after):
        if new in seen:
            raise UsageError(f"{what} {mapping.pattern!r} -> {mapping.template!r} gives {seen[new]} and {old} the "
                             f"same name {new}")
        seen[new] = old
        if new != old:
            found = back.match(new)
            if not found or back.rendered(found) != old:
                raise UsageError(f"{what} {mapping.pattern!r} -> {mapping.template!r}: {old} -> {new} does not "
                                 "rename back; make the groups match one way only")
    return after


@dataclass(frozen=True)
class Stack:
    """Stack leaves whose names match ``pattern`` (``{i}`` their number, 0 to n-1 with none
    missing) into one leaf named by ``template``, along a new ``axis``."""

    pattern: str
    template: str
    axis: int = 0

    def apply(self, items: Items, params: dict[str, Any]) -> Items:
        if "{i}" not in self.pattern or "{i}" in self.template:
            raise UsageError(f"stack {self.pattern!r} -> {self.template!r}: mark the number in the names with {{i}}, "
                             "in the pattern only")
        mapping = Mapping(self.pattern, self.template, "stack")
        groups: dict[str, dict[int, Any]] = {}
        place: dict[str, int] = {}
        out: list[tuple[str, Any] | None] = []
        for name, leaf in items:
            found = mapping.match(name)
            if not found:
                out.append((name, leaf))
                continue
            target = mapping.rendered(found)
            if target not in place:
                place[target] = len(out)
                out.append(None)
            groups.setdefault(target, {})[int(found.group("i"))] = _leaf_of(name, leaf, "stack")
        for target, members in groups.items():
            if sorted(members) != list(range(len(members))):
                missing = min(set(range(max(members) + 1)) - set(members))
                raise UsageError(f"stack into {target}: the leaves are not numbered 0 to {len(members) - 1} "
                                 f"(no {missing})")
            try:
                out[place[target]] = (target, _tensor_ops.stacked([members[i] for i in range(len(members))],
                                                                  self.axis))
            except UsageError as e:
                raise UsageError(f"stack into {target}: {e.message}") from None
        names = [entry[0] for entry in out]
        if len(set(names)) != len(names):
            raise UsageError(f"stack {self.pattern!r} -> {self.template!r}: a stacked name is already a leaf's")
        return out

    def inverse(self) -> "Unstack":
        back = Mapping(self.pattern, self.template, "stack").inverse()
        return Unstack(back.pattern, back.template, self.axis)


@dataclass(frozen=True)
class Unstack:
    """Cut each leaf matching ``pattern`` along ``axis`` into leaves named by ``template``
    (``{i}`` their number)."""

    pattern: str
    template: str
    axis: int = 0

    def apply(self, items: Items, params: dict[str, Any]) -> Items:
        if "{i}" not in self.template or "{i}" in self.pattern:
            raise UsageError(f"unstack {self.pattern!r} -> {self.template!r}: mark where the number goes with {{i}}, "
                             "in the template only")
        mapping = Mapping(self.pattern, self.template, "unstack")
        out = []
        for name, leaf in items:
            found = mapping.match(name)
            if not found:
                out.append((name, leaf))
                continue
            pieces = _tensor_ops.unstacked(_leaf_of(name, leaf, "unstack"), self.axis)
            out.extend((mapping.rendered(found, i), piece) for i, piece in enumerate(pieces))
        return _unique(out, f"unstack {self.pattern!r} -> {self.template!r}")

    def inverse(self) -> Stack:
        back = Mapping(self.pattern, self.template, "unstack").inverse()
        return Stack(back.pattern, back.template, self.axis)


def _unique(items: Items, what: str) -> Items:
    names = [name for name, _ in items]
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise UsageError(f"{what}: two leaves would be named {twice}")
    return items


@dataclass(frozen=True)
class Concat:
    """Join the leaves matching each of ``patterns`` (the same groups in each) along
    ``axis`` into one named by ``template``; ``sizes`` (what each part holds along the
    axis, hyper-parameters allowed) say how to split it back, and are checked."""

    patterns: tuple[str, ...]
    template: str
    axis: int = 0
    sizes: tuple[Any, ...] | None = None

    def apply(self, items: Items, params: dict[str, Any]) -> Items:
        first = Mapping(self.patterns[0], self.template, "concat")
        parts = [pattern(p, "concat") for p in self.patterns]
        leaves = dict(items)
        consumed: set[str] = set()
        made: dict[str, Any] = {}
        for name, _ in items:
            found = first.match(name)
            if not found:
                continue
            groups = [found.group(f"g{n}") for n in range(1, len(parts[0].groups()) + 1)]
            names = [part.instance(groups) for part in parts]
            absent = [n for n in names if n not in leaves]
            if absent:
                raise UsageError(f"concat into {first.rendered(found)}: {name} has no {absent[0]} to join")
            members = [_leaf_of(n, leaves[n], "concat") for n in names]
            self._check_sizes(members, params, first.rendered(found))
            try:
                made[names[0]] = (first.rendered(found), _tensor_ops.concatenated(members, self.axis))
            except UsageError as e:
                raise UsageError(f"concat into {first.rendered(found)}: {e.message}") from None
            consumed.update(names)
        out = [made[name] if name in made else (name, leaf) for name, leaf in items
               if name in made or name not in consumed]
        return _unique(out, f"concat -> {self.template!r}")

    def _check_sizes(self, members: list[Any], params: dict[str, Any], target: str) -> None:
        axis = self.axis % max(1, members[0].ndim)
        found = [m.shape[axis] if m.ndim else 0 for m in members]
        if self.sizes is None:
            if len(set(found)) > 1:
                raise UsageError(f"concat into {target}: parts of {found} along axis {axis}: give their sizes so that "
                                 "it can be split back")
            return
        wanted = [size_of(s, params, f"concat into {target}") for s in self.sizes]
        if len(wanted) != len(found) or any(w not in (-1, f) for w, f in zip(wanted, found)):
            raise UsageError(f"concat into {target}: parts of {found} along axis {axis}, and sizes says {wanted}")

    def inverse(self) -> "Split":
        backs = [Mapping(p, self.template, "concat").inverse() for p in self.patterns]
        return Split(backs[0].pattern, tuple(back.template for back in backs), self.axis, self.sizes)


@dataclass(frozen=True)
class Split:
    """Cut each leaf matching ``pattern`` along ``axis`` into parts of ``sizes`` (equal parts
    where None), named by ``templates``."""

    pattern: str
    templates: tuple[str, ...]
    axis: int = 0
    sizes: tuple[Any, ...] | None = None

    def apply(self, items: Items, params: dict[str, Any]) -> Items:
        mappings = [Mapping(self.pattern, t, "split") for t in self.templates]
        out = []
        for name, leaf in items:
            found = mappings[0].match(name)
            if not found:
                out.append((name, leaf))
                continue
            array = _leaf_of(name, leaf, "split")
            axis = self.axis % max(1, array.ndim)
            if self.sizes is not None:
                sizes = [size_of(s, params, f"split of {name}") for s in self.sizes]
            elif array.ndim and array.shape[axis] % len(mappings) == 0:
                sizes = [array.shape[axis] // len(mappings)] * len(mappings)
            else:
                raise UsageError(f"split of {name}: {list(array.shape)} has no {len(mappings)} equal parts along "
                                 f"axis {axis}; give sizes")
            if len(sizes) != len(mappings):
                raise UsageError(f"split of {name}: {len(sizes)} sizes for {len(mappings)} parts")
            try:
                pieces = _tensor_ops.split(array, sizes, axis)
            except UsageError as e:
                raise UsageError(f"split of {name}: {e.message}") from None
            out.extend((m.rendered(found), piece) for m, piece in zip(mappings, pieces))
        return _unique(out, f"split {self.pattern!r}")

    def inverse(self) -> Concat:
        patterns = tuple(Mapping(self.pattern, t, "split").inverse() for t in self.templates)
        return Concat(tuple(m.pattern for m in patterns), patterns[0].template, self.axis, self.sizes)


@dataclass(frozen=True)
class _InPlace:
    """An operation on each leaf whose name matches ``keys`` (a regular expression
    matched against the whole name); the name stays."""

    keys: str

    def apply(self, items: Items, params: dict[str, Any]) -> Items:
        try:
            regex = re.compile(self.keys)
        except re.error as e:
            raise UsageError(f"{self.verb} {self.keys!r}: no regular expression: {e}") from None
        out = []
        for name, leaf in items:
            if regex.fullmatch(name):
                try:
                    leaf = self.changed(_leaf_of(name, leaf, self.verb), params)
                except UsageError as e:
                    raise UsageError(f"{self.verb} of {name}: {e.message}", keypath=name) from None
            out.append((name, leaf))
        return out


@dataclass(frozen=True)
class Transpose(_InPlace):
    """Put the axes of the matching leaves in the order ``axes`` (``[1, 0]``: a Linear
    weight ``[out, in]`` as a kernel ``[in, out]``)."""

    axes: tuple[int, ...] = (1, 0)
    verb = "transpose"

    def changed(self, leaf: Any, params: dict[str, Any]) -> Any:
        return _tensor_ops.transposed(leaf, self.axes)

    def inverse(self) -> "Transpose":
        return Transpose(self.keys, _tensor_ops.inverse_axes(self.axes))


@dataclass(frozen=True)
class Rotary(_InPlace):
    """llama.cpp's row order of the matching Q or K weights, ``heads`` of them (a number or
    a hyper-parameter: ``num_key_value_heads`` for K); ``inverse`` undoes it."""

    heads: Any = "num_attention_heads"
    inverse_order: bool = False
    verb = "rotary permutation"

    def changed(self, leaf: Any, params: dict[str, Any]) -> Any:
        return _tensor_ops.rotary_permuted(leaf, size_of(self.heads, params, "heads"), inverse=self.inverse_order)

    def inverse(self) -> "Rotary":
        return Rotary(self.keys, self.heads, not self.inverse_order)


@dataclass(frozen=True)
class Unflatten(_InPlace):
    """Split axis ``axis`` of the matching leaves into axes of ``sizes`` (one -1 allowed):
    ``[n_heads * head_dim, hidden]`` as ``[n_heads, head_dim, hidden]``."""

    axis: int = 0
    sizes: tuple[Any, ...] = ()
    verb = "unflatten"

    def changed(self, leaf: Any, params: dict[str, Any]) -> Any:
        axis = self.axis % max(1, leaf.ndim)
        sizes = _tensor_ops.resolved_shape([size_of(s, params, "unflatten") for s in self.sizes],
                                           leaf.shape[axis], f"unflatten axis {axis}")
        return _tensor_ops.reshaped(leaf, leaf.shape[:axis] + tuple(sizes) + leaf.shape[axis + 1 :])

    def inverse(self) -> "Flatten":
        return Flatten(self.keys, self.axis, self.sizes)


@dataclass(frozen=True)
class Flatten(_InPlace):
    """Merge the axes from ``axis`` on that have ``sizes`` into one (the inverse of
    :class:`Unflatten`, the sizes checked)."""

    axis: int = 0
    sizes: tuple[Any, ...] = ()
    verb = "flatten"

    def changed(self, leaf: Any, params: dict[str, Any]) -> Any:
        axis, count = self.axis % max(1, leaf.ndim), len(self.sizes)
        wanted = [size_of(s, params, "flatten") for s in self.sizes]
        found = list(leaf.shape[axis : axis + count])
        if len(found) != count or any(w not in (-1, f) for w, f in zip(wanted, found)):
            raise UsageError(f"axes {found} from axis {axis} of {list(leaf.shape)} are not {wanted}")
        return _tensor_ops.reshaped(leaf, leaf.shape[:axis] + (-1,) + leaf.shape[axis + count :])

    def inverse(self) -> Unflatten:
        return Unflatten(self.keys, self.axis, self.sizes)


def applied(operations: Sequence[Any], items: Items, params: dict[str, Any]) -> Items:
    """``items`` through each operation in turn."""
    for operation in operations:
        items = operation.apply(items, params)
    return items


def inverted(operations: Sequence[Any]) -> list[Any]:
    """The operations that undo ``operations``: each one's inverse, in reverse order."""
    return [operation.inverse() for operation in reversed(operations)]


def items_of(tree: Any) -> Items:
    """A tree's leaves by name (key path segments joined by ``.``), in its order."""
    from treecli import _tree

    return [(".".join(str(key) for key in keypath), leaf) for keypath, leaf in _tree.flatten(tree)]


def tree_of(items: Items) -> Any:
    """The nested tree of named leaves (names split at ``.``), as flat formats nest them."""
    from treecli import _tree

    names = {name for name, _ in items}
    for name in names:
        parts = name.split(".")
        inner = next((".".join(parts[:n]) for n in range(1, len(parts)) if ".".join(parts[:n]) in names), None)
        if inner is not None:
            raise UsageError(f"{inner} would be both a leaf and the node that holds {name}")
    return _tree.unflatten([(tuple(name.split(".")), leaf) for name, leaf in items]) if items else {}
