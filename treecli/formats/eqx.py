"""Equinox ``.eqx`` files (``eqx.tree_serialise_leaves``) and plain ``.npy`` files.

An ``.eqx`` file is the model's array leaves saved one after another with
``np.save``: bare ``.npy`` records, no names (those live in the model's code,
which treecli does not have). It opens as an unnamed sequence ``[0]``, ``[1]``,
... of lazy leaves read from each record's header; a ``.npy`` file is a
sequence of one. Read-only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from treecli import _dtypes
from treecli._errors import FormatError, RefusedError
from treecli.formats import _npy
from treecli.formats._base import Checkpoint
from treecli.formats._filedata import FileArrayLeaf, FileReader, identity, open_regular


class _Format:
    name = "eqx"
    extensions = (".eqx", ".npy")
    separator = None

    def sniff(self, path: Path) -> str | None:
        if path.is_dir():
            return "a directory"
        with open_regular(path) as f:
            return None if f.read(6) == _npy.MAGIC else "does not start with a .npy record"

    def open(self, path: Path, **_: Any) -> Checkpoint:
        return _open(Path(path))


FORMAT = _Format()


def _open(path: Path) -> Checkpoint:
    file = str(path)
    leaves = []
    offset = 0
    with open_regular(path) as f:
        info = os.fstat(f.fileno())
        size = info.st_size
        reader = FileReader(file, identity(info))
        while offset < size:
            where = f"record [{len(leaves)}] at byte {offset}"
            f.seek(offset)
            try:
                header = _npy.parse(f.read(_npy.PREFIX))
            except ValueError as e:
                raise FormatError(f"{where}: {e}", file=file) from None
            if header.dtype.hasobject:
                raise RefusedError(f"refused: {where} holds Python objects, and loading them unpickles", file=file)
            if header.dtype.kind != "V" and not _dtypes.is_known(header.dtype_name):
                raise FormatError(f"{where} holds {header.dtype} values, not numbers", file=file)
            if header.fortran or header.dtype.byteorder == ">":
                raise FormatError(f"{where}: Fortran-order or big-endian records are not supported", file=file)
            data = offset + header.data_offset
            if data + header.nbytes > size:
                raise FormatError(f"file is truncated: {where} declares data through byte {data + header.nbytes}, "
                                  f"but the file is only {size} bytes", file=file)
            leaves.append(FileArrayLeaf(reader, data, header.shape, header.dtype_name))
            offset = data + header.nbytes
    checkpoint = Checkpoint(tree=leaves, format="eqx", file=file)
    checkpoint._closers.append(reader.close)
    if path.suffix == ".eqx":
        checkpoint.warnings.append("an .eqx file stores leaves without names: they are shown as [0], [1], ... in "
                                   "the model's own order (the names live in the model's code)")
    return checkpoint
