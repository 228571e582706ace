"""Writing GGUF: the header (metadata, tensor infos), then each tensor's bytes at its
aligned offset, streamed.

Float and integer leaves are written as GGUF's F32, F16, BF16, F64 and I8-I64 tensors,
their shapes reversed (GGUF names the fastest dimension first). A quantized tensor read
from a GGUF file is written with its blocks as they are, never dequantized and
quantized again. Metadata read from a GGUF file keeps its types and whole values
(a token list stays a list of strings); any other metadata is written as strings.
``gguf.GGUFReader`` reads what it writes.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from treecli import _leaf
from treecli._bytes import writer
from treecli._bytes.writer import Digest
from treecli._errors import UsageError
from treecli._keypath import format_keypath
from treecli.formats import _flatkeys
from treecli.formats._base import WriteOptions
from treecli.formats._filedata import FileArrayLeaf
from treecli.formats._gguf_layout import ARRAYS, MAGIC, SCALARS, STRING, MetaValue, QuantizedLeaf

_TYPE_OF = {dtype: kind for kind, dtype in ARRAYS.items()}
_COPY_BYTES = 4 << 20  # a quantized tensor's blocks are copied this many bytes at a time
GGML_MAX_DIMS = 4


def write(tree: Any, target: Path, options: WriteOptions) -> None:
    """One GGUF file; or, into a directory (``-o DIR --format gguf --max-shard-size``), the
    shards llama-gguf-split writes: ``model-00001-of-00003.gguf``, ..., each at most
    ``max_shard_size`` bytes of tensors (a bigger tensor alone), the first with the
    metadata, every one with ``split.no``, ``split.count`` and ``split.tensors.count``."""
    entries = _entries(tree, str(target), options)
    metadata = dict(options.metadata)
    mixes = {leaf.mix for _, leaf in entries if getattr(leaf, "mix", None) and not getattr(leaf, "requantized", False)}
    if len(mixes) == 1:  # quantized here by a llama.cpp mix: the file says which (an input's type no longer holds)
        from gguf import LlamaFileType

        metadata["general.file_type"] = MetaValue(4, int(LlamaFileType[f"MOSTLY_{mixes.pop().upper()}"]))
    if not target.is_dir():
        if options.max_shard_size is not None:
            raise UsageError("a .gguf output is one file; to split it into shards as llama-gguf-split does, name a "
                             "directory: -o DIR --format gguf --max-shard-size SIZE", file=str(target))
        _write_file(target, entries, metadata, options)
        return
    shards = _shards(entries, options.max_shard_size, _alignment(metadata.get("general.alignment")))
    for index, shard in enumerate(shards):
        split = {"split.no": MetaValue(2, index), "split.count": MetaValue(2, len(shards)),
                 "split.tensors.count": MetaValue(5, len(entries))}
        shard_metadata = {**metadata, **split} if index == 0 else split
        _write_file(target / split_name(index, len(shards)), shard, shard_metadata, options)


def split_name(index: int, count: int) -> str:
    """The name of shard ``index`` (from 0) of a split GGUF directory."""
    return f"model-{index + 1:05d}-of-{count:05d}.gguf"


def _shards(entries: list[tuple[str, Any]], limit: int | None, alignment: int) -> list[list[tuple[str, Any]]]:
    """The tensors in order, a new shard where the next one's bytes would pass ``limit``
    (as llama-gguf-split counts them: each tensor's bytes padded to the alignment)."""
    shards: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, leaf in entries:
        nbytes = -(-_nbytes(leaf) // alignment) * alignment
        if limit is not None and shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, leaf))
        size += nbytes
    return shards


def _nbytes(leaf: Any) -> int:
    return leaf.raw_nbytes if isinstance(leaf, QuantizedLeaf) else leaf.nbytes


