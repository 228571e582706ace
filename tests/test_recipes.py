"""CONTRIBUTING.md's recipes, followed: each adds a toy to a copy of the package exactly
as the recipe says (a module and one registry line) and uses it from the command line, in
a child process that imports the copy."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

ROOT = Path(__file__).parent.parent

TOY_METHOD = '''"""toy_midrange: the midpoint of the models' smallest and largest value, plus ``bias``."""

from __future__ import annotations

from treecli.merge_methods._method import LeafMerge, MergeMethod, Param


def toy_midrange(job: LeafMerge):
    import numpy as np

    from treecli.merge_methods import _blocks

    bias = job.shared["bias"]

    def compute(start: int, stop: int, arrays: list, spares: list):
        low, high = spares
        np.minimum.reduce(arrays, out=low)
        np.maximum.reduce(arrays, out=high)
        low += high
        low *= 0.5
        low += bias
        return low

    return _blocks.output_leaf(job.leaves, job.keypath, job.report, compute, spare=2)


METHODS = (
    MergeMethod("toy_midrange", "the midpoint of the models' extremes, plus bias", toy_midrange, base="added",
                models=(2, None), params=(Param("bias", 0.0),)),
)
'''


def _copy_of_the_package(tmp_path: Path) -> Path:
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "treecli", copy / "treecli", ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _treecli(copy: Path, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(copy), "COLUMNS": "200"}
    # (from the copy's folder: ``-m`` puts the working directory first on the path)
    return subprocess.run([sys.executable, "-m", "treecli", *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=copy, timeout=120)


def test_adding_a_merge_method_is_one_module_and_one_registry_line(tmp_path):
    copy = _copy_of_the_package(tmp_path)
    (copy / "treecli" / "merge_methods" / "toy_midrange.py").write_text(TOY_METHOD)
    registry = copy / "treecli" / "merge_methods" / "__init__.py"
    text = registry.read_text()
    registry.write_text(text.replace('    "passthrough",\n', '    "passthrough",\n    "toy_midrange",\n', 1))
    assert registry.read_text().count("\n") == text.count("\n") + 1  # one line

    rng = np.random.default_rng(0)
    models = [{"layers.0.w": rng.standard_normal((4, 6)).astype(np.float32),
               "layers.1.w": rng.standard_normal(5).astype(np.float32), "step": np.array(3)} for _ in range(3)]
    paths = [tmp_path / f"m{i}.safetensors" for i in range(3)]
    for model, path in zip(models, paths):
        save_file(model, str(path))

    merged = _treecli(copy, "merge", "--method", "toy_midrange", *paths, "--param", "bias=0.5",
                      "-o", tmp_path / "out.safetensors")
    assert merged.returncode == 0, merged.stderr
    out = load_file(str(tmp_path / "out.safetensors"))
    for key in ("layers.0.w", "layers.1.w"):
        stack = np.stack([m[key] for m in models]).astype(np.float64)
        want = ((stack.min(axis=0) + stack.max(axis=0)) * 0.5 + 0.5).astype(np.float32)
        assert out[key].tobytes() == want.tobytes()
    assert out["step"] == 3

    # a mergekit config names it, its parameter included; a base given is one more model
    (tmp_path / "toy.yml").write_text(f"merge_method: toy_midrange\nbase_model: {paths[0]}\n"
                                      f"models: [{{model: {paths[1]}}}, {{model: {paths[2]}}}]\n"
                                      "parameters: {bias: 0.5}\n")
    configured = _treecli(copy, "merge", "--config", tmp_path / "toy.yml", "-o", tmp_path / "config.safetensors")
    assert configured.returncode == 0, configured.stderr
    assert load_file(str(tmp_path / "config.safetensors"))["layers.0.w"].tobytes() == out["layers.0.w"].tobytes()

    # the help, the completion and the refusals read the registry
    assert "toy_midrange" in re.sub(r"\s+", " ", _treecli(copy, "merge", "--help").stdout)
    completion = subprocess.run([sys.executable, "-c", "from treecli.cli._complete import complete_methods; "
                                 "print(complete_methods('toy'))"], capture_output=True, text=True,
                                env={**os.environ, "PYTHONPATH": str(copy)}, cwd=copy, timeout=60)
    assert completion.stdout.strip() == "['toy_midrange']"
    one = _treecli(copy, "merge", "--method", "toy_midrange", paths[0], "-o", tmp_path / "one.safetensors")
    assert one.returncode == 2 and "toy_midrange merges at least 2 models; 1 were given" in one.stderr
    typo = _treecli(copy, "merge", "--method", "toy_midrange", *paths, "--param", "bais=1", "-o", tmp_path / "t.st")
    assert typo.returncode == 2 and "toy_midrange has no parameter 'bais'" in typo.stderr


TOY_COMMAND = '''"""``treecli count``: how many leaves a checkpoint holds, and their bytes."""

from __future__ import annotations

from typing import Annotated

import typer

from treecli.cli import _options as opt
from treecli.cli._common import about, open_input
from treecli.cli._output import Output


def count(
    checkpoint: Annotated[str, typer.Argument(help="A checkpoint (a path or URL).", metavar="CHECKPOINT",
                                              show_default=False)],
    input_format: opt.InputFormatOpt = None,
    quiet: opt.QuietOpt = False,
) -> None:
    """Count a checkpoint's leaves and the bytes of its arrays."""
    from treecli import _tree

    out = Output(quiet=quiet)
    with open_input(out, checkpoint, input_format) as ckpt, about(checkpoint):
        out.print(f"{len(_tree.flatten(ckpt.tree))} leaves, {_tree.array_bytes(ckpt.tree)} bytes")
'''


def test_adding_a_command_is_one_module_and_one_line(tmp_path):
    copy = _copy_of_the_package(tmp_path)
    (copy / "treecli" / "cli" / "count.py").write_text(TOY_COMMAND)
    app = copy / "treecli" / "cli" / "__init__.py"
    text = app.read_text()
    app.write_text(text.replace('    "get": "treecli.cli.get:get",\n',
                                '    "get": "treecli.cli.get:get",\n    "count": "treecli.cli.count:count",\n', 1))
    assert app.read_text().count("\n") == text.count("\n") + 1

    model = tmp_path / "m.safetensors"
    save_file({"a.w": np.ones((2, 3), np.float32), "a.b": np.zeros(3, np.int64)}, str(model))
    counted = _treecli(copy, "count", model)
    assert counted.returncode == 0, counted.stderr
    assert counted.stdout.strip() == "2 leaves, 48 bytes"
    assert "count" in _treecli(copy, "--help").stdout
    assert "Count a checkpoint's leaves" in _treecli(copy, "count", "--help").stdout
    # the error boundary, the same for every command: one line, exit 2, no traceback
    missing = _treecli(copy, "count", tmp_path / "missing.safetensors")
    assert missing.returncode == 2 and missing.stderr.startswith("treecli: error: ")
    assert "no such file" in missing.stderr and "Traceback" not in missing.stderr
