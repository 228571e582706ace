"""What ``show`` reports: a summary tree with per-subtree totals, from metadata alone."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from treecli import _dtypes, _keypath, _leaf, _tree
from treecli._keypath import KeyPath, format_keypath


@dataclass(slots=True)
class Node:
    """One row of ``show``: an inner node with totals, an array leaf, or a value leaf.

    A row knows its key, not its key path: the 333k rows of a big tree build their paths
    from their parents' only where shown (``leaves_by_keypath``)."""

    key: Any
    kind: str  # "node", "array" or "value"
    children: Sequence["Node"] = ()
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    nbytes: int = 0
    params: int = 0
    num_leaves: int = 0
    value: Any = None  # a value leaf's value; an array row's array, for --stats to read
    stats: dict[str, Any] | None = None
    # An inner node's layout: equal for subtrees that show the same rows (the same keys,
    # shapes and dtypes all the way down, and no value leaf), as the layers of a model do.
    layout: int = -1
    # The root's ``(arrays, params, bytes)`` per stored type, counted as ``summarize`` builds it.
    by_dtype: dict[str, list[int]] | None = None
    # How an array is stored where that is not its dtype (``Q4_0``: GGUF's quantized blocks);
    # the bytes stored, summed up the tree (a dtype's own where stored as it reads).
    stored: str | None = None
    stored_nbytes: int = 0
    # The root's: whether any array under it is stored otherwise than it reads.
    any_stored_otherwise: bool = False


def summarize(tree: Any, where: list[str] = (), *, shared: bool = True) -> Node:
    """The summary tree of ``tree``, restricted to the subtrees ``where`` patterns cover.

    ``shared``: subtrees of one layout (a model's layers, each expert of each layer) share
    their rows below, the first one's: made once, not once per layer. Without, each array's
    row is its own, holding its own array (for ``add_stats``).

    Raises:
        KeyPathError: a ``where`` pattern that matches nothing (naming the closest key paths).
    """
    patterns = [(text, _keypath.parse(text)) for text in where]
    for text, pattern in patterns:
        if not any(_keypath.matches(pattern, kp) for kp, _ in _tree.iter_nodes(tree)):
            raise _tree.no_match(tree, text)

    def leaf_row(key: Any, keypath: KeyPath, leaf: Any) -> Node | None:
        if leaf is None:  # an empty subtree, as in jax.tree_util
            return None
        if patterns and not any(_keypath.covers(p, keypath) for _, p in patterns):
            return None
        if _leaf.is_array(leaf):
            if isinstance(leaf, _leaf.ArrayLeaf):
                return array_row(key, leaf)
            shape = tuple(int(d) for d in leaf.shape)
            dtype = _dtypes.name(leaf.dtype)
            size = math.prod(shape)
            nbytes = size * _dtypes.itemsize(dtype)
            return Node(key, "array", (), shape, dtype, nbytes, size, 1, leaf, stored_nbytes=nbytes)
        return Node(key, "value", value=leaf, num_leaves=1)

    def array_row(key: Any, leaf: _leaf.ArrayLeaf) -> Node:
        size = prod(leaf.shape)
        nbytes = size * itemsize(leaf.dtype_name)
        if leaf.stored_otherwise:
            return Node(key, "array", (), leaf.shape, leaf.dtype_name, nbytes, size, 1, leaf,
                        stored=leaf.stored_dtype, stored_nbytes=leaf.stored_nbytes)
        return Node(key, "array", (), leaf.shape, leaf.dtype_name, nbytes, size, 1, leaf, stored_nbytes=nbytes)

    first_of_layout: dict[tuple, Node] = {}
    prod, itemsize, array_leaf, is_node, natural_sort_key = math.prod, _dtypes.itemsize, _leaf.ArrayLeaf, \
        _tree.is_node, _keypath.natural_sort_key

    # The hot loop of `show` (200k leaves under 133k nodes for a 200k-tensor header): an
    # array leaf is described by a tuple, and gets a row only if its layout is new. Children
    # are visited as stored and sorted into display order only then: a layout is the stored
    # order's (the same keys in another order are another layout, and show the same).
    def build(node: dict | list | tuple, keypath: KeyPath) -> Node | None:
        keys, children, parts = [], [], []  # parts: what the rows below show, the node's layout
        for k, child in node.items() if isinstance(node, dict) else enumerate(node):
            if isinstance(child, array_leaf) and not patterns:
                part = (k, child.shape, child.dtype_name, child.stored_dtype) if child.stored_otherwise else \
                    (k, child.shape, child.dtype_name)
            else:
                child = build(child, keypath + (k,)) if is_node(child) else leaf_row(k, keypath + (k,), child)
                if child is None:
                    continue
                # a value leaf's row shows its value: no other subtree shows the same
                part = ((k, child.layout) if child.kind == "node" else (k, child.shape, child.dtype, child.stored)
                        if child.kind == "array" else (k, "value", id(child)))
            keys.append(k)
            children.append(child)
            # 1 == True: a key that is not a str goes with its type ("1" and "True" show apart)
            parts.append(part if type(k) is str else (type(k), part))
        if not parts and keypath:
            return None
        key = keypath[-1] if keypath else None
        layout = tuple(parts)
        first = first_of_layout.get(layout)
        if first is not None and shared:
            return Node(key, "node", first.children, None, None, first.nbytes, first.params, first.num_leaves,
                        layout=first.layout, stored_nbytes=first.stored_nbytes)
        kids = []
        order = range(len(keys)) if not isinstance(node, dict) else sorted(
            range(len(keys)), key=lambda i: natural_sort_key(keys[i]))
        for i in order:
            k, child = keys[i], children[i]
            if isinstance(child, array_leaf):
                child = array_row(k, child)
            kids.append(child)
        row = Node(key, "node", kids, None, None, sum(c.nbytes for c in kids), sum(c.params for c in kids),
                   sum(c.num_leaves for c in kids), layout=first.layout if first else len(first_of_layout),
                   stored_nbytes=sum(c.stored_nbytes for c in kids))
        first_of_layout.setdefault(layout, row)
        return row

    if is_node(tree):
        root = build(tree, ())
    else:
        root = leaf_row(None, (), tree) or Node(key=None, kind="node")
    root.by_dtype, root.any_stored_otherwise = _by_dtype(root)
    return root


