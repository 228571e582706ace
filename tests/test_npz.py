import io
import shutil
import subprocess
import zipfile

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treecli
from treecli._errors import FormatError

from .conftest import BF16, assert_clean_error, bits, snapshot


def leaves_of(path):
    from treecli import _tree
    from treecli._keypath import format_keypath

    return {format_keypath(kp): leaf for kp, leaf in _tree.flatten(treecli.load(path))}


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_reads_numpy_written_npz_lazily_and_bit_exactly(tmp_path, save):
    arrays = {"params/dense/kernel": np.arange(12, dtype=np.float32).reshape(3, 4),
              "params/dense/bias": np.array([1, -2], ">i4"),  # big-endian
              "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
              "step": np.asarray(7, np.int64), "empty": np.zeros((0, 3), np.float16)}
    path = tmp_path / "a.npz"
    save(path, **arrays)
    leaves = leaves_of(path)
    assert set(leaves) == {"params.dense.kernel", "params.dense.bias", "fortran", "step", "empty"}
    for key, array in arrays.items():
        got = leaves[key.replace("/", ".")].read()
        assert got.shape == array.shape and np.array_equal(got, array), key
    assert leaves["params.dense.bias"].dtype_name == "int32"
    assert leaves["params.dense.kernel"].read((slice(1, 2),)).tolist() == [[4, 5, 6, 7]]


def test_treecli_npz_keeps_bf16_and_fp8_and_round_trips(tmp_path):
    tree = {"a": {"bf": np.array([1.5, -2], BF16), "f8": np.array([0.5, 448], ml_dtypes.float8_e4m3fn)},
            "i": np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max]), "nan": np.array([np.nan, -0.0])}
    first = treecli.save(tree, tmp_path / "x.npz")
    leaves = leaves_of(first)
    assert leaves["a.bf"].dtype_name == "bfloat16" and leaves["a.f8"].dtype_name == "float8_e4m3fn"
    for key, array in [("a.bf", tree["a"]["bf"]), ("a.f8", tree["a"]["f8"]), ("i", tree["i"]), ("nan", tree["nan"])]:
        assert bits(leaves[key].read()) == bits(array)
    second = treecli.save(treecli.load(first), tmp_path / "y.npz")
    assert first.read_bytes() == second.read_bytes()  # deterministic: two saves, same bytes
    assert np.load(first)["i"].tolist() == tree["i"].tolist()  # still an ordinary npz for NumPy


def test_void_members_from_elsewhere_are_shown_with_a_warning(tmp_path):
    path = tmp_path / "v.npz"
    np.savez(path, w=np.ones(3, BF16))
    with treecli.open(path) as ckpt:
        assert ckpt.tree["w"].dtype_name == "V2"
        assert "raw void dtypes" in ckpt.warnings[0]


def _zip(path, members):
    import warnings

    with warnings.catch_warnings(), zipfile.ZipFile(path, "w") as z:
        warnings.simplefilter("ignore")  # zipfile warns about the duplicate names we write on purpose
        for name, data in members:
            z.writestr(name, data)
    return path


