"""Hostile and odd inputs (issue 14): terminal controls from files, special files,
bombs, what the references refuse, paths that leave a checkpoint, layouts the
libraries write, lying metadata, I/O faults and numbers."""

import json
import os
import re
import threading

import numpy as np
import pytest
from safetensors.numpy import save_file

from .conftest import assert_clean_error, run_cli

# Every character that may steer a terminal: C0 (but the newline ending a line),
# DEL, C1, bidi controls and isolates, line separators.
UNSAFE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")

HOSTILE = ["title\x1b]0;pwned\x07", "clear\x1b[2J\x1b[H", "link\x1b]8;;https://evil\x1b\\x\x1b]8;;\x1b\\",
           "csi\x9b31m", "bidi\u202etxt_exe", "iso\u2066x\u2069", "cr\rover", "del\x7f", "nl\nline"]


def assert_terminal_safe(result):
    for stream in (result.stdout, result.stderr):
        found = UNSAFE.findall(stream)
        assert not found, (found, stream[:2000])


@pytest.fixture
def hostile_file(tmp_path):
    path = tmp_path / "m.safetensors"
    tensors = {f"layer.{name}": np.full(2, i, np.float32) for i, name in enumerate(HOSTILE)}
    save_file(tensors, str(path), metadata={"note\x1b[31m": "red\x1b]0;x\x07", "bidi": "a\u202eb"})
    return path, tensors


@pytest.mark.parametrize("args", [["show"], ["show", "--flat"], ["show", "--stats"], ["show", "--depth", "1"]])
def test_names_and_metadata_from_a_file_never_reach_the_terminal_raw(hostile_file, args):
    path, tensors = hostile_file
    result = run_cli(*args[:1], path, *args[1:])
    assert result.code == 0, result.stderr
    assert_terminal_safe(result)
    if "--depth" not in args:
        assert re.search(r"\\(x1b|u001b)\]0;pwned", result.stdout) and "\\u202e" in result.stdout


def test_a_raw_control_among_thousands_of_lines_is_escaped_and_keeps_to_its_line(capsys):
    """Printed lines are checked for controls a batch at a time: one line holding them in a
    batch of safe ones still shows escaped, and its newline does not start a line of its own."""
    from treecli.cli._output import Output

    lines = [f"row {i}" for i in range(9000)]
    lines[5000:5000] = ["nl\nline", [("title\x1b]0;pwned\x07", "bold"), ("  ", "")]]
    Output().lines(lines)
    printed = capsys.readouterr().out.split("\n")
    assert printed[:-1] == lines[:5000] + ["nl\\x0aline", "title\\x1b]0;pwned\\x07"] + lines[5002:]
    assert printed[-1] == ""


def test_json_carries_hostile_names_exactly(hostile_file):
    path, tensors = hostile_file
    result = run_cli("show", path, "--json")
    assert_terminal_safe(result)
    document = json.loads(result.stdout)
    assert {leaf["keypath"] for leaf in document["leaves"]} == {
        __import__("treecli").format_keypath(("layer", name)) for name in HOSTILE}
    assert document["metadata"]["note\x1b[31m"] == "red\x1b]0;x\x07"
    assert document["metadata"]["bidi"] == "a\u202eb"


@pytest.mark.parametrize("name", ["del\x7f", "c1\x9b", "bidi\u202e"])
def test_json_of_a_file_whose_one_control_is_its_only_odd_character(tmp_path, name):
    """All ASCII but a DEL (or one C1 or bidi control): still escaped in the JSON."""
    path = tmp_path / "m.safetensors"
    save_file({name: np.ones(2, np.float32), "plain": np.zeros(1, np.float32)}, str(path))
    result = run_cli("show", path, "--json")
    assert_terminal_safe(result)
    assert {leaf["keypath"] for leaf in json.loads(result.stdout)["leaves"]} == {
        __import__("treecli").format_keypath((name,)), "plain"}


