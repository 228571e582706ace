"""Flat-keyed formats (safetensors ``a.b.c``, npz ``a/b/c``) shown as nested trees.

Splitting on the separator and joining back is exact, so a round trip to the
same kind of format never renames anything.
"""

from __future__ import annotations

from typing import Any

from treecli import _tree
from treecli._errors import TreecliError, in_cli
from treecli._keypath import format_keypath


def nest(items: list[tuple[str, Any]], separator: str) -> tuple[dict, str | None]:
    """Nest flat ``(key, leaf)`` pairs by splitting keys on ``separator``.

    Returns the tree and a warning, or ``(flat dict, warning)`` when the keys
    cannot nest (both ``a`` and ``a.b`` exist).
    """
    root: dict = {}
    inner: dict[str, dict] = {}  # "a.b" -> the dict at a.b: sibling keys share it without a walk

    def node_at(prefix: str) -> dict | None:
        """The dict at ``prefix``, made (with its parents) if new; None where a leaf is in the way."""
        node = inner.get(prefix)
        if node is None:
            parent_prefix, sep, last = prefix.rpartition(separator)
            parent = node_at(parent_prefix) if sep else root
            node = None if parent is None else parent.setdefault(last, {})
            if not isinstance(node, dict):
                return None
            inner[prefix] = node
        return node

    last_prefix, node = None, None  # keys come grouped by prefix: the last one's, without a lookup
    for key, leaf in items:
        prefix, sep, last = key.rpartition(separator)
        if not sep:
            node, last_prefix = root, None
        elif prefix != last_prefix:
            node, last_prefix = inner.get(prefix), prefix
        if node is None:  # the first key under this prefix
            if prefix.count(separator) + 2 > _tree.MAX_DEPTH:
                return {k: v for k, v in items}, (f"key {key!r} has {prefix.count(separator) + 2} segments, more "
                                                  f"levels than treecli nests ({_tree.MAX_DEPTH}); showing keys flat")
            node = node_at(prefix)
        if node is None or last in node:  # `a` is a leaf and `a.b` wants it as a node; `a.b` made `a` a node
            return _flat(items, key, separator)
        node[last] = leaf
    return root, None


def _flat(items: list[tuple[str, Any]], key: str, separator: str) -> tuple[dict, str]:
    warning = (
        f"keys cannot nest on {separator!r} (e.g. {key!r} is both a tensor and a prefix "
        "of another); showing them flat"
    )
    return {k: v for k, v in items}, warning


def join(keypath: tuple, separator: str, file: str) -> str:
    """Join a key path into a flat key with ``separator``.

    Raises:
        TreecliError: when a key contains the separator (it would not split back).
    """
    parts = [str(k) for k in keypath]
    if len(parts) > 1:
        for part in parts:
            if separator in part:
                raise TreecliError(
                    f"key {part!r} contains {separator!r}, the separator of this format's flat keys; "
                    "rename it first" + in_cli(" (treecli edit --rename)"),
                    file=file,
                    keypath=format_keypath(keypath),
                )
    if not parts:
        raise TreecliError("a bare array at the root has no key to store it under", file=file)
    return separator.join(parts)


def flatten_for_writing(tree: Any, separator: str, file: str) -> list[tuple[str, tuple, Any]]:
    """``(flat key, key path, leaf)`` for every leaf; duplicate flat keys are an error."""
    out = []
    seen: dict[str, tuple] = {}
    if isinstance(tree, (dict, list, tuple)) and not tree:  # an empty checkpoint: nothing to store
        return out
    for keypath, leaf in _tree.flatten(tree):
        key = join(keypath, separator, file)
        if key in seen:
            raise TreecliError(
                f"key paths {format_keypath(seen[key])} and {format_keypath(keypath)} "
                f"both become the flat key {key!r}",
                file=file,
            )
        seen[key] = keypath
        out.append((key, keypath, leaf))
    return out
