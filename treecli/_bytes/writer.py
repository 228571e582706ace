"""Moving a leaf's bytes through a command, the writing side: the loop that writes one
leaf chunk by chunk, the hints that start the disk writing while more is produced, and
the read-back and digests that let an output be verified as it is written.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, BinaryIO, Callable

from treecli._bytes.stream import _pool, iter_chunks
from treecli._errors import TreecliError
from treecli._leaf import CHUNK_BYTES, ArrayLeaf, WholeLeaf


# Writers' file buffers: a checkpoint of many small leaves (an MoE model's 200k) is written in
# a call per MiB, not per 8 KiB (its conversion took 5.9-6.1 s so, 4.7 s with this); a chunk
# larger than the buffer goes to the file directly, not through it.
WRITE_BUFFER = 1 << 20

# Data written since the last hint, before the kernel is asked to start writing it
# to disk. Without hints a 1 GiB output stays dirty in memory (under the kernel's
# own threshold) and the final fsync then waits for all of it: `average` of
# 3 x 1 GiB spent 1.8 s in that fsync after 1.5 s of computing.
WRITEBACK_BYTES = 32 << 20


class Writeback:
    """Starts the disk writing a file's data while more is being produced.

    Call it after each write; every WRITEBACK_BYTES it hands what was written
    since to the kernel's writeback (posix_fadvise DONTNEED starts it). The same
    call covers the window before too: written back by then, its pages are clean
    and DONTNEED drops them, so a big output does not evict the inputs. (Pages
    still being written when first hinted are never dropped by that first hint.)

    With ``readback`` (a verified output), what was written is first read back from the
    cache, so that no byte is dropped before it is checked (:class:`ReadBack`).
    """

    def __init__(self, f: BinaryIO, readback: "FileReadBack | None" = None):
        self._f = f
        self.readback = readback
        self._previous = 0  # start of the window to hint from: the last one's
        self._hinted = 0  # end of the last window hinted
        self._enabled = hasattr(os, "posix_fadvise")

    def __call__(self) -> None:
        if not (self._enabled or self.readback):
            return
        try:
            end = self._f.tell()
        except (AttributeError, OSError, io.UnsupportedOperation):  # not a plain file (no read-back then)
            self._enabled = False
            return
        if end - self._hinted < WRITEBACK_BYTES:
            return
        if self.readback is not None:  # (done to the last hint's end first: the hint drops what lies before it)
            self.readback.read_behind(end)
        if self._enabled:
            try:
                self._f.flush()
                os.posix_fadvise(self._f.fileno(), self._previous, end - self._previous, os.POSIX_FADV_DONTNEED)
            except (AttributeError, OSError, io.UnsupportedOperation):  # not a plain file: only a hint is lost
                self._enabled = False
        self._previous, self._hinted = self._hinted, end


class ReadBack:
    """A verified output's bytes, read back from its files as they are written: each file a
    window at a time while the window is still cached (before :class:`Writeback` drops it),
    each leaf's bytes into a CRC-32 of their own, under where the writer put them.

    The check then compares those with the digests of the bytes the writer was given, at the
    places the output's own reader finds each leaf: the output is neither kept cached whole
    until the check (fresh page-cache pages cost this VM 0.4-2.4 s per GiB written, against
    0.3 s for the same pages dropped and reused) nor read again from the disk.
    """

    def __init__(self) -> None:
        # each leaf's, by where it lies: (device, inode, offset, bytes)
        self.leaves: dict[tuple[int, int, int, int], Digest] = {}
        self._files: list[FileReadBack] = []

    def file(self, f: BinaryIO) -> "FileReadBack":
        """The read-back of one output file, open for writing as ``f``. Writers write their
        files one after another: the files before it are finished (a sharded output of
        hundreds of files holds one descriptor for this at a time)."""
        self.finish()
        readback = FileReadBack(f, self.leaves)
        self._files.append(readback)
        return readback

    def finish(self) -> None:
        """Read back the rest of every file, written to its end (and still cached)."""
        try:
            for readback in self._files:
                readback.wait()
                readback.read_to(os.fstat(readback.fd).st_size)
        finally:
            self.close()

    def close(self) -> None:
        """Let go of the files (after a failed writing too: no read is left running)."""
        for readback in self._files:
            with contextlib.suppress(Exception):  # (a failure the writing's own error stands for)
                readback.wait()
            os.close(readback.fd)
        self._files.clear()


class FileReadBack:
    """One output file's part of a :class:`ReadBack`."""

    def __init__(self, f: BinaryIO, leaves: dict):
        self._f, self._leaves = f, leaves
        # The writer's descriptor may be write-only: reads go through one of their own,
        # to the file the writer has open (the same device and inode).
        written = os.fstat(f.fileno())
        self.fd = os.open(f.name, os.O_RDONLY)
        if not os.path.samestat(os.fstat(self.fd), written):
            os.close(self.fd)
            raise TreecliError("internal error: the output changed while it was written", file=str(f.name))
        self._identity = (written.st_dev, written.st_ino)
        self._read = 0  # read back up to here
        self._ranges: list[list] = []  # [start, end (None while written), digest] not yet read back whole
        self._lock = threading.Lock()  # the ranges: added by the writer, read back on the helper
        self._pending: Future | None = None
        self._buffer: Any = None

    def begin(self, leaf: ArrayLeaf, start: int = 0) -> None:
        """A leaf's bytes start here; their digest runs on from the CRC ``start``."""
        if leaf.nbytes:  # (an empty leaf has no bytes to read back)
            digest, offset = Digest(start), self._f.tell()
            with self._lock:
                self._ranges.append([offset, None, digest])
            self._leaves[(*self._identity, offset, leaf.nbytes)] = digest

    def end(self, leaf: ArrayLeaf) -> None:
        """The bytes of the leaf ``begin`` was last called for end here."""
        if leaf.nbytes:
            with self._lock:
                self._ranges[-1][1] = self._f.tell()

    def read_behind(self, end: int) -> None:
        """Read the file back up to ``end`` on a helper thread, beside the writing, once the
        last such read is done (what it covered may then be dropped)."""
        self._f.flush()
        self.wait()
        self._pending = _pool("readback").submit(self.read_to, end)

    def wait(self) -> None:
        """Wait for the read ``read_behind`` started; raise its failure."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def read_to(self, end: int) -> None:
        """Read the file back up to ``end``, taking each leaf's bytes into its digest."""
        import numpy as np

        if self._buffer is None:
            self._buffer = np.empty(CHUNK_BYTES, np.uint8)
        while self._read < end:
            try:
                n = os.preadv(self.fd, [self._buffer[: min(CHUNK_BYTES, end - self._read)]], self._read)
            except OSError as e:  # EIO from a failing disk: the output's, named as such
                raise TreecliError(f"cannot read the output back at byte {self._read}: {e.strerror or e}",
                                   file=str(self._f.name)) from e
            if n == 0:
                raise TreecliError(f"the output ended at byte {self._read} while it was read back",
                                   file=str(self._f.name))
            low, high = self._read, self._read + n
            with self._lock:
                ranges = [r for r in self._ranges if r[0] < high and (r[1] is None or r[1] > low)]
            for start, stop, digest in ranges:
                digest.update(self._buffer[max(start, low) - low : (high if stop is None else min(stop, high)) - low])
            with self._lock:
                self._ranges = [r for r in self._ranges if r[1] is None or r[1] > high]
            self._read = high


