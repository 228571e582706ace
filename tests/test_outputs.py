"""What an output may replace (docs/safety.md): in-place edits of
directories, -o DIR --force, special files, outputs over inputs, verification
before publishing, snapshots of inputs, name collisions in writers, cleanup on
every failure path and signal, and exit codes that tell the truth about the disk."""

import errno
import fcntl
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import treecli
from treecli import _atomic

from .conftest import BF16, assert_clean_error, bits, wait_for_temporary

ocp = pytest.importorskip("orbax.checkpoint")


def tree_listing(directory):
    """Everything under a directory, links not followed: name -> ("link", target) or
    ("dir",) or (size, bytes): what must stay byte-identical."""
    out = {}
    for base, dirs, files in os.walk(directory):
        for name in dirs + files:
            p = os.path.join(base, name)
            rel = os.path.relpath(p, directory)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir",)
            else:
                with open(p, "rb") as f:
                    out[rel] = ("file", f.read())
    return out


def temporaries(directory):
    return [p.name for p in directory.iterdir() if p.name.startswith(".treecli-tmp") or "orbax-checkpoint-tmp" in p.name]


def weights(seed=0):
    rng = np.random.default_rng(seed)
    return {"encoder.layer.0.w": rng.standard_normal((4, 3)).astype(np.float32),
            "encoder.layer.1.w": rng.standard_normal((4, 3)).astype(np.float32),
            "pooler.b": rng.standard_normal(3).astype(BF16)}


# --- in place: only the weight files change ---------------------------------------------------


def _git_clone(tmp_path):
    """A sentence-transformers repository as `git clone` leaves it."""
    repo = tmp_path / "repo"
    (repo / ".git" / "objects" / "ab").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / ".git" / "objects" / "ab" / "cdef").write_bytes(b"\x78\x9c blob")
    (repo / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    (repo / "1_Pooling").mkdir()
    (repo / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (repo / "config.json").write_text('{"model_type": "bert"}')
    (repo / "README.md").write_text("# a model card\n")
    outside = tmp_path / "shared_tokenizer.json"
    outside.write_text('{"vocab": []}')
    (repo / "tokenizer.json").symlink_to(outside)
    save_file(weights(), str(repo / "model.safetensors"))
    return repo


def test_in_place_on_a_git_clone_changes_only_the_weights(cli, tmp_path):
    repo = _git_clone(tmp_path)
    before = tree_listing(repo)
    result = cli("edit", repo, "--in-place", "--scale", "**=2", "-q")
    assert result.code == 0, result.stderr
    after = tree_listing(repo)
    assert set(after) == set(before)
    assert {k: v for k, v in after.items() if k != "model.safetensors"} == \
        {k: v for k, v in before.items() if k != "model.safetensors"}
    written = load_file(str(repo / "model.safetensors"))
    assert np.array_equal(written["encoder.layer.0.w"], weights()["encoder.layer.0.w"] * 2)
    assert (tmp_path / "shared_tokenizer.json").read_text() == '{"vocab": []}'


def test_in_place_on_a_hub_cache_snapshot_keeps_its_symlinks_and_blobs(cli, tmp_path):
    blobs = tmp_path / "models--org--m" / "blobs"
    snap = tmp_path / "models--org--m" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    save_file(weights(), str(blobs / "sha-weights"))
    (blobs / "sha-config").write_text('{"model_type": "bert"}')
    (snap / "model.safetensors").symlink_to("../../blobs/sha-weights")
    (snap / "config.json").symlink_to("../../blobs/sha-config")
    blob_bytes = (blobs / "sha-weights").read_bytes()
    result = cli("edit", snap, "--in-place", "--scale", "**=2", "-q")
    assert result.code == 0, result.stderr
    assert os.readlink(snap / "config.json") == "../../blobs/sha-config"
    assert (blobs / "sha-weights").read_bytes() == blob_bytes  # a shared blob is never written through
    assert not (snap / "model.safetensors").is_symlink()
    assert np.array_equal(load_file(str(snap / "model.safetensors"))["pooler.b"].view(np.uint16),
                          (weights()["pooler.b"] * 2).view(np.uint16))


def test_in_place_on_a_sharded_directory_replaces_the_shards_and_index_only(cli, sharded_dir):
    directory, tensors = sharded_dir
    (directory / ".git").mkdir()
    (directory / ".git" / "HEAD").write_text("x")
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text("{}")
    keep = {k: v for k, v in tree_listing(directory).items() if not k.endswith((".safetensors", ".index.json"))}
    result = cli("edit", directory, "--in-place", "--scale", "model.layers.0.attn.q.weight=2", "-q")
    assert result.code == 0, result.stderr
    after = tree_listing(directory)
    assert {k: v for k, v in after.items() if not k.endswith((".safetensors", ".index.json"))} == keep
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert sorted(k for k in after if k.endswith(".safetensors")) == shards  # no stale shard left
    loaded = treecli.load(directory)
    assert np.array_equal(np.asarray(loaded["model"]["layers"]["0"]["attn"]["q"]["weight"]),
                          tensors["model.layers.0.attn.q.weight"] * 2)
    assert bits(np.asarray(loaded["model"]["embed"]["weight"])) == bits(tensors["model.embed.weight"])


def test_in_place_on_a_sharded_directory_killed_before_the_index_keeps_the_old_checkpoint(sharded_dir,
                                                                                           monkeypatch, cli):
    directory, tensors = sharded_dir
    before = tree_listing(directory)
    from treecli.formats import safetensors as st

    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(st, "_write_index", fail)
    result = cli("edit", directory, "--in-place", "--scale", "**=2", "-q")
    assert_clean_error(result, "No space left")
    assert tree_listing(directory) == before


@pytest.fixture
def manager_root(tmp_path):
    root = tmp_path / "runs"
    with ocp.CheckpointManager(str(root)) as manager:
        for step in (100, 200, 300):
            manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave({"w": np.full(3, step, np.float32)}),
                metadata=ocp.args.JsonSave({"step": step})))
        manager.wait_until_finished()
    return root


