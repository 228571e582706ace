"""Orbax checkpoints: a PyTree checkpoint directory, a CheckpointManager step,
or a CheckpointManager root (``--step``, default the latest committed one).

Read without Orbax and without matching the saving machine's devices: the
tree, shapes and value types come from ``_METADATA`` (JSON); dtypes from each
array's zarr metadata, opened with tensorstore (which orbax-checkpoint brings)
without reading array data. tensorstore is imported only here, when an Orbax
checkpoint is opened. The directory is a ``Folder``: local, a bucket prefix or an
HTTP directory, its arrays read through the matching kvstore driver.

Writing uses Orbax's own PyTree handler, which stores strings and Python scalars
too; a bucket output is written here, then uploaded with its commit markers last.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from treecli import _leaf, _memory, _tree
from treecli._devices import READERS
from treecli._errors import FormatError, TreecliError, UsageError, option
from treecli._keypath import format_keypath
from treecli._bytes.local import refuse_special
from treecli.formats._base import Checkpoint, Format, Origin, WriteOptions
from treecli.formats._folder import Folder, LocalFolder
from treecli.formats._orbax_layout import OWNED, param_name

_TMP_MARK = ".orbax-checkpoint-tmp"
# The layout before _METADATA: the tree in a Flax msgpack file, arrays stored apart
# given as "PLACEHOLDER://NAME" (orbax-checkpoint still restores it).
_AGGREGATE = "checkpoint"
_PLACEHOLDER = "PLACEHOLDER://"
_ARRAY_TYPES = ("jax.Array", "np.ndarray", "scalar")
METADATA_CACHE_BYTES = 16 << 20  # OCDBT manifests and B-tree nodes, shared by a checkpoint's arrays


class OrbaxFormat(Format):
    """Orbax checkpoints: a PyTree checkpoint directory, a CheckpointManager root or step."""

    name = "orbax"
    holds_numbers = True  # a Python int is stored as Orbax stores it: a scalar
    compresses = True  # its arrays take less room on disk than in memory (zstd)
    writable = True
    keeps_records = True
    writes_directories = True
    writes_to_buckets = True

    def sniff(self, path: Path) -> str | None:
        return self.in_folder(LocalFolder(path)) if path.is_dir() else "not a directory"

    def open(self, path: Path, *, like: Any = None, step: int | None = None) -> Checkpoint:
        return self.open_folder(LocalFolder(Path(path)), step=step)

    def in_folder(self, folder: Folder) -> str | None:
        if is_checkpoint(folder):
            return None
        return "no _METADATA, _CHECKPOINT_METADATA or step directories"

    def open_folder(self, folder: Folder, *, step: int | None = None, entry: str | None = None) -> Checkpoint:
        if entry is not None:
            raise UsageError("an Orbax checkpoint is a directory; name the directory, not a file in it",
                             file=folder.named(entry))
        if folder.local_path is not None:
            _refuse_escaping_symlinks(folder.local_path)
        return open_folder(folder, step)

    def owns(self, name: str) -> bool:
        """Whether a directory entry is one Orbax's writer writes."""
        return OWNED.fullmatch(name) is not None

    def write(self, tree: Any, target: Path, options: WriteOptions) -> None:
        from treecli.formats import _orbax_write

        _orbax_write.write(tree, target, options)

    def write_remote(self, tree: Any, url: str, options: WriteOptions, replace: bool) -> None:
        from treecli.formats import _orbax_write

        _orbax_write.write_remote(tree, url, options, replace)

    writes_global_arrays = True

    def write_global(self, tree: Any, target: Path, options: WriteOptions, replace: bool) -> None:
        from treecli.formats import _orbax_write

        _orbax_write.write_global(tree, target, options, replace)


def open_folder(folder: Folder, step: int | None = None) -> Checkpoint:
    """An Orbax checkpoint, CheckpointManager step or root in a local directory or a bucket."""
    steps, pending = _steps(folder)
    if step is not None and not steps and not folder.listable:
        named = folder.child(str(step))  # a step directory as CheckpointManager names it by default
        if named.is_file("_CHECKPOINT_METADATA") and _committed(named):
            steps = {step: str(step)}
    if steps:
        return _open_manager_root(folder, steps, pending, step)
    if step is not None:
        raise UsageError(f"{option('step', step)} applies to a CheckpointManager root; this is a single checkpoint",
                         file=folder.name)
    if _TMP_MARK in folder.name.rsplit("/", 1)[-1]:
        raise FormatError("incomplete checkpoint: an unfinished Orbax temporary directory", file=folder.name)
    if not _committed(folder):
        raise FormatError("incomplete checkpoint: no commit_success.txt and no commit time in "
                          "_CHECKPOINT_METADATA in the bucket (the save did not finish)", file=folder.name)
    if folder.is_file("_METADATA") or folder.is_file(_AGGREGATE):
        checkpoint = Checkpoint(tree=None, format="orbax", file=folder.name, origin=_origin("directory", folder),
                                metadata=_recorded(folder))
        checkpoint.tree = _open_pytree(folder, checkpoint)
        return checkpoint
    return _open_step(folder)


