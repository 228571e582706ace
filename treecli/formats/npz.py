"""NumPy ``.npz``: a zip of ``.npy`` members, keys split on ``/`` into a tree.

Members stored uncompressed are read lazily with ``preadv`` at their offset in
the zip; compressed members (``np.savez_compressed``) are decompressed one leaf
at a time. Every member's header is validated before anything is allocated:
shape x itemsize must equal the member's declared size (a forged shape or a
zip bomb is an error, never an allocation), duplicate member names are refused,
and object arrays are refused because loading them unpickles.

NumPy has no names for bfloat16 or fp8 and saves them as raw void bytes
(``V2``); treecli writes the real dtypes to a ``__treecli__.json`` member and
restores them. A ``V`` member from elsewhere is shown as such, with a warning.

Written with ``_zip.StoredZip`` (stored members, as ``np.savez``), whose CRC-32s are
taken on the reading thread; read with ``zipfile``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import zipfile
import zlib
from pathlib import Path
from typing import Any, Iterator

from treecli import _dtypes, _leaf, _memory
from treecli._bytes import writer
from treecli._bytes.local import FileReader, identity, open_regular
from treecli._errors import FormatError, RefusedError, TreecliError
from treecli._keypath import format_keypath
from treecli.formats import _flatkeys, _npy, _zip
from treecli.formats._base import Checkpoint, Format, WriteOptions
from treecli.formats._filedata import FileArrayLeaf

MAX_METADATA_BYTES = 64 << 20
METADATA_MEMBER = "__treecli__.json"
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # so that two saves give identical bytes
# What zipfile raises on damaged archives: bad headers, CRC mismatches, truncated
# streams, unknown or encrypted compression, corrupt deflate data.
_ZIP_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, NotImplementedError, RuntimeError)


class NpzFormat(Format):
    """NumPy's ``.npz``: a zip of ``.npy`` members, keys joined with ``/``."""

    name = "npz"
    extensions = (".npz",)
    separator = "/"
    writable = True

    def sniff(self, path: Path) -> str | None:
        if path.is_dir():
            return "a directory"
        try:
            with open_regular(path) as f:
                if f.read(4) != b"PK\x03\x04":
                    return "not a zip file"
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except _ZIP_ERRORS as e:
            return f"not a readable zip ({e})"
        if names and all(n.endswith(".npy") or n == METADATA_MEMBER for n in names):
            return None
        return "a zip without .npy members"

    def open(self, path: Path, *, like: Any = None, step: int | None = None) -> Checkpoint:
        return _open(Path(path))

    def write(self, tree: Any, target: Path, options: WriteOptions) -> None:
        if target.is_dir():
            raise TreecliError("npz output must be a file ending in .npz", file=str(target))
        _write(tree, target, options)


def _open(path: Path) -> Checkpoint:
    file = str(path)
    with open_regular(path) as f:
        file_identity = identity(os.fstat(f.fileno()))  # members are read from this same file later
        if f.read(4) != b"PK\x03\x04":  # what np.load looks for: a zip with data before it is no npz
            raise FormatError("not an npz: it does not start with a zip member (PK\\x03\\x04)", file=file)
        f.seek(0)
        try:
            archive = zipfile.ZipFile(f)
        except _ZIP_ERRORS as e:
            raise FormatError(f"not a readable zip: {e}", file=file) from None
        return _open_archive(path, archive, file_identity)


def _open_archive(path: Path, archive: zipfile.ZipFile, file_identity: tuple) -> Checkpoint:
    file = str(path)
    with archive:
        infos = archive.infolist()
        names = [i.filename for i in infos]
        duplicates = sorted(n for n, count in collections.Counter(names).items() if count > 1)
        if duplicates:
            raise FormatError(f"duplicate member names: {', '.join(duplicates)}", file=file)
        if not any(name.endswith(".npy") for name in names):
            raise FormatError("no arrays: the zip holds no .npy members", file=file)
        real_dtypes = {}
        if METADATA_MEMBER in names:
            try:
                with archive.open(METADATA_MEMBER) as member:  # (at most what any real one needs, inflated)
                    text = member.read(MAX_METADATA_BYTES + 1)
                if len(text) > MAX_METADATA_BYTES:
                    raise ValueError("too long")
                real_dtypes = json.loads(text).get("dtypes", {})
                if not isinstance(real_dtypes, dict) or not all(isinstance(v, str) for v in real_dtypes.values()):
                    raise ValueError("dtypes is not an object of names")
            except (*_ZIP_ERRORS, AttributeError):
                raise FormatError(f"{METADATA_MEMBER} is damaged or not valid JSON", file=file) from None
        checkpoint = Checkpoint(tree=None, format="npz", file=file)
        reader = FileReader(file, file_identity)
        checkpoint._closers.append(reader.close)
        items = []
        void = []
        for info in infos:
            if info.filename == METADATA_MEMBER:
                continue
            if not info.filename.endswith(".npy"):
                checkpoint.warnings.append(f"ignoring member {info.filename!r}: not a .npy array")
                continue
            key = info.filename[: -len(".npy")]
            try:
                leaf = _member_leaf(path, archive, info, reader, real_dtypes.get(key), key)
            except _ZIP_ERRORS as e:
                raise FormatError(f"damaged zip member: {type(e).__name__}: {e}", file=file, keypath=key) from None
            except _NotNumbers as e:
                checkpoint.warnings.append(f"ignoring member {info.filename!r}: {e}")
                continue
            if leaf.dtype_name.startswith("V") and key not in real_dtypes:
                void.append((key, leaf.dtype_name))
            items.append((key, leaf))
        if void:
            checkpoint.warnings.append(
                f"{len(void)} members have raw void dtypes (e.g. {void[0][0]!r}: {void[0][1]}); NumPy writes "
                "bfloat16/fp8 this way and cannot say which, so they are shown as void")
    checkpoint.tree, warning = _flatkeys.nest(items, "/")
    if warning:
        checkpoint.warnings.append(warning)
    return checkpoint


