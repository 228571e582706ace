"""``treecli convert``: between any formats treecli writes, verified after writing."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from treecli.cli import _options as opt
from treecli.cli._common import about, open_input, report_written, write_output, written_json
from treecli.cli._output import Output


def convert(
    source: Annotated[str, typer.Argument(help="Input checkpoint (a path or URL).", show_default=False,
                                          metavar="SOURCE")],
    target: Annotated[str, typer.Argument(help="Output file, directory, or s3:// or gs:// URL.", show_default=False,
                                          metavar="TARGET")],
    format: opt.OutputFormatOpt = None,
    dtype: opt.dtype_option("Cast floating-point leaves to this dtype; into a .gguf output, q8_0, q5_1, q5_0, "
                            "q4_1 or q4_0 quantizes the weights (2-D leaves of whole blocks).") = None,
    max_shard_size: opt.MaxShardOpt = None,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip re-reading the output to check every "
                                            "leaf bit-exactly before it replaces anything.")] = False,
    drop_unsupported: opt.DropUnsupportedOpt = False,
    where: opt.WhereOpt = None,
    input_format: opt.InputFormatOpt = None,
    step: opt.StepOpt = None,
    like: opt.LikeOpt = None,
    force: opt.ForceOpt = False,
    json: opt.JsonOpt = False,
    quiet: opt.QuietOpt = False,
) -> None:
    """Convert a checkpoint to another format, verified bit-exactly before it is published.

    Refuses what the target cannot hold (a dtype, strings, scalars, empty
    containers) unless --drop-unsupported, which drops them with a warning.

    Examples:

    \b
        treecli convert orbax_ckpt model.safetensors --drop-unsupported
        treecli convert model.safetensors hf_dir --max-shard-size 5GB
        treecli convert model.safetensors ckpt_dir --format orbax
        treecli convert model.safetensors layer0.safetensors --where 'model.layers.0.**'
    """
    from treecli import _dtypes, _leaf, _tree
    from treecli._combine import cast_leaf
    from treecli._edit import EditReport
    from treecli._keypath import format_keypath
    from treecli._verify import Verifier
    from treecli._errors import UsageError, option
    from treecli.formats import GGUF_QUANTIZATIONS, held_by, is_url, output_format, quantized_in_gguf

    out = Output(quiet=quiet)
    with open_input(out, source, input_format, step, like) as ckpt, about(source):
        tree = _tree.selected(ckpt.tree, where) if where else ckpt.tree
        report = EditReport()
        if dtype and dtype.lower() in GGUF_QUANTIZATIONS:  # a GGUF output's quantization of its weights
            if output_format(Path(target), format, ckpt.format)[0].name != "gguf":
                raise UsageError(f"{option('dtype', dtype)} quantizes into a GGUF file; name a .gguf output")
            tree = _tree.map_leaves(lambda kp, x: quantized_in_gguf(_leaf.as_leaf(x), dtype.lower())
                                    if _leaf.is_array(x) and _dtypes.is_float(_leaf.as_leaf(x).dtype_name) else x, tree)
        elif dtype:
            name = _dtypes.parse(dtype)
            tree = _tree.map_leaves(
                lambda kp, x: cast_leaf(_leaf.as_leaf(x), name, format_keypath(kp), report.warnings.append)
                if _leaf.is_array(x) and _dtypes.is_float(_leaf.as_leaf(x).dtype_name)
                and _leaf.as_leaf(x).dtype_name != name else x, tree)
        # A bucket output is checked by the upload's own checksums: it cannot be read back before it appears.
        decided = None if is_url(target) else output_format(Path(target), format, ckpt.format)
        if decided:  # (what the verification compares: the tree as the format will hold it)
            tree = held_by(tree, decided[0], target)
        verify = None if no_verify or decided is None else Verifier(
            tree, decided[0], drop_unsupported, progress=out.progress, like=ckpt.like)
        written = write_output(out, tree, target, source=ckpt, inputs=[ckpt], format=format, force=force,
                               max_shard_size=max_shard_size, drop_unsupported=drop_unsupported, verify=verify,
                               decided=decided)
        notes = ["verified: every leaf is bit-exact"] if verify else []
        report_written(out, written, notes=notes, warnings=report.warnings, json=written_json(
            written, notes, report.warnings, input=str(source), verified=verify is not None) if json else None)
