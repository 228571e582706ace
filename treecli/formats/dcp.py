"""PyTorch Distributed Checkpoint directories (``torch.distributed.checkpoint.save``:
what FSDP and torchtitan write), read without torch.

A directory holds ``.metadata`` (a pickle of DCP's own classes: each key's dtype, size
and chunks, and where each chunk's bytes lie) and ``__R_S.distcp`` files, each chunk a
whole ``torch.save`` zip at an offset of one of them. ``.metadata`` is read by the same
allowlist unpickler as ``torch.save`` files, DCP's classes kept as plain records; each
chunk's zip is read where it lies; a tensor stored in several chunks (the shards of its
ranks) is one lazy leaf that reads only the chunks an index or a chunk of output
touches. Non-tensor values (a step counter) are read from their own small pickles.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from treecli import _leaf
from treecli._errors import FormatError
from treecli.formats import _flatkeys, _torch_pickle
from treecli.formats._base import Checkpoint, Format
from treecli.formats._unpickle import Record, Unpickler, record

METADATA = ".metadata"
MAX_METADATA_BYTES = 512 << 20

_DCP = "torch.distributed.checkpoint"
# DCP's metadata classes, kept as records of their fields; and what their fields hold.
ALLOWED = {
    **_torch_pickle.ALLOWED,
    **{f"{_DCP}.metadata.{name}": record(name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta")},
    f"{_DCP}.filesystem._StorageInfo": record("_StorageInfo"),
    f"{_DCP}.metadata._MEM_FORMAT_ENCODING": int,
    "torch.distributed.checkpoint._extension.ExtensionRegistry": record("ExtensionRegistry"),
    "pathlib.PosixPath": lambda *parts: "/".join(parts),
    "pathlib.WindowsPath": lambda *parts: "\\".join(parts),
}


class DcpFormat(Format):
    """A directory written by ``torch.distributed.checkpoint.save``."""

    name = "dcp"
    extensions = ()

    def sniff(self, path: Path) -> str | None:
        from treecli.formats._folder import LocalFolder

        return self.in_folder(LocalFolder(path)) if path.is_dir() else "not a directory"

    def open(self, path: Path, *, like: Any = None, step: int | None = None) -> Checkpoint:
        from treecli.formats._folder import LocalFolder

        return self.open_folder(LocalFolder(Path(path)), step=step)

    def in_folder(self, folder: Any) -> str | None:
        """Its ``.metadata`` and ``.distcp`` files (listed; over HTTP, which cannot list them,
        its ``.metadata`` asked for: it is binary, no text to fetch)."""
        if folder.listable:
            files = folder.files()
            if METADATA not in files:
                return f"no {METADATA}"
            return None if any(name.endswith(".distcp") for name in files) else "no .distcp files"
        from treecli._bytes.http import NotFoundError

        try:
            folder.reader(METADATA).close()
        except NotFoundError:
            return f"no {METADATA}"
        return None

    def open_folder(self, folder: Any, *, step: int | None = None, entry: str | None = None) -> Checkpoint:
        if step is not None or entry is not None:
            return super().open_folder(folder, step=step, entry=entry)
        return _open(folder)


def _open(folder: Any) -> Checkpoint:
    """A DCP checkpoint in a ``Folder``: a local directory, or one over HTTP, the Hub or in a
    bucket, every file read by byte ranges through its reader."""
    import numpy as np

    file = folder.named(METADATA)
    readers: dict[str, Any] = {}
    checkpoint = Checkpoint(tree=None, format=DcpFormat.name, file=folder.name)
    reader = _reader(folder, METADATA, readers, checkpoint, file, None)
    if reader.size > MAX_METADATA_BYTES:
        raise FormatError(f"{METADATA} is larger than {MAX_METADATA_BYTES >> 20} MiB", file=file)
    data = np.empty(reader.size, np.uint8)
    reader.read_into(data, 0)
    metadata = Unpickler(data.tobytes(), file=file, allowed=ALLOWED).load()[0]
    try:
        entries, places = metadata.field("state_dict_metadata"), metadata.field("storage_data")
        where = {(index.field("fqn"), _offsets(_fields(index).get("offset"))):
                 (info.field("relative_path"), info.field("offset"), info.field("length"),
                  _fields(info).get("transform_descriptors"))  # (fields at their defaults are not pickled)
                 for index, info in places.items()}
    except (KeyError, AttributeError, TypeError):
        raise FormatError(f"{METADATA} is not a DCP Metadata of state_dict_metadata and storage_data",
                          file=file) from None
    items = []
    for fqn, entry in entries.items():
        if not isinstance(fqn, str) or not isinstance(entry, Record):
            raise FormatError(f"{METADATA} has an entry that is not a key and its storage", file=file)
        items.append((fqn, _value(folder, fqn, entry, where, readers, checkpoint)))
    checkpoint.tree, warning = _flatkeys.nest(items, ".")
    checkpoint.warnings.extend([warning] if warning else [])
    return checkpoint


def _reader(folder: Any, name: str, readers: dict, checkpoint: Checkpoint, file: str, fqn: str | None) -> Any:
    """The folder's reader of ``name`` (opened once), its size known."""
    if name not in readers:
        try:
            reader = folder.reader(name)
        except (OSError, FormatError):
            raise FormatError(f"{name} is missing or cannot be read", file=file, keypath=fqn) from None
        checkpoint._closers.append(reader.close)
        if reader.size is None:
            raise FormatError("its size is not in the bucket's answers; copy the checkpoint here first",
                              file=folder.named(name))
        readers[name] = reader
    return readers[name]


