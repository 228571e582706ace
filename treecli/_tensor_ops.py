"""Reversible operations on single leaves, each a computed leaf made chunk by chunk.

Every function returns :class:`ComputedLeaf` objects (or lists of them) whose chunks
are produced from the input leaves' chunks when a writer asks for them, so a
checkpoint moves through them one leaf, and mostly one chunk, at a time. Each has an
exact inverse, and no value is ever converted: the bytes out are the bytes in, moved.

- :func:`sliced_leaf`: ``source[index]``, read by byte ranges where it lies in a file;
- :func:`reshaped` (and ``unflatten``/``flatten`` of one axis): the same elements;
- :func:`concatenated` / :func:`split` along an axis; :func:`stacked` /
  :func:`unstacked` along a new axis (layers into a scanned axis, experts into one
  tensor);
- :func:`transposed`: any permutation of the axes. The one operation that holds a
  whole leaf (twice) in memory: an output chunk gathers elements from all of its input;
- :func:`rotary_permuted`: llama.cpp's reordering of the rows of Q and K weights
  (``permute`` in ``convert_hf_to_gguf.py``) and, with ``inverse``, its undoing.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from treecli import _index, _memory
from treecli._errors import UsageError
from treecli._leaf import CHUNK_BYTES, ArrayLeaf, ComputedLeaf


def resolved_shape(shape: Sequence[int], size: int, what: str) -> tuple[int, ...]:
    """``shape`` with at most one ``-1`` worked out so that it holds ``size`` elements.

    Raises:
        UsageError: more than one ``-1``, a negative size, or no whole fit.
    """
    shape = tuple(int(d) for d in shape)
    unknown = [i for i, d in enumerate(shape) if d == -1]
    if len(unknown) > 1 or any(d < -1 for d in shape):
        raise UsageError(f"{what}: shape {list(shape)}: give at most one -1 and no other negative size")
    known = math.prod(d for d in shape if d != -1)
    if unknown:
        if known == 0 or size % known:
            raise UsageError(f"{what}: {size} elements do not fill shape {list(shape)}")
        shape = shape[: unknown[0]] + (size // known,) + shape[unknown[0] + 1 :]
    if math.prod(shape) != size:
        raise UsageError(f"{what}: {size} elements do not fill shape {list(shape)}")
    return shape


def reshaped(leaf: ArrayLeaf, shape: Sequence[int]) -> ComputedLeaf:
    """``leaf.reshape(shape)``: the same elements in the same order (one ``-1`` allowed)."""
    shape = resolved_shape(shape, leaf.size, f"a reshape of {list(leaf.shape)}")
    return ComputedLeaf(shape, leaf.dtype_name, leaf.read_flat, inputs=[leaf])


def _axis(axis: int, ndim: int, what: str) -> int:
    if not -ndim <= axis < ndim:
        raise UsageError(f"{what}: axis {axis} is out of range for {ndim} dimensions")
    return axis % ndim


def concatenated(leaves: Sequence[ArrayLeaf], axis: int = 0) -> ComputedLeaf:
    """``np.concatenate(leaves, axis)``, each output chunk read from the rows of the
    inputs that make it.

    Raises:
        UsageError: no leaves, or leaves whose dtypes or other axes differ.
    """
    if not leaves:
        raise UsageError("nothing to concatenate")
    first = leaves[0]
    axis = _axis(axis, max(1, first.ndim), "concatenate")
    for leaf in leaves[1:]:
        if leaf.dtype_name != first.dtype_name or leaf.ndim != first.ndim or \
                leaf.shape[:axis] + leaf.shape[axis + 1 :] != first.shape[:axis] + first.shape[axis + 1 :]:
            raise UsageError(f"cannot concatenate {first.dtype_name}{list(first.shape)} and "
                             f"{leaf.dtype_name}{list(leaf.shape)} along axis {axis}")
    inner = math.prod(first.shape[axis + 1 :])
    widths = [leaf.shape[axis] * inner for leaf in leaves]  # each input's elements in one row of the outer axes
    row = sum(widths)
    shape = first.shape[:axis] + (sum(leaf.shape[axis] for leaf in leaves),) + first.shape[axis + 1 :]
    starts = [sum(widths[:i]) for i in range(len(widths))]

    def compute(start: int, stop: int):
        import numpy as np

        if stop <= start:
            return np.empty(0, first.dtype)
        first_row, last_row = start // row, (stop - 1) // row + 1
        if row * first.itemsize < CHUNK_BYTES:  # short rows: whole rows of every input, side by side
            count = last_row - first_row
            rows = np.concatenate([leaf.read_flat(first_row * w, last_row * w).reshape(count, w)
                                   for leaf, w in zip(leaves, widths)], axis=1).reshape(-1)
            return rows[start - first_row * row : stop - first_row * row]
        pieces = []  # long rows (axis 0 above all): each piece of a row from the input holding it
        for r in range(first_row, last_row):
            low, high = max(start, r * row) - r * row, min(stop, (r + 1) * row) - r * row
            for leaf, begin, w in zip(leaves, starts, widths):
                a, b = max(low, begin), min(high, begin + w)
                if a < b:
                    pieces.append(leaf.read_flat(r * w + a - begin, r * w + b - begin))
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    return ComputedLeaf(shape, first.dtype_name, compute, inputs=list(leaves))


def split(leaf: ArrayLeaf, sizes: Sequence[int], axis: int = 0) -> list[ComputedLeaf]:
    """``leaf`` cut along ``axis`` into parts of ``sizes`` (one ``-1`` allowed), each read
    by byte ranges of the input where it lies in a file.

    Raises:
        UsageError: sizes that do not add up to the axis.
    """
    axis = _axis(axis, leaf.ndim, "split")
    sizes = [int(size) for size in sizes]
    if sizes.count(-1) == 1 and all(size >= 0 for size in sizes if size != -1):
        sizes[sizes.index(-1)] = leaf.shape[axis] - sum(size for size in sizes if size != -1)
    if any(size < 0 for size in sizes) or sum(sizes) != leaf.shape[axis]:
        raise UsageError(f"split: sizes {sizes} do not add up to axis {axis} of {list(leaf.shape)}")
    parts, begin = [], 0
    for size in sizes:
        index = (slice(None),) * axis + (slice(begin, begin + size),)
        parts.append(sliced_leaf(leaf, index))
        begin += size
    return parts


def stacked(leaves: Sequence[ArrayLeaf], axis: int = 0) -> ComputedLeaf:
    """``np.stack(leaves, axis)``: leaves of one shape and dtype along a new axis."""
    if not leaves:
        raise UsageError("nothing to stack")
    shapes = {leaf.shape for leaf in leaves}
    if len(shapes) > 1 or len({leaf.dtype_name for leaf in leaves}) > 1:
        raise UsageError("cannot stack leaves of different shapes or dtypes: " + ", ".join(
            sorted({f"{leaf.dtype_name}{list(leaf.shape)}" for leaf in leaves})))
    shape = leaves[0].shape
    axis = _axis(axis, len(shape) + 1, "stack")
    expanded = shape[:axis] + (1,) + shape[axis:]
    return concatenated([reshaped(leaf, expanded) for leaf in leaves], axis)


def unstacked(leaf: ArrayLeaf, axis: int = 0) -> list[ComputedLeaf]:
    """The leaves :func:`stacked` made ``leaf`` of: one for each index of ``axis``."""
    axis = _axis(axis, leaf.ndim, "unstack")
    rest = leaf.shape[:axis] + leaf.shape[axis + 1 :]
    return [reshaped(part, rest) for part in split(leaf, [1] * leaf.shape[axis], axis)]


def transposed(leaf: ArrayLeaf, axes: Sequence[int]) -> ComputedLeaf:
    """``leaf.transpose(axes)``. The whole leaf is read on the first chunk asked for and
    let go with the last one (an output chunk needs elements from all over the input)."""
    axes = tuple(int(a) for a in axes)
    if sorted(a % max(1, leaf.ndim) for a in axes) != list(range(leaf.ndim)) or len(axes) != leaf.ndim:
        raise UsageError(f"transpose: {list(axes)} is no order of the {leaf.ndim} axes of {list(leaf.shape)}")
    axes = tuple(a % leaf.ndim for a in axes)
    shape = tuple(leaf.shape[a] for a in axes)
    available = _memory.available()
    if available is not None and 2 * leaf.nbytes > available:  # (refused now: before anything is written)
        raise UsageError(f"a transpose holds the leaf twice in memory ({2 * leaf.nbytes / 2**30:.1f} GiB), and "
                         f"{available / 2**30:.1f} GiB is available")
    held: dict[str, Any] = {}

    def compute(start: int, stop: int):
        import numpy as np

        if "data" not in held:
            whole = leaf.read_flat(0, leaf.size).reshape(leaf.shape)
            held["data"] = np.ascontiguousarray(whole.transpose(axes)).reshape(-1)
        data = held["data"]
        if stop >= data.size:
            held.clear()  # the writer has the last chunk: hold nothing for a finished leaf
        return data[start:stop]

    return ComputedLeaf(shape, leaf.dtype_name, compute, inputs=[leaf])


def inverse_axes(axes: Sequence[int]) -> tuple[int, ...]:
    """The order of axes that undoes ``transposed(leaf, axes)``."""
    order = [0] * len(axes)
    for position, axis in enumerate(axes):
        order[axis % len(axes)] = position
    return tuple(order)


def rotary_permuted(leaf: ArrayLeaf, heads: int, *, inverse: bool = False) -> ComputedLeaf:
    """llama.cpp's order of a Q or K projection's rows (its ``permute``): in each head's
    block of rows, the two halves that rotary embedding pairs are interleaved, as
    ``w.reshape(heads, 2, d // 2, ...).swapaxes(1, 2)``; ``inverse`` undoes it. Each
    chunk is made from the whole head blocks it covers.

    Raises:
        UsageError: rows that do not split into ``heads`` blocks of an even size.
    """
    if leaf.ndim < 1 or heads <= 0 or leaf.shape[0] % heads or (leaf.shape[0] // heads) % 2:
        raise UsageError(f"rotary permutation: {list(leaf.shape)} does not split into {heads} heads of an even "
                         "number of rows")
    block = leaf.shape[0] // heads  # rows of one head
    half = block // 2
    # Row k of a head's block in the output is row order[k] of the input's.
    forward = [(k % 2) * half + k // 2 for k in range(block)]
    order = [0] * block
    for k, source in enumerate(forward):
        order[source if inverse else k] = k if inverse else source
    row = math.prod(leaf.shape[1:])
    block_elems = block * row

    def compute(start: int, stop: int):
        import numpy as np

        if stop <= start:
            return np.empty(0, leaf.dtype)
        first, last = start // block_elems, (stop - 1) // block_elems + 1
        data = leaf.read_flat(first * block_elems, last * block_elems).reshape(last - first, block, row)
        return data[:, order].reshape(-1)[start - first * block_elems : stop - first * block_elems]

    return ComputedLeaf(leaf.shape, leaf.dtype_name, compute, inputs=[leaf])


def sliced_leaf(source: ArrayLeaf, index: tuple, shape: tuple[int, ...] | None = None) -> ComputedLeaf:
    """A computed leaf equal to ``source[index]``, produced by output rows on demand.

    The output is cut into blocks of rows along its first selected axis (about
    one chunk each); a block is read from the source with ``read(index)``
    (only its bytes, for file leaves). The last block is kept, so a writer
    asking for consecutive chunks reads each source row once.
    """
    shape = _index.result_shape(source.shape, index) if shape is None else shape
    selectors = _index.selectors(source.shape, index)
    axis = next((i for i, s in enumerate(selectors) if isinstance(s, range)), None)
    row_elems = math.prod(len(s) for s in selectors[axis + 1 :] if isinstance(s, range)) if axis is not None else 1
    rows_per_block = max(1, CHUNK_BYTES // max(1, row_elems * source.itemsize))
    block_elems = rows_per_block * row_elems
    cache: dict[str, Any] = {}

    def block(b: int):
        """Output rows [b * rows_per_block, ...) as a flat array; the last block is kept."""
        if cache.get("block") != b:
            sub = list(selectors)
            sub[axis] = selectors[axis][b * rows_per_block : (b + 1) * rows_per_block]
            cache["block"], cache["data"] = b, source.read(_as_index(sub)).reshape(-1)
        return cache["data"]

    def compute(start: int, stop: int):
        import numpy as np

        if axis is None or row_elems == 0:
            return source.read(index).reshape(-1)[start:stop]
        pieces, position = [], start
        while position < stop:
            b = position // block_elems
            data, base = block(b), b * block_elems
            end = min(stop, base + data.size)
            pieces.append(data[position - base : end - base])
            position = end
        if stop == math.prod(shape):
            cache.clear()  # the writer has the last chunk: hold nothing for a finished leaf
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def compute_index(sub_index: Any):
        whole = source.read(index)
        return whole if sub_index == () else whole[sub_index].copy()

    return ComputedLeaf(shape, source.dtype_name, compute, compute_index, inputs=[source])


def _as_index(selectors: list) -> tuple:
    out = []
    for s in selectors:
        if isinstance(s, range):
            out.append(slice(s.start, s.stop if s.stop >= 0 else None, s.step))
        else:
            out.append(s)
    return tuple(out)
