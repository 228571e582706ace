"""Orbax checkpoints: a PyTree checkpoint directory, a CheckpointManager step,
or a CheckpointManager root (``--step``, default the latest committed one).

Read without Orbax and without matching the saving machine's devices: the
tree, shapes and value types come from ``_METADATA`` (JSON); dtypes from each
array's zarr metadata, opened with tensorstore (which orbax-checkpoint brings)
without reading array data. tensorstore is imported only here, when an Orbax
checkpoint is opened. Writing uses Orbax's own PyTree handler, which stores strings and Python scalars too.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from treecli import _leaf, _memory, _tree
from treecli._errors import FormatError, TreecliError, UsageError, in_cli, option
from treecli._keypath import format_keypath
from treecli.formats._base import Checkpoint, Origin, WriteOptions
from treecli._bytes.local import read_text, refuse_special

_TMP_MARK = ".orbax-checkpoint-tmp"
# The layout before _METADATA: the tree in a Flax msgpack file, arrays stored apart
# given as "PLACEHOLDER://NAME" (orbax-checkpoint still restores it).
_AGGREGATE = "checkpoint"
_PLACEHOLDER = "PLACEHOLDER://"
_MEMORY_FACTOR = 4
_ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")


class _Format:
    name = "orbax"
    holds_numbers = True  # a Python int is stored as Orbax stores it: a scalar
    extensions: tuple[str, ...] = ()
    separator = None

    def sniff(self, path: Path) -> str | None:
        if not path.is_dir():
            return "not a directory"
        if any((path / name).is_file() for name in ("_METADATA", "_CHECKPOINT_METADATA", _AGGREGATE)) \
                or _steps(path)[0]:
            return None
        return "no _METADATA, _CHECKPOINT_METADATA or step directories"

    def open(self, path: Path, step: int | None = None, **_: Any) -> Checkpoint:
        path = Path(path)
        _refuse_escaping_symlinks(path)
        steps, pending = _steps(path)
        if steps:
            return _open_manager_root(path, steps, pending, step)
        if step is not None:
            raise UsageError(f"{option('step', step)} applies to a CheckpointManager root; this is a single checkpoint",
                             file=str(path))
        if _TMP_MARK in path.name:
            raise FormatError("incomplete checkpoint: an unfinished Orbax temporary directory", file=str(path))
        if not _committed(path):
            raise FormatError("incomplete checkpoint: no commit_success.txt and no commit time in "
                              "_CHECKPOINT_METADATA (the save did not finish)", file=str(path))
        if (path / "_METADATA").is_file() or (path / _AGGREGATE).is_file():
            checkpoint = Checkpoint(tree=None, format="orbax", file=str(path), origin=Origin("directory", path, [path]))
            checkpoint.tree = _open_pytree(path, checkpoint)
            return checkpoint
        return _open_step(path)

    def owns(self, name: str) -> bool:
        """Whether a directory entry is one Orbax's writer writes."""
        return _OWNED.fullmatch(name) is not None

    def write(self, tree: Any, target: Path, options: WriteOptions) -> None:
        _write(tree, target, options)


FORMAT = _Format()


# --- layout ---------------------------------------------------------------------------------


# A step directory as CheckpointManager names it: the number, zero-padded with
# step_format_fixed_length ("00000100"), after a step_prefix ("checkpoint_100", PaxML).
_STEP_NAME = re.compile(r"(?:.+_)?([0-9]+)")


def _steps(root: Path) -> tuple[dict[int, str], list[str]]:
    """Committed steps under a CheckpointManager root (step -> directory name), and the
    names of the unfinished ones."""
    steps: dict[int, str] = {}
    pending = []
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return {}, []
    for entry in entries:
        if not entry.is_dir():
            continue
        match = _STEP_NAME.fullmatch(entry.name)
        if _TMP_MARK in entry.name:
            pending.append(entry.name)
        elif match and (entry / "_CHECKPOINT_METADATA").is_file():
            if _committed(entry):
                steps.setdefault(int(match.group(1)), entry.name)
            else:
                pending.append(entry.name)
    return dict(sorted(steps.items())), pending


def _committed(directory: Path) -> bool:
    """Orbax marks a finished save with commit_success.txt, or a commit time in _CHECKPOINT_METADATA."""
    if (directory / "commit_success.txt").is_file():
        return True
    try:
        metadata = json.loads(read_text(directory / "_CHECKPOINT_METADATA"))
    except (OSError, ValueError):
        return False
    return isinstance(metadata, dict) and bool(metadata.get("commit_timestamp_nsecs"))


