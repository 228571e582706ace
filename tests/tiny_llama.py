"""Tiny Hugging Face Llama, Mistral and Qwen2 directories made without transformers (NumPy
and safetensors): the tensors, config.json and a byte-level BPE tokenizer.json that
transformers itself writes for these models, for the tests that need no oracle (the
--help examples, hostile inputs). The oracle tests build their models with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def byte_level_tokenizer() -> dict:
    """A GPT-2 style tokenizer.json: the 256 byte symbols, a few merges, <s> and </s>."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    vocab = {symbols[b]: i for i, b in enumerate(range(256))}
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("o", "Ġ"), ("w", "o")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    added = [{"id": len(vocab) + i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, text in enumerate(["<s>", "</s>"])]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]}}


def write_model(directory: Path, kind: str = "llama", *, layers: int = 2, seed: int = 0,
                dtype=np.float32) -> Path:
    """An HF directory of a tiny random ``kind`` model (hidden 64, 4 heads, 2 KV heads)."""
    tokenizer = byte_level_tokenizer()
    vocab = len(tokenizer["model"]["vocab"]) + len(tokenizer["added_tokens"])
    hidden, ffn, heads, kv, head_dim = 64, 128, 4, 2, 16
    rng = np.random.default_rng(seed)

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(dtype)

    tensors = {"model.embed_tokens.weight": weight(vocab, hidden), "model.norm.weight": 1 + weight(hidden)}
    if kind != "qwen2":
        tensors["lm_head.weight"] = weight(vocab, hidden)
    for i in range(layers):
        prefix = f"model.layers.{i}."
        tensors.update({
            prefix + "self_attn.q_proj.weight": weight(heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": weight(kv * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": weight(kv * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
            prefix + "mlp.gate_proj.weight": weight(ffn, hidden), prefix + "mlp.up_proj.weight": weight(ffn, hidden),
            prefix + "mlp.down_proj.weight": weight(hidden, ffn),
            prefix + "input_layernorm.weight": 1 + weight(hidden),
            prefix + "post_attention_layernorm.weight": 1 + weight(hidden)})
        if kind == "qwen2":
            tensors.update({prefix + f"self_attn.{p}_proj.bias": weight(n * head_dim)
                            for p, n in (("q", heads), ("k", kv), ("v", kv))})
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {"architectures": [ARCHITECTURES[kind]], "model_type": kind, "hidden_size": hidden,
              "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "vocab_size": vocab, "tie_word_embeddings": kind == "qwen2", "hidden_act": "silu",
              "bos_token_id": vocab - 2, "eos_token_id": vocab - 1, "dtype": np.dtype(dtype).name}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                 "tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory
