"""safetensors: single files, HF sharded checkpoints (directory or index JSON).

The header is parsed and validated by treecli itself before anything is
allocated (``_safetensors_header``). Leaves are lazy; writing streams leaf by leaf.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import struct
from pathlib import Path
from typing import Any, Callable

from treecli import _atomic, _leaf
from treecli._bytes import stream, writer
from treecli._bytes.local import open_regular
from treecli._errors import FormatError, NotDurableError, TreecliError, UsageError, counted, option
from treecli._keypath import format_keypath
from treecli.formats import _flatkeys
from treecli.formats._base import Checkpoint, FilePlan, Format, Origin, OutputPlan, WriteOptions
from treecli.formats._folder import INDEX_SUFFIX, LocalFolder, companions_of, hf_weights, presumed
from treecli.formats._safetensors_header import _CODES, MAX_HEADER_BYTES, _parse_json, parse_header, tensor_leaf

_CODE_OF_DTYPE = {name: code for code, name in _CODES.items()}
_OWNED = re.compile(r"model(-\d{5}-of-\d{5}(-\d+)?)?\.safetensors|model\.safetensors\.index\.json")


class SafetensorsFormat(Format):
    """safetensors: one file, an HF sharded directory, or its index."""

    name = "safetensors"
    extensions = (".safetensors",)
    hf_directories = True  # (config.json beside the weights)
    remote_extensions = (".safetensors.index.json", ".safetensors")
    separator = "."
    writable = True
    keeps_records = True
    writes_directories = True
    writes_to_buckets = True

    def sniff(self, path: Path) -> str | None:
        if path.is_dir():
            return self.in_folder(LocalFolder(path))
        if path.name.endswith(INDEX_SUFFIX):
            return None
        try:
            with open_regular(path) as f:
                head = f.read(9)
                size = os.fstat(f.fileno()).st_size
        except OSError as e:
            return str(e)
        if len(head) < 9:
            return "too short for a safetensors header"
        (n,) = struct.unpack("<Q", head[:8])
        if n > min(MAX_HEADER_BYTES, size - 8) or head[8:9] not in (b"{", b" ", b"\t", b"\n", b"\r"):
            return "does not start with a safetensors header"
        return None

    def open(self, path: Path, *, like: Any = None, step: int | None = None) -> Checkpoint:
        path = Path(path)
        if path.is_dir():
            return self.open_folder(LocalFolder(path), step=step)
        return self.open_folder(LocalFolder(path.parent), step=step, entry=path.name)

    def in_folder(self, folder: Any) -> str | None:
        try:
            found = hf_weights(folder)
        except FormatError:  # (several indexes: safetensors still, and opening says which to name)
            return None
        return None if found is not None else "no *.safetensors files"

    def open_folder(self, folder: Any, *, step: int | None = None, entry: str | None = None) -> Checkpoint:
        """A safetensors file (``entry``), or an HF directory: its shard index (named, or
        the one it holds) and shards, else its one ``*.safetensors`` file; in any place,
        each header read through the folder's byte source (a remote repository's
        several at once: one round trip, not one a shard)."""
        if step is not None:
            raise UsageError(f"{option('step', step)} picks a step of an Orbax CheckpointManager; this is safetensors",
                             file=folder.named(entry) if entry else folder.name)
        if entry is None:
            found = hf_weights(folder)
            if found is None:
                raise FormatError("directory holds no *.safetensors file", file=folder.name)
            kind, name = found
        else:
            kind, name = ("index" if entry.endswith(INDEX_SUFFIX) else "file"), entry
        if kind == "index":
            return _open_sharded(folder, name, file=folder.named(name) if entry else folder.name)
        with presumed(folder, entry, f"no shard index or {name}"):
            checkpoint = _open_file(folder, name)
        if entry is None:  # a directory of one file: it is the checkpoint, its other files its companions
            checkpoint.file = folder.name
            checkpoint.companions = companions_of(folder, {name})
        return checkpoint

    def owns(self, name: str) -> bool:
        """Whether a directory entry is one treecli's writer writes (``-o DIR --force`` may replace it)."""
        return _OWNED.fullmatch(name) is not None

    def write(self, tree: Any, target: Path, options: WriteOptions) -> None:
        entries = _entries_for_writing(tree, str(target), options)
        if target.is_dir():
            _write_directory(entries, target, options)
        else:
            _write_file(target, entries, options.metadata, options)

    def plan(self, tree: Any, file: str, options: WriteOptions, directory: bool) -> OutputPlan:
        """The file, or the HF directory's shards (as ``write`` names and fills them) and its
        index, written last."""
        entries = _entries_for_writing(tree, file, options)
        if not directory:
            return OutputPlan([("", _file_plan(entries, options.metadata))])
        shards = _shards(entries, options.max_shard_size)
        if len(shards) == 1:
            return OutputPlan([("model.safetensors", _file_plan(shards[0], options.metadata))])
        names = _shard_names(len(shards), set())
        weight_map = {key: name for name, shard in zip(names, shards) for key, _ in shard}
        return OutputPlan([(name, _file_plan(shard, options.metadata)) for name, shard in zip(names, shards)],
                          last=lambda d: _write_index(d / "model.safetensors.index.json", entries, weight_map))

    def write_in_place(self, tree: Any, origin: Origin, options: WriteOptions) -> None:
        _write_sharded_in_place(_entries_for_writing(tree, str(origin.path), options), origin, options, self.open)

    def write_remote(self, tree: Any, url: str, options: WriteOptions, replace: bool) -> None:
        if not url.endswith(self.extensions):
            raise UsageError("a bucket output is one .safetensors object (a sharded directory is written here)",
                             file=url)
        _write_remote(tree, url, options, replace)

    def reference_problems(self, path: Path, written: dict[str, Any]) -> list[str]:
        """The output must also open with the reference's own parser (``safetensors.safe_open``),
        naming the tensors treecli's reader found."""
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        names: set[str] = set()
        problems = []
        for file in files:
            try:
                with safe_open(str(file), framework="numpy") as reader:
                    names.update(reader.keys())
            except Exception as e:  # the reference's own error types
                problems.append(f"{file.name}: the safetensors reference cannot open it: {e}")
        ours = {name for name, leaf in written.items() if _leaf.is_array(leaf)}
        if not problems and names != ours:
            problems.append(f"the safetensors reference reads {counted(len(names), 'tensor')}, treecli {len(ours)}")
        return problems


