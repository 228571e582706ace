"""mergekit itself as the oracle of ``treecli merge --config`` (issue 35): mergekit's own
example configs (tests/data/mergekit/example-*.yml, as mergekit ships them) and one config
per method more, run unchanged by ``mergekit-yaml`` and by treecli on small Llama-layout
models (40 layers, with a ``config.json`` mergekit accepts) that sit at the paths the
configs name; then by treecli again on Orbax copies of the same models at the same paths.

mergekit is not a dependency: it runs from its own virtual environment (a CPU torch),
named by ``TREECLI_MERGEKIT`` (its ``mergekit-yaml``) or found on PATH; without it these
tests are skipped. Set it up once with::

    python3 -m venv /tmp/mk && /tmp/mk/bin/pip install torch==2.13.0 mergekit==0.1.5
    TREECLI_MERGEKIT=/tmp/mk/bin/mergekit-yaml .venv/bin/python -m pytest tests/test_mergekit_oracle.py

Agreement: mergekit computes in the config's ``dtype`` (float16 in its examples), treecli
in float64 and rounds once, so an output element may differ by the rounding of mergekit's
own arithmetic: float32 outputs within 2e-6 of the tensor's largest magnitude (2e-5 for
the per-row statistics of 8-element rows, ill-conditioned in mergekit's float32), float16
and bfloat16 ones within 2 units in the last place, except where mergekit's TIES ranks
float16-rounded deltas (at most 1% of elements kept otherwise at the cut). Arcee Fusion
is not deterministic in mergekit (it samples) and rounds its KL divergence in the config's
dtype (in bfloat16 to 0 in most rows of these small models): every output element is the
base's or the model's, and in float32 at most 0.2% choose otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from .conftest import run_cli

DATA = Path(__file__).parent / "data" / "mergekit"
MERGEKIT = os.environ.get("TREECLI_MERGEKIT") or shutil.which("mergekit-yaml")
pytestmark = pytest.mark.skipif(not MERGEKIT, reason="mergekit-yaml not found: set TREECLI_MERGEKIT (see the docstring)")

LAYERS, HIDDEN, INTERMEDIATE, VOCAB = 40, 8, 16, 32
# Fine-tunes are their base plus a change in about half their elements (the rest equal to the
# base: RAM's and TIES' zeros); model_b is model_a changed.
FAMILIES = {
    "TheBloke/Llama-2-13B-fp16": ["psmathur/orca_mini_v3_13b", "garage-bAInd/Platypus2-13B",
                                  "WizardLM/WizardLM-13B-V1.2", "WizardLM/WizardMath-13B-V1.0"],
    "mistralai/Mistral-7B-v0.1": ["mistralai/Mistral-7B-Instruct-v0.2", "BioMistral/BioMistral-7B"],
    "model_a": ["model_b"],
}
CONFIGS = sorted(p.name for p in DATA.glob("*.yml"))


def _shapes() -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
                       **{p + f"self_attn.{n}_proj.weight": (HIDDEN, HIDDEN) for n in "qkvo"},
                       p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN), p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
                       p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE)})
    return shapes


def _write_model(root: Path, name: str, tensors: dict[str, np.ndarray]) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": 2,
        "num_key_value_heads": 2, "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "max_position_embeddings": 64,
        "torch_dtype": "float32", "tie_word_embeddings": False}))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root, orbax = tmp_path_factory.mktemp("models"), tmp_path_factory.mktemp("orbax")
    make_models(root, orbax)
    return root, orbax


def make_models(root: Path, orbax: Path) -> None:
    """The models at the paths the configs name: safetensors HF folders, and Orbax copies."""
    rng = np.random.default_rng(35)
    for base_name, tunes in FAMILIES.items():
        base = {n: rng.standard_normal(s).astype(np.float32) for n, s in _shapes().items()}
        _write_model(root, base_name, base)
        for name in tunes:
            changed = {n: (v + rng.standard_normal(v.shape) * 0.05 * (rng.random(v.shape) < 0.5)).astype(np.float32)
                       for n, v in base.items()}
            _write_model(root, name, changed)
    for folder in root.glob("**/config.json"):
        name = folder.parent.relative_to(root)
        (orbax / name).parent.mkdir(parents=True, exist_ok=True)
        result = run_cli("convert", folder.parent / "model.safetensors", orbax / name, "--format", "orbax")
        assert result.code == 0, result.stderr


def _mergekit(config: str, root: Path, out: Path) -> dict[str, np.ndarray]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([MERGEKIT, str(DATA / config), str(out), "--no-write-model-card", "--no-copy-tokenizer"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return load_file(str(out / "model.safetensors"))


def _treecli(config: str, root: Path, out: Path) -> dict[str, np.ndarray]:
    cwd = os.getcwd()
    os.chdir(root)  # the configs name their models relative to where the merge runs, as mergekit's
    try:
        result = run_cli("merge", "--config", DATA / config, "-o", out)
    finally:
        os.chdir(cwd)
    assert result.code == 0, result.stderr
    return load_file(str(out))


# Per-row statistics over rows of 8 elements, where mergekit's float32 cosines are
# ill-conditioned; treecli meets the float64 references of test_merge_methods.py there.
ROW_WISE = {"model_stock_filter_wise.yml", "nuslerp_columns.yml"}
# The magnitude selections of mergekit's float16 arithmetic rank deltas rounded to float16:
# among equal magnitudes at the cut it keeps other elements than treecli's exact ranking.
SELECTS_IN_FP16 = {"example-ties.yml", "example-bio-merge.yml"}


def _assert_agree(config: str, theirs: dict[str, np.ndarray], ours: dict[str, np.ndarray],
                  inputs: list[dict[str, np.ndarray]]) -> None:
    assert sorted(ours) == sorted(theirs)
    far = total = 0
    for name, want in theirs.items():
        got = ours[name]
        assert got.shape == want.shape, name
        a, b = got.astype(np.float64), want.astype(np.float64)
        total += a.size
        if "arcee_fusion" in config:
            # each element the base's or the model's (mergekit writes float32 here: its mask promotes)
            base, model = (x[name].astype(got.dtype).astype(np.float64) for x in inputs)
            assert np.all((a == base) | (a == model)), name
            # mergekit's base + (model - base) · mask: the model's value up to float32 rounding
            their_choice = np.abs(b - model) < np.abs(b - base)
            far += int(np.count_nonzero(((a == model) != their_choice) & (model != base)))
            continue
        assert got.dtype == want.dtype, name
        if want.dtype == np.float32:
            bound = (2e-5 if config in ROW_WISE else 2e-6) * max(1.0, float(np.max(np.abs(b))))
            assert np.max(np.abs(a - b)) <= bound, (name, float(np.max(np.abs(a - b))))
        else:  # float16, bfloat16: in units in the last place of mergekit's value
            beyond = np.abs(a - b) > 2 * np.abs(np.spacing(want)).astype(np.float64)
            far += int(np.count_nonzero(beyond))
            assert config in SELECTS_IN_FP16 or not beyond.any(), name
    if config == "arcee_fusion_float32.yml":  # a quantile an element's importance can sit on, in float32
        assert far <= 0.002 * total, far
    if config in SELECTS_IN_FP16:
        assert far <= 0.01 * total, far


def _inputs(config: str, root: Path) -> list[dict[str, np.ndarray]]:
    if "arcee_fusion" not in config:
        return []
    return [load_file(str(root / name / "model.safetensors")) for name in ("model_a", "model_b")]


@pytest.mark.parametrize("config", CONFIGS)
def test_treecli_runs_mergekit_configs_as_mergekit_does_on_safetensors_and_orbax(config, models, tmp_path):
    root, orbax = models
    theirs = _mergekit(config, root, tmp_path / "mergekit")
    inputs = _inputs(config, root)
    _assert_agree(config, theirs, _treecli(config, root, tmp_path / "treecli.safetensors"), inputs)
    _assert_agree(config, theirs, _treecli(config, orbax, tmp_path / "from-orbax.safetensors"), inputs)
