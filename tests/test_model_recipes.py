"""Issue 42, item 2: recipes make models their consumers run. transformers (with torch, the
test extras; never imported by treecli) builds tiny random Llama, Mistral and Qwen2
models from its own config classes and loads what treecli writes: the GGUF of the
llama.cpp recipe (its own GGUF reader maps llama.cpp's names back), the HF directories of
both recipes' reverse; a JAX forward pass runs the scanned layout. Logits of a fixed
prompt equal the original model's, and every recipe round-trips bit-identical.
llama.cpp itself is tests/test_llama_cpp_oracle.py."""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from .conftest import assert_clean_error
from .test_remote import server  # noqa: F401  (the HTTP server fixture)
from .tiny_llama import byte_level_tokenizer, write_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # (transformers' GGUF loader needs it)

IDS = [[3, 70, 101, 7, 256, 42, 99, 5]]
TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
KINDS = ["llama", "mistral", "qwen2"]


def _build(directory, kind, *, dtype=torch.float32, layers=2, tokenizer=True, vocab=263, **config_options):
    """A tiny random ``kind`` model as transformers writes it (save_pretrained), with a
    byte-level BPE tokenizer."""
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}
    config_class, model_class = classes[kind]
    # (263: the byte-level tokenizer's 256 bytes, 5 merges and 2 special tokens)
    config = config_class(**{"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
                             "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "max_position_embeddings": 128, "tie_word_embeddings": kind == "qwen2",
                             "bos_token_id": 261, "eos_token_id": 262, **config_options})
    torch.manual_seed(0)
    model = model_class(config).to(dtype).eval()
    with torch.no_grad():  # (a random init leaves the norms at 1: give them values of their own)
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(directory)
    if tokenizer:
        (directory / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer()))
        (directory / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast",
             "chat_template": TEMPLATE}))
    return directory


def _logits(directory, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs).eval()
        with torch.no_grad():
            return model(torch.tensor(IDS)).logits.numpy(), model.config


def _same_weights(a, b):
    left, right = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert sorted(left) == sorted(right)
    for name in left:
        assert left[name].dtype == right[name].dtype and left[name].tobytes() == right[name].tobytes(), name


@pytest.mark.parametrize("kind", KINDS)
def test_llama_cpp_recipe_writes_a_gguf_transformers_runs_and_back(cli, tmp_path, kind):
    model = _build(tmp_path / kind, kind)
    result = cli("convert", model, tmp_path / "model.gguf", "--recipe", "llama.cpp")
    assert result.code == 0, result.stderr
    expected, _ = _logits(model)
    got, config = _logits(tmp_path, gguf_file="model.gguf")
    assert config.num_hidden_layers == 2 and config.num_key_value_heads == 2
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())

    shown = cli("show", tmp_path / "model.gguf", "--json").json
    metadata = shown["metadata"]
    arch = "qwen2" if kind == "qwen2" else "llama"  # (Mistral is llama in llama.cpp)
    assert metadata["general.architecture"] == arch and metadata[f"{arch}.block_count"] == 2
    assert metadata["tokenizer.ggml.model"] == "gpt2" and metadata["tokenizer.ggml.bos_token_id"] == 261
    assert metadata["tokenizer.chat_template"] == TEMPLATE
    leaves = {leaf["keypath"]: leaf for leaf in shown["leaves"]}
    assert ("output.weight" in leaves) == (kind != "qwen2")  # tied embeddings: no output.weight

    back = tmp_path / "back"
    result = cli("convert", tmp_path / "model.gguf", back, "--recipe", "llama.cpp", "--reverse")
    assert result.code == 0, result.stderr
    _same_weights(model, back)
    again, config = _logits(back)
    assert np.array_equal(again, expected)
    assert config.model_type == arch and config.tie_word_embeddings == (kind == "qwen2")
    assert (back / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    tokenizer = transformers.AutoTokenizer.from_pretrained(back)
    assert tokenizer("hello world").input_ids == transformers.AutoTokenizer.from_pretrained(model)(
        "hello world").input_ids
    assert tokenizer.bos_token == "<s>" and tokenizer.chat_template == TEMPLATE


def test_a_bf16_model_keeps_its_bits_and_its_norms_go_f32_as_llama_cpp_writes_them(cli, tmp_path):
    model = _build(tmp_path / "m", "llama", dtype=torch.bfloat16)
    assert cli("convert", model, tmp_path / "m.gguf", "--recipe", "llama.cpp").code == 0
    shown = cli("show", tmp_path / "m.gguf", "--json").json
    assert shown["metadata"]["general.file_type"] == 32  # MOSTLY_BF16
    leaves = {leaf["keypath"]: leaf["dtype"] for leaf in shown["leaves"]}
    assert leaves["blk.0.attn_norm.weight"] == "float32" and leaves["blk.0.attn_q.weight"] == "bfloat16"
    expected, _ = _logits(model)
    got, _ = _logits(tmp_path, gguf_file="m.gguf")
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())
    assert cli("convert", tmp_path / "m.gguf", tmp_path / "back", "--recipe", "llama.cpp", "--reverse").code == 0
    _same_weights(model, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_pytorch_bin_directory_and_a_hub_repository_convert_too(cli, tmp_path, server):  # noqa: F811
    model = _build(tmp_path / "m", "mistral")
    expected, _ = _logits(model)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    state = {k: torch.from_numpy(v) for k, v in load_file(str(model / "model.safetensors")).items()}
    torch.save(state, bin_dir / "pytorch_model.bin")  # (transformers 5 writes safetensors only)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (bin_dir / name).write_bytes((model / name).read_bytes())
        server.files[f"/org/tiny/resolve/main/{name}"] = (model / name).read_bytes()
    server.files["/org/tiny/resolve/main/model.safetensors"] = (model / "model.safetensors").read_bytes()
    for source, name in ((bin_dir, "bin.gguf"), ("hf://org/tiny", "hub.gguf")):
        result = cli("convert", source, tmp_path / name, "--recipe", "llama.cpp", "--no-record")  # (inputs named apart)
        assert result.code == 0, result.stderr
        got, _ = _logits(tmp_path, gguf_file=name)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())
    assert (tmp_path / "bin.gguf").read_bytes() == (tmp_path / "hub.gguf").read_bytes()


