"""A place that holds a checkpoint: a local directory, a key prefix in an S3 or GCS
bucket, or an HTTP(S) directory (a Hub repository). ``Folder`` says what formats ask of
one, whatever the place: which files and subdirectories it holds, a small file's text,
a byte source for a file, and the TensorStore kvstore spec of a file or subdirectory.
Every format that reads directories (or files over the network) opens from a Folder:
one road, local or remote alike.

A bucket's keys under the prefix are listed once, when it is opened, and the
answers come from that list: a CheckpointManager root costs one listing, not a
request per question.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import urllib.parse
from pathlib import Path
from typing import Any, Iterator, Protocol, runtime_checkable

from treecli._errors import FormatError
from treecli.formats._base import NotInFolder

from treecli._bytes.local import MAX_TEXT_BYTES  # metadata files (_METADATA, _CHECKPOINT_METADATA) are far smaller
MAX_KEYS = 1_000_000  # a listing longer than this is no checkpoint directory


@runtime_checkable
class Folder(Protocol):
    """A place that holds a checkpoint's files, as formats read it."""

    #: The place as the user names it (a path or URL), for messages and ``Checkpoint.file``.
    name: str
    #: Whether its files can be listed (an HTTP directory's cannot: they are asked for by name).
    listable: bool
    #: The directory on this machine, where it is one (``--in-place`` and companion files
    #: need one); None for a remote place.
    local_path: Path | None
    #: How many files' headers are best read at once (a round trip each, remotely).
    parallel_reads: int

    def child(self, name: str) -> "Folder":
        """The subdirectory ``name``."""

    def named(self, name: str) -> str:
        """A file's name as the user would write it (a path or URL), for messages."""

    def files(self) -> list[str]:
        """The names of the entries directly in it that are not directories (listable only)."""

    def is_file(self, name: str) -> bool:
        """Whether it holds a file ``name`` (asked for, where it cannot be listed)."""

    def subfolders(self) -> list[str]:
        """The names of its subdirectories (those it can know)."""

    def read_text(self, name: str) -> str:
        """A small file's text; an error if there is none."""

    def text(self, name: str) -> str | None:
        """A small file's text, or None if there is no such file."""

    def reader(self, name: str) -> Any:
        """A file as a byte source of ``treecli._bytes`` (``read``, ``read_into``, ``size``)."""

    def kvstore(self, name: str = "") -> dict[str, Any]:
        """The TensorStore kvstore spec of a file or subdirectory (Orbax's arrays)."""

    def inside(self, name: str) -> str | None:
        """``name`` if it stays inside the folder, else None (a path that escapes it)."""


class LocalFolder:
    listable = True
    parallel_reads = 1  # (local headers are read faster one after another than by threads)

    def __init__(self, path: Path):
        self.path = Path(path)
        self.local_path = self.path
        self.name = str(path)

    def child(self, name: str) -> "LocalFolder":
        return LocalFolder(self.path / name)

    def is_file(self, name: str) -> bool:
        return (self.path / name).is_file()

    def subfolders(self) -> list[str]:
        try:
            return sorted(entry.name for entry in self.path.iterdir() if entry.is_dir())
        except OSError:
            return []

    def named(self, name: str) -> str:
        return str(self.path / name)

    def files(self) -> list[str]:
        """The names of the entries directly in it that are not directories (a FIFO named
        like a shard is listed, so that opening it refuses it, never passes it over)."""
        try:
            return sorted(entry.name for entry in os.scandir(self.path) if not entry.is_dir())
        except OSError:
            return []

    def read_text(self, name: str) -> str:
        from treecli._bytes.local import read_text

        return read_text(self.path / name)

    def text(self, name: str) -> str | None:
        """A small file's text, or None if there is no such file (a FIFO or a device by
        that name is refused, never taken for none)."""
        return self.read_text(name) if os.path.lexists(self.path / name) else None

    def reader(self, name: str) -> Any:
        """A regular file as a byte source (a FIFO or a device is refused)."""
        from treecli._bytes.local import FileReader

        return FileReader.opened(self.path / name)

    def kvstore(self, name: str = "") -> dict[str, Any]:
        return {"driver": "file", "path": os.path.abspath(self.path / name) + ("/" if name else "")}

    def inside(self, name: str) -> str | None:
        """``name`` if the file it names lies inside the directory, else None (an absolute
        name, ``..`` or a symlink out would read a host file into an output)."""
        root = os.path.realpath(self.path)
        return name if os.path.realpath(os.path.join(root, name)).startswith(root + os.sep) else None


