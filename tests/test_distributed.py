"""Every command across processes on JAX's distributed runtime (issue 33, item 4): the same
command launched on N processes on 127.0.0.1, each reading and writing its share, the
output byte-identical to one process's; a failure anywhere publishes nothing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import treecli

from .conftest import file_sha256

pytest.importorskip("jax")

ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3", "TREECLI_BARRIER_SECONDS": "120"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(count: int, *args: str | Path, each: dict[int, list] | None = None) -> list[subprocess.CompletedProcess]:
    """``treecli ARGS`` on ``count`` processes of one run (``each``: other arguments for some)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "treecli", "--coordinator", f"127.0.0.1:{port}",
                               "--num-processes", str(count), "--process-id", str(i),
                               *map(str, (each or {}).get(i, args))],
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(count)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def alone(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "treecli", *map(str, args)], env=ENV, capture_output=True, text=True,
                          timeout=240)


def model(seed: int) -> dict[str, np.ndarray]:
    """Leaves of several dtypes and sizes, so that the processes' shares cut leaves mid-way."""
    rng = np.random.default_rng(seed)
    return {"embed": rng.standard_normal((1000, 257)).astype(ml_dtypes.bfloat16),
            "layers.0.w": rng.standard_normal((333, 129)).astype(np.float32),
            "layers.0.b": rng.standard_normal(129).astype(np.float16),
            "layers.1.w": rng.standard_normal((333, 129)).astype(np.float32),
            "step": np.asarray(7, np.int64), "mask": rng.integers(0, 2, 37).astype(bool)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("dist")
    paths = []
    for seed in range(3):
        path = base / f"m{seed}.safetensors"
        save_file(model(seed), str(path), metadata={"format": "pt"})
        paths.append(path)
    return paths


@pytest.mark.parametrize("count", [2, 4])
def test_average_on_several_processes_is_byte_identical_to_one(models, tmp_path, count):
    single = alone("average", *models, "--weights", "1,2,3", "-o", tmp_path / "one.safetensors")
    assert single.returncode == 0, single.stderr
    results = launch(count, "average", *models, "--weights", "1,2,3", "-o", tmp_path / "many.safetensors")
    assert [r.returncode for r in results] == [0] * count, [r.stderr[-800:] for r in results]
    assert file_sha256(tmp_path / "many.safetensors") == file_sha256(tmp_path / "one.safetensors")
    assert all(not r.stderr.strip() for r in results[1:])  # process 0 speaks for all
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many.safetensors", "one.safetensors"]


@pytest.mark.parametrize("command", [
    ["convert", "{0}", "{out}"],
    ["slice", "{0}", "--index", "embed=:500", "--index", "layers.*.w=1:", "-o", "{out}"],
    ["edit", "{0}", "--cast", "layers.0.w=bfloat16", "--scale", "embed=0.5", "--rename", "layers.1=top", "-o", "{out}"],
    ["merge", "--method", "ties", "--base", "{0}", "{1}", "{2}", "--density", "0.5", "-o", "{out}"],
    ["merge", "--method", "dare_linear", "--base", "{0}", "{1}", "{2}", "--density", "0.5", "--seed", "3",
     "-o", "{out}"],
], ids=lambda c: " ".join(c[:3]))
def test_every_writing_command_on_two_processes_is_byte_identical_to_one(models, tmp_path, command):
    def args(out):
        return [a.format(*models, out=out) for a in command]

    single = alone(*args(tmp_path / "one.safetensors"))
    assert single.returncode == 0, single.stderr
    results = launch(2, *args(tmp_path / "two.safetensors"))
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-800:] for r in results]
    assert file_sha256(tmp_path / "two.safetensors") == file_sha256(tmp_path / "one.safetensors")


