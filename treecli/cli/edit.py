"""``treecli edit``: ``tree_at`` surgery from the shell."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Optional

import typer

from treecli.cli import _options as opt
from treecli.cli._common import about, command_line, open_input, report_written, write_output
from treecli.cli._complete import complete_cast
from treecli.cli._output import Output


def edit(
    context: typer.Context,
    checkpoint: opt.CheckpointArg,
    output: Annotated[Optional[str], typer.Option(
        "--output", "-o", help="Output file or directory, or an s3:// or gs:// URL.",
        show_default=False)] = None,
    rename: opt.patterns("--rename", "OLD=NEW: a key path, a prefix, or ** captures carried over "
                         "('_orig_mod.**=**'). Applied first.") = None,
    delete: opt.patterns("--delete", "PATTERN: leaves or whole subtrees.") = None,
    set_: opt.patterns("--set", "KEYPATH=VALUE: a number broadcast to the leaf's shape and dtype, or "
                       "@file.npy.") = None,
    cast: opt.patterns("--cast", "PATTERN=DTYPE: wildcards cast float leaves only; a key path named exactly is "
                       "cast whatever its dtype.", complete=complete_cast) = None,
    scale: opt.patterns("--scale", "PATTERN=FACTOR: multiply float leaves.") = None,
    transpose: opt.patterns("--transpose", "REGEX=AXES: the axes of the leaves whose names match, in this "
                            "order ('.*_proj\\.weight=1,0': Linear weights as kernels).") = None,
    stack: opt.patterns("--stack", "'PATTERN -> TEMPLATE': leaves numbered {i} stacked on a new first axis "
                        "('model.layers.{i}.(.+) -> layers.\\1').") = None,
    unstack: opt.patterns("--unstack", "'PATTERN -> TEMPLATE': the first axis cut into leaves numbered {i} "
                          "('layers.(.+) -> model.layers.{i}.\\1').") = None,
    regex_rename: opt.patterns("--regex-rename", "'PATTERN -> TEMPLATE': a regular expression's groups carried "
                               "over ('model.layers.(\\d+).mlp.up_proj.weight -> blk.\\1.ffn_up.weight').") = None,
    recipe: Annotated[Optional[str], typer.Option(
        "--recipe", help="A YAML file of reversible operations (docs/recipes.md), applied first.",
        show_default=False)] = None,
    reverse: Annotated[bool, typer.Option("--reverse", help="Apply --recipe's operations backwards.")] = False,
    allow_reshape: Annotated[bool, typer.Option("--allow-reshape", help="Let --set @file.npy change the "
                                                "leaf's shape.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would change (key path, shape and dtype "
                                          "before -> after); read no data, write nothing.")] = False,
    in_place: Annotated[bool, typer.Option("--in-place", help="Rewrite the input where it lies: only its "
                                           "weight files change, each atomically, keeping mode and owner.")] = False,
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
    """Edit leaves by key path: rename, delete, set, cast, scale — in that order.

    Every leaf you do not name is copied bit-exactly, without being decoded.
    Reversible layout changes come first, in this order: --recipe's operations,
    --unstack, --transpose, --stack, --regex-rename (each streams leaf by leaf;
    for another order, write a recipe).

    Examples:

    \b
        treecli edit ckpt.safetensors -o fixed.safetensors --rename '_orig_mod.**=**'
        treecli edit ckpt -o out --delete opt_state --cast 'embed.**=bfloat16' --set head.bias=0
        treecli edit ckpt.safetensors --set 'head.kernel=@new_head.npy' --in-place
        treecli edit ckpt.safetensors --scale 'head.kernel=0.5' --dry-run
        treecli edit Llama-3.2-1B -o scanned --stack 'model.layers.{i}.(.+) -> layers.\\1'
    """
    from treecli import _render
    from treecli._edit import EditReport, Edits
    from treecli._edit import edit as edit_tree
    from treecli._errors import UsageError

    out = Output(quiet=quiet)
    if in_place and output is not None:
        raise UsageError("give either -o OUTPUT or --in-place, not both")
    if output is None and not in_place and not dry_run:
        raise UsageError("give -o OUTPUT, --in-place, or --dry-run")
    from treecli.formats import open_array

    edits = Edits(rename=rename or [], delete=delete or [], set=set_ or [], cast=cast or [], scale=scale or [],
                  allow_reshape=allow_reshape, open_array=open_array)
    if reverse and recipe is None:
        raise UsageError("--reverse runs a recipe's operations backwards: give --recipe")
    steps = _layout_steps(recipe, reverse, transpose or [], stack or [], unstack or [], regex_rename or [])
    if not steps and not any((edits.rename, edits.delete, edits.set, edits.cast, edits.scale)):
        raise UsageError("nothing to do: give --rename, --delete, --set, --cast, --scale or a layout change")
    with _updating(out, checkpoint) if in_place else contextlib.nullcontext(), \
            open_input(out, checkpoint, input_format, step, like) as ckpt, about(checkpoint):
        tree, made = _relaid(ckpt, steps) if steps else (ckpt.tree, [])
        tree, report = edit_tree(tree, edits) if any(
            (edits.rename, edits.delete, edits.set, edits.cast, edits.scale)) else (tree, EditReport())
        report.rows[:0] = made
        if dry_run and not json:
            out.lines(_render.table(["key path", "before", "after", "what"], [list(r) for r in report.rows]))
            return
        written = None if dry_run else write_output(
            out, tree, output, source=ckpt, inputs=[ckpt], format=format, force=force, in_place=in_place,
            max_shard_size=max_shard_size, drop_unsupported=drop_unsupported, verify=verify,
            record=None if no_record else command_line(context))
        report_written(out, written, notes=[opt.VERIFIED] if verify and written else [], warnings=report.warnings,
                       json=_render.changes_json(report.rows, written) if json else None)


def _layout_steps(recipe: str | None, reverse: bool, transpose: list[str], stack: list[str], unstack: list[str],
                  regex_rename: list[str]) -> list:
    """The reversible operations the flags name, in their order."""
    from treecli import _transforms
    from treecli._errors import UsageError, option

    steps = []
    if recipe is not None:
        from treecli.recipes import _yaml

        if not recipe.lower().endswith((".yaml", ".yml")):
            raise UsageError(f"{option('recipe', recipe)}: edit takes a YAML file of operations; a built-in recipe "
                             "makes a model: treecli convert --recipe")
        own = _yaml.load(Path(recipe)).steps
        steps += _transforms.inverted(own) if reverse else own
    steps += _arrows("unstack", unstack, _transforms.Unstack)
    for text in transpose:
        keys, _, axes = text.rpartition("=")
        try:
            order = tuple(int(a) for a in axes.split(","))
        except ValueError:
            order = ()
        if not keys or not order:
            raise UsageError(f"{option('transpose', text)}: give REGEX=AXES ('.*_proj\\.weight=1,0')")
        steps.append(_transforms.Transpose(keys, order))
    steps += _arrows("stack", stack, _transforms.Stack)
    steps += _arrows("regex_rename", regex_rename, _transforms.Rename)
    return steps


def _arrows(flag: str, texts: list[str], operation) -> list:
    """``'PATTERN -> TEMPLATE'`` options as operations."""
    from treecli._errors import UsageError, option

    steps = []
    for text in texts:
        pattern, arrow, template = text.partition("->")
        if not arrow or not pattern.strip() or not template.strip():
            raise UsageError(f"{option(flag, text)}: give 'PATTERN -> TEMPLATE'")
        steps.append(operation(pattern.strip(), template.strip()))
    return steps


def _relaid(ckpt, steps: list) -> tuple:
    """The checkpoint's tree through the layout operations, and a report row for each leaf they made."""
    from treecli import _transforms
    from treecli._tree import describe_leaf
    from treecli.recipes import hyper_parameters

    before = _transforms.items_of(ckpt.tree)
    after = _transforms.applied(steps, before, hyper_parameters(ckpt))
    kept = {id(leaf) for _, leaf in before}
    described = dict(before)
    rows = [(name, describe_leaf(described[name]) if name in described else "-", describe_leaf(leaf), "relaid")
            for name, leaf in after if id(leaf) not in kept]
    rows += [(name, describe_leaf(leaf), "-", "relaid") for name, leaf in before
             if name not in dict(after) and id(leaf) not in {id(x) for _, x in after}]
    return _transforms.tree_of(after), sorted(rows)


def _updating(out: Output, checkpoint: str) -> contextlib.AbstractContextManager:
    """The in-place edit's read-modify-write held against another one of the same checkpoint."""
    from treecli import _atomic
    from treecli.formats import is_url

    if is_url(checkpoint) or not Path(checkpoint).exists():
        return contextlib.nullcontext()  # (refused, or not found, when it is opened)
    return _atomic.updating(Path(checkpoint), lambda: out.note(
        f"waiting for another in-place edit of {checkpoint} to finish"))
