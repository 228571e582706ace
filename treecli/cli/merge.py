"""``treecli merge``: task arithmetic, TIES, DARE and SLERP, streamed."""

from __future__ import annotations

import contextlib
from typing import Annotated, Optional

import typer

from treecli.cli import _options as opt
from treecli.cli._common import open_input, parse_weights, report_written, write_output, written_json
from treecli.cli._complete import complete_methods
from treecli.cli._output import Output


def merge(
    checkpoints: Annotated[list[str], typer.Argument(help="The models to merge (any formats, the same key paths, "
                                                      "shapes and dtypes).", show_default=False,
                                                      metavar="MODELS...")],
    output: opt.OutputOpt,
    method: Annotated[str, typer.Option("--method", "-m", help="linear, task_arithmetic, ties, dare_linear, "
                                        "dare_ties or slerp.", show_default=False,
                                        autocompletion=complete_methods)],
    base: Annotated[Optional[str], typer.Option("--base", help="The base model the task vectors (model - base) are "
                                                "taken from; for slerp, the model at t = 0.",
                                                show_default=False)] = None,
    weights: Annotated[Optional[str], typer.Option("--weights", "-w", help="One weight per model, e.g. 1,0.5 "
                                                   "(default: 1 each).", show_default=False)] = None,
    density: opt.patterns("--density", "[PATTERN=]D in (0, 1]: the fraction of each task vector kept (ties: the "
                          "largest magnitudes; dare_*: at random). Default 1.") = None,
    lambda_: opt.patterns("--lambda", "[PATTERN=]L: the scale of the merged task vector. Default 1.") = None,
    t: opt.patterns("--t", "[PATTERN=]T: slerp's interpolation factor, 0 the base, 1 the other model.") = None,
    seed: Annotated[int, typer.Option("--seed", help="DARE's random seed: the same seed gives the same bytes "
                                      "anywhere.")] = 0,
    rescale: Annotated[Optional[str], typer.Option("--rescale", help="How what a sparsifying method keeps is "
                                                   "rescaled: l1 (mergekit's: each task vector back to its L1 norm "
                                                   "over the leaf; dare_* and della* by default), density (DARE: by "
                                                   "1/density) or none.", show_default=False)] = None,
    normalize: Annotated[Optional[bool], typer.Option("--normalize/--no-normalize", help="Divide by the summed "
                                                      "weights (default: the method's own, as mergekit: linear "
                                                      "and ties do).", show_default=False)] = None,
    non_float: opt.NonFloatOpt = "last",
    format: opt.OutputFormatOpt = None,
    force: opt.ForceOpt = False,
    max_shard_size: opt.MaxShardOpt = None,
    drop_unsupported: opt.DropUnsupportedOpt = False,
    like: opt.LikeOpt = None,
    json: opt.JsonOpt = False,
    quiet: opt.QuietOpt = False,
) -> None:
    """Merge models with mergekit's methods, on any format, in flat memory.

    Parameters take rules, as slice --index does: a bare value is the default and
    PATTERN=VALUE sets it for the leaves under a pattern.

    Examples:

    \b
        treecli merge --method task_arithmetic --base base ft_a ft_b --lambda 0.8 -o out
        treecli merge --method ties --base base ft_a ft_b --density 0.5 --density 'encoder.**=0.7' -o out
        treecli merge --method dare_ties --base base ft_a ft_b --density 0.3 --seed 7 -o out
        treecli merge --method slerp --base a.safetensors b.safetensors --t 0.5 --t 'embed.**=0.3' -o out
    """
    from treecli._merge import merge as merge_trees

    out = Output(quiet=quiet)
    with contextlib.ExitStack() as stack:
        opened = [stack.enter_context(open_input(out, path, like=like)) for path in checkpoints]
        base_checkpoint = stack.enter_context(open_input(out, base, like=like)) if base else None
        tree, report = merge_trees(
            [c.tree for c in opened], method, base=base_checkpoint.tree if base_checkpoint else None,
            weights=parse_weights(weights, len(opened)), density=density, lambda_=lambda_, t=t, seed=seed,
            rescale=rescale, normalize=normalize, names=list(checkpoints), base_name=base or "base", non_float=non_float)
        source = base_checkpoint or opened[0]
        written = write_output(out, tree, output, source=source,
                               inputs=[*opened, *([base_checkpoint] if base else [])], format=format, force=force,
                               max_shard_size=max_shard_size, drop_unsupported=drop_unsupported)
        notes, warnings = report.notes(), report.warnings()
        report_written(out, written, notes=notes, warnings=warnings, json=written_json(
            written, notes, warnings, method=method, base=base, inputs=list(checkpoints)) if json else None)