# ---------------------------------------------------------------------------
# reading


def _open_file(folder: Any, name: str) -> Checkpoint:
    """One safetensors file of ``folder``: its header read and validated through the
    folder's byte source, its leaves lazy byte ranges of it."""
    reader, (tensors, metadata, _) = _header(folder, name)
    items = [(key, tensor_leaf(reader, offset, shape, dtype)) for key, (dtype, shape, offset) in tensors.items()]
    tree, warning = _flatkeys.nest(_logical(items, folder), ".")
    local = folder.local_path / name if folder.local_path is not None else None
    checkpoint = Checkpoint(tree=tree, format="safetensors", file=folder.named(name), metadata=dict(metadata),
                            origin=Origin("file", local, [local]) if local is not None else None)
    checkpoint.warnings.extend([warning] if warning else [])
    checkpoint._closers.append(reader.close)
    return checkpoint


def _header(folder: Any, name: str) -> tuple[Any, tuple]:
    """A file's byte source and its parsed header (a bucket object's size learnt from it)."""
    reader = folder.reader(name)
    try:
        size = reader.size if reader.size is not None else reader.check_end
        return reader, parse_header(reader.read, size, folder.named(name))
    except BaseException:
        reader.close()
        raise


def _open_sharded(folder: Any, index: str, file: str) -> Checkpoint:
    """An HF sharded checkpoint: the index, then every shard's header (``folder.parallel_reads``
    at once), every tensor checked to be where the index says."""
    index_file = folder.named(index)
    try:
        text = folder.text(index)
    except (OSError, UnicodeDecodeError) as e:
        raise FormatError(f"cannot read the shard index: {e}", file=index_file) from None
    if text is None:
        raise FormatError("not found", file=index_file)
    weight_map, shards = shard_names(text, index_file)
    present = set(folder.files()) if folder.listable else None
    for shard in shards:
        if present is not None and shard not in present:  # (a special file is refused when it is opened)
            raise FormatError(f"shard {shard!r} named by the index is missing (interrupted download?)",
                              file=index_file)
    local = folder.local_path
    checkpoint = Checkpoint(tree=None, format="safetensors", file=file, origin=None if local is None else Origin(
        "sharded", local / index, [local / index] + [local / s for s in shards]))
    results = stream.map_at_once(lambda shard: _shard_header(folder, shard), shards, folder.parallel_reads)
    opened = {shard: (reader, tensors, metadata) for shard, (reader, (tensors, metadata, _)) in zip(shards, results)}
    assemble_shards(checkpoint, weight_map, opened, lambda items: _logical(items, folder))
    if present is not None:
        stray = sorted(n for n in present if n.endswith(".safetensors") and n not in shards and not n.startswith("."))
        if stray:
            checkpoint.warnings.append(f"ignoring {', '.join(stray)}: not named by the index {index}")
    checkpoint.companions = companions_of(folder, set(shards) | {index})
    return checkpoint


