"""Every example in the README, CONTRIBUTING.md, docs/ and each command's --help runs, on real inputs
made by the real libraries (so that none can rot again).

Examples use the names a user would (model.safetensors, ckpt_dir, run1, ...):
a sandbox holds a checkpoint under each such name. The README's blocks run in
order, each in a fresh sandbox (a later line may use an earlier line's output);
each --help example runs in a fresh sandbox of its own.
"""

import json
import re
import shlex
import shutil
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from treecli.cli import app

from .conftest import run_cli

ocp = pytest.importorskip("orbax.checkpoint")

ROOT = Path(__file__).parent.parent
BF16 = np.dtype(ml_dtypes.bfloat16)
# Lines that change the machine rather than a checkpoint.
NOT_RUN = {"treecli --install-completion"}


def _hf_dir(path: Path, tensors: dict) -> None:
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text('{"model_type": "tiny"}')


def _soup_member(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"encoder.w": rng.standard_normal((4, 8)).astype(np.float32),
            "embed.weight": rng.standard_normal((16, 8)).astype(BF16)}


def _manager(root: Path, steps, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with ocp.CheckpointManager(str(root)) as manager:
        for step in steps:
            state = {"step": np.asarray(step, np.int32),
                     "params": {"dense": {"kernel": rng.standard_normal((8, 4)).astype(np.float32)}}}
            manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                       metadata=ocp.args.JsonSave({"step": step})))
        manager.wait_until_finished()


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    box = tmp_path_factory.mktemp("sandbox")
    tiny = ROOT / "examples" / "tiny.safetensors"
    shutil.copytree(ROOT / "examples", box / "examples")
    shutil.copy(tiny, box / "model.safetensors")
    box.joinpath("Llama-3-8B").mkdir()
    shutil.copy(tiny, box / "Llama-3-8B" / "model.safetensors")
    (box / "Llama-3-8B" / "config.json").write_text('{"model_type": "llama"}')
    rng = np.random.default_rng(0)
    ckpt = {"_orig_mod.encoder.w": rng.standard_normal((4, 8)).astype(np.float32),
            "embed.weight": rng.standard_normal((16, 8)).astype(np.float32),
            "head.kernel": rng.standard_normal((8, 8)).astype(np.float32),
            "head.bias": np.zeros(8, np.float32),
            "opt_state.mu": np.zeros(8, np.float32)}
    save_file(ckpt, str(box / "ckpt.safetensors"))
    np.save(box / "new_head.npy", np.ones((8, 8), np.float32))
    _hf_dir(box / "ckpt", {
        "model.layers.0.mlp.up.weight": rng.standard_normal((8, 4)).astype(np.float32),
        "encoder.layers.w": rng.standard_normal((4, 8, 8)).astype(np.float32),
        "decoder.layers.w": rng.standard_normal((2, 8, 8)).astype(np.float32),
        "ensemble.w": rng.standard_normal((3, 8, 200)).astype(np.float32),
        "params.dense.kernel": rng.standard_normal((8, 100)).astype(np.float32),
        "opt_state.mu": np.zeros(8, np.float32),
        "embed.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "head.bias": np.zeros(8, np.float32)})
    for i, name in enumerate(["a", "b", "c", "base", "ft", "ft_a", "ft_b"]):
        save_file(_soup_member(i), str(box / f"{name}.safetensors"))
        if name in ("b", "base", "ft_a", "ft_b"):  # also as directories, as some examples name them
            _hf_dir(box / name, _soup_member(i))
    (box / "merge.yml").write_text("merge_method: ties\nbase_model: base.safetensors\nmodels:\n"
                                   "  - model: ft_a.safetensors\n    parameters: {density: 0.5, weight: [0.3, 1.0]}\n"
                                   "  - model: ft_b.safetensors\n    parameters: {density: 0.5, weight: 0.5}\n")
    for i, name in enumerate(["s100", "s200", "s300", "step_100", "step_200", "step_300"]):
        _hf_dir(box / name, _soup_member(i))
    shutil.copytree(box / "b", box / "converted_dir")
    shutil.copytree(box / "Llama-3-8B", box / "hf_repo")
    train = {"step": np.asarray(3, np.int32), "params": {"dense": {"kernel": rng.standard_normal((8, 4)).astype(
        np.float32)}, "embed": rng.standard_normal((16, 8)).astype(BF16)}, "name": "run", "empty": {}}
    ocp.PyTreeCheckpointer().save(str(box / "orbax_ckpt"), train)
    ocp.PyTreeCheckpointer().save(str(box / "ckpt_dir"), train)
    _manager(box / "run1", (100, 200, 300), 0)
    _manager(box / "run2", (100, 200, 300), 1)
    _manager(box / "runs" / "exp1", (1000, 2000), 2)
    _equinox_model(box)
    _pytorch_files(box)
    _gguf_file(box / "model.gguf")
    _models(box)
    return box


def _models(box: Path) -> None:
    """HF Llama and Qwen2 directories (tiny ones), and the Llama as the llama.cpp recipe writes it."""
    from .tiny_llama import write_model

    write_model(box / "Llama-3.2-1B", "llama")
    write_model(box / "Qwen2-0.5B", "qwen2")
    result = run_cli("convert", box / "Llama-3.2-1B", box / "llama.gguf", "--recipe", "llama.cpp", "-q")
    assert result.code == 0, result.stderr
    from .test_blockscaled import _fp8_model  # (FP8 block-scaled HF directories, as DeepSeek-V3's)

    _fp8_model(box / "model-fp8")
    _fp8_model(box / "other-fp8", seed=1)


def _gguf_file(path: Path) -> None:
    """A tiny llama.cpp model: one float tensor, one Q8_0."""
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    weights = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "tiny")
    writer.add_tensor("token_embd.weight", weights)
    quantized = quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", quantized, raw_shape=quantized.shape,
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _pytorch_files(box: Path) -> None:
    """`pytorch_model.bin`, a training `checkpoint.pt` and an HF directory of `.bin` shards."""
    torch = pytest.importorskip("torch")
    state = {f"model.layers.{i}.weight": torch.randn(8, 4) for i in range(2)}
    torch.save(state, box / "pytorch_model.bin")
    torch.save({"model": state, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]}, "epoch": 3},
               box / "checkpoint.pt")
    hf = box / "Llama-2-7b-hf"
    hf.mkdir()
    names = {"pytorch_model-00001-of-00002.bin": ["model.layers.0.weight"],
             "pytorch_model-00002-of-00002.bin": ["model.layers.1.weight"]}
    for name, keys in names.items():
        torch.save({k: state[k] for k in keys}, hf / name)
    weight_map = {k: name for name, keys in names.items() for k in keys}
    (hf / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (hf / "config.json").write_text('{"model_type": "llama"}')
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": state, "step": 1000}, checkpoint_id=box / "step-1000")


MODELS = """
import equinox as eqx, jax

def make_model():
    return eqx.nn.MLP(2, 3, 4, 2, key=jax.random.PRNGKey(0))
"""


def _equinox_model(box: Path) -> None:
    """`mypkg.models:make_model`, a user's model code, and `model.eqx` written by Equinox."""
    eqx = pytest.importorskip("equinox")
    (box / "mypkg").mkdir()
    (box / "mypkg" / "__init__.py").write_text("")
    (box / "mypkg" / "models.py").write_text(MODELS)
    import jax

    eqx.tree_serialise_leaves(box / "model.eqx", eqx.nn.MLP(2, 3, 4, 2, key=jax.random.PRNGKey(1)))


def _outputs(args: list[str]) -> list[str]:
    """What a command line writes: -o's value, and convert's TARGET."""
    out = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-o", "--output")]
    positional = [a for a in args[1:] if not a.startswith("-")]
    if args[:1] == ["convert"] and len(positional) > 1:  # (not convert --list-recipes)
        out.append(positional[1])
    return out


def _run(box: Path, line: str, monkeypatch) -> None:
    args = shlex.split(line)[1:]
    for name in _outputs(args):
        target = box / name
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    monkeypatch.chdir(box)
    result = run_cli(*args)
    allowed = (0, 1) if args[:1] in (["diff"], ["verify"]) else (0,)
    assert result.code in allowed, f"{line}\n{result.stderr}"


DOCUMENTS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def _readme_blocks() -> list[list[str]]:
    """The ``sh`` blocks of the README, CONTRIBUTING.md and every page of docs/."""
    text = "\n".join(path.read_text() for path in DOCUMENTS)
    blocks = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)  # continued lines
        lines = [re.split(r"\s+#\s", line)[0].strip() for line in joined.splitlines()]
        lines = [line for line in lines if line.startswith("treecli ") and line not in NOT_RUN]
        if lines:
            blocks.append(lines)
    return blocks


