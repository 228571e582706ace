"""Checkpoints where they live: HTTP(S), the Hugging Face Hub, S3 and GCS.

Safetensors files and HF layouts are read by byte ranges through a source of
``treecli._bytes`` (``HttpReader`` for HTTP and the Hub, ``KvstoreReader`` for
buckets), so the same lazy leaves read local and remote files and only the bytes
a command needs move. Orbax checkpoints are read by ``formats.orbax`` through a
``Folder`` (a bucket prefix, or an HTTP directory asked for files by name).

``hf://ORG/REPO[@REVISION][/PATH]`` resolves to the Hub's
``{HF_ENDPOINT}/ORG/REPO/resolve/REVISION/PATH``. A directory (a repository, an
HTTP directory, a bucket prefix) reads as a local one: its shard index, else its
``model.safetensors``, else an Orbax checkpoint. ``HF_TOKEN`` is sent to the Hub
only; other HTTP servers are read anonymously.
"""

from __future__ import annotations

import os
import threading
import urllib.parse
from typing import Any

from treecli._bytes import kvstore, small_text
from treecli._bytes.http import HttpReader, NotFoundError, get_small
from treecli._errors import FormatError, UsageError
from treecli.formats._base import Checkpoint

MAX_INDEX_BYTES = 64 << 20
CONCURRENT_SHARDS = 16  # headers of a sharded repository fetched at once


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


# --- where the files are: a Hub or HTTP directory, or a bucket prefix ----------------------------


class _HttpPlace:
    """Files under an HTTP(S) base URL (a Hub repository's resolve URL); ``files`` maps
    a name to the exact URL the user gave for it (a query string and all)."""

    def __init__(self, url: str, base: str, headers: dict[str, str], files: dict[str, str]):
        self.url, self._base, self._headers, self._files = url, base, headers, files

    def name(self, path: str) -> str:
        return f"{self.url}/{path}"

    def text(self, path: str, name: str) -> str | None:
        url = self._files.get(path) or self._base + urllib.parse.quote(path)
        return small_text(get_small(url, self._headers, name, MAX_INDEX_BYTES), MAX_INDEX_BYTES, name, "shard index")

    def reader(self, path: str, name: str) -> Any:
        reader = HttpReader(self._files.get(path) or self._base + urllib.parse.quote(path), self._headers, name)
        reader.start()
        return reader


class _BucketPlace:
    """Objects under a key prefix of an S3 or GCS bucket, through TensorStore."""

    def __init__(self, url: str, store: Any, prefix: str):
        self.url, self._store, self._prefix = url, store, prefix

    def name(self, path: str) -> str:
        return f"{self.url.rstrip('/')}/{path}"

    def text(self, path: str, name: str) -> str | None:
        return kvstore.read_text(self._store, self._prefix + path, name, MAX_INDEX_BYTES)

    def reader(self, path: str, name: str) -> Any:
        reader = kvstore.KvstoreReader(self._store, self._prefix + path, name)
        reader.start()
        return reader


# --- opening -------------------------------------------------------------------------------------


def open_remote(url: str, format: str | None = None, step: int | None = None) -> Checkpoint:
    """A remote safetensors file or sharded repository, its headers read and validated
    as a local file's are (several shards' at once), its leaves lazy byte ranges; or an
    Orbax checkpoint, read through TensorStore's kvstore drivers as a local one is."""
    if format not in (None, "safetensors", "orbax"):
        raise UsageError(f"treecli reads safetensors and Orbax checkpoints from URLs, not {format}", file=url)
    wants_orbax = format == "orbax" or step is not None
    if url.startswith(kvstore.SCHEMES):
        store, key = kvstore.open_store(url)
        if not key.endswith((".safetensors", ".index.json")) or wants_orbax:
            return _open_bucket_directory(url, store, key, format, step)
        folder, _, path = key.rpartition("/")
        place: Any = _BucketPlace(url.rsplit("/", 1)[0], store, folder + "/" if folder else "")
    else:
        headers = _headers(url)
        if url.startswith("hf://"):
            base, inner = _hub(url)
        else:
            parts = urllib.parse.urlsplit(url)
            base = urllib.parse.urlunsplit(parts._replace(path="/", query="", fragment=""))
            inner = parts.path.lstrip("/")
        folder, _, path = inner.rstrip("/").rpartition("/")
        if not path.endswith((".safetensors", ".index.json")) or wants_orbax:
            return _open_http_directory(url, base + inner.rstrip("/") + "/" if inner.strip("/") else base, headers,
                                        format, step)
        shown = url.rsplit("/", 1)[0]
        exact = {} if url.startswith("hf://") else {urllib.parse.unquote(path): url}  # a query string and all
        place = _HttpPlace(shown, base + (folder + "/" if folder else ""), headers, exact)
        path = urllib.parse.unquote(path)
    if path.endswith(".index.json"):
        text = place.text(path, url)
        if text is None:
            raise FormatError("not found", file=url)
        return _open_sharded(url, place, text)
    return _open_file(url, _read_header(place, path, url))


