"""Any JAX pytree at the library's boundary.

treecli's operations and formats work on *native* trees: ``dict`` / ``list`` /
``tuple`` nodes, the trees checkpoints open as. Any other pytree — an
``eqx.Module``, a flax struct or ``TrainState``, ``nnx.State``, optax's
namedtuples, a node the user registered — is flattened through JAX's own
registry with key paths into a native tree of its *data* leaves, and its own
type is rebuilt from a result with the same key paths.

- Key entries become treecli keys: ``GetAttrKey('mu')`` -> ``"mu"``,
  ``SequenceKey(0)`` -> ``0``, ``DictKey('a')`` -> ``"a"``; so ``opt_state.0.mu``
  names the same leaf in memory and in an Orbax checkpoint.
- Data leaves are arrays (NumPy, JAX, lazy, ``ShapeDtypeStruct`` in templates)
  and Python numbers, as in Equinox's ``is_array_like``. Other leaves — an
  activation function, a string field, ``None`` — are structure, like static
  fields: kept from the original, never stored.
- Typed PRNG keys (``key<fry>``, NNX's ``Rngs``) become their key data, a
  uint32 array (:class:`KeyData`, which remembers the implementation): stored,
  averaged (copied, as integers are) and compared as such, and turned back into
  keys wherever the template or the input had keys.
- A native tree passes through untouched, and jax is imported only when a
  tree that needs it appears (the CLI's flat formats never do).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from treecli import _devices, _dtypes, _leaf, _tree
from treecli._errors import KeyPathError, StructureError, UsageError
from treecli._keypath import KeyPath, format_keypath, plain_key

_NUMBERS = (bool, int, float, complex)


def _is_native_leaf(value: Any) -> bool:
    if value is None or isinstance(value, (str, bytes, _leaf.ArrayLeaf) + _NUMBERS):
        return True
    if type(value).__module__ == "numpy":  # ndarray and NumPy scalars, without importing NumPy
        return True
    jax = sys.modules.get("jax")  # a JAX array exists only once jax is imported
    return jax is not None and isinstance(value, jax.Array)


def is_native(tree: Any) -> bool:
    """Whether a tree is made of dict / list / plain tuple nodes and plain leaves only."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):  # a namedtuple has names
            stack.extend(node)
        elif not _is_native_leaf(node):
            return False
    return True


def is_data(leaf: Any) -> bool:
    """An array-like leaf: what checkpoints store (Equinox's ``is_array_like``, plus templates' shapes)."""
    if isinstance(leaf, _NUMBERS) or _leaf.is_array(leaf):
        return True
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(leaf, jax.ShapeDtypeStruct)


def is_key(value: Any) -> bool:
    """A typed PRNG key array, or a template's ``ShapeDtypeStruct`` of one."""
    jax = sys.modules.get("jax")
    if jax is None or not isinstance(value, (jax.Array, jax.ShapeDtypeStruct)):
        return False
    return jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)


class KeyData(_leaf.InMemoryLeaf):
    """A typed PRNG key array as what checkpoints hold: its key data (uint32, the key
    shape last), with the name of its implementation (``threefry2x32``, ``rbg``)."""

    def __init__(self, keys: Any):
        import jax

        super().__init__(jax.random.key_data(keys))
        self.key_impl = str(jax.random.key_impl(keys))


def _key_impl(template: Any) -> Any:
    """The PRNG implementation of a key array or of a template's ``ShapeDtypeStruct``
    (its key dtype's; JAX offers no public way from a ``ShapeDtypeStruct``)."""
    return template.dtype._impl


def keys_as_data(tree: Any) -> Any:
    """A native tree with each typed key array as its :class:`KeyData`."""
    if sys.modules.get("jax") is None:
        return tree
    return _tree.map_leaves(lambda _, leaf: KeyData(leaf) if is_key(leaf) else leaf, tree)


@dataclass
class Structure:
    """How a pytree was flattened: enough to rebuild its own type around new data leaves."""

    treedef: Any  # jax's PyTreeDef
    leaves: list[Any]  # every leaf of the original, JAX order: data and structure alike
    data: list[tuple[KeyPath, int]]  # each data leaf's treecli key path and its index in ``leaves``
    native: Any  # the native tree of the original's data leaves

    @property
    def order(self) -> list[KeyPath]:
        """The data leaves' key paths in JAX's flatten order (the order ``.eqx`` records follow)."""
        return [keypath for keypath, _ in self.data]

    def rebuild(self, result: Any) -> Any:
        """``result`` (a native tree) inside the original's own types, if it has the
        same key paths; otherwise (an edit renamed or deleted leaves) ``result`` itself."""
        found = dict(_tree.flatten(result)) if self.data else {}
        if found.keys() != {keypath for keypath, _ in self.data}:
            return result
        leaves = list(self.leaves)
        for keypath, index in self.data:
            leaves[index] = found[keypath]
        return self.treedef.unflatten(leaves)