def test_an_hf_directory_written_by_three_processes_is_the_one_one_writes(models, tmp_path):
    """Shards, index and the input's companion files (config.json), each file byte-identical."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "llama"}\n')
    (source / "model.safetensors").write_bytes(models[0].read_bytes())
    for count, name in ((1, "one"), (3, "three")):
        args = ["convert", source, tmp_path / name, "--max-shard-size", "300KB"]
        results = [alone(*args)] if count == 1 else launch(count, *args)
        assert [r.returncode for r in results] == [0] * count, [r.stderr[-800:] for r in results]
    one, three = ({p.name: file_sha256(p) for p in (tmp_path / n).iterdir()} for n in ("one", "three"))
    assert one == three and "model.safetensors.index.json" in one and "config.json" in one
    # (the record's roots: taken by process 0 from the finished output, the same as one process's)
    record = json.loads(treecli.open(tmp_path / "three").metadata["treecli.record"])
    assert record["root"] == treecli.hash(tmp_path / "three").root == treecli.hash(models[0]).root
    assert len([n for n in one if n.startswith("model-")]) >= 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "source", "three"]


def test_an_orbax_checkpoint_written_by_two_processes_holds_what_one_writes(models, tmp_path):
    """Each process its own rows, in Orbax's multi-process layout (an ``ocdbt.process_N``
    each), committed once: the values are one process's, bit for bit."""
    results = launch(2, "edit", models[0], "--scale", "embed=0.5", "-o", tmp_path / "two", "--format", "orbax")
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-1500:] for r in results]
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= {p.name for p in (tmp_path / "two").iterdir()}
    single = alone("edit", models[0], "--scale", "embed=0.5", "-o", tmp_path / "one.safetensors")
    assert single.returncode == 0, single.stderr
    same = alone("diff", tmp_path / "two", tmp_path / "one.safetensors")
    assert same.returncode == 0, same.stdout + same.stderr


def test_diff_on_three_processes_says_what_one_says(models):
    single = alone("diff", models[0], models[1], "--json")
    results = launch(3, "diff", models[0], models[1], "--json")
    assert single.returncode == 1 and [r.returncode for r in results] == [1, 1, 1], [r.stderr for r in results]
    assert results[0].stdout == single.stdout and len(single.stdout) > 100
    assert results[1].stdout == results[2].stdout == ""  # process 0 speaks for all
    same = launch(2, "diff", models[2], models[2])
    assert [r.returncode for r in same] == [0, 0]


def test_hash_and_verify_on_three_processes_say_what_one_says(models, tmp_path):
    """Issue 44: each process hashes its share of the leaves; the digests are the whole's."""
    single = alone("hash", models[0], "--json")
    results = launch(3, "hash", models[0], "--json")
    assert single.returncode == 0 and [r.returncode for r in results] == [0, 0, 0], [r.stderr for r in results]
    assert results[0].stdout == single.stdout and '"leaves"' in single.stdout
    assert results[1].stdout == results[2].stdout == ""  # process 0 speaks for all
    differ = launch(2, "verify", models[0], models[1], "--json")
    assert [r.returncode for r in differ] == [1, 1]
    assert differ[0].stdout == alone("verify", models[0], models[1], "--json").stdout
    assert [r.returncode for r in launch(2, "verify", models[2], models[2])] == [0, 0]


def test_processes_that_run_other_commands_or_inputs_stop_before_any_work(models, tmp_path):
    """Two runs on one address pair up, or one process was given other inputs: each says so
    in one line, before reading a byte; nothing is written."""
    other = tmp_path / "other.safetensors"
    other.write_bytes(models[2].read_bytes())  # the same bytes, another file
    out = tmp_path / "out.safetensors"
    for each in ({1: ["average", models[0], models[1], other, "-o", out]},  # another input
                 {1: ["average", *models, "--weights", "1,2,3", "-o", out]}):  # another command
        results = launch(2, "average", *models, "-o", out, each=each)
        assert [r.returncode for r in results] == [2, 2], [r.stderr for r in results]
        for i, r in enumerate(results):
            said = r.stderr.strip().splitlines()
            assert len(said) == 1 and said[0].startswith(f"treecli: error: process {i} of 2 (coordinator "
                                                         "127.0.0.1:"), said
            assert f"): process {1 - i} runs another command, or on other inputs" in said[0], said
            assert "are two runs on one address?" in said[0]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["other.safetensors"]  # no output, no temporary
    touched = launch(2, "average", *models, "-o", out, each={1: ["average", *models, "-o", out]})
    assert [r.returncode for r in touched] == [0, 0]  # the same command and inputs: one run


