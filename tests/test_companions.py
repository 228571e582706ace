"""Issue 42, item 3: the config.json an HF directory output carries describes the weights
written: layers after slices, frankenmerges and deletions, the dtype after casts, the
vocabulary after embedding edits; a config that cannot be kept true is not written."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from .conftest import BF16


def _hf_model(directory, seed=0, layers=4, vocab=32, dtype_key="torch_dtype"):
    directory.mkdir()
    rng = np.random.default_rng(seed)
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": rng.standard_normal((8, 4)).astype(np.float32)
               for i in range(layers)}
    tensors["model.embed_tokens.weight"] = rng.standard_normal((vocab, 4)).astype(np.float32)
    tensors["model.norm.weight"] = np.ones(4, np.float32)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
              "vocab_size": vocab, "hidden_size": 4, dtype_key: "float32"}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "tokenizer.json").write_text("{}")
    return directory


def _config(directory):
    return json.loads((directory / "config.json").read_text())


def test_a_frankenmerge_s_config_counts_the_layers_it_stacked(cli, tmp_path):
    """mergekit's passthrough slices (layers 0-2 of one model, 1-3 of another): six layers,
    and config.json says six (it said four, as both inputs)."""
    a, b = _hf_model(tmp_path / "a"), _hf_model(tmp_path / "b", seed=1)
    (tmp_path / "franken.yml").write_text(
        "merge_method: passthrough\nslices:\n"
        f"  - sources: [{{model: {a}, layer_range: [0, 3]}}]\n"
        f"  - sources: [{{model: {b}, layer_range: [1, 4]}}]\n")
    result = cli("merge", "--config", tmp_path / "franken.yml", "-o", tmp_path / "out")
    assert result.code == 0, result.stderr
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(k for k in weights if ".layers." in k) == [f"model.layers.{i}.mlp.up_proj.weight" for i in range(6)]
    assert _config(tmp_path / "out")["num_hidden_layers"] == 6
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}"
    assert cli("show", tmp_path / "out", "--json").json["model"]["layers"] == 6


@pytest.mark.parametrize("dtype_key", ["torch_dtype", "dtype"])
def test_a_cast_s_config_names_the_dtype_written(cli, tmp_path, dtype_key):
    model = _hf_model(tmp_path / "m", dtype_key=dtype_key)
    assert cli("edit", model, "--cast", "**=bfloat16", "-o", tmp_path / "half").code == 0
    assert _config(tmp_path / "half")[dtype_key] == "bfloat16"
    assert load_file(str(tmp_path / "half" / "model.safetensors"))["model.norm.weight"].dtype == BF16
    assert cli("convert", model, tmp_path / "f16", "--dtype", "float16").code == 0
    assert _config(tmp_path / "f16")[dtype_key] == "float16"
    # in place: the config is rewritten beside the weights
    assert cli("edit", model, "--in-place", "--cast", "**=bfloat16").code == 0
    assert _config(model)[dtype_key] == "bfloat16"


def test_a_config_already_true_is_copied_byte_for_byte(cli, tmp_path):
    model = _hf_model(tmp_path / "m")
    text = (model / "config.json").read_text().replace("\n", "\n  ", 1)  # its own layout, kept as it is
    (model / "config.json").write_text(text)
    assert cli("edit", model, "--scale", "model.norm.weight=2", "-o", tmp_path / "out").code == 0
    assert (tmp_path / "out" / "config.json").read_text() == text


def test_an_embedding_cut_s_config_counts_its_vocabulary(cli, tmp_path):
    model = _hf_model(tmp_path / "m", vocab=32)
    assert cli("slice", model, "--index", "model.embed_tokens.weight=:24", "-o", tmp_path / "cut").code == 0
    assert _config(tmp_path / "cut")["vocab_size"] == 24


def test_a_config_that_cannot_be_kept_true_is_said_and_not_written(cli, tmp_path):
    """Layer 2 deleted: layers 0, 1, 3 remain; no count describes them (transformers would
    load layers 0-2), so the output has no config.json, and the warning says how to keep one."""
    model = _hf_model(tmp_path / "m")
    result = cli("edit", model, "--delete", "model.layers.2.**", "-o", tmp_path / "gap")
    assert result.code == 0, result.stderr
    assert "no model.layers.2" in result.stderr and "config.json" in result.stderr
    assert not (tmp_path / "gap" / "config.json").exists()
    assert (tmp_path / "gap" / "tokenizer.json").exists()
    renumbered = cli("edit", tmp_path / "gap", "--rename", "model.layers.3.**=model.layers.2.**",
                     "-o", tmp_path / "renumbered")
    assert renumbered.code == 0, renumbered.stderr
    # (the gap's output has no config.json to carry: nothing was invented either)
    assert not (tmp_path / "renumbered" / "config.json").exists()
    again = cli("edit", model, "--delete", "model.layers.3.**", "-o", tmp_path / "three")
    assert again.code == 0 and _config(tmp_path / "three")["num_hidden_layers"] == 3


def test_layers_of_several_stacks_or_of_unknown_names_keep_their_counts(cli, tmp_path):
    """An encoder and a decoder (BART's names) number their layers each from 0, T5 names
    them block.N: the counts cannot be told apart or found, so config.json keeps them (its
    dtype still follows a cast); a gap in either stack still cannot be described."""
    for name, keys in (("bart", [f"model.{side}.layers.{i}.fc1.weight" for side in ("encoder", "decoder")
                                 for i in range(3)]),
                       ("t5", [f"encoder.block.{i}.layer.0.w" for i in range(3)])):
        model = tmp_path / name
        model.mkdir()
        save_file({k: np.ones((2, 2), np.float32) for k in keys}, str(model / "model.safetensors"))
        (model / "config.json").write_text(json.dumps({"model_type": name, "num_layers": 3,
                                                       "num_hidden_layers": 3, "torch_dtype": "float32"}))
        assert cli("edit", model, "--cast", "**=float16", "-o", tmp_path / f"{name}-half").code == 0
        assert _config(tmp_path / f"{name}-half") == {"model_type": name, "num_layers": 3, "num_hidden_layers": 3,
                                                      "torch_dtype": "float16"}
    gap = cli("edit", tmp_path / "bart", "--delete", "model.decoder.layers.1.**", "-o", tmp_path / "bart-gap")
    assert gap.code == 0 and "no model.decoder.layers.1" in gap.stderr
    assert not (tmp_path / "bart-gap" / "config.json").exists()


def _tiny_llama(directory, seed):
    """A random 4-layer Llama of transformers' own making, saved by save_pretrained."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return model


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning")
def test_transformers_loads_a_frankenmerge_with_every_layer_it_stacked(cli, tmp_path):
    """The consumer is the test: transformers loads treecli's frankenmerge of two of its own
    models with six layers, none missing or unexpected, each the layer the slices name,
    and a cast output in the dtype written."""
    import torch
    import transformers

    a, b = _tiny_llama(tmp_path / "a", 0), _tiny_llama(tmp_path / "b", 1)
    (tmp_path / "franken.yml").write_text(
        "merge_method: passthrough\ndtype: float32\nslices:\n"
        f"  - sources: [{{model: {tmp_path / 'a'}, layer_range: [0, 3]}}]\n"
        f"  - sources: [{{model: {tmp_path / 'b'}, layer_range: [1, 4]}}]\n")
    assert cli("merge", "--config", tmp_path / "franken.yml", "-o", tmp_path / "out").code == 0
    merged, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert merged.config.num_hidden_layers == 6 and len(merged.model.layers) == 6
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for out_layer, (source, layer) in enumerate([(a, 0), (a, 1), (a, 2), (b, 1), (b, 2), (b, 3)]):
        assert torch.equal(merged.model.layers[out_layer].mlp.up_proj.weight, source.model.layers[layer].mlp.up_proj.weight)
    tokens = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert torch.isfinite(merged(tokens).logits).all()
    assert cli("convert", tmp_path / "a", tmp_path / "half", "--dtype", "bfloat16").code == 0
    half = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "half", dtype="auto")
    assert half.dtype == torch.bfloat16