def _open_manager_root(root: Path, steps: dict[int, str], pending: list[str], step: int | None) -> Checkpoint:
    chosen = max(steps) if step is None else step
    if chosen not in steps:
        raise UsageError(f"no committed step {chosen}; steps: {', '.join(map(str, steps))}", file=str(root))
    checkpoint = _open_step(root / steps[chosen])
    checkpoint.file = str(root)
    checkpoint.origin = Origin("step", root, [root])
    checkpoint.info = {"steps": list(steps), "step": chosen, **checkpoint.info}
    if pending:
        checkpoint.warnings.append(f"ignoring unfinished step directories: {', '.join(pending)}")
    return checkpoint


def _open_step(step_dir: Path) -> Checkpoint:
    """A CheckpointManager step: each item (a PyTree or a JSON file) is a top-level subtree."""
    if not (step_dir / "_CHECKPOINT_METADATA").is_file():
        raise FormatError("not an Orbax checkpoint: no _METADATA or _CHECKPOINT_METADATA", file=str(step_dir))
    handlers = _read_json(step_dir / "_CHECKPOINT_METADATA")
    if isinstance(handlers, dict) and isinstance(handlers.get("item_handlers"), str):
        # A single-item checkpoint (StandardCheckpointer): its tree lives in _METADATA.
        raise FormatError("_METADATA is missing (corrupt or incomplete checkpoint)", file=str(step_dir))
    checkpoint = Checkpoint(tree={}, format="orbax", file=str(step_dir), origin=Origin("step", step_dir, [step_dir]))
    for item in sorted(p for p in step_dir.iterdir() if p.is_dir()):
        if (item / "_METADATA").is_file() or (item / _AGGREGATE).is_file():
            checkpoint.tree[item.name] = _open_pytree(item, checkpoint)
        elif (item / "metadata").is_file():  # JsonSave writes ITEM/metadata
            checkpoint.tree[item.name] = _read_json(item / "metadata")
    if not checkpoint.tree:
        raise FormatError("no readable items (each needs _METADATA or a JSON metadata file)", file=str(step_dir))
    checkpoint.info["items"] = sorted(checkpoint.tree)
    return checkpoint