def drop_cached(path: Path) -> None:
    """Drop the cached pages of a written output (a file, or the files under a directory),
    once it has been read back: clean after its fsync, they would only evict other pages."""
    if not hasattr(os, "posix_fadvise"):
        return
    files = [path] if path.is_file() else [Path(root) / name for root, _, names in os.walk(path) for name in names]
    for file in files:
        try:
            fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # a link or a file gone: nothing of ours to drop
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Digest:
    """A checksum of a byte stream: its length and CRC-32. CRC-32 catches every burst of up
    to 32 bits and misses other damage once in 4 billion. ISA-L's (carry-less multiply,
    26 GB/s here, and it lets go of the GIL) rather than zlib's (4 GB/s): zip members need
    one CRC of every byte written, and verification one more of every byte read back, so
    zlib's was 0.5 s of every verified GiB written as npz."""

    __slots__ = ("length", "crc", "start")  # one a leaf: 200k for a big header

    def __init__(self, start: int = 0) -> None:
        self.length, self.crc, self.start = 0, start, start  # ``start``: the CRC this one runs on from

    def update(self, data: Any) -> None:
        self.length += len(data)
        self.crc = _crc32()(data, self.crc)

    def value(self) -> tuple[int, int, int]:
        return self.length, self.crc, self.start


@functools.cache
def _crc32() -> Callable[[Any, int], int]:
    """ISA-L's CRC-32, imported on first use (3.6 ms, which ``show`` need not pay), then
    found in 0.1 µs: a ``from`` import per call took 0.6 µs, per leaf of a 200k-leaf file."""
    from isal.isal_zlib import crc32

    return crc32


def digest_of(leaf: ArrayLeaf, start: int = 0) -> tuple[int, int, int]:
    """The :class:`Digest` of a leaf's bytes as ``write_leaf`` writes them, from ``start``."""
    digest = Digest(start)
    for chunk in iter_chunks(leaf):
        digest.update(stored_bytes(chunk))
    return digest.value()


def stored_bytes(chunk: Any) -> Any:
    """A chunk's bytes as files store them: little-endian, C order."""
    import numpy as np

    if chunk.dtype.byteorder == ">":
        chunk = chunk.astype(chunk.dtype.newbyteorder("<"))
    return np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)


class RangeWriteback:
    """:class:`Writeback` for a file written by positional writes at rising offsets from
    ``start`` (one process's share of a file written together)."""

    def __init__(self, fd: int, start: int):
        self._fd = fd
        self._previous = self._hinted = start

    def __call__(self, end: int) -> None:
        if end - self._hinted < WRITEBACK_BYTES or not hasattr(os, "posix_fadvise"):
            return
        with contextlib.suppress(OSError):  # only a hint is lost
            os.posix_fadvise(self._fd, self._previous, end - self._previous, os.POSIX_FADV_DONTNEED)
        self._previous, self._hinted = self._hinted, end