def test_tokenizer_source_names_the_model_whose_tokenizer_the_output_takes(cli, tmp_path):
    """mergekit's tokenizer_source: base or a model; the output directory takes that
    model's tokenizer files (and its config, kept true). A union of vocabularies, a name
    that is no model of the config, and a tokenizer whose vocabulary does not fit the
    weights written are each one line, and nothing is written."""
    base, other = _hf_model(tmp_path / "base"), _hf_model(tmp_path / "other", seed=1)
    (other / "tokenizer.json").write_text('{"other": true}')
    text = (f"merge_method: linear\nbase_model: {base}\nmodels: [{{model: {base}}}, {{model: {other}}}]\n"
            "tokenizer_source: SOURCE\n")
    for source, expected in (("base", "{}"), (str(other), '{"other": true}')):
        (tmp_path / "merge.yml").write_text(text.replace("SOURCE", source))
        out = tmp_path / f"out-{len(expected)}"
        result = cli("merge", "--config", tmp_path / "merge.yml", "-o", out)
        assert result.code == 0, result.stderr
        assert (out / "tokenizer.json").read_text() == expected and _config(out)["num_hidden_layers"] == 4
    for source, fragment in (("union", "tokenizer_source: union builds a tokenizer"),
                             ("elsewhere", "'elsewhere': name base or one of the config's models")):
        (tmp_path / "merge.yml").write_text(text.replace("SOURCE", source))
        result = cli("merge", "--config", tmp_path / "merge.yml", "-o", tmp_path / "refused")
        assert result.code == 2 and fragment in result.stderr and not (tmp_path / "refused").exists()
    wide = _hf_model(tmp_path / "wide", vocab=40)
    (tmp_path / "franken.yml").write_text(
        f"merge_method: passthrough\ntokenizer_source: {wide}\nslices:\n"
        f"  - sources: [{{model: {base}, layer_range: [0, 2]}}]\n"
        f"  - sources: [{{model: {wide}, layer_range: [2, 4]}}]\n")
    result = cli("merge", "--config", tmp_path / "franken.yml", "-o", tmp_path / "misfit")
    assert result.code == 2 and "its vocabulary has 40 tokens, the output's model.embed_tokens.weight 32 rows" \
        in result.stderr
    assert not (tmp_path / "misfit").exists()


