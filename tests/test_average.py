import ml_dtypes
import numpy as np
import pytest
from safetensors import deserialize
from safetensors.numpy import save_file

import treecli
from treecli._average import average
from treecli.cli._common import parse_weights
from treecli._errors import StructureError, UsageError

from .conftest import BF16, assert_clean_error, bits, snapshot


def materialize(tree):
    from treecli import _leaf, _tree

    return _tree.map_leaves(lambda kp, x: _leaf.as_leaf(x).read() if _leaf.is_array(x) else x, tree)


def reference(arrays, weights):
    """The float64 reference of DESIGN.md's accuracy oracle."""
    w = np.asarray(weights, np.float64) / np.sum(weights)
    return sum(wi * a.astype(np.float64) for wi, a in zip(w, arrays))


def ulp_distance(got, ref, dtype):
    """How many representable steps of ``dtype`` separate got from ref rounded to dtype."""
    rounded = ref.astype(dtype)
    as_int = {1: np.int8, 2: np.int16}[np.dtype(dtype).itemsize]
    a, b = got.view(as_int).astype(np.int64), rounded.view(as_int).astype(np.int64)
    # map sign-magnitude bit patterns onto a monotonic integer line
    top = 1 << (8 * np.dtype(dtype).itemsize - 1)
    a = np.where(a < 0, -(a + top), a)
    b = np.where(b < 0, -(b + top), b)
    return np.abs(a - b)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16, np.float64])
def test_accuracy_against_a_float64_reference(dtype):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((300, 70)).astype(dtype) * 10 for _ in range(3)]
    weights = [1.0, 2.0, 3.5]
    got = materialize(average([{"w": a} for a in arrays], weights)[0])["w"]
    assert got.dtype == np.dtype(dtype)
    ref = reference(arrays, weights)
    if dtype in (np.float32, np.float64):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    else:
        assert ulp_distance(got, ref, dtype).max() <= 1


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_leaves_computed_in_blocks_on_two_threads_match_the_reference(dtype):
    from treecli._combine import SUB_CHUNK

    rng = np.random.default_rng(2)
    size = 2 * SUB_CHUNK + 12345  # three blocks, the last one short
    arrays = [rng.standard_normal(size).astype(dtype) for _ in range(3)]
    got = materialize(average([{"w": a} for a in arrays], [1, 2, 3])[0])["w"]
    ref = reference(arrays, [1, 2, 3])
    if dtype is np.float32:
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    else:
        assert ulp_distance(got, ref, dtype).max() <= 1


def test_two_threads_fill_each_block_once_and_pass_on_an_error():
    import threading

    from treecli._bytes import stream

    out = np.zeros(1000, np.int64)
    calls, lock = [], threading.Lock()

    def fill(start, stop, part):
        part[:] = np.arange(start, stop)
        with lock:
            calls.append((start, stop))

    stream.on_two_threads(fill, 5, 1005, out, 64)
    assert (out == np.arange(5, 1005)).all()
    assert sorted(calls) == [(s, min(1005, s + 64)) for s in range(5, 1005, 64)]

    def failing(start, stop, part):
        if start == 5 + 3 * 64:
            raise ValueError("block 3 is bad")

    with pytest.raises(ValueError, match="block 3 is bad"):
        stream.on_two_threads(failing, 5, 1005, out, 64)

    # called from the helper thread itself (nested computed leaves), it runs inline instead of deadlocking
    nested = stream._pool("half").submit(stream.on_two_threads, fill, 5, 1005, out, 64)
    nested.result(timeout=30)


def test_fp16_values_near_the_maximum_do_not_overflow():
    arrays = [np.full(1000, 65504, np.float16), np.full(1000, 65504, np.float16), np.full(1000, 65000, np.float16)]
    got = materialize(average([{"w": a} for a in arrays])[0])["w"]
    assert np.isfinite(got).all() and got.dtype == np.float16


def test_bf16_subnormals_average_to_the_rounded_reference():
    tiny = np.array([1e-39, -2e-39, 5e-40], np.float32).astype(BF16)
    arrays = [tiny, tiny * 2, tiny * 3]
    got = materialize(average([{"w": a} for a in arrays])[0])["w"]
    assert ulp_distance(got, reference(arrays, [1, 1, 1]), BF16).max() <= 1


def test_integer_step_counters_are_copied_exactly_or_refused_when_they_differ():
    trees = [{"w": np.ones(2, np.float32), "step": np.asarray(2**40, np.int64), "flag": np.array([True]),
              "lr": 0.1, "name": "run"} for _ in range(3)]
    out = materialize(average(trees)[0])
    assert out["step"].dtype == np.int64 and int(out["step"]) == 2**40
    assert out["flag"].tolist() == [True] and out["lr"] == 0.1 and out["name"] == "run"
    trees[1] = dict(trees[1], step=np.asarray(200, np.int64), name="other")
    with pytest.raises(StructureError) as info:
        average(trees, names=["a", "b", "c"], non_float="error")
    assert info.value.details == ["name: 'run' in a; 'other' in b; 'run' in c",
                                  "step: 1099511627776 in a; 200 in b; 1099511627776 in c"]
    first = materialize(average(trees, non_float="first")[0])
    assert int(first["step"]) == 2**40 and first["name"] == "run"