def test_in_place_on_a_manager_root_never_rewrites_the_root(cli, manager_root):
    before = tree_listing(manager_root)
    result = cli("edit", manager_root, "--step", "100", "--in-place", "--scale", "**=2", "-q")
    assert_clean_error(result, "--step", "-o")
    assert tree_listing(manager_root) == before
    result = cli("edit", manager_root / "200", "--in-place", "--scale", "**=2", "-q")
    assert_clean_error(result)
    assert tree_listing(manager_root) == before


def test_in_place_on_an_orbax_directory_with_foreign_files_refuses_listing_them(cli, tmp_path):
    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(str(path), {"w": np.ones(3, np.float32)})
    (path / "NOTES.md").write_text("lr sweep 3")
    before = tree_listing(path)
    result = cli("edit", path, "--in-place", "--scale", "**=2", "-q")
    assert_clean_error(result, "NOTES.md")
    assert tree_listing(path) == before
    (path / "NOTES.md").unlink()
    result = cli("edit", path, "--in-place", "--scale", "**=2", "-q")
    assert result.code == 0, result.stderr
    assert np.asarray(treecli.load(path)["w"]).tolist() == [2, 2, 2]
    assert temporaries(tmp_path) == []


# --- -o DIR --force ---------------------------------------------------------------------------


def test_force_never_replaces_a_directory_that_holds_inputs_or_other_files(cli, tmp_path):
    runs = tmp_path / "runs"
    for name in ("a", "b"):
        (runs / name).mkdir(parents=True)
        save_file(weights(), str(runs / name / "model.safetensors"))
    (runs / "notes.txt").write_text("keep me")
    save_file(weights(3), str(runs / "best.safetensors"))
    before = tree_listing(runs)
    result = cli("average", runs / "a", runs / "b", "-o", runs, "--force", "-q")
    assert_clean_error(result)
    assert tree_listing(runs) == before
    elsewhere = tmp_path / "elsewhere.safetensors"
    save_file(weights(), str(elsewhere))
    result = cli("edit", elsewhere, "-o", runs, "--force", "--scale", "**=2", "-q")
    assert_clean_error(result, "notes.txt", "best.safetensors")
    assert tree_listing(runs) == before


def test_force_replaces_a_directory_treecli_could_have_written(cli, tmp_path):
    src = tmp_path / "m.safetensors"
    save_file(weights(), str(src))
    out = tmp_path / "out"
    assert cli("convert", src, out, "--max-shard-size", "60", "-q").code == 0
    assert len(list(out.glob("*.safetensors"))) > 1
    result = cli("edit", src, "-o", out, "--force", "--scale", "**=2", "-q")
    assert result.code == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # no stale shard or index
    assert temporaries(tmp_path) == []