@pytest.mark.parametrize("code", [*range(0x20), 0x7F, 0x9B, 0x202E])
def test_show_of_a_file_whose_one_control_is_its_only_odd_character(tmp_path, capsys, code):
    """All printable ASCII but one control character, of every kind: escaped in the lines
    `show` prints to a pipe (an ASCII batch of lines is searched for each C0 control and DEL)."""
    from treecli.cli._output import Output

    lines = [f"row {i}" for i in range(100)] + [f"k{chr(code)}x"]
    Output().lines(lines)
    printed = capsys.readouterr().out
    assert chr(code) not in printed.replace("\n", "") or code == 0x0A
    assert printed.split("\n")[100] == (f"k\\x{code:02x}x" if code < 0x100 else f"k\\u{code:04x}x")
    path = tmp_path / "m.safetensors"
    save_file({f"k{chr(code)}x": np.ones(2, np.float32), "plain": np.zeros(1, np.float32)}, str(path))
    for flags in ([], ["--flat"]):
        result = run_cli("show", path, *flags)
        assert result.code == 0, result.stderr
        assert_terminal_safe(result)
        assert chr(code) not in result.stdout.replace("\n", "") or code == 0x0A
        assert any(line.startswith(('["k', "k")) and "[2]" in line for line in result.stdout.splitlines())


def test_escaped_key_paths_parse_back_to_the_same_leaf(hostile_file):
    path, tensors = hostile_file
    document = run_cli("show", path, "--json").json
    for leaf in document["leaves"]:
        result = run_cli("get", path, leaf["keypath"], "--json")
        assert result.code == 0, result.stderr
        assert_terminal_safe(result)


def test_error_lines_and_warnings_escape_file_and_key_names(tmp_path, hostile_file):
    path, _ = hostile_file
    result = run_cli("get", path, "layer.nomatch\x1b[2J")
    assert_clean_error(result)
    assert_terminal_safe(result)
    bad = tmp_path / "bad\x1b]0;x\x07.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    directory = tmp_path / "hf"
    directory.mkdir()
    save_file({"w": np.ones(2, np.float32)}, str(directory / "model-00001-of-00001.safetensors"))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    save_file({"x": np.ones(2, np.float32)}, str(directory / "stray\u202e\x1b[2J.safetensors"))
    for args in (["show", bad], ["show", directory], ["diff", bad, path]):
        result = run_cli(*args)
        assert_terminal_safe(result)
    assert "stray" in run_cli("show", directory).stderr


