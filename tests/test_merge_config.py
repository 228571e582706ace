"""``treecli merge --config merge.yml`` (issue 35): a mergekit config resolved as mergekit
resolves it (precedence, gradients over the layers, filters, slices), checked against
float64 references here; its mistakes each one line. mergekit itself is the oracle in
test_mergekit_oracle.py."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import treecli

from .conftest import BF16, assert_clean_error

LAYERS = 5


def tensors(seed: int, like: dict | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if like is not None:
        return {k: (v + rng.standard_normal(v.shape) * 0.1).astype(np.float32) for k, v in like.items()}
    t = {"model.embed_tokens.weight": rng.standard_normal((6, 4)), "model.norm.weight": rng.standard_normal(4),
         "lm_head.weight": rng.standard_normal((6, 4))}
    for i in range(LAYERS):
        t[f"model.layers.{i}.self_attn.q_proj.weight"] = rng.standard_normal((4, 4))
        t[f"model.layers.{i}.mlp.up_proj.weight"] = rng.standard_normal((8, 4))
    return {k: v.astype(np.float32) for k, v in t.items()}


@pytest.fixture
def models(tmp_path) -> dict[str, Path]:
    base = tensors(0)
    paths = {"base": tmp_path / "base.safetensors", "a": tmp_path / "a.safetensors", "b": tmp_path / "b.safetensors"}
    save_file(base, str(paths["base"]))
    save_file(tensors(1, base), str(paths["a"]))
    save_file(tensors(2, base), str(paths["b"]))
    return paths


def write(tmp_path: Path, text: str, **paths: Path) -> Path:
    config = tmp_path / "merge.yml"
    config.write_text(text.format(**{k: str(v) for k, v in paths.items()}))
    return config


def run_config(cli, tmp_path: Path, text: str, **paths: Path) -> dict:
    """The tensors ``merge --config`` wrote for the config ``text`` (with ``paths`` in it)."""
    config = write(tmp_path, text, **paths)
    result = cli("merge", "--config", config, "-o", tmp_path / "out.safetensors")
    assert result.code == 0, result.stderr
    return load_file(str(tmp_path / "out.safetensors"))


def layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if parts[1] == "layers" else None


def test_parameters_resolve_by_precedence_gradient_and_filter(models, tmp_path, cli):
    out = run_config(cli, tmp_path, """
merge_method: task_arithmetic
base_model: {base}
models:
  - model: {a}
    parameters:
      weight: [0.0, 1.0]        # a gradient over the layers: t = layer / (layers - 1)
  - model: {b}
    parameters:
      weight:
        - filter: mlp
          value: 0.25
        - value: [1.0, 0.5, 0.0]
parameters:
  weight: 9.0                   # under both models' own: never used
  lambda:
    - filter: self_attn
      value: 0.5
    - value: 1.0
dtype: float32
""", **models)
    base, a, b = (load_file(str(models[k])) for k in ("base", "a", "b"))
    for name, got in out.items():
        layer = layer_of(name)
        t = 0.0 if layer is None else layer / (LAYERS - 1)  # outside the layers: the first anchor
        w_a = t
        w_b = 0.25 if "mlp" in name else (np.interp(t, [0, 0.5, 1], [1.0, 0.5, 0.0]))
        scale = 0.5 if "self_attn" in name else 1.0
        d = w_a * (a[name].astype(np.float64) - base[name]) + w_b * (b[name].astype(np.float64) - base[name])
        np.testing.assert_allclose(got, base[name] + scale * d, rtol=1e-6, atol=1e-7, err_msg=name)


def test_slices_stack_layers_renumbered_from_each_source(models, tmp_path, cli):
    out = run_config(cli, tmp_path, """
slices:
  - sources:
      - model: {a}
        layer_range: [0, 3]
  - sources:
      - model: {b}
        layer_range: [1, 5]
merge_method: passthrough
dtype: float32
""", **models)
    a, b = load_file(str(models["a"])), load_file(str(models["b"]))
    assert sorted({layer_of(n) for n in out if layer_of(n) is not None}) == list(range(7))
    for i in range(7):
        source, layer = (a, i) if i < 3 else (b, i - 3 + 1)
        for part in ("self_attn.q_proj.weight", "mlp.up_proj.weight"):
            assert out[f"model.layers.{i}.{part}"].tobytes() == source[f"model.layers.{layer}.{part}"].tobytes()
    assert out["model.embed_tokens.weight"].tobytes() == a["model.embed_tokens.weight"].tobytes()  # the first slice's
    assert out["model.norm.weight"].tobytes() == b["model.norm.weight"].tobytes()  # the last slice's
    assert out["lm_head.weight"].tobytes() == b["lm_head.weight"].tobytes()


def test_dtype_rounds_the_inputs_and_out_dtype_the_output(models, tmp_path, cli):
    out = run_config(cli, tmp_path, """
models:
  - model: {a}
  - model: {b}