def _shard_header(folder: Any, shard: str) -> tuple[Any, tuple]:
    try:
        return _header(folder, shard)
    except TreecliError as e:
        raise e.with_file(folder.named(shard))


def shard_names(text: str, file: str) -> tuple[dict[str, str], list[str]]:
    """An index's ``weight_map`` (tensor -> shard) and its shards in order; every shard
    name stays inside the checkpoint's directory (or repository), checked before any open."""
    index = _parse_json(text, file)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise FormatError("shard index has no 'weight_map' object of tensor name -> shard file", file=file)
    shards = list(dict.fromkeys(weight_map.values()))
    for shard in shards:  # each once: an MoE index maps 90k tensors to 160 shards
        if not shard or "/" in shard or "\\" in shard or shard in (".", "..") or Path(shard).is_absolute():
            name = next(name for name, named in weight_map.items() if named == shard)
            raise FormatError(f"weight_map names shard {shard!r}, which leaves the checkpoint directory", file=file, keypath=name)
    return weight_map, shards


def assemble_shards(checkpoint: Checkpoint, weight_map: dict[str, str], opened: dict[str, tuple],
                    logical: Callable[[list], list]) -> None:
    """Fill ``checkpoint`` from its shards' ``(reader, tensors, metadata)``, checking that
    every tensor is in exactly the shard the index names; ``logical`` makes the tensors
    the leaves read (``_logical``)."""
    file = checkpoint.file
    items: list[tuple[str, Any]] = []
    for shard, (reader, tensors, metadata) in opened.items():
        checkpoint._closers.append(reader.close)
        for key, value in metadata.items():
            checkpoint.metadata.setdefault(key, value)
        for name, (dtype, shape, offset) in tensors.items():
            # (a tensor in two shards is in one the index does not name; a shard holds a name once)
            if weight_map.get(name) != shard:
                raise FormatError(
                    f"tensor is stored in shard {shard} but the index maps it to {weight_map.get(name)!r}",
                    file=file, keypath=name,
                )
            items.append((name, tensor_leaf(reader, offset, shape, dtype)))
    if len(items) != len(weight_map):  # every tensor found is mapped: some mapped one was not found
        held = {name for name, _ in items}
        name, shard = next((name, shard) for name, shard in weight_map.items() if name not in held)
        raise FormatError(f"the index maps this tensor to shard {shard}, which does not hold it", file=file, keypath=name)
    checkpoint.tree, warning = _flatkeys.nest(logical(items), ".")
    if warning:
        checkpoint.warnings.append(warning)


