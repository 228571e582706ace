"""Equinox ``.eqx`` files (``eqx.tree_serialise_leaves``): ``.npy`` records one after another.

An ``.eqx`` file is the model's array leaves saved one after another with
``np.save``, in JAX's flatten order: bare ``.npy`` records, no names (those
live in the model's code). Without a template it opens as an unnamed sequence
``[0]``, ``[1]``, ... of lazy leaves read from each record's header; with one
(``like``, the CLI's ``--like MODULE:ATTR``) record *i* is the template's
*i*-th array leaf and takes its key path, its shape and dtype checked. A
``.npy`` file (``formats.npy``) is read the same way, as a sequence of one.

Writing follows ``tree_serialise_leaves``: one record per array leaf, in the
pytree's own order (``WriteOptions.like``, whose shapes and dtypes each record must
have, so that the model loads it; else JAX's order of the tree:
dict keys sorted, sequences in order), bfloat16 as ``<V2`` as ``jnp.save``
writes it, so that ``eqx.tree_deserialise_leaves`` reads the file back.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from treecli import _dtypes, _leaf, _pytree, _tree
from treecli._bytes import writer
from treecli._bytes.local import FileReader, identity, open_regular
from treecli._errors import FormatError, RefusedError, StructureError, TreecliError, counted
from treecli._keypath import KeyPath, format_keypath
from treecli.formats import _npy
from treecli.formats._base import Checkpoint, Format, WriteOptions
from treecli.formats._filedata import FileArrayLeaf


class EqxFormat(Format):
    """Equinox's ``tree_serialise_leaves``: ``.npy`` records one after another, no names."""

    name = "eqx"
    extensions = (".eqx",)
    writable = True

    def sniff(self, path: Path) -> str | None:
        if path.is_dir():
            return "a directory"
        with open_regular(path) as f:
            return None if f.read(6) == _npy.MAGIC else "does not start with a .npy record"

    def open(self, path: Path, *, like: Any = None, step: int | None = None) -> Checkpoint:
        return open_records(Path(path), like)

    def write(self, tree: Any, target: Path, options: WriteOptions) -> None:
        _write(tree, target, options)

    def stored_leaves(self, tree: Any, written: Any, like: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """An ``.eqx`` file stores no names: record *i* is named after the *i*-th leaf the
        writer took (in the model's order)."""
        taken = records(tree, WriteOptions(drop_unsupported=True, like=like), "")
        names = [f"[{i}] {text}" for i, (text, _) in enumerate(taken)]
        return (dict(zip(names, (leaf for _, leaf in taken))),
                {names[i] if i < len(names) else f"[{i}]": leaf for i, leaf in enumerate(written)})


def open_records(path: Path, like: _pytree.Structure | None, format: str = "eqx") -> Checkpoint:
    """A file of ``.npy`` records as a sequence of lazy leaves (named by ``like``, if given)."""
    file = str(path)
    leaves = []
    offset = 0
    with open_regular(path) as f:
        info = os.fstat(f.fileno())
        size = info.st_size
        reader = FileReader(file, identity(info))
        while offset < size:
            where = f"record [{len(leaves)}] at byte {offset}"
            f.seek(offset)
            try:
                header = _npy.parse(f.read(_npy.PREFIX))
            except ValueError as e:
                raise FormatError(f"{where}: {e}", file=file) from None
            if header.dtype.hasobject:
                raise RefusedError(f"refused: {where} holds Python objects, and loading them unpickles", file=file)
            if header.dtype.kind != "V" and not _dtypes.is_known(header.dtype_name):
                raise FormatError(f"{where} holds {header.dtype} values, not numbers", file=file)
            if header.fortran or header.dtype.byteorder == ">":
                raise FormatError(f"{where}: Fortran-order or big-endian records are not supported", file=file)
            data = offset + header.data_offset
            if data + header.nbytes > size:
                raise FormatError(f"file is truncated: {where} declares data through byte {data + header.nbytes}, "
                                  f"but the file is only {size} bytes", file=file)
            # jnp.save writes bfloat16 as raw 2-byte records, and jnp.load reads them back as bfloat16.
            dtype_name = "bfloat16" if header.dtype_name == "V2" else header.dtype_name
            leaves.append(FileArrayLeaf(reader, data, header.shape, dtype_name))
            offset = data + header.nbytes
    checkpoint = Checkpoint(tree=leaves if like is None else _named(leaves, like, file), format=format, file=file)
    checkpoint._closers.append(reader.close)
    if like is None and path.suffix == ".eqx":
        checkpoint.warnings.append("an .eqx file stores leaves without names: they are shown by position, 0, 1, "
                                   "..., in the model's own order (name them with --like MODULE:ATTR, the model's "
                                   "code)")
    return checkpoint


def _named(records: list[FileArrayLeaf], like: _pytree.Structure, file: str) -> Any:
    """The template's native tree with record *i* at its *i*-th array leaf.

    Raises:
        StructureError: a count, shape or dtype that does not fit, listed diff-style.
    """
    expected = [(keypath, like.leaves[index]) for keypath, index in like.data]
    name = os.path.basename(file)
    lines = []
    if len(records) != len(expected):
        lines.append(f"{name} holds {counted(len(records), 'record')}; the template has "
                     f"{counted(len(expected), 'array leaf', 'array leaves')}")
    named = {}
    for i, (record, (keypath, leaf)) in enumerate(zip(records, expected)):
        dtype = getattr(leaf, "dtype", None)
        if record.dtype_name.startswith("V") and dtype is not None and _dtypes.itemsize(
                _dtypes.name(dtype)) == record.itemsize:  # float8 & co. are saved as raw bytes too
            record = FileArrayLeaf(record.reader, record.offset, record.shape, _dtypes.name(dtype))
        if not _pytree.fits(leaf, record):
            lines.append(f"[{i}] {format_keypath(keypath) or '<root>'}: {_pytree.describe(leaf)} in the template; "
                         f"{_tree.describe_leaf(record)} in {name}")
        named[keypath] = record
    if lines:
        raise StructureError(f"does not fit the template: {len(lines)} "
                             f"{'difference' if len(lines) == 1 else 'differences'}", file=file, details=lines)
    return _tree.map_leaves(lambda keypath, _: named[keypath], like.native)


# --- writing --------------------------------------------------------------------------------------------


def _write(tree: Any, target: Path, options: WriteOptions) -> None:
    entries = records(tree, options, str(target))  # (refused before a byte is written)
    with open(target, "wb", buffering=writer.WRITE_BUFFER) as f:
        writeback = options.writeback(f)
        for key, leaf in entries:
            # np.save's record, byte for byte: jnp.save writes bfloat16 as '<V2' the same way.
            _npy.write(f, leaf, _npy.header(leaf), file=str(target), keypath=key, writeback=writeback,
                       progress=options.progress, digests=options.digests)


def records(tree: Any, options: WriteOptions, file: str) -> list[tuple[str, _leaf.ArrayLeaf]]:
    """The array leaves, with their key paths as text, in the order the file must hold them.

    Raises:
        TreecliError: leaves that are not arrays (unless dropped), or a tree that
            does not have the leaves of the order it must follow.
    """
    leaves = dict(_tree.flatten(tree)) if not (isinstance(tree, (dict, list, tuple)) and not tree) else {}
    unsupported = [f"{format_keypath(kp)} ({_tree.describe_leaf(x)})" for kp, x in leaves.items()
                   if not _leaf.is_array(x) and not _holds_nothing(x)]
    options.refuse_or_drop(unsupported, "an .eqx file", file)
    arrays = {format_keypath(kp): _leaf.as_leaf(x) for kp, x in leaves.items() if _leaf.is_array(x)}
    if options.like is None:
        texts = [format_keypath(kp) for kp in _jax_order(tree)]
        return [(text, arrays[text]) for text in texts if text in arrays]
    expected = {format_keypath(kp): options.like.leaves[i] for kp, i in options.like.data}
    order = list(expected)
    missing = [text for text in order if text not in arrays]
    extra = sorted(arrays.keys() - set(order))
    if missing or extra:
        raise TreecliError(
            f"an .eqx file must hold exactly the model's {len(order)} array leaves, in its order; this tree lacks "
            f"{len(missing)} and has {len(extra)} others", file=file,
            details=[f"{t}: missing" for t in missing] + [f"{t}: not in the model" for t in extra])
    # The model reads record i as its i-th leaf: one of another shape or dtype would not load.
    misfits = [f"{text}: {_pytree.describe(expected[text])} in the model; {_tree.describe_leaf(arrays[text])} here"
               for text in order if not _pytree.fits(expected[text], arrays[text])]
    if misfits:
        raise TreecliError(f"the model could not load this .eqx file: {len(misfits)} "
                           f"{'leaf differs' if len(misfits) == 1 else 'leaves differ'} from it in shape or dtype "
                           f"({misfits[0]}{'; ...' if len(misfits) > 1 else ''})", file=file, details=misfits)
    return [(text, arrays[text]) for text in order]


def _holds_nothing(leaf: Any) -> bool:
    """``None`` and empty containers: no leaf at all to JAX, so no record."""
    return leaf is None or (isinstance(leaf, (dict, list, tuple)) and not leaf)


def _jax_order(tree: Any, prefix: KeyPath = ()) -> list[KeyPath]:
    """Key paths of the leaves in ``jax.tree_util``'s order for a native tree (dict
    keys sorted, sequences in order, ``None`` no leaf), without importing jax."""
    if isinstance(tree, dict):
        return [kp for key in sorted(tree) for kp in _jax_order(tree[key], prefix + (key,))]
    if isinstance(tree, (list, tuple)):
        return [kp for i, child in enumerate(tree) for kp in _jax_order(child, prefix + (i,))]
    return [] if tree is None else [prefix]
