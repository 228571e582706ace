"""Host memory for loads onto devices: aligned buffers, a bounded ring of them reused
across leaves, and reads of a file's byte run into one, through the page cache or with
direct I/O past it (``_devices`` drives them).

Direct I/O reads whole blocks: a run's bytes land ``offset % ALIGN`` into its buffer, which
holds the run and up to a block either side (``aligned_room``).
"""

from __future__ import annotations

import queue
import threading
from typing import Any

ALIGN = 4096  # the block size direct I/O aligns addresses, offsets and sizes to (_bytes.local.DIRECT_ALIGN)


def aligned(nbytes: int) -> Any:
    """An uninitialised uint8 array of ``nbytes`` whose address is a multiple of ALIGN."""
    import numpy as np

    raw = np.empty(nbytes + ALIGN, np.uint8)
    shift = -raw.ctypes.data % ALIGN
    return raw[shift:shift + nbytes]


def aligned_room(nbytes: int) -> int:
    """The bytes a buffer takes to read a run of ``nbytes`` with direct I/O, wherever it starts."""
    return nbytes + 2 * ALIGN


class Ring:
    """At most ``count`` host buffers of ``nbytes`` each (made as first needed), taken by
    readers and given back once their bytes are on the devices: a load's host memory is the
    ring, not the model."""

    def __init__(self, count: int, nbytes: int):
        self.nbytes = nbytes
        self._free: queue.Queue = queue.Queue()
        self._made, self._count = 0, count
        self._lock = threading.Lock()

    def take(self) -> Any:
        with self._lock:
            if self._free.empty() and self._made < self._count:
                self._made += 1
                return aligned(self.nbytes)
        return self._free.get()

    def give(self, buffer: Any) -> None:
        self._free.put(buffer)

    @property
    def made(self) -> int:
        """How many buffers were made (never more than ``count``)."""
        return self._made


class RunReader:
    """Reads byte runs of local files into buffers: with direct I/O where asked and the file
    system takes it (a reader refused once reads through the page cache after)."""

    def __init__(self, direct: bool):
        self.direct = direct
        self._refused: set[int] = set()  # id() of the readers whose file system refused direct I/O

    def read(self, reader: Any, offset: int, nbytes: int, buffer: Any, at: int) -> Any:
        """The ``nbytes`` at ``offset`` of ``reader``'s file, read into ``buffer``, whose first
        byte stands for the file's byte ``at`` (so they land at ``offset - at``); returns the
        view of them. Direct I/O reads whole blocks around them: where ``at`` is a block's
        start, ``buffer`` aligned and room in it to the end of the last block (the bytes
        around the run in those blocks are overwritten)."""
        start, end = offset - offset % ALIGN, -(-(offset + nbytes) // ALIGN) * ALIGN
        if self.direct and id(reader) not in self._refused and hasattr(reader, "read_direct") and start >= at \
                and (start - at) % ALIGN == 0 and end - at <= len(buffer):
            try:
                got = reader.read_direct(buffer[start - at:end - at], start)
            except OSError:  # (EINVAL: tmpfs, or an alignment it will not take)
                self._refused.add(id(reader))
            else:
                if got >= offset + nbytes - start:
                    return buffer[offset - at:offset - at + nbytes]
                self._refused.add(id(reader))  # (short: the file ends early; the cached read says how)
        view = buffer[offset - at:offset - at + nbytes]
        reader.read_into(view, offset)
        return view