def _npy(header: str, data: bytes = b"") -> bytes:
    text = header.encode("latin1")
    text += b" " * (-(len(text) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + data


def test_object_arrays_are_refused_and_never_unpickled(tmp_path, cli):
    sentinel = tmp_path / "SENTINEL"

    class Evil:
        def __reduce__(self):
            return (open, (str(sentinel), "w"))

    buffer = io.BytesIO()
    np.save(buffer, np.array([Evil()], dtype=object), allow_pickle=True)
    path = _zip(tmp_path / "evil.npz", [("w.npy", buffer.getvalue())])
    result = cli("show", path)
    assert_clean_error(result, "refused", "unpickles")
    assert not sentinel.exists()


@pytest.mark.parametrize(
    "members, fragment",
    [
        ([("w.npy", _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", b"\0" * 8)),
          ("w.npy", _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", b"\0" * 4))], "duplicate"),
        ([("w.npy", _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776,), }"))], "holds 0 bytes"),
        ([("w.npy", _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (18446744073709551616,), }"))],
         "bad shape"),
        ([("w.npy", _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': " + "1" * 20000 + "}"))],
         "too large"),
        ([("w.npy", b"not numpy at all")], "no .npy magic"),
        ([("w.npy", _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", b"\0" * 4))], "holds 4 bytes"),
    ],
)
def test_hostile_members_are_format_errors(tmp_path, members, fragment):
    path = _zip(tmp_path / "bad.npz", members)
    with pytest.raises(FormatError) as info:
        treecli.load(path)
    assert fragment in str(info.value)


def test_a_deflate_bomb_is_refused_before_allocation(tmp_path):
    bomb = _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (10,), }", b"\0" * 40) + b"\0" * (64 << 20)
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("w.npy", bomb)
    assert path.stat().st_size < 1 << 20
    with pytest.raises(FormatError, match="holds"):
        treecli.load(path)


def test_cli_npz_to_safetensors_and_back(cli, tmp_path):
    src = tmp_path / "a.npz"
    np.savez(src, **{"enc/w": np.ones((2, 2), np.float32), "enc/b": np.zeros(2, np.float32)})
    assert cli("convert", src, tmp_path / "a.safetensors").code == 0
    assert cli("convert", tmp_path / "a.safetensors", tmp_path / "b.npz").code == 0
    assert cli("diff", src, tmp_path / "b.npz").code == 0
    before = snapshot(tmp_path)
    assert_clean_error(cli("convert", tmp_path / "a.safetensors", tmp_path / "c.npz", "--dtype", "nope"),
                       "unknown dtype")
    assert snapshot(tmp_path) == before


def written_npz(path, tree):
    treecli.save(tree, path)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None  # every member's CRC-32 checks
        names = archive.namelist()
    with np.load(path) as loaded:
        return names, {name: loaded[name] for name in loaded.files}


def test_written_npz_is_a_zip_numpy_and_zipfile_read_with_every_crc_right(tmp_path):
    """treecli writes the zip itself (each CRC-32 taken on the reading thread): zipfile finds
    every member's CRC right, NumPy loads the arrays, and two saves give identical bytes."""
    tree = {"layer": {"w": np.arange(3 * 1024 * 1024 + 3, dtype=np.float32)}, "ünï": np.ones((2, 3), np.int64),
            "b": np.zeros(4, BF16), "empty": np.zeros((0, 3), np.float32)}
    names, loaded = written_npz(tmp_path / "a.npz", tree)
    assert sorted(names[:-1]) == ["b.npy", "empty.npy", "layer/w.npy", "ünï.npy"] and names[-1] == "__treecli__.json"
    assert bits(loaded["layer/w"]) == bits(tree["layer"]["w"]) and bits(loaded["ünï"]) == bits(tree["ünï"])
    assert loaded["empty"].shape == (0, 3)
    assert bits(treecli.load(tmp_path / "a.npz")["b"].read()) == bits(tree["b"])
    treecli.save(tree, tmp_path / "again.npz")
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "again.npz").read_bytes()


def test_zip64_records_are_written_where_sizes_offsets_and_the_count_need_them(tmp_path, monkeypatch):
    """The limits lowered so that small members take the zip64 path: large sizes, offsets
    past 2 GiB and more than 65,535 members read back through zipfile, NumPy and treecli."""
    from treecli.formats import _zip

    monkeypatch.setattr(_zip, "ZIP64_LIMIT", 200)
    monkeypatch.setattr(_zip, "COUNT_LIMIT", 2)
    tree = {f"m{i}": np.arange(40 + i, dtype=np.float64) for i in range(4)} | {"small": np.ones(2, np.int8)}
    names, loaded = written_npz(tmp_path / "z.npz", tree)
    with zipfile.ZipFile(tmp_path / "z.npz") as archive:
        sizes = {info.filename: info.file_size for info in archive.infolist()}
    assert sizes["m0.npy"] > 200 and sizes["small.npy"] < 200
    assert sorted(names) == sorted(f"{key}.npy" for key in tree)
    if shutil.which("unzip"):  # Info-ZIP reads the zip64 end records by their locator, which zipfile does not
        checked = subprocess.run(["unzip", "-t", str(tmp_path / "z.npz")], capture_output=True, text=True)
        assert checked.returncode == 0 and "No errors detected" in checked.stdout, checked.stdout + checked.stderr
    for key, array in tree.items():
        assert bits(loaded[key]) == bits(array)
        assert bits(treecli.load(tmp_path / "z.npz")[key].read()) == bits(array)


def test_a_key_too_long_for_a_zip_name_is_one_clear_error_before_anything_is_written(tmp_path, cli):
    from safetensors.numpy import save_file

    save_file({"a" * 70_000: np.ones(2, np.float32)}, str(tmp_path / "long.safetensors"))
    result = cli("convert", tmp_path / "long.safetensors", tmp_path / "out.npz")
    assert_clean_error(result, "65,535 bytes")
    assert not (tmp_path / "out.npz").exists()
    with pytest.raises(treecli.TreecliError, match="npz cannot hold this key"):
        treecli.save({"b" * 70_000: np.ones(2)}, tmp_path / "api.npz")


_NAMES = st.text(st.characters(codec="utf-8", exclude_characters="/\0"), min_size=1, max_size=12)
_DTYPES = st.sampled_from([np.float32, np.float64, np.int8, np.uint16, np.int64, np.bool_, BF16])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arrays=st.dictionaries(_NAMES, st.tuples(_DTYPES, st.integers(0, 300)), min_size=1, max_size=6),
       limit=st.sampled_from([None, 64, 1000]))
def test_any_tree_written_as_npz_reads_back_through_zipfile_and_numpy(tmp_path, monkeypatch, arrays, limit):
    """Whatever the names (any Unicode), dtypes and sizes, and with zip64 forced on at low
    limits, the archive's CRCs check and NumPy and treecli read back the same bytes."""
    from treecli.formats import _zip

    if limit is not None:
        monkeypatch.setattr(_zip, "ZIP64_LIMIT", limit)
        monkeypatch.setattr(_zip, "COUNT_LIMIT", 2)
    rng = np.random.default_rng(0)
    tree = {name: rng.integers(0, 255, n * np.dtype(dtype).itemsize, np.uint8).view(dtype)
            for name, (dtype, n) in arrays.items()}
    path = tmp_path / f"t{len(list(tmp_path.iterdir()))}.npz"
    names, loaded = written_npz(path, tree)
    assert sorted(n for n in names if n != "__treecli__.json") == sorted(f"{k}.npy" for k in tree)
    back = treecli.load(path)
    for name, array in tree.items():
        assert loaded[name].tobytes() == array.tobytes()
        assert bits(back[name].read()) == bits(array)
