"""``.npy`` records: the header parsed without eval and checked before anything is
allocated, and a leaf written as one record, streamed chunk by chunk. Shared by
npz (one record per zip member), eqx (records one after another in a file) and
``get -o leaf.npy``."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

MAGIC = b"\x93NUMPY"
MAX_HEADER = 10_000  # NumPy's own limit for .npy headers
PREFIX = MAX_HEADER + 12  # enough leading bytes to hold any header we accept


@dataclass(frozen=True)
class NpyHeader:
    dtype: Any  # a NumPy dtype
    shape: tuple[int, ...]
    fortran: bool
    data_offset: int  # from the start of the record to its data

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        # np.dtype("V2") parses back; the void dtype's .name ("void16") does not.
        return f"V{self.dtype.itemsize}" if self.dtype.kind == "V" else self.dtype.name


def parse(head: bytes) -> NpyHeader:
    """The header of the record that ``head`` (its first ``PREFIX`` bytes, or all of it) starts.

    Raises:
        ValueError: saying what is wrong (no magic, unknown version, a header too
            large or cut short, a malformed dict, an unknown dtype).
    """
    import numpy as np

    if len(head) < 10 or head[:6] != MAGIC:
        raise ValueError("not a .npy record: no .npy magic, or cut short")
    major = head[6]
    if major == 1:
        header_len, start = struct.unpack("<H", head[8:10])[0], 10
    elif major in (2, 3) and len(head) >= 12:
        header_len, start = struct.unpack("<I", head[8:12])[0], 12
    else:
        raise ValueError(f"unknown .npy version {major}, or cut short")
    if header_len > MAX_HEADER or start + header_len > len(head):
        raise ValueError(f"header of {header_len} bytes is too large or truncated")
    try:
        text = head[start : start + header_len].decode("latin1" if major < 3 else "utf8")
    except UnicodeDecodeError as e:
        raise ValueError(f"header is not text: {e}") from None
    descr, fortran, shape = _parse_dict(text)
    try:
        dtype = np.dtype(np.lib.format.descr_to_dtype(descr))
    except (TypeError, ValueError) as e:
        raise ValueError(f"unknown dtype {descr!r}: {e}") from None
    return NpyHeader(dtype, shape, fortran, start + header_len)


def _parse_dict(text: str) -> tuple[Any, bool, tuple[int, ...]]:
    """``{'descr': ..., 'fortran_order': ..., 'shape': (...)}`` with literal_eval, never eval."""
    import ast

    try:
        header = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError) as e:
        raise ValueError(f"unreadable header ({type(e).__name__})") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise ValueError("header is not {'descr', 'fortran_order', 'shape'}")
    shape = header["shape"]
    if not isinstance(shape, tuple) or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63
                                               for d in shape):
        raise ValueError(f"bad shape {shape!r}")
    if not isinstance(header["fortran_order"], bool):
        raise ValueError("fortran_order is not a bool")
    return header["descr"], header["fortran_order"], shape


def header(leaf: Any, descr: str | None = None) -> bytes:
    """An array leaf's record header, as ``np.save`` writes it: version 1.0, or 2.0 when
    it would not fit. ``descr`` overrides the dtype's own (npz stores bfloat16 as ``|V2``
    with its real dtype beside)."""
    import io

    import numpy as np

    fields = {"descr": descr or np.lib.format.dtype_to_descr(leaf.dtype), "fortran_order": False,
              "shape": tuple(leaf.shape)}
    out = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(out, fields)
    except ValueError:  # a header over 64 KiB needs format 2.0
        np.lib.format.write_array_header_2_0(out, fields)
    return out.getvalue()


def write(f: BinaryIO, leaf: Any, head: bytes, *, file: str, keypath: str = "",
          writeback: Callable[[], None] | None = None, progress: Callable[[int], None] | None = None,
          digests: dict | None = None, checksum: Any = None) -> None:
    """Write an array leaf as one record, as ``np.save`` lays it out: ``head`` (its
    :func:`header`), then the data in C order, streamed by ``_bytes.writer.write_leaf``
    (``writeback``, ``progress``, ``digests`` and ``checksum`` as there; the checksum takes
    in the header too)."""
    from treecli._bytes import writer

    f.write(head)
    if checksum is not None:
        checksum.update(head)
    writer.write_leaf(f, leaf, file=file, keypath=keypath, writeback=writeback, progress=progress, digests=digests,
                      checksum=checksum)
