"""GGUF (llama.cpp, Ollama): the header read by treecli's own bounded parser, tensors as
lazy leaves.

The header (magic ``GGUF``, version 2 or 3, the metadata key/values, the tensor infos)
is parsed here, every count and length checked against the file's size before anything
is allocated (``gguf.GGUFReader`` trusts them). Metadata shows as safetensors'
``__metadata__`` does, each value as text, an array of more than 16 items summarised
(``[151936 strings]``). Float and integer tensors (F32, F16, BF16, F64, I8-I64) are
arrays read by byte ranges; quantized ones (Q4_0, Q8_0, the K-quants, the IQ kinds) are
float32 leaves of their logical shape, dequantized on demand, one tensor at a time, by
the ``gguf`` package (the llama.cpp project's own). GGUF names dimensions fastest
first; a leaf's shape is NumPy's, the reverse. Names nest on ``.`` as safetensors' do.
"""

from __future__ import annotations

import math
import re
import struct
from pathlib import Path
from typing import Any

from treecli import _leaf
from treecli._bytes.local import open_regular
from treecli._errors import FormatError, UsageError
from treecli.formats import _flatkeys, _iquants, _kquants, _model
from treecli.formats._base import Checkpoint, Format, WriteOptions
from treecli.formats._filedata import FileArrayLeaf
from treecli.formats._folder import LocalFolder
from treecli.formats._gguf_layout import (ARRAY, ARRAYS, MAGIC, MAX_DIMS, MAX_KEYS, MAX_NESTING, MAX_TENSORS,
                                           SCALARS, STRING, WRITTEN_QUANTIZATIONS, MetaValue, QuantizedLeaf,
                                           type_name)