merge_method: linear
dtype: bfloat16
out_dtype: float16
""", **models)
    a, b = load_file(str(models["a"])), load_file(str(models["b"]))
    for name, got in out.items():
        assert got.dtype == np.float16
        mean = (a[name].astype(BF16).astype(np.float64) + b[name].astype(BF16).astype(np.float64)) / 2
        assert got.tobytes() == mean.astype(BF16).astype(np.float16).tobytes(), name  # bf16, then float16


def test_a_config_runs_on_any_format_and_through_the_python_api(models, tmp_path):
    base, a, b = (treecli.load(models[k]) for k in ("base", "a", "b"))
    treecli.save(a, tmp_path / "a_orbax", format="orbax")
    treecli.save(b, tmp_path / "b.npz")
    config = {"merge_method": "ties", "base_model": str(models["base"]),
              "models": [{"model": str(tmp_path / "a_orbax"), "parameters": {"density": 0.5}},
                         {"model": str(tmp_path / "b.npz"), "parameters": {"density": 0.5}}]}
    from_files, _ = treecli.merge(config=config)
    flat = {n: np.asarray(v) for n, v in treecli._tree.by_text(from_files).items()}
    want, _ = treecli.merge([a, b], "ties", base=base, density=0.5)
    for name, value in treecli._tree.by_text(want).items():
        assert flat[name].tobytes() == np.asarray(value).tobytes(), name
    in_memory, _ = treecli.merge(config=config, models={str(models["base"]): base, str(tmp_path / "a_orbax"): a,
                                                        str(tmp_path / "b.npz"): b})
    got = treecli._tree.by_text(in_memory)
    assert all(np.asarray(got[n]).tobytes() == np.asarray(v).tobytes() for n, v in treecli._tree.by_text(want).items())


def test_a_layer_pattern_names_where_the_number_is(tmp_path):
    rng = np.random.default_rng(3)
    trees = {name: {f"h_{i}": {"w": rng.standard_normal(3).astype(np.float32)} for i in range(3)}
             for name in ("x", "y")}
    config = {"merge_method": "linear", "models": [{"model": "x", "parameters": {"weight": [1.0, 0.0]}},
                                                   {"model": "y", "parameters": {"weight": [0.0, 1.0]}}],
              "layer_pattern": r"h_(\d+)"}
    out, _ = treecli.merge(config=config, models=trees)
    for i, t in enumerate((0.0, 0.5, 1.0)):
        want = (1 - t) * trees["x"][f"h_{i}"]["w"].astype(np.float64) + t * trees["y"][f"h_{i}"]["w"]
        np.testing.assert_allclose(np.asarray(out[f"h_{i}"]["w"]), want, rtol=1e-6)


def test_ignored_keys_and_parameters_the_method_does_not_take_are_warned_once(models, tmp_path, cli):
    config = write(tmp_path, """
models:
  - model: {a}
  - model: {b}
merge_method: slerp
base_model: {a}
tokenizer: {{source: union}}
chat_template: chatml
parameters:
  t: 0.3
  density: 0.5