def _jax_forward(params, config, ids):
    """A Llama forward pass over the scanned layout, the layers run by jax.lax.scan."""
    import jax
    import jax.numpy as jnp

    eps, theta = config["rms_norm_eps"], config.get("rope_theta", 10000.0)
    heads = config["num_attention_heads"]

    def norm(x, scale):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale

    x = params["embedder"]["embedding"][jnp.asarray(ids)]
    head_dim = params["layers"]["attention"]["q_proj"]["kernel"].shape[-1]
    angles = jnp.arange(len(ids))[:, None] / theta ** (jnp.arange(0, head_dim, 2) / head_dim)[None]
    cos, sin = jnp.cos(jnp.concatenate([angles] * 2, -1))[:, None], jnp.sin(jnp.concatenate([angles] * 2, -1))[:, None]

    def rotate(x):
        half = x.shape[-1] // 2
        return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], -1) * sin

    def project(h, p):
        out = jnp.einsum("th,hnd->tnd", h, p["kernel"])
        return out + p["bias"] if "bias" in p else out

    def layer(x, p):
        a = p["attention"]
        h = norm(x, p["input_norm"]["scale"])
        q, k, v = rotate(project(h, a["q_proj"])), rotate(project(h, a["k_proj"])), project(h, a["v_proj"])
        k, v = (jnp.repeat(t, heads // t.shape[1], axis=1) for t in (k, v))
        scores = jnp.einsum("tnd,snd->nts", q, k) / jnp.sqrt(head_dim)
        scores = jnp.where(jnp.tril(jnp.ones((len(ids), len(ids)), bool)), scores, -jnp.inf)
        attended = jnp.einsum("nts,snd->tnd", jax.nn.softmax(scores, -1), v)
        x = x + jnp.einsum("tnd,ndh->th", attended, a["o_proj"]["kernel"])
        h = norm(x, p["post_attention_norm"]["scale"])
        m = p["mlp"]
        return x + (jax.nn.silu(h @ m["gate_proj"]["kernel"]) * (h @ m["up_proj"]["kernel"])) @ \
            m["down_proj"]["kernel"], None

    x, _ = jax.lax.scan(layer, x, params["layers"])
    x = norm(x, params["final_norm"]["scale"])
    head = params["lm_head"]["kernel"] if "lm_head" in params else params["embedder"]["embedding"].T
    return np.asarray(x @ head)


@pytest.mark.parametrize("kind", KINDS)
def test_scanned_recipe_runs_in_jax_and_comes_back(cli, tmp_path, kind):
    import treecli

    model = _build(tmp_path / kind, kind, layers=3)
    scanned = tmp_path / "scanned"
    result = cli("convert", model, scanned, "--format", "orbax", "--recipe", "scanned")
    assert result.code == 0, result.stderr
    import jax

    with treecli.open(scanned) as ckpt:
        params = jax.tree_util.tree_map(np.asarray, ckpt.tree)
    assert params["layers"]["attention"]["q_proj"]["kernel"].shape == (3, 64, 4, 16)
    assert params["layers"]["attention"]["k_proj"]["kernel"].shape == (3, 64, 2, 16)
    assert params["layers"]["mlp"]["down_proj"]["kernel"].shape == (3, 128, 64)
    config = json.loads((scanned / "config.json").read_text())
    expected, _ = _logits(model)
    got = _jax_forward(params, config, IDS[0])
    np.testing.assert_allclose(got, expected[0], rtol=1e-4, atol=1e-5 * np.abs(expected).max())
    back = tmp_path / "back"
    assert cli("convert", scanned, back, "--recipe", "scanned", "--reverse").code == 0
    _same_weights(model, back)
    assert np.array_equal(_logits(back)[0], expected)


def test_a_frankenmerge_loads_in_transformers_with_the_layers_it_stacked(cli, tmp_path):
    """mergekit's passthrough slices of two 2-layer models (0-1 of one, 1 of the other): three layers."""
    a, b = _build(tmp_path / "a", "llama"), _build(tmp_path / "b", "llama")
    (tmp_path / "franken.yml").write_text(
        "merge_method: passthrough\nslices:\n"
        f"  - sources: [{{model: {a}, layer_range: [0, 2]}}]\n"
        f"  - sources: [{{model: {b}, layer_range: [1, 2]}}]\n")
    assert cli("merge", "--config", tmp_path / "franken.yml", "-o", tmp_path / "out").code == 0
    _, config = _logits(tmp_path / "out")
    assert config.num_hidden_layers == 3


def test_what_a_recipe_cannot_make_is_one_line(cli, tmp_path):
    llama = write_model(tmp_path / "llama", "llama")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "model.safetensors").write_bytes((llama / "model.safetensors").read_bytes())
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert_clean_error(cli("convert", gpt2, tmp_path / "x.gguf", "--recipe", "llama.cpp"),
                       "knows LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM", "GPT2LMHeadModel")
    scaled = write_model(tmp_path / "scaled", "llama")
    config = json.loads((scaled / "config.json").read_text())
    (scaled / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "longrope", "factor": 8}}))
    assert_clean_error(cli("convert", scaled, tmp_path / "x.gguf", "--recipe", "llama.cpp"), "'longrope' rope scaling")
    (scaled / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "llama3", "factor": "8"}}))
    assert_clean_error(cli("convert", scaled, tmp_path / "x.gguf", "--recipe", "llama.cpp"),
                       "rope scaling factor is '8': a positive number is wanted")
    stale = write_model(tmp_path / "stale", "llama")
    (stale / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 40}))
    assert_clean_error(cli("convert", stale, tmp_path / "x.gguf", "--recipe", "llama.cpp"),
                       "config.json says 40 layers and the weights hold 2")
    bare = write_model(tmp_path / "bare", "llama")
    (bare / "tokenizer.json").unlink()
    assert_clean_error(cli("convert", bare, tmp_path / "x.gguf", "--recipe", "llama.cpp"), "needs the model's tokenizer")
    assert_clean_error(cli("convert", llama / "model.safetensors", tmp_path / "x.gguf", "--recipe", "llama.cpp"),
                       "config.json beside its weights, and there is none: give the model's directory")
    assert_clean_error(cli("convert", llama, tmp_path / "x", "--recipe", "nonesuch"), "no recipe 'nonesuch'")
    assert_clean_error(cli("convert", llama, tmp_path / "x", "--recipe", "llama.cpp", "--reverse"),
                       "reverse reads a GGUF file")
    assert not any(p.name.startswith("x") for p in tmp_path.iterdir())


