"""``treecli merge``: mergekit's methods, from flags or from a mergekit config, streamed."""

from __future__ import annotations

import contextlib
from typing import Annotated, Optional

import typer

from treecli.cli import _options as opt
from treecli.cli._common import command_line, open_input, parse_weights, report_written, write_output, written_json
from treecli.cli._complete import complete_methods
from treecli.cli._output import Output
from treecli.merge_methods import METHODS


def merge(
    context: typer.Context,
    checkpoints: Annotated[Optional[list[str]], typer.Argument(
        help="The models to merge (any formats, the same key paths and shapes); with --config, none: "
             "the config names them.", show_default=False, metavar="MODELS...")] = None,
    output: opt.OutputOpt = None,
    config: Annotated[Optional[str], typer.Option(
        "--config", "-c", metavar="MERGE.YML", show_default=False,
        help="A mergekit config: merge_method, base_model, models or slices, parameters (gradients, filters), "
             "dtype, out_dtype. Its models are any paths or URLs treecli reads.")] = None,
    method: Annotated[Optional[str], typer.Option(
        "--method", "-m", show_default=False, autocompletion=complete_methods,
        help=f"{', '.join(METHODS[:-1])} or {METHODS[-1]} (docs/merging.md says what each computes).")] = None,
    base: Annotated[Optional[str], typer.Option("--base", help="The base model the task vectors (model - base) are "
                                                "taken from; for slerp, the model at t = 0.",
                                                show_default=False)] = None,
    weights: Annotated[Optional[str], typer.Option("--weights", "-w", help="One weight per model, e.g. 1,0.5 "
                                                   "(default: 1 each).", show_default=False)] = None,
    density: opt.patterns("--density", "[PATTERN=]D in (0, 1]: the fraction of each task vector kept (ties, "
                          "breadcrumbs: by magnitude; dare_*, della*: at random). Default 1.") = None,
    lambda_: opt.patterns("--lambda", "[PATTERN=]L: the scale of the merged task vector. Default 1.") = None,
    t: opt.patterns("--t", "[PATTERN=]T: slerp's interpolation factor (0 the base, 1 the other model); "
                    "nearswap's distance.") = None,
    gamma: opt.patterns("--gamma", "[PATTERN=]G: the fraction of largest magnitudes breadcrumbs drops. "
                        "Default 0.01.") = None,
    epsilon: opt.patterns("--epsilon", "[PATTERN=]E: della's spread of keep probabilities (default 0.15); "
                          "ram's threshold of a change (default 1e-5).") = None,
    param: Annotated[Optional[list[str]], typer.Option(
        "--param", metavar="NAME=VALUE", show_default=False,
        help="Another parameter of the method by mergekit's name, e.g. filter_wise=true, select_topk=0.5, "
             "nuslerp_flatten=false.")] = None,
    seed: Annotated[int, typer.Option("--seed", help="The random seed of dare_* and della*: the same seed gives "
                                      "the same bytes anywhere.")] = 0,
    rescale: Annotated[Optional[str], typer.Option("--rescale", help="How what a sparsifying method keeps is "
                                                   "rescaled: l1 (mergekit's: each task vector back to its L1 norm "
                                                   "over the leaf; dare_* and della* by default), density (DARE: by "
                                                   "1/density) or none.", show_default=False)] = None,
    normalize: Annotated[Optional[bool], typer.Option("--normalize/--no-normalize", help="Divide by the summed "
                                                      "weights (default: the method's own, as mergekit's).",
                                                      show_default=False)] = None,
    layer_pattern: Annotated[Optional[str], typer.Option(
        "--layer-pattern", metavar="REGEX", show_default=False,
        help="With --config: a regular expression whose first group is a key path's layer number (default: the "
             "number after layers, blocks, h or layer).")] = None,
    dtype: opt.dtype_option("Output dtype of float leaves (default: each leaf's own; mixed inputs promote as in "
                            "mergekit: bf16 with f32 gives f32). With --config: the config's dtype, out_dtype.") = None,
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
    """Merge models with mergekit's methods, on any format, in flat memory.

    Parameters take rules, as slice --index does: a bare value is the default and
    PATTERN=VALUE sets it for the leaves under a pattern. A mergekit config
    (--config) is the full language: per-model parameters, gradients over the
    layers, filters, and slices that stack layers.

    Examples:

    \b
        treecli merge --config merge.yml -o out
        treecli merge --method task_arithmetic --base base ft_a ft_b --lambda 0.8 -o out
        treecli merge --method ties --base base ft_a ft_b --density 0.5 --density 'encoder.**=0.7' -o out
        treecli merge --method dare_ties --base base ft_a ft_b --density 0.3 --seed 7 -o out
        treecli merge --method slerp --base a.safetensors b.safetensors --t 0.5 --t 'embed.**=0.3' -o out
        treecli merge --method model_stock --base base ft_a ft_b --param filter_wise=true -o out
    """
    from treecli._errors import UsageError

    out = Output(quiet=quiet)
    if output is None:
        raise UsageError("name the output with -o/--output")
    if config is not None:
        given = [flag for flag, value in (("--method", method), ("--base", base), ("--weights", weights),
                                          ("--density", density), ("--lambda", lambda_), ("--t", t),
                                          ("--gamma", gamma), ("--epsilon", epsilon), ("--param", param),
                                          ("--rescale", rescale), ("--normalize", normalize), ("MODELS", checkpoints),
                                          ("--dtype", dtype))
                 if value is not None]
        if given:
            raise UsageError(f"--config {config!r} says what to merge; {given[0]} belongs in it")
        return _merge_config(out, config, output, seed, layer_pattern, non_float, format, force, max_shard_size,
                             drop_unsupported, like, json, verify,
                             None if no_record else command_line(context))
    if method is None:
        raise UsageError("name the method with --method, or give a mergekit config with --config")
    if not checkpoints:
        raise UsageError("name the models to merge")
    if layer_pattern is not None:
        raise UsageError("--layer-pattern is for --config (gradients and slices go by layer)")
    from treecli._merge import merge as merge_trees

    with contextlib.ExitStack() as stack:
        opened = [stack.enter_context(open_input(out, path, like=like)) for path in checkpoints]
        base_checkpoint = stack.enter_context(open_input(out, base, like=like)) if base else None
        tree, report = merge_trees(
            [c.tree for c in opened], method, base=base_checkpoint.tree if base_checkpoint else None,
            weights=parse_weights(weights, len(opened)), density=density, lambda_=lambda_, t=t, gamma=gamma,
            epsilon=epsilon, seed=seed, rescale=rescale, normalize=normalize, parameters=_parameters(param),
            names=list(checkpoints), base_name=base or "base", non_float=non_float, dtype=dtype)
        source = base_checkpoint or opened[0]
        written = write_output(out, tree, output, source=source,
                               inputs=[*opened, *([base_checkpoint] if base else [])], format=format, force=force,
                               max_shard_size=max_shard_size, drop_unsupported=drop_unsupported, verify=verify,
                               record=None if no_record else command_line(context))
        notes, warnings = report.notes() + ([opt.VERIFIED] if verify else []), report.warnings()
        report_written(out, written, notes=notes, warnings=warnings, json=written_json(
            written, notes, warnings, method=method, base=base, inputs=list(checkpoints)) if json else None)


def _merge_config(out: Output, path: str, output: str, seed: int, layer_pattern: str | None, non_float: str,
                  format, force: bool, max_shard_size, drop_unsupported: bool, like, json: bool,
                  verify: bool, record: str | None) -> None:
    from treecli._api import merge_config_file
    from treecli._configmerge import merge_config

    config = merge_config_file(path)
    with contextlib.ExitStack() as stack:
        opened = {name: stack.enter_context(open_input(out, name, like=like)) for name in config.models()}
        tree, report = merge_config(config, {name: c.tree for name, c in opened.items()}, seed=seed,
                                    non_float=non_float, layer_pattern=layer_pattern)
        # the files beside the weights (the tokenizer, config.json) are tokenizer_source's model's, else the first's
        first = opened[config.tokenizer_source] if config.tokenizer_source else next(iter(opened.values()))
        written = write_output(out, tree, output, source=first, inputs=list(opened.values()), format=format,
                               force=force, max_shard_size=max_shard_size, drop_unsupported=drop_unsupported,
                               verify=verify, record=record)
        notes, warnings = report.notes() + ([opt.VERIFIED] if verify else []), report.warnings()
        report_written(out, written, notes=notes, warnings=warnings, json=written_json(
            written, notes, warnings, method=config.method, base=config.base_model, inputs=config.models(),
            config=path) if json else None)


def _parameters(texts: list[str] | None) -> dict[str, object]:
    """``--param NAME=VALUE``s as a mapping, each value read as YAML reads a scalar."""
    from treecli._errors import UsageError
    from treecli._mergeconfig import convert

    parameters: dict[str, object] = {}
    for text in texts or []:
        name, sep, value = text.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"--param {text!r}: write NAME=VALUE, e.g. filter_wise=true")
        lowered = value.strip().lower()
        if lowered in ("true", "false"):
            parameters[name.strip()] = convert(lowered, bool)
        elif lowered in ("none", "null", ""):
            parameters[name.strip()] = None
        else:
            try:
                parameters[name.strip()] = convert(value.strip(), float)
            except UsageError as e:
                raise UsageError(f"--param {text!r}: {e.message}") from None
    return parameters
