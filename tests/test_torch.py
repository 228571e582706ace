"""PyTorch ``torch.save`` files read without torch and without running anything (issue
34, item 1). torch itself is the oracle: every leaf is compared bit for bit with
``torch.load(weights_only=True)``; treecli never imports it."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import treecli
from treecli import _tree
from treecli._keypath import format_keypath

from .conftest import assert_clean_error

torch = pytest.importorskip("torch")

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "uint16",
          "uint32", "uint64", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
          "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]


def tensor_bytes(t) -> bytes:
    """A tensor's elements in C order, as bytes (torch's own, for dtypes NumPy lacks)."""
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def leaves(tree) -> dict:
    return {format_keypath(kp): leaf for kp, leaf in _tree.flatten(tree)}


def every_dtype() -> dict:
    g = torch.Generator().manual_seed(0)
    out = {}
    for name in DTYPES:
        dtype = getattr(torch, name)
        base = torch.randn(3, 5, generator=g) * 4
        if name == "bool":
            out[name] = base > 0
        elif name.startswith(("int", "uint")):
            out[name] = base.abs().to(torch.int64).to(dtype)
        else:
            out[name] = base.to(dtype)
    return out


def views() -> dict:
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    return {"transposed": base.t(), "strided": base[1:5:2, ::3], "offset": base[2:], "expanded":
            torch.arange(3.0).expand(4, 3), "column": base[:, 5], "scalar": torch.tensor(2.5), "empty":
            torch.zeros(0, 4), "shares_a": base[0], "shares_b": base[3, 2:6]}


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_every_dtype_and_view_reads_as_torch_loads_it(tmp_path, legacy):
    state = {**(every_dtype() if not legacy else {k: v for k, v in every_dtype().items()
                                                    if k in ("float32", "float64", "float16", "bfloat16", "int8",
                                                             "int16", "int32", "int64", "uint8", "bool",
                                                             "complex64", "complex128")}), **views()}
    path = tmp_path / "weights.pt"  # the zip's folder is the stem, "weights/", not "archive/"
    torch.save(state, path, _use_new_zipfile_serialization=not legacy)
    if not legacy:
        assert any(n.startswith("weights/") for n in zipfile.ZipFile(path).namelist())
    expected = torch.load(path, weights_only=True)
    got = leaves(treecli.load(path))
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        leaf = got[name]
        assert leaf.dtype_name == str(tensor.dtype).removeprefix("torch."), name
        assert tuple(leaf.shape) == tuple(tensor.shape), name
        assert np.asarray(leaf).tobytes() == tensor_bytes(tensor), name
        if tensor.ndim >= 1 and tensor.shape[0] > 1:
            assert np.asarray(leaf[1:]).tobytes() == tensor_bytes(tensor[1:]), name  # a slice of a view


def test_a_training_checkpoint_is_a_tree_like_any_other(tmp_path, cli):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3,
                "config": {"lr": 1e-3, "name": "run"}}, path)
    shown = cli("show", path, "--json")
    assert shown.code == 0, shown.stderr
    rows = {row["keypath"]: row for row in shown.json["leaves"]}
    assert rows["model.0.weight"]["shape"] == [3, 4] and rows["model.0.weight"]["dtype"] == "float32"
    assert rows["optimizer.state.0.exp_avg"]["shape"] == [3, 4]
    assert rows["epoch"]["value"] == 3 and rows["config.name"]["value"] == "run"
    expected = torch.load(path, weights_only=True)
    got = leaves(treecli.load(path))
    assert np.asarray(got["optimizer.state.1.exp_avg_sq"]).tobytes() == \
        tensor_bytes(expected["optimizer"]["state"][1]["exp_avg_sq"])


@pytest.mark.parametrize("target", ["train.npz", "train.safetensors"])
def test_convert_keeps_the_numbers_a_format_holds_as_0d_arrays_as_the_api_does(tmp_path, cli, target):
    path = tmp_path / "train.pt"
    torch.save({"model": {"w": torch.ones(2, 3)}, "epoch": 3, "lr": 0.1, "betas": (0.9, 0.999), "name": "run"}, path)
    result = cli("convert", path, tmp_path / target, "--drop-unsupported")
    assert result.code == 0, result.stderr
    assert "dropped 1 leaf" in result.stderr and "name (str)" in result.stderr
    got = leaves(treecli.load(tmp_path / target))
    assert set(got) == {"model.w", "epoch", "lr", "betas.0", "betas.1"}
    assert np.asarray(got["epoch"]).dtype == np.int64 and int(np.asarray(got["epoch"])) == 3
    assert float(np.asarray(got["lr"])) == 0.1 and float(np.asarray(got["betas.1"])) == 0.999
    treecli.save(treecli.load(path), tmp_path / ("api_" + target), drop_unsupported=True)
    assert cli("diff", tmp_path / target, tmp_path / ("api_" + target)).code == 0  # one decision, both roads


def test_convert_to_safetensors_is_the_state_dict_safetensors_writes(tmp_path, cli):
    from safetensors.torch import save_file

    state = {f"model.layers.{i}.weight": torch.randn(8, 4).to(torch.bfloat16) for i in range(3)}
    state["model.norm.weight"] = torch.ones(4)
    torch.save(state, tmp_path / "pytorch_model.bin")
    save_file(state, tmp_path / "reference.safetensors")
    result = cli("convert", tmp_path / "pytorch_model.bin", tmp_path / "model.safetensors")
    assert result.code == 0, result.stderr
    assert cli("diff", tmp_path / "model.safetensors", tmp_path / "reference.safetensors").code == 0
    assert cli("diff", tmp_path / "pytorch_model.bin", tmp_path / "reference.safetensors").code == 0


def test_an_hf_directory_of_bin_shards_reads_through_its_index(tmp_path, cli):
    shards = {"pytorch_model-00001-of-00002.bin": {"model.embed.weight": torch.randn(10, 4)},
              "pytorch_model-00002-of-00002.bin": {"model.layers.0.w": torch.randn(4, 4), "lm_head.weight":
                                                   torch.randn(10, 4)}}
    model = tmp_path / "model"
    model.mkdir()
    weight_map = {}
    for name, state in shards.items():
        torch.save(state, model / name)
        weight_map.update(dict.fromkeys(state, name))
    (model / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (model / "config.json").write_text("{}")
    got = leaves(treecli.load(model))
    for state in shards.values():
        for name, tensor in state.items():
            assert np.asarray(got[name]).tobytes() == tensor_bytes(tensor)
    out = tmp_path / "out"
    result = cli("convert", model, out)
    assert result.code == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    weight_map["lm_head.weight"] = "pytorch_model-00001-of-00002.bin"  # the index disagrees with the shards
    (model / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_clean_error(cli("show", model), "lm_head.weight", "index maps it to")


@pytest.mark.parametrize("dtype", DTYPES)
def test_written_files_load_in_torch_bit_for_bit(tmp_path, dtype):
    source = every_dtype()[dtype]
    array = np.frombuffer(tensor_bytes(source), treecli._dtypes.numpy_dtype(dtype)).reshape(tuple(source.shape))
    tree = {"model": {"w": array, "empty": array[:0]}, "step": 7, "lr": 0.5, "name": "run", "done": False}
    treecli.save(tree, tmp_path / "out.pt")
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    assert loaded["model.w"].dtype == source.dtype and tensor_bytes(loaded["model.w"]) == tensor_bytes(source)
    assert loaded["model.empty"].shape == (0, 5) and loaded["model.empty"].dtype == source.dtype
    assert (loaded["step"], loaded["lr"], loaded["name"], loaded["done"]) == (7, 0.5, "run", False)
    back = leaves(treecli.load(tmp_path / "out.pt"))  # and treecli reads what it wrote
    assert np.asarray(back["model.w"]).tobytes() == tensor_bytes(source) and back["step"] == 7


def test_convert_writes_bin_files_both_ways_verified(tmp_path, cli):
    state = {"model.embed.weight": torch.randn(16, 8).to(torch.bfloat16), "model.norm.weight": torch.ones(8)}
    from safetensors.torch import save_file

    save_file(state, tmp_path / "model.safetensors")
    result = cli("convert", tmp_path / "model.safetensors", tmp_path / "pytorch_model.bin")
    assert result.code == 0 and "verified" in result.stderr, result.stderr
    loaded = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert all(tensor_bytes(loaded[k]) == tensor_bytes(v) for k, v in state.items())
    assert cli("convert", tmp_path / "pytorch_model.bin", tmp_path / "again.safetensors").code == 0
    assert cli("diff", tmp_path / "again.safetensors", tmp_path / "model.safetensors").code == 0


def test_show_never_imports_torch(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    code = ("import sys; from treecli.cli import main; main(['show', sys.argv[1]]); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.pt")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# --- hostile files: one line each, nothing run ---------------------------------------------------


def torch_zip(path, pickled: bytes, storages: dict[str, bytes] = {}, folder: str = "archive") -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{folder}/data.pkl", pickled)
        z.writestr(f"{folder}/byteorder", "little")
        for key, data in storages.items():
            z.writestr(f"{folder}/data/{key}", data)


def real_pickle(state) -> tuple[bytes, dict[str, bytes]]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    z = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    return z.read("archive/data.pkl"), {n.rsplit("/", 1)[1]: z.read(n) for n in z.namelist() if "/data/" in n}


class Evil:
    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


@pytest.mark.parametrize("payload, fragment", [
    (pickle.dumps(Evil(__import__("os").system, "touch SENTINEL"), protocol=2), "names posix.system"),
    (pickle.dumps(Evil(eval, "open('SENTINEL', 'w')"), protocol=4), "names builtins.eval"),  # STACK_GLOBAL
    (b"\x80\x02cbuiltins\neval\nq\x00X\x01\x00\x00\x001\x85R.", "names builtins.eval"),
    (b"\x80\x02}q\x00(X\x01\x00\x00\x00a" + b"N" * 10 + b"u.", "SETITEMS on something"),
], ids=["GLOBAL os.system", "STACK_GLOBAL eval", "REDUCE eval", "odd SETITEMS"])
def test_globals_outside_the_allowlist_are_refused_by_name(tmp_path, cli, monkeypatch, payload, fragment):
    monkeypatch.chdir(tmp_path)
    torch_zip(tmp_path / "m.pt", payload)
    assert_clean_error(cli("show", tmp_path / "m.pt"), fragment)
    assert not (tmp_path / "SENTINEL").exists()


def test_storages_that_do_not_fit_are_one_line(tmp_path, cli):
    pickled, storages = real_pickle({"w": torch.arange(6.0)})
    torch_zip(tmp_path / "missing.pt", pickled)
    assert_clean_error(cli("show", tmp_path / "missing.pt"), "names storage '0', which the zip does not hold")
    torch_zip(tmp_path / "short.pt", pickled, {"0": storages["0"][:-4]})
    assert_clean_error(cli("show", tmp_path / "short.pt"), "w: storage '0' is named with 24 bytes, but holds 20")
    bigger = pickled.replace(b"K\x06\x85", b"K\x09\x85", 1)  # the view's size: 9 elements of a 6-element storage
    torch_zip(tmp_path / "past.pt", bigger, storages)
    assert_clean_error(cli("show", tmp_path / "past.pt"), "w: the tensor's elements run to byte")
    outside = pickled.replace(b"X\x01\x00\x00\x000", b"X\x01\x00\x00\x00/", 1)  # the storage key "/"
    torch_zip(tmp_path / "outside.pt", outside, storages)
    assert_clean_error(cli("show", tmp_path / "outside.pt"), "outside the archive")


@pytest.mark.parametrize("payload, fragment", [
    (b"\x80\x02" + b"N" * 30_000_000 + b".", "more than 20,000,000 values"),  # a stack bomb
    (b"\x80\x02]q\x00h\x00a" * 1 + b"h\x00a" * 200 + b".", "nested deeper"),  # a list holding itself
    (b"\x80\x02]" + b"r\xff\xff\xff\xff" + b".", None),  # a memo index of 2**32 - 1: a dict entry, not 32 GB
    (b"\x80\x02](" + b"h\x00" * 0 + b"]q\x00" + b"h\x00h\x00\x86q\x00" * 40 + b"e.", "more than 2,000,000 values"),
    (b"\x80\x02\x8b\xff\xff\xff\x7f.", "an integer of"),
], ids=["stack bomb", "cycle", "memo index", "exponential", "huge long"])
def test_pickle_bombs_are_refused_in_bounded_time_and_memory(tmp_path, payload, fragment):
    torch_zip(tmp_path / "bomb.pt", payload)
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
            "from treecli.cli import main; sys.exit(main(['show', sys.argv[1]]))")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "bomb.pt")], capture_output=True, text=True,
                            timeout=120)
    if fragment is None:
        assert result.returncode in (0, 2) and "Traceback" not in result.stderr, result.stderr
    else:
        assert result.returncode == 2 and fragment in result.stderr and "Traceback" not in result.stderr, \
            result.stderr[-500:]


@pytest.mark.parametrize("payload, fragment", [
    (b"\x80\x02cbuiltins\nbytearray\nJ\x00\x00\x00@\x85R.", "a bytearray of 1,073,741,824 bytes"),
    (b"\x80\x02}K\x01" + b"\x85" * 200_000 + b"K\x01s.", "tuples nested more than 1000 deep"),
    (b"\x80\x02(" + b"\x91(" * 0 + b"K\x01" + b"\x85" * 1001 + b"\x91.", "tuples nested more than 1000 deep"),
], ids=["bytearray(2**30)", "a dict key of tuples 200,000 deep", "a frozenset of deep tuples"])
def test_sizes_and_depths_a_small_pickle_asks_for_are_bounded_before_they_are_built(tmp_path, payload, fragment):
    torch_zip(tmp_path / "small.pt", payload)
    assert (tmp_path / "small.pt").stat().st_size < 300_000
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
            "from treecli.cli import main; sys.exit(main(['show', sys.argv[1]]))")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "small.pt")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and fragment in result.stderr and "Traceback" not in result.stderr, \
        (result.returncode, result.stderr[-500:])


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_legacy_streams_of_every_pickle_protocol_read_as_torch_loads_them(tmp_path, cli, protocol):
    state = {"w": torch.arange(6.0).reshape(2, 3), "h": torch.ones(3, dtype=torch.bfloat16), "name": "run"}
    path = tmp_path / "old.pt"
    torch.save(state, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    shown = cli("show", path, "--json")
    assert shown.code == 0 and shown.json["format"] == "torch", shown.stderr
    got = leaves(treecli.load(path))
    assert np.asarray(got["w"]).tobytes() == tensor_bytes(state["w"]) and got["name"] == "run"
    assert np.asarray(got["h"]).tobytes() == tensor_bytes(state["h"])


def test_settings_pickled_beside_tensors_are_named_unread_leaves_and_run_nothing(tmp_path, cli, monkeypatch):
    import argparse

    monkeypatch.chdir(tmp_path)
    state = {"model": {"w": torch.arange(4.0)}, "args": argparse.Namespace(lr=0.1, name="run"),
             "rng": np.random.get_state(), "table": np.ones(3)}
    torch.save(state, tmp_path / "train.pt")
    shown = cli("show", tmp_path / "train.pt", "--json")
    assert shown.code == 0, shown.stderr
    rows = {row["keypath"]: row for row in shown.json["leaves"]}
    assert rows["model.w"]["shape"] == [4] and rows["rng.0"]["value"] == "MT19937" \
        and rows["rng.2"]["value"] == state["rng"][2]
    assert rows["args"]["type"] == "unread" and rows["args"]["value"].startswith("<argparse.Namespace, not read")
    assert rows["table"]["value"].startswith("<numpy.ndarray, not read") and rows["rng.1"]["type"] == "unread"
    assert np.asarray(treecli.load(tmp_path / "train.pt")["model"]["w"]).tolist() == [0, 1, 2, 3]
    refused = cli("convert", tmp_path / "train.pt", tmp_path / "w.safetensors")
    assert_clean_error(refused, "cannot hold")
    assert "args (Unreadable)" in refused.stderr
    dropped = cli("convert", tmp_path / "train.pt", tmp_path / "w.safetensors", "--drop-unsupported")
    assert dropped.code == 0 and "args (Unreadable)" in dropped.stderr
    # a class of settings is never built, and a call outside the allowlist is still refused by name
    torch_zip(tmp_path / "evil.pt", pickle.dumps({"args": argparse.Namespace(), "x": Evil(os.system, "touch S")},
                                                 protocol=2))
    assert_clean_error(cli("show", tmp_path / "evil.pt"), "names posix.system")
    assert not (tmp_path / "S").exists()


def test_torch_s_raw_bit_packed_and_complex32_tensors_and_bare_storages(tmp_path, cli):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "ComplexHalf support is experimental"
        state = {"b8": torch.arange(4, dtype=torch.uint8).view(torch.bits8),
                 "b16": torch.arange(2, dtype=torch.int16).view(torch.bits16),
                 "fp4": torch.tensor([0x12, 0x34], dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
                 "c32": torch.zeros(2, dtype=torch.complex32), "w": torch.ones(2),
                 "storage": torch.arange(3, dtype=torch.int32).untyped_storage()}
        torch.save(state, tmp_path / "odd.pt")
    shown = cli("show", tmp_path / "odd.pt", "--json")
    assert shown.code == 0, shown.stderr
    rows = {row["keypath"]: row for row in shown.json["leaves"]}
    assert (rows["b8"]["dtype"], rows["b16"]["dtype"], rows["fp4"]["dtype"]) == ("uint8", "uint16", "uint8")
    assert "bits8 tensors read as the bytes torch stores, uint8" in shown.stderr
    assert "float4_e2m1fn_x2 tensors read as the bytes torch stores" in shown.stderr
    assert rows["c32"]["type"] == "unread" and "no NumPy dtype holds complex32" in rows["c32"]["value"]
    got = leaves(treecli.load(tmp_path / "odd.pt"))
    assert np.asarray(got["fp4"]).tobytes() == b"\x12\x34" and np.asarray(got["b8"]).tolist() == [0, 1, 2, 3]
    assert np.asarray(got["storage"]).tobytes() == np.arange(3, dtype="<i4").tobytes()  # a storage's bytes


def test_python_2_strings_decode_as_torch_decodes_them():
    from treecli.formats._unpickle import Unpickler

    def load(data: bytes):
        return Unpickler(data, file="f", allowed={}).load()[0]

    assert load(b"\x80\x02U\x02\xc3\xa9.") == "\u00e9"  # UTF-8, torch.load's encoding
    assert load(b"\x80\x02U\x01\xe9.") == b"\xe9"  # not UTF-8: the bytes, never mojibake


def test_a_legacy_stream_cut_short_is_one_line(tmp_path, cli):
    torch.save({"w": torch.arange(100.0)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    data = (tmp_path / "old.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[:-40])
    assert_clean_error(cli("show", tmp_path / "cut.pt"), "runs past the end of the file")
    (tmp_path / "head.pt").write_bytes(data[:60])
    assert_clean_error(cli("show", tmp_path / "head.pt"), "the pickle ends early")
    assert struct.unpack("<q", data[-408:-400])[0] == 100  # (the count before the storage, as treecli reads it)


def test_a_zip_bomb_and_members_outside_the_folder_are_one_line(tmp_path, cli):
    pickled, storages = real_pickle({"w": torch.arange(6.0)})
    with zipfile.ZipFile(tmp_path / "bomb.pt", "w", zipfile.ZIP_DEFLATED) as z:  # 1 GiB of pickle from 1 MB
        z.writestr("archive/data.pkl", b"\x80\x02" + b"N" * (1 << 30))
    assert_clean_error(cli("show", tmp_path / "bomb.pt"), "more than any checkpoint's pickle")
    with zipfile.ZipFile(tmp_path / "deflated.pt", "w", zipfile.ZIP_DEFLATED) as z:  # storages are stored, not deflated
        z.writestr("archive/data.pkl", pickled)
        z.writestr("archive/data/0", storages["0"])
    assert_clean_error(cli("show", tmp_path / "deflated.pt"), "storage '0' is compressed")
    torch_zip(tmp_path / "two.pt", pickled, storages)  # a second folder with a data.pkl: which is the checkpoint?
    with zipfile.ZipFile(tmp_path / "two.pt", "a") as z:
        z.writestr("other/data.pkl", pickled)
    assert_clean_error(cli("show", tmp_path / "two.pt"), "no single NAME/data.pkl")
    torch_zip(tmp_path / "nested.pt", pickled, storages, folder="a/b")  # data.pkl deeper than one folder
    assert_clean_error(cli("show", tmp_path / "nested.pt"))


def test_edit_in_place_slice_and_average_of_pytorch_files(tmp_path, cli):
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4, dtype=torch.bfloat16), "step": 3}
    torch.save(state, tmp_path / "m.pt")
    edited = cli("edit", tmp_path / "m.pt", "--in-place", "--scale", "w=2", "--rename", "b=bias")
    assert edited.code == 0, edited.stderr
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert loaded["w"].tolist() == (state["w"] * 2).tolist() and "bias" in loaded and loaded["step"] == 3
    assert cli("slice", tmp_path / "m.pt", "--index", "w=0", "-o", tmp_path / "row.pt").code == 0
    assert torch.load(tmp_path / "row.pt", weights_only=True)["w"].tolist() == [0.0, 2.0, 4.0, 6.0]
    result = cli("average", tmp_path / "m.pt", tmp_path / "m.pt", "-o", tmp_path / "avg.bin")
    assert result.code == 0, result.stderr
    assert torch.load(tmp_path / "avg.bin", weights_only=True)["w"].tolist() == (state["w"] * 2).tolist()


def test_key_paths_of_a_pytorch_file_complete(tmp_path):
    torch.save({"model.layers.0.w": torch.ones(2), "model.layers.1.w": torch.ones(2)}, tmp_path / "m.pt")
    env = {"_TREECLI_COMPLETE": "complete_bash", "COMP_WORDS": f"treecli get {tmp_path / 'm.pt'} model.l",
           "COMP_CWORD": "3"}
    result = subprocess.run([sys.executable, "-m", "treecli"], capture_output=True, text=True,
                            env={**os.environ, **env})
    assert result.stdout.split() == ["model.layers.0.", "model.layers.1."], result.stdout + result.stderr


def test_a_storage_stored_twice_or_past_the_end_of_the_zip_is_refused(tmp_path, cli):
    import warnings

    pickled, storages = real_pickle({"w": torch.arange(6.0)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile: "Duplicate name"
        with zipfile.ZipFile(tmp_path / "twice.pt", "w") as z:
            z.writestr("archive/data.pkl", pickled)
            z.writestr("archive/data/0", storages["0"])
            z.writestr("archive/data/0", b"\0" * len(storages["0"]))
    assert_clean_error(cli("show", tmp_path / "twice.pt"), "the zip holds member 'archive/data/0' twice")
    # a member whose directory entry claims 1 GiB that the file does not hold (torch refuses it)
    torch_zip(tmp_path / "short.pt", pickled, storages)
    data = bytearray((tmp_path / "short.pt").read_bytes())
    for at in range(len(data) - 46):
        if data[at:at + 4] == b"PK\x01\x02" and data[at + 46:at + 46 + 14] == b"archive/data/0":
            data[at + 20:at + 28] = struct.pack("<II", 1 << 30, 1 << 30)  # compressed and real sizes
    (tmp_path / "short.pt").write_bytes(bytes(data))
    with pytest.raises(Exception):
        torch.load(tmp_path / "short.pt", weights_only=True)
    result = cli("show", tmp_path / "short.pt")
    assert_clean_error(result, "storage '0' runs past the end of the zip")


def test_views_read_by_parts_and_an_expand_claiming_2_40_elements_shows(tmp_path, cli):
    base = torch.arange(24.0).reshape(4, 6)
    views = {"t": base.t(), "strided": torch.arange(10.0)[::3], "row": torch.arange(3.0).expand(2, 3),
             "huge": torch.ones(1).expand(2**20, 2**20)}
    torch.save(views, tmp_path / "views.pt")
    got = leaves(treecli.load(tmp_path / "views.pt"))
    for name in ("t", "strided", "row"):
        assert np.asarray(got[name]).tobytes() == views[name].contiguous().numpy().tobytes(), name
        flat = views[name].contiguous().numpy().reshape(-1)
        assert got[name].read_flat(1, flat.size - 1).tobytes() == flat[1:-1].tobytes(), name
    shown = cli("get", tmp_path / "views.pt", "huge")
    assert shown.code == 0 and shown.stdout.startswith("huge  [1048576, 1048576] float32"), shown.stderr
    assert np.asarray(got["huge"][5, 10:12]).tolist() == [1.0, 1.0]