def test_recipes_are_listed(cli):
    result = cli("convert", "--list-recipes")
    assert result.code == 0 and "llama.cpp" in result.stdout and "scanned" in result.stdout


def _with_config(tmp_path, name, **changes):
    model = write_model(tmp_path / name, "llama")
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return model


@pytest.mark.parametrize("changes, message", [
    ({"hidden_size": None}, "hidden_size"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_attention_heads": "4"}, "num_attention_heads"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"rms_norm_eps": "tiny"}, "rms_norm_eps"),
    ({"max_position_embeddings": -1}, "max_position_embeddings"),
    ({"rope_theta": [1, 2]}, "rope_theta"),
    ({"vocab_size": 1e30}, "vocab_size"),
])
def test_a_hostile_config_is_one_line(cli, tmp_path, changes, message):
    model = _with_config(tmp_path, "m", **changes)
    assert_clean_error(cli("convert", model, tmp_path / "x.gguf", "--recipe", "llama.cpp"), "config.json", message)
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("tokenizer, message", [
    ({"model": {"type": "BPE", "vocab": {"a": 10 ** 12}}}, "token id"),
    ({"model": {"type": "BPE", "vocab": {"a": "zero"}}}, "token id"),
    ({"model": {"type": "BPE", "vocab": {"a": [0]}}}, "token id"),
    ({"model": {"type": "BPE", "vocab": {"a": 0}}, "added_tokens": [{"id": -1, "content": "x"}]}, "token id"),
    ({"model": {"type": "BPE", "vocab": ["a"]}}, "byte-level BPE"),
    ({"model": "BPE"}, "no tokenizer"),
    ([1, 2], "no tokenizer"),
])
def test_a_hostile_tokenizer_json_is_one_line(cli, tmp_path, tokenizer, message):
    model = write_model(tmp_path / "m", "llama")
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert_clean_error(cli("convert", model, tmp_path / "x.gguf", "--recipe", "llama.cpp"), message)


@pytest.mark.parametrize("data, message", [
    (b"\x0a\x05\x0a\x01a", "ends inside"),             # a piece longer than the file
    (b"\x0a\x04\x0a\x01a\x15", "ends inside"),           # a score cut short
    (b"\x10\x96\x01", "holds no pieces"),                # a number, no piece
    (b"\x08\x96\x01", "a piece that is a number"),
    (b"\x0a\x02\x10\x01", "no SentencePiece model"),     # a piece whose score is a number
    (b"\x0f", "no SentencePiece model"),                 # wire type 7
    (b"\xff" * 20, "ends inside a number"),
])
def test_a_hostile_tokenizer_model_is_one_line(cli, tmp_path, data, message):
    model = write_model(tmp_path / "m", "llama")
    (model / "tokenizer.model").write_bytes(data)
    assert_clean_error(cli("convert", model, tmp_path / "x.gguf", "--recipe", "llama.cpp"), "tokenizer.model",
                       message)


def _gguf_with(tmp_path, name, **metadata):
    """The llama.cpp recipe's GGUF of a tiny Llama, its metadata changed as given (None: removed)."""
    import gguf

    model = write_model(tmp_path / f"src_{name}", "llama")
    source = tmp_path / f"src_{name}.gguf"
    assert run_quiet(cli_args=("convert", model, source, "--recipe", "llama.cpp", "-q")) == 0
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(tmp_path / name), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name in metadata:
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, value, kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, value, kind)
    for key, value in metadata.items():
        if value is not None:
            writer.add_key_value(key, value[1], value[0])
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tmp_path / name


