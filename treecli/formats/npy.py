"""NumPy's ``.npy``: one array. Read as a sequence of one record (as an ``.eqx`` file
of one leaf reads), written from a tree that is one array leaf (``get -o leaf.npy``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from treecli import _dtypes, _leaf
from treecli._bytes import writer
from treecli._bytes.local import open_regular
from treecli._errors import TreecliError, UsageError
from treecli.formats import _npy, eqx
from treecli.formats._base import WRITES, Checkpoint, Format, WriteOptions


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
            raise UsageError("an .npy file holds one array, not a checkpoint (one leaf: treecli get "
                             f"{options.source_in_hint()} KEYPATH -o leaf.npy); treecli writes {WRITES}",
                             file=str(target))
        leaf = _leaf.as_leaf(tree)
        if _dtypes.kind(leaf.dtype_name) == "V" or _dtypes.needs_ml_dtypes(leaf.dtype_name):
            raise UsageError(f"the .npy format cannot name {leaf.dtype_name} (NumPy would write raw void bytes); "
                             f"write safetensors instead: treecli get {options.source_in_hint()} KEYPATH -o "
                             "leaf.safetensors",
                             file=str(target))
        with open(target, "wb", buffering=writer.WRITE_BUFFER) as f:
            _npy.write(f, leaf, _npy.header(leaf), file=str(target), writeback=options.writeback(f),
                       progress=options.progress, digests=options.digests)

    def stored_leaves(self, tree: Any, written: Any, like: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The one array, on both sides (it is stored without a name)."""
        return {"the array": tree}, {"the array": written[0]} if written else {}


def open_array(path: Path) -> _leaf.ArrayLeaf:
    """The one array of a ``.npy`` file as a lazy leaf (``edit --set KEYPATH=@file.npy``): the
    header now, the data by positional reads when asked, never a memory map (which a file
    truncated meanwhile turns into SIGBUS). Fortran-order and big-endian files, rare, are
    read whole, in C order and native byte order. No pickles, ever.

    Raises:
        UsageError: no such file, or not one array of numbers.
    """
    import numpy as np

    path = Path(path)
    if not path.exists():
        raise UsageError("no such file", file=str(path))
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            _, fortran, dtype = read_header(f)
        if fortran or dtype.byteorder == ">":
            return _leaf.InMemoryLeaf(np.load(path, allow_pickle=False))
        records = eqx.open_records(path, None, format="npy").tree
    except TreecliError as e:
        raise UsageError(f"cannot read it as a .npy array: {e.message}", file=str(path)) from None
    except (ValueError, OSError, EOFError) as e:
        raise UsageError(f"cannot read it as a .npy array: {e}", file=str(path)) from None
    if len(records) != 1:
        raise UsageError(f"holds {len(records)} .npy records, not one array", file=str(path))
    return records[0]
