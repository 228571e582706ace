"""Leaves stored as contiguous C-order bytes at an offset of a byte source (a local
file, or a remote object: see ``treecli._bytes``). ``read(index)`` reads only the
byte ranges the index touches (coalesced where the waste is small).
"""

from __future__ import annotations

import math
from typing import Any

from treecli import _dtypes, _index
from treecli._bytes import Source
from treecli._bytes.local import FileReader
from treecli._leaf import CHUNK_BYTES, ArrayLeaf


class FileArrayLeaf(ArrayLeaf):
    """A leaf of ``shape`` and ``dtype`` stored in C order at ``offset`` of a file."""

    __slots__ = ("reader", "offset", "shape", "dtype_name")  # 200k-tensor headers: keep leaves small
    fills_buffers = True
    reads_parts = True

    def __init__(self, reader: Source, offset: int, shape: tuple[int, ...], dtype_name: str):
        self.reader = reader
        self.offset = offset
        # 200k of these for a big header: no call where the header's types already fit
        self.shape = shape if type(shape) is tuple else tuple(shape)
        self.dtype_name = dtype_name if type(dtype_name) is str else _dtypes.name(dtype_name)

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.reader.path,)

    @property
    def in_local_file(self) -> bool:
        return isinstance(self.reader, FileReader)

    def read_flat(self, start: int, stop: int):
        import numpy as np

        out = np.empty(max(0, stop - start), self.dtype)
        if out.size:
            self.reader.read_into(out, self.offset + start * self.itemsize)
        return out

    def read_into(self, start: int, stop: int, out) -> None:
        if stop > start:
            self.reader.read_into(out, self.offset + start * self.itemsize)

    def read(self, index: Any = ()):
        import numpy as np

        if not isinstance(index, tuple):
            index = (index,)
        final_shape = _index.result_shape(self.shape, index)
        sels = _index.selectors(self.shape, index)
        out = np.empty([len(s) for s in sels if isinstance(s, range)], self.dtype)
        if out.size:
            _fill(self.reader, self.offset, self.shape, sels, out, self.itemsize)
        return out.reshape(final_shape)


def _fill(reader: Source, offset: int, shape: tuple, sels: list, out, itemsize: int) -> None:
    """Fill ``out`` with the selection ``sels`` of the C-order region at ``offset``."""
    import numpy as np

    # Trailing axes taken whole form one contiguous block per outer position.
    k = len(sels)
    while k > 0 and isinstance(sels[k - 1], range) and sels[k - 1] == range(0, shape[k - 1]):
        k -= 1
    if k == 0:
        reader.read_into(out, offset)
        return
    row_bytes = math.prod(shape[1:]) * itemsize
    first = sels[0]
    if isinstance(first, int):
        _fill(reader, offset + first * row_bytes, shape[1:], sels[1:], out, itemsize)
        return
    if k == 1 and first.step == 1:
        reader.read_into(out, offset + first.start * row_bytes)
        return
    needed_per_row = math.prod(len(s) for s in sels[1:] if isinstance(s, range)) * itemsize
    stride_bytes = row_bytes * abs(first.step)
    if stride_bytes <= 4 * max(needed_per_row, 64 << 10):
        # Read spans of whole rows (little waste) and index them in memory.
        rows_per_batch = max(1, CHUNK_BYTES // stride_bytes)
        inner = tuple(s if isinstance(s, int) else slice(s.start, s.stop if s.stop >= 0 else None, s.step)
                      for s in sels[1:])
        for b in range(0, len(first), rows_per_batch):
            batch = first[b : b + rows_per_batch]
            lo, hi = min(batch[0], batch[-1]), max(batch[0], batch[-1])
            span = np.empty((hi - lo + 1,) + tuple(shape[1:]), out.dtype)
            reader.read_into(span, offset + lo * row_bytes)
            stop = batch[-1] - lo + (1 if first.step > 0 else -1)
            local = slice(batch[0] - lo, stop if stop >= 0 else None, first.step)
            out[b : b + len(batch)] = span[(local,) + inner]
        return
    # Rows far apart or mostly unused: visit each selected row.
    for j, row in enumerate(first):
        _fill(reader, offset + row * row_bytes, shape[1:], sels[1:], out[j], itemsize)
