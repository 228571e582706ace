"""Equinox ``.eqx`` files (``eqx.tree_serialise_leaves``) and plain ``.npy`` files.

An ``.eqx`` file is the model's array leaves saved one after another with
``np.save``: bare ``.npy`` records, no names (those live in the model's code,
which treecli does not have). It opens as an unnamed sequence ``[0]``, ``[1]``,
... of lazy leaves read from each record's header; a ``.npy`` file is a
sequence of one. Read-only.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

from treecli._errors import FormatError, RefusedError
from treecli.formats._base import Checkpoint
from treecli.formats._filedata import FileArrayLeaf, FileReader
from treecli.formats.npz import _MAX_HEADER, _parse_header

_MAGIC = b"\x93NUMPY"


class _Format:
    name = "eqx"
    extensions = (".eqx", ".npy")
    separator = None

    def sniff(self, path: Path) -> str | None:
        if path.is_dir():
            return "a directory"
        with open(path, "rb") as f:
            return None if f.read(6) == _MAGIC else "does not start with a .npy record"

    def open(self, path: Path, **_: Any) -> Checkpoint:
        return _open(Path(path))


FORMAT = _Format()


def _open(path: Path) -> Checkpoint:
    import numpy as np

    file = str(path)
    size = os.stat(path).st_size
    reader = FileReader(file)
    leaves = []
    offset = 0
    with open(path, "rb") as f:
        while offset < size:
            where = f"record [{len(leaves)}] at byte {offset}"
            head = f.read(12)
            if head[:6] != _MAGIC or len(head) < 12:
                raise FormatError(f"{where} is not a .npy record (or is truncated)", file=file)
            major = head[6]
            if major == 1:
                header_len, start = struct.unpack("<H", head[8:10])[0], 10
            elif major in (2, 3):
                header_len, start = struct.unpack("<I", head[8:12])[0], 12
            else:
                raise FormatError(f"{where}: unknown .npy version {major}", file=file)
            if header_len > _MAX_HEADER:
                raise FormatError(f"{where}: header of {header_len} bytes is too large", file=file)
            f.seek(offset + start)
            text = f.read(header_len)
            try:
                descr, fortran, shape = _parse_header(text.decode("latin1" if major < 3 else "utf8"))
                dtype = np.dtype(np.lib.format.descr_to_dtype(descr))
            except (ValueError, TypeError, UnicodeDecodeError) as e:
                raise FormatError(f"{where}: bad header: {e}", file=file) from None
            if dtype.hasobject:
                raise RefusedError(f"refused: {where} holds Python objects, and loading them unpickles", file=file)
            if fortran or dtype.byteorder == ">":
                raise FormatError(f"{where}: Fortran-order or big-endian records are not supported", file=file)
            data = offset + start + header_len
            nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize if shape else dtype.itemsize
            if data + nbytes > size:
                raise FormatError(f"file is truncated: {where} declares data through byte {data + nbytes}, "
                                  f"but the file is only {size} bytes", file=file)
            name = f"V{dtype.itemsize}" if dtype.kind == "V" else dtype.name
            leaves.append(FileArrayLeaf(reader, data, tuple(shape), name))
            offset = data + nbytes
            f.seek(offset)
    checkpoint = Checkpoint(tree=leaves, format="eqx", file=file)
    checkpoint._closers.append(reader.close)
    if path.suffix == ".eqx":
        checkpoint.warnings.append("an .eqx file stores leaves without names: they are shown as [0], [1], ... in "
                                   "the model's own order (the names live in the model's code)")
    return checkpoint