def _help_examples() -> list[str]:
    examples = []
    for command in app.registered_commands:
        doc = command.callback.__doc__ or ""
        examples += [line.strip() for line in doc.splitlines() if line.strip().startswith("treecli ")]
    return examples


def test_the_readme_and_help_have_examples_to_run():
    assert sum(len(b) for b in _readme_blocks()) >= 30
    assert len(_help_examples()) >= 20


@pytest.mark.parametrize("block", _readme_blocks(), ids=lambda b: b[0][:60])
def test_readme_examples_run(block, template, tmp_path, monkeypatch):
    box = tmp_path / "box"
    shutil.copytree(template, box, symlinks=True)
    for line in block:
        _run(box, line, monkeypatch)


@pytest.mark.parametrize("line", _help_examples(), ids=lambda line: line[:60])
def test_help_examples_run(line, template, tmp_path, monkeypatch):
    box = tmp_path / "box"
    shutil.copytree(template, box, symlinks=True)
    _run(box, line, monkeypatch)


def _python_blocks() -> list[str]:
    """The ``python`` blocks of the same documents."""
    return [block for path in DOCUMENTS for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S)]


@pytest.mark.parametrize("block", _python_blocks(), ids=lambda b: b.strip().splitlines()[-1][:60])
def test_python_examples_run(block, template, tmp_path, monkeypatch):
    """Each block runs as written in a fresh sandbox, where its file names exist."""
    pytest.importorskip("equinox")
    box = tmp_path / "box"
    shutil.copytree(template, box, symlinks=True)
    monkeypatch.chdir(box)
    monkeypatch.syspath_prepend(str(box))
    exec(compile(block, "<example>", "exec"), {"__name__": "__example__"})


