"""Array leaves that know their shape and dtype and produce data on demand.

Every array leaf in a treecli tree is an :class:`ArrayLeaf`:

- ``shape``, ``dtype_name``, ``nbytes`` come from metadata alone (no NumPy
  import: ``show`` stays fast); ``dtype`` is the NumPy dtype, made on use;
- ``read_flat(start, stop)`` returns elements ``[start, stop)`` of the leaf in
  C order, as a 1-d array — the *chunk* protocol writers and operations use,
  so that peak memory is a few chunks whatever the leaf size;
- ``read(index)`` returns ``leaf[index]`` for any NumPy basic index, reading
  only what it needs where the format allows.

Format modules subclass it for lazy file-backed leaves; operations build
:class:`ComputedLeaf` objects whose chunks are computed from input chunks.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Iterator, Sequence

from treecli import _dtypes

# A chunk is this many bytes of a leaf (rounded to whole elements). Small
# enough to stay in cache and keep memory flat; large enough that the Python
# overhead per chunk is noise.
CHUNK_BYTES = 4 << 20


class ArrayLeaf:
    """Base class: a lazily-read or computed array of known shape and dtype."""

    __slots__ = ("__dict__",)  # subclasses may declare slots; the others keep a __dict__

    shape: tuple[int, ...]
    dtype_name: str
    # Whether ``read_into`` fills a caller's buffer without an extra copy (file
    # reads, computed chunks); otherwise writers take ``read_flat``'s arrays,
    # which may be views of data already in memory.
    fills_buffers = False
    # Whether ``read(index)`` reads only what the index needs (byte ranges, a TensorStore
    # slice); otherwise it reads the whole leaf, and a sharded load reads it once for all
    # its shards (``_devices``).
    reads_parts = False

    @property
    def dtype(self):
        return _dtypes.numpy_dtype(self.dtype_name)

    @property
    def itemsize(self) -> int:
        return _dtypes.itemsize(self.dtype_name)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    # Whether it is stored otherwise than it reads (GGUF's quantized blocks, read as
    # float32): ``stored_dtype`` and ``stored_nbytes`` say how.
    stored_otherwise = False

    @property
    def stored_dtype(self) -> str:
        """The type its bytes are stored in: its dtype's name, or a quantization's (``Q4_0``)."""
        return self.dtype_name

    @property
    def stored_nbytes(self) -> int:
        """The bytes it takes where it is stored."""
        return self.nbytes

    @property
    def sources(self) -> tuple[str, ...]:
        """The files (or checkpoint directories, or URLs) this leaf's bytes are read from when
        asked: what no output may replace while the leaf can still be read. None for data in memory."""
        return ()

    @property
    def in_local_file(self) -> bool:
        """Whether its bytes lie as stored, in C order, at ``offset`` of a local file read by
        ``reader``: then they can be compared without decoding (``stream.first_difference``)."""
        return False

    def read_flat(self, start: int, stop: int):
        """Elements ``[start, stop)`` in C order, as a 1-d NumPy array."""
        raise NotImplementedError

    def read_into(self, start: int, stop: int, out) -> None:
        """Fill ``out`` (a 1-d array of this dtype, length ``stop - start``) with elements ``[start, stop)``.

        Lets hot loops reuse buffers instead of touching fresh memory per chunk.
        """
        out[...] = self.read_flat(start, stop)

    # Whether ``read_index_into`` reads straight into the array given (no copy of its own):
    # a load onto CPU devices then reads into the memory the device takes as it is.
    reads_into_arrays = False

    def read_index_into(self, index: tuple, out) -> None:
        """Fill ``out`` (a C-contiguous array of this dtype and the index's shape) with
        ``self[index]``, ``index`` a tuple of slices (``()``: the whole leaf)."""
        out[...] = self.read(index) if index else self.read()

    def read(self, index: Any = ()):
        """``self[index]`` for a NumPy basic index; the default reads the whole leaf."""
        import numpy as np

        whole = self.read_flat(0, self.size).reshape(self.shape)
        return np.array(_index_array(whole, index), copy=True)

    def chunk_ranges(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, int]]:
        """``(start, stop)`` element ranges that cover the leaf in order."""
        step = max(1, chunk_bytes // max(1, self.itemsize))
        for start in range(0, self.size, step):
            yield start, min(self.size, start + step)

    def __getitem__(self, index: Any):
        """``leaf[index]``: reads only what the index needs where the format allows."""
        return self.read(index)

    def __bool__(self) -> bool:
        return True  # a leaf is an object that is there, never judged by its length or its data

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d leaf")  # as NumPy says of a 0-d array
        return self.shape[0]

    def __iter__(self) -> Iterator[Any]:
        """Rows, each read when reached (a 0-d leaf is not iterable, as in NumPy)."""
        if not self.shape:
            raise TypeError("iteration over a 0-d leaf")
        return (self.read(i) for i in range(self.shape[0]))

    def __array__(self, dtype=None, copy=None):
        data = self.read()
        return data if dtype is None else data.astype(dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype_name})"


class InMemoryLeaf(ArrayLeaf):
    """An array already in memory (NumPy, JAX, or anything with ``__array__``)."""

    reads_parts = True

    def __init__(self, array: Any):
        self._source = array
        self.shape = tuple(int(d) for d in array.shape)
        self.dtype_name = _dtypes.name(array.dtype)
        self._array = None

    def array(self):
        if self._array is None:
            import numpy as np

            array = np.asarray(self._source)
            if array.dtype.byteorder == ">":  # values kept, stored little-endian like every format
                array = array.astype(array.dtype.newbyteorder("="))
            # C order once, so that flat chunks are views, not copies (ascontiguousarray
            # would also turn a 0-d array into shape (1,)).
            self._array = array if array.flags.c_contiguous else array.copy(order="C")
        return self._array

    def read_flat(self, start: int, stop: int):
        return self.array().reshape(-1)[start:stop]

    def read(self, index: Any = ()):
        import numpy as np

        return np.array(_index_array(self.array(), index), copy=True)


class WholeLeaf(ArrayLeaf):
    """A leaf stored so that it can only be read whole (compressed, or reordered):
    loaded on first chunk, kept until its last chunk has been served, so that a
    writer holds one such leaf at a time. Subclasses implement ``load()``."""

    _cache = None

    def load(self):
        """The whole leaf, flat, in C order, as a NumPy array of this dtype."""
        raise NotImplementedError

    def read_flat(self, start: int, stop: int):
        if self._cache is None:
            self._cache = self.load()
        data = self._cache[start:stop]
        if stop >= self.size:
            self._cache = None
        return data

    def read(self, index: Any = ()):
        import numpy as np

        if self._cache is None and (index == () or index is Ellipsis):
            return self.load().reshape(self.shape)  # (loaded for this call alone: the caller's, not copied again)
        whole = self._cache if self._cache is not None else self.load()
        return np.array(_index_array(whole.reshape(self.shape), index), copy=True)


class ComputedLeaf(ArrayLeaf):
    """A leaf whose chunks are computed on demand.

    Either ``compute(start, stop)`` returns elements ``[start, stop)``, or
    ``fill(start, stop, out)`` writes them into a buffer the caller owns (writers
    reuse two buffers for a whole checkpoint instead of touching fresh memory per
    chunk). ``compute_index``, when given, answers ``read(index)`` directly (a
    slice of a lazy leaf reads only its bytes); otherwise ``read`` computes the
    whole leaf. ``inputs`` are the leaves it reads: their ``sources`` are its own.
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: Any,
        compute: Callable[[int, int], Any] | None = None,
        compute_index: Callable[[Any], Any] | None = None,
        *,
        fill: Callable[[int, int, Any], None] | None = None,
        inputs: Sequence[Any] = (),
    ):
        if (compute is None) == (fill is None):
            raise TypeError("ComputedLeaf needs exactly one of compute and fill")
        self._inputs = tuple(leaf for leaf in inputs if isinstance(leaf, ArrayLeaf))
        self.shape = tuple(shape)
        self.dtype_name = _dtypes.name(dtype)
        self._compute = compute
        self._compute_index = compute_index
        self._fill = fill
        self.fills_buffers = fill is not None
        self.reads_parts = compute_index is not None

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(source for leaf in self._inputs for source in leaf.sources))

    @property
    def inputs(self) -> tuple[ArrayLeaf, ...]:
        """The leaves it reads."""
        return self._inputs

    def read_flat(self, start: int, stop: int):
        if self._fill is None:
            return self._compute(start, stop)
        import numpy as np

        out = np.empty(max(0, stop - start), self.dtype)
        self._fill(start, stop, out)
        return out

    def read_into(self, start: int, stop: int, out) -> None:
        if self._fill is None:
            out[...] = self._compute(start, stop)
        elif stop > start:
            self._fill(start, stop, out)

    def read(self, index: Any = ()):
        if self._compute_index is not None:
            return self._compute_index(index)
        return super().read(index)


