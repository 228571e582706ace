"""What a ``torch.save`` pickle may name and how its objects become lazy leaves, without
torch and without running anything from the file: the allowlist of the globals
PyTorch's ``weights_only=True`` loader accepts for dense tensors (``ALLOWED``), the zip
and legacy layouts read by byte ranges (``read_zip``, ``read_legacy``), and each tensor
as a leaf over its storage's bytes (``items_of``). Shared by ``torch`` (``.bin``/``.pt``
files) and ``dcp`` (a distributed checkpoint's pickled values).
"""

from __future__ import annotations

import math
import zipfile
from dataclasses import dataclass
from typing import Any

from treecli import _dtypes, _leaf, _tree
from treecli._errors import FormatError, RefusedError
from treecli.formats import _flatkeys, _zip
from treecli.formats._filedata import FileArrayLeaf
from treecli.formats._unpickle import Global, Unpickler

# The pickled object and the keys list of a legacy file are read from its first bytes,
# at most this many: a state dict of 200k tensors pickles to about 30 MB.
MAX_PICKLE_BYTES = 256 << 20
# Containers and values walked to make the tree: a pickle's references can make a small
# file describe an exponentially large tree (a list holding the same list twice, ...).
MAX_NODES = 2_000_000
# The first pickle of a legacy file: torch.serialization's MAGIC_NUMBER, in the first
# bytes a file starts with (a protocol 4 or 5 frame adds 9 to protocol 2's 15).
_LEGACY_MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
LEGACY_HEAD = 64

# Storage classes by the dtype of their elements (PyTorch's legacy typed storages).
_STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}
# torch.<name> dtypes a tensor may name (rebuild v3), as treecli's dtype names.
_DTYPES = {
    **{name: name for name in ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                               "uint8", "uint16", "uint32", "uint64", "bool", "complex64", "complex128",
                               "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                               "float8_e8m0fnu")},
    "float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32", "short": "int16",
    "cfloat": "complex64", "cdouble": "complex128",
    # torch's raw-bit and packed types: read as the bytes torch stores (a warning names each)
    "bits8": "uint8", "bits16": "uint16", "float4_e2m1fn_x2": "uint8", "bits1x8": "uint8", "bits2x4": "uint8",
    "bits4x2": "uint8",
}
_AS_BYTES = {"bits8", "bits16", "float4_e2m1fn_x2", "bits1x8", "bits2x4", "bits4x2"}
# torch dtypes no NumPy dtype holds, and their item sizes: their tensors are Unreadable leaves.
_UNREPRESENTABLE = {"complex32": 4}

# Classes of plain settings a training checkpoint pickles beside its tensors (a script's
# arguments, NumPy's random state): never built, each object an Unreadable leaf naming its
# class, while every tensor of the file reads. Any other global is refused by name.
_OPAQUE = {"argparse.Namespace", "numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct",
           "numpy._core.multiarray._reconstruct", "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar",
           "numpy.random._pickle.__randomstate_ctor", "numpy.random._pickle.__bit_generator_ctor",
           "numpy.random._pickle.__generator_ctor", "numpy.random.mtrand.RandomState", "datetime.datetime",
           "datetime.date", "datetime.timedelta", "datetime.timezone", "pathlib.Path", "pathlib.PosixPath",
           "pathlib.WindowsPath", "pathlib.PurePosixPath", "pathlib.PureWindowsPath", "collections.defaultdict"}


def _opaque(name: str) -> bool:
    """Whether a global outside the allowlist stands for settings, shown as an Unreadable
    leaf: the classes above, and a training script's own (``__main__.Config``)."""
    return name in _OPAQUE or name.startswith(("__main__.", "omegaconf."))


@dataclass(frozen=True)
class _StorageType:
    dtype: str | None  # None: an UntypedStorage (bytes; the tensor names its dtype)


@dataclass(frozen=True)
class DType:
    name: str  # treecli's (NumPy's) name of its elements
    torch_name: str  # torch's (bits8 is read as uint8)


@dataclass
class _Storage:
    """A storage a persistent id names: its key, element dtype and length."""

    key: str
    dtype: str | None
    numel: int  # elements of ``dtype``; bytes for an untyped storage


@dataclass
class _Tensor:
    storage: _Storage
    offset: int  # in elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    torch_dtype: str | None = None  # where torch's name differs (bits8 read as uint8)


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any, dtype: str | None = None) -> _Tensor:
    if not isinstance(storage, _Storage):
        raise ValueError("the storage is not a persistent storage")
    dtype = dtype or storage.dtype
    if dtype is None:
        raise ValueError("an untyped storage with no dtype")
    shape, stride = tuple(size), tuple(stride)
    if not all(type(v) is int and v >= 0 for v in (offset, *shape, *stride)) or len(shape) != len(stride):
        raise ValueError(f"size {list(shape)}, stride {list(stride)}, offset {offset!r}")
    return _Tensor(storage, offset, shape, stride, dtype)


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any,
                *metadata: Any) -> _Tensor:
    if not isinstance(dtype, DType):
        raise ValueError("the dtype is not a torch dtype")
    tensor = _rebuild(storage, offset, size, stride, dtype=dtype.name)
    tensor.torch_dtype = dtype.torch_name
    return tensor


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """A tensor (or Parameter) with Python attributes: the tensor; its attributes are not data."""
    if not (isinstance(func, Global) and func.name in _TENSOR_REBUILDS and isinstance(new_type, Global)
            and new_type.name in ("torch.Tensor", "torch.nn.parameter.Parameter")):
        raise ValueError("a tensor subclass, which treecli does not rebuild")
    return func.build(*args)


