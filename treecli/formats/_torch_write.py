"""Writing ``torch.save``'s zip without torch: the pickle a state dict of tensors makes,
written opcode by opcode (nothing of the tree is pickled by Python's pickler), and each
tensor's bytes as a stored member, streamed.

The file is a flat state dict, as Hugging Face's ``pytorch_model.bin`` is: each leaf
under its dotted key path; Python numbers, strings, booleans and ``None`` as they are.
A dtype with a legacy typed storage (``FloatStorage``, ``BFloat16Storage``, ...) is
written as PyTorch writes it (``_rebuild_tensor_v2``); the others (fp8, uint16/32/64)
as an ``UntypedStorage`` and ``_rebuild_tensor_v3`` with the dtype, as PyTorch 2 does.
``torch.load(path, weights_only=True)`` reads it back bit for bit.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from treecli import _leaf
from treecli._bytes import writer
from treecli._keypath import format_keypath
from treecli.formats import _flatkeys, _zip
from treecli.formats._base import WriteOptions

# Legacy typed storages by element dtype; other dtypes go untyped, with the dtype named.
_STORAGES = {"float32": "FloatStorage", "float64": "DoubleStorage", "float16": "HalfStorage",
             "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage",
             "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage",
             "complex64": "ComplexFloatStorage", "complex128": "ComplexDoubleStorage"}
_UNTYPED = ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
            "float8_e8m0fnu")
_FOLDER = "archive"  # what torch.save names it when it cannot take the file's stem
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)


def write(tree: Any, target: Path, options: WriteOptions) -> None:
    entries = _entries(tree, str(target), options)
    tensors = [leaf for _, leaf in entries if isinstance(leaf, _leaf.ArrayLeaf)]
    pickled = _pickle(entries, {id(leaf): i for i, leaf in enumerate(tensors)})
    with open(target, "wb", buffering=writer.WRITE_BUFFER) as f:
        archive = _zip.StoredZip(f, _FIXED_TIME)
        for name, data in ((f"{_FOLDER}/data.pkl", pickled), (f"{_FOLDER}/byteorder", b"little")):
            with archive.member(name, len(data)) as checksum:
                f.write(data)
                checksum.update(data)
        writeback = options.writeback(f)
        for i, leaf in enumerate(tensors):
            with archive.member(f"{_FOLDER}/data/{i}", leaf.nbytes) as checksum:
                writer.write_leaf(f, leaf, file=str(target), keypath=str(i), writeback=writeback,
                                  progress=options.progress, digests=options.digests, checksum=checksum)
        with archive.member(f"{_FOLDER}/version", 2) as checksum:
            f.write(b"3\n")
            checksum.update(b"3\n")
        archive.close()


def _entries(tree: Any, file: str, options: WriteOptions) -> list[tuple[str, Any]]:
    entries, unsupported = [], []
    for key, keypath, leaf in _flatkeys.flatten_for_writing(tree, ".", file):
        if _leaf.is_array(leaf):
            leaf = _leaf.as_leaf(leaf)
            if leaf.dtype_name in _STORAGES or leaf.dtype_name in _UNTYPED:
                entries.append((key, leaf))
                continue
            unsupported.append(f"{format_keypath(keypath)} (dtype {leaf.dtype_name})")
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            entries.append((key, leaf))
        else:
            unsupported.append(f"{format_keypath(keypath)} ({type(leaf).__name__})")
    options.refuse_or_drop(unsupported, "PyTorch files", file)
    return entries


# --- the pickle, opcode by opcode (protocol 2, as torch.save writes) -------------------------------


def _pickle(entries: list[tuple[str, Any]], storage_of: dict[int, int]) -> bytes:
    out = [b"\x80\x02}"]  # PROTO 2, EMPTY_DICT
    for key, value in entries:
        out.append(_value(key))
        out.append(_tensor(value, storage_of[id(value)]) if isinstance(value, _leaf.ArrayLeaf) else _value(value))
        out.append(b"s")  # SETITEM
    out.append(b".")  # STOP
    return b"".join(out)


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _tuple(items: list[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t" if items else b")"


def _value(value: Any) -> bytes:
    if value is None:
        return b"N"
    if value is True or value is False:
        return b"\x88" if value else b"\x89"
    if isinstance(value, int):
        if 0 <= value < 256:
            return b"K" + bytes([value])
        if -(2**31) <= value < 2**31:
            return b"J" + struct.pack("<i", value)
        data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        return b"\x8a" + bytes([len(data)]) + data  # LONG1
    if isinstance(value, float):
        return b"G" + struct.pack(">d", value)
    data = value.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(data)) + data


def _tensor(leaf: _leaf.ArrayLeaf, key: int) -> bytes:
    """``_rebuild_tensor_v2/v3(storage, 0, size, stride, False, OrderedDict()[, dtype])``."""
    typed = leaf.dtype_name in _STORAGES
    storage_type = _global("torch", _STORAGES[leaf.dtype_name]) if typed else _global("torch.storage",
                                                                                       "UntypedStorage")
    persistent = _tuple([_value("storage"), storage_type, _value(str(key)), _value("cpu"),
                         _value(leaf.size if typed else leaf.nbytes)]) + b"Q"  # BINPERSID
    stride, strides = 1, []
    for n in reversed(leaf.shape):
        strides.insert(0, stride)
        stride *= n
    args = [persistent, _value(0), _tuple([_value(n) for n in leaf.shape]), _tuple([_value(s) for s in strides]),
            _value(False), _global("collections", "OrderedDict") + b")R"]
    if not typed:
        args.append(_global("torch", leaf.dtype_name))
    return _global("torch._utils", "_rebuild_tensor_v2" if typed else "_rebuild_tensor_v3") + _tuple(args) + b"R"