class GgufFormat(Format):
    """llama.cpp's GGUF files, version 2 and 3."""

    name = "gguf"
    extensions = (".gguf",)
    remote_extensions = (".gguf",)
    writable = True
    keeps_records = True

    def write(self, tree: Any, target: Path, options: WriteOptions) -> None:
        from treecli.formats import _gguf_write

        _gguf_write.write(tree, target, options)

    def held(self, tree: Any) -> Any:
        """Quantized tensors' edited values in their own type again (``kept_quantized``)."""
        return kept_quantized(tree)

    def sniff(self, path: Path) -> str | None:
        if path.is_dir():
            return "a directory"
        with open_regular(path) as f:
            return None if f.read(4) == MAGIC else "does not start with GGUF"

    def stored_leaves(self, tree: Any, written: Any, like: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """A quantized tensor is verified by its blocks, as stored (a copy is bit-exact
        whether or not the gguf package dequantizes its type); any other leaf as usual."""
        expected, found = super().stored_leaves(tree, written, like)

        def blocks(leaves: dict[str, Any]) -> dict[str, Any]:
            return {name: leaf.as_blocks() if isinstance(leaf, QuantizedLeaf) else leaf for name, leaf in leaves.items()}

        return blocks(expected), blocks(found)

    def open(self, path: Path, *, like: Any = None, step: int | None = None) -> Checkpoint:
        path = Path(path)
        if path.is_dir():
            return self.open_folder(LocalFolder(path), step=step)
        return self.open_folder(LocalFolder(path.parent), step=step, entry=path.name)

    def in_folder(self, folder: Any) -> str | None:
        """A directory of one split GGUF's shards (what ``-o DIR --format gguf`` writes)."""
        return None if folder.listable and _first_shard(folder) else "no split GGUF shards (NAME-00001-of-N.gguf)"

    def owns(self, name: str) -> bool:
        return _SPLIT_NAME.fullmatch(name) is not None

    def open_folder(self, folder: Any, *, step: int | None = None, entry: str | None = None) -> Checkpoint:
        """A GGUF file (``entry``) anywhere, read by byte ranges through the folder: its
        header now, its tensors lazy ranges of it; a split GGUF's shards, by any of them
        (or by their directory), as one checkpoint."""
        if entry is None and step is None and folder.listable:
            entry = _first_shard(folder)
        if entry is None or step is not None:
            return super().open_folder(folder, step=step, entry=entry)
        reader = _sized_reader(folder, entry)
        try:
            header = _Header(reader)
        except BaseException:
            reader.close()
            raise
        count = _split_count(header, folder.named(entry))
        if count <= 1:
            return _checkpoint([(reader, header)], reader.path)
        return _open_split(folder, entry, count, reader, header)


def _sized_reader(folder: Any, name: str) -> Any:
    reader = folder.reader(name)
    if reader.size is None:  # (a bucket's answers say no size)
        reader.close()
        raise UsageError("treecli reads GGUF files over HTTP and from the Hub; from a bucket, copy the file "
                         "here first", file=folder.named(name))
    return reader


# llama-gguf-split's shards: NAME-00001-of-00003.gguf, each with split.no (from 0) and split.count; the
# first holds the metadata, and every shard split.tensors.count, the tensors of all
_SPLIT_NAME = re.compile(r"(.+)-([0-9]{5})-of-([0-9]{5})\.gguf")
_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def _first_shard(folder: Any) -> str | None:
    """The first shard of the one split GGUF a directory holds (None: none, or several)."""
    firsts = [name for name in folder.files() if (m := _SPLIT_NAME.fullmatch(name)) and m.group(2) == "00001"]
    return firsts[0] if len(firsts) == 1 else None


def _split_count(header: "_Header", file: str) -> int:
    value = header.metadata.get("split.count")
    if value is None:
        return 1
    if value.kind not in SCALARS or isinstance(value.value, float) or not 1 <= int(value.value) <= 99999:
        raise FormatError(f"split.count is {str(value)[:40]!r}, not a number of shards from 1 to 99999", file=file)
    return int(value.value)


def _open_split(folder: Any, entry: str, count: int, reader: Any, header: "_Header") -> Checkpoint:
    """The shards of a split GGUF (``entry`` any of them), read as one checkpoint: every
    shard's header checked against the others before any is trusted."""
    file = folder.named(entry)
    named = _SPLIT_NAME.fullmatch(entry)
    if named is None or int(named.group(3)) != count:
        reader.close()
        raise FormatError(f"one of {count} shards (split.count), but not named NAME-0000K-of-{count:05d}.gguf: the "
                          "others cannot be found", file=file)
    opened = {int(named.group(2)) - 1: (reader, header)}
    try:
        for index in range(count):
            if index not in opened:
                name = f"{named.group(1)}-{index + 1:05d}-of-{count:05d}.gguf"
                shard = _sized_reader(folder, name)
                try:
                    opened[index] = (shard, _Header(shard))
                except BaseException:
                    shard.close()
                    raise
        shards = [opened[index] for index in range(count)]
        total = sum(len(h.tensors) for _, h in shards)
        for index, (shard, shard_header) in enumerate(shards):
            meta = shard_header.metadata
            no, declared = meta.get("split.no"), meta.get("split.tensors.count")
            if no is None or no.value != index or _split_count(shard_header, shard.path) != count:
                raise FormatError(f"split.no is {str(no)[:20]} and split.count {str(meta.get('split.count'))[:20]}; "
                                  f"its name makes it shard {index} (from 0) of {count}", file=shard.path)
            if declared is None or declared.value != total:
                raise FormatError(f"split.tensors.count is {str(declared)[:20]}, but the {count} shards hold "
                                  f"{total} tensors", file=shard.path)
        return _checkpoint(shards, folder.named(f"{named.group(1)}-00001-of-{count:05d}.gguf"))
    except BaseException:
        for shard, _ in opened.values():
            shard.close()
        raise


def _checkpoint(shards: list[tuple[Any, "_Header"]], file: str) -> Checkpoint:
    """A GGUF checkpoint of one file, or of a split file's shards (in order: the first's
    metadata, without the split keys, is the checkpoint's); its tensors lazy ranges."""
    checkpoint = Checkpoint(tree=None, format=GgufFormat.name, file=file)
    items, quantized, seen = [], {}, set()
    for reader, header in shards:
        checkpoint._closers.append(reader.close)
        for name, dims, kind, offset in header.tensors:
            if name in seen:
                raise FormatError("two shards hold a tensor of this name", file=reader.path, keypath=name)
            seen.add(name)
            items.append((name, _tensor_leaf(reader, header, name, dims, kind, offset)))
            if kind not in ARRAYS:
                quantized[type_name(kind)] = quantized.get(type_name(kind), 0) + 1
    checkpoint.tree, warning = _flatkeys.nest(items, ".")
    checkpoint.warnings.extend([warning] if warning else [])
    metadata = shards[0][1].metadata
    checkpoint.metadata = {k: v for k, v in metadata.items() if k not in _SPLIT_KEYS} if len(shards) > 1 \
        else metadata
    checkpoint.model = _model.from_gguf(metadata)
    if len(shards) > 1:
        checkpoint.info["shards"] = f"{len(shards)} files (llama-gguf-split's), read as one"
    if quantized:
        kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(quantized.items()))
        checkpoint.info["quantized"] = f"{kinds} (float32 leaves, dequantized when read)"
    return checkpoint