def test_a_process_failing_while_writing_its_share_stops_them_all(tmp_path):
    """The input opens (a deflated npz: its directory is sound), but the data of a leaf only
    process 1's share of the output reads is corrupt: found only when it reads it, after the
    output exists as a temporary. Every process stops; the temporary goes."""
    import treecli

    treecli.save(model(0), tmp_path / "plain.npz")
    with zipfile.ZipFile(tmp_path / "plain.npz") as plain, \
            zipfile.ZipFile(tmp_path / "bad.npz", "w", zipfile.ZIP_DEFLATED) as deflated:
        for member in plain.namelist():
            deflated.writestr(member, plain.read(member))
    with zipfile.ZipFile(tmp_path / "bad.npz") as z:  # layers.1.w: past the first half of the output's bytes
        info = z.getinfo("layers.1.w.npy")
    data = bytearray((tmp_path / "bad.npz").read_bytes())
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    middle = start + info.compress_size // 2  # (past the .npy header, which opening reads)
    data[middle:middle + 200] = bytes(200)
    (tmp_path / "bad.npz").write_bytes(bytes(data))
    (tmp_path / "plain.npz").unlink()
    out = tmp_path / "out.safetensors"
    results = launch(2, "convert", tmp_path / "bad.npz", out)
    assert [r.returncode for r in results] == [2, 2], [r.stderr for r in results]
    for r in results:
        said = r.stderr.strip().splitlines()
        assert len(said) == 1 and "1 of 2 processes failed (process 1: " in said[0], said
        assert "bad.npz" in said[0] and "nothing was published" in said[0], said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.npz"]  # no output, no temporary


def test_formats_written_alone_are_refused_with_the_way_out(models, tmp_path):
    results = launch(2, "convert", models[0], tmp_path / "out.npz")
    assert [r.returncode for r in results] == [2, 2]
    for r in results:
        assert "several processes writes safetensors and Orbax, not npz" in r.stderr
        assert "Traceback" not in r.stderr
    assert not list(tmp_path.iterdir())


PROGRAM = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, numpy as np, treecli
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from treecli._bytes import local

pid, port, base = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
mesh = Mesh(np.array(jax.devices()), ("x",))  # 4 devices, 2 in each process
w = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
like = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, P("x"))),
        "b": jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(mesh, P()))}
read = [0]
view = local.FileReader.read_view
local.FileReader.read_view = lambda self, buffer, offset: (read.__setitem__(0, read[0] + len(memoryview(buffer))),
                                                           view(self, buffer, offset))[1]
tree = treecli.load(f"{base}/m.safetensors", like=like)  # written by the test beforehand
assert not tree["w"].is_fully_addressable and len(tree["w"].addressable_shards) == 2
for shard in tree["w"].addressable_shards:
    assert np.asarray(shard.data).tobytes() == w[shard.index].tobytes()
assert read[0] == w.nbytes // 2 + 32, read[0]  # its own rows of w, and b (replicated) whole
try:
    treecli.save(tree, f"{base}/out.safetensors")
except treecli.UsageError as e:
    assert "save it as an Orbax checkpoint" in str(e), str(e)
else:
    raise AssertionError("global arrays were written to safetensors")