class _NotNumbers(Exception):
    """A member holding strings, bytes or dates: skipped with a warning, never misread."""


def _member_leaf(path: Path, archive: zipfile.ZipFile, info: zipfile.ZipInfo, reader: FileReader,
                 real_dtype: str | None, key: str) -> _leaf.ArrayLeaf:
    file = str(path)
    with archive.open(info) as stream:
        head = stream.read(min(info.file_size, _npy.PREFIX))
    try:
        header = _npy.parse(head)
    except ValueError as e:
        raise FormatError(f"member is not a valid .npy array: {e}", file=file, keypath=key) from None
    dtype, shape, fortran, data_start = header.dtype, header.shape, header.fortran, header.data_offset
    if dtype.hasobject:
        raise RefusedError("refused: this member holds Python objects, and loading them unpickles (which can run "
                           "code); treecli never does", file=file, keypath=key)
    if data_start + header.nbytes != info.file_size:
        raise FormatError(f"header declares shape {list(shape)} of {dtype} ({header.nbytes} bytes), but the member "
                          f"holds {info.file_size - data_start} bytes of data", file=file, keypath=key)
    if real_dtype is not None and not _dtypes.is_known(real_dtype):
        raise FormatError(f"{METADATA_MEMBER} names dtype {real_dtype!r}, which is not a numeric dtype",
                          file=file, keypath=key)
    if dtype.kind != "V" and not _dtypes.is_known(header.dtype_name):
        raise _NotNumbers(f"an array of {dtype} ({'text' if dtype.kind in 'US' else 'not numbers'}), which "
                          "treecli does not read")
    name = real_dtype or header.dtype_name
    if real_dtype and _dtypes.itemsize(real_dtype) != dtype.itemsize:
        raise FormatError(f"{METADATA_MEMBER} says {real_dtype}, but the member stores {dtype.itemsize}-byte items",
                          file=file, keypath=key)
    native = dtype.byteorder in ("=", "|", "<")
    if info.compress_type == zipfile.ZIP_STORED and not fortran and native:
        return FileArrayLeaf(reader, _zip.stored_member_offset(path, info) + data_start, tuple(shape), name)
    if fortran:
        return _FortranMemberLeaf(reader, info, data_start, tuple(shape), dtype, name, key)
    return _StreamedMemberLeaf(reader, info, data_start, tuple(shape), dtype, name, key)


@contextlib.contextmanager
def _member_stream(reader: FileReader, info: zipfile.ZipInfo, key: str) -> Iterator[Any]:
    """A member's decompressed bytes as a stream, from the file whose directory was read."""
    try:
        with os.fdopen(reader.open_checked(), "rb") as f, zipfile.ZipFile(f) as z, z.open(info) as stream:
            yield stream
    except _ZIP_ERRORS as e:
        raise FormatError(f"cannot decompress the member: {e}", file=reader.path, keypath=key) from None


class _Member:
    """Where a member read through zipfile lies and how it is stored (a mixin of leaves)."""

    __slots__ = ()

    def __init__(self, reader: FileReader, info: zipfile.ZipInfo, data_start: int, shape: tuple, stored_dtype,
                 name: str, key: str):
        self._reader, self._info, self._start = reader, info, data_start
        self._stored, self._key = stored_dtype, key
        self.shape = shape
        self.dtype_name = name

    @property
    def sources(self) -> tuple[str, ...]:
        return (self._reader.path,)


