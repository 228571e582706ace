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

MAGIC = '{"toy": 1'


class ToyFormat(Format):
    name = "toy"
    extensions = (".toy",)
    separator = "."
    writable = True

    def sniff(self, path: Path) -> str | None:
        if path.is_dir():
            return "a directory"
        with open(path, "rb") as f:
            return None if f.read(len(MAGIC)) == MAGIC.encode() else "not a toy file"

    def open(self, path: Path, *, like: Any = None, step: int | None = None) -> Checkpoint:
        try:
            document = json.loads(Path(path).read_text())
        except ValueError as e:
            raise FormatError(f"not toy JSON: {e}", file=str(path)) from None
        items = []
        for key, entry in document["leaves"].items():
            data = np.frombuffer(bytes.fromhex(entry["hex"]), _dtypes.numpy_dtype(entry["dtype"]))
            items.append((tuple(key.split(".")), _leaf.InMemoryLeaf(data.reshape(entry["shape"]))))
        return Checkpoint(tree=_tree.unflatten(items), format=self.name, file=str(path))

    def write(self, tree: Any, target: Path, options: WriteOptions) -> None:
        leaves = {}
        for keypath, value in _tree.flatten(tree):
            leaf = _leaf.as_leaf(value)
            leaves[".".join(map(str, keypath))] = {"dtype": leaf.dtype_name, "shape": list(leaf.shape),
                                                   "hex": np.ascontiguousarray(leaf.read()).tobytes().hex()}
        with open(target, "w") as f:
            f.write(MAGIC + ', "leaves": ' + json.dumps(leaves) + "}")
