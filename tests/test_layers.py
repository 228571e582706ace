"""``diff --by-layer`` (issue 35, item 4): one row per layer and kind of module with
``‖b − a‖ / ‖a‖``, against a float64 NumPy reference, across formats."""

from __future__ import annotations

import re

import numpy as np
import pytest
from safetensors.numpy import save_file

import treecli

from .conftest import assert_clean_error


def llama_like(seed: int, layers: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {"model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float32),
           "lm_head.weight": rng.standard_normal((16, 8)).astype(np.float32)}
    for i in range(layers):
        for name in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.up_proj.weight",
                     "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"):
            out[f"model.layers.{i}.{name}"] = rng.standard_normal((8, 8) if "norm" not in name else 8).astype(
                np.float32)
    return out


def reference(a: dict, b: dict) -> dict[tuple, float]:
    """‖b − a‖ / ‖a‖ per (layer, kind), in float64, from the definition."""
    sums: dict[tuple, list[float]] = {}
    for name, x in a.items():
        found = re.search(r"layers\.(\d+)\.", name)
        layer = int(found.group(1)) if found else None
        kind = "norm" if "norm" in name else "attention" if "attn" in name else "mlp" if "mlp" in name else "other"
        x64, y64 = x.astype(np.float64), b[name].astype(np.float64)
        s = sums.setdefault((layer, kind), [0.0, 0.0])
        s[0] += float(np.sum(x64 * x64))
        s[1] += float(np.sum((y64 - x64) ** 2))
    return {key: np.sqrt(change / norm) for key, (norm, change) in sums.items()}


def test_each_layer_and_module_kind_changes_as_the_definition_says(cli, tmp_path):
    a, b = llama_like(0), llama_like(0)
    rng = np.random.default_rng(1)
    for name in b:
        if ".1." in name or "lm_head" in name:
            b[name] = (b[name] + 0.1 * rng.standard_normal(b[name].shape)).astype(np.float32)
    b["model.layers.2.mlp.up_proj.weight"] = b["model.layers.2.mlp.up_proj.weight"] * np.float32(1.5)
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    result = cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--by-layer", "--json")
    assert result.code == 1, result.stderr
    got = {(row["layer"], row["kind"]): row["relative_change"] for row in result.json["rows"]}
    want = reference(a, b)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    assert got[(0, "mlp")] == 0 and got[(1, "norm")] > 0 and got[(None, "other")] > 0
    assert [row["layer"] for row in result.json["rows"]] == [0] * 3 + [1] * 3 + [2] * 3 + [None]
    text = cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--by-layer")
    assert "2      mlp" in text.stdout and "#" * 20 in text.stdout  # the largest change: the full bar
    assert text.stdout.isascii()  # piped: plain ASCII, no box or bar glyphs
    same = cli("diff", tmp_path / "a.safetensors", tmp_path / "a.safetensors", "--by-layer", "--json")
    assert same.code == 0 and same.json["equal"] and all(r["relative_change"] == 0 for r in same.json["rows"])


def test_by_layer_lines_up_trees_across_formats_and_names_its_pattern(cli, tmp_path):
    a = llama_like(3)
    b = {k: v * np.float32(2) for k, v in a.items()}
    save_file(a, str(tmp_path / "a.safetensors"))
    treecli.save(b, tmp_path / "b.npz")
    result = cli("diff", tmp_path / "a.safetensors", tmp_path / "b.npz", "--by-layer", "--json")
    assert result.code == 1 and all(row["relative_change"] == pytest.approx(1.0) for row in result.json["rows"])
    blocks = {f"encoder.block_{i}.ffn.w": np.full(4, i + 1, np.float32) for i in range(2)}
    save_file(blocks, str(tmp_path / "c.safetensors"))
    save_file({k: v * np.float32(3) for k, v in blocks.items()}, str(tmp_path / "d.safetensors"))
    custom = cli("diff", tmp_path / "c.safetensors", tmp_path / "d.safetensors", "--by-layer", "--json",
                 "--layer-pattern", r"block_(\d+)")
    assert [(r["layer"], r["kind"], r["relative_change"]) for r in custom.json["rows"]] == \
        [(0, "mlp", 2.0), (1, "mlp", 2.0)]
    assert_clean_error(cli("diff", tmp_path / "c.safetensors", tmp_path / "d.safetensors", "--by-layer",
                           "--layer-pattern", "block_"), "must capture the layer number")