def _logical(items: list[tuple[str, Any]], folder: Any) -> list[tuple[str, Any]]:
    """The tensors as the weights they are: FP8 with block scales and MXFP4 as one leaf of
    values each (``_blockscaled``), by the folder's ``config.json``, read only where a
    tensor's name says it may be needed."""
    from treecli.formats import _blockscaled

    if not _blockscaled.wanted(name for name, _ in items):
        return items
    try:
        config = folder.text("config.json")
    except (OSError, UnicodeDecodeError, TreecliError):
        config = None
    return _blockscaled.logical_items(items, config)


# ---------------------------------------------------------------------------
# writing


def _entries_for_writing(tree: Any, file: str, options: WriteOptions) -> list[tuple[str, Any]]:
    entries = []
    unsupported = []
    for key, keypath, leaf in _flatkeys.flatten_for_writing(tree, ".", file):
        if not _leaf.is_array(leaf):
            unsupported.append(f"{format_keypath(keypath)} ({_describe(leaf)})")
            continue
        leaf = _leaf.as_leaf(leaf)
        if leaf.dtype_name not in _CODE_OF_DTYPE:
            unsupported.append(f"{format_keypath(keypath)} (dtype {leaf.dtype_name})")
            continue
        entries.append((key, leaf))
    options.refuse_or_drop(unsupported, "safetensors", file)
    return entries


def _describe(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, (dict, list, tuple)):
        return f"empty {type(value).__name__}"
    return type(value).__name__


def _write_file(path: Path, entries: list[tuple[str, Any]], metadata: dict[str, Any], options: WriteOptions) -> None:
    head = _encode_header(entries, metadata)
    if options.record is not None:
        options.record.wrote_head(path, head)
    with open(path, "wb", buffering=writer.WRITE_BUFFER) as f:
        _write_stream(f, head, entries, str(path), options, options.writeback(f))
        f.flush()
        os.fsync(f.fileno())


def _file_plan(entries: list[tuple[str, Any]], metadata: dict[str, Any]) -> FilePlan:
    head = _encode_header(entries, metadata)
    offsets = itertools.accumulate((leaf.nbytes for _, leaf in entries), initial=len(head))
    return FilePlan(head, [(offset, leaf) for offset, (_, leaf) in zip(offsets, entries)])


