import threading

import numpy as np
import pytest
from safetensors import deserialize
from safetensors.numpy import load_file, save_file

import treecli
from treecli._diff import diff

from .conftest import BF16, assert_clean_error, bits, snapshot


def _pair(tmp_path, change):
    a = {"m.w": np.arange(6, dtype=np.float32).reshape(2, 3), "m.b": np.zeros(2, BF16), "step": np.asarray(1)}
    b = dict(a)
    change(b)
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    return tmp_path / "a.safetensors", tmp_path / "b.safetensors"


def test_diff_equal_is_exit_0_and_different_is_exit_1(cli, tmp_path):
    a, b = _pair(tmp_path, lambda t: None)
    assert cli("diff", a, b).code == 0
    a, b = _pair(tmp_path, lambda t: t.update({"m.w": t["m.w"] + np.float32(0.5), "extra": np.ones(1)}))
    result = cli("diff", a, b, "--json")
    assert result.code == 1
    assert result.json == {"equal": False, "only_in_a": [], "only_in_b": ["extra"],
                           "changed": [{"keypath": "m.w", "a": "[2, 3] float32", "b": "[2, 3] float32",
                                        "max_abs_diff": 0.5, "max_rel_diff": 0.5 / 0.5}]}
    assert cli("diff", a, b, "--atol", "0.6", "--where", "m.**").code == 0


def test_diff_shape_dtype_changes_and_nan(tmp_path):
    x = {"w": np.array([np.nan, 1.0], np.float32), "v": np.zeros(2, np.float32), "s": np.zeros(3, np.float32)}
    y = {"w": np.array([np.nan, 1.0], np.float32), "v": np.zeros(2, np.float16), "s": np.zeros(4, np.float32)}
    result = diff(x, y, atol=0.0)
    assert [(c.keypath, c.a, c.b) for c in result.changed] == [("s", "[3] float32", "[4] float32"),
                                                               ("v", "[2] float32", "[2] float16")]
    neg = diff({"z": np.array([0.0], np.float32)}, {"z": np.array([-0.0], np.float32)})
    assert not neg.equal  # exact compares bytes: -0.0 differs
    assert diff({"z": np.array([0.0])}, {"z": np.array([-0.0])}, rtol=0.0).equal


def test_diff_of_files_names_shape_and_dtype_changes(cli, tmp_path):
    a, b = _pair(tmp_path, lambda t: t.update({"s": np.zeros(4, np.float32), "v": np.zeros(2, np.float16)}))
    save_file({**load_file(str(a)), "s": np.zeros(3, np.float32), "v": np.zeros(2, np.float32)}, str(a))
    result = cli("diff", a, b, "--json")
    assert result.code == 1
    assert [(c["keypath"], c["a"], c["b"]) for c in result.json["changed"]] == [
        ("s", "[3] float32", "[4] float32"), ("v", "[2] float32", "[2] float16")]


@pytest.mark.parametrize("dtype, size", [(np.uint8, 4 * 1024 * 1024 + 13), (BF16, 3), (np.float64, 2 * 1024 * 1024 + 1)])
def test_diff_finds_one_changed_byte_anywhere_in_files_of_many_chunks(tmp_path, dtype, size):
    """The byte comparison works in 8-byte words and chunks: a change in the last,
    odd byte of the last chunk still shows, with its size."""
    a = {"w": np.zeros(size, dtype)}
    save_file(a, str(tmp_path / "a.safetensors"))
    for position in (0, size - 1):
        b = {"w": np.zeros(size, dtype)}
        b["w"].view(np.uint8)[position * b["w"].itemsize + b["w"].itemsize - 1] = 1
        save_file(b, str(tmp_path / "b.safetensors"))
        result = diff(treecli.load(tmp_path / "a.safetensors"), treecli.load(tmp_path / "b.safetensors"))
        assert [c.keypath for c in result.changed] == ["w"], position
        assert result.changed[0].max_abs_diff > 0
    assert diff(treecli.load(tmp_path / "a.safetensors"), treecli.load(tmp_path / "a.safetensors")).equal


