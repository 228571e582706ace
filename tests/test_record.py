"""Issue 44, item 3: every output treecli writes records where it came from, in the format's
own metadata (safetensors ``__metadata__``, GGUF keys, Orbax's custom metadata): its root
digest (what ``hash`` of it gives), the treecli version, the command in canonical form and
each input's root digest, with the history of the inputs' own making. ``show`` prints it,
``verify`` without AGAINST checks the weights against it, ``--no-record`` leaves it out."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import treecli

from .conftest import assert_clean_error


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    return {"model.embed.weight": rng.standard_normal((16, 8)).astype(np.float32),
            "model.layers.0.w": rng.standard_normal((8, 256)).astype(ml_dtypes.bfloat16),
            "model.layers.1.w": rng.standard_normal((8, 256)).astype(np.float32),
            "model.steps": np.arange(6, dtype=np.int64).reshape(2, 3)}


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_weights(), str(path), metadata={"format": "pt"})
    return path


def _record(cli, path):
    result = cli("show", path, "--json")
    assert result.code == 0, result.stderr
    return result.json["record"]


@pytest.mark.parametrize("target, options", [
    ("out.safetensors", []), ("out.gguf", []), ("hf_dir", ["--format", "safetensors", "--max-shard-size", "3000"]),
    ("orbax_dir", ["--format", "orbax"]), ("split", ["--format", "gguf", "--max-shard-size", "3000"]),
    ("q.gguf", ["--dtype", "q4_k_m"]), ("half.safetensors", ["--dtype", "float16"]),
])
def test_every_output_records_its_root_the_command_and_its_input(cli, model, tmp_path, target, options):
    result = cli("convert", model, tmp_path / target, *options)
    assert result.code == 0, result.stderr
    record = _record(cli, tmp_path / target)
    assert record["root"] == treecli.hash(tmp_path / target).root  # (what hash of the output gives)
    assert record["inputs"] == [{"name": str(model), "root": treecli.hash(model).root}]
    assert record["command"] == " ".join(["treecli", "convert", str(model), *options])  # (the output not named)
    assert record["treecli"] and record["history"] == []
    verified = cli("verify", tmp_path / target)
    assert verified.code == 0 and "verified" in verified.stderr and record["root"] in verified.stderr


def test_show_prints_the_record_and_a_format_without_metadata_says_it_has_none(cli, model, tmp_path):
    assert cli("convert", model, tmp_path / "out.safetensors", "--dtype", "bfloat16").code == 0
    shown = cli("show", tmp_path / "out.safetensors").stdout
    root = treecli.hash(tmp_path / "out.safetensors").root
    assert f"root        {root}" in shown
    assert f"command     treecli convert {model} --dtype bfloat16" in shown
    assert f"input       {model}  {treecli.hash(model).root}" in shown
    assert "treecli.record" not in shown  # (shown as the record, not as a line of raw metadata)
    assert load_file(tmp_path / "out.safetensors")  # (the reference still reads the file)
    assert cli("convert", model, tmp_path / "out.npz").code == 0
    assert "record: none (npz keeps no metadata to hold one)" in cli("show", tmp_path / "out.npz").stdout


def test_the_canonical_command_names_options_by_their_long_names_in_order(cli, model, tmp_path):
    out = tmp_path / "q.gguf"
    assert cli("convert", model, out, "--tensor-type", "layers.1=q8_0", "-f", "gguf", "--dtype", "q4_0",
               "--tensor-type", "layers.0=q4_1", "--force", "--no-verify").code == 0
    assert _record(cli, out)["command"] == (f"treecli convert {model} --dtype q4_0 --format gguf "
                                            "--tensor-type layers.1=q8_0 --tensor-type layers.0=q4_1")
    again = tmp_path / "elsewhere" / "other-name.gguf"
    assert cli("convert", model, again, "--tensor-type", "layers.1=q8_0", "--format", "gguf", "--dtype", "q4_0",
               "--tensor-type", "layers.0=q4_1").code == 0
    assert again.read_bytes() == out.read_bytes()  # (the same command writes the same bytes, wherever)


def test_each_input_of_an_average_is_recorded_and_history_follows_a_chain(cli, model, tmp_path):
    other = tmp_path / "other.safetensors"
    save_file(_weights(seed=1), str(other))
    step1, step2, final = tmp_path / "step1.gguf", tmp_path / "step2.safetensors", tmp_path / "final.safetensors"
    assert cli("convert", model, step1).code == 0
    assert cli("edit", step1, "-o", step2, "--scale", "model.embed.weight=2").code == 0
    assert cli("average", step2, other, "-o", final, "--weights", "1,3").code == 0
    record = _record(cli, final)
    assert record["inputs"] == [{"name": str(step2), "root": treecli.hash(step2).root},
                                {"name": str(other), "root": treecli.hash(other).root}]
    assert record["command"] == f"treecli average {step2} {other} --weights 1,3"
    assert [step["command"] for step in record["history"]] == [
        f"treecli convert {model}", f"treecli edit {step1} --scale model.embed.weight=2"]
    assert [step["root"] for step in record["history"]] == [treecli.hash(step1).root, treecli.hash(step2).root]
    assert record["history"][1]["inputs"] == [{"name": str(step1), "root": treecli.hash(step1).root}]
    assert cli("verify", final).code == 0


def test_an_edit_in_place_appends_to_the_history_and_records_the_weights_it_left(cli, model, tmp_path):
    path = tmp_path / "m.safetensors"
    assert cli("convert", model, path).code == 0
    before = treecli.hash(path).root
    assert cli("edit", path, "--in-place", "--scale", "model.layers.1.w=0.5").code == 0
    record = _record(cli, path)
    assert record["root"] == treecli.hash(path).root != before
    assert record["inputs"] == [{"name": str(path), "root": before}]
    assert [step["command"] for step in record["history"]] == [f"treecli convert {model}"]
    sharded = tmp_path / "sharded"
    assert cli("convert", model, sharded, "--format", "safetensors", "--max-shard-size", "3000").code == 0
    assert cli("edit", sharded, "--in-place", "--delete", "model.steps").code == 0
    record = _record(cli, sharded)
    assert record["root"] == treecli.hash(sharded).root and len(record["history"]) == 1
    assert cli("verify", sharded).code == 0


def test_no_record_leaves_it_out_and_drops_the_input_s(cli, model, tmp_path):
    recorded, plain = tmp_path / "recorded.safetensors", tmp_path / "plain.safetensors"
    assert cli("convert", model, recorded).code == 0
    assert cli("convert", recorded, plain, "--no-record").code == 0  # (the input's would describe other weights)
    metadata = treecli.open(plain).metadata
    assert "treecli.record" not in metadata and metadata["format"] == "pt"
    assert cli("edit", recorded, "-o", tmp_path / "q.gguf", "--no-record", "--scale", "**=2").code == 0
    assert "treecli.record" not in treecli.open(tmp_path / "q.gguf").metadata
    assert_clean_error(cli("verify", plain), "no record to verify against")


def _data_start(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n


def test_verify_without_against_finds_weights_changed_after_they_were_written(cli, model, tmp_path):
    out = tmp_path / "out.safetensors"
    assert cli("convert", model, out).code == 0
    data = bytearray(out.read_bytes())
    data[_data_start(out) + 100] ^= 0x10
    out.write_bytes(bytes(data))
    result = cli("verify", out)
    assert result.code == 1 and "the weights are not those their record names" in result.stderr
    assert f"recorded {_record(cli, out)['root']}" in result.stdout
    assert cli("verify", out, "--json").json["equal"] is False
    assert_clean_error(cli("verify", out, "--where", "model.**"), "--where needs AGAINST")


def _with_metadata(path, record_text):
    tensors = load_file(path)
    save_file(tensors, str(path), metadata={"treecli.record": record_text})


def test_a_hostile_record_is_escaped_when_shown_and_a_malformed_one_is_not_carried(cli, model, tmp_path):
    root = treecli.hash(model).root
    hostile = {"treecli": "0.1", "root": root, "command": "treecli convert \x1b[2J\x1b]0;pwned\x07 x",
               "inputs": [{"name": "a\x1b[31m", "root": root}], "history": []}
    _with_metadata(model, json.dumps(hostile))
    shown = cli("show", model)
    assert shown.code == 0 and "\x1b" not in shown.stdout and "\\x1b[2J" in shown.stdout
    assert cli("verify", model).code == 0  # (its root is the weights')
    assert cli("convert", model, tmp_path / "next.safetensors").code == 0
    assert _record(cli, tmp_path / "next.safetensors")["history"][0]["command"] == hostile["command"]
    step = {k: v for k, v in hostile.items() if k != "history"}
    for broken, why in [("{not json", "not JSON"), (json.dumps({**hostile, "root": "md5:00"}), "not of the form"),
                        (json.dumps({**hostile, "history": [{"x": 1}]}), "its history"),
                        ("[" * 200_000, "nested too deep"),
                        (json.dumps(hostile)[:-1] + ', "root": "' + root + '"}', "the key 'root' is given twice"),
                        (json.dumps({**hostile, "history": [step] * 101}), "its history"),
                        (json.dumps({**hostile, "inputs": hostile["inputs"] * 65}), "not of the form"),
                        (json.dumps({**hostile, "command": "x" * 4097}), "not of the form")]:
        _with_metadata(model, broken)
        assert f"treecli.record is not a record treecli wrote ({why}" in cli("show", model).stdout
        assert_clean_error(cli("verify", model), "no record to verify against", why)
        result = cli("convert", model, tmp_path / "again.safetensors", "--force")
        assert result.code == 0 and "not carried into the output's history" in result.stderr
        assert _record(cli, tmp_path / "again.safetensors")["history"] == []


def test_credentials_in_a_url_are_not_recorded():
    from treecli.cli._common import display_name

    assert display_name("https://user:secret@host:8443/m.safetensors?token=abc#x") == "https://host:8443/m.safetensors"
    assert display_name("hf://org/repo/model.safetensors") == "hf://org/repo/model.safetensors"


def test_the_api_records_a_save_and_verifies_against_it(tmp_path):
    tree = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(3, ml_dtypes.bfloat16)}
    treecli.save(tree, tmp_path / "a.safetensors")
    recorded = json.loads(treecli.open(tmp_path / "a.safetensors").metadata["treecli.record"])
    assert recorded["root"] == treecli.hash(tree).root and recorded["command"] == "treecli.save (Python)"
    assert treecli.verify(tmp_path / "a.safetensors").equal
    treecli.save(tree, tmp_path / "b.safetensors", record=False)
    assert "treecli.record" not in treecli.open(tmp_path / "b.safetensors").metadata
    with pytest.raises(treecli.UsageError, match="no record"):
        treecli.verify(tmp_path / "b.safetensors")
    treecli.save(tree, tmp_path / "o", format="orbax")
    assert treecli.verify(tmp_path / "o").equal
