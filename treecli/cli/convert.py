"""``treecli convert``: between any formats treecli writes, verified after writing."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated, Optional

import typer

from treecli.cli import _options as opt
from treecli.cli._common import open_input, write_output
from treecli.cli._output import Output


def convert(
    source: Annotated[Path, typer.Argument(help="Input checkpoint.", show_default=False, metavar="SOURCE")],
    target: Annotated[Path, typer.Argument(help="Output file or directory.", show_default=False, metavar="TARGET")],
    format: opt.OutputFormatOpt = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Cast floating-point leaves to this dtype.",
                                                 show_default=False)] = None,
    max_shard_size: opt.MaxShardOpt = None,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip re-reading the output to check every "
                                            "leaf bit-exactly.")] = False,
    drop_unsupported: opt.DropUnsupportedOpt = False,
    input_format: opt.InputFormatOpt = None,
    step: opt.StepOpt = None,
    force: opt.ForceOpt = False,
    quiet: opt.QuietOpt = False,
) -> None:
    """Convert a checkpoint to another format, then verify it bit-exactly.

    Refuses what the target cannot hold (a dtype, None, strings, scalars, empty
    containers) unless --drop-unsupported, which drops them with a warning.

    Examples:

    \b
        treecli convert orbax_ckpt model.safetensors --drop-unsupported
        treecli convert model.safetensors hf_dir --max-shard-size 5GB
        treecli convert model.safetensors ckpt_dir --format orbax
    """
    from treecli import _diff, _dtypes, _leaf, _tree
    from treecli._edit import EditReport, cast_leaf
    from treecli._keypath import format_keypath
    from treecli._errors import TreecliError
    from treecli.formats import open_checkpoint

    out = Output(quiet=quiet)
    with open_input(out, source, input_format, step) as ckpt:
        tree = ckpt.tree
        report = EditReport()
        if dtype:
            name = _dtypes.parse(dtype)
            tree = _tree.map_leaves(
                lambda kp, x: cast_leaf(_leaf.as_leaf(x), name, format_keypath(kp), report)
                if _leaf.is_array(x) and _dtypes.is_float(_leaf.as_leaf(x).dtype_name)
                and _leaf.as_leaf(x).dtype_name != name else x, tree)
        write_output(out, tree, target, source=ckpt, inputs=[source], format=format, force=force,
                     max_shard_size=max_shard_size, drop_unsupported=drop_unsupported)
        for line in report.warnings:
            out.warn(line)
        if no_verify:
            return
        with open_checkpoint(target, format) as written:
            result = _diff.diff(tree, written.tree)
        dropped = set(result.only_in_a) if drop_unsupported else set()
        problems = [f"only in the output: {k}" for k in result.only_in_b]
        problems += [f"missing from the output: {k}" for k in result.only_in_a if k not in dropped]
        problems += [f"{c.keypath}: {c.a} -> {c.b}" for c in result.changed]
        if problems:
            shutil.rmtree(target) if target.is_dir() else target.unlink()
            raise TreecliError(f"verification failed: the output differs from the input in {len(problems)} leaves; "
                               "it was removed", file=str(target), details=problems)
        out.note("verified: every leaf is bit-exact")
