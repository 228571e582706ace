"""Array leaves that know their shape and dtype and produce data on demand.

Every array leaf in a treecli tree is an :class:`ArrayLeaf`:

- ``shape``, ``dtype``, ``nbytes`` come from metadata alone;
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
from typing import Any, Callable, Iterator

import numpy as np

from treecli import _dtypes

# A chunk is this many bytes of a leaf (rounded to whole elements). Small
# enough to stay in cache and keep memory flat; large enough that the Python
# overhead per chunk is noise.
CHUNK_BYTES = 4 << 20


class ArrayLeaf:
    """Base class: a lazily-read or computed array of known shape and dtype."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def read_flat(self, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` in C order, as a 1-d array."""
        raise NotImplementedError

    def read(self, index: Any = ()) -> np.ndarray:
        """``self[index]`` for a NumPy basic index; the default reads the whole leaf."""
        whole = self.read_flat(0, self.size).reshape(self.shape)
        result = whole[index]
        return np.array(result, copy=True) if isinstance(result, np.ndarray) else np.asarray(result)

    def chunk_ranges(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, int]]:
        """``(start, stop)`` element ranges that cover the leaf in order."""
        step = max(1, chunk_bytes // max(1, self.dtype.itemsize))
        for start in range(0, self.size, step):
            yield start, min(self.size, start + step)

    def __array__(self, dtype=None, copy=None):
        data = self.read()
        return data if dtype is None else data.astype(dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={_dtypes.name(self.dtype)})"


class InMemoryLeaf(ArrayLeaf):
    """An array already in memory (NumPy, or anything with ``__array__``)."""

    def __init__(self, array: Any):
        self._source = array
        self.shape = tuple(int(d) for d in array.shape)
        self.dtype = np.dtype(array.dtype)
        self._array: np.ndarray | None = None

    def array(self) -> np.ndarray:
        if self._array is None:
            # C order once, so that flat chunks are views, not copies.
            self._array = np.ascontiguousarray(np.asarray(self._source))
        return self._array

    def read_flat(self, start: int, stop: int) -> np.ndarray:
        return self.array().reshape(-1)[start:stop]

    def read(self, index: Any = ()) -> np.ndarray:
        return np.array(self.array()[index], copy=True)


class ComputedLeaf(ArrayLeaf):
    """A leaf whose chunks are computed on demand by ``compute(start, stop)``.

    ``compute_index``, when given, answers ``read(index)`` directly (a slice of
    a lazy leaf reads only its bytes); otherwise ``read`` computes the whole leaf.
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: Any,
        compute: Callable[[int, int], np.ndarray],
        compute_index: Callable[[Any], np.ndarray] | None = None,
    ):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self._compute = compute
        self._compute_index = compute_index

    def read_flat(self, start: int, stop: int) -> np.ndarray:
        return self._compute(start, stop)

    def read(self, index: Any = ()) -> np.ndarray:
        if self._compute_index is not None and index == ():
            return self._compute_index(())
        return super().read(index)


def is_array(value: Any) -> bool:
    """Whether a tree leaf is an array (lazy, NumPy, JAX, or array-like with shape and dtype)."""
    if isinstance(value, (ArrayLeaf, np.ndarray, np.generic)):
        return True
    return hasattr(value, "__array__") and hasattr(value, "shape") and hasattr(value, "dtype")


def as_leaf(value: Any) -> ArrayLeaf:
    """Wrap an array-like value as an :class:`ArrayLeaf` (lazy leaves pass through)."""
    if isinstance(value, ArrayLeaf):
        return value
    if isinstance(value, np.generic):
        value = np.asarray(value)
    return InMemoryLeaf(value)
