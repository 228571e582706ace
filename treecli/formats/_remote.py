"""Checkpoints where they live: HTTP(S), the Hugging Face Hub, S3 and GCS.

Safetensors files and HF layouts (and PyTorch and GGUF files over HTTP) are read by byte ranges through a source of
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

from treecli._bytes import kvstore
from treecli._bytes.http import NotFoundError
from treecli._errors import FormatError, UsageError
from treecli.formats._base import Checkpoint

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


# --- opening -------------------------------------------------------------------------------------


def open_remote(url: str, format: str | None = None, step: int | None = None) -> Checkpoint:
    """A remote safetensors file or sharded repository, its headers read and validated
    as a local file's are (several shards' at once), its leaves lazy byte ranges; or an
    Orbax checkpoint, read through TensorStore's kvstore drivers as a local one is."""
    from treecli.formats._folder import BucketFolder, HttpFolder

    if format not in (None, "safetensors", "orbax", "dcp", *_FILES.values()):
        raise UsageError(f"treecli reads safetensors, Orbax, PyTorch and GGUF checkpoints from URLs, not {format}",
                         file=url)
    names_a_file = format != "orbax" and step is None
    if url.startswith(kvstore.SCHEMES):
        store, key = kvstore.open_store(url)
        if not (key.endswith((".safetensors", ".index.json", *_FILES)) and names_a_file):
            return _open_directory(url, BucketFolder.open(url, store), format, step)
        parent, _, path = key.rpartition("/")
        folder: Any = BucketFolder.unlisted(url.rsplit("/", 1)[0], store, parent + "/" if parent else "")
    else:
        headers = _headers(url)
        if url.startswith("hf://"):
            base, inner = _hub(url)
        else:
            parts = urllib.parse.urlsplit(url)
            base = urllib.parse.urlunsplit(parts._replace(path="/", query="", fragment=""))
            inner = parts.path.lstrip("/")
        parent, _, path = inner.rstrip("/").rpartition("/")
        if not (path.endswith((".safetensors", ".index.json", *_FILES)) and names_a_file):
            directory = base + inner.rstrip("/") + "/" if inner.strip("/") else base
            return _open_directory(url, HttpFolder(url, directory, headers), format, step)
        exact = {} if url.startswith("hf://") else {urllib.parse.unquote(path): url}  # a query string and all
        folder = HttpFolder(url.rsplit("/", 1)[0], base + (parent + "/" if parent else ""), headers, files=exact)
        path = urllib.parse.unquote(path)
    if path.endswith(".index.json"):
        text = folder.text(path)
        if text is None:
            raise FormatError("not found", file=url)
        return _open_sharded(url, folder, text)
    other = next((name for extension, name in _FILES.items() if path.endswith(extension)), None)
    if other is not None:
        return _open_other(url, folder.reader(path), other)
    return _open_file(url, _read_header(folder, path))


# Files of other formats read from URLs by byte ranges, by their extension.
_FILES = {".gguf": "gguf", ".bin": "torch", ".pt": "torch", ".pth": "torch"}


def _open_other(url: str, reader: Any, format: str) -> Checkpoint:
    """A PyTorch or GGUF file, its header (or zip directory and pickle) read by byte ranges,
    its leaves lazy byte ranges, as a local file's are."""
    import importlib

    if reader.size is None:  # a bucket's answers say no size, and a zip is read from its end
        raise UsageError("treecli reads PyTorch and GGUF files over HTTP and from the Hub; from a bucket, copy the "
                         "file here first", file=url)
    checkpoint = importlib.import_module(f"treecli.formats.{format}").open_source(reader)
    checkpoint.file = url
    return checkpoint


def _open_directory(url: str, folder: Any, format: str | None, step: int | None) -> Checkpoint:
    """A Hub repository, an HTTP directory or a bucket prefix, as an HF directory is read
    (``_folder.hf_weights``): its shard index, else its safetensors file, else an Orbax
    checkpoint in it."""
    from treecli.formats import orbax
    from treecli.formats._folder import hf_weights

    found = hf_weights(folder) if format != "orbax" and step is None else None
    if found is not None:
        kind, name = found
        if kind == "index":
            return _open_sharded(url, folder, folder.text(name) or "")
        try:
            return _open_file(url, _read_header(folder, name))
        except NotFoundError:  # (an HTTP directory's presumed model.safetensors)
            if format == "safetensors":
                raise
    from treecli.formats import dcp

    if format in (None, "dcp") and step is None and dcp.in_folder(folder):
        return dcp.open_folder(folder)
    if format in (None, "torch") and step is None:
        from treecli.formats import torch

        opened = torch.open_folder(folder, url)
        if opened is not None:
            return opened
    if format == "safetensors" or (step is None and not orbax.is_checkpoint(folder)):
        how = (f"{len(folder.subfolders())} subdirectories" if folder.listable else
               "an HTTP directory cannot be listed: name a CheckpointManager step with --step")
        raise FormatError(f"no checkpoint here: no shard index, model.safetensors, pytorch_model.bin or Orbax "
                          f"checkpoint ({how})",
                          file=url)
    return orbax.open_folder(folder, step)


def _open_file(url: str, opened: tuple[Any, tuple]) -> Checkpoint:
    from treecli.formats import _flatkeys, safetensors
    from treecli.formats._safetensors_header import tensor_leaf

    reader, (tensors, metadata, _) = opened
    items = [(name, tensor_leaf(reader, offset, shape, dtype)) for name, (dtype, shape, offset) in tensors.items()]
    tree, warning = _flatkeys.nest(items, ".")
    checkpoint = Checkpoint(tree=tree, format=safetensors.SafetensorsFormat.name, file=url, metadata=dict(metadata))
    checkpoint.warnings.extend([warning] if warning else [])
    checkpoint._closers.append(reader.close)
    return checkpoint


def _read_header(folder: Any, path: str) -> tuple[Any, tuple]:
    from treecli.formats._safetensors_header import parse_header

    reader = folder.reader(path)
    size = reader.size if reader.size is not None else reader.check_end
    return reader, parse_header(reader.read, size, folder.named(path))


def _open_sharded(url: str, folder: Any, text: str) -> Checkpoint:
    """The index, then every shard's header at once: one round trip of latency, not one per shard."""
    from treecli.formats import safetensors

    weight_map, shards = safetensors.shard_names(text, url)
    results: dict[str, Any] = {}
    slots = threading.Semaphore(CONCURRENT_SHARDS)

    def fetch(shard: str) -> None:
        with slots:
            try:
                results[shard] = _read_header(folder, shard)
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
