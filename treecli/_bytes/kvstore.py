"""S3 and GCS objects as a byte source, through TensorStore's kvstore drivers.

TensorStore is the engine Orbax itself reads and writes buckets with, it is
installed with orbax-checkpoint, and on this machine it read byte ranges faster
than fsspec and obstore (``bench/engines.py``; figures in docs/benchmarks.md). Its
drivers retry transient failures with backoff themselves.

Configuration is each ecosystem's own: ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION`` for S3;
``STORAGE_EMULATOR_HOST`` and application default credentials for GCS.

A kvstore read names no object size, which a safetensors header must be checked
against: a file under ``HEAD_GUESS`` bytes is read whole by the first request
(the speculative one failing tells it is that small), and a larger one's size is
confirmed where its header says the data ends (:meth:`KvstoreReader.check_end`).
"""

from __future__ import annotations

import os
import urllib.parse
from typing import Any

from treecli._bytes import small_text, too_long
from treecli._errors import FormatError, TreecliError, UsageError

HEAD_GUESS = 64 << 10  # a first request this long holds the length and almost every header
PART_BYTES = 1 << 20  # a chunk is read as parts of this size, all in flight at once
SCHEMES = ("s3://", "gs://")


def split_url(url: str) -> tuple[str, str, str]:
    """``s3://BUCKET/KEY`` -> ("s3", BUCKET, KEY)."""
    parts = urllib.parse.urlsplit(url)
    if not parts.netloc:
        raise UsageError(f"write a bucket object as {parts.scheme}://BUCKET/KEY", file=url)
    return parts.scheme, parts.netloc, parts.path.lstrip("/")


def spec(scheme: str, bucket: str, path: str = "") -> dict[str, Any]:
    """The TensorStore kvstore spec of a bucket (and a key prefix in it), from the
    standard environment variables of its cloud."""
    from treecli._bytes.http import tensorstore_deadlines, tensorstore_retries

    tensorstore_deadlines()
    retries = {"context": {name: policy for name, policy in tensorstore_retries().items() if name.startswith(scheme)}}
    if scheme == "s3":
        spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": path, **retries}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if endpoint:
            spec["endpoint"] = endpoint
        if region:
            spec["aws_region"] = region
        if os.environ.get("AWS_ACCESS_KEY_ID"):  # else the default chain: profiles, then the instance's role
            spec["aws_credentials"] = {"type": "environment"}
        return spec
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator:  # the variable Google's clients read; TensorStore reads its own
        os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL",
                              emulator if "://" in emulator else f"http://{emulator}")
    return {"driver": "gcs", "bucket": bucket, "path": path, **retries}


def open_store(url: str) -> tuple[Any, str]:
    """(the kvstore of the bucket of ``url``, the key ``url`` names in it)."""
    import tensorstore as ts

    scheme, bucket, key = split_url(url)
    try:
        return ts.KvStore.open(spec(scheme, bucket)).result(), key
    except Exception as e:  # tensorstore raises ValueError and friends with long messages
        raise describe(e, url) from None


def describe(error: Exception, url: str) -> TreecliError:
    """A TensorStore failure as one line naming the URL (and the variables to set)."""
    message = str(error).splitlines()[0] if str(error) else type(error).__name__
    code = message.split(":", 1)[0]
    if code in ("PERMISSION_DENIED", "UNAUTHENTICATED"):
        hint = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for a non-AWS server)"
                if url.startswith("s3://") else
                "set GOOGLE_APPLICATION_CREDENTIALS, or run gcloud auth application-default login")
        return FormatError(f"access denied: {hint}", file=url)
    if code == "NOT_FOUND":
        return FormatError("not found", file=url)
    return TreecliError(f"cannot read it: {message[:300]}", file=url)


def read_text(store: Any, key: str, url: str, limit: int) -> str | None:
    """A small text object (an index, JSON metadata), or None if it does not exist.

    The kvstore names no size, so one byte past ``limit`` is asked for first: an object
    that has it is refused before anything is read whole."""
    if _longer_than(store, key, limit, url):
        raise too_long(limit, url)
    try:
        result = store.read(key).result()
    except Exception as e:
        raise describe(e, url) from None
    return small_text(result.value if result.state == "value" else None, limit, url)


