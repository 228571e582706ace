import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from .conftest import assert_clean_error, raw_safetensors


def test_show_prints_the_nested_tree_in_natural_order_with_totals(cli, mixed_file):
    path, _ = mixed_file
    result = cli("show", path)
    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{path}  safetensors, 13 arrays")
    assert result.stdout.isascii()  # piped: plain ASCII
    names = [line.split()[0] for line in lines if line.startswith("    ") and line.split()[0].isdigit()]
    assert names == ["0", "1", "10"]  # natural order: 2 before 10
    row = next(line for line in lines if line.strip().startswith("weight") and "[10, 4]" in line)
    assert row.split()[1:] == ["[10,", "4]", "bfloat16", "40", "80", "B"]
    layers = next(line for line in lines if line.strip().startswith("layers"))
    assert layers.split()[1:3] == ["6", "leaves"]
    # totals by dtype, then the file's __metadata__
    assert any(line.split()[:2] == ["bfloat16", "1"] for line in lines)
    assert any(line.split()[:2] == ["note", "made"] for line in lines)
    assert "\x1b[" not in result.stdout and "├" not in result.stdout  # plain when not a TTY


def test_show_json_follows_the_documented_schema(cli, mixed_file):
    path, tensors = mixed_file
    document = cli("show", path, "--json").json
    assert document["format"] == "safetensors"
    assert document["file"] == str(path)
    assert document["metadata"] == {"format": "np", "note": "made by the reference library"}
    assert document["num_leaves"] == len(tensors)
    assert document["total_params"] == sum(a.size for a in tensors.values())
    assert document["total_bytes"] == sum(a.nbytes for a in tensors.values())
    by_path = {leaf["keypath"]: leaf for leaf in document["leaves"]}
    assert by_path["model.embed.weight"] == {"keypath": "model.embed.weight", "shape": [10, 4],
                                             "dtype": "bfloat16", "nbytes": 80, "stored_dtype": "bfloat16",
                                             "stored_nbytes": 80}
    assert document["stored_bytes"] == document["total_bytes"]
    assert by_path["model.fp8"]["dtype"] == "float8_e4m3fn"
    assert by_path["step"]["shape"] == []
    keypaths = [leaf["keypath"] for leaf in document["leaves"]]
    assert keypaths.index("model.layers.1.attn.q.bias") < keypaths.index("model.layers.10.attn.q.bias")


def test_where_depth_and_flat(cli, mixed_file):
    path, _ = mixed_file
    where = cli("show", path, "--where", "model.layers.*.attn.q.bias", "--json").json
    assert [leaf["keypath"] for leaf in where["leaves"]] == [
        "model.layers.0.attn.q.bias", "model.layers.1.attn.q.bias", "model.layers.10.attn.q.bias"]
    folded = cli("show", path, "--depth", "1").stdout
    assert "layers" not in folded and "model" in folded
    flat = cli("show", path, "--flat", "--where", "**.bias").stdout.splitlines()
    rows = [line.split()[0] for line in flat[3:6]]
    assert rows == ["model.layers.0.attn.q.bias", "model.layers.1.attn.q.bias", "model.layers.10.attn.q.bias"]


def test_where_that_matches_nothing_names_the_closest_key_paths(cli, mixed_file):
    path, _ = mixed_file
    result = cli("show", path, "--where", "model.embd")
    assert_clean_error(result, "model.embd", "matches nothing", "closest: model.embed")


def test_stats_reads_the_data_once_and_counts_nan_inf_zeros(cli, tmp_path):
    path = tmp_path / "s.safetensors"
    save_file({"w": np.array([1.0, 2.0, np.nan, np.inf, 0.0, 3.0], np.float32)}, str(path))
    leaf = cli("show", path, "--stats", "--json").json["leaves"][0]
    assert leaf["stats"] == {"count": 6, "nan": 1, "inf": 1, "zeros": 1, "min": 0.0, "max": 3.0,
                             "mean": 1.5, "std": float(np.std([1.0, 2.0, 0.0, 3.0]))}
    table = cli("show", path, "--stats", "--flat").stdout
    assert "nan" in table.splitlines()[2] and "1.5" in table