def run_quiet(cli_args):
    from .conftest import run_cli

    return run_cli(*cli_args).code


@pytest.mark.parametrize("metadata, message", [
    ({"llama.block_count": None}, "llama.block_count"),
    ({"llama.block_count": (5, 10 ** 9)}, "llama.block_count"),  # (an int32 past the tensors' layers)
    ({"llama.attention.head_count": (4, 0)}, "head_count"),
    ({"llama.embedding_length": None}, "embedding_length"),
    ({"llama.attention.head_count": (8, "four")}, "head_count"),
])
def test_a_hostile_gguf_is_one_line_on_the_way_back(cli, tmp_path, metadata, message):
    import gguf

    metadata = {k: (gguf.GGUFValueType(v[0]), v[1]) if v is not None else None for k, v in metadata.items()}
    path = _gguf_with(tmp_path, "h.gguf", **metadata)
    assert_clean_error(cli("convert", path, tmp_path / "back", "--recipe", "llama.cpp", "--reverse"), message)
    assert not (tmp_path / "back").exists()


def test_the_scanned_recipe_s_way_back_wants_its_layout(cli, tmp_path):
    llama = write_model(tmp_path / "llama", "llama")
    assert_clean_error(cli("convert", llama, tmp_path / "back", "--recipe", "scanned", "--reverse"),
                       "not the scanned recipe's layout")
    flat = tmp_path / "flat.safetensors"
    assert cli("edit", llama, "-o", flat, "--stack", r"model.layers.{i}.(.+) -> layers.attention.\1").code == 0
    assert_clean_error(cli("convert", flat, tmp_path / "back", "--recipe", "scanned", "--reverse"),
                       "not the scanned recipe's layout")
    model = _with_config(tmp_path, "five_heads", num_attention_heads=5)
    assert_clean_error(cli("convert", model, tmp_path / "s", "--recipe", "scanned", "--format", "orbax"),
                       "model.layers.0.self_attn.q_proj.weight", "64 elements do not fill shape [5, -1]")
    assert not (tmp_path / "back").exists() and not (tmp_path / "s").exists()


