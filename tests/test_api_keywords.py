"""The Python API's keywords: unknown ones are Python's own TypeError (never swallowed),
and a CheckpointManager step's items are reached with ``item=`` (issue 31)."""

from __future__ import annotations

import numpy as np
import pytest

import treecli


@pytest.fixture
def tree():
    return {"w": np.ones(3, np.float32)}


@pytest.mark.parametrize("call", [
    lambda t, p: treecli.load(p, stepp=100), lambda t, p: treecli.load(p, lazzy=False),
    lambda t, p: treecli.open(p, stepp=1), lambda t, p: treecli.save(t, p, forse=True),
    lambda t, p: treecli.average([t, t], wieghts=[1, 2]), lambda t, p: treecli.merge([t, t], "linear", dencity=1),
    lambda t, p: treecli.diff(t, t, rtoll=1), lambda t, p: treecli.slice_tree(t, [], rulez=1),
])
def test_unknown_keywords_are_pythons_own_type_error(tree, tmp_path, call):
    path = tmp_path / "a.npz"
    treecli.save(tree, path)
    with pytest.raises(TypeError, match=r"\w+\(\) got an unexpected keyword argument '\w+'"):
        call(tree, path)


@pytest.fixture(scope="module")
def manager_root(tmp_path_factory):
    ocp = pytest.importorskip("orbax.checkpoint")
    root = tmp_path_factory.mktemp("runs") / "run"
    with ocp.CheckpointManager(str(root)) as manager:
        for step in (1, 2):
            manager.save(step, args=ocp.args.StandardSave({"params": {"w": np.full((2, 3), step, np.float32)},
                                                           "step": np.asarray(step, np.int64)}))
        manager.wait_until_finished()
    return root


def test_load_of_a_manager_root_with_a_template_takes_its_single_item(manager_root):
    jax = pytest.importorskip("jax")
    like = {"params": {"w": jax.ShapeDtypeStruct((2, 3), np.float32)}, "step": jax.ShapeDtypeStruct((), np.int64)}
    with jax.enable_x64(True):  # the int64 step stays int64 on the device
        state = treecli.load(manager_root, like=like)
        assert np.asarray(state["params"]["w"]).tolist() == [[2.0] * 3] * 2  # the latest step
        state = treecli.load(manager_root, like=like, step=1, item="default")
        assert np.asarray(state["params"]["w"]).tolist() == [[1.0] * 3] * 2
    with pytest.raises(treecli.UsageError, match="step: an int64 leaf would become int32"):
        treecli.load(manager_root, like=like)  # JAX without x64 would truncate it: refused, not changed


def test_item_selects_one_item_and_names_the_others_when_wrong(manager_root):
    assert set(treecli.load(manager_root, item="default")) == {"params", "step"}
    with treecli.open(manager_root, step=1, item="default") as checkpoint:
        assert np.asarray(checkpoint.tree["params"]["w"]).tolist() == [[1.0] * 3] * 2
    with pytest.raises(treecli.UsageError, match="no item 'state'; items: default"):
        treecli.load(manager_root, item="state")


def test_a_tree_that_does_not_fit_says_its_first_differences_in_the_message(manager_root):
    jax = pytest.importorskip("jax")
    like = {"params": {"w": jax.ShapeDtypeStruct((3, 3), np.float32), "b": jax.ShapeDtypeStruct((3,), np.float32)}}
    with pytest.raises(treecli.StructureError) as caught:
        treecli.load(manager_root, like=like)
    message = str(caught.value)
    assert "3 differences" in message
    assert "params.b: only in the template" in message and "params.w: [3, 3] float32 in the template" in message


@pytest.mark.parametrize("name", ["v.safetensors", "v.npz", "v.msgpack"])
def test_save_verify_reads_the_output_back_before_it_replaces_anything(tmp_path, monkeypatch, name):
    import ml_dtypes

    from treecli.formats import _verify

    checked = []
    real = _verify.Verifier.__call__
    monkeypatch.setattr(_verify.Verifier, "__call__", lambda self, path: (checked.append(path), real(self, path))[1])
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, ml_dtypes.bfloat16), "step": 7}
    out = treecli.save(tree, tmp_path / name, verify=True)
    assert len(checked) == 1 and checked[0] != out  # the temporary, before it was published
    back = treecli.load(out)
    assert np.asarray(back["w"]).tolist() == tree["w"].tolist() and int(np.asarray(back["step"])) == 7
    treecli.save(tree, tmp_path / ("plain_" + name))
    assert len(checked) == 1  # (not asked: not read back)


def test_save_verify_that_fails_publishes_nothing(tmp_path, monkeypatch):
    from treecli.formats.safetensors import SafetensorsFormat

    monkeypatch.setattr(SafetensorsFormat, "reference_problems", lambda self, path, written: ["w: the reference differs"])
    with pytest.raises(treecli.TreecliError, match="verification failed") as info:
        treecli.save({"w": np.ones(3, np.float32)}, tmp_path / "v.safetensors", verify=True)
    assert "w: the reference differs" in info.value.details and not list(tmp_path.iterdir())


def test_cast_and_quantize_are_convert_s_dtype_as_library_calls(tmp_path):
    """``treecli.cast`` and ``treecli.quantize`` are what ``convert --dtype`` runs: the
    same output bytes, and a JAX pytree comes back as its own type."""
    import ml_dtypes
    from gguf import GGUFReader
    from safetensors.numpy import load_file, save_file

    from treecli.cli import main

    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal((4, 64)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32),
               "step": np.array(7, np.int64)}
    save_file(weights, str(tmp_path / "m.safetensors"))

    half, report = treecli.cast(weights, "bf16")
    assert half["w"].dtype == ml_dtypes.bfloat16 and half["step"].dtype == np.int64 and not report.warnings()
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "h.safetensors"), "--dtype", "bf16",
                 "-q"]) == 0
    assert load_file(str(tmp_path / "h.safetensors"))["w"].tobytes() == half["w"].tobytes()
    huge, report = treecli.cast({"x": np.array([1e6], np.float32)}, "float16")
    assert np.isinf(huge["x"]).all() and "outside float16's range" in report.warnings()[0]

    quantized = treecli.quantize(treecli.load(tmp_path / "m.safetensors"), "q8_0")
    treecli.save(quantized, tmp_path / "api.gguf")
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "cli.gguf"), "--dtype", "q8_0",
                 "-q"]) == 0
    api, cli = ({t.name: (t.tensor_type.name, bytes(t.data)) for t in GGUFReader(tmp_path / name).tensors}
                for name in ("api.gguf", "cli.gguf"))
    assert api == cli and api["w"][0] == "Q8_0" and api["b"][0] == "F32"
    # read, a quantized leaf holds what a GGUF reader gets back
    assert np.asarray(quantized["w"]).tobytes() == np.asarray(treecli.load(tmp_path / "api.gguf")["w"]).tobytes()
    with pytest.raises(treecli.UsageError, match="cannot quantize to 'iq3_s'"):
        treecli.quantize(weights, "iq3_s")
