"""Flax msgpack: the bytes of ``flax.serialization.to_bytes``, read without flax.

The layout is a msgpack map of maps; arrays are msgpack extension type 1
holding ``(shape, dtype name, raw bytes)``, NumPy scalars type 3, complex
numbers type 2; arrays over 1 GiB are split into a ``__msgpack_chunked_array__``
dict. Lists appear as ``{"0": ..., "1": ...}`` dicts (Flax's state dicts) and
are shown as such. The format has no index, so the whole file is read; every
extension is validated (known numeric dtype, byte length equal to shape x
itemsize) and nothing is ever unpickled.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from pathlib import Path
from typing import Any

from treecli import _dtypes, _leaf, _tree
from treecli._errors import FormatError, TreecliError
from treecli._keypath import format_keypath
from treecli.formats._base import Checkpoint, Format, Origin, WriteOptions
from treecli.formats._folder import LocalFolder, companions
from treecli._bytes.local import open_regular

_NDARRAY, _COMPLEX, _NPSCALAR = 1, 2, 3
MAX_NODES = 2_000_000  # arrays, maps and lists in one file: 20x a 100k-tensor model's
_CHUNKED = "__msgpack_chunked_array__"
_MAX_CHUNK = 2**30  # Flax's MAX_CHUNK_SIZE
_MAP_FIRST_BYTES = set(range(0x80, 0x90)) | {0xDE, 0xDF}
HF_FILE = "flax_model.msgpack"  # transformers' Flax weights in a model directory


class MsgpackFormat(Format):
    """Flax's msgpack state dicts (``flax.serialization.to_bytes``)."""

    name = "msgpack"
    holds_numbers = True  # a Python int is stored as an int, as Flax's msgpack does
    extensions = (".msgpack",)
    hf_directories = True  # (config.json beside the weights)
    writable = True
    directory_output = "safetensors"  # an HF Flax directory becomes an HF safetensors one, as transformers reads

    def sniff(self, path: Path) -> str | None:
        if path.is_dir():  # an HF Flax model: flax_model.msgpack beside config.json
            return self.in_folder(LocalFolder(path))
        if not path.name.endswith(self.extensions):
            return "not named *.msgpack"
        with open_regular(path) as f:
            first = f.read(1)
        return None if first and first[0] in _MAP_FIRST_BYTES else "does not start with a msgpack map"

    def open(self, path: Path, *, like: Any = None, step: int | None = None) -> Checkpoint:
        path = Path(path)
        if path.is_dir():
            return self.open_folder(LocalFolder(path), step=step)
        return _open(path)

    def in_folder(self, folder: Any) -> str | None:
        """An HF Flax model: its ``flax_model.msgpack`` (where the folder can be listed)."""
        return None if folder.listable and HF_FILE in folder.files() else f"no {HF_FILE}"

    def open_folder(self, folder: Any, *, step: int | None = None, entry: str | None = None) -> Checkpoint:
        if folder.local_path is None or step is not None or entry is not None:
            return super().open_folder(folder, step=step, entry=entry)
        path = folder.local_path
        checkpoint = _open(path / HF_FILE)
        checkpoint.file, checkpoint.origin = str(path), Origin("file", path / HF_FILE, [path / HF_FILE])
        checkpoint.companions = companions(path, {HF_FILE})
        return checkpoint

    def write(self, tree: Any, target: Path, options: WriteOptions) -> None:
        if target.is_dir():
            raise TreecliError("msgpack output must be a file ending in .msgpack", file=str(target))
        _write(tree, target, options)


def _open(path: Path) -> Checkpoint:
    import msgpack
    import numpy as np

    file = str(path)
    shapes: dict[tuple, tuple] = {}
    nodes = [0]

    def counted(node: Any) -> Any:
        """Every array, map and list built so far, counted: a file of a few bytes each could
        otherwise make tens of millions of Python objects (gigabytes) from 40 MB."""
        nodes[0] += 1
        if nodes[0] > MAX_NODES:
            raise _TooMany
        return node

    def ext_hook(code: int, data: bytes) -> Any:
        counted(None)
        try:
            if code in (_NDARRAY, _NPSCALAR):
                shape, dtype_name, buffer = msgpack.unpackb(data, raw=False)
                dtype = _known_dtype(dtype_name)
                shape = tuple(shape)
                if not all(isinstance(d, int) and d >= 0 for d in shape):
                    raise ValueError(f"bad shape {list(shape)}")
                if not isinstance(buffer, bytes) or len(buffer) != math.prod(shape) * dtype.itemsize:
                    raise ValueError(f"shape {list(shape)} of {dtype_name} needs "
                                     f"{math.prod(shape) * dtype.itemsize} bytes, the buffer has {len(buffer)}")
                if code == _NDARRAY:  # one shared shape tuple and dtype name for a million tiny arrays
                    return _BytesLeaf(buffer, shapes.setdefault(shape, shape), sys.intern(dtype_name))
                return np.frombuffer(buffer, dtype).reshape(shape)[()]
            if code == _COMPLEX:
                real, imag = msgpack.unpackb(data, raw=False)
                return complex(real, imag)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise _BadExtension(str(e)) from None
        raise _BadExtension(f"unknown msgpack extension type {code}")

    try:
        with open_regular(path) as f:
            data = f.read()
        tree = msgpack.unpackb(data, ext_hook=ext_hook, object_hook=counted, list_hook=counted, raw=False,
                               strict_map_key=False, max_array_len=MAX_NODES, max_map_len=MAX_NODES)
    except _TooMany:
        raise FormatError(f"holds over {MAX_NODES:,} arrays, maps and lists; no Flax state does, and holding "
                          "them would take gigabytes of memory", file=file) from None
    except _BadExtension as e:
        raise FormatError(f"bad array in the file: {e}", file=file) from None
    except RecursionError:
        raise FormatError("nested too deeply", file=file) from None
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException, msgpack.ExtraData) as e:
        # TypeError: a map or list used as a key ("unhashable"); the rest: damaged bytes
        raise FormatError(f"not valid msgpack: {type(e).__name__}: {str(e)[:200]}", file=file) from None
    if not isinstance(tree, dict):
        raise FormatError(f"the top level is a {type(tree).__name__}, not a map (Flax state dict)", file=file)
    return Checkpoint(tree=_checked(tree, (), file), format="msgpack", file=file)