def test_structure_mismatches_are_listed_diff_style_naming_inputs():
    a = {"w": np.zeros((1, 4), np.float32), "only_a": np.zeros(1, np.float32), "x": np.zeros(2, np.int32),
         "y": np.zeros(2, BF16)}
    b = {"w": np.zeros((3, 4), np.float32), "x": np.zeros(2, np.int64), "y": np.zeros(3, np.float32)}
    with pytest.raises(StructureError) as info:
        average([a, b], names=["a.st", "b.st"])
    assert info.value.details == [
        "only_a: only in a.st",
        "w: [1, 4] float32 in a.st; [3, 4] float32 in b.st",  # never broadcast
        "x: [2] int32 in a.st; [2] int64 in b.st",  # integers are copied, never promoted
        "y: [2] bfloat16 in a.st; [3] float32 in b.st",
    ]


@pytest.mark.parametrize("dtypes, promoted", [
    ((np.float32, BF16), "float32"), ((BF16, np.float16), "float32"), ((np.float16, np.float64), "float64"),
    ((ml_dtypes.float8_e4m3fn, BF16, BF16), "float32")])
def test_mixed_float_dtypes_promote_as_mergekit_and_dtype_says_otherwise(dtypes, promoted):
    rng = np.random.default_rng(5)
    trees = [{"w": rng.standard_normal((3, 5)).astype(d), "step": np.int64(7)} for d in dtypes]
    soup, report = average(trees, [1, 2, 3][: len(trees)])
    got = materialize(soup)
    want = reference([t["w"] for t in trees], [1, 2, 3][: len(trees)])
    assert got["w"].dtype == np.dtype(promoted) and got["step"] == 7
    assert np.allclose(got["w"].astype(np.float64), want, rtol=1e-6, atol=1e-7)
    assert report.notes() == [f"1 leaf of mixed float dtypes computed in {promoted} (as mergekit promotes them): w"]
    cast, _ = average(trees, [1, 2, 3][: len(trees)], dtype="bfloat16")
    assert materialize(cast)["w"].tobytes() == want.astype(BF16).tobytes()


def test_cli_average_and_merge_of_a_float32_base_and_a_bf16_fine_tune(cli, tmp_path):
    rng = np.random.default_rng(2)
    base = {"w": rng.standard_normal((4, 4)).astype(np.float32)}
    tuned = {"w": (base["w"] + 0.1).astype(BF16)}
    save_file(base, str(tmp_path / "base.safetensors"))
    save_file(tuned, str(tmp_path / "ft.safetensors"))
    want = (base["w"].astype(np.float64) + tuned["w"].astype(np.float64)) / 2
    for extra, dtype in (([], np.float32), (["--dtype", "bfloat16"], BF16)):
        out = tmp_path / f"avg{len(extra)}.safetensors"
        result = cli("average", tmp_path / "base.safetensors", tmp_path / "ft.safetensors", "-o", out, *extra)
        assert result.code == 0, result.stderr
        assert "computed in float32" in result.stderr
        got = deserialize(out.read_bytes())[0][1]
        assert got["dtype"] == {np.float32: "F32", BF16: "BF16"}[dtype]
        assert np.frombuffer(bytes(got["data"]), dtype).tobytes() == want.astype(dtype).tobytes()
    merged = tmp_path / "ties.safetensors"
    result = cli("merge", "--method", "task_arithmetic", "--base", tmp_path / "base.safetensors",
                 tmp_path / "ft.safetensors", "-o", merged, "--dtype", "bf16")
    assert result.code == 0, result.stderr
    got = deserialize(merged.read_bytes())[0][1]
    assert got["dtype"] == "BF16"
    task = base["w"].astype(np.float64) + (tuned["w"].astype(np.float64) - base["w"])
    assert np.frombuffer(bytes(got["data"]), BF16).tobytes() == task.astype(np.float32).astype(BF16).tobytes()
    assert_clean_error(cli("merge", "--method", "ties", "--base", tmp_path / "base.safetensors",
                           tmp_path / "ft.safetensors", "-o", tmp_path / "x.safetensors", "--dtype", "int8"),
                       "--dtype 'int8'", "float dtype")


def test_weights_normalize_count_and_task_arithmetic():
    base, ft = np.full(3, 1.0, np.float32), np.full(3, 4.0, np.float32)
    assert materialize(average([{"w": base}, {"w": ft}], [1, 3])[0])["w"].tolist() == [3.25] * 3
    delta = materialize(average([{"w": ft}, {"w": base}], [1, -1], normalize=False)[0])["w"]
    assert delta.tolist() == [3.0] * 3
    with pytest.raises(UsageError, match="sum to 0"):
        average([{"w": base}, {"w": ft}], [1, -1])
    with pytest.raises(UsageError, match="3 values for 2 inputs"):
        parse_weights("1,2,3", 2)
    with pytest.raises(UsageError, match="finite"):
        parse_weights("1,nan", 2)