def structure(tree: Any) -> Structure:
    """Flatten any pytree through JAX's registry into a :class:`Structure`."""
    import jax

    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [leaf for _, leaf in pairs]
    data = [(tuple(plain_key(k) for k in path), i) for i, (path, leaf) in enumerate(pairs) if is_data(leaf)]
    # A node whose children all sit at sequence positions is a list (Orbax stores it as one).
    lists = {tuple(plain_key(k) for k in path[:depth - 1]) for path, _ in pairs for depth in range(1, len(path) + 1)
             if isinstance(path[depth - 1], jax.tree_util.SequenceKey)}
    native = _tree.unflatten([(keypath, leaves[i]) for keypath, i in data], lists=lists)
    return Structure(treedef, leaves, data, native)


def to_native(tree: Any) -> tuple[Any, Structure | None]:
    """The native tree of any pytree, and how to rebuild its type (``None``: it was native)."""
    if is_native(tree):
        return keys_as_data(tree), None
    found = structure(tree)
    return keys_as_data(found.native), found


# --- results: in memory in, in memory out ------------------------------------------------------------


def is_lazy(tree: Any) -> bool:
    """Whether a native tree holds leaves read from a file or computed on demand."""
    return any(isinstance(leaf, _leaf.ArrayLeaf) and not isinstance(leaf, _leaf.InMemoryLeaf)
               for _, leaf in _tree.flatten(tree))


def in_memory(result: Any, like: Any) -> Any:
    """``result`` (native) with each computed leaf read into an array of the kind ``like``
    holds at the same key path (a JAX array stays a JAX array); NumPy where ``like`` has none."""
    kinds = {format_keypath(kp): leaf for kp, leaf in _tree.flatten(like)}

    def read(keypath: KeyPath, leaf: Any) -> Any:
        if not isinstance(leaf, _leaf.ArrayLeaf):
            return leaf
        return convert(leaf, kinds.get(format_keypath(keypath)))

    return _tree.map_leaves(read, result)


def on_device(like: Any) -> bool:
    """Whether a template leaf asks for a JAX array (a typed key array is rebuilt from its data)."""
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(like, (jax.Array, jax.ShapeDtypeStruct)) and not is_key(like)


def convert(leaf: Any, like: Any) -> Any:
    """An array leaf as the same kind of value as ``like``; for a JAX template, a JAX
    array of its sharding, read shard by shard (``_devices.place``)."""
    import numpy as np

    if on_device(like) and _leaf.is_array(leaf):
        return _devices.place([(_leaf.as_leaf(leaf), _devices.target(like))])[0]
    jax = sys.modules.get("jax")
    data = np.asarray(leaf)
    if isinstance(like, _NUMBERS):
        return type(like)(data.item())
    if type(like).__module__ == "numpy" and not isinstance(like, np.ndarray):  # a NumPy scalar
        return data[()]
    if isinstance(like, KeyData) or is_key(like):
        return jax.random.wrap_key_data(data, impl=like.key_impl if isinstance(like, KeyData) else _key_impl(like))
    if jax is not None and isinstance(like, (jax.Array, jax.ShapeDtypeStruct)):  # a Python number's
        return jax.numpy.asarray(data)
    return data


def numbers_as_arrays(tree: Any) -> Any:
    """A native tree with each Python number as the 0-d NumPy array Equinox would save."""

    def as_array(_: KeyPath, value: Any) -> Any:
        if not isinstance(value, _NUMBERS) or isinstance(value, int) and not -2**63 <= value < 2**63:
            return value  # (an int no int64 holds stays a number, which the format refuses by name)
        import numpy as np

        return np.asarray(value)

    return _tree.map_leaves(as_array, tree)


# --- templates: load(path, like=...) and --like MODULE:ATTR -----------------------------------------