def test_a_hostile_header_value_in_an_error_message_is_escaped(tmp_path):
    path = tmp_path / "x.safetensors"
    header = json.dumps({"w\x1b]0;t\x07": {"dtype": "F\u202e32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    result = run_cli("show", path)
    assert_clean_error(result)
    assert_terminal_safe(result)


def test_terminal_lines_are_escaped_as_well(monkeypatch, capsys):
    from treecli.cli import _output

    monkeypatch.setattr(_output, "_isatty", lambda stream: True)
    out = _output.Output()
    assert not out.plain
    out.lines([[("key\x1b[2J", "bold"), ("  [2] float32", "")], "bidi\u202eexe"])
    out.warn("stray\x9b31m shard")
    captured = capsys.readouterr()
    assert "key\\x1b[2J" in captured.out and "bidi\\u202eexe" in captured.out
    assert "\x1b[2J" not in captured.out and "\u202e" not in captured.out
    assert captured.err == "treecli: warning: stray\\x9b31m shard\n"


# --- special files ----------------------------------------------------------------------------


def bounded(*args, seconds=30):
    """run_cli in a daemon thread: a hang fails the test instead of stalling the suite."""
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", run_cli(*args)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"treecli {args} still running after {seconds} s"
    return box["result"]


@pytest.mark.parametrize("name", ["w.safetensors", "w.npz", "w.msgpack", "w.eqx", "noext"])
def test_a_fifo_as_the_file_is_refused_at_once(tmp_path, name):
    fifo = tmp_path / name
    os.mkfifo(fifo)
    for args in (["show", fifo], ["show", fifo, "--format", "npz"], ["get", fifo, "x"]):
        result = bounded(*args)
        assert_clean_error(result, "FIFO")


@pytest.mark.parametrize("name", ["w.msgpack", "w.npz", "w.eqx", "w.safetensors"])
def test_dev_zero_behind_a_checkpoint_name_is_refused(tmp_path, name):
    link = tmp_path / name
    link.symlink_to("/dev/zero")
    result = bounded("show", link)
    assert_clean_error(result, "character device")


def test_a_fifo_as_an_hf_shard_or_index_is_refused(tmp_path):
    directory = tmp_path / "hf"
    directory.mkdir()
    save_file({"w": np.ones(2, np.float32)}, str(directory / "model-00001-of-00002.safetensors"))
    os.mkfifo(directory / "model-00002-of-00002.safetensors")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"}}))
    assert_clean_error(bounded("show", directory), "FIFO")
    (directory / "model.safetensors.index.json").unlink()
    os.mkfifo(directory / "model.safetensors.index.json")
    assert_clean_error(bounded("show", directory), "FIFO")


@pytest.mark.parametrize("member", ["_METADATA", "manifest.ocdbt", "_CHECKPOINT_METADATA"])
def test_a_fifo_inside_an_orbax_checkpoint_is_refused(tmp_path, member):
    ocp = pytest.importorskip("orbax.checkpoint")
    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(str(path), {"w": np.ones(3, np.float32)})
    (path / member).unlink()
    os.mkfifo(path / member)
    assert_clean_error(bounded("show", path), "FIFO")


# --- never accept what the reference refuses ----------------------------------------------------


def _st(header: str, data: bytes = b"") -> bytes:
    raw = header.encode("utf-8")
    return len(raw).to_bytes(8, "little") + raw + data


REFUSED_BY_THE_REFERENCE = {
    "shape overflows before a zero": _st(json.dumps({"w": {"dtype": "F32", "shape": [2**62, 2**62, 0],
                                                           "data_offsets": [0, 0]}})),
    "dimension past 64 bits beside a zero": _st(json.dumps({"w": {"dtype": "F32", "shape": [2**70, 0],
                                                                  "data_offsets": [0, 0]}})),
    "bytes overflow": _st(json.dumps({"w": {"dtype": "F64", "shape": [2**61], "data_offsets": [0, 0]}})),
    "lone surrogate in a key": _st('{"w\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
    "lone surrogate in metadata": _st('{"__metadata__":{"a":"\\udc00"},"w":{"dtype":"F32","shape":[1],'
                                      '"data_offsets":[0,4]}}', b"\0" * 4),
    "minus zero offset": _st('{"w":{"dtype":"F32","shape":[1],"data_offsets":[-0,4]}}', b"\0" * 4),
    "minus zero dimension": _st('{"w":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}'),
    "float dimension": _st('{"w":{"dtype":"F32","shape":[1e0],"data_offsets":[0,4]}}', b"\0" * 4),
    "thousands of digits": _st('{"w":{"dtype":"F32","shape":[' + "9" * 5000 + '],"data_offsets":[0,4]}}', b"\0" * 4),
}


@pytest.mark.parametrize("case", sorted(REFUSED_BY_THE_REFERENCE))
def test_what_the_reference_refuses_treecli_refuses_cleanly(tmp_path, case):
    from safetensors import SafetensorError, deserialize

    raw = REFUSED_BY_THE_REFERENCE[case]
    with pytest.raises(SafetensorError):
        deserialize(raw)
    path = tmp_path / "x.safetensors"
    path.write_bytes(raw)
    for args in (["show", path], ["convert", path, tmp_path / "o.npz"]):
        assert_clean_error(run_cli(*args))
    assert not (tmp_path / "o.npz").exists()


def test_minus_zero_inside_a_name_is_still_a_valid_file(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"block:-0": np.ones(1, np.float32), "a,-0": np.zeros(1, np.float32)}, str(path))
    result = run_cli("show", path, "--json")
    assert result.code == 0, result.stderr
    assert {leaf["keypath"] for leaf in result.json["leaves"]} == {"block:-0", "a,-0"}


# --- bombs: bounded memory, near-linear time, nothing deep recurses --------------------------------


def test_a_key_of_990_segments_is_shown_flat_and_works_everywhere(tmp_path):
    path = tmp_path / "deep.safetensors"
    key = ".".join(["s"] * 990)
    save_file({key: np.ones(2, np.float32), "b": np.zeros(1, np.float32)}, str(path))
    result = run_cli("show", path)
    assert result.code == 0, result.stderr
    assert "showing keys flat" in result.stderr
    for args in (["show", path, "--json"], ["diff", path, path], ["convert", path, tmp_path / "o.npz"],
                 ["edit", path, "--scale", "**=2", "-o", tmp_path / "o.safetensors"],
                 ["slice", path, "--index", "0", "-o", tmp_path / "s.safetensors"],
                 ["average", path, path, "-o", tmp_path / "a.safetensors"]):
        result = run_cli(*args)
        assert result.code == 0, (args, result.stderr)
    from safetensors.numpy import load_file

    assert load_file(str(tmp_path / "o.safetensors"))[key].tolist() == [2, 2]


def test_deeply_nested_msgpack_is_a_clean_error(tmp_path):
    import msgpack

    node = {"w": 1}
    for _ in range(990):
        node = {"a": node}
    path = tmp_path / "deep.msgpack"
    path.write_bytes(msgpack.packb(node))
    assert_clean_error(run_cli("show", path), "deeper")


def test_mixed_key_types_in_a_msgpack_map_inside_a_list_are_refused(tmp_path):
    import msgpack

    path = tmp_path / "m.msgpack"
    path.write_bytes(msgpack.packb({"layers": [{1: 1, "1": 2}]}, strict_types=False))
    assert_clean_error(run_cli("show", path), "mixed types")


def test_an_npz_of_80000_members_opens_in_linear_time(tmp_path):
    import io
    import time
    import zipfile

    buffer = io.BytesIO()
    np.save(buffer, np.zeros(1, np.float32))
    member = buffer.getvalue()
    path = tmp_path / "many.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for i in range(80_000):
            z.writestr(f"p{i}.npy", member)
    start = time.perf_counter()
    result = run_cli("show", path, "--json")
    assert result.code == 0, result.stderr
    assert result.json["num_leaves"] == 80_000
    assert time.perf_counter() - start < 60  # minutes when the duplicate check was quadratic


def test_an_orbax_array_named_outside_the_checkpoint_is_refused(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    path = tmp_path / "ckpt"
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False)
    ocp.Checkpointer(handler).save(str(path), {"w": np.arange(3, dtype=np.float32)})
    assert (path / "w").is_dir()
    secret = tmp_path / "secret"
    import shutil

    shutil.copytree(path / "w", secret)
    metadata = json.loads((path / "_METADATA").read_text())
    for entry in metadata["tree_metadata"].values():
        entry["key_metadata"][0]["key"] = str(secret)  # an absolute path
    (path / "_METADATA").write_text(json.dumps(metadata))
    for args in (["show", path], ["get", path, "w"], ["convert", path, tmp_path / "o.safetensors"]):
        result = run_cli(*args)
        assert_clean_error(result, "outside the checkpoint")
    assert not (tmp_path / "o.safetensors").exists()


# --- valid layouts the libraries write ---------------------------------------------------------


@pytest.mark.parametrize("options,names", [({"step_format_fixed_length": 8}, ["00000100", "00000200"]),
                                           ({"step_prefix": "checkpoint"}, ["checkpoint_100", "checkpoint_200"])])
def test_manager_roots_with_padded_or_prefixed_step_names(tmp_path, options, names):
    ocp = pytest.importorskip("orbax.checkpoint")
    root = tmp_path / "run"
    with ocp.CheckpointManager(str(root), options=ocp.CheckpointManagerOptions(**options)) as manager:
        for step in (100, 200):
            manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": np.full(2, step, np.float32)})))
        manager.wait_until_finished()
    assert sorted(p.name for p in root.iterdir()) == names
    result = run_cli("show", root)
    assert result.code == 0, result.stderr
    assert "steps: 100, 200" in result.stdout
    assert run_cli("get", root, "state.w", "--step", "100", "--json").json["value"] == [100, 100]
    assert run_cli("get", root, "state.w", "--json").json["value"] == [200, 200]


def test_the_layout_before_metadata_reads_as_orbax_restores_it(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    from flax import serialization

    path = tmp_path / "legacy"
    tree = {"params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, "step": 3}
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(str(path), tree)
    (path / "_METADATA").unlink()
    aggregate = {"params": {"w": "PLACEHOLDER://params.w"}, "step": 3}
    (path / "checkpoint").write_bytes(serialization.msgpack_serialize(aggregate))
    restored = ocp.PyTreeCheckpointer().restore(str(path))
    result = run_cli("get", path, "params.w", "--json")
    assert result.code == 0, result.stderr
    assert result.json["value"] == restored["params"]["w"].tolist()
    assert run_cli("get", path, "step", "--json").json["value"] == restored["step"]


def test_an_empty_safetensors_file_converts(tmp_path):
    from safetensors import deserialize

    path = tmp_path / "empty.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    for out in ("o.safetensors", "o.msgpack"):
        result = run_cli("convert", path, tmp_path / out)
        assert result.code == 0, result.stderr
    assert deserialize((tmp_path / "o.safetensors").read_bytes()) == []
    assert_clean_error(run_cli("convert", path, tmp_path / "o.npz"), "no arrays")


def test_an_npz_with_text_arrays_beside_the_weights(tmp_path):
    path = tmp_path / "t.npz"
    np.savez(path, w=np.ones(2, np.float32), names=np.array(["a", "bc"]), raw=np.array([b"x", b"yz"]))
    result = run_cli("show", path, "--json")
    assert result.code == 0, result.stderr
    assert [leaf["keypath"] for leaf in result.json["leaves"]] == ["w"]
    assert "names.npy" in result.stderr and "raw.npy" in result.stderr


def test_a_zip_without_npy_members_is_no_checkpoint(tmp_path):
    import zipfile

    path = tmp_path / "x.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("readme.txt", "hello")
    assert_clean_error(run_cli("show", path), "no arrays")


# --- format metadata that lies -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["object", "str", "<U4", "datetime64[s]"])
def test_treecli_npz_metadata_naming_a_non_numeric_dtype_is_refused(tmp_path, dtype):
    import zipfile

    path = tmp_path / "x.npz"
    np.savez(path, w=np.zeros(4, np.uint8).view("V4"))
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("__treecli__.json", json.dumps({"dtypes": {"w": dtype}}))
    assert_clean_error(run_cli("show", path), "not a numeric dtype")


# --- numbers ---------------------------------------------------------------------------------------


def test_huge_weights_are_normalized_without_overflow(tmp_path):
    from safetensors.numpy import load_file

    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"w": np.full(3, 2.0, np.float32)}, str(a))
    save_file({"w": np.full(3, 4.0, np.float32)}, str(b))
    result = run_cli("average", a, b, "--weights", "1e308,1e308", "-o", tmp_path / "o.safetensors")
    assert result.code == 0, result.stderr
    assert load_file(str(tmp_path / "o.safetensors"))["w"].tolist() == [3, 3, 3]


@pytest.mark.parametrize("factor", ["inf", "-inf", "nan", "1e999"])
def test_a_non_finite_scale_is_refused(tmp_path, factor):
    path = tmp_path / "a.safetensors"
    save_file({"w": np.ones(3, np.float32)}, str(path))
    assert_clean_error(run_cli("edit", path, "--scale", f"w={factor}", "-o", tmp_path / "o.safetensors"), "finite")
    assert not (tmp_path / "o.safetensors").exists()


def test_set_from_an_npz_is_a_clean_error(tmp_path):
    path = tmp_path / "a.safetensors"
    save_file({"w": np.ones(3, np.float32)}, str(path))
    np.savez(tmp_path / "v.npz", w=np.zeros(3, np.float32))
    result = run_cli("edit", path, "--set", f"w=@{tmp_path / 'v.npz'}", "-o", tmp_path / "o.safetensors")
    assert_clean_error(result, "npz")


# --- I/O faults named right ------------------------------------------------------------------------


@pytest.mark.parametrize("failing", ["input", "output"])
def test_eio_while_reading_names_the_file_and_the_read(tmp_path, monkeypatch, failing):
    """A failing read of the input, or of a verified output read back as it is written:
    one line naming that file and the read, nothing written."""
    import errno

    src = tmp_path / "in.safetensors"
    save_file({"w": np.ones(1 << 16, np.float32)}, str(src))
    out = tmp_path / "out.npz"
    real = os.preadv

    def is_failing(fd):
        if failing == "input":
            return os.path.samestat(os.fstat(fd), os.stat(src))
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".treecli-tmp")

    def failing_preadv(fd, buffers, offset, *rest):
        if is_failing(fd):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset, *rest)

    monkeypatch.setattr(os, "preadv", failing_preadv)
    result = run_cli("convert", src, out)
    if failing == "input":
        assert_clean_error(result, str(src), "cannot read", "Input/output error")
        assert str(out) not in result.stderr.splitlines()[0]
    else:
        assert_clean_error(result, str(out), "cannot read the output back", "Input/output error")
    assert [p.name for p in tmp_path.iterdir()] == ["in.safetensors"]


def _into_a_closed_pipe(*args, env=None):
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader went away before treecli wrote anything
    try:
        proc = subprocess.run([sys.executable, "-m", "treecli", *map(str, args)], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120, env=env)
    finally:
        os.close(write_end)
    return proc


def test_a_closed_pipe_never_turns_into_a_verdict(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({f"w{i}": np.full(3, i, np.float32) for i in range(200)}, str(a))
    save_file({f"w{i}": np.full(3, i + 1, np.float32) for i in range(200)}, str(b))
    assert _into_a_closed_pipe("diff", a, b).returncode == 1
    assert _into_a_closed_pipe("diff", a, a).returncode == 0
    proc = _into_a_closed_pipe("get", a, "w3")
    assert proc.returncode == 0 and proc.stderr == ""


def test_an_ascii_only_stdout_never_crashes(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "m.safetensors"
    save_file({"caf\u00e9.w": np.ones(2, np.float32), "plain": np.zeros(1, np.float32)}, str(path))
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "LANG": "C", "LC_ALL": "C"}
    for args in (["show", path], ["show", path, "--stats"], ["get", path, "plain"], ["show", path, "--json"]):
        proc = subprocess.run([sys.executable, "-m", "treecli", *map(str, args)], capture_output=True,
                              env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert b"Traceback" not in proc.stderr
        proc.stdout.decode("ascii")


# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the (large) forking test process.
PEAK_RSS = ("import sys; from treecli.cli import main; code = main(sys.argv[1:]); "
            "peak = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]; "
            "print('peak_kib', peak, file=sys.stderr); sys.exit(code)")


def run_measured(*args):
    """treecli in a fresh process; returns (exit code, stderr without the measurement, peak RSS in bytes)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", PEAK_RSS, *map(str, args)], capture_output=True, text=True,
                          timeout=300)
    lines = proc.stderr.splitlines()
    peak = int(lines[-1].split()[1]) * 1024
    return proc.returncode, "\n".join(lines[:-1]), peak


@pytest.mark.parametrize("unit", [b"[],", b"{},", b'"a",', b"0,"])
def test_a_99_mb_header_bomb_is_refused_under_1_gib(tmp_path, unit):
    size = 99_000_000
    body = b'{"a":{"dtype":"F32","shape":[' + unit * ((size - 60) // len(unit))
    body = body[:-1] + b'],"data_offsets":[0,0]}}'
    path = tmp_path / "bomb.safetensors"
    path.write_bytes(len(body).to_bytes(8, "little") + body)
    code, stderr, peak = run_measured("show", path)
    path.unlink()
    assert code == 2 and stderr.startswith("treecli: error: ") and "Traceback" not in stderr, stderr
    assert peak < 1 << 30, peak


def test_a_msgpack_of_400k_tiny_arrays_stays_small_in_memory(tmp_path):
    import msgpack

    ext = msgpack.ExtType(1, msgpack.packb(((1,), "float32", b"\0\0\0\0")))
    path = tmp_path / "tiny.msgpack"
    path.write_bytes(msgpack.packb({f"{i}": ext for i in range(400_000)}))
    assert path.stat().st_size < 11_000_000
    code, stderr, peak = run_measured("get", path, "123")
    assert code == 0, stderr
    assert peak < 340 << 20, peak  # 0.41 GB when every tiny array was a NumPy array in a leaf object


def test_a_deflated_npz_member_is_streamed_not_inflated_whole(tmp_path):
    src = tmp_path / "z.npz"
    np.savez_compressed(src, w=np.zeros(1 << 26, np.float32), big_endian=np.arange(10, dtype=">i4"),
                        fortran=np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)))
    assert src.stat().st_size < 1 << 20  # 256 MiB of zeros, deflated
    out = tmp_path / "o.safetensors"
    code, stderr, peak = run_measured("convert", src, out)
    assert code == 0, stderr
    assert peak < 180 << 20, peak  # 0.6 GB when the member was inflated whole
    from safetensors.numpy import load_file

    loaded = load_file(str(out))
    assert loaded["big_endian"].tolist() == list(range(10))
    assert loaded["fortran"].tolist() == np.arange(12).reshape(3, 4).tolist()
    assert loaded["w"].shape == (1 << 26,) and not loaded["w"].any()


@pytest.mark.parametrize("chunk", [2**37, 2**20])
def test_an_orbax_array_of_2_pow_37_fill_values_is_refused_not_aborted(tmp_path, chunk):
    """One chunk: read whole, it would not fit in memory. Chunks of 4 MiB: read a band at a
    time, its 512 GiB would not fit on the output's disk."""
    ocp = pytest.importorskip("orbax.checkpoint")
    path = tmp_path / "fill"
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(str(path), {"w": np.arange(4, dtype=np.float32)})
    zarray = json.loads((path / "w" / ".zarray").read_text())
    zarray["shape"], zarray["chunks"] = [2**37], [chunk]
    (path / "w" / ".zarray").write_text(json.dumps(zarray))
    for chunk in (path / "w").iterdir():
        if not chunk.name.startswith("."):
            chunk.unlink()  # no chunk stored: every element is the fill value
    metadata = json.loads((path / "_METADATA").read_text())
    for entry in metadata["tree_metadata"].values():
        entry["value_metadata"]["write_shape"] = [2**37]
    (path / "_METADATA").write_text(json.dumps(metadata))
    out = tmp_path / "out"
    out.mkdir()
    code, stderr, peak = run_measured("convert", path, out / "o.safetensors")
    assert code == 2 and stderr.startswith("treecli: error: ") and "GiB" in stderr, stderr
    assert list(out.iterdir()) == []
    assert peak < 1 << 30


def test_a_zip_with_data_before_it_is_no_npz_as_np_load_says(tmp_path):
    import io

    buffer = io.BytesIO()
    np.savez(buffer, w=np.ones(2, np.float32))
    content = b"#!/bin/sh\n" + buffer.getvalue()  # zipfile reads it; np.load does not
    with pytest.raises(ValueError):
        np.load(io.BytesIO(content), allow_pickle=False)
    path = tmp_path / "x.npz"
    path.write_bytes(content)
    assert_clean_error(run_cli("show", path), "PK")


def test_an_npz_member_named_otherwise_in_its_local_header_is_refused(tmp_path):
    import io

    buffer = io.BytesIO()
    np.savez(buffer, b=np.ones(2, np.float32))
    content = buffer.getvalue()
    central = content.rindex(b"b.npy")  # the central directory's copy of the name
    content = content[:central] + b"c.npy" + content[central + 5:]
    with pytest.raises(Exception):
        with np.load(io.BytesIO(content), allow_pickle=False) as archive:
            archive["c"]
    path = tmp_path / "x.npz"
    path.write_bytes(content)
    assert_clean_error(run_cli("show", path), "c.npy")


def test_an_eqx_record_of_bytes_is_a_clean_error(tmp_path):
    """Found by the atheris harness: a .npy record of dtype S4 was an internal TypeError."""
    import io

    buffer = io.BytesIO()
    np.save(buffer, np.array([b"abcd"]))
    path = tmp_path / "m.eqx"
    path.write_bytes(buffer.getvalue())
    assert_clean_error(run_cli("show", path), "not numbers")


@pytest.mark.parametrize("member", ["_METADATA", "_CHECKPOINT_METADATA"])
def test_a_1_gib_orbax_json_file_is_refused_without_reading_it(tmp_path, member):
    """Every JSON file of every format has a size cap, as safetensors headers do."""
    import subprocess
    import sys

    ocp = pytest.importorskip("orbax.checkpoint")
    ckpt = tmp_path / "ckpt"
    ocp.PyTreeCheckpointer().save(str(ckpt), {"w": np.arange(4, dtype=np.float32)})
    big = ckpt / member
    with open(big, "wb") as f:  # sparse: a gigabyte that costs no disk
        f.write(b"{")
        f.truncate(1 << 30)
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
            "from treecli.cli import main; sys.exit(main(['show', sys.argv[1]]))")
    result = subprocess.run([sys.executable, "-c", code, str(ckpt)], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in result.stderr and "MemoryError" not in result.stderr
    if member == "_METADATA":
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("treecli: error: ") and "over 64 MiB" in result.stderr
        assert member in result.stderr
    else:  # what only describes the checkpoint: left out, as a damaged one is
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("layout", ["one list", "many lists", "maps"])
def test_a_msgpack_of_millions_of_empty_containers_is_refused_in_bounded_memory(tmp_path, layout):
    import struct
    import subprocess
    import sys

    n = 40_000_000
    path = tmp_path / "bomb.msgpack"
    with open(path, "wb") as f:
        if layout == "one list":  # {"a": [[], [], ... 40M]}: 40 MB
            f.write(b"\x81\xa1a\xdd" + struct.pack(">I", n) + b"\x90" * n)
        else:  # {"a": [[[] x 1000], ... 40k]} or the same of empty maps
            empty = b"\x90" if layout == "many lists" else b"\x80"
            f.write(b"\x81\xa1a\xdd" + struct.pack(">I", n // 1000) + (b"\xdc\x03\xe8" + empty * 1000) * (n // 1000))
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)); "
            "from treecli.cli import main; sys.exit(main(['show', sys.argv[1]]))")
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"treecli: error: {path}: ") and "Traceback" not in result.stderr
    assert "MemoryError" not in result.stderr  # refused by count, in a few dozen MB, not by running out