def _longer_than(store: Any, key: str, limit: int, url: str) -> bool:
    try:
        return store.read(key, byte_range=slice(limit, limit + 1)).result().state == "value"
    except Exception as e:
        if str(e).startswith("OUT_OF_RANGE"):  # no byte there: the object is short enough
            return False
        raise describe(e, url) from None


class KvstoreReader:
    """An object in a bucket read by byte ranges: a source (``treecli._bytes``).

    Every answer carries the object's generation (its ETag on S3); one that
    differs from the first read's means the object was replaced mid-read, an
    error rather than bytes from two versions.
    """

    def __init__(self, store: Any, key: str, name: str):
        self.path = name
        self.size: int | None = None  # known once read whole, or confirmed by check_end
        self.identity: bytes | None = None
        self.bytes_read = 0
        self._store = store
        self._key = key
        self._head = b""

    def start(self) -> None:
        """The object's first HEAD_GUESS bytes, or all of it when it is smaller."""
        try:
            self._head = self._wait(self._store.read(self._key, byte_range=slice(0, HEAD_GUESS)), 0)
        except _OutOfRange:  # smaller than the guess: what is there is small, read it whole
            self._head = self._wait(self._store.read(self._key), 0)
            if len(self._head) >= HEAD_GUESS:
                raise FormatError("the object changed while it was read; run the command again",
                                  file=self.path) from None
            self.size = len(self._head)

    def check_end(self, end: int) -> int:
        """The object's size, given where its header says the data ends: ``end`` itself,
        else a clear error (truncated, or trailing bytes)."""
        if self.size is not None:
            return self.size
        last = self._store.read(self._key, byte_range=slice(end - 1, end)) if end else None
        beyond = self._store.read(self._key, byte_range=slice(end, end + 1))
        try:
            if last is not None:
                self._wait(last, end - 1)
        except _OutOfRange:
            raise FormatError(f"object is truncated: its header declares tensor data through byte {end}, but "
                              "the object is shorter", file=self.path) from None
        try:
            self._wait(beyond, end)
        except _OutOfRange:
            self.size = end
            return end
        raise FormatError(f"trailing bytes after the last tensor (data ends at byte {end}, the object is longer)",
                          file=self.path)

    def read(self, offset: int, size: int) -> bytes:
        if offset + size <= len(self._head):
            return self._head[offset : offset + size]
        try:
            return self._wait(self._store.read(self._key, byte_range=slice(offset, offset + size)), offset)
        except _OutOfRange:
            raise FormatError(f"object ended before byte {offset + size} while reading {size} bytes at {offset}",
                              file=self.path) from None

    def read_into(self, buffer: Any, offset: int) -> None:
        view = memoryview(buffer.reshape(-1).view("uint8"))
        if offset + len(view) <= len(self._head):
            view[:] = self._head[offset : offset + len(view)]
            return
        parts = [(start, min(len(view), start + PART_BYTES)) for start in range(0, len(view), PART_BYTES)]
        futures = [self._store.read(self._key, byte_range=slice(offset + a, offset + b)) for a, b in parts]
        try:
            for (a, b), future in zip(parts, futures):
                view[a:b] = self._wait(future, offset + a)
        except _OutOfRange:
            raise FormatError(f"object ended while reading {len(view)} bytes at {offset} (was it replaced?)",
                              file=self.path) from None
        finally:
            for future in futures:
                future.cancel()

    def close(self) -> None:
        """Nothing to release: TensorStore pools its connections."""

    def _wait(self, future: Any, offset: int) -> bytes:
        try:
            result = future.result()
        except Exception as e:
            if str(e).startswith("OUT_OF_RANGE"):
                raise _OutOfRange() from None
            raise describe(e, self.path) from None
        if result.state != "value":
            raise FormatError("not found" if not self.bytes_read else
                              "the object was deleted while it was read", file=self.path)
        generation = result.stamp.generation
        if self.identity is None:
            self.identity = generation
        elif generation != self.identity:
            raise FormatError("the object changed in the bucket while it was read (its generation changed); "
                              "run the command again", file=self.path)
        self.bytes_read += len(result.value)
        return result.value


class _OutOfRange(Exception):
    """A byte range past the object's end."""