class PiecedLeaf(ArrayLeaf):
    """An array held in pieces, each a box of it (``(start, stop)`` per axis) and an array
    or lazy leaf of that box: the shards of a JAX array split over devices, the chunks of a
    PyTorch distributed checkpoint. A chunk of it is copied from the pieces it overlaps,
    and the whole array is never assembled unless asked for."""

    reads_parts = True

    def __init__(self, shape: tuple[int, ...], dtype_name: str, pieces: list[tuple[tuple, Any]], missing: str):
        self.shape = tuple(shape)
        self.dtype_name = dtype_name
        self._shards = pieces  # ((start, stop) per axis, the piece)
        self._missing = missing  # what to say where no piece holds a part that is read

    @classmethod
    def of_shards(cls, array: Any) -> "PiecedLeaf":
        """A JAX array split over devices, a replicated shard read from one of its devices."""
        shape = tuple(int(d) for d in array.shape)
        distinct: dict[tuple, Any] = {}
        for shard in array.addressable_shards:
            distinct.setdefault(tuple(s.indices(n)[:2] for s, n in zip(shard.index, shape)), shard.data)
        return cls(shape, _dtypes.name(array.dtype), list(distinct.items()),
                   "this process holds only some shards of a global array; write it where every process writes its "
                   "own (format orbax), or gather it first")

    def _rows(self, first: int, last: int):
        """Rows ``[first, last)`` of axis 0, the other axes whole, from the shards holding them."""
        import numpy as np

        out = np.empty((last - first,) + self.shape[1:], self.dtype)
        filled = 0
        for bounds, data in self._shards:
            low, high = bounds[0]
            start, stop = max(low, first), min(high, last)
            if start >= stop:
                continue
            inner = tuple(slice(a, b) for a, b in bounds[1:])
            out[(slice(start - first, stop - first),) + inner] = np.asarray(data[start - low:stop - low])
            filled += (stop - start) * math.prod(b - a for a, b in bounds[1:])
        if filled < out.size:
            from treecli._errors import UsageError

            raise UsageError(self._missing)
        return out

    def read_flat(self, start: int, stop: int):
        import numpy as np

        if stop <= start:
            return np.empty(0, self.dtype)
        row = self.size // self.shape[0]
        first, last = start // row, -(-stop // row)
        return self._rows(first, last).reshape(-1)[start - first * row:stop - first * row]

    def read(self, index: Any = ()):
        import numpy as np

        from treecli import _index

        index = index if isinstance(index, tuple) else (index,)
        final_shape = _index.result_shape(self.shape, index)
        selectors = _index.selectors(self.shape, index)
        if any(not isinstance(s, int) and len(s) == 0 for s in selectors):
            return np.empty(final_shape, self.dtype)
        within = [s if isinstance(s, int) else slice(s.start, s.stop if s.stop >= 0 else None, s.step)
                  for s in selectors]
        first = selectors[0]
        low, high = (first, first + 1) if isinstance(first, int) else (min(first[0], first[-1]),
                                                                        max(first[0], first[-1]) + 1)
        within[0] = 0 if isinstance(first, int) else slice(first.start - low, first.stop - low
                                                           if first.stop - low >= 0 else None, first.step)
        return np.array(self._rows(low, high)[tuple(within)], copy=True).reshape(final_shape)


