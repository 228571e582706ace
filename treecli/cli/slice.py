"""``treecli slice``: per-leaf and per-subtree indexing."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from treecli.cli import _options as opt
from treecli.cli._common import about, command_line, open_input, report_written, write_output
from treecli.cli._output import Output


def slice_(
    context: typer.Context,
    checkpoint: opt.CheckpointArg,
    index: Annotated[
        list[str],
        typer.Option("--index", "-i", autocompletion=opt.complete_keypaths,
                     help="[PATTERN=]INDEX, repeatable. INDEX is NumPy basic indexing (0, :2, ...,-1, 1:5:2,:). "
                     "Without PATTERN: the default for every array leaf.", show_default=False),
    ],
    output: Annotated[Optional[str], typer.Option(
        "--output", "-o", help="Output file or directory, or an s3:// or gs:// URL.",
        show_default=False)] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show each affected leaf, shape before -> after; "
                                          "read no data, write nothing.")] = False,
    format: opt.OutputFormatOpt = None,
    input_format: opt.InputFormatOpt = None,
    step: opt.StepOpt = None,
    like: opt.LikeOpt = None,
    force: opt.ForceOpt = False,
    no_record: opt.NoRecordOpt = False,
    verify: opt.VerifyOpt = False,
    max_shard_size: opt.MaxShardOpt = None,
    drop_unsupported: opt.DropUnsupportedOpt = False,
    json: opt.JsonOpt = False,
    quiet: opt.QuietOpt = False,
) -> None:
    """Take member k of a stack, layer k of a scan, the first n rows — per subtree.

    A rule with PATTERN applies to every leaf under the matching subtrees and
    overrides the default; None and non-array leaves pass through; the default
    skips leaves with too few dimensions (0-d step counters) and says how many.
    Reads only the bytes the result needs.

    Examples:

    \b
        treecli slice ckpt.safetensors --index 0 -o member0.safetensors
        treecli slice ckpt --index 'encoder.layers=3' --index 'decoder.layers=-1' -o out
        treecli slice ckpt --index 'ensemble=2' --index ':, :128' -o out
        treecli slice ckpt --index 'params.**.kernel=..., :64' --dry-run
        treecli slice ckpt.safetensors --index 0 -o member0.safetensors --json
    """
    import shlex

    from treecli import _render
    from treecli._errors import UsageError, counted
    from treecli._slice import slice_tree

    out = Output(quiet=quiet)
    if output is None and not dry_run:
        raise UsageError("give -o OUTPUT, or --dry-run to see what would change")
    with open_input(out, checkpoint, input_format, step, like) as ckpt, about(checkpoint):
        tree, report = slice_tree(ckpt.tree, index)
        notes = []
        if report.skipped:
            n = len(report.skipped)
            notes.append(f"default index skipped {n} {'leaf' if n == 1 else 'leaves'} with too few dimensions "
                         f"(e.g. {report.skipped[0]})")
        taken_apart = report.vectors_taken_apart()
        if taken_apart:  # an index along each leaf's first axis is not "these layers"
            out.warn(f"the index took one element of {counted(len(taken_apart), 'vector')}, its only axis gone "
                     f"(e.g. {taken_apart[0]}); for whole subtrees (a layer), write treecli get "
                     f"{shlex.quote(str(checkpoint))} KEYPATH -o OUT or treecli convert --where PATTERN")
        if dry_run and not json:
            for line in notes:
                out.note(line)
            rows = [[k, _render.format_shape(b), "->", _render.format_shape(a), d, r]
                    for k, b, a, d, r in report.changed]
            out.lines(_render.table(["key path", "before", "", "after", "dtype", "rule"], rows))
            return
        written = None if dry_run else write_output(
            out, tree, output, source=ckpt, inputs=[ckpt], format=format, force=force,
            max_shard_size=max_shard_size, drop_unsupported=drop_unsupported, verify=verify,
            record=None if no_record else command_line(context), inputs_read_whole=False)
        if verify and written:
            notes.append(opt.VERIFIED)
        rows = [(k, f"{_render.format_shape(b)} {d}", f"{_render.format_shape(a)} {d}", f"index {r}")
                for k, b, a, d, r in report.changed]
        report_written(out, written, notes=notes,
                       json=_render.changes_json(rows, written, report.skipped) if json else None)