class _BadExtension(Exception):
    pass


class _TooMany(Exception):
    pass


@functools.lru_cache(maxsize=64)
def _known_dtype(name: Any):
    if not isinstance(name, str):
        raise ValueError(f"dtype {name!r} is not a name")
    if not _dtypes.is_known(name):
        raise ValueError(f"dtype {name!r} is not a numeric dtype treecli reads (objects are never unpickled)")
    return _dtypes.numpy_dtype(name)


class _BytesLeaf(_leaf.ArrayLeaf):
    """An array of the file, kept as the bytes msgpack gave: a few dozen bytes of Python
    object per leaf, so that a file of a million tiny arrays stays small in memory."""

    __slots__ = ("_buffer", "shape", "dtype_name")

    def __init__(self, buffer: bytes, shape: tuple[int, ...], dtype_name: str):
        self._buffer = buffer
        self.shape = shape
        self.dtype_name = dtype_name

    def read_flat(self, start: int, stop: int):
        import numpy as np

        return np.frombuffer(self._buffer, self.dtype)[start:stop]


def _checked(node: Any, keypath: tuple, file: str) -> Any:
    """Mixed key types at one level are an error (in maps inside lists too); chunked
    arrays are reassembled; deeper than ``MAX_DEPTH`` is an error."""
    import numpy as np

    if len(keypath) > _tree.MAX_DEPTH and isinstance(node, (dict, list)):
        raise FormatError(f"nested deeper than {_tree.MAX_DEPTH} levels, more than treecli walks", file=file)
    if isinstance(node, list):
        return [_checked(v, keypath + (i,), file) for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    if node.get(_CHUNKED) is True:
        try:
            shape = tuple(node["shape"][k] for k in sorted(node["shape"], key=int))
            chunks = [node["chunks"][k] for k in sorted(node["chunks"], key=int)]
            flat = np.concatenate([c.read().reshape(-1) for c in chunks])
            return _leaf.InMemoryLeaf(flat.reshape(shape))
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise FormatError(f"bad chunked array: {type(e).__name__}: {e}", file=file,
                              keypath=format_keypath(keypath)) from None
    kinds = {type(k) for k in node}
    if len(kinds) > 1 or not kinds <= {str, int}:
        raise FormatError(f"keys of mixed types at one level ({', '.join(sorted(t.__name__ for t in kinds))})",
                          file=file, keypath=format_keypath(keypath) or "<root>")
    return {k: _checked(v, keypath + (k,), file) for k, v in node.items()}


def _write(tree: Any, target: Path, options: WriteOptions) -> None:
    """Stream the tree as Flax's layout, one leaf's bytes in memory at a time."""
    import msgpack

    packer = msgpack.Packer(use_bin_type=True)
    with open(target, "wb") as f:

        def emit(node: Any, keypath: tuple) -> None:
            if _tree.is_node(node):
                items = _tree.children(node)
                f.write(packer.pack_map_header(len(items)))
                for key, child in items:
                    f.write(packer.pack(str(key)))  # Flax state dicts have string keys: lists become {"0": ...}
                    emit(child, keypath + (key,))
            elif _leaf.is_array(node):
                leaf = _leaf.as_leaf(node)
                if leaf.nbytes > _MAX_CHUNK:
                    _emit_chunked(f, packer, leaf)
                else:
                    f.write(_array_ext(packer, leaf.shape, leaf.dtype_name, leaf.read()))
                if options.progress:
                    options.progress(leaf.nbytes)
            elif isinstance(node, (dict, list, tuple)):
                f.write(packer.pack({}))  # an empty node
            else:
                try:
                    f.write(packer.pack(node))
                except TypeError:
                    raise TreecliError(f"msgpack cannot hold a {type(node).__name__}",
                                       keypath=format_keypath(keypath)) from None

        emit(tree, ())
        f.flush()
        os.fsync(f.fileno())


def _array_ext(packer: Any, shape: tuple, dtype_name: str, array: Any) -> bytes:
    import msgpack

    payload = msgpack.packb((list(shape), dtype_name, array.tobytes()), use_bin_type=True)
    return packer.pack(msgpack.ExtType(_NDARRAY, payload))


def _emit_chunked(f: Any, packer: Any, leaf: Any) -> None:
    per = max(1, _MAX_CHUNK // leaf.itemsize)
    starts = list(range(0, leaf.size, per))
    f.write(packer.pack_map_header(3))
    f.write(packer.pack(_CHUNKED) + packer.pack(True))
    f.write(packer.pack("shape") + packer.pack({str(i): d for i, d in enumerate(leaf.shape)}))
    f.write(packer.pack("chunks") + packer.pack_map_header(len(starts)))
    for i, start in enumerate(starts):
        chunk = leaf.read_flat(start, min(leaf.size, start + per))
        f.write(packer.pack(str(i)) + _array_ext(packer, (chunk.size,), leaf.dtype_name, chunk))