def _by_dtype(root: Node) -> tuple[dict[str, list[int]], bool]:
    """``(arrays, params, bytes stored)`` per stored type (its dtype, or a quantization's)
    under ``root``, each layout counted once; and whether any array is stored otherwise."""
    of_layout: dict[int, dict[str, list[int]]] = {}
    otherwise = []

    def count(node: Node) -> dict[str, list[int]]:
        if node.kind == "array":
            if node.stored is not None:
                otherwise.append(node.stored)
            return {node.stored or node.dtype: [1, node.params, node.stored_nbytes]}
        if node.kind == "value":
            return {}
        found = of_layout.get(node.layout)
        if found is None:
            found = {}
            for child in node.children:
                for dtype, (arrays, params, nbytes) in count(child).items():
                    totals = found.setdefault(dtype, [0, 0, 0])
                    totals[0] += arrays
                    totals[1] += params
                    totals[2] += nbytes
            if node.layout >= 0:
                of_layout[node.layout] = found
        return found

    totals = count(root)
    return totals, bool(otherwise)


def leaves(root: Node) -> list[Node]:
    """The leaf rows under a summary node, in display order."""
    out: list[Node] = []
    stack = [root]
    while stack:
        node = stack.pop()
        if node.kind == "node":
            stack.extend(reversed(node.children))
        else:
            out.append(node)
    return out


def leaves_by_keypath(root: Node) -> list[tuple[str, Node]]:
    """``(key path as text, leaf row)`` under a summary node, in display order: each path
    is its parent's and one key, formatted once per distinct key (``text_keypath`` for
    each of 200k leaves formatted 1.2M keys)."""
    if root.kind != "node":
        return [("", root)]
    out: list[tuple[str, Node]] = []
    key_texts: dict[tuple[type, Any], str] = {}

    def walk(node: Node, prefix: str) -> None:
        for child in node.children:
            text = key_texts.get((type(child.key), child.key))
            if text is None:
                text = key_texts[(type(child.key), child.key)] = format_keypath((child.key,))
            path = prefix + text if not prefix or text[0] == "[" else f"{prefix}.{text}"
            if child.kind == "node":
                walk(child, path)
            else:
                out.append((path, child))

    walk(root, "")
    return out


def dtype_totals(root: Node) -> list[tuple[str, int, int, int]]:
    """``(dtype, number of arrays, params, bytes)`` per dtype, largest first, of the tree
    ``summarize`` returned ``root`` for."""
    return sorted(((d, *v) for d, v in root.by_dtype.items()), key=lambda row: -row[3])


def _python_scalar(value: Any) -> Any:
    """A NumPy scalar as the Python value (without importing NumPy)."""
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return value.item()
    return value


def value_type(value: Any) -> str:
    """The JSON ``type`` of a non-array leaf."""
    value = _python_scalar(value)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, dict):
        return "dict"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, _leaf.Unreadable):
        return "unread"
    return type(value).__name__


def json_value(value: Any) -> Any:
    """A non-array leaf's value for JSON: non-finite floats as ``"nan"``, ``"inf"``, ``"-inf"``."""
    value = _python_scalar(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (dict, list, tuple)):
        return {} if isinstance(value, dict) else []
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def json_array(data: Any) -> Any:
    """An array's values for JSON (nested lists), with the same spelling of NaN and Inf
    as non-array leaves: strict JSON, which ``jq`` reads."""
    import numpy as np

    kind = _dtypes.kind(data.dtype)
    if kind == "V":  # raw bytes of a dtype nobody named (an npz's V2): hex, as json_value does
        return _hex(data).tolist()
    data = _widened(data, kind, np.float64)  # bf16, fp8, int4: as Python numbers
    if kind == "c":  # [real, imag] pairs: JSON has no complex numbers
        return json_array(np.stack([data.real, data.imag], axis=-1))
    if kind != "f" or np.isfinite(data).all():
        return data.tolist()
    return np.vectorize(lambda x: json_value(float(x)), otypes=[object])(data).tolist()


