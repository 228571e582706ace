"""Local files as a byte source: positionless ``preadv`` through a bounded pool of
descriptors, each descriptor's file checked to be the one first opened.

Reads use ``preadv`` into preallocated arrays rather than a memory map: no
double buffering, thread-safe without a shared file position, and no mapped
pages lingering in the RSS users see.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import stat
import threading
import weakref
from typing import BinaryIO, Iterator

from treecli import _gc
from treecli._errors import FormatError, TreecliError


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFDIR: "a directory"}


def special_kind(mode: int) -> str | None:
    """"a FIFO", "a socket", "a character device", "a block device" for such a file; else None."""
    return _KINDS.get(stat.S_IFMT(mode)) if stat.S_IFMT(mode) != stat.S_IFDIR else None


def refuse_special(path: str | os.PathLike, mode: int) -> None:
    """Only regular files are read: a FIFO would block forever and /dev/zero never ends."""
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise FormatError(f"is {kind}; treecli reads only regular files", file=str(path))


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """Open an input file for reading, refusing at once anything but a regular file
    (without blocking: opening a FIFO would wait for a writer)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        refuse_special(path, os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


MAX_TEXT_BYTES = 64 << 20  # JSON metadata and shard indexes are far smaller


def read_text(path: str | os.PathLike, limit: int = MAX_TEXT_BYTES, what: str = "metadata file") -> str:
    """A small text file (JSON metadata, a shard index) as UTF-8, from a regular file only,
    of at most ``limit`` bytes: never more is read, whatever the file holds."""
    from treecli._bytes import small_text

    with open_regular(path) as f:
        return small_text(f.read(limit + 1), limit, str(path), what)


def identity(info: os.stat_result) -> tuple[int, int, int, int]:
    """What says a file is still the one whose header was validated: device, inode, size, mtime."""
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


# Direct I/O's alignment of addresses, offsets and sizes: the largest logical block size in use.
DIRECT_ALIGN = 4096


class FileReader:
    """An input file read with positionless ``preadv``, through a bounded pool of descriptors.

    Data is read only from the file whose header was validated: every time a
    descriptor is opened its identity (device, inode, size, mtime) is checked
    against the one recorded then, so a shard replaced or rewritten while a
    command runs is an error, never names from one file and bytes from another.
    """

    @classmethod
    def opened(cls, path: str | os.PathLike) -> "FileReader":
        """The reader of a regular file (a FIFO or a device is refused), its identity taken now."""
        with open_regular(path) as f:
            return cls(str(path), identity(os.fstat(f.fileno())))

    def __init__(self, path: str, file_identity: tuple[int, int, int, int] | None = None):
        self.path = str(path)
        self.identity = file_identity if file_identity is not None else identity(os.stat(self.path))
        self.bytes_read = 0
        self.token = next(_tokens)  # the pool's name for it: the pool holds no reference to the reader
        # A tree from treecli.load() is often just dropped, never closed: its descriptor goes with it.
        weakref.finalize(self, _POOL.collected, self.token)

    @property
    def size(self) -> int:
        """The file's size when its identity was taken (as a remote source's ``size``)."""
        return self.identity[2]

    def open_checked(self) -> int:
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)  # never blocks, even if a FIFO took its place
        if identity(os.fstat(fd)) != self.identity:
            os.close(fd)
            raise FormatError("the file changed since it was opened (replaced or rewritten); run the command "
                              "again", file=self.path)
        return fd

    def read(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` (fewer where the file ends), as a remote source's
        ``read``: a header is parsed the same way from any place. (Not counted in
        ``bytes_read``, which counts the data leaves read.)"""
        with _POOL.descriptor(self) as fd:
            try:
                data = os.pread(fd, size, offset)
            except OSError as e:
                raise TreecliError(f"cannot read {size} bytes at byte {offset}: {e.strerror or e}",
                                   file=self.path) from e
        return data

    def read_into(self, buffer, offset: int) -> None:
        """Fill a C-contiguous NumPy array with the bytes at ``offset``."""
        self.read_view(memoryview(buffer.reshape(-1).view("uint8")), offset)

    def read_view(self, view: memoryview, offset: int) -> None:
        """Fill a writable byte buffer (``bytearray``, or a memoryview of one) with the bytes at ``offset``."""
        view = memoryview(view)  # (slices of it are views, not copies)
        with _POOL.descriptor(self) as fd:
            done = 0
            while done < len(view):
                try:
                    n = os.preadv(fd, [view[done:]], offset + done)
                except OSError as e:  # EIO from a failing disk: the input's fault, named as such
                    raise TreecliError(f"cannot read {len(view)} bytes at byte {offset + done}: "
                                       f"{e.strerror or e}", file=self.path) from e
                if n == 0:
                    raise FormatError(
                        f"file ended at byte {offset + done} while reading {len(view)} bytes at {offset}"
                        " (was it truncated while open?)",
                        file=self.path,
                    )
                done += n
        self.bytes_read += done

    def will_need(self, offset: int, size: int) -> None:
        """Tell the kernel that ``size`` bytes at ``offset`` will be read soon: it reads them
        into the page cache in large requests of its own, ahead of the reads (which several
        threads make of one run, in no order its readahead would follow)."""
        if hasattr(os, "posix_fadvise"):
            with _POOL.descriptor(self) as fd, contextlib.suppress(OSError):  # (only a hint is lost)
                os.posix_fadvise(fd, offset, size, os.POSIX_FADV_WILLNEED)

    def read_direct(self, buffer, offset: int) -> int:
        """Read with direct I/O, past the page cache (neither needing it nor filling it), into
        ``buffer`` (a NumPy array whose address, like ``offset`` and its size, is a multiple of
        the block size ``DIRECT_ALIGN``); returns the bytes read, fewer where the file ends.

        Raises:
            OSError: the file system does not take direct I/O (tmpfs), or not so aligned: the
                caller reads through the cache instead.
            FormatError: the file changed since it was opened.
        """
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_DIRECT", 0))
        try:
            if identity(os.fstat(fd)) != self.identity:
                raise FormatError("the file changed since it was opened (replaced or rewritten); run the command "
                                  "again", file=self.path)
            view, done = memoryview(buffer.reshape(-1).view("uint8")), 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], offset + done)
                if n == 0:
                    break
                done += n
        finally:
            os.close(fd)
        self.bytes_read += done
        return done

    def close(self) -> None:
        _POOL.close(self.token)


class _DescriptorPool:
    """At most ``limit`` input files open at once, least recently used closed first:
    a checkpoint of 600 shards works under ``ulimit -n 256``. Keyed by reader
    token, so that a reader nobody holds any more is collected (and its descriptor
    closed) rather than kept alive by the pool."""

    def __init__(self, limit: int):
        self._limit = limit
        self._lock = threading.Lock()
        self._open: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # token -> [fd, users]
        self._orphans = _gc.Orphans(self._lock, self._forget)  # tokens of collected readers, to close

    @contextlib.contextmanager
    def descriptor(self, reader: FileReader) -> Iterator[int]:
        with self._lock:
            self._orphans.drain()
            entry = self._open.pop(reader.token, None)
            if entry is None:
                entry = [reader.open_checked(), 0]
            self._open[reader.token] = entry
            entry[1] += 1  # reads under way: the pool never closes it then
            idle = [token for token, (_, users) in self._open.items() if users == 0]
            for oldest in idle[: max(0, len(self._open) - self._limit)]:
                os.close(self._open.pop(oldest)[0])
        try:
            yield entry[0]
        finally:
            with self._lock:
                entry[1] -= 1

    def close(self, token: int) -> None:
        with self._lock:
            self._forget(token)

    def collected(self, token: int) -> None:
        """A reader's finalizer: its descriptor closed now, or by the pool's next user."""
        self._orphans.collected(token)

    def _forget(self, token: int) -> None:
        entry = self._open.pop(token, None)
        if entry is not None:
            os.close(entry[0])


_tokens = itertools.count()
_POOL = _DescriptorPool(64)
