"""What model a checkpoint's weights belong to, where the checkpoint says: an HF
``config.json`` beside them, or a GGUF file's metadata. ``show`` puts it in its header
line (``llama · 4 layers · vocab 128``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The names configs give the number of transformer blocks (GPT-2's n_layer, T5's num_layers, ...).
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


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
    return value if type(value) is int and value >= 0 else None


def from_config(text: str) -> Model | None:
    """The model an HF ``config.json`` describes (a multimodal one's text model gives the
    layers and vocabulary where the top level does not), or None: not JSON, no
    ``model_type``."""
    try:
        config = json.loads(text)
    except ValueError:
        return None
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