@pytest.mark.parametrize("kind", ["fifo", "socket", "device"])
def test_special_files_are_never_replaced(cli, tmp_path, kind):
    src = tmp_path / "m.safetensors"
    save_file(weights(), str(src))
    target = tmp_path / "target.safetensors"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(target))
    else:
        try:
            os.mknod(target, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own
        except PermissionError:
            pytest.skip("mknod needs privileges")
    mode = os.lstat(target).st_mode
    try:
        result = cli("edit", src, "-o", target, "--force", "--scale", "**=2", "-q")
    finally:
        if kind == "socket":
            sock.close()
    assert_clean_error(result, str(target))
    assert os.lstat(target).st_mode == mode
    assert temporaries(tmp_path) == []


def test_get_never_writes_over_its_input_even_with_force(cli, tmp_path):
    src = tmp_path / "weights.npy"  # safetensors bytes: sniffed, whatever the name
    save_file({"w": np.ones(3, np.float32)}, str(src))
    before = src.read_bytes()
    result = cli("get", src, "w", "-o", src, "--force")
    assert_clean_error(result, "input")
    assert src.read_bytes() == before


def test_no_output_lands_on_a_weight_file_inside_an_input_directory(cli, sharded_dir):
    directory, _ = sharded_dir
    before = tree_listing(directory)
    result = cli("edit", directory, "-o", directory / "model-00001-of-00002.safetensors", "--force",
                 "--scale", "**=2", "-q")
    assert_clean_error(result, "input")
    assert tree_listing(directory) == before


# --- verification before publishing -----------------------------------------------------------


def test_convert_verifies_the_temporary_so_a_mismatch_keeps_the_old_output(cli, tmp_path, monkeypatch):
    src = tmp_path / "m.safetensors"
    save_file(weights(), str(src))
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"the previous output")
    from treecli._bytes import writer

    original = writer.write_leaf

    def corrupting(f, leaf, **kwargs):
        original(f, leaf, **kwargs)
        if kwargs["keypath"] == "pooler.b":
            f.seek(-1, os.SEEK_CUR)
            f.write(b"\x7f")

    monkeypatch.setattr(writer, "write_leaf", corrupting)
    result = cli("convert", src, out, "--force", "-q")
    assert_clean_error(result, "verification failed")
    assert "pooler.b" in result.stderr
    assert out.read_bytes() == b"the previous output"
    assert temporaries(tmp_path) == []


@pytest.mark.parametrize("suffix", [".safetensors", ".npz", ".eqx"])
@pytest.mark.parametrize("verified", [True, False])
def test_an_output_leaves_the_cache_as_it_is_written_and_a_verified_one_is_read_back_first(
        cli, tmp_path, monkeypatch, suffix, verified):
    """Write-back starts as the output is written and each window is dropped once written back,
    verified or not: a big output never evicts the inputs, nor stays cached whole for its check
    (fresh page-cache pages cost this VM up to 2 s per GiB). A verified output's bytes are read
    back from the cache a window at a time, each byte once and before its window is dropped;
    the check then reads nothing of the output again."""
    from treecli._bytes import writer

    src = tmp_path / "m.safetensors"
    save_file({f"layer.{i}": np.full(4096, i, np.float32) for i in range(16)}, str(src))
    out = tmp_path / f"out{suffix}"
    events = []
    real_preadv = os.preadv

    def is_output(fd):
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".treecli-tmp")

    def hint(fd, offset, length, advice):
        assert advice == os.POSIX_FADV_DONTNEED
        if is_output(fd):
            events.append(("hint", offset, length))

    def preadv(fd, buffers, offset):
        n = real_preadv(fd, buffers, offset)
        if is_output(fd):
            events.append(("read", offset, n))
        return n

    monkeypatch.setattr(writer, "WRITEBACK_BYTES", 4096)
    monkeypatch.setattr(os, "posix_fadvise", hint)
    monkeypatch.setattr(os, "preadv", preadv)
    result = cli("convert", src, out, *([] if verified else ["--no-verify"]), "-q")
    assert result.code == 0, result.stderr

    hints = [e[1:] for e in events if e[0] == "hint" and e[1:] != (0, 0)]
    assert len(hints) >= 8
    # each hint starts the write-back of the window just written and drops the one before it
    assert all(hints[k][0] == hints[k - 2][0] + hints[k - 2][1] for k in range(2, len(hints)))
    reads = [e[1:] for e in events if e[0] == "read"]
    if not verified:
        assert reads == []
        return
    assert reads, "a verified output is read back"
    assert all(reads[k][0] == sum(reads[k - 1]) for k in range(1, len(reads))), "each byte read back once, in order"
    assert sum(reads[-1]) == out.stat().st_size  # to the end
    # Nothing is dropped before it was read back: a hint drops what lies before the last hint's end
    # (the window it starts writing back is read beside it).
    dropped_to = 0
    for i, event in enumerate(events):
        if event[0] == "hint" and event[1:] != (0, 0):
            assert max((sum(e[1:]) for e in events[:i] if e[0] == "read"), default=0) >= dropped_to
            dropped_to = sum(event[1:])
    assert events[-1] == ("hint", 0, 0)  # and the whole output dropped after the check


