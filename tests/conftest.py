"""Shared fixtures: checkpoints built by the reference libraries, and an
in-process runner for the CLI that goes through its real error boundary."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from treecli.cli import main

BF16 = np.dtype(ml_dtypes.bfloat16)

# Every cloud client the tests start stays off the network: no probe of an EC2 or GCE
# metadata server (a dead loopback port), test credentials, no proxy for the loopback.
for _name, _value in {"AWS_EC2_METADATA_DISABLED": "true", "GCE_METADATA_HOST": "127.0.0.1:9",
                      "GCE_METADATA_IP": "127.0.0.1:9", "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token",
                      "NO_GCE_CHECK": "True"}.items():
    os.environ[_name] = _value


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    @property
    def json(self):
        return json.loads(self.stdout)


def run_cli(*args: str | Path) -> Result:
    """Run ``treecli ARGS`` in-process through ``main`` (the error boundary)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return Result(code, out.getvalue(), err.getvalue())


@pytest.fixture
def cli():
    return run_cli


def assert_clean_error(result: Result, *fragments: str) -> None:
    """Oracle E: exit 2, one `treecli: error: ...` line first, no traceback."""
    assert result.code == 2, (result.code, result.stderr)
    first = result.stderr.splitlines()[0]
    assert first.startswith("treecli: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in first, (fragment, first)


def snapshot(directory: Path) -> dict[str, tuple[int, str]]:
    """Names, sizes and hashes of every file under a directory (oracles N and U)."""
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(directory))] = (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def raw_safetensors(header: dict | bytes | str, data: bytes = b"", header_len: int | None = None) -> bytes:
    """Hand-built safetensors bytes (for malformed files)."""
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode()
    n = len(header) if header_len is None else header_len
    return struct.pack("<Q", n) + header + data


def mixed_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """A small model with the dtypes users have: bf16, fp16, fp32, fp8, ints, bool, 0-d, zero-size."""
    rng = np.random.default_rng(seed)
    return {
        "model.embed.weight": rng.standard_normal((10, 4)).astype(BF16),
        "model.layers.0.attn.q.weight": rng.standard_normal((4, 4)).astype(np.float32),
        "model.layers.0.attn.q.bias": rng.standard_normal(4).astype(np.float16),
        "model.layers.1.attn.q.weight": rng.standard_normal((4, 4)).astype(np.float32),
        "model.layers.1.attn.q.bias": rng.standard_normal(4).astype(np.float16),
        "model.layers.10.attn.q.weight": rng.standard_normal((4, 4)).astype(np.float32),
        "model.layers.10.attn.q.bias": rng.standard_normal(4).astype(np.float16),
        "model.fp8": rng.standard_normal(6).astype(ml_dtypes.float8_e4m3fn),
        "model.fp8b": rng.standard_normal(5).astype(ml_dtypes.float8_e5m2),
        "model.int8": rng.integers(-128, 127, 7).astype(np.int8),
        "model.mask": rng.integers(0, 2, (2, 3)).astype(bool),
        "step": np.asarray(2**40 + 3, np.int64),
        "empty": np.zeros((2, 0), np.float32),
    }


@pytest.fixture
def mixed_file(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    tensors = mixed_tensors()
    path = tmp_path / "mixed.safetensors"
    save_file(tensors, str(path), metadata={"format": "np", "note": "made by the reference library"})
    return path, tensors


@pytest.fixture
def sharded_dir(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """An HF-style sharded directory made with the reference writer, plus a config.json."""
    tensors = mixed_tensors(1)
    directory = tmp_path / "sharded"
    directory.mkdir()
    names = sorted(tensors)
    shards = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        shard_name = f"model-0000{i}-of-00002.safetensors"
        save_file({k: tensors[k] for k in shard}, str(directory / shard_name), metadata={"format": "pt"})
        weight_map.update({k: shard_name for k in shard})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text('{"model_type": "tiny"}')
    return directory, tensors


def bits(array: np.ndarray) -> bytes:
    """Bytes of an array for bit-exact comparisons (NaN payloads, -0.0 included)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).tobytes()


@pytest.fixture(autouse=True)
def _no_color(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    os.umask(0o022)


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


KILL_EDIT = r"""
import sys
from treecli.cli import main
sys.exit(main(["edit", sys.argv[1], "-o", sys.argv[2], "--force", "--scale", "**=0.5", "--quiet"]))
"""


def kill_edit_trials(src: Path, out: Path, trials: int, delays: tuple[float, float],
                     is_complete: Callable[[Path], bool]) -> dict[str, int]:
    """SIGKILL `treecli edit SRC -o OUT`, every other trial with an old output in place: in
    half the trials once its temporary output holds a random share of the output's bytes
    (mid-write, however fast the machine), in the other half after a random delay in
    ``delays`` (seconds: anywhere from start-up to after the end). Asserts that each time
    OUT is the old bytes, absent, or complete (``is_complete``), never torn, and the input
    untouched; returns how often each happened."""
    import random
    import subprocess
    import sys
    import time

    src_digest = file_sha256(src)
    outcomes = {"old": 0, "absent": 0, "new": 0}
    for trial in range(trials):
        old = b"previous output %d" % trial if trial % 2 == 0 else None
        if old is None:
            out.unlink(missing_ok=True)
        else:
            out.write_bytes(old)
        earlier = set(out.parent.glob(".treecli-tmp-*"))  # left by earlier kills
        proc = subprocess.Popen([sys.executable, "-c", KILL_EDIT, str(src), str(out)])
        if (trial // 2) % 2 == 0:
            wait_for_temporary(proc, out.parent, random.uniform(0.05, 0.95) * src.stat().st_size, earlier)
        else:
            time.sleep(random.uniform(*delays))
        proc.kill()
        proc.wait()
        if not out.exists():
            assert old is None
            outcomes["absent"] += 1
        elif old is not None and out.read_bytes() == old:
            outcomes["old"] += 1
        else:
            assert is_complete(out)
            outcomes["new"] += 1
    assert file_sha256(src) == src_digest
    leftovers = [p.name for p in out.parent.iterdir() if p not in (src, out)]
    assert all(name.startswith(".treecli-tmp-") for name in leftovers), leftovers
    assert outcomes["old"] + outcomes["absent"] > 0, outcomes  # some kills did land mid-write
    return outcomes


def wait_for_temporary(proc, directory: Path, size: float, earlier: set = frozenset(), timeout: float = 60) -> None:
    """Returns once a temporary output in ``directory`` that was not there before
    (``earlier``) holds ``size`` bytes, or once the process has ended: a signal sent then
    lands mid-write, however fast the machine."""
    import time

    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        for path in set(directory.glob(".treecli-tmp-*")) - earlier:
            try:
                if path.stat().st_size >= size:
                    return
            except FileNotFoundError:  # renamed into place meanwhile
                pass
        time.sleep(0.0005)


def pytest_collection_modifyitems(config, items):
    """Multi-GB cases run only when asked for: ``pytest -m slow``."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="multi-GB case: run by hand with `pytest -m slow`")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def without_file(result: Result) -> dict:
    """A `show --json` document less the name of what was shown: a remote copy's equals the local one's."""
    return {k: v for k, v in result.json.items() if k != "file"}


@pytest.fixture(scope="session")
def orbax_run(tmp_path_factory):
    """A CheckpointManager root of two steps (10, 20), each a PyTree item (OCDBT) and a JSON
    item, and ``plain``: a PyTree checkpoint stored without OCDBT. For the remote tests."""
    ocp = pytest.importorskip("orbax.checkpoint")
    base = tmp_path_factory.mktemp("orbax_run")
    with ocp.CheckpointManager(str(base / "run")) as manager:
        for step in (10, 20):
            state = {"params": {"w": np.full((4, 3), step, np.float32), "b": np.arange(3, dtype=np.int64)},
                     "step": np.asarray(step, np.int32)}
            manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                       meta=ocp.args.JsonSave({"step": step})))
        manager.wait_until_finished()
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False))
    checkpointer.save(str(base / "plain"), args=ocp.args.PyTreeSave({"w": np.arange(6, dtype=np.float32)}))
    return base


def small_model(seed: int = 0, layers: int = 4) -> dict[str, np.ndarray]:
    """An embedding and ``layers`` square weights, as HF names them."""
    rng = np.random.default_rng(seed)
    out = {"model.embed.weight": rng.standard_normal((64, 32)).astype(np.float32)}
    for i in range(layers):
        out[f"model.layers.{i}.w"] = rng.standard_normal((32, 32)).astype(np.float32)
    return out


def publish_sharded(put: Callable[[str, bytes], None], prefix: str, shards: int, local: Path) -> Path:
    """An HF sharded repository made in the directory ``local``, each file handed to
    ``put(f"{prefix}/{name}", bytes)`` (a server's or a bucket's)."""
    local.mkdir()
    tensors = small_model(layers=shards * 2)
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(local / shard))
        put(f"{prefix}/{shard}", (local / shard).read_bytes())
        weight_map.update(dict.fromkeys(part, shard))
    index = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    (local / "model.safetensors.index.json").write_bytes(index)
    put(f"{prefix}/model.safetensors.index.json", index)
    return local