def test_diff_measures_every_chunk_that_differs_after_the_first(tmp_path):
    """Chunks are compared as bytes until one differs; from there on each is measured, so
    the largest difference, in a later chunk, is the one reported."""
    size = 4 * 1024 * 1024 + 7  # float32: four chunks and a bit
    a = np.zeros(size, np.float32)
    b = a.copy()
    b[[1024 * 1024 + 5, 3 * 1024 * 1024 + 9, size - 1]] = [0.5, 4.0, -2.0]
    save_file({"w": a}, str(tmp_path / "a.safetensors"))
    save_file({"w": b}, str(tmp_path / "b.safetensors"))
    counted = []
    result = diff(treecli.load(tmp_path / "a.safetensors"), treecli.load(tmp_path / "b.safetensors"),
                  progress=counted.append)
    assert [(c.keypath, c.max_abs_diff) for c in result.changed] == [("w", 4.0)]
    assert sum(counted) == 2 * a.nbytes  # each byte of both counted once on the progress bar


def test_diff_reads_both_files_at_once_and_a_failed_read_leaves_no_buffer_in_use(tmp_path, monkeypatch):
    """The two files' chunks are read side by side on two threads; when one read fails
    midway the error surfaces and the next diff, reusing the buffers, is still right."""
    from treecli._bytes import stream
    from treecli._bytes.local import FileReader

    size = 3 * 1024 * 1024 + 5  # float32: three chunks and a bit
    save_file({"w": np.arange(size, dtype=np.float32)}, str(tmp_path / "a.safetensors"))
    changed = np.arange(size, dtype=np.float32)
    changed[-1] += 1
    save_file({"w": changed}, str(tmp_path / "b.safetensors"))
    threads, calls, fail_at = set(), [], [4]
    original = FileReader.read_view

    def failing(self, view, offset):
        threads.add(threading.current_thread().name)
        calls.append(offset)
        if len(calls) in fail_at:
            raise OSError("disk went away")
        original(self, view, offset)

    monkeypatch.setattr(FileReader, "read_view", failing)
    a, b = treecli.load(tmp_path / "a.safetensors"), treecli.load(tmp_path / "b.safetensors")
    fail_at[0] = 0
    diff(a, b)
    spare = (len(stream._spare_raw), len(stream._spare_buffers))
    # midway through the byte comparison (8 reads), then in measuring the last chunk, which differs
    for fail_at[0] in (4, 10):
        calls.clear()
        with pytest.raises(OSError, match="disk went away"):
            diff(a, b)
        assert len(threads) == 2
        assert (len(stream._spare_raw), len(stream._spare_buffers)) == spare
    fail_at[0] = 0
    result = diff(a, b)
    assert [c.keypath for c in result.changed] == ["w"] and result.changed[0].max_abs_diff == 1.0


def test_a_diff_run_on_the_prefetch_thread_itself_finishes(tmp_path):
    """A comparison made inside a computed leaf's fill runs on the prefetch thread: it reads
    there in turn, rather than wait for a read queued behind itself."""
    from treecli._bytes import stream

    save_file({"w": np.arange(3 * 1024 * 1024, dtype=np.float32)}, str(tmp_path / "a.safetensors"))
    a = treecli.load(tmp_path / "a.safetensors")
    assert stream._pool("prefetch").submit(lambda: diff(a, a).equal).result(timeout=60)


