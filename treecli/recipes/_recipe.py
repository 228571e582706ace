"""What every recipe is and makes, and what recipes share: a model's config read from
beside its weights, its leaves by name."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from treecli._errors import UsageError


@dataclass
class Conversion:
    """A recipe's output: the ``tree`` to write, the ``metadata`` it carries (None: the
    input's, as any command keeps it; or a function of the tree finally written, which a
    cast or a quantization after the recipe may change), and the ``files`` an output
    directory gets beside the weights (name -> bytes)."""

    tree: Any
    metadata: dict[str, Any] | Callable[[Any], dict[str, Any]] | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    #: What the recipe had to leave out or guess (said as warnings).
    warnings: list[str] = field(default_factory=list)
    #: The format its output is written in where the output's name does not say
    #: (``safetensors``: an HF directory); None: as for any command.
    format: str | None = None

    def metadata_of(self, tree: Any) -> dict[str, Any] | None:
        return self.metadata(tree) if callable(self.metadata) else self.metadata


class Recipe(Protocol):
    name: str
    summary: str

    def forward(self, checkpoint: Any) -> Conversion:
        """The checkpoint made into the recipe's output."""

    def reverse(self, checkpoint: Any) -> Conversion:
        """The recipe's output made back into its input."""


def hf_config(checkpoint: Any, recipe: str) -> dict[str, Any]:
    """The ``config.json`` beside an HF checkpoint's weights, wherever they lie.

    Raises:
        UsageError: no HF directory, or no config.json (or one that is no JSON object).
    """
    text = companion_text(checkpoint, "config.json")
    if text is None:
        raise UsageError(f"the {recipe} recipe reads the model's hyper-parameters from the config.json beside its "
                         "weights, and there is none: give the model's directory", file=checkpoint.file)
    try:
        config = json.loads(text)
    except (ValueError, RecursionError):
        config = None
    if not isinstance(config, dict):
        raise UsageError("config.json is no JSON object", file=checkpoint.file)
    return config


def hyper_parameters(checkpoint: Any) -> dict[str, Any]:
    """The config.json beside a checkpoint's weights as a dict (sizes and head counts may name
    its entries), or nothing where there is none."""
    text = companion_text(checkpoint, "config.json")
    try:
        config = json.loads(text) if text is not None else {}
    except (ValueError, RecursionError):
        config = {}
    return config if isinstance(config, dict) else {}


def companion_text(checkpoint: Any, name: str) -> str | None:
    """A small file beside the weights of an HF directory (local, in a bucket, over HTTP), or None."""
    return checkpoint.folder.text(name) if checkpoint.folder is not None else None


def companion_bytes(checkpoint: Any, name: str) -> bytes | None:
    """A binary file beside the weights (``tokenizer.model``), or None: read whole, as it is small."""
    from treecli._errors import TreecliError

    folder = checkpoint.folder
    if folder is None or (folder.listable and name not in folder.files()):
        return None
    if folder.listable:  # (a FIFO or a device by that name is refused, never taken for none)
        reader = folder.reader(name)
    else:
        try:
            reader = folder.reader(name)
        except (OSError, TreecliError):  # (an HTTP directory is asked: no answer is no file)
            return None
    try:
        if reader.size is not None and reader.size > 64 << 20:
            raise UsageError(f"{name} is {reader.size:,} bytes: no tokenizer is that large", file=folder.named(name))
        return bytes(reader.read(0, reader.size)) if reader.size else b""
    finally:
        reader.close()


def architecture(config: dict[str, Any], known: dict[str, Any], recipe: str, file: str) -> str:
    """The ``architectures`` entry of an HF config the recipe knows.

    Raises:
        UsageError: none it knows, named with those it does.
    """
    named = config.get("architectures")
    found = next((a for a in named if a in known), None) if isinstance(named, list) else None
    if found is None:
        from treecli._escape import quote

        what = quote(", ".join(map(str, named))[:200]) if isinstance(named, list) and named else "no architecture"
        raise UsageError(f"the {recipe} recipe knows {', '.join(known)}; config.json names {what}", file=file)
    return found