def _tensor_leaf(reader: Any, header: "_Header", name: str, dims: list[int], kind: int, offset: int) -> Any:
    shape = tuple(reversed(dims))
    if kind in ARRAYS and header.order == ">":
        return _BigEndianLeaf(reader, offset, shape, ARRAYS[kind])
    if kind in ARRAYS:
        return FileArrayLeaf(reader, offset, shape, ARRAYS[kind])
    if header.order == ">":  # (llama.cpp swaps a block's scales, not its packed values: no rule to read it by)
        return _leaf.Unreadable(f"a {type_name(kind)} tensor {list(shape)}", "quantized blocks of a big-endian file")
    return QuantizedLeaf(reader, offset, shape, kind, header.sizes[kind], name)


class _Header:
    """The parsed header: ``metadata`` (key -> text), ``tensors`` ((name, dims, type,
    absolute offset)), ``sizes`` (type -> (block size, bytes per block)) and ``order``
    (``"<"``, or ``">"`` for a big-endian file: every number in it, header and tensors)."""

    def __init__(self, reader: Any):
        self._reader, self._size, self._file = reader, reader.size, reader.path
        file, size = self._file, self._size
        self._at, self._buffer, self._buffer_at = 0, b"", 0
        self._window = 64 << 10  # read ahead: 64 KiB first (over HTTP, most headers' whole), doubling to 4 MiB
        self.order = "<"
        if self._take(4) != MAGIC:
            raise FormatError("not a GGUF file: no GGUF magic", file=file)
        version = self._int("<I")
        if version & 0xFFFF == 0 and version >> 16:  # as gguf-py tells a big-endian file: its version byte-swapped
            self.order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in (2, 3):
            raise FormatError(f"GGUF version {version}; treecli reads versions 2 and 3", file=file)
        count, keys = self._int("<Q"), self._int("<Q")
        if count > MAX_TENSORS or keys > MAX_KEYS:
            raise FormatError(f"the header declares {count:,} tensors and {keys:,} metadata keys; refusing "
                              f"(at most {MAX_TENSORS:,} and {MAX_KEYS:,})", file=file)
        self.metadata: dict[str, MetaValue] = {}
        alignment = 32
        for _ in range(keys):
            key = self._string()
            kind = self._int("<I")
            value = self._value(kind, depth=0)
            if key in self.metadata:
                raise FormatError(f"metadata key {key[:60]!r} is given twice (gguf-py refuses it too)", file=file)
            if key == "general.alignment":
                if kind != 4 or value < 1 or value & (value - 1):
                    raise FormatError(f"general.alignment is {value!r}, not a power of two", file=file)
                alignment = value
            self.metadata[key] = MetaValue(kind, value)
        infos = [(self._string(), *self._tensor_info()) for _ in range(count)]
        names: set[str] = set()
        for name, dims, kind, _ in infos:
            if name in names:  # (gguf-py and llama.cpp refuse it: which one is meant?)
                raise FormatError("two tensors have this name", file=file, keypath=name)
            names.add(name)
            if not dims and kind not in ARRAYS:
                raise FormatError(f"a 0-d {type_name(kind)} tensor: quantized blocks need rows", file=file,
                                  keypath=name)
        start = -(-self._at // alignment) * alignment
        self.sizes = _sizes({kind for _, _, kind, _ in infos} - set(ARRAYS), file)
        self.tensors = []
        spans = []
        for name, dims, kind, offset in infos:
            nbytes = self._nbytes(name, dims, kind)
            if offset % alignment:
                raise FormatError(f"tensor data at offset {offset} is not aligned to {alignment}", file=file,
                                  keypath=name)
            if start + offset + nbytes > size:
                raise FormatError(f"the tensor's {nbytes} bytes at {start + offset} run past the end of the file "
                                  f"({size} bytes)", file=file, keypath=name)
            spans.append((offset, offset + nbytes, name))
            self.tensors.append((name, dims, kind, start + offset))
        spans.sort()
        for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
            if begin < end:
                raise FormatError(f"the data of {first} and {second} overlap", file=file, keypath=second)

    # --- reading, bounded by the file ----------------------------------------------------------

    def _take(self, n: int) -> bytes:
        import numpy as np

        if n < 0 or self._at + n > self._size:
            raise FormatError(f"the header runs past the end of the file (reading {n:,} bytes at {self._at:,} of "
                              f"{self._size:,})", file=self._file)
        local = self._at - self._buffer_at
        if local + n > len(self._buffer):  # the next window from here
            window = np.empty(min(max(n, self._window), self._size - self._at), np.uint8)
            self._window = min(self._window * 2, 4 << 20)
            self._reader.read_into(window, self._at)
            self._buffer, self._buffer_at, local = window.tobytes(), self._at, 0
        self._at += n
        return self._buffer[local:local + n]

    def _int(self, fmt: str) -> Any:
        fmt = self.order + fmt[1:]  # (every format here is written "<": the file's order decides)
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return self._take(self._int("<Q")).decode("utf-8", "replace")

    def _value(self, kind: int, depth: int) -> Any:
        """A value as Python holds it; an array as ``(item type, [items])``."""
        if kind in SCALARS:
            return self._int(SCALARS[kind][0])
        if kind == STRING:
            return self._string()
        if kind != ARRAY:
            raise FormatError(f"metadata value type {kind}, which GGUF does not define", file=self._file)
        if depth >= MAX_NESTING:
            raise FormatError(f"metadata arrays nested more than {MAX_NESTING} deep", file=self._file)
        item, count = self._int("<I"), self._int("<Q")
        if item in SCALARS:
            import numpy as np

            size = struct.calcsize(SCALARS[item][0])
            if count * size > self._size - self._at:
                raise FormatError(f"a metadata array of {count:,} items runs past the end of the file",
                                  file=self._file)
            return item, np.frombuffer(self._take(count * size), self.order + SCALARS[item][0][1:]).tolist()
        if count > self._size - self._at:  # every string or array takes at least 8 bytes
            raise FormatError(f"a metadata array of {count:,} items runs past the end of the file", file=self._file)
        return item, [self._value(item, depth + 1) for _ in range(count)]

    def _tensor_info(self) -> tuple[list[int], int, int]:
        n = self._int("<I")
        if n > MAX_DIMS:
            raise FormatError(f"a tensor of {n} dimensions; GGUF has at most 4", file=self._file)
        dims = [self._int("<Q") for _ in range(n)]
        return dims, self._int("<I"), self._int("<Q")

    def _nbytes(self, name: str, dims: list[int], kind: int) -> int:
        count = math.prod(dims)
        if count > self._size * 64:  # no encoding stores more than 64 elements per byte
            raise FormatError(f"a tensor of {count:,} elements in a file of {self._size:,} bytes", file=self._file,
                              keypath=name)
        if kind in ARRAYS:
            from treecli import _dtypes

            return count * _dtypes.itemsize(ARRAYS[kind])
        block, size = self.sizes[kind]
        if dims and dims[0] % block:
            raise FormatError(f"{type_name(kind)} stores blocks of {block}, but the rows hold {dims[0]} elements",
                              file=self._file, keypath=name)
        return count // block * size


def _sizes(kinds: set[int], file: str) -> dict[int, tuple[int, int]]:
    """(block size, bytes per block) of each quantized type, from the gguf package."""
    if not kinds:
        return {}
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    sizes = {}
    for kind in kinds:
        try:
            sizes[kind] = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise FormatError(f"tensor type {kind}, which ggml does not define", file=file) from None
    return sizes


class _BigEndianLeaf(FileArrayLeaf):
    """A float or integer tensor of a big-endian GGUF file, read in the machine's order."""

    __slots__ = ()
    reads_parts = False  # (read through read_flat, which swaps)
    fills_buffers = False

    @property
    def in_local_file(self) -> bool:
        return False  # (its bytes are not its values: never compared as bytes with another leaf's)

    def read_flat(self, start: int, stop: int):
        return super().read_flat(start, stop).byteswap()

    def read(self, index: Any = ()):
        return super().read(index).byteswap()


def quantizing(leaf: _leaf.ArrayLeaf, kind_name: str, mix: str | None = None) -> _leaf.ArrayLeaf:
    """``leaf`` to be written quantized (``q8_0``, ``q6_k``, ...), as llama.cpp quantizes
    weights: a leaf of two or more dimensions whose rows fill whole blocks (rows that do
    not fill a 256-value block fall back, Q6_K to Q8_0, Q5_K to Q5_1, Q4_K to Q5_0, Q3_K
    and Q2_K to Q4_0, IQ4_XS to IQ4_NL, as llama.cpp's quantizer falls back); any other leaf as it is. Its values are those a
    reader gets back: quantized, then dequantized. ``mix``: the llama.cpp mix that chose
    its type (``general.file_type``)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    kind = GGMLQuantizationType[kind_name.upper()]
    block, size = GGML_QUANT_SIZES[kind]
    if leaf.ndim >= 2 and leaf.shape[-1] % block and kind.name in _FALLBACKS:
        return quantizing(leaf, _FALLBACKS[kind.name], mix)
    if leaf.ndim < 2 or leaf.shape[-1] % block or not leaf.size:
        return leaf
    made = _Quantizing(leaf, int(kind), (block, size))
    made.mix = mix
    return made


# A K-quant whose blocks a tensor's rows cannot fill -> the type llama.cpp writes instead
# (``tensor_type_fallback`` in llama-quant.cpp)
_FALLBACKS = {"Q6_K": "q8_0", "Q5_K": "q5_1", "Q4_K": "q5_0", "Q3_K": "q4_0", "Q2_K": "q4_0", "IQ4_XS": "iq4_nl"}
# The types quantized by llama.cpp's reference quantizers: (one part's quantizer, each group's step
# from the blocks, values to a step)
_REFERENCE = {**_kquants.QUANTIZERS, "IQ4_NL": (_iquants.quantize_iq4_nl, _iquants.iq4_nl_steps, 32),
              "IQ4_XS": (_iquants.quantize_iq4_xs, _iquants.iq4_xs_steps, 32)}


def kept_quantized(tree: Any) -> Any:
    """``tree`` as a GGUF output holds it: a float32 leaf computed from quantized tensors of
    one type (an edit's ``--scale``, an average, a slice of whole blocks) quantized in that
    type again, where treecli quantizes it (``requantized``); any other leaf as it is."""
    from treecli import _tree

    def leaf(_keypath: tuple, value: Any) -> Any:
        kind = _quantized_origin(value)
        if kind is None or kind.lower() not in WRITTEN_QUANTIZATIONS:
            return value
        made = quantizing(value, kind.lower())
        if made is not value:
            made.requantized = True
        return made

    return _tree.map_leaves(leaf, tree)


def _quantized_origin(value: Any) -> str | None:
    """The type of the quantized tensors a float32 computed leaf is made from, where they are
    all of one type (and it reads from nothing else); else None."""
    if not isinstance(value, _leaf.ComputedLeaf) or value.dtype_name != "float32" or \
            getattr(value, "asked_dtype", False):
        return None
    kinds, pending = set(), list(value.inputs)
    while pending:
        source = pending.pop()
        if isinstance(source, QuantizedLeaf):
            kinds.add(source.stored_dtype)
        elif isinstance(source, _leaf.ComputedLeaf) and source.inputs:
            pending.extend(source.inputs)
        else:
            return None
    return kinds.pop() if len(kinds) == 1 else None


def unrequantized(tree: Any) -> dict[tuple[str, str], int]:
    """How many float32 leaves of ``tree`` made from quantized tensors a GGUF output writes as
    F32 (``kept_quantized`` left them), by that type and why: treecli does not write the
    type yet, or their rows are no longer whole blocks (a slice across them)."""
    from treecli import _tree

    found: dict[tuple[str, str], int] = {}
    for value in _tree.leaves(tree):
        kind = _quantized_origin(value)
        if kind is not None:
            why = f"its rows are not whole {kind} blocks" if kind.lower() in WRITTEN_QUANTIZATIONS else \
                f"treecli does not write {kind} yet"
            found[kind, why] = found.get((kind, why), 0) + 1
    return found


def _largest_error(data: Any, blocks: Any, kind: Any, step: Any, group: int) -> tuple[float, float]:
    """The largest error of quantized ``blocks`` against ``data``, in steps and in value,
    ``group`` values sharing a step; read back a few rows at a time (a whole embedding's
    float copies would take gigabytes)."""
    import numpy as np
    from gguf import quants

    rows = max(1, (1 << 18) // data.shape[1])
    in_steps = in_value = 0.0
    for start in range(0, data.shape[0], rows):
        error = quants.dequantize(blocks[start : start + rows], kind)
        error -= data[start : start + rows]
        np.abs(error, out=error)
        scale = step[start : start + rows].reshape(-1, 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            inverse = np.where(scale > 0, np.float32(1) / scale, np.float32(0))
            # (the largest over all values at once: a maximum per group, of 16 or 32 values, costs more)
            steps = float((error.reshape(-1, group) * inverse).max(initial=0.0))
        in_steps, in_value = max(in_steps, steps), max(in_value, float(error.max(initial=0.0)))
    return in_steps, in_value


class _Quantizing(QuantizedLeaf):
    """A float leaf quantized when written (its blocks computed whole, once per pass over
    them) and read back as its blocks dequantized: a verified output compares equal."""

    def __init__(self, source: _leaf.ArrayLeaf, kind: int, sizes: tuple[int, int]):
        super().__init__(None, 0, tuple(source.shape), kind, sizes)
        self._source = source
        self._blocks = None
        #: How far its values are from the source's, measured as its blocks are made: the
        #: largest error in units of the quantization step (a block's scale), and in value.
        self.error: tuple[float, float] | None = None
        #: Whether it is a quantized tensor's edited values quantized in its own type again
        #: (``kept_quantized``), not a float leaf quantized as asked (``quantized``).
        self.requantized = False
        #: The llama.cpp mix that chose its type (``q4_k_m``), where one did.
        self.mix: str | None = None

    @property
    def sources(self) -> tuple[str, ...]:
        return self._source.sources

    def blocks(self):
        import numpy as np
        from gguf import quants
        from gguf.constants import GGMLQuantizationType

        kind = GGMLQuantizationType(self.kind)
        data = np.asarray(self._source, np.float32).reshape(-1, self.shape[-1])

        def part_of(rows: Any) -> tuple[Any, tuple[float, float]]:
            """A part's blocks, and their largest error (in steps, in value)."""
            if kind.name in _REFERENCE:  # (llama.cpp's reference quantizers, byte for byte)
                quantize, steps_of, group = _REFERENCE[kind.name]
                blocks = quantize(rows).reshape(rows.shape[0], -1)
                step = steps_of(blocks)
            else:  # (the gguf package's; these types start a block with its scale, a float16 d: the step)
                blocks = quants.quantize(rows, kind)
                step, group = np.abs(blocks.reshape(-1, self._block_bytes)[:, :2].copy().view(np.float16).astype(
                    np.float32))[:, 0], self._block
            return blocks, _largest_error(rows, blocks, kind, step.reshape(rows.shape[0], -1), group)

        # parts of whole rows, about as many values as the K-quants take at once, on every core
        rows = max(1, _kquants.PART_VALUES // data.shape[1])
        made = _kquants.on_every_core(part_of, [data[start : start + rows] for start in range(0, data.shape[0], rows)])
        errors = [error for _, error in made]
        self.error = (max(e[0] for e in errors), max(e[1] for e in errors))
        return np.concatenate([blocks.reshape(-1) for blocks, _ in made])

    def read_raw(self, start: int, stop: int):
        if self._blocks is None:
            self._blocks = self.blocks()
        out = self._blocks[start:stop]
        if stop >= self.raw_nbytes:
            self._blocks = None
        return out