def test_nonfinite_inputs_are_reported_with_key_path_input_and_count():
    a = {"a": {"w": np.array([1, np.nan, np.nan], np.float32)}, "b": {"w": np.array([np.inf, 1], np.float32)}}
    b = {"a": {"w": np.ones(3, np.float32)}, "b": {"w": np.ones(2, np.float32)}}
    tree, report = average([a, b], names=["x", "y"])
    materialize(tree)
    assert report.warnings() == ["a.w: 2 NaN and 0 Inf values in x", "b.w: 0 NaN and 1 Inf values in x"]


def test_zero_d_leaves_and_empty_trees():
    out = materialize(average([{"s": np.float32(1)}, {"s": np.float32(3)}])[0])
    assert out["s"].shape == () and float(out["s"]) == 2.0
    assert average([{}, {}])[0] == {}


def test_jax_arrays_in_memory_average_too():
    jnp = pytest.importorskip("jax.numpy")
    trees = [{"w": jnp.full((2, 2), v, dtype=jnp.bfloat16)} for v in (1.0, 2.0)]
    out = materialize(average(trees)[0])
    assert out["w"].dtype == BF16 and out["w"].tolist() == [[1.5, 1.5], [1.5, 1.5]]


def _write(path, tensors):
    save_file(tensors, str(path))
    return path


def test_cli_average_streams_to_a_file_bit_exact_with_the_reference(cli, tmp_path):
    rng = np.random.default_rng(1)
    inputs = []
    for i in range(3):
        inputs.append({"m.w": rng.standard_normal((64, 33)).astype(BF16),
                       "m.f8": rng.standard_normal(16).astype(ml_dtypes.float8_e4m3fn),
                       "step": np.asarray(10, np.int64)})
    paths = [_write(tmp_path / f"in{i}.safetensors", t) for i, t in enumerate(inputs)]
    result = cli("average", *paths, "--weights", "1,2,3", "-o", tmp_path / "soup.safetensors")
    assert result.code == 0, result.stderr
    raw = {n: t for n, t in deserialize((tmp_path / "soup.safetensors").read_bytes())}  # load_file cannot do fp8
    dtypes = {"BF16": BF16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "I64": np.int64}
    out = {n: np.frombuffer(bytes(t["data"]), dtypes[t["dtype"]]).reshape(t["shape"]) for n, t in raw.items()}
    assert out["m.f8"].dtype == ml_dtypes.float8_e4m3fn
    expected = reference([t["m.w"] for t in inputs], [1, 2, 3]).astype(np.float32)
    assert out["m.w"].dtype == BF16 and ulp_distance(out["m.w"], expected, BF16).max() <= 1
    assert out["step"] == 10 and out["step"].dtype == np.int64
    # the Python API on the same files gives the same bytes
    api, _ = average([treecli.load(p) for p in paths], [1, 2, 3])
    assert bits(materialize(api)["m"]["w"]) == bits(out["m.w"])


def test_cli_average_mismatch_is_one_error_and_writes_nothing(cli, tmp_path):
    a = _write(tmp_path / "a.safetensors", {"w": np.zeros((1, 4), np.float32)})
    b = _write(tmp_path / "b.safetensors", {"w": np.zeros((2, 4), np.float32), "extra": np.zeros(1, np.float32)})
    before = snapshot(tmp_path)
    result = cli("average", a, b, "-o", tmp_path / "out.safetensors")
    assert_clean_error(result, "differ in 2 leaves")
    assert result.stderr.splitlines()[1:] == [f"    extra: only in {b}", f"    w: [1, 4] float32 in {a}; [2, 4] float32 in {b}"]
    assert snapshot(tmp_path) == before
    assert_clean_error(cli("average", a, a, "--weights", "1,-1", "-o", tmp_path / "o.safetensors"), "sum to 0")
    assert_clean_error(cli("average", a, "-o", tmp_path / "o.safetensors"), "at least two")


def test_an_output_dtype_overflow_is_one_counted_warning_before_wrote(tmp_path):
    import subprocess
    import sys

    save_file({"w": np.array([80000.0, 1.0], np.float32)}, str(tmp_path / "a.safetensors"))
    save_file({"w": np.array([70000.0, 1.0], np.float32)}, str(tmp_path / "b.safetensors"))
    out = tmp_path / "c.safetensors"
    result = subprocess.run([sys.executable, "-m", "treecli", "average", tmp_path / "a.safetensors",
                             tmp_path / "b.safetensors", "-o", out, "--dtype", "float16"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == ["treecli: warning: w: non-finite values in the output: 1",
                                          f"treecli: wrote {out}"]


def test_any_library_warning_is_treecli_s_one_line(tmp_path, monkeypatch, capsys):
    import warnings

    from treecli import _summary
    from treecli.cli import main

    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "a.safetensors"))
    summarize = _summary.summarize

    def warning_summarize(*args, **kwargs):
        warnings.warn("a library's\nwarning", RuntimeWarning)
        return summarize(*args, **kwargs)

    monkeypatch.setattr(_summary, "summarize", warning_summarize)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main(["show", str(tmp_path / "a.safetensors")]) == 0
    assert capsys.readouterr().err.splitlines() == ["treecli: warning: a library's warning"]