def _sentencepiece_model(directory):
    """A SentencePiece BPE tokenizer.model with byte fallback, as Llama 2's, trained here."""
    sentencepiece = pytest.importorskip("sentencepiece")
    text = directory / "corpus.txt"
    text.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog" for i in range(300)))
    sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(directory / "tokenizer"),
                                             vocab_size=300, model_type="bpe", byte_fallback=True,
                                             remove_extra_whitespaces=False, minloglevel=2)
    text.unlink()
    (directory / "tokenizer.vocab").unlink()
    return sentencepiece.SentencePieceProcessor(model_file=str(directory / "tokenizer.model"))


def test_a_sentencepiece_tokenizer_goes_into_gguf_as_sentencepiece_reads_it_and_back(cli, tmp_path):
    model = _build(tmp_path / "m", "llama", tokenizer=False, vocab=320)
    processor = _sentencepiece_model(model)
    assert cli("convert", model, tmp_path / "m.gguf", "--recipe", "llama.cpp").code == 0
    import gguf

    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    tokens = fields["tokenizer.ggml.tokens"].contents()
    scores, types = fields["tokenizer.ggml.scores"].contents(), fields["tokenizer.ggml.token_type"].contents()
    n = processor.get_piece_size()
    assert tokens[:n] == [processor.id_to_piece(i) for i in range(n)]
    assert scores[:n] == pytest.approx([processor.get_score(i) for i in range(n)])
    assert types[:n] == [6 if processor.is_byte(i) else 2 if processor.is_unknown(i) else 3 if processor.is_control(i)
                         else 1 for i in range(n)]
    assert len(tokens) == 320 and tokens[-1] == "[PAD319]"  # padded to the embeddings' rows, as llama.cpp's converter
    assert cli("convert", tmp_path / "m.gguf", tmp_path / "back", "--recipe", "llama.cpp", "--reverse").code == 0
    _same_weights(model, tmp_path / "back")
    import sentencepiece

    rebuilt = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "back" / "tokenizer.model"))
    for text in ("the quick brown fox 17 jumps", "über naïve 🦊", "a  b"):
        assert rebuilt.encode(text) == processor.encode(text), text
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
    assert tokenizer("the quick brown fox", add_special_tokens=False).input_ids == processor.encode(
        "the quick brown fox")


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def llama3_rope_freqs(theta, dim, scaling):
    """convert_hf_to_gguf.py's rope_freqs of a llama3 rope scaling, as it computes them (torch, float32)."""
    import math

    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


@pytest.mark.parametrize("scaling", [LLAMA3, {**LLAMA3, "factor": 32.0, "original_max_position_embeddings": 8192}])
def test_llama3_rope_scaling_goes_in_as_rope_freqs_and_comes_back(cli, tmp_path, scaling):
    """Llama 3.1 and 3.2 scale their rotary embedding ("llama3"): llama.cpp reads the factors
    from a rope_freqs tensor its converter computes; the way back finds the scaling again."""
    import gguf

    model = _build(tmp_path / "m", "llama", rope_scaling=dict(scaling))
    result = cli("convert", model, tmp_path / "m.gguf", "--recipe", "llama.cpp")
    assert result.code == 0, result.stderr
    tensors = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    np.testing.assert_array_equal(tensors["rope_freqs.weight"], llama3_rope_freqs(10000.0, 16, scaling))
    back = tmp_path / "back"
    result = cli("convert", tmp_path / "m.gguf", back, "--recipe", "llama.cpp", "--reverse")
    assert result.code == 0 and "warning" not in result.stderr, result.stderr
    _same_weights(model, back)
    expected, _ = _logits(model)
    again, config = _logits(back)
    np.testing.assert_allclose(again, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())
    assert config.rope_parameters["rope_type"] == "llama3"


