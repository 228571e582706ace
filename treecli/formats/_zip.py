"""Zips of stored (uncompressed) members: where a member's bytes start (npz, PyTorch), and
writing a zip as ``numpy.savez`` lays one out and as ``zipfile`` writes it: each
member's local header, its bytes, then the central directory, with zip64 records where
a size, an offset or the count needs them.

Why not ``zipfile``'s writer: it takes each member's CRC-32 on the thread that writes
(0.27 s per GiB here). A member written with :meth:`StoredZip.member` gets its CRC from
the caller, who takes it on the reading thread, beside the writing.
"""

from __future__ import annotations

import contextlib
import io
import os
import struct
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from treecli._bytes.local import open_regular
from treecli._bytes.writer import Digest
from treecli._errors import FormatError, TreecliError

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_END = struct.Struct("<IHHHHIIH")
_END64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64 = struct.Struct("<IIQI")
_CRC_AT = 14  # the CRC-32's place in a local header
# zipfile's limits: past them a member (or the archive) takes zip64 records.
ZIP64_LIMIT = (1 << 31) - 1
COUNT_LIMIT = (1 << 16) - 1
_UTF8 = 0x800  # flag: the name is UTF-8
_MADE_BY = (3 << 8) | 20  # Unix, zip 2.0 (zipfile's on Linux)
_PERMISSIONS = 0o600 << 16  # rw-------, as zipfile gives a member written from bytes


class StoredZip:
    """Members of known size, each a local header and the caller's bytes; :meth:`close`
    writes the central directory. ``f`` is a seekable file positioned at the archive's
    start: the CRC goes into each local header once the member is written."""

    def __init__(self, f: BinaryIO, date_time: tuple[int, int, int, int, int, int]):
        year, month, day, hour, minute, second = date_time
        self._f = f
        self._date = (year - 1980) << 9 | month << 5 | day
        self._time = hour << 11 | minute << 5 | second // 2
        # (name, flags, crc, size, local header offset) of each member, in order
        self._members: list[tuple[bytes, int, int, int, int]] = []

    @contextlib.contextmanager
    def member(self, name: str, size: int) -> Iterator[Digest]:
        """Write a member of ``size`` bytes: its local header now, then whatever the
        caller writes to the file inside the block, which must also go through the
        yielded :class:`Digest` (on any thread, done by the block's end)."""
        encoded, flags = encoded_name(name)
        offset = self._f.tell()
        zip64 = size > ZIP64_LIMIT
        extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
        stored = 0xFFFFFFFF if zip64 else size
        self._f.write(_LOCAL.pack(0x04034B50, 45 if zip64 else 20, flags, 0, self._time, self._date, 0, stored,
                                  stored, len(encoded), len(extra)) + encoded + extra)
        checksum = Digest()
        start = self._f.tell()
        yield checksum
        end = self._f.tell()
        summed, crc = checksum.length, checksum.crc
        if end - start != size or summed != size:
            raise TreecliError(f"internal error: zip member {name!r} took {end - start} bytes and its checksum "
                               f"{summed}, expected {size}")
        self._f.seek(offset + _CRC_AT)
        self._f.write(struct.pack("<I", crc))
        self._f.seek(end)
        self._members.append((encoded, flags, crc, size, offset))

    def close(self) -> None:
        """Write the central directory and the end records."""
        directory_start = self._f.tell()
        for encoded, flags, crc, size, offset in self._members:
            fields = [v for v in (size, size) if size > ZIP64_LIMIT] + [offset] * (offset > ZIP64_LIMIT)
            extra = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""
            stored = 0xFFFFFFFF if size > ZIP64_LIMIT else size
            self._f.write(_CENTRAL.pack(
                0x02014B50, _MADE_BY, 45 if fields else 20, flags, 0, self._time, self._date, crc, stored, stored,
                len(encoded), len(extra), 0, 0, 0, _PERMISSIONS, 0xFFFFFFFF if offset > ZIP64_LIMIT else offset,
            ) + encoded + extra)
        directory_end = self._f.tell()
        count, length = len(self._members), directory_end - directory_start
        if count > COUNT_LIMIT or directory_start > ZIP64_LIMIT or length > ZIP64_LIMIT:
            self._f.write(_END64.pack(0x06064B50, _END64.size - 12, 45, 45, 0, 0, count, count, length,
                                      directory_start))
            self._f.write(_LOCATOR64.pack(0x07064B50, 0, directory_end, 1))
        self._f.write(_END.pack(0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF), min(length, 0xFFFFFFFF),
                                min(directory_start, 0xFFFFFFFF), 0))


def encoded_name(name: str) -> tuple[bytes, int]:
    """A member's name as the zip stores it, and its flags; a ValueError past the 65,535
    bytes a zip's name can take."""
    try:
        encoded, flags = name.encode("ascii"), 0
    except UnicodeEncodeError:
        encoded, flags = name.encode("utf-8"), _UTF8
    if len(encoded) > 0xFFFF:
        raise ValueError(f"a zip member's name takes at most 65,535 bytes; this one takes {len(encoded):,}")
    return encoded, flags


class SourceFile(io.RawIOBase):
    """Bytes ``[start, start + length)`` of a byte source (``treecli._bytes``: a local
    file, an HTTP or bucket object) as a file for ``zipfile``: each read a byte range, so
    that a zip is read where it lies, only its directory and the members asked for (a
    remote ``.bin``, a chunk inside a PyTorch distributed checkpoint's file)."""

    def __init__(self, source: Any, start: int, length: int):
        self._source, self._start, self._length, self._at = source, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = 0) -> int:
        self._at = max(0, offset if whence == 0 else self._at + offset if whence == 1 else self._length + offset)
        return self._at

    def readinto(self, buffer: Any) -> int:
        import numpy as np

        n = max(0, min(len(buffer), self._length - self._at))
        if n:
            data = np.empty(n, np.uint8)
            self._source.read_into(data, self._start + self._at)
            memoryview(buffer)[:n] = data
        self._at += n
        return n


def stored_member_offset(source: Any, info: zipfile.ZipInfo, base: int = 0) -> int:
    """Where a stored member's bytes start: after its local file header, which must name
    the member as the central directory does (zipfile, and so np.load, checks that too).
    ``source``: a local file's path (read as metadata, apart from the data reads a
    verification watches), or a byte source; ``base``: where the zip starts in it."""
    def read(offset: int, n: int) -> bytes:
        if isinstance(source, Path):
            with open_regular(source) as f:
                return os.pread(f.fileno(), n, offset)
        import numpy as np

        out = np.empty(n, np.uint8)
        source.read_into(out, offset)
        return out.tobytes()

    name = str(source) if isinstance(source, Path) else source.path
    local = read(base + info.header_offset, 30)
    if len(local) < 30 or local[:4] != b"PK\x03\x04":
        raise FormatError(f"bad local header for member {info.filename!r}", file=name)
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    local_name = read(base + info.header_offset + 30, name_len)
    encoding = "utf-8" if info.flag_bits & 0x800 else "cp437"
    if local_name != info.orig_filename.encode(encoding, "surrogateescape"):
        raise FormatError(f"member {info.filename!r} is named {local_name!r} in its local header", file=name)
    return base + info.header_offset + 30 + name_len + extra_len
