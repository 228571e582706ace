"""A toy format plugged in through the Format contract alone (tests/test_format_contract.py):
JSON text, each array leaf its dtype, shape and bytes in hex, flat keys joined with ".".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from treecli import _dtypes, _leaf, _tree
from treecli._errors import FormatError
from treecli.formats._base import Checkpoint, Format, WriteOptions
from treecli.formats._folder import LocalFolder

MAGIC = '{"toy": 1'


class ToyFormat(Format):
    name = "toy"
    extensions = (".toy",)
    remote_extensions = (".toy",)  # a URL naming a .toy file is read through open_folder
    separator = "."
    writable = True

    def sniff(self, path: Path) -> str | None:
        if path.is_dir():
            return "a directory"
        with open(path, "rb") as f:
            return None if f.read(len(MAGIC)) == MAGIC.encode() else "not a toy file"

    def open(self, path: Path, *, like: Any = None, step: int | None = None) -> Checkpoint:
        path = Path(path)
        return self.open_folder(LocalFolder(path.parent), step=step, entry=path.name)

    def open_folder(self, folder: Any, *, step: int | None = None, entry: str | None = None) -> Checkpoint:
        """A .toy file in any place (a local directory, an HTTP directory, a bucket prefix):
        read through the folder's byte source, whole (toy files are small)."""
        if entry is None:
            return super().open_folder(folder, step=step, entry=entry)
        reader = folder.reader(entry)
        try:
            document = json.loads(reader.read(0, reader.size))
        except ValueError as e:
            raise FormatError(f"not toy JSON: {e}", file=folder.named(entry)) from None
        finally:
            reader.close()
        items = []
        for key, value in document["leaves"].items():
            data = np.frombuffer(bytes.fromhex(value["hex"]), _dtypes.numpy_dtype(value["dtype"]))
            items.append((tuple(key.split(".")), _leaf.InMemoryLeaf(data.reshape(value["shape"]))))
        return Checkpoint(tree=_tree.unflatten(items), format=self.name, file=folder.named(entry))

    def write(self, tree: Any, target: Path, options: WriteOptions) -> None:
        leaves = {}
        for keypath, value in _tree.flatten(tree):
            leaf = _leaf.as_leaf(value)
            leaves[".".join(map(str, keypath))] = {"dtype": leaf.dtype_name, "shape": list(leaf.shape),
                                                   "hex": np.ascontiguousarray(leaf.read()).tobytes().hex()}
        with open(target, "w") as f:
            f.write(MAGIC + ', "leaves": ' + json.dumps(leaves) + "}")
