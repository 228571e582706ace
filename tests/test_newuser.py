"""What a new user trips over (issue 15): silent wrong answers, rough edges, names
and shells, an honest boundary."""

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

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


# --- output a person reads ---------------------------------------------------------------------


def test_bare_treecli_prints_the_normal_help():
    result = run_cli()
    assert result.code == 0, result.stderr
    assert result.stdout.startswith("Usage: treecli") and "Commands" in result.stdout
    assert result.stderr == ""


def test_get_json_spells_nan_and_inf_as_strings_jq_reads(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": np.array([1.0, np.nan, np.inf, -np.inf], np.float32),
               "c": np.array([1 + 2j, complex(np.nan, 1)], np.complex64)}, str(path))
    result = run_cli("get", path, "w", "--json")
    assert result.code == 0, result.stderr
    assert json.loads(result.stdout, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))["value"] == \
        [1.0, "nan", "inf", "-inf"]
    assert run_cli("get", path, "c", "--json").json["value"] == [[1.0, 2.0], ["nan", 1.0]]


def test_get_prints_numpy_text_untouched(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")  # a narrow terminal must not re-wrap NumPy's rows
    path = tmp_path / "m.safetensors"
    data = np.arange(60, dtype=np.float32).reshape(3, 20) * 1000.5
    save_file({"w": data}, str(path))
    result = run_cli("get", path, "w")
    with np.printoptions(threshold=200, edgeitems=3, linewidth=120):
        expected = np.array2string(data)
    assert expected in result.stdout


def test_debug_is_read_as_the_option_it_is(tmp_path):
    from treecli._errors import UsageError

    with pytest.raises(UsageError):  # raised through: the traceback is the point of --debug
        run_cli("--debug", "show", tmp_path / "missing.safetensors")
    quiet = run_cli("show", tmp_path / "missing.safetensors", "--where", "--debug")
    assert_clean_error(quiet)  # "--debug" as a value of another option does not switch it on


# --- names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["out.h5", "out.npy", "out.tflite", "out.onnx", "out.json"])
def test_an_output_extension_treecli_does_not_write_is_an_error(tmp_path, name):
    src = tmp_path / "m.safetensors"
    save_file({"w": np.ones(2, np.float32)}, str(src))
    result = run_cli("convert", src, tmp_path / name)
    assert_clean_error(result, ".safetensors, .npz, .msgpack")
    assert not (tmp_path / name).exists()


def test_format_contradicting_the_name_is_an_error(tmp_path):
    src = tmp_path / "m.safetensors"
    save_file({"w": np.ones(2, np.float32)}, str(src))
    assert_clean_error(run_cli("convert", src, tmp_path / "o.safetensors", "--format", "npz"), "--format")


def test_get_writes_npy_and_any_other_format_by_the_output_s_name(tmp_path):
    src = tmp_path / "m.safetensors"
    save_file({"w": np.ones(2, np.float32)}, str(src))
    assert run_cli("get", src, "w", "-o", tmp_path / "w.safetensors").code == 0
    assert load_file(str(tmp_path / "w.safetensors"))["w"].tolist() == [1, 1]
    assert run_cli("get", src, "w", "-o", tmp_path / "w.npy").code == 0
    assert np.load(tmp_path / "w.npy").tolist() == [1, 1]


def test_hf_directory_outputs_keep_companion_dirs_and_drop_stale_weights(tmp_path):
    repo = tmp_path / "repo"
    (repo / "1_Pooling").mkdir(parents=True)
    (repo / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (repo / "config.json").write_text("{}")
    (repo / "pytorch_model.bin").write_bytes(b"stale pickle")
    (repo / "model.pt").write_bytes(b"stale")
    (repo / "tf_model.h5").write_bytes(b"stale")
    (repo / ".gitattributes").write_text("x")
    save_file({"w": np.ones(2, np.float32)}, str(repo / "model.safetensors"))
    out = tmp_path / "out"
    result = run_cli("edit", repo, "--scale", "**=2", "-o", out)
    assert result.code == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["1_Pooling", "config.json", "model.safetensors"]
    assert (out / "1_Pooling" / "config.json").read_text() == '{"pooling_mode_mean_tokens": true}'


# --- an honest boundary ----------------------------------------------------------------------------


def test_declared_dependencies_are_what_runs():
    import ast
    import sys
    import tomllib
    from pathlib import Path

    root = Path(__file__).parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    # The cloud extra: uploads to buckets, imported only then; the plot extra: diff --plot.
    declared = {d.split(">")[0].split("<")[0].split("=")[0].strip().lower().replace("-", "_")
                for d in project["dependencies"] + project["optional-dependencies"]["cloud"]
                + project["optional-dependencies"]["plot"]}
    imported = set()
    for path in (root / "treecli").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m != "treecli"}
    module_of = {"orbax_checkpoint": "orbax", "google_auth": "google", "pyyaml": "yaml"}
    # jax and jaxlib run whenever treecli writes or restores through Orbax (orbax imports them).
    import orbax.checkpoint  # noqa: F401

    assert "jax" in sys.modules and "jaxlib" in sys.modules
    assert third_party <= {module_of.get(d, d) for d in declared}, third_party
    assert {module_of.get(d, d) for d in declared} - {"jax", "jaxlib"} <= third_party


def test_slice_and_edit_json_share_one_schema_written_or_dry_run(tmp_path):
    src = tmp_path / "m.safetensors"
    save_file({"w": np.ones((4, 2), np.float32), "b": np.zeros(2, np.float32)}, str(src))
    docs = [run_cli("slice", src, "--index", "w=:2", "--dry-run", "--json").json,
            run_cli("slice", src, "--index", "w=:2", "-o", tmp_path / "s.safetensors", "--json", "-q").json,
            run_cli("edit", src, "--cast", "w=float16", "--dry-run", "--json").json,
            run_cli("edit", src, "--cast", "w=float16", "-o", tmp_path / "e.safetensors", "--json", "-q").json]
    for doc in docs:
        assert set(doc) == {"output", "changed", "skipped"}
        assert [set(row) for row in doc["changed"]] == [{"keypath", "before", "after", "what"}]
        assert doc["changed"][0]["keypath"] == "w"
    assert docs[0]["changed"][0]["after"] == "[2, 2] float32" and docs[0]["output"] is None
    assert docs[1]["output"] == str(tmp_path / "s.safetensors") and (tmp_path / "s.safetensors").exists()
    assert docs[3]["changed"][0]["after"] == "[4, 2] float16" and (tmp_path / "e.safetensors").exists()


def test_convert_shows_a_verification_bar_in_binary_units_on_a_terminal(tmp_path):
    import os
    import re
    import shlex
    import shutil
    import subprocess
    import sys

    if shutil.which("script") is None:
        pytest.skip("needs util-linux script for a pseudo-terminal")
    src = tmp_path / "big.safetensors"
    save_file({f"w{i}": np.ones(1 << 22, np.float32) for i in range(6)}, str(src))  # 96 MiB
    log = tmp_path / "pty.log"
    command = f"{shlex.quote(sys.executable)} -m treecli convert {src} {tmp_path / 'o.npz'}"
    subprocess.run(["script", "-qec", command, str(log)], check=True, capture_output=True, timeout=300,
                   env={**os.environ, "COLUMNS": "120"})
    screen = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", log.read_text(errors="replace"))
    assert "writing o.npz" in screen and "verifying" in screen
    assert "MiB/s" in screen or "GiB/s" in screen
    assert not re.search(r"\d MB/s", screen)


def _on_a_terminal(monkeypatch):
    from treecli.cli import _output

    monkeypatch.setattr(_output, "_isatty", lambda stream: True)


def test_identical_numbered_siblings_fold_into_one_row_on_a_terminal(tmp_path, monkeypatch):
    tensors = {f"model.layers.{i}.{name}": np.zeros(shape, np.float32)
               for i in range(32) for name, shape in (("attn.w", (4, 4)), ("norm.w", (4,)))}
    tensors["model.layers.32.attn.w"] = np.zeros((2, 2), np.float32)  # another structure: not in the run
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    _on_a_terminal(monkeypatch)
    folded = run_cli("show", path).stdout
    assert "{0..31} ×32" in folded
    assert folded.count("attn") == 2  # the folded structure once, plus layer 32
    assert "64 leaves" in folded  # totals of the 32 members summed
    expanded = run_cli("show", path, "--expand").stdout
    assert "{0.." not in expanded and expanded.count("attn") == 33
    monkeypatch.undo()
    piped = run_cli("show", path).stdout
    assert "{0.." not in piped and piped.count("attn") == 33
    assert run_cli("show", path, "--json").json["num_leaves"] == 65


def test_stats_fit_an_80_column_terminal_and_count_nan_and_inf(tmp_path, monkeypatch):
    data = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
    data[0, 0], data[1, 1], data[2, 2] = np.nan, np.inf, -np.inf
    path = tmp_path / "m.safetensors"
    save_file({"model.layers.0.self_attn.q_proj.weight": data, "model.norm.weight": np.ones(16, np.float32)},
              str(path))
    _on_a_terminal(monkeypatch)
    monkeypatch.setenv("COLUMNS", "80")
    result = run_cli("show", path, "--stats")
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()[1:]  # after the headline (a long file name is cut there)
    assert all(len(line) <= 80 and not line.endswith("…") for line in lines), result.stdout
    header = next(line for line in lines if line.startswith("key"))
    assert {"min", "max", "mean", "nan", "inf"} <= set(header.split())
    weight = next(line for line in lines if line.rstrip().endswith("2") and "[64, 16]" in line)
    assert weight.split()[-2:] == ["1", "2"]  # one NaN, two infinities, counted beside min/max/mean
    assert any(line.startswith("(left out to fit:") for line in lines)


@pytest.mark.parametrize("words", ["treecli edit examples/tiny.safetensors --cast model.l",
                                   "treecli edit examples/tiny.safetensors -o x.safetensors --delete model.l",
                                   "treecli slice examples/tiny.safetensors --index model.l"])
def test_edit_and_slice_patterns_complete_key_paths(words):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "_TREECLI_COMPLETE": "complete_bash", "COMP_WORDS": words,
           "COMP_CWORD": str(len(words.split()) - 1)}
    result = subprocess.run([sys.executable, "-m", "treecli"], capture_output=True, text=True,
                            cwd=Path(__file__).parent.parent, env=env, timeout=60)
    assert result.stdout.split()[:2] == ["model.layers.0.", "model.layers.1."], result.stdout + result.stderr