def _write_file(target: Path, entries: list[tuple[str, Any]], metadata: dict[str, Any], options: WriteOptions) -> None:
    alignment = _alignment(metadata.get("general.alignment"))
    infos, offset = [], 0
    for name, leaf in entries:
        kind = leaf.kind if isinstance(leaf, QuantizedLeaf) else _TYPE_OF[leaf.dtype_name]
        infos.append(_string(name) + struct.pack("<I", len(leaf.shape)) +
                     b"".join(struct.pack("<Q", d) for d in reversed(leaf.shape)) + struct.pack("<IQ", kind, offset))
        offset += -(-_nbytes(leaf) // alignment) * alignment
    head = MAGIC + struct.pack("<IQQ", 3, len(entries), len(metadata)) + \
        b"".join(_string(key) + _typed(value) for key, value in metadata.items()) + b"".join(infos)
    if options.record is not None:
        options.record.wrote_head(target, head)
    with open(target, "wb", buffering=writer.WRITE_BUFFER) as f:
        f.write(head + b"\0" * (-len(head) % alignment))
        writeback = options.writeback(f)
        for name, leaf in entries:
            if isinstance(leaf, QuantizedLeaf):
                _write_blocks(f, leaf, options)
            else:
                writer.write_leaf(f, leaf, file=str(target), keypath=name, writeback=writeback,
                                  progress=options.progress, digests=options.digests, record=options.record)
            f.write(b"\0" * (-_nbytes(leaf) % alignment))


def _write_blocks(f: Any, leaf: QuantizedLeaf, options: WriteOptions) -> None:
    """A quantized tensor's blocks, copied (or made, where it is quantized here), with their
    digest recorded for the verification: blocks made here are then never made again to
    check them."""
    digest = Digest() if options.digests is not None else None
    hashed = options.record.start(leaf) if options.record is not None else None
    place = writer.file_place(f) if hashed is not None else None
    for start in range(0, leaf.raw_nbytes, _COPY_BYTES):
        raw = leaf.read_raw(start, min(leaf.raw_nbytes, start + _COPY_BYTES))
        f.write(raw)
        for sums in (digest, hashed):
            if sums is not None:
                sums.update(raw)
        if options.progress:
            options.progress(raw.nbytes)
    if digest is not None:
        options.digests[id(leaf.as_blocks())] = (leaf.as_blocks(), digest.value())
    if hashed is not None:
        options.record.wrote(leaf, hashed, place)


def _entries(tree: Any, file: str, options: WriteOptions) -> list[tuple[str, Any]]:
    entries, unsupported = [], []
    for key, keypath, leaf in _flatkeys.flatten_for_writing(tree, ".", file):
        if _leaf.is_array(leaf) and len(leaf.shape) > GGML_MAX_DIMS:  # (llama.cpp, and treecli, read no more)
            unsupported.append(f"{format_keypath(keypath)} ({len(leaf.shape)} dimensions; GGUF holds at most "
                               f"{GGML_MAX_DIMS})")
        elif isinstance(leaf, QuantizedLeaf) or (_leaf.is_array(leaf) and _leaf.as_leaf(leaf).dtype_name in _TYPE_OF):
            entries.append((key, leaf if isinstance(leaf, QuantizedLeaf) else _leaf.as_leaf(leaf)))
        else:
            what = f"dtype {_leaf.as_leaf(leaf).dtype_name}" if _leaf.is_array(leaf) else type(leaf).__name__
            unsupported.append(f"{format_keypath(keypath)} ({what})")
    options.refuse_or_drop(unsupported, "GGUF", file)
    # A GGUF input's tensors keep its order (its data's, which its infos follow); others follow them.
    return [entry for _, entry in sorted(enumerate(entries), key=lambda item: _input_place(item[1][1], item[0]))]


def _input_place(leaf: Any, position: int) -> tuple:
    """Where a leaf's data lies in an input file, a computed leaf's where the leaf it reads
    lies (a cast, an edit); leaves of no file after, in the tree's order."""
    while isinstance(leaf, _leaf.ComputedLeaf) and len(leaf.inputs) == 1:
        leaf = leaf.inputs[0]
    if isinstance(leaf, QuantizedLeaf) and leaf.place is not None:
        return (0, *leaf.place)
    if isinstance(leaf, FileArrayLeaf):
        return (0, leaf.reader.path, leaf.offset)
    return (1, "", position)


def _alignment(value: Any) -> int:
    """The data's alignment: the input's ``general.alignment`` where it had one, else GGUF's 32."""
    if isinstance(value, MetaValue) and value.kind == 4 and value.value > 0 and not value.value & (value.value - 1):
        return value.value
    return 32


def _string(text: str | bytes) -> bytes:
    data = bytes(text) if isinstance(text, (bytes, bytearray)) else str(text).encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _typed(value: Any) -> bytes:
    """A metadata value: its own GGUF type where it came from a GGUF file, else a string."""
    if not isinstance(value, MetaValue):
        return struct.pack("<I", STRING) + _string(value)
    return struct.pack("<I", value.kind) + _payload(value.kind, value.value)


def _payload(kind: int, value: Any) -> bytes:
    if kind in SCALARS:
        return struct.pack(SCALARS[kind][0], value)
    if kind == STRING:
        return _string(value)
    item, items = value
    if item in SCALARS:
        import numpy as np

        body = np.asarray(items, np.dtype(SCALARS[item][0])).tobytes()
    else:
        body = b"".join(_payload(item, v) for v in items)
    return struct.pack("<IQ", item, len(items)) + body
