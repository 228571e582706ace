"""What every format module provides, and what opening a checkpoint returns.

A format module defines a module-level ``FORMAT`` object with:

- ``name`` (``"safetensors"``), ``extensions`` (``(".safetensors",)``),
  ``separator`` (how flat keys nest: ``"."``, ``"/"``, or ``None`` if the
  format stores a real tree);
- ``sniff(path) -> str | None``: ``None`` if the file or directory looks like
  this format, else why not (shown when no format accepts a file);
- ``open(path, **options) -> Checkpoint``: metadata only, lazy leaves;
- ``write(tree, target, options: WriteOptions) -> None`` (optional): stream
  the tree to ``target`` (a temporary path given by the atomic writer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


@dataclass
class Origin:
    """Where a checkpoint's weights live: what ``--in-place`` rewrites, and what
    no output may land on.

    ``layout`` is ``"file"`` (one file: ``path``), ``"sharded"`` (an index at
    ``path`` naming shard files), ``"directory"`` (a checkpoint directory
    rewritten whole: Orbax) or ``"step"`` (a CheckpointManager step, which is
    never rewritten in place). ``files`` are every file the weights are read from.
    """

    layout: str
    path: Path
    files: list[Path] = field(default_factory=list)


@dataclass
class Checkpoint:
    """An opened checkpoint: a tree of lazy leaves plus what surrounds it."""

    tree: Any
    format: str
    file: str
    metadata: dict[str, Any] = field(default_factory=dict)
    #: Other files of an input directory (config.json, tokenizer files), copied
    #: unchanged to a directory output.
    companions: list[Path] = field(default_factory=list)
    #: Warnings met while opening (a file opened flat, an ignored stray shard).
    warnings: list[str] = field(default_factory=list)
    #: Extra facts for ``show`` (the steps of a CheckpointManager root, ...).
    info: dict[str, Any] = field(default_factory=dict)
    #: Where its weights live on disk (None for a tree in memory).
    origin: Origin | None = None
    #: The model its leaves belong to (``--like``): a ``_pytree.Structure``, whose
    #: order, shapes and dtypes an ``.eqx`` output follows.
    like: Any = None
    _closers: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def item(self, name: str) -> Any:
        """The tree of one item of a CheckpointManager step.

        Raises:
            UsageError: not a step, or it has no such item (its items named).
        """
        from treecli._errors import UsageError

        items = self.info.get("items")
        if items is None or name not in items:
            known = f"; items: {', '.join(items)}" if items else " (not a CheckpointManager step)"
            raise UsageError(f"no item {name!r}{known}", file=self.file)
        return self.tree[name]

    def close(self) -> None:
        for close in self._closers:
            close()
        self._closers.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class WriteOptions:
    """Options every writer understands (a writer ignores what does not apply)."""

    metadata: dict[str, Any] = field(default_factory=dict)
    max_shard_size: int | None = None
    companions: list[Path] = field(default_factory=list)
    drop_unsupported: bool = False
    #: The pytree the data leaves belong to (a ``_pytree.Structure``): an ``.eqx``
    #: output holds its leaves in its JAX flatten order, each of its shape and dtype,
    #: so that the model loads it. None: the tree's own order.
    like: Any = None
    #: Called with the number of bytes written after each chunk (progress bars).
    progress: Callable[[int], None] | None = None
    #: Where writers record the digests of the leaves they write, for a verification (see
    #: ``stream.write_leaf``); None: not recorded.
    digests: dict[int, tuple[Any, tuple[int, int, int]]] | None = None
    #: A ``stream.ReadBack`` for a verified output: each file's writer reads it back as it
    #: writes it (through its ``stream.Writeback``); None: not read back.
    readback: Any = None
    #: Called with each warning line the writer has for the user.
    warn: Callable[[str], None] | None = None

    def writeback(self, f: Any) -> Any:
        """The ``stream.Writeback`` of an output file open for writing as ``f``, reading it
        back as it is written when the output is verified."""
        from treecli._bytes import stream

        return stream.Writeback(f, self.readback.file(f) if self.readback is not None else None)
