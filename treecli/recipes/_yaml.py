"""A recipe of one's own: a YAML file of reversible operations, and the metadata its
output carries (docs/recipes.md)::

    summary: HF Llama MLPs to llama.cpp's names
    steps:
      - rename: {from: 'model.layers.(\\d+).mlp.up_proj.weight', to: 'blk.\\1.ffn_up.weight'}
      - stack: {from: 'model.layers.{i}.(.+)', to: 'layers.\\1', axis: 0}
      - transpose: {keys: '.*_proj\\.weight', axes: [1, 0]}
      - rotary: {keys: '.*q_proj\\.weight', heads: num_attention_heads}
    params: {num_attention_heads: 32}     # beside (and over) config.json's
    metadata: {general.architecture: llama}

Read with ``yaml.safe_load``: nothing in it is run. Every step is checked when the file
is read (its keys, its patterns' reversibility); the reverse is the steps inverted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from treecli import _transforms
from treecli._errors import UsageError
from treecli.recipes._recipe import Conversion, hyper_parameters

_MAX_BYTES = 1 << 20  # a recipe is a page of YAML

# step name -> (the operation, its fields: name in the file -> (parameter, required))
_STEPS: dict[str, tuple[Any, dict[str, tuple[str, bool]]]] = {
    "rename": (_transforms.Rename, {"from": ("pattern", True), "to": ("template", True)}),
    "stack": (_transforms.Stack, {"from": ("pattern", True), "to": ("template", True), "axis": ("axis", False)}),
    "unstack": (_transforms.Unstack, {"from": ("pattern", True), "to": ("template", True), "axis": ("axis", False)}),
    "concat": (_transforms.Concat, {"from": ("patterns", True), "to": ("template", True), "axis": ("axis", False),
                                    "sizes": ("sizes", False)}),
    "split": (_transforms.Split, {"from": ("pattern", True), "to": ("templates", True), "axis": ("axis", False),
                                  "sizes": ("sizes", False)}),
    "transpose": (_transforms.Transpose, {"keys": ("keys", True), "axes": ("axes", True)}),
    "rotary": (_transforms.Rotary, {"keys": ("keys", True), "heads": ("heads", True)}),
    "unflatten": (_transforms.Unflatten, {"keys": ("keys", True), "axis": ("axis", True), "sizes": ("sizes", True)}),
    "flatten": (_transforms.Flatten, {"keys": ("keys", True), "axis": ("axis", True), "sizes": ("sizes", True)}),
}
_SEQUENCES = {"patterns", "templates", "sizes", "axes"}


class YamlRecipe:
    """The operations and metadata of a recipe file."""

    def __init__(self, name: str, summary: str, steps: list[Any], params: dict[str, Any], metadata: dict[str, Any]):
        self.name, self.summary, self.steps, self.params, self.metadata = name, summary, steps, params, metadata

    def forward(self, checkpoint: Any) -> Conversion:
        items = _transforms.applied(self.steps, _transforms.items_of(checkpoint.tree), self._params(checkpoint))
        return Conversion(_transforms.tree_of(items), {**checkpoint.metadata, **self.metadata} or None)

    def reverse(self, checkpoint: Any) -> Conversion:
        steps = _transforms.inverted(self.steps)
        items = _transforms.applied(steps, _transforms.items_of(checkpoint.tree), self._params(checkpoint))
        kept = {k: v for k, v in checkpoint.metadata.items() if k not in self.metadata}
        return Conversion(_transforms.tree_of(items), kept)

    def _params(self, checkpoint: Any) -> dict[str, Any]:
        """The hyper-parameters sizes may name: the config.json beside the weights, under the file's ``params``."""
        return {**hyper_parameters(checkpoint), **self.params}


