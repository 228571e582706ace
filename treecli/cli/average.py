"""``treecli average``: weighted averages of N checkpoints, streamed."""

from __future__ import annotations

import contextlib
from typing import Annotated, Optional

import typer

from treecli.cli import _options as opt
from treecli.cli._common import command_line, open_input, parse_weights, report_written, write_output, written_json
from treecli.cli._output import Output


def average(
    context: typer.Context,
    checkpoints: Annotated[list[str], typer.Argument(help="Two or more checkpoints with the same key paths "
                                                      "and shapes (any formats; float dtypes may differ).",
                                                      show_default=False, metavar="CHECKPOINTS...")],
    output: opt.OutputOpt,
    weights: Annotated[Optional[str], typer.Option("--weights", "-w", help="One weight per input, e.g. 1,2,3 "
                                                   "(default: equal). Negative weights are allowed.",
                                                   show_default=False)] = None,
    no_normalize: Annotated[bool, typer.Option("--no-normalize", help="Use the weights as given (task "
                                               "arithmetic: --weights 1,1,-1 --no-normalize); default: "
                                               "scale them to sum 1.")] = False,
    dtype: opt.dtype_option("Output dtype of float leaves (default: each leaf's own, bf16 stays bf16; "
                            "mixed inputs promote as in mergekit: bf16 with f32 gives f32).") = None,
    non_float: opt.NonFloatOpt = "last",
    format: opt.OutputFormatOpt = None,
    force: opt.ForceOpt = False,
    no_record: opt.NoRecordOpt = False,
    verify: opt.VerifyOpt = False,
    max_shard_size: opt.MaxShardOpt = None,
    drop_unsupported: opt.DropUnsupportedOpt = False,
    like: opt.LikeOpt = None,
    json: opt.JsonOpt = False,
    quiet: opt.QuietOpt = False,
) -> None:
    """Average checkpoints: model soups, the last N steps of a run, linear merges.

    Float leaves accumulate in float64 and are rounded back to their own dtype
    (bf16 stays bf16); memory stays flat (a few chunks of 4 MiB per input)
    whatever the model size.

    Examples:

    \b
        treecli average a.safetensors b.safetensors c.safetensors -o soup.safetensors
        treecli average step_100 step_200 step_300 --weights 1,2,3 -o avg
        treecli average base ft_a ft_b --weights -1,1,1 --no-normalize -o merged.safetensors
    """
    from treecli._average import average as average_trees
    from treecli._errors import UsageError

    out = Output(quiet=quiet)
    if len(checkpoints) < 2:
        raise UsageError("average needs at least two checkpoints")
    with contextlib.ExitStack() as stack:
        opened = [stack.enter_context(open_input(out, path, like=like)) for path in checkpoints]
        names = [str(p) for p in checkpoints]
        given = parse_weights(weights, len(opened))
        tree, report = average_trees([c.tree for c in opened], given, names=names,
                                     normalize=not no_normalize, dtype=dtype, non_float=non_float)
        written = write_output(out, tree, output, source=opened[0], inputs=opened, format=format, force=force,
                               max_shard_size=max_shard_size, drop_unsupported=drop_unsupported, verify=verify,
                               record=None if no_record else command_line(context))
        notes, warnings = report.notes() + ([opt.VERIFIED] if verify else []), report.warnings()
        report_written(out, written, notes=notes, warnings=warnings, json=written_json(
            written, notes, warnings, inputs=names, weights=given, normalize=not no_normalize) if json else None)