def test_sharded_directory_shows_as_one_tree(cli, sharded_dir):
    directory, tensors = sharded_dir
    document = cli("show", directory, "--json").json
    assert document["num_leaves"] == len(tensors)


def test_bad_files_get_one_clear_line_each(cli, tmp_path):
    cases = {
        "missing.safetensors": (None, "no such file"),
        "empty.safetensors": (b"", "empty"),
        "lfs.safetensors": (b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n", "Git LFS pointer"),
        "page.safetensors": (b"<!DOCTYPE html><html><body>Sign in</body></html>", "HTML"),
        "short.safetensors": (raw_safetensors({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
                              "truncated: its header declares tensor data through byte"),
        "pickle.pt": (b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94.", "pickle"),
        "notes.txt": (b"hello", "not a checkpoint"),
    }
    for name, (content, fragment) in cases.items():
        path = tmp_path / name
        if content is not None:
            path.write_bytes(content)
        result = cli("show", path)
        assert_clean_error(result, str(path), fragment)
        assert len(result.stderr.splitlines()) == 1, result.stderr
        assert result.stdout == ""


def test_a_directory_that_is_no_checkpoint(cli, tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    assert_clean_error(cli("show", tmp_path), str(tmp_path), "not a checkpoint")


def test_debug_shows_the_traceback(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "empty.safetensors"
    path.write_bytes(b"")
    result = subprocess.run([sys.executable, "-m", "treecli", "--debug", "show", str(path)],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_usage_errors_use_the_same_one_line_form(cli, mixed_file):
    path, _ = mixed_file
    result = cli("show", path, "--depth", "zero")
    assert_clean_error(result, "--depth")
    assert_clean_error(cli("show"), "Missing argument")


def test_show_of_the_bundled_example(cli):
    from pathlib import Path

    example = Path(__file__).parents[1] / "examples" / "tiny.safetensors"
    document = cli("show", example, "--json").json
    assert document["num_leaves"] == 19
    assert {leaf["dtype"] for leaf in document["leaves"]} == {"bfloat16", "float32", "float16", "int64"}
    assert json.loads(json.dumps(document)) == document


def _show_on_a_terminal(path, columns: int, *args: str) -> str:
    """Run `treecli show` with stdout on a pseudo-terminal; what the terminal received."""
    import os
    import pty
    import subprocess
    import sys

    primary, secondary = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns)}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, "-m", "treecli", "show", str(path), *args], stdout=secondary,
                            stderr=subprocess.PIPE, env=env)
    os.close(secondary)
    received = bytearray()
    while True:
        try:
            data = os.read(primary, 65536)
        except OSError:  # the child closed its end
            break
        if not data:
            break
        received.extend(data)
    os.close(primary)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    proc.stderr.close()
    return received.decode().replace("\r\n", "\n")


def test_show_on_a_terminal_draws_guides_with_styles_and_fits_its_width(mixed_file):
    path, _ = mixed_file
    wide = _show_on_a_terminal(path, 200).splitlines()
    assert wide[0].startswith(f"\x1b[1m{path}\x1b[0m  safetensors · 13 arrays")
    assert any(line.startswith("\x1b[2m├── \x1b[0m\x1b[1mmodel\x1b[0m") for line in wide)  # dim guide, bold node
    assert any("\x1b[2m│   " in line and "[10, 4]" in line for line in wide)
    narrow = _show_on_a_terminal(path, 30).splitlines()
    visible = [line.replace("\x1b[1m", "").replace("\x1b[2m", "").replace("\x1b[0m", "") for line in narrow]
    assert max(map(len, visible)) <= 30
    # columns are left out, and a line says which; only a name wider than the terminal is cut
    assert any(line.startswith("(left out to fit: ") for line in visible)
    assert all(not line.endswith("…") for line in visible[1:]), visible


@pytest.mark.parametrize("args", [[], ["--flat"], ["--depth", "1"]])
def test_a_checkpoint_without_tensors_shows_its_empty_table(cli, tmp_path, args):
    path = tmp_path / "none.safetensors"
    save_file({}, str(path), metadata={"note": "nothing yet"})
    result = cli("show", path, *args)
    assert result.code == 0, result.stderr
    assert "0 arrays" in result.stdout and "nothing yet" in result.stdout
    header = ["key", "path"] if args == ["--flat"] else ["key"]
    assert header + ["shape", "dtype", "params", "size"] in [line.split() for line in result.stdout.splitlines()]


def test_json_is_laid_out_as_pythons_indented_json(cli, tmp_path):
    """`--json` is Python's own two-space layout and number spelling (1e-05, not 0.00001),
    whatever encodes it; text stays unescaped UTF-8."""
    path = tmp_path / "m.safetensors"
    save_file({"café.w": np.array([1e-5, 3e22], np.float64), "b": np.zeros((0, 3), np.float32)}, str(path),
              metadata={"note": "ünïcode"})
    result = cli("show", path, "--stats", "--json")
    assert result.code == 0, result.stderr
    assert result.stdout == json.dumps(result.json, indent=2, ensure_ascii=False) + "\n"
    assert '"min": 1e-05' in result.stdout and '"max": 3e+22' in result.stdout


def test_json_of_a_name_that_is_no_unicode_still_prints(cli, tmp_path):
    """A file name that is not UTF-8 (byte 0xff) reaches the document as a lone surrogate,
    which no UTF-8 encoder takes; the document still prints, as a JSON escape."""
    path = tmp_path / "bad\udcff.safetensors"
    save_file({"w": np.ones(2, np.float32)}, str(path))
    result = cli("show", path, "--json")
    assert result.code == 0, result.stderr
    assert result.json["file"] == str(path)


def test_key_paths_of_flat_and_json_rows_are_each_leafs_own(cli, tmp_path):
    """Rows of --flat and --json spell each leaf's key path as every other command reads it,
    brackets and escapes included, though they are built from their parents' paths."""
    from treecli import _render, _summary, _tree
    from treecli._keypath import format_keypath

    odd = {"a.b": {"": 1.0, "x[y]": {"\u202e": 2, 0: [3, {"k": 4}]}}, "plain": {"w": 5}, "é": [6]}
    root = _summary.summarize(odd)
    expected = [format_keypath(keypath) for keypath, _ in _tree.flatten(odd)]
    assert [keypath for keypath, _ in _summary.leaves_by_keypath(root)] == expected
    assert [leaf["keypath"] for leaf in _render.show_json("f", "npz", root, {})["leaves"]] == expected
    flat = list(_render.flat_lines(root))[1:]
    assert [line.split("  ")[0].rstrip() for line in flat] == expected


def test_tree_rows_come_depth_first_each_under_its_parent(cli, mixed_file):
    """Read back by indentation, the plain tree's rows name every node once, each right
    after its parent's subtree began: the tree, depth first, in natural order."""
    path, tensors = mixed_file
    lines = cli("show", path).stdout.splitlines()
    rows = lines[3:lines.index("", 3)]
    stack: list[str] = []
    shown_leaves = []
    for row in rows:
        depth = (len(row) - len(row.lstrip(" "))) // 2
        del stack[depth:]
        stack.append(row.split()[0])
        if "leaves" not in row and "leaf" not in row.split()[1:3]:
            shown_leaves.append(".".join(stack))
    from treecli._keypath import natural_sort_key

    def order(name):
        return [natural_sort_key(part) for part in name.split(".")]

    assert shown_leaves == sorted(tensors, key=order)


_keys = st.sampled_from(["w", "b", "0", "1", "10", "a.b", 0, 1, 2, True])
_leaves = st.one_of(st.sampled_from([np.zeros((2, 3), np.float32), np.zeros(4, np.int8), np.zeros((), np.float16)]),
                    st.sampled_from([0, 1, "x", None, 2.5]))
_trees = st.recursive(_leaves, lambda inner: st.dictionaries(_keys, inner, min_size=1, max_size=4), max_leaves=40)


@settings(max_examples=200, deadline=None)
def _reversed(tree):
    """The same tree, each dict's keys stored in the opposite order."""
    if isinstance(tree, dict):
        return {k: _reversed(tree[k]) for k in reversed(tree)}
    return [_reversed(v) for v in tree] if isinstance(tree, list) else tree


@given(tree=_trees.map(lambda t: {"a": t, "b": t, "c": {"x": t, "y": [t, t]}, "t": {True: t}, "o": {1: t},
                                  "r": _reversed(t)}),
       plain=st.booleans(), fold=st.booleans(), depth=st.sampled_from([None, 1, 2, 3]))
def test_subtrees_laid_out_once_show_as_if_each_were_laid_out(tree, plain, fold, depth):
    """Subtrees of one layout (a model's layers) share their summary rows and are laid out
    once; what shows, in every form, is what a summary of rows of their own, each laid out
    afresh, shows: 1 and True apart, values each their own."""
    from treecli import _render, _summary

    def every_form(root):
        return (list(_render.tree_lines(root, plain=plain, fold=fold, depth=depth)), list(_render.flat_lines(root)),
                _render.show_json("f", "npz", root, {}), _summary.dtype_totals(root))

    fresh = _summary.summarize(tree, shared=False)
    stack, count = [fresh], 0
    while stack:  # every inner node a layout of its own: nothing is repeated
        node = stack.pop()
        node.layout, count = -1 - count, count + 1
        stack.extend(child for child in node.children if child.kind == "node")
    assert every_form(_summary.summarize(tree)) == every_form(fresh)
    totals: dict = {}  # by dtype, row by row
    for row in _summary.leaves(fresh):
        if row.kind == "array":
            entry = totals.setdefault(row.dtype, [0, 0, 0])
            entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + row.params, entry[2] + row.nbytes
    assert sorted(_summary.dtype_totals(fresh)) == sorted((dtype, *entry) for dtype, entry in totals.items())


def test_stats_of_layers_that_look_alike_are_each_their_own(cli, tmp_path):
    """Identical layers share their rows in the summary; their statistics must not."""
    path = tmp_path / "m.safetensors"
    save_file({f"layers.{i}.w": np.full((2, 3), float(i), np.float32) for i in range(3)}, str(path))
    leaves = cli("show", path, "--stats", "--json").json["leaves"]
    assert [(leaf["keypath"], leaf["stats"]["mean"]) for leaf in leaves] == [
        ("layers.0.w", 0.0), ("layers.1.w", 1.0), ("layers.2.w", 2.0)]
    rows = [line.split() for line in cli("show", path, "--stats").stdout.splitlines() if line.strip().startswith("w ")]
    assert [row[7] for row in rows] == ["0", "1", "2"]  # min


def test_show_names_the_model_an_hf_config_describes(cli, tmp_path):
    """Issue 42, item 4: the architecture, layers and vocabulary of config.json in the
    header line and in --json; a config that names no model_type adds nothing; text from
    the file is escaped."""
    repo = tmp_path / "tiny-llama"
    repo.mkdir()
    save_file({f"model.layers.{i}.mlp.w": np.ones((2, 2), np.float32) for i in range(4)}
              | {"model.embed_tokens.weight": np.ones((128, 2), np.float32)}, str(repo / "model.safetensors"))
    (repo / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4, "vocab_size": 128}))
    shown = cli("show", repo)
    assert shown.code == 0, shown.stderr
    assert shown.stdout.splitlines()[0].split("  ", 1)[1].startswith("safetensors, llama, 4 layers, vocab 128, ")
    assert cli("show", repo, "--json").json["model"] == {"architecture": "llama", "layers": 4, "vocab": 128}
    (repo / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": {"num_hidden_layers": 26}}))
    assert cli("show", repo, "--json").json["model"] == {"architecture": "gemma3", "layers": 26, "vocab": None}
    (repo / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert "model" not in cli("show", repo, "--json").json
    (repo / "config.json").write_text(json.dumps({"model_type": "evil\x1b[2J"}))
    shown = cli("show", repo)
    assert "\x1b" not in shown.stdout and "evil" in shown.stdout.splitlines()[0]
