"""``treecli edit``: ``tree_at`` surgery from the shell."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Optional

import typer

from treecli.cli import _options as opt
from treecli.cli._common import about, open_input, report_written, write_output
from treecli.cli._complete import complete_cast
from treecli.cli._output import Output


def edit(
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
    verify: opt.VerifyOpt = False,
    max_shard_size: opt.MaxShardOpt = None,
    drop_unsupported: opt.DropUnsupportedOpt = False,
    json: opt.JsonOpt = False,
    quiet: opt.QuietOpt = False,
) -> None:
    """Edit leaves by key path: rename, delete, set, cast, scale — in that order.

    Every leaf you do not name is copied bit-exactly, without being decoded.

    Examples:

    \b
        treecli edit ckpt.safetensors -o fixed.safetensors --rename '_orig_mod.**=**'
        treecli edit ckpt -o out --delete opt_state --cast 'embed.**=bfloat16' --set head.bias=0
        treecli edit ckpt.safetensors --set 'head.kernel=@new_head.npy' --in-place
        treecli edit ckpt.safetensors --scale 'head.kernel=0.5' --dry-run
    """
    from treecli import _render
    from treecli._edit import Edits
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
    if not any((edits.rename, edits.delete, edits.set, edits.cast, edits.scale)):
        raise UsageError("nothing to do: give --rename, --delete, --set, --cast or --scale")
    with _updating(out, checkpoint) if in_place else contextlib.nullcontext(), \
            open_input(out, checkpoint, input_format, step, like) as ckpt, about(checkpoint):
        tree, report = edit_tree(ckpt.tree, edits)
        if dry_run and not json:
            out.lines(_render.table(["key path", "before", "after", "what"], [list(r) for r in report.rows]))
            return
        written = None if dry_run else write_output(
            out, tree, output, source=ckpt, inputs=[ckpt], format=format, force=force, in_place=in_place,
            max_shard_size=max_shard_size, drop_unsupported=drop_unsupported, verify=verify)
        report_written(out, written, notes=[opt.VERIFIED] if verify and written else [], warnings=report.warnings,
                       json=_render.changes_json(report.rows, written) if json else None)


def _updating(out: Output, checkpoint: str) -> contextlib.AbstractContextManager:
    """The in-place edit's read-modify-write held against another one of the same checkpoint."""
    from treecli import _atomic
    from treecli.formats import is_url

    if is_url(checkpoint) or not Path(checkpoint).exists():
        return contextlib.nullcontext()  # (refused, or not found, when it is opened)
    return _atomic.updating(Path(checkpoint), lambda: out.note(
        f"waiting for another in-place edit of {checkpoint} to finish"))
