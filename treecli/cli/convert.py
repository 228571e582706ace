"""``treecli convert``: between any formats treecli writes, verified after writing."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer

from treecli.cli import _options as opt
from treecli.cli._complete import complete_recipe
from treecli.cli._common import about, command_line, open_input, report_written, write_output, written_json
from treecli.cli._output import Output


def convert(
    context: typer.Context,
    source: Annotated[Optional[str], typer.Argument(help="Input checkpoint (a path or URL).", show_default=False,
                                                    metavar="SOURCE")] = None,
    target: Annotated[Optional[str], typer.Argument(help="Output file, directory, or s3:// or gs:// URL.",
                                                    show_default=False, metavar="TARGET")] = None,
    recipe: Annotated[Optional[str], typer.Option(
        "--recipe", help="Make the checkpoint another program's model: a built-in recipe (llama.cpp, scanned) or a "
        "YAML file of reversible operations.", show_default=False, autocompletion=complete_recipe)] = None,
    reverse: Annotated[bool, typer.Option("--reverse", help="Run the recipe backwards: its output back into "
                                          "its input (a GGUF file back to an HF directory).")] = False,
    list_recipes: Annotated[bool, typer.Option("--list-recipes", help="List the built-in recipes and exit.")] = False,
    format: opt.OutputFormatOpt = None,
    dtype: opt.dtype_option("Cast floating-point leaves to this dtype; into a .gguf output, llama-quantize's "
                            "mixes (q4_k_m, q5_k_m, q3_k_s/m/l, q4_k_s, q5_k_s, q2_k, q6_k, q8_0, q5_1, q5_0, "
                            "q4_1, q4_0, iq4_nl, iq4_xs; q3_k, q4_k, q5_k its aliases of the _m mixes) quantize "
                            "the weights "
                            "tensor by tensor as llama-quantize does.") = None,
    tensor_type: Annotated[Optional[list[str]], typer.Option(
        "--tensor-type", help="With a quantizing --dtype: REGEX=TYPE quantizes the tensors whose llama.cpp "
        "name the regex is found in to TYPE (q8_0 ... q2_k, iq4_nl, iq4_xs), before the mix (llama-quantize's option); "
        "repeatable, the first match wins.", show_default=False, metavar="REGEX=TYPE")] = None,
    max_shard_size: opt.MaxShardOpt = None,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip re-reading the output to check every "
                                            "leaf bit-exactly before it replaces anything.")] = False,
    drop_unsupported: opt.DropUnsupportedOpt = False,
    where: opt.WhereOpt = None,
    input_format: opt.InputFormatOpt = None,
    step: opt.StepOpt = None,
    like: opt.LikeOpt = None,
    force: opt.ForceOpt = False,
    no_record: opt.NoRecordOpt = False,
    json: opt.JsonOpt = False,
    quiet: opt.QuietOpt = False,
) -> None:
    """Convert a checkpoint to another format, verified bit-exactly before it is published.

    Refuses what the target cannot hold (a dtype, strings, scalars, empty
    containers) unless --drop-unsupported, which drops them with a warning.

    A recipe makes it another program's model, and --reverse makes it back:
    names, layouts and the metadata and companion files that program reads
    (see docs/recipes.md).

    Examples:

    \b
        treecli convert Llama-3.2-1B/ llama.gguf --recipe llama.cpp
        treecli convert llama.gguf Llama-3.2-1B/ --recipe llama.cpp --reverse
        treecli convert Qwen2-0.5B/ scanned_ckpt --format orbax --recipe scanned
        treecli convert orbax_ckpt model.safetensors --drop-unsupported
        treecli convert model.safetensors hf_dir --max-shard-size 5GB
        treecli convert model.safetensors ckpt_dir --format orbax
        treecli convert model.safetensors layer0.safetensors --where 'model.layers.0.**'
        treecli convert llama.gguf llama-q4.gguf --dtype q4_k_m --tensor-type 'attn_v=q8_0'
    """
    from treecli import _dtypes, _tree
    from treecli._combine import AverageReport, cast_floats
    from treecli._errors import UsageError, option
    from treecli.formats import GGUF_QUANTIZATIONS, is_url, output_format, quantization_errors, quantized

    out = Output(quiet=quiet)
    if list_recipes:
        from treecli import _render, recipes

        out.lines(_render.table(["recipe", "what it makes"], [list(row) for row in recipes.listed()]))
        return
    if source is None or target is None:
        raise UsageError("give SOURCE and TARGET (or --list-recipes)")
    if reverse and recipe is None:
        raise UsageError("--reverse runs a recipe backwards: give --recipe")
    overrides = [_tensor_type(text) for text in tensor_type or []]
    if overrides and not (dtype and dtype.lower() in GGUF_QUANTIZATIONS):
        raise UsageError(f"{option('tensor-type', tensor_type[0])} picks a tensor's quantization: give a "
                         "quantizing --dtype (q4_k_m, q8_0, ...) too")
    with open_input(out, source, input_format, step, like) as ckpt, about(source):
        conversion = _recipe_applied(ckpt, recipe, reverse) if recipe else None
        tree = conversion.tree if conversion else ckpt.tree
        tree = _tree.selected(tree, where) if where else tree
        # A name without an extension is in the recipe's output format, else the input's.
        made_as = conversion.format if conversion and conversion.format else ckpt.format
        decided = None if is_url(target) else output_format(Path(target), format, made_as)
        report = AverageReport()  # (a cast's warnings fill in as the output is written)
        if dtype and dtype.lower() in GGUF_QUANTIZATIONS:  # a GGUF output's quantization of its weights
            if decided is None or decided[0].name != "gguf":
                raise UsageError(f"{option('dtype', dtype)} quantizes into a GGUF file; name a .gguf output")
            tree = quantized(tree, dtype, overrides)
        elif dtype:
            tree = cast_floats(tree, _dtypes.parse(dtype), report)
        # A bucket output is checked by the upload's own checksums: it cannot be read back before it appears.
        verify = not no_verify and not is_url(target)
        with _companions(conversion) as companions:
            written = write_output(out, tree, target, source=ckpt, inputs=[ckpt], format=format, force=force,
                                   max_shard_size=max_shard_size, drop_unsupported=drop_unsupported, verify=verify,
                                   metadata=conversion.metadata_of(tree) if conversion else None,
                                   companions=companions, decided=decided,
                                   record=None if no_record else command_line(context), inputs_read_whole=not where)
        errors = quantization_errors(tree)
        notes = [opt.quantized_note(errors, verify)] if errors else [opt.VERIFIED] if verify else []
        warnings = (conversion.warnings if conversion else []) + report.warnings()
        report_written(out, written, notes=notes, warnings=warnings, json=written_json(
            written, notes, warnings, input=str(source), verified=verify) if json else None)


def _tensor_type(text: str) -> tuple[str, str]:
    """--tensor-type's REGEX=TYPE (split at the last ``=``: a type has none, a regex may)."""
    from treecli._errors import UsageError, option

    pattern, equals, kind = text.rpartition("=")
    if not equals or not pattern or not kind:
        raise UsageError(f"{option('tensor-type', text)} is not REGEX=TYPE (attn_v=q8_0)")
    return pattern, kind


def _recipe_applied(ckpt, name: str, reverse: bool):
    from treecli import recipes

    return recipes.convert(ckpt, recipes.named(name), reverse=reverse)


@contextlib.contextmanager
def _companions(conversion) -> Iterator[list[Path] | None]:
    """The files a recipe makes for an output directory (config.json, the tokenizer's), in a
    temporary directory while they are copied beside the weights; None: the input's own."""
    if conversion is None or not conversion.files:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="treecli-companions-") as directory:
        paths = []
        for name, data in conversion.files.items():
            (Path(directory) / name).write_bytes(data)
            paths.append(Path(directory) / name)
        yield paths
