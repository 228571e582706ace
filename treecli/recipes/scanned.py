"""``scanned``: a Hugging Face Llama, Mistral or Qwen2 checkpoint in the layout JAX code
scans over, and back.

Every layer's leaf of one kind is stacked on a new leading axis (``jax.lax.scan`` and
``nnx.scan`` take the layers as one tree), ``Linear`` weights ``[out, in]`` become
kernels ``[in, out]``, attention's projections keep their heads on an axis of their own
(``[hidden, heads, head_dim]``, the output's ``[heads, head_dim, hidden]``), and names
are a Flax model's::

    embedder.embedding                 [vocab, hidden]
    layers.attention.q_proj.kernel     [layers, hidden, heads, head_dim]   (k_proj, v_proj: kv heads)
    layers.attention.q_proj.bias       [layers, heads, head_dim]           (Qwen2)
    layers.attention.o_proj.kernel     [layers, heads, head_dim, hidden]
    layers.mlp.gate_proj.kernel        [layers, hidden, intermediate]      (up_proj; down_proj the other way)
    layers.input_norm.scale            [layers, hidden]                    (post_attention_norm)
    final_norm.scale                   [hidden]
    lm_head.kernel                     [hidden, vocab]                     (none where tied)

The input's ``config.json`` and tokenizer files go beside a directory output (Orbax or
an HF directory), where ``--reverse`` reads the config back from.
"""

from __future__ import annotations

from typing import Any

from treecli import _leaf
from treecli._errors import UsageError
from treecli._transforms import Rename, Stack, Transpose, Unflatten, applied, inverted, items_of, tree_of
from treecli.recipes._recipe import Conversion, architecture, companion_bytes, hf_config

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

# HF's name in a layer -> the stacked leaf's name
_IN_LAYERS = {
    "self_attn.q_proj.weight": "attention.q_proj.kernel", "self_attn.k_proj.weight": "attention.k_proj.kernel",
    "self_attn.v_proj.weight": "attention.v_proj.kernel", "self_attn.o_proj.weight": "attention.o_proj.kernel",
    "self_attn.q_proj.bias": "attention.q_proj.bias", "self_attn.k_proj.bias": "attention.k_proj.bias",
    "self_attn.v_proj.bias": "attention.v_proj.bias",
    "mlp.gate_proj.weight": "mlp.gate_proj.kernel", "mlp.up_proj.weight": "mlp.up_proj.kernel",
    "mlp.down_proj.weight": "mlp.down_proj.kernel",
    "input_layernorm.weight": "input_norm.scale", "post_attention_layernorm.weight": "post_attention_norm.scale",
}
# The files of an HF directory that the scanned checkpoint keeps beside it, and gives back
COMPANIONS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
              "special_tokens_map.json")
_OUTSIDE = {"model.embed_tokens.weight": "embedder.embedding", "model.norm.weight": "final_norm.scale",
            "lm_head.weight": "lm_head.kernel"}
_LINEAR = r"model\.layers\.[0-9]+\.(self_attn|mlp)\.[a-z]+_proj\.weight|lm_head\.weight"
# (kind of projection, its heads' hyper-parameter)
_HEADS = (("q", "num_attention_heads"), ("k", "num_key_value_heads"), ("v", "num_key_value_heads"))


class Scanned:
    name = "scanned"
    summary = ("Hugging Face Llama, Mistral and Qwen2 to the layout JAX scans over: layers stacked, Linear "
               "weights as [in, out] kernels, heads on their own axis, Flax names; --reverse: back to HF")

    def forward(self, checkpoint: Any) -> Conversion:
        config = hf_config(checkpoint, self.name)
        architecture(config, dict.fromkeys(ARCHITECTURES), self.name, checkpoint.file)
        items = [(name, leaf) for name, leaf in items_of(checkpoint.tree) if not name.endswith("rotary_emb.inv_freq")]
        unknown = [name for name in (n for n, _ in items) if not _known(name)]
        if unknown:
            raise UsageError("the scanned recipe has no place for this tensor", file=checkpoint.file,
                             keypath=unknown[0])
        params = dict(config)
        params.setdefault("num_key_value_heads", config.get("num_attention_heads"))
        return Conversion(tree_of(applied(operations(), items, params)))

    def reverse(self, checkpoint: Any) -> Conversion:
        items = items_of(checkpoint.tree)
        leaves = dict(items)
        kernels = [leaves.get(f"layers.attention.{kind}_proj.kernel") for kind, _ in _HEADS]
        if any(not _leaf.is_array(kernel) or len(kernel.shape) != 4 for kernel in kernels):
            raise UsageError("no 4-D layers.attention.{q,k,v}_proj.kernel: not the scanned recipe's layout",
                             file=checkpoint.file)
        # The heads are read from the kernels' own axes: the way back needs no config.
        params = {name: leaves[f"layers.attention.{kind}_proj.kernel"].shape[2] for kind, name in _HEADS}
        files = {name: data for name in COMPANIONS if (data := companion_bytes(checkpoint, name)) is not None}
        warnings = [] if "config.json" in files else [
            "no config.json beside the scanned checkpoint: the HF directory written has none (copy the model's)"]
        return Conversion(tree_of(applied(inverted(operations()), items, params)), files=files, warnings=warnings,
                          format="safetensors")


RECIPE = Scanned()


def _known(name: str) -> bool:
    if name in _OUTSIDE:
        return True
    parts = name.split(".", 3)
    return len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and parts[3] in _IN_LAYERS


def operations() -> list[Any]:
    """HF's tensors to the scanned layout: kernels transposed, heads split off, each
    kind of a layer's leaf stacked into one, the rest renamed."""
    steps: list[Any] = [Transpose(_LINEAR, (1, 0))]
    for kind, heads in _HEADS:
        steps.append(Unflatten(rf"model\.layers\.[0-9]+\.self_attn\.{kind}_proj\.weight", 1, (heads, -1)))
        steps.append(Unflatten(rf"model\.layers\.[0-9]+\.self_attn\.{kind}_proj\.bias", 0, (heads, -1)))
    steps.append(Unflatten(r"model\.layers\.[0-9]+\.self_attn\.o_proj\.weight", 0, ("num_attention_heads", -1)))
    for hf, flax in _IN_LAYERS.items():
        steps.append(Stack(f"model.layers.{{i}}.{hf}", f"layers.{flax}"))
    steps.extend(Rename(hf, flax) for hf, flax in _OUTSIDE.items())
    return steps