def test_verification_catches_bytes_changed_in_a_window_before_it_is_read_back(cli, tmp_path, monkeypatch):
    """Bytes of the output that change between their writing and their reading back (a stray
    write, a reused buffer) fail the check, named by their leaf; the old output stays."""
    from treecli._bytes import writer

    src = tmp_path / "m.safetensors"
    save_file({f"layer.{i}": np.full(8192, i, np.float32) for i in range(4)}, str(src))
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"the previous output")
    calls = []
    original = writer.Writeback.__call__

    def meddling(self):
        calls.append(1)
        if len(calls) == 2:  # after layer.1 (one chunk, one call each): inside its data, not yet read back
            self._f.flush()
            os.pwrite(os.open(self._f.name, os.O_WRONLY), b"\x7f", self._f.tell() - 100)
        return original(self)

    monkeypatch.setattr(writer, "WRITEBACK_BYTES", 4096)
    monkeypatch.setattr(writer.Writeback, "__call__", meddling)
    result = cli("convert", src, out, "--force", "-q")
    assert_clean_error(result, "verification failed")
    assert "layer.1" in result.stderr and "layer.2" not in result.stderr
    assert out.read_bytes() == b"the previous output"
    assert temporaries(tmp_path) == []


def test_verification_names_a_leaf_the_writer_left_out_and_one_it_made_up(cli, tmp_path, monkeypatch):
    from treecli.formats import safetensors as st

    src = tmp_path / "m.safetensors"
    save_file(weights(), str(src))
    out = tmp_path / "out.safetensors"
    original = st._entries_for_writing

    def renamed(tree, file, options):
        entries = original(tree, file, options)
        return [("pooler.bias" if key == "pooler.b" else key, leaf) for key, leaf in entries]

    monkeypatch.setattr(st, "_entries_for_writing", renamed)
    result = cli("convert", src, out, "-q")
    assert_clean_error(result, "verification failed")
    assert 'only in the output: ["pooler.bias"]' in result.stderr
    assert 'missing from the output: ["pooler.b"]' in result.stderr
    assert not out.exists()


def test_verification_reads_each_leaf_where_the_output_says_it_is(cli, tmp_path, monkeypatch):
    """A header that places two leaves of one size at each other's bytes: the check follows
    the output's own header, not the writer's plan, and finds both wrong."""
    from treecli.formats import safetensors as st

    src = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(1000, np.float32), "b": np.ones(1000, np.float32), "c": np.full(10, 2, np.float32)},
              str(src))
    out = tmp_path / "out.safetensors"
    original = st._encode_header

    def swapped(entries, metadata):
        head = original(entries, metadata)
        return head.replace(b'"data_offsets":[0,4000]', b'"data_offsets":[@]').replace(
            b'"data_offsets":[4000,8000]', b'"data_offsets":[0,4000]').replace(b"[@]", b"[4000,8000]")

    monkeypatch.setattr(st, "_encode_header", swapped)
    result = cli("convert", src, out, "-q")
    assert_clean_error(result, "verification failed")
    assert "a:" in result.stderr and "b:" in result.stderr and "c:" not in result.stderr
    assert not out.exists()


def test_convert_of_an_npz_with_flat_dotted_keys_verifies(cli, tmp_path):
    src = tmp_path / "t.npz"
    np.savez(src, **{"a.b": np.ones(2, "f4"), "model.layers.0.w": np.arange(4, dtype="i8")})
    out = tmp_path / "t.safetensors"
    result = cli("convert", src, out)
    assert result.code == 0, result.stderr
    assert "verified" in result.stderr
    assert sorted(load_file(str(out))) == ["a.b", "model.layers.0.w"]


# --- one name per leaf in every writer ---------------------------------------------------------


