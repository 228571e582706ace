"""Checkpoints where they live: safetensors over HTTP(S) and from the Hugging Face Hub,
read by byte ranges.

The bytes move through a source of ``treecli._bytes`` (``HttpReader``), so the
same lazy leaves read local and remote files, and only the bytes a command
needs move.

``hf://ORG/REPO[@REVISION][/PATH]`` resolves to the Hub's
``{HF_ENDPOINT}/ORG/REPO/resolve/REVISION/PATH``; a repository without a path
to its ``model.safetensors.index.json``, else its ``model.safetensors``, as a
local HF directory. ``HF_TOKEN`` is sent to the Hub only. Plain HTTP(S) servers
are read anonymously.
"""

from __future__ import annotations

import os
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from treecli._bytes.http import TIMEOUT_S, HttpReader, status_error
from treecli._errors import FormatError, TreecliError, UsageError
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


def _get_text(url: str, headers: dict[str, str], name: str) -> str | None:
    """A small text file (an index), or None if it does not exist."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S) as response:
            body = response.read(MAX_INDEX_BYTES + 1)
    except urllib.error.HTTPError as e:
        e.close()
        if e.code == 404:
            return None
        raise status_error(e.code, e.reason, name) from None
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
    checkpoint._closers.append(reader.close)
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
