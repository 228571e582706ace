"""The multi-GB variants of the reliability cases (RELIABILITY.md 17 and 30c).

Marked slow: they write tens of GB. Run by hand with ``pytest -m slow`` on a
disk with 40 GB free; CI runs the small variants in test_reliability.py.
"""

from __future__ import annotations

import json
import os
import pty
import random
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from .conftest import KILL_EDIT, file_sha256, kill_edit_trials

pytestmark = pytest.mark.slow

ROWS, COLS = 32768, 4096  # 512 MiB of float32 per leaf


def _write_fp32_checkpoint(path: Path, leaves: int, seed: int) -> None:
    """A safetensors file of ``leaves`` [ROWS, COLS] float32 leaves, streamed (never held whole).

    Leaf k is a 64 MiB random block repeated 8 times plus k: real, distinct values
    at a fraction of the cost of drawing 8 GB of random numbers.
    """
    block = np.random.default_rng(seed).standard_normal(ROWS * COLS // 8, dtype=np.float32)
    nbytes = ROWS * COLS * 4
    header = {f"layers.{k}.w": {"dtype": "F32", "shape": [ROWS, COLS], "data_offsets": [k * nbytes, (k + 1) * nbytes]}
              for k in range(leaves)}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for k in range(leaves):
            part = block + np.float32(k)
            for _ in range(8):
                f.write(part.data)


def _leaf_values(path: Path, k: int, start: int, stop: int) -> np.ndarray:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        f.seek(8 + n + (k * ROWS * COLS + start) * 4)
        return np.frombuffer(f.read((stop - start) * 4), np.float32)


MEASURED_AVERAGE = r"""
import sys
from treecli.cli import main
code = main(["average", *sys.argv[1:4], "--weights", "1,2,3", "-o", sys.argv[4]])
with open("/proc/self/status") as f:
    peak_mb = int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) // 1024
print(code, peak_mb, flush=True)
"""


@pytest.fixture(autouse=True)
def _free_the_disk_afterwards(tmp_path):
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)  # tens of GB, which pytest would keep for three runs


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="peak RSS read from /proc (Linux)")
def test_average_of_three_8_gib_checkpoints_in_flat_memory_with_progress(tmp_path):
    """Case 30c: 3 x 8 GiB fp32 -> peak RSS of a few chunks, a progress bar on a terminal's
    stderr, and every output element within DESIGN.md's accuracy oracle."""
    if shutil.disk_usage(tmp_path).free < 40 << 30:
        pytest.skip("needs 40 GB free")
    inputs = [tmp_path / f"in{i}.safetensors" for i in range(3)]
    for i, path in enumerate(inputs):
        _write_fp32_checkpoint(path, leaves=16, seed=i)
    out = tmp_path / "soup.safetensors"
    primary, secondary = pty.openpty()  # stderr is a terminal: the progress bar shows
    progress = bytearray()
    reader = threading.Thread(target=lambda: _drain(primary, progress), daemon=True)
    reader.start()
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", MEASURED_AVERAGE, *map(str, inputs), str(out)],
                          stdout=subprocess.PIPE, stderr=secondary, text=True)
    elapsed = time.perf_counter() - start
    os.close(secondary)
    reader.join(timeout=10)
    code, peak_mb = proc.stdout.split()
    assert code == "0"
    assert int(peak_mb) < 512, f"peak RSS {peak_mb} MB"  # measured 49 MB; one leaf alone is 512 MiB
    assert b"writing soup.safetensors" in progress, bytes(progress[-500:])
    weights = np.array([1.0, 2.0, 3.0]) / 6
    step = 1 << 24
    for k in range(16):
        for s in range(0, ROWS * COLS, step):
            reference = sum(w * _leaf_values(p, k, s, s + step).astype(np.float64) for w, p in zip(weights, inputs))
            np.testing.assert_allclose(_leaf_values(out, k, s, s + step), reference, rtol=1e-6, atol=1e-7)
    print(f"3 x 8 GiB average: {elapsed:.1f} s, peak RSS {peak_mb} MB")


def _drain(fd: int, into: bytearray) -> None:
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            return
        if not data:
            return
        into.extend(data)


def test_kill_9_during_a_1_gib_write_leaves_the_old_output_none_or_the_complete_new_one(tmp_path):
    """Case 17 at 1 GiB: 10 SIGKILLs at random moments of `edit -o` (5 with an old output)."""
    src = tmp_path / "big.safetensors"
    _write_fp32_checkpoint(src, leaves=2, seed=0)
    out = tmp_path / "out.safetensors"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", KILL_EDIT, str(src), str(out)], check=True)
    full = time.perf_counter() - start
    expected = file_sha256(out)
    random.seed(17)
    outcomes = kill_edit_trials(src, out, 10, (0.2, full), lambda path: file_sha256(path) == expected)  # bit for bit
    print(f"1 GiB kill -9: {outcomes}, an uninterrupted write takes {full:.1f} s")
