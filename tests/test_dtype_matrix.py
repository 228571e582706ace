"""Every command and API function over every dtype treecli reads: a dependency release
that changes how a dtype is classified (ml_dtypes 0.6 made bf16 and fp8 kind 'V')
fails here, not in a user's hands."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import treecli
from treecli import _dtypes
from .conftest import assert_clean_error, bits

ML_FLOATS = ["bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e4m3b11fnuz", "float8_e5m2",
             "float8_e5m2fnuz", "float8_e8m0fnu", "float8_e3m4", "float8_e4m3", "float4_e2m1fn",
             "float6_e2m3fn", "float6_e3m2fn"]
PLAIN = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
         "float16", "float32", "float64", "complex64", "complex128"]
ML_INTS = ["int4", "uint4"]
DTYPES = [d for d in PLAIN + ML_FLOATS + ML_INTS if d in PLAIN or hasattr(ml_dtypes, d)]


def sample(dtype_name: str, shape: tuple[int, ...]) -> np.ndarray:
    dtype = _dtypes.numpy_dtype(dtype_name)
    n = int(np.prod(shape))
    values = (np.arange(n) % 4).astype(np.float64) * (0.5 if _dtypes.kind(dtype_name) == "f" else 1)
    if dtype_name == "bool":
        return (np.arange(n) % 2).astype(bool).reshape(shape)
    if dtype_name.startswith("float8_e8m0"):
        values = values + 1  # no zero, no sign in e8m0
    return values.astype(dtype).reshape(shape)


@pytest.fixture(scope="module")
def every_dtype(tmp_path_factory):
    """An npz (the format that holds them all) with each dtype as a matrix, a 0-d and an empty leaf."""
    tree = {}
    for d in DTYPES:
        tree[d] = {"m": sample(d, (30, 9)), "s": sample(d, ()), "e": sample(d, (0, 3))}
    path = tmp_path_factory.mktemp("dtypes") / "all.npz"
    treecli.save(tree, path)
    return path, tree


def test_kind_is_decided_by_name_for_every_dtype():
    assert {d: _dtypes.kind(d) for d in ["bool", "int4", "uint8", "bfloat16", "float8_e4m3fn", "complex64"]} == {
        "bool": "b", "int4": "i", "uint8": "u", "bfloat16": "f", "float8_e4m3fn": "f", "complex64": "c"}
    assert _dtypes.kind(np.dtype("V2")) == "V"


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_get_prints_and_jsons_every_dtype(cli, every_dtype, dtype_name):
    path, tree = every_dtype
    for leaf in ("m", "s", "e"):
        keypath = f"{dtype_name}.{leaf}"
        printed = cli("get", path, keypath)
        assert printed.code == 0, printed.stderr
        assert printed.stdout.startswith(keypath)
        document = cli("get", path, keypath, "--json")
        assert document.code == 0, document.stderr
        expected = tree[dtype_name][leaf]
        assert document.json["shape"] == list(expected.shape)
        pairs = _dtypes.kind(dtype_name) == "c"  # [real, imag]
        value = np.asarray(document.json["value"]).reshape(expected.shape + ((2,) if pairs else ()))
        if pairs:
            assert np.array_equal(value[..., 0] + 1j * value[..., 1], expected)
        else:
            assert np.array_equal(value, expected.astype(np.float64 if dtype_name != "bool" else bool))


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_every_command_takes_every_dtype(cli, every_dtype, dtype_name, tmp_path):
    path, tree = every_dtype
    where = f"{dtype_name}.**"
    for args in (["show", path, "--where", where, "--stats"], ["show", path, "--where", where, "--json"],
                 ["diff", path, path, "--where", where], ["diff", path, path, "--where", where, "--atol", "0.1"]):
        result = cli(*args)
        assert result.code == 0, (args, result.stderr)
        assert "internal error" not in result.stderr
    subset = tmp_path / "one.npz"
    treecli.save({k: np.asarray(v) for k, v in treecli.load(path)[dtype_name].items()}, subset)
    commands = [
        ["slice", subset, "--index", ":2", "-o", tmp_path / "s.npz"],
        ["average", subset, subset, "-o", tmp_path / "a.npz"],
        ["merge", subset, subset, "--method", "linear", "-o", tmp_path / "m.npz"],
        ["edit", subset, "--scale", "**=2", "--set", "m=1", "-o", tmp_path / "e.npz"],
        ["convert", subset, tmp_path / "c.msgpack"],
        ["convert", subset, tmp_path / "c.eqx"],
    ]
    for args in commands:
        result = cli(*args)
        assert "internal error" not in result.stderr, (args, result.stderr)
        assert result.code in (0, 2), (args, result.stderr)
        if result.code == 2:
            assert_clean_error(result)
    averaged = tmp_path / "a.npz"
    if averaged.exists():
        out = treecli.load(averaged)
        assert out["m"].dtype_name == dtype_name
        assert bits(np.asarray(out["m"])) == bits(tree[dtype_name]["m"])  # the mean of two equal inputs


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_api_functions_take_every_dtype(every_dtype, dtype_name):
    _, tree = every_dtype
    own = {k: np.asarray(v) for k, v in tree[dtype_name].items()}
    averaged, _ = treecli.average([own, own])
    assert bits(averaged["m"]) == bits(own["m"])
    merged, _ = treecli.merge([own, own], "linear")
    assert bits(merged["m"]) == bits(own["m"])
    sliced, _ = treecli.slice_tree(own, ["m=:2"])
    assert bits(sliced["m"]) == bits(own["m"][:2])
    assert treecli.diff(own, own).equal
    assert not treecli.diff(own, {**own, "m": own["m"][::-1].copy()}).equal