def _fields(item: Record) -> dict:
    return item.state if isinstance(item.state, dict) else {}


def _offsets(value: Any) -> tuple | None:
    return None if value is None else tuple(value)


def _value(folder: Any, fqn: str, entry: Record, where: dict, readers: dict, checkpoint: Checkpoint) -> Any:
    """One key's leaf (a tensor, from its chunks) or value."""
    file = folder.named(METADATA)
    if entry.name == "BytesStorageMetadata":
        return _chunk(folder, fqn, where.get((fqn, None)), readers, checkpoint)
    if entry.name != "TensorStorageMetadata":
        raise FormatError(f"a {entry.name} entry, which treecli does not read", file=file, keypath=fqn)
    try:
        shape = tuple(entry.field("size"))
        dtype = entry.field("properties").args[0] if entry.field("properties").args else \
            entry.field("properties").state[0]
        chunks = [(tuple(c.field("offsets")), tuple(c.field("sizes"))) for c in entry.field("chunks")]
    except (KeyError, AttributeError, TypeError, IndexError):
        raise FormatError("a tensor entry without size, dtype and chunks", file=file, keypath=fqn) from None
    if not isinstance(dtype, _torch_pickle.DType):
        raise FormatError("a tensor entry whose dtype is not a torch dtype", file=file, keypath=fqn)
    pieces, covered = [], 0
    for offsets, sizes in chunks:
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise FormatError(f"a chunk at {list(offsets)} of {list(sizes)} lies outside the tensor's {list(shape)}",
                              file=file, keypath=fqn)
        obj = _chunk(folder, fqn, where.get((fqn, offsets)), readers, checkpoint)
        if not isinstance(obj, _leaf.ArrayLeaf) or tuple(obj.shape) != sizes or obj.dtype_name != dtype.name:
            raise FormatError(f"the chunk at {list(offsets)} does not hold a {dtype.name} tensor of {list(sizes)}",
                              file=file, keypath=fqn)
        pieces.append((tuple((o, o + s) for o, s in zip(offsets, sizes)), obj))
        covered += math.prod(sizes)
    overlap = _overlapping(pieces)
    if overlap is not None:  # (two chunks on one place: volumes that add up could still leave places uncovered)
        raise FormatError(f"the chunks at {list(overlap[0])} and {list(overlap[1])} overlap", file=file, keypath=fqn)
    if covered != math.prod(shape):  # inside the tensor and disjoint: they cover it exactly when the volumes agree
        raise FormatError(f"the chunks hold {covered} elements of the tensor's {math.prod(shape)}", file=file,
                          keypath=fqn)
    if len(pieces) == 1:
        return pieces[0][1]
    return _leaf.PiecedLeaf(shape, dtype.name, pieces, f"{file}: {fqn}: no chunk holds a part read")


def _overlapping(pieces: list[tuple[tuple, Any]]) -> tuple[tuple, tuple] | None:
    """The offsets of two boxes that share a place, or None: each box against all the others,
    one row of the comparison at a time (a tensor has at most a few thousand chunks)."""
    import numpy as np

    boxes = [bounds for bounds, _ in pieces if all(stop > start for start, stop in bounds)]
    if len(boxes) < 2:
        return None
    starts = np.array([[start for start, _ in box] for box in boxes], np.int64)
    stops = np.array([[stop for _, stop in box] for box in boxes], np.int64)
    for i in range(len(boxes) - 1):
        shared = np.all((starts[i] < stops[i + 1:]) & (starts[i + 1:] < stops[i]), axis=1)
        if shared.any():
            j = i + 1 + int(np.argmax(shared))
            return tuple(starts[i].tolist()), tuple(starts[j].tolist())
    return None


def _chunk(folder: Any, fqn: str, place: Any, readers: dict, checkpoint: Checkpoint) -> Any:
    """The object a chunk's embedded ``torch.save`` zip holds (a lazy leaf for a tensor)."""
    file = folder.named(METADATA)
    if place is None:
        raise FormatError(f"{METADATA} says where none of the key's chunks lie", file=file, keypath=fqn)
    name, offset, length, transforms = place
    if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", "..") \
            or not name.endswith(".distcp"):
        raise FormatError(f"a chunk in {name!r}, outside the checkpoint's .distcp files", file=file, keypath=fqn)
    if transforms:
        raise FormatError(f"a chunk stored with transforms {transforms!r}, which treecli does not undo", file=file,
                          keypath=fqn)
    reader = _reader(folder, name, readers, checkpoint, file, fqn)
    if not (type(offset) is int and type(length) is int and 0 <= offset and offset + length <= reader.size):
        raise FormatError(f"a chunk at {offset!r}+{length!r} of {name}, past its end", file=file, keypath=fqn)
    obj, places = _torch_pickle.read_zip(reader, (offset, length))
    # (a value holding tensors: its tensors lazy leaves, as in a .pt)
    return _torch_pickle.tree_of(_torch_pickle.items_of(obj, places, reader, reader.path, checkpoint.warnings),
                                checkpoint.warnings)