# Bytes a bytearray(...) in a pickle may make: a 400-byte file must not ask for gigabytes.
_MAX_BYTEARRAY = 64 << 20


def _bytearray(*args: Any) -> bytes:
    if args and isinstance(args[0], int) and not 0 <= args[0] <= _MAX_BYTEARRAY:
        raise ValueError(f"a bytearray of {args[0]:,} bytes, more than any checkpoint's")
    return bytes(bytearray(*args))


def _refuse(what: str):
    def refuse(*args: Any) -> Any:
        raise RefusedError(f"refused: {what}, which treecli does not read")
    return refuse


_TENSOR_REBUILDS = {
    "torch._utils._rebuild_tensor": _rebuild,
    "torch._utils._rebuild_tensor_v2": _rebuild,
    "torch._utils._rebuild_tensor_v3": _rebuild_v3,
    "torch._utils._rebuild_parameter": lambda data, *rest: data,
    "torch._utils._rebuild_parameter_with_state": lambda data, *rest: data,
}

# The globals a checkpoint may name, each a function of plain data: PyTorch's own
# weights_only allowlist, less what treecli cannot represent (refused by name).
ALLOWED = {
    **_TENSOR_REBUILDS,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type,
    "collections.OrderedDict": lambda *args: dict(*args),
    "collections.Counter": lambda *args: dict(*args),
    "torch.Size": tuple,
    "torch.device": lambda *args: ":".join(map(str, args)),
    "torch.serialization._get_layout": str,
    "torch.Tensor": _refuse("a bare torch.Tensor call"),
    "torch.nn.parameter.Parameter": _refuse("a bare Parameter call"),
    "builtins.set": set,
    "builtins.frozenset": frozenset,
    "builtins.complex": complex,
    "builtins.bytearray": _bytearray,
    "_codecs.encode": lambda text, encoding="utf-8": text.encode(encoding),
    "torch.storage.UntypedStorage": _StorageType(None),
    **{f"torch.{name}": _StorageType(dtype) for name, dtype in _STORAGE_DTYPES.items()},
    **{f"torch.{name}": DType(dtype, name) for name, dtype in _DTYPES.items()},
    "torch._utils._rebuild_sparse_tensor": _refuse("a sparse tensor"),
    "torch._utils._rebuild_qtensor": _refuse("a quantized tensor"),
    "torch._utils._rebuild_nested_tensor": _refuse("a nested tensor"),
    "torch._utils._rebuild_meta_tensor_no_storage": _refuse("a meta tensor (no data)"),
    "torch._utils._rebuild_wrapper_subclass": _refuse("a tensor subclass"),
    "torch._utils._rebuild_device_tensor_from_numpy": _refuse("a tensor rebuilt from NumPy"),
    "torch.complex32": DType("complex32", "complex32"),
    "torch.chalf": DType("complex32", "chalf"),
    "torch.ComplexHalfStorage": _StorageType("complex32"),
}