class BucketFolder:
    local_path = None
    parallel_reads = 16

    def __init__(self, url: str, store: Any, spec: dict[str, Any], keys: frozenset[str] | None):
        self.name = url.rstrip("/")
        self._store = store  # opened at the bucket's root; ``spec["path"]`` is this folder's prefix
        self._spec = spec
        self.keys = keys  # every key under the prefix, relative to it; None: not listed
        self.listable = keys is not None

    @classmethod
    def unlisted(cls, url: str, store: Any, prefix: str) -> "BucketFolder":
        """The folder at ``url`` (key prefix ``prefix``) without listing it: for reading files
        named already (a .safetensors object and its shards)."""
        from treecli._bytes import kvstore

        scheme, bucket, _ = kvstore.split_url(url)
        return cls(url, store, {**kvstore.spec(scheme, bucket), "path": prefix}, None)

    @classmethod
    def open(cls, url: str, store: Any = None) -> "BucketFolder":
        """The folder at ``url``, listed; ``store`` is its bucket's kvstore if already open."""
        import tensorstore as ts

        from treecli._bytes import kvstore

        scheme, bucket, key = kvstore.split_url(url)
        prefix = key.strip("/") + "/" if key.strip("/") else ""
        spec = kvstore.spec(scheme, bucket)
        if store is None:
            store, _ = kvstore.open_store(url)
        try:
            end = prefix[:-1] + chr(ord("/") + 1) if prefix else ""  # every key that starts with prefix
            keys = store.list(ts.KvStore.KeyRange(prefix, end), strip_prefix_length=len(prefix)).result()
        except Exception as e:
            raise kvstore.describe(e, url) from None
        if len(keys) > MAX_KEYS:
            raise FormatError(f"holds over {MAX_KEYS} objects; no checkpoint directory does", file=url)
        return cls(url, store, {**spec, "path": prefix}, frozenset(k.decode("utf-8", "replace") for k in keys))

    def child(self, name: str) -> "BucketFolder":
        inner = name.rstrip("/") + "/"
        keys = None if self.keys is None else frozenset(k[len(inner):] for k in self.keys if k.startswith(inner))
        return BucketFolder(f"{self.name}/{name}", self._store, {**self._spec, "path": self._spec["path"] + inner},
                            keys)

    def named(self, name: str) -> str:
        return f"{self.name}/{name}"

    def files(self) -> list[str]:
        """The names of the objects directly under its prefix (a listed folder's)."""
        return sorted(k for k in self.keys or () if "/" not in k)

    def is_file(self, name: str) -> bool:
        return name in self.keys if self.keys is not None else self.text(name) is not None

    def subfolders(self) -> list[str]:
        return sorted({k.split("/", 1)[0] for k in self.keys if "/" in k})

    def read_text(self, name: str) -> str:
        text = self.text(name)
        if text is None:
            raise FormatError("not found (deleted while it was read?)", file=f"{self.name}/{name}")
        return text

    def text(self, name: str) -> str | None:
        """A small object's text, or None if there is no such object."""
        from treecli._bytes import kvstore

        return kvstore.read_text(self._store, self._spec["path"] + name, f"{self.name}/{name}", MAX_TEXT_BYTES)

    def reader(self, name: str) -> Any:
        """An object as a byte source, its size and generation learnt."""
        from treecli._bytes import kvstore

        reader = kvstore.KvstoreReader(self._store, self._spec["path"] + name, f"{self.name}/{name}")
        reader.start()
        return reader

    def kvstore(self, name: str = "") -> dict[str, Any]:
        return {**self._spec, "path": self._spec["path"] + (name.rstrip("/") + "/" if name else "")}

    def inside(self, name: str) -> str | None:
        return _relative_inside(name)


class HttpFolder:
    """A directory on an HTTP(S) server or the Hub. It cannot be listed: files are
    asked for by name (metadata files are small, fetched once and kept), and a
    CheckpointManager step's items are the ones its ``_CHECKPOINT_METADATA`` names."""

    listable = False
    local_path = None
    parallel_reads = 16

    def __init__(self, url: str, base: str, headers: dict[str, str], texts: dict[str, str | None] | None = None,
                 files: dict[str, str] | None = None):
        self.name = url.rstrip("/")
        self._base = base if base.endswith("/") else base + "/"
        self._headers = headers
        self._texts = {} if texts is None else texts  # by URL, shared with its children: each fetched once
        self._files = files or {}  # a name -> the exact URL the user gave for it (a query string and all)

    def child(self, name: str) -> "HttpFolder":
        return HttpFolder(f"{self.name}/{name}", self._base + urllib.parse.quote(name) + "/", self._headers,
                          self._texts)

    def named(self, name: str) -> str:
        return f"{self.name}/{name}"

    def is_file(self, name: str) -> bool:
        return self.text(name) is not None

    def files(self) -> list[str]:
        """None known: an HTTP directory cannot be listed (``listable`` is false)."""
        return []

    def reader(self, name: str) -> Any:
        """A file as a byte source, its size, identity and final location learnt."""
        from treecli._bytes.http import HttpReader

        reader = HttpReader(self._url(name), self._headers, self.named(name))
        reader.start()
        return reader

    def subfolders(self) -> list[str]:
        """A step's items, from its metadata; other directories cannot be listed."""
        if not self.is_file("_CHECKPOINT_METADATA"):
            return []
        try:
            handlers = json.loads(self.read_text("_CHECKPOINT_METADATA")).get("item_handlers")
        except (ValueError, AttributeError):
            return []
        return sorted(name for name in handlers if isinstance(name, str)) if isinstance(handlers, dict) else []

    def read_text(self, name: str) -> str:
        text = self.text(name)
        if text is None:
            raise FormatError("not found (HTTP 404)", file=f"{self.name}/{name}")
        return text

    def kvstore(self, name: str = "") -> dict[str, Any]:
        from treecli._bytes.http import tensorstore_deadlines

        tensorstore_deadlines()
        url = self._base + (urllib.parse.quote(name.rstrip("/")) + "/" if name else "")
        return {"driver": "http", "base_url": url,
                "headers": [f"{k}: {v}" for k, v in self._headers.items() if k == "Authorization"]}

    def inside(self, name: str) -> str | None:
        return _relative_inside(name)

    def _url(self, name: str) -> str:
        return self._files.get(name) or self._base + urllib.parse.quote(name)

    def text(self, name: str) -> str | None:
        """A small file's text (fetched once), or None if the server has none."""
        url = self._url(name)
        if url not in self._texts:
            from treecli._bytes import small_text
            from treecli._bytes.http import get_small

            shown = f"{self.name}/{name}"
            self._texts[url] = small_text(get_small(url, self._headers, shown, MAX_TEXT_BYTES), MAX_TEXT_BYTES, shown)
        return self._texts[url]


