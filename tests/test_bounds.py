"""Input-controlled depth and size are bounded with a clean refusal, never a RecursionError
or an int() limit as an internal error (issue 31): key paths and patterns of thousands
of segments, integers of thousands of digits, in what users type and in what files hold."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from .conftest import assert_clean_error

HUGE = "9" * 5000


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"model.norm.weight": np.ones(4, np.float32), "model.head.weight": np.zeros((2, 4), np.float32)},
              str(path))
    return path


def test_a_rename_to_a_500_segment_key_path_writes_it(cli, model, tmp_path):
    deep = ".".join(["a"] * 500) + ".b"
    result = cli("edit", model, "-o", tmp_path / "out.safetensors", "--rename", f"model.norm.weight={deep}")
    assert result.code == 0, result.stderr
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out.safetensors"), "np") as f:
        assert deep in f.keys()


def test_a_pattern_of_thousands_of_segments_matches_or_says_nothing_matches(cli, model):
    assert_clean_error(cli("show", model, "--where", "**." * 2000 + "x"), "matches nothing")
    found = cli("show", model, "--where", "**." * 2000 + "weight", "--flat")
    assert found.code == 0, found.stderr
    assert "model.norm.weight" in found.stdout and "model.head.weight" in found.stdout


@pytest.mark.parametrize("index", [HUGE, f"-{HUGE}", f"0:{HUGE}", f"::{HUGE}", f"0, {HUGE}"])
def test_an_index_of_thousands_of_digits_is_refused_in_one_line(cli, model, tmp_path, index):
    assert_clean_error(cli("slice", model, "--index", index, "-o", tmp_path / "o.safetensors"), "too large")
    assert not (tmp_path / "o.safetensors").exists()


def test_a_key_path_index_of_thousands_of_digits_is_refused_in_one_line(cli, model):
    assert_clean_error(cli("get", model, f"model[{HUGE}]"), "too large")


def test_keys_with_thousands_of_digits_sort_by_value(cli, tmp_path):
    path = tmp_path / "k.safetensors"
    save_file({"a" + HUGE: np.zeros(1, np.float32), "a10": np.zeros(1, np.float32), "a9": np.zeros(1, np.float32)},
              str(path))
    result = cli("show", path, "--json")
    assert result.code == 0, result.stderr
    assert [leaf["keypath"] for leaf in result.json["leaves"]] == ["a9", "a10", "a" + HUGE]