def _complete(words: str) -> list[str]:
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "_TREECLI_COMPLETE": "complete_bash", "COMP_WORDS": words,
           "COMP_CWORD": str(len(words.split()) - (0 if words.endswith(" ") else 1))}
    result = subprocess.run([sys.executable, "-m", "treecli"], capture_output=True, text=True,
                            cwd=Path(__file__).parent.parent, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.mark.parametrize("words, expected", [
    ("treecli merge a b -o o --method t", ["task_arithmetic", "ties"]),
    ("treecli merge a b -o o --method d", ["dare_linear", "dare_ties", "della", "della_linear"]),
    ("treecli average a b -o o --non-float ", ["last", "first", "error"]),
    ("treecli convert examples/tiny.safetensors x --format o", ["orbax"]),
    ("treecli show examples/tiny.safetensors --format s", ["safetensors"]),
    ("treecli convert examples/tiny.safetensors x --dtype bf", ["bfloat16"]),
    ("treecli average a b -o o --dtype float1", ["float16"]),
    ("treecli edit examples/tiny.safetensors --cast model.norm.weight=bfl", ["model.norm.weight=bfloat16"]),
])
def test_option_values_complete_from_their_choices_never_file_names(words, expected):
    assert _complete(words) == expected


def test_key_paths_complete_one_level_at_a_time():
    assert _complete("treecli show examples/tiny.safetensors --where ") == ["lm_head.", "model.", "step"]
    assert _complete("treecli show examples/tiny.safetensors --where m") == [
        "model.embed_tokens.", "model.layers.", "model.norm."]
    # one inner node fits: its children at once, as a shell completes a lone directory
    assert _complete("treecli get examples/tiny.safetensors model.n") == ["model.norm.weight"]
    assert len(_complete("treecli get examples/tiny.safetensors model.layers.0.")) == 3
    assert _complete("treecli edit examples/tiny.safetensors --scale model.norm.weight=") == []


@pytest.mark.parametrize("source", ["examples/tiny.npz"])  # (msgpack: an HF Flax directory's, so HF's directory)
def test_a_file_format_written_to_a_name_without_extension_suggests_a_directory_format(tmp_path, source):
    import treecli

    path = Path(__file__).parent.parent / source if source.startswith("examples") else tmp_path / source
    if not path.exists():
        treecli.save({"w": np.ones(2, np.float32)}, path)
    result = run_cli("convert", path, tmp_path / "some_dir")
    assert_clean_error(result, "--format 'orbax'", "--format 'safetensors'", "some_dir.")
    assert not (tmp_path / "some_dir").exists()


def test_a_file_sliced_to_a_name_without_extension_says_it_became_a_directory(tmp_path):
    out = tmp_path / "out"
    result = run_cli("slice", Path(__file__).parent.parent / "examples/tiny.safetensors", "--index", "0", "-o", out)
    assert result.code == 0, result.stderr
    lines = result.stderr.splitlines()
    said = [line for line in lines if "no extension" in line]
    assert len(said) == 1 and "so it is an HF safetensors directory" in said[0] and "out.safetensors" in said[0]
    assert lines[-1] == f"treecli: wrote {out}" and (out / "model.safetensors").is_file()


@pytest.mark.parametrize("view", [[], ["--flat"], ["--depth", "2"]])
def test_a_narrow_terminal_leaves_columns_out_and_says_so_never_cropping_cells(monkeypatch, view, tmp_path):
    _on_a_terminal(monkeypatch)
    monkeypatch.setenv("COLUMNS", "56")
    # from any clone path: the file's name, however long, goes on over lines, never cropped
    deep = tmp_path / ("a_directory_with_a_long_name_" * 4) / "tiny.safetensors"
    deep.parent.mkdir()
    deep.write_bytes((Path(__file__).parent.parent / "examples/tiny.safetensors").read_bytes())
    result = run_cli("show", deep, *view)
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert all(len(line) <= 56 and "…" not in line for line in lines), result.stdout
    assert "".join(lines[: (len(str(deep)) + 55) // 56]) == str(deep)
    said = " ".join(line for line in lines if line.startswith("(left out") or "all in --json)" in line)
    assert said.startswith("(left out to fit: ") and said.endswith("all in --json)"), result.stdout
    assert "19 arrays" in result.stdout and "31.3 KiB" in result.stdout  # the headline, wrapped


def test_format_help_names_every_format_the_registry_reads_and_writes():
    from treecli import formats
    from treecli.cli import _options

    def names(text: str) -> list[str]:
        return text.replace(" or ", ", ").split(", ")

    assert names(_options.READ_FORMATS) == list(formats.FORMATS)
    assert names(_options.WRITTEN_FORMATS) == [n for n in formats.FORMATS if formats.get(n).writable]
    shown = " ".join(run_cli("convert", "--help").stdout.split())
    assert "Format of the output: safetensors, npz, msgpack, npy, eqx, orbax, torch or gguf" in shown


@pytest.mark.parametrize("args, line", [
    (["show", "{tmp}/missing.safetensors", "--json"], "{tmp}/missing.safetensors: no such file or directory"),
    (["get", "{tmp}/m.safetensors", "nope", "--json"], "{tmp}/m.safetensors: nope: matches nothing"),
    (["diff", "{tmp}/m.safetensors", "{tmp}/m.safetensors", "--json", "--bogus"], "No such option: --bogus"),
])
def test_a_json_failure_is_a_json_document_on_stdout_and_the_line_on_stderr(tmp_path, args, line):
    import json

    save_file({"w": np.ones(2, np.float32)}, str(tmp_path / "m.safetensors"))
    result = run_cli(*[a.format(tmp=tmp_path) for a in args])
    assert_clean_error(result)
    document = json.loads(result.stdout)["error"]
    assert document["line"] == line.format(tmp=tmp_path)
    assert result.stderr.splitlines()[0] == "treecli: error: " + document["line"]
    if "bogus" not in line:
        assert document["file"].endswith(".safetensors") and document["message"] in document["line"]


def test_an_error_line_is_bounded_whatever_built_it(tmp_path):
    from treecli.cli import _print_error

    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        _print_error("x" * 10_000_000, ["y" * 10_000])
    assert len(err.getvalue()) < 5000 and "characters) ..." in err.getvalue()


def test_the_cli_says_the_api_s_words_with_the_file_first(tmp_path):
    import treecli

    src = tmp_path / "m.safetensors"
    save_file({"model.w": np.ones((2, 3), np.float32), "model.b": np.ones(3, np.float32)}, str(src))
    cases = [(lambda: treecli.slice_tree(treecli.load(src), ["model.w=5"]),
              ["slice", src, "--index", "model.w=5", "-o", tmp_path / "s.safetensors"]),
             (lambda: treecli.diff(treecli.load(src), treecli.load(src), where=["model.x"]),
              ["diff", src, src, "--where", "model.x"])]
    for api, cli_args in cases:
        with pytest.raises(treecli.TreecliError) as info:
            api()
        result = run_cli(*cli_args)
        assert_clean_error(result)
        line = result.stderr.splitlines()[0]
        assert line.startswith(f"treecli: error: {src}: "), line  # FILE: KEYPATH: what
        assert line.endswith(str(info.value).split(": ", 1)[1]), (line, str(info.value))
