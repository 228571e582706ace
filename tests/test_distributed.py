"""Every command across processes on JAX's distributed runtime (issue 33, item 4): the same
command launched on N processes on 127.0.0.1, each reading and writing its share, the
output byte-identical to one process's; a failure anywhere publishes nothing."""

from __future__ import annotations

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


def test_diff_on_three_processes_says_what_one_says(models):
    single = alone("diff", models[0], models[1], "--json")
    results = launch(3, "diff", models[0], models[1], "--json")
    assert single.returncode == 1 and [r.returncode for r in results] == [1, 1, 1], [r.stderr for r in results]
    assert results[0].stdout == single.stdout and len(single.stdout) > 100
    assert results[1].stdout == results[2].stdout == ""  # process 0 speaks for all
    same = launch(2, "diff", models[2], models[2])
    assert [r.returncode for r in same] == [0, 0]


def test_a_failing_process_publishes_nothing_and_each_says_one_line(models, tmp_path):
    broken = tmp_path / "broken.safetensors"  # the same header, its data cut short: read fails in process 1's share
    data = models[2].read_bytes()
    broken.write_bytes(data[: len(data) - 4096])
    out = tmp_path / "out.safetensors"
    results = launch(2, "average", *models, "-o", out,
                     each={1: ["average", models[0], models[1], broken, "-o", out]})
    assert [r.returncode for r in results] == [2, 2], [r.stderr for r in results]
    lines = [r.stderr.strip().splitlines() for r in results]
    assert all(len(said) == 1 and said[0].startswith("treecli: error: ") for said in lines), lines
    assert "broken.safetensors" in lines[1][0]  # its own error, naming its input
    assert "1 of 2 processes failed (process 1: " in lines[0][0] and "nothing was published" in lines[0][0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.safetensors"]  # no output, no temporary


def test_a_process_failing_while_writing_its_share_stops_them_all(tmp_path):
    """Process 1's input opens as well as process 0's (a deflated npz: its directory is
    sound), but its data is corrupt: found only when it reads its share, after the output
    exists as a temporary. Every process stops; the temporary goes."""
    import treecli

    treecli.save(model(0), tmp_path / "plain.npz")
    for name, corrupt in (("good.npz", False), ("bad.npz", True)):
        with zipfile.ZipFile(tmp_path / "plain.npz") as plain, \
                zipfile.ZipFile(tmp_path / name, "w", zipfile.ZIP_DEFLATED) as deflated:
            for member in plain.namelist():
                deflated.writestr(member, plain.read(member))
        if corrupt:  # bytes early in the first member's deflate stream
            data = bytearray((tmp_path / name).read_bytes())
            data[200:400] = bytes(200)
            (tmp_path / name).write_bytes(bytes(data))
    (tmp_path / "plain.npz").unlink()
    out = tmp_path / "out.safetensors"
    results = launch(2, "convert", tmp_path / "good.npz", out, each={1: ["convert", tmp_path / "bad.npz", out]})
    assert [r.returncode for r in results] == [2, 2], [r.stderr for r in results]
    for r in results:
        said = r.stderr.strip().splitlines()
        assert len(said) == 1 and "1 of 2 processes failed (process 1: " in said[0], said
        assert "bad.npz" in said[0] and "nothing was published" in said[0], said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.npz", "good.npz"]  # no output, no temporary


def test_formats_written_alone_are_refused_with_the_way_out(models, tmp_path):
    results = launch(2, "convert", models[0], tmp_path / "out.npz")
    assert [r.returncode for r in results] == [2, 2]
    for r in results:
        assert "several processes writes one safetensors file, not npz" in r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.iterdir())


def test_incomplete_options_are_one_line():
    result = alone("--coordinator", "127.0.0.1:1", "show", "x.safetensors")
    assert result.returncode == 2
    assert "missing: --num-processes, --process-id" in result.stderr and "Traceback" not in result.stderr
