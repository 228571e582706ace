"""Tree walks over nested dict / list / tuple with key paths.

treecli's own small versions of ``jax.tree_util``'s walks, so that commands on
flat formats run on NumPy alone. Conventions:

- inner nodes are non-empty ``dict``, ``list`` and ``tuple`` (namedtuples too);
- ``None`` is an empty subtree, as in ``jax.tree_util``: kept where it stands in a
  tree, but no leaf — never shown, compared, averaged or written (an Orbax checkpoint
  of ``eqx.filter(model, eqx.is_array)`` has the same leaves as its safetensors copy);
- leaves are everything else: arrays, Python scalars, strings and *empty*
  containers (shown as ``{}`` / ``[]`` leaves);
- dict children are visited in natural order (``layers.2`` before ``layers.10``),
  sequence children by index.
"""

from __future__ import annotations

from typing import Any, Callable, Container, Iterator, Sequence

from treecli import _keypath, _leaf
from treecli._errors import KeyPathError
from treecli._keypath import KeyPath, format_keypath


# The deepest tree treecli walks. Its walks recurse a frame or two per level, so this
# keeps them far from Python's recursion limit: formats refuse deeper trees on open,
# and flat-keyed ones show keys that would nest deeper flat instead.
MAX_DEPTH = 100


def is_node(value: Any) -> bool:
    return isinstance(value, (dict, list, tuple)) and len(value) > 0


def child_keys(node: Any) -> list | range:
    """The keys of an inner node's children, in display order."""
    return sorted(node, key=_keypath.natural_sort_key) if isinstance(node, dict) else range(len(node))


def children(node: Any) -> list[tuple[Any, Any]]:
    """``(key, child)`` pairs of an inner node, in display order."""
    return [(k, node[k]) for k in child_keys(node)]


def flatten(tree: Any, *, nones: bool = False) -> list[tuple[KeyPath, Any]]:
    """All leaves with their key paths, in display order; with ``nones``, each ``None``
    too, for rebuilding a tree (``unflatten``) with its empty subtrees where they were."""
    out: list[tuple[KeyPath, Any]] = []

    def walk(node: Any, prefix: KeyPath) -> None:
        if is_node(node):
            for key, child in children(node):
                walk(child, prefix + (key,))
        elif nones or node is not None:
            out.append((prefix, node))

    walk(tree, ())
    return out


def leaves(tree: Any) -> Iterator[Any]:
    """Every leaf, as stored: no key paths, no display order (for totals; a 200k-leaf
    tree's ``flatten`` takes 0.3 s sorting keys)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if is_node(node):
            stack.extend(node.values() if isinstance(node, dict) else node)
        elif node is not None:
            yield node


def array_bytes(tree: Any) -> int:
    """The bytes of every array leaf, as stored (what an output holds, or a progress bar counts)."""
    return sum(_leaf.as_leaf(x).nbytes for x in leaves(tree) if _leaf.is_array(x))


def sources(tree: Any) -> list[str]:
    """Every file, checkpoint directory or URL the tree's lazy leaves are read from."""
    found = dict.fromkeys(s for x in leaves(tree) if isinstance(x, _leaf.ArrayLeaf) for s in x.sources)
    return list(found)


def iter_nodes(tree: Any) -> Iterator[tuple[KeyPath, Any]]:
    """Every node, inner and leaf, with its key path (the root first). ``None`` is among
    them: an empty subtree can be named (and replaced: ``at``, ``edit --set``)."""
    stack: list[tuple[KeyPath, Any]] = [((), tree)]
    while stack:
        keypath, node = stack.pop()
        yield keypath, node
        if is_node(node):
            stack.extend((keypath + (k,), c) for k, c in reversed(children(node)))


def map_leaves(fn: Callable[[KeyPath, Any], Any], tree: Any) -> Any:
    """A new tree of the same structure with ``fn(keypath, leaf)`` at each leaf.

    Leaves are visited in display order (and new dicts keep that order); ``None``
    stays where it is.
    """

    def walk(node: Any, prefix: KeyPath) -> Any:
        if node is None:
            return None
        if not is_node(node):
            return fn(prefix, node)
        if isinstance(node, dict):
            return {k: walk(v, prefix + (k,)) for k, v in children(node)}
        return rebuild_sequence(node, [walk(v, prefix + (i,)) for i, v in enumerate(node)])

    return walk(tree, ())


