"""HTTP(S) files as a byte source: ``Range`` requests on keep-alive connections.

:class:`HttpReader` reads ``(offset, size)`` ranges into the caller's buffers and
knows the identity of what it reads (the ``ETag``, else ``Last-Modified``, and
the size): a file replaced on the server mid-read is an error, never bytes from
two versions. Transient failures (a reset, a 5xx, a short body) are retried
with backoff; the rest are one-line errors naming the URL.

Every request has a deadline (``TREECLI_HTTP_DEADLINE`` seconds, plus the time
its bytes take at ``TREECLI_HTTP_MIN_RATE`` bytes a second): a stuck or
dripping server is one line, never a hang. Credentials (``Authorization``,
cookies) go only to the origin they were given for: a redirect to another
scheme, host or port drops them, as ``requests`` and ``huggingface_hub`` do.
A server that names no version (neither ``ETag`` nor ``Last-Modified``) could
swap the file between two range requests unseen: such a file is read in one
request or refused, unless ``TREECLI_HTTP_UNVALIDATED=1``.
"""

from __future__ import annotations

import contextlib
import heapq
import http.client
import itertools
import os
import socket
import threading
import time
import urllib.parse
import weakref
from typing import Any, Callable, Iterator

from treecli._errors import FormatError, TreecliError

HEAD_GUESS = 64 << 10  # a first request this long holds the length and almost every header: one round trip
PART_BYTES = 1 << 20  # a longer read is split into ranges this long, fetched at once
RETRIES = 4  # transient failures (a reset, a 5xx, a short body) are tried again this many times
TIMEOUT_S = 30  # the longest wait for a connection or for any one packet
DEADLINE_S = 60.0  # every request finishes within this, plus its bytes' time at MIN_RATE
MIN_RATE = 64 << 10  # bytes a second
MAX_REDIRECTS = 10
_REDIRECTS = (301, 302, 303, 307, 308)
_CREDENTIALS = ("authorization", "proxy-authorization", "cookie")


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
        headers = {**self._headers, "Range": f"bytes=0-{HEAD_GUESS - 1}"}
        with _get(self.url, headers, self.path, HEAD_GUESS) as (final, response):
            if response.status == 416:  # an empty file
                self.size, self.identity = 0, response.getheader("ETag") or response.getheader("Last-Modified")
                return b""
            _check_status(response.status, response.reason, self.path)
            self._target = final
            self._check(response.status, response.headers, 0)
            try:
                body = response.read(min(HEAD_GUESS, self.size) + 1)
            except (OSError, http.client.HTTPException) as e:
                raise _Transient(f"connection lost mid-body: {e}") from None
            if len(body) != min(HEAD_GUESS, self.size):
                raise _Transient(f"the server sent {len(body)} bytes of the {min(HEAD_GUESS, self.size)} asked for")
        self.bytes_read += len(body)
        return body

    def _fetch_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the bytes at ``offset``: a long range as parts, all in flight
        at once (one request at a time on loopback reached a quarter of local throughput)."""
        from treecli._bytes import stream

        if self.identity is None and os.environ.get("TREECLI_HTTP_UNVALIDATED") != "1":
            raise FormatError("the server names no version of the file (neither ETag nor Last-Modified), so a "
                              "change between treecli's range requests would go unseen; read it from a server "
                              "that does, or set TREECLI_HTTP_UNVALIDATED=1 to read it anyway", file=self.path)

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
        parts = urllib.parse.urlsplit(self._target)
        connection = getattr(self._connections, "conn", None)
        if connection is None:
            connection = self._connections.conn = _connection(parts)
            with self._lock:
                self._opened.append(connection)
        headers = _credentials_for(self._target, self.url, self._headers)
        with _Deadline(len(view), self.path, connection):
            try:
                connection.request("GET", _request_target(parts),
                                   headers={**headers, "Range": f"bytes={offset}-{offset + len(view) - 1}"})
                response = connection.getresponse()
            except (http.client.HTTPException, OSError) as e:
                raise _Transient(f"{type(e).__name__}: {e}") from None
            try:
                if response.status in _REDIRECTS:
                    raise FormatError(f"the server moved the file again mid-read (HTTP {response.status})",
                                      file=self.path)
                _check_status(response.status, response.reason, self.path)
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
        with _get(url, headers, name, limit) as (_, response):
            if response.status == 404:
                return None
            _check_status(response.status, response.reason, name)
            try:
                return response.read(limit + 1)
            except (OSError, http.client.HTTPException) as e:
                raise _Transient(f"connection lost mid-body: {e}") from None

    return retrying(attempt, "reading it", name)


def deadline(nbytes: int) -> float:
    """Seconds a request for ``nbytes`` may take: ``TREECLI_HTTP_DEADLINE``, plus the bytes'
    time at ``TREECLI_HTTP_MIN_RATE`` bytes a second."""
    return _setting("TREECLI_HTTP_DEADLINE", DEADLINE_S) + nbytes / _setting("TREECLI_HTTP_MIN_RATE", MIN_RATE)


def tensorstore_deadlines() -> None:
    """TensorStore's HTTP transport (buckets, and Orbax arrays over HTTP) held to the same
    settings: a transfer below ``TREECLI_HTTP_MIN_RATE`` for ``TREECLI_HTTP_DEADLINE`` seconds
    is abandoned (curl's low-speed limit, which TensorStore reads from its environment when
    it first makes a request). ``TENSORSTORE_CURL_*`` variables a user set win."""
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS",
                          str(max(1, round(_setting("TREECLI_HTTP_DEADLINE", DEADLINE_S)))))
    os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES",
                          str(max(1, int(_setting("TREECLI_HTTP_MIN_RATE", MIN_RATE)))))
    os.environ.setdefault("TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS", str(TIMEOUT_S))


def tensorstore_retries() -> dict[str, Any]:
    """TensorStore's retries of HTTP and bucket requests as treecli's own (``RETRIES`` tries,
    backoff up to 2 s): its default, 32 tries with up to 32 s between, made a stuck server
    a quarter of an hour."""
    policy = {"max_retries": RETRIES, "initial_delay": "0.1s", "max_delay": "2s"}
    return {f"{kind}_request_retries": policy for kind in ("http", "s3", "gcs")}


def _setting(name: str, default: float) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        from treecli._errors import UsageError

        raise UsageError(f"{name}={text!r} is not a positive number of {'seconds' if 'DEADLINE' in name else 'bytes'}")
    return value


class _Deadline:
    """A request's deadline: when it passes, the connection's socket is shut down, so that a
    read blocked on a stuck server fails at once, and the failure becomes one line saying so
    (never retried: a server that slow would only be slow again)."""

    def __init__(self, nbytes: int, name: str, connection: Any = None):
        self.seconds, self._name, self.connection = deadline(nbytes), name, connection
        self._expired = threading.Event()

    def __enter__(self) -> "_Deadline":
        self._token = _WATCHDOG.watch(time.monotonic() + self.seconds, self._expire)
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        _WATCHDOG.forget(self._token)
        # (past the deadline, a read that "finished" may have met the shut socket's end early)
        if self._expired.is_set() and (kind is None or issubclass(kind, Exception)):
            if self.connection is not None:
                self.connection.close()  # (http.client reconnects on the next request)
            raise TreecliError(
                f"the server did not finish a request within {self.seconds:.1f} s (TREECLI_HTTP_DEADLINE seconds "
                "plus its bytes at TREECLI_HTTP_MIN_RATE bytes a second): stuck or too slow; raise them to wait "
                "longer", file=self._name) from None

    def _expire(self) -> None:
        self._expired.set()
        sock = getattr(self.connection, "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class _Watchdog:
    """One daemon thread that calls each registered function when its time comes, unless
    forgotten first: the deadlines of every request in flight (a thread per request
    would be a thousand thread starts for a 1 GiB read in 1 MiB parts)."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, Callable[[], None]]] = []  # a heap
        self._live: set[int] = set()
        self._tokens = itertools.count()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def watch(self, when: float, call: Callable[[], None]) -> int:
        with self._wake:
            token = next(self._tokens)
            heapq.heappush(self._due, (when, token, call))
            self._live.add(token)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="treecli-deadlines", daemon=True)
                self._thread.start()
            self._wake.notify()
            return token

    def forget(self, token: int) -> None:
        with self._wake:
            self._live.discard(token)

    def _run(self) -> None:
        with self._wake:
            while True:
                while self._due and self._due[0][1] not in self._live:  # forgotten: dropped unseen
                    heapq.heappop(self._due)
                if not self._due:
                    self._wake.wait()
                    continue
                when, token, call = self._due[0]
                if time.monotonic() < when:
                    self._wake.wait(when - time.monotonic())
                    continue
                heapq.heappop(self._due)
                self._live.discard(token)
                call()


