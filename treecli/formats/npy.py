"""NumPy's ``.npy``: one array. Read as a sequence of one record (as an ``.eqx`` file
of one leaf reads), written from a tree that is one array leaf (``get -o leaf.npy``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from treecli import _dtypes, _leaf
from treecli._bytes import stream
from treecli._bytes.local import open_regular
from treecli._errors import UsageError
from treecli.formats import _npy, eqx
from treecli.formats._base import Checkpoint, Format, WriteOptions


class NpyFormat(Format):
    """One ``np.save`` record in a file named ``*.npy``."""

    name = "npy"
    extensions = (".npy",)
    writable = True

    def sniff(self, path: Path) -> str | None:
        if path.is_dir() or not path.name.endswith(self.extensions):
            return "not a file named *.npy"
        with open_regular(path) as f:
            return None if f.read(6) == _npy.MAGIC else "does not start with a .npy record"

    def open(self, path: Path, *, like: Any = None, step: int | None = None) -> Checkpoint:
        return eqx.open_records(Path(path), like, format=self.name)

    def write(self, tree: Any, target: Path, options: WriteOptions) -> None:
        if not _leaf.is_array(tree):
            from treecli.formats import WRITES

            raise UsageError("an .npy file holds one array, not a checkpoint (one leaf: treecli get CKPT KEYPATH -o "
                             f"leaf.npy); treecli writes {WRITES}", file=str(target))
        leaf = _leaf.as_leaf(tree)
        if _dtypes.kind(leaf.dtype_name) == "V" or _dtypes.needs_ml_dtypes(leaf.dtype_name):
            raise UsageError(f"the .npy format cannot name {leaf.dtype_name} (NumPy would write raw void bytes); "
                             "write safetensors instead: treecli edit CKPT --delete ... -o leaf.safetensors",
                             file=str(target))
        with open(target, "wb", buffering=stream.WRITE_BUFFER) as f:
            _npy.write(f, leaf, _npy.header(leaf), file=str(target), writeback=options.writeback(f),
                       progress=options.progress, digests=options.digests)

    def stored_leaves(self, tree: Any, written: Any, like: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The one array, on both sides (it is stored without a name)."""
        return {"the array": tree}, {"the array": written[0]} if written else {}