@pytest.mark.parametrize("kind, scaling", [
    ("llama", {"rope_type": "linear", "factor": 4.0}),
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
])
def test_linear_and_yarn_rope_scaling_go_in_as_keys_and_come_back(cli, tmp_path, kind, scaling):
    model = _build(tmp_path / "m", kind, rope_scaling=dict(scaling))
    assert cli("convert", model, tmp_path / "m.gguf", "--recipe", "llama.cpp").code == 0
    metadata = cli("show", tmp_path / "m.gguf", "--json").json["metadata"]
    assert metadata[f"{kind}.rope.scaling.type"] == scaling["rope_type"]
    assert metadata[f"{kind}.rope.scaling.factor"] == 4.0
    back = tmp_path / "back"
    assert cli("convert", tmp_path / "m.gguf", back, "--recipe", "llama.cpp", "--reverse").code == 0
    expected, _ = _logits(model)
    again, config = _logits(back)
    assert config.rope_parameters["rope_type"] == scaling["rope_type"]
    np.testing.assert_allclose(again, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


def test_show_of_the_recipe_s_gguf_keeps_the_tokenizer_json_short(cli, tmp_path):
    model = write_model(tmp_path / "m", "llama")
    assert cli("convert", model, tmp_path / "m.gguf", "--recipe", "llama.cpp").code == 0
    size = len((model / "tokenizer.json").read_text())
    assert size > 4096
    line = next(line for line in cli("show", tmp_path / "m.gguf").stdout.splitlines()
                if line.startswith("tokenizer.huggingface.json"))
    assert line.endswith(f"… ({size:,} characters)") and len(line) < 4200
    assert cli("show", tmp_path / "m.gguf", "--json").json["metadata"]["tokenizer.huggingface.json"] == \
        (model / "tokenizer.json").read_text()  # (under 65,536 characters: whole)


def test_a_fifo_or_a_device_in_place_of_a_tokenizer_file_is_one_line(cli, tmp_path):
    import os

    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        model = write_model(tmp_path / name, "llama")
        (model / name).unlink(missing_ok=True)
        os.mkfifo(model / name)
        assert_clean_error(cli("convert", model, tmp_path / "x.gguf", "--recipe", "llama.cpp"), name)
    model = write_model(tmp_path / "zero", "llama")
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to("/dev/zero")
    assert_clean_error(cli("convert", model, tmp_path / "x.gguf", "--recipe", "llama.cpp"), "tokenizer.json")
    assert not (tmp_path / "x.gguf").exists()


def test_a_token_id_twice_is_one_line(cli, tmp_path):
    model = write_model(tmp_path / "m", "llama")
    tokenizer = byte_level_tokenizer()
    tokenizer["model"]["vocab"]["he"] = tokenizer["model"]["vocab"]["ll"]  # two tokens, one id
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert_clean_error(cli("convert", model, tmp_path / "x.gguf", "--recipe", "llama.cpp"), "token id",
                       "twice")
    tokenizer = byte_level_tokenizer()
    tokenizer["added_tokens"][0]["id"] = 5  # an added token on a vocabulary token's id, another text
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert_clean_error(cli("convert", model, tmp_path / "x.gguf", "--recipe", "llama.cpp"), "token id 5",
                       "twice")


def test_embeddings_of_more_rows_than_any_vocabulary_are_refused_before_a_list_is_built():
    import gguf

    from treecli._errors import UsageError
    from treecli.recipes import _vocab

    model = write_model(Path(tempfile.mkdtemp()) / "m", "llama")
    with pytest.raises(UsageError, match="rows"):
        _vocab.to_gguf(model, 1 << 40, gguf.GGUFWriter(None, "llama"))


def test_a_fifo_beside_a_scanned_checkpoint_is_one_line(cli, tmp_path):
    import os

    model = write_model(tmp_path / "m", "llama")
    assert cli("convert", model, tmp_path / "s", "--format", "orbax", "--recipe", "scanned").code == 0
    (tmp_path / "s" / "config.json").unlink()
    os.mkfifo(tmp_path / "s" / "config.json")
    assert_clean_error(cli("convert", tmp_path / "s", tmp_path / "back", "--recipe", "scanned", "--reverse"),
                       "config.json")
    assert not (tmp_path / "back").exists()