def test_convert_safetensors_to_orbax_and_back_verifies_bit_exactness(cli, mixed_file, tmp_path):
    pytest.importorskip("orbax.checkpoint")
    path, tensors = mixed_file
    orbax_dir = tmp_path / "orbax"
    result = cli("convert", path, orbax_dir, "--format", "orbax", "--drop-unsupported")
    assert result.code == 0, result.stderr
    assert "verified" in result.stderr and "empty" in result.stderr  # the zero-size leaf was dropped
    back = tmp_path / "back.safetensors"
    assert cli("convert", orbax_dir, back).code == 0
    leaves = {".".join(map(str, kp)): leaf for kp, leaf in __import__("treecli._tree").
              _tree.flatten(treecli.load(back))}
    for name, array in tensors.items():
        if array.size:
            assert bits(leaves[name].read()) == bits(array), name


@pytest.mark.parametrize("target", ["out.safetensors", "out.npz"])
def test_convert_from_orbax_reads_each_array_once_and_checks_what_it_wrote(cli, tmp_path, monkeypatch, target):
    """An Orbax array is decompressed whole: verification checks the output against the
    digest of the bytes written instead of reading the source again, and still catches
    an output that changed before it was published."""
    pytest.importorskip("orbax.checkpoint")
    from treecli.formats import _verify
    from treecli.formats import orbax

    tree = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, BF16), "note": "kept by Orbax only"}
    treecli.save(tree, tmp_path / "ck", format="orbax")
    loads = []
    original = orbax.OrbaxLeaf.load
    monkeypatch.setattr(orbax.OrbaxLeaf, "load", lambda self: loads.append(self) or original(self))
    result = cli("convert", tmp_path / "ck", tmp_path / target, "--drop-unsupported")
    assert result.code == 0, result.stderr
    assert "verified" in result.stderr
    assert len(loads) == 2  # each array once: written, then checked by digest
    assert bits(treecli.load(tmp_path / target)["w"].read()) == bits(tree["w"])

    if target.endswith(".npz"):
        return  # a changed npz member fails its zip CRC-32 when read back: the safetensors case shows the digest
    check = _verify.Verifier.__call__

    def corrupt_then_check(self, path):
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF  # in the last array's bytes
        path.write_bytes(bytes(data))
        return check(self, path)

    monkeypatch.setattr(_verify.Verifier, "__call__", corrupt_then_check)
    result = cli("convert", tmp_path / "ck", tmp_path / "again.safetensors", "--drop-unsupported")
    assert result.code == 2 and "Traceback" not in result.stderr
    assert "treecli: error: " in result.stderr and "verification failed" in result.stderr
    assert "w: [3, 4] float32: the bytes written differ" in result.stderr
    assert not (tmp_path / "again.safetensors").exists()


def test_convert_refuses_what_the_target_cannot_hold(cli, tmp_path):
    pytest.importorskip("orbax.checkpoint")
    import orbax.checkpoint as ocp

    src = tmp_path / "ckpt"
    ocp.PyTreeCheckpointer().save(str(src), {"w": np.ones(2, np.float32), "name": "x", "none": None})
    before = snapshot(tmp_path)
    result = cli("convert", src, tmp_path / "o.safetensors")
    assert_clean_error(result, "cannot hold 1 leaf")  # None is an empty subtree: nothing to hold
    assert "name (str)" in result.stderr and "none" not in result.stderr
    assert snapshot(tmp_path) == before


def test_convert_dtype_casts_float_leaves(cli, mixed_file, tmp_path):
    path, _ = mixed_file
    out = tmp_path / "f16.safetensors"
    assert cli("convert", path, out, "--dtype", "float16").code == 0
    dtypes = {leaf["keypath"]: leaf["dtype"] for leaf in cli("show", out, "--json").json["leaves"]}
    assert dtypes["model.embed.weight"] == "float16" and dtypes["model.int8"] == "int8" and dtypes["step"] == "int64"