""", **models)
    result = cli("merge", "--config", config, "-o", tmp_path / "out.safetensors")
    assert result.code == 0, result.stderr
    lines = result.stderr.splitlines()
    assert sum("tokenizer is ignored" in line for line in lines) == 1
    assert sum("chat_template is ignored" in line for line in lines) == 1
    assert sum("parameter density is not one of slerp's; ignored" in line for line in lines) == 1


@pytest.mark.parametrize("text, fragments", [
    ("merge_methd: ties\nmodels: [{{model: {a}}}]\n", ["merge_methd: unknown key; did you mean 'merge_method'?"]),
    ("merge_method: ties\nbase_model: {base}\nmodels:\n  - model: {a}\n    parameters: {{densty: 0.5}}\n",
     ["models[0].parameters.densty: no merge method takes this parameter; did you mean 'density'?"]),
    ("merge_method: tiess\nmodels: [{{model: {a}}}]\n", ["unknown method 'tiess'; did you mean 'ties'?"]),
    ("merge_method: ties\nmodels: [{{model: {a}}}]\n", ["ties needs a base model"]),
    ("merge_method: linear\nmodels: [{{model: {a}}}]\nslices: []\n", ["give exactly one of models and slices"]),
    ("merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: [[1, 2]]}}\n",
     ["expected {{filter: NAME, value: V}}"]),
    ("merge_method: linear\nmodels: [{{model: {a}}}]\nmodules: {{}}\n", ["modules: several modules"]),
    ("merge_method: passthrough\nslices:\n  - sources:\n      - model: {a}\n        layer_range: [0, 9]\n",
     ["no layer 5"]),
    ("merge_method: linear\nmodels: [{{model: {a}}}, {{model: nowhere.safetensors}}]\n", ["nowhere.safetensors"]),
    ("merge_method: linear\nmodels: [{{model: {a}}}\n", ["not a YAML config at line"]),
    ("!!python/object/apply:os.system ['touch {pwned}']\n", ["not a YAML config"]),
    ("merge_method: linear\nmodels: [{{model: {a}}}]\ndtype: int8\n", ["name a float dtype"]),
])
def test_config_mistakes_are_one_line_and_write_nothing(text, fragments, models, tmp_path, cli):
    pwned = tmp_path / "pwned"
    config = write(tmp_path, text, pwned=pwned, **models)
    result = cli("merge", "--config", config, "-o", tmp_path / "out.safetensors")
    assert_clean_error(result, *[f.replace("{{", "{").replace("}}", "}") for f in fragments])
    assert not (tmp_path / "out.safetensors").exists() and not pwned.exists()


def test_nested_alias_values_are_refused_in_bounded_time(models, tmp_path, cli):
    """A billion laughs of filter entries: each level holds the one below twice (by a YAML
    alias), 2**40 entries if walked; refused at the sixth level."""
    value = "1"
    for i in range(40):
        value = f"[{{value: &x{i} {value}}}, {{value: *x{i}}}]"
    config = tmp_path / "bomb.yml"
    config.write_text(f"merge_method: linear\nmodels:\n  - model: {models['a']}\n    parameters:\n"
                      f"      weight: {value}\n")
    assert_clean_error(cli("merge", "--config", config, "-o", tmp_path / "out.safetensors"), "nested this deep")


def test_an_alias_bomb_as_a_model_name_is_quoted_in_a_few_dozen_characters(models, tmp_path, cli):
    """A 2 KB config whose model name is 9**9 strings by YAML aliases (the anchors under
    `name`, a key mergekit ignores): the message quotes a few dozen characters of it."""
    layers = ["x0: &b0 [" + ",".join(["aaaaaaaaaa"] * 9) + "]"]
    layers += [f"x{i}: &b{i} [" + ",".join([f"*b{i - 1}"] * 9) + "]" for i in range(1, 9)]
    config = tmp_path / "bomb.yml"
    config.write_text("name:\n  " + "\n  ".join(layers) + f"\nmerge_method: linear\nmodels:\n  - model: "
                      f"{models['a']}\n  - model: *b8\n")
    assert len(config.read_bytes()) < 3000
    result = cli("merge", "--config", config, "-o", tmp_path / "out.safetensors")
    assert_clean_error(result, "models[1].model: expected a model's path or URL, found [[[")
    assert len(result.stderr) - len(str(tmp_path)) < 400  # (the config is named in full: the rest is bounded)


@pytest.mark.parametrize("make, fragment", [
    (lambda path: os.mkfifo(path), "is a FIFO; treecli reads only regular files"),
    (lambda path: path.symlink_to("/dev/zero"), "is a character device"),
    (lambda path: path.write_text("merge_method: linear\nmodels: " + "[" * 100_000), "nested deeper than any"),
], ids=["fifo", "/dev/zero", "deep"])
def test_a_config_that_is_no_file_or_too_deep_is_one_line_in_bounded_time(models, tmp_path, make, fragment):
    import subprocess
    import sys

    config = tmp_path / "merge.yml"
    make(config)
    result = subprocess.run([sys.executable, "-m", "treecli", "merge", "--config", str(config), "-o",
                             str(tmp_path / "out.safetensors")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and fragment in result.stderr and "Traceback" not in result.stderr, result.stderr
    with pytest.raises(treecli.TreecliError, match=fragment.split(";")[0]):
        treecli.merge(config=config)  # the Python API reads it the same way


def test_a_weight_of_hundreds_of_digits_is_one_line(models, tmp_path, cli):
    config = write(tmp_path, "merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: " + "9" * 400
                   + "}}\n  - model: {b}\n", **models)
    assert_clean_error(cli("merge", "--config", config, "-o", tmp_path / "out.safetensors"), "is not a finite number")


def test_flags_that_belong_in_the_config_are_refused(models, tmp_path, cli):
    config = write(tmp_path, "merge_method: linear\nmodels: [{{model: {a}}}, {{model: {b}}}]\n", **models)
    assert_clean_error(cli("merge", "--config", config, "--method", "ties", "-o", tmp_path / "o.safetensors"),
                       "--method belongs in it")
    assert_clean_error(cli("merge", "--config", config, models["a"], "-o", tmp_path / "o.safetensors"),
                       "MODELS belongs in it")
    assert_clean_error(cli("merge", models["a"], "-o", tmp_path / "o.safetensors"), "--method")
    result = cli("merge", "--method", "model_stock", "--base", models["base"], models["a"], models["b"],
                 "--param", "filter_wise=true", "-o", tmp_path / "stock.safetensors")
    assert result.code == 0, result.stderr
    assert_clean_error(cli("merge", "--method", "model_stock", "--base", models["base"], models["a"], models["b"],
                           "--param", "filter_wise", "-o", tmp_path / "x.safetensors"), "write NAME=VALUE")