def is_legacy(head: bytes) -> bool:
    """Whether a file's first bytes are a legacy ``torch.save`` stream: its first pickle,
    in any protocol from 2 to 5 (``pickle_protocol=``), is torch's magic number."""
    if len(head) < 3 or head[0] != 0x80 or not 2 <= head[1] <= 5:
        return False
    try:
        value, _ = Unpickler(head, file="", allowed={}).load()
    except FormatError:  # (refusals included: a global is no magic number)
        return False
    return type(value) is int and value == _LEGACY_MAGIC_NUMBER


def _archive_name(names: list[str]) -> str | None:
    """The folder a torch.save zip keeps its members in: the one holding ``data.pkl``."""
    found = {name[: -len("/data.pkl")] for name in names if name.endswith("/data.pkl")}
    found = {name for name in found if name and "/" not in name}
    return found.pop() if len(found) == 1 else None


def read_zip(source: Any, window: tuple[int, int]) -> tuple[Any, dict[str, tuple[int, int]]]:
    """The unpickled object, and where each storage lies in the source: (offset, bytes).
    The zip is the bytes ``window`` = ``(start, length)`` of ``source`` (a local file's
    reader, an HTTP or bucket object's), read by byte ranges: its directory, its pickle,
    then nothing until a leaf is read."""
    file = source.path
    start = window[0]
    try:
        with zipfile.ZipFile(_zip.SourceFile(source, *window)) as z:
            infos = {info.filename: info for info in z.infolist()}
            if len(infos) != len(z.infolist()):  # which copy is meant? (readers differ: torch takes another)
                twice = next(n for n in infos if sum(i.filename == n for i in z.infolist()) > 1)
                raise FormatError(f"the zip holds member {twice!r} twice", file=file)
            prefix = _archive_name(list(infos))
            if prefix is None:
                raise FormatError("not a torch.save zip: no single NAME/data.pkl", file=file)
            pickled = infos[f"{prefix}/data.pkl"]
            if pickled.file_size > MAX_PICKLE_BYTES:
                raise FormatError(f"data.pkl is {pickled.file_size:,} bytes, more than any checkpoint's pickle",
                                  file=file)
            data = z.read(pickled)
            order = z.read(f"{prefix}/byteorder").strip() if f"{prefix}/byteorder" in infos else b"little"
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, EOFError) as e:
        raise FormatError(f"a damaged torch.save zip: {e}", file=file) from None
    if order != b"little":
        raise FormatError(f"stored {order.decode('ascii', 'replace')}-endian, which treecli does not read", file=file)
    named: dict[str, _Storage] = {}
    obj = Unpickler(data, file=file, allowed=ALLOWED, persistent=lambda pid: _storage(pid, named, file),
                    opaque=_opaque).load()[0]
    places = {}
    for key in named:
        info = infos.get(f"{prefix}/data/{key}")
        if info is None:
            raise FormatError(f"the pickle names storage {key!r}, which the zip does not hold", file=file)
        if info.compress_type != zipfile.ZIP_STORED:
            raise FormatError(f"storage {key!r} is compressed; torch.save stores storages as they are", file=file)
        offset = _zip.stored_member_offset(source, info, start)
        if offset + info.file_size > start + window[1]:  # (torch refuses it too: a claim the file does not back)
            raise FormatError(f"storage {key!r} runs past the end of the zip ({info.file_size:,} bytes at "
                              f"{offset - start:,} of {window[1]:,})", file=file)
        places[key] = (offset, info.file_size)
    return obj, places