def fill(template: Structure, tree: Any, *, file: str, lazy: bool, settings: Any = None) -> Any:
    """The template's own type with its data leaves taken from ``tree`` by key path.

    Raises:
        StructureError: key paths only in one of them, or a different shape or
            dtype, listed diff-style.
    """
    found = {format_keypath(kp): leaf for kp, leaf in _tree.flatten(tree) if is_data(leaf)}
    wanted = {format_keypath(kp): template.leaves[i] for kp, i in template.data}
    name = os.path.basename(file.rstrip("/")) or file
    lines = []
    for text in sorted(wanted.keys() | found.keys()):
        if text not in found:
            lines.append(f"{text or '<root>'}: only in the template")
        elif text not in wanted:
            lines.append(f"{text or '<root>'}: only in {name}")
        else:
            expected, got = describe(wanted[text]), _tree.describe_leaf(found[text])
            if not fits(wanted[text], found[text]):
                lines.append(f"{text or '<root>'}: {expected} in the template; {got} in {name}")
    if lines:
        first = "; ".join(lines[:3]) + ("; ..." if len(lines) > 3 else "")
        raise StructureError(f"does not fit the template: {len(lines)} "
                             f"{'difference' if len(lines) == 1 else 'differences'} ({first})", file=file,
                             details=lines)
    leaves = list(template.leaves)
    to_devices = []  # (key path, leaf, sharding, index): read together, on several threads
    for keypath, index in template.data:
        leaf = found[format_keypath(keypath)]
        expected = template.leaves[index]
        if lazy and not isinstance(leaf, _NUMBERS) and not is_key(expected):
            leaves[index] = leaf
        elif (on_device(expected) or is_key(expected)) and _leaf.is_array(leaf):
            # (a key array's data takes the keys' sharding: its own axis, the key's words, last and whole)
            leaf, sharding = _leaf.as_leaf(leaf), _devices.target(expected)
            _check_fits(sharding, leaf, file, format_keypath(keypath))
            to_devices.append((format_keypath(keypath), leaf, sharding, index))
        else:
            leaves[index] = convert(leaf, expected)
    placed = _devices.place([(leaf, sharding) for _, leaf, sharding, _ in to_devices], [t[0] for t in to_devices],
                            settings or _devices.Settings())
    for (_, _, _, index), array in zip(to_devices, placed):
        expected = template.leaves[index]
        leaves[index] = _wrap_key_data(array, expected) if is_key(expected) else array
    return template.treedef.unflatten(leaves)


def _wrap_key_data(data: Any, like: Any) -> Any:
    """Key data placed on devices, as the typed key array ``like`` is (sharding kept)."""
    import jax

    return jax.random.wrap_key_data(data, impl=_key_impl(like))


def _check_fits(sharding: Any, leaf: _leaf.ArrayLeaf, file: str, keypath: str) -> None:
    """Refuse, naming the leaf, a sharding that does not divide its shape (before a byte is read).

    Raises:
        UsageError: JAX's reason, in treecli's one line.
    """
    if sharding is None:
        return
    try:
        sharding.shard_shape(tuple(leaf.shape))
    except Exception as e:  # IndivisibleError, or a spec of more axes than the leaf has
        reason = str(e).splitlines()[0][:300] if str(e) else "the leaf has fewer axes than its spec"
        raise UsageError(f"the sharding does not fit this leaf of shape {list(leaf.shape)}: "
                         f"{type(e).__name__}: {reason}", file=file, keypath=keypath) from None


def onto_devices(tree: Any, sharding: Any, *, file: str, settings: Any = None) -> Any:
    """A native tree with each array leaf read into a JAX array of ``sharding`` (one for
    every leaf, or a function of the key path's text giving one; ``None``: the default
    device); other leaves as they are.

    Raises:
        UsageError: a sharding that does not fit a leaf's shape (naming the key path).
    """
    chosen = []  # (keypath, leaf, sharding)
    for keypath, leaf in _tree.flatten(tree):
        if not _leaf.is_array(leaf):
            continue
        leaf = _leaf.as_leaf(leaf)
        text = format_keypath(keypath)
        target = sharding(text) if callable(sharding) else sharding
        _check_fits(target, leaf, file, text)
        chosen.append((keypath, leaf, target))
    placed = dict(zip((keypath for keypath, _, _ in chosen),
                      _devices.place([(l, t) for _, l, t in chosen], [format_keypath(kp) for kp, _, _ in chosen],
                                     settings or _devices.Settings())))
    return _tree.map_leaves(lambda keypath, leaf: placed.get(keypath, leaf), tree)


def describe(leaf: Any) -> str:
    """A template leaf as ``[2, 3] float32``; a Python number as its type."""
    if isinstance(leaf, _NUMBERS):
        return f"[] {type(leaf).__name__}"
    if is_key(leaf):  # stored as its key data
        return describe(_key_data_shape(leaf))
    return f"[{', '.join(str(int(d)) for d in leaf.shape)}] {_dtypes.name(leaf.dtype)}"


def fits(expected: Any, leaf: Any) -> bool:
    """Whether a stored leaf can fill a template leaf: same shape and dtype; a Python
    number takes any 0-d number (Equinox stores ``3`` as int64, ``True`` as bool)."""
    if isinstance(leaf, _NUMBERS):  # Orbax and msgpack store Python numbers as they are
        return isinstance(expected, _NUMBERS)
    leaf = _leaf.as_leaf(leaf)
    if isinstance(expected, _NUMBERS):
        return leaf.shape == ()
    if is_key(expected):
        expected = _key_data_shape(expected)
    return tuple(leaf.shape) == tuple(int(d) for d in expected.shape) and leaf.dtype_name == _dtypes.name(
        expected.dtype)