def is_checkpoint(folder: Folder) -> bool:
    """Whether a directory holds an Orbax checkpoint, step or CheckpointManager root."""
    return any(folder.is_file(name) for name in ("_METADATA", "_CHECKPOINT_METADATA", _AGGREGATE)) \
        or bool(_steps(folder)[0])


def _origin(kind: str, folder: Folder) -> Origin | None:
    """Where --in-place would write: local directories only."""
    return Origin(kind, folder.path, [folder.path]) if isinstance(folder, LocalFolder) else None


# --- layout ---------------------------------------------------------------------------------


# A step directory as CheckpointManager names it: the number, zero-padded with
# step_format_fixed_length ("00000100"), after a step_prefix ("checkpoint_100", PaxML).
_STEP_NAME = re.compile(r"(?:.+_)?([0-9]+)")


def _steps(root: Folder) -> tuple[dict[int, str], list[str]]:
    """Committed steps under a CheckpointManager root (step -> directory name), and the
    names of the unfinished ones."""
    steps: dict[int, str] = {}
    pending = []
    for name in root.subfolders():
        match = _STEP_NAME.fullmatch(name)
        if _TMP_MARK in name:
            pending.append(name)
        elif match and root.child(name).is_file("_CHECKPOINT_METADATA"):
            if _committed(root.child(name)):
                steps.setdefault(int(match.group(1)), name)
            else:
                pending.append(name)
    return dict(sorted(steps.items())), pending


def _committed(directory: Folder) -> bool:
    """Whether a save finished, as Orbax decides: in GCS, where nothing is renamed, by its
    commit_success.txt (or a commit time in _CHECKPOINT_METADATA); anywhere else by the
    directory's name, a save being renamed from its temporary name once complete (so
    checkpoints of Orbax versions that wrote neither marker restore, and read)."""
    if _TMP_MARK in directory.name.rstrip("/").rsplit("/", 1)[-1]:
        return False
    if directory.is_file("commit_success.txt") or not directory.name.startswith("gs://"):
        return True
    try:
        metadata = json.loads(directory.read_text("_CHECKPOINT_METADATA"))
    except (OSError, ValueError, TreecliError):
        return False
    return isinstance(metadata, dict) and bool(metadata.get("commit_timestamp_nsecs"))


def _recorded(directory: Folder) -> dict[str, Any]:
    """treecli's record, where the checkpoint's custom metadata holds one (as the metadata
    of the formats that keep it as text), else nothing."""
    from treecli.formats._record import KEY

    if not directory.is_file("_CHECKPOINT_METADATA"):
        return {}
    try:
        metadata = _read_json(directory, "_CHECKPOINT_METADATA")
    except FormatError:  # (it only describes the checkpoint: a damaged one is left out)
        return {}
    custom = metadata.get("custom_metadata") if isinstance(metadata, dict) else None
    if not isinstance(custom, dict) or KEY not in custom:
        return {}
    return {KEY: json.dumps(custom[KEY], ensure_ascii=False)}


def _open_manager_root(root: Folder, steps: dict[int, str], pending: list[str], step: int | None) -> Checkpoint:
    chosen = max(steps) if step is None else step
    if chosen not in steps:
        raise UsageError(f"no committed step {chosen}; steps: {', '.join(map(str, steps))}", file=root.name)
    checkpoint = _open_step(root.child(steps[chosen]))
    checkpoint.file = root.name
    checkpoint.origin = _origin("step", root)
    listed = {"steps": list(steps)} if root.listable else {}  # over HTTP only the step asked for is known
    checkpoint.info = {**listed, "step": chosen, **checkpoint.info}
    if pending:
        checkpoint.warnings.append(f"ignoring unfinished step directories: {', '.join(pending)}")
    return checkpoint


