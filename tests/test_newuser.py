"""What a new user trips over (issue 15): silent wrong answers, rough edges, names
and shells, an honest boundary."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from .conftest import assert_clean_error, run_cli

ocp = pytest.importorskip("orbax.checkpoint")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two CheckpointManager runs whose params differ, with step counters and JSON items."""
    roots = []
    for run, seed in (("run1", 0), ("run2", 1)):
        root = tmp_path_factory.mktemp("runs") / run
        rng = np.random.default_rng(seed)
        with ocp.CheckpointManager(str(root)) as manager:
            for step in (100, 200, 300):
                state = {"step": np.asarray(step, np.int32), "params": {"w": rng.standard_normal(4).astype(np.float32)},
                         "opt_state": [{"count": np.asarray(step, np.int32), "mu": np.zeros(4, np.float32)}]}
                manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                           metadata=ocp.args.JsonSave({"step": step, "loss": 1 / step})))
            manager.wait_until_finished()
        roots.append(root)
    return roots


def test_diff_where_that_matches_nothing_is_an_error_naming_the_closest(runs):
    run1, run2 = runs
    result = run_cli("diff", run1, run2, "--where", "params.**")
    assert_clean_error(result, "params.**", "matches nothing", "state.params")
    result = run_cli("diff", run1, run2, "--where", "state.params.**")
    assert result.code == 1, result.stderr
    assert "state.params.w" in result.stdout
    result = run_cli("diff", run1, run2, "--step", "100", "--where", "state.params.**", "--json")
    assert result.code == 1 and result.json["changed"][0]["keypath"] == "state.params.w"


def test_average_of_the_last_steps_takes_the_newest_counters_with_a_note(runs, tmp_path):
    run1, _ = runs
    out = tmp_path / "avg"
    result = run_cli("average", run1 / "100", run1 / "200", run1 / "300", "-o", out)
    assert result.code == 0, result.stderr
    assert "copied from" in result.stderr and "state.step" in result.stderr and "metadata.step" in result.stderr
    got = run_cli("show", out, "--json").json
    values = {leaf["keypath"]: leaf.get("value") for leaf in got["leaves"]}
    assert values["metadata.step"] == 300
    assert run_cli("get", out, "state.step", "--json").json["value"] == 300
    assert run_cli("get", out, "state.opt_state.0.count", "--json").json["value"] == 300
    refused = run_cli("average", run1 / "100", run1 / "200", "-o", tmp_path / "x", "--non-float", "error")
    assert_clean_error(refused, "differ")
    first = tmp_path / "first"
    assert run_cli("average", run1 / "100", run1 / "200", "-o", first, "--non-float", "first").code == 0
    assert run_cli("get", first, "state.step", "--json").json["value"] == 100