def read_legacy(reader: Any) -> tuple[Any, dict[str, tuple[int, int]]]:
    """The same from a legacy stream: its pickles, then each storage's count and bytes."""
    import numpy as np

    file, size = reader.path, reader.size
    head = np.empty(min(size, MAX_PICKLE_BYTES), np.uint8)
    reader.read_into(head, 0)
    data = head.tobytes()
    named: dict[str, _Storage] = {}
    at = 0
    values = []
    for _ in range(5):  # magic number, protocol version, system info, the object, the storage keys
        value, at = Unpickler(data, file=file, allowed=ALLOWED, persistent=lambda pid: _storage(pid, named, file),
                              start=at, opaque=_opaque).load()
        values.append(value)
    magic, protocol, _, obj, keys = values
    if protocol != 1001:
        raise FormatError(f"legacy torch.save protocol {protocol!r}; treecli reads 1001", file=file)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or set(keys) != set(named):
        raise FormatError("the list of storages does not name the storages the object holds", file=file)
    places = {}
    count = np.empty(1, "<i8")
    for key in keys:
        if at + 8 > size:
            raise FormatError(f"the file ends before storage {key!r}", file=file)
        reader.read_into(count, at)
        nbytes = int(count[0]) * _itemsize(named[key])
        if int(count[0]) != named[key].numel or at + 8 + nbytes > size:
            raise FormatError(f"storage {key!r} holds {int(count[0])} elements where {named[key].numel} were "
                              "named, or runs past the end of the file", file=file)
        places[key] = (at + 8, nbytes)
        at += 8 + nbytes
    return obj, places


def _itemsize(storage: _Storage) -> int:
    if storage.dtype is None:
        return 1
    return _UNREPRESENTABLE.get(storage.dtype) or _dtypes.itemsize(storage.dtype)


def _storage(pid: Any, named: dict[str, _Storage], file: str) -> _Storage:
    """A persistent id: ``('storage', type, key, location, numel[, view])``."""
    if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage"
            and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and type(pid[4]) is int
            and pid[4] >= 0):
        raise FormatError(f"a persistent id that is not a storage: {str(pid)[:100]}", file=file)
    if len(pid) == 6 and pid[5] is not None:
        raise FormatError("a legacy storage view, which treecli does not read", file=file)
    key = pid[2]
    if not key or "/" in key or "\\" in key or key in (".", ".."):
        raise FormatError(f"storage key {key!r} would name a file outside the archive", file=file)
    storage = _Storage(key, pid[1].dtype, pid[4])
    if named.setdefault(key, storage) != storage:
        raise FormatError(f"storage {key!r} is named twice, differently", file=file)
    return named[key]


def items_of(obj: Any, places: dict[str, tuple[int, int]], reader: Any, file: str,
             warnings: list[str] | None = None) -> list[tuple[str, Any]]:
    """The unpickled object as (dotted key, lazy leaf or value) items, to nest as
    safetensors' names nest; what a reader should know of them goes to ``warnings``. A
    bare storage is a 1-d leaf of its elements (bytes, for an untyped one); a tensor of a
    dtype NumPy cannot hold, an :class:`~treecli._leaf.Unreadable` leaf."""
    items: list[tuple[str, Any]] = []
    visited = 0
    as_bytes: dict[str, list[str]] = {}

    def walk(value: Any, keys: tuple[str, ...]) -> None:
        nonlocal visited
        visited += 1
        if visited > MAX_NODES:
            raise FormatError(f"the object holds more than {MAX_NODES:,} values (or refers to itself over and over)",
                              file=file)
        if len(keys) > _tree.MAX_DEPTH:
            raise FormatError(f"nested deeper than {_tree.MAX_DEPTH} levels (or holds itself)", file=file)
        if isinstance(value, dict) and value:
            for key, child in value.items():
                walk(child, keys + (str(key),))
        elif isinstance(value, (list, tuple)) and value:
            for i, child in enumerate(value):
                walk(child, keys + (str(i),))
        elif isinstance(value, _Tensor) and value.dtype in _UNREPRESENTABLE:
            items.append((".".join(keys), _leaf.Unreadable(f"a {value.dtype} tensor {list(value.shape)}",
                                                           f"no NumPy dtype holds {value.dtype}")))
        elif isinstance(value, _Tensor):
            items.append((".".join(keys), _leaf_of(value, places, reader, file, ".".join(keys))))
            if value.torch_dtype in _AS_BYTES:
                as_bytes.setdefault(value.torch_dtype, []).append(".".join(keys) or "<root>")
        elif isinstance(value, _Storage):
            items.append((".".join(keys), _storage_leaf(value, places, reader, file, ".".join(keys))))
        elif isinstance(value, (set, frozenset)):
            items.append((".".join(keys), sorted(value, key=repr)))
        else:
            items.append((".".join(keys), value))

    walk(obj, ())
    for torch_dtype, keypaths in as_bytes.items():
        if warnings is not None:
            warnings.append(f"{len(keypaths)} {torch_dtype} tensors read as the bytes torch stores, "
                            f"{_DTYPES[torch_dtype]} (e.g. {keypaths[0]})")
    return items