PRINT_THRESHOLD, EDGE_ITEMS = 200, 3  # NumPy's own: larger arrays print their first and last 3 along each axis


def array_text(leaf: _leaf.ArrayLeaf) -> str:
    """A leaf as NumPy prints it, summarised when large, reading only the elements printed.

    A summarised axis is read as its first and last ``EDGE_ITEMS`` around one placeholder:
    NumPy prints such an axis of length ``2 * EDGE_ITEMS + 1`` exactly as the whole one,
    with ``...`` where the placeholder is.
    """
    import numpy as np

    summarise = leaf.size > PRINT_THRESHOLD
    edges = [summarise and n > 2 * EDGE_ITEMS for n in leaf.shape]
    if not any(edges):
        data = leaf.read()
    else:
        data = np.zeros([2 * EDGE_ITEMS + 1 if cut else n for n, cut in zip(leaf.shape, edges)], leaf.dtype)
        halves = [((slice(0, EDGE_ITEMS), slice(0, EDGE_ITEMS)), (slice(-EDGE_ITEMS, None), slice(-EDGE_ITEMS, None)))
                  if cut else ((slice(None), slice(None)),) for cut in edges]
        for corner in itertools.product(*halves):
            data[tuple(inside for _, inside in corner)] = leaf.read(tuple(source for source, _ in corner))
    kind = _dtypes.kind(data.dtype)
    # raw bytes of a dtype nobody named as hex; bf16, fp8, int4 exactly, as wider NumPy numbers
    data = _hex(data) if kind == "V" else _widened(data, kind, np.float32)
    with np.printoptions(threshold=0 if summarise else PRINT_THRESHOLD, edgeitems=EDGE_ITEMS, linewidth=120):
        return np.array2string(data)


def _hex(data: Any) -> Any:
    """Each element of an array of a dtype nobody named (an npz's ``V2``) as its bytes in hex."""
    import numpy as np

    return np.vectorize(lambda v: bytes(v).hex(), otypes=[object])(data)


def _widened(data: Any, kind: str, float_dtype: Any) -> Any:
    """An ml_dtypes array (bf16, fp8, int4) as a NumPy dtype that holds its values exactly:
    ``float_dtype`` for floats, int64 for integers; other arrays as they are."""
    import numpy as np

    if not _dtypes.needs_ml_dtypes(data.dtype.name):
        return data
    return data.astype(float_dtype if kind == "f" else np.int64)


def add_stats(root: Node, progress: Callable[[int], None] | None = None) -> None:
    """Stream every array leaf once and attach min / max / mean / std and counts."""
    for row in leaves(root):
        if row.kind == "array":
            row.stats = leaf_stats(_leaf.as_leaf(row.value), progress)


def leaf_stats(leaf: _leaf.ArrayLeaf, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Statistics of one leaf, chunk by chunk (float64 accumulators; Chan's merge for the variance)."""
    import numpy as np

    count = finite = nan = inf = zeros = 0
    lo, hi = math.inf, -math.inf
    mean = m2 = 0.0
    numeric = _dtypes.kind(leaf.dtype_name) in "biuf"
    for start, stop in leaf.chunk_ranges():
        chunk = leaf.read_flat(start, stop)
        if progress:
            progress(chunk.nbytes)
        count += chunk.size
        if not numeric:  # complex: only zeros are meaningful here
            zeros += int(np.count_nonzero(chunk == 0))
            continue
        values = chunk.astype(np.float64)
        is_nan = np.isnan(values)
        is_inf = np.isinf(values)
        nan += int(is_nan.sum())
        inf += int(is_inf.sum())
        zeros += int(np.count_nonzero(values == 0))
        good = values[~(is_nan | is_inf)] if (nan or inf) else values
        if good.size == 0:
            continue
        lo, hi = min(lo, float(good.min())), max(hi, float(good.max()))
        n_b = good.size
        mean_b = float(good.mean())
        m2_b = float(((good - mean_b) ** 2).sum())
        total = finite + n_b
        delta = mean_b - mean
        mean += delta * n_b / total
        m2 += m2_b + delta * delta * finite * n_b / total
        finite = total
    stats: dict[str, Any] = {"count": count, "nan": nan, "inf": inf, "zeros": zeros}
    if finite:
        stats.update(min=lo, max=hi, mean=mean, std=math.sqrt(m2 / finite))
    else:
        stats.update(min=None, max=None, mean=None, std=None)
    return stats
