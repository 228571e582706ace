"""``llama.cpp``: a Hugging Face Llama, Mistral or Qwen2 checkpoint as a GGUF file
llama.cpp runs, and back.

Forward, as llama.cpp's ``convert_hf_to_gguf.py`` writes these models: each tensor
renamed by the ``gguf`` package's own mapping (``gguf.get_tensor_name_map``), Q and K
rows permuted for llama.cpp's rotary embedding where the architecture needs it
(``llama``; Qwen2's rotary embedding takes HF's order), 1-D tensors as F32, the
hyper-parameters from ``config.json`` under the keys and types the ``gguf`` package's
writer gives them, and the tokenizer (``_vocab``). A model that ties its embeddings
writes no ``output.weight`` (llama.cpp then uses ``token_embd.weight``).

Back: the names mapped the other way (the first transformers name the mapping lists
under ``model.``, and ``lm_head``), the permutation undone, 1-D tensors in the model's
float type again, a ``config.json`` from the metadata and the tokenizer files.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
from pathlib import Path
from typing import Any, Iterator

from treecli import _leaf
from treecli._errors import UsageError
from treecli._mergeconfig import shown as _shown  # (a value from a file, bounded however it was built)
from treecli._transforms import Rename, Rotary, applied, inverted, items_of, tree_of
from treecli.recipes import _rope, _vocab
from treecli.recipes._recipe import Conversion, architecture, companion_bytes, companion_text, hf_config

# transformers' architecture -> llama.cpp's (Mistral is llama there)
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
# llama.cpp's architecture -> the transformers model it goes back to
BACK = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}
# Architectures whose Q and K rows llama.cpp wants permuted (its "normal" rotary embedding)
PERMUTED = ("llama",)
_SKIPPED = re.compile(r".*\.rotary_emb\.inv_freq")  # (computed by every consumer, never stored in GGUF)
_LAYER = re.compile(r"(.*?)\.(0|[1-9][0-9]*)\.(.*)")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "config.json",
                    "special_tokens_map.json")
# general.file_type by the dtype of most of the weights' bytes (llama.cpp's LlamaFileType); weights
# quantized as they are written get the mix's from the GGUF writer, which knows it
_FILE_TYPES = {"float32": "ALL_F32", "float16": "MOSTLY_F16", "bfloat16": "MOSTLY_BF16"}


class LlamaCpp:
    name = "llama.cpp"
    summary = ("Hugging Face Llama, Mistral and Qwen2 to a GGUF file llama.cpp runs (names, Q/K order, "
               "hyper-parameters, tokenizer); --reverse: such a GGUF to an HF directory")

    def forward(self, checkpoint: Any) -> Conversion:
        config = hf_config(checkpoint, self.name)
        arch = ARCHITECTURES[architecture(config, ARCHITECTURES, self.name, checkpoint.file)]
        _check_hyper_parameters(config, checkpoint.file)
        params = _params(config)
        items = [(name, leaf) for name, leaf in items_of(checkpoint.tree) if not _SKIPPED.fullmatch(name)]
        if config.get("tie_word_embeddings") and any(name == "model.embed_tokens.weight" for name, _ in items):
            items = [(name, leaf) for name, leaf in items if name != "lm_head.weight"]
        layers = _layer_count(items, config, checkpoint.file)
        items = applied(operations([name for name, _ in items], arch, layers), items, params)
        items = [(name, _float32(leaf) if _is_vector(leaf) else leaf) for name, leaf in items]
        rows = dict(items).get("token_embd.weight")
        if rows is None:
            raise UsageError("no embeddings (model.embed_tokens.weight) to write as token_embd.weight",
                             file=checkpoint.file)
        metadata, warnings, extra = _metadata(checkpoint, config, arch, layers, _leaf.as_leaf(rows).shape[0])
        items += [(name, _leaf.InMemoryLeaf(array)) for name, array in extra.items()]

        def with_file_type(tree: Any) -> dict[str, Any]:
            return {**metadata, "general.file_type": _meta(4, _file_type(tree))}

        return Conversion(tree_of(items), with_file_type, {}, warnings, format="gguf")

    def reverse(self, checkpoint: Any) -> Conversion:
        if checkpoint.format != "gguf":
            raise UsageError(f"the {self.name} recipe's reverse reads a GGUF file; this is {checkpoint.format}",
                             file=checkpoint.file)
        meta = {key: getattr(value, "value", value) for key, value in checkpoint.metadata.items()}
        arch = meta.get("general.architecture")
        if arch not in BACK:
            from treecli._escape import quote

            raise UsageError(f"the {self.name} recipe takes {', '.join(BACK)} GGUF files back; this one's "
                             f"general.architecture is {quote(str(arch))[:80]}", file=checkpoint.file)
        items = items_of(checkpoint.tree)
        factors = dict(items).get(_rope.ROPE_FREQS)
        items = [(name, leaf) for name, leaf in items if name != _rope.ROPE_FREQS]
        layers = meta.get(f"{arch}.block_count")
        found = {int(m.group(1)) for name, _ in items if (m := re.match(r"blk\.([0-9]+)\.", name))}
        if type(layers) is not int or layers != len(found) or found != set(range(layers)):
            raise UsageError(f"{arch}.block_count is {_shown(layers)} and the tensors' blocks are numbered "
                             f"{_span(found)}: no model has both", file=checkpoint.file)
        hf_names = _hf_names([name for name, _ in items], arch, layers, checkpoint.file)
        config = _config(meta, arch, dict(items), checkpoint.file)
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        scaling, warnings = _rope.to_hf(meta, arch, None if factors is None else _leaf.as_leaf(factors).read(),
                                        config.get("rope_theta", 10000.0), head_dim)
        if scaling:
            config["rope_scaling"] = scaling
        forward = operations(hf_names, arch, layers)
        items = applied(inverted(forward), items, _params(config))
        dtype = config["dtype"]
        items = [(name, _cast(leaf, dtype) if _is_vector(leaf) and dtype != "float32" else leaf)
                 for name, leaf in items]
        files, more = _vocab.to_hf(checkpoint.metadata)
        warnings += more
        files["config.json"] = (json.dumps(config, indent=2) + "\n").encode()
        return Conversion(tree_of(items), {}, files, warnings, format="safetensors")


RECIPE = LlamaCpp()


def operations(hf_names: list[str], arch: str, layers: int) -> list[Any]:
    """The operations that make these HF tensors llama.cpp's: the rotary permutation of Q
    and K where ``arch`` wants it, then one rename for each kind of tensor (its layer
    number a group), by the ``gguf`` package's mapping.

    Raises:
        UsageError: a tensor llama.cpp has no name for in this architecture.
    """
    import gguf

    names = gguf.get_tensor_name_map(_gguf_arch(arch), layers)
    steps: list[Any] = []
    if arch in PERMUTED:
        steps.append(Rotary(r"model\.layers\.\d+\.self_attn\.q_proj\.(weight|bias)", "num_attention_heads"))
        steps.append(Rotary(r"model\.layers\.\d+\.self_attn\.k_proj\.(weight|bias)", "num_key_value_heads"))
    renames: dict[str, str] = {}
    for name in hf_names:
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise UsageError(f"llama.cpp has no name for this tensor of a {arch} model", keypath=name)
        pattern, template = _generalized(name, new)
        if renames.setdefault(pattern, template) != template:
            raise UsageError(f"llama.cpp names the layers' {pattern} in two ways", keypath=name)
    steps.extend(Rename(pattern, template) for pattern, template in renames.items())
    return steps


def _generalized(name: str, new: str) -> tuple[str, str]:
    """A rename of one tensor made the rename of its kind in every layer: ``model.layers.3.x``
    -> ``blk.3.y`` becomes ``model.layers.(\\d+).x`` -> ``blk.\\1.y``."""
    old, found = _LAYER.fullmatch(name), _LAYER.fullmatch(new)
    if old and found and old.group(2) == found.group(2):
        return (f"{_literal(old.group(1))}.([0-9]+).{_literal(old.group(3))}",
                f"{found.group(1)}.\\1.{found.group(3)}")
    return _literal(name), new


def _literal(text: str) -> str:
    return re.sub(r"([^A-Za-z0-9_\-.])", r"\\\1", text)


def _gguf_arch(name: str) -> Any:
    from gguf import MODEL_ARCH_NAMES

    return next(arch for arch, known in MODEL_ARCH_NAMES.items() if known == name)


def _params(config: dict[str, Any]) -> dict[str, Any]:
    """The hyper-parameters the operations use, with HF's defaults filled in."""
    params = dict(config)
    params.setdefault("num_key_value_heads", config.get("num_attention_heads"))
    return params


