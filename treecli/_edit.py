"""``edit``: ``eqx.tree_at`` from the shell — key-path-addressed surgery.

Operations apply in one pass in a fixed order — rename, delete, set, cast,
scale — so later operations address the renamed key paths. Only what the user
named changes: every other leaf object passes through untouched (a writer
copies its bytes without decoding them). Nothing here reads array data except
a ``@file.npy`` value's header; values are computed when written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from treecli import _dtypes, _errors, _keypath, _leaf, _tree
from treecli._combine import cast_leaf
from treecli._errors import KeyPathError, TreecliError, UsageError, counted
from treecli._keypath import format_keypath


@dataclass
class EditReport:
    """One row per changed leaf (for ``--dry-run``), and warnings found while writing."""

    rows: list[tuple[str, str, str, str]] = field(default_factory=list)  # keypath, before, after, what
    warnings: list[str] = field(default_factory=list)


@dataclass
class Edits:
    """The operations of one ``edit``, as the user typed them (``PATTERN=VALUE`` strings)."""

    rename: list[str] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    set: list[str] = field(default_factory=list)
    cast: list[str] = field(default_factory=list)
    scale: list[str] = field(default_factory=list)
    allow_reshape: bool = False
    #: How a ``KEYPATH=@file.npy`` value is read: a file name to a lazy leaf (the library's
    #: ``treecli.edit`` and the CLI give ``formats.npy.open_array``; operations read no files).
    open_array: Callable[[Path], Any] | None = None


def edit(tree: Any, edits: Edits) -> tuple[Any, EditReport]:
    """Apply ``edits`` to a tree; returns the new tree and a report. The input is not mutated.

    Raises:
        KeyPathError: a pattern that matches nothing (closest key paths named), a
            rename collision (both key paths named), a key path both set and deleted.
        UsageError: a bad value, dtype or factor; a set of a subtree with a scalar.
    """
    report = EditReport()
    items = _tree.flatten(tree, nones=True)  # an empty subtree keeps its place (and can be set)
    originals = dict(items)

    def describe(keypath: tuple) -> str:  # only leaves that end up in the report are described
        return _tree.describe_leaf(originals[keypath]) if keypath in originals else "-"

    origin = {kp: kp for kp, _ in items}  # new key path -> original key path

    what: dict[tuple, list[str]] = {}  # new key path -> what happened to it
    items, origin = _rename(items, origin, edits.rename, what)
    items = _delete(items, edits.delete, edits.set, report, origin, describe, what)
    leaves = dict(items)
    for text in edits.set:
        _set(leaves, text, edits, what, report)
    for text in edits.cast:
        _cast(leaves, text, what, report)
    for text in edits.scale:
        _scale(leaves, text, what, report)
    for keypath, actions in what.items():
        before = describe(origin.get(keypath, keypath))
        report.rows.append((format_keypath(keypath), before, _tree.describe_leaf(leaves[keypath]), ", ".join(actions)))
    report.rows.sort(key=lambda row: row[0])
    new_items = [(kp, leaves[kp]) for kp, _ in items]
    if not new_items:
        return {}, report
    return _tree.unflatten(new_items, template=tree), report


# --- rename ---------------------------------------------------------------------------------


def _rename(items, origin, rules, what):
    for text in rules:
        old_text, new_text = _split(text, "rename", "OLD=NEW")
        pattern, template = _keypath.parse(old_text), _keypath.parse(new_text)
        renamed: dict[tuple, tuple] = {}
        for keypath, _ in items:
            found = _keypath.match_prefix_with_captures(pattern, keypath)
            if found is not None:
                length, captures = found
                renamed[keypath] = _keypath.fill_template(template, captures, new_text) + tuple(keypath[length:])
        if not renamed:
            raise _no_match(items, old_text, f"{_errors.option('rename', text)} matches nothing")
        _check_collisions(items, renamed, text)
        items = [(renamed.get(kp, kp), leaf) for kp, leaf in items]
        origin = {renamed.get(kp, kp): origin[kp] for kp in origin}
        for old, new in renamed.items():
            what[new] = what.pop(old, []) + [f"renamed from {format_keypath(old)}"]
    return items, origin


def _check_collisions(items, renamed, text):
    targets: dict[tuple, tuple] = {}
    for old, new in renamed.items():
        if new in targets:
            raise KeyPathError(f"{_errors.option('rename', text)} sends {format_keypath(targets[new])} and "
                               f"{format_keypath(old)} "
                               "to the same key path", keypath=format_keypath(new))
        targets[new] = old
    staying = {kp for kp, _ in items if kp not in renamed}
    for new, old in targets.items():
        clash = next((kp for kp in staying if kp == new or kp[: len(new)] == new or new[: len(kp)] == kp), None)
        if clash is not None:
            raise KeyPathError(f"{_errors.option('rename', text)} moves {format_keypath(old)} onto the existing "
                               f"{format_keypath(clash)}",
                               keypath=format_keypath(new))


# --- delete ---------------------------------------------------------------------------------


def _delete(items, patterns, sets, report, origin, describe, what):
    set_paths = {}
    for text in sets:
        target, _ = _split(text, "set", "KEYPATH=VALUE")
        set_paths[target] = _keypath.parse(target)
    kept = items
    for text in patterns:
        pattern = _keypath.parse(text)
        gone = {kp for kp, _ in kept if _keypath.covers(pattern, kp)}
        if not gone:
            raise _no_match(kept, text, f"{_errors.option('delete', text)} matches nothing")
        for target, parsed in set_paths.items():
            if any(_keypath.matches(parsed, kp) for kp in gone):
                raise KeyPathError(f"both deleted by {_errors.option('delete', text)} and set by "
                                   f"{_errors.option('set', target)}", keypath=target)
        for kp, _ in kept:
            if kp in gone:
                what.pop(kp, None)
                report.rows.append((format_keypath(kp), describe(origin.get(kp, kp)), "-", "deleted"))
        kept = [(kp, leaf) for kp, leaf in kept if kp not in gone]
    return kept


# --- set ------------------------------------------------------------------------------------


def _set(leaves, text, edits, what, report):
    target_text, value_text = _split(text, "set", "KEYPATH=VALUE")
    keypath = _resolve_one(leaves, target_text, "set")
    old = leaves[keypath]
    if value_text.startswith("@"):
        new = _from_npy(Path(value_text[1:]), old, edits, target_text, report)
    else:
        value = _parse_number(value_text, _errors.option("set", text))
        if _leaf.is_array(old):
            old_leaf = _leaf.as_leaf(old)
            new = _constant_leaf(old_leaf.shape, old_leaf.dtype_name, value, target_text, report)
        elif old is None:
            raise UsageError(f"a None leaf can only be set from a file: {_errors.option('set', 'KEYPATH=@value.npy')}",
                             keypath=target_text)
        elif isinstance(old, (int, float, bool)) or old.__class__.__module__ == "numpy":
            new = type(old)(value) if isinstance(old, (int, float, bool)) else value
        else:
            raise UsageError(f"cannot set a {type(old).__name__} leaf to a number", keypath=target_text)
    leaves[keypath] = new
    what.setdefault(keypath, []).append("set")


def _constant_leaf(shape, dtype_name, value, keypath, report):
    import numpy as np

    dtype = _dtypes.numpy_dtype(dtype_name)
    stored = np.asarray(value).astype(dtype)
    if not _same_value(value, stored, dtype_name):
        report.warnings.append(f"{keypath}: {value!r} is stored as {stored.item()!r} in {dtype_name}")

    def compute(start: int, stop: int):
        return np.full(stop - start, stored, dtype)

    return _leaf.ComputedLeaf(shape, dtype_name, compute)


def _same_value(value, stored, dtype_name) -> bool:
    try:  # (complex128 holds every value a number typed on the command line becomes)
        back = complex(stored.astype("complex128"))
    except (TypeError, ValueError):
        return True
    value = complex(value)
    same = (math.isnan(value.real) and math.isnan(back.real)) or back.real == value.real
    return same and ((math.isnan(value.imag) and math.isnan(back.imag)) or back.imag == value.imag)


def _from_npy(path: Path, old, edits, keypath, report):
    if edits.open_array is None:
        raise UsageError("a value from a file needs Edits(open_array=...), as treecli.edit gives", keypath=keypath)
    try:
        array = edits.open_array(path)
    except TreecliError as e:
        raise e.with_keypath(keypath)
    if old is None or not _leaf.is_array(old):
        return array
    old_leaf = _leaf.as_leaf(old)
    if tuple(array.shape) != old_leaf.shape and not edits.allow_reshape:
        raise UsageError(f"shape {list(array.shape)} does not match the leaf's {list(old_leaf.shape)} "
                         f"(use {_errors.option('allow_reshape')} to replace the shape too)", file=str(path),
                         keypath=keypath)
    if array.dtype_name == old_leaf.dtype_name:
        return array
    return cast_leaf(array, old_leaf.dtype_name, keypath, report.warnings.append)


# --- cast and scale -------------------------------------------------------------------------


def _cast(leaves, text, what, report):
    pattern_text, dtype_text = _split(text, "cast", "PATTERN=DTYPE")
    dtype_name = _dtypes.parse(dtype_text)
    keypaths = _targets(leaves, pattern_text, "cast")
    for keypath in keypaths:
        old = leaves[keypath]
        leaf = _leaf.as_leaf(old)
        if leaf.dtype_name == dtype_name:
            continue
        leaves[keypath] = cast_leaf(leaf, dtype_name, format_keypath(keypath), report.warnings.append)
        what.setdefault(keypath, []).append(f"cast to {dtype_name}")


def _scale(leaves, text, what, report):
    pattern_text, factor_text = _split(text, "scale", "PATTERN=FACTOR")
    factor = _parse_number(factor_text, _errors.option("scale", text))
    if not math.isfinite(factor):
        raise UsageError(f"{_errors.option('scale', text)}: the factor must be a finite number")
    for keypath in _targets(leaves, pattern_text, "scale"):
        source = _leaf.as_leaf(leaves[keypath])

        def compute(start, stop, source=source):
            import numpy as np  # (when data is computed: planning and --dry-run go without NumPy)

            chunk = source.read_flat(start, stop)
            return (chunk.astype(np.float64) * factor).astype(source.dtype)

        leaves[keypath] = _leaf.ComputedLeaf(source.shape, source.dtype_name, compute, inputs=[source])
        what.setdefault(keypath, []).append(f"scaled by {factor:g}")


def _targets(leaves, pattern_text, name) -> list[tuple]:
    """Leaves a cast/scale pattern addresses: a wildcard pattern takes float leaves only;
    a key path named exactly is taken whatever its dtype (scale still needs a float)."""
    pattern = _keypath.parse(pattern_text)
    covered = [kp for kp in leaves if _keypath.covers(pattern, kp)]
    if not covered:
        raise _no_match(leaves.items(), pattern_text, f"{_errors.option(name, pattern_text)} matches nothing")
    exact = _keypath.is_literal(pattern) and len(covered) == 1 and _keypath.matches(pattern, covered[0])
    arrays = [kp for kp in covered if _leaf.is_array(leaves[kp])]
    if exact:
        if not arrays:
            raise UsageError(f"{_errors.option(name, pattern_text)}: not an array "
                             f"({_tree.describe_leaf(leaves[covered[0]])})",
                             keypath=format_keypath(covered[0]))
        if name == "scale" and not _dtypes.is_float(_leaf.as_leaf(leaves[arrays[0]]).dtype_name):
            raise UsageError(f"{_errors.option(name, pattern_text)}: scaling applies to floating-point leaves; "
                             f"this one is "
                             f"{_leaf.as_leaf(leaves[arrays[0]]).dtype_name}", keypath=format_keypath(arrays[0]))
        return arrays
    floats = [kp for kp in arrays if _dtypes.is_float(_leaf.as_leaf(leaves[kp]).dtype_name)]
    if not floats:
        raise KeyPathError(f"{_errors.option(name, pattern_text)} matches no floating-point leaf", keypath=pattern_text)
    return floats


# --- helpers --------------------------------------------------------------------------------


def _split(text: str, name: str, form: str) -> tuple[str, str]:
    try:
        left, right = _keypath.split_assignment(text)
    except KeyPathError:
        raise UsageError(f"{_errors.option(name, text)}: expected {form}") from None
    left, right = left.strip(), right.strip()
    if not left or not right:
        raise UsageError(f"{_errors.option(name, text)}: expected {form}")
    _keypath.parse(left)
    return left, right


def _resolve_one(leaves: dict, text: str, name: str) -> tuple:
    pattern = _keypath.parse(text)
    exact = [kp for kp in leaves if _keypath.matches(pattern, kp)]
    if len(exact) == 1:
        return exact[0]
    if len(exact) > 1:
        raise UsageError(f"{_errors.option(name, text)} names one leaf; it matches {len(exact)}", keypath=text)
    under = [kp for kp in leaves if _keypath.covers(pattern, kp)]
    if under:
        raise UsageError(f"{_errors.option(name, text)}: a subtree of {counted(len(under), 'leaf', 'leaves')}, "
                         f"not a leaf; set each leaf (e.g. {format_keypath(under[0])})", keypath=text)
    raise _no_match(leaves.items(), text, "no such key path")


def _no_match(items, text: str, what: str) -> KeyPathError:
    """The error for a pattern that matches nothing among ``(keypath, leaf)`` pairs, naming the closest."""
    items = list(items)
    return _tree.no_match(_tree.unflatten(items) if items else {}, text, what)


def _parse_number(text: str, where: str) -> float:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return 1.0 if lowered == "true" else 0.0
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{where}: {text!r} is not a number (or @file.npy)") from None
    return int(value) if value.is_integer() and "." not in text and "e" not in lowered else value


MISSING = object()  # at()'s "no replace= given": None is a value one may well put in


def at(tree: Any, where: str | list[str], replace: Any = MISSING,
       replace_fn: Callable[[Any], Any] | None = None) -> Any:
    """``eqx.tree_at`` with key-path strings, on a native tree (``treecli.at`` takes any pytree).

    Raises:
        KeyPathError: a key path that names no node (closest named) or several.
    """
    wheres, values = pair_up(where, replace, replace_fn)
    for text, value in zip(wheres, values):
        found = _tree.find(tree, text)
        if len(found) != 1:
            raise (_tree.no_match(tree, text) if not found
                   else KeyPathError(f"names {len(found)} nodes; give one key path", keypath=text))
        tree = _replace(tree, found[0], replace_fn(_tree.get(tree, found[0])) if replace_fn else value)
    return tree


def pair_up(where: str | list[str], replace: Any, replace_fn: Callable[[Any], Any] | None) -> tuple[list, list]:
    """``at()``'s key paths and their values (``None`` each with ``replace_fn``).

    Raises:
        UsageError: not exactly one of ``replace`` and ``replace_fn``, or as many values as key paths.
    """
    if (replace is MISSING) == (replace_fn is None):
        raise UsageError("at() takes exactly one of replace= and replace_fn=")
    wheres = [where] if isinstance(where, str) else list(where)
    if replace_fn is not None:
        return wheres, [None] * len(wheres)
    if isinstance(where, str):
        return wheres, [replace]
    values = list(replace)
    if len(values) != len(wheres):
        raise UsageError(f"{len(values)} replacements for {len(wheres)} key paths")
    return wheres, values


def _replace(node: Any, keypath: tuple, value: Any) -> Any:
    if not keypath:
        return value
    key, rest = keypath[0], keypath[1:]
    if isinstance(node, dict):
        return {k: (_replace(v, rest, value) if k == key else v) for k, v in node.items()}
    return _tree.rebuild_sequence(node, [(_replace(v, rest, value) if i == key else v) for i, v in enumerate(node)])