def _index_array(array: Any, index: Any) -> Any:
    """``array[index]``, but the whole array for ``()``: indexing a 0-d array with ``()``
    gives a NumPy scalar, which would canonicalize a bool's byte (0x02 -> 0x01)."""
    return array if index == () else array[index]


def is_array(value: Any) -> bool:
    """Whether a tree leaf is an array (lazy, NumPy, JAX, or array-like with shape and dtype)."""
    if isinstance(value, ArrayLeaf):
        return True
    return hasattr(value, "__array__") and hasattr(value, "shape") and hasattr(value, "dtype")


def as_leaf(value: Any) -> ArrayLeaf:
    """Wrap an array-like value as an :class:`ArrayLeaf` (lazy leaves pass through; a JAX
    array split over devices is read by its shards)."""
    if isinstance(value, ArrayLeaf):
        return value
    jax = sys.modules.get("jax")  # a JAX array exists only once jax is imported
    if jax is not None and isinstance(value, jax.Array) and value.ndim and not value.is_fully_replicated:
        return PiecedLeaf.of_shards(value)
    return InMemoryLeaf(value)


class Unreadable:
    """A leaf treecli shows but does not read: what the file holds there (an object of a
    class outside the unpickler's allowlist, a tensor of a dtype no NumPy dtype holds) and
    why it is not read. Every other leaf of the file reads as usual; no format writes one
    (``--drop-unsupported`` drops it, by name)."""

    __slots__ = ("what", "why")

    def __init__(self, what: str, why: str):
        self.what, self.why = what, why

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Unreadable) and (self.what, self.why) == (other.what, other.why)

    def __hash__(self) -> int:
        return hash((self.what, self.why))

    def __repr__(self) -> str:
        return f"<{self.what}, not read: {self.why}>"