def test_get_prints_writes_npy_and_refuses_subtrees(cli, mixed_file, tmp_path):
    path, tensors = mixed_file
    printed = cli("get", path, "model.layers.0.attn.q.weight", "--json").json
    assert printed["shape"] == [4, 4] and np.allclose(printed["value"], tensors["model.layers.0.attn.q.weight"])
    assert cli("get", path, "step").stdout.splitlines()[-1] == str(2**40 + 3)
    out = tmp_path / "q.npy"
    assert cli("get", path, "model.layers.0.attn.q.weight", "-o", out).code == 0
    assert bits(np.load(out)) == bits(tensors["model.layers.0.attn.q.weight"])
    assert_clean_error(cli("get", path, "model.layers"), "is a subtree")
    assert_clean_error(cli("get", path, "model.embed.weight", "-o", tmp_path / "e.npy"), "cannot name bfloat16")
    assert_clean_error(cli("get", path, "model.embd"), "closest: model.embed")


WRITABLE = {"safetensors": "x.safetensors", "npz": "x.npz", "msgpack": "x.msgpack", "orbax": "x_orbax"}


@pytest.mark.parametrize("source", sorted(WRITABLE))
def test_round_trips_between_every_pair_of_writable_formats(cli, tmp_path, source):
    pytest.importorskip("orbax.checkpoint")  # every source converts to orbax too
    import ml_dtypes

    tree = {"enc": {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([1.5, -0.0], BF16)},
            "f8": np.array([0.5, -2], ml_dtypes.float8_e4m3fn), "ids": np.array([2**40, -1], np.int64),
            "mask": np.array([True, False]), "nan": np.array([np.nan], np.float16)}
    start = tmp_path / WRITABLE[source]
    treecli.save(tree, start, format=source)
    for target in sorted(set(WRITABLE) - {source}):
        out = tmp_path / f"from_{source}" / WRITABLE[target]
        out.parent.mkdir(exist_ok=True)
        result = cli("convert", start, out, "--format", target)
        assert result.code == 0, (source, target, result.stderr)
        assert "verified" in result.stderr
        assert cli("diff", start, out).code == 0, (source, target)


def test_get_of_a_large_leaf_reads_only_the_elements_it_prints(cli, tmp_path, monkeypatch):
    from treecli._bytes import local

    array = np.arange(2000 * 3000, dtype=np.float32).reshape(2000, 3000)
    save_file({"w": array}, str(tmp_path / "big.safetensors"))
    read = []
    original = local.FileReader.read_into

    def counting(self, buffer, offset):
        read.append(buffer.nbytes)
        return original(self, buffer, offset)

    monkeypatch.setattr(local.FileReader, "read_into", counting)
    result = cli("get", tmp_path / "big.safetensors", "w")
    with np.printoptions(threshold=200, edgeitems=3, linewidth=120):
        assert result.stdout.splitlines()[1:] == np.array2string(array).splitlines()
    assert 0 < sum(read) <= 4 * 3 * 3000 * 4  # the four corners' rows, not the leaf's 24 MB


def test_diff_statistics_over_infinities_and_nan_are_defined(cli, tmp_path):
    """Equal infinities are equal; the maxima are over finite pairs; non-finite mismatches are counted."""
    a = np.array([np.inf, -np.inf, np.nan, 1.0, 2.0, np.inf, np.nan], np.float32)
    b = np.array([np.inf, -np.inf, np.nan, 1.5, 2.0, 3.0, 4.0], np.float32)
    save_file({"w": a}, str(tmp_path / "a.safetensors"))
    save_file({"w": b}, str(tmp_path / "b.safetensors"))
    result = cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--json")
    assert result.code == 1
    [change] = result.json["changed"]
    assert change["max_abs_diff"] == 0.5 and change["max_rel_diff"] == 0.5 / 1.5
    assert change["nonfinite_mismatches"] == 2
    text = cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors").stdout
    assert "2 non-finite differ" in text and "nan" not in text
    same_infs = {"w": np.array([np.inf, 1.0], np.float32)}, {"w": np.array([np.inf, 1.5], np.float32)}
    save_file(same_infs[0], str(tmp_path / "c.safetensors"))
    save_file(same_infs[1], str(tmp_path / "d.safetensors"))
    [change] = cli("diff", tmp_path / "c.safetensors", tmp_path / "d.safetensors", "--json").json["changed"]
    assert change["max_abs_diff"] == 0.5 and "nonfinite_mismatches" not in change


