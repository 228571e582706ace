"""Start-up is a tested property: --help, completion and show of safetensors
never import jax or orbax. Completion scripts are generated from the app."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
HEAVY = ("jax", "jaxlib", "orbax", "tensorstore")


def _modules_after(code: str, env: dict | None = None) -> set[str]:
    script = code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)), file=sys.stderr)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, **(env or {})}, cwd=ROOT)
    return set(json.loads(result.stderr.strip().splitlines()[-1]))


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


def test_import_and_help_do_not_load_jax_orbax_or_numpy():
    modules = _modules_after(
        "from treecli.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass")
    assert _heavy(modules) == []
    assert "numpy" not in modules


def test_show_of_safetensors_does_not_load_jax_or_orbax():
    modules = _modules_after(f"from treecli.cli import main\nmain(['show', {str(ROOT / 'examples/tiny.safetensors')!r}])")
    assert "treecli.formats.safetensors" in modules
    assert _heavy(modules) == []


def test_keypath_completion_reads_the_header_without_jax():
    env = {"_TREECLI_COMPLETE": "complete_bash", "COMP_WORDS": "treecli show examples/tiny.safetensors --where model.l",
           "COMP_CWORD": "4"}
    result = subprocess.run([sys.executable, "-m", "treecli"], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, **env})
    assert result.stdout.split() == ["model.layers.0.", "model.layers.1.", "model.layers.2."]  # one level down
    modules = _modules_after("from treecli.cli import main\nmain([])", env)
    assert _heavy(modules) == []


@pytest.mark.parametrize("shell, name", [("bash", "treecli.bash"), ("zsh", "_treecli"), ("fish", "treecli.fish")])
def test_completion_scripts_are_up_to_date(shell, name):
    result = subprocess.run([sys.executable, "-m", "treecli", "--show-completion", shell], capture_output=True,
                            text=True, env={**os.environ, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
    assert result.returncode == 0, result.stderr
    committed = (ROOT / "completions" / name).read_text()
    assert result.stdout == committed, f"completions/{name} is stale: run `bash completions/generate.sh`"


def test_the_console_script_and_module_entry_points_work():
    result = subprocess.run([sys.executable, "-m", "treecli", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("treecli ")


def test_the_process_ends_at_once_with_its_output_complete_and_its_exit_code(tmp_path):
    """The CLI process exits without the interpreter's teardown (freeing a big tree object by
    object took 0.15-0.3 s of a 200k-tensor show): what it printed to a file is all there,
    and the exit code is the command's."""
    import numpy as np
    from safetensors.numpy import save_file

    from .conftest import run_cli

    path = tmp_path / "many.safetensors"
    save_file({f"layers.{i}.w": np.zeros(2, np.float32) for i in range(3000)}, str(path))
    printed = tmp_path / "out.txt"
    with open(printed, "w") as stdout:
        result = subprocess.run([sys.executable, "-m", "treecli", "show", str(path), "--flat"], stdout=stdout,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert result.returncode == 0 and result.stderr == ""
    assert printed.read_text() == run_cli("show", path, "--flat").stdout
    missing = subprocess.run([sys.executable, "-m", "treecli", "show", str(tmp_path / "none.safetensors")],
                             capture_output=True, text=True, cwd=ROOT)
    assert missing.returncode == 2 and missing.stderr.startswith("treecli: error:")


def test_diff_of_equal_safetensors_files_compares_bytes_without_numpy(tmp_path):
    """Equal files (the common question: did this conversion change anything?) are compared
    byte for byte without importing NumPy (60 ms of a 0.26 s diff of 1 GiB); a difference
    brings it in, for the max abs / rel difference."""
    import numpy as np
    from safetensors.numpy import save_file

    a = {"w": np.arange(3 * 1024 * 1024 + 3, dtype=np.float32), "b": np.ones(5, np.float16)}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(a, str(tmp_path / "same.safetensors"))
    a["w"][-1] += 1
    save_file(a, str(tmp_path / "other.safetensors"))
    for other, code, numpy_loaded in (("same", 0, False), ("other", 1, True)):
        script = (f"from treecli.cli import main\n"
                  f"assert main(['diff', {str(tmp_path / 'a.safetensors')!r}, {str(tmp_path / other)!r} + "
                  f"'.safetensors']) == {code}")
        modules = _modules_after(script)
        assert "treecli._diff" in modules
        assert ("numpy" in modules) == numpy_loaded, other


@pytest.mark.parametrize("args", [["show", "--help"], ["merge", "-h"], ["slice", "--help"], ["--debug", "get", "--help"],
                                  ["average"], ["diff", "a"], ["convert", "a", "b", "--bogus"]])
def test_a_command_run_alone_says_what_the_whole_app_says(args, capsys):
    """A run lays out only the command it names (the whole app's layout was 14 ms of a 90 ms
    `show`): its help, usage errors and exit codes are the whole app's."""
    from treecli.cli import _run_app, app

    code = _run_app(args)
    alone = capsys.readouterr()
    try:
        whole_code = app(args=args, prog_name="treecli", standalone_mode=False)
    except SystemExit as e:
        whole_code = e.code
    except Exception as e:  # a usage error, as the error boundary would print it
        import sys

        whole_code = 2
        sys.stderr.write(f"treecli: error: {e.format_message()}\n")
    whole = capsys.readouterr()
    assert (code, alone.out, alone.err) == (whole_code or 0, whole.out, whole.err)


def test_zsh_keeps_the_apostrophes_of_descriptions():
    """Typer writes "mergekit's" as 'mergekit''s' inside single quotes: zsh reads that as
    "mergekits" unless the script sets RC_QUOTES for its eval, as ours does."""
    import shutil

    script = (ROOT / "completions" / "_treecli").read_text()
    function = script[script.index("_treecli_completion() {"):script.index("}")]
    assert function.index("setopt local_options rc_quotes") < function.index("eval")
    zsh = shutil.which("zsh")
    if zsh is None:
        pytest.skip("zsh is not installed")
    env = {**os.environ, "_TREECLI_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": "treecli "}
    generated = subprocess.run([sys.executable, "-m", "treecli"], capture_output=True, text=True, env=env).stdout
    # _arguments replaced by print: what zsh makes of the words the script evals
    shown = subprocess.run([zsh, "-fc", "setopt local_options rc_quotes; _arguments() { print -r -- \"$@\" }; "
                            f"eval $(print -r -- {shlex.quote(generated)})"], capture_output=True, text=True).stdout
    assert "mergekit's" in shown, shown


def test_the_public_api_is_visible_to_type_checkers_and_stays_lazy():
    """``__init__``'s TYPE_CHECKING block names exactly what it exports lazily, and the
    package says it is typed (py.typed, installed with it)."""
    import ast
    import importlib.resources

    import treecli

    tree = ast.parse((ROOT / "treecli" / "__init__.py").read_text())
    checking = next(node for node in tree.body
                    if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    typed = {alias.asname for node in checking.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert typed == set(treecli._EXPORTS)
    assert importlib.resources.files("treecli").joinpath("py.typed").is_file()
    assert treecli.Checkpoint.__name__ == "Checkpoint"
    modules = _modules_after("import treecli")
    assert not any(name.startswith("treecli.") for name in modules), sorted(modules)


TINY = str(ROOT / "examples" / "tiny.safetensors")


@pytest.mark.parametrize("args", [
    ["show", TINY], ["show", TINY, "--json"],
    ["slice", TINY, "--index", "0", "--dry-run"], ["slice", TINY, "--index", "model.layers.*.**=:2", "--dry-run"],
    ["edit", TINY, "--scale", "**=2", "--cast", "model.norm.weight=bfloat16", "--rename", "lm_head.weight=head",
     "--delete", "step", "--dry-run"],
    ["diff", TINY, TINY], ["get", TINY, "model.layers.0.mlp.up_proj.weight", "--help"],
    *[[command, "--help"] for command in ("show", "slice", "average", "merge", "edit", "diff", "convert", "get")],
])
def test_every_command_plans_and_starts_as_show_does(args):
    """What a command imports before it reads data is what show imports: no NumPy, jax or
    orbax to parse, plan or print a dry run (NumPy comes with the first array computed)."""
    modules = _modules_after(f"from treecli.cli import main\nmain({args!r})")
    assert _heavy(modules) == [] and "numpy" not in modules, sorted(m for m in modules if "numpy" in m)[:3]
