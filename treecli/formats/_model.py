"""What model a checkpoint's weights belong to, where the checkpoint says: an HF
``config.json`` beside them, or a GGUF file's metadata. ``show`` puts it in its header
line (``llama · 4 layers · vocab 128``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The names configs give the number of transformer blocks (GPT-2's n_layer, T5's num_layers, ...).
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_MODEL_DTYPES = ("float16", "bfloat16", "float32", "float64")  # what a config's dtype may name
# a quantization_config's quant_method -> what the name of a tensor it stores ends with (_blockscaled)
_BLOCK_SCALED = {"fp8": "_scale_inv", "mxfp4": "_blocks"}


@dataclass(frozen=True)
class Model:
    """An architecture (HF ``model_type``, GGUF ``general.architecture``), and its number of
    layers and vocabulary size where the checkpoint gives them."""

    architecture: str
    layers: int | None = None
    vocab: int | None = None

    def facts(self) -> list[str]:
        return [self.architecture] + ([f"{self.layers} layer{'s' if self.layers != 1 else ''}"]
                                      if self.layers is not None else []) + (
            [f"vocab {self.vocab:,}"] if self.vocab is not None else [])

    def as_json(self) -> dict[str, Any]:
        return {"architecture": self.architecture, "layers": self.layers, "vocab": self.vocab}


def _count(value: Any) -> int | None:
    """A count a config may give (a layer count, a vocabulary size): a plain int, not a
    bool, not absurd."""
    return value if type(value) is int and 0 <= value < 1 << 40 else None


def _json(text: str) -> Any:
    """A config's JSON, or None where it is not JSON (or nests deeper than Python's parser
    goes: a hostile file is no config, never a traceback)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def from_config(text: str) -> Model | None:
    """The model an HF ``config.json`` describes (a multimodal one's text model gives the
    layers and vocabulary where the top level does not), or None: not JSON, no
    ``model_type``."""
    config = _json(text)
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        return None
    inner = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def first(keys: tuple[str, ...]) -> int | None:
        for scope in (config, inner):
            for key in keys:
                if _count(scope.get(key)) is not None:
                    return scope[key]
        return None

    return Model(config["model_type"][:80], first(_LAYER_KEYS), first(("vocab_size",)))


def from_gguf(metadata: dict[str, Any]) -> Model | None:
    """The model a GGUF file's metadata describes: ``general.architecture``, its
    ``{arch}.block_count``, and its ``{arch}.vocab_size`` or else the tokenizer's tokens."""
    arch = getattr(metadata.get("general.architecture"), "value", None)
    if not isinstance(arch, str) or not arch:
        return None
    layers = _count(getattr(metadata.get(f"{arch}.block_count"), "value", None))
    vocab = _count(getattr(metadata.get(f"{arch}.vocab_size"), "value", None))
    tokens = getattr(metadata.get("tokenizer.ggml.tokens"), "value", None)
    if vocab is None and isinstance(tokens, tuple) and len(tokens) == 2 and isinstance(tokens[1], (list, tuple)):
        vocab = len(tokens[1])
    return Model(arch[:80], layers, vocab)


def of_folder(folder: Any) -> Model | None:
    """The model the ``config.json`` of an HF directory describes, in any place (over HTTP,
    one small request), or None: no such file, or one that names no model."""
    from treecli._errors import TreecliError

    try:
        text = folder.text("config.json")
    except (OSError, TreecliError):  # (unreadable or too long: no model to name, nothing worse)
        return None
    return from_config(text) if text is not None else None


def truthful_config(text: str, tree: Any, layer_pattern: Any) -> tuple[str | None, str | None]:
    """An HF ``config.json`` made to describe the weights of ``tree`` it goes beside: its
    layer count (``num_hidden_layers`` and the like) after slices, frankenmerges and layer
    deletions, its ``dtype``/``torch_dtype`` after casts, its ``vocab_size`` after embedding
    edits, no FP8 or MXFP4 ``quantization_config`` where those weights are written as plain
    values. Returns ``(text, why)``: the text to write (the same text where nothing changed),
    or None and why no text can describe the weights. A file that is no model config is
    left as it is."""
    from treecli import _leaf, _tree
    from treecli._keypath import EMBEDDINGS, format_keypath

    config = _json(text)
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        return text, None
    inner = config.get("text_config") if isinstance(config.get("text_config"), dict) else None
    stacks: dict[str, set[int]] = {}  # the layers' numbers, by what precedes them ("model.layers.")
    names = []
    float_bytes: dict[str, int] = {}
    vocab = None
    for keypath, leaf in _tree.flatten(tree):
        name = format_keypath(keypath)
        names.append(name)
        found = layer_pattern.search(name)
        if found:
            stacks.setdefault(name[: found.start(1)], set()).add(int(found.group(1)))
        if _leaf.is_array(leaf):
            array = _leaf.as_leaf(leaf)
            if array.dtype_name in _MODEL_DTYPES:  # (not FP8 or FP4: a quantized weight's storage, never a model's dtype)
                float_bytes[array.dtype_name] = float_bytes.get(array.dtype_name, 0) + array.nbytes
            if vocab is None and name.endswith(EMBEDDINGS) and len(array.shape) == 2:
                vocab = array.shape[0]
    changed = False

    def put(keys: tuple[str, ...], value: Any, scopes: tuple[dict, ...] = (config, inner or {})) -> None:
        nonlocal changed
        for scope in scopes:
            for key in keys:
                if key in scope and scope[key] != value:
                    scope[key], changed = value, True

    # The count is kept true for one stack of layers. A model of several (an encoder and a
    # decoder, a vision tower beside the text model) numbers each from 0, and which count is
    # which cannot be told from the names; layers named in a way the pattern does not know
    # (T5's block.N) cannot be counted: there, the counts stay as they were.
    several = len(stacks) > 1 or any(key.endswith("_config") and isinstance(value, dict)
                                     for key, value in config.items())
    has_layers = any(_count(config.get(key)) is not None for key in _LAYER_KEYS)
    for prefix, layers in stacks.items():  # (a stack with a gap: no count of it can be true)
        if has_layers and layers != set(range(len(layers))):
            gaps = sorted(set(range(max(layers) + 1)) - layers)
            return None, (f"the layers written are not numbered 0 to {len(layers) - 1} (no {prefix}{gaps[0]}), "
                          "so no count in config.json describes them (renumber them with edit --rename)")
    if has_layers and len(stacks) == 1 and not several:
        put(_LAYER_KEYS, len(next(iter(stacks.values()))), (config,))
    if float_bytes:
        put(("torch_dtype", "dtype"), max(float_bytes, key=float_bytes.get))
    if vocab is not None:
        put(("vocab_size",), vocab)
    quantization = config.get("quantization_config")
    stored = _BLOCK_SCALED.get(quantization.get("quant_method")) if isinstance(quantization, dict) else None
    if stored is not None and not any(name.endswith(stored) for name in names):
        del config["quantization_config"]  # (the weights are plain values now)
        changed = True
    return (json.dumps(config, indent=2, ensure_ascii=False) + "\n" if changed else text), None