def _layered(path):
    treecli.save({"model": {"layers": {"0": {"w": np.arange(4, dtype=np.float32).reshape(2, 2).astype(BF16),
                                             "b": np.ones(2, np.float32)},
                                       "1": {"w": np.full((2, 2), 3, BF16)}},
                            "norm": np.ones(2, np.float32)}}, path)


def test_get_writes_a_leaf_or_subtree_of_any_dtype_at_its_key_paths_to_any_format(cli, tmp_path):
    src = tmp_path / "m.safetensors"
    _layered(src)
    result = cli("get", src, "model.layers.0", "-o", tmp_path / "layer0.safetensors")
    assert result.code == 0, result.stderr
    names = {name: t["dtype"] for name, t in deserialize((tmp_path / "layer0.safetensors").read_bytes())}
    assert names == {"model.layers.0.w": "BF16", "model.layers.0.b": "F32"}
    assert cli("get", src, "model.layers.1.w", "-o", tmp_path / "w.npz").code == 0
    got = treecli.load(tmp_path / "w.npz")["model"]["layers"]["1"]["w"]
    assert np.asarray(got).dtype == BF16 and np.asarray(got).tobytes() == np.full((2, 2), 3, BF16).tobytes()
    # .npy cannot name bf16: the hint is the user's own command, with their path
    npy = cli("get", src, "model.layers.0.w", "-o", tmp_path / "w.npy")
    assert_clean_error(npy, "cannot name bfloat16", f"treecli get {src} model.layers.0.w -o w.safetensors")
    subtree = cli("get", src, "model.layers")
    assert_clean_error(subtree, f"treecli show {src} --where model.layers", "-o subtree.safetensors")
    assert "CKPT" not in npy.stderr + subtree.stderr


def test_convert_where_writes_only_the_subtrees_named(cli, tmp_path):
    src = tmp_path / "m.safetensors"
    _layered(src)
    result = cli("convert", src, tmp_path / "w.npz", "--where", "model.layers.*.w", "--where", "model.norm")
    assert result.code == 0 and "verified" in result.stderr, result.stderr
    written = treecli.load(tmp_path / "w.npz")
    assert sorted(written["model"]) == ["layers", "norm"] and sorted(written["model"]["layers"]["0"]) == ["w"]
    assert np.asarray(written["model"]["layers"]["1"]["w"]).dtype == BF16
    assert_clean_error(cli("convert", src, tmp_path / "x.npz", "--where", "model.layer.*"), "matches nothing",
                       "closest")
    assert not (tmp_path / "x.npz").exists()


def test_an_npy_output_of_a_checkpoint_names_the_user_s_checkpoint_in_its_hint(cli, tmp_path):
    src = tmp_path / "my model.safetensors"
    _layered(src)
    result = cli("convert", src, tmp_path / "all.npy")
    assert_clean_error(result, f"treecli get '{src}' KEYPATH -o leaf.npy")


def test_get_json_of_a_leaf_larger_than_memory_allows_is_refused_before_reading(cli, tmp_path, monkeypatch):
    from treecli import _memory

    src = tmp_path / "m.safetensors"
    save_file({"big": np.zeros((64, 1024), np.float32)}, str(src))
    monkeypatch.setattr(_memory, "available", lambda: 1 << 20)  # 1 MiB left: 64K elements need ~6 MiB
    result = cli("get", src, "big", "--json")
    assert_clean_error(result, "--json of 65,536 elements needs about", "-o leaf.npy")
    monkeypatch.setattr(_memory, "available", lambda: 1 << 30)
    fits = cli("get", src, "big", "--json")
    assert fits.code == 0 and len(fits.json["value"]) == 64