def _read_json(path: Path) -> Any:
    try:
        return json.loads(read_text(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise FormatError(f"cannot read it as JSON: {e}", file=str(path)) from None


def _refuse_escaping_symlinks(root: Path) -> None:
    """A symlink whose target lies outside the checkpoint could leak host files into outputs;
    a FIFO or a device among its files would hang tensorstore or never end."""
    real_root = os.path.realpath(root)
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            entry = os.path.join(directory, name)
            if os.path.islink(entry):
                target = os.path.realpath(entry)
                if os.path.commonpath([real_root, target]) != real_root:
                    raise FormatError(f"symlink {os.path.relpath(entry, root)} leaves the checkpoint directory "
                                      f"(-> {target}); refusing to read it", file=str(root))
            if name in files:
                try:
                    refuse_special(entry, os.stat(entry).st_mode)
                except FileNotFoundError:  # a dangling link: the read that needs it says so
                    continue


# --- the tree -------------------------------------------------------------------------------


def _open_pytree(directory: Path, checkpoint: Checkpoint) -> Any:
    if not (directory / "_METADATA").is_file():
        return _open_aggregate(directory)
    metadata = _read_json(directory / "_METADATA")
    tree_metadata = metadata.get("tree_metadata") if isinstance(metadata, dict) else None
    if not isinstance(tree_metadata, dict):
        raise FormatError("_METADATA has no tree_metadata object (missing or corrupt)", file=str(directory))
    strings_path = directory / "_strings.json"
    strings = _read_json(strings_path) if strings_path.is_file() else {}
    entries = []
    for raw, entry in tree_metadata.items():
        try:
            keypath = tuple(int(k["key"]) if k["key_type"] == 1 else str(k["key"]) for k in entry["key_metadata"])
            value = entry["value_metadata"]
            value_type = value["value_type"]
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"_METADATA entry {raw!r} is malformed", file=str(directory)) from None
        if len(keypath) > _tree.MAX_DEPTH:
            raise FormatError(f"a key path of {len(keypath)} keys is deeper than treecli walks "
                              f"({_tree.MAX_DEPTH})", file=str(directory))
        entries.append((keypath, value_type, value.get("write_shape")))
    arrays = [(kp, shape) for kp, kind, shape in entries if kind in _ARRAY_TYPES]
    stores = _open_arrays(directory, {kp: _param_name(kp) for kp, _ in arrays},
                          use_ocdbt=metadata.get("use_ocdbt", True), use_zarr3=bool(metadata.get("use_zarr3")))
    items = []
    for keypath, kind, write_shape in entries:
        name = _param_name(keypath)
        if kind in _ARRAY_TYPES:
            store = stores[keypath]
            if write_shape is not None and list(store.shape) != list(write_shape):
                raise FormatError(f"stored data has shape {list(store.shape)} but _METADATA says {write_shape}",
                                  file=str(directory), keypath=name)
            leaf = OrbaxLeaf(store, str(directory), name)
            items.append((keypath, leaf.read().item() if kind == "scalar" else leaf))
        elif kind == "string":
            items.append((keypath, strings.get(name)))
        elif kind == "None":
            items.append((keypath, None))
        elif kind in ("Dict", "List"):
            items.append((keypath, {} if kind == "Dict" else []))
        else:
            checkpoint.warnings.append(f"{name}: value type {kind!r} is not understood; shown as None")
            items.append((keypath, None))
    return _build(items)


def _param_name(keypath: tuple) -> str:
    """The name Orbax stores a leaf under: its keys joined with ``.``."""
    return ".".join(str(k) for k in keypath)


def _build(items: list[tuple[tuple, Any]]) -> Any:
    """Nested dicts and lists from ``(keypath, leaf)``: int keys (Orbax's sequence keys) make lists."""
    if not items:
        return {}

    def lists(node: Any) -> Any:
        if not isinstance(node, dict) or not node:
            return node
        node = {k: lists(v) for k, v in node.items()}
        if all(isinstance(k, int) for k in node) and sorted(node) == list(range(len(node))):
            return [node[i] for i in range(len(node))]
        return node

    return lists(_tree.unflatten(items))


def _open_aggregate(directory: Path) -> Any:
    """The layout before ``_METADATA``: the tree from the msgpack aggregate file, each
    placeholder replaced by its array (stored with or without OCDBT, zarr or zarr3)."""
    from treecli.formats import msgpack as msgpack_format

    with msgpack_format.FORMAT.open(directory / _AGGREGATE) as aggregate:
        items = _tree.flatten(aggregate.tree)
    names = {kp: x[len(_PLACEHOLDER):] for kp, x in items if isinstance(x, str) and x.startswith(_PLACEHOLDER)}
    use_ocdbt = (directory / "manifest.ocdbt").is_file()
    use_zarr3 = any((directory / name / "zarr.json").is_file() for name in names.values())
    stores = _open_arrays(directory, names, use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)
    return _tree.unflatten([(kp, OrbaxLeaf(stores[kp], str(directory), names[kp]) if kp in names else x)
                            for kp, x in items], template=aggregate.tree)


def _open_arrays(directory: Path, names: dict[tuple, str], *, use_ocdbt: bool, use_zarr3: bool) -> dict[tuple, Any]:
    """Open every array's tensorstore (metadata only), all at once; ``names`` maps each
    key path to the name its array is stored under."""
    import tensorstore as ts

    driver = "zarr3" if use_zarr3 else "zarr"
    base = f"file://{os.path.abspath(directory)}"
    futures = {}
    for keypath, name in names.items():
        if use_ocdbt:
            kvstore = {"driver": "ocdbt", "base": base, "path": name}
        else:
            kvstore = {"driver": "file", "path": _inside(directory, name, keypath) + "/"}
        futures[keypath] = ts.open({"driver": driver, "kvstore": kvstore}, open=True, read=True)
    stores = {}
    for keypath, future in futures.items():
        try:
            stores[keypath] = future.result()
        except Exception as e:  # tensorstore raises ValueError and friends with long messages
            message = str(e).splitlines()[0][:200]
            raise FormatError(f"array data is missing or unreadable: {message}", file=str(directory),
                              keypath=names[keypath]) from None
    return stores


def _inside(directory: Path, name: str, keypath: tuple) -> str:
    """The array directory a name in ``_METADATA`` stands for, which must lie inside the
    checkpoint: an absolute name or ``..`` would read a host file into an output."""
    root = os.path.realpath(directory)
    path = os.path.realpath(os.path.join(root, name))
    if not path.startswith(root + os.sep):
        raise FormatError(f"_METADATA names array {name!r}, which lies outside the checkpoint directory; refusing "
                          "to read it", file=str(directory), keypath=format_keypath(keypath))
    return path


class OrbaxLeaf(_leaf.WholeLeaf):
    """An array in an Orbax checkpoint. Orbax stores each array compressed (one
    zstd chunk in 0.12), so it is read whole: one leaf in memory at a time."""

    def __init__(self, store: Any, file: str, name: str):
        self._store = store
        self._file = file
        self._name = name
        self.shape = tuple(int(d) for d in store.shape)
        self.dtype_name = store.dtype.numpy_dtype.name

    def load(self):
        # Checked first: a 2 KB checkpoint may declare 2**37 elements of fill value, and
        # tensorstore allocating them aborts the whole process (std::bad_alloc).
        available = _memory.available()
        if available is not None and 2 * self.nbytes > available:
            raise FormatError(f"the array is {self.nbytes / 2**30:.1f} GiB, read whole from Orbax, but "
                              f"{available / 2**30:.1f} GiB of memory is available", file=self._file,
                              keypath=self._name)
        try:
            return self._store.read().result().reshape(-1)
        except Exception as e:  # tensorstore raises ValueError and friends with long messages
            raise FormatError(f"cannot read the array data: {str(e).splitlines()[0][:200]}", file=self._file,
                              keypath=self._name) from None


# --- writing --------------------------------------------------------------------------------


# What Orbax's PyTree handler stores besides arrays, as Orbax stores them.
_PLAIN_VALUES = (str, int, float, bool, type(None))
# Every entry Orbax's writers put in a checkpoint directory: `-o DIR --force` and
# --in-place may replace a directory only when it holds nothing else.
_OWNED = re.compile(r"_CHECKPOINT_METADATA|_METADATA|_ROOT_METADATA|_strings\.json|_sharding|commit_success\.txt"
                    r"|manifest\.ocdbt|d|ocdbt\.process_\d+|array_metadatas|descriptor")


def _write(tree: Any, target: Path, options: WriteOptions) -> None:
    """Save with Orbax's PyTree handler, which needs the whole tree in memory."""
    import numpy as np

    tree = _storable(tree, str(target), options)
    needed = sum(_leaf.as_leaf(x).nbytes for _, x in _tree.flatten(tree) if _leaf.is_array(x))
    available = _memory.available()
    # Measured: writing 0.5 GiB peaked at 1.7 GB (our arrays, Orbax's and tensorstore's buffers, jax).
    if available is not None and needed * _MEMORY_FACTOR > available:
        raise TreecliError(f"Orbax's writer needs the whole output in memory, about {_MEMORY_FACTOR}x its "
                           f"{needed / 2**30:.1f} GiB, but {available / 2**30:.1f} GiB is available; "
                           "write safetensors instead (-o out.safetensors)")

    def materialize(keypath: tuple, x: Any) -> Any:
        if _leaf.is_array(x):
            leaf = _leaf.as_leaf(x)
            array = leaf.read()
            if options.progress:
                options.progress(leaf.nbytes)
            return np.asarray(array)
        return x

    import orbax.checkpoint as ocp

    data = _tree.map_leaves(materialize, tree)
    # target is the empty directory the atomic writer made inside its locked holder;
    # Orbax replaces it (force), keeping its own temporaries in the holder too.
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(target), data, force=True)