def test_the_merge_methods_table_lists_the_registry():
    """docs/merging.md's table of methods has a row per registered method, in the
    registry's order, naming every parameter the method declares (or the method whose
    parameters it shares: "as `dare_linear`")."""
    from treecli.merge_methods import METHODS, REGISTRY

    text = (ROOT / "docs" / "merging.md").read_text()
    table = text[text.index("## The methods"):].split("\n## ")[0]
    rows = {}
    for line in table.splitlines():
        cells = re.split(r"(?<!\\)\|", line)  # (a pipe inside a cell is escaped, or it splits the row)
        found = re.fullmatch(r" `(\w+)` ", cells[1]) if len(cells) == 7 else None
        if found:
            rows[found.group(1)] = cells[4]
    assert tuple(rows) == METHODS

    def documented(name: str) -> str:
        cell = rows[name]
        shared = re.match(r"\s*as `(\w+)`", cell)
        return cell + (documented(shared.group(1)) if shared else "")

    missing = [f"{name}: {p.name}" for name in METHODS for p in REGISTRY[name].params
               if f"`{p.name}`" not in documented(name)]
    assert missing == []


def test_contributing_names_every_module_of_the_package():
    """CONTRIBUTING.md's layout is the package's: every top-level module and subpackage
    of treecli is named there (a new one without its line fails here)."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    package = ROOT / "treecli"
    names = [p.name for p in package.glob("*.py") if p.name != "__init__.py"]
    names += [f"{p.name}/" for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert [name for name in names if name not in text] == []