def write_range(fd: int, leaf: ArrayLeaf, offset: int, begin: int, end: int, writeback: RangeWriteback,
                progress: Callable[[int], None] | None = None) -> None:
    """Write the elements of ``leaf`` whose first byte falls in the file's bytes ``[begin,
    end)``, the leaf stored at ``offset``, by positional writes a chunk at a time: the
    share one process of several writes into a file they write together. Neighbouring
    ranges take every element exactly once."""
    for start, stop in _chunks_within(leaf, offset, begin, end):
        raw = stored_bytes(leaf.read_flat(start, stop))
        view, at = memoryview(raw), offset + start * leaf.itemsize
        while view:
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n
        writeback(at)
        if progress:
            progress(raw.nbytes)


def same_range(fd: int, leaf: ArrayLeaf, offset: int, begin: int, end: int) -> bool:
    """Whether the file holds, in ``[begin, end)``, the bytes :func:`write_range` writes there."""
    for start, stop in _chunks_within(leaf, offset, begin, end):
        expected = stored_bytes(leaf.read_flat(start, stop))
        if os.pread(fd, expected.nbytes, offset + start * leaf.itemsize) != expected.tobytes():
            return False
    return True


def _chunks_within(leaf: ArrayLeaf, offset: int, begin: int, end: int) -> list[tuple[int, int]]:
    """Element ranges, a chunk each, of the elements whose first byte lies in ``[begin, end)``."""
    size = leaf.itemsize
    first = min(leaf.size, max(0, -(-(begin - offset) // size)))
    last = min(leaf.size, max(0, -(-(end - offset) // size)))
    step = max(1, CHUNK_BYTES // size)
    return [(start, min(last, start + step)) for start in range(first, last, step)]


def write_leaf(f: BinaryIO, leaf: ArrayLeaf, *, file: str, keypath: str = "",
               writeback: Writeback | None = None, progress: Callable[[int], None] | None = None,
               digests: dict[int, tuple[ArrayLeaf, tuple[int, int, int]]] | None = None,
               checksum: Digest | None = None, record: Any = None) -> None:
    """Write a leaf's bytes (little-endian, C order) to ``f`` a chunk at a time, the next
    chunk read while this one is written. ``writeback`` is called after each chunk
    (a :class:`Writeback`), ``progress`` with each chunk's byte count. With ``digests``,
    the digest of what was written is recorded under the leaf's ``id`` (with the leaf, so
    that the id stays its own) for a verification to check the output against: every
    leaf's where the output is read back as written (the writeback's :class:`ReadBack`),
    else a leaf's that is costly to read again (one read whole: an Orbax array), instead of
    reading the source a second time. ``checksum``, when given, takes in the bytes written
    (a zip member's CRC-32). ``record``, when given (a ``formats._record.Record``), takes
    the digest of the tensor written, and where it lies."""
    readback = writeback.readback if writeback is not None else None
    recorded = digests is not None and (readback is not None or isinstance(leaf, WholeLeaf))
    # A zip member's CRC-32 runs on over the leaf's bytes: the leaf's own digest is that one,
    # from where it stands before them (one CRC pass over the bytes, not two).
    digest = (checksum if checksum is not None else Digest()) if recorded else None
    start = digest.crc if digest is not None else 0
    sums: list[Any] = [checksum] if checksum is not None else [digest] if digest is not None else []
    hashed = record.start(leaf) if record is not None else None
    if hashed is not None:
        sums.append(hashed)
    place = file_place(f) if record is not None else None

    def take_in(chunk: Any) -> None:
        raw = stored_bytes(chunk)
        for d in sums:
            d.update(raw)

    written = 0
    if readback is not None:
        readback.begin(leaf, start)
    # Checksums are taken on the reading thread, beside this one's writing: on this thread
    # they were a third of a verified Orbax conversion, and zip's CRC a third of an npz's.
    for chunk in iter_chunks(leaf, each=take_in if sums else None):
        if chunk.dtype != leaf.dtype:
            raise TreecliError(f"internal error: a chunk came back as {chunk.dtype}, expected {leaf.dtype}",
                               file=file, keypath=keypath)
        raw = stored_bytes(chunk)
        f.write(raw)
        if writeback:
            writeback()
        written += raw.nbytes
        if progress:
            progress(raw.nbytes)
    if written != leaf.nbytes:
        raise TreecliError(f"internal error: wrote {written} bytes, expected {leaf.nbytes}", file=file,
                           keypath=keypath)
    if readback is not None:
        readback.end(leaf)
    if digest is not None:
        digests[id(leaf)] = (leaf, (written, digest.crc, start))
    if record is not None:
        record.wrote(leaf, hashed, place)


def file_place(f: BinaryIO) -> tuple[int, int, int] | None:
    """Where the next byte written to ``f`` lands: (device, inode, offset); None for a stream
    that is no file (an upload)."""
    try:
        info = os.fstat(f.fileno())
        return info.st_dev, info.st_ino, f.tell()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None