# The hyper-parameters the recipe reads: counts (positive whole numbers), and the two it
# requires; other numbers (positive, finite).
_COUNTS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "max_position_embeddings",
           "vocab_size", "head_dim")
_REQUIRED = ("hidden_size", "num_attention_heads")
_NUMBERS = ("rms_norm_eps", "rope_theta")


def _check_hyper_parameters(config: dict[str, Any], file: str) -> None:
    """Refuse, in one line, a config.json whose hyper-parameters no model has: a count that is
    no positive whole number, KV heads that do not divide the heads, a norm epsilon that is
    no number."""
    import math

    for key in _COUNTS:
        value = config.get(key)
        if value is None and key in _REQUIRED:
            raise UsageError(f"config.json has no {key}", file=file)
        if value is not None and (type(value) is not int or not 0 < value < 1 << 31):
            raise UsageError(f"config.json's {key} is {_shown(value)}: a positive whole number is wanted", file=file)
    kv = config.get("num_key_value_heads")
    if kv is not None and config["num_attention_heads"] % kv:
        raise UsageError(f"config.json's num_key_value_heads ({kv}) does not divide num_attention_heads "
                         f"({config['num_attention_heads']})", file=file)
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    for key in _NUMBERS:
        value = rope.get(key, config.get(key)) if key == "rope_theta" else config.get(key)
        if value is not None and (type(value) not in (int, float) or not math.isfinite(value) or value <= 0):
            raise UsageError(f"config.json's {key} is {_shown(value)}: a positive number is wanted", file=file)