@pytest.mark.parametrize("suffix", [".safetensors", ".npz", ".msgpack", "_orbax"])
def test_two_leaves_that_would_share_a_stored_name_are_an_error_before_writing(tmp_path, suffix):
    separator = {"_orbax": ".", ".safetensors": ".", ".npz": "/", ".msgpack": None}[suffix]
    if separator is None:  # msgpack stores a real tree: {"1": ...} and [..] at one level cannot collide
        tree = {"a": {"b": np.ones(2, np.float32)}, "a.b": np.zeros(2, np.float32)}
    else:
        tree = {"a": {"b": np.ones(2, np.float32)}, f"a{separator}b": np.zeros(2, np.float32)}
    target = tmp_path / f"out{suffix}"
    fmt = "orbax" if suffix == "_orbax" else None
    if separator is None:
        treecli.save(tree, target)
        loaded = treecli.load(target)
        assert np.asarray(loaded["a.b"]).tolist() == [0, 0] and np.asarray(loaded["a"]["b"]).tolist() == [1, 1]
        return
    with pytest.raises(treecli.TreecliError) as info:
        treecli.save(tree, target, format=fmt)
    from treecli._keypath import format_keypath

    message = str(info.value)
    assert format_keypath(("a", "b")) in message and format_keypath((f"a{separator}b",)) in message
    assert not target.exists()
    assert temporaries(tmp_path) == []


# --- a consistent snapshot of the input ---------------------------------------------------------


def test_a_shard_replaced_after_opening_is_never_mixed_with_the_old_header(tmp_path):
    directory = tmp_path / "hf"
    directory.mkdir()
    a, b = np.full(4, 1, np.float32), np.full(4, 2, np.float32)
    save_file({"x": a, "y": b}, str(directory / "model-00001-of-00001.safetensors"))
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "model-00001-of-00001.safetensors", "y": "model-00001-of-00001.safetensors"}}))
    with treecli.open(directory) as ckpt:
        # The shard is replaced by one with the same tensors in another order (a re-download).
        replacement = tmp_path / "new.safetensors"
        save_file({"y": b, "x": a}, str(replacement))
        raw = bytearray(replacement.read_bytes())
        header_len = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + header_len])
        # Put y's bytes first: the same names and shapes, the other order on disk.
        header["y"]["data_offsets"], header["x"]["data_offsets"] = [0, 16], [16, 32]
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        replacement.write_bytes(len(blob).to_bytes(8, "little") + blob + b.tobytes() + a.tobytes())
        os.replace(replacement, directory / "model-00001-of-00001.safetensors")
        try:
            x = np.asarray(ckpt.tree["x"])
        except treecli.TreecliError as e:
            assert "changed" in str(e)
        else:
            assert x.tolist() == a.tolist()


def test_six_hundred_shards_under_a_descriptor_limit(tmp_path):
    directory = tmp_path / "hf"
    directory.mkdir()
    weight_map = {}
    for i in range(600):
        name = f"model-{i + 1:05d}-of-00600.safetensors"
        save_file({f"l{i}": np.full(2, i, np.float32)}, str(directory / name))
        weight_map[f"l{i}"] = name
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    code = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)); "
            "sys.argv = ['treecli', *sys.argv[1:]]; runpy.run_module('treecli', run_name='__main__')")
    out = tmp_path / "one.safetensors"
    proc = subprocess.run([sys.executable, "-c", code, "convert", str(directory), str(out), "-q"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = load_file(str(out))
    assert len(loaded) == 600 and loaded["l599"].tolist() == [599, 599]


def test_a_verified_output_of_six_hundred_shards_under_a_descriptor_limit(tmp_path):
    """Each shard is read back as it is written: a shard's descriptor for that goes when the
    next shard starts, so six hundred shards hold a handful at once."""
    src = tmp_path / "m.safetensors"
    save_file({f"l{i}": np.full(2, i, np.float32) for i in range(600)}, str(src))
    code = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)); "
            "sys.argv = ['treecli', *sys.argv[1:]]; runpy.run_module('treecli', run_name='__main__')")
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-c", code, "convert", str(src), str(out), "--max-shard-size", "8", "-q"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(list(out.glob("*.safetensors"))) == 600
    assert treecli.load(out)["l599"].read().tolist() == [599, 599]


# --- Orbax outputs from any tree ---------------------------------------------------------------


@pytest.fixture
def orbax_with_strings(tmp_path):
    path = tmp_path / "mixed"
    tree = {"params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(2, BF16)},
            "config": {"name": "tiny", "depth": 2, "lr": 0.5, "tied": True, "extra": None}, "empty": {}}
    ocp.PyTreeCheckpointer().save(str(path), tree)
    return path, tree


def test_slice_of_an_orbax_checkpoint_with_strings_into_orbax(cli, orbax_with_strings, tmp_path):
    path, tree = orbax_with_strings
    out = tmp_path / "sliced"
    result = cli("slice", path, "--index", "params.w=0", "-o", out, "--format", "orbax", "-q")
    assert result.code == 0, result.stderr
    restored = ocp.PyTreeCheckpointer().restore(str(out))
    assert restored["config"] == tree["config"]
    assert np.asarray(restored["params"]["w"]).tolist() == [0, 1, 2]
    assert bits(np.asarray(restored["params"]["b"])) == bits(tree["params"]["b"])
    assert temporaries(tmp_path) == []


