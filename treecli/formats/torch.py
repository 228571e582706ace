"""PyTorch's ``torch.save`` files (``.bin``, ``.pt``, ``.pth``), read without torch and
without running anything from them.

Two layouts:

- the zip (PyTorch >= 1.6): ``NAME/data.pkl`` (the pickled object), ``NAME/data/KEY``
  (each storage's bytes, stored uncompressed), ``NAME/byteorder``; ``NAME`` is the
  file's stem when saved, so it is found, not assumed;
- the legacy stream (``_use_new_zipfile_serialization=False``, PyTorch < 1.6): four
  pickles (magic number, protocol, system info, the object), a pickled list of storage
  keys, then each storage as an 8-byte element count and its bytes.

The pickle is read by :mod:`._unpickle` with an allowlist of the globals PyTorch's
``weights_only=True`` loader accepts for dense tensors (rebuild functions, storage
types, dtypes, ``OrderedDict``, ``torch.Size``, plain containers): a file naming
anything else is refused, naming the global. Each tensor becomes a lazy leaf over its
storage's bytes: a C-contiguous one reads its byte ranges; a view with other strides
(a transposed or strided slice) reads the span of storage it covers, once. Several
tensors may share a storage. Dotted keys nest as safetensors' names do, so that
``pytorch_model.bin`` and ``model.safetensors`` of one model have the same key paths.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

from treecli import _leaf
from treecli._bytes.local import open_regular
from treecli._errors import FormatError, UsageError, option
from treecli.formats._base import Checkpoint, Format, Origin, WriteOptions
from treecli.formats._folder import LocalFolder, companions_of, presumed
from treecli.formats._torch_pickle import LEGACY_HEAD, is_legacy, items_of, read_legacy, read_zip, tree_of


class TorchFormat(Format):
    """PyTorch's ``torch.save`` files, zip or legacy, read lazily and safely."""

    name = "torch"
    extensions = (".bin", ".pt", ".pth")
    hf_directories = True  # (config.json beside the weights)
    remote_extensions = (".bin.index.json", ".bin", ".pt", ".pth")
    writable = True
    holds_numbers = True  # a step counter stays a Python int, as in a training checkpoint
    directory_output = "safetensors"  # an HF directory of .bin shards becomes one of safetensors

    def write(self, tree: Any, target: Path, options: WriteOptions) -> None:
        from treecli.formats import _torch_write

        _torch_write.write(tree, target, options)

    def sniff(self, path: Path) -> str | None:
        if path.is_dir():
            return self.in_folder(LocalFolder(path))
        if path.name.endswith(".bin.index.json"):
            return None
        with open_regular(path) as f:
            head = f.read(LEGACY_HEAD)
        if is_legacy(head):
            return None
        if not head.startswith(b"PK\x03\x04"):
            return "neither a zip nor a legacy torch.save stream"
        try:
            with zipfile.ZipFile(path) as z:  # (opening says which data.pkl is missing or ambiguous)
                return None if any(n.endswith("/data.pkl") for n in z.namelist()) else "a zip without NAME/data.pkl"
        except (zipfile.BadZipFile, OSError, ValueError):
            return "not a readable zip"

    def open(self, path: Path, *, like: Any = None, step: int | None = None) -> Checkpoint:
        path = Path(path)
        if path.is_dir():
            return self.open_folder(LocalFolder(path), step=step)
        return self.open_folder(LocalFolder(path.parent), step=step, entry=path.name)

    def in_folder(self, folder: Any) -> str | None:
        """An HF directory's PyTorch weights: its shard index, else ``pytorch_model.bin``
        (over HTTP, which cannot list it, presumed: opening says if it is not there)."""
        if not folder.listable or {_INDEX, _SINGLE} & set(folder.files()):
            return None
        return f"no {_INDEX} or {_SINGLE}"

    def open_folder(self, folder: Any, *, step: int | None = None, entry: str | None = None) -> Checkpoint:
        """A torch.save file (``entry``), or an HF directory of them: its shard index
        (named, or ``pytorch_model.bin.index.json``) and shards, else its
        ``pytorch_model.bin``; in any place, each read by byte ranges through the folder."""
        if step is not None:
            raise UsageError(f"{option('step', step)} picks a step of an Orbax CheckpointManager; this is PyTorch",
                             file=folder.named(entry) if entry else folder.name)
        name = entry or (_INDEX if folder.is_file(_INDEX) else _SINGLE)
        local = folder.local_path
        checkpoint = Checkpoint(tree=None, format=self.name, file=folder.named(name) if entry else folder.name)

        def shard_items(shard: str) -> list[tuple[str, Any]]:
            reader = folder.reader(shard)
            checkpoint._closers.append(reader.close)
            if reader.size is None:  # a bucket's answers say no size, and a zip is read from its end
                raise UsageError("treecli reads PyTorch files over HTTP and from the Hub; from a bucket, copy the "
                                 "file here first", file=folder.named(shard))
            return source_items(reader, checkpoint.warnings)

        if name.endswith(".bin.index.json"):
            present = set(folder.files()) if folder.listable else None

            def present_shard_items(shard: str) -> list[tuple[str, Any]]:
                if present is not None and shard not in present:
                    raise FormatError(f"shard {shard!r} named by the index is missing (interrupted download?)",
                                      file=folder.named(name))
                return shard_items(shard)

            items, shards = _shard_items(folder.read_text(name), folder.named(name), present_shard_items)
            files = [name, *shards]
        else:
            with presumed(folder, entry, f"no {_INDEX} or {_SINGLE}"):
                items, files = shard_items(name), [name]
        _fill(checkpoint, items)
        if local is not None:
            checkpoint.origin = Origin("sharded" if len(files) > 1 else "file", local / name,
                                       [local / f for f in files])
        if entry is None:
            checkpoint.companions = companions_of(folder, set(files))
        return checkpoint


def _fill(checkpoint: Checkpoint, items: list[tuple[str, Any]]) -> None:
    checkpoint.tree = tree_of(items, checkpoint.warnings)


_INDEX = "pytorch_model.bin.index.json"
_SINGLE = "pytorch_model.bin"


def source_items(source: Any, warnings: list[str] | None = None) -> list[tuple[str, Any]]:
    """The items of a torch.save file in a byte source of known ``size`` (local or remote),
    its leaves lazy byte ranges of it."""
    import numpy as np

    head = np.empty(min(source.size, LEGACY_HEAD), np.uint8)
    source.read_into(head, 0)
    legacy = is_legacy(head.tobytes())
    obj, places = read_legacy(source) if legacy else read_zip(source, (0, source.size))
    return items_of(obj, places, source, source.path, warnings)


def _shard_items(index_text: str, file: str, shard_items: Any) -> tuple[list[tuple[str, Any]], list[str]]:
    """The items of every shard an index names (``shard_items(name)`` opens one), each
    tensor checked to be in the shard the index maps it to; and the shards."""
    from treecli.formats.safetensors import shard_names

    weight_map, shards = shard_names(index_text, file)
    items = []
    for shard in shards:
        for key, value in shard_items(shard):
            if _leaf.is_array(value) and weight_map.get(key) != shard:
                raise FormatError(f"tensor is stored in shard {shard} but the index maps it to "
                                  f"{weight_map.get(key)!r}", file=file, keypath=key)
            items.append((key, value))
    missing = sorted(set(weight_map) - {key for key, _ in items})
    if missing:
        raise FormatError(f"the index names {len(missing)} tensors no shard holds (e.g. {missing[0]})", file=file)
    return items, shards