def load(path: Path) -> YamlRecipe:
    """The recipe in a YAML file.

    Raises:
        UsageError: no such file, no YAML mapping, an unknown step or field, a pattern that cannot be reversed.
    """
    from treecli._bytes.local import read_text
    from treecli._mergeconfig import parse

    try:  # (a regular file only, never more than _MAX_BYTES read: a FIFO would hang, /dev/zero never end)
        text = read_text(path, _MAX_BYTES, "recipe")
    except OSError as e:
        raise UsageError(f"cannot read the recipe: {e.strerror or e}", file=str(path)) from None
    _refuse_keys_twice(text, str(path))
    data = parse(text, str(path), "recipe")
    if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
        raise UsageError("a recipe is a YAML mapping with a list of steps", file=str(path))
    unknown = sorted(set(map(str, data)) - {"name", "summary", "steps", "params", "metadata"})
    if unknown:
        raise UsageError(f"unknown key {unknown[0]!r} (a recipe has summary, steps, params, metadata)", file=str(path))
    params, metadata = data.get("params") or {}, data.get("metadata") or {}
    if not isinstance(params, dict) or not isinstance(metadata, dict):
        raise UsageError("params and metadata are mappings", file=str(path))
    if not all(_scalar(value) for value in metadata.values()):  # (never a list: an alias bomb's is endless)
        raise UsageError("metadata values are text or numbers", file=str(path))
    steps = [_step(step, n, str(path)) for n, step in enumerate(data["steps"], 1)]
    return YamlRecipe(str(data.get("name") or path.stem), str(data.get("summary") or ""), steps,
                      {str(k): v for k, v in params.items()}, {str(k): _text(v) for k, v in metadata.items()})


def _step(entry: Any, number: int, file: str) -> Any:
    if not isinstance(entry, dict) or len(entry) != 1 or not isinstance(next(iter(entry.values())), dict):
        raise UsageError(f"step {number}: one operation and its fields ({{rename: {{from: ..., to: ...}}}})", file=file)
    verb, fields = next(iter(entry.items()))
    if verb not in _STEPS:
        raise UsageError(f"step {number}: no operation {str(verb)[:40]!r}; there are {', '.join(_STEPS)}", file=file)
    operation, known = _STEPS[verb]
    extra = sorted(set(map(str, fields)) - set(known))
    if extra:
        raise UsageError(f"step {number} ({verb}): unknown field {extra[0]!r}; it takes {', '.join(known)}", file=file)
    arguments = {}
    for field, (parameter, required) in known.items():
        if field not in fields:
            if required:
                raise UsageError(f"step {number} ({verb}): give {field}", file=file)
            continue
        value = fields[field]
        if parameter in _SEQUENCES:
            if not isinstance(value, list) or not value:
                raise UsageError(f"step {number} ({verb}): {field} is a list", file=file)
            if not all(_scalar(item) for item in value):  # (a list in it may be an alias bomb's)
                raise UsageError(f"step {number} ({verb}): {field} holds a list or a mapping; it holds text or "
                                 "numbers", file=file)
            value = tuple(value)
        elif parameter == "axis" and type(value) is not int:
            raise UsageError(f"step {number} ({verb}): axis is a whole number", file=file)
        elif parameter not in ("heads", "axis") and not isinstance(value, str):
            raise UsageError(f"step {number} ({verb}): {field} is text", file=file)
        arguments[parameter] = value
    step = operation(**arguments)
    try:
        step.inverse()  # (a pattern that cannot be reversed is refused now, not halfway through a write)
    except UsageError as e:
        raise UsageError(f"step {number} ({verb}): {e.message}", file=file) from None
    return step


def _text(value: Any) -> Any:
    """A metadata value as a text, as most formats hold metadata."""
    return value if isinstance(value, str) else json.dumps(value)


def _scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float)) or value is None


def _refuse_keys_twice(text: str, file: str) -> None:
    """Refuse a mapping that names a key twice (YAML keeps the last, silently): which of the
    two was meant cannot be told. Each node is visited once, however often aliases share it."""
    import yaml

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, RecursionError):
        return  # (said by the parser, in its words)
    seen, pending = set(), [root] if root is not None else []
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys = [key.value for key, _ in node.value if isinstance(key, yaml.ScalarNode)]
            twice = next((key for key in keys if keys.count(key) > 1), None)
            if twice is not None:
                raise UsageError(f"{str(twice)[:40]!r} twice in one mapping, at line {node.start_mark.line + 1}",
                                 file=file)
            pending.extend(value for _, value in node.value)
        elif isinstance(node, yaml.SequenceNode):
            pending.extend(node.value)