class _StreamedMemberLeaf(_Member, _leaf.ArrayLeaf):
    """A compressed (or big-endian) C-order member, decompressed as a stream: chunks read
    in order cost one chunk of memory, however large the member inflates (a 3 MB npz
    may honestly hold a 3 GiB array); reading backwards starts the stream again."""

    def __init__(self, *member: Any):
        super().__init__(*member)
        self._lock = threading.Lock()
        self._open: contextlib.ExitStack | None = None
        self._stream = None
        self._position = 0  # the element the stream is at

    def read_flat(self, start: int, stop: int):
        import numpy as np

        with self._lock:
            if self._stream is None or start < self._position:
                self._restart()
            self._read_bytes((start - self._position) * self._stored.itemsize, keep=False)
            raw = self._read_bytes((stop - start) * self._stored.itemsize, keep=True)
            self._position = stop
            if stop >= self.size:
                self._close()
        array = np.frombuffer(raw, self._stored)
        if self._stored.byteorder == ">":
            array = array.astype(self._stored.newbyteorder("="))
        return array.view(self.dtype)

    def _restart(self) -> None:
        self._close()
        self._open = contextlib.ExitStack()
        self._stream = self._open.enter_context(_member_stream(self._reader, self._info, self._key))
        self._position = 0
        self._read_bytes(self._start, keep=False)

    def _read_bytes(self, n: int, keep: bool) -> bytes:
        parts = []
        while n > 0:
            try:
                block = self._stream.read(min(n, _leaf.CHUNK_BYTES))
            except _ZIP_ERRORS as e:
                self._close()
                raise FormatError(f"cannot decompress the member: {e}", file=self._reader.path,
                                  keypath=self._key) from None
            if not block:
                self._close()
                raise FormatError("the member ends before its declared shape", file=self._reader.path,
                                  keypath=self._key)
            n -= len(block)
            if keep:
                parts.append(block)
        return b"".join(parts)

    def _close(self) -> None:
        if self._open is not None:
            self._open.close()
        self._open = self._stream = None


class _FortranMemberLeaf(_Member, _leaf.WholeLeaf):
    """A Fortran-order member: reordered to C order whole, so it must fit in memory."""

    def load(self):
        import numpy as np

        available = _memory.available()
        if available is not None and 3 * self.nbytes > available:
            raise FormatError(f"a Fortran-order member of {self.nbytes / 2**30:.1f} GiB is reordered in memory, "
                              f"but {available / 2**30:.1f} GiB is available", file=self._reader.path,
                              keypath=self._key)
        with _member_stream(self._reader, self._info, self._key) as stream:
            stream.read(self._start)
            raw = stream.read(self._info.file_size - self._start)
        array = np.frombuffer(raw, self._stored).reshape(self.shape[::-1]).T
        array = np.ascontiguousarray(array).astype(self._stored.newbyteorder("="), copy=False)
        return array.reshape(-1).view(self.dtype)


# --- writing --------------------------------------------------------------------------------


def _write(tree: Any, target: Path, options: WriteOptions) -> None:
    import numpy as np

    entries, unsupported = [], []
    for key, keypath, leaf in _flatkeys.flatten_for_writing(tree, "/", str(target)):
        if _leaf.is_array(leaf):
            entries.append((key, _leaf.as_leaf(leaf)))
        else:
            unsupported.append(f"{format_keypath(keypath)} ({'None' if leaf is None else type(leaf).__name__})")
    options.refuse_or_drop(unsupported, "npz", str(target))
    if not entries:
        raise TreecliError("npz output would hold no arrays (a zip without .npy members is no npz treecli "
                           "reads); write safetensors or msgpack instead", file=str(target))
    for key, _ in entries:  # before a byte is written
        try:
            _zip.encoded_name(key + ".npy")
        except ValueError as e:
            raise TreecliError(f"npz cannot hold this key: {e}", file=str(target), keypath=key[:60] + "...") from None
    real_dtypes = {}
    with open(target, "wb", buffering=writer.WRITE_BUFFER) as f:
        archive = _zip.StoredZip(f, _FIXED_TIME)
        writeback = options.writeback(f)
        for key, leaf in entries:
            dtype = leaf.dtype
            if dtype.kind == "V" or _dtypes.needs_ml_dtypes(leaf.dtype_name):
                real_dtypes[key] = leaf.dtype_name
                descr = f"|V{dtype.itemsize}"
            else:
                descr = np.lib.format.dtype_to_descr(dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype)
            head = _npy.header(leaf, descr)
            with archive.member(key + ".npy", len(head) + leaf.nbytes) as checksum:
                _npy.write(f, leaf, head, file=str(target), keypath=key, writeback=writeback,
                           progress=options.progress, digests=options.digests, checksum=checksum)
        if real_dtypes:
            data = json.dumps({"dtypes": real_dtypes}, sort_keys=True).encode()
            with archive.member(METADATA_MEMBER, len(data)) as checksum:
                f.write(data)
                checksum.update(data)
        archive.close()
