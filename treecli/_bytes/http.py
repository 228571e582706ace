"""HTTP(S) files as a byte source: ``Range`` requests on keep-alive connections.

:class:`HttpReader` reads ``(offset, size)`` ranges into the caller's buffers and
knows the identity of what it reads (the ``ETag``, else ``Last-Modified``, and
the size): a file replaced on the server mid-read is an error, never bytes from
two versions. Transient failures (a reset, a 5xx, a short body) are retried
with backoff; the rest are one-line errors naming the URL.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from typing import Any, Callable

from treecli._errors import FormatError, TreecliError

HEAD_GUESS = 64 << 10  # a first request this long holds the length and almost every header: one round trip
PART_BYTES = 1 << 20  # a longer read is split into ranges this long, fetched at once
RETRIES = 4  # transient failures (a reset, a 5xx, a short body) are tried again this many times
TIMEOUT_S = 30


class HttpReader:
    """A remote file read with ``Range`` requests, a source (``treecli._bytes``).

    The first read goes through ``urllib`` (which follows the Hub's redirects to its
    storage) and learns the final location, size and identity; later reads reuse one
    keep-alive connection per thread to that location and land straight in the
    caller's buffer (a new connection and a copy per 4 MiB chunk halved throughput).
    """

    def __init__(self, url: str, headers: dict[str, str], name: str | None = None):
        self.url = url
        self.path = name or url  # what errors name: the URL the user gave
        self._headers = headers
        self.size: int | None = None
        self.identity: str | None = None
        self.bytes_read = 0
        self._head = b""
        self._target = url
        self._lock = threading.Lock()
        self._connections = threading.local()
        self._opened: list[Any] = []  # every thread's connection, closed with the reader or when it is collected
        weakref.finalize(self, _close_all, self._opened)

    def start(self) -> None:
        """Learn the size, identity and final location with one speculative read of the file's start."""
        self._head = self._retrying(self._first_request, "reading its first bytes")

    def read(self, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` (from the first read when it holds them)."""
        if offset + size <= len(self._head):
            return self._head[offset : offset + size]
        buffer = bytearray(size)
        self._fetch_into(memoryview(buffer), offset)
        return bytes(buffer)

    def read_into(self, buffer: Any, offset: int) -> None:
        view = memoryview(buffer.reshape(-1).view("uint8"))
        if offset + len(view) <= len(self._head):
            view[:] = self._head[offset : offset + len(view)]
        elif len(view):
            self._fetch_into(view, offset)

    def close(self) -> None:
        _close_all(self._opened)

    def _first_request(self) -> bytes:
        request = urllib.request.Request(self.url, headers={**self._headers, "Range": f"bytes=0-{HEAD_GUESS - 1}"})
        try:
            response = urllib.request.urlopen(request, timeout=TIMEOUT_S)
        except urllib.error.HTTPError as e:
            e.close()
            if e.code >= 500 or e.code == 429:
                raise _Transient(f"HTTP {e.code}") from None
            if e.code == 416:  # an empty file
                self.size, self.identity = 0, e.headers.get("ETag") or e.headers.get("Last-Modified")
                return b""
            raise status_error(e.code, e.reason, self.path) from None
        except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out
            raise _Transient(f"{type(getattr(e, 'reason', e)).__name__}: {getattr(e, 'reason', e)}") from None
        with response:
            self._target = response.geturl()
            self._check(response.status, response.headers, 0)
            try:
                body = response.read(min(HEAD_GUESS, self.size) + 1)
            except OSError as e:
                raise _Transient(f"connection lost mid-body: {e}") from None
        if len(body) != min(HEAD_GUESS, self.size):
            raise _Transient(f"the server sent {len(body)} bytes of the {min(HEAD_GUESS, self.size)} asked for")
        self.bytes_read += len(body)
        return body

    def _fetch_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the bytes at ``offset``: a long range as parts, all in flight
        at once (one request at a time on loopback reached a quarter of local throughput)."""
        from treecli._bytes import stream

        def part(start: int) -> Callable[[], None]:
            piece = view[start : start + PART_BYTES]
            return lambda: self._retrying(lambda: self._request_into(piece, offset + start),
                                          f"reading bytes {offset + start}-{offset + start + len(piece) - 1}")

        stream.in_flight([part(start) for start in range(0, len(view), PART_BYTES)])

    def _retrying(self, attempt: Callable[[], Any], what: str) -> Any:
        """``attempt()``, tried again after a transient failure on a fresh connection."""
        return retrying(attempt, what, self.path, after_failure=self._drop_connection)

    def _drop_connection(self) -> None:
        broken, self._connections.conn = getattr(self._connections, "conn", None), None
        if broken is not None:
            broken.close()

    def _request_into(self, view: memoryview, offset: int) -> None:
        import http.client

        parts = urllib.parse.urlsplit(self._target)
        connection = getattr(self._connections, "conn", None)
        if connection is None:
            kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            connection = self._connections.conn = kind(parts.netloc, timeout=TIMEOUT_S)
            with self._lock:
                self._opened.append(connection)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        headers = self._headers if self._target == self.url else {  # the Hub's token stays with the Hub
            k: v for k, v in self._headers.items() if k != "Authorization"}
        try:
            connection.request("GET", target, headers={**headers, "Range": f"bytes={offset}-{offset + len(view) - 1}"})
            response = connection.getresponse()
        except (http.client.HTTPException, OSError) as e:
            raise _Transient(f"{type(e).__name__}: {e}") from None
        try:
            if response.status >= 500 or response.status == 429:
                raise _Transient(f"HTTP {response.status}")
            if response.status >= 300:
                raise status_error(response.status, response.reason, self.path)
            self._check(response.status, response.headers, offset)
            done = 0
            while done < len(view):
                n = response.readinto(view[done:])
                if not n:
                    break
                done += n
        except (http.client.HTTPException, OSError) as e:
            raise _Transient(f"connection lost mid-body: {e}") from None
        finally:
            response.close()
        if done != len(view):
            raise _Transient(f"the server sent {done} bytes of the {len(view)} asked for")
        self.bytes_read += done

    def _check(self, status: int, headers: Any, offset: int) -> None:
        """A ranged answer, at the offset asked for, from the same version of the file."""
        if status != 206:
            raise FormatError("the server ignores Range requests and sends the whole file; treecli reads "
                              "only the byte ranges it needs", file=self.path)
        total = _total_size(headers.get("Content-Range", ""), offset, self.path)
        identity = headers.get("ETag") or headers.get("Last-Modified")
        with self._lock:
            if self.size is None:
                self.size, self.identity = total, identity
            elif (total, identity) != (self.size, self.identity):
                raise FormatError("the file changed on the server while it was read (its ETag or size "
                                  "changed); run the command again", file=self.path)


def retrying(attempt: Callable[[], Any], what: str, name: str,
             after_failure: Callable[[], None] | None = None) -> Any:
    """``attempt()``, tried again with backoff after a transient failure, RETRIES times."""
    last = ""
    for tries in range(RETRIES + 1):
        if tries:
            time.sleep(min(2.0, 0.1 * 2**tries))
        try:
            return attempt()
        except _Transient as e:
            if after_failure:
                after_failure()
            last = str(e)
    raise TreecliError(f"{what} failed {RETRIES + 1} times: {last}", file=name)


def get_small(url: str, headers: dict[str, str], name: str, limit: int) -> bytes | None:
    """A whole small file (a shard index), or None if the server has none; transient
    failures retried as range reads are."""
    def attempt() -> bytes | None:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S) as response:
                return response.read(limit + 1)
        except urllib.error.HTTPError as e:
            e.close()
            if e.code == 404:
                return None
            if e.code >= 500 or e.code == 429:
                raise _Transient(f"HTTP {e.code}") from None
            raise status_error(e.code, e.reason, name) from None
        except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out
            raise _Transient(f"{type(getattr(e, 'reason', e)).__name__}: {getattr(e, 'reason', e)}") from None

    return retrying(attempt, "reading it", name)


def _close_all(connections: list[Any]) -> None:
    while connections:
        connections.pop().close()


class _Transient(Exception):
    """A failure worth another try."""


def _total_size(content_range: str, offset: int, url: str) -> int:
    """The file's size from ``bytes START-END/TOTAL``, checking START is what was asked."""
    try:
        unit, _, spec = content_range.partition(" ")
        span, _, total = spec.partition("/")
        start = int(span.split("-")[0])
        size = int(total)
    except ValueError:
        raise FormatError(f"the server's Content-Range {content_range!r} is not bytes START-END/SIZE",
                          file=url) from None
    if unit != "bytes" or start != offset:
        raise FormatError(f"the server answered a range at {offset} with {content_range!r}", file=url)
    return size


class NotFoundError(FormatError):
    """The server has no such file (HTTP 404)."""


def status_error(code: int, reason: str, url: str) -> TreecliError:
    if code in (401, 403):
        hint = " (set HF_TOKEN for a gated or private Hub repository)" if url.startswith("hf://") else ""
        return FormatError(f"access denied (HTTP {code}){hint}", file=url)
    if code == 404:
        return NotFoundError("not found (HTTP 404)", file=url)
    if 300 <= code < 400:
        return FormatError(f"too many redirects (HTTP {code}: a redirect loop?)", file=url)
    return FormatError(f"the server refused it (HTTP {code} {reason})", file=url)
