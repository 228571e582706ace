"""How bytes move: sources that read byte ranges, and the streaming machinery.

A *source* is one file or object read by ``(offset, size)`` ranges, from any
number of threads at once, that knows the identity of what it reads and fails
rather than mix two versions of it:

- ``local.FileReader``: a local file (device, inode, size and mtime);
- ``http.HttpReader``: an HTTP(S) URL or a Hub file (ETag and size);
- ``kvstore.KvstoreReader``: an S3 or GCS object through TensorStore's kvstore
  drivers, the engine Orbax uses (the object's generation and size).

``stream`` holds what moves bytes through a command: the prefetch and helper
threads, the loop that writes a leaf chunk by chunk, the write-back hints.
Formats describe layouts (where a leaf's bytes lie) and leave moving them here.
"""

from __future__ import annotations

from typing import Any, Protocol

from treecli._errors import FormatError


class Source(Protocol):
    path: str  # what errors name: the file or the URL the user gave
    bytes_read: int

    def read_into(self, buffer: Any, offset: int) -> None:
        """Fill a C-contiguous NumPy array with the bytes at ``offset``."""

    def close(self) -> None:
        """Release descriptors or connections; reading again reopens them where it can."""


def small_text(body: bytes | None, limit: int, name: str, what: str = "metadata file") -> str | None:
    """A small text file (an index, JSON metadata) read whole, checked: at
    most ``limit`` bytes of UTF-8. None stays None (no such file)."""
    if body is None:
        return None
    if len(body) > limit:
        raise too_long(limit, name, what)
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"is not UTF-8 (byte {e.start})", file=name) from None


def too_long(limit: int, name: str, what: str = "metadata file") -> FormatError:
    return FormatError(f"is over {limit >> 20} MiB; no real {what} is", file=name)