def test_orbax_refuses_what_it_cannot_hold_before_writing_or_drops_it(tmp_path):
    tree = {"w": np.ones(2, np.float32), "blob": b"\x00bytes", "c": complex(1, 2)}
    target = tmp_path / "o"
    with pytest.raises(treecli.TreecliError) as info:
        treecli.save(tree, target, format="orbax")
    assert "blob" in str(info.value) or "blob" in "".join(info.value.details)
    assert not target.exists() and temporaries(tmp_path) == []


# --- every failure path cleans up --------------------------------------------------------------


def _fail(*args, **kwargs):
    raise RuntimeError("injected")


@pytest.mark.parametrize("fmt,patch", [
    ("safetensors", ("treecli._bytes.writer", "write_leaf")),
    ("sharded", ("treecli.formats.safetensors", "_write_index")),
    ("npz", ("numpy.lib.format", "write_array_header_1_0")),
    ("msgpack", ("msgpack", "packb")),
    ("orbax", ("orbax.checkpoint.PyTreeCheckpointer", "save")),
])
def test_a_writer_failing_inside_leaves_no_temporary_and_the_old_output(cli, tmp_path, monkeypatch, fmt, patch):
    import importlib

    src = tmp_path / "in" / "m.safetensors"
    src.parent.mkdir()
    save_file(weights(), str(src))
    work = tmp_path / "work"
    work.mkdir()
    out = work / {"safetensors": "o.safetensors", "sharded": "odir", "npz": "o.npz", "msgpack": "o.msgpack",
                  "orbax": "odir"}[fmt]
    module, name = patch
    owner = importlib.import_module(module.rsplit(".", 1)[0]) if module.endswith("Checkpointer") else \
        importlib.import_module(module)
    if module.endswith("Checkpointer"):
        owner = getattr(owner, module.rsplit(".", 1)[1])
    monkeypatch.setattr(owner, name, _fail)
    extra = {"sharded": ["--max-shard-size", "60"], "orbax": ["--format", "orbax"]}.get(fmt, [])
    result = cli("edit", src, "-o", out, "--scale", "**=2", "-q", *extra)
    assert result.code == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert list(work.iterdir()) == []


def _start_writer(tmp_path, extra=()):
    src = tmp_path / "big.safetensors"
    rng = np.random.default_rng(0)
    save_file({f"l{i}": rng.standard_normal(1 << 20).astype(np.float32) for i in range(32)}, str(src))
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"previous output")
    proc = subprocess.Popen([sys.executable, "-m", "treecli", "edit", str(src), "-o", str(out), "--force",
                             "--scale", "**=0.5", *extra], stderr=subprocess.PIPE, text=True)
    wait_for_temporary(proc, tmp_path, src.stat().st_size / 10)  # the write is under way
    return proc, out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_clean_up_like_sigint(tmp_path, signum):
    proc, out = _start_writer(tmp_path)
    before_out = out.read_bytes()
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the write finished before the signal arrived")
    assert proc.returncode == 128 + signum, stderr
    assert stderr.strip().splitlines() == [f"treecli: interrupted by {signal.Signals(signum).name}"]
    assert temporaries(tmp_path) == []
    assert out.read_bytes() == before_out


