"""The index language of ``slice``: NumPy basic indexing as typed inside ``x[...]``.

``0``, ``-1``, ``:2``, ``...,-1``, ``1:5:2,:``, ``None, :`` — integers, slices,
``...`` and ``None`` separated by commas. Nothing is evaluated: the text is
tokenised, never passed to ``eval``.
"""

from __future__ import annotations

import re
from typing import Any

from treecli._errors import UsageError
from treecli._keypath import MAX_INDEX_DIGITS

Index = tuple  # tuple[int | slice | EllipsisType | None, ...]

_INT = re.compile(r"[+-]?\d+")
MAX_NDIM = 64  # NumPy's limit


def parse(text: str) -> Index:
    """Parse ``"0, :128"`` into ``(0, slice(None, 128))``.

    Raises:
        UsageError: for anything that is not basic indexing.
    """
    stripped = text.strip()
    if stripped.startswith("[") and stripped.endswith("]"):
        stripped = stripped[1:-1]
    if not stripped:
        raise UsageError(f"empty index {text!r}; write e.g. 0, :2 or ...,-1")
    parts = [p.strip() for p in stripped.split(",")]
    if parts and parts[-1] == "" and len(parts) > 1:  # a trailing comma, as in x[0,]
        parts = parts[:-1]
    out: list[Any] = []
    for part in parts:
        if part in ("...", "Ellipsis"):
            out.append(Ellipsis)
        elif part in ("None", "newaxis", "np.newaxis"):
            out.append(None)
        elif _INT.fullmatch(part):
            out.append(_integer(part, text))
        elif ":" in part:
            bounds = [b.strip() for b in part.split(":")]
            if len(bounds) > 3 or not all(b == "" or _INT.fullmatch(b) for b in bounds):
                raise UsageError(f"bad slice {part!r} in index {text!r}; write start:stop:step with integers")
            values = [_integer(b, text) if b else None for b in bounds]
            if len(values) == 3 and values[2] == 0:
                raise UsageError(f"slice step cannot be zero in index {text!r}")
            out.append(slice(*values))
        else:
            raise UsageError(
                f"bad index element {part!r} in {text!r}; use integers, start:stop:step, ... or None"
            )
    if out.count(Ellipsis) > 1:
        raise UsageError(f"an index can only have a single ellipsis ('...'): {text!r}")
    return tuple(out)


def _integer(digits: str, text: str) -> int:
    """An index integer; one longer than any axis could need is refused before conversion."""
    if len(digits.lstrip("+-").lstrip("0")) > MAX_INDEX_DIGITS:
        raise UsageError(f"integer {digits[:20]}... in index {text[:60]!r} is too large for any array")
    return int(digits)


def format_index(index: Index) -> str:
    """The text form of a parsed index, as one would type it."""

    def one(item: Any) -> str:
        if item is Ellipsis:
            return "..."
        if item is None:
            return "None"
        if isinstance(item, slice):
            text = ":".join("" if v is None else str(v) for v in (item.start, item.stop))
            return text + (f":{item.step}" if item.step is not None else "")
        return str(item)

    return ", ".join(one(i) for i in index)


def indexed_dims(index: Index) -> int:
    """How many dimensions of the array an index consumes (``None`` and ``...`` consume none)."""
    return sum(1 for item in index if item is not None and item is not Ellipsis)


def result_shape(shape: tuple[int, ...], index: Index) -> tuple[int, ...]:
    """The shape of ``x[index]`` for an array of ``shape``, without any data.

    Raises:
        IndexError: as NumPy would, in its words (out of range, too many indices).
        ValueError: a slice step of zero, as NumPy's.
    """
    consumed = indexed_dims(index)
    if consumed > len(shape) or list(index).count(Ellipsis) > 1:
        if list(index).count(Ellipsis) > 1:
            raise IndexError("an index can only have a single ellipsis ('...')")
        raise IndexError(f"too many indices for array: array is {len(shape)}-dimensional, but {consumed} were indexed")
    out: list[int] = []
    axis = 0
    for item in index:
        if item is None:
            out.append(1)
        elif item is Ellipsis:
            fill = len(shape) - consumed
            out.extend(shape[axis : axis + fill])
            axis += fill
        elif isinstance(item, slice):
            if item.step == 0:
                raise ValueError("slice step cannot be zero")
            out.append(len(range(*item.indices(shape[axis]))))
            axis += 1
        else:
            if not -shape[axis] <= item < shape[axis]:
                raise IndexError(f"index {item} is out of bounds for axis {axis} with size {shape[axis]}")
            axis += 1
    result = tuple(out) + tuple(shape[axis:])
    if len(result) > MAX_NDIM:
        raise IndexError(f"the result would have {len(result)} dimensions; NumPy (and so treecli) reads at most "
                         f"{MAX_NDIM}")
    return result


def selectors(shape: tuple[int, ...], index: Index) -> list[int | range]:
    """Per source axis: the integer taken, or the ``range`` of positions selected.

    ``None`` entries are dropped (they only insert length-1 axes, which a
    reshape to :func:`result_shape` restores); ``...`` is expanded.
    Call :func:`result_shape` first to validate the index.
    """
    items = [i for i in index if i is not None]
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = len(shape) - (len(items) - 1)
        items = items[:at] + [slice(None)] * fill + items[at + 1 :]
    items += [slice(None)] * (len(shape) - len(items))
    out: list[int | range] = []
    for item, dim in zip(items, shape):
        if isinstance(item, slice):
            out.append(range(*item.indices(dim)))
        else:
            out.append(item + dim if item < 0 else item)
    return out