def _open_step(step_dir: Folder) -> Checkpoint:
    """A CheckpointManager step: each item (a PyTree or a JSON file) is a top-level subtree."""
    if not step_dir.is_file("_CHECKPOINT_METADATA"):
        raise FormatError("not an Orbax checkpoint: no _METADATA or _CHECKPOINT_METADATA", file=step_dir.name)
    handlers = _read_json(step_dir, "_CHECKPOINT_METADATA")
    if isinstance(handlers, dict) and isinstance(handlers.get("item_handlers"), str):
        # A single-item checkpoint (StandardCheckpointer): its tree lives in _METADATA.
        raise FormatError("_METADATA is missing (corrupt or incomplete checkpoint)", file=step_dir.name)
    checkpoint = Checkpoint(tree=None, format="orbax", file=step_dir.name, origin=_origin("step", step_dir))
    items = checkpoint.items
    named = handlers.get("item_handlers") if isinstance(handlers, dict) else None
    named = set(named) if isinstance(named, dict) else set()  # the items the save wrote
    for name in step_dir.subfolders():
        item = step_dir.child(name)
        if item.is_file("_METADATA") or item.is_file(_AGGREGATE):
            items[name] = _open_pytree(item, checkpoint)
        elif json_file := next((f for f in _JSON_ITEM_FILES if item.is_file(f)), None):
            items[name] = _read_json(item, json_file)
        elif name in named:  # an item the save names, which holds none of its files: never left out silently
            raise FormatError(f"item {name!r} has no _METADATA (nor JSON data): corrupt or incomplete",
                              file=step_dir.name)
    if not items:
        raise FormatError("no readable items (each needs _METADATA or a JSON metadata file)", file=step_dir.name)
    checkpoint.info["items"] = sorted(items)
    # A step saved with StandardSave alone holds the item `default`, and Orbax's restore
    # returns its tree without that level: so does treecli (`item="default"` names it).
    checkpoint.tree = items["default"] if list(items) == ["default"] else dict(items)
    return checkpoint


# A JSON item's file: v0's JsonSave writes ITEM/metadata, v1's JsonHandler ITEM/data.json.
_JSON_ITEM_FILES = ("metadata", "data.json")


def _read_json(folder: Folder, name: str) -> Any:
    try:
        return json.loads(folder.read_text(name))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise FormatError(f"cannot read it as JSON: {e}", file=f"{folder.name}/{name}") from None


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


def _open_pytree(directory: Folder, checkpoint: Checkpoint) -> Any:
    if not directory.is_file("_METADATA"):
        return _open_aggregate(directory)
    metadata = _read_json(directory, "_METADATA")
    tree_metadata = metadata.get("tree_metadata") if isinstance(metadata, dict) else None
    if not isinstance(tree_metadata, dict):
        raise FormatError("_METADATA has no tree_metadata object (missing or corrupt)", file=directory.name)
    strings = _read_json(directory, "_strings.json") if directory.is_file("_strings.json") else {}
    if not isinstance(strings, dict) or not all(isinstance(v, str) for v in strings.values()):
        raise FormatError("_strings.json is not an object of strings (the string leaves by name)",
                          file=f"{directory.name}/_strings.json")
    entries = []
    for raw, entry in tree_metadata.items():
        try:
            keypath = tuple(int(k["key"]) if k["key_type"] == 1 else str(k["key"]) for k in entry["key_metadata"])
            value = entry["value_metadata"]
            value_type = value["value_type"]
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"_METADATA entry {raw!r} is malformed", file=directory.name) from None
        if len(keypath) > _tree.MAX_DEPTH:
            raise FormatError(f"a key path of {len(keypath)} keys is deeper than treecli walks "
                              f"({_tree.MAX_DEPTH})", file=directory.name)
        entries.append((keypath, value_type, value.get("write_shape")))
    arrays = [(kp, shape) for kp, kind, shape in entries if kind in _ARRAY_TYPES]
    stores = _open_arrays(directory, {kp: param_name(kp) for kp, _ in arrays},
                          use_ocdbt=metadata.get("use_ocdbt", True), use_zarr3=bool(metadata.get("use_zarr3")))
    items = []
    for keypath, kind, write_shape in entries:
        name = param_name(keypath)
        if kind in _ARRAY_TYPES:
            store = stores[keypath]
            if write_shape is not None and not _fits_in(write_shape, store.shape):
                raise FormatError(f"stored data has shape {list(store.shape)} but _METADATA says {write_shape}",
                                  file=directory.name, keypath=name)
            leaf = OrbaxLeaf(store, directory.name, name)
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