def _storable(tree: Any, file: str, options: WriteOptions) -> Any:
    """The tree Orbax will be given: every leaf one it can store under a name of its own.

    Orbax names each array by its key path joined with ``.``: two key paths that
    join alike (``["a.b"]`` and ``a.b``) would share one parameter, so that is an
    error. Zero-size arrays and values Orbax cannot store are refused, or dropped
    with ``drop_unsupported``.
    """
    items = _tree.flatten(tree)
    seen: dict[str, tuple] = {}
    for keypath, _ in items:
        name = _param_name(keypath)
        if name in seen:
            raise TreecliError(f"key paths {format_keypath(seen[name])} and {format_keypath(keypath)} would both "
                               f"be stored as the Orbax parameter {name!r}; rename one first"
                               + in_cli(" (treecli edit --rename)"), file=file)
        seen[name] = keypath
    unsupported = []
    for keypath, x in items:
        if _leaf.is_array(x):
            if _leaf.as_leaf(x).size == 0:
                unsupported.append((keypath, f"{_tree.describe_leaf(x)}: zero-size"))
        elif not isinstance(x, (*_PLAIN_VALUES, dict, list, tuple)):  # empty containers are leaves here
            unsupported.append((keypath, type(x).__name__))
    if not unsupported:
        return tree
    listed = [f"{format_keypath(kp)} ({what})" for kp, what in unsupported]
    if not options.drop_unsupported:
        raise TreecliError(f"Orbax cannot hold {len(listed)} {'leaf' if len(listed) == 1 else 'leaves'} (use "
                           f"{option('drop_unsupported')} to drop them)", file=file, details=listed)
    if options.warn:
        options.warn(f"dropped {len(listed)} leaves Orbax cannot hold: {', '.join(listed[:20])}")
    dropped = {kp for kp, _ in unsupported}
    return _tree.unflatten([(kp, x) for kp, x in items if kp not in dropped], template=tree)