def _layer_count(items: list[tuple[str, Any]], config: dict[str, Any], file: str) -> int:
    numbers = {int(found.group(1)) for name, _ in items if (found := re.match(r"model\.layers\.([0-9]+)\.", name))}
    if numbers != set(range(len(numbers))):
        raise UsageError(f"the layers are not numbered 0 to {len(numbers) - 1}", file=file)
    stated = config.get("num_hidden_layers")
    if stated is not None and stated != len(numbers):
        raise UsageError(f"config.json says {stated} layers and the weights hold {len(numbers)}: llama.cpp would "
                         "read the wrong model", file=file)
    return len(numbers)


def _is_vector(leaf: Any) -> bool:
    from treecli import _dtypes

    return _leaf.is_array(leaf) and len(leaf.shape) == 1 and _dtypes.is_float(_leaf.as_leaf(leaf).dtype_name)


def _float32(leaf: Any) -> Any:
    return _cast(leaf, "float32")


def _cast(leaf: Any, dtype: str) -> Any:
    from treecli._combine import cast_leaf

    leaf = _leaf.as_leaf(leaf)
    return leaf if leaf.dtype_name == dtype else cast_leaf(leaf, dtype, "", lambda _: None)


def _meta(kind: int, value: Any) -> Any:
    from treecli.formats import gguf_value

    return gguf_value(kind, value)


def _metadata(checkpoint: Any, config: dict[str, Any], arch: str, layers: int, rows: int
              ) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    """The GGUF metadata llama.cpp's converter writes for this model, by the ``gguf``
    package's writer (its keys and value types), warnings, and the tensors it adds
    (``rope_freqs.weight``, name -> array)."""
    import gguf

    writer = gguf.GGUFWriter(None, arch)
    writer.add_type(gguf.GGUFType.MODEL)
    # No general.name: transformers' GGUF reader takes a llama whose name says "mistral" for
    # an architecture of its own, and then cannot load it.
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(layers)
    hparams = {"max_position_embeddings": writer.add_context_length, "hidden_size": writer.add_embedding_length,
               "intermediate_size": writer.add_feed_forward_length,
               "num_attention_heads": writer.add_head_count, "num_key_value_heads": writer.add_head_count_kv}
    for key, add in hparams.items():
        if config.get(key) is not None:
            add(config[key])
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    theta = rope.get("rope_theta", config.get("rope_theta"))
    if theta is not None:
        writer.add_rope_freq_base(theta)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    extra = _rope.to_gguf(config, arch, 10000.0 if theta is None else theta, head_dim, writer, checkpoint.file)
    if config.get("rms_norm_eps") is not None:
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim") is not None:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if arch == "llama":
        writer.add_vocab_size(config.get("vocab_size", rows))
        writer.add_rope_dimension_count(head_dim)
    with _tokenizer_directory(checkpoint) as directory:
        warnings = _vocab.to_gguf(directory, rows, writer)
    return _as_metadata(writer), warnings, extra


@contextlib.contextmanager
def _tokenizer_directory(checkpoint: Any) -> Iterator[Path]:
    """A temporary directory holding copies of the files beside the weights the tokenizer is
    read from, wherever they lie: each read as treecli reads a small file (a regular file
    only, its size bounded), so that neither treecli nor the gguf package reads a FIFO, a
    device or a file of gigabytes in a local directory."""
    with tempfile.TemporaryDirectory(prefix="treecli-tokenizer-") as directory:
        for name in _TOKENIZER_FILES:
            data = companion_bytes(checkpoint, name) if name == "tokenizer.model" else \
                (text.encode("utf-8") if (text := companion_text(checkpoint, name)) is not None else None)
            if data is not None:
                (Path(directory) / name).write_bytes(data)
        yield Path(directory)


