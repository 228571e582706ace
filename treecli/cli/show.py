"""``treecli show``: what is in this checkpoint."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from treecli.cli import _options as opt
from treecli.cli._common import about, open_input, record_of
from treecli.cli._output import Output


def show(
    checkpoint: opt.CheckpointArg,
    where: opt.WhereOpt = None,
    depth: Annotated[
        Optional[int], typer.Option("--depth", "-d", min=1, help="Fold levels deeper than N into their totals.",
                                    show_default=False)
    ] = None,
    flat: Annotated[bool, typer.Option("--flat", help="A table of full key paths instead of a tree.")] = False,
    expand: Annotated[bool, typer.Option("--expand", help="On a terminal, show every one of identical numbered "
                                         "siblings (layers.0 ... layers.31) instead of one folded row.")] = False,
    stats: Annotated[
        bool, typer.Option("--stats", help="Read the data once: min/max/mean/std and NaN/Inf/zero counts per leaf.")
    ] = False,
    json: opt.JsonOpt = False,
    format: opt.FormatOpt = None,
    step: opt.StepOpt = None,
    like: opt.LikeOpt = None,
    item: Annotated[Optional[str], typer.Option("--item", help="Only this item of a CheckpointManager step "
                                                "(e.g. state).", show_default=False)] = None,
    quiet: opt.QuietOpt = False,
) -> None:
    """Show the tree of a checkpoint: shapes, dtypes, sizes, totals, metadata.

    Reads metadata only (instant on any size) unless --stats.

    Examples:

    \b
        treecli show model.safetensors
        treecli show ./Llama-3-8B --where 'model.layers.0.**' --flat
        treecli show ckpt_dir --depth 2 --json
        treecli show ./Llama-3-8B --expand
    """
    from treecli import _gc, _render, _summary

    out = Output(quiet=quiet)
    with open_input(out, checkpoint, format, step, like) as ckpt, about(checkpoint):
        tree = ckpt.tree
        if item is not None:
            tree = {item: ckpt.item(item)}
        root = _summary.summarize(tree, where or [], shared=not stats)  # stats: each leaf a row of its own
        _gc.outlive(tree, root)
        if stats:
            with out.progress("reading", root.nbytes) as advance:
                _summary.add_stats(root, advance)
        metadata, record, note = record_of(ckpt)
        if json:
            document = _render.show_json(str(checkpoint), ckpt.format, root, metadata, ckpt.described_model())
            document["record"] = record
            document.update(ckpt.info)
            out.json(document)
        else:
            out.lines(_render.show_lines(str(checkpoint), ckpt.format, root, metadata, ckpt.info, flat=flat,
                                         depth=depth, stats=stats, plain=out.plain,
                                         fold=not (out.plain or expand or stats),
                                         width=None if out.plain else out.stdout.width, model=ckpt.described_model(),
                                         record=_render.record_lines(record, note)))