def _encode_header(entries: list[tuple[str, Any]], metadata: dict[str, Any]) -> bytes:
    """The 8-byte length and the JSON header of a file holding ``entries`` in order."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for key, leaf in entries:
        header[key] = {
            "dtype": _CODE_OF_DTYPE[leaf.dtype_name],
            "shape": list(leaf.shape),
            "data_offsets": [offset, offset + leaf.nbytes],
        }
        offset += leaf.nbytes
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # align the data region, as the reference does
    return struct.pack("<Q", len(blob)) + blob


def _write_stream(f: Any, head: bytes, entries: list[tuple[str, Any]], file: str, options: WriteOptions,
                  writeback: writer.Writeback | None = None) -> None:
    f.write(head)
    for key, leaf in entries:
        writer.write_leaf(f, leaf, file=file, keypath=key, writeback=writeback, progress=options.progress,
                          digests=options.digests, record=options.record)


def _write_remote(tree: Any, url: str, options: WriteOptions, replace: bool) -> None:
    """One object in a bucket, streamed as an upload that appears only when complete."""
    from treecli._bytes import upload

    entries = _entries_for_writing(tree, url, options)
    head = _encode_header(entries, options.metadata)
    with upload.uploading(url, len(head) + sum(leaf.nbytes for _, leaf in entries), replace=replace) as f:
        _write_stream(f, head, entries, url, options)


def _shards(entries: list[tuple[str, Any]], limit: int | None) -> list[list[tuple[str, Any]]]:
    """Consecutive groups of entries of at most ``limit`` bytes each (a bigger leaf alone)."""
    shards: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for key, leaf in entries:
        if limit and shards[-1] and size + leaf.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((key, leaf))
        size += leaf.nbytes
    return shards


def _shard_names(count: int, taken: set[str]) -> list[str]:
    """HF's shard names, with a generation mark where a name is taken (in place, the old
    shards stay until the new index is committed)."""
    for generation in itertools.count():
        mark = f"-{generation}" if generation else ""
        names = [f"model-{i:05d}-of-{count:05d}{mark}.safetensors" for i in range(1, count + 1)]
        if not taken.intersection(names):
            return names
    raise AssertionError("unreachable")


def _write_directory(entries: list[tuple[str, Any]], directory: Path, options: WriteOptions) -> None:
    shards = _shards(entries, options.max_shard_size)
    if len(shards) == 1:
        _write_file(directory / "model.safetensors", shards[0], options.metadata, options)
        return
    weight_map = {}
    for name, shard in zip(_shard_names(len(shards), set()), shards):
        _write_file(directory / name, shard, options.metadata, options)
        weight_map.update({key: name for key, _ in shard})
    # The index last: a directory without it is not a complete sharded checkpoint.
    _write_index(directory / "model.safetensors.index.json", entries, weight_map)


def _write_index(path: Path, entries: list[tuple[str, Any]], weight_map: dict[str, str]) -> None:
    index = {
        "metadata": {
            "total_size": sum(leaf.nbytes for _, leaf in entries),
            "total_parameters": sum(leaf.size for _, leaf in entries),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _write_sharded_in_place(entries: list[tuple[str, Any]], origin: Origin, options: WriteOptions,
                            opener: Callable[[Path], Checkpoint]) -> None:
    """New shards beside the old ones, then the index (the commit), then the old shards go:
    a crash at any point leaves the old checkpoint or the new one, and nothing else in the
    directory is touched. Without ``max_shard_size`` shards stay as large as the input's.
    The record's roots are written into the new shards (``opener`` reads them through the
    new index) before that index replaces the old."""
    directory = origin.path.parent
    old_shards = [p for p in origin.files if p != origin.path]
    limit = options.max_shard_size or max((p.stat().st_size for p in old_shards), default=None)
    shards = _shards(entries, limit)
    names = _shard_names(len(shards), set(os.listdir(directory)))
    like = os.stat(old_shards[0]) if old_shards else None
    stale = [old for old in old_shards if old.name not in names]
    written: list[Path] = []
    weight_map = {}
    try:
        for name, shard in zip(names, shards):
            written.append(directory / name)
            with _atomic.atomic_file(directory / name, like=like) as tmp:
                _write_file(tmp, shard, options.metadata, options)
            if options.record is not None:
                options.record.moved(tmp, directory / name)
            weight_map.update({key: name for key, _ in shard})
    except NotDurableError as e:  # the old index still rules, so nothing was published: say so
        _unlink_all(written)
        raise TreecliError(f"cannot write: syncing the directory failed ({e.__cause__}); the checkpoint is "
                           "unchanged", file=str(directory)) from e
    except BaseException:  # the old index still rules: the new shards go
        _unlink_all(written)
        raise
    try:
        with _atomic.atomic_file(origin.path, like=os.stat(origin.path)) as tmp:
            _write_index(tmp, entries, weight_map)
            if options.record is not None:  # (the new shards' roots, before the index makes them the checkpoint)
                options.record.seal(opener, tmp)
    except NotDurableError:  # the new index is in place: its shards stay, the old ones go
        _unlink_all(stale)
        raise
    except BaseException:
        _unlink_all(written)
        raise
    _unlink_all(stale)
    _atomic.fsync_path(directory)


def _unlink_all(paths: Any) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