def _fits_in(write_shape: Any, shape: Any) -> bool:
    """Whether ``_METADATA``'s ``write_shape`` can be that of an array of ``shape``: the
    shape of one shard as written (the whole array when it lived on one device)."""
    return isinstance(write_shape, list) and len(write_shape) == len(shape) and all(
        isinstance(w, int) and 0 <= w <= n for w, n in zip(write_shape, shape))


def _open_aggregate(directory: Folder) -> Any:
    """The layout before ``_METADATA``: the tree from the msgpack aggregate file, each
    placeholder replaced by its array (stored with or without OCDBT, zarr or zarr3)."""
    from treecli.formats import msgpack as msgpack_format

    if not isinstance(directory, LocalFolder):
        raise FormatError("Orbax's layout before _METADATA (a msgpack 'checkpoint' file) is read from local "
                          "directories only; copy it here first", file=directory.name)
    with msgpack_format.MsgpackFormat().open(directory.path / _AGGREGATE) as aggregate:
        items = _tree.flatten(aggregate.tree, nones=True)
    names = {kp: x[len(_PLACEHOLDER):] for kp, x in items if isinstance(x, str) and x.startswith(_PLACEHOLDER)}
    use_ocdbt = directory.is_file("manifest.ocdbt")
    use_zarr3 = any(directory.is_file(f"{name}/zarr.json") for name in names.values())
    stores = _open_arrays(directory, names, use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)
    return _tree.unflatten([(kp, OrbaxLeaf(stores[kp], directory.name, names[kp]) if kp in names else x)
                            for kp, x in items], template=aggregate.tree)


def _open_arrays(directory: Folder, names: dict[tuple, str], *, use_ocdbt: bool, use_zarr3: bool) -> dict[tuple, Any]:
    """Open every array's tensorstore (metadata only), all at once; ``names`` maps each
    key path to the name its array is stored under."""
    import tensorstore as ts

    from treecli._bytes import http as retries

    driver = "zarr3" if use_zarr3 else "zarr"
    # One context for the checkpoint's arrays: they share one OCDBT database, its manifest and
    # B-tree nodes read once and kept in a small cache (each array alone re-read them).
    # Its reads and copies as concurrent as a load's own (``_devices.READERS`` threads read
    # pieces at once, each a TensorStore read here): TensorStore's defaults follow the cores.
    concurrency = {"limit": max(os.cpu_count() or 1, READERS)}
    context = ts.Context({"cache_pool": {"total_bytes_limit": METADATA_CACHE_BYTES},
                          "file_io_concurrency": concurrency, "data_copy_concurrency": concurrency,
                          **retries.tensorstore_retries()})
    futures = {}
    for keypath, name in names.items():
        if use_ocdbt:
            kvstore = {"driver": "ocdbt", "base": directory.kvstore(), "path": name}
        else:
            kvstore = directory.kvstore(_inside(directory, name, keypath))
        # What was read once is used as it is (never revalidated): a committed checkpoint does
        # not change, the manifest read first pins one version of an OCDBT database, and
        # revalidating cost a request for the manifest per array read.
        futures[keypath] = ts.open({"driver": driver, "kvstore": kvstore, "recheck_cached_data": False,
                                    "recheck_cached_metadata": False}, open=True, read=True, context=context)
    stores = {}
    for keypath, future in futures.items():
        try:
            stores[keypath] = future.result()
        except Exception as e:  # tensorstore raises ValueError and friends with long messages
            message = str(e).splitlines()[0][:200]
            raise FormatError(f"array data is missing or unreadable: {message}", file=directory.name,
                              keypath=names[keypath]) from None
    return stores


def _inside(directory: Folder, name: str, keypath: tuple) -> str:
    """The array directory a name in ``_METADATA`` stands for, which must lie inside the
    checkpoint: an absolute name or ``..`` would read a host file into an output."""
    inside = directory.inside(name)
    if inside is None:
        raise FormatError(f"_METADATA names array {name!r}, which lies outside the checkpoint directory; refusing "
                          "to read it", file=directory.name, keypath=format_keypath(keypath))
    return inside