HUB_INDEX = "model.safetensors.index.json"
INDEX_SUFFIX = ".safetensors.index.json"


def hf_weights(folder: Any) -> tuple[str, str] | None:
    """Where an HF directory keeps its safetensors weights, the one lookup for every place:
    ``("index", NAME)`` for a shard index, ``("file", NAME)`` for a single file, None for
    neither. A folder that can be listed (local, a bucket prefix) holds one
    ``*.safetensors.index.json``, else one ``*.safetensors`` (dot-files aside); an HTTP
    directory, which cannot be, the names the Hub uses (its ``model.safetensors`` is then
    only presumed: opening it says if it is missing).

    Raises:
        FormatError: several indexes, or several files and no index.
    """
    if not folder.listable:
        return ("index", HUB_INDEX) if folder.text(HUB_INDEX) is not None else ("file", "model.safetensors")
    names = [name for name in folder.files() if not name.startswith(".")]
    indexes = [name for name in names if name.endswith(INDEX_SUFFIX)]
    if len(indexes) > 1:
        raise FormatError(f"directory holds several shard indexes ({', '.join(indexes)}); name one of them",
                          file=folder.name)
    if indexes:
        return "index", indexes[0]
    files = [name for name in names if name.endswith(".safetensors")]
    if len(files) > 1:
        raise FormatError("directory holds several *.safetensors files but no *.safetensors.index.json; name one file",
                          file=folder.name)
    return ("file", files[0]) if files else None


# Weights in other formats beside a checkpoint's own (pytorch_model.bin, tf_model.h5,
# flax_model.msgpack, their indexes): never copied beside new weights, where they would
# be stale and take precedence in some loaders.
_OTHER_WEIGHTS = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|onnx|gguf|npz|pkl)(\.index\.json)?")


def companions(directory: Path, checkpoint_files: set[str]) -> list[Path]:
    """What a directory output copies from an input directory: its other files and
    sub-directories (config.json, tokenizer files, sentence-transformers' 1_Pooling/),
    not dot-files, not weights. A symlink is followed only into the directory itself or,
    for a Hugging Face cache snapshot, into the cache's blobs: a link elsewhere could
    copy a host file into the output."""
    real = os.path.realpath(directory)
    blobs = os.path.realpath(os.path.join(directory, "..", "..", "blobs"))
    out = []
    for p in sorted(directory.iterdir()):
        if p.name.startswith(".") or p.name in checkpoint_files or _OTHER_WEIGHTS.fullmatch(p.name):
            continue
        target = os.path.realpath(p)
        if p.is_symlink() and not any(target.startswith(root + os.sep) for root in (real, blobs)):
            continue
        if p.is_file() or (p.is_dir() and not p.is_symlink()):
            out.append(p)
    return out


@contextlib.contextmanager
def presumed(folder: Folder, entry: str | None, why: str) -> Iterator[None]:
    """Opening a file a format only presumed a folder holds (it cannot list an HTTP
    directory, so it asks for the layout's name: its ``model.safetensors``): the server
    having none (HTTP 404) is no checkpoint of this format, ``why`` (``NotInFolder``: the
    next format is tried). A file the user named (``entry``) is never presumed."""
    if entry is not None or folder.listable:
        yield
        return
    from treecli._bytes.http import NotFoundError

    try:
        yield
    except NotFoundError:
        raise NotInFolder(why, file=folder.name) from None


def companions_of(folder: Folder, checkpoint_files: set[str]) -> list[Path]:
    """A local folder's companions (``companions``); a remote one's are not copied."""
    return companions(folder.local_path, checkpoint_files) if folder.local_path is not None else []


def _relative_inside(name: str) -> str | None:
    """``name`` if, as a key under a prefix or a URL path, it stays below it (no leading
    ``/``, no ``..``, no empty segment), else None."""
    parts = name.split("/")
    return None if name.startswith("/") or ".." in parts or "" in parts else name