def test_plot_draws_the_changes_as_a_png_and_refuses_what_it_would_replace(cli, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    a, b = llama_like(0, layers=12), llama_like(1, layers=12)
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    args = ["diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--by-layer"]
    result = cli(*args, "--plot", tmp_path / "layers.png")
    assert result.code == 1, result.stderr
    png = (tmp_path / "layers.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "wrote" in result.stderr and "#" in result.stdout  # the table too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors", "layers.png"]
    assert_clean_error(cli(*args, "--plot", tmp_path / "layers.png"), "the file exists")
    assert (tmp_path / "layers.png").read_bytes() == png
    assert_clean_error(cli(*args[:3], "--plot", tmp_path / "x.png"), "add --by-layer")
    assert_clean_error(cli(*args, "--plot", tmp_path / "x.jpg"), "name a .png file")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert_clean_error(cli(*args, "--plot", tmp_path / "y.png"), "pip install 'treecli[plot]'")
    assert not (tmp_path / "y.png").exists()


def test_each_layer_s_total_change_is_a_row_and_a_json_field(cli, tmp_path):
    a, b = llama_like(0), llama_like(1)
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    result = cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--by-layer", "--json")
    want = {}
    for name, x in a.items():  # the whole layer's ‖b − a‖ / ‖a‖, from the definition
        found = re.search(r"layers\.(\d+)\.", name)
        s = want.setdefault(int(found.group(1)) if found else None, [0.0, 0.0])
        s[0] += float(np.sum(x.astype(np.float64) ** 2))
        s[1] += float(np.sum((b[name].astype(np.float64) - x) ** 2))
    layers = {row["layer"]: row for row in result.json["layers"]}
    assert [row["layer"] for row in result.json["layers"]] == [0, 1, 2, None]
    for layer, (norm, change) in want.items():
        assert layers[layer]["relative_change"] == pytest.approx(np.sqrt(change / norm), rel=1e-12)
        assert layers[layer]["kind"] == "total"
    assert layers[0]["params"] == 8 * 8 * 4 + 8 * 2
    text = cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--by-layer").stdout
    rows = [line.split() for line in text.splitlines()]
    assert [r[:2] for r in rows if len(r) > 1 and r[1] == "total"] == [["0", "total"], ["1", "total"], ["2", "total"]]
    # the total row follows its layer's kinds
    kinds = [r[1] for r in rows[1:] if len(r) > 1 and r[0] == "1"]
    assert kinds == ["attention", "mlp", "norm", "total"]


def test_a_model_against_its_bf16_cast_gives_numbers_in_the_wider_dtype(cli, tmp_path):
    import ml_dtypes

    a = llama_like(0)
    b = {k: v.astype(ml_dtypes.bfloat16) for k, v in a.items()}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    result = cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--by-layer", "--json")
    assert result.code == 1 and not result.json["skipped"]
    assert set(result.json["compared_in"].values()) == {"float32"}
    for row in result.json["rows"]:  # bf16 keeps 8 bits: the cast changes each value by < 2^-8
        assert 0 < row["relative_change"] < 2 ** -8
    text = cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--by-layer")
    assert "attention" in text.stdout and "compared in float32" in text.stderr
    plain = cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--atol", "1e-2", "--json")
    changed = {c["keypath"]: c for c in plain.json["changed"]}
    assert len(changed) == len(a)
    w = "model.layers.0.mlp.up_proj.weight"
    want = np.max(np.abs(a[w].astype(np.float64) - b[w].astype(np.float64)))
    assert changed[w]["max_abs_diff"] == pytest.approx(want, rel=1e-12) and changed[w]["compared_in"] == "float32"
    assert changed[w]["a"] == "[8, 8] float32" and changed[w]["b"] == "[8, 8] bfloat16"
    table = cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert table.code == 1 and "compared in float32" in table.stdout and f"{want:.4g}" in table.stdout


def test_the_plot_is_in_the_table_s_units(tmp_path):
    pytest.importorskip("matplotlib")
    from treecli._layers import LayerReport, Row
    from treecli.cli import _plot

    drawn = {}
    report = LayerReport(rows=[Row(0, "mlp", 4, 1.0, 0.0004), Row(1, "mlp", 4, 1.0, 0.01)])
    real = _plot.Path

    import matplotlib.axes

    original = matplotlib.axes.Axes.plot

    def spy(self, x, y, *args, **kwargs):
        drawn.setdefault("y", []).extend(y)
        return original(self, x, y, *args, **kwargs)

    matplotlib.axes.Axes.plot = spy
    try:
        _plot.draw_layers(report, str(tmp_path / "p.png"), "a -> b")
    finally:
        matplotlib.axes.Axes.plot = original
    assert drawn["y"] == pytest.approx([2.0, 10.0])  # percent, as the table's 2.000% and 10.000%
    assert real(tmp_path / "p.png").is_file()


def test_plot_never_replaces_a_dangling_symlink_and_a_read_only_directory_is_one_line(cli, tmp_path, monkeypatch):
    import os

    pytest.importorskip("matplotlib")
    a = llama_like(0)
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(llama_like(1), str(tmp_path / "b.safetensors"))
    args = ["diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--by-layer", "--plot"]
    (tmp_path / "link.png").symlink_to(tmp_path / "elsewhere.png")
    assert_clean_error(cli(*args, tmp_path / "link.png"), "the file exists")
    assert not (tmp_path / "elsewhere.png").exists() and (tmp_path / "link.png").is_symlink()
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):  # (root writes anywhere: then the write itself fails, below)
            assert_clean_error(cli(*args, locked / "p.png"), "is not writable")
    finally:
        locked.chmod(0o700)
    from treecli import _atomic

    def refused(target, *rest):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(_atomic, "atomic_file", refused)
    assert_clean_error(cli(*args, tmp_path / "p.png"), "cannot write it: Permission denied")