def _key_data_shape(keys: Any) -> Any:
    """The ``ShapeDtypeStruct`` of a key array's key data: its shape, then the key's own."""
    import jax

    return jax.ShapeDtypeStruct(tuple(keys.shape) + tuple(_key_impl(keys).key_shape), "uint32")


def import_template(spec: str) -> Any:
    """The template a ``--like MODULE:ATTR`` names: the object, or what the callable
    returns, built under ``jax.eval_shape`` so that no array is allocated.

    This imports and runs the user's own code (never anything from a checkpoint).

    Raises:
        UsageError: not ``MODULE:ATTR``, a module that cannot be imported, no such
            attribute, or a callable that fails.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"--like {spec!r}: write MODULE:ATTR, e.g. mypkg.models:make_model")
    if "" not in sys.path and os.getcwd() not in sys.path:  # like `python -m`: the working directory's modules
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module failed: say so in one line, --debug has the traceback
        raise UsageError(f"--like {spec!r}: cannot import {module_name}: {type(e).__name__}: {e}") from e
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise UsageError(f"--like {spec!r}: {module_name} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not _is_factory(target):
        return target
    try:
        return shapes_of(target)
    except Exception as e:
        raise UsageError(f"--like {spec!r}: calling it failed: {type(e).__name__}: {e}") from e


def _is_factory(value: Any) -> bool:
    """A function, class or partial is called for the template; an object (a model, which
    may well be callable itself) is the template."""
    import functools

    return inspect.isroutine(value) or inspect.isclass(value) or isinstance(value, functools.partial)


def shapes_of(factory: Callable[[], Any]) -> Any:
    """``factory()`` with every array replaced by its ``ShapeDtypeStruct``, allocating
    nothing (``eqx.filter_eval_shape``, without needing Equinox): non-array leaves
    (activation functions, Python numbers) come back as they are."""
    import jax

    kept: dict[str, Any] = {}

    def arrays_only() -> list:
        leaves, kept["treedef"] = jax.tree_util.tree_flatten(factory())
        kept["others"] = [None if _is_array(leaf) else leaf for leaf in leaves]
        return [leaf if _is_array(leaf) else None for leaf in leaves]

    shapes = jax.eval_shape(arrays_only)
    return kept["treedef"].unflatten([o if s is None else s for s, o in zip(shapes, kept["others"])])


def _is_array(leaf: Any) -> bool:
    import jax
    import numpy as np

    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


# --- at(): replacing any node of any pytree -------------------------------------------------------------


def _children(node: Any) -> tuple[list[tuple[Any, Any]], Any] | None:
    """One level of a node through JAX's registry: ``[(key entry, child)]`` and its
    treedef, or ``None`` for a leaf (an array, a function, ``None``, an empty node)."""
    import jax

    pairs, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if not pairs or pairs[0][0] == ():
        return None
    return [(path[0], child) for path, child in pairs], treedef


def iter_nodes(tree: Any) -> Iterator[tuple[KeyPath, tuple, Any]]:
    """Every node, inner and leaf: its treecli key path, its JAX key path, the node."""
    stack: list[tuple[KeyPath, tuple, Any]] = [((), (), tree)]
    while stack:
        keypath, jax_path, node = stack.pop()
        yield keypath, jax_path, node
        split = _children(node)
        if split is not None:
            stack.extend((keypath + (plain_key(entry),), jax_path + (entry,), child)
                         for entry, child in reversed(split[0]))


def find_one(tree: Any, text: str) -> tuple[KeyPath, tuple, Any]:
    """The one node a key path names (treecli's or JAX's ``keystr`` spelling).

    Raises:
        KeyPathError: it names no node (the closest named) or several.
    """
    from treecli import _keypath

    pattern = _keypath.parse(text)
    nodes = list(iter_nodes(tree))
    found = [n for n in nodes if _keypath.matches(pattern, n[0])]
    if len(found) == 1:
        return found[0]
    if found:
        raise KeyPathError(f"names {len(found)} nodes; give one key path", keypath=text)
    near = _keypath.closest(text, [format_keypath(kp) for kp, _, _ in nodes if kp])
    raise KeyPathError("matches nothing" + (f"; closest: {', '.join(near)}" if near else ""), keypath=text)


def replace(node: Any, jax_path: tuple, value: Any) -> Any:
    """``node`` with the node at ``jax_path`` replaced, rebuilt through its own
    treedef: unflattening never calls a module's ``__init__``."""
    if not jax_path:
        return value
    children, treedef = _children(node)
    rebuilt = [replace(child, jax_path[1:], value) if entry == jax_path[0] else child for entry, child in children]
    return treedef.unflatten(rebuilt)