treecli.save(tree, f"{base}/out", format="orbax")  # every process its own shards
jax.distributed.shutdown()
print("ok")
"""


def test_a_jax_program_of_two_processes_loads_its_shards_and_saves_orbax(tmp_path):
    import treecli

    w = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
    treecli.save({"w": w, "b": np.ones(8, np.float32)}, tmp_path / "m.safetensors")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", PROGRAM, str(i), str(port), str(tmp_path)], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 and out.strip().endswith("ok") for p, (out, _) in zip(procs, results)), \
        [err[-1500:] for _, err in results]
    written = tmp_path / "out"
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= {p.name for p in written.iterdir()}  # Orbax's own layout
    back = treecli.load(written, lazy=False)  # read here, by one process
    assert np.asarray(back["w"]).tobytes() == w.tobytes() and np.asarray(back["b"]).tolist() == [1.0] * 8


def test_distributed_finds_a_slurm_step_as_jax_does(models, tmp_path):
    """``--distributed`` alone: JAX reads SLURM's variables (here those of a two-task step
    on this host), as ``jax.distributed.initialize()`` does in any JAX program."""
    for port in range(61440 + os.getpid() % 4000, 65536):  # SLURM's coordinator port: the job id's
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                break
    slurm = {"SLURM_JOB_ID": str(port - 61440), "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_NTASKS": "2",
             "SLURM_STEP_NUM_NODES": "1"}
    args = ["--distributed", "average", *models, "-o", tmp_path / "slurm.safetensors"]
    procs = [subprocess.Popen([sys.executable, "-m", "treecli", *map(str, args)],
                              env={**ENV, **slurm, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    errors = [p.communicate(timeout=240)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    single = alone("average", *models, "-o", tmp_path / "one.safetensors")
    assert single.returncode == 0, single.stderr
    assert file_sha256(tmp_path / "slurm.safetensors") == file_sha256(tmp_path / "one.safetensors")


def test_incomplete_options_are_one_line():
    result = alone("--coordinator", "127.0.0.1:1", "show", "x.safetensors")
    assert result.returncode == 2
    assert "missing: --num-processes, --process-id" in result.stderr and "Traceback" not in result.stderr


def _one(process: int, count: int, port: int, *args, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "treecli", "--coordinator", f"127.0.0.1:{port}", "--num-processes",
                             str(count), "--process-id", str(process), *map(str, args)], env={**ENV, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("process", [0, 1])
def test_a_peer_that_never_starts_is_one_line_within_the_join_deadline(models, tmp_path, process):
    import time

    port = free_port()
    started = time.monotonic()
    alone_ = _one(process, 2, port, "--join-timeout", "3", "average", *models, "-o", tmp_path / "o.safetensors")
    out, err = alone_.communicate(timeout=60)
    assert time.monotonic() - started < 30
    assert alone_.returncode == 2, err
    said = err.strip().splitlines()
    assert len(said) == 1, said  # no C++ trace
    assert said[0].startswith(f"treecli: error: process {process} of 2 (coordinator 127.0.0.1:{port}): "), said
    assert "could not join the run within 3 s" in said[0] and not list(tmp_path.iterdir())


def test_ctrl_c_ends_a_process_waiting_to_join_at_once(models, tmp_path):
    import signal
    import time

    waiting = _one(1, 2, free_port(), "average", *models, "-o", tmp_path / "o.safetensors")
    time.sleep(3)  # (joining: deaf to signals inside the runtime)
    sent = time.monotonic()
    waiting.send_signal(signal.SIGINT)
    out, err = waiting.communicate(timeout=30)
    assert time.monotonic() - sent < 5
    assert waiting.returncode == 130 and err.strip().splitlines() == ["treecli: interrupted"], err


def test_a_coordinator_address_no_socket_can_have_is_one_line(models, tmp_path):
    result = subprocess.run([sys.executable, "-m", "treecli", "--coordinator", "127.0.0.1:99999", "--num-processes",
                             "2", "--process-id", "1", "show", models[0]], env=ENV, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "treecli: error: --coordinator '127.0.0.1:99999': write HOST:PORT, the port 1 to 65535"], result.stderr


SLOW_TEMPLATE = '''
import os, time
def make():
    if os.environ.get("SLOW_TEMPLATE"):
        time.sleep(120)
    import numpy as np
    return {"w": np.zeros((64, 64), np.float32)}
'''


def test_a_peer_killed_mid_run_stops_the_others_in_one_line(tmp_path):
    import signal
    import time

    import treecli

    treecli.save({"w": np.ones((64, 64), np.float32)}, tmp_path / "m.safetensors")
    (tmp_path / "slowtemplate.py").write_text(SLOW_TEMPLATE)
    port = free_port()
    args = ["average", tmp_path / "m.safetensors", tmp_path / "m.safetensors", "--like", "slowtemplate:make", "-o",
            tmp_path / "o.safetensors"]
    env = {"PYTHONPATH": str(tmp_path)}
    first = _one(0, 2, port, *args, env=env)
    second = _one(1, 2, port, *args, env={**env, "SLOW_TEMPLATE": "1"})
    time.sleep(8)  # both joined; process 1 builds its template
    second.send_signal(signal.SIGKILL)
    second.communicate(timeout=30)
    started = time.monotonic()
    out, err = first.communicate(timeout=120)
    assert time.monotonic() - started < 90
    said = err.strip().splitlines()
    assert first.returncode == 2 and len(said) == 1, said
    assert said[0].startswith(f"treecli: error: process 0 of 2 (coordinator 127.0.0.1:{port}): the run broke"), said
    # nothing published; the runtime ends the process where it stands, as a kill would: only a
    # temporary of treecli's own may remain, which the next write there removes
    left = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("m.safetensors", "slowtemplate.py",
                                                                         "__pycache__"))
    assert all(name.startswith(".treecli-tmp-") for name in left), left