def rebuild_sequence(original: list | tuple, items: list) -> list | tuple:
    """``items`` in a sequence of ``original``'s kind: a list, the same tuple type, or
    the same namedtuple (a plain tuple if the count of fields no longer fits)."""
    if isinstance(original, list):
        return list(items)
    if hasattr(original, "_fields"):  # namedtuple
        return type(original)(*items) if len(items) == len(original) else tuple(items)
    return type(original)(items)


def unflatten(items: list[tuple[KeyPath, Any]], template: Any = None, lists: Container[KeyPath] = ()) -> Any:
    """Build a tree from ``(keypath, leaf)`` pairs.

    Inner nodes are dicts, except where ``template`` has a list or tuple at the
    same key path and the children are sequence indices: those keep their type
    (with indices renumbered in order if some were removed); and where a key
    path in ``lists`` has children ``0`` to ``n - 1``: those become lists.
    """
    if len(items) == 1 and items[0][0] == ():
        return items[0][1]
    root: dict = {}
    for keypath, leaf in items:
        node = root
        for key in keypath[:-1]:
            node = node.setdefault(key, {})
        node[keypath[-1]] = leaf

    def restore(node: dict, prefix: KeyPath, rebuilt: dict) -> Any:
        original = _get_or_none(template, prefix)
        if isinstance(original, (list, tuple)) and all(isinstance(k, int) for k in rebuilt):
            return rebuild_sequence(original, [rebuilt[k] for k in sorted(rebuilt)])
        if prefix in lists and set(rebuilt) == set(range(len(rebuilt))):
            return [rebuilt[i] for i in range(len(rebuilt))]
        return rebuilt

    # Inner nodes in pre-order, then rebuilt children first, without recursion: a key path
    # may be thousands of segments deep.
    inner: list[tuple[dict, KeyPath]] = []
    stack: list[tuple[dict, KeyPath]] = [(root, ())]
    while stack:
        node, prefix = stack.pop()
        inner.append((node, prefix))
        stack.extend((child, prefix + (k,)) for k, child in node.items() if isinstance(child, dict) and child)
    done: dict[int, Any] = {}
    for node, prefix in reversed(inner):
        done[id(node)] = restore(node, prefix, {k: done.get(id(v), v) if isinstance(v, dict) else v
                                                for k, v in node.items()})
    return done[id(root)]


def _get_or_none(tree: Any, keypath: KeyPath) -> Any:
    node = tree
    for key in keypath:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def get(tree: Any, keypath: KeyPath) -> Any:
    """The node at an exact key path tuple. Raises KeyError if absent."""
    node = tree
    for key in keypath:
        if not is_node(node):
            raise KeyError(keypath)
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            raise KeyError(keypath) from None
    return node


def find(tree: Any, pattern: str | tuple) -> list[KeyPath]:
    """Key paths of the nodes (inner or leaf) a pattern matches, in display order.

    A literal key path resolves to at most one node; ``*`` / ``**`` can match many.
    """
    parsed = _keypath.parse(pattern) if isinstance(pattern, str) else pattern
    return [kp for kp, _ in iter_nodes(tree) if _keypath.matches(parsed, kp)]


def no_match(tree: Any, pattern_text: str, what: str = "matches nothing") -> KeyPathError:
    """The error for a pattern that matches nothing, naming the closest key paths."""
    candidates = [format_keypath(kp) for kp, _ in iter_nodes(tree) if kp]
    near = _keypath.closest(pattern_text, candidates)
    hint = f"; closest: {', '.join(near)}" if near else ""
    return KeyPathError(f"{what}{hint}", keypath=pattern_text)


def resolve(tree: Any, pattern_text: str) -> list[KeyPath]:
    """Like :func:`find`, but a pattern that matches nothing is a :class:`KeyPathError`."""
    found = find(tree, pattern_text)
    if not found:
        raise no_match(tree, pattern_text)
    return found


def selected(tree: Any, where: Sequence[str]) -> Any:
    """The part of ``tree`` under the nodes the ``where`` patterns name, every leaf at its
    own key path (lists stay lists where whole).

    Raises:
        KeyPathError: a pattern that matches nothing (naming the closest key paths).
    """
    for text in where:
        resolve(tree, text)
    patterns = [_keypath.parse(text) for text in where]
    kept = [(kp, leaf) for kp, leaf in flatten(tree) if any(_keypath.covers(p, kp) for p in patterns)]
    # (a sequence kept in part is a dict by index: its leaves keep their numbers)
    sequences = {kp for kp, node in iter_nodes(tree) if isinstance(node, (list, tuple))}
    return unflatten(kept, lists=sequences) if kept else {}