@pytest.mark.parametrize("text", ["[" * 100_000, '{"model_type": "llama", "num_hidden_layers": 1e400}',
                                  '{"model_type": "llama", "num_hidden_layers": true, "vocab_size": -3}',
                                  '{"model_type": "llama", "num_hidden_layers": 100000000000000000000}',
                                  " " * (1 << 20) + '{"model_type": "llama", "num_hidden_layers": 9}'],
                         ids=["deep", "inf", "bool", "huge", "over 1 MiB"])
def test_a_hostile_config_json_is_no_model_and_travels_as_it_is(cli, tmp_path, text):
    """A config.json nested past Python's parser, or with counts that are no counts, names
    no model (or none of its counts) and never makes a traceback; beside the output it
    travels unchanged, but for the counts the weights can give (a vocabulary of -3 becomes
    32; a long file's 9 layers, 4)."""
    model = _hf_model(tmp_path / "m")
    (model / "config.json").write_text(text)
    shown = cli("show", model, "--json")
    assert shown.code == 0, shown.stderr
    assert shown.json.get("model") in (None, {"architecture": "llama", "layers": None, "vocab": None},
                                       {"architecture": "llama", "layers": 9, "vocab": None})
    assert cli("convert", model, tmp_path / "out").code == 0
    assert cli("edit", model, "--in-place", "--scale", "model.norm.weight=2").code == 0
    written = (tmp_path / "out" / "config.json").read_text()
    if '"vocab_size": -3' in text or '"num_hidden_layers": 9' in text:  # (counts the weights can give)
        fixed = {"vocab_size": 32} if "-3" in text else {"num_hidden_layers": 4}
        assert json.loads(written) == json.loads((model / "config.json").read_text()) == {**json.loads(text),
                                                                                          **fixed}
    else:
        assert written == (model / "config.json").read_text() == text


def test_a_fifo_named_config_json_names_no_model_and_is_not_carried(cli, tmp_path):
    """A special file beside the weights is never read (it would block) nor copied."""
    import os

    model = _hf_model(tmp_path / "m")
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    shown = cli("show", model, "--json")
    assert shown.code == 0 and "model" not in shown.json, shown.stderr
    assert cli("convert", model, tmp_path / "out").code == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors", "tokenizer.json"]