class OrbaxLeaf(_leaf.WholeLeaf):
    """An array in an Orbax checkpoint. Orbax stores an array compressed, by default as one
    chunk (0.12), which is read whole: one leaf in memory at a time. An array stored in
    several chunks (a pod's shards, ``chunk_byte_size``) is read a band of chunk rows at a
    time, and an index reads only the chunks it touches."""

    def __init__(self, store: Any, file: str, name: str):
        self._store = store
        self._file = file
        self._name = name
        self.shape = tuple(int(d) for d in store.shape)
        self.dtype_name = store.dtype.numpy_dtype.name
        # Rows of axis 0 per chunk, where its chunks split that axis: how reads are banded
        chunk_rows = int(store.chunk_layout.read_chunk.shape[0]) if self.shape else 0
        self._band_rows = chunk_rows if 0 < chunk_rows < self.shape[0] else None
        self._band: tuple[int, int, Any] | None = None  # the band read last: (start, stop, flat data)

    @property
    def sources(self) -> tuple[str, ...]:
        return (self._file,)

    @property
    def reads_parts(self) -> bool:  # an index reads the chunks it touches; one chunk is read whole
        return self._band_rows is not None

    def load(self):
        return self._read_box(())

    reads_into_arrays = True

    def read_index_into(self, index: tuple, out) -> None:
        """TensorStore writes the selection into ``out`` itself (its own read's array is only
        16-byte aligned: JAX would copy it again to put it on a CPU device)."""
        import tensorstore as ts

        self._checked_size(out.nbytes)
        try:
            ts.array(out).write(self._store[index] if index else self._store).result()
        except Exception as e:
            raise FormatError(f"cannot read the array data: {str(e).splitlines()[0][:200]}", file=self._file,
                              keypath=self._name) from None

    def read_flat(self, start: int, stop: int):
        if self._band_rows is None:
            return super().read_flat(start, stop)
        band = self._band
        if band is None or not band[0] <= start <= stop <= band[1]:
            row = max(1, self.size // self.shape[0])
            first = start // row // self._band_rows * self._band_rows
            last = min(self.shape[0], -(-max(stop, start + 1) // row // self._band_rows) * self._band_rows)
            band = self._band = (first * row, last * row, self._read_box((slice(first, last),)))
        data = band[2][start - band[0] : stop - band[0]]
        if stop >= self.size:
            self._band = None
        return data

    def read(self, index: Any = ()):
        import numpy as np

        from treecli import _index

        if self._band_rows is None:
            return super().read(index)
        index = index if isinstance(index, tuple) else (index,)
        final_shape = _index.result_shape(self.shape, index)  # (an index NumPy refuses fails here)
        # The box the selection lies in, read through TensorStore, then the selection within it
        box, within = [], []
        for selector in _index.selectors(self.shape, index):
            if isinstance(selector, int):
                box.append(slice(selector, selector + 1))
                within.append(0)
            elif len(selector) == 0:
                box.append(slice(0, 0))
                within.append(slice(None))
            else:
                low, high = min(selector[0], selector[-1]), max(selector[0], selector[-1])
                box.append(slice(low, high + 1))
                within.append(_within(selector, low))
        data = self._read_box(tuple(box)).reshape([b.stop - b.start for b in box])
        return np.array(data[tuple(within)], copy=True).reshape(final_shape)

    def _checked_size(self, nbytes: int) -> None:
        """Checked before a read: a 2 KB checkpoint may declare 2**37 elements of fill value,
        and tensorstore allocating them aborts the whole process (std::bad_alloc)."""
        available = _memory.available()
        if available is not None and 2 * nbytes > available:
            raise FormatError(f"{nbytes / 2**30:.1f} GiB of the array must be read at once from Orbax, but "
                              f"{available / 2**30:.1f} GiB of memory is available", file=self._file,
                              keypath=self._name)

    def _read_box(self, box: tuple):
        """The elements of ``self[box]`` (slices of the leading axes), flat."""
        rows = box[0].stop - box[0].start if box else self.shape[0] if self.shape else 1
        self._checked_size(self.nbytes // max(1, self.shape[0]) * rows if self.shape else self.nbytes)
        try:
            return (self._store[box] if box else self._store).read().result().reshape(-1)
        except Exception as e:  # tensorstore raises ValueError and friends with long messages
            raise FormatError(f"cannot read the array data: {str(e).splitlines()[0][:200]}", file=self._file,
                              keypath=self._name) from None


def _within(selector: range, low: int) -> slice:
    """The slice that takes ``selector``'s positions from a box starting at ``low``."""
    stop = selector[-1] - low + selector.step  # one step past the last: below 0 means "to the start"
    return slice(selector[0] - low, stop if stop >= 0 else None, selector.step)
