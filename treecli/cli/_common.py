"""Helpers the commands share: open inputs, write outputs, parse common values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from treecli.cli._output import Output
from treecli.formats import WriteOptions, open_checkpoint, save
from treecli.formats._base import Checkpoint


def open_input(out: Output, path: Path, format: str | None = None, step: int | None = None) -> Checkpoint:
    """Open a checkpoint and pass its warnings on to stderr."""
    checkpoint = open_checkpoint(path, format, step=step)
    for warning in checkpoint.warnings:
        out.warn(f"{path}: {warning}")
    return checkpoint


def write_output(
    out: Output,
    tree: Any,
    target: Path,
    *,
    source: Checkpoint,
    inputs: list[Path],
    format: str | None,
    force: bool,
    in_place: bool = False,
    max_shard_size: str | None = None,
    drop_unsupported: bool = False,
    metadata: dict[str, Any] | None = None,
    mode: int | None = None,
) -> None:
    """Write a tree the way every command does: atomically, streaming, with a progress bar."""
    from treecli import _leaf, _tree
    from treecli.formats.safetensors import parse_size

    total = sum(_leaf.as_leaf(leaf).nbytes for _, leaf in _tree.flatten(tree) if _leaf.is_array(leaf))
    with out.progress(f"writing {target.name}", total) as advance:
        options = WriteOptions(
            metadata=dict(source.metadata if metadata is None else metadata),
            max_shard_size=parse_size(max_shard_size) if max_shard_size else None,
            companions=list(source.companions),
            drop_unsupported=drop_unsupported,
            progress=advance,
            warn=out.warn,
        )
        save(tree, target, format=format, input_format=source.format, options=options,
             inputs=inputs, force=force, in_place=in_place, mode=mode)
    out.note(f"wrote {target}")