_WATCHDOG = _Watchdog()


@contextlib.contextmanager
def _get(url: str, headers: dict[str, str], name: str, nbytes: int) -> Iterator[tuple[str, Any]]:
    """A GET of ``url`` that follows redirects, within one deadline for the chain and the
    body (read by the caller inside the block); yields the final URL and the response.
    Credentials go on only while the redirects stay at ``url``'s origin."""
    with _Deadline(nbytes, name) as limit:
        for _ in range(MAX_REDIRECTS + 1):
            parts = urllib.parse.urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise FormatError(f"the server redirected to {url[:200]!r}, which is not an HTTP(S) URL", file=name)
            limit.connection = connection = _connection(parts)
            try:
                try:
                    connection.request("GET", _request_target(parts), headers=headers)
                    response = connection.getresponse()
                except (http.client.HTTPException, OSError) as e:
                    raise _Transient(f"{type(e).__name__}: {e}") from None
                location = response.getheader("Location") if response.status in _REDIRECTS else None
                if location is None:
                    with response:
                        yield url, response
                    return
                response.close()
            finally:
                connection.close()
            following = urllib.parse.urljoin(url, location)
            headers = _credentials_for(following, url, headers)
            url = following
    raise FormatError(f"too many redirects (over {MAX_REDIRECTS}: a redirect loop?)", file=name)


def _connection(parts: urllib.parse.SplitResult) -> http.client.HTTPConnection:
    """A new (not yet connected) connection to the server of a split URL."""
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return kind(parts.netloc, timeout=TIMEOUT_S)


def _credentials_for(url: str, origin_url: str, headers: dict[str, str]) -> dict[str, str]:
    """``headers`` for a request to ``url``: without credentials unless it is at the
    origin (scheme, host and port) of ``origin_url``, the one they were given for."""
    if _origin(url) == _origin(origin_url):
        return headers
    return {k: v for k, v in headers.items() if k.lower() not in _CREDENTIALS}


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    return parts.scheme.lower(), (parts.hostname or "").lower(), port or {"http": 80, "https": 443}.get(parts.scheme)


def _request_target(parts: urllib.parse.SplitResult) -> str:
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def _check_status(status: int, reason: str, name: str) -> None:
    """Transient failures (5xx, 429) to try again; other failures as one line."""
    if status >= 500 or status == 429:
        raise _Transient(f"HTTP {status}")
    if status >= 300:
        raise status_error(status, reason, name)


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