def _as_metadata(writer: Any) -> dict[str, Any]:
    """A ``gguf.GGUFWriter``'s key/values as treecli's GGUF writer takes them."""
    from gguf import GGUFValueType

    out = {}
    for key, field in writer.kv_data[0].items():
        if field.type == GGUFValueType.ARRAY:  # (its items' type, as the package's writer takes it: the first's)
            items = list(field.value)
            item = field.sub_type if field.sub_type is not None else GGUFValueType.get_type(items[0])
            out[key] = _meta(int(field.type), (int(item), items))
        else:
            out[key] = _meta(int(field.type), field.value)
    return out


def _file_type(tree: Any) -> int:
    """llama.cpp's ``general.file_type`` for the weights written: by the type of most of
    the bytes of the leaves of two or more dimensions."""
    from gguf import LlamaFileType

    from treecli import _tree
    from treecli.formats import stored_type

    sizes: dict[str, int] = {}
    for leaf in _tree.leaves(tree):
        if _leaf.is_array(leaf) and len(leaf.shape) >= 2:
            kind = stored_type(leaf)
            sizes[kind] = sizes.get(kind, 0) + _leaf.as_leaf(leaf).size
    most = max(sizes, key=sizes.get) if sizes else "float32"
    return int(LlamaFileType[_FILE_TYPES.get(most, "GUESSED")])


# --- back ---------------------------------------------------------------------------------------


def _hf_names(gguf_names: list[str], arch: str, layers: int, file: str) -> list[str]:
    """Each GGUF tensor's transformers name: the first name under ``model.`` (or
    ``lm_head``) the ``gguf`` package's mapping gives for that GGUF name."""
    import gguf

    mapping = gguf.get_tensor_name_map(_gguf_arch(arch), layers).mapping
    back: dict[str, str] = {}
    for hf, (_, name) in mapping.items():
        if hf.startswith("model.") or hf == "lm_head":
            back.setdefault(name, hf)
    out = []
    for name in gguf_names:
        base, _, suffix = name.rpartition(".")
        if base not in back or suffix not in ("weight", "bias"):
            raise UsageError(f"no transformers name for this tensor of a {arch} model", file=file, keypath=name)
        out.append(f"{back[base]}.{suffix}")
    return out


def _config(meta: dict[str, Any], arch: str, leaves: dict[str, Any], file: str) -> dict[str, Any]:
    """The transformers ``config.json`` the GGUF metadata describes."""
    from gguf import LlamaFileType

    def need(key: str, kind: str = "count") -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise UsageError(f"no {arch}.{key} in the metadata: the model's config.json needs it", file=file)
        wanted = (int,) if kind == "count" else (int, float)
        if type(value) not in wanted or not value > 0:
            raise UsageError(f"{arch}.{key} is {_shown(value)}: a positive {'whole ' if kind == 'count' else ''}number "
                             "is wanted", file=file)
        return _decimal(value)

    embeddings = leaves.get("token_embd.weight")
    if embeddings is None:
        raise UsageError("no token_embd.weight", file=file)
    hidden, heads = need("embedding_length"), need("attention.head_count")
    file_type = meta.get("general.file_type")
    dtype = {LlamaFileType.MOSTLY_F16: "float16", LlamaFileType.MOSTLY_BF16: "bfloat16"}.get(file_type, "float32")
    hf_arch, model_type = BACK[arch]
    config: dict[str, Any] = {
        "architectures": [hf_arch], "model_type": model_type, "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"), "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": need("attention.head_count_kv") if f"{arch}.attention.head_count_kv" in meta else heads,
        "max_position_embeddings": need("context_length"),
        "rms_norm_eps": need("attention.layer_norm_rms_epsilon", "number"),
        "vocab_size": _leaf.as_leaf(embeddings).shape[0], "tie_word_embeddings": "output.weight" not in leaves,
        "hidden_act": "silu", "dtype": dtype,
    }
    if meta.get(f"{arch}.rope.freq_base") is not None:
        config["rope_theta"] = need("rope.freq_base", "number")
    if f"{arch}.attention.key_length" in meta and need("attention.key_length") != hidden // heads:
        config["head_dim"] = meta[f"{arch}.attention.key_length"]
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in leaves
    for kind in ("bos", "eos", "pad"):
        if isinstance(meta.get(f"tokenizer.ggml.{kind}_token_id"), int):
            config[f"{kind}_token_id"] = meta[f"tokenizer.ggml.{kind}_token_id"]
    return config


def _span(numbers: set[int]) -> str:
    if not numbers:
        return "none"
    return f"0 to {max(numbers)}" if numbers == set(range(max(numbers) + 1)) else \
        ", ".join(map(str, sorted(numbers)[:8])) + (" ..." if len(numbers) > 8 else "")


def _decimal(value: Any) -> Any:
    """A float32 of the metadata as the shortest decimal that is that float32 (``1e-06``, not
    ``9.999999974752427e-07``), as config.json had it; anything else as it is."""
    if not isinstance(value, float):
        return value
    import numpy as np

    return float(str(np.float32(value)))