def _storage_leaf(storage: _Storage, places: dict[str, tuple[int, int]], reader: Any, file: str,
                  keypath: str) -> Any:
    """A bare storage (pickled without a tensor around it): its elements as a 1-d leaf."""
    dtype = storage.dtype or "uint8"
    if dtype in _UNREPRESENTABLE:
        return _leaf.Unreadable(f"a {dtype} storage", f"no NumPy dtype holds {dtype}")
    return _leaf_of(_Tensor(storage, 0, (storage.numel,), (1,), dtype), places, reader, file, keypath)


def _leaf_of(tensor: _Tensor, places: dict[str, tuple[int, int]], reader: Any, file: str,
             keypath: str) -> _leaf.ArrayLeaf:
    """A lazy leaf over a tensor's elements of its storage, checked to lie inside it."""
    offset, nbytes = places[tensor.storage.key]
    stored = tensor.storage.numel * _itemsize(tensor.storage)
    if stored > nbytes:
        raise FormatError(f"storage {tensor.storage.key!r} is named with {stored} bytes, but holds {nbytes}",
                          file=file, keypath=keypath)
    itemsize = _dtypes.itemsize(tensor.dtype)
    if math.prod(tensor.shape) == 0:
        return FileArrayLeaf(reader, offset, tensor.shape, tensor.dtype)
    last = tensor.offset + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride))
    if (last + 1) * itemsize > stored:
        raise FormatError(f"the tensor's elements run to byte {(last + 1) * itemsize} of a storage of {stored}",
                          file=file, keypath=keypath)
    if _c_contiguous(tensor.shape, tensor.stride):
        return FileArrayLeaf(reader, offset + tensor.offset * itemsize, tensor.shape, tensor.dtype)
    return _StridedLeaf(reader, offset + tensor.offset * itemsize, tensor.shape, tensor.stride, tensor.dtype,
                        last - tensor.offset + 1)


def _c_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, s in zip(reversed(shape), reversed(stride)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


class _StridedLeaf(_leaf.ArrayLeaf):
    """A view with other strides than C order's (a transpose, a strided slice, an expand):
    the span of storage it covers is read once and kept while its chunks are served,
    each chunk (or index) taken from the view of it, never the whole leaf laid out at once
    (an ``expand`` of one element may claim 2**40)."""

    reads_parts = True

    def __init__(self, reader: Any, start: int, shape: tuple[int, ...], stride: tuple[int, ...],
                 dtype_name: str, span: int):
        self._reader, self._start, self._stride, self._span = reader, start, stride, span
        self.shape = shape
        self.dtype_name = dtype_name
        self._base = None  # the span, kept from a chunk to the next until the last

    @property
    def sources(self) -> tuple[str, ...]:
        return (self._reader.path,)

    def _view(self):
        import numpy as np

        base = self._base
        if base is None:
            base = np.empty(self._span, self.dtype)
            self._reader.read_into(base, self._start)
        strides = tuple(s * self.itemsize for s in self._stride)
        return base, np.lib.stride_tricks.as_strided(base, self.shape, strides, writeable=False)

    def read_flat(self, start: int, stop: int):
        import numpy as np

        base, view = self._view()
        self._base = None if stop >= self.size else base
        places = np.unravel_index(np.arange(start, stop, dtype=np.int64), self.shape)
        return view[places] if self.shape else view.reshape(-1)[start:stop].copy()

    def read(self, index: Any = ()):
        import numpy as np

        return np.array(_leaf._index_array(self._view()[1], index), copy=True)


def tree_of(items: list[tuple[str, Any]], warnings: list[str]) -> Any:
    """The tree of a pickle's items: the object itself where it is one tensor or value,
    else its dotted keys nested (a warning where they cannot nest)."""
    if len(items) == 1 and items[0][0] == "":
        return items[0][1]
    tree, warning = _flatkeys.nest(items, ".")
    warnings.extend([warning] if warning else [])
    return tree
