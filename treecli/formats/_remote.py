"""Checkpoints where they live: safetensors over HTTP(S) and from the Hugging Face Hub,
read by byte ranges.

:class:`HttpReader` is the remote twin of ``_filedata.FileReader``: it reads
``(offset, size)`` ranges into buffers, so the same lazy leaves read local and
remote files, and only the bytes a command needs move. It knows the identity of
what it reads (the ``ETag``, else ``Last-Modified``, and the size): a file
replaced on the server mid-read is an error, never bytes from two versions.

``hf://ORG/REPO[@REVISION][/PATH]`` resolves to the Hub's
``{HF_ENDPOINT}/ORG/REPO/resolve/REVISION/PATH``; a repository without a path
to its ``model.safetensors.index.json``, else its ``model.safetensors``, as a
local HF directory. ``HF_TOKEN`` is sent to the Hub only. Plain HTTP(S) servers
are read anonymously.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from treecli._errors import FormatError, TreecliError, UsageError
from treecli.formats._base import Checkpoint

HEAD_GUESS = 64 << 10  # a first request this long holds the length and almost every header: one round trip
MAX_INDEX_BYTES = 64 << 20
CONCURRENT_SHARDS = 16  # headers of a sharded repository fetched at once
RETRIES = 4  # transient failures (a reset, a 5xx, a short body) are tried again this many times
TIMEOUT_S = 30


class HttpReader:
    """A remote file read with ``Range`` requests, the interface of ``FileReader``."""

    def __init__(self, url: str, headers: dict[str, str], name: str | None = None):
        self.url = url
        self.path = name or url  # what errors name: the URL the user gave
        self._headers = headers
        self.size: int | None = None
        self.identity: str | None = None
        self.bytes_read = 0
        self._head = b""
        self._lock = threading.Lock()

    def start(self) -> None:
        """Learn the size and identity with one speculative read of the file's start."""
        self._head = self._fetch(0, HEAD_GUESS, exact=False)

    def read(self, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` (from the first read when it holds them)."""
        if offset + size <= len(self._head):
            return self._head[offset : offset + size]
        return self._fetch(offset, size)

    def read_into(self, buffer: Any, offset: int) -> None:
        view = memoryview(buffer.reshape(-1).view("uint8"))
        if len(view):
            view[:] = self.read(offset, len(view))

    def close(self) -> None:
        """Nothing stays open between requests."""

    def _fetch(self, offset: int, size: int, exact: bool = True) -> bytes:
        last = ""
        for attempt in range(RETRIES + 1):
            if attempt:
                time.sleep(min(2.0, 0.1 * 2**attempt))
            try:
                return self._request(offset, size, exact)
            except _Transient as e:
                last = str(e)
        raise TreecliError(f"reading bytes {offset}-{offset + size - 1} failed {RETRIES + 1} times: {last}",
                           file=self.path)

    def _request(self, offset: int, size: int, exact: bool) -> bytes:
        request = urllib.request.Request(self.url, headers={**self._headers,
                                                            "Range": f"bytes={offset}-{offset + size - 1}"})
        try:
            response = urllib.request.urlopen(request, timeout=TIMEOUT_S)
        except urllib.error.HTTPError as e:
            e.close()
            if e.code >= 500 or e.code == 429:
                raise _Transient(f"HTTP {e.code}") from None
            if e.code == 416 and offset == 0 and not exact:  # an empty file
                self.size, self.identity = 0, e.headers.get("ETag") or e.headers.get("Last-Modified")
                return b""
            raise _http_error(e, self.path) from None
        except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out
            reason = getattr(e, "reason", e)
            raise _Transient(f"{type(reason).__name__}: {reason}") from None
        with response:
            if response.status != 206:
                raise FormatError("the server ignores Range requests and sends the whole file; treecli reads "
                                  "only the byte ranges it needs", file=self.path)
            total = _total_size(response.headers.get("Content-Range", ""), offset, self.path)
            identity = response.headers.get("ETag") or response.headers.get("Last-Modified")
            with self._lock:
                if self.size is None:
                    self.size, self.identity = total, identity
                elif (total, identity) != (self.size, self.identity):
                    raise FormatError("the file changed on the server while it was read (its ETag or size "
                                      "changed); run the command again", file=self.path)
            wanted = min(size, total - offset)
            try:
                body = response.read(wanted + 1)
            except OSError as e:
                raise _Transient(f"connection lost mid-body: {e}") from None
        if len(body) != wanted:
            raise _Transient(f"the server sent {len(body)} bytes of the {wanted} asked for")
        self.bytes_read += len(body)
        return body


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


def _http_error(error: urllib.error.HTTPError, url: str) -> TreecliError:
    if error.code in (401, 403):
        hint = " (set HF_TOKEN for a gated or private Hub repository)" if url.startswith("hf://") else ""
        return FormatError(f"access denied (HTTP {error.code}){hint}", file=url)
    if error.code == 404:
        return FormatError("not found (HTTP 404)", file=url)
    if 300 <= error.code < 400:
        return FormatError(f"too many redirects (HTTP {error.code}: a redirect loop?)", file=url)
    return FormatError(f"the server refused it (HTTP {error.code} {error.reason})", file=url)


# --- the Hub -----------------------------------------------------------------------------------


def _hub(url: str) -> tuple[str, str]:
    """``hf://ORG/REPO[@REV][/PATH]`` -> (the resolve URL of the repository, PATH or "")."""
    parts = url[len("hf://"):].split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise UsageError("write a Hub checkpoint as hf://ORG/REPO[@REVISION][/PATH]", file=url)
    repo, _, revision = parts[1].partition("@")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    quote = urllib.parse.quote
    base = f"{endpoint}/{quote(parts[0])}/{quote(repo)}/resolve/{quote(revision or 'main', safe='')}/"
    return base, "/".join(quote(p) for p in parts[2:] if p)


def _headers(url: str) -> dict[str, str]:
    headers = {"User-Agent": "treecli", "Accept-Encoding": "identity"}
    token = os.environ.get("HF_TOKEN")
    if url.startswith("hf://") and token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _get_text(url: str, headers: dict[str, str], name: str) -> str | None:
    """A small text file (an index), or None if it does not exist."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S) as response:
            body = response.read(MAX_INDEX_BYTES + 1)
    except urllib.error.HTTPError as e:
        e.close()
        if e.code == 404:
            return None
        raise _http_error(e, name) from None
    except (urllib.error.URLError, OSError) as e:
        raise TreecliError(f"cannot connect: {getattr(e, 'reason', e)}", file=name) from None
    if len(body) > MAX_INDEX_BYTES:
        raise FormatError(f"the shard index is over {MAX_INDEX_BYTES >> 20} MiB; no real index is", file=name)
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"the shard index is not UTF-8 (byte {e.start})", file=name) from None


# --- opening -------------------------------------------------------------------------------------


def open_remote(url: str) -> Checkpoint:
    """A remote safetensors file or sharded repository, its headers read and validated
    as a local file's are (several shards' at once), its leaves lazy byte ranges."""
    headers = _headers(url)
    if url.startswith("hf://"):
        base, path = _hub(url)
        if not path:
            text = _get_text(base + "model.safetensors.index.json", headers, url)
            if text is not None:
                return _open_sharded(url, base, text, headers)
            path = "model.safetensors"
        location = base + path
    else:
        location, path = url, urllib.parse.urlsplit(url).path
    if path.endswith(".index.json"):
        text = _get_text(location, headers, url)
        if text is None:
            raise FormatError("not found (HTTP 404)", file=url)
        return _open_sharded(url, location.rsplit("/", 1)[0] + "/", text, headers)
    if not path.endswith(".safetensors"):
        raise UsageError("treecli reads remote safetensors files and Hub repositories (a URL ending in "
                         ".safetensors or .index.json, or hf://ORG/REPO)", file=url)
    return _open_file(url, location, headers)


def _open_file(url: str, location: str, headers: dict[str, str]) -> Checkpoint:
    from treecli.formats import _flatkeys, safetensors
    from treecli.formats._filedata import FileArrayLeaf

    reader, (tensors, metadata, _) = _read_header(location, headers, url)
    items = [(name, FileArrayLeaf(reader, offset, shape, dtype)) for name, (dtype, shape, offset) in tensors.items()]
    tree, warning = _flatkeys.nest(items, ".")
    checkpoint = Checkpoint(tree=tree, format=safetensors.FORMAT.name, file=url, metadata=dict(metadata))
    checkpoint.warnings.extend([warning] if warning else [])
    return checkpoint


def _read_header(location: str, headers: dict[str, str], name: str) -> tuple[HttpReader, tuple]:
    from treecli.formats import safetensors

    reader = HttpReader(location, headers, name)
    reader.start()
    return reader, safetensors.parse_header(reader.read, reader.size, name)


def _open_sharded(url: str, base: str, text: str, headers: dict[str, str]) -> Checkpoint:
    """The index, then every shard's header at once: one round trip of latency, not one per shard."""
    from treecli.formats import safetensors

    weight_map, shards = safetensors.shard_names(text, url)
    results: dict[str, Any] = {}
    slots = threading.Semaphore(CONCURRENT_SHARDS)

    def fetch(shard: str) -> None:
        with slots:
            try:
                results[shard] = _read_header(base + urllib.parse.quote(shard), headers,
                                              f"{url.rstrip('/')}/{shard}")
            except BaseException as e:  # handed to the caller's thread
                results[shard] = e

    threads = [threading.Thread(target=fetch, args=(shard,), daemon=True) for shard in shards]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    opened = {}
    for shard in shards:
        if isinstance(results[shard], BaseException):
            raise results[shard]
        reader, (tensors, metadata, _) = results[shard]
        opened[shard] = (reader, tensors, metadata)
    checkpoint = Checkpoint(tree=None, format=safetensors.FORMAT.name, file=url)
    safetensors.assemble_shards(checkpoint, weight_map, opened)
    return checkpoint