def _open_http_directory(url: str, base: str, headers: dict[str, str], format: str | None,
                         step: int | None) -> Checkpoint:
    """A Hub repository or an HTTP directory: its shard index, else its model.safetensors,
    else an Orbax checkpoint in it."""
    from treecli.formats import orbax
    from treecli.formats._folder import HttpFolder

    if format != "orbax" and step is None:
        place = _HttpPlace(url.rstrip("/"), base, headers, {})
        text = place.text("model.safetensors.index.json", url)
        if text is not None:
            return _open_sharded(url, place, text)
        try:
            return _open_file(url, _read_header(place, "model.safetensors", place.name("model.safetensors")))
        except NotFoundError:
            if format == "safetensors":
                raise
    folder = HttpFolder(url, base, headers)
    if step is None and not orbax.is_checkpoint(folder):
        raise FormatError("no checkpoint here: no shard index, model.safetensors or Orbax checkpoint (an HTTP "
                          "directory cannot be listed: name a CheckpointManager step with --step)", file=url)
    return orbax.open_folder(folder, step)


def _open_bucket_directory(url: str, store: Any, key: str, format: str | None, step: int | None) -> Checkpoint:
    from treecli.formats import orbax
    from treecli.formats._folder import BucketFolder

    folder = BucketFolder.open(url, store)
    if format != "orbax" and step is None:
        place = _BucketPlace(url.rstrip("/"), store, key.strip("/") + "/" if key.strip("/") else "")
        if folder.is_file("model.safetensors.index.json"):
            return _open_sharded(url, place, place.text("model.safetensors.index.json", url) or "")
        if folder.is_file("model.safetensors"):
            return _open_file(url, _read_header(place, "model.safetensors", place.name("model.safetensors")))
    if format == "safetensors" or not orbax.is_checkpoint(folder):
        raise FormatError("no checkpoint here: no model.safetensors, shard index, or Orbax checkpoint "
                          f"({len(folder.subfolders())} subdirectories)", file=url)
    return orbax.open_folder(folder, step)


def _open_file(url: str, opened: tuple[Any, tuple]) -> Checkpoint:
    from treecli.formats import _flatkeys, safetensors
    from treecli.formats._filedata import FileArrayLeaf

    reader, (tensors, metadata, _) = opened
    items = [(name, FileArrayLeaf(reader, offset, shape, dtype)) for name, (dtype, shape, offset) in tensors.items()]
    tree, warning = _flatkeys.nest(items, ".")
    checkpoint = Checkpoint(tree=tree, format=safetensors.SafetensorsFormat.name, file=url, metadata=dict(metadata))
    checkpoint.warnings.extend([warning] if warning else [])
    checkpoint._closers.append(reader.close)
    return checkpoint


def _read_header(place: Any, path: str, name: str) -> tuple[Any, tuple]:
    from treecli.formats._safetensors_header import parse_header

    reader = place.reader(path, name)
    size = reader.size if reader.size is not None else reader.check_end
    return reader, parse_header(reader.read, size, name)


def _open_sharded(url: str, place: Any, text: str) -> Checkpoint:
    """The index, then every shard's header at once: one round trip of latency, not one per shard."""
    from treecli.formats import safetensors

    weight_map, shards = safetensors.shard_names(text, url)
    results: dict[str, Any] = {}
    slots = threading.Semaphore(CONCURRENT_SHARDS)

    def fetch(shard: str) -> None:
        with slots:
            try:
                results[shard] = _read_header(place, shard, place.name(shard))
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
    checkpoint = Checkpoint(tree=None, format=safetensors.SafetensorsFormat.name, file=url)
    safetensors.assemble_shards(checkpoint, weight_map, opened)
    return checkpoint
