"""Issue 43, item 3: block-quantized Hugging Face checkpoints read as the weights they are.
FP8 with 128x128 block scales (as DeepSeek-V3 and Qwen3-FP8 ship: ``weight_scale_inv``)
and MXFP4 (as gpt-oss ships: ``_blocks`` and ``_scales``), in tiny models made here in
those shapes; transformers (its fine-grained FP8 and MXFP4 integrations, ``dequantize=True``)
is the oracle for the values, bit for bit."""

from __future__ import annotations

import json
import warnings

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402  (torch's, for float8 tensors)

FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}


def _fp8_model(directory, seed=0, scale_fmt=None):
    """A tiny Llama whose projections are FP8 in 128x128 blocks, as DeepSeek-V3's are: each
    block's scale its largest magnitude over 448 (E4M3's largest)."""
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    tensors = {}
    for name, weight in model.state_dict().items():
        if not name.endswith("proj.weight"):
            tensors[name] = weight.contiguous()
            continue
        rows, cols = weight.shape
        blocks = weight.float().reshape(rows // 128, 128, cols // 128, 128)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        if scale_fmt == "ue8m0":  # (DeepSeek-V3.1's: each scale a power of two)
            scale = torch.pow(2.0, torch.ceil(torch.log2(scale)))
        tensors[name] = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = scale.float().contiguous()
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    quantization = {**FP8_CONFIG, **({"scale_fmt": scale_fmt} if scale_fmt else {})}
    settings = {**config.to_dict(), "dtype": "bfloat16", "quantization_config": quantization}
    (directory / "config.json").write_text(json.dumps(settings))
    return directory


def _mxfp4_model(directory):
    """A tiny gpt-oss whose experts are MXFP4, as gpt-oss's are: random FP4 pairs, exponents
    about 2^0."""
    config = transformers.GptOssConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                       num_experts_per_tok=2, max_position_embeddings=64,
                                       layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).to(torch.bfloat16)
    rng = np.random.default_rng(0)
    tensors = {}
    for name, weight in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, inputs, outputs = weight.shape
            tensors[name + "_blocks"] = torch.tensor(rng.integers(0, 256, (experts, outputs, inputs // 32, 16),
                                                                  dtype=np.uint8))
            tensors[name + "_scales"] = torch.tensor(rng.integers(118, 130, (experts, outputs, inputs // 32),
                                                                  dtype=np.uint8))
        else:
            tensors[name] = weight.contiguous()
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    settings = {**config.to_dict(), "dtype": "bfloat16", "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}}
    (directory / "config.json").write_text(json.dumps(settings))
    return directory


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    return _fp8_model(tmp_path_factory.mktemp("fp8") / "model")


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    return _mxfp4_model(tmp_path_factory.mktemp("mxfp4") / "model")


def _dequantized_by_transformers(directory, config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, quantization_config=config)
    return {name: value.float().numpy() for name, value in model.state_dict().items()}


def _flat(tree):
    from treecli import _tree

    return {".".join(map(str, keypath)): np.asarray(leaf) for keypath, leaf in _tree.flatten(tree)}


def _same_bits(ours, theirs):
    return ours.shape == theirs.shape and np.array_equal(ours.astype(np.float32).view(np.uint32),
                                                          theirs.view(np.uint32))


@pytest.mark.parametrize("scheme", ["fp8", "mxfp4"])
def test_block_scaled_weights_read_as_transformers_dequantizes_them(fp8, mxfp4, scheme):
    import treecli

    directory = fp8 if scheme == "fp8" else mxfp4
    config = transformers.FineGrainedFP8Config(dequantize=True) if scheme == "fp8" else \
        transformers.Mxfp4Config(dequantize=True)
    expected = _dequantized_by_transformers(directory, config)
    ours = _flat(treecli.load(directory))
    assert sorted(ours) == sorted(expected)  # (no scales, blocks or scale_inv left beside the weights)
    for name, values in expected.items():
        assert ours[name].dtype == ml_dtypes.bfloat16 and _same_bits(ours[name], values), name


def test_show_names_the_scheme_and_the_logical_dtype(cli, fp8, mxfp4):
    result = cli("show", fp8, "--json")
    assert result.code == 0, result.stderr
    leaves = {leaf["keypath"]: leaf for leaf in json.loads(result.stdout)["leaves"]}
    down = leaves["model.layers.0.mlp.down_proj.weight"]
    assert down["dtype"] == "bfloat16" and down["stored_dtype"] == "FP8 128x128"
    assert down["stored_nbytes"] == 256 * 384 + 2 * 3 * 4  # (the FP8 bytes and the float32 scales)
    assert "model.layers.0.mlp.down_proj.weight_scale_inv" not in leaves
    text = cli("show", fp8).stdout
    assert "FP8 128x128" in text and "bfloat16" in text
    gpt_oss = {leaf["keypath"]: leaf for leaf in json.loads(cli("show", mxfp4, "--json").stdout)["leaves"]}
    experts = gpt_oss["model.layers.0.mlp.experts.gate_up_proj"]
    assert experts["stored_dtype"] == "MXFP4" and experts["shape"] == [4, 64, 192]


def test_a_copy_keeps_the_blocks_and_a_cast_writes_plain_weights_transformers_loads(cli, fp8, tmp_path):
    copy = cli("convert", fp8, tmp_path / "copy")
    assert copy.code == 0 and "bit-exact" in copy.stderr, copy.stderr
    with safe_open(fp8 / "model.safetensors", "np") as a, safe_open(tmp_path / "copy" / "model.safetensors", "np") as b:
        assert sorted(a.keys()) == sorted(b.keys())
    copied = json.loads((tmp_path / "copy" / "config.json").read_text())
    assert copied["quantization_config"] == FP8_CONFIG and copied["dtype"] == "bfloat16"  # (not float8: storage)
    plain = cli("convert", fp8, tmp_path / "plain", "--dtype", "bfloat16")
    assert plain.code == 0, plain.stderr
    assert "14 weights stored FP8 128x128 are written as plain values" in plain.stderr
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 2
    with safe_open(tmp_path / "plain" / "model.safetensors", "np") as f:
        assert not [k for k in f.keys() if k.endswith("_scale_inv")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    expected = _dequantized_by_transformers(fp8, transformers.FineGrainedFP8Config(dequantize=True))
    for name, value in loaded.state_dict().items():
        assert _same_bits(value.float().numpy(), expected[name]), name
    assert cli("diff", fp8, tmp_path / "plain").code == 0


def test_an_average_of_fp8_checkpoints_averages_their_values(cli, fp8, tmp_path):
    import treecli

    other = _fp8_model(tmp_path / "other", seed=1)
    result = cli("average", fp8, other, "-o", tmp_path / "mean", "--dtype", "float32")
    assert result.code == 0 and "14 weights stored FP8 128x128 are written as plain values" in result.stderr
    a, b, mean = _flat(treecli.load(fp8)), _flat(treecli.load(other)), _flat(treecli.load(tmp_path / "mean"))
    name = "model.layers.1.self_attn.q_proj.weight"
    np.testing.assert_allclose(mean[name], (a[name].astype(np.float32) + b[name].astype(np.float32)) / 2, rtol=1e-6)
    assert "quantization_config" not in json.loads((tmp_path / "mean" / "config.json").read_text())


def test_an_edit_of_an_fp8_weight_writes_it_fp8_again_as_transformers_quantizes(cli, fp8, tmp_path):
    """Item 4: a changed FP8 weight is quantized to FP8 again (transformers' Fp8Quantize, the
    oracle), every other weight keeps its blocks, and config.json its quantization_config."""
    import types

    import treecli
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    name = "model.layers.0.mlp.down_proj.weight"
    result = cli("edit", fp8, "-o", tmp_path / "edited", "--scale", f"{name}=2")
    assert result.code == 0, result.stderr
    assert "requantized to FP8 128x128: 1 weight whose values changed" in result.stderr
    doubled = torch.tensor(_flat(treecli.load(fp8))[name].astype(np.float32) * 2).to(torch.bfloat16)
    quantizer = Fp8Quantize(types.SimpleNamespace(quantization_config=transformers.FineGrainedFP8Config()))
    expected = quantizer._quantize_one(name, doubled)
    with safe_open(tmp_path / "edited" / "model.safetensors", "pt") as f, \
            safe_open(fp8 / "model.safetensors", "pt") as original:
        for key in (name, name + "_scale_inv"):
            assert torch.equal(f.get_tensor(key).view(torch.uint8) if key == name else f.get_tensor(key),
                               expected[key].view(torch.uint8) if key == name else expected[key]), key
        other = "model.layers.1.mlp.up_proj.weight"
        assert torch.equal(f.get_tensor(other).view(torch.uint8), original.get_tensor(other).view(torch.uint8))
    assert json.loads((tmp_path / "edited" / "config.json").read_text())["quantization_config"] == FP8_CONFIG
    loaded = _dequantized_by_transformers(tmp_path / "edited", transformers.FineGrainedFP8Config(dequantize=True))
    assert _same_bits(_flat(treecli.load(tmp_path / "edited"))[name], loaded[name])


@pytest.mark.parametrize("edited", [False, True])
def test_an_fp8_output_records_the_root_hash_gives_it(cli, fp8, tmp_path, edited):
    """Issue 44: the record's root, taken from each stored tensor's digest as it was written
    (a weight and its scales: two tensors, one leaf), is what hashing the output gives."""
    import treecli

    args = ["edit", fp8, "-o", tmp_path / "out", "--scale", "model.layers.0.mlp.down_proj.weight=2"] if edited \
        else ["convert", fp8, tmp_path / "out"]
    assert cli(*args).code == 0
    record = json.loads(treecli.open(tmp_path / "out").metadata["treecli.record"])
    assert record["root"] == treecli.hash(tmp_path / "out").root
    assert (record["root"] == treecli.hash(fp8).root) == (not edited)
    assert record["inputs"] == [{"name": str(fp8), "root": treecli.hash(fp8).root}]


def test_a_changed_mxfp4_weight_writes_every_weight_plain_and_says_so(cli, mxfp4, tmp_path):
    import treecli

    name = "model.layers.0.mlp.experts.down_proj"
    result = cli("edit", mxfp4, "-o", tmp_path / "edited", "--scale", f"{name}=2")
    assert result.code == 0, result.stderr
    assert "4 weights stored MXFP4 are written as plain values; config.json without its quantization_config" \
        in result.stderr
    before, after = _flat(treecli.load(mxfp4)), _flat(treecli.load(tmp_path / "edited"))
    assert np.array_equal(after[name].astype(np.float32), before[name].astype(np.float32) * 2)
    other = "model.layers.1.mlp.experts.gate_up_proj"
    assert _same_bits(after[other], before[other].astype(np.float32))
    assert "quantization_config" not in json.loads((tmp_path / "edited" / "config.json").read_text())


def test_scales_that_do_not_fit_their_weight_leave_both_as_stored(cli, tmp_path):
    """A scale grid that is not the weight's (a hostile or foreign file): nothing is
    computed from it; both tensors read as the bytes they are."""
    weight = torch.zeros(256, 256).to(torch.float8_e4m3fn)
    save_file({"w.weight": weight, "w.weight_scale_inv": torch.ones(3, 5)}, str(tmp_path / "odd.safetensors"))
    result = cli("show", tmp_path / "odd.safetensors")
    assert result.code == 0 and "float8_e4m3fn" in result.stdout and "weight_scale_inv" in result.stdout
    save_file({"e_blocks": torch.zeros(2, 4, 2, 15, dtype=torch.uint8), "e_scales": torch.zeros(2, 4, 2, dtype=torch.uint8)},
              str(tmp_path / "odd_mx.safetensors"))
    assert "e_blocks" in cli("show", tmp_path / "odd_mx.safetensors").stdout


def test_a_broken_config_json_beside_fp8_weights_is_not_fatal(cli, fp8, tmp_path):
    import shutil

    shutil.copytree(fp8, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{not json")
    result = cli("show", tmp_path / "m")  # (the block size from the scales' grid)
    assert result.code == 0 and "FP8 128x128" in result.stdout, result.stderr
    broken = cli("convert", tmp_path / "m", tmp_path / "plain", "--dtype", "bfloat16")
    assert broken.code == 0, broken.stderr  # (config.json copied as it is: not JSON treecli can rewrite)
    assert (tmp_path / "plain" / "config.json").read_text() == "{not json"


def test_a_renamed_fp8_weight_keeps_its_blocks_under_its_new_name(cli, fp8, tmp_path):
    result = cli("edit", fp8, "-o", tmp_path / "renamed", "--rename",
                 "model.layers.0.mlp.down_proj.weight=model.layers.0.mlp.w2.kernel")
    assert result.code == 0, result.stderr
    with safe_open(tmp_path / "renamed" / "model.safetensors", "pt") as f, \
            safe_open(fp8 / "model.safetensors", "pt") as original:
        assert f.get_tensor("model.layers.0.mlp.w2.kernel").dtype == torch.float8_e4m3fn
        assert torch.equal(f.get_tensor("model.layers.0.mlp.w2.kernel_scale_inv"),
                           original.get_tensor("model.layers.0.mlp.down_proj.weight_scale_inv"))
        assert "model.layers.0.mlp.down_proj.weight_scale_inv" not in f.keys()


def test_a_ue8m0_checkpoint_s_changed_weight_gets_power_of_two_scales_as_transformers_gives(cli, tmp_path):
    import types

    import treecli
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    model = _fp8_model(tmp_path / "m", scale_fmt="ue8m0")
    name = "model.layers.1.self_attn.q_proj.weight"
    assert cli("edit", model, "-o", tmp_path / "e", "--scale", f"{name}=3").code == 0
    tripled = torch.tensor(_flat(treecli.load(model))[name].astype(np.float32) * 3).to(torch.bfloat16)
    quantizer = Fp8Quantize(types.SimpleNamespace(
        quantization_config=transformers.FineGrainedFP8Config(scale_fmt="ue8m0")))
    expected = quantizer._quantize_one(name, tripled)
    with safe_open(tmp_path / "e" / "model.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor(name).view(torch.uint8), expected[name].view(torch.uint8))
        scales = f.get_tensor(name + "_scale_inv")
        assert scales.dtype == torch.float32  # (as the checkpoint's were)
        assert torch.equal(scales, expected[name + "_scale_inv"].float())


def test_fp8_with_e8m0_byte_scales_reads_and_requantizes_in_bytes(cli, tmp_path):
    """MXFP8-style scales: uint8 E8M0 exponents (2^(byte - 127)), as transformers reads them."""
    import treecli

    rng = np.random.default_rng(0)
    weight = torch.tensor(rng.standard_normal((256, 256)).astype(np.float32)).to(torch.float8_e4m3fn)
    scales = torch.tensor(np.array([[126, 127], [128, 130]], np.uint8))
    directory = tmp_path / "m"
    directory.mkdir()
    save_file({"w.weight": weight, "w.weight_scale_inv": scales}, str(directory / "model.safetensors"))
    values = _flat(treecli.load(directory))["w.weight"].astype(np.float32)
    by_block = np.repeat(np.repeat(2.0 ** (scales.numpy().astype(np.float32) - 127), 128, 0), 128, 1)
    expected = (weight.float().numpy() * by_block).astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(values, expected)
    assert cli("edit", directory, "-o", tmp_path / "e", "--scale", "w.weight=2").code == 0
    with safe_open(tmp_path / "e" / "model.safetensors", "pt") as f:
        assert f.get_tensor("w.weight_scale_inv").dtype == torch.uint8
    doubled = _flat(treecli.load(tmp_path / "e"))["w.weight"].astype(np.float32)
    np.testing.assert_allclose(doubled, values * 2, rtol=1 / 8, atol=2 ** -6 * np.abs(values).max())


def test_mxfp4_values_read_in_any_chunks_are_the_whole_s(mxfp4):
    """A chunk reads only the groups it covers (memory of its own size): pieces of 1, 7, 33 and
    1,000 values, across experts, make the values read whole."""
    import treecli
    from treecli import _leaf

    leaf = _leaf.as_leaf(treecli.load(mxfp4)["model"]["layers"]["0"]["mlp"]["experts"]["gate_up_proj"])
    whole = np.asarray(leaf).reshape(-1)
    for step in (1, 7, 33, 1000):
        starts = range(0, leaf.size, max(step, leaf.size // 40))
        for start in starts:
            stop = min(leaf.size, start + step)
            assert np.array_equal(leaf.read_flat(start, stop).view(np.uint16), whole[start:stop].view(np.uint16))
    slab = leaf.size // leaf.shape[0]
    for boundary in range(slab, leaf.size, slab):  # (a chunk across two experts)
        piece = leaf.read_flat(boundary - 5, boundary + 70)
        assert np.array_equal(piece.view(np.uint16), whole[boundary - 5 : boundary + 70].view(np.uint16))
