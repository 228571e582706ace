"""Running a mergekit config (parsed by ``_mergeconfig``): its method (from
``treecli.merge_methods``), base, models or slices, parameters (per model, per slice,
global; gradients over the layers; filters), ``dtype`` and ``out_dtype``.

``models`` merges every tensor across whole models; ``slices`` stacks output layers
slice after slice, each merged from one layer of each source (a frankenmerge, with
``passthrough``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from treecli import _combine, _keypath, _leaf, _mergeconfig, _tree, merge_methods
from treecli._combine import AverageReport
from treecli._errors import UsageError
from treecli._keypath import format_keypath
from treecli.merge_methods import LeafMerge, LeafSettings, MergeMethod, Param, run


def load_config(config: Any, where: str = "the config") -> _mergeconfig.MergeConfig:
    """A mergekit config (its parsed YAML: ``_mergeconfig.parse``), checked against the methods."""
    if isinstance(config, _mergeconfig.MergeConfig):
        return config
    if isinstance(config, (str, Path)):
        raise UsageError("a config file is read by treecli.merge(config=PATH) or merge --config; here, give its "
                         "parsed mapping")
    return _mergeconfig.load(config, merge_methods.PARAMETERS, list(merge_methods.METHODS), where)


def merge_config(config: Any, trees: dict[str, Any], *, seed: int = 0, non_float: str = "last",
                 layer_pattern: str | None = None) -> tuple[Any, AverageReport]:
    """Run a mergekit config on ``trees`` (each model the config names, by that name): its
    method, base, models or slices, parameters (per model, per slice, global; gradients over
    the layers; filters), ``dtype`` (the inputs rounded to it; the arithmetic is float64)
    and ``out_dtype``. A layer's number is read from each key path by ``layer_pattern``
    (a regular expression whose first group is the number; default ``_keypath.LAYER_PATTERN``).
    The report's ``messages`` carry the config's warnings."""
    from treecli import _dtypes

    config = load_config(config)
    pattern = _keypath.layer_regex(layer_pattern or config.layer_pattern,
                                   "layer_pattern" if not layer_pattern else "--layer-pattern")
    dtype = _dtypes.parse(config.dtype) if config.dtype else None
    out_dtype = _dtypes.parse(config.out_dtype) if config.out_dtype else dtype
    for name, d in (("dtype", dtype), ("out_dtype", out_dtype)):
        if d is not None and not _dtypes.is_float(d):
            raise UsageError(f"{name} {d}: merges compute floating-point values; name a float dtype")
    missing = [m for m in config.models() if m not in trees]
    if missing:
        raise UsageError(f"no tree for {missing[0]!r}, which the config names")
    report = AverageReport()
    report.messages.extend(config.warnings)
    inputs = {name: _combine.cast_floats(tree, dtype, report) for name, tree in trees.items()}
    if config.from_slices:
        merged = _stacked_slices(config, inputs, pattern, seed, report)
    else:
        merged, report = _merged_models(config, inputs, pattern, seed, non_float, report)
    if out_dtype is not None:
        merged = _combine.cast_floats(merged, out_dtype, report)
    if config.tokenizer_source is not None:
        _check_vocabulary(merged, trees[config.tokenizer_source], config.tokenizer_source)
    return merged, report


def _check_vocabulary(merged: Any, source: Any, name: str) -> None:
    """The output's embeddings have as many rows as ``tokenizer_source``'s model has tokens
    (its own embeddings' rows): else its tokenizer would not fit the weights."""
    def rows(tree: Any) -> dict[str, int]:
        return {text: leaf.shape[0] for kp, leaf in _tree.flatten(tree)
                if (text := format_keypath(kp)).endswith(_keypath.EMBEDDINGS) and _leaf.is_array(leaf)
                and len(leaf.shape) == 2}

    theirs = rows(source)
    for text, count in rows(merged).items():
        if text in theirs and theirs[text] != count:
            raise UsageError(f"tokenizer_source {name!r}: its vocabulary has {theirs[text]} tokens, the output's "
                             f"{text} {count} rows; a tokenizer that fits the weights is another model's",
                             keypath=text)


def _settings(config: _mergeconfig.MergeConfig, out_slice: _mergeconfig.OutputSlice, models: list[str],
              method: MergeMethod, text: str, t: float) -> LeafSettings:
    """One tensor's parameters: each model's own, then the slice's, then the global ones."""
    spec = method
    sources = {s.model: s.parameters for s in out_slice.sources}
    shared_scopes = [out_slice.parameters, config.parameters]
    shared: dict[str, Any] = {}
    per_model: list[dict[str, Any]] = [{} for _ in models]

    def resolve(p: Param, scopes: list[dict]) -> Any:
        for scope in scopes:
            if p.name in scope:
                try:
                    value = _mergeconfig.evaluate(scope[p.name], text, t, p.kind)
                except UsageError as e:
                    raise UsageError(f"parameter {p.name}: {e.message}", keypath=text) from None
                if value is not None:
                    return value
        return p.default

    for p in spec.params:
        if p.per_model:
            for i, model in enumerate(models):
                per_model[i][p.name] = resolve(p, [sources.get(model, {}), *shared_scopes])
        else:
            shared[p.name] = resolve(p, shared_scopes)
    return LeafSettings(shared, per_model)


def _unused_parameters(config: _mergeconfig.MergeConfig, report: AverageReport) -> None:
    """A warning for each parameter the config sets that its method does not take."""
    spec = merge_methods.REGISTRY[config.method]
    named = set(config.parameters)
    for s in config.slices:
        named |= set(s.parameters) | {n for source in s.sources for n in source.parameters}
    for name in sorted(named):
        if spec.param(name) is None:
            report.messages.append(f"parameter {name} is not one of {config.method}'s; ignored")


def _layer_of(text: str, pattern) -> tuple[int, int] | None:
    """The layer number in a key path's text and where it starts, or None."""
    found = pattern.search(text)
    if not found:
        return None
    try:
        return int(found.group(1)), found.start(1)
    except (TypeError, ValueError):
        raise UsageError(f"the layer pattern captured {found.group(1)!r} in {text}, not a layer number") from None


def _merged_models(config: _mergeconfig.MergeConfig, trees: dict[str, Any], pattern, seed: int, non_float: str,
                   report: AverageReport) -> tuple[Any, AverageReport]:
    """``models``: every tensor merged across whole models; ``t`` of a gradient is the
    layer's position among the base's (the first model's) layers."""
    method = spec = merge_methods.REGISTRY[config.method]
    out_slice = config.slices[0]
    _unused_parameters(config, report)
    names = [s.model for s in out_slice.sources]
    base = config.base_model
    if spec.takes_no_base:
        if base is not None and base not in names:
            names.append(base)  # (mergekit adds the base as one more input)
        base = None
    elif base is not None:
        names = [n for n in names if n != base]
    run.check_inputs(method, base is not None, len(names), " (the config's models)")
    first = trees[base or names[0]]
    layers = {layer[0] for kp, _ in _tree.flatten(first) if (layer := _layer_of(format_keypath(kp), pattern))}
    count = max(layers) + 1 if layers else 1

    def settings(keypath: tuple) -> LeafSettings:
        text = format_keypath(keypath)
        layer = _layer_of(text, pattern)
        t = 0.0 if layer is None else (layer[0] / (count - 1) if count > 1 else 1.0)
        return _settings(config, out_slice, names, method, text, t)

    merged, own = run.merge_with(method, trees[base] if base else None, [trees[n] for n in names], settings,
                                 names=names, base_name=base or "base", seed=seed, non_float=non_float)
    own.messages[:0] = report.messages
    return merged, own


def _renumbered(keypath: tuple, start: int, number: int) -> tuple:
    """``keypath`` with the component whose text starts at ``start`` of its text made ``number``."""
    for i, key in enumerate(keypath):
        at = len(format_keypath(keypath[:i])) + (1 if i else 0)
        if at == start:
            return (*keypath[:i], number if isinstance(key, int) else str(number), *keypath[i + 1:])
    raise UsageError(f"the layer number of {format_keypath(keypath)} is not a whole key of its path")


def _stacked_slices(config: _mergeconfig.MergeConfig, trees: dict[str, Any], pattern, seed: int,
                    report: AverageReport) -> Any:
    """``slices``: output layers stacked slice after slice, each output layer merged from
    one layer of each source (renumbered from 0 up); tensors outside every layer from the
    first slice's sources, or the last's for the final norm and head (mergekit's "post"
    weights: key paths naming ``norm``, ``head`` or ``ln_f`` outside the layers)."""
    method = spec = merge_methods.REGISTRY[config.method]
    _unused_parameters(config, report)
    first_slice = config.slices[0]
    template = trees[first_slice.sources[0].model]
    flats = {name: _tree.by_text(tree) for name, tree in trees.items()}
    outside = [kp for kp, _ in _tree.flatten(template) if _layer_of(format_keypath(kp), pattern) is None]
    layer_keys: dict[str, dict[int, list[tuple[tuple, int]]]] = {}  # per model: layer -> (key path, number's offset)

    def layers_of(name: str) -> dict[int, list[tuple[tuple, int]]]:
        if name not in layer_keys:
            found: dict[int, list[tuple[tuple, int]]] = {}
            for kp, _ in _tree.flatten(trees[name]):
                layer = _layer_of(format_keypath(kp), pattern)
                if layer is not None:
                    found.setdefault(layer[0], []).append((kp, layer[1]))
            if not found:
                raise UsageError(f"{name}: no key path holds a layer number (such as model.layers.N.); name the "
                                 "pattern with layer_pattern")
            layer_keys[name] = found
        return layer_keys[name]

    items: list[tuple[tuple, Any]] = []

    def merged_leaf(out_slice: _mergeconfig.OutputSlice, texts: list[str], out_text: str, t: float,
                    where: str) -> Any:
        base = out_slice.base_model or config.base_model
        names = [s.model for s in out_slice.sources]
        if spec.takes_no_base:
            base = None
        elif base is not None:
            if base not in names:
                raise UsageError(f"{where}: the base model {base!r} is not among the slice's sources")
            names = [n for n in names if n != base]
        run.check_inputs(method, base is not None, len(names), f" ({where})")
        order = ([base] if base else []) + names
        text_of = {s.model: text for s, text in zip(out_slice.sources, texts)}
        values = []
        for name in order:
            value = flats[name].get(text_of[name])
            if value is None:
                raise UsageError(f"{name}: no leaf {text_of[name]} (for {out_text}, {where})")
            values.append(value)
        if not (_leaf.is_array(values[0]) and _dtypes_float(values[0])):
            return values[-1]
        leaves = [_leaf.as_leaf(v) for v in values]
        for name, leaf in zip(order[1:], leaves[1:]):
            if not _tree.same_layout(leaves[0], leaf):
                raise UsageError(f"{name}: {text_of[name]} is {leaf.dtype_name}{list(leaf.shape)}, "
                                 f"{order[0]}'s {leaves[0].dtype_name}{list(leaves[0].shape)} ({where})")
        settings = _settings(config, out_slice, names, method, out_text, t)
        return run.leaf_merge(method, LeafMerge(leaves, base is not None, settings, seed, out_text, order, report))

    post = ("norm", "head", "ln_f")
    after = [kp for kp in outside if any(word in format_keypath(kp) for word in post)]
    for kp in [kp for kp in outside if kp not in after]:
        text = format_keypath(kp)
        items.append((kp, merged_leaf(first_slice, [text] * len(first_slice.sources), text, 0.0,
                                      "outside the layers")))
    number = 0
    for index, out_slice in enumerate(config.slices):
        start, stop = out_slice.sources[0].layers
        for offset in range(stop - start):
            t = offset / (stop - start - 1) if stop - start > 1 else 1.0
            by_layer = layers_of(out_slice.sources[0].model)
            if start + offset not in by_layer:
                raise UsageError(f"{out_slice.sources[0].model}: no layer {start + offset} (slices[{index}]); "
                                 f"it has layers {min(by_layer)} to {max(by_layer)}")
            for kp, at in by_layer[start + offset]:
                out_kp = _renumbered(kp, at, number)
                texts = [format_keypath(_renumbered(kp, at, s.layers[0] + offset)) for s in out_slice.sources]
                items.append((out_kp, merged_leaf(out_slice, texts, format_keypath(out_kp), t,
                                                  f"slices[{index}], layer {start + offset}")))
            number += 1
    last = config.slices[-1]
    for kp in after:
        text = format_keypath(kp)
        items.append((kp, merged_leaf(last, [text] * len(last.sources), text, 0.0, "outside the layers")))
    return _tree.unflatten(items, template=template)


def _dtypes_float(value: Any) -> bool:
    from treecli import _dtypes

    return _dtypes.is_float(_leaf.as_leaf(value).dtype_name)
