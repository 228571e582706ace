"""A mergekit merge config (``merge.yml``), read and resolved as mergekit 0.1.5 does.

The file is parsed with ``yaml.safe_load`` (plain data, nothing constructed from
tags). Keys treecli cannot honour (``tokenizer``,
``chat_template``, ``residual_weight``) are warned about once each and ignored;
any other unknown key is an error naming the closest known one, and so is a
parameter name no method takes (mergekit silently ignores it).

A parameter's value for one tensor of one model is found as mergekit finds it:
the first of the model's own ``parameters`` (in ``models`` or a slice's
``sources``), the slice's, then the global ones that names it; a value is a
scalar, a gradient (a list of anchors interpolated over the layers: ``t`` is the
layer's position in its slice, ``i / (n − 1)``; 0 outside every layer), or a list
of ``{filter, value}`` whose first entry whose ``filter`` is a substring of the
tensor's name (or ``*``, or absent) applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treecli._errors import UsageError
from treecli._keypath import closest

TOP_KEYS = ("merge_method", "base_model", "models", "slices", "parameters", "dtype", "out_dtype", "layer_pattern",
            "tokenizer_source", "tokenizer", "chat_template", "modules", "name")
IGNORED = {"tokenizer": "treecli takes a model's tokenizer whole (tokenizer_source), never builds one",
           "chat_template": "the chat template is not a tensor; copy it beside the output yourself",
           "residual_weight": "mergekit defines it and never uses it",
           "name": "a name for the config"}
MODEL_KEYS = ("model", "parameters")
MAX_CONFIG_BYTES = 1 << 20  # mergekit's configs are a few hundred bytes
SLICE_KEYS = ("sources", "base_model", "residual_weight", "parameters")
SOURCE_KEYS = ("model", "layer_range", "parameters")


@dataclass
class Source:
    """One input of an output slice: a model and, in ``slices``, its layers ``[start, stop)``."""

    model: str
    layers: tuple[int, int] | None
    parameters: dict[str, Any]


@dataclass
class OutputSlice:
    sources: list[Source]
    base_model: str | None
    parameters: dict[str, Any]


@dataclass
class MergeConfig:
    """A parsed config: the method, the base, the output slices (``models`` is one slice of
    whole models), the parameters by scope, and the dtypes."""

    method: str
    base_model: str | None
    slices: list[OutputSlice]
    parameters: dict[str, Any]
    dtype: str | None = None
    out_dtype: str | None = None
    layer_pattern: str | None = None
    from_slices: bool = False  # ``slices`` (layers picked and stacked), not ``models``
    warnings: list[str] = field(default_factory=list)
    #: The model whose tokenizer (and other files) the output takes: ``tokenizer_source``'s
    #: model, ``base`` being the base model's; None: mergekit's default, the base (else the first).
    tokenizer_source: str | None = None

    def models(self) -> list[str]:
        """Every model the config names, the base first, each once."""
        names = [self.base_model] if self.base_model else []
        for s in self.slices:
            names += [s.base_model] if s.base_model else []
            names += [source.model for source in s.sources]
        return list(dict.fromkeys(names))


def parse(text: str, where: str, kind: str = "merge config") -> Any:
    """A config file's text (read by the caller: a regular file, at most
    ``MAX_CONFIG_BYTES``) as YAML plain data; ``kind`` says what config it is (a recipe's
    file is read here too).

    Raises:
        UsageError: not YAML, or nested deeper than any config.
    """
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise UsageError(f"{where}: not a YAML config{at}: {getattr(e, 'problem', None) or e}") from None
    except RecursionError:
        raise UsageError(f"{where}: nested deeper than any {kind}") from None


def load(data: Any, known_parameters: list[str], methods: list[str], where: str = "the config") -> MergeConfig:
    """A parsed config (plain data, as ``parse`` gives it) checked and resolved."""
    return _Parser(where, known_parameters, methods).config(data)


def shown(value: Any) -> str:
    """A value from a config as a message quotes it: bounded in depth and length, however
    it was built (a YAML alias bomb shares one list a billion times over)."""
    import reprlib

    from treecli._escape import clipped

    bounded = reprlib.Repr()
    bounded.maxlevel, bounded.maxstring, bounded.maxother = 3, 60, 60
    bounded.maxlist = bounded.maxtuple = bounded.maxdict = bounded.maxset = 4
    return clipped(bounded.repr(value), 80)


class _Parser:
    def __init__(self, where: str, known_parameters: list[str], methods: list[str]):
        self.where, self.known, self.methods = where, known_parameters, methods
        self.warnings: list[str] = []

    def fail(self, path: str, what: str) -> UsageError:
        return UsageError(f"{self.where}: {path}: {what}")

    def keys(self, data: Any, path: str, allowed: tuple[str, ...]) -> dict:
        if not isinstance(data, dict):
            raise self.fail(path, f"expected a mapping, found {type(data).__name__}")
        for key in data:
            if not isinstance(key, str):
                raise self.fail(path, f"key {shown(key)} is not a string")
            at = f"{path}.{key}" if path else key
            if key in IGNORED and key in allowed:
                self.warnings.append(f"{self.where}: {at} is ignored: {IGNORED[key]}")
            elif key not in allowed:
                near = closest(key, allowed, limit=1)
                raise self.fail(at, "unknown key" + (f"; did you mean {near[0]!r}?" if near else ""))
        return data

    def config(self, data: Any) -> MergeConfig:
        if data is None:
            raise UsageError(f"{self.where}: the config is empty")
        data = self.keys(data, "", TOP_KEYS)
        method = data.get("merge_method")
        if not isinstance(method, str):
            raise self.fail("merge_method", "missing: name the method (" + ", ".join(self.methods) + ")")
        if method not in self.methods:
            near = closest(method, self.methods, limit=1)
            raise self.fail("merge_method", f"unknown method {shown(method)}" + (f"; did you mean {near[0]!r}?" if near
                                                                              else f"; one of {', '.join(self.methods)}"))
        if "modules" in data:
            raise self.fail("modules", "several modules (a vision tower beside the language model) are not "
                                       "supported; use models or slices")
        given = [k for k in ("models", "slices") if k in data]
        if len(given) != 1:
            raise self.fail("models", "give exactly one of models and slices" if given else
                            "missing: list the models to merge (models) or the layers to stack (slices)")
        base = self.model_name(data.get("base_model"), "base_model") if data.get("base_model") is not None else None
        if "models" in data:
            sources = [self.model(m, f"models[{i}]") for i, m in enumerate(self.listed(data["models"], "models"))]
            slices = [OutputSlice(sources, None, {})]
        else:
            slices = [self.slice(s, f"slices[{i}]") for i, s in enumerate(self.listed(data["slices"], "slices"))]
        parameters = self.parameters(data.get("parameters"), "parameters")
        dtypes = {k: data.get(k) for k in ("dtype", "out_dtype")}
        for key, value in dtypes.items():
            if value is not None and not isinstance(value, str):
                raise self.fail(key, f"expected a dtype name such as bfloat16, found {shown(value)}")
        pattern = data.get("layer_pattern")
        if pattern is not None and not isinstance(pattern, str):
            raise self.fail("layer_pattern", "expected a regular expression")
        config = MergeConfig(method, base, slices, parameters, dtypes["dtype"], dtypes["out_dtype"], pattern,
                             from_slices="slices" in data, warnings=list(dict.fromkeys(self.warnings)))
        config.tokenizer_source = self.tokenizer_source(data.get("tokenizer_source"), config)
        return config

    def tokenizer_source(self, value: Any, config: MergeConfig) -> str | None:
        """The model ``tokenizer_source`` names: ``base`` or one of the config's models. A
        ``union`` of vocabularies needs the embeddings realigned row by row, which treecli
        does not do: refused."""
        if value is None:
            return None
        if value == "union":
            raise self.fail("tokenizer_source", "union builds a tokenizer of every model's tokens and realigns the "
                                                "embeddings; treecli does not: name base or one of the models")
        if value == "base":
            if config.base_model is None:
                raise self.fail("tokenizer_source", "base names the base model, and the config has no base_model")
            return config.base_model
        if not isinstance(value, str) or value not in config.models():
            raise self.fail("tokenizer_source", f"{shown(value)}: name base or one of the config's models "
                                                f"({', '.join(config.models())})")
        return value

    def listed(self, value: Any, path: str) -> list:
        if not isinstance(value, list) or not value:
            raise self.fail(path, "expected a non-empty list")
        return value

    def model_name(self, value: Any, path: str) -> str:
        if isinstance(value, dict) and set(value) <= {"model", "lora"}:  # mergekit's long form
            if value.get("lora"):
                raise self.fail(path, "a LoRA applied to a model is not supported; merge the adapter first")
            value = value.get("model")
            if isinstance(value, dict):
                value = value.get("path")
        if not isinstance(value, str) or not value:
            raise self.fail(path, f"expected a model's path or URL, found {shown(value)}")
        if "+" in value and not Path(value).exists():
            raise self.fail(path, f"{shown(value)}: a model+LoRA reference is not supported; merge the adapter first")
        return value

    def model(self, data: Any, path: str) -> Source:
        data = self.keys(data if isinstance(data, dict) else {"model": data}, path, MODEL_KEYS)
        return Source(self.model_name(data.get("model"), f"{path}.model"), None,
                      self.parameters(data.get("parameters"), f"{path}.parameters"))

    def slice(self, data: Any, path: str) -> OutputSlice:
        data = self.keys(data, path, SLICE_KEYS)
        sources = []
        for i, source in enumerate(self.listed(data.get("sources"), f"{path}.sources")):
            where = f"{path}.sources[{i}]"
            source = self.keys(source, where, SOURCE_KEYS)
            span = source.get("layer_range")
            if (not isinstance(span, list) or len(span) != 2 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                                        for x in span) or not 0 <= span[0] <= span[1]):
                raise self.fail(f"{where}.layer_range", f"expected [start, stop] layer numbers, found {shown(span)}")
            sources.append(Source(self.model_name(source.get("model"), f"{where}.model"), (span[0], span[1]),
                                  self.parameters(source.get("parameters"), f"{where}.parameters")))
        lengths = {s.layers[1] - s.layers[0] for s in sources}
        if len(lengths) > 1:
            raise self.fail(f"{path}.sources", f"every source of a slice must have as many layers; found "
                                               f"{sorted(lengths)}")
        base = data.get("base_model")
        return OutputSlice(sources, self.model_name(base, f"{path}.base_model") if base is not None else None,
                           self.parameters(data.get("parameters"), f"{path}.parameters"))

    def parameters(self, data: Any, path: str) -> dict[str, Any]:
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise self.fail(path, f"expected a mapping of parameters, found {type(data).__name__}")
        for name, value in data.items():
            if name not in self.known:
                near = closest(str(name), self.known, limit=1)
                raise self.fail(f"{path}.{name}", "no merge method takes this parameter"
                                + (f"; did you mean {near[0]!r}?" if near else ""))
            self.setting(value, f"{path}.{name}")
        return dict(data)

    def setting(self, value: Any, path: str, depth: int = 0) -> None:
        """A scalar, a gradient, or ``{filter, value}`` entries (checked here, resolved later).
        YAML aliases can nest one list many times over: past a few levels it is refused."""
        if _scalar(value):
            return
        if depth > 4:
            raise self.fail(path, "filter entries nested this deep are not a parameter's value")
        if isinstance(value, dict):
            value = [value]
        if not isinstance(value, list) or not value:
            raise self.fail(path, f"expected a number, a list of numbers (a gradient) or filter entries, "
                                  f"found {shown(value)}")
        if all(_scalar(v) for v in value):
            return
        for i, entry in enumerate(value):
            if not isinstance(entry, dict) or "value" not in entry or not set(entry) <= {"filter", "value"}:
                raise self.fail(f"{path}[{i}]", f"expected {{filter: NAME, value: V}}, found {shown(entry)}")
            if entry.get("filter") is not None and not isinstance(entry["filter"], str):
                raise self.fail(f"{path}[{i}].filter", f"expected a substring of tensor names, found "
                                                       f"{shown(entry['filter'])}")
            self.setting(entry["value"], f"{path}[{i}].value", depth + 1)


def _scalar(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str))


def evaluate(setting: Any, tensor_name: str, t: float, kind: type) -> Any:
    """The value of one parameter's setting for a tensor at gradient position ``t`` (mergekit's
    ``evaluate_setting``): ``None`` when no filter entry applies."""
    if isinstance(setting, dict):
        setting = [setting]
    if _scalar(setting):
        return convert(setting, kind)
    if all(_scalar(v) for v in setting):
        values = [convert(v, kind) for v in setting]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return values[int(t * (len(values) - 1))]
        scaled = t * (len(values) - 1)
        low = int(scaled)
        high = min(len(values) - 1, low + 1)
        fraction = scaled - low
        return convert((1 - fraction) * values[low] + fraction * values[high], kind)
    for entry in setting:
        pattern = entry.get("filter")
        if pattern is None or pattern == "*" or (tensor_name and pattern in tensor_name):
            return evaluate(entry["value"], tensor_name, t, kind)
    return None


def convert(value: Any, kind: type) -> Any:
    """A setting's value as the parameter's kind (YAML may give ``1e-3`` as a string)."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, (int, float)) and value in (0, 1):
            return bool(value)
        raise UsageError(f"{shown(value)} is not true or false")
    if isinstance(value, bool):
        return int(value) if kind is int else float(value)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise UsageError(f"{shown(value)} is not a number") from None
    if not isinstance(value, (int, float)):
        raise UsageError(f"{shown(value)} is not a number")
    try:
        number = float(value)
    except OverflowError:  # an integer of hundreds of digits
        number = math.inf
    if kind is int:
        if not number.is_integer():
            raise UsageError(f"{shown(value)} is not a whole number")
        return int(value)
    if not math.isfinite(number):
        raise UsageError(f"{shown(value)} is not a finite number")
    return number
