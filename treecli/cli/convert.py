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
    from treecli import _dtypes, _tree
    from treecli._combine import AverageReport, cast_floats
    from treecli._errors import UsageError, option
    from treecli.formats import GGUF_QUANTIZATIONS, is_url, output_format, quantized

    out = Output(quiet=quiet)
    with open_input(out, source, input_format, step, like) as ckpt, about(source):
        tree = _tree.selected(ckpt.tree, where) if where else ckpt.tree
        report = AverageReport()  # (a cast's warnings fill in as the output is written)
        if dtype and dtype.lower() in GGUF_QUANTIZATIONS:  # a GGUF output's quantization of its weights
            if is_url(target) or output_format(Path(target), format, ckpt.format)[0].name != "gguf":
                raise UsageError(f"{option('dtype', dtype)} quantizes into a GGUF file; name a .gguf output")
            tree = quantized(tree, dtype)
        elif dtype:
            tree = cast_floats(tree, _dtypes.parse(dtype), report)
        # A bucket output is checked by the upload's own checksums: it cannot be read back before it appears.
        verify = not no_verify and not is_url(target)
        written = write_output(out, tree, target, source=ckpt, inputs=[ckpt], format=format, force=force,
                               max_shard_size=max_shard_size, drop_unsupported=drop_unsupported, verify=verify)
        notes = [opt.VERIFIED] if verify else []
        report_written(out, written, notes=notes, warnings=report.warnings(), json=written_json(
            written, notes, report.warnings(), input=str(source), verified=verify) if json else None)
