import pickle
import zipfile

import msgpack
import numpy as np
import pytest

import treecli
from treecli._errors import FormatError

from .conftest import BF16, assert_clean_error, bits


def leaves_of(path):
    from treecli import _tree
    from treecli._keypath import format_keypath

    return {format_keypath(kp): leaf for kp, leaf in _tree.flatten(treecli.load(path))}


def test_flax_msgpack_reads_without_flax_and_round_trips_through_flax(tmp_path, cli):
    serialization = pytest.importorskip("flax.serialization")
    state = {"params": {"dense": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3),
                                  "bias": np.ones(3, BF16)}},
             "layers": [np.arange(2), np.arange(3)], "step": 5, "name": "run", "none": None}
    path = tmp_path / "state.msgpack"
    path.write_bytes(serialization.to_bytes(state))
    leaves = leaves_of(path)
    assert leaves["layers.0"].read().tolist() == [0, 1]  # a list stored as {"0": ..., "1": ...}
    assert leaves["params.dense.bias"].dtype_name == "bfloat16" and leaves["step"] == 5
    assert leaves["name"] == "run" and "none" not in leaves  # None: an empty subtree, as in JAX
    out = tmp_path / "out.msgpack"
    assert cli("edit", path, "--scale", "params.dense.kernel=2", "-o", out).code == 0
    restored = serialization.msgpack_restore(out.read_bytes())
    assert restored["params"]["dense"]["kernel"].tolist() == [[0, 2, 4], [6, 8, 10]]
    assert restored["params"]["dense"]["bias"].dtype == BF16 and restored["step"] == 5
    assert bits(np.asarray(restored["layers"]["1"])) == bits(np.arange(3))
    assert restored["none"] is None  # kept where it was by an edit of other leaves


def _ext(shape, dtype, buffer, code=1):
    return msgpack.ExtType(code, msgpack.packb((shape, dtype, buffer), use_bin_type=True))


@pytest.mark.parametrize(
    "payload, fragment",
    [
        ({"w": _ext([2], "O", b"\0" * 16)}, "not a numeric dtype"),
        ({"w": _ext([1], "V100", b"\0" * 100)}, "not a numeric dtype"),
        ({"w": _ext([4], "float32", b"\0" * 8)}, "needs 16 bytes"),
        ({"w": msgpack.ExtType(9, b"")}, "unknown msgpack extension"),
        ({"w": {"__msgpack_chunked_array__": True, "shape": {"0": 4}, "chunks": {}}}, "bad chunked array"),
        ({1: 1, "1": 2}, "mixed types"),
    ],
)
def test_hostile_msgpack_is_one_clear_error(tmp_path, payload, fragment):
    path = tmp_path / "bad.msgpack"
    path.write_bytes(msgpack.packb(payload, use_bin_type=True, strict_types=False))
    with pytest.raises(FormatError) as info:
        treecli.load(path)
    assert fragment in str(info.value)


def test_truncated_and_deep_msgpack(tmp_path, cli):
    good = msgpack.packb({"w": _ext([4], "float32", b"\0" * 16)}, use_bin_type=True)
    (tmp_path / "t.msgpack").write_bytes(good[:-5])
    assert_clean_error(cli("show", tmp_path / "t.msgpack"), "not valid msgpack")
    deep = b"\x81\xa1a" * 100_000 + b"\xc0"
    (tmp_path / "d.msgpack").write_bytes(deep)
    assert_clean_error(cli("show", tmp_path / "d.msgpack"))


def test_equinox_files_show_as_an_unnamed_sequence(tmp_path, cli):
    eqx = pytest.importorskip("equinox")
    import jax

    model = eqx.nn.MLP(2, 3, 4, 1, key=jax.random.PRNGKey(0))
    path = tmp_path / "model.eqx"
    eqx.tree_serialise_leaves(str(path), model)
    result = cli("show", path, "--json")
    assert [leaf["keypath"] for leaf in result.json["leaves"]] == ["0", "1", "2", "3"]
    assert [leaf["shape"] for leaf in result.json["leaves"]] == [[4, 2], [4], [3, 4], [3]]
    assert "without names" in result.stderr
    arrays = [x for x in jax.tree_util.tree_leaves(model) if eqx.is_array(x)]
    for leaf, array in zip(treecli.load(path), arrays):
        assert bits(leaf.read()) == bits(np.asarray(array))


def test_pickles_are_refused_by_their_bytes_and_never_run(tmp_path, cli):
    sentinel = tmp_path / "SENTINEL"

    class Evil:
        def __reduce__(self):
            return (open, (str(sentinel), "w"))

    payload = pickle.dumps(Evil(), protocol=4)
    for name in ("model.pt", "pytorch_model.bin", "state.pkl", "renamed.safetensors"):
        (tmp_path / name).write_bytes(payload)
        assert_clean_error(cli("show", tmp_path / name), "refused", "pickle")
    torch_zip = tmp_path / "archive.pt"
    with zipfile.ZipFile(torch_zip, "w") as z:
        z.writestr("archive/data.pkl", payload)
    # read as a torch.save zip: its pickle names a global outside the allowlist, refused by name
    assert_clean_error(cli("show", torch_zip), "refused: the pickle names ", "open, which is not among")
    assert not sentinel.exists()


def test_an_hf_flax_directory_is_a_checkpoint_with_its_companions(cli, tmp_path):
    import json

    import flax.serialization

    repo = tmp_path / "gpt2-flax"
    repo.mkdir()
    params = {"transformer": {"wte": {"embedding": np.arange(8, dtype=np.float32).reshape(4, 2)},
                              "h": {"0": {"ln_1": {"scale": np.ones(2, np.float32)}}}}}
    (repo / "flax_model.msgpack").write_bytes(flax.serialization.to_bytes(params))
    (repo / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    shown = cli("show", repo, "--json")
    assert shown.code == 0 and shown.json["format"] == "msgpack", shown.stderr
    assert {leaf["keypath"] for leaf in shown.json["leaves"]} == {"transformer.wte.embedding",
                                                                   "transformer.h.0.ln_1.scale"}
    result = cli("convert", repo, tmp_path / "out")
    assert result.code == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    assert cli("diff", repo, tmp_path / "out").code == 0
    assert_clean_error(cli("convert", repo, repo / "flax_model.msgpack", "--force"), "output is the input")
