"""The Python API behind ``treecli.load`` / ``treecli.open`` / ``treecli.save``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from treecli.formats import WriteOptions, open_checkpoint, save as _save
from treecli.formats._base import Checkpoint


def open(path: str | Path, format: str | None = None, **options: Any) -> Checkpoint:  # noqa: A001
    """Open a checkpoint lazily; use as a context manager to close its files.

    Returns:
        A :class:`~treecli.formats._base.Checkpoint` with ``tree`` (lazy leaves),
        ``metadata``, ``format``.

    Raises:
        FormatError: the file is not a valid checkpoint.
    """
    return open_checkpoint(path, format, **options)


def load(path: str | Path, format: str | None = None, **options: Any) -> Any:
    """The tree of a checkpoint, with lazy leaves (``np.asarray(leaf)`` reads one).

    Example:
        >>> tree = treecli.load("model.safetensors")
        >>> tree["model"]["embed_tokens"]["weight"].read((slice(0, 2),)).shape
        (2, 4096)
    """
    return open_checkpoint(path, format, **options).tree


def save(
    tree: Any,
    path: str | Path,
    format: str | None = None,
    *,
    metadata: dict[str, Any] | None = None,
    max_shard_size: int | None = None,
    force: bool = False,
) -> Path:
    """Write a tree (lazy, NumPy or JAX leaves) atomically, streaming leaf by leaf.

    The format follows ``format``, else the extension of ``path``.

    Raises:
        UsageError: ``path`` exists and ``force`` is false.
        TreecliError: the format cannot hold some leaves.
    """
    options = WriteOptions(metadata=dict(metadata or {}), max_shard_size=max_shard_size)
    return _save(tree, path, format=format, options=options, force=force)