def describe_leaf(leaf: Any) -> str:
    """``[2, 3] float32`` for arrays, the type for other leaves (for structure messages)."""
    from treecli import _leaf

    if _leaf.is_array(leaf):
        dtype = leaf.dtype_name if isinstance(leaf, _leaf.ArrayLeaf) else getattr(leaf.dtype, "name", str(leaf.dtype))
        return f"[{', '.join(str(int(d)) for d in leaf.shape)}] {dtype}"
    if leaf is None:
        return "None"
    if isinstance(leaf, (dict, list, tuple)):
        return f"empty {type(leaf).__name__}"
    return type(leaf).__name__


def same_layout(a: Any, b: Any) -> bool:
    """Whether two leaves are described alike by :func:`describe_leaf`; two array leaves
    by their shapes and dtypes, without the text (two strings a leaf took 0.58 s of a
    200k-leaf verification's 3.6 s)."""
    from treecli import _leaf

    if isinstance(a, _leaf.ArrayLeaf) and isinstance(b, _leaf.ArrayLeaf):
        return a.dtype_name == b.dtype_name and tuple(a.shape) == tuple(b.shape)
    return describe_leaf(a) == describe_leaf(b)


def values_equal(a: Any, b: Any) -> bool:
    """Equality of two non-array leaves: same type and value, NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and a != a and b != b:  # both NaN
        return True
    try:
        return bool(a == b)
    except Exception:  # a value whose == raises or is ambiguous counts as different
        return False


def by_text(tree: Any) -> dict[str, Any]:
    """Leaves by their key path's text: how trees from different formats line up (an Orbax
    list's ``layers.0`` has the key ``0``, a safetensors name's the key ``"0"``)."""
    return {format_keypath(kp): leaf for kp, leaf in flatten(tree)}


def structure_differences(trees: list[Any], names: list[str]) -> list[str]:
    """One line per key path where the trees disagree: missing in some, or a different shape/dtype/type.

    Lines read like ``model.w: [2, 3] float32 in a.safetensors; [3, 3] float32 in b.safetensors``.
    """
    flats = [by_text(tree) for tree in trees]
    keys: dict[str, KeyPath] = {}
    for tree in trees:
        keys.update((format_keypath(kp), kp) for kp, _ in flatten(tree))
    lines = []
    for name in sorted(keys, key=lambda t: tuple(_keypath.natural_sort_key(k) for k in keys[t])):
        text = name or "<root>"
        present = [i for i, flat in enumerate(flats) if name in flat]
        if len(present) != len(flats):
            lines.append(f"{text}: only in {', '.join(names[i] for i in present)}")
            continue
        descriptions = [describe_leaf(flat[name]) for flat in flats]
        if len(set(descriptions)) > 1:
            groups: dict[str, list[str]] = {}
            for description, name in zip(descriptions, names):
                groups.setdefault(description, []).append(name)
            lines.append(f"{text}: " + "; ".join(f"{d} in {', '.join(n)}" for d, n in groups.items()))
    return lines


def same_bytes(a, b) -> bool:
    """Whether two C-contiguous arrays of one dtype hold the same bytes: compared as
    64-bit words (40x faster here than ``a.tobytes() == b.tobytes()``, which copies both)."""
    import numpy as np

    x, y = np.ascontiguousarray(a).reshape(-1).view(np.uint8), np.ascontiguousarray(b).reshape(-1).view(np.uint8)
    if x.size != y.size:
        return False
    words = x.size // 8 * 8
    return bool(np.array_equal(x[:words].view(np.uint64), y[:words].view(np.uint64))) and \
        x[words:].tobytes() == y[words:].tobytes()


def shares(pairs: list[tuple[str, Any]], parts: int) -> dict[str, int]:
    """Which of ``parts`` processes takes each named leaf (``diff``'s comparisons, ``hash``'s
    digests): the next array to the part with the fewest bytes so far, other leaves to part
    0 — the same answer in every process."""
    owner: dict[str, int] = {}
    load = [0] * parts
    for text, leaf in pairs:
        if _leaf.is_array(leaf) and parts > 1:
            owner[text] = load.index(min(load))
            load[owner[text]] += _leaf.as_leaf(leaf).nbytes
        else:
            owner[text] = 0
    return owner