def test_a_live_writers_temporary_is_never_removed_whatever_its_pid(cli, tmp_path):
    src = tmp_path / "m.safetensors"
    save_file(weights(), str(src))
    # A writer in another PID namespace: its PID means nothing here, but it holds its lock.
    live = tmp_path / ".treecli-tmp-999999-0123abcd-other.safetensors"
    fd = os.open(live, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.utime(live, (time.time() - 3600, time.time() - 3600))  # a long write: only the lock protects it
    abandoned = tmp_path / ".treecli-tmp-1-89abcdef-gone.safetensors"
    abandoned.write_bytes(b"left by a killed run")
    os.utime(abandoned, (time.time() - 3600, time.time() - 3600))
    try:
        assert cli("edit", src, "-o", tmp_path / "o.safetensors", "--scale", "**=2", "-q").code == 0
        assert live.exists()
        assert not abandoned.exists()
    finally:
        os.close(fd)


def test_in_place_keeps_owner_group_and_mode(cli, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root")
    src = tmp_path / "m.safetensors"
    save_file(weights(), str(src))
    os.chown(src, 1234, 2345)
    os.chmod(src, 0o640)
    assert cli("edit", src, "--in-place", "--scale", "**=2", "-q").code == 0
    st = os.stat(src)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1234, 2345, 0o640)


def test_an_output_name_of_250_bytes_is_written(cli, tmp_path):
    src = tmp_path / "m.safetensors"
    save_file(weights(), str(src))
    out = tmp_path / ("é" * 119 + "x.safetensors")
    assert 250 <= len(out.name.encode()) <= 255
    result = cli("edit", src, "-o", out, "--scale", "**=2", "-q")
    assert result.code == 0, result.stderr
    assert sorted(load_file(str(out))) == sorted(weights())
    dir_out = tmp_path / ("d" * 250)
    result = cli("edit", src, "-o", dir_out, "--scale", "**=2", "-q")
    assert result.code == 0, result.stderr
    assert temporaries(tmp_path) == []


def _fail_directory_syncs(monkeypatch):
    """Every fsync of a directory (what makes a rename durable) fails with EIO."""
    real = _atomic.fsync_path

    def failing(path):
        if os.path.isdir(path):
            raise OSError(errno.EIO, "Input/output error")
        real(path)

    monkeypatch.setattr(_atomic, "fsync_path", failing)


def test_a_failed_directory_sync_after_publishing_says_the_output_exists(cli, tmp_path, monkeypatch):
    src = tmp_path / "m.safetensors"
    save_file(weights(), str(src))
    out = tmp_path / "o.safetensors"
    _fail_directory_syncs(monkeypatch)
    result = cli("edit", src, "-o", out, "--scale", "**=2", "-q")
    assert result.code == 3, result.stderr
    line = result.stderr.strip().splitlines()[0]
    assert line.startswith("treecli: error: ") and "written" in line and "not confirmed" in line
    assert sorted(load_file(str(out))) == sorted(weights())


def test_in_place_on_shards_whose_directory_sync_fails_keeps_the_old_checkpoint(cli, sharded_dir, monkeypatch):
    directory, _ = sharded_dir
    before = tree_listing(directory)
    _fail_directory_syncs(monkeypatch)
    result = cli("edit", directory, "--in-place", "--scale", "**=2", "-q")
    assert_clean_error(result, "unchanged")
    assert tree_listing(directory) == before  # the old index and every shard it names


@pytest.mark.parametrize("args", [["convert", "{src}", "{dir}/out.npz"], ["edit", "{src}", "--in-place", "--scale", "w=2"],
                                  ["convert", "{src}", "{dir}/shards", "--max-shard-size", "1KB"]])
def test_an_output_that_would_not_fit_on_its_disk_is_refused_before_writing(cli, tmp_path, monkeypatch, args):
    """Refused at once with the sizes, rather than failing (ENOSPC) after writing for minutes;
    nothing written, the input untouched."""
    src = tmp_path / "in" / "m.safetensors"
    src.parent.mkdir()
    save_file({"w": np.ones(4096, np.float32), "b": np.zeros(16, np.float32)}, str(src))
    before = src.read_bytes()
    real_statvfs = os.statvfs

    def almost_full(path):
        real = real_statvfs(path)
        return os.statvfs_result((real.f_bsize, 4096, real.f_blocks, 1, 1, *real[5:]))  # one block free

    monkeypatch.setattr(os, "statvfs", almost_full)
    result = cli(*[a.format(src=src, dir=tmp_path) for a in args])
    assert_clean_error(result, "16.1 KiB", "free")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"] and [p.name for p in src.parent.iterdir()] == ["m.safetensors"]
    assert src.read_bytes() == before


@pytest.mark.parametrize("declared, shown", [(b'"dtype":"F32","shape":[25,40]', "[25, 40] float32"),
                                             (b'"dtype":"I32","shape":[40,25]', "[40, 25] int32")])
def test_verification_names_a_leaf_whose_shape_or_dtype_the_output_declares_otherwise(cli, tmp_path, monkeypatch,
                                                                                       declared, shown):
    """The same bytes declared as another shape or dtype (the header keeps its length)."""
    from treecli.formats import safetensors as st

    src = tmp_path / "m.safetensors"
    save_file({"a": np.zeros((40, 25), np.float32), "c": np.full(10, 2, np.float32)}, str(src))
    out = tmp_path / "out.safetensors"
    original = st._encode_header

    def misdeclared(entries, metadata):
        head = original(entries, metadata)
        assert head.count(b'"dtype":"F32","shape":[40,25]') == 1, head
        return head.replace(b'"dtype":"F32","shape":[40,25]', declared)

    monkeypatch.setattr(st, "_encode_header", misdeclared)
    result = cli("convert", src, out, "-q")
    assert_clean_error(result, "verification failed")
    assert f"a: [40, 25] float32 -> {shown}" in result.stderr and "c:" not in result.stderr
    assert not out.exists()


def _corrupting_the_leaf(monkeypatch, keypath: str) -> None:
    """The writer's last byte of ``keypath`` changed after it was written (and digested)."""
    from treecli._bytes import writer

    original = writer.write_leaf

    def corrupting(f, leaf, **kwargs):
        original(f, leaf, **kwargs)
        if kwargs["keypath"] == keypath:
            f.seek(-1, os.SEEK_CUR)
            f.write(b"\x7f")

    monkeypatch.setattr(writer, "write_leaf", corrupting)


@pytest.mark.parametrize("command", [
    ["average", "{a}", "{b}"], ["merge", "--method", "ties", "--base", "{a}", "{b}", "--density", "0.5"],
    ["edit", "{a}", "--scale", "pooler.**=2"], ["slice", "{a}", "--index", "encoder.**=:1"],
    ["convert", "{a}"], ["get", "{a}", "pooler"],
])
def test_every_command_that_writes_verifies_with_verify(cli, tmp_path, monkeypatch, command):
    """--verify (convert: always; get: always) reads the output back before it is
    published: a byte changed after it was written keeps the previous output."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(weights(0), str(a))
    save_file(weights(1), str(b))
    out = tmp_path / "out.safetensors"
    args = [part.format(a=a, b=b) for part in command] + ["-o" if command[0] not in ("convert",) else "", out]
    args = [x for x in args if x != ""]
    extra = [] if command[0] in ("convert", "get") else ["--verify"]
    good = cli(*args, *extra, "--force")
    assert good.code == 0, good.stderr
    assert "verified: every leaf is bit-exact" in good.stderr or command[0] == "get"
    out.write_bytes(b"the previous output")
    _corrupting_the_leaf(monkeypatch, "pooler.b")
    result = cli(*args, *extra, "--force")
    assert_clean_error(result, "verification failed")
    assert "pooler.b" in result.stderr
    assert out.read_bytes() == b"the previous output" and temporaries(tmp_path) == []
    if command[0] not in ("convert", "get"):  # without --verify, the write path does not read it back
        assert cli(*args, "--force").code == 0


def test_an_in_place_edit_with_verify_keeps_the_checkpoint_when_the_check_fails(cli, tmp_path, monkeypatch):
    src = tmp_path / "m.safetensors"
    save_file(weights(), str(src))
    before = src.read_bytes()
    _corrupting_the_leaf(monkeypatch, "pooler.b")
    result = cli("edit", src, "--in-place", "--scale", "pooler.**=2", "--verify", "-q")
    assert_clean_error(result, "verification failed")
    assert src.read_bytes() == before and temporaries(tmp_path) == []
    monkeypatch.undo()
    assert cli("edit", src, "--in-place", "--scale", "pooler.**=2", "--verify").code == 0
    assert (load_file(str(src))["pooler.b"] == weights()["pooler.b"] * 2).all()


def test_verify_of_a_bucket_output_is_one_line(cli, tmp_path):
    src = tmp_path / "m.safetensors"
    save_file(weights(), str(src))
    assert_clean_error(cli("edit", src, "--scale", "**=2", "--verify", "-o", "s3://bucket/m.safetensors"),
                       "--verify reads a local output back")


def test_verification_reads_an_orbax_output_and_its_source_again_and_names_a_difference(cli, tmp_path, monkeypatch):
    """An Orbax output's leaves are not digested as they are written: both sides are read
    again and compared, bytes for arrays and values for the rest."""
    pytest.importorskip("orbax.checkpoint")
    from treecli.formats import _orbax_write

    src = tmp_path / "m.safetensors"
    save_file(weights(), str(src))
    assert cli("convert", src, tmp_path / "good", "--format", "orbax").code == 0
    original = _orbax_write.write

    def perturbed(tree, target, options):
        from treecli import _tree
        from treecli._keypath import format_keypath

        changed = _tree.map_leaves(lambda kp, x: np.asarray(x.read()) + 1 if format_keypath(kp) == "pooler.b" else x,
                                   tree)
        return original(changed, target, options)

    monkeypatch.setattr(_orbax_write, "write", perturbed)
    result = cli("convert", src, tmp_path / "bad", "--format", "orbax", "-q")
    assert_clean_error(result, "verification failed")
    assert "pooler.b" in result.stderr and "the bytes written differ" in result.stderr
    assert not (tmp_path / "bad").exists()
